/*
 * state_tracking.c -- the state-tracking tasks on the cpu (kernels/state_tracking.h):
 * one row per sequence, rows spread over the worker threads.  Rows are independent,
 * so the result does not depend on the thread count.
 */
#include <omp.h>

#include "state_tracking_cpu.h"

void gdp_cpu_state_tracking(const gdp_state_tracking_problem *p, int32_t *tokens,
                            int32_t *labels) {
  const int nthreads = p->num_threads < 1 ? 1 : p->num_threads;
  const int64_t T = p->length;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (p->batch * T > 4096)
  for (int64_t b = 0; b < p->batch; b++)
    gdp_state_tracking_row(p, p->mul, b, tokens + b * T, labels + b * T);
}
