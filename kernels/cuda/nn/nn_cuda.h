/*
 * nn_cuda.h -- C-callable launchers of the CUDA model layer kernels (the SwiGLU gate,
 * the embedding gather and its backward, the cross-entropy), for
 * core/src/backend_cuda.c.  Plain C.
 *
 * Buffers are contiguous, row-major, on the device, of one gdp_dtype `dtype`: f64
 * (float64 math), f32 or bf16 (float32 math: bf16 values widened on load, rounded once
 * on store), with the semantics of the CPU kernels (kernels/cpu/nn_cpu.h,
 * ../../nn_problem.h).  Index arrays are device copies of the problem's host arrays,
 * made by the caller.  Nothing uses atomics: a call repeats bit for bit.
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

/* out[i,:] = weight[tokens[i],:] over n tokens of D values. */
gdp_status gdp_cuda_embedding_fwd(int dtype, int64_t n, int64_t D, const int64_t *tokens,
                                  const void *weight, void *out, void *stream);

/* The backward's segments: each vocabulary row's token list (row_tokens[row_start[v] ..
 * row_start[v+1])) cut into pieces of at most GDP_CUDA_EMBED_SEGMENT tokens, so that a
 * frequent token does not leave one block with all the work.  seg_first[v] .. seg_first[v+1]
 * are row v's segments (host arrays filled by gdp_cuda_embedding_segments; seg_row
 * has seg_first[V] entries). */
enum { GDP_CUDA_EMBED_SEGMENT = 256 };
int64_t gdp_cuda_embedding_segment_count(int64_t V, const int64_t *row_start);
void gdp_cuda_embedding_segments(int64_t V, const int64_t *row_start, int64_t *seg_first,
                                 int64_t *seg_row);
size_t gdp_cuda_embedding_bwd_workspace(int dtype, int64_t segments, int64_t D);
/* dweight [V,D] (float64 for f64 d_out, else float32): pass 1 sums each segment's rows
 * of d_out in token order, pass 2 each vocabulary row's segments in order. */
gdp_status gdp_cuda_embedding_bwd(int dtype, int64_t V, int64_t D, const int64_t *row_start,
                                  const int64_t *row_tokens, const int64_t *seg_first,
                                  const int64_t *seg_row, int64_t segments, const void *d_out,
                                  void *dweight, void *workspace, void *stream);

/* Cross-entropy over rows x V: row losses into the workspace, then their sum in a fixed
 * order into *loss_sum_dev (a device double); dlogits (may be NULL) = scale (softmax -
 * onehot) on rows with target >= 0, zero on the others. */
size_t gdp_cuda_cross_entropy_workspace(int64_t rows);
gdp_status gdp_cuda_cross_entropy(int dtype, int64_t rows, int64_t V, const int64_t *target,
                                  double scale, const void *logits, void *dlogits,
                                  double *loss_sum_dev, void *workspace, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* GDP_KERNELS_CUDA_NN_H */
