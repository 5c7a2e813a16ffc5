/*
 * norm.cu -- the gated grouped RMSNorm of the mixer output and the row-wise L2 norm of
 * q and k on cuda, with the semantics of kernels/cpu/mixer_norm.c and l2norm.c:
 *
 *   x = y * silu(z),  xh = x * rstd,  out = xh * weight,  rstd = (mean_group x^2 + eps)^-1/2
 *   dx = rstd (dxh - xh c), dxh = d_out * weight, c = mean_group dxh * xh,
 *   dy = dx * silu(z), dz = dx * y * s (1 + z (1 - s)),  dweight = sum_rows d_out * xh
 *
 * One block per (row, group): the group's sums are block reductions in the math type
 * (float32 for f32 and bf16: the statistics stay float32 whatever the I/O dtype).  The
 * backward stores rstd per (row, group) in the workspace; dweight is then a two-pass
 * column sum (common.cuh) that recomputes xh from it.  The L2 norm takes one warp per row.
 */
#include "common.cuh"

namespace gdp_mixer {
namespace {

enum { NORM_THREADS = 128, L2_ROWS_PER_BLOCK = 4 };

template <typename IO>
__device__ __forceinline__ typename Math<IO>::type gated(const IO *y, const IO *z, int64_t i) {
  typedef typename Math<IO>::type A;
  A x = ld(y, i);
  if (z) {
    const A zz = ld(z, i);
    x *= zz * sigmoid(zz);
  }
  return x;
}

template <typename IO>
__global__ void rmsnorm_fwd_kernel(int64_t d, int64_t gs, typename Math<IO>::type eps,
                                   const IO *y, const IO *z, const IO *weight, IO *out) {
  typedef typename Math<IO>::type A;
  __shared__ A red[32];
  const int64_t ng = d / gs, rg = blockIdx.x;
  const int64_t i0 = (rg / ng) * d + (rg % ng) * gs, c0 = (rg % ng) * gs;
  A sum = (A)0;
  for (int64_t j = threadIdx.x; j < gs; j += blockDim.x) {
    const A x = gated(y, z, i0 + j);
    sum += x * x;
  }
  sum = block_sum(sum, red);
  const A rstd = m_rsqrt(sum / (A)gs + eps);
  for (int64_t j = threadIdx.x; j < gs; j += blockDim.x)
    st(out, i0 + j, gated(y, z, i0 + j) * rstd * ld(weight, c0 + j));
}

template <typename IO>
__global__ void rmsnorm_bwd_kernel(int64_t d, int64_t gs, typename Math<IO>::type eps,
                                   const IO *y, const IO *z, const IO *weight, const IO *d_out,
                                   IO *dy, IO *dz, float *rstd_out) {
  typedef typename Math<IO>::type A;
  __shared__ A red[32];
  const int64_t ng = d / gs, rg = blockIdx.x;
  const int64_t i0 = (rg / ng) * d + (rg % ng) * gs, c0 = (rg % ng) * gs;
  A sum = (A)0;
  for (int64_t j = threadIdx.x; j < gs; j += blockDim.x) {
    const A x = gated(y, z, i0 + j);
    sum += x * x;
  }
  sum = block_sum(sum, red);
  const A rstd = m_rsqrt(sum / (A)gs + eps);
  if (rstd_out && threadIdx.x == 0) rstd_out[rg] = (float)rstd;
  if (!dy && !dz) return; /* uniform over the block: no barrier follows */
  A c = (A)0;
  for (int64_t j = threadIdx.x; j < gs; j += blockDim.x)
    c += ld(d_out, i0 + j) * ld(weight, c0 + j) * gated(y, z, i0 + j) * rstd;
  c = block_sum(c, red) / (A)gs;
  for (int64_t j = threadIdx.x; j < gs; j += blockDim.x) {
    const int64_t i = i0 + j;
    const A dx = rstd * (ld(d_out, i) * ld(weight, c0 + j) - gated(y, z, i) * rstd * c);
    if (!z) {
      if (dy) st(dy, i, dx);
      continue;
    }
    const A zz = ld(z, i), s = sigmoid(zz);
    if (dy) st(dy, i, dx * zz * s);
    if (dz) st(dz, i, dx * ld(y, i) * s * ((A)1 + zz * ((A)1 - s)));
  }
}

/* dweight column sums: sum over rows of d_out * xh, xh from the stored rstd. */
template <typename IO> struct NormWeightSum {
  const IO *y, *z, *d_out;
  const float *rstd;
  int64_t d, gs;
  __device__ void operator()(int64_t r, int64_t col, typename Math<IO>::type *acc) const {
    typedef typename Math<IO>::type A;
    const int64_t i = r * d + col;
    const A rs = (A)rstd[r * (d / gs) + col / gs];
    acc[0] += ld(d_out, i) * gated(y, z, i) * rs;
  }
};

template <typename IO>
__global__ void l2norm_fwd_kernel(int64_t rows, int64_t dim, typename Math<IO>::type eps,
                                  const IO *x, IO *y) {
  typedef typename Math<IO>::type A;
  const int64_t row = (int64_t)blockIdx.x * L2_ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return; /* the whole warp */
  const IO *xi = x + row * dim;
  IO *yi = y + row * dim;
  A ss = (A)0;
  for (int64_t k = lane; k < dim; k += 32) {
    const A v = ld(xi, k);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const A r = m_rsqrt(ss + eps);
  for (int64_t k = lane; k < dim; k += 32) st(yi, k, ld(xi, k) * r);
}

template <typename IO>
__global__ void l2norm_bwd_kernel(int64_t rows, int64_t dim, typename Math<IO>::type eps,
                                  const IO *x, const IO *dy, IO *dx) {
  typedef typename Math<IO>::type A;
  const int64_t row = (int64_t)blockIdx.x * L2_ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const IO *xi = x + row * dim, *dyi = dy + row * dim;
  IO *dxi = dx + row * dim;
  A ss = (A)0, xdy = (A)0;
  for (int64_t k = lane; k < dim; k += 32) {
    const A v = ld(xi, k);
    ss += v * v;
    xdy += v * ld(dyi, k);
  }
  ss = warp_sum(ss);
  xdy = warp_sum(xdy);
  const A r = m_rsqrt(ss + eps);
  const A ydy = r * xdy;
  for (int64_t k = lane; k < dim; k += 32) st(dxi, k, r * (ld(dyi, k) - ld(xi, k) * r * ydy));
}

template <typename IO>
gdp_status rmsnorm_bwd(int64_t rows, int64_t d, int64_t gs, double eps, const void *y,
                       const void *z, const void *weight, const void *d_out, void *dy, void *dz,
                       void *dweight, void *workspace, cudaStream_t stream) {
  static const char *func = "gdp_cuda_gated_rmsnorm_bwd";
  typedef typename Math<IO>::type A;
  const int64_t ng = d / gs, nrg = rows * ng;
  float *rstd = (float *)workspace;
  double *partial = (double *)((char *)workspace + gdp_mixer_rstd_bytes(nrg));
  if (nrg > 0) {
    rmsnorm_bwd_kernel<IO><<<(unsigned)nrg, NORM_THREADS, 0, stream>>>(
        d, gs, (A)eps, (const IO *)y, (const IO *)z, (const IO *)weight, (const IO *)d_out,
        (IO *)dy, (IO *)dz, dweight ? rstd : NULL);
    GDP_TRY(launched(func, "rmsnorm_bwd_kernel"));
  }
  if (!dweight) return GDP_OK;
  NormWeightSum<IO> fn;
  fn.y = (const IO *)y, fn.z = (const IO *)z, fn.d_out = (const IO *)d_out;
  fn.rstd = rstd, fn.d = d, fn.gs = gs;
  IO *outs[1] = {(IO *)dweight};
  return colsum_run<1, IO>(func, "rmsnorm_dweight", fn, rows, d, 1, outs, partial, stream);
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

static gdp_status norm_grid_check(const char *func, int64_t rows, int64_t d, int64_t gs) {
  if (gs < 1 || d % gs != 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "group size %lld does not divide d = %lld",
                        (long long)gs, (long long)d);
  if (rows * (d / gs) > 0x7fffffffLL)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "more than 2^31-1 norm groups (%lld rows x %lld)",
                        (long long)rows, (long long)(d / gs));
  return GDP_OK;
}

extern "C" gdp_status gdp_cuda_gated_rmsnorm_fwd(int dtype, int64_t rows, int64_t d, int64_t gs,
                                                 double eps, const void *y, const void *z,
                                                 const void *weight, void *out, void *stream) {
  static const char *func = "gdp_cuda_gated_rmsnorm_fwd";
  GDP_TRY(norm_grid_check(func, rows, d, gs));
  const int64_t nrg = rows * (d / gs);
  if (nrg == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     rmsnorm_fwd_kernel<IO><<<(unsigned)nrg, NORM_THREADS, 0, (cudaStream_t)stream>>>(
                         d, gs, (typename Math<IO>::type)eps, (const IO *)y, (const IO *)z,
                         (const IO *)weight, (IO *)out));
  return launched(func, "rmsnorm_fwd_kernel");
}

extern "C" size_t gdp_cuda_gated_rmsnorm_bwd_workspace(int64_t rows, int64_t d, int64_t gs) {
  const int64_t nrg = gs > 0 ? rows * (d / gs) : 0;
  return gdp_mixer_rstd_bytes(nrg) + colsum_bytes(1, rows, d);
}

extern "C" gdp_status gdp_cuda_gated_rmsnorm_bwd(int dtype, int64_t rows, int64_t d, int64_t gs,
                                                 double eps, const void *y, const void *z,
                                                 const void *weight, const void *d_out, void *dy,
                                                 void *dz, void *dweight, void *workspace,
                                                 void *stream) {
  static const char *func = "gdp_cuda_gated_rmsnorm_bwd";
  GDP_TRY(norm_grid_check(func, rows, d, gs));
  GDP_MIXER_DISPATCH(func, dtype,
                     return rmsnorm_bwd<IO>(rows, d, gs, eps, y, z, weight, d_out, dy, dz, dweight,
                                            workspace, (cudaStream_t)stream));
  return GDP_OK;
}

extern "C" gdp_status gdp_cuda_l2norm_fwd(int dtype, int64_t rows, int64_t dim, double eps,
                                          const void *x, void *y, void *stream) {
  static const char *func = "gdp_cuda_l2norm_fwd";
  if (rows == 0) return GDP_OK;
  const int64_t blocks = (rows + L2_ROWS_PER_BLOCK - 1) / L2_ROWS_PER_BLOCK;
  if (blocks > 0x7fffffffLL)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "too many rows (%lld)", (long long)rows);
  GDP_MIXER_DISPATCH(func, dtype,
                     l2norm_fwd_kernel<IO><<<(unsigned)blocks, 32 * L2_ROWS_PER_BLOCK, 0,
                                             (cudaStream_t)stream>>>(
                         rows, dim, (typename Math<IO>::type)eps, (const IO *)x, (IO *)y));
  return launched(func, "l2norm_fwd_kernel");
}

extern "C" gdp_status gdp_cuda_l2norm_bwd(int dtype, int64_t rows, int64_t dim, double eps,
                                          const void *x, const void *dy, void *dx, void *stream) {
  static const char *func = "gdp_cuda_l2norm_bwd";
  if (rows == 0) return GDP_OK;
  const int64_t blocks = (rows + L2_ROWS_PER_BLOCK - 1) / L2_ROWS_PER_BLOCK;
  if (blocks > 0x7fffffffLL)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "too many rows (%lld)", (long long)rows);
  GDP_MIXER_DISPATCH(func, dtype,
                     l2norm_bwd_kernel<IO><<<(unsigned)blocks, 32 * L2_ROWS_PER_BLOCK, 0,
                                             (cudaStream_t)stream>>>(
                         rows, dim, (typename Math<IO>::type)eps, (const IO *)x, (const IO *)dy,
                         (IO *)dx));
  return launched(func, "l2norm_bwd_kernel");
}
