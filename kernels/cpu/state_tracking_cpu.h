/*
 * state_tracking_cpu.h -- the cpu kernel of the state-tracking tasks (gdp.h,
 * gdp_data_state_tracking; the stream and the scan: ../state_tracking.h).
 */
#ifndef GDP_KERNELS_CPU_STATE_TRACKING_H
#define GDP_KERNELS_CPU_STATE_TRACKING_H

#include <stdint.h>

#include "../state_tracking.h"

/* tokens and labels: [batch, length] contiguous int32 host buffers. */
void gdp_cpu_state_tracking(const gdp_state_tracking_problem *p, int32_t *tokens,
                            int32_t *labels);

#endif /* GDP_KERNELS_CPU_STATE_TRACKING_H */
