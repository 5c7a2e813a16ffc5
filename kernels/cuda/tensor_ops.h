/*
 * tensor_ops.h -- C-callable launchers of the CUDA tensor kernels: strided copy with
 * dtype conversion, fill, Philox random fills, elementwise binary ops and float64
 * reductions.  Plain C (included by core/src/backend_cuda.c, compiled by gcc).
 *
 * Every launcher takes the logical shape (ndim 0..GDP_MAX_DIMS, row-major order) and
 * one gdp_cuda_operand per tensor: the device address of element 0, its gdp_dtype and
 * its strides in elements (any, including 0 and negative for inputs).  The launcher
 * merges dimensions that are contiguous in every operand, takes a contiguous fast path
 * when all operands collapse to one unit-stride dimension, and otherwise a generic
 * strided kernel.  Work is queued on `stream`; the return value is the launch error
 * (cudaSuccess when queued), so callers wrap launches in GDP_CUDA_TRY.
 *
 * Conversions are those of the CPU backend (the oracle), bit for bit: narrowing to a
 * float type rounds once to nearest even (float64 and int64 -> bfloat16 included, NaN
 * stays NaN), float -> integer truncates toward zero.  A value an integer dtype has no
 * value for (NaN, +-inf, out of range, int64 -> int32 too) is stored saturated (NaN ->
 * 0) and its element recorded on the device: a caller brackets copies and binary ops
 * into i32/i64 with gdp_cuda_int_check_begin / _end and reports the error (the CPU
 * backend's rule: such conversions are errors).
 */
#ifndef GDP_KERNELS_CUDA_TENSOR_OPS_H
#define GDP_KERNELS_CUDA_TENSOR_OPS_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#include "gdp.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gdp_cuda_operand {
  void *data;                   /* device address of element 0 (NULL: operand unused) */
  int dtype;                    /* gdp_dtype */
  int64_t stride[GDP_MAX_DIMS]; /* in elements, one per logical dimension */
} gdp_cuda_operand;

/* Same values as gdp_binary_kind / gdp_reduce_kind / gdp_rng_kind in
 * core/src/backend_impl.h (backend_cuda.c checks that at compile time); repeated here
 * because that header is C-only (stdatomic.h) and the .cu files cannot include it. */
enum {
  GDP_CUDA_BINARY_AXPY = 0, /* out = a + alpha*b */
  GDP_CUDA_BINARY_MUL = 1,  /* out = a*b */
  GDP_CUDA_BINARY_SCALE = 2 /* out = alpha*a */
};
enum {
  GDP_CUDA_REDUCE_SUM = 0,
  GDP_CUDA_REDUCE_DOT = 1,
  GDP_CUDA_REDUCE_SUMSQ = 2,
  GDP_CUDA_REDUCE_MAXABS = 3, /* NaN anywhere gives NaN */
  GDP_CUDA_REDUCE_NONFINITE = 4,
  GDP_CUDA_REDUCE_DIFF_SUMSQ = 5
};
enum { GDP_CUDA_RNG_UNIFORM = 0, GDP_CUDA_RNG_NORMAL = 1 };

/* Doubles of device workspace gdp_cuda_reduce needs (per-block partial results). */
enum { GDP_CUDA_REDUCE_WORKSPACE = 1024 + 1 };

/* One thread that spins for `ms` milliseconds of the device's global timer: it holds
 * `stream` while the host queues work behind it (gdp_ctx_timer_start). */
cudaError_t gdp_cuda_spin(double ms, cudaStream_t stream);

/* Resets the device's record of integer conversions without a value (queued on stream). */
cudaError_t gdp_cuda_int_check_begin(cudaStream_t stream);
/* Waits for stream and gives the first such element since the reset (row-major over the
 * launch's logical shape, 0-based), or -1 for none. */
cudaError_t gdp_cuda_int_check_end(cudaStream_t stream, int64_t *first_bad);

/* dst = src converted to dst's dtype (same logical shape; must not overlap). */
cudaError_t gdp_cuda_copy(int ndim, const int64_t *shape, const gdp_cuda_operand *dst,
                          const gdp_cuda_operand *src, cudaStream_t stream);

/* Every element of dst = value converted to dst's dtype. */
cudaError_t gdp_cuda_fill(int ndim, const int64_t *shape, const gdp_cuda_operand *dst,
                          double value, cudaStream_t stream);

/* Random fill of a float64/float32/bfloat16 operand: element i (row-major) takes word
 * i%4 of Philox block (offset + i/4) keyed by seed, transformed as kernels/philox.h
 * says (uniform on [a, b) or normal with mean a and std b).  Bit-identical to the CPU
 * backend for the same seed and offset. */
cudaError_t gdp_cuda_rng(int ndim, const int64_t *shape, const gdp_cuda_operand *dst,
                         int kind, double a, double b, uint64_t seed, uint64_t offset,
                         cudaStream_t stream);

/* out = op(a, b) computed in float64 and converted to out's dtype.  b is ignored for
 * SCALE.  out may alias a or b exactly (same address and strides). */
cudaError_t gdp_cuda_binary(int ndim, const int64_t *shape, const gdp_cuda_operand *out,
                            const gdp_cuda_operand *a, const gdp_cuda_operand *b, int kind,
                            double alpha, cudaStream_t stream);

/* Queues a float64 reduction of a (and b for DOT and DIFF_SUMSQ) and an async copy of
 * the one-double result into *result_host (pinned host memory, valid after the stream
 * is synchronised).  workspace: GDP_CUDA_REDUCE_WORKSPACE device doubles.  The block
 * layout depends only on the element count, so results are run-to-run deterministic. */
cudaError_t gdp_cuda_reduce(int ndim, const int64_t *shape, const gdp_cuda_operand *a,
                            const gdp_cuda_operand *b, int kind, double *workspace,
                            double *result_host, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* GDP_KERNELS_CUDA_TENSOR_OPS_H */
