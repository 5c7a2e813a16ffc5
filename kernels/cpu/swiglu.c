/*
 * swiglu.c -- the SwiGLU MLP's gate (see nn_cpu.h):
 *
 *   out = silu(gate) * up = gate s up,  s = sigmoid(gate)
 *   d_up = d_out gate s,  d_gate = d_out up s (1 + gate (1 - s))
 *
 * Compiled twice (double, float) through real_instances.h, as conv1d.c.
 */
#ifndef GDP_SWIGLU_GENERIC

#include <tgmath.h>

#include "nn_cpu.h"

#define SWIGLU_PAR_MIN (1 << 15)

static int swiglu_threads(int n) { return n < 1 ? 1 : n; }

#define GDP_SWIGLU_GENERIC
#define GDP_REAL_FILE "swiglu.c"
#include "real_instances.h"
#undef GDP_SWIGLU_GENERIC

#else /* GDP_SWIGLU_GENERIC */

void FN(gdp_cpu_silu_mul_fwd)(int64_t n, const REAL *gate, const REAL *up, REAL *out,
                              int nthreads) {
#pragma omp parallel for schedule(static) num_threads(swiglu_threads(nthreads)) \
    if (n > SWIGLU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    const REAL g = gate[i];
    out[i] = g / ((REAL)1 + exp(-g)) * up[i];
  }
}

void FN(gdp_cpu_silu_mul_bwd)(int64_t n, const REAL *gate, const REAL *up, const REAL *d_out,
                              REAL *d_gate, REAL *d_up, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(swiglu_threads(nthreads)) \
    if (n > SWIGLU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    const REAL g = gate[i], s = (REAL)1 / ((REAL)1 + exp(-g));
    if (d_up) d_up[i] = d_out[i] * g * s;
    if (d_gate) d_gate[i] = d_out[i] * up[i] * s * ((REAL)1 + g * ((REAL)1 - s));
  }
}

#endif /* GDP_SWIGLU_GENERIC */
