/*
 * embedding.cu -- the embedding gather and its deterministic backward on cuda, with the
 * semantics of kernels/cpu/embedding.c.
 *
 * The backward never lets two threads add into one element: the op layer buckets the
 * token positions by vocabulary row (a stable sort on the host), each bucket is cut
 * into segments of at most GDP_CUDA_EMBED_SEGMENT tokens; pass 1 gives each segment a
 * block that sums its d_out rows, column by column in token order, into the workspace;
 * pass 2 gives each vocabulary row a block that adds its segments in order (rows
 * without tokens get zeros).  Sums are in the math type (float32 for f32 and bf16,
 * float64 for f64), and the result is stored in it.
 */
#include "../mixer/common.cuh"
#include "nn_cuda.h"

namespace gdp_mixer {
namespace {

enum { EMBED_THREADS = 128, EMBED_MAX_BLOCKS = 65535 };

template <typename IO>
__global__ void embedding_fwd_kernel(int64_t n, int64_t D, const int64_t *tokens,
                                     const IO *weight, IO *out) {
  GDP_MIXER_FOR(i, n * D) {
    const int64_t r = i / D, j = i - r * D;
    out[i] = weight[tokens[r] * D + j];
  }
}

template <typename IO>
__global__ void embedding_segment_kernel(int64_t D, int64_t segments, const int64_t *row_start,
                                         const int64_t *row_tokens, const int64_t *seg_first,
                                         const int64_t *seg_row, const IO *d_out,
                                         typename Math<IO>::type *partial) {
  typedef typename Math<IO>::type A;
  for (int64_t g = blockIdx.x; g < segments; g += gridDim.x) {
    const int64_t v = seg_row[g];
    const int64_t k0 = row_start[v] + (g - seg_first[v]) * GDP_CUDA_EMBED_SEGMENT;
    const int64_t k1 = k0 + GDP_CUDA_EMBED_SEGMENT < row_start[v + 1] ? k0 + GDP_CUDA_EMBED_SEGMENT
                                                                      : row_start[v + 1];
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      A s = (A)0;
      for (int64_t k = k0; k < k1; k++) s += ld(d_out, row_tokens[k] * D + j);
      partial[g * D + j] = s;
    }
  }
}

template <typename A>
__global__ void embedding_row_kernel(int64_t V, int64_t D, const int64_t *seg_first,
                                     const A *partial, A *dweight) {
  for (int64_t v = blockIdx.x; v < V; v += gridDim.x) {
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      A s = (A)0;
      for (int64_t g = seg_first[v]; g < seg_first[v + 1]; g++) s += partial[g * D + j];
      dweight[v * D + j] = s;
    }
  }
}

static unsigned blocks_for(int64_t n) {
  if (n < 1) return 1;
  return (unsigned)(n < EMBED_MAX_BLOCKS ? n : EMBED_MAX_BLOCKS);
}

template <typename IO>
static gdp_status embedding_bwd(int64_t V, int64_t D, const int64_t *row_start,
                                const int64_t *row_tokens, const int64_t *seg_first,
                                const int64_t *seg_row, int64_t segments, const void *d_out,
                                void *dweight, void *workspace, cudaStream_t stream) {
  static const char *func = "gdp_cuda_embedding_bwd";
  typedef typename Math<IO>::type A;
  A *partial = (A *)workspace;
  if (segments > 0) {
    embedding_segment_kernel<IO><<<blocks_for(segments), EMBED_THREADS, 0, stream>>>(
        D, segments, row_start, row_tokens, seg_first, seg_row, (const IO *)d_out, partial);
    GDP_TRY(launched(func, "embedding_segment_kernel"));
  }
  embedding_row_kernel<A><<<blocks_for(V), EMBED_THREADS, 0, stream>>>(V, D, seg_first, partial,
                                                                       (A *)dweight);
  return launched(func, "embedding_row_kernel");
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

extern "C" gdp_status gdp_cuda_embedding_fwd(int dtype, int64_t n, int64_t D,
                                             const int64_t *tokens, const void *weight,
                                             void *out, void *stream) {
  static const char *func = "gdp_cuda_embedding_fwd";
  if (n == 0 || D == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     embedding_fwd_kernel<IO><<<grid_for(n * D), THREADS, 0, (cudaStream_t)stream>>>(
                         n, D, tokens, (const IO *)weight, (IO *)out));
  return launched(func, "embedding_fwd_kernel");
}

extern "C" int64_t gdp_cuda_embedding_segment_count(int64_t V, const int64_t *row_start) {
  int64_t total = 0;
  for (int64_t v = 0; v < V; v++) {
    const int64_t c = row_start[v + 1] - row_start[v];
    total += (c + GDP_CUDA_EMBED_SEGMENT - 1) / GDP_CUDA_EMBED_SEGMENT;
  }
  return total;
}

extern "C" void gdp_cuda_embedding_segments(int64_t V, const int64_t *row_start,
                                            int64_t *seg_first, int64_t *seg_row) {
  int64_t g = 0;
  for (int64_t v = 0; v < V; v++) {
    seg_first[v] = g;
    const int64_t c = row_start[v + 1] - row_start[v];
    for (int64_t s = 0; s < (c + GDP_CUDA_EMBED_SEGMENT - 1) / GDP_CUDA_EMBED_SEGMENT; s++)
      seg_row[g++] = v;
  }
  seg_first[V] = g;
}

extern "C" size_t gdp_cuda_embedding_bwd_workspace(int dtype, int64_t segments, int64_t D) {
  const size_t elem = dtype == GDP_DTYPE_F64 ? sizeof(double) : sizeof(float);
  return (size_t)(segments > 0 ? segments : 1) * (size_t)(D > 0 ? D : 1) * elem;
}

extern "C" gdp_status gdp_cuda_embedding_bwd(int dtype, int64_t V, int64_t D,
                                             const int64_t *row_start, const int64_t *row_tokens,
                                             const int64_t *seg_first, const int64_t *seg_row,
                                             int64_t segments, const void *d_out, void *dweight,
                                             void *workspace, void *stream) {
  static const char *func = "gdp_cuda_embedding_bwd";
  if (V == 0 || D == 0) return GDP_OK;
  GDP_MIXER_DISPATCH(func, dtype,
                     return embedding_bwd<IO>(V, D, row_start, row_tokens, seg_first, seg_row,
                                              segments, d_out, dweight, workspace,
                                              (cudaStream_t)stream));
  return GDP_OK;
}
