/*
 * gdp_fwd.cu -- forward of the Gated DeltaProduct operator on CUDA.
 *
 * Two paths (gdp_chunk.cuh describes the chunk algebra):
 *  - recurrent: one block per (sequence, head, 32 value columns) steps the token
 *    recurrence with the state in registers (lane = key rows, warp = 8 columns).  Exact
 *    float32 arithmetic: the path for float32 problems and for shapes the chunk path
 *    does not cover, and the simple reference the chunk path is timed against.
 *  - chunk (bf16): prep kernel, parallel over (chunk, head): l2 norm, in-chunk decays,
 *    A = K K^T, T = (I + A)^-1 by blocked substitution, W, U, and the query-row-only
 *    panels Qd, Pm; then a state-pass kernel, sequential over the chunks of a sequence
 *    and parallel over (sequence, head, value block), that fuses D = U - W S, the
 *    output of the query rows (only step n-1 of a token has a query, so the other rows
 *    are never computed) and the state update, with the next chunk's panels loaded
 *    asynchronously while the current one is computed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "gdp_chunk.cuh"
#include "gdp_v3_overlap.h"

namespace gdpcu {

/* ------------------------------------------------------------------ validation */

gdp_status validate_problem(const gdp_gdp_problem *p, const char *what) {
  if (!p) return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: problem is NULL", what);
  if (p->dtype != GDP_DTYPE_F32 && p->dtype != GDP_DTYPE_BF16)
    return GDP_ERROR(GDP_ERR_DTYPE, "%s: dtype must be float32 or bfloat16 on CUDA, got %d", what,
                     p->dtype);
  if (p->H < 1 || p->K < 1 || p->V < 1 || p->n < 1 || p->N < 0 || p->T_total < 0)
    return GDP_ERROR(GDP_ERR_SHAPE,
                     "%s: expected H, K, V, n >= 1 and N, T_total >= 0, got H=%lld K=%lld V=%lld "
                     "n=%lld N=%lld T_total=%lld",
                     what, (long long)p->H, (long long)p->K, (long long)p->V, (long long)p->n,
                     (long long)p->N, (long long)p->T_total);
  if (p->K > 256)
    return GDP_ERROR(GDP_ERR_UNSUPPORTED, "%s: K = %lld, the CUDA kernels take K <= 256", what,
                     (long long)p->K);
  if (p->H > 65535)
    return GDP_ERROR(GDP_ERR_UNSUPPORTED, "%s: H = %lld, the CUDA kernels take H <= 65535", what,
                     (long long)p->H);
  if (p->N > 0 && !p->cu_seqlens)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: cu_seqlens is NULL with N = %lld", what,
                     (long long)p->N);
  if (p->N > 0) {
    if (p->cu_seqlens[0] != 0 || p->cu_seqlens[p->N] != p->T_total)
      return GDP_ERROR(GDP_ERR_SHAPE, "%s: cu_seqlens must run from 0 to T_total = %lld, got %lld .. %lld",
                       what, (long long)p->T_total, (long long)p->cu_seqlens[0],
                       (long long)p->cu_seqlens[p->N]);
    for (int64_t s = 0; s < p->N; s++)
      if (p->cu_seqlens[s + 1] < p->cu_seqlens[s])
        return GDP_ERROR(GDP_ERR_SHAPE, "%s: cu_seqlens decreases at %lld (%lld > %lld)", what,
                         (long long)s, (long long)p->cu_seqlens[s], (long long)p->cu_seqlens[s + 1]);
  } else if (p->T_total != 0) {
    return GDP_ERROR(GDP_ERR_SHAPE, "%s: N = 0 sequences but T_total = %lld", what,
                     (long long)p->T_total);
  }
  return GDP_OK;
}

gdp_status validate_fwd_io(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io, const char *what) {
  if (!io) return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: io is NULL", what);
  if (p->T_total > 0 && (!io->q || !io->k || !io->v || !io->beta || !io->o))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: q, k, v, beta and o must be non-NULL", what);
  return GDP_OK;
}

/* ------------------------------------------------------------------ host-to-device tables */

/* Small tables (cu_seqlens, chunk lists) travel through pinned staging buffers so that
 * the copy is asynchronous: a pageable copy would wait for all earlier work on the
 * stream and leave the GPU idle between calls.  Two buffers alternate; reusing one
 * waits only for its own copy, two calls back. */
namespace {
struct PinnedRing {
  std::mutex mu;
  void *buf[2] = {nullptr, nullptr};
  size_t cap[2] = {0, 0};
  cudaEvent_t ev[2] = {nullptr, nullptr};
  int next = 0;
};
PinnedRing g_ring;
std::once_flag g_pool_once;
}  // namespace

static gdp_status upload_async(void *dst, const void *src, size_t bytes, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_ring.mu);
  const int slot = g_ring.next;
  g_ring.next ^= 1;
  if (g_ring.ev[slot]) GDP_CUDA_TRY(cudaEventSynchronize(g_ring.ev[slot]));
  else GDP_CUDA_TRY(cudaEventCreateWithFlags(&g_ring.ev[slot], cudaEventDisableTiming));
  if (g_ring.cap[slot] < bytes) {
    if (g_ring.buf[slot]) GDP_CUDA_TRY(cudaFreeHost(g_ring.buf[slot]));
    g_ring.buf[slot] = nullptr;
    g_ring.cap[slot] = 0;
    const size_t cap = std::max(bytes, (size_t)1 << 16);
    GDP_CUDA_TRY(cudaMallocHost(&g_ring.buf[slot], cap));
    g_ring.cap[slot] = cap;
  }
  memcpy(g_ring.buf[slot], src, bytes);
  GDP_CUDA_TRY(cudaMemcpyAsync(dst, g_ring.buf[slot], bytes, cudaMemcpyHostToDevice, stream));
  GDP_CUDA_TRY(cudaEventRecord(g_ring.ev[slot], stream));
  return GDP_OK;
}

/* Workspaces come from the stream-ordered pool; keep freed blocks cached in it rather
 * than returned to the driver at every synchronisation. */
static void keep_pool_memory() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return;
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, dev) != cudaSuccess) return;
  uint64_t keep = UINT64_MAX;
  cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
}

gdp_status device_alloc(void **ptr, size_t bytes, cudaStream_t stream) {
  std::call_once(g_pool_once, keep_pool_memory);
  *ptr = nullptr;
  if (bytes == 0) bytes = 256;
  cudaError_t e = cudaMallocAsync(ptr, bytes, stream);
  if (e != cudaSuccess)
    return GDP_ERROR(e == cudaErrorMemoryAllocation ? GDP_ERR_OOM : GDP_ERR_CUDA,
                     "cudaMallocAsync of %zu bytes: %s", bytes, cudaGetErrorString(e));
  return GDP_OK;
}

gdp_status upload_cu_seqlens(const gdp_gdp_problem *p, long long *dst, cudaStream_t stream) {
  std::vector<long long> cu((size_t)p->N + 1, 0);
  for (int64_t s = 0; s <= p->N; s++) cu[s] = p->N > 0 ? (long long)p->cu_seqlens[s] : 0;
  return upload_async(dst, cu.data(), cu.size() * sizeof(long long), stream);
}

/* ------------------------------------------------------------------ recurrent forward */

/* Block: 4 warps x 8 value columns = 32 columns; lane l holds key rows l, l+32, ...
 * (RPT of them).  Every reduction over the key axis is a warp sum. */
template <typename T, int RPT>
__global__ __launch_bounds__(128) void rec_fwd_kernel(GdpArgs a) {
  const int s = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c0 = blockIdx.z * 32 + warp * 8;
  const int H = a.H, K = a.K, V = a.V, n = a.n;
  const T *q = (const T *)a.q, *k = (const T *)a.k, *v = (const T *)a.v, *g = (const T *)a.g,
          *beta = (const T *)a.beta;
  T *o = (T *)a.o;
  const int64_t state_off = ((int64_t)s * H + h) * K * V;
  float S[RPT][8];
#pragma unroll
  for (int i = 0; i < RPT; i++)
#pragma unroll
    for (int cc = 0; cc < 8; cc++) {
      const int r = lane + 32 * i, c = c0 + cc;
      S[i][cc] = (a.h0 && r < K && c < V) ? a.h0[state_off + (int64_t)r * V + c] : 0.f;
    }
  const long long bos = a.cu[s], eos = a.cu[s + 1];
  for (long long t = bos; t < eos; t++) {
    if (g) {
      const float d = __expf(to_f(g[t * H + h]));
#pragma unroll
      for (int i = 0; i < RPT; i++)
#pragma unroll
        for (int cc = 0; cc < 8; cc++) S[i][cc] *= d;
    }
    for (int j = 0; j < n; j++) {
      const int64_t row = (t * n + j) * H + h;
      float kr[RPT], ss = 0.f;
#pragma unroll
      for (int i = 0; i < RPT; i++) {
        const int r = lane + 32 * i;
        kr[i] = r < K ? to_f(k[row * K + r]) : 0.f;
        ss += kr[i] * kr[i];
      }
      if (a.l2norm) {
        const float inv = rsqrtf(warp_sum(ss) + kNormEps);
#pragma unroll
        for (int i = 0; i < RPT; i++) kr[i] *= inv;
      }
      const float b = to_f(beta[row]);
      float u[8];
#pragma unroll
      for (int cc = 0; cc < 8; cc++) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < RPT; i++) acc += S[i][cc] * kr[i];
        u[cc] = warp_sum(acc);
      }
#pragma unroll
      for (int cc = 0; cc < 8; cc++) {
        const int c = c0 + cc;
        const float vv = c < V ? to_f(v[row * V + c]) : 0.f;
        const float d = b * (vv - u[cc]);
#pragma unroll
        for (int i = 0; i < RPT; i++) S[i][cc] += kr[i] * d;
      }
    }
    const int64_t qrow = t * H + h;
    float qr[RPT], ss = 0.f;
#pragma unroll
    for (int i = 0; i < RPT; i++) {
      const int r = lane + 32 * i;
      qr[i] = r < K ? to_f(q[qrow * K + r]) : 0.f;
      ss += qr[i] * qr[i];
    }
    const float qs = a.l2norm ? a.scale * rsqrtf(warp_sum(ss) + kNormEps) : a.scale;
#pragma unroll
    for (int cc = 0; cc < 8; cc++) {
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < RPT; i++) acc += S[i][cc] * qr[i];
      acc = warp_sum(acc) * qs;
      if (lane == cc && c0 + cc < V) o[qrow * V + c0 + cc] = from_f<T>(acc);
    }
  }
  if (a.ht) {
#pragma unroll
    for (int i = 0; i < RPT; i++)
#pragma unroll
      for (int cc = 0; cc < 8; cc++) {
        const int r = lane + 32 * i, c = c0 + cc;
        if (r < K && c < V) a.ht[state_off + (int64_t)r * V + c] = S[i][cc];
      }
  }
}

template <typename T>
static gdp_status launch_rec_fwd(const GdpArgs &a, int64_t N, cudaStream_t stream) {
  const dim3 grid((unsigned)N, (unsigned)a.H, (unsigned)((a.V + 31) / 32));
  if (a.K <= 64) rec_fwd_kernel<T, 2><<<grid, 128, 0, stream>>>(a);
  else if (a.K <= 128) rec_fwd_kernel<T, 4><<<grid, 128, 0, stream>>>(a);
  else rec_fwd_kernel<T, 8><<<grid, 128, 0, stream>>>(a);
  GDP_CUDA_LAUNCHED("rec_fwd_kernel");
  return GDP_OK;
}

/* ------------------------------------------------------------------ plan */

struct Carve {
  size_t off = 0;
  size_t take(size_t bytes) {
    const size_t o = off;
    off = align128(off + bytes);
    return o;
  }
};

static int g_num_sms = 0;
int num_sms() {
  if (g_num_sms == 0) {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    g_num_sms = v > 0 ? v : 132;
  }
  return g_num_sms;
}

/* Shared-memory layout of the state-pass kernel (host and device compute the same):
 * fixed regions, then `nst` pipeline stages of the per-chunk panels. */
struct StateLayout {
  size_t S32, Sb0, Sb1, Db, wst, stage0, stage_bytes, oW, oKd, oQd, oPm, oU, total;
};
__host__ __device__ inline StateLayout state_layout(int K, int C, int TC, int BV, bool store, int nst) {
  StateLayout L;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t o = off;
    off = align128(off + bytes);
    return o;
  };
  L.S32 = take((size_t)K * ldf32(BV) * 4);
  L.Sb0 = take((size_t)K * ldb16(BV) * 2);
  L.Sb1 = take((size_t)K * ldb16(BV) * 2);
  L.Db = take((size_t)C * ldb16(BV) * 2);
  L.wst = take((size_t)(kChunkThreads / 32) * 320 * 4);
  L.stage0 = off;
  size_t so = 0;
  auto stake = [&](size_t bytes) {
    size_t o = so;
    so = align128(so + bytes);
    return o;
  };
  L.oW = stake((size_t)C * ldb16(K) * 2);
  L.oKd = stake((size_t)C * ldb16(K) * 2);
  L.oQd = store ? 0 : stake((size_t)TC * ldb16(K) * 2);
  L.oPm = store ? 0 : stake((size_t)TC * ldb16(C) * 2);
  L.oU = stake((size_t)C * ldb16(BV) * 2);
  L.stage_bytes = so;
  L.total = off + (size_t)nst * so;
  return L;
}

/* Pipeline depth: three stages where shared memory allows (the next two chunks' panels
 * in flight while one is computed), else two. */
inline int state_stages(int K, int C, int TC, int BV, bool store, int optin) {
  return (int)state_layout(K, C, TC, BV, store, 3).total <= optin ? 3 : 2;
}

struct PrepLayout {
  size_t Kn, Qn, Vb, CC1, CC2, Tb, wst, vbeta, vgp, vgc, total;
};
__host__ __device__ inline PrepLayout prep_layout(int K, int V, int C, int TC) {
  PrepLayout L;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t o = off;
    off = align128(off + bytes);
    return o;
  };
  L.Kn = take((size_t)C * ldb16(K) * 2);
  L.Qn = take((size_t)TC * ldb16(K) * 2);
  L.Vb = take((size_t)C * ldb16(V) * 2);
  L.CC1 = take((size_t)C * ldf32(C) * 4);
  L.CC2 = take((size_t)C * ldf32(C) * 4);
  L.Tb = take((size_t)C * ldb16(C) * 2);
  L.wst = take((size_t)(kChunkThreads / 32) * 320 * 4);
  L.vbeta = take((size_t)C * 4);
  L.vgp = take((size_t)C * 4);
  L.vgc = take((size_t)C * 4);
  L.total = off;
  return L;
}

template <int BV, bool STORE> __global__ void chunk_state_kernel(GdpArgs a);

template <int BV, bool STORE>
static double state_cost(const GdpArgs &a, int64_t N, int smem_optin) {
  if (a.V % BV) return INFINITY;
  const size_t smem =
      state_layout(a.K, a.C, a.TC, BV, STORE, state_stages(a.K, a.C, a.TC, BV, STORE, smem_optin)).total;
  if ((int)smem > smem_optin) return INFINITY;
  cudaFuncSetAttribute(chunk_state_kernel<BV, STORE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       (int)smem);
  int occ = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, chunk_state_kernel<BV, STORE>,
                                                kChunkThreads, smem);
  if (occ < 1) return INFINITY;
  const double blocks = (double)N * a.H * (a.V / BV);
  const double waves = ceil(blocks / ((double)num_sms() * occ));
  /* per-chunk time: a fixed latency part plus a part that grows with the block width */
  return waves * (1.0 + BV / 32.0);
}

int smem_optin_bytes() {
  int dev = 0, v = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return v;
}

template <bool STORE>
static int choose_bv(const GdpArgs &a, int64_t N) {
  const char *env = getenv("GDP_CUDA_BV");
  if (env) {
    const int bv = atoi(env);
    if ((bv == 16 || bv == 32 || bv == 64) && a.V % bv == 0 &&
        (int)state_layout(a.K, a.C, a.TC, bv, STORE, 2).total <= smem_optin_bytes())
      return bv;
  }
  const int optin = smem_optin_bytes();
  double best = INFINITY;
  int bv = 16;
  const double c64 = state_cost<64, STORE>(a, N, optin), c32 = state_cost<32, STORE>(a, N, optin),
               c16 = state_cost<16, STORE>(a, N, optin);
  if (c16 < best) best = c16, bv = 16;
  if (c32 < best) best = c32, bv = 32;
  if (c64 < best) best = c64, bv = 64;
  return bv;
}

/* plan_make, or (plan_bytes_out) only the size of its device block. */
static gdp_status plan_build(const gdp_gdp_problem *p, cudaStream_t stream, PlanBufs bufs, GdpArgs base,
                             Plan *plan, void *ext, bool upload_tables, size_t *plan_bytes_out) {
  const bool backward = bufs != PLAN_FORWARD;
  memset(plan, 0, sizeof *plan);
  plan->stream = stream;
  GdpArgs a = base;
  const int C = chunk_steps(p->n), TC = C / (int)p->n;
  a.C = C;
  a.TC = TC;
  /* chunk table */
  std::vector<int> choff((size_t)p->N + 1, 0);
  std::vector<ChunkInfo> chunks;
  for (int64_t s = 0; s < p->N; s++) {
    const int64_t bos = p->cu_seqlens[s], eos = p->cu_seqlens[s + 1];
    for (int64_t t0 = bos; t0 < eos; t0 += TC)
      chunks.push_back(ChunkInfo{(int)s, (int)t0, (int)std::min<int64_t>(TC, eos - t0), 0});
    choff[s + 1] = (int)chunks.size();
  }
  /* the same chunks latest-first (v3 backward's overlap; not made where a sequence is empty) */
  std::vector<ChunkInfo> chunks_rev;
  const bool have_rev = p->N > 0 && v3ovl::reverse_chunk_order(p->N, p->cu_seqlens, TC, &chunks_rev);
  a.N = (int)p->N;
  a.nchunks = (int)chunks.size();
  const int64_t CH = (int64_t)a.nchunks * a.H;
  const int64_t K = a.K, V = a.V;
  Carve cv;
  const size_t o_cu = cv.take(((size_t)p->N + 1) * sizeof(long long));
  const size_t o_choff = cv.take(((size_t)p->N + 1) * sizeof(int));
  const size_t o_chunks = cv.take(std::max<size_t>(1, chunks.size()) * sizeof(ChunkInfo));
  const size_t o_chunks_rev = cv.take(std::max<size_t>(1, chunks.size()) * sizeof(ChunkInfo));
  const size_t tables = cv.off;
  const size_t o_W = cv.take(CH * C * K * 2), o_U = cv.take(CH * C * V * 2),
               o_Kd = cv.take(CH * C * K * 2), o_Qd = cv.take(CH * TC * K * 2),
               o_Pm = cv.take(CH * TC * C * 2), o_el = cv.take(CH * 4);
  size_t o_h = 0, o_D = 0, o_dH = 0, o_dD = 0, o_Ulo = 0;
  if (bufs == PLAN_BACKWARD_V2) {
    o_h = cv.take(CH * K * V * 2);
    o_D = cv.take(CH * C * V * 2);
    o_dH = cv.take(CH * K * V * 2);
    o_dD = cv.take(CH * C * V * 2);
  } else if (bufs == PLAN_BACKWARD_V3) {
    o_D = cv.take(CH * C * V * 2);
    o_dD = cv.take(CH * C * V * 2);
    o_Ulo = cv.take(CH * C * V * 2);
  }
  if (plan_bytes_out) { /* plan_bytes: the size only */
    *plan_bytes_out = cv.off;
    return GDP_OK;
  }
  /* ext: the caller's block (a kept forward workspace, see plan_bytes), not freed here */
  void *block = ext;
  if (!ext) GDP_TRY(device_alloc(&block, cv.off, stream));
  char *b = (char *)block;
  if (upload_tables) { /* tables: one staged upload */
    std::vector<char> host(tables, 0);
    for (int64_t s = 0; s <= p->N; s++)
      ((long long *)(host.data() + o_cu))[s] = p->N > 0 ? (long long)p->cu_seqlens[s] : 0;
    memcpy(host.data() + o_choff, choff.data(), choff.size() * sizeof(int));
    if (!chunks.empty()) memcpy(host.data() + o_chunks, chunks.data(), chunks.size() * sizeof(ChunkInfo));
    if (have_rev) memcpy(host.data() + o_chunks_rev, chunks_rev.data(), chunks_rev.size() * sizeof(ChunkInfo));
    gdp_status st = upload_async(b, host.data(), tables, stream);
    if (st != GDP_OK) {
      if (!ext) cudaFreeAsync(block, stream);
      return st;
    }
  }
  a.cu = (const long long *)(b + o_cu);
  a.choff = (const int *)(b + o_choff);
  a.chunks = (const ChunkInfo *)(b + o_chunks);
  a.chunks_rev = have_rev ? (const ChunkInfo *)(b + o_chunks_rev) : nullptr;
  a.W = (bf16 *)(b + o_W);
  a.U = (bf16 *)(b + o_U);
  a.Kd = (bf16 *)(b + o_Kd);
  a.Qd = (bf16 *)(b + o_Qd);
  a.Pm = (bf16 *)(b + o_Pm);
  a.elast = (float *)(b + o_el);
  if (bufs == PLAN_BACKWARD_V2) {
    a.hbuf = (bf16 *)(b + o_h);
    a.dHbuf = (bf16 *)(b + o_dH);
  }
  if (backward) {
    a.Dbuf = (bf16 *)(b + o_D);
    a.dDbuf = (bf16 *)(b + o_dD);
  }
  if (bufs == PLAN_BACKWARD_V3) a.Ulo = (bf16 *)(b + o_Ulo);
  plan->a = a;
  plan->block = ext ? nullptr : block;
  plan->bv_fwd = backward ? choose_bv<true>(a, p->N) : choose_bv<false>(a, p->N);
  return GDP_OK;
}

gdp_status plan_make(const gdp_gdp_problem *p, cudaStream_t stream, PlanBufs bufs, GdpArgs base,
                     Plan *plan, void *ext, bool upload_tables) {
  return plan_build(p, stream, bufs, base, plan, ext, upload_tables, nullptr);
}

size_t plan_bytes(const gdp_gdp_problem *p, PlanBufs bufs) {
  Plan scratch;
  size_t bytes = 0;
  GdpArgs none;
  memset(&none, 0, sizeof none);
  none.H = (int)p->H, none.K = (int)p->K, none.V = (int)p->V, none.n = (int)p->n;
  (void)plan_build(p, nullptr, bufs, none, &scratch, nullptr, false, &bytes);
  return bytes;
}

void plan_free(Plan *plan) {
  if (plan->block) cudaFreeAsync(plan->block, plan->stream);
  plan->block = nullptr;
}

/* ------------------------------------------------------------------ chunk prep kernel */

__global__ __launch_bounds__(kChunkThreads, 2) void chunk_prep_kernel(GdpArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int c = blockIdx.x, h = blockIdx.y;
  const ChunkInfo ci = a.chunks[c];
  const int C = a.C, TC = a.TC, K = a.K, V = a.V, n = a.n, H = a.H;
  const int nv = ci.ntok * n;
  const int ldK = ldb16(K), ldV = ldb16(V), ldC = ldb16(C), ldF = ldf32(C);
  const PrepLayout L = prep_layout(K, V, C, TC);
  bf16 *Kn = (bf16 *)(smem + L.Kn), *Qn = (bf16 *)(smem + L.Qn), *Vb = (bf16 *)(smem + L.Vb);
  float *A = (float *)(smem + L.CC1), *Tm = (float *)(smem + L.CC2);
  bf16 *Tb = (bf16 *)(smem + L.Tb);
  float *vbeta = (float *)(smem + L.vbeta), *vgp = (float *)(smem + L.vgp),
        *vgc = (float *)(smem + L.vgc);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  float *wst = (float *)(smem + L.wst) + warp * 320;
  const bf16 *q = (const bf16 *)a.q, *k = (const bf16 *)a.k, *v = (const bf16 *)a.v,
             *g = (const bf16 *)a.g, *beta = (const bf16 *)a.beta;
  const int64_t CHi = (int64_t)c * H + h;
  bf16 *gW = a.W + CHi * C * K, *gU = a.U + CHi * C * V, *gKd = a.Kd + CHi * C * K,
       *gQd = a.Qd + CHi * TC * K, *gPm = a.Pm + CHi * TC * C;

  /* every row load is issued before the first use (one memory latency) */
  const int64_t krow0 = (int64_t)ci.t0 * n;
  float xk[8][4], xq[4][4], xv[8][4];
  warp_load_rows<8>(k + (krow0 * H + h) * K, (int64_t)H * K, nv, K, xk);
  warp_load_rows<4>(q + ((int64_t)ci.t0 * H + h) * K, (int64_t)H * K, ci.ntok, K, xq);
  warp_load_rows<8>(v + (krow0 * H + h) * V, (int64_t)H * V, nv, V, xv);
  for (int i = tid; i < C; i += blockDim.x) {
    const bool ok = i < nv;
    const int64_t row = (krow0 + i) * H + h;
    vbeta[i] = ok ? to_f(beta[row]) : 0.f;
    vgp[i] = (ok && g && i % n == 0) ? to_f(g[((int64_t)ci.t0 + i / n) * H + h]) : 0.f;
  }
  __syncthreads();
  if (tid < C) {
    float acc = 0.f;
    for (int m = 0; m <= tid; m++) acc += vgp[m];
    vgc[tid] = acc;
  }
  __syncthreads();
  const float last = vgc[C - 1];

  /* keys: Kn (bf16, shared) and Kd = e^{last-gc} kn (global); values: Vb = beta v */
#pragma unroll
  for (int r = 0; r < 8; r++) {
    const int i = warp + 8 * r;
    if (i >= C) break;
    float ss = 0.f;
#pragma unroll
    for (int m = 0; m < 4; m++) ss += xk[r][m] * xk[r][m];
    const float inv = a.l2norm ? rsqrtf(warp_sum(ss) + kNormEps) : 1.f;
    const float fd = __expf(last - vgc[i]), b = vbeta[i];
#pragma unroll
    for (int m = 0; m < 4; m++) {
      const int e = lane + 32 * m;
      if (e < K) {
        Kn[i * ldK + e] = __float2bfloat16(xk[r][m] * inv);
        gKd[(int64_t)i * K + e] = __float2bfloat16(xk[r][m] * inv * fd);
      }
      if (e < V) Vb[i * ldV + e] = __float2bfloat16(b * xv[r][m]);
    }
  }
  /* queries: Qn (bf16, shared) and Qd = scale e^{gc_ia} qn (global) */
#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int qa = warp + 8 * r;
    if (qa >= TC) break;
    float ss = 0.f;
#pragma unroll
    for (int m = 0; m < 4; m++) ss += xq[r][m] * xq[r][m];
    const float inv = a.l2norm ? rsqrtf(warp_sum(ss) + kNormEps) : 1.f;
    const float fq = a.scale * __expf(vgc[qa * n + n - 1]);
#pragma unroll
    for (int m = 0; m < 4; m++) {
      const int e = lane + 32 * m;
      if (e < K) {
        Qn[qa * ldK + e] = __float2bfloat16(xq[r][m] * inv);
        gQd[(int64_t)qa * K + e] = __float2bfloat16(xq[r][m] * inv * fq);
      }
    }
  }
  __syncthreads();

  /* A = strictly-lower(beta_i e^{gc_i-gc_j} kn_i.kn_j) and Pm (query rows only) */
  {
    const int nt = C / 16, tilesA = nt * nt, tilesP = (TC / 16) * nt;
    for (int tile = warp; tile < tilesA + tilesP; tile += 8) {
      FragC f;
      wmma::fill_fragment(f, 0.f);
      if (tile < tilesA) {
        const int tm = tile / nt, tn = tile % nt;
        if (tn > tm) { /* strictly upper tile: zeros */
          frag_epilogue(f, wst, tm, tn, [&](int i, int j, float) { A[i * ldF + j] = 0.f; });
          continue;
        }
        frag_mac<false, true>(f, Kn, ldK, Kn, ldK, tm, tn, K);
        frag_epilogue(f, wst, tm, tn, [&](int i, int j, float val) {
          A[i * ldF + j] = i > j ? vbeta[i] * __expf(vgc[i] - vgc[j]) * val : 0.f;
        });
      } else {
        const int t2 = tile - tilesA, tm = t2 / nt, tn = t2 % nt;
        frag_mac<false, true>(f, Qn, ldK, Kn, ldK, tm, tn, K);
        frag_epilogue(f, wst, tm, tn, [&](int qa, int j, float val) {
          const int ia = qa * n + n - 1;
          gPm[(int64_t)qa * C + j] =
              __float2bfloat16(j <= ia ? a.scale * __expf(vgc[ia] - vgc[j]) * val : 0.f);
        });
      }
    }
  }
  for (int e = tid; e < C * C; e += blockDim.x) Tm[(e / C) * ldF + e % C] = 0.f;
  __syncthreads();

  /* T = (I + A)^-1: 16x16 diagonal blocks by substitution (one warp each), then the
   * off-diagonal blocks row by row: T_ij = -T_ii sum_{k=j}^{i-1} A_ik T_kj. */
  const int NB = C / 16;
  if (warp < NB && lane < 16) {
    const int b0 = warp * 16;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; i++) {
      float s = (i == lane) ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < i; j++) s -= A[(b0 + i) * ldF + b0 + j] * x[j];
      x[i] = s;
    }
#pragma unroll
    for (int i = 0; i < 16; i++) Tm[(b0 + i) * ldF + b0 + lane] = x[i];
  }
  __syncthreads();
  float *Msc = (float *)(smem + L.wst); /* 8 warps x 320 floats >= 3 x 256 */
  for (int bi = 1; bi < NB; bi++) {
    for (int e = tid; e < bi * 256; e += blockDim.x) {
      const int bj = e >> 8, r = (e >> 4) & 15, cc = e & 15;
      float m = 0.f;
      for (int kk = 16 * bj; kk < 16 * bi; kk++) m += A[(16 * bi + r) * ldF + kk] * Tm[kk * ldF + 16 * bj + cc];
      Msc[e] = m;
    }
    __syncthreads();
    for (int e = tid; e < bi * 256; e += blockDim.x) {
      const int bj = e >> 8, r = (e >> 4) & 15, cc = e & 15;
      float t = 0.f;
#pragma unroll
      for (int m2 = 0; m2 < 16; m2++) t -= Tm[(16 * bi + r) * ldF + 16 * bi + m2] * Msc[(bj << 8) + m2 * 16 + cc];
      Tm[(16 * bi + r) * ldF + 16 * bj + cc] = t;
    }
    __syncthreads();
  }
  /* Tb = bf16(T); Kn -> Kb = beta e^{gc} kn in place */
  for (int e = tid; e < C * C; e += blockDim.x) Tb[(e / C) * ldC + e % C] = __float2bfloat16(Tm[(e / C) * ldF + e % C]);
  for (int e = tid; e < C * K; e += blockDim.x) {
    const int i = e / K, kk = e % K;
    Kn[i * ldK + kk] = __float2bfloat16(__bfloat162float(Kn[i * ldK + kk]) * vbeta[i] * __expf(vgc[i]));
  }
  __syncthreads();

  /* W = T Kb, U = T Vb -> global bf16 */
  {
    const int nt = C / 16, tk = K / 16, tv = V / 16;
    for (int tile = warp; tile < nt * (tk + tv); tile += 8) {
      FragC f;
      wmma::fill_fragment(f, 0.f);
      if (tile < nt * tk) {
        const int tm = tile / tk, tn = tile % tk;
        frag_mac<false, false>(f, Tb, ldC, Kn, ldK, tm, tn, C);
        frag_epilogue(f, wst, tm, tn, [&](int i, int e, float val) { gW[(int64_t)i * K + e] = __float2bfloat16(val); });
      } else {
        const int t2 = tile - nt * tk, tm = t2 / tv, tn = t2 % tv;
        frag_mac<false, false>(f, Tb, ldC, Vb, ldV, tm, tn, C);
        frag_epilogue(f, wst, tm, tn, [&](int i, int e, float val) { gU[(int64_t)i * V + e] = __float2bfloat16(val); });
      }
    }
  }
  if (tid == 0) a.elast[CHi] = __expf(last);
}

gdp_status launch_prep(const Plan &plan) {
  const GdpArgs &a = plan.a;
  if (a.nchunks == 0) return GDP_OK;
  const size_t smem = prep_layout(a.K, a.V, a.C, a.TC).total;
  GDP_CUDA_TRY(cudaFuncSetAttribute(chunk_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  chunk_prep_kernel<<<dim3((unsigned)a.nchunks, (unsigned)a.H), kChunkThreads, smem, plan.stream>>>(a);
  GDP_CUDA_LAUNCHED("chunk_prep_kernel");
  return GDP_OK;
}

/* ------------------------------------------------------------------ chunk state pass */

template <int BV, bool STORE>
__global__ __launch_bounds__(kChunkThreads, 1) void chunk_state_kernel(GdpArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * BV;
  const int C = a.C, TC = a.TC, K = a.K, V = a.V, H = a.H;
  const int ldK = ldb16(K), ldC = ldb16(C), ldB = ldb16(BV), ldS = ldf32(BV);
  const int nst = a.nstages;
  const StateLayout L = state_layout(K, C, TC, BV, STORE, nst);
  float *S32 = (float *)(smem + L.S32);
  bf16 *const Sb0 = (bf16 *)(smem + L.Sb0), *const Sb1 = (bf16 *)(smem + L.Sb1);
  bf16 *Db = (bf16 *)(smem + L.Db);
  const int tid = threadIdx.x, warp = tid >> 5;
  float *wst = (float *)(smem + L.wst) + warp * 320;
  const int cbeg = a.choff[s], nc = a.choff[s + 1] - cbeg;
  const int64_t soff = ((int64_t)s * H + h) * K * V;
  const bf16 *gW = a.W, *gKd = a.Kd, *gQd = a.Qd, *gPm = a.Pm, *gU = a.U;
  const float *gel = a.elast;
  const ChunkInfo *chunks = a.chunks;
  bf16 *o = (bf16 *)a.o;
  bf16 *hbuf = a.hbuf, *Dbuf = a.Dbuf;

  for (int e = tid; e < K * BV; e += blockDim.x) {
    const int r = e / BV, x = e % BV;
    const float v0 = a.h0 ? a.h0[soff + (int64_t)r * V + col0 + x] : 0.f;
    S32[r * ldS + x] = v0;
    Sb0[r * ldB + x] = __float2bfloat16(v0);
  }
  /* stage st holds chunk it when it % nst == st */
  for (int it = 0; it < nst - 1; it++) {
    if (it < nc) {
      unsigned char *stg = smem + L.stage0 + (size_t)it * L.stage_bytes;
      const int64_t base = (int64_t)(cbeg + it) * H + h;
      load_tile_async((bf16 *)(stg + L.oW), ldK, gW + base * C * K, K, C, K, C);
      load_tile_async((bf16 *)(stg + L.oKd), ldK, gKd + base * C * K, K, C, K, C);
      if (!STORE) {
        load_tile_async((bf16 *)(stg + L.oQd), ldK, gQd + base * TC * K, K, TC, K, TC);
        load_tile_async((bf16 *)(stg + L.oPm), ldC, gPm + base * TC * C, C, TC, C, TC);
      }
      load_tile_async((bf16 *)(stg + L.oU), ldB, gU + base * C * V + col0, V, C, BV, C);
    }
    cp_async_commit();
  }

  for (int it = 0; it < nc; it++) {
    const int c = cbeg + it;
    const int64_t CHi = (int64_t)c * H + h;
    /* scalars first: their latency overlaps the wait and phase 1 */
    const float el = gel[CHi];
    const ChunkInfo ci = chunks[c];
    bf16 *const Scur = (it & 1) ? Sb1 : Sb0;
    bf16 *const Snxt = (it & 1) ? Sb0 : Sb1;
    if (nst == 3) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();
    {
      const int ia = it + nst - 1;
      if (ia < nc) {
        unsigned char *stg = smem + L.stage0 + (size_t)(ia % nst) * L.stage_bytes;
        const int64_t base = (int64_t)(cbeg + ia) * H + h;
        load_tile_async((bf16 *)(stg + L.oW), ldK, gW + base * C * K, K, C, K, C);
        load_tile_async((bf16 *)(stg + L.oKd), ldK, gKd + base * C * K, K, C, K, C);
        if (!STORE) {
          load_tile_async((bf16 *)(stg + L.oQd), ldK, gQd + base * TC * K, K, TC, K, TC);
          load_tile_async((bf16 *)(stg + L.oPm), ldC, gPm + base * TC * C, C, TC, C, TC);
        }
        load_tile_async((bf16 *)(stg + L.oU), ldB, gU + base * C * V + col0, V, C, BV, C);
      }
      cp_async_commit();
    }
    const unsigned char *stg = smem + L.stage0 + (size_t)(it % nst) * L.stage_bytes;
    const bf16 *W = (const bf16 *)(stg + L.oW), *Kd = (const bf16 *)(stg + L.oKd),
               *U = (const bf16 *)(stg + L.oU);
    if (STORE) {
      bf16 *gh = hbuf + CHi * K * V + col0;
      for (int e = tid; e < K * BV; e += blockDim.x) gh[(int64_t)(e / BV) * V + e % BV] = Scur[(e / BV) * ldB + e % BV];
    }
    /* D = U - W S */
    for (int tile = warp; tile < (C / 16) * (BV / 16); tile += 8) {
      const int tm = tile / (BV / 16), tn = tile % (BV / 16);
      FragC f;
      wmma::fill_fragment(f, 0.f);
      frag_mac<false, false>(f, W, ldK, Scur, ldB, tm, tn, K);
      frag_epilogue(f, wst, tm, tn, [=](int i, int x, float val) {
        const float d = __bfloat162float(U[i * ldB + x]) - val;
        Db[i * ldB + x] = __float2bfloat16(d);
        if (STORE) Dbuf[(CHi * C + i) * V + col0 + x] = __float2bfloat16(d);
      });
    }
    __syncthreads();
    /* S <- e^{last} S + Kd^T D ; o = Qd S + Pm D (query rows) */
    const int tS = (K / 16) * (BV / 16), tO = STORE ? 0 : (TC / 16) * (BV / 16);
    for (int tile = warp; tile < tS + tO; tile += 8) {
      FragC f;
      wmma::fill_fragment(f, 0.f);
      if (tile < tS) {
        const int tm = tile / (BV / 16), tn = tile % (BV / 16);
        frag_mac<true, false>(f, Kd, ldK, Db, ldB, tm, tn, C);
        frag_epilogue(f, wst, tm, tn, [=](int r, int x, float val) {
          const float ns = el * S32[r * ldS + x] + val;
          S32[r * ldS + x] = ns;
          Snxt[r * ldB + x] = __float2bfloat16(ns);
        });
      } else {
        const int t2 = tile - tS, tm = t2 / (BV / 16), tn = t2 % (BV / 16);
        const bf16 *Qd = (const bf16 *)(stg + L.oQd), *Pm = (const bf16 *)(stg + L.oPm);
        frag_mac<false, false>(f, Qd, ldK, Scur, ldB, tm, tn, K);
        frag_mac<false, false>(f, Pm, ldC, Db, ldB, tm, tn, C);
        const int ntok = ci.ntok;
        const int64_t obase = (int64_t)ci.t0 * H + h;
        frag_epilogue(f, wst, tm, tn, [=](int qa, int x, float val) {
          if (qa < ntok) o[(obase + (int64_t)qa * H) * V + col0 + x] = __float2bfloat16(val);
        });
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if (a.ht)
    for (int e = tid; e < K * BV; e += blockDim.x)
      a.ht[soff + (int64_t)(e / BV) * V + col0 + e % BV] = S32[(e / BV) * ldS + e % BV];
}

template <int BV, bool STORE>
static gdp_status launch_state_bv(const Plan &plan) {
  GdpArgs a = plan.a;
  a.nstages = state_stages(a.K, a.C, a.TC, BV, STORE, smem_optin_bytes());
  const size_t smem = state_layout(a.K, a.C, a.TC, BV, STORE, a.nstages).total;
  GDP_CUDA_TRY(cudaFuncSetAttribute(chunk_state_kernel<BV, STORE>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  chunk_state_kernel<BV, STORE>
      <<<dim3((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV)), kChunkThreads, smem, plan.stream>>>(a);
  GDP_CUDA_LAUNCHED("chunk_state_kernel");
  return GDP_OK;
}

gdp_status launch_state(const Plan &plan, bool store_states) {
  if (plan.a.N == 0) return GDP_OK;
  switch (plan.bv_fwd) {
    case 64: return store_states ? launch_state_bv<64, true>(plan) : launch_state_bv<64, false>(plan);
    case 32: return store_states ? launch_state_bv<32, true>(plan) : launch_state_bv<32, false>(plan);
    default: return store_states ? launch_state_bv<16, true>(plan) : launch_state_bv<16, false>(plan);
  }
}

/* ------------------------------------------------------------------ profiling (lab only) */

namespace {
struct ProfEntry {
  const char *name;
  double ms;
  long calls;
};
struct Prof {
  std::mutex mu;
  int enabled = -1;
  std::vector<cudaEvent_t> ev;
  std::vector<const char *> names;
  std::vector<ProfEntry> table;
};
Prof g_prof;
bool prof_on() {
  if (g_prof.enabled < 0) g_prof.enabled = getenv("GDP_CUDA_PROFILE") ? 1 : 0;
  return g_prof.enabled == 1;
}
}  // namespace

void prof_begin(cudaStream_t stream) {
  if (!prof_on()) return;
  g_prof.mu.lock();
  g_prof.names.clear();
  prof_mark(nullptr, stream);
}
void prof_mark(const char *name, cudaStream_t stream) {
  if (!prof_on()) return;
  cudaEvent_t e;
  cudaEventCreate(&e);
  cudaEventRecord(e, stream);
  g_prof.ev.push_back(e);
  g_prof.names.push_back(name);
}
void prof_end(cudaStream_t stream) {
  if (!prof_on()) return;
  cudaStreamSynchronize(stream);
  for (size_t i = 1; i < g_prof.ev.size(); i++) {
    float ms = 0.f;
    cudaEventElapsedTime(&ms, g_prof.ev[i - 1], g_prof.ev[i]);
    const char *nm = g_prof.names[i];
    size_t j = 0;
    for (; j < g_prof.table.size(); j++)
      if (!strcmp(g_prof.table[j].name, nm)) break;
    if (j == g_prof.table.size()) g_prof.table.push_back(ProfEntry{nm, 0.0, 0});
    g_prof.table[j].ms += ms;
    g_prof.table[j].calls++;
  }
  for (auto e : g_prof.ev) cudaEventDestroy(e);
  g_prof.ev.clear();
  g_prof.mu.unlock();
}

}  // namespace gdpcu

extern "C" void gdp_cuda_gdp_profile_dump(FILE *out, double divide_by) {
  std::lock_guard<std::mutex> lock(gdpcu::g_prof.mu);
  for (auto &e : gdpcu::g_prof.table)
    fprintf(out, "    %-28s %9.4f ms  (%ld launches)\n", e.name, e.ms / divide_by, e.calls);
  gdpcu::g_prof.table.clear();
}

using namespace gdpcu;

/* ------------------------------------------------------------------ entry points */

extern "C" int gdp_cuda_gdp_supported(const gdp_gdp_problem *p) {
  if (!p) return 0;
  if (p->dtype != GDP_DTYPE_F32 && p->dtype != GDP_DTYPE_BF16) return 0;
  if (p->H < 1 || p->H > 65535 || p->K < 1 || p->K > 256 || p->V < 1 || p->n < 1) return 0;
  return 1;
}

GdpArgs gdpcu::fwd_args(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io) {
  GdpArgs a;
  memset(&a, 0, sizeof a);
  a.q = io->q;
  a.k = io->k;
  a.v = io->v;
  a.g = io->g;
  a.beta = io->beta;
  a.h0 = (const float *)io->h0;
  a.o = io->o;
  a.ht = (float *)io->ht;
  a.H = (int)p->H;
  a.K = (int)p->K;
  a.V = (int)p->V;
  a.n = (int)p->n;
  a.l2norm = p->l2norm_in_kernel;
  a.scale = (float)p->scale;
  a.N = (int)p->N;
  return a;
}

extern "C" gdp_status gdp_cuda_gdp_forward_v2(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io,
                                              void *stream_) {
  GDP_TRY(validate_problem(p, "forward_v2"));
  GDP_TRY(validate_fwd_io(p, io, "forward_v2"));
  if (!chunk_path_ok(p))
    return GDP_ERROR(GDP_ERR_UNSUPPORTED,
                     "forward_v2 takes bf16, n = 1..4, K and V multiples of 16 up to 128; got dtype %d "
                     "n=%lld K=%lld V=%lld",
                     p->dtype, (long long)p->n, (long long)p->K, (long long)p->V);
  if (p->N == 0) return GDP_OK;
  cudaStream_t stream = (cudaStream_t)stream_;
  Plan plan;
  prof_begin(stream);
  GDP_TRY(plan_make(p, stream, PLAN_FORWARD, fwd_args(p, io), &plan));
  prof_mark("fwd plan+upload", stream);
  gdp_status st = launch_prep(plan);
  prof_mark("fwd prep", stream);
  if (st == GDP_OK) st = launch_state(plan, false);
  prof_mark("fwd state+output", stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

extern "C" gdp_status gdp_cuda_gdp_forward_recurrent(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io,
                                                     void *stream_) {
  GDP_TRY(validate_problem(p, "forward_recurrent"));
  GDP_TRY(validate_fwd_io(p, io, "forward_recurrent"));
  if (p->N == 0) return GDP_OK;
  cudaStream_t stream = (cudaStream_t)stream_;
  GdpArgs a = fwd_args(p, io);
  void *cu = nullptr;
  GDP_TRY(device_alloc(&cu, ((size_t)p->N + 1) * sizeof(long long), stream));
  gdp_status st = upload_cu_seqlens(p, (long long *)cu, stream);
  a.cu = (const long long *)cu;
  if (st == GDP_OK)
    st = p->dtype == GDP_DTYPE_BF16 ? launch_rec_fwd<bf16>(a, p->N, stream)
                                    : launch_rec_fwd<float>(a, p->N, stream);
  cudaFreeAsync(cu, stream);
  return st;
}
