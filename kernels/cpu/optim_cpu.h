/*
 * optim_cpu.h -- the CPU kernel of the fused optimiser updates (AdamW, SGD with
 * momentum): one elementwise pass over a parameter, its gradient and its optimiser
 * state, as ../optim_problem.h defines it.  The op layer (core/src/op_optim.c) has
 * checked the buffers, the dtypes and the hyperparameters.
 */
#ifndef GDP_KERNELS_CPU_OPTIM_H
#define GDP_KERNELS_CPU_OPTIM_H

#include "gdp.h"
#include "../optim_problem.h"

/* Elementwise, so the result does not depend on the thread count.  Cannot fail. */
void gdp_cpu_optim_update(const gdp_optim_update *u);

#endif /* GDP_KERNELS_CPU_OPTIM_H */
