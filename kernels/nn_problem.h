/*
 * nn_problem.h -- the model layer ops (gdp.h, "model layer ops") as the kernels see
 * them: plain sizes, index arrays, raw pointers to contiguous row-major buffers of one
 * dtype.  Shared by the op layer, the backend table and the kernels of every device.
 *
 * Integer inputs reach a backend in one of two forms (backend_impl.h, device_indices):
 * host arrays built and validated by the op layer (core/src/op_nn.c: the cpu), or the
 * caller's values as a contiguous int32/int64 buffer on the device (`ids`), which the
 * backend validates there and answers in `fault`: the first flat position whose value
 * is out of range and that value (at = -1: none), for the op layer's message.
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
 */
#ifndef GDP_KERNELS_NN_PROBLEM_H
#define GDP_KERNELS_NN_PROBLEM_H

#include <stdint.h>

typedef struct gdp_index_fault {
  int64_t at, value;
} gdp_index_fault;

typedef struct gdp_embedding_problem {
  int64_t n, V, D;
  const int64_t *tokens;     /* host [n] (host-index backends) */
  const int64_t *row_start;  /* host [V+1], backward only (else NULL) */
  const int64_t *row_tokens; /* host [n], backward only (else NULL) */
  const void *ids;           /* device [n] of ids_dtype (device-index backends) */
  int ids_dtype;
  gdp_index_fault *fault;    /* device-index backends: out */
  int num_threads;           /* CPU worker threads */
  int dtype;                 /* gdp_dtype of weight/out/d_out (dweight: float32 for bf16) */
} gdp_embedding_problem;

typedef struct gdp_cross_entropy_problem {
  int64_t rows, V;
  const int64_t *target; /* host [rows]: the class, or -1 (not counted) */
  double scale;          /* dlogits factor: 1 / counted rows, 0 when none */
  /* Device-index backends instead: the targets [rows] (ids_dtype), the mask (NULL or
   * float64 [rows]) and ignore_index as given; out: the counted rows, the fault. */
  const void *ids;
  int ids_dtype;
  const double *mask;
  int64_t ignore_index;
  int64_t *count;
  gdp_index_fault *fault;
  int num_threads;
  int dtype;             /* gdp_dtype of logits and dlogits */
} gdp_cross_entropy_problem;

#endif /* GDP_KERNELS_NN_PROBLEM_H */
