/*
 * logprob.c - float64 reference of log-probs (any K), entropy and their
 * backward.
 *
 * logp[i, k] = (w_idx - m) k - log1p(R) (exactly -log1p(R) at the max);
 * H = sum_j p_j (lse - z_j), each term >= 0. A masked-out row (mask 0) is
 * not read: logp and entropy 0, gradient row 0. A non-finite row gives NaN.
 * Backward, in z units, with D_j = sum of dlogp_k over k with idx_k == j
 * and G = sum_k dlogp_k:
 *   dz_j = D_j - G p_j - dH p_j (log p_j + H),
 * and at the argmax with p_a > 1/2 dz_a = -sum_{j != a} dz_j (the row sums
 * to zero, and this form has no 1 - p_a cancellation); then dz/dx.
 */
#include "refrow.h"

static int row_masked(const lmloss_tensor *mask, int64_t i) {
  return lmloss_present(mask) && !*(const unsigned char *)ref_row_ptr(mask, i);
}

static int64_t index_at(const lmloss_tensor *t, int64_t i, int64_t k) {
  const char *p = ref_row_ptr(t, i) + (size_t)k * lmloss_dtype_size(t->dtype);
  return t->dtype == LMLOSS_I64 ? *(const int64_t *)p : (int64_t) * (const int32_t *)p;
}

/* The row statistics (LMLOSS_ROW_STATS) rounded to float, t from H. */
static void save_stats(const ref_row *st, float *out) {
  lmloss_rowstat s = lmloss_rowstat_empty();
  s.m = (float)st->m;
  s.r = (float)st->r;
  s.t = (float)((st->ent - st->l1r) * (1.0 + st->r));
  s.a = st->a;
  lmloss_rowstat_save(&s, st->finite, out);
}

lmloss_status lmloss_ref_log_probs(const lmloss_context *ctx, const lmloss_tensor *logits,
                                   const lmloss_tensor *index, const lmloss_tensor *mask,
                                   const lmloss_transform *tr, const lmloss_tensor *logp,
                                   const lmloss_tensor *entropy, const lmloss_tensor *stats) {
  int64_t N = logits->rows, V = logits->cols;
  int64_t K = lmloss_present(index) && lmloss_present(logp) ? index->cols : 0;
  ref_xf f = ref_xf_make(tr);
  double *x = ref_alloc(V), *w = ref_alloc(V);
  if (!x || !w) {
    free(x), free(w);
    return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "REF backend: out of host memory");
  }
  for (int64_t i = 0; i < N; i++) {
    char *lrow = K ? ref_row_mut(logp, i) : NULL;
    double ent = 0.0;
    if (row_masked(mask, i)) {
      for (int64_t k = 0; k < K; k++)
        ref_store(lrow, logp->dtype, k, 0.0);
      if (stats) lmloss_rowstat_save_masked((float *)ref_row_mut(stats, i));
    } else {
      ref_load_row(logits, i, x);
      ref_row st;
      ref_row_stats(&f, x, w, V, &st);
      ent = st.ent;
      if (stats) save_stats(&st, (float *)ref_row_mut(stats, i));
      for (int64_t k = 0; k < K; k++)
        ref_store(lrow, logp->dtype, k,
                  st.finite ? ref_logp(&f, &st, w[index_at(index, i, k)]) : NAN);
    }
    if (lmloss_present(entropy)) *(float *)ref_row_mut(entropy, i) = (float)ent;
  }
  free(x), free(w);
  return LMLOSS_OK;
}

lmloss_status lmloss_ref_log_probs_backward(const lmloss_context *ctx, const lmloss_tensor *logits,
                                            const lmloss_tensor *index, const lmloss_tensor *mask,
                                            const lmloss_transform *tr, const lmloss_tensor *dlogp,
                                            const lmloss_tensor *dentropy,
                                            const lmloss_tensor *dlogits,
                                            const lmloss_tensor *stats, lmloss_row_keep *keep) {
  (void)stats; /* the oracle recomputes every row in float64 */
  int64_t N = logits->rows, V = logits->cols;
  int64_t K = lmloss_present(dlogp) ? index->cols : 0;
  ref_xf f = ref_xf_make(tr);
  double *x = ref_alloc(V), *w = ref_alloc(V), *dz = ref_alloc(V), *dd = ref_alloc(V);
  if (!x || !w || !dz || !dd) {
    free(x), free(w), free(dz), free(dd);
    return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "REF backend: out of host memory");
  }
  for (int64_t j = 0; j < V; j++)
    dd[j] = 0.0;
  for (int64_t i = 0; i < N; i++) {
    char *drow = ref_row_mut(dlogits, i);
    if (row_masked(mask, i)) {
      for (int64_t j = 0; j < V; j++)
        ref_store(drow, dlogits->dtype, j, 0.0);
      continue;
    }
    ref_load_row(logits, i, x);
    ref_row st;
    ref_row_stats(&f, x, w, V, &st);
    if (!st.finite) {
      for (int64_t j = 0; j < V; j++)
        ref_store(drow, dlogits->dtype, j, NAN);
      continue;
    }
    double G = 0.0, dH = lmloss_present(dentropy) ? (double)ref_f32_at(dentropy, i) : 0.0;
    const float *gl = K ? (const float *)ref_row_ptr(dlogp, i) : NULL;
    for (int64_t k = 0; k < K; k++) {
      dd[index_at(index, i, k)] += gl[k];
      G += gl[k];
    }
    double rest = 0.0;
    for (int64_t j = 0; j < V; j++) {
      double lp = ref_logp(&f, &st, w[j]), p = exp(lp);
      dz[j] = dd[j] - (p > 0.0 ? G * p + dH * p * (lp + st.ent) : 0.0);
      if (j != st.a) rest += dz[j];
    }
    if (st.r < 1.0) dz[st.a] = -rest;
    for (int64_t j = 0; j < V; j++)
      ref_store(drow, dlogits->dtype, j, dz[j] * ref_dzdx(&f, x[j]));
    for (int64_t k = 0; k < K; k++)
      dd[index_at(index, i, k)] = 0.0;
  }
  free(x), free(w), free(dz), free(dd);
  return LMLOSS_OK;
}
