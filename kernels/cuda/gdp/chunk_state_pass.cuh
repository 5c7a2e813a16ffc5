/*
 * chunk_state_pass.cuh -- the fast path's forward state pass (bf16 in, float32 accumulation
 * and float32 state): a prep kernel and a state pass with the state in registers, both
 * on raw mma.sync m16n8k16 bf16 tensor-core instructions with compile-time shapes.
 *
 * The prep and the state pass meet through the global workspace (the per-chunk panels
 * W, U or Tu, Kd, Qd, Pm and e^{last}, plan.cuh).  The state-pass algebra, per chunk c
 * of a sequence, head h:
 *     D = U - W S,   o = Qd S + Pm D   (TC query rows),   S <- e^{last} S + Kd^T D.
 * The prep's method is described above chunk_prep_kernel.
 *
 * Why the state pass is laid out the way it is (docs/kernels.md §3.3):
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
#ifndef GDP_KERNELS_CUDA_GDP_CHUNK_STATE_PASS_CUH
#define GDP_KERNELS_CUDA_GDP_CHUNK_STATE_PASS_CUH

#include "fragments.cuh"

namespace gdpcu {
namespace chunked {

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

/* ------------------------------------------------------------------ the state pass */

/* The two stores of a forward that keeps its states for the backward (SAVE below), in
 * exactly the layouts chunk_state_recompute_kernel writes, so the backward's gradient
 * kernels read them unchanged (the PTX wrappers, panel copies and staging: fragments.cuh):
 *  - h^T bf16 [V][K] per (chunk, head): stage_hT16_half, two halves per chunk;
 *  - D bf16 [C][V] per (chunk, head): stage_dfrags, from the A fragments of D^T. */

/* Grid (sequence, head, value block of BV columns); BV/16 warps, warp w owns value
 * columns col0 + 16w .. +15.  Fragment coordinates (grp = lane/4, tig = lane%4):
 *   St[nt][e]  = S^T[x][r],  x = 16w + grp + 8(e/2),  r = 8nt + 2tig + e%2
 *   Dt[nt][e]  = -D^T[x][j], j = 8nt + 2tig + e%2      (accumulated negated, see D)
 *   Ot[nt][e]  = o^T[x][a],  a = 8nt + 2tig + e%2
 * and the bf16 A fragments Sa[kt], Da[kt] cover k columns 16kt..16kt+15.
 * SAVE (a forward kept for the backward): per chunk also h^T (S at the chunk start, in
 * bf16: the rounding the backward's products apply to it anyway; docs/kernels.md §3.3,
 * bf16 chunk states) to hT16 and D (bf16) to a.Dbuf, the values
 * chunk_state_recompute_kernel would recompute -- the same products in the same order, so
 * the same bits.  TU (the prep ran with TU_OUT; plain or SAVE): U is not read
 * but formed here, U = Tu V from a.Tu and v's rows, on the same bf16 operands the prep's
 * U product takes, inside D's accumulator: D = U - W S in one float32 sum, where the
 * default saving pass starts from U's bf16 rounding plus its residual (~16 bits). */
template <int K, int C, int TC, int BV, bool SAVE = false, bool TU = false>
__global__ void __launch_bounds__(BV / 16 * 32, 1) chunk_state_kernel(GdpArgs a, bf16 *hT16) {
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
    if constexpr (SAVE)
      stage_hT16_half<K, C>(smem + L::oHt, hT16 + ((int64_t)c * H + h) * V * K + (int64_t)xw * K, St, 0);

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
     * in the recompute backward's D (chunk_state_recompute_kernel), which this D replaces. */
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
      stage_hT16_half<K, C>(smem + L::oHt, hT16 + ((int64_t)c * H + h) * V * K + (int64_t)(xw + 8) * K, St, 1);
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

/* A warp's staging buffer in the saving pair pass (SAVE below): as HtStage (fragments.cuh)
 * but for the warp's K half of h^T (8 rows of K/2 floats or bf16, padded alike: the
 * fragment stores hit 2 wavefronts (float32) / 32 distinct banks (bf16)) and its C half of
 * D (C/2 rows of 16 bf16, 48 bytes apart). */
template <int K, int C>
struct Ks2Stage {
  static constexpr int row = K / 2 * 4 + 32, row16 = K / 2 * 2 + 16, drow = 48;
  static constexpr int warp_bytes = 8 * row > C / 2 * drow ? 8 * row : C / 2 * drow;
  static_assert(8 * row16 <= warp_bytes, "bf16 staging fits");
};

/* stage_hT16_half (fragments.cuh) for a warp that holds the K half w of S^T: X[nt][e] =
 * S^T[x][w K/2 + 8nt + 2tig + e%2], x = xw + grp + 8(e/2); half hf = rows xw + 8hf + grp.
 * `grow` = global h^T row xw + 8hf, column w K/2 (rows K apart).  Rows of K/2 elements,
 * read back as 16-byte pieces, lane l taking piece l % P of row l / P (P = pieces per
 * row), so each STG.128 writes whole lines (K/2 bf16 = 128 or 64 bytes per row, the
 * 64-byte rows in pairs of sectors).  `buf` = this warp's Ks2Stage buffer.  Syncs as in
 * stage_hT16_half. */
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
 * would go to local memory).  Syncs as in stage_hT16_half. */
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

/* Layout of chunk_state_pair_kernel: the plain pass's stages, then per warp pair the two
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

/* The plain state pass (chunk_state_kernel<.., SAVE = false>) with two warps on each 16
 * value columns (chosen by choose_ks2 where the pass runs one-warp blocks,
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
 * as in chunk_state_kernel (D: -U^T, then kt = 0..K/16-1; o: Qd kt = 0.., then Pm; S: decay,
 * then kt = 0..C/16-1), so o and ht are bit-identical to it; the mma per warp and chunk
 * halve (176 -> 88 at K = 128, C = 64), as do the panel copies per thread.
 * Ordering: the Sa tiles of chunk it are written before the loop-top __syncthreads of
 * iteration it (the initial state's before the loop) and read after it; the Da tiles are
 * written after it and read after the pair's named barrier (1 + g).  A warp rewrites its
 * Sa tiles after that pair barrier, which its partner reaches only after its Sa reads;
 * and its Da tiles after the next loop-top barrier, which its partner reaches only after
 * its Da reads.  So one buffer each suffices.  Needs C % 32 == 0 and TC % 32 == 0 (n = 1,
 * 2): each warp then owns whole 16-column A tiles of D and pairs of 8-column o tiles.
 * SAVE: the saving pass (chunk_state_kernel<.., SAVE>) split alike: U = hi + lo in D,
 * each warp stores its K half of h^T (ks2_stage_hT16, at the same two points of the
 * chunk as there) and its C half of D (ks2_stage_dhalf, after its Sa publish) through its
 * own Ks2Stage buffer: the same bits at the same addresses as the one-warp saving pass. */
template <int K, int C, int TC, int BV, bool SAVE = false>
__global__ void __launch_bounds__(BV / 16 * 64, 1) chunk_state_pair_kernel(GdpArgs a, bf16 *hT16) {
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
     * products (St is unchanged until the decay), as in chunk_state_kernel */
    unsigned char *const hbuf = smem + L::oHt + warp * Ks2Stage<K, C>::warp_bytes;
    const int64_t hrow = ((int64_t)c * H + h) * V * K + (int64_t)xw * K + w * (K / 2);
    if constexpr (SAVE) ks2_stage_hT16<K, C>(hbuf, hT16 + hrow, St, 0);

    uint32_t Sa[K / 16][4];
#pragma unroll
    for (int kt = 0; kt < K / 16; kt++) {
      const uint4 v = xS[kt * 32];
      Sa[kt][0] = v.x, Sa[kt][1] = v.y, Sa[kt][2] = v.z, Sa[kt][3] = v.w;
    }

    /* -D^T for this warp's C half: j-tiles w C/16 + i */
    float Dt[SC][4];
    /* SAVE: U = hi + lo, as in chunk_state_kernel's saving pass */
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
    if constexpr (SAVE) ks2_stage_hT16<K, C>(hbuf, hT16 + hrow + 8 * K, St, 1);
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

}  // namespace chunked
}  // namespace gdpcu

#endif
