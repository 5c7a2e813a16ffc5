/*
 * backend_cpu.c -- the CPU backend: host memory, strided copies with dtype
 * conversion, fills, Philox fills, elementwise ops, float64-accumulated reductions,
 * OpenBLAS matmul and the dispatch to the CPU kernels of the GDP operator, its L2 norm
 * and the mixer layer ops (kernels/cpu).
 *
 * This backend is the test oracle for every other one, so it favours exactness
 * over speed: arithmetic goes through float64 and every float -> narrower-float
 * conversion is rounded once (round to nearest even).
 *
 * Strided work is described by an iterator that coalesces the dims of all operands
 * and cuts the row-major element range into fixed blocks ("tasks").  Tasks do not
 * depend on the thread count, so reductions (partial sums per task, added in task
 * order) give the same bits with 1 or 64 threads.
 */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "backend_impl.h"
#include "cpu/gdp_cpu.h"
#include "cpu/mixer_cpu.h"
#include "cpu/state_tracking_cpu.h"
#include "cpu/optim_cpu.h"
#include "cpu/nn_cpu.h"
#include "philox.h"

enum {
  ITER_BLOCK = 16384,      /* elements per task */
  ITER_PAR_MIN = 1 << 16,  /* fewer elements than this run on one thread */
  CHUNK = 256,             /* elements converted at a time through float64 buffers */
  ALIGN = 64
};

/* ------------------------------------------------------------------ conversions */

/* Local copies of the dtype.c conversions so that the loops below inline them. */
static inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint16_t f32_to_bf16(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  /* branch-free (a select), so that conversion loops vectorise */
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* double -> bf16 rounded once: first to float with round-to-odd (truncate, then set
 * the last bit when anything was dropped), then to bf16 with round-to-nearest-even.
 * Round-to-odd to >= p+2 bits followed by RNE to p bits equals RNE to p bits
 * directly; the plain (float) cast would round twice and break ties wrongly. */
static inline uint16_t f64_to_bf16(double x) {
  float f = (float)x;
  if (isfinite(x) && (double)f != x) {
    if (fabs((double)f) > fabs(x)) f = nextafterf(f, 0.0f);
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits |= 1u;
    memcpy(&f, &bits, sizeof f);
  }
  return f32_to_bf16(f);
}

/* int64 -> bf16 rounded once: keep the top 53 bits with a sticky bit (exact in a
 * double, round-to-odd), then as above. */
static inline uint16_t i64_to_bf16(int64_t x) {
  const int64_t exact = (int64_t)1 << 53;
  if (x > -exact && x < exact) return f64_to_bf16((double)x);
  uint64_t u = x < 0 ? (uint64_t)0 - (uint64_t)x : (uint64_t)x;
  int shift = 11 - __builtin_clzll(u); /* u >= 2^53: drop this many low bits */
  uint64_t kept = u >> shift;
  if (u & ((UINT64_C(1) << shift) - 1)) kept |= 1u;
  double d = ldexp((double)kept, shift);
  return f64_to_bf16(x < 0 ? -d : d);
}

/* Float -> integer conversions truncate toward zero.  Values that have no integer of
 * the target type (NaN, +-inf, out of range) are rejected before any copy by
 * check_int_conversion below; the saturation here only keeps the casts defined for
 * the internal float64 -> integer stores of elementwise ops. */
static inline int32_t sat_i32(double x) {
  if (x != x) return 0;
  if (x >= 2147483647.0) return INT32_MAX;
  if (x <= -2147483648.0) return INT32_MIN;
  return (int32_t)x;
}

static inline int64_t sat_i64(double x) {
  if (x != x) return 0;
  if (x >= 9223372036854775808.0) return INT64_MAX;
  if (x < -9223372036854775808.0) return INT64_MIN;
  return (int64_t)x;
}

static inline int32_t i64_to_i32(int64_t x) {
  return x > INT32_MAX ? INT32_MAX : x < INT32_MIN ? INT32_MIN : (int32_t)x;
}

typedef void (*row_copy_fn)(void *dst, int64_t dst_stride, const void *src, int64_t src_stride,
                            int64_t n);

#define DEFINE_ROW_COPY(NAME, DT, ST, CONV)                                              \
  static void NAME(void *dv, int64_t ds, const void *sv, int64_t ss, int64_t n) {        \
    DT *d = (DT *)dv;                                                                    \
    const ST *s = (const ST *)sv;                                                        \
    if (ds == 1 && ss == 1) {                                                            \
      for (int64_t i = 0; i < n; i++) d[i] = CONV(s[i]);                                 \
    } else {                                                                             \
      for (int64_t i = 0; i < n; i++) d[i * ds] = CONV(s[i * ss]);                       \
    }                                                                                    \
  }

#define CV_ID(x) (x)
#define CV_F64(x) ((double)(x))
#define CV_F32(x) ((float)(x))
#define CV_BF16_F64(x) ((double)bf16_to_f32(x))
#define CV_BF16_F32(x) bf16_to_f32(x)
#define CV_I32_FLOAT(x) sat_i32((double)(x))
#define CV_I64_FLOAT(x) sat_i64((double)(x))
#define CV_I32_BF16(x) sat_i32((double)bf16_to_f32(x))
#define CV_I64_BF16(x) sat_i64((double)bf16_to_f32(x))
#define CV_I32_DIRECT(x) ((int32_t)(x))
#define CV_I64_DIRECT(x) ((int64_t)(x))
#define CV_BF16_I32(x) f64_to_bf16((double)(x))

/* dst f64 */
DEFINE_ROW_COPY(cp_f64_f64, double, double, CV_ID)
DEFINE_ROW_COPY(cp_f64_f32, double, float, CV_F64)
DEFINE_ROW_COPY(cp_f64_bf16, double, uint16_t, CV_BF16_F64)
DEFINE_ROW_COPY(cp_f64_i32, double, int32_t, CV_F64)
DEFINE_ROW_COPY(cp_f64_i64, double, int64_t, CV_F64)
/* dst f32 (int64 -> float is correctly rounded by the C cast) */
DEFINE_ROW_COPY(cp_f32_f64, float, double, CV_F32)
DEFINE_ROW_COPY(cp_f32_f32, float, float, CV_ID)
DEFINE_ROW_COPY(cp_f32_bf16, float, uint16_t, CV_BF16_F32)
DEFINE_ROW_COPY(cp_f32_i32, float, int32_t, CV_F32)
DEFINE_ROW_COPY(cp_f32_i64, float, int64_t, CV_F32)
/* dst bf16 */
DEFINE_ROW_COPY(cp_bf16_f64, uint16_t, double, f64_to_bf16)
DEFINE_ROW_COPY(cp_bf16_f32, uint16_t, float, f32_to_bf16)
DEFINE_ROW_COPY(cp_bf16_bf16, uint16_t, uint16_t, CV_ID)
DEFINE_ROW_COPY(cp_bf16_i32, uint16_t, int32_t, CV_BF16_I32)
DEFINE_ROW_COPY(cp_bf16_i64, uint16_t, int64_t, i64_to_bf16)
/* dst i32 */
DEFINE_ROW_COPY(cp_i32_f64, int32_t, double, CV_I32_FLOAT)
DEFINE_ROW_COPY(cp_i32_f32, int32_t, float, CV_I32_FLOAT)
DEFINE_ROW_COPY(cp_i32_bf16, int32_t, uint16_t, CV_I32_BF16)
DEFINE_ROW_COPY(cp_i32_i32, int32_t, int32_t, CV_ID)
DEFINE_ROW_COPY(cp_i32_i64, int32_t, int64_t, i64_to_i32)
/* dst i64 */
DEFINE_ROW_COPY(cp_i64_f64, int64_t, double, CV_I64_FLOAT)
DEFINE_ROW_COPY(cp_i64_f32, int64_t, float, CV_I64_FLOAT)
DEFINE_ROW_COPY(cp_i64_bf16, int64_t, uint16_t, CV_I64_BF16)
DEFINE_ROW_COPY(cp_i64_i32, int64_t, int32_t, CV_I64_DIRECT)
DEFINE_ROW_COPY(cp_i64_i64, int64_t, int64_t, CV_ID)

/* [dst dtype][src dtype], in gdp_dtype order F64, F32, BF16, I32, I64 */
static const row_copy_fn row_copy[GDP_DTYPE_COUNT][GDP_DTYPE_COUNT] = {
    {cp_f64_f64, cp_f64_f32, cp_f64_bf16, cp_f64_i32, cp_f64_i64},
    {cp_f32_f64, cp_f32_f32, cp_f32_bf16, cp_f32_i32, cp_f32_i64},
    {cp_bf16_f64, cp_bf16_f32, cp_bf16_bf16, cp_bf16_i32, cp_bf16_i64},
    {cp_i32_f64, cp_i32_f32, cp_i32_bf16, cp_i32_i32, cp_i32_i64},
    {cp_i64_f64, cp_i64_f32, cp_i64_bf16, cp_i64_i32, cp_i64_i64},
};

/* ------------------------------------------------------------------ iterator */

typedef struct iter {
  int nops, ndim; /* ndim >= 1 after coalescing */
  int64_t shape[GDP_MAX_DIMS];
  int64_t stride[3][GDP_MAX_DIMS];
  char *base[3];
  int64_t esize[3];
  gdp_dtype dtype[3];
  int64_t numel, inner;
} iter;

/* One run of `n` elements; p[k] points at operand k's first element, s[k] is its
 * stride in elements; `linear` is the row-major index of the first element. */
typedef void (*segment_fn)(void *user, int64_t task, char *const p[3], const int64_t s[3],
                           int64_t n, int64_t linear);

/* Operands share ts[0]'s shape.  Dims of size 1 are dropped and neighbours that are
 * contiguous with each other in every operand are merged, so that most copies end
 * up one long inner loop. */
static void iter_init(iter *it, int nops, const gdp_tensor *const *ts) {
  const gdp_tensor *t0 = ts[0];
  int64_t cs[GDP_MAX_DIMS], cst[3][GDP_MAX_DIMS];
  int n = 0;
  it->nops = nops;
  it->numel = 1;
  for (int d = 0; d < t0->ndim; d++) it->numel *= t0->shape[d];
  for (int k = 0; k < nops; k++) {
    it->base[k] = ts[k]->storage->data ? (char *)gdp_tensor_ptr(ts[k]) : NULL;
    it->esize[k] = (int64_t)gdp_dtype_size(ts[k]->dtype);
    it->dtype[k] = ts[k]->dtype;
  }
  for (int d = t0->ndim - 1; d >= 0; d--) {
    int64_t size = t0->shape[d];
    if (size == 1) continue;
    if (n > 0) {
      int merge = 1;
      for (int k = 0; k < nops; k++) merge &= ts[k]->stride[d] == cst[k][n - 1] * cs[n - 1];
      if (merge) {
        cs[n - 1] *= size;
        continue;
      }
    }
    cs[n] = size;
    for (int k = 0; k < nops; k++) cst[k][n] = ts[k]->stride[d];
    n++;
  }
  if (n == 0) { /* one element */
    cs[0] = 1;
    for (int k = 0; k < nops; k++) cst[k][0] = 1;
    n = 1;
  }
  it->ndim = n;
  for (int i = 0; i < n; i++) {
    it->shape[i] = cs[n - 1 - i];
    for (int k = 0; k < nops; k++) it->stride[k][i] = cst[k][n - 1 - i];
  }
  it->inner = it->shape[n - 1];
}

static void iter_seek(const iter *it, int64_t row, int64_t *idx, int64_t *off) {
  for (int k = 0; k < it->nops; k++) off[k] = 0;
  for (int d = it->ndim - 2; d >= 0; d--) {
    idx[d] = row % it->shape[d];
    row /= it->shape[d];
    for (int k = 0; k < it->nops; k++) off[k] += idx[d] * it->stride[k][d];
  }
}

static void iter_next_row(const iter *it, int64_t *idx, int64_t *off) {
  for (int d = it->ndim - 2; d >= 0; d--) {
    idx[d]++;
    for (int k = 0; k < it->nops; k++) off[k] += it->stride[k][d];
    if (idx[d] < it->shape[d]) return;
    for (int k = 0; k < it->nops; k++) off[k] -= it->stride[k][d] * it->shape[d];
    idx[d] = 0;
  }
}

static int64_t iter_tasks(const iter *it) { return (it->numel + ITER_BLOCK - 1) / ITER_BLOCK; }

static void iter_task(const iter *it, int64_t task, segment_fn fn, void *user) {
  int64_t lo = task * ITER_BLOCK;
  int64_t hi = lo + ITER_BLOCK < it->numel ? lo + ITER_BLOCK : it->numel;
  int64_t idx[GDP_MAX_DIMS], off[3];
  int64_t col = lo % it->inner;
  iter_seek(it, lo / it->inner, idx, off);
  int64_t s[3] = {0, 0, 0};
  for (int k = 0; k < it->nops; k++) s[k] = it->stride[k][it->ndim - 1];
  while (lo < hi) {
    int64_t n = it->inner - col < hi - lo ? it->inner - col : hi - lo;
    char *p[3] = {NULL, NULL, NULL};
    for (int k = 0; k < it->nops; k++) p[k] = it->base[k] + (off[k] + col * s[k]) * it->esize[k];
    fn(user, task, p, s, n, lo);
    lo += n;
    col = 0;
    iter_next_row(it, idx, off);
  }
}

static void iter_run(const iter *it, int num_threads, segment_fn fn, void *user) {
  if (it->numel == 0) return;
  int64_t ntasks = iter_tasks(it);
  if (num_threads > 1 && it->numel >= ITER_PAR_MIN) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < ntasks; t++) iter_task(it, t, fn, user);
  } else {
    for (int64_t t = 0; t < ntasks; t++) iter_task(it, t, fn, user);
  }
}

/* ------------------------------------------------------------------ memory */

static int cpu_device_count(void) { return 1; }

static gdp_status cpu_alloc(gdp_ctx *ctx, size_t nbytes, void **out) {
  /* never a NULL pointer, even for empty tensors, and a multiple of the alignment */
  size_t padded = nbytes ? (nbytes + ALIGN - 1) / ALIGN * ALIGN : ALIGN;
  if (padded < nbytes) return GDP_ERROR(GDP_ERR_OOM, "cannot allocate %zu bytes", nbytes);
  void *p = NULL;
  if (posix_memalign(&p, ALIGN, padded) != 0 || !p)
    return GDP_ERROR(GDP_ERR_OOM, "cannot allocate %zu bytes of host memory (live: %lld bytes)",
                     nbytes, (long long)gdp_mem_live_bytes(GDP_DEVICE_CPU));
  gdp_mem_track(GDP_DEVICE_CPU, (int64_t)nbytes);
  *out = p;
  return GDP_OK;
}

static void cpu_release(gdp_ctx *ctx, void *ptr, size_t nbytes) {
  if (!ptr) return;
  free(ptr);
  gdp_mem_track(GDP_DEVICE_CPU, -(int64_t)nbytes);
}

static gdp_status cpu_sync(gdp_ctx *ctx) { return GDP_OK; }

static gdp_status cpu_memcpy(gdp_ctx *ctx, void *dst, const void *src, size_t nbytes) {
  if (nbytes) memmove(dst, src, nbytes);
  return GDP_OK;
}

/* ------------------------------------------------------------------ conversion checks */

typedef struct int_check_job {
  gdp_dtype src, dst;
  int64_t bad;      /* row-major index of the first bad element, -1 while none */
  double bad_value; /* for float sources */
  int64_t bad_int;  /* for an int64 source */
} int_check_job;

static void int_check_segment(void *user, int64_t task, char *const p[3], const int64_t s[3],
                              int64_t n, int64_t linear) {
  int_check_job *job = user;
  if (job->bad >= 0) return;
  const char *b = p[0];
  for (int64_t i = 0; i < n; i++) {
    double x;
    switch (job->src) {
      case GDP_DTYPE_F64: x = ((const double *)b)[i * s[0]]; break;
      case GDP_DTYPE_F32: x = ((const float *)b)[i * s[0]]; break;
      case GDP_DTYPE_BF16: x = bf16_to_f32(((const uint16_t *)b)[i * s[0]]); break;
      default: { /* int64 -> int32 */
        int64_t v = ((const int64_t *)b)[i * s[0]];
        if (v < INT32_MIN || v > INT32_MAX) {
          job->bad = linear + i;
          job->bad_int = v;
          return;
        }
        continue;
      }
    }
    if (!gdp_fits_int(x, job->dst)) {
      job->bad = linear + i;
      job->bad_value = x;
      return;
    }
  }
}

/* A conversion to an integer dtype that would have to invent a value (NaN, +-inf,
 * out of range) is an error naming the conversion and the first bad element, in
 * row-major order.  One read-only pass over the source, run before the copy so that
 * dst is untouched on failure; only conversions that can fail pay for it. */
static gdp_status check_int_conversion(const gdp_tensor *src, gdp_dtype dst) {
  if (dst != GDP_DTYPE_I32 && dst != GDP_DTYPE_I64) return GDP_OK;
  if (src->dtype == GDP_DTYPE_I32 || src->dtype == dst) return GDP_OK;
  if (dst == GDP_DTYPE_I64 && src->dtype == GDP_DTYPE_I64) return GDP_OK;
  int_check_job job = {src->dtype, dst, -1, 0.0, 0};
  const gdp_tensor *ops[1] = {src};
  iter it;
  iter_init(&it, 1, ops);
  iter_run(&it, 1, int_check_segment, &job); /* in order: the first bad one is found */
  if (job.bad < 0) return GDP_OK;
  char shape_buf[160], val[64];
  if (src->dtype == GDP_DTYPE_I64)
    snprintf(val, sizeof val, "%lld", (long long)job.bad_int);
  else
    snprintf(val, sizeof val, "%.17g", job.bad_value);
  return GDP_ERROR_IN("tensor conversion", GDP_ERR_INVALID_ARG,
                      "converting a %s tensor of shape %s to %s: element %lld (row-major, "
                      "counting from 1) is %s, which %s has no value for (NaN, inf and values "
                      "out of range are errors, not saturated)",
                      gdp_dtype_name(src->dtype),
                      gdp_shape_str(shape_buf, sizeof shape_buf, src->ndim, src->shape),
                      gdp_dtype_name(dst), (long long)job.bad + 1, val, gdp_dtype_name(dst));
}

/* ------------------------------------------------------------------ copy, fill */

typedef struct copy_job {
  row_copy_fn fn;
} copy_job;

static void copy_segment(void *user, int64_t task, char *const p[3], const int64_t s[3],
                         int64_t n, int64_t linear) {
  const copy_job *job = user;
  job->fn(p[0], s[0], p[1], s[1], n);
}

/* Copies whose last two (coalesced) dims are transposed between dst and src, e.g.
 * making a transposed view contiguous: walking either one in order strides through
 * the other by whole rows, a cache miss per element.  Tiles of TILE x TILE stay in
 * cache.  Returns 0 (nothing done) when the layout is not of that kind. */
enum { TILE = 64 };

static int copy_tiled(const gdp_ctx *ctx, const iter *it, row_copy_fn fn) {
  int nd = it->ndim;
  if (nd < 2) return 0;
  int64_t R = it->shape[nd - 2], C = it->shape[nd - 1];
  int64_t dr = it->stride[0][nd - 2], dc = it->stride[0][nd - 1];
  int64_t sr = it->stride[1][nd - 2], sc = it->stride[1][nd - 1];
  int transposed = (dc == 1 && sr == 1 && sc != 1) || (sc == 1 && dr == 1 && dc != 1);
  if (!transposed || R < TILE / 4 || C < TILE / 4) return 0;
  int64_t tr = (R + TILE - 1) / TILE, tc = (C + TILE - 1) / TILE;
  int64_t outer = it->numel / (R * C);
  int64_t ntiles = outer * tr * tc;
  int threads = it->numel >= ITER_PAR_MIN ? ctx->num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t t = 0; t < ntiles; t++) {
    int64_t o = t / (tr * tc), rest = t % (tr * tc);
    int64_t r0 = rest / tc * TILE, c0 = rest % tc * TILE;
    int64_t rn = R - r0 < TILE ? R - r0 : TILE, cn = C - c0 < TILE ? C - c0 : TILE;
    int64_t doff = 0, soff = 0;
    for (int d = nd - 3; d >= 0; d--) { /* outer index -> offsets */
      int64_t i = o % it->shape[d];
      o /= it->shape[d];
      doff += i * it->stride[0][d];
      soff += i * it->stride[1][d];
    }
    char *dbase = it->base[0] + (doff + r0 * dr + c0 * dc) * it->esize[0];
    const char *sbase = it->base[1] + (soff + r0 * sr + c0 * sc) * it->esize[1];
    if (sr == 1) { /* read src down its contiguous columns */
      for (int64_t c = 0; c < cn; c++)
        fn(dbase + c * dc * it->esize[0], dr, sbase + c * sc * it->esize[1], sr, rn);
    } else {
      for (int64_t r = 0; r < rn; r++)
        fn(dbase + r * dr * it->esize[0], dc, sbase + r * sr * it->esize[1], sc, cn);
    }
  }
  return 1;
}

static int ranges_overlap(const char *a, size_t na, const char *b, size_t nb) {
  return a < b + nb && b < a + na;
}

static gdp_status cpu_copy(gdp_ctx *ctx, gdp_tensor *dst, const gdp_tensor *src) {
  int64_t n = gdp_tensor_numel(src);
  if (n == 0) return GDP_OK;
  if (dst->dtype == src->dtype && gdp_tensor_is_contiguous(dst) && gdp_tensor_is_contiguous(src)) {
    size_t bytes = (size_t)n * gdp_dtype_size(src->dtype);
    char *d = gdp_tensor_ptr(dst);
    const char *s = gdp_tensor_ptr(src);
    if (d == s) return GDP_OK;
    int threads = ctx->num_threads;
    if (threads > 1 && bytes >= ((size_t)8 << 20) && !ranges_overlap(d, bytes, s, bytes)) {
      /* big copies are limited by a single core's bandwidth; split them */
      const size_t piece = (size_t)1 << 20;
      int64_t pieces = (int64_t)((bytes + piece - 1) / piece);
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t i = 0; i < pieces; i++) {
        size_t o = (size_t)i * piece;
        memcpy(d + o, s + o, bytes - o < piece ? bytes - o : piece);
      }
    } else {
      memmove(d, s, bytes);
    }
    return GDP_OK;
  }
  GDP_TRY(check_int_conversion(src, dst->dtype));
  const gdp_tensor *ops[2] = {dst, src};
  iter it;
  iter_init(&it, 2, ops);
  copy_job job = {row_copy[dst->dtype][src->dtype]};
  if (copy_tiled(ctx, &it, job.fn)) return GDP_OK;
  iter_run(&it, ctx->num_threads, copy_segment, &job);
  return GDP_OK;
}

typedef struct fill_job {
  unsigned char value[8]; /* one element of the tensor's dtype */
  int64_t esize;
} fill_job;

static void fill_segment(void *user, int64_t task, char *const p[3], const int64_t s[3],
                         int64_t n, int64_t linear) {
  const fill_job *job = user;
  switch (job->esize) {
    case 8: {
      uint64_t v;
      memcpy(&v, job->value, 8);
      uint64_t *d = (uint64_t *)p[0];
      for (int64_t i = 0; i < n; i++) d[i * s[0]] = v;
      break;
    }
    case 4: {
      uint32_t v;
      memcpy(&v, job->value, 4);
      uint32_t *d = (uint32_t *)p[0];
      for (int64_t i = 0; i < n; i++) d[i * s[0]] = v;
      break;
    }
    default: {
      uint16_t v;
      memcpy(&v, job->value, 2);
      uint16_t *d = (uint16_t *)p[0];
      for (int64_t i = 0; i < n; i++) d[i * s[0]] = v;
      break;
    }
  }
}

static gdp_status cpu_fill(gdp_ctx *ctx, gdp_tensor *t, double value) {
  if (gdp_tensor_numel(t) == 0) return GDP_OK;
  fill_job job;
  memset(&job, 0, sizeof job);
  job.esize = (int64_t)gdp_dtype_size(t->dtype);
  if ((t->dtype == GDP_DTYPE_I32 || t->dtype == GDP_DTYPE_I64) && !gdp_fits_int(value, t->dtype))
    return GDP_ERROR_IN("tensor conversion", GDP_ERR_INVALID_ARG,
                        "filling a %s tensor with %.17g, which %s has no value for (NaN, inf "
                        "and values out of range are errors, not saturated)",
                        gdp_dtype_name(t->dtype), value, gdp_dtype_name(t->dtype));
  row_copy[t->dtype][GDP_DTYPE_F64](job.value, 1, &value, 1, 1);
  const gdp_tensor *ops[1] = {t};
  iter it;
  iter_init(&it, 1, ops);
  iter_run(&it, ctx->num_threads, fill_segment, &job);
  return GDP_OK;
}

/* ------------------------------------------------------------------ rng */

typedef struct rng_job {
  gdp_rng_kind kind;
  double a, b;
  uint64_t seed, offset;
  row_copy_fn store; /* float64 -> the tensor's dtype */
  int64_t esize;
} rng_job;

static void rng_segment(void *user, int64_t task, char *const p[3], const int64_t s[3],
                        int64_t n, int64_t linear) {
  const rng_job *job = user;
  double buf[CHUNK];
  double vals[4]; /* the 4 values of the current block */
  uint64_t cached = 0;
  int have = 0;
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    int64_t m = n - c0 < CHUNK ? n - c0 : CHUNK;
    for (int64_t j = 0; j < m; j++) {
      uint64_t block;
      int word;
      gdp_philox_element(job->offset, (uint64_t)(linear + c0 + j), &block, &word);
      if (!have || block != cached) { /* 4 consecutive elements share a block */
        uint32_t words[4];
        gdp_philox_stream_block(job->seed, block, words);
        if (job->kind == GDP_RNG_UNIFORM) {
          for (int w = 0; w < 4; w++) vals[w] = gdp_philox_uniform(words[w], job->a, job->b);
        } else {
          gdp_philox_normal4(words, job->a, job->b, vals);
        }
        cached = block;
        have = 1;
      }
      buf[j] = vals[word];
    }
    job->store(p[0] + c0 * s[0] * job->esize, s[0], buf, 1, m);
  }
}

static gdp_status cpu_rng(gdp_ctx *ctx, gdp_tensor *t, gdp_rng_kind kind, double a, double b,
                          uint64_t seed, uint64_t offset) {
  if (gdp_tensor_numel(t) == 0) return GDP_OK;
  rng_job job = {kind, a, b, seed, offset, row_copy[t->dtype][GDP_DTYPE_F64],
                 (int64_t)gdp_dtype_size(t->dtype)};
  const gdp_tensor *ops[1] = {t};
  iter it;
  iter_init(&it, 1, ops);
  iter_run(&it, ctx->num_threads, rng_segment, &job);
  return GDP_OK;
}

/* ------------------------------------------------------------------ elementwise */

typedef struct binary_job {
  gdp_binary_kind kind;
  double alpha;
  row_copy_fn load_a, load_b, store;
  int64_t es_out, es_a, es_b;
  gdp_dtype out_dtype;
  int int_out;       /* out is i32/i64: results without a value there are an error */
  int64_t bad;       /* row-major index of the first such result, INT64_MAX while none */
  double bad_value;
} binary_job;

/* Records a result that the integer out cannot hold; keeps the first in row-major
 * order whatever the order the threads get there. */
static void binary_note_bad(binary_job *job, int64_t index, double value) {
#pragma omp critical(gdp_binary_bad)
  {
    if (index < job->bad) {
      job->bad = index;
      job->bad_value = value;
    }
  }
}

/* Through float64 buffers, CHUNK elements at a time: every dtype and stride takes
 * the same path, and out may alias a or b (each chunk is read before written). */
static void binary_segment(void *user, int64_t task, char *const p[3], const int64_t s[3],
                           int64_t n, int64_t linear) {
  const binary_job *job = user;
  double x[CHUNK], y[CHUNK];
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    int64_t m = n - c0 < CHUNK ? n - c0 : CHUNK;
    job->load_a(x, 1, p[1] + c0 * s[1] * job->es_a, s[1], m);
    switch (job->kind) {
      case GDP_BINARY_AXPY:
        job->load_b(y, 1, p[2] + c0 * s[2] * job->es_b, s[2], m);
        for (int64_t j = 0; j < m; j++) x[j] += job->alpha * y[j];
        break;
      case GDP_BINARY_MUL:
        job->load_b(y, 1, p[2] + c0 * s[2] * job->es_b, s[2], m);
        for (int64_t j = 0; j < m; j++) x[j] *= y[j];
        break;
      case GDP_BINARY_SCALE:
        for (int64_t j = 0; j < m; j++) x[j] *= job->alpha;
        break;
    }
    if (job->int_out) {
      for (int64_t j = 0; j < m; j++) {
        if (!gdp_fits_int(x[j], job->out_dtype)) {
          binary_note_bad((binary_job *)job, linear + c0 + j, x[j]);
          break;
        }
      }
    }
    job->store(p[0] + c0 * s[0] * job->es_out, s[0], x, 1, m);
  }
}

static gdp_status cpu_binary(gdp_ctx *ctx, gdp_tensor *out, const gdp_tensor *a,
                             const gdp_tensor *b, gdp_binary_kind kind, double alpha) {
  if (gdp_tensor_numel(out) == 0) return GDP_OK;
  int has_b = kind != GDP_BINARY_SCALE;
  binary_job job;
  memset(&job, 0, sizeof job);
  job.kind = kind;
  job.alpha = alpha;
  job.load_a = row_copy[GDP_DTYPE_F64][a->dtype];
  job.store = row_copy[out->dtype][GDP_DTYPE_F64];
  job.es_out = (int64_t)gdp_dtype_size(out->dtype);
  job.es_a = (int64_t)gdp_dtype_size(a->dtype);
  if (has_b) {
    job.load_b = row_copy[GDP_DTYPE_F64][b->dtype];
    job.es_b = (int64_t)gdp_dtype_size(b->dtype);
  }
  job.out_dtype = out->dtype;
  job.int_out = out->dtype == GDP_DTYPE_I32 || out->dtype == GDP_DTYPE_I64;
  job.bad = INT64_MAX;
  const gdp_tensor *ops[3] = {out, a, b};
  iter it;
  iter_init(&it, has_b ? 3 : 2, ops);
  iter_run(&it, ctx->num_threads, binary_segment, &job);
  if (job.bad != INT64_MAX) {
    char shape_buf[160];
    return GDP_ERROR_IN("tensor conversion", GDP_ERR_INVALID_ARG,
                        "an elementwise result stored into a %s tensor of shape %s: element %lld "
                        "(row-major, counting from 1) is %.17g, which %s has no value for (NaN, "
                        "inf and values out of range are errors, not saturated; out holds "
                        "saturated values)",
                        gdp_dtype_name(out->dtype),
                        gdp_shape_str(shape_buf, sizeof shape_buf, out->ndim, out->shape),
                        (long long)job.bad + 1, job.bad_value, gdp_dtype_name(out->dtype));
  }
  return GDP_OK;
}

/* ------------------------------------------------------------------ reductions */

typedef struct reduce_job {
  gdp_reduce_kind kind;
  row_copy_fn load_a, load_b;
  int64_t es_a, es_b;
  double *partial; /* one per task */
} reduce_job;

/* max(|x|) that keeps NaN once seen */
static inline double max_nan(double m, double v) {
  if (isnan(m) || isnan(v)) return NAN;
  return v > m ? v : m;
}

/* sum(x) or sum(x*y) of up to CHUNK values in 8 fixed lanes: a single accumulator
 * is latency-bound, lanes vectorise; the order is fixed, so results stay
 * deterministic (and a little more accurate). */
static inline double lane_sum(const double *x, const double *y, int64_t m, int product) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  if (product) {
    for (; j + 8 <= m; j += 8)
      for (int l = 0; l < 8; l++) lane[l] += x[j + l] * y[j + l];
    for (; j < m; j++) lane[0] += x[j] * y[j];
  } else {
    for (; j + 8 <= m; j += 8)
      for (int l = 0; l < 8; l++) lane[l] += x[j + l];
    for (; j < m; j++) lane[0] += x[j];
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

static void reduce_segment(void *user, int64_t task, char *const p[3], const int64_t s[3],
                           int64_t n, int64_t linear) {
  const reduce_job *job = user;
  double x[CHUNK], y[CHUNK];
  double acc = job->partial[task];
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    int64_t m = n - c0 < CHUNK ? n - c0 : CHUNK;
    job->load_a(x, 1, p[0] + c0 * s[0] * job->es_a, s[0], m);
    if (job->load_b) job->load_b(y, 1, p[1] + c0 * s[1] * job->es_b, s[1], m);
    switch (job->kind) {
      case GDP_REDUCE_SUM:
        acc += lane_sum(x, x, m, 0);
        break;
      case GDP_REDUCE_DOT:
        acc += lane_sum(x, y, m, 1);
        break;
      case GDP_REDUCE_SUMSQ:
        acc += lane_sum(x, x, m, 1);
        break;
      case GDP_REDUCE_MAXABS:
        for (int64_t j = 0; j < m; j++) acc = max_nan(acc, fabs(x[j]));
        break;
      case GDP_REDUCE_NONFINITE:
        for (int64_t j = 0; j < m; j++) acc += isfinite(x[j]) ? 0.0 : 1.0;
        break;
      case GDP_REDUCE_DIFF_SUMSQ:
        /* in SUMSQ's lanes: with a = 0 (or b = 0) the same sum, bit for bit, so that
         * rel_error(0, ref) is exactly 1 */
        for (int64_t j = 0; j < m; j++) x[j] -= y[j];
        acc += lane_sum(x, x, m, 1);
        break;
    }
  }
  job->partial[task] = acc;
}

static gdp_status cpu_reduce(gdp_ctx *ctx, const gdp_tensor *a, const gdp_tensor *b,
                             gdp_reduce_kind kind, double *out) {
  *out = 0.0;
  if (gdp_tensor_numel(a) == 0) return GDP_OK;
  int has_b = kind == GDP_REDUCE_DOT || kind == GDP_REDUCE_DIFF_SUMSQ;
  const gdp_tensor *ops[2] = {a, b};
  iter it;
  iter_init(&it, has_b ? 2 : 1, ops);
  int64_t ntasks = iter_tasks(&it);
  double *partial = calloc((size_t)ntasks, sizeof *partial);
  if (!partial) return GDP_ERROR(GDP_ERR_OOM, "cannot allocate %lld partial sums", (long long)ntasks);
  reduce_job job;
  memset(&job, 0, sizeof job);
  job.kind = kind;
  job.load_a = row_copy[GDP_DTYPE_F64][a->dtype];
  job.es_a = (int64_t)gdp_dtype_size(a->dtype);
  if (has_b) {
    job.load_b = row_copy[GDP_DTYPE_F64][b->dtype];
    job.es_b = (int64_t)gdp_dtype_size(b->dtype);
  }
  job.partial = partial;
  iter_run(&it, ctx->num_threads, reduce_segment, &job);
  /* combine in task order: the same bits for any thread count */
  double total = 0.0;
  for (int64_t t = 0; t < ntasks; t++)
    total = kind == GDP_REDUCE_MAXABS ? max_nan(total, partial[t]) : total + partial[t];
  free(partial);
  *out = total;
  return GDP_OK;
}

/* ------------------------------------------------------------------ matmul */

/* How BLAS can read a 2-D operand x: row-major with leading dimension ld, or, when x
 * is column-major, as the row-major x^T with the transpose flag flipped.  Dims of
 * size 1 leave their stride free.  Returns 0 when neither fits (a copy is needed). */
static int blas_view(const gdp_tensor *x, int trans, int *eff_trans, int64_t *ld) {
  int64_t r = x->shape[0], c = x->shape[1], s0 = x->stride[0], s1 = x->stride[1];
  int64_t cmin = c > 1 ? c : 1, rmin = r > 1 ? r : 1;
  if ((s1 == 1 || c <= 1) && (r <= 1 || s0 >= cmin)) {
    *ld = r <= 1 ? cmin : s0;
    *eff_trans = trans;
    return *ld <= INT_MAX;
  }
  if ((s0 == 1 || r <= 1) && (c <= 1 || s1 >= rmin)) {
    *ld = c <= 1 ? rmin : s1;
    *eff_trans = !trans;
    return *ld <= INT_MAX;
  }
  return 0;
}

static void gemm(gdp_dtype dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                 const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C,
                 int64_t ldc) {
  enum CBLAS_TRANSPOSE cta = ta ? CblasTrans : CblasNoTrans;
  enum CBLAS_TRANSPOSE ctb = tb ? CblasTrans : CblasNoTrans;
  if (dtype == GDP_DTYPE_F64)
    cblas_dgemm(CblasRowMajor, cta, ctb, (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb,
                beta, C, (int)ldc);
  else
    cblas_sgemm(CblasRowMajor, cta, ctb, (int)M, (int)N, (int)K, (float)alpha, A, (int)lda, B,
                (int)ldb, (float)beta, C, (int)ldc);
}

static gdp_status cpu_matmul_2d(gdp_ctx *ctx, gdp_tensor *out, const gdp_tensor *a,
                                const gdp_tensor *b, int trans_a, int trans_b, double alpha,
                                double beta) {
  int64_t M = out->shape[0], N = out->shape[1];
  int64_t K = trans_a ? a->shape[0] : a->shape[1];
  if (M == 0 || N == 0) return GDP_OK;
  if (gdp_interrupt_poll()) /* one poll per call: a BLAS call itself cannot be stopped */
    return GDP_ERROR(GDP_ERR_INTERRUPTED, "interrupted (the interrupt flag was set: Ctrl-C)");
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
    return GDP_ERROR(GDP_ERR_UNSUPPORTED, "sizes M=%lld N=%lld K=%lld exceed BLAS int range",
                     (long long)M, (long long)N, (long long)K);
  if (K == 0) { /* BLAS implementations disagree on K = 0; out = beta * out */
    if (beta == 0.0) return cpu_fill(ctx, out, 0.0);
    return cpu_binary(ctx, out, out, NULL, GDP_BINARY_SCALE, beta);
  }
  gdp_status st = GDP_OK;
  gdp_tensor *ta_tmp = NULL, *tb_tmp = NULL, *out_tmp = NULL;
  int ea = 0, eb = 0, eo = 0; /* set by gemm_operand; initialised for -Wmaybe-uninitialized */
  int64_t lda = 0, ldb = 0, ldo = 0;
  if (!blas_view(a, trans_a, &ea, &lda)) {
    st = gdp_tensor_contiguous((gdp_tensor *)a, &ta_tmp);
    if (st != GDP_OK) goto done;
    a = ta_tmp;
    blas_view(a, trans_a, &ea, &lda);
  }
  if (!blas_view(b, trans_b, &eb, &ldb)) {
    st = gdp_tensor_contiguous((gdp_tensor *)b, &tb_tmp);
    if (st != GDP_OK) goto done;
    b = tb_tmp;
    blas_view(b, trans_b, &eb, &ldb);
  }
  gdp_tensor *c = out;
  if (!blas_view(out, 0, &eo, &ldo)) {
    /* beta = 0 never reads out (BLAS semantics), so only copy it when needed */
    st = beta != 0.0 ? gdp_tensor_clone(out, &out_tmp)
                     : gdp_tensor_empty(ctx, out->dtype, 2, out->shape, &out_tmp);
    if (st != GDP_OK) goto done;
    c = out_tmp;
    blas_view(c, 0, &eo, &ldo);
  }
  if (openblas_get_num_threads() != ctx->num_threads) openblas_set_num_threads(ctx->num_threads);
  if (!eo) {
    gemm(out->dtype, ea, eb, M, N, K, alpha, gdp_tensor_ptr(a), lda, gdp_tensor_ptr(b), ldb,
         beta, gdp_tensor_ptr(c), ldo);
  } else {
    /* out is column-major: compute out^T = op(b)^T op(a)^T in row-major */
    gemm(out->dtype, !eb, !ea, N, M, K, alpha, gdp_tensor_ptr(b), ldb, gdp_tensor_ptr(a), lda,
         beta, gdp_tensor_ptr(c), ldo);
  }
  if (out_tmp) st = cpu_copy(ctx, out, out_tmp);
done:
  gdp_tensor_free(ta_tmp);
  gdp_tensor_free(tb_tmp);
  gdp_tensor_free(out_tmp);
  return st;
}

/* Entry i of a batched operand: a view of [i] of a 3-D tensor (any batch stride); a 2-D
 * operand is the same matrix for every entry. */
static gdp_status batch_entry(const gdp_tensor *t, int64_t i, gdp_tensor **out) {
  if (t->ndim == 2) {
    *out = gdp_tensor_retain((gdp_tensor *)t);
    return GDP_OK;
  }
  return gdp_tensor_select((gdp_tensor *)t, 0, i, out);
}

/* A batched product is one 2-D product per batch entry. */
static gdp_status cpu_matmul(gdp_ctx *ctx, gdp_tensor *out, const gdp_tensor *a,
                             const gdp_tensor *b, int trans_a, int trans_b, double alpha,
                             double beta) {
  if (out->ndim == 2) return cpu_matmul_2d(ctx, out, a, b, trans_a, trans_b, alpha, beta);
  gdp_status st = GDP_OK;
  for (int64_t i = 0; st == GDP_OK && i < out->shape[0]; i++) {
    gdp_tensor *oi = NULL, *ai = NULL, *bi = NULL;
    st = batch_entry(out, i, &oi);
    if (st == GDP_OK) st = batch_entry(a, i, &ai);
    if (st == GDP_OK) st = batch_entry(b, i, &bi);
    if (st == GDP_OK) st = cpu_matmul_2d(ctx, oi, ai, bi, trans_a, trans_b, alpha, beta);
    gdp_tensor_free(oi);
    gdp_tensor_free(ai);
    gdp_tensor_free(bi);
  }
  return st;
}

/* ------------------------------------------------------------------ GDP operator */

/* float64 under "recurrent" is the oracle itself (op_gdp.c computes it in float64) */
static const char *cpu_gdp_path(const gdp_delta_product_problem *p) {
  return p->algorithm == GDP_ALGO_RECURRENT && p->dtype == GDP_DTYPE_F64 ? "recurrent" : "chunked";
}

static gdp_status cpu_gdp_forward(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                  const gdp_delta_product_forward_io *io) {
  if (p->l2norm_in_kernel)
    return GDP_ERROR(GDP_ERR_INTERNAL, "the CPU kernels take q and k already L2-normalised "
                                       "(l2norm_in_kernel must be 0)");
  switch (p->dtype) {
    case GDP_DTYPE_F64:
      return p->algorithm == GDP_ALGO_RECURRENT ? gdp_cpu_delta_product_forward_recurrent_f64(p, io)
                                                : gdp_cpu_delta_product_forward_chunk_f64(p, io);
    case GDP_DTYPE_F32:
      return gdp_cpu_delta_product_forward_chunk_f32(p, io);
    default:
      return GDP_ERROR(GDP_ERR_DTYPE, "the CPU kernels take f64 or f32 buffers, got %s",
                       gdp_dtype_name((gdp_dtype)p->dtype));
  }
}

static gdp_status cpu_gdp_backward(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                   const gdp_delta_product_backward_io *io) {
  if (p->l2norm_in_kernel)
    return GDP_ERROR(GDP_ERR_INTERNAL, "the CPU kernels take q and k already L2-normalised "
                                       "(l2norm_in_kernel must be 0)");
  switch (p->dtype) {
    case GDP_DTYPE_F64:
      return p->algorithm == GDP_ALGO_RECURRENT ? gdp_cpu_delta_product_backward_recurrent_f64(p, io)
                                                : gdp_cpu_delta_product_backward_chunk_f64(p, io);
    case GDP_DTYPE_F32:
      return gdp_cpu_delta_product_backward_chunk_f32(p, io);
    default:
      return GDP_ERROR(GDP_ERR_DTYPE, "the CPU kernels take f64 or f32 buffers, got %s",
                       gdp_dtype_name((gdp_dtype)p->dtype));
  }
}

/* ------------------------------------------------------------------ L2 norm, mixer ops */

/* The op layer hands these f64 or f32 buffers (the kernels' two instantiations). */
#define CPU_FLOAT_DISPATCH(dtype, call64, call32)                                          \
  do {                                                                                   \
    if ((dtype) == GDP_DTYPE_F64) {                                                      \
      call64;                                                                            \
    } else if ((dtype) == GDP_DTYPE_F32) {                                               \
      call32;                                                                            \
    } else {                                                                             \
      return GDP_ERROR(GDP_ERR_DTYPE, "the CPU kernels take f64 or f32 buffers, got %s", \
                       gdp_dtype_name((gdp_dtype)(dtype)));                              \
    }                                                                                    \
  } while (0)

static gdp_status cpu_l2norm_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t dim,
                                     double eps, const void *x, void *y) {
  CPU_FLOAT_DISPATCH(dtype,
                     gdp_cpu_l2norm_fwd_f64(rows, dim, eps, x, y, ctx->num_threads),
                     gdp_cpu_l2norm_fwd_f32(rows, dim, eps, x, y, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_l2norm_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t dim,
                                      double eps, const void *x, const void *dy, void *dx) {
  CPU_FLOAT_DISPATCH(dtype,
                     gdp_cpu_l2norm_bwd_f64(rows, dim, eps, x, dy, dx, ctx->num_threads),
                     gdp_cpu_l2norm_bwd_f32(rows, dim, eps, x, dy, dx, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_conv1d_forward(gdp_ctx *ctx, const gdp_conv1d_problem *p, const void *x,
                                     const void *wt, const void *bias, const void *halo,
                                     void *out) {
  CPU_FLOAT_DISPATCH(p->dtype, gdp_cpu_conv1d_fwd_f64(p, x, wt, bias, halo, out),
                     gdp_cpu_conv1d_fwd_f32(p, x, wt, bias, halo, out));
  return GDP_OK;
}

static gdp_status cpu_conv1d_backward(gdp_ctx *ctx, const gdp_conv1d_problem *p, const void *x,
                                      const void *wt, const void *bias, const void *halo,
                                      const void *d_out, void *dx, void *dweight, void *dbias,
                                      void *dhalo) {
  CPU_FLOAT_DISPATCH(
      p->dtype,
      return gdp_cpu_conv1d_bwd_f64(p, x, wt, bias, halo, d_out, dx, dweight, dbias, dhalo),
      return gdp_cpu_conv1d_bwd_f32(p, x, wt, bias, halo, d_out, dx, dweight, dbias, dhalo));
  return GDP_OK;
}

static gdp_status cpu_ssm_inputs_forward(gdp_ctx *ctx, const gdp_ssm_inputs_problem *p,
                                         const gdp_ssm_inputs_fwd_io *io) {
  (void)ctx;
  CPU_FLOAT_DISPATCH(p->dtype, gdp_cpu_ssm_inputs_fwd_f64(p, io), gdp_cpu_ssm_inputs_fwd_f32(p, io));
  return GDP_OK;
}

static gdp_status cpu_ssm_inputs_backward(gdp_ctx *ctx, const gdp_ssm_inputs_problem *p,
                                          const gdp_ssm_inputs_bwd_io *io) {
  (void)ctx;
  CPU_FLOAT_DISPATCH(p->dtype, return gdp_cpu_ssm_inputs_bwd_f64(p, io),
                     return gdp_cpu_ssm_inputs_bwd_f32(p, io));
  return GDP_OK;
}

static gdp_status cpu_beta_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t n, double scale,
                                   const void *b, void *beta) {
  CPU_FLOAT_DISPATCH(dtype, gdp_cpu_beta_fwd_f64(n, scale, b, beta, ctx->num_threads),
                     gdp_cpu_beta_fwd_f32(n, scale, b, beta, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_beta_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t n, double scale,
                                    const void *b, const void *d_beta, void *db) {
  CPU_FLOAT_DISPATCH(dtype, gdp_cpu_beta_bwd_f64(n, scale, b, d_beta, db, ctx->num_threads),
                     gdp_cpu_beta_bwd_f32(n, scale, b, d_beta, db, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_silu_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t C,
                                   const void *x, int64_t ld_x, void *out, int64_t ld_out) {
  CPU_FLOAT_DISPATCH(dtype, gdp_cpu_silu_fwd_f64(rows, C, x, ld_x, out, ld_out, ctx->num_threads),
                     gdp_cpu_silu_fwd_f32(rows, C, x, ld_x, out, ld_out, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_silu_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t C,
                                    const void *x, int64_t ld_x, const void *d_out,
                                    int64_t ld_d, void *dx, int64_t ld_dx) {
  CPU_FLOAT_DISPATCH(dtype,
                     gdp_cpu_silu_bwd_f64(rows, C, x, ld_x, d_out, ld_d, dx, ld_dx,
                                          ctx->num_threads),
                     gdp_cpu_silu_bwd_f32(rows, C, x, ld_x, d_out, ld_d, dx, ld_dx,
                                          ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_decay_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                                    const void *a, const void *A_log, const void *dt_bias,
                                    void *g) {
  CPU_FLOAT_DISPATCH(dtype,
                     gdp_cpu_decay_fwd_f64(rows, H, a, A_log, dt_bias, g, ctx->num_threads),
                     gdp_cpu_decay_fwd_f32(rows, H, a, A_log, dt_bias, g, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_decay_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                                     const void *a, const void *A_log, const void *dt_bias,
                                     const void *d_g, void *da, void *dA_log, void *ddt_bias) {
  CPU_FLOAT_DISPATCH(dtype,
                     return gdp_cpu_decay_bwd_f64(rows, H, a, A_log, dt_bias, d_g, da, dA_log,
                                                  ddt_bias, ctx->num_threads),
                     return gdp_cpu_decay_bwd_f32(rows, H, a, A_log, dt_bias, d_g, da, dA_log,
                                                  ddt_bias, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_out_norm_forward(gdp_ctx *ctx, const gdp_out_norm_problem *p,
                                      const void *o, const void *x_v, const void *D,
                                      const void *z, const void *weight, void *out) {
  (void)ctx;
  CPU_FLOAT_DISPATCH(p->dtype, return gdp_cpu_out_norm_fwd_f64(p, o, x_v, D, z, weight, out),
                     return gdp_cpu_out_norm_fwd_f32(p, o, x_v, D, z, weight, out));
  return GDP_OK;
}

static gdp_status cpu_out_norm_backward(gdp_ctx *ctx, const gdp_out_norm_problem *p,
                                       const void *o, const void *x_v, const void *D,
                                       const void *z, const void *weight, const void *d_out,
                                       void *d_o, void *dz, void *dx_v, void *dD, void *dweight) {
  (void)ctx;
  CPU_FLOAT_DISPATCH(p->dtype,
                     return gdp_cpu_out_norm_bwd_f64(p, o, x_v, D, z, weight, d_out, d_o, dz,
                                                     dx_v, dD, dweight),
                     return gdp_cpu_out_norm_bwd_f32(p, o, x_v, D, z, weight, d_out, d_o, dz,
                                                     dx_v, dD, dweight));
  return GDP_OK;
}

static gdp_status cpu_dskip_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                                    int64_t P, int per_channel, const void *y, const void *x_v,
                                    const void *D, void *out) {
  CPU_FLOAT_DISPATCH(
      dtype, gdp_cpu_dskip_fwd_f64(rows, H, P, per_channel, y, x_v, D, out, ctx->num_threads),
      gdp_cpu_dskip_fwd_f32(rows, H, P, per_channel, y, x_v, D, out, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_dskip_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                                     int64_t P, int per_channel, const void *x_v, const void *D,
                                     const void *d_out, void *dx_v, void *dD) {
  CPU_FLOAT_DISPATCH(dtype,
                     return gdp_cpu_dskip_bwd_f64(rows, H, P, per_channel, x_v, D, d_out, dx_v,
                                                  dD, ctx->num_threads),
                     return gdp_cpu_dskip_bwd_f32(rows, H, P, per_channel, x_v, D, d_out, dx_v,
                                                  dD, ctx->num_threads));
  return GDP_OK;
}

/* ------------------------------------------------------------------ synthetic data */

static gdp_status cpu_state_tracking(gdp_ctx *ctx, const gdp_state_tracking_problem *p,
                                     int32_t *tokens, int32_t *labels) {
  gdp_state_tracking_problem q = *p;
  q.num_threads = ctx->num_threads;
  gdp_cpu_state_tracking(&q, tokens, labels);
  return GDP_OK;
}

/* ------------------------------------------------------------------ optimisers */

static gdp_status cpu_optim_update(gdp_ctx *ctx, const gdp_optim_update *u) {
  gdp_cpu_optim_update(u);
  return GDP_OK;
}

/* ------------------------------------------------------------------ model layer ops */

static gdp_status cpu_silu_mul_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t n,
                                       const void *gate, const void *up, void *out) {
  CPU_FLOAT_DISPATCH(dtype, gdp_cpu_silu_mul_fwd_f64(n, gate, up, out, ctx->num_threads),
                     gdp_cpu_silu_mul_fwd_f32(n, gate, up, out, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_silu_mul_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t n,
                                        const void *gate, const void *up, const void *d_out,
                                        void *d_gate, void *d_up) {
  CPU_FLOAT_DISPATCH(
      dtype, gdp_cpu_silu_mul_bwd_f64(n, gate, up, d_out, d_gate, d_up, ctx->num_threads),
      gdp_cpu_silu_mul_bwd_f32(n, gate, up, d_out, d_gate, d_up, ctx->num_threads));
  return GDP_OK;
}

static gdp_status cpu_embedding_forward(gdp_ctx *ctx, const gdp_embedding_problem *p,
                                        const void *weight, void *out) {
  CPU_FLOAT_DISPATCH(p->dtype, gdp_cpu_embedding_fwd_f64(p, weight, out),
                     gdp_cpu_embedding_fwd_f32(p, weight, out));
  return GDP_OK;
}

static gdp_status cpu_embedding_backward(gdp_ctx *ctx, const gdp_embedding_problem *p,
                                         const void *d_out, void *dweight) {
  CPU_FLOAT_DISPATCH(p->dtype, gdp_cpu_embedding_bwd_f64(p, d_out, dweight),
                     gdp_cpu_embedding_bwd_f32(p, d_out, dweight));
  return GDP_OK;
}

static gdp_status cpu_cross_entropy(gdp_ctx *ctx, const gdp_cross_entropy_problem *p,
                                    const void *logits, void *result, void *dlogits) {
  double loss_sum = 0.0;
  CPU_FLOAT_DISPATCH(p->dtype, gdp_cpu_cross_entropy_f64(p, logits, &loss_sum, dlogits),
                     gdp_cpu_cross_entropy_f32(p, logits, &loss_sum, dlogits));
  ((double *)result)[0] = loss_sum * p->scale;
  ((double *)result)[1] = (double)p->counted;
  return GDP_OK;
}

/* ------------------------------------------------------------------ capabilities */

static int cpu_supports(gdp_op op, gdp_dtype dtype) {
  int is_float = dtype == GDP_DTYPE_F64 || dtype == GDP_DTYPE_F32 || dtype == GDP_DTYPE_BF16;
  switch (op) {
    case GDP_OP_COPY:
    case GDP_OP_ELEMENTWISE: /* integers go through float64: exact below 2^53 */
    case GDP_OP_REDUCE:
      return dtype >= 0 && dtype < GDP_DTYPE_COUNT;
    case GDP_OP_RNG:
      return is_float;
    case GDP_OP_MATMUL:
      return dtype == GDP_DTYPE_F64 || dtype == GDP_DTYPE_F32;
    case GDP_OP_GDP_FORWARD:
    case GDP_OP_GDP_BACKWARD:
      /* bf16 inputs are computed in float32 (the op layer converts) */
      return is_float;
    default:
      return 0;
  }
}

const gdp_backend gdp_backend_cpu = {
    .name = "cpu",
    .type = GDP_DEVICE_CPU,
    .device_count = cpu_device_count,
    .ctx_init = NULL,
    .ctx_fini = NULL,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .sync = cpu_sync,
    .to_device = cpu_memcpy,
    .to_host = cpu_memcpy,
    .copy = cpu_copy,
    .fill = cpu_fill,
    .rng = cpu_rng,
    .binary = cpu_binary,
    .reduce = cpu_reduce,
    .matmul = cpu_matmul,
    .gdp_forward = cpu_gdp_forward,
    .gdp_path = cpu_gdp_path,
    .gdp_backward = cpu_gdp_backward,
    .l2norm_forward = cpu_l2norm_forward,
    .l2norm_backward = cpu_l2norm_backward,
    .conv1d_forward = cpu_conv1d_forward,
    .conv1d_backward = cpu_conv1d_backward,
    .beta_forward = cpu_beta_forward,
    .beta_backward = cpu_beta_backward,
    .silu_forward = cpu_silu_forward,
    .silu_backward = cpu_silu_backward,
    .decay_forward = cpu_decay_forward,
    .decay_backward = cpu_decay_backward,
    .out_norm_forward = cpu_out_norm_forward,
    .out_norm_backward = cpu_out_norm_backward,
    .dskip_forward = cpu_dskip_forward,
    .dskip_backward = cpu_dskip_backward,
    .ssm_inputs_forward = cpu_ssm_inputs_forward,
    .ssm_inputs_backward = cpu_ssm_inputs_backward,
    .state_tracking = cpu_state_tracking,
    .optim_update = cpu_optim_update,
    .silu_mul_forward = cpu_silu_mul_forward,
    .silu_mul_backward = cpu_silu_mul_backward,
    .embedding_forward = cpu_embedding_forward,
    .embedding_backward = cpu_embedding_backward,
    .cross_entropy = cpu_cross_entropy,
    .supports = cpu_supports,
};
