/*
 * workspace.h - how the fused heads lay out their workspace: aligned
 * buffers, views into them, and the rows a chunk takes within a budget.
 */
#ifndef LMLOSS_CORE_WORKSPACE_H
#define LMLOSS_CORE_WORKSPACE_H

#include "backend.h"

/* Every buffer starts on this boundary (GEMM and vector loads). */
#define LMLOSS_WS_ALIGN 256

static inline size_t lmloss_ws_up(size_t x) {
  return (x + LMLOSS_WS_ALIGN - 1) / LMLOSS_WS_ALIGN * LMLOSS_WS_ALIGN;
}

/* The first address from p on the boundary. */
static inline char *lmloss_ws_ptr_up(char *p) {
  return p + (LMLOSS_WS_ALIGN - (uintptr_t)p % LMLOSS_WS_ALIGN) % LMLOSS_WS_ALIGN;
}

/* A dense row-major view of workspace bytes. */
static inline lmloss_tensor lmloss_ws_view(void *data, lmloss_dtype dt, lmloss_device dev,
                                           int64_t rows, int64_t cols) {
  lmloss_tensor t = {data, dt, dev, rows, cols, cols};
  return t;
}

/* Rows first..first+n of t. */
static inline lmloss_tensor lmloss_rows_of(const lmloss_tensor *t, int64_t first, int64_t n) {
  lmloss_tensor v = *t;
  v.data = (char *)t->data + (size_t)(first * t->row_stride) * lmloss_dtype_size(t->dtype);
  v.rows = n;
  return v;
}

/* Rows of a chunk: what the budget holds beyond `fixed` bytes at
 * `per_row` bytes a row, at most N (at least 1 for N = 0), and whole
 * GEMM tiles of 128 above that; 0 when not one row fits. */
static inline int64_t lmloss_chunk_rows(size_t budget, size_t fixed, size_t per_row, int64_t N) {
  int64_t rows = budget > fixed ? (int64_t)((budget - fixed) / per_row) : 0;
  if (rows < 1) return 0;
  if (rows > N) rows = N > 0 ? N : 1;
  if (rows > 128) rows -= rows % 128;
  return rows;
}

#endif
