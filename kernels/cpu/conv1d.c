/*
 * conv1d.c -- depthwise causal conv1d over time with optional fused SiLU, packed
 * sequence restarts and a halo of preceding tokens (see ../mixer_problem.h), and its backward.
 *
 *   u[t,b,c] = bias[c] + sum_w weight[c,w] * x~[t-(W-1)+w, b, c],   out = act(u)
 *
 * The weight arrives tap-major, wt[w*C + c] (the op layer transposes Megatron's [C,W]), so
 * that every inner loop runs over contiguous channels and vectorises.
 * The backward recomputes u (W multiply-adds per element: cheaper than storing it).
 * dx is a gather over the taps that read each input row, so rows are independent and
 * spread over threads; dweight and dbias are sums over all rows, computed per block of
 * channels (one thread owns a block, no atomics) in double.
 *
 * The file is compiled twice, for double and float: the generic part below the #else
 * is included by this file itself (real_instances.h) with REAL and FN defined (TH's
 * generic-file idea without a second file); <tgmath.h> picks expf/exp for the type.
 */
#ifndef GDP_CONV1D_GENERIC

#include <stdlib.h>
#include <string.h>
#include <tgmath.h>

#include "../kernel_status.h"
#include "../size_check.h"
#include "mixer_cpu.h"

/* Below this many elements the OpenMP fork costs more than the loop. */
#define CONV_PAR_MIN (1 << 15)
/* Channels per dweight task: enough for the inner loops to vectorise. */
#define CONV_CBLOCK 32

static int conv_threads(const gdp_conv1d_problem *a) {
  return a->num_threads < 1 ? 1 : a->num_threads;
}

/* Row of x (or of the halo) that tap position s of token t reads, as an element offset
 * into x (*from_halo = 0) or the halo (*from_halo = 1); -1 when the tap reads zero. */
static inline int64_t conv_tap(const gdp_conv1d_problem *a, int64_t t, int64_t b, int64_t s,
                               int *from_halo) {
  *from_halo = 0;
  if (s >= a->seq_start[t]) return (s * a->B + b) * a->x_ld;
  if (a->seq_start[t] == 0 && s >= -a->halo_len) {
    *from_halo = 1;
    return ((a->halo_len + s) * a->B + b) * a->C;
  }
  return -1;
}

#define GDP_CONV1D_GENERIC
#define GDP_REAL_FILE "conv1d.c"
#include "real_instances.h"
#undef GDP_CONV1D_GENERIC

#else /* GDP_CONV1D_GENERIC: the body, once per REAL */

/* Pre-activation u of one row (t,b) into u[0..C). */
static void FN(conv_row)(const gdp_conv1d_problem *a, const REAL *x, const REAL *wt,
                         const REAL *bias, const REAL *halo, int64_t t, int64_t b,
                         REAL *restrict u) {
  const int64_t C = a->C, W = a->W;
  for (int64_t c = 0; c < C; c++) u[c] = bias ? bias[c] : (REAL)0;
  for (int64_t w = 0; w < W; w++) {
    int from_halo;
    const int64_t off = conv_tap(a, t, b, t - (W - 1) + w, &from_halo);
    if (off < 0) continue;
    const REAL *restrict src = (from_halo ? halo : x) + off;
    const REAL *restrict tap = wt + w * C;
    for (int64_t c = 0; c < C; c++) u[c] += tap[c] * src[c];
  }
}

void FN(gdp_cpu_conv1d_fwd)(const gdp_conv1d_problem *a, const REAL *x, const REAL *wt,
                            const REAL *bias, const REAL *halo, REAL *out) {
  const int64_t rows = a->T * a->B, C = a->C;
#pragma omp parallel for schedule(static) num_threads(conv_threads(a)) if (rows * C > CONV_PAR_MIN)
  for (int64_t row = 0; row < rows; row++) {
    REAL *o = out + row * C;
    FN(conv_row)(a, x, wt, bias, halo, row / a->B, row % a->B, o);
    if (a->silu)
      for (int64_t c = 0; c < C; c++) o[c] = o[c] / ((REAL)1 + exp(-o[c]));
  }
}

gdp_status FN(gdp_cpu_conv1d_bwd)(const gdp_conv1d_problem *a, const REAL *x,
                                  const REAL *wt, const REAL *bias, const REAL *halo,
                                  const REAL *d_out, REAL *dx, REAL *dweight, REAL *dbias,
                                  REAL *dhalo) {
  const int64_t T = a->T, B = a->B, C = a->C, W = a->W, L = a->halo_len;
  const int64_t rows = T * B;
  const int nt = conv_threads(a);
  const int par = rows * C > CONV_PAR_MIN;

  /* du = d_out * act'(u); without an activation du is d_out itself. */
  const REAL *du = d_out;
  REAL *du_buf = NULL;
  if (a->silu && rows * C > 0) {
    size_t bytes;
    du_buf = gdp_size_product(&bytes, rows, C, sizeof(REAL)) ? malloc(bytes) : NULL;
    if (!du_buf)
      return GDP_ERROR(GDP_ERR_OOM, "out of host memory for %lld conv gradients",
                       (long long)(rows * C));
#pragma omp parallel for schedule(static) num_threads(nt) if (par)
    for (int64_t row = 0; row < rows; row++) {
      REAL *g = du_buf + row * C;
      FN(conv_row)(a, x, wt, bias, halo, row / B, row % B, g);
      const REAL *dy = d_out + row * C;
      for (int64_t c = 0; c < C; c++) {
        const REAL s = (REAL)1 / ((REAL)1 + exp(-g[c]));
        g[c] = dy[c] * s * ((REAL)1 + g[c] * ((REAL)1 - s));
      }
    }
    du = du_buf;
  }

  /* dx[s] = sum_w du[s+(W-1)-w] * weight[:,w] over the outputs t of s's own sequence. */
  if (dx) {
#pragma omp parallel for schedule(static) num_threads(nt) if (par)
    for (int64_t row = 0; row < rows; row++) {
      const int64_t s = row / B, b = row % B;
      REAL *g = dx + row * a->dx_ld;
      for (int64_t c = 0; c < C; c++) g[c] = 0;
      for (int64_t w = 0; w < W; w++) {
        const int64_t t = s + (W - 1) - w;
        if (t >= T || a->seq_start[t] > s) continue;
        const REAL *restrict src = du + (t * B + b) * C;
        const REAL *restrict tap = wt + w * C;
        for (int64_t c = 0; c < C; c++) g[c] += tap[c] * src[c];
      }
    }
  }

  /* dhalo: halo row j is position s = j - L, read by the first tokens when they belong
   * to the sequence that starts at token 0. */
  if (dhalo) {
    for (int64_t j = 0; j < L; j++)
      for (int64_t b = 0; b < B; b++) {
        const int64_t s = j - L;
        REAL *g = dhalo + (j * B + b) * C;
        for (int64_t c = 0; c < C; c++) g[c] = 0;
        for (int64_t w = 0; w < W; w++) {
          const int64_t t = s + (W - 1) - w;
          if (t < 0 || t >= T || a->seq_start[t] != 0) continue;
          const REAL *src = du + (t * B + b) * C;
          for (int64_t c = 0; c < C; c++) g[c] += wt[w * C + c] * src[c];
        }
      }
  }

  /* dweight[c,w] = sum_rows du * x~(tap w); dbias[c] = sum_rows du.  One task per block of
   * channels, double accumulators. */
  if (dweight || dbias) {
    const int64_t nblocks = (C + CONV_CBLOCK - 1) / CONV_CBLOCK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (par)
    for (int64_t blk = 0; blk < nblocks; blk++) {
      const int64_t c0 = blk * CONV_CBLOCK;
      const int64_t nc = C - c0 < CONV_CBLOCK ? C - c0 : CONV_CBLOCK;
      double acc_w[CONV_CBLOCK * 16]; /* W <= 16 is checked by the op layer */
      double acc_b[CONV_CBLOCK];
      memset(acc_w, 0, sizeof acc_w);
      memset(acc_b, 0, sizeof acc_b);
      for (int64_t row = 0; row < rows; row++) {
        const int64_t t = row / B, b = row % B;
        const REAL *g = du + row * C + c0;
        for (int64_t c = 0; c < nc; c++) acc_b[c] += g[c];
        for (int64_t w = 0; w < W; w++) {
          int from_halo;
          const int64_t off = conv_tap(a, t, b, t - (W - 1) + w, &from_halo);
          if (off < 0) continue;
          const REAL *src = (from_halo ? halo : x) + off + c0;
          double *aw = acc_w + w * CONV_CBLOCK;
          for (int64_t c = 0; c < nc; c++) aw[c] += (double)g[c] * src[c];
        }
      }
      for (int64_t c = 0; c < nc; c++) {
        if (dbias) dbias[c0 + c] = (REAL)acc_b[c];
        if (dweight)
          for (int64_t w = 0; w < W; w++) dweight[(c0 + c) * W + w] = (REAL)acc_w[w * CONV_CBLOCK + c];
      }
    }
  }
  free(du_buf);
  return GDP_OK;
}

#endif /* GDP_CONV1D_GENERIC */
