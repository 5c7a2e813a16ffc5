/*
 * chunk_split_bf16.c -- lab: the CPU chunk kernels (kernels/cpu/gdp_chunk_impl.h) in
 * float32 with every matrix product done the way a float32 path on bf16 tensor cores
 * would do it: each operand split into bf16 hi + lo (lo = the bf16 rounding of what hi
 * leaves), three products (hi hi, hi lo, lo hi) accumulated in float32, lo lo dropped.
 * The triangular solves stay exact float32.  `bench_gdp_cpu --split-bf16` validates it
 * against the float64 oracle: does such a split meet float32's 1e-4 (issue 22's float32
 * chunked path; docs/kernels.md section 5)?
 */
#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Round to the nearest bf16, ties to even (finite inputs). */
static float bf16_round(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  float y;
  memcpy(&y, &u, sizeof y);
  return y;
}

static float *alloc_or_die(size_t count) {
  float *p = malloc(count * sizeof(float));
  if (!p) {
    fprintf(stderr, "chunk_split_bf16: out of memory for %zu floats\n", count);
    exit(1);
  }
  return p;
}

/* rows x cols of row-major a (leading dimension ld) as packed hi and lo parts. */
static void split(const float *a, int rows, int cols, int ld, float **hi, float **lo) {
  *hi = alloc_or_die((size_t)rows * cols + 1);
  *lo = alloc_or_die((size_t)rows * cols + 1);
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < cols; c++) {
      const float x = a[(size_t)r * ld + c], h = bf16_round(x);
      (*hi)[(size_t)r * cols + c] = h;
      (*lo)[(size_t)r * cols + c] = bf16_round(x - h);
    }
}

/* cblas_sgemm's contract (row-major, as the chunk kernels call it) with split products. */
void split_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
  const int ar = ta == CblasNoTrans ? M : K, ac = ta == CblasNoTrans ? K : M;
  const int br = tb == CblasNoTrans ? K : N, bc = tb == CblasNoTrans ? N : K;
  const int lda_split = ac > 0 ? ac : 1, ldb_split = bc > 0 ? bc : 1; /* the packed parts' */
  float *Ah, *Al, *Bh, *Bl;
  split(A, ar, ac, lda, &Ah, &Al);
  split(B, br, bc, ldb, &Bh, &Bl);
  cblas_sgemm(order, ta, tb, M, N, K, alpha, Ah, lda_split, Bh, ldb_split, beta, C, ldc);
  cblas_sgemm(order, ta, tb, M, N, K, alpha, Ah, lda_split, Bl, ldb_split, 1, C, ldc);
  cblas_sgemm(order, ta, tb, M, N, K, alpha, Al, lda_split, Bh, ldb_split, 1, C, ldc);
  free(Ah), free(Al), free(Bh), free(Bl);
}

/* cblas_ssyrk's contract (row-major, no transpose: C = alpha A A^T + beta C on the uplo
 * triangle only) with split products. */
void split_ssyrk(int order, int uplo, int trans, int N, int K, float alpha, const float *A, int lda, float beta,
                 float *C, int ldc) {
  if (order != CblasRowMajor || trans != CblasNoTrans) {
    fprintf(stderr, "split_ssyrk: only row-major, no transpose (what the chunk kernels call)\n");
    exit(1);
  }
  float *T = alloc_or_die((size_t)N * N + 1);
  split_sgemm(order, CblasNoTrans, CblasTrans, N, N, K, alpha, A, lda, A, lda, 0, T, N);
  for (int i = 0; i < N; i++)
    for (int j = 0; j < N; j++)
      if (uplo == CblasLower ? j <= i : j >= i) {
        float *c = &C[(size_t)i * ldc + j];
        *c = T[(size_t)i * N + j] + (beta == 0 ? 0 : beta * *c);
      }
  free(T);
}

#define CK_REAL float
#define CK_SFX f32split
#define CK_GEMM split_sgemm
#define CK_SYRK split_ssyrk
#define CK_TRSM cblas_strsm
#define CK_EXP expf
#include "cpu/gdp_chunk_impl.h"
