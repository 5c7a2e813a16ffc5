/*
 * test_optim.c -- the fused optimiser updates (gdp.h, "optimisers") on the cpu.
 *
 * AdamW and SGD (momentum, dampening, Nesterov) run several steps on fresh random
 * gradients and are compared with plain float64 loops written here: float64 params
 * within 1e-13, float32 within 1e-6, bf16 params through their float32 masters within
 * 1e-6, the bf16 param equal to the master rounded once.  Validation errors are
 * checked by status and message; empty tensors are a no-op.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

enum { N = 37, STEPS = 4 };

static gdp_ctx *ctx;

static gdp_tensor *mk(gdp_dtype dt, const double *x, int64_t n) {
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, dt, 1, &n, GDP_DTYPE_F64, x, (size_t)n * sizeof(double), &t));
  return t;
}

static void host(const gdp_tensor *t, double *out, int64_t n) {
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_F64, out, (size_t)n * sizeof(double)));
}

static void set(gdp_tensor *t, const double *x, int64_t n) {
  gdp_tensor *src = mk(GDP_DTYPE_F64, x, n);
  CHECK_OK(gdp_tensor_copy(NULL, t, src));
  gdp_tensor_free(src);
}

static void adamw_ref(double *p, const double *g, double *m, double *v, double lr, double b1,
                      double b2, double eps, double wd, int t) {
  for (int i = 0; i < N; i++) {
    p[i] *= 1 - lr * wd;
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    const double mhat = m[i] / (1 - pow(b1, t)), vhat = v[i] / (1 - pow(b2, t));
    p[i] -= lr * mhat / (sqrt(vhat) + eps);
  }
}

/* param dtype pd, grad dtype gd; masters when pd is bf16. */
static void test_adamw(gdp_dtype pd, gdp_dtype gd, double tol) {
  const gdp_dtype sd = pd == GDP_DTYPE_F64 ? GDP_DTYPE_F64 : GDP_DTYPE_F32;
  double p0[N], ref[N], m[N] = {0}, v[N] = {0}, g[N], got[N];
  for (int i = 0; i < N; i++) p0[i] = tu_rand_normal();
  gdp_tensor *p = mk(pd, p0, N), *gt = mk(gd, p0, N), *mt = mk(sd, m, N), *vt = mk(sd, v, N);
  gdp_tensor *master = NULL;
  host(p, ref, N); /* the reference starts from the param's rounded values */
  if (pd == GDP_DTYPE_BF16) master = mk(GDP_DTYPE_F32, ref, N);
  for (int t = 1; t <= STEPS; t++) {
    for (int i = 0; i < N; i++) g[i] = tu_rand_normal();
    set(gt, g, N);
    host(gt, g, N); /* the values the kernel reads */
    adamw_ref(ref, g, m, v, 0.01, 0.9, 0.99, 1e-8, 0.1, t);
    CHECK_OK(gdp_optim_adamw_step(p, gt, mt, vt, master, 0.01, 0.9, 0.99, 1e-8, 0.1, t));
  }
  host(master ? master : p, got, N);
  double err = tu_rel_err_f64(got, ref, N);
  CHECK(err <= tol, "adamw %s/%s: relative error %.3e > %.0e", gdp_dtype_name(pd), gdp_dtype_name(gd),
        err, tol);
  if (master) {
    double pv[N];
    host(p, pv, N);
    int same = 1;
    for (int i = 0; i < N; i++)
      same &= pv[i] == (double)gdp_f32_from_bf16(gdp_bf16_from_f32((float)got[i]));
    CHECK(same, "bf16 param is not the master rounded to bf16");
  }
  gdp_tensor_free(p);
  gdp_tensor_free(gt);
  gdp_tensor_free(mt);
  gdp_tensor_free(vt);
  gdp_tensor_free(master);
}

static void test_sgd(gdp_dtype pd, int nesterov, double tol) {
  const double lr = 0.05, mom = 0.9, damp = nesterov ? 0 : 0.3, wd = 0.01;
  double ref[N], buf[N] = {0}, g[N], got[N];
  for (int i = 0; i < N; i++) ref[i] = tu_rand_normal();
  gdp_tensor *p = mk(pd, ref, N), *gt = mk(pd, ref, N), *bt = mk(pd, buf, N);
  host(p, ref, N);
  for (int t = 1; t <= STEPS; t++) {
    for (int i = 0; i < N; i++) g[i] = tu_rand_normal();
    set(gt, g, N);
    host(gt, g, N);
    for (int i = 0; i < N; i++) {
      double d = g[i] + wd * ref[i];
      buf[i] = t == 1 ? d : mom * buf[i] + (1 - damp) * d;
      d = nesterov ? d + mom * buf[i] : buf[i];
      ref[i] -= lr * d;
    }
    CHECK_OK(gdp_optim_sgd_step(p, gt, bt, NULL, lr, mom, damp, wd, nesterov, t));
  }
  host(p, got, N);
  double err = tu_rel_err_f64(got, ref, N);
  CHECK(err <= tol, "sgd %s nesterov %d: relative error %.3e > %.0e", gdp_dtype_name(pd), nesterov,
        err, tol);
  gdp_tensor_free(p);
  gdp_tensor_free(gt);
  gdp_tensor_free(bt);
}

static void test_errors(void) {
  double z[N] = {0};
  gdp_tensor *p = mk(GDP_DTYPE_F32, z, N), *g = mk(GDP_DTYPE_F32, z, N);
  gdp_tensor *m = mk(GDP_DTYPE_F32, z, N), *v = mk(GDP_DTYPE_F32, z, N);
  gdp_tensor *g64 = mk(GDP_DTYPE_F64, z, N), *short_g = mk(GDP_DTYPE_F32, z, N - 1);
  CHECK_ERR(gdp_optim_adamw_step(NULL, g, m, v, NULL, 1e-3, 0.9, 0.999, 1e-8, 0, 1),
            GDP_ERR_INVALID_ARG, "param: expected a tensor, got NULL");
  CHECK_ERR(gdp_optim_adamw_step(p, g64, m, v, NULL, 1e-3, 0.9, 0.999, 1e-8, 0, 1), GDP_ERR_DTYPE,
            "grad: expected dtype f32 for a f32 param, got f64");
  CHECK_ERR(gdp_optim_adamw_step(p, short_g, m, v, NULL, 1e-3, 0.9, 0.999, 1e-8, 0, 1),
            GDP_ERR_SHAPE, "grad: expected param's shape [37], got [36]");
  CHECK_ERR(gdp_optim_adamw_step(p, g, m, m, NULL, 1e-3, 0.9, 0.999, 1e-8, 0, 1),
            GDP_ERR_INVALID_ARG, "exp_avg and exp_avg_sq share memory");
  CHECK_ERR(gdp_optim_adamw_step(p, g, m, v, NULL, 1e-3, 0.9, 0.999, 0, 0, 1), GDP_ERR_INVALID_ARG,
            "eps: expected a finite number > 0, got 0");
  CHECK_ERR(gdp_optim_sgd_step(p, g, m, NULL, 0.1, 0.9, 0.5, 0, 1, 1), GDP_ERR_INVALID_ARG,
            "nesterov: needs momentum > 0 and dampening 0");
  CHECK_ERR(gdp_optim_sgd_step(p, g, m, NULL, 0.1, 0, 0, 0, 0, 1), GDP_ERR_INVALID_ARG,
            "momentum_buffer: expected NULL when momentum is 0");
  gdp_tensor *e = NULL, *eg = NULL, *em = NULL, *ev = NULL;
  int64_t zero = 0;
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 1, &zero, &e));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 1, &zero, &eg));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 1, &zero, &em));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 1, &zero, &ev));
  CHECK_OK(gdp_optim_adamw_step(e, eg, em, ev, NULL, 1e-3, 0.9, 0.999, 1e-8, 0, 1));
  gdp_tensor *all[] = {p, g, m, v, g64, short_g, e, eg, em, ev};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gdp_tensor_free(all[i]);
}

int main(void) {
  TEST_BEGIN(20261202);
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx));
  test_adamw(GDP_DTYPE_F64, GDP_DTYPE_F64, 1e-13);
  test_adamw(GDP_DTYPE_F32, GDP_DTYPE_F32, 1e-6);
  test_adamw(GDP_DTYPE_BF16, GDP_DTYPE_BF16, 1e-6);
  test_adamw(GDP_DTYPE_BF16, GDP_DTYPE_F32, 1e-6);
  test_sgd(GDP_DTYPE_F64, 0, 1e-13);
  test_sgd(GDP_DTYPE_F64, 1, 1e-13);
  test_sgd(GDP_DTYPE_F32, 1, 1e-6);
  test_errors();
  gdp_ctx_free(ctx);
  TEST_END();
}
