/*
 * chunk_dstate.cuh -- the reverse state-gradient pass: dH^T in float32 registers, backward
 * in time over the chunks of a sequence, storing dH^T and dD per chunk and dh0 at the end.
 */
#ifndef GDP_KERNELS_CUDA_GDP_CHUNK_DSTATE_CUH
#define GDP_KERNELS_CUDA_GDP_CHUNK_DSTATE_CUH

#include "chunk_backward.cuh"

namespace gdpcu {
namespace chunked_backward {

/* ------------------------------------------------------------------ reverse state-gradient pass */

/* STAGES: chunk panels in flight (3; 2 for the fork beside a states block, see
 * fork_mode in chunk_backward.cu); B16: the staging buffer holds only bf16 rows and D
 * tiles (the 2-stage kernel). */
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

/* Grid (sequence, head, value block of BV columns); warp w owns value columns
 * xw = col0 + 16w .. +15 and walks the sequence's chunks backwards.  Fragments
 * (grp = lane/4, tig = lane%4):
 *   Ht[nt][e] = dH^T[x][r],  x = xw + grp + 8(e/2),  r = 8nt + 2tig + e%2  (float32)
 *   Gt[nt][e] = dD^T[x][j],  j = 8nt + 2tig + e%2
 *   Oa[kt]    = A fragment of dO^T (x, query row a in 16kt..16kt+15).
 * Pm[a][j] is zero for j > ia = a n + n - 1, so the (a-tile, j-tile) pairs wholly past
 * the diagonal are skipped at compile time (NN = C / TC = n). */
template <int K, int V, int C, int TC, int BV, int STAGES = kStages>
__global__ void __launch_bounds__(BV / 16 * 32, 1) chunk_dstate_kernel(GdpArgs a, bf16 *dHT16) {
  /* STAGES = 2: the next chunk's panels are issued one chunk ahead instead of two (same
   * products, same bits), and the staging buffer is sized for bf16 rows: 171.5 -> 115.0 KB
   * at K = V = 128, n = 2, BV = 64, so that a states block fits beside it (the fork). */
  constexpr bool TWO = STAGES == 2;
  static_assert(STAGES == kStages || TWO, "2 or 3 stages");
  using L = DStateLayout<K, C, TC, BV, STAGES, TWO>;
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

  /* iteration it handles chunk cbeg + nc - 1 - it, in stage it % STAGES.  The chunk's
   * (t0, ntok) for dO come from registers loaded one iteration earlier (loaded after the
   * barrier, the dO copies waited on that load), and the four workspace panels are copied
   * without the zero-fill predicate (all their rows are valid). */
  auto issue = [&](int it, int t0, int ntok) {
    if (it < nc) {
      unsigned char *st = smem + (it % STAGES) * L::stage;
      const int c = cbeg + nc - 1 - it;
      const int64_t base = (int64_t)c * H + h;
      copy_panel_full<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K);
      copy_panel_full<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K);
      copy_panel_full<TC, K, NT>(st + L::oQd, L::ldK, a.Qd + base * TC * K, K);
      copy_panel_full<TC, C, NT>(st + L::oPm, L::ldC, a.Pm + base * TC * C, C);
      copy_panel<TC, BV, NT>(st + L::odO, L::ldB, d_o + ((int64_t)t0 * H + h) * V + col0, (int64_t)H * V, ntok);
    }
    cp_async_commit();
  };
  /* (t0, ntok) of the chunk that the next issue copies */
  int nx_t0 = 0, nx_ntok = 0;
  auto load_next = [&](int it) {
    if (it < nc) {
      const ChunkInfo ci = a.chunks[cbeg + nc - 1 - it];
      nx_t0 = ci.t0, nx_ntok = ci.ntok;
    }
  };
#pragma unroll
  for (int it = 0; it < STAGES - 1; it++) {
    load_next(it);
    issue(it, nx_t0, nx_ntok);
  }
  load_next(STAGES - 1);

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
    load_next(it + STAGES); /* used one iteration later */
    const uint32_t sb = smem0 + (it % STAGES) * L::stage;
    const uint32_t sW = sb + L::oW, sKd = sb + L::oKd, sQd = sb + L::oQd, sPm = sb + L::oPm,
                   sdO = sb + L::odO;

    /* dD^T = dH^T Kd^T + dO^T Pm.  dH (this chunk's end) as bf16 A fragments built per
     * k tile (4 registers live, not K/4), stored on the way; dO^T's fragments after, so
     * the two sets are never live together. */
    float Gt[C / 8][4];
#pragma unroll
    for (int nt = 0; nt < C / 8; nt++) Gt[nt][0] = Gt[nt][1] = Gt[nt][2] = Gt[nt][3] = 0.f;
    /* dH^T rows xw..xw+7 now, xw+8..15 after the dD products (Ht is unchanged until the
     * decay): the stores of each half overlap the products that follow */
    stage_hT16_half<K, C, WB>(smem + L::oHt, dHT16 + CHi * V * K + (int64_t)xw * K, Ht, 0);
    {
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
     * Scheduled so that what needs only dH^T is not on the dD chain: the second dH^T half
     * store and the dO^T Qd products (independent of dD) cover the tail of the dD
     * products; G's rounding is followed by the W products at once; dD's staged store
     * goes last, under their tail. */
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
    {
      stage_hT16_half<K, C, WB>(smem + L::oHt, dHT16 + CHi * V * K + (int64_t)(xw + 8) * K, Ht, 1);
      decay_qd();
      to_afrag<C / 16>(Gt, Ga, -1.f);
      w_products();
      stage_dfrags<K, C, WB>(smem + L::oHt, a.dDbuf + CHi * C * V + xw, V, Ga, 0x80008000u);
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
}

}  // namespace chunked_backward
}  // namespace gdpcu

#endif
