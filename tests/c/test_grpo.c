/*
 * test_grpo.c - the GRPO family (lmloss_grpo) of the backend under test
 * against REF: every loss type at both levels with the KL and its bias
 * correction, delta, the off-policy and entropy masks, the entropy bonus,
 * IS ratios per token and per sequence, given or formed in each of vLLM's
 * modes, advantages per token; the loss,
 * the metrics and both gradients, the backward from dloss, thread counts
 * (bitwise), closed forms where fp32 would lose them (a ratio of log-probs
 * near -1000, k3 of a difference of 1e-6, the float form of CUDA's one
 * pass there), and bad arguments. TRL itself
 * is the oracle of tests/python/test_grpo.py; here REF, the same formulas
 * in their sequential order, is the CPU threads' and CUDA's.
 */
#include "math/grpo.h"
#include "support/testing.h"

enum { IN_LOGP, IN_MASK, IN_ADV, IN_OLD, IN_REF, IN_SAMP, IN_IS, IN_ENT, IN_THR, IN_ITEMS, NIN };

typedef struct {
  lmloss_tensor t[NIN];
} host_in;

static lmloss_grpo_inputs as_inputs(const lmloss_tensor *t) {
  lmloss_grpo_inputs in = {t[IN_LOGP], t[IN_MASK], t[IN_ADV], t[IN_OLD], t[IN_REF],
                           t[IN_SAMP], t[IN_IS],   t[IN_ENT], t[IN_THR], t[IN_ITEMS]};
  return in;
}

/* Random inputs: log-probs in (-3, 0) (shift: added), old ones around
 * them, padded tails and an empty sequence; flags pick the optional ones
 * (1 old, 2 ref, 4 sampling, 8 IS per token, 16 IS per sequence, 32
 * entropy and threshold, 64 advantages per token, 128 num_items; 256,
 * read by the caller: vLLM's ratio formed from sampling_logp). */
static host_in make_in(int64_t B, int64_t T, unsigned flags, double shift) {
  host_in h;
  memset(&h, 0, sizeof h);
  const lmloss_dtype f = LMLOSS_F32;
  for (int k = 0; k < NIN; k++)
    h.t[k].dtype = f;
  h.t[IN_LOGP] = host_new(f, B, T, T);
  h.t[IN_MASK] = host_new(f, B, T, T);
  h.t[IN_ADV] = host_new(f, B, flags & 64 ? T : 1, flags & 64 ? T : 1);
  if (flags & 1) h.t[IN_OLD] = host_new(f, B, T, T);
  if (flags & 2) h.t[IN_REF] = host_new(f, B, T, T);
  if (flags & 4) h.t[IN_SAMP] = host_new(f, B, T, T);
  if (flags & 8) h.t[IN_IS] = host_new(f, B, T, T);
  if (flags & 16) h.t[IN_IS] = host_new(f, B, 1, 1);
  if (flags & 32) h.t[IN_ENT] = host_new(f, B, T, T), h.t[IN_THR] = host_new(f, 1, 1, 1);
  if (flags & 128) h.t[IN_ITEMS] = host_new(f, 1, 1, 1);
  for (int64_t b = 0; b < B; b++) {
    const int64_t len = b == 2 ? 0 : T - rng_int(T / 2 + 1);
    for (int64_t t = 0; t < T; t++) {
      const double lp = -0.05 - 2.95 * rng_uniform() + shift;
      tset(&h.t[IN_LOGP], b, t, lp);
      tset(&h.t[IN_MASK], b, t, t < len);
      if (flags & 64 || t == 0) tset(&h.t[IN_ADV], b, t, rng_normal());
      if (flags & 1) tset(&h.t[IN_OLD], b, t, lp + 0.25 * rng_normal());
      if (flags & 2) tset(&h.t[IN_REF], b, t, lp + 0.5 * rng_normal());
      if (flags & 4) tset(&h.t[IN_SAMP], b, t, lp + 0.2 * rng_normal());
      if (flags & 8 || (flags & 16 && t == 0)) tset(&h.t[IN_IS], b, t, 0.5 + rng_uniform());
      if (flags & 32) tset(&h.t[IN_ENT], b, t, 3.0 * rng_uniform());
    }
  }
  if (flags & 32) tset(&h.t[IN_THR], 0, 0, 1.2);
  if (flags & 128) tset(&h.t[IN_ITEMS], 0, 0, 17.5);
  return h;
}

static void free_in(host_in *h) {
  for (int k = 0; k < NIN; k++)
    if (h->t[k].data) host_free(&h->t[k]);
}

typedef struct {
  lmloss_tensor loss, metrics, dlogp, dentropy;
} host_out;

/* One call on the backend under test (dev) or REF; dloss > 0: the
 * backward at that upstream instead (loss and metrics untouched). */
static lmloss_status run(int dev, const host_in *h, const lmloss_grpo_options *o, host_out *r,
                         double dloss, int threads) {
  const int64_t B = h->t[IN_LOGP].rows, T = h->t[IN_LOGP].cols;
  const int ent = h->t[IN_ENT].data != NULL;
  r->loss = host_new(LMLOSS_F32, 1, 1, 1);
  r->metrics = host_new(LMLOSS_F32, LMLOSS_GRPO_METRICS, 1, 1);
  r->dlogp = host_new(LMLOSS_F32, B, T, T);
  r->dentropy = ent ? host_new(LMLOSS_F32, B, T, T) : (lmloss_tensor){0};
  lmloss_tensor t[NIN], lo = r->loss, me = r->metrics, dl = r->dlogp, de = r->dentropy,
                        dls = host_new(LMLOSS_F32, 1, 1, 1);
  tset(&dls, 0, 0, dloss);
  for (int k = 0; k < NIN; k++)
    t[k] = dev ? dev_clone(&h->t[k]) : h->t[k];
  lmloss_tensor dd = dls;
  if (dev) lo = dev_clone(&lo), me = dev_clone(&me), dl = dev_clone(&dl), dd = dev_clone(&dls);
  if (dev && ent) de = dev_clone(&de);
  const size_t wsb = lmloss_grpo_workspace_size(B);
  void *ws = dev ? dev_alloc_bytes(wsb) : malloc(wsb);
  lmloss_context c = dev ? tb_ctx() : ref_ctx();
  c.num_threads = threads;
  lmloss_grpo_inputs in = as_inputs(t);
  lmloss_status s;
  if (dloss > 0) {
    s = lmloss_grpo_backward(&c, &in, o, &dd, &dl, &de, ws, wsb);
  } else {
    lmloss_grpo_outputs out = {lo, me, dl, de};
    s = lmloss_grpo(&c, &in, o, &out, ws, wsb);
  }
  if (dev) {
    dev_fetch(&r->loss, &lo), dev_fetch(&r->metrics, &me), dev_fetch(&r->dlogp, &dl);
    if (ent) dev_fetch(&r->dentropy, &de), dev_free(&de);
    dev_free(&lo), dev_free(&me), dev_free(&dl), dev_free(&dd), dev_free_bytes(ws);
    for (int k = 0; k < NIN; k++)
      dev_free(&t[k]);
  } else {
    free(ws);
  }
  host_free(&dls);
  return s;
}

static void free_out(host_out *r) {
  host_free(&r->loss), host_free(&r->metrics), host_free(&r->dlogp);
  if (r->dentropy.data) host_free(&r->dentropy);
}

/* Every output of got against ref (scale: got's upstream over ref's). */
static void compare(tgroup *g, const host_out *got, const host_out *ref, int fwd, double scale) {
  const int64_t B = ref->dlogp.rows, T = ref->dlogp.cols;
  if (fwd) {
    tg_close(g, tget(&got->loss, 0, 0), tget(&ref->loss, 0, 0), LMLOSS_F32, 0, "loss", 0, 0);
    for (int k = 0; k < LMLOSS_GRPO_METRICS; k++)
      tg_close(g, tget(&got->metrics, k, 0), tget(&ref->metrics, k, 0), LMLOSS_F32, 0, "metrics", k,
               0);
  }
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++) {
      tg_close(g, tget(&got->dlogp, b, t), scale * tget(&ref->dlogp, b, t), LMLOSS_F32, 0, "dlogp",
               b, t);
      if (ref->dentropy.data)
        tg_close(g, tget(&got->dentropy, b, t), scale * tget(&ref->dentropy, b, t), LMLOSS_F32, 0,
                 "dentropy", b, t);
    }
}

static void every_option(void) {
  tgroup g;
  tg_begin(&g, "every loss type, level and option against REF, forward and backward");
  static const unsigned flags[] = {
      0,          1,      1 | 2,      1 | 4,   1 | 8,
      1 | 16,     1 | 32, 1 | 2 | 64, 1 | 128, 1 | 2 | 4 | 8 | 32 | 128,
      1 | 4 | 256};
  for (int type = LMLOSS_GRPO_GRPO; type <= LMLOSS_GRPO_VESPO; type++)
    for (int level = 0; level < 2; level++)
      for (int f = 0; f < (int)(sizeof flags / sizeof *flags); f++) {
        rng_seed(100 * type + 10 * level + f);
        const int64_t B = 3 + f % 3, T = f == 9 ? 700 : 5 + 3 * f;
        host_in h = make_in(B, T, flags[f], 0.0);
        lmloss_grpo_options o = lmloss_grpo_options_default();
        o.loss_type = (lmloss_grpo_loss_type)type;
        o.level = (lmloss_grpo_level)level;
        if (flags[f] & 2) o.beta = 0.04, o.bias_correction_kl = f % 2;
        if (flags[f] & 4) o.off_policy_mask = 1, o.off_policy_threshold = 0.01;
        if (flags[f] & 32) o.entropy_coef = 0.02;
        if (f == 9) o.delta = 1.2, o.epsilon_high = 0.28;
        if (flags[f] & 256) { /* vLLM's ratio formed in the call, each mode */
          o.is_mode = (lmloss_grpo_is_mode)(1 + (type + level) % 4);
          if (type == LMLOSS_GRPO_VESPO) o.is_mode = (lmloss_grpo_is_mode)(1 + level);
          o.is_min = 0.8, o.is_max = 1.25;
        }
        o.accumulation_steps = 1 + f % 3;
        o.max_completion_length = f % 2 ? 0 : 40;
        o.num_items = 11.0;
        host_out got, ref, bwd;
        tg_true(&g, run(1, &h, &o, &got, 0, 0) == LMLOSS_OK, "call: %s", lmloss_last_error());
        tg_true(&g, run(0, &h, &o, &ref, 0, 0) == LMLOSS_OK, "REF: %s", lmloss_last_error());
        compare(&g, &got, &ref, 1, 1.0);
        tg_true(&g, run(1, &h, &o, &bwd, 0.75, 0) == LMLOSS_OK, "backward: %s",
                lmloss_last_error());
        compare(&g, &bwd, &ref, 0, 0.75);
        free_out(&got), free_out(&ref), free_out(&bwd), free_in(&h);
      }
  tg_end(&g);
}

static void threads_bitwise(void) {
  tgroup g;
  tg_begin(&g, "CPU: the same bits for 1, 2 and 3 threads");
  rng_seed(7);
  host_in h = make_in(41, 333, 1 | 2 | 4 | 32, 0.0);
  lmloss_grpo_options o = lmloss_grpo_options_default();
  o.loss_type = LMLOSS_GRPO_BNPO, o.level = LMLOSS_GRPO_SEQUENCE, o.beta = 0.1;
  o.off_policy_mask = 1, o.entropy_coef = 0.05;
  host_out r[3];
  for (int n = 0; n < 3; n++)
    tg_true(&g, run(1, &h, &o, &r[n], 0, n + 1) == LMLOSS_OK, "call");
  for (int n = 1; n < 3; n++)
    tg_true(&g,
            same_bytes(&r[n].loss, &r[0].loss) && same_bytes(&r[n].metrics, &r[0].metrics) &&
                same_bytes(&r[n].dlogp, &r[0].dlogp) && same_bytes(&r[n].dentropy, &r[0].dentropy),
            "threads %d differ from 1", n + 1);
  for (int n = 0; n < 3; n++)
    free_out(&r[n]);
  free_in(&h);
  tg_end(&g);
}

/* One token, B = 1: GRPO's -min(c A, clip(c) A) with c = exp(logp - old)
 * at log-probs near -1000, and k3 of d = 1e-6 (expm1(d) - d would keep
 * 1e-10 of it in double, none in fp32). */
static void closed_forms(void) {
  tgroup g;
  tg_begin(&g, "closed forms: ratio at log-probs near -1000, k3 of 1e-6");
  host_in h = make_in(1, 1, 1 | 2, 0.0);
  tset(&h.t[IN_LOGP], 0, 0, -1000.0);
  tset(&h.t[IN_OLD], 0, 0, -999.9375); /* exact in fp32: logp - old = -1/16 */
  tset(&h.t[IN_REF], 0, 0, -1000.0);
  tset(&h.t[IN_MASK], 0, 0, 1.0);
  tset(&h.t[IN_ADV], 0, 0, 1.0);
  lmloss_grpo_options o = lmloss_grpo_options_default();
  o.loss_type = LMLOSS_GRPO_GRPO;
  host_out r;
  tg_true(&g, run(1, &h, &o, &r, 0, 0) == LMLOSS_OK, "call");
  const double c = exp(-0.0625);
  tg_close(&g, tget(&r.loss, 0, 0), -c, LMLOSS_F32, 0, "loss", 0, 0);
  tg_close(&g, tget(&r.dlogp, 0, 0), -c, LMLOSS_F32, 0, "dlogp", 0, 0);
  free_out(&r);
  /* k3 alone: logp = old = -2^-10, ref = logp + d with d = 2^-19 (exact) */
  const double lp = -0.0009765625, d = 1.9073486328125e-06;
  tset(&h.t[IN_LOGP], 0, 0, lp), tset(&h.t[IN_OLD], 0, 0, lp), tset(&h.t[IN_REF], 0, 0, lp + d);
  tg_true(&g, tget(&h.t[IN_REF], 0, 0) - lp == d, "d is not exact in fp32");
  tset(&h.t[IN_ADV], 0, 0, 0.0);
  o.beta = 1.0;
  tg_true(&g, run(1, &h, &o, &r, 0, 0) == LMLOSS_OK, "call");
  const double k3 = d * d * (0.5 + d / 6.0 + d * d / 24.0);
  tg_close(&g, tget(&r.loss, 0, 0), k3, LMLOSS_F32, 0, "k3", 0, 0);
  tg_close(&g, tget(&r.dlogp, 0, 0), -expm1(d), LMLOSS_F32, 0, "dk3", 0, 0);
  tg_close(&g, tget(&r.metrics, LMLOSS_GRPO_M_KL, 0), k3, LMLOSS_F32, 0, "kl metric", 0, 0);
  free_out(&r), free_in(&h);
  /* the one pass's float form against stage C's in double, at a log-prob
   * near -1000 that fp32 cannot hold, its old and reference log-probs
   * 1e-3 from it: its differences formed first (from fp32 log-probs, c
   * and expm1(d) would be 3e-5 off) */
  lmloss_grpo_options ko = lmloss_grpo_options_default();
  ko.loss_type = LMLOSS_GRPO_DAPO, ko.beta = 0.04;
  const lmloss_grpo_par kp = lmloss_grpo_par_make(&ko, &(lmloss_grpo_inputs){.ref_logp.data = &ko});
  lmloss_grpo_in x = {1.0, -1008.123456789, 0.0, 0.0, 0.0, 0.7, 0.0, 1.0};
  x.old = (float)(x.logp + 1e-3), x.ref = (float)(x.logp - 1e-3);
  x.samp = x.old;
  const double none[LMLOSS_GRPO_S_N] = {0.0};
  int keep_e;
  const lmloss_grpo_tok c_tok = lmloss_grpo_stage_c(&kp, none, &x, 0.0, &keep_e);
  tg_close(&g, lmloss_grpo_one_pass_dlogp(&kp, &x, 0.5f), 0.5 * (c_tok.dlp + c_tok.dlw), LMLOSS_F32,
           0, "float one-pass dlogp", 0, 0);
  /* and where the KL's term and the policy's cancel (ratio 1, the
   * advantage -beta expm1(d), d = ref - logp, to fp32's rounding): the
   * sum is 1e-8 of either, all rounding in float */
  lmloss_grpo_in y = {1.0, -3.25, -3.25, -3.25, -3.75, 0.0, 0.0, 1.0};
  y.adv = (float)(-0.04 * expm1(y.ref - y.logp));
  const lmloss_grpo_tok c_y = lmloss_grpo_stage_c(&kp, none, &y, 0.0, &keep_e);
  tg_true(&g, fabs(c_y.dlp + c_y.dlw) < 1e-6 * fabs(c_y.dlp), "the terms do not cancel");
  tg_close(&g, lmloss_grpo_one_pass_dlogp(&kp, &y, 1.0f), c_y.dlp + c_y.dlw, LMLOSS_F32, 0,
           "float one-pass dlogp, cancelling", 0, 0);
  tg_end(&g);
}

/* GRPO on logits (lmloss_grpo_logits) of the backend under test against
 * its composition on REF (lmloss_log_probs, lmloss_grpo with dlogp,
 * lmloss_log_probs_backward): the log-probs it writes, the loss, the
 * metrics and dlogits, for options CUDA takes in one pass and others,
 * F32 and BF16 logits, a temperature, a softcap (CUDA's staged plan, the
 * held one's otherwise), rows peaked by a margin of 30. */
static void on_logits_case(tgroup *g, int c) {
  static const unsigned flags[] = {0, 1 | 2, 1 | 8 | 128, 1 | 4, 1 | 4 | 256, 1 | 16, 1 | 2 | 64};
  const unsigned f = flags[c % 7];
  const int64_t B = 3 + c % 2, T = 7 + c, V = c % 3 ? 1003 : 4099, N = B * T;
  const lmloss_dtype dt = c % 2 ? LMLOSS_BF16 : LMLOSS_F32;
  host_in h = make_in(B, T, f & ~32u, 0.0);
  lmloss_grpo_options o = lmloss_grpo_options_default();
  o.loss_type = (lmloss_grpo_loss_type)(c % (LMLOSS_GRPO_VESPO + 1));
  o.level = c == 9 ? LMLOSS_GRPO_SEQUENCE : LMLOSS_GRPO_TOKEN;
  if (f & 2) o.beta = 0.04, o.bias_correction_kl = c % 2;
  if (f & 4) o.off_policy_mask = c % 2, o.off_policy_threshold = 0.01;
  if (f & 256) o.is_mode = (lmloss_grpo_is_mode)(1 + c % 4), o.is_min = 0.8, o.is_max = 1.25;
  if (o.loss_type == LMLOSS_GRPO_VESPO && o.is_mode > LMLOSS_GRPO_IS_TOKEN_MASK) o.is_mode = 1;
  o.num_items = 11.0, o.accumulation_steps = 1 + c % 2;
  lmloss_transform tr = lmloss_transform_default();
  if (c % 3 == 0) tr.temperature = 0.7f;
  if (c % 3 == 2) tr.softcap = 30.0f;
  lmloss_tensor x = host_new(dt, N, V, V), idx = host_new(LMLOSS_I64, N, 1, 1);
  for (int64_t i = 0; i < N; i++) {
    const int64_t y = rng_int(V);
    tset(&idx, i, 0, (double)y);
    for (int64_t j = 0; j < V; j++)
      tset(&x, i, j, 2.0 * rng_normal());
    if (i % 3 == 0) tset(&x, i, y, 30.0 + 10.0);
  }
  /* REF's composition, on the logits as the backend reads them */
  lmloss_context rc = ref_ctx(), dc = tb_ctx();
  lmloss_grpo_inputs rin = as_inputs(h.t);
  const lmloss_tensor rlp = {rin.logp.data, LMLOSS_F32, LMLOSS_CPU, N, 1, 1};
  lmloss_tensor rloss = host_new(LMLOSS_F32, 1, 1, 1);
  lmloss_tensor rmet = host_new(LMLOSS_F32, LMLOSS_GRPO_METRICS, 1, 1);
  lmloss_tensor rdlp = host_new(LMLOSS_F32, B, T, T), rdl = host_new(LMLOSS_F32, N, V, V);
  const lmloss_tensor rdlp1 = {rdlp.data, LMLOSS_F32, LMLOSS_CPU, N, 1, 1};
  const size_t gws = lmloss_grpo_workspace_size(B);
  void *rws = malloc(gws);
  const lmloss_grpo_outputs rout = {rloss, rmet, rdlp, {0}};
  lmloss_status sr = lmloss_log_probs(&rc, &x, &idx, NULL, &tr, &rlp, NULL, NULL);
  if (sr == LMLOSS_OK) sr = lmloss_grpo(&rc, &rin, &o, &rout, rws, gws);
  if (sr == LMLOSS_OK)
    sr = lmloss_log_probs_backward(&rc, &x, &idx, NULL, &tr, &rdlp1, NULL, &rdl, NULL);
  /* the backend under test */
  lmloss_tensor t[NIN], lp = host_new(LMLOSS_F32, B, T, T), loss = host_new(LMLOSS_F32, 1, 1, 1);
  lmloss_tensor met = host_new(LMLOSS_F32, LMLOSS_GRPO_METRICS, 1, 1), dl = host_new(dt, N, V, V);
  /* stale values, which every output must overwrite */
  for (int64_t i = 0; i < N; i++) {
    tset(&lp, i / T, i % T, 7.0);
    for (int64_t j = 0; j < V; j++)
      tset(&dl, i, j, 7.0);
  }
  for (int k = 0; k < NIN; k++)
    t[k] = dev_clone(&h.t[k]);
  dev_free(&t[IN_LOGP]);
  t[IN_LOGP] = dev_clone(&lp);
  lmloss_tensor dx = dev_clone(&x), didx = dev_clone(&idx), dloss = dev_clone(&loss);
  lmloss_tensor dmet = dev_clone(&met), ddl = dev_clone(&dl);
  const size_t wsb = lmloss_grpo_logits_workspace_size(B, T);
  void *ws = dev_alloc_bytes(wsb);
  lmloss_grpo_inputs in = as_inputs(t);
  const lmloss_grpo_outputs out = {dloss, dmet, {0}, {0}};
  lmloss_status s = lmloss_grpo_logits(&dc, &dx, &didx, &tr, &in, &o, &out, &ddl, ws, wsb);
  /* CUDA's one pass reads no masked token's logits: its log-prob is 0 */
  const lmloss_grpo_par par = lmloss_grpo_par_make(&o, &rin);
  const int unread = tb_is_cuda() && lmloss_grpo_one_pass(&par);
  dev_fetch(&lp, &t[IN_LOGP]), dev_fetch(&loss, &dloss), dev_fetch(&met, &dmet);
  dev_fetch(&dl, &ddl);
  if (tg_true(g, sr == LMLOSS_OK && s == LMLOSS_OK, "case %d: ref %s, call %s (%s)", c,
              lmloss_status_string(sr), lmloss_status_string(s), lmloss_last_error())) {
    for (int64_t b = 0; b < B; b++)
      for (int64_t j = 0; j < T; j++)
        tg_close(g, tget(&lp, b, j),
                 unread && tget(&h.t[IN_MASK], b, j) == 0.0 ? 0.0 : tget(&rin.logp, b, j),
                 LMLOSS_F32, 0, "logp", b, j);
    tg_close(g, tget(&loss, 0, 0), tget(&rloss, 0, 0), LMLOSS_F32, 0, "loss", c, 0);
    for (int k = 0; k < LMLOSS_GRPO_METRICS; k++)
      tg_close(g, tget(&met, k, 0), tget(&rmet, k, 0), LMLOSS_F32, 0, "metrics", c, k);
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < V; j++)
        tg_close(g, tget(&dl, i, j), tget(&rdl, i, j), dt, 0, "dlogits", i, j);
  }
  for (int k = 0; k < NIN; k++)
    dev_free(&t[k]);
  dev_free(&dx), dev_free(&didx), dev_free(&dloss), dev_free(&dmet), dev_free(&ddl);
  dev_free_bytes(ws), free(rws);
  host_free(&x), host_free(&idx), host_free(&rloss), host_free(&rmet), host_free(&rdlp);
  host_free(&rdl), host_free(&lp), host_free(&loss), host_free(&met), host_free(&dl);
  free_in(&h);
}

static void on_logits(void) {
  tgroup g;
  tg_begin(&g, "GRPO on logits against its composition on REF");
  for (int c = 0; c < 14; c++) {
    rng_seed(900 + c);
    on_logits_case(&g, c);
  }
  tg_end(&g);
}

static void bad_arguments(void) {
  tgroup g;
  tg_begin(&g, "bad arguments: a status and a message");
  host_in h = make_in(3, 4, 1 | 32, 0.0);
  lmloss_grpo_inputs in = as_inputs(h.t);
  lmloss_tensor loss = host_new(LMLOSS_F32, 1, 1, 1), dl = host_new(LMLOSS_F32, 3, 4, 4);
  lmloss_grpo_outputs out = {loss, {0}, {0}, {0}};
  size_t wsb = lmloss_grpo_workspace_size(3);
  void *ws = malloc(wsb);
  lmloss_context c = ref_ctx();
  lmloss_grpo_options o = lmloss_grpo_options_default();
#define EXPECT(call, st)                                                                           \
  do {                                                                                             \
    lmloss_status s_ = (call);                                                                     \
    tg_true(&g, s_ == (st) && lmloss_last_error()[0], "%s: got %s (%s)", #call,                    \
            lmloss_status_string(s_), lmloss_last_error());                                        \
  } while (0)
  EXPECT(lmloss_grpo(&c, NULL, &o, &out, ws, wsb), LMLOSS_ERR_NULL_POINTER);
  EXPECT(lmloss_grpo(&c, &in, &o, NULL, ws, wsb), LMLOSS_ERR_NULL_POINTER);
  EXPECT(lmloss_grpo(&c, &in, &o, &out, NULL, wsb), LMLOSS_ERR_NULL_POINTER);
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb - 1), LMLOSS_ERR_WORKSPACE_TOO_SMALL);
  o.loss_type = (lmloss_grpo_loss_type)8;
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default(), o.level = (lmloss_grpo_level)2;
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default(), o.epsilon_low = NAN;
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default(), o.beta = 0.1; /* no ref_logp */
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default(), o.num_items = 0;
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default(), o.sapo_temperature_neg = 0;
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default(), o.is_mode = (lmloss_grpo_is_mode)5;
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default(), o.is_mode = LMLOSS_GRPO_IS_TOKEN_MASK; /* no sampling_logp */
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default(), o.is_max = NAN;
  EXPECT(lmloss_grpo(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default();
  lmloss_grpo_inputs bad = in;
  bad.advantages.cols = 2, bad.advantages.row_stride = 2;
  EXPECT(lmloss_grpo(&c, &bad, &o, &out, ws, wsb), LMLOSS_ERR_BAD_SHAPE);
  bad = in, bad.mask.dtype = LMLOSS_BF16;
  EXPECT(lmloss_grpo(&c, &bad, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DTYPE);
  bad = in, bad.logp.rows = 0;
  EXPECT(lmloss_grpo(&c, &bad, &o, &out, ws, wsb), LMLOSS_ERR_BAD_SHAPE);
  bad = in, bad.entropy = (lmloss_tensor){0};
  o.entropy_coef = 0.1;
  EXPECT(lmloss_grpo(&c, &bad, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default();
  bad = in, bad.old_logp.device = LMLOSS_CUDA;
  EXPECT(lmloss_grpo(&c, &bad, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DEVICE);
  EXPECT(lmloss_grpo_backward(&c, &in, &o, &loss, NULL, NULL, ws, wsb), LMLOSS_ERR_NULL_POINTER);
  lmloss_tensor wrong = dl;
  wrong.rows = 2;
  EXPECT(lmloss_grpo_backward(&c, &in, &o, &loss, &wrong, NULL, ws, wsb), LMLOSS_ERR_BAD_SHAPE);
  /* GRPO on logits [12, 5] of 3 x 4 tokens */
  lmloss_tensor x = host_new(LMLOSS_F32, 12, 5, 5), idx = host_new(LMLOSS_I64, 12, 1, 1);
  const lmloss_transform tr = lmloss_transform_default();
  const size_t lwsb = lmloss_grpo_logits_workspace_size(3, 4);
  void *lws = calloc(1, lwsb);
  o = lmloss_grpo_options_default();
  EXPECT(lmloss_grpo_logits(&c, &x, NULL, &tr, &in, &o, &out, NULL, lws, lwsb),
         LMLOSS_ERR_NULL_POINTER);
  EXPECT(lmloss_grpo_logits(&c, &x, &idx, &tr, &in, &o, &out, NULL, lws, lwsb - 1),
         LMLOSS_ERR_WORKSPACE_TOO_SMALL);
  lmloss_tensor x9 = x;
  x9.rows = 9;
  EXPECT(lmloss_grpo_logits(&c, &x9, &idx, &tr, &in, &o, &out, NULL, lws, lwsb),
         LMLOSS_ERR_BAD_SHAPE);
  bad = in, bad.logp.row_stride = 5, bad.logp.data = malloc(3 * 5 * 4);
  EXPECT(lmloss_grpo_logits(&c, &x, &idx, &tr, &bad, &o, &out, NULL, lws, lwsb),
         LMLOSS_ERR_BAD_STRIDE);
  free(bad.logp.data);
  lmloss_grpo_outputs with_dlogp = out;
  with_dlogp.dlogp = dl;
  EXPECT(lmloss_grpo_logits(&c, &x, &idx, &tr, &in, &o, &with_dlogp, NULL, lws, lwsb),
         LMLOSS_ERR_BAD_SHAPE);
  o.entropy_coef = 0.1;
  EXPECT(lmloss_grpo_logits(&c, &x, &idx, &tr, &in, &o, &out, NULL, lws, lwsb),
         LMLOSS_ERR_BAD_OPTION);
  o = lmloss_grpo_options_default();
  tset(&idx, 3, 0, 5.0); /* outside [0, V) */
  EXPECT(lmloss_grpo_logits(&c, &x, &idx, &tr, &in, &o, &out, NULL, lws, lwsb),
         LMLOSS_ERR_INDEX_OUT_OF_RANGE);
  free(lws), host_free(&x), host_free(&idx);
#undef EXPECT
  free(ws), host_free(&loss), host_free(&dl), free_in(&h);
  tg_end(&g);
}

int main(void) {
  tb_init();
  every_option();
  closed_forms();
  on_logits();
  if (!tb_is_cuda()) threads_bitwise(), bad_arguments();
  return test_finish();
}
