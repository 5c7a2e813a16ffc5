/*
 * op_gdp.c -- the public GDP operator: gdp_delta_product_forward / gdp_delta_product_backward.
 *
 * This layer owns everything the kernels should not have to think about:
 *   1. validation of every argument, with messages that name the argument and give
 *      the expected and actual shape, dtype or value;
 *   2. contiguous copies of the inputs in the compute dtype (float64 stays float64;
 *      float32 and bf16 compute in float32 on cpu; algorithm RECURRENT on cpu is the
 *      float64 oracle whatever the input dtype; cuda kernels take f32/bf16 directly);
 *   3. cu_seqlens read to a host int64 array (an unpacked batch is the packed problem
 *      {0, T, 2T, ..., B*T});
 *   4. the L2 norm of q and k and its backward (through the backend's l2norm entries),
 *      unless the backend fuses it into the operator (cuda);
 *   5. dispatch through ctx->backend and conversion of the results to the documented
 *      dtypes.
 * Every temporary tensor is released on every path, success or failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_impl.h"
#include "internal.h"

/* eps of the q/k L2 norm, inside the square root (fla's l2norm). */
#define GDP_L2NORM_EPS 1e-6

void gdp_delta_product_options_init(gdp_delta_product_options *opts) {
  if (!opts) return;
  memset(opts, 0, sizeof *opts);
  opts->num_householder = 1;
  opts->scale = 0.0;
  opts->chunk_size = 0; /* the backend's own */
  opts->use_qk_l2norm = 0;
  opts->output_final_state = 0;
  opts->algorithm = GDP_ALGO_AUTO;
  opts->value_block = 0; /* the context's */
  opts->reserved = 0;
}

size_t gdp_delta_product_options_layout(size_t offsets[8]) {
  if (offsets) {
    offsets[0] = offsetof(gdp_delta_product_options, num_householder);
    offsets[1] = offsetof(gdp_delta_product_options, scale);
    offsets[2] = offsetof(gdp_delta_product_options, chunk_size);
    offsets[3] = offsetof(gdp_delta_product_options, use_qk_l2norm);
    offsets[4] = offsetof(gdp_delta_product_options, output_final_state);
    offsets[5] = offsetof(gdp_delta_product_options, algorithm);
    offsets[6] = offsetof(gdp_delta_product_options, value_block);
    offsets[7] = offsetof(gdp_delta_product_options, reserved);
  }
  return sizeof(gdp_delta_product_options);
}

/* ------------------------------------------------------------------ validation */

/* Everything the two entry points derive from their arguments. */
typedef struct gdp_op_plan {
  int64_t B, T, H, K, V, n, N;
  gdp_dtype in_dtype;    /* dtype of q, k, v, beta (and of their gradients) */
  gdp_dtype gate_dtype;  /* dtype of g and dg: in_dtype, or f32 beside bf16 tokens */
  gdp_dtype compute;     /* dtype of the buffers handed to the backend */
  gdp_dtype gate_compute; /* dtype of the g and dg buffers handed to the backend */
  gdp_dtype state_out;   /* dtype of ht / dh0 returned to the caller */
  int on_cpu;
  int l2norm;            /* opts->use_qk_l2norm */
  int l2norm_here;       /* the op layer applies the norm (the backend does not fuse it) */
  int64_t *cu;           /* host, N+1 entries (owned, free with plan_free) */
  gdp_delta_product_problem p;
} gdp_op_plan;

static void plan_free(gdp_op_plan *plan) {
  free(plan->cu);
  plan->cu = NULL;
}

static const char *shape_of(char *buf, size_t len, const gdp_tensor *t) {
  return gdp_shape_str(buf, len, t->ndim, t->shape);
}

static int is_token_dtype(gdp_dtype d) {
  return d == GDP_DTYPE_F64 || d == GDP_DTYPE_F32 || d == GDP_DTYPE_BF16;
}
static int is_state_dtype(gdp_dtype d) { return d == GDP_DTYPE_F64 || d == GDP_DTYPE_F32; }

/* t must have exactly `ndim` dims equal to `want`; `dims` spells them ("[B,T,H,K]"). */
static gdp_status check_shape(const char *func, const char *name, const gdp_tensor *t, int ndim,
                              const int64_t *want, const char *dims, const char *why) {
  int same = t->ndim == ndim;
  for (int i = 0; same && i < ndim; i++) same = t->shape[i] == want[i];
  if (same) return GDP_OK;
  char a[128], b[128];
  return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "%s: expected %s = %s%s, got %s", name, dims,
                      gdp_shape_str(b, sizeof b, ndim, want), why, shape_of(a, sizeof a, t));
}

static gdp_status check_device(const char *func, const char *name, const gdp_ctx *ctx,
                               const gdp_tensor *t) {
  const gdp_ctx *tc = t->storage->ctx;
  if (tc->type == ctx->type && tc->index == ctx->index) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected a tensor on %s:%d (ctx), got %s:%d",
                      name, gdp_device_type_name(ctx->type), ctx->index,
                      gdp_device_type_name(tc->type), tc->index);
}

/* Reads and checks cu_seqlens into plan->cu (host int64, N+1 entries). */
static gdp_status read_cu_seqlens(const char *func, gdp_op_plan *plan, const gdp_ctx *ctx,
                                  const gdp_tensor *cu) {
  char a[128];
  if (!cu) {
    /* Unpacked: B sequences of T tokens each. */
    plan->N = plan->B;
    plan->cu = malloc((size_t)(plan->N + 1) * sizeof(int64_t));
    if (!plan->cu) return GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for cu_seqlens");
    for (int64_t s = 0; s <= plan->N; s++) plan->cu[s] = s * plan->T;
    return GDP_OK;
  }
  if (cu->dtype != GDP_DTYPE_I32 && cu->dtype != GDP_DTYPE_I64)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "cu_seqlens: expected dtype i32 or i64, got %s",
                        gdp_dtype_name(cu->dtype));
  /* cu_seqlens is read on the host, so it may live on the cpu even with a cuda ctx. */
  const gdp_ctx *tc = cu->storage->ctx;
  if (tc->type != GDP_DEVICE_CPU && (tc->type != ctx->type || tc->index != ctx->index))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "cu_seqlens: expected a tensor on cpu or on %s:%d (ctx), got %s:%d",
                        gdp_device_type_name(ctx->type), ctx->index,
                        gdp_device_type_name(tc->type), tc->index);
  if (cu->ndim != 1 || cu->shape[0] < 2)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "cu_seqlens: expected 1-D [N+1] with N+1 >= 2 entries, got %s",
                        shape_of(a, sizeof a, cu));
  if (plan->B != 1)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "cu_seqlens: packed sequences need B = 1, got q with B = %lld",
                        (long long)plan->B);
  plan->N = cu->shape[0] - 1;
  plan->cu = malloc((size_t)(plan->N + 1) * sizeof(int64_t));
  if (!plan->cu) return GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for cu_seqlens");
  GDP_TRY(gdp_tensor_to_host(cu, GDP_DTYPE_I64, plan->cu,
                             (size_t)(plan->N + 1) * sizeof(int64_t)));
  if (plan->cu[0] != 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "cu_seqlens: expected cu_seqlens[0] = 0, got %lld",
                        (long long)plan->cu[0]);
  for (int64_t s = 0; s < plan->N; s++)
    if (plan->cu[s + 1] < plan->cu[s])
      return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                          "cu_seqlens: expected non-decreasing values, got cu_seqlens[%lld] = %lld "
                          "> cu_seqlens[%lld] = %lld",
                          (long long)s, (long long)plan->cu[s], (long long)(s + 1),
                          (long long)plan->cu[s + 1]);
  if (plan->cu[plan->N] != plan->T)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "cu_seqlens: expected the last entry = T = %lld (q's token count), got %lld",
                        (long long)plan->T, (long long)plan->cu[plan->N]);
  return GDP_OK;
}

/* Validates every argument of forward (d_o = dht = NULL, is_backward = 0) or backward and
 * fills the plan.  On failure the plan holds nothing to free beyond plan_free. */
static gdp_status plan_make(const char *func, gdp_ctx *ctx, const gdp_delta_product_options *opts,
                            const gdp_tensor *q, const gdp_tensor *k, const gdp_tensor *v,
                            const gdp_tensor *g, const gdp_tensor *beta, const gdp_tensor *h0,
                            const gdp_tensor *cu, const gdp_tensor *d_o, const gdp_tensor *dht,
                            int is_backward, gdp_op_plan *plan) {
  char a[128];
  memset(plan, 0, sizeof *plan);
  if (!ctx) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "ctx: expected a context, got NULL");
  if (!opts) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "opts: expected options, got NULL");
  if (!q) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "q: expected a tensor, got NULL");
  if (!k) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "k: expected a tensor, got NULL");
  if (!v) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "v: expected a tensor, got NULL");
  if (!beta) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "beta: expected a tensor, got NULL");
  if (is_backward && !d_o)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "d_o: expected a tensor, got NULL");

  /* Options. */
  if (opts->reserved != 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "opts->reserved: expected 0 (use gdp_delta_product_options_init), got %d",
                        (int)opts->reserved);
  if (opts->num_householder < 1)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "opts->num_householder: expected >= 1, got %lld",
                        (long long)opts->num_householder);
  if (opts->chunk_size < 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "opts->chunk_size: expected >= 1 (or 0 for the backend's own), got %lld",
                        (long long)opts->chunk_size);
  if (!gdp_value_block_valid(opts->value_block))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "opts->value_block: expected 0 (the context's), 16, 32 or 64, got %d",
                        (int)opts->value_block);
  if (!isfinite(opts->scale))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "opts->scale: expected a finite value (0 for K^-1/2), got %g", opts->scale);
  if (opts->algorithm != GDP_ALGO_AUTO && opts->algorithm != GDP_ALGO_CHUNK &&
      opts->algorithm != GDP_ALGO_RECURRENT)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "opts->algorithm: expected GDP_ALGO_AUTO (0), GDP_ALGO_CHUNK (1) or "
                        "GDP_ALGO_RECURRENT (2), got %d",
                        (int)opts->algorithm);

  /* Devices. */
  GDP_TRY(check_device(func, "q", ctx, q));
  GDP_TRY(check_device(func, "k", ctx, k));
  GDP_TRY(check_device(func, "v", ctx, v));
  GDP_TRY(check_device(func, "beta", ctx, beta));
  if (g) GDP_TRY(check_device(func, "g", ctx, g));
  if (h0) GDP_TRY(check_device(func, "h0", ctx, h0));
  if (d_o) GDP_TRY(check_device(func, "d_o", ctx, d_o));
  if (dht) GDP_TRY(check_device(func, "dht", ctx, dht));

  /* Dtypes: the token inputs share one of f64/f32/bf16, except that g may be f32 beside
   * bf16 ones (as fla and Megatron keep the gate: its gradient is then f32 too, and the
   * sums over tokens that make the gate parameters' gradients keep their precision);
   * states are f32/f64. */
  if (!is_token_dtype(q->dtype))
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "q: expected dtype f64, f32 or bf16, got %s",
                        gdp_dtype_name(q->dtype));
  const int gate_f32 = g && q->dtype == GDP_DTYPE_BF16 && g->dtype == GDP_DTYPE_F32;
  if (g && !gate_f32 && g->dtype != q->dtype)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE,
                        "g: expected dtype %s (q's)%s, got %s", gdp_dtype_name(q->dtype),
                        q->dtype == GDP_DTYPE_BF16 ? " or f32" : "", gdp_dtype_name(g->dtype));
  const struct { const char *name; const gdp_tensor *t; } same[] = {
      {"k", k}, {"v", v}, {"beta", beta}};
  for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
    if (same[i].t && same[i].t->dtype != q->dtype)
      return GDP_ERROR_IN(func, GDP_ERR_DTYPE,
                          "%s: expected dtype %s (q's: token inputs share one dtype), got %s",
                          same[i].name, gdp_dtype_name(q->dtype), gdp_dtype_name(same[i].t->dtype));
  if (d_o && !is_token_dtype(d_o->dtype))
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "d_o: expected dtype f64, f32 or bf16, got %s",
                        gdp_dtype_name(d_o->dtype));
  if (h0 && !is_state_dtype(h0->dtype))
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "h0: expected dtype f32 or f64, got %s",
                        gdp_dtype_name(h0->dtype));
  if (dht && !is_state_dtype(dht->dtype))
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "dht: expected dtype f32 or f64, got %s",
                        gdp_dtype_name(dht->dtype));

  /* Shapes: q fixes B, T, H, K; v fixes V. */
  if (q->ndim != 4)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "q: expected 4 dims [B,T,H,K], got %s",
                        shape_of(a, sizeof a, q));
  if (v->ndim != 4)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "v: expected 4 dims [B,T*n,H,V], got %s",
                        shape_of(a, sizeof a, v));
  const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], K = q->shape[3];
  const int64_t V = v->shape[3], n = opts->num_householder;
  if (H < 1 || K < 1 || V < 1)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "q, v: expected H >= 1, K >= 1, V >= 1, got H = %lld, K = %lld, V = %lld",
                        (long long)H, (long long)K, (long long)V);
  if (T > 0 && n > INT64_MAX / T / 2)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "opts->num_householder: %lld steps of %lld tokens overflow int64",
                        (long long)n, (long long)T);
  char why[96];
  snprintf(why, sizeof why, " for num_householder %lld", (long long)n);
  if (k->ndim == 4 && k->shape[1] % n != 0 && k->shape[0] == B && k->shape[2] == H &&
      k->shape[3] == K)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "k: its length %lld is not a multiple of num_householder %lld "
                        "(k holds T*n rows, q holds T = %lld)",
                        (long long)k->shape[1], (long long)n, (long long)T);
  GDP_TRY(check_shape(func, "k", k, 4, (const int64_t[]){B, T * n, H, K}, "[B,T*n,H,K]", why));
  GDP_TRY(check_shape(func, "v", v, 4, (const int64_t[]){B, T * n, H, V}, "[B,T*n,H,V]", why));
  GDP_TRY(check_shape(func, "beta", beta, 3, (const int64_t[]){B, T * n, H}, "[B,T*n,H]", why));
  if (g) GDP_TRY(check_shape(func, "g", g, 3, (const int64_t[]){B, T, H}, "[B,T,H]", ""));
  if (d_o) GDP_TRY(check_shape(func, "d_o", d_o, 4, (const int64_t[]){B, T, H, V}, "[B,T,H,V]", ""));

  plan->B = B, plan->T = T, plan->H = H, plan->K = K, plan->V = V, plan->n = n;
  GDP_TRY(read_cu_seqlens(func, plan, ctx, cu));
  const int64_t state[4] = {plan->N, H, K, V};
  if (h0) GDP_TRY(check_shape(func, "h0", h0, 4, state, "[N,H,K,V]", ""));
  if (dht) GDP_TRY(check_shape(func, "dht", dht, 4, state, "[N,H,K,V]", ""));

  if (!ctx->backend || (is_backward ? !ctx->backend->gdp_backward : !ctx->backend->gdp_forward))
    return GDP_NOT_IMPLEMENTED(func, ctx);

  /* Compute dtype (see the file comment). */
  plan->in_dtype = q->dtype;
  plan->on_cpu = ctx->type == GDP_DEVICE_CPU;
  if (plan->on_cpu)
    plan->compute = (opts->algorithm == GDP_ALGO_RECURRENT || q->dtype == GDP_DTYPE_F64)
                        ? GDP_DTYPE_F64
                        : GDP_DTYPE_F32;
  else
    plan->compute = q->dtype;
  plan->gate_dtype = gate_f32 ? GDP_DTYPE_F32 : q->dtype;
  plan->gate_compute = gate_f32 && plan->compute == GDP_DTYPE_BF16 ? GDP_DTYPE_F32 : plan->compute;
  plan->state_out = q->dtype == GDP_DTYPE_F64 ? GDP_DTYPE_F64 : GDP_DTYPE_F32;
  plan->l2norm = opts->use_qk_l2norm != 0;
  plan->l2norm_here = plan->l2norm && plan->on_cpu;
  if (plan->l2norm_here &&
      (!ctx->backend->l2norm_forward || (is_backward && !ctx->backend->l2norm_backward)))
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                        "use_qk_l2norm: the L2 norm of q and k is not implemented on %s "
                        "(ctx on %s:%d)",
                        gdp_device_type_name(ctx->type), gdp_device_type_name(ctx->type),
                        ctx->index);

  gdp_delta_product_problem *p = &plan->p;
  p->T_total = B * T;
  p->N = plan->N;
  p->cu_seqlens = plan->cu;
  p->H = H, p->K = K, p->V = V, p->n = n;
  p->scale = opts->scale != 0.0 ? opts->scale : 1.0 / sqrt((double)K);
  p->chunk_size = opts->chunk_size; /* 0: the backend resolves its own */
  p->num_threads = gdp_ctx_num_threads(ctx);
  p->dtype = plan->compute;
  p->gate_f32 = plan->gate_compute != plan->compute;
  p->algorithm = opts->algorithm;
  p->l2norm_in_kernel = plan->l2norm && !plan->l2norm_here;
  p->value_block = opts->value_block != 0 ? opts->value_block : ctx->tuning.value_block;
  return GDP_OK;
}

/* ------------------------------------------------------------------ buffers */

static gdp_dtype state_compute(const gdp_op_plan *plan) {
  return plan->compute == GDP_DTYPE_F64 ? GDP_DTYPE_F64 : GDP_DTYPE_F32;
}

/* A contiguous tensor of `dtype` holding t's values: a new reference to t itself when it
 * already is one (never written to), else a copy. */
static gdp_status as_compute(gdp_ctx *ctx, const gdp_tensor *t, gdp_dtype dtype,
                             gdp_tensor **out) {
  *out = NULL;
  if (!t) return GDP_OK;
  if (t->dtype == dtype) return gdp_tensor_contiguous((gdp_tensor *)t, out);
  return gdp_tensor_to(ctx, t, dtype, out);
}

/* Hands `*tmp` (contiguous, compute dtype) to the caller as `dtype`, converting when
 * needed; *tmp is consumed either way. */
static gdp_status deliver(gdp_ctx *ctx, gdp_tensor **tmp, gdp_dtype dtype, gdp_tensor **out) {
  gdp_status s = GDP_OK;
  if ((*tmp)->dtype == dtype) {
    *out = *tmp;
  } else {
    s = gdp_tensor_to(ctx, *tmp, dtype, out);
    gdp_tensor_free(*tmp);
  }
  *tmp = NULL;
  return s;
}

static void *data_or_null(const gdp_tensor *t) { return t ? gdp_tensor_data(t) : NULL; }

/* gdp_ctx_last_path: the kernels this call ran, by the backend's own account. */
static void record_path(gdp_ctx *ctx, const gdp_op_plan *plan) {
  ctx->last_path = ctx->backend->gdp_path ? ctx->backend->gdp_path(&plan->p) : NULL;
}

/* The inputs in the compute dtype: q, k raw (qc, kc) and as the kernel sees them (qn, kn:
 * normalised here when the op layer owns the L2 norm, else the same tensors). */
typedef struct gdp_op_inputs {
  gdp_tensor *qc, *kc, *vc, *gc, *bc, *h0c, *qn, *kn;
} gdp_op_inputs;

static void inputs_free(gdp_op_inputs *in) {
  gdp_tensor **all[] = {&in->qc, &in->kc, &in->vc, &in->gc, &in->bc, &in->h0c, &in->qn, &in->kn};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    gdp_tensor_free(*all[i]);
    *all[i] = NULL;
  }
}

static gdp_status l2norm_fwd(gdp_ctx *ctx, const gdp_op_plan *plan, const gdp_tensor *x,
                             gdp_tensor *y) {
  const int64_t rows = gdp_tensor_numel(x) / plan->K;
  return ctx->backend->l2norm_forward(ctx, plan->compute, rows, plan->K, GDP_L2NORM_EPS,
                                      gdp_tensor_data(x), gdp_tensor_data(y));
}

/* dx = backward of the norm at raw x, given dy; in place (dx is dy). */
static gdp_status l2norm_bwd_inplace(gdp_ctx *ctx, const gdp_op_plan *plan, const gdp_tensor *x,
                                     gdp_tensor *dxy) {
  const int64_t rows = gdp_tensor_numel(x) / plan->K;
  return ctx->backend->l2norm_backward(ctx, plan->compute, rows, plan->K, GDP_L2NORM_EPS,
                                       gdp_tensor_data(x), gdp_tensor_data(dxy),
                                       gdp_tensor_data(dxy));
}

static gdp_status inputs_make(gdp_ctx *ctx, const gdp_op_plan *plan, const gdp_tensor *q,
                              const gdp_tensor *k, const gdp_tensor *v, const gdp_tensor *g,
                              const gdp_tensor *beta, const gdp_tensor *h0, gdp_op_inputs *in) {
  memset(in, 0, sizeof *in);
  gdp_status s;
  if ((s = as_compute(ctx, q, plan->compute, &in->qc)) != GDP_OK) goto fail;
  if ((s = as_compute(ctx, k, plan->compute, &in->kc)) != GDP_OK) goto fail;
  if ((s = as_compute(ctx, v, plan->compute, &in->vc)) != GDP_OK) goto fail;
  if ((s = as_compute(ctx, g, plan->gate_compute, &in->gc)) != GDP_OK) goto fail;
  if ((s = as_compute(ctx, beta, plan->compute, &in->bc)) != GDP_OK) goto fail;
  if ((s = as_compute(ctx, h0, state_compute(plan), &in->h0c)) != GDP_OK) goto fail;
  if (plan->l2norm_here) {
    if ((s = gdp_tensor_empty(ctx, plan->compute, 4, q->shape, &in->qn)) != GDP_OK) goto fail;
    if ((s = gdp_tensor_empty(ctx, plan->compute, 4, k->shape, &in->kn)) != GDP_OK) goto fail;
    if ((s = l2norm_fwd(ctx, plan, in->qc, in->qn)) != GDP_OK) goto fail;
    if ((s = l2norm_fwd(ctx, plan, in->kc, in->kn)) != GDP_OK) goto fail;
  } else {
    in->qn = gdp_tensor_retain(in->qc);
    in->kn = gdp_tensor_retain(in->kc);
  }
  return GDP_OK;
fail:
  inputs_free(in);
  return s;
}

/* ------------------------------------------------------------------ saved forwards */

/* What a forward kept for its backward, and the problem it belongs to (gdp.h). */
struct gdp_delta_product_saved {
  gdp_ctx *ctx;    /* a reference: the memory goes back through the backend that gave it */
  void *data;      /* device block from ctx->backend->alloc; NULL when nothing is kept */
  size_t bytes;
  gdp_dtype dtype; /* q's */
  gdp_dtype gate_dtype; /* g's */
  gdp_device_type device;
  int device_index;
  int64_t B, T, H, K, V, n, N;
  int gated, has_h0, l2norm, algorithm, variant;
  double scale;    /* the effective scale (opts->scale 0 resolved) */
  int64_t *cu;     /* N+1 cu_seqlens values (host) */
};

size_t gdp_delta_product_saved_bytes(const gdp_delta_product_saved *saved) { return saved ? saved->bytes : 0; }

void gdp_delta_product_saved_free(gdp_delta_product_saved *saved) {
  if (!saved) return;
  /* stream-ordered on the ctx's stream (cuda): a backward queued before still reads it */
  if (saved->data) saved->ctx->backend->release(saved->ctx, saved->data, saved->bytes);
  gdp_ctx_free(saved->ctx);
  free(saved->cu);
  free(saved);
}

/* A new saved object recording plan's problem; no device memory yet. */
static gdp_status saved_new(const char *func, gdp_ctx *ctx, const gdp_op_plan *plan,
                            const gdp_delta_product_options *opts, const gdp_tensor *g, const gdp_tensor *h0,
                            gdp_delta_product_saved **out) {
  gdp_delta_product_saved *sv = calloc(1, sizeof *sv);
  int64_t *cu = malloc((size_t)(plan->N + 1) * sizeof(int64_t));
  if (!sv || !cu) {
    free(sv);
    free(cu);
    return GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for the saved forward");
  }
  memcpy(cu, plan->cu, (size_t)(plan->N + 1) * sizeof(int64_t));
  sv->ctx = gdp_ctx_retain(ctx);
  sv->dtype = plan->in_dtype;
  sv->gate_dtype = plan->gate_dtype;
  sv->device = ctx->type;
  sv->device_index = ctx->index;
  sv->B = plan->B, sv->T = plan->T, sv->H = plan->H, sv->K = plan->K, sv->V = plan->V;
  sv->n = plan->n, sv->N = plan->N;
  sv->gated = g != NULL;
  sv->has_h0 = h0 != NULL;
  sv->l2norm = plan->l2norm;
  sv->algorithm = opts->algorithm;
  sv->scale = plan->p.scale;
  sv->cu = cu;
  *out = sv;
  return GDP_OK;
}

/* The saved object belongs to this backward's problem, field by field. */
static gdp_status saved_check(const char *func, const gdp_delta_product_saved *sv, const gdp_ctx *ctx,
                              const gdp_op_plan *plan, const gdp_delta_product_options *opts,
                              const gdp_tensor *g, const gdp_tensor *h0) {
#define SAVED_FIELD(name, fwd, here)                                                          \
  if ((int64_t)(fwd) != (int64_t)(here))                                                     \
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,                                           \
                        "saved: %s: expected %lld (the saved forward's), got %lld (this call's)", \
                        name, (long long)(fwd), (long long)(here));
  if (sv->dtype != plan->in_dtype)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "saved: dtype: expected %s (the saved forward's), got %s (this call's)",
                        gdp_dtype_name(sv->dtype), gdp_dtype_name(plan->in_dtype));
  if (g && sv->gated && sv->gate_dtype != plan->gate_dtype)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "saved: g's dtype: expected %s (the saved forward's), got %s (this call's)",
                        gdp_dtype_name(sv->gate_dtype), gdp_dtype_name(plan->gate_dtype));
  if (sv->device != ctx->type || sv->device_index != ctx->index)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "saved: device: expected %s:%d (the saved forward's), got %s:%d (this call's)",
                        gdp_device_type_name(sv->device), sv->device_index,
                        gdp_device_type_name(ctx->type), ctx->index);
  SAVED_FIELD("B", sv->B, plan->B);
  SAVED_FIELD("T", sv->T, plan->T);
  SAVED_FIELD("H", sv->H, plan->H);
  SAVED_FIELD("K", sv->K, plan->K);
  SAVED_FIELD("V", sv->V, plan->V);
  SAVED_FIELD("num_householder", sv->n, plan->n);
  SAVED_FIELD("gated (g given)", sv->gated, g != NULL);
  SAVED_FIELD("h0 given", sv->has_h0, h0 != NULL);
  SAVED_FIELD("use_qk_l2norm", sv->l2norm, plan->l2norm);
  if (sv->scale != plan->p.scale)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "saved: scale: expected %.17g (the saved forward's), got %.17g (this call's)",
                        sv->scale, plan->p.scale);
  SAVED_FIELD("algorithm", sv->algorithm, opts->algorithm);
  SAVED_FIELD("number of sequences (cu_seqlens entries - 1)", sv->N, plan->N);
  for (int64_t s = 0; s <= sv->N; s++)
    if (sv->cu[s] != plan->cu[s])
      return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                          "saved: cu_seqlens[%lld]: expected %lld (the saved forward's), got %lld "
                          "(this call's)",
                          (long long)s, (long long)sv->cu[s], (long long)plan->cu[s]);
#undef SAVED_FIELD
  return GDP_OK;
}

/* ------------------------------------------------------------------ forward */

static gdp_status forward_impl(const char *func, gdp_ctx *ctx, const gdp_delta_product_options *opts,
                               const gdp_tensor *q, const gdp_tensor *k, const gdp_tensor *v,
                               const gdp_tensor *g, const gdp_tensor *beta, const gdp_tensor *h0,
                               const gdp_tensor *cu_seqlens, gdp_tensor **o, gdp_tensor **ht,
                               gdp_delta_product_saved **saved) {
  if (saved) *saved = NULL;
  if (!o) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "o: expected an output pointer, got NULL");
  *o = NULL;
  if (ht) *ht = NULL;
  if (opts && opts->output_final_state && !ht)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "ht: expected an output pointer (opts->output_final_state is set), got NULL");

  gdp_op_plan plan;
  gdp_op_inputs in = {0};
  gdp_tensor *oc = NULL, *htc = NULL;
  gdp_delta_product_saved *sv = NULL;
  gdp_status s = plan_make(func, ctx, opts, q, k, v, g, beta, h0, cu_seqlens, NULL, NULL, 0, &plan);
  if (s != GDP_OK) goto done;
  if (saved) {
    if ((s = saved_new(func, ctx, &plan, opts, g, h0, &sv)) != GDP_OK) goto done;
    if (ctx->backend->gdp_save_plan &&
        (s = ctx->backend->gdp_save_plan(ctx, &plan.p, &sv->variant, &sv->bytes)) != GDP_OK)
      goto done;
    if (sv->bytes > 0 && (s = ctx->backend->alloc(ctx, sv->bytes, &sv->data)) != GDP_OK) {
      sv->bytes = 0; /* nothing to release */
      goto done;
    }
  }
  if ((s = inputs_make(ctx, &plan, q, k, v, g, beta, h0, &in)) != GDP_OK) goto done;

  const int64_t o_shape[4] = {plan.B, plan.T, plan.H, plan.V};
  const int64_t st_shape[4] = {plan.N, plan.H, plan.K, plan.V};
  if ((s = gdp_tensor_empty(ctx, plan.compute, 4, o_shape, &oc)) != GDP_OK) goto done;
  if (opts->output_final_state &&
      (s = gdp_tensor_empty(ctx, state_compute(&plan), 4, st_shape, &htc)) != GDP_OK)
    goto done;

  const gdp_delta_product_forward_io io = {
      .q = data_or_null(in.qn), .k = data_or_null(in.kn), .v = data_or_null(in.vc),
      .g = data_or_null(in.gc), .beta = data_or_null(in.bc), .h0 = data_or_null(in.h0c),
      .o = data_or_null(oc), .ht = data_or_null(htc)};
  if (sv && sv->data)
    s = ctx->backend->gdp_forward_save(ctx, &plan.p, &io, sv->data);
  else
    s = ctx->backend->gdp_forward(ctx, &plan.p, &io);
  if (s != GDP_OK) goto done;
  record_path(ctx, &plan);

  if ((s = deliver(ctx, &oc, plan.in_dtype, o)) != GDP_OK) goto done;
  if (htc && (s = deliver(ctx, &htc, plan.state_out, ht)) != GDP_OK) goto done;

done:
  if (s != GDP_OK) {
    gdp_tensor_free(*o);
    *o = NULL;
    if (ht) {
      gdp_tensor_free(*ht);
      *ht = NULL;
    }
    gdp_delta_product_saved_free(sv);
  } else if (saved) {
    *saved = sv;
  }
  gdp_tensor_free(oc);
  gdp_tensor_free(htc);
  inputs_free(&in);
  plan_free(&plan);
  return s;
}

gdp_status gdp_delta_product_forward(gdp_ctx *ctx, const gdp_delta_product_options *opts, const gdp_tensor *q,
                           const gdp_tensor *k, const gdp_tensor *v, const gdp_tensor *g,
                           const gdp_tensor *beta, const gdp_tensor *h0,
                           const gdp_tensor *cu_seqlens, gdp_tensor **o, gdp_tensor **ht) {
  return forward_impl("gdp_delta_product_forward", ctx, opts, q, k, v, g, beta, h0, cu_seqlens, o, ht, NULL);
}

gdp_status gdp_delta_product_forward_ex(gdp_ctx *ctx, const gdp_delta_product_options *opts, const gdp_tensor *q,
                              const gdp_tensor *k, const gdp_tensor *v, const gdp_tensor *g,
                              const gdp_tensor *beta, const gdp_tensor *h0,
                              const gdp_tensor *cu_seqlens, gdp_tensor **o, gdp_tensor **ht,
                              gdp_delta_product_saved **saved) {
  return forward_impl("gdp_delta_product_forward_ex", ctx, opts, q, k, v, g, beta, h0, cu_seqlens, o, ht,
                      saved);
}

/* ------------------------------------------------------------------ backward */

static gdp_status backward_impl(const char *func, gdp_ctx *ctx, const gdp_delta_product_options *opts,
                                const gdp_tensor *q, const gdp_tensor *k, const gdp_tensor *v,
                                const gdp_tensor *g, const gdp_tensor *beta, const gdp_tensor *h0,
                                const gdp_tensor *cu_seqlens, const gdp_tensor *d_o,
                                const gdp_tensor *dht, gdp_tensor **dq, gdp_tensor **dk,
                                gdp_tensor **dv, gdp_tensor **dbeta, gdp_tensor **dg,
                                gdp_tensor **dh0, const gdp_delta_product_saved *saved) {
  gdp_tensor **outs[] = {dq, dk, dv, dbeta, dg, dh0};
  static const char *out_names[] = {"dq", "dk", "dv", "dbeta", "dg", "dh0"};
  for (int i = 0; i < 6; i++)
    if (outs[i]) *outs[i] = NULL;
  for (int i = 0; i < 6; i++)
    if (!outs[i])
      return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected an output pointer, got NULL",
                          out_names[i]);

  gdp_op_plan plan;
  gdp_op_inputs in = {0};
  gdp_tensor *doc = NULL, *dhtc = NULL;
  gdp_tensor *grads[6] = {NULL}; /* dq, dk, dv, dbeta, dg, dh0 in the compute dtype */
  gdp_status s = plan_make(func, ctx, opts, q, k, v, g, beta, h0, cu_seqlens, d_o, dht, 1, &plan);
  if (s != GDP_OK) goto done;
  if (saved && (s = saved_check(func, saved, ctx, &plan, opts, g, h0)) != GDP_OK) goto done;
  if ((s = inputs_make(ctx, &plan, q, k, v, g, beta, h0, &in)) != GDP_OK) goto done;
  if ((s = as_compute(ctx, d_o, plan.compute, &doc)) != GDP_OK) goto done;
  if ((s = as_compute(ctx, dht, state_compute(&plan), &dhtc)) != GDP_OK) goto done;

  const gdp_tensor *like[6] = {q, k, v, beta, g, h0};
  for (int i = 0; i < 6; i++) {
    if (!like[i]) continue;
    const gdp_dtype dt = i == 5 ? state_compute(&plan) : i == 4 ? plan.gate_compute : plan.compute;
    if ((s = gdp_tensor_empty(ctx, dt, like[i]->ndim, like[i]->shape, &grads[i])) != GDP_OK)
      goto done;
  }

  const gdp_delta_product_backward_io io = {
      .q = data_or_null(in.qn), .k = data_or_null(in.kn), .v = data_or_null(in.vc),
      .g = data_or_null(in.gc), .beta = data_or_null(in.bc), .h0 = data_or_null(in.h0c),
      .d_o = data_or_null(doc), .dht = data_or_null(dhtc),
      .dq = data_or_null(grads[0]), .dk = data_or_null(grads[1]), .dv = data_or_null(grads[2]),
      .dbeta = data_or_null(grads[3]), .dg = data_or_null(grads[4]),
      .dh0 = data_or_null(grads[5])};
  /* a saved object of a backend that keeps nothing: the plain backward (recompute) */
  if (saved && ctx->backend->gdp_backward_saved)
    s = ctx->backend->gdp_backward_saved(ctx, &plan.p, &io, saved->variant, saved->data);
  else
    s = ctx->backend->gdp_backward(ctx, &plan.p, &io);
  if (s != GDP_OK) goto done;
  record_path(ctx, &plan);

  if (plan.l2norm_here) {
    /* The kernel's dq, dk are with respect to the normalised q, k. */
    if ((s = l2norm_bwd_inplace(ctx, &plan, in.qc, grads[0])) != GDP_OK) goto done;
    if ((s = l2norm_bwd_inplace(ctx, &plan, in.kc, grads[1])) != GDP_OK) goto done;
  }

  for (int i = 0; i < 6; i++) {
    if (!grads[i]) continue;
    const gdp_dtype dt = i == 5 ? plan.state_out : i == 4 ? plan.gate_dtype : plan.in_dtype;
    if ((s = deliver(ctx, &grads[i], dt, outs[i])) != GDP_OK) goto done;
  }

done:
  if (s != GDP_OK)
    for (int i = 0; i < 6; i++) {
      gdp_tensor_free(*outs[i]);
      *outs[i] = NULL;
    }
  for (int i = 0; i < 6; i++) gdp_tensor_free(grads[i]);
  gdp_tensor_free(doc);
  gdp_tensor_free(dhtc);
  inputs_free(&in);
  plan_free(&plan);
  return s;
}

gdp_status gdp_delta_product_backward_dh0(gdp_ctx *ctx, const gdp_delta_product_options *opts,
                                         const gdp_tensor *q, const gdp_tensor *k,
                                         const gdp_tensor *v, const gdp_tensor *g,
                                         const gdp_tensor *beta, const gdp_tensor *h0,
                                         const gdp_tensor *cu_seqlens, const gdp_tensor *d_o,
                                         const gdp_tensor *dht, gdp_tensor **dh0) {
  static const char *func = "gdp_delta_product_backward_dh0";
  if (!dh0) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "dh0: expected an output pointer, got NULL");
  *dh0 = NULL;
  gdp_op_plan plan;
  gdp_status s = plan_make(func, ctx, opts, q, k, v, g, beta, h0, cu_seqlens, d_o, dht, 1, &plan);
  if (s != GDP_OK) return s;
  const gdp_backend *be = ctx->backend;
  if (!be->gdp_backward_dh0 || !be->gdp_backward_dh0_takes(ctx, &plan.p)) {
    /* the full backward, keeping dh0 */
    plan_free(&plan);
    gdp_tensor *zero_h0 = NULL, *rest[5] = {NULL};
    if (!h0) { /* dh0 is only formed for a given h0; it does not depend on its value */
      const gdp_dtype sd = q->dtype == GDP_DTYPE_F64 ? GDP_DTYPE_F64 : GDP_DTYPE_F32;
      const int64_t shape[4] = {plan.N, plan.H, plan.K, plan.V};
      s = gdp_tensor_zeros(ctx, sd, 4, shape, &zero_h0);
    }
    if (s == GDP_OK)
      s = backward_impl(func, ctx, opts, q, k, v, g, beta, h0 ? h0 : zero_h0, cu_seqlens, d_o, dht,
                        &rest[0], &rest[1], &rest[2], &rest[3], &rest[4], dh0, NULL);
    for (int i = 0; i < 5; i++) gdp_tensor_free(rest[i]);
    gdp_tensor_free(zero_h0);
    return s;
  }
  gdp_op_inputs in = {0};
  gdp_tensor *doc = NULL, *dhtc = NULL, *dh0c = NULL;
  const int64_t shape[4] = {plan.N, plan.H, plan.K, plan.V};
  if ((s = inputs_make(ctx, &plan, q, k, v, g, beta, h0, &in)) != GDP_OK) goto done;
  if ((s = as_compute(ctx, d_o, plan.compute, &doc)) != GDP_OK) goto done;
  if ((s = as_compute(ctx, dht, state_compute(&plan), &dhtc)) != GDP_OK) goto done;
  if ((s = gdp_tensor_empty(ctx, state_compute(&plan), 4, shape, &dh0c)) != GDP_OK) goto done;
  const gdp_delta_product_backward_io io = {
      .q = data_or_null(in.qn), .k = data_or_null(in.kn), .v = data_or_null(in.vc),
      .g = data_or_null(in.gc), .beta = data_or_null(in.bc), .h0 = data_or_null(in.h0c),
      .d_o = data_or_null(doc), .dht = data_or_null(dhtc), .dh0 = data_or_null(dh0c)};
  if ((s = be->gdp_backward_dh0(ctx, &plan.p, &io)) != GDP_OK) goto done;
  record_path(ctx, &plan);
  s = deliver(ctx, &dh0c, plan.state_out, dh0);
done:
  gdp_tensor_free(dh0c);
  gdp_tensor_free(doc);
  gdp_tensor_free(dhtc);
  inputs_free(&in);
  plan_free(&plan);
  return s;
}

gdp_status gdp_delta_product_backward(gdp_ctx *ctx, const gdp_delta_product_options *opts, const gdp_tensor *q,
                            const gdp_tensor *k, const gdp_tensor *v, const gdp_tensor *g,
                            const gdp_tensor *beta, const gdp_tensor *h0,
                            const gdp_tensor *cu_seqlens, const gdp_tensor *d_o,
                            const gdp_tensor *dht, gdp_tensor **dq, gdp_tensor **dk,
                            gdp_tensor **dv, gdp_tensor **dbeta, gdp_tensor **dg,
                            gdp_tensor **dh0) {
  return backward_impl("gdp_delta_product_backward", ctx, opts, q, k, v, g, beta, h0, cu_seqlens, d_o, dht,
                       dq, dk, dv, dbeta, dg, dh0, NULL);
}

gdp_status gdp_delta_product_backward_ex(gdp_ctx *ctx, const gdp_delta_product_options *opts, const gdp_tensor *q,
                               const gdp_tensor *k, const gdp_tensor *v, const gdp_tensor *g,
                               const gdp_tensor *beta, const gdp_tensor *h0,
                               const gdp_tensor *cu_seqlens, const gdp_tensor *d_o,
                               const gdp_tensor *dht, gdp_tensor **dq, gdp_tensor **dk,
                               gdp_tensor **dv, gdp_tensor **dbeta, gdp_tensor **dg,
                               gdp_tensor **dh0, const gdp_delta_product_saved *saved) {
  return backward_impl("gdp_delta_product_backward_ex", ctx, opts, q, k, v, g, beta, h0, cu_seqlens, d_o,
                       dht, dq, dk, dv, dbeta, dg, dh0, saved);
}
