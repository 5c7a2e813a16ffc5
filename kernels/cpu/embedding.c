/*
 * embedding.c -- the embedding gather and its backward (see nn_cpu.h, ../nn_problem.h).
 * The backward owns one vocabulary row per iteration and walks that row's tokens in
 * order (the op layer's bucketing), so threads never write the same row and the sums
 * do not depend on the thread count.
 *
 * Compiled twice (double, float) through real_instances.h, as conv1d.c.
 */
#ifndef GDP_EMBEDDING_GENERIC

#include <string.h>

#include "nn_cpu.h"

#define EMBED_PAR_MIN (1 << 15)

static int embed_threads(int n) { return n < 1 ? 1 : n; }

#define GDP_EMBEDDING_GENERIC
#define GDP_REAL_FILE "embedding.c"
#include "real_instances.h"
#undef GDP_EMBEDDING_GENERIC

#else /* GDP_EMBEDDING_GENERIC */

void FN(gdp_cpu_embedding_fwd)(const gdp_embedding_problem *p, const REAL *weight, REAL *out) {
  const int64_t D = p->D;
#pragma omp parallel for schedule(static) num_threads(embed_threads(p->num_threads)) \
    if (p->n * D > EMBED_PAR_MIN)
  for (int64_t i = 0; i < p->n; i++)
    memcpy(out + i * D, weight + p->tokens[i] * D, (size_t)D * sizeof(REAL));
}

void FN(gdp_cpu_embedding_bwd)(const gdp_embedding_problem *p, const REAL *d_out, REAL *dweight) {
  const int64_t D = p->D;
#pragma omp parallel for schedule(dynamic, 1) num_threads(embed_threads(p->num_threads)) \
    if (p->n * D > EMBED_PAR_MIN)
  for (int64_t v = 0; v < p->V; v++) {
    REAL *row = dweight + v * D;
    for (int64_t j = 0; j < D; j++) {
      double s = 0.0;
      for (int64_t k = p->row_start[v]; k < p->row_start[v + 1]; k++)
        s += (double)d_out[p->row_tokens[k] * D + j];
      row[j] = (REAL)s;
    }
  }
}

#endif /* GDP_EMBEDDING_GENERIC */
