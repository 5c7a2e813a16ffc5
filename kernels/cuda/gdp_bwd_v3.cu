/*
 * gdp_bwd_v3.cu -- variant 3 of the chunked GDP backward, the library's bf16 path where it
 * applies (gdp_dispatch.cu; kernels/cuda/NOTES.md, "Variant 3 backward").
 *
 * Steps (the chunk algebra is in gdp_chunk.cuh):
 *  1. recompute the per-chunk panels with variant 3's prep (gdp_fwd_v3.cu), which here
 *     also stores T^T = ((I + A)^-1)^T (bf16) for step 5;
 *  2. bwd_states_kernel_v3: the forward v3 state pass (S^T float32 in registers for the
 *     whole sequence) without the output products; per chunk it stores h = S at the
 *     chunk start (float32, transposed [V][K]) and D = U - W h (bf16, variant 2's layout);
 *  3. dstate_kernel_v3: the reverse state-gradient pass, dH^T float32 in registers:
 *        dD^T = dO^T Pm + dH^T Kd^T,    dH^T <- e^{last} dH^T + dO^T Qd - dD^T W,
 *     storing dH (gradient of the chunk-end state; float32, transposed) and dD (bf16) per
 *     chunk, and dh0 at the end;
 *  4. grad_state_kernel_v3: the per-chunk gradient terms that need the K x V matrices
 *     (dq final; dKnA, dWg, dgcA partials), from the float32 h and dH;
 *  5. grad_wy_kernel_v3: the WY part (dT, dA; T from step 1): dk, dv, dbeta, dg final.
 * GDP_CUDA_V3_GRAD=v2 replaces 4-5 by variant 2's chunk_grad_kernel (gdp_bwd.cu), and 2-3
 * then store bf16 h and dH for it instead of the float32 copies.
 *
 * The layout argument is the forward's (gdp_fwd_v3.cu): with everything transposed the
 * value columns x are the M side of every product, so a float32 accumulator fragment
 * (row x, column pair along the second index), rounded to bf16, is exactly the A
 * fragment of the next product: dH^T and dD^T never leave registers.  dO enters as A
 * fragments of dO^T by ldmatrix.trans from its row-major [token][x] rows; only the TC
 * query rows of a chunk are read (dO is zero on the other steps).
 */
#include <stdlib.h>
#include <string.h>

#include <mutex>
#include <type_traits>
#include <vector>

#include "gdp_fwd_v3.cuh"
#include "gdp_v3_stage.cuh"
#include "mma_sm90.cuh"
#include "gdp_chunk.cuh"
#include "gdp_v3_split.h"

namespace gdpcu {


namespace v3b {

/* the state passes' staging (gdp_v3_stage.cuh) */
using v3::HtStage;
using v3::stage_dfrags;
using v3::stage_hT16_half;
using v3::stage_hT32_half;
using v3::copy_panel_full;
using v3::copy_panel;
using v3::row_l2_inv;
using v3::neg_u_from_tu_v;
using v3::neg_u_from_panel;
using v3::copy_panel_sw128;

constexpr int kStages = 3; /* chunk panels in flight: current + next two */
constexpr int kPad = 8;    /* bf16 elements (16 bytes) of padding per shared row */

/* Float32 side buffers of the per-chunk gradient kernel (per (chunk, head) CHi):
 * hT32, dHT32 [V][K] (h^T and dH^T, written by the two sequential kernels), the state
 * part's outputs for the WY part: dKnA [C][K] float, dWg [C][K] bf16, dgcA [C] float, and
 * Tt [C][C] bf16: T^T = ((I + A)^-1)^T, written by the recompute's prep.  With
 * GDP_CUDA_V3_STATE=bf16 (v3::state16) h^T and dH^T are bf16 (hT16, dHT16; same layout). */
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

/* ------------------------------------------------------------------ PTX wrappers: mma_sm90.cuh */


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
 * so A + R is -X to ~16 bits.  The same helper is in gdp_fwd_v3.cu. */
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


/* copy_panel (rows >= valid zero-filled): gdp_v3_stage.cuh */


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

/* ------------------------------------------------------------------ recompute: states */

template <int K, int C, int BV>
struct StatesLayout {
  static constexpr int ldK = K + kPad, ldB = BV + kPad, ldC = C + kPad;
  static constexpr int oW = 0;
  static constexpr int oKd = oW + C * ldK * 2;
  static constexpr int oU = oKd + C * ldK * 2; /* U's columns, or (TU) v's */
  /* U's residual (a.Ulo), when given; or (TU, BV >= C) Tu^T, C rows of ldC <= ldB */
  static constexpr int oUl = oU + C * ldB * 2;
  static constexpr int stage = (oUl + C * ldB * 2 + 127) / 128 * 128;
  static constexpr int oHt = stage * kStages; /* h^T staging, one HtStage per warp */
  static constexpr int total = oHt + BV / 16 * HtStage<K, C>::warp_bytes;
};

/* Grid (sequence, head, value block of BV columns); warp w owns value columns
 * col0 + 16w .. +15.  Fragments (grp = lane/4, tig = lane%4):
 *   St[nt][e] = S^T[x][r],  x = xw + grp + 8(e/2),  r = 8nt + 2tig + e%2
 *   Dt[nt][e] = -D^T[x][j], j = 8nt + 2tig + e%2.
 * Per chunk: h (= bf16 S at the chunk start, the same rounding the products use) and D
 * to variant 2's workspace, then S^T <- e^{last} S^T + D^T Kd.  No ht: the forward gave
 * it.  For the v3 gradient kernels h^T goes to hT32 (float32) or, S16, to hT16 (bf16).
 * TU (with NEW, BV >= C; the prep ran with TU_OUT): U = Tu V formed here from a.Tu and
 * v's rows, inside D's accumulator, as state_kernel_v3's TU (gdp_fwd_v3.cu): no U, no
 * residual through memory, and D one float32 sum. */
template <int K, int V, int C, int BV, bool S16 = false, bool NEW = true, bool TU = false>
__global__ void __launch_bounds__(BV / 16 * 32, 1) bwd_states_kernel_v3(GdpArgs a, float *hT32, bf16 *hT16) {
  pdl_wait(); /* the prep's panels (a programmatic dependent: common.cuh) */
  pdl_launch_dependents();
  using L = StatesLayout<K, C, BV>;
  constexpr int NT = BV / 16 * 32;
  static_assert(K % 32 == 0 && C % 16 == 0 && BV % 16 == 0, "tile shapes");
  static_assert(!TU || (NEW && BV >= C), "TU: the new copies, Tu^T in the residual's region");
  extern __shared__ __align__(128) unsigned char smem[];
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * BV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = lane >> 2, tig = lane & 3;
  const int H = a.H;
  const int cbeg = a.choff[s], nc = a.choff[s + 1] - cbeg;
  const int64_t soff = ((int64_t)s * H + h) * K * V;
  const int xw = col0 + warp * 16;

  float St[K / 8][4];
#pragma unroll
  for (int nt = 0; nt < K / 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int r = nt * 8 + 2 * tig + (e & 1), x = xw + grp + 8 * (e >> 1);
      St[nt][e] = a.h0 ? a.h0[soff + (int64_t)r * V + x] : 0.f;
    }

  auto issue = [&](int it) {
    if (it < nc) {
      unsigned char *st = smem + (it % kStages) * L::stage;
      const int64_t base = (int64_t)(cbeg + it) * H + h;
      if constexpr (TU) { /* v's rows (zero past the sequence end) and Tu^T */
        copy_panel_full<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K);
        copy_panel_full<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K);
        const ChunkInfo cj = a.chunks[cbeg + it];
        const int64_t krow0 = (int64_t)cj.t0 * a.n;
        copy_panel<C, BV, NT>(st + L::oU, L::ldB, (const bf16 *)a.v + (krow0 * H + h) * V + col0, (int64_t)H * V,
                              cj.ntok * a.n);
        copy_panel_full<C, C, NT>(st + L::oUl, L::ldC, a.Tu + base * C * C, C);
      } else if constexpr (NEW) { /* complete workspace panels: no zero-fill predicate (copy_panel_full) */
        copy_panel_full<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K);
        copy_panel_full<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K);
        copy_panel_full<C, BV, NT>(st + L::oU, L::ldB, a.U + base * C * V + col0, V);
        if (a.Ulo) copy_panel_full<C, BV, NT>(st + L::oUl, L::ldB, a.Ulo + base * C * V + col0, V);
      } else {
        copy_panel<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K, C);
        copy_panel<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K, C);
        copy_panel<C, BV, NT>(st + L::oU, L::ldB, a.U + base * C * V + col0, V, C);
        if (a.Ulo) copy_panel<C, BV, NT>(st + L::oUl, L::ldB, a.Ulo + base * C * V + col0, V, C);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int it = 0; it < kStages - 1; it++) issue(it);

  const int nrow = (lane >> 4) * 8 + (lane & 7), ncol = ((lane >> 3) & 1) * 8;
  const int trow = ((lane >> 3) & 1) * 8 + (lane & 7), tcol = (lane >> 4) * 8;
  const int urow = (lane >> 4) * 8 + (lane & 7), ucol = warp * 16 + ((lane >> 3) & 1) * 8;
  const uint32_t smem0 = smem_addr(smem);
  const bool ulo = a.Ulo != nullptr;
  
  for (int it = 0; it < nc; it++) {
    const int64_t CHi = (int64_t)(cbeg + it) * H + h;
    const float el = a.elast[CHi];
    cp_async_wait<kStages - 2>();
    __syncthreads();
    issue(it + kStages - 1);
    const uint32_t sb = smem0 + (it % kStages) * L::stage;
    const uint32_t sW = sb + L::oW, sKd = sb + L::oKd, sU = sb + L::oU;

    /* -D^T = -U^T + S^T W^T, the bf16 A fragment of S^T built per k tile (4 registers
     * live instead of K/4) and stored as h on the way.  U = hi + lo when the residual is
     * given (hi + lo is exact in float32): the gate gradient's z terms take D from here,
     * and a bf16-only U was the largest single error in dg (NOTES.md, "dg precision"). */
    float Dt[C / 8][4];
    if constexpr (TU) { /* -U^T = (-V^T) Tu^T, as in state_kernel_v3 (gdp_fwd_v3.cu) */
      neg_u_from_tu_v<C>(Dt, sU, sU + (L::oUl - L::oU), L::ldB, L::ldC, urow, ucol, trow, tcol);
    } else {
      neg_u_from_panel<C / 16>(Dt, sU, sU + (L::oUl - L::oU), L::ldB, urow, ucol, ulo);
    }
    bf16 *gh = a.hbuf + CHi * K * V + xw + grp;
    const bool keep = S16 ? hT16 != nullptr : hT32 != nullptr; /* for the v3 gradient kernels */
    /* h^T rows xw..xw+7 now, xw+8..15 after the D products (St is unchanged until the
     * decay): the stores of each half overlap the products that follow */
    if (keep) store_stateT_half<K, C, S16>(smem + L::oHt, hT32, hT16, CHi * V * K + (int64_t)xw * K, St, 0);
#pragma unroll
    for (int kt = 0; kt < K / 16; kt++) {
      uint32_t Sa[4];
      afrag_kt(St, kt, Sa, 1.f);
      if (!keep) store_afrag<V>(gh, kt * 16 + 2 * tig, Sa); /* bf16 h only for variant 2's kernel */
#pragma unroll
      for (int nt = 0; nt < C / 8; nt += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(sW + ((nt * 8 + nrow) * L::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
        mma16816(Dt[nt], Sa, b0, b1);
        mma16816(Dt[nt + 1], Sa, b2, b3);
      }
    }
    uint32_t Da[C / 16][4];
    to_afrag<C / 16>(Dt, Da, -1.f);
    if (keep) store_stateT_half<K, C, S16>(smem + L::oHt, hT32, hT16, CHi * V * K + (int64_t)(xw + 8) * K, St, 1);
    stage_dfrags<K, C>(smem + L::oHt, a.Dbuf + CHi * C * V + xw, V, Da, 0u);

    /* S^T <- e^{last} S^T + D^T Kd */
#pragma unroll
    for (int nt = 0; nt < K / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) St[nt][e] *= el;
    if (a.d_residual) {
      /* + Dl^T Kd, Dl = bf16(D - bf16(D)) (exact difference): the states grad_state reads
       * carry D to ~16 bits (dg's <dH, h> and z terms on long dht sequences; NOTES.md "dg
       * on the K = 128 golden case") */
#pragma unroll
      for (int kt = 0; kt < C / 16; kt++) {
        uint32_t Dl[4];
        afrag_residual_kt(Dt, kt, Da[kt], Dl);
#pragma unroll
        for (int nt = 0; nt < K / 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(sKd + ((kt * 16 + trow) * L::ldK + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(St[nt], Da[kt], b0, b1);
          mma16816(St[nt + 1], Da[kt], b2, b3);
          mma16816(St[nt], Dl, b0, b1);
          mma16816(St[nt + 1], Dl, b2, b3);
        }
      }
    } else {
#pragma unroll
      for (int kt = 0; kt < C / 16; kt++)
#pragma unroll
        for (int nt = 0; nt < K / 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(sKd + ((kt * 16 + trow) * L::ldK + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(St[nt], Da[kt], b0, b1);
          mma16816(St[nt + 1], Da[kt], b2, b3);
        }
    }
  }
  cp_async_wait<0>();
}

/* ------------------------------------------------------------------ reverse state-gradient pass */

/* STAGES: chunk panels in flight (3 as today; 2 for the overlap with grad_state, E3);
 * B16: the staging buffer holds only bf16 rows and D tiles (S16 kernels with 2 stages). */
template <int K, int C, int TC, int BV, int STAGES = kStages, bool B16 = false>
struct DStateLayout {
  static constexpr int ldK = K + kPad, ldC = C + kPad, ldB = BV + kPad;
  static constexpr int oW = 0;
  static constexpr int oKd = oW + C * ldK * 2;
  static constexpr int oQd = oKd + C * ldK * 2;
  static constexpr int oPm = oQd + TC * ldK * 2;
  static constexpr int odO = oPm + TC * ldC * 2;
  static constexpr int stage = (odO + TC * ldB * 2 + 127) / 128 * 128;
  static constexpr int oHt = stage * STAGES; /* dH^T staging, one HtStage per warp */
  static constexpr int warp_bytes = B16 ? HtStage<K, C>::warp_bytes16 : HtStage<K, C>::warp_bytes;
  static constexpr int total = oHt + BV / 16 * warp_bytes;
};

/* PTX of the E3 overlap (sm_90): the counters' release / acquire at GPU scope (the
 * programmatic-launch trigger and wait: common.cuh). */
__device__ __forceinline__ void red_release_gpu_add(int *p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_gpu(const int *p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/* Grid (sequence, head, value block of BV columns); warp w owns value columns
 * xw = col0 + 16w .. +15 and walks the sequence's chunks backwards.  Fragments
 * (grp = lane/4, tig = lane%4):
 *   Ht[nt][e] = dH^T[x][r],  x = xw + grp + 8(e/2),  r = 8nt + 2tig + e%2  (float32)
 *   Gt[nt][e] = dD^T[x][j],  j = 8nt + 2tig + e%2
 *   Oa[kt]    = A fragment of dO^T (x, query row a in 16kt..16kt+15).
 * Pm[a][j] is zero for j > ia = a n + n - 1, so the (a-tile, j-tile) pairs wholly past
 * the diagonal are skipped at compile time (NN = C / TC = n). */
template <int K, int V, int C, int TC, int BV, bool S16 = false, bool NEW = true, int STAGES = kStages>
__global__ void __launch_bounds__(BV / 16 * 32, 1) dstate_kernel_v3(GdpArgs a, float *dHT32, bf16 *dHT16, int *ready) {
  /* E3: grad_state (launched with programmatic stream serialization right after this
   * kernel when GDP_CUDA_V3_OVERLAP is on) may start once every block of this grid has
   * executed the trigger below or exited, i.e. once every dstate block is resident.  Those
   * never wait on grad_state (they only signal), so grad_state blocks spinning on a chunk's
   * counter always see it complete: no deadlock at any grid size.  grad_state relies on
   * everything before this kernel being complete by then, so the wait (this kernel itself
   * a programmatic dependent under GDP_CUDA_PDL=1) must stay BEFORE the trigger. */
  pdl_wait(); /* the panels, and h^T / D of the states pass before it */
  pdl_launch_dependents();
  /* STAGES = 2 (E0; only with NEW): the next chunk's panels are issued one chunk ahead
   * instead of two (same products, same bits), and with S16 the staging buffer is sized for
   * bf16 rows: 171.5 -> 115.0 KB at K = V = 128, n = 2, BV = 64, so that a grad_state
   * block fits beside it (E3).  Only this instantiation signals `ready` (NULL: no
   * signals). */
  constexpr bool TWO = STAGES == 2;
  static_assert(STAGES == kStages || (TWO && NEW), "2 stages: the new schedule only");
  using L = DStateLayout<K, C, TC, BV, STAGES, TWO && S16>;
  constexpr int WB = L::warp_bytes;
  constexpr int NT = BV / 16 * 32;
  constexpr int NN = C / TC;
  static_assert(K % 32 == 0 && C % 16 == 0 && TC % 16 == 0 && BV % 16 == 0 && NN * TC == C, "tile shapes");
  extern __shared__ __align__(128) unsigned char smem[];
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * BV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = lane >> 2, tig = lane & 3;
  const int H = a.H;
  const int cbeg = a.choff[s], nc = a.choff[s + 1] - cbeg;
  const int64_t soff = ((int64_t)s * H + h) * K * V;
  const int xw = col0 + warp * 16;
  const bf16 *d_o = (const bf16 *)a.d_o;

  float Ht[K / 8][4];
#pragma unroll
  for (int nt = 0; nt < K / 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int r = nt * 8 + 2 * tig + (e & 1), x = xw + grp + 8 * (e >> 1);
      Ht[nt][e] = a.dht ? a.dht[soff + (int64_t)r * V + x] : 0.f;
    }

  /* iteration it handles chunk cbeg + nc - 1 - it, in stage it % STAGES.  NEW: the
   * chunk's (t0, ntok) for dO come from registers loaded one iteration earlier (the old
   * schedule loaded them here, after the barrier, and the dO copies waited on that
   * load), and the four workspace panels are copied without the zero-fill predicate. */
  auto issue = [&](int it, int t0, int ntok) {
    if (it < nc) {
      unsigned char *st = smem + (it % STAGES) * L::stage;
      const int c = cbeg + nc - 1 - it;
      const int64_t base = (int64_t)c * H + h;
      if constexpr (NEW) {
        copy_panel_full<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K);
        copy_panel_full<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K);
        copy_panel_full<TC, K, NT>(st + L::oQd, L::ldK, a.Qd + base * TC * K, K);
        copy_panel_full<TC, C, NT>(st + L::oPm, L::ldC, a.Pm + base * TC * C, C);
      } else {
        const ChunkInfo ci = a.chunks[c];
        t0 = ci.t0, ntok = ci.ntok;
        copy_panel<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K, C);
        copy_panel<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K, C);
        copy_panel<TC, K, NT>(st + L::oQd, L::ldK, a.Qd + base * TC * K, K, TC);
        copy_panel<TC, C, NT>(st + L::oPm, L::ldC, a.Pm + base * TC * C, C, TC);
      }
      copy_panel<TC, BV, NT>(st + L::odO, L::ldB, d_o + ((int64_t)t0 * H + h) * V + col0, (int64_t)H * V, ntok);
    }
    cp_async_commit();
  };
  /* NEW: (t0, ntok) of the chunk that the next issue copies */
  int nx_t0 = 0, nx_ntok = 0;
  auto load_next = [&](int it) {
    if (it < nc) {
      const ChunkInfo ci = a.chunks[cbeg + nc - 1 - it];
      nx_t0 = ci.t0, nx_ntok = ci.ntok;
    }
  };
#pragma unroll
  for (int it = 0; it < STAGES - 1; it++) {
    if constexpr (NEW) load_next(it);
    issue(it, nx_t0, nx_ntok);
  }
  if constexpr (NEW) load_next(STAGES - 1);

  const int nrow = (lane >> 4) * 8 + (lane & 7), ncol = ((lane >> 3) & 1) * 8;
  const int trow = ((lane >> 3) & 1) * 8 + (lane & 7), tcol = (lane >> 4) * 8;
  /* dO^T A fragments from dO [a][x]: matrices (a lo, x lo), (a lo, x hi), (a hi, x lo),
   * (a hi, x hi), transposed = A registers (m lo, k lo), (m hi, k lo), (m lo, k hi),
   * (m hi, k hi) */
  const int orow = (lane >> 4) * 8 + (lane & 7), ocol = warp * 16 + ((lane >> 3) & 1) * 8;
  const uint32_t smem0 = smem_addr(smem);
  
  for (int it = 0; it < nc; it++) {
    const int64_t CHi = (int64_t)(cbeg + nc - 1 - it) * H + h;
    const float el = a.elast[CHi];
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    issue(it + STAGES - 1, nx_t0, nx_ntok);
    if constexpr (NEW) load_next(it + STAGES); /* used one iteration later */
    const uint32_t sb = smem0 + (it % STAGES) * L::stage;
    const uint32_t sW = sb + L::oW, sKd = sb + L::oKd, sQd = sb + L::oQd, sPm = sb + L::oPm,
                   sdO = sb + L::odO;

    /* dD^T = dH^T Kd^T + dO^T Pm.  dH (this chunk's end) as bf16 A fragments built per
     * k tile (4 registers live, not K/4), stored on the way; dO^T's fragments after, so
     * the two sets are never live together. */
    float Gt[C / 8][4];
#pragma unroll
    for (int nt = 0; nt < C / 8; nt++) Gt[nt][0] = Gt[nt][1] = Gt[nt][2] = Gt[nt][3] = 0.f;
    bf16 *gdh = a.dHbuf + CHi * K * V + xw + grp;
    const bool keep = S16 ? dHT16 != nullptr : dHT32 != nullptr; /* for the v3 gradient kernels */
    /* dH^T rows xw..xw+7 now, xw+8..15 after the dD products (Ht is unchanged until the
     * decay): the stores of each half overlap the products that follow */
    if (keep) store_stateT_half<K, C, S16, WB>(smem + L::oHt, dHT32, dHT16, CHi * V * K + (int64_t)xw * K, Ht, 0);
    if constexpr (NEW) {
      /* bf16 dH only for variant 2's kernel, in its own loop: the branch inside the
       * product loop below (the old schedule) cut it into one basic block per k tile,
       * and every tile's four ldmatrix then waited before its mma */
      if (!keep) {
#pragma unroll
        for (int kt = 0; kt < K / 16; kt++) {
          uint32_t Ha[4];
          afrag_kt(Ht, kt, Ha, 1.f);
          store_afrag<V>(gdh, kt * 16 + 2 * tig, Ha);
        }
      }
#pragma unroll
      for (int kt = 0; kt < K / 16; kt++) {
        uint32_t Ha[4];
        afrag_kt(Ht, kt, Ha, 1.f);
#pragma unroll
        for (int nt = 0; nt < C / 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(sKd + ((nt * 8 + nrow) * L::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
          mma16816(Gt[nt], Ha, b0, b1);
          mma16816(Gt[nt + 1], Ha, b2, b3);
        }
      }
    } else {
#pragma unroll
      for (int kt = 0; kt < K / 16; kt++) {
        uint32_t Ha[4];
        afrag_kt(Ht, kt, Ha, 1.f);
        if (!keep) store_afrag<V>(gdh, kt * 16 + 2 * tig, Ha); /* bf16 dH only for variant 2's kernel */
#pragma unroll
        for (int nt = 0; nt < C / 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(sKd + ((nt * 8 + nrow) * L::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
          mma16816(Gt[nt], Ha, b0, b1);
          mma16816(Gt[nt + 1], Ha, b2, b3);
        }
      }
    }
    uint32_t Oa[TC / 16][4];
#pragma unroll
    for (int kt = 0; kt < TC / 16; kt++)
      ldsm_x4_t(sdO + ((kt * 16 + orow) * L::ldB + ocol) * 2, Oa[kt][0], Oa[kt][1], Oa[kt][2], Oa[kt][3]);
#pragma unroll
    for (int kt = 0; kt < TC / 16; kt++)
#pragma unroll
      for (int nt = 0; nt < C / 8; nt += 2) {
        if (nt * 8 > (kt * 16 + 15) * NN + NN - 1) continue; /* Pm block is zero */
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(sPm + ((kt * 16 + trow) * L::ldC + nt * 8 + tcol) * 2, b0, b1, b2, b3);
        mma16816(Gt[nt], Oa[kt], b0, b1);
        mma16816(Gt[nt + 1], Oa[kt], b2, b3);
      }
    /* -dD^T as A fragments (G), dD (bf16, the same rounding, sign bits flipped back:
     * exact) to the workspace, and
     *   dH^T <- e^{last} dH^T + dO^T Qd + (-dD^T) W   (float32 accumulators).
     * NEW: the same products in the same order per accumulator, scheduled so that what
     * needs only dH^T is not on the dD chain: the second dH^T half store and the dO^T Qd
     * products (independent of dD) cover the tail of the dD products; G's rounding is
     * followed by the W products at once; dD's staged store goes last, under their tail.
     * The old schedule stored the dH^T half and dD between G and the W products. */
    uint32_t Ga[C / 16][4];
    auto decay_qd = [&]() {
#pragma unroll
      for (int nt = 0; nt < K / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) Ht[nt][e] *= el;
#pragma unroll
      for (int kt = 0; kt < TC / 16; kt++)
#pragma unroll
        for (int nt = 0; nt < K / 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(sQd + ((kt * 16 + trow) * L::ldK + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(Ht[nt], Oa[kt], b0, b1);
          mma16816(Ht[nt + 1], Oa[kt], b2, b3);
        }
    };
    auto w_products = [&]() {
#pragma unroll
      for (int kt = 0; kt < C / 16; kt++)
#pragma unroll
        for (int nt = 0; nt < K / 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(sW + ((kt * 16 + trow) * L::ldK + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(Ht[nt], Ga[kt], b0, b1);
          mma16816(Ht[nt + 1], Ga[kt], b2, b3);
        }
    };
    if constexpr (NEW) {
      if (keep) store_stateT_half<K, C, S16, WB>(smem + L::oHt, dHT32, dHT16, CHi * V * K + (int64_t)(xw + 8) * K, Ht, 1);
      decay_qd();
      to_afrag<C / 16>(Gt, Ga, -1.f);
      w_products();
      if constexpr (TWO) {
        /* E3: the previous chunk's dH^T / dD stores (this thread's were issued a whole
         * chunk ago, so the fence seldom waits) are made visible at GPU scope, then one
         * release add per block.  Here rather than at the loop top, where the fence would
         * wait for the dD stores just issued. */
        if (ready != nullptr && it > 0) {
          __threadfence();
          __syncthreads();
          if (threadIdx.x == 0) red_release_gpu_add(ready + (CHi + H), 1); /* chunk c + 1 (iteration it - 1) */
        }
      }
      stage_dfrags<K, C, WB>(smem + L::oHt, a.dDbuf + CHi * C * V + xw, V, Ga, 0x80008000u);
    } else {
      to_afrag<C / 16>(Gt, Ga, -1.f);
      if (keep) store_stateT_half<K, C, S16, WB>(smem + L::oHt, dHT32, dHT16, CHi * V * K + (int64_t)(xw + 8) * K, Ht, 1);
      stage_dfrags<K, C, WB>(smem + L::oHt, a.dDbuf + CHi * C * V + xw, V, Ga, 0x80008000u);
      decay_qd();
      w_products();
    }
  }
  cp_async_wait<0>();

  if (a.dh0) {
#pragma unroll
    for (int nt = 0; nt < K / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int r = nt * 8 + 2 * tig + (e & 1), x = xw + grp + 8 * (e >> 1);
        a.dh0[soff + (int64_t)r * V + x] = Ht[nt][e];
      }
  }
  if constexpr (TWO) {
    /* E3: the sequence's first chunk (the last iteration) is signalled after dh0 too, so
     * that once every counter is complete every store of this grid is visible (the host
     * turns the overlap off where a sequence has no chunk to signal). */
    if (ready != nullptr && nc > 0) {
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) red_release_gpu_add(ready + ((int64_t)cbeg * H + h), 1);
    }
  }
}

/* ------------------------------------------------------------------ per-chunk gradients, state part */

/* Shared-memory layout of grad_state_kernel_v3 (bytes; rows padded by 16 bytes). */
/* sum over NS partial-sum slots p[0], p[stride], ..., from 0.f in slot order: with two slots
 * the bits a shared-memory atomicAdd from zero gave in either order ((0 + a) + b: -0 + -0
 * comes out +0 as there), with more a fixed order where the atomics' was not */
template <int NS>
__device__ __forceinline__ float slot_sum(const float *p, int stride) {
  float x = 0.f;
#pragma unroll
  for (int i = 0; i < NS; i++) x += p[i * stride];
  return x;
}

template <int K, int V, int C, int TC>
struct GradStateLayout {
  static constexpr int ldK = K + kPad, ldV = V + kPad, ldC = C + kPad;
  static constexpr int oHb = 0;                       /* dH^T, later h^T: [V][K] bf16 (from float32) */
  static constexpr int oD = oHb + V * ldK * 2;        /* D  [C][V] */
  static constexpr int odD = oD + C * ldV * 2;        /* dD [C][V] */
  static constexpr int odO = odD + C * ldV * 2;       /* dO [TC][V], query rows, 0 past the end */
  static constexpr int oKn = odO + TC * ldV * 2;      /* kn [C][K] */
  static constexpr int oQn = oKn + C * ldK * 2;       /* qn [TC][K] */
  static constexpr int oPs = oQn + TC * ldK * 2;      /* Ps [TC][C] */
  static constexpr int oF = oPs + TC * ldC * 2;       /* floats below */
  /* dgc's P1 column sums, z and qn . dqn are summed over several warps' items in partial-sum
   * slots, one writer each (TC / 16, K / 64 and K / 32 of them), added up in a fixed order
   * (slot_sum) where they are read; shared-memory float atomics compiled to compare-and-swap
   * loops (ncu, session 11: ~5% of the kernel's warp stall samples) */
  static constexpr int nDgc = TC / 16, nZ = K / 64, nQd = K / 32;
  static constexpr int fGp = 0, fGc = C, fDgc = 2 * C, fZ = fDgc + nDgc * C, fQinv = fZ + nZ * C,
                       fQdot = fQinv + TC, fDot = fQdot + nQd * TC, fKinv = fDot + 8, nF = fKinv + C;
  static constexpr int oNext = oF + nF * 4; /* ChunkInfo of the block `ahead` slots on (16 bytes) */
  static_assert(oNext % 16 == 0, "ChunkInfo alignment");
  static constexpr int total = oNext + 16;
};

/* The state part of the per-chunk gradients (one block of 8 warps per (chunk, head)):
 * everything that needs the K x V matrices h (S at the chunk start) and dH (gradient of
 * the chunk-end state), read as the float32 transposed copies the two sequential kernels
 * wrote (rounded once to bf16 for the tensor cores; <dH, h> in float32).  With kn, qn the
 * normalised keys / queries (bf16 as the prep rounds them), gc the in-chunk cumulative log
 * decay, ia = a n + n - 1 the step of query a:
 *   DP  = dO D^T,  QK = qn kn^T                                  (TC x C)
 *   Ps  = scale e^{gc_ia - gc_j} DP  (j <= ia)
 *   dqn = scale e^{gc_ia} dO h^T + Ps kn  -> dq (l2-norm backward applied; final)
 *   dKnA = e^{last - gc_j} (D dH^T)_j + (Ps^T qn)_j              (C x K, float32)
 *   dWg  = -dD h^T                                               (C x K, bf16)
 *   dgcA_j = -sum_a Ps_aj QK_aj + [j = ia] qn_a . dqn_a - z_j
 *            + [j = C-1] (e^{last} <dH, h> + sum_s z_s),   z_j = kn_j . e^{last-gc_j} (D dH^T)_j
 * i.e. the terms of variant 2's chunk_grad_kernel phases P1-P6 (gdp_bwd.cu); the WY part
 * (T, dT, dA, dv, dbeta and the rest of dk, dg) adds to dKnA and dgcA.  Only the TC query
 * rows enter the query products (dO is zero on the other steps). */
template <int K, int V, int C, int TC, bool S16 = false, bool PIPE = false, bool OVL = false>
__global__ void __launch_bounds__(256, 2) grad_state_kernel_v3(GdpArgs a, GradStateOut go, int ahead) {
  /* dH^T, dD of the state-gradient pass; OVL (E3): no wait -- the block waits on its
   * chunk's counter before its dH^T / dD copies instead (below) */
  if constexpr (!OVL) pdl_wait();
  pdl_launch_dependents();
  using L = GradStateLayout<K, V, C, TC>;
  /* OVL (E3, GDP_CUDA_V3_OVERLAP; with S16 && PIPE only): launched as dstate's
   * programmatic dependent, without griddepcontrol.wait, so dstate may still be running:
   * a 1-D grid of chunks x H blocks in go.order's order (the latest chunk of every
   * sequence first, as dstate walks backwards; heads fastest), and the block's dH^T, dD -- the only inputs
   * dstate writes -- are read only once its chunk's counter go.ready[c H + h] reaches
   * go.ready_target (every value tile stored).  Everything else was complete before
   * dstate started. */
  static_assert(!OVL || (S16 && PIPE), "the overlap reads dH^T by cp.async after the wait");
  /* PIPE (bf16 states only; GDP_CUDA_V3_GSPIPE=old turns it off): dH^T is cp.async'ed
   * straight into the K x V buffer with the other panels at the start (it is bf16 in
   * global memory already, and the layout is the buffer's), instead of being read into
   * registers after P1 and stored from there; <dH, h> is summed in P3a from the h^T
   * reload (registers) and the dH^T vectors in shared memory, in the same per-thread
   * order, so every output bit is as before.  Removed from the block's serial chain: the
   * post-P1 round of 16-byte loads (one L2 round trip and its wait), and one of the two
   * reads of h^T (32 KB of L2 traffic per block at K = V = 128). */
  constexpr bool NP = S16 && PIPE;
  /* S16: h^T, dH^T arrive in bf16 (go.hT16, go.dHT16): 16-byte vectors of 8 elements
   * instead of float4, half the bytes; the values are the float32 copies' round-to-nearest
   * bf16, i.e. what this kernel writes to shared memory from those, so every product
   * below is bit for bit the same; only <dH, h> then sums rounded values. */
  using SV = typename std::conditional<S16, uint4, float4>::type;
  constexpr int kEPV = S16 ? 8 : 4;                /* elements per vector */
  constexpr uint32_t kSB = (uint32_t)(V * K) * (S16 ? 2 : 4); /* bytes of one (chunk, head) copy */
  constexpr int NN = C / TC;
  static_assert(K % 64 == 0 && V % 16 == 0 && C % 16 == 0 && TC % 16 == 0 && NN * TC == C, "shapes");
  extern __shared__ __align__(128) unsigned char smem[];
  const int h = OVL ? (int)(blockIdx.x % (unsigned)a.H) : (int)blockIdx.y;
  const ChunkInfo ci = OVL ? go.order[blockIdx.x / (unsigned)a.H] : a.chunks[blockIdx.x];
  const int c = OVL ? ci.pad : (int)blockIdx.x;
  const int H = a.H, n = NN, nv = ci.ntok * NN;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grp = lane >> 2, tig = lane & 3;
  const int64_t CHi = (int64_t)c * H + h;
  const int64_t krow0 = (int64_t)ci.t0 * NN;
  const float scale = a.scale;
  const bf16 *gk = (const bf16 *)a.k, *gq = (const bf16 *)a.q, *gg = (const bf16 *)a.g,
             *d_o = (const bf16 *)a.d_o;
  float *sF = (float *)(smem + L::oF);
  float *sGc = sF + L::fGc, *sDgc = sF + L::fDgc, *sZ = sF + L::fZ,
        *sQinv = sF + L::fQinv, *sQdot = sF + L::fQdot, *sDot = sF + L::fDot, *sKinv = sF + L::fKinv;
  const uint32_t s0 = smem_addr(smem);
  /* this block's h^T, dH^T copies, in either format */
  const unsigned char *gH =
      S16 ? (const unsigned char *)(go.hT16 + CHi * V * K) : (const unsigned char *)(go.hT32 + CHi * V * K);
  const unsigned char *gdH =
      S16 ? (const unsigned char *)(go.dHT16 + CHi * V * K) : (const unsigned char *)(go.dHT32 + CHi * V * K);

  /* ---- loads.  The float32 h^T, dH^T panels (128 KB at K = V = 128, two thirds of the
   * block's DRAM bytes) are pulled into L2 first, by two bulk prefetches that hold no
   * register and no shared memory; the bf16 panels follow by cp.async (dD, needed only
   * from P3b on, in a second group).  The block then computes the cumulative gate, the
   * k / q norms and P1 (none of which reads h or dH) while that DRAM stream runs, and only
   * then reads the float32 copies (<dH, h>, dH^T -> bf16 shared), from L2.  Before, the
   * two rounds of float32 loads came first and each waited a full DRAM latency with
   * nothing else to do (ncu: 20.5 warp cycles per instruction, DRAM 52%). */
  if (tid == 0) {
    if (!NP) prefetch_l2_bulk(gdH, kSB); /* NP: copied by cp.async below */
    prefetch_l2_bulk(gH, kSB);
  }
  /* D, dD: workspace panels with all C rows (NP: without the always-true zero-fill
   * predicate, the same bytes) */
  if constexpr (NP) copy_panel_full<C, V, 256>(smem + L::oD, L::ldV, a.Dbuf + CHi * C * V, V);
  else copy_panel<C, V, 256>(smem + L::oD, L::ldV, a.Dbuf + CHi * C * V, V, C);
  copy_panel<TC, V, 256>(smem + L::odO, L::ldV, d_o + ((int64_t)ci.t0 * H + h) * V, (int64_t)H * V, ci.ntok);
  copy_panel<C, K, 256>(smem + L::oKn, L::ldK, gk + (krow0 * H + h) * K, (int64_t)H * K, nv);
  copy_panel<TC, K, 256>(smem + L::oQn, L::ldK, gq + ((int64_t)ci.t0 * H + h) * K, (int64_t)H * K, ci.ntok);
  /* the block `ahead` launch slots on (launcher: the resident block count, so roughly the
   * block that starts when this one ends): its ChunkInfo comes in with the panels, for the
   * L2 prefetch of its inputs after P3a (below) */
  const int64_t lin_ahead = (int64_t)blockIdx.y * gridDim.x + blockIdx.x + ahead;
  const bool do_ahead = ahead > 0 && lin_ahead < (int64_t)gridDim.x * gridDim.y; /* block-uniform */
  if (do_ahead && tid < 4) /* the ChunkInfo's four ints, 4-byte copies (the table is only int-aligned) */
    cp_async4(smem + L::oNext + 4 * tid,
              (const int *)(OVL ? go.order + lin_ahead / a.H : a.chunks + lin_ahead % gridDim.x) + tid);
  cp_async_commit();
  if constexpr (OVL) {
    /* E3: wait for dstate's dH^T / dD of this (chunk, head): one thread polls the counter
     * (acquire at GPU scope, backing off), the barrier passes the acquire on to the block.
     * The copies above (D, dO, k, q) do not depend on dstate and are in flight meanwhile.
     * A bounded spin: ~2^24 polls (seconds) -- a counter that never completes is a bug,
     * and traps instead of hanging the GPU. */
    if (tid == 0) {
      const int *cnt = go.ready + CHi;
      unsigned ns = 32;
      for (int polls = 0; ld_acquire_gpu(cnt) != go.ready_target; polls++) {
        if (polls >= (1 << 24)) __trap();
        __nanosleep(ns);
        if (ns < 1024) ns *= 2;
      }
    }
    __syncthreads();
  }
  if constexpr (NP) {
    /* dH^T [V][K] bf16 -> the K x V buffer (rows padded): thread tid copies the 16-byte
     * vectors e = tid + 256 u, the ones it dots with its h^T reload in P3a */
    copy_panel_full<V, K, 256>(smem + L::oHb, L::ldK, go.dHT16 + CHi * V * K, K);
    cp_async_commit();
  }
  if constexpr (NP) copy_panel_full<C, V, 256>(smem + L::odD, L::ldV, a.dDbuf + CHi * C * V, V);
  else copy_panel<C, V, 256>(smem + L::odD, L::ldV, a.dDbuf + CHi * C * V, V, C);
  cp_async_commit();
  /* sDgc, sZ, sQdot: every slot is written once below (P1, P3a, P2), none zeroed */
  if (warp == 0) {
    /* gc of key row i = g summed over the tokens <= i/n, token by token from 0.f: the
     * prep's shuffle scan (gdp_fwd_v3.cu), so the same additions in the same order, and
     * bit-identical to the serial loop over shared memory it replaces (whose other terms
     * were exact zeros), without its 64 dependent shared loads.  Lane t ends with the
     * sum through token t. */
    const float gt = (gg && lane < ci.ntok) ? __bfloat162float(gg[((int64_t)ci.t0 + lane) * H + h]) : 0.f;
    float acc = 0.f;
#pragma unroll
    for (int m = 0; m < TC; m++) {
      const float gm = __shfl_sync(0xffffffffu, gt, m);
      if (m <= lane) acc += gm;
    }
    if (lane < TC)
#pragma unroll
      for (int r = 0; r < n; r++) sGc[lane * n + r] = acc;
  }
  if constexpr (NP) cp_async_wait<2>(); /* D, dO, k, q (this thread's copies); dH^T, dD pending */
  else cp_async_wait<1>();              /* D, dO, k, q (this thread's copies) */
  __syncthreads();
  /* The k, q rows stay raw (exact bf16) and only their norms are taken:
   * kinv, qinv = rsqrt(|x|^2 + eps).  Every product below uses the raw rows and folds the
   * norms into its epilogue, so kn and qn are never rounded to bf16 here: the gate
   * gradient's z terms (kn . (D dH^T)) lost ~1.9e-3 of dg's precision to that rounding
   * (NOTES.md, "dg precision").  Rows past the end were zero-filled and stay zero.
   * A quad per row (8 rows per warp and pass, 16-byte loads, two shuffles) instead of a
   * warp per row (12 serial rows of five-shuffle sums per warp at C = 64). */
  for (int i0 = 8 * warp; i0 < C + TC; i0 += 64) { /* C + TC is a multiple of 16: warp-uniform */
    const int i = i0 + (lane >> 2);
    const bool isq = i >= C;
    const int row = isq ? i - C : i;
    const unsigned char *rp = smem + (isq ? L::oQn : L::oKn) + (row * L::ldK + 8 * (lane & 3)) * 2;
    float ss = 0.f;
#pragma unroll
    for (int m = 0; m < K / 32; m++) {
      const uint4 u = *reinterpret_cast<const uint4 *>(rp + 64 * m);
      const float2 x0 = unpack_bf16(u.x), x1 = unpack_bf16(u.y), x2 = unpack_bf16(u.z), x3 = unpack_bf16(u.w);
      ss += x0.x * x0.x + x0.y * x0.y + x1.x * x1.x + x1.y * x1.y + x2.x * x2.x + x2.y * x2.y + x3.x * x3.x + x3.y * x3.y;
    }
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    const float inv = a.l2norm ? rsqrtf(ss + kNormEps) : 1.f;
    if ((lane & 3) == 0) (isq ? sQinv : sKinv)[row] = inv;
  }
  __syncthreads();
  const float last = sGc[C - 1];

  /* lane offsets of the ldmatrix forms:
   *  A from [m][k] rows (non-trans):   row = (l&7) + 8((l>>3)&1), col = 8(l>>4)
   *  A from [k][m] rows (trans):       krow = (l&7) + 8(l>>4),    mcol = 8((l>>3)&1)
   *  B pair from [n][k] rows:          nrow = (l&7) + 8(l>>4),    ncol = 8((l>>3)&1)
   *  B pair from [k][n] rows (trans):  trow = (l&7) + 8((l>>3)&1), tcol = 8(l>>4) */
  const int arow = (lane & 7) + 8 * ((lane >> 3) & 1), acol = 8 * (lane >> 4);
  const int atk = (lane & 7) + 8 * (lane >> 4), atm = 8 * ((lane >> 3) & 1);
  const int nrow = (lane & 7) + 8 * (lane >> 4), ncol = 8 * ((lane >> 3) & 1);
  const int trow = arow, tcol = acol;

  /* ---- P1: DP = dO D^T and QK = qn kn^T for (16 query rows) x (16 steps) items;
   * Ps -> shared (bf16); dgc_j -= sum_a Ps QK (column sums over the 16 rows). */
  for (int item = warp; item < (TC / 16) * (C / 16); item += 8) {
    const int mb = (item / (C / 16)) * 16, jb = (item % (C / 16)) * 16;
    float dp[2][4] = {}, qk[2][4] = {};
    if (jb <= (mb + 15) * n + n - 1) { /* else Ps is zero on the whole item */
#pragma unroll
      for (int kt = 0; kt < V / 16; kt++) {
        uint32_t fa[4], b0, b1, b2, b3;
        ldsm_x4(s0 + L::odO + ((mb + arow) * L::ldV + kt * 16 + acol) * 2, fa[0], fa[1], fa[2], fa[3]);
        ldsm_x4(s0 + L::oD + ((jb + nrow) * L::ldV + kt * 16 + ncol) * 2, b0, b1, b2, b3);
        mma16816(dp[0], fa, b0, b1);
        mma16816(dp[1], fa, b2, b3);
      }
#pragma unroll
      for (int kt = 0; kt < K / 16; kt++) {
        uint32_t fa[4], b0, b1, b2, b3;
        ldsm_x4(s0 + L::oQn + ((mb + arow) * L::ldK + kt * 16 + acol) * 2, fa[0], fa[1], fa[2], fa[3]);
        ldsm_x4(s0 + L::oKn + ((jb + nrow) * L::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
        mma16816(qk[0], fa, b0, b1);
        mma16816(qk[1], fa, b2, b3);
      }
    }
    float colsum[2][2] = {};
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int qa = mb + grp + 8 * hf, ia = qa * n + n - 1, j = jb + 8 * nt + 2 * tig;
        const float gi = sGc[ia], qi = sQinv[qa];
        /* Ps'' = qinv_a Ps_aj kinv_j: the raw-row products below need exactly these factors,
         * and Ps'' qk_raw = Ps qk (qk from raw rows) */
        const float p0 = j <= ia ? scale * __expf(gi - sGc[j]) * dp[nt][2 * hf] * (qi * sKinv[j]) : 0.f;
        const float p1 = j + 1 <= ia ? scale * __expf(gi - sGc[j + 1]) * dp[nt][2 * hf + 1] * (qi * sKinv[j + 1]) : 0.f;
        const uint32_t pk = pack_bf16(p0, p1);
        *reinterpret_cast<uint32_t *>(smem + L::oPs + (qa * L::ldC + j) * 2) = pk;
        /* dg's P-column term -sum_a Ps qk and its query-row term qn . dqn (dqn takes the
         * bf16 Ps'' below) are one double sum split by token: they cancel in dg's reverse
         * cumsum only if both see the same Ps''.  Summing the float value here left the
         * bf16 rounding of Ps'' uncancelled -- the largest single term of dg's error on
         * short, dht-free problems (NOTES: "dg margin"). */
        const float2 pr = unpack_bf16(pk);
        colsum[nt][0] += (go.pcol_f32 ? p0 : pr.x) * qk[nt][2 * hf];
        colsum[nt][1] += (go.pcol_f32 ? p1 : pr.y) * qk[nt][2 * hf + 1];
      }
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        float v = colsum[nt][e];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (grp == 0) sDgc[(mb / 16) * C + jb + 8 * nt + 2 * tig + e] = -v;
      }
  }

  /* ---- the float32 copies, now (mostly) L2 hits: <dH, h> and dH^T -> bf16 shared (h^T
   * replaces it after the dH products: one K x V buffer keeps the block at ~108 KB, two
   * blocks per SM).  Two rounds of 16 16-byte loads per thread at K = V = 128; dH is read
   * once (streaming loads), h again after P3a (default caching).  The per-thread
   * summation order of the dot is e ascending in steps of 256, as before. */
  if constexpr (NP) {
    /* dH^T is in shared memory already; <dH, h> is taken in P3a */
  } else if constexpr (S16) {
    /* bf16 copies: one round of up to 8 16-byte vectors each (8 at K = V = 128); dH^T's
     * go to shared memory as they are (one 16-byte store each) */
    const uint4 *ph = (const uint4 *)gH, *pd = (const uint4 *)gdH;
    float dot = 0.f;
    constexpr int nvec = V * K / 8, per = nvec / 256 < 8 ? nvec / 256 : 8;
    static_assert(nvec % (256 * per) == 0, "whole rounds");
#pragma unroll
    for (int e0 = 0; e0 < nvec; e0 += 256 * per) {
      uint4 hv[per], dv[per];
#pragma unroll
      for (int u = 0; u < per; u++) {
        const int e = e0 + u * 256 + tid;
        hv[u] = ph[e], dv[u] = __ldcs(pd + e);
      }
#pragma unroll
      for (int u = 0; u < per; u++) {
        const int e = e0 + u * 256 + tid;
        const uint32_t hw[4] = {hv[u].x, hv[u].y, hv[u].z, hv[u].w}, dw[4] = {dv[u].x, dv[u].y, dv[u].z, dv[u].w};
#pragma unroll
        for (int q = 0; q < 4; q++) {
          const float2 hf = unpack_bf16(hw[q]), df = unpack_bf16(dw[q]);
          dot += hf.x * df.x + hf.y * df.y;
        }
        const int x = (8 * e) / K, r = (8 * e) % K;
        *reinterpret_cast<uint4 *>(smem + L::oHb + (x * L::ldK + r) * 2) = dv[u];
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) sDot[warp] = dot;
  } else {
    const float4 *ph = (const float4 *)gH, *pd = (const float4 *)gdH;
    float dot = 0.f;
    constexpr int nvec = V * K / 4, per = 8;
#pragma unroll
    for (int e0 = 0; e0 < nvec; e0 += 256 * per) {
      float4 hv[per], dv[per];
#pragma unroll
      for (int u = 0; u < per; u++) {
        const int e = e0 + u * 256 + tid;
        if (nvec % (256 * per) == 0 || e < nvec) hv[u] = ph[e], dv[u] = __ldcs(pd + e);
      }
#pragma unroll
      for (int u = 0; u < per; u++) {
        const int e = e0 + u * 256 + tid;
        if (nvec % (256 * per) == 0 || e < nvec) {
          dot += hv[u].x * dv[u].x + hv[u].y * dv[u].y + hv[u].z * dv[u].z + hv[u].w * dv[u].w;
          const int x = (4 * e) / K, r = (4 * e) % K;
          *reinterpret_cast<uint2 *>(smem + L::oHb + (x * L::ldK + r) * 2) =
              make_uint2(pack_bf16(dv[u].x, dv[u].y), pack_bf16(dv[u].z, dv[u].w));
        }
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) sDot[warp] = dot;
  }
  /* vectors (float4, or S16 8 bf16) of h^T per thread: 4 .. 16 (S16: 2 .. 8); at most 8
   * are held across the rest of the item (16 spill at K = V = 128 under the 128-register
   * cap), the others load after it */
  constexpr int nvecH = V * K / kEPV, perH = nvecH / 256, earlyH = perH < 8 ? perH : 8;
  static_assert(nvecH % 256 == 0 && perH <= 16 && perH - earlyH <= earlyH, "h^T reload: two rounds at most");
  static_assert(!NP || perH == earlyH, "NP: the whole h^T reload is held for the dot");
  SV hv[earlyH];
  if constexpr (NP) {
    /* the h^T reload (L2, prefetched at the start) is issued here, before the barrier and
     * this warp's D dH^T products, so its latency hides behind P3a; held in registers for
     * the dot and the store over dH^T (loads only: same bits) */
    const SV *ph = (const SV *)gH;
#pragma unroll
    for (int u = 0; u < earlyH; u++) hv[u] = __ldcs(ph + u * 256 + tid);
  } else if (tid == 0) {
    prefetch_l2_bulk(gH, kSB); /* h is read again after P3a: keep it in L2 until then */
  }
  if constexpr (NP) cp_async_wait<1>(); /* dH^T (dD is waited for before P3b) */
  else cp_async_wait<0>();              /* dD (read from P3b on; the barriers below publish it) */
  __syncthreads();

  /* ---- P3a: per 16 steps x 64 key columns: dKnA = e^{last-gc_j} D dH^T + Ps^T qn (z_j
   * on the way); item = warp (at most 8 items).  Once a warp's D dH^T products are done it
   * no longer reads dH^T, so it issues its share of the h^T reload (L2) into registers
   * right then and finishes its item (z, Ps^T qn, the dKnA store) while those loads are in
   * flight; the barrier then only guards the shared-memory overwrite. */
  constexpr int nP3 = (C / 16) * (K / 64);
  static_assert(nP3 <= 8, "one P3 item per warp");
  {
    const int jb = (warp / (K / 64)) * 16, rb = (warp % (K / 64)) * 64;
    float acc[8][4] = {};
    if (warp < nP3) {
#pragma unroll
      for (int kt = 0; kt < V / 16; kt++) {
        uint32_t fa[4];
        ldsm_x4(s0 + L::oD + ((jb + arow) * L::ldV + kt * 16 + acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(s0 + L::oHb + ((kt * 16 + trow) * L::ldK + rb + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(acc[nt], fa, b0, b1);
          mma16816(acc[nt + 1], fa, b2, b3);
        }
      }
    }
    if constexpr (!NP) {
      /* last read of h: streaming 16-byte loads, written over dH^T after the barrier */
      const SV *ph = (const SV *)gH;
#pragma unroll
      for (int u = 0; u < earlyH; u++) hv[u] = __ldcs(ph + u * 256 + tid);
    }
    if (warp < nP3) {
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int j = jb + grp + 8 * hf;
        const float w = __expf(last - sGc[j]) * sKinv[j]; /* kinv_j: z = k_raw . acc is then kn . w (D dH^T) */
        float z = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
          acc[nt][2 * hf] *= w;
          acc[nt][2 * hf + 1] *= w;
          const float2 kv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
              smem + L::oKn + (j * L::ldK + rb + nt * 8 + 2 * tig) * 2));
          z += kv.x * acc[nt][2 * hf] + kv.y * acc[nt][2 * hf + 1];
        }
        z += __shfl_xor_sync(0xffffffffu, z, 1);
        z += __shfl_xor_sync(0xffffffffu, z, 2);
        if (tig == 0) sZ[(rb / 64) * C + j] = z;
      }
      /* + Ps^T qn: A = Ps^T (rows j, k = query a) by ldmatrix.trans from Ps [a][j] */
#pragma unroll
      for (int kt = 0; kt < TC / 16; kt++) {
        if (jb > (kt * 16 + 15) * n + n - 1) continue; /* Ps zero there */
        uint32_t fa[4];
        ldsm_x4_t(s0 + L::oPs + ((kt * 16 + atk) * L::ldC + jb + atm) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(s0 + L::oQn + ((kt * 16 + trow) * L::ldK + rb + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(acc[nt], fa, b0, b1);
          mma16816(acc[nt + 1], fa, b2, b3);
        }
      }
      /* acc = kinv_j (w (D dH^T) + Ps^T qn)_j: divide kinv_j out */
      const float n0 = 1.f / sKinv[jb + grp], n1 = 1.f / sKinv[jb + grp + 8];
      const int64_t o = CHi * C * K + (int64_t)(jb + grp) * K + rb;
      if (go.dkna16) {
        bf16 *out = reinterpret_cast<bf16 *>(go.dKnA) + o;
        uint32_t w0[8], w1[8];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
          w0[nt] = pack_bf16(acc[nt][0] * n0, acc[nt][1] * n0);
          w1[nt] = pack_bf16(acc[nt][2] * n1, acc[nt][3] * n1);
        }
        st_row_pairs<8>(out, w0, tig, true);
        st_row_pairs<8>(out + 8 * K, w1, tig, true);
      } else {
        float *out = go.dKnA + o + 2 * tig;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
          *reinterpret_cast<float2 *>(out + nt * 8) = make_float2(acc[nt][0] * n0, acc[nt][1] * n0);
          *reinterpret_cast<float2 *>(out + 8 * K + nt * 8) = make_float2(acc[nt][2] * n1, acc[nt][3] * n1);
        }
      }
    }
    if constexpr (NP) {
      /* <dH, h>: this thread's h^T vectors (the reload above) against the same vectors of
       * dH^T, still in shared memory (h^T replaces them only after the barrier below).
       * The old S16 path's per-thread order (u ascending, then the four pairs), so the
       * same float sum; the products of two bf16 values are exact in float32. */
      float dot = 0.f;
#pragma unroll
      for (int u = 0; u < perH; u++) {
        const int e = u * 256 + tid;
        const int x = (8 * e) / K, r = (8 * e) % K;
        const uint4 dv = *reinterpret_cast<const uint4 *>(smem + L::oHb + (x * L::ldK + r) * 2);
        const uint32_t hw[4] = {hv[u].x, hv[u].y, hv[u].z, hv[u].w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
        for (int q = 0; q < 4; q++) {
          const float2 hf = unpack_bf16(hw[q]), df = unpack_bf16(dw[q]);
          dot += hf.x * df.x + hf.y * df.y;
        }
      }
      dot = warp_sum(dot);
      if (lane == 0) sDot[warp] = dot;
    }
  }
  __syncthreads(); /* dH^T no longer read by any warp: h^T takes its place */
  {
    const SV *ph = (const SV *)gH;
    SV hl[perH - earlyH > 0 ? perH - earlyH : 1];
#pragma unroll
    for (int u = earlyH; u < perH; u++) hl[u - earlyH] = __ldcs(ph + u * 256 + tid);
    /* (the late h^T loads are in flight: the prefetch hints fill their latency) */
    if (do_ahead) {
      /* Cross-block pipelining through L2: the inputs of the block `ahead` slots on (h^T,
       * dH^T, D, dD by bulk prefetches; its strided k, q, dO rows a 128-byte line per
       * thread) start streaming from DRAM now, ~40% of a block lifetime before that block
       * starts, so its cp.async panels and float32 reads hit L2 and the DRAM traffic runs
       * under the resident blocks' products.  Hints only: nothing waits on them, and only
       * rows inside that block's chunk are touched. */
      const ChunkInfo cin = *reinterpret_cast<const ChunkInfo *>(smem + L::oNext);
      /* OVL: the slot's chunk from its order entry, heads fastest (its dH^T, dD may not
       * be stored yet: then the hint fetches stale lines into L2, which dstate's stores
       * then update there -- wasted, never wrong) */
      const int cn = OVL ? cin.pad : (int)(lin_ahead % gridDim.x),
                hn = OVL ? (int)(lin_ahead % H) : (int)(lin_ahead / gridDim.x);
      const int64_t CHn = (int64_t)cn * H + hn;
      if (tid == 0) {
        if constexpr (S16) {
          prefetch_l2_bulk(go.dHT16 + CHn * V * K, kSB);
          prefetch_l2_bulk(go.hT16 + CHn * V * K, kSB);
        } else {
          prefetch_l2_bulk(go.dHT32 + CHn * V * K, kSB);
          prefetch_l2_bulk(go.hT32 + CHn * V * K, kSB);
        }
      }
      if (tid == 32) {
        prefetch_l2_bulk(a.Dbuf + CHn * C * V, C * V * 2);
        prefetch_l2_bulk(a.dDbuf + CHn * C * V, C * V * 2);
      }
      constexpr int lk = K / 64, lv = V / 64, nk = C * lk, nq = TC * lk, no = TC * lv; /* 128-byte lines */
      for (int i = tid; i < nk + nq + no; i += 256) {
        const bf16 *p = nullptr;
        if (i < nk) {
          const int r = i / lk;
          if (r < cin.ntok * NN) p = gk + (((int64_t)cin.t0 * NN + r) * H + hn) * K + (i % lk) * 64;
        } else if (i < nk + nq) {
          const int r = (i - nk) / lk;
          if (r < cin.ntok) p = gq + (((int64_t)cin.t0 + r) * H + hn) * K + ((i - nk) % lk) * 64;
        } else {
          const int r = (i - nk - nq) / lv;
          if (r < cin.ntok) p = d_o + (((int64_t)cin.t0 + r) * H + hn) * V + ((i - nk - nq) % lv) * 64;
        }
        if (p) prefetch_l2_line(p);
      }
    }
#pragma unroll
    for (int u = 0; u < perH; u++) {
      const int e = u * 256 + tid;
      const int x = (kEPV * e) / K, r = (kEPV * e) % K;
      const SV v = u < earlyH ? hv[u] : hl[u - earlyH];
      if constexpr (S16)
        *reinterpret_cast<uint4 *>(smem + L::oHb + (x * L::ldK + r) * 2) = v;
      else
        *reinterpret_cast<uint2 *>(smem + L::oHb + (x * L::ldK + r) * 2) =
            make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
    }
  }
  if constexpr (NP) cp_async_wait<0>(); /* dD, read from P3b on */
  __syncthreads();

  /* ---- P3b: dWg = -dD h^T per (16 steps x 64 key columns) */
  for (int item = warp; item < (C / 16) * (K / 64); item += 8) {
    const int jb = (item / (K / 64)) * 16, rb = (item % (K / 64)) * 64;
    {
      float acc[8][4] = {};
#pragma unroll
      for (int kt = 0; kt < V / 16; kt++) {
        uint32_t fa[4];
        ldsm_x4(s0 + L::odD + ((jb + arow) * L::ldV + kt * 16 + acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(s0 + L::oHb + ((kt * 16 + trow) * L::ldK + rb + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(acc[nt], fa, b0, b1);
          mma16816(acc[nt + 1], fa, b2, b3);
        }
      }
      bf16 *out = go.dWg + CHi * C * K + (int64_t)(jb + grp) * K + rb;
      uint32_t w0[8], w1[8];
#pragma unroll
      for (int nt = 0; nt < 8; nt++) {
        w0[nt] = pack_bf16(-acc[nt][0], -acc[nt][1]);
        w1[nt] = pack_bf16(-acc[nt][2], -acc[nt][3]);
      }
      st_row_pairs<8>(out, w0, tig, true);
      st_row_pairs<8>(out + 8 * K, w1, tig, true);
    }
  }

  /* ---- P2: dqn = scale e^{gc_ia} dO h^T + Ps kn, items of 16 query rows x 32 key
   * columns; row dots qn . dqn across the items of a row through shared memory. */
  constexpr int nQ = (TC / 16) * (K / 32);
  static_assert(nQ <= 8, "one dq item per warp");
  float dqa[4][4] = {};
  const int qmb = (warp / (K / 32)) * 16, qrb = (warp % (K / 32)) * 32;
  if (warp < nQ) {
#pragma unroll
    for (int kt = 0; kt < V / 16; kt++) {
      uint32_t fa[4];
      ldsm_x4(s0 + L::odO + ((qmb + arow) * L::ldV + kt * 16 + acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
      for (int nt = 0; nt < 4; nt += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(s0 + L::oHb + ((kt * 16 + trow) * L::ldK + qrb + nt * 8 + tcol) * 2, b0, b1, b2, b3);
        mma16816(dqa[nt], fa, b0, b1);
        mma16816(dqa[nt + 1], fa, b2, b3);
      }
    }
    /* dqa = qinv_a dqn: the dO h^T part times qinv_a here, the Ps'' k_raw part has it */
    const float f0 = scale * __expf(sGc[(qmb + grp) * n + n - 1]) * sQinv[qmb + grp],
                f1 = scale * __expf(sGc[(qmb + grp + 8) * n + n - 1]) * sQinv[qmb + grp + 8];
#pragma unroll
    for (int nt = 0; nt < 4; nt++) dqa[nt][0] *= f0, dqa[nt][1] *= f0, dqa[nt][2] *= f1, dqa[nt][3] *= f1;
#pragma unroll
    for (int kt = 0; kt < C / 16; kt++) {
      if (kt * 16 > (qmb + 15) * n + n - 1) continue; /* Ps zero there */
      uint32_t fa[4];
      ldsm_x4(s0 + L::oPs + ((qmb + arow) * L::ldC + kt * 16 + acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
      for (int nt = 0; nt < 4; nt += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(s0 + L::oKn + ((kt * 16 + trow) * L::ldK + qrb + nt * 8 + tcol) * 2, b0, b1, b2, b3);
        mma16816(dqa[nt], fa, b0, b1);
        mma16816(dqa[nt + 1], fa, b2, b3);
      }
    }
    /* qn . dqn over this item's columns: quad sums, then across items in shared memory */
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      const int qa = qmb + grp + 8 * hf;
      float d = 0.f;
#pragma unroll
      for (int nt = 0; nt < 4; nt++) {
        const float2 qv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
            smem + L::oQn + (qa * L::ldK + qrb + nt * 8 + 2 * tig) * 2));
        d += qv.x * dqa[nt][2 * hf] + qv.y * dqa[nt][2 * hf + 1];
      }
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      d += __shfl_xor_sync(0xffffffffu, d, 2);
      if (tig == 0) sQdot[(qrb / 32) * TC + qa] = d;
    }
  }

  __syncthreads();

  /* ---- P4: dq out (l2-norm backward: dq = inv (dqn - qn (qn . dqn))), gate terms */
  if (warp < nQ) {
    bf16 *dq = (bf16 *)a.dq;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      const int qa = qmb + grp + 8 * hf; /* rows past the end: computed, not stored (the shuffles need every lane) */
      /* dqa = qinv dqn and qn = qinv q_raw, so dq = qinv (dqn - qn (qn . dqn)) = dqa - q_raw qinv^2 dot */
      const float inv = sQinv[qa], dot = slot_sum<L::nQd>(sQdot + qa, TC) * inv * inv;
      uint32_t w[4];
#pragma unroll
      for (int nt = 0; nt < 4; nt++) {
        float o0 = dqa[nt][2 * hf], o1 = dqa[nt][2 * hf + 1];
        if (a.l2norm) {
          const float2 qv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
              smem + L::oQn + (qa * L::ldK + qrb + nt * 8 + 2 * tig) * 2));
          o0 = o0 - qv.x * dot;
          o1 = o1 - qv.y * dot;
        }
        w[nt] = pack_bf16(o0, o1);
      }
      st_row_pairs<4>(dq + (((int64_t)ci.t0 + qa) * H + h) * K + qrb, w, tig, qa < ci.ntok);
    }
  }
  if (warp == 0) {
    float zs = 0.f;
    for (int j = lane; j < C; j += 32) zs += slot_sum<L::nZ>(sZ + j, C);
    zs = warp_sum(zs);
    float dts = 0.f;
#pragma unroll
    for (int w = 0; w < 8; w++) dts += sDot[w];
    for (int j = lane; j < C; j += 32) {
      float v = slot_sum<L::nDgc>(sDgc + j, C) - slot_sum<L::nZ>(sZ + j, C);
      if (j % n == n - 1) v += slot_sum<L::nQd>(sQdot + j / n, TC);
      if (j == C - 1) v += __expf(last) * dts + zs;
      go.dgcA[CHi * C + j] = v;
    }
  }
  /* OVL: this grid started without waiting for dstate; waiting for it here (it is done
   * with every store by the time the last counter completes) makes this grid's completion
   * imply dstate's, so whatever the stream runs next -- grad_wy, the workspace's free --
   * comes after both, as stream order promises */
  if constexpr (OVL) pdl_wait();
}

/* ------------------------------------------------------------------ per-chunk gradients, WY part */

template <int K, int V, int C, bool WG = false>
struct GradWYLayout {
  static constexpr int ldK = K + kPad, ldV = V + kPad, ldC = C + kPad;
  /* Three blocks per SM need <= 76800 bytes a block (228 KB less 1 KB reserved per block,
   * over three).  kn kn^T is not kept (W5 recomputes its tile in registers), and where kn,
   * v, dD, dW, T^T and dT together would not fit (K = V = 128, C = 64: 89856 bytes), dW
   * arrives late (kLateDW): into v's region once W3a has read v and dD for the last time,
   * from L2 (prefetched at the start); W3a leaves its dD V^T sums in a float scratch P.
   * Later tenants of dead regions (the barriers between the phases order them):
   *   early dW: dT in R2 (W3-W4), X over dD (W4-W5), G over dT (W5-W6);
   *   late dW:  P in R2 (W3a-W3b), dT over dD (W3b-W4), X over P (W4-W5), G over dD (W5-W6). */
  static constexpr int NL = (C / 16) * (C / 16 + 1) / 2;
  /* Float sums of several warps' terms (dbeta, dgc, the l2-norm dots) go to partial-sum
   * slots with one writer each, summed in a fixed order at the end (WySlots below), not
   * to shared-memory float atomics: those compile to compare-and-swap loops (ATOMS.CAST.SPIN)
   * that held ~10% of the kernel's warp stall samples (ncu, session 11), and their order
   * varied from run to run. */
  static constexpr int nS = (V / 64 + 2 * (K / 64)) * C + 2 * NL * 16;
  static constexpr int szKn = C * ldK * 2, szV = C * ldV * 2, szC = C * ldC * 2, nF = 5 * C;
  static constexpr bool kLateDW = 2 * szKn + 2 * szV + 2 * szC + (nF + nS) * 4 > 76800;
  static constexpr int szP = kLateDW ? NL * 1024 : 0;
  static constexpr int oKn = 0;                                        /* kn [C][K] */
  static constexpr int oV = oKn + szKn;                                /* v [C][V] as given; late: then dW */
  static constexpr int odD = oV + (kLateDW && szKn > szV ? szKn : szV); /* dD [C][V] */
  static constexpr int odW = kLateDW ? oV : odD + szV;                 /* dW [C][K] (state part) */
  static constexpr int oT = kLateDW ? odD + szV : odW + szKn;          /* T^T (bf16, from the prep) */
  static constexpr int oR2 = oT + szC;                                 /* dT or P (see above) */
  static constexpr int oF = oR2 + (szP > szC ? szP : szC);
  static constexpr int odT = kLateDW ? odD : oR2; /* dT diag-scaled (bf16) */
  static constexpr int oP = oR2;                  /* late: W3a's dD V^T sums (float, fragment order) */
  static constexpr int oX = kLateDW ? oR2 : odD;  /* X = dT T^T (bf16) */
  static constexpr int oG = kLateDW ? odD : oR2;  /* G = dA o beta_i Gamma (bf16) */
  static_assert(C <= V, "X, dT and G fit in the dD region");
  static constexpr int fGp = 0, fGc = C, fBeta = 2 * C, fDgc = 3 * C, fKinv = 4 * C;
  static constexpr int oS = oF + nF * 4; /* the partial-sum slots (WySlots) */
  static constexpr int total = oS + nS * 4;
  /* W6's dKnA slices (bf16, 16 rows x 64 columns = 2 KB a warp), copied in by cp.async at
   * W6's start so that their L2 latency passes under W6's products, into two regions dead
   * by then (see the tenants above): late dW, R2 (X's, W4-W5) and dD's tail past G (dT and
   * G use C x ldC of it); early dW, dD (X's, W4-W5; G is in R2) and v (read last in W3).
   * Where they do not fit (or WG), dKnA is read from global memory at W6's end as before.
   * Row r of a slice at 128 r bytes, its 16-byte chunk c at c ^ (r & 7): a warp's
   * accumulator-fragment reads (rows grp, columns 8 nt + 2 tig) are then free of bank
   * conflicts. */
  static constexpr int kNI = (C / 16) * (K / 64), kSlice = 16 * 64 * 2;
  static constexpr int kFreeA = kLateDW ? oR2 : odD, kSizeA = kLateDW ? (szP > szC ? szP : szC) : szV;
  static constexpr int kFreeB = kLateDW ? odD + szC : oV, kSizeB = kLateDW ? szV - szC : szV;
  static constexpr int kSlicesA = kSizeA / kSlice, kSlicesB = kSizeB / kSlice;
  static constexpr bool kDknaSmem = !WG && kNI <= kSlicesA + kSlicesB;
  __device__ static __forceinline__ int dkna_slice(int warp) {
    return warp < kSlicesA ? kFreeA + warp * kSlice : kFreeB + (warp - kSlicesA) * kSlice;
  }
  /* Byte offset of element (r, c) in the kn and dW panels (K columns) and in the dD panel
   * (V columns).  WG (wgmma for dVb and W6's products): those three panels are SW128
   * (wgmma_sm90.cuh, the B operands' layout; unpadded, so in the same regions with room to
   * spare) and every region starts on a 1024-byte boundary (checked below). */
  __device__ static __forceinline__ uint32_t kpos(int r, int c) {
    if constexpr (WG) return sw128_off<C>(r, c);
    else return (uint32_t)((r * ldK + c) * 2);
  }
  __device__ static __forceinline__ uint32_t dpos(int r, int c) {
    if constexpr (WG) return sw128_off<C>(r, c);
    else return (uint32_t)((r * ldV + c) * 2);
  }
  static_assert(!WG || (oKn % 1024 == 0 && odW % 1024 == 0 && odD % 1024 == 0), "SW128 panels on 1 KB boundaries");
};

/* The 16-row, 64-column item a warp owns in grad_wy's dVb (W3) and dKn (W6) products.
 * mma.sync: rows by warp / (cols / 64).  WG: the warpgroup (warps 0-3, 4-7) is the
 * 64-column block, its four warps the 16-row slices of one m64n64 wgmma, so that the
 * accumulator is the same registers in the same order either way. */
template <int COLS, bool WG>
__device__ __forceinline__ void wy_item(int warp, int &rowb, int &colb) {
  if constexpr (WG) {
    rowb = (warp & 3) * 16;
    colb = (warp >> 2) * 64;
  } else {
    rowb = warp / (COLS / 64) * 16;
    colb = warp % (COLS / 64) * 64;
  }
}

/* acc (this warp's 16 x 64 of a 64 x 64 warpgroup product) += A B over the chunk's C rows:
 * A's 16 x 16 tile kt from load(kt, fa) (this warp's rows; zeros where A is zero), B the
 * 64-column block at panel (a SW128 panel of C rows, MN-major: its rows are the k index).
 * One k16 product per commit group, the A fragments in two buffers: tile kt + 1 is read
 * from shared memory while product kt runs, and a buffer is refilled only once the
 * product that read it is done (wait_group 1) -- 8 fragment registers instead of 4 C / 16
 * (all four tiles held spilled 100 bytes at 80 registers).  Returns with every product
 * done; the accumulator fences keep the compiler from moving its reads or writes across
 * the asynchronous products. */
template <int C, class Load>
__device__ __forceinline__ void wy_wgmma(float (&acc)[8][4], Load load, uint32_t panel) {
  uint32_t fa[2][4];
  wg_fence_acc(acc);
#pragma unroll
  for (int kt = 0; kt < C / 16; kt++) {
    if (kt >= 2) wg_wait<1>();
    load(kt, fa[kt & 1]);
    wg_fence();
    wg_m64n64k16_rs<1>(acc, fa[kt & 1], wg_desc_sw128(panel + kt * 2048, C * 128, 1024));
    wg_commit();
  }
  wg_wait<0>();
  wg_fence_acc(acc);
}

/* A special register (0: %tid.x, 1: %ctaid.x, 2: %ctaid.y) read anew: volatile, so never
 * merged with an earlier read -- a way to make the compiler recompute values derived from
 * it instead of keeping them live (or spilled) for the whole kernel. */
template <int R>
__device__ __forceinline__ int fresh_sreg() {
  int t;
  if constexpr (R == 0) asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  if constexpr (R == 1) asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(t));
  if constexpr (R == 2) asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(t));
  return t;
}

/* The lower 16x16 tiles (tj <= ti) of a C x C matrix, numbered row by row: t = ti (ti + 1) / 2
 * + tj.  The item loops below deal these out to the warps, so at C = 48 (6 lower tiles) no
 * warp gets two while others get none (the upper tiles used to take slots of the deal). */
__device__ __forceinline__ void lower_tile(int t, int &ti, int &tj) {
  /* t < 10 (C <= 64): ti, tj are nibble t of 0x3333222110, 0x3210210100 (no loop) */
  ti = (int)((0x3333222110ull >> (4 * t)) & 15u);
  tj = (int)((0x3210210100ull >> (4 * t)) & 15u);
}

/* Which lower tiles a warp takes in W4 (X = dT T^T: tj + 1 k16 steps) and W5 (dA = -T^T X:
 * NB - ti steps, then the heavy epilogue), slot 0 and 1; -1: none.  Up to 8 tiles, tile =
 * warp.  At C = 64 (10 tiles) two warps take two, and those get the cheapest: W5 warps 6, 7
 * the tiles of row 3 (one step each) where tile = warp, warp + 8 gave warps 0, 1 five steps
 * and two epilogues; W4 the tiles of column 0 (one step each) to warps 6, 7.  (ncu, session
 * 11: the barrier after W5 held ~8% of grad_wy's warp stall samples.) */
template <int NL>
__device__ __forceinline__ int w5_tile(int warp, int slot) {
  static_assert(NL <= 10, "C <= 64");
  if (slot == 0) return warp < NL ? warp : -1;
  return NL > 8 && warp >= 16 - NL ? warp + NL - 8 : -1;
}
template <int NL>
__device__ __forceinline__ int w4_tile(int warp, int slot) {
  static_assert(NL <= 10, "C <= 64");
  if constexpr (NL == 10) /* slot 0: tiles 2 4 5 7 8 9 0 1 (nibble = warp), slot 1: 3 6 for warps 6 7 */
    return slot == 0 ? (int)((0x10987542u >> (4 * warp)) & 15u) : warp >= 6 ? (warp == 6 ? 3 : 6) : -1;
  else
    return slot == 0 && warp < NL ? warp : -1;
}

/* grad_wy's partial sums (GradWYLayout::nS floats at oS), each slot written by one lane of
 * one warp, then summed in a fixed order by warp 7 after W6 (dbeta, dgc) and by the dk
 * store (the l2-norm dot):
 *   dvb[b][j]  W3:  v_j . dVb_j over the 64 value columns of block b
 *   row[t][r]  W5:  sum_m dA_im e^{gc_i - gc_m} kk_im of tile t = (ti, tj), row i = 16 ti + r
 *   col[t][r]  W5:  -sum_i dA_im A_im of tile t, column m = 16 tj + r
 *   dkb[b][j]  W6:  e^{gc_j} kn_j . dKb_j over the 64 key columns of block b
 *   dot[b][j]  W6:  kn_j . dKn_j over the same columns
 * dbeta_j = dvb + row + dkb terms;  dgc_j = dgcA_j + beta_j (row + dkb terms) + col terms
 * (W5's row term of dgc, sum_m dA_im A_im, is beta_i times its row term of dbeta, as
 * A_im = beta_i e kk_im; W6's is beta_j s).  Offsets in floats. */
template <int K, int V, int C>
struct WySlots {
  static constexpr int NB = C / 16, NL = NB * (NB + 1) / 2;
  static constexpr int dvb = 0, row = dvb + (V / 64) * C, col = row + NL * 16, dkb = col + NL * 16, dot = dkb + (K / 64) * C;
  static constexpr int count = dot + (K / 64) * C;
  __device__ static __forceinline__ float dot_sum(const float *S, int j) { return slot_sum<K / 64>(S + dot + j, C); }
  /* row j's W5 and W6 terms of dbeta (the ones dgc takes times beta_j) */
  __device__ static __forceinline__ float wb_sum(const float *S, int j) {
    const int ti = j >> 4, r = j & 15;
    float x = 0.f;
#pragma unroll
    for (int tj = 0; tj < NB; tj++)
      if (tj <= ti) x += S[row + (ti * (ti + 1) / 2 + tj) * 16 + r];
#pragma unroll
    for (int b = 0; b < K / 64; b++) x += S[dkb + b * C + j];
    return x;
  }
  __device__ static __forceinline__ float dvb_sum(const float *S, int j) { return slot_sum<V / 64>(S + dvb + j, C); }
  __device__ static __forceinline__ float col_sum(const float *S, int m) {
    const int tj = m >> 4, r = m & 15;
    float x = 0.f;
#pragma unroll
    for (int ti = 0; ti < NB; ti++)
      if (ti >= tj) x += S[col + (ti * (ti + 1) / 2 + tj) * 16 + r];
    return x;
  }
};

/* A lane's ldmatrix row / column maps and its accumulator row / column pair (grp, tig),
 * computed from a fresh read of %tid.x: each phase of grad_wy_kernel_v3 takes its own copy,
 * so that none is held (or spilled) across the barriers -- they cost a few integer
 * instructions to rebuild, registers otherwise.  arow/acol: A operand (and the .trans B
 * operand: row = k); atk/atm: A operand by .trans; nrow/ncol: B operand, non-transposed. */
struct LaneMaps {
  int grp, tig, arow, acol, atk, atm, nrow, ncol;
};
__device__ __forceinline__ LaneMaps lane_maps() {
  const int l = fresh_sreg<0>() & 31;
  return {l >> 2, l & 3, (l & 7) + 8 * ((l >> 3) & 1), 8 * (l >> 4), (l & 7) + 8 * (l >> 4), 8 * ((l >> 3) & 1),
          (l & 7) + 8 * (l >> 4), 8 * ((l >> 3) & 1)};
}

/* Blocks per SM that grad_wy_kernel_v3 is compiled for, where ptxas (nvcc 13.0) fits it
 * with 0 bytes spilled: three (80 registers) at C = 32 and 48 except K = 128, V = 64, and
 * at C = 64 with K = V = 128 (since wy2: no KK region, late dW); two (128 registers)
 * elsewhere (at 80 those spill 4-8 bytes: C = 48 K = 128 V = 64, and C = 64 but for
 * K = V = 128).  Shared memory (GradWYLayout, 1 KB reserved per block included) is
 * <= 76800 + 1024 bytes a block in every shape, so three fit in 228 KB. */
constexpr int grad_wy_blocks(int K, int V, int C) {
  return C == 64 ? (K == 128 && V == 128 ? 3 : 2) : (K == 128 && V == 64 ? 2 : 3);
}

/* grad_wy's dT tile (ti, tj), in two halves (W3 / W3a, W3b): acc += dD[ti] V[tj]^T, then
 * acc + dW[ti] kn[tj]^T diag(e^{gc}) scaled by beta_j into dT (bf16, shared). */
template <class L, int V>
__device__ __forceinline__ void grad_wy_dDVt(uint32_t s0, int ti, int tj, const LaneMaps &m, float (&acc)[2][4]) {
#pragma unroll
  for (int kt = 0; kt < V / 16; kt++) {
    uint32_t fa[4], b0, b1, b2, b3;
    ldsm_x4(s0 + L::odD + L::dpos(ti * 16 + m.arow, kt * 16 + m.acol), fa[0], fa[1], fa[2], fa[3]);
    ldsm_x4(s0 + L::oV + ((tj * 16 + m.nrow) * L::ldV + kt * 16 + m.ncol) * 2, b0, b1, b2, b3);
    mma16816(acc[0], fa, b0, b1);
    mma16816(acc[1], fa, b2, b3);
  }
}
template <class L, int K>
__device__ __forceinline__ void grad_wy_dT_out(unsigned char *smem, uint32_t s0, int ti, int tj, const LaneMaps &m,
                                               const float (&acc)[2][4], const float *sGc, const float *sBeta) {
  float acg[2][4] = {};
#pragma unroll
  for (int kt = 0; kt < K / 16; kt++) {
    uint32_t fa[4], b0, b1, b2, b3;
    ldsm_x4(s0 + L::odW + L::kpos(ti * 16 + m.arow, kt * 16 + m.acol), fa[0], fa[1], fa[2], fa[3]);
    ldsm_x4(s0 + L::oKn + L::kpos(tj * 16 + m.nrow, kt * 16 + m.ncol), b0, b1, b2, b3);
    mma16816(acg[0], fa, b0, b1);
    mma16816(acg[1], fa, b2, b3);
  }
#pragma unroll
  for (int nt = 0; nt < 2; nt++) {
    const int j = tj * 16 + nt * 8 + 2 * m.tig;
    const float e0 = __expf(sGc[j]), e1 = __expf(sGc[j + 1]);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      const int i = ti * 16 + m.grp + 8 * hf;
      *reinterpret_cast<uint32_t *>(smem + L::odT + (i * L::ldC + j) * 2) =
          pack_bf16(sBeta[j] * (acc[nt][2 * hf] + e0 * acg[nt][2 * hf]),
                    sBeta[j + 1] * (acc[nt][2 * hf + 1] + e1 * acg[nt][2 * hf + 1]));
    }
  }
}

/* W5's kn kn^T tile (ti, tj) in registers: kk += kn[ti] kn[tj]^T over K (the products and
 * order W1 used when KK was kept in shared memory). */
template <class L, int K>
__device__ __forceinline__ void grad_wy_kk(uint32_t s0, int ti, int tj, const LaneMaps &m, float (&kk)[2][4]) {
#pragma unroll
  for (int kt = 0; kt < K / 16; kt++) {
    uint32_t fa[4], b0, b1, b2, b3;
    ldsm_x4(s0 + L::oKn + L::kpos(ti * 16 + m.arow, kt * 16 + m.acol), fa[0], fa[1], fa[2], fa[3]);
    ldsm_x4(s0 + L::oKn + L::kpos(tj * 16 + m.nrow, kt * 16 + m.ncol), b0, b1, b2, b3);
    mma16816(kk[0], fa, b0, b1);
    mma16816(kk[1], fa, b2, b3);
  }
}

/* The WY part of the per-chunk gradients (one block of 8 warps per (chunk, head)), after
 * grad_state_kernel_v3 (its dKnA, dWg, dgcA) and the recompute's prep (T^T, bf16, the
 * only precision this kernel uses T in: every product with T is on bf16 mma operands,
 * and the epilogues use A, recomputed in float32 from kn kn^T) -- variant 2's phases
 * P7-P8 on mma.sync:
 *   A = strictly-lower(beta_i e^{gc_i-gc_j} kn_i.kn_j),  T = (I + A)^-1 (the prep's)
 *   dVb = T^T dD:  dv = beta dVb,  dbeta += v . dVb
 *   dKb = T^T dW:  dKn += beta e^{gc} dKb,  s = e^{gc} kn . dKb: dbeta += s, dgc += beta s
 *   dT = (dD V^T + dW kn^T diag(e^{gc})) diag(beta),  X = dT T^T,  dA = -T^T X (strictly lower)
 *   G = dA o beta_i e^{gc_i-gc_j}: dKn += G kn + G^T kn; dbeta_i += sum_j dA e kk;
 *   dgc_i += sum_j dA A_ij, dgc_j -= sum_i dA A_ij
 *   dk = l2-norm backward of dKnA + dKn;  dg = reverse cumsum of dgcA + dgc (step 0 rows).
 * Warp w < (C/16)(K/64) owns the dKn item (16 steps x 64 key columns) in registers from
 * dKb to the dk store.  Blocks per SM: grad_wy_blocks.
 * NEW (default; GDP_CUDA_V3_WY=old the session-5 schedule, =compare both, byte for byte):
 * the same products in the same order, scheduled differently (NOTES.md "grad_wy wy5"):
 * with kLateDW, W5's kn kn^T tiles are computed while dW comes in from L2 (they only read
 * kn) instead of in W5; dKnA (and, late, dW) are prefetched into L2 again nearer their
 * use; dg's reverse cumsum is stored by the 32 lanes of warp 7 instead of one thread. */
template <int K, int V, int C, int TC, bool NEW = true, int WGB = 0>
__global__ void __launch_bounds__(256, WGB ? WGB : grad_wy_blocks(K, V, C)) grad_wy_kernel_v3(GdpArgs a, GradStateOut go) {
  pdl_wait(); /* the state part's dKnA, dWg, dgcA */
  constexpr bool WG = WGB != 0; /* WGB: wgmma, compiled for WGB blocks per SM */
  using L = GradWYLayout<K, V, C, WG>;
  static_assert(!WG || (NEW && C == 64 && K == 128 && V == 128 && L::kLateDW),
                "WG: the 64-row products of C = 64, K = V = 128 (two warpgroups, one 64-column block each)");
  constexpr bool kPreKK = NEW && L::kLateDW; /* W5's kk computed in the dW wait */
  constexpr int NN = C / TC, NB = C / 16, NI = (C / 16) * (K / 64), NL = NB * (NB + 1) / 2, NVB = NB * (V / 64);
  static_assert(K % 64 == 0 && V % 64 == 0 && C % 16 == 0 && C <= 64 && NI <= 8 && NL <= 10, "shapes");
  static_assert(L::total <= 76800 || grad_wy_blocks(K, V, C) < 3, "three blocks per SM fit in shared memory");
  extern __shared__ __align__(128) unsigned char smem[];
  const int c = blockIdx.x, h = blockIdx.y;
  const ChunkInfo ci = a.chunks[c];
  const int H = a.H, n = NN, nv = ci.ntok * NN;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t CHi = (int64_t)c * H + h;
  const int64_t krow0 = (int64_t)ci.t0 * NN;
  const bf16 *gk = (const bf16 *)a.k, *gv = (const bf16 *)a.v, *gg = (const bf16 *)a.g,
             *gbeta = (const bf16 *)a.beta;
  float *sF = (float *)(smem + L::oF);
  float *sGp = sF + L::fGp, *sGc = sF + L::fGc, *sBeta = sF + L::fBeta, *sDgc = sF + L::fDgc, *sKinv = sF + L::fKinv;
  using WS = WySlots<K, V, C>; /* the partial sums, at S (every slot written once: no zeroing) */
  static_assert(WS::count == L::nS, "slots");
  float *S = (float *)(smem + L::oS);
  const uint32_t s0 = smem_addr(smem);
  if (WG && (s0 & 1023)) __trap(); /* the SW128 panels' swizzle is that of absolute addresses */

  /* ---- loads, by cp.async in two groups: the raw k rows (normalised in place below),
   * then v, dD, dW and T^T (first read in W3, so their latency overlaps the norms).
   * dKnA (read at the end) is pulled into L2 now so that that read does not wait on
   * DRAM; so is dW where it arrives late (kLateDW: copied in after W3a). */
  if constexpr (WG) copy_panel_sw128<C, K, 256>(smem + L::oKn, gk + (krow0 * H + h) * K, (int64_t)H * K, nv);
  else copy_panel<C, K, 256>(smem + L::oKn, L::ldK, gk + (krow0 * H + h) * K, (int64_t)H * K, nv);
  cp_async_commit();
  copy_panel<C, V, 256>(smem + L::oV, L::ldV, gv + (krow0 * H + h) * V, (int64_t)H * V, nv);
  if constexpr (WG) copy_panel_sw128<C, V, 256>(smem + L::odD, a.dDbuf + CHi * C * V, V, C);
  else copy_panel<C, V, 256>(smem + L::odD, L::ldV, a.dDbuf + CHi * C * V, V, C);
  if constexpr (!L::kLateDW) copy_panel<C, K, 256>(smem + L::odW, L::ldK, go.dWg + CHi * C * K, K, C);
  copy_panel<C, C, 256>(smem + L::oT, L::ldC, go.Tt + CHi * C * C, C, C);
  cp_async_commit();
  if (tid == 0 && (go.wy_pf & 1)) prefetch_l2_bulk(dkna_slice(go, CHi, C * K), dkna_bytes(go, C * K));
  if (L::kLateDW && tid == 32 && (go.wy_pf & 4)) prefetch_l2_bulk(go.dWg + CHi * C * K, C * K * 2);
  if (tid < C) {
    const bool ok = tid < nv;
    sGp[tid] = (gg && ok && tid % n == 0) ? __bfloat162float(gg[((int64_t)ci.t0 + tid / n) * H + h]) : 0.f;
    sBeta[tid] = ok ? __bfloat162float(gbeta[(krow0 + tid) * H + h]) : 0.f;
    sDgc[tid] = go.dgcA[CHi * C + tid];
  }
  cp_async_wait<1>(); /* k */
  __syncthreads();
  if (tid == 32 * 7) { /* same summation order as the prep (a running sum from m = 0), by
                        * one thread: its C values are read first, then C dependent adds
                        * (each of C threads summing its own prefix was ~C shared-memory
                        * round trips on the last one) */
    float gp[C];
#pragma unroll
    for (int i = 0; i < C; i += 4) {
      const float4 v4 = *reinterpret_cast<const float4 *>(sGp + i);
      gp[i] = v4.x, gp[i + 1] = v4.y, gp[i + 2] = v4.z, gp[i + 3] = v4.w;
    }
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < C; i++) {
      acc += gp[i];
      gp[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < C; i += 4) *reinterpret_cast<float4 *>(sGc + i) = make_float4(gp[i], gp[i + 1], gp[i + 2], gp[i + 3]);
  }
  /* ---- kn: l2 norms */
  { /* kn in place, the forward prep's l2 norm (row_l2_inv, shared with gdp_fwd_v3.cu): LPR =
     * K / 8 lanes per row, 8 elements (one 16-byte chunk, whole under the SW128 swizzle too)
     * a lane, RPS rows per warp and step -- the same sums in the same order, so kn and kinv
     * are the prep's bit for bit.  It was a warp per row (2-byte accesses, five-shuffle sums, eight rows in
     * turn): ~16% of the kernel's warp stall samples with the gate's cumsum (ncu, session
     * 11), where grad_state's quad-per-row norms had been made cheap in session 5.  Rows
     * past the end were zero-filled. */
    constexpr int LPR = K / 8, RPS = 32 / LPR, STEPS = (C + 8 * RPS - 1) / (8 * RPS);
    static_assert(C % RPS == 0, "a step's rows of a warp are all in or all out (its shuffles need every lane)");
    const int sub = lane / LPR, c8 = (lane % LPR) * 8;
#pragma unroll 2 /* two steps' loads in flight; fully unrolled, C = 64 spilled 8 bytes at 80 registers */
    for (int st = 0; st < STEPS; st++) {
      const int i = (st * 8 + warp) * RPS + sub;
      if (C % (8 * RPS) != 0 && i >= C) break; /* warp-uniform */
      unsigned char *src = smem + L::oKn + L::kpos(i, c8);
      const uint4 raw = *reinterpret_cast<const uint4 *>(src);
      float x[8];
      const float inv = row_l2_inv<LPR>(raw, x, a.l2norm);
      uint32_t kn[4];
#pragma unroll
      for (int m = 0; m < 4; m++) kn[m] = pack_bf16(x[2 * m] * inv, x[2 * m + 1] * inv);
      *reinterpret_cast<uint4 *>(src) = make_uint4(kn[0], kn[1], kn[2], kn[3]);
      if (lane % LPR == 0) sKinv[i] = inv;
    }
  }
  if constexpr (WG) fence_proxy_async_smem(); /* kn is W6's wgmma operand */
  __syncthreads();


  cp_async_wait<0>(); /* v, dD, dW, T^T */
  if constexpr (WG) fence_proxy_async_smem(); /* dD: dVb's wgmma operand */
  __syncthreads();
  if constexpr (NEW && L::kLateDW) /* again, nearer its copy (W3a's end): the first may have left L2 */
    if (tid == 32) prefetch_l2_bulk(go.dWg + CHi * C * K, C * K * 2);

  /* ---- W3: dVb (dv out) and the dT tiles (dT item t to warp 7 - t % 8: the dVb items
   * of the high warps are the short ones, vjb near C).  dKb = T^T dW is computed in W6,
   * where its accumulators are needed (T^T and dW stay untouched until then): held from
   * here to W6 they made C = 48 spill at 128 registers. */
  for (int item = warp; item < NVB; item += 8) { /* dVb = T^T dD (WG: NVB = 8, one item a warp) */
    const LaneMaps m = lane_maps();
    int vjb, xb;
    wy_item<V, WG>(item, vjb, xb);
    float acc[8][4] = {};
    if constexpr (WG) { /* the warpgroup's 64 x 64 block in one product; T^T's zero tiles as zero fragments */
      wy_wgmma<C>(
          acc,
          [&](int kt, uint32_t(&f)[4]) {
            f[0] = f[1] = f[2] = f[3] = 0u;
            if (kt * 16 + 15 >= vjb) ldsm_x4(s0 + L::oT + ((vjb + m.arow) * L::ldC + kt * 16 + m.acol) * 2, f[0], f[1], f[2], f[3]);
          },
          s0 + L::odD + L::dpos(0, xb));
    } else {
#pragma unroll
      for (int kt = 0; kt < NB; kt++) {
        if (kt * 16 + 15 < vjb) continue;
        uint32_t fa[4];
        ldsm_x4(s0 + L::oT + ((vjb + m.arow) * L::ldC + kt * 16 + m.acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(s0 + L::odD + L::dpos(kt * 16 + m.arow, xb + nt * 8 + m.acol), b0, b1, b2, b3);
          mma16816(acc[nt], fa, b0, b1);
          mma16816(acc[nt + 1], fa, b2, b3);
        }
      }
    }
    bf16 *dv = (bf16 *)a.dv;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      const int j = vjb + m.grp + 8 * hf;
      const float bj = sBeta[j];
      float s = 0.f;
      bf16 *row = dv + ((krow0 + j) * H + h) * V + xb + 2 * m.tig;
#pragma unroll
      for (int nt = 0; nt < 8; nt++) {
        const float2 vv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
            smem + L::oV + (j * L::ldV + xb + nt * 8 + 2 * m.tig) * 2));
        s += vv.x * acc[nt][2 * hf] + vv.y * acc[nt][2 * hf + 1];
        if (j < nv) *reinterpret_cast<uint32_t *>(row + nt * 8) = pack_bf16(bj * acc[nt][2 * hf], bj * acc[nt][2 * hf + 1]);
      }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (m.tig == 0) S[WS::dvb + (xb / 64) * C + j] = s;
    }
  }
  /* dT = (dD V^T + dW kn^T diag(e^{gc})) diag(beta), lower tiles only: X's lower tiles, the
   * only ones dA reads, need dT[ti][m <= tj].  A warp has at most two items (NL <= 10),
   * slots s = 0, 1: item 7 - warp + 8 s.  With kLateDW the dD V^T sums (acc) are held in
   * registers (16 floats at most) while dW is copied over v (W3b). */
  float kkp[2][2][4] = {}; /* kPreKK: W5's kk for items warp + 8 sl */
  if constexpr (!L::kLateDW) {
    for (int item = 7 - (fresh_sreg<0>() >> 5); item < NL; item += 8) {
      int ti, tj;
      lower_tile(item, ti, tj);
      const LaneMaps m = lane_maps();
      float acc[2][4] = {};
      grad_wy_dDVt<L, V>(s0, ti, tj, m, acc);
      grad_wy_dT_out<L, K>(smem, s0, ti, tj, m, acc, sGc, sBeta);
    }
  } else {
    /* W3a: the dD V^T sums go to the float scratch oP (item t at 1 KB t, lane l's 8
     * floats at 32 l bytes): held in registers across the dW copy they spilled at 80 */
    for (int item = 7 - (fresh_sreg<0>() >> 5); item < NL; item += 8) {
      int ti, tj;
      lower_tile(item, ti, tj);
      float acc[2][4] = {};
      grad_wy_dDVt<L, V>(s0, ti, tj, lane_maps(), acc);
      float4 *p = reinterpret_cast<float4 *>(smem + L::oP + item * 1024) + 2 * (fresh_sreg<0>() & 31);
      p[0] = make_float4(acc[0][0], acc[0][1], acc[0][2], acc[0][3]);
      p[1] = make_float4(acc[1][0], acc[1][1], acc[1][2], acc[1][3]);
    }
    __syncthreads(); /* v and dD read for the last time (dVb, dD V^T): dW over v, from L2 */
    {
      const int64_t CHl = (int64_t)fresh_sreg<1>() * H + fresh_sreg<2>();
      if constexpr (WG) copy_panel_sw128<C, K, 256>(smem + L::odW, go.dWg + CHl * C * K, K, C);
      else copy_panel<C, K, 256>(smem + L::odW, L::ldK, go.dWg + CHl * C * K, K, C);
      cp_async_commit();
    }
    if constexpr (kPreKK) { /* W5's kk tiles (items warp, warp + 8) while dW is in flight */
      const int w = fresh_sreg<0>() >> 5;
#pragma unroll
      for (int sl = 0; sl < 2; sl++) {
        const int item = w5_tile<NL>(w, sl);
        if (item >= 0) {
          int ti, tj;
          lower_tile(item, ti, tj);
          grad_wy_kk<L, K>(s0, ti, tj, lane_maps(), kkp[sl]);
        }
      }
    }
    cp_async_wait<0>();
    if constexpr (WG) fence_proxy_async_smem(); /* dW: W6's wgmma operand */
    __syncthreads();
    /* ---- W3b: dT (over dD) from the scratch sums and dW kn^T */
    for (int item = 7 - (fresh_sreg<0>() >> 5); item < NL; item += 8) {
      int ti, tj;
      lower_tile(item, ti, tj);
      const float4 *p = reinterpret_cast<const float4 *>(smem + L::oP + item * 1024) + 2 * (fresh_sreg<0>() & 31);
      const float4 p0 = p[0], p1 = p[1];
      const float acc[2][4] = {{p0.x, p0.y, p0.z, p0.w}, {p1.x, p1.y, p1.z, p1.w}};
      grad_wy_dT_out<L, K>(smem, s0, ti, tj, lane_maps(), acc, sGc, sBeta);
    }
  }
  __syncthreads();

  /* ---- W4: X = dT T^T (T[j][m] = 0 for m > j); only the lower tiles: dA[ti][tj <= ti]
   * reads X[m][tj] for m >= ti >= tj */
  if constexpr (NEW) /* dKnA into L2 again, nearer its read (W6's end) */
    if (fresh_sreg<0>() == 0 && (go.wy_pf & 2))
      prefetch_l2_bulk(dkna_slice(go, (int64_t)fresh_sreg<1>() * H + fresh_sreg<2>(), C * K), dkna_bytes(go, C * K));
#pragma unroll
  for (int sl = 0; sl < 2; sl++) {
    const int item = w4_tile<NL>(warp, sl);
    if (item < 0) continue;
    int ti, tj;
    lower_tile(item, ti, tj);
    const LaneMaps m = lane_maps();
    float acc[2][4] = {};
#pragma unroll
    for (int kt = 0; kt < NB; kt++) {
      if (kt > tj) continue;
      uint32_t fa[4], b0, b1, b2, b3;
      ldsm_x4(s0 + L::odT + ((ti * 16 + m.arow) * L::ldC + kt * 16 + m.acol) * 2, fa[0], fa[1], fa[2], fa[3]);
      ldsm_x4_t(s0 + L::oT + ((kt * 16 + m.arow) * L::ldC + tj * 16 + m.acol) * 2, b0, b1, b2, b3);
      mma16816(acc[0], fa, b0, b1);
      mma16816(acc[1], fa, b2, b3);
    }
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int i = ti * 16 + m.grp + 8 * hf, j = tj * 16 + nt * 8 + 2 * m.tig;
        *reinterpret_cast<uint32_t *>(smem + L::oX + (i * L::ldC + j) * 2) =
            pack_bf16(acc[nt][2 * hf], acc[nt][2 * hf + 1]);
      }
  }
  __syncthreads();

  /* ---- W5: dA = -T^T X on the strictly lower part; G -> shared (lower tiles: W6 reads
   * G[jb][m <= jb] and G[m >= jb][jb] only); dbeta, dgc sums.  The tile's kn kn^T (kk)
   * is computed here, in registers (it used to be a W1 phase into 17 KB of shared
   * memory at C = 64; same products, same order, so the same floats). */
#pragma unroll
  for (int sl = 0; sl < 2; sl++) {
    const int item = w5_tile<NL>(warp, sl);
    if (item < 0) continue;
    int ti, tj;
    lower_tile(item, ti, tj);
    const LaneMaps m = lane_maps();
    float acc[2][4] = {}, kk[2][4] = {};
    if constexpr (kPreKK) {
#pragma unroll
      for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) kk[nt][e] = kkp[sl][nt][e];
    } else {
      grad_wy_kk<L, K>(s0, ti, tj, m, kk);
    }
    {
#pragma unroll
      for (int kt = 0; kt < NB; kt++) {
        if (kt < ti) continue; /* T^T[i][m] = 0 for m < i */
        uint32_t fa[4], b0, b1, b2, b3;
        ldsm_x4(s0 + L::oT + ((ti * 16 + m.arow) * L::ldC + kt * 16 + m.acol) * 2, fa[0], fa[1], fa[2], fa[3]);
        ldsm_x4_t(s0 + L::oX + ((kt * 16 + m.arow) * L::ldC + tj * 16 + m.acol) * 2, b0, b1, b2, b3);
        mma16816(acc[0], fa, b0, b1);
        mma16816(acc[1], fa, b2, b3);
      }
    }
    float rdb[2] = {}, cdg[2][2] = {};
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int i = ti * 16 + m.grp + 8 * hf, j0 = tj * 16 + nt * 8 + 2 * m.tig;
        float gv[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const int j = j0 + e;
          gv[e] = 0.f;
          if (i > j) {
            const float da = -acc[nt][2 * hf + e], ee = __expf(sGc[i] - sGc[j]), kkij = kk[nt][2 * hf + e];
            const float aij = sBeta[i] * ee * kkij; /* = A_ij, recomputed (A is not kept) */
            gv[e] = da * sBeta[i] * ee;
            rdb[hf] += da * ee * kkij;
            cdg[nt][e] -= da * aij;
          }
        }
        *reinterpret_cast<uint32_t *>(smem + L::oG + (i * L::ldC + j0) * 2) = pack_bf16(gv[0], gv[1]);
      }
    {
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        float b = rdb[hf];
        b += __shfl_xor_sync(0xffffffffu, b, 1);
        b += __shfl_xor_sync(0xffffffffu, b, 2);
        if (m.tig == 0) S[WS::row + item * 16 + m.grp + 8 * hf] = b;
      }
#pragma unroll
      for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          float v = cdg[nt][e];
          v += __shfl_xor_sync(0xffffffffu, v, 4);
          v += __shfl_xor_sync(0xffffffffu, v, 8);
          v += __shfl_xor_sync(0xffffffffu, v, 16);
          if (m.grp == 0) S[WS::col + item * 16 + nt * 8 + 2 * m.tig + e] = v;
        }
    }
  }
  __syncthreads();

  /* W6 and the stores after it take the block's indices afresh (fresh_sreg: volatile
   * reads of %tid.x, %ctaid.x/y, which the compiler neither hoists nor merges with the
   * first; the chunk's row range is read again, from L1): derived from the first reads,
   * the row offsets, nv, krow0 and the lane maps stayed live from the loads on and were
   * spilled at 128 registers (C = 64) and at 80 (three blocks per SM); the stores after
   * W6's barrier take them anew again (C = 64 at 80 registers).  The names shadow the
   * first ones on purpose: the code below reads as the rest of the kernel. */
  float dkn[8][4] = {};
  {
    const int warp = fresh_sreg<0>() >> 5;
    const LaneMaps m = lane_maps();
    int jb, rb;
    wy_item<K, WG>(warp, jb, rb);
    const int64_t CHi = (int64_t)fresh_sreg<1>() * H + fresh_sreg<2>();
    /* ---- W6: own item: dKn = beta e^{gc} (T^T dW) + G kn + G^T kn + dKnA; l2-norm
     * backward; dk out */
    if (warp < NI) {
      if constexpr (L::kDknaSmem)
        if (go.dkna16) { /* this warp's dKnA slice into shared memory, read after the products */
          const bf16 *src = reinterpret_cast<const bf16 *>(go.dKnA) + CHi * C * K + (int64_t)jb * K + rb;
          unsigned char *dst = smem + L::dkna_slice(warp);
          const int lane = fresh_sreg<0>() & 31;
#pragma unroll
          for (int u = 0; u < 4; u++) {
            const int e = lane + 32 * u, r = e >> 3, c = e & 7;
            cp_async16(dst + r * 128 + ((c ^ (r & 7)) << 4), src + (int64_t)r * K + 8 * c, true);
          }
          cp_async_commit();
        }
      if constexpr (WG) { /* dKb = T^T dW; T^T's zero tiles (i < j) as zero fragments */
        wy_wgmma<C>(
            dkn,
            [&](int kt, uint32_t(&f)[4]) {
              f[0] = f[1] = f[2] = f[3] = 0u;
              if (kt * 16 + 15 >= jb) ldsm_x4(s0 + L::oT + ((jb + m.arow) * L::ldC + kt * 16 + m.acol) * 2, f[0], f[1], f[2], f[3]);
            },
            s0 + L::odW + L::kpos(0, rb));
      } else {
#pragma unroll
        for (int kt = 0; kt < NB; kt++) { /* dKb = T^T dW */
          if (kt * 16 + 15 < jb) continue; /* T^T[j][i] = 0 for i < j */
          uint32_t fa[4];
          ldsm_x4(s0 + L::oT + ((jb + m.arow) * L::ldC + kt * 16 + m.acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
          for (int nt = 0; nt < 8; nt += 2) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(s0 + L::odW + L::kpos(kt * 16 + m.arow, rb + nt * 8 + m.acol), b0, b1, b2, b3);
            mma16816(dkn[nt], fa, b0, b1);
            mma16816(dkn[nt + 1], fa, b2, b3);
          }
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; hf++) { /* s = e^{gc} kn . dKb: dbeta += s, dgc += beta s; scale */
        const int j = jb + m.grp + 8 * hf;
        const float eg = __expf(sGc[j]), bj = sBeta[j];
        float s = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
          const float2 kv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
              smem + L::oKn + L::kpos(j, rb + nt * 8 + 2 * m.tig)));
          s += kv.x * dkn[nt][2 * hf] + kv.y * dkn[nt][2 * hf + 1];
          dkn[nt][2 * hf] *= bj * eg;
          dkn[nt][2 * hf + 1] *= bj * eg;
        }
        s *= eg;
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (m.tig == 0) S[WS::dkb + (rb / 64) * C + j] = s;
      }
      if constexpr (WG) { /* G kn, then G^T kn, each one warpgroup product over the C rows of kn;
                           * G's unwritten upper tiles as zero fragments */
        wy_wgmma<C>(
            dkn,
            [&](int kt, uint32_t(&f)[4]) {
              f[0] = f[1] = f[2] = f[3] = 0u;
              if (kt * 16 <= jb + 15) /* G[j][m] = 0 for m >= j */
                ldsm_x4(s0 + L::oG + ((jb + m.arow) * L::ldC + kt * 16 + m.acol) * 2, f[0], f[1], f[2], f[3]);
            },
            s0 + L::oKn + L::kpos(0, rb));
        wy_wgmma<C>(
            dkn,
            [&](int kt, uint32_t(&f)[4]) {
              f[0] = f[1] = f[2] = f[3] = 0u;
              if (kt * 16 + 15 > jb) /* G[m][j] = 0 for m <= j */
                ldsm_x4_t(s0 + L::oG + ((kt * 16 + m.atk) * L::ldC + jb + m.atm) * 2, f[0], f[1], f[2], f[3]);
            },
            s0 + L::oKn + L::kpos(0, rb));
      } else {
#pragma unroll
        for (int kt = 0; kt < NB; kt++) {
          if (kt * 16 > jb + 15) continue; /* G[j][m] = 0 for m >= j */
          uint32_t fa[4];
          ldsm_x4(s0 + L::oG + ((jb + m.arow) * L::ldC + kt * 16 + m.acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
          for (int nt = 0; nt < 8; nt += 2) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(s0 + L::oKn + L::kpos(kt * 16 + m.arow, rb + nt * 8 + m.acol), b0, b1, b2, b3);
            mma16816(dkn[nt], fa, b0, b1);
            mma16816(dkn[nt + 1], fa, b2, b3);
          }
        }
#pragma unroll
        for (int kt = 0; kt < NB; kt++) {
          if (kt * 16 + 15 <= jb) continue; /* G[m][j] = 0 for m <= j */
          uint32_t fa[4];
          ldsm_x4_t(s0 + L::oG + ((kt * 16 + m.atk) * L::ldC + jb + m.atm) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
          for (int nt = 0; nt < 8; nt += 2) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(s0 + L::oKn + L::kpos(kt * 16 + m.arow, rb + nt * 8 + m.acol), b0, b1, b2, b3);
            mma16816(dkn[nt], fa, b0, b1);
            mma16816(dkn[nt + 1], fa, b2, b3);
          }
        }
      }
      const int64_t o = CHi * C * K + (int64_t)(jb + m.grp) * K + rb + 2 * m.tig;
      if (L::kDknaSmem && go.dkna16) {
        cp_async_wait<0>();
        __syncwarp(); /* the other lanes' copies */
        const unsigned char *sl = smem + L::dkna_slice(warp) + m.grp * 128 + 4 * m.tig; /* rows grp, grp + 8: same swizzle */
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
          const int c = (nt ^ m.grp) << 4;
          const float2 u0 = unpack_bf16(*reinterpret_cast<const uint32_t *>(sl + c)),
                       u1 = unpack_bf16(*reinterpret_cast<const uint32_t *>(sl + 8 * 128 + c));
          dkn[nt][0] += u0.x, dkn[nt][1] += u0.y, dkn[nt][2] += u1.x, dkn[nt][3] += u1.y;
        }
      } else if (go.dkna16) {
        const bf16 *pa = reinterpret_cast<const bf16 *>(go.dKnA) + o;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
          const float2 u0 = unpack_bf16(*reinterpret_cast<const uint32_t *>(pa + nt * 8)),
                       u1 = unpack_bf16(*reinterpret_cast<const uint32_t *>(pa + 8 * K + nt * 8));
          dkn[nt][0] += u0.x, dkn[nt][1] += u0.y, dkn[nt][2] += u1.x, dkn[nt][3] += u1.y;
        }
      } else {
        const float *pa = go.dKnA + o;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
          const float2 u0 = *reinterpret_cast<const float2 *>(pa + nt * 8),
                       u1 = *reinterpret_cast<const float2 *>(pa + 8 * K + nt * 8);
          dkn[nt][0] += u0.x, dkn[nt][1] += u0.y, dkn[nt][2] += u1.x, dkn[nt][3] += u1.y;
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int j = jb + m.grp + 8 * hf;
        float d = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
          const float2 kv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
              smem + L::oKn + L::kpos(j, rb + nt * 8 + 2 * m.tig)));
          d += kv.x * dkn[nt][2 * hf] + kv.y * dkn[nt][2 * hf + 1];
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        if (m.tig == 0) S[WS::dot + (rb / 64) * C + j] = d;
      }
    }
  }
  __syncthreads();
  {
    const int tid = fresh_sreg<0>(), warp = tid >> 5;
    const int h = fresh_sreg<2>();
    const ChunkInfo ci = a.chunks[fresh_sreg<1>()];
    const int nv = ci.ntok * NN;
    const int64_t krow0 = (int64_t)ci.t0 * NN;
    if (warp < NI) {
      /* afresh: the kn row addresses (and jb, rb) are not kept across the barrier */
      const LaneMaps m = lane_maps();
      int jb, rb;
      wy_item<K, WG>(warp, jb, rb);
      bf16 *dk = (bf16 *)a.dk;
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int j = jb + m.grp + 8 * hf;
        const unsigned live = __ballot_sync(0xffffffffu, j < nv); /* the lanes that store (and shuffle) */
        if (j >= nv) continue;
        const float inv = sKinv[j], dot = WS::dot_sum(S, j);
        bf16 *row = dk + ((krow0 + j) * H + h) * K + rb;
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
          uint32_t w[2];
#pragma unroll
          for (int e = 0; e < 2; e++) {
            float o0 = dkn[nt + e][2 * hf], o1 = dkn[nt + e][2 * hf + 1];
            if (a.l2norm) {
              const float2 kv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
                  smem + L::oKn + L::kpos(j, rb + (nt + e) * 8 + 2 * m.tig)));
              o0 = inv * (o0 - kv.x * dot);
              o1 = inv * (o1 - kv.y * dot);
            }
            w[e] = pack_bf16(o0, o1);
          }
          st_pair_x8(row, nt, w[0], w[1], m.tig, true, live);
        }
      }
    }
    if (warp == 7) { /* the slots' sums: dbeta out, dgc's step values (before the cumsum) into sDgc */
      for (int j = tid & 31; j < C; j += 32) {
        const float w = WS::wb_sum(S, j);
        if (j < nv) ((bf16 *)a.dbeta)[(krow0 + j) * H + h] = __float2bfloat16(WS::dvb_sum(S, j) + w);
        sDgc[j] += sBeta[j] * w + WS::col_sum(S, j);
      }
      __syncwarp();
    }
    if (NEW && a.g && warp == 7) { /* as below, but the 32 lanes store: lane 0 runs the same sum
                                    * and leaves the running values in sDgc */
      if ((tid & 31) == 0) {
        float dgc[C];
#pragma unroll
        for (int i = 0; i < C; i += 4) {
          const float4 v4 = *reinterpret_cast<const float4 *>(sDgc + i);
          dgc[i] = v4.x, dgc[i + 1] = v4.y, dgc[i + 2] = v4.z, dgc[i + 3] = v4.w;
        }
        float run = 0.f;
#pragma unroll
        for (int i = C - 1; i >= 0; i--) {
          run += dgc[i];
          dgc[i] = run;
        }
#pragma unroll
        for (int i = 0; i < C; i += 4)
          *reinterpret_cast<float4 *>(sDgc + i) = make_float4(dgc[i], dgc[i + 1], dgc[i + 2], dgc[i + 3]);
      }
      __syncwarp();
      const int t = tid & 31; /* token t of the chunk: step row t n (C / n <= 32) */
      if (t * n < C && t * n < nv) ((bf16 *)a.dg)[((int64_t)ci.t0 + t) * H + h] = __float2bfloat16(sDgc[t * n]);
    }
    if (!NEW && a.g && tid == 32 * 7) { /* reverse cumsum of the step gradients; a token's dg is its step 0's.
                                 * All C values are read first (vector loads), then the same
                                 * sequential sum: the chain is C adds, not C shared-memory round trips. */
      float dgc[C];
#pragma unroll
      for (int i = 0; i < C; i += 4) {
        const float4 v4 = *reinterpret_cast<const float4 *>(sDgc + i);
        dgc[i] = v4.x, dgc[i + 1] = v4.y, dgc[i + 2] = v4.z, dgc[i + 3] = v4.w;
      }
      float run = 0.f;
      bf16 *dgo = (bf16 *)a.dg + (int64_t)ci.t0 * H + h;
#pragma unroll
      for (int i = C - 1; i >= 0; i--) {
        run += dgc[i];
        if (i % n == 0 && i < nv) dgo[(int64_t)(i / n) * H] = __float2bfloat16(run);
      }
    }
  }
}

/* ------------------------------------------------------------------ host side */

template <class Kern>
static gdp_status occupancy(Kern kern, int threads, int smem, int *blocks_per_sm) {
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  GDP_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, threads, smem));
  return GDP_OK;
}

/* The two sequential passes at the largest shared-memory carveout.  An SM's carveout is
 * set when a block starts on an idle SM and cannot change while one runs there; left to
 * the driver, a states block could start on an SM at a carveout with no room for a
 * dstate block beside it, so the forked passes (launch_state_passes) would run one after
 * the other on that SM.  H200, 1 x 32768 n = 3 forked without this: 11.0 or 13.6 ms
 * fwd+bwd from one process to the next (unforked 13.4). */
template <class Kern>
static cudaError_t seq_carveout(Kern kern) {
  return cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
}

template <int K, int V, int C, int BV>
static gdp_status launch_states(const Plan &plan, float *f32, bf16 *b16) {
  const GdpArgs &a = plan.a;
  const dim3 grid((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV));
  constexpr int threads = BV / 16 * 32;
  auto kern = b16 ? bwd_states_kernel_v3<K, V, C, BV, true, true> : bwd_states_kernel_v3<K, V, C, BV, false, true>;
  if (a.Tu) { /* U from Tu and v (the prep stored Tu^T instead of U): BV >= C */
    if constexpr (BV >= C) {
      kern = b16 ? bwd_states_kernel_v3<K, V, C, BV, true, true, true> : bwd_states_kernel_v3<K, V, C, BV, false, true, true>;
    } else {
      return GDP_ERROR(GDP_ERR_INTERNAL, "bwd_states_kernel_v3: U from Tu and v needs BV %d >= C %d", BV, C);
    }
  }
  constexpr int smem = StatesLayout<K, C, BV>::total;
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  GDP_CUDA_TRY(seq_carveout(kern));
  kern<<<grid, dim3(threads), smem, plan.stream>>>(a, f32, b16);
  GDP_CUDA_LAUNCHED("bwd_states_kernel_v3");
  return GDP_OK;
}

/* two (fork_mode 2): the 2-stage kernel with bf16-only staging, for a fork of the two
 * passes where only it fits beside a states block; else the 3-stage one. */
template <int K, int V, int C, int TC, int BV>
static gdp_status launch_dstate(const Plan &plan, float *f32, bf16 *b16, bool two) {
  const GdpArgs &a = plan.a;
  const dim3 grid((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV));
  constexpr int threads = BV / 16 * 32;
  if (two) {
    if (!b16) return GDP_ERROR(GDP_ERR_INTERNAL, "dstate_kernel_v3: 2 stages need bf16 states");
    auto kern2 = dstate_kernel_v3<K, V, C, TC, BV, true, true, 2>;
    constexpr int smem2 = DStateLayout<K, C, TC, BV, 2, true>::total;
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern2, cudaFuncAttributeMaxDynamicSharedMemorySize, smem2));
    GDP_CUDA_TRY(seq_carveout(kern2));
    kern2<<<grid, dim3(threads), smem2, plan.stream>>>(a, f32, b16, (int *)nullptr);
    GDP_CUDA_LAUNCHED("dstate_kernel_v3 (2 stages)");
    return GDP_OK;
  }
  auto kern = b16 ? dstate_kernel_v3<K, V, C, TC, BV, true, true> : dstate_kernel_v3<K, V, C, TC, BV, false, true>;
  constexpr int smem = DStateLayout<K, C, TC, BV>::total;
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  GDP_CUDA_TRY(seq_carveout(kern));
  kern<<<grid, dim3(threads), smem, plan.stream>>>(a, f32, b16, (int *)nullptr);
  GDP_CUDA_LAUNCHED("dstate_kernel_v3");
  return GDP_OK;
}

/* One launch of either sequential kernel at value-block width BV (dry_run: occupancy of
 * the dstate kernel only, the larger of the two; its float32-states instantiation, the
 * one the measured choices were made with -- same shared memory).  f32 / b16: the
 * transposed copy of h (states) or dH (dstate) for the gradient kernels, float32 or
 * bf16. */
template <int K, int V, int C, int TC, int BV>
static gdp_status launch_seq_bv(const Plan &plan, bool states, bool dry_run, int *occ, float *f32, bf16 *b16,
                                bool two) {
  constexpr int threads = BV / 16 * 32;
  if (dry_run) return occupancy(dstate_kernel_v3<K, V, C, TC, BV>, threads, DStateLayout<K, C, TC, BV>::total, occ);
  if (states) return launch_states<K, V, C, BV>(plan, f32, b16);
  return launch_dstate<K, V, C, TC, BV>(plan, f32, b16, two);
}

template <int K, int V, int C, int TC>
static gdp_status launch_seq_k(const Plan &plan, int bv, bool states, bool dry_run, int *occ, float *f32,
                               bf16 *b16, bool two) {
  switch (bv) {
    case 64: return launch_seq_bv<K, V, C, TC, 64>(plan, states, dry_run, occ, f32, b16, two);
    case 32: return launch_seq_bv<K, V, C, TC, 32>(plan, states, dry_run, occ, f32, b16, two);
    default: return launch_seq_bv<K, V, C, TC, 16>(plan, states, dry_run, occ, f32, b16, two);
  }
}

template <int K, int V>
static gdp_status launch_seq_n(const Plan &plan, int bv, bool states, bool dry_run, int *occ, float *f32,
                               bf16 *b16, bool two) {
  if (plan.a.n == 1) return launch_seq_k<K, V, 32, 32>(plan, bv, states, dry_run, occ, f32, b16, two);
  if (plan.a.n == 2) return launch_seq_k<K, V, 64, 32>(plan, bv, states, dry_run, occ, f32, b16, two);
  return launch_seq_k<K, V, 48, 16>(plan, bv, states, dry_run, occ, f32, b16, two);
}

/* The (K, V) roots: every kernel of this file is instantiated through these three, one set
 * per (K, V); the dispatchers below call them by name.  Defined at the end of the
 * namespace: all four sets here when the file is compiled whole, one set per part file
 * when it is compiled in parts (gdp_v3_split.h). */
#define GDP_V3B_DECLARE_ROOTS(K, V)                                                                             \
  gdp_status seq_k##K##v##V(const Plan &plan, int bv, bool states, bool dry_run, int *occ, float *f32, bf16 *b16, \
                            bool two);                                                                          \
  gdp_status grad_k##K##v##V(const Plan &plan, const GradStateOut &go, bool wy);                                \
  gdp_status pair_k##K##v##V(int n, int bv, int *fits);
GDP_V3B_DECLARE_ROOTS(64, 64)
GDP_V3B_DECLARE_ROOTS(64, 128)
GDP_V3B_DECLARE_ROOTS(128, 64)
GDP_V3B_DECLARE_ROOTS(128, 128)

/* two: the fork beside a 2-stage dstate (fork_mode 2) */
static gdp_status launch_seq(const Plan &plan, int bv, bool states, bool dry_run, int *occ, float *f32 = nullptr,
                             bf16 *b16 = nullptr, bool two = false) {
  const GdpArgs &a = plan.a;
  if (a.K == 128)
    return a.V == 128 ? seq_k128v128(plan, bv, states, dry_run, occ, f32, b16, two)
                      : seq_k128v64(plan, bv, states, dry_run, occ, f32, b16, two);
  return a.V == 128 ? seq_k64v128(plan, bv, states, dry_run, occ, f32, b16, two)
                    : seq_k64v64(plan, bv, states, dry_run, occ, f32, b16, two);
}

/* The per-chunk gradients: the state part, then (wy) the WY part; one 8-warp block per
 * (chunk, head) each.  The state part runs two blocks per SM (a three-block version
 * measured slower on the H200, n = 2 0.74 -> 0.89 ms: its 64-column key panels read k, q
 * and the states from L2 twice); dKnA travels as bf16 (GradStateOut::dkna16: 128 instead
 * of 256 MB written and read back at 4 x 4096 n = 2; dk's errors +0.2..0.6e-3); no early
 * L2 prefetch (it made both kernels slower). */
template <int K, int V, int C, int TC>
static gdp_status launch_grad_state_kv(const Plan &plan, const GradStateOut &go_in, bool wy) {
  const dim3 grid((unsigned)plan.a.nchunks, (unsigned)plan.a.H);
  GradStateOut go = go_in;
  go.pcol_f32 = 0;
  go.dkna16 = 1;
  go.wy_pf = 0;
  if (!wy) {
    using L = GradStateLayout<K, V, C, TC>;
    /* with bf16 states dH^T comes in by cp.async with the first panels (PIPE) */
    auto kern = go.hT16 != nullptr ? grad_state_kernel_v3<K, V, C, TC, true, true> : grad_state_kernel_v3<K, V, C, TC, false>;
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, L::total));
    /* two blocks per SM need the largest shared-memory carveout */
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    kern<<<grid, dim3(256), L::total, plan.stream>>>(plan.a, go, 0);
    GDP_CUDA_LAUNCHED("grad_state_kernel_v3");
  } else {
    using L = GradWYLayout<K, V, C>;
    auto kern = grad_wy_kernel_v3<K, V, C, TC, true>;
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, L::total));
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    kern<<<grid, dim3(256), L::total, plan.stream>>>(plan.a, go);
    GDP_CUDA_LAUNCHED("grad_wy_kernel_v3");
  }
  return GDP_OK;
}

template <int K, int V>
static gdp_status launch_grad_state_n(const Plan &plan, const GradStateOut &go, bool wy) {
  if (plan.a.n == 1) return launch_grad_state_kv<K, V, 32, 32>(plan, go, wy);
  if (plan.a.n == 2) return launch_grad_state_kv<K, V, 64, 32>(plan, go, wy);
  return launch_grad_state_kv<K, V, 48, 16>(plan, go, wy);
}

static gdp_status launch_grad_v3(const Plan &plan, const GradStateOut &go, bool wy) {
  if (plan.a.nchunks == 0) return GDP_OK;
  const int K = plan.a.K, V = plan.a.V;
  if (K == 128) return V == 128 ? grad_k128v128(plan, go, wy) : grad_k128v64(plan, go, wy);
  return V == 128 ? grad_k64v128(plan, go, wy) : grad_k64v64(plan, go, wy);
}

/* Blocks per SM of the sequential passes at value-block width bv (the dstate kernel's,
 * whose shared memory is the larger of the two); -1 where it cannot run. */
static int seq_blocks_per_sm(const Plan &plan, int bv) {
  const GdpArgs &a = plan.a;
  static int occ_cache[2][2][3][3] = {}; /* depends only on (K, V, n, bv); benign race */
  int &occ = occ_cache[a.K == 128][a.V == 128][a.n - 1][bv == 16 ? 0 : bv == 32 ? 1 : 2];
  if (occ == 0 && launch_seq(plan, bv, false, true, &occ) != GDP_OK) occ = -1;
  return occ;
}

/* Value-block width as in the forward: the fewest waves, narrower on a tie; the
 * problem's value_block forces it. */
static int choose_bv(const Plan &plan) {
  const GdpArgs &a = plan.a;
  if (plan.value_block) return plan.value_block;
  int best = 16;
  double best_waves = INFINITY;
  for (int bv : {16, 32, 64}) {
    if (a.V % bv) continue;
    const int occ = seq_blocks_per_sm(plan, bv);
    if (occ < 1) continue;
    const double waves = ceil((double)a.N * a.H * (a.V / bv) / ((double)num_sms() * occ));
    if (waves < best_waves) best_waves = waves, best = bv;
  }
  return best;
}

/* The recompute backward's two sequential passes -- the states forward in time
 * (bwd_states_kernel_v3) and the state gradients backward in time (dstate_kernel_v3) --
 * read only the prep's panels, d_o and dht, and write disjoint buffers (h^T, D against
 * dH^T, dD, dh0), as fla's chunk_fwd_h and chunk_bwd_dhu are independent too.  Forked,
 * the state-gradient pass runs on a second stream beside the states pass: the two chains
 * overlap where both passes' blocks are resident at once.  H200, bf16, H = 16, K = V =
 * 128, library fwd+bwd: 1 x 32768 n = 1 5.52 -> 4.38 ms, n = 3 13.44 -> 10.91-11.10;
 * where the blocks fill the GPU it costs 1-3% (4 x 4096 n = 3 4.07 -> 4.18).  So: fork
 * where one pass leaves SMs idle (at most one block per SM) and both fit on the SMs at
 * once (twice its blocks over blocks per SM at most the SM count), or, with bf16 states,
 * where a states block fits beside a 2-stage dstate block (fork_mode 2: 1 x 32768 n = 2,
 * where a states block, 124.2 KB, and a 3-stage dstate block, 149.8 KB, do not fit
 * together but one of 100.0 KB does; 8.72-8.76 -> 7.27-7.39 ms).  Never while profiling
 * (its marks time one stream).
 *
 * Whether two kernels' blocks fit side by side on one SM (both at the max-shared
 * carveout): their registers from CUDA (cudaFuncGetAttributes), their shared memory from
 * the layouts, the SM's limits from the device, and the arithmetic of CUDA's occupancy
 * calculator for the two together. */

/* What one block holds on an SM, as CUDA's occupancy calculator counts it: shared memory
 * (dynamic + static + the per-block reserve, in 128-byte units), warps, registers per warp
 * (allocated per warp in units of 256). */
struct Footprint {
  int smem, warps, regs_per_warp;
};
static Footprint footprint(int dyn_smem, int static_smem, int reserved_smem, int threads, int regs_per_thread) {
  return {(dyn_smem + static_smem + reserved_smem + 127) / 128 * 128, (threads + 31) / 32,
          (regs_per_thread * 32 + 255) / 256 * 256};
}

/* SM limits: shared memory at the largest carveout, registers (split over 4 sub-partitions;
 * a block's warps go round-robin over them), warps, blocks. */
struct SmLimits {
  int smem, regs, warps, blocks;
};

/* Whether one block of a and one of b are resident on an SM together.  Registers: the 4
 * sub-partitions separately, each block's warps placed round-robin from the sub-partition
 * with the most free registers (the hardware's placement is not documented; this model
 * matched the occupancy tool's measurements). */
static bool pair_fits(const Footprint &a, const Footprint &b, const SmLimits &sm) {
  if (a.smem + b.smem > sm.smem || a.warps + b.warps > sm.warps || sm.blocks < 2) return false;
  int free_regs[4];
  for (int &f : free_regs) f = sm.regs / 4;
  for (const Footprint *f : {&a, &b}) {
    int best = 0;
    for (int p = 1; p < 4; p++)
      if (free_regs[p] > free_regs[best]) best = p;
    for (int w = 0; w < f->warps; w++)
      if ((free_regs[(best + w) % 4] -= f->regs_per_warp) < 0) return false;
  }
  return true;
}

static gdp_status sm_limits(SmLimits *sm, int *reserved) {
  int dev = 0;
  GDP_CUDA_TRY(cudaGetDevice(&dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(&sm->smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(&sm->regs, cudaDevAttrMaxRegistersPerMultiprocessor, dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(&sm->warps, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(&sm->blocks, cudaDevAttrMaxBlocksPerMultiprocessor, dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  sm->warps /= 32;
  return GDP_OK;
}

/* The fork's pair: the states pass + the 2-stage dstate (bf16 states only). */
template <int K, int V, int C, int TC, int BV>
static gdp_status pair_bv(int *fits) {
  SmLimits sm;
  int reserved = 0;
  GDP_TRY(sm_limits(&sm, &reserved));
  cudaFuncAttributes fd, fs;
  GDP_CUDA_TRY(cudaFuncGetAttributes(&fd, dstate_kernel_v3<K, V, C, TC, BV, true, true, 2>));
  GDP_CUDA_TRY(cudaFuncGetAttributes(&fs, bwd_states_kernel_v3<K, V, C, BV, true, true>));
  const Footprint d = footprint(DStateLayout<K, C, TC, BV, 2, true>::total, (int)fd.sharedSizeBytes, reserved,
                                BV / 16 * 32, fd.numRegs);
  const Footprint st =
      footprint(StatesLayout<K, C, BV>::total, (int)fs.sharedSizeBytes, reserved, BV / 16 * 32, fs.numRegs);
  *fits = pair_fits(d, st, sm) ? 1 : 0;
  return GDP_OK;
}

template <int K, int V, int C, int TC>
static gdp_status pair_k(int bv, int *fits) {
  switch (bv) {
    case 64: return pair_bv<K, V, C, TC, 64>(fits);
    case 32: return pair_bv<K, V, C, TC, 32>(fits);
    default: return pair_bv<K, V, C, TC, 16>(fits);
  }
}

template <int K, int V>
static gdp_status pair_n(int n, int bv, int *fits) {
  if (n == 1) return pair_k<K, V, 32, 32>(bv, fits);
  if (n == 2) return pair_k<K, V, 64, 32>(bv, fits);
  return pair_k<K, V, 48, 16>(bv, fits);
}

/* Whether a states block and a 2-stage dstate block fit on one SM together. */
static bool fork2_pair_fits(const Plan &plan, int bv) {
  const GdpArgs &a = plan.a;
  static int cache[2][2][3][3] = {}; /* 1 fits, -1 not; depends only on (K, V, n, bv); benign race */
  int &c = cache[a.K == 128][a.V == 128][a.n - 1][bv == 16 ? 0 : bv == 32 ? 1 : 2];
  if (c == 0) {
    int fits = 0;
    const gdp_status st = a.K == 128 ? (a.V == 128 ? pair_k128v128(a.n, bv, &fits) : pair_k128v64(a.n, bv, &fits))
                                     : (a.V == 128 ? pair_k64v128(a.n, bv, &fits) : pair_k64v64(a.n, bv, &fits));
    if (st != GDP_OK) (void)cudaGetLastError(); /* no pair, and no stale error for the next launch check */
    c = st == GDP_OK && fits ? 1 : -1;
  }
  return c > 0;
}

/* Whether (and how) to fork, see above: 0 no; 1 with the 3-stage dstate; 2 with the
 * 2-stage dstate (bf16 states only), where only that one fits beside a states block. */
static int fork_mode(const Plan &plan, int bv, bool s16) {
  if (gdp_debug_profile_kernels()) return 0;
  const GdpArgs &a = plan.a;
  const int occ = seq_blocks_per_sm(plan, bv);
  const double blocks = (double)a.N * a.H * (a.V / bv);
  const bool one = occ >= 1 && blocks <= num_sms() && 2.0 * blocks / occ <= num_sms();
  const bool two = !one && s16 && blocks <= num_sms() && fork2_pair_fits(plan, bv);
  return one ? 1 : two ? 2 : 0;
}

/* One non-blocking side stream per device, made on first use and kept for the process
 * (as a library handle would be); concurrent callers share it, which orders their side
 * work but keeps each call's own order through its events. */
static gdp_status side_stream(cudaStream_t *out) {
  static std::mutex mu;
  static cudaStream_t streams[64];
  int dev = 0;
  GDP_CUDA_TRY(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return GDP_ERROR(GDP_ERR_INTERNAL, "side_stream: device %d (at most 64 devices)", dev);
  std::lock_guard<std::mutex> lock(mu);
  if (!streams[dev]) GDP_CUDA_TRY(cudaStreamCreateWithFlags(&streams[dev], cudaStreamNonBlocking));
  *out = streams[dev];
  return GDP_OK;
}

/* A fork of `main` onto the side stream and its join; the events are destroyed at the
 * join (CUDA releases them once they complete). */
struct Fork {
  cudaStream_t side = nullptr;
  cudaEvent_t forked = nullptr, done = nullptr;
};

static gdp_status fork_begin(cudaStream_t main, Fork *f) {
  GDP_TRY(side_stream(&f->side));
  GDP_CUDA_TRY(cudaEventCreateWithFlags(&f->forked, cudaEventDisableTiming));
  GDP_CUDA_TRY(cudaEventCreateWithFlags(&f->done, cudaEventDisableTiming));
  GDP_CUDA_TRY(cudaEventRecord(f->forked, main));
  GDP_CUDA_TRY(cudaStreamWaitEvent(f->side, f->forked, 0));
  return GDP_OK;
}

/* Joins (main waits for everything queued on the side stream since the fork) and frees
 * the events; also after a failed fork_begin, whatever it made. */
static gdp_status fork_end(cudaStream_t main, Fork *f, bool join) {
  cudaError_t e = cudaSuccess;
  if (join) {
    e = cudaEventRecord(f->done, f->side);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(main, f->done, 0);
    /* main must not run ahead of the side pass: without the join, wait for it here */
    if (e != cudaSuccess) cudaStreamSynchronize(f->side);
  }
  if (f->forked) cudaEventDestroy(f->forked);
  if (f->done) cudaEventDestroy(f->done);
  f->forked = f->done = nullptr;
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return GDP_ERROR(GDP_ERR_CUDA, "backward: joining the side stream: %s", cudaGetErrorString(e));
  }
  return GDP_OK;
}

/* The recompute's two passes, forked where fork_mode says and the fork can be made
 * (otherwise one after the other on the caller's stream). */
static gdp_status launch_state_passes(const Plan &plan, int bv, const GradStateOut &go) {
  Fork f;
  const int fm = fork_mode(plan, bv, go.hT16 != nullptr);
  const bool forked = fm > 0 && fork_begin(plan.stream, &f) == GDP_OK;
  if (!forked) {
    /* a fork that could not be made (no stream or event to spare) is no error: the
     * passes run in order; its CUDA error must not reach the next launch check */
    fork_end(plan.stream, &f, false);
    (void)cudaGetLastError();
    gdp_status st = launch_seq(plan, bv, true, false, nullptr, go.hT32, go.hT16);
    prof_mark("bwd states (recompute)", plan.stream);
    if (st == GDP_OK) st = launch_seq(plan, bv, false, false, nullptr, go.dHT32, go.dHT16);
    prof_mark("bwd state gradients", plan.stream);
    return st;
  }
  Plan side = plan;
  side.stream = f.side;
  /* the backward-in-time pass first, so its blocks are queued by the time the states
   * pass's blocks start */
  gdp_status st = launch_seq(side, bv, false, false, nullptr, go.dHT32, go.dHT16, fm == 2);
  const gdp_status st2 = launch_seq(plan, bv, true, false, nullptr, go.hT32, go.hT16, fm == 2);
  const gdp_status st3 = fork_end(plan.stream, &f, true);
  if (st == GDP_OK) st = st2;
  if (st == GDP_OK) st = st3;
  return st;
}

#define GDP_V3B_DEFINE_ROOTS(K, V)                                                                              \
  gdp_status seq_k##K##v##V(const Plan &plan, int bv, bool states, bool dry_run, int *occ, float *f32, bf16 *b16, \
                            bool two) {                                                                         \
    return launch_seq_n<K, V>(plan, bv, states, dry_run, occ, f32, b16, two);                                   \
  }                                                                                                             \
  gdp_status grad_k##K##v##V(const Plan &plan, const GradStateOut &go, bool wy) {                              \
    return launch_grad_state_n<K, V>(plan, go, wy);                                                             \
  }                                                                                                             \
  gdp_status pair_k##K##v##V(int n, int bv, int *fits) { return pair_n<K, V>(n, bv, fits); }
#define GDP_V3B_DEFINE_PART_ROOTS(K, V) GDP_V3B_DEFINE_ROOTS(K, V) /* K, V expanded first */
#if !defined(GDP_V3_SPLIT)
GDP_V3B_DEFINE_ROOTS(64, 64)
GDP_V3B_DEFINE_ROOTS(64, 128)
GDP_V3B_DEFINE_ROOTS(128, 64)
GDP_V3B_DEFINE_ROOTS(128, 128)
#elif defined(GDP_V3_PART_K)
GDP_V3B_DEFINE_PART_ROOTS(GDP_V3_PART_K, GDP_V3_PART_V)
#endif

}  // namespace v3b
}  // namespace gdpcu

#ifndef GDP_V3_PART_K /* the entry points: in the whole file or its main part, not in a (K, V) part */
namespace gdpcu {
namespace v3b {

/* With the blocks a saved forward kept: its plan (tables, panels), h^T (bf16) and D are
 * read from there, so the prep and the states pass are skipped; the state-gradient pass
 * and the two gradient kernels run as in the recompute. */
static gdp_status backward_saved(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io, cudaStream_t stream,
                                 const void *saved) {
  const v3::SavedLayout sl = v3::saved_layout(p);
  Plan plan;
  prof_begin(stream);
  /* the kept block is only read: its tables and panels are the forward's */
  gdp_status st = plan_make(p, stream, PLAN_FORWARD, bwd_args(p, io), &plan, const_cast<void *>(saved), false);
  if (st != GDP_OK) {
    prof_end(stream);
    return st;
  }
  GradStateOut go;
  memset(&go, 0, sizeof go);
  void *extra = nullptr;
  const int bv = choose_bv(plan);
  if (plan.a.nchunks > 0) {
    const size_t CH = (size_t)plan.a.nchunks * plan.a.H, K = (size_t)plan.a.K, V = (size_t)plan.a.V,
                 C = (size_t)plan.a.C;
    const size_t bdD = align128(CH * C * V * 2), bHT = align128(CH * V * K * 2), bKn = align128(CH * C * K * 4),
                 bW = align128(CH * C * K * 2), bG = align128(CH * C * 4);
    st = device_alloc(&extra, bdD + bHT + bKn + bW + bG, stream);
    if (st != GDP_OK) {
      prof_end(stream);
      return st;
    }
    char *e = (char *)extra;
    plan.a.Dbuf = (bf16 *)((char *)const_cast<void *>(saved) + sl.o_D);
    plan.a.dDbuf = (bf16 *)e;
    go.hT16 = (bf16 *)((char *)const_cast<void *>(saved) + sl.o_hT);
    go.dHT16 = (bf16 *)(e + bdD);
    go.dKnA = (float *)(e + bdD + bHT);
    go.dWg = (bf16 *)(e + bdD + bHT + bKn);
    go.dgcA = (float *)(e + bdD + bHT + bKn + bW);
    go.Tt = (bf16 *)((char *)const_cast<void *>(saved) + sl.o_Tt);
  }
  prof_mark("bwd plan (saved)", stream);
  /* also without chunks (every sequence empty): the reverse pass writes dh0 = dht */
  st = launch_seq(plan, bv, false, false, nullptr, go.dHT32, go.dHT16);
  prof_mark("bwd state gradients", stream);
  if (st == GDP_OK) st = launch_grad_v3(plan, go, false);
  prof_mark("bwd chunk gradients, state part", stream);
  if (st == GDP_OK) st = launch_grad_v3(plan, go, true);
  prof_mark("bwd chunk gradients, WY part", stream);
  if (extra) cudaFreeAsync(extra, stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

/* The recompute backward: the prep (also storing T^T), the states pass and the
 * state-gradient pass (forked where that pays), then the two gradient kernels. */
static gdp_status backward_recompute(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io, cudaStream_t stream) {
  GdpArgs a = bwd_args(p, io);
  Plan plan;
  prof_begin(stream);
  /* The gradient kernels' bf16 copies of h^T and dH^T, the state part's outputs and T^T
   * from the prep (one stream-ordered allocation; the forward never pays for T). */
  gdp_status st = plan_make(p, stream, PLAN_BACKWARD, a, &plan);
  if (st != GDP_OK) {
    prof_end(stream);
    return st;
  }
  prof_mark("bwd plan+upload", stream);
  GradStateOut go;
  memset(&go, 0, sizeof go);
  void *extra = nullptr;
  const int bv = choose_bv(plan);
  if (plan.a.nchunks > 0) {
    const size_t CH = (size_t)plan.a.nchunks * plan.a.H, K = (size_t)plan.a.K, V = (size_t)plan.a.V,
                 C = (size_t)plan.a.C;
    const size_t bHT = align128(CH * V * K * 2), bKn = align128(CH * C * K * 4), bW = align128(CH * C * K * 2),
                 bG = align128(CH * C * 4), bT = align128(CH * C * C * 2);
    st = device_alloc(&extra, 2 * bHT + bKn + bW + bG + bT, stream);
    if (st != GDP_OK) {
      plan_free(&plan);
      prof_end(stream);
      return st;
    }
    char *e = (char *)extra;
    go.hT16 = (bf16 *)e;
    go.dHT16 = (bf16 *)(e + bHT);
    go.dKnA = (float *)(e + 2 * bHT);
    go.dWg = (bf16 *)(e + 2 * bHT + bKn);
    go.dgcA = (float *)(e + 2 * bHT + bKn + bW);
    go.Tt = (bf16 *)(e + 2 * bHT + bKn + bW + bG);
  }
  /* U formed in the states pass from Tu and v, where its value block holds Tu^T in the
   * residual's region (bv >= C); the prep then stores Tu^T into U's buffer instead of U
   * and U's residual.  Elsewhere the states pass reads U and its bf16 residual (the
   * plan's a.Ulo: D = U - W h then starts from U to ~16 bits instead of 8; dg's z terms
   * amplify D's error, NOTES.md). */
  if (bv >= plan.a.C && plan.a.C <= plan.a.V) {
    plan.a.Tu = plan.a.U;
    plan.a.Ulo = nullptr;
  }
  st = v3::launch_prep_v3(plan, go.Tt);
  prof_mark("bwd prep (recompute)", stream);
  if (st == GDP_OK) st = launch_state_passes(plan, bv, go);
  if (st == GDP_OK) st = launch_grad_v3(plan, go, false);
  prof_mark("bwd chunk gradients, state part", stream);
  if (st == GDP_OK) st = launch_grad_v3(plan, go, true);
  prof_mark("bwd chunk gradients, WY part", stream);
  if (extra) cudaFreeAsync(extra, stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

}  // namespace v3b

namespace v3 {
/* The dispatch has validated p and io and checked that the fast path takes p. */
gdp_status backward(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io, cudaStream_t stream, const void *saved) {
  if (p->N == 0) return GDP_OK;
  return saved ? v3b::backward_saved(p, io, stream, saved) : v3b::backward_recompute(p, io, stream);
}
}  // namespace v3
}  // namespace gdpcu
#endif /* GDP_V3_PART_K */
