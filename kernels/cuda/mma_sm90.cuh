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

}  // namespace gdpcu

#endif
