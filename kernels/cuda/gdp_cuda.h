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

/* The library's entry points (gdp_dispatch.cu): pick a variant for the problem and
 * its algorithm (AUTO, CHUNK, RECURRENT), see the table there. */
gdp_status gdp_cuda_gdp_forward(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io,
                                void *stream);
gdp_status gdp_cuda_gdp_backward(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io,
                                 void *stream);

/* The variants themselves (same contracts; the lab calls them directly).  Each returns
 * GDP_ERR_UNSUPPORTED for a problem it does not take.  Variant 3's entry points are in
 * gdp_fwd_v3.cuh and gdp_bwd_v3.cuh. */
gdp_status gdp_cuda_gdp_forward_recurrent(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io,
                                          void *stream);
gdp_status gdp_cuda_gdp_backward_recurrent(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io,
                                           void *stream);
gdp_status gdp_cuda_gdp_forward_v2(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io,
                                   void *stream);
gdp_status gdp_cuda_gdp_backward_v2(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io,
                                    void *stream);
/* 1 when the CUDA kernels handle this problem (sizes, dtype), else 0 with no error. */
int gdp_cuda_gdp_supported(const gdp_gdp_problem *p);

#ifdef __cplusplus
}
#endif

#endif
