/*
 * gdp_bwd.cu -- backward of the Gated DeltaProduct operator on CUDA.
 *
 *  - recurrent: the oracle's reverse sweep (DESIGN.md section 2) per (sequence, head,
 *    32 value columns): checkpoints every ~sqrt(L) tokens, each segment recomputed
 *    into a per-block trajectory in global memory, then walked backwards.  Reductions
 *    over the value axis (dq, dk, dbeta, dg) are summed across column blocks with float
 *    atomics, then a finalize kernel applies the l2-norm backward and the dtype.
 *  - chunk (bf16): recompute (prep + state pass storing the chunk-start states h and
 *    D = U - W h), then a reverse state-gradient pass (sequential over chunks, parallel
 *    over value blocks): dD = Pm^T dO + Kd dH, dH <- e^{last} dH + Qd^T dO - W^T dD,
 *    storing dH (gradient of the chunk-end state) and dD; then one kernel per (chunk,
 *    head) computes every gradient of the chunk: the query-side terms on the TC query
 *    rows only, the WY backward through T = (I + A)^-1, the gate gradient as an
 *    in-chunk reverse cumulative sum, and the l2-norm backward.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "gdp_chunk.cuh"

namespace gdpcu {

/* ------------------------------------------------------------------ recurrent backward */

template <int RPT>
__device__ __forceinline__ float *slot_ptr(float *base, int slot, int i, int cc) {
  return base + (((int64_t)slot * RPT + i) * 8 + cc) * 128 + threadIdx.x;
}

template <typename T, int RPT>
__device__ __forceinline__ void load_row_norm(const T *x, int64_t row, int K, int lane, int l2norm,
                                              float (&out)[RPT]) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < RPT; i++) {
    const int r = lane + 32 * i;
    out[i] = r < K ? to_f(x[row * K + r]) : 0.f;
    ss += out[i] * out[i];
  }
  if (l2norm) {
    const float inv = rsqrtf(warp_sum(ss) + kNormEps);
#pragma unroll
    for (int i = 0; i < RPT; i++) out[i] *= inv;
  }
}

/* One Householder step S <- S + k (b (v - S^T k))^T on this thread's tile. */
template <typename T, int RPT>
__device__ __forceinline__ void rec_step(const GdpArgs &a, float (&S)[RPT][8], int64_t row, int c0,
                                         int lane) {
  float kr[RPT];
  load_row_norm<T, RPT>((const T *)a.k, row, a.K, lane, a.l2norm, kr);
  const float b = to_f(((const T *)a.beta)[row]);
#pragma unroll
  for (int cc = 0; cc < 8; cc++) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < RPT; i++) acc += S[i][cc] * kr[i];
    const float u = warp_sum(acc);
    const int c = c0 + cc;
    const float vv = c < a.V ? to_f(((const T *)a.v)[row * a.V + c]) : 0.f;
    const float d = b * (vv - u);
#pragma unroll
    for (int i = 0; i < RPT; i++) S[i][cc] += kr[i] * d;
  }
}

template <typename T, int RPT>
__global__ __launch_bounds__(128) void rec_bwd_kernel(GdpArgs a, float *scratch, int seg,
                                                      int nseg_max, float *acc_dq, float *acc_dk,
                                                      float *acc_db, float *acc_dg) {
  const int s = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c0 = blockIdx.z * 32 + warp * 8;
  const int H = a.H, K = a.K, V = a.V, n = a.n;
  const T *g = (const T *)a.g, *d_o = (const T *)a.d_o, *beta = (const T *)a.beta,
          *v = (const T *)a.v;
  T *dv = (T *)a.dv;
  const int64_t bid = ((int64_t)s * H + h) * gridDim.z + blockIdx.z;
  const int64_t slot_floats = (int64_t)RPT * 8 * 128;
  float *ck = scratch + bid * (nseg_max + (int64_t)seg * (n + 1)) * slot_floats;
  float *tr = ck + (int64_t)nseg_max * slot_floats;
  const int64_t soff = ((int64_t)s * H + h) * K * V;
  float S[RPT][8], dS[RPT][8], X[RPT][8];
#pragma unroll
  for (int i = 0; i < RPT; i++)
#pragma unroll
    for (int cc = 0; cc < 8; cc++) {
      const int r = lane + 32 * i, c = c0 + cc;
      const bool ok = r < K && c < V;
      S[i][cc] = (a.h0 && ok) ? a.h0[soff + (int64_t)r * V + c] : 0.f;
      dS[i][cc] = (a.dht && ok) ? a.dht[soff + (int64_t)r * V + c] : 0.f;
    }
  const long long bos = a.cu[s], eos = a.cu[s + 1];
  const int64_t L = eos - bos;
  const int64_t nseg = (L + seg - 1) / seg;
  auto store = [&](float(&M)[RPT][8], int slot, float *base) {
#pragma unroll
    for (int i = 0; i < RPT; i++)
#pragma unroll
      for (int cc = 0; cc < 8; cc++) *slot_ptr<RPT>(base, slot, i, cc) = M[i][cc];
  };
  auto load = [&](float(&M)[RPT][8], int slot, float *base) {
#pragma unroll
    for (int i = 0; i < RPT; i++)
#pragma unroll
      for (int cc = 0; cc < 8; cc++) M[i][cc] = *slot_ptr<RPT>(base, slot, i, cc);
  };
  auto decay = [&](float(&M)[RPT][8], long long t) {
    if (!g) return;
    const float d = __expf(to_f(g[t * H + h]));
#pragma unroll
    for (int i = 0; i < RPT; i++)
#pragma unroll
      for (int cc = 0; cc < 8; cc++) M[i][cc] *= d;
  };
  /* forward sweep: checkpoint m = state before token bos + m*seg */
  for (int64_t m = 0; m < nseg; m++) {
    store(S, (int)m, ck);
    if (m + 1 == nseg) break;
    for (long long t = bos + m * seg; t < bos + (m + 1) * seg; t++) {
      decay(S, t);
      for (int j = 0; j < n; j++) rec_step<T, RPT>(a, S, (t * n + j) * H + h, c0, lane);
    }
  }
  for (int64_t m = nseg - 1; m >= 0; m--) {
    const long long t0 = bos + m * seg, t1 = std::min<long long>(t0 + seg, eos);
    load(S, (int)m, ck);
    for (long long t = t0; t < t1; t++) {
      const int base = (int)(t - t0) * (n + 1);
      decay(S, t);
      for (int j = 0; j < n; j++) {
        store(S, base + j, tr);
        rec_step<T, RPT>(a, S, (t * n + j) * H + h, c0, lane);
      }
      store(S, base + n, tr);
    }
    for (long long t = t1 - 1; t >= t0; t--) {
      const int base = (int)(t - t0) * (n + 1);
      /* o_t = scale S_t^T q_t */
      load(X, base + n, tr);
      float qn[RPT];
      load_row_norm<T, RPT>((const T *)a.q, t * H + h, K, lane, a.l2norm, qn);
      float dOc[8];
#pragma unroll
      for (int cc = 0; cc < 8; cc++) dOc[cc] = (c0 + cc < V) ? to_f(d_o[(t * H + h) * V + c0 + cc]) : 0.f;
#pragma unroll
      for (int i = 0; i < RPT; i++) {
        float acc = 0.f;
#pragma unroll
        for (int cc = 0; cc < 8; cc++) {
          acc += X[i][cc] * dOc[cc];
          dS[i][cc] += a.scale * qn[i] * dOc[cc];
        }
        const int r = lane + 32 * i;
        if (r < K) atomicAdd(acc_dq + (t * H + h) * K + r, a.scale * acc);
      }
      for (int j = n - 1; j >= 0; j--) {
        const int64_t row = (t * n + j) * H + h;
        load(X, base + j, tr); /* S_{t,j} */
        float kn[RPT];
        load_row_norm<T, RPT>((const T *)a.k, row, K, lane, a.l2norm, kn);
        const float b = to_f(beta[row]);
        float vu[8], dd[8], db = 0.f;
#pragma unroll
        for (int cc = 0; cc < 8; cc++) {
          float au = 0.f, ad = 0.f;
#pragma unroll
          for (int i = 0; i < RPT; i++) au += X[i][cc] * kn[i], ad += dS[i][cc] * kn[i];
          const float u = warp_sum(au);
          dd[cc] = warp_sum(ad);
          const int c = c0 + cc;
          vu[cc] = (c < V ? to_f(v[row * V + c]) : 0.f) - u;
          db += dd[cc] * vu[cc];
          if (lane == cc && c < V) dv[row * V + c] = from_f<T>(b * dd[cc]);
        }
        if (lane == 0) atomicAdd(acc_db + row, db);
#pragma unroll
        for (int i = 0; i < RPT; i++) {
          float acc = 0.f;
#pragma unroll
          for (int cc = 0; cc < 8; cc++) {
            acc += b * (dS[i][cc] * vu[cc] - X[i][cc] * dd[cc]);
            dS[i][cc] -= kn[i] * b * dd[cc];
          }
          const int r = lane + 32 * i;
          if (r < K) atomicAdd(acc_dk + row * K + r, acc);
        }
      }
      if (g) { /* X = S_{t,0} = e^{g} S_{t-1}:  dg = <dS, S_{t,0}>,  dS <- e^{g} dS */
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < RPT; i++)
#pragma unroll
          for (int cc = 0; cc < 8; cc++) acc += dS[i][cc] * X[i][cc];
        acc = warp_sum(acc);
        if (lane == 0) atomicAdd(acc_dg + t * H + h, acc);
        decay(dS, t);
      }
    }
  }
  if (a.dh0) {
#pragma unroll
    for (int i = 0; i < RPT; i++)
#pragma unroll
      for (int cc = 0; cc < 8; cc++) {
        const int r = lane + 32 * i, c = c0 + cc;
        if (r < K && c < V) a.dh0[soff + (int64_t)r * V + c] = dS[i][cc];
      }
  }
}

/* dx = r (dxn - xn (xn . dxn)) per row (warp per row), then the dtype. */
template <typename T>
__global__ void rec_finalize_kernel(GdpArgs a, int64_t T_total, const float *acc_dq,
                                    const float *acc_dk, const float *acc_db, const float *acc_dg) {
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  const int64_t qrows = T_total * a.H, krows = T_total * a.n * a.H;
  const int K = a.K;
  for (int64_t w = warp0; w < qrows + krows; w += nwarps) {
    const bool isq = w < qrows;
    const int64_t row = isq ? w : w - qrows;
    const T *x = (const T *)(isq ? a.q : a.k);
    const float *dxn = isq ? acc_dq : acc_dk;
    T *dx = (T *)(isq ? a.dq : a.dk);
    float ss = 0.f, dot = 0.f;
    for (int e = lane; e < K; e += 32) {
      const float xv = to_f(x[row * K + e]);
      ss += xv * xv;
      dot += xv * dxn[row * K + e];
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const float inv = a.l2norm ? rsqrtf(ss + kNormEps) : 1.f;
    for (int e = lane; e < K; e += 32) {
      const float d = dxn[row * K + e];
      dx[row * K + e] = from_f<T>(a.l2norm ? inv * (d - to_f(x[row * K + e]) * inv * inv * dot) : d);
    }
  }
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x,
                nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = tid; i < krows; i += nth) ((T *)a.dbeta)[i] = from_f<T>(acc_db[i]);
  if (a.dg)
    for (int64_t i = tid; i < qrows; i += nth) ((T *)a.dg)[i] = from_f<T>(acc_dg[i]);
}

template <typename T>
static gdp_status rec_backward(const gdp_gdp_problem *p, GdpArgs a, cudaStream_t stream) {
  int64_t Lmax = 0;
  for (int64_t s = 0; s < p->N; s++) Lmax = std::max<int64_t>(Lmax, p->cu_seqlens[s + 1] - p->cu_seqlens[s]);
  const int seg = std::max(1, (int)ceil(sqrt((double)std::max<int64_t>(Lmax, 1))));
  const int nseg_max = (int)std::max<int64_t>(1, (Lmax + seg - 1) / seg);
  const int RPT = a.K <= 64 ? 2 : a.K <= 128 ? 4 : 8;
  const int zb = (a.V + 31) / 32;
  const int64_t blocks = p->N * a.H * zb;
  const int64_t per_block = (nseg_max + (int64_t)seg * (a.n + 1)) * RPT * 8 * 128;
  const int64_t TT = p->T_total;
  const int64_t n_dq = TT * a.H * a.K, n_dk = TT * a.n * a.H * a.K, n_db = TT * a.n * a.H, n_dg = TT * a.H;
  const size_t bytes = (size_t)(blocks * per_block + n_dq + n_dk + n_db + n_dg + 64) * sizeof(float);
  void *block = nullptr;
  GDP_TRY(device_alloc(&block, bytes + ((size_t)p->N + 1) * sizeof(long long) + 256, stream));
  float *scratch = (float *)block;
  float *acc_dq = scratch + blocks * per_block, *acc_dk = acc_dq + n_dq, *acc_db = acc_dk + n_dk,
        *acc_dg = acc_db + n_db;
  long long *cu = (long long *)(((uintptr_t)(acc_dg + n_dg) + 255) & ~(uintptr_t)255);
  gdp_status st = upload_cu_seqlens(p, cu, stream);
  a.cu = cu;
  if (st == GDP_OK) {
    cudaError_t e = cudaMemsetAsync(acc_dq, 0, (size_t)(n_dq + n_dk + n_db + n_dg) * sizeof(float), stream);
    if (e != cudaSuccess) st = GDP_ERROR(GDP_ERR_CUDA, "cudaMemsetAsync: %s", cudaGetErrorString(e));
  }
  if (st == GDP_OK) {
    const dim3 grid((unsigned)p->N, (unsigned)a.H, (unsigned)zb);
    if (RPT == 2) rec_bwd_kernel<T, 2><<<grid, 128, 0, stream>>>(a, scratch, seg, nseg_max, acc_dq, acc_dk, acc_db, acc_dg);
    else if (RPT == 4) rec_bwd_kernel<T, 4><<<grid, 128, 0, stream>>>(a, scratch, seg, nseg_max, acc_dq, acc_dk, acc_db, acc_dg);
    else rec_bwd_kernel<T, 8><<<grid, 128, 0, stream>>>(a, scratch, seg, nseg_max, acc_dq, acc_dk, acc_db, acc_dg);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) st = GDP_ERROR(GDP_ERR_CUDA, "launch of rec_bwd_kernel: %s", cudaGetErrorString(e));
  }
  if (st == GDP_OK && TT > 0) {
    const int64_t rows = TT * a.H * (1 + a.n);
    const unsigned nb = (unsigned)std::min<int64_t>(4096, (rows * 32 + 255) / 256);
    rec_finalize_kernel<T><<<nb, 256, 0, stream>>>(a, TT, acc_dq, acc_dk, acc_db, acc_dg);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) st = GDP_ERROR(GDP_ERR_CUDA, "launch of rec_finalize_kernel: %s", cudaGetErrorString(e));
  }
  cudaFreeAsync(block, stream);
  return st;
}

/* ------------------------------------------------------------------ reverse state-gradient pass */

struct DStateLayout {
  size_t dH32, dHb0, dHb1, dDb, ndDb, wst, stage0, stage_bytes, oPm, oKd, oQd, oW, odO, total;
};
__host__ __device__ inline DStateLayout dstate_layout(int K, int C, int TC, int BV, int nst) {
  DStateLayout L;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t o = off;
    off = align128(off + bytes);
    return o;
  };
  L.dH32 = take((size_t)K * ldf32(BV) * 4);
  L.dHb0 = take((size_t)K * ldb16(BV) * 2);
  L.dHb1 = take((size_t)K * ldb16(BV) * 2);
  L.dDb = take((size_t)C * ldb16(BV) * 2);
  L.ndDb = take((size_t)C * ldb16(BV) * 2);
  L.wst = take((size_t)(kChunkThreads / 32) * 320 * 4);
  L.stage0 = off;
  size_t so = 0;
  auto stake = [&](size_t bytes) {
    size_t o = so;
    so = align128(so + bytes);
    return o;
  };
  L.oPm = stake((size_t)TC * ldb16(C) * 2);
  L.oKd = stake((size_t)C * ldb16(K) * 2);
  L.oQd = stake((size_t)TC * ldb16(K) * 2);
  L.oW = stake((size_t)C * ldb16(K) * 2);
  L.odO = stake((size_t)TC * ldb16(BV) * 2);
  L.stage_bytes = so;
  L.total = off + (size_t)nst * so;
  return L;
}
inline int dstate_stages(int K, int C, int TC, int BV, int optin) {
  return (int)dstate_layout(K, C, TC, BV, 3).total <= optin ? 3 : 2;
}

template <int BV>
__global__ __launch_bounds__(kChunkThreads, 1) void chunk_dstate_kernel(GdpArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * BV;
  const int C = a.C, TC = a.TC, K = a.K, V = a.V, H = a.H;
  const int ldK = ldb16(K), ldC = ldb16(C), ldB = ldb16(BV), ldS = ldf32(BV);
  const int nst = a.nstages;
  const DStateLayout L = dstate_layout(K, C, TC, BV, nst);
  float *dH32 = (float *)(smem + L.dH32);
  bf16 *const dHb0 = (bf16 *)(smem + L.dHb0), *const dHb1 = (bf16 *)(smem + L.dHb1);
  bf16 *dDb = (bf16 *)(smem + L.dDb), *ndDb = (bf16 *)(smem + L.ndDb);
  const int tid = threadIdx.x, warp = tid >> 5;
  float *wst = (float *)(smem + L.wst) + warp * 320;
  const int cbeg = a.choff[s], nc = a.choff[s + 1] - cbeg;
  const int64_t soff = ((int64_t)s * H + h) * K * V;
  const bf16 *d_o = (const bf16 *)a.d_o;
  const bf16 *gPm = a.Pm, *gKd = a.Kd, *gQd = a.Qd, *gW = a.W;
  const float *gel = a.elast;
  const ChunkInfo *chunks = a.chunks;
  bf16 *dDbuf = a.dDbuf, *dHbuf = a.dHbuf;

  for (int e = tid; e < K * BV; e += blockDim.x) {
    const int r = e / BV, x = e % BV;
    const float v0 = a.dht ? a.dht[soff + (int64_t)r * V + col0 + x] : 0.f;
    dH32[r * ldS + x] = v0;
    dHb0[r * ldB + x] = __float2bfloat16(v0);
  }
  /* iteration it handles chunk cbeg + nc - 1 - it (reverse), in stage it % nst */
  auto issue = [=](int it) {
    unsigned char *stg = smem + L.stage0 + (size_t)(it % nst) * L.stage_bytes;
    const int c = cbeg + nc - 1 - it;
    const int64_t base = (int64_t)c * H + h;
    const ChunkInfo ci = chunks[c];
    load_tile_async((bf16 *)(stg + L.oPm), ldC, gPm + base * TC * C, C, TC, C, TC);
    load_tile_async((bf16 *)(stg + L.oKd), ldK, gKd + base * C * K, K, C, K, C);
    load_tile_async((bf16 *)(stg + L.oQd), ldK, gQd + base * TC * K, K, TC, K, TC);
    load_tile_async((bf16 *)(stg + L.oW), ldK, gW + base * C * K, K, C, K, C);
    load_tile_async((bf16 *)(stg + L.odO), ldB, d_o + ((int64_t)ci.t0 * H + h) * V + col0,
                    (int64_t)H * V, TC, BV, ci.ntok);
  };
  for (int it = 0; it < nst - 1; it++) {
    if (it < nc) issue(it);
    cp_async_commit();
  }
  for (int it = 0; it < nc; it++) {
    const int c = cbeg + nc - 1 - it;
    const int64_t CHi = (int64_t)c * H + h;
    const float el = gel[CHi];
    bf16 *const dHcur = (it & 1) ? dHb1 : dHb0;
    bf16 *const dHnxt = (it & 1) ? dHb0 : dHb1;
    if (nst == 3) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();
    if (it + nst - 1 < nc) issue(it + nst - 1);
    cp_async_commit();
    const unsigned char *stg = smem + L.stage0 + (size_t)(it % nst) * L.stage_bytes;
    const bf16 *Pm = (const bf16 *)(stg + L.oPm), *Kd = (const bf16 *)(stg + L.oKd),
               *Qd = (const bf16 *)(stg + L.oQd), *W = (const bf16 *)(stg + L.oW),
               *dO = (const bf16 *)(stg + L.odO);
    {
      bf16 *gdh = dHbuf + CHi * K * V + col0;
      for (int e = tid; e < K * BV; e += blockDim.x) gdh[(int64_t)(e / BV) * V + e % BV] = dHcur[(e / BV) * ldB + e % BV];
    }
    /* dD = Pm^T dO + Kd dH */
    for (int tile = warp; tile < (C / 16) * (BV / 16); tile += 8) {
      const int tm = tile / (BV / 16), tn = tile % (BV / 16);
      FragC f;
      wmma::fill_fragment(f, 0.f);
      frag_mac<true, false>(f, Pm, ldC, dO, ldB, tm, tn, TC);
      frag_mac<false, false>(f, Kd, ldK, dHcur, ldB, tm, tn, K);
      frag_epilogue(f, wst, tm, tn, [=](int i, int x, float val) {
        dDb[i * ldB + x] = __float2bfloat16(val);
        ndDb[i * ldB + x] = __float2bfloat16(-val);
        dDbuf[(CHi * C + i) * V + col0 + x] = __float2bfloat16(val);
      });
    }
    __syncthreads();
    /* dH <- e^{last} dH + Qd^T dO - W^T dD */
    for (int tile = warp; tile < (K / 16) * (BV / 16); tile += 8) {
      const int tm = tile / (BV / 16), tn = tile % (BV / 16);
      FragC f;
      wmma::fill_fragment(f, 0.f);
      frag_mac<true, false>(f, Qd, ldK, dO, ldB, tm, tn, TC);
      frag_mac<true, false>(f, W, ldK, ndDb, ldB, tm, tn, C);
      frag_epilogue(f, wst, tm, tn, [=](int r, int x, float val) {
        const float nd = el * dH32[r * ldS + x] + val;
        dH32[r * ldS + x] = nd;
        dHnxt[r * ldB + x] = __float2bfloat16(nd);
      });
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if (a.dh0)
    for (int e = tid; e < K * BV; e += blockDim.x)
      a.dh0[soff + (int64_t)(e / BV) * V + col0 + e % BV] = dH32[(e / BV) * ldS + e % BV];
}

/* ------------------------------------------------------------------ per-chunk gradients */

/* Row/column sums of an epilogue: f(row, col, value) returns (a, b); rowA += sum_row a,
 * rowB += sum_row b, colNegB -= sum_col b (any may be NULL).  Element e = lane + 32 m
 * of the 16x16 tile is (row 2m + lane/16, col lane%16), so a row is one half-warp. */
template <class F>
__device__ __forceinline__ void frag_epilogue_sums(const FragC &c, float *stage, int tm, int tn, F &&f,
                                                   float *rowA, float *rowB, float *colNegB) {
  wmma::store_matrix_sync(stage, c, 20, wmma::mem_row_major);
  __syncwarp();
  const int lane = threadIdx.x & 31;
  float colacc = 0.f;
#pragma unroll
  for (int m = 0; m < 8; m++) {
    const int r = 2 * m + (lane >> 4), cc = lane & 15;
    const float2 v = f(tm * 16 + r, tn * 16 + cc, stage[r * 20 + cc]);
    float sa = v.x, sb = v.y;
    colacc += sb;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
      sa += __shfl_xor_sync(0xffffffffu, sa, o);
      sb += __shfl_xor_sync(0xffffffffu, sb, o);
    }
    if ((lane & 15) == 0) {
      if (rowA) atomicAdd(rowA + tm * 16 + r, sa);
      if (rowB) atomicAdd(rowB + tm * 16 + r, sb);
    }
  }
  if (colNegB) {
    colacc += __shfl_xor_sync(0xffffffffu, colacc, 16);
    if (lane < 16) atomicAdd(colNegB + tn * 16 + lane, -colacc);
  }
  __syncwarp();
}

struct GradLayout {
  size_t Kn, Dl, dD, SB, Tb, PB1, dKn, wst, vbeta, vgp, vgc, dgc, dbeta, zacc, scal;
  size_t slotA, slotQ, slotO, slotB; /* early region (overlaid later) */
  size_t total;
};
__host__ __device__ inline GradLayout grad_layout(int K, int V, int C, int TC) {
  GradLayout L;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t o = off;
    off = align128(off + bytes);
    return o;
  };
  const size_t sb1 = (size_t)K * ldb16(V) * 2, sb2 = (size_t)C * (ldb16(V) + ldb16(K)) * 2 + 128;
  L.Kn = take((size_t)C * ldb16(K) * 2);
  L.Dl = take((size_t)C * ldb16(V) * 2);
  L.dD = take((size_t)C * ldb16(V) * 2);
  L.SB = take(sb1 > sb2 ? sb1 : sb2);
  L.Tb = take((size_t)C * ldb16(C) * 2);
  L.PB1 = take((size_t)C * ldb16(C) * 2);
  L.dKn = take((size_t)C * ldf32(K) * 4);
  L.wst = take((size_t)(kChunkThreads / 32) * 320 * 4);
  L.vbeta = take((size_t)C * 4);
  L.vgp = take((size_t)C * 4);
  L.vgc = take((size_t)C * 4);
  L.dgc = take((size_t)C * 4);
  L.dbeta = take((size_t)C * 4);
  L.zacc = take((size_t)C * 4);
  L.scal = take(16);
  const size_t a1 = (size_t)C * ldf32(C) * 4, a2 = (size_t)C * ldb16(K) * 2;
  L.slotA = take(a1 > a2 ? a1 : a2);
  L.slotQ = take((size_t)TC * ldb16(K) * 2);
  L.slotO = take((size_t)TC * ldb16(V) * 2);
  const size_t b1 = (size_t)2 * C * ldf32(C) * 4, b2 = (size_t)TC * ldf32(K) * 4;
  size_t slotB = b1 > b2 ? b1 : b2;
  /* phase 7 puts Xb [C][C] bf16 and KK [C][C] f32 over slotQ .. the end of slotB */
  const size_t late = align128((size_t)C * ldb16(C) * 2) + (size_t)C * ldf32(C) * 4;
  const size_t have = (off - L.slotQ) + slotB;
  if (have < late) slotB += late - have;
  L.slotB = take(slotB);
  L.total = off;
  return L;
}

__global__ __launch_bounds__(kChunkThreads, 1) void chunk_grad_kernel(GdpArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int c = blockIdx.x, h = blockIdx.y;
  const ChunkInfo ci = a.chunks[c];
  const int C = a.C, TC = a.TC, K = a.K, V = a.V, n = a.n, H = a.H;
  const int nv = ci.ntok * n;
  const int ldK = ldb16(K), ldV = ldb16(V), ldC = ldb16(C), ldF = ldf32(C), ldFK = ldf32(K);
  const GradLayout L = grad_layout(K, V, C, TC);
  bf16 *Kn = (bf16 *)(smem + L.Kn), *Dl = (bf16 *)(smem + L.Dl), *dD = (bf16 *)(smem + L.dD),
       *SB = (bf16 *)(smem + L.SB), *Tb = (bf16 *)(smem + L.Tb), *PB1 = (bf16 *)(smem + L.PB1);
  float *dKn = (float *)(smem + L.dKn);
  float *vbeta = (float *)(smem + L.vbeta), *vgp = (float *)(smem + L.vgp), *vgc = (float *)(smem + L.vgc),
        *dgc = (float *)(smem + L.dgc), *vdb = (float *)(smem + L.dbeta), *zacc = (float *)(smem + L.zacc),
        *scal = (float *)(smem + L.scal);
  /* early region */
  float *A = (float *)(smem + L.slotA);  /* P1-P3 */
  bf16 *dWb = (bf16 *)(smem + L.slotA); /* P4-P7 */
  bf16 *Qn = (bf16 *)(smem + L.slotQ), *dO = (bf16 *)(smem + L.slotO);
  float *QK = (float *)(smem + L.slotB), *DP = QK + (size_t)C * ldF; /* P1-P2 */
  float *Tm = (float *)(smem + L.slotB);                             /* P3 */
  float *F2 = (float *)(smem + L.slotB);                             /* P4-P5 */
  bf16 *Xb = (bf16 *)(smem + L.slotQ);                               /* P7 */
  float *KK = (float *)(smem + L.slotQ + align128((size_t)C * ldC * 2));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  float *wst = (float *)(smem + L.wst) + warp * 320;
  const bf16 *q = (const bf16 *)a.q, *k = (const bf16 *)a.k, *v = (const bf16 *)a.v,
             *g = (const bf16 *)a.g, *beta = (const bf16 *)a.beta, *d_o = (const bf16 *)a.d_o;
  const int64_t CHi = (int64_t)c * H + h;
  const int64_t krow0 = (int64_t)ci.t0 * n; /* first step row of the chunk */

  /* ---- P0: loads */
  load_tile_async(Dl, ldV, a.Dbuf + CHi * C * V, V, C, V, C);
  load_tile_async(dD, ldV, a.dDbuf + CHi * C * V, V, C, V, C);
  load_tile_async(SB, ldV, a.hbuf + CHi * K * V, V, K, V, K);
  load_tile_async(dO, ldV, d_o + ((int64_t)ci.t0 * H + h) * V, (int64_t)H * V, TC, V, ci.ntok);
  cp_async_commit();
  float xk[8][4], xq[4][4];
  warp_load_rows<8>(k + (krow0 * H + h) * K, (int64_t)H * K, nv, K, xk);
  warp_load_rows<4>(q + ((int64_t)ci.t0 * H + h) * K, (int64_t)H * K, ci.ntok, K, xq);
  for (int i = tid; i < C; i += blockDim.x) {
    const bool ok = i < nv;
    const int64_t row = (krow0 + i) * H + h;
    vbeta[i] = ok ? to_f(beta[row]) : 0.f;
    vgp[i] = (ok && g && i % n == 0) ? to_f(g[((int64_t)ci.t0 + i / n) * H + h]) : 0.f;
    dgc[i] = 0.f;
    vdb[i] = 0.f;
    zacc[i] = 0.f;
  }
  if (tid == 0) scal[0] = 0.f;
  __syncthreads();
  if (tid < C) {
    float acc = 0.f;
    for (int m = 0; m <= tid; m++) acc += vgp[m];
    vgc[tid] = acc;
  }
#pragma unroll
  for (int r = 0; r < 8; r++) {
    const int i = warp + 8 * r;
    if (i >= C) break;
    float ss = 0.f;
#pragma unroll
    for (int m = 0; m < 4; m++) ss += xk[r][m] * xk[r][m];
    const float inv = a.l2norm ? rsqrtf(warp_sum(ss) + kNormEps) : 1.f;
#pragma unroll
    for (int m = 0; m < 4; m++) {
      const int e = lane + 32 * m;
      if (e < K) Kn[i * ldK + e] = __float2bfloat16(xk[r][m] * inv);
    }
  }
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int qa = warp + 8 * r;
    if (qa >= TC) break;
    float ss = 0.f;
#pragma unroll
    for (int m = 0; m < 4; m++) ss += xq[r][m] * xq[r][m];
    const float inv = a.l2norm ? rsqrtf(warp_sum(ss) + kNormEps) : 1.f;
#pragma unroll
    for (int m = 0; m < 4; m++) {
      const int e = lane + 32 * m;
      if (e < K) Qn[qa * ldK + e] = __float2bfloat16(xq[r][m] * inv);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  const float last = vgc[C - 1], elast = __expf(last);
  const float scale = a.scale;

  /* ---- P1: A (strictly lower), QK = Qn Kn^T, DP = dO D^T */
  {
    const int nt = C / 16, tA = nt * nt, tQ = (TC / 16) * nt;
    for (int tile = warp; tile < tA + 2 * tQ; tile += 8) {
      FragC f;
      wmma::fill_fragment(f, 0.f);
      if (tile < tA) {
        const int tm = tile / nt, tn = tile % nt;
        if (tn <= tm) frag_mac<false, true>(f, Kn, ldK, Kn, ldK, tm, tn, K);
        frag_epilogue(f, wst, tm, tn, [&](int i, int j, float val) {
          A[i * ldF + j] = i > j ? vbeta[i] * __expf(vgc[i] - vgc[j]) * val : 0.f;
        });
      } else if (tile < tA + tQ) {
        const int t2 = tile - tA, tm = t2 / nt, tn = t2 % nt;
        frag_mac<false, true>(f, Qn, ldK, Kn, ldK, tm, tn, K);
        frag_epilogue(f, wst, tm, tn, [&](int qa, int j, float val) { QK[qa * ldF + j] = val; });
      } else {
        const int t2 = tile - tA - tQ, tm = t2 / nt, tn = t2 % nt;
        frag_mac<false, true>(f, dO, ldV, Dl, ldV, tm, tn, V);
        frag_epilogue(f, wst, tm, tn, [&](int qa, int j, float val) { DP[qa * ldF + j] = val; });
      }
    }
  }
  __syncthreads();

  /* ---- P2: Ps = scale e^{gc_ia - gc_j} DP (j <= ia) -> PB1; dgc_j -= sum_a Ps QK */
  for (int e = tid; e < TC * C; e += blockDim.x) {
    const int qa = e / C, j = e % C, ia = qa * n + n - 1;
    const float ps = j <= ia ? scale * __expf(vgc[ia] - vgc[j]) * DP[qa * ldF + j] : 0.f;
    PB1[qa * ldC + j] = __float2bfloat16(ps);
  }
  if (tid < C) {
    const int j = tid;
    float acc = 0.f;
    for (int qa = 0; qa < TC; qa++) {
      const int ia = qa * n + n - 1;
      if (j <= ia) acc += scale * __expf(vgc[ia] - vgc[j]) * DP[qa * ldF + j] * QK[qa * ldF + j];
    }
    dgc[j] -= acc;
  }
  __syncthreads();

  /* ---- P3: T = (I + A)^-1 (as in the prep kernel) -> Tb */
  for (int e = tid; e < C * C; e += blockDim.x) Tm[(e / C) * ldF + e % C] = 0.f;
  __syncthreads();
  const int NB = C / 16;
  if (warp < NB && lane < 16) {
    const int b0 = warp * 16;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
      float s = (i == lane) ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < i; j++) s -= A[(b0 + i) * ldF + b0 + j] * x[j];
      x[i] = s;
    }
#pragma unroll
    for (int i = 0; i < 16; i++) Tm[(b0 + i) * ldF + b0 + lane] = x[i];
  }
  __syncthreads();
  {
    float *Msc = (float *)(smem + L.wst);
    for (int bi = 1; bi < NB; bi++) {
      for (int e = tid; e < bi * 256; e += blockDim.x) {
        const int bj = e >> 8, r = (e >> 4) & 15, cc = e & 15;
        float m = 0.f;
        for (int kk = 16 * bj; kk < 16 * bi; kk++) m += A[(16 * bi + r) * ldF + kk] * Tm[kk * ldF + 16 * bj + cc];
        Msc[e] = m;
      }
      __syncthreads();
      for (int e = tid; e < bi * 256; e += blockDim.x) {
        const int bj = e >> 8, r = (e >> 4) & 15, cc = e & 15;
        float t = 0.f;
#pragma unroll
        for (int m2 = 0; m2 < 16; m2++) t -= Tm[(16 * bi + r) * ldF + 16 * bi + m2] * Msc[(bj << 8) + m2 * 16 + cc];
        Tm[(16 * bi + r) * ldF + 16 * bj + cc] = t;
      }
      __syncthreads();
    }
  }
  for (int e = tid; e < C * C; e += blockDim.x) Tb[(e / C) * ldC + e % C] = __float2bfloat16(Tm[(e / C) * ldF + e % C]);
  __syncthreads();

  /* ---- P4: dQn = s_a dO S0^T + Ps Kn -> F2;  dKn = Ps^T Qn;  dW = -dD S0^T -> dWb */
  {
    const int tk = K / 16, tQ = (TC / 16) * tk, tC = (C / 16) * tk;
    for (int tile = warp; tile < tQ + 2 * tC; tile += 8) {
      FragC f;
      wmma::fill_fragment(f, 0.f);
      if (tile < tQ) {
        const int tm = tile / tk, tn = tile % tk;
        frag_mac<false, true>(f, dO, ldV, SB, ldV, tm, tn, V);
        frag_epilogue(f, wst, tm, tn, [&](int qa, int r, float val) {
          F2[qa * ldFK + r] = scale * __expf(vgc[qa * n + n - 1]) * val;
        });
        wmma::fill_fragment(f, 0.f);
        frag_mac<false, false>(f, PB1, ldC, Kn, ldK, tm, tn, C);
        frag_epilogue(f, wst, tm, tn, [&](int qa, int r, float val) { F2[qa * ldFK + r] += val; });
      } else if (tile < tQ + tC) {
        const int t2 = tile - tQ, tm = t2 / tk, tn = t2 % tk;
        frag_mac<true, false>(f, PB1, ldC, Qn, ldK, tm, tn, TC);
        frag_epilogue(f, wst, tm, tn, [&](int j, int r, float val) { dKn[j * ldFK + r] = val; });
      } else {
        const int t2 = tile - tQ - tC, tm = t2 / tk, tn = t2 % tk;
        frag_mac<false, true>(f, dD, ldV, SB, ldV, tm, tn, V);
        frag_epilogue(f, wst, tm, tn, [&](int j, int r, float val) { dWb[j * ldK + r] = __float2bfloat16(-val); });
      }
    }
  }
  __syncthreads();

  /* ---- P5: dq out (+ the query-row gate term dgc_ia += qn.dqn); <dH, S0>; S0 -> dH */
  {
    /* dH of the chunk end, 16 bytes per load, all in flight; <dH, S0>; S0 -> dH */
    const uint4 *gdh = (const uint4 *)(a.dHbuf + CHi * K * V);
    const int nvec = K * V / 8;
    uint4 hv[8];
#pragma unroll
    for (int u = 0; u < 8; u++) {
      const int idx = tid + kChunkThreads * u;
      if (idx < nvec) hv[u] = gdh[idx];
    }
    float xr[4][4];
    warp_load_rows<4>(q + ((int64_t)ci.t0 * H + h) * K, (int64_t)H * K, ci.ntok, K, xr);
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < 8; u++) {
      const int idx = tid + kChunkThreads * u;
      if (idx < nvec) {
        const int r = (idx * 8) / V, x = (idx * 8) % V;
        uint4 *dst = (uint4 *)(SB + r * ldV + x);
        const uint4 s0 = *dst;
        const bf16 *pd = (const bf16 *)&hv[u], *ps = (const bf16 *)&s0;
#pragma unroll
        for (int w = 0; w < 8; w++) acc += __bfloat162float(pd[w]) * __bfloat162float(ps[w]);
        *dst = hv[u];
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) atomicAdd(scal, elast * acc);
    /* dq out (+ the query-row gate term dgc_ia += qn . dqn) */
    bf16 *dq = (bf16 *)a.dq;
#pragma unroll
    for (int rr = 0; rr < 4; rr++) {
      const int qa = warp + 8 * rr;
      if (qa >= ci.ntok) break;
      const int64_t row = ((int64_t)ci.t0 + qa) * H + h;
      float d[4], ss = 0.f;
#pragma unroll
      for (int m = 0; m < 4; m++) {
        const int e = lane + 32 * m;
        d[m] = e < K ? F2[qa * ldFK + e] : 0.f;
        ss += xr[rr][m] * xr[rr][m];
      }
      const float inv = a.l2norm ? rsqrtf(warp_sum(ss) + kNormEps) : 1.f;
      float dot = 0.f;
#pragma unroll
      for (int m = 0; m < 4; m++) dot += xr[rr][m] * inv * d[m];
      dot = warp_sum(dot);
      if (lane == 0) atomicAdd(dgc + qa * n + n - 1, dot);
#pragma unroll
      for (int m = 0; m < 4; m++) {
        const int e = lane + 32 * m;
        if (e < K) dq[row * K + e] = __float2bfloat16(a.l2norm ? inv * (d[m] - xr[rr][m] * inv * dot) : d[m]);
      }
    }
  }
  __syncthreads();

  /* ---- P6: ks = D dH^T: dKn += e^{last-gc_j} ks; z_j = kn_j . that */
  {
    const int tk = K / 16;
    for (int tile = warp; tile < (C / 16) * tk; tile += 8) {
      const int tm = tile / tk, tn = tile % tk;
      FragC f;
      wmma::fill_fragment(f, 0.f);
      frag_mac<false, true>(f, Dl, ldV, SB, ldV, tm, tn, V);
      frag_epilogue_sums(f, wst, tm, tn, [&](int j, int r, float val) {
        const float w = __expf(last - vgc[j]) * val;
        dKn[j * ldFK + r] += w;
        return make_float2(__bfloat162float(Kn[j * ldK + r]) * w, 0.f);
      }, zacc, nullptr, nullptr);
    }
  }
  __syncthreads();

  /* ---- P7: WY backward */
  /* raw v by cp.async (beta is folded into the epilogues), Kg = e^{gc} kn */
  bf16 *Vr = SB, *Kg = SB + (size_t)C * ldV;
  Kg = (bf16 *)(((uintptr_t)Kg + 127) & ~(uintptr_t)127);
  load_tile_async(Vr, ldV, v + (krow0 * H + h) * V, (int64_t)H * V, C, V, nv);
  cp_async_commit();
  for (int e = tid; e < C * K; e += blockDim.x) {
    const int i = e / K, kk = e % K;
    Kg[i * ldK + kk] = __float2bfloat16(__expf(vgc[i]) * __bfloat162float(Kn[i * ldK + kk]));
  }
  cp_async_wait<0>();
  __syncthreads();
  {
    const int nt = C / 16, tk = K / 16, tv = V / 16;
    const int t1 = nt * tv, t2 = nt * tk, t3 = nt * nt, t4 = nt * nt;
    for (int tile = warp; tile < t1 + t2 + t3 + t4; tile += 8) {
      FragC f;
      wmma::fill_fragment(f, 0.f);
      if (tile < t1) { /* dVb = T^T dD: dv = beta dVb, dbeta += v . dVb */
        const int tm = tile / tv, tn = tile % tv;
        frag_mac<true, false>(f, Tb, ldC, dD, ldV, tm, tn, C);
        frag_epilogue_sums(f, wst, tm, tn, [&](int j, int x, float val) {
          if (j < nv) ((bf16 *)a.dv)[((krow0 + j) * H + h) * V + x] = __float2bfloat16(vbeta[j] * val);
          return make_float2(__bfloat162float(Vr[j * ldV + x]) * val, 0.f);
        }, vdb, nullptr, nullptr);
      } else if (tile < t1 + t2) { /* dKb = T^T dW */
        const int tt = tile - t1, tm = tt / tk, tn = tt % tk;
        frag_mac<true, false>(f, Tb, ldC, dWb, ldK, tm, tn, C);
        frag_epilogue_sums(f, wst, tm, tn, [&](int j, int r, float val) {
          const float eg = __expf(vgc[j]);
          dKn[j * ldFK + r] += vbeta[j] * eg * val;
          const float s = eg * __bfloat162float(Kn[j * ldK + r]) * val;
          return make_float2(s, vbeta[j] * s);
        }, vdb, dgc, nullptr);
      } else if (tile < t1 + t2 + t3) { /* dT = dD Vb^T + dW Kb^T = (dD V^T + dW Kg^T) diag(beta) */
        const int tt = tile - t1 - t2, tm = tt / nt, tn = tt % nt;
        frag_mac<false, true>(f, dD, ldV, Vr, ldV, tm, tn, V);
        frag_mac<false, true>(f, dWb, ldK, Kg, ldK, tm, tn, K);
        frag_epilogue(f, wst, tm, tn, [&](int i, int j, float val) { PB1[i * ldC + j] = __float2bfloat16(vbeta[j] * val); });
      } else { /* KK = Kn Kn^T */
        const int tt = tile - t1 - t2 - t3, tm = tt / nt, tn = tt % nt;
        if (tn <= tm) frag_mac<false, true>(f, Kn, ldK, Kn, ldK, tm, tn, K);
        frag_epilogue(f, wst, tm, tn, [&](int i, int j, float val) { KK[i * ldF + j] = val; });
      }
    }
  }
  __syncthreads();
  {
    const int nt = C / 16; /* X = dT T^T */
    for (int tile = warp; tile < nt * nt; tile += 8) {
      const int tm = tile / nt, tn = tile % nt;
      FragC f;
      wmma::fill_fragment(f, 0.f);
      frag_mac<false, true>(f, PB1, ldC, Tb, ldC, tm, tn, C);
      frag_epilogue(f, wst, tm, tn, [&](int i, int j, float val) { Xb[i * ldC + j] = __float2bfloat16(val); });
    }
  }
  __syncthreads();
  {
    const int nt = C / 16; /* dA = -T^T X, strictly lower; G -> PB1 */
    for (int tile = warp; tile < nt * nt; tile += 8) {
      const int tm = tile / nt, tn = tile % nt;
      FragC f;
      wmma::fill_fragment(f, 0.f);
      if (tn <= tm) frag_mac<true, false>(f, Tb, ldC, Xb, ldC, tm, tn, C);
      frag_epilogue_sums(f, wst, tm, tn, [&](int i, int j, float val) {
        if (i <= j) {
          PB1[i * ldC + j] = __float2bfloat16(0.f);
          return make_float2(0.f, 0.f);
        }
        const float da = -val, e = __expf(vgc[i] - vgc[j]), kk = KK[i * ldF + j];
        const float Aij = vbeta[i] * e * kk;
        PB1[i * ldC + j] = __float2bfloat16(da * vbeta[i] * e);
        return make_float2(da * e * kk, da * Aij);
      }, vdb, dgc, dgc);
    }
  }
  __syncthreads();
  {
    const int nt = C / 16, tk = K / 16; /* dKn += G Kn + G^T Kn */
    for (int tile = warp; tile < nt * tk; tile += 8) {
      const int tm = tile / tk, tn = tile % tk;
      FragC f;
      wmma::fill_fragment(f, 0.f);
      frag_mac<false, false>(f, PB1, ldC, Kn, ldK, tm, tn, C);
      frag_mac<true, false>(f, PB1, ldC, Kn, ldK, tm, tn, C);
      frag_epilogue(f, wst, tm, tn, [&](int j, int r, float val) { dKn[j * ldFK + r] += val; });
    }
  }
  __syncthreads();

  /* ---- P8: gate (reverse cumsum), dbeta, dk */
  if (tid == 0 && g) {
    float z = 0.f;
    for (int j = 0; j < C; j++) z += zacc[j];
    float run = 0.f;
    for (int i = C - 1; i >= 0; i--) {
      run += dgc[i] - zacc[i] + (i == C - 1 ? scal[0] + z : 0.f);
      if (i < nv && i % n == 0) ((bf16 *)a.dg)[((int64_t)ci.t0 + i / n) * H + h] = __float2bfloat16(run);
    }
  }
  for (int i = tid; i < nv; i += blockDim.x) ((bf16 *)a.dbeta)[(krow0 + i) * H + h] = __float2bfloat16(vdb[i]);
  {
    float xr[8][4];
    warp_load_rows<8>(k + (krow0 * H + h) * K, (int64_t)H * K, nv, K, xr);
    bf16 *dk = (bf16 *)a.dk;
#pragma unroll
    for (int rr = 0; rr < 8; rr++) {
      const int i = warp + 8 * rr;
      if (i >= nv) break;
      const int64_t row = (krow0 + i) * H + h;
      float d[4], ss = 0.f;
#pragma unroll
      for (int m = 0; m < 4; m++) {
        const int e = lane + 32 * m;
        d[m] = e < K ? dKn[i * ldFK + e] : 0.f;
        ss += xr[rr][m] * xr[rr][m];
      }
      const float inv = a.l2norm ? rsqrtf(warp_sum(ss) + kNormEps) : 1.f;
      float dot = 0.f;
#pragma unroll
      for (int m = 0; m < 4; m++) dot += xr[rr][m] * inv * d[m];
      dot = warp_sum(dot);
#pragma unroll
      for (int m = 0; m < 4; m++) {
        const int e = lane + 32 * m;
        if (e < K) dk[row * K + e] = __float2bfloat16(a.l2norm ? inv * (d[m] - xr[rr][m] * inv * dot) : d[m]);
      }
    }
  }
}

/* ------------------------------------------------------------------ launch */

template <int BV>
static double dstate_cost(const GdpArgs &a, int64_t N, int optin) {
  if (a.V % BV) return INFINITY;
  const size_t smem = dstate_layout(a.K, a.C, a.TC, BV, dstate_stages(a.K, a.C, a.TC, BV, optin)).total;
  if ((int)smem > optin) return INFINITY;
  cudaFuncSetAttribute(chunk_dstate_kernel<BV>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  int occ = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, chunk_dstate_kernel<BV>, kChunkThreads, smem);
  if (occ < 1) return INFINITY;
  const double blocks = (double)N * a.H * (a.V / BV);
  return ceil(blocks / ((double)num_sms() * occ)) * (1.0 + BV / 32.0);
}

static int choose_dstate_bv(const GdpArgs &a, int64_t N) {
  const int optin = smem_optin_bytes();
  const char *env = getenv("GDP_CUDA_BV");
  if (env) {
    const int bv = atoi(env);
    if ((bv == 16 || bv == 32 || bv == 64) && a.V % bv == 0 &&
        (int)dstate_layout(a.K, a.C, a.TC, bv, 2).total <= optin)
      return bv;
  }
  const double c64 = dstate_cost<64>(a, N, optin), c32 = dstate_cost<32>(a, N, optin),
               c16 = dstate_cost<16>(a, N, optin);
  if (c64 <= c32 && c64 <= c16) return 64;
  return c32 <= c16 ? 32 : 16;
}

template <int BV>
static gdp_status launch_dstate_bv(const Plan &plan) {
  GdpArgs a = plan.a;
  a.nstages = dstate_stages(a.K, a.C, a.TC, BV, smem_optin_bytes());
  const size_t smem = dstate_layout(a.K, a.C, a.TC, BV, a.nstages).total;
  GDP_CUDA_TRY(cudaFuncSetAttribute(chunk_dstate_kernel<BV>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  chunk_dstate_kernel<BV><<<dim3((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV)), kChunkThreads, smem,
                            plan.stream>>>(a);
  GDP_CUDA_LAUNCHED("chunk_dstate_kernel");
  return GDP_OK;
}

gdp_status launch_grad(const Plan &plan) { /* also variant 3's backward (gdp_bwd_v3.cu) */
  const GdpArgs &a = plan.a;
  if (a.nchunks == 0) return GDP_OK;
  const size_t smem = grad_layout(a.K, a.V, a.C, a.TC).total;
  if ((int)smem > smem_optin_bytes())
    return GDP_ERROR(GDP_ERR_UNSUPPORTED, "chunk_grad_kernel needs %zu bytes of shared memory (K=%d V=%d C=%d), the device gives %d",
                     smem, a.K, a.V, a.C, smem_optin_bytes());
  GDP_CUDA_TRY(cudaFuncSetAttribute(chunk_grad_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  chunk_grad_kernel<<<dim3((unsigned)a.nchunks, (unsigned)a.H), kChunkThreads, smem, plan.stream>>>(a);
  GDP_CUDA_LAUNCHED("chunk_grad_kernel");
  return GDP_OK;
}

gdp_status validate_bwd_io(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io, const char *what) {
  if (!io) return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: io is NULL", what);
  if (p->T_total > 0 && (!io->q || !io->k || !io->v || !io->beta || !io->d_o || !io->dq || !io->dk ||
                         !io->dv || !io->dbeta))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: q, k, v, beta, d_o, dq, dk, dv and dbeta must be non-NULL", what);
  if ((io->g == NULL) != (io->dg == NULL))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: dg must be given exactly when g is (g %s, dg %s)",
                     what, io->g ? "set" : "NULL", io->dg ? "set" : "NULL");
  return GDP_OK;
}

GdpArgs bwd_args(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io) {
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
  return a;
}

}  // namespace gdpcu

using namespace gdpcu;

extern "C" gdp_status gdp_cuda_gdp_backward_v2(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io,
                                               void *stream_) {
  GDP_TRY(validate_problem(p, "backward_v2"));
  GDP_TRY(validate_bwd_io(p, io, "backward_v2"));
  if (!chunk_path_ok(p))
    return GDP_ERROR(GDP_ERR_UNSUPPORTED,
                     "backward_v2 takes bf16, n = 1..4, K and V multiples of 16 up to 128; got dtype %d "
                     "n=%lld K=%lld V=%lld",
                     p->dtype, (long long)p->n, (long long)p->K, (long long)p->V);
  if (p->N == 0) return GDP_OK;
  cudaStream_t stream = (cudaStream_t)stream_;
  Plan plan;
  prof_begin(stream);
  GDP_TRY(plan_make(p, stream, PLAN_BACKWARD_V2, bwd_args(p, io), &plan));
  plan.bv_bwd = choose_dstate_bv(plan.a, p->N);
  prof_mark("bwd plan+upload", stream);
  gdp_status st = launch_prep(plan);
  prof_mark("bwd prep (recompute)", stream);
  if (st == GDP_OK) st = launch_state(plan, true);
  prof_mark("bwd states (recompute)", stream);
  if (st == GDP_OK) {
    switch (plan.bv_bwd) {
      case 64: st = launch_dstate_bv<64>(plan); break;
      case 32: st = launch_dstate_bv<32>(plan); break;
      default: st = launch_dstate_bv<16>(plan); break;
    }
  }
  prof_mark("bwd state gradients", stream);
  if (st == GDP_OK) st = launch_grad(plan);
  prof_mark("bwd chunk gradients", stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

extern "C" gdp_status gdp_cuda_gdp_backward_recurrent(const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io,
                                                      void *stream_) {
  GDP_TRY(validate_problem(p, "backward_recurrent"));
  GDP_TRY(validate_bwd_io(p, io, "backward_recurrent"));
  if (p->N == 0) return GDP_OK;
  cudaStream_t stream = (cudaStream_t)stream_;
  GdpArgs a = bwd_args(p, io);
  return p->dtype == GDP_DTYPE_BF16 ? rec_backward<bf16>(p, a, stream) : rec_backward<float>(p, a, stream);
}
