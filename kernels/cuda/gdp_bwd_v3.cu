/*
 * gdp_bwd_v3.cu -- variant 3 of the chunked GDP backward (lab only, not in the library's
 * dispatch until validated on the device; kernels/cuda/NOTES.md, "Variant 3 backward").
 *
 * Steps (the chunk algebra is in gdp_chunk.cuh):
 *  1. recompute the per-chunk panels with variant 3's prep (gdp_fwd_v3.cu, unchanged);
 *  2. bwd_states_kernel_v3: the forward v3 state pass (S^T float32 in registers for the
 *     whole sequence) without the output products; per chunk it stores h = S at the
 *     chunk start and D = U - W h (bf16, variant 2's workspace layout);
 *  3. dstate_kernel_v3: the reverse state-gradient pass, dH^T float32 in registers:
 *        dD^T = dO^T Pm + dH^T Kd^T,    dH^T <- e^{last} dH^T + dO^T Qd - dD^T W,
 *     storing dH (gradient of the chunk-end state) and dD per chunk, and dh0 at the end;
 *  4. variant 2's chunk_grad_kernel (gdp_bwd.cu) reads h, D, dH, dD and writes every
 *     token gradient.  Its replacement is the next step (NOTES.md).
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

#include "gdp_bwd_v3.cuh"
#include "gdp_chunk.cuh"

namespace gdpcu {

/* Variant 2's per-chunk gradient kernel (gdp_bwd.cu) and variant 3's prep
 * (gdp_fwd_v3.cu). */
gdp_status launch_grad(const Plan &plan);
namespace v3 {
gdp_status launch_prep_v3(const Plan &plan);
}

namespace v3b {

constexpr int kStages = 3; /* chunk panels in flight: current + next two */
constexpr int kPad = 8;    /* bf16 elements (16 bytes) of padding per shared row */

/* ------------------------------------------------------------------ PTX wrappers
 * (the same as gdp_fwd_v3.cu's; kept local so the two files stay independent) */

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
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t v) {
  __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162 *>(&v);
  return __bfloat1622float2(b);
}

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

/* ROWS x COLS bf16 panel, global row stride gld -> shared row stride sld, 16 bytes per
 * cp.async, all NT threads; rows >= valid are zero-filled (nothing read).  A thread
 * keeps one 16-byte column and steps down the rows (one base, constant strides). */
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

/* ------------------------------------------------------------------ recompute: states */

template <int K, int C, int BV>
struct StatesLayout {
  static constexpr int ldK = K + kPad, ldB = BV + kPad;
  static constexpr int oW = 0;
  static constexpr int oKd = oW + C * ldK * 2;
  static constexpr int oU = oKd + C * ldK * 2;
  static constexpr int stage = (oU + C * ldB * 2 + 127) / 128 * 128;
  static constexpr int total = stage * kStages;
};

/* Grid (sequence, head, value block of BV columns); warp w owns value columns
 * col0 + 16w .. +15.  Fragments (grp = lane/4, tig = lane%4):
 *   St[nt][e] = S^T[x][r],  x = xw + grp + 8(e/2),  r = 8nt + 2tig + e%2
 *   Dt[nt][e] = -D^T[x][j], j = 8nt + 2tig + e%2.
 * Per chunk: h (= bf16 S at the chunk start, the same rounding the products use) and D
 * to variant 2's workspace, then S^T <- e^{last} S^T + D^T Kd.  No ht: the forward gave
 * it. */
template <int K, int V, int C, int BV>
__global__ void __launch_bounds__(BV / 16 * 32, 1) bwd_states_kernel_v3(GdpArgs a) {
  using L = StatesLayout<K, C, BV>;
  constexpr int NT = BV / 16 * 32;
  static_assert(K % 32 == 0 && C % 16 == 0 && BV % 16 == 0, "tile shapes");
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
      copy_panel<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K, C);
      copy_panel<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K, C);
      copy_panel<C, BV, NT>(st + L::oU, L::ldB, a.U + base * C * V + col0, V, C);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int it = 0; it < kStages - 1; it++) issue(it);

  const int nrow = (lane >> 4) * 8 + (lane & 7), ncol = ((lane >> 3) & 1) * 8;
  const int trow = ((lane >> 3) & 1) * 8 + (lane & 7), tcol = (lane >> 4) * 8;
  const int urow = (lane >> 4) * 8 + (lane & 7), ucol = warp * 16 + ((lane >> 3) & 1) * 8;
  const uint32_t smem0 = smem_addr(smem);

  for (int it = 0; it < nc; it++) {
    const int64_t CHi = (int64_t)(cbeg + it) * H + h;
    const float el = a.elast[CHi];
    cp_async_wait<kStages - 2>();
    __syncthreads();
    issue(it + kStages - 1);
    const uint32_t sb = smem0 + (it % kStages) * L::stage;
    const uint32_t sW = sb + L::oW, sKd = sb + L::oKd, sU = sb + L::oU;

    /* -D^T = -U^T + S^T W^T, the bf16 A fragment of S^T built per k tile (4 registers
     * live instead of K/4) and stored as h on the way */
    float Dt[C / 8][4];
#pragma unroll
    for (int jt = 0; jt < C / 16; jt++) {
      uint32_t u0, u1, u2, u3;
      ldsm_x4_t(sU + ((jt * 16 + urow) * L::ldB + ucol) * 2, u0, u1, u2, u3);
      const float2 f0 = unpack_bf16(u0), f1 = unpack_bf16(u1), f2 = unpack_bf16(u2),
                   f3 = unpack_bf16(u3);
      Dt[2 * jt][0] = -f0.x, Dt[2 * jt][1] = -f0.y, Dt[2 * jt][2] = -f1.x, Dt[2 * jt][3] = -f1.y;
      Dt[2 * jt + 1][0] = -f2.x, Dt[2 * jt + 1][1] = -f2.y;
      Dt[2 * jt + 1][2] = -f3.x, Dt[2 * jt + 1][3] = -f3.y;
    }
    bf16 *gh = a.hbuf + CHi * K * V + xw + grp;
#pragma unroll
    for (int kt = 0; kt < K / 16; kt++) {
      uint32_t Sa[4];
      afrag_kt(St, kt, Sa, 1.f);
      store_afrag<V>(gh, kt * 16 + 2 * tig, Sa);
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
    {
      bf16 *gD = a.Dbuf + CHi * C * V + xw + grp;
#pragma unroll
      for (int kt = 0; kt < C / 16; kt++) store_afrag<V>(gD, kt * 16 + 2 * tig, Da[kt]);
    }

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

/* ------------------------------------------------------------------ reverse state-gradient pass */

template <int K, int C, int TC, int BV>
struct DStateLayout {
  static constexpr int ldK = K + kPad, ldC = C + kPad, ldB = BV + kPad;
  static constexpr int oW = 0;
  static constexpr int oKd = oW + C * ldK * 2;
  static constexpr int oQd = oKd + C * ldK * 2;
  static constexpr int oPm = oQd + TC * ldK * 2;
  static constexpr int odO = oPm + TC * ldC * 2;
  static constexpr int stage = (odO + TC * ldB * 2 + 127) / 128 * 128;
  static constexpr int total = stage * kStages;
};

/* Grid (sequence, head, value block of BV columns); warp w owns value columns
 * xw = col0 + 16w .. +15 and walks the sequence's chunks backwards.  Fragments
 * (grp = lane/4, tig = lane%4):
 *   Ht[nt][e] = dH^T[x][r],  x = xw + grp + 8(e/2),  r = 8nt + 2tig + e%2  (float32)
 *   Gt[nt][e] = dD^T[x][j],  j = 8nt + 2tig + e%2
 *   Oa[kt]    = A fragment of dO^T (x, query row a in 16kt..16kt+15).
 * Pm[a][j] is zero for j > ia = a n + n - 1, so the (a-tile, j-tile) pairs wholly past
 * the diagonal are skipped at compile time (NN = C / TC = n). */
template <int K, int V, int C, int TC, int BV>
__global__ void __launch_bounds__(BV / 16 * 32, 1) dstate_kernel_v3(GdpArgs a) {
  using L = DStateLayout<K, C, TC, BV>;
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

  /* iteration it handles chunk cbeg + nc - 1 - it, in stage it % kStages */
  auto issue = [&](int it) {
    if (it < nc) {
      unsigned char *st = smem + (it % kStages) * L::stage;
      const int c = cbeg + nc - 1 - it;
      const int64_t base = (int64_t)c * H + h;
      const ChunkInfo ci = a.chunks[c];
      copy_panel<C, K, NT>(st + L::oW, L::ldK, a.W + base * C * K, K, C);
      copy_panel<C, K, NT>(st + L::oKd, L::ldK, a.Kd + base * C * K, K, C);
      copy_panel<TC, K, NT>(st + L::oQd, L::ldK, a.Qd + base * TC * K, K, TC);
      copy_panel<TC, C, NT>(st + L::oPm, L::ldC, a.Pm + base * TC * C, C, TC);
      copy_panel<TC, BV, NT>(st + L::odO, L::ldB, d_o + ((int64_t)ci.t0 * H + h) * V + col0, (int64_t)H * V,
                             ci.ntok);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int it = 0; it < kStages - 1; it++) issue(it);

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
    cp_async_wait<kStages - 2>();
    __syncthreads();
    issue(it + kStages - 1);
    const uint32_t sb = smem0 + (it % kStages) * L::stage;
    const uint32_t sW = sb + L::oW, sKd = sb + L::oKd, sQd = sb + L::oQd, sPm = sb + L::oPm,
                   sdO = sb + L::odO;

    /* dD^T = dH^T Kd^T + dO^T Pm.  dH (this chunk's end) as bf16 A fragments built per
     * k tile (4 registers live, not K/4), stored on the way; dO^T's fragments after, so
     * the two sets are never live together. */
    float Gt[C / 8][4];
#pragma unroll
    for (int nt = 0; nt < C / 8; nt++) Gt[nt][0] = Gt[nt][1] = Gt[nt][2] = Gt[nt][3] = 0.f;
    bf16 *gdh = a.dHbuf + CHi * K * V + xw + grp;
#pragma unroll
    for (int kt = 0; kt < K / 16; kt++) {
      uint32_t Ha[4];
      afrag_kt(Ht, kt, Ha, 1.f);
      store_afrag<V>(gdh, kt * 16 + 2 * tig, Ha);
#pragma unroll
      for (int nt = 0; nt < C / 8; nt += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(sKd + ((nt * 8 + nrow) * L::ldK + kt * 16 + ncol) * 2, b0, b1, b2, b3);
        mma16816(Gt[nt], Ha, b0, b1);
        mma16816(Gt[nt + 1], Ha, b2, b3);
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
    /* -dD^T as A fragments; dD (bf16, the same rounding) to the workspace */
    uint32_t Ga[C / 16][4];
    to_afrag<C / 16>(Gt, Ga, -1.f);
    {
      bf16 *gdd = a.dDbuf + CHi * C * V + xw + grp;
#pragma unroll
      for (int kt = 0; kt < C / 16; kt++) {
        uint32_t pos[4]; /* flip the sign bits back: exact */
#pragma unroll
        for (int q = 0; q < 4; q++) pos[q] = Ga[kt][q] ^ 0x80008000u;
        store_afrag<V>(gdd, kt * 16 + 2 * tig, pos);
      }
    }

    /* dH^T <- e^{last} dH^T + dO^T Qd + (-dD^T) W   (float32 accumulators) */
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
#pragma unroll
    for (int kt = 0; kt < C / 16; kt++)
#pragma unroll
      for (int nt = 0; nt < K / 8; nt += 2) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(sW + ((kt * 16 + trow) * L::ldK + nt * 8 + tcol) * 2, b0, b1, b2, b3);
        mma16816(Ht[nt], Ga[kt], b0, b1);
        mma16816(Ht[nt + 1], Ga[kt], b2, b3);
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

/* ------------------------------------------------------------------ host side */

template <class Kern>
static gdp_status occupancy(Kern kern, int threads, int smem, int *blocks_per_sm) {
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  GDP_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, threads, smem));
  return GDP_OK;
}

/* One launch of both sequential kernels at value-block width BV (dry_run: occupancy of
 * the dstate kernel only, the larger of the two). */
template <int K, int V, int C, int TC, int BV>
static gdp_status launch_seq_bv(const Plan &plan, bool states, bool dry_run, int *occ) {
  const GdpArgs &a = plan.a;
  const dim3 grid((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV));
  constexpr int threads = BV / 16 * 32;
  if (dry_run) return occupancy(dstate_kernel_v3<K, V, C, TC, BV>, threads, DStateLayout<K, C, TC, BV>::total, occ);
  if (states) {
    auto kern = bwd_states_kernel_v3<K, V, C, BV>;
    constexpr int smem = StatesLayout<K, C, BV>::total;
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kern<<<grid, threads, smem, plan.stream>>>(a);
    GDP_CUDA_LAUNCHED("bwd_states_kernel_v3");
  } else {
    auto kern = dstate_kernel_v3<K, V, C, TC, BV>;
    constexpr int smem = DStateLayout<K, C, TC, BV>::total;
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kern<<<grid, threads, smem, plan.stream>>>(a);
    GDP_CUDA_LAUNCHED("dstate_kernel_v3");
  }
  return GDP_OK;
}

template <int K, int V, int C, int TC>
static gdp_status launch_seq_k(const Plan &plan, int bv, bool states, bool dry_run, int *occ) {
  switch (bv) {
    case 64: return launch_seq_bv<K, V, C, TC, 64>(plan, states, dry_run, occ);
    case 32: return launch_seq_bv<K, V, C, TC, 32>(plan, states, dry_run, occ);
    default: return launch_seq_bv<K, V, C, TC, 16>(plan, states, dry_run, occ);
  }
}

template <int K, int V>
static gdp_status launch_seq_n(const Plan &plan, int bv, bool states, bool dry_run, int *occ) {
  if (plan.a.n == 1) return launch_seq_k<K, V, 32, 32>(plan, bv, states, dry_run, occ);
  if (plan.a.n == 2) return launch_seq_k<K, V, 64, 32>(plan, bv, states, dry_run, occ);
  return launch_seq_k<K, V, 48, 16>(plan, bv, states, dry_run, occ);
}

static gdp_status launch_seq(const Plan &plan, int bv, bool states, bool dry_run, int *occ) {
  const GdpArgs &a = plan.a;
  if (a.K == 128)
    return a.V == 128 ? launch_seq_n<128, 128>(plan, bv, states, dry_run, occ)
                      : launch_seq_n<128, 64>(plan, bv, states, dry_run, occ);
  return a.V == 128 ? launch_seq_n<64, 128>(plan, bv, states, dry_run, occ)
                    : launch_seq_n<64, 64>(plan, bv, states, dry_run, occ);
}

/* Value-block width as in the forward v3: the fewest waves, narrower on a tie.
 * GDP_CUDA_V3_BV=16|32|64 forces it. */
static int choose_bv(const Plan &plan) {
  const GdpArgs &a = plan.a;
  const char *env = getenv("GDP_CUDA_V3_BV");
  if (env) {
    const int bv = atoi(env);
    if ((bv == 16 || bv == 32 || bv == 64) && a.V % bv == 0) return bv;
  }
  int best = 16;
  double best_waves = INFINITY;
  for (int bv : {16, 32, 64}) {
    if (a.V % bv) continue;
    static int occ_cache[2][2][3][3] = {}; /* depends only on (K, V, n, bv); benign race */
    int &occ = occ_cache[a.K == 128][a.V == 128][a.n - 1][bv == 16 ? 0 : bv == 32 ? 1 : 2];
    if (occ == 0 && launch_seq(plan, bv, false, true, &occ) != GDP_OK) occ = -1;
    if (occ < 1) continue;
    const double waves = ceil((double)a.N * a.H * (a.V / bv) / ((double)num_sms() * occ));
    if (waves < best_waves) best_waves = waves, best = bv;
  }
  return best;
}

}  // namespace v3b
}  // namespace gdpcu

using namespace gdpcu;

extern "C" int gdp_cuda_gdp_backward_v3_supported(const gdp_gdp_problem *p) {
  return p && chunk_path_ok(p) && (p->K == 64 || p->K == 128) && (p->V == 64 || p->V == 128) && p->n >= 1 &&
         p->n <= 3;
}

extern "C" gdp_status gdp_cuda_gdp_backward_v3(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io,
                                               void *stream_) {
  GDP_TRY(validate_problem(p, "backward_v3"));
  if (!io) return GDP_ERROR(GDP_ERR_INVALID_ARG, "io is NULL");
  if (!gdp_cuda_gdp_backward_v3_supported(p))
    return GDP_ERROR(GDP_ERR_UNSUPPORTED,
                     "backward_v3 takes bf16, n = 1..3, K and V = 64 or 128; got dtype %d n=%lld K=%lld V=%lld",
                     p->dtype, (long long)p->n, (long long)p->K, (long long)p->V);
  if (p->T_total > 0 && (!io->q || !io->k || !io->v || !io->beta || !io->d_o || !io->dq || !io->dk ||
                         !io->dv || !io->dbeta))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "q, k, v, beta, d_o, dq, dk, dv and dbeta must be non-NULL");
  if ((io->g == NULL) != (io->dg == NULL))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "dg must be given exactly when g is (g %s, dg %s)",
                     io->g ? "set" : "NULL", io->dg ? "set" : "NULL");
  if (p->N == 0) return GDP_OK;
  cudaStream_t stream = (cudaStream_t)stream_;
  GdpArgs a;
  memset(&a, 0, sizeof a);
  a.q = io->q;
  a.k = io->k;
  a.v = io->v;
  a.g = io->g;
  a.beta = io->beta;
  a.h0 = (const float *)io->h0;
  a.d_o = io->d_o;
  a.dht = (const float *)io->dht;
  a.dq = io->dq;
  a.dk = io->dk;
  a.dv = io->dv;
  a.dbeta = io->dbeta;
  a.dg = io->dg;
  a.dh0 = (float *)io->dh0;
  a.H = (int)p->H;
  a.K = (int)p->K;
  a.V = (int)p->V;
  a.n = (int)p->n;
  a.l2norm = p->l2norm_in_kernel;
  a.scale = (float)p->scale;
  a.N = (int)p->N;
  Plan plan;
  prof_begin(stream);
  gdp_status st = plan_make(p, stream, true, a, &plan);
  if (st != GDP_OK) {
    prof_end(stream);
    return st;
  }
  prof_mark("bwd plan+upload", stream);
  st = v3::launch_prep_v3(plan);
  prof_mark("bwd prep v3 (recompute)", stream);
  const int bv = v3b::choose_bv(plan);
  if (st == GDP_OK) st = v3b::launch_seq(plan, bv, true, false, nullptr);
  prof_mark("bwd states v3 (recompute)", stream);
  if (st == GDP_OK) st = v3b::launch_seq(plan, bv, false, false, nullptr);
  prof_mark("bwd state gradients v3", stream);
  if (st == GDP_OK) st = launch_grad(plan);
  prof_mark("bwd chunk gradients (v2)", stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}
