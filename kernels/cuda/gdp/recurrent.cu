/*
 * recurrent.cu -- the recurrent GDP kernels: f32 and bf16, any shape the dispatch takes
 * (K <= 256, any V), exact float32 arithmetic.  The path for float32 problems, for the
 * shapes the fast chunked path does not take, and algorithm = "recurrent".
 *  - forward: one block per (sequence, head, 32 value columns) steps the token
 *    recurrence with the state in registers (lane = key rows, warp = 8 columns);
 *  - backward: the oracle's reverse sweep per (sequence, head, 32 value columns):
 *    checkpoints every ~sqrt(L) tokens, each segment recomputed into a per-block
 *    trajectory in global memory, then walked backwards.  Reductions over the value
 *    axis (dq, dk, dbeta, dg) are summed across column blocks with float atomics, then
 *    a finalize kernel applies the l2-norm backward and the dtype.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "fragments.cuh"

namespace gdpcu {

/* ------------------------------------------------------------------ recurrent forward */

/* Block: 4 warps x 8 value columns = 32 columns; lane l holds key rows l, l+32, ...
 * (RPT of them).  Every reduction over the key axis is a warp sum. */
template <typename T, int RPT>
__global__ __launch_bounds__(128) void rec_fwd_kernel(GdpArgs a) {
  const int s = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c0 = blockIdx.z * 32 + warp * 8;
  const int H = a.H, K = a.K, V = a.V, n = a.n;
  const T *q = (const T *)a.q, *k = (const T *)a.k, *v = (const T *)a.v, *g = (const T *)a.g,
          *beta = (const T *)a.beta;
  T *o = (T *)a.o;
  const int64_t state_off = ((int64_t)s * H + h) * K * V;
  float S[RPT][8];
#pragma unroll
  for (int i = 0; i < RPT; i++)
#pragma unroll
    for (int cc = 0; cc < 8; cc++) {
      const int r = lane + 32 * i, c = c0 + cc;
      S[i][cc] = (a.h0 && r < K && c < V) ? a.h0[state_off + (int64_t)r * V + c] : 0.f;
    }
  const long long bos = a.cu[s], eos = a.cu[s + 1];
  for (long long t = bos; t < eos; t++) {
    if (g) {
      const float d = __expf(load_gate<T>(a.g, a.g_f32, t * H + h));
#pragma unroll
      for (int i = 0; i < RPT; i++)
#pragma unroll
        for (int cc = 0; cc < 8; cc++) S[i][cc] *= d;
    }
    for (int j = 0; j < n; j++) {
      const int64_t row = (t * n + j) * H + h;
      float kr[RPT], ss = 0.f;
#pragma unroll
      for (int i = 0; i < RPT; i++) {
        const int r = lane + 32 * i;
        kr[i] = r < K ? to_f(k[row * K + r]) : 0.f;
        ss += kr[i] * kr[i];
      }
      if (a.l2norm) {
        const float inv = rsqrtf(warp_sum(ss) + kNormEps);
#pragma unroll
        for (int i = 0; i < RPT; i++) kr[i] *= inv;
      }
      const float b = to_f(beta[row]);
      float u[8];
#pragma unroll
      for (int cc = 0; cc < 8; cc++) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < RPT; i++) acc += S[i][cc] * kr[i];
        u[cc] = warp_sum(acc);
      }
#pragma unroll
      for (int cc = 0; cc < 8; cc++) {
        const int c = c0 + cc;
        const float vv = c < V ? to_f(v[row * V + c]) : 0.f;
        const float d = b * (vv - u[cc]);
#pragma unroll
        for (int i = 0; i < RPT; i++) S[i][cc] += kr[i] * d;
      }
    }
    const int64_t qrow = t * H + h;
    float qr[RPT], ss = 0.f;
#pragma unroll
    for (int i = 0; i < RPT; i++) {
      const int r = lane + 32 * i;
      qr[i] = r < K ? to_f(q[qrow * K + r]) : 0.f;
      ss += qr[i] * qr[i];
    }
    const float qs = a.l2norm ? a.scale * rsqrtf(warp_sum(ss) + kNormEps) : a.scale;
#pragma unroll
    for (int cc = 0; cc < 8; cc++) {
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < RPT; i++) acc += S[i][cc] * qr[i];
      acc = warp_sum(acc) * qs;
      if (lane == cc && c0 + cc < V) o[qrow * V + c0 + cc] = from_f<T>(acc);
    }
  }
  if (a.ht) {
#pragma unroll
    for (int i = 0; i < RPT; i++)
#pragma unroll
      for (int cc = 0; cc < 8; cc++) {
        const int r = lane + 32 * i, c = c0 + cc;
        if (r < K && c < V) a.ht[state_off + (int64_t)r * V + c] = S[i][cc];
      }
  }
}

template <typename T>
static gdp_status launch_rec_fwd(const GdpArgs &a, int64_t N, cudaStream_t stream) {
  const dim3 grid((unsigned)N, (unsigned)a.H, (unsigned)((a.V + 31) / 32));
  if (a.K <= 64) rec_fwd_kernel<T, 2><<<grid, 128, 0, stream>>>(a);
  else if (a.K <= 128) rec_fwd_kernel<T, 4><<<grid, 128, 0, stream>>>(a);
  else rec_fwd_kernel<T, 8><<<grid, 128, 0, stream>>>(a);
  GDP_CUDA_LAUNCHED("rec_fwd_kernel");
  return GDP_OK;
}

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
    const float d = __expf(load_gate<T>(a.g, a.g_f32, t * H + h));
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
    for (int64_t i = tid; i < qrows; i += nth) store_gate_grad<T>(a.dg, a.g_f32, i, acc_dg[i]);
}

template <typename T>
static gdp_status rec_backward(const gdp_delta_product_problem *p, GdpArgs a, cudaStream_t stream) {
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

}  // namespace gdpcu

using namespace gdpcu;

gdp_status gdpcu::forward_recurrent(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io, cudaStream_t stream) {
  if (p->N == 0) return GDP_OK;
  GdpArgs a = fwd_args(p, io);
  void *cu = nullptr;
  GDP_TRY(device_alloc(&cu, ((size_t)p->N + 1) * sizeof(long long), stream));
  gdp_status st = upload_cu_seqlens(p, (long long *)cu, stream);
  a.cu = (const long long *)cu;
  if (st == GDP_OK)
    st = p->dtype == GDP_DTYPE_BF16 ? launch_rec_fwd<bf16>(a, p->N, stream)
                                    : launch_rec_fwd<float>(a, p->N, stream);
  cudaFreeAsync(cu, stream);
  return st;
}

gdp_status gdpcu::backward_recurrent(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, cudaStream_t stream) {
  if (p->N == 0) return GDP_OK;
  GdpArgs a = bwd_args(p, io);
  return p->dtype == GDP_DTYPE_BF16 ? rec_backward<bf16>(p, a, stream) : rec_backward<float>(p, a, stream);
}
