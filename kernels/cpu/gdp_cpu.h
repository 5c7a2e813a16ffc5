/*
 * gdp_cpu.h -- CPU kernels of the GDP operator (see ../gdp_problem.h for layouts).
 *
 *   gdp_cpu_delta_product_*_recurrent_f64: the plain token-by-token float64 recurrence with its
 *     hand-written backward (docs/design.md section 2).  The oracle: kept simple on purpose.
 *   gdp_cpu_delta_product_*_chunk_{f64,f32}: the chunkwise WY algorithm over the expanded stream,
 *     OpenBLAS for the dense products, (sequence, head) pairs spread over threads.
 *
 * All return GDP_OK or GDP_ERR_OOM (with the message set).
 */
#ifndef GDP_KERNELS_CPU_GDP_H
#define GDP_KERNELS_CPU_GDP_H

#include "gdp.h"
#include "../gdp_problem.h"

/* The chunk of the chunkwise kernels when the problem's chunk_size is 0 (the backend's
 * own): 64 steps of the expanded stream. */
#define GDP_DEFAULT_CHUNK 64

gdp_status gdp_cpu_delta_product_forward_recurrent_f64(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io);
gdp_status gdp_cpu_delta_product_backward_recurrent_f64(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io);

gdp_status gdp_cpu_delta_product_forward_chunk_f64(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io);
gdp_status gdp_cpu_delta_product_backward_chunk_f64(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io);
gdp_status gdp_cpu_delta_product_forward_chunk_f32(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io);
gdp_status gdp_cpu_delta_product_backward_chunk_f32(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io);

/* Row-wise L2 normalisation y = x / sqrt(sum x^2 + eps) over `dim` contiguous values
 * per row, and its backward dx = r (dy - y (y . dy)).  x and y may alias in forward.
 * num_threads: the context's worker threads (< 1: one). */
void gdp_cpu_l2norm_fwd_f64(int64_t rows, int64_t dim, double eps, const double *x, double *y,
                            int num_threads);
void gdp_cpu_l2norm_fwd_f32(int64_t rows, int64_t dim, double eps, const float *x, float *y,
                            int num_threads);
void gdp_cpu_l2norm_bwd_f64(int64_t rows, int64_t dim, double eps, const double *x,
                            const double *dy, double *dx, int num_threads);
void gdp_cpu_l2norm_bwd_f32(int64_t rows, int64_t dim, double eps, const float *x,
                            const float *dy, float *dx, int num_threads);

#endif /* GDP_KERNELS_CPU_GDP_H */
