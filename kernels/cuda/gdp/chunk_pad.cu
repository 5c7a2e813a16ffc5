/*
 * chunk_pad.cu -- the fast path at K or V = 32: the problem run at 64 with zero columns.
 *
 * The chunk kernels tile K and V by 64 columns (the prep's W/U items, grad_wy's and
 * grad_state's key and value panels: K % 64 == 0 and V % 64 == 0 asserted there), so a
 * width of 32 runs in the width-64 instances: q, k (K) and v, d_o (V) are copied into
 * zero-filled 64-wide rows, h0 and dht into zero-filled 64 x 64 states, the padded
 * problem runs, and o, ht, dq, dk, dv and dh0 are cropped back.  Zero columns change no
 * value of the real ones: the l2 norms, every dot product over K (A, Pm, Qd S, W S) and
 * every state update add exact zeros, and the padded state columns stay zero; so the
 * cropped results are the problem's own (beta, g, dbeta and dg pass through untouched).
 *
 * Why not dedicated width-32 instances: those stages would each need a second tiling
 * (32-column W/U items, grad_wy's and grad_state's panels over 8 warps), several
 * thousand lines of kernel code that could not be measured against the padded run;
 * padding costs the zero columns' work (up to 4x the state pass's at K = V = 32) and
 * one copy of each padded tensor, against which the recurrent kernels took 47 ms at
 * H = 8, K = V = 32, n = 4, 256 x 512 tokens (docs/kernels.md, section 3.7).
 */
#include "plan.cuh"

namespace gdpcu {
namespace chunked {
namespace {

/* The kernels' width for a problem's K or V (32 runs at 64, others as they are). */
int64_t kernel_width(int64_t d) { return d == 32 ? 64 : d; }

/* dst[b][i][j] (B x dr x dc) = src[b][i][j] (B x sr x sc) where i < sr and j < sc, else
 * 0: a pad where dst is the larger, a crop where it is the smaller. */
template <class T>
__global__ void window_kernel(T *dst, int dr, int dc, const T *src, int sr, int sc, int64_t B) {
  const int64_t total = B * dr * dc;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int j = (int)(e % dc), i = (int)(e / dc % dr);
    const int64_t b = e / ((int64_t)dc * dr);
    dst[e] = i < sr && j < sc ? src[(b * sr + i) * sc + j] : T(0);
  }
}

/* One window_kernel launch.  bf16 moves as its bits (uint16_t: 0 is +0.0); states are
 * float32. */
template <class T>
gdp_status window(void *dst, int dr, int dc, const void *src, int sr, int sc, int64_t B, cudaStream_t s) {
  const int64_t total = B * dr * dc;
  if (total == 0) return GDP_OK;
  const int64_t blocks = (total + 255) / 256;
  window_kernel<T><<<(unsigned)(blocks > 65536 ? 65536 : blocks), 256, 0, s>>>((T *)dst, dr, dc, (const T *)src, sr,
                                                                               sc, B);
  GDP_CUDA_LAUNCHED("window_kernel");
  return GDP_OK;
}
/* rows x c (bf16) <-> rows x cp; states B x r x c (float) <-> B x rp x cp */
gdp_status pad_rows(void *dst, const void *src, int64_t rows, int c, int cp, cudaStream_t s) {
  return window<uint16_t>(dst, 1, cp, src, 1, c, rows, s);
}
gdp_status crop_rows(void *dst, const void *src, int64_t rows, int c, int cp, cudaStream_t s) {
  return window<uint16_t>(dst, 1, c, src, 1, cp, rows, s);
}
gdp_status pad_states(void *dst, const void *src, int64_t B, int r, int c, int rp, int cp, cudaStream_t s) {
  return window<float>(dst, rp, cp, src, r, c, B, s);
}
gdp_status crop_states(void *dst, const void *src, int64_t B, int r, int c, int rp, int cp, cudaStream_t s) {
  return window<float>(dst, r, c, src, rp, cp, B, s);
}

/* The padded buffers of one call, carved from one stream-ordered allocation. */
struct PadBlock {
  void *block = nullptr;
  size_t off = 0;
  /* reserve bytes (0: nullptr); the addresses are filled in by carve() */
  size_t take(size_t bytes) {
    const size_t o = off;
    off = align128(off + bytes);
    return bytes ? o : (size_t)-1;
  }
  void *at(size_t o) const { return o == (size_t)-1 ? nullptr : (char *)block + o; }
};

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
  w.KP = (int)kernel_width(p->K);
  w.VP = (int)kernel_width(p->V);
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

bool needs_padding(const gdp_delta_product_problem *p) { return p->K == 32 || p->V == 32; }

gdp_delta_product_problem padded_problem(const gdp_delta_product_problem *p) {
  gdp_delta_product_problem q = *p;
  q.K = kernel_width(p->K);
  q.V = kernel_width(p->V);
  return q;
}

gdp_status forward_padded(const gdp_delta_product_problem *p, const gdp_delta_product_forward_io *io,
                          cudaStream_t stream, void *saved) {
  const gdp_delta_product_problem pp = padded_problem(p);
  const Widths w = widths(p);
  const bool pk = w.KP != w.K, pv = w.VP != w.V;
  const size_t st = (size_t)w.states * w.KP * w.VP * 4;
  PadBlock blk;
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
  PadBlock blk;
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

}  // namespace chunked
}  // namespace gdpcu
