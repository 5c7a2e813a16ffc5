/*
 * mixer_gates.c -- the mixer's per-head elementwise ops (see mixer_cpu.h):
 *
 *   beta = scale * sigmoid(b)                        db = d_beta * scale * s (1 - s)
 *   out = x * sigmoid(x) (SiLU)                      dx = d_out * s (1 + x (1 - s))
 *   g = -exp(A_log[h]) * softplus(a + dt_bias[h])    da = d_g * (-exp(A_log[h])) * sigmoid(x)
 *                                                    dA_log[h] = sum d_g * g
 *                                                    ddt_bias[h] = sum da
 *   out = y + D * x_v                                dx_v = D * d_out, dD = sum d_out * x_v
 *
 * softplus follows torch (threshold 20; mixer_gate_math.h).  The elementwise math
 * runs in the buffers' type (float32 like Megatron's gate computation); per-head sums
 * over rows accumulate in double, one partial sum per thread.
 *
 * Compiled twice (double, float) through real_instances.h, as conv1d.c.
 */
#ifndef GDP_GATES_GENERIC

#include <stdlib.h>
#include <string.h>
#include <tgmath.h>

#include <omp.h>

#include "../kernel_status.h"
#include "../size_check.h"
#include "mixer_cpu.h"

#define GATES_PAR_MIN (1 << 15)

static int gates_threads(int n) { return n < 1 ? 1 : n; }

/* Per-thread partial sums of `width` doubles each, zeroed; the caller adds them up in
 * thread order after the parallel region (no atomics, same result for a given thread
 * count). */
static double *gates_partials(int nthreads, int64_t width) {
  size_t count;
  return gdp_size_product(&count, nthreads, width > 0 ? width : 1, 1) ? calloc(count, sizeof(double))
                                                                      : NULL;
}

#define GDP_GATES_GENERIC
#define GDP_REAL_FILE "mixer_gates.c"
#include "real_instances.h"
#undef GDP_GATES_GENERIC

#else /* GDP_GATES_GENERIC */

#include "mixer_gate_math.h"

void FN(gdp_cpu_silu_fwd)(int64_t rows, int64_t C, const REAL *x, int64_t ld_x, REAL *out,
                          int64_t ld_out, int nthreads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(gates_threads(nthreads)) \
    if (rows * C > GATES_PAR_MIN)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < C; c++) {
      out[r * ld_out + c] = FN(silu)(x[r * ld_x + c]);
    }
}

void FN(gdp_cpu_silu_bwd)(int64_t rows, int64_t C, const REAL *x, int64_t ld_x, const REAL *d_out,
                          int64_t ld_d, REAL *dx, int64_t ld_dx, int nthreads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(gates_threads(nthreads)) \
    if (rows * C > GATES_PAR_MIN)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < C; c++) {
      const REAL v = x[r * ld_x + c], s = FN(sigmoid)(v);
      dx[r * ld_dx + c] = d_out[r * ld_d + c] * s * ((REAL)1 + v * ((REAL)1 - s));
    }
}

void FN(gdp_cpu_beta_fwd)(int64_t n, double scale, const REAL *b, REAL *beta, int nthreads) {
  const REAL sc = (REAL)scale;
#pragma omp parallel for schedule(static) num_threads(gates_threads(nthreads)) if (n > GATES_PAR_MIN)
  for (int64_t i = 0; i < n; i++) beta[i] = sc * FN(sigmoid)(b[i]);
}

void FN(gdp_cpu_beta_bwd)(int64_t n, double scale, const REAL *b, const REAL *d_beta, REAL *db,
                          int nthreads) {
  const REAL sc = (REAL)scale;
#pragma omp parallel for schedule(static) num_threads(gates_threads(nthreads)) if (n > GATES_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    const REAL s = FN(sigmoid)(b[i]);
    db[i] = d_beta[i] * sc * s * ((REAL)1 - s);
  }
}

void FN(gdp_cpu_decay_fwd)(int64_t rows, int64_t H, const REAL *a, const REAL *A_log,
                           const REAL *dt_bias, REAL *g, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(gates_threads(nthreads)) if (rows * H > GATES_PAR_MIN)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < H; h++) {
      const REAL x = a[r * H + h] + (dt_bias ? dt_bias[h] : (REAL)0);
      g[r * H + h] = -exp(A_log[h]) * FN(softplus)(x);
    }
}

gdp_status FN(gdp_cpu_decay_bwd)(int64_t rows, int64_t H, const REAL *a, const REAL *A_log,
                                 const REAL *dt_bias, const REAL *d_g, REAL *da, REAL *dA_log,
                                 REAL *ddt_bias, int nthreads) {
  const int nt = gates_threads(nthreads);
  /* partial[thread][0..H) for dA_log, [H..2H) for ddt_bias */
  double *partial = gates_partials(nt, 2 * H);
  if (!partial) return GDP_ERROR(GDP_ERR_OOM, "out of host memory for decay gradient sums");
  int used = 1;
#pragma omp parallel num_threads(nt) if (rows * H > GATES_PAR_MIN)
  {
    const int tid = omp_get_thread_num();
#pragma omp single
    used = omp_get_num_threads();
    double *acc = partial + (size_t)tid * (size_t)(2 * H);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
      for (int64_t h = 0; h < H; h++) {
        const REAL x = a[r * H + h] + (dt_bias ? dt_bias[h] : (REAL)0);
        const REAL A = exp(A_log[h]);
        const REAL dg = d_g[r * H + h];
        const REAL dx = -dg * A * FN(softplus_grad)(x);
        if (da) da[r * H + h] = dx;
        acc[h] += (double)dg * (double)(-A * FN(softplus)(x)); /* d_g * g */
        acc[H + h] += dx;
      }
  }
  for (int64_t h = 0; h < H; h++) {
    double sa = 0.0, sb = 0.0;
    for (int t = 0; t < used; t++) {
      sa += partial[(size_t)t * (size_t)(2 * H) + h];
      sb += partial[(size_t)t * (size_t)(2 * H) + H + h];
    }
    if (dA_log) dA_log[h] = (REAL)sa;
    if (ddt_bias) ddt_bias[h] = (REAL)sb;
  }
  free(partial);
  return GDP_OK;
}

void FN(gdp_cpu_dskip_fwd)(int64_t rows, int64_t H, int64_t P, int per_channel, const REAL *y,
                           const REAL *x_v, const REAL *D, REAL *out, int nthreads) {
  const int64_t HP = H * P;
#pragma omp parallel for schedule(static) num_threads(gates_threads(nthreads)) if (rows * HP > GATES_PAR_MIN)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t i = 0; i < HP; i++) {
      const REAL d = per_channel ? D[i] : D[i / P];
      out[r * HP + i] = y[r * HP + i] + d * x_v[r * HP + i];
    }
}

gdp_status FN(gdp_cpu_dskip_bwd)(int64_t rows, int64_t H, int64_t P, int per_channel,
                                 const REAL *x_v, const REAL *D, const REAL *d_out, REAL *dx_v,
                                 REAL *dD, int nthreads) {
  const int64_t HP = H * P;
  const int nt = gates_threads(nthreads);
  double *partial = gates_partials(nt, HP);
  if (!partial) return GDP_ERROR(GDP_ERR_OOM, "out of host memory for D gradient sums");
  int used = 1;
#pragma omp parallel num_threads(nt) if (rows * HP > GATES_PAR_MIN)
  {
    const int tid = omp_get_thread_num();
#pragma omp single
    used = omp_get_num_threads();
    double *acc = partial + (size_t)tid * (size_t)HP;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
      for (int64_t i = 0; i < HP; i++) {
        const REAL d = per_channel ? D[i] : D[i / P];
        const REAL go = d_out[r * HP + i];
        if (dx_v) dx_v[r * HP + i] = d * go;
        acc[i] += (double)go * x_v[r * HP + i];
      }
  }
  if (dD) {
    /* Thread partials into partial[0..HP) (row 0 is only read before it is written),
     * then per head the P channels are summed in double before rounding once. */
    for (int64_t i = 0; i < HP; i++) {
      double s = 0.0;
      for (int t = 0; t < used; t++) s += partial[(size_t)t * (size_t)HP + i];
      partial[i] = s;
    }
    for (int64_t j = 0; j < (per_channel ? HP : H); j++) {
      double s = 0.0;
      if (per_channel) s = partial[j];
      else for (int64_t p = 0; p < P; p++) s += partial[j * P + p];
      dD[j] = (REAL)s;
    }
  }
  free(partial);
  return GDP_OK;
}

#endif /* GDP_GATES_GENERIC */
