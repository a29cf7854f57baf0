/*
 * ce.c - float64 reference of the cross-entropy family (forward, fused
 * forward+backward, backward from dloss), exactly as lmloss.h defines it.
 *
 * Per supervised row with target y, in double: the max-split statistics of
 * refrow.h, then
 *   lse - z_j = (m - w_j) k + log1p(R)                (every term >= 0)
 *   ce  = c_y (1 - e) (lse - z_y) + (e / V) sum_j c_j (lse - z_j), times p_y
 *         for DFT;  loss = w_i (ce + z_loss lse^2)
 *   dce/dz_j = A p_j - B_j, A = c_y (1 - e) + e C / V,
 *         B_j = c_y (1 - e) [j == y] + e c_j / V; at the argmax with
 *         p_a > 1/2 it is (A - B_a) - A R / (1 + R) (the row sums to zero);
 *   times p_y for DFT, plus 2 z_loss lse p_j, times w_i, the reduction
 *   factor and the upstream gradient, then dz/dx.
 * Ignored rows are not read; a non-finite row gives NaN everywhere and
 * argmax -1. The workspace is not used.
 */
#include "refrow.h"

static int64_t target_at(const lmloss_tensor *t, int64_t i) {
  const char *p = ref_row_ptr(t, i);
  return t->dtype == LMLOSS_I64 ? *(const int64_t *)p : (int64_t) * (const int32_t *)p;
}

/* Forward when out != NULL (gradient too when out->dlogits is present);
 * backward from dloss otherwise. */
static lmloss_status ce_run(const lmloss_ce_inputs *in, const lmloss_ce_options *opt,
                            const lmloss_ce_outputs *out, const lmloss_tensor *dloss,
                            const lmloss_tensor *dlogits) {
  const lmloss_tensor *X = &in->logits;
  int64_t N = X->rows, V = X->cols;
  ref_xf f = ref_xf_make(&opt->transform);
  int has_cw = lmloss_present(&in->class_weight), has_tw = lmloss_present(&in->token_weight);
  double *x = ref_alloc(V), *w = ref_alloc(V), *cw = ref_alloc(V);
  if (!x || !w || !cw) {
    free(x), free(w), free(cw);
    return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "REF backend: out of host memory");
  }
  double C = 0.0;
  for (int64_t j = 0; j < V; j++) {
    cw[j] = has_cw ? (double)ref_f32_at(&in->class_weight, j) : 1.0;
    C += cw[j];
  }
  /* The reduction factor needs only targets and class weights. */
  double denom = 0.0;
  for (int64_t i = 0; i < N; i++) {
    int64_t y = target_at(&in->target, i);
    if (y != opt->ignore_index) denom += cw[y];
  }
  double factor = 1.0;
  if (opt->reduction == LMLOSS_REDUCE_MEAN) factor = denom > 0.0 ? 1.0 / denom : 0.0;
  if (opt->reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) factor = 1.0 / opt->num_items;
  int reduced = opt->reduction != LMLOSS_REDUCE_NONE;
  const double e = opt->label_smoothing, zl = opt->z_loss;
  double total = 0.0;

  for (int64_t i = 0; i < N; i++) {
    int64_t y = target_at(&in->target, i);
    double loss = 0.0, lse = 0.0, ent = 0.0;
    int64_t amax = -1;
    char *drow = dlogits ? ref_row_mut(dlogits, i) : NULL;
    if (y == opt->ignore_index) {
      if (drow && opt->zero_ignored_rows)
        for (int64_t j = 0; j < V; j++)
          ref_store(drow, dlogits->dtype, j, 0.0);
    } else {
      ref_load_row(X, i, x);
      ref_row st;
      ref_row_stats(&f, x, w, V, &st);
      if (!st.finite) {
        loss = lse = ent = NAN;
        if (drow)
          for (int64_t j = 0; j < V; j++)
            ref_store(drow, dlogits->dtype, j, NAN);
      } else {
        lse = st.lse, ent = st.ent, amax = st.a;
        double hot = cw[y] * (1.0 - e), sm = e / (double)V, A = hot + sm * C;
        double ce = hot > 0.0 ? hot * ((st.m - w[y]) * f.k + st.l1r) : 0.0;
        if (sm > 0.0) {
          double s = 0.0;
          for (int64_t j = 0; j < V; j++)
            if (cw[j] != 0.0) s += cw[j] * ((st.m - w[j]) * f.k + st.l1r);
          ce += sm * s;
        }
        double py = exp(ref_logp(&f, &st, w[y]));
        if (opt->dft) ce *= py;
        double wi = has_tw ? (double)ref_f32_at(&in->token_weight, i) : 1.0;
        loss = wi * (ce + zl * lse * lse);
        if (drow) {
          double up = dloss ? (double)ref_f32_at(dloss, reduced ? 0 : i) : (double)opt->grad_output;
          double g = wi * factor * up, dft = opt->dft ? py : 1.0;
          for (int64_t j = 0; j < V; j++) {
            double p = exp(ref_logp(&f, &st, w[j]));
            double b = (j == y ? hot : 0.0) + sm * cw[j];
            double d = (j == st.a && st.r < 1.0) ? (A - b) - A * (st.r / (1.0 + st.r)) : A * p - b;
            d = d * dft + 2.0 * zl * lse * p; /* DFT scales ce only */
            ref_store(drow, dlogits->dtype, j, g * d * ref_dzdx(&f, x[j]));
          }
        }
      }
    }
    total += loss;
    if (out) {
      if (!reduced) *(float *)ref_row_mut(&out->loss, i) = (float)loss;
      if (lmloss_present(&out->lse)) *(float *)ref_row_mut(&out->lse, i) = (float)lse;
      if (lmloss_present(&out->entropy)) *(float *)ref_row_mut(&out->entropy, i) = (float)ent;
      if (lmloss_present(&out->argmax)) *(int64_t *)ref_row_mut(&out->argmax, i) = amax;
    }
  }
  if (out && reduced) *(float *)out->loss.data = (float)(total * factor);
  free(x), free(w), free(cw);
  return LMLOSS_OK;
}

lmloss_status lmloss_ref_cross_entropy(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                       const lmloss_ce_options *opt, const lmloss_ce_outputs *out,
                                       void *ws, size_t ws_bytes, lmloss_row_keep *keep) {
  return ce_run(in, opt, out, NULL, lmloss_present(&out->dlogits) ? &out->dlogits : NULL);
}

lmloss_status lmloss_ref_cross_entropy_backward(const lmloss_context *ctx,
                                                const lmloss_ce_inputs *in,
                                                const lmloss_ce_options *opt,
                                                const lmloss_tensor *dloss,
                                                const lmloss_tensor *dlogits, void *ws,
                                                size_t ws_bytes, lmloss_row_keep *keep) {
  return ce_run(in, opt, NULL, dloss, dlogits);
}
