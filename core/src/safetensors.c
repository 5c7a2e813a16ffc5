/*
 * safetensors.c -- reading and writing the safetensors format:
 *
 *   [8 bytes: header length N, little-endian u64][N bytes: JSON header][data]
 *
 * The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
 * (offsets relative to the start of the data section) and may hold a "__metadata__"
 * object of string values.  Files come from other tools and may be truncated or
 * hostile, so the loader checks every field before it allocates or reads anything
 * that a field sizes, and every failure is a GDP_ERR_IO naming the file, the tensor
 * and what is wrong.
 *
 * The loader takes what the reference reader (the `safetensors` Rust crate) takes and
 * rejects what it rejects:
 *   - the header is at most 100,000,000 bytes of JSON, which may be padded at its end
 *     with whitespace (the writers pad with spaces to an 8-byte boundary);
 *   - the tensors' data_offsets tile the data section exactly: sorted by offset, the
 *     first begins at 0, each begins where the one before ends (no gap, no overlap),
 *     and the last ends at the end of the file (no trailing bytes);
 *   - an empty metadata key is legal, so the saver writes one too: what loads saves.
 * One rule is stricter: a NUL (the JSON escape \u0000) inside a name, a metadata key
 * or value is an error, since gdp's names are C strings and would be cut short.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "internal.h"

/* The reference reader's limit on the header's size. */
#define ST_MAX_HEADER 100000000ull

/* The data of a file is raw little-endian; we copy it as is. */
static int host_is_little_endian(void) {
  const uint16_t one = 1;
  unsigned char first;
  memcpy(&first, &one, 1);
  return first == 1;
}

/* ------------------------------------------------------------------ dtypes */

/* Every dtype the format defines, so that offsets of tensors we cannot load are still
 * validated (a malformed file is always GDP_ERR_IO) and the unsupported ones are named. */
typedef struct st_dtype_info {
  const char *name;
  size_t size;
  int gdp_dtype; /* -1: defined by the format, not loadable by gdp */
} st_dtype_info;

static const st_dtype_info st_dtypes[] = {
    {"F64", 8, GDP_DTYPE_F64},  {"F32", 4, GDP_DTYPE_F32},  {"BF16", 2, GDP_DTYPE_BF16},
    {"I32", 4, GDP_DTYPE_I32},  {"I64", 8, GDP_DTYPE_I64},  {"F16", 2, -1},
    {"I8", 1, -1},              {"U8", 1, -1},              {"BOOL", 1, -1},
    {"I16", 2, -1},             {"U16", 2, -1},             {"U32", 4, -1},
    {"U64", 8, -1},             {"F8_E4M3", 1, -1},         {"F8_E5M2", 1, -1},
};

static const st_dtype_info *st_dtype_lookup(const char *name) {
  for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
    if (strcmp(st_dtypes[i].name, name) == 0) return &st_dtypes[i];
  return NULL;
}

static const char *st_dtype_name(gdp_dtype dtype) {
  for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
    if (st_dtypes[i].gdp_dtype == (int)dtype) return st_dtypes[i].name;
  return NULL;
}

/* ------------------------------------------------------------------ loaded file */

struct gdp_st_file {
  int64_t count;
  char **names;
  gdp_tensor **tensors;
  int64_t meta_count;
  char **meta_keys;
  char **meta_values;
};

void gdp_st_free(gdp_st_file *f) {
  if (!f) return;
  for (int64_t i = 0; i < f->count; i++) {
    free(f->names[i]);
    gdp_tensor_free(f->tensors[i]);
  }
  for (int64_t i = 0; i < f->meta_count; i++) {
    free(f->meta_keys[i]);
    free(f->meta_values[i]);
  }
  free(f->names);
  free(f->tensors);
  free(f->meta_keys);
  free(f->meta_values);
  free(f);
}

int64_t gdp_st_count(const gdp_st_file *f) { return f ? f->count : 0; }

const char *gdp_st_name(const gdp_st_file *f, int64_t i) {
  return (f && i >= 0 && i < f->count) ? f->names[i] : NULL;
}

gdp_status gdp_st_tensor(const gdp_st_file *f, int64_t i, gdp_tensor **out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  if (!f) return GDP_ERROR(GDP_ERR_INVALID_ARG, "f is NULL");
  if (i < 0 || i >= f->count)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "index %lld out of range [0, %lld)", (long long)i,
                     (long long)f->count);
  *out = gdp_tensor_retain(f->tensors[i]);
  return GDP_OK;
}

int64_t gdp_st_meta_count(const gdp_st_file *f) { return f ? f->meta_count : 0; }

const char *gdp_st_meta_key(const gdp_st_file *f, int64_t i) {
  return (f && i >= 0 && i < f->meta_count) ? f->meta_keys[i] : NULL;
}

const char *gdp_st_meta_value(const gdp_st_file *f, int64_t i) {
  return (f && i >= 0 && i < f->meta_count) ? f->meta_values[i] : NULL;
}

/* ------------------------------------------------------------------ load */

/* Errors of load and save all name the file first: "'<path>': <what>". */
#if defined(__GNUC__)
__attribute__((format(printf, 5, 6)))
#endif
static gdp_status st_error(gdp_status status, const char *func, int line, const char *path,
                           const char *fmt, ...) {
  char what[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return gdp_set_error(status, func, __FILE__, line, "'%s': %s", path, what);
}
#define LOAD_ERR(status, ...) st_error((status), "gdp_safetensors_load", __LINE__, path, __VA_ARGS__)
#define SAVE_ERR(status, ...) st_error((status), "gdp_safetensors_save", __LINE__, path, __VA_ARGS__)

/* One header entry, validated. */
typedef struct st_entry {
  const char *name; /* borrowed from the cJSON tree */
  const st_dtype_info *dtype;
  int ndim;
  int64_t shape[GDP_MAX_DIMS];
  uint64_t begin, end; /* relative to the data section */
  int64_t order;       /* position in the header: keeps empty tensors at one offset in order */
} st_entry;

/* Integral JSON numbers up to 2^53 are exact in the double cJSON keeps; beyond that
 * we could not tell two offsets apart, and no real file is 9 PB. */
#define ST_MAX_JSON_INT 9007199254740992.0

static int json_uint(const cJSON *item, uint64_t *out) {
  if (!cJSON_IsNumber(item)) return 0;
  double d = item->valuedouble;
  if (!(d >= 0.0 && d <= ST_MAX_JSON_INT) || d != (double)(uint64_t)d) return 0;
  *out = (uint64_t)d;
  return 1;
}

static const char *json_kind(const cJSON *item) {
  if (!item) return "missing";
  if (cJSON_IsString(item)) return "a string";
  if (cJSON_IsNumber(item)) return "a number";
  if (cJSON_IsArray(item)) return "an array";
  if (cJSON_IsObject(item)) return "an object";
  if (cJSON_IsBool(item)) return "a boolean";
  if (cJSON_IsNull(item)) return "null";
  return "invalid";
}

/* A value for a message: the number itself, or what kind of JSON value it is. */
static const char *json_desc(const cJSON *item, char *buf, size_t len) {
  if (!cJSON_IsNumber(item)) return json_kind(item);
  snprintf(buf, len, "%.17g", item->valuedouble);
  return buf;
}

static gdp_status parse_entry(const char *path, const cJSON *item, uint64_t data_size,
                              st_entry *e) {
  const char *name = item->string;
  e->name = name;
  if (name[0] == '\0') return LOAD_ERR(GDP_ERR_IO, "a tensor has an empty name");
  if (!cJSON_IsObject(item))
    return LOAD_ERR(GDP_ERR_IO, "tensor '%s': entry must be an object, got %s", name,
                    json_kind(item));

  const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(item, "dtype");
  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
  const cJSON *offs = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
  if (!cJSON_IsString(dtype))
    return LOAD_ERR(GDP_ERR_IO, "tensor '%s': \"dtype\" must be a string, got %s", name,
                    json_kind(dtype));
  e->dtype = st_dtype_lookup(dtype->valuestring);
  if (!e->dtype)
    return LOAD_ERR(GDP_ERR_IO, "tensor '%s': unknown dtype \"%s\"", name, dtype->valuestring);

  if (!cJSON_IsArray(shape))
    return LOAD_ERR(GDP_ERR_IO, "tensor '%s': \"shape\" must be an array, got %s", name,
                    json_kind(shape));
  int ndim = cJSON_GetArraySize(shape);
  if (ndim > GDP_MAX_DIMS)
    return LOAD_ERR(GDP_ERR_IO, "tensor '%s': shape has %d dims, at most %d are supported",
                    name, ndim, (int)GDP_MAX_DIMS);
  e->ndim = ndim;
  /* numel * size must fit the data section; checking the running product against it
   * after every factor keeps the multiplication from overflowing. */
  uint64_t nbytes = e->dtype->size;
  uint64_t span = 1; /* product with 0 counted as 1: gdp's strides must fit in int64 */
  int zero = 0;
  int d = 0;
  char num_buf[40];
  for (const cJSON *s = shape->child; s; s = s->next, d++) {
    uint64_t n;
    if (!json_uint(s, &n))
      return LOAD_ERR(GDP_ERR_IO,
                      "tensor '%s': shape[%d] must be a non-negative integer, got %s", name, d,
                      json_desc(s, num_buf, sizeof num_buf));
    e->shape[d] = (int64_t)n;
    if (n > 1) span = span > (uint64_t)INT64_MAX / 8 / n ? UINT64_MAX : span * n;
    if (n == 0) zero = 1;
    if (!zero && nbytes > data_size / n) /* only matters when the tensor is not empty */
      nbytes = UINT64_MAX;
    else if (!zero)
      nbytes *= n;
  }
  if (zero) nbytes = 0;
  /* a non-empty tensor is bounded by the data section (checked below); an empty one
   * only by this */
  if (zero && span == UINT64_MAX)
    return LOAD_ERR(GDP_ERR_IO, "tensor '%s': empty, but its shape is too large (sizes multiply "
                    "past int64 bytes)", name);

  if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2)
    return LOAD_ERR(GDP_ERR_IO,
                    "tensor '%s': \"data_offsets\" must be an array [begin, end], got %s", name,
                    json_kind(offs));
  if (!json_uint(offs->child, &e->begin) || !json_uint(offs->child->next, &e->end)) {
    char b0[40], b1[40];
    return LOAD_ERR(GDP_ERR_IO, "tensor '%s': data_offsets must be non-negative integers, got "
                    "[%s, %s]", name, json_desc(offs->child, b0, sizeof b0),
                    json_desc(offs->child->next, b1, sizeof b1));
  }
  if (e->begin > e->end)
    return LOAD_ERR(GDP_ERR_IO, "tensor '%s': data_offsets [%llu, %llu] end before they begin",
                    name, (unsigned long long)e->begin, (unsigned long long)e->end);
  if (e->end > data_size)
    return LOAD_ERR(GDP_ERR_IO,
                    "tensor '%s': data_offsets [%llu, %llu] run past the data section of %llu "
                    "bytes (file truncated?)",
                    name, (unsigned long long)e->begin, (unsigned long long)e->end,
                    (unsigned long long)data_size);
  char shape_buf[200];
  if (nbytes != e->end - e->begin)
    return LOAD_ERR(GDP_ERR_IO,
                    "tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, but %s %s needs "
                    "%s%llu",
                    name, (unsigned long long)e->begin, (unsigned long long)e->end,
                    (unsigned long long)(e->end - e->begin), e->dtype->name,
                    gdp_shape_str(shape_buf, sizeof shape_buf, e->ndim, e->shape),
                    nbytes == UINT64_MAX ? "more than " : "",
                    nbytes == UINT64_MAX ? (unsigned long long)data_size
                                         : (unsigned long long)nbytes);
  return GDP_OK;
}

static int entry_cmp_offset(const void *a, const void *b) {
  const st_entry *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return (x->order > y->order) - (x->order < y->order);
}

static int str_ptr_cmp(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The first name that occurs twice in names[0..n), or NULL.  Sorts a copy: O(n log n). */
static const char *find_duplicate(const char *const *names, int64_t n, gdp_status *oom) {
  *oom = GDP_OK;
  if (n < 2) return NULL;
  const char **sorted = malloc((size_t)n * sizeof *sorted);
  if (!sorted) {
    *oom = GDP_ERR_OOM;
    return NULL;
  }
  memcpy(sorted, names, (size_t)n * sizeof *sorted);
  qsort(sorted, (size_t)n, sizeof *sorted, str_ptr_cmp);
  const char *dup = NULL;
  for (int64_t i = 1; i < n && !dup; i++)
    if (strcmp(sorted[i - 1], sorted[i]) == 0) dup = sorted[i];
  free(sorted);
  return dup;
}

static gdp_status parse_metadata(const char *path, const cJSON *meta, gdp_st_file *f) {
  if (!cJSON_IsObject(meta))
    return LOAD_ERR(GDP_ERR_IO, "\"__metadata__\" must be an object, got %s", json_kind(meta));
  int n = cJSON_GetArraySize(meta);
  if (n == 0) return GDP_OK;
  f->meta_keys = calloc((size_t)n, sizeof *f->meta_keys);
  f->meta_values = calloc((size_t)n, sizeof *f->meta_values);
  if (!f->meta_keys || !f->meta_values)
    return LOAD_ERR(GDP_ERR_OOM, "out of memory for %d metadata entries", n);
  for (const cJSON *m = meta->child; m; m = m->next) {
    if (!cJSON_IsString(m))
      return LOAD_ERR(GDP_ERR_IO, "__metadata__ \"%s\" must be a string, got %s", m->string,
                      json_kind(m));
    char *k = strdup(m->string), *v = strdup(m->valuestring);
    if (!k || !v) {
      free(k);
      free(v);
      return LOAD_ERR(GDP_ERR_OOM, "out of memory for metadata \"%s\"", m->string);
    }
    f->meta_keys[f->meta_count] = k;
    f->meta_values[f->meta_count] = v;
    f->meta_count++;
  }
  gdp_status oom;
  const char *dup = find_duplicate((const char *const *)f->meta_keys, f->meta_count, &oom);
  if (oom != GDP_OK) return LOAD_ERR(GDP_ERR_OOM, "out of memory checking metadata keys");
  if (dup) return LOAD_ERR(GDP_ERR_IO, "__metadata__ key \"%s\" appears twice", dup);
  return GDP_OK;
}

/* The byte offset of the first \u0000 escape inside a JSON string of text[0..n), or -1.
 * cJSON decodes it to a NUL that would silently end the C string.  Only needs to be
 * right for text that parses; text that does not is rejected by the parser. */
static long find_escaped_nul(const char *text, size_t n) {
  int in_string = 0;
  for (size_t i = 0; i < n; i++) {
    if (text[i] == '"') {
      in_string = !in_string;
    } else if (in_string && text[i] == '\\' && i + 1 < n) {
      if (text[i + 1] == 'u' && i + 5 < n && !memcmp(text + i + 2, "0000", 4)) return (long)i;
      i++; /* the escaped character, so an escaped quote or backslash is skipped */
    }
  }
  return -1;
}

/* Reads exactly n bytes at absolute offset `at`. */
static int read_at(FILE *fp, uint64_t at, void *buf, size_t n) {
  if (fseeko(fp, (off_t)at, SEEK_SET) != 0) return 0;
  return fread(buf, 1, n, fp) == n;
}

/* Parses and validates the header text; fills f's metadata and returns the entries
 * sorted by data offset in *entries_out (caller frees). */
static gdp_status parse_header(const char *path, const cJSON *root, uint64_t data_size,
                               gdp_st_file *f, st_entry **entries_out, int64_t *count_out) {
  *entries_out = NULL;
  *count_out = 0;
  if (!cJSON_IsObject(root))
    return LOAD_ERR(GDP_ERR_IO, "header must be a JSON object, got %s", json_kind(root));
  int n_items = cJSON_GetArraySize(root);
  st_entry *entries = calloc((size_t)n_items + 1, sizeof *entries);
  const char **names = calloc((size_t)n_items + 1, sizeof *names);
  gdp_status st = GDP_OK;
  int64_t n = 0;
  int have_meta = 0;
  if (!entries || !names) {
    st = LOAD_ERR(GDP_ERR_OOM, "out of memory for %d header entries", n_items);
    goto done;
  }
  for (const cJSON *item = root->child; item; item = item->next) {
    if (strcmp(item->string, "__metadata__") == 0) {
      if (have_meta) {
        st = LOAD_ERR(GDP_ERR_IO, "\"__metadata__\" appears twice");
        goto done;
      }
      have_meta = 1;
      if ((st = parse_metadata(path, item, f)) != GDP_OK) goto done;
      continue;
    }
    if ((st = parse_entry(path, item, data_size, &entries[n])) != GDP_OK) goto done;
    names[n] = entries[n].name;
    entries[n].order = n;
    n++;
  }
  const char *dup = find_duplicate(names, n, &st);
  if (st != GDP_OK) {
    st = LOAD_ERR(GDP_ERR_OOM, "out of memory checking %lld names", (long long)n);
    goto done;
  }
  if (dup) {
    st = LOAD_ERR(GDP_ERR_IO, "tensor '%s' appears twice in the header", dup);
    goto done;
  }
  qsort(entries, (size_t)n, sizeof *entries, entry_cmp_offset);
  /* The tensors must tile the data section: [0, data_size) exactly, in offset order. */
  uint64_t covered = 0;
  for (int64_t i = 0; i < n; i++) {
    if (entries[i].begin > covered) {
      st = LOAD_ERR(GDP_ERR_IO,
                    "gap of %llu bytes before tensor '%s' [%llu, %llu]: the tensors must cover "
                    "the data section contiguously from offset 0",
                    (unsigned long long)(entries[i].begin - covered), entries[i].name,
                    (unsigned long long)entries[i].begin, (unsigned long long)entries[i].end);
      goto done;
    }
    if (i > 0 && entries[i].begin < entries[i - 1].end) {
      st = LOAD_ERR(GDP_ERR_IO, "tensors '%s' [%llu, %llu] and '%s' [%llu, %llu] overlap",
                    entries[i - 1].name, (unsigned long long)entries[i - 1].begin,
                    (unsigned long long)entries[i - 1].end, entries[i].name,
                    (unsigned long long)entries[i].begin, (unsigned long long)entries[i].end);
      goto done;
    }
    if (entries[i].end > covered) covered = entries[i].end;
  }
  if (covered != data_size) {
    uint64_t extra = data_size - covered;
    st = LOAD_ERR(GDP_ERR_IO,
                  "%llu byte%s after the last tensor (data section of %llu bytes, tensors end at "
                  "%llu): the tensors must cover it exactly",
                  (unsigned long long)extra, extra == 1 ? "" : "s", (unsigned long long)data_size,
                  (unsigned long long)covered);
    goto done;
  }
  /* Only a well-formed file gets the (more specific) unsupported-dtype answer. */
  for (int64_t i = 0; i < n; i++) {
    if (entries[i].dtype->gdp_dtype < 0) {
      st = LOAD_ERR(GDP_ERR_UNSUPPORTED,
                    "tensor '%s' has dtype %s; gdp loads F64, F32, BF16, I32 and I64",
                    entries[i].name, entries[i].dtype->name);
      goto done;
    }
  }
done:
  free(names);
  if (st != GDP_OK) {
    free(entries);
    return st;
  }
  *entries_out = entries;
  *count_out = n;
  return GDP_OK;
}

gdp_status gdp_safetensors_load(gdp_ctx *ctx, const char *path, gdp_st_file **out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out is NULL");
  *out = NULL;
  if (!ctx) return GDP_ERROR(GDP_ERR_INVALID_ARG, "ctx is NULL");
  if (!path) return GDP_ERROR(GDP_ERR_INVALID_ARG, "path is NULL");
  if (!host_is_little_endian())
    return GDP_ERROR(GDP_ERR_UNSUPPORTED, "big-endian hosts are not supported");

  gdp_status st = GDP_OK;
  FILE *fp = NULL;
  char *header = NULL;
  cJSON *root = NULL;
  st_entry *entries = NULL;
  void *buf = NULL;
  gdp_st_file *f = calloc(1, sizeof *f);
  if (!f) return GDP_ERROR(GDP_ERR_OOM, "out of memory");

  /* O_NONBLOCK: opening a FIFO for reading would block until a writer comes; the
   * regular-file check below must come first.  Reads are blocking again after it. */
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    st = LOAD_ERR(GDP_ERR_IO, "cannot open: %s", strerror(errno));
    goto fail;
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    close(fd);
    st = LOAD_ERR(GDP_ERR_IO, "not a regular file");
    goto fail;
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl == -1 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) == -1 || !(fp = fdopen(fd, "rb"))) {
    st = LOAD_ERR(GDP_ERR_IO, "cannot open: %s", strerror(errno));
    close(fd);
    goto fail;
  }
  uint64_t file_size = (uint64_t)sb.st_size;
  unsigned char len_bytes[8];
  if (file_size < 8 || !read_at(fp, 0, len_bytes, 8)) {
    st = LOAD_ERR(GDP_ERR_IO, "file of %llu bytes is too short for the 8-byte header length",
                  (unsigned long long)file_size);
    goto fail;
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; i--) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > ST_MAX_HEADER) {
    st = LOAD_ERR(GDP_ERR_IO, "header length %llu is over the format's limit of %llu bytes",
                  (unsigned long long)header_len, (unsigned long long)ST_MAX_HEADER);
    goto fail;
  }
  if (header_len < 2 || header_len > file_size - 8) {
    st = LOAD_ERR(GDP_ERR_IO,
                  "header length %llu does not fit a file of %llu bytes (must be 2..%llu)",
                  (unsigned long long)header_len, (unsigned long long)file_size,
                  (unsigned long long)(file_size - 8));
    goto fail;
  }
  header = malloc((size_t)header_len + 1);
  if (!header) {
    st = LOAD_ERR(GDP_ERR_OOM, "out of memory for a %llu-byte header",
                  (unsigned long long)header_len);
    goto fail;
  }
  if (!read_at(fp, 8, header, (size_t)header_len)) {
    st = LOAD_ERR(GDP_ERR_IO, "reading the %llu-byte header failed: %s",
                  (unsigned long long)header_len, ferror(fp) ? strerror(errno) : "short read");
    goto fail;
  }
  header[header_len] = '\0';
  if (memchr(header, '\0', (size_t)header_len)) {
    st = LOAD_ERR(GDP_ERR_IO, "header contains a NUL byte");
    goto fail;
  }
  long nul_at = find_escaped_nul(header, (size_t)header_len);
  if (nul_at >= 0) {
    st = LOAD_ERR(GDP_ERR_IO, "header has a NUL (\\u0000) inside a string at byte %ld; names "
                  "and metadata cannot hold NUL", nul_at);
    goto fail;
  }
  const char *end = NULL;
  root = cJSON_ParseWithLengthOpts(header, (size_t)header_len, &end, 0);
  if (!root) {
    const char *at = end ? end : cJSON_GetErrorPtr();
    long pos = at ? (long)(at - header) : -1;
    st = LOAD_ERR(GDP_ERR_IO, "header is not valid JSON (error near byte %ld of %llu)", pos,
                  (unsigned long long)header_len);
    goto fail;
  }
  /* The format pads the header with spaces; anything else after the JSON is damage. */
  for (const char *p = end; p < header + header_len; p++) {
    if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
      st = LOAD_ERR(GDP_ERR_IO, "unexpected byte 0x%02x after the JSON header at byte %ld",
                    (unsigned char)*p, (long)(p - header));
      goto fail;
    }
  }

  uint64_t data_start = 8 + header_len;
  uint64_t data_size = file_size - data_start;
  int64_t n = 0;
  if ((st = parse_header(path, root, data_size, f, &entries, &n)) != GDP_OK) goto fail;

  f->names = calloc((size_t)n + 1, sizeof *f->names);
  f->tensors = calloc((size_t)n + 1, sizeof *f->tensors);
  uint64_t max_bytes = 0;
  for (int64_t i = 0; i < n; i++)
    if (entries[i].end - entries[i].begin > max_bytes) max_bytes = entries[i].end - entries[i].begin;
  /* One buffer the size of the largest tensor: never the whole file in memory twice. */
  buf = malloc(max_bytes ? (size_t)max_bytes : 1);
  if (!f->names || !f->tensors || !buf) {
    st = LOAD_ERR(GDP_ERR_OOM, "out of memory for a %llu-byte read buffer",
                  (unsigned long long)max_bytes);
    goto fail;
  }
  for (int64_t i = 0; i < n; i++) {
    const st_entry *e = &entries[i];
    size_t nbytes = (size_t)(e->end - e->begin);
    if (nbytes && !read_at(fp, data_start + e->begin, buf, nbytes)) {
      st = LOAD_ERR(GDP_ERR_IO, "tensor '%s': reading %zu bytes at offset %llu failed: %s",
                    e->name, nbytes, (unsigned long long)(data_start + e->begin),
                    ferror(fp) ? strerror(errno) : "short read");
      goto fail;
    }
    gdp_dtype dt = (gdp_dtype)e->dtype->gdp_dtype;
    if ((st = gdp_tensor_from_host(ctx, dt, e->ndim, e->shape, dt, buf, nbytes,
                                   &f->tensors[i])) != GDP_OK)
      goto fail; /* from_host said why (device memory, usually) */
    if (!(f->names[i] = strdup(e->name))) {
      gdp_tensor_free(f->tensors[i]);
      f->tensors[i] = NULL;
      st = LOAD_ERR(GDP_ERR_OOM, "out of memory for the name of tensor %lld", (long long)i);
      goto fail;
    }
    f->count = i + 1;
  }
  fclose(fp);
  free(header);
  cJSON_Delete(root);
  free(entries);
  free(buf);
  *out = f;
  return GDP_OK;

fail:
  if (fp) fclose(fp);
  free(header);
  cJSON_Delete(root);
  free(entries);
  free(buf);
  gdp_st_free(f);
  return st;
}

/* ------------------------------------------------------------------ save */

/* "[a,b,c]" as JSON; cJSON would write its doubles as 1e+15 past 15 digits, which
 * readers that parse offsets as integers (the Rust crate) reject. */
static int json_int_array(char *buf, size_t len, int n, const uint64_t *v) {
  size_t used = 0;
  int w = snprintf(buf, len, "[");
  if (w < 0 || (size_t)w >= len) return 0;
  used = (size_t)w;
  for (int i = 0; i < n; i++) {
    w = snprintf(buf + used, len - used, "%s%llu", i ? "," : "", (unsigned long long)v[i]);
    if (w < 0 || (size_t)w >= len - used) return 0;
    used += (size_t)w;
  }
  w = snprintf(buf + used, len - used, "]");
  return w >= 0 && (size_t)w < len - used;
}

static gdp_status check_save_args(const char *path, int64_t count, const char *const *names,
                                  const gdp_tensor *const *tensors, int64_t meta_count,
                                  const char *const *meta_keys, const char *const *meta_values) {
  if (!path || !path[0])
    return GDP_ERROR_IN("gdp_safetensors_save", GDP_ERR_INVALID_ARG, "path is %s",
                        path ? "empty" : "NULL");
  if (count < 0 || meta_count < 0)
    return SAVE_ERR(GDP_ERR_INVALID_ARG, "count and meta_count must be >= 0, got %lld and %lld",
                    (long long)count, (long long)meta_count);
  if (count > 0 && (!names || !tensors))
    return SAVE_ERR(GDP_ERR_INVALID_ARG, "names and tensors must be non-NULL for %lld tensors",
                    (long long)count);
  if (meta_count > 0 && (!meta_keys || !meta_values))
    return SAVE_ERR(GDP_ERR_INVALID_ARG,
                    "meta_keys and meta_values must be non-NULL for %lld entries",
                    (long long)meta_count);
  for (int64_t i = 0; i < count; i++) {
    if (!names[i] || !names[i][0])
      return SAVE_ERR(GDP_ERR_INVALID_ARG, "names[%lld] is %s; names must be non-empty",
                      (long long)i, names[i] ? "empty" : "NULL");
    if (strcmp(names[i], "__metadata__") == 0)
      return SAVE_ERR(GDP_ERR_INVALID_ARG,
                      "names[%lld] is \"__metadata__\", which the format reserves", (long long)i);
    if (!tensors[i])
      return SAVE_ERR(GDP_ERR_INVALID_ARG, "tensor '%s' (tensors[%lld]) is NULL", names[i],
                      (long long)i);
    if (!st_dtype_name(gdp_tensor_dtype(tensors[i])))
      return SAVE_ERR(GDP_ERR_DTYPE, "tensor '%s' has an invalid dtype %d", names[i],
                      (int)gdp_tensor_dtype(tensors[i]));
  }
  for (int64_t i = 0; i < meta_count; i++) {
    /* an empty key is legal (the loader takes it): only NULL is refused */
    if (!meta_keys[i] || !meta_values[i])
      return SAVE_ERR(GDP_ERR_INVALID_ARG,
                      "metadata entry %lld needs a non-NULL key and a non-NULL value",
                      (long long)i);
  }
  gdp_status oom;
  const char *dup = find_duplicate(names, count, &oom);
  if (oom != GDP_OK) return SAVE_ERR(GDP_ERR_OOM, "out of memory checking names");
  if (dup) return SAVE_ERR(GDP_ERR_INVALID_ARG, "tensor name '%s' appears twice", dup);
  dup = find_duplicate(meta_keys, meta_count, &oom);
  if (oom != GDP_OK) return SAVE_ERR(GDP_ERR_OOM, "out of memory checking metadata keys");
  if (dup) return SAVE_ERR(GDP_ERR_INVALID_ARG, "metadata key '%s' appears twice", dup);
  return GDP_OK;
}

/* Builds the padded header text.  *max_bytes gets the largest tensor's size. */
static gdp_status build_header(const char *path, int64_t count, const char *const *names,
                               const gdp_tensor *const *tensors, int64_t meta_count,
                               const char *const *meta_keys, const char *const *meta_values,
                               char **text_out, size_t *len_out, size_t *max_bytes) {
  gdp_status st = GDP_OK;
  char *json = NULL;
  cJSON *root = cJSON_CreateObject();
  if (!root) return SAVE_ERR(GDP_ERR_OOM, "out of memory building the header");
  if (meta_count > 0) {
    cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
    if (!meta) goto oom;
    for (int64_t i = 0; i < meta_count; i++)
      if (!cJSON_AddStringToObject(meta, meta_keys[i], meta_values[i])) goto oom;
  }
  uint64_t offset = 0;
  *max_bytes = 0;
  for (int64_t i = 0; i < count; i++) {
    const gdp_tensor *t = tensors[i];
    int ndim = gdp_tensor_ndim(t);
    uint64_t dims[GDP_MAX_DIMS];
    for (int d = 0; d < ndim; d++) dims[d] = (uint64_t)gdp_tensor_size(t, d);
    uint64_t nbytes = (uint64_t)gdp_tensor_numel(t) * gdp_dtype_size(gdp_tensor_dtype(t));
    uint64_t offs[2] = {offset, offset + nbytes};
    char shape_text[GDP_MAX_DIMS * 21 + 4], offs_text[48];
    if (!json_int_array(shape_text, sizeof shape_text, ndim, dims) ||
        !json_int_array(offs_text, sizeof offs_text, 2, offs)) {
      cJSON_Delete(root);
      return SAVE_ERR(GDP_ERR_INTERNAL, "formatting the shape of '%s' failed", names[i]);
    }
    cJSON *entry = cJSON_AddObjectToObject(root, names[i]);
    if (!entry || !cJSON_AddStringToObject(entry, "dtype", st_dtype_name(gdp_tensor_dtype(t))) ||
        !cJSON_AddRawToObject(entry, "shape", shape_text) ||
        !cJSON_AddRawToObject(entry, "data_offsets", offs_text))
      goto oom;
    offset += nbytes;
    if (nbytes > *max_bytes) *max_bytes = (size_t)nbytes;
  }
  json = cJSON_PrintUnformatted(root);
  if (!json) goto oom;
  /* Pad with spaces so that the data section starts 8-byte aligned (8 + len). */
  size_t len = strlen(json);
  size_t padded = (len + 7) / 8 * 8;
  char *text = malloc(padded);
  if (!text) goto oom;
  memcpy(text, json, len);
  memset(text + len, ' ', padded - len);
  *text_out = text;
  *len_out = padded;
  goto done;
oom:
  st = SAVE_ERR(GDP_ERR_OOM, "out of memory building the header");
done:
  cJSON_free(json);
  cJSON_Delete(root);
  return st;
}

/* Distinguishes temporary files of concurrent saves within one process. */
static atomic_uint save_counter;

gdp_status gdp_safetensors_save(const char *path, int64_t count, const char *const *names,
                                const gdp_tensor *const *tensors, int64_t meta_count,
                                const char *const *meta_keys, const char *const *meta_values) {
  GDP_TRY(check_save_args(path, count, names, tensors, meta_count, meta_keys, meta_values));
  if (!host_is_little_endian())
    return SAVE_ERR(GDP_ERR_UNSUPPORTED, "big-endian hosts are not supported");

  char *header = NULL;
  size_t header_len = 0, max_bytes = 0;
  GDP_TRY(build_header(path, count, names, tensors, meta_count, meta_keys, meta_values, &header,
                       &header_len, &max_bytes));

  gdp_status st = GDP_OK;
  void *buf = NULL;
  FILE *fp = NULL;
  /* Written beside the target and renamed over it, so readers never see half a file
   * and a failed save leaves the old file intact. */
  size_t tmp_len = strlen(path) + 64;
  char *tmp = malloc(tmp_len);
  if (!tmp) {
    free(header);
    return SAVE_ERR(GDP_ERR_OOM, "out of memory");
  }
  snprintf(tmp, tmp_len, "%s.tmp.%ld.%u", path, (long)getpid(),
           atomic_fetch_add(&save_counter, 1u));
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
  if (fd < 0 || !(fp = fdopen(fd, "wb"))) {
    st = SAVE_ERR(GDP_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    if (fd >= 0) close(fd);
    free(header);
    free(tmp);
    return st;
  }

  unsigned char len_bytes[8];
  for (int i = 0; i < 8; i++) len_bytes[i] = (unsigned char)((uint64_t)header_len >> (8 * i));
  if (fwrite(len_bytes, 1, 8, fp) != 8 || fwrite(header, 1, header_len, fp) != header_len) {
    st = SAVE_ERR(GDP_ERR_IO, "writing the header failed: %s", strerror(errno));
    goto fail;
  }
  buf = malloc(max_bytes ? max_bytes : 1);
  if (!buf) {
    st = SAVE_ERR(GDP_ERR_OOM, "out of memory for a %zu-byte buffer", max_bytes);
    goto fail;
  }
  for (int64_t i = 0; i < count; i++) {
    const gdp_tensor *t = tensors[i];
    gdp_dtype dt = gdp_tensor_dtype(t);
    size_t nbytes = (size_t)gdp_tensor_numel(t) * gdp_dtype_size(dt);
    if (nbytes == 0) continue;
    if ((st = gdp_tensor_to_host(t, dt, buf, nbytes)) != GDP_OK) goto fail;
    if (fwrite(buf, 1, nbytes, fp) != nbytes) {
      st = SAVE_ERR(GDP_ERR_IO, "writing tensor '%s' failed: %s", names[i], strerror(errno));
      goto fail;
    }
  }
  if (fflush(fp) != 0 || fsync(fileno(fp)) != 0) {
    st = SAVE_ERR(GDP_ERR_IO, "flushing failed: %s", strerror(errno));
    goto fail;
  }
  int rc = fclose(fp);
  fp = NULL;
  if (rc != 0) {
    st = SAVE_ERR(GDP_ERR_IO, "closing failed: %s", strerror(errno));
    goto fail;
  }
  if (rename(tmp, path) != 0) {
    st = SAVE_ERR(GDP_ERR_IO, "renaming '%s' over it failed: %s", tmp, strerror(errno));
    goto fail;
  }
  free(buf);
  free(header);
  free(tmp);
  return GDP_OK;

fail:
  if (fp) fclose(fp);
  unlink(tmp);
  free(buf);
  free(header);
  free(tmp);
  return st;
}
