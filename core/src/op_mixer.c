/*
 * op_mixer.c -- the public mixer layer ops (gdp.h, "mixer layer ops"): argument
 * validation, contiguous compute-dtype copies (token rows [T,B,C] evenly spaced with
 * contiguous channels are read in place: the conv's x and the input stage's sections),
 * dispatch through ctx->backend (backend_impl.h), and delivery of the results in the
 * documented dtypes.
 *
 * A backend without an op's entry answers GDP_ERR_UNSUPPORTED naming the op and the
 * device.  bf16 inputs compute in bf16 buffers where the backend's mixer kernels take
 * them (cuda: float32 math inside), and are refused elsewhere.  repeat_heads is
 * built from views, copies and adds of the tensor library and runs on every device.
 *
 * Every temporary is released on every path: each entry point collects its tensors
 * in a local array that one cleanup loop frees.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "op_helpers.h"

/* The widest conv the kernels take (the CPU's keeps the taps' partial sums on the stack). */
enum { MIXER_CONV_MAX_WIDTH = 16 };

const char *gdp_activation_name(gdp_activation act) {
  switch (act) {
    case GDP_ACT_NONE: return "none";
    case GDP_ACT_SILU: return "silu";
  }
  return "?";
}

/* ------------------------------------------------------------------ token rows */

/* The rows r = t*B + b of t [T,B,C] lie *ld >= C elements apart, each C contiguous
 * elements (a channel slice of a contiguous tensor is such a view). */
static int token_rows(const gdp_tensor *t, int64_t *ld) {
  if (t->ndim != 3 || (t->shape[2] > 1 && t->stride[2] != 1)) return 0;
  if (t->shape[1] == 1) *ld = t->stride[0];
  else if (t->shape[0] == 1 || t->stride[0] == t->shape[1] * t->stride[1]) *ld = t->stride[1];
  else return 0;
  return *ld >= t->shape[2] || t->shape[0] * t->shape[1] <= 1;
}

/* t [T,B,C] for the kernels: itself when its rows are (a new reference), else a
 * contiguous copy in `dtype`; *ld is the row stride.  NULL stays NULL. */
static gdp_status load_token_rows(gdp_ctx *ctx, const gdp_tensor *t, gdp_dtype dtype,
                                  gdp_tensor **out, int64_t *ld) {
  *out = NULL;
  *ld = 0;
  if (!t) return GDP_OK;
  if (t->dtype == dtype && token_rows(t, ld)) {
    *out = gdp_tensor_retain((gdp_tensor *)t);
    return GDP_OK;
  }
  *ld = t->shape[2];
  return load(ctx, t, dtype, out);
}

/* A destination `dst` [T,B,C] for the kernels: itself when it has the compute dtype and
 * rows (*buf = a new reference), else a contiguous buffer whose values the caller
 * copies into dst afterwards (*staged = 1). */
static gdp_status token_rows_target(gdp_ctx *ctx, gdp_tensor *dst, gdp_dtype dtype,
                                    gdp_tensor **buf, int64_t *ld, int *staged) {
  *buf = NULL;
  *ld = 0;
  *staged = 0;
  if (!dst) return GDP_OK;
  if (dst->dtype == dtype && token_rows(dst, ld)) {
    *buf = gdp_tensor_retain(dst);
    return GDP_OK;
  }
  *ld = dst->shape[2];
  *staged = 1;
  return gdp_tensor_empty(ctx, dtype, 3, dst->shape, buf);
}

/* ------------------------------------------------------------------ conv1d */

typedef struct conv_plan {
  int64_t T, B, C, W, L;
  int64_t x_ld, dx_ld; /* the row strides of the x and dx the kernels read and write */
  gdp_dtype compute;
  int64_t *seq_start; /* [T], owned */
} conv_plan;

/* seq_start[t]: the first token of t's sequence (0 without cu_seqlens). */
static gdp_status conv_read_cu(const char *func, conv_plan *p, const gdp_tensor *cu) {
  char a[128];
  p->seq_start = calloc((size_t)(p->T > 0 ? p->T : 1), sizeof(int64_t));
  if (!p->seq_start) return GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for seq starts");
  if (!cu) return GDP_OK;
  if (cu->dtype != GDP_DTYPE_I32 && cu->dtype != GDP_DTYPE_I64)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "cu_seqlens: expected dtype i32 or i64, got %s",
                        gdp_dtype_name(cu->dtype));
  if (cu->ndim != 1 || cu->shape[0] < 2)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "cu_seqlens: expected 1-D [N+1] with N+1 >= 2 entries, got %s",
                        shape_of(a, sizeof a, cu));
  if (p->B != 1)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "cu_seqlens: packed sequences need B = 1, got x with B = %lld",
                        (long long)p->B);
  const int64_t n1 = cu->shape[0];
  int64_t *h = malloc((size_t)n1 * sizeof(int64_t));
  if (!h) return GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for cu_seqlens");
  gdp_status s = gdp_tensor_to_host(cu, GDP_DTYPE_I64, h, (size_t)n1 * sizeof(int64_t));
  if (s == GDP_OK && h[0] != 0)
    s = GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "cu_seqlens: expected cu_seqlens[0] = 0, got %lld",
                     (long long)h[0]);
  for (int64_t i = 0; s == GDP_OK && i + 1 < n1; i++)
    if (h[i + 1] < h[i])
      s = GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                       "cu_seqlens: expected non-decreasing values, got cu_seqlens[%lld] = %lld "
                       "> cu_seqlens[%lld] = %lld",
                       (long long)i, (long long)h[i], (long long)(i + 1), (long long)h[i + 1]);
  if (s == GDP_OK && h[n1 - 1] != p->T)
    s = GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                     "cu_seqlens: expected the last entry = T = %lld (x's token count), got %lld",
                     (long long)p->T, (long long)h[n1 - 1]);
  for (int64_t i = 0; s == GDP_OK && i + 1 < n1; i++)
    for (int64_t t = h[i]; t < h[i + 1]; t++) p->seq_start[t] = h[i];
  free(h);
  return s;
}

static gdp_status conv_plan_make(const char *func, gdp_ctx *ctx, const gdp_tensor *x,
                                 const gdp_tensor *weight, const gdp_tensor *bias,
                                 const gdp_tensor *halo, const gdp_tensor *cu,
                                 gdp_activation act, const gdp_tensor *d_out, conv_plan *p) {
  char a[128];
  memset(p, 0, sizeof *p);
  GDP_TRY(need_tensor(func, "x", x));
  GDP_TRY(need_tensor(func, "weight", weight));
  GDP_TRY(check_float_on(func, "x", ctx, x));
  GDP_TRY(check_float_on(func, "weight", ctx, weight));
  GDP_TRY(check_float_on(func, "bias", ctx, bias));
  GDP_TRY(check_float_on(func, "halo", ctx, halo));
  GDP_TRY(check_float_on(func, "d_out", ctx, d_out));
  if (act != GDP_ACT_NONE && act != GDP_ACT_SILU)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "activation: expected GDP_ACT_NONE (0) or GDP_ACT_SILU (1), got %d",
                        (int)act);
  if (x->ndim != 3)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "x: expected 3 dims [T,B,C], got %s",
                        shape_of(a, sizeof a, x));
  p->T = x->shape[0], p->B = x->shape[1], p->C = x->shape[2];
  if (weight->ndim == 3 && weight->shape[1] == 1) {
    p->W = weight->shape[2];
  } else if (weight->ndim == 2) {
    p->W = weight->shape[1];
  } else {
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "weight: expected [C,W] or [C,1,W] with C = %lld, got %s",
                        (long long)p->C, shape_of(a, sizeof a, weight));
  }
  if (weight->shape[0] != p->C)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "weight: expected [C,W] or [C,1,W] with C = %lld (x's channels), got %s",
                        (long long)p->C, shape_of(a, sizeof a, weight));
  if (p->W < 1 || p->W > MIXER_CONV_MAX_WIDTH)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "weight: expected a width W in 1..%d, got %s",
                        MIXER_CONV_MAX_WIDTH, shape_of(a, sizeof a, weight));
  if (bias) GDP_TRY(check_shape(func, "bias", bias, 1, (const int64_t[]){p->C}, "[C]"));
  if (halo) {
    if (halo->ndim != 3 || halo->shape[1] != p->B || halo->shape[2] != p->C)
      return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "halo: expected [L,B,C] with B = %lld, C = %lld, got %s",
                          (long long)p->B, (long long)p->C, shape_of(a, sizeof a, halo));
    p->L = halo->shape[0];
  }
  if (d_out) GDP_TRY(check_same_shape(func, "d_out", d_out, "x [T,B,C]", x));
  p->compute = x->dtype;
  return conv_read_cu(func, p, cu);
}

/* The conv weight tap-major, [W,C] contiguous in `dtype`, as the kernels want it:
 * Megatron's [C,1,W] (or [C,W]) viewed as [C,W] and transposed. */
static gdp_status load_weight_tap_major(gdp_ctx *ctx, const conv_plan *p, const gdp_tensor *weight,
                                        gdp_dtype dtype, gdp_tensor **out) {
  *out = NULL;
  const int64_t cw[2] = {p->C, p->W};
  gdp_tensor *v = NULL, *vt = NULL;
  gdp_status s = gdp_tensor_reshape((gdp_tensor *)weight, 2, cw, &v);
  if (s == GDP_OK) s = gdp_tensor_transpose(v, 0, 1, &vt);
  if (s == GDP_OK) s = load(ctx, vt, dtype, out);
  gdp_tensor_free(vt);
  gdp_tensor_free(v);
  return s;
}

static gdp_conv1d_problem conv_problem(const conv_plan *p, gdp_ctx *ctx, gdp_activation act) {
  gdp_conv1d_problem a = {.T = p->T, .B = p->B, .C = p->C, .W = p->W,
                          .seq_start = p->seq_start, .halo_len = p->L, .x_ld = p->x_ld,
                          .dx_ld = p->dx_ld,
                          .silu = act == GDP_ACT_SILU, .num_threads = ctx->num_threads,
                          .dtype = p->compute};
  return a;
}

gdp_status gdp_mixer_conv1d_forward(gdp_ctx *ctx, const gdp_tensor *x, const gdp_tensor *weight,
                                    const gdp_tensor *bias, const gdp_tensor *halo,
                                    const gdp_tensor *cu_seqlens, gdp_activation activation,
                                    gdp_tensor **out) {
  static const char *func = "gdp_mixer_conv1d_forward";
  GDP_TRY(need_out(func, "out", out));
  *out = NULL;
  NEED_OP(func, ctx, conv1d_forward);
  conv_plan p;
  gdp_tensor *tmp[5] = {0}; /* x, weight [W,C], bias, halo, out */
  gdp_status s = conv_plan_make(func, ctx, x, weight, bias, halo, cu_seqlens, activation, NULL, &p);
  if (s == GDP_OK) s = load_token_rows(ctx, x, p.compute, &tmp[0], &p.x_ld);
  if (s == GDP_OK) s = load_weight_tap_major(ctx, &p, weight, p.compute, &tmp[1]);
  if (s == GDP_OK) s = load(ctx, bias, p.compute, &tmp[2]);
  if (s == GDP_OK) s = load(ctx, halo, p.compute, &tmp[3]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, p.compute, 3, x->shape, &tmp[4]);
  if (s == GDP_OK) {
    const gdp_conv1d_problem a = conv_problem(&p, ctx, activation);
    s = ctx->backend->conv1d_forward(ctx, &a, ptr(tmp[0]), ptr(tmp[1]), ptr(tmp[2]), ptr(tmp[3]),
                                     ptr(tmp[4]));
  }
  if (s == GDP_OK) {
    *out = tmp[4];
    tmp[4] = NULL;
  }
  free(p.seq_start);
  FREE_ALL(tmp);
  return s;
}

gdp_status gdp_mixer_conv1d_backward(gdp_ctx *ctx, const gdp_tensor *x, const gdp_tensor *weight,
                                     const gdp_tensor *bias, const gdp_tensor *halo,
                                     const gdp_tensor *cu_seqlens, gdp_activation activation,
                                     const gdp_tensor *d_out, gdp_tensor *dx,
                                     gdp_tensor **dweight, gdp_tensor **dbias,
                                     gdp_tensor **dhalo) {
  static const char *func = "gdp_mixer_conv1d_backward";
  clear_outs(dweight, dbias, dhalo, NULL);
  NEED_OP(func, ctx, conv1d_backward);
  GDP_TRY(need_tensor(func, "d_out", d_out));
  conv_plan p;
  /* x, weight [W,C], bias, halo, d_out, then the results dx, dweight, dbias, dhalo */
  gdp_tensor *tmp[9] = {0};
  int staged = 0;
  gdp_status s = conv_plan_make(func, ctx, x, weight, bias, halo, cu_seqlens, activation, d_out, &p);
  if (s == GDP_OK) s = check_float_on(func, "dx", ctx, dx);
  if (s == GDP_OK) s = check_same_shape(func, "dx", dx, "x [T,B,C]", x);
  if (s == GDP_OK) s = load_token_rows(ctx, x, p.compute, &tmp[0], &p.x_ld);
  if (s == GDP_OK) s = load_weight_tap_major(ctx, &p, weight, p.compute, &tmp[1]);
  if (s == GDP_OK) s = load(ctx, bias, p.compute, &tmp[2]);
  if (s == GDP_OK) s = load(ctx, halo, p.compute, &tmp[3]);
  if (s == GDP_OK) s = load(ctx, d_out, p.compute, &tmp[4]);
  if (s == GDP_OK) s = token_rows_target(ctx, dx, p.compute, &tmp[5], &p.dx_ld, &staged);
  if (s == GDP_OK) s = buffer_like(ctx, dweight != NULL, p.compute, weight, &tmp[6]);
  if (s == GDP_OK) s = buffer_like(ctx, dbias && bias, p.compute, bias, &tmp[7]);
  if (s == GDP_OK) s = buffer_like(ctx, dhalo && halo, p.compute, halo, &tmp[8]);
  if (s == GDP_OK && dx && !staged) gdp_tensor_mark_written(dx);
  if (s == GDP_OK) {
    const gdp_conv1d_problem a = conv_problem(&p, ctx, activation);
    s = ctx->backend->conv1d_backward(ctx, &a, ptr(tmp[0]), ptr(tmp[1]), ptr(tmp[2]),
                                      ptr(tmp[3]), ptr(tmp[4]), ptr(tmp[5]), ptr(tmp[6]),
                                      ptr(tmp[7]), ptr(tmp[8]));
  }
  if (s == GDP_OK && staged) s = gdp_tensor_copy(ctx, dx, tmp[5]);
  if (s == GDP_OK) s = deliver(ctx, &tmp[6], weight->dtype, dweight);
  if (s == GDP_OK && bias) s = deliver(ctx, &tmp[7], bias->dtype, dbias);
  if (s == GDP_OK && halo) s = deliver(ctx, &tmp[8], p.compute, dhalo);
  if (s != GDP_OK) {
    gdp_tensor **outs[3] = {dweight, dbias, dhalo};
    for (int i = 0; i < 3; i++)
      if (outs[i]) {
        gdp_tensor_free(*outs[i]);
        *outs[i] = NULL;
      }
  }
  free(p.seq_start);
  FREE_ALL(tmp);
  return s;
}

/* ------------------------------------------------------------------ beta */

/* b, d_beta (may be NULL) and the result checked and loaded, then the backend's
 * beta_forward or beta_backward over all elements of b. */
static gdp_status beta_elementwise(const char *func, gdp_ctx *ctx, const gdp_tensor *b,
                                   double scale, const gdp_tensor *d_beta, gdp_tensor **out) {
  *out = NULL;
  if (d_beta) GDP_TRY(check_same_shape(func, "d_beta", d_beta, "b", b));
  gdp_tensor *tmp[3] = {0}; /* b, d_beta, out */
  const gdp_dtype dt = b->dtype;
  const int64_t n = gdp_tensor_numel(b);
  gdp_status s = load(ctx, b, dt, &tmp[0]);
  if (s == GDP_OK) s = load(ctx, d_beta, dt, &tmp[1]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, dt, b->ndim, b->shape, &tmp[2]);
  if (s == GDP_OK) {
    const gdp_backend *be = ctx->backend;
    s = d_beta ? be->beta_backward(ctx, dt, n, scale, ptr(tmp[0]), ptr(tmp[1]), ptr(tmp[2]))
               : be->beta_forward(ctx, dt, n, scale, ptr(tmp[0]), ptr(tmp[2]));
  }
  if (s == GDP_OK) {
    *out = tmp[2];
    tmp[2] = NULL;
  }
  FREE_ALL(tmp);
  return s;
}

static gdp_status beta_check(const char *func, gdp_ctx *ctx, const gdp_tensor *b,
                             double beta_scale, const gdp_tensor *d_beta) {
  GDP_TRY(need_tensor(func, "b", b));
  GDP_TRY(check_float_on(func, "b", ctx, b));
  GDP_TRY(check_float_on(func, "d_beta", ctx, d_beta));
  if (!isfinite(beta_scale))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "beta_scale: expected a finite value (1, or 2 for negative eigenvalues), got %g",
                        beta_scale);
  return GDP_OK;
}

gdp_status gdp_mixer_beta_forward(gdp_ctx *ctx, const gdp_tensor *b, double beta_scale,
                                  gdp_tensor **beta) {
  static const char *func = "gdp_mixer_beta_forward";
  GDP_TRY(need_out(func, "beta", beta));
  *beta = NULL;
  NEED_OP(func, ctx, beta_forward);
  GDP_TRY(beta_check(func, ctx, b, beta_scale, NULL));
  return beta_elementwise(func, ctx, b, beta_scale, NULL, beta);
}

gdp_status gdp_mixer_beta_backward(gdp_ctx *ctx, const gdp_tensor *b, double beta_scale,
                                   const gdp_tensor *d_beta, gdp_tensor **db) {
  static const char *func = "gdp_mixer_beta_backward";
  GDP_TRY(need_out(func, "db", db));
  *db = NULL;
  NEED_OP(func, ctx, beta_backward);
  GDP_TRY(need_tensor(func, "d_beta", d_beta));
  GDP_TRY(beta_check(func, ctx, b, beta_scale, d_beta));
  return beta_elementwise(func, ctx, b, beta_scale, d_beta, db);
}

/* ------------------------------------------------------------------ SiLU */

/* The SiLU kernels' rows for an operand t like x: [T,B,C] token rows (read or written in
 * place when they lie evenly spaced, see token_rows), else any shape as a contiguous
 * buffer of rows of C elements, C the largest power of two <= 4096 dividing its size. */
typedef struct silu_rows {
  int64_t rows, C;
} silu_rows;

static silu_rows silu_rows_of(const gdp_tensor *x) {
  silu_rows r;
  const int64_t n = gdp_tensor_numel(x);
  if (x->ndim == 3) {
    r.C = x->shape[2];
    r.rows = x->shape[0] * x->shape[1];
    return r;
  }
  r.C = 1;
  while (r.C < 4096 && n % (2 * r.C) == 0) r.C *= 2;
  r.rows = n / r.C;
  return r;
}

/* t read as rows (a new reference or a contiguous copy in dtype); *ld its row stride. */
static gdp_status silu_load(gdp_ctx *ctx, const gdp_tensor *t, gdp_dtype dtype, silu_rows r,
                            gdp_tensor **out, int64_t *ld) {
  if (t->ndim == 3) return load_token_rows(ctx, t, dtype, out, ld);
  *ld = r.C;
  return load(ctx, t, dtype, out);
}

gdp_status gdp_mixer_silu_forward(gdp_ctx *ctx, const gdp_tensor *x, gdp_tensor **out) {
  static const char *func = "gdp_mixer_silu_forward";
  GDP_TRY(need_out(func, "out", out));
  *out = NULL;
  NEED_OP(func, ctx, silu_forward);
  GDP_TRY(need_tensor(func, "x", x));
  GDP_TRY(check_float_on(func, "x", ctx, x));
  gdp_tensor *tmp[2] = {0}; /* x, out */
  const silu_rows r = silu_rows_of(x);
  int64_t ld_x = 0;
  gdp_status s = silu_load(ctx, x, x->dtype, r, &tmp[0], &ld_x);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, x->dtype, x->ndim, x->shape, &tmp[1]);
  if (s == GDP_OK)
    s = ctx->backend->silu_forward(ctx, x->dtype, r.rows, r.C, ptr(tmp[0]), ld_x, ptr(tmp[1]),
                                   r.C);
  if (s == GDP_OK) {
    *out = tmp[1];
    tmp[1] = NULL;
  }
  FREE_ALL(tmp);
  return s;
}

gdp_status gdp_mixer_silu_backward(gdp_ctx *ctx, const gdp_tensor *x, const gdp_tensor *d_out,
                                   gdp_tensor *into, gdp_tensor **dx) {
  static const char *func = "gdp_mixer_silu_backward";
  GDP_TRY(need_out(func, "dx", dx));
  *dx = NULL;
  NEED_OP(func, ctx, silu_backward);
  GDP_TRY(need_tensor(func, "x", x));
  GDP_TRY(need_tensor(func, "d_out", d_out));
  GDP_TRY(check_float_on(func, "x", ctx, x));
  GDP_TRY(check_float_on(func, "d_out", ctx, d_out));
  GDP_TRY(check_float_on(func, "into", ctx, into));
  GDP_TRY(check_same_shape(func, "d_out", d_out, "x", x));
  GDP_TRY(check_same_shape(func, "into", into, "x", x));
  if (into && into->dtype != x->dtype)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "into: expected dtype %s (x's), got %s",
                        gdp_dtype_name(x->dtype), gdp_dtype_name(into->dtype));
  gdp_tensor *tmp[3] = {0}; /* x, d_out, dx (into itself, a buffer to copy into it, or new) */
  const gdp_dtype dt = x->dtype;
  const silu_rows r = silu_rows_of(x);
  int64_t ld_x = 0, ld_d = 0, ld_dx = r.C;
  int staged = 0;
  gdp_status s = silu_load(ctx, x, dt, r, &tmp[0], &ld_x);
  if (s == GDP_OK) s = silu_load(ctx, d_out, dt, r, &tmp[1], &ld_d);
  if (s == GDP_OK) {
    if (into && into->ndim == 3) s = token_rows_target(ctx, into, dt, &tmp[2], &ld_dx, &staged);
    else if (into && gdp_tensor_is_contiguous(into)) tmp[2] = gdp_tensor_retain(into);
    else {
      staged = into != NULL;
      s = gdp_tensor_empty(ctx, dt, x->ndim, x->shape, &tmp[2]);
    }
  }
  if (s == GDP_OK)
    s = ctx->backend->silu_backward(ctx, dt, r.rows, r.C, ptr(tmp[0]), ld_x, ptr(tmp[1]), ld_d,
                                    ptr(tmp[2]), ld_dx);
  if (s == GDP_OK && staged) s = gdp_tensor_copy(ctx, into, tmp[2]);
  if (s == GDP_OK) {
    *dx = into ? gdp_tensor_retain(into) : tmp[2];
    if (!into) tmp[2] = NULL;
  }
  FREE_ALL(tmp);
  return s;
}

/* ------------------------------------------------------------------ decay */

static gdp_status decay_check(const char *func, gdp_ctx *ctx, const gdp_tensor *a,
                              const gdp_tensor *A_log, const gdp_tensor *dt_bias,
                              const gdp_tensor *d_g, int64_t *H) {
  char s1[128];
  GDP_TRY(need_tensor(func, "a", a));
  GDP_TRY(need_tensor(func, "A_log", A_log));
  GDP_TRY(check_float_on(func, "a", ctx, a));
  GDP_TRY(check_float_on(func, "A_log", ctx, A_log));
  GDP_TRY(check_float_on(func, "dt_bias", ctx, dt_bias));
  GDP_TRY(check_float_on(func, "d_g", ctx, d_g));
  if (a->ndim < 1)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "a: expected at least 1 dim [...,H], got %s",
                        shape_of(s1, sizeof s1, a));
  *H = a->shape[a->ndim - 1];
  GDP_TRY(check_shape(func, "A_log", A_log, 1, H, "[H] (a's last dim)"));
  if (dt_bias) GDP_TRY(check_shape(func, "dt_bias", dt_bias, 1, H, "[H] (a's last dim)"));
  return check_same_shape(func, "d_g", d_g, "a", a);
}

gdp_status gdp_mixer_decay_forward(gdp_ctx *ctx, const gdp_tensor *a, const gdp_tensor *A_log,
                                   const gdp_tensor *dt_bias, gdp_tensor **g) {
  static const char *func = "gdp_mixer_decay_forward";
  GDP_TRY(need_out(func, "g", g));
  *g = NULL;
  NEED_OP(func, ctx, decay_forward);
  int64_t H = 0;
  GDP_TRY(decay_check(func, ctx, a, A_log, dt_bias, NULL, &H));
  gdp_tensor *tmp[4] = {0}; /* a, A_log, dt_bias, g */
  const gdp_dtype dt = a->dtype;
  gdp_status s = load(ctx, a, dt, &tmp[0]);
  if (s == GDP_OK) s = load(ctx, A_log, dt, &tmp[1]);
  if (s == GDP_OK) s = load(ctx, dt_bias, dt, &tmp[2]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, dt, a->ndim, a->shape, &tmp[3]);
  if (s == GDP_OK) {
    const int64_t rows = H > 0 ? gdp_tensor_numel(a) / H : 0;
    s = ctx->backend->decay_forward(ctx, dt, rows, H, ptr(tmp[0]), ptr(tmp[1]), ptr(tmp[2]),
                                    ptr(tmp[3]));
  }
  if (s == GDP_OK) {
    *g = tmp[3];
    tmp[3] = NULL;
  }
  FREE_ALL(tmp);
  return s;
}

gdp_status gdp_mixer_decay_backward(gdp_ctx *ctx, const gdp_tensor *a, const gdp_tensor *A_log,
                                    const gdp_tensor *dt_bias, const gdp_tensor *d_g,
                                    gdp_tensor **da, gdp_tensor **dA_log,
                                    gdp_tensor **ddt_bias) {
  static const char *func = "gdp_mixer_decay_backward";
  clear_outs(da, dA_log, ddt_bias, NULL);
  NEED_OP(func, ctx, decay_backward);
  GDP_TRY(need_tensor(func, "d_g", d_g));
  int64_t H = 0;
  GDP_TRY(decay_check(func, ctx, a, A_log, dt_bias, d_g, &H));
  /* a, A_log, dt_bias, d_g, then da, dA_log, ddt_bias */
  gdp_tensor *tmp[7] = {0};
  const gdp_dtype dt = a->dtype;
  gdp_status s = load(ctx, a, dt, &tmp[0]);
  if (s == GDP_OK) s = load(ctx, A_log, dt, &tmp[1]);
  if (s == GDP_OK) s = load(ctx, dt_bias, dt, &tmp[2]);
  if (s == GDP_OK) s = load(ctx, d_g, dt, &tmp[3]);
  if (s == GDP_OK) s = buffer_like(ctx, da != NULL, dt, a, &tmp[4]);
  if (s == GDP_OK) s = buffer_like(ctx, dA_log != NULL, dt, A_log, &tmp[5]);
  if (s == GDP_OK) s = buffer_like(ctx, ddt_bias && dt_bias, dt, dt_bias, &tmp[6]);
  if (s == GDP_OK) {
    const int64_t rows = H > 0 ? gdp_tensor_numel(a) / H : 0;
    s = ctx->backend->decay_backward(ctx, dt, rows, H, ptr(tmp[0]), ptr(tmp[1]), ptr(tmp[2]),
                                     ptr(tmp[3]), ptr(tmp[4]), ptr(tmp[5]), ptr(tmp[6]));
  }
  if (s == GDP_OK) s = deliver(ctx, &tmp[4], dt, da);
  if (s == GDP_OK) s = deliver(ctx, &tmp[5], A_log->dtype, dA_log);
  if (s == GDP_OK && dt_bias) s = deliver(ctx, &tmp[6], dt_bias->dtype, ddt_bias);
  if (s != GDP_OK) {
    gdp_tensor **outs[3] = {da, dA_log, ddt_bias};
    for (int i = 0; i < 3; i++)
      if (outs[i]) {
        gdp_tensor_free(*outs[i]);
        *outs[i] = NULL;
      }
  }
  FREE_ALL(tmp);
  return s;
}

/* ------------------------------------------------------------------ output norm */

/* The output norm (gdp_mixer_out_norm_*) and the plain gated RMSNorm (one head of d
 * channels per row, no skip) share the backend entries: one kernel per device. */

static gdp_status norm_group_check(const char *func, int64_t d, const char *d_is,
                                   int64_t group_size, double eps) {
  if (group_size < 1 || d % group_size != 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "group_size: expected a divisor of d = %lld (%s), got %lld", (long long)d,
                        d_is, (long long)group_size);
  if (!(eps >= 0.0) || !isfinite(eps))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "eps: expected a finite value >= 0, got %g", eps);
  return GDP_OK;
}

/* t as the kernels read it in place: a new reference when it has `dtype` and a
 * contiguous last dim, else a contiguous copy.  NULL stays NULL. */
static gdp_status load_rows(gdp_ctx *ctx, const gdp_tensor *t, gdp_dtype dtype, gdp_tensor **out) {
  *out = NULL;
  if (!t) return GDP_OK;
  const int last = t->ndim - 1;
  if (t->dtype == dtype && (last < 0 || t->shape[last] <= 1 || t->stride[last] == 1)) {
    *out = gdp_tensor_retain((gdp_tensor *)t);
    return GDP_OK;
  }
  return load(ctx, t, dtype, out);
}

/* The [T,B,H,P] strides (kernels/mixer_problem.h) of a [T,B,H,P] tensor, of a [B,T,H,P]
 * one and of a [T,B,H*P] one (last dim contiguous or of size <= 1). */
static gdp_tbhp_strides tbhp_of(const gdp_tensor *t) {
  return (gdp_tbhp_strides){t->stride[0], t->stride[1], t->stride[2]};
}
static gdp_tbhp_strides bthp_of(const gdp_tensor *t) {
  return (gdp_tbhp_strides){t->stride[1], t->stride[0], t->stride[2]};
}
static gdp_tbhp_strides tbd_of(const gdp_tensor *t, int64_t P) {
  return (gdp_tbhp_strides){t->stride[0], t->stride[1], P};
}

static gdp_status out_norm_check(const char *func, gdp_ctx *ctx, const gdp_tensor *o,
                                 const gdp_tensor *x_v, const gdp_tensor *D, const gdp_tensor *z,
                                 const gdp_tensor *weight, int64_t group_size, double eps,
                                 const gdp_tensor *d_out, gdp_out_norm_problem *p) {
  char s1[128], s2[128];
  memset(p, 0, sizeof *p);
  GDP_TRY(need_tensor(func, "o", o));
  GDP_TRY(need_tensor(func, "weight", weight));
  GDP_TRY(check_float_on(func, "o", ctx, o));
  GDP_TRY(check_float_on(func, "x_v", ctx, x_v));
  GDP_TRY(check_float_on(func, "D", ctx, D));
  GDP_TRY(check_float_on(func, "z", ctx, z));
  GDP_TRY(check_float_on(func, "weight", ctx, weight));
  GDP_TRY(check_float_on(func, "d_out", ctx, d_out));
  if (o->ndim != 4)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "o: expected 4 dims [B,T,H,P], got %s",
                        shape_of(s1, sizeof s1, o));
  p->B = o->shape[0], p->T = o->shape[1], p->H = o->shape[2], p->P = o->shape[3];
  const int64_t d = p->H * p->P;
  const int64_t tbhp[4] = {p->T, p->B, p->H, p->P}, tbd[3] = {p->T, p->B, d};
  if (!x_v != !D)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "%s: expected a tensor with %s (the D skip needs both), got NULL",
                        x_v ? "D" : "x_v", x_v ? "x_v" : "D");
  if (x_v) {
    GDP_TRY(check_shape(func, "x_v", x_v, 4, tbhp, "[T,B,H,P] (o's sizes)"));
    const int64_t nD = D->ndim == 1 ? D->shape[0] : -1;
    if (nD != p->H && nD != d)
      return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                          "D: expected [H] = [%lld] (per head) or [H*P] = [%lld] (per channel) "
                          "for o %s, got %s",
                          (long long)p->H, (long long)d, shape_of(s2, sizeof s2, o),
                          shape_of(s1, sizeof s1, D));
    p->D_mode = nD == p->H ? GDP_OUT_NORM_D_HEAD : GDP_OUT_NORM_D_CHANNEL;
  }
  if (z) GDP_TRY(check_shape(func, "z", z, 3, tbd, "[T,B,H*P]"));
  if (d_out) GDP_TRY(check_shape(func, "d_out", d_out, 3, tbd, "[T,B,H*P]"));
  GDP_TRY(check_shape(func, "weight", weight, 1, &d, "[H*P]"));
  GDP_TRY(norm_group_check(func, d, "H*P", group_size, eps));
  p->group_size = group_size;
  p->eps = eps;
  p->num_threads = ctx->num_threads;
  p->dtype = (int)o->dtype;
  return GDP_OK;
}

/* Hands each tmp[i] to outs[i] (NULL: not wanted) in dtypes[i]; on failure none is kept. */
static gdp_status deliver_all(gdp_ctx *ctx, gdp_tensor **tmp, const gdp_dtype *dtypes,
                              gdp_tensor ***outs, int n) {
  gdp_status s = GDP_OK;
  for (int i = 0; i < n && s == GDP_OK; i++)
    if (outs[i]) s = deliver(ctx, &tmp[i], dtypes[i], outs[i]);
  if (s != GDP_OK)
    for (int i = 0; i < n; i++)
      if (outs[i]) {
        gdp_tensor_free(*outs[i]);
        *outs[i] = NULL;
      }
  return s;
}

gdp_status gdp_mixer_out_norm_forward(gdp_ctx *ctx, const gdp_tensor *o, const gdp_tensor *x_v,
                                      const gdp_tensor *D, const gdp_tensor *z,
                                      const gdp_tensor *weight, int64_t group_size, double eps,
                                      gdp_tensor **out) {
  static const char *func = "gdp_mixer_out_norm_forward";
  GDP_TRY(need_out(func, "out", out));
  *out = NULL;
  NEED_OP(func, ctx, out_norm_forward);
  gdp_out_norm_problem p;
  GDP_TRY(out_norm_check(func, ctx, o, x_v, D, z, weight, group_size, eps, NULL, &p));
  gdp_tensor *tmp[6] = {0}; /* o, x_v, D, z, weight, out */
  const gdp_dtype dt = o->dtype;
  gdp_status s = load_rows(ctx, o, dt, &tmp[0]);
  if (s == GDP_OK) s = load_rows(ctx, x_v, dt, &tmp[1]);
  if (s == GDP_OK) s = load(ctx, D, dt, &tmp[2]);
  if (s == GDP_OK) s = load_rows(ctx, z, dt, &tmp[3]);
  if (s == GDP_OK) s = load(ctx, weight, dt, &tmp[4]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, dt, 3, (const int64_t[]){p.T, p.B, p.H * p.P}, &tmp[5]);
  if (s == GDP_OK) {
    p.o = bthp_of(tmp[0]);
    if (x_v) p.x_v = tbhp_of(tmp[1]);
    if (z) p.z = tbd_of(tmp[3], p.P);
    p.out = tbd_of(tmp[5], p.P);
    s = ctx->backend->out_norm_forward(ctx, &p, ptr(tmp[0]), ptr(tmp[1]), ptr(tmp[2]),
                                       ptr(tmp[3]), ptr(tmp[4]), ptr(tmp[5]));
  }
  if (s == GDP_OK) {
    *out = tmp[5];
    tmp[5] = NULL;
  }
  FREE_ALL(tmp);
  return s;
}

gdp_status gdp_mixer_out_norm_backward(gdp_ctx *ctx, const gdp_tensor *o, const gdp_tensor *x_v,
                                       const gdp_tensor *D, const gdp_tensor *z,
                                       const gdp_tensor *weight, int64_t group_size, double eps,
                                       const gdp_tensor *d_out, gdp_tensor *dz_into,
                                       gdp_tensor **d_o, gdp_tensor **dz, gdp_tensor **dx_v,
                                       gdp_tensor **dD, gdp_tensor **dweight) {
  static const char *func = "gdp_mixer_out_norm_backward";
  clear_outs(d_o, dz, dx_v, dD);
  clear_outs(dweight, NULL, NULL, NULL);
  NEED_OP(func, ctx, out_norm_backward);
  GDP_TRY(need_tensor(func, "d_out", d_out));
  gdp_out_norm_problem p;
  GDP_TRY(out_norm_check(func, ctx, o, x_v, D, z, weight, group_size, eps, d_out, &p));
  const int64_t d = p.H * p.P;
  const int64_t bthp[4] = {p.B, p.T, p.H, p.P}, tbhp[4] = {p.T, p.B, p.H, p.P}, tbd[3] = {p.T, p.B, d};
  const gdp_dtype dt = o->dtype;
  if (dz_into) {
    if (!z)
      return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                          "dz_into: expected NULL without z (no gate), got a tensor");
    GDP_TRY(check_float_on(func, "dz_into", ctx, dz_into));
    GDP_TRY(check_shape(func, "dz_into", dz_into, 3, tbd, "[T,B,H*P] (z's shape)"));
  }
  /* In place when dz_into has the compute dtype and a contiguous last dim (its other
   * strides are the kernels' business), else staged in a buffer and copied. */
  const int dz_in_place = dz_into && dz_into->dtype == dt &&
                          (dz_into->shape[2] <= 1 || dz_into->stride[2] == 1);
  /* results d_o, dz, dx_v, dD, dweight; then o, x_v, D, z, weight, d_out */
  gdp_tensor *tmp[11] = {0};
  gdp_status s = GDP_OK;
  if (d_o) s = gdp_tensor_empty(ctx, dt, 4, bthp, &tmp[0]);
  if (s == GDP_OK && dz_in_place) tmp[1] = gdp_tensor_retain(dz_into);
  else if (s == GDP_OK && (dz || dz_into) && z) s = gdp_tensor_empty(ctx, dt, 3, tbd, &tmp[1]);
  if (s == GDP_OK && dx_v && x_v) s = gdp_tensor_empty(ctx, dt, 4, tbhp, &tmp[2]);
  if (s == GDP_OK) s = buffer_like(ctx, dD && D, dt, D, &tmp[3]);
  if (s == GDP_OK) s = buffer_like(ctx, dweight != NULL, dt, weight, &tmp[4]);
  if (s == GDP_OK) s = load_rows(ctx, o, dt, &tmp[5]);
  if (s == GDP_OK) s = load_rows(ctx, x_v, dt, &tmp[6]);
  if (s == GDP_OK) s = load(ctx, D, dt, &tmp[7]);
  if (s == GDP_OK) s = load_rows(ctx, z, dt, &tmp[8]);
  if (s == GDP_OK) s = load(ctx, weight, dt, &tmp[9]);
  if (s == GDP_OK) s = load_rows(ctx, d_out, dt, &tmp[10]);
  if (s == GDP_OK) {
    p.o = bthp_of(tmp[5]);
    if (x_v) p.x_v = tbhp_of(tmp[6]);
    if (z) p.z = tbd_of(tmp[8], p.P);
    p.d_out = tbd_of(tmp[10], p.P);
    if (tmp[0]) p.d_o = bthp_of(tmp[0]);
    if (tmp[1]) p.dz = tbd_of(tmp[1], p.P);
    if (tmp[2]) p.dx_v = tbhp_of(tmp[2]);
    s = ctx->backend->out_norm_backward(ctx, &p, ptr(tmp[5]), ptr(tmp[6]), ptr(tmp[7]),
                                        ptr(tmp[8]), ptr(tmp[9]), ptr(tmp[10]), ptr(tmp[0]),
                                        ptr(tmp[1]), ptr(tmp[2]), ptr(tmp[3]), ptr(tmp[4]));
  }
  if (s == GDP_OK && dz_into) {
    if (dz_in_place) gdp_tensor_mark_written(dz_into);
    else s = gdp_tensor_copy(ctx, dz_into, tmp[1]);
    gdp_tensor_free(tmp[1]);
    tmp[1] = dz ? gdp_tensor_retain(dz_into) : NULL;
  }
  if (s == GDP_OK) {
    gdp_tensor **outs[5] = {d_o, z ? dz : NULL, x_v ? dx_v : NULL, D ? dD : NULL, dweight};
    const gdp_dtype dtypes[5] = {dt, dz_into ? dz_into->dtype : dt, dt, D ? D->dtype : dt,
                                 weight->dtype};
    s = deliver_all(ctx, tmp, dtypes, outs, 5);
  }
  FREE_ALL(tmp);
  return s;
}

/* y [..., d] as the output norm's operands: rows x one head of d channels. */
static gdp_status rows_problem(const char *func, gdp_ctx *ctx, const gdp_tensor *y,
                               const gdp_tensor *z, const gdp_tensor *weight, int64_t group_size,
                               double eps, const gdp_tensor *d_out, gdp_out_norm_problem *p) {
  char s1[128];
  memset(p, 0, sizeof *p);
  GDP_TRY(need_tensor(func, "y", y));
  GDP_TRY(need_tensor(func, "weight", weight));
  GDP_TRY(check_float_on(func, "y", ctx, y));
  GDP_TRY(check_float_on(func, "z", ctx, z));
  GDP_TRY(check_float_on(func, "weight", ctx, weight));
  GDP_TRY(check_float_on(func, "d_out", ctx, d_out));
  if (y->ndim < 1)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "y: expected at least 1 dim [...,d], got %s",
                        shape_of(s1, sizeof s1, y));
  const int64_t d = y->shape[y->ndim - 1];
  GDP_TRY(check_same_shape(func, "z", z, "y", y));
  GDP_TRY(check_same_shape(func, "d_out", d_out, "y", y));
  GDP_TRY(check_shape(func, "weight", weight, 1, &d, "[d] (y's last dim)"));
  GDP_TRY(norm_group_check(func, d, "y's last dim", group_size, eps));
  const gdp_tbhp_strides rows = {d, 0, 0};
  p->T = d > 0 ? gdp_tensor_numel(y) / d : 0, p->B = 1, p->H = 1, p->P = d;
  p->group_size = group_size;
  p->eps = eps;
  p->D_mode = GDP_OUT_NORM_NO_D;
  p->num_threads = ctx->num_threads;
  p->dtype = (int)y->dtype;
  p->o = p->z = p->out = p->d_out = p->d_o = p->dz = rows;
  return GDP_OK;
}

gdp_status gdp_mixer_gated_rmsnorm_forward(gdp_ctx *ctx, const gdp_tensor *y, const gdp_tensor *z,
                                           const gdp_tensor *weight, int64_t group_size,
                                           double eps, gdp_tensor **out) {
  static const char *func = "gdp_mixer_gated_rmsnorm_forward";
  GDP_TRY(need_out(func, "out", out));
  *out = NULL;
  NEED_OP(func, ctx, out_norm_forward);
  gdp_out_norm_problem p;
  GDP_TRY(rows_problem(func, ctx, y, z, weight, group_size, eps, NULL, &p));
  gdp_tensor *tmp[4] = {0}; /* y, z, weight, out */
  const gdp_dtype dt = y->dtype;
  gdp_status s = load(ctx, y, dt, &tmp[0]);
  if (s == GDP_OK) s = load(ctx, z, dt, &tmp[1]);
  if (s == GDP_OK) s = load(ctx, weight, dt, &tmp[2]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, dt, y->ndim, y->shape, &tmp[3]);
  if (s == GDP_OK)
    s = ctx->backend->out_norm_forward(ctx, &p, ptr(tmp[0]), NULL, NULL, ptr(tmp[1]),
                                       ptr(tmp[2]), ptr(tmp[3]));
  if (s == GDP_OK) {
    *out = tmp[3];
    tmp[3] = NULL;
  }
  FREE_ALL(tmp);
  return s;
}

gdp_status gdp_mixer_gated_rmsnorm_backward(gdp_ctx *ctx, const gdp_tensor *y,
                                            const gdp_tensor *z, const gdp_tensor *weight,
                                            int64_t group_size, double eps,
                                            const gdp_tensor *d_out, gdp_tensor **dy,
                                            gdp_tensor **dz, gdp_tensor **dweight) {
  static const char *func = "gdp_mixer_gated_rmsnorm_backward";
  clear_outs(dy, dz, dweight, NULL);
  NEED_OP(func, ctx, out_norm_backward);
  GDP_TRY(need_tensor(func, "d_out", d_out));
  gdp_out_norm_problem p;
  GDP_TRY(rows_problem(func, ctx, y, z, weight, group_size, eps, d_out, &p));
  /* dy, dz, dweight, then y, z, weight, d_out */
  gdp_tensor *tmp[7] = {0};
  const gdp_dtype dt = y->dtype;
  gdp_status s = buffer_like(ctx, dy != NULL, dt, y, &tmp[0]);
  if (s == GDP_OK) s = buffer_like(ctx, dz && z, dt, y, &tmp[1]);
  if (s == GDP_OK) s = buffer_like(ctx, dweight != NULL, dt, weight, &tmp[2]);
  if (s == GDP_OK) s = load(ctx, y, dt, &tmp[3]);
  if (s == GDP_OK) s = load(ctx, z, dt, &tmp[4]);
  if (s == GDP_OK) s = load(ctx, weight, dt, &tmp[5]);
  if (s == GDP_OK) s = load(ctx, d_out, dt, &tmp[6]);
  if (s == GDP_OK)
    s = ctx->backend->out_norm_backward(ctx, &p, ptr(tmp[3]), NULL, NULL, ptr(tmp[4]),
                                        ptr(tmp[5]), ptr(tmp[6]), ptr(tmp[0]), ptr(tmp[1]),
                                        NULL, NULL, ptr(tmp[2]));
  if (s == GDP_OK) {
    gdp_tensor **outs[3] = {dy, z ? dz : NULL, dweight};
    const gdp_dtype dtypes[3] = {dt, dt, weight->dtype};
    s = deliver_all(ctx, tmp, dtypes, outs, 3);
  }
  FREE_ALL(tmp);
  return s;
}

/* ------------------------------------------------------------------ repeat heads */

/* A device-side view of t [..., H, N] as [..., G, H/G, N] (splitting a dim is always a
 * view; reshape only as a fallback). */
static gdp_status split_heads(gdp_tensor *t, int64_t G, gdp_tensor **out) {
  int64_t shape[GDP_MAX_DIMS];
  const int nd = t->ndim;
  for (int i = 0; i < nd - 2; i++) shape[i] = t->shape[i];
  shape[nd - 2] = G;
  shape[nd - 1] = t->shape[nd - 2] / G;
  shape[nd] = t->shape[nd - 1];
  gdp_status s = gdp_tensor_view(t, nd + 1, shape, out);
  if (s != GDP_OK) {
    gdp_clear_error();
    s = gdp_tensor_reshape(t, nd + 1, shape, out);
  }
  return s;
}

static gdp_status repeat_check(const char *func, gdp_ctx *ctx, const gdp_tensor *t,
                               const char *name, const char *dims, int64_t count,
                               const char *count_name) {
  char s1[128];
  if (!ctx) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "ctx: expected a context, got NULL");
  GDP_TRY(need_tensor(func, name, t));
  const gdp_ctx *tc = t->storage->ctx;
  if (tc->type != ctx->type || tc->index != ctx->index)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected a tensor on %s:%d (ctx), got %s:%d",
                        name, gdp_device_type_name(ctx->type), ctx->index,
                        gdp_device_type_name(tc->type), tc->index);
  if (t->ndim < 2 || t->ndim >= GDP_MAX_DIMS)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "%s: expected 2..%d dims %s, got %s", name,
                        GDP_MAX_DIMS - 1, dims, shape_of(s1, sizeof s1, t));
  if (count < 1)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected >= 1, got %lld", count_name,
                        (long long)count);
  return GDP_OK;
}

gdp_status gdp_mixer_repeat_heads_forward(gdp_ctx *ctx, const gdp_tensor *x, int64_t num_heads,
                                          gdp_tensor **out) {
  static const char *func = "gdp_mixer_repeat_heads_forward";
  char s1[128];
  GDP_TRY(need_out(func, "out", out));
  *out = NULL;
  GDP_TRY(repeat_check(func, ctx, x, "x", "[...,G,N]", num_heads, "num_heads"));
  const int nd = x->ndim;
  const int64_t G = x->shape[nd - 2];
  if (G < 1 || num_heads % G != 0)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "num_heads: expected a multiple of the group count G = %lld (x %s), got %lld",
                        (long long)G, shape_of(s1, sizeof s1, x), (long long)num_heads);
  int64_t shape[GDP_MAX_DIMS];
  memcpy(shape, x->shape, sizeof(int64_t) * (size_t)nd);
  shape[nd - 2] = num_heads;
  gdp_tensor *res = NULL, *split = NULL, *sel = NULL;
  gdp_status s = gdp_tensor_empty(ctx, x->dtype, nd, shape, &res);
  if (s == GDP_OK) s = split_heads(res, G, &split);
  for (int64_t r = 0; s == GDP_OK && r < num_heads / G; r++) {
    s = gdp_tensor_select(split, nd - 1, r, &sel); /* [..., G, N]: replica r of every group */
    if (s == GDP_OK) s = gdp_tensor_copy(ctx, sel, x);
    gdp_tensor_free(sel);
    sel = NULL;
  }
  gdp_tensor_free(split);
  if (s == GDP_OK) *out = res;
  else gdp_tensor_free(res);
  return s;
}

gdp_status gdp_mixer_repeat_heads_backward(gdp_ctx *ctx, const gdp_tensor *d_out,
                                           int64_t num_groups, gdp_tensor **dx) {
  static const char *func = "gdp_mixer_repeat_heads_backward";
  char s1[128];
  GDP_TRY(need_out(func, "dx", dx));
  *dx = NULL;
  GDP_TRY(repeat_check(func, ctx, d_out, "d_out", "[...,H,N]", num_groups, "num_groups"));
  const int nd = d_out->ndim;
  const int64_t H = d_out->shape[nd - 2];
  if (H % num_groups != 0)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "num_groups: expected a divisor of the head count H = %lld (d_out %s), got %lld",
                        (long long)H, shape_of(s1, sizeof s1, d_out), (long long)num_groups);
  int64_t shape[GDP_MAX_DIMS];
  memcpy(shape, d_out->shape, sizeof(int64_t) * (size_t)nd);
  shape[nd - 2] = num_groups;
  gdp_tensor *res = NULL, *split = NULL, *sel = NULL;
  gdp_status s = gdp_tensor_zeros(ctx, d_out->dtype, nd, shape, &res);
  if (s == GDP_OK) s = split_heads((gdp_tensor *)d_out, num_groups, &split);
  for (int64_t r = 0; s == GDP_OK && r < H / num_groups; r++) {
    s = gdp_tensor_select(split, nd - 1, r, &sel);
    if (s == GDP_OK) s = gdp_tensor_add(res, res, sel, 1.0);
    gdp_tensor_free(sel);
    sel = NULL;
  }
  gdp_tensor_free(split);
  if (s == GDP_OK) *dx = res;
  else gdp_tensor_free(res);
  return s;
}

/* ------------------------------------------------------------------ D skip */

static gdp_status dskip_check(const char *func, gdp_ctx *ctx, const gdp_tensor *x_v,
                              const gdp_tensor *D, int64_t *H, int64_t *P, int *per_channel) {
  char s1[128], s2[128];
  GDP_TRY(need_tensor(func, "x_v", x_v));
  GDP_TRY(need_tensor(func, "D", D));
  GDP_TRY(check_float_on(func, "x_v", ctx, x_v));
  GDP_TRY(check_float_on(func, "D", ctx, D));
  if (x_v->ndim < 2)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "x_v: expected at least 2 dims [...,H,P], got %s",
                        shape_of(s1, sizeof s1, x_v));
  *H = x_v->shape[x_v->ndim - 2];
  *P = x_v->shape[x_v->ndim - 1];
  const int64_t nD = gdp_tensor_numel(D);
  if (nD == *H) *per_channel = 0;
  else if (nD == *H * *P) *per_channel = 1;
  else
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "D: expected H = %lld values (per head) or H*P = %lld (per channel) for "
                        "x_v %s, got %s",
                        (long long)*H, (long long)(*H * *P), shape_of(s2, sizeof s2, x_v),
                        shape_of(s1, sizeof s1, D));
  return GDP_OK;
}

gdp_status gdp_mixer_dskip_forward(gdp_ctx *ctx, const gdp_tensor *y, const gdp_tensor *x_v,
                                   const gdp_tensor *D, gdp_tensor **out) {
  static const char *func = "gdp_mixer_dskip_forward";
  GDP_TRY(need_out(func, "out", out));
  *out = NULL;
  NEED_OP(func, ctx, dskip_forward);
  GDP_TRY(need_tensor(func, "y", y));
  GDP_TRY(check_float_on(func, "y", ctx, y));
  int64_t H = 0, P = 0;
  int per_channel = 0;
  GDP_TRY(dskip_check(func, ctx, x_v, D, &H, &P, &per_channel));
  GDP_TRY(check_same_shape(func, "x_v", x_v, "y", y));
  gdp_tensor *tmp[4] = {0}; /* y, x_v, D, out */
  const gdp_dtype dt = y->dtype;
  gdp_status s = load(ctx, y, dt, &tmp[0]);
  if (s == GDP_OK) s = load(ctx, x_v, dt, &tmp[1]);
  if (s == GDP_OK) s = load(ctx, D, dt, &tmp[2]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, dt, y->ndim, y->shape, &tmp[3]);
  if (s == GDP_OK) {
    const int64_t rows = H * P > 0 ? gdp_tensor_numel(y) / (H * P) : 0;
    s = ctx->backend->dskip_forward(ctx, dt, rows, H, P, per_channel, ptr(tmp[0]), ptr(tmp[1]),
                                    ptr(tmp[2]), ptr(tmp[3]));
  }
  if (s == GDP_OK) {
    *out = tmp[3];
    tmp[3] = NULL;
  }
  FREE_ALL(tmp);
  return s;
}

gdp_status gdp_mixer_dskip_backward(gdp_ctx *ctx, const gdp_tensor *x_v, const gdp_tensor *D,
                                    const gdp_tensor *d_out, gdp_tensor **dx_v,
                                    gdp_tensor **dD) {
  static const char *func = "gdp_mixer_dskip_backward";
  clear_outs(dx_v, dD, NULL, NULL);
  NEED_OP(func, ctx, dskip_backward);
  GDP_TRY(need_tensor(func, "d_out", d_out));
  int64_t H = 0, P = 0;
  int per_channel = 0;
  GDP_TRY(dskip_check(func, ctx, x_v, D, &H, &P, &per_channel));
  GDP_TRY(check_float_on(func, "d_out", ctx, d_out));
  GDP_TRY(check_same_shape(func, "d_out", d_out, "x_v", x_v));
  gdp_tensor *tmp[5] = {0}; /* x_v, D, d_out, dx_v, dD */
  const gdp_dtype dt = x_v->dtype;
  gdp_status s = load(ctx, x_v, dt, &tmp[0]);
  if (s == GDP_OK) s = load(ctx, D, dt, &tmp[1]);
  if (s == GDP_OK) s = load(ctx, d_out, dt, &tmp[2]);
  if (s == GDP_OK) s = buffer_like(ctx, dx_v != NULL, dt, x_v, &tmp[3]);
  if (s == GDP_OK) s = buffer_like(ctx, dD != NULL, dt, D, &tmp[4]);
  if (s == GDP_OK) {
    const int64_t rows = H * P > 0 ? gdp_tensor_numel(x_v) / (H * P) : 0;
    s = ctx->backend->dskip_backward(ctx, dt, rows, H, P, per_channel, ptr(tmp[0]), ptr(tmp[1]),
                                     ptr(tmp[2]), ptr(tmp[3]), ptr(tmp[4]));
  }
  if (s == GDP_OK) s = deliver(ctx, &tmp[3], dt, dx_v);
  if (s == GDP_OK) s = deliver(ctx, &tmp[4], D->dtype, dD);
  if (s != GDP_OK) {
    if (dx_v) {
      gdp_tensor_free(*dx_v);
      *dx_v = NULL;
    }
    if (dD) {
      gdp_tensor_free(*dD);
      *dD = NULL;
    }
  }
  FREE_ALL(tmp);
  return s;
}

/* ------------------------------------------------------------------ input stage */

typedef struct inputs_plan {
  gdp_ssm_inputs_problem p;
  gdp_dtype gate_dtype; /* A_log, dt_bias, g, dg: float32 for bf16, else the compute dtype */
  int64_t conv_dim;
} inputs_plan;

/* The checks both directions share; `first` (xBC or b) sets the compute dtype. */
static gdp_status inputs_check(const char *func, gdp_ctx *ctx, const gdp_tensor *first,
                               const gdp_tensor *b, const gdp_tensor *a, const gdp_tensor *A_log,
                               const gdp_tensor *dt_bias, int64_t nh, int64_t P, int64_t ng,
                               int64_t N, int64_t M, double beta_scale, inputs_plan *pl) {
  char s1[128];
  memset(pl, 0, sizeof *pl);
  GDP_TRY(need_tensor(func, "b", b));
  GDP_TRY(check_float_on(func, "b", ctx, b));
  GDP_TRY(check_float_on(func, "a", ctx, a));
  GDP_TRY(check_float_on(func, "A_log", ctx, A_log));
  GDP_TRY(check_float_on(func, "dt_bias", ctx, dt_bias));
  const struct { const char *name; int64_t v; } sizes[5] = {
      {"num_heads", nh}, {"head_dim", P}, {"num_groups", ng}, {"state_dim", N},
      {"num_householder", M}};
  for (int i = 0; i < 5; i++)
    if (sizes[i].v < 1)
      return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected >= 1, got %lld", sizes[i].name,
                          (long long)sizes[i].v);
  if (nh % ng != 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "num_groups: expected a divisor of num_heads = %lld, got %lld",
                        (long long)nh, (long long)ng);
  if (!isfinite(beta_scale))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "beta_scale: expected a finite value (1, or 2 for negative eigenvalues), got %g",
                        beta_scale);
  if (b->ndim != 3 || b->shape[2] != M * nh)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "b: expected [T,B,M*nh] with M*nh = %lld, got %s",
                        (long long)(M * nh), shape_of(s1, sizeof s1, b));
  const int64_t T = b->shape[0], B = b->shape[1];
  if (a) {
    GDP_TRY(check_shape(func, "a", a, 3, (const int64_t[]){T, B, nh}, "[T,B,nh] (b's T, B)"));
    GDP_TRY(need_tensor(func, "A_log", A_log));
    GDP_TRY(check_shape(func, "A_log", A_log, 1, &nh, "[nh]"));
    if (dt_bias) GDP_TRY(check_shape(func, "dt_bias", dt_bias, 1, &nh, "[nh]"));
  } else if (A_log || dt_bias) {
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "%s: expected NULL without a (no forget gate), got a tensor",
                        A_log ? "A_log" : "dt_bias");
  }
  pl->conv_dim = M * nh * P + M * ng * N + ng * N;
  const gdp_dtype dt = first->dtype;
  pl->gate_dtype = dt == GDP_DTYPE_BF16 ? GDP_DTYPE_F32 : dt;
  gdp_ssm_inputs_problem p = {.T = T, .B = B, .nh = nh, .P = P, .ng = ng, .N = N, .M = M,
                              .beta_scale = beta_scale, .gate = a != NULL,
                              .num_threads = ctx->num_threads, .dtype = dt};
  pl->p = p;
  return GDP_OK;
}

gdp_status gdp_mixer_ssm_inputs_forward(gdp_ctx *ctx, const gdp_tensor *xBC, const gdp_tensor *b,
                                        const gdp_tensor *a, const gdp_tensor *A_log,
                                        const gdp_tensor *dt_bias, int64_t num_heads,
                                        int64_t head_dim, int64_t num_groups, int64_t state_dim,
                                        int64_t num_householder, double beta_scale, int silu,
                                        gdp_tensor **q, gdp_tensor **k, gdp_tensor **v,
                                        gdp_tensor **beta, gdp_tensor **g) {
  static const char *func = "gdp_mixer_ssm_inputs_forward";
  GDP_TRY(need_out(func, "q", q));
  GDP_TRY(need_out(func, "k", k));
  GDP_TRY(need_out(func, "v", v));
  GDP_TRY(need_out(func, "beta", beta));
  clear_outs(q, k, v, beta);
  if (g) *g = NULL;
  NEED_OP(func, ctx, ssm_inputs_forward);
  GDP_TRY(need_tensor(func, "xBC", xBC));
  GDP_TRY(check_float_on(func, "xBC", ctx, xBC));
  inputs_plan pl;
  GDP_TRY(inputs_check(func, ctx, xBC, b, a, A_log, dt_bias, num_heads, head_dim, num_groups,
                       state_dim, num_householder, beta_scale, &pl));
  gdp_ssm_inputs_problem *p = &pl.p;
  GDP_TRY(check_shape(func, "xBC", xBC, 3, (const int64_t[]){p->T, p->B, pl.conv_dim},
                      "[T,B,M*nh*P + M*ng*N + ng*N] (b's T, B)"));
  if (silu != 0 && silu != 1)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "silu: expected 0 or 1, got %d", silu);
  p->silu = silu;
  /* xBC, b, a, A_log, dt_bias, then q, k, v, beta, g */
  gdp_tensor *tmp[10] = {0};
  const gdp_dtype dt = p->dtype;
  const int64_t nh = p->nh, TM = p->T * p->M;
  gdp_status s = load_token_rows(ctx, xBC, dt, &tmp[0], &p->ld_xBC);
  if (s == GDP_OK) s = load_token_rows(ctx, b, dt, &tmp[1], &p->ld_b);
  if (s == GDP_OK) s = load_token_rows(ctx, a, dt, &tmp[2], &p->ld_a);
  if (s == GDP_OK) s = load(ctx, A_log, pl.gate_dtype, &tmp[3]);
  if (s == GDP_OK) s = load(ctx, dt_bias, pl.gate_dtype, &tmp[4]);
  if (s == GDP_OK)
    s = gdp_tensor_empty(ctx, dt, 4, (const int64_t[]){p->B, p->T, nh, p->N}, &tmp[5]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, dt, 4, (const int64_t[]){p->B, TM, nh, p->N}, &tmp[6]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, dt, 4, (const int64_t[]){p->B, TM, nh, p->P}, &tmp[7]);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, dt, 3, (const int64_t[]){p->B, TM, nh}, &tmp[8]);
  if (s == GDP_OK && a)
    s = gdp_tensor_empty(ctx, pl.gate_dtype, 3, (const int64_t[]){p->B, p->T, nh}, &tmp[9]);
  if (s == GDP_OK) {
    const gdp_ssm_inputs_fwd_io io = {.xBC = ptr(tmp[0]), .b = ptr(tmp[1]), .a = ptr(tmp[2]),
                                      .A_log = ptr(tmp[3]), .dt_bias = ptr(tmp[4]),
                                      .q = ptr(tmp[5]), .k = ptr(tmp[6]), .v = ptr(tmp[7]),
                                      .beta = ptr(tmp[8]), .g = ptr(tmp[9])};
    s = ctx->backend->ssm_inputs_forward(ctx, p, &io);
  }
  if (s == GDP_OK && a) s = deliver(ctx, &tmp[9], A_log->dtype, g);
  if (s == GDP_OK) {
    gdp_tensor **outs[4] = {q, k, v, beta};
    for (int i = 0; i < 4; i++) {
      *outs[i] = tmp[5 + i];
      tmp[5 + i] = NULL;
    }
  } else if (g) {
    gdp_tensor_free(*g);
    *g = NULL;
  }
  FREE_ALL(tmp);
  return s;
}

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
                                         gdp_tensor **ddt_bias) {
  static const char *func = "gdp_mixer_ssm_inputs_backward";
  clear_outs(dA_log, ddt_bias, NULL, NULL);
  NEED_OP(func, ctx, ssm_inputs_backward);
  GDP_TRY(need_tensor(func, "b", b));
  inputs_plan pl;
  GDP_TRY(inputs_check(func, ctx, b, b, a, A_log, dt_bias, num_heads, head_dim, num_groups,
                       state_dim, num_householder, beta_scale, &pl));
  gdp_ssm_inputs_problem *p = &pl.p;
  const int64_t T = p->T, B = p->B, nh = p->nh, TM = T * p->M;
  const struct { const char *name; const gdp_tensor *t; int ndim; int64_t shape[4]; const char *dims; } want[] = {
      {"xBC", xBC, 3, {T, B, pl.conv_dim}, "[T,B,M*nh*P + M*ng*N + ng*N] (b's T, B)"},
      {"dq", dq, 4, {B, T, nh, p->N}, "[B,T,nh,N]"},
      {"dk", dk, 4, {B, TM, nh, p->N}, "[B,T*M,nh,N]"},
      {"dv", dv, 4, {B, TM, nh, p->P}, "[B,T*M,nh,P]"},
      {"dbeta", dbeta, 3, {B, TM, nh}, "[B,T*M,nh]"},
      {"dg", dg, 3, {B, T, nh}, "[B,T,nh]"},
      {"dx_v", dx_v, 4, {T, B, nh, p->P}, "[T,B,nh,P]"},
      {"dxBC", dxBC, 3, {T, B, pl.conv_dim}, "[T,B,M*nh*P + M*ng*N + ng*N]"},
      {"db", db, 3, {T, B, p->M * nh}, "[T,B,M*nh] (b's shape)"},
      {"da", da, 3, {T, B, nh}, "[T,B,nh] (a's shape)"}};
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const int optional = !strcmp(want[i].name, "dx_v") || !strcmp(want[i].name, "xBC");
    const int gated = !strcmp(want[i].name, "dg") || !strcmp(want[i].name, "da");
    if (gated && !a) {
      if (want[i].t)
        return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                            "%s: expected NULL without a (no forget gate), got a tensor", want[i].name);
      continue;
    }
    if (!want[i].t) {
      if (optional) continue;
      GDP_TRY(need_tensor(func, want[i].name, want[i].t));
    }
    GDP_TRY(check_float_on(func, want[i].name, ctx, want[i].t));
    GDP_TRY(check_shape(func, want[i].name, want[i].t, want[i].ndim, want[i].shape, want[i].dims));
  }
  p->silu = xBC != NULL;
  /* b, a, A_log, dt_bias, dq, dk, dv, dbeta, dg, dx_v, then dxBC, db, da, dA_log, ddt_bias,
   * then xBC */
  gdp_tensor *tmp[16] = {0};
  int staged[3] = {0};
  const gdp_dtype dt = p->dtype, gt = pl.gate_dtype;
  gdp_status s = load_token_rows(ctx, b, dt, &tmp[0], &p->ld_b);
  if (s == GDP_OK) s = load_token_rows(ctx, a, dt, &tmp[1], &p->ld_a);
  if (s == GDP_OK) s = load(ctx, A_log, gt, &tmp[2]);
  if (s == GDP_OK) s = load(ctx, dt_bias, gt, &tmp[3]);
  if (s == GDP_OK) s = load(ctx, dq, dt, &tmp[4]);
  if (s == GDP_OK) s = load(ctx, dk, dt, &tmp[5]);
  if (s == GDP_OK) s = load(ctx, dv, dt, &tmp[6]);
  if (s == GDP_OK) s = load(ctx, dbeta, dt, &tmp[7]);
  if (s == GDP_OK) s = load(ctx, a ? dg : NULL, gt, &tmp[8]);
  if (s == GDP_OK) s = load(ctx, dx_v, dt, &tmp[9]);
  if (s == GDP_OK) s = load_token_rows(ctx, xBC, dt, &tmp[15], &p->ld_xBC);
  if (s == GDP_OK) s = token_rows_target(ctx, dxBC, dt, &tmp[10], &p->ld_dxBC, &staged[0]);
  if (s == GDP_OK) s = token_rows_target(ctx, db, dt, &tmp[11], &p->ld_db, &staged[1]);
  if (s == GDP_OK) s = token_rows_target(ctx, a ? da : NULL, dt, &tmp[12], &p->ld_da, &staged[2]);
  if (s == GDP_OK) s = buffer_like(ctx, a && dA_log, gt, A_log, &tmp[13]);
  if (s == GDP_OK) s = buffer_like(ctx, a && dt_bias && ddt_bias, gt, dt_bias, &tmp[14]);
  gdp_tensor *dsts[3] = {dxBC, db, a ? da : NULL};
  for (int i = 0; s == GDP_OK && i < 3; i++)
    if (dsts[i] && !staged[i]) gdp_tensor_mark_written(dsts[i]);
  if (s == GDP_OK) {
    const gdp_ssm_inputs_bwd_io io = {
        .xBC = ptr(tmp[15]), .b = ptr(tmp[0]), .a = ptr(tmp[1]), .A_log = ptr(tmp[2]), .dt_bias = ptr(tmp[3]),
        .dq = ptr(tmp[4]), .dk = ptr(tmp[5]), .dv = ptr(tmp[6]), .dbeta = ptr(tmp[7]),
        .dg = ptr(tmp[8]), .dx_v = ptr(tmp[9]), .dxBC = ptr(tmp[10]), .db = ptr(tmp[11]),
        .da = ptr(tmp[12]), .dA_log = ptr(tmp[13]), .ddt_bias = ptr(tmp[14])};
    s = ctx->backend->ssm_inputs_backward(ctx, p, &io);
  }
  for (int i = 0; s == GDP_OK && i < 3; i++)
    if (staged[i]) s = gdp_tensor_copy(ctx, dsts[i], tmp[10 + i]);
  if (s == GDP_OK && a) s = deliver(ctx, &tmp[13], A_log->dtype, dA_log);
  if (s == GDP_OK && a && dt_bias) s = deliver(ctx, &tmp[14], dt_bias->dtype, ddt_bias);
  if (s != GDP_OK) {
    gdp_tensor **outs[2] = {dA_log, ddt_bias};
    for (int i = 0; i < 2; i++)
      if (outs[i]) {
        gdp_tensor_free(*outs[i]);
        *outs[i] = NULL;
      }
  }
  FREE_ALL(tmp);
  return s;
}
