/* common.h - small helpers of the CPU backend's op files. */
#ifndef LMLOSS_CPU_COMMON_H
#define LMLOSS_CPU_COMMON_H

#include <omp.h>

#include "core/backend.h"
#include "math/dtype.h"

static inline int lmloss_cpu_threads(const lmloss_context *ctx) {
  return ctx && ctx->num_threads > 0 ? ctx->num_threads : omp_get_max_threads();
}

/* Threads for a row op over `logits` logits: the context's count, but by
 * default (num_threads 0) one below 32K logits, where a parallel region's
 * fork and join cost as much as the work, and far more when the cores
 * are busy (docs/benchmarks-history.md has the measurements). Results
 * never depend on the thread count. */
static inline int lmloss_cpu_row_threads(const lmloss_context *ctx, int64_t logits) {
  const int asked = ctx && ctx->num_threads > 0;
  return asked || logits >= (1 << 15) ? lmloss_cpu_threads(ctx) : 1;
}

static inline const void *lmloss_cpu_row(const lmloss_tensor *t, int64_t i) {
  return (const char *)t->data + (size_t)(i * t->row_stride) * lmloss_dtype_size(t->dtype);
}

static inline void *lmloss_cpu_row_mut(const lmloss_tensor *t, int64_t i) {
  return (char *)t->data + (size_t)(i * t->row_stride) * lmloss_dtype_size(t->dtype);
}

/* Element (i, 0) of a 1-D F32 tensor. */
static inline float *lmloss_cpu_f32_at(const lmloss_tensor *t, int64_t i) {
  return (float *)t->data + i * t->row_stride;
}

/* A one-shot call's shard: the whole row. */
static inline lmloss_shard lmloss_cpu_whole_row(int64_t cols, int entropy) {
  lmloss_shard sh = {0, cols, entropy};
  return sh;
}

static inline int lmloss_cpu_masked_out(const lmloss_tensor *mask, int64_t i) {
  return lmloss_present(mask) && !((const unsigned char *)mask->data)[i * mask->row_stride];
}

#endif
