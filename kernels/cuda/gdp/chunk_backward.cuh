/*
 * chunk_backward.cuh -- the fast path's backward: what its kernels share (kernels/cuda/NOTES.md,
 * "Variant 3 backward").
 *
 * Steps (the chunk algebra is in plan.cuh):
 *  1. recompute the per-chunk panels with the forward's prep (chunk_prep.cuh), which here
 *     also stores T^T = ((I + A)^-1)^T (bf16) for step 5;
 *  2. chunk_state_recompute_kernel: the forward state pass (S^T float32 in registers for the
 *     whole sequence) without the output products; per chunk it stores h = S at the
 *     chunk start (float32, transposed [V][K]) and D = U - W h (bf16, variant 2's layout);
 *  3. chunk_dstate_kernel: the reverse state-gradient pass, dH^T float32 in registers:
 *        dD^T = dO^T Pm + dH^T Kd^T,    dH^T <- e^{last} dH^T + dO^T Qd - dD^T W,
 *     storing dH (gradient of the chunk-end state; float32, transposed) and dD (bf16) per
 *     chunk, and dh0 at the end;
 *  4. chunk_grad_state_kernel: the per-chunk gradient terms that need the K x V matrices
 *     (dq final; dKnA, dWg, dgcA partials), from the float32 h and dH;
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
using chunked::stage_hT32_half;
using chunked::copy_panel_full;
using chunked::copy_panel;
using chunked::row_l2_inv;
using chunked::neg_u_from_tu_v;
using chunked::neg_u_from_panel;
using chunked::copy_panel_sw128;

constexpr int kStages = 3; /* chunk panels in flight: current + next two */
constexpr int kPad = 8;    /* bf16 elements (16 bytes) of padding per shared row */

/* Float32 side buffers of the per-chunk gradient kernel (per (chunk, head) CHi):
 * hT32, dHT32 [V][K] (h^T and dH^T, written by the two sequential kernels), the state
 * part's outputs for the WY part: dKnA [C][K] float, dWg [C][K] bf16, dgcA [C] float, and
 * Tt [C][C] bf16: T^T = ((I + A)^-1)^T, written by the recompute's prep.  With
 * GDP_CUDA_V3_STATE=bf16 (chunked::state16) h^T and dH^T are bf16 (hT16, dHT16; same layout). */
struct GradStateOut {
  float *hT32, *dHT32;
  bf16 *hT16, *dHT16; /* the same in bf16 (GDP_CUDA_V3_STATE=bf16), instead of hT32, dHT32 */
  float *dKnA;
  bf16 *dWg;
  float *dgcA;
  bf16 *Tt;
  /* GDP_CUDA_V3_OVERLAP (E3; NULL otherwise): grad_state runs as dstate's programmatic
   * dependent.  order: the chunk table in grad_state's block order (latest chunk of each
   * sequence first; ChunkInfo::pad = the chunk's index); ready: one counter per (chunk,
   * head), zeroed before dstate, which every dstate block of the chunk's (sequence, head)
   * increments once its dH^T / dD values of the chunk are stored (V / BV in all). */
  const ChunkInfo *order;
  int *ready;
  int ready_target;
  /* GDP_CUDA_V3_PCOL=f32 (lab A/B): dg's P-column sums from the float32 Ps'' (the old way)
   * instead of the bf16-rounded Ps'' that the dq / dKnA products take (default, 0) */
  int pcol_f32;
  /* GDP_CUDA_V3_DKNA: 1 (default, "bf16") = dKnA travels as bf16 (packed: (chunk, head)
   * slice CHi at element CHi C K of a bf16 view, the first half of the float32-sized
   * buffer -- dkna_slice; 128 instead of 256 MB written and read back at 4 x 4096 n = 2), 0 ("f32")
   * = float32 as before.  dKnA is one of the four terms of dKn (dk's only input), rounded
   * once; the other three are float32 sums in grad_wy's registers.  H200, session 8: the
   * lab check's dk errors +0.2..0.6e-3 (worst 5.1e-3; every other error bit-identical),
   * DRAM written by grad_state 454 -> 323 MB, read by grad_wy 1.16 -> 0.93 GB. */
  int dkna16;
  /* GDP_CUDA_V3_WY_PF (lab A/B): grad_wy's early L2 prefetches, a bit mask: 1 = dKnA at
   * the block's start, 2 = dKnA again before W4, 4 = dW at the start where it is copied in
   * late (kLateDW; it is prefetched again before that copy either way).  Default 0, none.
   * H200, session 8, 4 x 4096 n = 2 (ncu): with float32 dKnA and mask 7 grad_wy read 1.16 GB
   * against ~0.98 GB of inputs (lines evicted before their reads, fetched twice -- the
   * reading, not measured apart); with bf16 dKnA mask 7 read 925 MB in 516 us, mask 0
   * 778 MB in 503 us (inputs ~0.72 GB) -- but those runs' dKnA prefetches still used the
   * float32 slice addresses (wrong lines; dkna_slice fixed it afterwards, not re-timed). */
  int wy_pf;
};

/* dKnA's (chunk, head) slice CHi of `elems` values and its bytes, in the format the call
 * uses (GradStateOut::dkna16): slices are packed at their own element size. */
__device__ __forceinline__ uint32_t dkna_bytes(const GradStateOut &go, int elems) {
  return (uint32_t)elems * (go.dkna16 ? 2u : 4u);
}
__device__ __forceinline__ const void *dkna_slice(const GradStateOut &go, int64_t CHi, int elems) {
  return reinterpret_cast<const unsigned char *>(go.dKnA) + CHi * dkna_bytes(go, elems);
}

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

/* The rounding residual of afrag_kt's A = bf16(-X) fragment of k tile kt (sign -1, as the
 * state passes pack D^T): (-X) - A rounded to bf16; the difference is exact in float32,
 * so A + R is -X to ~16 bits.  The same helper is in chunk_state_pass.cuh. */
template <int NT2>
__device__ __forceinline__ void afrag_residual_kt(const float (&X)[NT2][4], int kt, const uint32_t (&A)[4],
                                                  uint32_t (&R)[4]) {
#pragma unroll
  for (int q = 0; q < 4; q++) {
    const float2 a = unpack_bf16(A[q]);
    R[q] = pack_bf16(-X[2 * kt + (q >> 1)][2 * (q & 1)] - a.x, -X[2 * kt + (q >> 1)][2 * (q & 1) + 1] - a.y);
  }
}

/* Store one A fragment (16 x-rows by 16 columns of a transposed matrix M^T) into M's
 * row-major [row][x] layout with row stride V: register q holds M[r0 + 8(q/2) + {0,1}]
 * [x + 8(q%2)] where `base` already points at column x = this lane's grp column and
 * r0 = 16kt + 2tig.  V is a compile-time constant, so every store is the base register
 * plus an immediate offset. */
template <int V>
__device__ __forceinline__ void store_afrag(bf16 *base, int r0, const uint32_t (&A)[4]) {
  bf16 *p = base + r0 * V;
#pragma unroll
  for (int q = 0; q < 4; q++) {
    const __nv_bfloat162 v2 = *reinterpret_cast<const __nv_bfloat162 *>(&A[q]);
    p[(8 * (q >> 1)) * V + 8 * (q & 1)] = v2.x;
    p[(8 * (q >> 1) + 1) * V + 8 * (q & 1)] = v2.y;
  }
}




/* The half-row store of h^T or dH^T in the format S16 picks (hT32 or hT16; `row0` is the
 * element offset of global row xw + 8hf). */
template <int K, int C, bool S16, int WB = HtStage<K, C>::warp_bytes>
__device__ __forceinline__ void store_stateT_half(unsigned char *stage0, float *hT32, bf16 *hT16, int64_t row0,
                                                  const float (&X)[K / 8][4], int hf) {
  if constexpr (S16) stage_hT16_half<K, C, WB>(stage0, hT16 + row0, X, hf);
  else stage_hT32_half<K, C>(stage0, hT32 + row0, X, hf);
}


/* copy_panel (rows >= valid zero-filled): fragments.cuh */


/* Pull `bytes` (a multiple of 16, 16-byte aligned) into L2 with one bulk-copy-engine
 * request: no register result, nothing waits on it. */
__device__ __forceinline__ void prefetch_l2_bulk(const void *p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

/* 4 bytes global -> shared (needs only 4-byte alignment, unlike cp_async16). */
__device__ __forceinline__ void cp_async4(void *dst, const void *src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}

/* Pull the cache line holding p into L2 (a hint: no register result, nothing waits). */
__device__ __forceinline__ void prefetch_l2_line(const void *p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p) : "memory");
}

}  // namespace chunked_backward
}  // namespace gdpcu

#endif
