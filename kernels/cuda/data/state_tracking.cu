/*
 * state_tracking.cu -- the state-tracking tasks on cuda: one thread per sequence runs
 * the same row scan as the cpu (../../state_tracking.h), with the product table in
 * shared memory (at most GDP_STATE_TABLE_MAX^2 = 16 KiB).  The scan is sequential in t, so the
 * parallelism is the batch; it is a data generator, not a hot loop.
 */
#include <cuda_runtime.h>

#include "../../kernel_status.h"
#include "state_tracking_cuda.h"

namespace {

enum { THREADS = 128 };

__global__ void state_tracking_kernel(gdp_state_tracking_problem p, const uint8_t *mul_dev,
                                      int32_t *tokens, int32_t *labels) {
  extern __shared__ uint8_t mul[];
  const int64_t nn = mul_dev ? p.num_elements * p.num_elements : 0;
  for (int64_t i = threadIdx.x; i < nn; i += blockDim.x) mul[i] = mul_dev[i];
  __syncthreads();
  const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (b < p.batch)
    gdp_state_tracking_row(&p, mul_dev ? mul : NULL, b, tokens + b * p.length,
                           labels + b * p.length);
}

}  // namespace

extern "C" gdp_status gdp_cuda_state_tracking(const gdp_state_tracking_problem *p,
                                              const uint8_t *mul_dev, int32_t *tokens,
                                              int32_t *labels, void *stream) {
  static const char *func = "gdp_cuda_state_tracking";
  if (p->batch == 0 || p->length == 0) return GDP_OK;
  const int64_t blocks = (p->batch + THREADS - 1) / THREADS;
  if (blocks > 0x7fffffff)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "batch: expected at most %lld sequences, got %lld",
                        (long long)0x7fffffff * THREADS, (long long)p->batch);
  const size_t shared = mul_dev ? (size_t)(p->num_elements * p->num_elements) : 0;
  gdp_state_tracking_problem host_free = *p;
  host_free.mul = NULL; /* the kernel reads mul_dev */
  state_tracking_kernel<<<(unsigned)blocks, THREADS, shared, (cudaStream_t)stream>>>(
      host_free, mul_dev, tokens, labels);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_CUDA, "launch of state_tracking_kernel failed: %s (%s)",
                      cudaGetErrorName(e), cudaGetErrorString(e));
}
