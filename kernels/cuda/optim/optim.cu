/*
 * optim.cu -- the fused optimiser updates on cuda (../../optim_problem.h has the math;
 * optim_cuda.h the contract).  One grid-stride pass per parameter; the element loads
 * and stores are the mixer kernels' (bf16 widened to float32, rounded once on store).
 */
#include "../mixer/common.cuh"
#include "optim_cuda.h"

namespace gdp_optim {
namespace {

using gdp_mixer::bf16;
using gdp_mixer::ld;
using gdp_mixer::st;

/* Operations rounded one at a time (no contraction into fma), as on the CPU. */
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float root(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double root(double a) { return __dsqrt_rn(a); }

/* The update's scalars, rounded once to the state type S. */
template <typename S> struct Scalars {
  S lr, wd, b1, b2, c1, c2, eps, decay, step_size, bc2_sqrt, mom, keep;
  int nesterov, first, use_buf;
  explicit Scalars(const gdp_optim_update *u)
      : lr((S)u->lr), wd((S)u->weight_decay), b1((S)u->beta1), b2((S)u->beta2),
        c1((S)(1.0 - u->beta1)), c2((S)(1.0 - u->beta2)), eps((S)u->eps), decay((S)u->decay),
        step_size((S)u->step_size), bc2_sqrt((S)u->bc2_sqrt), mom((S)u->momentum),
        keep((S)(1.0 - u->dampening)), nesterov(u->nesterov), first(u->first),
        use_buf(u->state0 != nullptr) {}
};

/* P: param storage, G: grad, S: state and math.  master NULL: param is S itself. */
template <typename P, typename G, typename S>
__global__ void adamw_kernel(int64_t n, Scalars<S> c, P *param, const G *grad, S *master,
                             S *m_buf, S *v_buf) {
  GDP_MIXER_FOR(i, n) {
    const S g = (S)ld(grad, i);
    S p = master ? master[i] : (S)ld(param, i);
    p = mul(p, c.decay);
    const S m = add(mul(c.b1, m_buf[i]), mul(c.c1, g));
    const S v = add(mul(c.b2, v_buf[i]), mul(c.c2, mul(g, g)));
    m_buf[i] = m;
    v_buf[i] = v;
    p = sub(p, div(mul(c.step_size, m), add(div(root(v), c.bc2_sqrt), c.eps)));
    if (master) master[i] = p;
    st(param, i, p);
  }
}

template <typename P, typename G, typename S>
__global__ void sgd_kernel(int64_t n, Scalars<S> c, P *param, const G *grad, S *master,
                           S *buf) {
  GDP_MIXER_FOR(i, n) {
    const S p = master ? master[i] : (S)ld(param, i);
    S d = add((S)ld(grad, i), mul(c.wd, p));
    if (c.use_buf) {
      const S b = c.first ? d : add(mul(c.mom, buf[i]), mul(c.keep, d));
      buf[i] = b;
      d = c.nesterov ? add(d, mul(c.mom, b)) : b;
    }
    const S out = sub(p, mul(c.lr, d));
    if (master) master[i] = out;
    st(param, i, out);
  }
}

template <typename P, typename G, typename S>
gdp_status launch(const gdp_optim_update *u, cudaStream_t stream) {
  const Scalars<S> c(u);
  const unsigned grid = gdp_mixer::grid_for(u->n);
  P *param = (P *)u->param;
  const G *grad = (const G *)u->grad;
  S *master = (S *)u->master;
  if (u->kind == GDP_OPTIM_ADAMW)
    adamw_kernel<P, G, S><<<grid, gdp_mixer::THREADS, 0, stream>>>(u->n, c, param, grad, master,
                                                                   (S *)u->state0, (S *)u->state1);
  else
    sgd_kernel<P, G, S><<<grid, gdp_mixer::THREADS, 0, stream>>>(u->n, c, param, grad, master,
                                                                 (S *)u->state0);
  return gdp_mixer::launched("gdp_cuda_optim_update",
                             u->kind == GDP_OPTIM_ADAMW ? "the AdamW update" : "the SGD update");
}

}  // namespace
}  // namespace gdp_optim

extern "C" gdp_status gdp_cuda_optim_update(const gdp_optim_update *u, void *stream) {
  using namespace gdp_optim;
  cudaStream_t s = (cudaStream_t)stream;
  const int p = u->param_dtype, g = u->grad_dtype, sd = u->state_dtype;
  if (p == GDP_DTYPE_F64 && g == GDP_DTYPE_F64 && sd == GDP_DTYPE_F64)
    return launch<double, double, double>(u, s);
  if (p == GDP_DTYPE_F32 && g == GDP_DTYPE_F32 && sd == GDP_DTYPE_F32)
    return launch<float, float, float>(u, s);
  if (p == GDP_DTYPE_BF16 && g == GDP_DTYPE_BF16 && sd == GDP_DTYPE_F32)
    return launch<bf16, bf16, float>(u, s);
  if (p == GDP_DTYPE_BF16 && g == GDP_DTYPE_F32 && sd == GDP_DTYPE_F32)
    return launch<bf16, float, float>(u, s);
  return GDP_ERROR_IN("gdp_cuda_optim_update", GDP_ERR_UNSUPPORTED,
                      "no kernel for param %s, grad %s, state %s", gdp_dtype_name((gdp_dtype)p),
                      gdp_dtype_name((gdp_dtype)g), gdp_dtype_name((gdp_dtype)sd));
}
