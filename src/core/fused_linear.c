/*
 * fused_linear.c - the fused linear head's entry points: each checks its
 * arguments and runs a job of its kind (linear_job.h); the chunk loop is
 * linear_loop.c's, the kinds' row ops linear_jobs.c's, the plan
 * linear_plan.c's.
 */
#include "linear_job.h"

lmloss_head_options lmloss_head_options_default(void) {
  lmloss_head_options o = {0, 1};
  return o;
}

/* Shared checks of the CE entry points; V, the vocabulary's width (the
 * head's rows, or a shard's vocabulary: targets and class weights are the
 * whole vocabulary's). */
static lmloss_status check_ce(const lmloss_head *head, const lmloss_tensor *target,
                              const lmloss_tensor *tw, const lmloss_tensor *cw,
                              const lmloss_ce_options *opt, int64_t V) {
  const int64_t N = head->hidden.rows;
  TRY(lmloss_check_ce_labels(target, tw, cw, opt, N, V));
  const lmloss_tensor *ts[] = {&head->hidden, &head->weight, &head->bias, target, tw, cw};
  TRY(lmloss_check_device(ts, 6, head->hidden.device));
  return lmloss_check_indices(target, NULL, V, 1, opt->ignore_index, "target");
}

static const lmloss_tensor *opt_tensor(const lmloss_tensor *t) {
  static const lmloss_tensor none = {0};
  return t ? t : &none;
}

/* A CE job's fields every entry point sets; each adds its outputs,
 * upstream, gradients and shard. */
static linear_job ce_job(const linear_job_table *table, const lmloss_context *ctx,
                         const lmloss_head *head, const lmloss_tensor *target,
                         const lmloss_tensor *tw, const lmloss_tensor *cw,
                         const lmloss_ce_options *opt, const lmloss_head_options *hopt) {
  const linear_job j = {.table = table,
                        .ctx = ctx,
                        .head = head,
                        .labels = target,
                        .tw = opt_tensor(tw),
                        .cw = opt_tensor(cw),
                        .opt = opt,
                        .tr = &opt->transform,
                        .hopt = hopt};
  return j;
}

/* A forward's outputs: no dlogits, the loss's rows as opt reduces. */
static lmloss_status check_ce_outputs(const lmloss_head *head, const lmloss_ce_options *opt,
                                      const lmloss_ce_outputs *out) {
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  if (wants(&out->dlogits))
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "dlogits must be absent: the fused head never "
                                             "materializes the logits");
  return lmloss_check_ce_rows(out, head->hidden.rows, opt->reduction);
}

/* A backward's gradients (at least one) and dloss. */
static lmloss_status check_ce_upstream(const lmloss_head *head, const lmloss_ce_options *opt,
                                       const lmloss_tensor *dloss, const lmloss_head_grads *g) {
  if (!has_grads(g)) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "no gradient requested");
  return lmloss_check_tensor(dloss, "dloss", LMLOSS_MASK(LMLOSS_F32),
                             opt->reduction == LMLOSS_REDUCE_NONE ? head->hidden.rows : 1, 1);
}

lmloss_status
lmloss_linear_cross_entropy(const lmloss_context *ctx, const lmloss_head *head,
                            const lmloss_tensor *target, const lmloss_tensor *token_weight,
                            const lmloss_tensor *class_weight, const lmloss_ce_options *opt,
                            const lmloss_head_options *hopt, const lmloss_ce_outputs *out,
                            const lmloss_head_grads *grads, void *ws, size_t ws_bytes) {
  TRY(lmloss_check_head(head, hopt));
  TRY(lmloss_check_head_grads(head, grads));
  TRY(check_ce_outputs(head, opt, out));
  TRY(check_ce(head, target, opt_tensor(token_weight), opt_tensor(class_weight), opt,
               head->weight.rows));
  linear_job j =
      ce_job(&lmloss_ce_forward_job, ctx, head, target, token_weight, class_weight, opt, hopt);
  j.out = out, j.grads = has_grads(grads) ? grads : NULL;
  return lmloss_linear_run(&j, ws, ws_bytes);
}

lmloss_status lmloss_linear_cross_entropy_backward(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *target,
    const lmloss_tensor *token_weight, const lmloss_tensor *class_weight,
    const lmloss_ce_options *opt, const lmloss_head_options *hopt, const lmloss_tensor *dloss,
    const lmloss_head_grads *grads, void *ws, size_t ws_bytes) {
  TRY(lmloss_check_head(head, hopt));
  TRY(lmloss_check_head_grads(head, grads));
  TRY(check_ce(head, target, opt_tensor(token_weight), opt_tensor(class_weight), opt,
               head->weight.rows));
  TRY(check_ce_upstream(head, opt, dloss, grads));
  linear_job j =
      ce_job(&lmloss_ce_backward_job, ctx, head, target, token_weight, class_weight, opt, hopt);
  j.dloss = dloss, j.grads = grads;
  return lmloss_linear_run(&j, ws, ws_bytes);
}

/* Shared checks of the sharded CE entry points (weight: the shard's rows):
 * the shard resolved into *sh, its states, F32 heads on a backend with
 * row states. */
static lmloss_status check_ce_shard(const lmloss_context *ctx, const lmloss_head *head,
                                    const lmloss_tensor *target, const lmloss_tensor *tw,
                                    const lmloss_tensor *cw, const lmloss_ce_options *opt,
                                    const lmloss_head_options *hopt, const lmloss_shard *shard,
                                    const lmloss_tensor *state, lmloss_shard *sh) {
  TRY(lmloss_check_head(head, hopt));
  TRY(lmloss_check_shard(shard, head->hidden.rows, head->weight.rows, state, LMLOSS_ROW_STATE_COLS,
                         head->hidden.device, sh));
  TRY(check_ce(head, target, opt_tensor(tw), opt_tensor(cw), opt, sh->vocab));
  /* a 16-bit head's rounded dlogits need the exact entries the one-shot
   * row op keeps (linear_loop.c); a shard's finish keeps none */
  if (head->hidden.dtype != LMLOSS_F32 || head->weight.dtype != LMLOSS_F32)
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "a sharded fused head takes F32 hidden and weight");
  const lmloss_backend_ops *ops;
  TRY(lmloss_pick_backend(ctx, head->hidden.device, &ops));
  return lmloss_check_supports(ops, LMLOSS_CAN_ROW_STATES, "row states");
}

/* The merged states a finish reads share no byte with its gradients. */
static lmloss_status state_apart(const lmloss_tensor *state, const lmloss_head_grads *g) {
  if (!g) return LMLOSS_OK;
  TRY(lmloss_check_disjoint(&g->dhidden, "dhidden", state, "state"));
  TRY(lmloss_check_disjoint(&g->dweight, "dweight", state, "state"));
  return lmloss_check_disjoint(&g->dbias, "dbias", state, "state");
}

lmloss_status lmloss_linear_cross_entropy_sharded(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *target,
    const lmloss_tensor *token_weight, const lmloss_tensor *class_weight,
    const lmloss_ce_options *opt, const lmloss_head_options *hopt, const lmloss_shard *shard,
    lmloss_exchange_fn exchange, void *user, const lmloss_tensor *state,
    const lmloss_ce_outputs *out, const lmloss_head_grads *grads, void *ws, size_t ws_bytes) {
  lmloss_shard sh;
  TRY(check_ce_shard(ctx, head, target, token_weight, class_weight, opt, hopt, shard, state, &sh));
  TRY(lmloss_check_head_grads(head, grads));
  if (!exchange) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "exchange is NULL");
  TRY(check_ce_outputs(head, opt, out));
  if (wants(&out->entropy) && !sh.entropy)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "an entropy output needs states with shard.entropy");
  const lmloss_head_grads *g = has_grads(grads) ? grads : NULL;
  TRY(state_apart(state, g));
  /* the state pass plans as the finish does: one chunk's logits stay */
  linear_job j =
      ce_job(&lmloss_ce_state_job, ctx, head, target, token_weight, class_weight, opt, hopt);
  j.shard = &sh, j.state = state, j.plan_grads = g;
  TRY(lmloss_linear_run(&j, ws, ws_bytes));
  const lmloss_status s = exchange(user, state);
  if (s != LMLOSS_OK) return lmloss_fail(s, "the exchange returned %s", lmloss_status_string(s));
  j.table = &lmloss_ce_forward_job, j.out = out, j.grads = g, j.plan_grads = NULL;
  j.logits_ready = 1;
  return lmloss_linear_run(&j, ws, ws_bytes);
}

lmloss_status lmloss_linear_cross_entropy_backward_finish(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *target,
    const lmloss_tensor *token_weight, const lmloss_tensor *class_weight,
    const lmloss_ce_options *opt, const lmloss_head_options *hopt, const lmloss_shard *shard,
    const lmloss_tensor *state, const lmloss_tensor *dloss, const lmloss_head_grads *grads,
    void *ws, size_t ws_bytes) {
  lmloss_shard sh;
  TRY(check_ce_shard(ctx, head, target, token_weight, class_weight, opt, hopt, shard, state, &sh));
  TRY(lmloss_check_head_grads(head, grads));
  TRY(check_ce_upstream(head, opt, dloss, grads));
  TRY(state_apart(state, grads));
  linear_job j =
      ce_job(&lmloss_ce_backward_job, ctx, head, target, token_weight, class_weight, opt, hopt);
  j.dloss = dloss, j.grads = grads, j.shard = &sh, j.state = state;
  return lmloss_linear_run(&j, ws, ws_bytes);
}

static lmloss_status check_lp(const lmloss_head *head, const lmloss_tensor *index,
                              const lmloss_tensor *mask, const lmloss_transform *tr) {
  const int64_t V = head->weight.rows;
  TRY(lmloss_check_lp_labels(index, mask, tr, head->hidden.rows, V));
  const lmloss_tensor *ts[] = {&head->hidden, &head->weight, &head->bias, index, mask};
  TRY(lmloss_check_device(ts, 5, head->hidden.device));
  return lmloss_check_indices(index, mask, V, 0, 0, "index");
}

lmloss_status lmloss_linear_log_probs(const lmloss_context *ctx, const lmloss_head *head,
                                      const lmloss_tensor *index, const lmloss_tensor *mask,
                                      const lmloss_transform *tr, const lmloss_head_options *hopt,
                                      const lmloss_tensor *logp, const lmloss_tensor *entropy,
                                      const lmloss_tensor *stats, void *ws, size_t ws_bytes) {
  TRY(lmloss_check_head(head, hopt));
  if (!wants(index)) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "index: data is NULL");
  if (index->cols < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "index: K must be >= 1");
  TRY(check_lp(head, index, mask, tr));
  TRY(lmloss_check_tensor(logp, "logp", LMLOSS_FLOATS, head->hidden.rows, index->cols));
  TRY(lmloss_check_optional(entropy, "entropy", LMLOSS_MASK(LMLOSS_F32), head->hidden.rows, 1));
  TRY(lmloss_check_stats(stats, head->hidden.rows, head->weight.rows, head->hidden.device));
  linear_job j = {.table = &lmloss_lp_forward_job,
                  .ctx = ctx,
                  .head = head,
                  .labels = index,
                  .mask = wants(mask) ? mask : NULL,
                  .tr = tr,
                  .hopt = hopt,
                  .logp = logp,
                  .entropy = wants(entropy) ? entropy : NULL,
                  .stats = wants(stats) ? stats : NULL};
  return lmloss_linear_run(&j, ws, ws_bytes);
}

lmloss_status lmloss_linear_log_probs_backward(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *tr, const lmloss_head_options *hopt,
    const lmloss_tensor *dlogp, const lmloss_tensor *dentropy, const lmloss_tensor *stats,
    const lmloss_head_grads *grads, void *ws, size_t ws_bytes) {
  TRY(lmloss_check_head(head, hopt));
  TRY(lmloss_check_head_grads(head, grads));
  TRY(check_lp(head, index, mask, tr));
  const int64_t N = head->hidden.rows;
  if (!has_grads(grads)) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "no gradient requested");
  TRY(lmloss_check_lp_upstream(index, dlogp, dentropy, N));
  TRY(lmloss_check_stats(stats, N, head->weight.rows, head->hidden.device));
  linear_job j = {.table = &lmloss_lp_backward_job,
                  .ctx = ctx,
                  .head = head,
                  .labels = wants(dlogp) ? index : NULL,
                  .mask = wants(mask) ? mask : NULL,
                  .tr = tr,
                  .hopt = hopt,
                  .dlogp = wants(dlogp) ? dlogp : NULL,
                  .dentropy = wants(dentropy) ? dentropy : NULL,
                  .stats = wants(stats) ? stats : NULL,
                  .grads = grads};
  return lmloss_linear_run(&j, ws, ws_bytes);
}

/* Shared checks of the kept log-probs' entry points: one index a row. */
static lmloss_status check_kept(const lmloss_head *head, const lmloss_head_options *hopt,
                                const lmloss_tensor *index, const lmloss_tensor *mask,
                                const lmloss_transform *tr) {
  TRY(lmloss_check_head(head, hopt));
  if (!wants(index)) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "index: data is NULL");
  if (index->cols != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "index: kept log-probs take K = 1");
  return check_lp(head, index, mask, tr);
}

lmloss_status lmloss_linear_log_probs_keep(const lmloss_context *ctx, const lmloss_head *head,
                                           const lmloss_tensor *index, const lmloss_tensor *mask,
                                           const lmloss_transform *tr,
                                           const lmloss_head_options *hopt,
                                           const lmloss_tensor *logp, const lmloss_tensor *entropy,
                                           void *ws, size_t ws_bytes) {
  TRY(check_kept(head, hopt, index, mask, tr));
  TRY(lmloss_check_tensor(logp, "logp", LMLOSS_MASK(LMLOSS_F32), head->hidden.rows, 1));
  TRY(lmloss_check_optional(entropy, "entropy", LMLOSS_MASK(LMLOSS_F32), head->hidden.rows, 1));
  const lmloss_tensor *outs[] = {logp, entropy};
  TRY(lmloss_check_device(outs, 2, head->hidden.device));
  linear_job j = {.table = &lmloss_lp_keep_forward_job,
                  .ctx = ctx,
                  .head = head,
                  .labels = index,
                  .mask = wants(mask) ? mask : NULL,
                  .tr = tr,
                  .hopt = hopt,
                  .logp = logp,
                  .entropy = wants(entropy) ? entropy : NULL};
  return lmloss_linear_run(&j, ws, ws_bytes);
}

lmloss_status lmloss_linear_log_probs_backward_kept(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *tr, const lmloss_head_options *hopt,
    const lmloss_tensor *dlogp, const lmloss_head_grads *grads, void *ws, size_t ws_bytes) {
  TRY(check_kept(head, hopt, index, mask, tr));
  TRY(lmloss_check_head_grads(head, grads));
  if (!has_grads(grads)) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "no gradient requested");
  if (wants(&grads->dbias))
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "dbias: the kept log-probs keep no column sums "
                                               "(lmloss_linear_log_probs_backward has them)");
  TRY(lmloss_check_tensor(dlogp, "dlogp", LMLOSS_MASK(LMLOSS_F32), head->hidden.rows, 1));
  const lmloss_tensor *ts[] = {dlogp, &grads->dhidden, &grads->dweight};
  TRY(lmloss_check_device(ts, 3, head->hidden.device));
  linear_job j = {.table = &lmloss_lp_keep_backward_job,
                  .ctx = ctx,
                  .head = head,
                  .labels = index,
                  .mask = wants(mask) ? mask : NULL,
                  .tr = tr,
                  .hopt = hopt,
                  .dlogp = dlogp,
                  .grads = grads};
  return lmloss_linear_run(&j, ws, ws_bytes);
}

/* The backend of a scale call on tensors ts (scale last). */
static lmloss_status scale_backend(const lmloss_context *ctx, const lmloss_tensor *const *ts, int n,
                                   const lmloss_backend_ops **ops) {
  TRY(lmloss_check_tensor(ts[n - 1], "scale", LMLOSS_MASK(LMLOSS_F32), 1, 1));
  TRY(lmloss_check_device(ts, n, ts[0]->device));
  TRY(lmloss_pick_backend(ctx, ts[0]->device, ops));
  return lmloss_check_supports(*ops, LMLOSS_CAN_FUSED_HEAD, "scale");
}

lmloss_status lmloss_linear_scale_grads(const lmloss_context *ctx, const lmloss_head *head,
                                        const lmloss_head_grads *grads,
                                        const lmloss_tensor *scale) {
  const lmloss_head_options hopt = lmloss_head_options_default();
  TRY(lmloss_check_head(head, &hopt));
  if (!grads) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "grads is NULL");
  TRY(lmloss_check_head_grads(head, grads));
  const lmloss_tensor *ts[] = {&head->hidden, &grads->dhidden, &grads->dweight, &grads->dbias,
                               scale};
  const lmloss_backend_ops *ops;
  TRY(scale_backend(ctx, ts, 5, &ops));
  for (int i = 1; i < 4; i++)
    if (wants(ts[i])) TRY(ops->linear->scale(ctx, ts[i], (const float *)scale->data));
  return LMLOSS_OK;
}

lmloss_status lmloss_scale(const lmloss_context *ctx, const lmloss_tensor *t,
                           const lmloss_tensor *scale) {
  if (!scale) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "scale is NULL");
  TRY(lmloss_check_tensor(t, "t", LMLOSS_FLOATS, -1, -1));
  const lmloss_tensor *ts[] = {t, scale};
  const lmloss_backend_ops *ops;
  TRY(scale_backend(ctx, ts, 2, &ops));
  return ops->linear->scale(ctx, t, (const float *)scale->data);
}
