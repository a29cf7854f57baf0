/* preference.c - the DPO family's entry points: validate, then dispatch. */
#include <math.h>

#include "math/preference.h"
#include "validate.h"

lmloss_pref_options lmloss_pref_options_default(void) {
  lmloss_pref_options o;
  for (int k = 0; k < LMLOSS_PREF_TYPES; k++)
    o.loss_weights[k] = k == LMLOSS_PREF_SIGMOID ? 1.0 : 0.0;
  o.beta = 0.1;
  o.label_smoothing = 0.0;
  o.f_divergence = LMLOSS_PREF_FDIV_REVERSE_KL;
  o.f_alpha = 0.5;
  o.discopop_tau = 0.05;
  o.simpo_gamma = 0.5;
  return o;
}

size_t lmloss_preference_workspace_size(int64_t pairs) {
  return LMLOSS_PREF_WS_HEADER + (size_t)(pairs > 0 ? pairs : 0) * 8 * sizeof(double);
}

lmloss_status lmloss_check_pref_options(const lmloss_pref_options *o) {
  for (int k = 0; k < LMLOSS_PREF_TYPES; k++)
    if (!isfinite(o->loss_weights[k]))
      return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "loss_weights[%d] is not finite", k);
  if (!(isfinite(o->beta) && o->beta > 0.0))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "beta must be finite and > 0, got %g", o->beta);
  const double e = o->label_smoothing;
  if (!(e >= 0.0 && e < 1.0))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "label_smoothing must be in [0, 1), got %g", e);
  if (o->loss_weights[LMLOSS_PREF_ROBUST] != 0.0 && !(e < 0.5))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "ROBUST needs label_smoothing < 0.5, got %g", e);
  if (o->loss_weights[LMLOSS_PREF_EXO_PAIR] != 0.0 && e == 0.0)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "EXO_PAIR needs label_smoothing > 0");
  if ((unsigned)o->f_divergence > LMLOSS_PREF_FDIV_ALPHAPO)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "unknown f_divergence %d", (int)o->f_divergence);
  if (!isfinite(o->f_alpha))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "f_alpha is not finite: %g", o->f_alpha);
  if (!isfinite(o->simpo_gamma))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "simpo_gamma is not finite: %g", o->simpo_gamma);
  if (!(isfinite(o->discopop_tau) && o->discopop_tau > 0.0))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "discopop_tau must be finite and > 0, got %g",
                       o->discopop_tau);
  return LMLOSS_OK;
}

static lmloss_status check_inputs(const lmloss_context *ctx, const lmloss_pref_inputs *in,
                                  const lmloss_pref_options *opt, void *ws, size_t ws_bytes,
                                  const lmloss_backend_ops **ops) {
  if (!in || !opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "inputs or options is NULL");
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_tensor(&in->chosen, "chosen", f32, -1, 1));
  const int64_t P = in->chosen.rows;
  if (P < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "chosen: P must be >= 1");
  TRY(lmloss_check_tensor(&in->rejected, "rejected", f32, P, 1));
  TRY(lmloss_check_optional(&in->ref_chosen, "ref_chosen", f32, P, 1));
  TRY(lmloss_check_optional(&in->ref_rejected, "ref_rejected", f32, P, 1));
  TRY(lmloss_check_optional(&in->chosen_tokens, "chosen_tokens", f32, P, 1));
  TRY(lmloss_check_optional(&in->rejected_tokens, "rejected_tokens", f32, P, 1));
  TRY(lmloss_check_optional(&in->weight, "weight", f32, P, 1));
  TRY(lmloss_check_pref_options(opt));
  const double *w = opt->loss_weights;
  if ((w[LMLOSS_PREF_IPO] != 0.0 || w[LMLOSS_PREF_SIGMOID_NORM] != 0.0) &&
      !(lmloss_present(&in->chosen_tokens) && lmloss_present(&in->rejected_tokens)))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "IPO and SIGMOID_NORM need both token counts");
  if (w[LMLOSS_PREF_SFT] != 0.0 && !lmloss_present(&in->chosen_tokens))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "SFT needs chosen_tokens");
  if ((w[LMLOSS_PREF_AOT] != 0.0 || w[LMLOSS_PREF_AOT_UNPAIRED] != 0.0) &&
      lmloss_present(&in->weight))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "AOT's sorted terms take no pair weights");
  if (!ws) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "workspace is NULL");
  if (ws_bytes < lmloss_preference_workspace_size(P))
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, lmloss_preference_workspace_size(P));
  const lmloss_tensor *ts[] = {&in->rejected,      &in->ref_chosen,      &in->ref_rejected,
                               &in->chosen_tokens, &in->rejected_tokens, &in->weight};
  TRY(lmloss_check_device(ts, 6, in->chosen.device));
  return lmloss_pick_backend(ctx, in->chosen.device, ops);
}

static lmloss_status check_grads(const lmloss_pref_inputs *in, const lmloss_tensor *dc,
                                 const lmloss_tensor *dr) {
  const int64_t P = in->chosen.rows;
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_optional(dc, "dchosen", f32, P, 1));
  TRY(lmloss_check_optional(dr, "drejected", f32, P, 1));
  if (lmloss_present(dc)) TRY(lmloss_check_alias(&in->chosen, dc, "dchosen"));
  if (lmloss_present(dr)) TRY(lmloss_check_alias(&in->rejected, dr, "drejected"));
  const lmloss_tensor *ts[] = {dc, dr};
  return lmloss_check_device(ts, 2, in->chosen.device);
}

lmloss_status lmloss_preference(const lmloss_context *ctx, const lmloss_pref_inputs *in,
                                const lmloss_pref_options *opt, const lmloss_pref_outputs *out,
                                void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  TRY(check_inputs(ctx, in, opt, ws, ws_bytes, &ops));
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_tensor(&out->loss, "loss", f32, 1, 1));
  TRY(lmloss_check_optional(&out->metrics, "metrics", f32, LMLOSS_PREF_METRICS, 1));
  TRY(check_grads(in, &out->dchosen, &out->drejected));
  TRY(lmloss_check_optional(&out->pair_loss, "pair_loss", f32, in->chosen.rows, 1));
  const lmloss_tensor *ts[] = {&out->loss, &out->metrics, &out->pair_loss};
  TRY(lmloss_check_device(ts, 3, in->chosen.device));
  return ops->preference(ctx, in, opt, out, NULL,
                         lmloss_present(&out->dchosen) ? &out->dchosen : NULL,
                         lmloss_present(&out->drejected) ? &out->drejected : NULL, ws, ws_bytes);
}

lmloss_status lmloss_preference_backward(const lmloss_context *ctx, const lmloss_pref_inputs *in,
                                         const lmloss_pref_options *opt, const lmloss_tensor *dloss,
                                         const lmloss_tensor *dchosen,
                                         const lmloss_tensor *drejected, void *ws,
                                         size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  TRY(check_inputs(ctx, in, opt, ws, ws_bytes, &ops));
  TRY(lmloss_check_tensor(dloss, "dloss", LMLOSS_MASK(LMLOSS_F32), 1, 1));
  TRY(check_grads(in, dchosen, drejected));
  if (!lmloss_present(dchosen) && !lmloss_present(drejected))
    return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "dchosen and drejected are both absent");
  const lmloss_tensor *ts[] = {dloss};
  TRY(lmloss_check_device(ts, 1, in->chosen.device));
  return ops->preference(ctx, in, opt, NULL, dloss, lmloss_present(dchosen) ? dchosen : NULL,
                         lmloss_present(drejected) ? drejected : NULL, ws, ws_bytes);
}

lmloss_kto_options lmloss_kto_options_default(void) {
  lmloss_kto_options o;
  o.loss_type = LMLOSS_KTO_KTO;
  o.beta = 0.1;
  o.desirable_weight = o.undesirable_weight = 1.0;
  return o;
}

static lmloss_status check_kto(const lmloss_context *ctx, const lmloss_kto_inputs *in,
                               const lmloss_kto_options *opt, const lmloss_backend_ops **ops) {
  if (!in || !opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "inputs or options is NULL");
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_tensor(&in->logps, "logps", f32, -1, 1));
  const int64_t N = in->logps.rows;
  if (N < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "logps: N must be >= 1");
  TRY(lmloss_check_optional(&in->ref_logps, "ref_logps", f32, N, 1));
  TRY(lmloss_check_tensor(&in->label, "label", LMLOSS_MASK(LMLOSS_BOOL), N, 1));
  TRY(lmloss_check_optional(&in->kl, "kl", f32, 1, 1));
  if ((unsigned)opt->loss_type > LMLOSS_KTO_APO_ZERO_UNPAIRED)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "unknown KTO loss_type %d", (int)opt->loss_type);
  if (!(isfinite(opt->beta) && opt->beta > 0.0))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "beta must be finite and > 0, got %g", opt->beta);
  if (!(isfinite(opt->desirable_weight) && isfinite(opt->undesirable_weight)))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "desirable_weight and undesirable_weight must be "
                                              "finite");
  const lmloss_tensor *ts[] = {&in->ref_logps, &in->label, &in->kl};
  TRY(lmloss_check_device(ts, 3, in->logps.device));
  return lmloss_pick_backend(ctx, in->logps.device, ops);
}

static lmloss_status check_kto_grad(const lmloss_kto_inputs *in, const lmloss_tensor *d) {
  TRY(lmloss_check_optional(d, "dlogps", LMLOSS_MASK(LMLOSS_F32), in->logps.rows, 1));
  if (lmloss_present(d)) TRY(lmloss_check_alias(&in->logps, d, "dlogps"));
  const lmloss_tensor *ts[] = {d};
  return lmloss_check_device(ts, 1, in->logps.device);
}

lmloss_status lmloss_kto(const lmloss_context *ctx, const lmloss_kto_inputs *in,
                         const lmloss_kto_options *opt, const lmloss_kto_outputs *out) {
  const lmloss_backend_ops *ops;
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  TRY(check_kto(ctx, in, opt, &ops));
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_tensor(&out->loss, "loss", f32, 1, 1));
  TRY(lmloss_check_optional(&out->metrics, "metrics", f32, LMLOSS_KTO_METRICS, 1));
  TRY(check_kto_grad(in, &out->dlogps));
  const lmloss_tensor *ts[] = {&out->loss, &out->metrics};
  TRY(lmloss_check_device(ts, 2, in->logps.device));
  return ops->kto(ctx, in, opt, out, NULL, lmloss_present(&out->dlogps) ? &out->dlogps : NULL);
}

lmloss_status lmloss_kto_backward(const lmloss_context *ctx, const lmloss_kto_inputs *in,
                                  const lmloss_kto_options *opt, const lmloss_tensor *dloss,
                                  const lmloss_tensor *dlogps) {
  const lmloss_backend_ops *ops;
  TRY(check_kto(ctx, in, opt, &ops));
  TRY(lmloss_check_tensor(dloss, "dloss", LMLOSS_MASK(LMLOSS_F32), 1, 1));
  TRY(lmloss_check_tensor(dlogps, "dlogps", LMLOSS_MASK(LMLOSS_F32), in->logps.rows, 1));
  TRY(check_kto_grad(in, dlogps));
  const lmloss_tensor *ts[] = {dloss};
  TRY(lmloss_check_device(ts, 1, in->logps.device));
  return ops->kto(ctx, in, opt, NULL, dloss, dlogps);
}
