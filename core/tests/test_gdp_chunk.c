/*
 * test_gdp_chunk.c -- the chunkwise CPU kernels (float64 and float32) against the
 * float64 recurrent oracle, forward and backward, on fresh seeded random problems:
 * n = 1..4, odd and unequal K/V, gated and ungated, beta in (0,1) and (0,2), with and
 * without h0/dht, unpacked batches and packed sequences (empty ones, ones shorter than
 * a chunk), chunk sizes that are not multiples of n.  Plus a finite-difference check
 * of the chunk backward against the chunk forward in float64.
 *
 * Inputs are rounded to float32 once, so that the float64 and float32 kernels see the
 * same numbers and one oracle run serves both.  Outputs start as NaN (an element the
 * kernel forgets to write fails the comparison) and are followed by guard values that
 * must survive.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/gdp_cpu.h"
#include "testutil.h"

enum { GUARD = 16 };
static const double GUARD_VALUE = 12345.0;

typedef struct tcase {
  const char *name;
  int64_t N;
  int64_t lens[8]; /* tokens per sequence */
  int64_t H, K, V, n, C;
  int gated, with_h0, with_dht;
  double beta_max; /* beta ~ U(0.02, beta_max - 0.02) */
  double g_min;    /* g ~ U(g_min, -0.001) */
  int threads;
} tcase;

/* ------------------------------------------------------------------ buffers */

static double *alloc_out_f64(int64_t count) {
  double *x = malloc((size_t)(count + GUARD) * sizeof(double));
  for (int64_t i = 0; i < count; i++) x[i] = NAN;
  for (int64_t i = 0; i < GUARD; i++) x[count + i] = GUARD_VALUE;
  return x;
}
static float *alloc_out_f32(int64_t count) {
  float *x = malloc((size_t)(count + GUARD) * sizeof(float));
  for (int64_t i = 0; i < count; i++) x[i] = NAN;
  for (int64_t i = 0; i < GUARD; i++) x[count + i] = (float)GUARD_VALUE;
  return x;
}
static int guard_ok_f64(const double *x, int64_t count) {
  for (int64_t i = 0; i < GUARD; i++)
    if (x[count + i] != GUARD_VALUE) return 0;
  return 1;
}
static int guard_ok_f32(const float *x, int64_t count) {
  for (int64_t i = 0; i < GUARD; i++)
    if (x[count + i] != (float)GUARD_VALUE) return 0;
  return 1;
}

/* Random values rounded to float32, so both precisions see the same inputs. */
static double *rand_normal(int64_t count) {
  double *x = malloc((size_t)(count > 0 ? count : 1) * sizeof(double));
  for (int64_t i = 0; i < count; i++) x[i] = (double)(float)tu_rand_normal();
  return x;
}
static double *rand_uniform(int64_t count, double lo, double hi) {
  double *x = malloc((size_t)(count > 0 ? count : 1) * sizeof(double));
  for (int64_t i = 0; i < count; i++) x[i] = (double)(float)tu_rand_uniform(lo, hi);
  return x;
}
/* Unit rows, as the op delivers q and k after its L2 norm. */
static void normalise_rows(double *x, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; r++) {
    double ss = 0;
    for (int64_t i = 0; i < dim; i++) ss += x[r * dim + i] * x[r * dim + i];
    const double inv = 1.0 / sqrt(ss);
    for (int64_t i = 0; i < dim; i++) x[r * dim + i] = (double)(float)(x[r * dim + i] * inv);
  }
}
static float *to_f32(const double *x, int64_t count) {
  if (!x) return NULL;
  float *y = malloc((size_t)(count > 0 ? count : 1) * sizeof(float));
  for (int64_t i = 0; i < count; i++) y[i] = (float)x[i];
  return y;
}

/* ------------------------------------------------------------------ one problem */

typedef struct problem {
  gdp_delta_product_problem p;
  int64_t cu[9];
  int64_t nq, nk, nv, nb, ng, ns, no; /* element counts */
  double *q, *k, *v, *beta, *g, *h0, *d_o, *dht;
} problem;

static void problem_make(problem *P, const tcase *tc, gdp_dtype dtype) {
  memset(P, 0, sizeof *P);
  P->cu[0] = 0;
  for (int64_t s = 0; s < tc->N; s++) P->cu[s + 1] = P->cu[s] + tc->lens[s];
  const int64_t T = P->cu[tc->N], H = tc->H, K = tc->K, V = tc->V, n = tc->n;
  gdp_delta_product_problem *p = &P->p;
  p->T_total = T;
  p->N = tc->N;
  p->cu_seqlens = P->cu;
  p->H = H;
  p->K = K;
  p->V = V;
  p->n = n;
  p->scale = 1.0 / sqrt((double)K);
  p->chunk_size = tc->C;
  p->num_threads = tc->threads;
  p->dtype = dtype;
  p->algorithm = GDP_ALGO_CHUNK;
  p->l2norm_in_kernel = 0;
  P->nq = T * H * K;
  P->nk = T * n * H * K;
  P->nv = T * n * H * V;
  P->nb = T * n * H;
  P->ng = T * H;
  P->ns = tc->N * H * K * V;
  P->no = T * H * V;
  P->q = rand_normal(P->nq);
  normalise_rows(P->q, T * H, K);
  P->k = rand_normal(P->nk);
  normalise_rows(P->k, T * n * H, K);
  P->v = rand_normal(P->nv);
  P->beta = rand_uniform(P->nb, 0.02, tc->beta_max - 0.02);
  P->g = tc->gated ? rand_uniform(P->ng, tc->g_min, -0.001) : NULL;
  P->h0 = tc->with_h0 ? rand_normal(P->ns) : NULL;
  P->d_o = rand_normal(P->no);
  P->dht = tc->with_dht ? rand_normal(P->ns) : NULL;
}

static void problem_free(problem *P) {
  free(P->q), free(P->k), free(P->v), free(P->beta), free(P->g), free(P->h0), free(P->d_o);
  free(P->dht);
}

/* Results of one run, always held in double for comparison. */
typedef struct results {
  double *o, *ht, *dq, *dk, *dv, *dbeta, *dg, *dh0;
} results;

static void results_free(results *R) {
  free(R->o), free(R->ht), free(R->dq), free(R->dk), free(R->dv), free(R->dbeta), free(R->dg);
  free(R->dh0);
}

static void run_oracle(const problem *P, results *R) {
  memset(R, 0, sizeof *R);
  R->o = alloc_out_f64(P->no);
  R->ht = alloc_out_f64(P->ns);
  gdp_delta_product_forward_io f = {P->q, P->k, P->v, P->g, P->beta, P->h0, R->o, R->ht};
  CHECK_OK(gdp_cpu_delta_product_forward_recurrent_f64(&P->p, &f));
  R->dq = alloc_out_f64(P->nq);
  R->dk = alloc_out_f64(P->nk);
  R->dv = alloc_out_f64(P->nv);
  R->dbeta = alloc_out_f64(P->nb);
  R->dg = P->g ? alloc_out_f64(P->ng) : NULL;
  R->dh0 = alloc_out_f64(P->ns);
  gdp_delta_product_backward_io b = {P->q,  P->k,  P->v,  P->g,     P->beta, P->h0, P->d_o,
                      P->dht, R->dq, R->dk, R->dv, R->dbeta, R->dg, R->dh0};
  CHECK_OK(gdp_cpu_delta_product_backward_recurrent_f64(&P->p, &b));
}

/* want_ht / want_dh0 = 0 pass NULL for those outputs (and skip their comparison). */
static void run_chunk_f64(const problem *P, int want_ht, int want_dh0, results *R) {
  memset(R, 0, sizeof *R);
  R->o = alloc_out_f64(P->no);
  R->ht = want_ht ? alloc_out_f64(P->ns) : NULL;
  gdp_delta_product_forward_io f = {P->q, P->k, P->v, P->g, P->beta, P->h0, R->o, R->ht};
  CHECK_OK(gdp_cpu_delta_product_forward_chunk_f64(&P->p, &f));
  R->dq = alloc_out_f64(P->nq);
  R->dk = alloc_out_f64(P->nk);
  R->dv = alloc_out_f64(P->nv);
  R->dbeta = alloc_out_f64(P->nb);
  R->dg = P->g ? alloc_out_f64(P->ng) : NULL;
  R->dh0 = want_dh0 ? alloc_out_f64(P->ns) : NULL;
  gdp_delta_product_backward_io b = {P->q,  P->k,  P->v,  P->g,     P->beta, P->h0, P->d_o,
                      P->dht, R->dq, R->dk, R->dv, R->dbeta, R->dg, R->dh0};
  CHECK_OK(gdp_cpu_delta_product_backward_chunk_f64(&P->p, &b));
  CHECK(guard_ok_f64(R->o, P->no) && guard_ok_f64(R->dq, P->nq) && guard_ok_f64(R->dk, P->nk) &&
            guard_ok_f64(R->dv, P->nv) && guard_ok_f64(R->dbeta, P->nb) &&
            (!R->ht || guard_ok_f64(R->ht, P->ns)) && (!R->dg || guard_ok_f64(R->dg, P->ng)) &&
            (!R->dh0 || guard_ok_f64(R->dh0, P->ns)),
        "f64: a guard value after an output was overwritten");
}

/* Runs the float32 kernels and widens the results to double. */
static void run_chunk_f32(const problem *P, int want_ht, int want_dh0, results *R) {
  float *q = to_f32(P->q, P->nq), *k = to_f32(P->k, P->nk), *v = to_f32(P->v, P->nv);
  float *beta = to_f32(P->beta, P->nb), *g = to_f32(P->g, P->ng), *h0 = to_f32(P->h0, P->ns);
  float *d_o = to_f32(P->d_o, P->no), *dht = to_f32(P->dht, P->ns);
  float *o = alloc_out_f32(P->no), *ht = want_ht ? alloc_out_f32(P->ns) : NULL;
  float *dq = alloc_out_f32(P->nq), *dk = alloc_out_f32(P->nk), *dv = alloc_out_f32(P->nv);
  float *dbeta = alloc_out_f32(P->nb), *dg = g ? alloc_out_f32(P->ng) : NULL;
  float *dh0 = want_dh0 ? alloc_out_f32(P->ns) : NULL;
  gdp_delta_product_problem p = P->p;
  p.dtype = GDP_DTYPE_F32;
  gdp_delta_product_forward_io f = {q, k, v, g, beta, h0, o, ht};
  CHECK_OK(gdp_cpu_delta_product_forward_chunk_f32(&p, &f));
  gdp_delta_product_backward_io b = {q, k, v, g, beta, h0, d_o, dht, dq, dk, dv, dbeta, dg, dh0};
  CHECK_OK(gdp_cpu_delta_product_backward_chunk_f32(&p, &b));
  CHECK(guard_ok_f32(o, P->no) && guard_ok_f32(dq, P->nq) && guard_ok_f32(dk, P->nk) &&
            guard_ok_f32(dv, P->nv) && guard_ok_f32(dbeta, P->nb) &&
            (!ht || guard_ok_f32(ht, P->ns)) && (!dg || guard_ok_f32(dg, P->ng)) &&
            (!dh0 || guard_ok_f32(dh0, P->ns)),
        "f32: a guard value after an output was overwritten");
  /* widen (the f32 comparison helper takes float data against a double reference) */
  memset(R, 0, sizeof *R);
  R->o = (double *)o, R->ht = (double *)ht, R->dq = (double *)dq, R->dk = (double *)dk;
  R->dv = (double *)dv, R->dbeta = (double *)dbeta, R->dg = (double *)dg;
  R->dh0 = (double *)dh0;
  free(q), free(k), free(v), free(beta), free(g), free(h0), free(d_o), free(dht);
}

/* ------------------------------------------------------------------ comparison */

static double worst_f64, worst_f32;

static void compare(const char *label, const char *what, int is_f32, const void *got,
                    const double *ref, int64_t count) {
  if (!got || !ref || count == 0) return;
  const double err = is_f32 ? tu_rel_err_f32((const float *)got, ref, count)
                            : tu_rel_err_f64((const double *)got, ref, count);
  const double tol = is_f32 ? 1e-4 : 1e-10;
  CHECK(err <= tol, "%s %s %s: relative error %.3e > %.0e", label, is_f32 ? "f32" : "f64", what,
        err, tol);
  double *worst = is_f32 ? &worst_f32 : &worst_f64;
  if (!(err <= *worst)) *worst = err;
}

static void compare_all(const char *label, int is_f32, const problem *P, const results *got,
                        const results *ref) {
  compare(label, "o", is_f32, got->o, ref->o, P->no);
  compare(label, "ht", is_f32, got->ht, ref->ht, P->ns);
  compare(label, "dq", is_f32, got->dq, ref->dq, P->nq);
  compare(label, "dk", is_f32, got->dk, ref->dk, P->nk);
  compare(label, "dv", is_f32, got->dv, ref->dv, P->nv);
  compare(label, "dbeta", is_f32, got->dbeta, ref->dbeta, P->nb);
  compare(label, "dg", is_f32, got->dg, ref->dg, P->ng);
  compare(label, "dh0", is_f32, got->dh0, ref->dh0, P->ns);
}

static void run_case(const tcase *tc, int want_ht, int want_dh0) {
  problem P;
  problem_make(&P, tc, GDP_DTYPE_F64);
  results ref, c64, c32;
  run_oracle(&P, &ref);
  run_chunk_f64(&P, want_ht, want_dh0, &c64);
  compare_all(tc->name, 0, &P, &c64, &ref);
  run_chunk_f32(&P, want_ht, want_dh0, &c32);
  compare_all(tc->name, 1, &P, &c32, &ref);
  results_free(&ref), results_free(&c64), results_free(&c32);
  problem_free(&P);
}

/* ------------------------------------------------------------------ finite differences */

/* loss = sum(o dO) + sum(ht dht), by the chunk forward in float64. */
static double chunk_loss(const problem *P) {
  double *o = malloc((size_t)P->no * sizeof(double)), *ht = malloc((size_t)P->ns * sizeof(double));
  gdp_delta_product_forward_io f = {P->q, P->k, P->v, P->g, P->beta, P->h0, o, ht};
  gdp_status st = gdp_cpu_delta_product_forward_chunk_f64(&P->p, &f);
  double loss = st == GDP_OK ? 0.0 : NAN;
  for (int64_t i = 0; i < P->no; i++) loss += o[i] * P->d_o[i];
  for (int64_t i = 0; i < P->ns; i++) loss += ht[i] * P->dht[i];
  free(o), free(ht);
  return loss;
}

/* Central differences over every element of x, against the analytic gradient. */
static void fd_check(const char *what, problem *P, double *x, const double *grad, int64_t count) {
  const double h = 1e-5;
  double num = 0, den = 0;
  for (int64_t i = 0; i < count; i++) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = chunk_loss(P);
    x[i] = keep - h;
    const double down = chunk_loss(P);
    x[i] = keep;
    const double fd = (up - down) / (2 * h);
    num += (fd - grad[i]) * (fd - grad[i]);
    den += grad[i] * grad[i];
  }
  const double err = sqrt(num / den);
  CHECK(err <= 1e-7, "finite differences: d%s relative error %.3e > 1e-7", what, err);
  printf("  finite differences d%-5s rel err %.2e\n", what, err);
}

static void run_fd(void) {
  const tcase tc = {"fd", 3, {7, 0, 9}, 2, 6, 5, 2, 5, 1, 1, 1, 2.0, -1.5, 1};
  problem P;
  problem_make(&P, &tc, GDP_DTYPE_F64);
  results R;
  run_chunk_f64(&P, 1, 1, &R);
  fd_check("q", &P, P.q, R.dq, P.nq);
  fd_check("k", &P, P.k, R.dk, P.nk);
  fd_check("v", &P, P.v, R.dv, P.nv);
  fd_check("beta", &P, P.beta, R.dbeta, P.nb);
  fd_check("g", &P, P.g, R.dg, P.ng);
  fd_check("h0", &P, P.h0, R.dh0, P.ns);
  results_free(&R);
  problem_free(&P);
}

/* ------------------------------------------------------------------ main */

int main(void) {
  TEST_BEGIN(20241130);

  /* name, N, lens, H, K, V, n, C, gated, h0, dht, beta_max, g_min, threads */
  const tcase cases[] = {
      {"n1 unpacked K24 V40", 2, {37, 37}, 2, 24, 40, 1, 16, 1, 1, 1, 1.0, -1.0, 2},
      {"n2 unpacked K24 V40", 2, {37, 37}, 2, 24, 40, 2, 16, 1, 1, 1, 1.0, -1.0, 2},
      {"n3 unpacked K40 V24", 3, {29, 29, 29}, 1, 40, 24, 3, 16, 1, 0, 1, 2.0, -1.0, 2},
      {"n4 unpacked K40 V24", 2, {23, 23}, 3, 40, 24, 4, 16, 0, 1, 0, 2.0, -1.0, 2},
      {"n2 K=V=128 T=300 C64", 1, {300}, 2, 128, 128, 2, 64, 1, 1, 1, 2.0, -0.5, 2},
      {"n1 K=V=128 T=200 C64 ungated", 1, {200}, 1, 128, 128, 1, 64, 0, 0, 1, 1.0, -1.0, 1},
      {"packed empties C37 n3", 6, {0, 5, 0, 70, 3, 0}, 2, 40, 24, 3, 37, 0, 1, 0, 2.0, -1.0, 2},
      {"packed gated C37 n2", 5, {12, 0, 41, 1, 19}, 2, 17, 33, 2, 37, 1, 1, 1, 1.0, -2.0, 2},
      {"short seqs C64 n4", 3, {3, 10, 1}, 2, 24, 16, 4, 64, 1, 1, 1, 2.0, -1.0, 2},
      {"C5 n2 odd sizes", 2, {21, 8}, 3, 17, 9, 2, 5, 1, 1, 1, 2.0, -1.0, 2},
      {"C16 n3 K=V=32", 2, {40, 33}, 2, 32, 32, 3, 16, 1, 0, 0, 1.0, -0.3, 2},
      {"C1 n2", 2, {9, 4}, 2, 8, 12, 2, 1, 1, 1, 1, 2.0, -1.0, 2},
      {"C64 n3 strong decay", 1, {90}, 2, 32, 48, 3, 64, 1, 1, 1, 1.0, -6.0, 2},
      {"single pair, BLAS threads", 1, {150}, 1, 64, 80, 2, 64, 1, 1, 1, 2.0, -1.0, 2},
  };
  const int ncases = (int)(sizeof cases / sizeof cases[0]);
  for (int i = 0; i < ncases; i++) run_case(&cases[i], 1, 1);
  /* ht and dh0 not wanted (NULL outputs). */
  run_case(&cases[1], 0, 0);
  run_case(&cases[6], 0, 1);
  printf("  worst relative error vs the float64 oracle: f64 %.2e, f32 %.2e\n", worst_f64,
         worst_f32);

  run_fd();

  TEST_END();
}
