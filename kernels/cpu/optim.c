/*
 * optim.c -- the fused optimiser updates on the CPU (../optim_problem.h has the math).
 * Each element is read once, updated in the state dtype (double for f64 parameters,
 * float otherwise) and written once; the bf16 compute copy of a master-weight update is
 * the float32 master rounded to nearest even.
 *
 * Compiled twice (double, float) through real_instances.h.
 */
#ifndef GDP_OPTIM_GENERIC

#include <stdint.h>
#include <tgmath.h>

#include "optim_cpu.h"

#define OPTIM_PAR_MIN (1 << 15)

static int optim_threads(int n) { return n < 1 ? 1 : n; }

/* Gradients and parameters arrive as f64, f32 or bf16; the state dtype fixes REAL. */
static inline double optim_load(const void *p, int dtype, int64_t i) {
  switch (dtype) {
    case GDP_DTYPE_F64: return ((const double *)p)[i];
    case GDP_DTYPE_F32: return ((const float *)p)[i];
    default: return gdp_f32_from_bf16(((const uint16_t *)p)[i]);
  }
}

#define GDP_OPTIM_GENERIC
#define GDP_REAL_FILE "optim.c"
#include "real_instances.h"

void gdp_cpu_optim_update(const gdp_optim_update *u) {
  if (u->state_dtype == GDP_DTYPE_F64)
    optim_update_f64(u);
  else
    optim_update_f32(u);
}

#else /* GDP_OPTIM_GENERIC */

/* The value of a float parameter: from the master when there is one, else the param. */
static inline REAL FN(optim_param)(const gdp_optim_update *u, int64_t i) {
  if (u->master) return ((const REAL *)u->master)[i];
  return (REAL)optim_load(u->param, u->param_dtype, i);
}

/* Stores the updated value into the master and the compute copy (or the param). */
static inline void FN(optim_store)(const gdp_optim_update *u, int64_t i, REAL p) {
  if (!u->master) {
    ((REAL *)u->param)[i] = p;
    return;
  }
  ((REAL *)u->master)[i] = p;
  if (u->param_dtype == GDP_DTYPE_BF16)
    ((uint16_t *)u->param)[i] = gdp_bf16_from_f32((float)p);
  else if (u->param_dtype == GDP_DTYPE_F32)
    ((float *)u->param)[i] = (float)p;
  else
    ((double *)u->param)[i] = (double)p;
}

static void FN(optim_update)(const gdp_optim_update *u) {
  const int64_t n = u->n;
  REAL *s0 = u->state0, *s1 = u->state1;
  if (u->kind == GDP_OPTIM_ADAMW) {
    const REAL b1 = (REAL)u->beta1, b2 = (REAL)u->beta2, eps = (REAL)u->eps;
    const REAL c1 = (REAL)(1.0 - u->beta1), c2 = (REAL)(1.0 - u->beta2);
    const REAL decay = (REAL)u->decay, step_size = (REAL)u->step_size;
    const REAL bc2_sqrt = (REAL)u->bc2_sqrt;
#pragma omp parallel for schedule(static) num_threads(optim_threads(u->num_threads)) if (n > OPTIM_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
      const REAL g = (REAL)optim_load(u->grad, u->grad_dtype, i);
      REAL p = FN(optim_param)(u, i) * decay;
      const REAL m = b1 * s0[i] + c1 * g;
      const REAL v = b2 * s1[i] + c2 * (g * g);
      s0[i] = m;
      s1[i] = v;
      p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps);
      FN(optim_store)(u, i, p);
    }
    return;
  }
  const REAL lr = (REAL)u->lr, wd = (REAL)u->weight_decay, mom = (REAL)u->momentum;
  const REAL keep = (REAL)(1.0 - u->dampening);
  const int use_buf = s0 != NULL, nesterov = u->nesterov, first = u->first;
#pragma omp parallel for schedule(static) num_threads(optim_threads(u->num_threads)) if (n > OPTIM_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    const REAL p = FN(optim_param)(u, i);
    REAL d = (REAL)optim_load(u->grad, u->grad_dtype, i) + wd * p;
    if (use_buf) {
      const REAL buf = first ? d : mom * s0[i] + keep * d;
      s0[i] = buf;
      d = nesterov ? d + mom * buf : buf;
    }
    FN(optim_store)(u, i, p - lr * d);
  }
}

#endif /* GDP_OPTIM_GENERIC */
