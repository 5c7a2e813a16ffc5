/*
 * chunk_backward.cu -- the fast path's backward: the launchers of its passes, their
 * host-side choices (value-block width, the fork of the two sequential passes), and the
 * entry points, recompute and saved (plan.cuh).  Compiled in parts like
 * chunk_forward.cu, one per (K, V) (GDP_PART_K, GDP_PART_V).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>

#include "chunk_state_recompute.cuh"
#include "chunk_dstate.cuh"
#include "chunk_grad_state.cuh"
#include "chunk_grad_wy.cuh"

namespace gdpcu {
namespace chunked_backward {

/* ------------------------------------------------------------------ host side */

template <class Kern>
static gdp_status occupancy(Kern kern, int threads, int smem, int *blocks_per_sm) {
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  GDP_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, threads, smem));
  return GDP_OK;
}

/* The two sequential passes at the largest shared-memory carveout.  An SM's carveout is
 * set when a block starts on an idle SM and cannot change while one runs there; left to
 * the driver, a states block could start on an SM at a carveout with no room for a
 * dstate block beside it, so the forked passes (launch_state_passes) would run one after
 * the other on that SM.  H200, 1 x 32768 n = 3 forked without this: 11.0 or 13.6 ms
 * fwd+bwd from one process to the next (unforked 13.4). */
template <class Kern>
static cudaError_t seq_carveout(Kern kern) {
  return cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
}

template <int K, int V, int C, int BV>
static gdp_status launch_states(const Plan &plan, bf16 *hT16) {
  const GdpArgs &a = plan.a;
  const dim3 grid((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV));
  constexpr int threads = BV / 16 * 32;
  auto kern = chunk_state_recompute_kernel<K, V, C, BV>;
  if (a.Tu) { /* U from Tu and v (the prep stored Tu^T instead of U): BV >= C */
    if constexpr (BV >= C) {
      kern = chunk_state_recompute_kernel<K, V, C, BV, true>;
    } else {
      return GDP_ERROR(GDP_ERR_INTERNAL, "chunk_state_recompute_kernel: U from Tu and v needs BV %d >= C %d", BV, C);
    }
  }
  constexpr int smem = StatesLayout<K, C, BV>::total;
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  GDP_CUDA_TRY(seq_carveout(kern));
  kern<<<grid, dim3(threads), smem, plan.stream>>>(a, hT16);
  GDP_CUDA_LAUNCHED("chunk_state_recompute_kernel");
  return GDP_OK;
}

/* two (fork_mode 2): the 2-stage kernel with bf16-only staging, for a fork of the two
 * passes where only it fits beside a states block; else the 3-stage one. */
template <int K, int V, int C, int TC, int BV>
static gdp_status launch_dstate(const Plan &plan, bf16 *dHT16, bool two) {
  const GdpArgs &a = plan.a;
  const dim3 grid((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV));
  constexpr int threads = BV / 16 * 32;
  if (two) {
    auto kern2 = chunk_dstate_kernel<K, V, C, TC, BV, 2>;
    constexpr int smem2 = DStateLayout<K, C, TC, BV, 2, true>::total;
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern2, cudaFuncAttributeMaxDynamicSharedMemorySize, smem2));
    GDP_CUDA_TRY(seq_carveout(kern2));
    kern2<<<grid, dim3(threads), smem2, plan.stream>>>(a, dHT16);
    GDP_CUDA_LAUNCHED("chunk_dstate_kernel (2 stages)");
    return GDP_OK;
  }
  auto kern = chunk_dstate_kernel<K, V, C, TC, BV>;
  constexpr int smem = DStateLayout<K, C, TC, BV>::total;
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  GDP_CUDA_TRY(seq_carveout(kern));
  kern<<<grid, dim3(threads), smem, plan.stream>>>(a, dHT16);
  GDP_CUDA_LAUNCHED("chunk_dstate_kernel");
  return GDP_OK;
}

/* One launch of either sequential kernel at value-block width BV (dry_run: occupancy of
 * the 3-stage dstate kernel only, whose shared memory is the larger of the two).  b16:
 * the transposed bf16 copy of h (states) or dH (dstate) for the gradient kernels. */
template <int K, int V, int C, int TC, int BV>
static gdp_status launch_seq_bv(const Plan &plan, bool states, bool dry_run, int *occ, bf16 *b16, bool two) {
  constexpr int threads = BV / 16 * 32;
  if (dry_run) return occupancy(chunk_dstate_kernel<K, V, C, TC, BV>, threads, DStateLayout<K, C, TC, BV>::total, occ);
  if (states) return launch_states<K, V, C, BV>(plan, b16);
  return launch_dstate<K, V, C, TC, BV>(plan, b16, two);
}

template <int K, int V, int C, int TC>
static gdp_status launch_seq_k(const Plan &plan, int bv, bool states, bool dry_run, int *occ, bf16 *b16,
                               bool two) {
  switch (bv) {
    case 64: return launch_seq_bv<K, V, C, TC, 64>(plan, states, dry_run, occ, b16, two);
    case 32: return launch_seq_bv<K, V, C, TC, 32>(plan, states, dry_run, occ, b16, two);
    default: return launch_seq_bv<K, V, C, TC, 16>(plan, states, dry_run, occ, b16, two);
  }
}

/* n's chunk at the enclosing template's K (chunk_steps_of, chunk_tokens_of), for n = 1..4;
 * GDP_BWD_CASE_N(N, call) is the statement of case n = N: the call where K has a chunk at
 * that n (K = 256: n = 2 alone), else an error. */
#define GDP_BWD_N(N) chunk_steps_of(N, K), chunk_tokens_of(N, K)
#define GDP_BWD_CASE_N(N, call)                                                             \
  if constexpr (chunk_steps_of(N, K) > 0) return call;                                     \
  else return GDP_ERROR(GDP_ERR_INTERNAL, "backward: K = %d has no chunk at n = %d", K, N)

template <int K, int V>
static gdp_status launch_seq_n(const Plan &plan, int bv, bool states, bool dry_run, int *occ, bf16 *b16,
                               bool two) {
  switch (plan.a.n) {
    case 1: GDP_BWD_CASE_N(1, (launch_seq_k<K, V, GDP_BWD_N(1)>(plan, bv, states, dry_run, occ, b16, two)));
    case 2: GDP_BWD_CASE_N(2, (launch_seq_k<K, V, GDP_BWD_N(2)>(plan, bv, states, dry_run, occ, b16, two)));
    case 3: GDP_BWD_CASE_N(3, (launch_seq_k<K, V, GDP_BWD_N(3)>(plan, bv, states, dry_run, occ, b16, two)));
    default: GDP_BWD_CASE_N(4, (launch_seq_k<K, V, GDP_BWD_N(4)>(plan, bv, states, dry_run, occ, b16, two)));
  }
}

/* The (K, V) roots: every kernel of this file is instantiated through these three, one set
 * per (K, V); the dispatchers below call them by name.  Defined at the end of the
 * namespace: all ten sets here when the file is compiled whole, one set per part file
 * when it is compiled in parts (chunk_forward.cu's header). */
#define GDP_BWD_DECLARE_ROOTS(K, V)                                                                             \
  gdp_status seq_k##K##v##V(const Plan &plan, int bv, bool states, bool dry_run, int *occ, bf16 *b16, bool two);          \
  gdp_status grad_k##K##v##V(const Plan &plan, const GradStateOut &go, bool wy);                                \
  gdp_status pair_k##K##v##V(int n, int bv, int *fits);
GDP_BWD_DECLARE_ROOTS(32, 32)
GDP_BWD_DECLARE_ROOTS(32, 64)
GDP_BWD_DECLARE_ROOTS(32, 128)
GDP_BWD_DECLARE_ROOTS(64, 32)
GDP_BWD_DECLARE_ROOTS(64, 64)
GDP_BWD_DECLARE_ROOTS(64, 128)
GDP_BWD_DECLARE_ROOTS(128, 32)
GDP_BWD_DECLARE_ROOTS(128, 64)
GDP_BWD_DECLARE_ROOTS(128, 128)
GDP_BWD_DECLARE_ROOTS(256, 128) /* K = 256: V = 128 only (chunk_shapes.cu pads narrower V) */

/* The roots' (K, V) pairs, and a pair's case label in the dispatchers below. */
#define GDP_BWD_EACH_KV(X) \
  X(32, 32) X(32, 64) X(32, 128) X(64, 32) X(64, 64) X(64, 128) X(128, 32) X(128, 64) X(128, 128) X(256, 128)
static constexpr int root_index(int K, int V) { return K * 1000 + V; }

/* two: the fork beside a 2-stage dstate (fork_mode 2) */
static gdp_status launch_seq(const Plan &plan, int bv, bool states, bool dry_run, int *occ, bf16 *b16 = nullptr,
                             bool two = false) {
  switch (root_index(plan.a.K, plan.a.V)) {
#define GDP_BWD_CASE(K, V) \
  case root_index(K, V): return seq_k##K##v##V(plan, bv, states, dry_run, occ, b16, two);
    GDP_BWD_EACH_KV(GDP_BWD_CASE)
#undef GDP_BWD_CASE
  }
  return GDP_ERROR(GDP_ERR_INTERNAL, "launch_seq: K = %d, V = %d", plan.a.K, plan.a.V);
}

/* The per-chunk gradients: the state part, then (wy) the WY part; one 8-warp block per
 * (chunk, head) each.  The state part runs two blocks per SM (a three-block version
 * measured slower on the H200, n = 2 0.74 -> 0.89 ms: its 64-column key panels read k, q
 * and the states from L2 twice); dKnA travels as bf16 (GradStateOut); no early
 * L2 prefetch (it made both kernels slower). */
template <int K, int V, int C, int TC>
static gdp_status launch_grad_state_kv(const Plan &plan, const GradStateOut &go, bool wy) {
  const dim3 grid((unsigned)plan.a.nchunks, (unsigned)plan.a.H);
  if (!wy) {
    using L = GradStateLayout<K, V, C, TC>;
    auto kern = chunk_grad_state_kernel<K, V, C, TC>;
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, L::total));
    /* two blocks per SM need the largest shared-memory carveout */
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    kern<<<grid, dim3(256), L::total, plan.stream>>>(plan.a, go);
    GDP_CUDA_LAUNCHED("chunk_grad_state_kernel");
  } else {
    using L = GradWYLayout<K, V, C>;
    auto kern = chunk_grad_wy_kernel<K, V, C, TC>;
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, L::total));
    GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    kern<<<grid, dim3(256), L::total, plan.stream>>>(plan.a, go);
    GDP_CUDA_LAUNCHED("chunk_grad_wy_kernel");
  }
  return GDP_OK;
}

template <int K, int V>
static gdp_status launch_grad_state_n(const Plan &plan, const GradStateOut &go, bool wy) {
  switch (plan.a.n) {
    case 1: GDP_BWD_CASE_N(1, (launch_grad_state_kv<K, V, GDP_BWD_N(1)>(plan, go, wy)));
    case 2: GDP_BWD_CASE_N(2, (launch_grad_state_kv<K, V, GDP_BWD_N(2)>(plan, go, wy)));
    case 3: GDP_BWD_CASE_N(3, (launch_grad_state_kv<K, V, GDP_BWD_N(3)>(plan, go, wy)));
    default: GDP_BWD_CASE_N(4, (launch_grad_state_kv<K, V, GDP_BWD_N(4)>(plan, go, wy)));
  }
}

static gdp_status launch_chunk_grad(const Plan &plan, const GradStateOut &go, bool wy) {
  if (plan.a.nchunks == 0) return GDP_OK;
  switch (root_index(plan.a.K, plan.a.V)) {
#define GDP_BWD_CASE(K, V) \
  case root_index(K, V): return grad_k##K##v##V(plan, go, wy);
    GDP_BWD_EACH_KV(GDP_BWD_CASE)
#undef GDP_BWD_CASE
  }
  return GDP_ERROR(GDP_ERR_INTERNAL, "launch_chunk_grad: K = %d, V = %d", plan.a.K, plan.a.V);
}

/* Blocks per SM of the sequential passes at value-block width bv (the dstate kernel's,
 * whose shared memory is the larger of the two); -1 where it cannot run. */
static int seq_blocks_per_sm(const Plan &plan, int bv) {
  const GdpArgs &a = plan.a;
  /* depends only on (K, V, n, bv); benign race */
  static int occ_cache[kWidths][3][kMaxChunkN][3] = {};
  int &occ = occ_cache[width_index(a.K)][width_index(a.V)][a.n - 1][bv == 16 ? 0 : bv == 32 ? 1 : 2];
  if (occ == 0 && launch_seq(plan, bv, false, true, &occ) != GDP_OK) occ = -1;
  return occ;
}

/* Value-block width as in the forward: the fewest waves, narrower on a tie; the
 * problem's value_block forces it. */
static int choose_bv(const Plan &plan) {
  const GdpArgs &a = plan.a;
  if (plan.value_block) return plan.value_block;
  int best = 16;
  double best_waves = INFINITY;
  for (int bv : {16, 32, 64}) {
    if (a.V % bv) continue;
    const int occ = seq_blocks_per_sm(plan, bv);
    if (occ < 1) continue;
    const double waves = ceil((double)a.N * a.H * (a.V / bv) / ((double)num_sms() * occ));
    if (waves < best_waves) best_waves = waves, best = bv;
  }
  return best;
}

/* The recompute backward's two sequential passes -- the states forward in time
 * (chunk_state_recompute_kernel) and the state gradients backward in time (chunk_dstate_kernel) --
 * read only the prep's panels, d_o and dht, and write disjoint buffers (h^T, D against
 * dH^T, dD, dh0), as fla's chunk_fwd_h and chunk_bwd_dhu are independent too.  Forked,
 * the state-gradient pass runs on a second stream beside the states pass: the two chains
 * overlap where both passes' blocks are resident at once.  H200, bf16, H = 16, K = V =
 * 128, library fwd+bwd: 1 x 32768 n = 1 5.52 -> 4.38 ms, n = 3 13.44 -> 10.91-11.10;
 * where the blocks fill the GPU it costs 1-3% (4 x 4096 n = 3 4.07 -> 4.18).  So: fork
 * where one pass leaves SMs idle (at most one block per SM) and both fit on the SMs at
 * once (twice its blocks over blocks per SM at most the SM count), or, with bf16 states,
 * where a states block fits beside a 2-stage dstate block (fork_mode 2: 1 x 32768 n = 2,
 * where a states block, 124.2 KB, and a 3-stage dstate block, 149.8 KB, do not fit
 * together but one of 100.0 KB does; 8.72-8.76 -> 7.27-7.39 ms).  Never while profiling
 * (its marks time one stream).
 *
 * Whether two kernels' blocks fit side by side on one SM (both at the max-shared
 * carveout): their registers from CUDA (cudaFuncGetAttributes), their shared memory from
 * the layouts, the SM's limits from the device, and the arithmetic of CUDA's occupancy
 * calculator for the two together. */

/* What one block holds on an SM, as CUDA's occupancy calculator counts it: shared memory
 * (dynamic + static + the per-block reserve, in 128-byte units), warps, registers per warp
 * (allocated per warp in units of 256). */
struct Footprint {
  int smem, warps, regs_per_warp;
};
static Footprint footprint(int dyn_smem, int static_smem, int reserved_smem, int threads, int regs_per_thread) {
  return {(dyn_smem + static_smem + reserved_smem + 127) / 128 * 128, (threads + 31) / 32,
          (regs_per_thread * 32 + 255) / 256 * 256};
}

/* SM limits: shared memory at the largest carveout, registers (split over 4 sub-partitions;
 * a block's warps go round-robin over them), warps, blocks. */
struct SmLimits {
  int smem, regs, warps, blocks;
};

/* Whether one block of a and one of b are resident on an SM together.  Registers: the 4
 * sub-partitions separately, each block's warps placed round-robin from the sub-partition
 * with the most free registers (the hardware's placement is not documented; this model
 * matched the occupancy tool's measurements). */
static bool pair_fits(const Footprint &a, const Footprint &b, const SmLimits &sm) {
  if (a.smem + b.smem > sm.smem || a.warps + b.warps > sm.warps || sm.blocks < 2) return false;
  int free_regs[4];
  for (int &f : free_regs) f = sm.regs / 4;
  for (const Footprint *f : {&a, &b}) {
    int best = 0;
    for (int p = 1; p < 4; p++)
      if (free_regs[p] > free_regs[best]) best = p;
    for (int w = 0; w < f->warps; w++)
      if ((free_regs[(best + w) % 4] -= f->regs_per_warp) < 0) return false;
  }
  return true;
}

static gdp_status sm_limits(SmLimits *sm, int *reserved) {
  int dev = 0;
  GDP_CUDA_TRY(cudaGetDevice(&dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(&sm->smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(&sm->regs, cudaDevAttrMaxRegistersPerMultiprocessor, dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(&sm->warps, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(&sm->blocks, cudaDevAttrMaxBlocksPerMultiprocessor, dev));
  GDP_CUDA_TRY(cudaDeviceGetAttribute(reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  sm->warps /= 32;
  return GDP_OK;
}

/* The fork's pair: the states pass + the 2-stage dstate (bf16 states only). */
template <int K, int V, int C, int TC, int BV>
static gdp_status pair_bv(int *fits) {
  SmLimits sm;
  int reserved = 0;
  GDP_TRY(sm_limits(&sm, &reserved));
  cudaFuncAttributes fd, fs;
  GDP_CUDA_TRY(cudaFuncGetAttributes(&fd, chunk_dstate_kernel<K, V, C, TC, BV, 2>));
  GDP_CUDA_TRY(cudaFuncGetAttributes(&fs, chunk_state_recompute_kernel<K, V, C, BV>));
  const Footprint d = footprint(DStateLayout<K, C, TC, BV, 2, true>::total, (int)fd.sharedSizeBytes, reserved,
                                BV / 16 * 32, fd.numRegs);
  const Footprint st =
      footprint(StatesLayout<K, C, BV>::total, (int)fs.sharedSizeBytes, reserved, BV / 16 * 32, fs.numRegs);
  *fits = pair_fits(d, st, sm) ? 1 : 0;
  return GDP_OK;
}

template <int K, int V, int C, int TC>
static gdp_status pair_k(int bv, int *fits) {
  switch (bv) {
    case 64: return pair_bv<K, V, C, TC, 64>(fits);
    case 32: return pair_bv<K, V, C, TC, 32>(fits);
    default: return pair_bv<K, V, C, TC, 16>(fits);
  }
}

template <int K, int V>
static gdp_status pair_n(int n, int bv, int *fits) {
  switch (n) {
    case 1: GDP_BWD_CASE_N(1, (pair_k<K, V, GDP_BWD_N(1)>(bv, fits)));
    case 2: GDP_BWD_CASE_N(2, (pair_k<K, V, GDP_BWD_N(2)>(bv, fits)));
    case 3: GDP_BWD_CASE_N(3, (pair_k<K, V, GDP_BWD_N(3)>(bv, fits)));
    default: GDP_BWD_CASE_N(4, (pair_k<K, V, GDP_BWD_N(4)>(bv, fits)));
  }
}

/* Whether a states block and a 2-stage dstate block fit on one SM together. */
static bool fork2_pair_fits(const Plan &plan, int bv) {
  const GdpArgs &a = plan.a;
  static int cache[kWidths][3][kMaxChunkN][3] = {}; /* 1 fits, -1 not; depends only on (K, V, n, bv); benign race */
  int &c = cache[width_index(a.K)][width_index(a.V)][a.n - 1][bv == 16 ? 0 : bv == 32 ? 1 : 2];
  if (c == 0) {
    int fits = 0;
    gdp_status st = GDP_ERR_INTERNAL;
    switch (root_index(a.K, a.V)) {
#define GDP_BWD_CASE(K, V) \
  case root_index(K, V): st = pair_k##K##v##V(a.n, bv, &fits); break;
      GDP_BWD_EACH_KV(GDP_BWD_CASE)
#undef GDP_BWD_CASE
    }
    if (st != GDP_OK) (void)cudaGetLastError(); /* no pair, and no stale error for the next launch check */
    c = st == GDP_OK && fits ? 1 : -1;
  }
  return c > 0;
}

/* Whether (and how) to fork, see above: 0 no; 1 with the 3-stage dstate; 2 with the
 * 2-stage dstate (bf16 states only), where only that one fits beside a states block. */
static int fork_mode(const Plan &plan, int bv, bool s16) {
  if (gdp_debug_profile_kernels()) return 0;
  const GdpArgs &a = plan.a;
  const int occ = seq_blocks_per_sm(plan, bv);
  const double blocks = (double)a.N * a.H * (a.V / bv);
  const bool one = occ >= 1 && blocks <= num_sms() && 2.0 * blocks / occ <= num_sms();
  const bool two = !one && s16 && blocks <= num_sms() && fork2_pair_fits(plan, bv);
  return one ? 1 : two ? 2 : 0;
}

/* One non-blocking side stream per device, made on first use and kept for the process
 * (as a library handle would be); concurrent callers share it, which orders their side
 * work but keeps each call's own order through its events. */
static gdp_status side_stream(cudaStream_t *out) {
  static std::mutex mu;
  static cudaStream_t streams[64];
  int dev = 0;
  GDP_CUDA_TRY(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return GDP_ERROR(GDP_ERR_INTERNAL, "side_stream: device %d (at most 64 devices)", dev);
  std::lock_guard<std::mutex> lock(mu);
  if (!streams[dev]) GDP_CUDA_TRY(cudaStreamCreateWithFlags(&streams[dev], cudaStreamNonBlocking));
  *out = streams[dev];
  return GDP_OK;
}

/* A fork of `main` onto the side stream and its join; the events are destroyed at the
 * join (CUDA releases them once they complete). */
struct Fork {
  cudaStream_t side = nullptr;
  cudaEvent_t forked = nullptr, done = nullptr;
};

static gdp_status fork_begin(cudaStream_t main, Fork *f) {
  GDP_TRY(side_stream(&f->side));
  GDP_CUDA_TRY(cudaEventCreateWithFlags(&f->forked, cudaEventDisableTiming));
  GDP_CUDA_TRY(cudaEventCreateWithFlags(&f->done, cudaEventDisableTiming));
  GDP_CUDA_TRY(cudaEventRecord(f->forked, main));
  GDP_CUDA_TRY(cudaStreamWaitEvent(f->side, f->forked, 0));
  return GDP_OK;
}

/* Joins (main waits for everything queued on the side stream since the fork) and frees
 * the events; also after a failed fork_begin, whatever it made. */
static gdp_status fork_end(cudaStream_t main, Fork *f, bool join) {
  cudaError_t e = cudaSuccess;
  if (join) {
    e = cudaEventRecord(f->done, f->side);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(main, f->done, 0);
    /* main must not run ahead of the side pass: without the join, wait for it here */
    if (e != cudaSuccess) cudaStreamSynchronize(f->side);
  }
  if (f->forked) cudaEventDestroy(f->forked);
  if (f->done) cudaEventDestroy(f->done);
  f->forked = f->done = nullptr;
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return GDP_ERROR(GDP_ERR_CUDA, "backward: joining the side stream: %s", cudaGetErrorString(e));
  }
  return GDP_OK;
}

/* The recompute's two passes, forked where fork_mode says and the fork can be made
 * (otherwise one after the other on the caller's stream). */
static gdp_status launch_state_passes(const Plan &plan, int bv, const GradStateOut &go) {
  Fork f;
  const int fm = fork_mode(plan, bv, go.hT16 != nullptr);
  const bool forked = fm > 0 && fork_begin(plan.stream, &f) == GDP_OK;
  if (!forked) {
    /* a fork that could not be made (no stream or event to spare) is no error: the
     * passes run in order; its CUDA error must not reach the next launch check */
    fork_end(plan.stream, &f, false);
    (void)cudaGetLastError();
    gdp_status st = launch_seq(plan, bv, true, false, nullptr, go.hT16);
    prof_mark("bwd states (recompute)", plan.stream);
    if (st == GDP_OK) st = launch_seq(plan, bv, false, false, nullptr, go.dHT16);
    prof_mark("bwd state gradients", plan.stream);
    return st;
  }
  Plan side = plan;
  side.stream = f.side;
  /* the backward-in-time pass first, so its blocks are queued by the time the states
   * pass's blocks start */
  gdp_status st = launch_seq(side, bv, false, false, nullptr, go.dHT16, fm == 2);
  const gdp_status st2 = launch_seq(plan, bv, true, false, nullptr, go.hT16, fm == 2);
  const gdp_status st3 = fork_end(plan.stream, &f, true);
  if (st == GDP_OK) st = st2;
  if (st == GDP_OK) st = st3;
  return st;
}

#define GDP_BWD_DEFINE_ROOTS(K, V)                                                                              \
  gdp_status seq_k##K##v##V(const Plan &plan, int bv, bool states, bool dry_run, int *occ, bf16 *b16, bool two) {          \
    return launch_seq_n<K, V>(plan, bv, states, dry_run, occ, b16, two);                                   \
  }                                                                                                             \
  gdp_status grad_k##K##v##V(const Plan &plan, const GradStateOut &go, bool wy) {                              \
    return launch_grad_state_n<K, V>(plan, go, wy);                                                             \
  }                                                                                                             \
  gdp_status pair_k##K##v##V(int n, int bv, int *fits) { return pair_n<K, V>(n, bv, fits); }
#define GDP_BWD_DEFINE_PART_ROOTS(K, V) GDP_BWD_DEFINE_ROOTS(K, V) /* K, V expanded first */
#if !defined(GDP_CHUNK_PARTS)
GDP_BWD_DEFINE_ROOTS(32, 32)
GDP_BWD_DEFINE_ROOTS(32, 64)
GDP_BWD_DEFINE_ROOTS(32, 128)
GDP_BWD_DEFINE_ROOTS(64, 32)
GDP_BWD_DEFINE_ROOTS(64, 64)
GDP_BWD_DEFINE_ROOTS(64, 128)
GDP_BWD_DEFINE_ROOTS(128, 32)
GDP_BWD_DEFINE_ROOTS(128, 64)
GDP_BWD_DEFINE_ROOTS(128, 128)
GDP_BWD_DEFINE_ROOTS(256, 128)
#elif defined(GDP_PART_K)
GDP_BWD_DEFINE_PART_ROOTS(GDP_PART_K, GDP_PART_V)
#endif

}  // namespace chunked_backward
}  // namespace gdpcu

#ifndef GDP_PART_K /* the entry points: in the whole file or its main part, not in a (K, V) part */
namespace gdpcu {
namespace chunked_backward {

/* With the blocks a saved forward kept: its plan (tables, panels), h^T (bf16) and D are
 * read from there, so the prep and the states pass are skipped; the state-gradient pass
 * and the two gradient kernels run as in the recompute. */
static gdp_status backward_saved(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, cudaStream_t stream,
                                 const void *saved) {
  const chunked::SavedLayout sl = chunked::saved_layout(p);
  Plan plan;
  prof_begin(stream);
  /* the kept block is only read: its tables and panels are the forward's */
  gdp_status st = plan_make(p, stream, PLAN_FORWARD, bwd_args(p, io), &plan, const_cast<void *>(saved), false);
  if (st != GDP_OK) {
    prof_end(stream);
    return st;
  }
  GradStateOut go;
  memset(&go, 0, sizeof go);
  void *extra = nullptr;
  const int bv = choose_bv(plan);
  if (plan.a.nchunks > 0) {
    const size_t CH = (size_t)plan.a.nchunks * plan.a.H, K = (size_t)plan.a.K, V = (size_t)plan.a.V,
                 C = (size_t)plan.a.C;
    const size_t bdD = align128(CH * C * V * 2), bHT = align128(CH * V * K * 2), bKn = align128(CH * C * K * 4),
                 bW = align128(CH * C * K * 2), bG = align128(CH * C * 4);
    st = device_alloc(&extra, bdD + bHT + bKn + bW + bG, stream);
    if (st != GDP_OK) {
      prof_end(stream);
      return st;
    }
    char *e = (char *)extra;
    plan.a.Dbuf = (bf16 *)((char *)const_cast<void *>(saved) + sl.o_D);
    plan.a.dDbuf = (bf16 *)e;
    go.hT16 = (bf16 *)((char *)const_cast<void *>(saved) + sl.o_hT);
    go.dHT16 = (bf16 *)(e + bdD);
    go.dKnA = (float *)(e + bdD + bHT);
    go.dWg = (bf16 *)(e + bdD + bHT + bKn);
    go.dgcA = (float *)(e + bdD + bHT + bKn + bW);
    go.Tt = (bf16 *)((char *)const_cast<void *>(saved) + sl.o_Tt);
  }
  prof_mark("bwd plan (saved)", stream);
  /* also without chunks (every sequence empty): the reverse pass writes dh0 = dht */
  st = launch_seq(plan, bv, false, false, nullptr, go.dHT16);
  prof_mark("bwd state gradients", stream);
  if (st == GDP_OK) st = launch_chunk_grad(plan, go, false);
  prof_mark("bwd chunk gradients, state part", stream);
  if (st == GDP_OK) st = launch_chunk_grad(plan, go, true);
  prof_mark("bwd chunk gradients, WY part", stream);
  if (extra) cudaFreeAsync(extra, stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

/* The recompute backward: the prep (also storing T^T), the states pass and the
 * state-gradient pass (forked where that pays), then the two gradient kernels. */
static gdp_status backward_recompute(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, cudaStream_t stream) {
  GdpArgs a = bwd_args(p, io);
  Plan plan;
  prof_begin(stream);
  /* The gradient kernels' bf16 copies of h^T and dH^T, the state part's outputs and T^T
   * from the prep (one stream-ordered allocation; the forward never pays for T). */
  gdp_status st = plan_make(p, stream, PLAN_BACKWARD, a, &plan);
  if (st != GDP_OK) {
    prof_end(stream);
    return st;
  }
  prof_mark("bwd plan+upload", stream);
  GradStateOut go;
  memset(&go, 0, sizeof go);
  void *extra = nullptr;
  const int bv = choose_bv(plan);
  if (plan.a.nchunks > 0) {
    const size_t CH = (size_t)plan.a.nchunks * plan.a.H, K = (size_t)plan.a.K, V = (size_t)plan.a.V,
                 C = (size_t)plan.a.C;
    const size_t bHT = align128(CH * V * K * 2), bKn = align128(CH * C * K * 4), bW = align128(CH * C * K * 2),
                 bG = align128(CH * C * 4), bT = align128(CH * C * C * 2);
    st = device_alloc(&extra, 2 * bHT + bKn + bW + bG + bT, stream);
    if (st != GDP_OK) {
      plan_free(&plan);
      prof_end(stream);
      return st;
    }
    char *e = (char *)extra;
    go.hT16 = (bf16 *)e;
    go.dHT16 = (bf16 *)(e + bHT);
    go.dKnA = (float *)(e + 2 * bHT);
    go.dWg = (bf16 *)(e + 2 * bHT + bKn);
    go.dgcA = (float *)(e + 2 * bHT + bKn + bW);
    go.Tt = (bf16 *)(e + 2 * bHT + bKn + bW + bG);
  }
  /* U formed in the states pass from Tu and v, where its value block holds Tu^T in the
   * residual's region (bv >= C); the prep then stores Tu^T into U's buffer instead of U
   * and U's residual.  Elsewhere the states pass reads U and its bf16 residual (the
   * plan's a.Ulo: D = U - W h then starts from U to ~16 bits instead of 8; dg's z terms
   * amplify D's error, docs/kernels.md §3.6). */
  if (bv >= plan.a.C && plan.a.C <= plan.a.V) {
    plan.a.Tu = plan.a.U;
    plan.a.Ulo = nullptr;
  }
  st = chunked::launch_chunk_prep(plan, go.Tt);
  prof_mark("bwd prep (recompute)", stream);
  if (st == GDP_OK) st = launch_state_passes(plan, bv, go);
  if (st == GDP_OK) st = launch_chunk_grad(plan, go, false);
  prof_mark("bwd chunk gradients, state part", stream);
  if (st == GDP_OK) st = launch_chunk_grad(plan, go, true);
  prof_mark("bwd chunk gradients, WY part", stream);
  if (extra) cudaFreeAsync(extra, stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

/* dh0 alone: the prep (as the forward's: no T^T, no U residual) and the state-gradient
 * pass, which reads only the prep's panels, d_o and dht; its dH^T copies go to a scratch
 * buffer nothing reads. */
static gdp_status backward_dh0_recompute(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                                         cudaStream_t stream) {
  Plan plan;
  prof_begin(stream);
  gdp_status st = plan_make(p, stream, PLAN_BACKWARD, bwd_args(p, io), &plan);
  if (st != GDP_OK) {
    prof_end(stream);
    return st;
  }
  plan.a.Ulo = nullptr;
  plan.a.Tu = nullptr;
  const int bv = choose_bv(plan);
  void *dHT16 = nullptr;
  if (plan.a.nchunks > 0) {
    st = device_alloc(&dHT16, align128((size_t)plan.a.nchunks * plan.a.H * plan.a.V * plan.a.K * 2), stream);
    if (st == GDP_OK) st = chunked::launch_chunk_prep(plan, nullptr);
    prof_mark("bwd dh0: prep", stream);
  }
  /* also without chunks (every sequence empty): the reverse pass writes dh0 = dht */
  if (st == GDP_OK) st = launch_seq(plan, bv, false, false, nullptr, (bf16 *)dHT16);
  prof_mark("bwd dh0: state gradients", stream);
  if (dHT16) cudaFreeAsync(dHT16, stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

}  // namespace chunked_backward

namespace chunked {
bool takes_dh0(const gdp_delta_product_problem *p) {
  return takes(p) && !needs_split(p) && !needs_padding(p) && !needs_value_split(p);
}

gdp_status backward_dh0(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, cudaStream_t stream) {
  if (p->N == 0) return GDP_OK;
  return chunked_backward::backward_dh0_recompute(p, io, stream);
}

/* The dispatch has validated p and io and checked that the fast path takes p. */
gdp_status backward(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, cudaStream_t stream, const void *saved) {
  if (p->N == 0) return GDP_OK;
  if (needs_split(p)) return backward_split(p, io, stream, saved);
  if (needs_padding(p)) return backward_padded(p, io, stream, saved);
  if (needs_value_split(p)) return backward_value_split(p, io, stream, saved);
  return saved ? chunked_backward::backward_saved(p, io, stream, saved) : chunked_backward::backward_recompute(p, io, stream);
}
}  // namespace chunked
}  // namespace gdpcu
#endif /* GDP_PART_K */
