/*
 * test_preference.c - the DPO family (lmloss_preference) of the backend
 * under test against REF: every loss type alone and combined, each
 * f-divergence, label smoothing, pair weights, AOT's sorted terms with
 * ties; loss, metrics and both gradients, the backward from dloss; closed
 * forms at margins of 70 and 80 nats (1 - sigmoid of 1e-35, where fp32's
 * difference reads 0 beyond 17); bad arguments. TRL itself is the oracle of
 * tests/python/test_dpo.py.
 */
#include "support/testing.h"

enum { C, R, RC, RR, NC, NR, W, NIN };

typedef struct {
  lmloss_tensor t[NIN];
} host_in;

static lmloss_pref_inputs as_inputs(const lmloss_tensor *t) {
  lmloss_pref_inputs in = {t[C], t[R], t[RC], t[RR], t[NC], t[NR], t[W]};
  return in;
}

/* P pairs of sums around -20 (margins of a few nats, and a tie of the
 * policy margins every fifth pair); weights where asked. */
static host_in make_in(int64_t P, int weights) {
  host_in h;
  memset(&h, 0, sizeof h);
  for (int k = 0; k < NIN; k++)
    if (k != W || weights) h.t[k] = host_new(LMLOSS_F32, P, 1, 1);
  for (int64_t i = 0; i < P; i++) {
    const double c = -20.0 + 4.0 * rng_normal(),
                 r = i % 5 == 4 ? c - 1.0 : -22.0 + 4.0 * rng_normal();
    tset(&h.t[C], i, 0, i % 5 == 4 ? -10.0 : c);
    tset(&h.t[R], i, 0, i % 5 == 4 ? -11.0 : r);
    tset(&h.t[RC], i, 0, c + rng_normal());
    tset(&h.t[RR], i, 0, r + rng_normal());
    tset(&h.t[NC], i, 0, 1 + rng_int(30));
    tset(&h.t[NR], i, 0, 1 + rng_int(30));
    if (weights) tset(&h.t[W], i, 0, 0.5 + rng_uniform());
  }
  return h;
}

static void free_in(host_in *h) {
  for (int k = 0; k < NIN; k++)
    if (h->t[k].data) host_free(&h->t[k]);
}

typedef struct {
  lmloss_tensor loss, metrics, dc, dr;
} host_out;

static lmloss_status run(int dev, const host_in *h, const lmloss_pref_options *o, host_out *r,
                         double dloss) {
  const int64_t P = h->t[C].rows;
  r->loss = host_new(LMLOSS_F32, 1, 1, 1);
  r->metrics = host_new(LMLOSS_F32, LMLOSS_PREF_METRICS, 1, 1);
  r->dc = host_new(LMLOSS_F32, P, 1, 1);
  r->dr = host_new(LMLOSS_F32, P, 1, 1);
  lmloss_tensor t[NIN], lo = r->loss, me = r->metrics, dc = r->dc, dr = r->dr,
                        dls = host_new(LMLOSS_F32, 1, 1, 1);
  tset(&dls, 0, 0, dloss);
  for (int k = 0; k < NIN; k++)
    t[k] = dev ? dev_clone(&h->t[k]) : h->t[k];
  lmloss_tensor dd = dls;
  if (dev) lo = dev_clone(&lo), me = dev_clone(&me), dc = dev_clone(&dc), dr = dev_clone(&dr);
  if (dev) dd = dev_clone(&dls);
  const size_t wsb = lmloss_preference_workspace_size(P);
  void *ws = dev ? dev_alloc_bytes(wsb) : malloc(wsb);
  lmloss_context c = dev ? tb_ctx() : ref_ctx();
  lmloss_pref_inputs in = as_inputs(t);
  lmloss_status s;
  if (dloss > 0) {
    s = lmloss_preference_backward(&c, &in, o, &dd, &dc, &dr, ws, wsb);
  } else {
    lmloss_pref_outputs out = {lo, me, dc, dr};
    s = lmloss_preference(&c, &in, o, &out, ws, wsb);
  }
  if (dev) {
    dev_fetch(&r->loss, &lo), dev_fetch(&r->metrics, &me), dev_fetch(&r->dc, &dc);
    dev_fetch(&r->dr, &dr);
    dev_free(&lo), dev_free(&me), dev_free(&dc), dev_free(&dr), dev_free(&dd);
    dev_free_bytes(ws);
    for (int k = 0; k < NIN; k++)
      dev_free(&t[k]);
  } else {
    free(ws);
  }
  host_free(&dls);
  return s;
}

static void free_out(host_out *r) {
  host_free(&r->loss), host_free(&r->metrics), host_free(&r->dc), host_free(&r->dr);
}

static void compare(tgroup *g, const host_out *got, const host_out *ref, int fwd, double scale) {
  if (fwd) {
    tg_close(g, tget(&got->loss, 0, 0), tget(&ref->loss, 0, 0), LMLOSS_F32, 0, "loss", 0, 0);
    for (int k = 0; k < LMLOSS_PREF_METRICS; k++)
      tg_close(g, tget(&got->metrics, k, 0), tget(&ref->metrics, k, 0), LMLOSS_F32, 0, "metrics", k,
               0);
  }
  for (int64_t i = 0; i < ref->dc.rows; i++) {
    tg_close(g, tget(&got->dc, i, 0), scale * tget(&ref->dc, i, 0), LMLOSS_F32, 0, "dc", i, 0);
    tg_close(g, tget(&got->dr, i, 0), scale * tget(&ref->dr, i, 0), LMLOSS_F32, 0, "dr", i, 0);
  }
}

static void every_type(void) {
  tgroup g;
  tg_begin(&g, "every loss type, f-divergence and combination against REF");
  for (int k = 0; k <= LMLOSS_PREF_TYPES; k++)
    for (int f = 0; f < 5; f++) {
      if (f && k != LMLOSS_PREF_SIGMOID && k != LMLOSS_PREF_IPO && k != LMLOSS_PREF_DISCOPOP &&
          k != LMLOSS_PREF_TYPES && k != LMLOSS_PREF_CPO_SIGMOID)
        continue;
      rng_seed(10 * k + f);
      const int aot = k == LMLOSS_PREF_AOT || k == LMLOSS_PREF_AOT_UNPAIRED;
      const int64_t P = k == LMLOSS_PREF_TYPES ? 700 : 3 + 7 * f + k;
      host_in h = make_in(P, !aot && k % 2);
      lmloss_pref_options o = lmloss_pref_options_default();
      o.loss_weights[LMLOSS_PREF_SIGMOID] = 0.0;
      if (k < LMLOSS_PREF_TYPES) {
        o.loss_weights[k] = 1.0;
      } else { /* all at once, but the ones weights exclude */
        for (int j = 0; j < LMLOSS_PREF_TYPES; j++)
          o.loss_weights[j] = 0.1 * (j + 1);
        free_in(&h), h = make_in(P, 0);
      }
      o.label_smoothing = 0.1, o.beta = 0.2, o.discopop_tau = 0.3;
      o.f_divergence = (lmloss_pref_fdiv)f, o.f_alpha = 0.3;
      host_out got, ref, bwd;
      tg_true(&g, run(1, &h, &o, &got, 0) == LMLOSS_OK, "call: %s", lmloss_last_error());
      tg_true(&g, run(0, &h, &o, &ref, 0) == LMLOSS_OK, "REF: %s", lmloss_last_error());
      compare(&g, &got, &ref, 1, 1.0);
      tg_true(&g, run(1, &h, &o, &bwd, 1.5) == LMLOSS_OK, "backward");
      compare(&g, &bwd, &ref, 0, 1.5);
      free_out(&got), free_out(&ref), free_out(&bwd), free_in(&h);
    }
  tg_end(&g);
}

/* One pair at a margin of beta (lc - lr) = 80: SIGMOID's loss log1p(e^-80)
 * and gradient -beta sigmoid(-80); APO_ZERO's 1 - sigmoid(beta lc). */
static void large_margin(void) {
  tgroup g;
  tg_begin(&g, "closed forms at margins of 70 and 80 nats");
  host_in h = make_in(1, 0);
  tset(&h.t[C], 0, 0, -10.0), tset(&h.t[R], 0, 0, -90.0);
  tset(&h.t[RC], 0, 0, -10.0), tset(&h.t[RR], 0, 0, -10.0);
  lmloss_pref_options o = lmloss_pref_options_default();
  o.beta = 1.0;
  host_out r;
  tg_true(&g, run(1, &h, &o, &r, 0) == LMLOSS_OK, "call");
  tg_close(&g, tget(&r.loss, 0, 0), log1p(exp(-80.0)), LMLOSS_F32, 0, "sigmoid loss", 0, 0);
  tg_close(&g, tget(&r.dc, 0, 0), -1.0 / (1.0 + exp(80.0)), LMLOSS_F32, 0, "sigmoid dc", 0, 0);
  free_out(&r);
  o.loss_weights[LMLOSS_PREF_SIGMOID] = 0.0, o.loss_weights[LMLOSS_PREF_APO_ZERO] = 1.0;
  tset(&h.t[C], 0, 0, 70.0), tset(&h.t[R], 0, 0, -80.0);
  tg_true(&g, run(1, &h, &o, &r, 0) == LMLOSS_OK, "call");
  tg_close(&g, tget(&r.loss, 0, 0), 1.0 / (1.0 + exp(80.0)) + 1.0 / (1.0 + exp(70.0)), LMLOSS_F32,
           0, "apo_zero loss", 0, 0);
  free_out(&r), free_in(&h);
  tg_end(&g);
}

static void bad_arguments(void) {
  tgroup g;
  tg_begin(&g, "bad arguments: a status and a message");
  host_in h = make_in(3, 1);
  lmloss_pref_inputs in = as_inputs(h.t);
  lmloss_tensor loss = host_new(LMLOSS_F32, 1, 1, 1);
  lmloss_pref_outputs out = {loss, {0}, {0}, {0}};
  size_t wsb = lmloss_preference_workspace_size(3);
  void *ws = malloc(wsb);
  lmloss_context c = ref_ctx();
  lmloss_pref_options o = lmloss_pref_options_default();
#define EXPECT(call, st)                                                                           \
  do {                                                                                             \
    lmloss_status s_ = (call);                                                                     \
    tg_true(&g, s_ == (st) && lmloss_last_error()[0], "%s: got %s (%s)", #call,                    \
            lmloss_status_string(s_), lmloss_last_error());                                        \
  } while (0)
  EXPECT(lmloss_preference(&c, NULL, &o, &out, ws, wsb), LMLOSS_ERR_NULL_POINTER);
  EXPECT(lmloss_preference(&c, &in, &o, &out, ws, wsb - 1), LMLOSS_ERR_WORKSPACE_TOO_SMALL);
  o.beta = 0.0;
  EXPECT(lmloss_preference(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_pref_options_default(), o.loss_weights[3] = NAN;
  EXPECT(lmloss_preference(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_pref_options_default(), o.f_divergence = (lmloss_pref_fdiv)5;
  EXPECT(lmloss_preference(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_pref_options_default(), o.loss_weights[LMLOSS_PREF_AOT] = 1.0; /* with weights */
  EXPECT(lmloss_preference(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_pref_options_default(), o.loss_weights[LMLOSS_PREF_ROBUST] = 1.0;
  o.label_smoothing = 0.5;
  EXPECT(lmloss_preference(&c, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_pref_options_default();
  lmloss_pref_inputs bad = in;
  bad.chosen_tokens = (lmloss_tensor){0};
  o.loss_weights[LMLOSS_PREF_IPO] = 1.0;
  EXPECT(lmloss_preference(&c, &bad, &o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION);
  o = lmloss_pref_options_default();
  bad = in, bad.rejected.rows = 2;
  EXPECT(lmloss_preference(&c, &bad, &o, &out, ws, wsb), LMLOSS_ERR_BAD_SHAPE);
  bad = in, bad.ref_chosen.dtype = LMLOSS_F16;
  EXPECT(lmloss_preference(&c, &bad, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DTYPE);
  EXPECT(lmloss_preference_backward(&c, &in, &o, &loss, NULL, NULL, ws, wsb),
         LMLOSS_ERR_NULL_POINTER);
#undef EXPECT
  free(ws), host_free(&loss), free_in(&h);
  tg_end(&g);
}

/* KTO on the backend under test against REF (both types, labels mixed,
 * a NaN completion skipped by the mean), its backward, and one desirable
 * completion at beta (lr - kl) = 80: 1 - sigmoid(80) = e^-80 / (1 + e^-80). */
static void kto(void) {
  tgroup g;
  tg_begin(&g, "KTO against REF, backward, a margin of 80 nats");
  for (int type = 0; type < 2; type++) {
    rng_seed(70 + type);
    const int64_t N = 333;
    lmloss_tensor lp = host_new(LMLOSS_F32, N, 1, 1), ref = host_new(LMLOSS_F32, N, 1, 1),
                  lab = host_new(LMLOSS_BOOL, N, 1, 1), kl = host_new(LMLOSS_F32, 1, 1, 1);
    for (int64_t i = 0; i < N; i++) {
      tset(&lp, i, 0, -20.0 + 4.0 * rng_normal());
      tset(&ref, i, 0, tget(&lp, i, 0) + rng_normal());
      tset(&lab, i, 0, rng_uniform() < 0.4);
    }
    tset(&lp, 5, 0, NAN);
    tset(&kl, 0, 0, 0.3);
    lmloss_kto_options o = lmloss_kto_options_default();
    o.loss_type = (lmloss_kto_type)type, o.beta = 0.2, o.desirable_weight = 1.3;
    lmloss_tensor r[2][3];
    for (int dev = 0; dev < 2; dev++) {
      lmloss_tensor in4[4] = {lp, ref, lab, kl};
      for (int k = 0; dev && k < 4; k++)
        in4[k] = dev_clone(&in4[k]);
      lmloss_kto_inputs in = {in4[0], in4[1], in4[2], in4[3]};
      r[dev][0] = host_new(LMLOSS_F32, 1, 1, 1);
      r[dev][1] = host_new(LMLOSS_F32, LMLOSS_KTO_METRICS, 1, 1);
      r[dev][2] = host_new(LMLOSS_F32, N, 1, 1);
      lmloss_tensor o3[3] = {r[dev][0], r[dev][1], r[dev][2]};
      for (int k = 0; dev && k < 3; k++)
        o3[k] = dev_clone(&o3[k]);
      lmloss_kto_outputs out = {o3[0], o3[1], o3[2]};
      lmloss_context c = dev ? tb_ctx() : ref_ctx();
      tg_true(&g, lmloss_kto(&c, &in, &o, &out) == LMLOSS_OK, "call: %s", lmloss_last_error());
      if (dev) {
        lmloss_tensor dl = host_new(LMLOSS_F32, 1, 1, 1), d = host_new(LMLOSS_F32, N, 1, 1);
        tset(&dl, 0, 0, 0.5);
        lmloss_tensor ddl = dev_clone(&dl), dd = dev_clone(&d);
        tg_true(&g, lmloss_kto_backward(&c, &in, &o, &ddl, &dd) == LMLOSS_OK, "backward");
        dev_fetch(&d, &dd);
        for (int64_t i = 0; i < N; i++)
          tg_close(&g, tget(&d, i, 0), 0.5 * tget(&r[0][2], i, 0), LMLOSS_F32, 0, "bwd", i, 0);
        for (int k = 0; k < 3; k++)
          dev_fetch(&r[dev][k], &o3[k]), dev_free(&o3[k]);
        for (int k = 0; k < 4; k++)
          dev_free(&in4[k]);
        dev_free(&ddl), dev_free(&dd), host_free(&dl), host_free(&d);
      }
    }
    tg_close(&g, tget(&r[1][0], 0, 0), tget(&r[0][0], 0, 0), LMLOSS_F32, 0, "loss", 0, 0);
    for (int k = 0; k < LMLOSS_KTO_METRICS; k++)
      tg_close(&g, tget(&r[1][1], k, 0), tget(&r[0][1], k, 0), LMLOSS_F32, 0, "metrics", k, 0);
    for (int64_t i = 0; i < N; i++)
      tg_close(&g, tget(&r[1][2], i, 0), tget(&r[0][2], i, 0), LMLOSS_F32, 0, "dlogps", i, 0);
    tg_true(&g, tget(&r[0][2], 5, 0) == 0.0, "a NaN completion's gradient is 0");
    for (int dev = 0; dev < 2; dev++)
      for (int k = 0; k < 3; k++)
        host_free(&r[dev][k]);
    host_free(&lp), host_free(&ref), host_free(&lab), host_free(&kl);
  }
  lmloss_tensor lp = host_new(LMLOSS_F32, 1, 1, 1), lab = host_new(LMLOSS_BOOL, 1, 1, 1),
                loss = host_new(LMLOSS_F32, 1, 1, 1);
  tset(&lp, 0, 0, 80.0), tset(&lab, 0, 0, 1);
  lmloss_kto_inputs in = {lp, {0}, lab, {0}};
  lmloss_kto_outputs out = {loss, {0}, {0}};
  lmloss_kto_options o = lmloss_kto_options_default();
  o.beta = 1.0;
  lmloss_context c = ref_ctx();
  tg_true(&g, lmloss_kto(&c, &in, &o, &out) == LMLOSS_OK, "call");
  tg_close(&g, tget(&loss, 0, 0), 1.0 / (1.0 + exp(80.0)), LMLOSS_F32, 0, "kto e^-80", 0, 0);
  o.beta = 0.0;
  tg_true(&g, lmloss_kto(&c, &in, &o, &out) == LMLOSS_ERR_BAD_OPTION, "beta 0 refused");
  o = lmloss_kto_options_default(), o.loss_type = (lmloss_kto_type)2;
  tg_true(&g, lmloss_kto(&c, &in, &o, &out) == LMLOSS_ERR_BAD_OPTION, "unknown type refused");
  lmloss_kto_inputs bad = in;
  bad.label.dtype = LMLOSS_F32;
  o = lmloss_kto_options_default();
  tg_true(&g, lmloss_kto(&c, &bad, &o, &out) == LMLOSS_ERR_BAD_DTYPE, "a float label refused");
  host_free(&lp), host_free(&lab), host_free(&loss);
  tg_end(&g);
}

int main(void) {
  tb_init();
  every_type();
  large_margin();
  kto();
  if (!tb_is_cuda()) bad_arguments();
  return test_finish();
}
