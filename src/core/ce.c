/* ce.c - cross-entropy entry points: validate, then dispatch. */
#include <math.h>

#include "validate.h"

lmloss_status lmloss_check_ce_options(const lmloss_ce_options *o) {
  TRY(lmloss_check_transform(&o->transform));
  if (!(o->label_smoothing >= 0.0f && o->label_smoothing <= 1.0f))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "label_smoothing must be in [0, 1], got %g",
                       (double)o->label_smoothing);
  if (!(isfinite(o->z_loss) && o->z_loss >= 0.0f))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "z_loss must be finite and >= 0, got %g",
                       (double)o->z_loss);
  if ((unsigned)o->reduction > LMLOSS_REDUCE_SUM_OVER_ITEMS)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "unknown reduction %d", (int)o->reduction);
  if (o->reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS && !(isfinite(o->num_items) && o->num_items > 0))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "num_items must be finite and > 0, got %g",
                       o->num_items);
  if (o->dft != 0 && o->dft != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "dft must be 0 or 1, got %d", o->dft);
  if (!isfinite(o->grad_output))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "grad_output must be finite");
  if (o->zero_ignored_rows != 0 && o->zero_ignored_rows != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "zero_ignored_rows must be 0 or 1");
  return LMLOSS_OK;
}

lmloss_status lmloss_check_ce_rows(const lmloss_ce_outputs *out, int64_t N, lmloss_reduction r) {
  TRY(lmloss_check_tensor(&out->loss, "loss", LMLOSS_MASK(LMLOSS_F32),
                          r == LMLOSS_REDUCE_NONE ? N : 1, 1));
  TRY(lmloss_check_optional(&out->lse, "lse", LMLOSS_MASK(LMLOSS_F32), N, 1));
  TRY(lmloss_check_optional(&out->entropy, "entropy", LMLOSS_MASK(LMLOSS_F32), N, 1));
  return lmloss_check_optional(&out->argmax, "argmax", LMLOSS_MASK(LMLOSS_I64), N, 1);
}

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
  return ops->cross_entropy(ctx, in, opt, out, ws, ws_bytes);
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
  return ops->cross_entropy_backward(ctx, in, opt, dloss, dlogits, ws, ws_bytes);
}
