/*
 * gdp_fwd_v3.cu -- variant 3 of the chunked GDP forward (bf16 in, float32 accumulation
 * and float32 state): a prep kernel and a state pass with the state in registers, both
 * on raw mma.sync m16n8k16 bf16 tensor-core instructions with compile-time shapes.
 *
 * The two kernels meet through variant 2's global workspace (the per-chunk panels W, U,
 * Kd, Qd, Pm and e^{last}, gdp_chunk.cuh), so either can be paired with variant 2's
 * counterpart: gdp_cuda_gdp_forward_v3(..., new_prep = 0) runs variant 2's
 * chunk_prep_kernel before the new state pass (the lab's variant 4).  Not in the
 * library's dispatch: it stays lab-only until validated on the device.  The state-pass
 * algebra, per chunk c of a sequence, head h (gdp_chunk.cuh):
 *     D = U - W S,   o = Qd S + Pm D   (TC query rows),   S <- e^{last} S + Kd^T D.
 * The prep's method is described above prep_kernel_v3.
 *
 * Why the state pass is laid out the way it is (kernels/cuda/NOTES.md, "Variant 3"):
 *  - Everything is computed transposed: S^T (BV x K), D^T = U^T - S^T W^T (BV x C),
 *    o^T = S^T Qd^T + D^T Pm^T (BV x TC), S^T <- e^{last} S^T + D^T Kd.  Then the value
 *    columns x are the M dimension of every product, and the float32 accumulator
 *    fragment of S^T (row x, column pairs along r) is, once rounded to bf16, exactly the
 *    A-operand fragment of the next product (row x, k pairs along r) -- the same holds
 *    for D^T.  So S and D never leave registers: no shared-memory staging, no
 *    transpose, and the state stays float32 across the whole sequence.
 *  - A warp owns 16 value columns and all K key rows of S^T: 64 (K = 128) float
 *    registers of state per thread.  Warps of a block never exchange data; they only
 *    share the chunk panels, which arrive in shared memory by cp.async, three chunks
 *    deep, so the next chunks' loads overlap this chunk's products.
 *  - B operands come from shared memory by ldmatrix (.trans for Kd, and for U, whose
 *    transposed 8x8 blocks land directly in the accumulator layout).  Panel rows are
 *    padded by 16 bytes so the eight rows of each 8x8 matrix fall in distinct banks.
 *  - Shapes are template parameters (K, C, TC, BV): every loop is unrolled, every
 *    register array is indexed by constants (no local memory).
 */
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "gdp_fwd_v3.cuh"
#include "gdp_v3_stage.cuh"
#include "gdp_v3_split.h"
#include "mma_sm90.cuh"

namespace gdpcu {
namespace v3 {

constexpr int kStages = 3; /* chunk panels in flight: current + next two */
constexpr int kPad = 8;    /* bf16 elements (16 bytes) of padding per shared row */


/* Shared-memory layout of one pipeline stage (bytes).  Every region and row starts on
 * 16 bytes, as ldmatrix and cp.async need.  ULO (the saving pass): also U's residual
 * panel, right after U's (195 KB in all at K = 128, C = 64, BV = 64: still one block).
 * TU (a pass that forms U itself): the oU region holds v's rows (C x BV, as given) and
 * the one after it Tu^T (C x C), in the saving pass instead of the residual (the same
 * 195 KB at K = 128, C = BV = 64), in the plain one added (9 KB more there). */
template <int K, int C, int TC, int BV, bool ULO = false, bool TU = false>
struct Layout {
  static constexpr int ldK = K + kPad, ldC = C + kPad, ldB = BV + kPad;
  static constexpr int oW = 0;
  static constexpr int oKd = oW + C * ldK * 2;
  static constexpr int oQd = oKd + C * ldK * 2;
  static constexpr int oPm = oQd + TC * ldK * 2;
  static constexpr int oU = oPm + TC * ldC * 2; /* U's columns, or (TU) v's */
  static constexpr int oUl = oU + C * ldB * 2;  /* U's residual, or (TU) Tu^T */
  static constexpr int szUl = TU ? C * ldC * 2 : ULO ? C * ldB * 2 : 0;
  static constexpr int stage = (oUl + szUl + 127) / 128 * 128;
  /* ULO (the saving pass) also has, after the stages, one h^T staging buffer per warp
   * (HtStage below): 17 KB at K = 128, BV = 64, 212 KB in all, still one block/SM */
  static constexpr int oHt = stage * kStages;
  static constexpr int total = oHt + (ULO ? BV / 16 * HtStage<K, C>::warp_bytes : 0);
};

/* ------------------------------------------------------------------ PTX wrappers: mma_sm90.cuh */
/* ------------------------------------------------------------------ chunk panels, state staging: gdp_v3_stage.cuh */

/* ------------------------------------------------------------------ saved-state stores */

/* The two stores of a forward that keeps its states for the backward (SAVE below), in
 * exactly the layouts bwd_states_kernel_v3 writes (gdp_bwd_v3.cu), so the backward's
 * gradient kernels read them unchanged:
 *  - h^T float32 [V][K] per (chunk, head): stage_hT32_half, two halves per chunk;
 *  - D bf16 [C][V] (variant 2's layout): stage_dfrags, from the A fragments of D^T. */




/* ------------------------------------------------------------------ the state pass */

/* The rounding residual of the bf16 A fragment A of -X's k tile kt (A[q] = bf16 pair of
 * -X[2kt + q/2][2(q%2)], [..+1], as the state passes pack D^T from its negated
 * accumulator): (-X) - A rounded to bf16; the difference is exact in float32, so A + R
 * is -X to ~16 bits.  The same helper is in gdp_bwd_v3.cu (separate translation units). */
template <int NT2>
__device__ __forceinline__ void afrag_residual_kt(const float (&X)[NT2][4], int kt, const uint32_t (&A)[4],
                                                  uint32_t (&R)[4]) {
#pragma unroll
  for (int q = 0; q < 4; q++) {
    const float2 a = unpack_bf16(A[q]);
    R[q] = pack_bf16(-X[2 * kt + (q >> 1)][2 * (q & 1)] - a.x, -X[2 * kt + (q >> 1)][2 * (q & 1) + 1] - a.y);
  }
}

/* Grid (sequence, head, value block of BV columns); BV/16 warps, warp w owns value
 * columns col0 + 16w .. +15.  Fragment coordinates (grp = lane/4, tig = lane%4):
 *   St[nt][e]  = S^T[x][r],  x = 16w + grp + 8(e/2),  r = 8nt + 2tig + e%2
 *   Dt[nt][e]  = -D^T[x][j], j = 8nt + 2tig + e%2      (accumulated negated, see D)
 *   Ot[nt][e]  = o^T[x][a],  a = 8nt + 2tig + e%2
 * and the bf16 A fragments Sa[kt], Da[kt] cover k columns 16kt..16kt+15.
 * SAVE (a forward kept for the backward): per chunk also h^T (float32, S at the chunk
 * start) to hT32 and D (bf16) to a.Dbuf, the values bwd_states_kernel_v3 would
 * recompute -- the same products in the same order, so the same bits.  S16 (with SAVE):
 * h^T in bf16 to hT16 instead (GDP_CUDA_V3_STATE=bf16), the rounding the backward's
 * products apply to it anyway.  TU (the prep ran with TU_OUT; plain or SAVE): U is not read
 * but formed here, U = Tu V from a.Tu and v's rows, on the same bf16 operands the prep's
 * U product takes, inside D's accumulator: D = U - W S in one float32 sum, where the
 * default saving pass starts from U's bf16 rounding plus its residual (~16 bits). */
template <int K, int C, int TC, int BV, bool SAVE = false, bool S16 = false, bool TU = false>
__global__ void __launch_bounds__(BV / 16 * 32, 1) state_kernel_v3(GdpArgs a, float *hT32, bf16 *hT16) {
  pdl_wait(); /* the prep's panels (launched as its programmatic dependent) */
  using L = Layout<K, C, TC, BV, SAVE, TU>;
  constexpr int NT = BV / 16 * 32;
  static_assert(K % 32 == 0 && C % 16 == 0 && TC % 16 == 0 && BV % 16 == 0, "tile shapes");
  extern __shared__ __align__(128) unsigned char smem[];
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * BV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = lane >> 2, tig = lane & 3;
  const int H = a.H, V = a.V;
  const int cbeg = a.choff[s], nc = a.choff[s + 1] - cbeg;
  const int64_t soff = ((int64_t)s * H + h) * K * V;
  const int xw = col0 + warp * 16; /* this warp's first value column */

  float St[K / 8][4];
#pragma unroll
  for (int nt = 0; nt < K / 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int r = nt * 8 + 2 * tig + (e & 1), x = xw + grp + 8 * (e >> 1);
      St[nt][e] = a.h0 ? a.h0[soff + (int64_t)r * V + x] : 0.f;
    }

  /* Stage it % kStages holds chunk it; every call commits a group (maybe empty) so that
   * the wait count below is the same on every iteration. */
  auto issue = [&](int it) {
    if (it < nc) {
      unsigned char *st = smem + (it % kStages) * L::stage;
      const int64_t base = (int64_t)(cbeg + it) * H + h;
      copy_panel_full<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K);
      copy_panel_full<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K);
      copy_panel_full<TC, K, NT>(st + L::oQd, L::ldK, a.Qd + base * TC * K, K);
      copy_panel_full<TC, C, NT>(st + L::oPm, L::ldC, a.Pm + base * TC * C, C);
      if constexpr (TU) { /* v's rows (zero past the sequence end, as in the prep) and Tu^T */
        const ChunkInfo cj = a.chunks[cbeg + it];
        const int64_t krow0 = (int64_t)cj.t0 * (C / TC);
        copy_panel<C, BV, NT>(st + L::oU, L::ldB, (const bf16 *)a.v + (krow0 * H + h) * V + col0, (int64_t)H * V,
                              cj.ntok * (C / TC));
        copy_panel_full<C, C, NT>(st + L::oUl, L::ldC, a.Tu + base * C * C, C);
      } else {
        copy_panel_full<C, BV, NT>(st + L::oU, L::ldB, a.U + base * C * V + col0, V);
        if constexpr (SAVE) copy_panel_full<C, BV, NT>(st + L::oUl, L::ldB, a.Ulo + base * C * V + col0, V);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int it = 0; it < kStages - 1; it++) issue(it);

  /* Per-lane ldmatrix offsets (elements), fixed for the whole pass:
   *  - non-transposed B pairs (W, Qd, Pm: stored [n][k]): matrices (n lo, k lo),
   *    (n lo, k hi), (n hi, k lo), (n hi, k hi) -> fragments (n-tile nt, nt+1);
   *  - transposed B pairs (Kd: stored [k][n]): matrices (k lo, n lo), (k hi, n lo),
   *    (k lo, n hi), (k hi, n hi);
   *  - U^T (U stored [j][x]): matrices (j lo, x lo), (j lo, x hi), (j hi, x lo),
   *    (j hi, x hi) = accumulator halves c01/c23 of j-tiles 2jt, 2jt+1. */
  const int nrow = (lane >> 4) * 8 + (lane & 7), ncol = ((lane >> 3) & 1) * 8;
  const int trow = ((lane >> 3) & 1) * 8 + (lane & 7), tcol = (lane >> 4) * 8;
  const int urow = (lane >> 4) * 8 + (lane & 7), ucol = warp * 16 + ((lane >> 3) & 1) * 8;
  const uint32_t smem0 = smem_addr(smem);

  for (int it = 0; it < nc; it++) {
    const int c = cbeg + it;
    /* scalars first: their latency overlaps the wait */
    const float el = a.elast[(int64_t)c * H + h];
    const ChunkInfo ci = a.chunks[c];
    cp_async_wait<kStages - 2>();
    __syncthreads(); /* chunk it visible to all warps; stage (it-1) free */
    issue(it + kStages - 1);

    const uint32_t sb = smem0 + (it % kStages) * L::stage;
    const uint32_t sW = sb + L::oW, sKd = sb + L::oKd, sQd = sb + L::oQd, sPm = sb + L::oPm,
                   sU = sb + L::oU;
    /* SAVE: h^T rows xw..xw+7 now, rows xw+8..15 after the D products (St is unchanged
     * until the decay): the stores of each half overlap the products that follow */
    if constexpr (SAVE && S16)
      stage_hT16_half<K, C>(smem + L::oHt, hT16 + ((int64_t)c * H + h) * V * K + (int64_t)xw * K, St, 0);
    else if constexpr (SAVE)
      stage_hT32_half<K, C>(smem + L::oHt, hT32 + ((int64_t)c * H + h) * V * K + (int64_t)xw * K, St, 0);

    /* S^T at the chunk start as bf16 A fragments (for D and o) */
    uint32_t Sa[K / 16][4];
#pragma unroll
    for (int kt = 0; kt < K / 16; kt++) {
      Sa[kt][0] = pack_bf16(St[2 * kt][0], St[2 * kt][1]);
      Sa[kt][1] = pack_bf16(St[2 * kt][2], St[2 * kt][3]);
      Sa[kt][2] = pack_bf16(St[2 * kt + 1][0], St[2 * kt + 1][1]);
      Sa[kt][3] = pack_bf16(St[2 * kt + 1][2], St[2 * kt + 1][3]);
    }

    /* -D^T = -U^T + S^T W^T (the mma only adds, so the accumulator starts at -U^T and
     * the sign is restored, exactly, when it is rounded into Da).  SAVE: U = hi + lo, as
     * in the recompute backward's D (bwd_states_kernel_v3), which this D replaces. */
    float Dt[C / 8][4];
    if constexpr (TU) {
      /* -U^T = (-V^T) Tu^T, v's rows where U's were (the A fragments of V^T at U^T's
       * addresses), Tu^T where the residual's were */
      neg_u_from_tu_v<C>(Dt, sU, sU + (L::oUl - L::oU), L::ldB, L::ldC, urow, ucol, trow, tcol);
    } else {
      neg_u_from_panel<C / 16>(Dt, sU, sU + (L::oUl - L::oU), L::ldB, urow, ucol, SAVE);
    }
#pragma unroll
    for (int kt = 0; kt < K / 16; kt++)
#pragma unroll
      for (int nt = 0; nt < C / 8; nt += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(sW + ((nt * 8 + nrow) * L::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
        mma16816(Dt[nt], Sa[kt], b0, b1);
        mma16816(Dt[nt + 1], Sa[kt], b2, b3);
      }
    uint32_t Da[C / 16][4];
#pragma unroll
    for (int kt = 0; kt < C / 16; kt++) {
      Da[kt][0] = pack_bf16(-Dt[2 * kt][0], -Dt[2 * kt][1]);
      Da[kt][1] = pack_bf16(-Dt[2 * kt][2], -Dt[2 * kt][3]);
      Da[kt][2] = pack_bf16(-Dt[2 * kt + 1][0], -Dt[2 * kt + 1][1]);
      Da[kt][3] = pack_bf16(-Dt[2 * kt + 1][2], -Dt[2 * kt + 1][3]);
    }
    if constexpr (SAVE) {
      if constexpr (S16)
        stage_hT16_half<K, C>(smem + L::oHt, hT16 + ((int64_t)c * H + h) * V * K + (int64_t)(xw + 8) * K, St, 1);
      else
        stage_hT32_half<K, C>(smem + L::oHt, hT32 + ((int64_t)c * H + h) * V * K + (int64_t)(xw + 8) * K, St, 1);
      stage_dfrags<K, C>(smem + L::oHt, a.Dbuf + ((int64_t)c * H + h) * C * V + xw, V, Da, 0u);
    }

    /* o^T = S^T Qd^T + D^T Pm^T, then straight to global (rows past the sequence end,
     * which prep filled with zeros, are not stored) */
    {
      float Ot[TC / 8][4];
#pragma unroll
      for (int nt = 0; nt < TC / 8; nt++) Ot[nt][0] = Ot[nt][1] = Ot[nt][2] = Ot[nt][3] = 0.f;
#pragma unroll
      for (int kt = 0; kt < K / 16; kt++)
#pragma unroll
        for (int nt = 0; nt < TC / 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(sQd + ((nt * 8 + nrow) * L::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
          mma16816(Ot[nt], Sa[kt], b0, b1);
          mma16816(Ot[nt + 1], Sa[kt], b2, b3);
        }
#pragma unroll
      for (int kt = 0; kt < C / 16; kt++)
#pragma unroll
        for (int nt = 0; nt < TC / 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(sPm + ((nt * 8 + nrow) * L::ldC + kt * 16 + ncol) * 2, b0, b1, b2, b3);
          mma16816(Ot[nt], Da[kt], b0, b1);
          mma16816(Ot[nt + 1], Da[kt], b2, b3);
        }
      bf16 *o = (bf16 *)a.o;
      const int64_t obase = (int64_t)ci.t0 * H + h;
#pragma unroll
      for (int nt = 0; nt < TC / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int qa = nt * 8 + 2 * tig + (e & 1), x = xw + grp + 8 * (e >> 1);
          if (qa < ci.ntok) o[(obase + (int64_t)qa * H) * V + x] = __float2bfloat16(Ot[nt][e]);
        }
    }

    /* S^T <- e^{last} S^T + D^T Kd  (float32 throughout) */
#pragma unroll
    for (int nt = 0; nt < K / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) St[nt][e] *= el;
    if (SAVE && a.d_residual) {
      /* + Dl^T Kd, Dl = bf16(D - bf16(D)) (exact difference): D to ~16 bits in the states
       * the gradients read, as bwd_states_kernel_v3 does (the same bits) */
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
  cp_async_wait<0>(); /* no copy may outlive the block (the tail groups are empty) */

  if (a.ht) {
#pragma unroll
    for (int nt = 0; nt < K / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int r = nt * 8 + 2 * tig + (e & 1), x = xw + grp + 8 * (e >> 1);
        a.ht[soff + (int64_t)r * V + x] = St[nt][e];
      }
  }
}

/* ------------------------------------------------------------------ the state pass, two warps per column tile */

/* A warp's staging buffer in the saving pair pass (SAVE below): as HtStage (gdp_v3_stage.cuh)
 * but for the warp's K half of h^T (8 rows of K/2 floats or bf16, padded alike: the
 * fragment stores hit 2 wavefronts (float32) / 32 distinct banks (bf16)) and its C half of
 * D (C/2 rows of 16 bf16, 48 bytes apart). */
template <int K, int C>
struct Ks2Stage {
  static constexpr int row = K / 2 * 4 + 32, row16 = K / 2 * 2 + 16, drow = 48;
  static constexpr int warp_bytes = 8 * row > C / 2 * drow ? 8 * row : C / 2 * drow;
  static_assert(8 * row16 <= warp_bytes, "bf16 staging fits");
};

/* stage_hT32_half / stage_hT16_half for a warp that holds the K half w of S^T: X[nt][e] =
 * S^T[x][w K/2 + 8nt + 2tig + e%2], x = xw + grp + 8(e/2); half hf = rows xw + 8hf + grp.
 * `grow` = global h^T row xw + 8hf, column w K/2 (rows K apart).  Rows of K/2 elements,
 * read back as 16-byte pieces, lane l taking piece l % P of row l / P (P = pieces per
 * row), so each STG.128 writes whole 128-byte lines (K/2 floats = 256 or 128 bytes; K/2
 * bf16 = 128 or 64 bytes per row, the 64-byte rows in pairs of sectors).  `buf` = this
 * warp's Ks2Stage buffer.  Syncs as in stage_hT32_half. */
template <int K, int C>
__device__ __forceinline__ void ks2_stage_hT32(unsigned char *buf, float *grow, const float (&X)[K / 16][4], int hf) {
  constexpr int kRow = Ks2Stage<K, C>::row;
  constexpr int kF4 = K / 8;       /* float4 per half row: 16 (K = 128), 8 (K = 64) */
  constexpr int kRows = 32 / kF4;  /* rows per warp instruction: 2, 4 */
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int lane = (int)(tid & 31);
  __syncwarp();
  float *s = reinterpret_cast<float *>(buf + (lane >> 2) * kRow) + 2 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < K / 16; nt++)
    *reinterpret_cast<float2 *>(s + nt * 8) = hf ? make_float2(X[nt][2], X[nt][3]) : make_float2(X[nt][0], X[nt][1]);
  __syncwarp();
  const int r = lane / kF4, c4 = lane % kF4;
  const unsigned char *src = buf + r * kRow + c4 * 16;
  float *dst = grow + r * K + c4 * 4;
#pragma unroll
  for (int i = 0; i < 8; i += kRows)
    *reinterpret_cast<float4 *>(dst + i * K) = *reinterpret_cast<const float4 *>(src + i * kRow);
}

template <int K, int C>
__device__ __forceinline__ void ks2_stage_hT16(unsigned char *buf, bf16 *grow, const float (&X)[K / 16][4], int hf) {
  constexpr int kRow = Ks2Stage<K, C>::row16;
  constexpr int kU4 = K / 16;     /* 16-byte pieces per half row: 8 (K = 128), 4 (K = 64) */
  constexpr int kRows = 32 / kU4; /* rows per warp instruction: 4, 8 */
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int lane = (int)(tid & 31);
  __syncwarp();
  unsigned char *s = buf + (lane >> 2) * kRow + 4 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < K / 16; nt++)
    *reinterpret_cast<uint32_t *>(s + nt * 16) = hf ? pack_bf16(X[nt][2], X[nt][3]) : pack_bf16(X[nt][0], X[nt][1]);
  __syncwarp();
  const int r = lane / kU4, c16 = lane % kU4;
  const unsigned char *src = buf + r * kRow + c16 * 16;
  bf16 *dst = grow + r * K + c16 * 8;
#pragma unroll
  for (int i = 0; i < 8; i += kRows)
    *reinterpret_cast<uint4 *>(dst + i * K) = *reinterpret_cast<const uint4 *>(src + i * kRow);
}

/* stage_dfrags for the C half w of D: the A tiles A[w C/32 + i], i < C/32, rows 16i.. of
 * the warp's buffer, out as 16-byte stores at `g` = global D row w C/2, column xw (rows ld
 * apart).  The tile is selected, not indexed by w (a register array indexed at run time
 * would go to local memory).  Syncs as in stage_hT32_half. */
template <int K, int C>
__device__ __forceinline__ void ks2_stage_dhalf(unsigned char *buf, bf16 *g, int64_t ld,
                                                const uint32_t (&A)[C / 16][4], int w) {
  constexpr int kRow = Ks2Stage<K, C>::drow;
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int lane = (int)(tid & 31);
  __syncwarp();
  unsigned char *s = buf + 2 * (lane & 3) * kRow + (lane >> 2) * 2;
#pragma unroll
  for (int i = 0; i < C / 32; i++)
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const uint32_t v = w ? A[C / 32 + i][q] : A[i][q];
      unsigned char *e = s + (16 * i + 8 * (q >> 1)) * kRow + 16 * (q & 1);
      *reinterpret_cast<uint16_t *>(e) = (uint16_t)(v & 0xffffu);
      *reinterpret_cast<uint16_t *>(e + kRow) = (uint16_t)(v >> 16);
    }
  __syncwarp();
  const int r = lane >> 1, h16 = (lane & 1) * 16;
#pragma unroll
  for (int i = 0; i < C / 2; i += 16)
    *reinterpret_cast<uint4 *>(reinterpret_cast<unsigned char *>(g + (i + r) * ld) + h16) =
        *reinterpret_cast<const uint4 *>(buf + (i + r) * kRow + h16);
}

/* Layout of state_ks2_kernel_v3: the plain pass's stages, then per warp pair the two
 * exchange buffers: Sa (the bf16 A fragments of S^T, K/16 tiles) and Da (those of D^T,
 * C/16 tiles), each tile as 32 lanes x 16 bytes, so one STS.128 / LDS.128 per tile moves
 * 512 contiguous bytes (4 wavefronts, the minimum). */
template <int K, int C, int TC, int BV, bool SAVE = false>
struct Ks2Layout {
  using P = Layout<K, C, TC, BV, SAVE>;
  static constexpr int stage = P::stage;
  static constexpr int oXS = stage * kStages;               /* Sa tiles, per pair */
  static constexpr int oXD = oXS + BV / 16 * (K / 16) * 512; /* Da tiles, per pair */
  static constexpr int oHt = oXD + BV / 16 * (C / 16) * 512; /* SAVE: Ks2Stage, per warp */
  static constexpr int total = oHt + (SAVE ? BV / 16 * 2 * Ks2Stage<K, C>::warp_bytes : 0);
};

/* The plain state pass (state_kernel_v3<.., SAVE = false>) with two warps on each 16
 * value columns (GDP_CUDA_V3_PASSES; default where the plain pass runs one-warp blocks,
 * i.e. a few long sequences: at 1 x 32768, H = 16 the pass had 128 one-warp blocks on 132
 * SMs, one tensor pipe of four busy per SM, and its per-chunk chain of 176 mma on one warp
 * set the time).  Warp pair g owns value columns xw = col0 + 16g .. +15; its warp w = 0, 1:
 *   - S^T rows' K half: St[i] = the original St[w K/16 + i] (key columns 8(w K/16 + i)..);
 *   - D^T's C half: Dt[i] = the original Dt[w C/16 + i];
 *   - o^T's TC half: Ot[i] = the original Ot[w TC/16 + i].
 * Every product needs the full A operand (Sa over all K for D and o, Da over all C for o
 * and S), so each warp publishes its half of Sa (after its S update, for the next chunk)
 * and of Da (after D) as bf16 fragments in shared memory and both read back all tiles.
 * Each accumulator element sees the same mma, with the same operands, in the same order
 * as in state_kernel_v3 (D: -U^T, then kt = 0..K/16-1; o: Qd kt = 0.., then Pm; S: decay,
 * then kt = 0..C/16-1), so o and ht are bit-identical to it; the mma per warp and chunk
 * halve (176 -> 88 at K = 128, C = 64), as do the panel copies per thread.
 * Ordering: the Sa tiles of chunk it are written before the loop-top __syncthreads of
 * iteration it (the initial state's before the loop) and read after it; the Da tiles are
 * written after it and read after the pair's named barrier (1 + g).  A warp rewrites its
 * Sa tiles after that pair barrier, which its partner reaches only after its Sa reads;
 * and its Da tiles after the next loop-top barrier, which its partner reaches only after
 * its Da reads.  So one buffer each suffices.  Needs C % 32 == 0 and TC % 32 == 0 (n = 1,
 * 2): each warp then owns whole 16-column A tiles of D and pairs of 8-column o tiles.
 * SAVE, S16: the saving pass (state_kernel_v3<.., SAVE, S16>) split alike: U = hi + lo in
 * D, each warp stores its K half of h^T (ks2_stage_hT32 / 16, at the same two points of the
 * chunk as there) and its C half of D (ks2_stage_dhalf, after its Sa publish) through its
 * own Ks2Stage buffer: the same bits at the same addresses as the one-warp saving pass. */
template <int K, int C, int TC, int BV, bool SAVE = false, bool S16 = false>
__global__ void __launch_bounds__(BV / 16 * 64, 1) state_ks2_kernel_v3(GdpArgs a, float *hT32, bf16 *hT16) {
  pdl_wait(); /* the prep's panels (launched as its programmatic dependent) */
  using P = Layout<K, C, TC, BV, SAVE>;
  using L = Ks2Layout<K, C, TC, BV, SAVE>;
  constexpr int NT = BV / 16 * 64;
  static_assert(K % 32 == 0 && C % 32 == 0 && TC % 32 == 0 && BV % 16 == 0, "tile shapes");
  constexpr int SK = K / 16, SC = C / 16, ST = TC / 16; /* 8-column tiles per warp of S, D, o */
  extern __shared__ __align__(128) unsigned char smem[];
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * BV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = warp >> 1, w = warp & 1;
  const int grp = lane >> 2, tig = lane & 3;
  const int H = a.H, V = a.V;
  const int cbeg = a.choff[s], nc = a.choff[s + 1] - cbeg;
  const int64_t soff = ((int64_t)s * H + h) * K * V;
  const int xw = col0 + g * 16; /* the pair's first value column */

  float St[SK][4];
#pragma unroll
  for (int nt = 0; nt < SK; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int r = (w * SK + nt) * 8 + 2 * tig + (e & 1), x = xw + grp + 8 * (e >> 1);
      St[nt][e] = a.h0 ? a.h0[soff + (int64_t)r * V + x] : 0.f;
    }

  auto issue = [&](int it) {
    if (it < nc) {
      unsigned char *st = smem + (it % kStages) * L::stage;
      const int64_t base = (int64_t)(cbeg + it) * H + h;
      copy_panel_full<C, K, NT>(st + P::oW, P::ldK, a.W + base * C * K, K);
      copy_panel_full<C, K, NT>(st + P::oKd, P::ldK, a.Kd + base * C * K, K);
      copy_panel_full<TC, K, NT>(st + P::oQd, P::ldK, a.Qd + base * TC * K, K);
      copy_panel_full<TC, C, NT>(st + P::oPm, P::ldC, a.Pm + base * TC * C, C);
      copy_panel_full<C, BV, NT>(st + P::oU, P::ldB, a.U + base * C * V + col0, V);
      if constexpr (SAVE) copy_panel_full<C, BV, NT>(st + P::oUl, P::ldB, a.Ulo + base * C * V + col0, V);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int it = 0; it < kStages - 1; it++) issue(it);

  const int nrow = (lane >> 4) * 8 + (lane & 7), ncol = ((lane >> 3) & 1) * 8;
  const int trow = ((lane >> 3) & 1) * 8 + (lane & 7), tcol = (lane >> 4) * 8;
  const int urow = (lane >> 4) * 8 + (lane & 7), ucol = g * 16 + ((lane >> 3) & 1) * 8;
  const uint32_t smem0 = smem_addr(smem);
  /* the pair's exchange tiles (K/16 of Sa, C/16 of Da); lane's 16 bytes of tile t at
   * + t * 512 */
  uint4 *const xS = reinterpret_cast<uint4 *>(smem + L::oXS + g * (K / 16) * 512) + lane;
  uint4 *const xD = reinterpret_cast<uint4 *>(smem + L::oXD + g * (C / 16) * 512) + lane;

  /* this warp's half of Sa: A tiles w K/32 + i, from St[2i], St[2i + 1] */
  auto put_sa = [&]() {
#pragma unroll
    for (int i = 0; i < SK / 2; i++)
      xS[(w * SK / 2 + i) * 32] = make_uint4(pack_bf16(St[2 * i][0], St[2 * i][1]), pack_bf16(St[2 * i][2], St[2 * i][3]),
                                             pack_bf16(St[2 * i + 1][0], St[2 * i + 1][1]),
                                             pack_bf16(St[2 * i + 1][2], St[2 * i + 1][3]));
  };
  put_sa();

  for (int it = 0; it < nc; it++) {
    const int c = cbeg + it;
    const float el = a.elast[(int64_t)c * H + h];
    const ChunkInfo ci = a.chunks[c];
    cp_async_wait<kStages - 2>();
    __syncthreads(); /* chunk it and both Sa halves visible; stage (it-1) free */
    issue(it + kStages - 1);

    const uint32_t sb = smem0 + (it % kStages) * L::stage;
    const uint32_t sW = sb + P::oW + w * (C / 2) * P::ldK * 2, sKd = sb + P::oKd + w * (K / 2) * 2,
                   sQd = sb + P::oQd + w * (TC / 2) * P::ldK * 2, sPm = sb + P::oPm + w * (TC / 2) * P::ldC * 2,
                   sU = sb + P::oU + w * (C / 2) * P::ldB * 2;
    /* SAVE: this warp's K half of h^T rows xw..xw+7 now, of rows xw+8..15 after its D
     * products (St is unchanged until the decay), as in state_kernel_v3 */
    unsigned char *const hbuf = smem + L::oHt + warp * Ks2Stage<K, C>::warp_bytes;
    const int64_t hrow = ((int64_t)c * H + h) * V * K + (int64_t)xw * K + w * (K / 2);
    if constexpr (SAVE && S16)
      ks2_stage_hT16<K, C>(hbuf, hT16 + hrow, St, 0);
    else if constexpr (SAVE)
      ks2_stage_hT32<K, C>(hbuf, hT32 + hrow, St, 0);

    uint32_t Sa[K / 16][4];
#pragma unroll
    for (int kt = 0; kt < K / 16; kt++) {
      const uint4 v = xS[kt * 32];
      Sa[kt][0] = v.x, Sa[kt][1] = v.y, Sa[kt][2] = v.z, Sa[kt][3] = v.w;
    }

    /* -D^T for this warp's C half: j-tiles w C/16 + i */
    float Dt[SC][4];
    /* SAVE: U = hi + lo, as in state_kernel_v3's saving pass */
    neg_u_from_panel<SC / 2>(Dt, sU, sU + (P::oUl - P::oU), P::ldB, urow, ucol, SAVE);
#pragma unroll
    for (int kt = 0; kt < K / 16; kt++)
#pragma unroll
      for (int nt = 0; nt < SC; nt += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(sW + ((nt * 8 + nrow) * P::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
        mma16816(Dt[nt], Sa[kt], b0, b1);
        mma16816(Dt[nt + 1], Sa[kt], b2, b3);
      }
#pragma unroll
    for (int i = 0; i < SC / 2; i++)
      xD[(w * SC / 2 + i) * 32] = make_uint4(pack_bf16(-Dt[2 * i][0], -Dt[2 * i][1]),
                                             pack_bf16(-Dt[2 * i][2], -Dt[2 * i][3]),
                                             pack_bf16(-Dt[2 * i + 1][0], -Dt[2 * i + 1][1]),
                                             pack_bf16(-Dt[2 * i + 1][2], -Dt[2 * i + 1][3]));
    if constexpr (SAVE && S16)
      ks2_stage_hT16<K, C>(hbuf, hT16 + hrow + 8 * K, St, 1);
    else if constexpr (SAVE)
      ks2_stage_hT32<K, C>(hbuf, hT32 + hrow + 8 * K, St, 1);
    /* both Da halves visible to the pair (named barrier 1 + g, its 64 threads) */
    asm volatile("bar.sync %0, 64;" ::"r"(1 + g) : "memory");
    uint32_t Da[C / 16][4];
#pragma unroll
    for (int kt = 0; kt < C / 16; kt++) {
      const uint4 v = xD[kt * 32];
      Da[kt][0] = v.x, Da[kt][1] = v.y, Da[kt][2] = v.z, Da[kt][3] = v.w;
    }

    /* S^T (this warp's K half) <- e^{last} S^T + D^T Kd, then its Sa half for the next
     * chunk: the serial chain first, o after it */
#pragma unroll
    for (int nt = 0; nt < SK; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) St[nt][e] *= el;
#pragma unroll
    for (int kt = 0; kt < C / 16; kt++)
#pragma unroll
      for (int nt = 0; nt < SK; nt += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(sKd + ((kt * 16 + trow) * P::ldK + nt * 8 + tcol) * 2, b0, b1, b2, b3);
        mma16816(St[nt], Da[kt], b0, b1);
        mma16816(St[nt + 1], Da[kt], b2, b3);
      }
    put_sa();
    /* SAVE: this warp's C half of D (rows w C/2..), off the chain */
    if constexpr (SAVE)
      ks2_stage_dhalf<K, C>(hbuf, a.Dbuf + ((int64_t)c * H + h) * C * V + (int64_t)(w * (C / 2)) * V + xw, V, Da,
                            w);

    /* o^T (this warp's TC half) = S^T Qd^T + D^T Pm^T */
    {
      float Ot[ST][4];
#pragma unroll
      for (int nt = 0; nt < ST; nt++) Ot[nt][0] = Ot[nt][1] = Ot[nt][2] = Ot[nt][3] = 0.f;
#pragma unroll
      for (int kt = 0; kt < K / 16; kt++)
#pragma unroll
        for (int nt = 0; nt < ST; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(sQd + ((nt * 8 + nrow) * P::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
          mma16816(Ot[nt], Sa[kt], b0, b1);
          mma16816(Ot[nt + 1], Sa[kt], b2, b3);
        }
#pragma unroll
      for (int kt = 0; kt < C / 16; kt++)
#pragma unroll
        for (int nt = 0; nt < ST; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(sPm + ((nt * 8 + nrow) * P::ldC + kt * 16 + ncol) * 2, b0, b1, b2, b3);
          mma16816(Ot[nt], Da[kt], b0, b1);
          mma16816(Ot[nt + 1], Da[kt], b2, b3);
        }
      bf16 *o = (bf16 *)a.o;
      const int64_t obase = (int64_t)ci.t0 * H + h;
#pragma unroll
      for (int nt = 0; nt < ST; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int qa = (w * ST + nt) * 8 + 2 * tig + (e & 1), x = xw + grp + 8 * (e >> 1);
          if (qa < ci.ntok) o[(obase + (int64_t)qa * H) * V + x] = __float2bfloat16(Ot[nt][e]);
        }
    }
  }
  cp_async_wait<0>();

  if (a.ht) {
#pragma unroll
    for (int nt = 0; nt < SK; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int r = (w * SK + nt) * 8 + 2 * tig + (e & 1), x = xw + grp + 8 * (e >> 1);
        a.ht[soff + (int64_t)r * V + x] = St[nt][e];
      }
  }
}

/* ------------------------------------------------------------------ the prep */

/* Offset (floats) of row i of the packed strictly-lower A: row r holds its r entries
 * j < r, padded to a multiple of 4 so that every row starts on 16 bytes (the solve reads
 * it by LDS.128).  Sum over r < i of 4 ceil(r/4) = 4 S(i+3), S(N) = sum_{u<N} floor(u/4)
 * = 2p(p-1) + s p for N = 4p + s. */
__host__ __device__ constexpr int prep_a_row(int i) {
  return 4 * (2 * ((i + 3) / 4) * ((i + 3) / 4 - 1) + ((i + 3) % 4) * ((i + 3) / 4));
}

/* The split solve (prep_split_*, below): rows 0..F-1 of columns 0..31 by warp 0, then the
 * remaining C - F rows in four blocks of RB, one per warp.  Its float buffer holds, per
 * column x < 32 (row x, `ld` floats), T's rows 0..F-1 and the first three row blocks as
 * they are published; ld is an odd number of 16-byte units, so that the eight lanes of a
 * quarter-warp reading (LDS.128) eight different columns fall in distinct bank groups. */
template <int C>
struct PrepSplit {
  static_assert(C == 32 || C == 48 || C == 64, "split solve shapes");
  static constexpr int F = C > 32 ? 32 : 16, RB = (C - F) / 4;
  static constexpr int ld = (F + 3 * RB) % 8 == 4 ? F + 3 * RB : F + 3 * RB + 4;
  static constexpr int bytes = 32 * ld * 4;
};

/* Shared-memory layout of the prep kernel (bytes).  k (then kn) and v stay resident; the
 * region from oQ on is used twice: first by q (then qn) and the packed A, then -- after
 * the barrier that ends the solve's reads of A -- by the bf16 panels Tw^T and Tu^T
 * (row x = column x of T, the layout the solve's threads write with 16-byte stores).
 * At K = V = 128, C = 64 that is 52.5 KB: four blocks per SM.  NOV (the prep that stores
 * Tu^T instead of U, TU_OUT): no v region (17 KB less at V = 128, C = 64). */
template <int K, int V, int C, int TC, bool STAGED = false, bool SPLIT = false, bool NOV = false>
struct PrepLayout {
  static constexpr int ldK = K + kPad, ldV = V + kPad, ldT = C + kPad;
  static constexpr int oK = 0;                   /* k rows, then kn (bf16) */
  static constexpr int oV = oK + C * ldK * 2;    /* v rows (bf16, as given; none with NOV) */
  static constexpr int oBeta = oV + (NOV ? 0 : C * ldV * 2); /* beta (float) */
  static constexpr int oGc = oBeta + C * 4;      /* in-chunk cumulative g (float) */
  static constexpr int oQ = oGc + C * 4;         /* q rows, then qn (bf16) */
  static constexpr int oA = oQ + TC * ldK * 2;   /* A, packed rows (float) */
  static constexpr int oTw = oQ;                 /* (T diag(beta e^gc))^T (bf16) */
  static constexpr int oTu = oTw + C * ldT * 2;  /* (T diag(beta))^T (bf16) */
  static constexpr int endA = oA + prep_a_row(C) * 4, endT = oTu + C * ldT * 2;
  /* SPLIT: the split solve's buffer over q (dead by then) where q's rows hold it (K = 128
   * with TC = 32: 7.5 KB in q's 8.5 at C = 64, no growth); at C = 48 after A and Tw^T /
   * Tu^T (+5.6 KB, still four blocks per SM), so that warp 0 reads its rows back after
   * the last barrier, not across the other write-outs (8-16 bytes spilled otherwise);
   * else (K = 64, C = 64) after A (+2.3 KB; there the late read-back spilled instead) */
  static constexpr int endAT = endA > endT ? endA : endT;
  static constexpr int oSolve = TC * ldK * 2 >= PrepSplit<C>::bytes ? oQ
                                : C == 48                         ? (endAT + 15) / 16 * 16
                                                                  : (endA + 15) / 16 * 16;
  static constexpr int endS = SPLIT ? oSolve + PrepSplit<C>::bytes : 0;
  static constexpr int end = endAT > endS ? endAT : endS;
  /* STAGED (prep_wu_staged): one 8 x 32 bf16 staging tile (512 bytes) per warp after
   * everything else: 52.5 -> 54.5 KB at K = V = 128, C = 64, still four blocks per SM */
  static constexpr int oStage = (end + 127) / 128 * 128;
  static constexpr int total = STAGED ? oStage + 4 * 512 : end;
};

/* A fragment (16 x 16, row-major source with row stride ld elements) at rows rb,
 * columns kb: matrices (rows lo, k lo), (rows hi, k lo), (rows lo, k hi), (rows hi, k hi)
 * are a0a1, a2a3, a4a5, a6a7. */
__device__ __forceinline__ void load_afrag(uint32_t base, int ld, int rb, int kb, uint32_t (&fa)[4]) {
  const int lane = threadIdx.x & 31;
  const int row = rb + (lane & 7) + ((lane >> 3) & 1) * 8, col = kb + (lane >> 4) * 8;
  ldsm_x4(base + (row * ld + col) * 2, fa[0], fa[1], fa[2], fa[3]);
}

/* Compile-time loops: the body gets its index as a type (PrepIdx<I>::value), so that
 * tile counts may depend on it and every register array stays constant-indexed. */
template <int I> struct PrepIdx { static constexpr int value = I; };
template <int N, int I = 0, class F>
__device__ __forceinline__ void prep_static_for(F &&f) {
  if constexpr (I < N) {
    f(PrepIdx<I>{});
    prep_static_for<N, I + 1>(f);
  }
}

/* Items of unequal cost (Cost::of(i), i < NI) onto the block's 4 warps: largest first
 * onto the least loaded warp (lower index on ties).  Evaluated by the compiler. */
template <int NI, class Cost>
struct PrepSched {
  int owner[NI] = {};
  constexpr PrepSched() {
    int load[4] = {0, 0, 0, 0};
    bool done[NI] = {};
    for (int k = 0; k < NI; k++) {
      int best = -1;
      for (int i = 0; i < NI; i++)
        if (!done[i] && (best < 0 || Cost::of(i) > Cost::of(best))) best = i;
      int w = 0;
      for (int u = 1; u < 4; u++)
        if (load[u] < load[w]) w = u;
      done[best] = true;
      owner[best] = w;
      load[w] += Cost::of(best);
    }
  }
};
/* The A / Pm products: item i < C/16 is A's row block i, which needs only key columns
 * < 16(i+1) (strictly lower); item C/16 + q is Pm's query rows 16q..16q+15, which need
 * only key rows <= a n + n - 1.  Cost: pairs of 8-column tiles. */
template <int C, int TC>
struct PrepApmCost {
  static constexpr int of(int i) {
    return i < C / 16 ? i + 1
                      : (((i - C / 16) * 16 + 15) * (C / TC) + C / TC - 1) / 16 + 1 < C / 16
                            ? (((i - C / 16) * 16 + 15) * (C / TC) + C / TC - 1) / 16 + 1
                            : C / 16;
  }
};
/* W = Tw Kn, U = Tu V: item g NR + r is row block r of 64-column group g (W's groups
 * first); T is lower triangular, so it needs only the k tiles kt <= r. */
template <int C>
struct PrepWuCost {
  static constexpr int of(int i) { return i % (C / 16) + 1; }
};
template <int C, int TC>
struct PrepScheds {
  static constexpr PrepSched<C / 16 + TC / 16, PrepApmCost<C, TC>> apm{};
};
template <int K, int V, int C>
struct PrepWuSched {
  static constexpr PrepSched<(K / 64 + V / 64) * (C / 16), PrepWuCost<C>> wu{};
};
/* The same items, costed for the prep that also stores U's residual (STORE_ULO): there a
 * U item stores twice the pieces of a W item (8 staged 16-byte stores instead of 4, with
 * the residual's arithmetic), so besides its k tiles (r + 1 of them) an item costs half a
 * k tile per staged piece: W 2(r + 1) + 2, U 2(r + 1) + 4 (in half tiles).  PrepWuCost's
 * schedule gives warp g all items of 64-column group g -- at K = V = 128 warps 2 and 3 run
 * every U item, so they alone carry the residual (32 staged stores each against the W
 * warps' 16) and end the block; this one gives every warp 2 W and 2 U items (24 each)
 * with the same 10 k tiles a warp (K = V = 128, C = 64; every shape: prep_wu_owner_bits_ulo). */
template <int C, int GK>
struct PrepWuCostUlo {
  static constexpr int of(int i) { return 2 * (i % (C / 16) + 1) + (i / (C / 16) >= GK ? 4 : 2); }
};
template <int K, int V, int C>
struct PrepWuSchedUlo {
  static constexpr PrepSched<(K / 64 + V / 64) * (C / 16), PrepWuCostUlo<C, K / 64>> wu{};
};

/* The owners of PrepWuSched's items as a 2-bit-per-item mask (at most 16 items), so that
 * the staged W/U phase can walk its items in a runtime loop: its code then exists once
 * per item kind instead of once per item. */
template <int K, int V, int C, bool ULO_COST = false>
__host__ __device__ constexpr uint32_t prep_wu_owner_bits() {
  uint32_t bits = 0;
  for (int i = 0; i < (K / 64 + V / 64) * (C / 16); i++)
    bits |= (uint32_t)(ULO_COST ? PrepWuSchedUlo<K, V, C>::wu.owner[i] : PrepWuSched<K, V, C>::wu.owner[i])
            << (2 * i);
  return bits;
}
/* The owners the prep that stores U's residual runs with: PrepWuSchedUlo's where its most
 * loaded warp (in PrepWuCostUlo's units) carries less than PrepWuSched's, else
 * PrepWuSched's (K, V, C = 128, 128, 64: 36 -> 32; 128, 128, 48: 24 -> 22; 128, 128, 32:
 * 14 -> 12; kept at 64, 64, 32 / 64, 128, 32 / 64, 128, 64 / 128, 64, 48, where it is a
 * tie).  The items, and what each computes, are the same: only which warp runs them. */
template <int K, int V, int C>
__host__ __device__ constexpr uint32_t prep_wu_owner_bits_ulo() {
  constexpr int NI = (K / 64 + V / 64) * (C / 16);
  int load_old[4] = {0, 0, 0, 0}, load_new[4] = {0, 0, 0, 0};
  for (int i = 0; i < NI; i++) {
    load_old[PrepWuSched<K, V, C>::wu.owner[i]] += PrepWuCostUlo<C, K / 64>::of(i);
    load_new[PrepWuSchedUlo<K, V, C>::wu.owner[i]] += PrepWuCostUlo<C, K / 64>::of(i);
  }
  int max_old = 0, max_new = 0;
  for (int w = 0; w < 4; w++) {
    max_old = load_old[w] > max_old ? load_old[w] : max_old;
    max_new = load_new[w] > max_new ? load_new[w] : max_new;
  }
  return max_new < max_old ? prep_wu_owner_bits<K, V, C, true>() : prep_wu_owner_bits<K, V, C, false>();
}

/* stmatrix (sm_90): the inverse of ldsm_x4 -- register i of thread t (row t/4, columns
 * 2(t%4), 2(t%4)+1 of matrix i) goes to the row address that lane 8i + t/4 gives.  The
 * memory clobbers keep the compiler from moving the staged tile's plain accesses across. */
__device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

/* A 16-byte global store, as one st.global.v4 whatever the compiler knows of the
 * address.  The memory clobber keeps the next l2 step's shared loads behind it, as they
 * were behind the plain store: without it ptxas hoisted them and took 12 more registers
 * (C = 32: 94 -> 106, one block per SM fewer). */
__device__ __forceinline__ void stg128(void *p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

/* One 8-row x 32-column bf16 piece of an accumulator tile to global in 16-byte row
 * stores, through the warp's 512-byte staging tile: w[m] is this lane's word of 8-column
 * block m (row grp, columns 8m + 2tig, +1), stored by stmatrix; each lane then reads row
 * lane/4, columns 8(lane%4)..+7 back and stores them at g (which the caller points
 * there), so that every store instruction writes 8 rows x 64 contiguous bytes (16 whole
 * sectors) instead of 8 rows x 16 bytes.  The tile's 16-byte chunks are XOR-swizzled by
 * (row/2)%4: the eight rows of each stmatrix matrix, and the eight lanes of each
 * quarter-warp read, then fall in eight distinct bank groups. */
__device__ __forceinline__ void prep_stage_store(uint32_t st_addr, uint32_t ld_addr, const uint32_t (&w)[4], bf16 *g) {
  __syncwarp(); /* the previous piece's reads are done before the tile is overwritten */
  stsm_x4(st_addr, w[0], w[1], w[2], w[3]);
  __syncwarp();
  *reinterpret_cast<uint4 *>(g) = lds128(ld_addr);
}

/* Column x (>= X0) of T = (I + A)^-1 by forward substitution, the column in registers;
 * rows above X0 are zero and skipped (X0 a multiple of 4, so each row's four partial
 * sums take the same terms in the same order as without the skip). */
template <int C, int X0>
__device__ __forceinline__ void prep_solve_column(const float *sA, int x, float (&t)[C]) {
#pragma unroll
  for (int i = 0; i < X0; i++) t[i] = 0.f;
#pragma unroll
  for (int i = X0; i < C; i++) {
    /* four partial sums: the dependent chain of one row is i/4 long instead of i */
    float s[4] = {(i == x) ? 1.f : 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = X0; j < i; j++) s[j & 3] -= sA[prep_a_row(i) + j] * t[j];
    t[i] = (s[0] + s[1]) + (s[2] + s[3]);
  }
}

/* BEGIN prep_split_solve (the CPU emulator compiles this block as it stands)
 *
 * T = (I + A)^-1 with the row-serial chain cut into pieces that four warps share, the
 * same floats as prep_solve_column.  That routine makes entry (i, x) as
 * (s0 + s1) + (s2 + s3), s_m = [i == x] - sum over j = m (mod 4), ascending, of
 * A[i][j] t[j] (one rounded fma a term; nvcc contracts `s -= a * t` into exactly the
 * fma(-a, t, s) written out here).  Any schedule that runs each s_m's terms in that
 * order, each term once its t[j] is final, gives the same bits.  For the columns
 * x < 32 (the row-serial routine's warp 0, whose 2016 fma a thread at C = 64 were the
 * prep's longest chain):
 *  1. warp 0 solves rows 0..F-1 (prep_split_first) and puts them in the buffer; warp 1
 *     meanwhile solves the columns 32..C-1 (prep_solve_column<C, 32>, unchanged);
 *  2. every warp g takes RB rows, F + RB g.., of every column x = lane, and adds their
 *     terms j < F (prep_split_rows: 256 fma a thread at C = 64, in parallel);
 *  3. block b = 0..3 in turn: warp b finishes its rows (terms j in its own block,
 *     prep_split_own) and publishes them; after a barrier, the warps g > b add that
 *     block's terms (prep_split_take).
 * The longest chain at C = 64 is 496 + 256 + 304 fma instead of 2016. */
__device__ __forceinline__ float prep_fms(float a, float t, float s) { return __fmaf_rn(-a, t, s); }

/* Phase 1, warp 0: rows 0..F-1 of column x (< 32), to row x of the buffer. */
template <int C>
__device__ __forceinline__ void prep_split_first(const float *sA, float *sBuf, int x) {
  constexpr int F = PrepSplit<C>::F;
  float t[F];
#pragma unroll
  for (int i = 0; i < F; i++) {
    float s[4] = {(i == x) ? 1.f : 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < i; j++) s[j & 3] = prep_fms(sA[prep_a_row(i) + j], t[j], s[j & 3]);
    t[i] = (s[0] + s[1]) + (s[2] + s[3]);
  }
  float *row = sBuf + x * PrepSplit<C>::ld;
#pragma unroll
  for (int i = 0; i < F; i += 4) *reinterpret_cast<float4 *>(row + i) = make_float4(t[i], t[i + 1], t[i + 2], t[i + 3]);
}

/* Rows F + RB g + r (r < RB) of one column take NJ terms: s[r][j % 4] -= A[row][j0 + j]
 * t[j] for j < NJ, with t = the column's solved rows from j0 and arow = row F + RB g's
 * packed A entries from j0 (phase 2: j0 = 0, NJ = F; phase 3: one block of RB). */
template <int C, int NJ>
__device__ __forceinline__ void prep_split_terms(const float *t, const float *arow, int g,
                                                 float (&s)[PrepSplit<C>::RB][4]) {
  constexpr int F = PrepSplit<C>::F, RB = PrepSplit<C>::RB;
#pragma unroll
  for (int jb = 0; jb < NJ; jb += 4) {
    const float4 t4 = *reinterpret_cast<const float4 *>(t + jb);
    const float *ar = arow;
#pragma unroll
    for (int r = 0; r < RB; r++) {
      const float4 a4 = *reinterpret_cast<const float4 *>(ar + jb);
      s[r][0] = prep_fms(a4.x, t4.x, s[r][0]);
      s[r][1] = prep_fms(a4.y, t4.y, s[r][1]);
      s[r][2] = prep_fms(a4.z, t4.z, s[r][2]);
      s[r][3] = prep_fms(a4.w, t4.w, s[r][3]);
      ar += (F + RB * g + r + 3) & ~3; /* the next packed row */
    }
  }
}

/* Phase 2, warp g: the partial sums of rows F + RB g + r of column x over j < F. */
template <int C>
__device__ __forceinline__ void prep_split_rows(const float *sA, const float *sBuf, int g, int x,
                                                float (&s)[PrepSplit<C>::RB][4]) {
  constexpr int F = PrepSplit<C>::F, RB = PrepSplit<C>::RB;
#pragma unroll
  for (int r = 0; r < RB; r++) {
    s[r][0] = (F + RB * g + r == x) ? 1.f : 0.f;
    s[r][1] = s[r][2] = s[r][3] = 0.f;
  }
  prep_split_terms<C, F>(sBuf + x * PrepSplit<C>::ld, sA + prep_a_row(F + RB * g), g, s);
}

/* Phase 3, warp B: its own rows' terms within block B, then the rows themselves. */
template <int C, int B>
__device__ __forceinline__ void prep_split_own(const float *sA, float (&s)[PrepSplit<C>::RB][4],
                                               float (&own)[PrepSplit<C>::RB]) {
  constexpr int RB = PrepSplit<C>::RB, i0 = PrepSplit<C>::F + RB * B;
#pragma unroll
  for (int r = 0; r < RB; r++) {
#pragma unroll
    for (int j = i0; j < i0 + r; j++) s[r][j & 3] = prep_fms(sA[prep_a_row(i0 + r) + j], own[j - i0], s[r][j & 3]);
    own[r] = (s[r][0] + s[r][1]) + (s[r][2] + s[r][3]);
  }
}

/* Phase 3, warp B publishes its rows of column x (B < 3; the barrier follows). */
template <int C, int B>
__device__ __forceinline__ void prep_split_publish(float *sBuf, int x, const float (&own)[PrepSplit<C>::RB]) {
  constexpr int RB = PrepSplit<C>::RB;
  float *row = sBuf + x * PrepSplit<C>::ld + PrepSplit<C>::F + RB * B;
#pragma unroll
  for (int r = 0; r < RB; r += 4)
    *reinterpret_cast<float4 *>(row + r) = make_float4(own[r], own[r + 1], own[r + 2], own[r + 3]);
}

/* Phase 3, warp g > B (after the barrier): block B's terms into rows F + RB g + r. */
template <int C, int B>
__device__ __forceinline__ void prep_split_take(const float *sA, const float *sBuf, int g, int x,
                                                float (&s)[PrepSplit<C>::RB][4]) {
  constexpr int F = PrepSplit<C>::F, RB = PrepSplit<C>::RB, j0 = F + RB * B;
  prep_split_terms<C, RB>(sBuf + x * PrepSplit<C>::ld + j0, sA + prep_a_row(F + RB * g) + j0, g, s);
}
/* END prep_split_solve */

/* Row x of Tw^T, Tu^T (shared) and of T^T (global, STORE_T) for T's rows i0..i0+N-1 of
 * column x (N = 4 or a multiple of 8), as the row-serial path writes them: the same
 * products and roundings, in 8- or 16-byte pieces. */
template <int N, bool STORE_T, class L>
__device__ __forceinline__ void prep_t_rows_out(const float *t, int i0, int x, float bx, float bgx, bf16 *sTw,
                                                bf16 *sTu, bf16 *Ttrow) {
  if constexpr (N == 4) {
    const uint2 w = make_uint2(pack_bf16(t[0] * bgx, t[1] * bgx), pack_bf16(t[2] * bgx, t[3] * bgx));
    const uint2 u = make_uint2(pack_bf16(t[0] * bx, t[1] * bx), pack_bf16(t[2] * bx, t[3] * bx));
    *reinterpret_cast<uint2 *>(sTw + x * L::ldT + i0) = w;
    *reinterpret_cast<uint2 *>(sTu + x * L::ldT + i0) = u;
    if constexpr (STORE_T)
      *reinterpret_cast<uint2 *>(Ttrow + i0) = make_uint2(pack_bf16(t[0], t[1]), pack_bf16(t[2], t[3]));
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 8) {
      uint32_t w4[4], u4[4];
#pragma unroll
      for (int m = 0; m < 4; m++) {
        w4[m] = pack_bf16(t[i + 2 * m] * bgx, t[i + 2 * m + 1] * bgx);
        u4[m] = pack_bf16(t[i + 2 * m] * bx, t[i + 2 * m + 1] * bx);
      }
      *reinterpret_cast<uint4 *>(sTw + x * L::ldT + i0 + i) = make_uint4(w4[0], w4[1], w4[2], w4[3]);
      *reinterpret_cast<uint4 *>(sTu + x * L::ldT + i0 + i) = make_uint4(u4[0], u4[1], u4[2], u4[3]);
      if constexpr (STORE_T) {
        uint32_t t4[4];
#pragma unroll
        for (int m = 0; m < 4; m++) t4[m] = pack_bf16(t[i + 2 * m], t[i + 2 * m + 1]);
        *reinterpret_cast<uint4 *>(Ttrow + i0 + i) = make_uint4(t4[0], t4[1], t4[2], t4[3]);
      }
    }
  }
}

/* The split solve (prep_split_*) and the panels Tw^T, Tu^T (and T^T) from it: the same
 * bits as the row-serial block in prep_kernel_v3, with 4 more barriers.  sBuf: the
 * layout's oSolve (over q, or after A); Tw^T / Tu^T go over q and A after the last
 * barrier, as before. */
template <int C, bool STORE_T, class L>
__device__ __forceinline__ void prep_split_solve(const float *sA, float *sBuf, const float *sBeta, const float *sGc,
                                                 bf16 *sTw, bf16 *sTu, bf16 *Tt, int64_t CHi, int warp, int lane) {
  using S = PrepSplit<C>;
  constexpr int F = S::F, RB = S::RB;
  float s[RB][4], own[RB];
  float t2[C]; /* warp 1: column 32 + lane (C > 32), rows 0..31 zero */
  if (warp == 0) prep_split_first<C>(sA, sBuf, lane);
  if constexpr (C > 32) {
    if (warp == 1 && lane < C - 32) prep_solve_column<C, 32>(sA, 32 + lane, t2);
  }
  __syncthreads();
  prep_split_rows<C>(sA, sBuf, warp, lane, s);
  prep_static_for<4>([&](auto Bi) {
    constexpr int b = decltype(Bi)::value;
    if (warp == b) {
      prep_split_own<C, b>(sA, s, own);
      if constexpr (b < 3) prep_split_publish<C, b>(sBuf, lane, own);
    }
    if constexpr (b < 3) {
      __syncthreads();
      if (warp > b) prep_split_take<C, b>(sA, sBuf, warp, lane, s);
    }
  });
  /* warp 0's rows 0..F-1 come back from the buffer: before the barrier where Tw^T / Tu^T
   * go over it, after it where they do not (kLate: then they are not held across the
   * other write-outs) */
  constexpr bool kLate = L::oSolve >= L::endT;
  float t1[F];
  auto load_t1 = [&] {
#pragma unroll
    for (int i = 0; i < F; i += 4) {
      const float4 v = *reinterpret_cast<const float4 *>(sBuf + lane * S::ld + i);
      t1[i] = v.x, t1[i + 1] = v.y, t1[i + 2] = v.z, t1[i + 3] = v.w;
    }
  };
  if (!kLate && warp == 0) load_t1();
  __syncthreads(); /* every read of A (and, unless kLate, of the buffer) is done: Tw^T, Tu^T go over them */
  if constexpr (C > 32) {
    if (warp == 1 && lane < C - 32) {
      const int x = 32 + lane;
      const float bx = sBeta[x], bgx = bx * __expf(sGc[x]);
      prep_t_rows_out<C, STORE_T, L>(t2, 0, x, bx, bgx, sTw, sTu, STORE_T ? Tt + (CHi * C + x) * C : nullptr);
    }
  }
  {
    const int x = lane;
    const float bx = sBeta[x], bgx = bx * __expf(sGc[x]);
    bf16 *Ttrow = STORE_T ? Tt + (CHi * C + x) * C : nullptr;
    prep_t_rows_out<RB, STORE_T, L>(own, F + RB * warp, x, bx, bgx, sTw, sTu, Ttrow);
    if (warp == 0) {
      if (kLate) load_t1();
      prep_t_rows_out<F, STORE_T, L>(t1, 0, x, bx, bgx, sTw, sTu, Ttrow);
    }
  }
}

/* The W/U phase of prep_kernel_v3 with WU_STAGED (same products, same bits as the
 * unrolled phase in the kernel): W = Tw Kn, U = Tu V (and U's residual with STORE_ULO)
 * by items of 16 rows x 64 columns, each warp taking the items PrepWuSched gives it, but
 *  - in a runtime loop over the items (one copy of the code per item kind, W or U,
 *    instead of one per item: the unrolled phase is 19 KB of the kernel's 139.5 KB at
 *    K = V = 128, C = 64, and 36 KB with the residual, which took the kernel past what
 *    the instruction cache holds -- NOTES.md, "The backward's prep");
 *  - U's items first, so that their stores (twice as many with the residual) drain
 *    behind the W items' products rather than at the block's exit;
 *  - every output through prep_stage_store: 16-byte stores of 64 contiguous bytes per
 *    row instead of 4-byte stores of 16. */
template <int K, int V, int C, bool STORE_ULO, class L, bool TU_OUT = false>
__device__ __forceinline__ void prep_wu_staged(const GdpArgs &a, int64_t CHi, uint32_t s0, uint32_t owners) {
  constexpr int GK = K / 64, NR = C / 16, NI = (GK + V / 64) * NR;
  static_assert(NI <= 16, "owner bits");
  const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
  const int trow = ((lane >> 3) & 1) * 8 + (lane & 7), tcol = (lane >> 4) * 8;
  const int aoff = ((lane >> 4) * 8 + (lane & 7)) * L::ldT + ((lane >> 3) & 1) * 8;
  /* this warp's staging tile (8 rows of 64 bytes): stmatrix row address of lane l
   * (matrix l/8, row l%8) and the 16 bytes lane l reads back (row l/4, chunk l%4) */
  const uint32_t stage = s0 + L::oStage + warp * 512;
  const int sr = lane & 7, lr = lane >> 2, lc = lane & 3;
  const uint32_t st_addr = stage + sr * 64 + (((lane >> 3) ^ (sr >> 1)) & 3) * 16;
  const uint32_t ld_addr = stage + lr * 64 + ((lc ^ (lr >> 1)) & 3) * 16;

  auto item = [&](auto isu_tag, int it) {
    constexpr bool isu = decltype(isu_tag)::value != 0;
    constexpr int ldb = isu ? L::ldV : L::ldK, ldo = isu ? V : K;
    const int r = it % NR, rb = r * 16, cb = (it / NR - (isu ? GK : 0)) * 64;
    const uint32_t tbase = s0 + (isu ? L::oTu : L::oTw) + (rb + aoff) * 2,
                   bbase = s0 + (isu ? L::oV : L::oK) + (trow * ldb + cb + tcol) * 2;
    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll 2
    for (int kt = 0; kt <= r; kt++) {
      uint32_t fa[4];
      ldsm_x4_t(tbase + kt * 16 * L::ldT * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
      for (int nt = 0; nt < 8; nt += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(bbase + (kt * 16 * ldb + nt * 8) * 2, b0, b1, b2, b3);
        mma16816(acc[nt], fa, b0, b1);
        mma16816(acc[nt + 1], fa, b2, b3);
      }
    }
    /* this lane's 16 bytes of each staged piece: row rb + lr (+ 8 hf), columns
     * cb + 8 lc (+ 32 q) */
    const int64_t off = (int64_t)(rb + lr) * ldo + cb + lc * 8;
    bf16 *out = (isu ? a.U + CHi * C * V : a.W + CHi * C * K) + off;
#pragma unroll
    for (int hf = 0; hf < 2; hf++)
#pragma unroll
      for (int q = 0; q < 2; q++) {
        uint32_t hi[4];
#pragma unroll
        for (int m = 0; m < 4; m++) hi[m] = pack_bf16(acc[4 * q + m][2 * hf], acc[4 * q + m][2 * hf + 1]);
        prep_stage_store(st_addr, ld_addr, hi, out + 8 * hf * ldo + 32 * q);
        if constexpr (STORE_ULO && isu) {
          /* U's bf16 rounding residual: U - bf16(U) is exact in float32 (the float of a
           * bf16 is its bits shifted up), its bf16 rounding keeps U to ~16 bits */
          uint32_t lo[4];
#pragma unroll
          for (int m = 0; m < 4; m++)
            lo[m] = pack_bf16(acc[4 * q + m][2 * hf] - __uint_as_float(hi[m] << 16),
                              acc[4 * q + m][2 * hf + 1] - __uint_as_float(hi[m] & 0xffff0000u));
          prep_stage_store(st_addr, ld_addr, lo, a.Ulo + CHi * C * V + off + 8 * hf * ldo + 32 * q);
        }
      }
  };
  /* not unrolled: that is the point */
#pragma unroll 1
  for (int it = GK * NR; it < (TU_OUT ? 0 : NI); it++) /* TU_OUT: no U (the state pass forms it) */
    if ((int)((owners >> (2 * it)) & 3u) == warp) item(PrepIdx<1>{}, it);
#pragma unroll 1
  for (int it = 0; it < GK * NR; it++)
    if ((int)((owners >> (2 * it)) & 3u) == warp) item(PrepIdx<0>{}, it);
}

/* The W items alone (the prep that leaves U to the state pass, TU_OUT below):
 * PrepWuCost's deal over W's items only, so that all four warps share them (at K = 128,
 * C = 64 each takes 5 of the 20 k tiles) instead of the two that own W's column groups
 * in the W/U deal. */
template <int K, int C>
struct PrepWSched {
  static constexpr PrepSched<(K / 64) * (C / 16), PrepWuCost<C>> w{};
};
template <int K, int C>
__host__ __device__ constexpr uint32_t prep_w_owner_bits() {
  uint32_t bits = 0;
  for (int i = 0; i < (K / 64) * (C / 16); i++) bits |= (uint32_t)PrepWSched<K, C>::w.owner[i] << (2 * i);
  return bits;
}

/* TU_OUT: the panel Tu^T = (T diag(beta))^T, as the solve left it in shared memory (row x
 * = column x of T times beta_x, bf16), to a.Tu ([C][C] per (chunk, head)) in 16-byte
 * pieces by all 128 threads. */
template <int C, class L>
__device__ __forceinline__ void prep_store_tu(const GdpArgs &a, int64_t CHi, uint32_t s0) {
  constexpr int per_row = C / 8;
  bf16 *g = a.Tu + CHi * C * C;
#pragma unroll
  for (int e0 = 0; e0 < C * per_row; e0 += 128) {
    const int e = e0 + (int)threadIdx.x, r = e / per_row, c8 = (e % per_row) * 8;
    if ((C * per_row) % 128 == 0 || e < C * per_row) { /* C = 48: 288 pieces */
      const uint4 v = lds128(s0 + L::oTu + (r * L::ldT + c8) * 2);
      stg128(g + r * C + c8, v.x, v.y, v.z, v.w);
    }
  }
}

/* One block (4 warps) per (chunk, head).  Same outputs as variant 2's chunk_prep_kernel
 * (gdp_fwd.cu): W, U, Kd, Qd, Pm (bf16) and e^{last}, with these differences of method:
 *  - products on mma.sync with the accumulators' epilogues applied in registers; tiles
 *    that are zero by the causal structure (A above the diagonal, Pm past each query's
 *    last key row, T above the diagonal) are skipped, with a compile-time schedule
 *    balancing the remaining tiles over the warps;
 *  - T = (I + A)^-1 by forward substitution with one thread per column of T, the column
 *    in registers (no barrier inside the solve: the columns are independent), float32;
 *    A is stored packed (strictly lower part only) so that the block fits 4 per SM;
 *  - beta and e^{gc} are folded into T's columns before its bf16 rounding
 *    (W = (T diag(beta e^gc)) Kn, U = (T diag(beta)) V), so v enters the product exactly
 *    as given instead of through a rounded beta v;
 *  - the l2 norms run K/8 lanes per row, 16 bytes a lane, every row of the chunk
 *    unrolled (the rows' shuffle chains overlap);
 *  - v arrives in its own cp.async group, waited for only before U's product.
 * For the panels a backward will read (the recompute backward's prep and a forward
 * saving for backward): STORE_T: T itself, unscaled, rounded to bf16, also goes to
 * global as T^T (row x = column x of T, [C][C] per (chunk, head) at Tt), for
 * grad_wy_kernel_v3 (gdp_bwd_v3.cu), which would otherwise solve for it again; STORE_ULO:
 * U's bf16 rounding residual to a.Ulo.  Both are template flags, not runtime tests: with
 * the residual's runtime test in it (never taken), the plain forward's prep at n = 2 ran
 * 0.86 ms instead of 0.50 on the H200 (session 3); its instantiation <false, false> is
 * instruction for instruction the kernel without either store.  WU_STAGED: the W/U
 * phase as prep_wu_staged (runtime item loop, 16-byte stores through shared memory), the
 * same bits in less code (<true, true> at K = V = 128, n = 2: 158 -> 128 KB, the plain
 * kernel 139.5), which is what brings it back inside the instruction cache (NOTES.md).
 * SPLIT: the triangular solve on four warps (prep_split_solve), the l2 steps' row kind
 * known at compile time, and at C = 32 five blocks per SM asked of ptxas (96 registers:
 * shared memory holds five there, and main's kernel happened to fit them; this one took
 * 102-106 registers unasked).  Same bits as without.
 * TU_OUT (the forward, GDP_CUDA_V3_U=tv): no U at all -- v is not read, U's
 * items are skipped -- and Tu^T (the U product's own bf16 operand) goes to a.Tu instead;
 * the state pass forms U = Tu V from v (state_kernel_v3's TU).  W, Kd, Qd, Pm, T^T and
 * e^last are the same bits as without.  FIVE (with TU_OUT): compiled for five blocks per
 * SM (96 registers; without v's region five fit in shared memory at C = 48, 64), where
 * four is the default elsewhere; ptxas: no spills at C = 32, 48, ~56 bytes at C = 64.
 */
template <int K, int V, int C, int TC, bool STORE_T, bool STORE_ULO, bool WU_STAGED, bool SPLIT, bool TU_OUT = false,
          bool FIVE = false>
__global__ void __launch_bounds__(128, FIVE || (SPLIT && C == 32) ? 5 : 4)
    prep_kernel_v3(GdpArgs a, bf16 *Tt, uint32_t wu_owners, int head_first) {
  /* the state pass after it may be scheduled once every prep block has started (it waits
   * for the prep's completion before it reads a panel): no launch gap */
  pdl_launch_dependents();
  using L = PrepLayout<K, V, C, TC, WU_STAGED, SPLIT, TU_OUT>;
  static_assert(K % 64 == 0 && V % 64 == 0 && C % 16 == 0 && TC % 16 == 0 && C <= 64 && TC <= 32 &&
                    C % TC == 0,
                "prep shapes");
  static_assert(!TU_OUT || (WU_STAGED && !STORE_ULO), "TU_OUT: the staged prep, without U's residual");
  static_assert(TU_OUT || !FIVE, "five blocks per SM only without v's region");
  constexpr int n = C / TC; /* tokens of n key rows: the launcher pairs (C, TC) with n */
  extern __shared__ __align__(128) unsigned char smem[];
  const int H = a.H;
  /* head_first (PrepRun, set by the launcher): a 1-D grid, block b = (chunk b / H, head b % H), so the
   * blocks resident together read the same tokens' rows of all heads (whole 4 KB token
   * rows of k, q, v at H = 16, K = 128) and write neighbouring panels; otherwise the 2-D
   * grid (chunk, head), chunk fastest: one head across the whole sequence at a time,
   * 256 bytes of each 4 KB token row */
  const int c = head_first ? (int)(blockIdx.x / (unsigned)H) : (int)blockIdx.x;
  const int h = head_first ? (int)(blockIdx.x - (unsigned)c * (unsigned)H) : (int)blockIdx.y;
  const ChunkInfo ci = a.chunks[c];
  const int nv = ci.ntok * n;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grp = lane >> 2, tig = lane & 3;
  const int64_t CHi = (int64_t)c * H + h;
  const int64_t krow0 = (int64_t)ci.t0 * n;
  const bf16 *gk = (const bf16 *)a.k, *gq = (const bf16 *)a.q, *gv = (const bf16 *)a.v,
             *gg = (const bf16 *)a.g, *gbeta = (const bf16 *)a.beta;
  bf16 *sK = (bf16 *)(smem + L::oK), *sQ = (bf16 *)(smem + L::oQ);
  float *sA = (float *)(smem + L::oA), *sBeta = (float *)(smem + L::oBeta), *sGc = (float *)(smem + L::oGc);
  bf16 *sTw = (bf16 *)(smem + L::oTw), *sTu = (bf16 *)(smem + L::oTu);
  const uint32_t s0 = smem_addr(smem);

  /* rows in by cp.async, 16 bytes a thread, zero-filled past the sequence end: k and q
   * (needed first) in one group, v (needed last) in a second */
  {
    /* a thread keeps one 16-byte column of each panel and steps down the rows: one base
     * pointer plus constant row strides (few instructions per copy) */
    constexpr int KC = K / 8, VC = V / 8, RK = 128 / KC, RV = 128 / VC;
    static_assert(C % RK == 0 && TC % RK == 0 && C % RV == 0, "whole load rounds");
    const int64_t strideK = (int64_t)RK * H * K, strideV = (int64_t)RV * H * V;
    const int ik = tid / KC, ck = (tid % KC) * 8, iv = tid / VC, cv = (tid % VC) * 8;
    const bf16 *pk = gk + ((krow0 + ik) * H + h) * K + ck;
    const bf16 *pq = gq + (((int64_t)ci.t0 + ik) * H + h) * K + ck;
    const bf16 *pv = gv + ((krow0 + iv) * H + h) * V + cv;
#pragma unroll
    for (int r = 0; r < C / RK; r++) {
      const bool ok = ik + r * RK < nv;
      cp_async16(smem + L::oK + ((ik + r * RK) * L::ldK + ck) * 2,
                 ok ? (const void *)(pk + r * strideK) : (const void *)gk, ok);
    }
#pragma unroll
    for (int r = 0; r < TC / RK; r++) {
      const bool ok = ik + r * RK < ci.ntok;
      cp_async16(smem + L::oQ + ((ik + r * RK) * L::ldK + ck) * 2,
                 ok ? (const void *)(pq + r * strideK) : (const void *)gq, ok);
    }
    cp_async_commit();
    if constexpr (!TU_OUT) { /* TU_OUT: no U here, so no v (its group stays, empty) */
#pragma unroll
      for (int r = 0; r < C / RV; r++) {
        const bool ok = iv + r * RV < nv;
        cp_async16(smem + L::oV + ((iv + r * RV) * L::ldV + cv) * 2,
                   ok ? (const void *)(pv + r * strideV) : (const void *)gv, ok);
      }
    }
    cp_async_commit();
  }
  if (tid < C) sBeta[tid] = tid < nv ? __bfloat162float(gbeta[(krow0 + tid) * H + h]) : 0.f;
  if (warp == 0) {
    /* gc of key row i = g summed over the tokens <= i/n, token by token from 0.f: the
     * same additions, in the same order, as variant 2's row-wise sum (whose other terms
     * are exact zeros).  Lane t ends with the sum through token t. */
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
  cp_async_wait<1>(); /* k and q are in; v may still be in flight */
  __syncthreads();
  const float last = sGc[C - 1];

  /* l2 norms, in place (bf16), and the decayed copies Kd, Qd straight to global: LPR
   * lanes per row, 8 elements a lane, RPS rows per warp and step */
  {
    constexpr int LPR = K / 8, RPS = 32 / LPR, STEPS = (C + TC) / (4 * RPS);
    static_assert((C + TC) % (4 * RPS) == 0 && C % (4 * RPS) == 0, "l2 rows");
    bf16 *gKd = a.Kd + CHi * C * K, *gQd = a.Qd + CHi * TC * K;
    const int sub = lane / LPR, c8 = (lane % LPR) * 8;
#pragma unroll
    for (int st = 0; st < STEPS; st++) {
      const int i = (st * 4 + warp) * RPS + sub;
      /* a step's rows are all k rows or all q rows (C is a multiple of 4 RPS): with SPLIT
       * (the kernel that also has the split solve) that is known at compile time, so a
       * step is straight-line code that the scheduler can overlap with its neighbours
       * (as a runtime test it put a branch, and the end of a basic block, in every step:
       * SASS BSSY / BRA); the same rows, the same operations, the same bits */
      const bool isq = SPLIT ? st * 4 * RPS >= C : i >= C;
      const int row = isq ? i - C : i;
      bf16 *src = (isq ? sQ : sK) + row * L::ldK + c8;
      const uint4 raw = *reinterpret_cast<const uint4 *>(src);
      float x[8];
      const float inv = row_l2_inv<LPR>(raw, x, a.l2norm);
      const float f = isq ? a.scale * __expf(sGc[row * n + n - 1]) : __expf(last - sGc[row]);
      uint32_t kn[4], kd[4];
#pragma unroll
      for (int m = 0; m < 4; m++) {
        const float y0 = x[2 * m] * inv, y1 = x[2 * m + 1] * inv;
        kn[m] = pack_bf16(y0, y1);
        kd[m] = pack_bf16(y0 * f, y1 * f);
      }
      *reinterpret_cast<uint4 *>(src) = make_uint4(kn[0], kn[1], kn[2], kn[3]);
      if constexpr (SPLIT) /* one 16-byte store: with isq known, NVVM split the plain one into four */
        stg128((isq ? gQd : gKd) + (int64_t)row * K + c8, kd[0], kd[1], kd[2], kd[3]);
      else
        *reinterpret_cast<uint4 *>((isq ? gQd : gKd) + (int64_t)row * K + c8) =
            make_uint4(kd[0], kd[1], kd[2], kd[3]);
    }
  }
  __syncthreads();

  /* A = strictly-lower(beta_i e^{gc_i-gc_j} kn_i.kn_j) -> shared (float, packed rows);
   * Pm = scale e^{gc_ia-gc_j} qn_a.kn_j (j <= ia) -> global.  Items of 16 rows, only
   * their nonzero column tiles; Pm's skipped tiles are stored as zeros. */
  {
    constexpr int NA = C / 16, NI = NA + TC / 16;
    const int nrow = (lane >> 4) * 8 + (lane & 7), ncol = ((lane >> 3) & 1) * 8;
    bf16 *gPm = a.Pm + CHi * TC * C;
    prep_static_for<NI>([&](auto I) {
      constexpr int item = decltype(I)::value;
      constexpr bool isq = item >= NA;
      constexpr int rb = (isq ? item - NA : item) * 16, NT = 2 * PrepApmCost<C, TC>::of(item);
      constexpr int owner = PrepScheds<C, TC>::apm.owner[item];
      if (warp != owner) return;
      const uint32_t abase = s0 + (isq ? L::oQ : L::oK);
      float acc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll 4 /* not 8: the hoisted fragments would spill at 128 registers */
      for (int kt = 0; kt < K / 16; kt++) {
        uint32_t fa[4];
        load_afrag(abase, L::ldK, rb, kt * 16, fa);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(s0 + L::oK + ((nt * 8 + nrow) * L::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
          mma16816(acc[nt], fa, b0, b1);
          mma16816(acc[nt + 1], fa, b2, b3);
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int i = rb + grp + 8 * hf;
        if constexpr (!isq) {
          const float bi = sBeta[i], gi = sGc[i];
          float *arow = sA + prep_a_row(i);
#pragma unroll
          for (int nt = 0; nt < NT; nt++) {
            const int j = nt * 8 + 2 * tig;
            if (j < i) arow[j] = bi * __expf(gi - sGc[j]) * acc[nt][2 * hf];
            if (j + 1 < i) arow[j + 1] = bi * __expf(gi - sGc[j + 1]) * acc[nt][2 * hf + 1];
          }
        } else {
          const int ia = i * n + n - 1;
          const float gi = sGc[ia];
          bf16 *prow = gPm + (int64_t)i * C;
#pragma unroll
          for (int nt = 0; nt < NT; nt++) {
            const int j = nt * 8 + 2 * tig;
            const float p0 = j <= ia ? a.scale * __expf(gi - sGc[j]) * acc[nt][2 * hf] : 0.f;
            const float p1 = j + 1 <= ia ? a.scale * __expf(gi - sGc[j + 1]) * acc[nt][2 * hf + 1] : 0.f;
            *reinterpret_cast<uint32_t *>(prow + j) = pack_bf16(p0, p1);
          }
#pragma unroll
          for (int nt = NT; nt < C / 8; nt++) /* past every query's last key row */
            *reinterpret_cast<uint32_t *>(prow + nt * 8 + 2 * tig) = 0u;
        }
      }
    });
  }
  __syncthreads();

  /* T = (I + A)^-1: thread x solves column x, (I + A) t = e_x, by forward substitution
   * in registers; A is read by broadcast (every thread the same address).  Warp 0 takes
   * columns 0..31, warp 1 columns 32..C-1, which are zero above row 32 (skipped).  Then
   * the column is scaled by beta_x e^{gc_x} (-> Tw) and by beta_x (-> Tu), rounded to
   * bf16 and stored as row x of Tw^T, Tu^T -- over q and A, hence the barrier between. */
  if constexpr (SPLIT) {
    prep_split_solve<C, STORE_T, L>(sA, (float *)(smem + L::oSolve), sBeta, sGc, sTw, sTu, Tt, CHi, warp, lane);
  } else {
    float t[C];
    const int x = tid;
    if (warp == 0) prep_solve_column<C, 0>(sA, x, t);
    if constexpr (C > 32) {
      if (warp == 1 && x < C) prep_solve_column<C, 32>(sA, x, t);
    }
    __syncthreads();
    if (x < C) {
      const float bx = sBeta[x], bgx = bx * __expf(sGc[x]);
#pragma unroll
      for (int i = 0; i < C; i += 8) {
        uint32_t w4[4], u4[4];
#pragma unroll
        for (int m = 0; m < 4; m++) {
          w4[m] = pack_bf16(t[i + 2 * m] * bgx, t[i + 2 * m + 1] * bgx);
          u4[m] = pack_bf16(t[i + 2 * m] * bx, t[i + 2 * m + 1] * bx);
        }
        *reinterpret_cast<uint4 *>(sTw + x * L::ldT + i) = make_uint4(w4[0], w4[1], w4[2], w4[3]);
        *reinterpret_cast<uint4 *>(sTu + x * L::ldT + i) = make_uint4(u4[0], u4[1], u4[2], u4[3]);
        if constexpr (STORE_T) { /* row x of T^T: 16-byte stores, a thread's row contiguous */
          uint32_t t4[4];
#pragma unroll
          for (int m = 0; m < 4; m++) t4[m] = pack_bf16(t[i + 2 * m], t[i + 2 * m + 1]);
          *reinterpret_cast<uint4 *>(Tt + (CHi * C + x) * C + i) = make_uint4(t4[0], t4[1], t4[2], t4[3]);
        }
      }
    }
  }
  cp_async_wait<0>(); /* v */
  __syncthreads();

  /* W = Tw Kn, U = Tu V: items of 16 rows x 64 columns, k tiles up to the diagonal.  The
   * A fragments come from the transposed panels by ldmatrix.trans: matrix m = lane/8
   * covers k rows kt 16 + 8(m/2).. and T rows rb + 8(m%2).. */
  if constexpr (WU_STAGED) {
    if constexpr (TU_OUT) prep_store_tu<C, L>(a, CHi, s0);
    prep_wu_staged<K, V, C, STORE_ULO, L, TU_OUT>(a, CHi, s0, wu_owners);
  } else {
    constexpr int GK = K / 64, NR = C / 16, NI = (GK + V / 64) * NR;
    const int trow = ((lane >> 3) & 1) * 8 + (lane & 7), tcol = (lane >> 4) * 8;
    const int aoff = ((lane >> 4) * 8 + (lane & 7)) * L::ldT + ((lane >> 3) & 1) * 8;
    prep_static_for<NI>([&](auto I) {
      constexpr int item = decltype(I)::value, g = item / NR, r = item % NR;
      constexpr bool isu = g >= GK;
      constexpr int rb = r * 16, cb = (isu ? g - GK : g) * 64;
      constexpr int owner = PrepWuSched<K, V, C>::wu.owner[item];
      if (warp != owner) return;
      const uint32_t tbase = s0 + (isu ? L::oTu : L::oTw) + (rb + aoff) * 2,
                     bbase = s0 + (isu ? L::oV : L::oK);
      constexpr int ldb = isu ? L::ldV : L::ldK;
      float acc[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll 2 /* fully unrolled, the hoisted fragments would spill at 128 registers */
      for (int kt = 0; kt <= r; kt++) {
        uint32_t fa[4];
        ldsm_x4_t(tbase + kt * 16 * L::ldT * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(bbase + ((kt * 16 + trow) * ldb + cb + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(acc[nt], fa, b0, b1);
          mma16816(acc[nt + 1], fa, b2, b3);
        }
      }
      bf16 *out = isu ? a.U + CHi * C * V : a.W + CHi * C * K;
      /* STORE_ULO: U's rounding residual too (a.Ulo, gdp_chunk.cuh), for the backward's
       * D: U - bf16(U) is exact in float32, its bf16 rounding keeps U to ~16 bits */
      constexpr int ldo = isu ? V : K;
#pragma unroll
      for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
          const int i = rb + grp + 8 * hf, col = cb + nt * 8 + 2 * tig;
          const uint32_t hi = pack_bf16(acc[nt][2 * hf], acc[nt][2 * hf + 1]);
          *reinterpret_cast<uint32_t *>(out + (int64_t)i * ldo + col) = hi;
          if constexpr (STORE_ULO && isu) {
            const float2 h2 = unpack_bf16(hi);
            *reinterpret_cast<uint32_t *>(a.Ulo + CHi * C * V + (int64_t)i * ldo + col) =
                pack_bf16(acc[nt][2 * hf] - h2.x, acc[nt][2 * hf + 1] - h2.y);
          }
        }
    });
  }
  if (tid == 0) a.elast[CHi] = __expf(last);
}

/* ------------------------------------------------------------------ host side */

/* save: the SAVE pass (h^T to hT32, or in bf16 to hT16 where that is given, and D to
 * plan.a.Dbuf, besides o); a dry run only asks the occupancy of the pass it names (the
 * two h^T formats share one layout; the dry run asks the float32 one, as the measured
 * choices always have).  tu (one-warp pass only): the pass that forms U from a.Tu and v
 * (state_kernel_v3's TU). */
template <int K, int C, int TC, int BV>
static gdp_status launch_bv(const Plan &plan, bool dry_run, int *blocks_per_sm, bool save, float *hT32,
                            bf16 *hT16, bool ks2, bool tu) {
  const GdpArgs &a = plan.a;
  if (tu && ks2)
    return GDP_ERROR(GDP_ERR_INTERNAL, "launch_state_v3: U from Tu and v is a one-warp pass (ks2 asked)");
  if constexpr (C % 32 == 0 && TC % 32 == 0) {
    /* two warps per 16 value columns (state_ks2_kernel_v3), plain or saving */
    if (ks2) {
      const int smem = save ? Ks2Layout<K, C, TC, BV, true>::total : Ks2Layout<K, C, TC, BV, false>::total;
      /* the saving pair pass at BV = 64 (K = 128) needs more than an SM's 227 KB: it does
       * not run there (0 blocks; choose_ks2 then keeps the one-warp pass) -- asked without
       * a CUDA call, whose error would linger for the next launch check */
      if (smem > 227 * 1024) {
        if (dry_run) {
          *blocks_per_sm = 0;
          return GDP_OK;
        }
        return GDP_ERROR(GDP_ERR_INTERNAL, "state_ks2_kernel_v3: %d bytes of shared memory (at most %d)", smem,
                         227 * 1024);
      }
      auto kern = !save ? state_ks2_kernel_v3<K, C, TC, BV, false, false>
                  : hT16 ? state_ks2_kernel_v3<K, C, TC, BV, true, true>
                         : state_ks2_kernel_v3<K, C, TC, BV, true, false>;
      GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      if (dry_run) {
        GDP_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, BV / 16 * 64, smem));
        return GDP_OK;
      }
      kern<<<dim3((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV)), dim3(BV / 16 * 64), smem, plan.stream>>>(
          a, hT32, hT16);
      GDP_CUDA_LAUNCHED("state_ks2_kernel_v3");
      return GDP_OK;
    }
  }
  /* the saving pass also stages U's residual (or, tu, Tu^T): a larger stage */
  const int smem = !save ? (tu ? Layout<K, C, TC, BV, false, true>::total : Layout<K, C, TC, BV, false>::total)
                   : tu  ? Layout<K, C, TC, BV, true, true>::total
                         : Layout<K, C, TC, BV, true>::total;
  auto kern = !save ? (tu ? state_kernel_v3<K, C, TC, BV, false, false, true> : state_kernel_v3<K, C, TC, BV, false, false>)
              : tu  ? (hT16 ? state_kernel_v3<K, C, TC, BV, true, true, true> : state_kernel_v3<K, C, TC, BV, true, false, true>)
              : hT16 ? state_kernel_v3<K, C, TC, BV, true, true>
                     : state_kernel_v3<K, C, TC, BV, true, false>;
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (dry_run) {
    GDP_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, BV / 16 * 32, smem));
    return GDP_OK;
  }
  kern<<<dim3((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV)), dim3(BV / 16 * 32), smem, plan.stream>>>(a, hT32,
                                                                                                          hT16);
  GDP_CUDA_LAUNCHED("state_kernel_v3");
  return GDP_OK;
}

template <int K, int C, int TC>
static gdp_status launch_k(const Plan &plan, int bv, bool dry_run, int *occ, bool save, float *hT32,
                           bf16 *hT16, bool ks2, bool tu) {
  switch (bv) {
    case 64: return launch_bv<K, C, TC, 64>(plan, dry_run, occ, save, hT32, hT16, ks2, tu);
    case 32: return launch_bv<K, C, TC, 32>(plan, dry_run, occ, save, hT32, hT16, ks2, tu);
    default: return launch_bv<K, C, TC, 16>(plan, dry_run, occ, save, hT32, hT16, ks2, tu);
  }
}

/* The (K, n) roots: every kernel of this file is instantiated through these two, one pair
 * per K and n; the dispatchers call them by name.  Defined at the end of the namespace:
 * all six pairs here when the file is compiled whole, one per part file when it is
 * compiled in parts (gdp_v3_split.h). */
#define GDP_V3F_DECLARE_ROOTS(K, N)                                                                          \
  gdp_status state_k##K##n##N(const Plan &plan, int bv, bool dry_run, int *occ, bool save, float *hT32,      \
                              bf16 *hT16, bool ks2, bool tu);                                                \
  gdp_status prep_k##K##n##N(const Plan &plan, bf16 *Tt);
GDP_V3F_DECLARE_ROOTS(64, 1)
GDP_V3F_DECLARE_ROOTS(64, 2)
GDP_V3F_DECLARE_ROOTS(64, 3)
GDP_V3F_DECLARE_ROOTS(128, 1)
GDP_V3F_DECLARE_ROOTS(128, 2)
GDP_V3F_DECLARE_ROOTS(128, 3)

static gdp_status launch_state_v3(const Plan &plan, int bv, bool dry_run, int *occ, bool save, float *hT32,
                                  bf16 *hT16 = nullptr, bool ks2 = false, bool tu = false) {
  const GdpArgs &a = plan.a;
  if (a.K == 128) {
    if (a.n == 1) return state_k128n1(plan, bv, dry_run, occ, save, hT32, hT16, ks2, tu);
    if (a.n == 2) return state_k128n2(plan, bv, dry_run, occ, save, hT32, hT16, ks2, tu);
    return state_k128n3(plan, bv, dry_run, occ, save, hT32, hT16, ks2, tu);
  }
  if (a.n == 1) return state_k64n1(plan, bv, dry_run, occ, save, hT32, hT16, ks2, tu);
  if (a.n == 2) return state_k64n2(plan, bv, dry_run, occ, save, hT32, hT16, ks2, tu);
  return state_k64n3(plan, bv, dry_run, occ, save, hT32, hT16, ks2, tu);
}

/* Value-block width: the fewest waves of blocks; on a tie the narrower block (more SMs
 * busy, fewer warps sharing one SM's shared-memory bandwidth).  Every block walks all
 * chunks of its sequence, so a wave costs one sequence's full chain.  By the occupancy of
 * the pass that runs: the saving pass's larger stage fits fewer blocks (at K = V = 128,
 * n = 3 the plain pass's choice, BV = 32, ran the saving pass in two waves).  The
 * problem's value_block (validated by the dispatch) forces a width.  tu: the pass that
 * forms U itself (its stage also holds Tu^T, C x C; the saving one's instead of the
 * residual). */
static int choose_bv(const Plan &plan, bool save, bool tu = false) {
  const GdpArgs &a = plan.a;
  if (plan.value_block) return plan.value_block;
  int best = 16;
  double best_waves = INFINITY;
  for (int bv : {16, 32, 64}) {
    if (a.V % bv) continue;
    /* occupancy depends only on (save, K, n, bv): asked once, then cached (benign race) */
    static int occ_cache[2][2][2][3][3] = {};
    int &occ = occ_cache[save][tu][a.K == 128][a.n - 1][bv == 16 ? 0 : bv == 32 ? 1 : 2];
    if (occ == 0 && launch_state_v3(plan, bv, true, &occ, save, nullptr, nullptr, false, tu) != GDP_OK) occ = -1;
    if (occ < 1) continue;
    const double blocks = (double)a.N * a.H * (a.V / bv);
    const double waves = ceil(blocks / ((double)num_sms() * occ));
    if (waves < best_waves) best_waves = waves, best = bv;
  }
  return best;
}

/* Two warps per 16 value columns (state_ks2_kernel_v3; n = 1, 2 only), plain or saving
 * pass?  Where choose_bv takes one-warp blocks (BV = 16: a few long sequences, e.g.
 * 1 x 32768 at H = 16, 128 blocks on 132 SMs, one warp each), unless the pair kernel's
 * exchange (and, saving, staging) buffers would fit fewer blocks per SM.  (Wherever the
 * pair kernel fits, at other widths too, measured slower.) */
static bool choose_ks2(const Plan &plan, int bv, bool save, bool tu = false) {
  const GdpArgs &a = plan.a;
  if (a.n > 2 || bv != 16) return false;
  /* occupancy depends only on (K, n, save, BV): asked once, then cached (benign race) */
  /* tu: the one-warp pass it is weighed against is the one that forms U itself */
  static int occ_cache[2][2][2][2][3][2] = {};
  int *occ = occ_cache[a.K == 128][a.n - 1][save][tu][bv == 64 ? 2 : bv == 32 ? 1 : 0];
  if (occ[0] == 0 && launch_state_v3(plan, bv, true, &occ[0], save, nullptr, nullptr, false, tu) != GDP_OK)
    occ[0] = -1;
  if (occ[1] == 0 && launch_state_v3(plan, bv, true, &occ[1], save, nullptr, nullptr, true) != GDP_OK) occ[1] = -1;
  return occ[1] >= 1 && occ[1] >= occ[0];
}

/* One prep launch.  Heads-first block order (a 1-D grid, heads fastest: the blocks of one
 * chunk share its k, v rows in L2) and the W/U item owners that balance the warps' work:
 * with U's residual stored, the residual-aware ones (NOTES.md "The prep's block order";
 * neither changes a bit of the output). */
template <int K, int V, int C, int TC, bool STORE_T, bool STORE_ULO, bool TU_OUT = false, bool FIVE = false>
static gdp_status launch_prep_kernel(const Plan &plan, bf16 *Tt) {
  using L = PrepLayout<K, V, C, TC, true, true, TU_OUT>;
  auto kern = prep_kernel_v3<K, V, C, TC, STORE_T, STORE_ULO, true, true, TU_OUT, FIVE>;
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, L::total));
  /* four blocks of up to 54.5 KB per SM need (nearly) all of the unified L1 as shared memory */
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared));
  const uint32_t owners = TU_OUT      ? prep_w_owner_bits<K, C>()
                          : STORE_ULO ? prep_wu_owner_bits_ulo<K, V, C>()
                                      : prep_wu_owner_bits<K, V, C>();
  /* heads first needs the chunk-head count in one grid dimension (< 2^31) */
  const int64_t nblocks = (int64_t)plan.a.nchunks * plan.a.H;
  const bool head_first = nblocks <= 0x7fffffff;
  const dim3 grid = head_first ? dim3((unsigned)nblocks) : dim3((unsigned)plan.a.nchunks, (unsigned)plan.a.H);
  kern<<<grid, 128, L::total, plan.stream>>>(plan.a, Tt, owners, head_first ? 1 : 0);
  GDP_CUDA_LAUNCHED("prep_kernel_v3");
  return GDP_OK;
}

/* The prep for a state pass that forms U itself (plan.a.Tu set): Tu^T instead of U, no v;
 * with T^T where Tt is given (the saving forward, the recompute backward).  At C = 48
 * compiled for five blocks per SM (FIVE): ptxas fits it in 96 registers without spilling
 * there; at C = 32 every prep runs five already, at C = 64 five would spill (~56 bytes). */
template <int K, int V, int C, int TC>
static gdp_status launch_prep_tu(const Plan &plan, bf16 *Tt) {
  if constexpr (C > V) { /* Tu^T ([C][C]) would not fit U's buffer ([C][V]) */
    return GDP_ERROR(GDP_ERR_INTERNAL, "launch_prep_v3: Tu with C %d > V %d", C, V);
  } else {
    if (plan.a.Ulo) return GDP_ERROR(GDP_ERR_INTERNAL, "launch_prep_v3: Tu with U's residual");
    constexpr bool five = C == 48;
    return Tt ? launch_prep_kernel<K, V, C, TC, true, false, true, five>(plan, Tt)
              : launch_prep_kernel<K, V, C, TC, false, false, true, five>(plan, nullptr);
  }
}

template <int K, int V, int C, int TC>
static gdp_status launch_prep_kv(const Plan &plan, bf16 *Tt) {
  if (plan.a.Tu) return launch_prep_tu<K, V, C, TC>(plan, Tt);
  if (!Tt) return launch_prep_kernel<K, V, C, TC, false, false>(plan, nullptr);
  return plan.a.Ulo ? launch_prep_kernel<K, V, C, TC, true, true>(plan, Tt)
                    : launch_prep_kernel<K, V, C, TC, true, false>(plan, Tt);
}

/* n's chunk: C steps, TC tokens (chunk_steps) */
#define GDP_V3F_DEFINE_ROOTS(K, N, C, TC)                                                                    \
  gdp_status state_k##K##n##N(const Plan &plan, int bv, bool dry_run, int *occ, bool save, float *hT32,      \
                              bf16 *hT16, bool ks2, bool tu) {                                               \
    return launch_k<K, C, TC>(plan, bv, dry_run, occ, save, hT32, hT16, ks2, tu);                           \
  }                                                                                                          \
  gdp_status prep_k##K##n##N(const Plan &plan, bf16 *Tt) {                                                  \
    return plan.a.V == 128 ? launch_prep_kv<K, 128, C, TC>(plan, Tt) : launch_prep_kv<K, 64, C, TC>(plan, Tt); \
  }
#define GDP_V3F_DEFINE_PART_ROOTS(K, N, C, TC) GDP_V3F_DEFINE_ROOTS(K, N, C, TC) /* K expanded first */
#if !defined(GDP_V3_SPLIT)
GDP_V3F_DEFINE_ROOTS(64, 1, 32, 32)
GDP_V3F_DEFINE_ROOTS(64, 2, 64, 32)
GDP_V3F_DEFINE_ROOTS(64, 3, 48, 16)
GDP_V3F_DEFINE_ROOTS(128, 1, 32, 32)
GDP_V3F_DEFINE_ROOTS(128, 2, 64, 32)
GDP_V3F_DEFINE_ROOTS(128, 3, 48, 16)
#elif defined(GDP_V3_PART_K) && GDP_V3_PART_N == 1
GDP_V3F_DEFINE_PART_ROOTS(GDP_V3_PART_K, 1, 32, 32)
#elif defined(GDP_V3_PART_K) && GDP_V3_PART_N == 2
GDP_V3F_DEFINE_PART_ROOTS(GDP_V3_PART_K, 2, 64, 32)
#elif defined(GDP_V3_PART_K) && GDP_V3_PART_N == 3
GDP_V3F_DEFINE_PART_ROOTS(GDP_V3_PART_K, 3, 48, 16)
#elif defined(GDP_V3_PART_K)
#error "a forward part needs GDP_V3_PART_N = 1, 2 or 3"
#endif

#ifndef GDP_V3_PART_K /* the file's other external definitions and its entry points: in the
                       * whole file or its main part, not in a K part */
/* Also the backward's recompute and the saving forward, which pass Tt (bf16 [C][C] per
 * (chunk, head)) to get T^T (and U's residual, where plan.a.Ulo is set) stored for the
 * backward's kernels; the plain forward passes NULL and runs the kernel without either
 * store. */
gdp_status launch_prep_v3(const Plan &plan, bf16 *Tt) {
  /* the residual is only written by the BWD instantiation: without it, the state pass
   * that reads a.Ulo would read whatever the buffer held */
  if (plan.a.Ulo && !Tt)
    return GDP_ERROR(GDP_ERR_INTERNAL, "launch_prep_v3: Ulo given without Tt (the residual is stored only "
                                       "with T^T)");
  if (plan.a.nchunks == 0) return GDP_OK;
  const int n = plan.a.n;
  if (plan.a.K == 128) return n == 1 ? prep_k128n1(plan, Tt) : n == 2 ? prep_k128n2(plan, Tt) : prep_k128n3(plan, Tt);
  return n == 1 ? prep_k64n1(plan, Tt) : n == 2 ? prep_k64n2(plan, Tt) : prep_k64n3(plan, Tt);
}

SavedLayout saved_layout(const gdp_gdp_problem *p) {
  SavedLayout L;
  const int64_t TC = chunk_steps(p->n) / p->n;
  int64_t nchunks = 0;
  for (int64_t s = 0; s < p->N; s++) nchunks += (p->cu_seqlens[s + 1] - p->cu_seqlens[s] + TC - 1) / TC;
  const size_t CH = (size_t)nchunks * (size_t)p->H;
  L.plan = align128(plan_bytes(p, PLAN_FORWARD));
  L.o_hT = L.plan;
  L.o_D = L.o_hT + align128(CH * (size_t)(p->V * p->K) * 2);
  L.o_Tt = L.o_D + align128(CH * (size_t)(chunk_steps(p->n) * p->V) * 2);
  L.total = L.o_Tt + align128(CH * (size_t)(chunk_steps(p->n) * chunk_steps(p->n)) * 2);
  return L;
}

bool takes(const gdp_gdp_problem *p) {
  return p && p->dtype == GDP_DTYPE_BF16 && (p->K == 64 || p->K == 128) && (p->V == 64 || p->V == 128) &&
         p->n >= 1 && p->n <= 3;
}

size_t saved_bytes(const gdp_gdp_problem *p) {
  if (!takes(p) || p->N == 0) return 0;
  return saved_layout(p).total;
}

/* The forward; saved non-NULL: the plan lives in the caller's block (saved_layout) and the
 * state pass also stores h^T (bf16) and D there.  The dispatch has validated p and io. */
gdp_status forward(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io, cudaStream_t stream, void *saved) {
  if (p->N == 0) return GDP_OK;
  GdpArgs a = fwd_args(p, io);
  Plan plan;
  prof_begin(stream);
  SavedLayout sl = {0, 0, 0, 0, 0};
  bf16 *hT16 = nullptr, *Tt = nullptr;
  if (saved) {
    sl = saved_layout(p);
    hT16 = (bf16 *)((char *)saved + sl.o_hT);
    Tt = (bf16 *)((char *)saved + sl.o_Tt);
  }
  gdp_status st = plan_make(p, stream, PLAN_FORWARD, a, &plan, saved, true);
  if (st != GDP_OK) {
    prof_end(stream);
    return st;
  }
  if (saved) {
    /* D is kept for the backward, so it gets what the recompute backward's D gets: U's
     * bf16 residual added before D is formed (GdpArgs::Ulo; the largest single rounding
     * in dg, NOTES.md "dg precision").  The residual has D's shape, so the prep writes it
     * into the D region itself and the SAVE state pass overwrites it chunk by chunk: a
     * block reads its columns of chunk c (cp.async, waited for) before it stores D there,
     * and no other block touches those columns.  (Where the pass forms U itself, below,
     * there is no residual: U is never rounded.) */
    plan.a.Dbuf = (bf16 *)((char *)saved + sl.o_D);
    plan.a.Ulo = plan.a.Dbuf;
  }
  /* The state pass is chosen before the prep runs: whether it forms U from Tu and v (tu;
   * the one-warp pass, C <= V) decides what the prep stores.  Tu^T ([C][C] bf16 per
   * (chunk, head)) goes into U's buffer, which the prep then does not write (C <= V: it
   * fits).  Forming U inside D's accumulator saves U's round trip through memory
   * (NOTES.md "U from Tu and v"). */
  const bool tu_wanted = plan.a.C <= plan.a.V;
  const int bv = choose_bv(plan, saved != nullptr, tu_wanted);
  const bool ks2 = choose_ks2(plan, bv, saved != nullptr, tu_wanted);
  const bool tu = tu_wanted && !ks2;
  if (tu) {
    plan.a.Tu = plan.a.U;
    plan.a.Ulo = nullptr;
  }
  prof_mark("fwd plan+upload", stream);
  /* saving: the prep also stores T^T for grad_wy (the recompute backward's prep does) */
  st = launch_prep_v3(plan, Tt);
  prof_mark("fwd prep", stream);
  if (st == GDP_OK) st = launch_state_v3(plan, bv, false, nullptr, saved != nullptr, nullptr, hT16, ks2, tu);
  prof_mark(saved ? "fwd state+output (saving h, D)" : "fwd state+output", stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

#endif /* GDP_V3_PART_K */
}  // namespace v3
}  // namespace gdpcu
