/*
 * testutil.h -- tiny harness for the C tests (plain main, non-zero exit on failure).
 *
 *   int main(void) { TEST_BEGIN(seed); ... CHECK(cond, "fmt", ...); ... TEST_END(); }
 *
 * CHECK records a failure with file:line and keeps going; TEST_END prints the seed
 * and a closing "N passed, N failed" line and returns non-zero on any failure.
 */
#ifndef GDP_TESTUTIL_H
#define GDP_TESTUTIL_H

#include <stdint.h>
#include <stdio.h>

#include "gdp.h"

extern int tu_checks, tu_failures;
extern uint64_t tu_seed;

void tu_begin(const char *name, uint64_t seed);
int tu_end(void);
void tu_fail(const char *file, int line, const char *fmt, ...);

#define TEST_BEGIN(seed) tu_begin(__FILE__, (seed))
#define TEST_END() return tu_end()

/* ||g - c|| / ||c|| <= tol (g on any device, c its reference: on the cpu, say), with
 * c not all zeros (a case that would test nothing). */
void tu_expect_near(const char *what, const gdp_tensor *g, const gdp_tensor *c, double tol);

/* main() of a cuda C test: exit 77 (ctest: skipped) without a CUDA device, else
 * run(cpu, gpu) on a new cpu and a new cuda context, then a wait on the device, both
 * freed, and a check that the device's live bytes are back where they started. */
int tu_cuda_main(const char *name, uint64_t seed, void (*run)(gdp_ctx *cpu, gdp_ctx *gpu));
#define CUDA_TEST_MAIN(seed, run) \
  int main(void) { return tu_cuda_main(__FILE__, (seed), (run)); }
#define CHECK(cond, ...)                                   \
  do {                                                     \
    tu_checks++;                                           \
    if (!(cond)) tu_fail(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
/* A gdp call that must succeed; prints gdp_last_error() otherwise. */
#define CHECK_OK(expr)                                                                   \
  do {                                                                                   \
    gdp_status tu_s_ = (expr);                                                           \
    tu_checks++;                                                                         \
    if (tu_s_ != GDP_OK)                                                                 \
      tu_fail(__FILE__, __LINE__, "%s -> %s: %s", #expr, gdp_status_name(tu_s_),        \
              gdp_last_error());                                                         \
  } while (0)
/* A gdp call that must fail with `status` and a message containing `needle`. */
#define CHECK_ERR(expr, status, needle) tu_check_err((expr), (status), (needle), #expr, __FILE__, __LINE__)
void tu_check_err(gdp_status got, gdp_status want, const char *needle, const char *expr,
                  const char *file, int line);

/* A new tensor of `dtype` on ctx holding the float64 host values v (row-major); NULL
   (and a recorded failure) when the library refuses. */
gdp_tensor *tu_tensor_from_f64(gdp_ctx *ctx, gdp_dtype dtype, int nd, const int64_t *shape,
                               const double *v);

/* Relative error ||a-b|| / ||b|| of two host arrays (NaN if any is non-finite). */
double tu_rel_err_f64(const double *a, const double *b, int64_t n);
double tu_rel_err_f32(const float *a, const double *b, int64_t n);
/* Deterministic host random numbers for tests (splitmix64-based), independent of the
   library's Philox so that tests can check the library against it. */
uint64_t tu_rand_u64(void);
double tu_rand_uniform(double lo, double hi);
double tu_rand_normal(void);

#endif
