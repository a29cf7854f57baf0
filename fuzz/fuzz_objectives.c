/*
 * fuzz_objectives.c - the RL and preference objectives (lmloss_grpo,
 * lmloss_preference, lmloss_kto; forward with or without gradients, and
 * backward) on the CPU and REF backends, every option, wild values and
 * lying tensors: statuses agree, errors leave the outputs alone with a
 * message, and on OK the CPU's results are REF's bit for bit (the same
 * stages in the same order, whatever the thread count).
 */
#include "fuzz_common.h"

/* Every byte of the outputs the same on both backends (NaNs alike). */
static void same_bits(const lmloss_tensor *a, const lmloss_tensor *b, const char *what) {
  const size_t n = fz_span(a);
  if (n && memcmp(a->data, b->data, n)) {
    fprintf(stderr, "fuzz: %s: the CPU's bits differ from REF's\n", what);
    abort();
  }
}

static double fz_option(fz_in *in, double sane) {
  return fz_chance(in, 24) ? fz_float(in) : sane * (fz_u8(in) / 64.0);
}

static void grpo(fz_in *in, fz_pool *pool, const lmloss_context *cpu, const lmloss_context *ref) {
  const int64_t B = fz_range(in, 0, 5) - fz_chance(in, 4), T = fz_range(in, 0, 40);
  lmloss_grpo_options o = lmloss_grpo_options_default();
  o.loss_type = (lmloss_grpo_loss_type)fz_range(in, 0, fz_chance(in, 8) ? 9 : 7);
  o.level = (lmloss_grpo_level)fz_range(in, 0, fz_chance(in, 8) ? 2 : 1);
  o.epsilon_low = fz_option(in, 0.2), o.epsilon_high = fz_option(in, 0.3);
  if (fz_chance(in, 64)) o.delta = fz_option(in, 1.5);
  if (fz_chance(in, 96)) o.beta = fz_option(in, 0.05);
  o.bias_correction_kl = (int)fz_range(in, 0, fz_chance(in, 8) ? 2 : 1);
  o.off_policy_mask = (int)fz_range(in, 0, 1);
  o.off_policy_threshold = fz_option(in, 0.1);
  if (fz_chance(in, 96)) o.entropy_coef = fz_option(in, 0.01);
  o.accumulation_steps = fz_chance(in, 8) ? 0.0 : 1.0 + fz_u8(in) % 4;
  o.max_completion_length = fz_range(in, -1, 50);
  o.num_items = fz_chance(in, 8) ? -1.0 : 1.0 + fz_u8(in);
  o.is_mode = (lmloss_grpo_is_mode)fz_range(in, 0, fz_chance(in, 8) ? 5 : 4);
  o.is_min = fz_option(in, 0.8), o.is_max = fz_chance(in, 32) ? INFINITY : fz_option(in, 1.5);
  const lmloss_dtype f = LMLOSS_F32;
  const int64_t ac = fz_chance(in, 64) ? T : 1, ic = fz_chance(in, 64) ? T : 1;
  lmloss_grpo_inputs x = {
      fz_tensor(in, pool, fz_dtype(in, f), B, T, 0, 0),
      fz_tensor(in, pool, fz_dtype(in, f), B, T, 0, 0),
      fz_tensor(in, pool, fz_dtype(in, f), B, ac, 0, 0),
      fz_optional(in, pool, fz_dtype(in, f), B, T, 0, 0),
      fz_optional(in, pool, fz_dtype(in, f), B, T, 0, 0),
      fz_optional(in, pool, fz_dtype(in, f), B, T, 0, 0),
      fz_chance(in, 64) ? fz_tensor(in, pool, fz_dtype(in, f), B, ic, 0, 0) : (lmloss_tensor){0},
      fz_optional(in, pool, fz_dtype(in, f), B, T, 0, 0),
      fz_chance(in, 48) ? fz_tensor(in, pool, fz_dtype(in, f), 1, 1, 0, 0) : (lmloss_tensor){0},
      fz_chance(in, 48) ? fz_tensor(in, pool, fz_dtype(in, f), 1, 1, 0, 0) : (lmloss_tensor){0}};
  lmloss_tensor out[4] = {fz_tensor(in, pool, fz_dtype(in, f), 1, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), LMLOSS_GRPO_METRICS, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), B, T, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), B, T, 0, 0)};
  lmloss_tensor dloss = fz_tensor(in, pool, fz_dtype(in, f), 1, 1, 0, 0);
  size_t wsb = lmloss_grpo_workspace_size(B > 0 ? B : 0);
  if (fz_chance(in, 8)) wsb /= 2;
  void *ws = fz_alloc(pool, wsb ? wsb : 1);
  lmloss_tensor r[4];
  fz_outs wc = {0}, wr = {0};
  for (int k = 0; k < 4; k++) {
    r[k] = fz_clone(pool, &out[k]);
    fz_watch(&wc, pool, &out[k]), fz_watch(&wr, pool, &r[k]);
  }
  lmloss_status sc, sr;
  if (fz_chance(in, 200)) {
    const lmloss_grpo_outputs oc = {out[0], out[1], out[2], out[3]}, orf = {r[0], r[1], r[2], r[3]};
    sc = lmloss_grpo(cpu, &x, &o, &oc, ws, wsb);
    sr = lmloss_grpo(ref, &x, &o, &orf, ws, wsb);
  } else {
    sc = lmloss_grpo_backward(cpu, &x, &o, &dloss, &out[2], &out[3], ws, wsb);
    sr = lmloss_grpo_backward(ref, &x, &o, &dloss, &r[2], &r[3], ws, wsb);
  }
  fz_check(sc, &wc, "grpo on CPU");
  fz_check(sr, &wr, "grpo on REF");
  fz_agree(sc, sr, "grpo");
  for (int k = 0; sc == LMLOSS_OK && sr == LMLOSS_OK && k < 4; k++)
    same_bits(&out[k], &r[k], "grpo");
}

static void preference(fz_in *in, fz_pool *pool, const lmloss_context *cpu,
                       const lmloss_context *ref) {
  const int64_t P = fz_range(in, 0, 12) - fz_chance(in, 4);
  lmloss_pref_options o = lmloss_pref_options_default();
  for (int k = 0; k < LMLOSS_PREF_TYPES; k++)
    if (fz_chance(in, 24)) o.loss_weights[k] = fz_option(in, 1.0);
  o.beta = fz_option(in, 0.2), o.label_smoothing = fz_option(in, 0.2);
  o.f_divergence = (lmloss_pref_fdiv)fz_range(in, 0, fz_chance(in, 8) ? 5 : 4);
  o.f_alpha = fz_option(in, 1.0), o.discopop_tau = fz_option(in, 0.1);
  o.simpo_gamma = fz_option(in, 0.5);
  const lmloss_dtype f = LMLOSS_F32;
  lmloss_pref_inputs x = {fz_tensor(in, pool, fz_dtype(in, f), P, 1, 0, 0),
                          fz_tensor(in, pool, fz_dtype(in, f), P, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), P, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), P, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), P, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), P, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), P, 1, 0, 0)};
  lmloss_tensor out[5] = {fz_tensor(in, pool, fz_dtype(in, f), 1, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), LMLOSS_PREF_METRICS, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), P, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), P, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), P, 1, 0, 0)};
  size_t wsb = lmloss_preference_workspace_size(P > 0 ? P : 0);
  if (fz_chance(in, 8)) wsb /= 2;
  void *ws = fz_alloc(pool, wsb ? wsb : 1);
  lmloss_tensor r[5];
  fz_outs wc = {0}, wr = {0};
  for (int k = 0; k < 5; k++) {
    r[k] = fz_clone(pool, &out[k]);
    fz_watch(&wc, pool, &out[k]), fz_watch(&wr, pool, &r[k]);
  }
  const lmloss_pref_outputs oc = {out[0], out[1], out[2], out[3], out[4]},
                            orf = {r[0], r[1], r[2], r[3], r[4]};
  const lmloss_status sc = lmloss_preference(cpu, &x, &o, &oc, ws, wsb);
  const lmloss_status sr = lmloss_preference(ref, &x, &o, &orf, ws, wsb);
  fz_check(sc, &wc, "preference on CPU");
  fz_check(sr, &wr, "preference on REF");
  fz_agree(sc, sr, "preference");
  for (int k = 0; sc == LMLOSS_OK && sr == LMLOSS_OK && k < 5; k++)
    same_bits(&out[k], &r[k], "preference");
}

static void kto(fz_in *in, fz_pool *pool, const lmloss_context *cpu, const lmloss_context *ref) {
  const int64_t N = fz_range(in, 0, 12) - fz_chance(in, 4);
  lmloss_kto_options o = lmloss_kto_options_default();
  o.loss_type = (lmloss_kto_type)fz_range(in, 0, fz_chance(in, 8) ? 2 : 1);
  o.beta = fz_option(in, 0.2), o.desirable_weight = fz_option(in, 1.0);
  o.undesirable_weight = fz_option(in, 1.0);
  const lmloss_dtype f = LMLOSS_F32;
  lmloss_kto_inputs x = {fz_tensor(in, pool, fz_dtype(in, f), N, 1, 0, 0),
                         fz_optional(in, pool, fz_dtype(in, f), N, 1, 0, 0),
                         fz_tensor(in, pool, fz_dtype(in, LMLOSS_BOOL), N, 1, 0, 0),
                         fz_chance(in, 128) ? fz_tensor(in, pool, fz_dtype(in, f), 1, 1, 0, 0)
                                            : (lmloss_tensor){0}};
  lmloss_tensor out[3] = {fz_tensor(in, pool, fz_dtype(in, f), 1, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), LMLOSS_KTO_METRICS, 1, 0, 0),
                          fz_optional(in, pool, fz_dtype(in, f), N, 1, 0, 0)};
  lmloss_tensor r[3];
  fz_outs wc = {0}, wr = {0};
  for (int k = 0; k < 3; k++) {
    r[k] = fz_clone(pool, &out[k]);
    fz_watch(&wc, pool, &out[k]), fz_watch(&wr, pool, &r[k]);
  }
  const lmloss_kto_outputs oc = {out[0], out[1], out[2]}, orf = {r[0], r[1], r[2]};
  const lmloss_status sc = lmloss_kto(cpu, &x, &o, &oc), sr = lmloss_kto(ref, &x, &o, &orf);
  fz_check(sc, &wc, "kto on CPU");
  fz_check(sr, &wr, "kto on REF");
  fz_agree(sc, sr, "kto");
  for (int k = 0; sc == LMLOSS_OK && sr == LMLOSS_OK && k < 3; k++)
    same_bits(&out[k], &r[k], "kto");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_in in = {data, size, size};
  fz_pool pool = {0};
  lmloss_context cpu = fz_context(&in, LMLOSS_BACKEND_CPU), ref = cpu;
  ref.backend = LMLOSS_BACKEND_REF;
  switch (fz_range(&in, 0, 2)) {
  case 0: grpo(&in, &pool, &cpu, &ref); break;
  case 1: preference(&in, &pool, &cpu, &ref); break;
  default: kto(&in, &pool, &cpu, &ref); break;
  }
  fz_release(&pool);
  return 0;
}
