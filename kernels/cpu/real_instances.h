/*
 * real_instances.h -- compiles a generic kernel file twice, for double (names with
 * _f64) and float (_f32).  The file defines its guard, names itself and includes this:
 *
 *   #ifndef GDP_SWIGLU_GENERIC
 *   ...includes, shared helpers...
 *   #define GDP_SWIGLU_GENERIC
 *   #define GDP_REAL_FILE "swiglu.c"
 *   #include "real_instances.h"
 *   #else
 *   ...code written with REAL and FN(name)...
 *   #endif
 */
#define REAL double
#define FN(name) name##_f64
#include GDP_REAL_FILE
#undef REAL
#undef FN
#define REAL float
#define FN(name) name##_f32
#include GDP_REAL_FILE
#undef REAL
#undef FN
#undef GDP_REAL_FILE
