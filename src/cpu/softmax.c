/*
 * softmax.c - softmax / log-softmax of any width on the CPU (one shot, or
 * a shard's columns from merged states), and their backward from the
 * output. The forward is one statistics pass and one write pass per row;
 * the backward takes the argmax of y first so the argmax entry can be
 * formed from the sums of the others.
 */
#include "common.h"
#include "rowpass.h"

/* Rows from their whole-row states (merged by the caller, or formed
 * here when merged is NULL: then the x are the whole rows). */
static lmloss_status softmax_rows(const lmloss_context *ctx, const lmloss_tensor *x,
                                  const lmloss_shard *sh, const lmloss_tensor *merged, int log,
                                  const lmloss_tensor *out) {
  const int64_t N = x->rows, n = x->cols;
  const lmloss_xform f = lmloss_xform_make(lmloss_transform_default());
  const int nt = lmloss_cpu_row_threads(ctx, N * n);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t i = 0; i < N; i++) {
    const void *row = lmloss_cpu_row(x, i);
    void *o = lmloss_cpu_row_mut(out, i);
    const lmloss_rowstate st = merged
                                   ? lmloss_rowstate_unpack(lmloss_cpu_row(merged, i), sh->vocab)
                                   : lmloss_cpu_row_state(row, x->dtype, n, 0, &f, NULL, 0, 0, -1);
    if (!lmloss_rowstate_ok(&st)) {
      lmloss_cpu_row_fill(o, out->dtype, n, NAN);
      continue;
    }
    float P = log ? lmloss_rowstat_l1r(&st.s) : 1.0f / (1.0f + st.s.r);
    lmloss_cpu_row_softmax(row, x->dtype, n, st.s.m, P, log, o, out->dtype);
  }
  return LMLOSS_OK;
}

lmloss_status lmloss_cpu_softmax(const lmloss_context *ctx, const lmloss_tensor *x, int log,
                                 const lmloss_tensor *out) {
  const lmloss_shard sh = lmloss_cpu_whole_row(x->cols, 0);
  return softmax_rows(ctx, x, &sh, NULL, log, out);
}

lmloss_status lmloss_cpu_softmax_finish(const lmloss_context *ctx, const lmloss_tensor *x,
                                        const lmloss_shard *sh, const lmloss_tensor *state, int log,
                                        const lmloss_tensor *out) {
  return softmax_rows(ctx, x, sh, state, log, out);
}

/* softmax:  dx_j = y_j (dy_j - sum_k dy_k y_k); at the argmax
 *           dx_a = y_a (dy_a sum_{k!=a} y_k - sum_{k!=a} dy_k y_k).
 * log:      dx_j = dy_j - p_j sum_k dy_k; at the argmax
 *           dx_a = dy_a (1 - p_a) - p_a sum_{k!=a} dy_k, 1 - p_a = -expm1(y_a). */
lmloss_status lmloss_cpu_softmax_backward(const lmloss_context *ctx, const lmloss_tensor *y,
                                          const lmloss_tensor *dy, int log,
                                          const lmloss_tensor *dx) {
  const int64_t N = y->rows, V = y->cols;
  const int nt = lmloss_cpu_row_threads(ctx, N * V);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t i = 0; i < N; i++) {
    const void *yr = lmloss_cpu_row(y, i), *dr = lmloss_cpu_row(dy, i);
    void *o = lmloss_cpu_row_mut(dx, i);
    int64_t a = 0;
    float ya = lmloss_load(yr, y->dtype, 0);
    for (int64_t j = 1; j < V; j++) {
      float v = lmloss_load(yr, y->dtype, j);
      if (v > ya || ya != ya) {
        ya = v;
        a = j;
      }
    }
    double rest_y = 0.0, rest_dyy = 0.0,
           rest_dy = 0.0; /* these sums cancel: accumulate in double */
    for (int64_t j = 0; j < V; j++) {
      if (j == a) continue;
      float yj = lmloss_load(yr, y->dtype, j), gj = lmloss_load(dr, dy->dtype, j);
      rest_y += log ? 0.0f : yj;
      rest_dyy += gj * yj;
      rest_dy += gj;
    }
    const float dya = lmloss_load(dr, dy->dtype, a);
    float xa;
    if (log)
      xa = (float)(dya * -expm1((double)ya) - exp((double)ya) * rest_dy);
    else
      xa = (float)(ya * (dya * rest_y - rest_dyy));
    const double total = log ? rest_dy + dya : rest_dyy + (double)dya * ya;
    for (int64_t j = 0; j < V; j++) {
      float yj = lmloss_load(yr, y->dtype, j), gj = lmloss_load(dr, dy->dtype, j);
      float v = (float)(log ? gj - exp((double)yj) * total : yj * (gj - total));
      lmloss_store(o, dx->dtype, j, j == a ? xa : v);
    }
  }
  return LMLOSS_OK;
}
