/*
 * fuzz_ce.c - lmloss_cross_entropy (forward, with or without the fused
 * gradient) and lmloss_cross_entropy_backward on the CPU and REF
 * backends, every option and optional tensor decoded from the input;
 * where the contract bounds them, the losses and entropies of the two
 * agree.
 */
#include "fuzz_common.h"

static float fz_option(fz_in *in, float lo, float hi) {
  if (fz_chance(in, 200)) return lo + (hi - lo) * (float)fz_u8(in) / 255.0f;
  return fz_float(in);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_in in = {data, size, size};
  fz_pool pool = {0};
  const int64_t N = fz_range(&in, 0, 6) - fz_chance(&in, 4);
  const int64_t V = fz_chance(&in, 16) ? fz_range(&in, 2040, 4500) : fz_range(&in, 0, 80);
  lmloss_ce_options opt = lmloss_ce_options_default();
  if (fz_chance(&in, 64)) opt.ignore_index = fz_range(&in, -3, V + 1);
  if (fz_chance(&in, 96)) opt.label_smoothing = fz_option(&in, 0.0f, 1.0f);
  if (fz_chance(&in, 64)) opt.z_loss = fz_option(&in, 0.0f, 0.01f);
  opt.transform = fz_transform(&in);
  opt.reduction = (lmloss_reduction)fz_range(&in, 0, 4); /* 4: no such reduction */
  opt.num_items = fz_chance(&in, 200) ? 1.0 + fz_u8(&in) : fz_float(&in);
  opt.dft = (int)fz_range(&in, 0, 1);
  if (fz_chance(&in, 8)) opt.dft = (int)fz_range(&in, -1, 2);
  if (fz_chance(&in, 64)) opt.grad_output = fz_float(&in);
  opt.zero_ignored_rows = (int)fz_range(&in, 0, 1);

  const lmloss_dtype xdt = fz_float_dtype(&in);
  lmloss_ce_inputs ci;
  ci.logits = fz_tensor(&in, &pool, xdt, N, V, V, opt.ignore_index);
  ci.target = fz_tensor(&in, &pool, fz_dtype(&in, fz_chance(&in, 128) ? LMLOSS_I64 : LMLOSS_I32), N,
                        1, V, opt.ignore_index);
  ci.token_weight = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, 1, V, 0);
  ci.class_weight = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), V, 1, V, 0);

  const int none = opt.reduction == LMLOSS_REDUCE_NONE, mode = (int)fz_range(&in, 0, 2);
  lmloss_ce_outputs oc = {{0}};
  oc.loss = fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_F32), none ? N : 1, 1, V, 0);
  if (mode != 2) { /* 0: forward, 1: forward with the gradient, 2: backward */
    oc.lse = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, 1, V, 0);
    oc.entropy = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, 1, V, 0);
    oc.argmax = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_I64), N, 1, V, 0);
  }
  if (mode >= 1) oc.dlogits = fz_tensor(&in, &pool, fz_dtype(&in, xdt), N, V, V, 0);
  lmloss_tensor dloss = fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_F32), none ? N : 1, 1, V, 0);

  size_t ws_bytes = lmloss_cross_entropy_workspace_size(N > 0 ? N : 0);
  if (fz_chance(&in, 8) && ws_bytes) ws_bytes -= 1 + fz_range(&in, 0, (int64_t)ws_bytes - 1);
  void *ws = fz_chance(&in, 4) ? NULL : fz_alloc(&pool, ws_bytes);

  lmloss_ce_outputs orf = oc; /* REF's outputs: copies */
  lmloss_tensor *pc[] = {&oc.loss, &oc.lse, &oc.entropy, &oc.argmax, &oc.dlogits};
  lmloss_tensor *pr[] = {&orf.loss, &orf.lse, &orf.entropy, &orf.argmax, &orf.dlogits};
  fz_outs wc = {0}, wr = {0};
  for (int k = 0; k < 5; k++) {
    *pr[k] = fz_clone(&pool, pc[k]);
    fz_watch(&wc, &pool, pc[k]), fz_watch(&wr, &pool, pr[k]);
  }
  lmloss_context cpu = fz_context(&in, LMLOSS_BACKEND_CPU), ref = cpu;
  ref.backend = LMLOSS_BACKEND_REF;
  lmloss_status sc, sr;
  if (mode == 2) {
    sc = lmloss_cross_entropy_backward(&cpu, &ci, &opt, &dloss, &oc.dlogits, ws, ws_bytes);
    sr = lmloss_cross_entropy_backward(&ref, &ci, &opt, &dloss, &orf.dlogits, ws, ws_bytes);
  } else {
    sc = lmloss_cross_entropy(&cpu, &ci, &opt, &oc, ws, ws_bytes);
    sr = lmloss_cross_entropy(&ref, &ci, &opt, &orf, ws, ws_bytes);
  }
  fz_check(sc, &wc, "cross_entropy on CPU");
  fz_check(sr, &wr, "cross_entropy on REF");
  fz_agree(sc, sr, "cross_entropy");
  if (sc == LMLOSS_OK && sr == LMLOSS_OK && mode != 2 && fz_tame(&ci.logits, &opt.transform) &&
      !ci.token_weight.data && !ci.class_weight.data) {
    fz_close(&oc.loss, &orf.loss, "loss");
    fz_close(&oc.entropy, &orf.entropy, "entropy");
  }
  fz_release(&pool);
  return 0;
}
