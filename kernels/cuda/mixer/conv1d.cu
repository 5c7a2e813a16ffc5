/*
 * conv1d.cu -- depthwise causal conv1d over time with optional fused SiLU, packed
 * sequence restarts and a halo of preceding tokens (../../mixer_problem.h), and its
 * backward; the semantics of kernels/cpu/conv1d.c:
 *
 *   u[t,b,c] = bias[c] + sum_w wt[w,c] * x~[t-(W-1)+w, b, c],   out = act(u)
 *
 * Forward: one thread per output element, W taps (neighbouring threads read
 * neighbouring channels, so loads coalesce; the taps' rows are shared through L1/L2).
 * Backward: du = d_out * act'(u) is recomputed where it is needed (W multiply-adds and
 * an exp, cheaper than a [T,B,C] float buffer).  One thread owns a channel of one batch
 * row over a chunk of CONV_TCH tokens: it writes dx for those tokens (a gather over the
 * W outputs that read each token) and keeps the chunk's dweight/dbias sums in registers,
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

template <typename IO>
__global__ void conv_fwd_kernel(ConvArgs a, const IO *x, const IO *wt, const IO *bias,
                                const IO *halo, IO *out) {
  typedef typename Math<IO>::type A;
  const int64_t n = a.T * a.B * a.C;
  GDP_MIXER_FOR(i, n) {
    const int64_t c = i % a.C, row = i / a.C;
    A u = conv_u(a, x, wt, bias, halo, row / a.B, row % a.B, c);
    if (a.silu) u = u / ((A)1 + m_exp(-u));
    st(out, i, u);
  }
}

/* grid (channel tiles, token chunks, B).  partial [chunk*B + b][(W+1)*C]: columns w*C+c
 * hold dweight[c,w]'s partial sums, W*C+c dbias[c]'s (NULL: not wanted). */
template <typename IO, int WMAX>
__global__ void conv_bwd_kernel(ConvArgs a, const IO *x, const IO *wt, const IO *bias,
                                const IO *halo, const IO *d_out, IO *dx, double *partial) {
  typedef typename Math<IO>::type A;
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= a.C) return;
  const int64_t b = blockIdx.z;
  const int64_t t0 = (int64_t)blockIdx.y * CONV_TCH;
  const int64_t t1 = t0 + CONV_TCH < a.T ? t0 + CONV_TCH : a.T;
  const int W = (int)a.W;
  A accw[WMAX];
#pragma unroll
  for (int w = 0; w < WMAX; w++) accw[w] = (A)0;
  A accb = (A)0;
  for (int64_t s = t0; s < t1; s++) {
    if (partial) {
      const A du = conv_du(a, x, wt, bias, halo, d_out, s, b, c);
      accb += du;
      const int64_t st0 = seq_start(a, s);
#pragma unroll
      for (int w = 0; w < WMAX; w++)
        if (w < W) accw[w] += du * tap_value(a, x, halo, st0, s - (W - 1) + w, b, c);
    }
    if (dx) {
      A g = (A)0;
      for (int w = 0; w < W; w++) {
        const int64_t t = s + (W - 1) - w;
        if (t >= a.T || seq_start(a, t) > s) continue;
        g += ld(wt, (int64_t)w * a.C + c) * conv_du(a, x, wt, bias, halo, d_out, t, b, c);
      }
      st(dx, (s * a.B + b) * a.C + c, g);
    }
  }
  if (partial) {
    const int64_t cols = (a.W + 1) * a.C;
    double *p = partial + ((int64_t)blockIdx.y * a.B + b) * cols;
#pragma unroll
    for (int w = 0; w < WMAX; w++)
      if (w < W) p[(int64_t)w * a.C + c] = (double)accw[w];
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

template <typename IO>
gdp_status conv_fwd(const gdp_conv1d_problem *p, const int64_t *seq, const void *x,
                    const void *wt, const void *bias, const void *halo, void *out,
                    cudaStream_t stream) {
  const ConvArgs a = conv_args(p, seq);
  const int64_t n = a.T * a.B * a.C;
  if (n == 0) return GDP_OK;
  conv_fwd_kernel<IO><<<grid_for(n), THREADS, 0, stream>>>(a, (const IO *)x, (const IO *)wt,
                                                           (const IO *)bias, (const IO *)halo,
                                                           (IO *)out);
  return launched("gdp_cuda_conv1d_fwd", "conv_fwd_kernel");
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
    if (nch > 65535 || a.B > 65535)
      return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                          "conv1d backward on cuda takes T <= %d and B <= 65535, got T = %lld, B = %lld",
                          65535 * CONV_TCH, (long long)a.T, (long long)a.B);
    dim3 grid((unsigned)((a.C + CONV_THREADS - 1) / CONV_THREADS), (unsigned)nch, (unsigned)a.B);
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
