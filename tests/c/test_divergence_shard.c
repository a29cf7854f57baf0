/*
 * test_divergence_shard.c - the divergences over a sharded vocabulary
 * (lmloss.h): each shard's state, the states exchanged (only the columns
 * lmloss.h says to send) and merged left to right, right to left and as a
 * tree, each shard's partials summed in rank order, then each shard's
 * finish and backward finish, against the one-shot lmloss_divergence and
 * lmloss_divergence_backward (within fp32 rounding: testing.h's
 * tolerances, gradients with a floor of 1e-6 of their row's largest
 * entry and, with a hard term, testing.h's cancellation floor over its
 * two parts). Every kind, beta 0, 0.3, 0.5 and 1, temperatures per side,
 * softcap, a hard term; k = 1, 2, 3, 4 and 7 uneven shards (and 2 of a
 * wide row). Rows: peaked with margins 0 to 1000 whose argmax lies in
 * each shard in turn, the teacher peaked elsewhere, student == teacher
 * (exactly 0 loss and gradient, merged over any number of shards), small
 * gaps, ties at the max across shards, a shard of only -inf in both rows,
 * a NaN, ignored rows.
 * On the backend under test (CPU, or CUDA with LMLOSS_TEST_BACKEND=cuda);
 * bad input on the host. On CUDA the one-shot call's e^x is one MUFU op
 * (math/divergence.h: within the suite's 1e-5 of the oracle) and the
 * shards' sums are another order of the same terms, so the two are held
 * to each other within twice that.
 */
#include "support/testing.h"

enum { MERGE_L2R, MERGE_R2L, MERGE_TREE, MERGE_ORDERS };
static const int shard_counts[] = {1, 2, 3, 4, 7};
static const double margins[] = {0, 5, 17, 30, 100, 1000};
/* a row whose one-shot call CUDA takes in one sweep (past divergence.cu's
 * DIV_ONLINE_MIN_COLS), against two shards, whose states take two */
enum { WIDE_V = 140001 };

static lmloss_tensor f32(int64_t rows, int64_t cols) {
  lmloss_tensor t = host_new(LMLOSS_F32, rows, cols, cols);
  host_poison(&t);
  return t;
}

typedef struct {
  lmloss_divergence_kind kind;
  float beta, ts, tt, cap, hard;
  lmloss_reduction red;
} div_case;

/* Student and teacher rows (module comment); is_same[i]: identical rows. */
static void fill_pair(const lmloss_tensor *s, const lmloss_tensor *t, int64_t *label,
                      const split *sp, int *is_same) {
  const int64_t N = s->rows, V = s->cols;
  for (int64_t i = 0; i < N; i++) {
    const int r = (int)(i % sp->k); /* the student's argmax in shard r */
    label[i] = sp->col0[r] + rng_int(sp->n[r]);
    int64_t tl = rng_int(V);
    lmloss_tensor rs = cols_view(s, 0, V), rt = cols_view(t, 0, V);
    rs.data = (char *)s->data + (size_t)(i * s->row_stride) * 4, rs.rows = 1;
    rt.data = (char *)t->data + (size_t)(i * t->row_stride) * 4, rt.rows = 1;
    fill_logits(&rs, 2.0, &label[i], margins[i % 6]);
    fill_logits(&rt, 2.0, &tl, margins[(i + 2) % 6]);
    is_same[i] = i % 7 == 0 || i % 7 == 5;
    for (int64_t j = 0; j < V; j++) {
      const double x = tget(s, i, j);
      if (is_same[i]) tset(t, i, j, x);
      if (i % 7 == 3) tset(t, i, j, x + 1e-2 * rng_normal()); /* a small gap */
    }
  }
  if (N < 5) return;
  /* row 1: both rows tie their max in the first and last shards */
  const int64_t a = sp->col0[0], b = sp->col0[sp->k - 1] + sp->n[sp->k - 1] - 1;
  tset(s, 1, a, 40.0), tset(s, 1, b, 40.0), tset(t, 1, a, 25.0), tset(t, 1, b, 25.0);
  /* row 2: shard 1 (the whole row for k = 1: NaN results) holds only -inf */
  const int64_t c0 = sp->k > 1 ? sp->col0[1] : 0, n = sp->k > 1 ? sp->n[1] : V;
  for (int64_t j = c0; j < c0 + n; j++)
    tset(s, 2, j, -INFINITY), tset(t, 2, j, -INFINITY);
  tset(s, 4, rng_int(V), NAN); /* row 4: a NaN (also ignored in some reductions' rows) */
}

static lmloss_status merge_all(lmloss_tensor *st, int k, int order, const lmloss_div_options *o) {
  lmloss_context c = tb_ctx();
  lmloss_status s = LMLOSS_OK;
  if (order == MERGE_L2R)
    for (int i = 1; i < k && !s; i++)
      s = lmloss_divergence_state_merge(&c, &st[0], &st[i], o, &st[0]);
  else if (order == MERGE_R2L)
    for (int i = k - 2; i >= 0 && !s; i--)
      s = lmloss_divergence_state_merge(&c, &st[i], &st[i + 1], o, &st[i]);
  else
    for (int w = 1; w < k && !s; w *= 2)
      for (int i = 0; i + w < k && !s; i += 2 * w)
        s = lmloss_divergence_state_merge(&c, &st[i], &st[i + w], o, &st[i]);
  return s;
}

/* What an exchange sends (lmloss.h): the leading columns, w_y with a hard
 * term, each side's raw max logit with its softcap; the rest arrive 0
 * (w_y NaN). st: a state on the device. */
static void exchange(const lmloss_tensor *st, const div_case *dc) {
  lmloss_tensor h = f32(st->rows, LMLOSS_DIV_STATE_COLS);
  dev_fetch(&h, st);
  for (int64_t r = 0; r < st->rows; r++)
    for (int j = LMLOSS_DIV_STATE_EXCHANGE_COLS; j < LMLOSS_DIV_STATE_COLS; j++) {
      const int keep = (j == 8 && dc->hard > 0) || (j == 9 || j == 10) * (dc->cap > 0);
      if (!keep) tset(&h, r, j, j == 8 ? NAN : 0.0);
    }
  dev_put(st->data, h.data, tensor_bytes(&h));
  host_free(&h);
}

/* Host tensors and their device copies (the same memory on the CPU's
 * test backend: copies). */
typedef struct {
  lmloss_tensor h, d;
} pair_t;

static pair_t both(lmloss_tensor h) {
  pair_t p = {h, dev_clone(&h)};
  return p;
}

static void fetch(pair_t *p) { dev_fetch(&p->h, &p->d); }

static void free_both(pair_t *p) { host_free(&p->h), dev_free(&p->d); }

static void run(tgroup *g, int64_t N, int64_t V, int k, int order, const div_case *dc) {
  const split sp = make_split(V, k);
  lmloss_tensor s = host_new(LMLOSS_F32, N, V, V + 3), t = host_new(LMLOSS_F32, N, V, V + 1);
  lmloss_tensor y = host_new(LMLOSS_I64, N, 1, 1);
  int64_t *label = malloc(sizeof(int64_t) * (size_t)N);
  int *same = malloc(sizeof(int) * (size_t)N);
  fill_pair(&s, &t, label, &sp, same);
  for (int64_t i = 0; i < N; i++)
    tset(&y, i, 0, i % 5 == 4 ? -100 : (double)label[i]);
  lmloss_div_options o = lmloss_div_options_default();
  o.kind = dc->kind, o.beta = dc->beta, o.hard_weight = dc->hard, o.reduction = dc->red;
  o.student.temperature = dc->ts, o.teacher.temperature = dc->tt;
  o.student.softcap = o.teacher.softcap = dc->cap;
  const int64_t NL = dc->red == LMLOSS_REDUCE_NONE ? N : 1;
  const size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = dev_alloc_bytes(wsb);
  lmloss_context c = tb_ctx();
  pair_t S = both(s), T = both(t), Y = both(y);
  /* the one-shot call */
  pair_t l1 = both(f32(NL, 1)), d1 = both(f32(N, 1)), c1 = both(f32(N, 1)), e1 = both(f32(N, 1));
  pair_t g1 = both(f32(N, V)), up = both(f32(NL, 1)), b1 = both(f32(N, V)), b2 = both(f32(N, V));
  lmloss_div_inputs in = {S.d, T.d, Y.d};
  lmloss_div_outputs o1 = {l1.d, d1.d, c1.d, g1.d, e1.d};
  tg_true(g, lmloss_divergence(&c, &in, &o, &o1, ws, wsb) == LMLOSS_OK, "one-shot: %s",
          lmloss_last_error());
  for (int64_t i = 0; i < NL; i++)
    tset(&up.h, i, 0, 0.25 + rng_uniform());
  dev_put(up.d.data, up.h.data, tensor_bytes(&up.h));
  tg_true(g, lmloss_divergence_backward(&c, &in, &o, &up.d, &b1.d, ws, wsb) == LMLOSS_OK,
          "one-shot backward: %s", lmloss_last_error());
  /* With a hard term the gradient is the divergence's part plus the
   * cross-entropy's, which cancel where they meet (testing.h's cancel):
   * the cross-entropy's part alone, the soft weight 0. */
  pair_t h1 = {{0}}, hb = {{0}}, hl = {{0}}; /* zeros: nothing to fetch or free */
  if (dc->hard > 0) {
    h1 = both(f32(N, V)), hb = both(f32(N, V)), hl = both(f32(NL, 1));
    lmloss_div_options oh = o;
    oh.soft_weight = 0.0f;
    const lmloss_div_outputs oo = {hl.d, {0}, {0}, h1.d, {0}};
    tg_true(g,
            lmloss_divergence(&c, &in, &oh, &oo, ws, wsb) == LMLOSS_OK &&
                lmloss_divergence_backward(&c, &in, &oh, &up.d, &hb.d, ws, wsb) == LMLOSS_OK,
            "the cross-entropy's part: %s", lmloss_last_error());
  }
  /* the shards' states, exchanged and merged, then the same merged state on every shard */
  lmloss_tensor st[8];
  lmloss_div_inputs sin[8];
  for (int r = 0; r < k; r++) {
    const lmloss_shard sh = {sp.col0[r], V, 0};
    sin[r] = (lmloss_div_inputs){cols_view(&S.d, sp.col0[r], sp.n[r]),
                                 cols_view(&T.d, sp.col0[r], sp.n[r]), Y.d};
    lmloss_tensor h = f32(N, LMLOSS_DIV_STATE_COLS);
    st[r] = dev_clone(&h);
    host_free(&h);
    tg_true(g, lmloss_divergence_state(&c, &sin[r], &o, &sh, &st[r]) == LMLOSS_OK, "state: %s",
            lmloss_last_error());
    exchange(&st[r], dc);
  }
  tg_true(g, merge_all(st, k, order, &o) == LMLOSS_OK, "merge: %s", lmloss_last_error());
  const lmloss_tensor merged = st[0]; /* every order ends in st[0] */
  /* each shard's partials, summed in rank order (the all-reduce) */
  /* also the gradient in two halves (g3): the partials with its first, the same sums */
  const int kl = o.kind == LMLOSS_DIV_KL || (o.kind == LMLOSS_DIV_JSD && o.beta == 0.0f);
  const int P = LMLOSS_DIV_PARTIAL_COLS;
  pair_t psum = both(host_new(LMLOSS_F64, N, P, P)), part = both(host_new(LMLOSS_F64, N, P, P));
  pair_t pg = both(host_new(LMLOSS_F64, N, P, P)), g3 = both(f32(N, V));
  for (int r = 0; r < k; r++) {
    const lmloss_shard sh = {sp.col0[r], V, 0};
    tg_true(g, lmloss_divergence_partials(&c, &sin[r], &o, &sh, &merged, &part.d) == LMLOSS_OK,
            "partials: %s", lmloss_last_error());
    fetch(&part);
    for (int64_t i = 0; i < N; i++)
      for (int j = 0; j < P; j++)
        tset(&psum.h, i, j, (r ? tget(&psum.h, i, j) : 0.0) + tget(&part.h, i, j));
    const lmloss_tensor d3 = cols_view(&g3.d, sp.col0[r], sp.n[r]);
    tg_true(g,
            lmloss_divergence_partials_grad(&c, &sin[r], &o, &sh, &merged, &pg.d, &d3, ws, wsb) ==
                LMLOSS_OK,
            "partials with the gradient's first half: %s", lmloss_last_error());
    fetch(&pg);
    for (int64_t i = 0; i < N; i++)
      for (int j = 0; j < P; j++) {
        const double a = tget(&pg.h, i, j), b = tget(&part.h, i, j);
        tg_true(g, a == b || (a != a && b != b), "partials with the gradient [%lld, %d]: %g, %g",
                (long long)i, j, a, b);
      }
  }
  dev_put(psum.d.data, psum.h.data, tensor_bytes(&psum.h));
  /* each shard's finish: the whole rows' outputs, its columns' gradients */
  pair_t l2 = both(f32(NL, 1)), d2 = both(f32(N, 1)), c2 = both(f32(N, 1)), e2 = both(f32(N, 1));
  pair_t g2 = both(f32(N, V));
  for (int r = 0; r < k; r++) {
    const lmloss_shard sh = {sp.col0[r], V, 0};
    /* a ce output reads w_y, which the exchange sends with a hard term only */
    lmloss_div_outputs o2 = {l2.d, d2.d, dc->hard > 0 ? c2.d : (lmloss_tensor){0},
                             cols_view(&g2.d, sp.col0[r], sp.n[r]), e2.d};
    tg_true(g,
            lmloss_divergence_finish(&c, &sin[r], &o, &sh, &merged, &psum.d, &o2, ws, wsb) ==
                LMLOSS_OK,
            "finish: %s", lmloss_last_error());
    const lmloss_tensor db = cols_view(&b2.d, sp.col0[r], sp.n[r]);
    tg_true(g,
            lmloss_divergence_backward_finish(&c, &sin[r], &o, &sh, &merged, kl ? NULL : &psum.d,
                                              &up.d, &db, ws, wsb) == LMLOSS_OK,
            "backward finish: %s", lmloss_last_error());
    const lmloss_tensor d3 = cols_view(&g3.d, sp.col0[r], sp.n[r]);
    tg_true(g,
            lmloss_divergence_finish_grad(&c, &sin[r], &o, &sh, &merged, &psum.d, &d3, ws, wsb) ==
                LMLOSS_OK,
            "the gradient's second half: %s", lmloss_last_error());
  }
  pair_t *outs[] = {&l1, &d1, &c1, &e1, &g1, &b1, &b2, &l2, &d2, &c2, &e2, &g2, &g3, &h1, &hb};
  for (size_t q = 0; q < sizeof outs / sizeof *outs; q++)
    fetch(outs[q]);
  const double cu = tb_is_cuda() ? TOL_REL : 0.0; /* module comment */
  for (int64_t i = 0; i < NL; i++)
    tg_close(g, tget(&l2.h, i, 0), tget(&l1.h, i, 0), LMLOSS_F32, cu * fabs(tget(&l1.h, i, 0)),
             "loss", i, 0);
  for (int64_t i = 0; i < N; i++) {
    const double dv = tget(&d2.h, i, 0), fl = 1e-6;
    tg_close(g, dv, tget(&d1.h, i, 0), LMLOSS_F32, 0, "divergence", i, 0);
    if (dc->hard > 0) tg_close(g, tget(&c2.h, i, 0), tget(&c1.h, i, 0), LMLOSS_F32, 0, "ce", i, 0);
    tg_close(g, tget(&e2.h, i, 0), tget(&e1.h, i, 0), LMLOSS_F32, 0, "entropy", i, 0);
    tg_true(g, !(dv < 0), "divergence %g < 0 at row %lld", dv, (long long)i);
    double m1 = 0, m2 = 0;
    for (int64_t j = 0; j < V; j++) {
      if (isfinite(tget(&g1.h, i, j))) m1 = fmax(m1, fabs(tget(&g1.h, i, j)));
      if (isfinite(tget(&b1.h, i, j))) m2 = fmax(m2, fabs(tget(&b1.h, i, j)));
    }
    for (int64_t j = 0; j < V; j++) {
      const double r1 = tget(&g1.h, i, j), r2 = tget(&b1.h, i, j);
      const double c1j = dc->hard > 0 ? tget(&h1.h, i, j) : 0.0;
      const double c2j = dc->hard > 0 ? tget(&hb.h, i, j) : 0.0;
      const double f1 = fl * m1 + cu * fabs(r1) + TOL_CANCEL * (fabs(r1 - c1j) + fabs(c1j));
      const double f2 = fl * m2 + cu * fabs(r2) + TOL_CANCEL * (fabs(r2 - c2j) + fabs(c2j));
      tg_close(g, tget(&g2.h, i, j), r1, LMLOSS_F32, f1, "dstudent", i, j);
      tg_close(g, tget(&g3.h, i, j), r1, LMLOSS_F32, f1, "dstudent in two halves", i, j);
      tg_close(g, tget(&b2.h, i, j), r2, LMLOSS_F32, f2, "backward", i, j);
    }
    if (same[i] && i % 5 != 4 && i != 4 && dc->ts == dc->tt) {
      tg_true(g, dv == 0, "identical rows: divergence %g at row %lld", dv, (long long)i);
      for (int64_t j = 0; dc->hard == 0 && j < V; j++)
        tg_true(g, tget(&g2.h, i, j) == 0 && tget(&b2.h, i, j) == 0 && tget(&g3.h, i, j) == 0,
                "identical rows: gradient %g at [%lld, %lld]", tget(&g2.h, i, j), (long long)i,
                (long long)j);
    }
  }
  for (int r = 0; r < k; r++)
    dev_free(&st[r]);
  pair_t *all[] = {&S,    &T,  &Y,  &l1, &d1, &c1, &e1, &g1, &up, &b1, &b2, &psum,
                   &part, &pg, &g3, &l2, &d2, &c2, &e2, &g2, &h1, &hb, &hl};
  for (size_t q = 0; q < sizeof all / sizeof *all; q++)
    free_both(all[q]);
  free(label), free(same), dev_free_bytes(ws);
}

/* Bad input: clear statuses, nothing else. */
static void bad_inputs(tgroup *g) {
  const int64_t N = 3, V = 10;
  lmloss_tensor s = f32(N, V), t = f32(N, V), st = f32(N, LMLOSS_DIV_STATE_COLS);
  lmloss_tensor pf = f32(N, LMLOSS_DIV_PARTIAL_COLS), p4 = host_new(LMLOSS_F64, N, 4, 4);
  lmloss_tensor p8 = host_new(LMLOSS_F64, N, LMLOSS_DIV_PARTIAL_COLS, LMLOSS_DIV_PARTIAL_COLS);
  lmloss_tensor db = host_new(LMLOSS_BF16, N, V, V);
  lmloss_tensor st8 = f32(N, LMLOSS_ROW_STATE_COLS);
  lmloss_tensor l = f32(1, 1), d = f32(N, V);
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < V; j++)
      tset(&s, i, j, rng_normal()), tset(&t, i, j, rng_normal());
  lmloss_context c = lmloss_context_default(); /* host tensors: the CPU */
  lmloss_div_options o = lmloss_div_options_default();
  lmloss_div_inputs in = {s, t, {0}};
  lmloss_shard out_of = {5, 14, 0}, ok = {0, 0, 0};
  const size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = malloc(wsb);
  lmloss_status e = lmloss_divergence_state(&c, &in, &o, &out_of, &st);
  tg_true(g, e == LMLOSS_ERR_BAD_SHAPE, "shard outside the vocabulary: %s",
          lmloss_status_string(e));
  e = lmloss_divergence_state(&c, &in, &o, &ok, &st8);
  tg_true(g, e == LMLOSS_ERR_BAD_SHAPE, "a row state's shape: %s", lmloss_status_string(e));
  e = lmloss_divergence_state(&c, &in, &o, &ok, &st);
  tg_true(g, e == LMLOSS_OK, "state: %s", lmloss_last_error());
  e = lmloss_divergence_partials(&c, &in, &o, &ok, &st, &p4);
  tg_true(g, e == LMLOSS_ERR_BAD_SHAPE, "partials' shape: %s", lmloss_status_string(e));
  e = lmloss_divergence_partials(&c, &in, &o, &ok, &st, &pf);
  tg_true(g, e == LMLOSS_ERR_BAD_DTYPE, "F32 partials: %s", lmloss_status_string(e));
  o.kind = LMLOSS_DIV_TVD;
  e = lmloss_divergence_backward_finish(&c, &in, &o, &ok, &st, NULL, &l, &d, ws, wsb);
  tg_true(g, e == LMLOSS_ERR_NULL_POINTER, "TVD without partials: %s", lmloss_status_string(e));
  e = lmloss_divergence_partials_grad(&c, &in, &o, &ok, &st, &p8, &db, ws, wsb);
  tg_true(g, e == LMLOSS_ERR_BAD_DTYPE, "TVD's first half into BF16: %s", lmloss_status_string(e));
  e = lmloss_divergence_finish_grad(&c, &in, &o, &ok, &st, &p8, &db, ws, wsb);
  tg_true(g, e == LMLOSS_ERR_BAD_DTYPE, "TVD's second half into BF16: %s", lmloss_status_string(e));
  e = lmloss_divergence_partials_grad(&c, &in, &o, &ok, &st, &p8, &s, ws, wsb);
  tg_true(g, e == LMLOSS_ERR_BAD_SHAPE, "TVD's first half over the student: %s",
          lmloss_status_string(e));
  e = lmloss_divergence_partials_grad(&c, &in, &o, &ok, &st, &p8, &d, ws, wsb);
  tg_true(g, e == LMLOSS_OK, "TVD's first half: %s", lmloss_last_error());
  o.kind = LMLOSS_DIV_KL;
  e = lmloss_divergence_partials_grad(&c, &in, &o, &ok, &st, &p8, &db, ws, wsb);
  tg_true(g, e == LMLOSS_OK, "the KL's gradient into BF16: %s", lmloss_last_error());
  e = lmloss_divergence_partials_grad(&c, &in, &o, &ok, &st, &p8, &pf, ws, wsb);
  tg_true(g, e == LMLOSS_ERR_BAD_SHAPE, "the gradient's shape: %s", lmloss_status_string(e));
  e = lmloss_divergence_partials_grad(&c, &in, &o, &ok, &st, &p8, &d, ws, 8);
  tg_true(g, e == LMLOSS_ERR_WORKSPACE_TOO_SMALL, "its workspace: %s", lmloss_status_string(e));
  e = lmloss_divergence_partials_grad(&c, &in, &o, &ok, &st, &p8, &d, ws, wsb);
  tg_true(g, e == LMLOSS_OK, "the KL's gradient in the partials: %s", lmloss_last_error());
  e = lmloss_divergence_state_merge(&c, &st, &st8, &o, &st);
  tg_true(g, e == LMLOSS_ERR_BAD_SHAPE, "merge of a row state: %s", lmloss_status_string(e));
  lmloss_context rc = ref_ctx();
  e = lmloss_divergence_state(&rc, &in, &o, &ok, &st);
  tg_true(g, e == LMLOSS_ERR_UNSUPPORTED, "REF: %s", lmloss_status_string(e));
  lmloss_tensor *all[] = {&s, &t, &st, &st8, &pf, &p4, &p8, &db, &l, &d};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    host_free(all[i]);
  free(ws);
}

int main(void) {
  tb_init();
  rng_seed(39);
  const div_case cases[] = {
      {LMLOSS_DIV_KL, 0, 1, 1, 0, 0, LMLOSS_REDUCE_MEAN},
      {LMLOSS_DIV_REVERSE_KL, 0, 1, 1, 0, 0, LMLOSS_REDUCE_NONE},
      {LMLOSS_DIV_JSD, 0.5f, 1, 1, 0, 0, LMLOSS_REDUCE_SUM},
      {LMLOSS_DIV_JSD, 0.3f, 0.7f, 1.3f, 0, 0, LMLOSS_REDUCE_NONE},
      {LMLOSS_DIV_JSD, 0.0f, 2.0f, 2.0f, 0, 0, LMLOSS_REDUCE_MEAN},
      {LMLOSS_DIV_JSD, 1.0f, 1, 0.5f, 0, 0, LMLOSS_REDUCE_NONE},
      {LMLOSS_DIV_TVD, 0, 1, 1, 0, 0, LMLOSS_REDUCE_NONE},
      {LMLOSS_DIV_TVD, 0, 0.8f, 0.8f, 0, 0.5f, LMLOSS_REDUCE_MEAN},
      {LMLOSS_DIV_KL, 0, 0.9f, 0.9f, 30, 0.3f, LMLOSS_REDUCE_NONE},
      {LMLOSS_DIV_JSD, 0.5f, 1, 1, 25, 0, LMLOSS_REDUCE_NONE},
      {LMLOSS_DIV_REVERSE_KL, 0, 1.5f, 1, 0, 1.0f, LMLOSS_REDUCE_SUM},
  };
  const char *kinds[] = {"KL", "reverse KL", "JSD", "TVD"};
  const int64_t Vs[] = {17, 1003, 5003};
  for (size_t cse = 0; cse < sizeof cases / sizeof *cases; cse++) {
    const div_case *dc = &cases[cse];
    char name[128];
    snprintf(name, sizeof name, "%s beta %g, T %g/%g, softcap %g, hard %g", kinds[dc->kind],
             dc->beta, dc->ts, dc->tt, dc->cap, dc->hard);
    tgroup g;
    tg_begin(&g, name);
    for (size_t v = 0; v < 3; v++)
      for (size_t k = 0; k < sizeof shard_counts / sizeof *shard_counts; k++)
        run(&g, Vs[v] > 2000 ? 14 : 21, Vs[v], shard_counts[k], (int)((v + k) % MERGE_ORDERS), dc);
    /* shards of a row wide enough for CUDA's one-sweep one-shot call */
    run(&g, 8, WIDE_V, 2, (int)(cse % MERGE_ORDERS), dc);
    tg_end(&g);
  }
  tgroup g;
  tg_begin(&g, "bad input");
  bad_inputs(&g);
  tg_end(&g);
  return test_finish();
}
