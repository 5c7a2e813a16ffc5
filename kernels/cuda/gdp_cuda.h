/*
 * gdp_cuda.h -- C-callable entry points of the CUDA kernels (plain C header: included
 * by core/src/backend_cuda.c, which is compiled by the C compiler, and by the .cu files).
 *
 * GDP operator: see ../gdp_problem.h for layouts.  Buffers are device addresses;
 * `stream` is a cudaStream_t passed as void* so that C callers need no CUDA headers.
 * Work is queued on the stream; errors found at launch return GDP_ERR_CUDA with the
 * message set, asynchronous ones surface at the next gdp_ctx_sync().
 */
#ifndef GDP_KERNELS_CUDA_GDP_H
#define GDP_KERNELS_CUDA_GDP_H

#include "gdp.h"
#include "../gdp_problem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The library's entry points (gdp/dispatch.cu): the fast chunked path (bf16, n = 1..8,
 * K <= 128, V <= 256) or the recurrent kernels, by the problem and its algorithm
 * (AUTO, CHUNK, RECURRENT; the table there).  A problem's chunk_size is 0 or the fast
 * path's own chunk (32, 64, 48, 64, 40, 48, 56, 64 steps for n = 1..8), else
 * GDP_ERR_INVALID_ARG; its
 * value_block 0 or 16, 32, 64. */
gdp_status gdp_cuda_delta_product_forward(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                                void *stream);
gdp_status gdp_cuda_delta_product_backward(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                                 void *stream);

/* dh0 alone (io's dq, dk, dv, dbeta, dg NULL): the fast path's prep and state-gradient
 * pass only.  _takes: 1 for the problems it runs (the fast path without shape
 * rewrites), else 0 with no error set. */
int gdp_cuda_delta_product_dh0_takes(const gdp_delta_product_problem *p);
gdp_status gdp_cuda_delta_product_backward_dh0(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                                               void *stream);

/* Save for backward.  gdp_cuda_delta_product_save_plan: the path that runs p (a code: 1 recurrent,
 * 3 fast; the same choice as the entry points above) and the device bytes its forward
 * keeps for the backward (0: that path keeps nothing and its backward recomputes).
 * gdp_cuda_delta_product_forward_ex: the forward; saved non-NULL (a block of those bytes on the
 * stream's device, 128-byte aligned) keeps what the backward needs there.
 * gdp_cuda_delta_product_backward_ex: the backward; saved_variant is the forward's path code
 * (GDP_ERR_INVALID_ARG when this call would choose another path), saved its block or
 * NULL (recompute).  The block belongs to the very inputs of the forward (not checked). */
gdp_status gdp_cuda_delta_product_save_plan(const gdp_delta_product_problem *p, int *variant, size_t *bytes);
gdp_status gdp_cuda_delta_product_forward_ex(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io, void *stream,
                                   void *saved);
gdp_status gdp_cuda_delta_product_backward_ex(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, void *stream,
                                    int saved_variant, const void *saved);

/* The name of the path the entry points above run p on ("fast chunked" or "recurrent"),
 * by the same choice, or NULL where they would refuse it; sets no error. */
const char *gdp_cuda_delta_product_path(const gdp_delta_product_problem *p);

/* 1 when the CUDA kernels handle this problem (sizes, dtype), else 0 with no error. */
int gdp_cuda_delta_product_supported(const gdp_delta_product_problem *p);

#ifdef __cplusplus
}
#endif

#endif
