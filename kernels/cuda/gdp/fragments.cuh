/*
 * fragments.cuh -- the device helpers every GDP chunk kernel shares: dtype access, warp
 * reductions, 16-byte asynchronous copies, the raw PTX wrappers
 * (ldmatrix, mma.sync m16n8k16 bf16 -> f32, bf16x2 packing; each comment gives the
 * fragment layout the kernels' index algebra relies on), and the per-warp shared-memory
 * staging of the state passes: the transposed chunk states h^T / dH^T and the D / dD
 * tiles go from mma fragments to a warp's staging buffer and out as whole-row 16-byte
 * stores, and the chunk panels come in (copy_panel_full).
 */
#ifndef GDP_KERNELS_CUDA_GDP_FRAGMENTS_CUH
#define GDP_KERNELS_CUDA_GDP_FRAGMENTS_CUH

#include <stdint.h>

#include "plan.cuh"

namespace gdpcu {

/* ------------------------------------------------------------------ dtype access */

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }

/* g[i] and dg[i] in the gate's dtype: float32 where the problem's gate_f32 is set (beside
 * bf16 tokens), else the tokens' T. */
template <class T>
__device__ __forceinline__ float load_gate(const void *g, int g_f32, int64_t i) {
  return g_f32 ? ((const float *)g)[i] : to_f(((const T *)g)[i]);
}
template <class T>
__device__ __forceinline__ void store_gate_grad(void *dg, int g_f32, int64_t i, float v) {
  if (g_f32)
    ((float *)dg)[i] = v;
  else
    ((T *)dg)[i] = from_f<T>(v);
}

/* ------------------------------------------------------------------ reductions */

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

/* ------------------------------------------------------------------ async copies */

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
/* 16 bytes global -> shared; zero-filled (nothing read) when !pred. */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace gdpcu

/* ------------------------------------------------------------------ PTX wrappers */

namespace gdpcu {

/* Four 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.  Thread t
 * receives, of matrix i, row t/4 columns 2(t%4), 2(t%4)+1 (register i). */
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                        uint32_t &r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
/* Same, transposed: thread t receives rows 2(t%4), 2(t%4)+1 of column t/4. */
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                          uint32_t &r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
/* d += A (16x16, row) * B (16x8, col), bf16 in, float32 accumulate. */
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* Two floats -> bf16x2, the first in the low half (the lower column index). */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t v) {
  __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162 *>(&v);
  return __bfloat1622float2(b);
}
/* One row of a warp's 16 x 8NT accumulator tile, as bf16, to memory, 8 bytes a lane
 * (st_row_pairs; st_pair_x8 stores one pair of 8-column blocks): w[nt] is this lane's
 * packed pair (columns 8 nt + 2 tig, + 1).  Lanes tig and tig ^ 1 swap one word
 * per pair of 8-column blocks, so that the even lane holds four consecutive columns of block
 * p and the odd lane four of block p + 1: the row's 32 bytes in one store instruction (whole
 * 32-byte sectors) instead of 16 bytes in each of two, half the store instructions.  Every
 * lane of the warp (of `lanes`) must call it (the shuffles); `ok` predicates the stores only.  row:
 * column 0 of the tile in this lane's row, 8-byte aligned. */
__device__ __forceinline__ void st_pair_x8(__nv_bfloat16 *row, int p, uint32_t wp, uint32_t wq, int tig, bool ok,
                                           unsigned lanes = 0xffffffffu) {
  /* blocks p and p + 1 (p even): wp, wq this lane's words of the two; lanes: the lanes that
   * call it (a lane's partner tig ^ 1 is in its row, so in or out with it) */
  const bool odd = tig & 1;
  const uint32_t got = __shfl_xor_sync(lanes, odd ? wp : wq, 1);
  if (ok)
    *reinterpret_cast<uint2 *>(row + p * 8 + (odd ? 8 + 2 * (tig - 1) : 2 * tig)) =
        odd ? make_uint2(got, wq) : make_uint2(wp, got);
}
template <int NT>
__device__ __forceinline__ void st_row_pairs(__nv_bfloat16 *row, const uint32_t (&w)[NT], int tig, bool ok) {
  static_assert(NT % 2 == 0, "pairs of 8-column blocks");
#pragma unroll
  for (int p = 0; p < NT; p += 2) st_pair_x8(row, p, w[p], w[p + 1], tig, ok);
}

}  // namespace gdpcu


/* ------------------------------------------------------------------ state staging */

namespace gdpcu {
namespace chunked {

/* ROWS x COLS bf16 panel whose rows are all there (the prep's workspace panels are
 * zero-filled past a sequence's end), global row stride gld -> shared row stride sld, 16
 * bytes per cp.async; all NT threads of the block take part.  A thread keeps one 16-byte
 * column and steps down the rows, so its addresses are one base plus constant strides
 * (few registers), and without a zero-fill predicate each cp.async is one LDGSTS with
 * constant offsets.  (copy_panel below, predicated by valid rows, keeps a
 * compare, a select and a 64-bit pointer per copy: at BV = 16 ~500 of chunk_dstate_kernel's
 * ~1500 instructions per chunk, and 255 registers.) */
template <int ROWS, int COLS, int NT>
__device__ __forceinline__ void copy_panel_full(unsigned char *dst, int sld, const bf16 *src, int64_t gld) {
  constexpr int per_row = COLS / 8;
  if constexpr (NT % per_row == 0) {
    constexpr int row_step = NT / per_row;
    const int r0 = (int)threadIdx.x / per_row, c8 = ((int)threadIdx.x % per_row) * 8;
    unsigned char *d = dst + (r0 * sld + c8) * 2;
    const bf16 *g = src + (int64_t)r0 * gld + c8;
#pragma unroll
    for (int r = 0; r < ROWS; r += row_step)
      if (ROWS % row_step == 0 || r + r0 < ROWS) cp_async16(d + r * sld * 2, g + (int64_t)r * gld, true);
  } else { /* rows of 6 chunks (C = 48): plain index arithmetic, small panel */
    constexpr int total = ROWS * per_row;
#pragma unroll
    for (int e0 = 0; e0 < total; e0 += NT) {
      const int e = e0 + (int)threadIdx.x;
      if (total % NT == 0 || e < total) {
        const int r = e / per_row, c8 = (e % per_row) * 8;
        cp_async16(dst + (r * sld + c8) * 2, src + (int64_t)r * gld + c8, true);
      }
    }
  }
}

/* ROWS x COLS bf16 panel, global row stride gld -> shared row stride sld, 16 bytes per
 * cp.async, all NT threads; rows >= valid are zero-filled (nothing read).  A thread
 * keeps one 16-byte column and steps down the rows (one base, constant strides).  For
 * panels that may end inside the chunk (a sequence's last chunk): token rows of k, v, dO. */
template <int ROWS, int COLS, int NT>
__device__ __forceinline__ void copy_panel(unsigned char *dst, int sld, const bf16 *src, int64_t gld,
                                           int valid) {
  constexpr int per_row = COLS / 8;
  if constexpr (NT % per_row == 0) {
    constexpr int row_step = NT / per_row;
    const int r0 = (int)threadIdx.x / per_row, c8 = ((int)threadIdx.x % per_row) * 8;
    unsigned char *d = dst + (r0 * sld + c8) * 2;
    const bf16 *g = src + (int64_t)r0 * gld + c8;
#pragma unroll
    for (int r = 0; r < ROWS; r += row_step)
      if (ROWS % row_step == 0 || r + r0 < ROWS) {
        const bool ok = r + r0 < valid;
        cp_async16(d + r * sld * 2, ok ? (const void *)(g + (int64_t)r * gld) : (const void *)src, ok);
      }
  } else { /* rows of 6 chunks (C = 48): plain index arithmetic, small panel */
    constexpr int total = ROWS * per_row;
#pragma unroll
    for (int e0 = 0; e0 < total; e0 += NT) {
      const int e = e0 + (int)threadIdx.x;
      if (total % NT == 0 || e < total) {
        const int r = e / per_row, c8 = (e % per_row) * 8;
        const bool ok = r < valid;
        cp_async16(dst + (r * sld + c8) * 2, ok ? (const void *)(src + (int64_t)r * gld + c8) : (const void *)src,
                   ok);
      }
    }
  }
}

/* -U^T into the accumulator Dt for NJ j-tiles of 16, U read from its bf16 panel [j][x] in
 * shared memory at sU (row stride ldB elements) by ldmatrix.trans at (urow, ucol), straight
 * into accumulator order (j-tiles 2jt, 2jt + 1); with lo, plus U's bf16 residual from the
 * panel of the same layout at sUl (hi + lo is exact in float32).  The panel path of
 * chunk_state_kernel, its two-warp pass and chunk_state_recompute_kernel. */
template <int NJ>
__device__ __forceinline__ void neg_u_from_panel(float (&Dt)[2 * NJ][4], uint32_t sU, uint32_t sUl, int ldB,
                                                 int urow, int ucol, bool lo) {
#pragma unroll
  for (int jt = 0; jt < NJ; jt++) {
    uint32_t u0, u1, u2, u3;
    ldsm_x4_t(sU + ((jt * 16 + urow) * ldB + ucol) * 2, u0, u1, u2, u3);
    float2 f0 = unpack_bf16(u0), f1 = unpack_bf16(u1), f2 = unpack_bf16(u2), f3 = unpack_bf16(u3);
    if (lo) {
      uint32_t l0, l1, l2, l3;
      ldsm_x4_t(sUl + ((jt * 16 + urow) * ldB + ucol) * 2, l0, l1, l2, l3);
      const float2 g0 = unpack_bf16(l0), g1 = unpack_bf16(l1), g2 = unpack_bf16(l2), g3 = unpack_bf16(l3);
      f0.x += g0.x, f0.y += g0.y, f1.x += g1.x, f1.y += g1.y;
      f2.x += g2.x, f2.y += g2.y, f3.x += g3.x, f3.y += g3.y;
    }
    Dt[2 * jt][0] = -f0.x, Dt[2 * jt][1] = -f0.y, Dt[2 * jt][2] = -f1.x, Dt[2 * jt][3] = -f1.y;
    Dt[2 * jt + 1][0] = -f2.x, Dt[2 * jt + 1][1] = -f2.y;
    Dt[2 * jt + 1][2] = -f3.x, Dt[2 * jt + 1][3] = -f3.y;
  }
}

/* -U^T = (-V^T) Tu^T into the accumulator Dt (zeroed here), for a state pass that forms U
 * itself (GdpArgs::Tu): the warp's 16 value columns of v's rows [m][x] in shared memory at
 * sV (row stride ldB elements) give the A fragments of V^T by ldmatrix.trans at
 * (urow, ucol), negated by their sign bits (exact); Tu^T [m][j] at sTu (row stride ldC) is
 * the transposed-B operand at (trow, tcol); Tu[j][m] = 0 for m > j, so those tiles are
 * skipped.  Both chunk_state_kernel (chunk_state_pass.cuh) and chunk_state_recompute_kernel (chunk_state_recompute.cuh). */
template <int C>
__device__ __forceinline__ void neg_u_from_tu_v(float (&Dt)[C / 8][4], uint32_t sV, uint32_t sTu, int ldB, int ldC,
                                                int urow, int ucol, int trow, int tcol) {
#pragma unroll
  for (int nt = 0; nt < C / 8; nt++) Dt[nt][0] = Dt[nt][1] = Dt[nt][2] = Dt[nt][3] = 0.f;
#pragma unroll
  for (int mt = 0; mt < C / 16; mt++) {
    uint32_t va[4];
    ldsm_x4_t(sV + ((mt * 16 + urow) * ldB + ucol) * 2, va[0], va[1], va[2], va[3]);
#pragma unroll
    for (int q = 0; q < 4; q++) va[q] ^= 0x80008000u;
#pragma unroll
    for (int nt = 0; nt < C / 8; nt += 2) {
      if (mt * 16 > nt * 8 + 15) continue;
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(sTu + ((mt * 16 + trow) * ldC + nt * 8 + tcol) * 2, b0, b1, b2, b3);
      mma16816(Dt[nt], va, b0, b1);
      mma16816(Dt[nt + 1], va, b2, b3);
    }
  }
}

/* A warp's staging buffer for the h^T / dH^T half-row stores (stage_hT16_half) and the
 * D / dD tiles (stage_dfrags).  warp_bytes is sized for eight rows of K floats padded by
 * 32 bytes (row): the passes that stage through it were measured, and their value-block
 * widths, pair pass and fork chosen, with this shared-memory footprint, so it stays; only
 * the 2-stage dstate kernel, made for the fork, uses the bf16-only size warp_bytes16. */
template <int K, int C>
struct HtStage {
  static constexpr int row = K * 4 + 32;
  /* the same buffer then stages the warp's D tile (C rows of 16 bf16, stage_dfrags):
   * rows 48 bytes apart, so the four rows of one 2-byte fragment store fall in distinct
   * banks and every row starts on 16 bytes */
  static constexpr int drow = 48;
  /* bf16 h^T, dH^T (stage_hT16_half): rows of 2K + 16 bytes */
  static constexpr int row16 = K * 2 + 16;
  static constexpr int warp_bytes = 8 * row > C * drow ? 8 * row : C * drow;
  static_assert(8 * row16 <= warp_bytes, "bf16 staging fits");
  /* a buffer that only ever stages bf16 rows and D tiles (dstate's 2-stage kernel: 3072
   * instead of 4352 bytes a warp at K = 128, C = 64) */
  static constexpr int warp_bytes16 = 8 * row16 > C * drow ? 8 * row16 : C * drow;
};

/* h^T (or dH^T) bf16 [V][K] per (chunk, head), half of a warp's 16 rows at a time: the
 * accumulator tiles X[nt][e] = S^T[x][r], x = xw + grp + 8(e/2), r = 8nt + 2tig + e%2;
 * half hf takes e = 2hf, 2hf+1, i.e. rows xw + 8hf + grp, whole (K elements each), at
 * `grow` = global row xw + 8hf.  Each accumulator pair is rounded once to nearest
 * (pack_bf16: the bits of the A fragments Sa), staged in the warp's buffer (HtStage, at
 * stage0 + warp * WB) as one 4-byte word per nt in rows of 2K + 16 bytes (word
 * grp (K/2 + 4) + 4nt + tig: the 32 lanes of a store hit 32 distinct banks), and read
 * back as whole rows, lane l taking 16 bytes l % (K/8) of row l / (K/8): each STG.128
 * writes 512 contiguous bytes (two rows at K = 128, four at K = 64), four per half,
 * instead of the 8-byte stores straight from the fragments, which touched 8 lines per
 * instruction (4x the L2 requests; ncu: L2 85-92% busy in these passes).  Plain shared
 * and global stores, no bulk async copy: on sm_90 the bulk-store wait compiles to the
 * same DEPBAR as the panels' cp.async.wait_group, so it would drain the panel prefetch
 * too.  The thread index is re-read (volatile: not hoisted), so no lane-derived address
 * stays live across the chunk loop (the passes run at up to 255 registers).  The first
 * __syncwarp orders the previous half's reads of the buffer before these writes; the
 * second, the writes before the reads. */
template <int K, int C, int WB = HtStage<K, C>::warp_bytes>
__device__ __forceinline__ void stage_hT16_half(unsigned char *stage0, bf16 *grow, const float (&X)[K / 8][4],
                                                int hf) {
  constexpr int kRow = HtStage<K, C>::row16;
  constexpr int kU4 = K / 8;      /* 16-byte pieces per row */
  constexpr int kRows = 32 / kU4; /* rows per warp instruction: 2 (K = 128), 4 (K = 64) */
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int lane = (int)(tid & 31);
  unsigned char *buf = stage0 + (tid >> 5) * WB;
  __syncwarp();
  unsigned char *s = buf + (lane >> 2) * kRow + 4 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < K / 8; nt++)
    *reinterpret_cast<uint32_t *>(s + nt * 16) = hf ? pack_bf16(X[nt][2], X[nt][3]) : pack_bf16(X[nt][0], X[nt][1]);
  __syncwarp();
  const int r = lane / kU4, c16 = lane % kU4;
  const unsigned char *src = buf + r * kRow + c16 * 16;
  bf16 *dst = grow + r * K + c16 * 8;
#pragma unroll
  for (int i = 0; i < 8; i += kRows)
    *reinterpret_cast<uint4 *>(dst + i * K) = *reinterpret_cast<const uint4 *>(src + i * kRow);
}

/* A bf16 [C][V] tile from the warp's C/16 A fragments (D, dD: register q of A[kt] =
 * M[16kt + 2tig + 8(q/2) + {0,1}][xw + grp + 8(q%2)], each XOR `flip`), through the warp's
 * staging buffer (HtStage: row j at j * drow, the 16 columns xw.. contiguous): 2-byte
 * shared stores, then lane l copies 16 bytes (columns 8(l%2)..+7) of row l/2 (+16i), so
 * every STG.128 writes 16 rows x 32 bytes, one whole sector per row.  `g` = row 0, column
 * xw.  The 2-byte global stores this replaces wrote each sector in two 16-byte halves
 * (2x the L2 requests).  Syncs as in stage_hT16_half. */
template <int K, int C, int WB = HtStage<K, C>::warp_bytes>
__device__ __forceinline__ void stage_dfrags(unsigned char *stage0, bf16 *g, int64_t ld,
                                             const uint32_t (&A)[C / 16][4], uint32_t flip) {
  constexpr int kRow = HtStage<K, C>::drow;
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int lane = (int)(tid & 31);
  unsigned char *buf = stage0 + (tid >> 5) * WB;
  __syncwarp();
  unsigned char *s = buf + 2 * (lane & 3) * kRow + (lane >> 2) * 2;
#pragma unroll
  for (int kt = 0; kt < C / 16; kt++)
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const uint32_t v = A[kt][q] ^ flip;
      unsigned char *e = s + (16 * kt + 8 * (q >> 1)) * kRow + 16 * (q & 1);
      *reinterpret_cast<uint16_t *>(e) = (uint16_t)(v & 0xffffu);
      *reinterpret_cast<uint16_t *>(e + kRow) = (uint16_t)(v >> 16);
    }
  __syncwarp();
  const int r = lane >> 1, h16 = (lane & 1) * 16;
#pragma unroll
  for (int i = 0; i < C; i += 16)
    *reinterpret_cast<uint4 *>(reinterpret_cast<unsigned char *>(g + (i + r) * ld) + h16) =
        *reinterpret_cast<const uint4 *>(buf + (i + r) * kRow + h16);
}

/* The l2 norm of a row spread over LPR lanes, one 16-byte chunk (8 bf16) a lane: x gets the
 * chunk as floats; returns 1 / sqrt(|row|^2 + eps) (1 without l2norm).  The forward prep and
 * grad_wy (chunk_backward.cu) both normalise k with it, so their kn are the same bits. */
template <int LPR>
__device__ __forceinline__ float row_l2_inv(uint4 raw, float (&x)[8], bool l2norm) {
  const uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
  float ss = 0.f;
#pragma unroll
  for (int m = 0; m < 4; m++) {
    const float2 p = unpack_bf16(w4[m]);
    x[2 * m] = p.x;
    x[2 * m + 1] = p.y;
  }
#pragma unroll
  for (int m = 0; m < 8; m++) ss += x[m] * x[m];
#pragma unroll
  for (int o = LPR / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  return l2norm ? rsqrtf(ss + kNormEps) : 1.f;
}

}  // namespace chunked
}  // namespace gdpcu

#endif
