/*
 * gdp_problem.h -- the GDP operator as the kernels see it: plain sizes and raw
 * pointers to contiguous row-major buffers, no tensor objects.  Shared by the CPU
 * and CUDA kernels, the core's op layer and the kernel lab drivers in dev/.
 *
 * Every problem is "packed": the token axis of all sequences is one axis of
 * T_total = B*T tokens (rows of q/g/o), T_total*n rows for k/v/beta, and sequence s
 * spans tokens [cu_seqlens[s], cu_seqlens[s+1]).  An unpacked batch [B,T,...] is the
 * packed problem with cu_seqlens = {0, T, 2T, ..., B*T}.
 *
 *   q [T_total, H, K]          g  [T_total, H]        (NULL: ungated)
 *   k [T_total*n, H, K]        beta [T_total*n, H]    row t*n+j: step j of token t
 *   v [T_total*n, H, V]        o  [T_total, H, V]
 *   h0, ht, dh0, dht [N, H, K, V]  (NULL: zeros in / not wanted out)
 *
 * L2 norm of q and k: when `l2norm_in_kernel` is 0, q and k arrive already
 * normalised (the op layer applies the norm and its backward, as it does for the
 * CPU kernels); a backend that fuses the norm (CUDA) gets raw q and k and 1.
 *
 * dtype: the dtype of q, k, v, g, beta, o and of their gradients.  CPU kernels take
 * GDP_DTYPE_F64 or GDP_DTYPE_F32; CUDA kernels GDP_DTYPE_F32 or GDP_DTYPE_BF16 (float32
 * accumulation).  gate_f32 (CUDA, dtype BF16 only): g and dg are float32 instead, as fla
 * and Megatron keep the gate.  States h0, ht, dh0, dht are float64 when dtype is F64,
 * else float32.
 */
#ifndef GDP_KERNELS_PROBLEM_H
#define GDP_KERNELS_PROBLEM_H

#include <stdint.h>

typedef struct gdp_delta_product_problem {
  int64_t T_total;           /* tokens over all sequences */
  int64_t N;                 /* sequences */
  const int64_t *cu_seqlens; /* host array, N+1 entries, 0 .. T_total */
  int64_t H, K, V;
  int64_t n;                 /* Householder steps per token */
  double scale;
  int64_t chunk_size;        /* steps of the expanded stream per chunk; 0: the backend's own
                              * (CPU: GDP_DEFAULT_CHUNK; CUDA: fixed by n on the fast path) */
  int num_threads;           /* CPU worker threads */
  int dtype;                 /* gdp_dtype of the token buffers (see above) */
  int algorithm;             /* gdp_delta_product_algorithm: AUTO, CHUNK or RECURRENT */
  int l2norm_in_kernel;      /* 1: q, k raw, the kernel normalises (eps 1e-6) */
  int value_block;           /* CUDA fast path's value-block width: 0 = its own choice, or 16,
                              * 32, 64 (a tuning knob: the context's or the call's, never bits) */
  int gate_f32;              /* 1: g and dg float32 beside BF16 token buffers (see above) */
} gdp_delta_product_problem;

/* Buffers of one dtype (the compute dtype: double or float), given as void*. */
typedef struct gdp_delta_product_forward_io {
  const void *q, *k, *v, *g, *beta, *h0; /* g, h0 may be NULL */
  void *o;
  void *ht;                              /* may be NULL */
} gdp_delta_product_forward_io;

typedef struct gdp_delta_product_backward_io {
  const void *q, *k, *v, *g, *beta, *h0; /* g, h0 may be NULL */
  const void *d_o;
  const void *dht;                       /* may be NULL (zeros) */
  void *dq, *dk, *dv, *dbeta;
  void *dg;                              /* NULL iff g is NULL */
  void *dh0;                             /* may be NULL (not wanted) */
} gdp_delta_product_backward_io;

#endif /* GDP_KERNELS_PROBLEM_H */
