/*
 * internal.h -- definitions shared by the C core's source files and the kernels.
 * Not installed, never seen by Lua.
 */
#ifndef GDP_INTERNAL_H
#define GDP_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>

#include "gdp.h"

/* errors, GDP_TRY, GDP_ASSERT and the debugging switches: shared with the kernels */
#include "kernel_status.h"

/* Formats a shape as "[2x3x4]" into buf (for messages). */
const char *gdp_shape_str(char *buf, size_t buflen, int ndim, const int64_t *shape);

/* ------------------------------------------------------------------ objects */

typedef struct gdp_backend gdp_backend;

struct gdp_ctx {
  atomic_int refcount;
  gdp_device_type type;
  int index;
  const gdp_backend *backend;
  void *backend_state; /* e.g. the CUDA stream and cuBLAS handle */
  int num_threads;
  uint64_t seed;
  uint64_t rng_offset;
  gdp_tuning tuning; /* gdp_ctx_set_tuning; zeros: the backend's own choices */
  const char *last_path; /* the GDP operator's kernels in the last call (gdp_ctx_last_path) */
};

/* A refcounted allocation on one device.  Holds a reference to its context so that
 * the memory goes back through the backend that gave it.  `version` counts the writes
 * into existing elements made through the public API (gdp_tensor_version); views share
 * the storage, so a write through any of them counts for all. */
typedef struct gdp_storage {
  atomic_int refcount;
  gdp_ctx *ctx;
  void *data;
  size_t nbytes;
  _Atomic uint64_t version;
} gdp_storage;

struct gdp_tensor {
  atomic_int refcount;
  gdp_storage *storage;
  gdp_dtype dtype;
  int ndim;
  int is_view;
  int64_t shape[GDP_MAX_DIMS];
  int64_t stride[GDP_MAX_DIMS]; /* in elements */
  int64_t offset;               /* in elements */
};

/* Every public entry point that writes into a caller's tensor calls this once, before
 * the write is queued (also when the write then fails: its elements may have changed). */
static inline void gdp_tensor_mark_written(const gdp_tensor *t) {
  atomic_fetch_add_explicit(&t->storage->version, 1, memory_order_relaxed);
}

/* 1 when a and b share storage bytes but are not the very same elements in the same
 * layout (same dtype, offset, shape and strides): writing one while reading the other
 * element by element would then read values already overwritten (tensor.c). */
int gdp_tensor_partial_overlap(const gdp_tensor *a, const gdp_tensor *b);

/* Address of element 0 of t (host or device address). */
static inline void *gdp_tensor_ptr(const gdp_tensor *t) {
  return (char *)t->storage->data + (size_t)t->offset * gdp_dtype_size(t->dtype);
}

#endif /* GDP_INTERNAL_H */
