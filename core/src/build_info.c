/*
 * build_info.c -- gdp_build_info(): the facts CMake compiled in, plus what the
 * linked OpenBLAS and the machine report at run time.  Recorded in every
 * experiment's meta.json.
 */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include <cblas.h>

#include "internal.h"

#ifndef GDP_VERSION_STRING
#define GDP_VERSION_STRING "unknown"
#endif
#ifndef GDP_BUILD_TYPE
#define GDP_BUILD_TYPE "unknown"
#endif
#ifndef GDP_C_COMPILER
#define GDP_C_COMPILER "unknown"
#endif
#ifndef GDP_BLAS_NAME
#define GDP_BLAS_NAME "unknown"
#endif
#ifndef GDP_CUDA_ARCHS
#define GDP_CUDA_ARCHS ""
#endif
#ifndef GDP_SANITIZE_ON
#define GDP_SANITIZE_ON 0
#endif

#ifdef GDP_HAVE_CUDA
#define GDP_INFO_CUDA "yes (archs " GDP_CUDA_ARCHS ")"
#else
#define GDP_INFO_CUDA "no"
#endif
#ifdef GDP_HAVE_NCCL
#define GDP_INFO_NCCL "yes"
#else
#define GDP_INFO_NCCL "no"
#endif
#ifdef GDP_HAVE_MPI
#define GDP_INFO_MPI "yes"
#else
#define GDP_INFO_MPI "no"
#endif

static char info[2048];
static pthread_once_t info_once = PTHREAD_ONCE_INIT;

static void build_info_init(void) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const char *blas_config = openblas_get_config();
  snprintf(info, sizeof info,
           "version: %s\n"
           "abi: %d\n"
           "build_type: %s\n"
           "compiler: %s\n"
           "blas: %s\n"
           "blas_config: %s\n"
           "cuda: %s\n"
           "nccl: %s\n"
           "mpi: %s\n"
           "sanitize: %s\n"
           "cpu_cores: %ld\n",
           GDP_VERSION_STRING, gdp_abi_version(), GDP_BUILD_TYPE, GDP_C_COMPILER, GDP_BLAS_NAME,
           blas_config ? blas_config : "unknown", GDP_INFO_CUDA, GDP_INFO_NCCL, GDP_INFO_MPI,
           GDP_SANITIZE_ON ? "yes" : "no", cores);
}

const char *gdp_build_info(void) {
  pthread_once(&info_once, build_info_init);
  return info;
}
