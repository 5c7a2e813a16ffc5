/*
 * comm.c -- gdp_comm: collectives on CPU tensors over MPI, and the size-1 path that
 * every build has (gdp_comm_self, and gdp_comm_world outside mpirun).
 *
 * Layering: each public collective validates its arguments locally, agrees on them
 * across ranks (by default; GDP_COMM_CHECK=0 or gdp_comm_set_check opts out: one small
 * all-gather of a fixed metadata record per call), stages non-contiguous tensors through
 * contiguous scratch tensors, then calls a "raw" helper that works on contiguous
 * buffers, and finally counts the payload bytes.  The raw helpers are the only code
 * that calls MPI; every MPI call goes through GDP_MPI_TRY, and our communicators use
 * MPI_ERRORS_RETURN, so an MPI failure becomes GDP_ERR_MPI instead of an abort.
 *
 * Counts: MPI takes int counts.  Elementwise operations (allreduce, broadcast, point
 * to point) are cut into pieces of at most max_count elements; gathers and
 * all-to-alls switch to a contiguous block/row datatype when element counts would not
 * fit, and fail clearly when even that does not fit.  max_count is INT_MAX unless
 * GDP_COMM_MAX_COUNT lowers it (so that the tests exercise those paths on small data).
 */
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#ifdef GDP_HAVE_MPI
#include <mpi.h>
#endif
#ifdef GDP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#if defined(GDP_HAVE_NCCL) && defined(GDP_HAVE_MPI)
#include <nccl.h>
#include <time.h>
#define COMM_NCCL 1
#endif

/* How a communicator moves cuda tensors, chosen by the first collective that carries
 * one (collective: every rank reaches the same choice; see choose_transport). */
typedef enum {
  TRANSPORT_UNDECIDED = 0,
  TRANSPORT_STAGED = 1, /* device -> host copy, the MPI (or size-1) path, host -> device */
  TRANSPORT_NCCL = 2    /* NCCL on the device buffers, on the tensor's context's stream */
} cuda_transport;

struct gdp_comm {
  atomic_int refcount;
  int rank, size;
  int is_mpi;
  int check;         /* agree on the arguments before each collective (default; GDP_COMM_CHECK=0 off) */
  int64_t max_count; /* most elements per MPI call (see the top of this file) */
  int64_t sent, received;         /* payload to / from other ranks */
  int64_t sent_all, received_all; /* the same with this rank's own block counted */
  int transport;       /* cuda_transport, for cuda tensors */
  int cuda_index;      /* under NCCL: the device the NCCL communicator was made on */
  gdp_ctx *host;       /* cpu context of the host staging buffers (made on first use) */
  double nccl_timeout_s; /* GDP_NCCL_TIMEOUT (seconds; default 300) */
#ifdef GDP_HAVE_MPI
  MPI_Comm mpi;
#endif
#ifdef COMM_NCCL
  ncclComm_t nccl;
#endif
};

/* Bytes of one rank's record in gdp_comm_agree_status: its status, then its message. */
enum { AGREE_RECORD_BYTES = 1024, AGREE_MAX_LISTED = 16 };

/* ------------------------------------------------------------------ small helpers */

#ifdef GDP_HAVE_MPI
/* Appends printf-style text to a fixed buffer, silently truncating (messages only). */
typedef struct {
  char *buf;
  size_t cap, len;
} strbuf;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void sb_printf(strbuf *sb, const char *fmt, ...) {
  if (sb->len + 1 >= sb->cap) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(sb->buf + sb->len, sb->cap - sb->len, fmt, ap);
  va_end(ap);
  if (n > 0) sb->len += (size_t)n < sb->cap - sb->len ? (size_t)n : sb->cap - sb->len - 1;
}
#endif

static int64_t env_int(const char *name, int64_t fallback, int64_t lo, int64_t hi) {
  const char *s = getenv(name);
  if (!s || !*s) return fallback;
  char *end = NULL;
  long long v = strtoll(s, &end, 10);
  if (end == s || *end != '\0' || v < lo || v > hi) return fallback;
  return (int64_t)v;
}

static gdp_comm *comm_new(int rank, int size, int is_mpi) {
  gdp_comm *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  atomic_init(&c->refcount, 1);
  c->rank = rank;
  c->size = size;
  c->is_mpi = is_mpi;
  c->check = env_int("GDP_COMM_CHECK", 1, 0, 1) == 1;
  c->max_count = env_int("GDP_COMM_MAX_COUNT", INT_MAX, 1, INT_MAX);
  c->nccl_timeout_s = (double)env_int("GDP_NCCL_TIMEOUT", 300, 1, 86400 * 7);
  c->cuda_index = -1;
  return c;
}

static int64_t numel(const gdp_tensor *t) { return gdp_tensor_numel(t); }

static size_t nbytes(const gdp_tensor *t) {
  return (size_t)numel(t) * gdp_dtype_size(t->dtype);
}

static const char *shape_of(char *buf, size_t len, const gdp_tensor *t) {
  return gdp_shape_str(buf, len, t->ndim, t->shape);
}

static gdp_status check_comm(const char *func, const gdp_comm *c) {
  if (!c) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "c (the communicator) is NULL");
  return GDP_OK;
}

static gdp_device_type device_of(const gdp_tensor *t) { return t->storage->ctx->type; }
static int on_cuda(const gdp_tensor *t) { return t && device_of(t) == GDP_DEVICE_CUDA; }

static gdp_status check_tensor(const char *func, const gdp_comm *c, const char *what,
                               const gdp_tensor *t) {
  if (!t) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s is NULL", what);
  if (device_of(t) != GDP_DEVICE_CPU && device_of(t) != GDP_DEVICE_CUDA)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                        "%s is a %s tensor; collectives carry cpu and cuda tensors", what,
                        gdp_device_type_name(device_of(t)));
  if (on_cuda(t) && c->transport == TRANSPORT_NCCL && t->storage->ctx->index != c->cuda_index)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "%s is on cuda:%d, but this communicator's NCCL communicator is on "
                        "cuda:%d (one GPU per rank)",
                        what, t->storage->ctx->index, c->cuda_index);
  return GDP_OK;
}

/* After the agreement: the first collective carrying cuda tensors chooses the
 * transport (collective), and a cuda tensor under NCCL names its context, whose stream
 * NCCL runs on (NULL: the MPI path, host-staged for cuda tensors). */
static gdp_status choose_transport(const char *func, gdp_comm *c, int device);

static gdp_status ready_for(const char *func, gdp_comm *c, const gdp_tensor *t) {
  if (!on_cuda(t) || c->transport != TRANSPORT_UNDECIDED) return GDP_OK;
  return choose_transport(func, c, t->storage->ctx->index);
}

static gdp_ctx *nccl_ctx(const gdp_comm *c, const gdp_tensor *t) {
  return on_cuda(t) && c->transport == TRANSPORT_NCCL ? t->storage->ctx : NULL;
}

/* Both tensors of one call live on one device (a collective does not move tensors
 * between devices). */
static gdp_status check_same_device(const char *func, const char *a_name, const gdp_tensor *a,
                                    const char *b_name, const gdp_tensor *b) {
  if (!a || !b) return GDP_OK;
  gdp_ctx *x = a->storage->ctx, *y = b->storage->ctx;
  if (x->type == y->type && (x->type == GDP_DEVICE_CPU || x->index == y->index)) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                      "%s is on %s:%d but %s on %s:%d; a collective's tensors live on one device",
                      a_name, gdp_device_type_name(x->type), x->index, b_name,
                      gdp_device_type_name(y->type), y->index);
}

static gdp_status check_peer(const char *func, const char *what, const gdp_comm *c, int peer,
                             int allow_none) {
  if (peer >= 0 && peer < c->size) return GDP_OK;
  if (allow_none && peer == -1) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected a rank in [0, %d)%s, got %d", what,
                      c->size, allow_none ? " or -1 (none)" : "", peer);
}

static gdp_status check_tag(const char *func, int tag) {
  if (tag < 0) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "tag: expected >= 0, got %d", tag);
  return GDP_OK;
}

static int overlaps(const gdp_tensor *a, const gdp_tensor *b) {
  return a && b && a->storage == b->storage;
}

/* Host staging: a cuda tensor moves over MPI (or the size-1 path) through a host copy.
 * The device -> host copy runs on the tensor's context's stream and waits for it
 * (work queued before the collective is finished first); the host -> device copy back
 * (finish_output) is queued on that stream from pageable memory, which returns once
 * the data is staged, so the host buffer may be freed at once. */
static int host_staged(const gdp_comm *c, const gdp_tensor *t) {
  return on_cuda(t) && c->transport != TRANSPORT_NCCL;
}

static gdp_status host_copy(gdp_comm *c, const gdp_tensor *t, int keep_values, gdp_tensor **out) {
  *out = NULL;
  if (!c->host) GDP_TRY(gdp_ctx_new(GDP_DEVICE_CPU, 0, &c->host));
  gdp_tensor *h = NULL;
  GDP_TRY(gdp_tensor_empty(c->host, t->dtype, t->ndim, t->shape, &h));
  if (keep_values) {
    gdp_status st = gdp_tensor_copy(NULL, h, t);
    if (st != GDP_OK) {
      gdp_tensor_free(h);
      return st;
    }
  }
  *out = h;
  return GDP_OK;
}

/* A contiguous tensor holding t's values, on the host when t is host-staged (a new
 * reference to t when it already is contiguous and needs no staging). */
static gdp_status staged_input(gdp_comm *c, const gdp_tensor *t, gdp_tensor **out) {
  if (host_staged(c, t)) return host_copy(c, t, 1, out);
  return gdp_tensor_contiguous((gdp_tensor *)t, out);
}

/* Like staged_input, but never t itself (for inputs that share storage with an output). */
static gdp_status staged_copy(gdp_comm *c, const gdp_tensor *t, gdp_tensor **out) {
  if (host_staged(c, t)) return host_copy(c, t, 1, out);
  return gdp_tensor_clone((gdp_tensor *)t, out);
}

/* Where a result is written: t itself when contiguous (and not host-staged), else a
 * contiguous scratch tensor (holding t's values when keep_values), copied back by
 * finish_output. */
static gdp_status staged_output(gdp_comm *c, gdp_tensor *t, int keep_values, gdp_tensor **out) {
  if (host_staged(c, t)) return host_copy(c, t, keep_values, out);
  if (gdp_tensor_is_contiguous(t)) {
    *out = gdp_tensor_retain(t);
    return GDP_OK;
  }
  if (keep_values) return gdp_tensor_clone(t, out);
  return gdp_tensor_empty(t->storage->ctx, t->dtype, t->ndim, t->shape, out);
}

static gdp_status finish_output(gdp_tensor *t, gdp_tensor *scratch) {
  if (scratch == t) return GDP_OK;
  return gdp_tensor_copy(NULL, t, scratch);
}

/* ------------------------------------------------------------------ MPI plumbing */

#ifdef GDP_HAVE_MPI

/* Records "<stmt> failed: <MPI's error string> (MPI error class N)" as GDP_ERR_MPI. */
static gdp_status mpi_error(const char *func, const char *file, int line, const char *stmt,
                            int rc) {
  char text[MPI_MAX_ERROR_STRING + 1];
  int len = 0, cls = -1;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  text[len > 0 ? len : 0] = '\0';
  if (len <= 0) snprintf(text, sizeof text, "unknown MPI error %d", rc);
  MPI_Error_class(rc, &cls);
  return gdp_set_error(GDP_ERR_MPI, func, file, line, "%s failed: %s (MPI error class %d)", stmt,
                       text, cls);
}

/* Runs an MPI call; on failure records the statement and MPI's error string and returns
 * GDP_ERR_MPI.  Expects `const char *func` (the public entry point) in scope. */
#define GDP_MPI_TRY(stmt)                                                     \
  do {                                                                        \
    int gdp_mpi_rc_ = (stmt);                                                 \
    if (gdp_mpi_rc_ != MPI_SUCCESS)                                           \
      return mpi_error(func, __FILE__, __LINE__, #stmt, gdp_mpi_rc_);         \
  } while (0)

static MPI_Datatype mpi_type(gdp_dtype dt) {
  switch (dt) {
    case GDP_DTYPE_F64: return MPI_DOUBLE;
    case GDP_DTYPE_F32: return MPI_FLOAT;
    case GDP_DTYPE_BF16: return MPI_UINT16_T; /* moved as bits; reduced via float32 */
    case GDP_DTYPE_I32: return MPI_INT32_T;
    case GDP_DTYPE_I64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
  }
}

static MPI_Op mpi_op(gdp_reduce_op op) {
  return op == GDP_REDUCE_OP_MAX ? MPI_MAX : op == GDP_REDUCE_OP_MIN ? MPI_MIN : MPI_SUM;
}

/* A committed datatype of n contiguous `base` elements (n <= INT_MAX). */
static gdp_status contiguous_type(const char *func, int64_t n, MPI_Datatype base,
                                  MPI_Datatype *out) {
  GDP_MPI_TRY(MPI_Type_contiguous((int)n, base, out));
  int rc = MPI_Type_commit(out);
  if (rc != MPI_SUCCESS) {
    MPI_Type_free(out);
    return mpi_error(func, __FILE__, __LINE__, "MPI_Type_commit(out)", rc);
  }
  return GDP_OK;
}

static int launched_by_mpirun(void) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
                                     "MPI_LOCALNRANKS"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
    if (getenv(vars[i])) return 1;
  return 0;
}

static gdp_comm *world_comm;
static int we_initialised_mpi;

/* atexit: after the program's own clean-up (LuaJIT's finalizers run before exit
 * handlers), drop the process-wide reference and finalise MPI if we started it. */
static void finalize_at_exit(void) {
  gdp_comm *w = world_comm;
  world_comm = NULL;
  gdp_comm_free(w);
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (we_initialised_mpi && !finalized) MPI_Finalize();
}

static gdp_status mpi_world(gdp_comm **out) {
  const char *func = "gdp_comm_world";
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized)
    return GDP_ERROR_IN(func, GDP_ERR_MPI, "MPI has already been finalised in this process");
  if (!initialized) {
    int provided = 0;
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS)
      return mpi_error(func, __FILE__, __LINE__, "MPI_Init_thread(FUNNELED)", rc);
    we_initialised_mpi = 1;
    /* We own MPI now: make MPI_COMM_WORLD itself return errors too (MPI_Comm_dup below). */
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  static int exit_handler_registered;
  if (!exit_handler_registered) exit_handler_registered = atexit(finalize_at_exit) == 0;
  MPI_Comm dup = MPI_COMM_NULL;
  GDP_MPI_TRY(MPI_Comm_dup(MPI_COMM_WORLD, &dup));
  GDP_MPI_TRY(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  int rank = 0, size = 1;
  GDP_MPI_TRY(MPI_Comm_rank(dup, &rank));
  GDP_MPI_TRY(MPI_Comm_size(dup, &size));
  gdp_comm *c = comm_new(rank, size, 1);
  if (!c) {
    MPI_Comm_free(&dup);
    return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate the communicator");
  }
  c->mpi = dup;
  *out = c;
  return GDP_OK;
}

#endif /* GDP_HAVE_MPI */

/* ------------------------------------------------------------------ NCCL */

#ifdef COMM_NCCL
/* The cuda context's stream (backend_cuda.c). */
void *gdp_cuda_ctx_stream(const gdp_ctx *ctx);

static cudaStream_t stream_of(gdp_ctx *ctx) { return (cudaStream_t)gdp_cuda_ctx_stream(ctx); }

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Aborts the NCCL communicator (after a failure or a timeout); later cuda collectives
 * on c fail at once. */
static void nccl_kill(gdp_comm *c) {
  if (c->nccl) ncclCommAbort(c->nccl);
  c->nccl = NULL;
}

static gdp_status nccl_fail(const char *func, gdp_comm *c, const char *what, const char *why) {
  nccl_kill(c);
  return GDP_ERROR_IN(func, GDP_ERR_NCCL,
                      "%s on rank %d of %d (NCCL): %s; the NCCL communicator was aborted", what,
                      c->rank, c->size, why);
}

/* Issues nothing: checks that c's NCCL communicator is usable and makes its device
 * current (NCCL calls need it). */
static gdp_status nccl_begin(const char *func, gdp_comm *c, const char *what) {
  if (!c->nccl)
    return GDP_ERROR_IN(func, GDP_ERR_NCCL,
                        "%s on rank %d of %d: the NCCL communicator was aborted by an earlier "
                        "failure; make a new communicator",
                        what, c->rank, c->size);
  cudaError_t e = cudaSetDevice(c->cuda_index);
  if (e != cudaSuccess)
    return GDP_ERROR_IN(func, GDP_ERR_CUDA, "cudaSetDevice(%d): %s", c->cuda_index,
                        cudaGetErrorString(e));
  return GDP_OK;
}

/* The watch: after the calls are issued (r: the result of issuing them), waits for the
 * stream, polling NCCL's asynchronous error, for at most GDP_NCCL_TIMEOUT seconds; a
 * failure or the timeout aborts the communicator, so no rank waits forever. */
static gdp_status nccl_watch(const char *func, gdp_comm *c, gdp_ctx *nx, const char *what,
                             ncclResult_t r) {
  char why[400];
  if (r != ncclSuccess && r != ncclInProgress) {
    snprintf(why, sizeof why, "issuing it failed: %s", ncclGetErrorString(r));
    return nccl_fail(func, c, what, why);
  }
  cudaStream_t s = stream_of(nx);
  double t0 = now_s();
  for (;;) {
    cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return GDP_OK;
    if (q != cudaErrorNotReady) {
      snprintf(why, sizeof why, "the stream failed: %s", cudaGetErrorString(q));
      return nccl_fail(func, c, what, why);
    }
    ncclResult_t ar = ncclSuccess;
    if (ncclCommGetAsyncError(c->nccl, &ar) == ncclSuccess && ar != ncclSuccess &&
        ar != ncclInProgress) {
      snprintf(why, sizeof why, "asynchronous error: %s", ncclGetErrorString(ar));
      return nccl_fail(func, c, what, why);
    }
    if (now_s() - t0 > c->nccl_timeout_s) {
      snprintf(why, sizeof why,
               "not complete after %.0f s (GDP_NCCL_TIMEOUT): another rank of the %d died, "
               "hangs, or called a different collective",
               c->nccl_timeout_s, c->size);
      return nccl_fail(func, c, what, why);
    }
    struct timespec pause = {0, 100000}; /* 0.1 ms */
    nanosleep(&pause, NULL);
  }
}

static ncclDataType_t nccl_type(gdp_dtype dt) {
  switch (dt) {
    case GDP_DTYPE_F64: return ncclFloat64;
    case GDP_DTYPE_I32: return ncclInt32;
    case GDP_DTYPE_I64: return ncclInt64;
    default: return ncclFloat32; /* bf16 is reduced as float32 by the caller */
  }
}

static ncclRedOp_t nccl_op(gdp_reduce_op op) {
  return op == GDP_REDUCE_OP_MAX ? ncclMax : op == GDP_REDUCE_OP_MIN ? ncclMin : ncclSum;
}

/* Payload moves as bytes (ncclUint8): no dtype can be misread on the way. */
static gdp_status nccl_allgather(const char *func, gdp_comm *c, gdp_ctx *nx, const void *send,
                                 void *recv, size_t block_bytes) {
  GDP_TRY(nccl_begin(func, c, "allgather"));
  if (!send) send = (const char *)recv + (size_t)c->rank * block_bytes;
  ncclResult_t r = ncclAllGather(send, recv, block_bytes, ncclUint8, c->nccl, stream_of(nx));
  return nccl_watch(func, c, nx, "allgather", r);
}

static gdp_status nccl_alltoallv(const char *func, gdp_comm *c, gdp_ctx *nx, const void *send,
                                 const int64_t *send_rows, void *recv, const int64_t *recv_rows,
                                 size_t row_bytes) {
  GDP_TRY(nccl_begin(func, c, "all-to-all"));
  cudaStream_t s = stream_of(nx);
  ncclResult_t r = ncclGroupStart();
  size_t soff = 0, roff = 0;
  for (int j = 0; j < c->size && r == ncclSuccess; j++) {
    size_t sb = (size_t)send_rows[j] * row_bytes, rb = (size_t)recv_rows[j] * row_bytes;
    if (sb) r = ncclSend((const char *)send + soff, sb, ncclUint8, j, c->nccl, s);
    if (rb && r == ncclSuccess) r = ncclRecv((char *)recv + roff, rb, ncclUint8, j, c->nccl, s);
    soff += sb;
    roff += rb;
  }
  ncclResult_t g = ncclGroupEnd();
  return nccl_watch(func, c, nx, "all-to-all", r != ncclSuccess ? r : g);
}

static gdp_status nccl_allreduce(const char *func, gdp_comm *c, gdp_ctx *nx, void *buf, int64_t n,
                                 gdp_dtype dt, gdp_reduce_op op) {
  GDP_TRY(nccl_begin(func, c, "all-reduce"));
  ncclResult_t r = ncclAllReduce(buf, buf, (size_t)n, nccl_type(dt), nccl_op(op), c->nccl,
                                 stream_of(nx));
  return nccl_watch(func, c, nx, "all-reduce", r);
}

static gdp_status nccl_broadcast(const char *func, gdp_comm *c, gdp_ctx *nx, void *buf,
                                 size_t bytes, int root) {
  GDP_TRY(nccl_begin(func, c, "broadcast"));
  ncclResult_t r = ncclBroadcast(buf, buf, bytes, ncclUint8, root, c->nccl, stream_of(nx));
  return nccl_watch(func, c, nx, "broadcast", r);
}

/* NCCL has no tags and cannot see a size mismatch (the watch's timeout catches a
 * receive that never completes). */
static gdp_status nccl_sendrecv(const char *func, gdp_comm *c, gdp_ctx *nx, const void *send,
                                size_t send_bytes, int dst, void *recv, size_t recv_bytes,
                                int src) {
  char what[96];
  snprintf(what, sizeof what, "send/recv (to rank %d, from rank %d)", dst, src);
  GDP_TRY(nccl_begin(func, c, what));
  cudaStream_t s = stream_of(nx);
  ncclResult_t r = ncclGroupStart();
  if (dst >= 0 && r == ncclSuccess) r = ncclSend(send, send_bytes, ncclUint8, dst, c->nccl, s);
  if (src >= 0 && r == ncclSuccess) r = ncclRecv(recv, recv_bytes, ncclUint8, src, c->nccl, s);
  ncclResult_t g = ncclGroupEnd();
  return nccl_watch(func, c, nx, what, r != ncclSuccess ? r : g);
}
#endif /* COMM_NCCL */

/* Chooses how c moves cuda tensors (device: the cuda device index of this rank's
 * tensors).  Collective when NCCL is built in: NCCL where every rank has its own GPU
 * (device UUIDs all different; GDP_COMM_NCCL=0 on any rank opts out), else host
 * staging; the same verdict on every rank.  A single MPI rank stages too, unless
 * GDP_COMM_NCCL=2 (a one-rank NCCL communicator: the NCCL path checked on one GPU).  A failed NCCL set-up falls back to host
 * staging on every rank (with one line on stderr). */
static gdp_status choose_transport(const char *func, gdp_comm *c, int device) {
  c->transport = TRANSPORT_STAGED;
#ifdef COMM_NCCL
  if (!c->is_mpi || (c->size == 1 && env_int("GDP_COMM_NCCL", 1, 0, 2) != 2)) return GDP_OK;
  struct {
    int64_t want;
    unsigned char uuid[16];
  } mine, *all;
  memset(&mine, 0, sizeof mine);
  mine.want = env_int("GDP_COMM_NCCL", 1, 0, 2) != 0;
  struct cudaDeviceProp prop;
  if (mine.want && cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    memcpy(mine.uuid, prop.uuid.bytes, sizeof mine.uuid);
  } else {
    (void)cudaGetLastError();
    mine.want = 0;
  }
  all = malloc((size_t)c->size * sizeof *all);
  if (!all) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %d device records", c->size);
  int rc = MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, c->mpi);
  if (rc != MPI_SUCCESS) {
    free(all);
    return mpi_error(func, __FILE__, __LINE__, "MPI_Allgather(device records)", rc);
  }
  int use = 1;
  for (int r = 0; r < c->size && use; r++) {
    use = all[r].want != 0;
    for (int q = 0; q < r && use; q++) use = memcmp(all[q].uuid, all[r].uuid, sizeof mine.uuid) != 0;
  }
  free(all);
  if (!use) return GDP_OK; /* a shared GPU (NCCL refuses it) or an opt-out: host staging */
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  gdp_status st = GDP_OK;
  if (c->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess)
      st = GDP_ERROR_IN(func, GDP_ERR_NCCL, "ncclGetUniqueId: %s", ncclGetErrorString(r));
  }
  /* rank 0's verdict on the id, then the id: every rank makes the same calls */
  int64_t id_ok = st == GDP_OK;
  GDP_MPI_TRY(MPI_Bcast(&id_ok, 1, MPI_INT64_T, 0, c->mpi));
  GDP_MPI_TRY(MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, c->mpi));
  char why[300] = "";
  int failed = !id_ok;
  if (failed) snprintf(why, sizeof why, "rank 0 could not make an NCCL id");
  cudaError_t e = failed ? cudaSuccess : cudaSetDevice(device);
  if (e != cudaSuccess) {
    failed = 1;
    snprintf(why, sizeof why, "rank %d: cudaSetDevice(%d): %s", c->rank, device, cudaGetErrorString(e));
  }
  /* agree before ncclCommInitRank, which blocks until every rank has called it */
  int nfailed = 0;
  GDP_MPI_TRY(MPI_Allreduce(&failed, &nfailed, 1, MPI_INT, MPI_SUM, c->mpi));
  if (nfailed == 0) {
    ncclResult_t r = ncclCommInitRank(&c->nccl, c->size, id, c->rank);
    if (r != ncclSuccess) {
      c->nccl = NULL;
      failed = 1;
      snprintf(why, sizeof why, "rank %d: ncclCommInitRank: %s", c->rank, ncclGetErrorString(r));
    }
    GDP_MPI_TRY(MPI_Allreduce(&failed, &nfailed, 1, MPI_INT, MPI_SUM, c->mpi));
  }
  if (nfailed) {
    if (c->nccl) ncclCommAbort(c->nccl);
    c->nccl = NULL;
    if (failed)
      fprintf(stderr, "gdp: NCCL set-up failed (%s); cuda tensors go through host-staged MPI\n", why);
    return GDP_OK;
  }
  c->transport = TRANSPORT_NCCL;
  c->cuda_index = device;
#else
  (void)func;
  (void)device;
#endif
  return GDP_OK;
}

/* Contiguous buffers, arguments already validated, sizes equal on all ranks. */

/* recv[r] = rank r's send; send == NULL means in place (this rank's block is already
 * in recv). */
static gdp_status raw_allgather(const char *func, gdp_comm *c, gdp_ctx *nx, const void *send,
                                void *recv, int64_t block_elems, gdp_dtype dt) {
  size_t block_bytes = (size_t)block_elems * gdp_dtype_size(dt);
#ifdef COMM_NCCL
  if (nx) return nccl_allgather(func, c, nx, send, recv, block_bytes);
#endif
  if (!c->is_mpi) {
    if (send && block_bytes) memmove(recv, send, block_bytes);
    return GDP_OK;
  }
#ifdef GDP_HAVE_MPI
  const void *sendbuf = send ? send : MPI_IN_PLACE;
  if (block_elems <= c->max_count) {
    GDP_MPI_TRY(MPI_Allgather(sendbuf, (int)block_elems, mpi_type(dt), recv, (int)block_elems,
                              mpi_type(dt), c->mpi));
    return GDP_OK;
  }
  if (block_elems > INT_MAX)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                        "%" PRId64 " elements per rank exceed MPI's int count limit (%d); "
                        "gather smaller pieces",
                        block_elems, INT_MAX);
  MPI_Datatype block;
  GDP_TRY(contiguous_type(func, block_elems, mpi_type(dt), &block));
  int rc = MPI_Allgather(sendbuf, 1, block, recv, 1, block, c->mpi);
  MPI_Type_free(&block);
  if (rc != MPI_SUCCESS)
    return mpi_error(func, __FILE__, __LINE__, "MPI_Allgather(send, 1, block, recv, 1, block)", rc);
  return GDP_OK;
#else
  return GDP_ERROR_IN(func, GDP_ERR_INTERNAL, "an MPI communicator in a build without MPI");
#endif
}

#ifdef GDP_HAVE_MPI
static gdp_status mpi_alltoallv(const char *func, gdp_comm *c, const void *send,
                                const int64_t *send_units, void *recv, const int64_t *recv_units,
                                MPI_Datatype unit) {
  int n = c->size;
  int *v = malloc(4 * (size_t)n * sizeof *v);
  if (!v) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %d counts", 4 * n);
  int *scount = v, *sdispl = v + n, *rcount = v + 2 * n, *rdispl = v + 3 * n;
  int64_t soff = 0, roff = 0;
  for (int j = 0; j < n; j++) {
    scount[j] = (int)send_units[j];
    sdispl[j] = (int)soff;
    soff += send_units[j];
    rcount[j] = (int)recv_units[j];
    rdispl[j] = (int)roff;
    roff += recv_units[j];
  }
  int rc = MPI_Alltoallv(send, scount, sdispl, unit, recv, rcount, rdispl, unit, c->mpi);
  free(v);
  if (rc != MPI_SUCCESS)
    return mpi_error(func, __FILE__, __LINE__,
                     "MPI_Alltoallv(send, scount, sdispl, unit, recv, rcount, rdispl, unit)", rc);
  return GDP_OK;
}
#endif

/* How an all-to-all's counts reach MPI: in elements when they fit, else in whole rows
 * (a contiguous row datatype).  Decided before any communication, so that under
 * GDP_COMM_CHECK a rank whose counts do not fit fails on every rank. */
typedef enum { UNITS_ELEMENTS = 0, UNITS_ROWS = 1 } alltoall_units;

static gdp_status alltoallv_plan(const char *func, const gdp_comm *c, const int64_t *send_rows,
                                 const int64_t *recv_rows, int64_t row_elems,
                                 alltoall_units *units) {
  *units = UNITS_ELEMENTS;
  if (!c->is_mpi) return GDP_OK;
  int64_t send_total = 0, recv_total = 0;
  for (int j = 0; j < c->size; j++) {
    send_total += send_rows[j];
    recv_total += recv_rows[j];
  }
  int64_t most_rows = send_total > recv_total ? send_total : recv_total;
  if (row_elems == 0 || most_rows <= c->max_count / row_elems) return GDP_OK;
  *units = UNITS_ROWS;
  if (row_elems <= INT_MAX && most_rows <= c->max_count) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                      "%" PRId64 " rows of %" PRId64 " elements exceed MPI's int count and "
                      "displacement limit (%" PRId64 "); exchange smaller pieces",
                      most_rows, row_elems, c->max_count);
}

/* send_rows[j] rows of `send` go to rank j; recv_rows[j] rows of `recv` come from j.
 * send and recv do not overlap; units from alltoallv_plan. */
static gdp_status raw_alltoallv(const char *func, gdp_comm *c, gdp_ctx *nx, const void *send,
                                const int64_t *send_rows, void *recv, const int64_t *recv_rows,
                                int64_t row_elems, gdp_dtype dt, alltoall_units units) {
#ifdef COMM_NCCL
  if (nx) return nccl_alltoallv(func, c, nx, send, send_rows, recv, recv_rows,
                                (size_t)row_elems * gdp_dtype_size(dt));
#endif
  if (!c->is_mpi) {
    size_t bytes = (size_t)send_rows[0] * (size_t)row_elems * gdp_dtype_size(dt);
    if (bytes) memcpy(recv, send, bytes);
    return GDP_OK;
  }
#ifdef GDP_HAVE_MPI
  int n = c->size;
  if (units == UNITS_ROWS) {
    MPI_Datatype row;
    GDP_TRY(contiguous_type(func, row_elems, mpi_type(dt), &row));
    gdp_status st = mpi_alltoallv(func, c, send, send_rows, recv, recv_rows, row);
    MPI_Type_free(&row);
    return st;
  }
  int64_t *counts = malloc(2 * (size_t)n * sizeof *counts);
  if (!counts) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %d counts", 2 * n);
  for (int j = 0; j < n; j++) {
    counts[j] = send_rows[j] * row_elems;
    counts[n + j] = recv_rows[j] * row_elems;
  }
  gdp_status st = mpi_alltoallv(func, c, send, counts, recv, counts + n, mpi_type(dt));
  free(counts);
  return st;
#else
  (void)units;
  return GDP_ERROR_IN(func, GDP_ERR_INTERNAL, "an MPI communicator in a build without MPI");
#endif
}

/* In place; dt is not bf16 (the caller reduces bf16 through float32). */
static gdp_status raw_allreduce(const char *func, gdp_comm *c, gdp_ctx *nx, void *buf, int64_t n,
                                gdp_dtype dt, gdp_reduce_op op) {
#ifdef COMM_NCCL
  if (nx) return nccl_allreduce(func, c, nx, buf, n, dt, op);
#endif
  if (!c->is_mpi) return GDP_OK;
#ifdef GDP_HAVE_MPI
  size_t es = gdp_dtype_size(dt);
  int64_t off = 0;
  do { /* at least one call, so that every rank makes the same calls */
    int64_t k = n - off < c->max_count ? n - off : c->max_count;
    GDP_MPI_TRY(MPI_Allreduce(MPI_IN_PLACE, (char *)buf + (size_t)off * es, (int)k, mpi_type(dt),
                              mpi_op(op), c->mpi));
    off += k;
  } while (off < n);
  return GDP_OK;
#else
  return GDP_ERROR_IN(func, GDP_ERR_INTERNAL, "an MPI communicator in a build without MPI");
#endif
}

static gdp_status raw_broadcast(const char *func, gdp_comm *c, gdp_ctx *nx, void *buf, int64_t n,
                                gdp_dtype dt, int root) {
#ifdef COMM_NCCL
  if (nx) return nccl_broadcast(func, c, nx, buf, (size_t)n * gdp_dtype_size(dt), root);
#endif
  if (!c->is_mpi) return GDP_OK;
#ifdef GDP_HAVE_MPI
  size_t es = gdp_dtype_size(dt);
  int64_t off = 0;
  do {
    int64_t k = n - off < c->max_count ? n - off : c->max_count;
    GDP_MPI_TRY(MPI_Bcast((char *)buf + (size_t)off * es, (int)k, mpi_type(dt), root, c->mpi));
    off += k;
  } while (off < n);
  return GDP_OK;
#else
  return GDP_ERROR_IN(func, GDP_ERR_INTERNAL, "an MPI communicator in a build without MPI");
#endif
}

#ifdef GDP_HAVE_MPI
/* Pieces of a message of n elements: ceil(n / max_count), at least 1 (an empty message
 * still travels, so that the receiver's matching recv completes). */
static int64_t pieces(const gdp_comm *c, int64_t n) {
  return n == 0 ? 1 : (n + c->max_count - 1) / c->max_count;
}
#endif

#ifdef GDP_HAVE_MPI
/* Receives the pieces of one message from src.  Each piece is probed first (MPI_Mprobe)
 * and received only into a buffer of its real size: a size mismatch becomes a
 * GDP_ERR_SHAPE here, and MPI never sees a truncated receive (Open MPI 4.1 with
 * MPI_THREAD_FUNNELED was seen to hang in one, with 4 ranks). */
static gdp_status mpi_recv_pieces(const char *func, gdp_comm *c, void *recv, int64_t n_recv,
                                  int src, gdp_dtype dt, int tag) {
  size_t es = gdp_dtype_size(dt);
  int64_t np = pieces(c, n_recv);
  for (int64_t i = 0; i < np; i++) {
    int64_t off = i * c->max_count, k = n_recv - off < c->max_count ? n_recv - off : c->max_count;
    MPI_Message msg;
    MPI_Status status;
    GDP_MPI_TRY(MPI_Mprobe(src, tag, c->mpi, &msg, &status));
    int bytes = 0;
    GDP_MPI_TRY(MPI_Get_count(&status, MPI_BYTE, &bytes));
    if ((int64_t)bytes == k * (int64_t)es) {
      GDP_MPI_TRY(MPI_Mrecv((char *)recv + (size_t)off * es, (int)k, mpi_type(dt), &msg,
                            MPI_STATUS_IGNORE));
      continue;
    }
    /* Consume the message anyway, so that it cannot match a later receive. */
    void *scratch = malloc(bytes > 0 ? (size_t)bytes : 1);
    if (!scratch) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %d bytes", bytes);
    int whole = bytes % (int)es == 0;
    int rc = MPI_Mrecv(scratch, whole ? bytes / (int)es : bytes, whole ? mpi_type(dt) : MPI_BYTE,
                       &msg, MPI_STATUS_IGNORE);
    free(scratch);
    if (rc != MPI_SUCCESS) return mpi_error(func, __FILE__, __LINE__, "MPI_Mrecv(scratch)", rc);
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "rank %d sent a message of %d bytes (piece %" PRId64 "), but the "
                        "receiving %s tensor expects %" PRId64 " elements (%" PRId64
                        " bytes) there (%" PRId64 " elements in all); the message was dropped",
                        src, bytes, i, gdp_dtype_name(dt), k, k * (int64_t)es, n_recv);
  }
  return GDP_OK;
}
#endif

/* Sends `send` (n_send elements) to dst and receives n_recv elements from src; either
 * peer may be -1 (none).  The sends are posted first (nonblocking), then the receives
 * block, then the sends are waited for: every rank posts before it waits, so rings and
 * chains cannot deadlock.  Messages between a pair of ranks with one tag arrive in
 * order, so the pieces line up. */
static gdp_status raw_sendrecv(const char *func, gdp_comm *c, gdp_ctx *nx, const void *send,
                               int64_t n_send, int dst, void *recv, int64_t n_recv, int src,
                               gdp_dtype dt, int tag) {
#ifdef COMM_NCCL
  if (nx) {
    size_t es = gdp_dtype_size(dt);
    return nccl_sendrecv(func, c, nx, send, (size_t)n_send * es, dst, recv, (size_t)n_recv * es, src);
  }
#endif
  if (!c->is_mpi) { /* size 1: dst and src are 0 or -1, and n_send == n_recv when both 0 */
    if (dst == 0 && src == 0 && n_send) memcpy(recv, send, (size_t)n_send * gdp_dtype_size(dt));
    return GDP_OK;
  }
#ifdef GDP_HAVE_MPI
  size_t es = gdp_dtype_size(dt);
  int64_t ns = dst >= 0 ? pieces(c, n_send) : 0;
  if (ns > INT_MAX)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "%" PRId64 " message pieces", ns);
  MPI_Request *req = malloc((size_t)(ns + 1) * sizeof *req);
  if (!req) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %" PRId64 " requests", ns);
  gdp_status st = GDP_OK;
  int posted = 0;
  for (int64_t i = 0; i < ns; i++) {
    int64_t off = i * c->max_count, k = n_send - off < c->max_count ? n_send - off : c->max_count;
    int rc = MPI_Isend((const char *)send + (size_t)off * es, (int)k, mpi_type(dt), dst, tag,
                       c->mpi, &req[posted]);
    if (rc != MPI_SUCCESS) {
      st = mpi_error(func, __FILE__, __LINE__, "MPI_Isend(send + off, k, type, dst, tag)", rc);
      break;
    }
    posted++;
  }
  if (st == GDP_OK && src >= 0) st = mpi_recv_pieces(func, c, recv, n_recv, src, dt, tag);
  /* Never return with sends in flight: the caller frees their buffers. */
  int rc = MPI_Waitall(posted, req, MPI_STATUSES_IGNORE);
  if (rc != MPI_SUCCESS && st == GDP_OK)
    st = mpi_error(func, __FILE__, __LINE__, "MPI_Waitall(sends)", rc);
  free(req);
  return st;
#else
  return GDP_ERROR_IN(func, GDP_ERR_INTERNAL, "an MPI communicator in a build without MPI");
#endif
}

/* ------------------------------------------------------------------ agreement */

static gdp_status agree_status_in(const char *func, gdp_comm *c, gdp_status local,
                                  const char *local_msg) {
  if (!local_msg) local_msg = local != GDP_OK ? gdp_last_error() : "";
  if (!c->is_mpi || c->size == 1) {
    if (local == GDP_OK) return GDP_OK;
    return GDP_ERROR_IN(func, local, "1 of 1 ranks failed (ranks %d); rank %d: %s: %s", c->rank,
                        c->rank, gdp_status_name(local), local_msg);
  }
#ifdef GDP_HAVE_MPI
  /* A flag first (cheap), the messages only when some rank failed: every rank makes
   * the same calls whatever happened, so none can wait for a message that never comes. */
  int failed = local != GDP_OK, nfailed = 0;
  GDP_MPI_TRY(MPI_Allreduce(&failed, &nfailed, 1, MPI_INT, MPI_SUM, c->mpi));
  if (nfailed == 0) return GDP_OK;
  char mine[AGREE_RECORD_BYTES];
  memset(mine, 0, sizeof mine);
  int32_t s32 = (int32_t)local;
  memcpy(mine, &s32, sizeof s32);
  snprintf(mine + sizeof s32, sizeof mine - sizeof s32, "%s", local_msg);
  char *all = malloc((size_t)c->size * AGREE_RECORD_BYTES);
  if (!all) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate the agreement records");
  int rc = MPI_Allgather(mine, AGREE_RECORD_BYTES, MPI_BYTE, all, AGREE_RECORD_BYTES, MPI_BYTE,
                         c->mpi);
  if (rc != MPI_SUCCESS) {
    free(all);
    return mpi_error(func, __FILE__, __LINE__, "MPI_Allgather(status records)", rc);
  }
  char text[1600];
  strbuf sb = {text, sizeof text, 0};
  text[0] = '\0';
  int first = -1, listed = 0;
  gdp_status first_status = GDP_ERR_INTERNAL;
  sb_printf(&sb, "%d of %d ranks failed (", nfailed, c->size);
  for (int r = 0; r < c->size; r++) {
    int32_t s;
    memcpy(&s, all + (size_t)r * AGREE_RECORD_BYTES, sizeof s);
    if (s == GDP_OK) continue;
    if (first < 0) {
      first = r;
      first_status = (gdp_status)s;
    }
    if (listed < AGREE_MAX_LISTED) sb_printf(&sb, "%s%d", listed ? ", " : "ranks ", r);
    else if (listed == AGREE_MAX_LISTED) sb_printf(&sb, ", ...");
    listed++;
  }
  if (first >= 0) {
    char *msg = all + (size_t)first * AGREE_RECORD_BYTES + sizeof(int32_t);
    msg[AGREE_RECORD_BYTES - sizeof(int32_t) - 1] = '\0';
    sb_printf(&sb, "); rank %d: %s: %s", first, gdp_status_name(first_status), msg);
  } else {
    sb_printf(&sb, ")");
  }
  free(all);
  if (first_status == GDP_OK) first_status = GDP_ERR_INTERNAL;
  return GDP_ERROR_IN(func, first_status, "%s", text);
#else
  return GDP_ERROR_IN(func, GDP_ERR_INTERNAL, "an MPI communicator in a build without MPI");
#endif
}

#ifdef GDP_HAVE_MPI
static void list_values(strbuf *sb, const int64_t *v, int64_t n) {
  sb_printf(sb, "[");
  for (int64_t i = 0; i < n && i < 8; i++) sb_printf(sb, "%s%" PRId64, i ? ", " : "", v[i]);
  if (n > 8) sb_printf(sb, ", ... (%" PRId64 " values)", n);
  sb_printf(sb, "]");
}
#endif

static gdp_status agree_values_in(const char *func, gdp_comm *c, const char *what,
                                  const int64_t *values, int64_t n) {
  if (!what) what = "values";
  int local_ok = n >= 0 && (n == 0 || values);
  if (!c->is_mpi || c->size == 1) {
    if (!local_ok)
      return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: n = %" PRId64 "%s", what, n,
                          n < 0 ? " (expected >= 0)" : " values at NULL");
    return GDP_OK;
  }
#ifdef GDP_HAVE_MPI
  /* Step 1: every rank learns every rank's n and whether its arguments are usable. */
  int size = c->size;
  int64_t mine[2] = {n, local_ok}, *head = malloc(2 * (size_t)size * sizeof *head);
  if (!head) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %d counts", size);
  int rc = MPI_Allgather(mine, 2, MPI_INT64_T, head, 2, MPI_INT64_T, c->mpi);
  if (rc != MPI_SUCCESS) {
    free(head);
    return mpi_error(func, __FILE__, __LINE__, "MPI_Allgather(value counts)", rc);
  }
  char text[1600];
  strbuf sb = {text, sizeof text, 0};
  text[0] = '\0';
  int bad = 0;
  for (int r = 0; r < size; r++) bad |= !head[2 * r + 1] || head[2 * r] != head[0];
  if (bad) {
    sb_printf(&sb, "%s: ranks pass different or invalid numbers of values:", what);
    for (int r = 0; r < size && r < 4 * AGREE_MAX_LISTED; r++)
      sb_printf(&sb, " rank %d: %" PRId64 "%s;", r, head[2 * r],
                head[2 * r + 1] ? "" : (head[2 * r] < 0 ? " (negative)" : " (values NULL)"));
    free(head);
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s", text);
  }
  free(head);
  if (n > INT_MAX / size) /* control data: not cut into pieces (max_count is for payload) */
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "%s: %" PRId64 " values are too many to compare",
                        what, n);
  if (n == 0) return GDP_OK;
  /* Step 2: every rank sees all values and reaches the same verdict. */
  int64_t *all = malloc((size_t)size * (size_t)n * sizeof *all);
  if (!all) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %d x %" PRId64 " values", size, n);
  rc = MPI_Allgather(values, (int)n, MPI_INT64_T, all, (int)n, MPI_INT64_T, c->mpi);
  if (rc != MPI_SUCCESS) {
    free(all);
    return mpi_error(func, __FILE__, __LINE__, "MPI_Allgather(values)", rc);
  }
  int listed = 0;
  for (int r = 1; r < size; r++) {
    const int64_t *v = all + (size_t)r * (size_t)n;
    int64_t i = 0;
    while (i < n && v[i] == all[i]) i++;
    if (i == n) continue;
    if (listed == 0) {
      sb_printf(&sb, "%s differ across ranks: rank 0: ", what);
      list_values(&sb, all, n);
    }
    if (listed < AGREE_MAX_LISTED) {
      sb_printf(&sb, "; rank %d: ", r);
      list_values(&sb, v, n);
      sb_printf(&sb, " (first difference at index %" PRId64 ")", i);
    } else if (listed == AGREE_MAX_LISTED) {
      sb_printf(&sb, "; ...");
    }
    listed++;
  }
  free(all);
  if (listed) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s", text);
  return GDP_OK;
#else
  return GDP_ERROR_IN(func, GDP_ERR_INTERNAL, "an MPI communicator in a build without MPI");
#endif
}

gdp_status gdp_comm_agree_status(gdp_comm *c, gdp_status local, const char *local_msg) {
  GDP_TRY(check_comm(__func__, c));
  return agree_status_in(__func__, c, local, local_msg);
}

gdp_status gdp_comm_agree_values(gdp_comm *c, const char *what, const int64_t *values,
                                 int64_t n) {
  GDP_TRY(check_comm(__func__, c));
  return agree_values_in(__func__, c, what, values, n);
}

/* Checked mode (the default): one all-gather of a fixed record per collective, holding
 * the rank's local status and the call's metadata (call, dtype, op, root, shape).  A
 * failed local check on any rank becomes that rank's error on every rank (the messages
 * are gathered only then); otherwise the first field that differs from rank 0's is
 * named with both values.  Unchecked: just the local status. */
typedef struct {
  int64_t status, call, device, dtype, op, root, ndim;
  int64_t skip_dim0; /* alltoallv: dim 0 may differ */
  int64_t shape[GDP_MAX_DIMS];
} call_sig;

enum { SIG_WORDS = sizeof(call_sig) / sizeof(int64_t) };

static const char *const call_names[] = {"?", "allgather", "alltoall", "alltoallv",
                                         "allreduce", "broadcast", "barrier"};

static const char *call_name(int64_t call) {
  return call >= 0 && call < (int64_t)(sizeof call_names / sizeof call_names[0]) ? call_names[call] : "?";
}

#ifdef GDP_HAVE_MPI
static void sig_shape(strbuf *sb, const call_sig *s) {
  sb_printf(sb, "[");
  for (int64_t i = 0; i < s->ndim && i < GDP_MAX_DIMS; i++)
    sb_printf(sb, "%s%" PRId64, i ? ", " : "", s->shape[i]);
  sb_printf(sb, "]");
}

/* Names the first field in which b differs from a, with both values; 0 when none. */
static int sig_diff(strbuf *sb, const call_sig *a, int ra, const call_sig *b, int rb) {
  if (a->call != b->call) {
    sb_printf(sb, "call: rank %d is in %s, rank %d in %s (collectives called in a different order)",
              ra, call_name(a->call), rb, call_name(b->call));
    return 1;
  }
  if (a->device != b->device) {
    sb_printf(sb, "device: rank %d passes a %s tensor, rank %d a %s tensor", ra,
              a->device < 0 ? "?" : gdp_device_type_name((gdp_device_type)a->device), rb,
              b->device < 0 ? "?" : gdp_device_type_name((gdp_device_type)b->device));
    return 1;
  }
  if (a->dtype != b->dtype) {
    sb_printf(sb, "dtype: rank %d passes %s, rank %d passes %s", ra,
              gdp_dtype_name((gdp_dtype)a->dtype), rb, gdp_dtype_name((gdp_dtype)b->dtype));
    return 1;
  }
  if (a->op != b->op) {
    sb_printf(sb, "op: rank %d passes %s, rank %d passes %s", ra,
              gdp_reduce_op_name((gdp_reduce_op)a->op), rb, gdp_reduce_op_name((gdp_reduce_op)b->op));
    return 1;
  }
  if (a->root != b->root) {
    sb_printf(sb, "root: rank %d passes %" PRId64 ", rank %d passes %" PRId64, ra, a->root, rb, b->root);
    return 1;
  }
  int same = a->ndim == b->ndim;
  for (int64_t i = a->skip_dim0 ? 1 : 0; same && i < a->ndim && i < GDP_MAX_DIMS; i++)
    same = a->shape[i] == b->shape[i];
  if (!same) {
    sb_printf(sb, "shape%s: rank %d passes ", a->skip_dim0 ? " (after dim 1)" : "", ra);
    sig_shape(sb, a);
    sb_printf(sb, ", rank %d passes ", rb);
    sig_shape(sb, b);
    return 1;
  }
  return 0;
}
#endif

/* The agreement on a collective's arguments and local status.  A cuda tensor t that
 * will be host-staged has its context's queued work waited for first: a failure that
 * surfaces at that wait (an asynchronous error, a model layer op's index check, gdp.h)
 * is then this rank's status here, which every rank sees, rather than a failure of the
 * staging copy after the agreement, which would leave the other ranks in the MPI call.
 * Under NCCL nothing waits (the staging is the only wait in a host-staged collective,
 * so this one costs nothing there). */
static gdp_status agree_call(const char *func, gdp_comm *c, gdp_status local, call_sig *sig,
                             const gdp_tensor *t) {
  if (!c->check || !c->is_mpi || c->size == 1) return local;
#ifdef GDP_HAVE_MPI
  if (local == GDP_OK && t && on_cuda(t) && c->transport != TRANSPORT_NCCL)
    local = gdp_ctx_sync(t->storage->ctx);
  sig->status = local;
  call_sig *all = malloc((size_t)c->size * sizeof *all);
  if (!all) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %d call records", c->size);
  int rc = MPI_Allgather(sig, SIG_WORDS, MPI_INT64_T, all, SIG_WORDS, MPI_INT64_T, c->mpi);
  if (rc != MPI_SUCCESS) {
    free(all);
    return mpi_error(func, __FILE__, __LINE__, "MPI_Allgather(call records)", rc);
  }
  int any_failed = 0;
  for (int r = 0; r < c->size; r++) any_failed |= all[r].status != GDP_OK;
  if (any_failed) { /* every rank takes this branch: the messages are gathered */
    free(all);
    return agree_status_in(func, c, local, NULL);
  }
  char text[1200];
  strbuf sb = {text, sizeof text, 0};
  text[0] = '\0';
  int bad = 0;
  for (int r = 1; r < c->size && !bad; r++) {
    sb.len = 0;
    sb_printf(&sb, "arguments differ across ranks: ");
    bad = sig_diff(&sb, &all[0], 0, &all[r], r);
  }
  free(all);
  if (bad) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s", text);
  return GDP_OK;
#else
  return local;
#endif
}

/* The metadata of a call on tensor t (NULL: a failed local check, fields -1). */
static call_sig make_sig(int64_t call, const gdp_tensor *t, int64_t op, int64_t root) {
  call_sig s;
  memset(&s, 0, sizeof s);
  s.call = call;
  s.op = op;
  s.root = root;
  s.device = t ? (int64_t)device_of(t) : -1;
  s.dtype = t ? (int64_t)t->dtype : -1;
  s.ndim = t ? t->ndim : -1;
  for (int i = 0; t && i < t->ndim && i < GDP_MAX_DIMS; i++) s.shape[i] = t->shape[i];
  return s;
}

/* Opting out (collective: the ranks agree on the flag, so that no rank gathers records
 * the others do not send). */
gdp_status gdp_comm_set_check(gdp_comm *c, int on) {
  GDP_TRY(check_comm(__func__, c));
  int64_t v = on ? 1 : 0;
  GDP_TRY(agree_values_in(__func__, c, "check (1: agree on each collective's arguments, 0: not)",
                          &v, 1));
  c->check = on ? 1 : 0;
  return GDP_OK;
}

int gdp_comm_check_enabled(const gdp_comm *c) { return c ? c->check : 0; }

/* Ends every rank of a multi-rank MPI job at once (MPI_Abort on MPI_COMM_WORLD) after
 * writing msg to stderr; returns 0 without doing anything when no such job is running
 * (no MPI, not initialised, already finalised, or one rank). */
int gdp_comm_abort(int code, const char *msg) {
#ifdef GDP_HAVE_MPI
  int initialized = 0, finalized = 0, size = 1, rank = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return 0;
  MPI_Finalized(&finalized);
  if (finalized) return 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size <= 1) return 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (msg && *msg) fprintf(stderr, "gdp: rank %d of %d: %s\n", rank, size, msg);
  fprintf(stderr, "gdp: rank %d of %d failed (exit status %d): aborting every rank\n", rank, size, code);
  fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
  return 1;
#else
  (void)code;
  (void)msg;
  return 0;
#endif
}

enum {
  CALL_ALLGATHER = 1,
  CALL_ALLTOALL,
  CALL_ALLTOALLV,
  CALL_ALLREDUCE,
  CALL_BROADCAST,
  CALL_BARRIER
};

/* ------------------------------------------------------------------ lifetime */

gdp_status gdp_comm_self(gdp_comm **out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out is NULL");
  *out = comm_new(0, 1, 0);
  if (!*out) return GDP_ERROR(GDP_ERR_OOM, "cannot allocate the communicator");
  return GDP_OK;
}

#ifndef GDP_HAVE_MPI
static gdp_comm *world_comm;
#endif

gdp_status gdp_comm_world(gdp_comm **out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  if (world_comm) {
    *out = gdp_comm_retain(world_comm);
    return GDP_OK;
  }
  gdp_comm *w = NULL;
#ifdef GDP_HAVE_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized || launched_by_mpirun()) GDP_TRY(mpi_world(&w));
#else
  int64_t launched = env_int("OMPI_COMM_WORLD_SIZE", 0, 0, INT_MAX);
  if (!launched) launched = env_int("PMI_SIZE", 0, 0, INT_MAX);
  if (launched > 1)
    return GDP_ERROR(GDP_ERR_UNSUPPORTED,
                     "launched by mpirun with %" PRId64 " processes, but libgdp was built without "
                     "MPI (configure with -DGDP_MPI=ON, which needs libopenmpi-dev)",
                     launched);
#endif
  if (!w) GDP_TRY(gdp_comm_self(&w));
  world_comm = w;
  *out = gdp_comm_retain(w);
  return GDP_OK;
}

gdp_status gdp_comm_split(gdp_comm *c, int color, int key, gdp_comm **out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  GDP_TRY(check_comm(__func__, c));
  if (!c->is_mpi) {
    if (color < 0) return GDP_OK;
    return gdp_comm_self(out);
  }
#ifdef GDP_HAVE_MPI
  const char *func = __func__;
  MPI_Comm sub = MPI_COMM_NULL;
  GDP_MPI_TRY(MPI_Comm_split(c->mpi, color < 0 ? MPI_UNDEFINED : color, key, &sub));
  if (sub == MPI_COMM_NULL) return GDP_OK;
  int rank = 0, size = 1;
  int rc = MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(sub, &rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(sub, &size);
  gdp_comm *s = rc == MPI_SUCCESS ? comm_new(rank, size, 1) : NULL;
  if (!s) {
    MPI_Comm_free(&sub);
    if (rc != MPI_SUCCESS) return mpi_error(func, __FILE__, __LINE__, "MPI_Comm_set_errhandler/rank/size(sub)", rc);
    return GDP_ERROR(GDP_ERR_OOM, "cannot allocate the communicator");
  }
  s->check = c->check; /* a sub-communicator checks as its parent does */
  s->mpi = sub;
  *out = s;
  return GDP_OK;
#else
  return GDP_ERROR(GDP_ERR_INTERNAL, "an MPI communicator in a build without MPI");
#endif
}

gdp_comm *gdp_comm_retain(gdp_comm *c) {
  if (c) atomic_fetch_add(&c->refcount, 1);
  return c;
}

void gdp_comm_free(gdp_comm *c) {
  if (!c || atomic_fetch_sub(&c->refcount, 1) != 1) return;
#ifdef COMM_NCCL
  if (c->nccl) ncclCommDestroy(c->nccl);
#endif
  gdp_ctx_free(c->host);
#ifdef GDP_HAVE_MPI
  if (c->is_mpi) {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&c->mpi);
  }
#endif
  free(c);
}

int gdp_comm_rank(const gdp_comm *c) { return c ? c->rank : -1; }
int gdp_comm_size(const gdp_comm *c) { return c ? c->size : -1; }
int gdp_comm_is_mpi(const gdp_comm *c) { return c ? c->is_mpi : 0; }

gdp_status gdp_comm_backend(gdp_comm *c, gdp_device_type type, int index, const char **name) {
  const char *func = __func__;
  if (!name) return GDP_ERROR(GDP_ERR_INVALID_ARG, "name is NULL");
  *name = NULL;
  GDP_TRY(check_comm(func, c));
  if (type != GDP_DEVICE_CPU && type != GDP_DEVICE_CUDA)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "type: expected cpu or cuda, got %d", (int)type);
  if (type == GDP_DEVICE_CUDA) {
    if (index < 0) return GDP_ERROR(GDP_ERR_INVALID_ARG, "index: expected >= 0, got %d", index);
    if (c->transport == TRANSPORT_UNDECIDED) GDP_TRY(choose_transport(func, c, index));
    if (c->transport == TRANSPORT_NCCL) {
      *name = "nccl";
      return GDP_OK;
    }
    *name = c->is_mpi ? "mpi-staged" : "self-staged";
    return GDP_OK;
  }
  *name = c->is_mpi ? "mpi" : "self";
  return GDP_OK;
}

const char *gdp_comm_cuda_transport(const gdp_comm *c) {
  if (!c || c->transport == TRANSPORT_UNDECIDED) return "";
  if (c->transport == TRANSPORT_NCCL) return "nccl";
  return c->is_mpi ? "mpi-staged" : "self-staged";
}

const char *gdp_reduce_op_name(gdp_reduce_op op) {
  switch (op) {
    case GDP_REDUCE_OP_SUM: return "sum";
    case GDP_REDUCE_OP_MAX: return "max";
    case GDP_REDUCE_OP_MIN: return "min";
  }
  return "?";
}

int64_t gdp_comm_bytes_sent(const gdp_comm *c) { return c ? c->sent : 0; }
int64_t gdp_comm_bytes_received(const gdp_comm *c) { return c ? c->received : 0; }
int64_t gdp_comm_bytes_sent_incl_self(const gdp_comm *c) { return c ? c->sent_all : 0; }
int64_t gdp_comm_bytes_received_incl_self(const gdp_comm *c) { return c ? c->received_all : 0; }

void gdp_comm_reset_counters(gdp_comm *c) {
  if (c) c->sent = c->received = c->sent_all = c->received_all = 0;
}

static void count(gdp_comm *c, int64_t sent, int64_t received, int64_t sent_all,
                  int64_t received_all) {
  c->sent += sent;
  c->received += received;
  c->sent_all += sent_all;
  c->received_all += received_all;
}

/* ------------------------------------------------------------------ collectives */

static gdp_status allgather_args(const char *func, gdp_comm *c, const gdp_tensor *out,
                                 const gdp_tensor *in) {
  GDP_TRY(check_tensor(func, c, "in", in));
  GDP_TRY(check_tensor(func, c, "out", out));
  if (out->dtype != in->dtype)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "out and in must have one dtype, got %s and %s",
                        gdp_dtype_name(out->dtype), gdp_dtype_name(in->dtype));
  int ok = out->ndim == in->ndim + 1 && out->shape[0] == c->size;
  for (int i = 0; ok && i < in->ndim; i++) ok = out->shape[i + 1] == in->shape[i];
  if (!ok) {
    char ob[160], ib[160];
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "out: expected [%d, *in.shape] for in %s, got %s",
                        c->size, shape_of(ib, sizeof ib, in), shape_of(ob, sizeof ob, out));
  }
  return GDP_OK;
}

gdp_status gdp_comm_allgather(gdp_comm *c, gdp_tensor *out, const gdp_tensor *in) {
  const char *func = __func__;
  GDP_TRY(check_comm(func, c));
  gdp_status st = allgather_args(func, c, out, in);
  if (st == GDP_OK) st = check_same_device(func, "in", in, "out", out);
  call_sig sig = make_sig(CALL_ALLGATHER, st == GDP_OK ? in : NULL, -1, -1);
  GDP_TRY(agree_call(func, c, st, &sig, st == GDP_OK ? in : NULL));
  GDP_TRY(ready_for(func, c, in));
  gdp_tensor_mark_written(out);

  int64_t block = numel(in);
  size_t block_bytes = nbytes(in);
  gdp_tensor *dst = NULL, *src = NULL;
  st = staged_output(c, out, 0, &dst);
  /* In place when `in` is exactly dst's block of this rank (nccl-tests' in-place
   * pattern); any other sharing of storage is copied first. */
  int in_place = st == GDP_OK && gdp_tensor_is_contiguous(in) && dst == out &&
                 gdp_tensor_ptr(in) == (char *)gdp_tensor_ptr(dst) + (size_t)c->rank * block_bytes;
  if (st == GDP_OK && !in_place)
    st = overlaps(in, out) ? staged_copy(c, in, &src) : staged_input(c, in, &src);
  if (st == GDP_OK)
    st = raw_allgather(func, c, nccl_ctx(c, in), in_place ? NULL : gdp_tensor_ptr(src), gdp_tensor_ptr(dst), block,
                       in->dtype);
  if (st == GDP_OK) st = finish_output(out, dst);
  gdp_tensor_free(src);
  gdp_tensor_free(dst);
  if (st != GDP_OK) return st;
  int64_t others = (int64_t)(c->size - 1) * (int64_t)block_bytes;
  int64_t all = (int64_t)c->size * (int64_t)block_bytes;
  count(c, others, others, all, all);
  return GDP_OK;
}

static gdp_status alltoallv_args(const char *func, gdp_comm *c, const gdp_tensor *out,
                                 const int64_t *recv_rows, const gdp_tensor *in,
                                 const int64_t *send_rows) {
  GDP_TRY(check_tensor(func, c, "in", in));
  GDP_TRY(check_tensor(func, c, "out", out));
  if (out->dtype != in->dtype)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "out and in must have one dtype, got %s and %s",
                        gdp_dtype_name(out->dtype), gdp_dtype_name(in->dtype));
  char ob[160], ib[160];
  if (in->ndim < 1 || out->ndim != in->ndim)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "in and out: expected the same number (>= 1) of dims, got %s and %s",
                        shape_of(ib, sizeof ib, in), shape_of(ob, sizeof ob, out));
  for (int i = 1; i < in->ndim; i++)
    if (out->shape[i] != in->shape[i])
      return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                          "in and out: dims after the first must agree, got %s and %s (dim %d)",
                          shape_of(ib, sizeof ib, in), shape_of(ob, sizeof ob, out), i);
  if (!send_rows) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "send_rows is NULL");
  if (!recv_rows) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "recv_rows is NULL");
  int64_t ssum = 0, rsum = 0;
  for (int j = 0; j < c->size; j++) {
    if (send_rows[j] < 0 || recv_rows[j] < 0)
      return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                          "row counts must be >= 0, got send_rows[%d] = %" PRId64
                          ", recv_rows[%d] = %" PRId64,
                          j, send_rows[j], j, recv_rows[j]);
    ssum += send_rows[j];
    rsum += recv_rows[j];
  }
  if (ssum != in->shape[0])
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "send_rows sum to %" PRId64 ", but in %s has %" PRId64 " rows", ssum,
                        shape_of(ib, sizeof ib, in), in->shape[0]);
  if (rsum != out->shape[0])
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "recv_rows sum to %" PRId64 ", but out %s has %" PRId64 " rows", rsum,
                        shape_of(ob, sizeof ob, out), out->shape[0]);
  if (!c->is_mpi && send_rows[0] != recv_rows[0])
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "size-1 communicator: send_rows[0] = %" PRId64 " must equal recv_rows[0] = %" PRId64,
                        send_rows[0], recv_rows[0]);
  return GDP_OK;
}

/* Under GDP_COMM_CHECK: rank i's send_rows[j] must equal rank j's recv_rows[i]. */
static gdp_status check_row_counts(const char *func, gdp_comm *c, const int64_t *recv_rows,
                                   const int64_t *send_rows) {
  if (!c->check || !c->is_mpi) return GDP_OK;
#ifdef GDP_HAVE_MPI
  int64_t *incoming = malloc((size_t)c->size * sizeof *incoming);
  if (!incoming) return GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %d counts", c->size);
  int rc = MPI_Alltoall(send_rows, 1, MPI_INT64_T, incoming, 1, MPI_INT64_T, c->mpi);
  gdp_status st = GDP_OK;
  if (rc != MPI_SUCCESS) {
    st = mpi_error(func, __FILE__, __LINE__, "MPI_Alltoall(send_rows)", rc);
  } else {
    for (int j = 0; j < c->size; j++) {
      if (incoming[j] != recv_rows[j]) {
        st = GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                          "rank %d expects recv_rows[%d] = %" PRId64 " rows from rank %d, "
                          "which sends %" PRId64,
                          c->rank, j, recv_rows[j], j, incoming[j]);
        break;
      }
    }
  }
  free(incoming);
  if (rc != MPI_SUCCESS) return st;
  return agree_status_in(func, c, st, NULL);
#else
  return GDP_OK;
#endif
}

static gdp_status alltoallv_impl(const char *func, int call, gdp_comm *c, gdp_tensor *out,
                                 const int64_t *recv_rows, const gdp_tensor *in,
                                 const int64_t *send_rows) {
  gdp_status st = alltoallv_args(func, c, out, recv_rows, in, send_rows);
  int64_t row_elems = 1;
  alltoall_units units = UNITS_ELEMENTS;
  if (st == GDP_OK) {
    for (int i = 1; i < in->ndim; i++) row_elems *= in->shape[i];
    st = alltoallv_plan(func, c, send_rows, recv_rows, row_elems, &units);
  }
  if (st == GDP_OK) st = check_same_device(func, "in", in, "out", out);
  /* the dims after the first must agree; the first may differ (alltoallv) */
  call_sig sig = make_sig(call, st == GDP_OK ? in : NULL, -1, -1);
  sig.skip_dim0 = call != CALL_ALLTOALL;
  GDP_TRY(agree_call(func, c, st, &sig, st == GDP_OK ? in : NULL));
  GDP_TRY(check_row_counts(func, c, recv_rows, send_rows));
  GDP_TRY(ready_for(func, c, in));
  gdp_tensor_mark_written(out);

  size_t row_bytes = (size_t)row_elems * gdp_dtype_size(in->dtype);
  gdp_tensor *dst = NULL, *src = NULL;
  st = staged_output(c, out, 0, &dst);
  if (st == GDP_OK)
    st = overlaps(in, out) || overlaps(in, dst) ? staged_copy(c, in, &src)
                                                : staged_input(c, in, &src);
  if (st == GDP_OK)
    st = raw_alltoallv(func, c, nccl_ctx(c, in), gdp_tensor_ptr(src), send_rows, gdp_tensor_ptr(dst), recv_rows,
                       row_elems, in->dtype, units);
  if (st == GDP_OK) st = finish_output(out, dst);
  gdp_tensor_free(src);
  gdp_tensor_free(dst);
  if (st != GDP_OK) return st;
  int64_t s_all = 0, r_all = 0;
  for (int j = 0; j < c->size; j++) {
    s_all += send_rows[j];
    r_all += recv_rows[j];
  }
  int me = c->rank;
  count(c, (s_all - send_rows[me]) * (int64_t)row_bytes, (r_all - recv_rows[me]) * (int64_t)row_bytes,
        s_all * (int64_t)row_bytes, r_all * (int64_t)row_bytes);
  return GDP_OK;
}

gdp_status gdp_comm_alltoallv(gdp_comm *c, gdp_tensor *out, const int64_t *recv_rows,
                              const gdp_tensor *in, const int64_t *send_rows) {
  GDP_TRY(check_comm(__func__, c));
  return alltoallv_impl(__func__, CALL_ALLTOALLV, c, out, recv_rows, in, send_rows);
}

gdp_status gdp_comm_alltoall(gdp_comm *c, gdp_tensor *out, const gdp_tensor *in) {
  const char *func = __func__;
  GDP_TRY(check_comm(func, c));
  /* One path for both: MPI_Alltoallv with equal counts costs the same as MPI_Alltoall
   * here, and the staging, in-place and counting code stays in one place. */
  gdp_status st = check_tensor(func, c, "in", in);
  if (st == GDP_OK) st = check_tensor(func, c, "out", out);
  if (st == GDP_OK && in->ndim < 1)
    st = GDP_ERROR_IN(func, GDP_ERR_SHAPE, "in: expected at least 1 dim (split along dim 0), got 0");
  if (st == GDP_OK) {
    int same = out->ndim == in->ndim;
    for (int i = 0; same && i < in->ndim; i++) same = out->shape[i] == in->shape[i];
    char ob[160], ib[160];
    if (!same)
      st = GDP_ERROR_IN(func, GDP_ERR_SHAPE, "out: expected in's shape %s, got %s",
                        shape_of(ib, sizeof ib, in), shape_of(ob, sizeof ob, out));
    else if (in->shape[0] % c->size != 0)
      st = GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "in %s: dim 0 (%" PRId64 ") must split into %d equal blocks (one per rank)",
                        shape_of(ib, sizeof ib, in), in->shape[0], c->size);
  }
  if (st != GDP_OK) {
    call_sig sig = make_sig(CALL_ALLTOALL, NULL, -1, -1);
    return agree_call(func, c, st, &sig, NULL);
  }
  int64_t *rows = malloc((size_t)c->size * sizeof *rows);
  if (!rows) {
    st = GDP_ERROR_IN(func, GDP_ERR_OOM, "cannot allocate %d counts", c->size);
    call_sig sig = make_sig(CALL_ALLTOALL, NULL, -1, -1);
    return agree_call(func, c, st, &sig, NULL);
  }
  for (int j = 0; j < c->size; j++) rows[j] = in->shape[0] / c->size;
  st = alltoallv_impl(func, CALL_ALLTOALL, c, out, rows, in, rows);
  free(rows);
  return st;
}

gdp_status gdp_comm_allreduce(gdp_comm *c, gdp_tensor *t, gdp_reduce_op op) {
  const char *func = __func__;
  GDP_TRY(check_comm(func, c));
  gdp_status st = check_tensor(func, c, "t", t);
  if (st == GDP_OK && op != GDP_REDUCE_OP_SUM && op != GDP_REDUCE_OP_MAX && op != GDP_REDUCE_OP_MIN)
    st = GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "op: expected sum (0), max (1) or min (2), got %d",
                      (int)op);
  call_sig sig = make_sig(CALL_ALLREDUCE, st == GDP_OK ? t : NULL, op, -1);
  GDP_TRY(agree_call(func, c, st, &sig, st == GDP_OK ? t : NULL));
  GDP_TRY(ready_for(func, c, t));
  gdp_tensor_mark_written(t);

  /* bf16 travels and is reduced as float32, then rounded once (on the host when
   * host-staged, on the device under NCCL). */
  gdp_tensor *buf = NULL;
  if (t->dtype == GDP_DTYPE_BF16) {
    gdp_tensor *h = NULL;
    st = staged_input(c, t, &h);
    if (st == GDP_OK) st = gdp_tensor_to(NULL, h, GDP_DTYPE_F32, &buf);
    gdp_tensor_free(h);
  } else {
    st = staged_output(c, t, 1, &buf);
  }
  if (st == GDP_OK) st = raw_allreduce(func, c, nccl_ctx(c, t), gdp_tensor_ptr(buf), numel(buf), buf->dtype, op);
  if (st == GDP_OK) st = finish_output(t, buf);
  int64_t bytes = st == GDP_OK ? (int64_t)nbytes(buf) : 0;
  gdp_tensor_free(buf);
  if (st != GDP_OK) return st;
  count(c, (c->size - 1) * bytes, (c->size - 1) * bytes, c->size * bytes, c->size * bytes);
  return GDP_OK;
}

gdp_status gdp_comm_broadcast(gdp_comm *c, gdp_tensor *t, int root) {
  const char *func = __func__;
  GDP_TRY(check_comm(func, c));
  gdp_status st = check_tensor(func, c, "t", t);
  if (st == GDP_OK) st = check_peer(func, "root", c, root, 0);
  call_sig sig = make_sig(CALL_BROADCAST, st == GDP_OK ? t : NULL, -1, root);
  GDP_TRY(agree_call(func, c, st, &sig, st == GDP_OK ? t : NULL));
  GDP_TRY(ready_for(func, c, t));
  if (c->rank != root) gdp_tensor_mark_written(t); /* the root's values stay */

  gdp_tensor *buf = NULL;
  st = staged_output(c, t, c->rank == root, &buf);
  if (st == GDP_OK) st = raw_broadcast(func, c, nccl_ctx(c, t), gdp_tensor_ptr(buf), numel(buf), buf->dtype, root);
  if (st == GDP_OK && c->rank != root) st = finish_output(t, buf);
  gdp_tensor_free(buf);
  if (st != GDP_OK) return st;
  int64_t bytes = (int64_t)nbytes(t);
  if (c->rank == root) count(c, (c->size - 1) * bytes, 0, c->size * bytes, bytes);
  else count(c, 0, bytes, 0, bytes);
  return GDP_OK;
}

gdp_status gdp_comm_barrier(gdp_comm *c) {
  const char *func = __func__;
  GDP_TRY(check_comm(func, c));
  call_sig sig = make_sig(CALL_BARRIER, NULL, -1, -1);
  GDP_TRY(agree_call(func, c, GDP_OK, &sig, NULL));
  if (!c->is_mpi) return GDP_OK;
#ifdef GDP_HAVE_MPI
  GDP_MPI_TRY(MPI_Barrier(c->mpi));
#endif
  return GDP_OK;
}

/* ------------------------------------------------------------------ point to point */

/* Shared by send, recv and sendrecv: send (or NULL) goes to dst, recv (or NULL) comes
 * from src; -1 means no partner. */
static gdp_status p2p(const char *func, gdp_comm *c, const gdp_tensor *send, int dst,
                      gdp_tensor *recv, int src, int tag) {
  GDP_TRY(check_comm(func, c));
  GDP_TRY(check_tag(func, tag));
  if (send) GDP_TRY(check_tensor(func, c, "send", send));
  if (recv) GDP_TRY(check_tensor(func, c, "recv", recv));
  GDP_TRY(check_peer(func, "dst", c, dst, 1));
  GDP_TRY(check_peer(func, "src", c, src, 1));
  if (dst >= 0 && !send)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "send is NULL, but dst is rank %d", dst);
  if (src >= 0 && !recv)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "recv is NULL, but src is rank %d", src);
  if (dst < 0) send = NULL;
  if (src < 0) recv = NULL;
  if (send && recv && send->dtype != recv->dtype)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "send and recv must have one dtype, got %s and %s",
                        gdp_dtype_name(send->dtype), gdp_dtype_name(recv->dtype));
  if (send && recv) GDP_TRY(check_same_device(func, "send", send, "recv", recv));
  if (send && recv && overlaps(send, recv))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "send and recv share storage");
  if (!c->is_mpi) {
    /* size 1: only a message to itself, and only with both halves in one call */
    if ((send != NULL) != (recv != NULL))
      return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                          "a size-1 communicator without MPI cannot %s rank 0 alone (it would "
                          "wait forever): use sendrecv with dst = src = 0",
                          send ? "send to" : "receive from");
    if (send && numel(send) != numel(recv)) {
      char sb[160], rb[160];
      return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                          "recv %s must hold exactly the %" PRId64 " elements of send %s",
                          shape_of(rb, sizeof rb, recv), numel(send), shape_of(sb, sizeof sb, send));
    }
  }

  gdp_tensor *s = NULL, *r = NULL;
  gdp_status st = GDP_OK;
  if (send) st = staged_input(c, send, &s);
  if (st == GDP_OK && recv) st = staged_output(c, recv, 0, &r);
  /* Point to point cannot choose a transport (that is collective): before the first
   * cuda collective on c, cuda tensors are host-staged; under NCCL both partners must
   * pass cuda tensors. */
  gdp_ctx *nx = nccl_ctx(c, send ? send : recv);
  if (recv) gdp_tensor_mark_written(recv);
  gdp_dtype dt = send ? send->dtype : recv ? recv->dtype : GDP_DTYPE_F32;
  if (st == GDP_OK && (send || recv))
    st = raw_sendrecv(func, c, nx, s ? gdp_tensor_ptr(s) : NULL, s ? numel(s) : 0, send ? dst : -1,
                      r ? gdp_tensor_ptr(r) : NULL, r ? numel(r) : 0, recv ? src : -1, dt, tag);
  if (st == GDP_OK && recv) st = finish_output(recv, r);
  gdp_tensor_free(s);
  gdp_tensor_free(r);
  if (st != GDP_OK) return st;
  int64_t sb = send ? (int64_t)nbytes(send) : 0, rb = recv ? (int64_t)nbytes(recv) : 0;
  count(c, dst == c->rank ? 0 : sb, src == c->rank ? 0 : rb, sb, rb);
  return GDP_OK;
}

gdp_status gdp_comm_send(gdp_comm *c, const gdp_tensor *t, int peer, int tag) {
  if (c && (peer < 0 || peer >= c->size))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "peer: expected a rank in [0, %d), got %d", c->size, peer);
  if (!t) return GDP_ERROR(GDP_ERR_INVALID_ARG, "t is NULL");
  return p2p(__func__, c, t, peer, NULL, -1, tag);
}

gdp_status gdp_comm_recv(gdp_comm *c, gdp_tensor *t, int peer, int tag) {
  if (c && (peer < 0 || peer >= c->size))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "peer: expected a rank in [0, %d), got %d", c->size, peer);
  if (!t) return GDP_ERROR(GDP_ERR_INVALID_ARG, "t is NULL");
  return p2p(__func__, c, NULL, -1, t, peer, tag);
}

gdp_status gdp_comm_sendrecv(gdp_comm *c, const gdp_tensor *send, int dst, gdp_tensor *recv,
                             int src, int tag) {
  return p2p(__func__, c, send, dst, recv, src, tag);
}
