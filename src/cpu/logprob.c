/*
 * logprob.c - log-probs at K indices, entropy, and their backward on the
 * CPU. Rows run in parallel (a flattened [B*T, V] batch is one loop over
 * rows, never per-token calls); masked rows are not read.
 */
#include <stdlib.h>

#include "common.h"
#include "core/validate.h"
#include "rowpass.h"

lmloss_status lmloss_cpu_log_probs(const lmloss_context *ctx, const lmloss_tensor *logits,
                                   const lmloss_tensor *index, const lmloss_tensor *mask,
                                   const lmloss_transform *tr, const lmloss_tensor *logp,
                                   const lmloss_tensor *entropy, const lmloss_tensor *stats) {
  const int64_t N = logits->rows, V = logits->cols, K = index ? index->cols : 0;
  const lmloss_xform f = lmloss_xform_make(*tr);
  const int want_h = lmloss_present(entropy), nt = lmloss_cpu_row_threads(ctx, N * V);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t i = 0; i < N; i++) {
    void *lp = logp ? lmloss_cpu_row_mut(logp, i) : NULL;
    if (lmloss_cpu_masked_out(mask, i)) {
      for (int64_t k = 0; k < K; k++)
        lmloss_store(lp, logp->dtype, k, 0.0f);
      if (want_h) *lmloss_cpu_f32_at(entropy, i) = 0.0f;
      if (stats) lmloss_rowstat_save_masked(lmloss_cpu_f32_at(stats, i));
      continue;
    }
    const void *row = lmloss_cpu_row(logits, i);
    lmloss_rowstat s;
    int bad;
    lmloss_cpu_row_stats(row, logits->dtype, V, &f, NULL, want_h || stats, 0, &s, &bad);
    const int ok = !bad && lmloss_rowstat_finite(&s);
    if (stats) lmloss_rowstat_save(&s, ok, lmloss_cpu_f32_at(stats, i));
    for (int64_t k = 0; k < K; k++) {
      const int64_t j = lmloss_index_at(index, i, k);
      const float w = lmloss_xform_w(&f, lmloss_load(row, logits->dtype, j));
      lmloss_store(lp, logp->dtype, k, ok ? lmloss_rowstat_logp(&s, f.k, j, w) : NAN);
    }
    if (want_h) *lmloss_cpu_f32_at(entropy, i) = ok ? lmloss_rowstat_entropy(&s) : NAN;
  }
  return LMLOSS_OK;
}

/* dlogits_j = sum_k dlogp_k ([j == idx_k] - p_j) - dH p_j (log p_j + H),
 * with log p_j + H = dk_j + t / (1 + R) (no cancellation against lse).
 * Every entry but the indexed ones has the row-pass shape; an indexed
 * entry adds dlogp_k, and at the argmax 1 - p_a is R / (1 + R). */
lmloss_status lmloss_cpu_log_probs_backward(const lmloss_context *ctx, const lmloss_tensor *logits,
                                            const lmloss_tensor *index, const lmloss_tensor *mask,
                                            const lmloss_transform *tr, const lmloss_tensor *dlogp,
                                            const lmloss_tensor *dentropy,
                                            const lmloss_tensor *dlogits,
                                            const lmloss_tensor *stats, lmloss_grad_keep *keep) {
  const int64_t N = logits->rows, V = logits->cols, K = dlogp ? index->cols : 0;
  const lmloss_xform f = lmloss_xform_make(*tr);
  const int nt = lmloss_cpu_row_threads(ctx, N * V);
  /* Exact values of the indexed entries, K per thread, computed before the
   * row pass may overwrite the logits (in place). */
  float *fix_all = malloc(sizeof(float) * (size_t)(K > 0 ? K : 1) * (size_t)nt);
  if (!fix_all)
    return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "no host memory for %lld floats",
                       (long long)K * nt);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t i = 0; i < N; i++) {
    float *fix = fix_all + (size_t)K * (size_t)omp_get_thread_num();
    void *g = lmloss_cpu_row_mut(dlogits, i);
    if (lmloss_cpu_masked_out(mask, i)) {
      lmloss_cpu_row_fill(g, dlogits->dtype, V, 0.0f);
      continue;
    }
    const void *row = lmloss_cpu_row(logits, i);
    lmloss_rowstat s;
    int bad = 0;
    const float dh = dentropy ? *lmloss_cpu_f32_at(dentropy, i) : 0.0f;
    if (stats)
      s = lmloss_rowstat_load(lmloss_cpu_f32_at(stats, i), V);
    else
      lmloss_cpu_row_stats(row, logits->dtype, V, &f, NULL, dentropy != NULL, 0, &s, &bad);
    if (bad || !lmloss_rowstat_finite(&s)) {
      lmloss_cpu_row_fill(g, dlogits->dtype, V, NAN);
      continue;
    }
    const float *dl = dlogp ? (const float *)lmloss_cpu_row(dlogp, i) : NULL;
    float sum_dl = 0.0f;
    for (int64_t k = 0; k < K; k++)
      sum_dl += dl[k];
    const float inv = 1.0f / (1.0f + s.r);
    const float hbar = s.t * inv; /* H - log1p(R) */
    const float P = (-sum_dl - dh * hbar) * inv, P2 = -dh * inv;
    for (int64_t k = 0; k < K; k++) { /* duplicated indices add their dlogp */
      int64_t j = lmloss_index_at(index, i, k);
      float x = lmloss_load(row, logits->dtype, j);
      float dk = lmloss_rowstat_dk(&s, f.k, j, lmloss_xform_w(&f, x));
      float p = expf(dk) * inv, gz = 0.0f;
      for (int64_t k2 = 0; k2 < K; k2++)
        if (lmloss_index_at(index, i, k2) == j) gz += dl[k2];
      if (j == s.a) /* sum_k dlogp_k [j == idx_k] (1 - p_a) - rest * p_a */
        gz = gz * (s.r * inv) - (sum_dl - gz) * p;
      else
        gz -= sum_dl * p;
      gz -= dh * p * (dk + hbar);
      fix[k] = gz * lmloss_xform_dzdx(&f, x);
    }
    lmloss_cpu_row_grad(row, logits->dtype, V, &f, NULL, s.m, P, P2, 0.0f, g, dlogits->dtype);
    for (int64_t k = 0; k < K; k++)
      lmloss_store(g, dlogits->dtype, lmloss_index_at(index, i, k), fix[k]);
  }
  free(fix_all);
  return LMLOSS_OK;
}
