/*
 * vmath.h - fp32 exp, expm1 and log1p as pure arithmetic, for C and CUDA:
 * the CPU passes that call them vectorize in their AVX-512 and x86-64-v3
 * clones (cpu/dispatch.h; libm's calls would keep each loop scalar), and
 * a GPU runs them as FMAs, with the CPU's results to the last bit.
 */
#ifndef LMLOSS_MATH_VMATH_H
#define LMLOSS_MATH_VMATH_H

#include <math.h>
#include <stdint.h>

#include "dtype.h"

/* Always inlined: an outlined copy is compiled for the baseline ISA and
 * calls libm's fmaf, which undoes the clones' vectorization. */
#if defined(__CUDACC__)
#define LMLOSS_VMATH __host__ __device__ __forceinline__
#else
#define LMLOSS_VMATH static inline __attribute__((always_inline))
#endif

/* exp(hi + lo) for hi <= 0, down through the fp32 subnormals (a row sum
 * of many subnormal terms can be a normal number). Cody-Waite reduction,
 * degree-6 Taylor on |r| <= ln2/2 (error 1.7e-7); 2^n is applied as
 * 2^(n+64) 2^-64, so the one rounding into the subnormals happens last.
 * Pure arithmetic, so a loop that calls it can vectorize: in the AVX-512
 * and x86-64-v3 clones, the latter only under -fno-trapping-math. */
LMLOSS_VMATH float lmloss_vexp_neg(float hi, float lo) {
  const float magic = 12582912.0f; /* 1.5 * 2^23: round to nearest */
  /* -inf and NaN stay convertible, and so does a positive exponent, which
   * only statistics not of these logits give (lmloss.h: garbage then, but
   * never an out-of-range conversion) */
  float h = hi > -104.0f ? (hi < 40.0f ? hi : 40.0f) : -104.0f;
  float n = (h * 1.44269504088896341f + magic) - magic;
  float r = fmaf(n, -0.693145751953125f, h);
  r = fmaf(n, -1.428606765330187e-06f, r) + lo;
  float p = 1.0f / 720.0f;
  p = fmaf(p, r, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  float scale = lmloss_bits_f32((uint32_t)((int32_t)n + 64 + 127) << 23);
  return hi < -103.972f ? 0.0f : p * scale * 0x1p-64f;
}

/* (e^x - 1 - x) / x^2 for |x| <= 1, the tail of expm1's series
 * (lmloss_vexpm1_small), which the KL's summands share: a degree-7
 * polynomial fitted for least relative error on [-1, 1] (4.3e-9 of the
 * tail there, below fp32's rounding of it), two terms fewer than Taylor's
 * for that error. Horner's form in x: one FMA a term. */
LMLOSS_VMATH float lmloss_vexpm1_tail(float x) {
  /* unrolled: a loop here would keep the callers' loops from vectorizing */
  float p = fmaf(x, 2.77227855e-06f, 2.53548333e-05f);
  p = fmaf(p, x, 0.000198440248f);
  p = fmaf(p, x, 0.00138854515f);
  p = fmaf(p, x, 0.00833331048f);
  p = fmaf(p, x, 0.041666735f);
  p = fmaf(p, x, 0.166666672f);
  return fmaf(p, x, 0.5f);
}

/* expm1(x) for |x| <= 1 (error about 1e-9 relative, below fp32's
 * rounding), full relative precision near 0 where e^x - 1 would cancel. */
LMLOSS_VMATH float lmloss_vexpm1_small(float x) { return x * fmaf(lmloss_vexpm1_tail(x), x, 1.0f); }

/* log1p(y) for y in [-0.64, 2] (|s| <= 1/2): 2 atanh(s), s = y / (2 + y),
 * atanh(s) / s a degree-6 polynomial in s^2 fitted for least relative
 * error on s^2 in [0, 1/4] (1.3e-9, below fp32's rounding; Taylor's
 * series needs twice the terms); exact near 0. */
LMLOSS_VMATH float lmloss_vlog1p_mid(float y) {
  const float s = y / (2.0f + y), s2 = s * s;
  float p = fmaf(s2, 0.178554311f, 0.0498508289f);
  p = fmaf(p, s2, 0.118705556f);
  p = fmaf(p, s2, 0.142158017f);
  p = fmaf(p, s2, 0.200030178f);
  p = fmaf(p, s2, 0.333332837f);
  p = fmaf(p, s2, 1.0f);
  return 2.0f * s * p;
}

#endif
