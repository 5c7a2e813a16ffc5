/*
 * mixer_problem.h -- the mixer layer's conv1d, output norm and input stage as the kernels
 * see them: plain sizes and raw pointers to buffers of one dtype, no tensor objects.
 * Shared by the op layer (core/src/op_mixer.c), the backend table and the kernels of
 * every device.  (The other mixer ops need only a few sizes, passed as arguments; see
 * core/src/backend_impl.h.)
 *
 * conv1d, on row-major buffers:
 *
 *   x [T,B,C] as rows of C contiguous channels x_ld elements apart (row t*B+b: a channel
 *   slice of the in_proj output is read in place); dx likewise, rows dx_ld apart (written
 *   in place into the in_proj gradient); out [T,B,C]; wt [W,C] (tap-major: the transpose
 *   of Megatron's [C,1,W] weight, so that inner loops run over contiguous channels);
 *   dweight [C,W]; bias, dbias [C] or NULL; halo, dhalo [halo_len,B,C] or NULL.
 *
 * seq_start[t] is the first token of the sequence holding token t; a tap at s < seq_start[t]
 * reads the halo row halo_len+s when seq_start[t] == 0 and s >= -halo_len, else zero.
 */
#ifndef GDP_KERNELS_MIXER_PROBLEM_H
#define GDP_KERNELS_MIXER_PROBLEM_H

#include <stdint.h>

typedef struct gdp_conv1d_problem {
  int64_t T, B, C, W;
  const int64_t *seq_start; /* host array, T entries */
  int64_t halo_len;         /* 0 without a halo */
  int64_t x_ld;             /* x's row stride in elements (C when contiguous) */
  int64_t dx_ld;            /* dx's row stride (backward) */
  int silu;                 /* fused SiLU after the bias */
  int num_threads;          /* CPU worker threads */
  int dtype;                /* gdp_dtype of every buffer: the compute dtype */
} gdp_conv1d_problem;

/*
 * The output norm (gdp_mixer_out_norm_*, gdp_mixer_gated_rmsnorm_*): the D skip fused
 * into the gated grouped RMSNorm,
 *
 *   y = o + D * x_v,  x = y * silu(z),  out = x * rstd * weight,
 *   rstd = (mean over the group of x^2 + eps)^-1/2   (per token and group of gs channels)
 *
 * over tokens (t, b) and channels c = h*P + p.  Every token operand is addressed as
 * [T,B,H,P] through its own element strides -- element (t,b,h,p) at t*st + b*sb + h*sh + p,
 * p always contiguous -- so the operator's [B,T,H,P] output, x_v inside the conv output
 * and z inside in_proj's output are read where they lie.  D [H] or [H*P] and weight [H*P]
 * are contiguous.  The skip (D_mode 0) and the gate (z NULL) are optional.
 *
 * Backward, with dxh = d_out * weight, xh = x * rstd and c = mean over the group of dxh * xh:
 *   dx = rstd (dxh - xh c),  d_o = dx * silu(z) (the gradient of y),
 *   dz = dx * y * s (1 + z (1 - s)) with s = sigmoid(z),  dx_v = D * d_o,
 *   dweight = sum over tokens of d_out * xh,  dD = sum over tokens of d_o * x_v (per head:
 *   and over its P channels).
 */
typedef struct gdp_tbhp_strides {
  int64_t t, b, h; /* elements; p has stride 1 */
} gdp_tbhp_strides;

enum { GDP_OUT_NORM_NO_D = 0, GDP_OUT_NORM_D_HEAD = 1, GDP_OUT_NORM_D_CHANNEL = 2 };

typedef struct gdp_out_norm_problem {
  int64_t T, B, H, P;
  int64_t group_size; /* divides H*P */
  double eps;
  int D_mode;      /* GDP_OUT_NORM_NO_D, _D_HEAD (D [H]) or _D_CHANNEL (D [H*P]) */
  int num_threads; /* CPU worker threads */
  int dtype;       /* gdp_dtype of every buffer: the compute dtype */
  /* forward operands and result; backward's d_out and results (unused ones ignored) */
  gdp_tbhp_strides o, x_v, z, out, d_out, d_o, dz, dx_v;
} gdp_out_norm_problem;

/*
 * The input stage (gdp_mixer_ssm_inputs_forward / _backward): the conv output and the
 * gate sections, sequence-major, to the operator's batch-major inputs and back.  Token
 * (t, b) is row r = t*B + b of the sequence-major buffers, which are read (and, in the
 * backward, written) as rows of contiguous elements a row stride apart, so that views
 * into the in_proj output and its gradient need no copy:
 *
 *   xBC, dxBC [rows, ld_xBC / ld_dxBC]: [V (m,h,p) | K (m,g,n) | Q (g,n)], conv_dim wide
 *   (with silu, xBC before the SiLU of a layer without short conv, and dxBC its gradient:
 *   dxBC = (the sums below) * silu'(xBC))
 *   b, db [rows, ld_b / ld_db]: (m,h);   a, da [rows, ld_a / ld_da]: h
 *   dx_v [rows, nh, P] contiguous (the D skip's gradient, added to value copy m = 0)
 *
 * and the operator's side is contiguous: q, dq [B,T,nh,N]; k, dk [B,T*M,nh,N] (row
 * t*M+m); v, dv [B,T*M,nh,P]; beta, dbeta [B,T*M,nh]; g, dg [B,T,nh].  Head h reads
 * group h / (nh/ng).  The gate buffers (A_log, dt_bias [nh], g, dg, dA_log, ddt_bias)
 * are in the gate dtype: the compute dtype, except float32 for bf16.
 */
typedef struct gdp_ssm_inputs_problem {
  int64_t T, B, nh, P, ng, N, M;
  double beta_scale;
  int64_t ld_xBC, ld_b, ld_a;    /* row strides of the inputs, in elements */
  int64_t ld_dxBC, ld_db, ld_da; /* row strides of the backward's outputs */
  int gate;                      /* 1: a and A_log given (g; da, dA_log) */
  int silu;                      /* 1: xBC is the pre-activation: the forward reads silu(xBC),
                                    the backward's dxBC is the gradient of xBC itself */
  int num_threads;               /* CPU worker threads */
  int dtype;                     /* gdp_dtype of the token buffers: the compute dtype */
} gdp_ssm_inputs_problem;

typedef struct gdp_ssm_inputs_fwd_io {
  const void *xBC, *b, *a, *A_log, *dt_bias; /* a, A_log NULL without gate; dt_bias may be */
  void *q, *k, *v, *beta, *g;                /* g NULL without gate */
} gdp_ssm_inputs_fwd_io;

typedef struct gdp_ssm_inputs_bwd_io {
  const void *xBC; /* with silu: the forward's xBC (rows ld_xBC apart); else NULL */
  const void *b, *a, *A_log, *dt_bias;
  const void *dq, *dk, *dv, *dbeta, *dg, *dx_v; /* dg NULL without gate; dx_v may be NULL */
  void *dxBC, *db, *da;                         /* written whole; da NULL without gate */
  void *dA_log, *ddt_bias;                      /* sums over tokens; may be NULL */
} gdp_ssm_inputs_bwd_io;

#endif /* GDP_KERNELS_MIXER_PROBLEM_H */
