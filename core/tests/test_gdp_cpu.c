/*
 * test_gdp_cpu.c -- the GDP operator on the cpu backend, through the C API.  The case
 * table of the operator (shapes, n, gated, packed, dtypes, chunk sizes, saving) and the
 * golden cases run on every device in spec/gdp_op_spec.lua; this file keeps what the
 * table does not check, and runs under the sanitizer pass:
 *   (b) finite differences of the float64 oracle's backward (through the public op, so
 *       the L2 norm's backward is covered too) on small random problems;
 *   (c) one packed problem through the op's chunk path at odd chunk sizes (1, and past
 *       any sequence: the workspaces are sized by the steps a chunk holds; 2^40 squared
 *       overflows size_t) in float64 and float32;
 *   (d) every validation error path: status and a message substring;
 *   strided inputs, unwanted outputs, num_threads, the options struct.
 */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

#define TOL_F64 1e-10
#define TOL_F32 1e-4

static gdp_ctx *ctx;

/* ------------------------------------------------------------------ helpers */

static double *host_f64(const gdp_tensor *t) {
  const int64_t n = gdp_tensor_numel(t);
  double *h = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  if (h && gdp_tensor_to_host(t, GDP_DTYPE_F64, h, (size_t)n * sizeof(double)) != GDP_OK) {
    free(h);
    return NULL;
  }
  return h;
}

/* ||a - ref|| / ||ref|| over host copies (NaN when either is missing or non-finite). */
static double rel_err(const gdp_tensor *a, const gdp_tensor *ref) {
  if (!a || !ref || gdp_tensor_numel(a) != gdp_tensor_numel(ref)) return NAN;
  double *ha = host_f64(a), *hr = host_f64(ref);
  double e = (ha && hr) ? tu_rel_err_f64(ha, hr, gdp_tensor_numel(ref)) : NAN;
  free(ha);
  free(hr);
  return e;
}

static int same_shape(const gdp_tensor *a, const gdp_tensor *b) {
  if (gdp_tensor_ndim(a) != gdp_tensor_ndim(b)) return 0;
  for (int i = 0; i < gdp_tensor_ndim(a); i++)
    if (gdp_tensor_size(a, i) != gdp_tensor_size(b, i)) return 0;
  return 1;
}

static gdp_tensor *from_host(gdp_dtype dtype, int ndim, const int64_t *shape, const double *x) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, dtype, ndim, shape, GDP_DTYPE_F64, x,
                                (size_t)n * sizeof(double), &t));
  return t;
}

/* The operator's inputs and results as tensors (any may be NULL). */
typedef struct op_in {
  gdp_tensor *q, *k, *v, *g, *beta, *h0, *cu, *d_o, *dht;
} op_in;
typedef struct op_out {
  gdp_tensor *o, *ht, *dq, *dk, *dv, *dbeta, *dg, *dh0;
} op_out;
static const char *out_names[8] = {"o", "ht", "dq", "dk", "dv", "dbeta", "dg", "dh0"};

static void op_in_free(op_in *in) {
  gdp_tensor **all[] = {&in->q, &in->k, &in->v, &in->g, &in->beta,
                        &in->h0, &in->cu, &in->d_o, &in->dht};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(*all[i]), *all[i] = NULL;
}
static gdp_tensor **out_slot(op_out *out, int i) { return &out->o + i; }
static void op_out_free(op_out *out) {
  for (int i = 0; i < 8; i++) gdp_tensor_free(*out_slot(out, i)), *out_slot(out, i) = NULL;
}

/* Forward (with ht when dht is given or want_ht) and backward. */
static gdp_status run_op(const gdp_delta_product_options *opts_in, const op_in *in, int want_ht,
                         op_out *out) {
  memset(out, 0, sizeof *out);
  gdp_delta_product_options opts = *opts_in;
  opts.output_final_state = want_ht;
  gdp_status s = gdp_delta_product_forward(ctx, &opts, in->q, in->k, in->v, in->g, in->beta, in->h0, in->cu,
                                 &out->o, want_ht ? &out->ht : NULL);
  if (s != GDP_OK) return s;
  return gdp_delta_product_backward(ctx, &opts, in->q, in->k, in->v, in->g, in->beta, in->h0, in->cu,
                          in->d_o, in->dht, &out->dq, &out->dk, &out->dv, &out->dbeta, &out->dg,
                          &out->dh0);
}

/* Every result present in `ref` must be present in `got`, same shape, within tol; and
 * the optional ones (ht, dg, dh0) absent exactly when absent in ref.  Returns the
 * largest error. */
static double compare_out(const char *label, const op_out *got, const op_out *ref, double tol,
                          gdp_dtype want_dtype) {
  double worst = 0.0;
  char line[512];
  int len = snprintf(line, sizeof line, "%s:", label);
  for (int i = 0; i < 8; i++) {
    const gdp_tensor *a = *out_slot((op_out *)got, i), *r = *out_slot((op_out *)ref, i);
    CHECK((a == NULL) == (r == NULL), "%s: %s is %s, reference %s", label, out_names[i],
          a ? "present" : "NULL", r ? "present" : "NULL");
    if (!a || !r) continue;
    CHECK(same_shape(a, r), "%s: %s shape differs from the reference", label, out_names[i]);
    const gdp_dtype dt = gdp_tensor_dtype(a);
    const int is_state = i == 1 || i == 7;
    const gdp_dtype expect = is_state ? (want_dtype == GDP_DTYPE_F64 ? GDP_DTYPE_F64 : GDP_DTYPE_F32)
                                      : want_dtype;
    CHECK(dt == expect, "%s: %s has dtype %s, expected %s", label, out_names[i],
          gdp_dtype_name(dt), gdp_dtype_name(expect));
    const double e = rel_err(a, r);
    CHECK(e <= tol, "%s: %s relative error %.3g > %.1g", label, out_names[i], e, tol);
    if (!(e <= worst)) worst = e; /* NaN sticks */
    if (len < (int)sizeof line) len += snprintf(line + len, sizeof line - len, " %s %.2g", out_names[i], e);
  }
  printf("  %s\n", line);
  return worst;
}

/* A copy of t in `dtype` (NULL stays NULL). */
static gdp_tensor *convert(const gdp_tensor *t, gdp_dtype dtype) {
  if (!t) return NULL;
  gdp_tensor *out = NULL;
  CHECK_OK(gdp_tensor_to(ctx, t, dtype, &out));
  return out;
}

/* ------------------------------------------------------------------ random problems */

/* A problem held as host float64 arrays, turned into tensors of any dtype on demand. */
typedef struct problem {
  int64_t B, T, H, K, V, n;
  int64_t N;   /* sequences: set with cu; B when unpacked */
  int64_t *cu; /* NULL: unpacked, else N+1 entries */
  int gated, with_h0, with_dht, l2norm;
  double beta_max;
  double *x[8]; /* q k v g beta h0 d_o dht (NULL when absent) */
  int64_t numel[8];
} problem;
enum { X_Q, X_K, X_V, X_G, X_BETA, X_H0, X_DO, X_DHT };

static void problem_shape(const problem *p, int which, int *ndim, int64_t shape[4]) {
  const int64_t B = p->B, T = p->T, H = p->H, K = p->K, V = p->V, Tn = p->T * p->n;
  const int64_t s[8][4] = {{B, T, H, K}, {B, Tn, H, K}, {B, Tn, H, V}, {B, T, H, 0},
                           {B, Tn, H, 0}, {p->N, H, K, V}, {B, T, H, V}, {p->N, H, K, V}};
  *ndim = (which == X_G || which == X_BETA) ? 3 : 4;
  memcpy(shape, s[which], sizeof s[which]);
}

/* Fresh random inputs.  Unnormalised keys are scaled to unit norm when the op does not
 * normalise them, so that the recurrence stays contractive (beta |k|^2 <= 2). */
static void problem_fill(problem *p) {
  if (!p->cu) p->N = p->B;
  for (int w = 0; w < 8; w++) {
    int ndim;
    int64_t shape[4], n = 1;
    problem_shape(p, w, &ndim, shape);
    for (int i = 0; i < ndim; i++) n *= shape[i];
    p->numel[w] = n;
    const int present = (w == X_G && p->gated) || (w == X_H0 && p->with_h0) ||
                        (w == X_DHT && p->with_dht) || (w != X_G && w != X_H0 && w != X_DHT);
    p->x[w] = NULL;
    if (!present) continue;
    p->x[w] = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++) {
      switch (w) {
      case X_G: p->x[w][i] = log(tu_rand_uniform(0.85, 0.999)); break;
      case X_BETA: p->x[w][i] = tu_rand_uniform(0.05, p->beta_max); break;
      case X_H0: p->x[w][i] = 0.5 * tu_rand_normal(); break;
      default: p->x[w][i] = tu_rand_normal(); break;
      }
    }
    if ((w == X_K || w == X_Q) && !p->l2norm) {
      for (int64_t r = 0; r < n / p->K; r++) {
        double ss = 0.0;
        for (int64_t c = 0; c < p->K; c++) ss += p->x[w][r * p->K + c] * p->x[w][r * p->K + c];
        for (int64_t c = 0; c < p->K; c++) p->x[w][r * p->K + c] /= sqrt(ss);
      }
    }
  }
}

static void problem_free(problem *p) {
  for (int w = 0; w < 8; w++) free(p->x[w]), p->x[w] = NULL;
}

/* Tensors of the problem in `dtype`; input `which` (or -1) replaced by x + eps dir. */
static void problem_tensors(const problem *p, gdp_dtype dtype, int which, const double *dir,
                            double eps, op_in *in) {
  gdp_tensor **slots[8] = {&in->q, &in->k, &in->v, &in->g, &in->beta, &in->h0, &in->d_o, &in->dht};
  memset(in, 0, sizeof *in);
  for (int w = 0; w < 8; w++) {
    if (!p->x[w]) continue;
    int ndim;
    int64_t shape[4];
    problem_shape(p, w, &ndim, shape);
    const double *src = p->x[w];
    double *tmp = NULL;
    if (w == which) {
      tmp = malloc((size_t)(p->numel[w] > 0 ? p->numel[w] : 1) * sizeof(double));
      for (int64_t i = 0; i < p->numel[w]; i++) tmp[i] = src[i] + eps * dir[i];
      src = tmp;
    }
    const gdp_dtype dt =
        (w == X_H0 || w == X_DHT) ? (dtype == GDP_DTYPE_F64 ? GDP_DTYPE_F64 : GDP_DTYPE_F32) : dtype;
    *slots[w] = from_host(dt, ndim, shape, src);
    free(tmp);
  }
  if (p->cu) {
    const int64_t shape[1] = {p->N + 1};
    CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 1, shape, GDP_DTYPE_I64, p->cu,
                                  (size_t)(p->N + 1) * sizeof(int64_t), &in->cu));
  }
}

static gdp_delta_product_options problem_opts(const problem *p, int algorithm, int64_t chunk) {
  gdp_delta_product_options o;
  gdp_delta_product_options_init(&o);
  o.num_householder = p->n;
  o.use_qk_l2norm = p->l2norm;
  o.algorithm = algorithm;
  o.chunk_size = chunk;
  return o;
}

static double dot_host(const gdp_tensor *a, const double *b) {
  double *h = host_f64(a), s = 0.0;
  if (!h) return NAN;
  for (int64_t i = 0; i < gdp_tensor_numel(a); i++) s += h[i] * b[i];
  free(h);
  return s;
}

/* loss = sum(o dO) + sum(ht dht) with input `which` moved by eps along dir. */
static double loss_at(const problem *p, int which, const double *dir, double eps) {
  op_in in;
  problem_tensors(p, GDP_DTYPE_F64, which, dir, eps, &in);
  gdp_delta_product_options opts = problem_opts(p, GDP_ALGO_RECURRENT, 0);
  opts.output_final_state = p->with_dht;
  gdp_tensor *o = NULL, *ht = NULL;
  double loss = NAN;
  gdp_status s = gdp_delta_product_forward(ctx, &opts, in.q, in.k, in.v, in.g, in.beta, in.h0, in.cu, &o,
                                 p->with_dht ? &ht : NULL);
  CHECK(s == GDP_OK, "loss_at: %s", gdp_last_error());
  if (s == GDP_OK) loss = dot_host(o, p->x[X_DO]) + (ht ? dot_host(ht, p->x[X_DHT]) : 0.0);
  gdp_tensor_free(o);
  gdp_tensor_free(ht);
  op_in_free(&in);
  return loss;
}

/* ------------------------------------------------------------------ (b) finite differences */

static void fd_case(const char *label, problem *p) {
  problem_fill(p);
  op_in in;
  problem_tensors(p, GDP_DTYPE_F64, -1, NULL, 0.0, &in);
  gdp_delta_product_options opts = problem_opts(p, GDP_ALGO_RECURRENT, 0);
  op_out got;
  gdp_status s = run_op(&opts, &in, p->with_dht, &got);
  CHECK(s == GDP_OK, "%s: %s", label, gdp_last_error());
  /* gradient of input w: q k v g beta h0 -> dq dk dv dg dbeta dh0 */
  const gdp_tensor *grad[6] = {got.dq, got.dk, got.dv, got.dg, got.dbeta, got.dh0};
  static const char *names[6] = {"q", "k", "v", "g", "beta", "h0"};
  char line[512];
  int len = snprintf(line, sizeof line, "%s:", label);
  for (int w = 0; s == GDP_OK && w < 6; w++) {
    CHECK((grad[w] != NULL) == (p->x[w] != NULL), "%s: d%s presence", label, names[w]);
    if (!p->x[w] || !grad[w]) continue;
    double *dir = malloc((size_t)(p->numel[w] > 0 ? p->numel[w] : 1) * sizeof(double));
    for (int64_t i = 0; i < p->numel[w]; i++) dir[i] = tu_rand_normal();
    /* Five-point central difference: truncation O(eps^4), so a large eps keeps the
     * cancellation error small too. */
    const double eps = 1e-3;
    const double fd = (8.0 * (loss_at(p, w, dir, eps) - loss_at(p, w, dir, -eps)) -
                       (loss_at(p, w, dir, 2 * eps) - loss_at(p, w, dir, -2 * eps))) /
                      (12.0 * eps);
    const double an = dot_host(grad[w], dir);
    const double err = fabs(fd - an) / fmax(fabs(an), 1e-12);
    CHECK(err <= 1e-7, "%s: d%s . dir = %.12g, finite difference %.12g (relative %.3g)", label,
          names[w], an, fd, err);
    if (len < (int)sizeof line) len += snprintf(line + len, sizeof line - len, " d%s %.1e", names[w], err);
    free(dir);
  }
  printf("  %s\n", line);
  op_out_free(&got);
  op_in_free(&in);
  problem_free(p);
}

static void test_finite_differences(void) {
  printf("(b) finite differences of the float64 oracle\n");
  int64_t cu_empty[] = {0, 3, 3, 9, 9}; /* an empty sequence inside and one at the end */
  for (int64_t n = 1; n <= 4; n++) {
    for (int gated = 0; gated <= 1; gated++) {
      problem p = {.B = 2, .T = 5, .H = 2, .K = 5, .V = 7, .n = n, .gated = gated,
                   .with_h0 = 1, .with_dht = 1, .l2norm = 1, .beta_max = gated ? 1.0 : 2.0};
      char label[96];
      snprintf(label, sizeof label, "n=%lld %s B=2 T=5 K=5 V=7 h0 dht l2norm", (long long)n,
               gated ? "gated" : "ungated");
      fd_case(label, &p);
    }
    problem p = {.B = 1, .T = 9, .H = 2, .K = 6, .V = 4, .n = n, .N = 4, .cu = cu_empty, .gated = 1,
                 .with_h0 = 1, .with_dht = 1, .l2norm = (int)(n % 2), .beta_max = 2.0};
    char label[96];
    snprintf(label, sizeof label, "n=%lld gated packed {0,3,3,9,9} K=6 V=4 h0 dht l2norm=%d",
             (long long)n, p.l2norm);
    fd_case(label, &p);
  }
  problem p = {.B = 3, .T = 4, .H = 1, .K = 3, .V = 8, .n = 2, .gated = 1, .beta_max = 1.0};
  fd_case("n=2 gated no h0 no dht no l2norm", &p);
}

/* ------------------------------------------------------------------ (c) chunk vs recurrent */

static void chunk_case(const char *label, problem *p, const int64_t *chunks, int nchunks) {
  problem_fill(p);
  op_in in64, in32;
  problem_tensors(p, GDP_DTYPE_F64, -1, NULL, 0.0, &in64);
  problem_tensors(p, GDP_DTYPE_F32, -1, NULL, 0.0, &in32);
  gdp_delta_product_options opts = problem_opts(p, GDP_ALGO_RECURRENT, 0);
  op_out ref;
  gdp_status s = run_op(&opts, &in64, 1, &ref);
  CHECK(s == GDP_OK, "%s: recurrent: %s", label, gdp_last_error());
  for (int c = 0; s == GDP_OK && c < nchunks; c++) {
    for (int prec = 0; prec < 2; prec++) {
      opts = problem_opts(p, GDP_ALGO_CHUNK, chunks[c]);
      op_out got;
      char l2[200];
      snprintf(l2, sizeof l2, "%s chunk %lld %s", label, (long long)chunks[c], prec ? "f32" : "f64");
      gdp_status s2 = run_op(&opts, prec ? &in32 : &in64, 1, &got);
      CHECK(s2 == GDP_OK, "%s: %s", l2, gdp_last_error());
      if (s2 == GDP_OK)
        compare_out(l2, &got, &ref, prec ? TOL_F32 : TOL_F64, prec ? GDP_DTYPE_F32 : GDP_DTYPE_F64);
      op_out_free(&got);
    }
  }
  op_out_free(&ref);
  op_in_free(&in64);
  op_in_free(&in32);
  problem_free(p);
}

static void test_chunk_vs_recurrent(void) {
  printf("(c) chunk vs recurrent at odd chunk sizes\n");
  /* chunk 1, and chunks far longer than any sequence: the workspaces must be sized by
   * the steps a chunk can hold, not by chunk_size (2^40 squared overflows size_t) */
  const int64_t odd_chunks[] = {1, 37, 100000, (int64_t)1 << 40};
  int64_t cu[] = {0, 5, 5, 17};
  problem p = {.B = 1, .T = 17, .H = 2, .K = 5, .V = 3, .n = 3, .N = 3, .cu = cu, .gated = 1,
               .with_h0 = 1, .with_dht = 1, .l2norm = 1, .beta_max = 2.0};
  chunk_case("packed {0,5,5,17} K=5 V=3 n=3 odd chunk sizes", &p, odd_chunks, 4);
}

/* ------------------------------------------------------------------ misc op behaviour */

/* Non-contiguous inputs (a permuted view) and outputs that are not wanted. */
static void test_views(void) {
  printf("(misc) strided inputs, unwanted outputs\n");
  problem p = {.B = 2, .T = 19, .H = 3, .K = 8, .V = 12, .n = 2, .gated = 1, .with_h0 = 1,
               .with_dht = 1, .l2norm = 1, .beta_max = 1.0};
  problem_fill(&p);
  op_in in;
  problem_tensors(&p, GDP_DTYPE_F64, -1, NULL, 0.0, &in);
  gdp_delta_product_options opts = problem_opts(&p, GDP_ALGO_RECURRENT, 0);
  op_out ref;
  CHECK_OK(run_op(&opts, &in, 1, &ref));

  /* q as a view: a [B,H,T,K] buffer permuted to [B,T,H,K]. */
  gdp_tensor *qbht = NULL, *qview = NULL;
  const int perm[4] = {0, 2, 1, 3};
  CHECK_OK(gdp_tensor_permute(in.q, 4, perm, &qview)); /* [B,H,T,K] view of q */
  CHECK_OK(gdp_tensor_clone(qview, &qbht));              /* contiguous [B,H,T,K] */
  gdp_tensor_free(qview);
  qview = NULL;
  CHECK_OK(gdp_tensor_permute(qbht, 4, perm, &qview)); /* back to [B,T,H,K], strided */
  CHECK(qview && !gdp_tensor_is_contiguous(qview), "the permuted q should be a strided view");
  op_in vin = in;
  vin.q = qview;
  for (int algo = GDP_ALGO_AUTO; algo <= GDP_ALGO_RECURRENT; algo++) {
    opts.algorithm = algo;
    op_out got;
    gdp_status s = run_op(&opts, &vin, 1, &got);
    CHECK(s == GDP_OK, "strided q: %s", gdp_last_error());
    if (s == GDP_OK) compare_out(algo == GDP_ALGO_RECURRENT ? "strided q recurrent" :
                                 algo == GDP_ALGO_CHUNK ? "strided q chunk" : "strided q auto",
                                 &got, &ref, TOL_F64, GDP_DTYPE_F64);
    op_out_free(&got);
  }
  gdp_tensor_free(qview);
  gdp_tensor_free(qbht);

  /* ht not wanted: *ht untouched-NULL; dht NULL means zeros. */
  opts.algorithm = GDP_ALGO_RECURRENT;
  opts.output_final_state = 0;
  gdp_tensor *o = NULL, *ht = (gdp_tensor *)&ht; /* junk that must be reset */
  CHECK_OK(gdp_delta_product_forward(ctx, &opts, in.q, in.k, in.v, in.g, in.beta, in.h0, in.cu, &o, &ht));
  CHECK(ht == NULL, "ht must be NULL when output_final_state is 0");
  CHECK(rel_err(o, ref.o) <= TOL_F64, "o without ht differs");
  gdp_tensor_free(o);

  op_in_free(&in);
  op_out_free(&ref);
  problem_free(&p);

  /* No tokens at all (T = 0): o is empty, ht = h0 and dh0 = dht, gradients empty. */
  problem e = {.B = 2, .T = 0, .H = 2, .K = 3, .V = 5, .n = 3, .gated = 1, .with_h0 = 1,
               .with_dht = 1, .l2norm = 1, .beta_max = 1.0};
  problem_fill(&e);
  problem_tensors(&e, GDP_DTYPE_F64, -1, NULL, 0.0, &in);
  for (int algo = GDP_ALGO_AUTO; algo <= GDP_ALGO_RECURRENT; algo++) {
    opts = problem_opts(&e, algo, 0);
    op_out got;
    gdp_status s = run_op(&opts, &in, 1, &got);
    CHECK(s == GDP_OK, "T = 0, algorithm %d: %s", algo, gdp_last_error());
    if (s != GDP_OK) continue;
    CHECK(gdp_tensor_numel(got.o) == 0 && gdp_tensor_size(got.o, 1) == 0, "T = 0: o not empty");
    CHECK(rel_err(got.ht, in.h0) == 0.0, "T = 0, algorithm %d: ht != h0", algo);
    CHECK(rel_err(got.dh0, in.dht) == 0.0, "T = 0, algorithm %d: dh0 != dht", algo);
    CHECK(gdp_tensor_numel(got.dk) == 0 && gdp_tensor_numel(got.dg) == 0, "T = 0: grads not empty");
    op_out_free(&got);
  }
  op_in_free(&in);
  problem_free(&e);
}

/* ------------------------------------------------------------------ (d) validation */

static void test_validation(void) {
  printf("(d) validation\n");
  problem p = {.B = 2, .T = 6, .H = 2, .K = 4, .V = 3, .n = 2, .gated = 1, .with_h0 = 1,
               .with_dht = 1, .l2norm = 1, .beta_max = 1.0};
  problem_fill(&p);
  op_in in;
  problem_tensors(&p, GDP_DTYPE_F64, -1, NULL, 0.0, &in);
  gdp_delta_product_options ok = problem_opts(&p, GDP_ALGO_AUTO, 0), o2;
  gdp_tensor *o = NULL, *ht = NULL, *bad = NULL, *dq, *dk, *dv, *db, *dg, *dh0;
  CHECK_OK(gdp_delta_product_forward(ctx, &ok, in.q, in.k, in.v, in.g, in.beta, in.h0, NULL, &o, NULL));
  gdp_tensor_free(o);

#define FWD(opts, q, k, v, g, beta, h0, cu) \
  gdp_delta_product_forward(ctx, (opts), (q), (k), (v), (g), (beta), (h0), (cu), &o, &ht)
#define BWD(opts, d_o, dht)                                                                   \
  gdp_delta_product_backward(ctx, (opts), in.q, in.k, in.v, in.g, in.beta, in.h0, NULL, (d_o), (dht), &dq, \
                   &dk, &dv, &db, &dg, &dh0)

  /* NULL arguments */
  CHECK_ERR(gdp_delta_product_forward(NULL, &ok, in.q, in.k, in.v, in.g, in.beta, NULL, NULL, &o, NULL),
            GDP_ERR_INVALID_ARG, "ctx");
  CHECK_ERR(FWD(NULL, in.q, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG, "opts");
  CHECK_ERR(FWD(&ok, NULL, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG, "q:");
  CHECK_ERR(FWD(&ok, in.q, NULL, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG, "k:");
  CHECK_ERR(FWD(&ok, in.q, in.k, NULL, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG, "v:");
  CHECK_ERR(FWD(&ok, in.q, in.k, in.v, in.g, NULL, NULL, NULL), GDP_ERR_INVALID_ARG, "beta:");
  CHECK_ERR(gdp_delta_product_forward(ctx, &ok, in.q, in.k, in.v, in.g, in.beta, NULL, NULL, NULL, NULL),
            GDP_ERR_INVALID_ARG, "o:");
  o2 = ok, o2.output_final_state = 1;
  CHECK_ERR(gdp_delta_product_forward(ctx, &o2, in.q, in.k, in.v, in.g, in.beta, NULL, NULL, &o, NULL),
            GDP_ERR_INVALID_ARG, "output_final_state");
  CHECK_ERR(BWD(&ok, NULL, NULL), GDP_ERR_INVALID_ARG, "d_o:");
  CHECK_ERR(gdp_delta_product_backward(ctx, &ok, in.q, in.k, in.v, in.g, in.beta, in.h0, NULL, in.d_o, NULL,
                             &dq, &dk, &dv, &db, NULL, &dh0),
            GDP_ERR_INVALID_ARG, "dg: expected an output pointer");

  /* options */
  o2 = ok, o2.num_householder = 0;
  CHECK_ERR(FWD(&o2, in.q, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG,
            "num_householder: expected >= 1, got 0");
  o2 = ok, o2.num_householder = 5; /* k has 12 rows for T = 6: n = 5 does not divide */
  CHECK_ERR(FWD(&o2, in.q, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_SHAPE,
            "not a multiple of num_householder 5");
  o2 = ok, o2.num_householder = 3; /* divides 12 but T*n = 18 */
  CHECK_ERR(FWD(&o2, in.q, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_SHAPE,
            "k: expected [B,T*n,H,K] = [2x18x2x4] for num_householder 3, got [2x12x2x4]");
  o2 = ok, o2.chunk_size = -1;
  CHECK_ERR(FWD(&o2, in.q, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG,
            "chunk_size: expected >= 1");
  o2 = ok, o2.scale = NAN;
  CHECK_ERR(FWD(&o2, in.q, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG,
            "scale: expected a finite value");
  o2 = ok, o2.scale = INFINITY;
  CHECK_ERR(FWD(&o2, in.q, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG, "scale");
  o2 = ok, o2.reserved = 7;
  CHECK_ERR(FWD(&o2, in.q, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG,
            "reserved: expected 0");
  o2 = ok, o2.algorithm = 3;
  CHECK_ERR(FWD(&o2, in.q, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_INVALID_ARG,
            "algorithm: expected");
  o2 = ok, o2.algorithm = -1;
  CHECK_ERR(BWD(&o2, in.d_o, NULL), GDP_ERR_INVALID_ARG, "got -1");

  /* ranks and shapes */
  const int64_t s3[3] = {2, 6, 8}, s5[5] = {2, 6, 2, 4, 1};
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 3, s3, &bad));
  CHECK_ERR(FWD(&ok, bad, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_SHAPE,
            "q: expected 4 dims [B,T,H,K], got [2x6x8]");
  CHECK_ERR(FWD(&ok, in.q, in.k, bad, in.g, in.beta, NULL, NULL), GDP_ERR_SHAPE, "v: expected 4 dims");
  CHECK_ERR(FWD(&ok, in.q, bad, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_SHAPE, "k: expected");
  gdp_tensor_free(bad);
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 5, s5, &bad));
  CHECK_ERR(FWD(&ok, bad, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_SHAPE, "q: expected 4 dims");
  gdp_tensor_free(bad);
  struct { int ndim; int64_t shape[4]; int arg; const char *needle; } shp[] = {
      {4, {2, 12, 2, 5}, X_K, "k: expected [B,T*n,H,K] = [2x12x2x4]"},          /* K disagrees */
      {4, {2, 12, 3, 4}, X_K, "k: expected [B,T*n,H,K] = [2x12x2x4]"},          /* H disagrees */
      {4, {1, 12, 2, 4}, X_K, "got [1x12x2x4]"},                                /* B disagrees */
      {4, {2, 10, 2, 3}, X_V, "v: expected [B,T*n,H,V] = [2x12x2x3]"},
      {4, {2, 12, 3, 3}, X_V, "v: expected"},
      {3, {2, 12, 3}, X_BETA, "beta: expected [B,T*n,H] = [2x12x2]"},
      {3, {2, 6, 2}, X_BETA, "beta: expected [B,T*n,H] = [2x12x2] for num_householder 2, got [2x6x2]"},
      {4, {2, 12, 2, 1}, X_BETA, "beta: expected"},
      {3, {2, 12, 2}, X_G, "g: expected [B,T,H] = [2x6x2], got [2x12x2]"},
      {2, {2, 6}, X_G, "g: expected"},
      {4, {2, 2, 4, 4}, X_H0, "h0: expected [N,H,K,V] = [2x2x4x3], got [2x2x4x4]"},
      {4, {1, 2, 4, 3}, X_H0, "h0: expected [N,H,K,V]"},
  };
  for (size_t i = 0; i < sizeof shp / sizeof shp[0]; i++) {
    CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, shp[i].ndim, shp[i].shape, &bad));
    op_in t = in;
    gdp_tensor **slot[] = {&t.q, &t.k, &t.v, &t.g, &t.beta, &t.h0};
    *slot[shp[i].arg] = bad;
    CHECK_ERR(FWD(&ok, t.q, t.k, t.v, t.g, t.beta, t.h0, NULL), GDP_ERR_SHAPE, shp[i].needle);
    gdp_tensor_free(bad);
  }
  /* d_o and dht shapes (backward) */
  const int64_t do_bad[4] = {2, 6, 2, 4}, dht_bad[4] = {2, 2, 3, 3};
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 4, do_bad, &bad));
  CHECK_ERR(BWD(&ok, bad, NULL), GDP_ERR_SHAPE, "d_o: expected [B,T,H,V] = [2x6x2x3], got [2x6x2x4]");
  gdp_tensor_free(bad);
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 4, dht_bad, &bad));
  CHECK_ERR(BWD(&ok, in.d_o, bad), GDP_ERR_SHAPE, "dht: expected [N,H,K,V] = [2x2x4x3]");
  gdp_tensor_free(bad);

  /* dtypes */
  gdp_tensor *k32 = convert(in.k, GDP_DTYPE_F32), *qi = convert(in.q, GDP_DTYPE_I32);
  gdp_tensor *h0bf = convert(in.h0, GDP_DTYPE_BF16), *dobf = convert(in.d_o, GDP_DTYPE_I64);
  gdp_tensor *dhtbf = convert(in.dht, GDP_DTYPE_BF16), *g32 = convert(in.g, GDP_DTYPE_F32);
  CHECK_ERR(FWD(&ok, in.q, k32, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_DTYPE,
            "k: expected dtype f64 (q's");
  CHECK_ERR(FWD(&ok, in.q, in.k, in.v, g32, in.beta, NULL, NULL), GDP_ERR_DTYPE,
            "g: expected dtype f64");
  CHECK_ERR(FWD(&ok, qi, in.k, in.v, in.g, in.beta, NULL, NULL), GDP_ERR_DTYPE,
            "q: expected dtype f64, f32 or bf16, got i32");
  CHECK_ERR(FWD(&ok, in.q, in.k, in.v, in.g, in.beta, h0bf, NULL), GDP_ERR_DTYPE,
            "h0: expected dtype f32 or f64, got bf16");
  CHECK_ERR(BWD(&ok, dobf, NULL), GDP_ERR_DTYPE, "d_o: expected dtype");
  CHECK_ERR(BWD(&ok, in.d_o, dhtbf), GDP_ERR_DTYPE, "dht: expected dtype f32 or f64");
  gdp_tensor *frees[] = {k32, qi, h0bf, dobf, dhtbf, g32};
  for (size_t i = 0; i < 6; i++) gdp_tensor_free(frees[i]);

  /* cu_seqlens: B must be 1; rank, length, dtype, values */
  {
    problem pk = {.B = 1, .T = 7, .H = 1, .K = 3, .V = 2, .n = 1, .gated = 0, .l2norm = 1,
                  .beta_max = 1.0};
    problem_fill(&pk);
    op_in ik;
    problem_tensors(&pk, GDP_DTYPE_F64, -1, NULL, 0.0, &ik);
    gdp_delta_product_options ko = problem_opts(&pk, GDP_ALGO_RECURRENT, 0);
    struct { gdp_dtype dt; int ndim; int64_t shape[2]; int64_t vals[5]; gdp_status st;
             const char *needle; } cus[] = {
        {GDP_DTYPE_I64, 1, {3}, {0, 3, 7}, GDP_OK, ""},
        {GDP_DTYPE_I32, 1, {4}, {0, 0, 7, 7}, GDP_OK, ""},
        {GDP_DTYPE_I64, 1, {3}, {1, 3, 7}, GDP_ERR_INVALID_ARG, "cu_seqlens[0] = 0, got 1"},
        {GDP_DTYPE_I64, 1, {3}, {0, 5, 3}, GDP_ERR_INVALID_ARG, "non-decreasing"},
        {GDP_DTYPE_I64, 1, {3}, {0, 3, 6}, GDP_ERR_INVALID_ARG, "last entry = T = 7"},
        {GDP_DTYPE_I64, 1, {3}, {0, 3, 8}, GDP_ERR_INVALID_ARG, "got 8"},
        {GDP_DTYPE_I64, 1, {1}, {0}, GDP_ERR_SHAPE, "N+1 >= 2"},
        {GDP_DTYPE_I64, 2, {1, 3}, {0, 3, 7}, GDP_ERR_SHAPE, "1-D"},
        {GDP_DTYPE_F64, 1, {3}, {0, 3, 7}, GDP_ERR_DTYPE, "cu_seqlens: expected dtype i32 or i64, got f64"},
    };
    for (size_t i = 0; i < sizeof cus / sizeof cus[0]; i++) {
      gdp_tensor *cu = NULL;
      int64_t count = cus[i].shape[0] * (cus[i].ndim == 2 ? cus[i].shape[1] : 1);
      CHECK_OK(gdp_tensor_from_host(ctx, cus[i].dt, cus[i].ndim, cus[i].shape, GDP_DTYPE_I64,
                                    cus[i].vals, (size_t)count * sizeof(int64_t), &cu));
      o = NULL;
      gdp_status s = gdp_delta_product_forward(ctx, &ko, ik.q, ik.k, ik.v, NULL, ik.beta, NULL, cu, &o, NULL);
      if (cus[i].st == GDP_OK)
        CHECK(s == GDP_OK && o != NULL, "cu_seqlens case %zu: %s", i, gdp_last_error());
      else
        CHECK_ERR(s, cus[i].st, cus[i].needle);
      gdp_tensor_free(o);
      gdp_tensor_free(cu);
    }
    op_in_free(&ik);
    problem_free(&pk);
  }
  {
    gdp_tensor *cu = NULL;
    const int64_t shape[1] = {3}, vals[3] = {0, 3, 6};
    CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 1, shape, GDP_DTYPE_I64, vals, sizeof vals, &cu));
    CHECK_ERR(FWD(&ok, in.q, in.k, in.v, in.g, in.beta, NULL, cu), GDP_ERR_SHAPE,
              "packed sequences need B = 1, got q with B = 2");
    gdp_tensor_free(cu);
  }
  /* h0 of N = 2 sequences given with cu_seqlens of 3 sequences */
  {
    problem pk = {.B = 1, .T = 7, .H = 2, .K = 4, .V = 3, .n = 2, .gated = 1, .with_h0 = 1,
                  .l2norm = 1, .beta_max = 1.0};
    int64_t cu3[] = {0, 2, 2, 7};
    pk.cu = cu3, pk.N = 3;
    problem_fill(&pk);
    op_in ik;
    problem_tensors(&pk, GDP_DTYPE_F64, -1, NULL, 0.0, &ik);
    gdp_delta_product_options ko = problem_opts(&pk, GDP_ALGO_RECURRENT, 0);
    CHECK_ERR(gdp_delta_product_forward(ctx, &ko, ik.q, ik.k, ik.v, ik.g, ik.beta, in.h0, ik.cu, &o, NULL),
              GDP_ERR_SHAPE, "h0: expected [N,H,K,V] = [3x2x4x3], got [2x2x4x3]");
    op_in_free(&ik);
    problem_free(&pk);
  }
  /* outputs are NULL after a failure */
  o = (gdp_tensor *)&o;
  CHECK_ERR(FWD(&ok, in.q, in.k, in.v, in.g, NULL, NULL, NULL), GDP_ERR_INVALID_ARG, "beta");
  CHECK(o == NULL, "o must be NULL after a failed forward");
  dq = dk = (gdp_tensor *)&dq;
  CHECK_ERR(BWD(&ok, NULL, NULL), GDP_ERR_INVALID_ARG, "d_o");
  CHECK(dq == NULL && dk == NULL, "gradients must be NULL after a failed backward");
  /* everything allocated above was released: no live bytes beyond the inputs */
#undef FWD
#undef BWD
  op_in_free(&in);
  problem_free(&p);
}

/* Threads alive in this process (-1 without /proc). */
static int count_threads(void) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

/* gdp_ctx_set_num_threads(ctx, 1) makes the op single-threaded, the q/k L2 norm of the
 * op layer included (it used OpenMP's default team, all cores).  Runs first, before any
 * other test has started OpenMP's pool: a pool started now would be the op's doing. */
static void test_num_threads_respected(void) {
  printf("(misc) ctx num_threads 1 starts no threads\n");
  gdp_ctx_set_num_threads(ctx, 1);
  problem p = {.B = 1, .T = 1100, .H = 2, .K = 64, .V = 4, .n = 1, .gated = 1, .l2norm = 1,
               .with_dht = 1, .beta_max = 1.0}; /* k: 2200 rows of 64, past the parallel cutoff */
  problem_fill(&p);
  op_in in;
  problem_tensors(&p, GDP_DTYPE_F64, -1, NULL, 0.0, &in);
  gdp_delta_product_options opts = problem_opts(&p, GDP_ALGO_CHUNK, 64);
  const int before = count_threads();
  op_out out;
  CHECK_OK(run_op(&opts, &in, 1, &out));
  const int after = count_threads();
  CHECK(before < 0 || after == before, "threads: %d before the op, %d after (num_threads 1)",
        before, after);
  op_out_free(&out);
  op_in_free(&in);
  problem_free(&p);
  gdp_ctx_set_num_threads(ctx, 0);
}

/* Options helpers and the layout the FFI checks. */
static void test_options(void) {
  gdp_delta_product_options o;
  memset(&o, 0xff, sizeof o);
  gdp_delta_product_options_init(&o);
  CHECK(o.num_householder == 1 && o.scale == 0.0 && o.chunk_size == 0 && o.use_qk_l2norm == 0 &&
            o.output_final_state == 0 && o.algorithm == GDP_ALGO_AUTO && o.value_block == 0 &&
            o.reserved == 0,
        "gdp_delta_product_options_init defaults");
  size_t off[8];
  CHECK(gdp_delta_product_options_layout(off) == sizeof(gdp_delta_product_options), "layout size");
  CHECK(off[0] == 0 && off[1] == 8 && off[2] == 16 && off[3] == 24 && off[4] == 28 &&
            off[5] == 32 && off[6] == 36 && off[7] == 40,
        "layout offsets %zu %zu %zu %zu %zu %zu %zu %zu", off[0], off[1], off[2], off[3], off[4],
        off[5], off[6], off[7]);
}

int main(void) {
  TEST_BEGIN(20260415);
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx));
  if (!ctx) TEST_END();
  const int64_t live0 = gdp_mem_live_bytes(GDP_DEVICE_CPU);
  test_num_threads_respected();
  test_options();
  test_validation();
  test_finite_differences();
  test_chunk_vs_recurrent();
  test_views();
  const int64_t live1 = gdp_mem_live_bytes(GDP_DEVICE_CPU);
  CHECK(live1 == live0, "leak: %lld bytes live after the tests, %lld before", (long long)live1,
        (long long)live0);
  gdp_ctx_free(ctx);
  TEST_END();
}
