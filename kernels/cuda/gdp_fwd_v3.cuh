/*
 * gdp_fwd_v3.cuh -- the fast chunked path's internal interface (bf16, n = 1..3, K and V
 * in {64, 128}): forward (gdp_fwd_v3.cu), backward (gdp_bwd_v3.cu), and what the
 * dispatch (gdp_dispatch.cu) asks of them.  See kernels/cuda/NOTES.md.
 */
#ifndef GDP_KERNELS_CUDA_FWD_V3_CUH
#define GDP_KERNELS_CUDA_FWD_V3_CUH

#include "gdp_chunk.cuh"

namespace gdpcu {
namespace v3 {

/* Whether the fast path takes p: bf16, n = 1..3, K and V in {64, 128}. */
bool takes(const gdp_gdp_problem *p);

/* Layout of the block a saving forward keeps (bytes): the forward plan's block
 * (plan_bytes: chunk tables, W, U, Kd, Qd, Pm, elast) from 0, h^T bf16 [CH][V][K] from
 * o_hT, D bf16 [CH][C][V] from o_D, T^T bf16 [CH][C][C] (the prep's, for grad_wy) from
 * o_Tt; CH = chunks x heads.  The chunk states travel in bf16: every use of them but one
 * is a bf16 tensor-core operand, rounded the same way either way; the exception is
 * grad_state's <dH, h> (gate gradient), which reads the rounded values (NOTES.md "bf16
 * chunk states": saving fwd+bwd at 4x4096 n=2 2.52 -> 2.33 ms, errors unchanged). */
struct SavedLayout {
  size_t plan, o_hT, o_D, o_Tt, total;
};
SavedLayout saved_layout(const gdp_gdp_problem *p);
/* saved_layout(p).total; 0 where the path does not take p or there is no sequence. */
size_t saved_bytes(const gdp_gdp_problem *p);

/* The forward and backward; p and io validated, takes(p).  forward: saved non-NULL keeps
 * the block above there.  backward: saved non-NULL reads a saving forward's block of the
 * same problem and inputs instead of recomputing (the prep and the states pass). */
gdp_status forward(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io, cudaStream_t stream, void *saved);
gdp_status backward(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io, cudaStream_t stream, const void *saved);

/* The prep (gdp_fwd_v3.cu), also the backward's recompute: Tt non-NULL also stores T^T
 * there (and U's residual where plan.a.Ulo is set). */
gdp_status launch_prep_v3(const Plan &plan, bf16 *Tt);

}  // namespace v3

/* The recurrent kernels (gdp_fwd.cu, gdp_bwd.cu): f32 and bf16, any shape the dispatch
 * validated.  p and io validated. */
gdp_status forward_recurrent(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io, cudaStream_t stream);
gdp_status backward_recurrent(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io, cudaStream_t stream);

}  // namespace gdpcu

#endif
