/* rowstate.c - the row contract's merge: validate, dispatch. */
#include "validate.h"

lmloss_status lmloss_row_state_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                     const lmloss_tensor *b, const lmloss_transform *tr,
                                     const lmloss_tensor *out) {
  const lmloss_backend_ops *ops;
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_tensor(a, "a", f32, -1, LMLOSS_ROW_STATE_COLS));
  TRY(lmloss_check_tensor(b, "b", f32, a->rows, LMLOSS_ROW_STATE_COLS));
  TRY(lmloss_check_tensor(out, "out", f32, a->rows, LMLOSS_ROW_STATE_COLS));
  TRY(lmloss_check_transform(tr));
  TRY(lmloss_check_alias(a, out, "out"));
  TRY(lmloss_check_alias(b, out, "out"));
  const lmloss_tensor *ts[] = {b, out};
  TRY(lmloss_check_device(ts, 2, a->device));
  TRY(lmloss_pick_backend(ctx, a->device, &ops));
  TRY(lmloss_check_supports(ops, LMLOSS_CAN_ROW_STATES, "row states"));
  return ops->states->merge(ctx, a, b, tr, out);
}
