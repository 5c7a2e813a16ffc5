/*
 * common.cuh -- what the mixer kernels share: loads and stores that widen bf16 to
 * float32 (float64 stays float64), block reductions, launch checks, and the
 * deterministic two-pass column sum behind every parameter gradient:
 *
 *   pass 1 (colsum_partial): block (column tile, chunk of rows) sums its rows for its
 *           columns into partial[v][chunk][col] (in the math type, stored as double);
 *   pass 2 (colsum_final):   out_v[j] = sum over chunks, then over the G columns of j,
 *           in double, always in the same order;
 *
 * and the column totals of partial rows (rows_colsum) for kernels that keep their sums
 * in registers and write one row per block.
 */
#ifndef GDP_KERNELS_CUDA_MIXER_COMMON_CUH
#define GDP_KERNELS_CUDA_MIXER_COMMON_CUH

#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "../../kernel_status.h"
#include "mixer_cuda.h"

namespace gdp_mixer {

typedef __nv_bfloat16 bf16;

/* The math type of an I/O type: float for f32 and bf16, double for f64. */
template <typename T> struct Math { typedef float type; };
template <> struct Math<double> { typedef double type; };

__device__ __forceinline__ float ld(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ double ld(const double *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16 *p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float *p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(double *p, int64_t i, double v) { p[i] = v; }
__device__ __forceinline__ void st(bf16 *p, int64_t i, float v) { p[i] = __float2bfloat16(v); }

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double m_log1p(double x) { return log1p(x); }
__device__ __forceinline__ float m_rsqrt(float x) { return 1.0f / sqrtf(x); }
__device__ __forceinline__ double m_rsqrt(double x) { return 1.0 / sqrt(x); }

/* VEC elements of IO moved as one load / store (16 bytes: 8 bf16, 4 f32, 2 f64). */
template <typename IO, int VEC> struct alignas(sizeof(IO) * VEC) Pack { IO e[VEC]; };

template <typename IO, int VEC> __device__ __forceinline__ Pack<IO, VEC> ld_pack(const IO *p) {
  return *reinterpret_cast<const Pack<IO, VEC> *>(p);
}
template <typename IO, int VEC>
__device__ __forceinline__ void st_pack(IO *p, const Pack<IO, VEC> &v) {
  *reinterpret_cast<Pack<IO, VEC> *>(p) = v;
}
/* A pack widened to the math type, and rounded back once. */
template <typename IO, int VEC>
__device__ __forceinline__ void ld_lanes(const IO *p, typename Math<IO>::type (&v)[VEC]) {
  const Pack<IO, VEC> q = ld_pack<IO, VEC>(p);
#pragma unroll
  for (int i = 0; i < VEC; i++) v[i] = ld(q.e, i);
}
template <typename IO, int VEC>
__device__ __forceinline__ void st_lanes(IO *p, const typename Math<IO>::type (&v)[VEC]) {
  Pack<IO, VEC> q;
#pragma unroll
  for (int i = 0; i < VEC; i++) st(q.e, i, v[i]);
  st_pack<IO, VEC>(p, q);
}
/* Per-thread staging of loads through shared memory: cp.async puts a pack's bytes in
 * flight without holding registers for them (packs of 4, 8 or 16 bytes; narrower ones
 * are copied through registers).  Each thread reads back only what it staged, after its
 * own wait, so no barrier is needed; a slot is restaged only after the value read from
 * it has been used. */
template <typename IO, int VEC>
__device__ __forceinline__ void stage(Pack<IO, VEC> *dst, const IO *src, bool valid) {
  constexpr int N = (int)sizeof(Pack<IO, VEC>);
  if constexpr (N == 4 || N == 8 || N == 16) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(N),
                 "r"(valid ? N : 0)
                 : "memory");
  } else {
    *dst = valid ? ld_pack<IO, VEC>(src) : Pack<IO, VEC>();
  }
}
__device__ __forceinline__ void stage_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING> __device__ __forceinline__ void stage_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

/* The pack of 16 bytes for IO. */
template <typename IO> struct Vec16 { enum { n = 16 / sizeof(IO) }; };

static inline int aligned16(const void *p) { return p == NULL || ((uintptr_t)p & 15) == 0; }

/* float: __expf and __fdividef, a few ulp from the exact value (far inside every
 * tolerance, bf16's and f32's 1e-4), where the precise expf and division would be most
 * of the instructions of the elementwise kernels, which are issue-bound.  1 + e^-x
 * past 2^126 gives 0, as it should to float precision. */
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
__device__ __forceinline__ double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

enum { THREADS = 256, MAX_BLOCKS = 1 << 20 };

/* Blocks of THREADS for n elements with a grid-stride loop. */
static inline unsigned grid_for(int64_t n) {
  int64_t b = (n + THREADS - 1) / THREADS;
  if (b < 1) b = 1;
  if (b > MAX_BLOCKS) b = MAX_BLOCKS;
  return (unsigned)b;
}

/* One block per row of `rows` (at least 1, at most MAX_BLOCKS: a grid-stride loop over rows). */
static inline unsigned row_grid(int64_t rows) {
  return (unsigned)(rows < MAX_BLOCKS ? (rows > 0 ? rows : 1) : MAX_BLOCKS);
}

#define GDP_MIXER_FOR(i, n) \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (int64_t)gridDim.x * blockDim.x)

/* The launch error of the kernels just queued, as a gdp status with the message set. */
static inline gdp_status launched(const char *func, const char *what) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_CUDA, "launch of %s failed: %s (%s)", what,
                      cudaGetErrorName(e), cudaGetErrorString(e));
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
 * `shared` holds 32 values; the call ends with a barrier so it can be reused. */
template <typename A> __device__ __forceinline__ A block_sum(A v, A *shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  A t = lane < nw ? shared[lane] : (A)0;
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  __syncthreads();
  return t;
}

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* ---------------------------------------------------------------- column sums */

enum { COLSUM_THREADS = 128, COLSUM_MIN_CHUNK = 64, COLSUM_MAX_CHUNKS = 4096 };

/* Rows per chunk and the chunk count for `rows` rows (0 rows: 0 chunks). */
static inline int64_t colsum_chunk(int64_t rows) {
  int64_t c = (rows + COLSUM_MAX_CHUNKS - 1) / COLSUM_MAX_CHUNKS;
  return c < COLSUM_MIN_CHUNK ? COLSUM_MIN_CHUNK : c;
}
static inline int64_t colsum_nchunks(int64_t rows) {
  const int64_t c = colsum_chunk(rows);
  return (rows + c - 1) / c;
}
/* Workspace bytes of nv column sums of `cols` columns over `rows` rows. */
static inline size_t colsum_bytes(int nv, int64_t rows, int64_t cols) {
  return (size_t)nv * (size_t)colsum_nchunks(rows) * (size_t)(cols > 0 ? cols : 1) * sizeof(double);
}

/* fn(r, col, acc) adds row r's contributions to column col into acc[0..NV) (and may
 * write elementwise results of (r, col): each pair is visited exactly once).
 *
 * A block of COLSUM_THREADS covers `span` consecutive columns (a power of two) with
 * COLSUM_THREADS / span row lanes: lane l takes rows r0 + l, r0 + l + lanes, ... of the
 * chunk, and lane 0 adds the lanes' sums in lane order (deterministic).  With few
 * columns (16 heads) one lane per column would leave most threads idle and walk the
 * chunk's rows one dependent load after another. */
template <int NV, typename A, class Fn>
__global__ void colsum_partial(Fn fn, int64_t rows, int64_t cols, int64_t chunk, int64_t nch,
                               int span, double *partial) {
  __shared__ A lanes_acc[NV][COLSUM_THREADS];
  const int lanes = COLSUM_THREADS / span;
  const int lane = threadIdx.x / span, cl = threadIdx.x % span;
  const int64_t col = (int64_t)blockIdx.x * span + cl;
  const int64_t ch = blockIdx.y;
  A acc[NV];
#pragma unroll
  for (int v = 0; v < NV; v++) acc[v] = (A)0;
  const int64_t r0 = ch * chunk;
  const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;
  if (col < cols)
    for (int64_t r = r0 + lane; r < r1; r += lanes) fn(r, col, acc);
  if (lanes > 1) {
#pragma unroll
    for (int v = 0; v < NV; v++) lanes_acc[v][threadIdx.x] = acc[v];
    __syncthreads();
    if (lane != 0) return;
    for (int l = 1; l < lanes; l++)
#pragma unroll
      for (int v = 0; v < NV; v++) acc[v] += lanes_acc[v][l * span + cl];
  }
  if (col >= cols) return;
#pragma unroll
  for (int v = 0; v < NV; v++) partial[((int64_t)v * nch + ch) * cols + col] = (double)acc[v];
}

/* The columns one colsum_partial block covers: the power of two >= cols, at most
 * COLSUM_THREADS. */
static inline int colsum_span(int64_t cols) {
  int s = 1;
  while (s < COLSUM_THREADS && s < cols) s <<= 1;
  return s;
}

/* out[j] = sum over chunks and over columns j*G .. j*G+G-1 of partial[v], j < cols/G.
 * A warp per output: lane l adds chunks l, l + 32, ..., then the lanes' sums meet in a
 * fixed shuffle tree (deterministic; the chunks' loads are independent, not a serial
 * chain of nch dependent loads). */
template <typename T>
__global__ void colsum_final(const double *partial, int v, int64_t nch, int64_t cols, int64_t G,
                             T *out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t j = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; j < cols / G;
       j += warps) {
    double s = 0.0;
    for (int64_t ch = lane; ch < nch; ch += 32) {
      const double *row = partial + ((int64_t)v * nch + ch) * cols + j * G;
      for (int64_t g = 0; g < G; g++) s += row[g];
    }
    s = warp_sum(s);
    if (lane == 0) st(out, j, (typename Math<T>::type)s);
  }
}

/* Column totals of per-block partial rows, for kernels that keep their weight-gradient
 * sums in registers and write one row per block: tot[q * cols + j] = the sum over the
 * nrows rows r of base[q * q_stride + r * row_stride + j] (q < nq), in double in a fixed
 * order: a block covers 32 columns, warp w adds rows w, w + 8, ..., and the warps' sums
 * are added in warp order (coalesced rows, independent loads, no atomics). */
enum { ROWS_COLSUM_THREADS = 256 };

template <typename A>
__global__ void __launch_bounds__(ROWS_COLSUM_THREADS)
    rows_colsum_kernel(const A *base, int64_t nrows, int64_t row_stride, int64_t cols,
                       int64_t q_stride, double *tot) {
  enum { WARPS = ROWS_COLSUM_THREADS / 32 };
  __shared__ double part[WARPS][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const A *rows = base + (int64_t)blockIdx.y * q_stride;
  const int64_t j = (int64_t)blockIdx.x * 32 + lane;
  double s = 0.0;
  if (j < cols)
    for (int64_t r = warp; r < nrows; r += WARPS) s += (double)rows[r * row_stride + j];
  part[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && j < cols) {
    double t = 0.0;
    for (int w = 0; w < WARPS; w++) t += part[w][lane];
    tot[(int64_t)blockIdx.y * cols + j] = t;
  }
}

template <typename A>
static gdp_status rows_colsum(const char *func, const char *what, const A *base, int64_t nrows,
                              int64_t row_stride, int64_t cols, int nq, int64_t q_stride,
                              double *tot, cudaStream_t stream) {
  if (cols <= 0 || nq <= 0) return GDP_OK;
  if ((cols + 31) / 32 > 0x7fffffffLL || nq > 65535)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "%s: %lld columns x %d sums: too many",
                        what, (long long)cols, nq);
  const dim3 grid((unsigned)((cols + 31) / 32), (unsigned)nq);
  rows_colsum_kernel<A><<<grid, ROWS_COLSUM_THREADS, 0, stream>>>(base, nrows, row_stride, cols,
                                                                  q_stride, tot);
  return launched(func, what);
}

/* Queues pass 1 (always: fn may write elementwise results) and pass 2 for each wanted
 * output outs[v] (NULL: not wanted). */
template <int NV, typename T, class Fn>
static gdp_status colsum_run(const char *func, const char *what, Fn fn, int64_t rows,
                             int64_t cols, int64_t G, T *const *outs, void *workspace,
                             cudaStream_t stream) {
  typedef typename Math<T>::type A;
  const int64_t chunk = colsum_chunk(rows), nch = colsum_nchunks(rows);
  double *partial = (double *)workspace;
  if (nch > 0 && cols > 0) {
    const int span = colsum_span(cols);
    dim3 grid((unsigned)((cols + span - 1) / span), (unsigned)nch);
    colsum_partial<NV, A, Fn><<<grid, COLSUM_THREADS, 0, stream>>>(fn, rows, cols, chunk, nch,
                                                                    span, partial);
    GDP_TRY(launched(func, what));
  }
  for (int v = 0; v < NV; v++) {
    if (!outs[v] || cols / G == 0) continue;
    colsum_final<T><<<grid_for(32 * (cols / G)), THREADS, 0, stream>>>(partial, v, nch, cols, G,
                                                                      outs[v]);
    GDP_TRY(launched(func, what));
  }
  return GDP_OK;
}

} // namespace gdp_mixer

/* Bytes of n float32 statistics, rounded up so that a double array may follow. */
static inline size_t gdp_mixer_rstd_bytes(int64_t n) {
  return ((size_t)(n > 0 ? n : 0) * sizeof(float) + 15) & ~(size_t)15;
}

/* Dispatch on the I/O dtype: the statement (the variadic part) is instantiated with the
 * type name IO. */
#define GDP_MIXER_DISPATCH(func, dtype, ...)                                              \
  do {                                                                                     \
    switch (dtype) {                                                                       \
      case GDP_DTYPE_F64: { typedef double IO; __VA_ARGS__; } break;                              \
      case GDP_DTYPE_F32: { typedef float IO; __VA_ARGS__; } break;                               \
      case GDP_DTYPE_BF16: { typedef gdp_mixer::bf16 IO; __VA_ARGS__; } break;                    \
      default:                                                                             \
        return GDP_ERROR_IN((func), GDP_ERR_DTYPE,                                         \
                            "the cuda mixer kernels take f64, f32 or bf16, got dtype %d",  \
                            (int)(dtype));                                                 \
    }                                                                                      \
  } while (0)

#endif /* GDP_KERNELS_CUDA_MIXER_COMMON_CUH */
