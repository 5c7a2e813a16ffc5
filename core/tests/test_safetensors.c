/*
 * test_safetensors.c -- safetensors load/save: round trips of every dtype (0-dim,
 * zero-size, non-contiguous views), metadata, the golden fixtures, and a battery of
 * malformed files that must each fail with GDP_ERR_IO (or UNSUPPORTED) and a message,
 * never a crash or a leak (run under -DGDP_SANITIZE=ON too).
 */
#define _GNU_SOURCE /* memmem */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gdp.h"
#include "testutil.h"

static char tmpdir[512];
static gdp_ctx *ctx;

static const char *tmp_path(const char *name) {
  static char buf[4][1024];
  static int slot;
  slot = (slot + 1) % 4;
  snprintf(buf[slot], sizeof buf[slot], "%s/%s", tmpdir, name);
  return buf[slot];
}

static unsigned char *read_all(const char *path, size_t *len) {
  FILE *fp = fopen(path, "rb");
  if (!fp) return NULL;
  fseek(fp, 0, SEEK_END);
  long n = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  unsigned char *b = malloc(n > 0 ? (size_t)n : 1);
  if (b && fread(b, 1, (size_t)n, fp) != (size_t)n) {
    free(b);
    b = NULL;
  }
  fclose(fp);
  *len = (size_t)n;
  return b;
}

static void write_all(const char *path, const void *data, size_t len) {
  FILE *fp = fopen(path, "wb");
  if (!fp) {
    tu_fail(__FILE__, __LINE__, "cannot write %s: %s", path, strerror(errno));
    return;
  }
  if (len && fwrite(data, 1, len, fp) != len) tu_fail(__FILE__, __LINE__, "short write %s", path);
  fclose(fp);
}

/* A file made of an 8-byte length field (as given), a header text and `data_len`
 * filler bytes: the raw material of the malformed-input battery. */
static void write_raw(const char *path, uint64_t len_field, const char *header, size_t header_len,
                      size_t data_len) {
  size_t n = 8 + header_len + data_len;
  unsigned char *b = malloc(n);
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)(len_field >> (8 * i));
  memcpy(b + 8, header, header_len);
  for (size_t i = 0; i < data_len; i++) b[8 + header_len + i] = (unsigned char)(i * 37 + 11);
  write_all(path, b, n);
  free(b);
}

static void write_header(const char *path, const char *header, size_t data_len) {
  write_raw(path, strlen(header), header, strlen(header), data_len);
}

/* ------------------------------------------------------------------ tensors with known bytes */

typedef struct expected {
  const char *name;
  gdp_dtype dtype;
  int ndim;
  int64_t shape[GDP_MAX_DIMS];
  unsigned char *bytes; /* row-major contents */
  size_t nbytes;
} expected;

static int64_t numel_of(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

/* Random row-major values of `dtype`, fresh and non-zero. */
static unsigned char *random_bytes(gdp_dtype dtype, int64_t n) {
  size_t es = gdp_dtype_size(dtype);
  unsigned char *b = malloc(n > 0 ? (size_t)n * es : 1);
  for (int64_t i = 0; i < n; i++) {
    unsigned char *p = b + (size_t)i * es;
    switch (dtype) {
      case GDP_DTYPE_F64: { double x = tu_rand_normal(); memcpy(p, &x, 8); break; }
      case GDP_DTYPE_F32: { float x = (float)tu_rand_normal(); memcpy(p, &x, 4); break; }
      case GDP_DTYPE_BF16: {
        uint16_t x = gdp_bf16_from_f32((float)tu_rand_normal());
        memcpy(p, &x, 2);
        break;
      }
      case GDP_DTYPE_I32: { int32_t x = (int32_t)(uint32_t)tu_rand_u64(); memcpy(p, &x, 4); break; }
      default: { int64_t x = (int64_t)tu_rand_u64(); memcpy(p, &x, 8); break; }
    }
  }
  return b;
}

static gdp_tensor *make_tensor(gdp_dtype dtype, int ndim, const int64_t *shape,
                               unsigned char **bytes_out) {
  int64_t n = numel_of(ndim, shape);
  unsigned char *b = random_bytes(dtype, n);
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_tensor_from_host(ctx, dtype, ndim, shape, dtype, b, (size_t)n * gdp_dtype_size(dtype), &t));
  *bytes_out = b;
  return t;
}

static void set_expected(expected *e, const char *name, gdp_dtype dtype, int ndim,
                         const int64_t *shape, unsigned char *bytes) {
  e->name = name;
  e->dtype = dtype;
  e->ndim = ndim;
  for (int i = 0; i < ndim; i++) e->shape[i] = shape[i];
  e->bytes = bytes;
  e->nbytes = (size_t)numel_of(ndim, shape) * gdp_dtype_size(dtype);
}

/* The row-major contents of a 2-D strided view of src (elements of es bytes): what
 * saving the view must write. */
static void gather_2d(unsigned char *dst, const unsigned char *src, size_t es, int64_t out_rows,
                      int64_t out_cols, int64_t row_stride, int64_t col_stride, int64_t offset) {
  for (int64_t i = 0; i < out_rows; i++)
    for (int64_t j = 0; j < out_cols; j++)
      memcpy(dst + (size_t)(i * out_cols + j) * es,
             src + (size_t)(offset + i * row_stride + j * col_stride) * es, es);
}

static void check_tensor(const gdp_st_file *f, int64_t i, const expected *e) {
  const char *name = gdp_st_name(f, i);
  CHECK(name && strcmp(name, e->name) == 0, "tensor %lld: name '%s', expected '%s'", (long long)i,
        name ? name : "(null)", e->name);
  gdp_tensor *t = NULL;
  CHECK_OK(gdp_st_tensor(f, i, &t));
  if (!t) return;
  CHECK(gdp_tensor_dtype(t) == e->dtype, "%s: dtype %s, expected %s", e->name,
        gdp_dtype_name(gdp_tensor_dtype(t)), gdp_dtype_name(e->dtype));
  CHECK(gdp_tensor_ndim(t) == e->ndim, "%s: ndim %d, expected %d", e->name, gdp_tensor_ndim(t), e->ndim);
  int same_shape = gdp_tensor_ndim(t) == e->ndim;
  for (int d = 0; same_shape && d < e->ndim; d++) same_shape = gdp_tensor_size(t, d) == e->shape[d];
  CHECK(same_shape, "%s: shape differs", e->name);
  if (same_shape && gdp_tensor_dtype(t) == e->dtype) {
    unsigned char *got = malloc(e->nbytes ? e->nbytes : 1);
    CHECK_OK(gdp_tensor_to_host(t, e->dtype, got, e->nbytes));
    CHECK(e->nbytes == 0 || memcmp(got, e->bytes, e->nbytes) == 0, "%s: %zu bytes differ", e->name,
          e->nbytes);
    free(got);
  }
  gdp_tensor_free(t);
}

static int count_tmp_leftovers(void) {
  DIR *d = opendir(tmpdir);
  int n = 0;
  struct dirent *de;
  while (d && (de = readdir(d)))
    if (strstr(de->d_name, ".tmp.")) n++;
  if (d) closedir(d);
  return n;
}

/* ------------------------------------------------------------------ round trip */

static void test_round_trip(void) {
  enum { N = 14 };
  const char *names[N] = {"f64_3d", "f32_vec", "bf16_2d", "i32_3d", "i64_scalar", "f32_empty",
                          "f64_empty_mid", "bf16_scalar", "i64_8d", "f32_transposed",
                          "i32_narrowed", "f64_selected", "bf16_transposed", "i64_vec"};
  gdp_tensor *tensors[N] = {0};
  gdp_tensor *bases[N] = {0};
  unsigned char *base_bytes[N] = {0};
  expected exp[N];
  memset(exp, 0, sizeof exp);

  /* Contiguous tensors of every dtype, odd sizes, 0-dim and zero-size among them. */
  static const struct { gdp_dtype dt; int nd; int64_t sh[8]; } plain[9] = {
      {GDP_DTYPE_F64, 3, {5, 7, 3}}, {GDP_DTYPE_F32, 1, {13}},   {GDP_DTYPE_BF16, 2, {3, 5}},
      {GDP_DTYPE_I32, 3, {2, 3, 4}}, {GDP_DTYPE_I64, 0, {0}},    {GDP_DTYPE_F32, 1, {0}},
      {GDP_DTYPE_F64, 3, {3, 0, 2}}, {GDP_DTYPE_BF16, 0, {0}},
      {GDP_DTYPE_I64, 8, {1, 1, 1, 1, 1, 1, 1, 9}}};
  for (int i = 0; i < 9; i++) {
    unsigned char *b;
    tensors[i] = make_tensor(plain[i].dt, plain[i].nd, plain[i].sh, &b);
    set_expected(&exp[i], names[i], plain[i].dt, plain[i].nd, plain[i].sh, b);
  }

  /* Non-contiguous views: what gets saved is their logical row-major contents. */
  {
    int64_t sh[2] = {4, 6}, out[2] = {6, 4};
    bases[9] = make_tensor(GDP_DTYPE_F32, 2, sh, &base_bytes[9]);
    CHECK_OK(gdp_tensor_transpose(bases[9], 0, 1, &tensors[9]));
    unsigned char *b = malloc(24 * 4);
    gather_2d(b, base_bytes[9], 4, 6, 4, 1, 6, 0);
    set_expected(&exp[9], names[9], GDP_DTYPE_F32, 2, out, b);
  }
  {
    int64_t sh[2] = {5, 7}, out[2] = {5, 3};
    bases[10] = make_tensor(GDP_DTYPE_I32, 2, sh, &base_bytes[10]);
    CHECK_OK(gdp_tensor_narrow(bases[10], 1, 2, 3, &tensors[10]));
    unsigned char *b = malloc(15 * 4);
    gather_2d(b, base_bytes[10], 4, 5, 3, 7, 1, 2);
    set_expected(&exp[10], names[10], GDP_DTYPE_I32, 2, out, b);
  }
  {
    int64_t sh[3] = {3, 4, 5}, out[2] = {3, 5};
    bases[11] = make_tensor(GDP_DTYPE_F64, 3, sh, &base_bytes[11]);
    CHECK_OK(gdp_tensor_select(bases[11], 1, 2, &tensors[11])); /* [3,5], strides (20, 1) */
    unsigned char *b = malloc(15 * 8);
    gather_2d(b, base_bytes[11], 8, 3, 5, 20, 1, 10);
    set_expected(&exp[11], names[11], GDP_DTYPE_F64, 2, out, b);
  }
  {
    int64_t sh[2] = {3, 7}, out[2] = {7, 3};
    bases[12] = make_tensor(GDP_DTYPE_BF16, 2, sh, &base_bytes[12]);
    CHECK_OK(gdp_tensor_transpose(bases[12], 0, 1, &tensors[12]));
    unsigned char *b = malloc(21 * 2);
    gather_2d(b, base_bytes[12], 2, 7, 3, 1, 7, 0);
    set_expected(&exp[12], names[12], GDP_DTYPE_BF16, 2, out, b);
  }
  {
    int64_t sh[1] = {11};
    unsigned char *b;
    tensors[13] = make_tensor(GDP_DTYPE_I64, 1, sh, &b);
    set_expected(&exp[13], names[13], GDP_DTYPE_I64, 1, sh, b);
  }
  CHECK(tensors[9] && !gdp_tensor_is_contiguous(tensors[9]), "transposed view should not be contiguous");
  CHECK(tensors[11] && !gdp_tensor_is_contiguous(tensors[11]), "selected view should not be contiguous");

  const char *meta_keys[5] = {"num_householder", "quote\"key", "unicode", "empty", "layout"};
  const char *meta_vals[5] = {"3", "back\\slash\nnew line\ttab", "beta \xce\xb2 \xe2\x89\x88 0.5",
                              "", "q[B,T,H,K] {json-looking: [1, 2]}"};

  const char *path = tmp_path("round_trip.safetensors");
  CHECK_OK(gdp_safetensors_save(path, N, names, (const gdp_tensor *const *)tensors, 5, meta_keys,
                                meta_vals));
  CHECK(count_tmp_leftovers() == 0, "temporary file left behind after a save");

  /* Layout on disk: 8-byte aligned data start, space padding, exact size. */
  size_t len = 0;
  unsigned char *raw = read_all(path, &len);
  CHECK(raw && len >= 8, "saved file unreadable");
  if (raw && len >= 8) {
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | raw[i];
    size_t data = 0;
    for (int i = 0; i < N; i++) data += exp[i].nbytes;
    CHECK((8 + hlen) % 8 == 0, "data section starts at %llu, not 8-byte aligned",
          (unsigned long long)(8 + hlen));
    CHECK(len == 8 + hlen + data, "file is %zu bytes, expected %llu", len,
          (unsigned long long)(8 + hlen + data));
    CHECK(hlen > 0 && raw[8] == '{', "header does not start with '{'");
    size_t last = 8 + hlen - 1;
    while (last > 8 && raw[last] == ' ') last--;
    CHECK(raw[last] == '}' && 8 + hlen - 1 - last < 8, "header padding is not 0..7 spaces after '}'");
    CHECK(memmem(raw + 8, hlen, "\"__metadata__\"", 14) != NULL, "no __metadata__ in the header");
  }
  free(raw);

  gdp_st_file *f = NULL;
  CHECK_OK(gdp_safetensors_load(ctx, path, &f));
  if (f) {
    CHECK(gdp_st_count(f) == N, "count %lld, expected %d", (long long)gdp_st_count(f), N);
    /* Saved in the given order, so offset order is the given order (the two empty
     * tensors share an offset and must still keep it). */
    for (int i = 0; i < N && i < gdp_st_count(f); i++) check_tensor(f, i, &exp[i]);
    CHECK(gdp_st_meta_count(f) == 5, "meta count %lld, expected 5", (long long)gdp_st_meta_count(f));
    for (int i = 0; i < 5 && i < gdp_st_meta_count(f); i++) {
      CHECK(strcmp(gdp_st_meta_key(f, i), meta_keys[i]) == 0, "meta key %d: '%s'", i, gdp_st_meta_key(f, i));
      CHECK(strcmp(gdp_st_meta_value(f, i), meta_vals[i]) == 0, "meta value %d: '%s'", i,
            gdp_st_meta_value(f, i));
    }
    CHECK(gdp_st_name(f, N) == NULL && gdp_st_name(f, -1) == NULL, "out-of-range name not NULL");
    CHECK(gdp_st_meta_key(f, 5) == NULL && gdp_st_meta_value(f, -1) == NULL, "out-of-range meta not NULL");
    gdp_tensor *t = (gdp_tensor *)1;
    CHECK_ERR(gdp_st_tensor(f, N, &t), GDP_ERR_INVALID_ARG, "out of range");
    CHECK(t == NULL, "failed gdp_st_tensor must set *out = NULL");

    /* A tensor outlives the file it came from. */
    gdp_tensor *kept = NULL;
    CHECK_OK(gdp_st_tensor(f, 0, &kept));
    gdp_st_free(f);
    if (kept) {
      unsigned char *got = malloc(exp[0].nbytes);
      CHECK_OK(gdp_tensor_to_host(kept, GDP_DTYPE_F64, got, exp[0].nbytes));
      CHECK(memcmp(got, exp[0].bytes, exp[0].nbytes) == 0, "tensor changed after gdp_st_free");
      free(got);
      gdp_tensor_free(kept);
    }
  }

  /* Saving again over the file replaces it atomically; no metadata this time. */
  CHECK_OK(gdp_safetensors_save(path, 2, names + 1, (const gdp_tensor *const *)tensors + 1, 0, NULL, NULL));
  f = NULL;
  CHECK_OK(gdp_safetensors_load(ctx, path, &f));
  if (f) {
    CHECK(gdp_st_count(f) == 2 && gdp_st_meta_count(f) == 0, "overwritten file: %lld tensors, %lld meta",
          (long long)gdp_st_count(f), (long long)gdp_st_meta_count(f));
    if (gdp_st_count(f) == 2) {
      check_tensor(f, 0, &exp[1]);
      check_tensor(f, 1, &exp[2]);
    }
    gdp_st_free(f);
  }

  /* An empty file set is a valid file. */
  const char *empty = tmp_path("empty.safetensors");
  CHECK_OK(gdp_safetensors_save(empty, 0, NULL, NULL, 0, NULL, NULL));
  f = NULL;
  CHECK_OK(gdp_safetensors_load(ctx, empty, &f));
  CHECK(f && gdp_st_count(f) == 0 && gdp_st_meta_count(f) == 0, "empty file not empty");
  gdp_st_free(f);

  for (int i = 0; i < N; i++) {
    gdp_tensor_free(tensors[i]);
    gdp_tensor_free(bases[i]);
    free(base_bytes[i]);
    free(exp[i].bytes);
  }
}

/* ------------------------------------------------------------------ save errors */

static void test_save_errors(void) {
  int64_t sh[1] = {3};
  unsigned char *b;
  gdp_tensor *t = make_tensor(GDP_DTYPE_F32, 1, sh, &b);
  const gdp_tensor *two[2] = {t, t};
  const char *path = tmp_path("save_errors.safetensors");

  const char *dup[2] = {"w", "w"};
  CHECK_ERR(gdp_safetensors_save(path, 2, dup, two, 0, NULL, NULL), GDP_ERR_INVALID_ARG, "'w' appears twice");
  const char *empty_name[2] = {"a", ""};
  CHECK_ERR(gdp_safetensors_save(path, 2, empty_name, two, 0, NULL, NULL), GDP_ERR_INVALID_ARG, "names[1] is empty");
  const char *null_name[2] = {"a", NULL};
  CHECK_ERR(gdp_safetensors_save(path, 2, null_name, two, 0, NULL, NULL), GDP_ERR_INVALID_ARG, "names[1] is NULL");
  const char *reserved[1] = {"__metadata__"};
  CHECK_ERR(gdp_safetensors_save(path, 1, reserved, two, 0, NULL, NULL), GDP_ERR_INVALID_ARG, "reserves");
  const gdp_tensor *null_t[2] = {t, NULL};
  const char *ab[2] = {"a", "b"};
  CHECK_ERR(gdp_safetensors_save(path, 2, ab, null_t, 0, NULL, NULL), GDP_ERR_INVALID_ARG, "'b' (tensors[1]) is NULL");
  const char *mk[2] = {"k", "k"}, *mv[2] = {"1", "2"};
  CHECK_ERR(gdp_safetensors_save(path, 2, ab, two, 2, mk, mv), GDP_ERR_INVALID_ARG, "metadata key 'k' appears twice");
  const char *mk1[1] = {"k"}, *mvnull[1] = {NULL};
  CHECK_ERR(gdp_safetensors_save(path, 2, ab, two, 1, mk1, mvnull), GDP_ERR_INVALID_ARG, "metadata entry 0");
  CHECK_ERR(gdp_safetensors_save(NULL, 2, ab, two, 0, NULL, NULL), GDP_ERR_INVALID_ARG, "path is NULL");
  CHECK_ERR(gdp_safetensors_save(path, -1, ab, two, 0, NULL, NULL), GDP_ERR_INVALID_ARG, "count");
  CHECK(access(path, F_OK) != 0, "a rejected save created %s", path);

  const char *missing_dir = tmp_path("no/such/dir/x.safetensors");
  CHECK_ERR(gdp_safetensors_save(missing_dir, 2, ab, two, 0, NULL, NULL), GDP_ERR_IO, strerror(ENOENT));

  /* rename() over a directory fails: the save must fail cleanly, leaving no temp file. */
  const char *dir = tmp_path("a_directory");
  mkdir(dir, 0755);
  CHECK_ERR(gdp_safetensors_save(dir, 2, ab, two, 0, NULL, NULL), GDP_ERR_IO, "a_directory");
  CHECK(count_tmp_leftovers() == 0, "temporary file left behind after a failed save");
  rmdir(dir);

  gdp_tensor_free(t);
  free(b);
}

/* ------------------------------------------------------------------ golden fixtures */

static const char *fixture(const char *name) {
  static char buf[1024];
  const char *root = getenv("GDP_SOURCE_DIR"); /* ctest runs from the source root anyway */
  snprintf(buf, sizeof buf, "%s%sspec/fixtures/golden/%s", root ? root : "", root ? "/" : "", name);
  return buf;
}

static double *tensor_f64(const gdp_st_file *f, const char *name, int64_t *n) {
  for (int64_t i = 0; i < gdp_st_count(f); i++) {
    if (strcmp(gdp_st_name(f, i), name) != 0) continue;
    gdp_tensor *t = NULL;
    if (gdp_st_tensor(f, i, &t) != GDP_OK) return NULL;
    *n = gdp_tensor_numel(t);
    double *v = malloc((size_t)*n * sizeof *v + 1);
    gdp_status s = gdp_tensor_to_host(t, gdp_tensor_dtype(t), v, (size_t)*n * gdp_dtype_size(gdp_tensor_dtype(t)));
    gdp_tensor_free(t);
    if (s != GDP_OK) { free(v); return NULL; }
    return v;
  }
  return NULL;
}

static const char *meta(const gdp_st_file *f, const char *key) {
  for (int64_t i = 0; i < gdp_st_meta_count(f); i++)
    if (strcmp(gdp_st_meta_key(f, i), key) == 0) return gdp_st_meta_value(f, i);
  return NULL;
}

static void test_golden(void) {
  gdp_st_file *f = NULL;
  CHECK_OK(gdp_safetensors_load(ctx, fixture("gdp_n1_basic.safetensors"), &f));
  if (!f) return;
  /* Header order is alphabetical and so are the offsets in this file. */
  static const char *order[14] = {"beta", "dbeta", "dg", "dht", "dk", "do", "dq",
                                  "dv",   "g",     "ht", "k",   "o",  "q",  "v"};
  CHECK(gdp_st_count(f) == 14, "golden count %lld", (long long)gdp_st_count(f));
  for (int i = 0; i < 14 && i < gdp_st_count(f); i++)
    CHECK(strcmp(gdp_st_name(f, i), order[i]) == 0, "golden name %d: '%s', expected '%s'", i,
          gdp_st_name(f, i), order[i]);
  const char *nh = meta(f, "num_householder"), *scale = meta(f, "scale");
  CHECK(gdp_st_meta_count(f) == 8, "golden meta count %lld", (long long)gdp_st_meta_count(f));
  CHECK(nh && strcmp(nh, "1") == 0, "num_householder '%s'", nh ? nh : "(missing)");
  CHECK(scale && fabs(atof(scale) - 1 / sqrt(32.0)) < 1e-15, "scale '%s'", scale ? scale : "(missing)");
  CHECK(meta(f, "use_qk_l2norm") && strcmp(meta(f, "use_qk_l2norm"), "true") == 0, "use_qk_l2norm");

  /* Shapes follow the layouts: q [B,T,H,K], k [B,T*n,H,K], g [B,T,H], ht [N,H,K,V]. */
  for (int64_t i = 0; i < gdp_st_count(f); i++) {
    gdp_tensor *t = NULL;
    CHECK_OK(gdp_st_tensor(f, i, &t));
    const char *name = gdp_st_name(f, i);
    CHECK(gdp_tensor_dtype(t) == GDP_DTYPE_F64, "%s is not f64", name);
    int nd = gdp_tensor_ndim(t);
    if (!strcmp(name, "q") || !strcmp(name, "k") || !strcmp(name, "v") || !strcmp(name, "o"))
      CHECK(nd == 4 && gdp_tensor_size(t, 0) == 2 && gdp_tensor_size(t, 1) == 64 &&
                gdp_tensor_size(t, 2) == 2 && gdp_tensor_size(t, 3) == 32,
            "%s: shape not [2,64,2,32]", name);
    if (!strcmp(name, "g") || !strcmp(name, "beta"))
      CHECK(nd == 3 && gdp_tensor_size(t, 0) == 2 && gdp_tensor_size(t, 1) == 64 && gdp_tensor_size(t, 2) == 2,
            "%s: shape not [2,64,2]", name);
    if (!strcmp(name, "ht"))
      CHECK(nd == 4 && gdp_tensor_size(t, 1) == 2 && gdp_tensor_size(t, 2) == 32 && gdp_tensor_size(t, 3) == 32,
            "ht: shape not [2,2,32,32]");
    gdp_tensor_free(t);
  }
  /* The values, against sums and end elements read with Python's struct module. */
  static const struct { const char *name; double sum, first, last; } vals[4] = {
      {"q", 75.63680472101179, -0.31128955419003207, 1.4226923058680676},
      {"v", -110.30676650594842, -0.32170223962258243, -0.19172305192673372},
      {"g", -51.074356930112614, -0.11755408320470913, -0.31551067406463884},
      {"beta", 131.26720340388093, 0.8550397730199389, 0.3618105786844717}};
  for (int j = 0; j < 4; j++) {
    int64_t n = 0;
    double *v = tensor_f64(f, vals[j].name, &n);
    CHECK(v != NULL, "golden %s unreadable", vals[j].name);
    if (!v) continue;
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += v[i];
    CHECK(fabs(s - vals[j].sum) <= 1e-12 * fabs(vals[j].sum), "%s: sum %.17g, expected %.17g",
          vals[j].name, s, vals[j].sum);
    CHECK(v[0] == vals[j].first && v[n - 1] == vals[j].last, "%s: end elements %.17g %.17g",
          vals[j].name, v[0], v[n - 1]);
    free(v);
  }
  gdp_st_free(f);

  /* Packed case: cu_seqlens is int64 and comes first by offset. */
  f = NULL;
  CHECK_OK(gdp_safetensors_load(ctx, fixture("gdp_n3_varlen.safetensors"), &f));
  if (!f) return;
  CHECK(strcmp(gdp_st_name(f, 0), "cu_seqlens") == 0, "first tensor '%s'", gdp_st_name(f, 0));
  gdp_tensor *cu = NULL;
  CHECK_OK(gdp_st_tensor(f, 0, &cu));
  if (cu) {
    int64_t got[5] = {0}, want[5] = {0, 37, 64, 200, 300};
    CHECK(gdp_tensor_dtype(cu) == GDP_DTYPE_I64 && gdp_tensor_numel(cu) == 5, "cu_seqlens not i64[5]");
    if (gdp_tensor_numel(cu) == 5) CHECK_OK(gdp_tensor_to_host(cu, GDP_DTYPE_I64, got, sizeof got));
    CHECK(memcmp(got, want, sizeof got) == 0, "cu_seqlens %lld %lld %lld %lld %lld", (long long)got[0],
          (long long)got[1], (long long)got[2], (long long)got[3], (long long)got[4]);
    gdp_tensor_free(cu);
  }
  CHECK(meta(f, "num_householder") && strcmp(meta(f, "num_householder"), "3") == 0, "n3 num_householder");

  /* Re-saving a real file and loading it back keeps every tensor bit for bit. */
  int64_t n = gdp_st_count(f);
  const char **names = calloc((size_t)n, sizeof *names);
  gdp_tensor **ts = calloc((size_t)n, sizeof *ts);
  for (int64_t i = 0; i < n; i++) {
    names[i] = gdp_st_name(f, i);
    CHECK_OK(gdp_st_tensor(f, i, &ts[i]));
  }
  const char *path = tmp_path("resaved.safetensors");
  CHECK_OK(gdp_safetensors_save(path, n, names, (const gdp_tensor *const *)ts, 0, NULL, NULL));
  gdp_st_file *g = NULL;
  CHECK_OK(gdp_safetensors_load(ctx, path, &g));
  CHECK(g && gdp_st_count(g) == n, "resaved count");
  for (int64_t i = 0; g && i < n && i < gdp_st_count(g); i++) {
    expected e;
    size_t nb = (size_t)gdp_tensor_numel(ts[i]) * gdp_dtype_size(gdp_tensor_dtype(ts[i]));
    unsigned char *bytes = malloc(nb ? nb : 1);
    CHECK_OK(gdp_tensor_to_host(ts[i], gdp_tensor_dtype(ts[i]), bytes, nb));
    int64_t sh[GDP_MAX_DIMS];
    for (int d = 0; d < gdp_tensor_ndim(ts[i]); d++) sh[d] = gdp_tensor_size(ts[i], d);
    set_expected(&e, names[i], gdp_tensor_dtype(ts[i]), gdp_tensor_ndim(ts[i]), sh, bytes);
    check_tensor(g, i, &e);
    free(bytes);
  }
  gdp_st_free(g);
  for (int64_t i = 0; i < n; i++) gdp_tensor_free(ts[i]);
  free(ts);
  free(names);
  gdp_st_free(f);
}

/* ------------------------------------------------------------------ malformed input */

/* A failing load: the expected status, *out NULL, a message naming the file and
 * containing `needle`. */
static void expect_load_fails(const char *path, gdp_status want, const char *needle, int line) {
  gdp_st_file *f = (gdp_st_file *)1;
  gdp_status s = gdp_safetensors_load(ctx, path, &f);
  tu_check_err(s, want, needle, path, __FILE__, line);
  CHECK(f == NULL, "line %d: failed load must set *out = NULL", line);
  if (s == GDP_OK) gdp_st_free(f);
  const char *base = strrchr(path, '/');
  CHECK(strstr(gdp_last_error(), base ? base + 1 : path) != NULL,
        "line %d: message does not name the file: %s", line, gdp_last_error());
}
#define EXPECT_FAIL(path, status, needle) expect_load_fails((path), (status), (needle), __LINE__)

static void test_truncation(void) {
  /* A small valid file whose last tensor is not empty, so every prefix is damaged. */
  int64_t s1[2] = {2, 3}, s2[1] = {5};
  unsigned char *b1, *b2;
  gdp_tensor *t[2] = {make_tensor(GDP_DTYPE_F32, 2, s1, &b1), make_tensor(GDP_DTYPE_I64, 1, s2, &b2)};
  const char *names[2] = {"w", "idx"}, *mk[1] = {"note"}, *mv[1] = {"small"};
  const char *full = tmp_path("small.safetensors");
  CHECK_OK(gdp_safetensors_save(full, 2, names, (const gdp_tensor *const *)t, 1, mk, mv));
  size_t len = 0;
  unsigned char *raw = read_all(full, &len);
  CHECK(raw && len > 8 + 2 + 24 + 40, "small file of %zu bytes", len);
  const char *cut = tmp_path("truncated.safetensors");
  int failures_before = tu_failures;
  for (size_t n = 0; raw && n < len; n++) {
    write_all(cut, raw, n);
    EXPECT_FAIL(cut, GDP_ERR_IO, "");
    if (tu_failures > failures_before + 3) break; /* one broken rule fails every prefix */
  }
  /* The untruncated file still loads. */
  write_all(cut, raw, len);
  gdp_st_file *f = NULL;
  CHECK_OK(gdp_safetensors_load(ctx, cut, &f));
  gdp_st_free(f);

  /* Damage every header byte a few ways: each load must succeed or fail cleanly. */
  uint64_t hlen = 0;
  for (int i = 7; raw && i >= 0; i--) hlen = (hlen << 8) | raw[i];
  static const unsigned char subst[] = {'0', '9', '-', '"', '[', ']', '{', '}', ',', ':', ' ',
                                        0x00, 0xff, 'e', '.'};
  int loaded = 0, failed = 0;
  for (size_t pos = 0; raw && pos < 8 + hlen && pos < len; pos++) {
    for (size_t k = 0; k < sizeof subst; k++) {
      if (raw[pos] == subst[k]) continue;
      unsigned char saved = raw[pos];
      raw[pos] = subst[k];
      write_all(cut, raw, len);
      raw[pos] = saved;
      f = NULL;
      gdp_status s = gdp_safetensors_load(ctx, cut, &f);
      if (s == GDP_OK) {
        loaded++;
        CHECK(f != NULL, "OK without a file");
        gdp_st_free(f);
      } else {
        failed++;
        CHECK((s == GDP_ERR_IO || s == GDP_ERR_UNSUPPORTED) && gdp_last_error()[0] && f == NULL,
              "byte %zu := 0x%02x: %s '%s'", pos, subst[k], gdp_status_name(s), gdp_last_error());
      }
    }
  }
  printf("header mutations: %d loaded, %d rejected\n", loaded, failed);
  CHECK(failed > loaded, "most header damage should be caught (%d loaded, %d rejected)", loaded, failed);
  free(raw);
  gdp_tensor_free(t[0]);
  gdp_tensor_free(t[1]);
  free(b1);
  free(b2);
}

static void test_malformed(void) {
  const char *p = tmp_path("bad.safetensors");
  const char *ok = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}";
  gdp_st_file *unused_ok = NULL;

  EXPECT_FAIL(tmp_path("does_not_exist.safetensors"), GDP_ERR_IO, strerror(ENOENT));
  EXPECT_FAIL(tmpdir, GDP_ERR_IO, "regular file");

  write_all(p, "\x05\0\0\0\0", 5);
  EXPECT_FAIL(p, GDP_ERR_IO, "too short");
  write_raw(p, strlen(ok) + 17, ok, strlen(ok), 16); /* length field past the end */
  EXPECT_FAIL(p, GDP_ERR_IO, "header length");
  write_raw(p, UINT64_MAX, ok, strlen(ok), 16);
  EXPECT_FAIL(p, GDP_ERR_IO, "header length");
  write_raw(p, 0, ok, strlen(ok), 16);
  EXPECT_FAIL(p, GDP_ERR_IO, "header length");
  write_raw(p, 1ull << 40, ok, strlen(ok), 16);
  EXPECT_FAIL(p, GDP_ERR_IO, "header length");

  static const struct { const char *header; size_t data; gdp_status status; const char *needle; } cases[] = {
      {"{\"a\":", 0, GDP_ERR_IO, "not valid JSON"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}", 16, GDP_ERR_IO, "not valid JSON"},
      {"[1,2]", 0, GDP_ERR_IO, "must be a JSON object"},
      {"\"str\"", 0, GDP_ERR_IO, "must be a JSON object"},
      {"{}  x", 0, GDP_ERR_IO, "after the JSON"},
      {"{\"a\":{\"dtype\":\"XYZ\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, GDP_ERR_IO, "unknown dtype \"XYZ\""},
      {"{\"a\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, GDP_ERR_IO, "\"dtype\" must be a string"},
      {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, GDP_ERR_IO, "tensor 'a': \"dtype\""},
      {"{\"half\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]}}", 8, GDP_ERR_UNSUPPORTED, "'half' has dtype F16"},
      {"{\"u8\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,4]}}", 4, GDP_ERR_IO, "needs 3"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,1000]}}", 16, GDP_ERR_IO, "run past"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 24, GDP_ERR_IO, "overlap"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 16, GDP_ERR_IO, "needs 16"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1,2],\"data_offsets\":[0,8]}}", 8, GDP_ERR_IO, "shape[0] must be a non-negative integer, got -1"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,8]}}", 8, GDP_ERR_IO, "got 1.5"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8, GDP_ERR_IO, "got a string"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8, GDP_ERR_IO, "\"shape\" must be an array"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", 8, GDP_ERR_IO, "9 dims"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,16]}}", 16, GDP_ERR_IO, "needs more than"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, GDP_ERR_IO, "[begin, end]"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,16]}}", 16, GDP_ERR_IO, "[begin, end]"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, GDP_ERR_IO, "data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, GDP_ERR_IO, "end before they begin"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}}", 8, GDP_ERR_IO, "got [-8, 0]"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,1e300]}}", 8, GDP_ERR_IO, "non-negative integers"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,\"8\"]}}", 8, GDP_ERR_IO, "got [0, a string]"},
      {"{\"a\":5}", 0, GDP_ERR_IO, "entry must be an object"},
      {"{\"\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, GDP_ERR_IO, "empty name"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, GDP_ERR_IO, "'a' appears twice"},
      {"{\"__metadata__\":{\"k\":1}}", 0, GDP_ERR_IO, "\"k\" must be a string"},
      {"{\"__metadata__\":[\"k\"]}", 0, GDP_ERR_IO, "must be an object"},
      {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, GDP_ERR_IO, "\"k\" appears twice"},
      {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, GDP_ERR_IO, "appears twice"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    write_header(p, cases[i].header, cases[i].data);
    gdp_st_file *f = (gdp_st_file *)1;
    gdp_status s = gdp_safetensors_load(ctx, p, &f);
    tu_check_err(s, cases[i].status, cases[i].needle, cases[i].header, __FILE__, __LINE__);
    CHECK(f == NULL, "case %zu: *out not NULL", i);
    CHECK(strstr(gdp_last_error(), "bad.safetensors") != NULL, "case %zu: message lacks the file: %s", i,
          gdp_last_error());
    if (s == GDP_OK) gdp_st_free(f);
  }

  /* An empty tensor whose other sizes multiply past int64 (its row-major strides would
   * overflow), in either order of the dims: damage, not a tensor. */
  write_header(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[0,9007199254740992,9007199254740992],"
                  "\"data_offsets\":[0,0]}}", 0);
  EXPECT_FAIL(p, GDP_ERR_IO, "too large");
  write_header(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[9007199254740992,9007199254740992,0],"
                  "\"data_offsets\":[0,0]}}", 0);
  EXPECT_FAIL(p, GDP_ERR_IO, "too large");

  /* A NUL byte inside the header. */
  write_raw(p, 20, "{\"a\":\0 \"b\"}        ", 20, 0);
  EXPECT_FAIL(p, GDP_ERR_IO, "NUL");

  /* Nesting deeper than cJSON's limit. */
  enum { DEPTH = 3000 };
  char *deep = malloc(2 * DEPTH + 16);
  size_t k = 0;
  k += (size_t)sprintf(deep, "{\"a\":");
  for (int i = 0; i < DEPTH; i++) deep[k++] = '[';
  for (int i = 0; i < DEPTH; i++) deep[k++] = ']';
  deep[k++] = '}';
  deep[k] = '\0';
  write_header(p, deep, 0);
  EXPECT_FAIL(p, GDP_ERR_IO, "");
  free(deep);

  /* The reference reader's layout rules: the tensors tile the data section exactly --
   * no gap before the first, none between two, no bytes after the last. */
  write_header(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16);
  EXPECT_FAIL(p, GDP_ERR_IO, "gap of 8 bytes before tensor 'a'");
  write_header(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20);
  EXPECT_FAIL(p, GDP_ERR_IO, "gap of 4 bytes before tensor 'b'");
  write_header(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 9);
  EXPECT_FAIL(p, GDP_ERR_IO, "1 byte after the last tensor");
  write_header(p, "{}", 3);
  EXPECT_FAIL(p, GDP_ERR_IO, "3 bytes after the last tensor");
  write_header(p, "{\"__metadata__\":{\"k\":\"v\"}}", 0);
  CHECK_OK(gdp_safetensors_load(ctx, p, &unused_ok));
  gdp_st_free(unused_ok);
  unused_ok = NULL;

  /* NUL inside a name or a metadata string (as the JSON escape \u0000) would be cut
   * short by C strings: an error, not a different name.  An escaped backslash before
   * "u0000" is text, not a NUL. */
  write_header(p, "{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
  EXPECT_FAIL(p, GDP_ERR_IO, "NUL");
  write_header(p, "{\"__metadata__\":{\"k\":\"x\\u0000y\"}}", 0);
  EXPECT_FAIL(p, GDP_ERR_IO, "NUL");
  write_header(p, "{\"__metadata__\":{\"k\\U0000\":\"x\"}}", 0);
  EXPECT_FAIL(p, GDP_ERR_IO, "");
  write_header(p, "{\"__metadata__\":{\"k\":\"x\\\\u0000y\"}}", 0);
  CHECK_OK(gdp_safetensors_load(ctx, p, &unused_ok));
  if (unused_ok) {
    CHECK(gdp_st_meta_count(unused_ok) == 1 && !strcmp(gdp_st_meta_value(unused_ok, 0), "x\\u0000y"),
          "escaped backslash: got '%s'", gdp_st_meta_count(unused_ok) ? gdp_st_meta_value(unused_ok, 0) : "");
    gdp_st_free(unused_ok);
    unused_ok = NULL;
  }

  /* What loads saves back: an empty metadata key is legal in the format (the reference
   * reader takes it), so the loader keeps it and the saver writes it. */
  write_header(p, "{\"__metadata__\":{\"\":\"empty key\"},"
                  "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
  CHECK_OK(gdp_safetensors_load(ctx, p, &unused_ok));
  if (unused_ok) {
    const char *again = tmp_path("again.safetensors");
    const char *key = gdp_st_meta_key(unused_ok, 0), *val = gdp_st_meta_value(unused_ok, 0);
    const char *nm = gdp_st_name(unused_ok, 0);
    gdp_tensor *ta = NULL;
    CHECK_OK(gdp_st_tensor(unused_ok, 0, &ta));
    const gdp_tensor *tl[1] = {ta};
    CHECK_OK(gdp_safetensors_save(again, 1, &nm, tl, 1, &key, &val));
    gdp_st_file *g = NULL;
    CHECK_OK(gdp_safetensors_load(ctx, again, &g));
    CHECK(g && gdp_st_meta_count(g) == 1 && !strcmp(gdp_st_meta_key(g, 0), "") &&
              !strcmp(gdp_st_meta_value(g, 0), "empty key"),
          "the empty metadata key did not survive a save");
    gdp_st_free(g);
    gdp_tensor_free(ta);
    gdp_st_free(unused_ok);
    unused_ok = NULL;
  }

  /* Legal oddities: tensors listed out of offset order come back sorted by offset;
   * whitespace padding of several kinds. */
  write_header(p,
               "{\"b\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[8,16]},"
               "\"e\":{\"dtype\":\"F64\",\"shape\":[0,3],\"data_offsets\":[8,8]},"
               "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}} \n\t ",
               16);
  gdp_st_file *f = NULL;
  CHECK_OK(gdp_safetensors_load(ctx, p, &f));
  if (f) {
    CHECK(gdp_st_count(f) == 3 && !strcmp(gdp_st_name(f, 0), "a") && !strcmp(gdp_st_name(f, 1), "e") &&
              !strcmp(gdp_st_name(f, 2), "b"),
          "not sorted by offset: %s %s %s", gdp_st_name(f, 0), gdp_st_name(f, 1), gdp_st_name(f, 2));
    gdp_tensor *b = NULL;
    CHECK_OK(gdp_st_tensor(f, 2, &b));
    int32_t got[2] = {0, 0}, want[2];
    unsigned char filler[8];
    for (int i = 0; i < 8; i++) filler[i] = (unsigned char)((8 + i) * 37 + 11);
    memcpy(want, filler, 8);
    if (b) CHECK_OK(gdp_tensor_to_host(b, GDP_DTYPE_I32, got, sizeof got));
    CHECK(memcmp(got, want, 8) == 0, "tensor 'b' read from the wrong offset");
    gdp_tensor_free(b);
    gdp_st_free(f);
  }

  gdp_st_file *unused = NULL;
  /* a FIFO without a writer: an error at once (open() used to block before the
   * regular-file check; the test would hang, and ctest's timeout fails it) */
  const char *fifo = tmp_path("fifo.safetensors");
  if (mkfifo(fifo, 0600) == 0) {
    CHECK_ERR(gdp_safetensors_load(ctx, fifo, &unused), GDP_ERR_IO, "not a regular file");
    unlink(fifo);
  }
  CHECK_ERR(gdp_safetensors_load(NULL, p, &unused), GDP_ERR_INVALID_ARG, "ctx");
  CHECK_ERR(gdp_safetensors_load(ctx, NULL, &unused), GDP_ERR_INVALID_ARG, "path");
  CHECK(gdp_st_count(NULL) == 0 && gdp_st_name(NULL, 0) == NULL, "NULL file accessors");
  gdp_st_free(NULL);
}

/* ------------------------------------------------------------------ main */

static void remove_tmpdir(void) {
  DIR *d = opendir(tmpdir);
  struct dirent *de;
  while (d && (de = readdir(d))) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    unlink(tmp_path(de->d_name));
  }
  if (d) closedir(d);
  rmdir(tmpdir);
}

int main(void) {
  TEST_BEGIN(20251130);
  /* The battery writes a few thousand small files: tmpfs keeps that well under a second
   * where /tmp sits on a slow disk. */
  const char *base = getenv("TMPDIR");
  if (!base || !base[0]) base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  snprintf(tmpdir, sizeof tmpdir, "%s/gdp_test_safetensors_XXXXXX", base);
  if (!mkdtemp(tmpdir)) {
    fprintf(stderr, "mkdtemp(%s): %s\n", tmpdir, strerror(errno));
    return 1;
  }
  CHECK_OK(gdp_ctx_new(GDP_DEVICE_CPU, 0, &ctx));
  if (ctx) {
    test_round_trip();
    test_save_errors();
    test_golden();
    test_truncation();
    test_malformed();
  }
  gdp_ctx_free(ctx);
  remove_tmpdir();
  TEST_END();
}
