/*
 * conv1d.cu -- depthwise causal conv1d over time with optional fused SiLU, packed
 * sequence restarts and a halo of preceding tokens (../../mixer_problem.h), and its
 * backward; the semantics of kernels/cpu/conv1d.c:
 *
 *   u[t,b,c] = bias[c] + sum_w wt[w,c] * x~[t-(W-1)+w, b, c],   out = act(u)
 *
 * Both directions: one thread owns VEC neighbouring channels of one batch row over a
 * chunk of CONV_TCH tokens and slides over them with the last WMAX inputs (and,
 * backward, the last WMAX du = d_out * act'(u) and sequence starts) in registers, so
 * that every element of x and d_out is read once per chunk (plus WMAX-1 tokens of
 * overlap) and no thread divides a 64-bit index.  At the mixer's shape the kernels
 * were waiting on memory (Nsight Compute on the H200: 12 warps per SM at 167
 * registers, 7 of every 10 cycles stalled on loads, 20% of DRAM bandwidth), so each
 * thread stages the loads of its next CONV_RING tokens in shared memory with cp.async
 * (stage), which keeps bytes in flight without registers for them: backward 0.61 ->
 * 0.25 ms, forward 0.15 -> 0.11 ms.  The rest is instruction count: a SEQ = false
 * instance (no cu_seqlens) tracks no sequence starts, tokens are stepped by pointer,
 * and the sigmoid is the fast one (common.cuh).  The VEC channels move as one pack of
 * CONV_PACK bytes when the channel count, the row strides and the buffers allow it (the
 * narrow conv, W <= 4, whose registers hold VEC lanes of every tap), else as single
 * elements.  x is read in place as rows x_ld apart (the in_proj output's channel
 * slice), dx written in place as rows dx_ld apart.  Taps are padded to WMAX with zero
 * weights (wk[k] multiplies the input k tokens back), so every register index is a
 * constant.  Backward writes dx for the chunk (a gather over the WMAX outputs that read
 * each token) and keeps its dweight/dbias sums in registers; a block's CONV_SUB warps
 * take consecutive chunks and add their sums in warp order through shared memory into
 * one partial row (math type) per (block chunk, batch), whose columns rows_colsum adds
 * in double in a fixed order.  dhalo (a few rows) has its own small kernel.
 */
#include "common.cuh"

namespace gdp_mixer {
namespace {

enum {
  CONV_THREADS = 128,
  CONV_TCH = 128,     /* tokens a thread slides over */
  CONV_WMAX = 16,
  CONV_RING = 16,     /* tokens (steps) whose loads are staged ahead in shared memory */
  CONV_SUB = 4,       /* backward: sub-chunks (warps) of a block, summed in shared memory */
  CONV_PACK = 8,      /* bytes of a channel pack (4 bf16, 2 f32): 16-byte packs doubled the
                         registers and were slower in both directions on the H200 (before
                         the staging; they would also double the rings' shared memory) */
  CONV_BWD_LANES = CONV_THREADS / CONV_SUB
};

struct ConvArgs {
  int64_t T, B, C, W, L;
  int64_t x_ld, dx_ld; /* x's and dx's row strides */
  const int64_t *seq; /* device [T] or NULL (all sequences start at 0) */
  int silu;
};

__device__ __forceinline__ int64_t seq_start(const ConvArgs &a, int64_t t) {
  return a.seq ? a.seq[t] : 0;
}

/* x~ at position s as token t reads it (t's own sequence, the halo before token 0 of the
 * first sequence, else zero). */
template <typename IO>
__device__ __forceinline__ typename Math<IO>::type tap_value(const ConvArgs &a, const IO *x,
                                                            const IO *halo, int64_t st0,
                                                            int64_t s, int64_t b, int64_t c) {
  typedef typename Math<IO>::type A;
  if (s >= st0) return ld(x, (s * a.B + b) * a.x_ld + c);
  if (st0 == 0 && s >= -a.L) return ld(halo, ((a.L + s) * a.B + b) * a.C + c);
  return (A)0;
}

/* Pre-activation u of (t, b, c). */
template <typename IO>
__device__ __forceinline__ typename Math<IO>::type conv_u(const ConvArgs &a, const IO *x,
                                                         const IO *wt, const IO *bias,
                                                         const IO *halo, int64_t t, int64_t b,
                                                         int64_t c) {
  typedef typename Math<IO>::type A;
  A u = bias ? ld(bias, c) : (A)0;
  const int64_t st0 = seq_start(a, t);
  for (int64_t w = 0; w < a.W; w++) {
    const int64_t s = t - (a.W - 1) + w;
    u += ld(wt, w * a.C + c) * tap_value(a, x, halo, st0, s, b, c);
  }
  return u;
}

/* du = d_out * act'(u) at (t, b, c). */
template <typename IO>
__device__ __forceinline__ typename Math<IO>::type conv_du(const ConvArgs &a, const IO *x,
                                                          const IO *wt, const IO *bias,
                                                          const IO *halo, const IO *d_out,
                                                          int64_t t, int64_t b, int64_t c) {
  typedef typename Math<IO>::type A;
  const A dy = ld(d_out, (t * a.B + b) * a.C + c);
  if (!a.silu) return dy;
  const A u = conv_u(a, x, wt, bias, halo, t, b, c);
  const A s = sigmoid(u);
  return dy * s * ((A)1 + u * ((A)1 - s));
}

/* Raw inputs at position pos as the first sequence reads them, channels c..c+VEC: x
 * for pos >= 0, the halo for -L <= pos < 0, else zero.  Whether the token being
 * computed may read them is its sequence's business (tap_ok). */
template <typename IO, int VEC>
__device__ __forceinline__ void raw_input(const ConvArgs &a, const IO *__restrict__ x,
                                          const IO *__restrict__ halo, int64_t pos, int64_t b,
                                          int64_t c, typename Math<IO>::type (&v)[VEC]) {
  typedef typename Math<IO>::type A;
  if (pos >= 0 && pos < a.T) {
    ld_lanes<IO, VEC>(x + (pos * a.B + b) * a.x_ld + c, v);
  } else if (pos < 0 && pos >= -a.L) {
    ld_lanes<IO, VEC>(halo + ((a.L + pos) * a.B + b) * a.C + c, v);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; i++) v[i] = (A)0;
  }
}

/* A token of the sequence starting at st0 reads position pos: within its sequence, or
 * anywhere before (the halo) when that sequence is the first (tap_value's rule). */
__device__ __forceinline__ bool tap_ok(int64_t pos, int64_t st0) { return pos >= st0 || st0 == 0; }

/* The taps of channels c..c+VEC by age: wk[k][i] multiplies the input k tokens back
 * (wt[W-1-k]); zero for k >= W.  Also the bias (zero without). */
template <typename IO, int WMAX, int VEC>
__device__ __forceinline__ void taps_by_age(const ConvArgs &a, const IO *wt, const IO *bias,
                                            int64_t c, typename Math<IO>::type (&wk)[WMAX][VEC],
                                            typename Math<IO>::type (&bs)[VEC]) {
  typedef typename Math<IO>::type A;
#pragma unroll
  for (int k = 0; k < WMAX; k++) {
    if (k < a.W) {
      ld_lanes<IO, VEC>(wt + (a.W - 1 - k) * a.C + c, wk[k]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; i++) wk[k][i] = (A)0;
    }
  }
  if (bias) {
    ld_lanes<IO, VEC>(bias + c, bs);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; i++) bs[i] = (A)0;
  }
}

/* Shifts the registers one token older: r[k] = r[k-1]. */
template <typename A, int WMAX, int VEC>
__device__ __forceinline__ void age(A (&r)[WMAX][VEC]) {
#pragma unroll
  for (int k = WMAX - 1; k > 0; k--)
#pragma unroll
    for (int i = 0; i < VEC; i++) r[k][i] = r[k - 1][i];
}

/* u of token t (sequence start st0) from the inputs by age.  SEQ false: one sequence
 * (no restarts), every tap counts. */
template <typename A, int WMAX, int VEC, bool SEQ>
__device__ __forceinline__ void pre_activation(int64_t t, int64_t st0, const A (&wk)[WMAX][VEC],
                                               const A (&xs)[WMAX][VEC], const A (&bs)[VEC],
                                               A (&u)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; i++) u[i] = bs[i];
#pragma unroll
  for (int k = 0; k < WMAX; k++)
    if (!SEQ || tap_ok(t - k, st0))
#pragma unroll
      for (int i = 0; i < VEC; i++) u[i] += wk[k][i] * xs[k][i];
}

/* grid (channel tiles of CONV_THREADS * VEC, token chunks, B).  x of the next RING
 * tokens is staged in shared memory (stage, common.cuh) while the current one is computed,
 * so that a warp keeps bytes in flight without registers for them; tokens are stepped
 * by pointer. */
template <typename IO, int WMAX, int VEC, bool SEQ, int RING, int MINB>
__global__ void __launch_bounds__(CONV_THREADS, MINB)
    conv_fwd_kernel(ConvArgs a, const IO *__restrict__ x, const IO *__restrict__ wt,
                    const IO *__restrict__ bias, const IO *__restrict__ halo,
                    IO *__restrict__ out) {
  typedef typename Math<IO>::type A;
  __shared__ Pack<IO, VEC> ring[RING][CONV_THREADS];
  const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (c >= a.C) return; /* no barriers below */
  const int64_t b = blockIdx.z;
  const int64_t t0 = (int64_t)blockIdx.y * CONV_TCH;
  const int n = (int)((t0 + CONV_TCH < a.T ? t0 + CONV_TCH : a.T) - t0); /* tokens here */
  A wk[WMAX][VEC], xs[WMAX][VEC], bs[VEC]; /* xs[k]: the inputs at t - k */
  taps_by_age<IO, WMAX, VEC>(a, wt, bias, c, wk, bs);
#pragma unroll
  for (int k = 0; k < WMAX; k++)
#pragma unroll
    for (int i = 0; i < VEC; i++) xs[k][i] = (A)0;
  const int64_t xrow = a.B * a.x_ld, orow = a.B * a.C;
  const IO *xp = x + (t0 * a.B + b) * a.x_ld + c; /* the next staged token's x */
  IO *op = out + (t0 * a.B + b) * a.C + c;
  auto stage_step = [&](int j) { /* token t0 + j into slot j % RING, a commit group each */
    if (j < n) stage<IO, VEC>(&ring[j % RING][threadIdx.x], xp, true);
    stage_commit();
    xp += xrow;
  };
#pragma unroll
  for (int j = 0; j < RING; j++) stage_step(j);
  for (int64_t t = t0 - (WMAX - 1); t < t0; t++) {
    age<A, WMAX, VEC>(xs);
    raw_input<IO, VEC>(a, x, halo, t, b, c, xs[0]);
  }
  for (int j0 = 0; j0 < n; j0 += WMAX) {
#pragma unroll
    for (int jj = 0; jj < WMAX; jj++) {
      const int j = j0 + jj;
      if (j >= n) break;
      stage_wait<RING - 1>();
      const Pack<IO, VEC> cx = ring[j % RING][threadIdx.x];
      age<A, WMAX, VEC>(xs);
#pragma unroll
      for (int i = 0; i < VEC; i++) xs[0][i] = ld(cx.e, i);
      stage_step(j + RING); /* the slot's value is in xs[0] */
      A u[VEC];
      pre_activation<A, WMAX, VEC, SEQ>(t0 + j, SEQ ? seq_start(a, t0 + j) : 0, wk, xs, bs, u);
      if (a.silu)
#pragma unroll
        for (int i = 0; i < VEC; i++) u[i] *= sigmoid(u[i]);
      st_lanes<IO, VEC>(op, u);
      op += orow;
    }
  }
  stage_wait<0>();
}

/* grid (channel tiles of CONV_BWD_LANES * VEC, token chunks of CONV_SUB * CONV_TCH, B);
 * warp `sub` of a block takes the chunk's sub-chunk `sub` of CONV_TCH tokens, lane l
 * channels c..c+VEC.  partial [chunk*B + b][(W+1)*C] (the math type): columns w*C+c
 * hold dweight[c,w]'s partial sums, W*C+c dbias[c]'s, the block's sub-chunks added in
 * order through shared memory (NULL: not wanted).  Step t computes du(t) (t in
 * [t0, t1 + WMAX - 1): the sub-chunk's own tokens for the sums, and the WMAX-1 after
 * it for dx) and dx(s) for s = t - (WMAX-1) in the sub-chunk; x and d_out of the next
 * RING steps are staged in shared memory (stage, common.cuh).  SEQ false: one sequence, so no
 * sequence starts are tracked. */
template <typename IO, int WMAX, int VEC, bool SEQ, int RING, int MINB>
__global__ void __launch_bounds__(CONV_THREADS, MINB)
    conv_bwd_kernel(ConvArgs a, const IO *__restrict__ x, const IO *__restrict__ wt,
                    const IO *__restrict__ bias, const IO *__restrict__ halo,
                    const IO *__restrict__ d_out, IO *__restrict__ dx,
                    typename Math<IO>::type *__restrict__ partial) {
  typedef typename Math<IO>::type A;
  __shared__ A sums[CONV_SUB][WMAX + 1][VEC][CONV_BWD_LANES];
  __shared__ Pack<IO, VEC> ring_x[RING][CONV_THREADS], ring_g[RING][CONV_THREADS];
  const int lane = threadIdx.x % CONV_BWD_LANES, sub = threadIdx.x / CONV_BWD_LANES;
  const int64_t c = ((int64_t)blockIdx.x * CONV_BWD_LANES + lane) * VEC;
  const bool live = c < a.C; /* no early exit: the block meets at the barrier */
  const int64_t b = blockIdx.z;
  const int64_t t0 = ((int64_t)blockIdx.y * CONV_SUB + sub) * CONV_TCH;
  const int64_t t1 = t0 + CONV_TCH < a.T ? t0 + CONV_TCH : a.T;
  A wk[WMAX][VEC], xs[WMAX][VEC], ds[WMAX][VEC], bs[VEC]; /* ds[k]: du(t - k) (0 outside [t0, T)) */
  int64_t sq[SEQ ? WMAX : 1];                             /* sq[k]: the sequence start of token t - k */
  A accw[WMAX][VEC], accb[VEC];
#pragma unroll
  for (int k = 0; k < WMAX; k++) {
    if (SEQ) sq[k] = 0;
#pragma unroll
    for (int i = 0; i < VEC; i++) xs[k][i] = ds[k][i] = accw[k][i] = (A)0;
  }
#pragma unroll
  for (int i = 0; i < VEC; i++) accb[i] = (A)0;
  if (live && t0 < a.T) {
    taps_by_age<IO, WMAX, VEC>(a, wt, bias, c, wk, bs);
    /* steps i = t - tb over [0, n): du for i in [W-1, nd), dx for s = t - (W-1) in [0, ns) */
    const int64_t tb = t0 - (WMAX - 1);
    const int ns = (int)(t1 - t0), n = ns + 2 * (WMAX - 1);
    const int nd = (int)((t1 + (WMAX - 1) < a.T ? t1 + (WMAX - 1) : a.T) - tb);
    const int64_t xrow = a.B * a.x_ld, grow = a.B * a.C, dxrow = a.B * a.dx_ld;
    const IO *xp = x + (tb * a.B + b) * a.x_ld + c;   /* the next staged step's x (may lie outside) */
    const IO *gp = d_out + (tb * a.B + b) * a.C + c; /* and its d_out */
    IO *dxp = dx ? dx + (t0 * a.B + b) * a.dx_ld + c : NULL; /* the next dx */
    /* stages x and d_out of step i into slot i % RING; one commit group per step
     * (empty past the end), so that waiting for RING - 1 pending groups means step
     * i - RING + 1 has landed */
    auto stage_step = [&](int i) {
      Pack<IO, VEC> *sx = &ring_x[i % RING][threadIdx.x], *sg = &ring_g[i % RING][threadIdx.x];
      if (i < n) {
        const int64_t t = tb + i;
        if (t >= 0 && t < a.T) stage<IO, VEC>(sx, xp, true);
        else if (t < 0 && t >= -a.L) stage<IO, VEC>(sx, halo + ((a.L + t) * a.B + b) * a.C + c, true);
        else stage<IO, VEC>(sx, x, false);
        stage<IO, VEC>(sg, i >= WMAX - 1 && i < nd ? gp : d_out, i >= WMAX - 1 && i < nd);
      }
      stage_commit();
      xp += xrow, gp += grow;
    };
#pragma unroll
    for (int i = 0; i < RING; i++) stage_step(i);
    for (int i0 = 0; i0 < n; i0 += WMAX) {
#pragma unroll
      for (int j = 0; j < WMAX; j++) {
        const int i = i0 + j;
        if (i >= n) break;
        const int64_t t = tb + i;
        stage_wait<RING - 1>();
        const Pack<IO, VEC> cx = ring_x[i % RING][threadIdx.x];
        const Pack<IO, VEC> cg = ring_g[i % RING][threadIdx.x];
        age<A, WMAX, VEC>(xs);
        age<A, WMAX, VEC>(ds);
        if (SEQ) {
#pragma unroll
          for (int k = WMAX - 1; k > 0; k--) sq[k] = sq[k - 1];
          sq[0] = 0;
        }
#pragma unroll
        for (int q = 0; q < VEC; q++) xs[0][q] = ld(cx.e, q), ds[0][q] = (A)0;
        if (i >= WMAX - 1 && i < nd) {
          const int64_t st0 = SEQ ? seq_start(a, t) : 0;
          if (SEQ) sq[0] = st0;
          A u[VEC], du[VEC];
          pre_activation<A, WMAX, VEC, SEQ>(t, st0, wk, xs, bs, u);
#pragma unroll
          for (int q = 0; q < VEC; q++) du[q] = ld(cg.e, q);
          if (a.silu)
#pragma unroll
            for (int q = 0; q < VEC; q++) {
              const A sg = sigmoid(u[q]);
              du[q] *= sg * ((A)1 + u[q] * ((A)1 - sg));
            }
#pragma unroll
          for (int q = 0; q < VEC; q++) ds[0][q] = du[q];
          if (partial && i < WMAX - 1 + ns) {
#pragma unroll
            for (int q = 0; q < VEC; q++) accb[q] += du[q];
#pragma unroll
            for (int k = 0; k < WMAX; k++)
              if (!SEQ || tap_ok(t - k, st0))
#pragma unroll
                for (int q = 0; q < VEC; q++) accw[k][q] += du[q] * xs[k][q];
          }
        }
        /* the slot's values are in registers and used: restage it */
        stage_step(i + RING);
        if (dxp && i >= 2 * (WMAX - 1)) {
          /* tokens s + j (age WMAX-1-j) of s's own sequence read s through wk[j] */
          const int64_t s = t - (WMAX - 1);
          A g[VEC];
#pragma unroll
          for (int q = 0; q < VEC; q++) g[q] = (A)0;
#pragma unroll
          for (int jj = 0; jj < WMAX; jj++)
            if (!SEQ || sq[SEQ ? WMAX - 1 - jj : 0] <= s)
#pragma unroll
              for (int q = 0; q < VEC; q++) g[q] += wk[jj][q] * ds[WMAX - 1 - jj][q];
          st_lanes<IO, VEC>(dxp, g);
          dxp += dxrow;
        }
      }
    }
    stage_wait<0>(); /* nothing staged is left in flight at exit */
  }
  if (!partial) return; /* uniform */
#pragma unroll
  for (int k = 0; k < WMAX; k++)
#pragma unroll
    for (int i = 0; i < VEC; i++) sums[sub][k][i][lane] = accw[k][i];
#pragma unroll
  for (int i = 0; i < VEC; i++) sums[sub][WMAX][i][lane] = accb[i];
  __syncthreads();
  if (sub != 0 || !live) return;
  const int64_t cols = (a.W + 1) * a.C;
  A *p = partial + ((int64_t)blockIdx.y * a.B + b) * cols;
#pragma unroll
  for (int k = 0; k <= WMAX; k++) {
    if (k < WMAX && k >= a.W) continue;
    /* accw[k] is tap W-1-k's; accb goes after the W taps */
    const int64_t col0 = (k < WMAX ? (int64_t)(a.W - 1 - k) : a.W) * a.C + c;
#pragma unroll
    for (int i = 0; i < VEC; i++) {
      if (c + i >= a.C) break;
      A v = (A)0;
      for (int q = 0; q < CONV_SUB; q++) v += sums[q][k][i][lane];
      p[col0 + i] = v;
    }
  }
}

/* dhalo[j,b,c], j < L: halo row j is position s = j - L, read by the first tokens when
 * they belong to the sequence starting at token 0. */
template <typename IO>
__global__ void conv_dhalo_kernel(ConvArgs a, const IO *x, const IO *wt, const IO *bias,
                                  const IO *halo, const IO *d_out, IO *dhalo) {
  typedef typename Math<IO>::type A;
  const int64_t n = a.L * a.B * a.C;
  GDP_MIXER_FOR(i, n) {
    const int64_t c = i % a.C, row = i / a.C;
    const int64_t j = row / a.B, b = row % a.B;
    const int64_t s = j - a.L;
    A g = (A)0;
    for (int64_t w = 0; w < a.W; w++) {
      const int64_t t = s + (a.W - 1) - w;
      if (t < 0 || t >= a.T || seq_start(a, t) != 0) continue;
      g += ld(wt, w * a.C + c) * conv_du(a, x, wt, bias, halo, d_out, t, b, c);
    }
    st(dhalo, i, g);
  }
}

/* dweight [C,W] and dbias [C] from the column totals of the (chunk, batch) partial rows. */
template <typename IO>
__global__ void conv_final_kernel(const double *tot, int64_t C, int64_t W, IO *dweight,
                                  IO *dbias) {
  typedef typename Math<IO>::type A;
  const int64_t cols = (W + 1) * C;
  GDP_MIXER_FOR(col, cols) {
    const int64_t w = col / C, c = col % C;
    if (w < W) {
      if (dweight) st(dweight, c * W + w, (A)tot[col]);
    } else if (dbias) {
      st(dbias, c, (A)tot[col]);
    }
  }
}

ConvArgs conv_args(const gdp_conv1d_problem *p, const int64_t *seq) {
  ConvArgs a;
  a.T = p->T, a.B = p->B, a.C = p->C, a.W = p->W, a.L = p->halo_len, a.x_ld = p->x_ld, a.dx_ld = p->dx_ld;
  a.seq = seq;
  a.silu = p->silu;
  return a;
}

int64_t conv_nchunks(int64_t T) { return (T + CONV_TCH - 1) / CONV_TCH; }

/* (channel tiles, token chunks, B), as both directions' kernels take it. */
gdp_status conv_grid_check(const char *func, const ConvArgs &a) {
  if (conv_nchunks(a.T) > 65535 || a.B > 65535)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                        "conv1d on cuda takes T <= %d and B <= 65535, got T = %lld, B = %lld",
                        65535 * CONV_TCH, (long long)a.T, (long long)a.B);
  return GDP_OK;
}
dim3 conv_grid(const ConvArgs &a, int vec) {
  const int64_t per_block = (int64_t)CONV_THREADS * vec;
  return dim3((unsigned)((a.C + per_block - 1) / per_block), (unsigned)conv_nchunks(a.T),
              (unsigned)a.B);
}

/* The backward's chunks of CONV_SUB sub-chunks: one partial row per (chunk, batch). */
int64_t conv_bwd_nchunks(int64_t T) {
  return (T + (int64_t)CONV_SUB * CONV_TCH - 1) / ((int64_t)CONV_SUB * CONV_TCH);
}
dim3 conv_bwd_grid(const ConvArgs &a, int vec) {
  const int64_t per_block = (int64_t)CONV_BWD_LANES * vec;
  return dim3((unsigned)((a.C + per_block - 1) / per_block), (unsigned)conv_bwd_nchunks(a.T),
              (unsigned)a.B);
}

/* The backward workspace: the partial rows [chunks*B][(W+1)*C] (sized in double, held in
 * the math type), then their column totals [(W+1)*C] in double. */
int64_t conv_partial_doubles(int64_t T, int64_t B, int64_t cols) {
  const int64_t slots = conv_bwd_nchunks(T) * B;
  return (slots > 0 ? slots : 1) * (cols > 0 ? cols : 1);
}

/* The narrow conv's packs of `bytes` fit: the channel count and the row strides of x and
 * dx are multiples of the pack, every buffer aligned to it. */
template <typename IO>
int conv_packs_fit(const ConvArgs &a, const void *const *ptrs, int n, int bytes) {
  const int64_t vec = bytes / (int64_t)sizeof(IO);
  if (a.W > 4 || vec < 1 || a.C % vec || a.x_ld % vec || a.dx_ld % vec) return 0;
  for (int i = 0; i < n; i++)
    if (ptrs[i] && (uintptr_t)ptrs[i] % (uintptr_t)bytes) return 0;
  return 1;
}

template <typename IO>
gdp_status conv_fwd(const gdp_conv1d_problem *p, const int64_t *seq, const void *x,
                    const void *wt, const void *bias, const void *halo, void *out,
                    cudaStream_t stream) {
  static const char *func = "gdp_cuda_conv1d_fwd";
  const ConvArgs a = conv_args(p, seq);
  if (a.T * a.B * a.C == 0) return GDP_OK;
  GDP_TRY(conv_grid_check(func, a));
  const IO *xi = (const IO *)x, *wi = (const IO *)wt, *bi = (const IO *)bias, *hi = (const IO *)halo;
  IO *o = (IO *)out;
  const void *ptrs[5] = {x, wt, bias, halo, out};
  typedef void (*Kernel)(ConvArgs, const IO *, const IO *, const IO *, const IO *, IO *);
  const bool seqs = a.seq != NULL;
  Kernel k;
  int vec = 1;
  enum { V = CONV_PACK / sizeof(IO) > 0 ? CONV_PACK / sizeof(IO) : 1 };
#define CONV_FWD_K(WM, VV, MB)                                    \
  (seqs ? conv_fwd_kernel<IO, WM, VV, true, CONV_RING, MB>        \
        : conv_fwd_kernel<IO, WM, VV, false, CONV_RING, MB>)
  if (conv_packs_fit<IO>(a, ptrs, 5, (int)(V * sizeof(IO))))
    k = CONV_FWD_K(4, V, 3), vec = V;
  else if (a.W <= 4)
    k = CONV_FWD_K(4, 1, 1);
  else
    k = CONV_FWD_K(CONV_WMAX, 1, 1);
#undef CONV_FWD_K
  k<<<conv_grid(a, vec), CONV_THREADS, 0, stream>>>(a, xi, wi, bi, hi, o);
  return launched(func, "conv_fwd_kernel");
}

template <typename IO>
gdp_status conv_bwd(const gdp_conv1d_problem *p, const int64_t *seq, const void *x,
                    const void *wt, const void *bias, const void *halo, const void *d_out,
                    void *dx, void *dweight, void *dbias, void *dhalo, void *workspace,
                    cudaStream_t stream) {
  static const char *func = "gdp_cuda_conv1d_bwd";
  const ConvArgs a = conv_args(p, seq);
  const IO *xi = (const IO *)x, *wi = (const IO *)wt, *bi = (const IO *)bias;
  const IO *hi = (const IO *)halo, *di = (const IO *)d_out;
  typedef typename Math<IO>::type A;
  const int want_sums = dweight || dbias;
  A *partial = want_sums ? (A *)workspace : NULL;
  const int64_t cols = (a.W + 1) * a.C;
  if ((dx || want_sums) && a.T * a.B * a.C > 0) {
    GDP_TRY(conv_grid_check(func, a));
    IO *dxo = (IO *)dx;
    const void *ptrs[6] = {x, wt, bias, halo, d_out, dx};
    typedef void (*Kernel)(ConvArgs, const IO *, const IO *, const IO *, const IO *, const IO *,
                           IO *, A *);
    const bool seqs = a.seq != NULL;
    Kernel k;
    int vec = 1;
    enum { V = CONV_PACK / sizeof(IO) > 0 ? CONV_PACK / sizeof(IO) : 1 };
#define CONV_BWD_K(WM, VV, RG, MB)                                \
  (seqs ? conv_bwd_kernel<IO, WM, VV, true, RG, MB>               \
        : conv_bwd_kernel<IO, WM, VV, false, RG, MB>)
    if (conv_packs_fit<IO>(a, ptrs, 6, (int)(V * sizeof(IO))))
      k = CONV_BWD_K(4, V, CONV_RING, 3), vec = V;
    else if (a.W <= 4)
      k = CONV_BWD_K(4, 1, CONV_RING, 3);
    else /* the wide taps' sums take shared memory: a shorter ring */
      k = CONV_BWD_K(CONV_WMAX, 1, CONV_RING / 2, 1);
#undef CONV_BWD_K
    k<<<conv_bwd_grid(a, vec), CONV_THREADS, 0, stream>>>(a, xi, wi, bi, hi, di, dxo, partial);
    GDP_TRY(launched(func, "conv_bwd_kernel"));
  }
  if (want_sums && a.C > 0) {
    /* T*B == 0: no rows, the sums are zeros */
    const int64_t nslots = a.T * a.B > 0 ? conv_bwd_nchunks(a.T) * a.B : 0;
    double *tot = (double *)workspace + conv_partial_doubles(a.T, a.B, cols);
    GDP_TRY(rows_colsum(func, "conv rows_colsum_kernel", (const A *)partial, nslots, cols, cols, 1,
                        0, tot, stream));
    conv_final_kernel<IO><<<grid_for(cols), THREADS, 0, stream>>>(tot, a.C, a.W, (IO *)dweight,
                                                                  (IO *)dbias);
    GDP_TRY(launched(func, "conv_final_kernel"));
  }
  if (dhalo && a.L * a.B * a.C > 0) {
    conv_dhalo_kernel<IO><<<grid_for(a.L * a.B * a.C), THREADS, 0, stream>>>(a, xi, wi, bi, hi,
                                                                             di, (IO *)dhalo);
    GDP_TRY(launched(func, "conv_dhalo_kernel"));
  }
  return GDP_OK;
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

static gdp_status conv_check(const char *func, const gdp_conv1d_problem *p) {
  if (p->W < 1 || p->W > CONV_WMAX)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "conv width W: the cuda kernels take 1..%d, got %lld",
                        (int)CONV_WMAX, (long long)p->W);
  return GDP_OK;
}

extern "C" gdp_status gdp_cuda_conv1d_fwd(const gdp_conv1d_problem *p,
                                          const int64_t *seq_start_dev, const void *x,
                                          const void *wt, const void *bias, const void *halo,
                                          void *out, void *stream) {
  static const char *func = "gdp_cuda_conv1d_fwd";
  GDP_TRY(conv_check(func, p));
  GDP_MIXER_DISPATCH(func, p->dtype,
                     return conv_fwd<IO>(p, seq_start_dev, x, wt, bias, halo, out,
                                         (cudaStream_t)stream));
  return GDP_OK;
}

extern "C" size_t gdp_cuda_conv1d_bwd_workspace(const gdp_conv1d_problem *p) {
  const int64_t cols = (p->W + 1) * p->C;
  return (size_t)(conv_partial_doubles(p->T, p->B, cols) + (cols > 0 ? cols : 1)) *
         sizeof(double);
}

extern "C" gdp_status gdp_cuda_conv1d_bwd(const gdp_conv1d_problem *p,
                                          const int64_t *seq_start_dev, const void *x,
                                          const void *wt, const void *bias, const void *halo,
                                          const void *d_out, void *dx, void *dweight,
                                          void *dbias, void *dhalo, void *workspace,
                                          void *stream) {
  static const char *func = "gdp_cuda_conv1d_bwd";
  GDP_TRY(conv_check(func, p));
  GDP_MIXER_DISPATCH(func, p->dtype,
                     return conv_bwd<IO>(p, seq_start_dev, x, wt, bias, halo, d_out, dx, dweight,
                                         dbias, dhalo, workspace, (cudaStream_t)stream));
  return GDP_OK;
}
