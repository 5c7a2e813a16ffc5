/*
 * tensor_ops.cu -- CUDA kernels behind the tensor part of the cuda backend: strided
 * copy with dtype conversion, fill, Philox random fills, binary elementwise ops and
 * float64 reductions (see tensor_ops.h for the contract).
 *
 * Every op has two kernels: a contiguous one (all operands collapse to one unit-stride
 * run) and a strided one that turns a row-major linear index into per-operand offsets.
 * The strided kernels use 32-bit index arithmetic when the element count allows it,
 * because 64-bit division is several times slower on the GPU and the index
 * decomposition is their main cost.
 */
#include <cuda_runtime.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tensor_ops.h"
#include "philox.h"

namespace {

constexpr int kBlock = 256;
constexpr int kMaxOperands = 3;
constexpr int kReduceBlocks = GDP_CUDA_REDUCE_WORKSPACE - 1; /* last slot holds the result */
constexpr int kReduceFinalThreads = 1024;
static_assert(kReduceBlocks == kReduceFinalThreads, "final reduce covers every partial");

/* ------------------------------------------------------------------ dtypes */

/* bfloat16 as its bit pattern; a distinct type so that templates can tell it apart. */
struct bf16 {
  uint16_t bits;
};

__host__ __device__ inline float bf16_to_float(bf16 x) {
  uint32_t u = (uint32_t)x.bits << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* The conversions below repeat those of the CPU backend (core/src/backend_cpu.c), the
 * oracle, so that device copies match it bit for bit: every narrowing to a float type
 * rounds once to nearest even.  A value with no integer of the target type (NaN, +-inf,
 * out of range) is an error on both: the CPU checks before the copy, the device stores
 * a saturated value (NaN -> 0) and records the element (IntRange, note_bad_int below),
 * which the launcher's caller reads back after the kernel (gdp_cuda_int_check_end). */

/* float -> bf16: round to nearest even; NaN stays a (quiet) NaN instead of rounding
 * into inf. */
__host__ __device__ inline bf16 bf16_from_float(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
    return bf16{(uint16_t)((u >> 16) | 0x0040u)};
  return bf16{(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

/* double -> bf16 rounded once: to float with round-to-odd (toward zero, then set the
 * last bit when anything was dropped), then to bf16 with round-to-nearest-even.  A
 * plain (float) cast first would round twice and break ties wrongly. */
__host__ __device__ inline bf16 bf16_from_double(double x) {
  float f = (float)x;
  if (isfinite(x) && (double)f != x) {
    if (fabs((double)f) > fabs(x)) f = nextafterf(f, 0.0f);
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u |= 1u;
    memcpy(&f, &u, sizeof f);
  }
  return bf16_from_float(f);
}

__host__ __device__ inline int count_leading_zeros64(uint64_t u) {
#ifdef __CUDA_ARCH__
  return __clzll((long long)u);
#else
  return __builtin_clzll(u);
#endif
}

/* int64 -> bf16 rounded once: keep the top 53 bits with a sticky bit (exact in a
 * double, round-to-odd), then as above. */
__host__ __device__ inline bf16 bf16_from_int64(int64_t x) {
  const int64_t exact = (int64_t)1 << 53;
  if (x > -exact && x < exact) return bf16_from_double((double)x);
  uint64_t u = x < 0 ? (uint64_t)0 - (uint64_t)x : (uint64_t)x;
  int shift = 11 - count_leading_zeros64(u); /* u >= 2^53: drop this many low bits */
  uint64_t kept = u >> shift;
  if (u & ((UINT64_C(1) << shift) - 1)) kept |= 1u;
  double d = ldexp((double)kept, shift);
  return bf16_from_double(x < 0 ? -d : d);
}

__host__ __device__ inline int32_t sat_i32(double x) {
  if (x != x) return 0;
  if (x >= 2147483647.0) return INT32_MAX;
  if (x <= -2147483648.0) return INT32_MIN;
  return (int32_t)x;
}

__host__ __device__ inline int64_t sat_i64(double x) {
  if (x != x) return 0;
  if (x >= 9223372036854775808.0) return INT64_MAX;
  if (x < -9223372036854775808.0) return INT64_MIN;
  return (int64_t)x;
}

/* ------------------------------------------------------------------ integer ranges */

/* The lowest iteration index (row-major over the logical shape, 0-based) of an element
 * whose conversion to an integer type had no value; ULLONG_MAX when none.  One per
 * device: gdp_cuda_int_check_begin resets it on a stream, _end reads it. */
__device__ unsigned long long g_first_bad_int = ULLONG_MAX;

__device__ inline void note_bad_int(int64_t i) {
  atomicMin(&g_first_bad_int, (unsigned long long)i);
}

/* IntRange<D>::fits(x): whether x has a value in D (the CPU's fits_int): only the
 * integer targets can fail, and there NaN fails every comparison. */
template <typename D>
struct IntRange {
  template <typename S>
  __device__ static bool fits(S) { return true; }
};
template <>
struct IntRange<int32_t> {
  __device__ static bool fits(double x) { return x > -2147483649.0 && x < 2147483648.0; }
  __device__ static bool fits(float x) { return fits((double)x); }
  __device__ static bool fits(bf16 x) { return fits((double)bf16_to_float(x)); }
  __device__ static bool fits(int32_t) { return true; }
  __device__ static bool fits(int64_t x) { return x >= INT32_MIN && x <= INT32_MAX; }
};
template <>
struct IntRange<int64_t> {
  __device__ static bool fits(double x) {
    return x >= -9223372036854775808.0 && x < 9223372036854775808.0;
  }
  __device__ static bool fits(float x) { return fits((double)x); }
  __device__ static bool fits(bf16 x) { return fits((double)bf16_to_float(x)); }
  __device__ static bool fits(int32_t) { return true; }
  __device__ static bool fits(int64_t) { return true; }
};

/* Conv<D>::from(x): x converted to D, one overload per source type. */
template <typename D>
struct Conv;
template <>
struct Conv<double> {
  template <typename S>
  __host__ __device__ static double from(S x) {
    return (double)x;
  }
  __host__ __device__ static double from(bf16 x) { return (double)bf16_to_float(x); }
};
template <>
struct Conv<float> {
  template <typename S>
  __host__ __device__ static float from(S x) {
    return (float)x; /* int64 -> float: the cast rounds correctly (cvt.rn) */
  }
  __host__ __device__ static float from(bf16 x) { return bf16_to_float(x); }
};
template <>
struct Conv<bf16> {
  __host__ __device__ static bf16 from(double x) { return bf16_from_double(x); }
  __host__ __device__ static bf16 from(float x) { return bf16_from_float(x); }
  __host__ __device__ static bf16 from(bf16 x) { return x; }
  __host__ __device__ static bf16 from(int32_t x) { return bf16_from_double((double)x); }
  __host__ __device__ static bf16 from(int64_t x) { return bf16_from_int64(x); }
};
template <>
struct Conv<int32_t> {
  __host__ __device__ static int32_t from(double x) { return sat_i32(x); }
  __host__ __device__ static int32_t from(float x) { return sat_i32((double)x); }
  __host__ __device__ static int32_t from(bf16 x) { return sat_i32((double)bf16_to_float(x)); }
  __host__ __device__ static int32_t from(int32_t x) { return x; }
  __host__ __device__ static int32_t from(int64_t x) {
    return x > INT32_MAX ? INT32_MAX : x < INT32_MIN ? INT32_MIN : (int32_t)x;
  }
};
template <>
struct Conv<int64_t> {
  __host__ __device__ static int64_t from(double x) { return sat_i64(x); }
  __host__ __device__ static int64_t from(float x) { return sat_i64((double)x); }
  __host__ __device__ static int64_t from(bf16 x) { return sat_i64((double)bf16_to_float(x)); }
  __host__ __device__ static int64_t from(int32_t x) { return (int64_t)x; }
  __host__ __device__ static int64_t from(int64_t x) { return x; }
};

template <typename T>
__device__ inline double to_f64(T x) {
  return Conv<double>::from(x);
}

/* Calls f(T{}) with T the C++ type of a gdp_dtype. */
template <typename F>
cudaError_t with_dtype(int dtype, F &&f) {
  switch (dtype) {
    case GDP_DTYPE_F64: return f(double{});
    case GDP_DTYPE_F32: return f(float{});
    case GDP_DTYPE_BF16: return f(bf16{});
    case GDP_DTYPE_I32: return f(int32_t{});
    case GDP_DTYPE_I64: return f(int64_t{});
    default: return cudaErrorInvalidValue;
  }
}

/* Runtime-dtype element access for the strided kernels, whose operands may mix dtypes:
 * the switch is on a kernel argument, so every thread takes the same branch. */
__device__ inline double load_f64(const void *p, int dtype, int64_t off) {
  switch (dtype) {
    case GDP_DTYPE_F64: return ((const double *)p)[off];
    case GDP_DTYPE_F32: return (double)((const float *)p)[off];
    case GDP_DTYPE_BF16: return Conv<double>::from(((const bf16 *)p)[off]);
    case GDP_DTYPE_I32: return (double)((const int32_t *)p)[off];
    default: return (double)((const int64_t *)p)[off];
  }
}

/* Stores v at p[off] in p's dtype; element i (the iteration index) is recorded when an
 * integer dtype has no value for v. */
__device__ inline void store_f64(void *p, int dtype, int64_t off, double v, int64_t i) {
  if ((dtype == GDP_DTYPE_I32 && !IntRange<int32_t>::fits(v)) ||
      (dtype == GDP_DTYPE_I64 && !IntRange<int64_t>::fits(v)))
    note_bad_int(i);
  switch (dtype) {
    case GDP_DTYPE_F64: ((double *)p)[off] = v; break;
    case GDP_DTYPE_F32: ((float *)p)[off] = Conv<float>::from(v); break;
    case GDP_DTYPE_BF16: ((bf16 *)p)[off] = Conv<bf16>::from(v); break;
    case GDP_DTYPE_I32: ((int32_t *)p)[off] = Conv<int32_t>::from(v); break;
    default: ((int64_t *)p)[off] = Conv<int64_t>::from(v); break;
  }
}

/* ------------------------------------------------------------------ iteration */

/* The logical shape after dropping size-1 dimensions and merging neighbours that are
 * contiguous in every operand, with each operand's strides. */
struct Iter {
  int ndim;
  int64_t size[GDP_MAX_DIMS];
  int64_t stride[kMaxOperands][GDP_MAX_DIMS];
};

/* Fills *it and returns numel (0: nothing to do). */
int64_t make_iter(int ndim, const int64_t *shape, int nops, const gdp_cuda_operand *const *ops,
                  Iter *it) {
  int64_t numel = 1;
  for (int d = 0; d < ndim; d++) numel *= shape[d];
  memset(it, 0, sizeof *it);
  if (numel == 0) return 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] == 1) continue;
    int last = it->ndim - 1;
    bool mergeable = last >= 0;
    for (int k = 0; k < nops && mergeable; k++)
      mergeable = it->stride[k][last] == ops[k]->stride[d] * shape[d];
    if (mergeable) {
      it->size[last] *= shape[d];
      for (int k = 0; k < nops; k++) it->stride[k][last] = ops[k]->stride[d];
      continue;
    }
    it->size[it->ndim] = shape[d];
    for (int k = 0; k < nops; k++) it->stride[k][it->ndim] = ops[k]->stride[d];
    it->ndim++;
  }
  return numel;
}

bool iter_contiguous(const Iter &it, int nops) {
  if (it.ndim == 0) return true; /* one element */
  if (it.ndim > 1) return false;
  for (int k = 0; k < nops; k++)
    if (it.stride[k][0] != 1) return false;
  return true;
}

bool fits_u32(int64_t numel) { return numel <= (int64_t)UINT32_MAX; }

unsigned grid_for(int64_t work_items) {
  int64_t g = (work_items + kBlock - 1) / kBlock;
  if (g < 1) g = 1;
  if (g > (1 << 20)) g = 1 << 20; /* grid-stride loops cover the rest */
  return (unsigned)g;
}

/* Element offsets of row-major linear index i in each of the first NOPS operands.  The
 * loop is unrolled over the fixed maximum so that the Iter fields stay in the constant
 * bank (dynamic indexing would copy the struct to local memory). */
template <int NOPS, typename Index>
__device__ inline void iter_offsets(const Iter &it, Index i, int64_t off[NOPS]) {
#pragma unroll
  for (int k = 0; k < NOPS; k++) off[k] = 0;
#pragma unroll
  for (int d = GDP_MAX_DIMS - 1; d >= 0; d--) {
    if (d < it.ndim) {
      Index size = (Index)it.size[d];
      Index c = i % size;
      i /= size;
#pragma unroll
      for (int k = 0; k < NOPS; k++) off[k] += (int64_t)c * it.stride[k][d];
    }
  }
}

__device__ inline int64_t thread_index() {
  return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ inline int64_t grid_stride() { return (int64_t)gridDim.x * blockDim.x; }

/* ------------------------------------------------------------------ copy, fill */

template <typename D, typename S>
__global__ void copy_contiguous_kernel(D *dst, const S *src, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += grid_stride()) {
    if (!IntRange<D>::fits(src[i])) note_bad_int(i);
    dst[i] = Conv<D>::from(src[i]);
  }
}

template <typename D, typename S, typename Index>
__global__ void copy_strided_kernel(D *dst, const S *src, const Iter it, Index n) {
  for (int64_t i = thread_index(); i < (int64_t)n; i += grid_stride()) {
    int64_t off[2];
    iter_offsets<2, Index>(it, (Index)i, off);
    if (!IntRange<D>::fits(src[off[1]])) note_bad_int(i);
    dst[off[0]] = Conv<D>::from(src[off[1]]);
  }
}

template <typename T>
__global__ void fill_contiguous_kernel(T *dst, T value, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += grid_stride()) dst[i] = value;
}

template <typename T, typename Index>
__global__ void fill_strided_kernel(T *dst, T value, const Iter it, Index n) {
  for (int64_t i = thread_index(); i < (int64_t)n; i += grid_stride()) {
    int64_t off[1];
    iter_offsets<1, Index>(it, (Index)i, off);
    dst[off[0]] = value;
  }
}

/* Rows: what merges to two dimensions with a unit inner stride in every operand, i.e. a
 * [rows, width] array of contiguous rows at a pitch -- a narrow of the last dimension,
 * such as the value columns of a wider buffer.  The strided kernels above divide per
 * element and move one element each (bf16 rows of 128 at a 256-element pitch: ~0.8 TB/s
 * on an H200); these move the widest word W (16, 8, 4, 2 or 1 bytes) that the width, the
 * pitches and both addresses allow, so a row of bf16 is 16 words, not 128 elements. */
template <typename W>
__global__ void copy_rows_kernel(char *dst, const char *src, int64_t dpitch, int64_t spitch,
                                 int64_t width, int64_t rows) {
  const int64_t n = rows * width;
  for (int64_t i = thread_index(); i < n; i += grid_stride()) {
    const int64_t r = i / width, c = i - r * width;
    ((W *)(dst + r * dpitch))[c] = ((const W *)(src + r * spitch))[c];
  }
}

template <typename W>
__global__ void fill_rows_kernel(char *dst, W value, int64_t dpitch, int64_t width, int64_t rows) {
  const int64_t n = rows * width;
  for (int64_t i = thread_index(); i < n; i += grid_stride()) {
    const int64_t r = i / width, c = i - r * width;
    ((W *)(dst + r * dpitch))[c] = value;
  }
}

/* The bytes of the row layout of an Iter of two dimensions with unit inner strides:
 * false when it is not one.  Element strides become byte pitches of elem bytes. */
struct Rows {
  int64_t rows, width_bytes, pitch_bytes[2];
};
bool rows_layout(const Iter &it, int nops, size_t elem, Rows *out) {
  if (it.ndim != 2) return false;
  for (int k = 0; k < nops; k++)
    if (it.stride[k][1] != 1 || it.stride[k][0] < 0) return false;
  out->rows = it.size[0];
  out->width_bytes = it.size[1] * (int64_t)elem;
  for (int k = 0; k < nops; k++) out->pitch_bytes[k] = it.stride[k][0] * (int64_t)elem;
  return true;
}

/* The widest word that divides every one of the given byte quantities (1 at worst). */
size_t rows_word(const int64_t *quantities, int count) {
  size_t w = 16;
  for (int i = 0; i < count; i++)
    while (w > 1 && quantities[i] % (int64_t)w != 0) w /= 2;
  return w;
}

/* Calls f with a value of the unsigned word type of w bytes (16, 8, 4, 2, else 1). */
template <typename F>
cudaError_t with_word(size_t w, F &&f) {
  switch (w) {
    case 16: return f(uint4{});
    case 8: return f(uint2{});
    case 4: return f(uint32_t{});
    case 2: return f(uint16_t{});
    default: return f(uint8_t{});
  }
}

cudaError_t copy_rows(void *dst, const void *src, const Rows &r, cudaStream_t stream) {
  const int64_t q[5] = {r.width_bytes, r.pitch_bytes[0], r.pitch_bytes[1], (int64_t)(uintptr_t)dst,
                        (int64_t)(uintptr_t)src};
  const size_t w = rows_word(q, 5);
  const int64_t width = r.width_bytes / (int64_t)w;
  return with_word(w, [&](auto tag) {
    using W = decltype(tag);
    copy_rows_kernel<W><<<grid_for(r.rows * width), kBlock, 0, stream>>>(
        (char *)dst, (const char *)src, r.pitch_bytes[0], r.pitch_bytes[1], width, r.rows);
    return cudaGetLastError();
  });
}

/* value: elem bytes, repeated over the word (the word is a multiple of elem: the width and
 * the pitch are, and elem is a power of two). */
cudaError_t fill_rows(void *dst, const unsigned char *value, size_t elem, const Rows &r,
                      cudaStream_t stream) {
  const int64_t q[3] = {r.width_bytes, r.pitch_bytes[0], (int64_t)(uintptr_t)dst};
  size_t w = rows_word(q, 3);
  if (w < elem) w = elem;
  unsigned char pattern[16];
  for (size_t i = 0; i < w; i++) pattern[i] = value[i % elem];
  const int64_t width = r.width_bytes / (int64_t)w;
  return with_word(w, [&](auto tag) {
    using W = decltype(tag);
    W v;
    memcpy(&v, pattern, sizeof v);
    fill_rows_kernel<W><<<grid_for(r.rows * width), kBlock, 0, stream>>>(
        (char *)dst, v, r.pitch_bytes[0], width, r.rows);
    return cudaGetLastError();
  });
}

/* ------------------------------------------------------------------ rng */

/* One thread per Philox block: it produces the 4 consecutive elements 4j..4j+3. */
template <typename T, int KIND, bool CONTIGUOUS, typename Index>
__global__ void rng_kernel(T *dst, const Iter it, Index n, double a, double b, uint64_t seed,
                           uint64_t offset) {
  int64_t blocks = (int64_t)gdp_philox_blocks_for((uint64_t)n);
  for (int64_t j = thread_index(); j < blocks; j += grid_stride()) {
    uint32_t words[4];
    gdp_philox_stream_block(seed, offset + (uint64_t)j, words);
#pragma unroll
    for (int w = 0; w < 4; w++) {
      int64_t i = 4 * j + w;
      if (i >= (int64_t)n) break;
      double v = KIND == GDP_CUDA_RNG_UNIFORM ? gdp_philox_uniform(words[w], a, b)
                                              : gdp_philox_normal(words, w, a, b);
      int64_t off;
      if (CONTIGUOUS) {
        off = i;
      } else {
        int64_t offs[1];
        iter_offsets<1, Index>(it, (Index)i, offs);
        off = offs[0];
      }
      dst[off] = Conv<T>::from(v);
    }
  }
}

/* ------------------------------------------------------------------ binary */

template <int KIND>
__device__ inline double binary_apply(double x, double y, double alpha) {
  if (KIND == GDP_CUDA_BINARY_AXPY) return x + alpha * y;
  if (KIND == GDP_CUDA_BINARY_MUL) return x * y;
  return alpha * x;
}

__device__ inline double binary_apply_rt(int kind, double x, double y, double alpha) {
  switch (kind) {
    case GDP_CUDA_BINARY_AXPY: return binary_apply<GDP_CUDA_BINARY_AXPY>(x, y, alpha);
    case GDP_CUDA_BINARY_MUL: return binary_apply<GDP_CUDA_BINARY_MUL>(x, y, alpha);
    default: return binary_apply<GDP_CUDA_BINARY_SCALE>(x, y, alpha);
  }
}

/* All operands of one dtype and contiguous: the common case, fully typed. */
template <typename T, int KIND>
__global__ void binary_contiguous_kernel(T *out, const T *a, const T *b, int64_t n,
                                         double alpha) {
  for (int64_t i = thread_index(); i < n; i += grid_stride()) {
    double y = KIND == GDP_CUDA_BINARY_SCALE ? 0.0 : to_f64(b[i]);
    const double v = binary_apply<KIND>(to_f64(a[i]), y, alpha);
    if (!IntRange<T>::fits(v)) note_bad_int(i);
    out[i] = Conv<T>::from(v);
  }
}

/* bf16 a * b and a +- b, 8 elements (16 bytes) a thread, in float32 with the float64
 * path's bits: a product of two bf16 values (8 significant bits each) is exact in
 * float32 wherever it is normal (a subnormal or zero one takes the float64 path); a sum
 * a +- b is exact in float32 unless |b| < 2^-15 |a| (or the reverse), and then a alone
 * is the nearest bf16 both of the exact sum and of its float32 rounding, which lies
 * far from the midpoints around a.  Rounded once to bf16 as the float64 path rounds the
 * exact value. */
template <int KIND>
__device__ inline bf16 binary_bf16_f32(bf16 x, bf16 y, float sign) {
  const float fx = bf16_to_float(x), fy = bf16_to_float(y);
  if (KIND == GDP_CUDA_BINARY_MUL) {
    const float r = __fmul_rn(fx, fy);
    if (fabsf(r) >= FLT_MIN || isnan(r) || isinf(r)) return bf16_from_float(r);
    return bf16_from_double((double)fx * (double)fy);
  }
  return bf16_from_float(__fadd_rn(fx, sign * fy));
}

template <int KIND>
__global__ void binary_bf16x8_kernel(bf16 *out, const bf16 *a, const bf16 *b, int64_t n, float sign) {
  const int64_t n8 = n / 8;
  for (int64_t i = thread_index(); i < n8; i += grid_stride()) {
    const uint4 va = reinterpret_cast<const uint4 *>(a)[i], vb = reinterpret_cast<const uint4 *>(b)[i];
    const bf16 *pa = reinterpret_cast<const bf16 *>(&va), *pb = reinterpret_cast<const bf16 *>(&vb);
    uint4 vo;
    bf16 *po = reinterpret_cast<bf16 *>(&vo);
#pragma unroll
    for (int j = 0; j < 8; j++) po[j] = binary_bf16_f32<KIND>(pa[j], pb[j], sign);
    reinterpret_cast<uint4 *>(out)[i] = vo;
  }
  for (int64_t i = n8 * 8 + thread_index(); i < n; i += grid_stride())
    out[i] = binary_bf16_f32<KIND>(a[i], b[i], sign);
}

/* Operands 0 = out, 1 = a, 2 = b (b's data NULL for SCALE). */
struct Operands3 {
  void *data[3];
  int dtype[3];
};

template <typename Index>
__global__ void binary_strided_kernel(Operands3 ops, const Iter it, Index n, int kind,
                                      double alpha) {
  for (int64_t i = thread_index(); i < (int64_t)n; i += grid_stride()) {
    int64_t off[3];
    iter_offsets<3, Index>(it, (Index)i, off);
    double x = load_f64(ops.data[1], ops.dtype[1], off[1]);
    double y = ops.data[2] ? load_f64(ops.data[2], ops.dtype[2], off[2]) : 0.0;
    store_f64(ops.data[0], ops.dtype[0], off[0], binary_apply_rt(kind, x, y, alpha), i);
  }
}

/* ------------------------------------------------------------------ reduce */

__device__ inline double max_nan(double m, double x) {
  if (m != m || x != x) return NAN; /* NaN must never pass a check as a small error */
  return x > m ? x : m;
}

template <int KIND>
__device__ inline double reduce_term(double x, double y) {
  switch (KIND) {
    case GDP_CUDA_REDUCE_SUM: return x;
    case GDP_CUDA_REDUCE_DOT: return x * y;
    case GDP_CUDA_REDUCE_SUMSQ: return x * x;
    case GDP_CUDA_REDUCE_MAXABS: return fabs(x);
    case GDP_CUDA_REDUCE_NONFINITE: return isfinite(x) ? 0.0 : 1.0;
    default: { double d = x - y; return d * d; }
  }
}

template <int KIND>
__device__ inline double reduce_combine(double acc, double v) {
  return KIND == GDP_CUDA_REDUCE_MAXABS ? max_nan(acc, v) : acc + v;
}

/* Fixed-shape tree over the block (blockDim.x a power of two): the same grouping on
 * every run, so reductions are deterministic. */
template <int KIND>
__device__ double block_reduce(double v, double *shared) {
  unsigned t = threadIdx.x;
  shared[t] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) shared[t] = reduce_combine<KIND>(shared[t], shared[t + s]);
    __syncthreads();
  }
  return shared[0];
}

template <typename T, int KIND>
__global__ void reduce_contiguous_kernel(const T *a, const T *b, int64_t n, double *partials) {
  __shared__ double shared[kBlock];
  double acc = 0.0;
  for (int64_t i = thread_index(); i < n; i += grid_stride()) {
    double y = (KIND == GDP_CUDA_REDUCE_DOT || KIND == GDP_CUDA_REDUCE_DIFF_SUMSQ)
                   ? to_f64(b[i]) : 0.0;
    acc = reduce_combine<KIND>(acc, reduce_term<KIND>(to_f64(a[i]), y));
  }
  double r = block_reduce<KIND>(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = r;
}

template <int KIND, typename Index>
__global__ void reduce_strided_kernel(Operands3 ops, const Iter it, Index n, double *partials) {
  __shared__ double shared[kBlock];
  double acc = 0.0;
  for (int64_t i = thread_index(); i < (int64_t)n; i += grid_stride()) {
    int64_t off[2];
    iter_offsets<2, Index>(it, (Index)i, off);
    double x = load_f64(ops.data[0], ops.dtype[0], off[0]);
    double y = ops.data[1] ? load_f64(ops.data[1], ops.dtype[1], off[1]) : 0.0;
    acc = reduce_combine<KIND>(acc, reduce_term<KIND>(x, y));
  }
  double r = block_reduce<KIND>(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = r;
}

template <int KIND>
__global__ void reduce_final_kernel(double *workspace, int nblocks) {
  __shared__ double shared[kReduceFinalThreads];
  double v = (int)threadIdx.x < nblocks ? workspace[threadIdx.x] : 0.0;
  double r = block_reduce<KIND>(v, shared);
  if (threadIdx.x == 0) workspace[kReduceBlocks] = r;
}

template <int KIND>
cudaError_t reduce_launch(const Iter &it, int64_t n, const gdp_cuda_operand *a,
                          const gdp_cuda_operand *b, double *workspace, double *result_host,
                          cudaStream_t stream) {
  /* The grid depends on n alone (never on the device), so the summation order, and with
   * it the result, is the same on every run. */
  int64_t g = (n + (int64_t)kBlock * 4 - 1) / ((int64_t)kBlock * 4);
  int nblocks = (int)(g < 1 ? 1 : g > kReduceBlocks ? kReduceBlocks : g);
  bool two = b && b->data;
  bool same_dtype = !two || a->dtype == b->dtype;
  cudaError_t err = cudaSuccess;
  if (iter_contiguous(it, two ? 2 : 1) && same_dtype) {
    err = with_dtype(a->dtype, [&](auto tag) {
      using T = decltype(tag);
      reduce_contiguous_kernel<T, KIND><<<nblocks, kBlock, 0, stream>>>(
          (const T *)a->data, two ? (const T *)b->data : nullptr, n, workspace);
      return cudaGetLastError();
    });
  } else {
    Operands3 ops = {{a->data, two ? b->data : nullptr, nullptr},
                     {a->dtype, two ? b->dtype : 0, 0}};
    if (fits_u32(n))
      reduce_strided_kernel<KIND, uint32_t><<<nblocks, kBlock, 0, stream>>>(
          ops, it, (uint32_t)n, workspace);
    else
      reduce_strided_kernel<KIND, int64_t><<<nblocks, kBlock, 0, stream>>>(ops, it, n,
                                                                           workspace);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) return err;
  reduce_final_kernel<KIND><<<1, kReduceFinalThreads, 0, stream>>>(workspace, nblocks);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return cudaMemcpyAsync(result_host, workspace + kReduceBlocks, sizeof(double),
                         cudaMemcpyDeviceToHost, stream);
}

} /* namespace */

/* ------------------------------------------------------------------ launchers */

extern "C" cudaError_t gdp_cuda_int_check_begin(cudaStream_t stream) {
  static const unsigned long long none = ULLONG_MAX;
  return cudaMemcpyToSymbolAsync(g_first_bad_int, &none, sizeof none, 0, cudaMemcpyHostToDevice,
                                 stream);
}

extern "C" cudaError_t gdp_cuda_int_check_end(cudaStream_t stream, int64_t *first_bad) {
  unsigned long long got = ULLONG_MAX;
  cudaError_t e = cudaMemcpyFromSymbolAsync(&got, g_first_bad_int, sizeof got, 0,
                                            cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  *first_bad = got == ULLONG_MAX ? -1 : (int64_t)got;
  return e;
}

extern "C" cudaError_t gdp_cuda_copy(int ndim, const int64_t *shape, const gdp_cuda_operand *dst,
                                     const gdp_cuda_operand *src, cudaStream_t stream) {
  const gdp_cuda_operand *ops[2] = {dst, src};
  Iter it;
  int64_t n = make_iter(ndim, shape, 2, ops, &it);
  if (n == 0) return cudaSuccess;
  bool contiguous = iter_contiguous(it, 2);
  if (dst->dtype == src->dtype && dst->data == src->data &&
      memcmp(it.stride[0], it.stride[1], sizeof it.stride[0]) == 0)
    return cudaSuccess; /* copying a tensor onto itself */
  if (dst->dtype == src->dtype) {
    Rows rows;
    bool done = false;
    cudaError_t err = with_dtype(dst->dtype, [&](auto tag) {
      done = true;
      if (contiguous)
        return cudaMemcpyAsync(dst->data, src->data, (size_t)n * sizeof tag,
                               cudaMemcpyDeviceToDevice, stream);
      if (rows_layout(it, 2, sizeof tag, &rows))
        return copy_rows(dst->data, src->data, rows, stream);
      done = false;
      return cudaSuccess;
    });
    if (err != cudaSuccess || done) return err;
  }
  return with_dtype(dst->dtype, [&](auto dtag) {
    using D = decltype(dtag);
    return with_dtype(src->dtype, [&](auto stag) {
      using S = decltype(stag);
      if (contiguous)
        copy_contiguous_kernel<D, S><<<grid_for(n), kBlock, 0, stream>>>(
            (D *)dst->data, (const S *)src->data, n);
      else if (fits_u32(n))
        copy_strided_kernel<D, S, uint32_t><<<grid_for(n), kBlock, 0, stream>>>(
            (D *)dst->data, (const S *)src->data, it, (uint32_t)n);
      else
        copy_strided_kernel<D, S, int64_t><<<grid_for(n), kBlock, 0, stream>>>(
            (D *)dst->data, (const S *)src->data, it, n);
      return cudaGetLastError();
    });
  });
}

extern "C" cudaError_t gdp_cuda_fill(int ndim, const int64_t *shape, const gdp_cuda_operand *dst,
                                     double value, cudaStream_t stream) {
  const gdp_cuda_operand *ops[1] = {dst};
  Iter it;
  int64_t n = make_iter(ndim, shape, 1, ops, &it);
  if (n == 0) return cudaSuccess;
  bool contiguous = iter_contiguous(it, 1);
  return with_dtype(dst->dtype, [&](auto tag) {
    using T = decltype(tag);
    T v = Conv<T>::from(value); /* converted once, on the host, like the CPU does */
    unsigned char bytes[sizeof(T)];
    memcpy(bytes, &v, sizeof v);
    bool all_zero = true;
    for (size_t i = 0; i < sizeof v; i++) all_zero = all_zero && bytes[i] == 0;
    if (contiguous && all_zero)
      return cudaMemsetAsync(dst->data, 0, (size_t)n * sizeof(T), stream);
    Rows rows;
    if (rows_layout(it, 1, sizeof(T), &rows)) return fill_rows(dst->data, bytes, sizeof(T), rows, stream);
    if (contiguous)
      fill_contiguous_kernel<T><<<grid_for(n), kBlock, 0, stream>>>((T *)dst->data, v, n);
    else if (fits_u32(n))
      fill_strided_kernel<T, uint32_t><<<grid_for(n), kBlock, 0, stream>>>((T *)dst->data, v,
                                                                            it, (uint32_t)n);
    else
      fill_strided_kernel<T, int64_t><<<grid_for(n), kBlock, 0, stream>>>((T *)dst->data, v,
                                                                           it, n);
    return cudaGetLastError();
  });
}

extern "C" cudaError_t gdp_cuda_rng(int ndim, const int64_t *shape, const gdp_cuda_operand *dst,
                                    int kind, double a, double b, uint64_t seed,
                                    uint64_t offset, cudaStream_t stream) {
  if (kind != GDP_CUDA_RNG_UNIFORM && kind != GDP_CUDA_RNG_NORMAL) return cudaErrorInvalidValue;
  if (dst->dtype != GDP_DTYPE_F64 && dst->dtype != GDP_DTYPE_F32 &&
      dst->dtype != GDP_DTYPE_BF16)
    return cudaErrorInvalidValue;
  const gdp_cuda_operand *ops[1] = {dst};
  Iter it;
  int64_t n = make_iter(ndim, shape, 1, ops, &it);
  if (n == 0) return cudaSuccess;
  bool contiguous = iter_contiguous(it, 1);
  bool small = fits_u32(n);
  unsigned grid = grid_for((int64_t)gdp_philox_blocks_for((uint64_t)n));
  return with_dtype(dst->dtype, [&](auto tag) {
    using T = decltype(tag);
    T *p = (T *)dst->data;
#define GDP_RNG_LAUNCH(KIND)                                                                  \
  do {                                                                                        \
    if (contiguous)                                                                           \
      rng_kernel<T, KIND, true, int64_t><<<grid, kBlock, 0, stream>>>(p, it, n, a, b, seed,   \
                                                                       offset);               \
    else if (small)                                                                           \
      rng_kernel<T, KIND, false, uint32_t><<<grid, kBlock, 0, stream>>>(                      \
          p, it, (uint32_t)n, a, b, seed, offset);                                            \
    else                                                                                      \
      rng_kernel<T, KIND, false, int64_t><<<grid, kBlock, 0, stream>>>(p, it, n, a, b, seed,  \
                                                                        offset);              \
  } while (0)
    if (kind == GDP_CUDA_RNG_UNIFORM)
      GDP_RNG_LAUNCH(GDP_CUDA_RNG_UNIFORM);
    else
      GDP_RNG_LAUNCH(GDP_CUDA_RNG_NORMAL);
#undef GDP_RNG_LAUNCH
    return cudaGetLastError();
  });
}

extern "C" cudaError_t gdp_cuda_binary(int ndim, const int64_t *shape,
                                       const gdp_cuda_operand *out, const gdp_cuda_operand *a,
                                       const gdp_cuda_operand *b, int kind, double alpha,
                                       cudaStream_t stream) {
  if (kind != GDP_CUDA_BINARY_AXPY && kind != GDP_CUDA_BINARY_MUL &&
      kind != GDP_CUDA_BINARY_SCALE)
    return cudaErrorInvalidValue;
  bool uses_b = kind != GDP_CUDA_BINARY_SCALE;
  const gdp_cuda_operand *ops[3] = {out, a, uses_b ? b : a};
  Iter it;
  int64_t n = make_iter(ndim, shape, 3, ops, &it);
  if (n == 0) return cudaSuccess;
  bool same_dtype = out->dtype == a->dtype && (!uses_b || b->dtype == a->dtype);
  /* bf16 products, sums and differences: float32 arithmetic on 16-byte pieces, where it
   * gives the float64 path's bits (binary_bf16_f32); the residual adds and gradient
   * sums of a training step, which the float64 path ran at a third of the bandwidth */
  const bool bf16_fast = same_dtype && out->dtype == GDP_DTYPE_BF16 &&
                         (kind == GDP_CUDA_BINARY_MUL || (kind == GDP_CUDA_BINARY_AXPY && (alpha == 1.0 || alpha == -1.0)));
  if (bf16_fast && iter_contiguous(it, 3) &&
      ((uintptr_t)out->data | (uintptr_t)a->data | (uintptr_t)b->data) % 16 == 0) {
    bf16 *o = (bf16 *)out->data;
    const bf16 *x = (const bf16 *)a->data, *y = (const bf16 *)b->data;
    const unsigned grid = grid_for((n + 7) / 8);
    if (kind == GDP_CUDA_BINARY_MUL)
      binary_bf16x8_kernel<GDP_CUDA_BINARY_MUL><<<grid, kBlock, 0, stream>>>(o, x, y, n, 1.0f);
    else
      binary_bf16x8_kernel<GDP_CUDA_BINARY_AXPY><<<grid, kBlock, 0, stream>>>(o, x, y, n, (float)alpha);
    return cudaGetLastError();
  }
  if (iter_contiguous(it, 3) && same_dtype) {
    return with_dtype(out->dtype, [&](auto tag) {
      using T = decltype(tag);
      T *o = (T *)out->data;
      const T *x = (const T *)a->data;
      const T *y = uses_b ? (const T *)b->data : nullptr;
      unsigned grid = grid_for(n);
      switch (kind) {
        case GDP_CUDA_BINARY_AXPY:
          binary_contiguous_kernel<T, GDP_CUDA_BINARY_AXPY><<<grid, kBlock, 0, stream>>>(
              o, x, y, n, alpha);
          break;
        case GDP_CUDA_BINARY_MUL:
          binary_contiguous_kernel<T, GDP_CUDA_BINARY_MUL><<<grid, kBlock, 0, stream>>>(
              o, x, y, n, alpha);
          break;
        default:
          binary_contiguous_kernel<T, GDP_CUDA_BINARY_SCALE><<<grid, kBlock, 0, stream>>>(
              o, x, y, n, alpha);
          break;
      }
      return cudaGetLastError();
    });
  }
  Operands3 o3 = {{out->data, a->data, uses_b ? b->data : nullptr},
                  {out->dtype, a->dtype, uses_b ? b->dtype : 0}};
  if (fits_u32(n))
    binary_strided_kernel<uint32_t><<<grid_for(n), kBlock, 0, stream>>>(o3, it, (uint32_t)n,
                                                                          kind, alpha);
  else
    binary_strided_kernel<int64_t><<<grid_for(n), kBlock, 0, stream>>>(o3, it, n, kind, alpha);
  return cudaGetLastError();
}

extern "C" cudaError_t gdp_cuda_reduce(int ndim, const int64_t *shape, const gdp_cuda_operand *a,
                                       const gdp_cuda_operand *b, int kind, double *workspace,
                                       double *result_host, cudaStream_t stream) {
  bool two = kind == GDP_CUDA_REDUCE_DOT || kind == GDP_CUDA_REDUCE_DIFF_SUMSQ;
  if (two && (!b || !b->data)) return cudaErrorInvalidValue;
  const gdp_cuda_operand *ops[2] = {a, two ? b : a};
  Iter it;
  int64_t n = make_iter(ndim, shape, 2, ops, &it);
  if (n == 0) {
    /* Every kind's empty result is 0; no device work is pending on result_host because
     * the backend waits before it reuses a result slot (reduce, reduce_many). */
    *result_host = 0.0;
    return cudaSuccess;
  }
  const gdp_cuda_operand *bb = two ? b : nullptr;
  switch (kind) {
    case GDP_CUDA_REDUCE_SUM:
      return reduce_launch<GDP_CUDA_REDUCE_SUM>(it, n, a, bb, workspace, result_host, stream);
    case GDP_CUDA_REDUCE_DOT:
      return reduce_launch<GDP_CUDA_REDUCE_DOT>(it, n, a, bb, workspace, result_host, stream);
    case GDP_CUDA_REDUCE_SUMSQ:
      return reduce_launch<GDP_CUDA_REDUCE_SUMSQ>(it, n, a, bb, workspace, result_host, stream);
    case GDP_CUDA_REDUCE_MAXABS:
      return reduce_launch<GDP_CUDA_REDUCE_MAXABS>(it, n, a, bb, workspace, result_host,
                                                   stream);
    case GDP_CUDA_REDUCE_NONFINITE:
      return reduce_launch<GDP_CUDA_REDUCE_NONFINITE>(it, n, a, bb, workspace, result_host,
                                                      stream);
    case GDP_CUDA_REDUCE_DIFF_SUMSQ:
      return reduce_launch<GDP_CUDA_REDUCE_DIFF_SUMSQ>(it, n, a, bb, workspace, result_host,
                                                       stream);
    default: return cudaErrorInvalidValue;
  }
}

/* ------------------------------------------------------------------ spin */

/* %globaltimer counts nanoseconds whatever the SM clock does, so the hold is a duration,
 * not a cycle count that a clock change would stretch or shrink. */
__global__ void spin_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

extern "C" cudaError_t gdp_cuda_spin(double ms, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>((uint64_t)(ms * 1e6));
  return cudaGetLastError();
}
