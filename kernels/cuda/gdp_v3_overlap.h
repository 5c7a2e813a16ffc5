/*
 * gdp_v3_overlap.h -- host-only rules of variant 3's E3 overlap (gdp_bwd_v3.cu,
 * GDP_CUDA_V3_OVERLAP; kernels/cuda/NOTES.md, "dstate -> grad_state overlap"): grad_state's
 * block order and whether one grad_state block fits on an SM beside one dstate block.
 * Plain C++ without CUDA, so that the rules are tested on the CPU.
 */
#ifndef GDP_KERNELS_CUDA_V3_OVERLAP_H
#define GDP_KERNELS_CUDA_V3_OVERLAP_H

#include <stdint.h>

#include <algorithm>
#include <vector>

namespace gdpcu {
namespace v3ovl {

/* grad_state's chunk order under the overlap: dstate walks every sequence backwards in
 * time, all sequences at once, so the chunks become ready by their position from the
 * sequence's end; the order is that position, then the sequence (heads are the grid's
 * fastest index).  Chunks are numbered as plan_make numbers them (sequence by sequence,
 * TC tokens each, the last one shorter); CI is the plan's ChunkInfo {seq, t0, ntok, pad},
 * pad = the chunk's index.  Returns false (and leaves `out` empty) where a sequence has
 * no token: its dstate blocks would signal nothing (see the caller). */
template <class CI>
bool reverse_chunk_order(int64_t N, const int64_t *cu_seqlens, int TC, std::vector<CI> *out) {
  out->clear();
  std::vector<int> first((size_t)N), count((size_t)N);
  int total = 0, longest = 0;
  for (int64_t s = 0; s < N; s++) {
    const int64_t len = cu_seqlens[s + 1] - cu_seqlens[s];
    if (len <= 0) return false;
    first[s] = total;
    count[s] = (int)((len + TC - 1) / TC);
    total += count[s];
    longest = std::max(longest, count[s]);
  }
  out->reserve((size_t)total);
  for (int back = 0; back < longest; back++)
    for (int64_t s = 0; s < N; s++) {
      if (back >= count[s]) continue;
      const int j = count[s] - 1 - back; /* position in the sequence */
      const int64_t t0 = cu_seqlens[s] + (int64_t)j * TC;
      out->push_back(CI{(int)s, (int)t0, (int)std::min<int64_t>(TC, cu_seqlens[s + 1] - t0), first[s] + j});
    }
  return true;
}

/* What one block holds on an SM, as CUDA's occupancy calculator counts it: shared memory
 * (dynamic + static + the per-block reserve, in 128-byte units), warps, registers per warp
 * (allocated per warp in units of 256). */
struct Footprint {
  int smem, warps, regs_per_warp;
};
inline Footprint footprint(int dyn_smem, int static_smem, int reserved_smem, int threads, int regs_per_thread) {
  return {(dyn_smem + static_smem + reserved_smem + 127) / 128 * 128, (threads + 31) / 32,
          (regs_per_thread * 32 + 255) / 256 * 256};
}

/* SM limits: shared memory at the largest carveout, registers (split over 4 sub-partitions;
 * a block's warps go round-robin over them), warps, blocks. */
struct SmLimits {
  int smem, regs, warps, blocks;
};

/* Whether one block of a and one of b are resident on an SM together (both kernels at the
 * max-shared carveout).  Registers: the 4 sub-partitions separately, each block's warps
 * placed round-robin from the sub-partition with the most free registers (the hardware's
 * placement is not documented; kernels/bench/v3_occupancy.cu's model). */
inline bool pair_fits(const Footprint &a, const Footprint &b, const SmLimits &sm) {
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

}  // namespace v3ovl
}  // namespace gdpcu

#endif /* GDP_KERNELS_CUDA_V3_OVERLAP_H */
