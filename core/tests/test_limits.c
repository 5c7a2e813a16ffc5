/*
 * test_limits.c -- the CPU operator at the edges of its sizes, and cancellation.
 *
 *   - sizes whose workspace would overflow size_t, or whose BLAS dimensions pass
 *     INT_MAX, are errors before anything is allocated or touched (the buffers given
 *     here are NULL: a kernel that went on would crash);
 *   - a problem without tokens allocates nothing (K = 2^40 would need terabytes) and
 *     passes the states through (ht = h0, dh0 = dht);
 *   - the interrupt flag, set mid-op by the test hook, stops the chunked and the
 *     recurrent kernels and the public ops with GDP_ERR_INTERRUPTED and no leak (this
 *     test runs under ASan in ./gdp test), and a cleared flag lets the next call run.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/gdp_cpu.h"
#include "size_check.h"
#include "testutil.h"

static gdp_delta_product_problem problem(int64_t N, const int64_t *cu, int64_t H, int64_t K,
                                         int64_t V, int64_t n, int64_t C) {
  gdp_delta_product_problem p;
  memset(&p, 0, sizeof p);
  p.N = N;
  p.cu_seqlens = cu;
  p.T_total = cu[N];
  p.H = H;
  p.K = K;
  p.V = V;
  p.n = n;
  p.scale = 1.0;
  p.chunk_size = C;
  p.num_threads = 2;
  p.dtype = GDP_DTYPE_F64;
  p.algorithm = GDP_ALGO_CHUNK;
  return p;
}

static void test_size_helpers(void) {
  size_t acc = 0;
  CHECK(gdp_size_mac(&acc, 3, 4, 5) && acc == 60, "3*4*5 = 60, got %zu", acc);
  CHECK(!gdp_size_mac(&acc, SIZE_MAX / 2, 3, 1), "SIZE_MAX/2 * 3 must overflow");
  acc = SIZE_MAX - 1;
  CHECK(!gdp_size_mac(&acc, 1, 1, 2), "a sum past SIZE_MAX must overflow");
  size_t out;
  CHECK(!gdp_size_product(&out, -1, 1, 1), "a negative size is rejected");
  CHECK(gdp_size_product(&out, 0, INT64_MAX, 8) && out == 0, "0 * anything = 0");
  CHECK(gdp_blas_int_ok(INT_MAX) && !gdp_blas_int_ok((int64_t)INT_MAX + 1) && !gdp_blas_int_ok(-1),
        "BLAS int range");
}

/* Workspaces that would wrap size_t: V = 2^31 - 1, chunks of 2^30 - 1 steps, two
 * sequences (two workers). */
static void test_workspace_overflow(void) {
  const int64_t T = ((int64_t)1 << 30) - 1, V = INT_MAX;
  const int64_t cu[3] = {0, T, 2 * T};
  gdp_delta_product_problem p = problem(2, cu, 1, 1, V, 1, T);
  gdp_delta_product_forward_io fio = {0};
  gdp_delta_product_backward_io bio = {0};
  CHECK_ERR(gdp_cpu_delta_product_forward_chunk_f64(&p, &fio), GDP_ERR_INVALID_ARG, "overflows size_t");
  CHECK_ERR(gdp_cpu_delta_product_forward_chunk_f32(&p, &fio), GDP_ERR_INVALID_ARG, "overflows size_t");
  CHECK_ERR(gdp_cpu_delta_product_backward_chunk_f64(&p, &bio), GDP_ERR_INVALID_ARG, "overflows size_t");
  CHECK_ERR(gdp_cpu_delta_product_backward_chunk_f32(&p, &bio), GDP_ERR_INVALID_ARG, "overflows size_t");

  /* The recurrence's state: K x V doubles past size_t. */
  gdp_delta_product_problem r = problem(1, cu, 1, (int64_t)1 << 40, (int64_t)1 << 40, 1, 0);
  CHECK_ERR(gdp_cpu_delta_product_forward_recurrent_f64(&r, &fio), GDP_ERR_INVALID_ARG, "overflows size_t");
  CHECK_ERR(gdp_cpu_delta_product_backward_recurrent_f64(&r, &bio), GDP_ERR_INVALID_ARG, "overflows size_t");
}

/* A chunk of 2^31 steps: BLAS dimensions past INT_MAX. */
static void test_blas_dims(void) {
  const int64_t T = (int64_t)1 << 31;
  const int64_t cu[2] = {0, T};
  gdp_delta_product_problem p = problem(1, cu, 1, 1, 1, 1, T);
  gdp_delta_product_forward_io fio = {0};
  gdp_delta_product_backward_io bio = {0};
  CHECK_ERR(gdp_cpu_delta_product_forward_chunk_f64(&p, &fio), GDP_ERR_INVALID_ARG, "BLAS's int");
  CHECK_ERR(gdp_cpu_delta_product_backward_chunk_f32(&p, &bio), GDP_ERR_INVALID_ARG, "BLAS's int");
  /* H*K past INT_MAX */
  const int64_t cu1[2] = {0, 1};
  gdp_delta_product_problem q = problem(1, cu1, (int64_t)1 << 16, (int64_t)1 << 16, 1, 1, 0);
  CHECK_ERR(gdp_cpu_delta_product_forward_chunk_f64(&q, &fio), GDP_ERR_INVALID_ARG, "H*K");
}

/* No tokens: K = 2^40 would need a 2^43-byte workspace; nothing is allocated. */
static void test_zero_tokens(void) {
  const int64_t cu[3] = {0, 0, 0};
  gdp_delta_product_problem p = problem(2, cu, 1, (int64_t)1 << 40, 1, 2, 0);
  gdp_delta_product_forward_io fio = {0};
  gdp_delta_product_backward_io bio = {0};
  CHECK_OK(gdp_cpu_delta_product_forward_chunk_f64(&p, &fio));
  CHECK_OK(gdp_cpu_delta_product_forward_chunk_f32(&p, &fio));
  CHECK_OK(gdp_cpu_delta_product_backward_chunk_f64(&p, &bio));
  CHECK_OK(gdp_cpu_delta_product_backward_chunk_f32(&p, &bio));

  /* ... and the states pass through: ht = h0, dh0 = dht (zeros without them). */
  gdp_delta_product_problem s = problem(2, cu, 2, 3, 4, 2, 0);
  double h0[48], ht[48], dh0[48];
  for (int i = 0; i < 48; i++) h0[i] = tu_rand_normal(), ht[i] = NAN, dh0[i] = NAN;
  fio.h0 = h0, fio.ht = ht;
  CHECK_OK(gdp_cpu_delta_product_forward_chunk_f64(&s, &fio));
  CHECK(memcmp(h0, ht, sizeof h0) == 0, "zero tokens: ht must equal h0");
  bio.dht = NULL, bio.dh0 = dh0;
  CHECK_OK(gdp_cpu_delta_product_backward_chunk_f64(&s, &bio));
  int zeros = 1;
  for (int i = 0; i < 48; i++) zeros &= dh0[i] == 0.0;
  CHECK(zeros, "zero tokens without dht: dh0 must be zeros");
}

/* A problem long enough for many polls: 4 sequences x 2 heads of 300 tokens, n = 2. */
typedef struct longp {
  int64_t cu[5];
  gdp_delta_product_problem p;
  double *q, *k, *v, *beta, *g, *o, *d_o, *dq, *dk, *dv, *dbeta, *dg;
} longp;

static double *randn(int64_t count) {
  double *x = malloc((size_t)count * sizeof(double));
  for (int64_t i = 0; i < count; i++) x[i] = 0.3 * tu_rand_normal();
  return x;
}

static void longp_make(longp *L) {
  const int64_t T = 1200, H = 2, K = 16, V = 16, n = 2;
  for (int s = 0; s <= 4; s++) L->cu[s] = s * 300;
  L->p = problem(4, L->cu, H, K, V, n, 16);
  L->q = randn(T * H * K), L->k = randn(T * n * H * K), L->v = randn(T * n * H * V);
  L->beta = randn(T * n * H), L->g = randn(T * H), L->d_o = randn(T * H * V);
  for (int64_t i = 0; i < T * n * H; i++) L->beta[i] = 0.5;
  for (int64_t i = 0; i < T * H; i++) L->g[i] = -0.05;
  L->o = randn(T * H * V), L->dq = randn(T * H * K), L->dk = randn(T * n * H * K);
  L->dv = randn(T * n * H * V), L->dbeta = randn(T * n * H), L->dg = randn(T * H);
}

static void longp_free(longp *L) {
  free(L->q), free(L->k), free(L->v), free(L->beta), free(L->g), free(L->o), free(L->d_o);
  free(L->dq), free(L->dk), free(L->dv), free(L->dbeta), free(L->dg);
}

static void test_kernels_interrupted(void) {
  longp L;
  longp_make(&L);
  gdp_delta_product_forward_io fio = {L.q, L.k, L.v, L.g, L.beta, NULL, L.o, NULL};
  gdp_delta_product_backward_io bio;
  memset(&bio, 0, sizeof bio);
  bio.q = L.q, bio.k = L.k, bio.v = L.v, bio.g = L.g, bio.beta = L.beta, bio.d_o = L.d_o;
  bio.dq = L.dq, bio.dk = L.dk, bio.dv = L.dv, bio.dbeta = L.dbeta, bio.dg = L.dg;

  for (int algo = 0; algo < 2; algo++) {
    L.p.algorithm = algo ? GDP_ALGO_RECURRENT : GDP_ALGO_CHUNK;
    gdp_status (*fwd)(const gdp_delta_product_problem *, const gdp_delta_product_forward_io *) =
        algo ? gdp_cpu_delta_product_forward_recurrent_f64 : gdp_cpu_delta_product_forward_chunk_f64;
    gdp_status (*bwd)(const gdp_delta_product_problem *, const gdp_delta_product_backward_io *) =
        algo ? gdp_cpu_delta_product_backward_recurrent_f64 : gdp_cpu_delta_product_backward_chunk_f64;
    gdp_interrupt_request_after(5); /* mid-op: after a few chunks (token blocks) */
    CHECK_ERR(fwd(&L.p, &fio), GDP_ERR_INTERRUPTED, "interrupted");
    CHECK(gdp_interrupt_requested(), "the flag stays set until cleared");
    CHECK_ERR(fwd(&L.p, &fio), GDP_ERR_INTERRUPTED, "interrupted");
    gdp_interrupt_clear();
    CHECK_OK(fwd(&L.p, &fio));
    gdp_interrupt_request_after(5);
    CHECK_ERR(bwd(&L.p, &bio), GDP_ERR_INTERRUPTED, "interrupted");
    gdp_interrupt_clear();
    CHECK_OK(bwd(&L.p, &bio));
  }
  longp_free(&L);
}

/* Through the public ops: the interrupted call makes no outputs and leaks nothing. */
static void test_ops_interrupted(void) {
  gdp_ctx *ctx;
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx));
  const int64_t B = 1, T = 600, H = 2, K = 16, V = 16, n = 2;
  const int64_t sq[4] = {B, T, H, K}, sk[4] = {B, T * n, H, K}, sv[4] = {B, T * n, H, V};
  const int64_t sb[3] = {B, T * n, H}, so[4] = {B, T, H, V};
  gdp_tensor *q, *k, *v, *beta, *d_o, *o = NULL, *ht = NULL;
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 4, sq, &q));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 4, sk, &k));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 4, sv, &v));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 3, sb, &beta));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 4, so, &d_o));
  CHECK_OK(gdp_tensor_normal(q, 0, 1));
  CHECK_OK(gdp_tensor_normal(k, 0, 1));
  CHECK_OK(gdp_tensor_normal(v, 0, 1));
  CHECK_OK(gdp_tensor_uniform(beta, 0, 1));
  CHECK_OK(gdp_tensor_normal(d_o, 0, 1));
  gdp_delta_product_options opts;
  gdp_delta_product_options_init(&opts);
  opts.num_householder = n;
  opts.chunk_size = 16;
  opts.use_qk_l2norm = 1;
  opts.output_final_state = 1;
  const int64_t live = gdp_mem_live_bytes(GDP_DEVICE_CPU);

  gdp_interrupt_request_after(3);
  CHECK_ERR(gdp_delta_product_forward(ctx, &opts, q, k, v, NULL, beta, NULL, NULL, &o, &ht),
            GDP_ERR_INTERRUPTED, "interrupted");
  CHECK(o == NULL && ht == NULL, "an interrupted forward makes no outputs");
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CPU) == live, "an interrupted forward leaks: %lld bytes live, were %lld",
        (long long)gdp_mem_live_bytes(GDP_DEVICE_CPU), (long long)live);
  gdp_tensor *dq = NULL, *dk = NULL, *dv = NULL, *db = NULL, *dg = NULL, *dh0 = NULL;
  gdp_interrupt_request_after(3);
  CHECK_ERR(gdp_delta_product_backward(ctx, &opts, q, k, v, NULL, beta, NULL, NULL, d_o, NULL, &dq, &dk,
                                       &dv, &db, &dg, &dh0),
            GDP_ERR_INTERRUPTED, "interrupted");
  CHECK(dq == NULL && dk == NULL && dv == NULL && db == NULL, "an interrupted backward makes no outputs");
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CPU) == live, "an interrupted backward leaks");
  gdp_interrupt_clear();
  CHECK_OK(gdp_delta_product_forward(ctx, &opts, q, k, v, NULL, beta, NULL, NULL, &o, &ht));
  CHECK(o != NULL && ht != NULL, "after clearing the flag the forward runs");
  gdp_tensor_free(o), gdp_tensor_free(ht);

  /* matmul polls once per call */
  const int64_t s2[2] = {4, 4};
  gdp_tensor *a, *c;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, s2, &a));
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, s2, &c));
  gdp_interrupt_request();
  CHECK_ERR(gdp_tensor_matmul(c, a, a, 0, 0, 1.0, 0.0), GDP_ERR_INTERRUPTED, "interrupted");
  gdp_interrupt_clear();
  CHECK_OK(gdp_tensor_matmul(c, a, a, 0, 0, 1.0, 0.0));
  gdp_tensor_free(a), gdp_tensor_free(c);
  gdp_tensor_free(q), gdp_tensor_free(k), gdp_tensor_free(v), gdp_tensor_free(beta);
  gdp_tensor_free(d_o);
  gdp_ctx_free(ctx);
}

int main(void) {
  TEST_BEGIN(20261202);
  CHECK(strcmp(gdp_status_name(GDP_ERR_INTERRUPTED), "GDP_ERR_INTERRUPTED") == 0, "status name");
  test_size_helpers();
  test_workspace_overflow();
  test_blas_dims();
  test_zero_tokens();
  test_kernels_interrupted();
  test_ops_interrupted();
  TEST_END();
}
