/*
 * plan.cu -- host side shared by both CUDA paths: validation of a problem and its
 * buffers, the kernels' argument blocks, small-table uploads through pinned staging,
 * stream-ordered workspaces, the chunk plan, and the optional per-kernel timing.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "plan.cuh"

namespace gdpcu {

/* ------------------------------------------------------------------ validation */

gdp_status validate_problem(const gdp_delta_product_problem *p, const char *what) {
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

gdp_status validate_fwd_io(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io, const char *what) {
  if (!io) return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: io is NULL", what);
  if (p->T_total > 0 && (!io->q || !io->k || !io->v || !io->beta || !io->o))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: q, k, v, beta and o must be non-NULL", what);
  return GDP_OK;
}

/* ------------------------------------------------------------------ host-to-device tables */

/* Small tables (cu_seqlens, chunk lists) travel through pinned staging buffers so that
 * the copy is asynchronous: a pageable copy would wait for all earlier work on the
 * stream and leave the GPU idle between calls.  A buffer is reused once the copy out of
 * it has run (its event has completed); while none has, another is made, so the host
 * never waits for the device to queue a table -- a V = 256 backward uploads several
 * per call, and a two-buffer ring made the host wait for the device's progress.  Past
 * kMaxStaging buffers (the device is that many uploads behind) the oldest is waited for. */
namespace {
struct Staging {
  void *buf = nullptr;
  size_t cap = 0;
  cudaEvent_t ev = nullptr;
  uint64_t used = 0; /* upload count when last taken: the oldest is the one waited for */
};
constexpr size_t kMaxStaging = 64;
struct StagingPool {
  std::mutex mu;
  std::vector<Staging> bufs;
  uint64_t uploads = 0;
};
StagingPool g_staging;
std::once_flag g_pool_once;

/* The buffer to use for `bytes`: a free one that holds them (the smallest such), else a
 * new one, else (at the cap) the largest free one or the oldest once its copy has run,
 * grown by the caller.  Growing frees pinned memory, which synchronises the device, so
 * a new buffer is preferred to growing while the cap allows. */
gdp_status take_staging(size_t bytes, Staging **out) {
  Staging *fits = nullptr, *largest = nullptr, *oldest = nullptr;
  for (Staging &b : g_staging.bufs) {
    if (!oldest || b.used < oldest->used) oldest = &b;
    cudaError_t e = cudaEventQuery(b.ev);
    if (e == cudaErrorNotReady) continue;
    GDP_CUDA_TRY(e);
    if (b.cap >= bytes && (!fits || b.cap < fits->cap)) fits = &b;
    if (!largest || b.cap > largest->cap) largest = &b;
  }
  Staging *best = fits;
  if (!best && g_staging.bufs.size() < kMaxStaging) {
    Staging fresh;
    GDP_CUDA_TRY(cudaEventCreateWithFlags(&fresh.ev, cudaEventDisableTiming));
    g_staging.bufs.push_back(fresh);
    best = &g_staging.bufs.back();
  }
  if (!best) best = largest;
  if (!best) {
    GDP_CUDA_TRY(cudaEventSynchronize(oldest->ev));
    best = oldest;
  }
  *out = best;
  return GDP_OK;
}
}  // namespace

static gdp_status upload_async(void *dst, const void *src, size_t bytes, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_staging.mu);
  Staging *b = nullptr;
  GDP_TRY(take_staging(bytes, &b));
  if (b->cap < bytes) {
    if (b->buf) GDP_CUDA_TRY(cudaFreeHost(b->buf));
    b->buf = nullptr;
    b->cap = 0;
    const size_t cap = std::max(bytes, (size_t)1 << 16);
    GDP_CUDA_TRY(cudaMallocHost(&b->buf, cap));
    b->cap = cap;
  }
  b->used = ++g_staging.uploads;
  memcpy(b->buf, src, bytes);
  GDP_CUDA_TRY(cudaMemcpyAsync(dst, b->buf, bytes, cudaMemcpyHostToDevice, stream));
  GDP_CUDA_TRY(cudaEventRecord(b->ev, stream));
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

gdp_status upload_cu_seqlens(const gdp_delta_product_problem *p, long long *dst, cudaStream_t stream) {
  std::vector<long long> cu((size_t)p->N + 1, 0);
  for (int64_t s = 0; s <= p->N; s++) cu[s] = p->N > 0 ? (long long)p->cu_seqlens[s] : 0;
  return upload_async(dst, cu.data(), cu.size() * sizeof(long long), stream);
}

gdp_status validate_bwd_io(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, const char *what) {
  if (!io) return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: io is NULL", what);
  if (p->T_total > 0 && (!io->q || !io->k || !io->v || !io->beta || !io->d_o || !io->dq || !io->dk ||
                         !io->dv || !io->dbeta))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: q, k, v, beta, d_o, dq, dk, dv and dbeta must be non-NULL", what);
  if ((io->g == NULL) != (io->dg == NULL))
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "%s: dg must be given exactly when g is (g %s, dg %s)",
                     what, io->g ? "set" : "NULL", io->dg ? "set" : "NULL");
  return GDP_OK;
}

GdpArgs bwd_args(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io) {
  GdpArgs a;
  memset(&a, 0, sizeof a);
  a.q = io->q;
  a.k = io->k;
  a.v = io->v;
  a.g = io->g;
  a.beta = io->beta;
  a.h0 = (const float *)io->h0;
  a.d_o = io->d_o;
  a.dht = (const float *)io->dht;
  a.dq = io->dq;
  a.dk = io->dk;
  a.dv = io->dv;
  a.dbeta = io->dbeta;
  a.dg = io->dg;
  a.dh0 = (float *)io->dh0;
  a.H = (int)p->H;
  a.K = (int)p->K;
  a.V = (int)p->V;
  a.n = (int)p->n;
  a.l2norm = p->l2norm_in_kernel;
  a.scale = (float)p->scale;
  a.g_f32 = p->gate_f32 && p->dtype == GDP_DTYPE_BF16;
  a.N = (int)p->N;
  return a;
}

GdpArgs fwd_args(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io) {
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
  a.g_f32 = p->gate_f32 && p->dtype == GDP_DTYPE_BF16;
  a.N = (int)p->N;
  return a;
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
static gdp_status plan_build(const gdp_delta_product_problem *p, cudaStream_t stream, PlanBufs bufs, GdpArgs base,
                             Plan *plan, void *ext, bool upload_tables, size_t *plan_bytes_out) {
  memset(plan, 0, sizeof *plan);
  plan->stream = stream;
  /* the kernels' instances: K in {32, 64, 128, 256}, V in {32, 64, 128} (128 at K = 256),
   * n = 1..4 where chunk_steps has a chunk (V = 256 and n = 5..8 are rewritten before,
   * chunk_shapes.cu) */
  const auto instance_width = [](int64_t d) { return d == 32 || d == 64 || d == 128; };
  if (!(instance_width(p->K) || p->K == 256) || !instance_width(p->V) || (p->K == 256 && p->V != 128) ||
      chunk_steps(p->n, p->K) == 0)
    return GDP_ERROR(GDP_ERR_INTERNAL, "plan: the chunk kernels take K in {32, 64, 128, 256}, V in {32, 64, 128} "
                                       "(128 at K = 256) and n = 1..%d with a chunk, got K = %lld, V = %lld, n = %lld",
                     kMaxChunkN, (long long)p->K, (long long)p->V, (long long)p->n);
  GdpArgs a = base;
  const int C = chunk_steps(p->n, p->K), TC = C / (int)p->n;
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

gdp_status plan_make(const gdp_delta_product_problem *p, cudaStream_t stream, PlanBufs bufs, GdpArgs base,
                     Plan *plan, void *ext, bool upload_tables) {
  return plan_build(p, stream, bufs, base, plan, ext, upload_tables, nullptr);
}

size_t plan_bytes(const gdp_delta_product_problem *p, PlanBufs bufs) {
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

/* ------------------------------------------------------------------ profiling (GDP_CUDA_PROFILE) */

namespace {
/* One call's marks: an event after each stage, printed as one line per stage to stderr
 * when the call ends (the mutex keeps two host threads' calls from interleaving). */
struct Prof {
  std::mutex mu;
  int enabled = -1;
  std::vector<cudaEvent_t> ev;
  std::vector<const char *> names;
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
    fprintf(stderr, "gdp profile: %-40s %9.4f ms\n", g_prof.names[i], ms);
  }
  for (auto e : g_prof.ev) cudaEventDestroy(e);
  g_prof.ev.clear();
  g_prof.mu.unlock();
}

}  // namespace gdpcu

using namespace gdpcu;
