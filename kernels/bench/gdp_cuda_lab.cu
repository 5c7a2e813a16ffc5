/*
 * gdp_cuda_lab.cu -- kernel lab for the GDP operator on CUDA (llm.c dev/cuda style).
 *
 *   gdp_cuda_lab selftest            CPU only: the float64 mirror of the chunkwise
 *                                    algorithm (the exact sequence of matrix steps the
 *                                    CUDA chunk kernels run) against the oracle
 *   gdp_cuda_lab check [variant...]  random problems (packed, empty sequences, n = 1..3,
 *                                    gated or not, odd K/V, h0/ht, f32 and bf16) through
 *                                    the CUDA entry points, errors vs the float64 oracle
 *   gdp_cuda_lab bench B T n [variant...] [--reps R] [--json FILE]
 *                                    bf16 timings (CUDA events, median) at B x T, H = 16,
 *                                    K = V = 128, gated, l2norm; plus a check of the chunk
 *                                    path against the recurrent one at that size
 *
 * Variants: 1 = recurrent (one block per sequence, head and 32 value columns),
 *           2 = chunkwise WY on tensor cores (bf16 only; f32 falls back to 1),
 *           3 = chunkwise on mma.sync with the states in registers: forward gdp_fwd_v3.cu,
 *               backward gdp_bwd_v3.cu (GDP_CUDA_V3_GRAD=v2: with variant 2's per-chunk
 *               gradient kernel, named chunk_v3_gradv2); bf16, K, V = 64/128, n <= 3,
 *           4 = variant 2's prep + variant 3's forward state pass, variant 2's backward,
 *           5 = variant 3 saving for backward: the forward keeps its panels, h^T and D
 *               (gdp_cuda_gdp_forward_v3_save), the backward reads them
 *               (gdp_cuda_gdp_backward_v3_saved) instead of recomputing.
 * The oracle is gdp_cpu_gdp_{fwd,bwd}_recurrent_f64 (kernels/cpu/gdp_recurrent.c) on
 * l2-normalised inputs, with the backward of the norm done here in float64.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

extern "C" {
#include "cpu/gdp_cpu.h"
#include "cuda/gdp_cuda.h"
}

using std::vector;

/* ------------------------------------------------------------------ errors */

static char g_last_error[1024];
extern "C" gdp_status gdp_set_error(gdp_status status, const char *func, const char *file, int line,
                                    const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  snprintf(g_last_error, sizeof g_last_error, "%s: %s (%s:%d)", func, msg, file, line);
  return status;
}

#define CK(expr)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (expr);                                                           \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
              __LINE__, #expr);                                                        \
      exit(2);                                                                         \
    }                                                                                  \
  } while (0)

/* ------------------------------------------------------------------ random numbers */

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 12345) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  double uniform() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
  }
};

static double round_bf16(double x) { return (double)__bfloat162float(__float2bfloat16((float)x)); }

/* ------------------------------------------------------------------ problems */

struct Prob {
  vector<int64_t> cu; /* N+1 */
  int64_t H, K, V, n;
  bool gated, has_h0, has_dht, want_ht, want_dh0, l2norm;
  double scale;
  int64_t N() const { return (int64_t)cu.size() - 1; }
  int64_t T() const { return cu.back(); }
};

struct Inputs {
  vector<double> q, k, v, g, beta, h0, d_o, dht;
};
struct Outputs {
  vector<double> o, ht, dq, dk, dv, dbeta, dg, dh0;
};

static void make_inputs(const Prob &P, Rng &r, bool bf16_inputs, Inputs &in) {
  const int64_t T = P.T(), H = P.H, K = P.K, V = P.V, n = P.n, N = P.N();
  auto fill = [&](vector<double> &x, int64_t count, double sd, int kind) {
    x.resize(count);
    for (auto &e : x) {
      double z = r.normal();
      if (kind == 1) z = 1.0 / (1.0 + exp(-z));         /* beta in (0,1) */
      else if (kind == 2) z = -log1p(exp(-(z + 2.0))); /* g = logsigmoid(z + 2) */
      else z *= sd;
      e = bf16_inputs && kind != 3 ? round_bf16(z) : z;
    }
  };
  fill(in.q, T * H * K, 1.0, 0);
  fill(in.k, T * n * H * K, 1.0, 0);
  fill(in.v, T * n * H * V, 1.0, 0);
  fill(in.beta, T * n * H, 0, 1);
  if (P.gated) fill(in.g, T * H, 0, 2); else in.g.clear();
  if (P.has_h0) fill(in.h0, N * H * K * V, 0.5, 3); else in.h0.clear();
  fill(in.d_o, T * H * V, 1.0, 0);
  if (P.has_dht) fill(in.dht, N * H * K * V, 0.5, 3); else in.dht.clear();
}

static gdp_gdp_problem to_problem(const Prob &P, int dtype, int algorithm, int l2norm) {
  gdp_gdp_problem p;
  memset(&p, 0, sizeof p);
  p.T_total = P.T();
  p.N = P.N();
  p.cu_seqlens = P.cu.data();
  p.H = P.H;
  p.K = P.K;
  p.V = P.V;
  p.n = P.n;
  p.scale = P.scale;
  p.chunk_size = 64;
  p.num_threads = 8;
  p.dtype = dtype;
  p.algorithm = algorithm;
  p.l2norm_in_kernel = l2norm;
  return p;
}

/* ------------------------------------------------------------------ float64 reference */

static const double kEps = 1e-6;

static void l2norm_rows(const vector<double> &x, int64_t dim, vector<double> &y) {
  y.resize(x.size());
  for (size_t r = 0; r < x.size() / dim; r++) {
    double ss = 0;
    for (int64_t c = 0; c < dim; c++) ss += x[r * dim + c] * x[r * dim + c];
    const double inv = 1.0 / sqrt(ss + kEps);
    for (int64_t c = 0; c < dim; c++) y[r * dim + c] = x[r * dim + c] * inv;
  }
}
/* dx = r (dy - y (y . dy)), y = x r */
static void l2norm_bwd_rows(const vector<double> &x, const vector<double> &dy, int64_t dim,
                            vector<double> &dx) {
  dx.resize(x.size());
  for (size_t r = 0; r < x.size() / dim; r++) {
    double ss = 0;
    for (int64_t c = 0; c < dim; c++) ss += x[r * dim + c] * x[r * dim + c];
    const double inv = 1.0 / sqrt(ss + kEps);
    double dot = 0;
    for (int64_t c = 0; c < dim; c++) dot += x[r * dim + c] * inv * dy[r * dim + c];
    for (int64_t c = 0; c < dim; c++)
      dx[r * dim + c] = inv * (dy[r * dim + c] - x[r * dim + c] * inv * dot);
  }
}

static void reference(const Prob &P, const Inputs &in, Outputs &out) {
  const int64_t T = P.T(), H = P.H, K = P.K, V = P.V, n = P.n, N = P.N();
  vector<double> qn, kn;
  if (P.l2norm) {
    l2norm_rows(in.q, K, qn);
    l2norm_rows(in.k, K, kn);
  } else {
    qn = in.q;
    kn = in.k;
  }
  gdp_gdp_problem p = to_problem(P, GDP_DTYPE_F64, GDP_ALGO_RECURRENT, 0);
  p.num_threads = 16;
  out.o.assign(T * H * V, 0);
  out.ht.assign(N * H * K * V, 0);
  gdp_gdp_fwd_io f = {qn.data(), kn.data(), in.v.data(), P.gated ? in.g.data() : NULL,
                      in.beta.data(), P.has_h0 ? in.h0.data() : NULL, out.o.data(), out.ht.data()};
  if (gdp_cpu_gdp_fwd_recurrent_f64(&p, &f) != GDP_OK) {
    fprintf(stderr, "oracle forward failed: %s\n", g_last_error);
    exit(2);
  }
  vector<double> dqn(T * H * K), dkn(T * n * H * K);
  out.dv.assign(T * n * H * V, 0);
  out.dbeta.assign(T * n * H, 0);
  out.dg.assign(P.gated ? T * H : 0, 0);
  out.dh0.assign(N * H * K * V, 0);
  gdp_gdp_bwd_io b = {qn.data(), kn.data(), in.v.data(), P.gated ? in.g.data() : NULL,
                      in.beta.data(), P.has_h0 ? in.h0.data() : NULL, in.d_o.data(),
                      P.has_dht ? in.dht.data() : NULL, dqn.data(), dkn.data(), out.dv.data(),
                      out.dbeta.data(), P.gated ? out.dg.data() : NULL, out.dh0.data()};
  if (gdp_cpu_gdp_bwd_recurrent_f64(&p, &b) != GDP_OK) {
    fprintf(stderr, "oracle backward failed: %s\n", g_last_error);
    exit(2);
  }
  if (P.l2norm) {
    l2norm_bwd_rows(in.q, dqn, K, out.dq);
    l2norm_bwd_rows(in.k, dkn, K, out.dk);
  } else {
    out.dq = dqn;
    out.dk = dkn;
  }
}

/* ------------------------------------------------------------------ float64 chunk mirror */
/* The chunkwise algorithm exactly as the CUDA chunk kernels run it (prep, state pass,
 * reverse state-gradient pass, per-chunk gradients), in float64, so that its algebra
 * is checked against the oracle on the CPU before any GPU time is spent. */

typedef vector<double> Mat; /* row-major */

static void mirror(const Prob &P, const Inputs &in, int64_t C, Outputs &out) {
  const int64_t T = P.T(), H = P.H, K = P.K, V = P.V, n = P.n, N = P.N(), TC = C / n;
  out.o.assign(T * H * V, 0);
  out.ht.assign(N * H * K * V, 0);
  out.dq.assign(T * H * K, 0);
  out.dk.assign(T * n * H * K, 0);
  out.dv.assign(T * n * H * V, 0);
  out.dbeta.assign(T * n * H, 0);
  out.dg.assign(P.gated ? T * H : 0, 0);
  out.dh0.assign(N * H * K * V, 0);
  struct Ch {
    int64_t t0, ntok;
    Mat kraw, kn, qraw, qn, vv, beta, gc, KK, A, Tm, W, U, Kd, Qd, Pm, h, D, dSC, dD, dO;
    double elast;
  };
  for (int64_t s = 0; s < N; s++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t bos = P.cu[s], eos = P.cu[s + 1];
      vector<Ch> ch;
      for (int64_t t0 = bos; t0 < eos; t0 += TC) {
        Ch c;
        c.t0 = t0;
        c.ntok = std::min(TC, eos - t0);
        const int64_t nv = c.ntok * n;
        c.kraw.assign(C * K, 0); c.kn.assign(C * K, 0); c.qraw.assign(TC * K, 0);
        c.qn.assign(TC * K, 0); c.vv.assign(C * V, 0); c.beta.assign(C, 0); c.gc.assign(C, 0);
        c.dO.assign(TC * V, 0);
        double acc = 0;
        for (int64_t i = 0; i < C; i++) {
          if (i < nv) {
            const int64_t row = (t0 * n + i) * H + h;
            double ss = 0;
            for (int64_t r = 0; r < K; r++) c.kraw[i * K + r] = in.k[row * K + r], ss += c.kraw[i * K + r] * c.kraw[i * K + r];
            const double rk = P.l2norm ? 1.0 / sqrt(ss + kEps) : 1.0;
            for (int64_t r = 0; r < K; r++) c.kn[i * K + r] = c.kraw[i * K + r] * rk;
            for (int64_t x = 0; x < V; x++) c.vv[i * V + x] = in.v[row * V + x];
            c.beta[i] = in.beta[row];
            if (P.gated && i % n == 0) acc += in.g[(t0 + i / n) * H + h];
          }
          c.gc[i] = acc;
        }
        for (int64_t a = 0; a < c.ntok; a++) {
          const int64_t row = (t0 + a) * H + h;
          double ss = 0;
          for (int64_t r = 0; r < K; r++) c.qraw[a * K + r] = in.q[row * K + r], ss += c.qraw[a * K + r] * c.qraw[a * K + r];
          const double rq = P.l2norm ? 1.0 / sqrt(ss + kEps) : 1.0;
          for (int64_t r = 0; r < K; r++) c.qn[a * K + r] = c.qraw[a * K + r] * rq;
          for (int64_t x = 0; x < V; x++) c.dO[a * V + x] = in.d_o[row * V + x];
        }
        const double last = c.gc[C - 1];
        c.elast = exp(last);
        c.KK.assign(C * C, 0); c.A.assign(C * C, 0); c.Tm.assign(C * C, 0);
        for (int64_t i = 0; i < C; i++)
          for (int64_t j = 0; j < C; j++) {
            double d = 0;
            for (int64_t r = 0; r < K; r++) d += c.kn[i * K + r] * c.kn[j * K + r];
            c.KK[i * C + j] = d;
            if (i > j) c.A[i * C + j] = c.beta[i] * exp(c.gc[i] - c.gc[j]) * d;
          }
        for (int64_t i = 0; i < C; i++)
          for (int64_t x = 0; x < C; x++) {
            double t = (i == x) ? 1.0 : 0.0;
            for (int64_t j = 0; j < i; j++) t -= c.A[i * C + j] * c.Tm[j * C + x];
            c.Tm[i * C + x] = t;
          }
        c.W.assign(C * K, 0); c.U.assign(C * V, 0); c.Kd.assign(C * K, 0);
        for (int64_t i = 0; i < C; i++) {
          for (int64_t j = 0; j <= i; j++) {
            const double t = c.Tm[i * C + j];
            const double kb = c.beta[j] * exp(c.gc[j]);
            for (int64_t r = 0; r < K; r++) c.W[i * K + r] += t * kb * c.kn[j * K + r];
            for (int64_t x = 0; x < V; x++) c.U[i * V + x] += t * c.beta[j] * c.vv[j * V + x];
          }
          for (int64_t r = 0; r < K; r++) c.Kd[i * K + r] = exp(last - c.gc[i]) * c.kn[i * K + r];
        }
        c.Qd.assign(TC * K, 0); c.Pm.assign(TC * C, 0);
        for (int64_t a = 0; a < TC; a++) {
          const int64_t ia = a * n + n - 1;
          for (int64_t r = 0; r < K; r++) c.Qd[a * K + r] = P.scale * exp(c.gc[ia]) * c.qn[a * K + r];
          for (int64_t j = 0; j <= ia; j++) {
            double d = 0;
            for (int64_t r = 0; r < K; r++) d += c.qn[a * K + r] * c.kn[j * K + r];
            c.Pm[a * C + j] = P.scale * exp(c.gc[ia] - c.gc[j]) * d;
          }
        }
        ch.push_back(c);
      }
      /* state pass */
      Mat S(K * V, 0);
      if (P.has_h0) for (int64_t e = 0; e < K * V; e++) S[e] = in.h0[(s * H + h) * K * V + e];
      for (auto &c : ch) {
        c.h = S;
        c.D.assign(C * V, 0);
        for (int64_t i = 0; i < C; i++)
          for (int64_t x = 0; x < V; x++) {
            double d = c.U[i * V + x];
            for (int64_t r = 0; r < K; r++) d -= c.W[i * K + r] * S[r * V + x];
            c.D[i * V + x] = d;
          }
        for (int64_t a = 0; a < c.ntok; a++)
          for (int64_t x = 0; x < V; x++) {
            double o = 0;
            for (int64_t r = 0; r < K; r++) o += c.Qd[a * K + r] * S[r * V + x];
            for (int64_t j = 0; j < C; j++) o += c.Pm[a * C + j] * c.D[j * V + x];
            out.o[((c.t0 + a) * H + h) * V + x] = o;
          }
        for (int64_t r = 0; r < K; r++)
          for (int64_t x = 0; x < V; x++) {
            double d = c.elast * S[r * V + x];
            for (int64_t j = 0; j < C; j++) d += c.Kd[j * K + r] * c.D[j * V + x];
            S[r * V + x] = d;
          }
      }
      for (int64_t e = 0; e < K * V; e++) out.ht[(s * H + h) * K * V + e] = S[e];
      /* reverse state-gradient pass */
      Mat dH(K * V, 0);
      if (P.has_dht) for (int64_t e = 0; e < K * V; e++) dH[e] = in.dht[(s * H + h) * K * V + e];
      for (int64_t ci = (int64_t)ch.size() - 1; ci >= 0; ci--) {
        Ch &c = ch[ci];
        c.dSC = dH;
        c.dD.assign(C * V, 0);
        for (int64_t j = 0; j < C; j++)
          for (int64_t x = 0; x < V; x++) {
            double d = 0;
            for (int64_t a = 0; a < TC; a++) d += c.Pm[a * C + j] * c.dO[a * V + x];
            for (int64_t r = 0; r < K; r++) d += c.Kd[j * K + r] * dH[r * V + x];
            c.dD[j * V + x] = d;
          }
        for (int64_t r = 0; r < K; r++)
          for (int64_t x = 0; x < V; x++) {
            double d = c.elast * dH[r * V + x];
            for (int64_t a = 0; a < TC; a++) d += c.Qd[a * K + r] * c.dO[a * V + x];
            for (int64_t j = 0; j < C; j++) d -= c.W[j * K + r] * c.dD[j * V + x];
            dH[r * V + x] = d;
          }
      }
      for (int64_t e = 0; e < K * V; e++) out.dh0[(s * H + h) * K * V + e] = dH[e];
      /* per-chunk gradients */
      for (auto &c : ch) {
        const int64_t nv = c.ntok * n;
        const double last = c.gc[C - 1];
        vector<double> dgc(C, 0), dbeta(C, 0);
        Mat dqn(TC * K, 0), dkn(C * K, 0), dW(C * K, 0), dVb(C * V, 0), dKb(C * K, 0);
        for (int64_t a = 0; a < TC; a++) {
          const int64_t ia = a * n + n - 1;
          for (int64_t j = 0; j <= ia; j++) {
            double dp = 0, qk = 0;
            for (int64_t x = 0; x < V; x++) dp += c.dO[a * V + x] * c.D[j * V + x];
            for (int64_t r = 0; r < K; r++) qk += c.qn[a * K + r] * c.kn[j * K + r];
            const double ps = P.scale * exp(c.gc[ia] - c.gc[j]) * dp;
            dgc[ia] += ps * qk;
            dgc[j] -= ps * qk;
            for (int64_t r = 0; r < K; r++) {
              dqn[a * K + r] += ps * c.kn[j * K + r];
              dkn[j * K + r] += ps * c.qn[a * K + r];
            }
          }
          const double sa = P.scale * exp(c.gc[ia]);
          for (int64_t r = 0; r < K; r++) {
            double t = 0;
            for (int64_t x = 0; x < V; x++) t += c.h[r * V + x] * c.dO[a * V + x];
            dgc[ia] += sa * c.qn[a * K + r] * t;
            dqn[a * K + r] += sa * t;
          }
        }
        double dlast = 0, frob = 0;
        for (int64_t e = 0; e < K * V; e++) frob += c.dSC[e] * c.h[e];
        dlast += c.elast * frob;
        for (int64_t j = 0; j < C; j++) {
          const double w = exp(last - c.gc[j]);
          double z = 0;
          for (int64_t r = 0; r < K; r++) {
            double ks = 0, dw = 0;
            for (int64_t x = 0; x < V; x++) ks += c.dSC[r * V + x] * c.D[j * V + x], dw += c.h[r * V + x] * c.dD[j * V + x];
            dkn[j * K + r] += w * ks;
            z += w * c.kn[j * K + r] * ks;
            dW[j * K + r] = -dw;
          }
          dgc[j] -= z;
          dlast += z;
        }
        dgc[C - 1] += dlast;
        for (int64_t j = 0; j < C; j++)
          for (int64_t i = j; i < C; i++) {
            const double t = c.Tm[i * C + j];
            for (int64_t x = 0; x < V; x++) dVb[j * V + x] += t * c.dD[i * V + x];
            for (int64_t r = 0; r < K; r++) dKb[j * K + r] += t * dW[i * K + r];
          }
        for (int64_t j = 0; j < C; j++) {
          const double eg = exp(c.gc[j]);
          for (int64_t x = 0; x < V; x++) dbeta[j] += c.vv[j * V + x] * dVb[j * V + x];
          double kd = 0;
          for (int64_t r = 0; r < K; r++) kd += c.kn[j * K + r] * dKb[j * K + r], dkn[j * K + r] += c.beta[j] * eg * dKb[j * K + r];
          dbeta[j] += eg * kd;
          dgc[j] += c.beta[j] * eg * kd;
        }
        /* dT = dU Vb^T + dW Kb^T ; dA = -T^T dT T^T */
        Mat dT(C * C, 0), X(C * C, 0), dA(C * C, 0);
        for (int64_t i = 0; i < C; i++)
          for (int64_t j = 0; j < C; j++) {
            double d = 0;
            for (int64_t x = 0; x < V; x++) d += c.dD[i * V + x] * c.beta[j] * c.vv[j * V + x];
            for (int64_t r = 0; r < K; r++) d += dW[i * K + r] * c.beta[j] * exp(c.gc[j]) * c.kn[j * K + r];
            dT[i * C + j] = d;
          }
        for (int64_t i = 0; i < C; i++)
          for (int64_t j = 0; j < C; j++) {
            double d = 0;
            for (int64_t m = 0; m < C; m++) d += dT[i * C + m] * c.Tm[j * C + m];
            X[i * C + j] = d;
          }
        for (int64_t i = 0; i < C; i++)
          for (int64_t j = 0; j < C; j++) {
            double d = 0;
            for (int64_t m = 0; m < C; m++) d -= c.Tm[m * C + i] * X[m * C + j];
            dA[i * C + j] = d;
          }
        for (int64_t i = 0; i < C; i++)
          for (int64_t j = 0; j < i; j++) {
            const double e = exp(c.gc[i] - c.gc[j]);
            const double da = dA[i * C + j];
            dbeta[i] += da * e * c.KK[i * C + j];
            const double G = da * c.beta[i] * e;
            for (int64_t r = 0; r < K; r++) {
              dkn[i * K + r] += G * c.kn[j * K + r];
              dkn[j * K + r] += G * c.kn[i * K + r];
            }
            dgc[i] += da * c.A[i * C + j];
            dgc[j] -= da * c.A[i * C + j];
          }
        double run = 0;
        vector<double> dgp(C);
        for (int64_t i = C - 1; i >= 0; i--) run += dgc[i], dgp[i] = run;
        for (int64_t i = 0; i < nv; i++) {
          const int64_t row = (c.t0 * n + i) * H + h;
          out.dbeta[row] = dbeta[i];
          for (int64_t x = 0; x < V; x++) out.dv[row * V + x] = c.beta[i] * dVb[i * V + x];
          double ss = 0, dot = 0;
          for (int64_t r = 0; r < K; r++) ss += c.kraw[i * K + r] * c.kraw[i * K + r];
          const double rk = P.l2norm ? 1.0 / sqrt(ss + kEps) : 1.0;
          for (int64_t r = 0; r < K; r++) dot += c.kn[i * K + r] * dkn[i * K + r];
          for (int64_t r = 0; r < K; r++)
            out.dk[row * K + r] = P.l2norm ? rk * (dkn[i * K + r] - c.kn[i * K + r] * dot) : dkn[i * K + r];
          if (P.gated && i % n == 0) out.dg[(c.t0 + i / n) * H + h] = dgp[i];
        }
        for (int64_t a = 0; a < c.ntok; a++) {
          const int64_t row = (c.t0 + a) * H + h;
          double ss = 0, dot = 0;
          for (int64_t r = 0; r < K; r++) ss += c.qraw[a * K + r] * c.qraw[a * K + r];
          const double rq = P.l2norm ? 1.0 / sqrt(ss + kEps) : 1.0;
          for (int64_t r = 0; r < K; r++) dot += c.qn[a * K + r] * dqn[a * K + r];
          for (int64_t r = 0; r < K; r++)
            out.dq[row * K + r] = P.l2norm ? rq * (dqn[a * K + r] - c.qn[a * K + r] * dot) : dqn[a * K + r];
        }
      }
    }
}

/* ------------------------------------------------------------------ comparison */

static double rel_err(const vector<double> &x, const vector<double> &ref) {
  if (x.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); i++) {
    if (!(x[i] == x[i])) return NAN;
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return sqrt(num / den);
}

struct Named {
  const char *name;
  const vector<double> *got, *ref;
};

/* Prints one line per tensor; returns the largest error (NaN counts as failure). */
static double compare_all(const char *label, const vector<Named> &items, double tol, int *fails) {
  double worst = 0;
  printf("%-48s", label);
  for (auto &it : items) {
    if (it.ref->empty()) continue;
    double e = rel_err(*it.got, *it.ref);
    bool bad = !(e <= tol);
    if (bad) (*fails)++;
    worst = std::max(worst, e != e ? INFINITY : e);
    printf(" %s=%.1e%s", it.name, e, bad ? "!" : "");
  }
  printf("\n");
  fflush(stdout);
  return worst;
}

static vector<Named> all_named(const Prob &P, const Outputs &g, const Outputs &r) {
  vector<Named> v = {{"o", &g.o, &r.o},       {"ht", &g.ht, &r.ht},   {"dq", &g.dq, &r.dq},
                     {"dk", &g.dk, &r.dk},    {"dv", &g.dv, &r.dv},   {"dbeta", &g.dbeta, &r.dbeta},
                     {"dg", &g.dg, &r.dg},    {"dh0", &g.dh0, &r.dh0}};
  return v;
}

/* ------------------------------------------------------------------ random problem shapes */

static Prob random_prob(Rng &r, int64_t K, int64_t V, int64_t n, bool gated, bool packed) {
  Prob P;
  P.H = 1 + (int64_t)(r.next() % 3);
  P.K = K;
  P.V = V;
  P.n = n;
  P.gated = gated;
  P.has_h0 = r.next() % 2;
  P.has_dht = r.next() % 2;
  P.want_ht = true;
  P.want_dh0 = true;
  P.l2norm = true;
  P.scale = 1.0 / sqrt((double)K);
  P.cu.push_back(0);
  if (packed) {
    int64_t N = 2 + (int64_t)(r.next() % 4);
    for (int64_t s = 0; s < N; s++) {
      int64_t L = (r.next() % 4 == 0) ? 0 : 1 + (int64_t)(r.next() % 150);
      P.cu.push_back(P.cu.back() + L);
    }
  } else {
    int64_t B = 1 + (int64_t)(r.next() % 2), L = 64 + (int64_t)(r.next() % 100);
    for (int64_t s = 0; s < B; s++) P.cu.push_back(P.cu.back() + L);
  }
  return P;
}

static int selftest(void) {
  Rng r(20261130);
  int fails = 0;
  const int64_t shapes[][2] = {{64, 64}, {48, 96}, {32, 16}};
  for (int n = 1; n <= 3; n++)
    for (int gi = 0; gi < 2; gi++)
      for (auto &sh : shapes) {
        Prob P = random_prob(r, sh[0], sh[1], n, gi, true);
        for (auto &L : P.cu) (void)L;
        Inputs in;
        make_inputs(P, r, false, in);
        Outputs ref, mir;
        reference(P, in, ref);
        const int64_t C = n == 3 ? 48 : 64;
        mirror(P, in, C, mir);
        char label[128];
        snprintf(label, sizeof label, "mirror n=%d g=%d K=%lld V=%lld N=%lld T=%lld", n, gi,
                 (long long)P.K, (long long)P.V, (long long)P.N(), (long long)P.T());
        compare_all(label, all_named(P, mir, ref), 1e-9, &fails);
      }
  printf("selftest: %s (%d tensors over tolerance 1e-9)\n", fails ? "FAIL" : "ok", fails);
  return fails ? 1 : 0;
}

#ifndef GDP_LAB_CPU_ONLY
/* ================================================================== GPU side */

#include "cuda/gdp_chunk.cuh"
#include "cuda/gdp_bwd_v3.cuh"
#include "cuda/gdp_fwd_v3.cuh"

static const char *variant_name(int v) {
  static char buf[32];
  if (v == 1) return "recurrent";
  /* bf16 chunk states between the v3 kernels (the default; GDP_CUDA_V3_STATE=f32 for the
   * float32 ones) mark their lines */
  const char *st = getenv("GDP_CUDA_V3_STATE");
  const bool s16 = !(st && !strcmp(st, "f32"));
  if (v == 3) {
    const char *g = getenv("GDP_CUDA_V3_GRAD");
    return g && !strcmp(g, "v2") ? "chunk_v3_gradv2" : s16 ? "chunk_v3_s16" : "chunk_v3";
  }
  if (v == 4) return "v3_oldprep";
  if (v == 5) return s16 ? "v3_saved_s16" : "v3_saved";
  const char *bv = getenv("GDP_CUDA_BV");
  if (!bv) return "chunk";
  snprintf(buf, sizeof buf, "chunk_bv%s", bv);
  return buf;
}
static int variant_algo(int v) { return v == 1 ? GDP_ALGO_RECURRENT : GDP_ALGO_CHUNK; }
/* Variant 5's kept block: grown as needed, reused across calls (a forward overwrites it,
 * the next backward reads it; everything runs on the default stream). */
static void *g_saved = nullptr;
static size_t g_saved_cap = 0;
static void *saved_block(const gdp_gdp_problem *p) {
  const size_t bytes = gdp_cuda_gdp_v3_saved_bytes(p);
  if (bytes > g_saved_cap) {
    if (g_saved) CK(cudaFree(g_saved));
    CK(cudaMalloc(&g_saved, bytes));
    g_saved_cap = bytes;
  }
  return g_saved;
}
/* The forward of a variant (4 = variant 2's prep + variant 3's state pass). */
static gdp_status variant_forward(int v, const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io) {
  if (v == 5) return gdp_cuda_gdp_forward_v3_save(p, io, 0, saved_block(p));
  if (v == 3 || v == 4) return gdp_cuda_gdp_forward_v3(p, io, 0, v == 3);
  if (v == 2) return gdp_cuda_gdp_forward_v2(p, io, 0);
  return gdp_cuda_gdp_forward_recurrent(p, io, 0);
}
/* The backward of a variant (4 has variant 2's). */
static gdp_status variant_backward(int v, const gdp_gdp_problem *p, const gdp_gdp_bwd_io *io) {
  if (v == 5) return gdp_cuda_gdp_backward_v3_saved(p, io, 0, g_saved);
  if (v == 3) return gdp_cuda_gdp_backward_v3(p, io, 0);
  if (v == 2 || v == 4) return gdp_cuda_gdp_backward_v2(p, io, 0);
  return gdp_cuda_gdp_backward_recurrent(p, io, 0);
}

/* A device buffer of `count` elements of dtype (token tensors) or float32 (states). */
struct DBuf {
  void *p = nullptr;
  size_t bytes = 0;
  void alloc(size_t nbytes) {
    bytes = nbytes;
    if (nbytes) CK(cudaMalloc(&p, nbytes));
  }
  ~DBuf() {
    if (p) cudaFree(p);
  }
};

static size_t esize(int dtype) { return dtype == GDP_DTYPE_BF16 ? 2 : 4; }

static void upload(DBuf &b, const vector<double> &x, int dtype) {
  b.alloc(x.size() * esize(dtype));
  if (x.empty()) return;
  if (dtype == GDP_DTYPE_BF16) {
    vector<__nv_bfloat16> h(x.size());
    for (size_t i = 0; i < x.size(); i++) h[i] = __float2bfloat16((float)x[i]);
    CK(cudaMemcpy(b.p, h.data(), b.bytes, cudaMemcpyHostToDevice));
  } else {
    vector<float> h(x.begin(), x.end());
    CK(cudaMemcpy(b.p, h.data(), b.bytes, cudaMemcpyHostToDevice));
  }
}
static void alloc_poisoned(DBuf &b, size_t count, int dtype) {
  b.alloc(count * esize(dtype));
  if (b.bytes) CK(cudaMemset(b.p, 0xFF, b.bytes)); /* NaN in f32 and bf16 */
}
static void download(const DBuf &b, size_t count, int dtype, vector<double> &x) {
  x.resize(count);
  if (!count) return;
  if (dtype == GDP_DTYPE_BF16) {
    vector<__nv_bfloat16> h(count);
    CK(cudaMemcpy(h.data(), b.p, count * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; i++) x[i] = __bfloat162float(h[i]);
  } else {
    vector<float> h(count);
    CK(cudaMemcpy(h.data(), b.p, count * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; i++) x[i] = h[i];
  }
}

struct DevProblem {
  DBuf q, k, v, g, beta, h0, d_o, dht;
  DBuf o, ht, dq, dk, dv, dbeta, dg, dh0;
};

static void dev_inputs(const Prob &P, const Inputs &in, int dtype, DevProblem &d) {
  upload(d.q, in.q, dtype);
  upload(d.k, in.k, dtype);
  upload(d.v, in.v, dtype);
  upload(d.g, in.g, dtype);
  upload(d.beta, in.beta, dtype);
  upload(d.h0, in.h0, GDP_DTYPE_F32);
  upload(d.d_o, in.d_o, dtype);
  upload(d.dht, in.dht, GDP_DTYPE_F32);
  const int64_t T = P.T(), H = P.H, K = P.K, V = P.V, n = P.n, N = P.N();
  alloc_poisoned(d.o, T * H * V, dtype);
  alloc_poisoned(d.ht, N * H * K * V, GDP_DTYPE_F32);
  alloc_poisoned(d.dq, T * H * K, dtype);
  alloc_poisoned(d.dk, T * n * H * K, dtype);
  alloc_poisoned(d.dv, T * n * H * V, dtype);
  alloc_poisoned(d.dbeta, T * n * H, dtype);
  alloc_poisoned(d.dg, P.gated ? T * H : 0, dtype);
  alloc_poisoned(d.dh0, N * H * K * V, GDP_DTYPE_F32);
}

static gdp_gdp_fwd_io fwd_io(const Prob &P, DevProblem &d, bool want_ht) {
  gdp_gdp_fwd_io io = {d.q.p, d.k.p, d.v.p, P.gated ? d.g.p : NULL, d.beta.p,
                       P.has_h0 ? d.h0.p : NULL, d.o.p, want_ht ? d.ht.p : NULL};
  return io;
}
static gdp_gdp_bwd_io bwd_io(const Prob &P, DevProblem &d, bool want_dh0) {
  gdp_gdp_bwd_io io = {d.q.p, d.k.p, d.v.p, P.gated ? d.g.p : NULL, d.beta.p,
                       P.has_h0 ? d.h0.p : NULL, d.d_o.p, P.has_dht ? d.dht.p : NULL,
                       d.dq.p, d.dk.p, d.dv.p, d.dbeta.p, P.gated ? d.dg.p : NULL,
                       want_dh0 ? d.dh0.p : NULL};
  return io;
}

static void must(gdp_status st, const char *what) {
  if (st != GDP_OK) {
    fprintf(stderr, "%s failed (%d): %s\n", what, (int)st, g_last_error);
    exit(3);
  }
}

static void run_gpu(const Prob &P, DevProblem &d, int dtype, int variant, Outputs &got) {
  gdp_gdp_problem p = to_problem(P, dtype, variant_algo(variant), P.l2norm ? 1 : 0);
  gdp_gdp_fwd_io f = fwd_io(P, d, true);
  must(variant_forward(variant, &p, &f), "gdp_cuda_gdp_forward");
  gdp_gdp_bwd_io b = bwd_io(P, d, true);
  must(variant_backward(variant, &p, &b), "gdp_cuda_gdp_backward");
  CK(cudaDeviceSynchronize());
  CK(cudaGetLastError());
  const int64_t T = P.T(), H = P.H, K = P.K, V = P.V, n = P.n, N = P.N();
  download(d.o, T * H * V, dtype, got.o);
  download(d.ht, N * H * K * V, GDP_DTYPE_F32, got.ht);
  download(d.dq, T * H * K, dtype, got.dq);
  download(d.dk, T * n * H * K, dtype, got.dk);
  download(d.dv, T * n * H * V, dtype, got.dv);
  download(d.dbeta, T * n * H, dtype, got.dbeta);
  download(d.dg, P.gated ? T * H : 0, dtype, got.dg);
  download(d.dh0, N * H * K * V, GDP_DTYPE_F32, got.dh0);
}

static bool chunk_covers(const Prob &P, int dtype) {
  gdp_gdp_problem p = to_problem(P, dtype, GDP_ALGO_CHUNK, 1);
  return gdpcu::chunk_path_ok(&p);
}

static bool v3_covers(const Prob &P, int dtype, int variant) {
  gdp_gdp_problem p = to_problem(P, dtype, GDP_ALGO_CHUNK, 1);
  return gdp_cuda_gdp_forward_v3_supported(&p, variant != 4) != 0 &&
         (variant == 4 || gdp_cuda_gdp_backward_v3_supported(&p) != 0);
}

static int gpu_check(const vector<int> &variants, uint64_t seed, bool quick) {
  Rng r(seed);
  int fails = 0, runs = 0;
  const int64_t shapes[][2] = {{64, 64}, {128, 128}, {48, 96}, {96, 48}};
  printf("== check: relative error vs the float64 oracle (seed %llu); tolerance f32 1e-4, bf16 1e-2\n",
         (unsigned long long)seed);
  for (int n = 1; n <= 3; n++)
    for (int gi = 0; gi < 2; gi++)
      for (auto &sh : shapes) {
        if (quick && !(sh[0] == 64 || sh[0] == 48)) continue;
        Prob P = random_prob(r, sh[0], sh[1], n, gi, (r.next() % 4) != 0);
        for (int dtype : {GDP_DTYPE_F32, GDP_DTYPE_BF16}) {
          Inputs in;
          make_inputs(P, r, dtype == GDP_DTYPE_BF16, in);
          Outputs ref;
          reference(P, in, ref);
          DevProblem d;
          dev_inputs(P, in, dtype, d);
          for (int var : variants) {
            if (var == 2 && !chunk_covers(P, dtype)) continue;
            if ((var == 3 || var == 4 || var == 5) && !v3_covers(P, dtype, var)) continue;
            Outputs got;
            run_gpu(P, d, dtype, var, got);
            char label[160];
            snprintf(label, sizeof label, "%-9s %s n=%d g=%d K=%-3lld V=%-3lld H=%lld N=%lld T=%lld", variant_name(var),
                     dtype == GDP_DTYPE_BF16 ? "bf16" : "f32 ", n, gi, (long long)P.K, (long long)P.V,
                     (long long)P.H, (long long)P.N(), (long long)P.T());
            compare_all(label, all_named(P, got, ref), dtype == GDP_DTYPE_BF16 ? 1e-2 : 1e-4, &fails);
            runs++;
          }
        }
      }
  /* one long sequence: many chunks through the state passes */
  {
    Prob P;
    P.H = 2; P.K = 128; P.V = 128; P.n = 2; P.gated = true; P.has_h0 = true; P.has_dht = true;
    P.want_ht = P.want_dh0 = true; P.l2norm = true; P.scale = 1.0 / sqrt(128.0);
    P.cu = {0, quick ? 700 : 2000, quick ? 1000 : 2600};
    for (int dtype : {GDP_DTYPE_F32, GDP_DTYPE_BF16}) {
      Inputs in;
      make_inputs(P, r, dtype == GDP_DTYPE_BF16, in);
      Outputs ref;
      reference(P, in, ref);
      DevProblem d;
      dev_inputs(P, in, dtype, d);
      for (int var : variants) {
        if (var == 2 && !chunk_covers(P, dtype)) continue;
        if ((var == 3 || var == 4 || var == 5) && !v3_covers(P, dtype, var)) continue;
        Outputs got;
        run_gpu(P, d, dtype, var, got);
        char label[160];
        snprintf(label, sizeof label, "%-9s %s long n=2 g=1 K=128 V=128 H=2 T=%lld", variant_name(var),
                 dtype == GDP_DTYPE_BF16 ? "bf16" : "f32 ", (long long)P.T());
        compare_all(label, all_named(P, got, ref), dtype == GDP_DTYPE_BF16 ? 1e-2 : 1e-4, &fails);
        runs++;
      }
    }
  }
  printf("check: %s (%d runs, %d tensors over tolerance)\n", fails ? "FAIL" : "ok", runs, fails);
  fflush(stdout);
  return fails ? 1 : 0;
}

/* ------------------------------------------------------------------ bench */

static float time_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

static double median(vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.empty() ? 0 : x[x.size() / 2];
}

static int gpu_bench(int64_t B, int64_t T, int64_t n, const vector<int> &variants, int reps,
                     const char *json_path) {
  Prob P;
  P.H = 16; P.K = 128; P.V = 128; P.n = n; P.gated = true; P.has_h0 = false; P.has_dht = false;
  P.want_ht = false; P.want_dh0 = false; P.l2norm = true; P.scale = 1.0 / sqrt(128.0);
  P.cu.push_back(0);
  for (int64_t b = 0; b < B; b++) P.cu.push_back(P.cu.back() + T);
  Rng r(777 + B * 131 + T * 7 + n);
  Inputs in;
  make_inputs(P, r, true, in);
  DevProblem d;
  dev_inputs(P, in, GDP_DTYPE_BF16, d);
  cudaEvent_t e0, e1, e2;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&e2));
  FILE *js = json_path ? fopen(json_path, "a") : NULL;
  printf("== bench bf16 B=%lld T=%lld n=%lld H=16 K=V=128 gated l2norm (median of %d)\n", (long long)B,
         (long long)T, (long long)n, reps);
  vector<Outputs> outs;
  for (int var : variants) {
    gdp_gdp_problem p = to_problem(P, GDP_DTYPE_BF16, variant_algo(var), 1);
    gdp_gdp_fwd_io f = fwd_io(P, d, false);
    gdp_gdp_bwd_io b = bwd_io(P, d, false);
    const int myreps = var == 1 ? std::max(2, reps / 10) : reps;
    for (int w = 0; w < 2; w++) {
      must(variant_forward(var, &p, &f), "forward");
      must(variant_backward(var, &p, &b), "backward");
    }
    CK(cudaDeviceSynchronize());
    vector<double> tf, tb, tfb;
    for (int i = 0; i < myreps; i++) {
      CK(cudaEventRecord(e0, 0));
      must(variant_forward(var, &p, &f), "forward");
      CK(cudaEventRecord(e1, 0));
      must(variant_backward(var, &p, &b), "backward");
      CK(cudaEventRecord(e2, 0));
      CK(cudaEventSynchronize(e2));
      tf.push_back(time_ms(e0, e1));
      tb.push_back(time_ms(e1, e2));
      tfb.push_back(time_ms(e0, e2));
    }
    CK(cudaGetLastError());
    const double mf = median(tf), mb = median(tb), mfb = median(tfb);
    printf("  %-9s fwd %8.3f ms   bwd %8.3f ms   fwd+bwd %8.3f ms\n", variant_name(var), mf, mb, mfb);
    if (getenv("GDP_CUDA_PROFILE")) {
      gdp_cuda_gdp_profile_dump(stdout, 1e30); /* clear warm-up/timed entries */
      must(variant_forward(var, &p, &f), "forward");
      must(variant_backward(var, &p, &b), "backward");
      printf("  %s per kernel (one profiled call, synchronised):\n", variant_name(var));
      gdp_cuda_gdp_profile_dump(stdout, 1.0);
    }
    if (js)
      fprintf(js,
              "{\"tool\":\"gdp_cuda_lab\",\"variant\":\"%s\",\"B\":%lld,\"T\":%lld,\"n\":%lld,\"H\":16,"
              "\"K\":128,\"V\":128,\"dtype\":\"bf16\",\"fwd_ms\":%.5f,\"bwd_ms\":%.5f,\"fwdbwd_ms\":%.5f,"
              "\"reps\":%d}\n",
              variant_name(var), (long long)B, (long long)T, (long long)n, mf, mb, mfb, myreps);
    Outputs got;
    gdp_gdp_fwd_io f2 = fwd_io(P, d, false);
    must(variant_forward(var, &p, &f2), "forward");
    must(variant_backward(var, &p, &b), "backward");
    CK(cudaDeviceSynchronize());
    download(d.o, P.T() * P.H * P.V, GDP_DTYPE_BF16, got.o);
    download(d.dq, P.T() * P.H * P.K, GDP_DTYPE_BF16, got.dq);
    download(d.dk, P.T() * n * P.H * P.K, GDP_DTYPE_BF16, got.dk);
    download(d.dv, P.T() * n * P.H * P.V, GDP_DTYPE_BF16, got.dv);
    download(d.dbeta, P.T() * n * P.H, GDP_DTYPE_BF16, got.dbeta);
    download(d.dg, P.T() * P.H, GDP_DTYPE_BF16, got.dg);
    outs.push_back(got);
  }
  for (size_t vi = 1; vi < outs.size(); vi++) {
    int fails = 0;
    vector<Named> items = {{"o", &outs[vi].o, &outs[0].o},       {"dq", &outs[vi].dq, &outs[0].dq},
                           {"dk", &outs[vi].dk, &outs[0].dk},    {"dv", &outs[vi].dv, &outs[0].dv},
                           {"dbeta", &outs[vi].dbeta, &outs[0].dbeta}, {"dg", &outs[vi].dg, &outs[0].dg}};
    char label[96];
    snprintf(label, sizeof label, "  %s vs %s at this size:", variant_name(variants[vi]), variant_name(variants[0]));
    compare_all(label, items, 1e-2, &fails);
  }
  if (js) fclose(js);
  return 0;
}

/* A small problem for compute-sanitizer (memcheck / racecheck). */
static int gpu_small(void) {
  Rng r(99);
  int fails = 0;
  Prob P = random_prob(r, 64, 64, 2, true, true);
  Inputs in;
  make_inputs(P, r, true, in);
  Outputs ref;
  reference(P, in, ref);
  DevProblem d;
  dev_inputs(P, in, GDP_DTYPE_BF16, d);
  for (int var : {1, 2}) {
    Outputs got;
    run_gpu(P, d, GDP_DTYPE_BF16, var, got);
    compare_all(variant_name(var), all_named(P, got, ref), 1e-2, &fails);
  }
  return fails ? 1 : 0;
}

static int gpu_main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s selftest | check [variants] | small | bench B T n [variants] [--reps R] [--json F]\n",
            argv[0]);
    return 2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, %d SMs, %.0f MB L2, smem/block optin %zu\n", prop.name, prop.multiProcessorCount,
         prop.l2CacheSize / 1e6, (size_t)prop.sharedMemPerBlockOptin);
  vector<int> variants;
  int reps = 20;
  const char *json = NULL;
  vector<int64_t> nums;
  for (int i = 2; i < argc; i++) {
    if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (argv[i][0] == 'v') variants.push_back(atoi(argv[i] + 1));
    else nums.push_back(atoll(argv[i]));
  }
  if (variants.empty()) variants = {1, 2};
  if (!strcmp(argv[1], "check")) return gpu_check(variants, nums.empty() ? 20261130 : nums[0], false);
  if (!strcmp(argv[1], "quick")) return gpu_check(variants, nums.empty() ? 20261130 : nums[0], true);
  if (!strcmp(argv[1], "small")) return gpu_small();
  if (!strcmp(argv[1], "bench") && nums.size() >= 3) return gpu_bench(nums[0], nums[1], nums[2], variants, reps, json);
  fprintf(stderr, "unknown command %s\n", argv[1]);
  return 2;
}
#endif

int main(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "selftest")) return selftest();
#ifndef GDP_LAB_CPU_ONLY
  return gpu_main(argc, argv);
#else
  fprintf(stderr, "usage: %s selftest (CPU-only build)\n", argv[0]);
  return 2;
#endif
}
