/*
 * v3_occupancy.cu -- host-only table of the per-SM resources of every variant-3 kernel
 * launch at the benchmark shapes (bf16, H = 16, K = V = 128), as the library chooses
 * them: the kernel taken (prep, state pass or state_ks2 pair pass, bwd_states, dstate,
 * grad_state, grad_wy), its grid, threads, dynamic shared memory, registers per thread
 * (from a ptxas -v log of the lab build) and blocks per SM on an H200 -- computed with
 * CUDA's own occupancy calculator (cuda_occupancy.h, the code behind
 * cudaOccupancyMaxActiveBlocksPerMultiprocessor) on the H200's properties, so no GPU is
 * needed.  It replays the host's choices (choose_bv of gdp_fwd_v3.cu and gdp_bwd_v3.cu,
 * choose_ks2, fork_wanted), then asks which pairs of kernels could be resident on one
 * SM together (the question behind the forked state passes and any further overlap).
 *
 * The shared-memory layouts are re-derived here (namespace occ) from the kernels' host
 * constexprs; building with -DV3OCC_CHECK_FWD / -DV3OCC_CHECK_BWD includes the kernel
 * sources and static_asserts that every re-derived size equals the real one (a compile
 * check only: that object is not linked).  tools/v3_occupancy.sh builds both checks and
 * the program and runs it.
 *
 * Usage: v3_occupancy [ptxas.log]   (default /tmp/lab-p7b/ptxas.log; tools/gpu_lab_build.sh
 * writes DIR/ptxas.log).  Exit status 1 if a kernel's register count is not in the log.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <map>
#include <string>
#include <vector>

#include <cuda_occupancy.h>

/* ------------------------------------------------------------------ re-derived layouts */

namespace occ {

constexpr int kStages = 3, kPad = 8;

template <int K, int C>
struct HtStage {
  static constexpr int row = K * 4 + 32, drow = 48;
  static constexpr int warp_bytes = 8 * row > C * drow ? 8 * row : C * drow;
};

template <int K, int C>
struct Ks2Stage {
  static constexpr int row = K / 2 * 4 + 32, drow = 48;
  static constexpr int warp_bytes = 8 * row > C / 2 * drow ? 8 * row : C / 2 * drow;
};

/* gdp_fwd_v3.cu: Layout (state_kernel_v3) */
template <int K, int C, int TC, int BV, bool ULO>
struct Layout {
  static constexpr int ldK = K + kPad, ldC = C + kPad, ldB = BV + kPad;
  static constexpr int stage_raw = 2 * C * ldK * 2 + TC * ldK * 2 + TC * ldC * 2 + C * ldB * 2 + (ULO ? C * ldB * 2 : 0);
  static constexpr int stage = (stage_raw + 127) / 128 * 128;
  static constexpr int total = stage * kStages + (ULO ? BV / 16 * HtStage<K, C>::warp_bytes : 0);
};

/* gdp_fwd_v3.cu: Ks2Layout (state_ks2_kernel_v3) */
template <int K, int C, int TC, int BV, bool SAVE>
struct Ks2Layout {
  static constexpr int total = Layout<K, C, TC, BV, SAVE>::stage * kStages + BV / 16 * (K / 16) * 512 +
                               BV / 16 * (C / 16) * 512 + (SAVE ? BV / 16 * 2 * Ks2Stage<K, C>::warp_bytes : 0);
};

/* gdp_fwd_v3.cu: PrepLayout (prep_kernel_v3), STAGED and SPLIT as the default launch */
constexpr int prep_a_row(int i) {
  return 4 * (2 * ((i + 3) / 4) * ((i + 3) / 4 - 1) + ((i + 3) % 4) * ((i + 3) / 4));
}
template <int C>
struct PrepSplit {
  static constexpr int F = C > 32 ? 32 : 16, RB = (C - F) / 4;
  static constexpr int ld = (F + 3 * RB) % 8 == 4 ? F + 3 * RB : F + 3 * RB + 4;
  static constexpr int bytes = 32 * ld * 4;
};
template <int K, int V, int C, int TC, bool STAGED, bool SPLIT>
struct PrepLayout {
  static constexpr int ldK = K + kPad, ldV = V + kPad, ldT = C + kPad;
  static constexpr int oQ = C * ldK * 2 + C * ldV * 2 + 2 * C * 4;
  static constexpr int endA = oQ + TC * ldK * 2 + prep_a_row(C) * 4, endT = oQ + 2 * C * ldT * 2;
  static constexpr int endAT = endA > endT ? endA : endT;
  static constexpr int oSolve = TC * ldK * 2 >= PrepSplit<C>::bytes ? oQ
                                : C == 48                         ? (endAT + 15) / 16 * 16
                                                                  : (endA + 15) / 16 * 16;
  static constexpr int endS = SPLIT ? oSolve + PrepSplit<C>::bytes : 0;
  static constexpr int end = endAT > endS ? endAT : endS;
  static constexpr int total = STAGED ? (end + 127) / 128 * 128 + 4 * 512 : end;
};

/* gdp_bwd_v3.cu: StatesLayout, DStateLayout, GradStateLayout, GradWYLayout */
template <int K, int C, int BV>
struct StatesLayout {
  static constexpr int ldK = K + kPad, ldB = BV + kPad;
  static constexpr int stage = (2 * C * ldK * 2 + 2 * C * ldB * 2 + 127) / 128 * 128;
  static constexpr int total = stage * kStages + BV / 16 * HtStage<K, C>::warp_bytes;
};
/* STAGES, STAGE16 (not in the kernels: the overlap plan's variants): pipeline depth, and
 * a staging buffer sized for bf16 states only (8 rows of 2K + 16 bytes, or the C x 48
 * bytes of the D / dD tile, whichever is larger) */
template <int K, int C>
constexpr int ht_warp_bytes(bool stage16) {
  return !stage16 ? HtStage<K, C>::warp_bytes : 8 * (2 * K + 16) > C * 48 ? 8 * (2 * K + 16) : C * 48;
}
template <int K, int C, int BV, int STAGES = kStages, bool STAGE16 = false>
struct StatesLayoutV {
  static constexpr int ldK = K + kPad, ldB = BV + kPad;
  static constexpr int stage = (2 * C * ldK * 2 + 2 * C * ldB * 2 + 127) / 128 * 128;
  static constexpr int total = stage * STAGES + BV / 16 * ht_warp_bytes<K, C>(STAGE16);
};
template <int K, int C, int TC, int BV, int STAGES = kStages, bool STAGE16 = false>
struct DStateLayout {
  static constexpr int ldK = K + kPad, ldC = C + kPad, ldB = BV + kPad;
  static constexpr int stage = (2 * C * ldK * 2 + TC * ldK * 2 + TC * ldC * 2 + TC * ldB * 2 + 127) / 128 * 128;
  static constexpr int total = stage * STAGES + BV / 16 * ht_warp_bytes<K, C>(STAGE16);
};
template <int K, int V, int C, int TC>
struct GradStateLayout {
  static constexpr int ldK = K + kPad, ldV = V + kPad, ldC = C + kPad;
  static constexpr int oF = V * ldK * 2 + 2 * C * ldV * 2 + TC * ldV * 2 + C * ldK * 2 + TC * ldK * 2 + TC * ldC * 2;
  static constexpr int nF = 3 * C + (TC / 16) * C + (K / 64) * C + TC + (K / 32) * TC + 8; /* with the partial-sum slots */
  static constexpr int total = oF + nF * 4 + 16;
};
template <int K, int V, int C>
struct GradWYLayout {
  static constexpr int ldK = K + kPad, ldV = V + kPad, ldC = C + kPad;
  static constexpr int NL = (C / 16) * (C / 16 + 1) / 2;
  static constexpr int nF = 5 * C + (V / 64 + 2 * (K / 64)) * C + 2 * NL * 16; /* with the partial-sum slots */
  static constexpr int szKn = C * ldK * 2, szV = C * ldV * 2, szC = C * ldC * 2;
  static constexpr bool kLateDW = 2 * szKn + 2 * szV + 2 * szC + nF * 4 > 76800;
  static constexpr int szP = kLateDW ? NL * 1024 : 0;
  static constexpr int odD = szKn + (kLateDW && szKn > szV ? szKn : szV);
  static constexpr int oT = kLateDW ? odD + szV : odD + szV + szKn;
  static constexpr int total = oT + szC + (szP > szC ? szP : szC) + nF * 4;
};
constexpr int grad_wy_blocks(int K, int V, int C) {
  return C == 64 ? (K == 128 && V == 128 ? 3 : 2) : (K == 128 && V == 64 ? 2 : 3);
}

}  // namespace occ

/* ------------------------------------------------------------------ the compile checks */

#if defined(V3OCC_CHECK_FWD)
#include "gdp_fwd_v3.cu"
#define SAME(a, b) static_assert((a) == (b), #a " == " #b)
#define CHECK_STATE(K, C, TC, BV)                                                                                  \
  SAME((occ::Layout<K, C, TC, BV, false>::total), (gdpcu::v3::Layout<K, C, TC, BV, false>::total));                \
  SAME((occ::Layout<K, C, TC, BV, true>::total), (gdpcu::v3::Layout<K, C, TC, BV, true>::total));                  \
  SAME((occ::Ks2Layout<K, C, TC, BV, false>::total), (gdpcu::v3::Ks2Layout<K, C, TC, BV, false>::total));          \
  SAME((occ::Ks2Layout<K, C, TC, BV, true>::total), (gdpcu::v3::Ks2Layout<K, C, TC, BV, true>::total));
#define CHECK_STATE3(K, C, TC) CHECK_STATE(K, C, TC, 16) CHECK_STATE(K, C, TC, 32) CHECK_STATE(K, C, TC, 64)
CHECK_STATE3(128, 32, 32)
CHECK_STATE3(128, 64, 32)
CHECK_STATE3(128, 48, 16)
#define CHECK_PREP(K, V, C, TC)                                                                                    \
  SAME((occ::PrepLayout<K, V, C, TC, true, true>::total), (gdpcu::v3::PrepLayout<K, V, C, TC, true, true>::total)); \
  SAME((occ::PrepLayout<K, V, C, TC, true, false>::total), (gdpcu::v3::PrepLayout<K, V, C, TC, true, false>::total));
CHECK_PREP(128, 128, 32, 32)
CHECK_PREP(128, 128, 64, 32)
CHECK_PREP(128, 128, 48, 16)
#endif

#if defined(V3OCC_CHECK_BWD)
#include "gdp_bwd_v3.cu"
#define SAME(a, b) static_assert((a) == (b), #a " == " #b)
#define CHECK_SEQ(K, V, C, TC, BV)                                                                                 \
  SAME((occ::StatesLayout<K, C, BV>::total), (gdpcu::v3b::StatesLayout<K, C, BV>::total));                         \
  SAME((occ::DStateLayout<K, C, TC, BV>::total), (gdpcu::v3b::DStateLayout<K, C, TC, BV>::total));           \
  SAME((occ::DStateLayout<K, C, TC, BV, 2, true>::total), (gdpcu::v3b::DStateLayout<K, C, TC, BV, 2, true>::total));
#define CHECK_GRAD(K, V, C, TC)                                                                                    \
  CHECK_SEQ(K, V, C, TC, 16) CHECK_SEQ(K, V, C, TC, 32) CHECK_SEQ(K, V, C, TC, 64)                                 \
  SAME((occ::GradStateLayout<K, V, C, TC>::total), (gdpcu::v3b::GradStateLayout<K, V, C, TC>::total));             \
  SAME((occ::GradWYLayout<K, V, C>::total), (gdpcu::v3b::GradWYLayout<K, V, C>::total));                           \
  SAME((occ::grad_wy_blocks(K, V, C)), (gdpcu::v3b::grad_wy_blocks(K, V, C)));
CHECK_GRAD(128, 128, 32, 32)
CHECK_GRAD(128, 128, 64, 32)
CHECK_GRAD(128, 128, 48, 16)
#endif

/* ------------------------------------------------------------------ registers from ptxas */

/* ptxas -v: "Compiling entry function '<mangled>'" ... "Used N registers, used B barriers" */
struct Regs {
  int regs = -1, barriers = 1;
};
static std::map<std::string, Regs> g_regs;

static bool read_ptxas_log(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return false;
  char line[4096];
  std::string cur;
  while (fgets(line, sizeof line, f)) {
    const char *p = strstr(line, "Compiling entry function '");
    if (p) {
      p += strlen("Compiling entry function '");
      const char *q = strchr(p, '\'');
      cur = q ? std::string(p, q - p) : std::string();
      continue;
    }
    p = strstr(line, "Used ");
    if (p && !cur.empty() && strstr(line, "registers")) {
      Regs r;
      r.regs = atoi(p + 5);
      const char *b = strstr(line, "used ");
      if (b && strstr(b, "barriers")) r.barriers = atoi(b + 5);
      g_regs[cur] = r;
      cur.clear();
    }
  }
  fclose(f);
  return true;
}

/* Itanium mangling of gdpcu::<ns>::<name><args...>: every instantiation here takes ints
 * and bools only, so the prefix "_ZN5gdpcu<ns><name>I<args>EE" identifies it. */
struct TArg {
  bool is_bool;
  int v;
};
static std::string mangle(const char *ns, const char *name, std::vector<TArg> args) {
  std::string s = "_ZN5gdpcu" + std::to_string(strlen(ns)) + ns + std::to_string(strlen(name)) + name + "I";
  for (const TArg &a : args) s += (a.is_bool ? "Lb" : "Li") + std::to_string(a.v) + "E";
  return s + "EE";
}
static TArg I(int v) { return {false, v}; }
static TArg B(bool v) { return {true, v ? 1 : 0}; }

static Regs regs_of(const std::string &prefix) {
  for (const auto &kv : g_regs)
    if (kv.first.compare(0, prefix.size(), prefix) == 0) return kv.second;
  fprintf(stderr, "v3_occupancy: no ptxas entry for %s\n", prefix.c_str());
  exit(1);
}

/* ------------------------------------------------------------------ H200 occupancy */

constexpr int kSms = 132;

static cudaOccDeviceProp h200() {
  cudaOccDeviceProp p;
  p.computeMajor = 9;
  p.computeMinor = 0;
  p.maxThreadsPerBlock = 1024;
  p.maxThreadsPerMultiprocessor = 2048;
  p.regsPerBlock = 65536;
  p.regsPerMultiprocessor = 65536;
  p.warpSize = 32;
  p.sharedMemPerBlock = 48 * 1024;
  p.sharedMemPerMultiprocessor = 228 * 1024;
  p.numSms = kSms;
  p.sharedMemPerBlockOptin = 227 * 1024;
  p.reservedSharedMemPerBlock = 1024;
  return p;
}

/* One kernel launch as the host makes it. */
struct Launch {
  std::string what;   /* role in the call, e.g. "bwd dstate" */
  std::string kernel; /* readable instantiation */
  std::string mangled;
  long long grid;
  int threads, smem, launch_bound_threads;
  Regs r;
  int bps = 0;          /* blocks per SM (cudaOccMaxActiveBlocksPerMultiprocessor) */
  const char *limit = "";
  int regs_per_warp = 0; /* allocated */
};

static int blocks_per_sm(int threads, int smem, Regs r, const char **limit = nullptr, int *regs_per_warp = nullptr) {
  const cudaOccDeviceProp prop = h200();
  cudaOccFuncAttributes at;
  at.maxThreadsPerBlock = 1024;
  at.numRegs = r.regs;
  at.sharedSizeBytes = 0;
  at.partitionedGCConfig = PARTITIONED_GC_OFF;
  at.shmemLimitConfig = FUNC_SHMEM_LIMIT_OPTIN; /* cudaFuncAttributeMaxDynamicSharedMemorySize is set */
  at.maxDynamicSharedSizeBytes = smem;
  at.numBlockBarriers = r.barriers > 0 ? r.barriers : 1;
  cudaOccDeviceState st;
  cudaOccResult res;
  if (cudaOccMaxActiveBlocksPerMultiprocessor(&res, &prop, &at, &st, threads, (size_t)smem) != CUDA_OCC_SUCCESS)
    return -1;
  if (limit) {
    const int f = res.limitingFactors;
    *limit = f & OCC_LIMIT_SHARED_MEMORY ? "smem" : f & OCC_LIMIT_REGISTERS ? "regs" : f & OCC_LIMIT_WARPS ? "warps"
             : f & OCC_LIMIT_BLOCKS ? "blocks" : f & OCC_LIMIT_BARRIERS ? "barriers" : "-";
  }
  if (regs_per_warp) *regs_per_warp = (r.regs * 32 + 255) / 256 * 256;
  return res.activeBlocksPerMultiprocessor;
}

static void finish(Launch &l) {
  l.r = regs_of(l.mangled);
  l.bps = blocks_per_sm(l.threads, l.smem, l.r, &l.limit, &l.regs_per_warp);
}

/* ------------------------------------------------------------------ co-residency */

/* Resources one block takes on an SM: shared memory as the calculator allocates it (its
 * dynamic bytes plus the 1 KB reserved, in 128-byte units), warps, registers per warp. */
struct Footprint {
  int smem, warps, rpw;
};
static Footprint footprint(const Launch &l) {
  return {(l.smem + 1024 + 127) / 128 * 128, (l.threads + 31) / 32, l.regs_per_warp};
}

/* Whether `na` blocks of a and `nb` of b fit on one SM together: 228 KB of shared memory
 * (both at the largest carveout), 64 warps, 32 blocks, and registers per SM sub-partition
 * (16384 each; a block's warps go round-robin over the four, here placed greedily where
 * most registers are free -- the hardware's placement is not documented; the per-kernel
 * calculator above assumes the same even spread). */
static bool fits(const Footprint &a, int na, const Footprint &b, int nb) {
  if (na * a.smem + nb * b.smem > 228 * 1024) return false;
  if (na * a.warps + nb * b.warps > 64 || na + nb > 32) return false;
  int freeregs[4] = {16384, 16384, 16384, 16384};
  auto place = [&](const Footprint &f) {
    int best = 0;
    for (int s = 1; s < 4; s++)
      if (freeregs[s] > freeregs[best]) best = s;
    for (int w = 0; w < f.warps; w++) {
      int &fr = freeregs[(best + w) % 4];
      fr -= f.rpw;
      if (fr < 0) return false;
    }
    return true;
  };
  for (int i = 0; i < na; i++)
    if (!place(a)) return false;
  for (int i = 0; i < nb; i++)
    if (!place(b)) return false;
  return true;
}

/* The most blocks of b that fit beside na blocks of a. */
static int beside(const Launch &a, int na, const Launch &b) {
  const Footprint fa = footprint(a), fb = footprint(b);
  int nb = 0;
  while (nb < 32 && fits(fa, na, fb, nb + 1)) nb++;
  return fits(fa, na, fb, 0) ? nb : -1;
}

/* ------------------------------------------------------------------ the host's choices */

struct Shape {
  int B, T, n;
};
constexpr int H = 16, K = 128, V = 128;

static int chunk_c(int n) { return n == 1 ? 32 : n == 2 ? 64 : 48; }
static int chunk_tc(int n) { return n == 1 ? 32 : n == 2 ? 32 : 16; }
static long long nchunks(const Shape &s) { return (long long)s.B * ((s.T + chunk_tc(s.n) - 1) / chunk_tc(s.n)); }

/* Shared memory of the instantiations the host asks for, by (n, bv): templates need the
 * constants, so each shape is spelled out. */
template <int C, int TC, int BV>
struct Sizes {
  static constexpr int state = occ::Layout<K, C, TC, BV, false>::total;
  static constexpr int state_save = occ::Layout<K, C, TC, BV, true>::total;
  static constexpr int ks2 = occ::Ks2Layout<K, C, TC, BV, false>::total;
  static constexpr int ks2_save = occ::Ks2Layout<K, C, TC, BV, true>::total;
  static constexpr int states = occ::StatesLayout<K, C, BV>::total;
  static constexpr int dstate = occ::DStateLayout<K, C, TC, BV>::total;
  static constexpr int dstate2 = occ::DStateLayout<K, C, TC, BV, 2>::total;
};
struct SizeRow {
  int state, state_save, ks2, ks2_save, states, dstate, dstate2;
  /* the overlap plan's variants, [stages 3, 2][f32 / bf16-only staging] */
  int statesv[2][2], dstatev[2][2];
};
template <int C, int TC, int BV>
static SizeRow size_row() {
  using S = Sizes<C, TC, BV>;
  using namespace occ;
  return {S::state,
          S::state_save,
          S::ks2,
          S::ks2_save,
          S::states,
          S::dstate,
          S::dstate2,
          {{StatesLayoutV<K, C, BV, 3, false>::total, StatesLayoutV<K, C, BV, 3, true>::total},
           {StatesLayoutV<K, C, BV, 2, false>::total, StatesLayoutV<K, C, BV, 2, true>::total}},
          {{DStateLayout<K, C, TC, BV, 3, false>::total, DStateLayout<K, C, TC, BV, 3, true>::total},
           {DStateLayout<K, C, TC, BV, 2, false>::total, DStateLayout<K, C, TC, BV, 2, true>::total}}};
}
static SizeRow sizes(int n, int bv) {
  if (n == 1) return bv == 16 ? size_row<32, 32, 16>() : bv == 32 ? size_row<32, 32, 32>() : size_row<32, 32, 64>();
  if (n == 2) return bv == 16 ? size_row<64, 32, 16>() : bv == 32 ? size_row<64, 32, 32>() : size_row<64, 32, 64>();
  return bv == 16 ? size_row<48, 16, 16>() : bv == 32 ? size_row<48, 16, 32>() : size_row<48, 16, 64>();
}
static int prep_smem(int n) {
  return n == 1 ? occ::PrepLayout<K, V, 32, 32, true, true>::total
         : n == 2 ? occ::PrepLayout<K, V, 64, 32, true, true>::total
                  : occ::PrepLayout<K, V, 48, 16, true, true>::total;
}
static int grad_state_smem(int n) {
  return n == 1 ? occ::GradStateLayout<K, V, 32, 32>::total
         : n == 2 ? occ::GradStateLayout<K, V, 64, 32>::total
                  : occ::GradStateLayout<K, V, 48, 16>::total;
}
static int grad_wy_smem(int n) {
  return n == 1 ? occ::GradWYLayout<K, V, 32>::total : n == 2 ? occ::GradWYLayout<K, V, 64>::total
                                                              : occ::GradWYLayout<K, V, 48>::total;
}

/* gdp_fwd_v3.cu launch_bv's dry run: the kernel asked is the plain or the SAVE, S16 = false
 * instantiation (hT16 is NULL there), one-warp or pair pass. */
static int fwd_state_occ(int n, int bv, bool save, bool ks2) {
  const int C = chunk_c(n), TC = chunk_tc(n);
  const SizeRow z = sizes(n, bv);
  if (ks2) {
    const int smem = save ? z.ks2_save : z.ks2;
    if (smem > 227 * 1024) return 0; /* the launcher's own guard, no CUDA call */
    const Regs r = regs_of(mangle("v3", "state_ks2_kernel_v3", {I(K), I(C), I(TC), I(bv), B(save), B(false)}));
    return blocks_per_sm(bv / 16 * 64, smem, r);
  }
  const Regs r = regs_of(mangle("v3", "state_kernel_v3", {I(K), I(C), I(TC), I(bv), B(save), B(false)}));
  return blocks_per_sm(bv / 16 * 32, save ? z.state_save : z.state, r);
}

/* choose_bv (gdp_fwd_v3.cu): fewest waves, narrower on a tie */
static int fwd_choose_bv(const Shape &s, bool save) {
  int best = 16;
  double best_waves = INFINITY;
  for (int bv : {16, 32, 64}) {
    const int o = fwd_state_occ(s.n, bv, save, false);
    if (o < 1) continue;
    const double waves = ceil((double)s.B * H * (V / bv) / ((double)kSms * o));
    if (waves < best_waves) best_waves = waves, best = bv;
  }
  return best;
}

/* choose_ks2 (gdp_fwd_v3.cu), default mode, no D residual */
static bool fwd_choose_ks2(const Shape &s, int bv, bool save) {
  if (s.n > 2 || bv != 16) return false;
  const int o0 = fwd_state_occ(s.n, bv, save, false), o1 = fwd_state_occ(s.n, bv, save, true);
  return o1 >= 1 && o1 >= o0;
}

/* seq_blocks_per_sm (gdp_bwd_v3.cu): dstate_kernel_v3<K, V, C, TC, BV> with its default
 * template arguments (S16 = false, NEW = true), whatever instantiation then runs */
static int bwd_seq_occ(int n, int bv) {
  const int C = chunk_c(n), TC = chunk_tc(n);
  const Regs r = regs_of(mangle("v3b", "dstate_kernel_v3", {I(K), I(V), I(C), I(TC), I(bv), B(false), B(true), I(3)}));
  return blocks_per_sm(bv / 16 * 32, sizes(n, bv).dstate, r);
}

static int bwd_choose_bv(const Shape &s) {
  int best = 16;
  double best_waves = INFINITY;
  for (int bv : {16, 32, 64}) {
    const int o = bwd_seq_occ(s.n, bv);
    if (o < 1) continue;
    const double waves = ceil((double)s.B * H * (V / bv) / ((double)kSms * o));
    if (waves < best_waves) best_waves = waves, best = bv;
  }
  return best;
}

static bool fork_wanted(const Shape &s, int bv) {
  const int o = bwd_seq_occ(s.n, bv);
  const double blocks = (double)s.B * H * (V / bv);
  return o >= 1 && blocks <= kSms && 2.0 * blocks / o <= kSms;
}

/* ------------------------------------------------------------------ the launches of one call */

static std::string inst(const char *name, std::vector<int> v) {
  std::string s = std::string(name) + "<";
  for (size_t i = 0; i < v.size(); i++) s += (i ? "," : "") + std::to_string(v[i]);
  return s + ">";
}

static Launch prep(const Shape &s, bool store) {
  const int C = chunk_c(s.n), TC = chunk_tc(s.n);
  Launch l;
  l.what = "prep";
  l.kernel = inst("prep_kernel_v3", {K, V, C, TC, store, store, 1, 1});
  l.mangled = mangle("v3", "prep_kernel_v3", {I(K), I(V), I(C), I(TC), B(store), B(store), B(true), B(true)});
  l.grid = nchunks(s) * H;
  l.threads = 128;
  l.smem = prep_smem(s.n);
  finish(l);
  return l;
}

static Launch fwd_state(const Shape &s, bool save) {
  const int C = chunk_c(s.n), TC = chunk_tc(s.n);
  const int bv = fwd_choose_bv(s, save);
  const bool ks2 = fwd_choose_ks2(s, bv, save);
  const SizeRow z = sizes(s.n, bv);
  Launch l;
  const char *name = ks2 ? "state_ks2_kernel_v3" : "state_kernel_v3";
  l.what = save ? "SAVE state" : "state";
  l.kernel = inst(name, {K, C, TC, bv, save, save});
  /* saving with bf16 states: S16 = true runs (the dry runs asked S16 = false) */
  l.mangled = mangle("v3", name, {I(K), I(C), I(TC), I(bv), B(save), B(save)});
  l.grid = (long long)s.B * H * (V / bv);
  l.threads = bv / 16 * (ks2 ? 64 : 32);
  l.smem = ks2 ? (save ? z.ks2_save : z.ks2) : (save ? z.state_save : z.state);
  finish(l);
  return l;
}

static Launch seq(const Shape &s, bool states, int bv) {
  const int C = chunk_c(s.n), TC = chunk_tc(s.n);
  const SizeRow z = sizes(s.n, bv);
  Launch l;
  l.what = states ? "states" : "dstate";
  if (states) {
    l.kernel = inst("bwd_states_kernel_v3", {K, V, C, bv, 1, 1});
    l.mangled = mangle("v3b", "bwd_states_kernel_v3", {I(K), I(V), I(C), I(bv), B(true), B(true)});
    l.smem = z.states;
  } else {
    l.kernel = inst("dstate_kernel_v3", {K, V, C, TC, bv, 1, 1});
    l.mangled = mangle("v3b", "dstate_kernel_v3", {I(K), I(V), I(C), I(TC), I(bv), B(true), B(true), I(3)});
    l.smem = z.dstate;
  }
  l.grid = (long long)s.B * H * (V / bv);
  l.threads = bv / 16 * 32;
  finish(l);
  return l;
}

static Launch grad(const Shape &s, bool wy) {
  const int C = chunk_c(s.n), TC = chunk_tc(s.n);
  Launch l;
  if (wy) {
    l.what = "grad_wy";
    l.kernel = inst("grad_wy_kernel_v3", {K, V, C, TC, 1});
    l.mangled = mangle("v3b", "grad_wy_kernel_v3", {I(K), I(V), I(C), I(TC), B(true)});
    l.smem = grad_wy_smem(s.n);
  } else {
    l.what = "grad_state";
    l.kernel = inst("grad_state_kernel_v3", {K, V, C, TC, 1, 1});
    l.mangled = mangle("v3b", "grad_state_kernel_v3", {I(K), I(V), I(C), I(TC), B(true), B(true), B(false)});
    l.smem = grad_state_smem(s.n);
  }
  l.grid = nchunks(s) * H;
  l.threads = 256;
  finish(l);
  return l;
}

static void print_row(const char *call, const Launch &l) {
  const double waves = (double)l.grid / ((double)kSms * l.bps);
  printf("| %-9s | %-10s | %-38s | %6lld | %4d | %6d (%5.1f KB) | %3d | %d (%s) | %5.2f |\n", call, l.what.c_str(),
         l.kernel.c_str(), l.grid, l.threads, l.smem, l.smem / 1024.0, l.r.regs, l.bps, l.limit, waves);
}

int main(int argc, char **argv) {
  const char *log = argc > 1 ? argv[1] : "/tmp/lab-p7b/ptxas.log";
  if (!read_ptxas_log(log)) {
    fprintf(stderr, "v3_occupancy: cannot read %s\n", log);
    return 1;
  }
  const Shape shapes[] = {{4, 4096, 1}, {4, 4096, 2}, {4, 4096, 3}, {1, 32768, 1},
                          {1, 32768, 2}, {1, 32768, 3}, {2, 8192, 1}, {8, 2048, 1}};
  printf("H200 model: %d SMs, 228 KB shared/SM (227 KB/block + 1 KB reserved), 64K regs (4 x 16K), 2048 threads, "
         "32 blocks.  bf16, H = %d, K = V = %d.  Registers: %s\n\n",
         kSms, H, K, log);
  printf("| call      | launch     | kernel                                 |   grid | thr  | dyn. smem        | reg | "
         "blocks/SM (limit) | waves |\n");
  printf("|-----------|------------|----------------------------------------|--------|------|------------------|-----|"
         "-------------------|-------|\n");
  for (const Shape &s : shapes) {
    char call[64];
    snprintf(call, sizeof call, "%dx%d n%d", s.B, s.T, s.n);
    const int bvb = bwd_choose_bv(s);
    std::vector<std::pair<std::string, Launch>> rows = {
        {"fwd", prep(s, false)},         {"fwd", fwd_state(s, false)}, {"fwd save", prep(s, true)},
        {"fwd save", fwd_state(s, true)}, {"bwd rec", prep(s, true)},   {"bwd rec", seq(s, true, bvb)},
        {"bwd", seq(s, false, bvb)},      {"bwd", grad(s, false)},      {"bwd", grad(s, true)}};
    printf("| **%s** | | | | | | | | |\n", call);
    for (auto &r : rows) print_row(r.first.c_str(), r.second);
  }

  printf("\nHost choices per shape (fwd: choose_bv by the occupancy of the pass that runs, choose_ks2; bwd: choose_bv "
         "and fork_wanted by seq_blocks_per_sm = dstate<..,S16=0,NEW=1> occupancy):\n\n");
  printf("| shape | fwd bv (occ 16/32/64) | ks2? | save bv (occ 16/32/64) | save ks2? | bwd bv (occ 16/32/64) | "
         "seq blocks | fork? | states blocks beside k = 0, 1, .. dstate blocks | (states, dstate) pairs per SM |\n"
         "|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape &s : shapes) {
    const int bvf = fwd_choose_bv(s, false), bvs = fwd_choose_bv(s, true), bvb = bwd_choose_bv(s);
    const Launch st = seq(s, true, bvb), ds = seq(s, false, bvb);
    /* both passes at once: how many (states, dstate) block pairs one SM holds */
    int pairs = 0;
    while (pairs < 32 && beside(st, pairs + 1, ds) >= pairs + 1) pairs++;
    std::string mix;
    for (int k = 0; k <= ds.bps; k++) mix += (k ? "/" : "") + std::to_string(beside(ds, k, st));
    printf("| %dx%d n=%d | %d (%d/%d/%d) | %s | %d (%d/%d/%d) | %s | %d (%d/%d/%d) | %lld | %s | %s | %d |\n",
           s.B, s.T, s.n, bvf, fwd_state_occ(s.n, 16, false, false), fwd_state_occ(s.n, 32, false, false),
           fwd_state_occ(s.n, 64, false, false), fwd_choose_ks2(s, bvf, false) ? "yes" : "no", bvs,
           fwd_state_occ(s.n, 16, true, false), fwd_state_occ(s.n, 32, true, false), fwd_state_occ(s.n, 64, true, false),
           fwd_choose_ks2(s, bvs, true) ? "yes" : "no", bvb, bwd_seq_occ(s.n, 16), bwd_seq_occ(s.n, 32),
           bwd_seq_occ(s.n, 64), (long long)s.B * H * (V / bvb), fork_wanted(s, bvb) ? "FORK" : "no", mix.c_str(),
           pairs);
  }

  /* the choosers ask the occupancy of one instantiation and launch another (S16 = false
   * asked, S16 = true run with bf16 states): same blocks per SM at every shape and width? */
  int differ = 0;
  for (int n = 1; n <= 3; n++)
    for (int bv : {16, 32, 64}) {
      const int C = chunk_c(n), TC = chunk_tc(n);
      const Shape s = {1, 1, n};
      const int asked = bwd_seq_occ(n, bv);
      const Launch run = seq(s, false, bv);
      if (asked != run.bps) differ++, printf("dstate n=%d bv=%d: asked %d, launched %d blocks/SM\n", n, bv, asked, run.bps);
      for (int ks2 = 0; ks2 < 2; ks2++) {
        if (ks2 && n == 3) continue;
        const SizeRow z = sizes(n, bv);
        const int smem = ks2 ? z.ks2_save : z.state_save;
        if (smem > 227 * 1024) continue;
        const char *name = ks2 ? "state_ks2_kernel_v3" : "state_kernel_v3";
        const int a = fwd_state_occ(n, bv, true, ks2);
        const int r = blocks_per_sm(bv / 16 * (ks2 ? 64 : 32), smem,
                                    regs_of(mangle("v3", name, {I(K), I(C), I(TC), I(bv), B(true), B(true)})));
        if (a != r) differ++, printf("%s SAVE n=%d bv=%d: asked %d, launched %d blocks/SM\n", name, n, bv, a, r);
      }
    }
  printf("\nAsked (S16 = false) vs launched (S16 = true) occupancy: %d of the dstate and saving-pass "
         "instantiations differ\n", differ);

  /* co-residency at the shape that matters next: every pair of the backward's kernels */
  for (const Shape &s : {Shape{4, 4096, 2}, Shape{1, 32768, 2}}) {
    const int bvb = bwd_choose_bv(s);
    std::vector<Launch> ks = {prep(s, true), seq(s, true, bvb), seq(s, false, bvb), grad(s, false), grad(s, true)};
    printf("\nCo-residency at %dx%d n=%d (blocks of the column kernel that fit beside k blocks of the row kernel, "
           "k = 1 .. its own blocks/SM):\n\n| beside \\ of |",
           s.B, s.T, s.n);
    for (const Launch &b : ks) printf(" %s |", b.what.c_str());
    printf("\n|---|");
    for (size_t i = 0; i < ks.size(); i++) printf("---|");
    printf("\n");
    for (const Launch &a : ks) {
      printf("| %s (%d/SM) |", a.what.c_str(), a.bps);
      for (const Launch &b : ks) {
        std::string cell;
        for (int k = 1; k <= a.bps; k++) cell += (k > 1 ? "/" : "") + std::to_string(beside(a, k, b));
        printf(" %s |", cell.c_str());
      }
      printf("\n");
    }
    /* the overlap plan's variants of the two sequential kernels (registers as now) */
    printf("\nVariants of the sequential kernels at %dx%d n=%d (registers as now; not in the kernels):\n\n"
           "| kernel, bv | stages | staging | dyn. smem | blocks/SM | beside 1: prep | grad_state | grad_wy | "
           "beside 1 of the other pass (same variant) |\n|---|---|---|---|---|---|---|---|---|\n",
           s.B, s.T, s.n);
    for (int bv : {bvb, 32}) {
      const SizeRow zz = sizes(s.n, bv);
      for (int kind = 0; kind < 2; kind++)
        for (int st2 = 0; st2 < 2; st2++)
          for (int b16 = 0; b16 < 2; b16++) {
            Launch v = seq(s, kind == 0, bv);
            v.smem = kind == 0 ? zz.statesv[st2][b16] : zz.dstatev[st2][b16];
            v.bps = blocks_per_sm(v.threads, v.smem, v.r, &v.limit, &v.regs_per_warp);
            /* partner: the other pass as the same variant */
            Launch o = seq(s, kind != 0, bv);
            o.smem = kind != 0 ? zz.statesv[st2][b16] : zz.dstatev[st2][b16];
            o.bps = blocks_per_sm(o.threads, o.smem, o.r, &o.limit, &o.regs_per_warp);
            printf("| %s bv=%d (%d reg) | %d | %s | %d (%.1f KB) | %d | %d | %d | %d | %d |\n",
                   kind == 0 ? "states" : "dstate", bv, v.r.regs, st2 ? 2 : 3, b16 ? "bf16 only" : "f32 (now)", v.smem,
                   v.smem / 1024.0, v.bps, beside(v, 1, ks[0]), beside(v, 1, ks[3]), beside(v, 1, ks[4]),
                   beside(v, 1, o));
          }
    }
    /* mixed: the states pass as now beside a 2-stage dstate (f32 staging, as now otherwise) */
    {
      const SizeRow zz = sizes(s.n, bvb);
      Launch d = seq(s, false, bvb);
      d.smem = zz.dstatev[1][0];
      d.bps = blocks_per_sm(d.threads, d.smem, d.r, &d.limit, &d.regs_per_warp);
      const Launch st = seq(s, true, bvb);
      printf("\nstates as now (%d B) beside a 2-stage dstate (%d B, %d/SM alone): %d; (states + dstate) bytes with "
             "the 1 KB reserves: %d of %d\n",
             st.smem, d.smem, d.bps, beside(d, 1, st), footprint(st).smem + footprint(d).smem, 228 * 1024);
    }
  }
  /* E3 (GDP_CUDA_V3_OVERLAP, gdp_bwd_v3.cu): the instantiations the overlap launches --
   * dstate_kernel_v3<.., S16, NEW, STAGES = 2> (bf16-only staging) and
   * grad_state_kernel_v3<.., S16, PIPE, OVL> -- with their own registers, and the host's
   * default (overlap_wanted: one grad_state block fits beside one dstate block, at the bwd
   * bv, and the recompute's passes are not forked) */
  printf("\nE3 overlap (GDP_CUDA_V3_OVERLAP unset: on where 1 grad_state fits beside 1 dstate and no fork):\n\n"
         "| shape | bwd bv | dstate 2-stage bf16: smem, reg, blocks/SM | grad_state OVL: smem, reg, blocks/SM | "
         "grad_state beside 1 / all dstate blocks | smem of the pair with reserves | overlap (rec / saved) | "
         "rec fork |\n"
         "|---|---|---|---|---|---|---|---|\n");
  for (const Shape &s : shapes) {
    const int bvb = bwd_choose_bv(s), C = chunk_c(s.n), TC = chunk_tc(s.n);
    Launch d = seq(s, false, bvb);
    d.kernel = inst("dstate_kernel_v3", {K, V, C, TC, bvb, 1, 1, 2});
    d.mangled = mangle("v3b", "dstate_kernel_v3", {I(K), I(V), I(C), I(TC), I(bvb), B(true), B(true), I(2)});
    d.smem = sizes(s.n, bvb).dstatev[1][1];
    finish(d);
    Launch g = grad(s, false);
    g.kernel = inst("grad_state_kernel_v3", {K, V, C, TC, 1, 1, 1});
    g.mangled = mangle("v3b", "grad_state_kernel_v3", {I(K), I(V), I(C), I(TC), B(true), B(true), B(true)});
    finish(g);
    const int b1 = beside(d, 1, g), ball = beside(d, d.bps, g);
    /* fork_mode 2 (gdp_bwd_v3.cu): where the old fork rule says no, a states block beside a
     * 2-stage dstate block and at most one block per SM -> the recompute forks instead */
    const bool fork2 = !fork_wanted(s, bvb) && (long long)s.B * H * (V / bvb) <= kSms &&
                       beside(d, 1, seq(s, true, bvb)) >= 1;
    const bool on_saved = b1 >= 1, on_rec = on_saved && !fork_wanted(s, bvb) && !fork2;
    printf("| %dx%d n=%d | %d | %d (%.1f KB), %d, %d | %d (%.1f KB), %d, %d | %d / %d | %d of %d | %s / %s | %s |\n", s.B,
           s.T, s.n, bvb, d.smem, d.smem / 1024.0, d.r.regs, d.bps, g.smem, g.smem / 1024.0, g.r.regs, g.bps, b1, ball,
           footprint(d).smem + footprint(g).smem, 228 * 1024, on_rec ? "on" : "off", on_saved ? "on" : "off",
           fork_wanted(s, bvb) ? "FORK (today's kernels)" : fork2 ? "FORK (2-stage dstate)" : "no");
  }
  return 0;
}
