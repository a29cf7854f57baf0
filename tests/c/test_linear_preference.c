/*
 * test_linear_preference.c - the DPO family through the fused head
 * (lmloss_linear_preference) of the backend under test against a float64
 * oracle built from REF's parts: the logits in double (support/head.h),
 * REF's log-probs of them, the sequences' sums in double, REF's
 * preference op (loss, metrics, each pair's terms, the gradients in the
 * sums), and the head's gradients formed in double from REF's log-probs
 * backward at each token's upstream (its sequence's gradient). Tolerances
 * are test_fused_linear.c's: FL_TOL per row and per tensor (F32 heads),
 * BF16_FACTOR times the bf16 rounding of the exact gradient (BF16 heads);
 * the loss, metrics and sums within FL_TOL of the sums' magnitude, which
 * the objective differentiates. Every budget that fits gives the same
 * results, down to the least one (groups of one pair); a type that couples
 * pairs is refused there and runs where all pairs fit.
 */
#include "support/head.h"

typedef struct {
  int64_t P, T, V, H0;
  lmloss_dtype dt, dwdt;
  double mask_frac, margin;
  int refs, weight, grads, accumulate; /* grads: 0 none, 1 all, 2 dhidden, 3 dweight */
  int average;                         /* sequences' means in place of their sums */
  int pad;                             /* elements past each row of hidden, weight and grads */
  double weights[LMLOSS_PREF_TYPES];   /* 0 everywhere: sigmoid */
  size_t budget;                       /* 0: default; 1: the least that fits */
} pc_case;

/* The oracle's and the call's outputs. */
typedef struct {
  lmloss_tensor loss, metrics, pairs, chosen, rejected, logp, dh, dw;
} pc_outs;

static pc_outs outs_new(const pc_case *c, const head_data *hd) {
  pc_outs o;
  const int64_t N = hd->N;
  o.loss = host_new(LMLOSS_F32, 1, 1, 1);
  o.metrics = host_new(LMLOSS_F32, LMLOSS_PREF_METRICS, 1, 1);
  o.pairs = host_new(LMLOSS_F32, c->P, 1, 1);
  o.chosen = host_new(LMLOSS_F32, c->P, 1, 1), o.rejected = host_new(LMLOSS_F32, c->P, 1, 1);
  o.logp = host_new(LMLOSS_F32, N, 1, 1);
  const int64_t H = hd->H, S = H + c->pad; /* padded rows: dweight then holds no store */
  o.dh = c->grads == 1 || c->grads == 2 ? host_new(c->dt, N, H, S) : (lmloss_tensor){0};
  o.dw = c->grads == 1 || c->grads == 3 ? host_new(c->dwdt, hd->V, H, S) : (lmloss_tensor){0};
  lmloss_tensor *all[] = {&o.loss, &o.metrics, &o.pairs, &o.chosen, &o.rejected, &o.logp, &o.dh};
  for (int k = 0; k < 7; k++)
    if (all[k]->data) host_poison(all[k]);
  for (int64_t j = 0; o.dw.data && j < o.dw.rows; j++)
    for (int64_t k = 0; k < o.dw.cols; k++)
      tset(&o.dw, j, k, c->accumulate ? 0.5 : 7.0);
  return o;
}

static void outs_free(pc_outs *o) {
  lmloss_tensor *all[] = {&o->loss,     &o->metrics, &o->pairs, &o->chosen,
                          &o->rejected, &o->logp,    &o->dh,    &o->dw};
  for (int k = 0; k < 8; k++)
    host_free(all[k]);
}

static lmloss_pref_options options_of(const pc_case *c) {
  lmloss_pref_options o = lmloss_pref_options_default();
  int any = 0;
  for (int k = 0; k < LMLOSS_PREF_TYPES; k++)
    any |= c->weights[k] != 0.0;
  for (int k = 0; any && k < LMLOSS_PREF_TYPES; k++)
    o.loss_weights[k] = c->weights[k];
  o.beta = 0.2, o.label_smoothing = 0.1;
  return o;
}

/* The case's inputs in host memory. */
typedef struct {
  head_data hd;
  lmloss_tensor idx, mask, refc, refr, weight;
} pc_inputs;

static void inputs_new(const pc_case *c, pc_inputs *x) {
  const int64_t N = 2 * c->P * c->T;
  int64_t *tv = xcalloc((size_t)N, sizeof(int64_t));
  for (int64_t i = 0; i < N; i++)
    tv[i] = rng_int(c->V);
  head_new(&x->hd, N, c->V, c->H0, c->dt, 0, c->pad, c->margin >= 0 ? tv : NULL, c->margin, 2.0);
  x->idx = host_new(LMLOSS_I64, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&x->idx, i, 0, (double)tv[i]);
  x->mask = (lmloss_tensor){0};
  if (c->mask_frac > 0) { /* the first rejected sequence masked whole */
    x->mask = host_new(LMLOSS_BOOL, N, 1, 1);
    for (int64_t i = 0; i < N; i++)
      tset(&x->mask, i, 0, rng_uniform() >= c->mask_frac && i / c->T != c->P);
  }
  x->refc = x->refr = x->weight = (lmloss_tensor){0};
  if (c->refs) {
    x->refc = host_new(LMLOSS_F32, c->P, 1, 1), x->refr = host_new(LMLOSS_F32, c->P, 1, 1);
    for (int64_t i = 0; i < c->P; i++)
      tset(&x->refc, i, 0, -3.0 * c->T + rng_normal()),
          tset(&x->refr, i, 0, -3.0 * c->T + rng_normal());
  }
  if (c->weight) {
    x->weight = host_new(LMLOSS_F32, c->P, 1, 1);
    for (int64_t i = 0; i < c->P; i++)
      tset(&x->weight, i, 0, 0.5 + rng_uniform());
  }
  free(tv);
}

static void inputs_free(pc_inputs *x) {
  head_free(&x->hd);
  host_free(&x->idx), host_free(&x->mask), host_free(&x->refc), host_free(&x->refr);
  host_free(&x->weight);
}

/* The oracle: o's outputs, and dlogits [N, V] into *dl (REF's). */
static int oracle(const pc_case *c, const pc_inputs *x, pc_outs *o, lmloss_tensor *dl) {
  const int64_t P = c->P, T = c->T, N = x->hd.N;
  const lmloss_context r = ref_ctx();
  const lmloss_transform tr = lmloss_transform_default();
  if (lmloss_log_probs(&r, &x->hd.logits, &x->idx, &x->mask, &tr, &o->logp, NULL, NULL)) return 0;
  lmloss_tensor tok[2] = {host_new(LMLOSS_F32, P, 1, 1), host_new(LMLOSS_F32, P, 1, 1)};
  lmloss_tensor *sums[2] = {&o->chosen, &o->rejected};
  for (int64_t s = 0; s < 2 * P; s++) {
    double sum = 0.0, n = 0.0;
    for (int64_t t = 0; t < T; t++) {
      const int64_t i = s * T + t;
      const int on = !x->mask.data || tget(&x->mask, i, 0) != 0.0;
      sum += on ? tget(&o->logp, i, 0) : 0.0, n += on;
    }
    tset(sums[s / P], s % P, 0, c->average ? (n > 0 ? sum / n : 0.0) : sum);
    tset(&tok[s / P], s % P, 0, n);
  }
  lmloss_tensor dc = host_new(LMLOSS_F32, P, 1, 1), dr = host_new(LMLOSS_F32, P, 1, 1);
  const lmloss_pref_inputs in = {o->chosen, o->rejected, x->refc,  x->refr,
                                 tok[0],    tok[1],      x->weight};
  const lmloss_pref_outputs po = {o->loss, o->metrics, dc, dr, o->pairs};
  const lmloss_pref_options opt = options_of(c);
  char ws[4096];
  int ok = lmloss_preference(&r, &in, &opt, &po, ws, sizeof ws) == LMLOSS_OK;
  lmloss_tensor dlogp = host_new(LMLOSS_F32, N, 1, 1);
  for (int64_t i = 0; i < N; i++) { /* a mean's gradient reaches each token over its count */
    const double n = tget(&tok[i / T / P], (i / T) % P, 0);
    const double d = tget(i / T < P ? &dc : &dr, (i / T) % P, 0);
    tset(&dlogp, i, 0, c->average ? (n > 0 ? d / n : 0.0) : d);
  }
  ok = ok && lmloss_log_probs_backward(&r, &x->hd.logits, &x->idx, &x->mask, &tr, &dlogp, NULL, dl,
                                       NULL) == LMLOSS_OK;
  host_free(&tok[0]), host_free(&tok[1]), host_free(&dc), host_free(&dr), host_free(&dlogp);
  return ok;
}

/* |got - ref| within FL_TOL of scale (the magnitude the value is formed from);
 * an infinite oracle (ORPO's log odds of a completion with no token) the same. */
static void close_at(tgroup *g, double got, double ref, double scale, const char *what, int64_t i) {
  note(g, fabs(got - ref), fabs(ref));
  tg_true(g,
          (isinf(ref) && got == ref) ||
              (isfinite(got) && fabs(got - ref) <= FL_TOL * (scale + fabs(ref)) + ABS_FLOOR),
          "%s[%lld]: %.9g, oracle %.9g", what, (long long)i, got, ref);
}

/* The least budget at which the call fits (the size query answers bytes). */
static size_t least_budget(const lmloss_head *h, const lmloss_head_grads *gr, int64_t P,
                           const lmloss_pref_options *opt) {
  size_t lo = 1, hi = (size_t)1 << 40, bytes;
  while (lo + 1 < hi) {
    size_t mid = lo + (hi - lo) / 2;
    lmloss_head_options ho = lmloss_head_options_default();
    ho.memory_budget = mid;
    if (lmloss_linear_preference_size(h, &ho, gr, P, opt, &bytes) == LMLOSS_OK && bytes > 0)
      hi = mid;
    else
      lo = mid;
  }
  return hi;
}

static void run_case(tgroup *g, const pc_case *c) {
  pc_inputs x;
  inputs_new(c, &x);
  head_data *hd = &x.hd;
  const int64_t N = hd->N, P = c->P;
  pc_outs ref = outs_new(c, hd), got = outs_new(c, hd);
  lmloss_tensor rdl = host_new(LMLOSS_F32, N, hd->V, hd->V);
  const int ok_ref = oracle(c, &x, &ref, &rdl);
  lmloss_context ctx = tb_ctx();
  const lmloss_transform tr = lmloss_transform_default();
  const lmloss_pref_options opt = options_of(c);
  lmloss_head h = {dev_clone(&hd->hidden), dev_clone(&hd->weight), {0}};
  lmloss_tensor didx = dev_clone(&x.idx), dmask = dev_clone(&x.mask);
  lmloss_linear_pref_inputs in = {P, dev_clone(&x.refc), dev_clone(&x.refr), dev_clone(&x.weight),
                                  c->average};
  lmloss_linear_pref_outputs out = {dev_clone(&got.loss),     dev_clone(&got.metrics),
                                    dev_clone(&got.pairs),    dev_clone(&got.chosen),
                                    dev_clone(&got.rejected), dev_clone(&got.logp)};
  lmloss_head_grads gr = {dev_clone(&got.dh), dev_clone(&got.dw), {0}, c->accumulate};
  lmloss_head_options ho = lmloss_head_options_default();
  if (c->budget) ho.memory_budget = c->budget == 1 ? least_budget(&h, &gr, P, &opt) : c->budget;
  size_t wsb = 0;
  lmloss_status sz = lmloss_linear_preference_size(&h, &ho, &gr, P, &opt, &wsb);
  void *ws = dev_alloc_bytes(wsb ? wsb : 1);
  lmloss_status st =
      lmloss_linear_preference(&ctx, &h, &didx, &dmask, &tr, &ho, &in, &opt, &out, &gr, ws, wsb);
  if (tg_true(g, ok_ref && sz == LMLOSS_OK && wsb > 0 && st == LMLOSS_OK,
              "oracle %d, size %s (%zu bytes), call %s (%s)", ok_ref, lmloss_status_string(sz), wsb,
              lmloss_status_string(st), lmloss_last_error())) {
    dev_fetch(&got.loss, &out.loss), dev_fetch(&got.metrics, &out.metrics);
    dev_fetch(&got.pairs, &out.pair_loss), dev_fetch(&got.chosen, &out.chosen);
    dev_fetch(&got.rejected, &out.rejected), dev_fetch(&got.logp, &out.logp);
    if (gr.dhidden.data) dev_fetch(&got.dh, &gr.dhidden);
    if (gr.dweight.data) dev_fetch(&got.dw, &gr.dweight);
    double *lp = to_f64(&ref.logp);
    rows_close(g, &got.logp, lp, FL_TOL, "logp");
    free(lp);
    double mag = 0.0; /* the sums' magnitude, times beta: what the loss is formed from */
    for (int64_t i = 0; i < P; i++) {
      const double sc = fabs(tget(&ref.chosen, i, 0)), sr = fabs(tget(&ref.rejected, i, 0));
      close_at(g, tget(&got.chosen, i, 0), tget(&ref.chosen, i, 0), 0.0, "chosen", i);
      close_at(g, tget(&got.rejected, i, 0), tget(&ref.rejected, i, 0), 0.0, "rejected", i);
      mag += sc + sr;
    }
    for (int64_t i = 0; i < P; i++)
      close_at(g, tget(&got.pairs, i, 0), tget(&ref.pairs, i, 0), opt.beta * mag, "pair_loss", i);
    close_at(g, tget(&got.loss, 0, 0), tget(&ref.loss, 0, 0), opt.beta * mag, "loss", 0);
    for (int k = 0; k < LMLOSS_PREF_METRICS; k++)
      close_at(g, tget(&got.metrics, k, 0), tget(&ref.metrics, k, 0), mag, "metrics", k);
    if (c->accumulate)
      for (int64_t j = 0; j < got.dw.rows; j++)
        for (int64_t k = 0; k < got.dw.cols; k++)
          tset(&got.dw, j, k, tget(&got.dw, j, k) - 0.5);
    const lmloss_tensor none = {0};
    if (c->grads) grads_close(g, hd, &got.dh, &got.dw, &none, &rdl);
    if (c->mask_frac > 0 && got.dh.data) { /* the masked sequence's rows read 0 */
      const lmloss_tensor seq = rows_view(&got.dh, P * c->T, c->T);
      all_zero(g, &seq, "dhidden of a masked sequence");
    }
  }
  if (g->fails)
    printf("  case: P=%lld T=%lld V=%lld H=%lld head=%s dW=%s mask=%g margin=%g grads=%d acc=%d "
           "average=%d budget=%zu\n",
           (long long)P, (long long)c->T, (long long)c->V, (long long)hd->H, dt_name(c->dt),
           dt_name(c->dwdt), c->mask_frac, c->margin, c->grads, c->accumulate, c->average,
           ho.memory_budget);
  dev_free_bytes(ws);
  lmloss_tensor *devs[] = {&h.hidden,        &h.weight,     &didx,     &dmask,       &in.ref_chosen,
                           &in.ref_rejected, &in.weight,    &out.loss, &out.metrics, &out.pair_loss,
                           &out.chosen,      &out.rejected, &out.logp, &gr.dhidden,  &gr.dweight};
  for (int k = 0; k < 15; k++)
    dev_free(devs[k]);
  outs_free(&ref), outs_free(&got);
  host_free(&rdl);
  inputs_free(&x);
}

/* A type that couples pairs at the least budget of groups of one pair:
 * the size 0, the call UNSUPPORTED, nothing written. */
static void coupled_refused(tgroup *g, lmloss_dtype dt) {
  pc_case c = {.P = 3, .T = 4, .V = 61, .H0 = 12, .dt = dt, .dwdt = dt, .margin = -1, .grads = 1};
  pc_inputs x;
  inputs_new(&c, &x);
  lmloss_head h = {dev_clone(&x.hd.hidden), dev_clone(&x.hd.weight), {0}};
  pc_outs o = outs_new(&c, &x.hd);
  lmloss_tensor didx = dev_clone(&x.idx), dl = dev_clone(&o.loss), ddh = dev_clone(&o.dh);
  lmloss_head_grads gr = {ddh, dev_clone(&o.dw), {0}, 0};
  const lmloss_pref_options sig = options_of(&c);
  c.weights[LMLOSS_PREF_AOT] = 1.0;
  const lmloss_pref_options aot = options_of(&c);
  lmloss_head_options ho = lmloss_head_options_default();
  ho.memory_budget = least_budget(&h, &gr, c.P, &sig);
  size_t bytes = 1;
  lmloss_status s = lmloss_linear_preference_size(&h, &ho, &gr, c.P, &aot, &bytes);
  const lmloss_linear_pref_inputs in = {c.P, {0}, {0}, {0}};
  const lmloss_linear_pref_outputs out = {dl};
  const lmloss_transform tr = lmloss_transform_default();
  lmloss_context ctx = tb_ctx();
  void *ws = dev_alloc_bytes(1 << 20);
  lmloss_status t =
      lmloss_linear_preference(&ctx, &h, &didx, NULL, &tr, &ho, &in, &aot, &out, &gr, ws, 1 << 20);
  lmloss_tensor back = host_clone(&o.dh);
  dev_fetch(&back, &ddh);
  tg_true(g,
          s == LMLOSS_OK && bytes == 0 && t == LMLOSS_ERR_UNSUPPORTED &&
              strstr(lmloss_last_error(), "all pairs") && same_bytes(&back, &o.dh),
          "AOT in groups of one pair: size %s %zu, call %s (%s)", lmloss_status_string(s), bytes,
          lmloss_status_string(t), lmloss_last_error());
  dev_free_bytes(ws);
  dev_free(&h.hidden), dev_free(&h.weight), dev_free(&didx), dev_free(&dl), dev_free(&ddh);
  dev_free(&gr.dweight);
  host_free(&back);
  outs_free(&o);
  inputs_free(&x);
}

static void expect(tgroup *g, lmloss_status got, lmloss_status want, const char *what) {
  tg_true(g, got == want && lmloss_last_error()[0], "%s: got %s want %s ('%s')", what,
          lmloss_status_string(got), lmloss_status_string(want), lmloss_last_error());
}

/* Bad input: a clear status, nothing read past its end. */
static void bad_input(tgroup *g) {
  head_data hd;
  head_new(&hd, 12, 17, 8, LMLOSS_F32, 1, 0, NULL, -1, 1.0);
  lmloss_context ctx = tb_ctx();
  const lmloss_transform tr = lmloss_transform_default();
  const lmloss_head_options ho = lmloss_head_options_default();
  lmloss_pref_options opt = lmloss_pref_options_default();
  lmloss_tensor idx = host_new(LMLOSS_I64, 12, 1, 1), idx2 = host_new(LMLOSS_I64, 12, 2, 2);
  for (int64_t i = 0; i < 12; i++)
    tset(&idx, i, 0, (double)(i % 17)), tset(&idx2, i, 0, 0), tset(&idx2, i, 1, 0);
  lmloss_tensor loss = host_new(LMLOSS_F32, 1, 1, 1), db = host_new(LMLOSS_F32, 17, 1, 1);
  lmloss_tensor r2 = host_new(LMLOSS_F32, 2, 1, 1);
  lmloss_head h = {dev_clone(&hd.hidden), dev_clone(&hd.weight), {0}};
  lmloss_head hb = {h.hidden, h.weight, dev_clone(&hd.bias)};
  lmloss_tensor di = dev_clone(&idx), di2 = dev_clone(&idx2), dl = dev_clone(&loss);
  lmloss_tensor ddb = dev_clone(&db), dr2 = dev_clone(&r2);
  lmloss_linear_pref_inputs in = {3, {0}, {0}, {0}};
  const lmloss_linear_pref_outputs out = {dl};
  size_t bytes;
  void *ws = dev_alloc_bytes(1 << 20);
  const size_t wsb = 1 << 20;
  in.pairs = 5;
  expect(g, lmloss_linear_preference(&ctx, &h, &di, NULL, &tr, &ho, &in, &opt, &out, NULL, ws, wsb),
         LMLOSS_ERR_BAD_SHAPE, "12 rows in 10 sequences");
  in.pairs = 0;
  expect(g, lmloss_linear_preference_size(&h, &ho, NULL, 0, &opt, &bytes), LMLOSS_ERR_BAD_SHAPE,
         "0 pairs");
  in.pairs = 3;
  expect(g,
         lmloss_linear_preference(&ctx, &h, &di2, NULL, &tr, &ho, &in, &opt, &out, NULL, ws, wsb),
         LMLOSS_ERR_BAD_SHAPE, "K = 2");
  in.ref_chosen = dr2;
  expect(g, lmloss_linear_preference(&ctx, &h, &di, NULL, &tr, &ho, &in, &opt, &out, NULL, ws, wsb),
         LMLOSS_ERR_BAD_SHAPE, "ref_chosen of 2 pairs");
  in.ref_chosen = (lmloss_tensor){0};
  const lmloss_head_grads gb = {{0}, {0}, ddb, 0};
  expect(g, lmloss_linear_preference(&ctx, &hb, &di, NULL, &tr, &ho, &in, &opt, &out, &gb, ws, wsb),
         LMLOSS_ERR_UNSUPPORTED, "dbias");
  opt.beta = -1.0;
  expect(g, lmloss_linear_preference(&ctx, &h, &di, NULL, &tr, &ho, &in, &opt, &out, NULL, ws, wsb),
         LMLOSS_ERR_BAD_OPTION, "beta -1");
  opt = lmloss_pref_options_default();
  expect(g, lmloss_linear_preference(&ctx, &h, &di, NULL, &tr, &ho, &in, &opt, NULL, NULL, ws, wsb),
         LMLOSS_ERR_NULL_POINTER, "outputs NULL");
  expect(g, lmloss_linear_preference(&ctx, &h, &di, NULL, &tr, &ho, &in, &opt, &out, NULL, ws, 64),
         LMLOSS_ERR_WORKSPACE_TOO_SMALL, "a workspace of 64 bytes");
  lmloss_linear_pref_outputs over = out; /* log-probs written over the hidden rows they read */
  over.logp = (lmloss_tensor){h.hidden.data, LMLOSS_F32, h.hidden.device, 12, 1, 1};
  expect(g,
         lmloss_linear_preference(&ctx, &h, &di, NULL, &tr, &ho, &in, &opt, &over, NULL, ws, wsb),
         LMLOSS_ERR_BAD_SHAPE, "logp over hidden");
  if (!tb_is_cuda()) { /* an index out of range, read on the host */
    tset(&idx, 5, 0, 17.0);
    lmloss_tensor bad = dev_clone(&idx);
    expect(g,
           lmloss_linear_preference(&ctx, &h, &bad, NULL, &tr, &ho, &in, &opt, &out, NULL, ws, wsb),
           LMLOSS_ERR_INDEX_OUT_OF_RANGE, "index 17 of V = 17");
    dev_free(&bad);
  }
  dev_free_bytes(ws);
  dev_free(&h.hidden), dev_free(&h.weight), dev_free(&hb.bias), dev_free(&di), dev_free(&di2);
  dev_free(&dl), dev_free(&ddb), dev_free(&dr2);
  host_free(&idx), host_free(&idx2), host_free(&loss), host_free(&db), host_free(&r2);
  head_free(&hd);
}

int main(void) {
  tb_init();
  const lmloss_dtype dt = tb_is_cuda() ? LMLOSS_BF16 : LMLOSS_F32;
  tgroup g;
  tg_begin(&g, "linear preference: bad input");
  bad_input(&g);
  tg_end(&g);

  tg_begin(&g, "linear preference against the float64 oracle");
  const pc_case base = {
      .P = 3, .T = 5, .V = 37, .H0 = 16, .dt = dt, .dwdt = dt, .margin = -1, .refs = 1, .grads = 1};
  pc_case cases[16];
  for (int k = 0; k < 16; k++)
    cases[k] = base;
  cases[1].mask_frac = 0.3, cases[1].weight = 1, cases[1].V = 101, cases[1].P = 4, cases[1].T = 7;
  cases[1].weights[LMLOSS_PREF_IPO] = 0.5, cases[1].weights[LMLOSS_PREF_SIGMOID] = 1.0;
  cases[2].budget = 1; /* groups of one pair */
  cases[3].budget = 1, cases[3].mask_frac = 0.4, cases[3].grads = 2;
  cases[4].budget = 1, cases[4].grads = 3, cases[4].weights[LMLOSS_PREF_ROBUST] = 1.0;
  cases[5].grads = 0, cases[5].budget = 1;
  cases[6].weights[LMLOSS_PREF_AOT] = 1.0, cases[6].weights[LMLOSS_PREF_SFT] = 0.3;
  cases[6].mask_frac = 0.2;
  cases[7].margin = 30, cases[7].budget = 1; /* confident tokens: log p = -e^-30 */
  cases[8].accumulate = 1, cases[8].dwdt = LMLOSS_F32, cases[8].budget = 1;
  cases[9].T = 64, cases[9].P = 2, cases[9].V = 1003, cases[9].H0 = 48, cases[9].budget = 1;
  cases[10].refs = 0, cases[10].weights[LMLOSS_PREF_APO_ZERO] = 1.0, cases[10].P = 1;
  cases[11].T = 300, cases[11].P = 2, cases[11].V = 517, cases[11].H0 = 40, cases[11].budget = 1;
  cases[11].mask_frac = 0.1;
  /* means in place of sums (CPO's and ORPO's average_log_prob): SimPO;
   * ORPO beside SFT, in groups of one pair where it may */
  cases[12].refs = 0, cases[12].average = 1, cases[12].weights[LMLOSS_PREF_SIMPO] = 1.0;
  cases[12].mask_frac = 0.3, cases[12].budget = 1;
  cases[13].refs = 0, cases[13].average = 1, cases[13].weights[LMLOSS_PREF_ORPO] = 1.0;
  cases[13].mask_frac = 0.3, cases[13].budget = 1, cases[13].P = 4;
  cases[14].pad = 3, cases[14].budget = 1, cases[14].mask_frac = 0.2; /* strided rows */
  /* a sequence longer than the slab's chunks: wide chunks in the free store */
  cases[15].T = 600, cases[15].P = 1, cases[15].V = 300, cases[15].H0 = 32, cases[15].budget = 1;
  cases[15].mask_frac = 0.05;
  for (int k = 0; k < 16; k++) {
    rng_seed(9100 + k);
    run_case(&g, &cases[k]);
  }
  tg_end(&g);

  tg_begin(&g, "linear preference: a type that couples pairs, groups of one pair");
  coupled_refused(&g, dt);
  tg_end(&g);
  return test_finish();
}
