/*
 * embedding.cu -- the embedding gather and its deterministic backward on cuda, with the
 * semantics of kernels/cpu/embedding.c.  The token ids are read where they lie (int32
 * or int64 on the device) and checked there: a position whose id is outside [0, V)
 * is never used as an address, and the first such position goes to a device word the
 * caller reads back (atomicMin: the same answer whatever the schedule).
 *
 * The backward never lets two threads add into one element.  The token positions are
 * grouped by vocabulary row on the device: a histogram of the ids (integer atomics,
 * exact), its exclusive scan (row_start), and a stable radix sort of (id, position)
 * pairs over the id's bits only (cub, LSD: positions stay increasing within a row).
 * Each row's list is cut into segments of at most GDP_CUDA_EMBED_SEGMENT tokens (a
 * scan of the per-row segment counts); pass 1 gives each segment a block that sums its
 * d_out rows, column by column in token order, into the workspace; pass 2 gives each
 * vocabulary row a block that adds its segments in order (rows without tokens get
 * zeros).  The segment count is not read back: pass 1 is launched for its bound,
 * min(n, ceil(n / SEGMENT) + V), and blocks past the real count return.  Sums are in
 * the math type (float32 for f32 and bf16, float64 for f64), stored in it.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "../mixer/common.cuh"
#include "nn_cuda.h"

namespace gdp_mixer {
namespace {

enum { EMBED_THREADS = 128, EMBED_MAX_BLOCKS = 65535 };

template <typename ID> __device__ __forceinline__ int64_t id_at(const void *ids, int64_t i) {
  return (int64_t)((const ID *)ids)[i];
}

/* The verdict of a check: slot = {first bad position or -1, the value there or 0}. */
__global__ void index_fault_kernel(const unsigned long long *first_bad, const void *ids,
                                   int ids_dtype, int64_t *slot) {
  const unsigned long long w = *first_bad;
  if (w == ~0ull) {
    slot[0] = -1;
    slot[1] = 0;
    return;
  }
  slot[0] = (int64_t)w;
  slot[1] = ids_dtype == GDP_DTYPE_I32 ? id_at<int32_t>(ids, (int64_t)w)
                                       : id_at<int64_t>(ids, (int64_t)w);
}

/* out row r = weight row ids[r], moved in packs of VEC (D % VEC == 0, rows aligned). */
template <typename IO, typename ID, int VEC>
__global__ void embedding_fwd_kernel(int64_t n, int64_t D, int64_t V, const void *ids,
                                     const IO *weight, IO *out, unsigned long long *first_bad) {
  const int64_t packs = D / VEC;
  GDP_MIXER_FOR(i, n * packs) {
    const int64_t r = i / packs, j = (i - r * packs) * VEC;
    const int64_t v = id_at<ID>(ids, r);
    if (v < 0 || v >= V) {
      if (j == 0) atomicMin(first_bad, (unsigned long long)r);
      continue;
    }
    st_pack<IO, VEC>(out + r * D + j, ld_pack<IO, VEC>(weight + v * D + j));
  }
}

/* The check alone, for rows of no values (D == 0): the ids are still validated, as on
 * the cpu. */
template <typename ID>
__global__ void embedding_check_kernel(int64_t n, int64_t V, const void *ids,
                                       unsigned long long *first_bad) {
  GDP_MIXER_FOR(i, n) {
    const int64_t v = id_at<ID>(ids, i);
    if (v < 0 || v >= V) atomicMin(first_bad, (unsigned long long)i);
  }
}

static void embedding_check(int64_t n, int64_t V, const void *ids, int ids_dtype,
                            unsigned long long *first_bad, cudaStream_t stream) {
  if (ids_dtype == GDP_DTYPE_I32)
    embedding_check_kernel<int32_t><<<grid_for(n), THREADS, 0, stream>>>(n, V, ids, first_bad);
  else
    embedding_check_kernel<int64_t><<<grid_for(n), THREADS, 0, stream>>>(n, V, ids, first_bad);
}

/* The sort's keys (the id, or V for an id out of range: a row of its own that pass 2
 * never reads), its values (the positions) and the histogram of the keys (exact:
 * integer adds, blockDim a multiple of 32). */
template <typename ID>
__global__ void embedding_keys_kernel(int64_t n, int64_t V, const void *ids, uint32_t *keys,
                                      int64_t *pos, unsigned long long *count,
                                      unsigned long long *first_bad) {
  /* Whole warps per step (the loop bound is the block's), so that every lane meets the
   * match below; lanes past n carry the key V + 1, which nothing counts. */
  for (int64_t i0 = (int64_t)blockIdx.x * blockDim.x; i0 < n;
       i0 += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = i0 + threadIdx.x;
    int64_t v = V + 1;
    if (i < n) {
      v = id_at<ID>(ids, i);
      if (v < 0 || v >= V) {
        atomicMin(first_bad, (unsigned long long)i);
        v = V;
      }
      keys[i] = (uint32_t)v;
      pos[i] = i;
    }
    /* one add per distinct id in the warp: a few rows take every token's add otherwise */
    const unsigned peers = __match_any_sync(0xffffffffu, (unsigned)v);
    if (v <= V && (int)(threadIdx.x & 31) == __ffs(peers) - 1)
      atomicAdd(count + v, (unsigned long long)__popc(peers));
  }
}

/* nseg[v] = row v's segment count (v < V; nseg[V], the bad ids' row, is 0). */
__global__ void embedding_nseg_kernel(int64_t V, const int64_t *count, int64_t *nseg) {
  GDP_MIXER_FOR(v, V + 1)
    nseg[v] = v < V ? (count[v] + GDP_CUDA_EMBED_SEGMENT - 1) / GDP_CUDA_EMBED_SEGMENT : 0;
}

template <typename IO>
__global__ void embedding_segment_kernel(int64_t V, int64_t D, int64_t bound,
                                         const int64_t *row_start, const int64_t *row_tokens,
                                         const int64_t *seg_first, const IO *d_out,
                                         typename Math<IO>::type *partial) {
  typedef typename Math<IO>::type A;
  for (int64_t g = blockIdx.x; g < bound; g += gridDim.x) {
    if (g >= seg_first[V]) return; /* uniform over the block */
    int64_t lo = 0, hi = V; /* the row v with seg_first[v] <= g < seg_first[v+1] */
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (seg_first[mid] <= g) lo = mid;
      else hi = mid;
    }
    const int64_t v = lo;
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

/* A cuda runtime call's error (a cub call, a memset) as a gdp status. */
static gdp_status called(const char *func, cudaError_t e, const char *what) {
  if (e == cudaSuccess) return GDP_OK;
  (void)cudaGetLastError();
  return GDP_ERROR_IN(func, GDP_ERR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorName(e),
                      cudaGetErrorString(e));
}

static unsigned blocks_for(int64_t n) {
  if (n < 1) return 1;
  return (unsigned)(n < EMBED_MAX_BLOCKS ? n : EMBED_MAX_BLOCKS);
}

static int key_bits(int64_t V) { /* the bits of keys in [0, V] */
  int b = 1;
  while (b < 32 && ((int64_t)1 << b) <= V) b++;
  return b;
}

/* The backward's workspace, carved in this order (each piece 256-byte aligned). */
struct BwdLayout {
  size_t keys, keys_sorted, pos, row_tokens, count, row_start, nseg, seg_first, cub, partial,
      total;
};

static size_t align_up(size_t x) { return (x + 255) & ~(size_t)255; }

static int64_t segment_bound(int64_t n, int64_t V) {
  const int64_t b = (n + GDP_CUDA_EMBED_SEGMENT - 1) / GDP_CUDA_EMBED_SEGMENT + V;
  return b < n ? b : n;
}

static cudaError_t bwd_layout(int dtype, int64_t n, int64_t V, int64_t D, BwdLayout *L) {
  size_t sort_bytes = 0, scan_bytes = 0;
  cudaError_t e = cub::DeviceRadixSort::SortPairs(
      (void *)NULL, sort_bytes, (const uint32_t *)NULL, (uint32_t *)NULL, (const int64_t *)NULL,
      (int64_t *)NULL, (int64_t)n, 0, key_bits(V));
  if (e == cudaSuccess)
    e = cub::DeviceScan::ExclusiveSum((void *)NULL, scan_bytes, (const int64_t *)NULL,
                                      (int64_t *)NULL, (int64_t)(V + 1));
  const size_t elem = dtype == GDP_DTYPE_F64 ? sizeof(double) : sizeof(float);
  const size_t sizes[10] = {
      (size_t)n * 4, (size_t)n * 4, (size_t)n * 8, (size_t)n * 8, (size_t)(V + 1) * 8,
      (size_t)(V + 1) * 8, (size_t)(V + 1) * 8, (size_t)(V + 1) * 8,
      sort_bytes > scan_bytes ? sort_bytes : scan_bytes,
      (size_t)(segment_bound(n, V) > 0 ? segment_bound(n, V) : 1) * (size_t)D * elem};
  size_t *fields[10] = {&L->keys,      &L->keys_sorted, &L->pos,       &L->row_tokens,
                        &L->count,     &L->row_start,   &L->nseg,      &L->seg_first,
                        &L->cub,       &L->partial};
  size_t at = 0;
  for (int i = 0; i < 10; i++) {
    *fields[i] = at;
    at += align_up(sizes[i] > 0 ? sizes[i] : 1);
  }
  L->total = at;
  return e;
}

template <typename ID>
static gdp_status embedding_group(int64_t n, int64_t V, const void *ids, char *ws,
                                  const BwdLayout &L, unsigned long long *first_bad,
                                  cudaStream_t stream) {
  static const char *func = "gdp_cuda_embedding_bwd";
  int64_t *count = (int64_t *)(ws + L.count);
  GDP_TRY(called(func, cudaMemsetAsync(count, 0, (size_t)(V + 1) * sizeof(int64_t), stream),
                      "clearing the token histogram"));
  embedding_keys_kernel<ID><<<grid_for(n), THREADS, 0, stream>>>(
      n, V, ids, (uint32_t *)(ws + L.keys), (int64_t *)(ws + L.pos),
      (unsigned long long *)count, first_bad);
  GDP_TRY(launched(func, "embedding_keys_kernel"));
  size_t cub_bytes = L.partial - L.cub;
  GDP_TRY(called(func, cub::DeviceRadixSort::SortPairs(
      (void *)(ws + L.cub), cub_bytes, (const uint32_t *)(ws + L.keys),
      (uint32_t *)(ws + L.keys_sorted), (const int64_t *)(ws + L.pos),
      (int64_t *)(ws + L.row_tokens), (int64_t)n, 0, key_bits(V), stream),
      "sorting the token positions by id"));
  cub_bytes = L.partial - L.cub;
  GDP_TRY(called(func, cub::DeviceScan::ExclusiveSum((void *)(ws + L.cub), cub_bytes, count,
                                                     (int64_t *)(ws + L.row_start),
                                                     (int64_t)(V + 1), stream),
                 "scanning the token histogram"));
  embedding_nseg_kernel<<<grid_for(V + 1), THREADS, 0, stream>>>(V, count,
                                                                 (int64_t *)(ws + L.nseg));
  GDP_TRY(launched(func, "embedding_nseg_kernel"));
  cub_bytes = L.partial - L.cub;
  GDP_TRY(called(func, cub::DeviceScan::ExclusiveSum((void *)(ws + L.cub), cub_bytes,
                                                     (const int64_t *)(ws + L.nseg),
                                                     (int64_t *)(ws + L.seg_first),
                                                     (int64_t)(V + 1), stream),
                 "scanning the segment counts"));
  return GDP_OK;
}

template <typename IO>
static gdp_status embedding_sums(int64_t n, int64_t V, int64_t D, const void *d_out,
                                 void *dweight, char *ws, const BwdLayout &L,
                                 cudaStream_t stream) {
  static const char *func = "gdp_cuda_embedding_bwd";
  typedef typename Math<IO>::type A;
  A *partial = (A *)(ws + L.partial);
  const int64_t *seg_first = (const int64_t *)(ws + L.seg_first);
  const int64_t bound = segment_bound(n, V);
  if (bound > 0) {
    embedding_segment_kernel<IO><<<blocks_for(bound), EMBED_THREADS, 0, stream>>>(
        V, D, bound, (const int64_t *)(ws + L.row_start), (const int64_t *)(ws + L.row_tokens),
        seg_first, (const IO *)d_out, partial);
    GDP_TRY(launched(func, "embedding_segment_kernel"));
  }
  embedding_row_kernel<A><<<blocks_for(V), EMBED_THREADS, 0, stream>>>(V, D, seg_first, partial,
                                                                       (A *)dweight);
  return launched(func, "embedding_row_kernel");
}

template <typename IO, typename ID>
static void embedding_fwd(int64_t n, int64_t D, int64_t V, const void *ids, const void *weight,
                          void *out, unsigned long long *first_bad, cudaStream_t stream) {
  enum { VEC = Vec16<IO>::n };
  if (D % VEC == 0 && aligned16(weight) && aligned16(out))
    embedding_fwd_kernel<IO, ID, VEC><<<grid_for(n * (D / VEC)), THREADS, 0, stream>>>(
        n, D, V, ids, (const IO *)weight, (IO *)out, first_bad);
  else
    embedding_fwd_kernel<IO, ID, 1><<<grid_for(n * D), THREADS, 0, stream>>>(
        n, D, V, ids, (const IO *)weight, (IO *)out, first_bad);
}

} // namespace
} // namespace gdp_mixer

using namespace gdp_mixer;

extern "C" gdp_status gdp_cuda_embedding_fwd(int dtype, int64_t n, int64_t D, int64_t V,
                                             const void *ids, int ids_dtype, const void *weight,
                                             void *out, unsigned long long *first_bad,
                                             void *stream) {
  static const char *func = "gdp_cuda_embedding_fwd";
  if (n == 0) return GDP_OK;
  const cudaStream_t s = (cudaStream_t)stream;
  if (D == 0) {
    embedding_check(n, V, ids, ids_dtype, first_bad, s);
    return launched(func, "embedding_check_kernel");
  }
  if (ids_dtype == GDP_DTYPE_I32)
    GDP_MIXER_DISPATCH(func, dtype,
                       embedding_fwd<IO, int32_t>(n, D, V, ids, weight, out, first_bad, s));
  else
    GDP_MIXER_DISPATCH(func, dtype,
                       embedding_fwd<IO, int64_t>(n, D, V, ids, weight, out, first_bad, s));
  return launched(func, "embedding_fwd_kernel");
}

extern "C" gdp_status gdp_cuda_index_fault(const unsigned long long *first_bad, const void *ids,
                                           int ids_dtype, int64_t *slot, void *stream) {
  index_fault_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(first_bad, ids, ids_dtype, slot);
  return launched("gdp_cuda_index_fault", "index_fault_kernel");
}

extern "C" size_t gdp_cuda_embedding_bwd_workspace(int dtype, int64_t n, int64_t V, int64_t D) {
  BwdLayout L;
  if (bwd_layout(dtype, n, V, D, &L) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return L.total;
}

extern "C" gdp_status gdp_cuda_embedding_bwd(int dtype, int64_t n, int64_t V, int64_t D,
                                             const void *ids, int ids_dtype, const void *d_out,
                                             void *dweight, void *workspace,
                                             unsigned long long *first_bad, void *stream) {
  static const char *func = "gdp_cuda_embedding_bwd";
  if (V == 0 || D == 0) { /* no sums, but the ids are checked all the same */
    if (n == 0) return GDP_OK;
    embedding_check(n, V, ids, ids_dtype, first_bad, (cudaStream_t)stream);
    return launched(func, "embedding_check_kernel");
  }
  if (V >= (int64_t)UINT32_MAX)
    return GDP_ERROR_IN(func, GDP_ERR_UNSUPPORTED,
                        "num_embeddings: expected < %llu on cuda (32-bit sort keys), got %lld",
                        (unsigned long long)UINT32_MAX, (long long)V);
  const cudaStream_t s = (cudaStream_t)stream;
  BwdLayout L;
  GDP_TRY(called(func, bwd_layout(dtype, n, V, D, &L), "sizing the sort's workspace"));
  char *ws = (char *)workspace;
  if (n > 0) {
    if (ids_dtype == GDP_DTYPE_I32)
      GDP_TRY(embedding_group<int32_t>(n, V, ids, ws, L, first_bad, s));
    else
      GDP_TRY(embedding_group<int64_t>(n, V, ids, ws, L, first_bad, s));
  } else {
    GDP_TRY(called(func, cudaMemsetAsync(ws + L.seg_first, 0, (size_t)(V + 1) * sizeof(int64_t), s),
                   "clearing the segment table"));
  }
  GDP_MIXER_DISPATCH(func, dtype,
                     return embedding_sums<IO>(n, V, D, d_out, dweight, ws, L, s));
  return GDP_OK;
}
