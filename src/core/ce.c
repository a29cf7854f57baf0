/* ce.c - cross-entropy entry points: validate, then dispatch. */
#include "validate.h"

static lmloss_status check_logits(const lmloss_ce_inputs *in, const lmloss_ce_options *opt) {
  if (!in || !opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "inputs or options is NULL");
  TRY(lmloss_check_tensor(&in->logits, "logits", LMLOSS_FLOATS, -1, -1));
  if (in->logits.cols < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "logits: V must be >= 1");
  return LMLOSS_OK;
}

/* ws NULL with need_ws 0: a call without a workspace (the states). */
static lmloss_status check_workspace(int64_t N, int need_ws, void *ws, size_t ws_bytes) {
  if (!need_ws) return LMLOSS_OK;
  if (!ws && N > 0) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "workspace is NULL");
  if (ws_bytes < lmloss_cross_entropy_workspace_size(N))
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, lmloss_cross_entropy_workspace_size(N));
  return LMLOSS_OK;
}

/* Everything every cross-entropy call shares; V is the vocabulary's width
 * (the logits' cols, or a shard's vocabulary): class weights and targets
 * are the whole vocabulary's. */
static lmloss_status check_inputs(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                  const lmloss_ce_options *opt, int64_t V, int need_ws, void *ws,
                                  size_t ws_bytes, const lmloss_backend_ops **ops) {
  const int64_t N = in->logits.rows;
  TRY(lmloss_check_ce_labels(&in->target, &in->token_weight, &in->class_weight, opt, N, V));
  TRY(check_workspace(N, need_ws, ws, ws_bytes));
  const lmloss_tensor *ts[] = {&in->logits, &in->target, &in->token_weight, &in->class_weight};
  TRY(lmloss_check_device(ts, 4, in->logits.device));
  TRY(lmloss_pick_backend(ctx, in->logits.device, ops));
  return lmloss_check_indices(&in->target, NULL, V, 1, opt->ignore_index, "target");
}

/* The forward's outputs over logits [N, V]. */
static lmloss_status check_outputs(const lmloss_ce_inputs *in, const lmloss_ce_options *opt,
                                   const lmloss_ce_outputs *out) {
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  int64_t N = in->logits.rows, V = in->logits.cols;
  TRY(lmloss_check_ce_rows(out, N, opt->reduction));
  TRY(lmloss_check_optional(&out->dlogits, "dlogits", LMLOSS_FLOATS, N, V));
  if (lmloss_present(&out->dlogits)) TRY(lmloss_check_alias(&in->logits, &out->dlogits, "dlogits"));
  const lmloss_tensor *ts[] = {&out->loss, &out->lse, &out->entropy, &out->argmax, &out->dlogits};
  return lmloss_check_device(ts, 5, in->logits.device);
}

/* The backward's dloss and dlogits over logits [N, V]. */
static lmloss_status check_backward(const lmloss_ce_inputs *in, const lmloss_ce_options *opt,
                                    const lmloss_tensor *dloss, const lmloss_tensor *dlogits) {
  int64_t N = in->logits.rows, V = in->logits.cols;
  TRY(lmloss_check_tensor(dloss, "dloss", LMLOSS_MASK(LMLOSS_F32),
                          opt->reduction == LMLOSS_REDUCE_NONE ? N : 1, 1));
  TRY(lmloss_check_tensor(dlogits, "dlogits", LMLOSS_FLOATS, N, V));
  TRY(lmloss_check_alias(&in->logits, dlogits, "dlogits"));
  const lmloss_tensor *ts[] = {dloss, dlogits};
  return lmloss_check_device(ts, 2, in->logits.device);
}

lmloss_status lmloss_cross_entropy(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                   const lmloss_ce_options *opt, const lmloss_ce_outputs *out,
                                   void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  TRY(check_logits(in, opt));
  TRY(check_inputs(ctx, in, opt, in->logits.cols, 1, ws, ws_bytes, &ops));
  TRY(check_outputs(in, opt, out));
  return ops->cross_entropy(ctx, in, opt, out, ws, ws_bytes, NULL);
}

lmloss_status lmloss_cross_entropy_backward(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                            const lmloss_ce_options *opt,
                                            const lmloss_tensor *dloss,
                                            const lmloss_tensor *dlogits, void *ws,
                                            size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  TRY(check_logits(in, opt));
  TRY(check_inputs(ctx, in, opt, in->logits.cols, 1, ws, ws_bytes, &ops));
  TRY(check_backward(in, opt, dloss, dlogits));
  return ops->cross_entropy_backward(ctx, in, opt, dloss, dlogits, ws, ws_bytes, NULL);
}

/* A shard's call: its inputs, shard and states. */
static lmloss_status check_shard_call(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                      const lmloss_ce_options *opt, const lmloss_shard *shard,
                                      const lmloss_tensor *state, int need_ws, void *ws,
                                      size_t ws_bytes, lmloss_shard *sh,
                                      const lmloss_backend_ops **ops) {
  TRY(check_logits(in, opt));
  TRY(lmloss_check_shard(shard, in->logits.rows, in->logits.cols, state, LMLOSS_ROW_STATE_COLS,
                         in->logits.device, sh));
  TRY(check_inputs(ctx, in, opt, sh->vocab, need_ws, ws, ws_bytes, ops));
  return lmloss_check_supports(*ops, LMLOSS_CAN_ROW_STATES, "row states");
}

lmloss_status lmloss_cross_entropy_state(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                         const lmloss_ce_options *opt, const lmloss_shard *shard,
                                         const lmloss_tensor *state) {
  const lmloss_backend_ops *ops;
  lmloss_shard sh;
  TRY(check_shard_call(ctx, in, opt, shard, state, 0, NULL, 0, &sh, &ops));
  return ops->states->ce_state(ctx, in, opt, &sh, state);
}

lmloss_status lmloss_cross_entropy_finish(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                          const lmloss_ce_options *opt, const lmloss_shard *shard,
                                          const lmloss_tensor *state, const lmloss_ce_outputs *out,
                                          void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_shard sh;
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  TRY(check_shard_call(ctx, in, opt, shard, state, 1, ws, ws_bytes, &sh, &ops));
  TRY(check_outputs(in, opt, out));
  if (lmloss_present(&out->entropy) && !sh.entropy)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "an entropy output needs states with shard.entropy");
  return ops->states->ce_finish(ctx, in, opt, &sh, state, out, NULL,
                                lmloss_present(&out->dlogits) ? &out->dlogits : NULL, ws, ws_bytes);
}

lmloss_status
lmloss_cross_entropy_backward_finish(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                     const lmloss_ce_options *opt, const lmloss_shard *shard,
                                     const lmloss_tensor *state, const lmloss_tensor *dloss,
                                     const lmloss_tensor *dlogits, void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_shard sh;
  TRY(check_shard_call(ctx, in, opt, shard, state, 1, ws, ws_bytes, &sh, &ops));
  TRY(check_backward(in, opt, dloss, dlogits));
  return ops->states->ce_finish(ctx, in, opt, &sh, state, NULL, dloss, dlogits, ws, ws_bytes);
}
