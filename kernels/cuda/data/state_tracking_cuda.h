/*
 * state_tracking_cuda.h -- C-callable launcher of the state-tracking tasks on cuda
 * (gdp.h, gdp_data_state_tracking; the stream and the scan: ../../state_tracking.h).
 * Plain C, included by core/src/backend_cuda.c.
 */
#ifndef GDP_KERNELS_CUDA_STATE_TRACKING_H
#define GDP_KERNELS_CUDA_STATE_TRACKING_H

#include <stdint.h>

#include "gdp.h"
#include "../../state_tracking.h"

#ifdef __cplusplus
extern "C" {
#endif

/* p->mul is NOT read (a host array): mul_dev is the same n*n table on the device, or
 * NULL for a cyclic group.  tokens, labels: [batch, length] int32 on the device.
 * Queued on `stream`; returns launch errors (GDP_ERR_CUDA, message set). */
gdp_status gdp_cuda_state_tracking(const gdp_state_tracking_problem *p, const uint8_t *mul_dev,
                                   int32_t *tokens, int32_t *labels, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* GDP_KERNELS_CUDA_STATE_TRACKING_H */
