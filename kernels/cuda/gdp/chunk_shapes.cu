/*
 * chunk_shapes.cu -- fast-path shapes outside the kernels' instances, run as an equal
 * problem inside them: n = 5..8 split into tokens of fewer Householder steps, K and V
 * other than the instances' widths zero-padded to the next one, V = 256 as two problems
 * on the halves of the value columns (applied in that order by chunked::forward and
 * backward).  All are exact rewrites of the problem, not approximations; each costs one
 * copy in and out of what it rewrites.  K and V = 32 need no rewrite: the kernels have
 * width-32 instances (their 64-column panels are 32 wide there, panel_cols in plan.cuh).
 *
 * Other widths (K, V <= 256: 48, 96, 80, 16, 192, ...).  The kernels' instances are
 * K in {32, 64, 128, 256} and V in {32, 64, 128} (only 128 at K = 256; V = 256 by
 * halves), so K runs at the next of 32, 64, 128, 256 and V at the next of 32, 64, 128,
 * 256 (at least 128 above K = 128): q, k (K) and v, d_o (V) are copied into zero-filled
 * rows of that width, h0 and dht into zero-filled states, the padded problem runs, and
 * o, ht, dq, dk, dv and dh0 are cropped back.  Zero columns change no value of the real
 * ones: the l2 norms, every dot product over K (A, Pm, Qd S, W S) and every state update
 * add exact zeros, and the padded state columns stay zero (beta, g, dbeta and dg pass
 * through untouched).  The price is the zero columns' work (K = 48 runs 64 columns) and
 * one copy of each padded tensor, against the recurrent kernels' ~20x.
 *
 * V = 256.  The recurrence mixes the state's rows, never its value columns, so each half
 * of the columns is a V = 128 problem of its own: v, d_o, h0, dht split, o, ht, dv, dh0
 * joined, and the gradients of the shared q, k, beta, g summed (float32, rounded to bf16
 * once more).  The prep and the key-side gradient work run twice.
 *
 * n = 5..8.  The kernels take n <= 4 (chunk_steps_of: C <= 64 steps of whole tokens, TC
 * a multiple of 16).  A token of n steps is first padded to np = 6 (n = 5) or 8 (n = 7)
 * steps with identity steps (beta 0, k 0, v 0: every product with them is an exact
 * zero, so S is untouched), then run as m = 2 tokens of np / 2 = 3 or 4 steps: the step
 * rows stay in the same order; the first of the two carries the token's gate, the
 * second gate 0 (a decay of exactly 1); only the second carries the query, the first a
 * zero query (its output zero, discarded).  So q, g and d_o are spread over 2 rows (zero
 * elsewhere), o and dq read from the second, dg from the first; k, v, beta (and their
 * gradients) are padded (cropped) only at n = 5, 7; the states are the problem's own.
 * 8 tokens a chunk (C = 48 or 64 of the split steps).  Why 2 x (3 or 4) and not, for
 * n = 5 and 7, n tokens of one step (no padding): the state pass is sequential over
 * chunks, and 1-step tokens give chunks of 32 steps and a query per step, against 48 or
 * 64 steps and a query per 3 or 4 (n = 7: 7T / 32 chunks in the chain instead of 8T / 64).
 * K = 256 (one instance, n = 2: plan.cuh) rewrites every other n the same way: padded to
 * 2, 4 or 8 steps and run as 1, 2 or 4 tokens of 2 steps (n = 1 then pays for an identity
 * step per token, against the recurrent kernels' ~20x).
 * (docs/kernels.md section 3.7)
 */
#include <vector>

#include "plan.cuh"

namespace gdpcu {
namespace chunked {
namespace {

/* dst[b][i][j] (B x dr x dc) = src[b][i + roff][j] (B x sr x sc) where that row and
 * column exist, else 0: a pad where dst has more rows, a crop where it has fewer, a
 * spread of one row over several (roff < 0) or the pick of one (roff > 0). */
template <class T>
__global__ void window_kernel(T *dst, int dr, int dc, const T *src, int sr, int sc, int roff, int64_t B) {
  const int64_t total = B * dr * dc;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int j = (int)(e % dc), i = (int)(e / dc % dr), si = i + roff;
    const int64_t b = e / ((int64_t)dc * dr);
    dst[e] = si >= 0 && si < sr && j < sc ? src[(b * sr + si) * sc + j] : T(0);
  }
}

/* One window_kernel launch over elements of `bytes` bytes: 2 (bf16, moved as its bits,
 * 0 is +0.0) or 4 (float32 states and gates). */
gdp_status window(void *dst, int dr, int dc, const void *src, int sr, int sc, int roff, int64_t B, int bytes,
                  cudaStream_t s) {
  const int64_t total = B * dr * dc;
  if (total == 0) return GDP_OK;
  const int64_t blocks = (total + 255) / 256;
  const unsigned grid = (unsigned)(blocks > 65536 ? 65536 : blocks);
  if (bytes == 4)
    window_kernel<float><<<grid, 256, 0, s>>>((float *)dst, dr, dc, (const float *)src, sr, sc, roff, B);
  else
    window_kernel<uint16_t><<<grid, 256, 0, s>>>((uint16_t *)dst, dr, dc, (const uint16_t *)src, sr, sc, roff, B);
  GDP_CUDA_LAUNCHED("window_kernel");
  return GDP_OK;
}
/* T tokens of `width` elements -> T x m rows, token t at row t m + at (zeros elsewhere),
 * and back: row t m + at of T x m -> token t. */
gdp_status spread_tokens(void *dst, const void *src, int64_t T, int m, int width, int at, int bytes, cudaStream_t s) {
  return window(dst, m, width, src, 1, width, -at, T, bytes, s);
}
gdp_status pick_tokens(void *dst, const void *src, int64_t T, int m, int width, int at, int bytes, cudaStream_t s) {
  return window(dst, 1, width, src, m, width, at, T, bytes, s);
}

/* The rewritten problem's buffers of one call, carved from one stream-ordered
 * allocation: take() reserves (0 bytes: no buffer), at() its address once allocated. */
struct ScratchBlock {
  void *block = nullptr;
  size_t off = 0;
  size_t take(size_t bytes) {
    const size_t o = off;
    off = align128(off + bytes);
    return bytes ? o : (size_t)-1;
  }
  void *at(size_t o) const { return o == (size_t)-1 ? nullptr : (char *)block + o; }
};

/* rows x cols elements from src (row stride lds) to dst (row stride ldd); add: dst +=
 * src, in float32, rounded once to T. */
template <class T>
__global__ void rect_kernel(T *dst, int64_t ldd, const T *src, int64_t lds, int64_t rows, int cols, int add) {
  const int64_t total = rows * cols;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = e / cols;
    const int j = (int)(e % cols);
    const T x = src[r * lds + j];
    if (add)
      dst[r * ldd + j] = (T)((float)dst[r * ldd + j] + (float)x);
    else
      dst[r * ldd + j] = x;
  }
}

/* One rect_kernel launch: bytes 2 (bf16) or 4 (float32). */
gdp_status rect(void *dst, int64_t ldd, const void *src, int64_t lds, int64_t rows, int cols, bool add, int bytes,
                cudaStream_t s) {
  const int64_t total = rows * cols;
  if (total == 0) return GDP_OK;
  const int64_t blocks = (total + 255) / 256;
  const unsigned grid = (unsigned)(blocks > 65536 ? 65536 : blocks);
  if (bytes == 4)
    rect_kernel<float><<<grid, 256, 0, s>>>((float *)dst, ldd, (const float *)src, lds, rows, cols, add);
  else
    rect_kernel<__nv_bfloat16><<<grid, 256, 0, s>>>((__nv_bfloat16 *)dst, ldd, (const __nv_bfloat16 *)src, lds,
                                                   rows, cols, add);
  GDP_CUDA_LAUNCHED("rect_kernel");
  return GDP_OK;
}

/* rows x c (bf16) <-> rows x cp; states B x r x c (float) <-> B x rp x cp */
gdp_status pad_rows(void *dst, const void *src, int64_t rows, int c, int cp, cudaStream_t s) {
  return window(dst, 1, cp, src, 1, c, 0, rows, 2, s);
}
gdp_status crop_rows(void *dst, const void *src, int64_t rows, int c, int cp, cudaStream_t s) {
  return window(dst, 1, c, src, 1, cp, 0, rows, 2, s);
}
gdp_status pad_states(void *dst, const void *src, int64_t B, int r, int c, int rp, int cp, cudaStream_t s) {
  return window(dst, rp, cp, src, r, c, 0, B, 4, s);
}
gdp_status crop_states(void *dst, const void *src, int64_t B, int r, int c, int rp, int cp, cudaStream_t s) {
  return window(dst, r, c, src, rp, cp, 0, B, 4, s);
}

/* The instances' width for a K (32, 64, 128, 256) or a V (also 256, by halves) up to it. */
int64_t kernel_width(int64_t d, int64_t max) {
  int64_t w = 32;
  while (w < d && w < max) w *= 2;
  return w;
}


/* Row counts and widths of one problem for the copies. */
struct Widths {
  int64_t rows_q, rows_k, states; /* T*H, T*n*H, N*H */
  int K, V, KP, VP;
};
Widths widths(const gdp_delta_product_problem *p) {
  Widths w;
  w.rows_q = p->T_total * p->H;
  w.rows_k = p->T_total * p->n * p->H;
  w.states = p->N * p->H;
  w.K = (int)p->K;
  w.V = (int)p->V;
  w.KP = (int)kernel_width(p->K, kMaxFastK);
  w.VP = (int)kernel_value_width(p);
  return w;
}

/* q, k, v and h0, the inputs both directions pad: from (q, k, v, h0) into the padded
 * buffers (q_pad, ...) where the width (or the state) is padded and given. */
gdp_status pad_inputs(const Widths &w, const void *q, const void *k, const void *v, const void *h0, const void *q_pad,
                      const void *k_pad, const void *v_pad, const void *h0_pad, cudaStream_t stream) {
  gdp_status s = GDP_OK;
  if (w.KP != w.K) s = pad_rows((void *)q_pad, q, w.rows_q, w.K, w.KP, stream);
  if (s == GDP_OK && w.KP != w.K) s = pad_rows((void *)k_pad, k, w.rows_k, w.K, w.KP, stream);
  if (s == GDP_OK && w.VP != w.V) s = pad_rows((void *)v_pad, v, w.rows_k, w.V, w.VP, stream);
  if (s == GDP_OK && h0) s = pad_states((void *)h0_pad, h0, w.states, w.K, w.V, w.KP, w.VP, stream);
  return s;
}

}  // namespace

/* ------------------------------------------------------------------ other widths */

bool needs_padding(const gdp_delta_product_problem *p) {
  return kernel_width(p->K, kMaxFastK) != p->K || kernel_value_width(p) != p->V;
}

/* p's V as the kernels run it: its kernel_width, at least 128 above K = 128 (the K = 256
 * instances have V = 128 only: narrower ones would cost their own compile for little). */
int64_t kernel_value_width(const gdp_delta_product_problem *p) {
  const int64_t w = kernel_width(p->V, kMaxFastV);
  return p->K > 128 && w < 128 ? 128 : w;
}

gdp_delta_product_problem padded_problem(const gdp_delta_product_problem *p) {
  gdp_delta_product_problem q = *p;
  q.K = kernel_width(p->K, kMaxFastK);
  q.V = kernel_value_width(p);
  return q;
}

gdp_status forward_padded(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                          cudaStream_t stream, void *saved) {
  const gdp_delta_product_problem pp = padded_problem(p);
  const Widths w = widths(p);
  const bool pk = w.KP != w.K, pv = w.VP != w.V;
  const size_t st = (size_t)w.states * w.KP * w.VP * 4;
  ScratchBlock blk;
  const size_t o_q = blk.take(pk ? (size_t)w.rows_q * w.KP * 2 : 0), o_k = blk.take(pk ? (size_t)w.rows_k * w.KP * 2 : 0),
               o_v = blk.take(pv ? (size_t)w.rows_k * w.VP * 2 : 0), o_o = blk.take(pv ? (size_t)w.rows_q * w.VP * 2 : 0),
               o_h0 = blk.take(io->h0 ? st : 0), o_ht = blk.take(io->ht ? st : 0);
  GDP_TRY(device_alloc(&blk.block, blk.off, stream));
  gdp_delta_product_forward_io pio = *io;
  if (pk) pio.q = blk.at(o_q), pio.k = blk.at(o_k);
  if (pv) pio.v = blk.at(o_v), pio.o = blk.at(o_o);
  pio.h0 = blk.at(o_h0);
  pio.ht = blk.at(o_ht);
  gdp_status s = pad_inputs(w, io->q, io->k, io->v, io->h0, pio.q, pio.k, pio.v, pio.h0, stream);
  if (s == GDP_OK) s = forward(&pp, &pio, stream, saved);
  if (s == GDP_OK && pv) s = crop_rows(io->o, pio.o, w.rows_q, w.V, w.VP, stream);
  if (s == GDP_OK && io->ht) s = crop_states(io->ht, pio.ht, w.states, w.K, w.V, w.KP, w.VP, stream);
  cudaFreeAsync(blk.block, stream);
  return s;
}

gdp_status backward_padded(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                           cudaStream_t stream, const void *saved) {
  const gdp_delta_product_problem pp = padded_problem(p);
  const Widths w = widths(p);
  const bool pk = w.KP != w.K, pv = w.VP != w.V;
  const size_t st = (size_t)w.states * w.KP * w.VP * 4, bq = pk ? (size_t)w.rows_q * w.KP * 2 : 0,
               bk = pk ? (size_t)w.rows_k * w.KP * 2 : 0, bv = pv ? (size_t)w.rows_k * w.VP * 2 : 0,
               bo = pv ? (size_t)w.rows_q * w.VP * 2 : 0;
  ScratchBlock blk;
  const size_t o_q = blk.take(bq), o_k = blk.take(bk), o_v = blk.take(bv), o_do = blk.take(bo),
               o_dq = blk.take(bq), o_dk = blk.take(bk), o_dv = blk.take(bv), o_h0 = blk.take(io->h0 ? st : 0),
               o_dht = blk.take(io->dht ? st : 0), o_dh0 = blk.take(io->dh0 ? st : 0);
  GDP_TRY(device_alloc(&blk.block, blk.off, stream));
  gdp_delta_product_backward_io pio = *io;
  if (pk) pio.q = blk.at(o_q), pio.k = blk.at(o_k), pio.dq = blk.at(o_dq), pio.dk = blk.at(o_dk);
  if (pv) pio.v = blk.at(o_v), pio.d_o = blk.at(o_do), pio.dv = blk.at(o_dv);
  pio.h0 = blk.at(o_h0);
  pio.dht = blk.at(o_dht);
  pio.dh0 = blk.at(o_dh0);
  gdp_status s = pad_inputs(w, io->q, io->k, io->v, io->h0, pio.q, pio.k, pio.v, pio.h0, stream);
  if (s == GDP_OK && pv) s = pad_rows((void *)pio.d_o, io->d_o, w.rows_q, w.V, w.VP, stream);
  if (s == GDP_OK && io->dht) s = pad_states((void *)pio.dht, io->dht, w.states, w.K, w.V, w.KP, w.VP, stream);
  if (s == GDP_OK) s = backward(&pp, &pio, stream, saved);
  if (s == GDP_OK && pk) s = crop_rows(io->dq, pio.dq, w.rows_q, w.K, w.KP, stream);
  if (s == GDP_OK && pk) s = crop_rows(io->dk, pio.dk, w.rows_k, w.K, w.KP, stream);
  if (s == GDP_OK && pv) s = crop_rows(io->dv, pio.dv, w.rows_k, w.V, w.VP, stream);
  if (s == GDP_OK && io->dh0) s = crop_states(io->dh0, pio.dh0, w.states, w.K, w.V, w.KP, w.VP, stream);
  cudaFreeAsync(blk.block, stream);
  return s;
}

/* ------------------------------------------------------------------ n = 5..8 */

bool needs_split(const gdp_delta_product_problem *p) {
  const TokenSplit ts = token_split(p->n, p->K);
  return ts.m != 1 || ts.np != p->n;
}

namespace {

/* The split problem: each token's n steps padded to np, run as m tokens of np / m steps
 * (token_split in plan.cuh) (cu_seqlens scaled by m into cu, which must
 * outlive the problem). */
struct Split {
  gdp_delta_product_problem p;
  std::vector<int64_t> cu;
  int64_t T;                  /* the problem's tokens */
  int n, np, m;               /* steps a token: given, padded; tokens per token */
  int wq, wo, wk, wv, wb, wg; /* elements per token row of q, o; per step row of k, v, beta; g */
  int gb;                     /* bytes of a gate element */
};
void split_problem(const gdp_delta_product_problem *p, Split *sp) {
  sp->T = p->T_total;
  sp->n = (int)p->n;
  const TokenSplit ts = token_split(p->n, p->K);
  sp->np = (int)ts.np;
  sp->m = (int)ts.m;
  sp->cu.resize((size_t)p->N + 1);
  for (int64_t s = 0; s <= p->N; s++) sp->cu[s] = p->cu_seqlens[s] * sp->m;
  sp->p = *p;
  sp->p.n = sp->np / sp->m;
  sp->p.T_total = p->T_total * sp->m;
  sp->p.cu_seqlens = sp->cu.data();
  sp->wq = (int)(p->H * p->K), sp->wo = (int)(p->H * p->V), sp->wk = sp->wq, sp->wv = sp->wo;
  sp->wb = sp->wg = (int)p->H;
  sp->gb = p->gate_f32 ? 4 : 2;
}

/* Token t's n step rows (of `width` elements) -> rows t np .. t np + n - 1 of np a token
 * (the padded steps zero: beta 0, k 0, v 0, an identity step), and back. */
gdp_status pad_steps(const Split &sp, void *dst, const void *src, int width, cudaStream_t s) {
  return window(dst, sp.np, width, src, sp.n, width, 0, sp.T, 2, s);
}
gdp_status crop_steps(const Split &sp, void *dst, const void *src, int width, cudaStream_t s) {
  return window(dst, sp.n, width, src, sp.np, width, 0, sp.T, 2, s);
}

/* q, g, k, v and beta, the inputs both directions rewrite, into the split buffers (q_s,
 * ...): the query on the last of a token's m, its gate on the first; the steps padded
 * where np > n (else k_s, v_s, beta_s unused). */
gdp_status split_inputs(const Split &sp, const void *q, const void *g, const void *k, const void *v,
                        const void *beta, const void *q_s, const void *g_s, const void *k_s, const void *v_s,
                        const void *beta_s, cudaStream_t stream) {
  const bool ps = sp.np != sp.n;
  gdp_status s = spread_tokens((void *)q_s, q, sp.T, sp.m, sp.wq, sp.m - 1, 2, stream);
  if (s == GDP_OK && g) s = spread_tokens((void *)g_s, g, sp.T, sp.m, sp.wg, 0, sp.gb, stream);
  if (s == GDP_OK && ps) s = pad_steps(sp, (void *)k_s, k, sp.wk, stream);
  if (s == GDP_OK && ps) s = pad_steps(sp, (void *)v_s, v, sp.wv, stream);
  if (s == GDP_OK && ps) s = pad_steps(sp, (void *)beta_s, beta, sp.wb, stream);
  return s;
}

}  // namespace

gdp_status forward_split(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                         cudaStream_t stream, void *saved) {
  Split sp;
  split_problem(p, &sp);
  const size_t TM = (size_t)sp.T * sp.m, TS = (size_t)sp.T * sp.np; /* rows of the split tokens, steps */
  const bool ps = sp.np != sp.n;
  ScratchBlock blk;
  const size_t o_q = blk.take(TM * sp.wq * 2), o_o = blk.take(TM * sp.wo * 2),
               o_g = blk.take(io->g ? TM * sp.wg * sp.gb : 0), o_k = blk.take(ps ? TS * sp.wk * 2 : 0),
               o_v = blk.take(ps ? TS * sp.wv * 2 : 0), o_b = blk.take(ps ? TS * sp.wb * 2 : 0);
  GDP_TRY(device_alloc(&blk.block, blk.off, stream));
  gdp_delta_product_forward_io sio = *io;
  sio.q = blk.at(o_q);
  sio.o = blk.at(o_o);
  sio.g = blk.at(o_g);
  if (ps) sio.k = blk.at(o_k), sio.v = blk.at(o_v), sio.beta = blk.at(o_b);
  gdp_status s = split_inputs(sp, io->q, io->g, io->k, io->v, io->beta, sio.q, sio.g, sio.k, sio.v, sio.beta, stream);
  if (s == GDP_OK) s = forward(&sp.p, &sio, stream, saved);
  if (s == GDP_OK) s = pick_tokens(io->o, sio.o, sp.T, sp.m, sp.wo, sp.m - 1, 2, stream);
  cudaFreeAsync(blk.block, stream);
  return s;
}

gdp_status backward_split(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                          cudaStream_t stream, const void *saved) {
  Split sp;
  split_problem(p, &sp);
  const size_t TM = (size_t)sp.T * sp.m, TS = (size_t)sp.T * sp.np;
  const bool ps = sp.np != sp.n;
  const size_t bq = TM * sp.wq * 2, bg = io->g ? TM * sp.wg * sp.gb : 0, bk = ps ? TS * sp.wk * 2 : 0,
               bv = ps ? TS * sp.wv * 2 : 0, bb = ps ? TS * sp.wb * 2 : 0;
  ScratchBlock blk;
  const size_t o_q = blk.take(bq), o_do = blk.take(TM * sp.wo * 2), o_g = blk.take(bg), o_dq = blk.take(bq),
               o_dg = blk.take(bg), o_k = blk.take(bk), o_v = blk.take(bv), o_b = blk.take(bb), o_dk = blk.take(bk),
               o_dv = blk.take(bv), o_db = blk.take(bb);
  GDP_TRY(device_alloc(&blk.block, blk.off, stream));
  gdp_delta_product_backward_io sio = *io;
  sio.q = blk.at(o_q);
  sio.d_o = blk.at(o_do);
  sio.g = blk.at(o_g);
  sio.dq = blk.at(o_dq);
  sio.dg = blk.at(o_dg);
  if (ps) {
    sio.k = blk.at(o_k), sio.v = blk.at(o_v), sio.beta = blk.at(o_b);
    sio.dk = blk.at(o_dk), sio.dv = blk.at(o_dv), sio.dbeta = blk.at(o_db);
  }
  gdp_status s = split_inputs(sp, io->q, io->g, io->k, io->v, io->beta, sio.q, sio.g, sio.k, sio.v, sio.beta, stream);
  if (s == GDP_OK) s = spread_tokens((void *)sio.d_o, io->d_o, sp.T, sp.m, sp.wo, sp.m - 1, 2, stream);
  if (s == GDP_OK) s = backward(&sp.p, &sio, stream, saved);
  if (s == GDP_OK) s = pick_tokens(io->dq, sio.dq, sp.T, sp.m, sp.wq, sp.m - 1, 2, stream);
  /* the token's gate sits on the first of its m: its gradient is that row's (the other
   * rows' gates are the constant 0 the split added) */
  if (s == GDP_OK && io->g) s = pick_tokens(io->dg, sio.dg, sp.T, sp.m, sp.wg, 0, sp.gb, stream);
  if (s == GDP_OK && ps) s = crop_steps(sp, io->dk, sio.dk, sp.wk, stream);
  if (s == GDP_OK && ps) s = crop_steps(sp, io->dv, sio.dv, sp.wv, stream);
  if (s == GDP_OK && ps) s = crop_steps(sp, io->dbeta, sio.dbeta, sp.wb, stream);
  cudaFreeAsync(blk.block, stream);
  return s;
}

/* ------------------------------------------------------------------ V = 256 */

bool needs_value_split(const gdp_delta_product_problem *p) { return p->V == 256; }

namespace {

/* The half problem (V / 2): the state's value columns evolve independently, so V = 256
 * is two V = 128 problems on the two column halves of v, d_o and the states (o, ht, dv,
 * dh0 their halves), with q, k, beta and g shared (their gradients the halves' sums). */
gdp_delta_product_problem value_half(const gdp_delta_product_problem *p) {
  gdp_delta_product_problem q = *p;
  q.V = p->V / 2;
  return q;
}

/* Half `part` of rows x V elements (`bytes` each) into / out of a rows x V/2 buffer. */
struct Halves {
  int64_t V, VH;
  int part;
  gdp_status in(void *dst, const void *src, int64_t rows, int bytes, cudaStream_t s) const {
    return rect(dst, VH, (const char *)src + part * VH * bytes, V, rows, (int)VH, false, bytes, s);
  }
  gdp_status out(void *dst, const void *src, int64_t rows, int bytes, cudaStream_t s) const {
    return rect((char *)dst + part * VH * bytes, V, src, VH, rows, (int)VH, false, bytes, s);
  }
};

}  // namespace

gdp_status forward_value_split(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                               cudaStream_t stream, void *saved) {
  const gdp_delta_product_problem ph = value_half(p);
  const int64_t V = p->V, VH = ph.V, rows_v = p->T_total * p->n * p->H, rows_o = p->T_total * p->H,
                rows_s = p->N * p->H * p->K;
  const size_t half_saved = saved ? saved_bytes(&ph) : 0;
  ScratchBlock blk;
  const size_t o_v = blk.take((size_t)rows_v * VH * 2), o_o = blk.take((size_t)rows_o * VH * 2),
               o_h0 = blk.take(io->h0 ? (size_t)rows_s * VH * 4 : 0), o_ht = blk.take(io->ht ? (size_t)rows_s * VH * 4 : 0);
  GDP_TRY(device_alloc(&blk.block, blk.off, stream));
  gdp_delta_product_forward_io hio = *io;
  hio.v = blk.at(o_v);
  hio.o = blk.at(o_o);
  hio.h0 = blk.at(o_h0);
  hio.ht = blk.at(o_ht);
  gdp_status s = GDP_OK;
  for (int part = 0; part < 2 && s == GDP_OK; part++) {
    const Halves hv{V, VH, part};
    s = hv.in((void *)hio.v, io->v, rows_v, 2, stream);
    if (s == GDP_OK && io->h0) s = hv.in((void *)hio.h0, io->h0, rows_s, 4, stream);
    if (s == GDP_OK) s = forward(&ph, &hio, stream, saved ? (char *)saved + part * half_saved : nullptr);
    if (s == GDP_OK) s = hv.out(io->o, hio.o, rows_o, 2, stream);
    if (s == GDP_OK && io->ht) s = hv.out(io->ht, hio.ht, rows_s, 4, stream);
  }
  cudaFreeAsync(blk.block, stream);
  return s;
}

gdp_status backward_value_split(const gdp_delta_product_problem *p, const gdp_delta_product_backward_io *io,
                                cudaStream_t stream, const void *saved) {
  const gdp_delta_product_problem ph = value_half(p);
  const int64_t V = p->V, VH = ph.V, rows_v = p->T_total * p->n * p->H, rows_o = p->T_total * p->H,
                rows_s = p->N * p->H * p->K, nq = p->T_total * p->H * p->K, nk = nq * p->n,
                nb = p->T_total * p->n * p->H, ng = p->T_total * p->H; /* elements of dq, dk, dbeta, dg */
  const int gb = p->gate_f32 ? 4 : 2;
  const size_t half_saved = saved ? saved_bytes(&ph) : 0;
  ScratchBlock blk;
  const size_t bs = (size_t)rows_s * VH * 4;
  const size_t o_v = blk.take((size_t)rows_v * VH * 2), o_do = blk.take((size_t)rows_o * VH * 2),
               o_dv = blk.take((size_t)rows_v * VH * 2), o_h0 = blk.take(io->h0 ? bs : 0),
               o_dht = blk.take(io->dht ? bs : 0), o_dh0 = blk.take(io->dh0 ? bs : 0),
               o_dq = blk.take((size_t)nq * 2), o_dk = blk.take((size_t)nk * 2), o_db = blk.take((size_t)nb * 2),
               o_dg = blk.take(io->g ? (size_t)ng * gb : 0);
  GDP_TRY(device_alloc(&blk.block, blk.off, stream));
  gdp_delta_product_backward_io hio = *io;
  hio.v = blk.at(o_v);
  hio.d_o = blk.at(o_do);
  hio.dv = blk.at(o_dv);
  hio.h0 = blk.at(o_h0);
  hio.dht = blk.at(o_dht);
  hio.dh0 = blk.at(o_dh0);
  gdp_status s = GDP_OK;
  for (int part = 0; part < 2 && s == GDP_OK; part++) {
    const Halves hv{V, VH, part};
    /* q, k, beta and g feed both halves: the first half's gradients go straight to the
     * outputs, the second's to scratch and are added (float32, one bf16 rounding) */
    if (part == 1) hio.dq = blk.at(o_dq), hio.dk = blk.at(o_dk), hio.dbeta = blk.at(o_db), hio.dg = blk.at(o_dg);
    s = hv.in((void *)hio.v, io->v, rows_v, 2, stream);
    if (s == GDP_OK) s = hv.in((void *)hio.d_o, io->d_o, rows_o, 2, stream);
    if (s == GDP_OK && io->h0) s = hv.in((void *)hio.h0, io->h0, rows_s, 4, stream);
    if (s == GDP_OK && io->dht) s = hv.in((void *)hio.dht, io->dht, rows_s, 4, stream);
    if (s == GDP_OK) s = backward(&ph, &hio, stream, saved ? (const char *)saved + part * half_saved : nullptr);
    if (s == GDP_OK) s = hv.out(io->dv, hio.dv, rows_v, 2, stream);
    if (s == GDP_OK && io->dh0) s = hv.out(io->dh0, hio.dh0, rows_s, 4, stream);
  }
  const int K = (int)p->K, H = (int)p->H;
  if (s == GDP_OK) s = rect(io->dq, K, hio.dq, K, rows_o, K, true, 2, stream);
  if (s == GDP_OK) s = rect(io->dk, K, hio.dk, K, rows_v, K, true, 2, stream);
  if (s == GDP_OK) s = rect(io->dbeta, H, hio.dbeta, H, p->T_total * p->n, H, true, 2, stream);
  if (s == GDP_OK && io->g) s = rect(io->dg, H, hio.dg, H, p->T_total, H, true, gb, stream);
  cudaFreeAsync(blk.block, stream);
  return s;
}

gdp_delta_product_problem kernel_problem(const gdp_delta_product_problem *p, std::vector<int64_t> &cu, int *parts) {
  gdp_delta_product_problem q = *p;
  if (needs_split(p)) {
    Split sp;
    split_problem(p, &sp);
    cu = sp.cu;
    q = sp.p;
    q.cu_seqlens = cu.data();
  }
  if (needs_padding(&q)) q = padded_problem(&q);
  *parts = 1;
  if (needs_value_split(&q)) q = value_half(&q), *parts = 2;
  return q;
}

}  // namespace chunked
}  // namespace gdpcu
