/*
 * rng.c -- the raw Philox 4x32-10 block, exposed for known-answer tests.  The
 * stream used by random fills is defined in kernels/philox.h, shared with CUDA.
 */
#include "internal.h"
#include "philox.h"

void gdp_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
  if (!counter || !key || !out) return;
  gdp_philox4x32_10_block(counter, key, out);
}
