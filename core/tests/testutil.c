/*
 * testutil.c -- the C tests' harness (see testutil.h).
 *
 * GDP_TEST_SEED=<n> overrides a test's fixed seed, to rerun a failure or to try
 * fresh inputs; the seed in use is printed with any failure.
 */
#include "testutil.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

int tu_checks, tu_failures;
uint64_t tu_seed;

static const char *tu_name = "?";
static uint64_t tu_state;

void tu_begin(const char *name, uint64_t seed) {
  const char *env = getenv("GDP_TEST_SEED");
  if (env && *env) seed = strtoull(env, NULL, 0);
  tu_name = name;
  tu_seed = seed;
  tu_state = seed;
  tu_checks = tu_failures = 0;
  printf("# %s (seed %" PRIu64 ")\n", name, seed);
}

int tu_end(void) {
  if (tu_failures)
    printf("# %s: %d failure(s); seed %" PRIu64 " (rerun with GDP_TEST_SEED=%" PRIu64 ")\n",
           tu_name, tu_failures, tu_seed, tu_seed);
  printf("%d passed, %d failed\n", tu_checks - tu_failures, tu_failures);
  fflush(stdout);
  return tu_failures ? 1 : 0;
}

/* ||gpu - cpu|| / ||cpu|| <= tol; a reference of zeros counts as a failure (the case
 * would test nothing). */
void tu_expect_near(const char *what, const gdp_tensor *g, const gdp_tensor *c, double tol) {
  CHECK(g && c, "%s: missing result (gpu %p, cpu %p)", what, (const void *)g, (const void *)c);
  if (!g || !c) return;
  const int64_t n = gdp_tensor_numel(c);
  CHECK(gdp_tensor_numel(g) == n, "%s: %lld elements on cuda, %lld on the cpu", what,
        (long long)gdp_tensor_numel(g), (long long)n);
  if (gdp_tensor_numel(g) != n) return;
  double *a = malloc((size_t)(n ? n : 1) * sizeof *a), *b = malloc((size_t)(n ? n : 1) * sizeof *b);
  CHECK_OK(gdp_tensor_to_host(g, GDP_DTYPE_F64, a, (size_t)n * sizeof(double)));
  CHECK_OK(gdp_tensor_to_host(c, GDP_DTYPE_F64, b, (size_t)n * sizeof(double)));
  double norm = 0;
  for (int64_t i = 0; i < n; i++) norm += b[i] * b[i];
  const double err = tu_rel_err_f64(a, b, n);
  CHECK(norm > 0, "%s: the reference is all zeros", what);
  CHECK(err <= tol, "%s: relative error %.3e > %.1e", what, err, tol);
  free(a);
  free(b);
}

int tu_cuda_main(const char *name, uint64_t seed, void (*run)(gdp_ctx *cpu, gdp_ctx *gpu)) {
  if (gdp_device_count(GDP_DEVICE_CUDA) == 0) {
    printf("SKIP: no CUDA device\n");
    return 77;
  }
  tu_begin(name, seed);
  const int64_t baseline = gdp_mem_live_bytes(GDP_DEVICE_CUDA);
  gdp_ctx *cpu = NULL, *gpu = NULL;
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &cpu));
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CUDA, 0, &gpu));
  if (!cpu || !gpu) return tu_end();
  run(cpu, gpu);
  CHECK_OK(gdp_ctx_sync(gpu));
  gdp_ctx_free(gpu); /* with the workspaces the ops keep in it */
  gdp_ctx_free(cpu);
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CUDA) == baseline,
        "cuda live bytes: %lld after freeing everything, %lld at the start",
        (long long)gdp_mem_live_bytes(GDP_DEVICE_CUDA), (long long)baseline);
  return tu_end();
}

void tu_fail(const char *file, int line, const char *fmt, ...) {
  tu_failures++;
  const char *base = strrchr(file, '/');
  printf("FAIL %s:%d: ", base ? base + 1 : file, line);
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  printf("  [seed %" PRIu64 "]\n", tu_seed);
  fflush(stdout);
}

gdp_tensor *tu_tensor_from_f64(gdp_ctx *ctx, gdp_dtype dtype, int nd, const int64_t *shape,
                               const double *v) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++) n *= shape[i];
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, dtype, nd, shape, GDP_DTYPE_F64, v, (size_t)n * sizeof(double),
                                &t));
  return t;
}

void tu_check_err(gdp_status got, gdp_status want, const char *needle, const char *expr,
                  const char *file, int line) {
  tu_checks++;
  if (got != want) {
    tu_fail(file, line, "%s -> %s, expected %s (message: %s)", expr, gdp_status_name(got),
            gdp_status_name(want), gdp_last_error());
  } else if (needle && !strstr(gdp_last_error(), needle)) {
    tu_fail(file, line, "%s: message lacks \"%s\": %s", expr, needle, gdp_last_error());
  }
}

double tu_rel_err_f64(const double *a, const double *b, int64_t n) {
  double d = 0, r = 0;
  for (int64_t i = 0; i < n; i++) {
    if (!isfinite(a[i]) || !isfinite(b[i])) return NAN;
    d += (a[i] - b[i]) * (a[i] - b[i]);
    r += b[i] * b[i];
  }
  if (r == 0) return d == 0 ? 0.0 : INFINITY;
  return sqrt(d) / sqrt(r);
}

double tu_rel_err_f32(const float *a, const double *b, int64_t n) {
  double d = 0, r = 0;
  for (int64_t i = 0; i < n; i++) {
    if (!isfinite(a[i]) || !isfinite(b[i])) return NAN;
    d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    r += b[i] * b[i];
  }
  if (r == 0) return d == 0 ? 0.0 : INFINITY;
  return sqrt(d) / sqrt(r);
}

/* splitmix64 (Steele, Lea, Flood 2014) */
uint64_t tu_rand_u64(void) {
  uint64_t z = (tu_state += UINT64_C(0x9E3779B97F4A7C15));
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  return z ^ (z >> 31);
}

double tu_rand_uniform(double lo, double hi) {
  double u = (double)(tu_rand_u64() >> 11) * (1.0 / 9007199254740992.0); /* [0, 1) */
  return lo + (hi - lo) * u;
}

double tu_rand_normal(void) {
  double u1 = 1.0 - tu_rand_uniform(0, 1); /* (0, 1] */
  double u2 = tu_rand_uniform(0, 1);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
