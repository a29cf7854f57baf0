/*
 * fuzz_logprob.c - lmloss_log_probs, lmloss_entropy and
 * lmloss_log_probs_backward (from dlogp and/or dentropy, with or without
 * the forward's saved statistics, in place or not) on the CPU and REF
 * backends; where the contract bounds them, the log-probs and entropies
 * of the two agree.
 */
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_in in = {data, size, size};
  fz_pool pool = {0};
  const int64_t N = fz_range(&in, 0, 6) - fz_chance(&in, 4);
  const int64_t V = fz_chance(&in, 16) ? fz_range(&in, 2040, 4500) : fz_range(&in, 0, 80);
  const int64_t K = fz_range(&in, 0, 4) - fz_chance(&in, 4);
  const lmloss_transform tr = fz_transform(&in);
  const lmloss_dtype xdt = fz_float_dtype(&in);
  const int mode = (int)fz_range(&in, 0, 2); /* forward, entropy, backward */

  lmloss_tensor x = fz_tensor(&in, &pool, xdt, N, V, V, 0);
  lmloss_tensor idx = fz_optional(
      &in, &pool, fz_dtype(&in, fz_chance(&in, 128) ? LMLOSS_I64 : LMLOSS_I32), N, K, V, -1);
  if (mode != 1 && fz_chance(&in, 200) && !idx.data)
    idx = fz_tensor(&in, &pool, LMLOSS_I64, N, K, V, 0);
  lmloss_tensor mask = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_BOOL), N, 1, V, 0);
  /* saved statistics: garbage from the input, or the forward's (below) */
  lmloss_tensor stats =
      fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, LMLOSS_ROW_STATS, V, 0);
  const int fresh_stats = fz_chance(&in, 128);

  lmloss_tensor o[4] = {{0}}; /* logp, entropy, dlogits, stats out */
  lmloss_tensor dlogp = {0}, dent = {0};
  if (mode == 0) {
    o[0] = fz_tensor(&in, &pool, fz_dtype(&in, xdt), N, K, V, 0);
    o[1] = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, 1, V, 0);
    o[3] = stats;
    stats = (lmloss_tensor){0};
  } else if (mode == 1) {
    o[1] = fz_tensor(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, 1, V, 0);
  } else {
    dlogp = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, K, V, 0);
    dent = fz_optional(&in, &pool, fz_dtype(&in, LMLOSS_F32), N, 1, V, 0);
    o[2] = fz_tensor(&in, &pool, fz_dtype(&in, xdt), N, V, V, 0);
  }
  const int inplace = mode == 2 && fz_chance(&in, 48);
  lmloss_context cpu = fz_context(&in, LMLOSS_BACKEND_CPU), ref = cpu;
  ref.backend = LMLOSS_BACKEND_REF;

  if (mode == 2 && fresh_stats && stats.data) { /* the statistics this forward saves */
    lmloss_context c1 = cpu;
    c1.num_threads = 1;
    lmloss_tensor lp = fz_tensor(&in, &pool, LMLOSS_F32, N, K > 0 ? K : 1, V, 0);
    (void)lmloss_log_probs(&c1, &x, idx.data ? &idx : NULL, &mask, &tr, idx.data ? &lp : NULL, NULL,
                           &stats);
  }

  lmloss_tensor r[4], xr = x, xc = x;
  fz_outs wc = {0}, wr = {0};
  for (int k = 0; k < 4; k++) {
    r[k] = fz_clone(&pool, &o[k]);
    fz_watch(&wc, &pool, &o[k]), fz_watch(&wr, &pool, &r[k]);
  }
  if (inplace) { /* dlogits over the logits: each backend its own copy */
    xc = fz_clone(&pool, &x), xr = fz_clone(&pool, &x);
    o[2] = xc, r[2] = xr;
    wc.n = wr.n = 0;
    fz_watch(&wc, &pool, &o[2]), fz_watch(&wr, &pool, &r[2]);
    if (fz_span(&x)) {
      memcpy(xc.data, x.data, fz_span(&x)), memcpy(xr.data, x.data, fz_span(&x));
      memcpy(wc.before[0], x.data, fz_span(&x)), memcpy(wr.before[0], x.data, fz_span(&x));
    }
  }
  const lmloss_tensor *ip = idx.data || fz_chance(&in, 128) ? &idx : NULL;
  lmloss_status sc, sr;
  if (mode == 0) {
    sc = lmloss_log_probs(&cpu, &x, ip, &mask, &tr, &o[0], &o[1], &o[3]);
    sr = lmloss_log_probs(&ref, &x, ip, &mask, &tr, &r[0], &r[1], &r[3]);
  } else if (mode == 1) {
    sc = lmloss_entropy(&cpu, &x, &tr, &o[1]);
    sr = lmloss_entropy(&ref, &x, &tr, &r[1]);
  } else {
    const lmloss_tensor *dp = dlogp.data || fz_chance(&in, 64) ? &dlogp : NULL;
    const lmloss_tensor *dh = dent.data || fz_chance(&in, 64) ? &dent : NULL;
    const lmloss_tensor *sp = stats.data ? &stats : NULL;
    sc = lmloss_log_probs_backward(&cpu, &xc, ip, &mask, &tr, dp, dh, &o[2], sp);
    sr = lmloss_log_probs_backward(&ref, &xr, ip, &mask, &tr, dp, dh, &r[2], sp);
  }
  fz_check(sc, &wc, "log-probs on CPU");
  fz_check(sr, &wr, "log-probs on REF");
  fz_agree(sc, sr, "log-probs");
  if (sc == LMLOSS_OK && sr == LMLOSS_OK && mode != 2 && fz_tame(&x, &tr)) {
    fz_close(&o[0], &r[0], "logp");
    fz_close(&o[1], &r[1], "entropy");
  }
  fz_release(&pool);
  return 0;
}
