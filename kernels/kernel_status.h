/*
 * kernel_status.h -- what a kernel may use of the core: recording an error message for
 * gdp_last_error(), propagating a status, internal assertions, and the core's debugging
 * switches.  Plain C, includable from C and CUDA C++ alike; the kernels include this and
 * never core/src/internal.h (which holds the core's object layouts).
 */
#ifndef GDP_KERNEL_STATUS_H
#define GDP_KERNEL_STATUS_H

#include "gdp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records a message for gdp_last_error() and returns `status`, so that callers write
 *   return GDP_ERROR(GDP_ERR_SHAPE, "q: expected 4 dims [B,T,H,K], got %d", nd);
 * The message becomes "<func>: <text> (<file>:<line>)".  `func` is the public entry
 * point the user called where that differs from __func__ (see GDP_ERROR_IN). */
gdp_status gdp_set_error(gdp_status status, const char *func, const char *file, int line,
                         const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

/* The core's debugging switches (core/src/debug.c, the one place that reads them from
 * the environment, once):
 *   GDP_SYNC_EVERY_OP=1  device ops synchronise after every call, so an asynchronous
 *                        device error surfaces at the op that caused it;
 *   GDP_CUDA_PROFILE=1   the CUDA operator synchronises between its kernels and prints
 *                        each kernel's time to stderr. */
int gdp_debug_sync_every_op(void);
int gdp_debug_profile_kernels(void);

#ifdef __cplusplus
}
#endif

#define GDP_ERROR(status, ...) gdp_set_error((status), __func__, __FILE__, __LINE__, __VA_ARGS__)
#define GDP_ERROR_IN(func, status, ...) gdp_set_error((status), (func), __FILE__, __LINE__, __VA_ARGS__)

/* Propagates a failing status (the callee already recorded the message). */
#define GDP_TRY(expr)                                \
  do {                                               \
    gdp_status gdp_try_s_ = (expr);                  \
    if (gdp_try_s_ != GDP_OK) return gdp_try_s_;     \
  } while (0)

/* Internal invariants: checked in debug and test builds only (NDEBUG off); a broken
 * invariant is a bug in gdp, never a user error. */
#ifndef NDEBUG
#include <stdio.h>
#include <stdlib.h>
#define GDP_ASSERT(cond)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      fprintf(stderr, "gdp internal assertion failed: %s (%s:%d)\n", #cond, __FILE__, \
              __LINE__);                                                              \
      abort();                                                                        \
    }                                                                                 \
  } while (0)
#else
#define GDP_ASSERT(cond) ((void)0)
#endif

#endif /* GDP_KERNEL_STATUS_H */
