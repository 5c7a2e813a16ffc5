/*
 * mixer_problem.h -- the mixer layer's conv1d as the kernels see it: plain sizes and
 * raw pointers to contiguous row-major buffers of one dtype, no tensor objects.  Shared
 * by the op layer (core/src/op_mixer.c), the backend table and the kernels of every
 * device.  (The other mixer ops need only a few sizes, passed as arguments; see
 * core/src/backend_impl.h.)
 *
 *   x, out, dx [T,B,C]; wt [W,C] (tap-major: the transpose of Megatron's [C,1,W] weight,
 *   so that inner loops run over contiguous channels); dweight [C,W]; bias, dbias [C] or
 *   NULL; halo, dhalo [halo_len,B,C] or NULL.
 *
 * seq_start[t] is the first token of the sequence holding token t; a tap at s < seq_start[t]
 * reads the halo row halo_len+s when seq_start[t] == 0 and s >= -halo_len, else zero.
 */
#ifndef GDP_KERNELS_MIXER_PROBLEM_H
#define GDP_KERNELS_MIXER_PROBLEM_H

#include <stdint.h>

typedef struct gdp_conv1d_problem {
  int64_t T, B, C, W;
  const int64_t *seq_start; /* host array, T entries */
  int64_t halo_len;         /* 0 without a halo */
  int silu;                 /* fused SiLU after the bias */
  int num_threads;          /* CPU worker threads */
  int dtype;                /* gdp_dtype of every buffer: the compute dtype */
} gdp_conv1d_problem;

#endif /* GDP_KERNELS_MIXER_PROBLEM_H */
