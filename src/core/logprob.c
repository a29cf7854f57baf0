/* logprob.c - log-probs, entropy and their backward: validate, dispatch. */
#include "validate.h"

/* Checks shared by forward and backward; K = index cols (0 when absent). */
static lmloss_status check_common(const lmloss_context *ctx, const lmloss_tensor *logits,
                                  const lmloss_tensor *index, const lmloss_tensor *mask,
                                  const lmloss_transform *tr, const lmloss_backend_ops **ops) {
  TRY(lmloss_check_tensor(logits, "logits", LMLOSS_FLOATS, -1, -1));
  int64_t N = logits->rows, V = logits->cols;
  if (V < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "logits: V must be >= 1");
  TRY(lmloss_check_lp_labels(index, mask, tr, N, V));
  const lmloss_tensor *ts[] = {logits, index, mask};
  TRY(lmloss_check_device(ts, 3, logits->device));
  TRY(lmloss_pick_backend(ctx, logits->device, ops));
  if (lmloss_present(index)) TRY(lmloss_check_indices(index, mask, V, 0, 0, "index"));
  return LMLOSS_OK;
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
