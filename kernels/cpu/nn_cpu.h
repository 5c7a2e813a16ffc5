/*
 * nn_cpu.h -- CPU kernels of the model layer ops (gdp.h, "model layer ops"): the SwiGLU
 * gate silu(gate) * up, the embedding gather and its bucketed backward, and the
 * cross-entropy with its gradient, for float64 (_f64) and float32 (_f32).
 *
 * Kernels see contiguous row-major buffers of one dtype and the problems of
 * ../nn_problem.h (already validated); the op layer (core/src/op_nn.c) converts and
 * allocates.  float32 elementwise math is float32; sums (a row's log-sum-exp, the loss,
 * an embedding row's gradient) accumulate in double.  None of them can fail.
 */
#ifndef GDP_KERNELS_CPU_NN_H
#define GDP_KERNELS_CPU_NN_H

#include <stdint.h>

#include "gdp.h"
#include "../nn_problem.h"

/* out = silu(gate) * up over n elements; backward d_gate, d_up (either may be NULL). */
void gdp_cpu_silu_mul_fwd_f64(int64_t n, const double *gate, const double *up, double *out,
                              int nthreads);
void gdp_cpu_silu_mul_fwd_f32(int64_t n, const float *gate, const float *up, float *out,
                              int nthreads);
void gdp_cpu_silu_mul_bwd_f64(int64_t n, const double *gate, const double *up,
                              const double *d_out, double *d_gate, double *d_up, int nthreads);
void gdp_cpu_silu_mul_bwd_f32(int64_t n, const float *gate, const float *up, const float *d_out,
                              float *d_gate, float *d_up, int nthreads);

/* out[i,:] = weight[tokens[i],:]; dweight[v,:] = sum over row v's tokens of d_out[i,:]. */
void gdp_cpu_embedding_fwd_f64(const gdp_embedding_problem *p, const double *weight,
                               double *out);
void gdp_cpu_embedding_fwd_f32(const gdp_embedding_problem *p, const float *weight, float *out);
void gdp_cpu_embedding_bwd_f64(const gdp_embedding_problem *p, const double *d_out,
                               double *dweight);
void gdp_cpu_embedding_bwd_f32(const gdp_embedding_problem *p, const float *d_out,
                               float *dweight);

/* *loss_sum = sum over counted rows of logsumexp(row) - row[target] (not scaled);
 * dlogits (may be NULL) as ../nn_problem.h says. */
void gdp_cpu_cross_entropy_f64(const gdp_cross_entropy_problem *p, const double *logits,
                               double *loss_sum, double *dlogits);
void gdp_cpu_cross_entropy_f32(const gdp_cross_entropy_problem *p, const float *logits,
                               double *loss_sum, float *dlogits);

#endif /* GDP_KERNELS_CPU_NN_H */
