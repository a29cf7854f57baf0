/*
 * fuzz_shard.c - the row contract over a vocabulary split into 1 to 3
 * shards: each shard's state (cross-entropy or log-probs), the merge
 * (lmloss_row_state_merge, in place), sometimes states the input
 * corrupts, and every finish over each shard's columns (the softmax's
 * backward phases too), on the CPU
 * backend; REF, which has no row states, must refuse them and write
 * nothing. Some inputs go on to the divergences over the same cuts:
 * states of a student and a teacher, their merge, the partials, the
 * finishes, likewise.
 */
#include "fuzz_common.h"

/* The columns [c0, c0 + n) of t (a view, same rows and stride). */
static lmloss_tensor cols_of(const lmloss_tensor *t, int64_t c0, int64_t n) {
  lmloss_tensor v = *t;
  if (t->data && c0 > 0 && c0 < t->cols) v.data = (char *)t->data + (size_t)c0 * fz_elem(t->dtype);
  v.cols = n;
  return v;
}

/* The divergences' phases over the cuts: garbage states and partials are
 * read as non-finite rows, never out of bounds. */
static void divergence_shards(fz_in *in, fz_pool *pool, int64_t N, int64_t V, const int64_t *cut,
                              int ns, const lmloss_shard *proto) {
  lmloss_div_options opt = lmloss_div_options_default();
  opt.kind = (lmloss_divergence_kind)fz_range(in, 0, 3);
  opt.beta = (float)fz_range(in, 0, 4) / 4.0f;
  opt.student = fz_transform(in);
  opt.teacher = fz_chance(in, 128) ? opt.student : fz_transform(in);
  opt.reduction = (lmloss_reduction)fz_range(in, 0, 3);
  if (fz_chance(in, 48)) opt.hard_weight = fz_u8(in) / 64.0f;
  lmloss_tensor s = fz_tensor(in, pool, fz_float_dtype(in), N, V, V, 0);
  lmloss_tensor t = fz_tensor(in, pool, fz_float_dtype(in), N, V, V, 0);
  lmloss_tensor y = fz_optional(in, pool, fz_dtype(in, LMLOSS_I64), N, 1, V, -100);
  lmloss_context cpu = fz_context(in, LMLOSS_BACKEND_CPU), ref = cpu;
  ref.backend = LMLOSS_BACKEND_REF;
  const int64_t SC = LMLOSS_DIV_STATE_COLS, PC = LMLOSS_DIV_PARTIAL_COLS;
  lmloss_tensor merged = fz_tensor(in, pool, LMLOSS_F32, N, SC, V, 0);
  lmloss_tensor st = fz_tensor(in, pool, fz_dtype(in, LMLOSS_F32), N, SC, V, 0);
  lmloss_tensor part = fz_tensor(in, pool, fz_dtype(in, LMLOSS_F64), N, PC, V, 0);
  for (int r = 0; r < ns; r++) {
    lmloss_shard sh = *proto;
    sh.col0 = cut[r];
    const int64_t n = cut[r + 1] - cut[r];
    lmloss_div_inputs di = {cols_of(&s, cut[r], n), cols_of(&t, cut[r], n), y};
    fz_outs w = {0};
    lmloss_tensor sref = fz_clone(pool, &st);
    fz_watch(&w, pool, &sref);
    const lmloss_status sr = lmloss_divergence_state(&ref, &di, &opt, &sh, &sref);
    if (sr == LMLOSS_OK) fz_fail("REF formed a divergence state", sr);
    fz_check(sr, &w, "divergence state on REF");
    const lmloss_status sc = lmloss_divergence_state(&cpu, &di, &opt, &sh, &st);
    fz_check(sc, &(fz_outs){0}, "divergence state on CPU");
    if (sc != LMLOSS_OK) continue;
    if (r == 0 && fz_span(&st) && fz_span(&st) == fz_span(&merged))
      memcpy(merged.data, st.data, fz_span(&st));
    else
      fz_check(lmloss_divergence_state_merge(&cpu, &merged, &st, &opt, &merged), &(fz_outs){0},
               "divergence merge on CPU");
  }
  if (fz_chance(in, 32) && fz_span(&merged)) /* a corrupted exchange */
    ((unsigned char *)merged.data)[fz_range(in, 0, (int64_t)fz_span(&merged) - 1)] ^= fz_u8(in);
  const int64_t nl = opt.reduction == LMLOSS_REDUCE_NONE ? N : 1;
  size_t wsb = lmloss_cross_entropy_workspace_size(N > 0 ? N : 0);
  void *ws = fz_alloc(pool, wsb ? wsb : 1);
  for (int r = 0; r < ns; r++) {
    lmloss_shard sh = *proto;
    sh.col0 = cut[r];
    const int64_t n = cut[r + 1] - cut[r];
    lmloss_div_inputs di = {cols_of(&s, cut[r], n), cols_of(&t, cut[r], n), y};
    /* sometimes the gradient in two halves (partials_grad, finish_grad) */
    const int halves = fz_chance(in, 48);
    lmloss_tensor g = fz_tensor(in, pool, fz_dtype(in, halves ? LMLOSS_F32 : s.dtype), N, n, V, 0);
    fz_outs wp = {0};
    fz_watch(&wp, pool, &part);
    if (halves) fz_watch(&wp, pool, &g);
    fz_check(
        halves ? lmloss_divergence_partials_grad(&cpu, &di, &opt, &sh, &merged, &part, &g, ws, wsb)
               : lmloss_divergence_partials(&cpu, &di, &opt, &sh, &merged, &part),
        &wp, "divergence partials on CPU");
    if (fz_chance(in, 16) && fz_span(&part)) /* a corrupted sum */
      ((unsigned char *)part.data)[fz_range(in, 0, (int64_t)fz_span(&part) - 1)] ^= fz_u8(in);
    lmloss_tensor l = fz_tensor(in, pool, LMLOSS_F32, nl, 1, V, 0);
    lmloss_tensor e = fz_optional(in, pool, LMLOSS_F32, N, 1, V, 0);
    lmloss_tensor up = fz_tensor(in, pool, LMLOSS_F32, nl, 1, V, 0);
    fz_outs w = {0};
    fz_watch(&w, pool, &g), fz_watch(&w, pool, &l), fz_watch(&w, pool, &e);
    lmloss_div_outputs out = {.loss = l, .entropy = e};
    if (fz_chance(in, 128)) out.dstudent = g;
    const lmloss_tensor *p = fz_chance(in, 32) ? NULL : &part;
    fz_check(
        halves ? lmloss_divergence_finish_grad(&cpu, &di, &opt, &sh, &merged, &part, &g, ws, wsb)
        : fz_chance(in, 128)
            ? lmloss_divergence_finish(&cpu, &di, &opt, &sh, &merged, &part, &out, ws, wsb)
            : lmloss_divergence_backward_finish(&cpu, &di, &opt, &sh, &merged, p, &up, &g, ws, wsb),
        &w, "divergence finish on CPU");
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_in in = {data, size, size};
  fz_pool pool = {0};
  const int64_t N = fz_range(&in, 0, 5) - fz_chance(&in, 4);
  const int64_t V = fz_chance(&in, 16) ? fz_range(&in, 2040, 4500) : fz_range(&in, 1, 80);
  const int ce = (int)fz_range(&in, 0, 2); /* 0: log-probs, 1: CE, 2: softmax */
  lmloss_shard proto = lmloss_shard_default();
  proto.entropy = (int)fz_range(&in, 0, 1);
  proto.vocab = fz_chance(&in, 8) ? fz_range(&in, -1, V + 2) : V;
  lmloss_ce_options opt = lmloss_ce_options_default();
  if (fz_chance(&in, 96)) opt.label_smoothing = (float)fz_u8(&in) / 255.0f;
  if (fz_chance(&in, 64)) opt.z_loss = (float)fz_u8(&in) / 2550.0f;
  opt.reduction = (lmloss_reduction)fz_range(&in, 0, 3);
  opt.dft = fz_chance(&in, 32);
  opt.transform = ce == 2 ? lmloss_transform_default() : fz_transform(&in);
  const lmloss_transform tr = opt.transform;
  const lmloss_dtype xdt = fz_float_dtype(&in);

  lmloss_tensor x = fz_tensor(&in, &pool, xdt, N, V, V, 0);
  lmloss_tensor y = fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_I64), N, 1, V, opt.ignore_index);
  lmloss_tensor mask = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_BOOL), N, 1, V, 0);
  lmloss_tensor cw = fz_optional(&in, &pool, LMLOSS_F32, V, 1, V, 0);
  const int with_index = ce == 0 && fz_chance(&in, 192);

  /* the cuts: shard s holds [cut[s], cut[s + 1]) */
  const int ns = (int)fz_range(&in, 1, 3);
  int64_t cut[4] = {0, V, V, V};
  for (int s = 1; s < ns; s++)
    cut[s] = fz_range(&in, cut[s - 1], V);
  cut[ns] = V;

  lmloss_context cpu = fz_context(&in, LMLOSS_BACKEND_CPU), ref = cpu;
  ref.backend = LMLOSS_BACKEND_REF;
  const int64_t SC = LMLOSS_ROW_STATE_COLS;
  lmloss_tensor merged = fz_tensor(&in, &pool, LMLOSS_F32, N, SC, V, 0);
  lmloss_tensor st = fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, SC, V, 0);
  const int keep_garbage = fz_chance(&in, 24); /* merged stays what the input says */
  int have = 0;
  for (int s = 0; s < ns; s++) {
    lmloss_shard sh = proto;
    sh.col0 = cut[s];
    lmloss_tensor xs = cols_of(&x, cut[s], cut[s + 1] - cut[s]);
    fz_outs w = {0};
    lmloss_tensor sref = fz_clone(&pool, &st);
    fz_watch(&w, &pool, &sref);
    lmloss_status sr, sc;
    if (ce == 1) {
      lmloss_ce_inputs ci = {xs, y, {0}, cw};
      sr = lmloss_cross_entropy_state(&ref, &ci, &opt, &sh, &sref);
      sc = lmloss_cross_entropy_state(&cpu, &ci, &opt, &sh, &st);
    } else {
      const lmloss_tensor *ip = with_index ? &y : NULL;
      sr = lmloss_log_probs_state(&ref, &xs, ip, &mask, &tr, &sh, &sref);
      sc = lmloss_log_probs_state(&cpu, &xs, ip, &mask, &tr, &sh, &st);
    }
    if (sr == LMLOSS_OK) fz_fail("REF formed a row state", sr);
    fz_check(sr, &w, "state on REF");
    fz_check(sc, &(fz_outs){0}, "state on CPU");
    if (sc != LMLOSS_OK || keep_garbage) continue;
    if (!have) {
      if (fz_span(&st) && fz_span(&st) == fz_span(&merged))
        memcpy(merged.data, st.data, fz_span(&st));
      have = 1;
      continue;
    }
    fz_outs wm = {0};
    lmloss_tensor mref = fz_clone(&pool, &merged);
    fz_watch(&wm, &pool, &mref);
    lmloss_status mr = lmloss_row_state_merge(&ref, &mref, &st, &tr, &mref);
    if (mr == LMLOSS_OK) fz_fail("REF merged row states", mr);
    fz_check(mr, &wm, "merge on REF");
    fz_check(lmloss_row_state_merge(&cpu, &merged, &st, &tr, &merged), &(fz_outs){0},
             "merge on CPU");
  }
  if (fz_chance(&in, 32) && fz_span(&merged)) /* a corrupted exchange */
    ((unsigned char *)merged.data)[fz_range(&in, 0, (int64_t)fz_span(&merged) - 1)] ^= fz_u8(&in);

  const int none = opt.reduction == LMLOSS_REDUCE_NONE;
  size_t wsb = lmloss_cross_entropy_workspace_size(N > 0 ? N : 0);
  void *ws = fz_alloc(&pool, wsb);
  for (int s = 0; s < ns; s++) {
    lmloss_shard sh = proto;
    sh.col0 = cut[s];
    const int64_t n = cut[s + 1] - cut[s];
    lmloss_tensor xs = cols_of(&x, cut[s], n);
    lmloss_tensor g = fz_tensor(&in, &pool, fz_dtype(&in, xdt), N, n, V, 0);
    lmloss_tensor l = fz_tensor(&in, &pool, LMLOSS_F32, ce == 1 && !none ? 1 : N, 1, V, 0);
    lmloss_tensor e = fz_optional(&in, &pool, LMLOSS_F32, N, 1, V, 0);
    lmloss_tensor up = fz_tensor(&in, &pool, LMLOSS_F32, none || ce != 1 ? N : 1, 1, V, 0);
    fz_outs w = {0};
    fz_watch(&w, &pool, &g), fz_watch(&w, &pool, &l), fz_watch(&w, &pool, &e);
    const int which = (int)fz_range(&in, 0, 1);
    lmloss_tensor p; /* the softmax backward's partials, watched to fz_check */
    lmloss_status st2;
    if (ce == 1) {
      lmloss_ce_inputs ci = {xs, y, {0}, cw};
      lmloss_ce_outputs out = {.loss = l, .entropy = e};
      if (which) out.dlogits = g;
      st2 = fz_chance(&in, 128)
                ? lmloss_cross_entropy_finish(&cpu, &ci, &opt, &sh, &merged, &out, ws, wsb)
                : lmloss_cross_entropy_backward_finish(&cpu, &ci, &opt, &sh, &merged, &up, &g, ws,
                                                       wsb);
    } else if (ce == 0) {
      const lmloss_tensor *ip = with_index ? &y : NULL;
      st2 = which ? lmloss_log_probs_finish(&cpu, &xs, ip, &mask, &tr, &sh, &merged,
                                            with_index ? &l : NULL, &e)
                  : lmloss_log_probs_backward_finish(&cpu, &xs, ip, &mask, &tr, &sh, &merged,
                                                     with_index ? &up : NULL, &e, &g);
    } else if (fz_chance(&in, 128)) {
      st2 = lmloss_softmax_finish(&cpu, &xs, &sh, &merged, which, &g);
    } else { /* the backward's phases, y and dy the shard's logits (any floats) */
      p = fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_F64), N, 1, V, 0);
      fz_watch(&w, &pool, &p);
      st2 = fz_chance(&in, 128)
                ? lmloss_softmax_backward_partials(&cpu, &xs, &xs, which, &sh, &merged, &up, &p)
                : lmloss_softmax_backward_finish(&cpu, &xs, &xs, which, &sh, &merged, &up, &p, &g);
    }
    fz_check(st2, &w, "finish on CPU");
  }
  if (!fz_chance(&in, 160)) divergence_shards(&in, &pool, N, V, cut, ns, &proto);
  fz_release(&pool);
  return 0;
}
