/*
 * optim_problem.h -- one fused optimiser update as the kernels see it: the element
 * count, the dtypes, raw pointers to contiguous buffers of n elements and the
 * hyperparameters, already folded into the scalars the update uses.  Shared by the op
 * layer (core/src/op_optim.c), the backend table and the kernels of every device.
 *
 * Buffers: param (the model's tensor: f64, f32 or bf16), grad (f64, f32 or bf16),
 * master (float32 master weights of a bf16 param, else NULL: the update then reads and
 * writes param itself), state0 / state1 (see the kinds).  The state dtype S is float64
 * for f64 params and float32 otherwise; every update computes in S, reads grad widened
 * to S and, with a master, writes param = master rounded once to bf16.
 *
 * AdamW (decoupled weight decay, bias-corrected; torch.optim.AdamW's update), with
 * p the master (or param), m = state0 (exp_avg), v = state1 (exp_avg_sq):
 *   p = p * decay                         decay = 1 - lr * weight_decay
 *   m = beta1 * m + (1 - beta1) * g
 *   v = beta2 * v + (1 - beta2) * g * g
 *   p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps)
 *                                         step_size = lr / (1 - beta1^t),
 *                                         bc2_sqrt = sqrt(1 - beta2^t), t = step
 * SGD (torch.optim.SGD: L2 weight decay added to the gradient), buf = state0 (NULL
 * when momentum is 0), state1 unused:
 *   d = g + weight_decay * p
 *   buf = d (first step), else momentum * buf + (1 - dampening) * d
 *   d = d + momentum * buf (nesterov), else buf
 *   p = p - lr * d
 * Every scalar is computed in double by the op layer and rounded once to S by the
 * kernel, so that every device applies the same numbers.
 */
#ifndef GDP_KERNELS_OPTIM_PROBLEM_H
#define GDP_KERNELS_OPTIM_PROBLEM_H

#include <stdint.h>

typedef enum gdp_optim_kind { GDP_OPTIM_ADAMW = 0, GDP_OPTIM_SGD = 1 } gdp_optim_kind;

typedef struct gdp_optim_update {
  int kind;            /* gdp_optim_kind */
  int64_t n;           /* elements of every buffer */
  int param_dtype;     /* gdp_dtype */
  int grad_dtype;
  int state_dtype;     /* f64 or f32: master, state0, state1 */
  void *param;
  const void *grad;
  void *master;        /* NULL: update param in place (then param_dtype == state_dtype) */
  void *state0;        /* AdamW exp_avg; SGD momentum buffer (NULL without momentum) */
  void *state1;        /* AdamW exp_avg_sq */
  double lr;
  double weight_decay;
  /* AdamW */
  double beta1, beta2, eps;
  double decay;        /* 1 - lr * weight_decay */
  double step_size;    /* lr / (1 - beta1^step) */
  double bc2_sqrt;     /* sqrt(1 - beta2^step) */
  /* SGD */
  double momentum, dampening;
  int nesterov;
  int first;           /* 1 on the first step: buf = d */
  int num_threads;     /* CPU worker threads */
} gdp_optim_update;

#endif /* GDP_KERNELS_OPTIM_PROBLEM_H */
