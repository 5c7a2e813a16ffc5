/*
 * gdp_fwd_v3.cuh -- variant 3 of the chunked GDP forward: the library's bf16 path for
 * n = 1..3, K and V in {64, 128} (gdp_dispatch.cu).  See kernels/cuda/NOTES.md,
 * "Variant 3".
 */
#ifndef GDP_KERNELS_CUDA_FWD_V3_CUH
#define GDP_KERNELS_CUDA_FWD_V3_CUH

#include "gdp_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when variant 3 takes this problem: bf16, n = 1..3, K in {64, 128}, and V in
 * {64, 128} with its own prep (new_prep = 1), or V a multiple of 16 up to 128 with
 * variant 2's prep (new_prep = 0). */
int gdp_cuda_gdp_forward_v3_supported(const gdp_gdp_problem *p, int new_prep);

/* Same contract as gdp_cuda_gdp_forward.  new_prep = 1: variant 3's prep kernel, else
 * variant 2's chunk_prep_kernel; then the register-resident state pass of variant 3.
 * GDP_ERR_UNSUPPORTED outside the problems above. */
gdp_status gdp_cuda_gdp_forward_v3(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io, void *stream,
                                   int new_prep);

/* Save for backward.  gdp_cuda_gdp_v3_saved_bytes: the device bytes a forward of p keeps
 * for its backward (0: variant 3 does not take p).  gdp_cuda_gdp_forward_v3_save: the
 * forward (new prep), leaving in `saved` (that many bytes, on the stream's device, 128-byte
 * aligned) the chunk tables and panels, h^T (float32) and D (bf16) of every chunk, which
 * gdp_cuda_gdp_backward_v3_saved (gdp_bwd_v3.cuh) reads instead of recomputing them. */
size_t gdp_cuda_gdp_v3_saved_bytes(const gdp_gdp_problem *p);
gdp_status gdp_cuda_gdp_forward_v3_save(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io, void *stream,
                                        void *saved);

#ifdef __cplusplus
}

namespace gdpcu {
namespace v3 {
/* Layout of the kept block (bytes): the forward plan's block (plan_bytes: chunk tables,
 * W, U, Kd, Qd, Pm, elast) from 0, h^T [CH][V][K] from o_hT (float32, or bf16 when
 * state16), D bf16 [CH][C][V] from o_D, T^T bf16 [CH][C][C] (the prep's, for grad_wy)
 * from o_Tt; CH = chunks x heads. */
struct SavedLayout {
  size_t plan, o_hT, o_D, o_Tt, total;
};
SavedLayout saved_layout(const gdp_gdp_problem *p, bool state16);
/* The format of the chunk states that travel between the v3 kernels (h^T, dH^T: the
 * state passes write them, grad_state reads them): bf16 when GDP_CUDA_V3_STATE=bf16 and
 * the problem is bf16, else float32.  The variable is read once per process, so a saved
 * forward, its saved_bytes and its backward always agree (the dispatch also records the
 * format in the saved object's variant code, gdp_dispatch.cu).  Every use of the stored
 * copies but one is a bf16 tensor-core operand, rounded the same way (round to nearest)
 * either way; the exception is grad_state's <dH, h> (gate gradient), which then reads
 * the rounded values (kernels/cuda/NOTES.md, "bf16 chunk states"). */
bool state16(const gdp_gdp_problem *p);
bool keep_u_residual();
/* GDP_CUDA_V3_U: unset or tv = the state passes form U = Tu V themselves (GdpArgs::Tu),
 * =panel = U through memory (gdp_fwd_v3.cu). */
bool u_from_tv();
/* GdpArgs::d_residual for the state passes that feed the gradients (opt-in: GDP_CUDA_V3_DLO=1). */
bool keep_d_residual();
}  // namespace v3
}  // namespace gdpcu
#endif

#endif
