/*
 * inputs.cu -- the mixer's input stage on cuda, with the semantics of
 * kernels/cpu/mixer_inputs.c (layouts in ../../mixer_problem.h).
 *
 * Forward, one kernel: a block per token row r = (t, b) (or per few rows, when a row
 * has too few packs to keep a block's threads busy) reads the row's conv output
 * once (V, K, Q: M*nh*P + M*ng*N + ng*N elements) and writes its slices of v, k, q
 * (M*nh*P + M*nh*N + nh*N elements, contiguous per row on the operator's side as
 * well), then beta and g from the row's gate sections.  Threads walk the row's output
 * in 16-byte packs (8 bf16, 4 f32, 2 f64) so that consecutive threads load and store
 * consecutive packs; a group's K/Q pack is read by its nh/ng heads from L1/L2, not
 * from DRAM again.  Sizes or pointers that do not allow 16-byte packs take the same
 * kernel with packs of one element.
 *
 * Backward: the same walk over the row of dxBC, which it writes whole (no zero fill):
 * dv (+ dx_v for m = 0), and for each group the sum of its heads' dk and dq packs in
 * the math type (float32 for bf16), rounded once.  Then the gates per (row, head) with
 * the deterministic two-pass column sums of common.cuh: pass 1 writes db and da and
 * each row chunk's partial dA_log, ddt_bias; pass 2 adds the chunks in a fixed order.
 *
 * With silu (a layer without short conv) the forward reads xBC through SiLU and the
 * backward reads xBC again to multiply each dxBC pack by SiLU's derivative, so the
 * SiLU's own pass over the row (a write and a read of it each way) is gone.
 *
 * Traffic per token row at the bench shape (bf16, nh 16 x 128, ng 4 x 128, M 2):
 * forward 11 KB in, 20 KB out; backward 20 KB (+ 4 KB dx_v) in, 11 KB out.
 */
#include "common.cuh"

namespace gdp_mixer {
namespace {

enum { SOFTPLUS_THRESHOLD = 20, INPUTS_THREADS = 256 };

template <typename A> __device__ __forceinline__ A softplus(A x) {
  return x > (A)SOFTPLUS_THRESHOLD ? x : m_log1p(m_exp(x));
}
template <typename A> __device__ __forceinline__ A softplus_grad(A x) {
  return x > (A)SOFTPLUS_THRESHOLD ? (A)1 : sigmoid(x);
}

/* The sizes as the kernels use them: in-row offsets fit in 32 bits (a row is one token). */
struct Dims {
  int64_t T, B, rows;
  int nh, P, ng, N, M, rep;
  int rpb;  /* token rows per block (rows_per_block) */
  int silu; /* xBC is the pre-activation (a layer without short conv) */
  int64_t ld_x, ld_b, ld_a, ld_dx, ld_db, ld_da;
  double scale;
};

/* A pack of xBC as the forward reads it: through SiLU when act. */
template <typename IO, int VEC>
__device__ __forceinline__ Pack<IO, VEC> input_pack(const IO *p, int act) {
  Pack<IO, VEC> v = ld_pack<IO, VEC>(p);
  if (act) {
#pragma unroll
    for (int i = 0; i < VEC; i++) {
      const typename Math<IO>::type u = ld(v.e, i);
      st(v.e, i, u * sigmoid(u));
    }
  }
  return v;
}

template <typename IO, int VEC>
__global__ void __launch_bounds__(INPUTS_THREADS)
    inputs_fwd_kernel(Dims d, const IO *__restrict__ xBC, const IO *__restrict__ b,
                      const IO *__restrict__ a, const typename Math<IO>::type *__restrict__ A_log,
                      const typename Math<IO>::type *__restrict__ dt_bias, IO *__restrict__ q,
                      IO *__restrict__ k, IO *__restrict__ v, IO *__restrict__ beta,
                      typename Math<IO>::type *__restrict__ g) {
  typedef typename Math<IO>::type A;
  const int hP = d.nh * d.P, hN = d.nh * d.N;
  const int nv = d.M * hP / VEC, nk = d.M * hN / VEC, nq = hN / VEC;
  const int k_off = d.M * hP, q_off = k_off + d.M * d.ng * d.N;
  const int per = nv + nk + nq;
  for (int64_t r0 = (int64_t)blockIdx.x * d.rpb; r0 < d.rows; r0 += (int64_t)gridDim.x * d.rpb) {
    const int nr = d.rows - r0 < d.rpb ? (int)(d.rows - r0) : d.rpb;
    for (int w = threadIdx.x; w < nr * per; w += blockDim.x) {
      const int64_t r = r0 + w / per, t = r / d.B, bt = (r % d.B) * d.T + t;
      const IO *x = xBC + r * d.ld_x;
      const int u = w % per;
      if (u < nv) {
        const int e = u * VEC;
        st_pack<IO, VEC>(v + bt * d.M * hP + e, input_pack<IO, VEC>(x + e, d.silu));
      } else if (u < nv + nk) {
        const int e = (u - nv) * VEC, m = e / hN, h = (e % hN) / d.N, n = e % d.N;
        st_pack<IO, VEC>(k + bt * d.M * hN + e,
                         input_pack<IO, VEC>(x + k_off + (m * d.ng + h / d.rep) * d.N + n, d.silu));
      } else {
        const int e = (u - nv - nk) * VEC, h = e / d.N, n = e % d.N;
        st_pack<IO, VEC>(q + bt * hN + e, input_pack<IO, VEC>(x + q_off + (h / d.rep) * d.N + n, d.silu));
      }
    }
    const A sc = (A)d.scale;
    const int nb = d.M * d.nh;
    for (int w = threadIdx.x; w < nr * nb; w += blockDim.x) {
      const int64_t r = r0 + w / nb, t = r / d.B, bt = (r % d.B) * d.T + t;
      const int j = w % nb;
      st(beta, bt * nb + j, sc * sigmoid(ld(b, r * d.ld_b + j)));
    }
    if (g)
      for (int w = threadIdx.x; w < nr * d.nh; w += blockDim.x) {
        const int64_t r = r0 + w / d.nh, t = r / d.B, bt = (r % d.B) * d.T + t;
        const int h = w % d.nh;
        const A xa = ld(a, r * d.ld_a + h) + (dt_bias ? dt_bias[h] : (A)0);
        g[bt * d.nh + h] = -m_exp(A_log[h]) * softplus(xa);
      }
  }
}

template <typename IO, int VEC>
__global__ void __launch_bounds__(INPUTS_THREADS)
    inputs_bwd_kernel(Dims d, const IO *__restrict__ dq, const IO *__restrict__ dk,
                      const IO *__restrict__ dv, const IO *__restrict__ dx_v,
                      const IO *__restrict__ xBC, IO *__restrict__ dxBC) {
  typedef typename Math<IO>::type A;
  const int hP = d.nh * d.P, hN = d.nh * d.N, gN = d.ng * d.N;
  const int nv = d.M * hP / VEC, nk = d.M * gN / VEC, nq = gN / VEC;
  const int k_off = d.M * hP, q_off = k_off + d.M * gN;
  const int per = nv + nk + nq;
  for (int64_t r0 = (int64_t)blockIdx.x * d.rpb; r0 < d.rows; r0 += (int64_t)gridDim.x * d.rpb) {
    const int nr = d.rows - r0 < d.rpb ? (int)(d.rows - r0) : d.rpb;
    for (int w = threadIdx.x; w < nr * per; w += blockDim.x) {
      const int64_t r = r0 + w / per, t = r / d.B, bt = (r % d.B) * d.T + t;
      IO *x = dxBC + r * d.ld_dx;
      const int u = w % per;
      A acc[VEC];
      int dst;
      if (u < nv) {
        const int e = u * VEC;
        ld_lanes<IO, VEC>(dv + bt * d.M * hP + e, acc);
        if (dx_v && e < hP) {
          A s[VEC];
          ld_lanes<IO, VEC>(dx_v + r * hP + e, s);
#pragma unroll
          for (int i = 0; i < VEC; i++) acc[i] += s[i];
        }
        dst = e;
      } else {
        /* a group's pack: the sum over its rep heads, in head order from zero */
        const int in_k = u < nv + nk;
        const int e = (in_k ? u - nv : u - nv - nk) * VEC;
        const int m = in_k ? e / gN : 0, gi = (e % gN) / d.N, n = e % d.N;
        const IO *src = in_k ? dk + (bt * d.M + m) * hN : dq + bt * hN;
#pragma unroll
        for (int i = 0; i < VEC; i++) acc[i] = (A)0;
        for (int j = 0; j < d.rep; j++) {
          A s[VEC];
          ld_lanes<IO, VEC>(src + (gi * d.rep + j) * d.N + n, s);
#pragma unroll
          for (int i = 0; i < VEC; i++) acc[i] += s[i];
        }
        dst = (in_k ? k_off : q_off) + e;
      }
      if (d.silu) { /* the pre-activation's gradient: silu'(u) = s (1 + u (1 - s)) */
        A u[VEC];
        ld_lanes<IO, VEC>(xBC + r * d.ld_x + dst, u);
#pragma unroll
        for (int i = 0; i < VEC; i++) {
          const A s = sigmoid(u[i]);
          acc[i] *= s * ((A)1 + u[i] * ((A)1 - s));
        }
      }
      st_lanes<IO, VEC>(x + dst, acc);
    }
  }
}

/* Pass 1 of the gates' backward, per (row r, head h): db for the M copies, da, and
 * row r's terms of dA_log (dg * g) and ddt_bias (da). */
template <typename IO> struct GatesBwd {
  typedef typename Math<IO>::type A;
  Dims d;
  const IO *b, *a, *dbeta;
  const A *A_log, *dt_bias, *dg;
  IO *db, *da;
  __device__ void operator()(int64_t r, int64_t h, A *acc) const {
    const int64_t t = r / d.B, bt = (r % d.B) * d.T + t;
    const A sc = (A)d.scale;
    for (int m = 0; m < d.M; m++) {
      const int j = m * d.nh + (int)h;
      const A s = sigmoid(ld(b, r * d.ld_b + j));
      st(db, r * d.ld_db + j, ld(dbeta, bt * d.M * d.nh + j) * sc * s * ((A)1 - s));
    }
    if (!a) return;
    const A xa = ld(a, r * d.ld_a + h) + (dt_bias ? dt_bias[h] : (A)0);
    const A Ah = m_exp(A_log[h]);
    const A dgv = dg[bt * d.nh + h];
    const A dx = -dgv * Ah * softplus_grad(xa);
    st(da, r * d.ld_da + h, dx);
    acc[0] += dgv * (-Ah * softplus(xa));
    acc[1] += dx;
  }
};

/* Rows per block: enough that a block's threads walk about four passes of packs, so
 * that rows of a few hundred packs (small heads) leave no warp idle on a second, short
 * pass; large rows keep a block each. */
static int rows_per_block(int packs) {
  const int want = (4 * INPUTS_THREADS + packs - 1) / (packs > 0 ? packs : 1);
  return want < 1 ? 1 : want > 16 ? 16 : want;
}

/* Blocks for d.rows rows, d.rpb a block. */
static unsigned inputs_grid(const Dims &d) { return row_grid((d.rows + d.rpb - 1) / d.rpb); }

static Dims dims_of(const gdp_ssm_inputs_problem *p) {
  Dims d;
  d.T = p->T, d.B = p->B, d.rows = p->T * p->B;
  d.nh = (int)p->nh, d.P = (int)p->P, d.ng = (int)p->ng, d.N = (int)p->N, d.M = (int)p->M;
  d.rep = (int)(p->nh / p->ng);
  d.ld_x = p->ld_xBC, d.ld_b = p->ld_b, d.ld_a = p->ld_a;
  d.ld_dx = p->ld_dxBC, d.ld_db = p->ld_db, d.ld_da = p->ld_da;
  d.scale = p->beta_scale;
  d.rpb = 1;
  d.silu = p->silu;
  return d;
}

/* 16-byte packs fit: P, N and the row strides are multiples of the pack, the buffers
 * 16-byte aligned. */
template <typename IO>
static int packs_fit(const gdp_ssm_inputs_problem *p, int64_t ld_rows, const void *const *ptrs,
                     int n) {
  const int64_t vec = Vec16<IO>::n;
  if (p->P % vec || p->N % vec || ld_rows % vec) return 0;
  for (int i = 0; i < n; i++)
    if (!aligned16(ptrs[i])) return 0;
  return 1;
}

template <typename IO>
static gdp_status inputs_fwd(const gdp_ssm_inputs_problem *p, const gdp_ssm_inputs_fwd_io *io,
                             cudaStream_t stream) {
  typedef typename Math<IO>::type A;
  Dims d = dims_of(p);
  const void *ptrs[4] = {io->xBC, io->q, io->k, io->v};
  const IO *x = (const IO *)io->xBC, *b = (const IO *)io->b, *a = (const IO *)io->a;
  const A *A_log = (const A *)io->A_log, *dt = (const A *)io->dt_bias;
  IO *q = (IO *)io->q, *k = (IO *)io->k, *v = (IO *)io->v, *beta = (IO *)io->beta;
  A *g = (A *)io->g;
  enum { VEC = Vec16<IO>::n };
  const int hP = d.nh * d.P, hN = d.nh * d.N;
  if (packs_fit<IO>(p, p->ld_xBC, ptrs, 4)) {
    d.rpb = rows_per_block((d.M * hP + d.M * hN + hN) / VEC);
    inputs_fwd_kernel<IO, VEC><<<inputs_grid(d), INPUTS_THREADS, 0, stream>>>(
        d, x, b, a, A_log, dt, q, k, v, beta, g);
  } else {
    d.rpb = rows_per_block(d.M * hP + d.M * hN + hN);
    inputs_fwd_kernel<IO, 1><<<inputs_grid(d), INPUTS_THREADS, 0, stream>>>(
        d, x, b, a, A_log, dt, q, k, v, beta, g);
  }
  return launched("gdp_cuda_ssm_inputs_fwd", "inputs_fwd_kernel");
}

template <typename IO>
static gdp_status inputs_bwd(const gdp_ssm_inputs_problem *p, const gdp_ssm_inputs_bwd_io *io,
                             void *workspace, cudaStream_t stream) {
  static const char *func = "gdp_cuda_ssm_inputs_bwd";
  typedef typename Math<IO>::type A;
  const Dims d = dims_of(p);
  const void *ptrs[6] = {io->dq, io->dk, io->dv, io->dx_v, io->dxBC, io->xBC};
  const IO *dq = (const IO *)io->dq, *dk = (const IO *)io->dk, *dv = (const IO *)io->dv;
  const IO *dx_v = (const IO *)io->dx_v;
  IO *dx = (IO *)io->dxBC;
  enum { VEC = Vec16<IO>::n };
  const int hP = d.nh * d.P, gN = d.ng * d.N;
  Dims walk = d; /* rows per block for the walk over dxBC (the gates' sums take rows alone) */
  const IO *xBC = (const IO *)io->xBC;
  if (packs_fit<IO>(p, p->ld_dxBC, ptrs, 6) && (!p->silu || p->ld_xBC % VEC == 0)) {
    walk.rpb = rows_per_block((d.M * hP + d.M * gN + gN) / VEC);
    inputs_bwd_kernel<IO, VEC><<<inputs_grid(walk), INPUTS_THREADS, 0, stream>>>(
        walk, dq, dk, dv, dx_v, xBC, dx);
  } else {
    walk.rpb = rows_per_block(d.M * hP + d.M * gN + gN);
    inputs_bwd_kernel<IO, 1><<<inputs_grid(walk), INPUTS_THREADS, 0, stream>>>(
        walk, dq, dk, dv, dx_v, xBC, dx);
  }
  GDP_TRY(launched(func, "inputs_bwd_kernel"));
  GatesBwd<IO> fn;
  fn.d = d;
  fn.b = (const IO *)io->b, fn.a = (const IO *)io->a, fn.dbeta = (const IO *)io->dbeta;
  fn.A_log = (const A *)io->A_log, fn.dt_bias = (const A *)io->dt_bias, fn.dg = (const A *)io->dg;
  fn.db = (IO *)io->db, fn.da = (IO *)io->da;
  A *outs[2] = {p->gate ? (A *)io->dA_log : NULL, p->gate ? (A *)io->ddt_bias : NULL};
  return colsum_run<2, A>(func, "inputs_gates_bwd", fn, d.rows, p->nh, 1, outs, workspace, stream);
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

extern "C" gdp_status gdp_cuda_ssm_inputs_fwd(const gdp_ssm_inputs_problem *p,
                                              const gdp_ssm_inputs_fwd_io *io, void *stream) {
  static const char *func = "gdp_cuda_ssm_inputs_fwd";
  if (p->T * p->B == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, p->dtype, return inputs_fwd<IO>(p, io, (cudaStream_t)stream));
  return GDP_OK;
}

extern "C" size_t gdp_cuda_ssm_inputs_bwd_workspace(const gdp_ssm_inputs_problem *p) {
  return colsum_bytes(2, p->T * p->B, p->nh);
}

extern "C" gdp_status gdp_cuda_ssm_inputs_bwd(const gdp_ssm_inputs_problem *p,
                                              const gdp_ssm_inputs_bwd_io *io, void *workspace,
                                              void *stream) {
  static const char *func = "gdp_cuda_ssm_inputs_bwd";
  /* no tokens: the kernels do nothing, and pass 2 of the sums writes zeros */
  GDP_MIXER_DISPATCH(func, p->dtype,
                     return inputs_bwd<IO>(p, io, workspace, (cudaStream_t)stream));
  return GDP_OK;
}
