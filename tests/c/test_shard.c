/*
 * test_shard.c - the row contract over a sharded vocabulary: each
 * family's states of k shards (k in {1, 2, 3, 7}, uneven widths), merged
 * with the public merge left to right, right to left and as a tree, then
 * each shard's finish, against the one-shot call on the same backend
 * (within fp32 rounding: testing.h's tolerances, gradients with a floor
 * of 1e-6 of their row's largest entry). Rows: peaked with margins 0 to
 * 1000, ties at the max in two shards, a shard holding only -inf, a NaN,
 * ignored and masked rows; F32 and BF16 logits; softcap, temperature,
 * label smoothing, class and token weights, z-loss. The states and
 * finishes are bitwise the same run to run and for any CPU thread count.
 */
#include "math/dtype.h"
#include "support/testing.h"

enum { MERGE_L2R, MERGE_R2L, MERGE_TREE, MERGE_ORDERS };
static const char *order_name[] = {"left to right", "right to left", "tree"};
static const int shard_counts[] = {1, 2, 3, 7};
static const double margins[] = {0, 5, 17, 30, 100, 1000};

/* The determinism group's hooks: the CPU's thread count, and where the
 * sharded gradient and loss of a run are copied (host; NULL: not). */
static int threads;
static lmloss_tensor *capture_grad, *capture_loss;

static lmloss_context ctx(void) {
  lmloss_context c = tb_ctx();
  c.num_threads = threads;
  return c;
}

static int shard_of(const split *s, int64_t j) {
  int c = 0;
  while (c + 1 < s->k && j >= s->col0[c + 1])
    c++;
  return c;
}

static lmloss_tensor state_new(int64_t N) {
  lmloss_tensor h = host_new(LMLOSS_F32, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
  host_poison(&h);
  lmloss_tensor d = dev_clone(&h);
  host_free(&h);
  return d;
}

/* What a vocab-parallel exchange sends: the states' leading `ncols`
 * columns, the rest 0 on arrival (lmloss.h); the merges and finishes
 * below then see only what a receiving rank would have. */
static void exchange(lmloss_tensor *st, int k, int ncols) {
  for (int i = 0; i < k; i++) {
    lmloss_tensor h =
        host_new(LMLOSS_F32, st[i].rows, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
    dev_fetch(&h, &st[i]);
    for (int64_t r = 0; r < h.rows; r++)
      for (int j = ncols; j < LMLOSS_ROW_STATE_COLS; j++)
        tset(&h, r, j, 0.0);
    dev_put(st[i].data, h.data, tensor_bytes(&h));
    host_free(&h);
  }
}

/* The merge of the k states st[] in one order into st[0]'s place (the
 * others are scratch). */
static lmloss_status merge_all(lmloss_tensor *st, int k, int order, const lmloss_transform *tr) {
  lmloss_context c = ctx();
  lmloss_status s = LMLOSS_OK;
  if (order == MERGE_L2R)
    for (int i = 1; i < k && !s; i++)
      s = lmloss_row_state_merge(&c, &st[0], &st[i], tr, &st[0]);
  else if (order == MERGE_R2L) {
    for (int i = k - 2; i >= 0 && !s; i--)
      s = lmloss_row_state_merge(&c, &st[i], &st[i + 1], tr, &st[i]);
  } else
    for (int w = 1; w < k && !s; w *= 2)
      for (int i = 0; i + w < k && !s; i += 2 * w)
        s = lmloss_row_state_merge(&c, &st[i], &st[i + w], tr, &st[i]);
  return s;
}

/* Rows: N(0, 2) logits, row i's label peaked by margins[i % 6] (margin 0:
 * a tie with the runner-up), then row 1 ties its max in two shards, row
 * 2's shard 1 (or the whole row, k = 1) holds only -inf, row 3 a NaN. */
static void fill_rows(const lmloss_tensor *x, int64_t *label, const split *s, int special) {
  const int64_t N = x->rows, V = x->cols;
  for (int64_t i = 0; i < N; i++)
    label[i] = rng_int(V);
  if (special && s->k > 1) label[2] = s->col0[0]; /* not in shard 1 */
  lmloss_tensor row = *x;
  for (int64_t i = 0; i < N; i++) {
    row.data = (char *)x->data + (size_t)(i * x->row_stride) * lmloss_dtype_size(x->dtype);
    row.rows = 1;
    fill_logits(&row, 2.0, &label[i], margins[i % 6]);
  }
  if (!special || N < 4) return;
  const int64_t j2 = s->k > 1 ? s->col0[s->k - 1] : (label[1] + V / 2) % V;
  if (j2 != label[1]) tset(x, 1, j2, tget(x, 1, label[1]));
  const int64_t c0 = s->k > 1 ? s->col0[1] : 0, n = s->k > 1 ? s->n[1] : V;
  for (int64_t j = c0; j < c0 + n; j++)
    tset(x, 2, j, -INFINITY);
  tset(x, 3, rng_int(V), NAN);
}

static double row_max_abs(const lmloss_tensor *t, int64_t i) {
  double m = 0;
  for (int64_t j = 0; j < t->cols; j++)
    if (isfinite(tget(t, i, j))) m = fmax(m, fabs(tget(t, i, j)));
  return m;
}

/* got and ref [N, V] gradients (ref: the one-shot's). exact[i]: the
 * floor of row i's label and argmax entries, where the exact result
 * cancels (testing.h); NULL: none. */
static void close_grads(tgroup *g, const lmloss_tensor *got, const lmloss_tensor *ref,
                        const int64_t *label, const double *exact, const char *what) {
  for (int64_t i = 0; i < ref->rows; i++) {
    const double fl = 1e-6 * row_max_abs(ref, i);
    int64_t a = 0;
    for (int64_t j = 1; j < ref->cols; j++)
      if (fabs(tget(ref, i, j)) > fabs(tget(ref, i, a))) a = j;
    for (int64_t j = 0; j < ref->cols; j++) {
      const int ex = exact && (j == label[i] || j == a);
      tg_close(g, tget(got, i, j), tget(ref, i, j), ref->dtype, ex ? fmax(fl, exact[i]) : fl, what,
               i, j);
    }
  }
}

static void close_rows(tgroup *g, const lmloss_tensor *got, const lmloss_tensor *ref,
                       const char *what) {
  for (int64_t i = 0; i < ref->rows; i++)
    for (int64_t j = 0; j < ref->cols; j++)
      tg_close(g, tget(got, i, j), tget(ref, i, j), ref->dtype, 0, what, i, j);
}

static int ok2(tgroup *g, lmloss_status a, lmloss_status b, const char *what) {
  return tg_true(g, a == LMLOSS_OK && b == LMLOSS_OK, "%s: status %s %s (%s)", what,
                 lmloss_status_string(a), lmloss_status_string(b), lmloss_last_error());
}

/* ---- cross-entropy ---- */

typedef struct {
  float smoothing, z_loss, softcap, temperature;
  int class_weights, token_weights, special;
  lmloss_reduction reduction;
} ce_case;

/* Logits of dtype dt, gradients of dtype gdt. */
static void run_ce(tgroup *g, int64_t N, int64_t V, lmloss_dtype dt, lmloss_dtype gdt, int k,
                   int order, const ce_case *cc) {
  const split s = make_split(V, k);
  lmloss_tensor x = host_new(dt, N, V, V + 3), tgt = host_new(LMLOSS_I64, N, 1, 1);
  lmloss_tensor tw = host_new(LMLOSS_F32, N, 1, 1), cw = host_new(LMLOSS_F32, V, 1, 1);
  int64_t *label = malloc(sizeof(int64_t) * (size_t)N);
  fill_rows(&x, label, &s, cc->special);
  for (int64_t i = 0; i < N; i++) {
    tset(&tgt, i, 0, i % 5 == 4 ? -100 : (double)label[i]);
    tset(&tw, i, 0, 0.5 + rng_uniform());
  }
  for (int64_t j = 0; j < V; j++)
    tset(&cw, j, 0, 0.25 + rng_uniform());
  lmloss_ce_options opt = lmloss_ce_options_default();
  opt.label_smoothing = cc->smoothing;
  opt.z_loss = cc->z_loss;
  opt.transform.softcap = cc->softcap;
  opt.transform.temperature = cc->temperature;
  opt.reduction = cc->reduction;
  const int none = cc->reduction == LMLOSS_REDUCE_NONE;
  lmloss_tensor dx = dev_clone(&x), dt_ = dev_clone(&tgt);
  lmloss_tensor dtw = cc->token_weights ? dev_clone(&tw) : (lmloss_tensor){0};
  lmloss_tensor dcw = cc->class_weights ? dev_clone(&cw) : (lmloss_tensor){0};
  lmloss_ce_inputs in = {dx, dt_, dtw, dcw};
  /* outputs: one-shot (r*) and sharded (g*) */
  lmloss_tensor hl = host_new(LMLOSS_F32, none ? N : 1, 1, 1), hf = host_new(LMLOSS_F32, N, 1, 1);
  lmloss_tensor ha = host_new(LMLOSS_I64, N, 1, 1), hg = host_new(gdt, N, V, V + 1);
  host_poison(&hg);
  lmloss_tensor rl = dev_clone(&hl), rse = dev_clone(&hf), rent = dev_clone(&hf),
                ram = dev_clone(&ha), rg = dev_clone(&hg);
  lmloss_tensor gl = dev_clone(&hl), gse = dev_clone(&hf), gent = dev_clone(&hf),
                gam = dev_clone(&ha), gg = dev_clone(&hg), gb = dev_clone(&hg);
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = dev_alloc_bytes(wsb);
  lmloss_context c = ctx();
  lmloss_ce_outputs ro = {rl, rse, rent, ram, rg};
  lmloss_status s1 = lmloss_cross_entropy(&c, &in, &opt, &ro, ws, wsb);
  /* states, merged, finished shard by shard */
  lmloss_tensor st[8];
  lmloss_shard sh = {0, V, 1};
  lmloss_status s2 = LMLOSS_OK;
  for (int i = 0; i < k && !s2; i++) {
    st[i] = state_new(N);
    lmloss_ce_inputs si = in;
    si.logits = cols_view(&dx, s.col0[i], s.n[i]);
    sh.col0 = s.col0[i];
    s2 = lmloss_cross_entropy_state(&c, &si, &opt, &sh, &st[i]);
  }
  if (!s2) {
    exchange(st, k,
             opt.label_smoothing > 0 ? LMLOSS_ROW_STATE_EXCHANGE_COLS_SMOOTHING
                                     : LMLOSS_ROW_STATE_EXCHANGE_COLS_ENTROPY);
    s2 = merge_all(st, k, order, &opt.transform);
  }
  /* the backward from dloss alongside: one-shot into rb, sharded into gb */
  lmloss_tensor hdl = host_new(LMLOSS_F32, none ? N : 1, 1, 1);
  for (int64_t i = 0; i < hdl.rows; i++)
    tset(&hdl, i, 0, 0.5 + rng_uniform());
  lmloss_tensor ddl = dev_clone(&hdl), rb = dev_clone(&hg);
  lmloss_status s3 = lmloss_cross_entropy_backward(&c, &in, &opt, &ddl, &rb, ws, wsb);
  for (int i = 0; i < k && !s2; i++) {
    lmloss_ce_inputs si = in;
    si.logits = cols_view(&dx, s.col0[i], s.n[i]);
    sh.col0 = s.col0[i];
    lmloss_ce_outputs go = {gl, gse, gent, gam, cols_view(&gg, s.col0[i], s.n[i])};
    s2 = lmloss_cross_entropy_finish(&c, &si, &opt, &sh, &st[0], &go, ws, wsb);
    lmloss_tensor gbv = cols_view(&gb, s.col0[i], s.n[i]);
    if (!s2)
      s2 = lmloss_cross_entropy_backward_finish(&c, &si, &opt, &sh, &st[0], &ddl, &gbv, ws, wsb);
  }
  if (capture_grad) {
    *capture_grad = host_clone(&hg), *capture_loss = host_clone(&hl);
    dev_fetch(capture_grad, &gg), dev_fetch(capture_loss, &gl);
  }
  if (ok2(g, s1, s2, "CE") && ok2(g, s3, LMLOSS_OK, "CE backward")) {
    lmloss_tensor a = host_clone(&hl), b = host_clone(&hl);
    dev_fetch(&a, &rl), dev_fetch(&b, &gl);
    close_rows(g, &b, &a, "loss");
    host_free(&a), host_free(&b);
    lmloss_tensor f1 = host_clone(&hf), f2 = host_clone(&hf);
    dev_fetch(&f1, &rse), dev_fetch(&f2, &gse);
    close_rows(g, &f2, &f1, "lse");
    dev_fetch(&f1, &rent), dev_fetch(&f2, &gent);
    close_rows(g, &f2, &f1, "entropy");
    host_free(&f1), host_free(&f2);
    lmloss_tensor a1 = host_clone(&ha), a2 = host_clone(&ha);
    dev_fetch(&a1, &ram), dev_fetch(&a2, &gam);
    for (int64_t i = 0; i < N; i++)
      tg_true(g, tget(&a1, i, 0) == tget(&a2, i, 0), "argmax row %lld: %g != %g", (long long)i,
              tget(&a2, i, 0), tget(&a1, i, 0));
    host_free(&a1), host_free(&a2);
    /* The label and argmax entries cancel with smoothing and class
     * weights: TOL_REL (A + |B|) times the row's factor (testing.h). */
    double den = 0, cmax = 1, C = V, *fwd = malloc(sizeof(double) * (size_t)N),
           *bwd = malloc(sizeof(double) * (size_t)N);
    if (cc->class_weights) {
      cmax = C = 0;
      for (int64_t j = 0; j < V; j++)
        cmax = fmax(cmax, tget(&cw, j, 0)), C += tget(&cw, j, 0);
    }
    for (int64_t i = 0; i < N; i++)
      if (tget(&tgt, i, 0) != -100) den += cc->class_weights ? tget(&cw, label[i], 0) : 1;
    lmloss_tensor lse = host_clone(&hf);
    dev_fetch(&lse, &rse);
    for (int64_t i = 0; i < N; i++) {
      double f = (cc->token_weights ? tget(&tw, i, 0) : 1) / cc->temperature;
      if (cc->reduction == LMLOSS_REDUCE_MEAN) f /= den;
      const double terms =
          2 * cmax + cc->smoothing * C / V + 2 * cc->z_loss * fabs(tget(&lse, i, 0));
      fwd[i] = TOL_REL * f * terms;
      bwd[i] = fwd[i] * tget(&hdl, none ? i : 0, 0);
    }
    lmloss_tensor q1 = host_clone(&hg), q2 = host_clone(&hg);
    dev_fetch(&q1, &rg), dev_fetch(&q2, &gg);
    close_grads(g, &q2, &q1, label, fwd, "dlogits");
    dev_fetch(&q1, &rb), dev_fetch(&q2, &gb);
    close_grads(g, &q2, &q1, label, bwd, "dlogits (backward)");
    host_free(&q1), host_free(&q2), host_free(&lse);
    free(fwd), free(bwd);
  }
  for (int i = 0; i < k; i++)
    dev_free(&st[i]);
  lmloss_tensor *ds[] = {&dx, &dt_, &dtw,  &dcw, &rl, &rse, &rent, &ram, &rg,
                         &gl, &gse, &gent, &gam, &gg, &gb,  &ddl,  &rb};
  for (size_t i = 0; i < sizeof ds / sizeof *ds; i++)
    dev_free(ds[i]);
  dev_free_bytes(ws);
  lmloss_tensor *hs[] = {&x, &tgt, &tw, &cw, &hl, &hf, &ha, &hg, &hdl};
  for (size_t i = 0; i < sizeof hs / sizeof *hs; i++)
    host_free(hs[i]);
  free(label);
}

/* ---- log-probs, entropy, their backward; softmax ---- */

/* The softmax backward over the shards of split s (lmloss.h: dy at the
 * merged state's argmax, each shard's partials summed, each finish) from
 * the sharded forward's y into dx. */
static lmloss_status softmax_backward_sharded(const lmloss_context *c, const split *s, int k,
                                              const lmloss_tensor *y, const lmloss_tensor *dy,
                                              const lmloss_tensor *hdy, const lmloss_tensor *merged,
                                              int log, const lmloss_tensor *dx) {
  const int64_t N = y->rows, V = y->cols;
  lmloss_tensor hst = host_new(LMLOSS_F32, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
  lmloss_tensor ha = host_new(LMLOSS_F32, N, 1, 1), hsum = host_new(LMLOSS_F64, N, 1, 1);
  lmloss_tensor hpart = host_new(LMLOSS_F64, N, 1, 1);
  dev_fetch(&hst, merged);
  for (int64_t i = 0; i < N; i++) {
    const double a = tget(&hst, i, 2);
    tset(&ha, i, 0, a >= 0 && a < V ? tget(hdy, i, (int64_t)a) : 0.0);
    tset(&hsum, i, 0, 0.0);
  }
  lmloss_tensor da = dev_clone(&ha), dp = dev_clone(&hpart), ds = dev_clone(&hsum);
  lmloss_shard sh = {0, V, 0};
  lmloss_status st = LMLOSS_OK;
  for (int r = 0; r < k && !st; r++) {
    lmloss_tensor yv = cols_view(y, s->col0[r], s->n[r]), gv = cols_view(dy, s->col0[r], s->n[r]);
    sh.col0 = s->col0[r];
    st = lmloss_softmax_backward_partials(c, &yv, &gv, log, &sh, merged, &da, &dp);
    dev_fetch(&hpart, &dp);
    for (int64_t i = 0; i < N; i++) /* the all-reduce */
      tset(&hsum, i, 0, tget(&hsum, i, 0) + tget(&hpart, i, 0));
  }
  dev_free(&ds);
  ds = dev_clone(&hsum);
  for (int r = 0; r < k && !st; r++) {
    lmloss_tensor yv = cols_view(y, s->col0[r], s->n[r]), gv = cols_view(dy, s->col0[r], s->n[r]);
    lmloss_tensor ov = cols_view(dx, s->col0[r], s->n[r]);
    sh.col0 = s->col0[r];
    st = lmloss_softmax_backward_finish(c, &yv, &gv, log, &sh, merged, &da, &ds, &ov);
  }
  dev_free(&da), dev_free(&dp), dev_free(&ds);
  host_free(&hst), host_free(&ha), host_free(&hsum), host_free(&hpart);
  return st;
}

static void run_lp(tgroup *g, int64_t N, int64_t V, lmloss_dtype dt, int k, int order,
                   float temperature, float softcap, int special) {
  const split s = make_split(V, k);
  lmloss_tensor x = host_new(dt, N, V, V + 2), idx = host_new(LMLOSS_I32, N, 1, 1);
  lmloss_tensor mask = host_new(LMLOSS_BOOL, N, 1, 1);
  int64_t *label = malloc(sizeof(int64_t) * (size_t)N);
  fill_rows(&x, label, &s, special);
  for (int64_t i = 0; i < N; i++) {
    tset(&idx, i, 0, (double)label[i]);
    ((unsigned char *)mask.data)[i] = i % 7 != 6;
  }
  lmloss_transform tr = lmloss_transform_default();
  tr.temperature = temperature;
  tr.softcap = softcap;
  lmloss_tensor dx = dev_clone(&x), di = dev_clone(&idx), dm = dev_clone(&mask);
  lmloss_tensor hp = host_new(LMLOSS_F32, N, 1, 1), hg = host_new(dt, N, V, V);
  host_poison(&hg);
  lmloss_tensor rp = dev_clone(&hp), rh = dev_clone(&hp), gp = dev_clone(&hp), gh = dev_clone(&hp);
  lmloss_tensor hdp = host_new(LMLOSS_F32, N, 1, 1), hdh = host_new(LMLOSS_F32, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&hdp, i, 0, rng_normal()), tset(&hdh, i, 0, rng_normal());
  lmloss_tensor ddp = dev_clone(&hdp), ddh = dev_clone(&hdh);
  lmloss_tensor rg = dev_clone(&hg), gg = dev_clone(&hg), rs = dev_clone(&hg), gs = dev_clone(&hg);
  lmloss_context c = ctx();
  lmloss_status s1 = lmloss_log_probs(&c, &dx, &di, &dm, &tr, &rp, &rh, NULL);
  if (!s1) s1 = lmloss_log_probs_backward(&c, &dx, &di, &dm, &tr, &ddp, &ddh, &rg, NULL);
  const lmloss_transform unit = lmloss_transform_default();
  if (!s1) s1 = lmloss_softmax(&c, &dx, special & 1, &rs);
  lmloss_tensor st[8], su[8];
  lmloss_shard sh = {0, V, 1};
  lmloss_status s2 = LMLOSS_OK;
  for (int i = 0; i < k && !s2; i++) {
    st[i] = state_new(N), su[i] = state_new(N);
    lmloss_tensor xv = cols_view(&dx, s.col0[i], s.n[i]);
    sh.col0 = s.col0[i];
    s2 = lmloss_log_probs_state(&c, &xv, &di, &dm, &tr, &sh, &st[i]);
    if (!s2) s2 = lmloss_log_probs_state(&c, &xv, NULL, NULL, &unit, &sh, &su[i]);
  }
  if (!s2) {
    exchange(st, k, LMLOSS_ROW_STATE_EXCHANGE_COLS_ENTROPY);
    exchange(su, k, LMLOSS_ROW_STATE_EXCHANGE_COLS);
    s2 = merge_all(st, k, order, &tr);
  }
  if (!s2) s2 = merge_all(su, k, order, &unit);
  for (int i = 0; i < k && !s2; i++) {
    lmloss_tensor xv = cols_view(&dx, s.col0[i], s.n[i]);
    lmloss_tensor gv = cols_view(&gg, s.col0[i], s.n[i]), sv = cols_view(&gs, s.col0[i], s.n[i]);
    sh.col0 = s.col0[i];
    s2 = lmloss_log_probs_finish(&c, &xv, &di, &dm, &tr, &sh, &st[0], &gp, &gh);
    if (!s2)
      s2 = lmloss_log_probs_backward_finish(&c, &xv, &di, &dm, &tr, &sh, &st[0], &ddp, &ddh, &gv);
    if (!s2) s2 = lmloss_softmax_finish(&c, &xv, &sh, &su[0], special & 1, &sv);
  }
  if (capture_grad) {
    *capture_grad = host_clone(&hg), *capture_loss = host_clone(&hp);
    dev_fetch(capture_grad, &gg), dev_fetch(capture_loss, &gp);
  }
  if (ok2(g, s1, s2, "log-probs")) {
    lmloss_tensor a = host_clone(&hp), b = host_clone(&hp);
    dev_fetch(&a, &rp), dev_fetch(&b, &gp);
    close_rows(g, &b, &a, "logp");
    dev_fetch(&a, &rh), dev_fetch(&b, &gh);
    close_rows(g, &b, &a, "entropy");
    /* The index's entry cancels (dlogp (1 - p)): TOL_REL (|dlogp| +
     * |dH| (H + |log p|)) dz/dx there (testing.h). */
    double *exact = malloc(sizeof(double) * (size_t)N);
    dev_fetch(&a, &rp), dev_fetch(&b, &rh);
    for (int64_t i = 0; i < N; i++)
      exact[i] = TOL_REL / temperature *
                 (fabs(tget(&hdp, i, 0)) +
                  fabs(tget(&hdh, i, 0)) * (fabs(tget(&b, i, 0)) + fabs(tget(&a, i, 0))));
    host_free(&a), host_free(&b);
    lmloss_tensor q1 = host_clone(&hg), q2 = host_clone(&hg);
    dev_fetch(&q1, &rg), dev_fetch(&q2, &gg);
    close_grads(g, &q2, &q1, label, exact, "dlogits");
    free(exact);
    dev_fetch(&q1, &rs), dev_fetch(&q2, &gs);
    close_rows(g, &q2, &q1, "softmax");
    /* the backward from the sharded forward's y, against the one-shot
     * backward from the same y */
    lmloss_tensor hdy = host_new(dt, N, V, V);
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < V; j++)
        tset(&hdy, i, j, 0.25 + rng_uniform());
    lmloss_tensor ddy = dev_clone(&hdy), r1 = dev_clone(&hg), r2 = dev_clone(&hg);
    s1 = lmloss_softmax_backward(&c, &gs, &ddy, special & 1, &r1);
    s2 = softmax_backward_sharded(&c, &s, k, &gs, &ddy, &hdy, &su[0], special & 1, &r2);
    if (ok2(g, s1, s2, "softmax backward")) {
      dev_fetch(&q1, &r1);
      lmloss_tensor q3 = host_clone(&hg);
      dev_fetch(&q3, &r2);
      /* The one-shot form reads sum_k y_k dy_k from y as given, the
       * sharded one takes sum_k y_k = 1 from the state: 16-bit y part
       * them by their own rounding, so there the floors are of 2^-8. */
      tg_close_softmax_grad(g, &q3, &q1, &q2, &hdy, special & 1,
                            dt == LMLOSS_F32 ? TOL_CANCEL : 0x1p-8);
      host_free(&q3);
    }
    dev_free(&ddy), dev_free(&r1), dev_free(&r2);
    host_free(&hdy), host_free(&q1), host_free(&q2);
  }
  for (int i = 0; i < k; i++)
    dev_free(&st[i]), dev_free(&su[i]);
  lmloss_tensor *ds[] = {&dx, &di, &dm, &rp, &rh, &gp, &gh, &ddp, &ddh, &rg, &gg, &rs, &gs};
  for (size_t i = 0; i < sizeof ds / sizeof *ds; i++)
    dev_free(ds[i]);
  lmloss_tensor *hs[] = {&x, &idx, &mask, &hp, &hg, &hdp, &hdh};
  for (size_t i = 0; i < sizeof hs / sizeof *hs; i++)
    host_free(hs[i]);
  free(label);
}

/* ---- bad input ---- */

static void bad_input(tgroup *g) {
  lmloss_tensor x = host_new(LMLOSS_F32, 2, 5, 5), st = host_new(LMLOSS_F32, 2, 8, 8);
  lmloss_tensor tgt = host_new(LMLOSS_I64, 2, 1, 1);
  fill_logits(&x, 1.0, NULL, -1);
  tset(&tgt, 0, 0, 7), tset(&tgt, 1, 0, 1);
  lmloss_context c = tb_ctx(), r = ref_ctx();
  lmloss_ce_options opt = lmloss_ce_options_default();
  lmloss_tensor dx = dev_clone(&x), ds = dev_clone(&st), dtg = dev_clone(&tgt);
  lmloss_ce_inputs in = {dx, dtg, {0}, {0}};
  lmloss_shard sh = {3, 8, 0};
  /* target 7 lies in the vocabulary of 8 (not in the shard's columns) */
  tg_true(g, lmloss_cross_entropy_state(&c, &in, &opt, &sh, &ds) == LMLOSS_OK, "%s",
          lmloss_last_error());
  sh.col0 = 4; /* columns 4..8 of 8 */
  tg_true(g, lmloss_cross_entropy_state(&c, &in, &opt, &sh, &ds) == LMLOSS_ERR_BAD_SHAPE,
          "shard past the vocabulary");
  sh.col0 = -1;
  tg_true(g, lmloss_cross_entropy_state(&c, &in, &opt, &sh, &ds) == LMLOSS_ERR_BAD_SHAPE,
          "negative col0");
  sh.col0 = 0, sh.vocab = 6;
  if (!tb_is_cuda()) /* targets are range-checked on the host only */
    tg_true(g, lmloss_cross_entropy_state(&c, &in, &opt, &sh, &ds) == LMLOSS_ERR_INDEX_OUT_OF_RANGE,
            "target outside the vocabulary");
  sh.vocab = ((int64_t)1 << 24) + 1;
  tg_true(g, lmloss_cross_entropy_state(&c, &in, &opt, &sh, &ds) == LMLOSS_ERR_BAD_SHAPE,
          "vocabulary over 2^24");
  sh.vocab = 8;
  tg_true(g, lmloss_cross_entropy_state(&c, &in, &opt, NULL, &ds) == LMLOSS_ERR_NULL_POINTER,
          "NULL shard");
  lmloss_tensor narrow = ds;
  narrow.cols = 7;
  tg_true(g, lmloss_cross_entropy_state(&c, &in, &opt, &sh, &narrow) == LMLOSS_ERR_BAD_SHAPE,
          "state of 7 columns");
  lmloss_tensor f = host_new(LMLOSS_F32, 2, 1, 1), dfv = dev_clone(&f);
  void *ws = dev_alloc_bytes(lmloss_cross_entropy_workspace_size(2));
  lmloss_ce_outputs out = {dfv, {0}, dfv, {0}, {0}};
  opt.reduction = LMLOSS_REDUCE_NONE;
  tg_true(g,
          lmloss_cross_entropy_finish(&c, &in, &opt, &sh, &ds, &out, ws,
                                      lmloss_cross_entropy_workspace_size(2)) ==
              LMLOSS_ERR_BAD_OPTION,
          "entropy output from states without the entropy sum");
  lmloss_tensor two = host_new(LMLOSS_I64, 2, 2, 2), d2 = dev_clone(&two);
  tg_true(g,
          lmloss_log_probs_state(&c, &dx, &d2, NULL, &opt.transform, &sh, &ds) ==
              LMLOSS_ERR_BAD_SHAPE,
          "two indices a row over a shard");
  /* the sharded softmax backward: partials F64, dy_a F32, dx required */
  sh.col0 = 0, sh.vocab = 8;
  lmloss_tensor p64 = host_new(LMLOSS_F64, 2, 1, 1), dp = dev_clone(&p64);
  tg_true(g,
          lmloss_softmax_backward_partials(&c, &dx, &dx, 0, &sh, &ds, &dfv, &dfv) ==
              LMLOSS_ERR_BAD_DTYPE,
          "F32 softmax partials");
  tg_true(g,
          lmloss_softmax_backward_partials(&c, &dx, &dx, 0, &sh, &ds, &dp, &dp) ==
              LMLOSS_ERR_BAD_DTYPE,
          "F64 dy_a");
  tg_true(g,
          lmloss_softmax_backward_partials(&c, &dx, &dx, 2, &sh, &ds, &dfv, &dp) ==
              LMLOSS_ERR_BAD_OPTION,
          "log 2");
  tg_true(g,
          lmloss_softmax_backward_finish(&c, &dx, &dx, 0, &sh, &ds, &dfv, &dp, NULL) ==
              LMLOSS_ERR_NULL_POINTER,
          "NULL dx");
  tg_true(g,
          lmloss_softmax_backward_finish(&c, &dx, &dx, 0, &sh, &ds, &dfv, &dp, &narrow) ==
              LMLOSS_ERR_BAD_SHAPE,
          "dx of another shape");
  dev_free(&dp), host_free(&p64);
  in.logits = x, in.target = tgt;
  tg_true(g, lmloss_cross_entropy_state(&r, &in, &opt, &sh, &st) == LMLOSS_ERR_UNSUPPORTED,
          "REF has no row states");
  dev_free(&dx), dev_free(&ds), dev_free(&dtg), dev_free(&dfv), dev_free(&d2);
  dev_free_bytes(ws);
  host_free(&x), host_free(&st), host_free(&tgt), host_free(&f), host_free(&two);
}

int main(void) {
  tb_init();
  rng_seed(34);
  const lmloss_reduction reds[] = {LMLOSS_REDUCE_MEAN, LMLOSS_REDUCE_NONE, LMLOSS_REDUCE_SUM};
  const ce_case ce_cases[] = {
      {0, 0, 0, 1, 0, 0, 1, LMLOSS_REDUCE_MEAN},        /* plain, special rows */
      {0.1f, 1e-3f, 0, 1, 1, 1, 0, LMLOSS_REDUCE_MEAN}, /* every option */
      {0, 0, 30, 0.7f, 0, 1, 1, LMLOSS_REDUCE_NONE},    /* softcap and temperature */
      {0.05f, 0, 0, 1, 1, 0, 1, LMLOSS_REDUCE_NONE},    /* smoothing, special rows */
  };
  const int64_t Vs[] = {17, 1003, 5003};
  const lmloss_dtype dts[] = {LMLOSS_F32, LMLOSS_BF16};
  /* logits' and gradient's dtypes; F32 logits into a BF16 gradient is
   * what the fused head's vocab tiles ask */
  const lmloss_dtype ce_dts[][2] = {
      {LMLOSS_F32, LMLOSS_F32}, {LMLOSS_BF16, LMLOSS_BF16}, {LMLOSS_F32, LMLOSS_BF16}};
  for (size_t d = 0; d < sizeof ce_dts / sizeof *ce_dts; d++)
    for (size_t c = 0; c < sizeof ce_cases / sizeof *ce_cases; c++)
      for (int order = 0; order < MERGE_ORDERS; order++) {
        char name[96];
        snprintf(name, sizeof name, "CE %s logits, %s gradient, case %zu, merged %s",
                 dt_name(ce_dts[d][0]), dt_name(ce_dts[d][1]), c, order_name[order]);
        tgroup g;
        tg_begin(&g, name);
        for (size_t v = 0; v < 3; v++)
          for (size_t k = 0; k < 4; k++) {
            ce_case cc = ce_cases[c];
            cc.reduction = cc.reduction == LMLOSS_REDUCE_MEAN ? reds[k % 3] : cc.reduction;
            run_ce(&g, Vs[v] > 2000 ? 13 : 24, Vs[v], ce_dts[d][0], ce_dts[d][1], shard_counts[k],
                   order, &cc);
          }
        tg_end(&g);
      }
  for (size_t d = 0; d < 2; d++)
    for (int order = 0; order < MERGE_ORDERS; order++) {
      char name[96];
      snprintf(name, sizeof name, "log-probs, entropy, softmax %s, merged %s", dt_name(dts[d]),
               order_name[order]);
      tgroup g;
      tg_begin(&g, name);
      for (size_t v = 0; v < 3; v++)
        for (size_t k = 0; k < 4; k++) {
          run_lp(&g, Vs[v] > 2000 ? 13 : 24, Vs[v], dts[d], shard_counts[k], order, 1.0f, 0.0f, 1);
          run_lp(&g, 12, Vs[v], dts[d], shard_counts[k], order, 0.6f, 20.0f, 2);
        }
      tg_end(&g);
    }
  /* Bitwise the same run to run, and on the CPU for any thread count. */
  tgroup g;
  tg_begin(&g, "determinism (bitwise, runs and thread counts)");
  for (int fam = 0; fam < 2; fam++) {
    lmloss_tensor grad[3], loss[3];
    for (int run = 0; run < 3; run++) {
      threads = tb_is_cuda() ? 0 : 1 + 2 * run;
      capture_grad = &grad[run], capture_loss = &loss[run];
      rng_seed(7);
      if (fam == 0)
        run_ce(&g, 16, 5003, LMLOSS_BF16, LMLOSS_BF16, 3, MERGE_TREE, &ce_cases[1]);
      else
        run_lp(&g, 16, 5003, LMLOSS_F32, 7, MERGE_L2R, 0.6f, 20.0f, 1);
      if (run > 0)
        tg_true(&g, same_bytes(&grad[run], &grad[0]) && same_bytes(&loss[run], &loss[0]),
                "%s run %d differs from run 0", fam ? "log-probs" : "CE", run);
    }
    for (int run = 0; run < 3; run++)
      host_free(&grad[run]), host_free(&loss[run]);
  }
  capture_grad = capture_loss = NULL;
  threads = 0;
  tg_end(&g);
  tg_begin(&g, "bad input");
  bad_input(&g);
  tg_end(&g);
  return test_finish();
}
