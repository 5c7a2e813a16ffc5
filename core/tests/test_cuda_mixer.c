/*
 * test_cuda_mixer.c -- the cuda mixer kernels (conv1d, the output norm, the input stage)
 * through the public ops against the CPU backend in float64 on the same inputs, at
 * small odd shapes that reach every kernel instance: packs and single elements,
 * packed sequences crossing the kernels' token chunks, the halo, strided operands,
 * the wide conv, the output norm's staged and unstaged backward (teams of part of a
 * warp and of a whole block), the input stage with the fused SiLU.  Being plain C, it
 * also runs under compute-sanitizer (tools/gpu_run.sh check), which the Lua specs
 * cannot.
 *
 * Exits 77 (ctest: skipped) when there is no CUDA device.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

#define SEED 0x6d697865725f6375ull /* "mixer_cu" */

static gdp_ctx *cpu, *gpu;

static int64_t numel_of(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++) n *= shape[i];
  return n;
}

/* One operand on both sides: float64 on the cpu, `dtype` on cuda, the same values. */
typedef struct pair {
  gdp_tensor *c, *g;
} pair;

/* Random values ~ scale N(0,1), rounded through `dtype` first so that both sides see
 * the same numbers. */
static pair mk(gdp_dtype dt, int nd, const int64_t *shape, double scale) {
  const int64_t n = numel_of(nd, shape);
  double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
  for (int64_t i = 0; i < n; i++) v[i] = scale * tu_rand_normal();
  pair p = {NULL, tu_tensor_from_f64(gpu, dt, nd, shape, v)};
  if (p.g) CHECK_OK(gdp_tensor_to_host(p.g, GDP_DTYPE_F64, v, (size_t)n * sizeof(double)));
  p.c = tu_tensor_from_f64(cpu, GDP_DTYPE_F64, nd, shape, v);
  free(v);
  return p;
}

static void drop(pair *p) {
  gdp_tensor_free(p->c);
  gdp_tensor_free(p->g);
  p->c = p->g = NULL;
}

static double tol_of(gdp_dtype dt) { return dt == GDP_DTYPE_BF16 ? 1e-2 : 1e-4; }

static gdp_tensor *cu_tensor(gdp_ctx *ctx, const int64_t *cu, int n) {
  if (!n) return NULL;
  gdp_tensor *t = NULL;
  const int64_t shape[1] = {n};
  CHECK_OK(gdp_tensor_from_host(ctx, GDP_DTYPE_I32, 1, shape, GDP_DTYPE_I64, cu,
                                (size_t)n * sizeof(int64_t), &t));
  return t;
}

/* ----------------------------------------------------------------- conv1d */

typedef struct conv_case {
  const char *label;
  int64_t T, B, C, W, L, pad; /* pad > 0: x and dx are channel slices of rows C + pad wide */
  int ncu;
  int64_t cu[6];
} conv_case;

static void conv_run(const conv_case *k, gdp_dtype dt) {
  char what[200];
  const int64_t xs[3] = {k->T, k->B, k->C + k->pad}, ws[2] = {k->C, k->W}, hs[3] = {k->L, k->B, k->C};
  const int64_t ds[3] = {k->T, k->B, k->C};
  pair xw = mk(dt, 3, xs, 1.0), w = mk(dt, 2, ws, 0.5), bias = mk(dt, 1, &k->C, 0.3);
  pair halo = k->L ? mk(dt, 3, hs, 1.0) : (pair){NULL, NULL}, dout = mk(dt, 3, ds, 1.0);
  gdp_tensor *cc = cu_tensor(cpu, k->cu, k->ncu), *cg = cu_tensor(gpu, k->cu, k->ncu);
  gdp_tensor *xc = NULL, *xg = NULL, *dxc = NULL, *dxg = NULL, *dxw = NULL;
  CHECK_OK(gdp_tensor_narrow(xw.c, 2, k->pad, k->C, &xc));
  CHECK_OK(gdp_tensor_narrow(xw.g, 2, k->pad, k->C, &xg));
  CHECK_OK(gdp_tensor_empty(cpu, GDP_DTYPE_F64, 3, ds, &dxc));
  CHECK_OK(gdp_tensor_empty(gpu, dt, 3, xs, &dxw));
  CHECK_OK(gdp_tensor_narrow(dxw, 2, k->pad, k->C, &dxg));
  gdp_tensor *out[2] = {0}, *dw[2] = {0}, *db[2] = {0}, *dh[2] = {0};
  CHECK_OK(gdp_mixer_conv1d_forward(cpu, xc, w.c, bias.c, halo.c, cc, GDP_ACT_SILU, &out[0]));
  CHECK_OK(gdp_mixer_conv1d_forward(gpu, xg, w.g, bias.g, halo.g, cg, GDP_ACT_SILU, &out[1]));
  CHECK_OK(gdp_mixer_conv1d_backward(cpu, xc, w.c, bias.c, halo.c, cc, GDP_ACT_SILU, dout.c, dxc,
                                     &dw[0], &db[0], &dh[0]));
  CHECK_OK(gdp_mixer_conv1d_backward(gpu, xg, w.g, bias.g, halo.g, cg, GDP_ACT_SILU, dout.g, dxg,
                                     &dw[1], &db[1], &dh[1]));
  const double tol = tol_of(dt);
  const char *dn = gdp_dtype_name(dt);
  snprintf(what, sizeof what, "conv %s %s: out", k->label, dn);
  tu_expect_near(what, out[1], out[0], tol);
  snprintf(what, sizeof what, "conv %s %s: dx", k->label, dn);
  tu_expect_near(what, dxg, dxc, tol);
  /* the weight and bias gradients sum over every token: bf16 products, float32 sums */
  snprintf(what, sizeof what, "conv %s %s: dweight", k->label, dn);
  tu_expect_near(what, dw[1], dw[0], dt == GDP_DTYPE_BF16 ? 3e-2 : tol);
  snprintf(what, sizeof what, "conv %s %s: dbias", k->label, dn);
  tu_expect_near(what, db[1], db[0], dt == GDP_DTYPE_BF16 ? 3e-2 : tol);
  if (k->L) {
    snprintf(what, sizeof what, "conv %s %s: dhalo", k->label, dn);
    tu_expect_near(what, dh[1], dh[0], tol);
  }
  for (int i = 0; i < 2; i++) {
    gdp_tensor_free(out[i]), gdp_tensor_free(dw[i]), gdp_tensor_free(db[i]);
    gdp_tensor_free(dh[i]);
  }
  gdp_tensor_free(xc), gdp_tensor_free(xg), gdp_tensor_free(dxc), gdp_tensor_free(dxg);
  gdp_tensor_free(dxw), gdp_tensor_free(cc), gdp_tensor_free(cg);
  drop(&xw), drop(&w), drop(&bias), drop(&halo), drop(&dout);
}

static void test_conv(void) {
  static const conv_case cases[] = {
      /* packs (C % 4 == 0), over two of the backward's 512-token blocks, a halo */
      {"packs, T 700 x B 2, halo 5", 700, 2, 40, 4, 5, 0, 0, {0}},
      /* single elements (C odd), sequences across the 128-token chunks */
      {"odd C, packed {0,100,101,300}, halo 3", 300, 1, 37, 4, 3, 0, 4, {0, 100, 101, 300}},
      {"W = 6 (the wide kernel), packed, halo 5", 140, 1, 21, 6, 5, 0, 3, {0, 2, 140}},
      /* x and dx read and written in place in rows 72 wide; starts on both sides of 512 */
      {"strided x and dx, packed {0,511,513,1024,1100}", 1100, 1, 64, 4, 3, 8, 5,
       {0, 511, 513, 1024, 1100}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    conv_run(&cases[i], GDP_DTYPE_F32);
    conv_run(&cases[i], GDP_DTYPE_BF16);
  }
}

/* ---------------------------------------------------------------- out norm */

typedef struct norm_case {
  const char *label;
  int64_t T, B, H, P, gs;
  int D_mode; /* 0 none, 1 per head, 2 per channel */
  int gate;
} norm_case;

static void norm_run(const norm_case *k, gdp_dtype dt) {
  char what[200];
  const int64_t d = k->H * k->P;
  const int64_t os[4] = {k->B, k->T, k->H, k->P}, xs[4] = {k->T, k->B, k->H, k->P};
  const int64_t zs[3] = {k->T, k->B, d}, Ds = k->D_mode == 1 ? k->H : d;
  pair o = mk(dt, 4, os, 1.0), xv = mk(dt, 4, xs, 1.0), z = mk(dt, 3, zs, 1.0);
  pair D = mk(dt, 1, &Ds, 0.5), w = mk(dt, 1, &d, 1.0), dout = mk(dt, 3, zs, 1.0);
  const int hasD = k->D_mode != 0;
  const double eps = 1e-5;
  gdp_tensor *out[2] = {0}, *d_o[2] = {0}, *dz[2] = {0}, *dxv[2] = {0}, *dD[2] = {0}, *dw[2] = {0};
  gdp_ctx *ctx[2] = {cpu, gpu};
  for (int s = 0; s < 2; s++) {
    gdp_tensor *oo = s ? o.g : o.c, *x = hasD ? (s ? xv.g : xv.c) : NULL;
    gdp_tensor *DD = hasD ? (s ? D.g : D.c) : NULL, *zz = k->gate ? (s ? z.g : z.c) : NULL;
    gdp_tensor *ww = s ? w.g : w.c, *gg = s ? dout.g : dout.c;
    CHECK_OK(gdp_mixer_out_norm_forward(ctx[s], oo, x, DD, zz, ww, k->gs, eps, &out[s]));
    CHECK_OK(gdp_mixer_out_norm_backward(ctx[s], oo, x, DD, zz, ww, k->gs, eps, gg, NULL, &d_o[s],
                                         k->gate ? &dz[s] : NULL, hasD ? &dxv[s] : NULL,
                                         hasD ? &dD[s] : NULL, &dw[s]));
  }
  const double tol = tol_of(dt), tol_sum = dt == GDP_DTYPE_BF16 ? 3e-2 : tol;
  const char *dn = gdp_dtype_name(dt);
  struct { const char *name; gdp_tensor **t; double tol; int on; } res[] = {
      {"out", out, tol, 1}, {"d_o", d_o, tol, 1}, {"dz", dz, tol, k->gate},
      {"dx_v", dxv, tol, hasD}, {"dD", dD, tol_sum, hasD}, {"dweight", dw, tol_sum, 1}};
  for (size_t i = 0; i < sizeof res / sizeof res[0]; i++) {
    if (!res[i].on) continue;
    snprintf(what, sizeof what, "out norm %s %s: %s", k->label, dn, res[i].name);
    tu_expect_near(what, res[i].t[1], res[i].t[0], res[i].tol);
  }
  for (int s = 0; s < 2; s++) {
    gdp_tensor_free(out[s]), gdp_tensor_free(d_o[s]), gdp_tensor_free(dz[s]);
    gdp_tensor_free(dxv[s]), gdp_tensor_free(dD[s]), gdp_tensor_free(dw[s]);
  }
  drop(&o), drop(&xv), drop(&z), drop(&D), drop(&w), drop(&dout);
}

static void test_out_norm(void) {
  static const norm_case cases[] = {
      /* teams of 8 threads, one vector each: the backward stages 4 rows ahead */
      {"groups of 64, D per head, z", 37, 3, 4, 32, 64, 1, 1},
      /* teams of 32, two vectors each: 2 rows ahead */
      {"groups of 512, D per channel, z", 29, 2, 4, 128, 512, 2, 1},
      /* a 64-thread team is its block (no teams' sums in shared memory) */
      {"groups of 1024, D per head, z", 9, 2, 16, 64, 1024, 1, 1},
      /* P = 20: single elements; plain RMSNorm */
      {"P = 20, no D, no z", 31, 1, 3, 20, 20, 0, 0},
      /* the state-tracking model's RMSNorm: one group of 128 over many rows */
      {"one group of 128, 700 rows", 350, 2, 1, 128, 128, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    norm_run(&cases[i], GDP_DTYPE_F32);
    norm_run(&cases[i], GDP_DTYPE_BF16);
  }
}

/* ------------------------------------------------------- input stage, fused SiLU */

typedef struct inputs_case {
  const char *label;
  int64_t T, B, nh, P, ng, N, M;
  int gate;
  double scale;
} inputs_case;

static void inputs_run(const inputs_case *k, gdp_dtype dt) {
  char what[200];
  const int64_t T = k->T, B = k->B, nh = k->nh, P = k->P, ng = k->ng, N = k->N, M = k->M;
  const int64_t conv = M * nh * P + (M + 1) * ng * N;
  const gdp_dtype gt = dt == GDP_DTYPE_BF16 ? GDP_DTYPE_F32 : dt; /* the gates' dtype */
  const int64_t xs[3] = {T, B, conv}, bs[3] = {T, B, M * nh}, as[3] = {T, B, nh};
  const int64_t qs[4] = {B, T, nh, N}, ks[4] = {B, T * M, nh, N}, vs[4] = {B, T * M, nh, P};
  const int64_t betas[3] = {B, T * M, nh}, gs[3] = {B, T, nh}, xvs[4] = {T, B, nh, P};
  pair x = mk(dt, 3, xs, 1.0), b = mk(dt, 3, bs, 1.0);
  pair a = k->gate ? mk(dt, 3, as, 2.0) : (pair){NULL, NULL};
  pair A_log = k->gate ? mk(gt, 1, &nh, 0.5) : (pair){NULL, NULL};
  pair dt_bias = k->gate ? mk(gt, 1, &nh, 0.5) : (pair){NULL, NULL};
  pair dq = mk(dt, 4, qs, 1.0), dk = mk(dt, 4, ks, 1.0), dv = mk(dt, 4, vs, 1.0);
  pair dbeta = mk(dt, 3, betas, 1.0), dg = k->gate ? mk(gt, 3, gs, 1.0) : (pair){NULL, NULL};
  pair dxv = mk(dt, 4, xvs, 1.0);
  gdp_tensor *q[2] = {0}, *kk[2] = {0}, *v[2] = {0}, *beta[2] = {0}, *g[2] = {0};
  gdp_tensor *dx[2] = {0}, *db[2] = {0}, *da[2] = {0}, *dA[2] = {0}, *ddt[2] = {0};
  gdp_ctx *ctx[2] = {cpu, gpu};
#define SIDE(p) (s ? (p).g : (p).c)
  for (int s = 0; s < 2; s++) {
    const gdp_dtype odt = s ? dt : GDP_DTYPE_F64;
    CHECK_OK(gdp_mixer_ssm_inputs_forward(ctx[s], SIDE(x), SIDE(b), SIDE(a), SIDE(A_log),
                                          SIDE(dt_bias), nh, P, ng, N, M, k->scale, 1, &q[s],
                                          &kk[s], &v[s], &beta[s], k->gate ? &g[s] : NULL));
    CHECK_OK(gdp_tensor_empty(ctx[s], odt, 3, xs, &dx[s]));
    CHECK_OK(gdp_tensor_empty(ctx[s], odt, 3, bs, &db[s]));
    if (k->gate) CHECK_OK(gdp_tensor_empty(ctx[s], odt, 3, as, &da[s]));
    CHECK_OK(gdp_mixer_ssm_inputs_backward(ctx[s], SIDE(b), SIDE(a), SIDE(A_log), SIDE(dt_bias), nh,
                                           P, ng, N, M, k->scale, SIDE(x), SIDE(dq), SIDE(dk),
                                           SIDE(dv), SIDE(dbeta), SIDE(dg), SIDE(dxv), dx[s], db[s],
                                           da[s], k->gate ? &dA[s] : NULL,
                                           k->gate ? &ddt[s] : NULL));
  }
#undef SIDE
  const double tol = tol_of(dt), tol_sum = dt == GDP_DTYPE_BF16 ? 3e-2 : tol;
  const char *dn = gdp_dtype_name(dt);
  struct { const char *name; gdp_tensor **t; double tol; int on; } res[] = {
      {"q", q, tol, 1}, {"k", kk, tol, 1}, {"v", v, tol, 1}, {"beta", beta, tol, 1},
      {"g", g, tol, k->gate}, {"dxBC", dx, tol, 1}, {"db", db, tol, 1}, {"da", da, tol, k->gate},
      {"dA_log", dA, tol_sum, k->gate}, {"ddt_bias", ddt, tol_sum, k->gate}};
  for (size_t i = 0; i < sizeof res / sizeof res[0]; i++) {
    if (!res[i].on) continue;
    snprintf(what, sizeof what, "inputs %s %s: %s", k->label, dn, res[i].name);
    tu_expect_near(what, res[i].t[1], res[i].t[0], res[i].tol);
  }
  for (int s = 0; s < 2; s++) {
    gdp_tensor_free(q[s]), gdp_tensor_free(kk[s]), gdp_tensor_free(v[s]), gdp_tensor_free(beta[s]);
    gdp_tensor_free(g[s]), gdp_tensor_free(dx[s]), gdp_tensor_free(db[s]), gdp_tensor_free(da[s]);
    gdp_tensor_free(dA[s]), gdp_tensor_free(ddt[s]);
  }
  drop(&x), drop(&b), drop(&a), drop(&A_log), drop(&dt_bias), drop(&dq), drop(&dk), drop(&dv);
  drop(&dbeta), drop(&dg), drop(&dxv);
}

static void test_inputs_silu(void) {
  static const inputs_case cases[] = {
      /* the state-tracking layer's head shape: 16-byte packs */
      {"SiLU, 8 x 32 heads, M = 4, no gate, beta x2", 33, 2, 8, 32, 8, 32, 4, 0, 2.0},
      /* single elements, groups shared by two heads, the forget gate */
      {"SiLU, odd sizes, ng < nh, M = 2, gate", 6, 2, 4, 3, 2, 5, 2, 1, 1.0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    inputs_run(&cases[i], GDP_DTYPE_F32);
    inputs_run(&cases[i], GDP_DTYPE_BF16);
  }
}

static void run(gdp_ctx *c, gdp_ctx *g) {
  cpu = c, gpu = g;
  test_conv();
  test_out_norm();
  test_inputs_silu();
}

CUDA_TEST_MAIN(SEED, run)
