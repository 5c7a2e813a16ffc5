/*
 * swiglu.cu -- the SwiGLU gate on cuda, with the semantics of kernels/cpu/swiglu.c:
 *   out = gate s up, s = sigmoid(gate);  d_up = d_out gate s,
 *   d_gate = d_out up s (1 + gate (1 - s)).
 * One grid-stride loop per direction, over 16-byte packs when the buffers are aligned
 * (then the few elements past the last whole pack).
 */
#include "../mixer/common.cuh"
#include "nn_cuda.h"

namespace gdp_mixer {
namespace {

template <typename A> __device__ __forceinline__ A silu_mul(A g, A u) { return g * sigmoid(g) * u; }

/* d_gate, d_up of one element (either output may be skipped). */
template <typename A>
__device__ __forceinline__ void silu_mul_grad(A g, A u, A d, A *dg, A *du) {
  const A s = sigmoid(g);
  *du = d * g * s;
  *dg = d * u * s * ((A)1 + g * ((A)1 - s));
}

/* Packs of VEC elements (16-byte loads and stores: every buffer aligned), then the
 * n % VEC elements left, one a thread. */
template <typename IO, int VEC>
__global__ void silu_mul_fwd_kernel(int64_t n, const IO *gate, const IO *up, IO *out) {
  typedef typename Math<IO>::type A;
  const int64_t packs = n / VEC;
  GDP_MIXER_FOR(p, packs) {
    A g[VEC], u[VEC];
    ld_lanes<IO, VEC>(gate + p * VEC, g);
    ld_lanes<IO, VEC>(up + p * VEC, u);
#pragma unroll
    for (int i = 0; i < VEC; i++) g[i] = silu_mul(g[i], u[i]);
    st_lanes<IO, VEC>(out + p * VEC, g);
  }
  GDP_MIXER_FOR(k, n - packs * VEC) {
    const int64_t i = packs * VEC + k;
    st(out, i, silu_mul(ld(gate, i), ld(up, i)));
  }
}

template <typename IO, int VEC>
__global__ void silu_mul_bwd_kernel(int64_t n, const IO *gate, const IO *up, const IO *d_out,
                                    IO *d_gate, IO *d_up) {
  typedef typename Math<IO>::type A;
  const int64_t packs = n / VEC;
  GDP_MIXER_FOR(p, packs) {
    A g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
    ld_lanes<IO, VEC>(gate + p * VEC, g);
    ld_lanes<IO, VEC>(up + p * VEC, u);
    ld_lanes<IO, VEC>(d_out + p * VEC, d);
#pragma unroll
    for (int i = 0; i < VEC; i++) silu_mul_grad(g[i], u[i], d[i], &dg[i], &du[i]);
    if (d_gate) st_lanes<IO, VEC>(d_gate + p * VEC, dg);
    if (d_up) st_lanes<IO, VEC>(d_up + p * VEC, du);
  }
  GDP_MIXER_FOR(k, n - packs * VEC) {
    const int64_t i = packs * VEC + k;
    A dg, du;
    silu_mul_grad(ld(gate, i), ld(up, i), ld(d_out, i), &dg, &du);
    if (d_gate) st(d_gate, i, dg);
    if (d_up) st(d_up, i, du);
  }
}

template <typename IO>
static void silu_mul_fwd(int64_t n, const void *gate, const void *up, void *out,
                         cudaStream_t stream) {
  enum { VEC = Vec16<IO>::n };
  if (aligned16(gate) && aligned16(up) && aligned16(out))
    silu_mul_fwd_kernel<IO, VEC><<<grid_for(n / VEC + 1), THREADS, 0, stream>>>(
        n, (const IO *)gate, (const IO *)up, (IO *)out);
  else
    silu_mul_fwd_kernel<IO, 1><<<grid_for(n), THREADS, 0, stream>>>(n, (const IO *)gate,
                                                                   (const IO *)up, (IO *)out);
}

template <typename IO>
static void silu_mul_bwd(int64_t n, const void *gate, const void *up, const void *d_out,
                         void *d_gate, void *d_up, cudaStream_t stream) {
  enum { VEC = Vec16<IO>::n };
  if (aligned16(gate) && aligned16(up) && aligned16(d_out) && aligned16(d_gate) &&
      aligned16(d_up))
    silu_mul_bwd_kernel<IO, VEC><<<grid_for(n / VEC + 1), THREADS, 0, stream>>>(
        n, (const IO *)gate, (const IO *)up, (const IO *)d_out, (IO *)d_gate, (IO *)d_up);
  else
    silu_mul_bwd_kernel<IO, 1><<<grid_for(n), THREADS, 0, stream>>>(
        n, (const IO *)gate, (const IO *)up, (const IO *)d_out, (IO *)d_gate, (IO *)d_up);
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

extern "C" gdp_status gdp_cuda_silu_mul_fwd(int dtype, int64_t n, const void *gate,
                                            const void *up, void *out, void *stream) {
  static const char *func = "gdp_cuda_silu_mul_fwd";
  if (n == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     silu_mul_fwd<IO>(n, gate, up, out, (cudaStream_t)stream));
  return launched(func, "silu_mul_fwd_kernel");
}

extern "C" gdp_status gdp_cuda_silu_mul_bwd(int dtype, int64_t n, const void *gate,
                                            const void *up, const void *d_out, void *d_gate,
                                            void *d_up, void *stream) {
  static const char *func = "gdp_cuda_silu_mul_bwd";
  if (n == 0 || (!d_gate && !d_up)) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     silu_mul_bwd<IO>(n, gate, up, d_out, d_gate, d_up, (cudaStream_t)stream));
  return launched(func, "silu_mul_bwd_kernel");
}
