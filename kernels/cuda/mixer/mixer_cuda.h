/*
 * mixer_cuda.h -- C-callable launchers of the CUDA mixer layer kernels (conv1d + SiLU,
 * SiLU alone, the beta and decay gates, the D skip, the output norm (D skip + gated
 * grouped RMSNorm), the q/k L2 norm, the fused input stage), forward and backward.  Plain
 * C, included by core/src/backend_cuda.c.
 *
 * Buffers are contiguous, row-major (the output norm: strided as its problem says), on the device, of one gdp_dtype `dtype`: f64
 * (float64 math), f32 or bf16 (float32 math: bf16 values are widened on load and
 * rounded once on store).  Shapes and semantics are those of the CPU kernels
 * (kernels/cpu/mixer_cpu.h, ../../mixer_problem.h).  Backward outputs may be NULL.
 *
 * Parameter gradients (conv weight and bias, A_log, dt_bias, D, norm weight) are sums
 * over all tokens: each block writes partial sums of its slice of tokens to `workspace`
 * and a second kernel adds them up in a fixed order, in double (no atomics, so a run
 * repeats bit for bit).  The *_workspace functions say how many bytes a call needs;
 * the caller allocates them (stream-ordered) and may free them right after the call.
 *
 * Everything is queued on `stream` (a cudaStream_t); the return value reports launch
 * errors (GDP_ERR_CUDA, message set) or bad arguments; asynchronous faults surface at
 * the next synchronisation.
 */
#ifndef GDP_KERNELS_CUDA_MIXER_H
#define GDP_KERNELS_CUDA_MIXER_H

#include <stddef.h>
#include <stdint.h>

#include "gdp.h"
#include "../../mixer_problem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* conv1d.  p->seq_start is NOT read (it is a host array): seq_start_dev is the same
 * T values on the device, or NULL when every token's sequence starts at 0 (no packing). */
gdp_status gdp_cuda_conv1d_fwd(const gdp_conv1d_problem *p, const int64_t *seq_start_dev,
                               const void *x, const void *wt, const void *bias,
                               const void *halo, void *out, void *stream);
size_t gdp_cuda_conv1d_bwd_workspace(const gdp_conv1d_problem *p);
gdp_status gdp_cuda_conv1d_bwd(const gdp_conv1d_problem *p, const int64_t *seq_start_dev,
                               const void *x, const void *wt, const void *bias,
                               const void *halo, const void *d_out, void *dx, void *dweight,
                               void *dbias, void *dhalo, void *workspace, void *stream);

/* beta = scale * sigmoid(b); db = d_beta * scale * s (1 - s). */
gdp_status gdp_cuda_beta_fwd(int dtype, int64_t n, double scale, const void *b, void *beta,
                             void *stream);
gdp_status gdp_cuda_beta_bwd(int dtype, int64_t n, double scale, const void *b,
                             const void *d_beta, void *db, void *stream);

/* out = x * sigmoid(x); dx = d_out * s (1 + x (1 - s)), over rows of C elements, each
 * operand's rows ld_* elements apart. */
gdp_status gdp_cuda_silu_fwd(int dtype, int64_t rows, int64_t C, const void *x, int64_t ld_x,
                             void *out, int64_t ld_out, void *stream);
gdp_status gdp_cuda_silu_bwd(int dtype, int64_t rows, int64_t C, const void *x, int64_t ld_x,
                             const void *d_out, int64_t ld_d, void *dx, int64_t ld_dx,
                             void *stream);

/* g[r,h] = -exp(A_log[h]) softplus(a[r,h] + dt_bias[h]) (dt_bias may be NULL). */
gdp_status gdp_cuda_decay_fwd(int dtype, int64_t rows, int64_t H, const void *a,
                              const void *A_log, const void *dt_bias, void *g, void *stream);
size_t gdp_cuda_decay_bwd_workspace(int64_t rows, int64_t H);
gdp_status gdp_cuda_decay_bwd(int dtype, int64_t rows, int64_t H, const void *a,
                              const void *A_log, const void *dt_bias, const void *d_g, void *da,
                              void *dA_log, void *ddt_bias, void *workspace, void *stream);

/* D skip over rows x H x P, D [H] (per_channel 0) or [H*P] (1). */
gdp_status gdp_cuda_dskip_fwd(int dtype, int64_t rows, int64_t H, int64_t P, int per_channel,
                              const void *y, const void *x_v, const void *D, void *out,
                              void *stream);
size_t gdp_cuda_dskip_bwd_workspace(int64_t rows, int64_t H, int64_t P);
gdp_status gdp_cuda_dskip_bwd(int dtype, int64_t rows, int64_t H, int64_t P, int per_channel,
                              const void *x_v, const void *D, const void *d_out, void *dx_v,
                              void *dD, void *workspace, void *stream);

/* The output norm (D skip fused into the gated grouped RMSNorm) on the strided operands
 * of ../../mixer_problem.h; x_v and D are read only with p->D_mode, z may be NULL.  The
 * workspace holds the dweight and dD partial sums (float32, one row per token chunk). */
gdp_status gdp_cuda_out_norm_fwd(const gdp_out_norm_problem *p, const void *o, const void *x_v,
                                 const void *D, const void *z, const void *weight, void *out,
                                 void *stream);
size_t gdp_cuda_out_norm_bwd_workspace(const gdp_out_norm_problem *p);
gdp_status gdp_cuda_out_norm_bwd(const gdp_out_norm_problem *p, const void *o, const void *x_v,
                                 const void *D, const void *z, const void *weight,
                                 const void *d_out, void *d_o, void *dz, void *dx_v, void *dD,
                                 void *dweight, void *workspace, void *stream);

/* The fused input stage (inputs.cu; buffers and row strides as ../../mixer_problem.h
 * says; the gate buffers in float32 for bf16).  The backward's workspace holds the
 * partial sums of dA_log and ddt_bias (needed also without the gate: pass 1 writes db). */
gdp_status gdp_cuda_ssm_inputs_fwd(const gdp_ssm_inputs_problem *p,
                                   const gdp_ssm_inputs_fwd_io *io, void *stream);
size_t gdp_cuda_ssm_inputs_bwd_workspace(const gdp_ssm_inputs_problem *p);
gdp_status gdp_cuda_ssm_inputs_bwd(const gdp_ssm_inputs_problem *p,
                                   const gdp_ssm_inputs_bwd_io *io, void *workspace,
                                   void *stream);

/* Row-wise L2 norm y = x / sqrt(sum x^2 + eps) (y may alias x); backward
 * dx = r (dy - y (y . dy)) (dx may alias dy). */
gdp_status gdp_cuda_l2norm_fwd(int dtype, int64_t rows, int64_t dim, double eps, const void *x,
                               void *y, void *stream);
gdp_status gdp_cuda_l2norm_bwd(int dtype, int64_t rows, int64_t dim, double eps, const void *x,
                               const void *dy, void *dx, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* GDP_KERNELS_CUDA_MIXER_H */
