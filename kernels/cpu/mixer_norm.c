/*
 * mixer_norm.c -- gated grouped RMSNorm of the mixer output (see mixer_cpu.h):
 *
 *   x = y * silu(z),  xh = x * rstd,  out = xh * weight,
 *   rstd = (mean over the group of x^2 + eps)^-1/2      (per row and group of gs channels)
 *
 * Backward, with dxh = d_out * weight and c = mean over the group of dxh * xh:
 *   dx = rstd (dxh - xh c),  dy = dx * silu(z),  dz = dx * y * s (1 + z (1 - s)), s = sigmoid(z)
 *   dweight = sum over rows of d_out * xh
 * The group sums (x^2, dxh * xh) and the dweight sums over rows accumulate in double
 * (one partial dweight per thread); x and sigmoid(z) of the group being worked on sit
 * in a per-thread scratch row, so each exp is taken once.
 *
 * Compiled twice (double, float) through real_instances.h, as conv1d.c.
 */
#ifndef GDP_NORM_GENERIC

#include <stdlib.h>
#include <tgmath.h>

#include <omp.h>

#include "../kernel_status.h"
#include "../size_check.h"
#include "mixer_cpu.h"

#define NORM_PAR_MIN (1 << 14)

static int norm_threads(int n) { return n < 1 ? 1 : n; }

#define GDP_NORM_GENERIC
#define GDP_REAL_FILE "mixer_norm.c"
#include "real_instances.h"
#undef GDP_NORM_GENERIC

#else /* GDP_NORM_GENERIC */

/* x = y * silu(z) (y alone without z) of one group into xs[0..gs), and s = sigmoid(z)
 * into ss (when given); returns sum x^2 in double. */
static inline double FN(gate_group)(const REAL *restrict y, const REAL *restrict z, int64_t i0,
                                    int64_t gs, REAL *restrict xs, REAL *restrict ss) {
  double sum = 0.0;
  for (int64_t j = 0; j < gs; j++) {
    REAL x = y[i0 + j];
    if (z) {
      const REAL s = (REAL)1 / ((REAL)1 + exp(-z[i0 + j]));
      x *= z[i0 + j] * s;
      if (ss) ss[j] = s;
    }
    xs[j] = x;
    sum += (double)x * x;
  }
  return sum;
}

gdp_status FN(gdp_cpu_gated_rmsnorm_fwd)(int64_t rows, int64_t d, int64_t gs, double eps,
                                         const REAL *y, const REAL *z, const REAL *weight,
                                         REAL *out, int nthreads) {
  const int64_t ngroups = d / gs;
  const int nt = norm_threads(nthreads);
  size_t bytes;
  REAL *scratch = gdp_size_product(&bytes, nt, gs, sizeof(REAL)) ? malloc(bytes) : NULL;
  if (!scratch) return GDP_ERROR(GDP_ERR_OOM, "out of host memory for norm scratch");
#pragma omp parallel num_threads(nt) if (rows * d > NORM_PAR_MIN)
  {
    REAL *xs = scratch + (size_t)omp_get_thread_num() * (size_t)gs;
#pragma omp for schedule(static)
    for (int64_t rg = 0; rg < rows * ngroups; rg++) {
      const int64_t i0 = (rg / ngroups) * d + (rg % ngroups) * gs; /* first element */
      const int64_t c0 = (rg % ngroups) * gs;                      /* first channel */
      const double sum = FN(gate_group)(y, z, i0, gs, xs, NULL);
      const double rstd = 1.0 / sqrt(sum / (double)gs + eps);
      for (int64_t j = 0; j < gs; j++) out[i0 + j] = (REAL)(xs[j] * rstd * weight[c0 + j]);
    }
  }
  free(scratch);
  return GDP_OK;
}

gdp_status FN(gdp_cpu_gated_rmsnorm_bwd)(int64_t rows, int64_t d, int64_t gs, double eps,
                                         const REAL *y, const REAL *z, const REAL *weight,
                                         const REAL *d_out, REAL *dy, REAL *dz, REAL *dweight,
                                         int nthreads) {
  const int64_t ngroups = d / gs;
  const int nt = norm_threads(nthreads);
  size_t count, bytes;
  double *partial = gdp_size_product(&count, nt, d > 0 ? d : 1, 1) ? calloc(count, sizeof(double)) : NULL;
  REAL *scratch = gdp_size_product(&bytes, nt, 2 * gs, sizeof(REAL)) ? malloc(bytes) : NULL;
  if (!partial || !scratch) {
    free(partial);
    free(scratch);
    return GDP_ERROR(GDP_ERR_OOM, "out of host memory for norm gradient sums");
  }
  int used = 1;
#pragma omp parallel num_threads(nt) if (rows * d > NORM_PAR_MIN)
  {
#pragma omp single
    used = omp_get_num_threads();
    const int tid = omp_get_thread_num();
    double *acc = partial + (size_t)tid * (size_t)d;
    REAL *xs = scratch + (size_t)tid * (size_t)(2 * gs), *ss = xs + gs;
#pragma omp for schedule(static)
    for (int64_t rg = 0; rg < rows * ngroups; rg++) {
      const int64_t i0 = (rg / ngroups) * d + (rg % ngroups) * gs;
      const int64_t c0 = (rg % ngroups) * gs;
      const double sum = FN(gate_group)(y, z, i0, gs, xs, ss);
      const double rstd = 1.0 / sqrt(sum / (double)gs + eps);
      double c = 0.0; /* sum of dxh * xh */
      for (int64_t j = 0; j < gs; j++) {
        const double xh = (double)xs[j] * rstd;
        const double go = d_out[i0 + j];
        c += go * weight[c0 + j] * xh;
        acc[c0 + j] += go * xh;
      }
      c /= (double)gs;
      if (!dy && !dz) continue;
      for (int64_t j = 0; j < gs; j++) {
        const int64_t i = i0 + j;
        const REAL dx = (REAL)(rstd * ((double)d_out[i] * weight[c0 + j] - (double)xs[j] * rstd * c));
        if (!z) {
          if (dy) dy[i] = dx;
          continue;
        }
        const REAL s = ss[j];
        if (dy) dy[i] = dx * z[i] * s;
        if (dz) dz[i] = dx * y[i] * s * ((REAL)1 + z[i] * ((REAL)1 - s));
      }
    }
  }
  if (dweight)
    for (int64_t i = 0; i < d; i++) {
      double sum = 0.0;
      for (int t = 0; t < used; t++) sum += partial[(size_t)t * (size_t)d + i];
      dweight[i] = (REAL)sum;
    }
  free(partial);
  free(scratch);
  return GDP_OK;
}

#endif /* GDP_NORM_GENERIC */
