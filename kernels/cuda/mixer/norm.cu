/*
 * norm.cu -- the mixer's output norm (the D skip fused into the gated grouped RMSNorm)
 * and the row-wise L2 norm of q and k on cuda, with the semantics of
 * kernels/cpu/mixer_norm.c and l2norm.c (the output norm's formulas and strided
 * operands: ../../mixer_problem.h).
 *
 * Output norm: a team of tpg threads (a power of two: part of a warp, a warp, or a block
 * of up to 1024) owns one (token, group); each thread loads K vectors of V elements
 * (16 bytes when every operand allows it, else V = 1) of o, x_v, z and d_out into
 * registers, so each element is read once and the backward needs no second pass.
 * The group sums are team reductions in the math type (float32 for f32 and bf16:
 * shuffles, or shared memory when a team spans warps).  The backward (teams of at most
 * a 512-thread block for bf16, 256 otherwise) keeps the operands as loaded, in the I/O
 * type, and widens them where used, recomputing y, sigmoid(z) and x in its second pass:
 * bf16 is register-bounded to two 256-thread blocks per SM, so one block's loads overlap
 * the other's arithmetic.
 * It walks a fixed chunk of tokens per block for one group, keeps per-thread sums of
 * d_out * xh and d_o * x_v for its channels, adds its teams' sums in team order into
 * one partial row per (chunk, group), and rows_colsum (common.cuh) adds the rows'
 * columns in double: the same sizes give the same bits, no atomics.
 *
 * L2 norm: one warp per row.
 */
#include <string.h>

#include "common.cuh"

namespace gdp_mixer {
namespace {

enum {
  L2_ROWS_PER_BLOCK = 4,
  NORM_BLOCK = 256,        /* threads of a block of small teams */
  NORM_MAX_TEAM = 1024,    /* the widest team: one block */
  NORM_MAX_ELEMS = 16,     /* register elements per thread and operand before teams widen */
  NORM_MAX_K = 8,          /* vectors per thread at the widest team */
  NORM_TARGET_BLOCKS = 1024, /* backward: chunks x groups aimed at (a few waves) */
  NORM_SMEM_BYTES = 49152,  /* backward: the teams' sums in shared memory */
  NORM_RING_SMEM_BYTES = 98304 /* backward: with its ring of staged rows (two blocks per SM) */
};

/* The element offset of channel c of token (t, b) in an operand with strides s. */
__device__ __forceinline__ int64_t at(const gdp_tbhp_strides &s, int64_t t, int64_t b, int c,
                                      int P) {
  return t * s.t + b * s.b + (int64_t)(c / P) * s.h + c % P;
}

/* The same with the channel's head h = c / P and place pp = c % P worked out once: a
 * thread's channels are the same on every row, and the divisions would be a large part
 * of the backward's instructions. */
__device__ __forceinline__ int64_t at_hp(const gdp_tbhp_strides &s, int64_t t, int64_t b, int h,
                                         int pp) {
  return t * s.t + b * s.b + (int64_t)h * s.h + pp;
}

/* V consecutive elements widened to the math type (one 16-byte access when V > 1). */
template <int V, typename IO, typename A>
__device__ __forceinline__ void ldv(const IO *p, A *v) {
  if (V == 1) {
    v[0] = ld(p, 0);
  } else {
    const uint4 u = __ldg((const uint4 *)p);
    const IO *e = (const IO *)&u;
#pragma unroll
    for (int i = 0; i < V; i++) v[i] = ld(e, i);
  }
}
template <int V, typename IO, typename A>
__device__ __forceinline__ void stv(IO *p, const A *v) {
  if (V == 1) {
    st(p, 0, v[0]);
  } else {
    uint4 u;
    IO *e = (IO *)&u;
#pragma unroll
    for (int i = 0; i < V; i++) st(e, i, v[i]);
    *(uint4 *)p = u;
  }
}

/* Sum over a team of tpg threads; a team wider than a warp is the whole block. */
template <typename A> __device__ __forceinline__ A team_sum(A v, int tpg, A *shared) {
  if (tpg > 32) return block_sum(v, shared);
  for (int o = tpg >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename IO> struct NormArgs {
  gdp_out_norm_problem p;
  const IO *o, *x_v, *D, *z, *weight, *d_out;
  IO *out, *d_o, *dz, *dx_v;
  typename Math<IO>::type *partial; /* [chunks][2][d]: dweight, then dD per channel */
  int tpg;                /* team size */
  int64_t rows_per_chunk; /* backward: tokens per block */
};

/* A thread's share of its team's group: vector k covers channels c0 + (lane + k tpg) V. */
template <int V, int K> struct Slots {
  int lane, tpg, nv, c0;
  __device__ bool has(int k) const { return lane + k * tpg < nv; }
  __device__ int channel(int k) const { return c0 + (lane + k * tpg) * V; }
};

/* y = o + D x_v (xv keeps x_v), s = sigmoid(z), x = y z s into the arrays; returns the
 * thread's sum of x^2.  Slots not held (or tokens past the end) read as zeros. */
template <typename IO, int V, int K, typename A>
__device__ __forceinline__ A load_group(const NormArgs<IO> &a, const Slots<V, K> &sl, bool ok,
                                        int64_t t, int64_t b, A *y, A *xv, A *zz, A *sg, A *x) {
  const gdp_out_norm_problem &p = a.p;
  const int P = (int)p.P;
  A sum = (A)0;
#pragma unroll
  for (int k = 0; k < K; k++) {
    A *yk = y + k * V, *xk = x + k * V, *vk = xv + k * V, *zk = zz + k * V, *sk = sg + k * V;
#pragma unroll
    for (int i = 0; i < V; i++) yk[i] = vk[i] = zk[i] = (A)0, sk[i] = (A)0, xk[i] = (A)0;
    if (!ok || !sl.has(k)) continue;
    const int c = sl.channel(k);
    ldv<V>(a.o + at(p.o, t, b, c, P), yk);
    if (p.D_mode != GDP_OUT_NORM_NO_D) {
      ldv<V>(a.x_v + at(p.x_v, t, b, c, P), vk);
      A dv[V];
      if (p.D_mode == GDP_OUT_NORM_D_CHANNEL) ldv<V>(a.D + c, dv);
#pragma unroll
      for (int i = 0; i < V; i++)
        yk[i] += (p.D_mode == GDP_OUT_NORM_D_CHANNEL ? dv[i] : ld(a.D, c / P)) * vk[i];
    }
    if (a.z) ldv<V>(a.z + at(p.z, t, b, c, P), zk);
#pragma unroll
    for (int i = 0; i < V; i++) {
      if (a.z) {
        sk[i] = sigmoid(zk[i]);
        xk[i] = yk[i] * zk[i] * sk[i];
      } else {
        xk[i] = yk[i];
      }
      sum += xk[i] * xk[i];
    }
  }
  return sum;
}

template <typename IO, int V, int K>
__global__ void out_norm_fwd_kernel(NormArgs<IO> a) {
  typedef typename Math<IO>::type A;
  __shared__ A red[32];
  const gdp_out_norm_problem &p = a.p;
  const int tpg = a.tpg, team = threadIdx.x / tpg, teams = blockDim.x / tpg;
  const int gs = (int)p.group_size, P = (int)p.P;
  const Slots<V, K> sl = {(int)threadIdx.x % tpg, tpg, gs / V, (int)blockIdx.y * gs};
  const int64_t r = (int64_t)blockIdx.x * teams + team;
  const bool ok = r < p.T * p.B; /* no early exit: the team's reductions need every lane */
  const int64_t t = ok ? r / p.B : 0, b = ok ? r % p.B : 0;
  A y[K * V], xv[K * V], zz[K * V], sg[K * V], x[K * V];
  A sum = load_group<IO, V, K>(a, sl, ok, t, b, y, xv, zz, sg, x);
  sum = team_sum(sum, tpg, red);
  const A rstd = m_rsqrt(sum / (A)gs + (A)p.eps);
#pragma unroll
  for (int k = 0; k < K; k++) {
    if (!ok || !sl.has(k)) continue;
    const int c = sl.channel(k);
    A w[V], res[V];
    ldv<V>(a.weight + c, w);
#pragma unroll
    for (int i = 0; i < V; i++) res[i] = x[k * V + i] * rstd * w[i];
    stv<V>(a.out + at(p.out, t, b, c, P), res);
  }
}

/* The block's partial row `pass` of its chunk and group: the teams' sums acc, added in
 * team order through shared memory ([teams][gs] of the math type). */
template <typename IO, int V, int K, typename A>
__device__ __forceinline__ void stash_partial(const NormArgs<IO> &a, const Slots<V, K> &sl,
                                              int team, int teams, const A (&acc)[K * V],
                                              int pass) {
  extern __shared__ __align__(16) unsigned char norm_smem[];
  A *team_acc = (A *)norm_smem;
  const int gs = (int)a.p.group_size, d = (int)(a.p.H * a.p.P);
  A *row = a.partial + ((int64_t)blockIdx.x * 2 + pass) * d + sl.c0;
  if (teams == 1) { /* uniform: a lone team writes its sums straight out */
#pragma unroll
    for (int k = 0; k < K; k++) {
      if (!sl.has(k)) continue;
#pragma unroll
      for (int i = 0; i < V; i++) row[(sl.lane + k * sl.tpg) * V + i] = acc[k * V + i];
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < K; k++) {
    if (!sl.has(k)) continue;
    const int j = (sl.lane + k * sl.tpg) * V;
#pragma unroll
    for (int i = 0; i < V; i++) team_acc[team * gs + j + i] = acc[k * V + i];
  }
  __syncthreads();
  for (int j = threadIdx.x; j < gs; j += blockDim.x) {
    A s = (A)0;
    for (int tm = 0; tm < teams; tm++) s += team_acc[tm * gs + j];
    row[j] = s;
  }
  __syncthreads();
}

/* The backward's operands of one (token, group) as loaded: packs in the I/O type (half
 * the registers of widened bf16), widened where used, so that two blocks of teams fit
 * an SM's registers and their loads overlap each other's arithmetic. */
template <typename IO, int V, int K> struct BwdRow {
  Pack<IO, V> o[K], xv[K], z[K], go[K];
};

template <typename IO, int V, int K>
__device__ __forceinline__ void load_bwd_row(const NormArgs<IO> &a, const Slots<V, K> &sl,
                                             bool ok, int64_t t, int64_t b, const int (&hk)[K],
                                             const int (&pk)[K], BwdRow<IO, V, K> &r) {
  const gdp_out_norm_problem &p = a.p;
#pragma unroll
  for (int k = 0; k < K; k++) {
    r.o[k] = r.xv[k] = r.z[k] = r.go[k] = Pack<IO, V>();
    if (!ok || !sl.has(k)) continue;
    r.o[k] = ld_pack<IO, V>(a.o + at_hp(p.o, t, b, hk[k], pk[k]));
    r.go[k] = ld_pack<IO, V>(a.d_out + at_hp(p.d_out, t, b, hk[k], pk[k]));
    if (p.D_mode != GDP_OUT_NORM_NO_D) r.xv[k] = ld_pack<IO, V>(a.x_v + at_hp(p.x_v, t, b, hk[k], pk[k]));
    if (a.z) r.z[k] = ld_pack<IO, V>(a.z + at_hp(p.z, t, b, hk[k], pk[k]));
  }
}

/* Element i of vector k (channel c, head h): y = o + D x_v, s = sigmoid(z), x = y z s
 * (x = y without z). */
template <typename IO, int V, int K, typename A>
__device__ __forceinline__ void bwd_elem(const NormArgs<IO> &a, const BwdRow<IO, V, K> &r,
                                         int k, int i, int c, int h, A &y, A &zz, A &sg, A &x) {
  const gdp_out_norm_problem &p = a.p;
  y = ld(r.o[k].e, i);
  if (p.D_mode != GDP_OUT_NORM_NO_D)
    y += ld(a.D, p.D_mode == GDP_OUT_NORM_D_CHANNEL ? c + i : h) * ld(r.xv[k].e, i);
  zz = ld(r.z[k].e, i);
  sg = a.z ? sigmoid(zz) : (A)1;
  x = a.z ? y * zz * sg : y;
}

/* The backward's widest team (its block), and the registers that bounds: bf16 at 128
 * (two 256-thread blocks per SM, or one of 512), the wider types at 255 (one block of
 * 256). */
template <typename IO> struct BwdBounds {
  enum { max_team = sizeof(IO) == 2 ? 2 * NORM_BLOCK : NORM_BLOCK };
};

/* The rows a backward thread stages ahead (RING > 0: the operand packs of its next RING
 * rows in shared memory, after the teams' sums, [RING][4][K][blockDim]; 0: loaded when
 * used).  Chosen at launch (launch_bwd) when the ring fits. */
template <int K> struct BwdRing { enum { rows = K == 1 ? 4 : K == 2 ? 2 : 0 }; };

template <typename IO, int V, int K, int RING>
__global__ void __launch_bounds__(BwdBounds<IO>::max_team, 1)
    out_norm_bwd_kernel(NormArgs<IO> a, int ring_off) {
  typedef typename Math<IO>::type A;
  __shared__ A red[32];
  const gdp_out_norm_problem &p = a.p;
  const int tpg = a.tpg, team = threadIdx.x / tpg, teams = blockDim.x / tpg;
  const int gs = (int)p.group_size, P = (int)p.P;
  const Slots<V, K> sl = {(int)threadIdx.x % tpg, tpg, gs / V, (int)blockIdx.y * gs};
  const bool has_D = p.D_mode != GDP_OUT_NORM_NO_D;
  const int64_t R = p.T * p.B, r0 = (int64_t)blockIdx.x * a.rows_per_chunk;
  const int64_t r1 = r0 + a.rows_per_chunk < R ? r0 + a.rows_per_chunk : R;
  A acc_w[K * V], acc_D[K * V];
#pragma unroll
  for (int i = 0; i < K * V; i++) acc_w[i] = acc_D[i] = (A)0;
  int hk[K], pk[K]; /* vector k's head and place in it (a vector stays inside a head) */
#pragma unroll
  for (int k = 0; k < K; k++) hk[k] = sl.channel(k) / P, pk[k] = sl.channel(k) - hk[k] * P;
  /* row rr = t B + b, stepped by `teams` rows without a division per row */
  const int64_t dt = teams / p.B, db = teams % p.B;
  int64_t t = (r0 + team) / p.B, b = (r0 + team) % p.B;
  /* RING > 0: row i of this team (rr = r0 + team + i teams) is staged into slot i % RING,
   * one commit group per row (empty past r1), RING rows ahead */
  extern __shared__ __align__(16) unsigned char norm_smem[];
  Pack<IO, V> *ring = (Pack<IO, V> *)(norm_smem + ring_off);
  int64_t ts = t, bs = b; /* the next row to stage */
  int64_t rs = r0 + team;
  auto stage_row = [&](int i) {
    if (RING > 0) {
      const bool sok = rs < r1;
#pragma unroll
      for (int k = 0; k < K; k++) {
        const bool kok = sok && sl.has(k);
        Pack<IO, V> *slot =
            ring + ((int64_t)((i % (RING > 0 ? RING : 1)) * 4) * K + k) * blockDim.x + threadIdx.x;
        const int64_t kb = (int64_t)K * blockDim.x;
        stage<IO, V>(slot, kok ? a.o + at_hp(p.o, ts, bs, hk[k], pk[k]) : a.o, kok);
        stage<IO, V>(slot + kb, kok ? a.d_out + at_hp(p.d_out, ts, bs, hk[k], pk[k]) : a.o, kok);
        if (has_D) stage<IO, V>(slot + 2 * kb, kok ? a.x_v + at_hp(p.x_v, ts, bs, hk[k], pk[k]) : a.o, kok);
        if (a.z) stage<IO, V>(slot + 3 * kb, kok ? a.z + at_hp(p.z, ts, bs, hk[k], pk[k]) : a.o, kok);
      }
      stage_commit();
      rs += teams, ts += dt, bs += db;
      if (bs >= p.B) bs -= p.B, ts++;
    }
  };
#pragma unroll
  for (int i = 0; i < RING; i++) stage_row(i);
  int it = 0;
  for (int64_t base = r0; base < r1; base += teams, it++) { /* uniform over the block */
    const int64_t rr = base + team;
    const bool ok = rr < r1;
    BwdRow<IO, V, K> r;
    if (RING > 0) {
      stage_wait<(RING > 0 ? RING - 1 : 0)>();
      const Pack<IO, V> *slot =
          ring + ((int64_t)((it % (RING > 0 ? RING : 1)) * 4) * K) * blockDim.x + threadIdx.x;
      const int64_t kb = (int64_t)K * blockDim.x;
#pragma unroll
      for (int k = 0; k < K; k++) {
        r.o[k] = slot[k * blockDim.x], r.go[k] = slot[kb + k * blockDim.x];
        r.xv[k] = has_D ? slot[2 * kb + k * blockDim.x] : Pack<IO, V>();
        r.z[k] = a.z ? slot[3 * kb + k * blockDim.x] : Pack<IO, V>();
      }
    } else {
      load_bwd_row<IO, V, K>(a, sl, ok, t, b, hk, pk, r);
    }
    A sum = (A)0, dot = (A)0; /* sums of x^2 and of d_out * weight * x */
#pragma unroll
    for (int k = 0; k < K; k++) {
      if (!ok || !sl.has(k)) continue;
      const int c = sl.channel(k);
      A w[V];
      ldv<V>(a.weight + c, w);
#pragma unroll
      for (int i = 0; i < V; i++) {
        A y, zz, sg, x;
        bwd_elem<IO, V, K, A>(a, r, k, i, c, hk[k], y, zz, sg, x);
        sum += x * x;
        dot += ld(r.go[k].e, i) * w[i] * x;
      }
    }
    sum = team_sum(sum, tpg, red);
    dot = team_sum(dot, tpg, red);
    stage_row(it + RING); /* r's packs are used: its slot takes the row RING on */
    const A rstd = m_rsqrt(sum / (A)gs + (A)p.eps);
    const A cm = dot * rstd * rstd / (A)gs; /* mean of dxh * xh, over rstd */
#pragma unroll
    for (int k = 0; k < K; k++) {
      if (!ok || !sl.has(k)) continue;
      const int c = sl.channel(k);
      A w[V], dy[V], dzv[V], dxv[V];
      ldv<V>(a.weight + c, w);
#pragma unroll
      for (int i = 0; i < V; i++) {
        const int e = k * V + i;
        A y, zz, sg, x;
        bwd_elem<IO, V, K, A>(a, r, k, i, c, hk[k], y, zz, sg, x);
        const A go = ld(r.go[k].e, i);
        const A dx = rstd * (go * w[i] - x * cm);
        acc_w[e] += go * x * rstd;
        dy[i] = dx;
        if (a.z) {
          dy[i] = dx * zz * sg;
          dzv[i] = dx * y * sg * ((A)1 + zz * ((A)1 - sg));
        }
        if (has_D) {
          acc_D[e] += dy[i] * ld(r.xv[k].e, i);
          dxv[i] = ld(a.D, p.D_mode == GDP_OUT_NORM_D_CHANNEL ? c + i : hk[k]) * dy[i];
        }
      }
      if (a.d_o) stv<V>(a.d_o + at_hp(p.d_o, t, b, hk[k], pk[k]), dy);
      if (a.dz && a.z) stv<V>(a.dz + at_hp(p.dz, t, b, hk[k], pk[k]), dzv);
      if (a.dx_v && has_D) stv<V>(a.dx_v + at_hp(p.dx_v, t, b, hk[k], pk[k]), dxv);
    }
    t += dt, b += db;
    if (b >= p.B) b -= p.B, t++;
  }
  if (RING > 0) stage_wait<0>();
  if (!a.partial) return; /* uniform */
  stash_partial(a, sl, team, teams, acc_w, 0);
  if (has_D) stash_partial(a, sl, team, teams, acc_D, 1);
}

/* out[j] = the sum of tot[j*G .. j*G+G-1] (a warp per output, a fixed shuffle tree). */
template <typename T>
__global__ void out_norm_final_kernel(const double *tot, int64_t n, int64_t G, T *out) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t j = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; j < n; j += warps) {
    double s = 0.0;
    for (int64_t g = lane; g < G; g += 32) s += tot[j * G + g];
    s = warp_sum(s);
    if (lane == 0) st(out, j, (typename Math<T>::type)s);
  }
}

template <typename IO>
__global__ void l2norm_fwd_kernel(int64_t rows, int64_t dim, typename Math<IO>::type eps,
                                  const IO *x, IO *y) {
  typedef typename Math<IO>::type A;
  const int64_t row = (int64_t)blockIdx.x * L2_ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return; /* the whole warp */
  const IO *xi = x + row * dim;
  IO *yi = y + row * dim;
  A ss = (A)0;
  for (int64_t k = lane; k < dim; k += 32) {
    const A v = ld(xi, k);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const A r = m_rsqrt(ss + eps);
  for (int64_t k = lane; k < dim; k += 32) st(yi, k, ld(xi, k) * r);
}

template <typename IO>
__global__ void l2norm_bwd_kernel(int64_t rows, int64_t dim, typename Math<IO>::type eps,
                                  const IO *x, const IO *dy, IO *dx) {
  typedef typename Math<IO>::type A;
  const int64_t row = (int64_t)blockIdx.x * L2_ROWS_PER_BLOCK + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const IO *xi = x + row * dim, *dyi = dy + row * dim;
  IO *dxi = dx + row * dim;
  A ss = (A)0, xdy = (A)0;
  for (int64_t k = lane; k < dim; k += 32) {
    const A v = ld(xi, k);
    ss += v * v;
    xdy += v * ld(dyi, k);
  }
  ss = warp_sum(ss);
  xdy = warp_sum(xdy);
  const A r = m_rsqrt(ss + eps);
  const A ydy = r * xdy;
  for (int64_t k = lane; k < dim; k += 32) st(dxi, k, r * (ld(dyi, k) - ld(xi, k) * r * ydy));
}

/* How a problem is laid over threads. */
struct NormPlan {
  int V, K, tpg, teams;
  int64_t chunks, rows_per_chunk; /* backward */
};

static bool aligned16(const void *ptr) {
  return ptr == NULL || ((uintptr_t)ptr & 15u) == 0;
}

static bool strides_ok(const gdp_tbhp_strides &s, int V) {
  return s.t % V == 0 && s.b % V == 0 && s.h % V == 0;
}

/* 16-byte vectors when every channel vector stays inside a head and every operand the
 * call touches starts on a 16-byte boundary; else one element at a time. */
template <typename IO>
static int vector_width(const gdp_out_norm_problem *p, const void *const *ptrs, int n,
                        const gdp_tbhp_strides *const *strides, int ns) {
  const int V = (int)(16 / sizeof(IO));
  if (p->P % V != 0 || p->group_size % V != 0) return 1;
  for (int i = 0; i < n; i++)
    if (!aligned16(ptrs[i])) return 1;
  for (int i = 0; i < ns; i++)
    if (!strides_ok(*strides[i], V)) return 1;
  return V;
}

/* The backward's token chunks: from the sizes alone (not the plan), so the workspace
 * and the order of the sums depend on nothing else. */
static void norm_chunks(const gdp_out_norm_problem *p, int64_t *chunks, int64_t *rows_per_chunk) {
  const int64_t R = p->T * p->B, ng = p->group_size > 0 ? p->H * p->P / p->group_size : 0;
  int64_t want = NORM_TARGET_BLOCKS / (ng > 0 ? ng : 1);
  if (want < 1) want = 1;
  if (want > R) want = R > 0 ? R : 1;
  *rows_per_chunk = R > 0 ? (R + want - 1) / want : 1;
  *chunks = (R + *rows_per_chunk - 1) / *rows_per_chunk;
}

/* The backward workspace: the chunks' partial rows [chunks][2][d] (sized in double, held
 * in the math type), then the column totals [2][d] in double. */
static int64_t norm_partial_doubles(int64_t chunks, int64_t d) {
  return (chunks > 0 ? chunks : 1) * 2 * d;
}

static gdp_status norm_plan(const char *func, const gdp_out_norm_problem *p, int V,
                            int64_t max_team, NormPlan *pl) {
  const int64_t gs = p->group_size, d = p->H * p->P, R = p->T * p->B;
  if (gs < 1 || d % gs != 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "group size %lld does not divide d = %lld",
                        (long long)gs, (long long)d);
  if (d > 0x7fffffffLL || d / gs > 65535)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                        "d = %lld channels in %lld groups: at most 2^31-1 and 65535", (long long)d,
                        (long long)(d / gs));
  const int64_t nv = gs / V;
  int64_t tpg = 1;
  while (tpg < 32 && tpg < nv) tpg <<= 1;
  int64_t K = (nv + tpg - 1) / tpg;
  while ((K * V > NORM_MAX_ELEMS || K > NORM_MAX_K) && tpg < max_team) {
    tpg <<= 1;
    K = (nv + tpg - 1) / tpg;
  }
  if (K > NORM_MAX_K)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                        "norm groups of %lld channels: at most %lld at this dtype and alignment",
                        (long long)gs, (long long)(max_team * NORM_MAX_K * V));
  pl->V = V, pl->tpg = (int)tpg;
  pl->K = K <= 1 ? 1 : K <= 2 ? 2 : K <= 4 ? 4 : 8;
  pl->teams = tpg > 32 ? 1 : (int)(NORM_BLOCK / tpg); /* a wider team is its block */
  if ((R + pl->teams - 1) / pl->teams > 0x7fffffffLL)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "too many tokens (%lld)", (long long)R);
  norm_chunks(p, &pl->chunks, &pl->rows_per_chunk);
  return GDP_OK;
}

/* The backward's teams per block: their sums (elem bytes each) must fit NORM_SMEM_BYTES. */
static int bwd_teams(const NormPlan &pl, int64_t gs, size_t elem) {
  int teams = pl.teams;
  while (teams > 1 && (size_t)teams * (size_t)gs * elem > NORM_SMEM_BYTES && teams * pl.tpg > 32)
    teams >>= 1;
  return teams;
}

#define GDP_NORM_K_DISPATCH(K_, V_, ...)                         \
  switch (K_) {                                                  \
    case 1: { enum { K = 1, V = V_ }; __VA_ARGS__; } break;      \
    case 2: { enum { K = 2, V = V_ }; __VA_ARGS__; } break;      \
    case 4: { enum { K = 4, V = V_ }; __VA_ARGS__; } break;      \
    default: { enum { K = 8, V = V_ }; __VA_ARGS__; } break;     \
  }

template <typename IO>
static NormArgs<IO> norm_args(const gdp_out_norm_problem *p, const void *o, const void *x_v,
                              const void *D, const void *z, const void *weight,
                              const void *d_out, void *out, void *d_o, void *dz, void *dx_v) {
  NormArgs<IO> a;
  memset(&a, 0, sizeof a);
  a.p = *p;
  a.o = (const IO *)o, a.x_v = (const IO *)x_v, a.D = (const IO *)D, a.z = (const IO *)z;
  a.weight = (const IO *)weight, a.d_out = (const IO *)d_out;
  a.out = (IO *)out, a.d_o = (IO *)d_o, a.dz = (IO *)dz, a.dx_v = (IO *)dx_v;
  return a;
}

template <typename IO>
static gdp_status out_norm_fwd(const gdp_out_norm_problem *p, const void *o, const void *x_v,
                               const void *D, const void *z, const void *weight, void *out,
                               cudaStream_t stream) {
  static const char *func = "gdp_cuda_out_norm_fwd";
  const int has_D = p->D_mode != GDP_OUT_NORM_NO_D;
  const void *ptrs[5] = {o, has_D ? x_v : NULL, p->D_mode == GDP_OUT_NORM_D_CHANNEL ? D : NULL, z, out};
  const gdp_tbhp_strides *strides[4] = {&p->o, has_D ? &p->x_v : &p->o, z ? &p->z : &p->o, &p->out};
  int V = vector_width<IO>(p, ptrs, 5, strides, 4);
  if (V > 1 && !aligned16(weight)) V = 1;
  NormPlan pl;
  GDP_TRY(norm_plan(func, p, V, NORM_MAX_TEAM, &pl));
  const int64_t R = p->T * p->B, ng = p->H * p->P / p->group_size;
  if (R == 0 || ng == 0) return GDP_OK;
  NormArgs<IO> a = norm_args<IO>(p, o, x_v, D, z, weight, NULL, out, NULL, NULL, NULL);
  a.tpg = pl.tpg;
  dim3 grid((unsigned)((R + pl.teams - 1) / pl.teams), (unsigned)ng);
  const unsigned threads = (unsigned)(pl.teams * pl.tpg);
  if (V == 1) {
    GDP_NORM_K_DISPATCH(pl.K, 1, out_norm_fwd_kernel<IO, V, K><<<grid, threads, 0, stream>>>(a));
  } else {
    GDP_NORM_K_DISPATCH(pl.K, (int)(16 / sizeof(IO)),
                        out_norm_fwd_kernel<IO, V, K><<<grid, threads, 0, stream>>>(a));
  }
  return launched(func, "out_norm_fwd_kernel");
}

/* The backward's launch: with its ring of staged rows (BwdRing) when the ring and the
 * teams' sums (ring_off bytes before it) fit NORM_RING_SMEM_BYTES, else without. */
template <typename IO, int V, int K>
static gdp_status launch_bwd(const NormArgs<IO> &a, dim3 grid, unsigned threads, size_t ring_off,
                             cudaStream_t stream) {
  enum { R = BwdRing<K>::rows };
  const size_t smem = ring_off + (size_t)R * 4 * K * threads * sizeof(Pack<IO, V>);
  if (R > 0 && smem <= NORM_RING_SMEM_BYTES) {
    auto kern = out_norm_bwd_kernel<IO, V, K, R>;
    if (smem > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      if (e != cudaSuccess)
        return GDP_ERROR_IN("gdp_cuda_out_norm_bwd", GDP_ERR_CUDA, "shared memory of %zu bytes: %s",
                            smem, cudaGetErrorString(e));
    }
    kern<<<grid, threads, smem, stream>>>(a, (int)ring_off);
  } else {
    out_norm_bwd_kernel<IO, V, K, 0><<<grid, threads, ring_off, stream>>>(a, (int)ring_off);
  }
  return GDP_OK;
}

template <typename IO>
static gdp_status out_norm_bwd(const gdp_out_norm_problem *p, const void *o, const void *x_v,
                               const void *D, const void *z, const void *weight,
                               const void *d_out, void *d_o, void *dz, void *dx_v, void *dD,
                               void *dweight, void *workspace, cudaStream_t stream) {
  static const char *func = "gdp_cuda_out_norm_bwd";
  const int has_D = p->D_mode != GDP_OUT_NORM_NO_D;
  if (!has_D) dx_v = dD = NULL;
  if (!z) dz = NULL;
  const void *ptrs[8] = {o, has_D ? x_v : NULL, p->D_mode == GDP_OUT_NORM_D_CHANNEL ? D : NULL,
                         z, weight, d_out, d_o, dz};
  const gdp_tbhp_strides *strides[7] = {&p->o, has_D ? &p->x_v : &p->o, z ? &p->z : &p->o,
                                        &p->d_out, d_o ? &p->d_o : &p->o, dz ? &p->dz : &p->o,
                                        dx_v ? &p->dx_v : &p->o};
  int V = vector_width<IO>(p, ptrs, 8, strides, 7);
  if (V > 1 && !aligned16(dx_v)) V = 1;
  NormPlan pl;
  GDP_TRY(norm_plan(func, p, V, BwdBounds<IO>::max_team, &pl));
  const int64_t d = p->H * p->P, ng = d / p->group_size;
  pl.teams = bwd_teams(pl, p->group_size, sizeof(typename Math<IO>::type));
  NormArgs<IO> a = norm_args<IO>(p, o, x_v, D, z, weight, d_out, NULL, d_o, dz, dx_v);
  a.tpg = pl.tpg;
  a.rows_per_chunk = pl.rows_per_chunk;
  a.partial = (dweight || dD) ? (typename Math<IO>::type *)workspace : NULL;
  if (pl.chunks > 0 && ng > 0) {
    if (pl.chunks > 0x7fffffffLL)
      return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "too many token chunks (%lld)",
                          (long long)pl.chunks);
    dim3 grid((unsigned)pl.chunks, (unsigned)ng);
    const unsigned threads = (unsigned)(pl.teams * pl.tpg);
    const size_t sums = a.partial && pl.teams > 1 ? (size_t)pl.teams * (size_t)p->group_size * sizeof(typename Math<IO>::type) : 0;
    const size_t ring_off = (sums + 15) & ~(size_t)15;
    if (V == 1) {
      GDP_NORM_K_DISPATCH(pl.K, 1,
                          GDP_TRY((launch_bwd<IO, V, K>(a, grid, threads, ring_off, stream))));
    } else {
      GDP_NORM_K_DISPATCH(pl.K, (int)(16 / sizeof(IO)),
                          GDP_TRY((launch_bwd<IO, V, K>(a, grid, threads, ring_off, stream))));
    }
    GDP_TRY(launched(func, "out_norm_bwd_kernel"));
  }
  const int64_t nD = !dD ? 0 : p->D_mode == GDP_OUT_NORM_D_CHANNEL ? d : p->H;
  if ((dweight || nD > 0) && d > 0) {
    double *tot = (double *)workspace + norm_partial_doubles(pl.chunks, d);
    /* pass q's rows are partial + q d, 2 d apart */
    GDP_TRY(rows_colsum(func, "out_norm rows_colsum_kernel", a.partial, pl.chunks, 2 * d, d,
                        nD > 0 ? 2 : 1, d, tot, stream));
    if (dweight) {
      out_norm_final_kernel<IO><<<grid_for(32 * d), THREADS, 0, stream>>>(tot, d, 1, (IO *)dweight);
      GDP_TRY(launched(func, "out_norm_final_kernel (dweight)"));
    }
    if (nD > 0) {
      out_norm_final_kernel<IO><<<grid_for(32 * nD), THREADS, 0, stream>>>(tot + d, nD, d / nD,
                                                                           (IO *)dD);
      GDP_TRY(launched(func, "out_norm_final_kernel (dD)"));
    }
  }
  return GDP_OK;
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

extern "C" gdp_status gdp_cuda_out_norm_fwd(const gdp_out_norm_problem *p, const void *o,
                                            const void *x_v, const void *D, const void *z,
                                            const void *weight, void *out, void *stream) {
  static const char *func = "gdp_cuda_out_norm_fwd";
  GDP_MIXER_DISPATCH(func, p->dtype,
                     return out_norm_fwd<IO>(p, o, x_v, D, z, weight, out, (cudaStream_t)stream));
  return GDP_OK;
}

extern "C" size_t gdp_cuda_out_norm_bwd_workspace(const gdp_out_norm_problem *p) {
  int64_t chunks, rows_per_chunk;
  norm_chunks(p, &chunks, &rows_per_chunk);
  const int64_t d = p->H * p->P > 0 ? p->H * p->P : 1;
  return (size_t)(norm_partial_doubles(chunks, d) + 2 * d) * sizeof(double);
}

extern "C" gdp_status gdp_cuda_out_norm_bwd(const gdp_out_norm_problem *p, const void *o,
                                            const void *x_v, const void *D, const void *z,
                                            const void *weight, const void *d_out, void *d_o,
                                            void *dz, void *dx_v, void *dD, void *dweight,
                                            void *workspace, void *stream) {
  static const char *func = "gdp_cuda_out_norm_bwd";
  GDP_MIXER_DISPATCH(func, p->dtype,
                     return out_norm_bwd<IO>(p, o, x_v, D, z, weight, d_out, d_o, dz, dx_v, dD,
                                             dweight, workspace, (cudaStream_t)stream));
  return GDP_OK;
}

extern "C" gdp_status gdp_cuda_l2norm_fwd(int dtype, int64_t rows, int64_t dim, double eps,
                                          const void *x, void *y, void *stream) {
  static const char *func = "gdp_cuda_l2norm_fwd";
  if (rows == 0) return GDP_OK;
  const int64_t blocks = (rows + L2_ROWS_PER_BLOCK - 1) / L2_ROWS_PER_BLOCK;
  if (blocks > 0x7fffffffLL)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "too many rows (%lld)", (long long)rows);
  GDP_MIXER_DISPATCH(func, dtype,
                     l2norm_fwd_kernel<IO><<<(unsigned)blocks, 32 * L2_ROWS_PER_BLOCK, 0,
                                             (cudaStream_t)stream>>>(
                         rows, dim, (typename Math<IO>::type)eps, (const IO *)x, (IO *)y));
  return launched(func, "l2norm_fwd_kernel");
}

extern "C" gdp_status gdp_cuda_l2norm_bwd(int dtype, int64_t rows, int64_t dim, double eps,
                                          const void *x, const void *dy, void *dx, void *stream) {
  static const char *func = "gdp_cuda_l2norm_bwd";
  if (rows == 0) return GDP_OK;
  const int64_t blocks = (rows + L2_ROWS_PER_BLOCK - 1) / L2_ROWS_PER_BLOCK;
  if (blocks > 0x7fffffffLL)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED, "too many rows (%lld)", (long long)rows);
  GDP_MIXER_DISPATCH(func, dtype,
                     l2norm_bwd_kernel<IO><<<(unsigned)blocks, 32 * L2_ROWS_PER_BLOCK, 0,
                                             (cudaStream_t)stream>>>(
                         rows, dim, (typename Math<IO>::type)eps, (const IO *)x, (const IO *)dy,
                         (IO *)dx));
  return launched(func, "l2norm_bwd_kernel");
}
