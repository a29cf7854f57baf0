/* logprob.c - log-probs, entropy and their backward, one shot or over a
 * vocabulary shard: validate, dispatch. */
#include "validate.h"

static lmloss_status check_logits(const lmloss_tensor *logits) {
  TRY(lmloss_check_tensor(logits, "logits", LMLOSS_FLOATS, -1, -1));
  if (logits->cols < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "logits: V must be >= 1");
  return LMLOSS_OK;
}

/* Checks every call shares, after the logits', for a vocabulary V wide
 * (the logits' cols, or a shard's vocabulary); K = index cols (0 when
 * absent). */
static lmloss_status check_labels(const lmloss_context *ctx, const lmloss_tensor *logits,
                                  const lmloss_tensor *index, const lmloss_tensor *mask,
                                  const lmloss_transform *tr, int64_t V,
                                  const lmloss_backend_ops **ops) {
  TRY(lmloss_check_lp_labels(index, mask, tr, logits->rows, V));
  const lmloss_tensor *ts[] = {logits, index, mask};
  TRY(lmloss_check_device(ts, 3, logits->device));
  TRY(lmloss_pick_backend(ctx, logits->device, ops));
  TRY(lmloss_check_indices(index, mask, V, 0, 0, "index"));
  return LMLOSS_OK;
}

static lmloss_status check_common(const lmloss_context *ctx, const lmloss_tensor *logits,
                                  const lmloss_tensor *index, const lmloss_tensor *mask,
                                  const lmloss_transform *tr, const lmloss_backend_ops **ops) {
  TRY(check_logits(logits));
  return check_labels(ctx, logits, index, mask, tr, logits->cols, ops);
}

lmloss_status lmloss_log_probs(const lmloss_context *ctx, const lmloss_tensor *logits,
                               const lmloss_tensor *index, const lmloss_tensor *mask,
                               const lmloss_transform *tr, const lmloss_tensor *logp,
                               const lmloss_tensor *entropy, const lmloss_tensor *stats) {
  const lmloss_backend_ops *ops;
  if (!lmloss_present(index)) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "index: data is NULL");
  if (index->cols < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "index: K must be >= 1");
  TRY(check_common(ctx, logits, index, mask, tr, &ops));
  TRY(lmloss_check_tensor(logp, "logp", LMLOSS_FLOATS, logits->rows, index->cols));
  TRY(lmloss_check_optional(entropy, "entropy", LMLOSS_MASK(LMLOSS_F32), logits->rows, 1));
  const lmloss_tensor *ts[] = {logp, entropy};
  TRY(lmloss_check_device(ts, 2, logits->device));
  TRY(lmloss_check_stats(stats, logits->rows, logits->cols, logits->device));
  return ops->log_probs(ctx, logits, index, mask, tr, logp, entropy,
                        lmloss_present(stats) ? stats : NULL);
}

lmloss_status lmloss_entropy(const lmloss_context *ctx, const lmloss_tensor *logits,
                             const lmloss_transform *tr, const lmloss_tensor *entropy) {
  const lmloss_backend_ops *ops;
  TRY(check_common(ctx, logits, NULL, NULL, tr, &ops));
  TRY(lmloss_check_tensor(entropy, "entropy", LMLOSS_MASK(LMLOSS_F32), logits->rows, 1));
  const lmloss_tensor *ts[] = {entropy};
  TRY(lmloss_check_device(ts, 1, logits->device));
  return ops->log_probs(ctx, logits, NULL, NULL, tr, NULL, entropy, NULL);
}

lmloss_status lmloss_log_probs_backward(const lmloss_context *ctx, const lmloss_tensor *logits,
                                        const lmloss_tensor *index, const lmloss_tensor *mask,
                                        const lmloss_transform *tr, const lmloss_tensor *dlogp,
                                        const lmloss_tensor *dentropy, const lmloss_tensor *dlogits,
                                        const lmloss_tensor *stats) {
  const lmloss_backend_ops *ops;
  TRY(check_common(ctx, logits, index, mask, tr, &ops));
  int64_t N = logits->rows;
  TRY(lmloss_check_lp_upstream(index, dlogp, dentropy, N));
  TRY(lmloss_check_tensor(dlogits, "dlogits", LMLOSS_FLOATS, N, logits->cols));
  TRY(lmloss_check_alias(logits, dlogits, "dlogits"));
  const lmloss_tensor *ts[] = {dlogp, dentropy, dlogits};
  TRY(lmloss_check_device(ts, 3, logits->device));
  TRY(lmloss_check_stats(stats, logits->rows, logits->cols, logits->device));
  const lmloss_tensor *idx = lmloss_present(dlogp) ? index : NULL;
  return ops->log_probs_backward(ctx, logits, idx, mask, tr, lmloss_present(dlogp) ? dlogp : NULL,
                                 lmloss_present(dentropy) ? dentropy : NULL, dlogits,
                                 lmloss_present(stats) ? stats : NULL, NULL);
}

/* A shard's call: logits, shard and states, then labels (index: one a
 * row, the label the states carry). */
static lmloss_status check_shard_call(const lmloss_context *ctx, const lmloss_tensor *logits,
                                      const lmloss_tensor *index, const lmloss_tensor *mask,
                                      const lmloss_transform *tr, const lmloss_shard *shard,
                                      const lmloss_tensor *state, lmloss_shard *sh,
                                      const lmloss_backend_ops **ops) {
  TRY(check_logits(logits));
  TRY(lmloss_check_shard(shard, logits->rows, logits->cols, state, LMLOSS_ROW_STATE_COLS,
                         logits->device, sh));
  if (lmloss_present(index) && index->cols != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE,
                       "index: a shard's log-probs take one index a row, got K = %lld",
                       (long long)index->cols);
  TRY(check_labels(ctx, logits, index, mask, tr, sh->vocab, ops));
  return lmloss_check_supports(*ops, LMLOSS_CAN_ROW_STATES, "row states");
}

lmloss_status lmloss_log_probs_state(const lmloss_context *ctx, const lmloss_tensor *logits,
                                     const lmloss_tensor *index, const lmloss_tensor *mask,
                                     const lmloss_transform *tr, const lmloss_shard *shard,
                                     const lmloss_tensor *state) {
  const lmloss_backend_ops *ops;
  lmloss_shard sh;
  TRY(check_shard_call(ctx, logits, index, mask, tr, shard, state, &sh, &ops));
  return ops->states->lp_state(ctx, logits, lmloss_present(index) ? index : NULL, mask, tr, &sh,
                               state);
}

lmloss_status lmloss_log_probs_finish(const lmloss_context *ctx, const lmloss_tensor *logits,
                                      const lmloss_tensor *index, const lmloss_tensor *mask,
                                      const lmloss_transform *tr, const lmloss_shard *shard,
                                      const lmloss_tensor *state, const lmloss_tensor *logp,
                                      const lmloss_tensor *entropy) {
  const lmloss_backend_ops *ops;
  lmloss_shard sh;
  TRY(check_shard_call(ctx, logits, index, mask, tr, shard, state, &sh, &ops));
  const int64_t N = logits->rows;
  if (!lmloss_present(logp) && !lmloss_present(entropy))
    return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "logp and entropy are both absent");
  if (lmloss_present(logp)) {
    if (!lmloss_present(index))
      return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "logp given without index");
    TRY(lmloss_check_tensor(logp, "logp", LMLOSS_FLOATS, N, 1));
  }
  TRY(lmloss_check_optional(entropy, "entropy", LMLOSS_MASK(LMLOSS_F32), N, 1));
  if (lmloss_present(entropy) && !sh.entropy)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "an entropy output needs states with shard.entropy");
  const lmloss_tensor *ts[] = {logp, entropy};
  TRY(lmloss_check_device(ts, 2, logits->device));
  return ops->states->lp_finish(ctx, logits, index, mask, tr, &sh, state,
                                lmloss_present(logp) ? logp : NULL,
                                lmloss_present(entropy) ? entropy : NULL, NULL, NULL, NULL, NULL);
}

lmloss_status
lmloss_log_probs_backward_finish(const lmloss_context *ctx, const lmloss_tensor *logits,
                                 const lmloss_tensor *index, const lmloss_tensor *mask,
                                 const lmloss_transform *tr, const lmloss_shard *shard,
                                 const lmloss_tensor *state, const lmloss_tensor *dlogp,
                                 const lmloss_tensor *dentropy, const lmloss_tensor *dlogits) {
  const lmloss_backend_ops *ops;
  lmloss_shard sh;
  TRY(check_shard_call(ctx, logits, index, mask, tr, shard, state, &sh, &ops));
  const int64_t N = logits->rows;
  TRY(lmloss_check_lp_upstream(index, dlogp, dentropy, N));
  if (lmloss_present(dentropy) && !sh.entropy)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION,
                       "an entropy gradient needs states with shard.entropy");
  TRY(lmloss_check_tensor(dlogits, "dlogits", LMLOSS_FLOATS, N, logits->cols));
  TRY(lmloss_check_alias(logits, dlogits, "dlogits"));
  const lmloss_tensor *ts[] = {dlogp, dentropy, dlogits};
  TRY(lmloss_check_device(ts, 3, logits->device));
  const lmloss_tensor *idx = lmloss_present(dlogp) ? index : NULL;
  return ops->states->lp_finish(ctx, logits, idx, mask, tr, &sh, state, NULL, NULL,
                                lmloss_present(dlogp) ? dlogp : NULL,
                                lmloss_present(dentropy) ? dentropy : NULL, dlogits, NULL);
}
