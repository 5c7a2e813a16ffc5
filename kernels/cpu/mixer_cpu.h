/*
 * mixer_cpu.h -- CPU kernels of the mixer layer ops (gdp.h, "mixer layer ops"):
 * depthwise causal conv1d, the beta/decay gates, SiLU, the output norm (D skip fused into
 * the gated grouped RMSNorm), the D skip alone and the fused input stage, each forward
 * and backward, for float64 (_f64) and float32 (_f32).
 *
 * Kernels see contiguous row-major buffers of one dtype and plain sizes (the output
 * norm: strided operands, ../mixer_problem.h); the op layer
 * (core/src/op_mixer.c) validates, converts and allocates.  Backward outputs may be
 * NULL (not wanted).  float32 elementwise math is float32; sums over tokens and norm
 * groups accumulate in double.  Kernels that need scratch memory return GDP_ERR_OOM
 * with the message set; the others cannot fail.
 */
#ifndef GDP_KERNELS_CPU_MIXER_H
#define GDP_KERNELS_CPU_MIXER_H

#include <stdint.h>

#include "gdp.h"
#include "../mixer_problem.h"

/* conv1d: the problem and the buffers' layouts are in ../mixer_problem.h (a->dtype is
 * not read: the suffix says it). */
void gdp_cpu_conv1d_fwd_f64(const gdp_conv1d_problem *a, const double *x, const double *wt,
                            const double *bias, const double *halo, double *out);
void gdp_cpu_conv1d_fwd_f32(const gdp_conv1d_problem *a, const float *x, const float *wt,
                            const float *bias, const float *halo, float *out);
/* dweight [C,W], dbias [C], dhalo [halo_len,B,C]; any may be NULL, so may dx. */
gdp_status gdp_cpu_conv1d_bwd_f64(const gdp_conv1d_problem *a, const double *x,
                                  const double *wt, const double *bias, const double *halo,
                                  const double *d_out, double *dx, double *dweight, double *dbias,
                                  double *dhalo);
gdp_status gdp_cpu_conv1d_bwd_f32(const gdp_conv1d_problem *a, const float *x,
                                  const float *wt, const float *bias, const float *halo,
                                  const float *d_out, float *dx, float *dweight, float *dbias,
                                  float *dhalo);

/* beta = scale * sigmoid(b) over n elements; db = d_beta * scale * s (1 - s). */
void gdp_cpu_beta_fwd_f64(int64_t n, double scale, const double *b, double *beta, int nthreads);
void gdp_cpu_beta_fwd_f32(int64_t n, double scale, const float *b, float *beta, int nthreads);
void gdp_cpu_beta_bwd_f64(int64_t n, double scale, const double *b, const double *d_beta,
                          double *db, int nthreads);
void gdp_cpu_beta_bwd_f32(int64_t n, double scale, const float *b, const float *d_beta,
                          float *db, int nthreads);

/* out = x * sigmoid(x); dx = d_out * s (1 + x (1 - s)), over rows of C elements, each
 * operand's rows ld_* elements apart. */
void gdp_cpu_silu_fwd_f64(int64_t rows, int64_t C, const double *x, int64_t ld_x, double *out,
                          int64_t ld_out, int nthreads);
void gdp_cpu_silu_fwd_f32(int64_t rows, int64_t C, const float *x, int64_t ld_x, float *out,
                          int64_t ld_out, int nthreads);
void gdp_cpu_silu_bwd_f64(int64_t rows, int64_t C, const double *x, int64_t ld_x,
                          const double *d_out, int64_t ld_d, double *dx, int64_t ld_dx,
                          int nthreads);
void gdp_cpu_silu_bwd_f32(int64_t rows, int64_t C, const float *x, int64_t ld_x,
                          const float *d_out, int64_t ld_d, float *dx, int64_t ld_dx,
                          int nthreads);

/* g[r,h] = -exp(A_log[h]) * softplus(a[r,h] + dt_bias[h]) over rows x H; dt_bias may be
 * NULL.  Backward: da [rows,H]; dA_log, ddt_bias [H] (double sums, any may be NULL). */
void gdp_cpu_decay_fwd_f64(int64_t rows, int64_t H, const double *a, const double *A_log,
                           const double *dt_bias, double *g, int nthreads);
void gdp_cpu_decay_fwd_f32(int64_t rows, int64_t H, const float *a, const float *A_log,
                           const float *dt_bias, float *g, int nthreads);
gdp_status gdp_cpu_decay_bwd_f64(int64_t rows, int64_t H, const double *a, const double *A_log,
                                 const double *dt_bias, const double *d_g, double *da,
                                 double *dA_log, double *ddt_bias, int nthreads);
gdp_status gdp_cpu_decay_bwd_f32(int64_t rows, int64_t H, const float *a, const float *A_log,
                                 const float *dt_bias, const float *d_g, float *da,
                                 float *dA_log, float *ddt_bias, int nthreads);

/* The output norm: the D skip fused into the gated grouped RMSNorm, on the strided
 * operands of ../mixer_problem.h (p->dtype is not read: the suffix says it).  x_v and D
 * are read only with p->D_mode, z may be NULL.  Backward results may be NULL; dD [H] or
 * [H*P] as D, dweight [H*P]. */
gdp_status gdp_cpu_out_norm_fwd_f64(const gdp_out_norm_problem *p, const double *o,
                                    const double *x_v, const double *D, const double *z,
                                    const double *weight, double *out);
gdp_status gdp_cpu_out_norm_fwd_f32(const gdp_out_norm_problem *p, const float *o,
                                    const float *x_v, const float *D, const float *z,
                                    const float *weight, float *out);
gdp_status gdp_cpu_out_norm_bwd_f64(const gdp_out_norm_problem *p, const double *o,
                                    const double *x_v, const double *D, const double *z,
                                    const double *weight, const double *d_out, double *d_o,
                                    double *dz, double *dx_v, double *dD, double *dweight);
gdp_status gdp_cpu_out_norm_bwd_f32(const gdp_out_norm_problem *p, const float *o,
                                    const float *x_v, const float *D, const float *z,
                                    const float *weight, const float *d_out, float *d_o,
                                    float *dz, float *dx_v, float *dD, float *dweight);

/* D skip over rows x H x P: out = y + D * x_v with D [H] (per_channel 0) or [H*P] (1).
 * Backward: dx_v = D * d_out; dD = sum over rows of d_out * x_v (and over P per head). */
void gdp_cpu_dskip_fwd_f64(int64_t rows, int64_t H, int64_t P, int per_channel, const double *y,
                           const double *x_v, const double *D, double *out, int nthreads);
void gdp_cpu_dskip_fwd_f32(int64_t rows, int64_t H, int64_t P, int per_channel, const float *y,
                           const float *x_v, const float *D, float *out, int nthreads);
gdp_status gdp_cpu_dskip_bwd_f64(int64_t rows, int64_t H, int64_t P, int per_channel,
                                 const double *x_v, const double *D, const double *d_out,
                                 double *dx_v, double *dD, int nthreads);
gdp_status gdp_cpu_dskip_bwd_f32(int64_t rows, int64_t H, int64_t P, int per_channel,
                                 const float *x_v, const float *D, const float *d_out,
                                 float *dx_v, float *dD, int nthreads);

/* The input stage (mixer_inputs.c; layouts in ../mixer_problem.h).  The backward
 * returns GDP_ERR_OOM when its per-thread sums find no host memory. */
void gdp_cpu_ssm_inputs_fwd_f64(const gdp_ssm_inputs_problem *p, const gdp_ssm_inputs_fwd_io *io);
void gdp_cpu_ssm_inputs_fwd_f32(const gdp_ssm_inputs_problem *p, const gdp_ssm_inputs_fwd_io *io);
gdp_status gdp_cpu_ssm_inputs_bwd_f64(const gdp_ssm_inputs_problem *p,
                                      const gdp_ssm_inputs_bwd_io *io);
gdp_status gdp_cpu_ssm_inputs_bwd_f32(const gdp_ssm_inputs_problem *p,
                                      const gdp_ssm_inputs_bwd_io *io);

#endif /* GDP_KERNELS_CPU_MIXER_H */
