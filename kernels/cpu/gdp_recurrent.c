/*
 * gdp_recurrent.c -- the float64 oracle of the Gated DeltaProduct operator: the plain
 * token-by-token recurrence of docs/design.md section 2 and its hand-written backward.
 *
 * Kept simple on purpose: every other kernel (chunkwise CPU, CUDA) is validated
 * against it.  Per (sequence, head) the state S is K x V, key-major (S[r*V + c]).
 *
 * The backward needs S_{t,j}, the state before step j of token t.  Storing all of
 * them costs T*n*K*V doubles per (sequence, head), which is a gigabyte at T = 4096,
 * K = V = 128, n = 2; so the forward sweep keeps only a checkpoint every `seg` tokens
 * (seg ~ sqrt(T)) and the reverse sweep recomputes one segment's states at a time,
 * with exactly the same arithmetic as the forward (so the trajectory is identical).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gdp_cpu.h"
#include "../kernel_status.h"
#include "../size_check.h"

/* Tokens between two polls of the interrupt flag (gdp_interrupt_poll). */
enum { POLL_TOKENS = 64 };

/* Row offsets into the packed buffers (gdp_problem.h). */
static inline const double *row_q(const gdp_delta_product_problem *p, const double *q, int64_t t,
                                  int64_t h) {
  return q + (t * p->H + h) * p->K;
}
static inline int64_t step_row(const gdp_delta_product_problem *p, int64_t t, int64_t j, int64_t h) {
  return (t * p->n + j) * p->H + h;
}

/* The two pieces of the recurrence, shared by the forward and the backward's
 * recomputation so that both see bit-identical states. */
static void decay_state(int64_t KV, double decay, double *S) {
  for (int64_t i = 0; i < KV; i++) S[i] *= decay;
}

/* Householder step j of token t:  S <- S + k (beta (v - S^T k))^T.  u: V scratch. */
static void householder_step(const gdp_delta_product_problem *p, const double *k, const double *v,
                             const double *beta, int64_t t, int64_t j, int64_t h, double *S,
                             double *u) {
  const int64_t K = p->K, V = p->V;
  const int64_t row = step_row(p, t, j, h);
  const double *kj = k + row * K, *vj = v + row * V;
  const double b = beta[row];
  for (int64_t c = 0; c < V; c++) u[c] = 0.0;
  for (int64_t r = 0; r < K; r++) {
    const double kr = kj[r];
    const double *Sr = S + r * V;
    for (int64_t c = 0; c < V; c++) u[c] += Sr[c] * kr;
  }
  for (int64_t c = 0; c < V; c++) u[c] = b * (vj[c] - u[c]);
  for (int64_t r = 0; r < K; r++) {
    const double kr = kj[r];
    double *Sr = S + r * V;
    for (int64_t c = 0; c < V; c++) Sr[c] += kr * u[c];
  }
}

/* S <- exp(g_t) S, then the n Householder steps of token t. */
static void advance_token(const gdp_delta_product_problem *p, const double *k, const double *v,
                          const double *g, const double *beta, int64_t t, int64_t h,
                          double *S, double *u) {
  if (g) decay_state(p->K * p->V, exp(g[t * p->H + h]), S);
  for (int64_t j = 0; j < p->n; j++) householder_step(p, k, v, beta, t, j, h, S, u);
}

static void copy_or_zero(double *dst, const double *src, int64_t count) {
  if (src)
    memcpy(dst, src, (size_t)count * sizeof(double));
  else
    memset(dst, 0, (size_t)count * sizeof(double));
}

static int clamp_threads(int num_threads) { return num_threads < 1 ? 1 : num_threads; }

/* K*V states of doubles must be addressable before any K*V is formed. */
static gdp_status check_state_size(const char *fn, const gdp_delta_product_problem *p) {
  size_t bytes;
  if (!gdp_size_product(&bytes, p->K, p->V, sizeof(double)))
    return GDP_ERROR_IN(fn, GDP_ERR_INVALID_ARG, "a K x V state (K=%lld, V=%lld) overflows size_t",
                        (long long)p->K, (long long)p->V);
  return GDP_OK;
}

static gdp_status finish(const char *fn, int oom, const char *what, const gdp_delta_product_problem *p) {
  if (oom)
    return GDP_ERROR_IN(fn, GDP_ERR_OOM, "out of host memory (or its size overflows size_t) for %s "
                        "(K=%lld, V=%lld, n=%lld)", what, (long long)p->K, (long long)p->V,
                        (long long)p->n);
  if (gdp_interrupt_requested())
    return GDP_ERROR_IN(fn, GDP_ERR_INTERRUPTED, "interrupted (the interrupt flag was set: Ctrl-C)");
  return GDP_OK;
}

/* ------------------------------------------------------------------ forward */

gdp_status gdp_cpu_delta_product_forward_recurrent_f64(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io) {
  GDP_TRY(check_state_size("gdp_cpu_delta_product_forward_recurrent_f64", p));
  const int64_t H = p->H, K = p->K, V = p->V, KV = p->K * p->V;
  const double *q = io->q, *k = io->k, *v = io->v, *g = io->g, *beta = io->beta;
  const double *h0 = io->h0;
  double *o = io->o, *ht = io->ht;
  const int64_t items = p->N * H;
  int oom = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(clamp_threads(p->num_threads))
  for (int64_t item = 0; item < items; item++) {
    const int64_t s = item / H, h = item % H;
    size_t bytes;
    double *S = gdp_size_product(&bytes, K + 1, V, sizeof(double)) ? malloc(bytes) : NULL;
    if (!S) {
#pragma omp atomic write
      oom = 1;
      continue;
    }
    double *u = S + KV;
    copy_or_zero(S, h0 ? h0 + item * KV : NULL, KV);
    for (int64_t t = p->cu_seqlens[s]; t < p->cu_seqlens[s + 1]; t++) {
      if ((t - p->cu_seqlens[s]) % POLL_TOKENS == 0 && gdp_interrupt_poll()) break;
      advance_token(p, k, v, g, beta, t, h, S, u);
      /* o_t = scale S^T q_t */
      const double *qt = row_q(p, q, t, h);
      double *ot = o + (t * H + h) * V;
      for (int64_t c = 0; c < V; c++) ot[c] = 0.0;
      for (int64_t r = 0; r < K; r++) {
        const double qr = qt[r];
        const double *Sr = S + r * V;
        for (int64_t c = 0; c < V; c++) ot[c] += Sr[c] * qr;
      }
      for (int64_t c = 0; c < V; c++) ot[c] *= p->scale;
    }
    if (ht) memcpy(ht + item * KV, S, (size_t)KV * sizeof(double));
    free(S);
  }
  return finish("gdp_cpu_delta_product_forward_recurrent_f64", oom, "a state", p);
}

/* ------------------------------------------------------------------ backward */

/* Tokens per checkpoint segment for a sequence of L tokens: ~sqrt(L) balances the
 * checkpoints (L/seg states) against one segment's trajectory (seg*n+1 states). */
static int64_t segment_tokens(int64_t L) {
  int64_t seg = (int64_t)ceil(sqrt((double)L));
  return seg < 1 ? 1 : seg;
}

/* Backward of one (sequence s, head h).  Returns 0, or -1 when out of memory. */
static int backward_one(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, int64_t s,
                        int64_t h) {
  const int64_t H = p->H, K = p->K, V = p->V, KV = p->K * p->V, n = p->n;
  const double *q = io->q, *k = io->k, *v = io->v, *g = io->g, *beta = io->beta;
  const double *d_o = io->d_o;
  double *dq = io->dq, *dk = io->dk, *dv = io->dv, *dbeta = io->dbeta, *dg = io->dg;
  const int64_t item = s * H + h;
  const int64_t bos = p->cu_seqlens[s], L = p->cu_seqlens[s + 1] - bos;
  const int64_t seg = segment_tokens(L);
  const int64_t nseg = (L + seg - 1) / seg;

  /* dS, S_{t,0} scratch, checkpoints, one segment's trajectory, two V vectors. */
  size_t count = 0, bytes = 0;
  const int fits = gdp_size_mac(&count, (size_t)KV, (size_t)(2 + nseg + seg * n + 1), 1) &&
                   gdp_size_mac(&count, 2, (size_t)V, 1) && gdp_size_mac(&bytes, count, sizeof(double), 1);
  double *buf = fits ? malloc(bytes) : NULL;
  if (!buf) return -1;
  double *dS = buf, *S0 = dS + KV, *ckpt = S0 + KV, *traj = ckpt + nseg * KV;
  double *u = traj + (seg * n + 1) * KV, *dd = u + V;

  /* Forward sweep: ckpt[m] = state before token m*seg (S_{-1} = h0 for m = 0). */
  copy_or_zero(S0, io->h0 ? (const double *)io->h0 + item * KV : NULL, KV);
  for (int64_t m = 0; m < nseg; m++) {
    memcpy(ckpt + m * KV, S0, (size_t)KV * sizeof(double));
    if (m + 1 == nseg) break; /* the last segment's end state is never needed */
    for (int64_t t = m * seg; t < (m + 1) * seg; t++)
      advance_token(p, k, v, g, beta, bos + t, h, S0, u);
  }

  copy_or_zero(dS, io->dht ? (const double *)io->dht + item * KV : NULL, KV);

  for (int64_t m = nseg - 1; m >= 0; m--) {
    if (gdp_interrupt_poll()) break; /* per segment of ~sqrt(L) tokens; finish reports it */
    const int64_t t0 = m * seg, t1 = (m + 1) * seg < L ? (m + 1) * seg : L;
    /* traj[(t-t0)*n + j + 1] = state after step j of token t; traj[0] = S_{t0-1}. */
    memcpy(traj, ckpt + m * KV, (size_t)KV * sizeof(double));
    for (int64_t t = t0; t < t1; t++) {
      for (int64_t j = 0; j < n; j++) {
        const double *prev = traj + ((t - t0) * n + j) * KV;
        double *next = traj + ((t - t0) * n + j + 1) * KV;
        memcpy(next, prev, (size_t)KV * sizeof(double));
        if (j == 0 && g) decay_state(KV, exp(g[(bos + t) * H + h]), next);
        householder_step(p, k, v, beta, bos + t, j, h, next, u);
      }
    }

    for (int64_t t = t1 - 1; t >= t0; t--) {
      const int64_t tg = bos + t;
      const double *S_prev = traj + ((t - t0) * n) * KV; /* S_{t-1} */
      const double *S_last = traj + ((t - t0) * n + n) * KV; /* S_{t,n} = S_t */
      const double decay = g ? exp(g[tg * H + h]) : 1.0;

      /* o_t = scale S_t^T q_t:  dS += scale q dO^T,  dq = scale S_t dO. */
      const double *qt = row_q(p, q, tg, h);
      const double *dot = d_o + (tg * H + h) * V;
      double *dqt = dq + (tg * H + h) * K;
      for (int64_t r = 0; r < K; r++) {
        const double *Sr = S_last + r * V;
        double *dSr = dS + r * V;
        const double sq = p->scale * qt[r];
        double acc = 0.0;
        for (int64_t c = 0; c < V; c++) {
          acc += Sr[c] * dot[c];
          dSr[c] += sq * dot[c];
        }
        dqt[r] = p->scale * acc;
      }

      for (int64_t j = n - 1; j >= 0; j--) {
        const int64_t row = step_row(p, tg, j, h);
        const double *kj = k + row * K, *vj = v + row * V;
        const double b = beta[row];
        /* S_{t,j}: the state before step j (for j = 0: the decayed S_{t-1}). */
        const double *Sj;
        if (j > 0) {
          Sj = traj + ((t - t0) * n + j) * KV;
        } else {
          for (int64_t i = 0; i < KV; i++) S0[i] = decay * S_prev[i];
          Sj = S0;
        }
        /* u = Sj^T k (kept in u as v - u), dd = dS^T k */
        for (int64_t c = 0; c < V; c++) u[c] = 0.0, dd[c] = 0.0;
        for (int64_t r = 0; r < K; r++) {
          const double kr = kj[r];
          const double *Sr = Sj + r * V, *dSr = dS + r * V;
          for (int64_t c = 0; c < V; c++) {
            u[c] += Sr[c] * kr;
            dd[c] += dSr[c] * kr;
          }
        }
        double db = 0.0;
        for (int64_t c = 0; c < V; c++) {
          u[c] = vj[c] - u[c]; /* v - u */
          db += dd[c] * u[c];
        }
        dbeta[row] = db;
        double *dvj = dv + row * V;
        for (int64_t c = 0; c < V; c++) dvj[c] = b * dd[c];
        /* dk = dS delta + Sj du, delta = b (v - u), du = -b dd */
        double *dkj = dk + row * K;
        for (int64_t r = 0; r < K; r++) {
          const double *Sr = Sj + r * V, *dSr = dS + r * V;
          double acc = 0.0;
          for (int64_t c = 0; c < V; c++) acc += dSr[c] * (b * u[c]) - Sr[c] * (b * dd[c]);
          dkj[r] = acc;
        }
        /* dS += k du^T */
        for (int64_t r = 0; r < K; r++) {
          const double kr = kj[r];
          double *dSr = dS + r * V;
          for (int64_t c = 0; c < V; c++) dSr[c] -= kr * (b * dd[c]);
        }
      }

      /* S_{t,0} = exp(g_t) S_{t-1}:  dg_t = exp(g_t) <dS, S_{t-1}>,  dS = exp(g_t) dS. */
      if (g) {
        double acc = 0.0;
        for (int64_t i = 0; i < KV; i++) acc += dS[i] * S_prev[i];
        dg[tg * H + h] = decay * acc;
        for (int64_t i = 0; i < KV; i++) dS[i] *= decay;
      }
    }
  }

  if (io->dh0) memcpy((double *)io->dh0 + item * KV, dS, (size_t)KV * sizeof(double));
  free(buf);
  return 0;
}

gdp_status gdp_cpu_delta_product_backward_recurrent_f64(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io) {
  GDP_TRY(check_state_size("gdp_cpu_delta_product_backward_recurrent_f64", p));
  const int64_t items = p->N * p->H;
  int oom = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(clamp_threads(p->num_threads))
  for (int64_t item = 0; item < items; item++) {
    if (backward_one(p, io, item / p->H, item % p->H) != 0) {
#pragma omp atomic write
      oom = 1;
    }
  }
  return finish("gdp_cpu_delta_product_backward_recurrent_f64", oom, "the backward's checkpoints", p);
}
