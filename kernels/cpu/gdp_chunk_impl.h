/*
 * gdp_chunk_impl.h -- the chunkwise WY algorithm of the Gated DeltaProduct operator,
 * forward and backward, written once and instantiated for double (gdp_chunk_f64.c) and
 * float (gdp_chunk_f32.c).  The derivation, the buffer layouts and measured timings are
 * in docs/kernels.md section 9; the comments here say what each block computes.
 *
 * The includer defines:
 *   CK_REAL            double or float
 *   CK_SFX             f64 or f32 (suffix of the public names)
 *   CK_GEMM, CK_SYRK, CK_TRSM    cblas_dgemm / cblas_sgemm ...
 *   CK_EXP             exp or expf
 *
 * Per (sequence, head) the recurrence runs over the expanded stream of L = T*n steps,
 * step i = t*n + j has log-decay g_t when j == 0 (else 0), and a query when j == n-1.
 * A chunk covers c <= C consecutive steps of one sequence.  Inside a chunk, with S0
 * the state before it, G_r the inclusive cumulative log-decay and Gam_rs = e^(G_r-G_s):
 *
 *   A     = strictly-lower(diag(b) (K K^T o Gam))         M = I + A
 *   Delta = M^-1 diag(b) (V - diag(e^G) K S0)             ("V_new" = U - W S0)
 *   O     = scale ( diag(e^G) Q S0 + (Q K^T o Gam o causal) Delta )   query rows only
 *   S_end = e^(G_last) S0 + (diag(e^(G_last - G)) K)^T Delta
 */
#ifndef CK_REAL
#error "define CK_REAL, CK_SFX, CK_GEMM, CK_SYRK, CK_TRSM and CK_EXP before including"
#endif

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <omp.h>

#include "gdp_cpu.h"
#include "../kernel_status.h"
#include "../size_check.h"

#define CK_CAT2(a, b) a##_##b
#define CK_CAT(a, b) CK_CAT2(a, b)
#define CK_PUBLIC(name) CK_CAT(name, CK_SFX)
#define CK_STR2(x) #x
#define CK_STR(x) CK_STR2(x)

typedef CK_REAL real;

/* ------------------------------------------------------------------ geometry */

/* Sizes shared by every chunk of one call. */
typedef struct ck_dims {
  int64_t H, K, V, n;
  int64_t C;    /* chunk size in steps */
  int64_t mmax; /* most query rows a chunk can hold: ceil(C / n) */
  int64_t ldk, ldv; /* row strides of k/q and v/o in the packed buffers: H*K, H*V */
  real scale;
} ck_dims;

/* One chunk of one (sequence, head). */
typedef struct ck_chunk {
  int64_t step0; /* global row of the chunk's first step in k/v/beta: bos*n + i0 */
  int64_t i0;    /* step index of that row inside its sequence */
  int64_t c;     /* steps in this chunk, 1..C */
  int64_t r0;    /* chunk row of the first query (valid when m > 0) */
  int64_t m;     /* query rows in this chunk */
  int64_t tq0;   /* global token of the first query row */
  int64_t bos;   /* global token where the sequence starts */
} ck_chunk;

static ck_dims ck_dims_of(const gdp_delta_product_problem *p) {
  ck_dims d;
  d.H = p->H;
  d.K = p->K;
  d.V = p->V;
  d.n = p->n;
  d.C = p->chunk_size > 0 ? p->chunk_size : GDP_DEFAULT_CHUNK; /* 0: the CPU's own */
  /* No chunk holds more steps than the longest sequence, and the workspaces grow with
   * C^2: clamp, so that a chunk_size beyond every sequence neither allocates for steps
   * that never come nor overflows size_t.  Chunk boundaries are unchanged (each
   * sequence is then one chunk either way). */
  int64_t longest = 1;
  for (int64_t s = 0; s < p->N; s++) {
    const int64_t L = (p->cu_seqlens[s + 1] - p->cu_seqlens[s]) * p->n;
    if (L > longest) longest = L;
  }
  if (d.C > longest) d.C = longest;
  d.mmax = (d.C + d.n - 1) / d.n;
  d.ldk = p->H * p->K;
  d.ldv = p->H * p->V;
  d.scale = (real)p->scale;
  return d;
}

static ck_chunk ck_chunk_at(const ck_dims *d, int64_t bos, int64_t L, int64_t i0) {
  ck_chunk ch;
  const int64_t n = d->n;
  ch.bos = bos;
  ch.i0 = i0;
  ch.step0 = bos * n + i0;
  ch.c = L - i0 < d->C ? L - i0 : d->C;
  /* rows r with (i0 + r) % n == n - 1 hold the queries */
  ch.r0 = (n - 1) - (i0 % n);
  ch.m = ch.r0 < ch.c ? (ch.c - 1 - ch.r0) / n + 1 : 0;
  ch.tq0 = bos + (i0 + ch.r0) / n;
  return ch;
}

/* Cumulative log-decays of the chunk: G[r] = sum of the step log-decays of rows 0..r
 * (g_t on a token's step 0, else 0), eG[r] = e^G[r].  All zeros when ungated. */
static void ck_decays(const ck_dims *d, const ck_chunk *ch, const real *g, int64_t h, real *G,
                      real *eG) {
  real acc = 0;
  for (int64_t r = 0; r < ch->c; r++) {
    const int64_t i = ch->i0 + r;
    if (g && i % d->n == 0) acc += g[(ch->bos + i / d->n) * d->H + h];
    G[r] = acc;
    eG[r] = g ? CK_EXP(acc) : (real)1;
  }
}

/* gam[s] = e^(G[r] - G[s]) for s = 0..last.  Only differences of cumulative decays
 * within one chunk are exponentiated, never e^(-G) alone, so nothing overflows.  G is
 * constant over the n steps of a token, so one exp serves a whole run of equal values. */
static void ck_gamma_row(const real *G, int64_t r, int64_t last, real *gam) {
  real prev = 0, e = 1;
  int have = 0;
  for (int64_t s = last; s >= 0; s--) {
    if (!have || G[s] != prev) {
      prev = G[s];
      e = CK_EXP(G[r] - prev);
      have = 1;
    }
    gam[s] = e;
  }
}

/* A dot product with CK_LANES independent partial sums, which the compiler turns into
 * vector FMAs; a plain loop keeps the sum in order, one dependent add after another. */
enum { CK_LANES = 16 };
static inline real ck_dot(int64_t len, const real *a, const real *b) {
  real part[CK_LANES] = {0};
  int64_t i = 0;
  for (; i + CK_LANES <= len; i += CK_LANES)
    for (int l = 0; l < CK_LANES; l++) part[l] += a[i + l] * b[i + l];
  real acc = 0;
  for (; i < len; i++) acc += a[i] * b[i];
  for (int l = 0; l < CK_LANES; l++) acc += part[l];
  return acc;
}

/* The same in double partial sums, for a long dot whose terms cancel (dS . S0, K V terms,
 * into the log-decay gradients). */
static inline double ck_dot64(int64_t len, const real *a, const real *b) {
  double part[CK_LANES] = {0};
  int64_t i = 0;
  for (; i + CK_LANES <= len; i += CK_LANES)
    for (int l = 0; l < CK_LANES; l++) part[l] += (double)a[i + l] * (double)b[i + l];
  double acc = 0;
  for (; i < len; i++) acc += (double)a[i] * (double)b[i];
  for (int l = 0; l < CK_LANES; l++) acc += part[l];
  return acc;
}

/* ------------------------------------------------------------------ triangular solves */

/* X (c x ncol, ld ldx) <- (I + A)^-1 X, or (I + A)^-T X when `transposed`, for A strictly
 * lower (ld lda).  OpenBLAS's trsm is slow at these sizes (about a third of its GEMM
 * rate at 64 x 128), so the columns that fill whole vectors are done here by row
 * substitution with CK_NVEC vector accumulators per row held in registers (GNU vector
 * extensions: any target, widest vectors the compiler is allowed), and only the
 * remaining ragged columns go to trsm. */
typedef real ck_vec __attribute__((vector_size(64)));
enum { CK_VLEN = (int)(sizeof(ck_vec) / sizeof(real)), CK_NVEC = 4 };

/* Unaligned vector load/store as macros: passing vectors wider than the enabled ISA
 * through functions changes the ABI (GCC warns with -Wpsabi). */
#define CK_VLOAD(dst, ptr) memcpy(&(dst), (ptr), sizeof(ck_vec))
#define CK_VSTORE(ptr, src) memcpy((ptr), &(src), sizeof(ck_vec))

static void ck_solve_unit(int transposed, int64_t c, int64_t ncol, const real *A, int64_t lda,
                          real *X, int64_t ldx) {
  int64_t x0 = 0;
  for (; x0 + CK_NVEC * CK_VLEN <= ncol; x0 += CK_NVEC * CK_VLEN) {
    for (int64_t i = 0; i < c; i++) {
      const int64_t r = transposed ? c - 1 - i : i;
      const int64_t s_begin = transposed ? r + 1 : 0, s_end = transposed ? c : r;
      real *xr = X + r * ldx + x0;
      ck_vec a0, a1, a2, a3, t0, t1, t2, t3;
      CK_VLOAD(a0, xr);
      CK_VLOAD(a1, xr + CK_VLEN);
      CK_VLOAD(a2, xr + 2 * CK_VLEN);
      CK_VLOAD(a3, xr + 3 * CK_VLEN);
      for (int64_t s = s_begin; s < s_end; s++) {
        const real a = transposed ? A[s * lda + r] : A[r * lda + s];
        const real *xs = X + s * ldx + x0;
        CK_VLOAD(t0, xs);
        CK_VLOAD(t1, xs + CK_VLEN);
        CK_VLOAD(t2, xs + 2 * CK_VLEN);
        CK_VLOAD(t3, xs + 3 * CK_VLEN);
        a0 -= a * t0;
        a1 -= a * t1;
        a2 -= a * t2;
        a3 -= a * t3;
      }
      CK_VSTORE(xr, a0);
      CK_VSTORE(xr + CK_VLEN, a1);
      CK_VSTORE(xr + 2 * CK_VLEN, a2);
      CK_VSTORE(xr + 3 * CK_VLEN, a3);
    }
  }
  for (; x0 + CK_VLEN <= ncol; x0 += CK_VLEN) {
    for (int64_t i = 0; i < c; i++) {
      const int64_t r = transposed ? c - 1 - i : i;
      const int64_t s_begin = transposed ? r + 1 : 0, s_end = transposed ? c : r;
      real *xr = X + r * ldx + x0;
      ck_vec a0, t0;
      CK_VLOAD(a0, xr);
      for (int64_t s = s_begin; s < s_end; s++) {
        CK_VLOAD(t0, X + s * ldx + x0);
        a0 -= (transposed ? A[s * lda + r] : A[r * lda + s]) * t0;
      }
      CK_VSTORE(xr, a0);
    }
  }
  if (x0 < ncol)
    CK_TRSM(CblasRowMajor, CblasLeft, CblasLower, transposed ? CblasTrans : CblasNoTrans,
            CblasUnit, (int)c, (int)(ncol - x0), 1, A, (int)lda, X + x0, (int)ldx);
}

/* ------------------------------------------------------------------ chunk pieces */

/* KKG (ld C, strictly lower) = K K^T o Gam for the chunk; Mt (ld C) = diag(b) KKG, the
 * A of M = I + A.  KKG may alias Mt when the caller needs only A. */
static void ck_build_A(const ck_dims *d, const ck_chunk *ch, const real *kc, const real *bc,
                       const real *G, real *KKG, real *Mt, real *gam) {
  const int64_t c = ch->c, C = d->C;
  if (c > 1) CK_SYRK(CblasRowMajor, CblasLower, CblasNoTrans, (int)c, (int)d->K, 1, kc,
                     (int)d->ldk, 0, KKG, (int)C);
  for (int64_t r = 1; r < c; r++) {
    ck_gamma_row(G, r, r - 1, gam);
    real *kr = KKG + r * C, *mr = Mt + r * C;
    const real b = bc[r * d->H];
    for (int64_t s = 0; s < r; s++) {
      const real x = kr[s] * gam[s];
      kr[s] = x;
      mr[s] = b * x;
    }
  }
}

/* Delta (c x V, ld V) = M^-1 diag(b) (V - diag(e^G) K S0).  Kb: c x K scratch.  S0 is
 * skipped when known to be zero (first chunk without h0). */
static void ck_solve_delta(const ck_dims *d, const ck_chunk *ch, const real *kc, const real *vc,
                           const real *bc, const real *eG, const real *Mt, const real *S0,
                           int s0_zero, real *Delta, real *Kb) {
  const int64_t c = ch->c, K = d->K, V = d->V;
  for (int64_t r = 0; r < c; r++) {
    const real b = bc[r * d->H];
    const real *vr = vc + r * d->ldv;
    real *dr = Delta + r * V;
    for (int64_t x = 0; x < V; x++) dr[x] = b * vr[x];
  }
  if (!s0_zero) {
    for (int64_t r = 0; r < c; r++) {
      const real s = bc[r * d->H] * eG[r];
      const real *kr = kc + r * d->ldk;
      real *br = Kb + r * K;
      for (int64_t x = 0; x < K; x++) br[x] = s * kr[x];
    }
    CK_GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)c, (int)V, (int)K, -1, Kb, (int)K,
            S0, (int)V, 1, Delta, (int)V);
  }
  if (c > 1) ck_solve_unit(0, c, V, Mt, d->C, Delta, V);
}

/* Snext (K x V) = e^(G_last) S0 + (diag(e^(G_last - G)) K)^T Delta.  Snext may be S0
 * (in place); otherwise it is overwritten.  Kd: c x K scratch. */
static void ck_advance_state(const ck_dims *d, const ck_chunk *ch, const real *kc, const real *G,
                             const real *eG, const real *Delta, const real *S0, real *Snext,
                             real *Kd) {
  const int64_t c = ch->c, K = d->K, V = d->V;
  const real Gl = G[c - 1];
  for (int64_t r = 0; r < c; r++) {
    const real s = CK_EXP(Gl - G[r]);
    const real *kr = kc + r * d->ldk;
    real *out = Kd + r * K;
    for (int64_t x = 0; x < K; x++) out[x] = s * kr[x];
  }
  if (Snext != S0) memcpy(Snext, S0, (size_t)(K * V) * sizeof(real));
  CK_GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)K, (int)V, (int)c, 1, Kd, (int)K, Delta,
          (int)V, eG[c - 1], Snext, (int)V);
}

/* ------------------------------------------------------------------ workspaces */

static int64_t ck_max_chunks(const gdp_delta_product_problem *p, int64_t C) {
  int64_t most = 0;
  for (int64_t s = 0; s < p->N; s++) {
    const int64_t L = (p->cu_seqlens[s + 1] - p->cu_seqlens[s]) * p->n;
    const int64_t nc = (L + C - 1) / C;
    if (nc > most) most = nc;
  }
  return most;
}

static int ck_threads(const gdp_delta_product_problem *p, int64_t items) {
  int t = p->num_threads < 1 ? 1 : p->num_threads;
  if (items < t) t = items < 1 ? 1 : (int)items;
  return t;
}

/* BLAS threads inside the workers: 1 when there are several workers (OpenBLAS's pthread
 * pool serialises concurrent multi-threaded calls), else all of num_threads.  Returns
 * the previous setting for ck_blas_threads_leave. */
static int ck_blas_threads_enter(const gdp_delta_product_problem *p, int workers) {
  const int prev = openblas_get_num_threads();
  const int want = workers > 1 || p->num_threads < 1 ? 1 : p->num_threads;
  if (want != prev) openblas_set_num_threads(want);
  return prev;
}
static void ck_blas_threads_leave(int prev) {
  if (openblas_get_num_threads() != prev) openblas_set_num_threads(prev);
}

static gdp_status ck_check(const gdp_delta_product_problem *p, const char *fn) {
  if (p->H < 1 || p->K < 1 || p->V < 1 || p->n < 1)
    return GDP_ERROR_IN(fn, GDP_ERR_INVALID_ARG,
                        "sizes must be positive, got H=%lld K=%lld V=%lld n=%lld",
                        (long long)p->H, (long long)p->K, (long long)p->V, (long long)p->n);
  if (p->N < 0 || !p->cu_seqlens)
    return GDP_ERROR_IN(fn, GDP_ERR_INVALID_ARG, "cu_seqlens must be given for N=%lld sequences",
                        (long long)p->N);
  return GDP_OK;
}

/* Every BLAS dimension and leading dimension of the kernels is at most C + mmax + K,
 * H*K or H*V (ck_dims): all must fit an int. */
static gdp_status ck_check_blas_dims(const ck_dims *d, const char *fn) {
  if (!gdp_blas_int_ok(d->C + d->mmax + d->K) || !gdp_blas_int_ok(d->ldk) || !gdp_blas_int_ok(d->ldv))
    return GDP_ERROR_IN(fn, GDP_ERR_INVALID_ARG,
                        "sizes beyond BLAS's int (%d): chunk %lld + query rows %lld + K %lld, "
                        "H*K = %lld and H*V = %lld must each be at most that", INT_MAX,
                        (long long)d->C, (long long)d->mmax, (long long)d->K, (long long)d->ldk,
                        (long long)d->ldv);
  return GDP_OK;
}

/* No token at all: only the states pass through (dst = src, or zeros without src), and
 * no workspace is allocated. */
static void ck_states_only(const gdp_delta_product_problem *p, const real *src, real *dst) {
  if (!dst) return;
  const size_t bytes = (size_t)(p->N * p->H * p->K * p->V) * sizeof(real); /* dst exists */
  if (src)
    memcpy(dst, src, bytes);
  else
    memset(dst, 0, bytes);
}

/* ws = per-thread count * threads, in bytes, or an error naming the sizes. */
static gdp_status ck_ws_bytes(const char *fn, size_t per, int nt, const ck_dims *d, size_t *bytes) {
  *bytes = 0;
  if (per == 0 || !gdp_size_mac(bytes, per, (size_t)nt, sizeof(real)))
    return GDP_ERROR_IN(fn, GDP_ERR_INVALID_ARG,
                        "the workspace size overflows size_t (chunk %lld steps, K=%lld, V=%lld, "
                        "%d threads): use a smaller chunk_size", (long long)d->C, (long long)d->K,
                        (long long)d->V, nt);
  return GDP_OK;
}

/* After the workers: the status of a run the interrupt flag may have stopped. */
static gdp_status ck_finish(const char *fn) {
  if (gdp_interrupt_requested())
    return GDP_ERROR_IN(fn, GDP_ERR_INTERRUPTED, "interrupted (the interrupt flag was set: Ctrl-C)");
  return GDP_OK;
}

/* ------------------------------------------------------------------ forward */

/* Per-thread forward workspace: [Delta ; S] stacked so that one GEMM reads both. */
typedef struct ck_fwd_ws {
  real *DS;  /* (C + K) x V: Delta in rows C-c .. C-1, S in rows C .. C+K-1 */
  real *Mt;  /* C x C */
  real *Qg;  /* mmax x (C + K): [Q K^T o Gam o causal | diag(e^G) Q] */
  real *Kb;  /* C x K */
  real *G, *eG, *gam; /* C each */
} ck_fwd_ws;

/* Elements of one forward workspace; 0 when the count overflows size_t. */
static size_t ck_fwd_ws_count(const ck_dims *d) {
  const size_t C = (size_t)d->C, K = (size_t)d->K, V = (size_t)d->V, m = (size_t)d->mmax;
  size_t n = 0;
  const int ok = gdp_size_mac(&n, C + K, V, 1) && gdp_size_mac(&n, C, C, 1) &&
                 gdp_size_mac(&n, m, C + K, 1) && gdp_size_mac(&n, C, K, 1) && gdp_size_mac(&n, 3, C, 1);
  return ok ? n : 0;
}

static void ck_fwd_ws_carve(const ck_dims *d, real *base, ck_fwd_ws *w) {
  const int64_t C = d->C, K = d->K, V = d->V;
  w->DS = base;
  w->Mt = w->DS + (C + K) * V;
  w->Qg = w->Mt + C * C;
  w->Kb = w->Qg + d->mmax * (C + K);
  w->G = w->Kb + C * K;
  w->eG = w->G + C;
  w->gam = w->eG + C;
}

static void ck_forward_pair(const ck_dims *d, const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                            int64_t s, int64_t h, ck_fwd_ws *w) {
  const real *q = io->q, *k = io->k, *v = io->v, *g = io->g, *beta = io->beta;
  const real *h0 = io->h0;
  real *o = io->o, *ht = io->ht;
  const int64_t K = d->K, V = d->V, C = d->C, KV = K * V, n = d->n;
  const int64_t item = s * d->H + h;
  const int64_t bos = p->cu_seqlens[s], L = (p->cu_seqlens[s + 1] - bos) * n;
  real *S = w->DS + C * V;
  int s_zero = h0 == NULL;
  if (h0)
    memcpy(S, h0 + item * KV, (size_t)KV * sizeof(real));
  else
    memset(S, 0, (size_t)KV * sizeof(real));

  for (int64_t i0 = 0; i0 < L; i0 += C) {
    if (gdp_interrupt_poll()) return; /* ck_finish reports it */
    const ck_chunk ch = ck_chunk_at(d, bos, L, i0);
    const int64_t c = ch.c, m = ch.m;
    const real *kc = k + ch.step0 * d->ldk + h * K;
    const real *vc = v + ch.step0 * d->ldv + h * V;
    const real *bc = beta + ch.step0 * d->H + h;
    real *Delta = w->DS + (C - c) * V; /* ends right where S begins */

    ck_decays(d, &ch, g, h, w->G, w->eG);
    ck_build_A(d, &ch, kc, bc, w->G, w->Mt, w->Mt, w->gam);
    ck_solve_delta(d, &ch, kc, vc, bc, w->eG, w->Mt, S, s_zero, Delta, w->Kb);

    /* O = scale [Q K^T o Gam o causal | diag(e^G) Q] [Delta ; S], query rows only. */
    if (m > 0) {
      const int64_t ldq = C + K;
      const real *qc = q + ch.tq0 * d->ldk + h * K;
      CK_GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)c, (int)K, 1, qc,
              (int)d->ldk, kc, (int)d->ldk, 0, w->Qg, (int)ldq);
      for (int64_t j = 0; j < m; j++) {
        const int64_t r = ch.r0 + j * n;
        real *row = w->Qg + j * ldq;
        ck_gamma_row(w->G, r, r, w->gam);
        for (int64_t x = 0; x <= r; x++) row[x] *= w->gam[x];
        for (int64_t x = r + 1; x < c; x++) row[x] = 0;
        const real e = w->eG[r];
        const real *qj = qc + j * d->ldk;
        for (int64_t x = 0; x < K; x++) row[c + x] = e * qj[x];
      }
      /* With S = 0 only the in-chunk term remains. */
      CK_GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)V,
              (int)(s_zero ? c : c + K), d->scale, w->Qg, (int)ldq, Delta, (int)V, 0,
              o + ch.tq0 * d->ldv + h * V, (int)d->ldv);
    }

    ck_advance_state(d, &ch, kc, w->G, w->eG, Delta, S, S, w->Kb);
    s_zero = 0;
  }
  if (ht) memcpy(ht + item * KV, S, (size_t)KV * sizeof(real));
}

gdp_status CK_PUBLIC(gdp_cpu_delta_product_forward_chunk)(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io) {
  static const char *const fn = "gdp_cpu_delta_product_forward_chunk_" CK_STR(CK_SFX);
  GDP_TRY(ck_check(p, fn));
  const int64_t items = p->N * p->H;
  if (items == 0) return GDP_OK;
  if (p->cu_seqlens[p->N] == p->cu_seqlens[0]) {
    ck_states_only(p, io->h0, io->ht);
    return GDP_OK;
  }
  const ck_dims d = ck_dims_of(p);
  GDP_TRY(ck_check_blas_dims(&d, fn));
  const int nt = ck_threads(p, items);
  const size_t per = ck_fwd_ws_count(&d);
  size_t bytes;
  GDP_TRY(ck_ws_bytes(fn, per, nt, &d, &bytes));
  real *ws = malloc(bytes);
  if (!ws)
    return GDP_ERROR_IN(fn, GDP_ERR_OOM, "out of host memory for %d workspaces of %zu bytes",
                        nt, per * sizeof(real));

  /* One thread per (sequence, head) pair, BLAS single-threaded inside so that the two
   * pools do not oversubscribe the cores; a single pair gets BLAS's threads instead.
   * Restored afterwards. */
  const int prev_blas = ck_blas_threads_enter(p, nt);
#pragma omp parallel num_threads(nt)
  {
    ck_fwd_ws w;
    ck_fwd_ws_carve(&d, ws + per * (size_t)omp_get_thread_num(), &w);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++)
      ck_forward_pair(&d, p, io, item / p->H, item % p->H, &w);
  }
  ck_blas_threads_leave(prev_blas);
  free(ws);
  return ck_finish(fn);
}

/* ------------------------------------------------------------------ backward */

/* Per-thread backward workspace.
 *   store: per chunk b, at b*(C+K)*V: [Delta (c rows) ; S0 (K rows)] x V, contiguous so
 *          that one GEMM multiplies by both; and KKG (C x C) at b*C*C of kstore.
 *   BV:    (C + mmax + K) x V, [dR (c) ; dO (m) ; dS (K)] with dS at the fixed row
 *          C+mmax and the other two packed right before it.
 */
typedef struct ck_bwd_ws {
  real *store, *kstore;
  real *BV;
  real *Gam, *Am;      /* C x C */
  real *RES;           /* (C + mmax) x (C + K) */
  real *L1;            /* C x (mmax + K): [scale P^T | diag(e^(Gl-G)) K] */
  real *L2;            /* C x (C + mmax): [E + E^T | dPs^T] */
  real *KQ;            /* (C + mmax) x K: [K ; Q] */
  real *L3;            /* (C + mmax) x K: [-diag(b e^G) K ; scale diag(e^G) Q] */
  real *Zb;            /* C x K */
  real *PQ;            /* mmax x C */
  real *G, *eG, *kY, *gam; /* C each */
  double *dGc;              /* C: the log-decay gradients, in double in both precisions */
} ck_bwd_ws;

/* Elements of one backward workspace; 0 when the count overflows size_t. */
static size_t ck_bwd_ws_count(const ck_dims *d, int64_t max_chunks) {
  const size_t C = (size_t)d->C, K = (size_t)d->K, V = (size_t)d->V, m = (size_t)d->mmax;
  const size_t nb = (size_t)(max_chunks > 0 ? max_chunks : 1);
  size_t n = 0;
  const int ok = gdp_size_mac(&n, nb, C + K, V) && gdp_size_mac(&n, nb, C, C) &&
                 gdp_size_mac(&n, C + m + K, V, 1) && gdp_size_mac(&n, 2, C, C) &&
                 gdp_size_mac(&n, C + m, C + K, 1) && gdp_size_mac(&n, C, m + K, 1) &&
                 gdp_size_mac(&n, C, C + m, 1) && gdp_size_mac(&n, 2, C + m, K) &&
                 gdp_size_mac(&n, C, K, 1) && gdp_size_mac(&n, m, C, 1) && gdp_size_mac(&n, 4, C, 1) &&
                 /* dGc, and room to align it */
                 gdp_size_mac(&n, C + 1, sizeof(double) / sizeof(real), 1);
  return ok ? n : 0;
}

static void ck_bwd_ws_carve(const ck_dims *d, int64_t max_chunks, real *base, ck_bwd_ws *w) {
  const int64_t C = d->C, K = d->K, V = d->V, m = d->mmax;
  const int64_t nb = max_chunks > 0 ? max_chunks : 1;
  w->store = base;
  w->kstore = w->store + nb * (C + K) * V;
  w->BV = w->kstore + nb * C * C;
  w->Gam = w->BV + (C + m + K) * V;
  w->Am = w->Gam + C * C;
  w->RES = w->Am + C * C;
  w->L1 = w->RES + (C + m) * (C + K);
  w->L2 = w->L1 + C * (m + K);
  w->KQ = w->L2 + C * (C + m);
  w->L3 = w->KQ + (C + m) * K;
  w->Zb = w->L3 + (C + m) * K;
  w->PQ = w->Zb + C * K;
  w->G = w->PQ + m * C;
  w->eG = w->G + C;
  w->kY = w->eG + C;
  w->gam = w->kY + C;
  const uintptr_t end = (uintptr_t)(w->gam + C), al = sizeof(double);
  w->dGc = (double *)((end + al - 1) / al * al);
}

/* Backward through one chunk.  On entry dS (in BV) is the gradient of the state after
 * the chunk; on exit, of the state before it.  Writes dq (query rows), dk, dv, dbeta of
 * the chunk's steps and dg of the tokens whose step 0 lies in it. */
static void ck_backward_chunk(const ck_dims *d, const gdp_delta_product_backward_io *io, const ck_chunk *ch,
                              int64_t h, const real *DSst, const real *KKG, ck_bwd_ws *w) {
  const real *q = io->q, *k = io->k, *v = io->v, *g = io->g, *beta = io->beta;
  const real *d_o = io->d_o;
  real *dq = io->dq, *dk = io->dk, *dv = io->dv, *dbeta = io->dbeta, *dg = io->dg;
  const int64_t K = d->K, V = d->V, C = d->C, n = d->n, H = d->H;
  const int64_t c = ch->c, m = ch->m, r0 = ch->r0;
  const real scale = d->scale;
  const real *kc = k + ch->step0 * d->ldk + h * K;
  const real *vc = v + ch->step0 * d->ldv + h * V;
  const real *bc = beta + ch->step0 * H + h;
  const real *Delta = DSst, *S0 = DSst + c * V;
  real *G = w->G, *eG = w->eG, *Gam = w->Gam;
  /* dGc: gradients of the chunk's cumulative log-decays G_r.  In double in both
   * precisions: a token's dg is their reverse cumulative sum, in which terms much larger
   * than the result cancel (e^(Gl-G_r) k_r.Z_r enters at r and again at the chunk's end,
   * dS.S0 at the end), and in float32 that cost dg up to ~1e-3 of its size on heads
   * whose dg is small, e.g. the f32 mixer golden cases' grad.A_log. */
  double *dGc = w->dGc;
  real *dS = w->BV + (C + d->mmax) * V;
  real *dO = dS - m * V, *dR = dO - c * V;
  const int64_t ldres = C + K, ldl1 = d->mmax + K, ldl2 = C + d->mmax;

  ck_decays(d, ch, g, h, G, eG);
  const real Gl = G[c - 1], eGl = eG[c - 1];

  /* Gam (lower, with diagonal), A = diag(b) KKG for the transposed solve, [K ; Q]. */
  for (int64_t r = 0; r < c; r++) {
    real *gr = Gam + r * C;
    ck_gamma_row(G, r, r, gr);
    const real b = bc[r * H];
    const real *kk = KKG + r * C;
    real *ar = w->Am + r * C;
    for (int64_t s = 0; s < r; s++) ar[s] = b * kk[s];
    memcpy(w->KQ + r * K, kc + r * d->ldk, (size_t)K * sizeof(real));
  }
  const real *qc = q + ch->tq0 * d->ldk + h * K;
  for (int64_t j = 0; j < m; j++) {
    memcpy(w->KQ + (c + j) * K, qc + j * d->ldk, (size_t)K * sizeof(real));
    memcpy(dO + j * V, d_o + (ch->tq0 + j) * d->ldv + h * V, (size_t)V * sizeof(real));
  }

  /* P = Q K^T o Gam o causal (m x c). */
  if (m > 0) {
    CK_GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)c, (int)K, 1, w->KQ + c * K,
            (int)K, w->KQ, (int)K, 0, w->PQ, (int)C);
    for (int64_t j = 0; j < m; j++) {
      const int64_t r = r0 + j * n;
      real *pr = w->PQ + j * C;
      const real *gr = Gam + r * C;
      for (int64_t s = 0; s <= r; s++) pr[s] *= gr[s];
      for (int64_t s = r + 1; s < c; s++) pr[s] = 0;
    }
  }

  /* dDelta = [scale P^T | diag(e^(Gl-G)) K] [dO ; dS], into dR's rows. */
  for (int64_t s = 0; s < c; s++) {
    real *lr = w->L1 + s * ldl1;
    for (int64_t j = 0; j < m; j++) lr[j] = scale * w->PQ[j * C + s];
    const real e = CK_EXP(Gl - G[s]);
    const real *ks = w->KQ + s * K;
    for (int64_t x = 0; x < K; x++) lr[m + x] = e * ks[x];
  }
  CK_GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)c, (int)V, (int)(m + K), 1, w->L1,
          (int)ldl1, dO, (int)V, 0, dR, (int)V);

  /* dR = M^-T dDelta: the gradient of the solve's right-hand side. */
  if (c > 1) ck_solve_unit(1, c, V, w->Am, C, dR, V);

  /* [dR ; dO] [Delta ; S0]^T = [[dR Delta^T, dR S0^T] ; [dO Delta^T, dO S0^T]]. */
  CK_GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)(c + m), (int)(c + K), (int)V, 1, dR,
          (int)V, DSst, (int)V, 0, w->RES, (int)ldres);
  /* Z = Delta dS^T (c x K): the state-update path's gradient for K and G. */
  CK_GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, (int)K, (int)V, 1, Delta, (int)V, dS,
          (int)V, 0, w->Zb, (int)K);

  for (int64_t r = 0; r < c; r++) dGc[r] = 0;

  /* Per step r: dv, dbeta, the diagonal dk terms, and L2 = [E + E^T | dPs^T]. */
  for (int64_t r = 0; r < c; r++) {
    const real b = bc[r * H];
    const real *dRr = dR + r * V, *vr = vc + r * d->ldv, *kr = w->KQ + r * K;
    const real *Yr = w->RES + r * ldres + c, *Zr = w->Zb + r * K;
    const real *F1r = w->RES + r * ldres, *kkr = KKG + r * C, *gr = Gam + r * C;
    real *dvr = dv + (ch->step0 + r) * d->ldv + h * V;
    for (int64_t x = 0; x < V; x++) dvr[x] = b * dRr[x];

    const real kY = ck_dot(K, kr, Yr);
    w->kY[r] = kY;
    real db = ck_dot(V, dRr, vr) - eG[r] * kY;
    real *l2r = w->L2 + r * ldl2;
#pragma omp simd reduction(+ : db)
    for (int64_t s = 0; s < r; s++) { /* dA_rs = -F1_rs, E_rs = dA_rs b Gam_rs */
      const real dA = -F1r[s];
      db += dA * kkr[s];
      l2r[s] = dA * b * gr[s];
    }
    l2r[r] = 0;
    if (g) {
      double rowF = 0;
#pragma omp simd reduction(+ : rowF)
      for (int64_t s = 0; s < r; s++) { /* dA o A: A_rs depends on G_r - G_s */
        const real f = -F1r[s] * b * kkr[s];
        rowF += f;
        dGc[s] -= f;
      }
      dGc[r] += rowF - b * eG[r] * kY;
      const real hs = CK_EXP(Gl - G[r]) * ck_dot(K, kr, Zr);
      dGc[r] -= hs;
      dGc[c - 1] += hs;
    }
    dbeta[(ch->step0 + r) * H + h] = db;

    /* dk_r = -b e^G_r Y_r + e^(Gl-G_r) Z_r; the GEMM below adds the rest. */
    real *dkr = dk + (ch->step0 + r) * d->ldk + h * K;
    const real cy = -b * eG[r], cz = CK_EXP(Gl - G[r]);
    for (int64_t x = 0; x < K; x++) dkr[x] = cy * Yr[x] + cz * Zr[x];
  }
  /* E + E^T: mirror the strictly lower part. */
  for (int64_t r = 0; r < c; r++) {
    real *l2r = w->L2 + r * ldl2;
    for (int64_t s = r + 1; s < c; s++) l2r[s] = w->L2[s * ldl2 + r];
  }
  /* dPs = scale dP o Gam o causal (stored transposed in L2's last m columns), and the
   * query rows' own terms: dq's state part and the gate gradients through P and e^G. */
  for (int64_t j = 0; j < m; j++) {
    const int64_t r = r0 + j * n;
    const real *dPj = w->RES + (c + j) * ldres, *dOSj = dPj + c;
    const real *gr = Gam + r * C, *Pj = w->PQ + j * C;
    for (int64_t s = 0; s <= r; s++) {
      const real dps = scale * dPj[s] * gr[s];
      w->L2[s * ldl2 + c + j] = dps;
    }
    for (int64_t s = r + 1; s < c; s++) w->L2[s * ldl2 + c + j] = 0;
    if (g) {
      double rowD = 0;
#pragma omp simd reduction(+ : rowD)
      for (int64_t s = 0; s <= r; s++) {
        const real dd = scale * dPj[s] * Pj[s];
        rowD += dd;
        dGc[s] -= dd;
      }
      dGc[r] += rowD + scale * eG[r] * ck_dot(K, w->KQ + (c + j) * K, dOSj);
    }
    real *dqj = dq + (ch->tq0 + j) * d->ldk + h * K;
    const real e = scale * eG[r];
    for (int64_t x = 0; x < K; x++) dqj[x] = e * dOSj[x];
  }

  /* dK += [E + E^T | dPs^T] [K ; Q];  dQ += dPs K. */
  CK_GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)c, (int)K, (int)(c + m), 1, w->L2,
          (int)ldl2, w->KQ, (int)K, 1, dk + ch->step0 * d->ldk + h * K, (int)d->ldk);
  if (m > 0)
    CK_GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)m, (int)K, (int)c, 1, w->L2 + c,
            (int)ldl2, w->KQ, (int)K, 1, dq + ch->tq0 * d->ldk + h * K, (int)d->ldk);

  if (g) {
    /* the decay of the carried state: S_end = e^Gl S0 + ... */
    dGc[c - 1] += eGl * ck_dot64(K * V, dS, S0);
    /* G_r = sum_{s<=r} (step log-decays): reverse cumulative sum; a token's dg is the
     * gradient of the log-decay of its step 0. */
    double acc = 0;
    for (int64_t r = c - 1; r >= 0; r--) {
      acc += dGc[r];
      const int64_t i = ch->i0 + r;
      if (i % n == 0) dg[(ch->bos + i / n) * H + h] = (real)acc;
    }
  }

  /* dS0 = e^Gl dS + [-diag(b e^G) K ; scale diag(e^G) Q]^T [dR ; dO]. */
  for (int64_t r = 0; r < c; r++) {
    const real s = -bc[r * H] * eG[r];
    const real *kr = w->KQ + r * K;
    real *lr = w->L3 + r * K;
    for (int64_t x = 0; x < K; x++) lr[x] = s * kr[x];
  }
  for (int64_t j = 0; j < m; j++) {
    const real s = scale * eG[r0 + j * n];
    const real *qj = w->KQ + (c + j) * K;
    real *lr = w->L3 + (c + j) * K;
    for (int64_t x = 0; x < K; x++) lr[x] = s * qj[x];
  }
  CK_GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)K, (int)V, (int)(c + m), 1, w->L3,
          (int)K, dR, (int)V, eGl, dS, (int)V);
}

static void ck_backward_pair(const ck_dims *d, const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                             int64_t s, int64_t h, ck_bwd_ws *w) {
  const real *k = io->k, *v = io->v, *g = io->g, *beta = io->beta;
  const real *h0 = io->h0, *dht = io->dht;
  real *dh0 = io->dh0;
  const int64_t K = d->K, V = d->V, C = d->C, KV = K * V, n = d->n;
  const int64_t item = s * d->H + h;
  const int64_t bos = p->cu_seqlens[s], L = (p->cu_seqlens[s + 1] - bos) * n;
  const int64_t nchunks = (L + C - 1) / C;
  const int64_t blk = (C + K) * V;
  real *dS = w->BV + (C + d->mmax) * V;

  /* Pass 1: the forward again, keeping each chunk's Delta, S0 and K K^T o Gam. */
  if (nchunks > 0) {
    real *S0 = w->store + ck_chunk_at(d, bos, L, 0).c * V;
    if (h0)
      memcpy(S0, h0 + item * KV, (size_t)KV * sizeof(real));
    else
      memset(S0, 0, (size_t)KV * sizeof(real));
  }
  for (int64_t b = 0; b < nchunks; b++) {
    if (gdp_interrupt_poll()) return; /* ck_finish reports it */
    const ck_chunk ch = ck_chunk_at(d, bos, L, b * C);
    const real *kc = k + ch.step0 * d->ldk + h * K;
    const real *vc = v + ch.step0 * d->ldv + h * V;
    const real *bc = beta + ch.step0 * d->H + h;
    real *Delta = w->store + b * blk, *S0 = Delta + ch.c * V;
    real *KKG = w->kstore + b * C * C;
    ck_decays(d, &ch, g, h, w->G, w->eG);
    ck_build_A(d, &ch, kc, bc, w->G, KKG, w->Am, w->gam);
    ck_solve_delta(d, &ch, kc, vc, bc, w->eG, w->Am, S0, b == 0 && !h0, Delta, w->L3);
    if (b + 1 < nchunks) {
      const ck_chunk next = ck_chunk_at(d, bos, L, (b + 1) * C);
      ck_advance_state(d, &ch, kc, w->G, w->eG, Delta, S0, w->store + (b + 1) * blk + next.c * V,
                       w->L3);
    }
  }

  /* Pass 2: dS from the end backwards. */
  if (dht)
    memcpy(dS, dht + item * KV, (size_t)KV * sizeof(real));
  else
    memset(dS, 0, (size_t)KV * sizeof(real));
  for (int64_t b = nchunks - 1; b >= 0; b--) {
    if (gdp_interrupt_poll()) return;
    const ck_chunk ch = ck_chunk_at(d, bos, L, b * C);
    ck_backward_chunk(d, io, &ch, h, w->store + b * blk, w->kstore + b * C * C, w);
  }
  if (dh0) memcpy(dh0 + item * KV, dS, (size_t)KV * sizeof(real));
}

gdp_status CK_PUBLIC(gdp_cpu_delta_product_backward_chunk)(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io) {
  static const char *const fn = "gdp_cpu_delta_product_backward_chunk_" CK_STR(CK_SFX);
  GDP_TRY(ck_check(p, fn));
  const int64_t items = p->N * p->H;
  if (items == 0) return GDP_OK;
  if (p->cu_seqlens[p->N] == p->cu_seqlens[0]) {
    ck_states_only(p, io->dht, io->dh0);
    return GDP_OK;
  }
  const ck_dims d = ck_dims_of(p);
  GDP_TRY(ck_check_blas_dims(&d, fn));
  const int nt = ck_threads(p, items);
  const int64_t max_chunks = ck_max_chunks(p, d.C);
  const size_t per = ck_bwd_ws_count(&d, max_chunks);
  size_t bytes;
  GDP_TRY(ck_ws_bytes(fn, per, nt, &d, &bytes));
  real *ws = malloc(bytes);
  if (!ws)
    return GDP_ERROR_IN(fn, GDP_ERR_OOM,
                        "out of host memory for %d workspaces of %zu bytes (%lld chunks of "
                        "%lld steps, K=%lld, V=%lld)",
                        nt, per * sizeof(real), (long long)max_chunks, (long long)d.C,
                        (long long)d.K, (long long)d.V);

  const int prev_blas = ck_blas_threads_enter(p, nt);
#pragma omp parallel num_threads(nt)
  {
    ck_bwd_ws w;
    ck_bwd_ws_carve(&d, max_chunks, ws + per * (size_t)omp_get_thread_num(), &w);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++)
      ck_backward_pair(&d, p, io, item / p->H, item % p->H, &w);
  }
  ck_blas_threads_leave(prev_blas);
  free(ws);
  return ck_finish(fn);
}
