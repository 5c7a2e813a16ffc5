// v3_overlap_test.cpp -- CPU tests of the E3 host rules (kernels/cuda/gdp_v3_overlap.h) and a model of the counter
// protocol (no GPU).  Build and run (args: registers of the 2-stage dstate and of grad_state
// from a ptxas log, default 214 122):
//   g++ -O2 -std=c++17 -pthread -Ikernels/cuda kernels/bench/v3_overlap_test.cpp -o /tmp/v3ovl && /tmp/v3ovl 206 122
#include "gdp_v3_overlap.h"
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>
using namespace gdpcu::v3ovl;
struct CI { int seq, t0, ntok, pad; };
static int fails = 0;
#define CHECK(c, ...) do { if (!(c)) { fails++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } while (0)

// plan_make's chunk table, re-typed from gdp_fwd.cu's plan_build
static void plan_chunks(int64_t N, const int64_t *cu, int TC, std::vector<CI> &chunks, std::vector<int> &choff) {
  chunks.clear(); choff.assign(N + 1, 0);
  for (int64_t s = 0; s < N; s++) {
    for (int64_t t0 = cu[s]; t0 < cu[s + 1]; t0 += TC)
      chunks.push_back(CI{(int)s, (int)t0, (int)std::min<int64_t>(TC, cu[s + 1] - t0), 0});
    choff[s + 1] = (int)chunks.size();
  }
}

static void test_order(std::mt19937 &rng) {
  for (int trial = 0; trial < 2000; trial++) {
    const int N = 1 + rng() % 9, TC = (int[]){16, 32, 32}[rng() % 3];
    std::vector<int64_t> cu(N + 1, 0);
    bool empty = false;
    for (int s = 0; s < N; s++) {
      int len = (rng() % 5 == 0) ? (int)(rng() % 3) : 1 + (int)(rng() % 700);
      if (trial % 7 == 0) len = 4096;
      cu[s + 1] = cu[s] + len;
      empty |= len == 0;
    }
    std::vector<CI> order, chunks; std::vector<int> choff;
    const bool ok = reverse_chunk_order<CI>(N, cu.data(), TC, &order);
    CHECK(ok == !empty, "ok %d empty %d", ok, empty);
    if (!ok) { CHECK(order.empty(), "order not empty"); continue; }
    plan_chunks(N, cu.data(), TC, chunks, choff);
    CHECK(order.size() == chunks.size(), "size %zu vs %zu", order.size(), chunks.size());
    std::vector<int> seen(chunks.size(), 0);
    int prev_back = -1, prev_seq = -1;
    for (size_t i = 0; i < order.size(); i++) {
      const CI o = order[i];
      CHECK(o.pad >= 0 && o.pad < (int)chunks.size(), "pad %d", o.pad);
      if (o.pad < 0 || o.pad >= (int)chunks.size()) continue;
      seen[o.pad]++;
      const CI c = chunks[o.pad];
      CHECK(c.seq == o.seq && c.t0 == o.t0 && c.ntok == o.ntok, "slot %zu: (%d,%d,%d) vs chunk %d (%d,%d,%d)", i, o.seq,
            o.t0, o.ntok, o.pad, c.seq, c.t0, c.ntok);
      const int back = choff[c.seq + 1] - 1 - o.pad; /* position from the sequence's end */
      CHECK(back > prev_back || (back == prev_back && c.seq > prev_seq), "slot %zu out of order (back %d seq %d after %d %d)",
            i, back, c.seq, prev_back, prev_seq);
      prev_back = back, prev_seq = c.seq;
    }
    for (size_t c = 0; c < seen.size(); c++) CHECK(seen[c] == 1, "chunk %zu seen %d times", c, seen[c]);
  }
  printf("order: 2000 random tables checked\n");
}

static void test_pair() {
  const SmLimits h200{233472, 65536, 64, 32};
  // registers per thread from the ptxas log (argv), defaults = session-6 counts of the 3-stage kernels
  struct Case { const char *what; int dsmem, dthreads, dregs, gsmem, gregs; bool expect; };
  extern int g_regs_d2, g_regs_g;
  const Case cases[] = {
      {"4x4096 n=2 BV=64: 2-stage bf16 dstate + grad_state", 117760, 128, g_regs_d2, 110640, g_regs_g, true},
      {"4x4096 n=2 BV=64: 3-stage f32-staged dstate (today) + grad_state", 175616, 128, 214, 110640, 122, false},
      {"4x4096 n=2 BV=64: 3-stage bf16-staged dstate + grad_state", 170496, 128, 214, 110640, 122, false},
      {"4x4096 n=2 BV=64: 2-stage f32-staged dstate + grad_state", 122880, 128, 214, 110640, 122, false},
      {"1x32768 n=2 BV=16: 2-stage bf16 dstate + grad_state", 102400, 32, 214, 110640, 122, true},
  };
  for (const Case &c : cases) {
    const Footprint d = footprint(c.dsmem, 0, 1024, c.dthreads, c.dregs), g = footprint(c.gsmem, 0, 1024, 256, c.gregs);
    const bool got = pair_fits(d, g, h200);
    printf("pair: %-70s smem %6d + %6d = %6d of %d, regs/warp %d, %d -> %s\n", c.what, d.smem, g.smem, d.smem + g.smem,
           h200.smem, d.regs_per_warp, g.regs_per_warp, got ? "fits" : "no");
    CHECK(got == c.expect, "%s: expected %d", c.what, c.expect);
  }
  // fork_mode 2 (gdp_bwd_v3.cu): the states pass as now beside a 2-stage bf16 dstate at 1x32768 n=2, BV=16
  // (1-warp blocks; registers 202 / 214 from the session-7 ptxas log); the 3-stage dstate must not pair
  CHECK(pair_fits(footprint(127232, 0, 1024, 32, 202), footprint(102400, 0, 1024, 32, 214), h200), "fork2 pair");
  CHECK(!pair_fits(footprint(127232, 0, 1024, 32, 202), footprint(153344, 0, 1024, 32, 226), h200), "3-stage pair");
  // and not at 4x4096 n=2, BV=64 (states 177152 B)
  CHECK(!pair_fits(footprint(177152, 0, 1024, 128, 194), footprint(117760, 0, 1024, 128, 206), h200), "bv64 fork2");
  // a planted error: registers at 255 on both (2 warps x 8192 > 16384 on a sub-partition) must not fit
  CHECK(!pair_fits(footprint(117760, 0, 1024, 128, 255), footprint(110640, 0, 1024, 256, 255), h200), "255 regs fit?");
  // grad_state alone twice must still fit (the calculator's 2/SM)
  CHECK(pair_fits(footprint(110640, 0, 1024, 256, 122), footprint(110640, 0, 1024, 256, 122), h200), "2 grad_state");
}
int g_regs_d2 = 214, g_regs_g = 122;

/* The counter protocol on threads: producers = dstate blocks (one per (seq, head, value
 * tile)), walking their chunks backwards, storing the tile of each chunk, then (after all
 * of the block's stores: the fence + barrier) one release add; consumers = grad_state
 * blocks in reverse_chunk_order's order, acquiring their (chunk, head) counter until it
 * equals `target`, then reading every tile.  A consumer that reads an unwritten tile is an
 * error.  target = V / BV is right; V / BV - 1 must fail. */
static int run_protocol(int target_delta, bool signal_first, std::mt19937 &rng) {
  const int N = 3, H = 2, tiles = 4, TC = 32;
  const int64_t cu[] = {0, 300, 333, 600};
  std::vector<CI> order, chunks; std::vector<int> choff;
  reverse_chunk_order<CI>(N, cu, TC, &order);
  plan_chunks(N, cu, TC, chunks, choff);
  const int nch = (int)chunks.size();
  std::vector<std::atomic<int>> data((size_t)nch * H * tiles), ready((size_t)nch * H);
  for (auto &d : data) d.store(0, std::memory_order_relaxed);
  for (auto &r : ready) r.store(0, std::memory_order_relaxed);
  std::atomic<int> bad{0};
  const int target = tiles + target_delta;
  std::vector<std::thread> th;
  std::vector<unsigned> seeds;
  for (int i = 0; i < N * H * tiles + 4; i++) seeds.push_back(rng());
  int si = 0;
  for (int s = 0; s < N; s++)
    for (int h = 0; h < H; h++)
      for (int t = 0; t < tiles; t++)
        th.emplace_back([&, s, h, t, seed = seeds[si++]] {
          std::mt19937 r(seed);
          for (int c = choff[s + 1] - 1; c >= choff[s]; c--) {
            std::this_thread::sleep_for(std::chrono::microseconds(r() % 200));
            auto &cell = data[((size_t)c * H + h) * tiles + t];
            if (signal_first) {
              ready[(size_t)c * H + h].fetch_add(1, std::memory_order_release);
              std::this_thread::sleep_for(std::chrono::microseconds(50 + r() % 200)); /* the store lags */
            }
            cell.store(1, std::memory_order_relaxed);
            if (!signal_first) ready[(size_t)c * H + h].fetch_add(1, std::memory_order_release);
          }
        });
  // 4 consumers take slots in order (a shared slot counter = block launch order)
  std::atomic<int> next{0};
  for (int w = 0; w < 4; w++)
    th.emplace_back([&] {
      for (;;) {
        const int lin = next.fetch_add(1);
        if (lin >= nch * H) return;
        const CI ci = order[lin / H];
        const int h = lin % H, c = ci.pad;
        long polls = 0;
        while (ready[(size_t)c * H + h].load(std::memory_order_acquire) != target) {
          /* the kernel's bounded spin (2^24 polls with backoff), shortened: a trap counts as an error */
          if (++polls > (1L << 12)) { bad += 1000; break; }
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        for (int t = 0; t < tiles; t++)
          if (data[((size_t)c * H + h) * tiles + t].load(std::memory_order_relaxed) != 1) bad++;
      }
    });
  for (auto &x : th) x.join();
  return bad.load();
}

int main(int argc, char **argv) {
  if (argc > 2) g_regs_d2 = atoi(argv[1]), g_regs_g = atoi(argv[2]);
  std::mt19937 rng(20261201u ^ (unsigned)std::chrono::steady_clock::now().time_since_epoch().count());
  test_order(rng);
  test_pair();
  int bad = 0;
  for (int rep = 0; rep < 5; rep++) bad += run_protocol(0, false, rng);
  printf("protocol, target V/BV: %d bad reads in 5 runs\n", bad);
  CHECK(bad == 0, "right target read unwritten tiles");
  int bad_wrong = 0;
  for (int rep = 0; rep < 2; rep++) bad_wrong += run_protocol(-1, false, rng);
  printf("protocol, target V/BV - 1 (planted): %d bad reads in 2 runs\n", bad_wrong);
  CHECK(bad_wrong > 0, "a wrong target went unnoticed");
  int bad_sig = 0;
  for (int rep = 0; rep < 2; rep++) bad_sig += run_protocol(0, true, rng);
  printf("protocol, signal before the store (planted): %d bad reads in 2 runs\n", bad_sig);
  CHECK(bad_sig > 0, "signalling before the stores went unnoticed");
  printf(fails ? "FAILED (%d)\n" : "all passed\n", fails);
  return fails != 0;
}
