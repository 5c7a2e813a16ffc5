/*
 * optim_cuda.h -- C-callable launcher of the CUDA fused optimiser updates (AdamW, SGD
 * with momentum), with the semantics of ../../optim_problem.h and the CPU kernel
 * (kernels/cpu/optim.c).  Plain C, included by core/src/backend_cuda.c.
 *
 * Every arithmetic operation is rounded on its own (no fused multiply-add; sqrt and
 * division correctly rounded), in the order of the CPU kernel, which is compiled
 * without contraction: the two devices give the same bits.
 *
 * Queued on `stream` (a cudaStream_t); returns launch errors (GDP_ERR_CUDA, message
 * set) and GDP_ERR_UNSUPPORTED for a dtype combination the op layer does not produce.
 */
#ifndef GDP_KERNELS_CUDA_OPTIM_H
#define GDP_KERNELS_CUDA_OPTIM_H

#include "gdp.h"
#include "../../optim_problem.h"

#ifdef __cplusplus
extern "C" {
#endif

gdp_status gdp_cuda_optim_update(const gdp_optim_update *u, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* GDP_KERNELS_CUDA_OPTIM_H */
