/*
 * plan.cuh -- the GDP operator's CUDA internals shared by every file of kernels/cuda/gdp:
 * the kernels' argument block, the per-call plan (chunk table, workspace), validation,
 * and the interfaces between the stages (dispatch.cu, chunk_forward.cu,
 * chunk_backward.cu, recurrent.cu).
 *
 * Chunkwise algorithm (docs: the design note), over the expanded stream of T*n steps,
 * chunks of C steps = TC whole tokens (C = 32, 64, 48, 64 for n = 1..4: chunk_steps), so
 * every sequence starts a chunk.  Per chunk c and head h, with kn, qn the normalised
 * keys/queries, gc the in-chunk cumulative log decay (g on step 0 of each token),
 * last = gc[C-1] and query a on step ia = a*n + n-1:
 *   A  = strictly-lower(beta_i e^{gc_i-gc_j} kn_i.kn_j),  T = (I + A)^-1
 *   W  = T diag(beta e^{gc}) Kn,   U = T diag(beta) V
 *   Qd = scale e^{gc_ia} qn_a,     Kd = e^{last-gc_j} kn_j
 *   Pm = scale e^{gc_ia-gc_j} qn_a.kn_j  (j <= ia)        [TC x C: query rows only]
 *   D  = U - W S,  o = Qd S + Pm D,  S <- e^{last} S + Kd^T D
 * Workspace per (chunk, head), bf16: W[C][K] U[C][V] Kd[C][K] Qd[TC][K] Pm[TC][C];
 * float elast.  The backward adds D[C][V], dD[C][V] and U's residual.
 */
#ifndef GDP_KERNELS_CUDA_GDP_PLAN_CUH
#define GDP_KERNELS_CUDA_GDP_PLAN_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "gdp.h"
#include "kernel_status.h"
#include "../gdp_cuda.h"

/* Returns GDP_ERR_CUDA with the CUDA message from the enclosing gdp_status function. */
#define GDP_CUDA_TRY(expr)                                                              \
  do {                                                                                  \
    cudaError_t gdp_cuda_e_ = (expr);                                                   \
    if (gdp_cuda_e_ != cudaSuccess)                                                     \
      return GDP_ERROR(GDP_ERR_CUDA, "%s: %s", #expr, cudaGetErrorString(gdp_cuda_e_)); \
  } while (0)

/* After a launch: configuration errors surface here, faults at the next sync. */
#define GDP_CUDA_LAUNCHED(name)                                                           \
  do {                                                                                    \
    cudaError_t gdp_cuda_e_ = cudaGetLastError();                                         \
    if (gdp_cuda_e_ != cudaSuccess)                                                       \
      return GDP_ERROR(GDP_ERR_CUDA, "launch of %s: %s", name, cudaGetErrorString(gdp_cuda_e_)); \
  } while (0)

typedef __nv_bfloat16 bf16;

namespace gdpcu {

/* Stride (elements) of a padded shared-memory row of `cols` bf16 / float values. */
__host__ __device__ constexpr int ldb16(int cols) { return cols + 8; }
__host__ __device__ constexpr int ldf32(int cols) { return cols + 4; }

/* Round a byte count up to 128 (keeps every carved shared-memory region aligned). */
__host__ __device__ constexpr size_t align128(size_t b) { return (b + 127) & ~(size_t)127; }


/* The chunk kernels' column panels over K or V (the prep's W/U items, grad_wy's and
 * grad_state's key and value items): 64 columns, or the whole width where it is 32 --
 * panel_groups(d) panels of panel_cols(d) columns. */
__host__ __device__ constexpr int panel_cols(int d) { return d < 64 ? d : 64; }
__host__ __device__ constexpr int panel_groups(int d) { return d / panel_cols(d); }
/* The kernels' widths of K (32, 64, 128, 256) and V (32, 64, 128) as an index 0, 1, 2, 3
 * (the launchers' occupancy caches). */
constexpr int kWidths = 4;
inline int width_index(int d) { return d == 32 ? 0 : d == 64 ? 1 : d == 128 ? 2 : 3; }

constexpr int kChunkThreads = 256; /* 8 warps in every chunk kernel */
constexpr float kNormEps = 1e-6f;

struct ChunkInfo {
  int seq, t0, ntok, pad;
};

struct GdpArgs {
  /* problem */
  const void *q, *k, *v, *g, *beta;
  const float *h0;
  void *o;
  float *ht;
  const void *d_o;
  const float *dht;
  void *dq, *dk, *dv, *dbeta, *dg;
  float *dh0;
  int H, K, V, n, C, TC, l2norm;
  int g_f32; /* g and dg float32 beside bf16 tokens (the problem's gate_f32) */
  float scale;
  /* sequences and chunks (device copies) */
  const long long *cu; /* N+1 token offsets */
  const ChunkInfo *chunks;
  const int *choff; /* N+1 chunk offsets */
  int N, nchunks;
  int nstages; /* pipeline depth of the sequential kernels (set at launch) */
  /* workspace */
  bf16 *W, *U, *Kd, *Qd, *Pm;
  /* U - bf16(U) (else NULL), so that D = U - W h starts from U to ~16 bits instead of 8
   * (dg's z terms amplify D's error; docs/kernels.md §3.6): the recompute backward's
   * states pass and the saving forward, where they do not form U from Tu and v */
  bf16 *Ulo;
  /* where the state pass forms U itself (else NULL): (T diag(beta))^T, bf16 [C][C] per
   * (chunk, head), which the prep stores in U's buffer (C <= V) instead of U (and, saving,
   * U's residual); the state pass reads it and v and forms U = Tu V itself, in float32,
   * inside D's accumulator (no U round trip, no residual) */
  bf16 *Tu;
  float *elast;
  /* D and dD, bf16 [C][V] per (chunk, head): the saving forward's and the states pass's
   * D, the state-gradient pass's dD (backward only, else NULL) */
  bf16 *Dbuf, *dDbuf;
};

/* Chunk steps for n Householder steps per token at key instance width K (0: no instance
 * for this n): C = 32, 64, 48, 64 for n = 1..4, i.e. TC = C / n = 32, 32, 16, 16 whole
 * tokens per chunk, so every sequence starts a chunk.  The kernels take C <= 64 (the
 * prep's solve holds a column of T in registers) and TC a multiple of 16 (query rows in
 * whole mma tiles): n = 4 is the last n with both (n = 5..8 would need 8-token chunks,
 * i.e. half query tiles: chunk_shapes.cu runs them as tokens of fewer steps instead).
 * K = 32: n = 2 takes 32-step chunks (16 tokens): at K = 32 the prep's and grad_wy's
 * C x C work (the solve, T, dT) outweighs the K-wide products and shrinks with C, while
 * the state passes that pay for the longer chain of chunks are cheap (H200, H = 8,
 * 256 x 512: fwd+bwd 3.82 -> 3.26 ms plain, 2.94 -> 2.77 saving).  n = 4 keeps its
 * 64-step chunk: run as 2 tokens of 2 steps on the 32-step n = 2 chunk it measured
 * slower (7.10 -> 7.55 ms plain, 5.42 -> 6.48 saving; the split's copies and twice the
 * chunks outweigh the smaller solve).
 * K = 256 has one instance, n = 2 with 32-step chunks (16 tokens): the sequential passes'
 * chunk panels (k, W, D: C rows of K) fit an SM's 227 KB only up to C = 48 (at C = 64 the
 * state pass alone needs 276 KB), and the state-gradient part of the per-chunk gradients
 * gives each of its 8 warps one item of 16 rows x 64 key columns, which at K = 256 leaves
 * room for 32 steps of 16 query rows, not 48 steps or 32 query rows.
 * The launchers instantiate their kernels at <chunk_steps_of(n, K), chunk_tokens_of(n, K)>. */
__host__ __device__ constexpr int chunk_steps_of(int n, int K) {
  return K > 128   ? (n == 2 ? 32 : 0)
         : K <= 32 ? (n == 1 ? 32 : n == 2 ? 32 : n == 3 ? 48 : n == 4 ? 64 : 0)
                   : (n == 1 ? 32 : n == 2 ? 64 : n == 3 ? 48 : n == 4 ? 64 : 0);
}
__host__ __device__ constexpr int chunk_tokens_of(int n, int K) {
  return n >= 1 && n <= 4 ? chunk_steps_of(n, K) / n : 0;
}
constexpr int kMaxChunkN = 4; /* the largest n with a chunk (the launchers' caches are sized by it) */
static_assert(chunk_steps_of(kMaxChunkN, 128) > 0 && chunk_steps_of(kMaxChunkN + 1, 128) == 0,
              "kMaxChunkN is the last n");
static_assert(chunk_tokens_of(3, 128) * 3 == chunk_steps_of(3, 128) && chunk_tokens_of(4, 128) * 4 == chunk_steps_of(4, 128) &&
                  chunk_tokens_of(4, 128) % 16 == 0 && chunk_tokens_of(2, 256) % 16 == 0 &&
                  chunk_tokens_of(2, 32) % 16 == 0,
              "whole tokens per chunk, whole query tiles");
inline int chunk_steps(int64_t n, int64_t K) {
  return n >= 1 && n <= kMaxChunkN ? chunk_steps_of((int)n, (int)K) : 0;
}

/* The token rewrite of chunk_shapes.cu (token_split): a token's n steps padded with
 * identity steps to np and run as m tokens of ns = np / m steps, ns an n that the key
 * width's instances have (chunk_steps_of).  n with an instance runs
 * as it is; else the fewest padded steps, then the longest tokens, among the instances
 * whose chunk holds a whole number of the problem's tokens (m divides its TC).
 * K = 64, 128: n = 5, 6 as 2 tokens of 3 steps (padded to 6), n = 7, 8 as 2 of 4: a chunk
 * holds 32, 32, 16, 16, 8, 8, 8, 8 whole tokens for n = 1..8; K = 32 the same but 16 at
 * n = 2.  K = 256 (n = 2 alone): n = 1 padded to 2, n = 3, 4 as 2 of 2, n = 5..8 as 4 of
 * 2: 16, 16, 8, 8, 4, 4, 4, 4.
 * fast_chunk_steps(n, K) is a chunk's steps of the problem's own stream (0: none). */
constexpr int kMaxFastN = 8;
/* the widest K and V the fast path takes (narrower ones zero-padded: chunk_shapes.cu) */
constexpr int64_t kMaxFastK = 256, kMaxFastV = 256;
/* the kernels' instance width for a key width K (1..256): 32, 64, 128 or 256 */
inline int64_t key_instance_width(int64_t K) { return K <= 32 ? 32 : K <= 64 ? 64 : K <= 128 ? 128 : 256; }
struct TokenSplit {
  int64_t np, m; /* steps a token after padding; tokens a token runs as (0, 0: none) */
};
inline TokenSplit token_split(int64_t n, int64_t K) {
  const int KW = (int)key_instance_width(K);
  if (n < 1 || n > kMaxFastN) return {0, 0};
  if (n <= kMaxChunkN && chunk_steps_of((int)n, KW) > 0) return {n, 1};
  TokenSplit best = {0, 0};
  for (int ns = kMaxChunkN; ns >= 1; ns--) {
    const int tc = chunk_tokens_of(ns, KW);
    if (tc == 0) continue;
    int64_t m = (n + ns - 1) / ns;
    while (tc % m) m++; /* a whole number of the problem's tokens a chunk */
    if (best.m == 0 || m * ns < best.np) best = {m * ns, m};
  }
  return best;
}
inline int fast_chunk_steps(int64_t n, int64_t K) {
  const TokenSplit ts = token_split(n, K);
  if (ts.m == 0) return 0;
  const int KW = (int)key_instance_width(K);
  return (int)(chunk_tokens_of((int)(ts.np / ts.m), KW) / ts.m * n);
}

/* Host-side plan of one call: device copies of the tables and the workspace, all in
 * one stream-ordered allocation released by plan_free. */
struct Plan {
  GdpArgs a;
  void *block;
  cudaStream_t stream;
  int value_block; /* the problem's value_block: 0 = the passes' own choice */
};

/* Shared helpers (plan.cu). */
gdp_status validate_problem(const gdp_delta_product_problem *p, const char *what);
/* The io block's required buffers for the call named `what`. */
gdp_status validate_fwd_io(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io, const char *what);
gdp_status validate_bwd_io(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, const char *what);
/* The kernels' argument block from a problem and its buffers (both paths). */
GdpArgs fwd_args(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io);
GdpArgs bwd_args(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io);
gdp_status device_alloc(void **ptr, size_t bytes, cudaStream_t stream);
gdp_status upload_cu_seqlens(const gdp_delta_product_problem *p, long long *dst, cudaStream_t stream);
int num_sms();

/* Which per-chunk buffers a plan carries besides the forward's panels (W, U, Kd, Qd, Pm,
 * elast): PLAN_BACKWARD adds D, dD and U's residual (a.Ulo, C x V bf16); the gradient
 * kernels read h^T and dH^T from their own buffers. */
enum PlanBufs { PLAN_FORWARD, PLAN_BACKWARD };

/* ext: NULL allocates the block (freed by plan_free); else the plan lives in the
 * caller's block of plan_bytes(p, bufs) bytes (a forward workspace kept for the
 * backward), which plan_free leaves alone, and upload_tables = false trusts the chunk
 * tables already there (written by an earlier plan of the same problem). */
gdp_status plan_make(const gdp_delta_product_problem *p, cudaStream_t stream, PlanBufs bufs, GdpArgs base,
                     Plan *plan, void *ext = nullptr, bool upload_tables = true);
size_t plan_bytes(const gdp_delta_product_problem *p, PlanBufs bufs);
void plan_free(Plan *plan);

/* Optional per-kernel timing (gdp_debug_profile_kernels(): GDP_CUDA_PROFILE=1): each
 * launch is bracketed by events and the call synchronises at its end. */
void prof_begin(cudaStream_t stream);
void prof_mark(const char *name, cudaStream_t stream);
void prof_end(cudaStream_t stream);

namespace chunked {

/* Whether the fast path takes p: bf16, n = 1..8, K <= 256, V <= 256 (n = 5..8 -- any n
 * but 2 above K = 128 -- split into tokens of fewer steps, K and V other than 32, 64,
 * 128, 256 zero-padded to the next -- V to 128 at least above K = 128 --, V = 256 as
 * two halves: chunk_shapes.cu; K, V = 32 in the kernels' own width-32 instances). */
bool takes(const gdp_delta_product_problem *p);

/* The rewrites of chunk_shapes.cu, which forward and backward below apply first, in this
 * order: n = 5..8 (needs_split) as 2 tokens of 3 or 4 steps, other widths
 * (needs_padding) zero-padded to the next instance's, V = 256 (needs_value_split) as
 * two problems of V = 128; each rewrite's forward and backward copy the inputs into the
 * rewritten problem's layout, run it and copy the results back.  kernel_problem: the
 * problem the kernels run for p (every rewrite applied; cu receives its cu_seqlens),
 * run `parts` times (2 for V = 256), each part's saved block one after the other. */
bool needs_split(const gdp_delta_product_problem *p);
bool needs_padding(const gdp_delta_product_problem *p);
int64_t kernel_value_width(const gdp_delta_product_problem *p); /* V after padding (256: before halves) */
bool needs_value_split(const gdp_delta_product_problem *p);
gdp_delta_product_problem kernel_problem(const gdp_delta_product_problem *p, std::vector<int64_t> &cu, int *parts);
gdp_status forward_value_split(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                               cudaStream_t stream, void *saved);
gdp_status backward_value_split(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                                cudaStream_t stream, const void *saved);
gdp_status forward_padded(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                          cudaStream_t stream, void *saved);
gdp_status backward_padded(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                           cudaStream_t stream, const void *saved);
gdp_status forward_split(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                         cudaStream_t stream, void *saved);
gdp_status backward_split(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                          cudaStream_t stream, const void *saved);

/* Layout of the block a saving forward keeps (bytes): the forward plan's block
 * (plan_bytes: chunk tables, W, U, Kd, Qd, Pm, elast) from 0, h^T bf16 [CH][V][K] from
 * o_hT, D bf16 [CH][C][V] from o_D, T^T bf16 [CH][C][C] (the prep's, for grad_wy) from
 * o_Tt; CH = chunks x heads.  The chunk states travel in bf16: every use of them but one
 * is a bf16 tensor-core operand, rounded the same way either way; the exception is
 * grad_state's <dH, h> (gate gradient), which reads the rounded values (docs/kernels.md
 * §3.3, bf16 chunk states: saving fwd+bwd at 4x4096 n=2 2.52 -> 2.33 ms, errors
 * unchanged). */
struct SavedLayout {
  size_t plan, o_hT, o_D, o_Tt, total;
};
SavedLayout saved_layout(const gdp_delta_product_problem *p);
/* saved_layout(p).total; 0 where the path does not take p or there is no sequence. */
size_t saved_bytes(const gdp_delta_product_problem *p);

/* The forward and backward; p and io validated, takes(p).  forward: saved non-NULL keeps
 * the block above there.  backward: saved non-NULL reads a saving forward's block of the
 * same problem and inputs instead of recomputing (the prep and the states pass). */
gdp_status forward(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io, cudaStream_t stream, void *saved);
gdp_status backward(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, cudaStream_t stream, const void *saved);

/* dh0 alone (io's other gradients NULL): the prep and the state-gradient pass, neither
 * the states pass nor the gradient kernels -- context parallelism's backward summary.
 * takes_dh0: the problems it runs (takes(p) with no rewrite of chunk_shapes.cu). */
bool takes_dh0(const gdp_delta_product_problem *p);
gdp_status backward_dh0(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, cudaStream_t stream);

/* The prep (chunk_prep.cuh, launched by chunk_forward.cu), also the backward's recompute:
 * Tt non-NULL also stores T^T there (and U's residual where plan.a.Ulo is set). */
gdp_status launch_chunk_prep(const Plan &plan, bf16 *Tt);

}  // namespace chunked

/* The recurrent kernels (recurrent.cu): f32 and bf16, any shape the dispatch
 * validated.  p and io validated. */
gdp_status forward_recurrent(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io, cudaStream_t stream);
gdp_status backward_recurrent(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io, cudaStream_t stream);

}  // namespace gdpcu


#endif
