/*
 * chunk_state_recompute.cuh -- the recompute backward's states pass: the forward state
 * pass without the output products, storing per chunk h^T (the chunk-start state) and D.
 */
#ifndef GDP_KERNELS_CUDA_GDP_CHUNK_STATE_RECOMPUTE_CUH
#define GDP_KERNELS_CUDA_GDP_CHUNK_STATE_RECOMPUTE_CUH

#include "chunk_backward.cuh"

namespace gdpcu {
namespace chunked_backward {

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
 * Per chunk: h^T (bf16 S at the chunk start, the rounding the gradient kernels' products
 * apply to it anyway) to hT16 and D (bf16 [C][V] per (chunk, head)) to a.Dbuf, then
 * S^T <- e^{last} S^T + D^T Kd.  No ht: the forward gave it.  TU (BV >= C; the prep ran
 * with TU_OUT): U = Tu V formed here from a.Tu and v's rows, inside D's accumulator, as
 * chunk_state_kernel's TU (chunk_state_pass.cuh): no U, no residual through memory, and D
 * one float32 sum. */
template <int K, int V, int C, int BV, bool TU = false>
__global__ void __launch_bounds__(BV / 16 * 32, 1) chunk_state_recompute_kernel(GdpArgs a, bf16 *hT16) {
  using L = StatesLayout<K, C, BV>;
  constexpr int NT = BV / 16 * 32;
  static_assert(K % 32 == 0 && C % 16 == 0 && BV % 16 == 0, "tile shapes");
  static_assert(!TU || BV >= C, "TU: Tu^T in the residual's region");
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
      } else { /* complete workspace panels: no zero-fill predicate (copy_panel_full) */
        copy_panel_full<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K);
        copy_panel_full<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K);
        copy_panel_full<C, BV, NT>(st + L::oU, L::ldB, a.U + base * C * V + col0, V);
        if (a.Ulo) copy_panel_full<C, BV, NT>(st + L::oUl, L::ldB, a.Ulo + base * C * V + col0, V);
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
     * and a bf16-only U was the largest single error in dg (docs/kernels.md §3.6). */
    float Dt[C / 8][4];
    if constexpr (TU) { /* -U^T = (-V^T) Tu^T, as in chunk_state_kernel (chunk_state_pass.cuh) */
      neg_u_from_tu_v<C>(Dt, sU, sU + (L::oUl - L::oU), L::ldB, L::ldC, urow, ucol, trow, tcol);
    } else {
      neg_u_from_panel<C / 16>(Dt, sU, sU + (L::oUl - L::oU), L::ldB, urow, ucol, ulo);
    }
    /* h^T rows xw..xw+7 now, xw+8..15 after the D products (St is unchanged until the
     * decay): the stores of each half overlap the products that follow */
    stage_hT16_half<K, C>(smem + L::oHt, hT16 + CHi * V * K + (int64_t)xw * K, St, 0);
#pragma unroll
    for (int kt = 0; kt < K / 16; kt++) {
      uint32_t Sa[4];
      afrag_kt(St, kt, Sa, 1.f);
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
    stage_hT16_half<K, C>(smem + L::oHt, hT16 + CHi * V * K + (int64_t)(xw + 8) * K, St, 1);
    stage_dfrags<K, C>(smem + L::oHt, a.Dbuf + CHi * C * V + xw, V, Da, 0u);

    /* S^T <- e^{last} S^T + D^T Kd */
#pragma unroll
    for (int nt = 0; nt < K / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) St[nt][e] *= el;
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
  cp_async_wait<0>();
}

}  // namespace chunked_backward
}  // namespace gdpcu

#endif
