/*
 * test_shard_head.c - the fused head's cross-entropy over a sharded
 * vocabulary (lmloss_linear_cross_entropy_state, _finish and
 * _backward_finish): the head's rows split into k shards (k in {1, 2, 3,
 * 7}, uneven), each shard's states merged with the public merge, then
 * each shard's finish, against the one-shot fused head on the same
 * backend. The loss and the per-row outputs within fp32 rounding on every
 * shard; dhidden summed over the shards, and each shard's rows of dweight
 * and dbias, within fp32 rounding plus a floor of TOL_REL times their
 * row's largest entry (the shards' GEMMs sum in another order). Rows
 * peaked with margins 0 to 1000 (their targets, so their argmaxes, in
 * every shard), ignored rows, bias, label smoothing with class weights,
 * every reduction, a budget of one chunk and one of several; bad input
 * gets its status.
 */
#include "support/testing.h"

static const int shard_counts[] = {1, 2, 3, 7};
static const double margins[] = {0, 17, 1000};

typedef struct {
  int64_t N, H0, V;
  int bias, reduction, smoothing;
  double margin;
  size_t budget;
} sh_case;

/* The host inputs: hidden [N, H0 + N] and weight [V, H0 + N], row i's
 * own column H0 + i lifting its target to margin above the others'
 * max (test_fused_linear's construction); a quarter of the rows ignored. */
typedef struct {
  lmloss_tensor hidden, weight, bias, target, cw, dloss;
} sh_data;

static sh_data data_new(const sh_case *c) {
  const int64_t N = c->N, V = c->V, H = c->H0 + N;
  sh_data d;
  d.hidden = host_new(LMLOSS_F32, N, H, H), d.weight = host_new(LMLOSS_F32, V, H, H);
  d.bias = c->bias ? host_new(LMLOSS_F32, V, 1, 1) : (lmloss_tensor){0};
  d.target = host_new(LMLOSS_I64, N, 1, 1);
  d.cw = c->smoothing ? host_new(LMLOSS_F32, V, 1, 1) : (lmloss_tensor){0};
  d.dloss = host_new(LMLOSS_F32, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < H; k++)
      tset(&d.hidden, i, k, k < c->H0 ? rng_normal() : k == c->H0 + i);
  for (int64_t j = 0; j < V; j++) {
    for (int64_t k = 0; k < H; k++)
      tset(&d.weight, j, k, k < c->H0 ? 2.0 * rng_normal() / sqrt((double)c->H0) : 0.0);
    if (c->bias) tset(&d.bias, j, 0, rng_normal());
    if (c->smoothing) tset(&d.cw, j, 0, 0.5 + rng_uniform());
  }
  for (int64_t i = 0; i < N; i++) { /* distinct targets: a row's lift moves no other row */
    int64_t y = (i * 7919 + rng_int(7)) % V;
    tset(&d.dloss, i, 0, rng_normal());
    if (rng_uniform() < 0.25) {
      tset(&d.target, i, 0, -100);
      continue;
    }
    tset(&d.target, i, 0, (double)y);
    double *z = malloc((size_t)V * sizeof *z), mx = -INFINITY;
    for (int64_t j = 0; j < V; j++) {
      z[j] = c->bias ? tget(&d.bias, j, 0) : 0.0;
      for (int64_t k = 0; k < c->H0; k++)
        z[j] += tget(&d.hidden, i, k) * tget(&d.weight, j, k);
      if (j != y && z[j] > mx) mx = z[j];
    }
    tset(&d.weight, y, c->H0 + i, mx + c->margin - z[y]);
    free(z);
  }
  return d;
}

static void data_free(sh_data *d) {
  host_free(&d->hidden), host_free(&d->weight), host_free(&d->bias);
  host_free(&d->target), host_free(&d->cw), host_free(&d->dloss);
}

/* A call's outputs and gradients, on the device under test. */
typedef struct {
  lmloss_tensor loss, lse, ent, amax, dh, dw, db;
} outs;

static outs outs_new(const sh_case *c, const lmloss_tensor *hidden) {
  const int64_t N = c->N, H = hidden->cols;
  outs o;
  lmloss_tensor h;
#define NEW(field, dt, r, cols)                                                                    \
  h = host_new(dt, r, cols, cols), host_poison(&h), o.field = dev_clone(&h), host_free(&h)
  NEW(loss, LMLOSS_F32, c->reduction == LMLOSS_REDUCE_NONE ? N : 1, 1);
  NEW(lse, LMLOSS_F32, N, 1);
  NEW(ent, LMLOSS_F32, N, 1);
  NEW(amax, LMLOSS_I64, N, 1);
  NEW(dh, LMLOSS_F32, N, H);
  NEW(dw, LMLOSS_F32, c->V, H);
  o.db = (lmloss_tensor){0};
  if (c->bias) NEW(db, LMLOSS_F32, c->V, 1);
#undef NEW
  return o;
}

static void outs_free(outs *o) {
  lmloss_tensor *t[] = {&o->loss, &o->lse, &o->ent, &o->amax, &o->dh, &o->dw, &o->db};
  for (int i = 0; i < 7; i++)
    dev_free(t[i]);
}

static lmloss_tensor fetched(const lmloss_tensor *dev) {
  lmloss_tensor h = host_new(dev->dtype, dev->rows, dev->cols, dev->cols);
  dev_fetch(&h, dev);
  return h;
}

/* got against ref entry by entry, with a floor of TOL_REL times the
 * largest |ref| of the entry's row. */
static void rows_close(tgroup *g, const lmloss_tensor *got, const lmloss_tensor *ref,
                       const char *what) {
  for (int64_t i = 0; i < ref->rows; i++) {
    double big = 0.0;
    for (int64_t j = 0; j < ref->cols; j++)
      big = fmax(big, fabs(tget(ref, i, j)));
    for (int64_t j = 0; j < ref->cols; j++)
      tg_close(g, tget(got, i, j), tget(ref, i, j), LMLOSS_F32, TOL_REL * big, what, i, j);
  }
}

typedef struct {
  lmloss_head head;
  lmloss_tensor target, cw, dloss;
  lmloss_ce_options opt;
  lmloss_head_options ho;
} dev_call;

static size_t ws_size(const dev_call *d, const lmloss_head *h, const lmloss_head_grads *gr) {
  size_t b = 0;
  if (lmloss_linear_workspace_size(h, &d->ho, gr, 1, &b) != LMLOSS_OK) b = 1 << 16;
  return b;
}

/* The one-shot head: the forward with the gradients (a scalar loss) or
 * the forward and then the backward with dloss (NONE). */
static lmloss_status one_shot(const dev_call *d, int none, outs *o) {
  lmloss_context ctx = tb_ctx();
  lmloss_head_grads gr = {o->dh, o->dw, o->db, 0};
  const size_t wsb = ws_size(d, &d->head, &gr);
  void *ws = dev_alloc_bytes(wsb);
  lmloss_ce_outputs out = {o->loss, o->lse, o->ent, o->amax, {0}};
  lmloss_status s = lmloss_linear_cross_entropy(&ctx, &d->head, &d->target, NULL, &d->cw, &d->opt,
                                                &d->ho, &out, none ? NULL : &gr, ws, wsb);
  if (!s && none)
    s = lmloss_linear_cross_entropy_backward(&ctx, &d->head, &d->target, NULL, &d->cw, &d->opt,
                                             &d->ho, &d->dloss, &gr, ws, wsb);
  dev_free_bytes(ws);
  return s;
}

/* The exchange of the test's calls, one shard at a time: a first round
 * copies each shard's states out (collect) and stops its call with a
 * status; a second copies the merged states in. */
typedef struct {
  lmloss_tensor *collect;
  const lmloss_tensor *merged;
} exch;

static lmloss_status exchange(void *user, const lmloss_tensor *state) {
  const exch *x = user;
  lmloss_tensor h = fetched(x->collect ? state : x->merged);
  dev_put(x->collect ? x->collect->data : state->data, h.data, tensor_bytes(&h));
  host_free(&h);
  return x->collect ? LMLOSS_ERR_UNSUPPORTED : LMLOSS_OK;
}

/* Shard c's call (x: its exchange): its outputs into o (the whole
 * rows'), its dhidden into dh, its rows of dweight and dbias into o's,
 * its states into st; with none, the backward with dloss after it. */
static lmloss_status sharded(const dev_call *d, const split *sp, int c, int none, outs *o,
                             const lmloss_tensor *dh, const lmloss_tensor *st, exch *x) {
  lmloss_context ctx = tb_ctx();
  const lmloss_head h = {d->head.hidden, rows_view(&d->head.weight, sp->col0[c], sp->n[c]),
                         rows_view(&d->head.bias, sp->col0[c], sp->n[c])};
  const lmloss_shard sh = {sp->col0[c], d->head.weight.rows, 1};
  const lmloss_head_grads gr = {*dh, rows_view(&o->dw, sp->col0[c], sp->n[c]),
                                rows_view(&o->db, sp->col0[c], sp->n[c]), 0};
  const size_t wsb = ws_size(d, &h, none ? NULL : &gr);
  void *ws = dev_alloc_bytes(wsb);
  lmloss_ce_outputs out = {o->loss, o->lse, o->ent, o->amax, {0}};
  lmloss_status s =
      lmloss_linear_cross_entropy_sharded(&ctx, &h, &d->target, NULL, &d->cw, &d->opt, &d->ho, &sh,
                                          exchange, x, st, &out, none ? NULL : &gr, ws, wsb);
  if (!s && none) {
    dev_free_bytes(ws);
    const size_t wsg = ws_size(d, &h, &gr);
    ws = dev_alloc_bytes(wsg);
    s = lmloss_linear_cross_entropy_backward_finish(&ctx, &h, &d->target, NULL, &d->cw, &d->opt,
                                                    &d->ho, &sh, st, &d->dloss, &gr, ws, wsg);
  }
  dev_free_bytes(ws);
  return s;
}

/* The k shards' states (the first round: each call stopped by its
 * exchange with that status), merged (left to right, right to left or as
 * a tree by `order`) into st[0]. */
static lmloss_status merged_states(tgroup *g, const dev_call *d, const split *sp, int order,
                                   int none, outs *o, const lmloss_tensor *dh,
                                   const lmloss_tensor *work, lmloss_tensor *st) {
  lmloss_context ctx = tb_ctx();
  const int k = sp->k;
  for (int c = 0; c < k; c++) {
    exch x = {&st[c], NULL};
    const lmloss_status s = sharded(d, sp, c, none, o, &dh[c], work, &x);
    if (!tg_true(g, s == LMLOSS_ERR_UNSUPPORTED, "the exchange's status back: %d", s)) return s;
  }
  for (int c = 0; c < k; c++) { /* an ignored row's: the empty state, packed */
    lmloss_tensor h = fetched(&st[c]), t = fetched(&d->target);
    static const double empty[LMLOSS_ROW_STATE_COLS] = {-INFINITY, 0, -1, NAN, 0, 0, 0, 0};
    for (int64_t r = 0; r < h.rows; r++)
      for (int j = 0; j < LMLOSS_ROW_STATE_COLS && tget(&t, r, 0) == -100; j++)
        tg_close(g, tget(&h, r, j), empty[j], LMLOSS_F32, 0.0, "ignored row's state", r, j);
    host_free(&h), host_free(&t);
  }
  const lmloss_transform *tr = &d->opt.transform;
  lmloss_status s = LMLOSS_OK;
  if (order == 0)
    for (int i = 1; i < k && !s; i++)
      s = lmloss_row_state_merge(&ctx, &st[0], &st[i], tr, &st[0]);
  else if (order == 1)
    for (int i = k - 2; i >= 0 && !s; i--)
      s = lmloss_row_state_merge(&ctx, &st[i], &st[i + 1], tr, &st[i]);
  else
    for (int w = 1; w < k && !s; w *= 2)
      for (int i = 0; i + w < k && !s; i += 2 * w)
        s = lmloss_row_state_merge(&ctx, &st[i], &st[i + w], tr, &st[i]);
  return s;
}

static void run_case(tgroup *g, const sh_case *c, int k, int order) {
  sh_data hd = data_new(c);
  dev_call d;
  d.head = (lmloss_head){dev_clone(&hd.hidden), dev_clone(&hd.weight), dev_clone(&hd.bias)};
  d.target = dev_clone(&hd.target), d.cw = dev_clone(&hd.cw), d.dloss = dev_clone(&hd.dloss);
  d.opt = lmloss_ce_options_default();
  d.opt.reduction = c->reduction;
  d.opt.label_smoothing = c->smoothing ? 0.1f : 0.0f;
  d.ho = lmloss_head_options_default();
  d.ho.memory_budget = c->budget;
  const int none = c->reduction == LMLOSS_REDUCE_NONE;
  outs ref = outs_new(c, &hd.hidden), got = outs_new(c, &hd.hidden);
  lmloss_status s = one_shot(&d, none, &ref);
  const split sp = make_split(c->V, k);
  lmloss_tensor st[8], dh[8], work;
  lmloss_tensor h = host_new(LMLOSS_F32, c->N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
  host_poison(&h), work = dev_clone(&h);
  for (int i = 0; i < k; i++)
    st[i] = dev_clone(&h), dh[i] = dev_clone(&hd.hidden);
  host_free(&h);
  if (!s) s = merged_states(g, &d, &sp, order, none, &got, dh, &work, st);
  lmloss_tensor rl = fetched(&ref.loss), rlse = fetched(&ref.lse), rent = fetched(&ref.ent);
  lmloss_tensor ramax = fetched(&ref.amax);
  for (int i = 0; i < k && !s; i++) {
    exch x = {NULL, &st[0]};
    if ((s = sharded(&d, &sp, i, none, &got, &dh[i], &work, &x)) != LMLOSS_OK) break;
    lmloss_tensor gl = fetched(&got.loss), glse = fetched(&got.lse), gent = fetched(&got.ent);
    lmloss_tensor gamax = fetched(&got.amax);
    for (int64_t r = 0; r < rl.rows; r++)
      tg_close(g, tget(&gl, r, 0), tget(&rl, r, 0), LMLOSS_F32, 0.0, "loss", r, i);
    for (int64_t r = 0; r < c->N; r++) {
      tg_close(g, tget(&glse, r, 0), tget(&rlse, r, 0), LMLOSS_F32, 0.0, "lse", r, i);
      tg_close(g, tget(&gent, r, 0), tget(&rent, r, 0), LMLOSS_F32, 0.0, "entropy", r, i);
      /* at margin 0 the target ties the others' max, which the shards'
       * GEMMs round apart differently */
      if (c->margin > 0)
        tg_true(g, tget(&gamax, r, 0) == tget(&ramax, r, 0), "argmax row %lld shard %d",
                (long long)r, i);
    }
    host_free(&gl), host_free(&glse), host_free(&gent), host_free(&gamax);
  }
  if (tg_true(g, s == LMLOSS_OK, "status %d: %s", s, lmloss_last_error())) {
    lmloss_tensor sum = fetched(&dh[0]), rdh = fetched(&ref.dh);
    for (int i = 1; i < k; i++) {
      lmloss_tensor part = fetched(&dh[i]);
      for (int64_t r = 0; r < sum.rows; r++)
        for (int64_t j = 0; j < sum.cols; j++)
          ((float *)sum.data)[r * sum.cols + j] += tget(&part, r, j);
      host_free(&part);
    }
    rows_close(g, &sum, &rdh, "dhidden");
    lmloss_tensor gdw = fetched(&got.dw), rdw = fetched(&ref.dw);
    rows_close(g, &gdw, &rdw, "dweight");
    host_free(&sum), host_free(&rdh), host_free(&gdw), host_free(&rdw);
    if (c->bias) {
      lmloss_tensor gdb = fetched(&got.db), rdb = fetched(&ref.db);
      for (int64_t j = 0; j < c->V; j++)
        tg_close(g, tget(&gdb, j, 0), tget(&rdb, j, 0), LMLOSS_F32, 1e-6, "dbias", j, 0);
      host_free(&gdb), host_free(&rdb);
    }
  } else {
    printf("  case: N=%lld V=%lld k=%d margin=%g reduction=%d\n", (long long)c->N, (long long)c->V,
           k, c->margin, c->reduction);
  }
  host_free(&rl), host_free(&rlse), host_free(&rent), host_free(&ramax);
  for (int i = 0; i < k; i++)
    dev_free(&st[i]), dev_free(&dh[i]);
  dev_free(&work);
  outs_free(&ref), outs_free(&got);
  dev_free(&d.head.hidden), dev_free(&d.head.weight), dev_free(&d.head.bias);
  dev_free(&d.target), dev_free(&d.cw), dev_free(&d.dloss);
  data_free(&hd);
}

/* Bad input: a 16-bit head, a shard outside its vocabulary, an entropy
 * output from states without it, states over dhidden's bytes. */
static void bad_input(tgroup *g) {
  lmloss_context ctx = tb_ctx();
  const int64_t N = 4, H = 8, V = 16;
  lmloss_tensor hid = host_new(LMLOSS_F32, N, H, H), w = host_new(LMLOSS_F32, V, H, H);
  lmloss_tensor w16 = host_new(LMLOSS_BF16, V, H, H), h16h = host_new(LMLOSS_BF16, N, H, H);
  lmloss_tensor t = host_new(LMLOSS_I64, N, 1, 1);
  lmloss_tensor st = host_new(LMLOSS_F32, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
  lmloss_tensor ent = host_new(LMLOSS_F32, N, 1, 1), loss = host_new(LMLOSS_F32, 1, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&t, i, 0, (double)i);
  lmloss_tensor dh = dev_clone(&hid), dhid = dev_clone(&hid), dw = dev_clone(&w);
  lmloss_tensor dw16 = dev_clone(&w16), dh16 = dev_clone(&h16h), dt = dev_clone(&t);
  lmloss_tensor dst = dev_clone(&st);
  const lmloss_tensor over = {
      dh.data, LMLOSS_F32, dh.device, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS};
  lmloss_tensor dent = dev_clone(&ent), dloss = dev_clone(&loss);
  const lmloss_ce_options opt = lmloss_ce_options_default();
  const lmloss_head_options ho = lmloss_head_options_default();
  const lmloss_head h = {dhid, dw, {0}}, h16 = {dh16, dw16, {0}};
  size_t wsb = 0;
  lmloss_linear_workspace_size(&h, &ho, &(lmloss_head_grads){dh, {0}, {0}, 0}, 1, &wsb);
  void *ws = dev_alloc_bytes(wsb + (1 << 20));
  wsb += 1 << 20;
  const lmloss_shard in = {0, 2 * V, 0}, out_of = {V + 1, 2 * V, 0};
  lmloss_ce_outputs out = {dloss, {0}, {0}, {0}, {0}};
  const lmloss_head_grads gr = {dh, {0}, {0}, 0};
  exch keep_own = {NULL, &dst}; /* merged = this shard's own states */
  const struct {
    const lmloss_head *h;
    const lmloss_shard *sh;
    lmloss_exchange_fn fn;
    int entropy;
    const lmloss_tensor *st;
    lmloss_status want;
    const char *what;
  } bad[] = {
      {&h16, &in, exchange, 0, &dst, LMLOSS_ERR_UNSUPPORTED, "a 16-bit head"},
      {&h, &out_of, exchange, 0, &dst, LMLOSS_ERR_BAD_SHAPE, "a shard outside the vocabulary"},
      {&h, &in, NULL, 0, &dst, LMLOSS_ERR_NULL_POINTER, "no exchange"},
      {&h, &in, exchange, 1, &dst, LMLOSS_ERR_BAD_OPTION, "entropy without shard.entropy"},
      {&h, &in, exchange, 0, &over, LMLOSS_ERR_BAD_SHAPE, "states over dhidden"},
      {&h, &in, exchange, 0, &dst, LMLOSS_OK, "a valid call"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    out.entropy = bad[i].entropy ? dent : (lmloss_tensor){0};
    const lmloss_status s =
        lmloss_linear_cross_entropy_sharded(&ctx, bad[i].h, &dt, NULL, NULL, &opt, &ho, bad[i].sh,
                                            bad[i].fn, &keep_own, bad[i].st, &out, &gr, ws, wsb);
    tg_true(g, s == bad[i].want, "%s: status %d, want %d (%s)", bad[i].what, s, bad[i].want,
            lmloss_last_error());
  }
  dev_free_bytes(ws);
  lmloss_tensor *dev[] = {&dh, &dhid, &dw, &dw16, &dh16, &dt, &dst, &dent, &dloss};
  for (int i = 0; i < 9; i++)
    dev_free(dev[i]);
  lmloss_tensor *host[] = {&hid, &w, &w16, &h16h, &t, &st, &ent, &loss};
  for (int i = 0; i < 8; i++)
    host_free(host[i]);
}

int main(void) {
  tb_init();
  rng_seed(41);
  tgroup g;
  const int reductions[] = {LMLOSS_REDUCE_MEAN, LMLOSS_REDUCE_SUM, LMLOSS_REDUCE_NONE};
  tg_begin(&g, "sharded fused head vs one-shot: k shards, margins, reductions");
  int n = 0;
  for (int ki = 0; ki < 4; ki++)
    for (int mi = 0; mi < 3; mi++)
      for (int ri = 0; ri < 3; ri++, n++) {
        sh_case c = {24, 16, 257, n % 2, reductions[ri], n % 4 == 1, margins[mi], 0};
        c.budget = (ki + mi) % 2 ? 10 * 1024 : 0; /* chunks of a few rows */
        run_case(&g, &c, shard_counts[ki], (ki + ri) % 3);
      }
  tg_end(&g);
  tg_begin(&g, "sharded fused head: bad input");
  bad_input(&g);
  tg_end(&g);
  return test_finish();
}
