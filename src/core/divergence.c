/* divergence.c - divergence entry points: validate, then dispatch. */
#include <math.h>

#include "validate.h"

lmloss_div_options lmloss_div_options_default(void) {
  lmloss_div_options o;
  o.kind = LMLOSS_DIV_KL;
  o.beta = 0.5f;
  o.student = o.teacher = lmloss_transform_default();
  o.soft_weight = 1.0f;
  o.hard_weight = 0.0f;
  o.ignore_index = -100;
  o.reduction = LMLOSS_REDUCE_MEAN;
  o.num_items = 1.0;
  o.grad_output = 1.0f;
  return o;
}

lmloss_status lmloss_check_div_options(const lmloss_div_options *o) {
  if ((unsigned)o->kind > LMLOSS_DIV_TVD)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "unknown divergence kind %d", (int)o->kind);
  if (!(o->beta >= 0.0f && o->beta <= 1.0f))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "beta must be in [0, 1], got %g", (double)o->beta);
  TRY(lmloss_check_transform(&o->student));
  TRY(lmloss_check_transform(&o->teacher));
  if (!(isfinite(o->soft_weight) && o->soft_weight >= 0.0f && isfinite(o->hard_weight) &&
        o->hard_weight >= 0.0f))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "soft_weight and hard_weight must be finite, >= 0");
  return lmloss_check_reduction(o->reduction, o->num_items, o->grad_output);
}

lmloss_div_options lmloss_div_resolve(const lmloss_div_options *opt) {
  lmloss_div_options eff = *opt;
  if (opt->kind == LMLOSS_DIV_JSD && opt->beta == 0.0f) eff.kind = LMLOSS_DIV_KL;
  if (opt->kind == LMLOSS_DIV_JSD && opt->beta == 1.0f) eff.kind = LMLOSS_DIV_REVERSE_KL;
  return eff;
}

/* Everything the calls share; *eff is opt resolved. With a shard (else
 * NULL), *sh is it resolved and state must be [N, LMLOSS_DIV_STATE_COLS];
 * need_ws 0: a call without a workspace (a state or partials). */
static lmloss_status check_inputs(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                  const lmloss_div_options *opt, const lmloss_shard *shard,
                                  const lmloss_tensor *state, int need_ws, void *ws,
                                  size_t ws_bytes, lmloss_shard *sh, lmloss_div_options *eff,
                                  const lmloss_backend_ops **ops) {
  if (!in || !opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "inputs or options is NULL");
  TRY(lmloss_check_tensor(&in->student, "student", LMLOSS_FLOATS, -1, -1));
  const int64_t N = in->student.rows, V = in->student.cols;
  if (V < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "student: V must be >= 1");
  TRY(lmloss_check_tensor(&in->teacher, "teacher", LMLOSS_FLOATS, N, V));
  TRY(lmloss_check_optional(&in->label, "label", LMLOSS_INDICES, N, 1));
  TRY(lmloss_check_div_options(opt));
  if (opt->hard_weight > 0.0f && !lmloss_present(&in->label))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "hard_weight > 0 needs a label");
  int64_t vocab = V;
  if (shard) {
    TRY(lmloss_check_shard(shard, N, V, state, LMLOSS_DIV_STATE_COLS, in->student.device, sh));
    vocab = sh->vocab;
  }
  if (need_ws && !ws && N > 0) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "workspace is NULL");
  if (need_ws && ws_bytes < lmloss_cross_entropy_workspace_size(N))
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, lmloss_cross_entropy_workspace_size(N));
  const lmloss_tensor *ts[] = {&in->student, &in->teacher, &in->label};
  TRY(lmloss_check_device(ts, 3, in->student.device));
  TRY(lmloss_pick_backend(ctx, in->student.device, ops));
  TRY(lmloss_check_supports(*ops, LMLOSS_CAN_DIVERGENCE, "divergences"));
  if (shard) {
    TRY(lmloss_check_supports(*ops, LMLOSS_CAN_ROW_STATES, "row states"));
    if (!(*ops)->states->div_state)
      return lmloss_fail(LMLOSS_ERR_UNSUPPORTED,
                         "this backend has no divergences over a sharded vocabulary");
  }
  TRY(lmloss_check_indices(&in->label, NULL, vocab, 1, opt->ignore_index, "label"));
  *eff = lmloss_div_resolve(opt);
  return LMLOSS_OK;
}

/* The forward's outputs for rows V wide. */
static lmloss_status check_outputs(const lmloss_div_inputs *in, const lmloss_div_options *opt,
                                   const lmloss_div_outputs *out) {
  const int64_t N = in->student.rows, V = in->student.cols;
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_tensor(&out->loss, "loss", f32, opt->reduction == LMLOSS_REDUCE_NONE ? N : 1,
                          1));
  TRY(lmloss_check_optional(&out->divergence, "divergence", f32, N, 1));
  TRY(lmloss_check_optional(&out->ce, "ce", f32, N, 1));
  TRY(lmloss_check_optional(&out->entropy, "entropy", f32, N, 1));
  if (lmloss_present(&out->ce) && !lmloss_present(&in->label))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "a ce output needs a label");
  TRY(lmloss_check_optional(&out->dstudent, "dstudent", LMLOSS_FLOATS, N, V));
  if (lmloss_present(&out->dstudent)) {
    TRY(lmloss_check_alias(&in->student, &out->dstudent, "dstudent"));
    TRY(lmloss_check_alias(&in->teacher, &out->dstudent, "dstudent"));
  }
  const lmloss_tensor *ts[] = {&out->loss, &out->divergence, &out->ce, &out->dstudent,
                               &out->entropy};
  return lmloss_check_device(ts, 5, in->student.device);
}

/* A gradient output: the student's shape, over neither input. */
static lmloss_status check_dstudent(const lmloss_div_inputs *in, const lmloss_tensor *dstudent) {
  TRY(lmloss_check_tensor(dstudent, "dstudent", LMLOSS_FLOATS, in->student.rows, in->student.cols));
  TRY(lmloss_check_alias(&in->student, dstudent, "dstudent"));
  TRY(lmloss_check_alias(&in->teacher, dstudent, "dstudent"));
  const lmloss_tensor *ts[] = {dstudent};
  return lmloss_check_device(ts, 1, in->student.device);
}

/* Partials F64 [N, LMLOSS_DIV_PARTIAL_COLS] on the student's device. */
static lmloss_status check_partials(const lmloss_div_inputs *in, const lmloss_tensor *partials) {
  TRY(lmloss_check_tensor(partials, "partials", LMLOSS_MASK(LMLOSS_F64), in->student.rows,
                          LMLOSS_DIV_PARTIAL_COLS));
  const lmloss_tensor *ts[] = {partials};
  return lmloss_check_device(ts, 1, in->student.device);
}

/* Both calls of the gradient in two halves (partials_grad, then
 * finish_grad). Between them dstudent keeps an fp32 quantity a column
 * that the finish reads beside the student's row, except the forward
 * KL's, whole after the partials' sweep and free of either condition. */
static lmloss_status check_halves(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                  const lmloss_div_options *opt, const lmloss_shard *shard,
                                  const lmloss_tensor *state, const lmloss_tensor *partials,
                                  const lmloss_tensor *dstudent, void *ws, size_t ws_bytes,
                                  lmloss_shard *sh, lmloss_div_options *eff,
                                  const lmloss_backend_ops **ops) {
  TRY(check_inputs(ctx, in, opt, shard, state, 1, ws, ws_bytes, sh, eff, ops));
  TRY(check_partials(in, partials));
  TRY(lmloss_check_alias(state, partials, "partials"));
  TRY(check_dstudent(in, dstudent));
  if (eff->kind == LMLOSS_DIV_KL) return LMLOSS_OK;
  if (dstudent->dtype != LMLOSS_F32)
    return lmloss_fail(LMLOSS_ERR_BAD_DTYPE,
                       "dstudent of the gradient in two halves: F32 (but for the forward KL)");
  TRY(lmloss_check_disjoint(&in->student, "student", dstudent, "dstudent"));
  return lmloss_check_disjoint(&in->teacher, "teacher", dstudent, "dstudent");
}

/* The backward's dloss and dstudent. */
static lmloss_status check_backward(const lmloss_div_inputs *in, const lmloss_div_options *opt,
                                    const lmloss_tensor *dloss, const lmloss_tensor *dstudent) {
  TRY(lmloss_check_tensor(dloss, "dloss", LMLOSS_MASK(LMLOSS_F32),
                          opt->reduction == LMLOSS_REDUCE_NONE ? in->student.rows : 1, 1));
  const lmloss_tensor *ts[] = {dloss};
  TRY(lmloss_check_device(ts, 1, in->student.device));
  return check_dstudent(in, dstudent);
}

lmloss_status lmloss_divergence(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                const lmloss_div_options *opt, const lmloss_div_outputs *out,
                                void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  TRY(check_inputs(ctx, in, opt, NULL, NULL, 1, ws, ws_bytes, NULL, &eff, &ops));
  TRY(check_outputs(in, opt, out));
  return ops->divergence(ctx, in, &eff, out, NULL,
                         lmloss_present(&out->dstudent) ? &out->dstudent : NULL, ws, ws_bytes);
}

lmloss_status lmloss_divergence_backward(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                         const lmloss_div_options *opt, const lmloss_tensor *dloss,
                                         const lmloss_tensor *dstudent, void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  TRY(check_inputs(ctx, in, opt, NULL, NULL, 1, ws, ws_bytes, NULL, &eff, &ops));
  TRY(check_backward(in, opt, dloss, dstudent));
  return ops->divergence(ctx, in, &eff, NULL, dloss, dstudent, ws, ws_bytes);
}

/* ------------------------------------------------------------------ */
/* Over a sharded vocabulary                                            */
/* ------------------------------------------------------------------ */

lmloss_status lmloss_divergence_state(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                      const lmloss_div_options *opt, const lmloss_shard *shard,
                                      const lmloss_tensor *state) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  lmloss_shard sh;
  TRY(check_inputs(ctx, in, opt, shard, state, 0, NULL, 0, &sh, &eff, &ops));
  return ops->states->div_state(ctx, in, &eff, &sh, state);
}

lmloss_status lmloss_divergence_state_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                            const lmloss_tensor *b, const lmloss_div_options *opt,
                                            const lmloss_tensor *out) {
  const lmloss_backend_ops *ops;
  if (!opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "options is NULL");
  TRY(lmloss_check_div_options(opt));
  TRY(lmloss_check_state_merge(ctx, a, b, out, LMLOSS_DIV_STATE_COLS, &ops));
  TRY(lmloss_check_supports(ops, LMLOSS_CAN_DIVERGENCE, "divergences"));
  const lmloss_div_options eff = lmloss_div_resolve(opt);
  return ops->states->div_merge(ctx, a, b, &eff, out);
}

lmloss_status lmloss_divergence_partials(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                         const lmloss_div_options *opt, const lmloss_shard *shard,
                                         const lmloss_tensor *state,
                                         const lmloss_tensor *partials) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  lmloss_shard sh;
  TRY(check_inputs(ctx, in, opt, shard, state, 0, NULL, 0, &sh, &eff, &ops));
  TRY(check_partials(in, partials));
  TRY(lmloss_check_alias(state, partials, "partials"));
  return ops->states->div_partials(ctx, in, &eff, &sh, state, partials, NULL, NULL, 0);
}

lmloss_status
lmloss_divergence_partials_grad(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                const lmloss_div_options *opt, const lmloss_shard *shard,
                                const lmloss_tensor *state, const lmloss_tensor *partials,
                                const lmloss_tensor *dstudent, void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  lmloss_shard sh;
  TRY(check_halves(ctx, in, opt, shard, state, partials, dstudent, ws, ws_bytes, &sh, &eff, &ops));
  return ops->states->div_partials(ctx, in, &eff, &sh, state, partials, dstudent, ws, ws_bytes);
}

lmloss_status lmloss_divergence_finish_grad(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                            const lmloss_div_options *opt,
                                            const lmloss_shard *shard, const lmloss_tensor *state,
                                            const lmloss_tensor *partials,
                                            const lmloss_tensor *dstudent, void *ws,
                                            size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  lmloss_shard sh;
  TRY(check_halves(ctx, in, opt, shard, state, partials, dstudent, ws, ws_bytes, &sh, &eff, &ops));
  if (eff.kind == LMLOSS_DIV_KL) return LMLOSS_OK; /* the partials' sweep wrote it whole */
  return ops->states->div_finish(ctx, in, &eff, &sh, state, partials, NULL, NULL, dstudent, 1, ws,
                                 ws_bytes);
}

lmloss_status lmloss_divergence_finish(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                       const lmloss_div_options *opt, const lmloss_shard *shard,
                                       const lmloss_tensor *state, const lmloss_tensor *partials,
                                       const lmloss_div_outputs *out, void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  lmloss_shard sh;
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  TRY(check_inputs(ctx, in, opt, shard, state, 1, ws, ws_bytes, &sh, &eff, &ops));
  TRY(check_outputs(in, opt, out));
  TRY(check_partials(in, partials));
  return ops->states->div_finish(ctx, in, &eff, &sh, state, partials, out, NULL,
                                 lmloss_present(&out->dstudent) ? &out->dstudent : NULL, 0, ws,
                                 ws_bytes);
}

lmloss_status lmloss_divergence_backward_finish(
    const lmloss_context *ctx, const lmloss_div_inputs *in, const lmloss_div_options *opt,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_tensor *partials,
    const lmloss_tensor *dloss, const lmloss_tensor *dstudent, void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  lmloss_shard sh;
  TRY(check_inputs(ctx, in, opt, shard, state, 1, ws, ws_bytes, &sh, &eff, &ops));
  TRY(check_backward(in, opt, dloss, dstudent));
  if (lmloss_present(partials))
    TRY(check_partials(in, partials));
  else if (eff.kind != LMLOSS_DIV_KL)
    return lmloss_fail(LMLOSS_ERR_NULL_POINTER,
                       "partials is NULL: only the forward KL's gradient needs none");
  return ops->states->div_finish(ctx, in, &eff, &sh, state,
                                 lmloss_present(partials) ? partials : NULL, NULL, dloss, dstudent,
                                 0, ws, ws_bytes);
}
