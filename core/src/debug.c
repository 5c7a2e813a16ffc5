/*
 * debug.c -- the core's debugging switches, the one place that reads them from the
 * environment (kernels/kernel_status.h lists them).  Each is read once per process.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int env_flag(const char *name) {
  const char *v = getenv(name);
  return v && v[0] && strcmp(v, "0") != 0;
}

static int read_once(atomic_int *cache, const char *name) {
  int m = atomic_load_explicit(cache, memory_order_relaxed);
  if (m < 0) {
    m = env_flag(name);
    atomic_store_explicit(cache, m, memory_order_relaxed);
  }
  return m;
}

int gdp_debug_sync_every_op(void) {
  static atomic_int mode = -1;
  return read_once(&mode, "GDP_SYNC_EVERY_OP");
}

int gdp_debug_profile_kernels(void) {
  static atomic_int mode = -1;
  return read_once(&mode, "GDP_CUDA_PROFILE");
}
