/*
 * softmax.c - float64 reference of softmax / log-softmax and their
 * backward from the forward's output y.
 *
 * Forward: log p_j = (x_j - m) - log1p(R); out = log p or exp(log p). A
 * non-finite row (NaN, +inf, or only -inf) gives a NaN row.
 * Backward: softmax dx = y (dy - sum(dy y)), log-softmax
 * dx = dy - exp(y) sum(dy). At the (first) argmax a of y the entry comes
 * from the other entries, as lmloss.h says, so it survives collapse:
 *   softmax:     dx_a = y_a sum_{k != a} (dy_a - dy_k) y_k
 *   log-softmax: dx_a = -sum_{k != a} dy_k - expm1(y_a) sum(dy)
 * (1 - p_a = -expm1(y_a)). dx may alias dy: rows are read before written.
 */
#include "refrow.h"

lmloss_status lmloss_ref_softmax(const lmloss_context *ctx, const lmloss_tensor *x, int log,
                                 const lmloss_tensor *out) {
  int64_t N = x->rows, V = x->cols;
  ref_xf f = ref_xf_identity();
  double *xb = ref_alloc(V), *w = ref_alloc(V);
  if (!xb || !w) {
    free(xb), free(w);
    return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "REF backend: out of host memory");
  }
  for (int64_t i = 0; i < N; i++) {
    ref_load_row(x, i, xb);
    ref_row st;
    ref_row_stats(&f, xb, w, V, &st);
    char *orow = ref_row_mut(out, i);
    for (int64_t j = 0; j < V; j++) {
      double lp = st.finite ? ref_logp(&f, &st, w[j]) : NAN;
      ref_store(orow, out->dtype, j, log ? lp : exp(lp));
    }
  }
  free(xb), free(w);
  return LMLOSS_OK;
}

lmloss_status lmloss_ref_softmax_backward(const lmloss_context *ctx, const lmloss_tensor *y,
                                          const lmloss_tensor *dy, int log,
                                          const lmloss_tensor *dx) {
  int64_t N = y->rows, V = y->cols;
  double *yb = ref_alloc(V), *gb = ref_alloc(V);
  if (!yb || !gb) {
    free(yb), free(gb);
    return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "REF backend: out of host memory");
  }
  for (int64_t i = 0; i < N; i++) {
    ref_load_row(y, i, yb);
    ref_load_row(dy, i, gb);
    int64_t a = 0;
    for (int64_t j = 1; j < V; j++)
      if (yb[j] > yb[a]) a = j;
    double s = 0.0;
    for (int64_t j = 0; j < V; j++)
      s += log ? gb[j] : gb[j] * yb[j];
    double da = 0.0;
    for (int64_t k = 0; k < V; k++)
      if (k != a) da += log ? -gb[k] : (gb[a] - gb[k]) * yb[k];
    da = log ? da - expm1(yb[a]) * s : yb[a] * da;
    char *drow = ref_row_mut(dx, i);
    for (int64_t j = 0; j < V; j++) {
      double d = log ? gb[j] - exp(yb[j]) * s : yb[j] * (gb[j] - s);
      ref_store(drow, dx->dtype, j, j == a ? da : d);
    }
  }
  free(yb), free(gb);
  return LMLOSS_OK;
}
