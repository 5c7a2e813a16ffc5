/*
 * swiglu.cu -- the SwiGLU gate on cuda, with the semantics of kernels/cpu/swiglu.c:
 *   out = gate s up, s = sigmoid(gate);  d_up = d_out gate s,
 *   d_gate = d_out up s (1 + gate (1 - s)).
 * One grid-stride loop per direction.
 */
#include "../mixer/common.cuh"
#include "nn_cuda.h"

namespace gdp_mixer {
namespace {

template <typename IO>
__global__ void silu_mul_fwd_kernel(int64_t n, const IO *gate, const IO *up, IO *out) {
  typedef typename Math<IO>::type A;
  GDP_MIXER_FOR(i, n) {
    const A g = ld(gate, i);
    st(out, i, g * sigmoid(g) * ld(up, i));
  }
}

template <typename IO>
__global__ void silu_mul_bwd_kernel(int64_t n, const IO *gate, const IO *up, const IO *d_out,
                                    IO *d_gate, IO *d_up) {
  typedef typename Math<IO>::type A;
  GDP_MIXER_FOR(i, n) {
    const A g = ld(gate, i), s = sigmoid(g), d = ld(d_out, i);
    if (d_up) st(d_up, i, d * g * s);
    if (d_gate) st(d_gate, i, d * ld(up, i) * s * ((A)1 + g * ((A)1 - s)));
  }
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

extern "C" gdp_status gdp_cuda_silu_mul_fwd(int dtype, int64_t n, const void *gate,
                                            const void *up, void *out, void *stream) {
  static const char *func = "gdp_cuda_silu_mul_fwd";
  if (n == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     silu_mul_fwd_kernel<IO><<<grid_for(n), THREADS, 0, (cudaStream_t)stream>>>(
                         n, (const IO *)gate, (const IO *)up, (IO *)out));
  return launched(func, "silu_mul_fwd_kernel");
}

extern "C" gdp_status gdp_cuda_silu_mul_bwd(int dtype, int64_t n, const void *gate,
                                            const void *up, const void *d_out, void *d_gate,
                                            void *d_up, void *stream) {
  static const char *func = "gdp_cuda_silu_mul_bwd";
  if (n == 0 || (!d_gate && !d_up)) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     silu_mul_bwd_kernel<IO><<<grid_for(n), THREADS, 0, (cudaStream_t)stream>>>(
                         n, (const IO *)gate, (const IO *)up, (const IO *)d_out, (IO *)d_gate,
                         (IO *)d_up));
  return launched(func, "silu_mul_bwd_kernel");
}
