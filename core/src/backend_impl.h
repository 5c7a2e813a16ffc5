/*
 * backend_impl.h -- the per-device vtable (ggml's backend idea).  The public API
 * validates arguments, then dispatches through ctx->backend; a backend may assume
 * validated arguments (shapes agree, dtypes supported, tensors on its device).
 * Every op goes through this table; an entry a backend does not have stays NULL (its
 * table uses designated initialisers), and the op layer reports the op as not
 * implemented on that device.
 */
#ifndef GDP_BACKEND_IMPL_H
#define GDP_BACKEND_IMPL_H

#include "internal.h"
#include "../../kernels/gdp_problem.h"
#include "../../kernels/mixer_problem.h"
#include "../../kernels/state_tracking.h"
#include "../../kernels/optim_problem.h"
#include "../../kernels/nn_problem.h"

typedef enum gdp_reduce_kind {
  GDP_REDUCE_SUM = 0,
  GDP_REDUCE_DOT = 1,       /* sum(a*b) */
  GDP_REDUCE_SUMSQ = 2,
  GDP_REDUCE_MAXABS = 3,
  GDP_REDUCE_NONFINITE = 4, /* count of NaN/inf, as a double */
  GDP_REDUCE_DIFF_SUMSQ = 5 /* sum((a-b)^2) */
} gdp_reduce_kind;

typedef enum gdp_binary_kind {
  GDP_BINARY_AXPY = 0, /* out = a + alpha*b */
  GDP_BINARY_MUL = 1,  /* out = a*b */
  GDP_BINARY_SCALE = 2 /* out = alpha*a (b unused) */
} gdp_binary_kind;

typedef enum gdp_rng_kind { GDP_RNG_UNIFORM = 0, GDP_RNG_NORMAL = 1 } gdp_rng_kind;

struct gdp_backend {
  const char *name;
  gdp_device_type type;
  int (*device_count)(void);
  gdp_status (*ctx_init)(gdp_ctx *ctx);      /* may be NULL */
  void (*ctx_fini)(gdp_ctx *ctx);            /* may be NULL */
  gdp_status (*alloc)(gdp_ctx *ctx, size_t nbytes, void **out);
  void (*release)(gdp_ctx *ctx, void *ptr, size_t nbytes);
  gdp_status (*sync)(gdp_ctx *ctx);
  /* Contiguous byte copies between host memory and this device (either direction). */
  gdp_status (*to_device)(gdp_ctx *ctx, void *dst_dev, const void *src_host, size_t nbytes);
  gdp_status (*to_host)(gdp_ctx *ctx, void *dst_host, const void *src_dev, size_t nbytes);
  /* Same-device strided copy with dtype conversion (same shapes). */
  gdp_status (*copy)(gdp_ctx *ctx, gdp_tensor *dst, const gdp_tensor *src);
  gdp_status (*fill)(gdp_ctx *ctx, gdp_tensor *t, double value);
  gdp_status (*rng)(gdp_ctx *ctx, gdp_tensor *t, gdp_rng_kind kind, double a, double b,
                    uint64_t seed, uint64_t offset);
  gdp_status (*binary)(gdp_ctx *ctx, gdp_tensor *out, const gdp_tensor *a, const gdp_tensor *b,
                       gdp_binary_kind kind, double alpha);
  gdp_status (*reduce)(gdp_ctx *ctx, const gdp_tensor *a, const gdp_tensor *b,
                       gdp_reduce_kind kind, double *out);
  /* Optional: out[i] = the one-operand reduction `kind` of ts[i] (0 for an empty one) for
   * n >= 1 tensors of this device, waiting once for all of them (NULL: the op layer calls
   * reduce per tensor, which a synchronous backend does as fast). */
  gdp_status (*reduce_many)(gdp_ctx *ctx, int n, const gdp_tensor *const *ts,
                            gdp_reduce_kind kind, double *out);
  /* out [M,N] from 2-D a and b, or out [batch,M,N] (batch >= 1, M, N >= 1) from a and b
   * that are each [batch,.,.] or 2-D (the same matrix for every entry); shapes checked. */
  gdp_status (*matmul)(gdp_ctx *ctx, gdp_tensor *out, const gdp_tensor *a, const gdp_tensor *b,
                       int trans_a, int trans_b, double alpha, double beta);
  /* The GDP operator on contiguous tensors of the compute dtype (f64 or f32), q and k
   * already L2-normalised when asked (the op layer does that); see gdp_problem.h. */
  gdp_status (*gdp_forward)(gdp_ctx *ctx, const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io);
  gdp_status (*gdp_backward)(gdp_ctx *ctx, const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io);
  /* Optional: dh0 alone (io's dq, dk, dv, dbeta, dg NULL) for the problems
   * gdp_backward_dh0_takes accepts; the op layer runs gdp_backward for the others. */
  int (*gdp_backward_dh0_takes)(gdp_ctx *ctx, const gdp_delta_product_problem *p);
  gdp_status (*gdp_backward_dh0)(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                 const gdp_delta_product_backward_io *io);
  /* Save for backward (gdp_delta_product_forward_ex); all three NULL: the backend keeps nothing
   * and its saved objects are empty.  gdp_save_plan: the variant that runs p (recorded,
   * and compared by the backward) and the device bytes its forward keeps (0: none).
   * gdp_forward_save: the forward, keeping that many bytes in `saved` (allocated by the
   * op layer through alloc); gdp_backward_saved: the backward of the forward that ran
   * with `variant` (refused when this call would run another), reading `saved` (NULL:
   * recompute). */
  gdp_status (*gdp_save_plan)(gdp_ctx *ctx, const gdp_delta_product_problem *p, int *variant,
                              size_t *bytes);
  gdp_status (*gdp_forward_save)(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                 const gdp_delta_product_forward_io *io, void *saved);
  gdp_status (*gdp_backward_saved)(gdp_ctx *ctx, const gdp_delta_product_problem *p,
                                   const gdp_delta_product_backward_io *io, int variant, const void *saved);
  /* The name of the kernels that run p (a static string: "chunked", "recurrent", "fast
   * chunked"), recorded by the op layer after each call (gdp_ctx_last_path); NULL: unnamed. */
  const char *(*gdp_path)(const gdp_delta_product_problem *p);
  /* Row-wise L2 norm over `dim` contiguous values (the GDP operator's q/k norm, when the
   * backend does not fuse it): y = x / sqrt(sum x^2 + eps), x and y may alias; backward
   * dx = r (dy - y (y . dy)), dx and dy may alias.  `dtype` is the buffers'. */
  gdp_status (*l2norm_forward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t dim,
                               double eps, const void *x, void *y);
  gdp_status (*l2norm_backward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t dim,
                                double eps, const void *x, const void *dy, void *dx);
  /* The mixer layer ops (gdp.h, "mixer layer ops"), on contiguous buffers of one compute
   * dtype (`dtype`, or p->dtype), shapes as kernels/cpu/mixer_cpu.h documents them;
   * backward outputs may be NULL (not wanted).  A backend without an op leaves it NULL
   * and the op layer answers GDP_ERR_UNSUPPORTED naming the op and the device. */
  gdp_status (*conv1d_forward)(gdp_ctx *ctx, const gdp_conv1d_problem *p, const void *x,
                               const void *wt, const void *bias, const void *halo, void *out);
  gdp_status (*conv1d_backward)(gdp_ctx *ctx, const gdp_conv1d_problem *p, const void *x,
                                const void *wt, const void *bias, const void *halo,
                                const void *d_out, void *dx, void *dweight, void *dbias,
                                void *dhalo);
  gdp_status (*beta_forward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t n, double scale,
                             const void *b, void *beta);
  gdp_status (*beta_backward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t n, double scale,
                              const void *b, const void *d_beta, void *db);
  /* over rows of C elements, each operand's rows ld_* elements apart */
  gdp_status (*silu_forward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t C,
                             const void *x, int64_t ld_x, void *out, int64_t ld_out);
  gdp_status (*silu_backward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t C,
                              const void *x, int64_t ld_x, const void *d_out, int64_t ld_d,
                              void *dx, int64_t ld_dx);
  gdp_status (*decay_forward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                              const void *a, const void *A_log, const void *dt_bias, void *g);
  gdp_status (*decay_backward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                               const void *a, const void *A_log, const void *dt_bias,
                               const void *d_g, void *da, void *dA_log, void *ddt_bias);
  /* The output norm and the plain gated RMSNorm (gdp_mixer_out_norm_*,
   * gdp_mixer_gated_rmsnorm_*): strided token operands as kernels/mixer_problem.h says;
   * x_v and D are read only with p->D_mode; z, and any backward result, may be NULL. */
  gdp_status (*out_norm_forward)(gdp_ctx *ctx, const gdp_out_norm_problem *p, const void *o,
                                 const void *x_v, const void *D, const void *z,
                                 const void *weight, void *out);
  gdp_status (*out_norm_backward)(gdp_ctx *ctx, const gdp_out_norm_problem *p, const void *o,
                                  const void *x_v, const void *D, const void *z,
                                  const void *weight, const void *d_out, void *d_o, void *dz,
                                  void *dx_v, void *dD, void *dweight);
  gdp_status (*dskip_forward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H, int64_t P,
                              int per_channel, const void *y, const void *x_v, const void *D,
                              void *out);
  gdp_status (*dskip_backward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t rows, int64_t H,
                               int64_t P, int per_channel, const void *x_v, const void *D,
                               const void *d_out, void *dx_v, void *dD);
  /* The fused input stage (gdp_mixer_ssm_inputs_forward / _backward) on the buffers and
   * row strides of ../../kernels/mixer_problem.h. */
  gdp_status (*ssm_inputs_forward)(gdp_ctx *ctx, const gdp_ssm_inputs_problem *p,
                                   const gdp_ssm_inputs_fwd_io *io);
  gdp_status (*ssm_inputs_backward)(gdp_ctx *ctx, const gdp_ssm_inputs_problem *p,
                                    const gdp_ssm_inputs_bwd_io *io);
  /* The state-tracking tasks (gdp_data_state_tracking; kernels/state_tracking.h):
   * tokens and labels [p->batch, p->length] contiguous int32 on this device; p->mul
   * (host memory) is the product table or NULL (a cyclic group). */
  gdp_status (*state_tracking)(gdp_ctx *ctx, const gdp_state_tracking_problem *p,
                               int32_t *tokens, int32_t *labels);
  /* The fused optimiser update (gdp.h, "optimisers"; kernels/optim_problem.h), on
   * buffers the op layer has checked. */
  gdp_status (*optim_update)(gdp_ctx *ctx, const gdp_optim_update *u);
  /* The model layer ops (gdp.h, "model layer ops"; op_nn.c), on contiguous buffers of
   * the compute dtype; integer inputs as device_indices says (nn_problem.h).  silu_mul
   * backward outputs may be NULL.  embedding_backward's dweight is float32 for bf16
   * d_out.  cross_entropy writes its result (nn_problem.h: the mean loss and the counted
   * rows, two doubles in the device's memory) and, when dlogits is not NULL, the
   * gradient; a device-index backend may report its index check later (nn_problem.h). */
  gdp_status (*silu_mul_forward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t n, const void *gate,
                                 const void *up, void *out);
  gdp_status (*silu_mul_backward)(gdp_ctx *ctx, gdp_dtype dtype, int64_t n, const void *gate,
                                  const void *up, const void *d_out, void *d_gate, void *d_up);
  gdp_status (*embedding_forward)(gdp_ctx *ctx, const gdp_embedding_problem *p,
                                  const void *weight, void *out);
  gdp_status (*embedding_backward)(gdp_ctx *ctx, const gdp_embedding_problem *p,
                                   const void *d_out, void *dweight);
  gdp_status (*cross_entropy)(gdp_ctx *ctx, const gdp_cross_entropy_problem *p,
                              const void *logits, void *result, void *dlogits);
  /* 1: the mixer and model layer entries above also take bf16 buffers (float32 math
   * inside); 0: the op layer refuses bf16 inputs to them on this device. */
  int mixer_bf16;
  /* 1: the model layer ops take their integer inputs as contiguous device buffers and
   * validate them there (no host pass over the tokens; the verdict through the op's
   * gdp_index_check, nn_problem.h);
   * 0: as host arrays the op layer has read, validated and bucketed. */
  int device_indices;
  int (*supports)(gdp_op op, gdp_dtype dtype);
  /* Device timing of queued work (gdp_ctx_timer_start / _stop); NULL: the backend has
   * no device timer (the CPU's work runs on the calling thread: time it on the host). */
  gdp_status (*timer_start)(gdp_ctx *ctx, double hold_ms);
  gdp_status (*timer_stop)(gdp_ctx *ctx, double *device_ms);
};

extern const gdp_backend gdp_backend_cpu;
#ifdef GDP_HAVE_CUDA
extern const gdp_backend gdp_backend_cuda;
#endif

/* The backend for a device type, or NULL when not built in. */
const gdp_backend *gdp_backend_for(gdp_device_type type);

/* The error for an op whose entry the context's backend leaves NULL, e.g.
 * "gdp_mixer_beta_forward: not implemented on cuda (ctx on cuda:0)". */
#define GDP_NOT_IMPLEMENTED(func, ctx)                                                  \
  GDP_ERROR_IN((func), GDP_ERR_UNSUPPORTED, "not implemented on %s (ctx on %s:%d)",      \
               gdp_device_type_name((ctx)->type), gdp_device_type_name((ctx)->type),    \
               (ctx)->index)

/* 1 when v is a value the value_block tuning field takes: 0, 16, 32 or 64 (ctx.c). */
int gdp_value_block_valid(int v);

/* Whether x (a float, or an int64 going to int32) has a value of the integer dtype
 * `dst` after the truncating cast: false for NaN, +-inf and anything outside the
 * type's range.  Both backends' rule for conversions to i32/i64 (the CUDA kernels
 * repeat it as IntRange in kernels/cuda/tensor_ops.cu). */
static inline int gdp_fits_int(double x, gdp_dtype dst) {
  if (dst == GDP_DTYPE_I32) return x > -2147483649.0 && x < 2147483648.0; /* NaN fails */
  return x >= -9223372036854775808.0 && x < 9223372036854775808.0;
}

/* Allocation bookkeeping for gdp_mem_live_bytes (atomic). */
void gdp_mem_track(gdp_device_type type, int64_t delta_bytes);

#endif /* GDP_BACKEND_IMPL_H */
