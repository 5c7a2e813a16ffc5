/*
 * size_check.h -- size arithmetic that cannot wrap, for host code that computes how
 * much to allocate or passes sizes to BLAS (whose dimensions are int).  The one place
 * these checks live: a workspace size is a sum of products accumulated with
 * gdp_size_mac, and every BLAS dimension is checked with gdp_blas_int_ok.
 */
#ifndef GDP_SIZE_CHECK_H
#define GDP_SIZE_CHECK_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

/* *acc += a * b * c; returns 0 on overflow (then *acc is unspecified). */
static inline int gdp_size_mac(size_t *acc, size_t a, size_t b, size_t c) {
  size_t ab, abc;
  return !__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, &abc) &&
         !__builtin_add_overflow(*acc, abc, acc);
}

/* *out = a * b * c as a size_t from non-negative int64 sizes; returns 0 on overflow or
 * a negative size. */
static inline int gdp_size_product(size_t *out, int64_t a, int64_t b, int64_t c) {
  *out = 0;
  return a >= 0 && b >= 0 && c >= 0 && gdp_size_mac(out, (size_t)a, (size_t)b, (size_t)c);
}

/* Whether x fits a BLAS dimension or leading dimension (an int). */
static inline int gdp_blas_int_ok(int64_t x) { return x >= 0 && x <= INT_MAX; }

#endif /* GDP_SIZE_CHECK_H */
