/*
 * cross_entropy.cu -- the token loss and its gradient on cuda, with the semantics of
 * kernels/cpu/cross_entropy.c:
 *   m = max(row), lse = m + log(sum exp(row - m)), loss_r = lse - row[target],
 *   dlogits = scale (exp(row - lse) - onehot(target)).
 * The targets are read where they lie (int32 or int64 on the device, the mask as
 * float64) by a first kernel: the row's class, or -1 where it does not count
 * (ignore_index, mask zero), the count of counted rows (integer atomics, exact) and the
 * first position whose counted target is outside [0, V) (atomicMin) go to the
 * workspace and the result block.  The row kernels take scale = 1 / count from there,
 * so that nothing is read back between the kernels nor after them: with few classes (V <= 32) a
 * thread per row, else a block per row (block reductions for the max and the sum), in
 * the math type (float32 for f32 and bf16); the row losses go to the workspace as
 * doubles and one block adds them in a fixed order.
 */
#include <math.h>

#include "../mixer/common.cuh"
#include "nn_cuda.h"

namespace gdp_mixer {
namespace {

enum { XENT_THREADS = 256, XENT_MAX_BLOCKS = 65535, XENT_SUM_THREADS = 1024 };
enum { XENT_THREAD_ROW_V = 32 }; /* up to this many classes, a thread per row */

__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }

/* Maximum over the block (as block_sum in common.cuh). */
template <typename A> __device__ __forceinline__ A block_max(A v, A *shared) {
  for (int o = 16; o > 0; o >>= 1) {
    const A w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  A t = lane < nw ? shared[lane] : shared[0];
  for (int o = 16; o > 0; o >>= 1) {
    const A w = __shfl_xor_sync(0xffffffffu, t, o);
    t = w > t ? w : t;
  }
  __syncthreads();
  return t;
}

template <typename ID>
__global__ void xent_targets_kernel(int64_t rows, int64_t V, const void *targets,
                                    const double *mask, int64_t ignore_index, int64_t *target,
                                    gdp_cuda_xent_result *res) {
  unsigned counted = 0;
  GDP_MIXER_FOR(r, rows) {
    int64_t t = (int64_t)((const ID *)targets)[r];
    if (t == ignore_index || (mask && mask[r] == 0.0)) {
      t = -1;
    } else if (t < 0 || t >= V) {
      atomicMin(&res->first_bad, (unsigned long long)r);
      t = -1;
    } else {
      counted++;
    }
    target[r] = t;
  }
  counted = __reduce_add_sync(0xffffffffu, counted);
  if ((threadIdx.x & 31) == 0 && counted)
    atomicAdd((unsigned long long *)&res->count, (unsigned long long)counted);
}

template <typename A> __device__ __forceinline__ A xent_scale(const gdp_cuda_xent_result *res) {
  const int64_t c = res->count;
  return (A)(c > 0 ? 1.0 / (double)c : 0.0);
}

/* A thread per row (few classes: a block per row would leave most threads idle). */
template <typename IO>
__global__ void xent_thread_row_kernel(int64_t rows, int64_t V, const int64_t *target,
                                       const gdp_cuda_xent_result *res, const IO *logits,
                                       IO *dlogits, double *row_loss) {
  typedef typename Math<IO>::type A;
  const A scale = xent_scale<A>(res);
  GDP_MIXER_FOR(r, rows) {
    const IO *x = logits + r * V;
    const int64_t t = target[r];
    if (t < 0) {
      if (dlogits)
        for (int64_t j = 0; j < V; j++) st(dlogits + r * V, j, (A)0);
      row_loss[r] = 0.0;
      continue;
    }
    A m = ld(x, 0);
    for (int64_t j = 1; j < V; j++) {
      const A v = ld(x, j);
      m = v > m ? v : m;
    }
    A s = (A)0;
    for (int64_t j = 0; j < V; j++) s += m_exp(ld(x, j) - m);
    const A lse = m + m_log(s);
    row_loss[r] = (double)(lse - ld(x, t));
    if (dlogits)
      for (int64_t j = 0; j < V; j++)
        st(dlogits + r * V, j, scale * (m_exp(ld(x, j) - lse) - (j == t ? (A)1 : (A)0)));
  }
}

template <typename IO>
__global__ void xent_row_kernel(int64_t rows, int64_t V, const int64_t *target,
                                const gdp_cuda_xent_result *res, const IO *logits, IO *dlogits,
                                double *row_loss) {
  typedef typename Math<IO>::type A;
  __shared__ A red[32];
  const A scale = xent_scale<A>(res);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const IO *x = logits + r * V;
    const int64_t t = target[r];
    if (t < 0) { /* uniform over the block */
      if (dlogits)
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) st(dlogits + r * V, j, (A)0);
      if (threadIdx.x == 0) row_loss[r] = 0.0;
      continue;
    }
    A m = ld(x, 0);
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const A v = ld(x, j);
      m = v > m ? v : m;
    }
    m = block_max(m, red);
    A s = (A)0;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += m_exp(ld(x, j) - m);
    s = block_sum(s, red);
    const A lse = m + m_log(s);
    if (threadIdx.x == 0) row_loss[r] = (double)(lse - ld(x, t));
    if (dlogits)
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
        st(dlogits + r * V, j, scale * (m_exp(ld(x, j) - lse) - (j == t ? (A)1 : (A)0)));
  }
}

/* result = {the mean of the counted rows' losses, the count}: the sum of v[0..n) in a
 * fixed order (thread i adds i, i + blockDim, ..., then a fixed tree over the block). */
__global__ void xent_sum_kernel(int64_t n, const double *v, const gdp_cuda_xent_result *res,
                                double *result) {
  __shared__ double red[32];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += v[i];
  s = block_sum(s, red);
  if (threadIdx.x == 0) {
    result[0] = s * xent_scale<double>(res);
    result[1] = (double)res->count;
  }
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

extern "C" size_t gdp_cuda_cross_entropy_workspace(int64_t rows) {
  return (size_t)(rows > 0 ? rows : 1) * (sizeof(double) + sizeof(int64_t));
}

extern "C" gdp_status gdp_cuda_cross_entropy(int dtype, int64_t rows, int64_t V,
                                             const void *targets, int targets_dtype,
                                             const double *mask, int64_t ignore_index,
                                             const void *logits, void *dlogits,
                                             gdp_cuda_xent_result *res, double *result,
                                             void *workspace, void *stream) {
  static const char *func = "gdp_cuda_cross_entropy";
  cudaStream_t s = (cudaStream_t)stream;
  double *row_loss = (double *)workspace;
  int64_t *target = (int64_t *)(row_loss + (rows > 0 ? rows : 1));
  cudaError_t e = cudaMemsetAsync(res, 0, sizeof *res, s);
  if (e == cudaSuccess) e = cudaMemsetAsync(&res->first_bad, 0xff, sizeof res->first_bad, s);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return GDP_ERROR_IN(func, GDP_ERR_CUDA, "clearing the loss's result block failed: %s (%s)",
                        cudaGetErrorName(e), cudaGetErrorString(e));
  }
  if (rows > 0) {
    if (targets_dtype == GDP_DTYPE_I32)
      xent_targets_kernel<int32_t><<<grid_for(rows), THREADS, 0, s>>>(rows, V, targets, mask,
                                                                      ignore_index, target, res);
    else
      xent_targets_kernel<int64_t><<<grid_for(rows), THREADS, 0, s>>>(rows, V, targets, mask,
                                                                      ignore_index, target, res);
    GDP_TRY(launched(func, "xent_targets_kernel"));
    const unsigned blocks = (unsigned)(rows < XENT_MAX_BLOCKS ? rows : XENT_MAX_BLOCKS);
    if (V <= XENT_THREAD_ROW_V)
      GDP_MIXER_DISPATCH(func, dtype,
                         xent_thread_row_kernel<IO><<<grid_for(rows), THREADS, 0, s>>>(
                             rows, V, target, res, (const IO *)logits, (IO *)dlogits, row_loss));
    else
      GDP_MIXER_DISPATCH(func, dtype,
                         xent_row_kernel<IO><<<blocks, XENT_THREADS, 0, s>>>(
                             rows, V, target, res, (const IO *)logits, (IO *)dlogits, row_loss));
    GDP_TRY(launched(func, "xent_row_kernel"));
  }
  xent_sum_kernel<<<1, XENT_SUM_THREADS, 0, s>>>(rows, row_loss, res, result);
  return launched(func, "xent_sum_kernel");
}
