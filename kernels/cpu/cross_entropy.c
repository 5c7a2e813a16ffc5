/*
 * cross_entropy.c -- the token loss and its gradient (see nn_cpu.h, ../nn_problem.h):
 *
 *   m = max(row),  lse = m + log(sum exp(row - m)),  loss_r = lse - row[target]
 *   dlogits = scale (exp(row - lse) - onehot(target))
 *
 * The row's sum of exponentials and the loss sum accumulate in double; rows spread
 * over threads, whose partial loss sums are added in thread order.
 *
 * Compiled twice (double, float) through real_instances.h, as conv1d.c.
 */
#ifndef GDP_XENT_GENERIC

#include <stdlib.h>
#include <string.h>
#include <tgmath.h>

#include <omp.h>

#include "nn_cpu.h"

#define XENT_PAR_MIN (1 << 15)
#define XENT_MAX_THREADS 256

static int xent_threads(int n) {
  if (n < 1) return 1;
  return n > XENT_MAX_THREADS ? XENT_MAX_THREADS : n;
}

#define GDP_XENT_GENERIC
#define GDP_REAL_FILE "cross_entropy.c"
#include "real_instances.h"
#undef GDP_XENT_GENERIC

#else /* GDP_XENT_GENERIC */

void FN(gdp_cpu_cross_entropy)(const gdp_cross_entropy_problem *p, const REAL *logits,
                               double *loss_sum, REAL *dlogits) {
  const int64_t V = p->V;
  const int nt = xent_threads(p->num_threads);
  double partial[XENT_MAX_THREADS] = {0};
  int used = 1;
#pragma omp parallel num_threads(nt) if (p->rows * V > XENT_PAR_MIN)
  {
#pragma omp single
    used = omp_get_num_threads();
    double acc = 0.0;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p->rows; r++) {
      const REAL *x = logits + r * V;
      const int64_t t = p->target[r];
      if (t < 0) {
        if (dlogits) memset(dlogits + r * V, 0, (size_t)V * sizeof(REAL));
        continue;
      }
      double m = (double)x[0];
      for (int64_t j = 1; j < V; j++)
        if ((double)x[j] > m) m = (double)x[j];
      double sum = 0.0;
      for (int64_t j = 0; j < V; j++) sum += exp((double)x[j] - m);
      const double lse = m + log(sum);
      acc += lse - (double)x[t];
      if (!dlogits) continue;
      REAL *dx = dlogits + r * V;
      for (int64_t j = 0; j < V; j++) {
        const double sm = exp((double)x[j] - lse);
        dx[j] = (REAL)(p->scale * (sm - (j == t ? 1.0 : 0.0)));
      }
    }
    partial[omp_get_thread_num()] = acc;
  }
  double total = 0.0;
  for (int i = 0; i < used; i++) total += partial[i];
  *loss_sum = total;
}

#endif /* GDP_XENT_GENERIC */
