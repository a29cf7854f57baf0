/*
 * test_determinism.c - every public op gives bitwise identical results run
 * to run on the backend under test, and on the CPU across thread counts.
 *
 * Each case (an op with its inputs and options) runs several times; every
 * output (the whole allocation: padding between rows included) must match
 * the first run's byte for byte (memcmp), NaN payloads included.
 *   cpu:  lmloss_context.num_threads = 1, 2, 3, 4, 7, 0 (OpenMP's default),
 *         then 1 again; the first run (1 thread) is the reference.
 *   cuda: three runs on the default stream.
 * Before every run the workspace is filled with a different byte pattern,
 * so a result that depends on workspace bytes it did not write differs.
 *
 * Ops: cross-entropy (forward with lse/entropy/argmax; fused forward and
 * backward with dlogits separate or in place; backward from dloss) under
 * plain options, label smoothing + class weights + z-loss + token weights +
 * softcap/temperature/scale with reductions NONE, SUM and MEAN (sparse
 * supervision on SUM), and DFT with SUM_OVER_ITEMS; log-probs K = 1 and
 * K = 3 with mask, entropy and saved statistics; entropy; the log-probs
 * backward from dlogp and dentropy, with and without statistics,
 * dentropy only, in place; softmax and log-softmax and their backward; the
 * fused linear head (CE forward, fused, backward; log-probs forward and
 * backward with and without statistics; scale_grads) with the default
 * memory budget and with chunks of about 3 rows. Heads are F32 (the CPU's
 * only kind); on cuda BF16 heads too.
 *
 * Rows: N(0, 2) logits; every 8th row from row 1 has its target leading
 * the row by 30, from row 3 by 1000 (the fused head: by about that, through
 * a hidden dimension of the row's own), and from row 5 is ignored
 * (ignore_index) or masked out. cpu: small shapes (it runs in CI under
 * ASan + UBSan too); cuda adds N = 64 with V = 40001 and 151936, bf16 and
 * f32, so that a row spans many CTAs / a cluster.
 */
#include "support/testing.h"

enum { CE, CE_BWD, LP, ENT, LP_BWD, SM, SM_BWD, LCE, LCE_BWD, LLP, LLP_BWD, LSCALE };
#define MAXO 8
#define IGNORE (-100)

typedef struct {
  int op;
  char label[128];
  /* inputs, host memory (views of the config's tensors); absent: data NULL */
  lmloss_tensor x, target, tw, cw, index, mask, dloss, dlogp, dent, stats, dy, scale;
  lmloss_tensor hidden, weight, bias;
  lmloss_ce_options opt;
  lmloss_transform tr;
  int log;
  int alias;        /* output whose memory is also the logits (in place); -1: none */
  int small_budget; /* fused head: a budget of about 3 rows a chunk */
  int64_t k;        /* fused head: indices per row, for the workspace size */
  int nout;
  lmloss_tensor out[MAXO]; /* templates: poisoned, or (alias) the logits' copy */
  const char *oname[MAXO];
} dcase;

/* ---- running a case ---- */

static void *ws_new(size_t n, int run) {
  static const unsigned char pat[] = {0x00, 0xff, 0x5a, 0xa5, 0x3c, 0x7f, 0x81, 0xc3};
  void *ws = dev_alloc_bytes(n);
  unsigned char *h = malloc(n ? n : 1);
  if (!h) {
    fprintf(stderr, "FAIL: out of memory\n");
    exit(1);
  }
  memset(h, pat[run % 8], n);
  dev_put(ws, h, n);
  free(h);
  return ws;
}

/* The smallest memory budget that holds one row of the fused head. */
static size_t one_row_budget(const lmloss_head *h, const lmloss_head_grads *gr, int64_t k) {
  lmloss_head_options ho = lmloss_head_options_default();
  size_t lo = 1, hi = (size_t)1 << 40, b;
  while (lo < hi) {
    ho.memory_budget = lo + (hi - lo) / 2;
    if (lmloss_linear_workspace_size(h, &ho, gr, k, &b) == LMLOSS_OK)
      hi = ho.memory_budget;
    else
      lo = ho.memory_budget + 1;
  }
  return lo;
}

/* One call on the backend under test; res: host copies of the output
 * templates, filled with the results. */
static lmloss_status run(const dcase *c, const lmloss_context *ctx, int rn, lmloss_tensor *res) {
  lmloss_tensor d[MAXO];
  memset(d, 0, sizeof d);
  for (int k = 0; k < c->nout; k++)
    d[k] = dev_clone(&res[k]);
  lmloss_tensor x = c->alias >= 0 ? d[c->alias] : dev_clone(&c->x);
  lmloss_tensor tg = dev_clone(&c->target), tw = dev_clone(&c->tw), cw = dev_clone(&c->cw);
  lmloss_tensor ix = dev_clone(&c->index), mk = dev_clone(&c->mask), dl = dev_clone(&c->dloss);
  lmloss_tensor dlp = dev_clone(&c->dlogp), de = dev_clone(&c->dent), st = dev_clone(&c->stats);
  lmloss_tensor dy = dev_clone(&c->dy), sc = dev_clone(&c->scale);
  lmloss_head h = {dev_clone(&c->hidden), dev_clone(&c->weight), dev_clone(&c->bias)};
  lmloss_status s = LMLOSS_ERR_BAD_OPTION;
  void *ws = NULL;
  size_t wsb = 0;
  switch (c->op) {
  case CE:
  case CE_BWD: {
    wsb = lmloss_cross_entropy_workspace_size(c->x.rows);
    ws = ws_new(wsb, rn);
    lmloss_ce_inputs in = {x, tg, tw, cw};
    if (c->op == CE) {
      lmloss_ce_outputs o = {d[0], d[1], d[2], d[3], d[4]};
      s = lmloss_cross_entropy(ctx, &in, &c->opt, &o, ws, wsb);
    } else {
      s = lmloss_cross_entropy_backward(ctx, &in, &c->opt, &dl, &d[0], ws, wsb);
    }
    break;
  }
  case LP: s = lmloss_log_probs(ctx, &x, &ix, &mk, &c->tr, &d[0], &d[1], &d[2]); break;
  case ENT: s = lmloss_entropy(ctx, &x, &c->tr, &d[0]); break;
  case LP_BWD:
    s = lmloss_log_probs_backward(ctx, &x, &ix, &mk, &c->tr, &dlp, &de, &d[0], &st);
    break;
  case SM: s = lmloss_softmax(ctx, &x, c->log, &d[0]); break;
  case SM_BWD: s = lmloss_softmax_backward(ctx, &x, &dy, c->log, &d[0]); break;
  default: {
    lmloss_head_options ho = lmloss_head_options_default();
    lmloss_head_grads gr = {{0}, {0}, {0}};
    if (c->op == LCE)
      gr = (lmloss_head_grads){d[4], d[5], d[6]};
    else if (c->op != LLP)
      gr = (lmloss_head_grads){d[0], d[1], d[2]};
    if (c->op == LSCALE) {
      s = lmloss_linear_scale_grads(ctx, &h, &gr, &sc);
      break;
    }
    if (c->small_budget) ho.memory_budget = 3 * one_row_budget(&h, &gr, c->k);
    s = lmloss_linear_workspace_size(&h, &ho, &gr, c->k, &wsb);
    if (s != LMLOSS_OK) break;
    ws = ws_new(wsb, rn);
    if (c->op == LCE) {
      lmloss_ce_outputs o = {d[0], d[1], d[2], d[3], {0}};
      s = lmloss_linear_cross_entropy(ctx, &h, &tg, &tw, &cw, &c->opt, &ho, &o, &gr, ws, wsb);
    } else if (c->op == LCE_BWD) {
      s = lmloss_linear_cross_entropy_backward(ctx, &h, &tg, &tw, &cw, &c->opt, &ho, &dl, &gr, ws,
                                               wsb);
    } else if (c->op == LLP) {
      s = lmloss_linear_log_probs(ctx, &h, &ix, &mk, &c->tr, &ho, &d[0], &d[1], &d[2], ws, wsb);
    } else {
      s = lmloss_linear_log_probs_backward(ctx, &h, &ix, &mk, &c->tr, &ho, &dlp, &de, &st, &gr, ws,
                                           wsb);
    }
  }
  }
  for (int k = 0; k < c->nout; k++)
    dev_fetch(&res[k], &d[k]), dev_free(&d[k]);
  if (c->alias < 0) dev_free(&x);
  dev_free(&tg), dev_free(&tw), dev_free(&cw), dev_free(&ix), dev_free(&mk), dev_free(&dl);
  dev_free(&dlp), dev_free(&de), dev_free(&st), dev_free(&dy), dev_free(&sc);
  dev_free(&h.hidden), dev_free(&h.weight), dev_free(&h.bias);
  if (ws) dev_free_bytes(ws);
  return s;
}

/* ---- comparing ---- */

static size_t esize(lmloss_dtype dt) {
  return dt == LMLOSS_I64                        ? 8
         : dt == LMLOSS_BF16 || dt == LMLOSS_F16 ? 2
         : dt == LMLOSS_BOOL                     ? 1
                                                 : 4;
}

static size_t span_bytes(const lmloss_tensor *t) {
  return (size_t)(t->rows * t->row_stride) * esize(t->dtype);
}

/* Entries (whole row spans, padding included) in which got and want
 * differ bytewise; *first: the first of them. */
static size_t differ(const lmloss_tensor *want, const lmloss_tensor *got, size_t *first) {
  const size_t n = span_bytes(want), es = esize(want->dtype);
  const unsigned char *a = want->data, *b = got->data;
  size_t diff = 0;
  *first = 0;
  if (memcmp(a, b, n) == 0) return 0;
  for (size_t e = n / es; e-- > 0;)
    if (memcmp(a + e * es, b + e * es, es)) diff++, *first = e;
  return diff;
}

/* got == want byte for byte; otherwise names the first differing entry. */
static int bitwise(tgroup *g, const char *label, const char *what, const char *run,
                   const lmloss_tensor *want, const lmloss_tensor *got) {
  size_t first, diff = differ(want, got, &first);
  if (!diff) return tg_true(g, 1, "");
  const int64_t i = (int64_t)first / want->row_stride, j = (int64_t)first % want->row_stride;
  const int pad = j >= want->cols;
  return tg_true(g, 0,
                 "%s: %s differs from the first run (%s): %zu entries, first [%lld,%lld]%s %.9g "
                 "vs %.9g",
                 label, what, run, diff, (long long)i, (long long)j, pad ? " (row padding)" : "",
                 pad ? 0.0 : tget(got, i, j), pad ? 0.0 : tget(want, i, j));
}

static void free_outs(const dcase *c, lmloss_tensor *t) {
  for (int k = 0; k < c->nout; k++)
    host_free(&t[k]);
}

/* Runs a case on every run of the backend under test; compares bitwise. */
static void check_case(tgroup *g, const dcase *c) {
  static const int threads[] = {1, 2, 3, 4, 7, 0, 1};
  const int nrun = tb_is_cuda() ? 3 : 7;
  lmloss_tensor first[MAXO], cur[MAXO];
  for (int r = 0; r < nrun; r++) {
    lmloss_context ctx = tb_ctx();
    if (!tb_is_cuda()) ctx.num_threads = threads[r];
    char run_name[48];
    snprintf(run_name, sizeof run_name, tb_is_cuda() ? "run %d" : "run %d, num_threads %d", r + 1,
             threads[r]);
    lmloss_tensor *res = r == 0 ? first : cur;
    for (int k = 0; k < c->nout; k++)
      res[k] = host_clone(&c->out[k]);
    lmloss_status s = run(c, &ctx, r, res);
    if (!tg_true(g, s == LMLOSS_OK, "%s: %s: status %s (%s)", c->label, run_name,
                 lmloss_status_string(s), lmloss_last_error())) {
      if (r > 0) free_outs(c, cur);
      break;
    }
    for (int k = 0; k < c->nout; k++) {
      if (!c->out[k].data) continue;
      if (r == 0)
        tg_true(g, !same_bytes(&first[k], &c->out[k]), "%s: %s was not written", c->label,
                c->oname[k]);
      else
        bitwise(g, c->label, c->oname[k], run_name, &first[k], &cur[k]);
    }
    if (r > 0) free_outs(c, cur);
  }
  free_outs(c, first);
}

/* ---- inputs ---- */

typedef struct {
  int64_t N, V, stride;
  lmloss_dtype dt;
} rcfg;

typedef struct {
  int64_t N, V, H0;
  lmloss_dtype dt;
} hcfg;

static int role(int64_t i) { return (int)(i % 8); } /* 1: +30, 3: +1000, 5: ignored */
static int ignored(int64_t i) { return role(i) == 5; }

static lmloss_tensor poisoned(lmloss_dtype dt, int64_t rows, int64_t cols, int64_t stride) {
  lmloss_tensor t = host_new(dt, rows, cols, stride);
  host_poison(&t);
  return t;
}

static lmloss_tensor f32_random(int64_t rows, int64_t cols, double lo, double width) {
  lmloss_tensor t = host_new(LMLOSS_F32, rows, cols, cols);
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++)
      tset(&t, i, j, lo + width * rng_uniform());
  return t;
}

/* Random targets (ignored rows: IGNORE) and distinct other indices. */
static void targets(int64_t N, int64_t V, int64_t *tv) {
  for (int64_t i = 0; i < N; i++)
    tv[i] = ignored(i) ? IGNORE : rng_int(V);
}

static lmloss_tensor index_of(const int64_t *tv, int64_t N, int64_t V, int64_t K,
                              lmloss_dtype idt) {
  lmloss_tensor t = host_new(idt, N, K, K);
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < K; k++)
      tset(&t, i, k, (double)(k == 0 && tv[i] >= 0 ? tv[i] : rng_int(V)));
  return t;
}

static lmloss_tensor mask_of(int64_t N) {
  lmloss_tensor t = host_new(LMLOSS_BOOL, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&t, i, 0, !ignored(i));
  return t;
}

static lmloss_transform transform3(void) {
  lmloss_transform t = lmloss_transform_default();
  t.logit_scale = 1.1f, t.softcap = 30.0f, t.temperature = 1.3f;
  return t;
}

/* CE option sets: 0 plain (MEAN); 1-3 everything with NONE / SUM / MEAN
 * (token and class weights with them); 4 DFT with SUM_OVER_ITEMS. */
static const char *set_name[] = {"plain", "full-none", "full-sum", "full-mean", "dft-items"};
static lmloss_ce_options ce_set(int s) {
  lmloss_ce_options o = lmloss_ce_options_default();
  if (s >= 1 && s <= 3) {
    o.reduction = (lmloss_reduction)(s - 1);
    o.label_smoothing = 0.1f, o.z_loss = 1e-3f, o.grad_output = 0.75f;
    o.transform.logit_scale = 1.25f, o.transform.softcap = 20.0f;
    o.transform.temperature = 0.9f;
    o.zero_ignored_rows = s != 2; /* SUM: ignored gradient rows left untouched */
  } else if (s == 4) {
    o.dft = 1, o.reduction = LMLOSS_REDUCE_SUM_OVER_ITEMS, o.num_items = 17.0;
    o.label_smoothing = 0.05f;
  }
  return o;
}
static int set_weights(int s) { return s >= 1 && s <= 3; }

static lmloss_tensor dloss_for(const lmloss_ce_options *o, int64_t N) {
  return f32_random(o->reduction == LMLOSS_REDUCE_NONE ? N : 1, 1, 0.5, 1.0);
}

static char group_name[160];

static void begin(tgroup *g, const char *what, const char *dt, int64_t N, int64_t V) {
  snprintf(group_name, sizeof group_name, "determinism: %s %s %lldx%lld", what, dt, (long long)N,
           (long long)V);
  tg_begin(g, group_name);
}

/* ---- the row ops ---- */

static void row_ops(const rcfg *rc, uint64_t seed) {
  const int64_t N = rc->N, V = rc->V, S = rc->stride;
  const lmloss_dtype dt = rc->dt;
  const char *dn = dt_name(dt);
  rng_seed(seed);
  int64_t *tv = malloc(sizeof(int64_t) * (size_t)N);
  targets(N, V, tv);
  lmloss_tensor x = poisoned(dt, N, V, S);
  fill_logits(&x, 2.0, NULL, -1);
  for (int64_t i = 0; i < N; i++) {
    if (role(i) != 1 && role(i) != 3) continue;
    double mx = -INFINITY;
    for (int64_t j = 0; j < V; j++)
      if (j != tv[i] && tget(&x, i, j) > mx) mx = tget(&x, i, j);
    tset(&x, i, tv[i], mx + (role(i) == 1 ? 30.0 : 1000.0));
  }
  lmloss_tensor tgt = host_new(LMLOSS_I64, N, 1, 1), tgt32 = host_new(LMLOSS_I32, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&tgt, i, 0, (double)tv[i]), tset(&tgt32, i, 0, (double)tv[i]);
  lmloss_tensor tw = f32_random(N, 1, 0.25, 1.5), cw = f32_random(V, 1, 0.5, 1.0);
  for (int64_t j = 0; j < V; j += 10)
    tset(&cw, j, 0, 0.0);
  tgroup g;

  /* cross-entropy */
  begin(&g, "cross-entropy", dn, N, V);
  lmloss_tensor dls[5];
  for (int s = 0; s < 5; s++) {
    lmloss_ce_options o = ce_set(s);
    dls[s] = dloss_for(&o, N);
    for (int mode = 0; mode < 4; mode++) { /* fwd, fused, fused in place, bwd */
      if (mode == 2 && s != 3 && s != 4) continue;
      dcase c;
      memset(&c, 0, sizeof c);
      c.op = mode == 3 ? CE_BWD : CE, c.opt = o, c.alias = -1, c.x = x;
      c.target = s == 4 ? tgt32 : tgt;
      if (set_weights(s)) c.tw = tw, c.cw = cw;
      snprintf(c.label, sizeof c.label, "ce %s %s",
               (const char *[]){"fwd", "fused", "inplace", "bwd"}[mode], set_name[s]);
      if (mode == 3) {
        c.dloss = dls[s], c.nout = 1, c.oname[0] = "dlogits";
        c.out[0] = poisoned(s == 1 ? LMLOSS_F32 : dt, N, V, S);
      } else {
        c.nout = 5;
        c.out[0] = poisoned(LMLOSS_F32, o.reduction == LMLOSS_REDUCE_NONE ? N : 1, 1, 1);
        c.out[1] = poisoned(LMLOSS_F32, N, 1, 1), c.out[2] = poisoned(LMLOSS_F32, N, 1, 1);
        c.out[3] = poisoned(LMLOSS_I64, N, 1, 1);
        if (mode == 1) c.out[4] = poisoned(s == 1 ? LMLOSS_F32 : dt, N, V, S);
        if (mode == 2) c.out[4] = host_clone(&x), c.alias = 4;
        c.oname[0] = "loss", c.oname[1] = "lse", c.oname[2] = "entropy", c.oname[3] = "argmax";
        c.oname[4] = "dlogits";
      }
      check_case(&g, &c);
      free_outs(&c, c.out);
    }
  }
  for (int s = 0; s < 5; s++)
    host_free(&dls[s]);
  tg_end(&g);

  /* log-probs, entropy and the log-probs backward */
  begin(&g, "log-probs", dn, N, V);
  lmloss_tensor mask = mask_of(N);
  lmloss_tensor idx1 = index_of(tv, N, V, 1, LMLOSS_I64), idx3 = index_of(tv, N, V, 3, LMLOSS_I32);
  lmloss_tensor stats = {0};
  for (int K = 1; K <= 3; K += 2) {
    dcase c;
    memset(&c, 0, sizeof c);
    c.op = LP, c.alias = -1, c.x = x, c.mask = mask, c.nout = 3;
    c.index = K == 1 ? idx1 : idx3;
    c.tr = K == 1 ? lmloss_transform_default() : transform3();
    snprintf(c.label, sizeof c.label, "log-probs K=%d", K);
    c.out[0] = poisoned(K == 1 ? LMLOSS_F32 : dt, N, K, K);
    c.out[1] = poisoned(LMLOSS_F32, N, 1, 1);
    c.out[2] = poisoned(LMLOSS_F32, N, LMLOSS_ROW_STATS, LMLOSS_ROW_STATS);
    c.oname[0] = "logp", c.oname[1] = "entropy", c.oname[2] = "stats";
    check_case(&g, &c);
    if (K == 3) { /* the statistics the backward cases read */
      lmloss_context ctx = tb_ctx();
      lmloss_tensor r[MAXO];
      for (int k = 0; k < c.nout; k++)
        r[k] = host_clone(&c.out[k]);
      lmloss_status s = run(&c, &ctx, 0, r);
      tg_true(&g, s == LMLOSS_OK, "log-probs forward for stats: %s", lmloss_status_string(s));
      stats = host_clone(&r[2]);
      free_outs(&c, r);
    }
    free_outs(&c, c.out);
  }
  {
    dcase c;
    memset(&c, 0, sizeof c);
    c.op = ENT, c.alias = -1, c.x = x, c.tr = transform3(), c.nout = 1;
    snprintf(c.label, sizeof c.label, "entropy");
    c.out[0] = poisoned(LMLOSS_F32, N, 1, 1), c.oname[0] = "entropy";
    check_case(&g, &c);
    free_outs(&c, c.out);
  }
  lmloss_tensor dlogp1 = f32_random(N, 1, -1.0, 2.0), dlogp3 = f32_random(N, 3, -1.0, 2.0);
  lmloss_tensor dent = f32_random(N, 1, -1.0, 2.0);
  for (int v = 0; v < 5; v++) {
    /* 0: K=3 dlogp + dentropy; 1: the same from stats; 2: dentropy only,
     * stats; 3: K=1 dlogp only, no mask, default transform; 4: 1 in place */
    static const char *vn[] = {"K=3 dlogp+dentropy", "K=3 dlogp+dentropy stats",
                               "dentropy-only stats", "K=1 dlogp", "K=3 in place stats"};
    dcase c;
    memset(&c, 0, sizeof c);
    c.op = LP_BWD, c.alias = -1, c.x = x, c.nout = 1, c.oname[0] = "dlogits";
    c.tr = v == 3 ? lmloss_transform_default() : transform3();
    if (v != 3) c.mask = mask;
    if (v == 3) c.index = idx1, c.dlogp = dlogp1;
    if (v == 0 || v == 1 || v == 4) c.index = idx3, c.dlogp = dlogp3;
    if (v != 3) c.dent = dent;
    if (v == 1 || v == 2 || v == 4) c.stats = stats;
    snprintf(c.label, sizeof c.label, "log-probs bwd %s", vn[v]);
    if (v == 4)
      c.out[0] = host_clone(&x), c.alias = 0;
    else
      c.out[0] = poisoned(v == 0 ? LMLOSS_F32 : dt, N, V, S);
    check_case(&g, &c);
    free_outs(&c, c.out);
  }
  host_free(&dlogp1), host_free(&dlogp3), host_free(&dent), host_free(&stats);
  host_free(&idx1), host_free(&idx3), host_free(&mask);
  tg_end(&g);

  /* softmax, log-softmax and their backward (from the forward's y) */
  begin(&g, "softmax", dn, N, V);
  lmloss_tensor dy = poisoned(dt, N, V, S);
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < V; j++)
      tset(&dy, i, j, rng_normal());
  for (int log = 0; log <= 1; log++) {
    dcase c;
    memset(&c, 0, sizeof c);
    c.op = SM, c.alias = -1, c.x = x, c.log = log, c.nout = 1, c.oname[0] = "y";
    c.out[0] = poisoned(dt, N, V, S);
    snprintf(c.label, sizeof c.label, "%s", log ? "log-softmax" : "softmax");
    check_case(&g, &c);
    lmloss_context ctx = tb_ctx();
    lmloss_tensor y = host_clone(&c.out[0]);
    lmloss_status s = run(&c, &ctx, 0, &y);
    tg_true(&g, s == LMLOSS_OK, "softmax forward for y: %s", lmloss_status_string(s));
    free_outs(&c, c.out);
    c.op = SM_BWD, c.x = y, c.dy = dy, c.oname[0] = "dx";
    c.out[0] = poisoned(log ? dt : LMLOSS_F32, N, V, S);
    snprintf(c.label, sizeof c.label, "%s backward", log ? "log-softmax" : "softmax");
    check_case(&g, &c);
    free_outs(&c, c.out);
    host_free(&y);
  }
  host_free(&dy);
  tg_end(&g);

  host_free(&x), host_free(&tgt), host_free(&tgt32), host_free(&tw), host_free(&cw);
  free(tv);
}

/* ---- the fused linear head ---- */

static void head_ops(const hcfg *hc, uint64_t seed) {
  const int64_t N = hc->N, V = hc->V, H0 = hc->H0, H = H0 + N;
  const lmloss_dtype dt = hc->dt;
  rng_seed(seed);
  int64_t *tv = malloc(sizeof(int64_t) * (size_t)N);
  targets(N, V, tv);
  /* row i owns hidden dimension H0 + i: W[y_i][H0 + i] lifts its target */
  lmloss_tensor hid = poisoned(dt, N, H, H + 3), w = poisoned(dt, V, H, H + 1);
  lmloss_tensor b = host_new(dt, V, 1, 1);
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < H; k++)
      tset(&hid, i, k, k < H0 ? rng_normal() : k == H0 + i);
  const double sd = 2.0 / sqrt((double)H0);
  for (int64_t j = 0; j < V; j++) {
    for (int64_t k = 0; k < H; k++)
      tset(&w, j, k, k < H0 ? sd * rng_normal() : 0.0);
    tset(&b, j, 0, 0.5 * rng_normal());
  }
  for (int64_t i = 0; i < N; i++)
    if (role(i) == 1 || role(i) == 3) tset(&w, tv[i], H0 + i, role(i) == 1 ? 40.0 : 1010.0);
  lmloss_tensor tgt = host_new(LMLOSS_I64, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&tgt, i, 0, (double)tv[i]);
  lmloss_tensor tw = f32_random(N, 1, 0.25, 1.5), cw = f32_random(V, 1, 0.5, 1.0);
  lmloss_tensor mask = mask_of(N), idx3 = index_of(tv, N, V, 3, LMLOSS_I64);
  lmloss_tensor dlogp = f32_random(N, 3, -1.0, 2.0), dent = f32_random(N, 1, -1.0, 2.0);
  const lmloss_dtype gdt = dt; /* dweight / dbias: the head's dtype (F32 on full-sum) */
  tgroup g;
  begin(&g, "fused head", dt_name(dt), N, V);

  lmloss_tensor dls[4] = {{0}};
  for (int s = 1; s <= 4; s++) {
    lmloss_ce_options o = ce_set(s);
    dls[s - 1] = dloss_for(&o, N);
    for (int mode = 0; mode < 3; mode++) /* fwd, fused, bwd */
      for (int sb = 0; sb <= 1; sb++) {
        if (mode == 0 && (s != 1 || sb)) continue;
        if (mode == 2 && s != 1 && s != 3) continue;
        if (s == 4 && sb) continue;
        dcase c;
        memset(&c, 0, sizeof c);
        c.alias = -1, c.opt = o, c.k = 1, c.small_budget = sb;
        c.hidden = hid, c.weight = w, c.bias = b, c.target = tgt;
        if (set_weights(s)) c.tw = tw, c.cw = cw;
        snprintf(c.label, sizeof c.label, "linear ce %s %s%s",
                 (const char *[]){"fwd", "fused", "bwd"}[mode], set_name[s],
                 sb ? " 3-row chunks" : "");
        const lmloss_dtype wdt = s == 2 ? LMLOSS_F32 : gdt;
        lmloss_tensor *gr = c.out;
        if (mode == 2) {
          c.op = LCE_BWD, c.dloss = dls[s - 1], c.nout = 3;
        } else {
          c.op = LCE, c.nout = mode == 1 ? 7 : 4, gr = c.out + 4;
          c.out[0] = poisoned(LMLOSS_F32, o.reduction == LMLOSS_REDUCE_NONE ? N : 1, 1, 1);
          c.out[1] = poisoned(LMLOSS_F32, N, 1, 1), c.out[2] = poisoned(LMLOSS_F32, N, 1, 1);
          c.out[3] = poisoned(LMLOSS_I64, N, 1, 1);
          c.oname[0] = "loss", c.oname[1] = "lse", c.oname[2] = "entropy", c.oname[3] = "argmax";
        }
        if (mode != 0) {
          gr[0] = poisoned(dt, N, H, H + 2), gr[1] = poisoned(wdt, V, H, H);
          gr[2] = poisoned(wdt, V, 1, 1);
          c.oname[gr - c.out] = "dhidden", c.oname[gr - c.out + 1] = "dweight";
          c.oname[gr - c.out + 2] = "dbias";
        }
        check_case(&g, &c);
        free_outs(&c, c.out);
      }
  }
  for (int s = 0; s < 4; s++)
    host_free(&dls[s]);

  lmloss_tensor stats = {0};
  for (int sb = 0; sb <= 1; sb++) {
    dcase c;
    memset(&c, 0, sizeof c);
    c.op = LLP, c.alias = -1, c.k = 3, c.small_budget = sb, c.tr = transform3();
    c.hidden = hid, c.weight = w, c.bias = b, c.index = idx3, c.mask = mask, c.nout = 3;
    snprintf(c.label, sizeof c.label, "linear log-probs K=3%s", sb ? " 3-row chunks" : "");
    c.out[0] = poisoned(LMLOSS_F32, N, 3, 3), c.out[1] = poisoned(LMLOSS_F32, N, 1, 1);
    c.out[2] = poisoned(LMLOSS_F32, N, LMLOSS_ROW_STATS, LMLOSS_ROW_STATS);
    c.oname[0] = "logp", c.oname[1] = "entropy", c.oname[2] = "stats";
    check_case(&g, &c);
    if (sb == 0) {
      lmloss_context ctx = tb_ctx();
      lmloss_tensor r[MAXO];
      for (int k = 0; k < c.nout; k++)
        r[k] = host_clone(&c.out[k]);
      lmloss_status s = run(&c, &ctx, 0, r);
      tg_true(&g, s == LMLOSS_OK, "linear log-probs for stats: %s", lmloss_status_string(s));
      stats = host_clone(&r[2]);
      free_outs(&c, r);
    }
    free_outs(&c, c.out);
  }
  for (int v = 0; v < 3; v++) /* dlogp + dentropy; the same from stats; dentropy only, stats */
    for (int sb = 0; sb <= 1; sb++) {
      dcase c;
      memset(&c, 0, sizeof c);
      c.op = LLP_BWD, c.alias = -1, c.k = v == 2 ? 0 : 3, c.small_budget = sb;
      c.tr = transform3(), c.hidden = hid, c.weight = w, c.bias = b, c.mask = mask, c.dent = dent;
      if (v < 2) c.index = idx3, c.dlogp = dlogp;
      if (v > 0) c.stats = stats;
      snprintf(c.label, sizeof c.label, "linear log-probs bwd %s%s",
               (const char *[]){"dlogp+dentropy", "dlogp+dentropy stats", "dentropy-only stats"}[v],
               sb ? " 3-row chunks" : "");
      c.nout = 3;
      c.out[0] = poisoned(dt, N, H, H), c.out[1] = poisoned(gdt, V, H, H + 1);
      c.out[2] = poisoned(gdt, V, 1, 1);
      c.oname[0] = "dhidden", c.oname[1] = "dweight", c.oname[2] = "dbias";
      check_case(&g, &c);
      free_outs(&c, c.out);
    }
  {
    dcase c;
    memset(&c, 0, sizeof c);
    c.op = LSCALE, c.alias = -1, c.hidden = hid, c.weight = w, c.bias = b, c.nout = 3;
    c.scale = f32_random(1, 1, 0.37, 0.0);
    snprintf(c.label, sizeof c.label, "linear scale_grads");
    c.out[0] = poisoned(dt, N, H, H), c.out[1] = poisoned(gdt, V, H, H);
    c.out[2] = poisoned(gdt, V, 1, 1);
    for (int k = 0; k < 3; k++)
      for (int64_t i = 0; i < c.out[k].rows; i++)
        for (int64_t j = 0; j < c.out[k].cols; j++)
          tset(&c.out[k], i, j, rng_normal());
    c.oname[0] = "dhidden", c.oname[1] = "dweight", c.oname[2] = "dbias";
    check_case(&g, &c);
    free_outs(&c, c.out);
    host_free(&c.scale);
  }
  tg_end(&g);
  host_free(&stats), host_free(&hid), host_free(&w), host_free(&b), host_free(&tgt);
  host_free(&tw), host_free(&cw), host_free(&mask), host_free(&idx3), host_free(&dlogp);
  host_free(&dent);
  free(tv);
}

/* The comparison itself sees one flipped byte (so the groups above can fail). */
static void self_check(void) {
  tgroup g;
  tg_begin(&g, "determinism: the comparison sees a flipped bit");
  lmloss_tensor a = poisoned(LMLOSS_BF16, 3, 5, 7);
  for (int64_t i = 0; i < 3; i++)
    for (int64_t j = 0; j < 5; j++)
      tset(&a, i, j, rng_normal());
  lmloss_tensor b = host_clone(&a);
  size_t first, n = differ(&a, &b, &first);
  tg_true(&g, n == 0, "an identical copy differs in %zu entries", n);
  ((unsigned char *)b.data)[(2 * 7 + 1) * 2 + 1] ^= 1; /* entry [2, 1]: its exponent's low bit */
  n = differ(&a, &b, &first);
  tg_true(&g, n == 1 && first == 2 * 7 + 1, "flipped entry [2, 1]: %zu entries differ, first %zu",
          n, first);
  ((unsigned char *)b.data)[(2 * 7 + 6) * 2] ^= 0x80; /* row padding [2, 6] */
  n = differ(&a, &b, &first);
  tg_true(&g, n == 2 && first == 2 * 7 + 1, "and the padding [2, 6]: %zu entries differ", n);
  host_free(&a), host_free(&b);
  tg_end(&g);
}

int main(void) {
  tb_init();
  self_check();
  static const rcfg small[] = {
      {24, 1000, 1005, LMLOSS_F32}, {16, 1500, 1504, LMLOSS_BF16}, {16, 517, 517, LMLOSS_F16}};
  static const rcfg large[] = {{64, 40001, 40008, LMLOSS_BF16},
                               {64, 40001, 40001, LMLOSS_F32},
                               {64, 151936, 151936, LMLOSS_BF16},
                               {64, 151936, 151936, LMLOSS_F32}};
  for (int i = 0; i < 3; i++)
    row_ops(&small[i], 100 + i);
  if (tb_is_cuda())
    for (int i = 0; i < 4; i++)
      row_ops(&large[i], 200 + i);
  static const hcfg hsmall = {16, 600, 24, LMLOSS_F32};
  head_ops(&hsmall, 300);
  if (tb_is_cuda()) {
    static const hcfg hlarge[] = {{16, 600, 24, LMLOSS_BF16},
                                  {64, 40001, 64, LMLOSS_F32},
                                  {64, 40001, 64, LMLOSS_BF16},
                                  {64, 151936, 64, LMLOSS_BF16},
                                  {64, 151936, 64, LMLOSS_F32}};
    for (int i = 0; i < 5; i++)
      head_ops(&hlarge[i], 400 + i);
  }
  return test_finish();
}
