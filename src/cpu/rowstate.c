/* rowstate.c - the row contract's merge on the CPU. */
#include "common.h"

lmloss_status lmloss_cpu_state_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                     const lmloss_tensor *b, const lmloss_transform *tr,
                                     const lmloss_tensor *out) {
  const float k = lmloss_xform_make(*tr).k;
  /* Merging is a few flops a row: threads would cost more than they save. */
  for (int64_t i = 0; i < a->rows; i++) {
    const lmloss_rowstate x = lmloss_rowstate_unpack(lmloss_cpu_row(a, i), LMLOSS_STATE_MAX_VOCAB);
    const lmloss_rowstate y = lmloss_rowstate_unpack(lmloss_cpu_row(b, i), LMLOSS_STATE_MAX_VOCAB);
    const lmloss_rowstate m = lmloss_rowstate_merge(x, y, k);
    lmloss_rowstate_pack(&m, lmloss_cpu_row_mut(out, i));
  }
  return LMLOSS_OK;
}
