/*
 * test_mixer_ops.c -- the mixer layer ops (gdp.h, "mixer layer ops") on the cpu.
 *
 * Every op is checked against a plain float64 loop written here (the oracle), forward
 * and backward, in float64 (<= 1e-12) and float32 (<= 1e-5 relative to the float64
 * oracle), on strided inputs; every backward is also checked by central finite
 * differences of sum(out * d_out) in float64 through the public forward.  The conv is
 * run unpacked and packed (empty and one-token sequences), with halos shorter than,
 * equal to and longer than W-1, with and without bias and SiLU, with [C,W] and [C,1,W]
 * weights.  Validation errors are checked by status and message.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

#define TOL_F64 1e-12
#define TOL_F32 1e-5
#define TOL_FD 1e-7

static gdp_ctx *ctx;

/* ------------------------------------------------------------------ helpers */

static int64_t numel(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++) n *= shape[i];
  return n;
}

static gdp_tensor *mk(gdp_dtype dt, int nd, const int64_t *shape, const double *x) {
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, dt, nd, shape, GDP_DTYPE_F64, x,
                                (size_t)numel(nd, shape) * sizeof(double), &t));
  return t;
}

/* A non-contiguous view holding x (every other element of a buffer with one more
 * trailing dim of 2, like the channel slices of the in_proj output), so that the ops
 * must honour strides; the other elements are NaN, so a stray read shows. */
static gdp_tensor *mk_strided(gdp_dtype dt, int nd, const int64_t *shape, const double *x) {
  int64_t wide[GDP_MAX_DIMS];
  memcpy(wide, shape, sizeof(int64_t) * (size_t)nd);
  wide[nd] = 2;
  gdp_tensor *buf = NULL, *view = NULL, *src = mk(dt, nd, shape, x);
  CHECK_OK(gdp_tensor_empty(ctx, dt, nd + 1, wide, &buf));
  CHECK_OK(gdp_tensor_fill(buf, NAN));
  CHECK_OK(gdp_tensor_select(buf, nd, 1, &view));
  CHECK_OK(gdp_tensor_copy(ctx, view, src));
  CHECK(numel(nd, shape) < 2 || !gdp_tensor_is_contiguous(view),
        "mk_strided: expected a non-contiguous view");
  gdp_tensor_free(buf);
  gdp_tensor_free(src);
  return view;
}

static gdp_tensor *mk_any(int strided, gdp_dtype dt, int nd, const int64_t *shape,
                          const double *x) {
  if (!x) return NULL;
  return strided ? mk_strided(dt, nd, shape, x) : mk(dt, nd, shape, x);
}

static double *host(const gdp_tensor *t) {
  const int64_t n = gdp_tensor_numel(t);
  double *h = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
  if (t) CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_F64, h, (size_t)n * sizeof(double)));
  return h;
}

/* ||t - ref|| / ||ref||; NaN (fails every bound) when t is missing or of another size. */
static double rel_t(const gdp_tensor *t, const double *ref, int64_t n) {
  if (!t || gdp_tensor_numel(t) != n) return NAN;
  double *h = host(t);
  double e = tu_rel_err_f64(h, ref, n);
  free(h);
  return e;
}

static double *rnd(int64_t n, double lo, double hi) {
  double *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  for (int64_t i = 0; i < n; i++) x[i] = tu_rand_uniform(lo, hi);
  return x;
}

static double *rndn(int64_t n, double sd) {
  double *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  for (int64_t i = 0; i < n; i++) x[i] = sd * tu_rand_normal();
  return x;
}

static double dot(const double *a, const double *b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

/* sum(out * d_out) of an op output tensor (NaN when missing). */
static double loss_of(gdp_tensor *out, const double *d_out) {
  if (!out) return NAN;
  double *h = host(out);
  double l = dot(h, d_out, gdp_tensor_numel(out));
  free(h);
  gdp_tensor_free(out);
  return l;
}

/* Central differences of loss(env) along single entries of `param` (all entries when
 * there are few, else 48 random ones) against the analytic gradient `grad`; returns
 * ||fd - grad|| / ||grad|| over the sampled entries. */
typedef double (*loss_fn)(void *env);
static double fd_check(loss_fn loss, void *env, double *param, const double *grad, int64_t n) {
  const double h = 1e-5;
  const int64_t samples = n <= 64 ? n : 48;
  double num = 0, den = 0;
  for (int64_t k = 0; k < samples; k++) {
    const int64_t i = n <= 64 ? k : (int64_t)(tu_rand_u64() % (uint64_t)n);
    const double keep = param[i];
    param[i] = keep + h;
    const double lp = loss(env);
    param[i] = keep - h;
    const double lm = loss(env);
    param[i] = keep;
    const double fd = (lp - lm) / (2 * h);
    if (!isfinite(fd) || !isfinite(grad[i])) return NAN;
    num += (fd - grad[i]) * (fd - grad[i]);
    den += grad[i] * grad[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return sqrt(num / den);
}

static void check_err(const char *what, double err, double tol) {
  if (getenv("GDP_TEST_VERBOSE")) printf("  %-56s %.3e\n", what, err);
  CHECK(err <= tol, "%s: rel error %.3e > %.1e", what, err, tol);
}

/* ------------------------------------------------------------------ conv1d oracle */

typedef struct conv_case {
  const char *label;
  int64_t T, B, C, W, L; /* L: halo rows (0 and has_halo = 0: none) */
  int has_halo, has_bias, silu, weight3, strided;
  int64_t ncu; /* entries of cu (0: unpacked) */
  int64_t cu[12];
} conv_case;

typedef struct conv_data {
  const conv_case *k;
  double *x, *w, *bias, *halo, *dout;
} conv_data;

static double silu_ref(double u) { return u / (1 + exp(-u)); }
static double silu_grad_ref(double u) {
  const double s = 1 / (1 + exp(-u));
  return s * (1 + u * (1 - s));
}

/* Calls fn(k, b, lo, hi) for every sequence: each column b of an unpacked batch, else
 * every packed segment [cu[i], cu[i+1]) of column 0. */
typedef void (*seg_fn)(const conv_data *d, int64_t b, int64_t lo, int64_t hi, void *acc);
static void for_segments(const conv_data *d, seg_fn fn, void *acc) {
  const conv_case *k = d->k;
  if (k->ncu == 0)
    for (int64_t b = 0; b < k->B; b++) fn(d, b, 0, k->T, acc);
  else
    for (int64_t i = 0; i + 1 < k->ncu; i++) fn(d, 0, k->cu[i], k->cu[i + 1], acc);
}

/* The sequence [lo,hi) of column b, channel c, with W-1 rows of left context in front:
 * the halo (only for the sequence starting at token 0, only its last L rows), else 0.
 * ext_src[j] tells where row j came from: >= 0 a token of x, -1 - r halo row r, or
 * INT64_MIN for zero padding. */
static void conv_extend(const conv_data *d, int64_t b, int64_t c, int64_t lo, int64_t hi,
                        double *ext, int64_t *ext_src) {
  const conv_case *k = d->k;
  const int64_t pad = k->W - 1;
  for (int64_t j = 0; j < pad; j++) {
    const int64_t back = pad - j; /* tokens before lo */
    ext[j] = 0;
    ext_src[j] = INT64_MIN;
    if (lo == 0 && k->has_halo && back <= k->L) {
      const int64_t r = k->L - back;
      ext[j] = d->halo[(r * k->B + b) * k->C + c];
      ext_src[j] = -1 - r;
    }
  }
  for (int64_t t = lo; t < hi; t++) {
    ext[pad + t - lo] = d->x[(t * k->B + b) * k->C + c];
    ext_src[pad + t - lo] = t;
  }
}

typedef struct conv_result {
  double *out, *dx, *dw, *dbias, *dhalo;
} conv_result;

static void conv_ref_segment(const conv_data *d, int64_t b, int64_t lo, int64_t hi, void *accp) {
  const conv_case *k = d->k;
  conv_result *r = accp;
  const int64_t pad = k->W - 1, n = hi - lo;
  double *ext = calloc((size_t)(pad + n + 1), sizeof(double));
  double *dext = calloc((size_t)(pad + n + 1), sizeof(double));
  int64_t *src = calloc((size_t)(pad + n + 1), sizeof(int64_t));
  for (int64_t c = 0; c < k->C; c++) {
    conv_extend(d, b, c, lo, hi, ext, src);
    memset(dext, 0, (size_t)(pad + n + 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++) {
      double u = k->has_bias ? d->bias[c] : 0;
      for (int64_t w = 0; w < k->W; w++) u += d->w[c * k->W + w] * ext[i + w];
      const int64_t row = ((lo + i) * k->B + b) * k->C + c;
      r->out[row] = k->silu ? silu_ref(u) : u;
      const double du = d->dout[row] * (k->silu ? silu_grad_ref(u) : 1);
      /* scatter form of the backward (the kernel gathers) */
      for (int64_t w = 0; w < k->W; w++) {
        dext[i + w] += du * d->w[c * k->W + w];
        r->dw[c * k->W + w] += du * ext[i + w];
      }
      r->dbias[c] += du;
    }
    for (int64_t j = 0; j < pad + n; j++) {
      if (src[j] >= 0) r->dx[(src[j] * k->B + b) * k->C + c] += dext[j];
      else if (src[j] != INT64_MIN) r->dhalo[((-1 - src[j]) * k->B + b) * k->C + c] += dext[j];
    }
  }
  free(ext);
  free(dext);
  free(src);
}

static void conv_shapes(const conv_case *k, int64_t xs[3], int64_t ws[3], int *wnd,
                        int64_t hs[3]) {
  xs[0] = k->T, xs[1] = k->B, xs[2] = k->C;
  if (k->weight3) ws[0] = k->C, ws[1] = 1, ws[2] = k->W, *wnd = 3;
  else ws[0] = k->C, ws[1] = k->W, *wnd = 2;
  hs[0] = k->L, hs[1] = k->B, hs[2] = k->C;
}

static gdp_tensor *conv_cu(const conv_case *k) {
  if (!k->ncu) return NULL;
  gdp_tensor *cu = NULL;
  const int64_t shape[1] = {k->ncu};
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I32, 1, shape, GDP_DTYPE_I64, k->cu,
                                (size_t)k->ncu * sizeof(int64_t), &cu));
  return cu;
}

static gdp_activation conv_act(const conv_case *k) { return k->silu ? GDP_ACT_SILU : GDP_ACT_NONE; }

static double conv_loss(void *envp) {
  const conv_data *d = envp;
  const conv_case *k = d->k;
  int64_t xs[3], ws[3], hs[3];
  int wnd;
  conv_shapes(k, xs, ws, &wnd, hs);
  gdp_tensor *x = mk(GDP_DTYPE_F64, 3, xs, d->x), *w = mk(GDP_DTYPE_F64, wnd, ws, d->w);
  gdp_tensor *bias = k->has_bias ? mk(GDP_DTYPE_F64, 1, &k->C, d->bias) : NULL;
  gdp_tensor *halo = k->has_halo ? mk(GDP_DTYPE_F64, 3, hs, d->halo) : NULL;
  gdp_tensor *cu = conv_cu(k), *out = NULL;
  CHECK_OK(gdp_mixer_conv1d_forward(ctx, x, w, bias, halo, cu, conv_act(k), &out));
  gdp_tensor_free(x), gdp_tensor_free(w), gdp_tensor_free(bias), gdp_tensor_free(halo);
  gdp_tensor_free(cu);
  return loss_of(out, d->dout);
}

static void conv_run(const conv_case *k) {
  int64_t xs[3], ws[3], hs[3];
  int wnd;
  conv_shapes(k, xs, ws, &wnd, hs);
  const int64_t nx = numel(3, xs), nw = k->C * k->W, nh = numel(3, hs);
  conv_data d = {.k = k};
  d.x = rndn(nx, 1.0);
  d.w = rndn(nw, 0.5);
  d.bias = k->has_bias ? rndn(k->C, 0.3) : NULL;
  d.halo = k->has_halo ? rndn(nh, 1.0) : NULL;
  d.dout = rndn(nx, 1.0);
  conv_result ref = {calloc((size_t)nx + 1, 8), calloc((size_t)nx + 1, 8), calloc((size_t)nw, 8),
                     calloc((size_t)k->C, 8), calloc((size_t)nh + 1, 8)};
  for_segments(&d, conv_ref_segment, &ref);

  const gdp_dtype dts[2] = {GDP_DTYPE_F64, GDP_DTYPE_F32};
  for (int di = 0; di < 2; di++) {
    const gdp_dtype dt = dts[di];
    const double tol = dt == GDP_DTYPE_F64 ? TOL_F64 : TOL_F32;
    char what[160];
    gdp_tensor *x = mk_any(k->strided, dt, 3, xs, d.x);
    gdp_tensor *w = mk_any(k->strided, dt, wnd, ws, d.w);
    gdp_tensor *bias = k->has_bias ? mk_any(k->strided, dt, 1, &k->C, d.bias) : NULL;
    gdp_tensor *halo = k->has_halo ? mk_any(k->strided, dt, 3, hs, d.halo) : NULL;
    gdp_tensor *dout = mk_any(k->strided, dt, 3, xs, d.dout);
    gdp_tensor *cu = conv_cu(k);
    gdp_tensor *out = NULL, *dx = NULL, *dw = NULL, *db = NULL, *dh = NULL;
    CHECK_OK(gdp_tensor_empty(ctx, dt, 3, xs, &dx));
    CHECK_OK(gdp_mixer_conv1d_forward(ctx, x, w, bias, halo, cu, conv_act(k), &out));
    CHECK_OK(gdp_mixer_conv1d_backward(ctx, x, w, bias, halo, cu, conv_act(k), dout, dx, &dw,
                                       &db, &dh));
    snprintf(what, sizeof what, "conv %s %s out", k->label, gdp_dtype_name(dt));
    check_err(what, rel_t(out, ref.out, nx), tol);
    snprintf(what, sizeof what, "conv %s %s dx", k->label, gdp_dtype_name(dt));
    check_err(what, rel_t(dx, ref.dx, nx), tol);
    snprintf(what, sizeof what, "conv %s %s dweight", k->label, gdp_dtype_name(dt));
    check_err(what, rel_t(dw, ref.dw, nw), tol);
    CHECK(dw && gdp_tensor_ndim(dw) == wnd, "conv %s: dweight keeps the weight's %d dims",
          k->label, wnd);
    if (k->has_bias) {
      snprintf(what, sizeof what, "conv %s %s dbias", k->label, gdp_dtype_name(dt));
      check_err(what, rel_t(db, ref.dbias, k->C), tol);
    } else {
      CHECK(db == NULL, "conv %s: dbias must be NULL without bias", k->label);
    }
    if (k->has_halo) {
      snprintf(what, sizeof what, "conv %s %s dhalo", k->label, gdp_dtype_name(dt));
      /* a halo whose rows all lie beyond the taps has an all-zero gradient */
      double nrm = sqrt(dot(ref.dhalo, ref.dhalo, nh));
      if (nrm > 0) check_err(what, rel_t(dh, ref.dhalo, nh), tol);
      else CHECK(dh && rel_t(dh, ref.dhalo, nh) == 0, "%s: expected zeros", what);
    } else {
      CHECK(dh == NULL, "conv %s: dhalo must be NULL without halo", k->label);
    }
    CHECK(out && gdp_tensor_dtype(out) == dt, "conv %s: out dtype", k->label);
    gdp_tensor *all[] = {x, w, bias, halo, dout, cu, out, dx, dw, db, dh};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(all[i]);
  }

  /* Only dx wanted: the other outputs are skipped, dx identical. */
  {
    gdp_tensor *x = mk(GDP_DTYPE_F64, 3, xs, d.x), *w = mk(GDP_DTYPE_F64, wnd, ws, d.w);
    gdp_tensor *bias = k->has_bias ? mk(GDP_DTYPE_F64, 1, &k->C, d.bias) : NULL;
    gdp_tensor *halo = k->has_halo ? mk(GDP_DTYPE_F64, 3, hs, d.halo) : NULL;
    gdp_tensor *dout = mk(GDP_DTYPE_F64, 3, xs, d.dout), *cu = conv_cu(k), *dx = NULL;
    CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 3, xs, &dx));
    CHECK_OK(gdp_mixer_conv1d_backward(ctx, x, w, bias, halo, cu, conv_act(k), dout, dx, NULL,
                                       NULL, NULL));
    check_err("conv dx alone", rel_t(dx, ref.dx, nx), TOL_F64);
    gdp_tensor *all[] = {x, w, bias, halo, dout, cu, dx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(all[i]);
  }

  /* Finite differences of the public forward (float64). */
  char what[160];
  snprintf(what, sizeof what, "conv %s fd dx", k->label);
  check_err(what, fd_check(conv_loss, &d, d.x, ref.dx, nx), TOL_FD);
  snprintf(what, sizeof what, "conv %s fd dweight", k->label);
  check_err(what, fd_check(conv_loss, &d, d.w, ref.dw, nw), TOL_FD);
  if (k->has_bias) {
    snprintf(what, sizeof what, "conv %s fd dbias", k->label);
    check_err(what, fd_check(conv_loss, &d, d.bias, ref.dbias, k->C), TOL_FD);
  }
  if (k->has_halo && sqrt(dot(ref.dhalo, ref.dhalo, nh)) > 0) {
    snprintf(what, sizeof what, "conv %s fd dhalo", k->label);
    check_err(what, fd_check(conv_loss, &d, d.halo, ref.dhalo, nh), TOL_FD);
  }
  free(d.x), free(d.w), free(d.bias), free(d.halo), free(d.dout);
  free(ref.out), free(ref.dx), free(ref.dw), free(ref.dbias), free(ref.dhalo);
}

/* The packed conv equals the conv of each sequence on its own (no tap crosses a start). */
static void conv_packed_equals_separate(void) {
  const int64_t C = 5, W = 4, cu[] = {0, 2, 2, 9, 10, 14};
  const int64_t T = 14, ncu = 6;
  double *x = rndn(T * C, 1), *w = rndn(C * W, 1);
  const int64_t xs[3] = {T, 1, C}, ws[2] = {C, W}, cs[1] = {ncu};
  gdp_tensor *tx = mk(GDP_DTYPE_F64, 3, xs, x), *tw = mk(GDP_DTYPE_F64, 2, ws, w), *tcu = NULL;
  gdp_tensor *packed = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 1, cs, GDP_DTYPE_I64, cu, sizeof cu, &tcu));
  CHECK_OK(gdp_mixer_conv1d_forward(ctx, tx, tw, NULL, NULL, tcu, GDP_ACT_SILU, &packed));
  double *hp = host(packed);
  double worst = 0;
  for (int64_t s = 0; s + 1 < ncu; s++) {
    const int64_t n = cu[s + 1] - cu[s];
    if (n == 0) continue;
    const int64_t ss[3] = {n, 1, C};
    gdp_tensor *xs_t = mk(GDP_DTYPE_F64, 3, ss, x + cu[s] * C), *o = NULL;
    CHECK_OK(gdp_mixer_conv1d_forward(ctx, xs_t, tw, NULL, NULL, NULL, GDP_ACT_SILU, &o));
    double *ho = host(o);
    for (int64_t i = 0; i < n * C; i++) {
      const double e = fabs(ho[i] - hp[cu[s] * C + i]);
      if (e > worst) worst = e;
    }
    free(ho);
    gdp_tensor_free(o), gdp_tensor_free(xs_t);
  }
  CHECK(worst == 0, "conv packed vs separate: max diff %.3e (expected bitwise equal)", worst);
  free(hp), free(x), free(w);
  gdp_tensor_free(tx), gdp_tensor_free(tw), gdp_tensor_free(tcu), gdp_tensor_free(packed);
}

static void test_conv1d(void) {
  const conv_case cases[] = {
      {"unpacked B=2 silu bias", 9, 2, 7, 4, 0, 0, 1, 1, 0, 0, 0, {0}},
      {"unpacked strided w3", 11, 3, 6, 4, 0, 0, 1, 0, 1, 1, 0, {0}},
      {"no act W=3", 8, 2, 5, 3, 0, 0, 0, 0, 0, 1, 0, {0}},
      {"W=1", 5, 2, 4, 1, 0, 0, 1, 1, 0, 0, 0, {0}},
      {"halo L=W-1", 7, 2, 5, 4, 3, 1, 1, 1, 1, 1, 0, {0}},
      {"halo L=2<W-1 (masked)", 7, 2, 5, 4, 2, 1, 1, 1, 0, 1, 0, {0}},
      {"halo L=6>W-1", 6, 1, 4, 4, 6, 1, 1, 0, 0, 0, 0, {0}},
      {"halo L=0", 6, 2, 3, 4, 0, 1, 1, 1, 0, 0, 0, {0}},
      {"T shorter than W, halo", 2, 2, 3, 4, 3, 1, 1, 1, 0, 0, 0, {0}},
      {"packed empty + short", 13, 1, 6, 4, 0, 0, 1, 1, 1, 1, 7, {0, 0, 3, 3, 4, 10, 13}},
      {"packed halo", 12, 1, 5, 4, 3, 1, 1, 1, 0, 1, 5, {0, 2, 2, 7, 12}},
      {"packed halo, first seq empty", 9, 1, 4, 4, 3, 1, 0, 1, 1, 0, 4, {0, 0, 5, 9}},
      {"packed trailing empties", 8, 1, 4, 4, 0, 0, 1, 0, 0, 1, 5, {0, 8, 8, 8, 8}},
      {"many channels", 6, 2, 70, 4, 3, 1, 1, 1, 0, 1, 0, {0}},
      {"T=0", 0, 2, 3, 4, 3, 1, 1, 1, 0, 0, 0, {0}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) conv_run(&cases[i]);
  conv_packed_equals_separate();
}

/* ------------------------------------------------------------------ gates */

typedef struct gate_data {
  int64_t rows, H;
  double scale;
  double *b, *a, *A_log, *dt_bias, *dbeta, *dg;
  int has_dt;
} gate_data;

static double softplus_ref(double x) { return x > 20 ? x : log(1 + exp(x)); }

static double beta_loss(void *envp) {
  gate_data *d = envp;
  const int64_t s[2] = {d->rows, d->H};
  gdp_tensor *b = mk(GDP_DTYPE_F64, 2, s, d->b), *beta = NULL;
  CHECK_OK(gdp_mixer_beta_forward(ctx, b, d->scale, &beta));
  gdp_tensor_free(b);
  return loss_of(beta, d->dbeta);
}

static double decay_loss(void *envp) {
  gate_data *d = envp;
  const int64_t s[2] = {d->rows, d->H};
  gdp_tensor *a = mk(GDP_DTYPE_F64, 2, s, d->a), *A = mk(GDP_DTYPE_F64, 1, &d->H, d->A_log);
  gdp_tensor *dt = d->has_dt ? mk(GDP_DTYPE_F64, 1, &d->H, d->dt_bias) : NULL, *g = NULL;
  CHECK_OK(gdp_mixer_decay_forward(ctx, a, A, dt, &g));
  gdp_tensor_free(a), gdp_tensor_free(A), gdp_tensor_free(dt);
  return loss_of(g, d->dg);
}

static void gates_case(int64_t rows, int64_t H, double scale, int has_dt, int strided) {
  gate_data d = {.rows = rows, .H = H, .scale = scale, .has_dt = has_dt};
  const int64_t n = rows * H;
  d.b = rndn(n, 3);
  d.a = rndn(n, 2);
  /* both sides of the softplus threshold and a deep negative tail */
  if (n > 3) d.a[0] = 25, d.a[1] = 19.5, d.a[2] = -60, d.a[3] = 20.3;
  d.A_log = rnd(H, log(0.5), log(16));
  d.dt_bias = rndn(H, 1);
  d.dbeta = rndn(n, 1);
  d.dg = rndn(n, 1);
  double *beta = malloc(8 * (size_t)n), *db = malloc(8 * (size_t)n), *g = malloc(8 * (size_t)n);
  double *da = malloc(8 * (size_t)n), *dA = calloc((size_t)H, 8), *ddt = calloc((size_t)H, 8);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t i = r * H + h;
      const double s = 1 / (1 + exp(-d.b[i]));
      beta[i] = scale * s;
      db[i] = d.dbeta[i] * scale * s * (1 - s);
      const double x = d.a[i] + (has_dt ? d.dt_bias[h] : 0), A = exp(d.A_log[h]);
      g[i] = -A * softplus_ref(x);
      da[i] = -d.dg[i] * A * (x > 20 ? 1 : 1 / (1 + exp(-x)));
      dA[h] += d.dg[i] * g[i];
      ddt[h] += da[i];
    }
  /* exactness of the threshold branch: softplus(25 + dt) is 25 + dt itself */
  const gdp_dtype dts[2] = {GDP_DTYPE_F64, GDP_DTYPE_F32};
  for (int di = 0; di < 2; di++) {
    const gdp_dtype dt = dts[di];
    const double tol = dt == GDP_DTYPE_F64 ? TOL_F64 : TOL_F32;
    const int64_t s[2] = {rows, H};
    gdp_tensor *tb = mk_any(strided, dt, 2, s, d.b), *ta = mk_any(strided, dt, 2, s, d.a);
    gdp_tensor *tA = mk_any(strided, dt, 1, &H, d.A_log);
    gdp_tensor *tdt = has_dt ? mk_any(strided, dt, 1, &H, d.dt_bias) : NULL;
    gdp_tensor *tdb = mk_any(strided, dt, 2, s, d.dbeta), *tdg = mk_any(strided, dt, 2, s, d.dg);
    gdp_tensor *obeta = NULL, *odb = NULL, *og = NULL, *oda = NULL, *odA = NULL, *oddt = NULL;
    CHECK_OK(gdp_mixer_beta_forward(ctx, tb, scale, &obeta));
    CHECK_OK(gdp_mixer_beta_backward(ctx, tb, scale, tdb, &odb));
    CHECK_OK(gdp_mixer_decay_forward(ctx, ta, tA, tdt, &og));
    CHECK_OK(gdp_mixer_decay_backward(ctx, ta, tA, tdt, tdg, &oda, &odA, &oddt));
    char what[128];
    snprintf(what, sizeof what, "beta %s scale %g", gdp_dtype_name(dt), scale);
    check_err(what, rel_t(obeta, beta, n), tol);
    snprintf(what, sizeof what, "db %s", gdp_dtype_name(dt));
    check_err(what, rel_t(odb, db, n), tol);
    snprintf(what, sizeof what, "g %s dt_bias %d", gdp_dtype_name(dt), has_dt);
    check_err(what, rel_t(og, g, n), tol);
    snprintf(what, sizeof what, "da %s", gdp_dtype_name(dt));
    check_err(what, rel_t(oda, da, n), tol);
    snprintf(what, sizeof what, "dA_log %s", gdp_dtype_name(dt));
    check_err(what, rel_t(odA, dA, H), tol);
    if (has_dt) {
      snprintf(what, sizeof what, "ddt_bias %s", gdp_dtype_name(dt));
      check_err(what, rel_t(oddt, ddt, H), tol);
    } else {
      CHECK(oddt == NULL, "ddt_bias must be NULL without dt_bias");
    }
    if (dt == GDP_DTYPE_F64 && n > 3) {
      double *hg = host(og);
      const double x0 = 25 + (has_dt ? d.dt_bias[0] : 0);
      if (x0 > 20)
        CHECK(hg[0] == -exp(d.A_log[0]) * x0, "softplus above the threshold is the identity");
      free(hg);
    }
    gdp_tensor *all[] = {tb, ta, tA, tdt, tdb, tdg, obeta, odb, og, oda, odA, oddt};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(all[i]);
  }
  check_err("fd db", fd_check(beta_loss, &d, d.b, db, n), TOL_FD);
  /* keep the finite differences away from the kink at the softplus threshold */
  if (n > 3) d.a[1] = 15, d.a[3] = 22;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t i = r * H + h;
      const double x = d.a[i] + (has_dt ? d.dt_bias[h] : 0);
      if (fabs(x - 20) < 1e-3) d.a[i] += 0.5;
    }
  /* recompute the analytic gradients at the moved points through the op itself */
  {
    const int64_t s[2] = {rows, H};
    gdp_tensor *ta = mk(GDP_DTYPE_F64, 2, s, d.a), *tA = mk(GDP_DTYPE_F64, 1, &H, d.A_log);
    gdp_tensor *tdt = has_dt ? mk(GDP_DTYPE_F64, 1, &H, d.dt_bias) : NULL;
    gdp_tensor *tdg = mk(GDP_DTYPE_F64, 2, s, d.dg), *oda = NULL, *odA = NULL, *oddt = NULL;
    CHECK_OK(gdp_mixer_decay_backward(ctx, ta, tA, tdt, tdg, &oda, &odA, &oddt));
    double *hda = host(oda), *hdA = host(odA), *hddt = host(oddt);
    check_err("fd da", fd_check(decay_loss, &d, d.a, hda, n), TOL_FD);
    check_err("fd dA_log", fd_check(decay_loss, &d, d.A_log, hdA, H), TOL_FD);
    if (has_dt) check_err("fd ddt_bias", fd_check(decay_loss, &d, d.dt_bias, hddt, H), TOL_FD);
    free(hda), free(hdA), free(hddt);
    gdp_tensor *all[] = {ta, tA, tdt, tdg, oda, odA, oddt};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(all[i]);
  }
  free(d.b), free(d.a), free(d.A_log), free(d.dt_bias), free(d.dbeta), free(d.dg);
  free(beta), free(db), free(g), free(da), free(dA), free(ddt);
}

static void test_gates(void) {
  gates_case(37, 5, 1.0, 1, 0);
  gates_case(23, 3, 2.0, 1, 1);
  gates_case(11, 4, 1.0, 0, 1);
  gates_case(3000, 16, 2.0, 1, 0); /* big enough for the threaded path */
}

/* ------------------------------------------------------------------ gated RMSNorm */

typedef struct norm_data {
  int64_t rows, d, gs;
  double eps;
  int has_z;
  double *y, *z, *w, *dout;
} norm_data;

static void norm_ref(const norm_data *n, double *out, double *dy, double *dz, double *dw) {
  const int64_t G = n->d / n->gs;
  double *x = malloc(8 * (size_t)n->gs), *dx = malloc(8 * (size_t)n->gs);
  memset(dw, 0, 8 * (size_t)n->d);
  for (int64_t r = 0; r < n->rows; r++)
    for (int64_t g = 0; g < G; g++) {
      const int64_t base = r * n->d + g * n->gs, c0 = g * n->gs;
      double ms = 0;
      for (int64_t j = 0; j < n->gs; j++) {
        const int64_t i = base + j;
        x[j] = n->y[i] * (n->has_z ? silu_ref(n->z[i]) : 1);
        ms += x[j] * x[j];
      }
      ms /= (double)n->gs;
      const double rstd = 1 / sqrt(ms + n->eps);
      /* d/dx of sum_j dout_j w_j x_j rstd, written out term by term */
      double sdx = 0;
      for (int64_t j = 0; j < n->gs; j++) sdx += n->dout[base + j] * n->w[c0 + j] * x[j];
      for (int64_t j = 0; j < n->gs; j++) {
        const int64_t i = base + j;
        out[i] = x[j] * rstd * n->w[c0 + j];
        dw[c0 + j] += n->dout[i] * x[j] * rstd;
        /* d rstd / d x_j = -rstd^3 x_j / gs */
        dx[j] = n->dout[i] * n->w[c0 + j] * rstd - sdx * rstd * rstd * rstd * x[j] / (double)n->gs;
        if (n->has_z) {
          dy[i] = dx[j] * silu_ref(n->z[i]);
          dz[i] = dx[j] * n->y[i] * silu_grad_ref(n->z[i]);
        } else {
          dy[i] = dx[j];
        }
      }
    }
  free(x), free(dx);
}

static double norm_loss(void *envp) {
  norm_data *n = envp;
  const int64_t s[2] = {n->rows, n->d};
  gdp_tensor *y = mk(GDP_DTYPE_F64, 2, s, n->y), *w = mk(GDP_DTYPE_F64, 1, &n->d, n->w);
  gdp_tensor *z = n->has_z ? mk(GDP_DTYPE_F64, 2, s, n->z) : NULL, *out = NULL;
  CHECK_OK(gdp_mixer_gated_rmsnorm_forward(ctx, y, z, w, n->gs, n->eps, &out));
  gdp_tensor_free(y), gdp_tensor_free(z), gdp_tensor_free(w);
  return loss_of(out, n->dout);
}

static void norm_case(int64_t rows, int64_t d, int64_t gs, int has_z, int strided, double eps) {
  norm_data n = {.rows = rows, .d = d, .gs = gs, .eps = eps, .has_z = has_z};
  const int64_t N = rows * d;
  n.y = rndn(N, 1);
  n.z = rndn(N, 1.5);
  n.w = rnd(d, 0.5, 1.5);
  n.dout = rndn(N, 1);
  double *out = malloc(8 * (size_t)N), *dy = malloc(8 * (size_t)N), *dz = malloc(8 * (size_t)N);
  double *dw = malloc(8 * (size_t)d);
  norm_ref(&n, out, dy, dz, dw);
  const gdp_dtype dts[2] = {GDP_DTYPE_F64, GDP_DTYPE_F32};
  for (int di = 0; di < 2; di++) {
    const gdp_dtype dt = dts[di];
    const double tol = dt == GDP_DTYPE_F64 ? TOL_F64 : TOL_F32;
    /* 3-D [rows/.., ...] view to check that leading dims are flattened */
    const int64_t s[3] = {1, rows, d};
    gdp_tensor *ty = mk_any(strided, dt, 3, s, n.y), *tz = has_z ? mk_any(strided, dt, 3, s, n.z) : NULL;
    gdp_tensor *tw = mk_any(strided, dt, 1, &d, n.w), *tdo = mk_any(strided, dt, 3, s, n.dout);
    gdp_tensor *o = NULL, *ody = NULL, *odz = NULL, *odw = NULL;
    CHECK_OK(gdp_mixer_gated_rmsnorm_forward(ctx, ty, tz, tw, gs, eps, &o));
    CHECK_OK(gdp_mixer_gated_rmsnorm_backward(ctx, ty, tz, tw, gs, eps, tdo, &ody, &odz, &odw));
    char what[128];
    snprintf(what, sizeof what, "norm %s d=%lld gs=%lld z=%d out", gdp_dtype_name(dt),
             (long long)d, (long long)gs, has_z);
    check_err(what, rel_t(o, out, N), tol);
    snprintf(what, sizeof what, "norm %s gs=%lld dy", gdp_dtype_name(dt), (long long)gs);
    check_err(what, rel_t(ody, dy, N), tol);
    if (has_z) {
      snprintf(what, sizeof what, "norm %s gs=%lld dz", gdp_dtype_name(dt), (long long)gs);
      check_err(what, rel_t(odz, dz, N), tol);
    } else {
      CHECK(odz == NULL, "norm: dz must be NULL without z");
    }
    snprintf(what, sizeof what, "norm %s gs=%lld dweight", gdp_dtype_name(dt), (long long)gs);
    check_err(what, rel_t(odw, dw, d), tol);
    gdp_tensor *all[] = {ty, tz, tw, tdo, o, ody, odz, odw};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(all[i]);
  }
  char fdw[96];
  snprintf(fdw, sizeof fdw, "norm gs=%lld eps=%g fd", (long long)gs, eps);
  check_err(fdw, fd_check(norm_loss, &n, n.y, dy, N), TOL_FD);
  if (has_z) check_err("norm fd dz", fd_check(norm_loss, &n, n.z, dz, N), TOL_FD);
  check_err("norm fd dweight", fd_check(norm_loss, &n, n.w, dw, d), TOL_FD);
  free(n.y), free(n.z), free(n.w), free(n.dout), free(out), free(dy), free(dz), free(dw);
}

static void test_norm(void) {
  norm_case(13, 12, 4, 1, 0, 1e-5);
  norm_case(9, 12, 12, 1, 1, 1e-5);
  norm_case(7, 10, 5, 0, 1, 1e-3);
  norm_case(5, 6, 1, 1, 0, 1e-2); /* gs = 1: x / sqrt(x^2 + eps) is steep near 0 for a tiny eps */
  norm_case(700, 64, 16, 1, 0, 1e-5); /* threaded path */
}

/* ------------------------------------------------------------------ repeat heads */

static void repeat_case(int64_t T, int64_t B, int64_t G, int64_t H, int64_t N, int strided,
                        gdp_dtype dt) {
  const int64_t xs[4] = {T, B, G, N}, os[4] = {T, B, H, N};
  const int64_t nx = numel(4, xs), no = numel(4, os), rep = H / G;
  double *x = rndn(nx, 1), *dout = rndn(no, 1);
  double *ref = malloc(8 * (size_t)no), *dref = calloc((size_t)nx + 1, 8);
  for (int64_t r = 0; r < T * B; r++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t k = 0; k < N; k++) {
        ref[(r * H + h) * N + k] = x[(r * G + h / rep) * N + k];
        dref[(r * G + h / rep) * N + k] += dout[(r * H + h) * N + k];
      }
  gdp_tensor *tx = mk_any(strided, dt, 4, xs, x), *td = mk_any(strided, dt, 4, os, dout);
  gdp_tensor *o = NULL, *dx = NULL;
  CHECK_OK(gdp_mixer_repeat_heads_forward(ctx, tx, H, &o));
  CHECK_OK(gdp_mixer_repeat_heads_backward(ctx, td, G, &dx));
  const double tol = dt == GDP_DTYPE_F64 ? 0 : TOL_F32;
  char what[128];
  snprintf(what, sizeof what, "repeat_heads G=%lld H=%lld %s", (long long)G, (long long)H,
           gdp_dtype_name(dt));
  check_err(what, rel_t(o, ref, no), tol);
  snprintf(what, sizeof what, "repeat_heads backward G=%lld H=%lld %s", (long long)G,
           (long long)H, gdp_dtype_name(dt));
  check_err(what, rel_t(dx, dref, nx), dt == GDP_DTYPE_F64 ? TOL_F64 : TOL_F32);
  CHECK(o && gdp_tensor_size(o, 2) == H && gdp_tensor_is_contiguous(o), "repeat_heads: out shape");
  free(x), free(dout), free(ref), free(dref);
  gdp_tensor_free(tx), gdp_tensor_free(td), gdp_tensor_free(o), gdp_tensor_free(dx);
}

static void test_repeat_heads(void) {
  repeat_case(5, 2, 2, 6, 3, 0, GDP_DTYPE_F64);
  repeat_case(4, 3, 1, 4, 5, 1, GDP_DTYPE_F64);
  repeat_case(3, 1, 4, 4, 2, 1, GDP_DTYPE_F32);
  repeat_case(6, 2, 3, 12, 4, 1, GDP_DTYPE_F32);
}

/* ------------------------------------------------------------------ D skip */

typedef struct dskip_data {
  int64_t rows, H, P, nD;
  double *y, *xv, *D, *dout;
} dskip_data;

static double dskip_loss(void *envp) {
  dskip_data *d = envp;
  const int64_t s[3] = {d->rows, d->H, d->P};
  gdp_tensor *y = mk(GDP_DTYPE_F64, 3, s, d->y), *xv = mk(GDP_DTYPE_F64, 3, s, d->xv);
  gdp_tensor *D = mk(GDP_DTYPE_F64, 1, &d->nD, d->D), *out = NULL;
  CHECK_OK(gdp_mixer_dskip_forward(ctx, y, xv, D, &out));
  gdp_tensor_free(y), gdp_tensor_free(xv), gdp_tensor_free(D);
  return loss_of(out, d->dout);
}

static void dskip_case(int64_t rows, int64_t H, int64_t P, int per_channel, int strided) {
  dskip_data d = {.rows = rows, .H = H, .P = P, .nD = per_channel ? H * P : H};
  const int64_t n = rows * H * P;
  d.y = rndn(n, 1), d.xv = rndn(n, 1), d.D = rndn(d.nD, 1), d.dout = rndn(n, 1);
  double *out = malloc(8 * (size_t)n), *dxv = malloc(8 * (size_t)n), *dD = calloc((size_t)d.nD, 8);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t p = 0; p < P; p++) {
        const int64_t i = (r * H + h) * P + p, j = per_channel ? h * P + p : h;
        out[i] = d.y[i] + d.D[j] * d.xv[i];
        dxv[i] = d.D[j] * d.dout[i];
        dD[j] += d.dout[i] * d.xv[i];
      }
  const gdp_dtype dts[2] = {GDP_DTYPE_F64, GDP_DTYPE_F32};
  for (int di = 0; di < 2; di++) {
    const gdp_dtype dt = dts[di];
    const double tol = dt == GDP_DTYPE_F64 ? TOL_F64 : TOL_F32;
    const int64_t s[3] = {rows, H, P};
    gdp_tensor *ty = mk_any(strided, dt, 3, s, d.y), *tx = mk_any(strided, dt, 3, s, d.xv);
    gdp_tensor *tD = mk_any(strided, dt, 1, &d.nD, d.D), *tdo = mk_any(strided, dt, 3, s, d.dout);
    gdp_tensor *o = NULL, *odx = NULL, *odD = NULL;
    CHECK_OK(gdp_mixer_dskip_forward(ctx, ty, tx, tD, &o));
    CHECK_OK(gdp_mixer_dskip_backward(ctx, tx, tD, tdo, &odx, &odD));
    char what[128];
    snprintf(what, sizeof what, "dskip %s per_channel %d out", gdp_dtype_name(dt), per_channel);
    check_err(what, rel_t(o, out, n), tol);
    snprintf(what, sizeof what, "dskip %s per_channel %d dx_v", gdp_dtype_name(dt), per_channel);
    check_err(what, rel_t(odx, dxv, n), tol);
    snprintf(what, sizeof what, "dskip %s per_channel %d dD", gdp_dtype_name(dt), per_channel);
    check_err(what, rel_t(odD, dD, d.nD), tol);
    gdp_tensor *all[] = {ty, tx, tD, tdo, o, odx, odD};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(all[i]);
  }
  check_err("dskip fd dx_v", fd_check(dskip_loss, &d, d.xv, dxv, n), TOL_FD);
  check_err("dskip fd dD", fd_check(dskip_loss, &d, d.D, dD, d.nD), TOL_FD);
  free(d.y), free(d.xv), free(d.D), free(d.dout), free(out), free(dxv), free(dD);
}

static void test_dskip(void) {
  dskip_case(9, 3, 4, 0, 0);
  dskip_case(7, 2, 5, 1, 1);
  dskip_case(2000, 4, 16, 1, 0);
}

/* ------------------------------------------------------------------ validation */

static void test_validation(void) {
  const int64_t xs[3] = {6, 2, 5}, ws[2] = {5, 4}, w3[3] = {5, 1, 4}, bad_w3[3] = {5, 2, 4};
  const int64_t b5[1] = {5}, b4[1] = {4}, hs[3] = {3, 2, 5}, hs_bad[3] = {3, 1, 5};
  gdp_tensor *x = NULL, *w = NULL, *wb = NULL, *wc = NULL, *bias = NULL, *bias4 = NULL;
  gdp_tensor *halo = NULL, *halo_bad = NULL, *xi = NULL, *out = NULL, *wide = NULL;
  gdp_tensor *x1 = NULL, *cu = NULL, *cu_bad = NULL, *cu_f = NULL, *d_bad = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, xs, &x));
  CHECK_OK(gdp_tensor_fill(x, 0.5));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, ws, &w));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, bad_w3, &wb));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, w3, &wc));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, b5, &bias));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, b4, &bias4));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, hs, &halo));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, hs_bad, &halo_bad));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_I32, 3, xs, &xi));
  const int64_t wide_s[2] = {5, 17};
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, wide_s, &wide));
  const int64_t x1s[3] = {6, 1, 5};
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, x1s, &x1));
  const int64_t cu_ok[3] = {0, 2, 6}, cu_dec[3] = {0, 4, 3}, n3[1] = {3};
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 1, n3, GDP_DTYPE_I64, cu_ok, sizeof cu_ok, &cu));
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 1, n3, GDP_DTYPE_I64, cu_dec, sizeof cu_dec,
                                &cu_bad));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, n3, &cu_f));
  const int64_t dbs[3] = {6, 2, 4};
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, dbs, &d_bad));

  CHECK_ERR(gdp_mixer_conv1d_forward(NULL, x, w, NULL, NULL, NULL, GDP_ACT_SILU, &out),
            GDP_ERR_INVALID_ARG, "ctx");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, NULL, w, NULL, NULL, NULL, GDP_ACT_SILU, &out),
            GDP_ERR_INVALID_ARG, "x: expected a tensor");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x, w, NULL, NULL, NULL, GDP_ACT_SILU, NULL),
            GDP_ERR_INVALID_ARG, "out");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, xi, w, NULL, NULL, NULL, GDP_ACT_SILU, &out),
            GDP_ERR_DTYPE, "x: expected dtype f64 or f32, got i32");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, w, w, NULL, NULL, NULL, GDP_ACT_SILU, &out),
            GDP_ERR_SHAPE, "x: expected 3 dims [T,B,C], got [5x4]");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x, wb, NULL, NULL, NULL, GDP_ACT_SILU, &out),
            GDP_ERR_SHAPE, "weight: expected [C,W] or [C,1,W] with C = 5, got [5x2x4]");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x, wide, NULL, NULL, NULL, GDP_ACT_SILU, &out),
            GDP_ERR_SHAPE, "width W in 1..16, got [5x17]");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x, bias4, NULL, NULL, NULL, GDP_ACT_SILU, &out),
            GDP_ERR_SHAPE, "weight");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x, w, bias4, NULL, NULL, GDP_ACT_SILU, &out),
            GDP_ERR_SHAPE, "bias: expected [C] = [5], got [4]");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x, w, bias, halo_bad, NULL, GDP_ACT_SILU, &out),
            GDP_ERR_SHAPE, "halo: expected [L,B,C] with B = 2, C = 5, got [3x1x5]");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x, w, bias, halo, NULL, (gdp_activation)7, &out),
            GDP_ERR_INVALID_ARG, "activation");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x, w, bias, halo, cu, GDP_ACT_SILU, &out),
            GDP_ERR_SHAPE, "cu_seqlens: packed sequences need B = 1, got x with B = 2");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x1, w, bias, NULL, cu_bad, GDP_ACT_SILU, &out),
            GDP_ERR_INVALID_ARG, "non-decreasing");
  CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x1, w, bias, NULL, cu_f, GDP_ACT_SILU, &out),
            GDP_ERR_DTYPE, "cu_seqlens: expected dtype i32 or i64, got f64");
  {
    const int64_t cu_short[2] = {0, 5}, n2[1] = {2};
    gdp_tensor *cs = NULL;
    CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 1, n2, GDP_DTYPE_I64, cu_short,
                                  sizeof cu_short, &cs));
    CHECK_ERR(gdp_mixer_conv1d_forward(ctx, x1, w, bias, NULL, cs, GDP_ACT_SILU, &out),
              GDP_ERR_INVALID_ARG, "expected the last entry = T = 6 (x's token count), got 5");
    gdp_tensor_free(cs);
  }
  gdp_tensor *dw_fail = NULL;
  CHECK_ERR(gdp_mixer_conv1d_backward(ctx, x, w, bias, halo, NULL, GDP_ACT_SILU, NULL, NULL,
                                      &dw_fail, NULL, NULL),
            GDP_ERR_INVALID_ARG, "d_out: expected a tensor");
  CHECK_ERR(gdp_mixer_conv1d_backward(ctx, x, w, bias, halo, NULL, GDP_ACT_SILU, d_bad, NULL,
                                      &dw_fail, NULL, NULL),
            GDP_ERR_SHAPE, "d_out: expected the shape of x [T,B,C], [6x2x5], got [6x2x4]");
  CHECK(dw_fail == NULL, "a failed backward leaves its outputs NULL");
  CHECK_ERR(gdp_mixer_conv1d_backward(ctx, x, w, bias, halo, NULL, GDP_ACT_SILU, x, d_bad,
                                      NULL, NULL, NULL),
            GDP_ERR_SHAPE, "dx: expected the shape of x [T,B,C], [6x2x5], got [6x2x4]");
  /* [C,1,W] and [C,W] weights give the same result */
  {
    gdp_tensor *o2 = NULL, *o3 = NULL;
    CHECK_OK(gdp_mixer_conv1d_forward(ctx, x, w, bias, halo, NULL, GDP_ACT_SILU, &o2));
    CHECK_OK(gdp_mixer_conv1d_forward(ctx, x, wc, bias, halo, NULL, GDP_ACT_SILU, &o3));
    double e = NAN;
    if (o2 && o3) CHECK_OK(gdp_tensor_rel_error(o3, o2, &e));
    CHECK(e == 0, "weight [C,1,W] vs [C,W]: %.3e", e);
    gdp_tensor_free(o2), gdp_tensor_free(o3);
  }

  /* gates */
  const int64_t as[2] = {4, 3}, h3[1] = {3}, h2[1] = {2};
  gdp_tensor *a = NULL, *A3 = NULL, *A2 = NULL, *g = NULL, *da = NULL, *dA = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 2, as, &a));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, h3, &A3));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F32, 1, h2, &A2));
  CHECK_ERR(gdp_mixer_decay_forward(ctx, a, A2, NULL, &g), GDP_ERR_SHAPE,
            "A_log: expected [H] (a's last dim) = [3], got [2]");
  CHECK_ERR(gdp_mixer_decay_forward(ctx, a, A3, A2, &g), GDP_ERR_SHAPE,
            "dt_bias: expected [H] (a's last dim) = [3], got [2]");
  CHECK_ERR(gdp_mixer_decay_forward(ctx, a, NULL, NULL, &g), GDP_ERR_INVALID_ARG,
            "A_log: expected a tensor, got NULL");
  CHECK_ERR(gdp_mixer_decay_backward(ctx, a, A3, NULL, A3, &da, &dA, NULL), GDP_ERR_SHAPE,
            "d_g: expected the shape of a, [4x3], got [3]");
  CHECK_ERR(gdp_mixer_beta_forward(ctx, xi, 1.0, &g), GDP_ERR_DTYPE, "b: expected dtype f64 or f32");
  CHECK_ERR(gdp_mixer_beta_forward(ctx, a, NAN, &g), GDP_ERR_INVALID_ARG, "beta_scale");
  CHECK_ERR(gdp_mixer_beta_backward(ctx, a, 1.0, A3, &g), GDP_ERR_SHAPE, "d_beta");

  /* norm */
  CHECK_ERR(gdp_mixer_gated_rmsnorm_forward(ctx, a, NULL, A3, 2, 1e-5, &g), GDP_ERR_INVALID_ARG,
            "group_size: expected a divisor of d = 3 (y's last dim), got 2");
  CHECK_ERR(gdp_mixer_gated_rmsnorm_forward(ctx, a, NULL, A2, 3, 1e-5, &g), GDP_ERR_SHAPE,
            "weight: expected [d] (y's last dim) = [3], got [2]");
  CHECK_ERR(gdp_mixer_gated_rmsnorm_forward(ctx, a, A3, A3, 3, 1e-5, &g), GDP_ERR_SHAPE,
            "z: expected the shape of y, [4x3], got [3]");
  CHECK_ERR(gdp_mixer_gated_rmsnorm_forward(ctx, a, NULL, A3, 3, -1, &g), GDP_ERR_INVALID_ARG,
            "eps");

  /* repeat heads, D skip */
  const int64_t qs[3] = {4, 3, 2}, Ds[1] = {5};
  gdp_tensor *q = NULL, *D5 = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, qs, &q));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 1, Ds, &D5));
  CHECK_ERR(gdp_mixer_repeat_heads_forward(ctx, q, 4, &g), GDP_ERR_SHAPE,
            "num_heads: expected a multiple of the group count G = 3");
  CHECK_ERR(gdp_mixer_repeat_heads_forward(ctx, bias, 4, &g), GDP_ERR_SHAPE,
            "x: expected 2..7 dims [...,G,N], got [5]");
  CHECK_ERR(gdp_mixer_repeat_heads_backward(ctx, q, 2, &g), GDP_ERR_SHAPE,
            "num_groups: expected a divisor of the head count H = 3");
  CHECK_ERR(gdp_mixer_repeat_heads_backward(ctx, q, 0, &g), GDP_ERR_INVALID_ARG,
            "num_groups: expected >= 1, got 0");
  CHECK_ERR(gdp_mixer_dskip_forward(ctx, q, q, D5, &g), GDP_ERR_SHAPE,
            "D: expected H = 3 values (per head) or H*P = 6 (per channel)");
  CHECK_ERR(gdp_mixer_dskip_forward(ctx, q, x, bias, &g), GDP_ERR_SHAPE, "x_v");

  /* input stage: nh = 2 heads of P = 2, one group of N = 2, M = 1 (xBC 4 + 2 + 2 wide) */
  const int64_t xbs[3] = {3, 1, 8}, bbs[3] = {3, 1, 2};
  gdp_tensor *xBC = NULL, *bb = NULL, *iq = NULL, *ik = NULL, *iv = NULL, *ib = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, xbs, &xBC));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, bbs, &bb));
  CHECK_ERR(gdp_mixer_ssm_inputs_forward(ctx, xBC, bb, NULL, NULL, NULL, 2, 2, 1, 2, 1, 1.0, 2, &iq,
                                         &ik, &iv, &ib, NULL),
            GDP_ERR_INVALID_ARG, "silu: expected 0 or 1, got 2");
  CHECK(iq == NULL && ik == NULL && iv == NULL && ib == NULL, "ssm_inputs: outputs set on an error");

  gdp_tensor *all[] = {x, w, wb, wc, bias, bias4, halo, halo_bad, xi, wide, x1, cu, cu_bad,
                       cu_f, d_bad, a, A3, A2, q, D5, xBC, bb};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(all[i]);
}

int main(void) {
  TEST_BEGIN(20250607);
  if (gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx) != GDP_OK) {
    printf("cannot make a cpu context: %s\n", gdp_last_error());
    return 1;
  }
  test_conv1d();
  test_gates();
  test_norm();
  test_repeat_heads();
  test_dskip();
  test_validation();
  gdp_ctx_free(ctx);
  TEST_END();
}
