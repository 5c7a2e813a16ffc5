/*
 * gdp_chunk_f64.c -- the chunkwise GDP kernels in float64 (the body is written once,
 * in gdp_chunk_impl.h, for both precisions).
 */
#define CK_REAL double
#define CK_SFX f64
#define CK_GEMM cblas_dgemm
#define CK_SYRK cblas_dsyrk
#define CK_TRSM cblas_dtrsm
#define CK_EXP exp
#include "gdp_chunk_impl.h"
