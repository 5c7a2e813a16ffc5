/*
 * test_data.c -- the state-tracking generator and the sequence accuracy (gdp.h,
 * "synthetic data") on the cpu, so that the sanitizer pass covers them: every task's
 * labels against prefix products composed here from gdp_state_task_permutation's
 * one-line notations (or sums mod n), the stream's reproducibility rules, the accuracy
 * against a count written here, and the argument errors.  spec/data_spec.lua checks
 * the same against an oracle that builds the groups itself.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

static gdp_ctx *ctx;

static int32_t *host_i32(const gdp_tensor *t, int64_t n) {
  int32_t *h = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_I32, h, (size_t)n * sizeof(int32_t)));
  return h;
}

/* The index of permutation p among the task's elements (linear search). */
static int32_t index_of(gdp_state_task task, int64_t n, const int32_t *p, int k) {
  for (int64_t e = 0; e < n; e++) {
    int32_t q[5], deg = 0;
    CHECK_OK(gdp_state_task_permutation(task, e, q, &deg));
    if (memcmp(p, q, sizeof(int32_t) * (size_t)k) == 0) return (int32_t)e;
  }
  return -1;
}

static void test_task(gdp_state_task task, int64_t modulus) {
  const int64_t B = 5, T = 33;
  int64_t n = 0;
  CHECK_OK(gdp_state_task_size(task, modulus, &n));
  gdp_tensor *tok = NULL, *lab = NULL;
  CHECK_OK(gdp_data_state_tracking(ctx, task, modulus, B, T, 11, 1000, &tok, &lab));
  if (!tok || !lab) return;
  int32_t *x = host_i32(tok, B * T), *y = host_i32(lab, B * T);
  int bad = 0;
  for (int64_t b = 0; b < B; b++) {
    int32_t state[5] = {0, 1, 2, 3, 4}; /* the identity */
    int64_t sum = 0;
    for (int64_t t = 0; t < T; t++) {
      const int32_t xt = x[b * T + t];
      bad += xt < 0 || xt >= n;
      int32_t want;
      if (task == GDP_STATE_TASK_PARITY || task == GDP_STATE_TASK_MODULAR_ADDITION) {
        sum = (sum + xt) % n;
        want = (int32_t)sum;
      } else {
        int32_t q[5], k = 0, next[5];
        CHECK_OK(gdp_state_task_permutation(task, xt, q, &k));
        for (int i = 0; i < k; i++) next[i] = q[state[i]]; /* "state, then x_t" */
        memcpy(state, next, sizeof next);
        want = index_of(task, n, state, k);
      }
      bad += y[b * T + t] != want;
    }
  }
  CHECK(bad == 0, "%s: %d tokens out of range or labels not the prefix products",
        gdp_state_task_name(task), bad);
  /* a shorter draw at a later offset is a block of this one */
  gdp_tensor *tok2 = NULL, *lab2 = NULL;
  CHECK_OK(gdp_data_state_tracking(ctx, task, modulus, 2, 7, 11, 1003, &tok2, &lab2));
  int32_t *x2 = host_i32(tok2, 14);
  int same = 1;
  for (int64_t b = 0; b < 2; b++)
    for (int64_t t = 0; t < 7; t++) same = same && x2[b * 7 + t] == x[(b + 3) * T + t];
  CHECK(same, "%s: offset 1003 length 7 is rows 3, 4 of offset 1000 cut to 7 tokens",
        gdp_state_task_name(task));
  free(x);
  free(y);
  free(x2);
  gdp_tensor_free(tok);
  gdp_tensor_free(lab);
  gdp_tensor_free(tok2);
  gdp_tensor_free(lab2);
}

static void test_accuracy(void) {
  /* 3 sequences of 4 tokens: row 0 all right, row 1 wrong at token 2, row 2 at token 0 */
  const int32_t lab[12] = {1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0};
  const int32_t pred[12] = {1, 2, 3, 4, 5, 6, 0, 8, 9, 0, 0, 0};
  const int64_t shape[2] = {3, 4};
  gdp_tensor *L = NULL, *P = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I32, 2, shape, GDP_DTYPE_I32, lab, sizeof lab, &L));
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I64, 2, shape, GDP_DTYPE_I32, pred, sizeof pred, &P));
  double cum[4], per[4];
  CHECK_OK(gdp_data_sequence_accuracy(P, L, 4, cum, per));
  const double want_cum[4] = {2. / 3, 2. / 3, 1. / 3, 1. / 3};
  const double want_per[4] = {2. / 3, 1, 2. / 3, 1};
  for (int t = 0; t < 4; t++)
    CHECK(cum[t] == want_cum[t] && per[t] == want_per[t], "t = %d: cumulative %g (want %g), per token %g (want %g)",
          t, cum[t], want_cum[t], per[t], want_per[t]);
  CHECK_ERR(gdp_data_sequence_accuracy(P, L, 3, cum, per), GDP_ERR_INVALID_ARG, "n: expected T = 4");
  CHECK_ERR(gdp_data_sequence_accuracy(L, NULL, 4, cum, per), GDP_ERR_INVALID_ARG, "expected tensors");
  gdp_tensor_free(L);
  gdp_tensor_free(P);
}

static void test_errors(void) {
  gdp_tensor *t = NULL, *l = NULL;
  CHECK_ERR(gdp_data_state_tracking(ctx, GDP_STATE_TASK_COUNT, 0, 1, 1, 1, 0, &t, &l),
            GDP_ERR_INVALID_ARG, "task: expected 0..5");
  CHECK_ERR(gdp_data_state_tracking(ctx, GDP_STATE_TASK_S3, 4, 1, 1, 1, 0, &t, &l),
            GDP_ERR_INVALID_ARG, "modulus: expected 0 for task S3");
  CHECK_ERR(gdp_data_state_tracking(ctx, GDP_STATE_TASK_MODULAR_ADDITION, 1, 1, 1, 1, 0, &t, &l),
            GDP_ERR_INVALID_ARG, "modulus: expected 2..2147483647");
  CHECK_ERR(gdp_data_state_tracking(ctx, GDP_STATE_TASK_S5, 0, -2, 1, 1, 0, &t, &l),
            GDP_ERR_INVALID_ARG, "batch: expected >= 0, got -2");
  CHECK_ERR(gdp_data_state_tracking(ctx, GDP_STATE_TASK_S5, 0, 2, 1, 1, UINT64_C(1) << 63, &t, &l),
            GDP_ERR_INVALID_ARG, "offset + batch <= 2^63");
  CHECK(t == NULL && l == NULL, "failed calls leave NULL results");
  int32_t p[5], k;
  CHECK_ERR(gdp_state_task_permutation(GDP_STATE_TASK_A5, 60, p, &k), GDP_ERR_INVALID_ARG,
            "index: expected 0..59");
  gdp_state_task task;
  CHECK_ERR(gdp_state_task_from_name("s5", &task), GDP_ERR_INVALID_ARG, "got 's5'");
  CHECK_OK(gdp_state_task_from_name("A5", &task));
  CHECK(task == GDP_STATE_TASK_A5, "A5 by name");
}

int main(void) {
  TEST_BEGIN(1);
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx));
  test_task(GDP_STATE_TASK_PARITY, 0);
  test_task(GDP_STATE_TASK_MODULAR_ADDITION, 7);
  test_task(GDP_STATE_TASK_S3, 0);
  test_task(GDP_STATE_TASK_S4, 0);
  test_task(GDP_STATE_TASK_A5, 0);
  test_task(GDP_STATE_TASK_S5, 0);
  test_accuracy();
  test_errors();
  gdp_ctx_free(ctx);
  TEST_END();
}
