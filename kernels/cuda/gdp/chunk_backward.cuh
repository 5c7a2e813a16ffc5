/*
 * chunk_backward.cuh -- the fast path's backward: what its kernels share (docs/kernels.md
 * §3.4, §3.5).
 *
 * Steps (the chunk algebra is in plan.cuh):
 *  1. recompute the per-chunk panels with the forward's prep (chunk_prep.cuh), which here
 *     also stores T^T = ((I + A)^-1)^T (bf16) for step 5;
 *  2. chunk_state_recompute_kernel: the forward state pass (S^T float32 in registers for the
 *     whole sequence) without the output products; per chunk it stores h = S at the
 *     chunk start (bf16, transposed [V][K]) and D = U - W h (bf16 [C][V] per (chunk, head));
 *  3. chunk_dstate_kernel: the reverse state-gradient pass, dH^T float32 in registers:
 *        dD^T = dO^T Pm + dH^T Kd^T,    dH^T <- e^{last} dH^T + dO^T Qd - dD^T W,
 *     storing dH (gradient of the chunk-end state; bf16, transposed) and dD (bf16) per
 *     chunk, and dh0 at the end;
 *  4. chunk_grad_state_kernel: the per-chunk gradient terms that need the K x V matrices
 *     (dq final; dKnA, dWg, dgcA partials), from h and dH;
 *  5. chunk_grad_wy_kernel: the WY part (dT, dA; T from step 1): dk, dv, dbeta, dg final.
 *
 * The layout argument is the forward's (chunk_state_pass.cuh): with everything transposed the
 * value columns x are the M side of every product, so a float32 accumulator fragment
 * (row x, column pair along the second index), rounded to bf16, is exactly the A
 * fragment of the next product: dH^T and dD^T never leave registers.  dO enters as A
 * fragments of dO^T by ldmatrix.trans from its row-major [token][x] rows; only the TC
 * query rows of a chunk are read (dO is zero on the other steps).
 */
#ifndef GDP_KERNELS_CUDA_GDP_CHUNK_BACKWARD_CUH
#define GDP_KERNELS_CUDA_GDP_CHUNK_BACKWARD_CUH

#include "fragments.cuh"

namespace gdpcu {
namespace chunked_backward {

/* the state passes' staging (fragments.cuh) */
using chunked::HtStage;
using chunked::stage_dfrags;
using chunked::stage_hT16_half;
using chunked::copy_panel_full;
using chunked::copy_panel;
using chunked::row_l2_inv;
using chunked::neg_u_from_tu_v;
using chunked::neg_u_from_panel;

constexpr int kStages = 3; /* chunk panels in flight: current + next two */
constexpr int kPad = 8;    /* bf16 elements (16 bytes) of padding per shared row */

/* Side buffers of the per-chunk gradient kernels (per (chunk, head) CHi): hT16, dHT16
 * bf16 [V][K] (h^T and dH^T, written by the two sequential kernels or kept by a saving
 * forward), the state part's outputs for the WY part: dKnA [C][K] bf16 (packed: slice CHi
 * at element CHi C K of a bf16 view of the buffer, which is sized for float32), dWg [C][K]
 * bf16, dgcA [C] float, and Tt [C][C] bf16: T^T = ((I + A)^-1)^T, written by the prep.
 * dKnA is one of the four terms of dKn (dk's only input), rounded once; the other three
 * are float32 sums in grad_wy's registers.  In bf16 rather than float32 it halves the
 * bytes grad_state writes and grad_wy reads back (H200, 4 x 4096 n = 2: DRAM written by
 * grad_state 454 -> 323 MB, read by grad_wy 1.16 -> 0.93 GB; dk's errors +0.2..0.6e-3,
 * every other output bit-identical). */
struct GradStateOut {
  bf16 *hT16, *dHT16;
  float *dKnA;
  bf16 *dWg;
  float *dgcA;
  bf16 *Tt;
};

/* ------------------------------------------------------------------ PTX wrappers: fragments.cuh */


/* Accumulator tiles X[2kt], X[2kt+1] (16 rows x 16 columns, float) -> the bf16 A
 * fragment of k-tile kt, times `sign` (exact: a sign flip commutes with rounding). */
template <int NK>
__device__ __forceinline__ void to_afrag(const float (&X)[2 * NK][4], uint32_t (&A)[NK][4], float sign) {
#pragma unroll
  for (int kt = 0; kt < NK; kt++) {
    A[kt][0] = pack_bf16(sign * X[2 * kt][0], sign * X[2 * kt][1]);
    A[kt][1] = pack_bf16(sign * X[2 * kt][2], sign * X[2 * kt][3]);
    A[kt][2] = pack_bf16(sign * X[2 * kt + 1][0], sign * X[2 * kt + 1][1]);
    A[kt][3] = pack_bf16(sign * X[2 * kt + 1][2], sign * X[2 * kt + 1][3]);
  }
}

/* The A fragment of k tile kt from accumulator tiles X[2kt], X[2kt+1], times sign. */
template <int NT2>
__device__ __forceinline__ void afrag_kt(const float (&X)[NT2][4], int kt, uint32_t (&A)[4], float sign) {
  A[0] = pack_bf16(sign * X[2 * kt][0], sign * X[2 * kt][1]);
  A[1] = pack_bf16(sign * X[2 * kt][2], sign * X[2 * kt][3]);
  A[2] = pack_bf16(sign * X[2 * kt + 1][0], sign * X[2 * kt + 1][1]);
  A[3] = pack_bf16(sign * X[2 * kt + 1][2], sign * X[2 * kt + 1][3]);
}

/* Pull `bytes` (a multiple of 16, 16-byte aligned) into L2 with one bulk-copy-engine
 * request: no register result, nothing waits on it. */
__device__ __forceinline__ void prefetch_l2_bulk(const void *p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

}  // namespace chunked_backward
}  // namespace gdpcu

#endif
