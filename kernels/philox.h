/*
 * philox.h -- Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy as
 * 1, 2, 3", SC 2011) and the mapping from tensor elements to random numbers.
 *
 * Header-only and shared by the CPU backend (C) and the CUDA kernels (.cu), so that
 * the same seed and offset give bit-identical uniforms on every device.  Everything
 * that defines the stream lives here; a backend only loops over elements.
 *
 * The stream (gdp.h, gdp_tensor_uniform):
 *   element i of a tensor (row-major order) takes word  i % 4  of the Philox block
 *   numbered  offset + i / 4,  where block b is philox4x32_10(counter, key) with
 *     counter = { lo32(b), hi32(b), 0, 0 }   key = { lo32(seed), hi32(seed) }.
 *   uniform:  u01(w) = (w + 0.5) * 2^-32 in (0, 1), value = fma(hi - lo, u01, lo)
 *   normal:   Box-Muller on the word pairs (0,1) and (2,3) of a block:
 *             r = sqrt(-2 log u01(w_even)), theta = 2 pi u01(w_odd),
 *             even word -> r cos(theta), odd word -> r sin(theta);
 *             value = fma(std, z, mean), with log, sin and cos computed by
 *             gdp_philox_log and gdp_philox_sincos_2pi below (not libm).
 *   All in float64, then rounded once to the tensor's dtype.  The explicit fma()
 *   keeps compilers from contracting a*b+c differently on host and device.
 */
#ifndef GDP_KERNELS_PHILOX_H
#define GDP_KERNELS_PHILOX_H

#include <stdint.h>
#include <math.h>

#ifdef __CUDACC__
#define GDP_PHILOX_FN static inline __host__ __device__
#else
#define GDP_PHILOX_FN static inline
#endif

#define GDP_PHILOX_M0 0xD2511F53u
#define GDP_PHILOX_M1 0xCD9E8D57u
#define GDP_PHILOX_W0 0x9E3779B9u /* golden ratio */
#define GDP_PHILOX_W1 0xBB67AE85u /* sqrt(3) - 1 */

/* One Philox round: two 32x32 -> 64-bit products, then the S-box-free mix. */
GDP_PHILOX_FN void gdp_philox_round(uint32_t ctr[4], const uint32_t key[2]) {
  uint64_t p0 = (uint64_t)GDP_PHILOX_M0 * ctr[0];
  uint64_t p1 = (uint64_t)GDP_PHILOX_M1 * ctr[2];
  uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
  uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
  uint32_t c1 = ctr[1], c3 = ctr[3];
  ctr[0] = hi1 ^ c1 ^ key[0];
  ctr[1] = lo1;
  ctr[2] = hi0 ^ c3 ^ key[1];
  ctr[3] = lo0;
}

/* out = Philox4x32-10(counter, key); out may alias counter. */
GDP_PHILOX_FN void gdp_philox4x32_10_block(const uint32_t counter[4], const uint32_t key_in[2],
                                           uint32_t out[4]) {
  uint32_t c[4] = {counter[0], counter[1], counter[2], counter[3]};
  uint32_t k[2] = {key_in[0], key_in[1]};
  for (int r = 0; r < 10; r++) {
    if (r > 0) { /* the key schedule bumps the key before every round but the first */
      k[0] += GDP_PHILOX_W0;
      k[1] += GDP_PHILOX_W1;
    }
    gdp_philox_round(c, k);
  }
  out[0] = c[0];
  out[1] = c[1];
  out[2] = c[2];
  out[3] = c[3];
}

/* The 4 words of stream block `block` for `seed` (see the stream definition above). */
GDP_PHILOX_FN void gdp_philox_stream_block(uint64_t seed, uint64_t block, uint32_t out[4]) {
  uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), 0u, 0u};
  uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  gdp_philox4x32_10_block(ctr, key, out);
}

/* Element i (row-major) of a fill starting at block `offset` -> (block, word). */
GDP_PHILOX_FN void gdp_philox_element(uint64_t offset, uint64_t i, uint64_t *block, int *word) {
  *block = offset + (i >> 2);
  *word = (int)(i & 3u);
}

/* Blocks consumed by a fill of numel elements: ceil(numel / 4). */
GDP_PHILOX_FN uint64_t gdp_philox_blocks_for(uint64_t numel) { return (numel + 3u) >> 2; }

/* (w + 0.5) * 2^-32: exact in float64, strictly inside (0, 1), so log() is finite. */
GDP_PHILOX_FN double gdp_philox_u01_f64(uint32_t w) {
  return ((double)w + 0.5) * (1.0 / 4294967296.0);
}

/* The same number rounded to float.  May round up to 1.0f for w near 2^32 (float has
 * 24 bits); fine as a probability, not as an argument of log(1 - u). */
GDP_PHILOX_FN float gdp_philox_u01_f32(uint32_t w) { return (float)gdp_philox_u01_f64(w); }

/* Uniform value of one word on [lo, hi]. */
GDP_PHILOX_FN double gdp_philox_uniform(uint32_t w, double lo, double hi) {
  return fma(hi - lo, gdp_philox_u01_f64(w), lo);
}

/*
 * log and sin/cos for Box-Muller, built from IEEE-754 operations only (+ - * /,
 * sqrt, fma, frexp, rint), with every multiply-add written as fma() so that no
 * compiler can contract differently.  libm and CUDA's math library differ in the
 * last bits (and by more relative to results near zero), which would make normals
 * differ between devices; these give the same bits everywhere.  Accuracy: within
 * a few 1e-16 of the true values on the ranges used here, far below anything a
 * sample from a normal distribution can show.
 */

/* ln(u) for finite u > 0: u = m 2^e with m in [sqrt(1/2), sqrt(2)), then
 * ln(m) = 2 atanh(s), s = (m-1)/(m+1), |s| <= 0.1716, as an odd series in s. */
GDP_PHILOX_FN double gdp_philox_log(double u) {
  int e;
  double m = frexp(u, &e); /* m in [0.5, 1) */
  if (m < 0.70710678118654752440) {
    m = m * 2.0;
    e = e - 1;
  }
  double s = (m - 1.0) / (m + 1.0);
  double s2 = s * s;
  /* 1/(2k+1) for k = 11 down to 1 (s^23 / 23 < 1e-19) */
  double p = 0.043478260869565217391; /* 1/23 */
  p = fma(p, s2, 0.047619047619047619048); /* 1/21 */
  p = fma(p, s2, 0.052631578947368421053); /* 1/19 */
  p = fma(p, s2, 0.058823529411764705882); /* 1/17 */
  p = fma(p, s2, 0.066666666666666666667); /* 1/15 */
  p = fma(p, s2, 0.076923076923076923077); /* 1/13 */
  p = fma(p, s2, 0.090909090909090909091); /* 1/11 */
  p = fma(p, s2, 0.11111111111111111111);  /* 1/9 */
  p = fma(p, s2, 0.14285714285714285714);  /* 1/7 */
  p = fma(p, s2, 0.2);                     /* 1/5 */
  p = fma(p, s2, 0.33333333333333333333);  /* 1/3 */
  double two_s = 2.0 * s;
  double log_m = fma(two_s * s2, p, two_s);
  /* e ln2 with ln2 split so that e * LN2_HI is exact (|e| < 2^11) */
  const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
  return fma((double)e, ln2_hi, fma((double)e, ln2_lo, log_m));
}

/* sin(2 pi u) and cos(2 pi u) for u in [0, 1]: the quadrant from the exact turn
 * fraction (no large-argument reduction needed), then Taylor polynomials on
 * |x| <= pi/4 (x^19 / 19! < 1e-19). */
GDP_PHILOX_FN void gdp_philox_sincos_2pi(double u, double *sin_out, double *cos_out) {
  double q = rint(4.0 * u);      /* quadrant 0..4 */
  double f = fma(-0.25, q, u);   /* exact: u - q/4 in [-1/8, 1/8] */
  double x = f * 6.283185307179586476925286766559;
  double x2 = x * x;
  /* sin x = x + x^3 (-1/3! + x^2/5! - ...) */
  double ps = 2.8114572543455207632e-15;  /* 1/17! */
  ps = fma(ps, x2, -7.6471637318198164759e-13); /* -1/15! */
  ps = fma(ps, x2, 1.6059043836821614599e-10);  /* 1/13! */
  ps = fma(ps, x2, -2.5052108385441718775e-08); /* -1/11! */
  ps = fma(ps, x2, 2.7557319223985890653e-06);  /* 1/9! */
  ps = fma(ps, x2, -1.9841269841269841270e-04); /* -1/7! */
  ps = fma(ps, x2, 8.3333333333333333333e-03);  /* 1/5! */
  ps = fma(ps, x2, -1.6666666666666666667e-01); /* -1/3! */
  double sin_x = fma(x * x2, ps, x);
  /* cos x = 1 + x^2 (-1/2! + x^2/4! - ...) */
  double pc = -1.5619206968586225472e-16;      /* -1/18! */
  pc = fma(pc, x2, 4.7794773323873852974e-14);  /* 1/16! */
  pc = fma(pc, x2, -1.1470745597729724714e-11); /* -1/14! */
  pc = fma(pc, x2, 2.0876756987868098979e-09);  /* 1/12! */
  pc = fma(pc, x2, -2.7557319223985890653e-07); /* -1/10! */
  pc = fma(pc, x2, 2.4801587301587301587e-05);  /* 1/8! */
  pc = fma(pc, x2, -1.3888888888888888889e-03); /* -1/6! */
  pc = fma(pc, x2, 4.1666666666666666667e-02);  /* 1/4! */
  pc = fma(pc, x2, -0.5);                       /* -1/2! */
  double cos_x = fma(pc, x2, 1.0);
  switch ((int)q & 3) { /* 2 pi u = x + q pi/2 */
    case 0: *sin_out = sin_x; *cos_out = cos_x; break;
    case 1: *sin_out = cos_x; *cos_out = -sin_x; break;
    case 2: *sin_out = -sin_x; *cos_out = -cos_x; break;
    default: *sin_out = -cos_x; *cos_out = sin_x; break;
  }
}

/* Standard normal of word `word` (0..3) of a block: Box-Muller on the block's pair. */
GDP_PHILOX_FN double gdp_philox_std_normal(const uint32_t words[4], int word) {
  int even = word & 2;
  double r = sqrt(-2.0 * gdp_philox_log(gdp_philox_u01_f64(words[even])));
  double s, c;
  gdp_philox_sincos_2pi(gdp_philox_u01_f64(words[even + 1]), &s, &c);
  return (word & 1) ? r * s : r * c;
}

GDP_PHILOX_FN double gdp_philox_normal(const uint32_t words[4], int word, double mean,
                                       double std) {
  return fma(std, gdp_philox_std_normal(words, word), mean);
}

/* All four normals of a block at once (one log, sqrt and sin/cos per pair); the
 * same operations as gdp_philox_normal, so the same bits. */
GDP_PHILOX_FN void gdp_philox_normal4(const uint32_t words[4], double mean, double std,
                                      double out[4]) {
  for (int even = 0; even < 4; even += 2) {
    double r = sqrt(-2.0 * gdp_philox_log(gdp_philox_u01_f64(words[even])));
    double s, c;
    gdp_philox_sincos_2pi(gdp_philox_u01_f64(words[even + 1]), &s, &c);
    out[even] = fma(std, r * c, mean);
    out[even + 1] = fma(std, r * s, mean);
  }
}

#endif /* GDP_KERNELS_PHILOX_H */
