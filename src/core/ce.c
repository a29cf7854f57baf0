/* ce.c - cross-entropy entry points: validate, then dispatch. */
#include "validate.h"

/* Everything the forward and the backward share. */
static lmloss_status check_inputs(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                  const lmloss_ce_options *opt, void *ws, size_t ws_bytes,
                                  const lmloss_backend_ops **ops) {
  if (!in || !opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "inputs or options is NULL");
  TRY(lmloss_check_tensor(&in->logits, "logits", LMLOSS_FLOATS, -1, -1));
  int64_t N = in->logits.rows, V = in->logits.cols;
  if (V < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "logits: V must be >= 1");
  TRY(lmloss_check_ce_labels(&in->target, &in->token_weight, &in->class_weight, opt, N, V));
  if (!ws && N > 0) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "workspace is NULL");
  if (ws_bytes < lmloss_cross_entropy_workspace_size(N))
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, lmloss_cross_entropy_workspace_size(N));
  const lmloss_tensor *ts[] = {&in->logits, &in->target, &in->token_weight, &in->class_weight};
  TRY(lmloss_check_device(ts, 4, in->logits.device));
  TRY(lmloss_pick_backend(ctx, in->logits.device, ops));
  return lmloss_check_indices(&in->target, NULL, V, 1, opt->ignore_index, "target");
}

lmloss_status lmloss_cross_entropy(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                   const lmloss_ce_options *opt, const lmloss_ce_outputs *out,
                                   void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  TRY(check_inputs(ctx, in, opt, ws, ws_bytes, &ops));
  int64_t N = in->logits.rows, V = in->logits.cols;
  TRY(lmloss_check_ce_rows(out, N, opt->reduction));
  TRY(lmloss_check_optional(&out->dlogits, "dlogits", LMLOSS_FLOATS, N, V));
  if (lmloss_present(&out->dlogits)) TRY(lmloss_check_alias(&in->logits, &out->dlogits, "dlogits"));
  const lmloss_tensor *ts[] = {&out->loss, &out->lse, &out->entropy, &out->argmax, &out->dlogits};
  TRY(lmloss_check_device(ts, 5, in->logits.device));
  return ops->cross_entropy(ctx, in, opt, out, ws, ws_bytes, NULL);
}

lmloss_status lmloss_cross_entropy_backward(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                            const lmloss_ce_options *opt,
                                            const lmloss_tensor *dloss,
                                            const lmloss_tensor *dlogits, void *ws,
                                            size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  TRY(check_inputs(ctx, in, opt, ws, ws_bytes, &ops));
  int64_t N = in->logits.rows, V = in->logits.cols;
  TRY(lmloss_check_tensor(dloss, "dloss", LMLOSS_MASK(LMLOSS_F32),
                          opt->reduction == LMLOSS_REDUCE_NONE ? N : 1, 1));
  TRY(lmloss_check_tensor(dlogits, "dlogits", LMLOSS_FLOATS, N, V));
  TRY(lmloss_check_alias(&in->logits, dlogits, "dlogits"));
  const lmloss_tensor *ts[] = {dloss, dlogits};
  TRY(lmloss_check_device(ts, 2, in->logits.device));
  return ops->cross_entropy_backward(ctx, in, opt, dloss, dlogits, ws, ws_bytes, NULL);
}
