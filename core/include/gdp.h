/*
 * gdp.h -- the whole public C API of libgdp (Gated DeltaProduct research core).
 *
 * This header is also the single source of the LuaJIT FFI declarations: the build
 * runs it through the C preprocessor with GDP_CDEF defined and wraps the output into
 * lua/gdp/cdef.lua (see cmake/gen_cdef.cmake).  Keep it plain C: no inline functions,
 * no macros that the FFI needs (macros vanish in preprocessing; expose constants as
 * enums or functions instead).
 *
 * Conventions (docs/design.md section 5):
 *   - Fallible functions return gdp_status (GDP_OK = 0, errors negative) and write
 *     results through a final `**out` argument.  On failure a thread-local message
 *     names the function, the argument, expected and actual values, and the source
 *     location: gdp_last_error().
 *   - Handles are opaque and reference counted.  `_new`/constructors return an owned
 *     reference; `_retain` adds one; `_free` is NULL-safe and drops one.  Views hold a
 *     reference to their storage, so free order never matters.
 *   - Pointer parameters are "borrowed" (the callee keeps no reference after return)
 *     unless marked "owned".
 *   - Sizes and indices are int64_t and 0-based in C.
 *   - Nothing in the library exits, aborts or longjmps.
 */
#ifndef GDP_H
#define GDP_H

#ifndef GDP_CDEF
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif
#endif

/* ------------------------------------------------------------------ status */

typedef enum gdp_status {
  GDP_OK = 0,
  GDP_ERR_INVALID_ARG = -1,
  GDP_ERR_SHAPE = -2,
  GDP_ERR_DTYPE = -3,
  GDP_ERR_OOM = -4,
  GDP_ERR_CUDA = -5,
  GDP_ERR_NCCL = -6,
  GDP_ERR_MPI = -7,
  GDP_ERR_UNSUPPORTED = -8,
  GDP_ERR_IO = -9,
  GDP_ERR_INTERNAL = -10,
  GDP_ERR_INTERRUPTED = -11 /* the work was cancelled (gdp_interrupt_request, Ctrl-C) */
} gdp_status;

/* "GDP_OK", "GDP_ERR_SHAPE", ...; "GDP_ERR_UNKNOWN" for other values. */
const char *gdp_status_name(gdp_status status);
/* Message of the last failure on this thread ("" if none).  Borrowed; valid until
   the next failing call on this thread. */
const char *gdp_last_error(void);
void gdp_clear_error(void);

/* ------------------------------------------------------------------ interrupts */

/* Cancellation of long CPU work.  One process-wide flag: gdp_interrupt_request sets it
   (async-signal-safe: the SIGINT handler below calls it), the CPU kernels poll it per
   chunk of work (the operator's chunk and token loops, the mixer ops' row blocks; not
   inside one BLAS call) and then return GDP_ERR_INTERRUPTED, freeing what they
   allocated; the outputs of an interrupted call are not made.  The flag stays set
   until gdp_interrupt_clear (gdp's Lua bindings clear it when they raise the error).

   gdp_interrupt_install puts in a SIGINT handler (no SA_RESTART: a blocking read
   returns EINTR) that sets the flag.  While gdp_interrupt_defer's count is above 0 it
   does only that; otherwise it also passes the signal on to the handler it replaced
   at the first install (a function is called, SIG_DFL ends the process as before,
   SIG_IGN ignores it), so code outside gdp's calls is still interrupted the way it
   was.  Installing again keeps that first handler.  GDP_ERR_INVALID_ARG when
   sigaction fails. */
gdp_status gdp_interrupt_install(void);
void gdp_interrupt_request(void);
int gdp_interrupt_requested(void); /* 1 when set */
void gdp_interrupt_clear(void);
void gdp_interrupt_defer(int delta); /* +1 before a call whose outputs are not yet owned, -1 after */
/* Test hook: the flag gets set by the `polls`-th kernel poll from now (1: the next);
   < 1 cancels a pending countdown. */
void gdp_interrupt_request_after(int64_t polls);
/* What the kernels call between chunks of work: 1 when the work must stop. */
int gdp_interrupt_poll(void);

/* ------------------------------------------------------------------ library */

/* Bumped whenever a declaration in this header changes incompatibly; the Lua
   loader refuses a library whose number differs from the one it was generated for. */
int gdp_abi_version(void);
const char *gdp_version(void);
/* Multi-line "key: value" text: version, compiler, build type, BLAS, CUDA, NCCL, MPI,
   sanitizer.  Borrowed, static. */
const char *gdp_build_info(void);

/* ------------------------------------------------------------------ dtypes, devices */

typedef enum gdp_dtype {
  GDP_DTYPE_F64 = 0,
  GDP_DTYPE_F32 = 1,
  GDP_DTYPE_BF16 = 2,
  GDP_DTYPE_I32 = 3,
  GDP_DTYPE_I64 = 4,
  GDP_DTYPE_COUNT = 5
} gdp_dtype;

/* "f64", "f32", "bf16", "i32", "i64"; "?" for other values. */
const char *gdp_dtype_name(gdp_dtype dtype);
/* 0 for an invalid dtype. */
size_t gdp_dtype_size(gdp_dtype dtype);
/* Accepts the short names above and "float64", "float32", "bfloat16", "int32",
   "int64", "double", "float". */
gdp_status gdp_dtype_from_name(const char *name, gdp_dtype *out);

/* bfloat16 conversions: round to nearest even, NaN stays NaN. */
uint16_t gdp_bf16_from_f32(float x);
float gdp_f32_from_bf16(uint16_t x);

typedef enum gdp_device_type {
  GDP_DEVICE_CPU = 0,
  GDP_DEVICE_CUDA = 1,
  GDP_DEVICE_TYPE_COUNT = 2
} gdp_device_type;

/* "cpu", "cuda". */
const char *gdp_device_type_name(gdp_device_type type);
/* Devices of that type usable now: 1 for cpu; for cuda 0 when the library was built
   without CUDA or no GPU is present. */
int gdp_device_count(gdp_device_type type);
/* Bytes currently allocated by the library on devices of that type (all indices). */
int64_t gdp_mem_live_bytes(gdp_device_type type);

/* ------------------------------------------------------------------ context */

/* A context owns a device, its stream (cuda), worker-thread count (cpu) and the
   Philox RNG state.  Tensors remember the context that allocated them. */
typedef struct gdp_ctx gdp_ctx;

/* Owned result.  GDP_ERR_UNSUPPORTED for a device type not built in, GDP_ERR_INVALID_ARG
   for an index out of range. */
gdp_status gdp_ctx_new(gdp_device_type type, int index, gdp_ctx **out);
gdp_ctx *gdp_ctx_retain(gdp_ctx *ctx);
void gdp_ctx_free(gdp_ctx *ctx);
gdp_device_type gdp_ctx_device_type(const gdp_ctx *ctx);
int gdp_ctx_device_index(const gdp_ctx *ctx);
/* Waits for all queued work; surfaces asynchronous device errors. */
gdp_status gdp_ctx_sync(gdp_ctx *ctx);
/* The device's own time for work the host queues, without the host's launch time (the
   way fla's "GPU only" figure is taken).  gdp_ctx_timer_start waits for queued work,
   then queues a spin of hold_ms milliseconds (0 < hold_ms <= 10000) and a start mark
   after it: work queued while the spin runs starts back to back behind it.
   gdp_ctx_timer_stop queues a stop mark, waits for it and returns the milliseconds
   between the marks.  The figure is only the device's if the host queued the work
   within hold_ms (otherwise the device waited for the host inside it): the caller
   compares its host time with hold_ms.  GDP_ERR_UNSUPPORTED on the CPU (its work runs on
   the calling thread); GDP_ERR_INVALID_ARG for a stop without a start. */
gdp_status gdp_ctx_timer_start(gdp_ctx *ctx, double hold_ms);
gdp_status gdp_ctx_timer_stop(gdp_ctx *ctx, double *device_ms);
/* CPU worker threads used by ops (default: the number of online cores, or the
   GDP_NUM_THREADS environment variable).  n < 1 resets to the default. */
void gdp_ctx_set_num_threads(gdp_ctx *ctx, int n);
int gdp_ctx_num_threads(const gdp_ctx *ctx);
/* RNG: Philox 4x32-10 keyed by the seed; each random fill consumes counter blocks
   from `offset` (see gdp_tensor_uniform).  Same seed and offset give the same
   numbers on every device. */
void gdp_ctx_manual_seed(gdp_ctx *ctx, uint64_t seed);
uint64_t gdp_ctx_seed(const gdp_ctx *ctx);
uint64_t gdp_ctx_rng_offset(const gdp_ctx *ctx);
void gdp_ctx_set_rng_offset(gdp_ctx *ctx, uint64_t offset);

/* Tuning: knobs of speed, not of the math.  Each field is 0 for the backend's own choice;
   a context starts with all zeros, and an op's options may override a field per call.
     value_block  CUDA fast path of the GDP operator: value columns per thread block, 16,
                  32 or 64.  No effect on the cpu (its kernels have no such block).
   gdp_ctx_set_tuning checks every field (GDP_ERR_INVALID_ARG naming the field, what it
   takes and what it got) and changes nothing unless all are valid. */
typedef struct gdp_tuning {
  int32_t value_block;
} gdp_tuning;

/* The kernels the last GDP operator call on this context ran (forward or backward):
   "chunked" or "recurrent" on the cpu, "fast chunked" or "recurrent" on cuda; NULL before
   the first call.  A static string; the last call of any thread sharing the context. */
const char *gdp_ctx_last_path(const gdp_ctx *ctx);

void gdp_tuning_init(gdp_tuning *t); /* all zeros: the backends' own choices */
gdp_status gdp_ctx_set_tuning(gdp_ctx *ctx, const gdp_tuning *t);
gdp_status gdp_ctx_get_tuning(const gdp_ctx *ctx, gdp_tuning *out);

typedef enum gdp_op {
  GDP_OP_COPY = 0,         /* copy / dtype conversion / fill */
  GDP_OP_ELEMENTWISE = 1,  /* add, mul, scale */
  GDP_OP_REDUCE = 2,       /* sum, dot, norm, nonfinite count */
  GDP_OP_RNG = 3,          /* uniform, normal */
  GDP_OP_GDP_FORWARD = 4,  /* chunk_gated_delta_product forward */
  GDP_OP_GDP_BACKWARD = 5, /* chunk_gated_delta_product backward */
  GDP_OP_MATMUL = 6,       /* 2-D matrix product (BLAS / cuBLAS) */
  GDP_OP_COUNT = 7
} gdp_op;

/* 1 when the context's backend implements `op` for tensors of `dtype`, else 0. */
int gdp_ctx_supports(const gdp_ctx *ctx, gdp_op op, gdp_dtype dtype);

/* Raw Philox 4x32-10 block: out = philox(counter, key).  Exposed for tests. */
void gdp_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

/* ------------------------------------------------------------------ tensors */

enum { GDP_MAX_DIMS = 8 };

typedef struct gdp_tensor gdp_tensor;

/* New contiguous tensors on ctx's device (owned results).  ndim 0..GDP_MAX_DIMS; a
   0-dim tensor holds one element; sizes may be 0. */
gdp_status gdp_tensor_empty(gdp_ctx *ctx, gdp_dtype dtype, int ndim, const int64_t *shape,
                            gdp_tensor **out);
gdp_status gdp_tensor_zeros(gdp_ctx *ctx, gdp_dtype dtype, int ndim, const int64_t *shape,
                            gdp_tensor **out);
/* Copies `nbytes` of contiguous row-major host data of `src_dtype` into a new tensor of
   `dtype` (converting).  nbytes must equal numel * size(src_dtype). */
gdp_status gdp_tensor_from_host(gdp_ctx *ctx, gdp_dtype dtype, int ndim, const int64_t *shape,
                                gdp_dtype src_dtype, const void *src, size_t nbytes,
                                gdp_tensor **out);

gdp_tensor *gdp_tensor_retain(gdp_tensor *t);
void gdp_tensor_free(gdp_tensor *t);

int gdp_tensor_ndim(const gdp_tensor *t);
/* dim may be negative (counted from the end); out-of-range gives -1. */
int64_t gdp_tensor_size(const gdp_tensor *t, int dim);
int64_t gdp_tensor_stride(const gdp_tensor *t, int dim);
int64_t gdp_tensor_numel(const gdp_tensor *t);
/* Element offset of the first element inside its storage. */
int64_t gdp_tensor_offset(const gdp_tensor *t);
gdp_dtype gdp_tensor_dtype(const gdp_tensor *t);
gdp_device_type gdp_tensor_device_type(const gdp_tensor *t);
int gdp_tensor_device_index(const gdp_tensor *t);
/* Borrowed: the context that allocated the storage. */
gdp_ctx *gdp_tensor_ctx(const gdp_tensor *t);
int gdp_tensor_is_contiguous(const gdp_tensor *t);
/* 1 when t was made by a view operation (shares storage made for another tensor). */
int gdp_tensor_is_view(const gdp_tensor *t);
/* Address of the first element (a device address for cuda tensors: never dereference
   it on the host). */
void *gdp_tensor_data(const gdp_tensor *t);
/* Write counter of t's storage (PyTorch's _version): 0 for a tensor made by
   gdp_tensor_empty, _zeros, _from_host, _clone or _to (or copied by _contiguous or
   _reshape), then raised by every call of this API that writes into existing elements:
   copy (dst), fill, set, uniform, normal, add, mul, scale and matmul (out), and the
   collectives' output tensors (allgather, alltoall(v), allreduce, broadcast on the
   other ranks, recv and sendrecv's recv), also when such a call fails after its checks.
   Views share the storage: a write through one raises the count of all.  Calls that
   allocate their results leave their inputs' counts alone.  Writes through
   gdp_tensor_data's pointer (or by other code holding it) are not seen.  Only
   differences mean something (other calls may build their results with writes): equal
   values from two calls mean no write through the API in between, and say nothing
   about which elements changed. */
uint64_t gdp_tensor_version(const gdp_tensor *t);

/* Views (owned results sharing t's storage).  dims may be negative. */
/* Same numel; one size may be -1 (inferred).  Fails with GDP_ERR_SHAPE when the strides
   cannot express it (use gdp_tensor_reshape, which copies then). */
gdp_status gdp_tensor_view(gdp_tensor *t, int ndim, const int64_t *shape, gdp_tensor **out);
/* A view when possible, otherwise a contiguous copy. */
gdp_status gdp_tensor_reshape(gdp_tensor *t, int ndim, const int64_t *shape, gdp_tensor **out);
gdp_status gdp_tensor_narrow(gdp_tensor *t, int dim, int64_t start, int64_t length,
                             gdp_tensor **out);
gdp_status gdp_tensor_select(gdp_tensor *t, int dim, int64_t index, gdp_tensor **out);
gdp_status gdp_tensor_transpose(gdp_tensor *t, int dim0, int dim1, gdp_tensor **out);
/* perm is a permutation of 0..ndim-1: out.size(i) = t.size(perm[i]). */
gdp_status gdp_tensor_permute(gdp_tensor *t, int ndim, const int *perm, gdp_tensor **out);
/* New reference to t itself when already contiguous, else a contiguous copy. */
gdp_status gdp_tensor_contiguous(gdp_tensor *t, gdp_tensor **out);
/* Always a new contiguous copy (same dtype and device). */
gdp_status gdp_tensor_clone(gdp_tensor *t, gdp_tensor **out);

/* Copies src into dst (same shape; any dtypes, any strides; host<->device through
   ctx's stream).  ctx may be NULL (dst's context is used).  dst and src may share
   memory (e.g. t and its transpose, or shifted windows of one tensor): dst gets src's
   values as they were before the call. */
gdp_status gdp_tensor_copy(gdp_ctx *ctx, gdp_tensor *dst, const gdp_tensor *src);
/* New contiguous tensor of `dtype` on ctx's device holding t's values. */
gdp_status gdp_tensor_to(gdp_ctx *ctx, const gdp_tensor *t, gdp_dtype dtype, gdp_tensor **out);
/* Contiguous row-major host copy of t's values as `dst_dtype` (converting).  dst_bytes
   must equal numel * size(dst_dtype). */
gdp_status gdp_tensor_to_host(const gdp_tensor *t, gdp_dtype dst_dtype, void *dst,
                              size_t dst_bytes);
gdp_status gdp_tensor_fill(gdp_tensor *t, double value);
/* One element, any device (slow: for tests and printing).  idx has ndim entries. */
gdp_status gdp_tensor_get(const gdp_tensor *t, const int64_t *idx, double *out);
gdp_status gdp_tensor_set(gdp_tensor *t, const int64_t *idx, double value);

/* Random fills from t's context RNG.  Element i of t (row-major order) takes word i%4
   of Philox block (offset + i/4) keyed by the seed; the context's offset then advances
   by ceil(numel/4).  uniform: lo + (hi-lo) * (u + 0.5) * 2^-32.  normal: Box-Muller on
   the uniform pairs (words 0,1 and 2,3 of a block), mean + std * z. */
gdp_status gdp_tensor_uniform(gdp_tensor *t, double lo, double hi);
gdp_status gdp_tensor_normal(gdp_tensor *t, double mean, double std);

/* ------------------------------------------------------------------ elementwise, reductions */

/* out = a + alpha * b (same shapes; out may alias a or b, also in another layout such
   as a transpose: inputs are read as they were before the call). */
gdp_status gdp_tensor_add(gdp_tensor *out, const gdp_tensor *a, const gdp_tensor *b,
                          double alpha);
/* out = a * b elementwise. */
gdp_status gdp_tensor_mul(gdp_tensor *out, const gdp_tensor *a, const gdp_tensor *b);
/* out = alpha * a. */
gdp_status gdp_tensor_scale(gdp_tensor *out, const gdp_tensor *a, double alpha);
/* Reductions accumulate in float64. */
gdp_status gdp_tensor_sum(const gdp_tensor *t, double *out);
gdp_status gdp_tensor_dot(const gdp_tensor *a, const gdp_tensor *b, double *out);
gdp_status gdp_tensor_norm(const gdp_tensor *t, double *out);
gdp_status gdp_tensor_max_abs(const gdp_tensor *t, double *out);
gdp_status gdp_tensor_count_nonfinite(const gdp_tensor *t, int64_t *out);
/* out[i] = the sum of squares of ts[i] (float64 accumulation, the bits gdp_tensor_norm
   squares) for n >= 0 tensors of one device: one wait for all of them on cuda, where n
   separate norms would each round-trip to the host (gradient-norm clipping). */
gdp_status gdp_tensor_sumsq_many(int n, const gdp_tensor *const *ts, double *out);
/* ||a - ref|| / ||ref|| in float64; NaN when either holds a non-finite value; 0 when
   both are all zero; +inf when ref is zero and a is not. */
gdp_status gdp_tensor_rel_error(const gdp_tensor *a, const gdp_tensor *ref, double *out);

/* out = alpha * op(a) @ op(b) + beta * out for 2-D float32/float64 tensors (and bfloat16
   with float32 accumulation on cuda, into a bf16 or a float32 out), op(x) = x or x^T as
   trans_a/trans_b say; out is [M,N] and must not alias a or b.  Batched: out
   [batch,M,N] with a and b [batch,.,.] (dim 0 any stride; op transposes the last two
   dims), one product per batch entry with the same alpha and beta; one of a and b may
   be 2-D, the same matrix for every entry.  beta = 0 never reads out. */
gdp_status gdp_tensor_matmul(gdp_tensor *out, const gdp_tensor *a, const gdp_tensor *b,
                             int trans_a, int trans_b, double alpha, double beta);

/* Monotonic wall clock in seconds (for benchmarks). */
double gdp_time_now(void);

/* ------------------------------------------------------------------ safetensors */

typedef struct gdp_st_file gdp_st_file;

/* Loads every tensor of a safetensors file onto ctx's device, keeping their dtypes
   (F64, F32, BF16, I32, I64; others are GDP_ERR_UNSUPPORTED) and the __metadata__
   strings.  Malformed or truncated files give GDP_ERR_IO with the reason. */
gdp_status gdp_safetensors_load(gdp_ctx *ctx, const char *path, gdp_st_file **out);
void gdp_st_free(gdp_st_file *f);
int64_t gdp_st_count(const gdp_st_file *f);
/* Borrowed names, in file-offset order; NULL when i is out of range. */
const char *gdp_st_name(const gdp_st_file *f, int64_t i);
/* New reference to tensor i. */
gdp_status gdp_st_tensor(const gdp_st_file *f, int64_t i, gdp_tensor **out);
int64_t gdp_st_meta_count(const gdp_st_file *f);
const char *gdp_st_meta_key(const gdp_st_file *f, int64_t i);
const char *gdp_st_meta_value(const gdp_st_file *f, int64_t i);

/* Writes tensors (any device; copied to host) with names and optional metadata
   strings.  Names must be unique and non-empty. */
gdp_status gdp_safetensors_save(const char *path, int64_t count, const char *const *names,
                                const gdp_tensor *const *tensors, int64_t meta_count,
                                const char *const *meta_keys, const char *const *meta_values);

/* ------------------------------------------------------------------ GDP operator */

typedef enum gdp_delta_product_algorithm {
  GDP_ALGO_AUTO = 0,      /* the fastest path the backend has */
  GDP_ALGO_CHUNK = 1,     /* chunkwise WY algorithm */
  GDP_ALGO_RECURRENT = 2  /* token-by-token recurrence (the float64 oracle on cpu) */
} gdp_delta_product_algorithm;

/* Options of chunk_gated_delta_product (fla's argument names).  A plain struct: its
   layout is checked against the FFI's by the specs (gdp_delta_product_options_layout). */
typedef struct gdp_delta_product_options {
  int64_t num_householder;    /* n >= 1; k, v, beta hold T*n rows */
  double scale;               /* output scale; 0 means K^-1/2 */
  int64_t chunk_size;         /* steps per chunk of the expanded stream; 0: the backend's
                                 own (cpu: 64; cuda: see the CUDA operator's shapes) */
  int32_t use_qk_l2norm;      /* normalise q and k inside the op (eps 1e-6) */
  int32_t output_final_state; /* forward returns ht */
  int32_t algorithm;          /* gdp_delta_product_algorithm */
  int32_t value_block;        /* tuning for this call (gdp_tuning.value_block); 0: the ctx's */
  int32_t reserved;           /* must be 0 */
} gdp_delta_product_options;

/* Fills *opts with the defaults (n = 1, scale default, chunk_size 0 = the backend's own,
   no l2norm, no ht, value_block 0 = the context's). */
void gdp_delta_product_options_init(gdp_delta_product_options *opts);
/* sizeof and the offsets of the fields in declaration order (8 entries). */
size_t gdp_delta_product_options_layout(size_t offsets[8]);

/*
 * Forward.  Layouts (row-major, fla's):
 *   q [B,T,H,K]; k [B,T*n,H,K]; v [B,T*n,H,V]; beta [B,T*n,H]; g [B,T,H] or NULL
 *   (ungated); h0 [N,H,K,V] or NULL (zeros); cu_seqlens NULL or int32/int64 [N+1]
 *   over tokens (then B = 1; non-decreasing from 0 to T; empty sequences allowed).
 * Inputs: float64, float32 or bfloat16 (bf16 is computed in float32), all of one
 * dtype, on one device; h0 float32 or float64; any strides.
 * Results (owned): *o [B,T,H,V] in q's dtype; *ht [N,H,K,V] (float64 for float64
 * inputs, else float32) when opts->output_final_state, else *ht is set to NULL.
 */
gdp_status gdp_delta_product_forward(gdp_ctx *ctx, const gdp_delta_product_options *opts, const gdp_tensor *q,
                           const gdp_tensor *k, const gdp_tensor *v, const gdp_tensor *g,
                           const gdp_tensor *beta, const gdp_tensor *h0,
                           const gdp_tensor *cu_seqlens, gdp_tensor **o, gdp_tensor **ht);

/*
 * Backward of the loss sum(o * dO) + sum(ht * dht).  Same inputs as the forward plus
 * dO [B,T,H,V] and dht [N,H,K,V] or NULL (zeros).  Results (owned), in the dtype of
 * their input: dq, dk, dv, dbeta; *dg (NULL when g is NULL); *dh0 (NULL when h0 is
 * NULL; float32 or float64 like ht).
 */
gdp_status gdp_delta_product_backward(gdp_ctx *ctx, const gdp_delta_product_options *opts, const gdp_tensor *q,
                            const gdp_tensor *k, const gdp_tensor *v, const gdp_tensor *g,
                            const gdp_tensor *beta, const gdp_tensor *h0,
                            const gdp_tensor *cu_seqlens, const gdp_tensor *d_o,
                            const gdp_tensor *dht, gdp_tensor **dq, gdp_tensor **dk,
                            gdp_tensor **dv, gdp_tensor **dbeta, gdp_tensor **dg,
                            gdp_tensor **dh0);

/* dh0 [N,H,K,V] of the backward above, alone (h0 may be NULL: dh0 does not depend on
 * its value): context parallelism's backward summary.  The CUDA fast path runs only its
 * prep and its state-gradient pass; elsewhere the full backward runs and keeps dh0. */
gdp_status gdp_delta_product_backward_dh0(gdp_ctx *ctx, const gdp_delta_product_options *opts,
                                         const gdp_tensor *q, const gdp_tensor *k,
                                         const gdp_tensor *v, const gdp_tensor *g,
                                         const gdp_tensor *beta, const gdp_tensor *h0,
                                         const gdp_tensor *cu_seqlens, const gdp_tensor *d_o,
                                         const gdp_tensor *dht, gdp_tensor **dh0);

/*
 * Save for backward (opt-in).  gdp_delta_product_forward_ex is gdp_delta_product_forward
 * that, when saved is not NULL, also returns in *saved (owned; free with
 * gdp_delta_product_saved_free) what the backward would otherwise recompute: on cuda's fast
 * path (bf16, n <= 8, K <= 128, V <= 256) the per-chunk panels, the chunk-start
 * states h (bf16), D (bf16) and the prep's T^T (bf16) -- 2(2C + TC)K + 4CV + 2 TC C + 2C^2 +
 * 2KV + 4 bytes per chunk of C steps (TC tokens) and head, C = 32, 64, 48, 64 for
 * n = 1..4, K and V counted at the width the kernels run (the next of 32, 64, 128, 256:
 * that path pads the others), and n = 5..8
 * counted as 2 tokens of 3 or 4 steps and V = 256 as two blocks of V = 128 (as that path
 * runs them), e.g.
 * 0.97 GB at B x T = 4 x 4096, H = 16, K = V = 128, n = 2 -- which
 * gdp_delta_product_backward_ex then reads instead of running the prep and the state pass
 * again.  Paths that keep nothing (cpu; cuda's recurrent kernels) still return a saved
 * object, of 0 bytes, and their backward recomputes: results identical to the plain calls.
 *
 * The object records the problem (dtype, device, B, T, H, K, V, n, gated, h0 present,
 * use_qk_l2norm, scale, algorithm, the backend's path, the cu_seqlens values) and
 * gdp_delta_product_backward_ex with a saved object refuses any mismatch (GDP_ERR_INVALID_ARG
 * naming the field, its expected and actual values).  It belongs to the very input
 * VALUES of its forward, which are not checked: a backward with other q, k, v, g, beta
 * or h0 values of the same shapes returns gradients of the forward's inputs.  It holds a
 * reference to its context, and its device memory counts in gdp_mem_live_bytes; freeing
 * it is stream-ordered on that context's stream (work already queued there that reads it
 * finishes first).  Use it with the context of its forward: another context of the same
 * device has another stream, so synchronise (gdp_ctx_sync) between them, as for any
 * tensor.  One object may serve several backwards (it is only read).
 */
typedef struct gdp_delta_product_saved gdp_delta_product_saved;

/* saved NULL: exactly gdp_delta_product_forward.  Else *saved receives the object (NULL on
 * failure). */
gdp_status gdp_delta_product_forward_ex(gdp_ctx *ctx, const gdp_delta_product_options *opts, const gdp_tensor *q,
                              const gdp_tensor *k, const gdp_tensor *v, const gdp_tensor *g,
                              const gdp_tensor *beta, const gdp_tensor *h0,
                              const gdp_tensor *cu_seqlens, gdp_tensor **o, gdp_tensor **ht,
                              gdp_delta_product_saved **saved);

/* gdp_delta_product_backward; saved (borrowed) NULL: the same, else the forward's kept buffers. */
gdp_status gdp_delta_product_backward_ex(gdp_ctx *ctx, const gdp_delta_product_options *opts, const gdp_tensor *q,
                               const gdp_tensor *k, const gdp_tensor *v, const gdp_tensor *g,
                               const gdp_tensor *beta, const gdp_tensor *h0,
                               const gdp_tensor *cu_seqlens, const gdp_tensor *d_o,
                               const gdp_tensor *dht, gdp_tensor **dq, gdp_tensor **dk,
                               gdp_tensor **dv, gdp_tensor **dbeta, gdp_tensor **dg,
                               gdp_tensor **dh0, const gdp_delta_product_saved *saved);

/* Device bytes the object keeps (0 for NULL or when its backend keeps nothing). */
size_t gdp_delta_product_saved_bytes(const gdp_delta_product_saved *saved);
/* Releases the object (owned); NULL is a no-op. */
void gdp_delta_product_saved_free(gdp_delta_product_saved *saved);

/* ------------------------------------------------------------------ mixer layer ops */

/*
 * Building blocks of the Gated DeltaProduct mixer layer (docs/design.md section 3,
 * Megatron-Core semantics), each with its backward.  Common rules:
 *   - float64 or float32 tensors of any strides (copied to contiguous inside); the
 *     dtype of the first tensor argument is the compute dtype, the other float
 *     arguments are converted to it.  float32 elementwise math runs in float32;
 *     reductions (sums over tokens and over norm groups) accumulate in float64.
 *   - Results are new contiguous tensors (owned) in the compute dtype, except the
 *     gradients of parameters, which take the parameter's dtype and shape, and the
 *     token gradients of the conv and of the input stage, which are written into
 *     caller tensors (any strides: the in_proj gradient's sections).
 *   - Backward result pointers may be NULL: that gradient is not computed.  A
 *     gradient of an absent optional input is set to NULL.
 *   - cpu and cuda (where bf16 is a compute dtype too); repeat_heads is built from
 *     tensor views and copies and runs on every device.
 */

typedef enum gdp_activation {
  GDP_ACT_NONE = 0,
  GDP_ACT_SILU = 1 /* x * sigmoid(x) */
} gdp_activation;

/* "none", "silu"; "?" for other values. */
const char *gdp_activation_name(gdp_activation act);

/*
 * Depthwise causal conv1d over time (the short conv of the mixer):
 *   out[t,b,c] = act(bias[c] + sum_{w<W} weight[c,w] * x~[t-(W-1)+w, b, c])
 * x [T,B,C] sequence-major (a strided channel slice of the in_proj output is fine);
 * weight [C,W] or Megatron's [C,1,W]; bias [C] or NULL.  x~[s] is x[s] when s lies
 * in the same sequence as t, else zero, except before token 0:
 *   halo [L,B,C] or NULL holds the L tokens that precede token 0 (row L-1 is token
 *   -1); x~[s] = halo[L+s] for -min(L,W-1) <= s < 0.  Rows older than W-1 are never
 *   read; pass fewer rows (L < W-1) to mask tokens of another sequence.
 * cu_seqlens NULL (each of the B columns is one sequence) or int32/int64 [N+1] over T
 * with B = 1: the conv restarts at every sequence start (no tap reads across one;
 * empty sequences are legal); the halo continues the sequence that holds token 0.
 */
gdp_status gdp_mixer_conv1d_forward(gdp_ctx *ctx, const gdp_tensor *x, const gdp_tensor *weight,
                                    const gdp_tensor *bias, const gdp_tensor *halo,
                                    const gdp_tensor *cu_seqlens, gdp_activation activation,
                                    gdp_tensor **out);
/* Backward of sum(out * d_out), d_out [T,B,C]: dx is written into the caller's tensor dx
 * [T,B,C] (borrowed; any strides, e.g. the in_proj gradient's channel slice; it must not
 * overlap the inputs; NULL: not wanted); results dweight (weight's shape), dbias [C]
 * (NULL without bias), dhalo [L,B,C] (NULL without halo). */
gdp_status gdp_mixer_conv1d_backward(gdp_ctx *ctx, const gdp_tensor *x, const gdp_tensor *weight,
                                     const gdp_tensor *bias, const gdp_tensor *halo,
                                     const gdp_tensor *cu_seqlens, gdp_activation activation,
                                     const gdp_tensor *d_out, gdp_tensor *dx,
                                     gdp_tensor **dweight, gdp_tensor **dbias,
                                     gdp_tensor **dhalo);

/* Step sizes: beta = beta_scale * sigmoid(b), elementwise, any shape (beta_scale 1, or 2
 * for the negative-eigenvalue variant). */
gdp_status gdp_mixer_beta_forward(gdp_ctx *ctx, const gdp_tensor *b, double beta_scale,
                                  gdp_tensor **beta);
gdp_status gdp_mixer_beta_backward(gdp_ctx *ctx, const gdp_tensor *b, double beta_scale,
                                   const gdp_tensor *d_beta, gdp_tensor **db);

/* SiLU, elementwise, any shape: out = x * sigmoid(x) (the q/k/v activation of a mixer
 * without short conv); dx = d_out * s (1 + x (1 - s)), s = sigmoid(x).  [T,B,C] operands
 * whose rows lie evenly spaced with contiguous channels (a channel slice of the in_proj
 * output or its gradient) are read and written in place.  into: NULL (dx is a new
 * tensor) or x's shape and dtype, where dx is written (may be a view; *dx is then a new
 * reference to it). */
gdp_status gdp_mixer_silu_forward(gdp_ctx *ctx, const gdp_tensor *x, gdp_tensor **out);
gdp_status gdp_mixer_silu_backward(gdp_ctx *ctx, const gdp_tensor *x, const gdp_tensor *d_out,
                                   gdp_tensor *into, gdp_tensor **dx);

/* Log decays: g = -exp(A_log[h]) * softplus(a + dt_bias[h]) for a [..., H]; A_log and
 * dt_bias [H] (dt_bias may be NULL: zero).  softplus(x) = x for x > 20, else
 * log1p(exp(x)) (torch's threshold). */
gdp_status gdp_mixer_decay_forward(gdp_ctx *ctx, const gdp_tensor *a, const gdp_tensor *A_log,
                                   const gdp_tensor *dt_bias, gdp_tensor **g);
/* d_g like a; results da [..., H], dA_log [H], ddt_bias [H] (NULL without dt_bias). */
gdp_status gdp_mixer_decay_backward(gdp_ctx *ctx, const gdp_tensor *a, const gdp_tensor *A_log,
                                    const gdp_tensor *dt_bias, const gdp_tensor *d_g,
                                    gdp_tensor **da, gdp_tensor **dA_log,
                                    gdp_tensor **ddt_bias);

/* Gated grouped RMSNorm over the last dim d (Megatron's norm_before_gate = False):
 *   x = y * silu(z);  out = x * rstd * weight,  rstd = (mean(x^2 over the group) + eps)^-1/2
 * per row and group of `group_size` consecutive channels (d % group_size == 0; the
 * mixer's group_size is d_inner / ngroups).  y [..., d]; z like y, or NULL (no gate);
 * weight [d]. */
gdp_status gdp_mixer_gated_rmsnorm_forward(gdp_ctx *ctx, const gdp_tensor *y, const gdp_tensor *z,
                                           const gdp_tensor *weight, int64_t group_size,
                                           double eps, gdp_tensor **out);
/* Results dy, dz (NULL without z) like y; dweight [d]. */
gdp_status gdp_mixer_gated_rmsnorm_backward(gdp_ctx *ctx, const gdp_tensor *y,
                                            const gdp_tensor *z, const gdp_tensor *weight,
                                            int64_t group_size, double eps,
                                            const gdp_tensor *d_out, gdp_tensor **dy,
                                            gdp_tensor **dz, gdp_tensor **dweight);

/* The mixer's output norm: the D skip fused into the gated grouped RMSNorm above,
 *   y = o + D * x_v;  x = y * silu(z);  out = x * rstd * weight
 * with o [B,T,H,P] (the operator's output layout), x_v [T,B,H,P] and D [H] (per head)
 * or [H*P] (per channel; x_v and D both NULL: no skip), z [T,B,H*P] or NULL (no gate),
 * weight [H*P], group_size dividing H*P; out [T,B,H*P].  Operands whose last dim is
 * contiguous are read in place, whatever their other strides (views into larger
 * buffers cost no copy); the math is float32 or better whatever the dtype. */
gdp_status gdp_mixer_out_norm_forward(gdp_ctx *ctx, const gdp_tensor *o, const gdp_tensor *x_v,
                                      const gdp_tensor *D, const gdp_tensor *z,
                                      const gdp_tensor *weight, int64_t group_size, double eps,
                                      gdp_tensor **out);
/* d_out [T,B,H*P]; results (each pointer may be NULL: not wanted) d_o [B,T,H,P] (the
 * gradient of y, in o's layout), dz like z, dx_v [T,B,H,P] (= D * d_o), dD like D,
 * dweight like weight.  dz_into (borrowed): NULL (dz is a new tensor) or a [T,B,H*P]
 * tensor (z's shape, any strides, e.g. the z section of the in_proj gradient; it must
 * not overlap the inputs) where dz is written, in place when it has o's dtype and a
 * contiguous last dim; *dz is then a new reference to it (dz may be NULL: not wanted).
 * One pass over the operands; dD and dweight are summed in a fixed order (a run
 * repeats bit for bit). */
gdp_status gdp_mixer_out_norm_backward(gdp_ctx *ctx, const gdp_tensor *o, const gdp_tensor *x_v,
                                       const gdp_tensor *D, const gdp_tensor *z,
                                       const gdp_tensor *weight, int64_t group_size, double eps,
                                       const gdp_tensor *d_out, gdp_tensor *dz_into,
                                       gdp_tensor **d_o, gdp_tensor **dz, gdp_tensor **dx_v,
                                       gdp_tensor **dD, gdp_tensor **dweight);

/* Groups to heads: x [..., G, N] -> out [..., num_heads, N], head h reads group
 * h / (num_heads / G) (num_heads % G == 0).  Any dtype and device. */
gdp_status gdp_mixer_repeat_heads_forward(gdp_ctx *ctx, const gdp_tensor *x, int64_t num_heads,
                                          gdp_tensor **out);
/* dx [..., num_groups, N]: the sum of d_out [..., H, N] over each group's heads. */
gdp_status gdp_mixer_repeat_heads_backward(gdp_ctx *ctx, const gdp_tensor *d_out,
                                           int64_t num_groups, gdp_tensor **dx);

/*
 * The input stage of the mixer, fused: from the conv output and the gate sections
 * (sequence-major, as the in_proj output holds them) to the operator's batch-major
 * inputs, in one pass.  Sizes: num_heads nh of head_dim P, num_groups ng (a divisor of
 * nh) of state_dim N, num_householder M.
 *   xBC [T,B,M*nh*P + M*ng*N + ng*N]: the sections V (m,h,p), K (m,g,n), Q (g,n);
 *   b [T,B,M*nh] (m,h); a [T,B,nh] or NULL (no forget gate: A_log, dt_bias NULL too);
 *   A_log [nh], dt_bias [nh] or NULL, float32 when xBC is bf16 (else xBC's dtype).
 * Results (new, contiguous): q [B,T,nh,N], k [B,T*M,nh,N] (row t*M+m), v [B,T*M,nh,P],
 * with head h reading group h / (nh/ng); beta [B,T*M,nh] = beta_scale * sigmoid(b);
 * g [B,T,nh] = -exp(A_log) * softplus(a + dt_bias) in A_log's dtype (NULL without a).
 * xBC, b and a may be strided views (rows of contiguous elements read in place).
 * silu = 1: xBC is taken through SiLU as it is read (a layer without short conv, whose
 * SiLU would otherwise be a pass of its own); 0: as it is.
 */
gdp_status gdp_mixer_ssm_inputs_forward(gdp_ctx *ctx, const gdp_tensor *xBC, const gdp_tensor *b,
                                        const gdp_tensor *a, const gdp_tensor *A_log,
                                        const gdp_tensor *dt_bias, int64_t num_heads,
                                        int64_t head_dim, int64_t num_groups, int64_t state_dim,
                                        int64_t num_householder, double beta_scale, int silu,
                                        gdp_tensor **q, gdp_tensor **k, gdp_tensor **v,
                                        gdp_tensor **beta, gdp_tensor **g);
/* Backward: xBC the forward's when it ran with silu = 1 (dxBC is then the gradient of
 * that pre-activation xBC), else NULL; dq, dk, dv, dbeta like q, k, v, beta; dg like g (NULL without a); dx_v
 * [T,B,nh,P] or NULL (a gradient added to value copy m = 0: the D skip's).  The token
 * gradients are written into caller tensors (borrowed; any strides, e.g. views into
 * the in_proj gradient; they must not overlap the inputs): dxBC like xBC (written
 * whole: the group sums of dk and dq, dv plus dx_v), db like b, da like a (NULL
 * without a).  dA_log and ddt_bias (new, in their parameter's dtype; may be NULL) are
 * the sums over tokens. */
gdp_status gdp_mixer_ssm_inputs_backward(gdp_ctx *ctx, const gdp_tensor *b, const gdp_tensor *a,
                                         const gdp_tensor *A_log, const gdp_tensor *dt_bias,
                                         int64_t num_heads, int64_t head_dim, int64_t num_groups,
                                         int64_t state_dim, int64_t num_householder,
                                         double beta_scale, const gdp_tensor *xBC,
                                         const gdp_tensor *dq,
                                         const gdp_tensor *dk, const gdp_tensor *dv,
                                         const gdp_tensor *dbeta, const gdp_tensor *dg,
                                         const gdp_tensor *dx_v, gdp_tensor *dxBC,
                                         gdp_tensor *db, gdp_tensor *da, gdp_tensor **dA_log,
                                         gdp_tensor **ddt_bias);

/* D skip: out = y + D * x_v for y, x_v [..., H, P]; D [H] (per head) or [H*P] (per
 * channel: Megatron's D_has_hdim). */
gdp_status gdp_mixer_dskip_forward(gdp_ctx *ctx, const gdp_tensor *y, const gdp_tensor *x_v,
                                   const gdp_tensor *D, gdp_tensor **out);
/* dy = d_out (no result); dx_v = D * d_out; dD like D. */
gdp_status gdp_mixer_dskip_backward(gdp_ctx *ctx, const gdp_tensor *x_v, const gdp_tensor *D,
                                    const gdp_tensor *d_out, gdp_tensor **dx_v,
                                    gdp_tensor **dD);

/* ------------------------------------------------------------------ synthetic data */

/*
 * State-tracking tasks (the word problems of the DeltaProduct and "illusion of state"
 * studies; docs/design.md section 7).  A task is a finite group of n elements numbered
 * 0..n-1 with the identity 0; a sequence's tokens x_t are drawn uniformly from it and its
 * labels are the prefix products y_t = x_0 * x_1 * ... * x_t (y_0 = x_0):
 *   parity            n = 2, tokens 0/1, y_t = x_0 + ... + x_t mod 2
 *   modular_addition  n = modulus m, y_t = x_0 + ... + x_t mod m
 *   S3, S4, S5        the symmetric groups (n = 6, 24, 120), A5 the alternating group
 *                     (n = 60): the permutations of {0..k-1} in one-line notation
 *                     (p = [p(0), ..., p(k-1)]), numbered in lexicographic order (the
 *                     identity [0, 1, ..., k-1] first), A5 the even ones of S5 in that
 *                     order; the product p * q is "p, then q": (p * q)(i) = q(p(i)), so
 *                     y_t(i) = x_t(y_{t-1}(i)) tracks where each of the k objects went.
 * Tokens come from the Philox 4x32-10 stream keyed by the seed (kernels/state_tracking.h
 * gives the exact definition): sequence s of a set is a function of (seed, s) alone and
 * its first T tokens do not depend on the length drawn, so a training set (seed,
 * offsets 0, B, 2B, ...) and a test set (another seed, or a disjoint offset range) are
 * independent and reproducible at any lengths, on every device.
 */
typedef enum gdp_state_task {
  GDP_STATE_TASK_PARITY = 0,
  GDP_STATE_TASK_MODULAR_ADDITION = 1,
  GDP_STATE_TASK_S3 = 2,
  GDP_STATE_TASK_S4 = 3,
  GDP_STATE_TASK_A5 = 4,
  GDP_STATE_TASK_S5 = 5,
  GDP_STATE_TASK_COUNT = 6
} gdp_state_task;

/* "parity", "modular_addition", "S3", "S4", "A5", "S5"; "?" for other values. */
const char *gdp_state_task_name(gdp_state_task task);
/* The names above (exactly); GDP_ERR_INVALID_ARG listing them for any other. */
gdp_status gdp_state_task_from_name(const char *name, gdp_state_task *out);
/* The group's order n (token and label values are 0..n-1).  modulus: the m of
 * modular_addition (2 <= m <= 2^31 - 1), 0 for every other task. */
gdp_status gdp_state_task_size(gdp_state_task task, int64_t modulus, int64_t *out);
/* Element `index` of a permutation-group task as its one-line notation: perm[i] = p(i)
 * for i < *degree (3, 4 or 5); perm holds 5 entries.  GDP_ERR_INVALID_ARG for the
 * cyclic tasks and for an index outside 0..n-1. */
gdp_status gdp_state_task_permutation(gdp_state_task task, int64_t index, int32_t perm[5],
                                      int32_t *degree);

/* batch sequences of `length` tokens: sequences offset .. offset+batch-1 of the set of
 * `seed` (offset + batch <= 2^63).  Results (owned): *tokens and *labels, int32
 * [batch, length] contiguous on ctx's device. */
gdp_status gdp_data_state_tracking(gdp_ctx *ctx, gdp_state_task task, int64_t modulus,
                                   int64_t batch, int64_t length, uint64_t seed,
                                   uint64_t offset, gdp_tensor **tokens,
                                   gdp_tensor **labels);

/* Accuracy of predictions against labels [B,T] (int32 or int64, any device):
 * predictions are [B,T] int32/int64 classes, or [B,T,C] float scores whose argmax over
 * C is the class (the first of equal maxima; NaN never wins).  For t = 0..T-1:
 *   per_token[t]  = the fraction of the B sequences right at token t;
 *   cumulative[t] = the fraction right at every token 0..t (the sequence accuracy at
 *                   length t+1, the state-tracking studies' metric).
 * Both are caller arrays of n = T doubles (either may be NULL); B = 0 gives NaN.
 * Computed on the host (device tensors are copied). */
gdp_status gdp_data_sequence_accuracy(const gdp_tensor *predictions, const gdp_tensor *labels,
                                      int64_t n, double *cumulative, double *per_token);

/* ------------------------------------------------------------------ optimisers */

/*
 * Fused optimiser updates: one elementwise pass over a parameter, its gradient and its
 * state, in place (the math: kernels/optim_problem.h).  All tensors contiguous, of
 * param's shape and device, no two sharing memory.  Dtypes: param f64 (state f64), f32
 * (state f32) or bf16 (state f32, and `master` -- its float32 master weights -- is
 * required: the update runs on the master and writes param = the master rounded to
 * bf16); grad has param's dtype, or f32 for a bf16 param.  master must be NULL for f64
 * and f32 params.  step is the 1-based number of this update (bias correction; SGD's
 * first step sets the momentum buffer to the gradient).  Hyperparameters out of range
 * are GDP_ERR_INVALID_ARG naming them.
 */
/* AdamW (decoupled weight decay, bias-corrected): lr >= 0, 0 <= beta1, beta2 < 1,
 * eps > 0, weight_decay >= 0; exp_avg and exp_avg_sq are the first and second moments. */
gdp_status gdp_optim_adamw_step(gdp_tensor *param, const gdp_tensor *grad, gdp_tensor *exp_avg,
                                gdp_tensor *exp_avg_sq, gdp_tensor *master, double lr,
                                double beta1, double beta2, double eps, double weight_decay,
                                int64_t step);
/* SGD with momentum (torch's: weight decay added to the gradient; nesterov needs
 * momentum > 0 and dampening 0).  momentum_buffer: required when momentum > 0, NULL when
 * it is 0; 0 <= dampening <= 1. */
gdp_status gdp_optim_sgd_step(gdp_tensor *param, const gdp_tensor *grad,
                              gdp_tensor *momentum_buffer, gdp_tensor *master, double lr,
                              double momentum, double dampening, double weight_decay,
                              int nesterov, int64_t step);

/* ------------------------------------------------------------------ model layer ops */

/*
 * Building blocks of the models around the mixer (gdp.nn: Embedding, the SwiGLU MLP,
 * the loss), each with its backward.  The rules of the mixer layer ops above hold
 * (any strides; the first float tensor's dtype is the compute dtype; new contiguous
 * results; NULL backward results are not computed), and: f64 and f32 on the cpu, also
 * bf16 on cuda (float32 math inside, bf16 rounded once on store); integer inputs
 * (tokens, targets) are int32 or int64 and may live on the host or on ctx's device:
 * every value is validated, and the first one out of range is an error naming its
 * position (in a permuted view, such as a transpose, also its position in the tensor
 * the view is of).  On the cpu the op returns that error.  On cuda the values are checked on
 * the device and the verdict is read with the next wait on it (a read back, a
 * reduction, gdp_ctx_sync: whichever op waits returns the error, with the checking
 * op's message), so that a training step waits on the device once, not once per check;
 * the faulty op's outputs are not to be used, and nothing that reads them back can
 * return before the error.
 */

/* SwiGLU's gate: out = silu(gate) * up, elementwise; gate and up of one shape. */
gdp_status gdp_nn_silu_mul_forward(gdp_ctx *ctx, const gdp_tensor *gate, const gdp_tensor *up,
                                   gdp_tensor **out);
/* d_gate = d_out * up * s (1 + gate (1 - s)), s = sigmoid(gate); d_up = d_out * silu(gate). */
gdp_status gdp_nn_silu_mul_backward(gdp_ctx *ctx, const gdp_tensor *gate, const gdp_tensor *up,
                                    const gdp_tensor *d_out, gdp_tensor **d_gate,
                                    gdp_tensor **d_up);

/* Embedding lookup: out[..., :] = weight[tokens[...], :] for weight [V,D] and tokens of
 * any shape (values in [0, V)); out [..., D] in weight's dtype. */
gdp_status gdp_nn_embedding_forward(gdp_ctx *ctx, const gdp_tensor *weight,
                                    const gdp_tensor *tokens, gdp_tensor **out);
/* dweight [num_embeddings, D]: row v is the sum of d_out's rows at the tokens equal to v,
 * in token order (deterministic: no atomics on any device); d_out [..., D] (tokens'
 * shape, then D).  dweight takes d_out's dtype, float32 for bf16. */
gdp_status gdp_nn_embedding_backward(gdp_ctx *ctx, const gdp_tensor *tokens,
                                     const gdp_tensor *d_out, int64_t num_embeddings,
                                     gdp_tensor **dweight);

/* Cross-entropy of logits [..., V] against targets (logits' leading shape, values in
 * [0, V) or ignore_index): the mean over the counted rows of logsumexp(row) -
 * row[target], a row counting when its target is not ignore_index and mask (NULL, or
 * any dtype of the targets' shape) is non-zero there.  The log-softmax is computed
 * stably (max subtracted), in float32 for bf16 logits, and summed in float64.
 * *loss gets the mean (0 when no row counts), *count the counted rows (either may be
 * NULL); dlogits (NULL: not wanted) the gradient of the mean, (softmax - onehot) /
 * count on counted rows and zero elsewhere, in logits' dtype. */
gdp_status gdp_nn_cross_entropy(gdp_ctx *ctx, const gdp_tensor *logits,
                                const gdp_tensor *targets, const gdp_tensor *mask,
                                int64_t ignore_index, double *loss, int64_t *count,
                                gdp_tensor **dlogits);
/* The same without a read back: *result a new float64 [2] tensor on ctx's device, the
 * mean loss and the counted rows (gdp_nn_cross_entropy reads it). */
gdp_status gdp_nn_cross_entropy_result(gdp_ctx *ctx, const gdp_tensor *logits,
                                       const gdp_tensor *targets, const gdp_tensor *mask,
                                       int64_t ignore_index, gdp_tensor **result,
                                       gdp_tensor **dlogits);

/* ------------------------------------------------------------------ collectives */

/*
 * gdp_comm: a communicator over a group of ranks (one process per rank, launched by
 * mpirun).  CPU tensors travel over MPI (GPU tensors over NCCL later, same calls).
 * Ranks are 0-based (MPI's numbering).  Handles are reference counted like tensors.
 *
 * Collectives are blocking and must be called by every rank of the communicator in
 * the same order with the same dtype and (where the call says so) the same shapes.
 * Tensors may be non-contiguous (they are made contiguous internally) but must be on
 * the cpu (cuda tensors: GDP_ERR_UNSUPPORTED until the NCCL path exists).  Argument
 * checks are local and cheap; a rank whose arguments are bad returns an error at once
 * while the others may wait for it, so code that cannot rule out rank-dependent bad
 * input first calls gdp_comm_agree_status / gdp_comm_agree_values.  By default
 * (GDP_COMM_CHECK=0 opts out; see gdp_comm_set_check) every collective first agrees on
 * the local checks, dtype, shapes, op, root and the all-to-all row counts, so a
 * mismatch is an error on every rank instead of a hang.
 * MPI failures return GDP_ERR_MPI with the failing MPI call and MPI's error string
 * (the communicators use MPI_ERRORS_RETURN: MPI never aborts the process).
 */
typedef struct gdp_comm gdp_comm;

/* The process-wide MPI_COMM_WORLD communicator (a new reference to the same handle on
 * every call, so its byte counters are shared).  The first call initialises MPI (thread
 * level FUNNELED: call MPI from the main thread only) unless it already is, and then
 * registers an atexit handler that finalises it.  A size-1, non-MPI communicator when
 * the library was built without MPI or the process was not launched by mpirun (no
 * OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMI_RANK, PMIX_RANK or MPI_LOCALNRANKS in the
 * environment).  A build without MPI launched with more than one process fails with
 * GDP_ERR_UNSUPPORTED instead of silently running each rank alone.  Owned result. */
gdp_status gdp_comm_world(gdp_comm **out);
/* A new size-1 communicator that never touches MPI.  Owned result. */
gdp_status gdp_comm_self(gdp_comm **out);
/* MPI_Comm_split (collective): ranks passing the same color >= 0 form a new
 * communicator, ordered by key (ties by rank in c).  A negative color gives
 * *out = NULL (this rank joins no group: MPI_UNDEFINED).  Owned result. */
gdp_status gdp_comm_split(gdp_comm *c, int color, int key, gdp_comm **out);
gdp_comm *gdp_comm_retain(gdp_comm *c);
/* NULL-safe; the MPI communicator is freed with the last reference (unless MPI has
 * already been finalised). */
void gdp_comm_free(gdp_comm *c);
/* -1 for NULL. */
int gdp_comm_rank(const gdp_comm *c);
int gdp_comm_size(const gdp_comm *c);
/* 1 when c is backed by an MPI communicator (even of size 1), else 0. */
int gdp_comm_is_mpi(const gdp_comm *c);
/* How c moves tensors of a device type: "mpi" or "self" (size 1, no MPI) for cpu
 * tensors; for cuda tensors "nccl" (NCCL built in, every rank on its own GPU: device
 * UUIDs all different, and GDP_COMM_NCCL=0 on no rank; one rank only with
 * GDP_COMM_NCCL=2, which checks the NCCL path on one GPU), else "mpi-staged" (each buffer
 * copied to the host, moved over MPI, copied back; always the case when ranks share a
 * GPU) or "self-staged".  The cuda transport is chosen once per communicator, by the
 * first collective carrying cuda tensors or by this call with type cuda (index: this
 * rank's device); choosing is collective when NCCL is built in, so call it on every
 * rank.  Under NCCL every call waits for its stream, polling NCCL's asynchronous
 * error, for at most GDP_NCCL_TIMEOUT seconds (default 300), then aborts the NCCL
 * communicator with GDP_ERR_NCCL naming the collective and the rank.  *name is static. */
gdp_status gdp_comm_backend(gdp_comm *c, gdp_device_type type, int index, const char **name);
/* The cuda transport chosen so far ("nccl", "mpi-staged", "self-staged"), "" if none
 * yet; never communicates. */
const char *gdp_comm_cuda_transport(const gdp_comm *c);

/* out [size, *in.shape] (out[r] is rank r's `in`); `in` may be out[rank] itself (in
 * place), any other overlap is copied first. */
gdp_status gdp_comm_allgather(gdp_comm *c, gdp_tensor *out, const gdp_tensor *in);
/* Equal split along dim 0: in and out have the same shape [size * R, ...]; rows
 * [j*R, (j+1)*R) of `in` go to rank j and rows [j*R, (j+1)*R) of `out` come from rank j.
 * out may be in (in place). */
gdp_status gdp_comm_alltoall(gdp_comm *c, gdp_tensor *out, const gdp_tensor *in);
/* Unequal split along dim 0: send_rows[j] consecutive rows of `in` go to rank j and
 * recv_rows[j] rows of `out` come from rank j, both arrays of `size` entries >= 0 in
 * rank order, summing to in's and out's dim 0; the dims after 0 agree.  Rank i's
 * send_rows[j] must equal rank j's recv_rows[i] (checked unless checking is off). */
gdp_status gdp_comm_alltoallv(gdp_comm *c, gdp_tensor *out, const int64_t *recv_rows,
                              const gdp_tensor *in, const int64_t *send_rows);

typedef enum gdp_reduce_op {
  GDP_REDUCE_OP_SUM = 0,
  GDP_REDUCE_OP_MAX = 1,
  GDP_REDUCE_OP_MIN = 2
} gdp_reduce_op;

/* "sum", "max", "min"; "?" for other values. */
const char *gdp_reduce_op_name(gdp_reduce_op op);
/* In place, elementwise over ranks.  bf16 travels and is reduced as float32 (and
 * counted as 4 bytes per element), then rounded once. */
gdp_status gdp_comm_allreduce(gdp_comm *c, gdp_tensor *t, gdp_reduce_op op);
/* t on every rank becomes root's t. */
gdp_status gdp_comm_broadcast(gdp_comm *c, gdp_tensor *t, int root);
/* Point to point, blocking; tag >= 0; peer a rank of c.  recv's t must hold exactly
 * the number of elements sent, in the sender's dtype; otherwise the receiver gets
 * GDP_ERR_SHAPE and the message is dropped.  A size-1 non-MPI communicator cannot send
 * to itself (it would block forever): use sendrecv. */
gdp_status gdp_comm_send(gdp_comm *c, const gdp_tensor *t, int peer, int tag);
gdp_status gdp_comm_recv(gdp_comm *c, gdp_tensor *t, int peer, int tag);
/* Sends `send` to dst and receives `recv` from src at once (no deadlock in rings);
 * send and recv may differ in size and must not share storage.  dst = -1 (then send
 * may be NULL) or src = -1 (recv may be NULL) skips that half, like MPI_PROC_NULL at
 * the ends of a non-periodic chain. */
gdp_status gdp_comm_sendrecv(gdp_comm *c, const gdp_tensor *send, int dst, gdp_tensor *recv,
                             int src, int tag);
gdp_status gdp_comm_barrier(gdp_comm *c);

/* Agreement (collective), so that bad input is an error on every rank instead of a
 * hang.  Every rank passes its local status and message (NULL: gdp_last_error());
 * every rank returns the same status: GDP_OK when all passed GDP_OK, else the status of
 * the lowest failing rank, with a message naming the failing ranks and that rank's
 * message. */
gdp_status gdp_comm_agree_status(gdp_comm *c, gdp_status local, const char *local_msg);
/* Every rank passes n int64 values; GDP_ERR_INVALID_ARG on every rank when the counts
 * differ (checked first) or any value differs from rank 0's, naming `what`, the
 * differing ranks and their values. */
gdp_status gdp_comm_agree_values(gdp_comm *c, const char *what, const int64_t *values,
                                 int64_t n);

/* Payload byte counters of this rank, summed over the collectives and point-to-point
 * calls above (agreement, split and barrier traffic is not counted).  Two definitions:
 *   bytes_sent / bytes_received: what this rank sends to / receives from OTHER ranks
 *     (self-copies excluded), counted as the logical data movement, independent of the
 *     algorithm MPI picks: allgather and allreduce of S bytes: (size-1)*S each way;
 *     all-to-all: the blocks for / from the other ranks; broadcast: root sends
 *     (size-1)*S, the others receive S; send/recv/sendrecv: the message (0 to self).
 *   bytes_sent_incl_self / bytes_received_incl_self: the same with this rank's own
 *     block counted as if it travelled (allgather: size*S each way, so received equals
 *     out's bytes; all-to-all: in's bytes sent, out's received; allreduce: size*S;
 *     broadcast: root sends size*S, every rank receives S; point to point: the message).
 *     docs/design.md's per-rank volume formulas (e.g. 4*cp*H*K*(K+V) for the chunkwise
 *     all-gather of float32 summaries) count this way.
 * A failing call counts nothing. */
int64_t gdp_comm_bytes_sent(const gdp_comm *c);
int64_t gdp_comm_bytes_received(const gdp_comm *c);
int64_t gdp_comm_bytes_sent_incl_self(const gdp_comm *c);
int64_t gdp_comm_bytes_received_incl_self(const gdp_comm *c);
void gdp_comm_reset_counters(gdp_comm *c);

/* Argument checking of the collectives (on by default: one small all-gather of each
 * call's metadata -- status, call, dtype, op, root, shape -- so that a mismatch is an
 * error on every rank naming the field, never a hang or silent garbage).  Opting out,
 * for measured benchmarks: GDP_COMM_CHECK=0 in the environment of every rank (read
 * when a communicator is made), or gdp_comm_set_check(c, 0), collective (the ranks
 * agree on the flag).  Sub-communicators inherit their parent's setting. */
gdp_status gdp_comm_set_check(gdp_comm *c, int on);
int gdp_comm_check_enabled(const gdp_comm *c);
/* An uncaught error or a failing exit on one rank of a multi-rank job: writes msg (may
 * be NULL) to stderr, then MPI_Abort(MPI_COMM_WORLD, code), ending every rank (instead
 * of MPI_Finalize at exit, which waits for ranks that wait for this one).  Returns 0
 * and does nothing when no multi-rank MPI job is running (no MPI, MPI not initialised
 * or already finalised, one rank). */
int gdp_comm_abort(int code, const char *msg);

#ifndef GDP_CDEF
#ifdef __cplusplus
}
#endif
#endif

#endif /* GDP_H */
