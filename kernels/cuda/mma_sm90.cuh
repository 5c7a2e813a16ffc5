/*
 * mma_sm90.cuh -- the PTX wrappers of the tensor-core kernels (gdp_fwd_v3.cu,
 * gdp_bwd_v3.cu): ldmatrix, mma.sync m16n8k16 bf16 -> f32, bf16x2 packing.  Each
 * comment gives the fragment layout the kernels' index algebra relies on.
 */
#ifndef GDP_KERNELS_CUDA_MMA_SM90_CUH
#define GDP_KERNELS_CUDA_MMA_SM90_CUH

#include <cuda_bf16.h>
#include <stdint.h>

namespace gdpcu {

/* Four 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.  Thread t
 * receives, of matrix i, row t/4 columns 2(t%4), 2(t%4)+1 (register i). */
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                        uint32_t &r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
/* Same, transposed: thread t receives rows 2(t%4), 2(t%4)+1 of column t/4. */
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                          uint32_t &r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
/* d += A (16x16, row) * B (16x8, col), bf16 in, float32 accumulate. */
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* Two floats -> bf16x2, the first in the low half (the lower column index). */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t v) {
  __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162 *>(&v);
  return __bfloat1622float2(b);
}
/* One row of a warp's 16 x 8NT accumulator tile, as bf16, to memory, 8 bytes a lane
 * (st_row_pairs; st_pair_x8 stores one pair of 8-column blocks): w[nt] is this lane's
 * packed pair (columns 8 nt + 2 tig, + 1).  Lanes tig and tig ^ 1 swap one word
 * per pair of 8-column blocks, so that the even lane holds four consecutive columns of block
 * p and the odd lane four of block p + 1: the row's 32 bytes in one store instruction (whole
 * 32-byte sectors) instead of 16 bytes in each of two, half the store instructions.  Every
 * lane of the warp (of `lanes`) must call it (the shuffles); `ok` predicates the stores only.  row:
 * column 0 of the tile in this lane's row, 8-byte aligned. */
__device__ __forceinline__ void st_pair_x8(__nv_bfloat16 *row, int p, uint32_t wp, uint32_t wq, int tig, bool ok,
                                           unsigned lanes = 0xffffffffu) {
  /* blocks p and p + 1 (p even): wp, wq this lane's words of the two; lanes: the lanes that
   * call it (a lane's partner tig ^ 1 is in its row, so in or out with it) */
  const bool odd = tig & 1;
  const uint32_t got = __shfl_xor_sync(lanes, odd ? wp : wq, 1);
  if (ok)
    *reinterpret_cast<uint2 *>(row + p * 8 + (odd ? 8 + 2 * (tig - 1) : 2 * tig)) =
        odd ? make_uint2(got, wq) : make_uint2(wp, got);
}
template <int NT>
__device__ __forceinline__ void st_row_pairs(__nv_bfloat16 *row, const uint32_t (&w)[NT], int tig, bool ok) {
  static_assert(NT % 2 == 0, "pairs of 8-column blocks");
#pragma unroll
  for (int p = 0; p < NT; p += 2) st_pair_x8(row, p, w[p], w[p + 1], tig, ok);
}

}  // namespace gdpcu

#endif
