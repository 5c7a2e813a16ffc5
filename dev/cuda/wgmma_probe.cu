/*
 * wgmma_probe.cu -- checks the wgmma wrappers and the SW128 panel layout of
 * kernels/cuda/wgmma_sm90.cuh on the device, before any kernel relies on them.
 *
 *   wgmma_probe        one warpgroup per case: D = A B with A from registers (or shared
 *                      memory) and B read through a descriptor from a SW128 panel, against
 *                      the product on the CPU.  Inputs are multiples of 1/8 in [-2, 2], so
 *                      every float32 sum is exact and a correct case has error 0.  One case
 *                      is a planted mistake (LBO and SBO swapped) that must fail.
 * Exit status 0 when every case is as expected, 77 (ctest: skipped) without an sm_90
 * device.  Built by dev/CMakeLists.txt and run as the ctest dev.wgmma_probe (label cuda).
 * The wrappers live beside it: the library's kernels no longer use wgmma (measured slower
 * for the per-chunk gradients, docs/kernels.md section 7); they stay here for kernel work.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "gdp/fragments.cuh"
#include "wgmma_sm90.cuh"

using namespace gdpcu;

#define CK(expr)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (expr);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #expr); \
      exit(2);                                                                                     \
    }                                                                                              \
  } while (0)

enum Case { MN64 = 0, MN128, MN128_SWAPPED, K64, SS_MN64, NCASES };
static const char *kName[NCASES] = {
    "A regs, B MN-major SW128, m64n64k16 (K = 64)",
    "A regs, B MN-major SW128, m64n128k16 (LBO = column block)",
    "planted: as above with LBO and SBO swapped (must FAIL)",
    "A regs, B K-major SW128, m64n64k16 (K = 128, +32 B per k16)",
    "A smem K-major SW128, B MN-major SW128, m64n64k16 (K = 64)",
};
/* Problem per case: A is 64 x KD (row-major in global), B is KD x ND. */
__host__ __device__ static void dims(int cs, int &KD, int &ND) {
  KD = (cs == K64) ? 128 : 64;
  ND = (cs == MN128 || cs == MN128_SWAPPED) ? 128 : 64;
}

/* One block of 128 threads.  A (64 x KD) and B (KD x ND) in global, row-major; D out
 * (64 x ND, float). */
__global__ void probe(int cs, const bf16 *A, const bf16 *B, float *D) {
  extern __shared__ __align__(1024) unsigned char smem[];
  int KD, ND;
  dims(cs, KD, ND);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grp = lane >> 2, tig = lane & 3;
  const uint32_t s0 = smem_addr(smem);
  if (s0 & 1023) __trap();
  /* Panels: B at 0.  MN-major: B's rows are the panel's rows (KD rows, ND columns);
   * K-major: the panel holds B^T (ND rows, KD columns).  A (SS case) after B. */
  const bool kmaj = (cs == K64);
  const int PR = kmaj ? ND : KD, PC = kmaj ? KD : ND;
  for (int i = tid; i < PR * PC; i += 128) {
    const int r = i / PC, c = i % PC;
    const bf16 v = kmaj ? B[c * ND + r] : B[r * ND + c];
    uint32_t off;
    if (PR == 64) off = sw128_off<64>(r, c);
    else off = sw128_off<128>(r, c);
    *reinterpret_cast<bf16 *>(smem + off) = v;
  }
  const uint32_t oA = 64 * 128 * 2 * 2; /* after the largest B panel (128 x 128) */
  if (cs == SS_MN64)
    for (int i = tid; i < 64 * 64; i += 128)
      *reinterpret_cast<bf16 *>(smem + oA + sw128_off<64>(i / 64, i % 64)) = A[i];
  fence_proxy_async_smem();
  __syncthreads();

  float d[16][4] = {};
  float (&d8)[8][4] = *reinterpret_cast<float(*)[8][4]>(&d[0][0]);
  const int r0 = 16 * warp;
  wg_fence();
  for (int ks = 0; ks < KD / 16; ks++) {
    uint32_t a[4];
    {
      const int c0 = 16 * ks + 2 * tig;
      auto pk = [&](int r, int c) {
        __nv_bfloat162 v;
        v.x = A[r * KD + c];
        v.y = A[r * KD + c + 1];
        return *reinterpret_cast<uint32_t *>(&v);
      };
      a[0] = pk(r0 + grp, c0);
      a[1] = pk(r0 + grp + 8, c0);
      a[2] = pk(r0 + grp, c0 + 8);
      a[3] = pk(r0 + grp + 8, c0 + 8);
    }
    const int sd = ks > 0;
    switch (cs) {
      case MN64:
        wg_m64n64k16_rs<1>(d8, a, wg_desc_sw128(s0 + ks * 2048, 64 * 128, 1024), sd);
        break;
      case MN128:
        wg_m64n128k16_rs<1>(d, a, wg_desc_sw128(s0 + ks * 2048, KD * 128, 1024), sd);
        break;
      case MN128_SWAPPED:
        wg_m64n128k16_rs<1>(d, a, wg_desc_sw128(s0 + ks * 2048, 1024, KD * 128), sd);
        break;
      case K64:
        wg_m64n64k16_rs<0>(d8, a, wg_desc_sw128(s0 + (ks / 4) * ND * 128 + (ks % 4) * 32, 16, 1024), sd);
        break;
      case SS_MN64:
        wg_m64n64k16_ss<1>(d8, wg_desc_sw128(s0 + oA + ks * 32, 16, 1024),
                           wg_desc_sw128(s0 + ks * 2048, 64 * 128, 1024), sd);
        break;
    }
  }
  wg_commit();
  wg_wait<0>();
  for (int nt = 0; nt < ND / 8; nt++)
    for (int e = 0; e < 4; e++) {
      const int r = r0 + grp + 8 * (e >> 1), c = 8 * nt + 2 * tig + (e & 1);
      D[r * ND + c] = d[nt][e];
    }
}

int main() {
  int ndev = 0, dev = 0, major = 0, minor = 0;
  const cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0) { /* ctest: SKIP_RETURN_CODE 77 */
    printf("SKIP: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return 77;
  }
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9) {
    printf("SKIP: wgmma needs sm_90 (this device is sm_%d%d)\n", major, minor);
    return 77;
  }
  const int smem = 2 * 64 * 128 * 2 + 64 * 64 * 2;
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int bad = 0;
  srand(12345);
  for (int cs = 0; cs < NCASES; cs++) {
    int KD, ND;
    dims(cs, KD, ND);
    float *hA = (float *)malloc(sizeof(float) * 64 * KD), *hB = (float *)malloc(sizeof(float) * KD * ND);
    bf16 *bA = (bf16 *)malloc(2 * 64 * KD), *bB = (bf16 *)malloc(2 * KD * ND);
    for (int i = 0; i < 64 * KD; i++) hA[i] = (float)(rand() % 33 - 16) / 8.f, bA[i] = __float2bfloat16(hA[i]);
    for (int i = 0; i < KD * ND; i++) hB[i] = (float)(rand() % 33 - 16) / 8.f, bB[i] = __float2bfloat16(hB[i]);
    bf16 *dA, *dB;
    float *dD;
    CK(cudaMalloc(&dA, 2 * 64 * KD));
    CK(cudaMalloc(&dB, 2 * KD * ND));
    CK(cudaMalloc(&dD, 4 * 64 * ND));
    CK(cudaMemcpy(dA, bA, 2 * 64 * KD, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, bB, 2 * KD * ND, cudaMemcpyHostToDevice));
    CK(cudaMemset(dD, 0, 4 * 64 * ND));
    probe<<<1, 128, smem>>>(cs, dA, dB, dD);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    float *hD = (float *)malloc(4 * 64 * ND);
    CK(cudaMemcpy(hD, dD, 4 * 64 * ND, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int i = 0; i < 64; i++)
      for (int j = 0; j < ND; j++) {
        double s = 0;
        for (int k = 0; k < KD; k++) s += (double)hA[i * KD + k] * hB[k * ND + j];
        worst = fmax(worst, fabs(s - hD[i * ND + j]));
      }
    const bool planted = cs == MN128_SWAPPED, pass = worst == 0.0;
    const bool as_expected = planted ? !pass : pass;
    bad += !as_expected;
    printf("%-64s max |err| %-10.4g %s%s\n", kName[cs], worst, pass ? "PASS" : "FAIL",
           as_expected ? "" : "  <-- unexpected");
    free(hA), free(hB), free(bA), free(bB), free(hD);
    CK(cudaFree(dA));
    CK(cudaFree(dB));
    CK(cudaFree(dD));
  }
  printf("wgmma_probe: %s\n", bad ? "UNEXPECTED RESULTS" : "all cases as expected");
  return bad ? 1 : 0;
}
