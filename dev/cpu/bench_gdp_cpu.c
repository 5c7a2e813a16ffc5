/*
 * bench_gdp_cpu.c -- validate-then-time driver for the chunkwise CPU GDP kernels.
 *
 *   bench_gdp_cpu [--B 1] [--T 4096] [--H 4] [--K 128] [--V 128] [--n 2] [--chunk 64]
 *                 [--threads 2] [--repeats 7] [--dtype f32|f64] [--ungated]
 *                 [--validate-T 512] [--split-bf16]
 *
 * --split-bf16: the float32 kernels with every product split into bf16 hi + lo, three
 * products summed in float32 (chunk_split_bf16.c), as a float32 path on bf16 tensor
 * cores would compute them; validated at float32's 1e-4.
 *
 * 1. Validates the chunk kernels against the float64 recurrent oracle on the same
 *    shapes with T = validate-T tokens (0 skips): relative error per output and
 *    gradient, non-zero exit above 1e-10 (f64) / 1e-4 (f32).
 * 2. Times OpenBLAS GEMM at M = N = K = 1024 on `threads` threads (the machine's
 *    ceiling), then the chunk forward and backward at the full size, and reports
 *    useful GFLOP/s with the recurrence's count: forward 2*K*V*(2n+1) per token and
 *    head, backward twice that.  Every time is the best of `repeats` runs, since the
 *    machine may be shared.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "cpu/gdp_cpu.h"
#include "philox.h"

typedef struct config {
  int64_t B, T, H, K, V, n, chunk;
  int threads, repeats, f64, gated;
  int64_t validate_T;
  int split_bf16;
} config;

/* chunk_split_bf16.c: the float32 chunk kernels with split-bf16 products */
gdp_status gdp_cpu_delta_product_forward_chunk_f32split(const gdp_delta_product_problem *p,
                                                        const gdp_delta_product_forward_io *io);
gdp_status gdp_cpu_delta_product_backward_chunk_f32split(const gdp_delta_product_problem *p,
                                                         const gdp_delta_product_backward_io *io);
static int g_split_bf16 = 0;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Deterministic inputs from the library's Philox stream (kernels/philox.h), read in
 * order: uniforms word by word, normals block by block. */
static const uint64_t kSeed = 0x5eed;
static uint64_t rng_block = 0;
static uint32_t rng_words[4];
static int rng_used = 4;
static double urand(void) {
  if (rng_used == 4) {
    gdp_philox_stream_block(kSeed, rng_block++, rng_words);
    rng_used = 0;
  }
  return gdp_philox_u01_f64(rng_words[rng_used++]);
}
static double nrand(void) {
  uint32_t w[4];
  gdp_philox_stream_block(kSeed, rng_block++, w);
  return gdp_philox_std_normal(w, 0);
}

/* Inputs in double (rounded to float32 so both precisions see the same values). */
typedef struct inputs {
  gdp_delta_product_problem p;
  int64_t *cu;
  int64_t nq, nk, nv, nb, ng, ns, no;
  double *q, *k, *v, *beta, *g, *h0, *d_o, *dht;
} inputs;

static double *fill(int64_t count, int kind, int64_t row) {
  double *x = malloc((size_t)count * sizeof(double));
  if (!x) {
    fprintf(stderr, "out of memory for %lld values\n", (long long)count);
    exit(1);
  }
  for (int64_t i = 0; i < count; i++) {
    if (kind == 0) x[i] = nrand();
    if (kind == 1) x[i] = 0.02 + 0.96 * urand();      /* beta in (0,1) */
    if (kind == 2) x[i] = -(0.001 + 0.2 * urand());   /* log-decay */
  }
  if (row > 0) /* unit rows: q and k as the op hands them over after its L2 norm */
    for (int64_t r = 0; r < count / row; r++) {
      double ss = 0;
      for (int64_t i = 0; i < row; i++) ss += x[r * row + i] * x[r * row + i];
      for (int64_t i = 0; i < row; i++) x[r * row + i] /= sqrt(ss);
    }
  for (int64_t i = 0; i < count; i++) x[i] = (double)(float)x[i];
  return x;
}

static void inputs_make(inputs *in, const config *cf, int64_t T) {
  memset(in, 0, sizeof *in);
  const int64_t Tt = cf->B * T, H = cf->H, K = cf->K, V = cf->V, n = cf->n;
  in->cu = malloc((size_t)(cf->B + 1) * sizeof(int64_t));
  for (int64_t b = 0; b <= cf->B; b++) in->cu[b] = b * T;
  gdp_delta_product_problem *p = &in->p;
  p->T_total = Tt;
  p->N = cf->B;
  p->cu_seqlens = in->cu;
  p->H = H, p->K = K, p->V = V, p->n = n;
  p->scale = 1.0 / sqrt((double)K);
  p->chunk_size = cf->chunk;
  p->num_threads = cf->threads;
  p->dtype = cf->f64 ? GDP_DTYPE_F64 : GDP_DTYPE_F32;
  p->algorithm = GDP_ALGO_CHUNK;
  in->nq = Tt * H * K, in->nk = Tt * n * H * K, in->nv = Tt * n * H * V;
  in->nb = Tt * n * H, in->ng = Tt * H, in->ns = cf->B * H * K * V, in->no = Tt * H * V;
  in->q = fill(in->nq, 0, K);
  in->k = fill(in->nk, 0, K);
  in->v = fill(in->nv, 0, 0);
  in->beta = fill(in->nb, 1, 0);
  in->g = cf->gated ? fill(in->ng, 2, 0) : NULL;
  in->h0 = fill(in->ns, 0, 0);
  in->d_o = fill(in->no, 0, 0);
  in->dht = fill(in->ns, 0, 0);
}

static void inputs_free(inputs *in) {
  free(in->cu), free(in->q), free(in->k), free(in->v), free(in->beta), free(in->g);
  free(in->h0), free(in->d_o), free(in->dht);
}

/* The buffers of one run in the compute dtype: 8 inputs then 8 outputs. */
typedef struct run_bufs {
  void *q, *k, *v, *beta, *g, *h0, *d_o, *dht;
  void *o, *ht, *dq, *dk, *dv, *dbeta, *dg, *dh0;
} run_bufs;

static void *convert(const double *x, int64_t count, int f64) {
  if (!x) return NULL;
  void *y = malloc((size_t)count * (f64 ? sizeof(double) : sizeof(float)));
  if (!y) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  for (int64_t i = 0; i < count; i++) {
    if (f64)
      ((double *)y)[i] = x[i];
    else
      ((float *)y)[i] = (float)x[i];
  }
  return y;
}
static void *zeros(int64_t count, int f64) {
  return calloc((size_t)count, f64 ? sizeof(double) : sizeof(float));
}

static void bufs_make(run_bufs *r, const inputs *in, int f64) {
  r->q = convert(in->q, in->nq, f64), r->k = convert(in->k, in->nk, f64);
  r->v = convert(in->v, in->nv, f64), r->beta = convert(in->beta, in->nb, f64);
  r->g = convert(in->g, in->ng, f64), r->h0 = convert(in->h0, in->ns, f64);
  r->d_o = convert(in->d_o, in->no, f64), r->dht = convert(in->dht, in->ns, f64);
  r->o = zeros(in->no, f64), r->ht = zeros(in->ns, f64), r->dq = zeros(in->nq, f64);
  r->dk = zeros(in->nk, f64), r->dv = zeros(in->nv, f64), r->dbeta = zeros(in->nb, f64);
  r->dg = in->g ? zeros(in->ng, f64) : NULL, r->dh0 = zeros(in->ns, f64);
}
static void bufs_free(run_bufs *r) {
  void **all = (void **)r;
  for (size_t i = 0; i < sizeof *r / sizeof(void *); i++) free(all[i]);
}

static gdp_status run_fwd(const gdp_delta_product_problem *p, const run_bufs *r, int f64) {
  gdp_delta_product_forward_io io = {r->q, r->k, r->v, r->g, r->beta, r->h0, r->o, r->ht};
  if (f64) return gdp_cpu_delta_product_forward_chunk_f64(p, &io);
  return g_split_bf16 ? gdp_cpu_delta_product_forward_chunk_f32split(p, &io)
                      : gdp_cpu_delta_product_forward_chunk_f32(p, &io);
}
static gdp_status run_bwd(const gdp_delta_product_problem *p, const run_bufs *r, int f64) {
  gdp_delta_product_backward_io io = {r->q,  r->k,  r->v,  r->g,     r->beta, r->h0,  r->d_o,
                       r->dht, r->dq, r->dk, r->dv, r->dbeta, r->dg, r->dh0};
  if (f64) return gdp_cpu_delta_product_backward_chunk_f64(p, &io);
  return g_split_bf16 ? gdp_cpu_delta_product_backward_chunk_f32split(p, &io)
                      : gdp_cpu_delta_product_backward_chunk_f32(p, &io);
}

static double rel_err(const void *got, int f64, const double *ref, int64_t count) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < count; i++) {
    const double x = f64 ? ((const double *)got)[i] : (double)((const float *)got)[i];
    if (!isfinite(x)) return NAN;
    num += (x - ref[i]) * (x - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Returns 0 when every output is within tolerance of the oracle. */
static int validate(const config *cf) {
  inputs in;
  inputs_make(&in, cf, cf->validate_T);
  run_bufs ref, got;
  bufs_make(&ref, &in, 1);
  bufs_make(&got, &in, cf->f64);
  gdp_delta_product_problem p64 = in.p;
  p64.dtype = GDP_DTYPE_F64;
  gdp_delta_product_forward_io f = {ref.q, ref.k, ref.v, ref.g, ref.beta, ref.h0, ref.o, ref.ht};
  gdp_delta_product_backward_io b = {ref.q,  ref.k,  ref.v,  ref.g,      ref.beta, ref.h0,  ref.d_o,
                      ref.dht, ref.dq, ref.dk, ref.dv, ref.dbeta, ref.dg, ref.dh0};
  int bad = 0;
  if (gdp_cpu_delta_product_forward_recurrent_f64(&p64, &f) != GDP_OK ||
      gdp_cpu_delta_product_backward_recurrent_f64(&p64, &b) != GDP_OK || run_fwd(&in.p, &got, cf->f64) != GDP_OK ||
      run_bwd(&in.p, &got, cf->f64) != GDP_OK) {
    fprintf(stderr, "validation run failed: %s\n", gdp_last_error());
    bad = 1;
  }
  const double tol = cf->f64 ? 1e-10 : 1e-4;
  const char *names[] = {"o", "ht", "dq", "dk", "dv", "dbeta", "dg", "dh0"};
  const void *gv[] = {got.o, got.ht, got.dq, got.dk, got.dv, got.dbeta, got.dg, got.dh0};
  const double *rv[] = {ref.o, ref.ht, ref.dq, ref.dk, ref.dv, ref.dbeta, ref.dg, ref.dh0};
  const int64_t cnt[] = {in.no, in.ns, in.nq, in.nk, in.nv, in.nb, in.ng, in.ns};
  printf("# validation vs float64 recurrent oracle (T=%lld): relative error, tolerance %.0e\n",
         (long long)cf->validate_T, tol);
  for (int i = 0; i < 8 && !bad; i++) {
    if (!gv[i]) continue;
    const double e = rel_err(gv[i], cf->f64, rv[i], cnt[i]);
    printf("#   %-6s %.3e%s\n", names[i], e, e <= tol ? "" : "  FAIL");
    if (!(e <= tol)) bad = 1;
  }
  bufs_free(&ref), bufs_free(&got);
  inputs_free(&in);
  return bad;
}

static double gemm_gflops(const config *cf) {
  const int N = 1024;
  void *a = zeros((int64_t)N * N, cf->f64), *b = zeros((int64_t)N * N, cf->f64);
  void *c = zeros((int64_t)N * N, cf->f64);
  for (int64_t i = 0; i < (int64_t)N * N; i++) {
    if (cf->f64)
      ((double *)a)[i] = nrand(), ((double *)b)[i] = nrand();
    else
      ((float *)a)[i] = (float)nrand(), ((float *)b)[i] = (float)nrand();
  }
  const int prev = openblas_get_num_threads();
  openblas_set_num_threads(cf->threads);
  double best = 1e30;
  for (int r = 0; r < cf->repeats + 1; r++) { /* first run warms up */
    const double t0 = now_s();
    if (cf->f64)
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, N, N, 1, a, N, b, N, 0, c, N);
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, N, N, 1, a, N, b, N, 0, c, N);
    const double t = now_s() - t0;
    if (r > 0 && t < best) best = t;
  }
  openblas_set_num_threads(prev);
  free(a), free(b), free(c);
  return 2.0 * N * N * (double)N / best * 1e-9;
}

static int parse(int argc, char **argv, config *cf) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *val = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT_INT(name, field)             \
  if (!strcmp(a, name) && val) {         \
    cf->field = atoll(val);              \
    i++;                                 \
    continue;                            \
  }
    OPT_INT("--B", B)
    OPT_INT("--T", T)
    OPT_INT("--H", H)
    OPT_INT("--K", K)
    OPT_INT("--V", V)
    OPT_INT("--n", n)
    OPT_INT("--chunk", chunk)
    OPT_INT("--threads", threads)
    OPT_INT("--repeats", repeats)
    OPT_INT("--validate-T", validate_T)
#undef OPT_INT
    if (!strcmp(a, "--dtype") && val) {
      cf->f64 = !strcmp(val, "f64");
      i++;
      continue;
    }
    if (!strcmp(a, "--ungated")) {
      cf->gated = 0;
      continue;
    }
    if (!strcmp(a, "--split-bf16")) {
      cf->split_bf16 = 1;
      continue;
    }
    fprintf(stderr, "unknown argument %s (see the header of bench_gdp_cpu.c)\n", a);
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  config cf = {1, 4096, 4, 128, 128, 2, 64, 2, 7, 0, 1, 512, 0};
  if (parse(argc, argv, &cf)) return 2;
  if (cf.split_bf16 && cf.f64) {
    fprintf(stderr, "--split-bf16 emulates a float32 path: use it with --dtype f32\n");
    return 2;
  }
  g_split_bf16 = cf.split_bf16;
  if (cf.repeats < 1) cf.repeats = 1;
  printf("# bench_gdp_cpu: B=%lld T=%lld H=%lld K=%lld V=%lld n=%lld chunk=%lld %s %s "
         "threads=%d, best of %d repeats\n",
         (long long)cf.B, (long long)cf.T, (long long)cf.H, (long long)cf.K, (long long)cf.V,
         (long long)cf.n, (long long)cf.chunk, cf.f64 ? "f64" : cf.split_bf16 ? "f32 (split-bf16 products)" : "f32",
         cf.gated ? "gated" : "ungated", cf.threads, cf.repeats);

  if (cf.validate_T > 0 && validate(&cf)) {
    printf("# validation FAILED: not timing\n");
    return 1;
  }

  const double peak = gemm_gflops(&cf);

  inputs in;
  inputs_make(&in, &cf, cf.T);
  run_bufs r;
  bufs_make(&r, &in, cf.f64);
  double best_f = 1e30, best_b = 1e30, best_fb = 1e30;
  for (int rep = 0; rep < cf.repeats + 1; rep++) { /* first repeat warms up */
    const double t0 = now_s();
    if (run_fwd(&in.p, &r, cf.f64) != GDP_OK) {
      fprintf(stderr, "forward failed: %s\n", gdp_last_error());
      return 1;
    }
    const double t1 = now_s();
    if (run_bwd(&in.p, &r, cf.f64) != GDP_OK) {
      fprintf(stderr, "backward failed: %s\n", gdp_last_error());
      return 1;
    }
    const double t2 = now_s();
    if (rep == 0) continue;
    if (t1 - t0 < best_f) best_f = t1 - t0;
    if (t2 - t1 < best_b) best_b = t2 - t1;
    if (t2 - t0 < best_fb) best_fb = t2 - t0;
  }
  const double fwd_flop =
      2.0 * (double)cf.K * (double)cf.V * (double)(2 * cf.n + 1) * (double)(cf.B * cf.T * cf.H);
  const double fb_gflops = 3.0 * fwd_flop / best_fb * 1e-9;
  printf("%-34s %10.2f GFLOP/s\n", cf.f64 ? "dgemm 1024^3 (all threads)" : "sgemm 1024^3 (all threads)",
         peak);
  printf("%-34s %10.4f s  %8.2f GFLOP/s\n", "chunk forward", best_f, fwd_flop / best_f * 1e-9);
  printf("%-34s %10.4f s  %8.2f GFLOP/s\n", "chunk backward", best_b, 2 * fwd_flop / best_b * 1e-9);
  printf("%-34s %10.4f s  %8.2f GFLOP/s\n", "chunk forward+backward", best_fb, fb_gflops);
  printf("%-34s %10.3f   (target >= 0.15)\n", "ratio fwd+bwd / gemm", fb_gflops / peak);
  bufs_free(&r);
  inputs_free(&in);
  return 0;
}
