/*
 * test_rng.c -- Philox 4x32-10 and the random fills built on it.
 *
 * Known answers: Random123's tests/kat_vectors (DEShawResearch/random123), the three
 * "philox4x32 10" lines (counter, key, expected output).  The stream definition
 * (gdp.h, kernels/philox.h) is checked element by element against a host
 * computation from the raw block function, then the distributions by moments.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "philox.h"
#include "testutil.h"

static gdp_ctx *ctx;

static void test_known_answers(void) {
  static const struct {
    uint32_t ctr[4], key[2], out[4];
  } kat[] = {
      {{0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000},
       {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (int i = 0; i < 3; i++) {
    uint32_t out[4] = {0, 0, 0, 0};
    gdp_philox4x32_10(kat[i].ctr, kat[i].key, out);
    CHECK(memcmp(out, kat[i].out, sizeof out) == 0,
          "philox4x32_10 KAT %d: got %08x %08x %08x %08x, want %08x %08x %08x %08x", i, out[0],
          out[1], out[2], out[3], kat[i].out[0], kat[i].out[1], kat[i].out[2], kat[i].out[3]);
  }
}

/* The stream, computed here from the raw block (gdp.h's definition). */
static void stream_words(uint64_t seed, uint64_t block, uint32_t w[4]) {
  uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), 0, 0};
  uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  gdp_philox4x32_10(ctr, key, w);
}

static double expected_uniform(uint64_t seed, uint64_t offset, int64_t i, double lo, double hi) {
  uint32_t w[4];
  stream_words(seed, offset + (uint64_t)i / 4, w);
  double u = ((double)w[i % 4] + 0.5) * (1.0 / 4294967296.0);
  return fma(hi - lo, u, lo);
}

/* Box-Muller with long double libm: the library's own log/sin/cos (philox.h) agree
 * with it to rounding, not bit for bit. */
static double expected_normal(uint64_t seed, uint64_t offset, int64_t i, double mean, double std) {
  uint32_t w[4];
  stream_words(seed, offset + (uint64_t)i / 4, w);
  int pair = (int)(i % 4) & 2;
  long double u1 = ((long double)w[pair] + 0.5L) / 4294967296.0L;
  long double u2 = ((long double)w[pair + 1] + 0.5L) / 4294967296.0L;
  long double r = sqrtl(-2.0L * logl(u1)), th = 6.283185307179586476925286766559L * u2;
  long double z = (i % 2) ? r * sinl(th) : r * cosl(th);
  return (double)(mean + std * z);
}

/* philox.h's portable log and sin/cos against long double libm. */
static void test_math(void) {
  double worst_log = 0, worst_sc = 0;
  int inexact = 0;
  for (int64_t i = 0; i < 200000; i++) {
    uint32_t w = i < 3 ? (i == 0 ? 0u : i == 1 ? 0xffffffffu : 0x80000000u) : (uint32_t)tu_rand_u64();
    if (i >= 3 && i < 1003) w = (uint32_t)(0xffffffffu - (uint32_t)i); /* u near 1 */
    if (i >= 1003 && i < 2003) w = (uint32_t)(i - 1003) * 1073741u;     /* near quadrant edges */
    double u = gdp_philox_u01_f64(w);
    long double ul = ((long double)w + 0.5L) / 4294967296.0L;
    inexact += u != (double)ul;
    double lg = gdp_philox_log(u);
    long double ref = logl(ul);
    double e = (double)fabsl((lg - ref) / ref);
    worst_log = e > worst_log ? e : worst_log;
    double sn, cs;
    gdp_philox_sincos_2pi(u, &sn, &cs);
    long double th = 6.283185307179586476925286766559L * ul;
    double es = (double)fmaxl(fabsl(sn - sinl(th)), fabsl(cs - cosl(th)));
    worst_sc = es > worst_sc ? es : worst_sc;
  }
  CHECK(inexact == 0, "u01 not exact for %d words", inexact);
  CHECK(worst_log <= 3e-16, "gdp_philox_log max rel err %.3g", worst_log);
  CHECK(worst_sc <= 3e-16, "gdp_philox_sincos_2pi max abs err %.3g", worst_sc);
  /* exact quadrant points */
  double sn, cs;
  gdp_philox_sincos_2pi(0.25, &sn, &cs);
  CHECK(sn == 1.0 && cs == 0.0, "sincos(pi/2) = (%g, %g)", sn, cs);
  gdp_philox_sincos_2pi(0.5, &sn, &cs);
  CHECK(sn == 0.0 && cs == -1.0, "sincos(pi) = (%g, %g)", sn, cs);
  CHECK(gdp_philox_log(1.0) == 0.0 && gdp_philox_log(0.5) == -0.69314718055994530942, "log(1), log(1/2)");
  printf("# philox.h math vs long double libm: log rel %.3g, sin/cos abs %.3g\n", worst_log, worst_sc);
  /* the per-element and per-block normals are the same bits */
  int bad = 0;
  for (int i = 0; i < 1000; i++) {
    uint32_t words[4] = {(uint32_t)tu_rand_u64(), (uint32_t)tu_rand_u64(), (uint32_t)tu_rand_u64(),
                         (uint32_t)tu_rand_u64()};
    double four[4];
    gdp_philox_normal4(words, 0.5, 2.0, four);
    for (int k = 0; k < 4; k++) bad += four[k] != gdp_philox_normal(words, k, 0.5, 2.0);
  }
  CHECK(bad == 0, "normal4 == normal: %d differ", bad);
}

static double *values(const gdp_tensor *t) {
  int64_t n = gdp_tensor_numel(t);
  double *d = malloc((size_t)(n ? n : 1) * sizeof *d);
  CHECK_OK(gdp_tensor_to_host(t, GDP_DTYPE_F64, d, (size_t)n * 8));
  return d;
}

static void test_stream_definition(void) {
  uint64_t seed = tu_seed ^ UINT64_C(0xA5A5A5A5DEADBEEF); /* high key word in use */
  int64_t shape[2] = {3, 7};
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 2, shape, &t));
  gdp_ctx_manual_seed(ctx, seed);
  CHECK(gdp_ctx_seed(ctx) == seed && gdp_ctx_rng_offset(ctx) == 0, "manual_seed resets the offset");
  uint64_t offset = (UINT64_C(1) << 32) + 5; /* counter word 1 in use */
  gdp_ctx_set_rng_offset(ctx, offset);
  CHECK_OK(gdp_tensor_uniform(t, -3.0, 5.0));
  CHECK(gdp_ctx_rng_offset(ctx) == offset + 6, "21 elements consume 6 blocks: offset %llu",
        (unsigned long long)(gdp_ctx_rng_offset(ctx) - offset));
  double *v = values(t);
  int bad = 0;
  for (int64_t i = 0; i < 21; i++) bad += v[i] != expected_uniform(seed, offset, i, -3.0, 5.0);
  CHECK(bad == 0, "uniform stream: %d of 21 differ", bad);
  free(v);
  uint64_t off2 = gdp_ctx_rng_offset(ctx);
  CHECK_OK(gdp_tensor_normal(t, 2.0, 0.5));
  v = values(t);
  bad = 0;
  double worst = 0;
  for (int64_t i = 0; i < 21; i++) {
    double e = fabs(v[i] - expected_normal(seed, off2, i, 2.0, 0.5));
    worst = e > worst ? e : worst;
    uint32_t w[4];
    stream_words(seed, off2 + (uint64_t)i / 4, w);
    bad += v[i] != gdp_philox_normal(w, (int)(i % 4), 2.0, 0.5);
  }
  CHECK(worst < 4e-15, "normal stream vs long double Box-Muller: max abs diff %.3g", worst);
  CHECK(bad == 0, "normal stream vs philox.h: %d of 21 differ", bad);
  free(v);
  gdp_tensor_free(t);
}

static void test_offsets_and_seeds(void) {
  int64_t n10 = 10, n8 = 8, n6 = 6, n1 = 1;
  gdp_tensor *a = NULL, *b = NULL, *c = NULL;
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 1, &n10, &a));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 1, &n10, &b));
  gdp_ctx_manual_seed(ctx, 1234);
  CHECK_OK(gdp_tensor_uniform(a, 0, 1));
  CHECK(gdp_ctx_rng_offset(ctx) == 3, "ceil(10/4) = 3, got %llu", (unsigned long long)gdp_ctx_rng_offset(ctx));
  gdp_ctx_set_rng_offset(ctx, 0);
  CHECK_OK(gdp_tensor_uniform(b, 0, 1));
  double r = -1;
  CHECK_OK(gdp_tensor_rel_error(a, b, &r));
  CHECK(r == 0, "same seed and offset -> identical");
  /* the next fill continues at block 3 */
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 1, &n6, &c));
  CHECK_OK(gdp_tensor_uniform(c, 0, 1));
  CHECK(gdp_ctx_rng_offset(ctx) == 5, "then ceil(6/4) = 2 more");
  double *cv = values(c);
  int bad = 0;
  for (int i = 0; i < 6; i++) bad += cv[i] != (double)(float)expected_uniform(1234, 3, i, 0, 1);
  CHECK(bad == 0, "consecutive fill continues the stream");
  free(cv);
  gdp_tensor_free(c);
  /* 8 and 1 elements */
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 1, &n8, &c));
  CHECK_OK(gdp_tensor_normal(c, 0, 1));
  CHECK(gdp_ctx_rng_offset(ctx) == 7, "ceil(8/4) = 2 more");
  gdp_tensor_free(c);
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 1, &n1, &c));
  CHECK_OK(gdp_tensor_normal(c, 0, 1));
  CHECK(gdp_ctx_rng_offset(ctx) == 8, "ceil(1/4) = 1 more");
  gdp_tensor_free(c);
  /* different seeds differ everywhere */
  gdp_ctx_manual_seed(ctx, 1235);
  CHECK_OK(gdp_tensor_uniform(b, 0, 1));
  double *av = values(a), *bv = values(b);
  int same = 0;
  for (int i = 0; i < 10; i++) same += av[i] == bv[i];
  CHECK(same == 0, "seeds 1234 and 1235 share %d of 10 values", same);
  /* seeds differing only in the high word differ too */
  gdp_ctx_manual_seed(ctx, 1234 + (UINT64_C(1) << 32));
  CHECK_OK(gdp_tensor_uniform(b, 0, 1));
  free(bv);
  bv = values(b);
  same = 0;
  for (int i = 0; i < 10; i++) same += av[i] == bv[i];
  CHECK(same == 0, "high seed word changes the stream (%d equal)", same);
  free(av);
  free(bv);
  gdp_tensor_free(a);
  gdp_tensor_free(b);
}

/* A non-contiguous destination takes values in its own row-major order. */
static void test_strided_destination(void) {
  int64_t s75[2] = {7, 5}, s57[2] = {5, 7};
  gdp_tensor *base = NULL, *t = NULL, *ref = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, s75, &base));
  CHECK_OK(gdp_tensor_transpose(base, 0, 1, &t)); /* [5x7], strides (1, 5) */
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 2, s57, &ref));
  gdp_ctx_manual_seed(ctx, tu_seed);
  CHECK_OK(gdp_tensor_normal(t, 0, 1));
  gdp_ctx_manual_seed(ctx, tu_seed);
  CHECK_OK(gdp_tensor_normal(ref, 0, 1));
  double r = -1;
  CHECK_OK(gdp_tensor_rel_error(t, ref, &r));
  CHECK(r == 0, "transposed destination filled in its row-major order (rel %g)", r);
  /* a window of a larger tensor: the rest stays untouched */
  int64_t s9[2] = {9, 11};
  gdp_tensor *big = NULL, *w1 = NULL, *w = NULL;
  CHECK_OK(gdp_tensor_zeros(ctx, GDP_DTYPE_F64, 2, s9, &big));
  CHECK_OK(gdp_tensor_narrow(big, 0, 2, 5, &w1));
  CHECK_OK(gdp_tensor_narrow(w1, 1, 3, 7, &w));
  gdp_ctx_manual_seed(ctx, tu_seed);
  CHECK_OK(gdp_tensor_normal(w, 0, 1));
  CHECK_OK(gdp_tensor_rel_error(w, ref, &r));
  CHECK(r == 0, "window destination (rel %g)", r);
  double s1 = 0, s2 = 0;
  CHECK_OK(gdp_tensor_sum(big, &s1));
  CHECK_OK(gdp_tensor_sum(ref, &s2));
  CHECK(fabs(s1 - s2) < 1e-12, "nothing written outside the window");
  gdp_tensor_free(w);
  gdp_tensor_free(w1);
  gdp_tensor_free(big);
  gdp_tensor_free(ref);
  gdp_tensor_free(t);
  gdp_tensor_free(base);
}

/* f32 and bf16 fills are the f64 fill rounded once. */
static void test_dtypes(void) {
  int64_t n = 1001;
  gdp_tensor *d = NULL, *f = NULL, *b = NULL, *df = NULL, *db = NULL;
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 1, &n, &d));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 1, &n, &f));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_BF16, 1, &n, &b));
  for (int kind = 0; kind < 2; kind++) {
    gdp_ctx_set_rng_offset(ctx, 77);
    CHECK_OK(kind ? gdp_tensor_normal(d, 1, 3) : gdp_tensor_uniform(d, -1, 2));
    gdp_ctx_set_rng_offset(ctx, 77);
    CHECK_OK(kind ? gdp_tensor_normal(f, 1, 3) : gdp_tensor_uniform(f, -1, 2));
    gdp_ctx_set_rng_offset(ctx, 77);
    CHECK_OK(kind ? gdp_tensor_normal(b, 1, 3) : gdp_tensor_uniform(b, -1, 2));
    CHECK_OK(gdp_tensor_to(NULL, d, GDP_DTYPE_F32, &df));
    CHECK_OK(gdp_tensor_to(NULL, d, GDP_DTYPE_BF16, &db));
    double r1 = -1, r2 = -1;
    CHECK_OK(gdp_tensor_rel_error(f, df, &r1));
    CHECK_OK(gdp_tensor_rel_error(b, db, &r2));
    CHECK(r1 == 0 && r2 == 0, "%s: f32 and bf16 fills are the rounded f64 fill (%g, %g)",
          kind ? "normal" : "uniform", r1, r2);
    gdp_tensor_free(df);
    gdp_tensor_free(db);
  }
  gdp_tensor_free(d);
  gdp_tensor_free(f);
  gdp_tensor_free(b);
}

static void test_moments(void) {
  const int64_t n = 1000000;
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 1, &n, &t));
  gdp_ctx_manual_seed(ctx, tu_seed);
  double t0 = gdp_time_now();
  CHECK_OK(gdp_tensor_uniform(t, 0, 1));
  double t_uniform = gdp_time_now() - t0;
  double *v = values(t);
  double mean = 0, m2 = 0, lo = 1, hi = 0;
  for (int64_t i = 0; i < n; i++) {
    mean += v[i];
    lo = v[i] < lo ? v[i] : lo;
    hi = v[i] > hi ? v[i] : hi;
  }
  mean /= n;
  for (int64_t i = 0; i < n; i++) m2 += (v[i] - mean) * (v[i] - mean);
  m2 /= n;
  /* 5 standard errors: sd(mean) = sqrt(1/12/n), sd(var) = sqrt(1/180/n) */
  CHECK(fabs(mean - 0.5) < 5 * sqrt(1.0 / 12 / n), "uniform mean %.6f", mean);
  CHECK(fabs(m2 - 1.0 / 12) < 5 * sqrt(1.0 / 180 / n), "uniform var %.6f", m2);
  CHECK(lo > 0 && hi < 1, "uniform inside (0,1): [%.3g, %.9f]", lo, hi);
  free(v);

  t0 = gdp_time_now();
  CHECK_OK(gdp_tensor_normal(t, 0, 1));
  double t_normal = gdp_time_now() - t0;
  v = values(t);
  double s1 = 0, s2 = 0, s3 = 0, s4 = 0;
  for (int64_t i = 0; i < n; i++) s1 += v[i];
  mean = s1 / n;
  for (int64_t i = 0; i < n; i++) {
    double x = v[i] - mean;
    s2 += x * x;
    s3 += x * x * x;
    s4 += x * x * x * x;
  }
  double var = s2 / n, skew = s3 / n / pow(var, 1.5), kurt = s4 / n / (var * var);
  CHECK(fabs(mean) < 5 / sqrt((double)n), "normal mean %.5f", mean);
  CHECK(fabs(var - 1) < 5 * sqrt(2.0 / n), "normal var %.5f", var);
  CHECK(fabs(skew) < 5 * sqrt(6.0 / n), "normal skew %.5f", skew);
  CHECK(fabs(kurt - 3) < 5 * sqrt(24.0 / n), "normal kurtosis %.5f", kurt);
  /* pairs (0,1) and (2,3) of a block are independent: correlation ~ 0 */
  double c01 = 0;
  for (int64_t i = 0; i + 1 < n; i += 2) c01 += v[i] * v[i + 1];
  c01 /= n / 2;
  CHECK(fabs(c01) < 5 * sqrt(2.0 / n), "Box-Muller pair correlation %.5f", c01);
  free(v);
  printf("# 1e6 f64 samples: uniform %.2f ms, normal %.2f ms (%d threads)\n", 1e3 * t_uniform,
         1e3 * t_normal, gdp_ctx_num_threads(ctx));

  /* same bits for any thread count */
  gdp_tensor *u = NULL;
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F64, 1, &n, &u));
  int threads = gdp_ctx_num_threads(ctx);
  gdp_ctx_set_num_threads(ctx, 1);
  gdp_ctx_set_rng_offset(ctx, 12345);
  CHECK_OK(gdp_tensor_normal(u, 0, 1));
  gdp_ctx_set_num_threads(ctx, threads > 1 ? threads : 3);
  gdp_ctx_set_rng_offset(ctx, 12345);
  CHECK_OK(gdp_tensor_normal(t, 0, 1));
  gdp_ctx_set_num_threads(ctx, threads);
  double r = -1;
  CHECK_OK(gdp_tensor_rel_error(t, u, &r));
  CHECK(r == 0, "thread count does not change the numbers");
  gdp_tensor_free(u);
  gdp_tensor_free(t);
}

static void test_errors(void) {
  int64_t n = 4;
  gdp_tensor *i = NULL, *f = NULL;
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_I32, 1, &n, &i));
  CHECK_OK(gdp_tensor_empty(ctx, GDP_DTYPE_F32, 1, &n, &f));
  uint64_t off = gdp_ctx_rng_offset(ctx);
  CHECK_ERR(gdp_tensor_uniform(i, 0, 1), GDP_ERR_DTYPE, "gdp_tensor_uniform: t: expected f64, f32 or bf16, got i32");
  CHECK_ERR(gdp_tensor_uniform(f, 1, 0), GDP_ERR_INVALID_ARG, "expected finite lo <= hi, got lo 1, hi 0");
  CHECK_ERR(gdp_tensor_normal(f, 0, -1), GDP_ERR_INVALID_ARG, "std >= 0");
  CHECK_ERR(gdp_tensor_normal(f, NAN, 1), GDP_ERR_INVALID_ARG, "expected finite mean");
  CHECK_ERR(gdp_tensor_normal(NULL, 0, 1), GDP_ERR_INVALID_ARG, "t is NULL");
  CHECK(gdp_ctx_rng_offset(ctx) == off, "failed fills consume nothing");
  /* std = 0 and lo = hi are degenerate but valid */
  CHECK_OK(gdp_tensor_normal(f, 2.5, 0));
  double m = 0;
  CHECK_OK(gdp_tensor_max_abs(f, &m));
  CHECK(m == 2.5, "std 0 gives the mean");
  gdp_tensor_free(i);
  gdp_tensor_free(f);
}

int main(void) {
  TEST_BEGIN(987654321);
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx));
  test_known_answers();
  test_math();
  test_stream_definition();
  test_offsets_and_seeds();
  test_strided_destination();
  test_dtypes();
  test_moments();
  test_errors();
  gdp_ctx_free(ctx);
  TEST_END();
}
