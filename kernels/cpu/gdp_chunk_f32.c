/*
 * gdp_chunk_f32.c -- the chunkwise GDP kernels in float32 (the body is written once,
 * in gdp_chunk_impl.h, for both precisions).
 */
#define CK_REAL float
#define CK_SFX f32
#define CK_GEMM cblas_sgemm
#define CK_SYRK cblas_ssyrk
#define CK_TRSM cblas_strsm
#define CK_EXP expf
#include "gdp_chunk_impl.h"
