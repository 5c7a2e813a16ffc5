/*
 * op_data.c -- synthetic data and its metric (gdp.h, "synthetic data"): the
 * state-tracking tasks' names, sizes and element numbering, the product tables of the
 * permutation groups, argument checks and the dispatch of the generator through
 * ctx->backend, and the sequence accuracy (on the host).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend_impl.h"

typedef struct task_info {
  const char *name;
  int degree; /* permutation groups: k of S_k / A_k; 0: a cyclic group */
  int even_only;
} task_info;

static const task_info TASKS[GDP_STATE_TASK_COUNT] = {
    [GDP_STATE_TASK_PARITY] = {"parity", 0, 0},
    [GDP_STATE_TASK_MODULAR_ADDITION] = {"modular_addition", 0, 0},
    [GDP_STATE_TASK_S3] = {"S3", 3, 0},
    [GDP_STATE_TASK_S4] = {"S4", 4, 0},
    [GDP_STATE_TASK_A5] = {"A5", 5, 1},
    [GDP_STATE_TASK_S5] = {"S5", 5, 0},
};

enum { MAX_DEGREE = 5, MAX_MODULUS = 2147483647 };

static int task_valid(gdp_state_task task) { return task >= 0 && task < GDP_STATE_TASK_COUNT; }

const char *gdp_state_task_name(gdp_state_task task) {
  return task_valid(task) ? TASKS[task].name : "?";
}

gdp_status gdp_state_task_from_name(const char *name, gdp_state_task *out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out: expected a pointer, got NULL");
  for (int i = 0; name && i < GDP_STATE_TASK_COUNT; i++)
    if (strcmp(name, TASKS[i].name) == 0) {
      *out = (gdp_state_task)i;
      return GDP_OK;
    }
  return GDP_ERROR(GDP_ERR_INVALID_ARG,
                   "task: expected one of parity, modular_addition, S3, S4, A5, S5, got '%s'",
                   name ? name : "(NULL)");
}

static int64_t factorial(int k) {
  int64_t f = 1;
  for (int i = 2; i <= k; i++) f *= i;
  return f;
}

static gdp_status task_size(const char *func, gdp_state_task task, int64_t modulus,
                            int64_t *out) {
  if (!task_valid(task))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "task: expected 0..%d (gdp_state_task), got %d",
                        GDP_STATE_TASK_COUNT - 1, (int)task);
  if (task == GDP_STATE_TASK_MODULAR_ADDITION) {
    if (modulus < 2 || modulus > MAX_MODULUS)
      return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                          "modulus: expected 2..%d for modular_addition, got %lld", MAX_MODULUS,
                          (long long)modulus);
    *out = modulus;
    return GDP_OK;
  }
  if (modulus != 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "modulus: expected 0 for task %s (only modular_addition takes one), got %lld",
                        TASKS[task].name, (long long)modulus);
  const task_info *ti = &TASKS[task];
  *out = ti->degree == 0 ? 2 : factorial(ti->degree) / (ti->even_only ? 2 : 1);
  return GDP_OK;
}

gdp_status gdp_state_task_size(gdp_state_task task, int64_t modulus, int64_t *out) {
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out: expected a pointer, got NULL");
  return task_size(__func__, task, modulus, out);
}

/* ------------------------------------------------------------------ permutation groups */

/* The task's elements in their numbering: perms[e * k + i] = p_e(i), k = degree; returns
 * the count.  Lexicographic order of one-line notations, by the standard next-permutation
 * step (swap the last ascent's head with its smallest larger successor, reverse the tail). */
static int64_t enumerate(const task_info *ti, int8_t *perms) {
  const int k = ti->degree;
  int8_t p[MAX_DEGREE];
  for (int i = 0; i < k; i++) p[i] = (int8_t)i;
  int64_t count = 0;
  for (;;) {
    int inversions = 0;
    for (int i = 0; i < k; i++)
      for (int j = i + 1; j < k; j++) inversions += p[i] > p[j];
    if (!ti->even_only || inversions % 2 == 0) memcpy(perms + k * count++, p, (size_t)k);
    int i = k - 2;
    while (i >= 0 && p[i] > p[i + 1]) i--;
    if (i < 0) return count;
    int j = k - 1;
    while (p[j] < p[i]) j--;
    int8_t tmp = p[i];
    p[i] = p[j];
    p[j] = tmp;
    for (int a = i + 1, b = k - 1; a < b; a++, b--) {
      tmp = p[a];
      p[a] = p[b];
      p[b] = tmp;
    }
  }
}

/* A permutation of degree <= 5 as a base-k number (< 5^5), for the reverse lookup. */
static int perm_code(const int8_t *p, int k) {
  int c = 0;
  for (int i = 0; i < k; i++) c = c * k + p[i];
  return c;
}

/* mul[a * n + b] = the index of a * b, (a * b)(i) = b(a(i)); owned by the caller. */
static gdp_status product_table(const char *func, const task_info *ti, int64_t n, uint8_t **out) {
  const int k = ti->degree;
  int8_t *perms = malloc((size_t)(n * k));
  int16_t *index = malloc(sizeof(int16_t) * 3125); /* 5^5 codes */
  uint8_t *mul = malloc((size_t)(n * n));
  if (!perms || !index || !mul) {
    free(perms);
    free(index);
    free(mul);
    return GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for the %s product table", ti->name);
  }
  enumerate(ti, perms);
  for (int64_t e = 0; e < n; e++) index[perm_code(perms + e * k, k)] = (int16_t)e;
  for (int64_t a = 0; a < n; a++)
    for (int64_t b = 0; b < n; b++) {
      int8_t ab[MAX_DEGREE];
      for (int i = 0; i < k; i++) ab[i] = perms[b * k + perms[a * k + i]];
      mul[a * n + b] = (uint8_t)index[perm_code(ab, k)];
    }
  free(perms);
  free(index);
  *out = mul;
  return GDP_OK;
}

gdp_status gdp_state_task_permutation(gdp_state_task task, int64_t index, int32_t perm[5],
                                      int32_t *degree) {
  static const char *func = "gdp_state_task_permutation";
  if (!perm || !degree)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "perm, degree: expected pointers, got NULL");
  if (!task_valid(task) || TASKS[task].degree == 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "task: expected a permutation group (S3, S4, A5, S5), got %s",
                        gdp_state_task_name(task));
  const task_info *ti = &TASKS[task];
  int64_t n = 0;
  GDP_TRY(task_size(func, task, 0, &n));
  if (index < 0 || index >= n)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "index: expected 0..%lld (the %s elements), got %lld",
                        (long long)(n - 1), ti->name, (long long)index);
  int8_t perms[120 * MAX_DEGREE];
  enumerate(ti, perms);
  memset(perm, 0, 5 * sizeof(int32_t));
  for (int i = 0; i < ti->degree; i++) perm[i] = perms[index * ti->degree + i];
  *degree = ti->degree;
  return GDP_OK;
}

/* ------------------------------------------------------------------ generator */

gdp_status gdp_data_state_tracking(gdp_ctx *ctx, gdp_state_task task, int64_t modulus,
                                   int64_t batch, int64_t length, uint64_t seed,
                                   uint64_t offset, gdp_tensor **tokens,
                                   gdp_tensor **labels) {
  static const char *func = "gdp_data_state_tracking";
  if (!tokens || !labels)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "tokens, labels: expected output pointers, got NULL");
  *tokens = *labels = NULL;
  if (!ctx) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "ctx: expected a context, got NULL");
  if (!ctx->backend->state_tracking) return GDP_NOT_IMPLEMENTED(func, ctx);
  int64_t n = 0;
  GDP_TRY(task_size(func, task, modulus, &n));
  if (batch < 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "batch: expected >= 0, got %lld", (long long)batch);
  if (length < 0)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "length: expected >= 0, got %lld", (long long)length);
  const uint64_t limit = UINT64_C(1) << 63;
  if (offset > limit || (uint64_t)batch > limit - offset)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "offset: expected offset + batch <= 2^63 (sequence indices), got offset %llu, "
                        "batch %lld",
                        (unsigned long long)offset, (long long)batch);
  if (length > 0 && batch > INT64_MAX / length)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "batch x length: %lld x %lld overflows",
                        (long long)batch, (long long)length);
  const int64_t shape[2] = {batch, length};
  gdp_tensor *tok = NULL, *lab = NULL;
  uint8_t *mul = NULL;
  gdp_status s = gdp_tensor_empty(ctx, GDP_DTYPE_I32, 2, shape, &tok);
  if (s == GDP_OK) s = gdp_tensor_empty(ctx, GDP_DTYPE_I32, 2, shape, &lab);
  if (s == GDP_OK && TASKS[task].degree > 0) s = product_table(func, &TASKS[task], n, &mul);
  if (s == GDP_OK && batch > 0 && length > 0) {
    const gdp_state_tracking_problem p = {.batch = batch, .length = length, .seed = seed,
                                          .offset = offset, .num_elements = n, .mul = mul,
                                          .num_threads = ctx->num_threads};
    s = ctx->backend->state_tracking(ctx, &p, gdp_tensor_data(tok), gdp_tensor_data(lab));
  }
  free(mul);
  if (s != GDP_OK) {
    gdp_tensor_free(tok);
    gdp_tensor_free(lab);
    return s;
  }
  *tokens = tok;
  *labels = lab;
  return GDP_OK;
}

/* ------------------------------------------------------------------ sequence accuracy */

static int is_int(gdp_dtype d) { return d == GDP_DTYPE_I32 || d == GDP_DTYPE_I64; }
static int is_float(gdp_dtype d) {
  return d == GDP_DTYPE_F64 || d == GDP_DTYPE_F32 || d == GDP_DTYPE_BF16;
}

/* Predicted classes [B*T] from integer classes or the argmax of [B*T, C] scores. */
static gdp_status predicted_classes(const char *func, const gdp_tensor *pred, int64_t rows,
                                    int64_t *out) {
  if (pred->ndim == 2)
    return gdp_tensor_to_host(pred, GDP_DTYPE_I64, out, (size_t)rows * sizeof(int64_t));
  const int64_t C = pred->shape[2];
  if (rows == 0 || C == 0) {
    for (int64_t r = 0; r < rows; r++) out[r] = -1; /* no class: never right */
    return GDP_OK;
  }
  float *scores = malloc((size_t)(rows * C) * sizeof(float));
  if (!scores) return GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for %lld scores",
                                   (long long)(rows * C));
  gdp_status s = gdp_tensor_to_host(pred, GDP_DTYPE_F32, scores, (size_t)(rows * C) * sizeof(float));
  for (int64_t r = 0; s == GDP_OK && r < rows; r++) {
    const float *row = scores + r * C;
    int64_t best = -1;
    for (int64_t c = 0; c < C; c++)
      if (!isnan(row[c]) && (best < 0 || row[c] > row[best])) best = c;
    out[r] = best;
  }
  free(scores);
  return s;
}

gdp_status gdp_data_sequence_accuracy(const gdp_tensor *predictions, const gdp_tensor *labels,
                                      int64_t n, double *cumulative, double *per_token) {
  static const char *func = "gdp_data_sequence_accuracy";
  char a[128], b[128];
  if (!predictions || !labels)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "predictions, labels: expected tensors, got NULL");
  if (labels->ndim != 2 || !is_int(labels->dtype))
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "labels: expected int32 or int64 [B,T], got %s %s",
                        gdp_dtype_name(labels->dtype),
                        gdp_shape_str(a, sizeof a, labels->ndim, labels->shape));
  const int64_t B = labels->shape[0], T = labels->shape[1];
  const int classes = predictions->ndim == 2 && is_int(predictions->dtype);
  const int scores = predictions->ndim == 3 && is_float(predictions->dtype);
  if ((!classes && !scores) || predictions->shape[0] != B || predictions->shape[1] != T)
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE,
                        "predictions: expected int32/int64 classes [B,T] = [%lld,%lld] or float "
                        "scores [B,T,C], got %s %s (labels %s)",
                        (long long)B, (long long)T, gdp_dtype_name(predictions->dtype),
                        gdp_shape_str(a, sizeof a, predictions->ndim, predictions->shape),
                        gdp_shape_str(b, sizeof b, labels->ndim, labels->shape));
  if (n != T)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "n: expected T = %lld (the labels' length, one value per token), got %lld",
                        (long long)T, (long long)n);
  int64_t *pred = malloc((size_t)(B * T > 0 ? B * T : 1) * sizeof(int64_t));
  int64_t *lab = malloc((size_t)(B * T > 0 ? B * T : 1) * sizeof(int64_t));
  int64_t *right = calloc((size_t)(T > 0 ? T : 1), sizeof(int64_t));
  int64_t *all_right = calloc((size_t)(T > 0 ? T : 1), sizeof(int64_t));
  gdp_status s = GDP_OK;
  if (!pred || !lab || !right || !all_right)
    s = GDP_ERROR_IN(func, GDP_ERR_OOM, "out of host memory for %lld tokens", (long long)(B * T));
  if (s == GDP_OK) s = predicted_classes(func, predictions, B * T, pred);
  if (s == GDP_OK) s = gdp_tensor_to_host(labels, GDP_DTYPE_I64, lab, (size_t)(B * T) * sizeof(int64_t));
  for (int64_t r = 0; s == GDP_OK && r < B; r++) {
    int prefix = 1;
    for (int64_t t = 0; t < T; t++) {
      const int ok = pred[r * T + t] == lab[r * T + t];
      prefix = prefix && ok;
      right[t] += ok;
      all_right[t] += prefix;
    }
  }
  for (int64_t t = 0; s == GDP_OK && t < T; t++) {
    if (per_token) per_token[t] = B > 0 ? (double)right[t] / (double)B : NAN;
    if (cumulative) cumulative[t] = B > 0 ? (double)all_right[t] / (double)B : NAN;
  }
  free(pred);
  free(lab);
  free(right);
  free(all_right);
  return s;
}
