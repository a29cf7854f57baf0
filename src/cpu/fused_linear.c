/*
 * fused_linear.c - the CPU's building blocks of the fused linear head
 * (src/core/fused_linear.c runs the chunk loop): fp32 GEMMs through
 * OpenBLAS's CBLAS, row gathers and scatters, and small reductions. 16-bit
 * heads are not supported on the CPU (OpenBLAS has no half GEMM we can
 * rely on in Debian's build): they get LMLOSS_ERR_UNSUPPORTED.
 */
#include <cblas.h>
#include <string.h>

#include "common.h"
#include "core/validate.h"

static lmloss_status gemm(const lmloss_context *ctx, int t_a, int t_b, float alpha,
                          const lmloss_tensor *a, const lmloss_tensor *b, float beta,
                          const lmloss_tensor *c) {
  if (a->dtype != LMLOSS_F32 || b->dtype != LMLOSS_F32 || c->dtype != LMLOSS_F32)
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED,
                       "the CPU fused head takes F32 hidden/weight only (got %s)",
                       a->dtype == LMLOSS_BF16 ? "BF16" : "F16");
  const int64_t m = c->rows, n = c->cols, k = t_a ? a->rows : a->cols;
  if (m == 0 || n == 0) return LMLOSS_OK;
  cblas_sgemm(CblasRowMajor, t_a ? CblasTrans : CblasNoTrans, t_b ? CblasTrans : CblasNoTrans,
              (blasint)m, (blasint)n, (blasint)k, alpha, a->data, (blasint)a->row_stride, b->data,
              (blasint)b->row_stride, beta, c->data, (blasint)c->row_stride);
  return LMLOSS_OK;
}

static lmloss_status select_rows(const lmloss_context *ctx, const lmloss_tensor *labels,
                                 int64_t ignore, const lmloss_tensor *cw, int64_t *list,
                                 int64_t *count, double *weight_sum) {
  int64_t m = 0;
  double w = 0.0;
  for (int64_t i = 0; i < labels->rows; i++) {
    if (labels->dtype == LMLOSS_BOOL) {
      if (labels->data && !((const unsigned char *)labels->data)[i * labels->row_stride]) continue;
      w += 1.0;
    } else {
      int64_t y = lmloss_index_at(labels, i, 0);
      if (y == ignore) continue;
      w += lmloss_present(cw) ? ((const float *)cw->data)[y * cw->row_stride] : 1.0;
    }
    list[m++] = i;
  }
  *count = m;
  *weight_sum = w;
  return LMLOSS_OK;
}

static lmloss_status gather_rows(const lmloss_context *ctx, const lmloss_tensor *src,
                                 const int64_t *list, const lmloss_tensor *dst) {
  const size_t bytes = (size_t)dst->cols * lmloss_dtype_size(dst->dtype);
#pragma omp parallel for num_threads(lmloss_cpu_threads(ctx)) if (dst->rows * bytes > (1 << 20))
  for (int64_t r = 0; r < dst->rows; r++)
    memcpy(lmloss_cpu_row_mut(dst, r), lmloss_cpu_row(src, list[r]), bytes);
  return LMLOSS_OK;
}

static lmloss_status scatter_rows(const lmloss_context *ctx, const lmloss_tensor *src,
                                  const int64_t *list, const lmloss_tensor *dst) {
  const size_t bytes = (size_t)src->cols * lmloss_dtype_size(src->dtype);
#pragma omp parallel for num_threads(lmloss_cpu_threads(ctx)) if (src->rows * bytes > (1 << 20))
  for (int64_t r = 0; r < src->rows; r++)
    memcpy(lmloss_cpu_row_mut(dst, list[r]), lmloss_cpu_row(src, r), bytes);
  return LMLOSS_OK;
}

static lmloss_status fill(const lmloss_context *ctx, const lmloss_tensor *t, double v) {
#pragma omp parallel for num_threads(lmloss_cpu_threads(ctx)) if (t->rows * t->cols > (1 << 18))
  for (int64_t r = 0; r < t->rows; r++) {
    void *row = lmloss_cpu_row_mut(t, r);
    for (int64_t j = 0; j < t->cols; j++) {
      if (t->dtype == LMLOSS_I64)
        ((int64_t *)row)[j] = (int64_t)v;
      else
        lmloss_store(row, t->dtype, j, (float)v);
    }
  }
  return LMLOSS_OK;
}

/* The bias goes in first, and the GEMM adds to it (beta = 1). */
static lmloss_status logits(const lmloss_context *ctx, const lmloss_tensor *h,
                            const lmloss_tensor *w, const lmloss_tensor *bias,
                            const lmloss_tensor *c) {
  const int with_bias = lmloss_present(bias);
  if (with_bias) {
#pragma omp parallel for num_threads(lmloss_cpu_threads(ctx))
    for (int64_t r = 0; r < c->rows; r++) {
      float *row = lmloss_cpu_row_mut(c, r);
      for (int64_t j = 0; j < c->cols; j++)
        row[j] = lmloss_load(bias->data, bias->dtype, j * bias->row_stride);
    }
  }
  return gemm(ctx, 0, 1, 1.0f, h, w, with_bias ? 1.0f : 0.0f, c);
}

/* Column sums over the rows in row order, columns in parallel: the result
 * does not depend on the thread count. */
static lmloss_status colsum(const lmloss_context *ctx, const lmloss_tensor *a,
                            const lmloss_row_keep *entries, float beta, const lmloss_tensor *out) {
  if (entries) return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "CPU: kept entries are 16-bit heads'");
#pragma omp parallel for num_threads(lmloss_cpu_threads(ctx))
  for (int64_t j0 = 0; j0 < a->cols; j0 += 256) {
    const int64_t n = a->cols - j0 < 256 ? a->cols - j0 : 256;
    double acc[256] = {0};
    for (int64_t r = 0; r < a->rows; r++) {
      const void *row = lmloss_cpu_row(a, r);
      for (int64_t j = 0; j < n; j++)
        acc[j] += lmloss_load(row, a->dtype, j0 + j);
    }
    for (int64_t j = 0; j < n; j++) {
      int64_t o = (j0 + j) * out->row_stride;
      float prev = beta != 0.0f ? lmloss_load(out->data, out->dtype, o) : 0.0f;
      lmloss_store(out->data, out->dtype, o, (float)(beta * prev + acc[j]));
    }
  }
  return LMLOSS_OK;
}

static lmloss_status sum(const lmloss_context *ctx, const lmloss_tensor *src,
                         const lmloss_tensor *dst) {
  double s = 0.0;
  for (int64_t r = 0; r < src->rows; r++)
    s += *lmloss_cpu_f32_at(src, r);
  *(float *)dst->data = (float)s;
  return LMLOSS_OK;
}

static lmloss_status cast(const lmloss_context *ctx, const lmloss_tensor *src,
                          const lmloss_tensor *dst) {
#pragma omp parallel for num_threads(lmloss_cpu_threads(ctx))
  for (int64_t r = 0; r < src->rows; r++) {
    const void *s = lmloss_cpu_row(src, r);
    void *d = lmloss_cpu_row_mut(dst, r);
    for (int64_t j = 0; j < src->cols; j++)
      lmloss_store(d, dst->dtype, j, lmloss_load(s, src->dtype, j));
  }
  return LMLOSS_OK;
}

static lmloss_status scale(const lmloss_context *ctx, const lmloss_tensor *t, const float *s) {
  const float a = *s;
  if (a == 1.0f) return LMLOSS_OK; /* x * 1 is x, NaN included */
#pragma omp parallel for num_threads(lmloss_cpu_threads(ctx))
  for (int64_t r = 0; r < t->rows; r++) {
    void *row = lmloss_cpu_row_mut(t, r);
    for (int64_t j = 0; j < t->cols; j++)
      lmloss_store(row, t->dtype, j, lmloss_load(row, t->dtype, j) * a);
  }
  return LMLOSS_OK;
}

static lmloss_status scale_rows(const lmloss_context *ctx, const lmloss_tensor *t,
                                const lmloss_tensor *s) {
#pragma omp parallel for num_threads(lmloss_cpu_threads(ctx))
  for (int64_t r = 0; r < t->rows; r++) {
    void *row = lmloss_cpu_row_mut(t, r);
    const float a = *lmloss_cpu_f32_at(s, r);
    for (int64_t j = 0; j < t->cols; j++)
      lmloss_store(row, t->dtype, j, lmloss_load(row, t->dtype, j) * a);
  }
  return LMLOSS_OK;
}

/* restore_entries: 16-bit heads only. */
const lmloss_linear_prims lmloss_cpu_linear = {
    gemm,   select_rows, gather_rows, scatter_rows, fill, logits,
    colsum, sum,         cast,        scale,        NULL, scale_rows,
};
