/*
 * dispatch.cu -- which CUDA path runs a GDP problem, and the library's entry points.
 *
 *   path       | takes                                  | algorithm
 *   -----------+----------------------------------------+------------------------------------
 *   fast       | bf16, n = 1..8, K <= 256, V <= 256     | AUTO, CHUNK (an error elsewhere)
 *   recurrent  | f32 and bf16, K <= 256, any V         | RECURRENT; AUTO where fast does not
 *
 * (The kernels' instances are K in {32, 64, 128} with V in {32, 64, 128} and n = 1..4,
 * and K = 256 with V = 128 and n = 2; other K and V run
 * zero-padded to the next of 32, 64, 128, 256, other n as tokens of fewer steps
 * (plan.cuh, token_split), V = 256 as two halves of 128: chunk_shapes.cu.)  The fast
 * path is chunked, with its chunk fixed by n and K (fast_chunk_steps, steps of the
 * expanded stream for n = 1..8: 32, 64, 48, 64, 40, 48, 56, 64 at K = 64, 128; the same
 * but 32 at n = 2 for K = 32; 16, 32, 24, 32, 20, 24, 28, 32 at K = 256); a
 * problem's chunk_size is 0 (the path's own)
 * or that C, anything else is an error that names the size.  The recurrent kernels have
 * no chunks: a nonzero chunk_size with them is an error too, also where AUTO falls back
 * to them (a chunk size asked for and silently not used would mislead a measurement).
 * Float32 problems always take the recurrent path (exact float32; the chunked kernels
 * are bf16 tensor-core kernels).  value_block (0, 16, 32, 64) forces the fast path's
 * value-block width; the recurrent kernels ignore it.
 */
#include "plan.cuh"

using namespace gdpcu;

namespace {

/* What the fast path takes (chunked::takes), for the messages that name it. */
#define GDP_FAST_SHAPES "bf16, n = 1..8, K <= 256, V <= 256"

/* The saved object's path code (op_gdp.c keeps it and hands it back to the backward). */
enum Path { PATH_RECURRENT = 1, PATH_FAST = 3 };

const char *path_name(int path) { return path == PATH_FAST ? "fast chunked" : "recurrent"; }

gdp_status check_chunk_size(const gdp_delta_product_problem *p, const char *what, int path) {
  if (p->chunk_size == 0) return GDP_OK;
  if (path == PATH_FAST) {
    const int C = fast_chunk_steps(p->n, p->K);
    if (p->chunk_size == C) return GDP_OK;
    return GDP_ERROR_IN(what, GDP_ERR_INVALID_ARG,
                        "chunk_size: the CUDA chunked path takes %d steps at n = %lld, K = %lld (or 0 for it), got %lld",
                        C, (long long)p->n, (long long)p->K, (long long)p->chunk_size);
  }
  return GDP_ERROR_IN(what, GDP_ERR_INVALID_ARG,
                      "chunk_size: this problem runs the CUDA recurrent kernels, which have no chunks "
                      "(the chunked path takes " GDP_FAST_SHAPES "); expected 0, got %lld",
                      (long long)p->chunk_size);
}

/* The path for a validated problem, or an error naming what does not fit. */
gdp_status choose_path(const gdp_delta_product_problem *p, const char *what, int *path) {
  *path = 0;
  const int vb = p->value_block;
  if (vb != 0 && vb != 16 && vb != 32 && vb != 64)
    return GDP_ERROR_IN(what, GDP_ERR_INVALID_ARG, "value_block: expected 0 (automatic), 16, 32 or 64, got %d", vb);
  const bool fast = chunked::takes(p);
  if (p->algorithm == GDP_ALGO_CHUNK && !fast)
    return GDP_ERROR_IN(what, GDP_ERR_UNSUPPORTED,
                        "algorithm chunk: the CUDA chunked path takes " GDP_FAST_SHAPES "; "
                        "got %s, n = %lld, K = %lld, V = %lld",
                        p->dtype == GDP_DTYPE_BF16 ? "bf16" : "float32", (long long)p->n, (long long)p->K,
                        (long long)p->V);
  const int chosen = p->algorithm == GDP_ALGO_RECURRENT || !fast ? PATH_RECURRENT : PATH_FAST;
  GDP_TRY(check_chunk_size(p, what, chosen));
  /* the value block tiles the V the kernels run (a padded V: its next instance width) */
  const int64_t kv = chunked::kernel_value_width(p);
  if (chosen == PATH_FAST && vb != 0 && kv % vb != 0)
    return GDP_ERROR_IN(what, GDP_ERR_INVALID_ARG, "value_block: %d does not divide V = %lld (run as %lld)", vb,
                        (long long)p->V, (long long)kv);
  *path = chosen;
  return GDP_OK;
}

}  // namespace

extern "C" gdp_status gdp_cuda_delta_product_forward(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                                           void *stream) {
  return gdp_cuda_delta_product_forward_ex(p, io, stream, nullptr);
}

extern "C" gdp_status gdp_cuda_delta_product_backward(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                                            void *stream) {
  GDP_TRY(validate_problem(p, "backward"));
  GDP_TRY(validate_bwd_io(p, io, "backward"));
  int path = 0;
  GDP_TRY(choose_path(p, "backward", &path));
  if (path == PATH_FAST) return chunked::backward(p, io, (cudaStream_t)stream, nullptr);
  return backward_recurrent(p, io, (cudaStream_t)stream);
}

extern "C" int gdp_cuda_delta_product_dh0_takes(const gdp_delta_product_problem *p) {
  /* choose_path's answer without its messages: the fast path, no rewrite, a chunk size
   * and value block it takes */
  const int vb = p->value_block;
  return gdp_cuda_delta_product_supported(p) && p->algorithm != GDP_ALGO_RECURRENT && chunked::takes_dh0(p) &&
         (p->chunk_size == 0 || p->chunk_size == fast_chunk_steps(p->n, p->K)) &&
         (vb == 0 || ((vb == 16 || vb == 32 || vb == 64) && p->V % vb == 0));
}

extern "C" gdp_status gdp_cuda_delta_product_backward_dh0(const gdp_delta_product_problem *p,
                                                          const gdp_delta_product_backward_io *io, void *stream) {
  GDP_TRY(validate_problem(p, "backward_dh0"));
  if (!io->d_o || !io->dh0 || !io->q || !io->k || !io->v || !io->beta)
    return GDP_ERROR_IN("backward_dh0", GDP_ERR_INVALID_ARG, "io: expected q, k, v, beta, d_o and dh0 buffers");
  int path = 0;
  GDP_TRY(choose_path(p, "backward_dh0", &path));
  if (path != PATH_FAST || !chunked::takes_dh0(p))
    return GDP_ERROR_IN("backward_dh0", GDP_ERR_UNSUPPORTED,
                        "dh0 alone runs on the fast path without shape rewrites only (bf16, n = 1..4, "
                        "K, V in {32, 64, 128}, or K = 256 with V = 128 and n = 2); got n = %lld, K = %lld, V = %lld",
                        (long long)p->n, (long long)p->K, (long long)p->V);
  return chunked::backward_dh0(p, io, (cudaStream_t)stream);
}

extern "C" gdp_status gdp_cuda_delta_product_save_plan(const gdp_delta_product_problem *p, int *variant, size_t *bytes) {
  *variant = 0;
  *bytes = 0;
  GDP_TRY(validate_problem(p, "save_plan"));
  int path = 0;
  GDP_TRY(choose_path(p, "save_plan", &path));
  *variant = path;
  /* only the fast path keeps anything: its backward's recompute is what saving removes */
  if (path == PATH_FAST) *bytes = chunked::saved_bytes(p);
  return GDP_OK;
}

extern "C" gdp_status gdp_cuda_delta_product_forward_ex(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io, void *stream,
                                              void *saved) {
  GDP_TRY(validate_problem(p, "forward"));
  GDP_TRY(validate_fwd_io(p, io, "forward"));
  int path = 0;
  GDP_TRY(choose_path(p, "forward", &path));
  if (path == PATH_FAST) return chunked::forward(p, io, (cudaStream_t)stream, saved);
  if (saved)
    return GDP_ERROR_IN("forward", GDP_ERR_INVALID_ARG,
                        "saved: the recurrent kernels keep nothing for the backward (gdp_cuda_delta_product_save_plan "
                        "gives 0 bytes), got a block");
  return forward_recurrent(p, io, (cudaStream_t)stream);
}

extern "C" gdp_status gdp_cuda_delta_product_backward_ex(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, void *stream,
                                               int saved_variant, const void *saved) {
  GDP_TRY(validate_problem(p, "backward"));
  GDP_TRY(validate_bwd_io(p, io, "backward"));
  int path = 0;
  GDP_TRY(choose_path(p, "backward", &path));
  if (saved_variant != path)
    return GDP_ERROR_IN("backward", GDP_ERR_INVALID_ARG,
                        "saved: the forward ran the %s path (code %d), this backward runs the %s path (%d)",
                        path_name(saved_variant), saved_variant, path_name(path), path);
  if (path == PATH_FAST) return chunked::backward(p, io, (cudaStream_t)stream, saved);
  if (saved)
    return GDP_ERROR_IN("backward", GDP_ERR_INVALID_ARG,
                        "saved: the recurrent kernels keep nothing for the backward, got a block");
  return backward_recurrent(p, io, (cudaStream_t)stream);
}

extern "C" const char *gdp_cuda_delta_product_path(const gdp_delta_product_problem *p) {
  if (!gdp_cuda_delta_product_supported(p)) return nullptr;
  const bool fast = chunked::takes(p);
  if (p->algorithm == GDP_ALGO_CHUNK && !fast) return nullptr;
  return p->algorithm == GDP_ALGO_RECURRENT || !fast ? path_name(PATH_RECURRENT) : path_name(PATH_FAST);
}

extern "C" int gdp_cuda_delta_product_supported(const gdp_delta_product_problem *p) {
  if (!p) return 0;
  if (p->dtype != GDP_DTYPE_F32 && p->dtype != GDP_DTYPE_BF16) return 0;
  if (p->H < 1 || p->H > 65535 || p->K < 1 || p->K > 256 || p->V < 1 || p->n < 1) return 0;
  return 1;
}
