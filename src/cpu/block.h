/* block.h - a row's block to fp32 and a gradient block back to its
 * dtype, for the CPU passes (vectorized: no per-element dtype switch). */
#ifndef LMLOSS_CPU_BLOCK_H
#define LMLOSS_CPU_BLOCK_H

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

#endif
