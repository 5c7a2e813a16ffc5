/*
 * cuda_check.h -- GDP_CUDA_TRY / GDP_CUBLAS_TRY for C files that call the CUDA runtime
 * or cuBLAS (backend_cuda.c, and the NCCL comm code when it needs CUDA calls).
 *
 *   GDP_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream));
 *
 * On failure: clears the (non-sticky) error state so that later calls are not blamed
 * for it, records "<stmt> failed: <error name> (<error string>)" via GDP_ERROR and
 * returns GDP_ERR_OOM for cudaErrorMemoryAllocation, else GDP_ERR_CUDA.
 */
#ifndef GDP_CUDA_CHECK_H
#define GDP_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#include "internal.h"

#define GDP_CUDA_TRY(stmt)                                                                   \
  do {                                                                                       \
    cudaError_t gdp_cuda_e_ = (stmt);                                                        \
    if (gdp_cuda_e_ != cudaSuccess) {                                                        \
      (void)cudaGetLastError();                                                              \
      return GDP_ERROR(gdp_cuda_e_ == cudaErrorMemoryAllocation ? GDP_ERR_OOM : GDP_ERR_CUDA, \
                       "%s failed: %s (%s)", #stmt, cudaGetErrorName(gdp_cuda_e_),           \
                       cudaGetErrorString(gdp_cuda_e_));                                     \
    }                                                                                        \
  } while (0)

/* Only for files that include <cublas_v2.h> first. */
#define GDP_CUBLAS_TRY(stmt)                                                                 \
  do {                                                                                       \
    cublasStatus_t gdp_cublas_s_ = (stmt);                                                   \
    if (gdp_cublas_s_ != CUBLAS_STATUS_SUCCESS)                                              \
      return GDP_ERROR(gdp_cublas_s_ == CUBLAS_STATUS_ALLOC_FAILED ? GDP_ERR_OOM : GDP_ERR_CUDA, \
                       "%s failed: %s (%s)", #stmt, cublasGetStatusName(gdp_cublas_s_),      \
                       cublasGetStatusString(gdp_cublas_s_));                                \
  } while (0)

#endif /* GDP_CUDA_CHECK_H */
