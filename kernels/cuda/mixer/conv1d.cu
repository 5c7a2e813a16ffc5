/*
 * conv1d.cu -- depthwise causal conv1d over time with optional fused SiLU, packed
 * sequence restarts and a halo of preceding tokens (../../mixer_problem.h), and its
 * backward; the semantics of kernels/cpu/conv1d.c:
 *
 *   u[t,b,c] = bias[c] + sum_w wt[w,c] * x~[t-(W-1)+w, b, c],   out = act(u)
 *
 * Both directions: one thread owns a channel of one batch row over a chunk of CONV_TCH
 * tokens and slides over them with the last WMAX inputs (and, backward, the last WMAX
 * du = d_out * act'(u) and sequence starts) in registers, so that every element of x and
 * d_out is read once per chunk (plus WMAX-1 tokens of overlap), neighbouring threads
 * read neighbouring channels (coalesced), and no thread divides a 64-bit index.  Taps
 * are padded to WMAX with zero weights (wk[k] multiplies the input k tokens back), so
 * every register index is a constant.  Backward writes dx for the chunk (a gather over
 * the WMAX outputs that read each token) and keeps its dweight/dbias sums in registers,
 * written as one partial per (chunk, batch) and added up by conv_final in double in a
 * fixed order.  dhalo (a few rows) has its own small kernel.
 */
#include "common.cuh"

namespace gdp_mixer {
namespace {

enum { CONV_THREADS = 128, CONV_TCH = 128, CONV_WMAX = 16 };

struct ConvArgs {
  int64_t T, B, C, W, L;
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
  if (s >= st0) return ld(x, (s * a.B + b) * a.C + c);
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

/* Raw input at position pos as the first sequence reads it: x for pos >= 0, the halo
 * for -L <= pos < 0, else zero.  Whether the token being computed may read it is its
 * sequence's business (tap_ok). */
template <typename IO>
__device__ __forceinline__ typename Math<IO>::type raw_input(const ConvArgs &a, const IO *x,
                                                            const IO *halo, int64_t pos, int64_t b,
                                                            int64_t c) {
  typedef typename Math<IO>::type A;
  if (pos >= 0) return pos < a.T ? ld(x, (pos * a.B + b) * a.C + c) : (A)0;
  if (pos >= -a.L) return ld(halo, ((a.L + pos) * a.B + b) * a.C + c);
  return (A)0;
}

/* A token of the sequence starting at st0 reads position pos: within its sequence, or
 * anywhere before (the halo) when that sequence is the first (tap_value's rule). */
__device__ __forceinline__ bool tap_ok(int64_t pos, int64_t st0) { return pos >= st0 || st0 == 0; }

/* The channel's taps by age: wk[k] multiplies the input k tokens back (wt[W-1-k]); zero
 * for k >= W. */
template <typename IO, int WMAX>
__device__ __forceinline__ void taps_by_age(const ConvArgs &a, const IO *wt, int64_t c,
                                            typename Math<IO>::type (&wk)[WMAX]) {
  typedef typename Math<IO>::type A;
#pragma unroll
  for (int k = 0; k < WMAX; k++) wk[k] = k < a.W ? ld(wt, (a.W - 1 - k) * a.C + c) : (A)0;
}

/* grid (channel tiles, token chunks, B). */
template <typename IO, int WMAX>
__global__ void conv_fwd_kernel(ConvArgs a, const IO *x, const IO *wt, const IO *bias,
                                const IO *halo, IO *out) {
  typedef typename Math<IO>::type A;
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= a.C) return;
  const int64_t b = blockIdx.z;
  const int64_t t0 = (int64_t)blockIdx.y * CONV_TCH;
  const int64_t t1 = t0 + CONV_TCH < a.T ? t0 + CONV_TCH : a.T;
  A wk[WMAX], xs[WMAX]; /* xs[k]: the input at t - k */
  taps_by_age<IO, WMAX>(a, wt, c, wk);
  const A bs = bias ? ld(bias, c) : (A)0;
#pragma unroll
  for (int k = 0; k < WMAX; k++) xs[k] = (A)0;
  for (int64_t t = t0 - (WMAX - 1); t < t1; t++) {
#pragma unroll
    for (int k = WMAX - 1; k > 0; k--) xs[k] = xs[k - 1];
    xs[0] = raw_input(a, x, halo, t, b, c);
    if (t < t0) continue;
    const int64_t st0 = seq_start(a, t);
    A u = bs;
#pragma unroll
    for (int k = 0; k < WMAX; k++)
      if (tap_ok(t - k, st0)) u += wk[k] * xs[k];
    if (a.silu) u = u / ((A)1 + m_exp(-u));
    st(out, (t * a.B + b) * a.C + c, u);
  }
}

/* grid (channel tiles, token chunks, B).  partial [chunk*B + b][(W+1)*C]: columns w*C+c
 * hold dweight[c,w]'s partial sums, W*C+c dbias[c]'s (NULL: not wanted).  Step t
 * computes du(t) (t in [t0, t1 + WMAX - 1): the chunk's own tokens for the sums, and the
 * WMAX-1 after it for dx) and dx(s) for s = t - (WMAX-1) in the chunk. */
template <typename IO, int WMAX>
__global__ void conv_bwd_kernel(ConvArgs a, const IO *x, const IO *wt, const IO *bias,
                                const IO *halo, const IO *d_out, IO *dx, double *partial) {
  typedef typename Math<IO>::type A;
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= a.C) return;
  const int64_t b = blockIdx.z;
  const int64_t t0 = (int64_t)blockIdx.y * CONV_TCH;
  const int64_t t1 = t0 + CONV_TCH < a.T ? t0 + CONV_TCH : a.T;
  A wk[WMAX], xs[WMAX], ds[WMAX]; /* ds[k]: du(t - k) (0 outside [t0, T)) */
  int64_t sq[WMAX];               /* sq[k]: the sequence start of token t - k */
  taps_by_age<IO, WMAX>(a, wt, c, wk);
  const A bs = bias ? ld(bias, c) : (A)0;
  A accw[WMAX], accb = (A)0;
#pragma unroll
  for (int k = 0; k < WMAX; k++) xs[k] = ds[k] = accw[k] = (A)0, sq[k] = 0;
  const int64_t t_end = t1 + (WMAX - 1) < a.T ? t1 + (WMAX - 1) : a.T;
  for (int64_t t = t0 - (WMAX - 1); t < t1 + (WMAX - 1); t++) {
#pragma unroll
    for (int k = WMAX - 1; k > 0; k--) xs[k] = xs[k - 1], ds[k] = ds[k - 1], sq[k] = sq[k - 1];
    xs[0] = raw_input(a, x, halo, t, b, c);
    ds[0] = (A)0;
    sq[0] = 0;
    if (t >= t0 && t < t_end) {
      const int64_t st0 = seq_start(a, t);
      sq[0] = st0;
      A u = bs;
#pragma unroll
      for (int k = 0; k < WMAX; k++)
        if (tap_ok(t - k, st0)) u += wk[k] * xs[k];
      A du = ld(d_out, (t * a.B + b) * a.C + c);
      if (a.silu) {
        const A sg = sigmoid(u);
        du *= sg * ((A)1 + u * ((A)1 - sg));
      }
      ds[0] = du;
      if (partial && t < t1) {
        accb += du;
#pragma unroll
        for (int k = 0; k < WMAX; k++)
          if (tap_ok(t - k, st0)) accw[k] += du * xs[k];
      }
    }
    const int64_t s = t - (WMAX - 1);
    if (dx && s >= t0 && s < t1) {
      /* tokens s + j (age WMAX-1-j) of s's own sequence read s through wk[j] */
      A g = (A)0;
#pragma unroll
      for (int j = 0; j < WMAX; j++)
        if (sq[WMAX - 1 - j] <= s) g += wk[j] * ds[WMAX - 1 - j];
      st(dx, (s * a.B + b) * a.C + c, g);
    }
  }
  if (partial) {
    const int64_t cols = (a.W + 1) * a.C;
    double *p = partial + ((int64_t)blockIdx.y * a.B + b) * cols;
#pragma unroll
    for (int k = 0; k < WMAX; k++)
      if (k < a.W) p[(int64_t)(a.W - 1 - k) * a.C + c] = (double)accw[k];
    p[a.W * a.C + c] = (double)accb;
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

/* dweight [C,W] and dbias [C] from the partials of nslots (chunk, batch) slots. */
template <typename IO>
__global__ void conv_final_kernel(const double *partial, int64_t nslots, int64_t C, int64_t W,
                                  IO *dweight, IO *dbias) {
  typedef typename Math<IO>::type A;
  const int64_t cols = (W + 1) * C;
  GDP_MIXER_FOR(col, cols) {
    double s = 0.0;
    for (int64_t k = 0; k < nslots; k++) s += partial[k * cols + col];
    const int64_t w = col / C, c = col % C;
    if (w < W) {
      if (dweight) st(dweight, c * W + w, (A)s);
    } else if (dbias) {
      st(dbias, c, (A)s);
    }
  }
}

ConvArgs conv_args(const gdp_conv1d_problem *p, const int64_t *seq) {
  ConvArgs a;
  a.T = p->T, a.B = p->B, a.C = p->C, a.W = p->W, a.L = p->halo_len;
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
dim3 conv_grid(const ConvArgs &a) {
  return dim3((unsigned)((a.C + CONV_THREADS - 1) / CONV_THREADS), (unsigned)conv_nchunks(a.T),
              (unsigned)a.B);
}

template <typename IO>
gdp_status conv_fwd(const gdp_conv1d_problem *p, const int64_t *seq, const void *x,
                    const void *wt, const void *bias, const void *halo, void *out,
                    cudaStream_t stream) {
  static const char *func = "gdp_cuda_conv1d_fwd";
  const ConvArgs a = conv_args(p, seq);
  if (a.T * a.B * a.C == 0) return GDP_OK;
  GDP_TRY(conv_grid_check(func, a));
  const dim3 grid = conv_grid(a);
  const IO *xi = (const IO *)x, *wi = (const IO *)wt, *bi = (const IO *)bias, *hi = (const IO *)halo;
  if (a.W <= 4)
    conv_fwd_kernel<IO, 4><<<grid, CONV_THREADS, 0, stream>>>(a, xi, wi, bi, hi, (IO *)out);
  else
    conv_fwd_kernel<IO, CONV_WMAX><<<grid, CONV_THREADS, 0, stream>>>(a, xi, wi, bi, hi, (IO *)out);
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
  const int want_sums = dweight || dbias;
  double *partial = want_sums ? (double *)workspace : NULL;
  const int64_t nch = conv_nchunks(a.T);
  if ((dx || want_sums) && a.T * a.B * a.C > 0) {
    GDP_TRY(conv_grid_check(func, a));
    const dim3 grid = conv_grid(a);
    if (a.W <= 4)
      conv_bwd_kernel<IO, 4><<<grid, CONV_THREADS, 0, stream>>>(a, xi, wi, bi, hi, di, (IO *)dx,
                                                               partial);
    else
      conv_bwd_kernel<IO, CONV_WMAX><<<grid, CONV_THREADS, 0, stream>>>(a, xi, wi, bi, hi, di,
                                                                       (IO *)dx, partial);
    GDP_TRY(launched(func, "conv_bwd_kernel"));
  }
  if (want_sums && a.C > 0) {
    /* T*B == 0: no slots, the sums are zeros */
    const int64_t nslots = a.T * a.B > 0 ? nch * a.B : 0;
    conv_final_kernel<IO><<<grid_for((a.W + 1) * a.C), THREADS, 0, stream>>>(
        partial, nslots, a.C, a.W, (IO *)dweight, (IO *)dbias);
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
  const int64_t slots = conv_nchunks(p->T) * p->B;
  const int64_t cols = (p->W + 1) * p->C;
  return (size_t)(slots > 0 ? slots : 1) * (size_t)(cols > 0 ? cols : 1) * sizeof(double);
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
