/*
 * tensor.c -- tensors: refcounted storage, construction, queries, views, copies
 * between dtypes and devices, single-element access.
 *
 * Ownership: a tensor holds one reference to its storage, a storage one reference
 * to the context that allocated it, so that tensors, views and contexts can be
 * freed in any order; memory goes back through the backend that gave it.
 *
 * Host-side helpers wrap caller memory in stack-allocated tensor headers (never
 * reference counted past their scope) so that every dtype conversion and strided
 * walk goes through the one implementation in the CPU backend.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_impl.h"

/* ------------------------------------------------------------------ helpers */

static int same_device(const gdp_ctx *a, const gdp_ctx *b) {
  return a->type == b->type && a->index == b->index;
}

static gdp_ctx *tensor_ctx(const gdp_tensor *t) { return t->storage->ctx; }

static int64_t numel_of(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

static void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    stride[i] = s;
    s *= shape[i] > 1 ? shape[i] : 1;
  }
}

static const char *strides_str(char *buf, size_t len, int ndim, const int64_t *stride) {
  size_t used = 0;
  int n = snprintf(buf, len, "(");
  used = n > 0 ? (size_t)n : 0;
  for (int i = 0; i < ndim && used < len; i++) {
    n = snprintf(buf + used, len - used, i ? ", %" PRId64 : "%" PRId64, stride[i]);
    if (n < 0) break;
    used += (size_t)n;
  }
  if (used < len) snprintf(buf + used, len - used, ")");
  return buf;
}

#define SHAPE_STR(buf, t) gdp_shape_str((buf), sizeof(buf), (t)->ndim, (t)->shape)

/* Checks ndim and sizes, and that numel * element size fits in int64. */
static gdp_status check_shape(const char *func, int ndim, const int64_t *shape,
                              gdp_dtype dtype) {
  if (ndim < 0 || ndim > GDP_MAX_DIMS)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "ndim: expected 0..%d, got %d", GDP_MAX_DIMS, ndim);
  if (ndim > 0 && !shape) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "shape is NULL");
  int64_t limit = INT64_MAX / (int64_t)(gdp_dtype_size(dtype) ? gdp_dtype_size(dtype) : 1);
  /* the product of the sizes with 0 counted as 1: an empty tensor's row-major strides
   * (contiguous_strides) must fit as well */
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0) {
      char sb[160];
      return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "shape %s: size of dim %d must be >= 0, got %" PRId64,
                          gdp_shape_str(sb, sizeof sb, ndim, shape), i, shape[i]);
    }
    if (shape[i] > 1 && n > limit / shape[i]) {
      char sb[160];
      return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "shape %s: too many elements for int64 bytes",
                          gdp_shape_str(sb, sizeof sb, ndim, shape));
    }
    if (shape[i] > 1) n *= shape[i];
  }
  return GDP_OK;
}

static gdp_status check_dtype(const char *func, const char *arg, gdp_dtype dtype) {
  if ((int)dtype < 0 || dtype >= GDP_DTYPE_COUNT)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "%s: expected a gdp_dtype 0..%d, got %d", arg,
                        GDP_DTYPE_COUNT - 1, (int)dtype);
  return GDP_OK;
}

/* Normalises a possibly negative dim of a tensor with ndim dims. */
static gdp_status norm_dim(const char *func, const char *arg, int dim, const gdp_tensor *t,
                           int *out) {
  int nd = t->ndim;
  if (dim < -nd || dim >= nd) {
    char sb[160];
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "%s: expected -%d <= %s < %d for a %d-dim tensor %s, got %d", arg, nd, arg,
                        nd, nd, SHAPE_STR(sb, t), dim);
  }
  *out = dim < 0 ? dim + nd : dim;
  return GDP_OK;
}

/* Stack-only tensor header over memory not owned by the library (never freed). */
static void wrap_memory(gdp_tensor *t, gdp_storage *s, gdp_ctx *ctx, gdp_dtype dtype, int ndim,
                        const int64_t *shape, void *data) {
  memset(s, 0, sizeof *s);
  atomic_init(&s->refcount, 1);
  atomic_init(&s->version, 0);
  s->ctx = ctx;
  s->data = data;
  s->nbytes = (size_t)numel_of(ndim, shape) * gdp_dtype_size(dtype);
  memset(t, 0, sizeof *t);
  atomic_init(&t->refcount, 1);
  t->storage = s;
  t->dtype = dtype;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  contiguous_strides(ndim, shape, t->stride);
  t->offset = 0;
}

/* A stack CPU context for converting single elements on the host (get/set of
 * device tensors have no CPU context at hand). */
static void host_ctx(gdp_ctx *c) {
  memset(c, 0, sizeof *c);
  atomic_init(&c->refcount, 1);
  c->type = GDP_DEVICE_CPU;
  c->backend = &gdp_backend_cpu;
  c->num_threads = 1;
}

/* ------------------------------------------------------------------ storage */

static gdp_status storage_new(const char *func, gdp_ctx *ctx, size_t nbytes, gdp_storage **out) {
  gdp_storage *s = calloc(1, sizeof *s);
  if (!s) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate a storage header");
  void *data = NULL;
  gdp_status st = ctx->backend->alloc(ctx, nbytes, &data);
  if (st != GDP_OK) {
    free(s);
    return st;
  }
  atomic_init(&s->refcount, 1);
  atomic_init(&s->version, 0);
  s->ctx = gdp_ctx_retain(ctx);
  s->data = data;
  s->nbytes = nbytes;
  *out = s;
  return GDP_OK;
}

static void storage_release(gdp_storage *s) {
  if (atomic_fetch_sub_explicit(&s->refcount, 1, memory_order_acq_rel) != 1) return;
  gdp_ctx *ctx = s->ctx;
  ctx->backend->release(ctx, s->data, s->nbytes);
  gdp_ctx_free(ctx);
  free(s);
}

/* ------------------------------------------------------------------ construction */

/* New contiguous tensor; shape and dtype already validated. */
static gdp_status tensor_new(const char *func, gdp_ctx *ctx, gdp_dtype dtype, int ndim,
                             const int64_t *shape, gdp_tensor **out) {
  gdp_tensor *t = calloc(1, sizeof *t);
  if (!t) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate a tensor header");
  size_t nbytes = (size_t)numel_of(ndim, shape) * gdp_dtype_size(dtype);
  gdp_status st = storage_new(func, ctx, nbytes, &t->storage);
  if (st != GDP_OK) {
    free(t);
    return st;
  }
  atomic_init(&t->refcount, 1);
  t->dtype = dtype;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  contiguous_strides(ndim, shape, t->stride);
  t->offset = 0;
  t->is_view = 0;
  *out = t;
  return GDP_OK;
}

static gdp_status check_new_args(const char *func, gdp_ctx *ctx, gdp_dtype dtype, int ndim,
                                 const int64_t *shape, gdp_tensor **out) {
  if (!out) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  if (!ctx) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "ctx is NULL");
  GDP_TRY(check_dtype(func, "dtype", dtype));
  return check_shape(func, ndim, shape, dtype);
}

gdp_status gdp_tensor_empty(gdp_ctx *ctx, gdp_dtype dtype, int ndim, const int64_t *shape,
                            gdp_tensor **out) {
  GDP_TRY(check_new_args(__func__, ctx, dtype, ndim, shape, out));
  return tensor_new(__func__, ctx, dtype, ndim, shape, out);
}

gdp_status gdp_tensor_zeros(gdp_ctx *ctx, gdp_dtype dtype, int ndim, const int64_t *shape,
                            gdp_tensor **out) {
  GDP_TRY(check_new_args(__func__, ctx, dtype, ndim, shape, out));
  gdp_tensor *t = NULL;
  GDP_TRY(tensor_new(__func__, ctx, dtype, ndim, shape, &t));
  gdp_status st = ctx->backend->fill(ctx, t, 0.0);
  if (st != GDP_OK) {
    gdp_tensor_free(t);
    return st;
  }
  *out = t;
  return GDP_OK;
}

gdp_status gdp_tensor_from_host(gdp_ctx *ctx, gdp_dtype dtype, int ndim, const int64_t *shape,
                                gdp_dtype src_dtype, const void *src, size_t nbytes,
                                gdp_tensor **out) {
  GDP_TRY(check_new_args(__func__, ctx, dtype, ndim, shape, out));
  GDP_TRY(check_dtype(__func__, "src_dtype", src_dtype));
  int64_t n = numel_of(ndim, shape);
  size_t want = (size_t)n * gdp_dtype_size(src_dtype);
  if (nbytes != want) {
    char sb[160];
    return GDP_ERROR(GDP_ERR_INVALID_ARG,
                     "nbytes: expected %zu (%" PRId64 " elements of %s for shape %s), got %zu",
                     want, n, gdp_dtype_name(src_dtype), gdp_shape_str(sb, sizeof sb, ndim, shape),
                     nbytes);
  }
  if (n > 0 && !src) return GDP_ERROR(GDP_ERR_INVALID_ARG, "src is NULL for %" PRId64 " elements", n);
  gdp_tensor *t = NULL;
  GDP_TRY(tensor_new(__func__, ctx, dtype, ndim, shape, &t));
  gdp_status st = GDP_OK;
  if (n > 0) {
    if (ctx->type == GDP_DEVICE_CPU) {
      gdp_tensor w;
      gdp_storage ws;
      wrap_memory(&w, &ws, ctx, src_dtype, ndim, shape, (void *)src);
      st = ctx->backend->copy(ctx, t, &w);
    } else if (dtype == src_dtype) {
      st = ctx->backend->to_device(ctx, gdp_tensor_ptr(t), src, nbytes);
    } else {
      /* upload as is, convert on the device */
      gdp_tensor *tmp = NULL;
      st = tensor_new(__func__, ctx, src_dtype, ndim, shape, &tmp);
      if (st == GDP_OK) st = ctx->backend->to_device(ctx, gdp_tensor_ptr(tmp), src, nbytes);
      if (st == GDP_OK) st = ctx->backend->copy(ctx, t, tmp);
      gdp_tensor_free(tmp);
    }
  }
  if (st != GDP_OK) {
    gdp_tensor_free(t);
    return st;
  }
  *out = t;
  return GDP_OK;
}

gdp_tensor *gdp_tensor_retain(gdp_tensor *t) {
  if (t) atomic_fetch_add_explicit(&t->refcount, 1, memory_order_relaxed);
  return t;
}

void gdp_tensor_free(gdp_tensor *t) {
  if (!t) return;
  if (atomic_fetch_sub_explicit(&t->refcount, 1, memory_order_acq_rel) != 1) return;
  storage_release(t->storage);
  free(t);
}

/* ------------------------------------------------------------------ queries */

int gdp_tensor_ndim(const gdp_tensor *t) { return t ? t->ndim : -1; }

int64_t gdp_tensor_size(const gdp_tensor *t, int dim) {
  if (!t || dim < -t->ndim || dim >= t->ndim) return -1;
  return t->shape[dim < 0 ? dim + t->ndim : dim];
}

int64_t gdp_tensor_stride(const gdp_tensor *t, int dim) {
  if (!t || dim < -t->ndim || dim >= t->ndim) return -1;
  return t->stride[dim < 0 ? dim + t->ndim : dim];
}

int64_t gdp_tensor_numel(const gdp_tensor *t) { return t ? numel_of(t->ndim, t->shape) : 0; }

int64_t gdp_tensor_offset(const gdp_tensor *t) { return t ? t->offset : 0; }

gdp_dtype gdp_tensor_dtype(const gdp_tensor *t) { return t ? t->dtype : GDP_DTYPE_COUNT; }

gdp_device_type gdp_tensor_device_type(const gdp_tensor *t) {
  return t ? tensor_ctx(t)->type : GDP_DEVICE_TYPE_COUNT;
}

int gdp_tensor_device_index(const gdp_tensor *t) { return t ? tensor_ctx(t)->index : -1; }

gdp_ctx *gdp_tensor_ctx(const gdp_tensor *t) { return t ? tensor_ctx(t) : NULL; }

/* torch's rule: sizes of 1 place no constraint on their stride; empty is contiguous. */
int gdp_tensor_is_contiguous(const gdp_tensor *t) {
  if (!t) return 0;
  if (numel_of(t->ndim, t->shape) == 0) return 1;
  int64_t expected = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] == 1) continue;
    if (t->stride[d] != expected) return 0;
    expected *= t->shape[d];
  }
  return 1;
}

int gdp_tensor_is_view(const gdp_tensor *t) { return t ? t->is_view : 0; }

uint64_t gdp_tensor_version(const gdp_tensor *t) {
  return t ? atomic_load_explicit(&t->storage->version, memory_order_relaxed) : 0;
}

void *gdp_tensor_data(const gdp_tensor *t) {
  if (!t || !t->storage->data) return NULL;
  return gdp_tensor_ptr(t);
}

/* ------------------------------------------------------------------ views */

static gdp_status make_view(const char *func, gdp_tensor *t, int ndim, const int64_t *shape,
                            const int64_t *stride, int64_t offset, gdp_tensor **out) {
  gdp_tensor *v = calloc(1, sizeof *v);
  if (!v) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate a tensor header");
  atomic_init(&v->refcount, 1);
  atomic_fetch_add_explicit(&t->storage->refcount, 1, memory_order_relaxed);
  v->storage = t->storage;
  v->dtype = t->dtype;
  v->ndim = ndim;
  for (int i = 0; i < ndim; i++) {
    v->shape[i] = shape[i];
    v->stride[i] = stride[i];
  }
  v->offset = offset;
  v->is_view = 1;
  *out = v;
  return GDP_OK;
}

static gdp_status check_view_args(const char *func, const gdp_tensor *t, gdp_tensor **out) {
  if (!out) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  if (!t) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "t is NULL");
  return GDP_OK;
}

/* Resolves one -1 in `shape` against numel; writes the full shape to `resolved`. */
static gdp_status infer_shape(const char *func, const gdp_tensor *t, int ndim,
                              const int64_t *shape, int64_t *resolved) {
  char sb[160], tb[160];
  if (ndim < 0 || ndim > GDP_MAX_DIMS)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "ndim: expected 0..%d, got %d", GDP_MAX_DIMS, ndim);
  if (ndim > 0 && !shape) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "shape is NULL");
  int infer = -1;
  int64_t known = 1, span = 1; /* span: product with 0 counted as 1 (for the strides) */
  for (int i = 0; i < ndim; i++) {
    if (shape[i] == -1) {
      if (infer >= 0)
        return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "shape %s: only one size may be -1, got dims %d and %d",
                            gdp_shape_str(sb, sizeof sb, ndim, shape), infer, i);
      infer = i;
    } else if (shape[i] < 0) {
      return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "shape %s: size of dim %d must be >= 0 or -1, got %" PRId64,
                          gdp_shape_str(sb, sizeof sb, ndim, shape), i, shape[i]);
    } else {
      /* a wrapped product could match numel and pass sizes the storage cannot hold */
      if (shape[i] > 1 && span > INT64_MAX / shape[i])
        return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "shape %s: the product of the sizes overflows int64",
                            gdp_shape_str(sb, sizeof sb, ndim, shape));
      if (shape[i] > 1) span *= shape[i];
      known *= shape[i];
    }
    resolved[i] = shape[i];
  }
  int64_t n = numel_of(t->ndim, t->shape);
  if (infer >= 0) {
    if (known == 0 || n % known != 0)
      return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "shape %s is invalid for tensor %s of %" PRId64 " elements",
                          gdp_shape_str(sb, sizeof sb, ndim, shape), SHAPE_STR(tb, t), n);
    resolved[infer] = n / known;
  } else if (known != n) {
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "shape %s has %" PRId64 " elements, tensor %s has %" PRId64,
                        gdp_shape_str(sb, sizeof sb, ndim, shape), known, SHAPE_STR(tb, t), n);
  }
  return GDP_OK;
}

/* torch's computeStride: walks the old dims from the back in chunks of memory-
 * contiguous dims; each chunk must be tiled exactly by consecutive new dims.
 * Returns 0 when the strides cannot express the new shape. */
static int view_strides(int old_nd, const int64_t *old_shape, const int64_t *old_stride,
                        int new_nd, const int64_t *new_shape, int64_t *new_stride) {
  int64_t one_shape = 1, one_stride = 1;
  if (old_nd == 0) { /* a scalar behaves like [1] */
    old_nd = 1;
    old_shape = &one_shape;
    old_stride = &one_stride;
  }
  int64_t numel = numel_of(old_nd, old_shape);
  if (numel == 0) {
    int same = old_nd == new_nd;
    for (int i = 0; same && i < new_nd; i++) same = old_shape[i] == new_shape[i];
    if (same) {
      for (int i = 0; i < new_nd; i++) new_stride[i] = old_stride[i];
    } else {
      contiguous_strides(new_nd, new_shape, new_stride);
    }
    return 1;
  }
  int view_d = new_nd - 1;
  int64_t chunk_base_stride = old_stride[old_nd - 1];
  int64_t tensor_numel = 1, view_numel = 1;
  for (int tensor_d = old_nd - 1; tensor_d >= 0; tensor_d--) {
    tensor_numel *= old_shape[tensor_d];
    if (tensor_d == 0 || (old_shape[tensor_d - 1] != 1 &&
                          old_stride[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        new_stride[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_shape[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return 0;
      if (tensor_d > 0) {
        chunk_base_stride = old_stride[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

gdp_status gdp_tensor_view(gdp_tensor *t, int ndim, const int64_t *shape, gdp_tensor **out) {
  GDP_TRY(check_view_args(__func__, t, out));
  int64_t resolved[GDP_MAX_DIMS], stride[GDP_MAX_DIMS];
  GDP_TRY(infer_shape(__func__, t, ndim, shape, resolved));
  if (!view_strides(t->ndim, t->shape, t->stride, ndim, resolved, stride)) {
    char sb[160], tb[160], rb[160];
    return GDP_ERROR(GDP_ERR_SHAPE,
                     "tensor %s with strides %s cannot be viewed as %s without a copy "
                     "(use gdp_tensor_reshape)",
                     SHAPE_STR(tb, t), strides_str(rb, sizeof rb, t->ndim, t->stride),
                     gdp_shape_str(sb, sizeof sb, ndim, resolved));
  }
  return make_view(__func__, t, ndim, resolved, stride, t->offset, out);
}

gdp_status gdp_tensor_reshape(gdp_tensor *t, int ndim, const int64_t *shape, gdp_tensor **out) {
  GDP_TRY(check_view_args(__func__, t, out));
  int64_t resolved[GDP_MAX_DIMS], stride[GDP_MAX_DIMS];
  GDP_TRY(infer_shape(__func__, t, ndim, shape, resolved));
  if (view_strides(t->ndim, t->shape, t->stride, ndim, resolved, stride))
    return make_view(__func__, t, ndim, resolved, stride, t->offset, out);
  /* Copy into a fresh tensor of the new shape, seen through a header of t's shape
   * (both contiguous, so the element orders agree). */
  gdp_ctx *ctx = tensor_ctx(t);
  gdp_tensor *c = NULL;
  GDP_TRY(tensor_new(__func__, ctx, t->dtype, ndim, resolved, &c));
  gdp_tensor alias = *c;
  atomic_init(&alias.refcount, 1);
  alias.ndim = t->ndim;
  for (int i = 0; i < t->ndim; i++) alias.shape[i] = t->shape[i];
  contiguous_strides(t->ndim, t->shape, alias.stride);
  gdp_status st = ctx->backend->copy(ctx, &alias, t);
  if (st != GDP_OK) {
    gdp_tensor_free(c);
    return st;
  }
  *out = c;
  return GDP_OK;
}

gdp_status gdp_tensor_narrow(gdp_tensor *t, int dim, int64_t start, int64_t length,
                             gdp_tensor **out) {
  GDP_TRY(check_view_args(__func__, t, out));
  int d = 0;
  GDP_TRY(norm_dim(__func__, "dim", dim, t, &d));
  char tb[160];
  int64_t size = t->shape[d];
  if (length < 0)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "length must be >= 0 for dim %d of %s, got %" PRId64,
                     d, SHAPE_STR(tb, t), length);
  if (start < 0 || start > size || length > size - start)
    return GDP_ERROR(GDP_ERR_INVALID_ARG,
                     "start + length out of range for dim %d of %s: start %" PRId64
                     ", length %" PRId64,
                     d, SHAPE_STR(tb, t), start, length);
  int64_t shape[GDP_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) shape[i] = t->shape[i];
  shape[d] = length;
  /* an empty result keeps the base offset: start may equal size */
  int64_t offset = t->offset + (length > 0 ? start * t->stride[d] : 0);
  return make_view(__func__, t, t->ndim, shape, t->stride, offset, out);
}

gdp_status gdp_tensor_select(gdp_tensor *t, int dim, int64_t index, gdp_tensor **out) {
  GDP_TRY(check_view_args(__func__, t, out));
  int d = 0;
  GDP_TRY(norm_dim(__func__, "dim", dim, t, &d));
  int64_t size = t->shape[d];
  if (index < -size || index >= size) {
    char tb[160];
    return GDP_ERROR(GDP_ERR_INVALID_ARG,
                     "index: expected -%" PRId64 " <= index < %" PRId64 " for dim %d of %s, got %" PRId64,
                     size, size, d, SHAPE_STR(tb, t), index);
  }
  if (index < 0) index += size;
  int64_t shape[GDP_MAX_DIMS], stride[GDP_MAX_DIMS];
  int nd = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (i == d) continue;
    shape[nd] = t->shape[i];
    stride[nd] = t->stride[i];
    nd++;
  }
  return make_view(__func__, t, nd, shape, stride, t->offset + index * t->stride[d], out);
}

gdp_status gdp_tensor_transpose(gdp_tensor *t, int dim0, int dim1, gdp_tensor **out) {
  GDP_TRY(check_view_args(__func__, t, out));
  int d0 = 0, d1 = 0;
  GDP_TRY(norm_dim(__func__, "dim0", dim0, t, &d0));
  GDP_TRY(norm_dim(__func__, "dim1", dim1, t, &d1));
  int64_t shape[GDP_MAX_DIMS], stride[GDP_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) {
    shape[i] = t->shape[i];
    stride[i] = t->stride[i];
  }
  shape[d0] = t->shape[d1];
  stride[d0] = t->stride[d1];
  shape[d1] = t->shape[d0];
  stride[d1] = t->stride[d0];
  return make_view(__func__, t, t->ndim, shape, stride, t->offset, out);
}

gdp_status gdp_tensor_permute(gdp_tensor *t, int ndim, const int *perm, gdp_tensor **out) {
  GDP_TRY(check_view_args(__func__, t, out));
  char tb[160];
  if (ndim != t->ndim)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "ndim: expected %d (the dims of %s), got %d", t->ndim,
                     SHAPE_STR(tb, t), ndim);
  if (ndim > 0 && !perm) return GDP_ERROR(GDP_ERR_INVALID_ARG, "perm is NULL");
  int seen[GDP_MAX_DIMS] = {0};
  int64_t shape[GDP_MAX_DIMS], stride[GDP_MAX_DIMS];
  for (int i = 0; i < ndim; i++) {
    int d = 0;
    if (perm[i] < -ndim || perm[i] >= ndim)
      return GDP_ERROR(GDP_ERR_INVALID_ARG, "perm[%d]: expected -%d <= perm[%d] < %d for %s, got %d",
                       i, ndim, i, ndim, SHAPE_STR(tb, t), perm[i]);
    d = perm[i] < 0 ? perm[i] + ndim : perm[i];
    if (seen[d])
      return GDP_ERROR(GDP_ERR_INVALID_ARG,
                       "perm is not a permutation of 0..%d: dim %d appears twice (at perm[%d])",
                       ndim - 1, d, i);
    seen[d] = 1;
    shape[i] = t->shape[d];
    stride[i] = t->stride[d];
  }
  return make_view(__func__, t, ndim, shape, stride, t->offset, out);
}

/* A new contiguous tensor of `dtype` on ctx (same device as t) holding t's values. */
static gdp_status copy_same_device(const char *func, gdp_ctx *ctx, const gdp_tensor *t,
                                   gdp_dtype dtype, gdp_tensor **out) {
  gdp_tensor *c = NULL;
  GDP_TRY(tensor_new(func, ctx, dtype, t->ndim, t->shape, &c));
  gdp_status st = numel_of(t->ndim, t->shape) ? ctx->backend->copy(ctx, c, t) : GDP_OK;
  if (st != GDP_OK) {
    gdp_tensor_free(c);
    return st;
  }
  *out = c;
  return GDP_OK;
}

gdp_status gdp_tensor_contiguous(gdp_tensor *t, gdp_tensor **out) {
  GDP_TRY(check_view_args(__func__, t, out));
  if (gdp_tensor_is_contiguous(t)) {
    *out = gdp_tensor_retain(t);
    return GDP_OK;
  }
  return copy_same_device(__func__, tensor_ctx(t), t, t->dtype, out);
}

gdp_status gdp_tensor_clone(gdp_tensor *t, gdp_tensor **out) {
  GDP_TRY(check_view_args(__func__, t, out));
  return copy_same_device(__func__, tensor_ctx(t), t, t->dtype, out);
}

/* ------------------------------------------------------------------ copies */

int gdp_tensor_partial_overlap(const gdp_tensor *a, const gdp_tensor *b) {
  if (a->storage != b->storage) return 0;
  int64_t na = numel_of(a->ndim, a->shape), nb = numel_of(b->ndim, b->shape);
  if (na == 0 || nb == 0) return 0;
  int same = a->dtype == b->dtype && a->offset == b->offset && a->ndim == b->ndim;
  for (int d = 0; same && d < a->ndim; d++)
    same = a->shape[d] == b->shape[d] && (a->shape[d] == 1 || a->stride[d] == b->stride[d]);
  if (same) return 0;
  /* byte ranges touched (strides are >= 0); conservative for interleaved views */
  int64_t alo = a->offset, ahi = a->offset, blo = b->offset, bhi = b->offset;
  for (int d = 0; d < a->ndim; d++) ahi += (a->shape[d] - 1) * a->stride[d];
  for (int d = 0; d < b->ndim; d++) bhi += (b->shape[d] - 1) * b->stride[d];
  size_t ea = gdp_dtype_size(a->dtype), eb = gdp_dtype_size(b->dtype);
  return (size_t)alo * ea < (size_t)(bhi + 1) * eb && (size_t)blo * eb < (size_t)(ahi + 1) * ea;
}

static gdp_status check_same_shape(const char *func, const char *an, const gdp_tensor *a,
                                   const char *bn, const gdp_tensor *b) {
  int same = a->ndim == b->ndim;
  for (int i = 0; same && i < a->ndim; i++) same = a->shape[i] == b->shape[i];
  if (!same) {
    char ab[160], bb[160];
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "%s and %s must have the same shape, got %s and %s", an,
                        bn, SHAPE_STR(ab, a), SHAPE_STR(bb, b));
  }
  return GDP_OK;
}

/* Copy between devices through a contiguous host buffer of src's dtype. */
static gdp_status copy_cross_device(gdp_ctx *dctx, gdp_tensor *dst, gdp_ctx *sctx,
                                    const gdp_tensor *src) {
  const char *func = "gdp_tensor_copy";
  int64_t n = numel_of(src->ndim, src->shape);
  size_t bytes = (size_t)n * gdp_dtype_size(src->dtype);
  void *host = NULL;  /* contiguous src values on the host */
  void *owned = NULL; /* the staging buffer, when host is not src's own memory */
  gdp_tensor hw;
  gdp_storage hs;
  gdp_status st = GDP_OK;

  /* 1. src -> host (contiguous, src dtype) */
  if (sctx->type == GDP_DEVICE_CPU && gdp_tensor_is_contiguous(src)) {
    host = gdp_tensor_ptr(src); /* read in place */
  } else {
    void *buf = malloc(bytes ? bytes : 1);
    if (!buf) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate a %zu-byte host staging buffer", bytes);
    if (sctx->type == GDP_DEVICE_CPU) {
      wrap_memory(&hw, &hs, sctx, src->dtype, src->ndim, src->shape, buf);
      st = sctx->backend->copy(sctx, &hw, src);
    } else if (gdp_tensor_is_contiguous(src)) {
      st = sctx->backend->to_host(sctx, buf, gdp_tensor_ptr(src), bytes);
    } else {
      gdp_tensor *c = NULL;
      st = copy_same_device(func, sctx, src, src->dtype, &c);
      if (st == GDP_OK) st = sctx->backend->to_host(sctx, buf, gdp_tensor_ptr(c), bytes);
      gdp_tensor_free(c);
    }
    if (st != GDP_OK) {
      free(buf);
      return st;
    }
    host = owned = buf;
  }

  /* 2. host -> dst (converting to dst's dtype and strides) */
  if (dctx->type == GDP_DEVICE_CPU) {
    wrap_memory(&hw, &hs, dctx, src->dtype, src->ndim, src->shape, host);
    st = dctx->backend->copy(dctx, dst, &hw);
  } else if (dst->dtype == src->dtype && gdp_tensor_is_contiguous(dst)) {
    st = dctx->backend->to_device(dctx, gdp_tensor_ptr(dst), host, bytes);
  } else {
    gdp_tensor *tmp = NULL;
    st = tensor_new(func, dctx, src->dtype, src->ndim, src->shape, &tmp);
    if (st == GDP_OK) st = dctx->backend->to_device(dctx, gdp_tensor_ptr(tmp), host, bytes);
    if (st == GDP_OK) st = dctx->backend->copy(dctx, dst, tmp);
    gdp_tensor_free(tmp);
  }
  free(owned);
  return st;
}

/* gdp_tensor_copy; mark: 0 when dst was made by the caller just now (gdp_tensor_to),
 * whose version stays 0. */
static gdp_status tensor_copy(gdp_ctx *ctx, gdp_tensor *dst, const gdp_tensor *src, int mark) {
  if (!dst) return GDP_ERROR(GDP_ERR_INVALID_ARG, "dst is NULL");
  if (!src) return GDP_ERROR(GDP_ERR_INVALID_ARG, "src is NULL");
  GDP_TRY(check_same_shape(__func__, "dst", dst, "src", src));
  gdp_ctx *dctx = tensor_ctx(dst), *sctx = tensor_ctx(src);
  if (ctx && !same_device(ctx, dctx) && !same_device(ctx, sctx))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "ctx is on %s:%d, but dst is on %s:%d and src on %s:%d",
                     gdp_device_type_name(ctx->type), ctx->index, gdp_device_type_name(dctx->type),
                     dctx->index, gdp_device_type_name(sctx->type), sctx->index);
  if (numel_of(dst->ndim, dst->shape) == 0) return GDP_OK;
  if (mark) gdp_tensor_mark_written(dst);
  /* the caller's context (its stream) does the work on its own device */
  gdp_ctx *dwork = ctx && same_device(ctx, dctx) ? ctx : dctx;
  gdp_ctx *swork = ctx && same_device(ctx, sctx) ? ctx : sctx;
  if (same_device(dctx, sctx)) {
    if (!gdp_tensor_partial_overlap(dst, src)) return dwork->backend->copy(dwork, dst, src);
    /* strided copies walk element by element (in parallel): read src out first */
    gdp_tensor *staged = NULL;
    GDP_TRY(copy_same_device(__func__, swork, src, src->dtype, &staged));
    gdp_status st = dwork->backend->copy(dwork, dst, staged);
    gdp_tensor_free(staged);
    return st;
  }
  return copy_cross_device(dwork, dst, swork, src);
}

gdp_status gdp_tensor_copy(gdp_ctx *ctx, gdp_tensor *dst, const gdp_tensor *src) {
  return tensor_copy(ctx, dst, src, 1);
}

gdp_status gdp_tensor_to(gdp_ctx *ctx, const gdp_tensor *t, gdp_dtype dtype, gdp_tensor **out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  if (!t) return GDP_ERROR(GDP_ERR_INVALID_ARG, "t is NULL");
  GDP_TRY(check_dtype(__func__, "dtype", dtype));
  if (!ctx) ctx = tensor_ctx(t);
  gdp_tensor *c = NULL;
  GDP_TRY(tensor_new(__func__, ctx, dtype, t->ndim, t->shape, &c));
  gdp_status st = tensor_copy(ctx, c, t, 0);
  if (st != GDP_OK) {
    gdp_tensor_free(c);
    return st;
  }
  *out = c;
  return GDP_OK;
}

gdp_status gdp_tensor_to_host(const gdp_tensor *t, gdp_dtype dst_dtype, void *dst,
                              size_t dst_bytes) {
  if (!t) return GDP_ERROR(GDP_ERR_INVALID_ARG, "t is NULL");
  GDP_TRY(check_dtype(__func__, "dst_dtype", dst_dtype));
  int64_t n = numel_of(t->ndim, t->shape);
  size_t want = (size_t)n * gdp_dtype_size(dst_dtype);
  if (dst_bytes != want) {
    char tb[160];
    return GDP_ERROR(GDP_ERR_INVALID_ARG,
                     "dst_bytes: expected %zu (%" PRId64 " elements of %s for %s), got %zu", want,
                     n, gdp_dtype_name(dst_dtype), SHAPE_STR(tb, t), dst_bytes);
  }
  if (n == 0) return GDP_OK;
  if (!dst) return GDP_ERROR(GDP_ERR_INVALID_ARG, "dst is NULL for %" PRId64 " elements", n);
  gdp_ctx *ctx = tensor_ctx(t);
  if (ctx->type == GDP_DEVICE_CPU) {
    gdp_tensor w;
    gdp_storage ws;
    wrap_memory(&w, &ws, ctx, dst_dtype, t->ndim, t->shape, dst);
    return ctx->backend->copy(ctx, &w, t);
  }
  if (dst_dtype == t->dtype && gdp_tensor_is_contiguous(t))
    return ctx->backend->to_host(ctx, dst, gdp_tensor_ptr(t), want);
  /* convert and compact on the device, then one transfer */
  gdp_tensor *c = NULL;
  GDP_TRY(copy_same_device(__func__, ctx, t, dst_dtype, &c));
  gdp_status st = ctx->backend->to_host(ctx, dst, gdp_tensor_ptr(c), want);
  gdp_tensor_free(c);
  return st;
}

gdp_status gdp_tensor_fill(gdp_tensor *t, double value) {
  if (!t) return GDP_ERROR(GDP_ERR_INVALID_ARG, "t is NULL");
  if (numel_of(t->ndim, t->shape) == 0) return GDP_OK;
  gdp_ctx *ctx = tensor_ctx(t);
  gdp_tensor_mark_written(t);
  return ctx->backend->fill(ctx, t, value);
}

/* Element offset (in elements, within the storage) of idx; validates idx. */
static gdp_status element_offset(const char *func, const gdp_tensor *t, const int64_t *idx,
                                 int64_t *out) {
  if (t->ndim > 0 && !idx) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "idx is NULL");
  int64_t off = t->offset;
  for (int d = 0; d < t->ndim; d++) {
    int64_t i = idx[d];
    if (i < -t->shape[d] || i >= t->shape[d]) {
      char tb[160];
      return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                          "idx[%d]: expected -%" PRId64 " <= idx < %" PRId64 " for dim %d of %s, got %" PRId64,
                          d, t->shape[d], t->shape[d], d, SHAPE_STR(tb, t), i);
    }
    if (i < 0) i += t->shape[d];
    off += i * t->stride[d];
  }
  *out = off;
  return GDP_OK;
}

gdp_status gdp_tensor_get(const gdp_tensor *t, const int64_t *idx, double *out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out is NULL");
  if (!t) return GDP_ERROR(GDP_ERR_INVALID_ARG, "t is NULL");
  int64_t off;
  GDP_TRY(element_offset(__func__, t, idx, &off));
  gdp_ctx *ctx = tensor_ctx(t);
  size_t es = gdp_dtype_size(t->dtype);
  const void *elem = (const char *)t->storage->data + (size_t)off * es;
  uint64_t raw = 0; /* one element, any dtype */
  if (ctx->type != GDP_DEVICE_CPU) {
    GDP_TRY(ctx->backend->to_host(ctx, &raw, elem, es));
    elem = &raw;
  }
  gdp_ctx hc;
  host_ctx(&hc);
  gdp_tensor src, dst;
  gdp_storage ss, ds;
  wrap_memory(&src, &ss, &hc, t->dtype, 0, NULL, (void *)elem);
  wrap_memory(&dst, &ds, &hc, GDP_DTYPE_F64, 0, NULL, out);
  return gdp_backend_cpu.copy(&hc, &dst, &src);
}

gdp_status gdp_tensor_set(gdp_tensor *t, const int64_t *idx, double value) {
  if (!t) return GDP_ERROR(GDP_ERR_INVALID_ARG, "t is NULL");
  int64_t off;
  GDP_TRY(element_offset(__func__, t, idx, &off));
  gdp_ctx *ctx = tensor_ctx(t);
  gdp_tensor_mark_written(t);
  size_t es = gdp_dtype_size(t->dtype);
  void *elem = (char *)t->storage->data + (size_t)off * es;
  uint64_t raw = 0;
  gdp_ctx hc;
  host_ctx(&hc);
  gdp_tensor src, dst;
  gdp_storage ss, ds;
  wrap_memory(&src, &ss, &hc, GDP_DTYPE_F64, 0, NULL, &value);
  wrap_memory(&dst, &ds, &hc, t->dtype, 0, NULL, ctx->type == GDP_DEVICE_CPU ? elem : (void *)&raw);
  GDP_TRY(gdp_backend_cpu.copy(&hc, &dst, &src));
  if (ctx->type != GDP_DEVICE_CPU) return ctx->backend->to_device(ctx, elem, &raw, es);
  return GDP_OK;
}
