/*
 * mixer_norm.c -- the mixer's output norm: the D skip fused into the gated grouped
 * RMSNorm (semantics and the strided [T,B,H,P] operands in ../mixer_problem.h):
 *
 *   y = o + D * x_v,  x = y * silu(z),  xh = x * rstd,  out = xh * weight
 *
 * One (token, group) at a time: y, sigmoid(z), z and x of the group sit in a per-thread
 * scratch row, so every operand element is read once and each exp is taken once.  The
 * group sums (x^2, dxh * xh) accumulate in double; the elementwise math runs in double
 * and rounds once on store.  dweight and dD sum over tokens into one partial row per
 * thread (static schedule: a fixed thread count gives fixed sums), then over threads
 * in thread order.
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

/* Element offset of channel c of token (t, b) in an operand with strides s. */
static inline int64_t norm_at(const gdp_tbhp_strides *s, int64_t t, int64_t b, int64_t c,
                              int64_t P) {
  return t * s->t + b * s->b + (c / P) * s->h + c % P;
}

#define GDP_NORM_GENERIC
#define GDP_REAL_FILE "mixer_norm.c"
#include "real_instances.h"
#undef GDP_NORM_GENERIC

#else /* GDP_NORM_GENERIC */

/* A group's values in a thread's scratch: y (after the skip), s = sigmoid(z), z, x. */
typedef struct FN(norm_scratch) {
  double *y, *s, *z, *x;
} FN(norm_scratch);

/* Loads group c0..c0+gs of token (t, b) into w; returns sum x^2. */
static double FN(load_group)(const gdp_out_norm_problem *p, int64_t t, int64_t b, int64_t c0,
                             const REAL *o, const REAL *x_v, const REAL *D, const REAL *z,
                             FN(norm_scratch) w) {
  const int64_t gs = p->group_size, P = p->P;
  double sum = 0.0;
  for (int64_t j = 0; j < gs; j++) {
    const int64_t c = c0 + j;
    double y = o[norm_at(&p->o, t, b, c, P)];
    if (p->D_mode != GDP_OUT_NORM_NO_D) {
      const double dv = D[p->D_mode == GDP_OUT_NORM_D_CHANNEL ? c : c / P];
      y += dv * (double)x_v[norm_at(&p->x_v, t, b, c, P)];
    }
    double x = y;
    if (z) {
      const double zz = z[norm_at(&p->z, t, b, c, P)];
      const double s = 1.0 / (1.0 + exp(-zz));
      w.s[j] = s;
      w.z[j] = zz;
      x = y * zz * s;
    }
    w.y[j] = y;
    w.x[j] = x;
    sum += x * x;
  }
  return sum;
}

static gdp_status FN(scratch_new)(int nt, int64_t gs, double **out) {
  size_t bytes;
  *out = gdp_size_product(&bytes, (int64_t)nt * 4, gs > 0 ? gs : 1, sizeof(double)) ? malloc(bytes) : NULL;
  return *out ? GDP_OK : GDP_ERROR(GDP_ERR_OOM, "out of host memory for norm scratch");
}

static FN(norm_scratch) FN(scratch_of)(double *scratch, int tid, int64_t gs) {
  double *base = scratch + (size_t)tid * 4 * (size_t)gs;
  FN(norm_scratch) w = {base, base + gs, base + 2 * gs, base + 3 * gs};
  return w;
}

gdp_status FN(gdp_cpu_out_norm_fwd)(const gdp_out_norm_problem *p, const REAL *o,
                                    const REAL *x_v, const REAL *D, const REAL *z,
                                    const REAL *weight, REAL *out) {
  const int64_t gs = p->group_size, d = p->H * p->P, ng = d / gs, rows = p->T * p->B;
  const int nt = norm_threads(p->num_threads);
  double *scratch = NULL;
  GDP_TRY(FN(scratch_new)(nt, gs, &scratch));
#pragma omp parallel num_threads(nt) if (rows * d > NORM_PAR_MIN)
  {
    const FN(norm_scratch) w = FN(scratch_of)(scratch, omp_get_thread_num(), gs);
#pragma omp for schedule(static)
    for (int64_t rg = 0; rg < rows * ng; rg++) {
      const int64_t t = rg / ng / p->B, b = rg / ng % p->B, c0 = rg % ng * gs;
      const double rstd = 1.0 / sqrt(FN(load_group)(p, t, b, c0, o, x_v, D, z, w) / (double)gs + p->eps);
      for (int64_t j = 0; j < gs; j++)
        out[norm_at(&p->out, t, b, c0 + j, p->P)] = (REAL)(w.x[j] * rstd * (double)weight[c0 + j]);
    }
  }
  free(scratch);
  return GDP_OK;
}

gdp_status FN(gdp_cpu_out_norm_bwd)(const gdp_out_norm_problem *p, const REAL *o,
                                    const REAL *x_v, const REAL *D, const REAL *z,
                                    const REAL *weight, const REAL *d_out, REAL *d_o, REAL *dz,
                                    REAL *dx_v, REAL *dD, REAL *dweight) {
  const int64_t gs = p->group_size, P = p->P, d = p->H * P, ng = d / gs, rows = p->T * p->B;
  const int has_D = p->D_mode != GDP_OUT_NORM_NO_D;
  const int nt = norm_threads(p->num_threads);
  size_t count;
  /* per thread: the dweight partial row, then the dD one (per channel) */
  double *partial = gdp_size_product(&count, (int64_t)nt * 2, d > 0 ? d : 1, 1) ? calloc(count, sizeof(double)) : NULL;
  double *scratch = NULL;
  if (!partial) return GDP_ERROR(GDP_ERR_OOM, "out of host memory for norm gradient sums");
  gdp_status st = FN(scratch_new)(nt, gs, &scratch);
  if (st != GDP_OK) {
    free(partial);
    return st;
  }
  int used = 1;
#pragma omp parallel num_threads(nt) if (rows * d > NORM_PAR_MIN)
  {
#pragma omp single
    used = omp_get_num_threads();
    const int tid = omp_get_thread_num();
    double *acc_w = partial + (size_t)tid * 2 * (size_t)d, *acc_D = acc_w + d;
    const FN(norm_scratch) w = FN(scratch_of)(scratch, tid, gs);
#pragma omp for schedule(static)
    for (int64_t rg = 0; rg < rows * ng; rg++) {
      const int64_t t = rg / ng / p->B, b = rg / ng % p->B, c0 = rg % ng * gs;
      const double rstd = 1.0 / sqrt(FN(load_group)(p, t, b, c0, o, x_v, D, z, w) / (double)gs + p->eps);
      double c = 0.0; /* sum of dxh * xh */
      for (int64_t j = 0; j < gs; j++) {
        const double xh = w.x[j] * rstd, go = d_out[norm_at(&p->d_out, t, b, c0 + j, P)];
        c += go * (double)weight[c0 + j] * xh;
        acc_w[c0 + j] += go * xh;
      }
      c /= (double)gs;
      for (int64_t j = 0; j < gs; j++) {
        const int64_t ch = c0 + j;
        const double go = d_out[norm_at(&p->d_out, t, b, ch, P)];
        const double dx = rstd * (go * (double)weight[ch] - w.x[j] * rstd * c);
        double dy = dx;
        if (z) {
          const double s = w.s[j];
          dy = dx * w.z[j] * s;
          if (dz) dz[norm_at(&p->dz, t, b, ch, P)] = (REAL)(dx * w.y[j] * s * (1.0 + w.z[j] * (1.0 - s)));
        }
        if (d_o) d_o[norm_at(&p->d_o, t, b, ch, P)] = (REAL)dy;
        if (!has_D) continue;
        const double dv = D[p->D_mode == GDP_OUT_NORM_D_CHANNEL ? ch : ch / P];
        if (dx_v) dx_v[norm_at(&p->dx_v, t, b, ch, P)] = (REAL)(dv * dy);
        acc_D[ch] += dy * (double)x_v[norm_at(&p->x_v, t, b, ch, P)];
      }
    }
  }
  /* thread partials into thread 0's rows (read before they are written) */
  for (int64_t i = 0; i < 2 * d; i++) {
    double s = 0.0;
    for (int t = 0; t < used; t++) s += partial[(size_t)t * 2 * (size_t)d + i];
    partial[i] = s;
  }
  if (dweight)
    for (int64_t i = 0; i < d; i++) dweight[i] = (REAL)partial[i];
  if (dD && has_D) {
    const int per_channel = p->D_mode == GDP_OUT_NORM_D_CHANNEL;
    for (int64_t j = 0; j < (per_channel ? d : p->H); j++) {
      double s = 0.0;
      if (per_channel) s = partial[d + j];
      else for (int64_t q = 0; q < P; q++) s += partial[d + j * P + q];
      dD[j] = (REAL)s;
    }
  }
  free(partial);
  free(scratch);
  return GDP_OK;
}

#endif /* GDP_NORM_GENERIC */
