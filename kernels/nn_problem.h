/*
 * nn_problem.h -- the model layer ops (gdp.h, "model layer ops") as the kernels see
 * them: plain sizes, index arrays, raw pointers to contiguous row-major buffers of one
 * dtype.  Shared by the op layer, the backend table and the kernels of every device.
 *
 * Integer inputs reach a backend in one of two forms (backend_impl.h, device_indices):
 * host arrays built and validated by the op layer (core/src/op_nn.c: the cpu), or the
 * caller's values as a contiguous int32/int64 buffer on the device (`ids`), which the
 * backend validates there and answers through `check`: for the first flat position
 * whose value is out of range it calls check->report(check, at, value), the op layer's
 * message.  It may answer later than the op returns (cuda: at its next wait on the
 * device, so that a check costs no wait of its own), so it keeps its own copy of the
 * struct, whose fields are all values.
 *
 * Embedding: weight, dweight [V,D]; out, d_out [n,D].  tokens[i] in [0, V) is row i's
 * vocabulary row.  The backward reads the tokens bucketed by vocabulary row (a stable
 * counting sort, so that every device sums a row's gradients in token order):
 * row_tokens[row_start[v] .. row_start[v+1]) are the positions i with tokens[i] == v,
 * increasing.
 *
 * Cross-entropy: logits, dlogits [rows,V]; target[r] in [0, V), or -1 for a row that
 * does not count (ignored or masked).  scale = 1 / (counted rows) (0 when none count):
 * dlogits = scale (softmax - onehot) on counted rows, 0 elsewhere.  A device-index
 * backend derives target, the count and scale itself, and checks only counted rows.
 * The result is two doubles in the backend's memory: the mean loss (loss sum x scale)
 * and the counted rows.
 */
#ifndef GDP_KERNELS_NN_PROBLEM_H
#define GDP_KERNELS_NN_PROBLEM_H

#include <stdint.h>

#include "gdp.h"

typedef struct gdp_index_check gdp_index_check;
struct gdp_index_check {
  /* The error for the value `value` at flat position `at`. */
  gdp_status (*report)(const gdp_index_check *c, int64_t at, int64_t value);
  const char *func;             /* the op (a static string) */
  int64_t V, ignore_index;      /* the valid range [0, V); cross-entropy's ignore_index */
  int ndim;                     /* the index tensor's shape, for the position's message */
  int64_t shape[GDP_MAX_DIMS];
  /* a permuted view of a contiguous block (a transpose, as CausalLM makes): its dims in
   * the viewed tensor's order, so that the message names that tensor's position too;
   * base[0] = -1 otherwise */
  int base[GDP_MAX_DIMS];
};

typedef struct gdp_embedding_problem {
  int64_t n, V, D;
  const int64_t *tokens;     /* host [n] (host-index backends) */
  const int64_t *row_start;  /* host [V+1], backward only (else NULL) */
  const int64_t *row_tokens; /* host [n], backward only (else NULL) */
  const void *ids;           /* device [n] of ids_dtype (device-index backends) */
  int ids_dtype;
  const gdp_index_check *check; /* device-index backends */
  int num_threads;           /* CPU worker threads */
  int dtype;                 /* gdp_dtype of weight/out/d_out (dweight: float32 for bf16) */
} gdp_embedding_problem;

typedef struct gdp_cross_entropy_problem {
  int64_t rows, V;
  const int64_t *target; /* host [rows]: the class, or -1 (not counted) */
  double scale;          /* dlogits factor: 1 / counted rows, 0 when none */
  int64_t counted;       /* host [rows]' counted rows */
  /* Device-index backends instead: the targets [rows] (ids_dtype), the mask (NULL or
   * float64 [rows]) and ignore_index as given, and the check of the counted ones. */
  const void *ids;
  int ids_dtype;
  const double *mask;
  int64_t ignore_index;
  const gdp_index_check *check;
  int num_threads;
  int dtype;             /* gdp_dtype of logits and dlogits */
} gdp_cross_entropy_problem;

#endif /* GDP_KERNELS_NN_PROBLEM_H */
