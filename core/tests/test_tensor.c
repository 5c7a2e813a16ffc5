/*
 * test_tensor.c -- tensors on the CPU backend: construction, views, copies and
 * dtype conversions (exact expected bits), bf16 rounding, element access,
 * elementwise ops, reductions, rel_error rules, matmul against a naive loop,
 * error messages, free order, empty and 0-dim tensors, write versions, memory
 * accounting.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

static gdp_ctx *ctx;

#define NELEM(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))

/* ------------------------------------------------------------------ helpers */

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Tensor of dtype f64 from host doubles. */
static gdp_tensor *tensor_f64(int ndim, const int64_t *shape, const double *data) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_F64, ndim, shape, GDP_DTYPE_F64, data,
                                (size_t)n * 8, &t));
  return t;
}

/* 0, 1, 2, ... as f64 */
static gdp_tensor *arange(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  double *d = malloc((size_t)(n ? n : 1) * sizeof *d);
  for (int64_t i = 0; i < n; i++) d[i] = (double)i;
  gdp_tensor *t = tensor_f64(ndim, shape, d);
  free(d);
  return t;
}

static gdp_tensor *random_tensor(gdp_dtype dtype, int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  double *d = malloc((size_t)(n ? n : 1) * sizeof *d);
  for (int64_t i = 0; i < n; i++) d[i] = tu_rand_normal();
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, dtype, ndim, shape, GDP_DTYPE_F64, d, (size_t)n * 8, &t));
  free(d);
  return t;
}

/* All values of t (row-major) as doubles; caller frees. */
static double *values(const gdp_tensor *t) {
  int64_t n = gdp_tensor_numel(t);
  double *d = malloc((size_t)(n ? n : 1) * sizeof *d);
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_F64, d, (size_t)n * 8));
  return d;
}

static double get1(const gdp_tensor *t, int64_t i0) {
  double v = NAN;
  CHECK_OK(gdp_tensor_get(t, &i0, &v));
  return v;
}

static double get2(const gdp_tensor *t, int64_t i0, int64_t i1) {
  int64_t idx[2] = {i0, i1};
  double v = NAN;
  CHECK_OK(gdp_tensor_get(t, idx, &v));
  return v;
}

static int same_shape(const gdp_tensor *t, int ndim, const int64_t *shape) {
  if (gdp_tensor_ndim(t) != ndim) return 0;
  for (int i = 0; i < ndim; i++)
    if (gdp_tensor_size(t, i) != shape[i]) return 0;
  return 1;
}

/* Raw bytes of value v in dtype (the test's own encoding: v must be exact there). */
static void encode(gdp_dtype dtype, double v, void *out) {
  switch (dtype) {
    case GDP_DTYPE_F64: memcpy(out, &v, 8); break;
    case GDP_DTYPE_F32: { float f = (float)v; memcpy(out, &f, 4); break; }
    case GDP_DTYPE_BF16: { uint16_t b = (uint16_t)(f32_bits((float)v) >> 16); memcpy(out, &b, 2); break; }
    case GDP_DTYPE_I32: { int32_t i = (int32_t)v; memcpy(out, &i, 4); break; }
    case GDP_DTYPE_I64: { int64_t i = (int64_t)v; memcpy(out, &i, 8); break; }
    default: break;
  }
}

/* ------------------------------------------------------------------ basics */

static void test_basics(void) {
  CHECK(strcmp(gdp_dtype_name(GDP_DTYPE_BF16), "bf16") == 0, "bf16 name");
  CHECK(strcmp(gdp_dtype_name((gdp_dtype)99), "?") == 0, "bad dtype name");
  CHECK(gdp_dtype_size(GDP_DTYPE_F64) == 8 && gdp_dtype_size(GDP_DTYPE_F32) == 4 &&
            gdp_dtype_size(GDP_DTYPE_BF16) == 2 && gdp_dtype_size(GDP_DTYPE_I32) == 4 &&
            gdp_dtype_size(GDP_DTYPE_I64) == 8 && gdp_dtype_size((gdp_dtype)-1) == 0,
        "dtype sizes");
  const char *names[] = {"f64", "float64", "double", "f32", "float32", "float",
                         "bf16", "bfloat16", "i32", "int32", "i64", "int64"};
  const gdp_dtype want[] = {GDP_DTYPE_F64, GDP_DTYPE_F64, GDP_DTYPE_F64, GDP_DTYPE_F32,
                            GDP_DTYPE_F32, GDP_DTYPE_F32, GDP_DTYPE_BF16, GDP_DTYPE_BF16,
                            GDP_DTYPE_I32, GDP_DTYPE_I32, GDP_DTYPE_I64, GDP_DTYPE_I64};
  for (int i = 0; i < 12; i++) {
    gdp_dtype d = GDP_DTYPE_COUNT;
    CHECK_OK(gdp_dtype_from_name(names[i], &d));
    CHECK(d == want[i], "from_name(%s) = %d", names[i], (int)d);
  }
  gdp_dtype d;
  CHECK_ERR(gdp_dtype_from_name("f16", &d), GDP_ERR_DTYPE, "unknown dtype name \"f16\"");
  /* the device timer: the CPU has none; the hold is range-checked first, by name */
  double ms = -1;
  CHECK_ERR(gdp_ctx_timer_start(ctx, 20), GDP_ERR_UNSUPPORTED, "no device timer on cpu");
  CHECK_ERR(gdp_ctx_timer_stop(ctx, &ms), GDP_ERR_UNSUPPORTED, "no device timer on cpu");
  CHECK_ERR(gdp_ctx_timer_start(ctx, 0), GDP_ERR_INVALID_ARG, "hold_ms must be in (0, 10000]");
  CHECK_ERR(gdp_ctx_timer_start(ctx, NAN), GDP_ERR_INVALID_ARG, "hold_ms");
  CHECK_ERR(gdp_ctx_timer_stop(ctx, NULL), GDP_ERR_INVALID_ARG, "device_ms is NULL");
  CHECK(ms == -1, "a refused timer leaves device_ms alone");
  CHECK(strcmp(gdp_status_name(GDP_ERR_SHAPE), "GDP_ERR_SHAPE") == 0, "status name");
  CHECK(strcmp(gdp_status_name((gdp_status)-99), "GDP_ERR_UNKNOWN") == 0, "unknown status");
  CHECK(strcmp(gdp_device_type_name(GDP_DEVICE_CUDA), "cuda") == 0, "device name");
  CHECK(gdp_abi_version() == 1, "abi version");
  CHECK(gdp_version() && strlen(gdp_version()) > 0, "version");
  const char *info = gdp_build_info();
  CHECK(strstr(info, "version: ") && strstr(info, "blas: ") && strstr(info, "cuda: ") &&
            strstr(info, "blas_config: "),
        "build info: %s", info);
  CHECK(gdp_device_count(GDP_DEVICE_CPU) == 1, "one cpu device");
  CHECK(gdp_ctx_device_type(ctx) == GDP_DEVICE_CPU && gdp_ctx_device_index(ctx) == 0, "ctx device");
  CHECK(gdp_ctx_num_threads(ctx) >= 1, "threads");
  gdp_ctx_set_num_threads(ctx, 3);
  CHECK(gdp_ctx_num_threads(ctx) == 3, "set threads");
  gdp_ctx_set_num_threads(ctx, 0);
  CHECK(gdp_ctx_num_threads(ctx) >= 1, "reset threads");
  CHECK(gdp_ctx_supports(ctx, GDP_OP_MATMUL, GDP_DTYPE_F32) == 1, "matmul f32");
  CHECK(gdp_ctx_supports(ctx, GDP_OP_MATMUL, GDP_DTYPE_I32) == 0, "no matmul i32");
  CHECK(gdp_ctx_supports(ctx, GDP_OP_RNG, GDP_DTYPE_I64) == 0, "no rng i64");
  CHECK(gdp_ctx_supports(ctx, (gdp_op)42, GDP_DTYPE_F32) == 0, "bad op");
  CHECK_OK(gdp_ctx_sync(ctx));
  gdp_ctx *c2 = NULL;
  CHECK_ERR(gdp_ctx_new(GDP_DEVICE_CPU, 1, &c2), GDP_ERR_INVALID_ARG, "index: expected 0 <= index < 1");
  CHECK(c2 == NULL, "no ctx on failure");
  if (gdp_device_count(GDP_DEVICE_CUDA) == 0) {
    gdp_status s = gdp_ctx_new(GDP_DEVICE_CUDA, 0, &c2);
    CHECK(s == GDP_ERR_UNSUPPORTED || s == GDP_ERR_INVALID_ARG, "cuda without devices: %s",
          gdp_status_name(s));
  }
  double t0 = gdp_time_now(), t1 = gdp_time_now();
  CHECK(t1 >= t0 && t0 > 0, "monotonic clock");
  gdp_clear_error();
  CHECK(gdp_last_error()[0] == '\0', "clear_error");
}

/* ------------------------------------------------------------------ construction */

static void test_construct(void) {
  int64_t shape[3] = {2, 3, 5};
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 3, shape, &t));
  CHECK(gdp_tensor_ndim(t) == 3 && gdp_tensor_numel(t) == 30, "zeros shape");
  CHECK(gdp_tensor_stride(t, 0) == 15 && gdp_tensor_stride(t, 1) == 5 && gdp_tensor_stride(t, 2) == 1,
        "contiguous strides");
  CHECK(gdp_tensor_size(t, -1) == 5 && gdp_tensor_size(t, -3) == 2, "negative dims");
  CHECK(gdp_tensor_size(t, 3) == -1 && gdp_tensor_size(t, -4) == -1, "size out of range -> -1");
  CHECK(gdp_tensor_dtype(t) == GDP_DTYPE_F32, "dtype");
  CHECK(gdp_tensor_device_type(t) == GDP_DEVICE_CPU && gdp_tensor_device_index(t) == 0, "device");
  CHECK(gdp_tensor_ctx(t) == ctx, "ctx");
  CHECK(gdp_tensor_is_contiguous(t) && !gdp_tensor_is_view(t), "fresh tensor");
  CHECK(((uintptr_t)gdp_tensor_data(t) % 64) == 0, "64-byte aligned data");
  double s = -1, m = -1;
  CHECK_OK(gdp_tensor_sum(t, &s));
  CHECK_OK(gdp_tensor_max_abs(t, &m));
  CHECK(s == 0 && m == 0, "zeros are zero");
  gdp_tensor_free(t);

  /* from_host converting int32 -> f64 */
  int32_t iv[6] = {1, -2, 3, -4, 5, 2147483647};
  int64_t s2[2] = {2, 3};
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_F64, 2, s2, GDP_DTYPE_I32, iv, sizeof iv, &t));
  double *v = values(t);
  for (int i = 0; i < 6; i++) CHECK(v[i] == (double)iv[i], "from_host i32 [%d] = %g", i, v[i]);
  free(v);
  gdp_tensor_free(t);

  gdp_tensor *bad = (gdp_tensor *)0x1;
  int64_t neg[2] = {2, -3};
  CHECK_ERR(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 2, neg, &bad), GDP_ERR_SHAPE,
            "shape [2x-3]: size of dim 1 must be >= 0, got -3");
  CHECK(bad == NULL, "out cleared on failure");
  int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  CHECK_ERR(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 9, nine, &bad), GDP_ERR_SHAPE, "ndim: expected 0..8, got 9");
  CHECK_ERR(gdp_tensor_empty(ctx, (gdp_dtype)7, 1, nine, &bad), GDP_ERR_DTYPE, "dtype: expected a gdp_dtype");
  CHECK_ERR(gdp_tensor_empty(NULL, GDP_DTYPE_F32, 1, nine, &bad), GDP_ERR_INVALID_ARG, "ctx is NULL");
  int64_t huge[2] = {INT64_MAX / 2, 4};
  CHECK_ERR(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 2, huge, &bad), GDP_ERR_SHAPE, "too many elements");
  CHECK_ERR(gdp_tensor_from_host(ctx, GDP_DTYPE_F32, 2, s2, GDP_DTYPE_I32, iv, 20, &bad),
            GDP_ERR_INVALID_ARG, "nbytes: expected 24 (6 elements of i32 for shape [2x3]), got 20");
  /* the location is repo-relative */
  CHECK(strstr(gdp_last_error(), "(core/src/tensor.c:") != NULL, "location: %s", gdp_last_error());
  CHECK(strncmp(gdp_last_error(), "gdp_tensor_from_host: ", 22) == 0, "function name first: %s",
        gdp_last_error());
}

/* ------------------------------------------------------------------ views */

static void test_views(void) {
  int64_t s26[2] = {2, 6};
  gdp_tensor *a = arange(2, s26); /* a[i][j] = 6i + j */
  gdp_tensor *v = NULL;

  /* narrow */
  CHECK_OK(gdp_tensor_narrow(a, 1, 2, 3, &v));
  int64_t s23[2] = {2, 3};
  CHECK(same_shape(v, 2, s23), "narrow shape");
  CHECK(gdp_tensor_is_view(v) && !gdp_tensor_is_contiguous(v), "narrow is a non-contiguous view");
  CHECK(gdp_tensor_offset(v) == 2, "narrow offset %lld", (long long)gdp_tensor_offset(v));
  double *d = values(v);
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 3; j++) CHECK(d[i * 3 + j] == 6 * i + j + 2, "narrow[%d][%d]", i, j);
  free(d);
  gdp_tensor_free(v);
  CHECK_OK(gdp_tensor_narrow(a, -2, 1, 1, &v));
  CHECK(gdp_tensor_size(v, 0) == 1 && get2(v, 0, 5) == 11, "narrow dim -2");
  gdp_tensor_free(v);
  CHECK_OK(gdp_tensor_narrow(a, 1, 6, 0, &v)); /* empty at the end is fine */
  CHECK(gdp_tensor_numel(v) == 0, "empty narrow");
  gdp_tensor_free(v);
  CHECK_ERR(gdp_tensor_narrow(a, 1, 3, 5, &v), GDP_ERR_INVALID_ARG,
            "gdp_tensor_narrow: start + length out of range for dim 1 of [2x6]: start 3, length 5 "
            "(core/src/tensor.c:");
  CHECK_ERR(gdp_tensor_narrow(a, 2, 0, 1, &v), GDP_ERR_INVALID_ARG,
            "dim: expected -2 <= dim < 2 for a 2-dim tensor [2x6], got 2");
  CHECK_ERR(gdp_tensor_narrow(a, 0, 0, -1, &v), GDP_ERR_INVALID_ARG, "length must be >= 0");

  /* select */
  CHECK_OK(gdp_tensor_select(a, 0, 1, &v));
  CHECK(gdp_tensor_ndim(v) == 1 && gdp_tensor_size(v, 0) == 6 && get1(v, 0) == 6 && get1(v, 5) == 11,
        "select row 1");
  gdp_tensor_free(v);
  CHECK_OK(gdp_tensor_select(a, -1, -1, &v));
  CHECK(gdp_tensor_size(v, 0) == 2 && get1(v, 0) == 5 && get1(v, 1) == 11 && gdp_tensor_stride(v, 0) == 6,
        "select last column");
  gdp_tensor *s0 = NULL;
  CHECK_OK(gdp_tensor_select(v, 0, 1, &s0)); /* down to 0 dims */
  CHECK(gdp_tensor_ndim(s0) == 0 && gdp_tensor_numel(s0) == 1, "0-dim select");
  double x = 0;
  CHECK_OK(gdp_tensor_get(s0, NULL, &x));
  CHECK(x == 11, "0-dim value %g", x);
  gdp_tensor_free(s0);
  gdp_tensor_free(v);
  CHECK_ERR(gdp_tensor_select(a, 0, 2, &v), GDP_ERR_INVALID_ARG,
            "index: expected -2 <= index < 2 for dim 0 of [2x6], got 2");

  /* transpose */
  gdp_tensor *at = NULL;
  CHECK_OK(gdp_tensor_transpose(a, 0, -1, &at));
  int64_t s62[2] = {6, 2};
  CHECK(same_shape(at, 2, s62) && !gdp_tensor_is_contiguous(at), "transpose shape");
  d = values(at);
  for (int i = 0; i < 6; i++)
    for (int j = 0; j < 2; j++) CHECK(d[i * 2 + j] == 6 * j + i, "transpose[%d][%d]", i, j);
  free(d);

  /* permute */
  int64_t s234[3] = {2, 3, 4};
  gdp_tensor *b = arange(3, s234); /* b[i][j][k] = 12i + 4j + k */
  int perm[3] = {2, 0, -2};
  CHECK_OK(gdp_tensor_permute(b, 3, perm, &v));
  int64_t s423[3] = {4, 2, 3};
  CHECK(same_shape(v, 3, s423), "permute shape");
  d = values(v);
  int bad = 0;
  for (int k = 0; k < 4; k++)
    for (int i = 0; i < 2; i++)
      for (int j = 0; j < 3; j++) bad += d[(k * 2 + i) * 3 + j] != 12 * i + 4 * j + k;
  CHECK(bad == 0, "permute values: %d wrong", bad);
  free(d);
  gdp_tensor_free(v);
  int dup[3] = {0, 0, 1};
  CHECK_ERR(gdp_tensor_permute(b, 3, dup, &v), GDP_ERR_INVALID_ARG,
            "perm is not a permutation of 0..2: dim 0 appears twice (at perm[1])");
  CHECK_ERR(gdp_tensor_permute(b, 2, perm, &v), GDP_ERR_INVALID_ARG, "ndim: expected 3 (the dims of [2x3x4]), got 2");
  int oob[3] = {0, 1, 3};
  CHECK_ERR(gdp_tensor_permute(b, 3, oob, &v), GDP_ERR_INVALID_ARG, "perm[2]: expected -3 <= perm[2] < 3");

  /* view */
  int64_t s64[2] = {6, 4}, sm12[2] = {-1, 2}, s24[1] = {24};
  CHECK_OK(gdp_tensor_view(b, 2, s64, &v));
  CHECK(same_shape(v, 2, s64) && gdp_tensor_is_view(v) && get2(v, 5, 3) == 23, "view [6x4]");
  gdp_tensor_free(v);
  CHECK_OK(gdp_tensor_view(b, 2, sm12, &v));
  int64_t s122[2] = {12, 2};
  CHECK(same_shape(v, 2, s122) && get2(v, 11, 1) == 23, "view [-1x2] inferred");
  gdp_tensor_free(v);
  CHECK_OK(gdp_tensor_view(b, 1, s24, &v));
  CHECK(gdp_tensor_size(v, 0) == 24 && get1(v, 17) == 17, "flatten");
  gdp_tensor_free(v);
  int64_t twoneg[2] = {-1, -1};
  CHECK_ERR(gdp_tensor_view(b, 2, twoneg, &v), GDP_ERR_SHAPE, "only one size may be -1");
  int64_t s55[2] = {5, 5};
  CHECK_ERR(gdp_tensor_view(b, 2, s55, &v), GDP_ERR_SHAPE, "shape [5x5] has 25 elements, tensor [2x3x4] has 24");
  int64_t sm17[2] = {-1, 7};
  CHECK_ERR(gdp_tensor_view(b, 2, sm17, &v), GDP_ERR_SHAPE, "shape [-1x7] is invalid for tensor [2x3x4] of 24 elements");
  /* transposed: flattening needs a copy */
  int64_t s12[1] = {12};
  CHECK_ERR(gdp_tensor_view(at, 1, s12, &v), GDP_ERR_SHAPE,
            "tensor [6x2] with strides (1, 6) cannot be viewed as [12] without a copy");
  /* ... but splitting or adding unit dims works (torch's rule) */
  int64_t s3x2x2[3] = {3, 2, 2}, s6x1x2[3] = {6, 1, 2};
  CHECK_OK(gdp_tensor_view(at, 3, s3x2x2, &v));
  CHECK(gdp_tensor_stride(v, 0) == 2 && gdp_tensor_stride(v, 1) == 1 && gdp_tensor_stride(v, 2) == 6,
        "split transposed dim strides (%lld,%lld,%lld)", (long long)gdp_tensor_stride(v, 0),
        (long long)gdp_tensor_stride(v, 1), (long long)gdp_tensor_stride(v, 2));
  CHECK(get2(at, 3, 1) == 9, "at[3][1]");
  int64_t idx3[3] = {1, 1, 1};
  double y = 0;
  CHECK_OK(gdp_tensor_get(v, idx3, &y));
  CHECK(y == 9, "split view value %g", y);
  gdp_tensor_free(v);
  CHECK_OK(gdp_tensor_view(at, 3, s6x1x2, &v));
  gdp_tensor_free(v);
  /* narrowed columns: rows can be split, but not merged with columns */
  gdp_tensor *n = NULL;
  int64_t s4x6[2] = {4, 6};
  gdp_tensor *c = arange(2, s4x6);
  CHECK_OK(gdp_tensor_narrow(c, 1, 1, 3, &n)); /* [4x3], strides (6,1) */
  int64_t s2x2x3[3] = {2, 2, 3};
  CHECK_OK(gdp_tensor_view(n, 3, s2x2x3, &v));
  CHECK(gdp_tensor_stride(v, 0) == 12 && gdp_tensor_stride(v, 1) == 6, "split rows of narrowed");
  gdp_tensor_free(v);
  CHECK_ERR(gdp_tensor_view(n, 1, s12, &v), GDP_ERR_SHAPE, "cannot be viewed");

  /* reshape: a view when possible, a copy otherwise */
  CHECK_OK(gdp_tensor_reshape(n, 1, s12, &v));
  CHECK(!gdp_tensor_is_view(v) && gdp_tensor_is_contiguous(v), "reshape copies");
  d = values(v);
  bad = 0;
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++) bad += d[i * 3 + j] != 6 * i + j + 1;
  CHECK(bad == 0, "reshape copy values");
  free(d);
  gdp_tensor_free(v);
  CHECK_OK(gdp_tensor_reshape(b, 2, s64, &v));
  CHECK(gdp_tensor_is_view(v) && gdp_tensor_data(v) == gdp_tensor_data(b), "reshape views");
  gdp_tensor_free(v);

  /* contiguous and clone */
  CHECK_OK(gdp_tensor_contiguous(b, &v));
  CHECK(v == b, "contiguous of contiguous is the same tensor");
  gdp_tensor_free(v);
  CHECK_OK(gdp_tensor_contiguous(at, &v));
  CHECK(v != at && gdp_tensor_is_contiguous(v) && get2(v, 3, 1) == 9, "contiguous copy");
  gdp_tensor_free(v);
  CHECK_OK(gdp_tensor_clone(b, &v));
  CHECK(gdp_tensor_data(v) != gdp_tensor_data(b) && !gdp_tensor_is_view(v), "clone is new memory");
  double rel = -1;
  CHECK_OK(gdp_tensor_rel_error(v, b, &rel));
  CHECK(rel == 0, "clone equal");
  gdp_tensor_free(v);

  /* free order: parent first, views still work */
  gdp_tensor *v1 = NULL, *v2 = NULL;
  CHECK_OK(gdp_tensor_transpose(c, 0, 1, &v1));
  CHECK_OK(gdp_tensor_select(v1, 0, 2, &v2));
  gdp_tensor_free(c);
  gdp_tensor_free(n);
  gdp_tensor_free(v1);
  CHECK(get1(v2, 3) == 20, "view outlives parents");
  gdp_tensor *r = gdp_tensor_retain(v2);
  gdp_tensor_free(v2);
  CHECK(get1(r, 0) == 2, "retained view");
  gdp_tensor_free(r);
  gdp_tensor_free(NULL);

  gdp_tensor_free(at);
  gdp_tensor_free(b);
  gdp_tensor_free(a);
}

/* ------------------------------------------------------------------ dtype conversion */

static void test_copy_all_pairs(void) {
  /* values exact in every float dtype; integer destinations truncate toward zero */
  const double fvals[12] = {0, 1, -2, 3.5, -7.75, 100, 256, -1536, 0.5, -0.25, 65280, -3};
  const double ivals[12] = {0, 1, -2, 3, -7, 100, 256, -1536, 0, 0, 65280, -3};
  for (int sd = 0; sd < GDP_DTYPE_COUNT; sd++) {
    int src_int = sd == GDP_DTYPE_I32 || sd == GDP_DTYPE_I64;
    const double *sv = src_int ? ivals : fvals;
    /* src stored [4x3] and used through its transpose [3x4] */
    unsigned char raw[12 * 8];
    for (int i = 0; i < 12; i++) encode((gdp_dtype)sd, sv[i], raw + i * gdp_dtype_size((gdp_dtype)sd));
    int64_t s43[2] = {4, 3};
    gdp_tensor *src = NULL, *srct = NULL;
    CHECK_OK(gdp_tensor_from_host(ctx, (gdp_dtype)sd, 2, s43, (gdp_dtype)sd, raw,
                                  12 * gdp_dtype_size((gdp_dtype)sd), &src));
    CHECK_OK(gdp_tensor_transpose(src, 0, 1, &srct));
    for (int dd = 0; dd < GDP_DTYPE_COUNT; dd++) {
      int dst_int = dd == GDP_DTYPE_I32 || dd == GDP_DTYPE_I64;
      /* contiguous destination */
      int64_t s34[2] = {3, 4};
      gdp_tensor *dst = NULL;
      CHECK_OK(gdp_tensor_empty(ctx, (gdp_dtype)dd, 2, s34, &dst));
      CHECK_OK(gdp_tensor_copy(NULL, dst, srct));
      size_t es = gdp_dtype_size((gdp_dtype)dd);
      unsigned char got[12 * 8], want[12 * 8];
      CHECK_OK(gdp_tensor_to_host(dst, (gdp_dtype)dd, got, 12 * es));
      for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) {
          double v = (dst_int && !src_int) ? ivals[j * 3 + i] : sv[j * 3 + i];
          encode((gdp_dtype)dd, v, want + (i * 4 + j) * es);
        }
      CHECK(memcmp(got, want, 12 * es) == 0, "copy %s -> %s (transposed src)",
            gdp_dtype_name((gdp_dtype)sd), gdp_dtype_name((gdp_dtype)dd));
      /* strided destination: a [3x4] window of a zeroed [5x6] */
      int64_t s56[2] = {5, 6};
      gdp_tensor *big = NULL, *w1 = NULL, *w = NULL;
      CHECK_OK(gdp_tensor_zeros(ctx, (gdp_dtype)dd, 2, s56, &big));
      CHECK_OK(gdp_tensor_narrow(big, 0, 1, 3, &w1));
      CHECK_OK(gdp_tensor_narrow(w1, 1, 2, 4, &w));
      CHECK_OK(gdp_tensor_copy(NULL, w, srct));
      double *bv = values(big);
      int bad = 0;
      for (int i = 0; i < 5; i++)
        for (int j = 0; j < 6; j++) {
          int inside = i >= 1 && i < 4 && j >= 2 && j < 6;
          double s = inside ? ((dst_int && !src_int) ? ivals : sv)[(j - 2) * 3 + (i - 1)] : 0.0;
          bad += bv[i * 6 + j] != s;
        }
      CHECK(bad == 0, "copy %s -> %s into a window: %d wrong", gdp_dtype_name((gdp_dtype)sd),
            gdp_dtype_name((gdp_dtype)dd), bad);
      free(bv);
      gdp_tensor_free(w);
      gdp_tensor_free(w1);
      gdp_tensor_free(big);
      /* gdp_tensor_to and to_host of a strided view convert the same way */
      gdp_tensor *cv = NULL;
      CHECK_OK(gdp_tensor_to(NULL, srct, (gdp_dtype)dd, &cv));
      CHECK_OK(gdp_tensor_to_host(cv, (gdp_dtype)dd, got, 12 * es));
      CHECK(memcmp(got, want, 12 * es) == 0 && (int)gdp_tensor_dtype(cv) == dd, "to %s -> %s",
            gdp_dtype_name((gdp_dtype)sd), gdp_dtype_name((gdp_dtype)dd));
      CHECK_OK(gdp_tensor_to_host(srct, (gdp_dtype)dd, got, 12 * es));
      CHECK(memcmp(got, want, 12 * es) == 0, "to_host %s -> %s", gdp_dtype_name((gdp_dtype)sd),
            gdp_dtype_name((gdp_dtype)dd));
      gdp_tensor_free(cv);
      gdp_tensor_free(dst);
    }
    gdp_tensor_free(srct);
    gdp_tensor_free(src);
  }
}

/* Transposed layouts large enough for the tiled copy path, with an outer dim and
 * sizes that are not multiples of the tile. */
static void test_transposed_copies(void) {
  const int64_t A = 3, R = 67, C = 45, n = A * R * C;
  float *fv = malloc((size_t)n * sizeof *fv);
  for (int64_t i = 0; i < n; i++) fv[i] = (float)tu_rand_normal(); /* exact in f32 */
  int64_t s[3] = {A, R, C}, st[3] = {A, C, R};
  gdp_tensor *base = NULL, *perm = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_F64, 3, s, GDP_DTYPE_F32, fv, (size_t)n * 4, &base));
  int p021[3] = {0, 2, 1};
  CHECK_OK(gdp_tensor_permute(base, 3, p021, &perm)); /* [A,C,R] view */
  int threads = gdp_ctx_num_threads(ctx);
  for (int pass = 0; pass < 2; pass++) {
    gdp_ctx_set_num_threads(ctx, pass ? 4 : 1);
    for (int di = 0; di < 3; di++) {
      gdp_dtype dt = di == 0 ? GDP_DTYPE_F64 : di == 1 ? GDP_DTYPE_F32 : GDP_DTYPE_BF16;
      /* src transposed -> contiguous dst */
      gdp_tensor *c = NULL;
      CHECK_OK(gdp_tensor_to(NULL, perm, dt, &c));
      double *cv = values(c);
      int bad = 0;
      for (int64_t a = 0; a < A; a++)
        for (int64_t j = 0; j < C; j++)
          for (int64_t i = 0; i < R; i++) {
            float x = fv[(a * R + i) * C + j];
            double want = dt == GDP_DTYPE_BF16 ? (double)gdp_f32_from_bf16(gdp_bf16_from_f32(x)) : (double)x;
            bad += cv[(a * C + j) * R + i] != want;
          }
      CHECK(bad == 0, "transposed -> contiguous %s (threads %d): %d wrong", gdp_dtype_name(dt),
            gdp_ctx_num_threads(ctx), bad);
      free(cv);
      /* contiguous src -> transposed dst view */
      gdp_tensor *back = NULL, *backp = NULL;
      CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, s, &back));
      CHECK_OK(gdp_tensor_permute(back, 3, p021, &backp));
      CHECK(gdp_tensor_size(backp, 1) == st[1], "permuted shape");
      CHECK_OK(gdp_tensor_copy(NULL, backp, c));
      double r = -1;
      if (dt != GDP_DTYPE_BF16) {
        CHECK_OK(gdp_tensor_rel_error(back, base, &r));
        CHECK(r == 0, "contiguous -> transposed %s: rel %g", gdp_dtype_name(dt), r);
      } else {
        CHECK_OK(gdp_tensor_rel_error(back, base, &r));
        CHECK(r > 0 && r < 4e-3, "contiguous bf16 -> transposed f64: rel %g", r);
      }
      gdp_tensor_free(backp);
      gdp_tensor_free(back);
      gdp_tensor_free(c);
    }
  }
  gdp_ctx_set_num_threads(ctx, threads);
  gdp_tensor_free(perm);
  gdp_tensor_free(base);
  free(fv);
}

static void test_conversion_edges(void) {
  /* float -> int truncates toward zero; a value with no integer of the target type
   * (NaN, +-inf, out of range) is an error naming the conversion and the value */
  const double ok_in[4] = {2.9, -2.9, 2147483647.9, -2147483648.9};
  const int32_t ok32[4] = {2, -2, INT32_MAX, INT32_MIN};
  int64_t s4[1] = {4};
  gdp_tensor *t = tensor_f64(1, s4, ok_in);
  int32_t g32[8];
  int64_t g64[8];
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_I32, g32, 4 * sizeof *g32));
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_I64, g64, 4 * sizeof *g64));
  for (int i = 0; i < 4; i++) {
    CHECK(g32[i] == ok32[i], "f64 %.17g -> i32 = %d, want %d", ok_in[i], g32[i], ok32[i]);
    CHECK(g64[i] == (int64_t)ok32[i], "f64 %.17g -> i64 = %lld", ok_in[i],
          (long long)g64[i]);
  }
  gdp_tensor_free(t);
  const struct { double v; int bad32, bad64; const char *text; } edge[] = {
      {1e10, 1, 0, "10000000000"}, {-1e10, 1, 0, "-10000000000"}, {NAN, 1, 1, "nan"},
      {INFINITY, 1, 1, "inf"},     {-INFINITY, 1, 1, "-inf"},     {1e30, 1, 1, "1e+30"},
      {2147483648.0, 1, 0, "2147483648"}, {9223372036854775808.0, 1, 1, "9.2233720368547758e+18"},
      {-9223372036854775808.0, 1, 0, ""},
  };
  for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) {
    const double two[2] = {0.0, edge[i].v};
    int64_t s2[1] = {2};
    t = tensor_f64(1, s2, two);
    gdp_status s = gdp_tensor_to_host(t, GDP_DTYPE_I32, g32, 2 * sizeof *g32);
    if (edge[i].bad32) {
      CHECK_ERR(s, GDP_ERR_INVALID_ARG, "converting a f64 tensor of shape [2] to i32: element 2");
      if (edge[i].text[0])
        CHECK(strstr(gdp_last_error(), edge[i].text) != NULL, "message lacks %s: %s", edge[i].text,
              gdp_last_error());
    } else {
      CHECK_OK(s);
    }
    s = gdp_tensor_to_host(t, GDP_DTYPE_I64, g64, 2 * sizeof *g64);
    if (edge[i].bad64)
      CHECK_ERR(s, GDP_ERR_INVALID_ARG, "to i64: element 2");
    else
      CHECK_OK(s);
    gdp_tensor_free(t);
  }

  /* int64 -> narrower types: saturation, and rounding done once */
  const int64_t big[5] = {INT64_MAX, INT64_MIN, (1LL << 53) + 1, (1LL << 40) + (1LL << 32) + 1,
                          (1LL << 40) + (1LL << 32)};
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 1, (int64_t[]){5}, GDP_DTYPE_I64, big, sizeof big, &t));
  CHECK_ERR(gdp_tensor_to_host(t, GDP_DTYPE_I32, g32, 5 * 4), GDP_ERR_INVALID_ARG,
            "element 1 (row-major, counting from 1) is 9223372036854775807");
  double gd[5];
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_F64, gd, sizeof gd));
  CHECK(gd[2] == 9007199254740992.0, "2^53+1 -> f64 ties to even: %.17g", gd[2]);
  uint16_t gb[6];
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_BF16, gb, 5 * 2));
  /* 2^40 + 2^32 + 1 is just above the bf16 tie at 2^40 + 2^32: rounds up to 2^40 + 2^33
     (rounding through float first would give the tie and then 2^40) */
  CHECK(gdp_f32_from_bf16(gb[3]) == ldexp(1.0, 40) + ldexp(1.0, 33), "i64 -> bf16 single rounding: %g",
        (double)gdp_f32_from_bf16(gb[3]));
  CHECK(gdp_f32_from_bf16(gb[4]) == ldexp(1.0, 40), "i64 -> bf16 exact tie to even: %g",
        (double)gdp_f32_from_bf16(gb[4]));
  CHECK(gdp_f32_from_bf16(gb[0]) == ldexp(1.0, 63), "INT64_MAX -> bf16 = 2^63");
  float gf[6];
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_F32, gf, 5 * 4));
  CHECK(gf[3] == (float)big[3], "i64 -> f32 correctly rounded");
  gdp_tensor_free(t);

  /* f64 -> bf16 rounds once */
  const double dv[6] = {1 + ldexp(1, -8) + ldexp(1, -30), 1 + ldexp(1, -8), 1 + 3 * ldexp(1, -8),
                        -(1 + ldexp(1, -8) + ldexp(1, -40)), 1e300, -1e-300};
  const double dwant[6] = {1 + ldexp(1, -7), 1, 1 + ldexp(1, -6), -(1 + ldexp(1, -7)), INFINITY, -0.0};
  t = tensor_f64(1, (int64_t[]){6}, dv);
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_BF16, gb, 6 * 2));
  for (int i = 0; i < 6; i++)
    CHECK(gdp_f32_from_bf16(gb[i]) == dwant[i] && !signbit(gdp_f32_from_bf16(gb[i])) == !signbit(dwant[i]),
          "f64 %.17g -> bf16 %.9g, want %.9g", dv[i], (double)gdp_f32_from_bf16(gb[i]), dwant[i]);
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_F32, gf, 6 * 4));
  CHECK(isinf(gf[4]) && gf[4] > 0, "1e300 -> f32 inf");
  gdp_tensor_free(t);
}

static void test_bf16(void) {
  const struct {
    uint32_t in;
    uint16_t out;
    const char *what;
  } cases[] = {
      {0x3F800000u, 0x3F80, "1.0 exact"},
      {0x3F808000u, 0x3F80, "tie, even stays"},
      {0x3F818000u, 0x3F82, "tie, odd rounds up"},
      {0x3F808001u, 0x3F81, "above tie"},
      {0x3F807FFFu, 0x3F80, "below tie"},
      {0xBF818000u, 0xBF82, "negative tie"},
      {0x7F800000u, 0x7F80, "+inf"},
      {0xFF800000u, 0xFF80, "-inf"},
      {0x7F7F0000u, 0x7F7F, "bf16 max finite"},
      {0x7F7F7FFFu, 0x7F7F, "just below overflow tie"},
      {0x7F7F8000u, 0x7F80, "tie at max finite rounds to inf"},
      {0x7F7FFFFFu, 0x7F80, "f32 max overflows to inf"},
      {0xFF7FFFFFu, 0xFF80, "-f32 max overflows to -inf"},
      {0x00008000u, 0x0000, "subnormal tie to zero"},
      {0x00018000u, 0x0002, "subnormal tie up"},
      {0x80000000u, 0x8000, "-0"},
      {0x7FC00000u, 0x7FC0, "quiet NaN"},
      {0x7F800001u, 0x7FC0, "signalling NaN stays NaN"},
      {0xFF800001u, 0xFFC0, "negative NaN"},
      {0x7FFFFFFFu, 0x7FFF, "NaN with payload"},
  };
  int64_t n = NELEM(cases);
  float *f = malloc((size_t)n * sizeof *f);
  for (int64_t i = 0; i < n; i++) {
    f[i] = f32_from_bits(cases[i].in);
    uint16_t got = gdp_bf16_from_f32(f[i]);
    CHECK(got == cases[i].out, "bf16(%08x) = %04x, want %04x (%s)", cases[i].in, got, cases[i].out,
          cases[i].what);
  }
  /* the backend's conversion agrees */
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_BF16, 1, &n, GDP_DTYPE_F32, f, (size_t)n * 4, &t));
  uint16_t *g = malloc((size_t)n * 2);
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_BF16, g, (size_t)n * 2));
  for (int64_t i = 0; i < n; i++)
    CHECK(g[i] == cases[i].out, "copy f32 -> bf16 (%08x) = %04x, want %04x", cases[i].in, g[i], cases[i].out);
  /* f64 NaN -> bf16 NaN */
  double dn = NAN;
  uint16_t bn;
  gdp_tensor *tn = tensor_f64(0, NULL, &dn);
  CHECK_OK(gdp_tensor_to_host(tn, GDP_DTYPE_BF16, &bn, 2));
  CHECK(isnan(gdp_f32_from_bf16(bn)), "f64 NaN -> bf16 NaN (%04x)", bn);
  gdp_tensor_free(tn);
  free(g);
  free(f);
  gdp_tensor_free(t);

  /* every non-NaN bf16 survives bf16 -> f32 -> bf16 */
  int bad = 0;
  for (uint32_t b = 0; b < 65536; b++) {
    float x = gdp_f32_from_bf16((uint16_t)b);
    if (isnan(x)) continue;
    bad += gdp_bf16_from_f32(x) != b;
  }
  CHECK(bad == 0, "bf16 round trip: %d wrong", bad);

  /* random float bit patterns: backend == dtype.c, and a reference RNE in the test */
  int64_t m = 100003;
  uint32_t *bits = malloc((size_t)m * 4);
  for (int64_t i = 0; i < m; i++) bits[i] = (uint32_t)tu_rand_u64();
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_BF16, 1, &m, GDP_DTYPE_F32, bits, (size_t)m * 4, &t));
  g = malloc((size_t)m * 2);
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_BF16, g, (size_t)m * 2));
  bad = 0;
  for (int64_t i = 0; i < m; i++) {
    float x = f32_from_bits(bits[i]);
    uint16_t want;
    if (isnan(x)) {
      want = (uint16_t)((bits[i] >> 16) | 0x40);
    } else { /* nearest of the two neighbours, ties to the even one, in double */
      uint16_t lo = (uint16_t)(bits[i] >> 16);
      double xl = gdp_f32_from_bf16(lo), xh = gdp_f32_from_bf16((uint16_t)(lo + 1));
      double dl = fabs((double)x - xl), dh = fabs(xh - (double)x);
      if ((bits[i] & 0xFFFF) == 0) want = lo;
      else if (isinf(xh) && !isinf(x)) /* beyond max: compare with the rounding boundary */
        want = (bits[i] & 0xFFFF) >= 0x8000 && ((lo & 1) || (bits[i] & 0xFFFF) > 0x8000) ? (uint16_t)(lo + 1) : lo;
      else if (dl < dh) want = lo;
      else if (dh < dl) want = (uint16_t)(lo + 1);
      else want = (lo & 1) ? (uint16_t)(lo + 1) : lo;
    }
    if (g[i] != want || gdp_bf16_from_f32(x) != want) bad++;
  }
  CHECK(bad == 0, "random f32 -> bf16: %d of %lld wrong", bad, (long long)m);
  free(g);
  free(bits);
  gdp_tensor_free(t);
}

/* ------------------------------------------------------------------ get/set, fill */

static void test_get_set_fill(void) {
  int64_t s[2] = {3, 5};
  gdp_tensor *t = NULL, *tt = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_BF16, 2, s, &t));
  CHECK_OK(gdp_tensor_transpose(t, 0, 1, &tt));
  int64_t idx[2] = {4, -1}; /* tt[4][2] = t[2][4] */
  CHECK_OK(gdp_tensor_set(tt, idx, 1.0 + 1.0 / 256 + 1e-9)); /* rounds up in bf16 */
  double v = 0;
  CHECK_OK(gdp_tensor_get(t, (int64_t[]){2, 4}, &v));
  CHECK(v == 1.0 + 1.0 / 128, "set through a transposed view, bf16 rounding: %.10g", v);
  CHECK_ERR(gdp_tensor_get(t, (int64_t[]){3, 0}, &v), GDP_ERR_INVALID_ARG,
            "idx[0]: expected -3 <= idx < 3 for dim 0 of [3x5], got 3");
  CHECK_ERR(gdp_tensor_set(t, NULL, 1.0), GDP_ERR_INVALID_ARG, "idx is NULL");

  CHECK_OK(gdp_tensor_fill(tt, -2.5));
  double sum = 0;
  CHECK_OK(gdp_tensor_sum(t, &sum));
  CHECK(sum == -37.5, "fill bf16 sum %g", sum);
  gdp_tensor *w = NULL;
  CHECK_OK(gdp_tensor_narrow(tt, 0, 1, 2, &w)); /* columns 1..2 of t */
  CHECK_OK(gdp_tensor_fill(w, 4.0));
  CHECK_OK(gdp_tensor_sum(t, &sum));
  CHECK(sum == -37.5 + 6 * 6.5, "fill strided window: sum %g", sum);
  gdp_tensor_free(w);
  gdp_tensor_free(tt);
  gdp_tensor_free(t);

  /* a fill of integers with a value they cannot hold is an error, like a conversion */
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_I32, 1, (int64_t[]){3}, &t));
  CHECK_ERR(gdp_tensor_fill(t, 1e12), GDP_ERR_INVALID_ARG, "filling a i32 tensor with 1000000000000");
  CHECK_ERR(gdp_tensor_fill(t, NAN), GDP_ERR_INVALID_ARG, "nan");
  CHECK_OK(gdp_tensor_fill(t, -2147483648.0));
  int32_t iv[3];
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_I32, iv, sizeof iv));
  CHECK(iv[0] == INT32_MIN && iv[2] == INT32_MIN, "fill i32 with INT32_MIN");
  gdp_tensor_free(t);

  /* a large fill (threaded path) on a non-contiguous view */
  int64_t sb[2] = {517, 403};
  gdp_tensor *b = NULL, *bt = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 2, sb, &b));
  CHECK_OK(gdp_tensor_transpose(b, 0, 1, &bt));
  CHECK_OK(gdp_tensor_fill(bt, 0.5));
  CHECK_OK(gdp_tensor_sum(b, &sum));
  CHECK(sum == 0.5 * 517 * 403, "large fill sum %g", sum);
  gdp_tensor_free(bt);
  gdp_tensor_free(b);
}

/* ------------------------------------------------------------------ elementwise */

static void test_elementwise(void) {
  int64_t s[2] = {7, 13};
  for (int di = 0; di < 3; di++) {
    gdp_dtype dt = di == 0 ? GDP_DTYPE_F64 : di == 1 ? GDP_DTYPE_F32 : GDP_DTYPE_BF16;
    double tol = dt == GDP_DTYPE_F64 ? 1e-15 : dt == GDP_DTYPE_F32 ? 1e-7 : 8e-3;
    gdp_tensor *a = random_tensor(dt, 2, s), *b = random_tensor(dt, 2, s), *out = NULL;
    CHECK_OK(gdp_tensor_empty(ctx, dt, 2, s, &out));
    double *av = values(a), *bv = values(b), *ref = malloc(91 * sizeof *ref);
    CHECK_OK(gdp_tensor_add(out, a, b, -0.75));
    for (int i = 0; i < 91; i++) ref[i] = av[i] - 0.75 * bv[i];
    double *ov = values(out);
    double e = tu_rel_err_f64(ov, ref, 91);
    CHECK(e <= tol, "add %s rel err %g", gdp_dtype_name(dt), e);
    free(ov);
    CHECK_OK(gdp_tensor_mul(out, a, b));
    for (int i = 0; i < 91; i++) ref[i] = av[i] * bv[i];
    ov = values(out);
    e = tu_rel_err_f64(ov, ref, 91);
    CHECK(e <= tol, "mul %s rel err %g", gdp_dtype_name(dt), e);
    free(ov);
    CHECK_OK(gdp_tensor_scale(out, a, 3.0));
    for (int i = 0; i < 91; i++) ref[i] = 3.0 * av[i];
    ov = values(out);
    e = tu_rel_err_f64(ov, ref, 91);
    CHECK(e <= tol, "scale %s rel err %g", gdp_dtype_name(dt), e);
    free(ov);
    /* in place, out aliasing a */
    CHECK_OK(gdp_tensor_add(a, a, b, 1.0));
    for (int i = 0; i < 91; i++) ref[i] = av[i] + bv[i];
    ov = values(a);
    e = tu_rel_err_f64(ov, ref, 91);
    CHECK(e <= tol, "add in place %s rel err %g", gdp_dtype_name(dt), e);
    free(ov);
    free(av);
    free(bv);
    free(ref);
    gdp_tensor_free(a);
    gdp_tensor_free(b);
    gdp_tensor_free(out);
  }
  /* transposed operands and a transposed output, exact in f64 */
  int64_t s1[2] = {13, 7};
  gdp_tensor *a = random_tensor(GDP_DTYPE_F64, 2, s), *b = random_tensor(GDP_DTYPE_F64, 2, s1);
  gdp_tensor *bt = NULL, *o = NULL, *ot = NULL;
  CHECK_OK(gdp_tensor_transpose(b, 0, 1, &bt));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, s1, &o));
  CHECK_OK(gdp_tensor_transpose(o, 0, 1, &ot));
  CHECK_OK(gdp_tensor_mul(ot, a, bt));
  int bad = 0;
  for (int i = 0; i < 7; i++)
    for (int j = 0; j < 13; j++) bad += get2(o, j, i) != get2(a, i, j) * get2(b, j, i);
  CHECK(bad == 0, "strided mul: %d wrong", bad);
  /* errors */
  CHECK_ERR(gdp_tensor_add(o, a, b, 1.0), GDP_ERR_SHAPE, "out and a must have the same shape, got [13x7] and [7x13]");
  CHECK_ERR(gdp_tensor_add(ot, a, b, 1.0), GDP_ERR_SHAPE, "out and b must have the same shape, got [7x13] and [13x7]");
  gdp_tensor *f = random_tensor(GDP_DTYPE_F32, 2, s);
  CHECK_ERR(gdp_tensor_mul(ot, a, f), GDP_ERR_DTYPE, "out and b must have the same dtype, got f64 and f32");
  CHECK_ERR(gdp_tensor_scale(NULL, a, 1.0), GDP_ERR_INVALID_ARG, "gdp_tensor_scale: out is NULL");
  gdp_tensor_free(f);
  gdp_tensor_free(ot);
  gdp_tensor_free(o);
  gdp_tensor_free(bt);
  gdp_tensor_free(b);
  gdp_tensor_free(a);
}

/* ------------------------------------------------------------------ reductions */

static void test_reductions(void) {
  int64_t n = 100003; /* several tasks, threaded */
  for (int di = 0; di < 2; di++) {
    gdp_dtype dt = di ? GDP_DTYPE_F32 : GDP_DTYPE_F64;
    gdp_tensor *a = random_tensor(dt, 1, &n), *b = random_tensor(dt, 1, &n);
    double *av = values(a), *bv = values(b);
    double s = 0, d = 0, q = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
      s += av[i];
      d += av[i] * bv[i];
      q += av[i] * av[i];
      m = fabs(av[i]) > m ? fabs(av[i]) : m;
    }
    double gs, gd, gq, gm;
    CHECK_OK(gdp_tensor_sum(a, &gs));
    CHECK_OK(gdp_tensor_dot(a, b, &gd));
    CHECK_OK(gdp_tensor_norm(a, &gq));
    CHECK_OK(gdp_tensor_max_abs(a, &gm));
    CHECK(fabs(gs - s) <= 1e-12 * sqrt(q), "sum %s: %.17g vs %.17g", gdp_dtype_name(dt), gs, s);
    CHECK(fabs(gd - d) <= 1e-12 * q, "dot %s: %.17g vs %.17g", gdp_dtype_name(dt), gd, d);
    CHECK(fabs(gq - sqrt(q)) <= 1e-13 * sqrt(q), "norm %s", gdp_dtype_name(dt));
    CHECK(gm == m, "max_abs %s", gdp_dtype_name(dt));
    /* same bits for any thread count */
    int threads = gdp_ctx_num_threads(ctx);
    gdp_ctx_set_num_threads(ctx, 1);
    double s1;
    CHECK_OK(gdp_tensor_sum(a, &s1));
    gdp_ctx_set_num_threads(ctx, 5);
    double s5;
    CHECK_OK(gdp_tensor_sum(a, &s5));
    gdp_ctx_set_num_threads(ctx, threads);
    CHECK(s1 == gs && s5 == gs, "sum deterministic across thread counts");
    free(av);
    free(bv);
    gdp_tensor_free(a);
    gdp_tensor_free(b);
  }
  /* strided reductions */
  int64_t s[2] = {31, 17};
  gdp_tensor *a = arange(2, s), *at = NULL, *col = NULL;
  CHECK_OK(gdp_tensor_transpose(a, 0, 1, &at));
  CHECK_OK(gdp_tensor_select(at, 0, 3, &col)); /* column 3 of a: 3, 20, 37, ... */
  double sum;
  CHECK_OK(gdp_tensor_sum(col, &sum));
  CHECK(sum == 31 * 3 + 17.0 * (31 * 30 / 2), "strided sum %g", sum);
  /* sumsq_many: each tensor's sum of squares (the norm's, squared), empty ones 0 */
  {
    int64_t n0 = 0, n1 = 1000;
    /* arange, not random_tensor: the checks after this expect the seed's stream */
    gdp_tensor *e = NULL, *r = NULL, *r64 = arange(1, &n1);
    CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 1, &n0, &e));
    CHECK_OK(gdp_tensor_to(ctx, r64, GDP_DTYPE_F32, &r));
    const gdp_tensor *list[4] = {col, r, e, a};
    double out[4] = {-1, -1, -1, -1}, nrm;
    CHECK_OK(gdp_tensor_sumsq_many(4, list, out));
    for (int i = 0; i < 4; i++) {
      CHECK_OK(gdp_tensor_norm(list[i], &nrm));
      CHECK(sqrt(out[i]) == nrm, "sumsq_many[%d] %.17g, norm %.17g", i, out[i], nrm);
    }
    CHECK(out[2] == 0, "sumsq_many of an empty tensor %g", out[2]);
    CHECK(out[0] == 2780204.0, "sumsq_many of a strided column (3, 20, ..., 513): %.17g", out[0]);
    CHECK_OK(gdp_tensor_sumsq_many(0, NULL, NULL));
    CHECK_ERR(gdp_tensor_sumsq_many(-1, list, out), GDP_ERR_INVALID_ARG, "expected >= 0, got -1");
    CHECK_ERR(gdp_tensor_sumsq_many(2, NULL, out), GDP_ERR_INVALID_ARG, "ts is NULL");
    const gdp_tensor *holes[2] = {a, NULL};
    CHECK_ERR(gdp_tensor_sumsq_many(2, holes, out), GDP_ERR_INVALID_ARG, "ts[1] is NULL");
    gdp_tensor_free(e);
    gdp_tensor_free(r);
    gdp_tensor_free(r64);
  }
  gdp_tensor_free(col);
  gdp_tensor_free(at);
  gdp_tensor_free(a);

  /* non-finite values */
  double vals[6] = {1, NAN, -INFINITY, 2, INFINITY, -7};
  gdp_tensor *t = tensor_f64(1, (int64_t[]){6}, vals);
  int64_t cnt = -1;
  CHECK_OK(gdp_tensor_count_nonfinite(t, &cnt));
  CHECK(cnt == 3, "count_nonfinite %lld", (long long)cnt);
  double mx;
  CHECK_OK(gdp_tensor_max_abs(t, &mx));
  CHECK(isnan(mx), "max_abs propagates NaN");
  gdp_tensor_free(t);

  /* rel_error rules */
  int64_t k = 37;
  gdp_tensor *ref = random_tensor(GDP_DTYPE_F64, 1, &k), *x = NULL, *z = NULL, *z2 = NULL;
  double r;
  CHECK_OK(gdp_tensor_rel_error(ref, ref, &r));
  CHECK(r == 0, "identical -> 0");
  CHECK_OK(gdp_tensor_clone(ref, &x));
  CHECK_OK(gdp_tensor_scale(x, ref, 1.001));
  CHECK_OK(gdp_tensor_rel_error(x, ref, &r));
  CHECK(fabs(r - 1e-3) < 1e-12, "scaled by 1.001 -> 1e-3, got %.17g", r);
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, &k, &z));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, &k, &z2));
  CHECK_OK(gdp_tensor_rel_error(z, z2, &r));
  CHECK(r == 0, "both zero -> 0");
  CHECK_OK(gdp_tensor_rel_error(x, z, &r));
  CHECK(isinf(r) && r > 0, "zero ref, nonzero a -> +inf");
  CHECK_OK(gdp_tensor_rel_error(z, x, &r));
  CHECK(r == 1, "zero a -> 1");
  CHECK_OK(gdp_tensor_set(x, (int64_t[]){5}, NAN));
  CHECK_OK(gdp_tensor_rel_error(x, ref, &r));
  CHECK(isnan(r), "NaN in a -> NaN");
  CHECK_OK(gdp_tensor_scale(x, ref, 1.001));
  CHECK_OK(gdp_tensor_set(z, (int64_t[]){0}, INFINITY));
  CHECK_OK(gdp_tensor_rel_error(z, z, &r));
  CHECK(isnan(r), "inf in both -> NaN (never passes)");
  /* mixed dtypes: f32 against an f64 reference */
  gdp_tensor *xf = NULL;
  CHECK_OK(gdp_tensor_to(NULL, ref, GDP_DTYPE_F32, &xf));
  CHECK_OK(gdp_tensor_rel_error(xf, ref, &r));
  CHECK(r > 0 && r < 1e-7, "f32 copy vs f64: %g", r);
  /* magnitudes whose squares over/underflow */
  gdp_tensor *hx = NULL, *hr = NULL;
  CHECK_OK(gdp_tensor_clone(ref, &hr));
  CHECK_OK(gdp_tensor_clone(ref, &hx));
  CHECK_OK(gdp_tensor_scale(hr, ref, 1e200));
  CHECK_OK(gdp_tensor_scale(hx, x, 1e200));
  CHECK_OK(gdp_tensor_rel_error(hx, hr, &r));
  CHECK(fabs(r - 1e-3) < 1e-9, "1e200 scale: %.17g", r);
  CHECK_OK(gdp_tensor_scale(hr, ref, 1e-200));
  CHECK_OK(gdp_tensor_scale(hx, x, 1e-200));
  CHECK_OK(gdp_tensor_rel_error(hx, hr, &r));
  CHECK(fabs(r - 1e-3) < 1e-9, "1e-200 scale: %.17g", r);
  int64_t k2 = 36;
  gdp_tensor *short_t = random_tensor(GDP_DTYPE_F64, 1, &k2);
  CHECK_ERR(gdp_tensor_rel_error(short_t, ref, &r), GDP_ERR_SHAPE, "a and ref must have the same shape, got [36] and [37]");
  gdp_tensor_free(short_t);
  gdp_tensor_free(hx);
  gdp_tensor_free(hr);
  gdp_tensor_free(xf);
  gdp_tensor_free(z2);
  gdp_tensor_free(z);
  gdp_tensor_free(x);
  gdp_tensor_free(ref);
}

/* ------------------------------------------------------------------ matmul */

/* out = alpha op(a) op(b) + beta out, all in double on host values */
static void naive_matmul(int64_t M, int64_t N, int64_t K, const double *a, int ta, int64_t a_cols,
                         const double *b, int tb, int64_t b_cols, double alpha, double beta,
                         double *out) {
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double s = 0;
      for (int64_t k = 0; k < K; k++) {
        double x = ta ? a[k * a_cols + i] : a[i * a_cols + k];
        double y = tb ? b[j * b_cols + k] : b[k * b_cols + j];
        s += x * y;
      }
      out[i * N + j] = alpha * s + beta * out[i * N + j];
    }
}

/* layout of an operand/output: 0 contiguous, 1 column-major (transposed storage),
 * 2 neither (every other element of a wider tensor) */
static gdp_tensor *matrix_in_layout(gdp_tensor *src, int layout, gdp_tensor **keep) {
  int64_t r = gdp_tensor_size(src, 0), c = gdp_tensor_size(src, 1);
  gdp_tensor *m = NULL;
  *keep = NULL;
  if (layout == 0) return gdp_tensor_retain(src);
  if (layout == 1) {
    int64_t s[2] = {c, r};
    CHECK_OK(gdp_tensor_empty(ctx, gdp_tensor_dtype(src), 2, s, keep));
    CHECK_OK(gdp_tensor_transpose(*keep, 0, 1, &m));
  } else {
    int64_t s[3] = {r, c, 2};
    CHECK_OK(gdp_tensor_zeros(ctx, gdp_tensor_dtype(src), 3, s, keep));
    CHECK_OK(gdp_tensor_select(*keep, 2, 1, &m));
  }
  CHECK_OK(gdp_tensor_copy(NULL, m, src));
  return m;
}

static void test_matmul(void) {
  const int64_t M = 7, N = 5, K = 13;
  int checked = 0;
  for (int di = 0; di < 2; di++) {
    gdp_dtype dt = di ? GDP_DTYPE_F32 : GDP_DTYPE_F64;
    double tol = di ? 2e-6 : 1e-14;
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++)
        for (int la = 0; la < 3; la++)
          for (int lo = 0; lo < 3; lo++) {
            int64_t sa[2] = {ta ? K : M, ta ? M : K}, sb[2] = {tb ? N : K, tb ? K : N}, so[2] = {M, N};
            gdp_tensor *a0 = random_tensor(dt, 2, sa), *b0 = random_tensor(dt, 2, sb);
            gdp_tensor *o0 = random_tensor(dt, 2, so);
            gdp_tensor *ka, *kb, *ko;
            gdp_tensor *a = matrix_in_layout(a0, la, &ka), *b = matrix_in_layout(b0, (la + 1) % 3, &kb);
            gdp_tensor *o = matrix_in_layout(o0, lo, &ko);
            double *av = values(a0), *bv = values(b0), *ref = values(o0);
            double alpha = 1.5, beta = (la + lo) % 2 ? 0.5 : 0.0;
            naive_matmul(M, N, K, av, ta, sa[1], bv, tb, sb[1], alpha, beta, ref);
            if (beta == 0.0) CHECK_OK(gdp_tensor_fill(o, NAN)); /* beta = 0 must not read out */
            CHECK_OK(gdp_tensor_matmul(o, a, b, ta, tb, alpha, beta));
            double *ov = values(o);
            double e = tu_rel_err_f64(ov, ref, M * N);
            CHECK(e <= tol, "matmul %s ta=%d tb=%d layouts a=%d b=%d out=%d: rel err %g",
                  gdp_dtype_name(dt), ta, tb, la, (la + 1) % 3, lo, e);
            checked++;
            free(ov);
            free(av);
            free(bv);
            free(ref);
            gdp_tensor_free(a);
            gdp_tensor_free(b);
            gdp_tensor_free(o);
            gdp_tensor_free(ka);
            gdp_tensor_free(kb);
            gdp_tensor_free(ko);
            gdp_tensor_free(a0);
            gdp_tensor_free(b0);
            gdp_tensor_free(o0);
          }
  }
  CHECK(checked == 72, "matmul cases %d", checked);

  /* a larger product against the naive loop (BLAS blocking paths) */
  {
    int64_t sa[2] = {129, 67}, sb[2] = {67, 93}, so[2] = {129, 93};
    gdp_tensor *a = random_tensor(GDP_DTYPE_F64, 2, sa), *b = random_tensor(GDP_DTYPE_F64, 2, sb), *o = NULL;
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, so, &o));
    double *av = values(a), *bv = values(b), *ref = calloc(129 * 93, sizeof *ref);
    naive_matmul(129, 93, 67, av, 0, 67, bv, 0, 93, 1.0, 0.0, ref);
    CHECK_OK(gdp_tensor_matmul(o, a, b, 0, 0, 1.0, 0.0));
    double *ov = values(o);
    double e = tu_rel_err_f64(ov, ref, 129 * 93);
    CHECK(e <= 1e-14, "matmul 129x67x93: %g", e);
    free(ov);
    free(av);
    free(bv);
    free(ref);
    gdp_tensor_free(a);
    gdp_tensor_free(b);
    gdp_tensor_free(o);
  }

  /* K = 0: out = beta * out */
  int64_t s30[2] = {3, 0}, s04[2] = {0, 4}, s34[2] = {3, 4};
  gdp_tensor *a = NULL, *b = NULL, *o = NULL;
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 2, s30, &a));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 2, s04, &b));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 2, s34, &o));
  CHECK_OK(gdp_tensor_fill(o, 2.0));
  CHECK_OK(gdp_tensor_matmul(o, a, b, 0, 0, 1.0, 0.25));
  double sum;
  CHECK_OK(gdp_tensor_sum(o, &sum));
  CHECK(sum == 6.0, "K = 0 scales out by beta: sum %g", sum);
  CHECK_OK(gdp_tensor_matmul(o, a, b, 0, 0, 1.0, 0.0));
  CHECK_OK(gdp_tensor_sum(o, &sum));
  CHECK(sum == 0.0, "K = 0, beta = 0 zeroes out");
  /* M = 0 */
  gdp_tensor *o0 = NULL, *a0 = NULL;
  int64_t s05[2] = {0, 5}, s54[2] = {5, 4};
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 2, s04, &o0));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 2, s05, &a0));
  gdp_tensor *b54 = random_tensor(GDP_DTYPE_F32, 2, s54);
  CHECK_OK(gdp_tensor_matmul(o0, a0, b54, 0, 0, 1.0, 0.0));
  /* errors */
  CHECK_ERR(gdp_tensor_matmul(o, b54, b54, 0, 0, 1.0, 0.0), GDP_ERR_SHAPE,
            "inner dims differ: op(a) is [5x4] (a [5x4], trans_a 0), op(b) is [5x4] (b [5x4], trans_b 0)");
  CHECK_ERR(gdp_tensor_matmul(o, b54, b54, 1, 0, 1.0, 0.0), GDP_ERR_SHAPE,
            "out: expected [4x4] for op(a) [5x4] @ op(b) [5x4], got [3x4]");
  gdp_tensor *sq = random_tensor(GDP_DTYPE_F32, 2, s54), *sqv = NULL;
  int64_t s44[2] = {4, 4};
  CHECK_OK(gdp_tensor_narrow(sq, 0, 1, 4, &sqv));
  CHECK_ERR(gdp_tensor_matmul(sqv, sq, b54, 1, 0, 1.0, 0.0), GDP_ERR_INVALID_ARG, "out must not alias a");
  gdp_tensor_free(sqv);
  gdp_tensor *i32 = NULL, *i32b = NULL, *i32o = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_I32, 2, s44, &i32));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_I32, 2, s44, &i32b));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_I32, 2, s44, &i32o));
  CHECK_ERR(gdp_tensor_matmul(i32o, i32, i32b, 0, 0, 1.0, 0.0), GDP_ERR_DTYPE, "expected f32, f64 or bf16 tensors, got i32");
  /* bf16 matmul exists on cuda only: the cpu says so rather than computing */
  gdp_tensor *h16 = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_BF16, 2, s44, &h16));
  CHECK_ERR(gdp_tensor_matmul(h16, h16, h16, 0, 0, 1.0, 0.0), GDP_ERR_UNSUPPORTED, "bf16");
  gdp_tensor_free(h16);
  int64_t s3d[3] = {2, 2, 2};
  gdp_tensor *t3 = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 3, s3d, &t3));
  CHECK_ERR(gdp_tensor_matmul(o, t3, b, 0, 0, 1.0, 0.0), GDP_ERR_SHAPE,
            "a: expected a 2-D tensor (out is 2-D; a batched product takes a 3-D out), got 3 dims [2x2x2]");
  gdp_tensor *of64 = random_tensor(GDP_DTYPE_F64, 2, s34);
  CHECK_ERR(gdp_tensor_matmul(of64, a, b, 0, 0, 1.0, 0.0), GDP_ERR_DTYPE, "out and a must have the same dtype, got f64 and f32");
  gdp_tensor_free(of64);
  gdp_tensor_free(t3);
  gdp_tensor_free(i32);
  gdp_tensor_free(i32b);
  gdp_tensor_free(i32o);
  gdp_tensor_free(sq);
  gdp_tensor_free(b54);
  gdp_tensor_free(a0);
  gdp_tensor_free(o0);
  gdp_tensor_free(a);
  gdp_tensor_free(b);
  gdp_tensor_free(o);
}

/* [Bt, r, c] view of a bigger tensor holding src's values: layout 0 an interleaved batch
 * (a [r, Bt, c] tensor transposed: batch stride c), 1 column-major matrices ([Bt, c, r]
 * transposed), 2 a select of a 4-D [Bt, 2, r, c] tensor (batch stride 2 r c), 3 no unit
 * stride (a select of [Bt, r, c, 2]: copied before BLAS). */
static gdp_tensor *batch_in_layout(gdp_tensor *src, int layout, gdp_tensor **keep) {
  int64_t B = gdp_tensor_size(src, 0), r = gdp_tensor_size(src, 1), c = gdp_tensor_size(src, 2);
  gdp_tensor *m = NULL;
  gdp_dtype dt = gdp_tensor_dtype(src);
  if (layout == 0) {
    int64_t s[3] = {r, B, c};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 3, s, keep));
    CHECK_OK(gdp_tensor_transpose(*keep, 0, 1, &m));
  } else if (layout == 1) {
    int64_t s[3] = {B, c, r};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 3, s, keep));
    CHECK_OK(gdp_tensor_transpose(*keep, 1, 2, &m));
  } else if (layout == 2) {
    int64_t s[4] = {B, 2, r, c};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 4, s, keep));
    CHECK_OK(gdp_tensor_select(*keep, 1, 1, &m));
  } else {
    int64_t s[4] = {B, r, c, 2};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 4, s, keep));
    CHECK_OK(gdp_tensor_select(*keep, 3, 1, &m));
  }
  CHECK_OK(gdp_tensor_copy(NULL, m, src));
  return m;
}

/* Batched products ([Bt, M, K] @ [Bt, K, N], and a 2-D b shared by every entry) against
 * the naive loop per batch entry. */
static void test_matmul_batched(void) {
  const int64_t Bt = 3, M = 5, N = 4, K = 7;
  /* every dtype x trans_a x trans_b x layout (4: b 2-D) */
  for (int ci = 0; ci < 2 * 2 * 2 * 5; ci++) {
    const int di = ci / 20, ta = ci / 10 % 2, tb = ci / 5 % 2, layout = ci % 5;
    const gdp_dtype dt = di ? GDP_DTYPE_F32 : GDP_DTYPE_F64;
    const int shared_b = layout == 4;
    int la = layout % 4, lb = (layout + 1) % 4, lo = (layout + 2) % 4;
    int64_t sa[3] = {Bt, ta ? K : M, ta ? M : K}, sb[3] = {Bt, tb ? N : K, tb ? K : N};
    int64_t so[3] = {Bt, M, N};
    gdp_tensor *a0 = random_tensor(dt, 3, sa), *o0 = random_tensor(dt, 3, so);
    gdp_tensor *b0 = shared_b ? random_tensor(dt, 2, sb + 1) : random_tensor(dt, 3, sb);
    gdp_tensor *ka, *kb = NULL, *ko;
    gdp_tensor *a = batch_in_layout(a0, la, &ka), *o = batch_in_layout(o0, lo, &ko);
    gdp_tensor *b = shared_b ? gdp_tensor_retain(b0) : batch_in_layout(b0, lb, &kb);
    double *av = values(a0), *bv = values(b0), *ref = values(o0);
    double alpha = 1.5, beta = (layout + ta) % 2 ? 0.5 : 0.0;
    for (int64_t i = 0; i < Bt; i++)
      naive_matmul(M, N, K, av + i * M * K, ta, sa[2], shared_b ? bv : bv + i * K * N, tb, sb[2],
                   alpha, beta, ref + i * M * N);
    if (beta == 0.0) CHECK_OK(gdp_tensor_fill(o, NAN)); /* beta = 0 must not read out */
    CHECK_OK(gdp_tensor_matmul(o, a, b, ta, tb, alpha, beta));
    double *ov = values(o);
    double e = tu_rel_err_f64(ov, ref, Bt * M * N);
    CHECK(e <= (di ? 2e-6 : 1e-14), "batched matmul %s ta=%d tb=%d layouts a=%d b=%d out=%d: rel err %g",
          gdp_dtype_name(dt), ta, tb, la, shared_b ? -1 : lb, lo, e);
    free(ov);
    free(av);
    free(bv);
    free(ref);
    gdp_tensor *ts[9] = {a, b, o, ka, kb, ko, a0, b0, o0};
    for (int t = 0; t < 9; t++) gdp_tensor_free(ts[t]);
  }

  /* errors name the argument and the shapes */
  int64_t s234[3] = {2, 3, 4}, s345[3] = {3, 4, 5}, s235[3] = {2, 3, 5}, s34[2] = {3, 4},
          s45[2] = {4, 5};
  gdp_tensor *a = random_tensor(GDP_DTYPE_F64, 3, s234), *b = random_tensor(GDP_DTYPE_F64, 3, s345);
  gdp_tensor *o = random_tensor(GDP_DTYPE_F64, 3, s235), *a2 = random_tensor(GDP_DTYPE_F64, 2, s34);
  gdp_tensor *b2 = random_tensor(GDP_DTYPE_F64, 2, s45);
  CHECK_ERR(gdp_tensor_matmul(o, a, b, 0, 0, 1.0, 0.0), GDP_ERR_SHAPE,
            "b: expected a batch of 2 (out is [2x3x5]), got [3x4x5]");
  CHECK_ERR(gdp_tensor_matmul(o, a2, b2, 0, 0, 1.0, 0.0), GDP_ERR_SHAPE,
            "a and b: expected at least one 3-D [batch,.,.] operand (out is [2x3x5]), got a [3x4] and b [4x5]");
  CHECK_OK(gdp_tensor_matmul(o, a, b2, 0, 0, 1.0, 0.0));
  CHECK_ERR(gdp_tensor_matmul(o, a, b2, 0, 1, 1.0, 0.0), GDP_ERR_SHAPE,
            "inner dims differ: op(a) is [3x4] (a [2x3x4], trans_a 0), op(b) is [5x4] (b [4x5], trans_b 1)");
  gdp_tensor *ts[5] = {a, b, o, a2, b2};
  for (int t = 0; t < 5; t++) gdp_tensor_free(ts[t]);
}

/* ------------------------------------------------------------------ empty and 0-dim */

static void test_empty_and_scalar(void) {
  double one = 4.25;
  gdp_tensor *s = tensor_f64(0, NULL, &one);
  CHECK(gdp_tensor_ndim(s) == 0 && gdp_tensor_numel(s) == 1 && gdp_tensor_is_contiguous(s), "0-dim");
  double v = 0;
  CHECK_OK(gdp_tensor_get(s, NULL, &v));
  CHECK(v == 4.25, "0-dim get");
  CHECK_OK(gdp_tensor_set(s, NULL, -1.0));
  CHECK_OK(gdp_tensor_sum(s, &v));
  CHECK(v == -1.0, "0-dim sum");
  int64_t s11[2] = {1, 1}, sm1[1] = {-1};
  gdp_tensor *w = NULL, *w0 = NULL;
  CHECK_OK(gdp_tensor_view(s, 2, s11, &w));
  CHECK(get2(w, 0, 0) == -1.0, "0-dim viewed as [1x1]");
  CHECK_OK(gdp_tensor_view(w, 0, NULL, &w0));
  CHECK(gdp_tensor_ndim(w0) == 0, "[1x1] viewed as 0-dim");
  gdp_tensor_free(w0);
  gdp_tensor_free(w);
  CHECK_OK(gdp_tensor_reshape(s, 1, sm1, &w));
  CHECK(gdp_tensor_size(w, 0) == 1, "0-dim reshape [-1]");
  gdp_tensor_free(w);
  CHECK_ERR(gdp_tensor_transpose(s, 0, 0, &w), GDP_ERR_INVALID_ARG, "for a 0-dim tensor []");
  gdp_tensor *c = NULL;
  CHECK_OK(gdp_tensor_to(NULL, s, GDP_DTYPE_I64, &c));
  int64_t iv = 0;
  CHECK_OK(gdp_tensor_to_host(c, GDP_DTYPE_I64, &iv, 8));
  CHECK(iv == -1, "0-dim to i64");
  gdp_tensor_free(c);
  gdp_tensor_free(s);

  int64_t se[3] = {0, 3, 2};
  gdp_tensor *e = NULL, *e2 = NULL, *ev = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 3, se, &e));
  CHECK(gdp_tensor_numel(e) == 0 && gdp_tensor_is_contiguous(e), "empty tensor");
  CHECK(gdp_tensor_data(e) != NULL, "empty tensors still have an address");
  CHECK_OK(gdp_tensor_sum(e, &v));
  CHECK(v == 0, "empty sum");
  CHECK_OK(gdp_tensor_max_abs(e, &v));
  CHECK(v == 0, "empty max_abs");
  CHECK_OK(gdp_tensor_rel_error(e, e, &v));
  CHECK(v == 0, "empty rel_error");
  CHECK_OK(gdp_tensor_fill(e, 1.0));
  CHECK_OK(gdp_tensor_uniform(e, 0, 1));
  CHECK_OK(gdp_tensor_clone(e, &e2));
  CHECK_OK(gdp_tensor_copy(NULL, e2, e));
  CHECK_OK(gdp_tensor_add(e2, e, e, 1.0));
  CHECK_OK(gdp_tensor_to_host(e, GDP_DTYPE_F64, NULL, 0));
  int64_t s6[2] = {-1, 6}, s0m[2] = {-1, 0};
  CHECK_OK(gdp_tensor_view(e, 2, s6, &ev));
  CHECK(gdp_tensor_size(ev, 0) == 0 && gdp_tensor_size(ev, 1) == 6, "empty view [-1x6] -> [0x6]");
  gdp_tensor_free(ev);
  CHECK_ERR(gdp_tensor_view(e, 2, s0m, &ev), GDP_ERR_SHAPE, "shape [-1x0] is invalid for tensor [0x3x2] of 0 elements");
  int64_t s06[2] = {0, 6};
  CHECK_OK(gdp_tensor_view(e, 2, s06, &ev));
  CHECK(gdp_tensor_size(ev, 1) == 6, "view of empty");
  gdp_tensor_free(ev);
  int perm[3] = {2, 1, 0};
  CHECK_OK(gdp_tensor_permute(e, 3, perm, &ev));
  CHECK(gdp_tensor_size(ev, 2) == 0, "permute of empty");
  gdp_tensor_free(ev);
  gdp_tensor_free(e2);
  gdp_tensor_free(e);
}

/* ------------------------------------------------------------------ memory accounting */

/* ------------------------------------------------------------------ adversarial */

/* A shape whose product overflows int64 must be refused, not wrapped: 3*11*c wraps to
 * exactly 1 mod 2^64, so a wrapped check would accept a 1-element tensor viewed as
 * [3, 11, c] (an 8-byte storage with strides of ~10^18 elements). */
static void test_shape_overflow(void) {
  gdp_tensor *t = arange(1, (int64_t[]){1}), *v = NULL;
  const int64_t c = 1117984489315730401LL;
  CHECK_ERR(gdp_tensor_view(t, 3, (int64_t[]){3, 11, c}, &v), GDP_ERR_SHAPE, "overflow");
  CHECK(v == NULL, "no view on failure");
  CHECK_ERR(gdp_tensor_reshape(t, 3, (int64_t[]){3, 11, c}, &v), GDP_ERR_SHAPE, "overflow");
  CHECK(v == NULL, "no reshape on failure");
  gdp_tensor_free(v);
  /* with -1: the known sizes overflow (2^62 * 4 wraps to 0) */
  CHECK_ERR(gdp_tensor_reshape(t, 3, (int64_t[]){(int64_t)1 << 62, 4, -1}, &v), GDP_ERR_SHAPE, "overflow");
  gdp_tensor_free(v);
  /* empty tensors too: the row-major strides of [0, 2^53, 2^53] overflow int64, whatever
   * the order of the dims */
  const int64_t big = (int64_t)1 << 53;
  gdp_tensor *e = NULL;
  CHECK_ERR(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 3, (int64_t[]){0, big, big}, &e), GDP_ERR_SHAPE,
            "too many elements");
  CHECK(e == NULL, "no tensor on failure");
  CHECK_ERR(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 3, (int64_t[]){big, big, 0}, &e), GDP_ERR_SHAPE,
            "too many elements");
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 2, (int64_t[]){0, 4}, &e));
  CHECK_ERR(gdp_tensor_view(e, 3, (int64_t[]){0, big, big}, &v), GDP_ERR_SHAPE, "overflow");
  gdp_tensor_free(v);
  gdp_tensor_free(e);
  gdp_tensor_free(t);
}

/* Copies and elementwise ops whose output shares memory with an input laid out
 * differently (a transpose, a shifted window) must give the values of the input as
 * it was before the call, like the contiguous (memmove) path does. */
static void test_overlapping_copies(void) {
  const int64_t n = 40 + (int64_t)(tu_rand_u64() % 9);
  /* copy(t, t^T): the tiled transpose path */
  gdp_tensor *t = random_tensor(GDP_DTYPE_F64, 2, (int64_t[]){n, n}), *tt = NULL;
  double *before = values(t);
  CHECK_OK(gdp_tensor_transpose(t, 0, 1, &tt));
  CHECK_OK(gdp_tensor_copy(NULL, t, tt));
  int bad = 0;
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < n; j++) bad += get2(t, i, j) != before[j * n + i];
  CHECK(bad == 0, "copy(t, t^T): %d of %lld elements wrong", bad, (long long)(n * n));
  free(before);
  /* add(t, t, t^T) must be symmetric: out aliases a (same layout) and b (transposed) */
  before = values(t);
  CHECK_OK(gdp_tensor_add(t, t, tt, 1.0));
  bad = 0;
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < n; j++) bad += get2(t, i, j) != before[i * n + j] + before[j * n + i];
  CHECK(bad == 0, "add(t, t, t^T): %d of %lld elements wrong", bad, (long long)(n * n));
  free(before);
  gdp_tensor_free(tt);
  gdp_tensor_free(t);

  /* a strided window shifted by one row onto itself (columns of a [m,3] tensor) */
  const int64_t m = 100 + (int64_t)(tu_rand_u64() % 50);
  gdp_tensor *u = random_tensor(GDP_DTYPE_F32, 2, (int64_t[]){m, 3}), *ut = NULL, *dst = NULL,
             *src = NULL;
  before = values(u);
  CHECK_OK(gdp_tensor_transpose(u, 0, 1, &ut));
  CHECK_OK(gdp_tensor_narrow(ut, 1, 1, m - 1, &dst));
  CHECK_OK(gdp_tensor_narrow(ut, 1, 0, m - 1, &src));
  CHECK_OK(gdp_tensor_copy(NULL, dst, src));
  bad = 0;
  for (int64_t i = 1; i < m; i++)
    for (int64_t j = 0; j < 3; j++) bad += get2(u, i, j) != before[(i - 1) * 3 + j];
  CHECK(bad == 0, "shifted strided copy: %d of %lld elements wrong", bad, (long long)(3 * (m - 1)));
  /* and the same shift through scale (out overlaps a) */
  free(before);
  before = values(u);
  CHECK_OK(gdp_tensor_scale(dst, src, 2.0));
  bad = 0;
  for (int64_t i = 1; i < m; i++)
    for (int64_t j = 0; j < 3; j++) bad += get2(u, i, j) != 2.0 * before[(i - 1) * 3 + j];
  CHECK(bad == 0, "shifted strided scale: %d elements wrong", bad);
  free(before);
  gdp_tensor_free(src);
  gdp_tensor_free(dst);
  gdp_tensor_free(ut);
  gdp_tensor_free(u);
}

/* ------------------------------------------------------------------ write versions */

/* Operands of one version case: `t` is the tensor written (a view of `base`), `a` and
 * `b` are [2,6] inputs, `m` [2,3] and `n` [3,6] matmul inputs. */
typedef struct {
  gdp_tensor *base, *t, *a, *b, *m, *n;
  gdp_comm *comm;
} ver_ops;

static gdp_status ver_copy(ver_ops *o) { return gdp_tensor_copy(NULL, o->t, o->a); }
static gdp_status ver_copy_self(ver_ops *o) { return gdp_tensor_copy(NULL, o->t, o->t); }
static gdp_status ver_fill(ver_ops *o) { return gdp_tensor_fill(o->t, 3.0); }
static gdp_status ver_set(ver_ops *o) { return gdp_tensor_set(o->t, (int64_t[]){1, 2}, 5.0); }
static gdp_status ver_uniform(ver_ops *o) { return gdp_tensor_uniform(o->t, -1.0, 1.0); }
static gdp_status ver_normal(ver_ops *o) { return gdp_tensor_normal(o->t, 0.0, 1.0); }
static gdp_status ver_add(ver_ops *o) { return gdp_tensor_add(o->t, o->a, o->b, 2.0); }
static gdp_status ver_add_(ver_ops *o) { return gdp_tensor_add(o->t, o->t, o->a, 1.0); }
static gdp_status ver_mul(ver_ops *o) { return gdp_tensor_mul(o->t, o->a, o->b); }
static gdp_status ver_scale(ver_ops *o) { return gdp_tensor_scale(o->t, o->t, 0.5); }
static gdp_status ver_matmul(ver_ops *o) {
  return gdp_tensor_matmul(o->t, o->m, o->n, 0, 0, 1.0, 1.0);
}
static gdp_status ver_allgather(ver_ops *o) {
  gdp_tensor *out = NULL;
  gdp_status st = gdp_tensor_view(o->t, 3, (int64_t[]){1, 2, 6}, &out);
  if (st == GDP_OK) st = gdp_comm_allgather(o->comm, out, o->a);
  gdp_tensor_free(out);
  return st;
}
static gdp_status ver_alltoall(ver_ops *o) { return gdp_comm_alltoall(o->comm, o->t, o->a); }
static gdp_status ver_alltoallv(ver_ops *o) {
  return gdp_comm_alltoallv(o->comm, o->t, (int64_t[]){2}, o->a, (int64_t[]){2});
}
static gdp_status ver_allreduce(ver_ops *o) {
  return gdp_comm_allreduce(o->comm, o->t, GDP_REDUCE_OP_SUM);
}
static gdp_status ver_sendrecv(ver_ops *o) { return gdp_comm_sendrecv(o->comm, o->a, 0, o->t, 0, 0); }

/* Calls that write nothing into t (t is read, or the call fails its checks). */
static gdp_status ver_broadcast_root(ver_ops *o) { return gdp_comm_broadcast(o->comm, o->t, 0); }
static gdp_status ver_send_side(ver_ops *o) { return gdp_comm_sendrecv(o->comm, o->t, 0, o->a, 0, 0); }
static gdp_status ver_copy_from(ver_ops *o) { return gdp_tensor_copy(NULL, o->a, o->t); }
static gdp_status ver_add_into_other(ver_ops *o) { return gdp_tensor_add(o->a, o->t, o->b, 1.0); }
static gdp_status ver_matmul_bad_shape(ver_ops *o) {
  return gdp_tensor_matmul(o->t, o->n, o->m, 0, 0, 1.0, 0.0) == GDP_OK ? GDP_ERR_INTERNAL : GDP_OK;
}
static gdp_status ver_fill_empty(ver_ops *o) {
  gdp_tensor *e = NULL;
  gdp_status st = gdp_tensor_narrow(o->t, 0, 1, 0, &e);
  if (st == GDP_OK) st = gdp_tensor_fill(e, 1.0);
  gdp_tensor_free(e);
  return st;
}
static gdp_status ver_reads(ver_ops *o) {
  double d = 0, host[12];
  int64_t k = 0;
  gdp_status st = gdp_tensor_get(o->t, (int64_t[]){0, 0}, &d);
  if (st == GDP_OK) st = gdp_tensor_sum(o->t, &d);
  if (st == GDP_OK) st = gdp_tensor_dot(o->t, o->a, &d);
  if (st == GDP_OK) st = gdp_tensor_norm(o->t, &d);
  if (st == GDP_OK) st = gdp_tensor_max_abs(o->t, &d);
  if (st == GDP_OK) st = gdp_tensor_count_nonfinite(o->t, &k);
  if (st == GDP_OK) st = gdp_tensor_rel_error(o->t, o->a, &d);
  if (st == GDP_OK) st = gdp_tensor_to_host(o->t, GDP_DTYPE_F64, host, sizeof host);
  return st;
}
/* Allocating calls: t's count stays; a copy's result starts at 0. */
static gdp_status ver_allocating(ver_ops *o) {
  gdp_tensor *r[8] = {NULL};
  gdp_status st = GDP_OK;
  gdp_tensor *tt = NULL;
  if (st == GDP_OK) st = gdp_tensor_transpose(o->t, 0, 1, &tt);
  if (st == GDP_OK) st = gdp_tensor_clone(o->t, &r[0]);
  if (st == GDP_OK) st = gdp_tensor_contiguous(tt, &r[1]);
  if (st == GDP_OK) st = gdp_tensor_to(NULL, o->t, GDP_DTYPE_F32, &r[2]);
  if (st == GDP_OK) st = gdp_tensor_reshape(tt, 1, (int64_t[]){12}, &r[3]);
  if (st == GDP_OK) st = gdp_mixer_beta_forward(ctx, o->t, 2.0, &r[4]);
  if (st == GDP_OK) st = gdp_mixer_repeat_heads_forward(ctx, o->t, 4, &r[5]);
  /* the mixer ops may build their results with writes of their own: only the copies'
   * results are checked */
  for (int i = 0; i < 4; i++)
    CHECK(r[i] && gdp_tensor_version(r[i]) == 0, "allocated result %d starts at version 0", i);
  for (int i = 0; i < 8; i++) gdp_tensor_free(r[i]);
  gdp_tensor_free(tt);
  return st;
}

static void test_versions(void) {
  static const struct {
    const char *name;
    gdp_status (*call)(ver_ops *);
    int writes;
  } cases[] = {
      {"copy", ver_copy, 1},
      {"copy onto itself", ver_copy_self, 1},
      {"fill", ver_fill, 1},
      {"set", ver_set, 1},
      {"uniform", ver_uniform, 1},
      {"normal", ver_normal, 1},
      {"add", ver_add, 1},
      {"add in place", ver_add_, 1},
      {"mul", ver_mul, 1},
      {"scale in place", ver_scale, 1},
      {"matmul (beta 1)", ver_matmul, 1},
      {"comm allgather (through a view of the view)", ver_allgather, 1},
      {"comm alltoall", ver_alltoall, 1},
      {"comm alltoallv", ver_alltoallv, 1},
      {"comm allreduce", ver_allreduce, 1},
      {"comm sendrecv (recv)", ver_sendrecv, 1},
      {"comm broadcast on the root", ver_broadcast_root, 0},
      {"comm sendrecv (send)", ver_send_side, 0},
      {"copy from t", ver_copy_from, 0},
      {"add reading t", ver_add_into_other, 0},
      {"matmul failing its checks", ver_matmul_bad_shape, 0},
      {"fill of an empty view", ver_fill_empty, 0},
      {"reads and reductions", ver_reads, 0},
      {"allocating ops", ver_allocating, 0},
  };
  ver_ops o = {0};
  o.base = random_tensor(GDP_DTYPE_F64, 2, (int64_t[]){4, 6});
  o.a = random_tensor(GDP_DTYPE_F64, 2, (int64_t[]){2, 6});
  o.b = random_tensor(GDP_DTYPE_F64, 2, (int64_t[]){2, 6});
  o.m = random_tensor(GDP_DTYPE_F64, 2, (int64_t[]){2, 3});
  o.n = random_tensor(GDP_DTYPE_F64, 2, (int64_t[]){3, 6});
  CHECK_OK(gdp_comm_self(&o.comm));
  CHECK(gdp_tensor_version(o.base) == 0, "a new tensor is at version 0");
  CHECK(gdp_tensor_version(NULL) == 0, "NULL: 0");
  CHECK_OK(gdp_tensor_narrow(o.base, 0, 1, 2, &o.t));
  CHECK(gdp_tensor_version(o.t) == 0, "a view shares the count");
  for (int i = 0; i < NELEM(cases); i++) {
    uint64_t before = gdp_tensor_version(o.base), a_before = gdp_tensor_version(o.a);
    CHECK_OK(cases[i].call(&o));
    uint64_t after = gdp_tensor_version(o.base);
    if (cases[i].writes) CHECK(after > before, "%s: the base's version rose", cases[i].name);
    else CHECK(after == before, "%s: the version stayed (%llu -> %llu)", cases[i].name,
               (unsigned long long)before, (unsigned long long)after);
    CHECK(gdp_tensor_version(o.t) == after, "%s: view and base agree", cases[i].name);
    int a_written = cases[i].call == ver_copy_from || cases[i].call == ver_add_into_other ||
                    cases[i].call == ver_send_side;
    if (!a_written) CHECK(gdp_tensor_version(o.a) == a_before, "%s: an input's version stayed", cases[i].name);
    else CHECK(gdp_tensor_version(o.a) > a_before, "%s: the written tensor's version rose", cases[i].name);
  }
  /* a write into the base is seen through the view */
  uint64_t v = gdp_tensor_version(o.t);
  CHECK_OK(gdp_tensor_set(o.base, (int64_t[]){3, 5}, 1.0));
  CHECK(gdp_tensor_version(o.t) > v, "a write through the base shows in the view");
  gdp_comm_free(o.comm);
  gdp_tensor_free(o.t);
  gdp_tensor_free(o.base);
  gdp_tensor_free(o.a);
  gdp_tensor_free(o.b);
  gdp_tensor_free(o.m);
  gdp_tensor_free(o.n);
}

static void test_memory(int64_t baseline) {
  int64_t s[2] = {100, 10};
  gdp_tensor *t = NULL, *v = NULL;
  int64_t before = gdp_mem_live_bytes(GDP_DEVICE_CPU);
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 2, s, &t));
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CPU) - before == 8000, "8000 bytes live, got %lld",
        (long long)(gdp_mem_live_bytes(GDP_DEVICE_CPU) - before));
  CHECK_OK(gdp_tensor_transpose(t, 0, 1, &v));
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CPU) - before == 8000, "views allocate nothing");
  gdp_tensor_free(t);
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CPU) - before == 8000, "storage lives while a view does");
  gdp_tensor_free(v);
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CPU) == before, "freed");
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CPU) == baseline, "back to the baseline: %lld vs %lld",
        (long long)gdp_mem_live_bytes(GDP_DEVICE_CPU), (long long)baseline);
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CUDA) == 0, "no cuda bytes");
}

int main(void) {
  TEST_BEGIN(20240611);
  int64_t baseline = gdp_mem_live_bytes(GDP_DEVICE_CPU);
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx));
  test_basics();
  test_construct();
  test_views();
  test_copy_all_pairs();
  test_transposed_copies();
  test_conversion_edges();
  test_bf16();
  test_get_set_fill();
  test_elementwise();
  test_reductions();
  test_matmul();
  test_matmul_batched();
  test_empty_and_scalar();
  test_shape_overflow();
  test_overlapping_copies();
  test_versions();
  test_memory(baseline);
  /* a tensor may outlive the caller's reference to its context */
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, (int64_t[]){5}, &t));
  gdp_ctx_free(ctx);
  CHECK_OK(gdp_tensor_fill(t, 2.0));
  double sum = 0;
  CHECK_OK(gdp_tensor_sum(t, &sum));
  CHECK(sum == 10.0, "tensor outlives ctx reference");
  gdp_tensor_free(t);
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CPU) == baseline, "all memory returned");
  TEST_END();
}
