/*
 * chunk_prep.cuh -- the fast path's prep: per (chunk, head), the l2 norms, in-chunk decays,
 * A = K K^T, T = (I + A)^-1, and the panels W, U (or Tu), Kd, Qd, Pm, e^{last} the state
 * passes read (plan.cuh gives the algebra; the method is described above chunk_prep_kernel).
 */
#ifndef GDP_KERNELS_CUDA_GDP_CHUNK_PREP_CUH
#define GDP_KERNELS_CUDA_GDP_CHUNK_PREP_CUH

#include "chunk_state_pass.cuh"

namespace gdpcu {
namespace chunked {

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
template <int K, int V, int C, int TC, bool NOV = false>
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
  /* the split solve's buffer over q (dead by then) where q's rows hold it (K = 128
   * with TC = 32: 7.5 KB in q's 8.5 at C = 64, no growth); at C = 48 after A and Tw^T /
   * Tu^T (+5.6 KB, still four blocks per SM), so that warp 0 reads its rows back after
   * the last barrier, not across the other write-outs (8-16 bytes spilled otherwise);
   * else (K = 64, C = 64) after A (+2.3 KB; there the late read-back spilled instead) */
  static constexpr int endAT = endA > endT ? endA : endT;
  static constexpr int oSolve = TC * ldK * 2 >= PrepSplit<C>::bytes ? oQ
                                : C == 48                         ? (endAT + 15) / 16 * 16
                                                                  : (endA + 15) / 16 * 16;
  static constexpr int endS = oSolve + PrepSplit<C>::bytes;
  static constexpr int end = endAT > endS ? endAT : endS;
  /* prep_wu_staged: one 8 x 32 bf16 staging tile (512 bytes) per warp after
   * everything else: 52.5 -> 54.5 KB at K = V = 128, C = 64, still four blocks per SM.
   * Where that would not fit four blocks on an SM (228 KB, 1 KB reserved a block: only
   * K = V = 128, C = 64, TC = 16, 56.5 KB), the tiles go right after the panels instead,
   * over the solve's buffer and A: both are dead by the W/U phase (their last reads are
   * inside the solve, two barriers before it), and everything that phase reads (k, v,
   * beta, gc, Tw^T, Tu^T) lies below endAT (55808 bytes there: four blocks). */
  static constexpr int oStageAfter = (end + 127) / 128 * 128;
  static constexpr bool kStageOver = 4 * (oStageAfter + 4 * 512 + 1024) > 228 * 1024;
  static constexpr int oStage = kStageOver ? (endAT + 127) / 128 * 128 : oStageAfter;
  static_assert(oStage >= endAT, "the staging tiles clear of every region the W/U phase reads");
  static constexpr int total = oStage + 4 * 512 > end ? oStage + 4 * 512 : end;
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
/* W = Tw Kn, U = Tu V: item g NR + r is row block r of column panel g (panel_cols: 64
 * columns, 32 at a width of 32; W's panels first); T is lower triangular, so it needs
 * only the k tiles kt <= r. */
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
  static constexpr PrepSched<(panel_groups(K) + panel_groups(V)) * (C / 16), PrepWuCost<C>> wu{};
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
  static constexpr PrepSched<(panel_groups(K) + panel_groups(V)) * (C / 16), PrepWuCostUlo<C, panel_groups(K)>> wu{};
};

/* The owners of PrepWuSched's items as a 2-bit-per-item mask (at most 16 items), so that
 * the staged W/U phase can walk its items in a runtime loop: its code then exists once
 * per item kind instead of once per item. */
template <int K, int V, int C, bool ULO_COST = false>
__host__ __device__ constexpr uint32_t prep_wu_owner_bits() {
  uint32_t bits = 0;
  for (int i = 0; i < (panel_groups(K) + panel_groups(V)) * (C / 16); i++)
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
  constexpr int NI = (panel_groups(K) + panel_groups(V)) * (C / 16);
  int load_old[4] = {0, 0, 0, 0}, load_new[4] = {0, 0, 0, 0};
  for (int i = 0; i < NI; i++) {
    load_old[PrepWuSched<K, V, C>::wu.owner[i]] += PrepWuCostUlo<C, panel_groups(K)>::of(i);
    load_new[PrepWuSchedUlo<K, V, C>::wu.owner[i]] += PrepWuCostUlo<C, panel_groups(K)>::of(i);
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
 * bits as a one-thread-per-column solve, with 4 more barriers.  sBuf: the layout's
 * oSolve (over q, or after A); Tw^T / Tu^T go over q and A after the last barrier. */
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

/* The W/U phase of chunk_prep_kernel: W = Tw Kn, U = Tu V (and U's residual with STORE_ULO)
 * by items of 16 rows x 64 columns (32 at a width of 32), each warp taking the items PrepWuSched gives it, but
 *  - in a runtime loop over the items (one copy of the code per item kind, W or U,
 *    instead of one per item: the unrolled phase is 19 KB of the kernel's 139.5 KB at
 *    K = V = 128, C = 64, and 36 KB with the residual, which took the kernel past what
 *    the instruction cache holds -- docs/kernels.md §3.2);
 *  - U's items first, so that their stores (twice as many with the residual) drain
 *    behind the W items' products rather than at the block's exit;
 *  - every output through prep_stage_store: 16-byte stores of 64 contiguous bytes per
 *    row instead of 4-byte stores of 16. */
template <int K, int V, int C, bool STORE_ULO, class L, bool TU_OUT = false>
__device__ __forceinline__ void prep_wu_staged(const GdpArgs &a, int64_t CHi, uint32_t s0, uint32_t owners) {
  constexpr int GK = panel_groups(K), NR = C / 16, NI = (GK + panel_groups(V)) * NR;
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
    /* PW columns: 64, or 32 where the width is 32 (panel_cols) */
    constexpr int ldb = isu ? L::ldV : L::ldK, ldo = isu ? V : K, PW = panel_cols(ldo), NT = PW / 8;
    const int r = it % NR, rb = r * 16, cb = (it / NR - (isu ? GK : 0)) * PW;
    const uint32_t tbase = s0 + (isu ? L::oTu : L::oTw) + (rb + aoff) * 2,
                   bbase = s0 + (isu ? L::oV : L::oK) + (trow * ldb + cb + tcol) * 2;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll 2
    for (int kt = 0; kt <= r; kt++) {
      uint32_t fa[4];
      ldsm_x4_t(tbase + kt * 16 * L::ldT * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
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
      for (int q = 0; q < PW / 32; q++) {
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
  static constexpr PrepSched<panel_groups(K) * (C / 16), PrepWuCost<C>> w{};
};
template <int K, int C>
__host__ __device__ constexpr uint32_t prep_w_owner_bits() {
  uint32_t bits = 0;
  for (int i = 0; i < panel_groups(K) * (C / 16); i++) bits |= (uint32_t)PrepWSched<K, C>::w.owner[i] << (2 * i);
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

/* One block (4 warps) per (chunk, head): W, U, Kd, Qd, Pm (bf16) and e^{last}, by this
 * method:
 *  - products on mma.sync with the accumulators' epilogues applied in registers; tiles
 *    that are zero by the causal structure (A above the diagonal, Pm past each query's
 *    last key row, T above the diagonal) are skipped, with a compile-time schedule
 *    balancing the remaining tiles over the warps;
 *  - T = (I + A)^-1 by forward substitution in float32, split over the four warps
 *    (prep_split_solve); A is stored packed (strictly lower part only) so that the block
 *    fits 4 per SM;
 *  - beta and e^{gc} are folded into T's columns before its bf16 rounding
 *    (W = (T diag(beta e^gc)) Kn, U = (T diag(beta)) V), so v enters the product exactly
 *    as given instead of through a rounded beta v;
 *  - the l2 norms run K/8 lanes per row, 16 bytes a lane, every row of the chunk
 *    unrolled (the rows' shuffle chains overlap), each step's row kind (k or q) known at
 *    compile time;
 *  - v arrives in its own cp.async group, waited for only before U's product;
 *  - the W/U phase is prep_wu_staged (a runtime item loop, 16-byte stores through shared
 *    memory): the same bits in less code (at K = V = 128, n = 2 with T^T and the residual
 *    stored: 158 -> 128 KB of code, the plain kernel 139.5), which keeps the kernel inside
 *    the instruction cache (docs/kernels.md §3.2).
 * At C = 32 the kernel is compiled for five blocks per SM (96 registers; shared memory
 * holds five there; it took 102-106 registers unasked).
 * For the panels a backward will read (the recompute backward's prep and a forward
 * saving for backward): STORE_T: T itself, unscaled, rounded to bf16, also goes to
 * global as T^T (row x = column x of T, [C][C] per (chunk, head) at Tt), for
 * chunk_grad_wy_kernel, which would otherwise solve for it again; STORE_ULO: U's bf16
 * rounding residual to a.Ulo.  Both are template flags, not runtime tests: with the
 * residual's runtime test in it (never taken), the plain forward's prep at n = 2 ran
 * 0.86 ms instead of 0.50 on the H200; its instantiation <false, false> is instruction
 * for instruction the kernel without either store.
 * TU_OUT (a state pass that forms U itself, docs/kernels.md §3.3): no U at all -- v is
 * not read, U's items are skipped -- and Tu^T (the U product's own bf16 operand) goes to
 * a.Tu instead; the state pass forms U = Tu V from v (chunk_state_kernel's TU).  W, Kd,
 * Qd, Pm, T^T and e^last are the same bits as without.  FIVE (with TU_OUT): compiled for
 * five blocks per SM (96 registers; without v's region five fit in shared memory at
 * C = 48, 64), where four is the default elsewhere; ptxas: no spills at C = 32, 48, ~56
 * bytes at C = 64.
 */
template <int K, int V, int C, int TC, bool STORE_T, bool STORE_ULO, bool TU_OUT = false, bool FIVE = false>
__global__ void __launch_bounds__(128, FIVE || C == 32 ? 5 : 4)
    chunk_prep_kernel(GdpArgs a, bf16 *Tt, uint32_t wu_owners, int head_first) {
  /* the state pass after it may be scheduled once every prep block has started (it waits
   * for the prep's completion before it reads a panel): no launch gap */
  using L = PrepLayout<K, V, C, TC, TU_OUT>;
  static_assert(K % panel_cols(K) == 0 && V % panel_cols(V) == 0 && K % 32 == 0 && V % 32 == 0 && C % 16 == 0 &&
                    TC % 16 == 0 && C <= 64 && TC <= 32 && C % TC == 0,
                "prep shapes");
  static_assert(!TU_OUT || !STORE_ULO, "TU_OUT: without U's residual");
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
    /* at a width of 32 a round is 32 rows: C = 48 and TC = 16 end in a partial round */
    const int64_t strideK = (int64_t)RK * H * K, strideV = (int64_t)RV * H * V;
    const int ik = tid / KC, ck = (tid % KC) * 8, iv = tid / VC, cv = (tid % VC) * 8;
    const bf16 *pk = gk + ((krow0 + ik) * H + h) * K + ck;
    const bf16 *pq = gq + (((int64_t)ci.t0 + ik) * H + h) * K + ck;
    const bf16 *pv = gv + ((krow0 + iv) * H + h) * V + cv;
#pragma unroll
    for (int r = 0; r < (C + RK - 1) / RK; r++) {
      if (C % RK != 0 && ik + r * RK >= C) break;
      const bool ok = ik + r * RK < nv;
      cp_async16(smem + L::oK + ((ik + r * RK) * L::ldK + ck) * 2,
                 ok ? (const void *)(pk + r * strideK) : (const void *)gk, ok);
    }
#pragma unroll
    for (int r = 0; r < (TC + RK - 1) / RK; r++) {
      if (TC % RK != 0 && ik + r * RK >= TC) break;
      const bool ok = ik + r * RK < ci.ntok;
      cp_async16(smem + L::oQ + ((ik + r * RK) * L::ldK + ck) * 2,
                 ok ? (const void *)(pq + r * strideK) : (const void *)gq, ok);
    }
    cp_async_commit();
    if constexpr (!TU_OUT) { /* TU_OUT: no U here, so no v (its group stays, empty) */
#pragma unroll
      for (int r = 0; r < (C + RV - 1) / RV; r++) {
        if (C % RV != 0 && iv + r * RV >= C) break;
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
     * same additions, in the same order, as a row-wise serial sum over the chunk's steps
     * (whose other terms are exact zeros).  Lane t ends with the sum through token t. */
    const float gt = (gg && lane < ci.ntok) ? load_gate<bf16>(a.g, a.g_f32, ((int64_t)ci.t0 + lane) * H + h) : 0.f;
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
    /* at K = 32 (RPS = 8: 32 rows a step) a step may straddle the k and q rows (C = 48)
     * or end past them (C + TC = 80): such a step tells its rows apart at run time and
     * stores only the real ones (its shuffles still need every lane); elsewhere every step
     * is whole and of one kind, known at compile time */
    constexpr int LPR = K / 8, RPS = 32 / LPR, STEPS = (C + TC + 4 * RPS - 1) / (4 * RPS);
    bf16 *gKd = a.Kd + CHi * C * K, *gQd = a.Qd + CHi * TC * K;
    const int sub = lane / LPR, c8 = (lane % LPR) * 8;
#pragma unroll
    for (int st = 0; st < STEPS; st++) {
      const int i = (st * 4 + warp) * RPS + sub;
      /* a step's rows are all k rows or all q rows (C is a multiple of 4 RPS), known at
       * compile time, so a step is straight-line code that the scheduler can overlap with its neighbours
       * (as a runtime test it put a branch, and the end of a basic block, in every step:
       * SASS BSSY / BRA); the same rows, the same operations, the same bits */
      const bool mixed = C % (4 * RPS) != 0 && st * 4 * RPS < C && (st + 1) * 4 * RPS > C;
      const bool isq = mixed ? i >= C : st * 4 * RPS >= C;
      const bool live = (C + TC) % (4 * RPS) == 0 || (st + 1) * 4 * RPS <= C + TC || i < C + TC;
      const int row = !live ? 0 : isq ? i - C : i; /* a row past the end reads q's row 0 */
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
      if (live) {
        *reinterpret_cast<uint4 *>(src) = make_uint4(kn[0], kn[1], kn[2], kn[3]);
        /* one 16-byte store: with isq known, NVVM split the plain one into four */
        stg128((isq ? gQd : gKd) + (int64_t)row * K + c8, kd[0], kd[1], kd[2], kd[3]);
      }
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
  {
    prep_split_solve<C, STORE_T, L>(sA, (float *)(smem + L::oSolve), sBeta, sGc, sTw, sTu, Tt, CHi, warp, lane);
  }
  cp_async_wait<0>(); /* v */
  __syncthreads();

  /* W = Tw Kn, U = Tu V: items of 16 rows x 64 columns (panel_cols), k tiles up to the diagonal.  The
   * A fragments come from the transposed panels by ldmatrix.trans: matrix m = lane/8
   * covers k rows kt 16 + 8(m/2).. and T rows rb + 8(m%2).. */
  {
    if constexpr (TU_OUT) prep_store_tu<C, L>(a, CHi, s0);
    prep_wu_staged<K, V, C, STORE_ULO, L, TU_OUT>(a, CHi, s0, wu_owners);
  }
  if (tid == 0) a.elast[CHi] = __expf(last);
}

}  // namespace chunked
}  // namespace gdpcu

#endif
