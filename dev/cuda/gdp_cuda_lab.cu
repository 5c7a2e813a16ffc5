/*
 * gdp_cuda_lab.cu -- the CUDA GDP operator's kernel lab (llm.c's dev/cuda idea): a table
 * of problems through the library's CUDA entry points, compared with the float64 oracle,
 * then timed.  What a kernel developer runs between an edit and a benchmark.
 *
 *   gdp_cuda_lab check [VARIANT...] [--seed S] [--quick] [--value-block W]
 *       The table below (packed sequences with empty ones, n = 1..8, gated and ungated,
 *       K x V in {64x64, 128x128, 32x32, 32x64, 128x32, 64x256, 48x96, 96x48, 16x40} (n = 5..8:
 *       those of at most 64 x 64), with and without h0
 *       and dht, a case table of K or V = 32 at n = 3..8 and V = 256 at odd lengths,
 *       a 2600-token pair of sequences at K = V = 128 and a 1000-token pair at
 *       H = 8, K = V = 32, n = 4) in f32 and bf16; per run one line of relative
 *       errors (o, ht and every gradient) against the oracle, a "!" past the dtype's
 *       tolerance (f32 1e-4, bf16 1e-2; dbeta, dg, dh0 2e-2).  Ends with a summary line; exit status 0 when
 *       every run is within tolerance, 1 otherwise.  The ctest dev.lab_check.
 *   gdp_cuda_lab bench B T n [VARIANT...] [--reps R] [--value-block W] [--json FILE]
 *                          [--heads H] [--K K] [--V V]
 *       bf16 at B x T, H = 16, K = V = 128 (or --heads, --K, --V), gated, l2norm in the
 *       kernel: the median
 *       forward, backward and forward+backward time of R calls (CUDA events), then each
 *       variant's outputs and gradients against the first one's at that size.  Under
 *       GDP_CUDA_PROFILE=1 (the core's switch: the operator synchronises between its
 *       kernels and prints each kernel's time to stderr) it makes one warm-up and one
 *       profiled call per variant instead of the timed ones.  --json appends one line per
 *       variant.  The first timed (or the profiled) forward and backward of each variant
 *       lies between cudaProfilerStart and cudaProfilerStop, so that a profiler started
 *       with capture off (ncu --profile-from-start off, nsys --capture-range=cudaProfilerApi)
 *       records exactly one call of each.
 *
 * Variants (default: all three for check; chunk and chunk_saving for bench):
 *   chunk         algorithm CHUNK: the fast chunked path, its backward recomputing
 *   chunk_saving  the same with save for backward: gdp_cuda_delta_product_save_plan, the forward
 *                 keeping its block (gdp_cuda_delta_product_forward_ex), the backward reading it
 *   recurrent     algorithm RECURRENT: the recurrent kernels (f32 and bf16)
 * A variant runs the problems the library says it takes: the chunked ones where the save
 * plan of the CHUNK problem keeps a block (only the fast path does), the recurrent one
 * where gdp_cuda_delta_product_supported says so.  --value-block sets the problem's value_block
 * (0: the fast path's own choice; 16, 32 or 64).
 *
 * The oracle is the library's: gdp_cpu_delta_product_{fwd,bwd}_recurrent_f64 on inputs normalised
 * by gdp_cpu_l2norm_fwd_f64, the norm's backward by gdp_cpu_l2norm_bwd_f64.  Inputs come
 * from the library's Philox stream (kernels/philox.h).  Exit status 77 (ctest: skipped)
 * when there is no CUDA device.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

extern "C" {
#include "cpu/gdp_cpu.h"
#include "cuda/gdp_cuda.h"
#include "kernel_status.h"
}
#include "philox.h"

using std::vector;

#define CK(expr)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (expr);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
              __LINE__, #expr);                                                         \
      exit(2);                                                                          \
    }                                                                                   \
  } while (0)

static const double kEps = 1e-6; /* the kernels' l2norm epsilon (gdp_problem.h) */

/* ------------------------------------------------------------------ random numbers */

/* The library's Philox stream read in order: words for shapes, normals a block at a time. */
struct Rng {
  uint64_t seed, block = 0;
  uint32_t w[4];
  int used = 4;
  explicit Rng(uint64_t s) : seed(s) {}
  uint32_t next() {
    if (used == 4) {
      gdp_philox_stream_block(seed, block++, w);
      used = 0;
    }
    return w[used++];
  }
  double normal() {
    uint32_t b[4];
    gdp_philox_stream_block(seed, block++, b);
    return gdp_philox_std_normal(b, 0);
  }
};

static double round_bf16(double x) { return (double)__bfloat162float(__float2bfloat16((float)x)); }

/* ------------------------------------------------------------------ problems */

struct Prob {
  vector<int64_t> cu; /* N+1 */
  int64_t H, K, V, n;
  bool gated, has_h0, has_dht;
  double scale;
  double beta_max = 1; /* beta in (0, beta_max): 2 gives the steps negative eigenvalues */
  int64_t N() const { return (int64_t)cu.size() - 1; }
  int64_t T() const { return cu.back(); }
};

struct Inputs {
  vector<double> q, k, v, g, beta, h0, d_o, dht;
};
struct Outputs {
  vector<double> o, ht, dq, dk, dv, dbeta, dg, dh0;
};

/* Random sequence lengths, heads and optional states for a K x V problem. */
static Prob random_prob(Rng &r, int64_t K, int64_t V, int64_t n, bool gated, bool packed) {
  Prob P;
  P.H = 1 + (int64_t)(r.next() % 3);
  P.K = K;
  P.V = V;
  P.n = n;
  P.gated = gated;
  P.has_h0 = r.next() % 2;
  P.has_dht = r.next() % 2;
  P.scale = 1.0 / sqrt((double)K);
  P.cu.push_back(0);
  if (packed) { /* 2..5 sequences, a quarter of them empty */
    const int64_t N = 2 + (int64_t)(r.next() % 4);
    for (int64_t s = 0; s < N; s++) {
      const int64_t L = (r.next() % 4 == 0) ? 0 : 1 + (int64_t)(r.next() % 150);
      P.cu.push_back(P.cu.back() + L);
    }
    if (P.T() == 0) P.cu.back() = 1 + (int64_t)(r.next() % 150); /* never all empty */
  } else {
    const int64_t B = 1 + (int64_t)(r.next() % 2), L = 64 + (int64_t)(r.next() % 100);
    for (int64_t s = 0; s < B; s++) P.cu.push_back(P.cu.back() + L);
  }
  return P;
}

/* q, k, v, d_o standard normal; beta = beta_max sigmoid(z); g = logsigmoid(z + 2); h0, dht with
 * sd 0.5.  Token tensors rounded to bf16 when the run is bf16, so both sides see the
 * same values. */
static void make_inputs(const Prob &P, Rng &r, bool bf16_inputs, Inputs &in) {
  const int64_t T = P.T(), H = P.H, K = P.K, V = P.V, n = P.n, N = P.N();
  enum { NORMAL, BETA, GATE, STATE };
  /* Element j of a tensor is the normal of Philox block (its first block + j), as
   * r.normal() would draw them in order, so the threads' slices give the sequential
   * values (bench sizes draw hundreds of millions: a minute on one thread). */
  const unsigned nthreads = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  auto fill = [&](vector<double> &x, int64_t count, int kind) {
    x.resize(count);
    const uint64_t b0 = r.block;
    r.block += (uint64_t)count;
    auto slice = [&](int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; j++) {
        uint32_t b[4];
        gdp_philox_stream_block(r.seed, b0 + (uint64_t)j, b);
        double z = gdp_philox_std_normal(b, 0);
        if (kind == BETA) z = P.beta_max / (1.0 + exp(-z));
        else if (kind == GATE) z = -log1p(exp(-(z + 2.0)));
        else if (kind == STATE) z *= 0.5;
        x[j] = bf16_inputs && kind != STATE ? round_bf16(z) : z;
      }
    };
    if (count < (1 << 20) || nthreads == 1) return slice(0, count);
    vector<std::thread> pool;
    const int64_t per = (count + nthreads - 1) / nthreads;
    for (unsigned t = 0; t < nthreads; t++)
      pool.emplace_back(slice, std::min(count, t * per), std::min(count, (t + 1) * per));
    for (auto &th : pool) th.join();
  };
  fill(in.q, T * H * K, NORMAL);
  fill(in.k, T * n * H * K, NORMAL);
  fill(in.v, T * n * H * V, NORMAL);
  fill(in.beta, T * n * H, BETA);
  if (P.gated) fill(in.g, T * H, GATE); else in.g.clear();
  if (P.has_h0) fill(in.h0, N * H * K * V, STATE); else in.h0.clear();
  fill(in.d_o, T * H * V, NORMAL);
  if (P.has_dht) fill(in.dht, N * H * K * V, STATE); else in.dht.clear();
}

static int g_value_block = 0; /* --value-block */

static gdp_delta_product_problem to_problem(const Prob &P, int dtype, int algorithm, int l2norm) {
  gdp_delta_product_problem p;
  memset(&p, 0, sizeof p);
  p.T_total = P.T();
  p.N = P.N();
  p.cu_seqlens = P.cu.data();
  p.H = P.H;
  p.K = P.K;
  p.V = P.V;
  p.n = P.n;
  p.scale = P.scale;
  p.chunk_size = 0; /* the backend's own */
  p.num_threads = (int)std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  p.dtype = dtype;
  p.algorithm = algorithm;
  p.l2norm_in_kernel = l2norm;
  p.value_block = g_value_block;
  return p;
}

/* ------------------------------------------------------------------ float64 oracle */

static void die_oracle(const char *what) {
  fprintf(stderr, "oracle %s failed: %s\n", what, gdp_last_error());
  exit(2);
}

/* The operator with l2norm on q and k, from the library's float64 kernels. */
static void reference(const Prob &P, const Inputs &in, Outputs &out) {
  const int64_t T = P.T(), H = P.H, K = P.K, V = P.V, n = P.n, N = P.N();
  gdp_delta_product_problem p = to_problem(P, GDP_DTYPE_F64, GDP_ALGO_RECURRENT, 0);
  vector<double> qn(in.q.size()), kn(in.k.size());
  gdp_cpu_l2norm_fwd_f64(T * H, K, kEps, in.q.data(), qn.data(), p.num_threads);
  gdp_cpu_l2norm_fwd_f64(T * n * H, K, kEps, in.k.data(), kn.data(), p.num_threads);
  out.o.assign(T * H * V, 0);
  out.ht.assign(N * H * K * V, 0);
  gdp_delta_product_forward_io f = {qn.data(), kn.data(), in.v.data(), P.gated ? in.g.data() : NULL,
                      in.beta.data(), P.has_h0 ? in.h0.data() : NULL, out.o.data(), out.ht.data()};
  if (gdp_cpu_delta_product_forward_recurrent_f64(&p, &f) != GDP_OK) die_oracle("forward");
  vector<double> dqn(T * H * K), dkn(T * n * H * K);
  out.dv.assign(T * n * H * V, 0);
  out.dbeta.assign(T * n * H, 0);
  out.dg.assign(P.gated ? T * H : 0, 0);
  out.dh0.assign(N * H * K * V, 0);
  gdp_delta_product_backward_io b = {qn.data(), kn.data(), in.v.data(), P.gated ? in.g.data() : NULL,
                      in.beta.data(), P.has_h0 ? in.h0.data() : NULL, in.d_o.data(),
                      P.has_dht ? in.dht.data() : NULL, dqn.data(), dkn.data(), out.dv.data(),
                      out.dbeta.data(), P.gated ? out.dg.data() : NULL, out.dh0.data()};
  if (gdp_cpu_delta_product_backward_recurrent_f64(&p, &b) != GDP_OK) die_oracle("backward");
  out.dq.assign(T * H * K, 0);
  out.dk.assign(T * n * H * K, 0);
  gdp_cpu_l2norm_bwd_f64(T * H, K, kEps, in.q.data(), dqn.data(), out.dq.data(), p.num_threads);
  gdp_cpu_l2norm_bwd_f64(T * n * H, K, kEps, in.k.data(), dkn.data(), out.dk.data(), p.num_threads);
}

/* ------------------------------------------------------------------ comparison */

/* ||x - ref|| / ||ref||; NaN when x holds a NaN (the outputs start poisoned). */
static double rel_err(const vector<double> &x, const vector<double> &ref) {
  if (x.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); i++) {
    if (!(x[i] == x[i])) return NAN;
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return sqrt(num / den);
}

struct Named {
  const char *name;
  const vector<double> *got, *ref;
};

/* ops.tolerance's bounds (docs/design.md section 6): bf16 dbeta, dg and dh0 are sums of
 * cancelling products (over K, over the sequence) and are held to 2e-2. */
static double tolerance(int dtype, const char *name) {
  if (dtype != GDP_DTYPE_BF16) return 1e-4;
  const bool summed = name && (!strcmp(name, "dbeta") || !strcmp(name, "dg") || !strcmp(name, "dh0"));
  return summed ? 2e-2 : 1e-2;
}

/* One line: the label, then name=error per tensor, "!" past its tolerance; counts those in *fails. */
static void compare_all(const char *label, const vector<Named> &items, int dtype, int *fails) {
  printf("%-52s", label);
  for (auto &it : items) {
    if (it.ref->empty()) continue;
    const double e = rel_err(*it.got, *it.ref);
    const bool bad = !(e <= tolerance(dtype, it.name));
    if (bad) (*fails)++;
    printf(" %s=%.1e%s", it.name, e, bad ? "!" : "");
  }
  printf("\n");
  fflush(stdout);
}

static vector<Named> all_named(const Outputs &g, const Outputs &r) {
  return {{"o", &g.o, &r.o},    {"ht", &g.ht, &r.ht}, {"dq", &g.dq, &r.dq},
          {"dk", &g.dk, &r.dk}, {"dv", &g.dv, &r.dv}, {"dbeta", &g.dbeta, &r.dbeta},
          {"dg", &g.dg, &r.dg}, {"dh0", &g.dh0, &r.dh0}};
}

/* ------------------------------------------------------------------ device buffers */

struct DBuf {
  void *p = nullptr;
  size_t bytes = 0;
  void alloc(size_t nbytes) {
    bytes = nbytes;
    if (nbytes) CK(cudaMalloc(&p, nbytes));
  }
  DBuf() = default;
  DBuf(const DBuf &) = delete;
  DBuf &operator=(const DBuf &) = delete;
  ~DBuf() {
    if (p) cudaFree(p);
  }
};

static size_t esize(int dtype) { return dtype == GDP_DTYPE_BF16 ? 2 : 4; }

static void upload(DBuf &b, const vector<double> &x, int dtype) {
  b.alloc(x.size() * esize(dtype));
  if (x.empty()) return;
  if (dtype == GDP_DTYPE_BF16) {
    vector<__nv_bfloat16> h(x.size());
    for (size_t i = 0; i < x.size(); i++) h[i] = __float2bfloat16((float)x[i]);
    CK(cudaMemcpy(b.p, h.data(), b.bytes, cudaMemcpyHostToDevice));
  } else {
    vector<float> h(x.begin(), x.end());
    CK(cudaMemcpy(b.p, h.data(), b.bytes, cudaMemcpyHostToDevice));
  }
}
/* All bits set: NaN in f32 and bf16, so an output the kernels never write shows. */
static void alloc_poisoned(DBuf &b, size_t count, int dtype) {
  b.alloc(count * esize(dtype));
  if (b.bytes) CK(cudaMemset(b.p, 0xFF, b.bytes));
}
static void download(const DBuf &b, size_t count, int dtype, vector<double> &x) {
  x.resize(count);
  if (!count) return;
  if (dtype == GDP_DTYPE_BF16) {
    vector<__nv_bfloat16> h(count);
    CK(cudaMemcpy(h.data(), b.p, count * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; i++) x[i] = __bfloat162float(h[i]);
  } else {
    vector<float> h(count);
    CK(cudaMemcpy(h.data(), b.p, count * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; i++) x[i] = h[i];
  }
}

/* A problem's buffers on the device: token tensors in dtype, states in float32. */
struct DevProblem {
  DBuf q, k, v, g, beta, h0, d_o, dht;
  DBuf o, ht, dq, dk, dv, dbeta, dg, dh0;
};

static void dev_inputs(const Prob &P, const Inputs &in, int dtype, DevProblem &d) {
  upload(d.q, in.q, dtype);
  upload(d.k, in.k, dtype);
  upload(d.v, in.v, dtype);
  upload(d.g, in.g, dtype);
  upload(d.beta, in.beta, dtype);
  upload(d.h0, in.h0, GDP_DTYPE_F32);
  upload(d.d_o, in.d_o, dtype);
  upload(d.dht, in.dht, GDP_DTYPE_F32);
  const int64_t T = P.T(), H = P.H, K = P.K, V = P.V, n = P.n, N = P.N();
  alloc_poisoned(d.o, T * H * V, dtype);
  alloc_poisoned(d.ht, N * H * K * V, GDP_DTYPE_F32);
  alloc_poisoned(d.dq, T * H * K, dtype);
  alloc_poisoned(d.dk, T * n * H * K, dtype);
  alloc_poisoned(d.dv, T * n * H * V, dtype);
  alloc_poisoned(d.dbeta, T * n * H, dtype);
  alloc_poisoned(d.dg, P.gated ? T * H : 0, dtype);
  alloc_poisoned(d.dh0, N * H * K * V, GDP_DTYPE_F32);
}

static gdp_delta_product_forward_io fwd_io(const Prob &P, DevProblem &d, bool want_ht) {
  gdp_delta_product_forward_io io = {d.q.p, d.k.p, d.v.p, P.gated ? d.g.p : NULL, d.beta.p,
                       P.has_h0 ? d.h0.p : NULL, d.o.p, want_ht ? d.ht.p : NULL};
  return io;
}
static gdp_delta_product_backward_io bwd_io(const Prob &P, DevProblem &d, bool want_dh0) {
  gdp_delta_product_backward_io io = {d.q.p, d.k.p, d.v.p, P.gated ? d.g.p : NULL, d.beta.p,
                       P.has_h0 ? d.h0.p : NULL, d.d_o.p, P.has_dht ? d.dht.p : NULL,
                       d.dq.p, d.dk.p, d.dv.p, d.dbeta.p, P.gated ? d.dg.p : NULL,
                       want_dh0 ? d.dh0.p : NULL};
  return io;
}

/* ------------------------------------------------------------------ variants */

enum Variant { CHUNK, CHUNK_SAVING, RECURRENT, NVARIANTS };
static const char *kVariantName[NVARIANTS] = {"chunk", "chunk_saving", "recurrent"};

static int parse_variant(const char *s) {
  for (int v = 0; v < NVARIANTS; v++)
    if (!strcmp(s, kVariantName[v])) return v;
  return -1;
}

/* One variant on one problem: the library's entry points, and for chunk_saving the block
 * its forward keeps (grown as needed, reused; every call runs on the default stream). */
struct Runner {
  int variant;
  gdp_delta_product_problem p;
  int saved_variant = 0;
  size_t saved_bytes = 0;
  static void *block;
  static size_t block_cap;

  Runner(int v, const Prob &P, int dtype)
      : variant(v), p(to_problem(P, dtype, v == RECURRENT ? GDP_ALGO_RECURRENT : GDP_ALGO_CHUNK, 1)) {}

  /* Whether the library takes this problem in this variant (no error left behind). */
  bool takes() {
    if (variant == RECURRENT) return gdp_cuda_delta_product_supported(&p) != 0;
    return gdp_cuda_delta_product_save_plan(&p, &saved_variant, &saved_bytes) == GDP_OK && saved_bytes > 0;
  }
  void *saved() {
    if (variant != CHUNK_SAVING) return nullptr;
    if (saved_bytes > block_cap) {
      if (block) CK(cudaFree(block));
      CK(cudaMalloc(&block, saved_bytes));
      block_cap = saved_bytes;
    }
    return block;
  }
  gdp_status forward(const gdp_delta_product_forward_io *io) {
    if (variant == CHUNK_SAVING) return gdp_cuda_delta_product_forward_ex(&p, io, nullptr, saved());
    return gdp_cuda_delta_product_forward(&p, io, nullptr);
  }
  gdp_status backward(const gdp_delta_product_backward_io *io) {
    if (variant == CHUNK_SAVING) return gdp_cuda_delta_product_backward_ex(&p, io, nullptr, saved_variant, saved());
    return gdp_cuda_delta_product_backward(&p, io, nullptr);
  }
};
void *Runner::block = nullptr;
size_t Runner::block_cap = 0;

/* Forward then backward; false (the library's message printed) when a call fails. */
static bool run_fwd_bwd(Runner &r, const gdp_delta_product_forward_io *f, const gdp_delta_product_backward_io *b, const char *label) {
  gdp_status st = r.forward(f);
  if (st == GDP_OK) st = r.backward(b);
  if (st != GDP_OK) {
    printf("%-52s FAILED (status %d): %s\n", label, (int)st, gdp_last_error());
    fflush(stdout);
    return false;
  }
  return true;
}

static void download_all(const Prob &P, DevProblem &d, int dtype, Outputs &got) {
  const int64_t T = P.T(), H = P.H, K = P.K, V = P.V, n = P.n, N = P.N();
  CK(cudaDeviceSynchronize());
  download(d.o, T * H * V, dtype, got.o);
  download(d.ht, N * H * K * V, GDP_DTYPE_F32, got.ht);
  download(d.dq, T * H * K, dtype, got.dq);
  download(d.dk, T * n * H * K, dtype, got.dk);
  download(d.dv, T * n * H * V, dtype, got.dv);
  download(d.dbeta, T * n * H, dtype, got.dbeta);
  download(d.dg, P.gated ? T * H : 0, dtype, got.dg);
  download(d.dh0, N * H * K * V, GDP_DTYPE_F32, got.dh0);
}

/* ------------------------------------------------------------------ check */

static const char *dtype_name(int dtype) { return dtype == GDP_DTYPE_BF16 ? "bf16" : "f32"; }

struct Tally {
  int runs[NVARIANTS] = {0}, skipped[NVARIANTS] = {0};
  int fails = 0;   /* tensors over tolerance */
  int errors = 0;  /* calls that failed */
};

/* Every variant on one problem in one dtype, against the oracle. */
static void check_problem(const Prob &P, const char *shape, Rng &r, int dtype,
                          const vector<int> &variants, Tally &t) {
  Inputs in;
  make_inputs(P, r, dtype == GDP_DTYPE_BF16, in); /* whichever variants run: same table */
  Outputs ref;
  bool have_ref = false;
  for (int var : variants) {
    Runner run(var, P, dtype);
    if (!run.takes()) {
      t.skipped[var]++;
      continue;
    }
    if (!have_ref) reference(P, in, ref), have_ref = true;
    DevProblem d; /* fresh, poisoned outputs per variant */
    dev_inputs(P, in, dtype, d);
    char label[160];
    snprintf(label, sizeof label, "%-12s %-4s %s", kVariantName[var], dtype_name(dtype), shape);
    gdp_delta_product_forward_io f = fwd_io(P, d, true);
    gdp_delta_product_backward_io b = bwd_io(P, d, true);
    t.runs[var]++;
    if (!run_fwd_bwd(run, &f, &b, label)) {
      t.errors++;
      continue;
    }
    Outputs got;
    download_all(P, d, dtype, got);
    compare_all(label, all_named(got, ref), dtype, &t.fails);
  }
}

/* A gated pair of sequences of L0 and L1 tokens with h0 and dht. */
static void check_long(int64_t H, int64_t K, int64_t V, int64_t n, int64_t L0, int64_t L1, Rng &r,
                       const vector<int> &variants, Tally &t) {
  Prob P;
  P.H = H; P.K = K; P.V = V; P.n = n; P.gated = true; P.has_h0 = true; P.has_dht = true;
  P.scale = 1.0 / sqrt((double)K);
  P.cu = {0, L0, L0 + L1};
  char shape[96];
  snprintf(shape, sizeof shape, "long n=%lld g=1 K=%lld V=%lld H=%lld N=2 T=%lld", (long long)n, (long long)K,
           (long long)V, (long long)H, (long long)P.T());
  for (int dtype : {GDP_DTYPE_F32, GDP_DTYPE_BF16}) check_problem(P, shape, r, dtype, variants, t);
}

static int lab_check(const vector<int> &variants, uint64_t seed, bool quick) {
  Rng r(seed);
  Tally t;
  printf("== check: relative error vs the float64 oracle (seed %llu); tolerance f32 %.0e, bf16 %.0e (dbeta, dg, dh0 %.0e)\n",
         (unsigned long long)seed, tolerance(GDP_DTYPE_F32, "o"), tolerance(GDP_DTYPE_BF16, "o"),
         tolerance(GDP_DTYPE_BF16, "dg"));
  /* 32 x 32, 32 x 64, 128 x 32: the fast path's width-32 instances; 64 x 256 its value halves;
   * 48 x 96, 96 x 48, 16 x 40: zero-padded to 64 x 128, 128 x 64, 32 x 64; n = 5..8 its
   * split tokens (chunk_shapes.cu) */
  const int64_t shapes[][2] = {{64, 64}, {128, 128}, {32, 32}, {32, 64}, {128, 32},
                               {64, 256}, {48, 96}, {96, 48}, {16, 40}};
  for (int n = 1; n <= 8; n++)
    for (int gated = 0; gated < 2; gated++)
      for (auto &sh : shapes) {
        if (quick && sh[0] != 64 && sh[0] != 48 && sh[0] != 32) continue;
        /* n = 5..8 at the small widths only: the float64 oracle's time grows with n K V,
         * and the ctest has 300 s (the case table covers K = 128 at n = 7) */
        if (n > 4 && sh[0] * sh[1] > 64 * 64) continue;
        Prob P = random_prob(r, sh[0], sh[1], n, gated, (r.next() % 4) != 0);
        char shape[96];
        snprintf(shape, sizeof shape, "n=%d g=%d K=%-3lld V=%-3lld H=%lld N=%lld T=%lld", n, gated,
                 (long long)P.K, (long long)P.V, (long long)P.H, (long long)P.N(), (long long)P.T());
        for (int dtype : {GDP_DTYPE_F32, GDP_DTYPE_BF16}) check_problem(P, shape, r, dtype, variants, t);
      }
  /* The width-32 instances behind the other rewrites and at the row counts that end a
   * 32-wide load or norm round inside a chunk: n = 5..8 (2 split tokens of 3 or 4 steps,
   * 8 a chunk, with their zero-query and zero-gate rows and identity steps), n = 3, 4
   * (C = 48; C + TC = 80), K = 32 with V = 256 (two halves), the mixed widths; odd
   * lengths, packed with empty sequences, h0 and dht, beta in (0, 2) -- the first is the
   * op case table's K = V = 32 n = 7 case. */
  struct Case {
    int64_t H, K, V, n;
    vector<int64_t> cu;
    bool gated, h0, dht;
    double beta_max;
  };
  const Case cases[] = {
      {8, 32, 32, 7, {0, 40}, true, false, false, 2},        {8, 32, 32, 5, {0, 13, 13, 41}, true, true, true, 2},
      {8, 32, 32, 6, {0, 0, 19, 45}, false, false, true, 2}, {8, 32, 32, 8, {0, 17, 17, 51}, true, true, false, 1},
      {2, 32, 64, 7, {0, 29, 30}, true, true, true, 2},      {2, 64, 32, 5, {0, 37}, true, false, true, 2},
      {2, 32, 256, 6, {0, 40}, false, true, false, 1},       {2, 32, 256, 3, {0, 21, 21, 71}, true, true, true, 2},
      {8, 32, 32, 3, {0, 1, 60, 133}, true, true, true, 2},  {3, 32, 128, 4, {0, 77}, true, false, true, 1},
      {2, 128, 32, 3, {0, 45, 46}, true, true, false, 2},    {8, 32, 32, 4, {0, 0, 37, 37, 151}, true, true, true, 2},
  };
  for (const Case &c : cases) {
    Prob P;
    P.H = c.H; P.K = c.K; P.V = c.V; P.n = c.n; P.cu = c.cu;
    P.gated = c.gated; P.has_h0 = c.h0; P.has_dht = c.dht; P.beta_max = c.beta_max;
    P.scale = 1.0 / sqrt((double)c.K);
    char shape[96];
    snprintf(shape, sizeof shape, "case n=%lld g=%d K=%-3lld V=%-3lld H=%lld N=%lld T=%lld b<%g", (long long)c.n,
             (int)c.gated, (long long)c.K, (long long)c.V, (long long)c.H, (long long)P.N(), (long long)P.T(),
             c.beta_max);
    for (int dtype : {GDP_DTYPE_F32, GDP_DTYPE_BF16}) check_problem(P, shape, r, dtype, variants, t);
  }
  /* long pairs of sequences: many chunks through the state passes; the second at
   * DeltaProduct's state-tracking heads (K = V = 32) */
  check_long(2, 128, 128, 2, quick ? 700 : 2000, quick ? 300 : 600, r, variants, t);
  check_long(8, 32, 32, 4, quick ? 300 : 600, quick ? 150 : 400, r, variants, t);
  int total = 0;
  printf("check: %s (", t.fails || t.errors ? "FAIL" : "ok");
  for (size_t i = 0; i < variants.size(); i++) {
    const int v = variants[i];
    total += t.runs[v];
    printf("%s%s %d runs, %d not taken", i ? "; " : "", kVariantName[v], t.runs[v], t.skipped[v]);
  }
  printf("; %d tensors over tolerance, %d failed calls)\n", t.fails, t.errors);
  if (total == 0) printf("check: FAIL (no variant took any problem)\n");
  fflush(stdout);
  return t.fails || t.errors || total == 0 ? 1 : 0;
}

/* ------------------------------------------------------------------ bench */

static double median(vector<double> x) {
  std::sort(x.begin(), x.end());
  return x.empty() ? 0 : x[x.size() / 2];
}

static float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

static int lab_bench(int64_t B, int64_t T, int64_t n, int64_t H, int64_t K, int64_t V, const vector<int> &variants,
                     int reps, const char *json_path) {
  Prob P;
  P.H = H; P.K = K; P.V = V; P.n = n; P.gated = true; P.has_h0 = false; P.has_dht = false;
  P.scale = 1.0 / sqrt((double)K);
  P.cu.push_back(0);
  for (int64_t b = 0; b < B; b++) P.cu.push_back(P.cu.back() + T);
  Rng r(777 + B * 131 + T * 7 + n);
  Inputs in;
  make_inputs(P, r, true, in);
  DevProblem d;
  dev_inputs(P, in, GDP_DTYPE_BF16, d);
  gdp_delta_product_forward_io f = fwd_io(P, d, false);
  gdp_delta_product_backward_io b = bwd_io(P, d, false);
  const bool profiling = gdp_debug_profile_kernels() != 0;
  cudaEvent_t e0, e1, e2;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&e2));
  FILE *js = json_path ? fopen(json_path, "a") : NULL;
  if (json_path && !js) fprintf(stderr, "cannot open %s: no JSON written\n", json_path);
  printf("== bench bf16 B=%lld T=%lld n=%lld H=%lld K=%lld V=%lld gated l2norm value_block=%d (%s)\n",
         (long long)B, (long long)T, (long long)n, (long long)H, (long long)K, (long long)V, g_value_block,
         profiling ? "GDP_CUDA_PROFILE: one profiled call each, per-kernel times on stderr" : "median of the reps");
  int status = 0;
  vector<Outputs> outs;
  vector<int> ran;
  for (int var : variants) {
    Runner run(var, P, GDP_DTYPE_BF16);
    if (!run.takes()) {
      printf("  %-12s does not take this problem\n", kVariantName[var]);
      continue;
    }
    const char *name = kVariantName[var];
    if (profiling) fprintf(stderr, "-- %s: the warm-up forward and backward\n", name), fflush(stderr);
    if (!run_fwd_bwd(run, &f, &b, name)) {
      status = 1;
      continue;
    }
    CK(cudaDeviceSynchronize());
    if (profiling) {
      fprintf(stderr, "-- %s B=%lld T=%lld n=%lld: the profiled forward and backward\n", name,
              (long long)B, (long long)T, (long long)n);
      fflush(stderr);
      CK(cudaProfilerStart());
      if (!run_fwd_bwd(run, &f, &b, name)) status = 1;
      CK(cudaDeviceSynchronize());
      CK(cudaProfilerStop());
      fflush(stderr);
    } else {
      const int myreps = var == RECURRENT ? std::max(2, reps / 10) : reps;
      if (run_fwd_bwd(run, &f, &b, name)) CK(cudaDeviceSynchronize()); /* second warm-up */
      vector<double> tf, tb, tfb;
      for (int i = 0; i < myreps; i++) {
        if (i == 0) CK(cudaProfilerStart());
        CK(cudaEventRecord(e0, 0));
        gdp_status st = run.forward(&f);
        CK(cudaEventRecord(e1, 0));
        if (st == GDP_OK) st = run.backward(&b);
        CK(cudaEventRecord(e2, 0));
        CK(cudaEventSynchronize(e2));
        if (i == 0) CK(cudaProfilerStop());
        if (st != GDP_OK) {
          printf("  %-12s FAILED: %s\n", name, gdp_last_error());
          status = 1;
          break;
        }
        tf.push_back(elapsed_ms(e0, e1));
        tb.push_back(elapsed_ms(e1, e2));
        tfb.push_back(elapsed_ms(e0, e2));
      }
      CK(cudaGetLastError());
      const double mf = median(tf), mb = median(tb), mfb = median(tfb);
      printf("  %-12s fwd %8.3f ms   bwd %8.3f ms   fwd+bwd %8.3f ms\n", name, mf, mb, mfb);
      if (js)
        fprintf(js,
                "{\"tool\":\"gdp_cuda_lab\",\"variant\":\"%s\",\"B\":%lld,\"T\":%lld,\"n\":%lld,\"H\":%lld,"
                "\"K\":%lld,\"V\":%lld,\"dtype\":\"bf16\",\"value_block\":%d,\"fwd_ms\":%.5f,\"bwd_ms\":%.5f,"
                "\"fwdbwd_ms\":%.5f,\"reps\":%d}\n",
                name, (long long)B, (long long)T, (long long)n, (long long)H, (long long)K, (long long)V, g_value_block,
                mf, mb, mfb, myreps);
    }
    /* this variant's results at this size, for the comparison below */
    Outputs got;
    CK(cudaDeviceSynchronize());
    download(d.o, P.T() * P.H * P.V, GDP_DTYPE_BF16, got.o);
    download(d.dq, P.T() * P.H * P.K, GDP_DTYPE_BF16, got.dq);
    download(d.dk, P.T() * n * P.H * P.K, GDP_DTYPE_BF16, got.dk);
    download(d.dv, P.T() * n * P.H * P.V, GDP_DTYPE_BF16, got.dv);
    download(d.dbeta, P.T() * n * P.H, GDP_DTYPE_BF16, got.dbeta);
    download(d.dg, P.T() * P.H, GDP_DTYPE_BF16, got.dg);
    outs.push_back(got);
    ran.push_back(var);
  }
  for (size_t i = 1; i < outs.size(); i++) {
    int fails = 0;
    const Outputs &x = outs[i], &y = outs[0];
    char label[96];
    snprintf(label, sizeof label, "  %s vs %s at this size:", kVariantName[ran[i]], kVariantName[ran[0]]);
    compare_all(label,
                {{"o", &x.o, &y.o}, {"dq", &x.dq, &y.dq}, {"dk", &x.dk, &y.dk}, {"dv", &x.dv, &y.dv},
                 {"dbeta", &x.dbeta, &y.dbeta}, {"dg", &x.dg, &y.dg}},
                GDP_DTYPE_BF16, &fails);
    if (fails) status = 1;
  }
  if (js) fclose(js);
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaEventDestroy(e2));
  return status;
}

/* ------------------------------------------------------------------ main */

static int usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s check [VARIANT...] [--seed S] [--quick] [--value-block W]\n"
          "       %s bench B T n [VARIANT...] [--reps R] [--value-block W] [--json FILE] [--heads H] [--K K] [--V V]\n"
          "VARIANT: chunk, chunk_saving, recurrent (see the header of dev/cuda/gdp_cuda_lab.cu)\n",
          argv0, argv0);
  return 2;
}

int main(int argc, char **argv) {
  if (argc < 2 || (strcmp(argv[1], "check") && strcmp(argv[1], "bench"))) return usage(argv[0]);
  const bool check = !strcmp(argv[1], "check");
  vector<int> variants;
  vector<long long> nums;
  int reps = 20;
  long long heads = 16, kdim = 128, vdim = 128; /* bench: --heads, --K, --V */
  bool quick = false;
  unsigned long long seed = 20261130;
  const char *json = NULL;
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    const bool has_value = i + 1 < argc;
    if (!strcmp(a, "--reps") && has_value) reps = atoi(argv[++i]);
    else if (!strcmp(a, "--seed") && has_value) seed = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(a, "--json") && has_value) json = argv[++i];
    else if (!strcmp(a, "--value-block") && has_value) g_value_block = atoi(argv[++i]);
    else if (!strcmp(a, "--heads") && has_value) heads = atoll(argv[++i]);
    else if (!strcmp(a, "--K") && has_value) kdim = atoll(argv[++i]);
    else if (!strcmp(a, "--V") && has_value) vdim = atoll(argv[++i]);
    else if (!strcmp(a, "--quick")) quick = true;
    else if (parse_variant(a) >= 0) variants.push_back(parse_variant(a));
    else if (a[0] >= '0' && a[0] <= '9') nums.push_back(atoll(a));
    else {
      fprintf(stderr, "%s: unknown argument '%s'\n", argv[0], a);
      return usage(argv[0]);
    }
  }
  if (check ? !nums.empty() : nums.size() != 3 || reps < 1) return usage(argv[0]);
  if (g_value_block != 0 && g_value_block != 16 && g_value_block != 32 && g_value_block != 64) {
    fprintf(stderr, "%s: --value-block takes 0, 16, 32 or 64, got %d\n", argv[0], g_value_block);
    return 2;
  }
  if (heads < 1 || heads > 65535 || kdim < 1 || kdim > 256 || vdim < 1) {
    fprintf(stderr, "%s: --heads takes 1..65535, --K 1..256, --V >= 1; got %lld, %lld, %lld\n", argv[0], heads, kdim,
            vdim);
    return 2;
  }
  if (variants.empty()) {
    variants = {CHUNK, CHUNK_SAVING};
    if (check) variants.push_back(RECURRENT);
  }

  int ndev = 0;
  const cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0) { /* ctest: SKIP_RETURN_CODE 77 */
    printf("SKIP: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return 77;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s (sm_%d%d), %d SMs, %.0f MB L2\n", prop.name, prop.major, prop.minor,
         prop.multiProcessorCount, prop.l2CacheSize / 1e6);
  if (check) return lab_check(variants, seed, quick);
  return lab_bench(nums[0], nums[1], nums[2], heads, kdim, vdim, variants, reps, json);
}
