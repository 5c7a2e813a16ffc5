/*
 * backend_cuda.c -- the cuda device: one non-blocking stream and a lazily created
 * cuBLAS handle per context, stream-ordered allocation from the device's default
 * memory pool, and dispatch to the kernels of kernels/cuda (tensor_ops.h, gdp_cuda.h,
 * mixer/mixer_cuda.h, optim/optim_cuda.h).
 *
 * Everything is queued on the context's stream; host-visible results (to_host,
 * reductions) synchronise it.  Asynchronous kernel faults therefore surface at the
 * next synchronisation, named after the last ops queued; GDP_SYNC_EVERY_OP=1 makes
 * every op synchronise so that the failing op is the one reported.
 *
 * A libgdp built with CUDA must still load and work on a machine without a GPU or a
 * driver: nothing here runs before a cuda context is asked for, device_count answers 0
 * there, and ctx_init fails with "no CUDA device".
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "backend_impl.h"
#include "cuda_check.h"
#include "cuda/gdp_cuda.h"
#include "cuda/mixer/mixer_cuda.h"
#include "cuda/data/state_tracking_cuda.h"
#include "cuda/optim/optim_cuda.h"
#include "cuda/nn/nn_cuda.h"
#include "cuda/tensor_ops.h"

/* tensor_ops.h repeats these enums for the .cu files, which cannot include this one. */
_Static_assert((int)GDP_BINARY_AXPY == GDP_CUDA_BINARY_AXPY &&
                   (int)GDP_BINARY_MUL == GDP_CUDA_BINARY_MUL &&
                   (int)GDP_BINARY_SCALE == GDP_CUDA_BINARY_SCALE,
               "binary kinds of backend_impl.h and tensor_ops.h differ");
_Static_assert((int)GDP_REDUCE_SUM == GDP_CUDA_REDUCE_SUM &&
                   (int)GDP_REDUCE_DOT == GDP_CUDA_REDUCE_DOT &&
                   (int)GDP_REDUCE_SUMSQ == GDP_CUDA_REDUCE_SUMSQ &&
                   (int)GDP_REDUCE_MAXABS == GDP_CUDA_REDUCE_MAXABS &&
                   (int)GDP_REDUCE_NONFINITE == GDP_CUDA_REDUCE_NONFINITE &&
                   (int)GDP_REDUCE_DIFF_SUMSQ == GDP_CUDA_REDUCE_DIFF_SUMSQ,
               "reduce kinds of backend_impl.h and tensor_ops.h differ");
_Static_assert((int)GDP_RNG_UNIFORM == GDP_CUDA_RNG_UNIFORM &&
                   (int)GDP_RNG_NORMAL == GDP_CUDA_RNG_NORMAL,
               "rng kinds of backend_impl.h and tensor_ops.h differ");

enum { OP_NAME_LEN = 96, DEFERRED_LEN = 256 };
/* pinned result slots: one wait per this many reductions in reduce_many */
enum { kReduceSlots = 64 };
/* index checks queued between two waits on the device (one more waits first) */
enum { kPendingChecks = 64 };

typedef struct cuda_state {
  cudaStream_t stream;
  cublasHandle_t blas;    /* created on the first matmul: cuBLAS init costs time and memory */
  int use_pool;           /* cudaMallocAsync available (memory pools supported) */
  int sync_every_op;      /* GDP_SYNC_EVERY_OP=1 */
  double *reduce_workspace; /* GDP_CUDA_REDUCE_WORKSPACE doubles on the device */
  double *reduce_result;    /* kReduceSlots pinned host doubles (reduce: the first) */
  /* The two most recent ops queued, for messages about asynchronous errors (the
   * previous one matters when the op that synchronised, e.g. to_host, is the latest). */
  char last_op[OP_NAME_LEN];
  char prev_op[OP_NAME_LEN];
  /* release() cannot return an error; a failure there is reported at the next sync. */
  char deferred_error[DEFERRED_LEN];
  /* The model layer ops' index checks (nn_problem.h) queued since the last wait: each
   * one's verdict ({first bad position or -1, its value}) is written by the device into
   * its pair of check_slots (pinned, mapped) when the stream gets there, and the next
   * stream_sync reports the first failed one, so that a check costs no wait of its own. */
  gdp_index_check pending[kPendingChecks];
  int n_pending;
  int64_t *check_slots;     /* host view: 2 x kPendingChecks */
  int64_t *check_slots_dev; /* the same memory, the device's pointer */
  /* gdp_ctx_timer_start / _stop: the marks (created on the first start) and whether a
   * start is pending */
  cudaEvent_t timer_mark[2];
  int timer_started;
} cuda_state;

static cuda_state *state_of(const gdp_ctx *ctx) { return (cuda_state *)ctx->backend_state; }

/* The context's stream, for comm.c's NCCL calls (declared there). */
void *gdp_cuda_ctx_stream(const gdp_ctx *ctx);
void *gdp_cuda_ctx_stream(const gdp_ctx *ctx) {
  return ctx && ctx->type == GDP_DEVICE_CUDA ? (void *)state_of(ctx)->stream : NULL;
}

/* ------------------------------------------------------------------ op bookkeeping */

/* Makes ctx's device current (several contexts may drive several GPUs from one
 * thread) and records the op about to be queued: "<op> <dtype> [shape]". */
static gdp_status op_begin(gdp_ctx *ctx, const char *op, const gdp_tensor *t) {
  cuda_state *st = state_of(ctx);
  memcpy(st->prev_op, st->last_op, sizeof st->prev_op);
  if (t) {
    char shape[128];
    snprintf(st->last_op, sizeof st->last_op, "%s %s %s", op, gdp_dtype_name(t->dtype),
             gdp_shape_str(shape, sizeof shape, t->ndim, t->shape));
  } else {
    snprintf(st->last_op, sizeof st->last_op, "%s", op);
  }
  GDP_CUDA_TRY(cudaSetDevice(ctx->index));
  return GDP_OK;
}

static gdp_status stream_sync(gdp_ctx *ctx) {
  cuda_state *st = state_of(ctx);
  cudaError_t e = cudaStreamSynchronize(st->stream);
  const int checks = st->n_pending;
  st->n_pending = 0; /* after a failed wait their slots mean nothing */
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return GDP_ERROR(GDP_ERR_CUDA,
                     "cuda:%d: an asynchronous error surfaced at synchronisation: %s (%s); "
                     "last op queued: %s (before it: %s)%s",
                     ctx->index, cudaGetErrorName(e), cudaGetErrorString(e), st->last_op,
                     st->prev_op[0] ? st->prev_op : "none",
                     st->sync_every_op ? "" : "; run with GDP_SYNC_EVERY_OP=1 to find the op");
  }
  if (st->deferred_error[0]) {
    gdp_status s = GDP_ERROR(GDP_ERR_CUDA, "cuda:%d: %s", ctx->index, st->deferred_error);
    st->deferred_error[0] = '\0';
    return s;
  }
  for (int i = 0; i < checks; i++) {
    const int64_t *v = st->check_slots + 2 * i;
    if (v[0] >= 0) return st->pending[i].report(&st->pending[i], v[0], v[1]);
  }
  return GDP_OK;
}

/* After every queued op: synchronise when GDP_SYNC_EVERY_OP asks for it. */
static gdp_status op_end(gdp_ctx *ctx) {
  return state_of(ctx)->sync_every_op ? stream_sync(ctx) : GDP_OK;
}

static gdp_cuda_operand operand_of(const gdp_tensor *t) {
  gdp_cuda_operand o;
  memset(&o, 0, sizeof o);
  o.data = gdp_tensor_ptr(t);
  o.dtype = (int)t->dtype;
  for (int d = 0; d < t->ndim; d++) o.stride[d] = t->stride[d];
  return o;
}

/* ------------------------------------------------------------------ devices, contexts */

static int cuda_device_count(void) {
  int n = 0;
  /* No driver or no GPU (cudaErrorNoDevice, cudaErrorInsufficientDriver, ...) means no
   * CUDA devices, not a failure: a CUDA build must run on CPU-only machines. */
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

static void destroy_state(gdp_ctx *ctx, cuda_state *st) {
  if (!st) return;
  (void)cudaSetDevice(ctx->index);
  if (st->stream) (void)cudaStreamSynchronize(st->stream);
  if (st->blas) (void)cublasDestroy(st->blas);
  if (st->reduce_workspace) (void)cudaFree(st->reduce_workspace);
  if (st->reduce_result) (void)cudaFreeHost(st->reduce_result);
  if (st->check_slots) (void)cudaFreeHost(st->check_slots);
  for (int i = 0; i < 2; i++)
    if (st->timer_mark[i]) (void)cudaEventDestroy(st->timer_mark[i]);
  if (st->stream) (void)cudaStreamDestroy(st->stream);
  (void)cudaGetLastError();
  free(st);
}

static gdp_status init_state(gdp_ctx *ctx, cuda_state *st) {
  int dev = ctx->index;
  GDP_CUDA_TRY(cudaSetDevice(dev));
  GDP_CUDA_TRY(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking));
  int pools = 0;
  GDP_CUDA_TRY(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev));
  st->use_pool = pools != 0;
  if (st->use_pool) {
    /* The default release threshold (0) hands freed memory back to the driver at every
     * synchronisation, so a training loop would re-map its activations each step; keep
     * it cached instead (alloc trims the pool and retries before reporting OOM). */
    cudaMemPool_t pool;
    uint64_t threshold = UINT64_MAX;
    GDP_CUDA_TRY(cudaDeviceGetDefaultMemPool(&pool, dev));
    GDP_CUDA_TRY(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  }
  GDP_CUDA_TRY(cudaMalloc((void **)&st->reduce_workspace,
                          GDP_CUDA_REDUCE_WORKSPACE * sizeof(double)));
  GDP_CUDA_TRY(cudaMallocHost((void **)&st->reduce_result, kReduceSlots * sizeof(double)));
  GDP_CUDA_TRY(cudaHostAlloc((void **)&st->check_slots, 2 * kPendingChecks * sizeof(int64_t),
                             cudaHostAllocMapped));
  GDP_CUDA_TRY(cudaHostGetDevicePointer((void **)&st->check_slots_dev, st->check_slots, 0));
  st->sync_every_op = gdp_debug_sync_every_op();
  snprintf(st->last_op, sizeof st->last_op, "none");
  return GDP_OK;
}

static gdp_status cuda_ctx_init(gdp_ctx *ctx) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return GDP_ERROR(GDP_ERR_UNSUPPORTED, "no CUDA device on this machine (cudaGetDeviceCount: %s)",
                     e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  }
  if (ctx->index < 0 || ctx->index >= count)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "index: expected 0 <= index < %d CUDA devices, got %d",
                     count, ctx->index);
  cuda_state *st = calloc(1, sizeof *st);
  if (!st) return GDP_ERROR(GDP_ERR_OOM, "cannot allocate the CUDA context state");
  gdp_status s = init_state(ctx, st);
  if (s != GDP_OK) {
    destroy_state(ctx, st);
    return s;
  }
  ctx->backend_state = st;
  return GDP_OK;
}

static void cuda_ctx_fini(gdp_ctx *ctx) {
  destroy_state(ctx, state_of(ctx));
  ctx->backend_state = NULL;
}

static gdp_status cuda_sync(gdp_ctx *ctx) {
  GDP_CUDA_TRY(cudaSetDevice(ctx->index));
  return stream_sync(ctx);
}

/* ------------------------------------------------------------------ memory */

static gdp_status oom_error(const char *func, gdp_ctx *ctx, size_t nbytes) {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
  return GDP_ERROR_IN(func, GDP_ERR_OOM,
                      "cuda:%d: out of memory: asked for %zu bytes, %zu bytes free of %zu",
                      ctx->index, nbytes, free_bytes, total_bytes);
}

/* Stream-ordered device memory, not counted in gdp_mem_live_bytes (scratch buffers
 * use it directly).  The memory may be used by work queued later on the stream.
 * `func` names the caller in messages. */
static gdp_status device_alloc(const char *func, gdp_ctx *ctx, size_t nbytes, void **out) {
  cuda_state *st = state_of(ctx);
  size_t ask = nbytes ? nbytes : 1; /* a valid, distinct address even for empty tensors */
  void *p = NULL;
  cudaError_t e = st->use_pool ? cudaMallocAsync(&p, ask, st->stream) : cudaMalloc(&p, ask);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    /* Memory freed on other streams may still be pending, and the pool keeps freed
     * memory mapped (release threshold above): wait for it, give it back, retry once. */
    if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
    if (st->use_pool) {
      cudaMemPool_t pool;
      if (cudaDeviceGetDefaultMemPool(&pool, ctx->index) == cudaSuccess)
        (void)cudaMemPoolTrimTo(pool, 0);
      (void)cudaGetLastError();
    }
    e = st->use_pool ? cudaMallocAsync(&p, ask, st->stream) : cudaMalloc(&p, ask);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    /* Requests beyond the device (say 1 PB) may be refused as invalid rather than out
     * of memory; to the caller both are out of memory. */
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    if (e == cudaErrorMemoryAllocation || (total_bytes > 0 && nbytes > total_bytes))
      return oom_error(func, ctx, nbytes);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return GDP_ERROR_IN(func, GDP_ERR_CUDA, "cuda:%d: allocating %zu bytes failed: %s (%s)",
                        ctx->index, nbytes, cudaGetErrorName(e), cudaGetErrorString(e));
  }
  *out = p;
  return GDP_OK;
}

static void device_free(gdp_ctx *ctx, void *ptr) {
  cuda_state *st = state_of(ctx);
  cudaError_t e = st->use_pool ? cudaFreeAsync(ptr, st->stream) : cudaFree(ptr);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (!st->deferred_error[0])
      snprintf(st->deferred_error, sizeof st->deferred_error,
               "freeing device memory %p failed: %s (%s)", ptr, cudaGetErrorName(e),
               cudaGetErrorString(e));
  }
}

static gdp_status cuda_alloc(gdp_ctx *ctx, size_t nbytes, void **out) {
  /* Not recorded as an op: allocations fail synchronously, never later. */
  GDP_CUDA_TRY(cudaSetDevice(ctx->index));
  GDP_TRY(device_alloc("cuda_alloc", ctx, nbytes, out));
  gdp_mem_track(GDP_DEVICE_CUDA, (int64_t)nbytes);
  return GDP_OK;
}

static void cuda_release(gdp_ctx *ctx, void *ptr, size_t nbytes) {
  if (!ptr) return;
  if (cudaSetDevice(ctx->index) != cudaSuccess) (void)cudaGetLastError();
  /* Stream-ordered: work already queued on the stream that reads ptr finishes first. */
  device_free(ctx, ptr);
  gdp_mem_track(GDP_DEVICE_CUDA, -(int64_t)nbytes);
}

static gdp_status cuda_to_device(gdp_ctx *ctx, void *dst_dev, const void *src_host,
                                 size_t nbytes) {
  if (nbytes == 0) return GDP_OK;
  GDP_TRY(op_begin(ctx, "to_device", NULL));
  /* From pageable memory this returns once the data is staged, so the caller may reuse
   * its buffer at once (tensor_set passes a stack variable).  From pinned memory the
   * copy is truly asynchronous, and no caller of this entry keeps its buffer alive, so
   * wait for it then. */
  struct cudaPointerAttributes attr;
  int pinned = 0;
  if (cudaPointerGetAttributes(&attr, src_host) == cudaSuccess)
    pinned = attr.type == cudaMemoryTypeHost;
  else
    (void)cudaGetLastError();
  GDP_CUDA_TRY(cudaMemcpyAsync(dst_dev, src_host, nbytes, cudaMemcpyHostToDevice,
                               state_of(ctx)->stream));
  return pinned ? stream_sync(ctx) : op_end(ctx);
}

static gdp_status cuda_to_host(gdp_ctx *ctx, void *dst_host, const void *src_dev,
                               size_t nbytes) {
  if (nbytes == 0) return GDP_OK;
  GDP_TRY(op_begin(ctx, "to_host", NULL));
  GDP_CUDA_TRY(cudaMemcpyAsync(dst_host, src_dev, nbytes, cudaMemcpyDeviceToHost,
                               state_of(ctx)->stream));
  return stream_sync(ctx);
}

/* ------------------------------------------------------------------ elementwise */

static int is_int_dtype(gdp_dtype d) { return d == GDP_DTYPE_I32 || d == GDP_DTYPE_I64; }

/* A launch that stores into an integer dtype from values that may not fit: the device
 * records the first element without a value, read back here (a sync), so that such a
 * conversion is an error as on the CPU; `what` and the shape name it. */
static gdp_status int_check_end(gdp_ctx *ctx, const char *what, const gdp_tensor *out) {
  int64_t bad = -1;
  GDP_CUDA_TRY(gdp_cuda_int_check_end(state_of(ctx)->stream, &bad));
  if (bad < 0) return GDP_OK;
  char shape_buf[160];
  return GDP_ERROR_IN("tensor conversion", GDP_ERR_INVALID_ARG,
                      "%s a %s tensor of shape %s on %s:%d: element %lld (row-major, counting "
                      "from 1) has no value in %s (NaN, inf and values out of range are errors, "
                      "not saturated; the tensor holds saturated values)",
                      what, gdp_dtype_name(out->dtype),
                      gdp_shape_str(shape_buf, sizeof shape_buf, out->ndim, out->shape),
                      gdp_device_type_name(ctx->type), ctx->index, (long long)bad + 1,
                      gdp_dtype_name(out->dtype));
}

static gdp_status cuda_copy(gdp_ctx *ctx, gdp_tensor *dst, const gdp_tensor *src) {
  GDP_TRY(op_begin(ctx, "copy", dst));
  gdp_cuda_operand d = operand_of(dst), s = operand_of(src);
  const int checked = is_int_dtype(dst->dtype) && src->dtype != GDP_DTYPE_I32 &&
                      !(dst->dtype == GDP_DTYPE_I64 && src->dtype == GDP_DTYPE_I64);
  if (checked) GDP_CUDA_TRY(gdp_cuda_int_check_begin(state_of(ctx)->stream));
  GDP_CUDA_TRY(gdp_cuda_copy(dst->ndim, dst->shape, &d, &s, state_of(ctx)->stream));
  if (checked) GDP_TRY(int_check_end(ctx, "converting into", dst));
  return op_end(ctx);
}

static gdp_status cuda_fill(gdp_ctx *ctx, gdp_tensor *t, double value) {
  GDP_TRY(op_begin(ctx, "fill", t));
  if (is_int_dtype(t->dtype) && !gdp_fits_int(value, t->dtype))
    return GDP_ERROR_IN("tensor conversion", GDP_ERR_INVALID_ARG,
                        "filling a %s tensor with %.17g, which %s has no value for (NaN, inf "
                        "and values out of range are errors, not saturated)",
                        gdp_dtype_name(t->dtype), value, gdp_dtype_name(t->dtype));
  gdp_cuda_operand d = operand_of(t);
  GDP_CUDA_TRY(gdp_cuda_fill(t->ndim, t->shape, &d, value, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_rng(gdp_ctx *ctx, gdp_tensor *t, gdp_rng_kind kind, double a, double b,
                           uint64_t seed, uint64_t offset) {
  GDP_TRY(op_begin(ctx, kind == GDP_RNG_NORMAL ? "normal" : "uniform", t));
  if (t->dtype != GDP_DTYPE_F64 && t->dtype != GDP_DTYPE_F32 && t->dtype != GDP_DTYPE_BF16)
    return GDP_ERROR(GDP_ERR_DTYPE, "random fills need f64, f32 or bf16, got %s",
                     gdp_dtype_name(t->dtype));
  gdp_cuda_operand d = operand_of(t);
  GDP_CUDA_TRY(gdp_cuda_rng(t->ndim, t->shape, &d, (int)kind, a, b, seed, offset,
                            state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_binary(gdp_ctx *ctx, gdp_tensor *out, const gdp_tensor *a,
                              const gdp_tensor *b, gdp_binary_kind kind, double alpha) {
  static const char *names[] = {"axpy", "mul", "scale"};
  GDP_TRY(op_begin(ctx, (unsigned)kind < 3 ? names[kind] : "binary", out));
  gdp_cuda_operand o = operand_of(out), x = operand_of(a);
  gdp_cuda_operand y = b ? operand_of(b) : x;
  if (kind != GDP_BINARY_SCALE && !b)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "b is NULL for a binary op that reads it");
  if (is_int_dtype(out->dtype)) GDP_CUDA_TRY(gdp_cuda_int_check_begin(state_of(ctx)->stream));
  GDP_CUDA_TRY(gdp_cuda_binary(out->ndim, out->shape, &o, &x, &y, (int)kind, alpha,
                               state_of(ctx)->stream));
  if (is_int_dtype(out->dtype)) GDP_TRY(int_check_end(ctx, "an elementwise result stored into", out));
  return op_end(ctx);
}

static gdp_status cuda_reduce(gdp_ctx *ctx, const gdp_tensor *a, const gdp_tensor *b,
                              gdp_reduce_kind kind, double *out) {
  static const char *names[] = {"sum", "dot", "sumsq", "maxabs", "nonfinite", "diff_sumsq"};
  GDP_TRY(op_begin(ctx, (unsigned)kind < 6 ? names[kind] : "reduce", a));
  cuda_state *st = state_of(ctx);
  int two = kind == GDP_REDUCE_DOT || kind == GDP_REDUCE_DIFF_SUMSQ;
  if (two && !b) return GDP_ERROR(GDP_ERR_INVALID_ARG, "b is NULL for a two-operand reduction");
  gdp_cuda_operand x = operand_of(a);
  gdp_cuda_operand y = two ? operand_of(b) : x;
  GDP_CUDA_TRY(gdp_cuda_reduce(a->ndim, a->shape, &x, two ? &y : NULL, (int)kind,
                               st->reduce_workspace, st->reduce_result, st->stream));
  GDP_TRY(stream_sync(ctx));
  *out = *st->reduce_result;
  return GDP_OK;
}

/* Each reduction queues its own result copy into its own pinned slot (the workspace is
 * reused in stream order; an empty tensor's 0 is written to its slot at once, which no
 * pending copy targets), and one wait covers up to kReduceSlots of them. */
static gdp_status cuda_reduce_many(gdp_ctx *ctx, int n, const gdp_tensor *const *ts,
                                   gdp_reduce_kind kind, double *out) {
  if (kind == GDP_REDUCE_DOT || kind == GDP_REDUCE_DIFF_SUMSQ)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "reduce_many takes one-operand reductions only");
  GDP_TRY(op_begin(ctx, "reduce_many", ts[0]));
  cuda_state *st = state_of(ctx);
  for (int i0 = 0; i0 < n; i0 += kReduceSlots) {
    const int m = n - i0 < kReduceSlots ? n - i0 : kReduceSlots;
    for (int j = 0; j < m; j++) {
      const gdp_tensor *t = ts[i0 + j];
      gdp_cuda_operand x = operand_of(t);
      GDP_CUDA_TRY(gdp_cuda_reduce(t->ndim, t->shape, &x, NULL, (int)kind, st->reduce_workspace,
                                   st->reduce_result + j, st->stream));
    }
    GDP_TRY(stream_sync(ctx));
    for (int j = 0; j < m; j++) out[i0 + j] = st->reduce_result[j];
  }
  return GDP_OK;
}

/* ------------------------------------------------------------------ matmul */

/* How a logical R x S matrix with strides (rs, cs) looks to column-major cuBLAS.
 * row_major: its memory is the column-major S x R matrix X^T with leading dimension ld;
 * otherwise it is X itself, column-major with leading dimension ld.  Returns 0 when
 * neither holds (no unit stride, overlapping or negative strides): copy it first. */
static int blas_layout(int64_t R, int64_t S, int64_t rs, int64_t cs, int *row_major,
                       int64_t *ld) {
  if ((S == 1 || cs == 1) && (R == 1 || rs >= S)) {
    *row_major = 1;
    *ld = R == 1 ? (S > 1 ? S : 1) : rs;
  } else if ((R == 1 || rs == 1) && (S == 1 || cs >= R)) {
    *row_major = 0;
    *ld = S == 1 ? (R > 1 ? R : 1) : cs;
  } else {
    return 0;
  }
  return *ld <= INT_MAX;
}

/* One gemm operand: op(tensor) as a logical matrix; in a batched product the matrices
 * of successive batch entries lie bs elements apart (0: one matrix for every entry). */
typedef struct mat_view {
  const void *ptr;
  int64_t rows, cols, rs, cs, bs;
} mat_view;

/* op(t) for a 2-D t or a 3-D t [batch, r, c] (the matrix is its last two dims) whose
 * elements lie at ptr with strides `stride` (t->ndim of them). */
static mat_view mat_of(const gdp_tensor *t, int trans, const void *ptr, const int64_t *stride) {
  const int d = t->ndim - 2;
  mat_view m;
  m.ptr = ptr;
  m.rows = trans ? t->shape[d + 1] : t->shape[d];
  m.cols = trans ? t->shape[d] : t->shape[d + 1];
  m.rs = trans ? stride[d + 1] : stride[d];
  m.cs = trans ? stride[d] : stride[d + 1];
  m.bs = d ? stride[0] : 0;
  return m;
}

/* Row-major strides of a contiguous tensor of t's shape. */
static void contiguous_strides_of(const gdp_tensor *t, int64_t *stride) {
  int64_t s = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    stride[d] = s;
    s *= t->shape[d];
  }
}

/* Contiguous device copy of t (same dtype) in scratch memory for operands whose
 * strides cuBLAS cannot express. */
static gdp_status scratch_contiguous(gdp_ctx *ctx, const gdp_tensor *t, void **out) {
  size_t nbytes = (size_t)gdp_tensor_numel(t) * gdp_dtype_size(t->dtype);
  GDP_TRY(device_alloc("cuda_matmul", ctx, nbytes, out));
  gdp_cuda_operand d = operand_of(t), s = operand_of(t);
  d.data = *out;
  contiguous_strides_of(t, d.stride);
  cudaError_t e = gdp_cuda_copy(t->ndim, t->shape, &d, &s, state_of(ctx)->stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    device_free(ctx, *out);
    *out = NULL;
    return GDP_ERROR(GDP_ERR_CUDA, "copying a matmul operand to scratch memory failed: %s (%s)",
                     cudaGetErrorName(e), cudaGetErrorString(e));
  }
  return GDP_OK;
}

static gdp_status ensure_blas(gdp_ctx *ctx) {
  cuda_state *st = state_of(ctx);
  if (st->blas) return GDP_OK;
  cublasHandle_t h = NULL;
  GDP_CUBLAS_TRY(cublasCreate(&h));
  cublasStatus_t s = cublasSetStream(h, st->stream);
  /* Default math: no TF32 (and no other reduced precision), so that float32 products
   * match the CPU's to float32 accuracy. */
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
  if (s != CUBLAS_STATUS_SUCCESS) {
    (void)cublasDestroy(h);
    return GDP_ERROR(GDP_ERR_CUDA, "configuring the cuBLAS handle failed: %s (%s)",
                     cublasGetStatusName(s), cublasGetStatusString(s));
  }
  st->blas = h;
  return GDP_OK;
}

/* `dtype` is the operands', `c_dtype` the result's (the same, or float32 for bf16).
 * batch > 1: one strided-batched launch, entry i reading x->ptr + i x->bs and
 * y->ptr + i y->bs and writing c + i c_bs. */
static gdp_status gemm(gdp_ctx *ctx, gdp_dtype dtype, gdp_dtype c_dtype, int64_t batch,
                       int64_t m, int64_t n, int64_t k, const mat_view *x, int x_trans,
                       int64_t ldx, const mat_view *y, int y_trans, int64_t ldy, void *c,
                       int64_t ldc, int64_t c_bs, double alpha, double beta) {
  cuda_state *st = state_of(ctx);
  cublasOperation_t opx = x_trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t opy = y_trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batch > 1) {
    if (dtype == GDP_DTYPE_F64) {
      GDP_CUBLAS_TRY(cublasDgemmStridedBatched(
          st->blas, opx, opy, (int)m, (int)n, (int)k, &alpha, x->ptr, (int)ldx,
          (long long)x->bs, y->ptr, (int)ldy, (long long)y->bs, &beta, c, (int)ldc,
          (long long)c_bs, (int)batch));
    } else {
      cudaDataType_t t = dtype == GDP_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
      cudaDataType_t tc = c_dtype == GDP_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
      float alpha_f = (float)alpha, beta_f = (float)beta;
      GDP_CUBLAS_TRY(cublasGemmStridedBatchedEx(
          st->blas, opx, opy, (int)m, (int)n, (int)k, &alpha_f, x->ptr, t, (int)ldx,
          (long long)x->bs, y->ptr, t, (int)ldy, (long long)y->bs, &beta_f, c, tc, (int)ldc,
          (long long)c_bs, (int)batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    return GDP_OK;
  }
  if (dtype == GDP_DTYPE_F64) {
    GDP_CUBLAS_TRY(cublasDgemm(st->blas, opx, opy, (int)m, (int)n, (int)k, &alpha, x->ptr,
                               (int)ldx, y->ptr, (int)ldy, &beta, c, (int)ldc));
  } else {
    /* float32, or bfloat16 operands with float32 accumulation (the tensor cores' rate:
     * the ceiling the GDP kernels are measured against) and a bf16 or float32 result. */
    cudaDataType_t t = dtype == GDP_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    cudaDataType_t tc = c_dtype == GDP_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    float alpha_f = (float)alpha, beta_f = (float)beta;
    GDP_CUBLAS_TRY(cublasGemmEx(st->blas, opx, opy, (int)m, (int)n, (int)k, &alpha_f, x->ptr, t,
                                (int)ldx, y->ptr, t, (int)ldy, &beta_f, c, tc, (int)ldc,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  return GDP_OK;
}

/* out = alpha op(a) op(b) + beta out, everything row-major in gdp's view.  cuBLAS is
 * column-major, and a row-major matrix is its transpose there, so for a row-major out
 * it computes out^T = op(b)^T op(a)^T (the usual swap); a column-major out (a
 * transposed view) takes the direct product.  A batched out's matrices lie c_bs
 * elements apart; the batch strides travel with the pointers through the swap. */
static gdp_status matmul_planned(gdp_ctx *ctx, gdp_tensor *out, gdp_dtype ab_dtype,
                                 const mat_view *A, const mat_view *B, double alpha, double beta,
                                 void *c_ptr, int64_t c_rs, int64_t c_cs, int64_t c_bs) {
  const int bd = out->ndim - 2; /* batch dims: 0 or 1 */
  int64_t batch = bd ? out->shape[0] : 1, M = out->shape[bd], N = out->shape[bd + 1], K = A->cols;
  int a_row, b_row, c_row;
  int64_t lda, ldb, ldc;
  if (!blas_layout(M, K, A->rs, A->cs, &a_row, &lda) ||
      !blas_layout(K, N, B->rs, B->cs, &b_row, &ldb) ||
      !blas_layout(M, N, c_rs, c_cs, &c_row, &ldc))
    return GDP_ERROR(GDP_ERR_INTERNAL, "matmul operand layout not expressible after copies");
  if (c_row)
    return gemm(ctx, ab_dtype, out->dtype, batch, N, M, K, B, !b_row, ldb, A, !a_row, lda, c_ptr,
                ldc, c_bs, alpha, beta);
  return gemm(ctx, ab_dtype, out->dtype, batch, M, N, K, A, a_row, lda, B, b_row, ldb, c_ptr, ldc,
              c_bs, alpha, beta);
}

static gdp_status cuda_matmul(gdp_ctx *ctx, gdp_tensor *out, const gdp_tensor *a,
                              const gdp_tensor *b, int trans_a, int trans_b, double alpha,
                              double beta) {
  GDP_TRY(op_begin(ctx, "matmul", out));
  if (out->dtype != GDP_DTYPE_F32 && out->dtype != GDP_DTYPE_F64 && out->dtype != GDP_DTYPE_BF16)
    return GDP_ERROR(GDP_ERR_DTYPE, "matmul on cuda needs f32, f64 or bf16, got %s",
                     gdp_dtype_name(out->dtype));
  const int bf16_into_f32 = a->dtype == GDP_DTYPE_BF16 && b->dtype == GDP_DTYPE_BF16 &&
                            out->dtype == GDP_DTYPE_F32;
  if (!bf16_into_f32 && (a->dtype != out->dtype || b->dtype != out->dtype))
    return GDP_ERROR(GDP_ERR_DTYPE, "matmul dtypes differ: out %s, a %s, b %s",
                     gdp_dtype_name(out->dtype), gdp_dtype_name(a->dtype),
                     gdp_dtype_name(b->dtype));
  /* out [M,N], or [batch,M,N] with a, b each [batch,.,.] or 2-D (op layer checked) */
  const int bd = out->ndim - 2; /* batch dims: 0 or 1 */
  int64_t batch = bd ? out->shape[0] : 1, M = out->shape[bd], N = out->shape[bd + 1];
  int64_t K = trans_a ? a->shape[a->ndim - 2] : a->shape[a->ndim - 1];
  if (batch == 0 || M == 0 || N == 0) return GDP_OK;
  if (K == 0) { /* empty sum: out = beta out (beta 0 overwrites NaN, as BLAS does) */
    gdp_cuda_operand o = operand_of(out);
    cudaStream_t s = state_of(ctx)->stream;
    if (beta == 0.0)
      GDP_CUDA_TRY(gdp_cuda_fill(out->ndim, out->shape, &o, 0.0, s));
    else
      GDP_CUDA_TRY(gdp_cuda_binary(out->ndim, out->shape, &o, &o, &o, GDP_CUDA_BINARY_SCALE,
                                   beta, s));
    return op_end(ctx);
  }
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX || batch > INT_MAX)
    return GDP_ERROR(GDP_ERR_UNSUPPORTED,
                     "matmul sizes above 2^31-1: M %lld, N %lld, K %lld, batch %lld",
                     (long long)M, (long long)N, (long long)K, (long long)batch);
  GDP_TRY(ensure_blas(ctx));

  /* Operands cuBLAS cannot read in place are copied to contiguous scratch memory. */
  void *a_tmp = NULL, *b_tmp = NULL, *c_tmp = NULL;
  mat_view A = mat_of(a, trans_a, gdp_tensor_ptr(a), a->stride);
  mat_view B = mat_of(b, trans_b, gdp_tensor_ptr(b), b->stride);
  int row;
  int64_t ld;
  gdp_status s = GDP_OK;
  if (!blas_layout(A.rows, A.cols, A.rs, A.cs, &row, &ld)) {
    s = scratch_contiguous(ctx, a, &a_tmp);
    int64_t cstr[GDP_MAX_DIMS];
    contiguous_strides_of(a, cstr);
    if (s == GDP_OK) A = mat_of(a, trans_a, a_tmp, cstr);
  }
  if (s == GDP_OK && !blas_layout(B.rows, B.cols, B.rs, B.cs, &row, &ld)) {
    s = scratch_contiguous(ctx, b, &b_tmp);
    int64_t cstr[GDP_MAX_DIMS];
    contiguous_strides_of(b, cstr);
    if (s == GDP_OK) B = mat_of(b, trans_b, b_tmp, cstr);
  }
  void *c_ptr = gdp_tensor_ptr(out);
  int64_t c_rs = out->stride[bd], c_cs = out->stride[bd + 1], c_bs = bd ? out->stride[0] : 0;
  if (s == GDP_OK && !blas_layout(M, N, c_rs, c_cs, &row, &ld)) {
    /* beta != 0 reads out, so the scratch starts as a copy of it. */
    size_t c_bytes = (size_t)(batch * M * N) * gdp_dtype_size(out->dtype);
    s = beta != 0.0 ? scratch_contiguous(ctx, out, &c_tmp)
                    : device_alloc("cuda_matmul", ctx, c_bytes, &c_tmp);
    c_ptr = c_tmp;
    c_rs = N;
    c_cs = 1;
    c_bs = M * N;
  }
  if (s == GDP_OK)
    s = matmul_planned(ctx, out, a->dtype, &A, &B, alpha, beta, c_ptr, c_rs, c_cs, c_bs);
  if (s == GDP_OK && c_tmp) {
    gdp_cuda_operand d = operand_of(out), src = operand_of(out);
    src.data = c_tmp;
    contiguous_strides_of(out, src.stride);
    cudaError_t e = gdp_cuda_copy(out->ndim, out->shape, &d, &src, state_of(ctx)->stream);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      s = GDP_ERROR(GDP_ERR_CUDA, "copying the matmul result back failed: %s",
                    cudaGetErrorString(e));
    }
  }
  /* Stream-ordered frees: the gemm queued above still reads these buffers. */
  if (a_tmp) device_free(ctx, a_tmp);
  if (b_tmp) device_free(ctx, b_tmp);
  if (c_tmp) device_free(ctx, c_tmp);
  if (s != GDP_OK) return s;
  return op_end(ctx);
}

/* ------------------------------------------------------------------ GDP operator */

static gdp_status cuda_gdp_forward(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                   const gdp_delta_product_forward_io *io) {
  GDP_TRY(op_begin(ctx, "gdp_forward", NULL));
  GDP_TRY(gdp_cuda_delta_product_forward(p, io, (void *)state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_gdp_backward(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                    const gdp_delta_product_backward_io *io) {
  GDP_TRY(op_begin(ctx, "gdp_backward", NULL));
  GDP_TRY(gdp_cuda_delta_product_backward(p, io, (void *)state_of(ctx)->stream));
  return op_end(ctx);
}

static int cuda_gdp_backward_dh0_takes(gdp_ctx *ctx, const gdp_delta_product_problem *p) {
  (void)ctx;
  return gdp_cuda_delta_product_dh0_takes(p);
}

static gdp_status cuda_gdp_backward_dh0(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                        const gdp_delta_product_backward_io *io) {
  GDP_TRY(op_begin(ctx, "gdp_backward (dh0 alone)", NULL));
  GDP_TRY(gdp_cuda_delta_product_backward_dh0(p, io, (void *)state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_gdp_save_plan(gdp_ctx *ctx, const gdp_delta_product_problem *p, int *variant,
                                     size_t *bytes) {
  return gdp_cuda_delta_product_save_plan(p, variant, bytes);
}

static gdp_status cuda_gdp_forward_save(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                        const gdp_delta_product_forward_io *io, void *saved) {
  GDP_TRY(op_begin(ctx, "gdp_forward (saving for backward)", NULL));
  GDP_TRY(gdp_cuda_delta_product_forward_ex(p, io, (void *)state_of(ctx)->stream, saved));
  return op_end(ctx);
}

static gdp_status cuda_gdp_backward_saved(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                          const gdp_delta_product_backward_io *io, int variant,
                                          const void *saved) {
  GDP_TRY(op_begin(ctx, saved ? "gdp_backward (saved forward)" : "gdp_backward", NULL));
  GDP_TRY(gdp_cuda_delta_product_backward_ex(p, io, (void *)state_of(ctx)->stream, variant, saved));
  return op_end(ctx);
}

/* ------------------------------------------------------------------ mixer ops, L2 norm */

/* Records a mixer op as "<op> <dtype> [rows x cols]" (the buffers are raw pointers). */
static gdp_status mixer_begin(gdp_ctx *ctx, const char *op, gdp_dtype dtype, int64_t rows,
                              int64_t cols) {
  cuda_state *st = state_of(ctx);
  memcpy(st->prev_op, st->last_op, sizeof st->prev_op);
  snprintf(st->last_op, sizeof st->last_op, "%s %s [%lld x %lld]", op, gdp_dtype_name(dtype),
           (long long)rows, (long long)cols);
  GDP_CUDA_TRY(cudaSetDevice(ctx->index));
  return GDP_OK;
}

/* Scratch memory for a kernel (stream-ordered; freed right after the launch). */
static gdp_status mixer_workspace(gdp_ctx *ctx, size_t nbytes, void **out) {
  return device_alloc("cuda mixer workspace", ctx, nbytes, out);
}

/* A new device copy of a small host array the op layer owns (a kernel's side table),
 * queued on the ctx's stream; free it with device_free after the launch.  The copy is
 * from pageable memory, so it returns once staged and the op layer may free its array. */
static gdp_status host_array_to_device(gdp_ctx *ctx, const char *func, const char *what,
                                       const void *src, size_t nbytes, void **out) {
  *out = NULL;
  void *d = NULL;
  GDP_TRY(device_alloc(func, ctx, nbytes, &d));
  cudaError_t e = cudaMemcpyAsync(d, src, nbytes, cudaMemcpyHostToDevice, state_of(ctx)->stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    device_free(ctx, d);
    return GDP_ERROR_IN(func, GDP_ERR_CUDA, "copying %s to cuda:%d failed: %s (%s)", what,
                        ctx->index, cudaGetErrorName(e), cudaGetErrorString(e));
  }
  *out = d;
  return GDP_OK;
}

/* The conv's seq_start (a host array) on the device, or NULL when no token's sequence
 * starts after token 0 (no packing: the kernels read 0). */
static gdp_status conv_seq_start(gdp_ctx *ctx, const gdp_conv1d_problem *p, int64_t **out) {
  *out = NULL;
  int packed = 0;
  for (int64_t t = 0; t < p->T && !packed; t++) packed = p->seq_start[t] != 0;
  if (!packed) return GDP_OK;
  void *d = NULL;
  GDP_TRY(host_array_to_device(ctx, "cuda_conv1d", "the conv's sequence starts", p->seq_start,
                               (size_t)p->T * sizeof(int64_t), &d));
  *out = (int64_t *)d;
  return GDP_OK;
}

static gdp_status cuda_conv1d_forward(gdp_ctx *ctx, const gdp_conv1d_problem *p, const void *x,
                                      const void *wt, const void *bias, const void *halo,
                                      void *out) {
  GDP_TRY(mixer_begin(ctx, "conv1d_forward", (gdp_dtype)p->dtype, p->T * p->B, p->C));
  int64_t *seq = NULL;
  GDP_TRY(conv_seq_start(ctx, p, &seq));
  gdp_status s = gdp_cuda_conv1d_fwd(p, seq, x, wt, bias, halo, out, state_of(ctx)->stream);
  if (seq) device_free(ctx, seq);
  GDP_TRY(s);
  return op_end(ctx);
}

static gdp_status cuda_conv1d_backward(gdp_ctx *ctx, const gdp_conv1d_problem *p, const void *x,
                                       const void *wt, const void *bias, const void *halo,
                                       const void *d_out, void *dx, void *dweight, void *dbias,
                                       void *dhalo) {
  GDP_TRY(mixer_begin(ctx, "conv1d_backward", (gdp_dtype)p->dtype, p->T * p->B, p->C));
  int64_t *seq = NULL;
  void *ws = NULL;
  GDP_TRY(conv_seq_start(ctx, p, &seq));
  gdp_status s = GDP_OK;
  if (dweight || dbias) s = mixer_workspace(ctx, gdp_cuda_conv1d_bwd_workspace(p), &ws);
  if (s == GDP_OK)
    s = gdp_cuda_conv1d_bwd(p, seq, x, wt, bias, halo, d_out, dx, dweight, dbias, dhalo, ws,
                            state_of(ctx)->stream);
  if (ws) device_free(ctx, ws);
  if (seq) device_free(ctx, seq);
  GDP_TRY(s);
  return op_end(ctx);
}

static gdp_status cuda_optim_update(gdp_ctx *ctx, const gdp_optim_update *u) {
  GDP_TRY(mixer_begin(ctx, u->kind == GDP_OPTIM_ADAMW ? "adamw_step" : "sgd_step",
                      (gdp_dtype)u->param_dtype, u->n, 1));
  GDP_TRY(gdp_cuda_optim_update(u, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_beta_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t n, double scale,
                                    const void *b, void *beta) {
  GDP_TRY(mixer_begin(ctx, "beta_forward", dtype, n, 1));
  GDP_TRY(gdp_cuda_beta_fwd((int)dtype, n, scale, b, beta, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_beta_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t n, double scale,
                                     const void *b, const void *d_beta, void *db) {
  GDP_TRY(mixer_begin(ctx, "beta_backward", dtype, n, 1));
  GDP_TRY(gdp_cuda_beta_bwd((int)dtype, n, scale, b, d_beta, db, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_silu_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t C,
                                    const void *x, int64_t ld_x, void *out, int64_t ld_out) {
  GDP_TRY(mixer_begin(ctx, "silu_forward", dtype, rows, C));
  GDP_TRY(gdp_cuda_silu_fwd((int)dtype, rows, C, x, ld_x, out, ld_out, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_silu_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t C,
                                     const void *x, int64_t ld_x, const void *d_out,
                                     int64_t ld_d, void *dx, int64_t ld_dx) {
  GDP_TRY(mixer_begin(ctx, "silu_backward", dtype, rows, C));
  GDP_TRY(gdp_cuda_silu_bwd((int)dtype, rows, C, x, ld_x, d_out, ld_d, dx, ld_dx,
                            state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_decay_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                                     const void *a, const void *A_log, const void *dt_bias,
                                     void *g) {
  GDP_TRY(mixer_begin(ctx, "decay_forward", dtype, rows, H));
  GDP_TRY(gdp_cuda_decay_fwd((int)dtype, rows, H, a, A_log, dt_bias, g, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_decay_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                                      const void *a, const void *A_log, const void *dt_bias,
                                      const void *d_g, void *da, void *dA_log, void *ddt_bias) {
  GDP_TRY(mixer_begin(ctx, "decay_backward", dtype, rows, H));
  void *ws = NULL;
  GDP_TRY(mixer_workspace(ctx, gdp_cuda_decay_bwd_workspace(rows, H), &ws));
  gdp_status s = gdp_cuda_decay_bwd((int)dtype, rows, H, a, A_log, dt_bias, d_g, da, dA_log,
                                    ddt_bias, ws, state_of(ctx)->stream);
  device_free(ctx, ws);
  GDP_TRY(s);
  return op_end(ctx);
}

static gdp_status cuda_ssm_inputs_forward(gdp_ctx *ctx, const gdp_ssm_inputs_problem *p,
                                          const gdp_ssm_inputs_fwd_io *io) {
  GDP_TRY(mixer_begin(ctx, "ssm_inputs_forward", (gdp_dtype)p->dtype, p->T * p->B,
                      p->M * p->nh * p->P + (p->M + 1) * p->ng * p->N));
  GDP_TRY(gdp_cuda_ssm_inputs_fwd(p, io, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_ssm_inputs_backward(gdp_ctx *ctx, const gdp_ssm_inputs_problem *p,
                                           const gdp_ssm_inputs_bwd_io *io) {
  GDP_TRY(mixer_begin(ctx, "ssm_inputs_backward", (gdp_dtype)p->dtype, p->T * p->B,
                      p->M * p->nh * p->P + (p->M + 1) * p->ng * p->N));
  void *ws = NULL;
  GDP_TRY(mixer_workspace(ctx, gdp_cuda_ssm_inputs_bwd_workspace(p), &ws));
  gdp_status s = gdp_cuda_ssm_inputs_bwd(p, io, ws, state_of(ctx)->stream);
  device_free(ctx, ws);
  GDP_TRY(s);
  return op_end(ctx);
}

static gdp_status cuda_out_norm_forward(gdp_ctx *ctx, const gdp_out_norm_problem *p,
                                       const void *o, const void *x_v, const void *D,
                                       const void *z, const void *weight, void *out) {
  GDP_TRY(mixer_begin(ctx, "out_norm_forward", (gdp_dtype)p->dtype, p->T * p->B, p->H * p->P));
  GDP_TRY(gdp_cuda_out_norm_fwd(p, o, x_v, D, z, weight, out, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_out_norm_backward(gdp_ctx *ctx, const gdp_out_norm_problem *p,
                                        const void *o, const void *x_v, const void *D,
                                        const void *z, const void *weight, const void *d_out,
                                        void *d_o, void *dz, void *dx_v, void *dD, void *dweight) {
  GDP_TRY(mixer_begin(ctx, "out_norm_backward", (gdp_dtype)p->dtype, p->T * p->B, p->H * p->P));
  void *ws = NULL;
  if (dD || dweight) GDP_TRY(mixer_workspace(ctx, gdp_cuda_out_norm_bwd_workspace(p), &ws));
  gdp_status s = gdp_cuda_out_norm_bwd(p, o, x_v, D, z, weight, d_out, d_o, dz, dx_v, dD, dweight,
                                       ws, state_of(ctx)->stream);
  if (ws) device_free(ctx, ws);
  GDP_TRY(s);
  return op_end(ctx);
}

static gdp_status cuda_dskip_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                                     int64_t P, int per_channel, const void *y, const void *x_v,
                                     const void *D, void *out) {
  GDP_TRY(mixer_begin(ctx, "dskip_forward", dtype, rows, H * P));
  GDP_TRY(gdp_cuda_dskip_fwd((int)dtype, rows, H, P, per_channel, y, x_v, D, out,
                             state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_dskip_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                                      int64_t P, int per_channel, const void *x_v, const void *D,
                                      const void *d_out, void *dx_v, void *dD) {
  GDP_TRY(mixer_begin(ctx, "dskip_backward", dtype, rows, H * P));
  void *ws = NULL;
  if (dD) GDP_TRY(mixer_workspace(ctx, gdp_cuda_dskip_bwd_workspace(rows, H, P), &ws));
  gdp_status s = gdp_cuda_dskip_bwd((int)dtype, rows, H, P, per_channel, x_v, D, d_out, dx_v,
                                    dD, ws, state_of(ctx)->stream);
  if (ws) device_free(ctx, ws);
  GDP_TRY(s);
  return op_end(ctx);
}

static gdp_status cuda_l2norm_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t dim,
                                      double eps, const void *x, void *y) {
  GDP_TRY(mixer_begin(ctx, "l2norm_forward", dtype, rows, dim));
  GDP_TRY(gdp_cuda_l2norm_fwd((int)dtype, rows, dim, eps, x, y, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_l2norm_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t dim,
                                       double eps, const void *x, const void *dy, void *dx) {
  GDP_TRY(mixer_begin(ctx, "l2norm_backward", dtype, rows, dim));
  GDP_TRY(gdp_cuda_l2norm_bwd((int)dtype, rows, dim, eps, x, dy, dx, state_of(ctx)->stream));
  return op_end(ctx);
}

/* ------------------------------------------------------------------ synthetic data */

static gdp_status cuda_state_tracking(gdp_ctx *ctx, const gdp_state_tracking_problem *p,
                                      int32_t *tokens, int32_t *labels) {
  GDP_TRY(mixer_begin(ctx, "state_tracking", GDP_DTYPE_I32, p->batch, p->length));
  void *mul = NULL;
  if (p->mul)
    GDP_TRY(host_array_to_device(ctx, "cuda_state_tracking", "the product table", p->mul,
                                 (size_t)(p->num_elements * p->num_elements), &mul));
  gdp_status s = gdp_cuda_state_tracking(p, (const uint8_t *)mul, tokens, labels,
                                         state_of(ctx)->stream);
  if (mul) device_free(ctx, mul);
  GDP_TRY(s);
  return op_end(ctx);
}

/* ------------------------------------------------------------------ model layer ops */

/* A device word for the kernels' first out-of-range position, set to all ones (none). */
static gdp_status fault_word(gdp_ctx *ctx, unsigned long long **out) {
  *out = NULL;
  void *d = NULL;
  GDP_TRY(mixer_workspace(ctx, sizeof(unsigned long long), &d));
  cudaError_t e = cudaMemsetAsync(d, 0xff, sizeof(unsigned long long), state_of(ctx)->stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    device_free(ctx, d);
    return GDP_ERROR(GDP_ERR_CUDA, "clearing the index check's word on cuda:%d failed: %s (%s)",
                     ctx->index, cudaGetErrorName(e), cudaGetErrorString(e));
  }
  *out = (unsigned long long *)d;
  return GDP_OK;
}

/* Queues the verdict of an index check: after the kernels that set *word (fault_word),
 * the device writes {first bad position or -1, its value in ids} into the next pair of
 * check slots, and the next wait reports it (stream_sync).  The word and ids may be
 * freed once this is queued (stream-ordered). */
static gdp_status defer_check(gdp_ctx *ctx, const unsigned long long *word, const void *ids,
                              int ids_dtype, const gdp_index_check *check) {
  cuda_state *st = state_of(ctx);
  if (st->n_pending == kPendingChecks) GDP_TRY(stream_sync(ctx));
  const int i = st->n_pending;
  GDP_TRY(gdp_cuda_index_fault(word, ids, ids_dtype, st->check_slots_dev + 2 * i, st->stream));
  st->pending[i] = *check;
  st->n_pending = i + 1;
  return GDP_OK;
}

static gdp_status cuda_silu_mul_forward(gdp_ctx *ctx, gdp_dtype dtype, int64_t n,
                                        const void *gate, const void *up, void *out) {
  GDP_TRY(mixer_begin(ctx, "silu_mul_forward", dtype, n, 1));
  GDP_TRY(gdp_cuda_silu_mul_fwd((int)dtype, n, gate, up, out, state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_silu_mul_backward(gdp_ctx *ctx, gdp_dtype dtype, int64_t n,
                                         const void *gate, const void *up, const void *d_out,
                                         void *d_gate, void *d_up) {
  GDP_TRY(mixer_begin(ctx, "silu_mul_backward", dtype, n, 1));
  GDP_TRY(gdp_cuda_silu_mul_bwd((int)dtype, n, gate, up, d_out, d_gate, d_up,
                                state_of(ctx)->stream));
  return op_end(ctx);
}

static gdp_status cuda_embedding_forward(gdp_ctx *ctx, const gdp_embedding_problem *p,
                                         const void *weight, void *out) {
  GDP_TRY(mixer_begin(ctx, "embedding_forward", (gdp_dtype)p->dtype, p->n, p->D));
  unsigned long long *bad = NULL;
  GDP_TRY(fault_word(ctx, &bad));
  gdp_status s = gdp_cuda_embedding_fwd(p->dtype, p->n, p->D, p->V, p->ids, p->ids_dtype, weight,
                                        out, bad, state_of(ctx)->stream);
  if (s == GDP_OK) s = defer_check(ctx, bad, p->ids, p->ids_dtype, p->check);
  device_free(ctx, bad);
  GDP_TRY(s);
  return op_end(ctx);
}

static gdp_status cuda_embedding_backward(gdp_ctx *ctx, const gdp_embedding_problem *p,
                                          const void *d_out, void *dweight) {
  GDP_TRY(mixer_begin(ctx, "embedding_backward", (gdp_dtype)p->dtype, p->n, p->D));
  const size_t ws_bytes = gdp_cuda_embedding_bwd_workspace(p->dtype, p->n, p->V, p->D);
  if (ws_bytes == 0)
    return GDP_ERROR(GDP_ERR_CUDA, "sizing the embedding backward's sort on cuda:%d failed",
                     ctx->index);
  unsigned long long *bad = NULL;
  void *ws = NULL;
  GDP_TRY(fault_word(ctx, &bad));
  gdp_status s = mixer_workspace(ctx, ws_bytes, &ws);
  if (s == GDP_OK)
    s = gdp_cuda_embedding_bwd(p->dtype, p->n, p->V, p->D, p->ids, p->ids_dtype, d_out, dweight,
                               ws, bad, state_of(ctx)->stream);
  if (s == GDP_OK) s = defer_check(ctx, bad, p->ids, p->ids_dtype, p->check);
  if (ws) device_free(ctx, ws);
  device_free(ctx, bad);
  GDP_TRY(s);
  return op_end(ctx);
}

static gdp_status cuda_cross_entropy(gdp_ctx *ctx, const gdp_cross_entropy_problem *p,
                                     const void *logits, void *result, void *dlogits) {
  GDP_TRY(mixer_begin(ctx, "cross_entropy", (gdp_dtype)p->dtype, p->rows, p->V));
  void *ws = NULL, *res = NULL;
  gdp_status s = mixer_workspace(ctx, gdp_cuda_cross_entropy_workspace(p->rows), &ws);
  if (s == GDP_OK) s = mixer_workspace(ctx, sizeof(gdp_cuda_xent_result), &res);
  if (s == GDP_OK)
    s = gdp_cuda_cross_entropy(p->dtype, p->rows, p->V, p->ids, p->ids_dtype, p->mask,
                               p->ignore_index, logits, dlogits, (gdp_cuda_xent_result *)res,
                               (double *)result, ws, state_of(ctx)->stream);
  if (s == GDP_OK)
    s = defer_check(ctx, &((gdp_cuda_xent_result *)res)->first_bad, p->ids, p->ids_dtype,
                    p->check);
  if (res) device_free(ctx, res);
  if (ws) device_free(ctx, ws);
  GDP_TRY(s);
  return op_end(ctx);
}

/* ------------------------------------------------------------------ capabilities */

static int cuda_supports(gdp_op op, gdp_dtype dtype) {
  int is_float = dtype == GDP_DTYPE_F64 || dtype == GDP_DTYPE_F32 || dtype == GDP_DTYPE_BF16;
  switch (op) {
    case GDP_OP_COPY:
    case GDP_OP_ELEMENTWISE:
    case GDP_OP_REDUCE: return (int)dtype >= 0 && dtype < GDP_DTYPE_COUNT;
    case GDP_OP_RNG: return is_float;
    case GDP_OP_MATMUL: return is_float;
    /* The kernels answer per problem (gdp_cuda_delta_product_supported); per dtype these two. */
    case GDP_OP_GDP_FORWARD:
    case GDP_OP_GDP_BACKWARD: return dtype == GDP_DTYPE_F32 || dtype == GDP_DTYPE_BF16;
    default: return 0;
  }
}

/* ------------------------------------------------------------------ device timer */

static gdp_status cuda_timer_start(gdp_ctx *ctx, double hold_ms) {
  cuda_state *st = state_of(ctx);
  GDP_CUDA_TRY(cudaSetDevice(ctx->index));
  for (int i = 0; i < 2; i++)
    if (!st->timer_mark[i]) GDP_CUDA_TRY(cudaEventCreate(&st->timer_mark[i]));
  /* earlier work first, so that the spin starts now and holds the stream for the whole
   * of hold_ms while the caller queues */
  gdp_status s = stream_sync(ctx);
  if (s != GDP_OK) return s;
  GDP_CUDA_TRY(gdp_cuda_spin(hold_ms, st->stream));
  GDP_CUDA_TRY(cudaEventRecord(st->timer_mark[0], st->stream));
  st->timer_started = 1;
  return GDP_OK;
}

static gdp_status cuda_timer_stop(gdp_ctx *ctx, double *device_ms) {
  cuda_state *st = state_of(ctx);
  if (!st->timer_started)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "gdp_ctx_timer_stop: no gdp_ctx_timer_start pending on this context");
  st->timer_started = 0;
  GDP_CUDA_TRY(cudaSetDevice(ctx->index));
  GDP_CUDA_TRY(cudaEventRecord(st->timer_mark[1], st->stream));
  gdp_status s = stream_sync(ctx);
  if (s != GDP_OK) return s;
  float ms = 0.f;
  GDP_CUDA_TRY(cudaEventElapsedTime(&ms, st->timer_mark[0], st->timer_mark[1]));
  *device_ms = ms;
  return GDP_OK;
}

const gdp_backend gdp_backend_cuda = {
    .name = "cuda",
    .type = GDP_DEVICE_CUDA,
    .device_count = cuda_device_count,
    .ctx_init = cuda_ctx_init,
    .ctx_fini = cuda_ctx_fini,
    .alloc = cuda_alloc,
    .release = cuda_release,
    .sync = cuda_sync,
    .to_device = cuda_to_device,
    .to_host = cuda_to_host,
    .copy = cuda_copy,
    .fill = cuda_fill,
    .rng = cuda_rng,
    .binary = cuda_binary,
    .reduce = cuda_reduce,
    .reduce_many = cuda_reduce_many,
    .matmul = cuda_matmul,
    .gdp_forward = cuda_gdp_forward,
    .gdp_path = gdp_cuda_delta_product_path,
    .gdp_backward = cuda_gdp_backward,
    .gdp_backward_dh0_takes = cuda_gdp_backward_dh0_takes,
    .gdp_backward_dh0 = cuda_gdp_backward_dh0,
    .gdp_save_plan = cuda_gdp_save_plan,
    .gdp_forward_save = cuda_gdp_forward_save,
    .gdp_backward_saved = cuda_gdp_backward_saved,
    .l2norm_forward = cuda_l2norm_forward,
    .l2norm_backward = cuda_l2norm_backward,
    .conv1d_forward = cuda_conv1d_forward,
    .conv1d_backward = cuda_conv1d_backward,
    .beta_forward = cuda_beta_forward,
    .beta_backward = cuda_beta_backward,
    .silu_forward = cuda_silu_forward,
    .silu_backward = cuda_silu_backward,
    .decay_forward = cuda_decay_forward,
    .decay_backward = cuda_decay_backward,
    .out_norm_forward = cuda_out_norm_forward,
    .out_norm_backward = cuda_out_norm_backward,
    .dskip_forward = cuda_dskip_forward,
    .dskip_backward = cuda_dskip_backward,
    .ssm_inputs_forward = cuda_ssm_inputs_forward,
    .ssm_inputs_backward = cuda_ssm_inputs_backward,
    .state_tracking = cuda_state_tracking,
    .optim_update = cuda_optim_update,
    .silu_mul_forward = cuda_silu_mul_forward,
    .silu_mul_backward = cuda_silu_mul_backward,
    .embedding_forward = cuda_embedding_forward,
    .embedding_backward = cuda_embedding_backward,
    .cross_entropy = cuda_cross_entropy,
    .mixer_bf16 = 1,
    .device_indices = 1,
    .supports = cuda_supports,
    .timer_start = cuda_timer_start,
    .timer_stop = cuda_timer_stop,
};
