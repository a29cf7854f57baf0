/* block.h - a row's block to fp32, a gradient block back to its dtype,
 * and a block's first max, for the CPU passes (vectorized: no
 * per-element dtype switch). */
#ifndef LMLOSS_CPU_BLOCK_H
#define LMLOSS_CPU_BLOCK_H

#include <math.h>
#include <string.h>

#include "math/dtype.h"

/* Convert n elements starting at j0 to fp32. */
static inline void lmloss_cpu_load_block(const void *row, lmloss_dtype dt, int64_t j0, int n,
                                         float *buf) {
  if (dt == LMLOSS_F32) {
    memcpy(buf, (const float *)row + j0, (size_t)n * sizeof(float));
  } else if (dt == LMLOSS_BF16) {
    const uint16_t *h = (const uint16_t *)row + j0;
#pragma omp simd
    for (int i = 0; i < n; i++)
      buf[i] = lmloss_bf16_to_f32(h[i]);
  } else {
    const uint16_t *h = (const uint16_t *)row + j0;
#pragma omp simd
    for (int i = 0; i < n; i++)
      buf[i] = lmloss_f16_to_f32(h[i]);
  }
}

static inline void lmloss_cpu_store_block(void *out, lmloss_dtype odt, int64_t j0, int n,
                                          const float *g) {
  if (odt == LMLOSS_F32) {
    memcpy((float *)out + j0, g, (size_t)n * sizeof(float));
  } else if (odt == LMLOSS_BF16) {
    uint16_t *h = (uint16_t *)out + j0;
#pragma omp simd
    for (int i = 0; i < n; i++)
      h[i] = lmloss_f32_to_bf16(g[i]);
  } else {
    uint16_t *h = (uint16_t *)out + j0;
#pragma omp simd
    for (int i = 0; i < n; i++)
      h[i] = lmloss_f32_to_f16(g[i]);
  }
}

/* The first index of the max of w[0, n) (n >= 1), the max into *m; NaN
 * is never the max. OpenMP may start a max reduction at -FLT_MAX (clang's
 * does), which a block of only -inf and NaN never reaches: its max is
 * -inf, at its first -inf (0 when it holds none). Always inlined, so that
 * each ISA clone of a caller vectorizes it. */
static inline __attribute__((always_inline)) int lmloss_cpu_first_max(const float *w, int n,
                                                                      float *m) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int i = 0; i < n; i++)
    mx = w[i] > mx ? w[i] : mx;
  int a = n;
  for (int pass = 0; pass < 2 && a == n; pass++) {
    if (pass) mx = -INFINITY;
#pragma omp simd reduction(min : a)
    for (int i = 0; i < n; i++)
      a = w[i] == mx && i < a ? i : a;
  }
  *m = mx;
  return a < n ? a : 0;
}

#endif
