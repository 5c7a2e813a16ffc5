/*
 * chunk_forward.cu -- the fast path's forward: the launchers of the prep and the state
 * pass, their host-side choices (value-block width, the two-warp pass, U from Tu and v),
 * and the entry points (plan.cuh).
 *
 * Compiled in parts, in parallel: the kernels are instantiated through a few "root"
 * functions, one per (K, n) here (state_k64n2, prep_k64n2, ...; K in {32, 64, 128} with
 * n = 1..4, K = 256 with n = 2), and the rest of the file
 * calls the roots by name.  CMake generates one unit per (K, n) that defines
 * GDP_CHUNK_PARTS, GDP_PART_K and GDP_PART_N and includes this file (only that part's
 * roots: its kernels), and a main unit with GDP_CHUNK_PARTS alone (every root declared,
 * none defined: the dispatchers and entry points, compiled in seconds).  Whole, one nvcc
 * process took 4 minutes or more.  Linked together the parts hold the same code as the
 * whole file, which still builds alone (nothing defined: every root in it).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunk_prep.cuh"

#if defined(GDP_PART_K) && !defined(GDP_CHUNK_PARTS)
#error "chunk_forward.cu: a part (GDP_PART_K defined) needs GDP_CHUNK_PARTS defined too"
#endif

namespace gdpcu {
namespace chunked {

/* ------------------------------------------------------------------ host side */

/* save: the SAVE pass (h^T in bf16 to hT16 and D to plan.a.Dbuf, besides o); a dry run
 * only asks the occupancy of the pass it names (hT16 may then be NULL).  tu (one-warp pass
 * only): the pass that forms U from a.Tu and v (chunk_state_kernel's TU). */
template <int K, int C, int TC, int BV>
static gdp_status launch_bv(const Plan &plan, bool dry_run, int *blocks_per_sm, bool save, bf16 *hT16,
                            bool ks2, bool tu) {
  const GdpArgs &a = plan.a;
  if (tu && ks2)
    return GDP_ERROR(GDP_ERR_INTERNAL, "launch_chunk_state: U from Tu and v is a one-warp pass (ks2 asked)");
  if constexpr (C % 32 == 0 && TC % 32 == 0 && K >= 64) {
    /* two warps per 16 value columns (chunk_state_pair_kernel), plain or saving; each
     * warp holds half of S^T's K columns, whose h^T staging (ks2_stage_hT16) stores 8
     * half rows of at least 64 bytes per instruction: K >= 64 (at K = 32 one store would
     * span 16 rows of the warp's 8) */
    if (ks2) {
      const int smem = save ? Ks2Layout<K, C, TC, BV, true>::total : Ks2Layout<K, C, TC, BV, false>::total;
      /* the saving pair pass at BV = 64 (K = 128) needs more than an SM's 227 KB: it does
       * not run there (0 blocks; choose_ks2 then keeps the one-warp pass) -- asked without
       * a CUDA call, whose error would linger for the next launch check */
      if (smem > 227 * 1024) {
        if (dry_run) {
          *blocks_per_sm = 0;
          return GDP_OK;
        }
        return GDP_ERROR(GDP_ERR_INTERNAL, "chunk_state_pair_kernel: %d bytes of shared memory (at most %d)", smem,
                         227 * 1024);
      }
      auto kern = save ? chunk_state_pair_kernel<K, C, TC, BV, true> : chunk_state_pair_kernel<K, C, TC, BV, false>;
      GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      if (dry_run) {
        GDP_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, BV / 16 * 64, smem));
        return GDP_OK;
      }
      kern<<<dim3((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV)), dim3(BV / 16 * 64), smem, plan.stream>>>(
          a, hT16);
      GDP_CUDA_LAUNCHED("chunk_state_pair_kernel");
      return GDP_OK;
    }
  }
  /* the saving pass also stages U's residual (or, tu, Tu^T): a larger stage */
  const int smem = !save ? (tu ? Layout<K, C, TC, BV, false, true>::total : Layout<K, C, TC, BV, false>::total)
                   : tu  ? Layout<K, C, TC, BV, true, true>::total
                         : Layout<K, C, TC, BV, true>::total;
  auto kern = !save ? (tu ? chunk_state_kernel<K, C, TC, BV, false, true> : chunk_state_kernel<K, C, TC, BV, false>)
              : tu  ? chunk_state_kernel<K, C, TC, BV, true, true>
                    : chunk_state_kernel<K, C, TC, BV, true>;
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (dry_run) {
    GDP_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kern, BV / 16 * 32, smem));
    return GDP_OK;
  }
  kern<<<dim3((unsigned)a.N, (unsigned)a.H, (unsigned)(a.V / BV)), dim3(BV / 16 * 32), smem, plan.stream>>>(a, hT16);
  GDP_CUDA_LAUNCHED("chunk_state_kernel");
  return GDP_OK;
}

template <int K, int C, int TC>
static gdp_status launch_k(const Plan &plan, int bv, bool dry_run, int *occ, bool save, bf16 *hT16,
                           bool ks2, bool tu) {
  switch (bv) {
    case 64: return launch_bv<K, C, TC, 64>(plan, dry_run, occ, save, hT16, ks2, tu);
    case 32: return launch_bv<K, C, TC, 32>(plan, dry_run, occ, save, hT16, ks2, tu);
    default: return launch_bv<K, C, TC, 16>(plan, dry_run, occ, save, hT16, ks2, tu);
  }
}

/* The (K, n) roots: every kernel of this file is instantiated through these two, one pair
 * per K and n; the dispatchers call them by name.  Defined at the end of the namespace:
 * all thirteen pairs here when the file is compiled whole, one per part file when it is
 * compiled in parts (chunk_forward.cu's header). */
#define GDP_FWD_DECLARE_ROOTS(K, N)                                                                          \
  gdp_status state_k##K##n##N(const Plan &plan, int bv, bool dry_run, int *occ, bool save, bf16 *hT16,       \
                              bool ks2, bool tu);                                                \
  gdp_status prep_k##K##n##N(const Plan &plan, bf16 *Tt);
GDP_FWD_DECLARE_ROOTS(32, 1)
GDP_FWD_DECLARE_ROOTS(32, 2)
GDP_FWD_DECLARE_ROOTS(32, 3)
GDP_FWD_DECLARE_ROOTS(32, 4)
GDP_FWD_DECLARE_ROOTS(64, 1)
GDP_FWD_DECLARE_ROOTS(64, 2)
GDP_FWD_DECLARE_ROOTS(64, 3)
GDP_FWD_DECLARE_ROOTS(64, 4)
GDP_FWD_DECLARE_ROOTS(128, 1)
GDP_FWD_DECLARE_ROOTS(128, 2)
GDP_FWD_DECLARE_ROOTS(128, 3)
GDP_FWD_DECLARE_ROOTS(128, 4)
GDP_FWD_DECLARE_ROOTS(256, 2) /* K = 256: n = 2 alone (chunk_steps_of) */

static gdp_status launch_chunk_state(const Plan &plan, int bv, bool dry_run, int *occ, bool save,
                                  bf16 *hT16 = nullptr, bool ks2 = false, bool tu = false) {
  const GdpArgs &a = plan.a;
  if (a.K == 256) {
    if (a.n == 2) return state_k256n2(plan, bv, dry_run, occ, save, hT16, ks2, tu);
    return GDP_ERROR(GDP_ERR_INTERNAL, "launch_chunk_state: K = 256 has no chunk at n = %d", a.n);
  }
  if (a.K == 128) {
    if (a.n == 1) return state_k128n1(plan, bv, dry_run, occ, save, hT16, ks2, tu);
    if (a.n == 2) return state_k128n2(plan, bv, dry_run, occ, save, hT16, ks2, tu);
    if (a.n == 3) return state_k128n3(plan, bv, dry_run, occ, save, hT16, ks2, tu);
    return state_k128n4(plan, bv, dry_run, occ, save, hT16, ks2, tu);
  }
  if (a.K == 32) {
    if (a.n == 1) return state_k32n1(plan, bv, dry_run, occ, save, hT16, ks2, tu);
    if (a.n == 2) return state_k32n2(plan, bv, dry_run, occ, save, hT16, ks2, tu);
    if (a.n == 3) return state_k32n3(plan, bv, dry_run, occ, save, hT16, ks2, tu);
    return state_k32n4(plan, bv, dry_run, occ, save, hT16, ks2, tu);
  }
  if (a.n == 1) return state_k64n1(plan, bv, dry_run, occ, save, hT16, ks2, tu);
  if (a.n == 2) return state_k64n2(plan, bv, dry_run, occ, save, hT16, ks2, tu);
  if (a.n == 3) return state_k64n3(plan, bv, dry_run, occ, save, hT16, ks2, tu);
  return state_k64n4(plan, bv, dry_run, occ, save, hT16, ks2, tu);
}

/* Value-block width: the fewest waves of blocks; on a tie the narrower block (more SMs
 * busy, fewer warps sharing one SM's shared-memory bandwidth).  Every block walks all
 * chunks of its sequence, so a wave costs one sequence's full chain.  By the occupancy of
 * the pass that runs: the saving pass's larger stage fits fewer blocks (at K = V = 128,
 * n = 3 the plain pass's choice, BV = 32, ran the saving pass in two waves).  The
 * problem's value_block (validated by the dispatch) forces a width.  tu: the pass that
 * forms U itself (its stage also holds Tu^T, C x C; the saving one's instead of the
 * residual). */
static int choose_bv(const Plan &plan, bool save, bool tu = false) {
  const GdpArgs &a = plan.a;
  if (plan.value_block) return plan.value_block;
  int best = 16;
  double best_waves = INFINITY;
  for (int bv : {16, 32, 64}) {
    if (a.V % bv) continue;
    /* occupancy depends only on (save, K, n, bv): asked once, then cached (benign race) */
    static int occ_cache[2][2][kWidths][kMaxChunkN][3] = {};
    int &occ = occ_cache[save][tu][width_index(a.K)][a.n - 1][bv == 16 ? 0 : bv == 32 ? 1 : 2];
    if (occ == 0 && launch_chunk_state(plan, bv, true, &occ, save, nullptr, false, tu) != GDP_OK) occ = -1;
    if (occ < 1) continue;
    const double blocks = (double)a.N * a.H * (a.V / bv);
    const double waves = ceil(blocks / ((double)num_sms() * occ));
    if (waves < best_waves) best_waves = waves, best = bv;
  }
  return best;
}

/* Two warps per 16 value columns (chunk_state_pair_kernel; n = 1, 2 only), plain or saving
 * pass?  Where choose_bv takes one-warp blocks (BV = 16: a few long sequences, e.g.
 * 1 x 32768 at H = 16, 128 blocks on 132 SMs, one warp each), unless the pair kernel's
 * exchange (and, saving, staging) buffers would fit fewer blocks per SM.  (Wherever the
 * pair kernel fits, at other widths too, measured slower.) */
static bool choose_ks2(const Plan &plan, int bv, bool save, bool tu = false) {
  const GdpArgs &a = plan.a;
  if (a.n > 2 || bv != 16 || a.K < 64) return false; /* the pair kernel: K >= 64 (launch_bv) */
  /* occupancy depends only on (K, n, save, BV): asked once, then cached (benign race) */
  /* tu: the one-warp pass it is weighed against is the one that forms U itself */
  static int occ_cache[kWidths][2][2][2][3][2] = {};
  int *occ = occ_cache[width_index(a.K)][a.n - 1][save][tu][bv == 64 ? 2 : bv == 32 ? 1 : 0];
  if (occ[0] == 0 && launch_chunk_state(plan, bv, true, &occ[0], save, nullptr, false, tu) != GDP_OK)
    occ[0] = -1;
  if (occ[1] == 0 && launch_chunk_state(plan, bv, true, &occ[1], save, nullptr, true) != GDP_OK) occ[1] = -1;
  return occ[1] >= 1 && occ[1] >= occ[0];
}

/* One prep launch.  Heads-first block order (a 1-D grid, heads fastest: the blocks of one
 * chunk share its k, v rows in L2) and the W/U item owners that balance the warps' work:
 * with U's residual stored, the residual-aware ones (docs/kernels.md §3.2; neither
 * changes a bit of the output). */
template <int K, int V, int C, int TC, bool STORE_T, bool STORE_ULO, bool TU_OUT = false, bool FIVE = false>
static gdp_status launch_prep_kernel(const Plan &plan, bf16 *Tt) {
  using L = PrepLayout<K, V, C, TC, TU_OUT>;
  auto kern = chunk_prep_kernel<K, V, C, TC, STORE_T, STORE_ULO, TU_OUT, FIVE>;
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, L::total));
  /* four blocks of up to 54.5 KB per SM need (nearly) all of the unified L1 as shared memory */
  GDP_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared));
  const uint32_t owners = TU_OUT      ? prep_w_owner_bits<K, C>()
                          : STORE_ULO ? prep_wu_owner_bits_ulo<K, V, C>()
                                      : prep_wu_owner_bits<K, V, C>();
  /* heads first needs the chunk-head count in one grid dimension (< 2^31) */
  const int64_t nblocks = (int64_t)plan.a.nchunks * plan.a.H;
  const bool head_first = nblocks <= 0x7fffffff;
  const dim3 grid = head_first ? dim3((unsigned)nblocks) : dim3((unsigned)plan.a.nchunks, (unsigned)plan.a.H);
  kern<<<grid, 128, L::total, plan.stream>>>(plan.a, Tt, owners, head_first ? 1 : 0);
  GDP_CUDA_LAUNCHED("chunk_prep_kernel");
  return GDP_OK;
}

/* The prep for a state pass that forms U itself (plan.a.Tu set): Tu^T instead of U, no v;
 * with T^T where Tt is given (the saving forward, the recompute backward).  At C = 48
 * compiled for five blocks per SM (FIVE): ptxas fits it in 96 registers without spilling
 * there; at C = 32 every prep runs five already, at C = 64 five would spill (~56 bytes). */
template <int K, int V, int C, int TC>
static gdp_status launch_prep_tu(const Plan &plan, bf16 *Tt) {
  if constexpr (C > V) { /* Tu^T ([C][C]) would not fit U's buffer ([C][V]) */
    return GDP_ERROR(GDP_ERR_INTERNAL, "launch_chunk_prep: Tu with C %d > V %d", C, V);
  } else {
    if (plan.a.Ulo) return GDP_ERROR(GDP_ERR_INTERNAL, "launch_chunk_prep: Tu with U's residual");
    constexpr bool five = C == 48;
    return Tt ? launch_prep_kernel<K, V, C, TC, true, false, true, five>(plan, Tt)
              : launch_prep_kernel<K, V, C, TC, false, false, true, five>(plan, nullptr);
  }
}

template <int K, int V, int C, int TC>
static gdp_status launch_prep_kv(const Plan &plan, bf16 *Tt) {
  if (plan.a.Tu) return launch_prep_tu<K, V, C, TC>(plan, Tt);
  if (!Tt) return launch_prep_kernel<K, V, C, TC, false, false>(plan, nullptr);
  return plan.a.Ulo ? launch_prep_kernel<K, V, C, TC, true, true>(plan, Tt)
                    : launch_prep_kernel<K, V, C, TC, true, false>(plan, Tt);
}

/* n's chunk: C steps, TC tokens (chunk_steps_of, chunk_tokens_of) */
#define GDP_FWD_DEFINE_ROOTS(K, N)                                                                           \
  gdp_status state_k##K##n##N(const Plan &plan, int bv, bool dry_run, int *occ, bool save, bf16 *hT16,       \
                              bool ks2, bool tu) {                                                           \
    return launch_k<K, chunk_steps_of(N, K), chunk_tokens_of(N, K)>(plan, bv, dry_run, occ, save, hT16, ks2, \
                                                                     tu);                                    \
  }                                                                                                          \
  gdp_status prep_k##K##n##N(const Plan &plan, bf16 *Tt) {                                                  \
    constexpr int C = chunk_steps_of(N, K), TC = chunk_tokens_of(N, K);                                      \
    if constexpr (K > 128) /* V = 128 only (chunk_shapes.cu pads narrower V) */                             \
      return launch_prep_kv<K, 128, C, TC>(plan, Tt);                                                        \
    else                                                                                                     \
      return plan.a.V == 128  ? launch_prep_kv<K, 128, C, TC>(plan, Tt)                                     \
             : plan.a.V == 64 ? launch_prep_kv<K, 64, C, TC>(plan, Tt)                                      \
                              : launch_prep_kv<K, 32, C, TC>(plan, Tt);                                     \
  }
#define GDP_FWD_DEFINE_PART_ROOTS(K, N) GDP_FWD_DEFINE_ROOTS(K, N) /* K, N expanded first */
#if !defined(GDP_CHUNK_PARTS)
GDP_FWD_DEFINE_ROOTS(32, 1)
GDP_FWD_DEFINE_ROOTS(32, 2)
GDP_FWD_DEFINE_ROOTS(32, 3)
GDP_FWD_DEFINE_ROOTS(32, 4)
GDP_FWD_DEFINE_ROOTS(64, 1)
GDP_FWD_DEFINE_ROOTS(64, 2)
GDP_FWD_DEFINE_ROOTS(64, 3)
GDP_FWD_DEFINE_ROOTS(64, 4)
GDP_FWD_DEFINE_ROOTS(128, 1)
GDP_FWD_DEFINE_ROOTS(128, 2)
GDP_FWD_DEFINE_ROOTS(128, 3)
GDP_FWD_DEFINE_ROOTS(128, 4)
GDP_FWD_DEFINE_ROOTS(256, 2)
#elif defined(GDP_PART_K) && GDP_PART_N >= 1 && GDP_PART_N <= 4
GDP_FWD_DEFINE_PART_ROOTS(GDP_PART_K, GDP_PART_N)
#elif defined(GDP_PART_K)
#error "a forward part needs GDP_PART_N = 1..4"
#endif

#ifndef GDP_PART_K /* the file's other external definitions and its entry points: in the
                       * whole file or its main part, not in a K part */
/* Also the backward's recompute and the saving forward, which pass Tt (bf16 [C][C] per
 * (chunk, head)) to get T^T (and U's residual, where plan.a.Ulo is set) stored for the
 * backward's kernels; the plain forward passes NULL and runs the kernel without either
 * store. */
gdp_status launch_chunk_prep(const Plan &plan, bf16 *Tt) {
  /* the residual is only written by the BWD instantiation: without it, the state pass
   * that reads a.Ulo would read whatever the buffer held */
  if (plan.a.Ulo && !Tt)
    return GDP_ERROR(GDP_ERR_INTERNAL, "launch_chunk_prep: Ulo given without Tt (the residual is stored only "
                                       "with T^T)");
  if (plan.a.nchunks == 0) return GDP_OK;
  const int n = plan.a.n;
  if (plan.a.K == 256)
    return n == 2 ? prep_k256n2(plan, Tt)
                  : GDP_ERROR(GDP_ERR_INTERNAL, "launch_chunk_prep: K = 256 has no chunk at n = %d", n);
  if (plan.a.K == 128)
    return n == 1   ? prep_k128n1(plan, Tt)
           : n == 2 ? prep_k128n2(plan, Tt)
           : n == 3 ? prep_k128n3(plan, Tt)
                    : prep_k128n4(plan, Tt);
  if (plan.a.K == 32)
    return n == 1   ? prep_k32n1(plan, Tt)
           : n == 2 ? prep_k32n2(plan, Tt)
           : n == 3 ? prep_k32n3(plan, Tt)
                    : prep_k32n4(plan, Tt);
  return n == 1 ? prep_k64n1(plan, Tt) : n == 2 ? prep_k64n2(plan, Tt) : n == 3 ? prep_k64n3(plan, Tt) : prep_k64n4(plan, Tt);
}

SavedLayout saved_layout(const gdp_delta_product_problem *p) {
  SavedLayout L;
  const int64_t C = chunk_steps(p->n, p->K), TC = C / p->n;
  int64_t nchunks = 0;
  for (int64_t s = 0; s < p->N; s++) nchunks += (p->cu_seqlens[s + 1] - p->cu_seqlens[s] + TC - 1) / TC;
  const size_t CH = (size_t)nchunks * (size_t)p->H;
  L.plan = align128(plan_bytes(p, PLAN_FORWARD));
  L.o_hT = L.plan;
  L.o_D = L.o_hT + align128(CH * (size_t)(p->V * p->K) * 2);
  L.o_Tt = L.o_D + align128(CH * (size_t)(C * p->V) * 2);
  L.total = L.o_Tt + align128(CH * (size_t)(C * C) * 2);
  return L;
}

bool takes(const gdp_delta_product_problem *p) {
  return p && p->dtype == GDP_DTYPE_BF16 && p->K >= 1 && p->K <= kMaxFastK && p->V >= 1 && p->V <= kMaxFastV &&
         fast_chunk_steps(p->n, p->K) > 0;
}

size_t saved_bytes(const gdp_delta_product_problem *p) {
  if (!takes(p) || p->N == 0) return 0;
  std::vector<int64_t> cu;
  int parts = 1;
  const gdp_delta_product_problem kp = kernel_problem(p, cu, &parts); /* the runs the kernels make */
  return parts * saved_layout(&kp).total;
}

/* The plain forward of V = 256 in one prep and one state pass over all 256 columns, in
 * place (no copies into halves).  Where the state pass forms U from Tu and v itself (tu:
 * C <= V / 2, every instance), the prep reads no v and writes nothing sized by V (Tu^T is
 * C x C per chunk and head), and the state pass takes V and its blocks' column offsets
 * from a.V at run time; so the prep runs on the V = 128 instance, planned for V = 128,
 * and the state pass on the same plan with a.V = 256: twice the column blocks.  (The
 * saving forward keeps the halves: its saved layout is one block per half.)  The caller
 * checks that tu applies (C <= V / 2). */
static gdp_status forward_wide_plain(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                                     cudaStream_t stream) {
  gdp_delta_product_problem ph = *p;
  ph.V = p->V / 2;
  GdpArgs a = fwd_args(p, io);
  a.V = (int)ph.V; /* the plan's buffers and the prep's instance: a half's */
  Plan plan;
  prof_begin(stream);
  gdp_status st = plan_make(&ph, stream, PLAN_FORWARD, a, &plan, nullptr, true);
  if (st != GDP_OK) {
    prof_end(stream);
    return st;
  }
  plan.a.Tu = plan.a.U;
  plan.a.Ulo = nullptr;
  prof_mark("fwd plan+upload", stream);
  st = launch_chunk_prep(plan, nullptr);
  prof_mark("fwd prep", stream);
  plan.a.V = (int)p->V;
  /* the one-warp TU pass only: the two-warp pass (ks2) reads U with stride C * a.V, past
   * this plan's buffer, which is a half's (launch_bv also refuses tu with ks2) */
  if (st == GDP_OK) st = launch_chunk_state(plan, choose_bv(plan, false, true), false, nullptr, false, nullptr, false, true);
  prof_mark("fwd state+output (all value columns)", stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

/* The forward; saved non-NULL: the plan lives in the caller's block (saved_layout) and the
 * state pass also stores h^T (bf16) and D there.  The dispatch has validated p and io. */
gdp_status forward(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io, cudaStream_t stream, void *saved) {
  if (p->N == 0) return GDP_OK;
  if (needs_split(p)) return forward_split(p, io, stream, saved);
  if (needs_padding(p)) return forward_padded(p, io, stream, saved);
  if (needs_value_split(p)) {
    if (!saved && chunk_steps(p->n, p->K) <= p->V / 2) return forward_wide_plain(p, io, stream);
    return forward_value_split(p, io, stream, saved);
  }
  GdpArgs a = fwd_args(p, io);
  Plan plan;
  prof_begin(stream);
  SavedLayout sl = {0, 0, 0, 0, 0};
  bf16 *hT16 = nullptr, *Tt = nullptr;
  if (saved) {
    sl = saved_layout(p);
    hT16 = (bf16 *)((char *)saved + sl.o_hT);
    Tt = (bf16 *)((char *)saved + sl.o_Tt);
  }
  gdp_status st = plan_make(p, stream, PLAN_FORWARD, a, &plan, saved, true);
  if (st != GDP_OK) {
    prof_end(stream);
    return st;
  }
  if (saved) {
    /* D is kept for the backward, so it gets what the recompute backward's D gets: U's
     * bf16 residual added before D is formed (GdpArgs::Ulo; the largest single rounding
     * in dg, docs/kernels.md §3.6).  The residual has D's shape, so the prep writes it
     * into the D region itself and the SAVE state pass overwrites it chunk by chunk: a
     * block reads its columns of chunk c (cp.async, waited for) before it stores D there,
     * and no other block touches those columns.  (Where the pass forms U itself, below,
     * there is no residual: U is never rounded.) */
    plan.a.Dbuf = (bf16 *)((char *)saved + sl.o_D);
    plan.a.Ulo = plan.a.Dbuf;
  }
  /* The state pass is chosen before the prep runs: whether it forms U from Tu and v (tu;
   * the one-warp pass, C <= V) decides what the prep stores.  Tu^T ([C][C] bf16 per
   * (chunk, head)) goes into U's buffer, which the prep then does not write (C <= V: it
   * fits).  Forming U inside D's accumulator saves U's round trip through memory
   * (docs/kernels.md §3.3). */
  const bool tu_wanted = plan.a.C <= plan.a.V;
  const int bv = choose_bv(plan, saved != nullptr, tu_wanted);
  const bool ks2 = choose_ks2(plan, bv, saved != nullptr, tu_wanted);
  const bool tu = tu_wanted && !ks2;
  if (tu) {
    plan.a.Tu = plan.a.U;
    plan.a.Ulo = nullptr;
  }
  prof_mark("fwd plan+upload", stream);
  /* saving: the prep also stores T^T for grad_wy (the recompute backward's prep does) */
  st = launch_chunk_prep(plan, Tt);
  prof_mark("fwd prep", stream);
  if (st == GDP_OK) st = launch_chunk_state(plan, bv, false, nullptr, saved != nullptr, hT16, ks2, tu);
  prof_mark(saved ? "fwd state+output (saving h, D)" : "fwd state+output", stream);
  plan_free(&plan);
  prof_end(stream);
  return st;
}

#endif /* GDP_PART_K */
}  // namespace chunked
}  // namespace gdpcu
