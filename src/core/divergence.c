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

/* Everything both calls share; *eff is opt resolved. */
static lmloss_status check_inputs(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                  const lmloss_div_options *opt, void *ws, size_t ws_bytes,
                                  lmloss_div_options *eff, const lmloss_backend_ops **ops) {
  if (!in || !opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "inputs or options is NULL");
  TRY(lmloss_check_tensor(&in->student, "student", LMLOSS_FLOATS, -1, -1));
  const int64_t N = in->student.rows, V = in->student.cols;
  if (V < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "student: V must be >= 1");
  TRY(lmloss_check_tensor(&in->teacher, "teacher", LMLOSS_FLOATS, N, V));
  TRY(lmloss_check_optional(&in->label, "label", LMLOSS_INDICES, N, 1));
  TRY(lmloss_check_div_options(opt));
  if (opt->hard_weight > 0.0f && !lmloss_present(&in->label))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "hard_weight > 0 needs a label");
  if (!ws && N > 0) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "workspace is NULL");
  if (ws_bytes < lmloss_cross_entropy_workspace_size(N))
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, lmloss_cross_entropy_workspace_size(N));
  const lmloss_tensor *ts[] = {&in->student, &in->teacher, &in->label};
  TRY(lmloss_check_device(ts, 3, in->student.device));
  TRY(lmloss_pick_backend(ctx, in->student.device, ops));
  TRY(lmloss_check_supports(*ops, LMLOSS_CAN_DIVERGENCE, "divergences"));
  TRY(lmloss_check_indices(&in->label, NULL, V, 1, opt->ignore_index, "label"));
  *eff = lmloss_div_resolve(opt);
  return LMLOSS_OK;
}

lmloss_status lmloss_divergence(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                const lmloss_div_options *opt, const lmloss_div_outputs *out,
                                void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  TRY(check_inputs(ctx, in, opt, ws, ws_bytes, &eff, &ops));
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
  TRY(lmloss_check_device(ts, 5, in->student.device));
  return ops->divergence(ctx, in, &eff, out, NULL,
                         lmloss_present(&out->dstudent) ? &out->dstudent : NULL, ws, ws_bytes);
}

lmloss_status lmloss_divergence_backward(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                         const lmloss_div_options *opt, const lmloss_tensor *dloss,
                                         const lmloss_tensor *dstudent, void *ws, size_t ws_bytes) {
  const lmloss_backend_ops *ops;
  lmloss_div_options eff;
  TRY(check_inputs(ctx, in, opt, ws, ws_bytes, &eff, &ops));
  const int64_t N = in->student.rows, V = in->student.cols;
  TRY(lmloss_check_tensor(dloss, "dloss", LMLOSS_MASK(LMLOSS_F32),
                          opt->reduction == LMLOSS_REDUCE_NONE ? N : 1, 1));
  TRY(lmloss_check_tensor(dstudent, "dstudent", LMLOSS_FLOATS, N, V));
  TRY(lmloss_check_alias(&in->student, dstudent, "dstudent"));
  TRY(lmloss_check_alias(&in->teacher, dstudent, "dstudent"));
  const lmloss_tensor *ts[] = {dloss, dstudent};
  TRY(lmloss_check_device(ts, 2, in->student.device));
  return ops->divergence(ctx, in, &eff, NULL, dloss, dstudent, ws, ws_bytes);
}
