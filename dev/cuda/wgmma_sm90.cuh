/*
 * wgmma_sm90.cuh -- warpgroup MMA (sm_90a) for the kernel lab: shared-memory matrix
 * descriptors for 128-byte-swizzled bf16 panels, and m64nNk16 bf16 -> f32 with A from
 * registers and B from shared memory.  The library does not use it: wgmma for
 * grad_wy's 64-row products was correct but slower (docs/kernels.md §7).
 *
 * The layout (a "SW128 panel"): a bf16 matrix of R rows and 64 c
 * columns is stored as c column blocks of 64 (one 128-byte line per row), block b at
 * b * R * 128 bytes, row r of a block at r * 128 bytes, and its eight 16-byte chunks
 * permuted by the row: chunk j sits at position j ^ (r & 7).  Each 16-byte chunk stays
 * contiguous, so ldmatrix reads it with per-lane addresses from sw128_off; rows 8 apart
 * repeat the pattern, so a panel must start on a 1024-byte boundary (then the
 * descriptor's base offset is 0).
 *
 * As wgmma's B operand (K x N) such a panel is read two ways:
 *   MN-major (the panel's rows are B's k index, its columns B's n: B = P[k0.., n0..]):
 *     8 k-rows of 128 bytes form one 1 KB swizzle atom; the stride dimension byte
 *     offset (SBO) is the next 8 rows (1024 bytes), the leading one (LBO) the next 64
 *     columns (the column block, R * 128 bytes); a k16 step starts 16 rows (2 KB) on.
 *     (PTX ISA, "Leading / Stride dimension byte offset", MN-major swizzled.)
 *   K-major (the panel's rows are B's n index, its columns B's k: B = P[n0.., k0..]^T):
 *     SBO = 1024 (the next 8 n-rows), LBO unused; a k16 step inside a column block
 *     starts 32 bytes on (the hardware applies the swizzle to the computed address).
 * dev/cuda/wgmma_probe.cu checks both against a CPU product on the device (exact on the
 * H200).
 *
 * Register fragments (PTX ISA, "wgmma .m64nNk16 register fragments"): warp w of the
 * warpgroup holds A's rows 16 w .. 16 w + 15 as mma.m16n8k16's A fragment, and D's same
 * rows as N / 8 of mma.m16n8k16's C fragments side by side: d[nt][e] is row
 * 16 w + grp + 8 (e / 2), column 8 nt + 2 tig + (e & 1) -- the layout the mma.sync
 * epilogues already index.
 */
#ifndef GDP_DEV_CUDA_WGMMA_SM90_CUH
#define GDP_DEV_CUDA_WGMMA_SM90_CUH

#include <stdint.h>

namespace gdpcu {

/* Byte offset of element (r, c) in a SW128 panel of R rows (see above). */
template <int R>
__host__ __device__ __forceinline__ constexpr uint32_t sw128_off(int r, int c) {
  return (uint32_t)((c >> 6) * R * 128 + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) + (c & 7) * 2);
}

/* Descriptor of a 128-byte-swizzled operand at shared address addr (1024-aligned, or a
 * k step inside an aligned atom), leading / stride byte offsets lbo, sbo. */
__device__ __forceinline__ uint64_t wg_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async
 * proxy that wgmma reads B through: each writing thread, before the barrier. */
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* An empty asm that reads and writes every accumulator register: the compiler cannot move
 * the accumulator's other uses across it (wgmma's results appear only at wg_wait, which the
 * compiler does not know). */
__device__ __forceinline__ void wg_fence_acc(float (&d)[8][4]) {
#pragma unroll
  for (int i = 0; i < 8; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[i][e])::"memory");
}

#define GDP_WG_D8(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])

/* d (64 x 64 over the warpgroup; this warp's 16 rows) += A (64 x 16, registers) B (16 x 64,
 * descriptor); TB = 1: B MN-major, 0: K-major; SD = 0 overwrites d instead. */
template <int TB>
__device__ __forceinline__ void wg_m64n64k16_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db, int sd = 1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
      "{%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
      : GDP_WG_D8(0), GDP_WG_D8(1), GDP_WG_D8(2), GDP_WG_D8(3), GDP_WG_D8(4), GDP_WG_D8(5), GDP_WG_D8(6),
        GDP_WG_D8(7)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(sd), "n"(TB));
}

/* The same at N = 128 (d: 16 n8 tiles). */
template <int TB>
__device__ __forceinline__ void wg_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db,
                                                 int sd = 1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
      "{%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
      : GDP_WG_D8(0), GDP_WG_D8(1), GDP_WG_D8(2), GDP_WG_D8(3), GDP_WG_D8(4), GDP_WG_D8(5), GDP_WG_D8(6),
        GDP_WG_D8(7), GDP_WG_D8(8), GDP_WG_D8(9), GDP_WG_D8(10), GDP_WG_D8(11), GDP_WG_D8(12), GDP_WG_D8(13),
        GDP_WG_D8(14), GDP_WG_D8(15)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(sd), "n"(TB));
}

/* A from shared memory too (descriptor da, K-major: A's rows are M, its columns K). */
template <int TB>
__device__ __forceinline__ void wg_m64n64k16_ss(float (&d)[8][4], uint64_t da, uint64_t db, int sd = 1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
      "%32, %33, p, 1, 1, 0, %35;\n}\n"
      : GDP_WG_D8(0), GDP_WG_D8(1), GDP_WG_D8(2), GDP_WG_D8(3), GDP_WG_D8(4), GDP_WG_D8(5), GDP_WG_D8(6),
        GDP_WG_D8(7)
      : "l"(da), "l"(db), "r"(sd), "n"(TB));
}
#undef GDP_WG_D8

}  // namespace gdpcu

#endif
