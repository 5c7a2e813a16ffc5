/*
 * state_tracking.h -- the synthetic state-tracking tasks (gdp.h, gdp_data_state_tracking)
 * as kernels see them: the problem, the draw of every token from the Philox stream and
 * the scan that labels a sequence.  Header-only and shared by the CPU kernel (C) and the
 * CUDA kernel (.cu), so that one (seed, offset) gives the same sequences on every device.
 *
 * A task is a finite group of n elements numbered 0..n-1, the identity 0.  Sequence s
 * (row b of a batch drawn at `offset` is s = offset + b) has tokens x_0, x_1, ... drawn
 * uniformly from the group, and labels the prefix products
 *   y_0 = x_0,   y_t = y_{t-1} * x_t   (= x_0 * x_1 * ... * x_t).
 * The product is (a + b) mod n for the cyclic groups (parity: n = 2; modular addition:
 * n = m) and a lookup table mul[a * n + b] for the permutation groups (the op layer,
 * core/src/op_data.c, builds it and documents the numbering of the elements).
 *
 * The stream: token t of sequence s is word t % 4 of the Philox 4x32-10 block
 *   counter = { lo32(t/4), hi32(t/4), lo32(s), hi32(s) | 2^31 },  key = { lo32(seed), hi32(seed) }
 * as the integer floor(w * n / 2^32) of that word w (each token is off uniform by less
 * than n / 2^32 relative, under 3e-8 for S5).  The top bit of counter word 3 keeps
 * these blocks apart from the random fills' (kernels/philox.h: words 2 and 3 are 0
 * there), so data and parameters drawn with one seed are independent.  A token depends
 * only on (seed, s, t): the first T tokens of a sequence are the same whatever length
 * is drawn, and sets drawn at disjoint ranges of s share no sequence.
 */
#ifndef GDP_KERNELS_STATE_TRACKING_H
#define GDP_KERNELS_STATE_TRACKING_H

#include <stdint.h>

#include "philox.h"

#ifdef __CUDACC__
#define GDP_STATE_FN static inline __host__ __device__
#else
#define GDP_STATE_FN static inline
#endif

/* The largest order of a group given by a table (S5 has 120): elements fit in uint8 and
 * the CUDA kernel keeps the whole table in 16 KiB of shared memory. */
enum { GDP_STATE_TABLE_MAX = 128 };

typedef struct gdp_state_tracking_problem {
  int64_t batch;           /* B sequences ... */
  int64_t length;          /* ... of T tokens each */
  uint64_t seed;
  uint64_t offset;         /* sequence index of row 0 (< 2^63 - batch) */
  int64_t num_elements;    /* n, the group's order (>= 1) */
  const uint8_t *mul;      /* [n*n] product table (host memory), or NULL: cyclic, (a+b) mod n */
  int32_t num_threads;     /* cpu worker threads */
} gdp_state_tracking_problem;

/* The 4 words of block `block` (tokens 4*block .. 4*block+3) of sequence `s`. */
GDP_STATE_FN void gdp_state_tracking_block(uint64_t seed, uint64_t s, uint64_t block,
                                           uint32_t out[4]) {
  const uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), (uint32_t)s,
                           (uint32_t)(s >> 32) | 0x80000000u};
  const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  gdp_philox4x32_10_block(ctr, key, out);
}

/* floor(w * n / 2^32): an element of 0..n-1 from one word. */
GDP_STATE_FN int32_t gdp_state_tracking_element(uint32_t w, int64_t n) {
  return (int32_t)(((uint64_t)w * (uint64_t)n) >> 32);
}

/* Tokens and labels of row b (sequence offset + b), T values each; `mul` is the product
 * table wherever the caller keeps it (host or device memory), NULL for a cyclic group. */
GDP_STATE_FN void gdp_state_tracking_row(const gdp_state_tracking_problem *p,
                                         const uint8_t *mul, int64_t b, int32_t *tokens,
                                         int32_t *labels) {
  const uint64_t s = p->offset + (uint64_t)b;
  const int64_t n = p->num_elements;
  uint32_t words[4];
  int64_t state = 0;
  for (int64_t t = 0; t < p->length; t++) {
    if ((t & 3) == 0) gdp_state_tracking_block(p->seed, s, (uint64_t)t >> 2, words);
    const int32_t x = gdp_state_tracking_element(words[t & 3], n);
    if (mul) {
      state = mul[state * n + x];
    } else { /* state, x < n: one conditional subtraction (a select, no branch) */
      state += x;
      state -= state >= n ? n : 0;
    }
    tokens[t] = x;
    labels[t] = (int32_t)state;
  }
}

#endif /* GDP_KERNELS_STATE_TRACKING_H */
