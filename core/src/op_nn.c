/*
 * op_nn.c -- the public model layer ops (gdp.h, "model layer ops"): argument
 * validation, the integer inputs (tokens and targets) handed to the backend where it
 * reads them, contiguous compute-dtype copies, dispatch through ctx->backend
 * (backend_impl.h), and delivery of the results in the documented dtypes.
 *
 * A value out of range is an error naming its position, never an out-of-bounds read.
 * A host-index backend (the cpu) gets the values read, validated and (for the
 * embedding's backward) bucketed here: one stable counting sort, so that every row's
 * gradients are added in token order.  A device-index backend (cuda) gets them as a
 * contiguous buffer on its device and checks them there, reporting the first bad
 * position (nn_problem.h); the message is made here from the same words either way.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "op_helpers.h"

/* ------------------------------------------------------------------ integer inputs */

/* t (not NULL) is int32/int64, on the host or on ctx's device. */
static gdp_status check_index_tensor(const char *func, const char *name, const gdp_ctx *ctx,
                                     const gdp_tensor *t) {
  GDP_TRY(need_tensor(func, name, t));
  if (t->dtype != GDP_DTYPE_I32 && t->dtype != GDP_DTYPE_I64)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "%s: expected dtype i32 or i64, got %s", name,
                        gdp_dtype_name(t->dtype));
  return check_host_readable(func, name, ctx, t);
}

/* A host int64 copy of t's values (freed by the caller), *n its element count. */
static gdp_status host_indices(const char *func, const gdp_tensor *t, int64_t **out, int64_t *n) {
  *n = gdp_tensor_numel(t);
  *out = malloc((size_t)(*n > 0 ? *n : 1) * sizeof(int64_t));
  if (!*out) return GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for %lld indices",
                                 (long long)*n);
  gdp_status s = gdp_tensor_to_host(t, GDP_DTYPE_I64, *out, (size_t)*n * sizeof(int64_t));
  if (s != GDP_OK) {
    free(*out);
    *out = NULL;
  }
  return s;
}

/* idx = the multi-index of flat position `flat` in a row-major shape. */
static void unflatten(int ndim, const int64_t *shape, int64_t flat, int64_t *idx) {
  for (int d = ndim - 1; d >= 0; d--) {
    idx[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
}

/* "[i,j,k]" for a multi-index, for messages. */
static const char *index_str(char *buf, size_t len, int ndim, const int64_t *idx) {
  size_t used = (size_t)snprintf(buf, len, "[");
  for (int d = 0; d < ndim && used < len; d++)
    used += (size_t)snprintf(buf + used, len - used, d ? ",%lld" : "%lld", (long long)idx[d]);
  if (used < len) snprintf(buf + used, len - used, "]");
  return buf;
}

/* When t is a permutation of a contiguous block other than t itself (a transposed view),
 * base[i] = the dim of t that is dim i of the tensor it views (dims by stride, largest
 * first, ties in t's order); else base[0] = -1. */
static void view_base(const gdp_tensor *t, int *base) {
  base[0] = -1;
  int order[GDP_MAX_DIMS], permuted = 0;
  for (int d = 0; d < t->ndim; d++) order[d] = d;
  for (int i = 1; i < t->ndim; i++) /* insertion sort: stable */
    for (int j = i; j > 0 && t->stride[order[j]] > t->stride[order[j - 1]]; j--) {
      const int x = order[j];
      order[j] = order[j - 1];
      order[j - 1] = x;
    }
  int64_t expect = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    const int d = order[i];
    if (t->shape[d] != 1 && t->stride[d] != expect) return; /* not a plain permutation */
    expect *= t->shape[d];
    permuted |= d != i;
  }
  if (permuted) memcpy(base, order, sizeof(int) * (size_t)t->ndim);
}

/* The check of an index tensor's values against [0, V) (nn_problem.h), whose report is
 * the message naming the first bad one; by value, so that a backend may report late. */
static gdp_index_check index_check(const char *func, const gdp_tensor *t, int64_t V,
                                   int64_t ignore_index,
                                   gdp_status (*report)(const gdp_index_check *, int64_t,
                                                        int64_t)) {
  gdp_index_check c;
  memset(&c, 0, sizeof c);
  c.report = report, c.func = func, c.V = V, c.ignore_index = ignore_index;
  c.ndim = t->ndim;
  memcpy(c.shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
  view_base(t, c.base);
  return c;
}

/* "[i,j]" for flat position `flat` of the checked tensor, and for a permuted view
 * " (a permuted view: [j,i] in the tensor it views)" after it. */
static const char *check_position(char *buf, size_t len, const gdp_index_check *c, int64_t flat) {
  int64_t idx[GDP_MAX_DIMS], in_base[GDP_MAX_DIMS];
  unflatten(c->ndim, c->shape, flat, idx);
  index_str(buf, len, c->ndim, idx);
  if (c->base[0] < 0) return buf;
  for (int i = 0; i < c->ndim; i++) in_base[i] = idx[c->base[i]];
  char b[120];
  const size_t used = strlen(buf);
  snprintf(buf + used, len - used, " (a permuted view: %s in the tensor it views)",
           index_str(b, sizeof b, c->ndim, in_base));
  return buf;
}

/* t's shape is ref's without its last dim (targets against logits, tokens against d_out). */
static gdp_status check_leading_shape(const char *func, const char *name, const gdp_tensor *t,
                                      const char *ref_name, const gdp_tensor *ref) {
  int same = t->ndim == ref->ndim - 1;
  for (int i = 0; same && i < t->ndim; i++) same = t->shape[i] == ref->shape[i];
  if (same) return GDP_OK;
  char a[128], b[128];
  return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "%s: expected the leading dims of %s, %s, got %s", name,
                      ref_name, gdp_shape_str(b, sizeof b, ref->ndim - 1, ref->shape),
                      shape_of(a, sizeof a, t));
}

/* t's values contiguous on ctx's device in `dtype` (a new reference when they already
 * are), for a device-index backend. */
static gdp_status device_values(gdp_ctx *ctx, const gdp_tensor *t, gdp_dtype dtype,
                                gdp_tensor **out) {
  const gdp_ctx *tc = t->storage->ctx;
  if (t->dtype == dtype && tc->type == ctx->type && tc->index == ctx->index)
    return gdp_tensor_contiguous((gdp_tensor *)t, out);
  return gdp_tensor_to(ctx, t, dtype, out);
}

/* ------------------------------------------------------------------ SwiGLU gate */

static gdp_status silu_mul_check(const char *func, gdp_ctx *ctx, const gdp_tensor *gate,
                                 const gdp_tensor *up, const gdp_tensor *d_out) {
  GDP_TRY(need_tensor(func, "gate", gate));
  GDP_TRY(need_tensor(func, "up", up));
  GDP_TRY(check_float_on(func, "gate", ctx, gate));
  GDP_TRY(check_float_on(func, "up", ctx, up));
  GDP_TRY(check_float_on(func, "d_out", ctx, d_out));
  GDP_TRY(check_same_shape(func, "up", up, "gate", gate));
  return check_same_shape(func, "d_out", d_out, "gate", gate);
}

gdp_status gdp_nn_silu_mul_forward(gdp_ctx *ctx, const gdp_tensor *gate, const gdp_tensor *up,
                                   gdp_tensor **out) {
  static const char *func = "gdp_nn_silu_mul_forward";
  GDP_TRY(need_out(func, "out", out));
  *out = NULL;
  NEED_OP(func, ctx, silu_mul_forward);
  GDP_TRY(silu_mul_check(func, ctx, gate, up, NULL));
  gdp_tensor *tmp[3] = {0}; /* gate, up, out */
  const gdp_dtype dt = gate->dtype;
  gdp_status s = load(ctx, gate, dt, &tmp[0]);
  if (s == GDP_OK) s = load(ctx, up, dt, &tmp[1]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, dt, gate->ndim, gate->shape, &tmp[2]);
  if (s == GDP_OK)
    s = ctx->backend->silu_mul_forward(ctx, dt, gdp_tensor_numel(gate), ptr(tmp[0]),
                                       ptr(tmp[1]), ptr(tmp[2]));
  if (s == GDP_OK) {
    *out = tmp[2];
    tmp[2] = NULL;
  }
  FREE_ALL(tmp);
  return s;
}

gdp_status gdp_nn_silu_mul_backward(gdp_ctx *ctx, const gdp_tensor *gate, const gdp_tensor *up,
                                    const gdp_tensor *d_out, gdp_tensor **d_gate,
                                    gdp_tensor **d_up) {
  static const char *func = "gdp_nn_silu_mul_backward";
  clear_outs(d_gate, d_up, NULL, NULL);
  NEED_OP(func, ctx, silu_mul_backward);
  GDP_TRY(need_tensor(func, "d_out", d_out));
  GDP_TRY(silu_mul_check(func, ctx, gate, up, d_out));
  gdp_tensor *tmp[5] = {0}; /* gate, up, d_out, d_gate, d_up */
  const gdp_dtype dt = gate->dtype;
  gdp_status s = load(ctx, gate, dt, &tmp[0]);
  if (s == GDP_OK) s = load(ctx, up, dt, &tmp[1]);
  if (s == GDP_OK) s = load(ctx, d_out, dt, &tmp[2]);
  if (s == GDP_OK) s = buffer_like(ctx, d_gate != NULL, dt, gate, &tmp[3]);
  if (s == GDP_OK) s = buffer_like(ctx, d_up != NULL, dt, gate, &tmp[4]);
  if (s == GDP_OK)
    s = ctx->backend->silu_mul_backward(ctx, dt, gdp_tensor_numel(gate), ptr(tmp[0]),
                                        ptr(tmp[1]), ptr(tmp[2]), ptr(tmp[3]), ptr(tmp[4]));
  if (s == GDP_OK) s = deliver(ctx, &tmp[3], dt, d_gate);
  if (s == GDP_OK) s = deliver(ctx, &tmp[4], dt, d_up);
  if (s != GDP_OK) {
    if (d_gate) {
      gdp_tensor_free(*d_gate);
      *d_gate = NULL;
    }
    if (d_up) {
      gdp_tensor_free(*d_up);
      *d_up = NULL;
    }
  }
  FREE_ALL(tmp);
  return s;
}

/* ------------------------------------------------------------------ embedding */

static gdp_status report_bad_token(const gdp_index_check *c, int64_t i, int64_t v) {
  char at[288];
  return GDP_ERROR_IN(c->func, GDP_ERR_INVALID_ARG,
                      "tokens: expected values in [0, %lld) (num_embeddings), got %lld at %s",
                      (long long)c->V, (long long)v, check_position(at, sizeof at, c, i));
}

static gdp_status bad_token(const char *func, const gdp_tensor *tokens, int64_t V, int64_t v,
                            int64_t i) {
  const gdp_index_check c = index_check(func, tokens, V, 0, report_bad_token);
  return c.report(&c, i, v);
}

/* The host token ids of `tokens`, every one checked to lie in [0, V). */
static gdp_status read_tokens(const char *func, const gdp_tensor *tokens, int64_t V,
                              int64_t **out, int64_t *n) {
  GDP_TRY(host_indices(func, tokens, out, n));
  for (int64_t i = 0; i < *n; i++) {
    const int64_t v = (*out)[i];
    if (v < 0 || v >= V) {
      free(*out);
      *out = NULL;
      return bad_token(func, tokens, V, v, i);
    }
  }
  return GDP_OK;
}

/* The tokens for the backend: host ids read and checked (p->tokens, *ids owned by the
 * caller), or the device buffer *dev (p->ids) that the backend checks. */
static gdp_status stage_tokens(const char *func, gdp_ctx *ctx, const gdp_tensor *tokens,
                               gdp_embedding_problem *p, int64_t **ids, gdp_tensor **dev) {
  *ids = NULL;
  *dev = NULL;
  if (!ctx->backend->device_indices) {
    GDP_TRY(read_tokens(func, tokens, p->V, ids, &p->n));
    p->tokens = *ids;
    return GDP_OK;
  }
  p->n = gdp_tensor_numel(tokens);
  GDP_TRY(device_values(ctx, tokens, tokens->dtype, dev));
  p->ids = ptr(*dev);
  p->ids_dtype = tokens->dtype;
  return GDP_OK;
}

gdp_status gdp_nn_embedding_forward(gdp_ctx *ctx, const gdp_tensor *weight,
                                    const gdp_tensor *tokens, gdp_tensor **out) {
  static const char *func = "gdp_nn_embedding_forward";
  char a[128];
  GDP_TRY(need_out(func, "out", out));
  *out = NULL;
  NEED_OP(func, ctx, embedding_forward);
  GDP_TRY(need_tensor(func, "weight", weight));
  GDP_TRY(check_float_on(func, "weight", ctx, weight));
  GDP_TRY(check_index_tensor(func, "tokens", ctx, tokens));
  if (weight->ndim != 2)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "weight: expected 2 dims [V,D], got %s",
                        shape_of(a, sizeof a, weight));
  if (tokens->ndim >= GDP_MAX_DIMS)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "tokens: expected at most %d dims, got %s",
                        GDP_MAX_DIMS - 1, shape_of(a, sizeof a, tokens));
  gdp_embedding_problem p = {.V = weight->shape[0], .D = weight->shape[1],
                             .num_threads = ctx->num_threads, .dtype = weight->dtype};
  const gdp_index_check check = index_check(func, tokens, p.V, 0, report_bad_token);
  p.check = &check;
  int64_t *ids = NULL;
  gdp_tensor *dev_ids = NULL;
  GDP_TRY(stage_tokens(func, ctx, tokens, &p, &ids, &dev_ids));
  int64_t shape[GDP_MAX_DIMS];
  memcpy(shape, tokens->shape, sizeof(int64_t) * (size_t)tokens->ndim);
  shape[tokens->ndim] = p.D;
  gdp_tensor *tmp[2] = {0}; /* weight, out */
  gdp_status s = load(ctx, weight, weight->dtype, &tmp[0]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, weight->dtype, tokens->ndim + 1, shape, &tmp[1]);
  if (s == GDP_OK) s = ctx->backend->embedding_forward(ctx, &p, ptr(tmp[0]), ptr(tmp[1]));
  if (s == GDP_OK) {
    *out = tmp[1];
    tmp[1] = NULL;
  }
  free(ids);
  gdp_tensor_free(dev_ids);
  FREE_ALL(tmp);
  return s;
}

/* The positions of ids[0..n) grouped by value (a stable counting sort over [0, V)):
 * row_start [V+1], row_tokens [n], both owned by the caller. */
static gdp_status bucket_tokens(const char *func, const int64_t *ids, int64_t n, int64_t V,
                                int64_t **row_start, int64_t **row_tokens) {
  *row_start = calloc((size_t)V + 1, sizeof(int64_t));
  *row_tokens = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
  int64_t *next = malloc((size_t)(V > 0 ? V : 1) * sizeof(int64_t));
  if (!*row_start || !*row_tokens || !next) {
    free(*row_start);
    free(*row_tokens);
    free(next);
    *row_start = *row_tokens = NULL;
    return GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for the token buckets");
  }
  for (int64_t i = 0; i < n; i++) (*row_start)[ids[i] + 1]++;
  for (int64_t v = 0; v < V; v++) (*row_start)[v + 1] += (*row_start)[v];
  memcpy(next, *row_start, (size_t)V * sizeof(int64_t));
  for (int64_t i = 0; i < n; i++) (*row_tokens)[next[ids[i]]++] = i;
  free(next);
  return GDP_OK;
}

gdp_status gdp_nn_embedding_backward(gdp_ctx *ctx, const gdp_tensor *tokens,
                                     const gdp_tensor *d_out, int64_t num_embeddings,
                                     gdp_tensor **dweight) {
  static const char *func = "gdp_nn_embedding_backward";
  char a[128], b[128];
  GDP_TRY(need_out(func, "dweight", dweight));
  *dweight = NULL;
  NEED_OP(func, ctx, embedding_backward);
  GDP_TRY(check_index_tensor(func, "tokens", ctx, tokens));
  GDP_TRY(need_tensor(func, "d_out", d_out));
  GDP_TRY(check_float_on(func, "d_out", ctx, d_out));
  if (num_embeddings < 1)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "num_embeddings: expected >= 1, got %lld",
                        (long long)num_embeddings);
  if (d_out->ndim != tokens->ndim + 1)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "d_out: expected tokens' shape %s then D (%d dims), got %s",
                        shape_of(b, sizeof b, tokens), tokens->ndim + 1,
                        shape_of(a, sizeof a, d_out));
  GDP_TRY(check_leading_shape(func, "tokens", tokens, "d_out", d_out));
  gdp_embedding_problem p = {.V = num_embeddings, .D = d_out->shape[d_out->ndim - 1],
                             .num_threads = ctx->num_threads, .dtype = d_out->dtype};
  const gdp_index_check check = index_check(func, tokens, p.V, 0, report_bad_token);
  p.check = &check;
  int64_t *ids = NULL, *row_start = NULL, *row_tokens = NULL;
  gdp_tensor *dev_ids = NULL;
  GDP_TRY(stage_tokens(func, ctx, tokens, &p, &ids, &dev_ids));
  gdp_status s = GDP_OK;
  if (ids) s = bucket_tokens(func, ids, p.n, p.V, &row_start, &row_tokens);
  p.row_start = row_start, p.row_tokens = row_tokens;
  const gdp_dtype grad_dt = d_out->dtype == GDP_DTYPE_BF16 ? GDP_DTYPE_F32 : d_out->dtype;
  gdp_tensor *tmp[2] = {0}; /* d_out, dweight */
  if (s == GDP_OK) s = load(ctx, d_out, d_out->dtype, &tmp[0]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, grad_dt, 2, (const int64_t[]){p.V, p.D}, &tmp[1]);
  if (s == GDP_OK) s = ctx->backend->embedding_backward(ctx, &p, ptr(tmp[0]), ptr(tmp[1]));
  if (s == GDP_OK) {
    *dweight = tmp[1];
    tmp[1] = NULL;
  }
  free(ids);
  gdp_tensor_free(dev_ids);
  free(row_start);
  free(row_tokens);
  FREE_ALL(tmp);
  return s;
}

/* ------------------------------------------------------------------ cross-entropy */

static gdp_status report_bad_target(const gdp_index_check *c, int64_t i, int64_t v) {
  char at[288];
  return GDP_ERROR_IN(c->func, GDP_ERR_INVALID_ARG,
                      "targets: expected values in [0, %lld) (logits' last dim) or "
                      "ignore_index = %lld, got %lld at %s",
                      (long long)c->V, (long long)c->ignore_index, (long long)v,
                      check_position(at, sizeof at, c, i));
}

static gdp_status bad_target(const char *func, const gdp_tensor *targets, int64_t V,
                             int64_t ignore_index, int64_t v, int64_t i) {
  const gdp_index_check c = index_check(func, targets, V, ignore_index, report_bad_target);
  return c.report(&c, i, v);
}

/* Each row's class, or -1 where the row does not count (ignore_index, or mask zero);
 * *count the counted rows.  Targets that count must lie in [0, V). */
static gdp_status read_targets(const char *func, const gdp_tensor *targets,
                               const gdp_tensor *mask, int64_t V, int64_t ignore_index,
                               int64_t **out, int64_t *count) {
  int64_t n = 0;
  GDP_TRY(host_indices(func, targets, out, &n));
  double *m = NULL;
  if (mask) {
    m = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    gdp_status s = m ? gdp_tensor_to_host(mask, GDP_DTYPE_F64, m, (size_t)n * sizeof(double))
                     : GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for the mask");
    if (s != GDP_OK) {
      free(m);
      free(*out);
      *out = NULL;
      return s;
    }
  }
  *count = 0;
  for (int64_t i = 0; i < n; i++) {
    int64_t *t = &(*out)[i];
    if (*t == ignore_index || (m && m[i] == 0.0)) {
      *t = -1;
      continue;
    }
    if (*t < 0 || *t >= V) {
      const int64_t got = *t;
      free(m);
      free(*out);
      *out = NULL;
      return bad_target(func, targets, V, ignore_index, got, i);
    }
    (*count)++;
  }
  free(m);
  return GDP_OK;
}

gdp_status gdp_nn_cross_entropy_result(gdp_ctx *ctx, const gdp_tensor *logits,
                                       const gdp_tensor *targets, const gdp_tensor *mask,
                                       int64_t ignore_index, gdp_tensor **result,
                                       gdp_tensor **dlogits) {
  static const char *func = "gdp_nn_cross_entropy";
  char a[128];
  GDP_TRY(need_out(func, "result", result));
  *result = NULL;
  if (dlogits) *dlogits = NULL;
  NEED_OP(func, ctx, cross_entropy);
  GDP_TRY(need_tensor(func, "logits", logits));
  GDP_TRY(check_float_on(func, "logits", ctx, logits));
  GDP_TRY(check_index_tensor(func, "targets", ctx, targets));
  if (logits->ndim < 1 || logits->shape[logits->ndim - 1] < 1)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "logits: expected [..., V] with V >= 1 classes, got %s",
                        shape_of(a, sizeof a, logits));
  GDP_TRY(check_leading_shape(func, "targets", targets, "logits", logits));
  if (mask) {
    GDP_TRY(check_host_readable(func, "mask", ctx, mask));
    GDP_TRY(check_same_shape(func, "mask", mask, "targets", targets));
  }
  const int64_t V = logits->shape[logits->ndim - 1];
  int64_t *target = NULL;
  const gdp_index_check check = index_check(func, targets, V, ignore_index, report_bad_target);
  gdp_cross_entropy_problem p = {.rows = gdp_tensor_numel(targets), .V = V,
                                 .num_threads = ctx->num_threads, .dtype = logits->dtype};
  gdp_tensor *tmp[5] = {0}; /* logits, dlogits, device targets, device mask, result */
  gdp_status s = GDP_OK;
  if (ctx->backend->device_indices) {
    s = device_values(ctx, targets, targets->dtype, &tmp[2]);
    if (s == GDP_OK && mask) s = device_values(ctx, mask, GDP_DTYPE_F64, &tmp[3]);
    p.ids = ptr(tmp[2]), p.ids_dtype = targets->dtype, p.mask = (const double *)ptr(tmp[3]);
    p.ignore_index = ignore_index, p.check = &check;
  } else {
    s = read_targets(func, targets, mask, V, ignore_index, &target, &p.counted);
    p.target = target;
    p.scale = p.counted > 0 ? 1.0 / (double)p.counted : 0.0;
  }
  if (s == GDP_OK) s = load(ctx, logits, logits->dtype, &tmp[0]);
  if (s == GDP_OK) s = buffer_like(ctx, dlogits != NULL, logits->dtype, logits, &tmp[1]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, GDP_DTYPE_F64, 1, (const int64_t[]){2}, &tmp[4]);
  if (s == GDP_OK) s = ctx->backend->cross_entropy(ctx, &p, ptr(tmp[0]), ptr(tmp[4]), ptr(tmp[1]));
  if (s == GDP_OK) {
    *result = tmp[4];
    tmp[4] = NULL;
    if (dlogits) {
      *dlogits = tmp[1];
      tmp[1] = NULL;
    }
  }
  free(target);
  FREE_ALL(tmp);
  return s;
}

gdp_status gdp_nn_cross_entropy(gdp_ctx *ctx, const gdp_tensor *logits,
                                const gdp_tensor *targets, const gdp_tensor *mask,
                                int64_t ignore_index, double *loss, int64_t *count,
                                gdp_tensor **dlogits) {
  if (loss) *loss = 0.0;
  if (count) *count = 0;
  gdp_tensor *result = NULL;
  GDP_TRY(gdp_nn_cross_entropy_result(ctx, logits, targets, mask, ignore_index, &result, dlogits));
  double host[2] = {0.0, 0.0};
  gdp_status s = gdp_tensor_to_host(result, GDP_DTYPE_F64, host, sizeof host);
  gdp_tensor_free(result);
  if (s != GDP_OK) {
    if (dlogits) {
      gdp_tensor_free(*dlogits);
      *dlogits = NULL;
    }
    return s;
  }
  if (loss) *loss = host[0];
  if (count) *count = (int64_t)host[1];
  return GDP_OK;
}
