/*
 * ctx.c -- contexts (device, worker threads, RNG state, tuning), backend lookup, memory
 * accounting, version and clock.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend_impl.h"

#ifndef GDP_VERSION_STRING
#define GDP_VERSION_STRING "0.0.0-unknown"
#endif

/* ------------------------------------------------------------------ library */

int gdp_abi_version(void) { return 1; }

const char *gdp_version(void) { return GDP_VERSION_STRING; }

double gdp_time_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ devices */

const char *gdp_device_type_name(gdp_device_type type) {
  switch (type) {
    case GDP_DEVICE_CPU: return "cpu";
    case GDP_DEVICE_CUDA: return "cuda";
    default: return "?";
  }
}

const gdp_backend *gdp_backend_for(gdp_device_type type) {
  switch (type) {
    case GDP_DEVICE_CPU: return &gdp_backend_cpu;
#ifdef GDP_HAVE_CUDA
    case GDP_DEVICE_CUDA: return &gdp_backend_cuda;
#endif
    default: return NULL;
  }
}

int gdp_device_count(gdp_device_type type) {
  const gdp_backend *b = gdp_backend_for(type);
  if (!b) return 0;
  return b->device_count ? b->device_count() : 1;
}

/* Live bytes per device type; updated by the backends' alloc/release. */
static _Atomic int64_t live_bytes[GDP_DEVICE_TYPE_COUNT];

void gdp_mem_track(gdp_device_type type, int64_t delta_bytes) {
  if ((int)type < 0 || type >= GDP_DEVICE_TYPE_COUNT) return;
  atomic_fetch_add_explicit(&live_bytes[type], delta_bytes, memory_order_relaxed);
}

int64_t gdp_mem_live_bytes(gdp_device_type type) {
  if ((int)type < 0 || type >= GDP_DEVICE_TYPE_COUNT) return 0;
  return atomic_load_explicit(&live_bytes[type], memory_order_relaxed);
}

/* ------------------------------------------------------------------ context */

/* GDP_NUM_THREADS when set to a positive integer, else the online cores. */
static int default_num_threads(void) {
  const char *env = getenv("GDP_NUM_THREADS");
  if (env && *env) {
    char *end = NULL;
    errno = 0;
    long n = strtol(env, &end, 10);
    if (errno == 0 && end && *end == '\0' && n >= 1 && n <= 4096) return (int)n;
  }
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return cores >= 1 ? (int)cores : 1;
}

gdp_status gdp_ctx_new(gdp_device_type type, int index, gdp_ctx **out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  if ((int)type < 0 || type >= GDP_DEVICE_TYPE_COUNT)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "type: expected cpu (0) or cuda (1), got %d",
                     (int)type);
  const gdp_backend *b = gdp_backend_for(type);
  if (!b)
    return GDP_ERROR(GDP_ERR_UNSUPPORTED,
                     "device type %s: this libgdp was built without it (rebuild with "
                     "-DGDP_CUDA=ON)",
                     gdp_device_type_name(type));
  int count = gdp_device_count(type);
  /* Built with CUDA but run on a machine without a GPU: say so, rather than reporting
   * an index range of [0, 0). */
  if (count == 0)
    return GDP_ERROR(GDP_ERR_UNSUPPORTED, "no %s device on this machine (gdp_device_count is 0)",
                     gdp_device_type_name(type));
  if (index < 0 || index >= count)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "index: expected 0 <= index < %d for %s, got %d",
                     count, gdp_device_type_name(type), index);
  gdp_ctx *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return GDP_ERROR(GDP_ERR_OOM, "cannot allocate a context");
  atomic_init(&ctx->refcount, 1);
  ctx->type = type;
  ctx->index = index;
  ctx->backend = b;
  ctx->backend_state = NULL;
  ctx->num_threads = default_num_threads();
  ctx->seed = 0;
  ctx->rng_offset = 0;
  if (b->ctx_init) {
    gdp_status s = b->ctx_init(ctx);
    if (s != GDP_OK) {
      free(ctx);
      return s;
    }
  }
  *out = ctx;
  return GDP_OK;
}

gdp_ctx *gdp_ctx_retain(gdp_ctx *ctx) {
  if (ctx) atomic_fetch_add_explicit(&ctx->refcount, 1, memory_order_relaxed);
  return ctx;
}

void gdp_ctx_free(gdp_ctx *ctx) {
  if (!ctx) return;
  if (atomic_fetch_sub_explicit(&ctx->refcount, 1, memory_order_acq_rel) != 1) return;
  if (ctx->backend && ctx->backend->ctx_fini) ctx->backend->ctx_fini(ctx);
  free(ctx);
}

gdp_device_type gdp_ctx_device_type(const gdp_ctx *ctx) { return ctx ? ctx->type : GDP_DEVICE_CPU; }

int gdp_ctx_device_index(const gdp_ctx *ctx) { return ctx ? ctx->index : -1; }

gdp_status gdp_ctx_sync(gdp_ctx *ctx) {
  if (!ctx) return GDP_ERROR(GDP_ERR_INVALID_ARG, "ctx is NULL");
  return ctx->backend->sync ? ctx->backend->sync(ctx) : GDP_OK;
}

gdp_status gdp_ctx_timer_start(gdp_ctx *ctx, double hold_ms) {
  if (!ctx) return GDP_ERROR(GDP_ERR_INVALID_ARG, "ctx is NULL");
  if (!(hold_ms > 0 && hold_ms <= 10000))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "hold_ms must be in (0, 10000] milliseconds, got %g", hold_ms);
  if (!ctx->backend->timer_start)
    return GDP_ERROR(GDP_ERR_UNSUPPORTED, "no device timer on %s: time the work on the host",
                     ctx->backend->name);
  return ctx->backend->timer_start(ctx, hold_ms);
}

gdp_status gdp_ctx_timer_stop(gdp_ctx *ctx, double *device_ms) {
  if (!ctx) return GDP_ERROR(GDP_ERR_INVALID_ARG, "ctx is NULL");
  if (!device_ms) return GDP_ERROR(GDP_ERR_INVALID_ARG, "device_ms is NULL");
  if (!ctx->backend->timer_stop)
    return GDP_ERROR(GDP_ERR_UNSUPPORTED, "no device timer on %s: time the work on the host",
                     ctx->backend->name);
  return ctx->backend->timer_stop(ctx, device_ms);
}

void gdp_ctx_set_num_threads(gdp_ctx *ctx, int n) {
  if (!ctx) return;
  ctx->num_threads = n >= 1 ? n : default_num_threads();
}

int gdp_ctx_num_threads(const gdp_ctx *ctx) { return ctx ? ctx->num_threads : 0; }

const char *gdp_ctx_last_path(const gdp_ctx *ctx) { return ctx ? ctx->last_path : NULL; }

void gdp_ctx_manual_seed(gdp_ctx *ctx, uint64_t seed) {
  if (!ctx) return;
  /* torch's manual_seed also restarts the stream */
  ctx->seed = seed;
  ctx->rng_offset = 0;
}

uint64_t gdp_ctx_seed(const gdp_ctx *ctx) { return ctx ? ctx->seed : 0; }

uint64_t gdp_ctx_rng_offset(const gdp_ctx *ctx) { return ctx ? ctx->rng_offset : 0; }

void gdp_ctx_set_rng_offset(gdp_ctx *ctx, uint64_t offset) {
  if (ctx) ctx->rng_offset = offset;
}

int gdp_value_block_valid(int v) { return v == 0 || v == 16 || v == 32 || v == 64; }

void gdp_tuning_init(gdp_tuning *t) {
  if (t) memset(t, 0, sizeof *t);
}

gdp_status gdp_ctx_set_tuning(gdp_ctx *ctx, const gdp_tuning *t) {
  if (!ctx) return GDP_ERROR(GDP_ERR_INVALID_ARG, "ctx: expected a context, got NULL");
  if (!t) return GDP_ERROR(GDP_ERR_INVALID_ARG, "t: expected a gdp_tuning, got NULL");
  if (!gdp_value_block_valid(t->value_block))
    return GDP_ERROR(GDP_ERR_INVALID_ARG,
                     "value_block: expected 0 (the backend's own), 16, 32 or 64, got %d",
                     (int)t->value_block);
  ctx->tuning = *t;
  return GDP_OK;
}

gdp_status gdp_ctx_get_tuning(const gdp_ctx *ctx, gdp_tuning *out) {
  if (!ctx) return GDP_ERROR(GDP_ERR_INVALID_ARG, "ctx: expected a context, got NULL");
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out: expected a gdp_tuning, got NULL");
  *out = ctx->tuning;
  return GDP_OK;
}

int gdp_ctx_supports(const gdp_ctx *ctx, gdp_op op, gdp_dtype dtype) {
  if (!ctx || !ctx->backend || !ctx->backend->supports) return 0;
  if ((int)op < 0 || op >= GDP_OP_COUNT) return 0;
  if ((int)dtype < 0 || dtype >= GDP_DTYPE_COUNT) return 0;
  return ctx->backend->supports(op, dtype) ? 1 : 0;
}
