/*
 * dtype.h - bf16 / fp16 <-> fp32 by bit manipulation, for C and CUDA.
 * Round to nearest even on the way down; NaN stays NaN. Pure integer
 * arithmetic, so compilers vectorize the loops that use it.
 */
#ifndef LMLOSS_MATH_DTYPE_H
#define LMLOSS_MATH_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "rowstats.h"

/* Bytes of one element (element offsets are computed in 64 bits). */
LMLOSS_HD size_t lmloss_dtype_size(lmloss_dtype d) {
  switch (d) {
  case LMLOSS_F64:
  case LMLOSS_I64: return 8;
  case LMLOSS_F32:
  case LMLOSS_I32: return 4;
  case LMLOSS_BF16:
  case LMLOSS_F16: return 2;
  case LMLOSS_BOOL: return 1;
  }
  return 0;
}

LMLOSS_HD float lmloss_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

LMLOSS_HD uint32_t lmloss_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

LMLOSS_HD float lmloss_bf16_to_f32(uint16_t h) { return lmloss_bits_f32((uint32_t)h << 16); }

LMLOSS_HD uint16_t lmloss_f32_to_bf16(float f) {
  uint32_t u = lmloss_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

LMLOSS_HD float lmloss_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return lmloss_bits_f32(sign | 0x7f800000u | (m << 13));
  if (e != 0) return lmloss_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
  /* subnormal half: m * 2^-24, exact in fp32 */
  float v = (float)m * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

LMLOSS_HD uint16_t lmloss_f32_to_f16(float f) {
  uint32_t u = lmloss_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
  if (a < 0x38800000u) {                                   /* subnormal or zero half */
    /* add 0.5 (2^-1) so the fp32 adder rounds the mantissa at 2^-24 */
    float v = lmloss_bits_f32(a) + 0.5f;
    return (uint16_t)(sign | (uint16_t)(lmloss_f32_bits(v) - 0x3f000000u));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return (uint16_t)(sign | (uint16_t)(r >> 13));
}

/* Load element j of a row of dtype d (F32, BF16 or F16) as fp32. */
LMLOSS_HD float lmloss_load(const void *row, lmloss_dtype d, int64_t j) {
  if (d == LMLOSS_F32) return ((const float *)row)[j];
  uint16_t h = ((const uint16_t *)row)[j];
  return d == LMLOSS_BF16 ? lmloss_bf16_to_f32(h) : lmloss_f16_to_f32(h);
}

LMLOSS_HD void lmloss_store(void *row, lmloss_dtype d, int64_t j, float v) {
  if (d == LMLOSS_F32)
    ((float *)row)[j] = v;
  else
    ((uint16_t *)row)[j] = d == LMLOSS_BF16 ? lmloss_f32_to_bf16(v) : lmloss_f32_to_f16(v);
}

#endif
