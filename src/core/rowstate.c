/* rowstate.c - the row contract's merge: validate, dispatch. */
#include "validate.h"

lmloss_status lmloss_row_state_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                     const lmloss_tensor *b, const lmloss_transform *tr,
                                     const lmloss_tensor *out) {
  const lmloss_backend_ops *ops;
  TRY(lmloss_check_transform(tr));
  TRY(lmloss_check_state_merge(ctx, a, b, out, LMLOSS_ROW_STATE_COLS, &ops));
  return ops->states->merge(ctx, a, b, tr, out);
}
