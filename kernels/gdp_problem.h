/*
 * gdp_problem.h -- the GDP operator as the kernels see it: plain sizes and raw
 * pointers to contiguous row-major buffers, no tensor objects.  Shared by the CPU
 * and CUDA kernels, the core's op layer and the kernel lab drivers in kernels/bench.
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
 * q and k arrive already L2-normalised when the user asked for it (the op layer
 * applies the norm and its backward), so kernels never see use_qk_l2norm.
 */
#ifndef GDP_KERNELS_PROBLEM_H
#define GDP_KERNELS_PROBLEM_H

#include <stdint.h>

typedef struct gdp_gdp_problem {
  int64_t T_total;           /* tokens over all sequences */
  int64_t N;                 /* sequences */
  const int64_t *cu_seqlens; /* host array, N+1 entries, 0 .. T_total */
  int64_t H, K, V;
  int64_t n;                 /* Householder steps per token */
  double scale;
  int64_t chunk_size;        /* steps of the expanded stream per chunk */
  int num_threads;           /* CPU worker threads */
} gdp_gdp_problem;

/* Buffers of one dtype (the compute dtype: double or float), given as void*. */
typedef struct gdp_gdp_fwd_io {
  const void *q, *k, *v, *g, *beta, *h0; /* g, h0 may be NULL */
  void *o;
  void *ht;                              /* may be NULL */
} gdp_gdp_fwd_io;

typedef struct gdp_gdp_bwd_io {
  const void *q, *k, *v, *g, *beta, *h0; /* g, h0 may be NULL */
  const void *d_o;
  const void *dht;                       /* may be NULL (zeros) */
  void *dq, *dk, *dv, *dbeta;
  void *dg;                              /* NULL iff g is NULL */
  void *dh0;                             /* may be NULL (not wanted) */
} gdp_gdp_bwd_io;

#endif /* GDP_KERNELS_PROBLEM_H */
