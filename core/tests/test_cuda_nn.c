/*
 * test_cuda_nn.c -- the model layer ops on cuda (gdp.h, "model layer ops": the
 * embedding and its backward, the cross-entropy) against the CPU backend in float64 on
 * the same inputs, and their index checks, which cuda answers at the next wait on the
 * device: a bad token or target lets the op return, the next wait (gdp_ctx_sync, a read
 * back) fails with the op's message, the wait after it is clean, and more checks than
 * the slots between two waits make the op that finds them full wait and report the
 * first failure.  Being plain C, it also runs under compute-sanitizer (tools/gpu_run.sh
 * check: the verdicts are written by the device into mapped pinned memory).
 *
 * Exits 77 (ctest: skipped) when there is no CUDA device.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

#define SEED 0x6e6e5f6375646121ull /* "nn_cuda!" */

static gdp_ctx *cpu, *gpu;

static gdp_tensor *ids_on(gdp_ctx *ctx, gdp_dtype dt, int nd, const int64_t *shape,
                          const int64_t *v) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++) n *= shape[i];
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, dt, nd, shape, GDP_DTYPE_I64, v,
                                (size_t)(n ? n : 1) * sizeof(int64_t), &t));
  return t;
}

enum { V = 7, D = 24, B = 3, T = 101 };

/* weights and d_out rounded through float32, so that both sides see the same numbers */
static void float_pair(int nd, const int64_t *shape, gdp_tensor **g, gdp_tensor **c) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++) n *= shape[i];
  double *v = malloc((size_t)n * sizeof *v);
  for (int64_t i = 0; i < n; i++) v[i] = (double)(float)tu_rand_normal();
  *g = tu_tensor_from_f64(gpu, GDP_DTYPE_F32, nd, shape, v);
  *c = tu_tensor_from_f64(cpu, GDP_DTYPE_F64, nd, shape, v);
  free(v);
}

static void test_ops(void) {
  const int64_t ws[2] = {V, D}, ts[2] = {B, T}, ds[3] = {B, T, D}, ls[3] = {B, T, V};
  int64_t tok[B * T];
  for (int i = 0; i < B * T; i++) tok[i] = (i * 5 + i / 11) % V;
  tok[7] = -100; /* ignored by the loss */
  gdp_tensor *wg, *wc, *dg, *dc, *lg, *lc;
  float_pair(2, ws, &wg, &wc);
  float_pair(3, ds, &dg, &dc);
  float_pair(3, ls, &lg, &lc);
  int64_t emb_tok[B * T];
  memcpy(emb_tok, tok, sizeof tok);
  emb_tok[7] = 3;
  for (int d = 0; d < 2; d++) {
    const gdp_dtype idt = d ? GDP_DTYPE_I64 : GDP_DTYPE_I32;
    gdp_tensor *tg = ids_on(gpu, idt, 2, ts, emb_tok), *tc = ids_on(cpu, GDP_DTYPE_I64, 2, ts, emb_tok);
    gdp_tensor *og = NULL, *oc = NULL, *gg = NULL, *gc = NULL;
    CHECK_OK(gdp_nn_embedding_forward(gpu, wg, tg, &og));
    CHECK_OK(gdp_nn_embedding_forward(cpu, wc, tc, &oc));
    tu_expect_near("embedding forward", og, oc, 1e-6);
    CHECK_OK(gdp_nn_embedding_backward(gpu, tg, dg, V, &gg));
    CHECK_OK(gdp_nn_embedding_backward(cpu, tc, dc, V, &gc));
    tu_expect_near("embedding backward", gg, gc, 1e-5);
    gdp_tensor_free(og), gdp_tensor_free(oc), gdp_tensor_free(gg), gdp_tensor_free(gc);
    gdp_tensor_free(tg), gdp_tensor_free(tc);
    /* the loss, its result tensor and its gradient */
    tg = ids_on(gpu, idt, 2, ts, tok), tc = ids_on(cpu, GDP_DTYPE_I64, 2, ts, tok);
    gdp_tensor *rg = NULL, *xg = NULL, *xc = NULL;
    double loss_c = 0, loss_g = 0, res[2] = {0, 0};
    int64_t count_c = 0, count_g = 0;
    CHECK_OK(gdp_nn_cross_entropy(cpu, lc, tc, NULL, -100, &loss_c, &count_c, &xc));
    CHECK_OK(gdp_nn_cross_entropy(gpu, lg, tg, NULL, -100, &loss_g, &count_g, &xg));
    CHECK(count_g == count_c && count_c == B * T - 1, "counted rows: cuda %lld, cpu %lld",
          (long long)count_g, (long long)count_c);
    CHECK(fabs(loss_g - loss_c) <= 1e-5 * loss_c, "loss: cuda %.10g, cpu %.10g", loss_g, loss_c);
    tu_expect_near("cross-entropy gradient", xg, xc, 1e-5);
    gdp_tensor_free(xg);
    CHECK_OK(gdp_nn_cross_entropy_result(gpu, lg, tg, NULL, -100, &rg, NULL));
    CHECK(rg && gdp_tensor_numel(rg) == 2, "the result is [2]");
    if (rg) CHECK_OK(gdp_tensor_to_host(rg, GDP_DTYPE_F64, res, sizeof res));
    CHECK(res[0] == loss_g && res[1] == (double)count_g, "result {%.10g, %g}, read {%.10g, %lld}",
          res[0], res[1], loss_g, (long long)count_g);
    gdp_tensor_free(rg), gdp_tensor_free(xc), gdp_tensor_free(tg), gdp_tensor_free(tc);
  }
  gdp_tensor_free(wg), gdp_tensor_free(wc), gdp_tensor_free(dg), gdp_tensor_free(dc);
  gdp_tensor_free(lg), gdp_tensor_free(lc);
}

static void test_deferred_checks(void) {
  const int64_t ws[2] = {V, D}, ts[2] = {B, T}, ls[3] = {B, T, V}, ds[3] = {B, T, D};
  gdp_tensor *wg, *wc, *lg, *lc, *dg, *dc;
  float_pair(2, ws, &wg, &wc);
  float_pair(3, ls, &lg, &lc);
  float_pair(3, ds, &dg, &dc);
  int64_t tok[B * T];
  for (int i = 0; i < B * T; i++) tok[i] = i % V;
  tok[T + 1] = 9, tok[2 * T] = -1; /* [1,1] first */
  gdp_tensor *bad = ids_on(gpu, GDP_DTYPE_I32, 2, ts, tok), *out = NULL, *dw = NULL;
  /* the op returns; the next wait reports it; the one after is clean */
  CHECK_OK(gdp_nn_embedding_forward(gpu, wg, bad, &out));
  CHECK_ERR(gdp_ctx_sync(gpu), GDP_ERR_INVALID_ARG,
            "gdp_nn_embedding_forward: tokens: expected values in [0, 7) (num_embeddings), got 9 at [1,1]");
  CHECK_OK(gdp_ctx_sync(gpu));
  CHECK_OK(gdp_nn_embedding_backward(gpu, bad, dg, V, &dw));
  double dw_host[V * D];
  CHECK_ERR(gdp_tensor_to_host(dw, GDP_DTYPE_F64, dw_host, sizeof dw_host), GDP_ERR_INVALID_ARG,
            "gdp_nn_embedding_backward: tokens: expected values in [0, 7) (num_embeddings), got 9 at [1,1]");
  CHECK_OK(gdp_ctx_sync(gpu));
  gdp_tensor_free(out), gdp_tensor_free(dw), gdp_tensor_free(bad);
  /* host tokens are checked on the device too */
  bad = ids_on(cpu, GDP_DTYPE_I64, 2, ts, tok);
  out = NULL;
  CHECK_OK(gdp_nn_embedding_forward(gpu, wg, bad, &out));
  CHECK_ERR(gdp_ctx_sync(gpu), GDP_ERR_INVALID_ARG, "got 9 at [1,1]");
  gdp_tensor_free(out), gdp_tensor_free(bad);
  /* a bad target: the loss read back fails; its result tensor's read back too */
  for (int i = 0; i < B * T; i++) tok[i] = i % V;
  tok[4] = 7;
  bad = ids_on(gpu, GDP_DTYPE_I64, 2, ts, tok);
  double loss = 0;
  int64_t count = 0;
  CHECK_ERR(gdp_nn_cross_entropy(gpu, lg, bad, NULL, -100, &loss, &count, NULL),
            GDP_ERR_INVALID_ARG,
            "gdp_nn_cross_entropy: targets: expected values in [0, 7) (logits' last dim) or "
            "ignore_index = -100, got 7 at [0,4]");
  gdp_tensor *res = NULL;
  CHECK_OK(gdp_nn_cross_entropy_result(gpu, lg, bad, NULL, -100, &res, NULL));
  double r[2];
  CHECK_ERR(gdp_tensor_to_host(res, GDP_DTYPE_F64, r, sizeof r), GDP_ERR_INVALID_ARG, "got 7 at [0,4]");
  CHECK_OK(gdp_ctx_sync(gpu));
  gdp_tensor_free(res), gdp_tensor_free(bad);
  /* more checks than slots between two waits: the first failure, from the op that waits */
  const int64_t n1 = 40;
  gdp_status first_error = GDP_OK;
  int failed_at = -1;
  for (int i = 0; i < 70 && first_error == GDP_OK; i++) {
    int64_t t1[40];
    for (int j = 0; j < n1; j++) t1[j] = j % V;
    t1[i % n1] = 100 + i;
    gdp_tensor *b1 = ids_on(gpu, GDP_DTYPE_I32, 1, &n1, t1), *o1 = NULL;
    first_error = gdp_nn_embedding_forward(gpu, wg, b1, &o1);
    if (first_error != GDP_OK) failed_at = i;
    gdp_tensor_free(o1), gdp_tensor_free(b1);
  }
  CHECK(first_error == GDP_ERR_INVALID_ARG && failed_at > 0 && failed_at < 70,
        "70 bad embeddings without a wait: %s at call %d", gdp_status_name(first_error), failed_at);
  CHECK(strstr(gdp_last_error(), "got 100 at [0]") != NULL, "the first failure reported: %s",
        gdp_last_error());
  CHECK_OK(gdp_ctx_sync(gpu));
  /* and the context goes on */
  for (int i = 0; i < B * T; i++) tok[i] = i % V;
  gdp_tensor *good = ids_on(gpu, GDP_DTYPE_I32, 2, ts, tok), *goodc = ids_on(cpu, GDP_DTYPE_I64, 2, ts, tok);
  gdp_tensor *og = NULL, *oc = NULL;
  CHECK_OK(gdp_nn_embedding_forward(gpu, wg, good, &og));
  CHECK_OK(gdp_nn_embedding_forward(cpu, wc, goodc, &oc));
  tu_expect_near("embedding after the errors", og, oc, 1e-6);
  gdp_tensor_free(og), gdp_tensor_free(oc), gdp_tensor_free(good), gdp_tensor_free(goodc);
  gdp_tensor_free(wg), gdp_tensor_free(wc), gdp_tensor_free(lg), gdp_tensor_free(lc);
  gdp_tensor_free(dg), gdp_tensor_free(dc);
}

static void run(gdp_ctx *c, gdp_ctx *g) {
  cpu = c, gpu = g;
  test_ops();
  test_deferred_checks();
}

CUDA_TEST_MAIN(SEED, run)
