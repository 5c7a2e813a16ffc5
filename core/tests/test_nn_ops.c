/*
 * test_nn_ops.c -- the model layer ops (gdp.h, "model layer ops") on the cpu, under the
 * sanitizers as well: each op against a plain float64 loop written here, in float64
 * (<= 1e-12) and float32 (<= 1e-5), on a transposed (non-contiguous) input; the error
 * paths (a token or target out of range, bad dtypes and shapes) by status and message,
 * so that the sanitizers see them release everything.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

static gdp_ctx *ctx;

static const double TOL[2] = {1e-12, 1e-5}; /* f64, f32 */
static const gdp_dtype FLOATS[2] = {GDP_DTYPE_F64, GDP_DTYPE_F32};

/* A [rows, cols] tensor of `dt` holding x (row-major), made as the transpose of a
 * [cols, rows] tensor when `transposed`, so that it is not contiguous. */
static gdp_tensor *matrix(gdp_dtype dt, int64_t rows, int64_t cols, const double *x,
                          int transposed) {
  gdp_tensor *t = NULL;
  if (!transposed) {
    const int64_t shape[2] = {rows, cols};
    CHECK_OK(gdp_tensor_from_host(ctx, dt, 2, shape, GDP_DTYPE_F64, x,
                                  (size_t)(rows * cols) * sizeof(double), &t));
    return t;
  }
  double *xt = malloc((size_t)(rows * cols) * sizeof(double));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) xt[c * rows + r] = x[r * cols + c];
  gdp_tensor *base = matrix(dt, cols, rows, xt, 0);
  CHECK_OK(gdp_tensor_transpose(base, 0, 1, &t));
  CHECK(!gdp_tensor_is_contiguous(t), "expected a non-contiguous view");
  gdp_tensor_free(base);
  free(xt);
  return t;
}

static gdp_tensor *indices(gdp_dtype dt, int64_t n, const int64_t *v) {
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, dt, 1, &n, GDP_DTYPE_I64, v, (size_t)n * sizeof(int64_t), &t));
  return t;
}

/* ||t - ref|| / ||ref|| (NaN when t is missing or has another size); frees t. */
static double err_of(gdp_tensor *t, const double *ref, int64_t n) {
  if (!t || gdp_tensor_numel(t) != n) {
    gdp_tensor_free(t);
    return NAN;
  }
  double *h = malloc((size_t)n * sizeof(double));
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_F64, h, (size_t)n * sizeof(double)));
  const double e = tu_rel_err_f64(h, ref, n);
  free(h);
  gdp_tensor_free(t);
  return e;
}

static double *normals(int64_t n, double sd) {
  double *x = malloc((size_t)n * sizeof(double));
  for (int64_t i = 0; i < n; i++) x[i] = sd * tu_rand_normal();
  return x;
}

/* ------------------------------------------------------------------ SwiGLU gate */

static void test_silu_mul(void) {
  enum { R = 7, C = 13, N = R * C };
  double *g = normals(N, 2), *u = normals(N, 1), *d = normals(N, 1);
  double want[N], wdg[N], wdu[N];
  for (int i = 0; i < N; i++) {
    const double s = 1 / (1 + exp(-g[i]));
    want[i] = g[i] * s * u[i];
    wdu[i] = d[i] * g[i] * s;
    wdg[i] = d[i] * u[i] * s * (1 + g[i] * (1 - s));
  }
  for (int k = 0; k < 2; k++) {
    gdp_tensor *tg = matrix(FLOATS[k], R, C, g, 1), *tu = matrix(FLOATS[k], R, C, u, 0);
    gdp_tensor *td = matrix(FLOATS[k], R, C, d, 1), *out = NULL, *dg = NULL, *du = NULL;
    CHECK_OK(gdp_nn_silu_mul_forward(ctx, tg, tu, &out));
    double e = err_of(out, want, N);
    CHECK(e <= TOL[k], "silu_mul forward %s: %.3e", gdp_dtype_name(FLOATS[k]), e);
    CHECK_OK(gdp_nn_silu_mul_backward(ctx, tg, tu, td, &dg, &du));
    e = err_of(dg, wdg, N);
    CHECK(e <= TOL[k], "silu_mul d_gate %s: %.3e", gdp_dtype_name(FLOATS[k]), e);
    e = err_of(du, wdu, N);
    CHECK(e <= TOL[k], "silu_mul d_up %s: %.3e", gdp_dtype_name(FLOATS[k]), e);
    CHECK_OK(gdp_nn_silu_mul_backward(ctx, tg, tu, td, NULL, &du)); /* one result only */
    e = err_of(du, wdu, N);
    CHECK(e <= TOL[k], "silu_mul d_up alone %s: %.3e", gdp_dtype_name(FLOATS[k]), e);
    gdp_tensor *bad = matrix(FLOATS[k], C, R, u, 0);
    CHECK_ERR(gdp_nn_silu_mul_forward(ctx, tg, bad, &out), GDP_ERR_SHAPE,
              "up: expected the shape of gate, [7x13], got [13x7]");
    gdp_tensor_free(bad);
    gdp_tensor_free(tg);
    gdp_tensor_free(tu);
    gdp_tensor_free(td);
  }
  free(g);
  free(u);
  free(d);
}

/* ------------------------------------------------------------------ embedding */

static void test_embedding(void) {
  enum { V = 9, D = 6, N = 40 };
  int64_t tok[N];
  for (int i = 0; i < N; i++) tok[i] = (int64_t)(tu_rand_u64() % (V - 2)); /* rows V-2, V-1 unused */
  tok[3] = tok[17] = tok[30] = 4;
  double *w = normals(V * D, 1), *d = normals(N * D, 1);
  double want[N * D], wdw[V * D];
  memset(wdw, 0, sizeof wdw);
  for (int i = 0; i < N; i++)
    for (int j = 0; j < D; j++) {
      want[i * D + j] = w[tok[i] * D + j];
      wdw[tok[i] * D + j] += d[i * D + j];
    }
  gdp_tensor *t32 = indices(GDP_DTYPE_I32, N, tok), *t64 = indices(GDP_DTYPE_I64, N, tok);
  for (int k = 0; k < 2; k++) {
    gdp_tensor *tw = matrix(FLOATS[k], V, D, w, 1), *td = matrix(FLOATS[k], N, D, d, 1);
    gdp_tensor *out = NULL, *dw = NULL;
    CHECK_OK(gdp_nn_embedding_forward(ctx, tw, k ? t32 : t64, &out));
    double e = err_of(out, want, N * D);
    CHECK(e <= TOL[k], "embedding forward %s: %.3e", gdp_dtype_name(FLOATS[k]), e);
    CHECK_OK(gdp_nn_embedding_backward(ctx, k ? t64 : t32, td, V, &dw));
    CHECK(dw && gdp_tensor_dtype(dw) == FLOATS[k], "embedding dweight dtype");
    e = err_of(dw, wdw, V * D);
    CHECK(e <= TOL[k], "embedding backward %s: %.3e", gdp_dtype_name(FLOATS[k]), e);
    gdp_tensor_free(tw);
    gdp_tensor_free(td);
  }
  /* errors: a token out of range (after the host copy was made), dtypes, shapes */
  gdp_tensor *tw = matrix(GDP_DTYPE_F64, V, D, w, 0), *td = matrix(GDP_DTYPE_F64, N, D, d, 0);
  gdp_tensor *out = NULL;
  int64_t bad[3] = {0, V, 1};
  gdp_tensor *tb = indices(GDP_DTYPE_I64, 3, bad);
  CHECK_ERR(gdp_nn_embedding_forward(ctx, tw, tb, &out), GDP_ERR_INVALID_ARG,
            "tokens: expected values in [0, 9) (num_embeddings), got 9 at [1]");
  CHECK(out == NULL, "no output after an error");
  { /* a transposed view: its position and the viewed tensor's */
    const int64_t ids[6] = {0, 1, 2, 3, 4, V}, shape[2] = {2, 3};
    gdp_tensor *base = NULL, *view = NULL;
    CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 2, shape, GDP_DTYPE_I64, ids, sizeof ids, &base));
    CHECK_OK(gdp_tensor_transpose(base, 0, 1, &view));
    CHECK_ERR(gdp_nn_embedding_forward(ctx, tw, view, &out), GDP_ERR_INVALID_ARG,
              "got 9 at [2,1] (a permuted view: [1,2] in the tensor it views)");
    CHECK_ERR(gdp_nn_embedding_forward(ctx, tw, base, &out), GDP_ERR_INVALID_ARG, "got 9 at [1,2]");
    CHECK(strstr(gdp_last_error(), "permuted") == NULL, "no view, one position: %s", gdp_last_error());
    gdp_tensor_free(view);
    gdp_tensor_free(base);
  }
  CHECK_ERR(gdp_nn_embedding_backward(ctx, t64, td, V - 5, &out), GDP_ERR_INVALID_ARG,
            "tokens: expected values in [0, 4) (num_embeddings)");
  CHECK_ERR(gdp_nn_embedding_forward(ctx, tw, td, &out), GDP_ERR_DTYPE,
            "tokens: expected dtype i32 or i64, got f64");
  CHECK_ERR(gdp_nn_embedding_backward(ctx, tb, td, V, &out), GDP_ERR_SHAPE,
            "tokens: expected the leading dims of d_out, [40], got [3]");
  CHECK_ERR(gdp_nn_embedding_forward(NULL, tw, t64, &out), GDP_ERR_INVALID_ARG,
            "ctx: expected a context, got NULL");
  gdp_tensor_free(tb);
  gdp_tensor_free(tw);
  gdp_tensor_free(td);
  gdp_tensor_free(t32);
  gdp_tensor_free(t64);
  free(w);
  free(d);
}

/* ------------------------------------------------------------------ cross-entropy */

static void test_cross_entropy(void) {
  enum { R = 23, V = 17 };
  int64_t tg[R];
  double mask[R];
  for (int r = 0; r < R; r++) {
    tg[r] = (int64_t)(tu_rand_u64() % V);
    mask[r] = r % 5 == 3 ? 0.0 : 1.0;
  }
  tg[2] = tg[11] = -100;
  double *x = normals(R * V, 25); /* exp would overflow without the max subtracted */
  double want_grad[R * V], loss_sum = 0;
  int64_t count = 0;
  for (int r = 0; r < R; r++) count += tg[r] != -100 && mask[r] != 0;
  for (int r = 0; r < R; r++) {
    const int counted = tg[r] != -100 && mask[r] != 0;
    double m = x[r * V];
    for (int j = 1; j < V; j++) m = fmax(m, x[r * V + j]);
    double s = 0;
    for (int j = 0; j < V; j++) s += exp(x[r * V + j] - m);
    const double lse = m + log(s);
    if (counted) loss_sum += lse - x[r * V + tg[r]];
    for (int j = 0; j < V; j++)
      want_grad[r * V + j] = counted ? (exp(x[r * V + j] - lse) - (j == tg[r])) / (double)count : 0;
  }
  const double want_loss = loss_sum / (double)count;
  gdp_tensor *tt = indices(GDP_DTYPE_I32, R, tg), *tm = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_F32, 1, (const int64_t[]){R}, GDP_DTYPE_F64, mask,
                                sizeof mask, &tm));
  for (int k = 0; k < 2; k++) {
    gdp_tensor *tx = matrix(FLOATS[k], R, V, x, 1), *dx = NULL;
    double loss = NAN;
    int64_t n = -1;
    CHECK_OK(gdp_nn_cross_entropy(ctx, tx, tt, tm, -100, &loss, &n, &dx));
    CHECK(n == count, "cross_entropy count %lld, want %lld", (long long)n, (long long)count);
    CHECK(fabs(loss - want_loss) <= TOL[k] * want_loss, "cross_entropy loss %s: %.15g, want %.15g",
          gdp_dtype_name(FLOATS[k]), loss, want_loss);
    const double e = err_of(dx, want_grad, R * V);
    CHECK(e <= TOL[k], "cross_entropy dlogits %s: %.3e", gdp_dtype_name(FLOATS[k]), e);
    CHECK_OK(gdp_nn_cross_entropy(ctx, tx, tt, tm, -100, &loss, NULL, NULL));
    CHECK(fabs(loss - want_loss) <= TOL[k] * want_loss, "cross_entropy loss without dlogits");
    gdp_tensor_free(tx);
  }
  gdp_tensor *tx = matrix(GDP_DTYPE_F64, R, V, x, 0), *dx = NULL;
  double loss = 1;
  int64_t n = 1;
  int64_t none[R];
  for (int r = 0; r < R; r++) none[r] = -1;
  gdp_tensor *tn = indices(GDP_DTYPE_I64, R, none);
  CHECK_OK(gdp_nn_cross_entropy(ctx, tx, tn, NULL, -1, &loss, &n, &dx));
  CHECK(loss == 0 && n == 0, "no counted row: loss %g, count %lld", loss, (long long)n);
  double mx = -1;
  if (dx) CHECK_OK(gdp_tensor_max_abs(dx, &mx));
  CHECK(mx == 0, "no counted row: dlogits zero, max %g", mx);
  gdp_tensor_free(dx);
  dx = NULL;
  tg[7] = V;
  gdp_tensor *tbad = indices(GDP_DTYPE_I64, R, tg);
  CHECK_ERR(gdp_nn_cross_entropy(ctx, tx, tbad, NULL, -100, &loss, &n, &dx), GDP_ERR_INVALID_ARG,
            "targets: expected values in [0, 17) (logits' last dim) or ignore_index = -100, got 17 at [7]");
  CHECK(dx == NULL && loss == 0 && n == 0, "no results after an error");
  CHECK_ERR(gdp_nn_cross_entropy(ctx, tx, tm, NULL, -100, &loss, &n, &dx), GDP_ERR_DTYPE,
            "targets: expected dtype i32 or i64, got f32");
  gdp_tensor *short_mask = indices(GDP_DTYPE_I64, 3, (const int64_t[]){1, 1, 1});
  CHECK_ERR(gdp_nn_cross_entropy(ctx, tx, tt, short_mask, -100, &loss, &n, &dx), GDP_ERR_SHAPE,
            "mask: expected the shape of targets, [23], got [3]");
  gdp_tensor_free(short_mask);
  gdp_tensor_free(tbad);
  gdp_tensor_free(tn);
  gdp_tensor_free(tx);
  gdp_tensor_free(tt);
  gdp_tensor_free(tm);
  free(x);
}

int main(void) {
  TEST_BEGIN(20261202);
  if (gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx) != GDP_OK) {
    printf("cannot make a cpu context: %s\n", gdp_last_error());
    return 1;
  }
  test_silu_mul();
  test_embedding();
  test_cross_entropy();
  gdp_ctx_free(ctx);
  TEST_END();
}
