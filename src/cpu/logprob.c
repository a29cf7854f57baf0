/*
 * logprob.c - log-probs at K indices, entropy, and their backward on the
 * CPU, one shot or as the row contract's phases over a vocabulary shard.
 * Rows run in parallel (a flattened [B*T, V] batch is one loop over rows,
 * never per-token calls); masked rows are not read.
 */
#include <stdlib.h>

#include "common.h"
#include "core/validate.h"
#include "rowpass.h"

/* The state of row i's columns [sh->col0, sh->col0 + cols); the label is
 * index[i, 0] when the row has one index (a shard's finish reads its w
 * from the merged state). */
static lmloss_rowstate lp_row_state(const lmloss_tensor *logits, const lmloss_tensor *index,
                                    const lmloss_xform *f, const lmloss_shard *sh, int64_t i) {
  const int64_t label = index && index->cols == 1 ? lmloss_index_at(index, i, 0) : -1;
  return lmloss_cpu_row_state(lmloss_cpu_row(logits, i), logits->dtype, logits->cols, sh->col0, f,
                              NULL, sh->entropy, 0, label);
}

/* Row i's whole-row state: merged by the caller, saved by the forward
 * (stats), or formed here. */
static lmloss_rowstate lp_whole_state(const lmloss_tensor *logits, const lmloss_tensor *index,
                                      const lmloss_xform *f, const lmloss_shard *sh,
                                      const lmloss_tensor *merged, const lmloss_tensor *stats,
                                      int64_t i) {
  if (merged) return lmloss_rowstate_unpack(lmloss_cpu_row(merged, i), sh->vocab);
  if (!stats) return lp_row_state(logits, index, f, sh, i);
  lmloss_rowstate st = lmloss_rowstate_empty();
  st.s = lmloss_rowstat_load(lmloss_cpu_f32_at(stats, i), sh->vocab);
  st.flags = LMLOSS_STATE_LOGIT; /* saved finite, else loaded empty */
  return st;
}

/* w at column j of the vocabulary: from the row when the shard holds it,
 * else the label's, from the merged state (NaN when no part held it). */
static float lp_w(const void *row, lmloss_dtype dt, const lmloss_xform *f, const lmloss_shard *sh,
                  int64_t n, const lmloss_rowstate *st, int64_t j) {
  const int64_t jl = j - sh->col0;
  if (jl >= 0 && jl < n) return lmloss_xform_w(f, lmloss_load(row, dt, jl));
  return st->flags & LMLOSS_STATE_LABEL ? st->wy : NAN;
}

static lmloss_status lp_forward(const lmloss_context *ctx, const lmloss_tensor *logits,
                                const lmloss_tensor *index, const lmloss_tensor *mask,
                                const lmloss_transform *tr, const lmloss_shard *sh,
                                const lmloss_tensor *merged, const lmloss_tensor *logp,
                                const lmloss_tensor *entropy, const lmloss_tensor *stats) {
  const int64_t N = logits->rows, n = logits->cols, K = index ? index->cols : 0;
  const lmloss_xform f = lmloss_xform_make(*tr);
  const int want_h = lmloss_present(entropy), nt = lmloss_cpu_row_threads(ctx, N * n);
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
    const lmloss_rowstate st = lp_whole_state(logits, index, &f, sh, merged, NULL, i);
    const int ok = lmloss_rowstate_ok(&st);
    if (stats) lmloss_rowstat_save(&st.s, ok, lmloss_cpu_f32_at(stats, i));
    for (int64_t k = 0; k < K; k++) {
      const int64_t j = lmloss_index_at(index, i, k);
      const float w = lp_w(row, logits->dtype, &f, sh, n, &st, j);
      lmloss_store(lp, logp->dtype, k, ok ? lmloss_rowstat_logp(&st.s, f.k, j, w) : NAN);
    }
    if (want_h) *lmloss_cpu_f32_at(entropy, i) = ok ? lmloss_rowstat_entropy(&st.s) : NAN;
  }
  return LMLOSS_OK;
}

/* dlogits_j = sum_k dlogp_k ([j == idx_k] - p_j) - dH p_j (log p_j + H),
 * with log p_j + H = dk_j + t / (1 + R) (no cancellation against lse).
 * Every entry but the indexed ones has the row-pass shape; the indexed
 * ones are lmloss_lp_entry_z's. Over a shard, the indexed entries in its
 * columns. */
static lmloss_status lp_backward(const lmloss_context *ctx, const lmloss_tensor *logits,
                                 const lmloss_tensor *index, const lmloss_tensor *mask,
                                 const lmloss_transform *tr, const lmloss_shard *sh,
                                 const lmloss_tensor *merged, const lmloss_tensor *dlogp,
                                 const lmloss_tensor *dentropy, const lmloss_tensor *dlogits,
                                 const lmloss_tensor *stats) {
  const int64_t N = logits->rows, n = logits->cols, K = dlogp ? index->cols : 0;
  const lmloss_xform f = lmloss_xform_make(*tr);
  const int nt = lmloss_cpu_row_threads(ctx, N * n);
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
      lmloss_cpu_row_fill(g, dlogits->dtype, n, 0.0f);
      continue;
    }
    const void *row = lmloss_cpu_row(logits, i);
    const float dh = dentropy ? *lmloss_cpu_f32_at(dentropy, i) : 0.0f;
    const lmloss_rowstate st = lp_whole_state(logits, index, &f, sh, merged, stats, i);
    if (!lmloss_rowstate_ok(&st)) {
      lmloss_cpu_row_fill(g, dlogits->dtype, n, NAN);
      continue;
    }
    const lmloss_rowstat s = st.s;
    const float *dl = dlogp ? (const float *)lmloss_cpu_row(dlogp, i) : NULL;
    float sum_dl = 0.0f;
    for (int64_t k = 0; k < K; k++)
      sum_dl += dl[k];
    const float inv = 1.0f / (1.0f + s.r);
    const float hbar = s.t * inv; /* H - log1p(R) */
    const float P = (-sum_dl - dh * hbar) * inv, P2 = -dh * inv;
    for (int64_t k = 0; k < K; k++) { /* duplicated indices add their dlogp */
      const int64_t j = lmloss_index_at(index, i, k), jl = j - sh->col0;
      if (jl < 0 || jl >= n) continue;
      float x = lmloss_load(row, logits->dtype, jl);
      float dk = lmloss_rowstat_dk(&s, f.k, j, lmloss_xform_w(&f, x));
      float dj = 0.0f, rest = 0.0f;
      for (int64_t k2 = 0; k2 < K; k2++) {
        if (lmloss_index_at(index, i, k2) == j)
          dj += dl[k2];
        else
          rest += dl[k2];
      }
      const float gz = lmloss_lp_entry_z(&s, expf(dk) * inv, dk, hbar, dj, rest, dh, j == s.a);
      fix[k] = gz * lmloss_xform_dzdx(&f, x);
    }
    lmloss_cpu_row_grad(row, logits->dtype, n, &f, NULL, s.m, P, P2, 0.0f, g, dlogits->dtype);
    for (int64_t k = 0; k < K; k++) {
      const int64_t jl = lmloss_index_at(index, i, k) - sh->col0;
      if (jl >= 0 && jl < n) lmloss_store(g, dlogits->dtype, jl, fix[k]);
    }
  }
  free(fix_all);
  return LMLOSS_OK;
}

lmloss_status lmloss_cpu_log_probs(const lmloss_context *ctx, const lmloss_tensor *logits,
                                   const lmloss_tensor *index, const lmloss_tensor *mask,
                                   const lmloss_transform *tr, const lmloss_tensor *logp,
                                   const lmloss_tensor *entropy, const lmloss_tensor *stats) {
  const lmloss_shard sh = lmloss_cpu_whole_row(logits->cols, lmloss_present(entropy) || stats);
  return lp_forward(ctx, logits, index, mask, tr, &sh, NULL, logp, entropy, stats);
}

lmloss_status lmloss_cpu_log_probs_backward(const lmloss_context *ctx, const lmloss_tensor *logits,
                                            const lmloss_tensor *index, const lmloss_tensor *mask,
                                            const lmloss_transform *tr, const lmloss_tensor *dlogp,
                                            const lmloss_tensor *dentropy,
                                            const lmloss_tensor *dlogits,
                                            const lmloss_tensor *stats, lmloss_row_keep *keep) {
  const lmloss_shard sh = lmloss_cpu_whole_row(logits->cols, dentropy != NULL);
  return lp_backward(ctx, logits, index, mask, tr, &sh, NULL, dlogp, dentropy, dlogits, stats);
}

lmloss_status lmloss_cpu_lp_state(const lmloss_context *ctx, const lmloss_tensor *logits,
                                  const lmloss_tensor *index, const lmloss_tensor *mask,
                                  const lmloss_transform *tr, const lmloss_shard *sh,
                                  const lmloss_tensor *state) {
  const int64_t N = logits->rows;
  const lmloss_xform f = lmloss_xform_make(*tr);
  const int nt = lmloss_cpu_row_threads(ctx, N * logits->cols);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t i = 0; i < N; i++) {
    const lmloss_rowstate st = lmloss_cpu_masked_out(mask, i)
                                   ? lmloss_rowstate_empty()
                                   : lp_row_state(logits, index, &f, sh, i);
    lmloss_rowstate_pack(&st, lmloss_cpu_row_mut(state, i));
  }
  return LMLOSS_OK;
}

lmloss_status lmloss_cpu_lp_finish(const lmloss_context *ctx, const lmloss_tensor *logits,
                                   const lmloss_tensor *index, const lmloss_tensor *mask,
                                   const lmloss_transform *tr, const lmloss_shard *sh,
                                   const lmloss_tensor *state, const lmloss_tensor *logp,
                                   const lmloss_tensor *entropy, const lmloss_tensor *dlogp,
                                   const lmloss_tensor *dentropy, const lmloss_tensor *dlogits,
                                   lmloss_row_keep *keep) {
  if (dlogits && state->cols == LMLOSS_ROW_STATS) /* saved statistics (backend.h) */
    return lp_backward(ctx, logits, index, mask, tr, sh, NULL, dlogp, dentropy, dlogits, state);
  if (dlogits)
    return lp_backward(ctx, logits, index, mask, tr, sh, state, dlogp, dentropy, dlogits, NULL);
  return lp_forward(ctx, logits, logp ? index : NULL, mask, tr, sh, state, logp, entropy, NULL);
}
