/*
 * op_helpers.h -- what the layer op files (op_mixer.c, op_nn.c) share between their
 * public entry points and the backend table: argument checks whose messages name the
 * argument, the expected and the actual value; contiguous compute-dtype copies of the
 * inputs (load) and delivery of results in the documented dtype (deliver); one cleanup
 * of every temporary (FREE_ALL).
 */
#ifndef GDP_OP_HELPERS_H
#define GDP_OP_HELPERS_H

#include <stddef.h>

#include "backend_impl.h"

/* ------------------------------------------------------------------ checks */

static inline const char *shape_of(char *buf, size_t len, const gdp_tensor *t) {
  return gdp_shape_str(buf, len, t->ndim, t->shape);
}

static inline gdp_status need_tensor(const char *func, const char *name, const gdp_tensor *t) {
  if (t) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected a tensor, got NULL", name);
}

/* t is read on the host, so it may live on the cpu, or on ctx's device. */
static inline gdp_status check_host_readable(const char *func, const char *name, const gdp_ctx *ctx,
                                             const gdp_tensor *t) {
  const gdp_ctx *tc = t->storage->ctx;
  if (tc->type == GDP_DEVICE_CPU || (tc->type == ctx->type && tc->index == ctx->index)) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected a tensor on cpu or on %s:%d (ctx), got %s:%d",
                      name, gdp_device_type_name(ctx->type), ctx->index, gdp_device_type_name(tc->type),
                      tc->index);
}

static inline gdp_status need_out(const char *func, const char *name, gdp_tensor **out) {
  if (out) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected an output pointer, got NULL",
                      name);
}

static inline int is_float(gdp_dtype d) { return d == GDP_DTYPE_F64 || d == GDP_DTYPE_F32; }

/* ctx is a context whose backend has the op: its table entry `entry` is not NULL. */
#define NEED_OP(func, ctx, entry)                                                          \
  do {                                                                                     \
    if (!(ctx))                                                                            \
      return GDP_ERROR_IN((func), GDP_ERR_INVALID_ARG, "ctx: expected a context, got NULL"); \
    if (!(ctx)->backend->entry) return GDP_NOT_IMPLEMENTED((func), (ctx));                  \
  } while (0)

/* t (may be NULL) lives on ctx's device and holds float64 or float32 values (or bf16,
 * where the backend's mixer kernels take it: backend_impl.h, mixer_bf16). */
static inline gdp_status check_float_on(const char *func, const char *name, const gdp_ctx *ctx,
                                 const gdp_tensor *t) {
  if (!t) return GDP_OK;
  const gdp_ctx *tc = t->storage->ctx;
  if (tc->type != ctx->type || tc->index != ctx->index)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "%s: expected a tensor on %s:%d (ctx), got %s:%d", name,
                        gdp_device_type_name(ctx->type), ctx->index,
                        gdp_device_type_name(tc->type), tc->index);
  if (t->dtype == GDP_DTYPE_BF16 && ctx->backend->mixer_bf16) return GDP_OK;
  if (!is_float(t->dtype))
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "%s: expected dtype f64 or f32%s, got %s", name,
                        t->dtype == GDP_DTYPE_BF16 ? " (bf16 mixer kernels: cuda only)" : "",
                        gdp_dtype_name(t->dtype));
  return GDP_OK;
}

/* t must have exactly the shape `want` (ndim dims), spelled `dims` in the message. */
static inline gdp_status check_shape(const char *func, const char *name, const gdp_tensor *t, int ndim,
                              const int64_t *want, const char *dims) {
  int same = t->ndim == ndim;
  for (int i = 0; same && i < ndim; i++) same = t->shape[i] == want[i];
  if (same) return GDP_OK;
  char a[128], b[128];
  return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "%s: expected %s = %s, got %s", name, dims,
                      gdp_shape_str(b, sizeof b, ndim, want), shape_of(a, sizeof a, t));
}

static inline gdp_status check_same_shape(const char *func, const char *name, const gdp_tensor *t,
                                   const char *ref_name, const gdp_tensor *ref) {
  if (!t) return GDP_OK;
  int same = t->ndim == ref->ndim;
  for (int i = 0; same && i < t->ndim; i++) same = t->shape[i] == ref->shape[i];
  if (same) return GDP_OK;
  char a[128], b[128];
  return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "%s: expected the shape of %s, %s, got %s", name,
                      ref_name, shape_of(b, sizeof b, ref), shape_of(a, sizeof a, t));
}

/* ------------------------------------------------------------------ buffers */

/* A contiguous tensor of `dtype` with t's values: a new reference to t itself when it
 * already is one (only ever read), else a copy.  NULL stays NULL. */
static inline gdp_status load(gdp_ctx *ctx, const gdp_tensor *t, gdp_dtype dtype, gdp_tensor **out) {
  *out = NULL;
  if (!t) return GDP_OK;
  if (t->dtype == dtype) return gdp_tensor_contiguous((gdp_tensor *)t, out);
  return gdp_tensor_to(ctx, t, dtype, out);
}

/* Hands *tmp to the caller as `dtype` (converting when needed); *tmp is consumed. */
static inline gdp_status deliver(gdp_ctx *ctx, gdp_tensor **tmp, gdp_dtype dtype, gdp_tensor **out) {
  gdp_status s = GDP_OK;
  if (!*tmp) return GDP_OK;
  if ((*tmp)->dtype == dtype) {
    *out = *tmp;
  } else {
    s = gdp_tensor_to(ctx, *tmp, dtype, out);
    gdp_tensor_free(*tmp);
  }
  *tmp = NULL;
  return s;
}

static inline void *ptr(const gdp_tensor *t) { return t ? gdp_tensor_data(t) : NULL; }

static inline void free_all(gdp_tensor **ts, size_t n) {
  for (size_t i = 0; i < n; i++) {
    gdp_tensor_free(ts[i]);
    ts[i] = NULL;
  }
}
#define FREE_ALL(arr) free_all((arr), sizeof(arr) / sizeof((arr)[0]))

/* A new contiguous buffer of `dtype` shaped like `like` (NULL when not wanted). */
static inline gdp_status buffer_like(gdp_ctx *ctx, int wanted, gdp_dtype dtype, const gdp_tensor *like,
                              gdp_tensor **out) {
  *out = NULL;
  if (!wanted) return GDP_OK;
  return gdp_tensor_empty(ctx, dtype, like->ndim, like->shape, out);
}

static inline void clear_outs(gdp_tensor **a, gdp_tensor **b, gdp_tensor **c, gdp_tensor **d) {
  if (a) *a = NULL;
  if (b) *b = NULL;
  if (c) *c = NULL;
  if (d) *d = NULL;
}

#endif /* GDP_OP_HELPERS_H */
