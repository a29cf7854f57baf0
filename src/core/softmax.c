/* softmax.c - softmax / log-softmax (one shot or a shard's columns from
 * merged states) and their backward: validate, dispatch. */
#include "validate.h"

/* The forward's arguments after x's, and its backend. */
static lmloss_status check_forward(const lmloss_context *ctx, const lmloss_tensor *x, int log,
                                   const lmloss_tensor *out, const lmloss_backend_ops **ops) {
  if (log != 0 && log != 1) return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "log must be 0 or 1");
  TRY(lmloss_check_tensor(out, "out", LMLOSS_FLOATS, x->rows, x->cols));
  TRY(lmloss_check_alias(x, out, "out"));
  const lmloss_tensor *ts[] = {out};
  TRY(lmloss_check_device(ts, 1, x->device));
  return lmloss_pick_backend(ctx, x->device, ops);
}

static lmloss_status check_x(const lmloss_tensor *x) {
  TRY(lmloss_check_tensor(x, "x", LMLOSS_FLOATS, -1, -1));
  if (x->cols < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "x: V must be >= 1");
  return LMLOSS_OK;
}

lmloss_status lmloss_softmax(const lmloss_context *ctx, const lmloss_tensor *x, int log,
                             const lmloss_tensor *out) {
  const lmloss_backend_ops *ops;
  TRY(check_x(x));
  TRY(check_forward(ctx, x, log, out, &ops));
  return ops->softmax(ctx, x, log, out);
}

/* The backward's y, dy, log and (unless NULL: a shard's partials) dx. */
static lmloss_status check_backward(const lmloss_tensor *y, const lmloss_tensor *dy, int log,
                                    const lmloss_tensor *dx) {
  TRY(lmloss_check_tensor(y, "y", LMLOSS_FLOATS, -1, -1));
  if (y->cols < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "y: V must be >= 1");
  if (log != 0 && log != 1) return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "log must be 0 or 1");
  TRY(lmloss_check_tensor(dy, "dy", LMLOSS_FLOATS, y->rows, y->cols));
  if (!dx) return LMLOSS_OK;
  TRY(lmloss_check_tensor(dx, "dx", LMLOSS_FLOATS, y->rows, y->cols));
  TRY(lmloss_check_alias(dy, dx, "dx"));
  return lmloss_check_alias(y, dx, "dx");
}

lmloss_status lmloss_softmax_backward(const lmloss_context *ctx, const lmloss_tensor *y,
                                      const lmloss_tensor *dy, int log, const lmloss_tensor *dx) {
  const lmloss_backend_ops *ops;
  if (!dx) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "dx is NULL");
  TRY(check_backward(y, dy, log, dx));
  const lmloss_tensor *ts[] = {dy, dx};
  TRY(lmloss_check_device(ts, 2, y->device));
  TRY(lmloss_pick_backend(ctx, y->device, &ops));
  return ops->softmax_backward(ctx, y, dy, log, dx);
}

lmloss_status lmloss_softmax_finish(const lmloss_context *ctx, const lmloss_tensor *x,
                                    const lmloss_shard *shard, const lmloss_tensor *state, int log,
                                    const lmloss_tensor *out) {
  const lmloss_backend_ops *ops;
  lmloss_shard sh;
  TRY(check_x(x));
  TRY(lmloss_check_shard(shard, x->rows, x->cols, state, LMLOSS_ROW_STATE_COLS, x->device, &sh));
  TRY(check_forward(ctx, x, log, out, &ops));
  TRY(lmloss_check_supports(ops, LMLOSS_CAN_ROW_STATES, "row states"));
  return ops->states->softmax_finish(ctx, x, &sh, state, log, out);
}

/* The sharded backward's arguments; dx NULL for the partials. */
static lmloss_status softmax_bwd_shard(const lmloss_context *ctx, const lmloss_tensor *y,
                                       const lmloss_tensor *dy, int log, const lmloss_shard *shard,
                                       const lmloss_tensor *state, const lmloss_tensor *dy_a,
                                       const lmloss_tensor *partials, const lmloss_tensor *dx) {
  const lmloss_backend_ops *ops;
  lmloss_shard sh;
  TRY(check_backward(y, dy, log, dx));
  TRY(lmloss_check_shard(shard, y->rows, y->cols, state, LMLOSS_ROW_STATE_COLS, y->device, &sh));
  TRY(lmloss_check_tensor(dy_a, "dy_a", LMLOSS_MASK(LMLOSS_F32), y->rows, 1));
  TRY(lmloss_check_tensor(partials, "partials", LMLOSS_MASK(LMLOSS_F64), y->rows, 1));
  const lmloss_tensor *ts[] = {dy, dy_a, partials, dx ? dx : dy};
  TRY(lmloss_check_device(ts, 4, y->device));
  TRY(lmloss_pick_backend(ctx, y->device, &ops));
  TRY(lmloss_check_supports(ops, LMLOSS_CAN_ROW_STATES, "row states"));
  return ops->states->softmax_bwd(ctx, y, dy, log, &sh, state, dy_a, partials, dx);
}

lmloss_status lmloss_softmax_backward_partials(const lmloss_context *ctx, const lmloss_tensor *y,
                                               const lmloss_tensor *dy, int log,
                                               const lmloss_shard *shard,
                                               const lmloss_tensor *state,
                                               const lmloss_tensor *dy_a,
                                               const lmloss_tensor *partials) {
  return softmax_bwd_shard(ctx, y, dy, log, shard, state, dy_a, partials, NULL);
}

lmloss_status lmloss_softmax_backward_finish(const lmloss_context *ctx, const lmloss_tensor *y,
                                             const lmloss_tensor *dy, int log,
                                             const lmloss_shard *shard, const lmloss_tensor *state,
                                             const lmloss_tensor *dy_a,
                                             const lmloss_tensor *partials,
                                             const lmloss_tensor *dx) {
  if (!dx) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "dx is NULL");
  return softmax_bwd_shard(ctx, y, dy, log, shard, state, dy_a, partials, dx);
}
