/*
 * fuzz_fused_linear.c - the fused head on the CPU backend: the workspace
 * size, lmloss_linear_cross_entropy (with or without gradients) and its
 * backward, lmloss_linear_log_probs (with saved statistics) and its
 * backward, lmloss_linear_scale_grads, and the head over a vocabulary
 * shard (lmloss_linear_cross_entropy_sharded, whose exchange keeps the
 * shard's states, writes garbage over them or fails; its backward from
 * the input's states); memory budgets from one row's worth to the default
 * (several chunks, or too small), workspaces sometimes one byte short.
 * REF, which has no fused head, must refuse each call and write nothing.
 */
#include "fuzz_common.h"

/* The sharded call's exchange: mode 0 keeps the shard's states (a world
 * of one), 1 writes the input's floats over them, 2 fails. */
typedef struct {
  fz_in *in;
  int mode;
} fz_exchange;

static lmloss_status exchange(void *user, const lmloss_tensor *state) {
  const fz_exchange *x = user;
  for (int64_t i = 0; i < state->rows && x->mode == 1; i++)
    for (int64_t j = 0; j < state->cols; j++)
      ((float *)state->data)[i * state->row_stride + j] = fz_float(x->in);
  return x->mode == 2 ? LMLOSS_ERR_BAD_OPTION : LMLOSS_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_in in = {data, size, size};
  fz_pool pool = {0};
  const int64_t N = fz_range(&in, 0, 7) - fz_chance(&in, 4);
  const int64_t V = fz_chance(&in, 8) ? fz_range(&in, 2040, 3000) : fz_range(&in, 0, 70);
  const int64_t H = fz_range(&in, 0, 9) - fz_chance(&in, 4);
  const int64_t K = fz_range(&in, 1, 3);
  /* CE fwd, CE bwd, LP fwd, LP bwd, scale, sharded CE fwd, its bwd */
  const int kind = (int)fz_range(&in, 0, 6);
  const int lp = kind == 2 || kind == 3;
  lmloss_ce_options opt = lmloss_ce_options_default();
  if (fz_chance(&in, 96)) opt.label_smoothing = (float)fz_u8(&in) / 255.0f;
  if (fz_chance(&in, 64)) opt.z_loss = (float)fz_u8(&in) / 2550.0f;
  opt.reduction = (lmloss_reduction)fz_range(&in, 0, 3);
  opt.transform = fz_transform(&in);
  const lmloss_transform tr = opt.transform;
  lmloss_head_options ho = lmloss_head_options_default();
  ho.memory_budget = fz_chance(&in, 64) ? 0 : (size_t)fz_range(&in, 0, 60000);
  ho.fp32_accumulate = (int)fz_range(&in, 0, 1);

  const lmloss_dtype hdt = fz_dtype(&in, LMLOSS_F32); /* 16-bit heads: UNSUPPORTED here */
  lmloss_head head = {fz_tensor(&in, &pool, hdt, N, H, V, 0),
                      fz_tensor(&in, &pool, fz_dtype(&in, hdt), V, H, V, 0),
                      fz_optional(&in, &pool, fz_dtype(&in, hdt), V, 1, V, 0)};
  lmloss_tensor y =
      fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_I64), N, lp ? K : 1, V, opt.ignore_index);
  lmloss_tensor mask = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_BOOL), N, 1, V, 0);
  lmloss_tensor tw = fz_optional(&in, &pool, LMLOSS_F32, N, 1, V, 0);
  lmloss_tensor cw = fz_optional(&in, &pool, LMLOSS_F32, V, 1, V, 0);
  const int none = opt.reduction == LMLOSS_REDUCE_NONE;
  lmloss_head_grads gr = {fz_optional(&in, &pool, fz_dtype(&in, hdt), N, H, V, 0),
                          fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), V, H, V, 0),
                          fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), V, 1, V, 0)};
  lmloss_tensor loss = fz_tensor(&in, &pool, LMLOSS_F32, lp ? N : none ? N : 1, lp ? K : 1, V, 0);
  lmloss_tensor ent = fz_optional(&in, &pool, LMLOSS_F32, N, 1, V, 0);
  lmloss_tensor stats = fz_optional(&in, &pool, LMLOSS_F32, N, LMLOSS_ROW_STATS, V, 0);
  lmloss_tensor up = fz_tensor(&in, &pool, LMLOSS_F32, lp || none ? N : 1, lp ? K : 1, V, 0);
  lmloss_tensor scale = fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_F32), 1, 1, V, 0);
  /* a shard: the head's V rows at col0 of a wider vocabulary (sometimes
   * outside it), its states sometimes of the wrong dtype or shape */
  const lmloss_shard shard = {fz_range(&in, -1, 40), V + fz_range(&in, -1, 60),
                              (int)fz_range(&in, -1, 1)};
  lmloss_tensor state = fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_F32), N,
                                  LMLOSS_ROW_STATE_COLS - fz_chance(&in, 4), V, 0);
  fz_exchange xch = {&in, (int)fz_range(&in, 0, 2)};

  size_t wsb = 0;
  const int no_grads = fz_chance(&in, 32);
  lmloss_status sw =
      lmloss_linear_workspace_size(&head, &ho, no_grads ? NULL : &gr, lp ? K : 1, &wsb);
  if ((int)sw < 0 || (int)sw > LMLOSS_ERR_OUT_OF_MEMORY) fz_fail("workspace size", sw);
  if (sw != LMLOSS_OK || wsb > ((size_t)1 << 26)) wsb = (size_t)fz_range(&in, 0, 4096);
  if (fz_chance(&in, 16) && wsb) wsb -= 1;
  void *ws = fz_chance(&in, 4) ? NULL : fz_alloc(&pool, wsb);

  lmloss_context cpu = fz_context(&in, LMLOSS_BACKEND_CPU), ref = cpu;
  ref.backend = LMLOSS_BACKEND_REF;
  for (int b = 0; b < 2; b++) { /* REF (must refuse), then CPU */
    lmloss_context *ctx = b ? &cpu : &ref;
    lmloss_head_grads g = gr;
    lmloss_tensor l = loss, e = ent, s = stats, sst = state;
    if (!b) { /* REF's own copies, so that the CPU's outputs stay unread */
      g.dhidden = fz_clone(&pool, &gr.dhidden), g.dweight = fz_clone(&pool, &gr.dweight);
      g.dbias = fz_clone(&pool, &gr.dbias), l = fz_clone(&pool, &loss);
      e = fz_clone(&pool, &ent), s = fz_clone(&pool, &stats), sst = fz_clone(&pool, &state);
    }
    fz_outs w = {0};
    fz_watch(&w, &pool, &g.dhidden), fz_watch(&w, &pool, &g.dweight);
    fz_watch(&w, &pool, &g.dbias), fz_watch(&w, &pool, &l), fz_watch(&w, &pool, &e);
    if (kind == 2) fz_watch(&w, &pool, &s);
    if (kind == 5 && xch.mode != 2) fz_watch(&w, &pool, &sst); /* a failed exchange saw it */
    const lmloss_head_grads *gp = no_grads ? NULL : &g;
    lmloss_status st;
    switch (kind) {
    case 0: {
      lmloss_ce_outputs out = {.loss = l, .entropy = e};
      st = lmloss_linear_cross_entropy(ctx, &head, &y, &tw, &cw, &opt, &ho, &out, gp, ws, wsb);
      break;
    }
    case 1:
      st = lmloss_linear_cross_entropy_backward(ctx, &head, &y, &tw, &cw, &opt, &ho, &up, gp, ws,
                                                wsb);
      break;
    case 2:
      st = lmloss_linear_log_probs(ctx, &head, &y, &mask, &tr, &ho, &l, &e, &s, ws, wsb);
      break;
    case 3:
      st = lmloss_linear_log_probs_backward(ctx, &head, fz_chance(&in, 8) ? NULL : &y, &mask, &tr,
                                            &ho, &up, &e, &stats, gp, ws, wsb);
      break;
    case 4: st = lmloss_linear_scale_grads(ctx, &head, gp, &scale); break;
    case 5: {
      lmloss_ce_outputs out = {.loss = l, .entropy = e};
      st = lmloss_linear_cross_entropy_sharded(ctx, &head, &y, &tw, &cw, &opt, &ho, &shard,
                                               exchange, &xch, &sst, &out, gp, ws, wsb);
      break;
    }
    default:
      st = lmloss_linear_cross_entropy_backward_finish(ctx, &head, &y, &tw, &cw, &opt, &ho, &shard,
                                                       &sst, &up, gp, ws, wsb);
    }
    if (!b && st == LMLOSS_OK) fz_fail("REF ran the fused head", st);
    fz_check(st, &w, b ? "fused head on CPU" : "fused head on REF");
  }
  fz_release(&pool);
  return 0;
}
