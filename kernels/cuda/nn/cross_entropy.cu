/*
 * cross_entropy.cu -- the token loss and its gradient on cuda, with the semantics of
 * kernels/cpu/cross_entropy.c:
 *   m = max(row), lse = m + log(sum exp(row - m)), loss_r = lse - row[target],
 *   dlogits = scale (exp(row - lse) - onehot(target)).
 * One block per row (block reductions for the max and the sum, in the math type:
 * float32 for f32 and bf16); the row losses go to the workspace as doubles and one
 * block adds them in a fixed order (no atomics).
 */
#include <math.h>

#include "../mixer/common.cuh"
#include "nn_cuda.h"

namespace gdp_mixer {
namespace {

enum { XENT_THREADS = 256, XENT_MAX_BLOCKS = 65535, XENT_SUM_THREADS = 1024 };

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

template <typename IO>
__global__ void xent_row_kernel(int64_t rows, int64_t V, const int64_t *target,
                                typename Math<IO>::type scale, const IO *logits, IO *dlogits,
                                double *row_loss) {
  typedef typename Math<IO>::type A;
  __shared__ A red[32];
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

/* *out = sum of v[0..n) in a fixed order: thread i adds i, i + blockDim, ..., then a
 * fixed tree over the block. */
__global__ void xent_sum_kernel(int64_t n, const double *v, double *out) {
  __shared__ double red[32];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += v[i];
  s = block_sum(s, red);
  if (threadIdx.x == 0) *out = s;
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

extern "C" size_t gdp_cuda_cross_entropy_workspace(int64_t rows) {
  return (size_t)(rows > 0 ? rows : 1) * sizeof(double);
}

extern "C" gdp_status gdp_cuda_cross_entropy(int dtype, int64_t rows, int64_t V,
                                             const int64_t *target, double scale,
                                             const void *logits, void *dlogits,
                                             double *loss_sum_dev, void *workspace,
                                             void *stream) {
  static const char *func = "gdp_cuda_cross_entropy";
  cudaStream_t s = (cudaStream_t)stream;
  double *row_loss = (double *)workspace;
  if (rows > 0) {
    const unsigned blocks = (unsigned)(rows < XENT_MAX_BLOCKS ? rows : XENT_MAX_BLOCKS);
    GDP_MIXER_DISPATCH(func, dtype,
                       xent_row_kernel<IO><<<blocks, XENT_THREADS, 0, s>>>(
                           rows, V, target, (typename Math<IO>::type)scale, (const IO *)logits,
                           (IO *)dlogits, row_loss));
    GDP_TRY(launched(func, "xent_row_kernel"));
  }
  xent_sum_kernel<<<1, XENT_SUM_THREADS, 0, s>>>(rows, row_loss, loss_sum_dev);
  return launched(func, "xent_sum_kernel");
}
