/*
 * gates.cu -- the mixer's per-head elementwise ops on cuda, with the semantics of
 * kernels/cpu/mixer_gates.c:
 *
 *   beta = scale * sigmoid(b)                        db = d_beta * scale * s (1 - s)
 *   out = x * sigmoid(x) (SiLU, rows with strides)   dx = d_out * s (1 + x (1 - s))
 *   g = -exp(A_log[h]) * softplus(a + dt_bias[h])    da = d_g * (-exp(A_log[h])) * softplus'(x)
 *                                                    dA_log[h] = sum d_g * g, ddt_bias[h] = sum da
 *   out = y + D * x_v                                dx_v = D * d_out, dD = sum d_out * x_v
 *
 * softplus as torch's (threshold 20).  The per-head sums are two-pass column sums
 * (common.cuh); their first pass also writes the elementwise gradient.
 */
#include "common.cuh"

namespace gdp_mixer {
namespace {

enum { SOFTPLUS_THRESHOLD = 20 };

template <typename A> __device__ __forceinline__ A softplus(A x) {
  return x > (A)SOFTPLUS_THRESHOLD ? x : m_log1p(m_exp(x));
}
template <typename A> __device__ __forceinline__ A softplus_grad(A x) {
  return x > (A)SOFTPLUS_THRESHOLD ? (A)1 : sigmoid(x);
}

template <typename IO>
__global__ void beta_fwd_kernel(int64_t n, typename Math<IO>::type sc, const IO *b, IO *beta) {
  GDP_MIXER_FOR(i, n) st(beta, i, sc * sigmoid(ld(b, i)));
}

template <typename IO>
__global__ void beta_bwd_kernel(int64_t n, typename Math<IO>::type sc, const IO *b,
                                const IO *d_beta, IO *db) {
  typedef typename Math<IO>::type A;
  GDP_MIXER_FOR(i, n) {
    const A s = sigmoid(ld(b, i));
    st(db, i, ld(d_beta, i) * sc * s * ((A)1 - s));
  }
}

/* SiLU over rows of C elements with row strides (a channel section of the in_proj
 * output or of its gradient is read or written where it lies), in packs of VEC: one
 * grid-stride loop over every pack of every row, so that rows of a few hundred packs
 * (the in_proj's q/k/v section) do not leave most of a block per row idle. */
template <typename IO, int VEC>
__global__ void silu_fwd_kernel(int64_t rows, int C, const IO *x, int64_t ld_x, IO *out,
                                int64_t ld_out) {
  typedef typename Math<IO>::type A;
  const int64_t packs = C / VEC;
  GDP_MIXER_FOR(i, rows * packs) {
    const int64_t r = i / packs, c = (i - r * packs) * VEC;
    A v[VEC];
    ld_lanes<IO, VEC>(x + r * ld_x + c, v);
#pragma unroll
    for (int k = 0; k < VEC; k++) v[k] = v[k] * sigmoid(v[k]);
    st_lanes<IO, VEC>(out + r * ld_out + c, v);
  }
}

template <typename IO, int VEC>
__global__ void silu_bwd_kernel(int64_t rows, int C, const IO *x, int64_t ld_x, const IO *d_out,
                                int64_t ld_d, IO *dx, int64_t ld_dx) {
  typedef typename Math<IO>::type A;
  const int64_t packs = C / VEC;
  GDP_MIXER_FOR(i, rows * packs) {
    const int64_t r = i / packs, c = (i - r * packs) * VEC;
    A v[VEC], d[VEC];
    ld_lanes<IO, VEC>(x + r * ld_x + c, v);
    ld_lanes<IO, VEC>(d_out + r * ld_d + c, d);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
      const A s = sigmoid(v[k]);
      d[k] = d[k] * s * ((A)1 + v[k] * ((A)1 - s));
    }
    st_lanes<IO, VEC>(dx + r * ld_dx + c, d);
  }
}

/* 16-byte packs fit: C and the row strides are multiples of the pack, the rows aligned. */
template <typename IO>
static int rows_pack(int64_t C, const int64_t *lds, const void *const *ptrs, int n) {
  const int64_t vec = Vec16<IO>::n;
  if (C % vec) return 0;
  for (int i = 0; i < n; i++)
    if (lds[i] % vec || !aligned16(ptrs[i])) return 0;
  return 1;
}

template <typename IO>
static void silu_fwd(int64_t rows, int C, const void *x, int64_t ld_x, void *out, int64_t ld_out,
                     cudaStream_t stream) {
  enum { VEC = Vec16<IO>::n };
  const int64_t lds[2] = {ld_x, ld_out};
  const void *ptrs[2] = {x, out};
  if (rows_pack<IO>(C, lds, ptrs, 2))
    silu_fwd_kernel<IO, VEC><<<grid_for(rows * (C / VEC)), THREADS, 0, stream>>>(
        rows, C, (const IO *)x, ld_x, (IO *)out, ld_out);
  else
    silu_fwd_kernel<IO, 1><<<grid_for(rows * C), THREADS, 0, stream>>>(rows, C, (const IO *)x,
                                                                      ld_x, (IO *)out, ld_out);
}

template <typename IO>
static void silu_bwd(int64_t rows, int C, const void *x, int64_t ld_x, const void *d_out,
                     int64_t ld_d, void *dx, int64_t ld_dx, cudaStream_t stream) {
  enum { VEC = Vec16<IO>::n };
  const int64_t lds[3] = {ld_x, ld_d, ld_dx};
  const void *ptrs[3] = {x, d_out, dx};
  if (rows_pack<IO>(C, lds, ptrs, 3))
    silu_bwd_kernel<IO, VEC><<<grid_for(rows * (C / VEC)), THREADS, 0, stream>>>(
        rows, C, (const IO *)x, ld_x, (const IO *)d_out, ld_d, (IO *)dx, ld_dx);
  else
    silu_bwd_kernel<IO, 1><<<grid_for(rows * C), THREADS, 0, stream>>>(
        rows, C, (const IO *)x, ld_x, (const IO *)d_out, ld_d, (IO *)dx, ld_dx);
}

template <typename IO>
__global__ void decay_fwd_kernel(int64_t rows, int64_t H, const IO *a, const IO *A_log,
                                 const IO *dt_bias, IO *g) {
  typedef typename Math<IO>::type A;
  GDP_MIXER_FOR(i, rows * H) {
    const int64_t h = i % H;
    const A x = ld(a, i) + (dt_bias ? ld(dt_bias, h) : (A)0);
    st(g, i, -m_exp(ld(A_log, h)) * softplus(x));
  }
}

/* Column sums over rows of [d_g * g, da] per head; writes da. */
template <typename IO> struct DecayBwd {
  const IO *a, *A_log, *dt_bias, *d_g;
  IO *da;
  int64_t H;
  __device__ void operator()(int64_t r, int64_t h, typename Math<IO>::type *acc) const {
    typedef typename Math<IO>::type A;
    const int64_t i = r * H + h;
    const A x = ld(a, i) + (dt_bias ? ld(dt_bias, h) : (A)0);
    const A Ah = m_exp(ld(A_log, h));
    const A dg = ld(d_g, i);
    const A dx = -dg * Ah * softplus_grad(x);
    if (da) st(da, i, dx);
    acc[0] += dg * (-Ah * softplus(x));
    acc[1] += dx;
  }
};

template <typename IO>
__global__ void dskip_fwd_kernel(int64_t rows, int64_t H, int64_t P, int per_channel,
                                 const IO *y, const IO *x_v, const IO *D, IO *out) {
  const int64_t HP = H * P;
  GDP_MIXER_FOR(i, rows * HP) {
    const int64_t k = i % HP;
    st(out, i, ld(y, i) + ld(D, per_channel ? k : k / P) * ld(x_v, i));
  }
}

template <typename IO>
__global__ void dskip_dx_kernel(int64_t rows, int64_t H, int64_t P, int per_channel,
                                const IO *D, const IO *d_out, IO *dx_v) {
  const int64_t HP = H * P;
  GDP_MIXER_FOR(i, rows * HP) {
    const int64_t k = i % HP;
    st(dx_v, i, ld(D, per_channel ? k : k / P) * ld(d_out, i));
  }
}

/* Column sums over rows of d_out * x_v per channel k < H*P; writes dx_v. */
template <typename IO> struct DskipBwd {
  const IO *x_v, *D, *d_out;
  IO *dx_v;
  int64_t HP, P;
  int per_channel;
  __device__ void operator()(int64_t r, int64_t k, typename Math<IO>::type *acc) const {
    const int64_t i = r * HP + k;
    const typename Math<IO>::type go = ld(d_out, i);
    if (dx_v) st(dx_v, i, ld(D, per_channel ? k : k / P) * go);
    acc[0] += go * ld(x_v, i);
  }
};

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

extern "C" gdp_status gdp_cuda_beta_fwd(int dtype, int64_t n, double scale, const void *b,
                                        void *beta, void *stream) {
  static const char *func = "gdp_cuda_beta_fwd";
  if (n == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     beta_fwd_kernel<IO><<<grid_for(n), THREADS, 0, (cudaStream_t)stream>>>(
                         n, (typename Math<IO>::type)scale, (const IO *)b, (IO *)beta));
  return launched(func, "beta_fwd_kernel");
}

extern "C" gdp_status gdp_cuda_beta_bwd(int dtype, int64_t n, double scale, const void *b,
                                        const void *d_beta, void *db, void *stream) {
  static const char *func = "gdp_cuda_beta_bwd";
  if (n == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     beta_bwd_kernel<IO><<<grid_for(n), THREADS, 0, (cudaStream_t)stream>>>(
                         n, (typename Math<IO>::type)scale, (const IO *)b, (const IO *)d_beta,
                         (IO *)db));
  return launched(func, "beta_bwd_kernel");
}

extern "C" gdp_status gdp_cuda_silu_fwd(int dtype, int64_t rows, int64_t C, const void *x,
                                        int64_t ld_x, void *out, int64_t ld_out, void *stream) {
  static const char *func = "gdp_cuda_silu_fwd";
  if (rows == 0 || C == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     silu_fwd<IO>(rows, (int)C, x, ld_x, out, ld_out, (cudaStream_t)stream));
  return launched(func, "silu_fwd_kernel");
}

extern "C" gdp_status gdp_cuda_silu_bwd(int dtype, int64_t rows, int64_t C, const void *x,
                                        int64_t ld_x, const void *d_out, int64_t ld_d, void *dx,
                                        int64_t ld_dx, void *stream) {
  static const char *func = "gdp_cuda_silu_bwd";
  if (rows == 0 || C == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     silu_bwd<IO>(rows, (int)C, x, ld_x, d_out, ld_d, dx, ld_dx,
                                  (cudaStream_t)stream));
  return launched(func, "silu_bwd_kernel");
}

extern "C" gdp_status gdp_cuda_decay_fwd(int dtype, int64_t rows, int64_t H, const void *a,
                                         const void *A_log, const void *dt_bias, void *g,
                                         void *stream) {
  static const char *func = "gdp_cuda_decay_fwd";
  if (rows * H == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     decay_fwd_kernel<IO><<<grid_for(rows * H), THREADS, 0, (cudaStream_t)stream>>>(
                         rows, H, (const IO *)a, (const IO *)A_log, (const IO *)dt_bias, (IO *)g));
  return launched(func, "decay_fwd_kernel");
}

extern "C" size_t gdp_cuda_decay_bwd_workspace(int64_t rows, int64_t H) {
  return colsum_bytes(2, rows, H);
}

template <typename IO>
static gdp_status decay_bwd(int64_t rows, int64_t H, const void *a, const void *A_log,
                            const void *dt_bias, const void *d_g, void *da, void *dA_log,
                            void *ddt_bias, void *workspace, cudaStream_t stream) {
  DecayBwd<IO> fn;
  fn.a = (const IO *)a, fn.A_log = (const IO *)A_log, fn.dt_bias = (const IO *)dt_bias;
  fn.d_g = (const IO *)d_g, fn.da = (IO *)da, fn.H = H;
  IO *outs[2] = {(IO *)dA_log, dt_bias ? (IO *)ddt_bias : NULL};
  return colsum_run<2, IO>("gdp_cuda_decay_bwd", "decay_bwd", fn, rows, H, 1, outs, workspace,
                           stream);
}

extern "C" gdp_status gdp_cuda_decay_bwd(int dtype, int64_t rows, int64_t H, const void *a,
                                         const void *A_log, const void *dt_bias, const void *d_g,
                                         void *da, void *dA_log, void *ddt_bias, void *workspace,
                                         void *stream) {
  static const char *func = "gdp_cuda_decay_bwd";
  GDP_MIXER_DISPATCH(func, dtype,
                     return decay_bwd<IO>(rows, H, a, A_log, dt_bias, d_g, da, dA_log, ddt_bias,
                                          workspace, (cudaStream_t)stream));
  return GDP_OK;
}

extern "C" gdp_status gdp_cuda_dskip_fwd(int dtype, int64_t rows, int64_t H, int64_t P,
                                         int per_channel, const void *y, const void *x_v,
                                         const void *D, void *out, void *stream) {
  static const char *func = "gdp_cuda_dskip_fwd";
  if (rows * H * P == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     dskip_fwd_kernel<IO><<<grid_for(rows * H * P), THREADS, 0, (cudaStream_t)stream>>>(
                         rows, H, P, per_channel, (const IO *)y, (const IO *)x_v, (const IO *)D,
                         (IO *)out));
  return launched(func, "dskip_fwd_kernel");
}

extern "C" size_t gdp_cuda_dskip_bwd_workspace(int64_t rows, int64_t H, int64_t P) {
  return colsum_bytes(1, rows, H * P);
}

template <typename IO>
static gdp_status dskip_bwd(int64_t rows, int64_t H, int64_t P, int per_channel,
                            const void *x_v, const void *D, const void *d_out, void *dx_v,
                            void *dD, void *workspace, cudaStream_t stream) {
  static const char *func = "gdp_cuda_dskip_bwd";
  if (!dD) { /* elementwise only */
    if (!dx_v || rows * H * P == 0) return GDP_OK;
    dskip_dx_kernel<IO><<<grid_for(rows * H * P), THREADS, 0, stream>>>(
        rows, H, P, per_channel, (const IO *)D, (const IO *)d_out, (IO *)dx_v);
    return launched(func, "dskip_dx_kernel");
  }
  DskipBwd<IO> fn;
  fn.x_v = (const IO *)x_v, fn.D = (const IO *)D, fn.d_out = (const IO *)d_out;
  fn.dx_v = (IO *)dx_v, fn.HP = H * P, fn.P = P, fn.per_channel = per_channel;
  IO *outs[1] = {(IO *)dD};
  return colsum_run<1, IO>(func, "dskip_bwd", fn, rows, H * P, per_channel ? 1 : P, outs,
                           workspace, stream);
}

extern "C" gdp_status gdp_cuda_dskip_bwd(int dtype, int64_t rows, int64_t H, int64_t P,
                                         int per_channel, const void *x_v, const void *D,
                                         const void *d_out, void *dx_v, void *dD,
                                         void *workspace, void *stream) {
  static const char *func = "gdp_cuda_dskip_bwd";
  GDP_MIXER_DISPATCH(func, dtype,
                     return dskip_bwd<IO>(rows, H, P, per_channel, x_v, D, d_out, dx_v, dD,
                                          workspace, (cudaStream_t)stream));
  return GDP_OK;
}
