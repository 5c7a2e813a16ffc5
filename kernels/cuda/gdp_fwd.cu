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

#include "gdp_fwd_v3.cuh"

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

/* plan_make, or (plan_bytes_out) only the size of its device block. */
static gdp_status plan_build(const gdp_gdp_problem *p, cudaStream_t stream, PlanBufs bufs, GdpArgs base,
                             Plan *plan, void *ext, bool upload_tables, size_t *plan_bytes_out) {
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
  a.N = (int)p->N;
  a.nchunks = (int)chunks.size();
  const int64_t CH = (int64_t)a.nchunks * a.H;
  const int64_t K = a.K, V = a.V;
  Carve cv;
  const size_t o_cu = cv.take(((size_t)p->N + 1) * sizeof(long long));
  const size_t o_choff = cv.take(((size_t)p->N + 1) * sizeof(int));
  const size_t o_chunks = cv.take(std::max<size_t>(1, chunks.size()) * sizeof(ChunkInfo));
  const size_t tables = cv.off;
  const size_t o_W = cv.take(CH * C * K * 2), o_U = cv.take(CH * C * V * 2),
               o_Kd = cv.take(CH * C * K * 2), o_Qd = cv.take(CH * TC * K * 2),
               o_Pm = cv.take(CH * TC * C * 2), o_el = cv.take(CH * 4);
  size_t o_D = 0, o_dD = 0, o_Ulo = 0;
  if (bufs == PLAN_BACKWARD) {
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
    gdp_status st = upload_async(b, host.data(), tables, stream);
    if (st != GDP_OK) {
      if (!ext) cudaFreeAsync(block, stream);
      return st;
    }
  }
  a.cu = (const long long *)(b + o_cu);
  a.choff = (const int *)(b + o_choff);
  a.chunks = (const ChunkInfo *)(b + o_chunks);
  a.W = (bf16 *)(b + o_W);
  a.U = (bf16 *)(b + o_U);
  a.Kd = (bf16 *)(b + o_Kd);
  a.Qd = (bf16 *)(b + o_Qd);
  a.Pm = (bf16 *)(b + o_Pm);
  a.elast = (float *)(b + o_el);
  if (bufs == PLAN_BACKWARD) {
    a.Dbuf = (bf16 *)(b + o_D);
    a.dDbuf = (bf16 *)(b + o_dD);
    a.Ulo = (bf16 *)(b + o_Ulo);
  }
  plan->a = a;
  plan->block = ext ? nullptr : block;
  plan->value_block = p->value_block;
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
  if (g_prof.enabled < 0) g_prof.enabled = gdp_debug_profile_kernels() ? 1 : 0;
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

gdp_status gdpcu::forward_recurrent(const gdp_gdp_problem *p, const gdp_gdp_fwd_io *io, cudaStream_t stream) {
  if (p->N == 0) return GDP_OK;
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
