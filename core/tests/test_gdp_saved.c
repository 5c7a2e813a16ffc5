/*
 * test_gdp_saved.c -- save for backward (gdp_delta_product_forward_ex / gdp_delta_product_backward_ex) on the
 * cpu, whose backend keeps nothing: the API contract (NULL handling, bytes, ownership),
 * results identical to the plain calls, and a refusal naming the field for every
 * recorded field of the problem that differs in the backward.  The device path (the
 * cuda fast path, which keeps its panels and states) is checked by spec/cuda_spec.lua;
 * saving against the float64 oracle on every device by spec/gdp_op_spec.lua.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

static gdp_ctx *ctx;

/* One problem: sizes, switches and its tensors (inputs and upstream gradients). */
typedef struct problem {
  int64_t B, T, H, K, V, n;
  int gated, has_h0, l2norm, algorithm;
  double scale;
  gdp_dtype dtype;
  const int64_t *cu; /* NULL or N+1 values (then B = 1) */
  int64_t N;
  gdp_tensor *q, *k, *v, *g, *beta, *h0, *cut, *d_o, *dht;
} problem;

static gdp_tensor *random_tensor(gdp_dtype dtype, int ndim, const int64_t *shape, double lo,
                                 double hi) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  double *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  for (int64_t i = 0; i < n; i++) x[i] = tu_rand_uniform(lo, hi);
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, dtype, ndim, shape, GDP_DTYPE_F64, x,
                                (size_t)n * sizeof(double), &t));
  free(x);
  return t;
}

/* The base problem: packed-free, gated, with h0, l2norm, chunked, float64. */
static problem base_problem(void) {
  problem p;
  memset(&p, 0, sizeof p);
  p.B = 2, p.T = 9, p.H = 2, p.K = 5, p.V = 3, p.n = 2;
  p.gated = 1, p.has_h0 = 1, p.l2norm = 1, p.algorithm = GDP_ALGO_CHUNK;
  p.scale = 0.0;
  p.dtype = GDP_DTYPE_F64;
  return p;
}

static void problem_make(problem *p) {
  p->N = p->cu ? 0 : p->B;
  if (p->cu) {
    int64_t count = 0;
    while (p->cu[count] != p->T) count++;
    p->N = count;
  }
  const int64_t B = p->B, T = p->T, H = p->H, K = p->K, V = p->V, n = p->n;
  const gdp_dtype st = p->dtype == GDP_DTYPE_F64 ? GDP_DTYPE_F64 : GDP_DTYPE_F32;
  p->q = random_tensor(p->dtype, 4, (int64_t[]){B, T, H, K}, -1, 1);
  p->k = random_tensor(p->dtype, 4, (int64_t[]){B, T * n, H, K}, -1, 1);
  p->v = random_tensor(p->dtype, 4, (int64_t[]){B, T * n, H, V}, -1, 1);
  p->beta = random_tensor(p->dtype, 3, (int64_t[]){B, T * n, H}, 0, 1);
  p->g = p->gated ? random_tensor(p->dtype, 3, (int64_t[]){B, T, H}, -0.2, -0.01) : NULL;
  p->h0 = p->has_h0 ? random_tensor(st, 4, (int64_t[]){p->N, H, K, V}, -1, 1) : NULL;
  p->d_o = random_tensor(p->dtype, 4, (int64_t[]){B, T, H, V}, -1, 1);
  p->dht = random_tensor(st, 4, (int64_t[]){p->N, H, K, V}, -1, 1);
  p->cut = NULL;
  if (p->cu) {
    double x[16];
    for (int64_t i = 0; i <= p->N; i++) x[i] = (double)p->cu[i];
    CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 1, (int64_t[]){p->N + 1}, GDP_DTYPE_F64, x,
                                  (size_t)(p->N + 1) * sizeof(double), &p->cut));
  }
}

static void problem_free(problem *p) {
  gdp_tensor *all[] = {p->q, p->k, p->v, p->g, p->beta, p->h0, p->cut, p->d_o, p->dht};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(all[i]);
}

static gdp_delta_product_options options_of(const problem *p) {
  gdp_delta_product_options o;
  gdp_delta_product_options_init(&o);
  o.num_householder = p->n;
  o.scale = p->scale;
  o.use_qk_l2norm = p->l2norm;
  o.output_final_state = 1;
  o.algorithm = p->algorithm;
  return o;
}

static gdp_status forward(const problem *p, gdp_tensor **o, gdp_tensor **ht, gdp_delta_product_saved **saved) {
  const gdp_delta_product_options opts = options_of(p);
  return gdp_delta_product_forward_ex(ctx, &opts, p->q, p->k, p->v, p->g, p->beta, p->h0, p->cut, o, ht,
                            saved);
}

/* grads[6] = dq, dk, dv, dbeta, dg, dh0 */
static gdp_status backward(const problem *p, gdp_tensor *grads[6], const gdp_delta_product_saved *saved) {
  const gdp_delta_product_options opts = options_of(p);
  memset(grads, 0, 6 * sizeof grads[0]);
  return gdp_delta_product_backward_ex(ctx, &opts, p->q, p->k, p->v, p->g, p->beta, p->h0, p->cut, p->d_o,
                             p->dht, &grads[0], &grads[1], &grads[2], &grads[3], &grads[4],
                             &grads[5], saved);
}

static void grads_free(gdp_tensor *grads[6]) {
  for (int i = 0; i < 6; i++) gdp_tensor_free(grads[i]), grads[i] = NULL;
}

/* Largest |a - b| (0 for two NULLs; inf when only one is NULL or the sizes differ). */
static double max_abs_diff(const gdp_tensor *a, const gdp_tensor *b) {
  if (!a && !b) return 0.0;
  if (!a || !b || gdp_tensor_numel(a) != gdp_tensor_numel(b)) return INFINITY;
  const int64_t n = gdp_tensor_numel(a);
  double *ha = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  double *hb = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  CHECK_OK(gdp_tensor_to_host(a, GDP_DTYPE_F64, ha, (size_t)n * sizeof(double)));
  CHECK_OK(gdp_tensor_to_host(b, GDP_DTYPE_F64, hb, (size_t)n * sizeof(double)));
  double worst = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double d = fabs(ha[i] - hb[i]);
    if (!(d <= worst)) worst = d;
  }
  free(ha);
  free(hb);
  return worst;
}

/* Saved and plain runs agree exactly (the cpu keeps nothing and recomputes). */
static void test_identical(const char *label, problem p) {
  problem_make(&p);
  gdp_tensor *o0 = NULL, *ht0 = NULL, *o1 = NULL, *ht1 = NULL, *g0[6], *g1[6], *g2[6];
  gdp_delta_product_saved *saved = NULL;
  CHECK_OK(forward(&p, &o0, &ht0, NULL));
  CHECK_OK(forward(&p, &o1, &ht1, &saved));
  CHECK(saved != NULL, "%s: forward_ex gave no saved object", label);
  CHECK(gdp_delta_product_saved_bytes(saved) == 0, "%s: the cpu kept %zu bytes, expected 0", label,
        gdp_delta_product_saved_bytes(saved));
  CHECK(max_abs_diff(o0, o1) == 0.0, "%s: o differs with save_for_backward", label);
  CHECK(max_abs_diff(ht0, ht1) == 0.0, "%s: ht differs with save_for_backward", label);
  CHECK_OK(backward(&p, g0, NULL));
  CHECK_OK(backward(&p, g1, saved));
  CHECK_OK(backward(&p, g2, saved)); /* one saved object serves several backwards */
  static const char *names[6] = {"dq", "dk", "dv", "dbeta", "dg", "dh0"};
  double norm = 0.0;
  for (int i = 0; i < 6; i++) {
    CHECK(max_abs_diff(g0[i], g1[i]) == 0.0, "%s: %s differs with a saved forward", label, names[i]);
    CHECK(max_abs_diff(g0[i], g2[i]) == 0.0, "%s: %s differs in a second saved backward", label,
          names[i]);
    if (g0[i]) {
      double nrm = 0.0;
      CHECK_OK(gdp_tensor_norm(g0[i], &nrm));
      norm += nrm;
    }
  }
  CHECK(norm > 0.0, "%s: all gradients are zero (the comparison would be vacuous)", label);
  printf("  %s: identical with and without saved (bytes %zu)\n", label, gdp_delta_product_saved_bytes(saved));
  gdp_delta_product_saved_free(saved);
  grads_free(g0), grads_free(g1), grads_free(g2);
  gdp_tensor_free(o0), gdp_tensor_free(ht0), gdp_tensor_free(o1), gdp_tensor_free(ht1);
  problem_free(&p);
}

/* The forward of `fwd` saves; the backward of `bwd` (one field changed) must be refused
 * with GDP_ERR_INVALID_ARG and a message containing `needle`. */
static void test_mismatch(const char *needle, problem fwd, problem bwd) {
  problem_make(&fwd);
  problem_make(&bwd);
  gdp_tensor *o = NULL, *ht = NULL, *grads[6];
  gdp_delta_product_saved *saved = NULL;
  CHECK_OK(forward(&fwd, &o, &ht, &saved));
  CHECK_ERR(backward(&bwd, grads, saved), GDP_ERR_INVALID_ARG, needle);
  for (int i = 0; i < 6; i++) CHECK(grads[i] == NULL, "%s: a refused backward left a result", needle);
  /* the same problem is still accepted */
  CHECK_OK(backward(&fwd, grads, saved));
  grads_free(grads);
  /* the plain backward of the other problem works: only the saved object objects */
  CHECK_OK(backward(&bwd, grads, NULL));
  grads_free(grads);
  gdp_delta_product_saved_free(saved);
  gdp_tensor_free(o), gdp_tensor_free(ht);
  problem_free(&fwd), problem_free(&bwd);
}

static void test_mismatches(void) {
  const problem b = base_problem();
  problem x;
  x = b, x.B = 3, test_mismatch("saved: B: expected 2 (the saved forward's), got 3", b, x);
  x = b, x.T = 8, test_mismatch("saved: T: expected 9", b, x);
  x = b, x.H = 3, test_mismatch("saved: H: expected 2", b, x);
  x = b, x.K = 6, test_mismatch("saved: K: expected 5", b, x);
  x = b, x.V = 4, test_mismatch("saved: V: expected 3", b, x);
  x = b, x.n = 3, test_mismatch("saved: num_householder: expected 2", b, x);
  x = b, x.gated = 0, test_mismatch("saved: gated (g given): expected 1", b, x);
  x = b, x.has_h0 = 0, test_mismatch("saved: h0 given: expected 1", b, x);
  x = b, x.l2norm = 0, test_mismatch("saved: use_qk_l2norm: expected 1", b, x);
  x = b, x.scale = 0.25, test_mismatch("saved: scale: expected 0.44721", b, x);
  x = b, x.algorithm = GDP_ALGO_RECURRENT, test_mismatch("saved: algorithm: expected 1", b, x);
  x = b, x.dtype = GDP_DTYPE_F32,
  test_mismatch("saved: dtype: expected f64 (the saved forward's), got f32", b, x);
  /* packed sequences: the values and their count */
  static const int64_t cu_a[] = {0, 5, 12}, cu_b[] = {0, 6, 12}, cu_c[] = {0, 5, 5, 12};
  problem pa = b;
  pa.B = 1, pa.T = 12, pa.cu = cu_a;
  x = pa, x.cu = cu_b, test_mismatch("saved: cu_seqlens[1]: expected 5 (the saved forward's), got 6", pa, x);
  x = pa, x.cu = cu_c, test_mismatch("saved: number of sequences (cu_seqlens entries - 1): expected 2", pa, x);
  /* unpacked forward, packed backward of the same token count */
  problem ua = b;
  ua.B = 1, ua.T = 12;
  x = pa, test_mismatch("saved: number of sequences", ua, x);
  printf("  every recorded field: a mismatch is refused, naming it\n");
}

/* NULL handling, failure leaves *saved NULL, the object outlives the caller's ctx. */
static void test_api(void) {
  gdp_delta_product_saved_free(NULL); /* no-op */
  CHECK(gdp_delta_product_saved_bytes(NULL) == 0, "bytes of NULL");
  problem p = base_problem();
  problem_make(&p);
  gdp_tensor *o = NULL, *ht = NULL, *grads[6];
  gdp_delta_product_saved *saved = (gdp_delta_product_saved *)&p; /* must be overwritten with NULL */
  gdp_delta_product_options opts = options_of(&p);
  /* a failing forward (k of the wrong length) returns no object */
  CHECK_ERR(gdp_delta_product_forward_ex(ctx, &opts, p.q, p.q, p.v, p.g, p.beta, p.h0, NULL, &o, &ht, &saved),
            GDP_ERR_SHAPE, "k");
  CHECK(saved == NULL, "a failing forward_ex left *saved non-NULL");
  CHECK(o == NULL && ht == NULL, "a failing forward_ex left results");
  /* forward_ex without saved is the plain forward */
  CHECK_OK(gdp_delta_product_forward_ex(ctx, &opts, p.q, p.k, p.v, p.g, p.beta, p.h0, NULL, &o, &ht, NULL));
  gdp_tensor_free(o), gdp_tensor_free(ht);
  o = ht = NULL;
  /* the object holds its own reference to the context */
  gdp_ctx *c2 = NULL;
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &c2));
  CHECK_OK(gdp_delta_product_forward_ex(c2, &opts, p.q, p.k, p.v, p.g, p.beta, p.h0, NULL, &o, &ht, &saved));
  gdp_ctx_free(c2);
  CHECK_OK(backward(&p, grads, saved));
  grads_free(grads);
  gdp_delta_product_saved_free(saved);
  gdp_tensor_free(o), gdp_tensor_free(ht);
  problem_free(&p);
  printf("  API: NULL frees, failing forwards, ctx references\n");
}

int main(void) {
  TEST_BEGIN(20261130);
  if (gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx) != GDP_OK) {
    fprintf(stderr, "cannot create the cpu context: %s\n", gdp_last_error());
    return 1;
  }
  test_api();
  problem p = base_problem();
  test_identical("f64 chunk", p);
  p.dtype = GDP_DTYPE_F32, test_identical("f32 chunk", p);
  p = base_problem(), p.algorithm = GDP_ALGO_RECURRENT, p.gated = 0, p.has_h0 = 0;
  test_identical("f64 recurrent, ungated, no h0", p);
  static const int64_t cu[] = {0, 4, 4, 11};
  p = base_problem(), p.B = 1, p.T = 11, p.cu = cu, p.n = 3, p.algorithm = GDP_ALGO_AUTO;
  test_identical("packed with an empty sequence, n=3, auto", p);
  test_mismatches();
  gdp_ctx_free(ctx);
  TEST_END();
}
