/*
 * l2norm.c -- row-wise L2 normalisation of q and k (use_qk_l2norm) and its backward.
 *
 *   y = x r,  r = (sum x^2 + eps)^-1/2        dx = r (dy - y (y . dy))
 *
 * eps sits inside the square root (fla's l2norm), so a zero row gives y = 0, never a
 * division by zero.  The float32 versions accumulate sums in double: rows are short
 * (K <= 256), so this costs nothing and removes the summation error from comparisons.
 * Both directions work in place: forward y may alias x, backward dx may alias dy (each
 * row reads all it needs before writing).
 */
#include <math.h>

#include "gdp_cpu.h"

/* The context's thread count, not OpenMP's default team (all cores). */
static int l2_threads(int num_threads) { return num_threads < 1 ? 1 : num_threads; }

void gdp_cpu_l2norm_fwd_f64(int64_t rows, int64_t dim, double eps, const double *x, double *y,
                            int num_threads) {
#pragma omp parallel for schedule(static) num_threads(l2_threads(num_threads)) \
    if (rows * dim > (1 << 16))
  for (int64_t i = 0; i < rows; i++) {
    const double *xi = x + i * dim;
    double *yi = y + i * dim;
    double ss = 0.0;
    for (int64_t d = 0; d < dim; d++) ss += xi[d] * xi[d];
    const double r = 1.0 / sqrt(ss + eps);
    for (int64_t d = 0; d < dim; d++) yi[d] = xi[d] * r;
  }
}

void gdp_cpu_l2norm_fwd_f32(int64_t rows, int64_t dim, double eps, const float *x, float *y,
                            int num_threads) {
#pragma omp parallel for schedule(static) num_threads(l2_threads(num_threads)) \
    if (rows * dim > (1 << 16))
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = x + i * dim;
    float *yi = y + i * dim;
    double ss = 0.0;
    for (int64_t d = 0; d < dim; d++) ss += (double)xi[d] * xi[d];
    const double r = 1.0 / sqrt(ss + eps);
    for (int64_t d = 0; d < dim; d++) yi[d] = (float)(xi[d] * r);
  }
}

void gdp_cpu_l2norm_bwd_f64(int64_t rows, int64_t dim, double eps, const double *x,
                            const double *dy, double *dx, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(l2_threads(num_threads)) \
    if (rows * dim > (1 << 16))
  for (int64_t i = 0; i < rows; i++) {
    const double *xi = x + i * dim, *dyi = dy + i * dim;
    double *dxi = dx + i * dim;
    double ss = 0.0, x_dot_dy = 0.0;
    for (int64_t d = 0; d < dim; d++) {
      ss += xi[d] * xi[d];
      x_dot_dy += xi[d] * dyi[d];
    }
    const double r = 1.0 / sqrt(ss + eps);
    const double y_dot_dy = r * x_dot_dy; /* (y . dy) with y = x r */
    for (int64_t d = 0; d < dim; d++) dxi[d] = r * (dyi[d] - xi[d] * r * y_dot_dy);
  }
}

void gdp_cpu_l2norm_bwd_f32(int64_t rows, int64_t dim, double eps, const float *x,
                            const float *dy, float *dx, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(l2_threads(num_threads)) \
    if (rows * dim > (1 << 16))
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = x + i * dim, *dyi = dy + i * dim;
    float *dxi = dx + i * dim;
    double ss = 0.0, x_dot_dy = 0.0;
    for (int64_t d = 0; d < dim; d++) {
      ss += (double)xi[d] * xi[d];
      x_dot_dy += (double)xi[d] * dyi[d];
    }
    const double r = 1.0 / sqrt(ss + eps);
    const double y_dot_dy = r * x_dot_dy;
    for (int64_t d = 0; d < dim; d++) dxi[d] = (float)(r * (dyi[d] - xi[d] * r * y_dot_dy));
  }
}
