/*
 * chunk_grad_wy.cuh -- the per-chunk gradients' WY part: through T = (I + A)^-1 (T from the
 * prep), dk, dv, dbeta, dg final.
 */
#ifndef GDP_KERNELS_CUDA_GDP_CHUNK_GRAD_WY_CUH
#define GDP_KERNELS_CUDA_GDP_CHUNK_GRAD_WY_CUH

#include "chunk_backward.cuh"

namespace gdpcu {
namespace chunked_backward {

/* ------------------------------------------------------------------ per-chunk gradients, WY part */

template <int K, int V, int C>
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
   * that held ~10% of the kernel's warp stall samples (ncu), and their order
   * varied from run to run. */
  static constexpr int nS = (panel_groups(V) + 2 * panel_groups(K)) * C + 2 * NL * 16;
  /* szD: the dD region, which X, dT and G later take (C x C): C x V, or C x C where
   * C > V (V = 32 at C = 48, 64) */
  static constexpr int szKn = C * ldK * 2, szV = C * ldV * 2, szC = C * ldC * 2, nF = 5 * C;
  static constexpr int szD = szV > szC ? szV : szC;
  static constexpr bool kLateDW = 2 * szKn + szV + szD + 2 * szC + (nF + nS) * 4 > 76800;
  static constexpr int szP = kLateDW ? NL * 1024 : 0;
  static constexpr int oKn = 0;                                        /* kn [C][K] */
  static constexpr int oV = oKn + szKn;                                /* v [C][V] as given; late: then dW */
  static constexpr int odD = oV + (kLateDW && szKn > szV ? szKn : szV); /* dD [C][V] */
  static constexpr int odW = kLateDW ? oV : odD + szD;                 /* dW [C][K] (state part) */
  static constexpr int oT = kLateDW ? odD + szD : odW + szKn;          /* T^T (bf16, from the prep) */
  static constexpr int oR2 = oT + szC;                                 /* dT or P (see above) */
  static constexpr int oF = oR2 + (szP > szC ? szP : szC);
  static constexpr int odT = kLateDW ? odD : oR2; /* dT diag-scaled (bf16) */
  static constexpr int oP = oR2;                  /* late: W3a's dD V^T sums (float, fragment order) */
  static constexpr int oX = kLateDW ? oR2 : odD;  /* X = dT T^T (bf16) */
  static constexpr int oG = kLateDW ? odD : oR2;  /* G = dA o beta_i Gamma (bf16) */
  static_assert(!kLateDW || C <= V, "late dW: dT and G fit in the dD region");
  static constexpr int fGp = 0, fGc = C, fBeta = 2 * C, fDgc = 3 * C, fKinv = 4 * C;
  static constexpr int oS = oF + nF * 4; /* the partial-sum slots (WySlots) */
  static constexpr int total = oS + nS * 4;
  /* W6's dKnA slices (bf16, 16 rows x 64 columns = 2 KB a warp; K >= 64), copied in by cp.async at
   * W6's start so that their L2 latency passes under W6's products, into two regions dead
   * by then (see the tenants above): late dW, R2 (X's, W4-W5) and dD's tail past G (dT and
   * G use C x ldC of it); early dW, dD (X's, W4-W5; G is in R2) and v (read last in W3).
   * Where they do not fit, dKnA is read from global memory at W6's end.
   * Row r of a slice at 128 r bytes, its 16-byte chunk c at c ^ (r & 7): a warp's
   * accumulator-fragment reads (rows grp, columns 8 nt + 2 tig) are then free of bank
   * conflicts. */
  static constexpr int kNI = (C / 16) * panel_groups(K), kSlice = 16 * 64 * 2;
  static constexpr int kFreeA = kLateDW ? oR2 : odD, kSizeA = kLateDW ? (szP > szC ? szP : szC) : szD;
  static constexpr int kFreeB = kLateDW ? odD + szC : oV, kSizeB = kLateDW ? szV - szC : szV;
  static constexpr int kSlicesA = kSizeA / kSlice, kSlicesB = kSizeB / kSlice;
  /* the slices' swizzle is over 8 16-byte chunks a row: 64 columns (at K = 32 dKnA is read
   * from global memory) */
  static constexpr bool kDknaSmem = K >= 64 && kNI <= kSlicesA + kSlicesB;
  __device__ static __forceinline__ int dkna_slice(int warp) {
    return warp < kSlicesA ? kFreeA + warp * kSlice : kFreeB + (warp - kSlicesA) * kSlice;
  }
  /* Byte offset of element (r, c) in the kn and dW panels (K columns) and in the dD panel
   * (V columns): padded rows. */
  __device__ static __forceinline__ uint32_t kpos(int r, int c) { return (uint32_t)((r * ldK + c) * 2); }
  __device__ static __forceinline__ uint32_t dpos(int r, int c) { return (uint32_t)((r * ldV + c) * 2); }
};

/* The 16-row item of panel_cols(COLS) columns (64, or 32 at a width of 32) a warp owns in
 * grad_wy's dVb (W3) and dKn (W6) products: rows by warp / panel_groups(COLS). */
template <int COLS>
__device__ __forceinline__ void wy_item(int warp, int &rowb, int &colb) {
  rowb = warp / panel_groups(COLS) * 16;
  colb = warp % panel_groups(COLS) * panel_cols(COLS);
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
 * and two epilogues; W4 the tiles of column 0 (one step each) to warps 6, 7.  (ncu: the
 * barrier after W5 held ~8% of grad_wy's warp stall samples.) */
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
 *   dvb[b][j]  W3:  v_j . dVb_j over the value columns of panel b (panel_cols)
 *   row[t][r]  W5:  sum_m dA_im e^{gc_i - gc_m} kk_im of tile t = (ti, tj), row i = 16 ti + r
 *   col[t][r]  W5:  -sum_i dA_im A_im of tile t, column m = 16 tj + r
 *   dkb[b][j]  W6:  e^{gc_j} kn_j . dKb_j over the key columns of panel b
 *   dot[b][j]  W6:  kn_j . dKn_j over the same columns
 * dbeta_j = dvb + row + dkb terms;  dgc_j = dgcA_j + beta_j (row + dkb terms) + col terms
 * (W5's row term of dgc, sum_m dA_im A_im, is beta_i times its row term of dbeta, as
 * A_im = beta_i e kk_im; W6's is beta_j s).  Offsets in floats. */
template <int K, int V, int C>
struct WySlots {
  static constexpr int NB = C / 16, NL = NB * (NB + 1) / 2, GK = panel_groups(K), GV = panel_groups(V);
  static constexpr int dvb = 0, row = dvb + GV * C, col = row + NL * 16, dkb = col + NL * 16, dot = dkb + GK * C;
  static constexpr int count = dot + GK * C;
  __device__ static __forceinline__ float dot_sum(const float *S, int j) { return slot_sum<GK>(S + dot + j, C); }
  /* row j's W5 and W6 terms of dbeta (the ones dgc takes times beta_j) */
  __device__ static __forceinline__ float wb_sum(const float *S, int j) {
    const int ti = j >> 4, r = j & 15;
    float x = 0.f;
#pragma unroll
    for (int tj = 0; tj < NB; tj++)
      if (tj <= ti) x += S[row + (ti * (ti + 1) / 2 + tj) * 16 + r];
#pragma unroll
    for (int b = 0; b < GK; b++) x += S[dkb + b * C + j];
    return x;
  }
  __device__ static __forceinline__ float dvb_sum(const float *S, int j) { return slot_sum<GV>(S + dvb + j, C); }
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
 * computed from a fresh read of %tid.x: each phase of chunk_grad_wy_kernel takes its own copy,
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

/* Blocks per SM that chunk_grad_wy_kernel is compiled for, where ptxas (nvcc 13.0) fits it
 * with 0 bytes spilled: three (80 registers) at C = 32 and 48 except K = 128, V = 64 and
 * K = 32, V = 128, C = 48, and at C = 64 with K = V = 128 (since wy2: no KK region, late
 * dW); two (128 registers) elsewhere (at 80 those spill 4-8 bytes: C = 48 K = 128 V = 64,
 * C = 48 K = 32 V = 128, and C = 64 but for K = V = 128; at C = 64 the width-32 shapes
 * take 80-108 registers unasked, so K = V = 32 runs three blocks there all the same).
 * Shared memory (GradWYLayout, 1 KB reserved per block included) is <= 76800 + 1024
 * bytes a block in every shape, so three fit in 228 KB. */
constexpr int grad_wy_blocks(int K, int V, int C) {
  return C == 64 ? (K == 128 && V == 128 ? 3 : 2) : ((K == 128 && V == 64) || (K == 32 && V == 128 && C == 48) ? 2 : 3);
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
 * chunk_grad_state_kernel (its dKnA, dWg, dgcA) and the recompute's prep (T^T, bf16, the
 * only precision this kernel uses T in: every product with T is on bf16 mma operands,
 * and the epilogues use A, recomputed in float32 from kn kn^T), on mma.sync:
 *   A = strictly-lower(beta_i e^{gc_i-gc_j} kn_i.kn_j),  T = (I + A)^-1 (the prep's)
 *   dVb = T^T dD:  dv = beta dVb,  dbeta += v . dVb
 *   dKb = T^T dW:  dKn += beta e^{gc} dKb,  s = e^{gc} kn . dKb: dbeta += s, dgc += beta s
 *   dT = (dD V^T + dW kn^T diag(e^{gc})) diag(beta),  X = dT T^T,  dA = -T^T X (strictly lower)
 *   G = dA o beta_i e^{gc_i-gc_j}: dKn += G kn + G^T kn; dbeta_i += sum_j dA e kk;
 *   dgc_i += sum_j dA A_ij, dgc_j -= sum_i dA A_ij
 *   dk = l2-norm backward of dKnA + dKn;  dg = reverse cumsum of dgcA + dgc (step 0 rows).
 * Warp w < (C/16) panel_groups(K) owns the dKn item (16 steps x panel_cols(K) key columns) in registers from
 * dKb to the dk store.  Blocks per SM: grad_wy_blocks.
 * Scheduling (docs/kernels.md §3.5): with kLateDW, W5's kn kn^T tiles are computed while
 * dW comes in from L2 (they only read kn) instead of in W5, and dW is prefetched into L2
 * again nearer its copy; dg's reverse cumsum is stored by the 32 lanes of warp 7. */
template <int K, int V, int C, int TC>
__global__ void __launch_bounds__(256, grad_wy_blocks(K, V, C)) chunk_grad_wy_kernel(GdpArgs a, GradStateOut go) {
  using L = GradWYLayout<K, V, C>;
  constexpr bool kPreKK = L::kLateDW; /* W5's kk computed in the dW wait */
  constexpr int NN = C / TC, NB = C / 16, NI = (C / 16) * panel_groups(K), NL = NB * (NB + 1) / 2,
                NVB = NB * panel_groups(V);
  /* item widths (panel_cols): 64 columns, or 32 at a width of 32 */
  constexpr int PK = panel_cols(K), PV = panel_cols(V), NTK = PK / 8, NTV = PV / 8;
  static_assert(K % PK == 0 && V % PV == 0 && K % 32 == 0 && V % 32 == 0 && C % 16 == 0 && C <= 64 && NI <= 8 &&
                    NL <= 10,
                "shapes");
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

  /* ---- loads, by cp.async in two groups: the raw k rows (normalised in place below),
   * then v, dD, dW and T^T (first read in W3, so their latency overlaps the norms).
   * dKnA (read at the end) is pulled into L2 now so that that read does not wait on
   * DRAM; so is dW where it arrives late (kLateDW: copied in after W3a). */
  copy_panel<C, K, 256>(smem + L::oKn, L::ldK, gk + (krow0 * H + h) * K, (int64_t)H * K, nv);
  cp_async_commit();
  copy_panel<C, V, 256>(smem + L::oV, L::ldV, gv + (krow0 * H + h) * V, (int64_t)H * V, nv);
  copy_panel<C, V, 256>(smem + L::odD, L::ldV, a.dDbuf + CHi * C * V, V, C);
  if constexpr (!L::kLateDW) copy_panel<C, K, 256>(smem + L::odW, L::ldK, go.dWg + CHi * C * K, K, C);
  copy_panel<C, C, 256>(smem + L::oT, L::ldC, go.Tt + CHi * C * C, C, C);
  cp_async_commit();
  if (tid < C) {
    const bool ok = tid < nv;
    sGp[tid] = (gg && ok && tid % n == 0) ? load_gate<bf16>(a.g, a.g_f32, ((int64_t)ci.t0 + tid / n) * H + h) : 0.f;
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
  { /* kn in place, the forward prep's l2 norm (row_l2_inv, shared with chunk_state_pass.cuh): LPR =
     * K / 8 lanes per row, 8 elements (one 16-byte chunk)
     * a lane, RPS rows per warp and step -- the same sums in the same order, so kn and kinv
     * are the prep's bit for bit (a warp per row, 2-byte accesses and five-shuffle sums,
     * held ~16% of the kernel's warp stall samples with the gate's cumsum, ncu).  Rows
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
  __syncthreads();


  cp_async_wait<0>(); /* v, dD, dW, T^T */
  __syncthreads();
  if constexpr (L::kLateDW) /* again, nearer its copy (W3a's end): the first may have left L2 */
    if (tid == 32) prefetch_l2_bulk(go.dWg + CHi * C * K, C * K * 2);

  /* ---- W3: dVb (dv out) and the dT tiles (dT item t to warp 7 - t % 8: the dVb items
   * of the high warps are the short ones, vjb near C).  dKb = T^T dW is computed in W6,
   * where its accumulators are needed (T^T and dW stay untouched until then): held from
   * here to W6 they made C = 48 spill at 128 registers. */
  for (int item = warp; item < NVB; item += 8) { /* dVb = T^T dD */
    const LaneMaps m = lane_maps();
    int vjb, xb;
    wy_item<V>(item, vjb, xb);
    float acc[NTV][4] = {};
    {
#pragma unroll
      for (int kt = 0; kt < NB; kt++) {
        if (kt * 16 + 15 < vjb) continue;
        uint32_t fa[4];
        ldsm_x4(s0 + L::oT + ((vjb + m.arow) * L::ldC + kt * 16 + m.acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
        for (int nt = 0; nt < NTV; nt += 2) {
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
      for (int nt = 0; nt < NTV; nt++) {
        const float2 vv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
            smem + L::oV + (j * L::ldV + xb + nt * 8 + 2 * m.tig) * 2));
        s += vv.x * acc[nt][2 * hf] + vv.y * acc[nt][2 * hf + 1];
        if (j < nv) *reinterpret_cast<uint32_t *>(row + nt * 8) = pack_bf16(bj * acc[nt][2 * hf], bj * acc[nt][2 * hf + 1]);
      }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (m.tig == 0) S[WS::dvb + (xb / PV) * C + j] = s;
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
      copy_panel<C, K, 256>(smem + L::odW, L::ldK, go.dWg + CHl * C * K, K, C);
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
  float dkn[NTK][4] = {};
  {
    const int warp = fresh_sreg<0>() >> 5;
    const LaneMaps m = lane_maps();
    int jb, rb;
    wy_item<K>(warp, jb, rb);
    const int64_t CHi = (int64_t)fresh_sreg<1>() * H + fresh_sreg<2>();
    /* ---- W6: own item: dKn = beta e^{gc} (T^T dW) + G kn + G^T kn + dKnA; l2-norm
     * backward; dk out */
    if (warp < NI) {
      if constexpr (L::kDknaSmem) { /* this warp's dKnA slice into shared memory, read after the products */
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
      {
#pragma unroll
        for (int kt = 0; kt < NB; kt++) { /* dKb = T^T dW */
          if (kt * 16 + 15 < jb) continue; /* T^T[j][i] = 0 for i < j */
          uint32_t fa[4];
          ldsm_x4(s0 + L::oT + ((jb + m.arow) * L::ldC + kt * 16 + m.acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
          for (int nt = 0; nt < NTK; nt += 2) {
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
        for (int nt = 0; nt < NTK; nt++) {
          const float2 kv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
              smem + L::oKn + L::kpos(j, rb + nt * 8 + 2 * m.tig)));
          s += kv.x * dkn[nt][2 * hf] + kv.y * dkn[nt][2 * hf + 1];
          dkn[nt][2 * hf] *= bj * eg;
          dkn[nt][2 * hf + 1] *= bj * eg;
        }
        s *= eg;
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (m.tig == 0) S[WS::dkb + (rb / PK) * C + j] = s;
      }
      {
#pragma unroll
        for (int kt = 0; kt < NB; kt++) {
          if (kt * 16 > jb + 15) continue; /* G[j][m] = 0 for m >= j */
          uint32_t fa[4];
          ldsm_x4(s0 + L::oG + ((jb + m.arow) * L::ldC + kt * 16 + m.acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
          for (int nt = 0; nt < NTK; nt += 2) {
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
          for (int nt = 0; nt < NTK; nt += 2) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(s0 + L::oKn + L::kpos(kt * 16 + m.arow, rb + nt * 8 + m.acol), b0, b1, b2, b3);
            mma16816(dkn[nt], fa, b0, b1);
            mma16816(dkn[nt + 1], fa, b2, b3);
          }
        }
      }
      const int64_t o = CHi * C * K + (int64_t)(jb + m.grp) * K + rb + 2 * m.tig;
      if (L::kDknaSmem) {
        cp_async_wait<0>();
        __syncwarp(); /* the other lanes' copies */
        const unsigned char *sl = smem + L::dkna_slice(warp) + m.grp * 128 + 4 * m.tig; /* rows grp, grp + 8: same swizzle */
#pragma unroll
        for (int nt = 0; nt < NTK; nt++) {
          const int c = (nt ^ m.grp) << 4;
          const float2 u0 = unpack_bf16(*reinterpret_cast<const uint32_t *>(sl + c)),
                       u1 = unpack_bf16(*reinterpret_cast<const uint32_t *>(sl + 8 * 128 + c));
          dkn[nt][0] += u0.x, dkn[nt][1] += u0.y, dkn[nt][2] += u1.x, dkn[nt][3] += u1.y;
        }
      } else {
        const bf16 *pa = reinterpret_cast<const bf16 *>(go.dKnA) + o;
#pragma unroll
        for (int nt = 0; nt < NTK; nt++) {
          const float2 u0 = unpack_bf16(*reinterpret_cast<const uint32_t *>(pa + nt * 8)),
                       u1 = unpack_bf16(*reinterpret_cast<const uint32_t *>(pa + 8 * K + nt * 8));
          dkn[nt][0] += u0.x, dkn[nt][1] += u0.y, dkn[nt][2] += u1.x, dkn[nt][3] += u1.y;
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int j = jb + m.grp + 8 * hf;
        float d = 0.f;
#pragma unroll
        for (int nt = 0; nt < NTK; nt++) {
          const float2 kv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
              smem + L::oKn + L::kpos(j, rb + nt * 8 + 2 * m.tig)));
          d += kv.x * dkn[nt][2 * hf] + kv.y * dkn[nt][2 * hf + 1];
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        if (m.tig == 0) S[WS::dot + (rb / PK) * C + j] = d;
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
      wy_item<K>(warp, jb, rb);
      bf16 *dk = (bf16 *)a.dk;
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int j = jb + m.grp + 8 * hf;
        const unsigned live = __ballot_sync(0xffffffffu, j < nv); /* the lanes that store (and shuffle) */
        if (j >= nv) continue;
        const float inv = sKinv[j], dot = WS::dot_sum(S, j);
        bf16 *row = dk + ((krow0 + j) * H + h) * K + rb;
#pragma unroll
        for (int nt = 0; nt < NTK; nt += 2) {
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
    if (a.g && warp == 7) { /* reverse cumsum of the step gradients (a token's dg is its step
                             * 0's): lane 0 reads all C values first (vector loads), runs the
                             * sequential sum and leaves the running values in sDgc; the 32
                             * lanes store */
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
      if (t * n < C && t * n < nv) store_gate_grad<bf16>(a.dg, a.g_f32, ((int64_t)ci.t0 + t) * H + h, sDgc[t * n]);
    }
  }
}

}  // namespace chunked_backward
}  // namespace gdpcu

#endif
