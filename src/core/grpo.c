/* grpo.c - the GRPO family's entry points: validate, then dispatch; and
 * GRPO on logits, composed with the log-probs row op. */
#include <math.h>

#include "math/grpo.h"
#include "validate.h"
#include "workspace.h"

lmloss_grpo_options lmloss_grpo_options_default(void) {
  lmloss_grpo_options o;
  o.loss_type = LMLOSS_GRPO_DAPO;
  o.level = LMLOSS_GRPO_TOKEN;
  o.epsilon_low = o.epsilon_high = 0.2;
  o.delta = 0.0;
  o.beta = 0.0;
  o.bias_correction_kl = 0;
  o.sapo_temperature_pos = 1.0;
  o.sapo_temperature_neg = 1.05;
  o.vespo_k_pos = 2.0;
  o.vespo_lambda_pos = 3.0;
  o.vespo_k_neg = 3.0;
  o.vespo_lambda_neg = 2.0;
  o.off_policy_mask = 0;
  o.off_policy_threshold = 0.0;
  o.entropy_coef = 0.0;
  o.accumulation_steps = 1.0;
  o.max_completion_length = 0;
  o.num_items = 1.0;
  o.is_mode = LMLOSS_GRPO_IS_GIVEN;
  o.is_min = -INFINITY;
  o.is_max = INFINITY;
  return o;
}

size_t lmloss_grpo_workspace_size(int64_t sequences) {
  return LMLOSS_GRPO_WS_HEADER +
         (size_t)(sequences > 0 ? sequences : 0) * LMLOSS_GRPO_S_N * sizeof(double);
}

static lmloss_status bad(const char *what, double v) {
  return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "%s is out of range or NaN: %g", what, v);
}

static lmloss_status check_options(const lmloss_grpo_options *o) {
  if ((unsigned)o->loss_type > LMLOSS_GRPO_VESPO)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "unknown GRPO loss_type %d", (int)o->loss_type);
  if ((unsigned)o->level > LMLOSS_GRPO_SEQUENCE)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "unknown importance sampling level %d",
                       (int)o->level);
  if (!(isfinite(o->epsilon_low) && o->epsilon_low >= 0.0))
    return bad("epsilon_low", o->epsilon_low);
  if (!(isfinite(o->epsilon_high) && o->epsilon_high >= 0.0))
    return bad("epsilon_high", o->epsilon_high);
  if (!(isfinite(o->delta) && o->delta >= 0.0)) return bad("delta", o->delta);
  if (!(isfinite(o->beta) && o->beta >= 0.0)) return bad("beta", o->beta);
  if (!(isfinite(o->sapo_temperature_pos) && o->sapo_temperature_pos > 0.0))
    return bad("sapo_temperature_pos", o->sapo_temperature_pos);
  if (!(isfinite(o->sapo_temperature_neg) && o->sapo_temperature_neg > 0.0))
    return bad("sapo_temperature_neg", o->sapo_temperature_neg);
  const double vespo[] = {o->vespo_k_pos, o->vespo_lambda_pos, o->vespo_k_neg, o->vespo_lambda_neg};
  for (int i = 0; i < 4; i++)
    if (!isfinite(vespo[i])) return bad("a vespo_k / vespo_lambda", vespo[i]);
  if ((unsigned)o->bias_correction_kl > 1 || (unsigned)o->off_policy_mask > 1)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "bias_correction_kl and off_policy_mask are 0 or 1");
  if (!isfinite(o->off_policy_threshold))
    return bad("off_policy_threshold", o->off_policy_threshold);
  if (!isfinite(o->entropy_coef)) return bad("entropy_coef", o->entropy_coef);
  if (!(isfinite(o->accumulation_steps) && o->accumulation_steps > 0.0))
    return bad("accumulation_steps", o->accumulation_steps);
  if (o->max_completion_length < 0)
    return bad("max_completion_length", (double)o->max_completion_length);
  if (!(isfinite(o->num_items) && o->num_items > 0.0)) return bad("num_items", o->num_items);
  if ((unsigned)o->is_mode > LMLOSS_GRPO_IS_SEQUENCE_MASK)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "unknown is_mode %d", (int)o->is_mode);
  if (isnan(o->is_min) || isnan(o->is_max)) return bad("is_min or is_max", NAN);
  if (o->is_mode >= LMLOSS_GRPO_IS_SEQUENCE_TRUNCATE && o->loss_type == LMLOSS_GRPO_VESPO)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "VESPO takes token-level IS ratios (as TRL)");
  return LMLOSS_OK;
}

/* Everything the forward and the backward share. */
static lmloss_status check_inputs(const lmloss_context *ctx, const lmloss_grpo_inputs *in,
                                  const lmloss_grpo_options *opt, void *ws, size_t ws_bytes,
                                  const lmloss_backend_ops **ops) {
  if (!in || !opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "inputs or options is NULL");
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_tensor(&in->logp, "logp", f32, -1, -1));
  const int64_t B = in->logp.rows, T = in->logp.cols;
  if (B < 1 || T < 1)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "logp is [%lld, %lld]: B and T must be >= 1",
                       (long long)B, (long long)T);
  TRY(lmloss_check_tensor(&in->mask, "mask", f32, B, T));
  TRY(lmloss_check_tensor(&in->advantages, "advantages", f32, B, -1));
  if (in->advantages.cols != 1 && in->advantages.cols != T)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE,
                       "advantages must be [B, 1] or [B, T], got [%lld, %lld]", (long long)B,
                       (long long)in->advantages.cols);
  TRY(lmloss_check_optional(&in->old_logp, "old_logp", f32, B, T));
  TRY(lmloss_check_optional(&in->ref_logp, "ref_logp", f32, B, T));
  TRY(lmloss_check_optional(&in->sampling_logp, "sampling_logp", f32, B, T));
  TRY(lmloss_check_optional(&in->is_ratio, "is_ratio", f32, B, -1));
  if (lmloss_present(&in->is_ratio) && in->is_ratio.cols != 1 && in->is_ratio.cols != T)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "is_ratio must be [B, 1] or [B, T], got [%lld, %lld]",
                       (long long)B, (long long)in->is_ratio.cols);
  TRY(lmloss_check_optional(&in->entropy, "entropy", f32, B, T));
  TRY(lmloss_check_optional(&in->entropy_threshold, "entropy_threshold", f32, 1, 1));
  TRY(lmloss_check_optional(&in->num_items, "num_items", f32, 1, 1));
  TRY(check_options(opt));
  if (opt->beta > 0.0 && !lmloss_present(&in->ref_logp))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "beta > 0 needs ref_logp");
  if ((opt->entropy_coef != 0.0 || lmloss_present(&in->entropy_threshold)) &&
      !lmloss_present(&in->entropy))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION,
                       "entropy_coef != 0 and an entropy_threshold need the entropy");
  if (opt->is_mode != LMLOSS_GRPO_IS_GIVEN &&
      (lmloss_present(&in->is_ratio) || !lmloss_present(&in->sampling_logp)))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION,
                       "an is_mode forms the IS ratio from sampling_logp: give that, not is_ratio");
  if (!ws) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "workspace is NULL");
  if (ws_bytes < lmloss_grpo_workspace_size(B))
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, lmloss_grpo_workspace_size(B));
  const lmloss_tensor *ts[] = {&in->mask,     &in->advantages,        &in->old_logp,
                               &in->ref_logp, &in->sampling_logp,     &in->is_ratio,
                               &in->entropy,  &in->entropy_threshold, &in->num_items};
  TRY(lmloss_check_device(ts, 9, in->logp.device));
  return lmloss_pick_backend(ctx, in->logp.device, ops);
}

/* The gradients: optional F32 [B, T], on the device; each may alias its
 * own input exactly (dlogp logp, dentropy entropy). */
static lmloss_status check_grads(const lmloss_grpo_inputs *in, const lmloss_tensor *dlogp,
                                 const lmloss_tensor *dentropy) {
  const int64_t B = in->logp.rows, T = in->logp.cols;
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_optional(dlogp, "dlogp", f32, B, T));
  TRY(lmloss_check_optional(dentropy, "dentropy", f32, B, T));
  if (lmloss_present(dentropy) && !lmloss_present(&in->entropy))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "a dentropy output needs the entropy");
  if (lmloss_present(dlogp)) TRY(lmloss_check_alias(&in->logp, dlogp, "dlogp"));
  if (lmloss_present(dentropy)) TRY(lmloss_check_alias(&in->entropy, dentropy, "dentropy"));
  const lmloss_tensor *ts[] = {dlogp, dentropy};
  return lmloss_check_device(ts, 2, in->logp.device);
}

lmloss_status lmloss_grpo(const lmloss_context *ctx, const lmloss_grpo_inputs *in,
                          const lmloss_grpo_options *opt, const lmloss_grpo_outputs *out, void *ws,
                          size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  TRY(check_inputs(ctx, in, opt, ws, ws_bytes, &ops));
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_tensor(&out->loss, "loss", f32, 1, 1));
  TRY(lmloss_check_optional(&out->metrics, "metrics", f32, LMLOSS_GRPO_METRICS, 1));
  TRY(check_grads(in, &out->dlogp, &out->dentropy));
  const lmloss_tensor *ts[] = {&out->loss, &out->metrics};
  TRY(lmloss_check_device(ts, 2, in->logp.device));
  return ops->grpo(ctx, in, opt, out, NULL, lmloss_present(&out->dlogp) ? &out->dlogp : NULL,
                   lmloss_present(&out->dentropy) ? &out->dentropy : NULL, ws, ws_bytes);
}

lmloss_status lmloss_grpo_backward(const lmloss_context *ctx, const lmloss_grpo_inputs *in,
                                   const lmloss_grpo_options *opt, const lmloss_tensor *dloss,
                                   const lmloss_tensor *dlogp, const lmloss_tensor *dentropy,
                                   void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  TRY(check_inputs(ctx, in, opt, ws, ws_bytes, &ops));
  TRY(lmloss_check_tensor(dloss, "dloss", LMLOSS_MASK(LMLOSS_F32), 1, 1));
  TRY(check_grads(in, dlogp, dentropy));
  if (!lmloss_present(dlogp) && !lmloss_present(dentropy))
    return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "dlogp and dentropy are both absent");
  const lmloss_tensor *ts[] = {dloss};
  TRY(lmloss_check_device(ts, 1, in->logp.device));
  return ops->grpo(ctx, in, opt, NULL, dloss, lmloss_present(dlogp) ? dlogp : NULL,
                   lmloss_present(dentropy) ? dentropy : NULL, ws, ws_bytes);
}

/* The workspace of lmloss_grpo_logits: the GRPO op's; then dlogp [B, T]
 * (two passes), or the one pass's (backend.h's grpo_logits). */
size_t lmloss_grpo_logits_workspace_size(int64_t sequences, int64_t tokens) {
  const int64_t B = sequences > 0 ? sequences : 0, N = B * (tokens > 0 ? tokens : 0);
  const size_t two = lmloss_ws_up((size_t)N * 4);
  const size_t one = lmloss_grpo_pass_ce_ws(B, N) + lmloss_cross_entropy_workspace_size(N);
  return lmloss_ws_up(lmloss_grpo_workspace_size(B)) + (one > two ? one : two);
}

lmloss_status lmloss_grpo_logits(const lmloss_context *ctx, const lmloss_tensor *logits,
                                 const lmloss_tensor *index, const lmloss_transform *tr,
                                 const lmloss_grpo_inputs *in, const lmloss_grpo_options *opt,
                                 const lmloss_grpo_outputs *out, const lmloss_tensor *dlogits,
                                 void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  if (!out || !tr) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs or transform is NULL");
  TRY(check_inputs(ctx, in, opt, ws, ws_bytes, &ops));
  const int64_t B = in->logp.rows, T = in->logp.cols, N = B * T;
  if (in->logp.row_stride != T)
    return lmloss_fail(LMLOSS_ERR_BAD_STRIDE,
                       "logp: written as the logits' rows, so its row "
                       "stride must be T = %lld",
                       (long long)T);
  if (opt->entropy_coef != 0.0)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION,
                       "entropy_coef: the entropy is an input here, which no gradient flows "
                       "through (lmloss_log_probs_backward takes the bonus' dentropy)");
  TRY(lmloss_check_tensor(logits, "logits", LMLOSS_FLOATS, N, -1));
  const int64_t V = logits->cols;
  if (!lmloss_present(index)) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "index: data is NULL");
  const lmloss_tensor idx = *index;
  TRY(lmloss_check_lp_labels(&idx, NULL, tr, N, V));
  if (idx.cols != 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "index: one token a row");
  TRY(lmloss_check_tensor(&out->loss, "loss", LMLOSS_MASK(LMLOSS_F32), 1, 1));
  TRY(lmloss_check_optional(&out->metrics, "metrics", LMLOSS_MASK(LMLOSS_F32), LMLOSS_GRPO_METRICS,
                            1));
  if (lmloss_present(&out->dlogp) || lmloss_present(&out->dentropy))
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "out->dlogp and dentropy must be absent: the "
                                             "gradient goes to dlogits");
  TRY(lmloss_check_optional(dlogits, "dlogits", LMLOSS_FLOATS, N, V));
  if (lmloss_present(dlogits)) TRY(lmloss_check_alias(logits, dlogits, "dlogits"));
  const lmloss_tensor *ts[] = {logits, &idx, &out->loss, &out->metrics, dlogits};
  TRY(lmloss_check_device(ts, 5, in->logp.device));
  TRY(lmloss_check_indices(&idx, NULL, V, 0, 0, "index"));
  if (ws_bytes < lmloss_grpo_logits_workspace_size(B, T))
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, lmloss_grpo_logits_workspace_size(B, T));
  char *w = ws;
  const size_t g = lmloss_ws_up(lmloss_grpo_workspace_size(B));
  const lmloss_grpo_outputs res = {out->loss, out->metrics, {0}, {0}};
  const int grad = lmloss_present(dlogits);
  const lmloss_grpo_par par = lmloss_grpo_par_make(opt, in);
  if (grad && ops->grpo_logits && lmloss_grpo_one_pass(&par)) {
    TRY(ops->grpo_logits(ctx, logits, &idx, tr, in, opt, dlogits, w + g, ws_bytes - g));
    return ops->grpo(ctx, in, opt, &res, NULL, NULL, NULL, ws, ws_bytes);
  }
  /* two passes: the log-probs, the objective's dlogp, their backward */
  const lmloss_tensor lp = {in->logp.data, LMLOSS_F32, in->logp.device, N, 1, 1};
  TRY(ops->log_probs(ctx, logits, &idx, NULL, tr, &lp, NULL, NULL));
  if (!grad) return ops->grpo(ctx, in, opt, &res, NULL, NULL, NULL, ws, ws_bytes);
  const lmloss_tensor dlogp = {w + g, LMLOSS_F32, in->logp.device, B, T, T};
  TRY(ops->grpo(ctx, in, opt, &res, NULL, &dlogp, NULL, ws, ws_bytes));
  const lmloss_tensor dlp = {w + g, LMLOSS_F32, in->logp.device, N, 1, 1};
  return ops->log_probs_backward(ctx, logits, &idx, NULL, tr, &dlp, NULL, dlogits, NULL, NULL);
}
