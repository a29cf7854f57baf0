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

/* softmax: dx_j = y_j (dy_j - sum_k dy_k y_k); at the argmax
 *          dx_a = y_a (dy_a sum_{k!=a} y_k - sum_{k!=a} dy_k y_k).
 * log:     dx_j = dy_j - p_j sum_k dy_k; at the argmax
 *          dx_a = dy_a (1 - p_a) - p_a sum_{k!=a} dy_k, 1 - p_a = -expm1(y_a).
 * The sums leave the argmax out, so its entry survives collapse. */
lmloss_status lmloss_cpu_softmax_backward(const lmloss_context *ctx, const lmloss_tensor *y,
                                          const lmloss_tensor *dy, int log,
                                          const lmloss_tensor *dx) {
  const int64_t N = y->rows, V = y->cols;
  const int nt = lmloss_cpu_row_threads(ctx, N * V);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t i = 0; i < N; i++) {
    const void *yr = lmloss_cpu_row(y, i), *dr = lmloss_cpu_row(dy, i);
    void *o = lmloss_cpu_row_mut(dx, i);
    const int64_t a = lmloss_cpu_row_argmax(yr, y->dtype, V);
    const float ya = lmloss_load(yr, y->dtype, a), dya = lmloss_load(dr, dy->dtype, a);
    double rest_y = 0.0; /* softmax: the sum is -sum_{k!=a} dy_k y_k */
    const double sum =
        lmloss_cpu_row_softmax_bwd_sum(yr, y->dtype, dr, dy->dtype, V, a, 0.0f, log, &rest_y);
    const float xa = log ? (float)(dya * -expm1((double)ya) - exp((double)ya) * sum)
                         : (float)(ya * (dya * rest_y + sum));
    const double total = log ? sum + dya : (double)dya * ya - sum;
    lmloss_cpu_row_softmax_bwd(yr, y->dtype, dr, dy->dtype, V, log ? 0.0f : (float)total,
                               log ? (float)total : 0.0f, log, o, dx->dtype);
    lmloss_store(o, dx->dtype, a, xa);
  }
  return LMLOSS_OK;
}

/* A shard's backward (lmloss.h): with dx NULL the partial sums of its
 * columns other than the merged state's argmax a, else dx from the summed
 * ones, its entry at a from the state's R. */
lmloss_status lmloss_cpu_softmax_bwd_shard(const lmloss_context *ctx, const lmloss_tensor *y,
                                           const lmloss_tensor *dy, int log, const lmloss_shard *sh,
                                           const lmloss_tensor *state, const lmloss_tensor *dy_a,
                                           const lmloss_tensor *partials, const lmloss_tensor *dx) {
  const int64_t N = y->rows, n = y->cols;
  const int nt = lmloss_cpu_row_threads(ctx, N * n);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t i = 0; i < N; i++) {
    const void *yr = lmloss_cpu_row(y, i), *dr = lmloss_cpu_row(dy, i);
    double *part = (double *)lmloss_cpu_row_mut(partials, i);
    const lmloss_rowstate st = lmloss_rowstate_unpack(lmloss_cpu_row(state, i), sh->vocab);
    const int ok = lmloss_rowstate_ok(&st);
    const int64_t a = st.s.a - sh->col0 >= 0 && st.s.a - sh->col0 < n ? st.s.a - sh->col0 : -1;
    const float dya = *(const float *)lmloss_cpu_row(dy_a, i);
    if (!dx) {
      *part = ok ? lmloss_cpu_row_softmax_bwd_sum(yr, y->dtype, dr, dy->dtype, n, a, dya, log, NULL)
                 : NAN;
      continue;
    }
    void *o = lmloss_cpu_row_mut(dx, i);
    if (!ok) {
      lmloss_cpu_row_fill(o, dx->dtype, n, NAN);
      continue;
    }
    const double c = *part, pa = 1.0 / (1.0 + (double)st.s.r);
    lmloss_cpu_row_softmax_bwd(yr, y->dtype, dr, dy->dtype, n, log ? 0.0f : dya,
                               (float)(log ? c + dya : c), log, o, dx->dtype);
    if (a >= 0) lmloss_store(o, dx->dtype, a, (float)(log ? dya * (st.s.r * pa) - pa * c : pa * c));
  }
  return LMLOSS_OK;
}
