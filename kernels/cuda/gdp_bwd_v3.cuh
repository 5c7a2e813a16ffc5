/*
 * gdp_bwd_v3.cuh -- variant 3 of the chunked GDP backward: the library's bf16 path for
 * n = 1..3, K and V in {64, 128} (gdp_dispatch.cu).  See kernels/cuda/NOTES.md,
 * "Variant 3 backward".
 */
#ifndef GDP_KERNELS_CUDA_BWD_V3_CUH
#define GDP_KERNELS_CUDA_BWD_V3_CUH

#include "gdp_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when variant 3's backward takes this problem: bf16, n = 1..3, K and V in {64, 128}
 * (the problems variant 3's forward takes with its own prep). */
int gdp_cuda_gdp_backward_v3_supported(const gdp_gdp_problem *p);

/* Same contract as gdp_cuda_gdp_backward.  Recompute with variant 3's prep and a
 * register-resident state pass that stores the chunk states (float32), the reverse
 * state-gradient pass with dS in float32 registers, then the two v3 per-chunk gradient
 * kernels (state part, WY part; GDP_CUDA_V3_GRAD=v2: variant 2's kernel instead).
 * GDP_ERR_UNSUPPORTED outside the problems above. */
gdp_status gdp_cuda_gdp_backward_v3(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io, void *stream);

/* Same, reading the block a gdp_cuda_gdp_forward_v3_save of the same problem and inputs
 * kept (chunk tables and panels, h^T, D): the prep and the state pass are not run again.
 * saved NULL (or GDP_CUDA_V3_GRAD=v2, whose kernel needs bf16 h and dH): recompute. */
gdp_status gdp_cuda_gdp_backward_v3_saved(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io, void *stream,
                                          const void *saved);
/* Same, reading the kept states in the format given (state16: 1 bf16, 0 float32), the
 * one the saved forward wrote; gdp_cuda_gdp_backward_v3_saved takes this process's
 * (gdpcu::v3::state16, fixed per process).  The dispatch passes the format it recorded
 * in the saved object. */
gdp_status gdp_cuda_gdp_backward_v3_saved_fmt(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io, void *stream,
                                              const void *saved, int state16);

#ifdef __cplusplus
}
#endif

#endif
