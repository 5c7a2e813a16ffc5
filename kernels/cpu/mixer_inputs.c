/*
 * mixer_inputs.c -- the mixer's input stage on the cpu (gdp_mixer_ssm_inputs_forward /
 * _backward; layouts in ../mixer_problem.h), plain loops over tokens:
 *
 *   v[b,t*M+m,h,p] = xBC[t,b,V(m,h,p)]       dxBC[t,b,V(m,h,p)] = dv[...] (+ dx_v at m = 0)
 *   k[b,t*M+m,h,n] = xBC[t,b,K(m,h/r,n)]     dxBC[t,b,K(m,g,n)] = sum_{h in g} dk[b,t*M+m,h,n]
 *   q[b,t,h,n]     = xBC[t,b,Q(h/r,n)]       dxBC[t,b,Q(g,n)]   = sum_{h in g} dq[b,t,h,n]
 *   beta = scale * sigmoid(b)                db = dbeta * scale * s (1 - s)
 *   (with silu, x = silu(xBC) is read above and dxBC multiplied by silu'(xBC): a layer
 *   without short conv, whose SiLU this stage applies)
 *   g = -exp(A_log[h]) softplus(a + dt_bias[h])   da = dg * (-exp(A_log[h])) softplus'(x)
 *                                            dA_log[h] = sum dg * g, ddt_bias[h] = sum da
 *
 * with r = nh / ng heads per group.  The math is that of the composed ops it replaces
 * (mixer_gates.c, repeat_heads): the buffers' type, the group sums in head order from
 * zero, the sums over tokens in double, one partial per thread added in thread order.
 *
 * Compiled twice (double, float) through real_instances.h.
 */
#ifndef GDP_INPUTS_GENERIC

#include <stdlib.h>
#include <tgmath.h>

#include <omp.h>

#include "../kernel_status.h"
#include "../size_check.h"
#include "mixer_cpu.h"

#define INPUTS_PAR_MIN (1 << 15)

static int inputs_threads(int n) { return n < 1 ? 1 : n; }

#define GDP_INPUTS_GENERIC
#define GDP_REAL_FILE "mixer_inputs.c"
#include "real_instances.h"
#undef GDP_INPUTS_GENERIC

#else /* GDP_INPUTS_GENERIC */

#include "mixer_gate_math.h"

/* Element j of a row of xBC as the stage reads it: through SiLU when act. */
static inline REAL FN(input)(const REAL *x, int64_t j, int act) {
  return act ? FN(silu)(x[j]) : x[j];
}

void FN(gdp_cpu_ssm_inputs_fwd)(const gdp_ssm_inputs_problem *p, const gdp_ssm_inputs_fwd_io *io) {
  const int64_t T = p->T, B = p->B, nh = p->nh, P = p->P, ng = p->ng, N = p->N, M = p->M;
  const int64_t rep = nh / ng, k_off = M * nh * P, q_off = k_off + M * ng * N;
  const REAL sc = (REAL)p->beta_scale;
  const REAL *xBC = io->xBC, *b = io->b, *a = io->a, *A_log = io->A_log, *dt_bias = io->dt_bias;
  REAL *q = io->q, *k = io->k, *v = io->v, *beta = io->beta, *g = io->g;
  const int64_t rows = T * B;
#pragma omp parallel for schedule(static) num_threads(inputs_threads(p->num_threads)) \
    if (rows * (q_off + ng * N) > INPUTS_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const int64_t t = r / B, bt = (r % B) * T + t; /* batch-major token */
    const REAL *x = xBC + r * p->ld_xBC;
    const int act = p->silu;
    for (int64_t m = 0; m < M; m++)
      for (int64_t h = 0; h < nh; h++) {
        const int64_t o = (bt * M + m) * nh + h;
        for (int64_t i = 0; i < P; i++) v[o * P + i] = FN(input)(x, (m * nh + h) * P + i, act);
        for (int64_t n = 0; n < N; n++)
          k[o * N + n] = FN(input)(x, k_off + (m * ng + h / rep) * N + n, act);
        beta[o] = sc * FN(sigmoid)(b[r * p->ld_b + m * nh + h]);
      }
    for (int64_t h = 0; h < nh; h++) {
      for (int64_t n = 0; n < N; n++)
        q[(bt * nh + h) * N + n] = FN(input)(x, q_off + (h / rep) * N + n, act);
      if (p->gate) {
        const REAL xa = a[r * p->ld_a + h] + (dt_bias ? dt_bias[h] : (REAL)0);
        g[bt * nh + h] = -exp(A_log[h]) * FN(softplus)(xa);
      }
    }
  }
}

gdp_status FN(gdp_cpu_ssm_inputs_bwd)(const gdp_ssm_inputs_problem *p,
                                      const gdp_ssm_inputs_bwd_io *io) {
  const int64_t T = p->T, B = p->B, nh = p->nh, P = p->P, ng = p->ng, N = p->N, M = p->M;
  const int64_t rep = nh / ng, k_off = M * nh * P, q_off = k_off + M * ng * N;
  const REAL sc = (REAL)p->beta_scale;
  const REAL *b = io->b, *a = io->a, *A_log = io->A_log, *dt_bias = io->dt_bias;
  const REAL *dq = io->dq, *dk = io->dk, *dv = io->dv, *dbeta = io->dbeta, *dg = io->dg;
  const REAL *dx_v = io->dx_v;
  REAL *dxBC = io->dxBC, *db = io->db, *da = io->da;
  const int64_t rows = T * B;
  const int nt = inputs_threads(p->num_threads);
  /* partial[thread][0..nh) for dA_log, [nh..2nh) for ddt_bias */
  size_t count = 0;
  double *partial = gdp_size_product(&count, nt, 2 * nh, 1) ? calloc(count, sizeof(double)) : NULL;
  if (!partial) return GDP_ERROR(GDP_ERR_OOM, "out of host memory for decay gradient sums");
  int used = 1;
#pragma omp parallel num_threads(nt) if (rows * (q_off + ng * N) > INPUTS_PAR_MIN)
  {
    const int tid = omp_get_thread_num();
#pragma omp single
    used = omp_get_num_threads();
    double *acc = partial + (size_t)tid * (size_t)(2 * nh);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      const int64_t t = r / B, bt = (r % B) * T + t;
      REAL *x = dxBC + r * p->ld_dxBC;
      for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < nh; h++) {
          const int64_t o = (bt * M + m) * nh + h;
          for (int64_t i = 0; i < P; i++) {
            REAL d = dv[o * P + i];
            if (m == 0 && dx_v) d += dx_v[(r * nh + h) * P + i];
            x[(m * nh + h) * P + i] = d;
          }
          const REAL s = FN(sigmoid)(b[r * p->ld_b + m * nh + h]);
          db[r * p->ld_db + m * nh + h] = dbeta[o] * sc * s * ((REAL)1 - s);
        }
      for (int64_t m = 0; m < M; m++)
        for (int64_t gi = 0; gi < ng; gi++)
          for (int64_t n = 0; n < N; n++) {
            REAL s = 0;
            for (int64_t j = 0; j < rep; j++) s += dk[((bt * M + m) * nh + gi * rep + j) * N + n];
            x[k_off + (m * ng + gi) * N + n] = s;
          }
      for (int64_t gi = 0; gi < ng; gi++)
        for (int64_t n = 0; n < N; n++) {
          REAL s = 0;
          for (int64_t j = 0; j < rep; j++) s += dq[(bt * nh + gi * rep + j) * N + n];
          x[q_off + gi * N + n] = s;
        }
      if (p->silu) { /* the gradient of the pre-activation: silu' = s (1 + u (1 - s)) */
        const REAL *u = (const REAL *)io->xBC + r * p->ld_xBC;
        for (int64_t j = 0; j < q_off + ng * N; j++) {
          const REAL s = FN(sigmoid)(u[j]);
          x[j] *= s * ((REAL)1 + u[j] * ((REAL)1 - s));
        }
      }
      if (p->gate)
        for (int64_t h = 0; h < nh; h++) {
          const REAL xa = a[r * p->ld_a + h] + (dt_bias ? dt_bias[h] : (REAL)0);
          const REAL A = exp(A_log[h]);
          const REAL dgv = dg[bt * nh + h];
          const REAL dx = -dgv * A * FN(softplus_grad)(xa);
          da[r * p->ld_da + h] = dx;
          acc[h] += (double)dgv * (double)(-A * FN(softplus)(xa)); /* d_g * g */
          acc[nh + h] += dx;
        }
    }
  }
  for (int64_t h = 0; p->gate && h < nh; h++) {
    double sa = 0.0, sb = 0.0;
    for (int t = 0; t < used; t++) {
      sa += partial[(size_t)t * (size_t)(2 * nh) + h];
      sb += partial[(size_t)t * (size_t)(2 * nh) + nh + h];
    }
    if (io->dA_log) ((REAL *)io->dA_log)[h] = (REAL)sa;
    if (io->ddt_bias) ((REAL *)io->ddt_bias)[h] = (REAL)sb;
  }
  free(partial);
  return GDP_OK;
}

#endif /* GDP_INPUTS_GENERIC */
