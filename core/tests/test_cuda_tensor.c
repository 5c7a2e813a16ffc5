/*
 * test_cuda_tensor.c -- the cuda backend's tensor ops against the CPU backend (the
 * oracle) and against host references: transfers, strided copies and conversions,
 * fills, Philox fills, elementwise ops, reductions, cuBLAS matmul, OOM reporting,
 * memory accounting and guard regions after outputs.
 *
 * Exits 77 (ctest: skipped) when there is no CUDA device, after checking that a cuda
 * context then fails cleanly with "no CUDA device".
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gdp.h"
#include "testutil.h"

#define SEED 0x6764705f63756461ull /* "gdp_cuda" */

static gdp_ctx *cpu, *gpu;

/* Fill value of guard regions: far from every test value, exact in f32 and integers. */
#define SENTINEL (-123456.25)

static const gdp_dtype all_dtypes[] = {GDP_DTYPE_F64, GDP_DTYPE_F32, GDP_DTYPE_BF16,
                                       GDP_DTYPE_I32, GDP_DTYPE_I64};
enum { NDTYPES = 5 };

static int is_float(gdp_dtype d) {
  return d == GDP_DTYPE_F64 || d == GDP_DTYPE_F32 || d == GDP_DTYPE_BF16;
}

static int64_t numel_of(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++) n *= shape[i];
  return n;
}

/* n random values ~ scale * N(0,1), with a few exact halves and integers mixed in so
 * that float -> int truncation and bf16 ties are exercised. */
static double *random_values(int64_t n, double scale) {
  double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
  for (int64_t i = 0; i < n; i++) {
    double x = scale * tu_rand_normal();
    if (i % 7 == 3) x = floor(x) + 0.5;
    if (i % 11 == 5) x = floor(x);
    v[i] = x;
  }
  return v;
}

static gdp_tensor *upload(gdp_ctx *ctx, gdp_dtype dtype, int nd, const int64_t *shape,
                          const double *vals) {
  return tu_tensor_from_f64(ctx, dtype, nd, shape, vals);
}

/* t's values as `dtype`, row-major (malloc'd; NULL on failure). */
static void *download(const gdp_tensor *t, gdp_dtype dtype) {
  if (!t) return NULL;
  size_t bytes = (size_t)gdp_tensor_numel(t) * gdp_dtype_size(dtype);
  void *buf = malloc(bytes ? bytes : 1);
  gdp_status s = gdp_tensor_to_host(t, dtype, buf, bytes);
  CHECK(s == GDP_OK, "to_host(%s): %s", gdp_dtype_name(dtype), gdp_last_error());
  if (s != GDP_OK) {
    free(buf);
    return NULL;
  }
  return buf;
}

static double *download_f64(const gdp_tensor *t) { return download(t, GDP_DTYPE_F64); }

/* Index of the first element whose bits differ (NaN equals NaN), or -1. */
static int64_t first_bit_diff(const void *a, const void *b, int64_t n, gdp_dtype dtype) {
  size_t es = gdp_dtype_size(dtype);
  for (int64_t i = 0; i < n; i++) {
    const char *pa = (const char *)a + (size_t)i * es, *pb = (const char *)b + (size_t)i * es;
    if (memcmp(pa, pb, es) == 0) continue;
    if (dtype == GDP_DTYPE_F64) {
      double x, y;
      memcpy(&x, pa, 8);
      memcpy(&y, pb, 8);
      if (isnan(x) && isnan(y)) continue;
    } else if (dtype == GDP_DTYPE_F32) {
      float x, y;
      memcpy(&x, pa, 4);
      memcpy(&y, pb, 4);
      if (isnan(x) && isnan(y)) continue;
    } else if (dtype == GDP_DTYPE_BF16) {
      uint16_t x, y;
      memcpy(&x, pa, 2);
      memcpy(&y, pb, 2);
      if ((x & 0x7fff) > 0x7f80 && (y & 0x7fff) > 0x7f80) continue;
    }
    return i;
  }
  return -1;
}

/* g (cuda) and c (cpu) hold the same bits in their own dtype. */
static void check_same_bits(const gdp_tensor *g, const gdp_tensor *c, const char *what) {
  if (!g || !c) {
    CHECK(0, "%s: missing tensor", what);
    return;
  }
  gdp_dtype dt = gdp_tensor_dtype(g);
  int64_t n = gdp_tensor_numel(g);
  void *hg = download(g, dt), *hc = download(c, dt);
  if (hg && hc) {
    int64_t i = first_bit_diff(hg, hc, n, dt);
    if (i >= 0) {
      double *dg = download_f64(g), *dc = download_f64(c);
      CHECK(0, "%s (%s, %lld elements): element %lld differs: cuda %.17g, cpu %.17g", what,
            gdp_dtype_name(dt), (long long)n, (long long)i, dg ? dg[i] : NAN, dc ? dc[i] : NAN);
      free(dg);
      free(dc);
    } else {
      CHECK(1, "");
    }
  }
  free(hg);
  free(hc);
}

/* The strided view used throughout: base [8,9,10] -> transpose(0,2) [10,9,8] ->
 * narrow(0,1,8) -> narrow(1,2,7) -> narrow(2,0,7) = [8,7,7], non-contiguous, offset. */
static const int64_t base_shape[3] = {8, 9, 10};
static const int64_t view_shape[3] = {8, 7, 7};

static gdp_tensor *strided_view(gdp_tensor *base) {
  gdp_tensor *a = NULL, *b = NULL, *c = NULL, *d = NULL;
  if (!base) return NULL;
  CHECK_OK(gdp_tensor_transpose(base, 0, 2, &a));
  if (a) CHECK_OK(gdp_tensor_narrow(a, 0, 1, 8, &b));
  if (b) CHECK_OK(gdp_tensor_narrow(b, 1, 2, 7, &c));
  if (c) CHECK_OK(gdp_tensor_narrow(c, 2, 0, 7, &d));
  gdp_tensor_free(a);
  gdp_tensor_free(b);
  gdp_tensor_free(c);
  return d;
}

/* ------------------------------------------------------------------ transfers */

static void test_round_trips(void) {
  const int64_t shape[3] = {3, 19, 21}; /* 1197 elements, odd */
  int64_t n = numel_of(3, shape);
  for (int di = 0; di < NDTYPES; di++) {
    gdp_dtype dt = all_dtypes[di];
    size_t es = gdp_dtype_size(dt), bytes = (size_t)n * es;
    unsigned char *src = malloc(bytes);
    /* random bit patterns; for floats, finite ones (NaN payloads are not promised) */
    for (int64_t i = 0; i < n; i++) {
      uint64_t r = tu_rand_u64();
      if (dt == GDP_DTYPE_F64) {
        double x = tu_rand_normal() * ldexp(1.0, (int)(r % 200) - 100);
        memcpy(src + i * es, &x, es);
      } else if (dt == GDP_DTYPE_F32) {
        float x = (float)(tu_rand_normal() * ldexp(1.0, (int)(r % 60) - 30));
        memcpy(src + i * es, &x, es);
      } else if (dt == GDP_DTYPE_BF16) {
        uint16_t x = (uint16_t)r;
        if ((x & 0x7f80) == 0x7f80) x &= 0xbfff; /* no inf/NaN exponent */
        memcpy(src + i * es, &x, es);
      } else {
        memcpy(src + i * es, &r, es);
      }
    }
    gdp_tensor *t = NULL;
    CHECK_OK(gdp_tensor_from_host(gpu, dt, 3, shape, dt, src, bytes, &t));
    void *back = download(t, dt);
    CHECK(back && memcmp(back, src, bytes) == 0, "round trip of %s [3x19x21] not exact",
          gdp_dtype_name(dt));
    /* device -> device clone, then back */
    gdp_tensor *c = NULL;
    if (t) CHECK_OK(gdp_tensor_clone(t, &c));
    void *back2 = download(c, dt);
    CHECK(back2 && memcmp(back2, src, bytes) == 0, "clone of %s not exact", gdp_dtype_name(dt));
    /* single elements */
    if (t && is_float(dt)) {
      int64_t idx[3] = {2, 18, 20};
      double v = 0;
      CHECK_OK(gdp_tensor_set(t, idx, 0.375));
      CHECK_OK(gdp_tensor_get(t, idx, &v));
      CHECK(v == 0.375, "get after set on %s: got %g", gdp_dtype_name(dt), v);
    }
    free(back);
    free(back2);
    gdp_tensor_free(t);
    gdp_tensor_free(c);
    free(src);
  }
  /* zero-size and 0-dim tensors */
  gdp_tensor *e = NULL, *s = NULL;
  int64_t zshape[2] = {0, 5};
  CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_F32, 2, zshape, &e));
  double one = 2.5, got = 0;
  CHECK_OK(gdp_tensor_from_host(gpu, GDP_DTYPE_F32, 0, NULL, GDP_DTYPE_F64, &one, 8, &s));
  if (s) CHECK_OK(gdp_tensor_to_host(s, GDP_DTYPE_F64, &got, 8));
  CHECK(got == 2.5, "0-dim round trip: got %g", got);
  gdp_tensor_free(e);
  gdp_tensor_free(s);
}

/* ------------------------------------------------------------------ copies, conversions */

/* Every dtype pair: contiguous conversion (from_host + to), strided source into a
 * contiguous destination, and strided source into a strided destination inside a
 * sentinel-filled base (elements outside the view must keep the sentinel). */
static void test_conversions(void) {
  int64_t nbase = numel_of(3, base_shape);
  for (int si = 0; si < NDTYPES; si++) {
    gdp_dtype st = all_dtypes[si];
    /* ints get values that fit even int32; floats span ties and large magnitudes */
    double *vals = random_values(nbase, is_float(st) ? 1e3 : 1e6);
    if (st == GDP_DTYPE_I64)
      for (int64_t i = 0; i < nbase; i += 13) /* beyond 2^53: int64 -> float rounding */
        vals[i] = (double)((int64_t)1 << 55) + (double)(i * 4096);
    if (is_float(st)) { /* near the int32 edges (the CPU rejects what is past them) */
      vals[1] = 2147483000.5;
      vals[2] = -2147483000.5;
    }
    gdp_tensor *gsrc = upload(gpu, st, 3, base_shape, vals);
    gdp_tensor *csrc = upload(cpu, st, 3, base_shape, vals);
    check_same_bits(gsrc, csrc, "from_host conversion");
    gdp_tensor *gview = strided_view(gsrc), *cview = strided_view(csrc);
    for (int di = 0; di < NDTYPES; di++) {
      gdp_dtype dt = all_dtypes[di];
      char what[96];
      if (dt == GDP_DTYPE_I32 && (st == GDP_DTYPE_I64 || st == GDP_DTYPE_BF16)) {
        /* values past int32 (the 2^55 int64s; 2147483000.5, which bf16 rounds to 2^31):
         * both devices refuse the conversion with the same status and return nothing */
        gdp_tensor *g1 = NULL, *c1 = NULL;
        const gdp_status sg = gsrc ? gdp_tensor_to(gpu, gsrc, dt, &g1) : GDP_ERR_INVALID_ARG;
        const gdp_status sc = csrc ? gdp_tensor_to(cpu, csrc, dt, &c1) : GDP_ERR_INVALID_ARG;
        CHECK(sg == GDP_ERR_INVALID_ARG && sc == GDP_ERR_INVALID_ARG && !g1 && !c1,
              "%s -> i32 with values past int32: cuda %d, cpu %d (expected both %d, no tensor)",
              gdp_dtype_name(st), (int)sg, (int)sc, (int)GDP_ERR_INVALID_ARG);
        gdp_tensor_free(g1);
        gdp_tensor_free(c1);
        continue;
      }
      /* contiguous conversion of the whole base */
      gdp_tensor *g1 = NULL, *c1 = NULL;
      if (gsrc) CHECK_OK(gdp_tensor_to(gpu, gsrc, dt, &g1));
      if (csrc) CHECK_OK(gdp_tensor_to(cpu, csrc, dt, &c1));
      snprintf(what, sizeof what, "contiguous %s -> %s", gdp_dtype_name(st), gdp_dtype_name(dt));
      check_same_bits(g1, c1, what);
      /* strided source -> contiguous destination */
      gdp_tensor *g2 = NULL, *c2 = NULL;
      if (gview) CHECK_OK(gdp_tensor_to(gpu, gview, dt, &g2));
      if (cview) CHECK_OK(gdp_tensor_to(cpu, cview, dt, &c2));
      snprintf(what, sizeof what, "strided %s -> %s", gdp_dtype_name(st), gdp_dtype_name(dt));
      check_same_bits(g2, c2, what);
      /* strided source -> strided destination in a sentinel-filled base */
      gdp_tensor *gbase = NULL, *cbase = NULL;
      CHECK_OK(gdp_tensor_empty(gpu, dt, 3, base_shape, &gbase));
      CHECK_OK(gdp_tensor_empty(cpu, dt, 3, base_shape, &cbase));
      if (gbase) CHECK_OK(gdp_tensor_fill(gbase, SENTINEL));
      if (cbase) CHECK_OK(gdp_tensor_fill(cbase, SENTINEL));
      gdp_tensor *gdst = strided_view(gbase), *cdst = strided_view(cbase);
      if (gdst && gview) CHECK_OK(gdp_tensor_copy(NULL, gdst, gview));
      if (cdst && cview) CHECK_OK(gdp_tensor_copy(NULL, cdst, cview));
      snprintf(what, sizeof what, "strided %s -> strided %s (with the untouched rest)",
               gdp_dtype_name(st), gdp_dtype_name(dt));
      check_same_bits(gbase, cbase, what);
      /* independently of the CPU: exactly numel(base) - numel(view) sentinels remain
       * (base element 0 is outside the view, so it shows the sentinel in dst's dtype;
       * no source value is near it) */
      double *hb = download_f64(gbase);
      if (hb) {
        int64_t sentinels = 0;
        for (int64_t i = 0; i < nbase; i++) sentinels += hb[i] == hb[0];
        CHECK(sentinels == nbase - numel_of(3, view_shape),
              "%s: %lld sentinels left, expected %lld", what, (long long)sentinels,
              (long long)(nbase - numel_of(3, view_shape)));
      }
      free(hb);
      gdp_tensor_free(g1);
      gdp_tensor_free(c1);
      gdp_tensor_free(g2);
      gdp_tensor_free(c2);
      gdp_tensor_free(gdst);
      gdp_tensor_free(cdst);
      gdp_tensor_free(gbase);
      gdp_tensor_free(cbase);
    }
    gdp_tensor_free(gview);
    gdp_tensor_free(cview);
    gdp_tensor_free(gsrc);
    gdp_tensor_free(csrc);
    free(vals);
  }
}

static void test_fill(void) {
  const double values[] = {0.0, -3.75, 1e9, 1.0 / 3.0};
  for (int di = 0; di < NDTYPES; di++) {
    for (int vi = 0; vi < 4; vi++) {
      gdp_dtype dt = all_dtypes[di];
      gdp_tensor *gb = NULL, *cb = NULL;
      double *vals = random_values(numel_of(3, base_shape), 10.0);
      gb = upload(gpu, dt, 3, base_shape, vals);
      cb = upload(cpu, dt, 3, base_shape, vals);
      gdp_tensor *gv = strided_view(gb), *cv = strided_view(cb);
      if (gv) CHECK_OK(gdp_tensor_fill(gv, values[vi]));
      if (cv) CHECK_OK(gdp_tensor_fill(cv, values[vi]));
      char what[64];
      snprintf(what, sizeof what, "fill %s view with %g", gdp_dtype_name(dt), values[vi]);
      check_same_bits(gb, cb, what);
      /* contiguous whole-tensor fill (memset path for 0) */
      if (gb) CHECK_OK(gdp_tensor_fill(gb, values[vi]));
      if (cb) CHECK_OK(gdp_tensor_fill(cb, values[vi]));
      check_same_bits(gb, cb, what);
      gdp_tensor_free(gv);
      gdp_tensor_free(cv);
      gdp_tensor_free(gb);
      gdp_tensor_free(cb);
      free(vals);
    }
  }
}

/* Row views: a narrow of the last dimension (or of the one before it) merges to
 * [rows, width] with unit inner strides, which the cuda copy and fill move in the widest
 * word the width, the pitches and the addresses allow (16 bytes down to 1): widths and
 * offsets below reach every word size in every dtype, and odd ones reach the narrow
 * words.  Each is checked bit for bit against the CPU, with the rest of the base left
 * as it was. */
static void test_rows(void) {
  static const int64_t base[3] = {5, 6, 40};
  /* {dim, start, length}: dim 2 narrows the rows; dim 1 gives wide rows (6 x 40 -> k x 40) */
  static const int64_t views[][3] = {{2, 0, 16}, {2, 8, 16}, {2, 3, 7}, {2, 1, 32},
                                     {2, 0, 39}, {2, 8, 8},  {2, 5, 1}, {1, 1, 4}};
  enum { NVIEWS = sizeof views / sizeof views[0] };
  const int64_t nbase = numel_of(3, base);
  for (int di = 0; di < NDTYPES; di++) {
    gdp_dtype dt = all_dtypes[di];
    double *vals = random_values(nbase, is_float(dt) ? 10.0 : 1e4);
    gdp_tensor *gsrc = upload(gpu, dt, 3, base, vals), *csrc = upload(cpu, dt, 3, base, vals);
    /* the sentinel as dt stores it */
    gdp_tensor *one = NULL;
    const int64_t one_shape[1] = {1};
    CHECK_OK(gdp_tensor_empty(cpu, dt, 1, one_shape, &one));
    if (one) CHECK_OK(gdp_tensor_fill(one, SENTINEL));
    double *stored = download_f64(one);
    gdp_tensor_free(one);
    for (int vi = 0; vi < NVIEWS; vi++) {
      const int dim = (int)views[vi][0];
      const int64_t start = views[vi][1], len = views[vi][2];
      int64_t vshape[3] = {base[0], base[1], base[2]};
      vshape[dim] = len;
      const int64_t nview = numel_of(3, vshape);
      char what[128];
      gdp_tensor *gb = NULL, *cb = NULL, *gv = NULL, *cv = NULL, *gs = NULL, *cs = NULL;
      /* contiguous source -> row view of a sentinel base */
      CHECK_OK(gdp_tensor_empty(gpu, dt, 3, base, &gb));
      CHECK_OK(gdp_tensor_empty(cpu, dt, 3, base, &cb));
      if (gb) CHECK_OK(gdp_tensor_fill(gb, SENTINEL));
      if (cb) CHECK_OK(gdp_tensor_fill(cb, SENTINEL));
      if (gb) CHECK_OK(gdp_tensor_narrow(gb, dim, start, len, &gv));
      if (cb) CHECK_OK(gdp_tensor_narrow(cb, dim, start, len, &cv));
      gdp_tensor *gc = upload(gpu, dt, 3, vshape, vals), *cc = upload(cpu, dt, 3, vshape, vals);
      if (gv && gc) CHECK_OK(gdp_tensor_copy(NULL, gv, gc));
      if (cv && cc) CHECK_OK(gdp_tensor_copy(NULL, cv, cc));
      snprintf(what, sizeof what, "%s contiguous -> rows narrow(%d, %lld, %lld)", gdp_dtype_name(dt), dim,
               (long long)start, (long long)len);
      check_same_bits(gb, cb, what);
      /* independently of the CPU: the stored sentinel left outside the view alone
       * (no source value is near it) */
      double *hb = download_f64(gb);
      if (hb && stored) {
        int64_t sentinels = 0;
        for (int64_t i = 0; i < nbase; i++) sentinels += hb[i] == stored[0];
        CHECK(sentinels == nbase - nview, "%s: %lld sentinels left, expected %lld", what,
              (long long)sentinels, (long long)(nbase - nview));
      }
      free(hb);
      /* row view -> row view (another offset of the same width, where one fits) */
      const int64_t start2 = start + len <= base[dim] - 1 ? start + 1 : 0;
      if (gsrc) CHECK_OK(gdp_tensor_narrow(gsrc, dim, start2, len, &gs));
      if (csrc) CHECK_OK(gdp_tensor_narrow(csrc, dim, start2, len, &cs));
      if (gv && gs) CHECK_OK(gdp_tensor_copy(NULL, gv, gs));
      if (cv && cs) CHECK_OK(gdp_tensor_copy(NULL, cv, cs));
      snprintf(what, sizeof what, "%s rows narrow(%d, %lld) -> rows narrow(%d, %lld), length %lld",
               gdp_dtype_name(dt), dim, (long long)start2, dim, (long long)start, (long long)len);
      check_same_bits(gb, cb, what);
      /* row view -> contiguous */
      gdp_tensor *g2 = NULL, *c2 = NULL;
      if (gs) CHECK_OK(gdp_tensor_to(gpu, gs, dt, &g2));
      if (cs) CHECK_OK(gdp_tensor_to(cpu, cs, dt, &c2));
      snprintf(what, sizeof what, "%s rows narrow(%d, %lld, %lld) -> contiguous", gdp_dtype_name(dt), dim,
               (long long)start2, (long long)len);
      check_same_bits(g2, c2, what);
      /* fills of the row view: zero and a value whose bytes are not all equal */
      const double fills[2] = {0.0, -3.75};
      for (int fi = 0; fi < 2; fi++) {
        if (gv) CHECK_OK(gdp_tensor_fill(gv, fills[fi]));
        if (cv) CHECK_OK(gdp_tensor_fill(cv, fills[fi]));
        snprintf(what, sizeof what, "%s fill rows narrow(%d, %lld, %lld) with %g", gdp_dtype_name(dt), dim,
                 (long long)start, (long long)len, fills[fi]);
        check_same_bits(gb, cb, what);
      }
      gdp_tensor_free(g2);
      gdp_tensor_free(c2);
      gdp_tensor_free(gc);
      gdp_tensor_free(cc);
      gdp_tensor_free(gs);
      gdp_tensor_free(cs);
      gdp_tensor_free(gv);
      gdp_tensor_free(cv);
      gdp_tensor_free(gb);
      gdp_tensor_free(cb);
    }
    gdp_tensor_free(gsrc);
    gdp_tensor_free(csrc);
    free(stored);
    free(vals);
  }
}

/* ------------------------------------------------------------------ guard regions */

/* Each op writes a view of the first n elements of a buffer of n + GUARD sentinels;
 * the GUARD elements after it must be untouched (catches off-by-one grids). */
static void test_guards(void) {
  enum { GUARD = 67 };
  const int64_t sizes[] = {1, 3, 4, 5, 255, 256, 257, 1023, 4099};
  for (int si = 0; si < 9; si++) {
    int64_t n = sizes[si];
    int64_t full = n + GUARD;
    for (int di = 0; di < 3; di++) {
      gdp_dtype dt = all_dtypes[di];
      for (int op = 0; op < 5; op++) {
        gdp_tensor *buf = NULL, *out = NULL, *a = NULL;
        CHECK_OK(gdp_tensor_empty(gpu, dt, 1, &full, &buf));
        if (!buf) continue;
        CHECK_OK(gdp_tensor_fill(buf, SENTINEL));
        CHECK_OK(gdp_tensor_narrow(buf, 0, 0, n, &out));
        double *vals = random_values(n, 1.0);
        a = upload(gpu, dt, 1, &n, vals);
        free(vals);
        switch (op) {
          case 0: CHECK_OK(gdp_tensor_copy(NULL, out, a)); break;
          case 1: CHECK_OK(gdp_tensor_uniform(out, -1.0, 1.0)); break;
          case 2: CHECK_OK(gdp_tensor_normal(out, 0.0, 1.0)); break;
          case 3: CHECK_OK(gdp_tensor_add(out, a, a, 0.5)); break;
          default: CHECK_OK(gdp_tensor_fill(out, -1.0)); break;
        }
        double *h = download_f64(buf);
        int bad = 0;
        for (int64_t i = n; h && i < full; i++) bad += h[i] != h[full - 1] || h[i] > -1e5;
        CHECK(h && bad == 0, "op %d on %s[%lld]: %d guard elements overwritten", op,
              gdp_dtype_name(dt), (long long)n, bad);
        free(h);
        gdp_tensor_free(a);
        gdp_tensor_free(out);
        gdp_tensor_free(buf);
      }
    }
  }
}

/* ------------------------------------------------------------------ rng */

static uint32_t philox_word(uint64_t seed, uint64_t block, int word) {
  uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), 0, 0};
  uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  uint32_t out[4];
  gdp_philox4x32_10(ctr, key, out);
  return out[word];
}

static void test_rng(void) {
  const uint64_t seed = 0x1234abcd5678ull;
  const int64_t shapes[3][2] = {{1, 1001}, {13, 17}, {3, 4}};
  for (int di = 0; di < 3; di++) {
    gdp_dtype dt = all_dtypes[di];
    for (int kind = 0; kind < 2; kind++) {
      for (int si = 0; si < 3; si++) {
        for (int strided = 0; strided < 2; strided++) {
          int64_t sh[2] = {shapes[si][0], shapes[si][1]};
          gdp_tensor *gt = NULL, *ct = NULL, *gv = NULL, *cv = NULL;
          int64_t tsh[2] = {sh[1], sh[0]};
          CHECK_OK(gdp_tensor_zeros(gpu, dt, 2, strided ? tsh : sh, &gt));
          CHECK_OK(gdp_tensor_zeros(cpu, dt, 2, strided ? tsh : sh, &ct));
          if (!gt || !ct) continue;
          if (strided) { /* fill a transposed view: element order is the view's */
            CHECK_OK(gdp_tensor_transpose(gt, 0, 1, &gv));
            CHECK_OK(gdp_tensor_transpose(ct, 0, 1, &cv));
          } else {
            gv = gdp_tensor_retain(gt);
            cv = gdp_tensor_retain(ct);
          }
          uint64_t start = 1000003ull * (uint64_t)(si + 1) + (uint64_t)kind;
          gdp_ctx_manual_seed(gpu, seed);
          gdp_ctx_manual_seed(cpu, seed);
          gdp_ctx_set_rng_offset(gpu, start);
          gdp_ctx_set_rng_offset(cpu, start);
          if (kind == 0) {
            CHECK_OK(gdp_tensor_uniform(gv, -2.0, 3.0));
            CHECK_OK(gdp_tensor_uniform(cv, -2.0, 3.0));
          } else {
            CHECK_OK(gdp_tensor_normal(gv, 0.5, 2.0));
            CHECK_OK(gdp_tensor_normal(cv, 0.5, 2.0));
          }
          int64_t n = sh[0] * sh[1];
          uint64_t want_off = start + (uint64_t)((n + 3) / 4);
          CHECK(gdp_ctx_rng_offset(gpu) == want_off && gdp_ctx_rng_offset(cpu) == want_off,
                "rng offsets after %lld elements: cuda %llu, cpu %llu, want %llu", (long long)n,
                (unsigned long long)gdp_ctx_rng_offset(gpu),
                (unsigned long long)gdp_ctx_rng_offset(cpu), (unsigned long long)want_off);
          char what[96];
          snprintf(what, sizeof what, "%s %s [%lldx%lld]%s", kind ? "normal" : "uniform",
                   gdp_dtype_name(dt), (long long)sh[0], (long long)sh[1],
                   strided ? " transposed view" : "");
          double *hg = download_f64(gv), *hc = download_f64(cv);
          if (kind == 1 && dt == GDP_DTYPE_F64) {
            /* float64 normals go through log/sin/cos, which CUDA and glibc may round
             * differently in the last bit: report identity, require <= 4 ulp. */
            int64_t same = 0;
            double worst = 0;
            for (int64_t i = 0; hg && hc && i < n; i++) {
              same += hg[i] == hc[i];
              double d = fabs(hg[i] - hc[i]) / (fabs(hc[i]) > 1e-300 ? fabs(hc[i]) : 1.0);
              if (!(d <= worst)) worst = d;
            }
            CHECK(worst <= 4 * 2.220446049250313e-16, "%s: max rel diff to cpu %.3g", what, worst);
            if (si == 0 && !strided)
              printf("  %s: %lld of %lld bit-identical to cpu, max rel diff %.3g\n", what,
                     (long long)same, (long long)n, worst);
          } else {
            check_same_bits(gv, cv, what);
          }
          /* independently of the CPU backend: float64 uniforms from the raw Philox */
          if (kind == 0 && dt == GDP_DTYPE_F64 && hg) {
            int64_t bad = 0;
            for (int64_t i = 0; i < n; i++) {
              uint32_t w = philox_word(seed, start + (uint64_t)(i / 4), (int)(i % 4));
              double want = fma(5.0, ((double)w + 0.5) * (1.0 / 4294967296.0), -2.0);
              bad += hg[i] != want;
            }
            CHECK(bad == 0, "%s: %lld elements differ from the raw Philox stream", what,
                  (long long)bad);
          }
          /* sanity: moments */
          if (hg && n >= 1000) {
            double m = 0, v = 0;
            for (int64_t i = 0; i < n; i++) m += hg[i];
            m /= (double)n;
            for (int64_t i = 0; i < n; i++) v += (hg[i] - m) * (hg[i] - m);
            v /= (double)(n - 1);
            double want_m = kind ? 0.5 : 0.5, want_v = kind ? 4.0 : 25.0 / 12.0;
            CHECK(fabs(m - want_m) < 5 * sqrt(want_v / (double)n) && fabs(v / want_v - 1) < 0.2,
                  "%s: mean %g var %g, expected %g and %g", what, m, v, want_m, want_v);
          }
          free(hg);
          free(hc);
          gdp_tensor_free(gv);
          gdp_tensor_free(cv);
          gdp_tensor_free(gt);
          gdp_tensor_free(ct);
        }
      }
    }
  }
}

/* ------------------------------------------------------------------ elementwise */

static double rel_err_host(const double *a, const double *b, int64_t n) {
  return tu_rel_err_f64(a, b, n);
}

static void test_binary(void) {
  const int64_t shape[2] = {37, 41};
  int64_t n = 37 * 41;
  const double tol[3] = {1e-15, 1e-7, 4e-3}; /* one rounding of a float64 result */
  for (int di = 0; di < 3; di++) {
    gdp_dtype dt = all_dtypes[di];
    double *va = random_values(n, 1.0), *vb = random_values(n, 1.0);
    for (int op = 0; op < 3; op++) {
      for (int layout = 0; layout < 3; layout++) { /* contiguous, transposed, in place */
        gdp_tensor *ga = upload(gpu, dt, 2, shape, va), *gb = upload(gpu, dt, 2, shape, vb);
        gdp_tensor *ca = upload(cpu, dt, 2, shape, va), *cb = upload(cpu, dt, 2, shape, vb);
        if (!ga || !gb || !ca || !cb) goto next;
        gdp_tensor *gx = NULL, *gy = NULL, *cx = NULL, *cy = NULL, *go = NULL, *co = NULL;
        if (layout == 1) {
          CHECK_OK(gdp_tensor_transpose(ga, 0, 1, &gx));
          CHECK_OK(gdp_tensor_transpose(ca, 0, 1, &cx));
          /* b transposed too, but out contiguous: mixed strides in one op */
          CHECK_OK(gdp_tensor_transpose(gb, 0, 1, &gy));
          CHECK_OK(gdp_tensor_transpose(cb, 0, 1, &cy));
          int64_t ts[2] = {shape[1], shape[0]};
          CHECK_OK(gdp_tensor_empty(gpu, dt, 2, ts, &go));
          CHECK_OK(gdp_tensor_empty(cpu, dt, 2, ts, &co));
        } else {
          gx = gdp_tensor_retain(ga);
          cx = gdp_tensor_retain(ca);
          gy = gdp_tensor_retain(gb);
          cy = gdp_tensor_retain(cb);
          if (layout == 2) {
            go = gdp_tensor_retain(ga);
            co = gdp_tensor_retain(ca);
          } else {
            CHECK_OK(gdp_tensor_empty(gpu, dt, 2, shape, &go));
            CHECK_OK(gdp_tensor_empty(cpu, dt, 2, shape, &co));
          }
        }
        if (op == 0) {
          CHECK_OK(gdp_tensor_add(go, gx, gy, -0.7));
          CHECK_OK(gdp_tensor_add(co, cx, cy, -0.7));
        } else if (op == 1) {
          CHECK_OK(gdp_tensor_mul(go, gx, gy));
          CHECK_OK(gdp_tensor_mul(co, cx, cy));
        } else {
          CHECK_OK(gdp_tensor_scale(go, gx, 1.0 / 3.0));
          CHECK_OK(gdp_tensor_scale(co, cx, 1.0 / 3.0));
        }
        double *hg = download_f64(go), *hc = download_f64(co);
        if (hg && hc) {
          int64_t same = 0;
          for (int64_t i = 0; i < n; i++) same += hg[i] == hc[i];
          double e = rel_err_host(hg, hc, n);
          CHECK(e <= tol[di], "binary op %d %s layout %d: rel err to cpu %.3g (tol %.1g)", op,
                gdp_dtype_name(dt), layout, e, tol[di]);
          if (layout == 0 && op == 0)
            printf("  axpy %s: %lld of %lld bit-identical to cpu, rel err %.3g\n",
                   gdp_dtype_name(dt), (long long)same, (long long)n, e);
        }
        free(hg);
        free(hc);
        gdp_tensor_free(gx);
        gdp_tensor_free(gy);
        gdp_tensor_free(cx);
        gdp_tensor_free(cy);
        gdp_tensor_free(go);
        gdp_tensor_free(co);
      next:
        gdp_tensor_free(ga);
        gdp_tensor_free(gb);
        gdp_tensor_free(ca);
        gdp_tensor_free(cb);
      }
    }
    free(va);
    free(vb);
  }
}

/* ------------------------------------------------------------------ reductions */

/* The bf16 float32 path of add (alpha +-1) and mul (kernels/cuda/tensor_ops.cu,
 * binary_bf16_f32) against the cpu's float64 arithmetic, bit for bit, on the values it
 * has to get right: every exponent (subnormal products, wide sums, overflow), zeros of
 * both signs, inf and NaN; a length that leaves a tail past the 8-element pieces, an
 * offset view (not 16-byte aligned: the float64 path), in place. */
static void test_binary_bf16_fast(void) {
  const int64_t n = 4099;
  double *va = malloc((size_t)n * sizeof *va), *vb = malloc((size_t)n * sizeof *vb);
  for (int64_t i = 0; i < n; i++) {
    for (int k = 0; k < 2; k++) {
      /* a random bf16 bit pattern: sign, any exponent, any mantissa */
      uint32_t bits = (uint32_t)(tu_rand_u64() & 0xffffu) << 16;
      float f;
      memcpy(&f, &bits, sizeof f);
      double x = f;
      if (i % 97 == 1) x = k ? -0.0 : 0.0;
      if (i % 5 == 2 && k) x = va[i] * ldexp(1.0, -(int)(i % 40)); /* b near a's scale */
      (k ? vb : va)[i] = x;
    }
  }
  int64_t shape[1] = {n};
  gdp_tensor *ga = upload(gpu, GDP_DTYPE_BF16, 1, shape, va), *gb = upload(gpu, GDP_DTYPE_BF16, 1, shape, vb);
  gdp_tensor *ca = upload(cpu, GDP_DTYPE_BF16, 1, shape, va), *cb = upload(cpu, GDP_DTYPE_BF16, 1, shape, vb);
  for (int op = 0; op < 3 && ga && gb && ca && cb; op++) {
    for (int view = 0; view < 3; view++) {
      /* view 0: whole, 1: from element 3 (unaligned), 2: in place into a copy of a */
      gdp_tensor *gx = NULL, *gy = NULL, *cx = NULL, *cy = NULL, *go = NULL, *co = NULL;
      const int64_t off = view == 1 ? 3 : 0, m = n - off;
      CHECK_OK(gdp_tensor_narrow(ga, 0, off, m, &gx));
      CHECK_OK(gdp_tensor_narrow(gb, 0, off, m, &gy));
      CHECK_OK(gdp_tensor_narrow(ca, 0, off, m, &cx));
      CHECK_OK(gdp_tensor_narrow(cb, 0, off, m, &cy));
      if (view == 2) {
        CHECK_OK(gdp_tensor_clone(gx, &go));
        CHECK_OK(gdp_tensor_clone(cx, &co));
      } else {
        CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_BF16, 1, &m, &go));
        CHECK_OK(gdp_tensor_empty(cpu, GDP_DTYPE_BF16, 1, &m, &co));
      }
      const gdp_tensor *gxi = view == 2 ? go : gx, *cxi = view == 2 ? co : cx;
      if (op < 2) {
        CHECK_OK(gdp_tensor_add(go, gxi, gy, op ? -1.0 : 1.0));
        CHECK_OK(gdp_tensor_add(co, cxi, cy, op ? -1.0 : 1.0));
      } else {
        CHECK_OK(gdp_tensor_mul(go, gxi, gy));
        CHECK_OK(gdp_tensor_mul(co, cxi, cy));
      }
      void *hg = download(go, GDP_DTYPE_BF16), *hc = download(co, GDP_DTYPE_BF16);
      if (hg && hc) {
        int64_t d = first_bit_diff(hg, hc, m, GDP_DTYPE_BF16);
        CHECK(d < 0, "bf16 %s view %d: element %lld differs from the cpu (a %.9g, b %.9g)",
              op == 0 ? "a + b" : op == 1 ? "a - b" : "a * b", view, (long long)d,
              d >= 0 ? va[off + d] : 0.0, d >= 0 ? vb[off + d] : 0.0);
      }
      free(hg);
      free(hc);
      gdp_tensor *views[6] = {gx, gy, cx, cy, go, co};
      for (int t = 0; t < 6; t++) gdp_tensor_free(views[t]);
    }
  }
  gdp_tensor *whole[4] = {ga, gb, ca, cb};
  for (int t = 0; t < 4; t++) gdp_tensor_free(whole[t]);
  free(va);
  free(vb);
}

/* sumsq_many: the cpu's sums, more tensors than one wait's slots, empty ones among them. */
static void test_sumsq_many(void) {
  enum { N = 150 };
  gdp_tensor *g[N], *c[N];
  const gdp_tensor *gl[N], *cl[N];
  for (int i = 0; i < N; i++) {
    int64_t shape[2] = {i % 37 == 0 ? 0 : 1 + i % 13, 1 + (7 * i) % 101};
    gdp_dtype dt = i % 3 == 0 ? GDP_DTYPE_F64 : i % 3 == 1 ? GDP_DTYPE_F32 : GDP_DTYPE_BF16;
    double *v = random_values(shape[0] * shape[1], 2.0);
    g[i] = upload(gpu, dt, 2, shape, v);
    c[i] = upload(cpu, dt, 2, shape, v);
    gl[i] = g[i];
    cl[i] = c[i];
    free(v);
  }
  double sg[N], sc[N];
  CHECK_OK(gdp_tensor_sumsq_many(N, gl, sg));
  CHECK_OK(gdp_tensor_sumsq_many(N, cl, sc));
  for (int i = 0; i < N; i++) {
    double nrm;
    CHECK_OK(gdp_tensor_norm(g[i], &nrm));
    CHECK(fabs(sg[i] - sc[i]) <= 1e-12 * (sc[i] > 1 ? sc[i] : 1), "sumsq_many[%d] cuda %.17g cpu %.17g", i, sg[i], sc[i]);
    CHECK(sqrt(sg[i]) == nrm, "sumsq_many[%d] %.17g against the norm %.17g", i, sg[i], nrm);
  }
  const gdp_tensor *mixed[2] = {g[1], c[2]};
  CHECK_ERR(gdp_tensor_sumsq_many(2, mixed, sg), GDP_ERR_INVALID_ARG, "ts[0] and ts[1] must be on the same device");
  for (int i = 0; i < N; i++) {
    gdp_tensor_free(g[i]);
    gdp_tensor_free(c[i]);
  }
}

static void test_reduce(void) {
  const double tol = 1e-12; /* float64 sums in different orders */
  for (int di = 0; di < NDTYPES; di++) {
    gdp_dtype dt = all_dtypes[di];
    int64_t nbase = numel_of(3, base_shape);
    double *va = random_values(nbase, is_float(dt) ? 1.0 : 1000.0);
    double *vb = random_values(nbase, is_float(dt) ? 1.0 : 1000.0);
    gdp_tensor *ga = upload(gpu, dt, 3, base_shape, va), *gb = upload(gpu, dt, 3, base_shape, vb);
    gdp_tensor *ca = upload(cpu, dt, 3, base_shape, va), *cb = upload(cpu, dt, 3, base_shape, vb);
    for (int strided = 0; strided < 2; strided++) {
      gdp_tensor *gx, *gy, *cx, *cy;
      if (strided) {
        gx = strided_view(ga);
        gy = strided_view(gb);
        cx = strided_view(ca);
        cy = strided_view(cb);
      } else {
        gx = gdp_tensor_retain(ga);
        gy = gdp_tensor_retain(gb);
        cx = gdp_tensor_retain(ca);
        cy = gdp_tensor_retain(cb);
      }
      if (!gx || !gy || !cx || !cy) continue;
      double g[5] = {0}, c[5] = {0};
      CHECK_OK(gdp_tensor_sum(gx, &g[0]));
      CHECK_OK(gdp_tensor_sum(cx, &c[0]));
      CHECK_OK(gdp_tensor_dot(gx, gy, &g[1]));
      CHECK_OK(gdp_tensor_dot(cx, cy, &c[1]));
      CHECK_OK(gdp_tensor_norm(gx, &g[2]));
      CHECK_OK(gdp_tensor_norm(cx, &c[2]));
      CHECK_OK(gdp_tensor_max_abs(gx, &g[3]));
      CHECK_OK(gdp_tensor_max_abs(cx, &c[3]));
      CHECK_OK(gdp_tensor_rel_error(gx, gy, &g[4]));
      CHECK_OK(gdp_tensor_rel_error(cx, cy, &c[4]));
      const char *names[5] = {"sum", "dot", "norm", "max_abs", "rel_error"};
      for (int k = 0; k < 5; k++) {
        double e = fabs(g[k] - c[k]) / (fabs(c[k]) > 0 ? fabs(c[k]) : 1.0);
        CHECK(e <= (k == 3 ? 0.0 : tol) && isfinite(g[k]),
              "%s %s%s: cuda %.17g cpu %.17g (rel %.3g)", names[k], gdp_dtype_name(dt),
              strided ? " strided" : "", g[k], c[k], e);
      }
      /* deterministic: the same bits twice */
      double again = 0;
      CHECK_OK(gdp_tensor_dot(gx, gy, &again));
      CHECK(again == g[1], "dot %s not deterministic: %.17g then %.17g", gdp_dtype_name(dt), g[1],
            again);
      gdp_tensor_free(gx);
      gdp_tensor_free(gy);
      gdp_tensor_free(cx);
      gdp_tensor_free(cy);
    }
    /* mixed dtypes: the op layer widens; the result must match the cpu */
    if (dt != GDP_DTYPE_F64 && ga) {
      gdp_tensor *g64 = upload(gpu, GDP_DTYPE_F64, 3, base_shape, vb);
      gdp_tensor *c64 = upload(cpu, GDP_DTYPE_F64, 3, base_shape, vb);
      double g1 = 0, c1 = 0;
      if (g64) CHECK_OK(gdp_tensor_rel_error(ga, g64, &g1));
      if (c64) CHECK_OK(gdp_tensor_rel_error(ca, c64, &c1));
      CHECK(fabs(g1 - c1) <= tol * fabs(c1), "rel_error %s vs f64: cuda %.17g cpu %.17g",
            gdp_dtype_name(dt), g1, c1);
      gdp_tensor_free(g64);
      gdp_tensor_free(c64);
    }
    gdp_tensor_free(ga);
    gdp_tensor_free(gb);
    gdp_tensor_free(ca);
    gdp_tensor_free(cb);
    free(va);
    free(vb);
  }

  /* non-finite counting and NaN propagation */
  {
    int64_t n = 1000;
    double *v = random_values(n, 1.0);
    v[17] = NAN;
    v[500] = INFINITY;
    v[999] = -INFINITY;
    v[3] = NAN;
    gdp_tensor *t = upload(gpu, GDP_DTYPE_F32, 1, &n, v);
    int64_t bad = -1;
    double m = 0;
    if (t) {
      CHECK_OK(gdp_tensor_count_nonfinite(t, &bad));
      CHECK_OK(gdp_tensor_max_abs(t, &m));
    }
    CHECK(bad == 4, "count_nonfinite: got %lld, want 4", (long long)bad);
    CHECK(isnan(m), "max_abs with NaN inside: got %g, want NaN", m);
    gdp_tensor_free(t);
    free(v);
  }

  /* a long reduction (the full 1024-block grid) against a long double host sum */
  {
    int64_t n = 3000001;
    double *v = malloc((size_t)n * sizeof *v);
    long double want = 0;
    for (int64_t i = 0; i < n; i++) {
      v[i] = tu_rand_uniform(-1.0, 2.0);
      want += v[i];
    }
    gdp_tensor *t = upload(gpu, GDP_DTYPE_F64, 1, &n, v);
    double got = 0, got2 = 0;
    if (t) {
      CHECK_OK(gdp_tensor_sum(t, &got));
      CHECK_OK(gdp_tensor_sum(t, &got2));
    }
    CHECK(fabs(got - (double)want) <= 1e-12 * fabs((double)want),
          "sum of %lld: cuda %.17g, host %.17Lg", (long long)n, got, want);
    CHECK(got == got2, "sum of %lld not deterministic", (long long)n);
    gdp_tensor_free(t);
    free(v);
  }

  /* int32 sum is exact */
  {
    int64_t n = 4097;
    int32_t *v = malloc((size_t)n * sizeof *v);
    int64_t want = 0;
    for (int64_t i = 0; i < n; i++) {
      v[i] = (int32_t)(tu_rand_u64() % 2000001) - 1000000;
      want += v[i];
    }
    gdp_tensor *t = NULL;
    CHECK_OK(gdp_tensor_from_host(gpu, GDP_DTYPE_I32, 1, &n, GDP_DTYPE_I32, v, (size_t)n * 4, &t));
    double got = 0;
    if (t) CHECK_OK(gdp_tensor_sum(t, &got));
    CHECK(got == (double)want, "i32 sum: got %.17g, want %lld", got, (long long)want);
    gdp_tensor_free(t);
    free(v);
  }
}

/* ------------------------------------------------------------------ matmul */

typedef struct mm_case {
  int64_t M, N, K;
} mm_case;

/* Operand with logical shape [r, c] in one of several layouts:
 *   0 contiguous, 1 column-major (a transposed view), 2 row-padded (narrowed columns),
 *   3 no unit stride (select from a 3-D tensor: needs a copy for BLAS). */
static gdp_tensor *mm_operand(gdp_ctx *ctx, gdp_dtype dt, int64_t r, int64_t c, int layout,
                              const double *vals) {
  gdp_tensor *base = NULL, *view = NULL;
  double *buf = NULL;
  if (layout == 0) return upload(ctx, dt, 2, (int64_t[]){r, c}, vals);
  if (layout == 1) {
    int64_t sh[2] = {c, r};
    buf = malloc((size_t)(r * c) * sizeof *buf);
    for (int64_t i = 0; i < r; i++)
      for (int64_t j = 0; j < c; j++) buf[j * r + i] = vals[i * c + j];
    base = upload(ctx, dt, 2, sh, buf);
    if (base) CHECK_OK(gdp_tensor_transpose(base, 0, 1, &view));
  } else if (layout == 2) {
    int64_t sh[2] = {r, c + 3};
    buf = malloc((size_t)(r * (c + 3)) * sizeof *buf);
    for (int64_t i = 0; i < r; i++)
      for (int64_t j = 0; j < c + 3; j++)
        buf[i * (c + 3) + j] = j >= 1 && j <= c ? vals[i * c + j - 1] : 99.0;
    base = upload(ctx, dt, 2, sh, buf);
    if (base) CHECK_OK(gdp_tensor_narrow(base, 1, 1, c, &view));
  } else {
    int64_t sh[3] = {r, c, 2};
    buf = malloc((size_t)(r * c * 2) * sizeof *buf);
    for (int64_t i = 0; i < r * c; i++) {
      buf[2 * i] = -99.0;
      buf[2 * i + 1] = vals[i];
    }
    base = upload(ctx, dt, 3, sh, buf);
    if (base) CHECK_OK(gdp_tensor_select(base, 2, 1, &view));
  }
  free(buf);
  gdp_tensor_free(base);
  return view;
}

/* Runs out = alpha op(a) op(b) + beta out on the gpu operands (ga, gb, go) and on the
 * cpu ones (the same values in the same layouts) and checks the gpu's result against
 * the cpu's and a long-double reference of the values as stored (after rounding).
 * Operands are 2-D, or batched: out [Bt, M, N] with a and b each [Bt, ., .] or 2-D
 * (shared by every entry).  g and c are {a, b, out}, freed here; *worst keeps the
 * largest relative error to the reference. */
static void check_matmul(const char *what, gdp_tensor **g, gdp_tensor **c, int ta, int tb,
                         double alpha, double beta, double tol, double *worst) {
  gdp_tensor *ga = g[0], *gb = g[1], *go = g[2], *ca = c[0], *cb = c[1], *co = c[2];
  double *ha = NULL, *hb = NULL, *hc0 = NULL, *hg = NULL, *hcpu = NULL, *ref = NULL;
  if (ga && gb && go && ca && cb && co) {
    const int na = gdp_tensor_ndim(ga), nb = gdp_tensor_ndim(gb), no = gdp_tensor_ndim(go);
    const int64_t Bt = no == 3 ? gdp_tensor_size(go, 0) : 1;
    const int64_t M = gdp_tensor_size(go, no - 2), N = gdp_tensor_size(go, no - 1);
    const int64_t ar = gdp_tensor_size(ga, na - 2), ac = gdp_tensor_size(ga, na - 1);
    const int64_t br = gdp_tensor_size(gb, nb - 2), bc = gdp_tensor_size(gb, nb - 1);
    const int64_t K = ta ? ar : ac;
    ha = download_f64(ga);
    hb = download_f64(gb);
    hc0 = download_f64(go);
    CHECK_OK(gdp_tensor_matmul(go, ga, gb, ta, tb, alpha, beta));
    CHECK_OK(gdp_tensor_matmul(co, ca, cb, ta, tb, alpha, beta));
    hg = download_f64(go);
    hcpu = download_f64(co);
    ref = malloc((size_t)(Bt * M * N) * sizeof *ref);
    for (int64_t e = 0; ha && hb && hc0 && e < Bt; e++) {
      const double *pa = na == 3 ? ha + e * ar * ac : ha, *pb = nb == 3 ? hb + e * br * bc : hb;
      for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
          long double sum = 0;
          for (int64_t k = 0; k < K; k++) {
            double x = ta ? pa[k * ac + i] : pa[i * ac + k];
            double y = tb ? pb[j * bc + k] : pb[k * bc + j];
            sum += (long double)x * y;
          }
          int64_t o = (e * M + i) * N + j;
          ref[o] = (double)(alpha * sum + (beta != 0 ? beta * hc0[o] : 0));
        }
    }
    if (ha && hb && hc0 && hg && hcpu) {
      double e_ref = rel_err_host(hg, ref, Bt * M * N), e_cpu = rel_err_host(hg, hcpu, Bt * M * N);
      CHECK(e_ref <= tol && e_cpu <= tol,
            "matmul %s beta %g: rel err %.3g to f64 ref, %.3g to cpu (tol %.0e)", what, beta,
            e_ref, e_cpu, tol);
      if (e_ref > *worst) *worst = e_ref;
    }
  } else {
    CHECK(0, "matmul %s: operands could not be made", what);
  }
  free(ha);
  free(hb);
  free(hc0);
  free(hg);
  free(hcpu);
  free(ref);
  for (int t = 0; t < 3; t++) {
    gdp_tensor_free(g[t]);
    gdp_tensor_free(c[t]);
  }
}

static void test_matmul(void) {
  const mm_case cases[] = {{1, 1, 1}, {37, 53, 29}, {64, 1, 130}, {1, 45, 7},
                           {129, 67, 3}, {33, 31, 257}};
  const int ncases = (int)(sizeof cases / sizeof cases[0]);
  double worst[2] = {0, 0};
  for (int di = 0; di < 2; di++) {
    gdp_dtype dt = all_dtypes[di];
    double tol = dt == GDP_DTYPE_F32 ? 1e-5 : 1e-12;
    for (int ci = 0; ci < ncases; ci++) {
      for (int tr = 0; tr < 4; tr++) {
        for (int layout = 0; layout < 4; layout++) {
          int ta = tr & 1, tb = (tr >> 1) & 1;
          int64_t M = cases[ci].M, N = cases[ci].N, K = cases[ci].K;
          int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
          double *va = random_values(ar * ac + br * bc + M * N, 1.0);
          double *vb = va + ar * ac, *vc = vb + br * bc;
          double beta = (ci + tr) % 2 ? 0.5 : 0.0, alpha = 0.75;
          /* a, b and out take the layouts in turn so that every combination appears */
          int la = layout, lb = (layout + 1) % 4, lo = (layout + 2) % 4;
          gdp_tensor *g[3], *c[3];
          for (int d = 0; d < 2; d++) {
            gdp_ctx *x = d ? cpu : gpu;
            gdp_tensor **t = d ? c : g;
            t[0] = mm_operand(x, dt, ar, ac, la, va);
            t[1] = mm_operand(x, dt, br, bc, lb, vb);
            t[2] = mm_operand(x, dt, M, N, lo, vc);
          }
          char what[160];
          snprintf(what, sizeof what, "%s M%lld N%lld K%lld ta%d tb%d layouts a%d b%d out%d",
                   gdp_dtype_name(dt), (long long)M, (long long)N, (long long)K, ta, tb, la, lb, lo);
          check_matmul(what, g, c, ta, tb, alpha, beta, tol, &worst[di]);
          free(va);
        }
      }
    }
  }
  printf("  matmul worst rel err to the float64 reference: f64 %.3g, f32 %.3g\n", worst[0],
         worst[1]);
  CHECK(gdp_ctx_supports(gpu, GDP_OP_MATMUL, GDP_DTYPE_F32) == 1, "matmul f32 not supported");
  /* bf16 operands and result, float32 accumulation (cublasGemmEx): against float64
   * products of the same bf16-rounded operands; the result's own rounding to bf16
   * bounds the error near 2^-9. */
  CHECK(gdp_ctx_supports(gpu, GDP_OP_MATMUL, GDP_DTYPE_BF16) == 1, "matmul bf16 not supported");
  int64_t sa[2] = {37, 53}, sb[2] = {53, 29}, so[2] = {37, 29};
  gdp_tensor *a16 = NULL, *b16 = NULL, *o16 = NULL, *a64 = NULL, *b64 = NULL, *o64 = NULL,
             *got = NULL;
  CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_BF16, 2, sa, &a16));
  CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_BF16, 2, sb, &b16));
  CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_BF16, 2, so, &o16));
  if (a16 && b16 && o16) {
    CHECK_OK(gdp_tensor_normal(a16, 0.0, 1.0));
    CHECK_OK(gdp_tensor_normal(b16, 0.0, 1.0));
    CHECK_OK(gdp_tensor_matmul(o16, a16, b16, 0, 0, 1.0, 0.0));
    CHECK_OK(gdp_tensor_to(cpu, a16, GDP_DTYPE_F64, &a64));
    CHECK_OK(gdp_tensor_to(cpu, b16, GDP_DTYPE_F64, &b64));
    CHECK_OK(gdp_tensor_to(cpu, o16, GDP_DTYPE_F64, &got));
    CHECK_OK(gdp_tensor_zeros(cpu, GDP_DTYPE_F64, 2, so, &o64));
    if (a64 && b64 && o64 && got) {
      CHECK_OK(gdp_tensor_matmul(o64, a64, b64, 0, 0, 1.0, 0.0));
      double e = NAN;
      CHECK_OK(gdp_tensor_rel_error(got, o64, &e));
      printf("  matmul bf16 (f32 accumulation) rel err to float64: %.3g\n", e);
      CHECK(e <= 4e-3, "matmul bf16: rel err %.3g > 4e-3", e);
    }
  }
  gdp_tensor *tensors16[7] = {a16, b16, o16, a64, b64, o64, got};
  for (int i = 0; i < 7; i++) gdp_tensor_free(tensors16[i]);
}

/* Batched operand [B, r, c] holding vals (row-major) in one of several layouts:
 *   0 contiguous, 1 interleaved batch (an [r, B, c] tensor transposed: batch stride c,
 *   like the heads of [T, H, K]), 2 column-major matrices ([B, c, r] transposed),
 *   3 no unit stride (select from [B, r, c, 2]: copied before cuBLAS). */
static gdp_tensor *bmm_operand(gdp_ctx *ctx, gdp_dtype dt, int64_t B, int64_t r, int64_t c,
                               int layout, const double *vals) {
  int64_t sh[3] = {B, r, c};
  gdp_tensor *src = upload(ctx, dt, 3, sh, vals), *base = NULL, *view = NULL;
  if (!src || layout == 0) return src;
  if (layout == 1) {
    int64_t s[3] = {r, B, c};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 3, s, &base));
    if (base) CHECK_OK(gdp_tensor_transpose(base, 0, 1, &view));
  } else if (layout == 2) {
    int64_t s[3] = {B, c, r};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 3, s, &base));
    if (base) CHECK_OK(gdp_tensor_transpose(base, 1, 2, &view));
  } else {
    int64_t s[4] = {B, r, c, 2};
    CHECK_OK(gdp_tensor_zeros(ctx, dt, 4, s, &base));
    if (base) CHECK_OK(gdp_tensor_select(base, 3, 1, &view));
  }
  if (view) CHECK_OK(gdp_tensor_copy(NULL, view, src));
  gdp_tensor_free(base);
  gdp_tensor_free(src);
  return view;
}

/* Batched products (one strided-batched cuBLAS call) against the cpu and a float64
 * reference, every layout of a, b and out, and a 2-D b shared by every entry. */
static void test_matmul_batched(void) {
  const int64_t cases[][4] = {{3, 37, 29, 53}, {5, 1, 17, 9}, {2, 64, 1, 130}}; /* Bt M N K */
  double worst[2] = {0, 0};
  for (int di = 0; di < 2; di++) {
    gdp_dtype dt = all_dtypes[di];
    double tol = dt == GDP_DTYPE_F32 ? 1e-5 : 1e-12;
    for (int ci = 0; ci < 3; ci++)
      for (int tr = 0; tr < 4; tr++)
        for (int layout = 0; layout < 5; layout++) {
          const int shared_b = layout == 4; /* b 2-D */
          int ta = tr & 1, tb = (tr >> 1) & 1;
          int64_t Bt = cases[ci][0], M = cases[ci][1], N = cases[ci][2], K = cases[ci][3];
          int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
          int la = layout % 4, lb = (layout + 1) % 4, lo = (layout + 2) % 4;
          double *va = random_values(Bt * (ar * ac + br * bc + M * N), 1.0);
          double *vb = va + Bt * ar * ac, *vc = vb + Bt * br * bc;
          double beta = (ci + tr + layout) % 2 ? 0.5 : 0.0;
          int64_t sb2[2] = {br, bc};
          gdp_tensor *g[3], *c[3];
          for (int d = 0; d < 2; d++) {
            gdp_ctx *x = d ? cpu : gpu;
            gdp_tensor **t = d ? c : g;
            t[0] = bmm_operand(x, dt, Bt, ar, ac, la, va);
            t[1] = shared_b ? upload(x, dt, 2, sb2, vb) : bmm_operand(x, dt, Bt, br, bc, lb, vb);
            t[2] = bmm_operand(x, dt, Bt, M, N, lo, vc);
          }
          char what[160];
          snprintf(what, sizeof what,
                   "batched %s Bt%lld M%lld N%lld K%lld ta%d tb%d layouts a%d b%d out%d",
                   gdp_dtype_name(dt), (long long)Bt, (long long)M, (long long)N, (long long)K,
                   ta, tb, la, shared_b ? -1 : lb, lo);
          check_matmul(what, g, c, ta, tb, 0.75, beta, tol, &worst[di]);
          free(va);
        }
  }
  printf("  batched matmul worst rel err to the float64 reference: f64 %.3g, f32 %.3g\n",
         worst[0], worst[1]);
}

/* ------------------------------------------------------------------ memory, errors */

static void test_oom_and_errors(int64_t baseline) {
  int64_t petabyte_f64 = (int64_t)1 << 47; /* 2^50 bytes */
  gdp_tensor *huge = NULL;
  CHECK_ERR(gdp_tensor_empty(gpu, GDP_DTYPE_F64, 1, &petabyte_f64, &huge), GDP_ERR_OOM,
            "bytes free of");
  CHECK(huge == NULL, "a failed allocation returned a tensor");
  printf("  OOM message: %s\n", gdp_last_error());
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CUDA) == baseline, "failed allocation changed live bytes");
  /* the context stays usable */
  gdp_tensor *t = NULL;
  int64_t n = 1000;
  CHECK_OK(gdp_tensor_zeros(gpu, GDP_DTYPE_F32, 1, &n, &t));
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CUDA) >= baseline + 4000, "live bytes did not grow");
  double s = -1;
  if (t) CHECK_OK(gdp_tensor_sum(t, &s));
  CHECK(s == 0.0, "sum of zeros after an OOM: %g", s);
  gdp_tensor_free(t);
  CHECK_OK(gdp_ctx_sync(gpu));
}

/* GDP_SYNC_EVERY_OP=1 (read at context creation): ops still give the same results. */
static void test_sync_every_op(void) {
  setenv("GDP_SYNC_EVERY_OP", "1", 1);
  gdp_ctx *sctx = NULL;
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CUDA, 0, &sctx));
  unsetenv("GDP_SYNC_EVERY_OP");
  if (!sctx) return;
  int64_t n = 777;
  double *v = random_values(n, 1.0);
  gdp_tensor *a = upload(sctx, GDP_DTYPE_F32, 1, &n, v), *b = NULL;
  if (a) CHECK_OK(gdp_tensor_clone(a, &b));
  if (a && b) {
    CHECK_OK(gdp_tensor_add(b, a, a, 1.0));
    double s = 0, sa = 0;
    CHECK_OK(gdp_tensor_sum(b, &s));
    CHECK_OK(gdp_tensor_sum(a, &sa));
    CHECK(fabs(s - 2 * sa) <= 1e-6 * fabs(sa) + 1e-6, "sync-every-op ctx: sum %g vs 2*%g", s, sa);
  }
  gdp_tensor_free(a);
  gdp_tensor_free(b);
  gdp_ctx_free(sctx);
  free(v);
}

/* The device timer: an empty hold-and-mark measures ~nothing, a queued axpy chain its
 * own time (below the host-synchronised time of the same chain, above a fraction of it
 * -- the spin is NOT inside), and a stop without a start is refused.  Run with
 * GDP_TEST_NO_TIMINGS set (under a sanitizer) the chain's bounds are printed only. */
static void test_device_timer(void) {
  double ms = -1;
  CHECK_ERR(gdp_ctx_timer_stop(gpu, &ms), GDP_ERR_INVALID_ARG, "no gdp_ctx_timer_start pending");
  CHECK_ERR(gdp_ctx_timer_start(gpu, 20000), GDP_ERR_INVALID_ARG, "hold_ms must be in (0, 10000]");
  CHECK_OK(gdp_ctx_timer_start(gpu, 5));
  CHECK_OK(gdp_ctx_timer_stop(gpu, &ms));
  CHECK(ms >= 0 && ms < 1.0, "an empty timed region took %g ms on the device (the 5 ms spin leaked in?)", ms);
  int64_t n = (int64_t)1 << 24;
  gdp_tensor *a = NULL, *b = NULL;
  CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_F32, 1, &n, &a));
  CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_F32, 1, &n, &b));
  if (a && b) {
    CHECK_OK(gdp_tensor_uniform(a, -1, 1));
    CHECK_OK(gdp_tensor_copy(NULL, b, a));
    CHECK_OK(gdp_ctx_sync(gpu));
    double t0 = gdp_time_now();
    for (int r = 0; r < 20; r++) CHECK_OK(gdp_tensor_add(b, b, a, 0.5));
    CHECK_OK(gdp_ctx_sync(gpu));
    double host_ms = (gdp_time_now() - t0) * 1e3;
    CHECK_OK(gdp_ctx_timer_start(gpu, 20));
    for (int r = 0; r < 20; r++) CHECK_OK(gdp_tensor_add(b, b, a, 0.5));
    CHECK_OK(gdp_ctx_timer_stop(gpu, &ms));
    /* (a sanitizer slows the device past the hold: GDP_TEST_NO_TIMINGS drops the bound) */
    if (getenv("GDP_TEST_NO_TIMINGS"))
      printf("  20 queued axpys: %g ms on the device, %g ms host-synchronised (GDP_TEST_NO_TIMINGS: "
             "bounds not checked)\n", ms, host_ms);
    else
      CHECK(ms > 0.2 * host_ms && ms < host_ms + 0.5 && ms < 20,
            "20 queued axpys: %g ms on the device, %g ms host-synchronised", ms, host_ms);
  }
  gdp_tensor_free(a);
  gdp_tensor_free(b);
}

/* ------------------------------------------------------------------ timings (info) */

static void report_timings(void) {
  int64_t n = (int64_t)1 << 26; /* 256 MB of f32 */
  gdp_tensor *a = NULL, *b = NULL;
  CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_F32, 1, &n, &a));
  CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_F32, 1, &n, &b));
  if (!a || !b) goto done;
  CHECK_OK(gdp_tensor_uniform(a, -1, 1));
  CHECK_OK(gdp_tensor_copy(NULL, b, a));
  CHECK_OK(gdp_ctx_sync(gpu));
  double t0 = gdp_time_now();
  for (int r = 0; r < 10; r++) CHECK_OK(gdp_tensor_add(b, b, a, 0.5));
  CHECK_OK(gdp_ctx_sync(gpu));
  double t1 = gdp_time_now();
  printf("  axpy f32 2^26: %.3f ms, %.0f GB/s (read 2, write 1)\n", (t1 - t0) / 10 * 1e3,
         3.0 * 4 * (double)n / ((t1 - t0) / 10) / 1e9);
  /* transposed copy [8192 x 8192] */
  {
    gdp_tensor *av = NULL, *bv = NULL, *at = NULL;
    int64_t sh[2] = {8192, 8192};
    CHECK_OK(gdp_tensor_view(a, 2, sh, &av));
    CHECK_OK(gdp_tensor_view(b, 2, sh, &bv));
    if (av) CHECK_OK(gdp_tensor_transpose(av, 0, 1, &at));
    if (at && bv) {
      CHECK_OK(gdp_tensor_copy(NULL, bv, at));
      CHECK_OK(gdp_ctx_sync(gpu));
      t0 = gdp_time_now();
      for (int r = 0; r < 10; r++) CHECK_OK(gdp_tensor_copy(NULL, bv, at));
      CHECK_OK(gdp_ctx_sync(gpu));
      t1 = gdp_time_now();
      printf("  transposed copy f32 8192^2: %.3f ms, %.0f GB/s\n", (t1 - t0) / 10 * 1e3,
             2.0 * 4 * (double)n / ((t1 - t0) / 10) / 1e9);
    }
    gdp_tensor_free(av);
    gdp_tensor_free(bv);
    gdp_tensor_free(at);
  }
  /* f32 matmul 4096^3 (no TF32) */
  {
    gdp_tensor *x = NULL, *y = NULL, *z = NULL;
    int64_t sh[2] = {4096, 4096};
    int64_t q = 4096 * 4096;
    gdp_tensor *x1 = NULL, *y1 = NULL;
    CHECK_OK(gdp_tensor_narrow(a, 0, 0, q, &x1));
    CHECK_OK(gdp_tensor_narrow(a, 0, q, q, &y1));
    if (x1) CHECK_OK(gdp_tensor_view(x1, 2, sh, &x));
    if (y1) CHECK_OK(gdp_tensor_view(y1, 2, sh, &y));
    CHECK_OK(gdp_tensor_empty(gpu, GDP_DTYPE_F32, 2, sh, &z));
    if (x && y && z) {
      CHECK_OK(gdp_tensor_matmul(z, x, y, 0, 0, 1.0, 0.0));
      CHECK_OK(gdp_ctx_sync(gpu));
      t0 = gdp_time_now();
      for (int r = 0; r < 5; r++) CHECK_OK(gdp_tensor_matmul(z, x, y, 0, 0, 1.0, 0.0));
      CHECK_OK(gdp_ctx_sync(gpu));
      t1 = gdp_time_now();
      printf("  matmul f32 4096^3: %.3f ms, %.1f TFLOP/s\n", (t1 - t0) / 5 * 1e3,
             2.0 * 4096.0 * 4096.0 * 4096.0 / ((t1 - t0) / 5) / 1e12);
    }
    gdp_tensor_free(x1);
    gdp_tensor_free(y1);
    gdp_tensor_free(x);
    gdp_tensor_free(y);
    gdp_tensor_free(z);
  }
done:
  gdp_tensor_free(a);
  gdp_tensor_free(b);
}

/* ------------------------------------------------------------------ main */

int main(void) {
  if (gdp_device_count(GDP_DEVICE_CUDA) == 0) {
    /* A CUDA build on a CPU-only machine: contexts must fail cleanly, with a reason. */
    gdp_ctx *c = NULL;
    gdp_status s = gdp_ctx_new(GDP_DEVICE_CUDA, 0, &c);
    const char *msg = gdp_last_error();
    if (c != NULL || (s != GDP_ERR_UNSUPPORTED && s != GDP_ERR_CUDA) ||
        (!strstr(msg, "no CUDA device") && !strstr(msg, "no cuda device"))) {
      printf("FAIL: without a CUDA device, gdp_ctx_new(cuda) gave %s (%s); expected "
             "GDP_ERR_UNSUPPORTED or GDP_ERR_CUDA mentioning \"no CUDA device\" (any case)\n",
             gdp_status_name(s), msg);
      gdp_ctx_free(c);
      return 1;
    }
    printf("SKIP: no CUDA device (gdp_ctx_new says: %s)\n", msg);
    return 77;
  }
  TEST_BEGIN(SEED);
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &cpu));
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CUDA, 0, &gpu));
  if (!cpu || !gpu) TEST_END();
  int64_t baseline = gdp_mem_live_bytes(GDP_DEVICE_CUDA);

  double t0 = gdp_time_now();
  test_round_trips();
  test_conversions();
  test_fill();
  test_rows();
  test_guards();
  test_rng();
  test_binary();
  test_binary_bf16_fast();
  test_sumsq_many();
  test_reduce();
  test_matmul();
  test_matmul_batched();
  test_oom_and_errors(baseline);
  test_sync_every_op();
  test_device_timer();
  CHECK_OK(gdp_ctx_sync(gpu));
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CUDA) == baseline,
        "cuda live bytes: %lld after freeing everything, %lld at the start",
        (long long)gdp_mem_live_bytes(GDP_DEVICE_CUDA), (long long)baseline);
  printf("  checks took %.2f s\n", gdp_time_now() - t0);
  if (!getenv("GDP_TEST_NO_TIMINGS")) report_timings();
  CHECK(gdp_mem_live_bytes(GDP_DEVICE_CUDA) == baseline, "live bytes after the timings");

  gdp_ctx_free(gpu);
  gdp_ctx_free(cpu);
  TEST_END();
}
