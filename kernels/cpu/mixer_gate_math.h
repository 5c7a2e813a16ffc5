/*
 * mixer_gate_math.h -- the scalar gate functions that mixer_gates.c and
 * mixer_inputs.c share, written with REAL and FN (real_instances.h): included once per
 * instance inside a file's generic part, so it has no include guard.
 *
 * softplus follows torch (threshold 20): x for x > 20, else log1p(exp(x)), whose
 * derivative is 1 above the threshold and sigmoid(x) below.  Needs <tgmath.h>.
 */
#ifndef GDP_SOFTPLUS_THRESHOLD
#define GDP_SOFTPLUS_THRESHOLD 20
#endif

static inline REAL FN(sigmoid)(REAL x) { return (REAL)1 / ((REAL)1 + exp(-x)); }

static inline REAL FN(silu)(REAL x) { return x * FN(sigmoid)(x); }

static inline REAL FN(softplus)(REAL x) {
  return x > (REAL)GDP_SOFTPLUS_THRESHOLD ? x : log1p(exp(x));
}

/* d softplus / dx with the same threshold. */
static inline REAL FN(softplus_grad)(REAL x) {
  return x > (REAL)GDP_SOFTPLUS_THRESHOLD ? (REAL)1 : FN(sigmoid)(x);
}
