/*
 * tensor_ops.c -- the public elementwise, reduction, matmul and random-fill entry
 * points: argument checks with messages, then dispatch through the backend of the
 * tensors' device.  Backends see operands that agree in device, shape and dtype.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_impl.h"
#include "philox.h"

#define SHAPE_STR(buf, t) gdp_shape_str((buf), sizeof(buf), (t)->ndim, (t)->shape)

static gdp_ctx *ctx_of(const gdp_tensor *t) { return t->storage->ctx; }

/* GDP_SYNC_EVERY_OP=1 (kernels/kernel_status.h) makes asynchronous device errors
 * surface at the op that caused them. */
static gdp_status after_op(const char *func, gdp_ctx *ctx, gdp_status st) {
  const int m = gdp_debug_sync_every_op();
  if (st != GDP_OK || !m || ctx->type == GDP_DEVICE_CPU) return st;
  st = ctx->backend->sync(ctx);
  if (st != GDP_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", gdp_last_error());
    return GDP_ERROR_IN(func, st, "asynchronous error after this op (GDP_SYNC_EVERY_OP): %s", msg);
  }
  return st;
}

static gdp_status check_not_null(const char *func, const char *name, const void *p) {
  if (!p) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s is NULL", name);
  return GDP_OK;
}

static gdp_status check_same_device(const char *func, const char *an, const gdp_tensor *a,
                                    const char *bn, const gdp_tensor *b) {
  const gdp_ctx *ca = ctx_of(a), *cb = ctx_of(b);
  if (ca->type != cb->type || ca->index != cb->index)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "%s and %s must be on the same device, got %s:%d and %s:%d (copy one "
                        "with gdp_tensor_to)",
                        an, bn, gdp_device_type_name(ca->type), ca->index,
                        gdp_device_type_name(cb->type), cb->index);
  return GDP_OK;
}

static gdp_status check_same_shape(const char *func, const char *an, const gdp_tensor *a,
                                   const char *bn, const gdp_tensor *b) {
  int same = a->ndim == b->ndim;
  for (int i = 0; same && i < a->ndim; i++) same = a->shape[i] == b->shape[i];
  if (!same) {
    char ab[160], bb[160];
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "%s and %s must have the same shape, got %s and %s",
                        an, bn, SHAPE_STR(ab, a), SHAPE_STR(bb, b));
  }
  return GDP_OK;
}

static gdp_status check_same_dtype(const char *func, const char *an, const gdp_tensor *a,
                                   const char *bn, const gdp_tensor *b) {
  if (a->dtype != b->dtype)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "%s and %s must have the same dtype, got %s and %s",
                        an, bn, gdp_dtype_name(a->dtype), gdp_dtype_name(b->dtype));
  return GDP_OK;
}

static gdp_status check_supported(const char *func, const gdp_ctx *ctx, gdp_op op,
                                  const char *what, gdp_dtype dtype) {
  if (!ctx->backend->supports(op, dtype))
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "%s is not implemented for %s on %s",
                        what, gdp_dtype_name(dtype), gdp_device_type_name(ctx->type));
  return GDP_OK;
}

/* Binary inputs of different dtypes are both widened to float64 (exact for every
 * dtype but int64 beyond 2^53) so that the backends only see one dtype. */
static gdp_status promote_pair(const char *func, const gdp_tensor **a, const gdp_tensor **b,
                               gdp_tensor **tmp_a, gdp_tensor **tmp_b) {
  *tmp_a = *tmp_b = NULL;
  if ((*a)->dtype == (*b)->dtype) return GDP_OK;
  gdp_status st = GDP_OK;
  if ((*a)->dtype != GDP_DTYPE_F64) st = gdp_tensor_to(ctx_of(*a), *a, GDP_DTYPE_F64, tmp_a);
  if (st == GDP_OK && (*b)->dtype != GDP_DTYPE_F64)
    st = gdp_tensor_to(ctx_of(*b), *b, GDP_DTYPE_F64, tmp_b);
  if (st != GDP_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", gdp_last_error());
    gdp_tensor_free(*tmp_a);
    gdp_tensor_free(*tmp_b);
    *tmp_a = *tmp_b = NULL;
    return GDP_ERROR_IN(func, st, "widening the inputs to f64 failed: %s", msg);
  }
  if (*tmp_a) *a = *tmp_a;
  if (*tmp_b) *b = *tmp_b;
  return GDP_OK;
}

/* ------------------------------------------------------------------ elementwise */

static gdp_status binary_op(const char *func, gdp_tensor *out, const gdp_tensor *a,
                            const gdp_tensor *b, gdp_binary_kind kind, double alpha) {
  GDP_TRY(check_not_null(func, "out", out));
  GDP_TRY(check_not_null(func, "a", a));
  if (b) {
    GDP_TRY(check_same_device(func, "out", out, "b", b));
    GDP_TRY(check_same_shape(func, "out", out, "b", b));
    GDP_TRY(check_same_dtype(func, "out", out, "b", b));
  }
  GDP_TRY(check_same_device(func, "out", out, "a", a));
  GDP_TRY(check_same_shape(func, "out", out, "a", a));
  GDP_TRY(check_same_dtype(func, "out", out, "a", a));
  gdp_ctx *ctx = ctx_of(out);
  GDP_TRY(check_supported(func, ctx, GDP_OP_ELEMENTWISE, "elementwise arithmetic", out->dtype));
  if (gdp_tensor_numel(out) == 0) return GDP_OK;
  gdp_tensor_mark_written(out);
  /* out may alias an input exactly (each chunk is read before it is written), but an
   * input that shares memory with out in another layout (a transpose, a shifted
   * window) would be read after it was overwritten: stage such inputs first. */
  gdp_tensor *staged_a = NULL, *staged_b = NULL;
  gdp_status st = GDP_OK;
  if (gdp_tensor_partial_overlap(out, a)) st = gdp_tensor_clone((gdp_tensor *)a, &staged_a);
  if (st == GDP_OK && b && gdp_tensor_partial_overlap(out, b))
    st = gdp_tensor_clone((gdp_tensor *)b, &staged_b);
  if (st == GDP_OK)
    st = after_op(func, ctx,
                  ctx->backend->binary(ctx, out, staged_a ? staged_a : a,
                                       staged_b ? staged_b : b, kind, alpha));
  gdp_tensor_free(staged_a);
  gdp_tensor_free(staged_b);
  return st;
}

gdp_status gdp_tensor_add(gdp_tensor *out, const gdp_tensor *a, const gdp_tensor *b,
                          double alpha) {
  GDP_TRY(check_not_null(__func__, "b", b));
  return binary_op(__func__, out, a, b, GDP_BINARY_AXPY, alpha);
}

gdp_status gdp_tensor_mul(gdp_tensor *out, const gdp_tensor *a, const gdp_tensor *b) {
  GDP_TRY(check_not_null(__func__, "b", b));
  return binary_op(__func__, out, a, b, GDP_BINARY_MUL, 1.0);
}

gdp_status gdp_tensor_scale(gdp_tensor *out, const gdp_tensor *a, double alpha) {
  return binary_op(__func__, out, a, NULL, GDP_BINARY_SCALE, alpha);
}

/* ------------------------------------------------------------------ reductions */

/* a (and b for the two-input kinds) already checked; dtypes may differ. */
static gdp_status reduce_op(const char *func, const gdp_tensor *a, const gdp_tensor *b,
                            gdp_reduce_kind kind, double *out) {
  gdp_tensor *ta = NULL, *tb = NULL;
  if (b) GDP_TRY(promote_pair(func, &a, &b, &ta, &tb));
  gdp_ctx *ctx = ctx_of(a);
  gdp_status st = check_supported(func, ctx, GDP_OP_REDUCE, "reduction", a->dtype);
  if (st == GDP_OK) {
    *out = 0.0;
    if (gdp_tensor_numel(a) > 0) st = after_op(func, ctx, ctx->backend->reduce(ctx, a, b, kind, out));
  }
  gdp_tensor_free(ta);
  gdp_tensor_free(tb);
  return st;
}

static gdp_status check_unary(const char *func, const gdp_tensor *t, const void *out) {
  GDP_TRY(check_not_null(func, "out", out));
  return check_not_null(func, "t", t);
}

static gdp_status check_pair(const char *func, const char *an, const gdp_tensor *a,
                             const char *bn, const gdp_tensor *b, const void *out) {
  GDP_TRY(check_not_null(func, "out", out));
  GDP_TRY(check_not_null(func, an, a));
  GDP_TRY(check_not_null(func, bn, b));
  GDP_TRY(check_same_device(func, an, a, bn, b));
  return check_same_shape(func, an, a, bn, b);
}

gdp_status gdp_tensor_sum(const gdp_tensor *t, double *out) {
  GDP_TRY(check_unary(__func__, t, out));
  return reduce_op(__func__, t, NULL, GDP_REDUCE_SUM, out);
}

gdp_status gdp_tensor_dot(const gdp_tensor *a, const gdp_tensor *b, double *out) {
  GDP_TRY(check_pair(__func__, "a", a, "b", b, out));
  return reduce_op(__func__, a, b, GDP_REDUCE_DOT, out);
}

gdp_status gdp_tensor_norm(const gdp_tensor *t, double *out) {
  GDP_TRY(check_unary(__func__, t, out));
  double s;
  GDP_TRY(reduce_op(__func__, t, NULL, GDP_REDUCE_SUMSQ, &s));
  *out = sqrt(s);
  return GDP_OK;
}

gdp_status gdp_tensor_sumsq_many(int n, const gdp_tensor *const *ts, double *out) {
  const char *func = __func__;
  if (n < 0) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "n: expected >= 0, got %d", n);
  if (n == 0) return GDP_OK;
  GDP_TRY(check_not_null(func, "ts", ts));
  GDP_TRY(check_not_null(func, "out", out));
  for (int i = 0; i < n; i++) {
    if (!ts[i]) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "ts[%d] is NULL", i);
    char name[32];
    snprintf(name, sizeof name, "ts[%d]", i);
    GDP_TRY(check_same_device(func, "ts[0]", ts[0], name, ts[i]));
  }
  gdp_ctx *ctx = ctx_of(ts[0]);
  for (int i = 0; i < n; i++) GDP_TRY(check_supported(func, ctx, GDP_OP_REDUCE, "reduction", ts[i]->dtype));
  if (!ctx->backend->reduce_many) {
    for (int i = 0; i < n; i++) GDP_TRY(reduce_op(func, ts[i], NULL, GDP_REDUCE_SUMSQ, &out[i]));
    return GDP_OK;
  }
  return after_op(func, ctx, ctx->backend->reduce_many(ctx, n, ts, GDP_REDUCE_SUMSQ, out));
}

gdp_status gdp_tensor_max_abs(const gdp_tensor *t, double *out) {
  GDP_TRY(check_unary(__func__, t, out));
  return reduce_op(__func__, t, NULL, GDP_REDUCE_MAXABS, out);
}

gdp_status gdp_tensor_count_nonfinite(const gdp_tensor *t, int64_t *out) {
  GDP_TRY(check_unary(__func__, t, out));
  double n;
  GDP_TRY(reduce_op(__func__, t, NULL, GDP_REDUCE_NONFINITE, &n));
  *out = (int64_t)n;
  return GDP_OK;
}

/* ||a - ref||^2 and ||ref||^2 of float64 copies of a and ref scaled by 2^-e, where
 * 2^e ~ the largest magnitude: only used when the plain sums over- or underflow. */
static gdp_status rel_error_scaled(const char *func, const gdp_tensor *a, const gdp_tensor *ref,
                                   double *diff, double *refsq) {
  double ma, mr;
  GDP_TRY(reduce_op(func, a, NULL, GDP_REDUCE_MAXABS, &ma));
  GDP_TRY(reduce_op(func, ref, NULL, GDP_REDUCE_MAXABS, &mr));
  double m = ma > mr ? ma : mr;
  if (m == 0.0) {
    *diff = *refsq = 0.0;
    return GDP_OK;
  }
  /* two power-of-two factors, each within range even for subnormal m */
  int e = ilogb(m);
  double s1 = ldexp(1.0, -e / 2), s2 = ldexp(1.0, -e - (-e / 2));
  gdp_tensor *sa = NULL, *sr = NULL;
  gdp_status st = gdp_tensor_to(ctx_of(a), a, GDP_DTYPE_F64, &sa);
  if (st == GDP_OK) st = gdp_tensor_to(ctx_of(ref), ref, GDP_DTYPE_F64, &sr);
  if (st == GDP_OK) st = gdp_tensor_scale(sa, sa, s1);
  if (st == GDP_OK) st = gdp_tensor_scale(sa, sa, s2);
  if (st == GDP_OK) st = gdp_tensor_scale(sr, sr, s1);
  if (st == GDP_OK) st = gdp_tensor_scale(sr, sr, s2);
  if (st == GDP_OK) st = reduce_op(func, sa, sr, GDP_REDUCE_DIFF_SUMSQ, diff);
  if (st == GDP_OK) st = reduce_op(func, sr, NULL, GDP_REDUCE_SUMSQ, refsq);
  gdp_tensor_free(sa);
  gdp_tensor_free(sr);
  return st;
}

gdp_status gdp_tensor_rel_error(const gdp_tensor *a, const gdp_tensor *ref, double *out) {
  GDP_TRY(check_pair(__func__, "a", a, "ref", ref, out));
  double bad_a, bad_r;
  GDP_TRY(reduce_op(__func__, a, NULL, GDP_REDUCE_NONFINITE, &bad_a));
  GDP_TRY(reduce_op(__func__, ref, NULL, GDP_REDUCE_NONFINITE, &bad_r));
  if (bad_a > 0 || bad_r > 0) {
    *out = NAN; /* NaN never passes a tolerance check */
    return GDP_OK;
  }
  double diff, refsq;
  GDP_TRY(reduce_op(__func__, a, ref, GDP_REDUCE_DIFF_SUMSQ, &diff));
  GDP_TRY(reduce_op(__func__, ref, NULL, GDP_REDUCE_SUMSQ, &refsq));
  /* squares of values beyond ~1e154 overflow, below ~1e-154 underflow: rescale */
  if (!isfinite(diff) || !isfinite(refsq) || refsq < 1e-290 || (diff > 0 && diff < 1e-290))
    GDP_TRY(rel_error_scaled(__func__, a, ref, &diff, &refsq));
  if (refsq == 0.0)
    *out = diff == 0.0 ? 0.0 : INFINITY;
  else
    *out = sqrt(diff) / sqrt(refsq);
  return GDP_OK;
}

/* ------------------------------------------------------------------ matmul */

/* Element range [lo, hi] that t touches in its storage (strides are >= 0). */
static void elem_range(const gdp_tensor *t, int64_t *lo, int64_t *hi) {
  *lo = *hi = t->offset;
  for (int d = 0; d < t->ndim; d++) *hi += (t->shape[d] - 1) * t->stride[d];
}

static int overlaps(const gdp_tensor *a, const gdp_tensor *b) {
  if (a->storage != b->storage || gdp_tensor_numel(a) == 0 || gdp_tensor_numel(b) == 0) return 0;
  int64_t alo, ahi, blo, bhi;
  elem_range(a, &alo, &ahi);
  elem_range(b, &blo, &bhi);
  size_t ea = gdp_dtype_size(a->dtype), eb = gdp_dtype_size(b->dtype);
  /* compare byte ranges: dtypes of views on one storage may differ */
  return (size_t)alo * ea < (size_t)(bhi + 1) * eb && (size_t)blo * eb < (size_t)(ahi + 1) * ea;
}

gdp_status gdp_tensor_matmul(gdp_tensor *out, const gdp_tensor *a, const gdp_tensor *b,
                             int trans_a, int trans_b, double alpha, double beta) {
  const char *func = __func__;
  GDP_TRY(check_not_null(func, "out", out));
  GDP_TRY(check_not_null(func, "a", a));
  GDP_TRY(check_not_null(func, "b", b));
  GDP_TRY(check_same_device(func, "out", out, "a", a));
  GDP_TRY(check_same_device(func, "out", out, "b", b));
  /* bf16 operands may write a float32 out (a gradient kept in float32) */
  const int bf16_into_f32 = a->dtype == GDP_DTYPE_BF16 && b->dtype == GDP_DTYPE_BF16 &&
                            out->dtype == GDP_DTYPE_F32;
  if (!bf16_into_f32) {
    GDP_TRY(check_same_dtype(func, "out", out, "a", a));
    GDP_TRY(check_same_dtype(func, "out", out, "b", b));
  }
  gdp_ctx *ctx = ctx_of(out);
  if (out->dtype != GDP_DTYPE_F32 && out->dtype != GDP_DTYPE_F64 && out->dtype != GDP_DTYPE_BF16)
    return GDP_ERROR(GDP_ERR_DTYPE, "expected f32, f64 or bf16 tensors, got %s",
                     gdp_dtype_name(out->dtype));
  /* bf16 (float32 accumulation) exists on cuda only; the cpu answers unsupported. */
  GDP_TRY(check_supported(func, ctx, GDP_OP_MATMUL, "matmul", a->dtype));
  char ab[160], bb[160], ob[160];
  /* out [M,N] takes 2-D a and b; out [batch,M,N] takes a and b with that batch on dim 0,
   * or one of them 2-D, the same matrix for every batch entry (batch stride 0). */
  if (out->ndim != 2 && out->ndim != 3)
    return GDP_ERROR(GDP_ERR_SHAPE,
                     "out: expected a 2-D [M,N] or 3-D [batch,M,N] tensor, got %d dims %s",
                     out->ndim, SHAPE_STR(ob, out));
  const int batched = out->ndim == 3;
  const int64_t nb = batched ? out->shape[0] : 1;
  const struct {
    const char *name;
    const gdp_tensor *t;
  } ops[2] = {{"a", a}, {"b", b}};
  for (int i = 0; i < 2; i++) {
    const gdp_tensor *t = ops[i].t;
    if (!batched && t->ndim != 2)
      return GDP_ERROR(GDP_ERR_SHAPE,
                       "%s: expected a 2-D tensor (out is 2-D; a batched product takes a 3-D out), "
                       "got %d dims %s",
                       ops[i].name, t->ndim, SHAPE_STR(ab, t));
    if (batched && t->ndim != 2 && t->ndim != 3)
      return GDP_ERROR(GDP_ERR_SHAPE,
                       "%s: expected a 3-D [batch,.,.] tensor or a 2-D one shared by every batch "
                       "entry (out is %s), got %d dims %s",
                       ops[i].name, SHAPE_STR(ob, out), t->ndim, SHAPE_STR(ab, t));
    if (batched && t->ndim == 3 && t->shape[0] != nb)
      return GDP_ERROR(GDP_ERR_SHAPE,
                       "%s: expected a batch of %" PRId64 " (out is %s), got %s",
                       ops[i].name, nb, SHAPE_STR(ob, out), SHAPE_STR(ab, t));
  }
  if (batched && a->ndim == 2 && b->ndim == 2)
    return GDP_ERROR(GDP_ERR_SHAPE,
                     "a and b: expected at least one 3-D [batch,.,.] operand (out is %s), "
                     "got a %s and b %s",
                     SHAPE_STR(ob, out), SHAPE_STR(ab, a), SHAPE_STR(bb, b));
  const int da = a->ndim - 2, db = b->ndim - 2, dout = out->ndim - 2;
  int64_t M = trans_a ? a->shape[da + 1] : a->shape[da];
  int64_t K = trans_a ? a->shape[da] : a->shape[da + 1];
  int64_t Kb = trans_b ? b->shape[db + 1] : b->shape[db];
  int64_t N = trans_b ? b->shape[db] : b->shape[db + 1];
  if (K != Kb)
    return GDP_ERROR(GDP_ERR_SHAPE,
                     "inner dims differ: op(a) is [%" PRId64 "x%" PRId64 "] (a %s, trans_a %d), "
                     "op(b) is [%" PRId64 "x%" PRId64 "] (b %s, trans_b %d)",
                     M, K, SHAPE_STR(ab, a), trans_a != 0, Kb, N, SHAPE_STR(bb, b), trans_b != 0);
  if (out->shape[dout] != M || out->shape[dout + 1] != N) {
    char want[64];
    if (batched)
      snprintf(want, sizeof want, "[%" PRId64 "x%" PRId64 "x%" PRId64 "]", nb, M, N);
    else
      snprintf(want, sizeof want, "[%" PRId64 "x%" PRId64 "]", M, N);
    return GDP_ERROR(GDP_ERR_SHAPE, "out: expected %s for op(a) %s @ op(b) %s, got %s", want,
                     SHAPE_STR(ab, a), SHAPE_STR(bb, b), SHAPE_STR(ob, out));
  }
  if (overlaps(out, a)) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out must not alias a (they share memory)");
  if (overlaps(out, b)) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out must not alias b (they share memory)");
  if (nb == 0 || M == 0 || N == 0) return GDP_OK;
  gdp_tensor_mark_written(out);
  return after_op(func, ctx,
                  ctx->backend->matmul(ctx, out, a, b, trans_a != 0, trans_b != 0, alpha, beta));
}

/* ------------------------------------------------------------------ random fills */

static gdp_status rng_fill(const char *func, gdp_tensor *t, gdp_rng_kind kind, double a,
                           double b) {
  GDP_TRY(check_not_null(func, "t", t));
  if (t->dtype != GDP_DTYPE_F64 && t->dtype != GDP_DTYPE_F32 && t->dtype != GDP_DTYPE_BF16)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "t: expected f64, f32 or bf16, got %s",
                        gdp_dtype_name(t->dtype));
  gdp_ctx *ctx = ctx_of(t);
  GDP_TRY(check_supported(func, ctx, GDP_OP_RNG, "random fill", t->dtype));
  int64_t n = gdp_tensor_numel(t);
  if (n == 0) return GDP_OK;
  uint64_t offset = ctx->rng_offset;
  gdp_tensor_mark_written(t);
  GDP_TRY(after_op(func, ctx, ctx->backend->rng(ctx, t, kind, a, b, ctx->seed, offset)));
  ctx->rng_offset = offset + gdp_philox_blocks_for((uint64_t)n);
  return GDP_OK;
}

gdp_status gdp_tensor_uniform(gdp_tensor *t, double lo, double hi) {
  if (!isfinite(lo) || !isfinite(hi) || lo > hi)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "expected finite lo <= hi, got lo %g, hi %g", lo, hi);
  return rng_fill(__func__, t, GDP_RNG_UNIFORM, lo, hi);
}

gdp_status gdp_tensor_normal(gdp_tensor *t, double mean, double std) {
  if (!isfinite(mean) || !isfinite(std) || std < 0)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "expected finite mean and std >= 0, got mean %g, std %g",
                     mean, std);
  return rng_fill(__func__, t, GDP_RNG_NORMAL, mean, std);
}
