/*
 * chunk_grad_state.cuh -- the per-chunk gradients' state part: the terms that need the
 * K x V chunk states (dq final; dKnA, dWg, dgcA partials for the WY part).
 */
#ifndef GDP_KERNELS_CUDA_GDP_CHUNK_GRAD_STATE_CUH
#define GDP_KERNELS_CUDA_GDP_CHUNK_GRAD_STATE_CUH

#include "chunk_backward.cuh"

namespace gdpcu {
namespace chunked_backward {

/* ------------------------------------------------------------------ per-chunk gradients, state part */

/* Shared-memory layout of chunk_grad_state_kernel (bytes; rows padded by 16 bytes). */
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
   * slots, one writer each (TC / 16, panel_groups(K) and K / 32 of them), added up in a fixed order
   * (slot_sum) where they are read; shared-memory float atomics compiled to compare-and-swap
   * loops (ncu: ~5% of the kernel's warp stall samples) */
  static constexpr int nDgc = TC / 16, nZ = panel_groups(K), nQd = K / 32;
  static constexpr int fGp = 0, fGc = C, fDgc = 2 * C, fZ = fDgc + nDgc * C, fQinv = fZ + nZ * C,
                       fQdot = fQinv + TC, fDot = fQdot + nQd * TC, fKinv = fDot + 8, nF = fKinv + C;
  static constexpr int total = oF + nF * 4;
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
 * (phases P1-P6 below); the WY part
 * (T, dT, dA, dv, dbeta and the rest of dk, dg) adds to dKnA and dgcA.  Only the TC query
 * rows enter the query products (dO is zero on the other steps). */
template <int K, int V, int C, int TC>
__global__ void __launch_bounds__(256, 2) chunk_grad_state_kernel(GdpArgs a, GradStateOut go) {
  using L = GradStateLayout<K, V, C, TC>;
  /* h^T and dH^T arrive in bf16 (go.hT16, go.dHT16; docs/kernels.md §3.3, bf16 chunk
   * states): every product below takes them as bf16 operands anyway; only <dH, h> sums
   * the rounded values.  dH^T is cp.async'ed straight into the K x V buffer with the
   * other panels at the start (the layout is the buffer's); <dH, h> is summed in P3a from
   * the h^T reload (registers) against the dH^T vectors in shared memory. */
  using SV = uint4;
  constexpr int kEPV = 8;                              /* elements per vector */
  constexpr uint32_t kSB = (uint32_t)(V * K) * 2;      /* bytes of one (chunk, head) copy */
  constexpr int NN = C / TC;
  constexpr int PK = panel_cols(K), GK = panel_groups(K); /* key panels: 64 columns, or 32 at K = 32 */
  static_assert(K % 32 == 0 && V % 16 == 0 && C % 16 == 0 && TC % 16 == 0 && NN * TC == C, "shapes");
  extern __shared__ __align__(128) unsigned char smem[];
  const int h = (int)blockIdx.y;
  const ChunkInfo ci = a.chunks[blockIdx.x];
  const int c = (int)blockIdx.x;
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
  /* this block's h^T copy */
  const unsigned char *gH = (const unsigned char *)(go.hT16 + CHi * V * K);

  /* ---- loads.  h^T is pulled into L2 first, by a bulk prefetch that holds no register
   * and no shared memory; the panels follow by cp.async (dH^T with them, dD, needed only
   * from P3b on, in a later group).  The block then computes the cumulative gate, the
   * k / q norms and P1 (none of which reads h or dH) while that stream runs, and reads
   * h^T only after P3a's products, from L2.  (Loading the states first, each round waited
   * a full DRAM latency with nothing else to do: ncu 20.5 warp cycles per instruction.) */
  if (tid == 0) prefetch_l2_bulk(gH, kSB);
  /* D, dD: workspace panels with all C rows */
  copy_panel_full<C, V, 256>(smem + L::oD, L::ldV, a.Dbuf + CHi * C * V, V);
  copy_panel<TC, V, 256>(smem + L::odO, L::ldV, d_o + ((int64_t)ci.t0 * H + h) * V, (int64_t)H * V, ci.ntok);
  copy_panel<C, K, 256>(smem + L::oKn, L::ldK, gk + (krow0 * H + h) * K, (int64_t)H * K, nv);
  copy_panel<TC, K, 256>(smem + L::oQn, L::ldK, gq + ((int64_t)ci.t0 * H + h) * K, (int64_t)H * K, ci.ntok);
  cp_async_commit();
  {
    /* dH^T [V][K] bf16 -> the K x V buffer (rows padded): thread tid copies the 16-byte
     * vectors e = tid + 256 u, the ones it dots with its h^T reload in P3a */
    copy_panel_full<V, K, 256>(smem + L::oHb, L::ldK, go.dHT16 + CHi * V * K, K);
    cp_async_commit();
  }
  copy_panel_full<C, V, 256>(smem + L::odD, L::ldV, a.dDbuf + CHi * C * V, V);
  cp_async_commit();
  /* sDgc, sZ, sQdot: every slot is written once below (P1, P3a, P2), none zeroed */
  if (warp == 0) {
    /* gc of key row i = g summed over the tokens <= i/n, token by token from 0.f: the
     * prep's shuffle scan (chunk_prep.cuh), so the same additions in the same order, and
     * bit-identical to the serial loop over shared memory it replaces (whose other terms
     * were exact zeros), without its 64 dependent shared loads.  Lane t ends with the
     * sum through token t. */
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
  cp_async_wait<2>();              /* D, dO, k, q (this thread's copies) */
  __syncthreads();
  /* The k, q rows stay raw (exact bf16) and only their norms are taken:
   * kinv, qinv = rsqrt(|x|^2 + eps).  Every product below uses the raw rows and folds the
   * norms into its epilogue, so kn and qn are never rounded to bf16 here: the gate
   * gradient's z terms (kn . (D dH^T)) lost ~1.9e-3 of dg's precision to that rounding
   * (docs/kernels.md §3.6).  Rows past the end were zero-filled and stay zero.
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
         * short, dht-free problems (docs/kernels.md §3.6). */
        const float2 pr = unpack_bf16(pk);
        colsum[nt][0] += pr.x * qk[nt][2 * hf];
        colsum[nt][1] += pr.y * qk[nt][2 * hf + 1];
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

  /* ---- h^T, an L2 hit by now (prefetched at the start): one K x V buffer holds dH^T
   * until P3a's products are done, then h^T (the block stays at ~108 KB, two blocks per
   * SM).  16-byte vectors of 8 bf16 per thread: 1 .. 8 (8 at K = V = 128; at K = V = 32
   * half the threads hold one), all held from here to the dot and the store over dH^T.
   * Past 8 (K = 256: 16) they would take 64 of the 128 registers a thread has here, so
   * they are not held: the dot and the store each read them from L2 (the copy is 64 KB,
   * prefetched; the second read costs an L2 pass, not DRAM).
   * The dot sums per thread e ascending in steps of 256. */
  constexpr int nvecH = V * K / kEPV, perH = (nvecH + 255) / 256;
  constexpr bool kHoldH = perH <= 8;
  constexpr int earlyH = kHoldH ? perH : 1;
  static_assert(nvecH % 256 == 0 || nvecH < 256, "h^T reload: whole rounds of 256 vectors, or one partial");
  const bool hvec = nvecH % 256 == 0 || tid < nvecH; /* this thread holds vectors */
  const SV *ph = (const SV *)gH;
  SV hv[earlyH];
  if constexpr (kHoldH) {
    /* the h^T reload (L2, prefetched at the start) is issued here, before the barrier and
     * this warp's D dH^T products, so its latency hides behind P3a; held in registers for
     * the dot and the store over dH^T (loads only: same bits) */
#pragma unroll
    for (int u = 0; u < earlyH; u++) hv[u] = hvec ? __ldcs(ph + u * 256 + tid) : make_uint4(0, 0, 0, 0);
  }
  /* vector u of this thread's share of h^T: held, or read from L2 (first read kept in L2) */
  const auto h_vec = [&](int u, bool last_read) -> SV {
    if constexpr (kHoldH) return hv[u];
    return last_read ? __ldcs(ph + u * 256 + tid) : __ldcg(ph + u * 256 + tid);
  };
  cp_async_wait<1>();              /* dD (read from P3b on; the barriers below publish it) */
  __syncthreads();

  /* ---- P3a: per 16 steps x PK (64, or 32 at K = 32) key columns: dKnA = e^{last-gc_j} D dH^T + Ps^T qn (z_j
   * on the way); item = warp (at most 8 items).  Once a warp's D dH^T products are done it
   * no longer reads dH^T, so it issues its share of the h^T reload (L2) into registers
   * right then and finishes its item (z, Ps^T qn, the dKnA store) while those loads are in
   * flight; the barrier then only guards the shared-memory overwrite. */
  constexpr int nP3 = (C / 16) * GK, NT = PK / 8;
  static_assert(nP3 <= 8, "one P3 item per warp");
  {
    const int jb = (warp / GK) * 16, rb = (warp % GK) * PK;
    float acc[NT][4] = {};
    if (warp < nP3) {
#pragma unroll
      for (int kt = 0; kt < V / 16; kt++) {
        uint32_t fa[4];
        ldsm_x4(s0 + L::oD + ((jb + arow) * L::ldV + kt * 16 + acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(s0 + L::oHb + ((kt * 16 + trow) * L::ldK + rb + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(acc[nt], fa, b0, b1);
          mma16816(acc[nt + 1], fa, b2, b3);
        }
      }
    }
    if (warp < nP3) {
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int j = jb + grp + 8 * hf;
        const float w = __expf(last - sGc[j]) * sKinv[j]; /* kinv_j: z = k_raw . acc is then kn . w (D dH^T) */
        float z = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
          acc[nt][2 * hf] *= w;
          acc[nt][2 * hf + 1] *= w;
          const float2 kv = unpack_bf16(*reinterpret_cast<const uint32_t *>(
              smem + L::oKn + (j * L::ldK + rb + nt * 8 + 2 * tig) * 2));
          z += kv.x * acc[nt][2 * hf] + kv.y * acc[nt][2 * hf + 1];
        }
        z += __shfl_xor_sync(0xffffffffu, z, 1);
        z += __shfl_xor_sync(0xffffffffu, z, 2);
        if (tig == 0) sZ[(rb / PK) * C + j] = z;
      }
      /* + Ps^T qn: A = Ps^T (rows j, k = query a) by ldmatrix.trans from Ps [a][j] */
#pragma unroll
      for (int kt = 0; kt < TC / 16; kt++) {
        if (jb > (kt * 16 + 15) * n + n - 1) continue; /* Ps zero there */
        uint32_t fa[4];
        ldsm_x4_t(s0 + L::oPs + ((kt * 16 + atk) * L::ldC + jb + atm) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(s0 + L::oQn + ((kt * 16 + trow) * L::ldK + rb + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(acc[nt], fa, b0, b1);
          mma16816(acc[nt + 1], fa, b2, b3);
        }
      }
      /* acc = kinv_j (w (D dH^T) + Ps^T qn)_j: divide kinv_j out */
      const float n0 = 1.f / sKinv[jb + grp], n1 = 1.f / sKinv[jb + grp + 8];
      const int64_t o = CHi * C * K + (int64_t)(jb + grp) * K + rb;
      {
        bf16 *out = reinterpret_cast<bf16 *>(go.dKnA) + o;
        uint32_t w0[NT], w1[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
          w0[nt] = pack_bf16(acc[nt][0] * n0, acc[nt][1] * n0);
          w1[nt] = pack_bf16(acc[nt][2] * n1, acc[nt][3] * n1);
        }
        st_row_pairs<NT>(out, w0, tig, true);
        st_row_pairs<NT>(out + 8 * K, w1, tig, true);
      }
    }
    {
      /* <dH, h>: this thread's h^T vectors (the reload above) against the same vectors of
       * dH^T, still in shared memory (h^T replaces them only after the barrier below).
       * Per thread u ascending, then the four pairs; the products of two bf16 values are exact in float32. */
      float dot = 0.f;
#pragma unroll
      for (int u = 0; u < perH; u++) {
        const int e = u * 256 + tid;
        if (!hvec) break;
        const int x = (8 * e) / K, r = (8 * e) % K;
        const uint4 dv = *reinterpret_cast<const uint4 *>(smem + L::oHb + (x * L::ldK + r) * 2);
        const SV hu = h_vec(u, false);
        const uint32_t hw[4] = {hu.x, hu.y, hu.z, hu.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
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
#pragma unroll
  for (int u = 0; u < perH; u++) {
    const int e = u * 256 + tid;
    if (!hvec) break;
    const int x = (kEPV * e) / K, r = (kEPV * e) % K;
    *reinterpret_cast<uint4 *>(smem + L::oHb + (x * L::ldK + r) * 2) = h_vec(u, true);
  }
  cp_async_wait<0>(); /* dD, read from P3b on */
  __syncthreads();

  /* ---- P3b: dWg = -dD h^T per (16 steps x PK key columns) */
  for (int item = warp; item < (C / 16) * GK; item += 8) {
    const int jb = (item / GK) * 16, rb = (item % GK) * PK;
    {
      float acc[NT][4] = {};
#pragma unroll
      for (int kt = 0; kt < V / 16; kt++) {
        uint32_t fa[4];
        ldsm_x4(s0 + L::odD + ((jb + arow) * L::ldV + kt * 16 + acol) * 2, fa[0], fa[1], fa[2], fa[3]);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(s0 + L::oHb + ((kt * 16 + trow) * L::ldK + rb + nt * 8 + tcol) * 2, b0, b1, b2, b3);
          mma16816(acc[nt], fa, b0, b1);
          mma16816(acc[nt + 1], fa, b2, b3);
        }
      }
      bf16 *out = go.dWg + CHi * C * K + (int64_t)(jb + grp) * K + rb;
      uint32_t w0[NT], w1[NT];
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        w0[nt] = pack_bf16(-acc[nt][0], -acc[nt][1]);
        w1[nt] = pack_bf16(-acc[nt][2], -acc[nt][3]);
      }
      st_row_pairs<NT>(out, w0, tig, true);
      st_row_pairs<NT>(out + 8 * K, w1, tig, true);
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
}

}  // namespace chunked_backward
}  // namespace gdpcu

#endif
