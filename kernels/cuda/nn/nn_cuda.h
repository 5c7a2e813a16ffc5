/*
 * nn_cuda.h -- C-callable launchers of the CUDA model layer kernels (the SwiGLU gate,
 * the embedding gather and its backward, the cross-entropy), for
 * core/src/backend_cuda.c.  Plain C.
 *
 * Buffers are contiguous, row-major, on the device, of one gdp_dtype `dtype`: f64
 * (float64 math), f32 or bf16 (float32 math: bf16 values widened on load, rounded once
 * on store), with the semantics of the CPU kernels (kernels/cpu/nn_cpu.h,
 * ../../nn_problem.h).  No floating-point value is added with atomics (the integer
 * counts and the first-bad-position words are, exactly): a call repeats bit for bit.
 *
 * Everything is queued on `stream` (a cudaStream_t); the return value reports launch
 * errors (GDP_ERR_CUDA, message set); asynchronous faults surface at the next
 * synchronisation.  Workspaces are allocated by the caller (the *_workspace sizes) and
 * may be freed, stream-ordered, right after the call.
 */
#ifndef GDP_KERNELS_CUDA_NN_H
#define GDP_KERNELS_CUDA_NN_H

#include <stddef.h>
#include <stdint.h>

#include "gdp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out = silu(gate) * up; backward d_gate, d_up (either may be NULL). */
gdp_status gdp_cuda_silu_mul_fwd(int dtype, int64_t n, const void *gate, const void *up,
                                 void *out, void *stream);
gdp_status gdp_cuda_silu_mul_bwd(int dtype, int64_t n, const void *gate, const void *up,
                                 const void *d_out, void *d_gate, void *d_up, void *stream);

/* Integer inputs (token ids, targets) are device buffers of int32 or int64 (ids_dtype,
 * a gdp_dtype), read unvalidated: a value out of range is never used as an address,
 * and the first position holding one goes to *first_bad, a device word the caller sets
 * to UINT64_MAX (all bits) beforehand.  gdp_cuda_index_fault then writes the verdict,
 * slot[0] = that position (-1: none) and slot[1] = the value there, into slot (device
 * memory, or mapped pinned host memory: then the host reads it after its next wait). */
gdp_status gdp_cuda_index_fault(const unsigned long long *first_bad, const void *ids,
                                int ids_dtype, int64_t *slot, void *stream);

/* out[i,:] = weight[ids[i],:] over n tokens of D values, ids in [0, V). */
gdp_status gdp_cuda_embedding_fwd(int dtype, int64_t n, int64_t D, int64_t V, const void *ids,
                                  int ids_dtype, const void *weight, void *out,
                                  unsigned long long *first_bad, void *stream);

/* The backward groups the token positions by id on the device (a stable sort) and cuts
 * each vocabulary row's list into segments of at most GDP_CUDA_EMBED_SEGMENT tokens, so
 * that a frequent token does not leave one block with all the work.  dweight [V,D]
 * (float64 for f64 d_out, else float32): pass 1 sums each segment's rows of d_out in
 * token order, pass 2 each vocabulary row's segments in order.  The workspace
 * (gdp_cuda_embedding_bwd_workspace bytes; 0: the size query failed) holds the sort,
 * the tables and the segments' sums.  V < 2^32 - 1. */
enum { GDP_CUDA_EMBED_SEGMENT = 256 };
size_t gdp_cuda_embedding_bwd_workspace(int dtype, int64_t n, int64_t V, int64_t D);
gdp_status gdp_cuda_embedding_bwd(int dtype, int64_t n, int64_t V, int64_t D, const void *ids,
                                  int ids_dtype, const void *d_out, void *dweight,
                                  void *workspace, unsigned long long *first_bad, void *stream);

/* The cross-entropy's bookkeeping on the device: the counted rows and the first row
 * whose counted target is out of range (UINT64_MAX: none; gdp_cuda_index_fault's word). */
typedef struct gdp_cuda_xent_result {
  int64_t count;
  unsigned long long first_bad;
} gdp_cuda_xent_result;

/* Cross-entropy over rows x V against targets [rows] (ids_dtype) and mask (NULL, or
 * float64 [rows]: rows where it is 0 do not count, nor rows whose target is
 * ignore_index): the row losses and the classes into the workspace, their sum in a
 * fixed order times 1 / count into result[0] (0 when no row counts), the count into
 * result[1] (two device doubles); dlogits (may be NULL) = (softmax - onehot) / count on
 * counted rows, zero on the others.  res is cleared by the call. */
size_t gdp_cuda_cross_entropy_workspace(int64_t rows);
gdp_status gdp_cuda_cross_entropy(int dtype, int64_t rows, int64_t V, const void *targets,
                                  int targets_dtype, const double *mask, int64_t ignore_index,
                                  const void *logits, void *dlogits, gdp_cuda_xent_result *res,
                                  double *result, void *workspace, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* GDP_KERNELS_CUDA_NN_H */
