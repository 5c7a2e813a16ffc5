/*
 * dtype.c -- dtype names and sizes, bfloat16 conversions.
 */
#include <string.h>

#include "internal.h"

static const char *const dtype_names[GDP_DTYPE_COUNT] = {"f64", "f32", "bf16", "i32", "i64"};
static const size_t dtype_sizes[GDP_DTYPE_COUNT] = {8, 4, 2, 4, 8};

const char *gdp_dtype_name(gdp_dtype dtype) {
  if ((int)dtype < 0 || dtype >= GDP_DTYPE_COUNT) return "?";
  return dtype_names[dtype];
}

size_t gdp_dtype_size(gdp_dtype dtype) {
  if ((int)dtype < 0 || dtype >= GDP_DTYPE_COUNT) return 0;
  return dtype_sizes[dtype];
}

gdp_status gdp_dtype_from_name(const char *name, gdp_dtype *out) {
  static const struct {
    const char *name;
    gdp_dtype dtype;
  } aliases[] = {
      {"f64", GDP_DTYPE_F64},   {"float64", GDP_DTYPE_F64}, {"double", GDP_DTYPE_F64},
      {"f32", GDP_DTYPE_F32},   {"float32", GDP_DTYPE_F32}, {"float", GDP_DTYPE_F32},
      {"bf16", GDP_DTYPE_BF16}, {"bfloat16", GDP_DTYPE_BF16},
      {"i32", GDP_DTYPE_I32},   {"int32", GDP_DTYPE_I32},
      {"i64", GDP_DTYPE_I64},   {"int64", GDP_DTYPE_I64},
  };
  if (!out) return GDP_ERROR(GDP_ERR_INVALID_ARG, "out is NULL");
  if (!name) return GDP_ERROR(GDP_ERR_INVALID_ARG, "name is NULL");
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++) {
    if (strcmp(name, aliases[i].name) == 0) {
      *out = aliases[i].dtype;
      return GDP_OK;
    }
  }
  return GDP_ERROR(GDP_ERR_DTYPE,
                   "unknown dtype name \"%s\", expected one of f64, f32, bf16, i32, i64 "
                   "(or float64, float32, bfloat16, int32, int64, double, float)",
                   name);
}

uint16_t gdp_bf16_from_f32(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    /* NaN: keep sign and top payload bits, force the quiet bit so that truncation
     * cannot turn it into an infinity. */
    return (uint16_t)((bits >> 16) | 0x0040u);
  }
  /* Round to nearest even on the 16 dropped bits; a carry into the exponent is the
   * correct result, including finite values that round up to infinity. */
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)((bits + rounding) >> 16);
}

float gdp_f32_from_bf16(uint16_t x) {
  uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
