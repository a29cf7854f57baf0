/*
 * test_fused_linear.c - the fused linear head (lmloss_linear_*) of the
 * backend under test against a float64 oracle: logits = hidden W^T + bias
 * formed in double from the (already rounded) inputs; the REF backend on
 * those logits rounded to fp32 gives the per-row values and dlogits; dhidden,
 * dweight and dbias are formed in double from REF's dlogits.
 *
 * Accuracy contract of the fused head (tolerances written once, here):
 *   F32 heads: loss, lse, entropy, log-probs and dhidden within FL_TOL
 *     relative per row (norm over the row; a reduced loss as one value),
 *     dweight and dbias within FL_TOL Frobenius-relative as whole tensors.
 *   BF16 heads (CUDA only): per-row values as for F32 (the GEMMs accumulate
 *     in fp32 into an fp32 slab); each gradient tensor g, Frobenius, within
 *     BF16_FACTOR times the error of rounding the exact gradient e to bf16:
 *     |g - e| <= BF16_FACTOR |bf16(e) - e|.
 *   Chunking: 1-row, 3-row and default chunks agree within CHUNK_TOL (fp32
 *     outputs) on rows that are not peaked: a GEMM's summation order (cuBLAS
 *     picks its algorithm by the chunk's row count) moves a length-H dot
 *     product by up to about H 2^-24 = 1e-5 at the H used here, and a peaked
 *     row turns one ulp of a large logit into ~1e-6 relative on its tiny
 *     loss and entropy. 16-bit outputs agree within two of their roundings
 *     (CHUNK_TOL16), and so does a 16-bit head's dW in any dtype: it is
 *     formed from 16-bit dlogits, which more than one chunk recomputes
 *     (outs_agree).
 *   Rows the loss ignores (or masks) read exactly 0, gradients included.
 * Peaked rows are made exactly: row i owns hidden dimension H0 + i (h_i = 1
 * there, 0 in every other row) and W[y_i][H0 + i] is set so that logit y_i
 * leads the row's max of the others by the margin; targets are distinct.
 */
#include "support/head.h"

#define CHUNK_TOL 1e-5
#define CHUNK_TOL16 0x1p-7

enum { FWD, FUSED, BWD };
static const char *mode_name[] = {"fwd", "fused", "bwd"};
enum { G_ALL, G_NO_W, G_DH, G_NO_DH }; /* requested gradients */
static const char *grads_name[] = {"all", "frozen-weight", "dhidden-only", "no-dhidden"};
static int want_dh(int g) { return g != G_NO_DH; }
static int want_dw(int g) { return g == G_ALL || g == G_NO_DH; }
static int want_db(int g) { return g != G_DH; }

/* Same results of two runs (chunking), within CHUNK_TOL. */
static void runs_agree(tgroup *g, const lmloss_tensor *a, const lmloss_tensor *b, int whole,
                       int via16, const char *what) {
  if (!a->data) return;
  double *r = to_f64(b);
  const double tol = a->dtype == LMLOSS_F32 && !via16 ? CHUNK_TOL : CHUNK_TOL16;
  if (whole)
    tensor_close(g, a, r, tol, 0, what);
  else
    rows_close(g, a, r, tol, what);
  free(r);
}

/* ---- the device side of a call ---- */

typedef struct {
  lmloss_tensor loss, lse, ent, amax; /* CE forward */
  lmloss_tensor logp;                 /* log-probs forward (ent shared) */
  lmloss_tensor dh, dw, db;
} outs;

static void outs_poison(outs *o) {
  lmloss_tensor *t[] = {&o->loss, &o->lse, &o->ent, &o->amax, &o->logp, &o->dh, &o->dw, &o->db};
  for (int i = 0; i < 8; i++)
    if (t[i]->data) host_poison(t[i]);
}

static outs outs_clone(const outs *o) {
  outs c = *o;
  lmloss_tensor *s[] = {&c.loss, &c.lse, &c.ent, &c.amax, &c.logp, &c.dh, &c.dw, &c.db};
  for (int i = 0; i < 8; i++)
    *s[i] = host_clone(s[i]);
  return c;
}

static int outs_same(const outs *a, const outs *b) {
  const lmloss_tensor *s[] = {&a->loss, &a->lse, &a->ent, &a->amax,
                              &a->logp, &a->dh,  &a->dw,  &a->db};
  const lmloss_tensor *t[] = {&b->loss, &b->lse, &b->ent, &b->amax,
                              &b->logp, &b->dh,  &b->dw,  &b->db};
  int ok = 1;
  for (int i = 0; i < 8; i++)
    if (s[i]->data) ok &= same_bytes(s[i], t[i]);
  return ok;
}

static void outs_restore(const outs *o, const outs *p) {
  const lmloss_tensor *s[] = {&o->loss, &o->lse, &o->ent, &o->amax,
                              &o->logp, &o->dh,  &o->dw,  &o->db};
  const lmloss_tensor *t[] = {&p->loss, &p->lse, &p->ent, &p->amax,
                              &p->logp, &p->dh,  &p->dw,  &p->db};
  for (int i = 0; i < 8; i++)
    if (s[i]->data) memcpy(s[i]->data, t[i]->data, tensor_bytes(s[i]));
}

static void outs_free(outs *o) {
  lmloss_tensor *s[] = {&o->loss, &o->lse, &o->ent, &o->amax, &o->logp, &o->dh, &o->dw, &o->db};
  for (int i = 0; i < 8; i++)
    host_free(s[i]);
}

/* How a call is made: the memory budget (0 = default), a workspace one
 * byte short of what lmloss_linear_workspace_size says, and whether
 * dweight and dbias are added to (lmloss_head_grads.accumulate). */
typedef struct {
  size_t budget;
  int ws_short, accumulate;
} how;

typedef struct {
  int kind; /* FWD / FUSED / BWD for CE; 10 + FWD / BWD for log-probs */
  const head_data *hd;
  const lmloss_tensor *labels, *tw, *cw, *mask, *dloss, *dlogp, *dent;
  const lmloss_ce_options *opt;
  const lmloss_transform *tr;
  int64_t k;
  lmloss_tensor *stats; /* log-probs: written by the forward, read by the backward */
} call_spec;

static lmloss_status call(const call_spec *s, how hw, outs *o);

/* The chunking does not change the results: run a against run b. head16:
 * a 16-bit head, whose dW comes from dlogits rounded to 16 bits; with more
 * than one chunk they are recomputed in vocab tiles (fp32 differences at
 * rounding level), and an element near a rounding boundary rounds the
 * other way, so dW agrees within 16-bit roundings, even in F32. */
static void outs_agree(tgroup *g, const outs *a, const outs *b, int head16) {
  runs_agree(g, &a->loss, &b->loss, 0, 0, "chunks: loss");
  runs_agree(g, &a->lse, &b->lse, 0, 0, "chunks: lse");
  runs_agree(g, &a->logp, &b->logp, 0, 0, "chunks: logp");
  runs_agree(g, &a->ent, &b->ent, 0, 0, "chunks: entropy");
  runs_agree(g, &a->dh, &b->dh, 0, 0, "chunks: dhidden");
  runs_agree(g, &a->dw, &b->dw, 1, head16, "chunks: dweight");
  runs_agree(g, &a->db, &b->db, 1, 0, "chunks: dbias");
  if (a->amax.data) tg_true(g, same_bytes(&a->amax, &b->amax), "chunks: argmax differs");
}

/* Too small a budget or workspace (bad[]): the status, outputs (fresh
 * copies of proto) untouched. */
static void too_small(tgroup *g, const call_spec *s, const how *bad, int nbad, const outs *proto) {
  for (int b = 0; b < nbad; b++) {
    outs p = outs_clone(proto), q = outs_clone(proto);
    lmloss_status st = call(s, bad[b], &p);
    tg_true(g, st == LMLOSS_ERR_WORKSPACE_TOO_SMALL && outs_same(&p, &q),
            "budget %zu%s: got %s, outputs untouched %d", bad[b].budget,
            bad[b].ws_short ? " with a workspace 1 byte short" : "", lmloss_status_string(st),
            outs_same(&p, &q));
    outs_free(&p), outs_free(&q);
  }
}

static lmloss_status call(const call_spec *s, how hw, outs *o) {
  lmloss_context ctx = tb_ctx();
  const head_data *hd = s->hd;
  lmloss_head h = {dev_clone(&hd->hidden), dev_clone(&hd->weight), dev_clone(&hd->bias)};
  lmloss_tensor none = {0};
  lmloss_tensor lab = s->labels ? dev_clone(s->labels) : none;
  lmloss_tensor tw = s->tw ? dev_clone(s->tw) : none, cw = s->cw ? dev_clone(s->cw) : none;
  lmloss_tensor mask = s->mask ? dev_clone(s->mask) : none;
  lmloss_tensor dloss = s->dloss ? dev_clone(s->dloss) : none;
  lmloss_tensor dlogp = s->dlogp ? dev_clone(s->dlogp) : none;
  lmloss_tensor dent = s->dent ? dev_clone(s->dent) : none;
  lmloss_tensor stats = s->stats ? dev_clone(s->stats) : none;
  outs d = *o;
  lmloss_tensor *src[] = {&o->loss, &o->lse, &o->ent, &o->amax, &o->logp, &o->dh, &o->dw, &o->db};
  lmloss_tensor *dst[] = {&d.loss, &d.lse, &d.ent, &d.amax, &d.logp, &d.dh, &d.dw, &d.db};
  for (int i = 0; i < 8; i++)
    *dst[i] = dev_clone(src[i]);
  lmloss_head_options ho = lmloss_head_options_default();
  ho.memory_budget = hw.budget;
  lmloss_head_grads gr = {d.dh, d.dw, d.db, hw.accumulate};
  size_t wsb = 0;
  if (lmloss_linear_workspace_size(&h, &ho, &gr, s->k, &wsb) != LMLOSS_OK)
    wsb = 1 << 16; /* the call itself must then fail */
  if (hw.ws_short) wsb -= 1;
  void *ws = dev_alloc_bytes(wsb);
  lmloss_status st;
  if (s->kind == FWD || s->kind == FUSED) {
    lmloss_ce_outputs out = {d.loss, d.lse, d.ent, d.amax, {0}};
    st = lmloss_linear_cross_entropy(&ctx, &h, &lab, &tw, &cw, s->opt, &ho, &out,
                                     s->kind == FUSED ? &gr : NULL, ws, wsb);
  } else if (s->kind == BWD) {
    st = lmloss_linear_cross_entropy_backward(&ctx, &h, &lab, &tw, &cw, s->opt, &ho, &dloss, &gr,
                                              ws, wsb);
  } else if (s->kind == 10 + FWD) {
    st = lmloss_linear_log_probs(&ctx, &h, &lab, &mask, s->tr, &ho, &d.logp, &d.ent, &stats, ws,
                                 wsb);
    if (s->stats) dev_fetch(s->stats, &stats);
  } else {
    st = lmloss_linear_log_probs_backward(&ctx, &h, s->labels ? &lab : NULL, &mask, s->tr, &ho,
                                          s->dlogp ? &dlogp : NULL, s->dent ? &dent : NULL, &stats,
                                          &gr, ws, wsb);
  }
  for (int i = 0; i < 8; i++)
    dev_fetch(src[i], dst[i]), dev_free(dst[i]);
  dev_free(&h.hidden), dev_free(&h.weight), dev_free(&h.bias), dev_free(&lab), dev_free(&tw);
  dev_free(&cw), dev_free(&mask), dev_free(&dloss), dev_free(&dlogp), dev_free(&dent);
  dev_free(&stats), dev_free_bytes(ws);
  return st;
}

/* Whether a call has a plan at this budget, with a store of groups of at
 * least min_group rows. */
static int plans(const head_data *hd, const outs *o, int64_t k, size_t budget, int64_t min_group) {
  const lmloss_head h = {hd->hidden, hd->weight, hd->bias};
  const lmloss_head_grads gr = {o->dh, o->dw, o->db};
  lmloss_head_options ho = lmloss_head_options_default();
  lmloss_head_plan pl;
  ho.memory_budget = budget;
  return lmloss_linear_plan(&h, &ho, &gr, k, &pl) == LMLOSS_OK && pl.group_rows >= min_group;
}

/* The smallest memory budget that plans(min_group), 0 if none does:
 * min_group 0, any plan (chunks of exactly 1 row; 3x that: 3 rows);
 * 1024 (LMLOSS_HEAD_MIN_GROUP), a store of groups. */
static size_t least_budget(const head_data *hd, const outs *o, int64_t k, int64_t min_group) {
  size_t lo = 1, hi = (size_t)1 << 32;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (plans(hd, o, k, mid, min_group))
      hi = mid;
    else
      lo = mid + 1;
  }
  return plans(hd, o, k, lo, min_group) ? lo : 0;
}

/* dweight and dbias added to (accumulate) over a's own: twice a's, and
 * dhidden overwritten. */
static void accumulated(tgroup *g, const call_spec *s, how hw, const outs *a, int head16) {
  outs b = outs_clone(a);
  hw.accumulate = 1;
  lmloss_status st = call(s, hw, &b);
  if (tg_true(g, st == LMLOSS_OK, "accumulate: %s", lmloss_status_string(st))) {
    const lmloss_tensor *got[] = {&b.dw, &b.db}, *base[] = {&a->dw, &a->db};
    for (int q = 0; q < 2; q++) {
      if (!got[q]->data) continue;
      double *twice = to_f64(base[q]);
      for (int64_t e = 0; e < got[q]->rows * got[q]->cols; e++)
        twice[e] *= 2;
      tensor_close(g, got[q], twice, head16 ? CHUNK_TOL16 : CHUNK_TOL, 0,
                   q ? "accumulate: dbias" : "accumulate: dweight");
      free(twice);
    }
    runs_agree(g, &b.dh, &a->dh, 0, head16, "accumulate: dhidden");
  }
  outs_free(&b);
}

/* ---- cross-entropy cases ---- */

typedef struct {
  int64_t N, V, H0, pad;
  lmloss_dtype dt, idt, gwdt; /* head; target; dweight/dbias */
  lmloss_ce_options opt;
  int bias, tw, cw, mode, grads, outs, all_ignored, chunks;
  int groups;     /* a 4th run: the store in groups (least_budget), which must exist */
  int accumulate; /* and dweight, dbias (F32) added to (accumulated) */
  double margin, ignore_frac, sigma;
} lc_case;

static lc_case lc_base(int64_t N, int64_t V) {
  lc_case c;
  memset(&c, 0, sizeof c);
  c.N = N, c.V = V, c.H0 = 24, c.dt = c.gwdt = LMLOSS_F32, c.idt = LMLOSS_I64;
  c.opt = lmloss_ce_options_default();
  c.mode = FUSED, c.grads = G_ALL, c.outs = 1, c.margin = -1, c.sigma = 2.0;
  return c;
}

static outs lc_outs(const lc_case *c, const head_data *hd) {
  outs o;
  memset(&o, 0, sizeof o);
  int64_t N = c->N, V = c->V, H = hd->H;
  if (c->mode != BWD) {
    o.loss = host_new(LMLOSS_F32, c->opt.reduction == LMLOSS_REDUCE_NONE ? N : 1, 1, 1);
    if (c->outs) {
      o.lse = host_new(LMLOSS_F32, N, 1, 1), o.ent = host_new(LMLOSS_F32, N, 1, 1);
      o.amax = host_new(LMLOSS_I64, N, 1, 1);
    }
  }
  if (c->mode != FWD) {
    if (want_dh(c->grads)) o.dh = host_new(c->dt, N, H, H);
    if (want_dw(c->grads)) o.dw = host_new(c->gwdt, V, H, H);
    if (want_db(c->grads) && c->bias) o.db = host_new(c->gwdt, V, 1, 1);
  }
  outs_poison(&o);
  return o;
}

static void lc_print(const lc_case *c) {
  printf("  case: N=%lld V=%lld H0=%lld head=%s dW=%s mode=%s grads=%s bias=%d margin=%g "
         "ignore=%g ls=%g zl=%g s=%g cap=%g T=%g red=%d dft=%d tw=%d cw=%d\n",
         (long long)c->N, (long long)c->V, (long long)c->H0, dt_name(c->dt), dt_name(c->gwdt),
         mode_name[c->mode], grads_name[c->grads], c->bias, c->margin,
         c->all_ignored ? 1.0 : c->ignore_frac, c->opt.label_smoothing, c->opt.z_loss,
         c->opt.transform.logit_scale, c->opt.transform.softcap, c->opt.transform.temperature,
         (int)c->opt.reduction, c->opt.dft, c->tw, c->cw);
}

/* Distinct random targets (while they last); ignored rows get ignore. */
static void targets(int64_t N, int64_t V, double ignore_frac, int64_t ignore, int64_t *tv) {
  char *used = xcalloc((size_t)V, 1);
  for (int64_t i = 0; i < N; i++) {
    int64_t y = rng_int(V);
    for (int t = 0; t < 64 && used[y]; t++)
      y = rng_int(V);
    used[y] = 1;
    tv[i] = rng_uniform() < ignore_frac ? ignore : y;
  }
  free(used);
}

static void lc_run(tgroup *g, const lc_case *c) {
  const int64_t N = c->N, V = c->V;
  const lmloss_ce_options *opt = &c->opt;
  int64_t *tv = xcalloc((size_t)N, sizeof(int64_t)), *peak = xcalloc((size_t)N, sizeof(int64_t));
  targets(N, V, c->all_ignored ? 2.0 : c->ignore_frac, opt->ignore_index, tv);
  for (int64_t i = 0; i < N; i++)
    peak[i] = tv[i] == opt->ignore_index ? -1 : tv[i];
  head_data hd;
  head_new(&hd, N, V, c->H0, c->dt, c->bias, c->pad, peak, c->margin, c->sigma);
  lmloss_tensor tgt = host_new(c->idt, N, 1, 1), tw = {0}, cw = {0}, dloss = {0};
  for (int64_t i = 0; i < N; i++)
    tset(&tgt, i, 0, (double)tv[i]);
  if (c->tw) {
    tw = host_new(LMLOSS_F32, N, 1, 1);
    for (int64_t i = 0; i < N; i++)
      tset(&tw, i, 0, 0.25 + 1.5 * rng_uniform());
  }
  if (c->cw) {
    cw = host_new(LMLOSS_F32, V, 1, 1);
    for (int64_t j = 0; j < V; j++)
      tset(&cw, j, 0, rng_uniform() < 0.1 ? 0.0 : 0.5 + rng_uniform());
  }
  if (c->mode == BWD) {
    dloss = host_new(LMLOSS_F32, opt->reduction == LMLOSS_REDUCE_NONE ? N : 1, 1, 1);
    for (int64_t i = 0; i < dloss.rows; i++)
      tset(&dloss, i, 0, 0.5 + rng_uniform());
  }

  /* the oracle: REF on the rounded float64 logits */
  lmloss_context rctx = ref_ctx();
  lmloss_ce_inputs in = {hd.logits, tgt, tw, cw};
  lmloss_tensor rloss = host_new(LMLOSS_F32, opt->reduction == LMLOSS_REDUCE_NONE ? N : 1, 1, 1);
  lmloss_tensor rlse = host_new(LMLOSS_F32, N, 1, 1), rent = host_new(LMLOSS_F32, N, 1, 1);
  lmloss_tensor ramax = host_new(LMLOSS_I64, N, 1, 1), rdl = host_new(LMLOSS_F32, N, V, V);
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = malloc(wsb);
  lmloss_status sr;
  if (c->mode == BWD) {
    sr = lmloss_cross_entropy_backward(&rctx, &in, opt, &dloss, &rdl, ws, wsb);
  } else {
    lmloss_ce_outputs ro = {rloss, rlse, rent, ramax, c->mode == FUSED ? rdl : (lmloss_tensor){0}};
    sr = lmloss_cross_entropy(&rctx, &in, opt, &ro, ws, wsb);
  }
  free(ws);

  /* the backend under test, at each budget */
  outs o[4];
  int nrun = c->groups ? 4 : c->chunks ? 3 : 1;
  call_spec s = {c->mode, &hd, &tgt, &tw, &cw, NULL, &dloss, NULL, NULL, opt, NULL, 1};
  size_t b1 = 0, bg = 0;
  int before = (int)g->fails;
  for (int r = 0; r < nrun; r++) {
    o[r] = lc_outs(c, &hd);
    if (r == 0 && c->chunks) b1 = least_budget(&hd, &o[0], 1, 0);
    if (r == 3) {
      bg = least_budget(&hd, &o[3], 1, 1024);
      if (!tg_true(g, bg > 0, "no budget keeps a store of groups")) continue;
    }
    how hw = {c->chunks ? (r == 0 ? b1 : r == 1 ? 3 * b1 : r == 3 ? bg : 0) : 0, 0, 0};
    lmloss_status st = call(&s, hw, &o[r]);
    if (!tg_true(g, sr == LMLOSS_OK && st == LMLOSS_OK, "status ref %s got %s (%s)",
                 lmloss_status_string(sr), lmloss_status_string(st), lmloss_last_error()))
      continue;
    if (c->mode != BWD) {
      double *rl = to_f64(&rloss);
      rows_close(g, &o[r].loss, rl, FL_TOL, "loss");
      free(rl);
      if (c->outs) {
        double *a = to_f64(&rlse), *b = to_f64(&rent);
        rows_close(g, &o[r].lse, a, FL_TOL, "lse");
        rows_close(g, &o[r].ent, b, FL_TOL, "entropy");
        free(a), free(b);
        for (int64_t i = 0; i < N; i++) {
          /* compare argmax where the top two logits are apart */
          double m1 = -INFINITY, m2 = -INFINITY;
          for (int64_t j = 0; j < V; j++) {
            double x = hd.x64[i * V + j];
            if (x > m1)
              m2 = m1, m1 = x;
            else if (x > m2)
              m2 = x;
          }
          if (tv[i] != opt->ignore_index && m1 - m2 < 1e-2) continue;
          tg_true(g, tget(&o[r].amax, i, 0) == tget(&ramax, i, 0), "argmax[%lld] got %g ref %g",
                  (long long)i, tget(&o[r].amax, i, 0), tget(&ramax, i, 0));
        }
      }
    }
    if (c->mode != FWD) grads_close(g, &hd, &o[r].dh, &o[r].dw, &o[r].db, &rdl);
    if (c->all_ignored) {
      all_zero(g, &o[r].loss, "all-ignored loss");
      all_zero(g, &o[r].lse, "all-ignored lse");
      all_zero(g, &o[r].ent, "all-ignored entropy");
      all_zero(g, &o[r].dh, "all-ignored dhidden");
      all_zero(g, &o[r].dw, "all-ignored dweight");
      all_zero(g, &o[r].db, "all-ignored dbias");
      for (int64_t i = 0; o[r].amax.data && i < N; i++)
        tg_true(g, tget(&o[r].amax, i, 0) == -1.0, "all-ignored argmax[%lld] != -1", (long long)i);
    }
    if (r > 0) outs_agree(g, &o[r], &o[0], c->dt != LMLOSS_F32);
    if (c->accumulate && (r == 2 || r == 3))
      accumulated(g, &s, (how){r == 3 ? bg : 0, 0, 0}, &o[r], c->dt != LMLOSS_F32);
  }
  if (c->chunks) {
    const how bad[] = {{b1 - 1, 0}, {b1, 1}, {0, 1}};
    outs proto = lc_outs(c, &hd);
    too_small(g, &s, bad, (int)(sizeof bad / sizeof bad[0]), &proto);
    outs_free(&proto);
  }
  if ((int)g->fails > before && before == 0) lc_print(c);
  for (int r = 0; r < nrun; r++)
    outs_free(&o[r]);
  host_free(&rloss), host_free(&rlse), host_free(&rent), host_free(&ramax), host_free(&rdl);
  host_free(&tgt), host_free(&tw), host_free(&cw), host_free(&dloss);
  head_free(&hd);
  free(tv), free(peak);
}

/* ---- log-probs cases ---- */

typedef struct {
  int64_t N, V, H0, K;
  lmloss_dtype dt, idt, gwdt;
  lmloss_transform tr;
  int bias, mask, entropy, mode, dlogp, dent, no_index, grads, chunks;
  int saved; /* the forward writes stats; the backward takes a forward's (2: no room for them) */
  double margin, sigma;
} lp_case;

static lp_case lp_base(int64_t N, int64_t V, int64_t K) {
  lp_case c;
  memset(&c, 0, sizeof c);
  c.N = N, c.V = V, c.H0 = 24, c.K = K, c.dt = c.gwdt = LMLOSS_F32, c.idt = LMLOSS_I64;
  c.tr = lmloss_transform_default();
  c.mode = FWD, c.entropy = 1, c.dlogp = 1, c.grads = G_ALL, c.margin = -1, c.sigma = 2.0;
  return c;
}

static outs lp_outs(const lp_case *c, const head_data *hd) {
  outs o;
  memset(&o, 0, sizeof o);
  if (c->mode == FWD) {
    o.logp = host_new(LMLOSS_F32, c->N, c->K, c->K);
    if (c->entropy) o.ent = host_new(LMLOSS_F32, c->N, 1, 1);
  } else {
    if (want_dh(c->grads)) o.dh = host_new(c->dt, c->N, hd->H, hd->H);
    if (want_dw(c->grads)) o.dw = host_new(c->gwdt, c->V, hd->H, hd->H);
    if (want_db(c->grads) && c->bias) o.db = host_new(c->gwdt, c->V, 1, 1);
  }
  outs_poison(&o);
  return o;
}

static void lp_print(const lp_case *c) {
  printf("  case: N=%lld V=%lld K=%lld head=%s mode=%s grads=%s bias=%d margin=%g s=%g cap=%g "
         "T=%g mask=%d entropy=%d dlogp=%d dentropy=%d no_index=%d saved=%d\n",
         (long long)c->N, (long long)c->V, (long long)c->K, dt_name(c->dt), mode_name[c->mode],
         grads_name[c->grads], c->bias, c->margin, c->tr.logit_scale, c->tr.softcap,
         c->tr.temperature, c->mask, c->entropy, c->dlogp, c->dent, c->no_index, c->saved);
}

/* Whether the backward read the statistics: run again with every m NaN.
 * Where lmloss.h says they are used (a 16-bit head with dW and no dbias
 * wanted, here at the 3-row budget, more than one chunk, with room for
 * dhidden's sum, K <= 127) dW turns NaN; elsewhere the gradients are o's,
 * bit for bit. */
static void stats_read(tgroup *g, const lp_case *c, const call_spec *s, const lmloss_tensor *stats,
                       how hw, const outs *o) {
  const int used = c->dt != LMLOSS_F32 && want_dw(c->grads) && !(c->bias && want_db(c->grads)) &&
                   c->saved == 1 && c->K <= 127;
  lmloss_tensor bad = host_clone(stats);
  for (int64_t i = 0; i < bad.rows; i++)
    tset(&bad, i, 0, NAN);
  call_spec sb = *s;
  sb.stats = &bad;
  outs b = outs_clone(o);
  outs_poison(&b);
  lmloss_status st = call(&sb, hw, &b);
  int nan = 0;
  for (int64_t j = 0; j < b.dw.rows; j++)
    for (int64_t k = 0; k < b.dw.cols; k++)
      nan |= isnan(tget(&b.dw, j, k));
  tg_true(g, st == LMLOSS_OK && (used ? nan : outs_same(&b, o)),
          "statistics %s: status %s, dW NaN %d", used ? "not read" : "read",
          lmloss_status_string(st), nan);
  outs_free(&b), host_free(&bad);
}

static void lp_run(tgroup *g, const lp_case *c) {
  const int64_t N = c->N, V = c->V, K = c->K;
  int64_t *tv = xcalloc((size_t)N, sizeof(int64_t));
  targets(N, V, 0.0, -1, tv);
  head_data hd;
  head_new(&hd, N, V, c->H0, c->dt, c->bias, 0, tv, c->margin, c->sigma);
  lmloss_tensor idx = host_new(c->idt, N, K, K), mask = {0}, dlogp = {0}, dent = {0};
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < K; k++)
      tset(&idx, i, k, k == 0 ? (double)tv[i] : (double)rng_int(V));
  if (c->mask) {
    mask = host_new(LMLOSS_BOOL, N, 1, 1);
    for (int64_t i = 0; i < N; i++)
      tset(&mask, i, 0, rng_uniform() < 0.7);
  }
  if (c->mode == BWD && c->dlogp) {
    dlogp = host_new(LMLOSS_F32, N, K, K);
    for (int64_t i = 0; i < N; i++)
      for (int64_t k = 0; k < K; k++)
        tset(&dlogp, i, k, rng_normal());
  }
  if (c->mode == BWD && c->dent) {
    dent = host_new(LMLOSS_F32, N, 1, 1);
    for (int64_t i = 0; i < N; i++)
      tset(&dent, i, 0, rng_normal());
  }
  const int use_idx = !(c->mode == BWD && !c->dlogp && c->no_index);

  lmloss_context rctx = ref_ctx();
  lmloss_tensor rlogp = host_new(LMLOSS_F32, N, K, K), rent = host_new(LMLOSS_F32, N, 1, 1);
  lmloss_tensor rdl = host_new(LMLOSS_F32, N, V, V);
  const int64_t RS = LMLOSS_ROW_STATS;
  lmloss_tensor stats = {0}, rstats = {0};
  if (c->saved) stats = host_new(LMLOSS_F32, N, RS, RS), rstats = host_new(LMLOSS_F32, N, RS, RS);
  lmloss_status sr =
      c->mode == FWD
          ? lmloss_log_probs(&rctx, &hd.logits, &idx, &mask, &c->tr, &rlogp, &rent, &rstats)
          : lmloss_log_probs_backward(&rctx, &hd.logits, use_idx ? &idx : NULL, &mask, &c->tr,
                                      c->dlogp ? &dlogp : NULL, c->dent ? &dent : NULL, &rdl, NULL);

  outs o[3];
  int nrun = c->chunks ? 3 : 1, before = (int)g->fails;
  int64_t k = c->mode == FWD || c->dlogp ? K : 0;
  call_spec s = {10 + c->mode,
                 &hd,
                 use_idx ? &idx : NULL,
                 NULL,
                 NULL,
                 c->mask ? &mask : NULL,
                 NULL,
                 c->dlogp ? &dlogp : NULL,
                 c->dent ? &dent : NULL,
                 NULL,
                 &c->tr,
                 k,
                 c->saved ? &stats : NULL};
  if (c->saved && c->mode == BWD) { /* the statistics of a forward call on this backend */
    outs fo;
    memset(&fo, 0, sizeof fo);
    fo.logp = host_new(LMLOSS_F32, N, K, K);
    call_spec fs = s;
    fs.kind = 10 + FWD, fs.labels = &idx, fs.dlogp = fs.dent = NULL, fs.k = K;
    lmloss_status st = call(&fs, (how){0, 0}, &fo);
    tg_true(g, st == LMLOSS_OK, "forward for the statistics: %s (%s)", lmloss_status_string(st),
            lmloss_last_error());
    outs_free(&fo);
  }
  size_t b1 = 0;
  for (int r = 0; r < nrun; r++) {
    o[r] = lp_outs(c, &hd);
    if (r == 0 && c->chunks) b1 = least_budget(&hd, &o[0], k, 0);
    how hw = {c->chunks ? (r == 0 ? b1 : r == 1 ? 3 * b1 : 0) : 0, 0};
    lmloss_status st = call(&s, hw, &o[r]);
    if (!tg_true(g, sr == LMLOSS_OK && st == LMLOSS_OK, "status ref %s got %s (%s)",
                 lmloss_status_string(sr), lmloss_status_string(st), lmloss_last_error()))
      continue;
    if (c->mode == FWD) {
      double *a = to_f64(&rlogp), *b = to_f64(&rent);
      rows_close(g, &o[r].logp, a, FL_TOL, "logp");
      if (c->entropy) rows_close(g, &o[r].ent, b, FL_TOL, "entropy");
      free(a), free(b);
      if (c->saved) { /* m, R, t and the argmax's column */
        double *e = to_f64(&rstats);
        rows_close(g, &stats, e, FL_TOL, "stats");
        free(e);
      }
    } else {
      grads_close(g, &hd, &o[r].dh, &o[r].dw, &o[r].db, &rdl);
      if (c->saved && r == 1) stats_read(g, c, &s, &stats, hw, &o[r]);
    }
    if (r > 0) outs_agree(g, &o[r], &o[0], c->dt != LMLOSS_F32);
  }
  if (c->chunks) {
    const how bad[] = {{b1 - 1, 0}, {0, 1}};
    outs proto = lp_outs(c, &hd);
    too_small(g, &s, bad, (int)(sizeof bad / sizeof bad[0]), &proto);
    outs_free(&proto);
  }
  if ((int)g->fails > before && before == 0) lp_print(c);
  for (int r = 0; r < nrun; r++)
    outs_free(&o[r]);
  host_free(&idx), host_free(&mask), host_free(&dlogp), host_free(&dent);
  host_free(&rlogp), host_free(&rent), host_free(&rdl), host_free(&stats), host_free(&rstats);
  head_free(&hd);
  free(tv);
}

/* ---- kept log-probs (lmloss_linear_log_probs_keep) ---- */

static const double margins[] = {-1, 0, 5, 17, 30, 50};

/* The kept forward and its backward against REF on the head's logits:
 * logp and entropy per row, dhidden and dweight from dlogp (gwdt; with
 * accumulate, added to an F32 dweight holding 0.5), masked rows 0. An F32
 * head keeps nothing: keep_size answers 0 and the call UNSUPPORTED. */
static void kept_case(tgroup *g, int64_t N, int64_t V, lmloss_dtype dt, lmloss_transform tr,
                      int mask_on, double margin, lmloss_dtype gwdt, int accumulate) {
  int64_t *tv = xcalloc((size_t)N, sizeof(int64_t));
  targets(N, V, 0.0, -1, tv);
  head_data hd;
  head_new(&hd, N, V, 24, dt, 0, 0, tv, margin, 2.0);
  const int64_t H = hd.H;
  lmloss_tensor idx = host_new(LMLOSS_I64, N, 1, 1), mask = {0};
  lmloss_tensor dlogp = host_new(LMLOSS_F32, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&idx, i, 0, (double)tv[i]), tset(&dlogp, i, 0, rng_normal());
  if (mask_on) {
    mask = host_new(LMLOSS_BOOL, N, 1, 1);
    for (int64_t i = 0; i < N; i++)
      tset(&mask, i, 0, rng_uniform() < 0.7);
  }
  lmloss_context rctx = ref_ctx(), ctx = tb_ctx();
  lmloss_tensor rlogp = host_new(LMLOSS_F32, N, 1, 1), rent = host_new(LMLOSS_F32, N, 1, 1);
  lmloss_tensor rdl = host_new(LMLOSS_F32, N, V, V);
  lmloss_status sr = lmloss_log_probs(&rctx, &hd.logits, &idx, &mask, &tr, &rlogp, &rent, NULL);
  if (sr == LMLOSS_OK)
    sr = lmloss_log_probs_backward(&rctx, &hd.logits, &idx, &mask, &tr, &dlogp, NULL, &rdl, NULL);
  outs o;
  memset(&o, 0, sizeof o);
  o.logp = host_new(LMLOSS_F32, N, 1, 1), o.ent = host_new(LMLOSS_F32, N, 1, 1);
  o.dh = host_new(dt, N, H, H), o.dw = host_new(gwdt, V, H, H);
  outs_poison(&o);
  if (accumulate)
    for (int64_t j = 0; j < V; j++)
      for (int64_t k = 0; k < H; k++)
        tset(&o.dw, j, k, 0.5);
  lmloss_head h = {dev_clone(&hd.hidden), dev_clone(&hd.weight), {0}};
  lmloss_tensor didx = dev_clone(&idx), dmask = dev_clone(&mask), ddlogp = dev_clone(&dlogp);
  lmloss_tensor dlp = dev_clone(&o.logp), dent = dev_clone(&o.ent);
  lmloss_head_grads gr = {dev_clone(&o.dh), dev_clone(&o.dw), {0}, accumulate};
  const lmloss_head_options ho = lmloss_head_options_default();
  size_t wsb = 1;
  lmloss_status sz = lmloss_linear_log_probs_keep_size(&h, &ho, &wsb);
  void *ws = dev_alloc_bytes(wsb ? wsb : 1);
  lmloss_status sf =
      lmloss_linear_log_probs_keep(&ctx, &h, &didx, &dmask, &tr, &ho, &dlp, &dent, ws, wsb);
  if (dt == LMLOSS_F32) {
    tg_true(g,
            sz == LMLOSS_OK && wsb == 0 && sf == LMLOSS_ERR_UNSUPPORTED && lmloss_last_error()[0],
            "an F32 head: keep_size %s %zu bytes, the call %s", lmloss_status_string(sz), wsb,
            lmloss_status_string(sf));
  } else if (tg_true(g, sz == LMLOSS_OK && wsb > 0 && sf == LMLOSS_OK && sr == LMLOSS_OK,
                     "keep_size %s (%zu bytes), forward %s (%s), ref %s", lmloss_status_string(sz),
                     wsb, lmloss_status_string(sf), lmloss_last_error(),
                     lmloss_status_string(sr))) {
    lmloss_status sb = lmloss_linear_log_probs_backward_kept(&ctx, &h, &didx, &dmask, &tr, &ho,
                                                             &ddlogp, &gr, ws, wsb);
    tg_true(g, sb == LMLOSS_OK, "backward: %s (%s)", lmloss_status_string(sb), lmloss_last_error());
    dev_fetch(&o.logp, &dlp), dev_fetch(&o.ent, &dent);
    dev_fetch(&o.dh, &gr.dhidden), dev_fetch(&o.dw, &gr.dweight);
    if (accumulate)
      for (int64_t j = 0; j < V; j++)
        for (int64_t k = 0; k < H; k++)
          tset(&o.dw, j, k, tget(&o.dw, j, k) - 0.5);
    double *a = to_f64(&rlogp), *b = to_f64(&rent);
    rows_close(g, &o.logp, a, FL_TOL, "kept logp");
    rows_close(g, &o.ent, b, FL_TOL, "kept entropy");
    free(a), free(b);
    const lmloss_tensor none = {0};
    grads_close(g, &hd, &o.dh, &o.dw, &none, &rdl);
  }
  if (g->fails)
    printf("  kept case: N=%lld V=%lld head=%s dW=%s accumulate=%d mask=%d margin=%g cap=%g T=%g\n",
           (long long)N, (long long)V, dt_name(dt), dt_name(gwdt), accumulate, mask_on, margin,
           tr.softcap, tr.temperature);
  dev_free_bytes(ws);
  dev_free(&h.hidden), dev_free(&h.weight), dev_free(&didx), dev_free(&dmask), dev_free(&ddlogp);
  dev_free(&dlp), dev_free(&dent), dev_free(&gr.dhidden), dev_free(&gr.dweight);
  outs_free(&o);
  host_free(&idx), host_free(&mask), host_free(&dlogp), host_free(&rlogp), host_free(&rent);
  host_free(&rdl);
  head_free(&hd);
  free(tv);
}

/* Bad input of the kept log-probs: K = 2, a dbias asked of the backward. */
static void kept_bad(tgroup *g) {
  head_data hd;
  head_new(&hd, 4, 17, 8, LMLOSS_F32, 1, 0, NULL, -1, 1.0);
  lmloss_context ctx = tb_ctx();
  const lmloss_transform tr = lmloss_transform_default();
  const lmloss_head_options ho = lmloss_head_options_default();
  lmloss_tensor idx2 = host_new(LMLOSS_I64, 4, 2, 2), idx = host_new(LMLOSS_I64, 4, 1, 1);
  lmloss_tensor logp = host_new(LMLOSS_F32, 4, 2, 2), dlogp = host_new(LMLOSS_F32, 4, 1, 1);
  lmloss_tensor db = host_new(LMLOSS_F32, 17, 1, 1), dh = host_new(LMLOSS_F32, 4, hd.H, hd.H);
  lmloss_head h = {dev_clone(&hd.hidden), dev_clone(&hd.weight), dev_clone(&hd.bias)};
  lmloss_tensor d2 = dev_clone(&idx2), d1 = dev_clone(&idx), dl = dev_clone(&logp);
  lmloss_tensor ddl = dev_clone(&dlogp);
  lmloss_head_grads gr = {dev_clone(&dh), {0}, dev_clone(&db), 0};
  char ws[64];
  lmloss_status s = lmloss_linear_log_probs_keep(&ctx, &h, &d2, NULL, &tr, &ho, &dl, NULL, ws, 64);
  tg_true(g, s == LMLOSS_ERR_BAD_SHAPE && lmloss_last_error()[0], "K = 2: %s",
          lmloss_status_string(s));
  s = lmloss_linear_log_probs_backward_kept(&ctx, &h, &d1, NULL, &tr, &ho, &ddl, &gr, ws, 64);
  tg_true(g, s == LMLOSS_ERR_UNSUPPORTED && strstr(lmloss_last_error(), "dbias"), "dbias: %s (%s)",
          lmloss_status_string(s), lmloss_last_error());
  dev_free(&h.hidden), dev_free(&h.weight), dev_free(&h.bias), dev_free(&d2), dev_free(&d1);
  dev_free(&dl), dev_free(&ddl), dev_free(&gr.dhidden), dev_free(&gr.dbias);
  host_free(&idx2), host_free(&idx), host_free(&logp), host_free(&dlogp), host_free(&db);
  host_free(&dh);
  head_free(&hd);
}

static void kept_suite(void) {
  tgroup g;
  tg_begin(&g, "linear kept log-probs: bad input, an F32 head");
  kept_bad(&g);
  rng_seed(7000);
  kept_case(&g, 12, 1003, LMLOSS_F32, lmloss_transform_default(), 0, -1, LMLOSS_F32, 0);
  tg_end(&g);
  if (!tb_is_cuda()) return;
  static const lmloss_transform trs[] = {{1, 0, 1}, {1, 30, 1}, {1, 0, 0.7f}, {0.8f, 25, 1.3f}};
  tg_begin(&g, "linear kept log-probs against REF (bf16 head)");
  for (int k = 0; k < 8; k++) {
    rng_seed(7100 + k);
    const lmloss_transform tr = trs[k % 4];
    const double margin = tr.temperature < 1 || tr.softcap > 0 ? (k % 2 ? 17 : -1) : margins[k % 6];
    kept_case(&g, k == 7 ? 300 : 12, k % 2 ? 4099 : 1003, LMLOSS_BF16, tr, k % 3 == 1, margin,
              k % 4 == 3 ? LMLOSS_F32 : LMLOSS_BF16, k % 4 == 3);
  }
  tg_end(&g);
}

/* ---- bad input ---- */

static void expect(tgroup *g, lmloss_status got, lmloss_status want, const outs *o, const outs *p,
                   const char *what) {
  int same = outs_same(o, p);
  int ok = (want == LMLOSS_OK ? got != LMLOSS_OK : got == want) && lmloss_last_error()[0] && same;
  tg_true(g, ok, "%s: got %s want %s, message '%s', outputs untouched %d", what,
          lmloss_status_string(got), want == LMLOSS_OK ? "an error" : lmloss_status_string(want),
          lmloss_last_error(), same);
  outs_restore(o, p); /* the next check starts from the poison again */
}

static void bad_input(tgroup *g) {
  const int64_t N = 4, V = 17, H = 8;
  lmloss_context ctx = lmloss_context_default();
  ctx.backend = LMLOSS_BACKEND_CPU;
  lmloss_tensor hid = host_new(LMLOSS_F32, N, H, H), w = host_new(LMLOSS_F32, V, H, H);
  lmloss_tensor b = host_new(LMLOSS_F32, V, 1, 1), t = host_new(LMLOSS_I64, N, 1, 1);
  lmloss_tensor idx = host_new(LMLOSS_I64, N, 1, 1), dlg = host_new(LMLOSS_F32, N, V, V);
  lmloss_tensor hid16 = host_new(LMLOSS_BF16, N, H, H), w16 = host_new(LMLOSS_BF16, V, H, H);
  lmloss_tensor w9 = host_new(LMLOSS_F32, V, H + 1, H + 1), none = {0};
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < H; k++)
      tset(&hid, i, k, rng_normal()), tset(&hid16, i, k, rng_normal());
  for (int64_t j = 0; j < V; j++)
    for (int64_t k = 0; k < H; k++)
      tset(&w, j, k, rng_normal()), tset(&w16, j, k, rng_normal());
  for (int64_t i = 0; i < N; i++)
    tset(&t, i, 0, (double)(3 * i)), tset(&idx, i, 0, (double)i);
  outs o;
  memset(&o, 0, sizeof o);
  o.loss = host_new(LMLOSS_F32, N, 1, 1), o.lse = host_new(LMLOSS_F32, N, 1, 1);
  o.logp = host_new(LMLOSS_F32, N, 1, 1), o.dh = host_new(LMLOSS_F32, N, H, H);
  o.dw = host_new(LMLOSS_F32, V, H, H), o.db = host_new(LMLOSS_F32, V, 1, 1);
  outs_poison(&o);
  outs p = outs_clone(&o);
  lmloss_ce_options opt = lmloss_ce_options_default();
  opt.reduction = LMLOSS_REDUCE_NONE;
  lmloss_head_options ho = lmloss_head_options_default();
  lmloss_transform tr = lmloss_transform_default();
  lmloss_ce_outputs out = {o.loss, o.lse, {0}, {0}, {0}};
  lmloss_head head = {hid, w, none}, hb = {hid, w, b};
  lmloss_head_grads gr = {o.dh, o.dw, none}, grb = {o.dh, o.dw, o.db};
  lmloss_tensor dloss = host_new(LMLOSS_F32, N, 1, 1);
  size_t wsb = 1 << 20;
  void *ws = malloc(wsb);
  size_t bytes;

  expect(g, lmloss_linear_cross_entropy(&ctx, NULL, &t, NULL, NULL, &opt, &ho, &out, &gr, ws, wsb),
         LMLOSS_ERR_NULL_POINTER, &o, &p, "CE: head NULL");
  expect(g,
         lmloss_linear_cross_entropy_backward(&ctx, NULL, &t, NULL, NULL, &opt, &ho, &dloss, &gr,
                                              ws, wsb),
         LMLOSS_ERR_NULL_POINTER, &o, &p, "CE backward: head NULL");
  expect(g, lmloss_linear_log_probs(&ctx, NULL, &idx, NULL, &tr, &ho, &o.logp, NULL, NULL, ws, wsb),
         LMLOSS_ERR_NULL_POINTER, &o, &p, "log-probs: head NULL");
  expect(g, lmloss_linear_workspace_size(NULL, &ho, &gr, 1, &bytes), LMLOSS_ERR_NULL_POINTER, &o,
         &p, "workspace size: head NULL");
  {
    lmloss_head h = {hid, w16, none};
    expect(g, lmloss_linear_cross_entropy(&ctx, &h, &t, NULL, NULL, &opt, &ho, &out, &gr, ws, wsb),
           LMLOSS_ERR_BAD_DTYPE, &o, &p, "CE: hidden F32, weight BF16");
    expect(g, lmloss_linear_log_probs(&ctx, &h, &idx, NULL, &tr, &ho, &o.logp, NULL, NULL, ws, wsb),
           LMLOSS_ERR_BAD_DTYPE, &o, &p, "log-probs: hidden F32, weight BF16");
    h.weight = w9;
    expect(g, lmloss_linear_cross_entropy(&ctx, &h, &t, NULL, NULL, &opt, &ho, &out, &gr, ws, wsb),
           LMLOSS_ERR_BAD_SHAPE, &o, &p, "CE: weight has H + 1 columns");
    expect(g, lmloss_linear_workspace_size(&h, &ho, &gr, 1, &bytes), LMLOSS_ERR_BAD_SHAPE, &o, &p,
           "workspace size: weight has H + 1 columns");
  }
  {
    lmloss_ce_outputs o2 = out;
    o2.dlogits = dlg;
    expect(g,
           lmloss_linear_cross_entropy(&ctx, &head, &t, NULL, NULL, &opt, &ho, &o2, &gr, ws, wsb),
           LMLOSS_OK, &o, &p, "CE: dlogits given in the outputs");
  }
  expect(g,
         lmloss_linear_cross_entropy(&ctx, &head, &t, NULL, NULL, &opt, &ho, &out, &grb, ws, wsb),
         LMLOSS_OK, &o, &p, "CE: dbias without bias");
  expect(g,
         lmloss_linear_log_probs_backward(&ctx, &head, &idx, NULL, &tr, &ho, &dloss, NULL, NULL,
                                          &grb, ws, wsb),
         LMLOSS_OK, &o, &p, "log-probs backward: dbias without bias");
  {
    lmloss_head h = {hid16, w16, none};
    lmloss_tensor dh16 = host_new(LMLOSS_BF16, N, H, H);
    host_poison(&dh16);
    lmloss_tensor dh16p = host_clone(&dh16);
    lmloss_head_grads g16 = {dh16, o.dw, none};
    expect(g, lmloss_linear_cross_entropy(&ctx, &h, &t, NULL, NULL, &opt, &ho, &out, &g16, ws, wsb),
           LMLOSS_ERR_UNSUPPORTED, &o, &p, "CE: BF16 head on the CPU backend");
    expect(g, lmloss_linear_log_probs(&ctx, &h, &idx, NULL, &tr, &ho, &o.logp, NULL, NULL, ws, wsb),
           LMLOSS_ERR_UNSUPPORTED, &o, &p, "log-probs: BF16 head on the CPU backend");
    expect(g,
           lmloss_linear_cross_entropy_backward(&ctx, &h, &t, NULL, NULL, &opt, &ho, &dloss, &g16,
                                                ws, wsb),
           LMLOSS_ERR_UNSUPPORTED, &o, &p, "CE backward: BF16 head on the CPU backend");
    tg_true(g, same_bytes(&dh16, &dh16p), "BF16 head on the CPU: dhidden was written");
    host_free(&dh16), host_free(&dh16p);
  }
  { /* gradients that share bytes with what the call reads, or with each other */
    lmloss_head_grads over[3] = {grb, grb, grb};
    over[0].dweight = w, over[1].dbias = b, over[2].dbias = o.dw;
    over[2].dbias.rows = V, over[2].dbias.cols = over[2].dbias.row_stride = 1;
    const char *what[3] = {"dweight is the weight", "dbias is the bias", "dbias in dweight"};
    char msg[64];
    for (int q = 0; q < 3; q++) {
      snprintf(msg, sizeof msg, "CE: %s", what[q]);
      expect(g,
             lmloss_linear_cross_entropy(&ctx, &hb, &t, NULL, NULL, &opt, &ho, &out, &over[q], ws,
                                         wsb),
             LMLOSS_ERR_BAD_SHAPE, &o, &p, msg);
    }
  }
  {
    lmloss_head_options h2 = ho;
    h2.memory_budget = 16;
    expect(g,
           lmloss_linear_cross_entropy(&ctx, &hb, &t, NULL, NULL, &opt, &h2, &out, &grb, ws, wsb),
           LMLOSS_ERR_WORKSPACE_TOO_SMALL, &o, &p, "CE: budget of 16 bytes");
    expect(g, lmloss_linear_workspace_size(&hb, &h2, &grb, 1, &bytes),
           LMLOSS_ERR_WORKSPACE_TOO_SMALL, &o, &p, "workspace size: budget of 16 bytes");
  }
  { /* saved statistics: [N, LMLOSS_ROW_STATS] F32 */
    lmloss_tensor st3 = host_new(LMLOSS_F32, N, LMLOSS_ROW_STATS - 1, LMLOSS_ROW_STATS - 1);
    lmloss_tensor st16 = host_new(LMLOSS_BF16, N, LMLOSS_ROW_STATS, LMLOSS_ROW_STATS);
    expect(g,
           lmloss_linear_log_probs(&ctx, &head, &idx, NULL, &tr, &ho, &o.logp, NULL, &st3, ws, wsb),
           LMLOSS_ERR_BAD_SHAPE, &o, &p, "log-probs: stats with 3 columns");
    expect(
        g,
        lmloss_linear_log_probs(&ctx, &head, &idx, NULL, &tr, &ho, &o.logp, NULL, &st16, ws, wsb),
        LMLOSS_ERR_BAD_DTYPE, &o, &p, "log-probs: BF16 stats");
    expect(g,
           lmloss_linear_log_probs_backward(&ctx, &head, &idx, NULL, &tr, &ho, &dloss, NULL, &st3,
                                            &gr, ws, wsb),
           LMLOSS_ERR_BAD_SHAPE, &o, &p, "log-probs backward: stats with 3 columns");
    host_free(&st3), host_free(&st16);
  }
  tset(&t, 2, 0, (double)V);
  expect(g, lmloss_linear_cross_entropy(&ctx, &head, &t, NULL, NULL, &opt, &ho, &out, &gr, ws, wsb),
         LMLOSS_ERR_INDEX_OUT_OF_RANGE, &o, &p, "CE: target = V");
  free(ws);
  outs_free(&o), outs_free(&p);
  host_free(&hid), host_free(&w), host_free(&b), host_free(&t), host_free(&idx);
  host_free(&dlg), host_free(&hid16), host_free(&w16), host_free(&w9), host_free(&dloss);
}

/* The workspace is the call's whole transient memory and never exceeds
 * the budget, and lmloss_linear_plan says the schedule: the bf16
 * shape with every gradient in bf16 and the log-probs path (k = 4). The
 * default budget keeps the store of all rows (three GEMMs, no fp32 dW
 * accumulator: it is no larger than one) beside 256 MiB; 256 and 48 MiB
 * take vocab tiles (the logits twice); an F32 dweight added to (a caller's
 * fp32 main_grad) at the default budget keeps the store of all rows too;
 * twice the rows at a 4 GiB budget take groups and the accumulator; at the
 * default budget, groups in dweight's own bytes (3968 rows) beside it. A
 * size query reads no data. */
static void workspace_in_budget(tgroup *g) {
  const int64_t N = 8192, H = 4096, V = 152064;
  const size_t MiB = (size_t)1 << 20, acc = (size_t)V * H * 4;
  static char fake[1];
  const lmloss_tensor hid = {fake, LMLOSS_BF16, LMLOSS_CPU, N, H, H};
  const lmloss_tensor hid2 = {fake, LMLOSS_BF16, LMLOSS_CPU, 2 * N, H, H};
  const lmloss_tensor w = {fake, LMLOSS_BF16, LMLOSS_CPU, V, H, H};
  const lmloss_tensor w32 = {fake, LMLOSS_F32, LMLOSS_CPU, V, H, H};
  const lmloss_tensor b = {fake, LMLOSS_BF16, LMLOSS_CPU, V, 1, 1};
  const struct {
    lmloss_tensor hid, dw;
    int accumulate;
    size_t budget, cap;
    int64_t group;
    int accumulator, logits, in_dw;
  } cases[] = {
      {hid, w, 0, 0, 256 * MiB + acc, N, 0, 1, 0},
      {hid, w, 0, 256 * MiB, 256 * MiB, 0, 0, 2, 0},
      {hid, w, 0, 48 * MiB, 48 * MiB, 0, 0, 2, 0},
      {hid, w32, 1, 0, 256 * MiB + acc, N, 0, 1, 0},
      {hid2, w, 0, 4096 * MiB, 4096 * MiB, -1, 1, 1, 0},
      {hid2, w, 0, 0, 256 * MiB + acc, 3968, 1, 1, 1},
  };
  for (int i = 0; i < 6; i++)
    for (int64_t k = 1; k <= 4; k += 3) {
      const lmloss_head head = {cases[i].hid, w, b};
      const lmloss_head_grads gr = {cases[i].hid, cases[i].dw, {0}, cases[i].accumulate};
      lmloss_head_options ho = lmloss_head_options_default();
      ho.memory_budget = cases[i].budget;
      lmloss_head_plan pl;
      lmloss_status st = lmloss_linear_plan(&head, &ho, &gr, k, &pl);
      const int64_t gr_rows = pl.group_rows;
      const int group_ok =
          cases[i].group < 0 ? gr_rows >= 1024 && gr_rows < 2 * N : gr_rows == cases[i].group;
      tg_true(g,
              st == LMLOSS_OK && pl.workspace_bytes <= cases[i].cap &&
                  pl.workspace_bytes > cases[i].cap / 2 && group_ok &&
                  (pl.accumulator_bytes == acc) == cases[i].accumulator &&
                  pl.logits_gemms == cases[i].logits && pl.store_in_dweight == cases[i].in_dw,
              "case %d, k %lld: %s, workspace %zu of %zu bytes, group %lld, accumulator %zu, "
              "logits %d times, store in dweight %d",
              i, (long long)k, lmloss_status_string(st), pl.workspace_bytes, cases[i].cap,
              (long long)gr_rows, pl.accumulator_bytes, pl.logits_gemms, pl.store_in_dweight);
    }
}

/* A 16-bit dweight's own bytes hold the store of groups where the budget
 * leaves it no room (no accumulator in them: dW is written last, cast from
 * it): at a budget that plans so, the results agree with the store of all
 * rows (the default budget here). The smallest shape whose dW holds a
 * group of LMLOSS_HEAD_MIN_GROUP rows (V H / (V + H) >= 1024) and whose
 * rows take more than one group, so that no store in the workspace fits
 * beside the accumulator. */
static void store_in_dweight(tgroup *g) {
  const int64_t N = 2304, V = 2112, H = 2112;
  head_data hd;
  memset(&hd, 0, sizeof hd);
  hd.N = N, hd.V = V, hd.H = H, hd.dt = LMLOSS_BF16;
  hd.hidden = host_new(LMLOSS_BF16, N, H, H), hd.weight = host_new(LMLOSS_BF16, V, H, H);
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < H; k++)
      tset(&hd.hidden, i, k, rng_normal() * 0.1);
  for (int64_t j = 0; j < V; j++)
    for (int64_t k = 0; k < H; k++)
      tset(&hd.weight, j, k, rng_normal() * 0.1);
  lmloss_tensor tgt = host_new(LMLOSS_I64, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&tgt, i, 0, (double)rng_int(V));
  const lmloss_ce_options opt = lmloss_ce_options_default();
  const call_spec s = {FUSED, &hd, &tgt, NULL, NULL, NULL, NULL, NULL, NULL, &opt, NULL, 1};
  outs o[2];
  for (int r = 0; r < 2; r++) {
    memset(&o[r], 0, sizeof o[r]);
    o[r].loss = host_new(LMLOSS_F32, 1, 1, 1);
    o[r].dh = host_new(LMLOSS_BF16, N, H, H), o[r].dw = host_new(LMLOSS_BF16, V, H, H);
    outs_poison(&o[r]);
  }
  const lmloss_head h = {hd.hidden, hd.weight, {0}};
  const lmloss_head_grads gr = {o[0].dh, o[0].dw, {0}, 0};
  lmloss_head_options ho = lmloss_head_options_default();
  lmloss_head_plan pl = {0};
  const size_t acc = (size_t)V * H * 4, step = (size_t)1 << 16;
  for (ho.memory_budget = acc; ho.memory_budget < acc + ((size_t)64 << 20);
       ho.memory_budget += step)
    if (lmloss_linear_plan(&h, &ho, &gr, 1, &pl) == LMLOSS_OK && pl.store_in_dweight) break;
  if (tg_true(g,
              pl.store_in_dweight && pl.group_rows == 1024 && pl.accumulator_bytes >= acc &&
                  pl.workspace_bytes <= ho.memory_budget,
              "no budget stores in dweight: group %lld, accumulator %zu, workspace %zu",
              (long long)pl.group_rows, pl.accumulator_bytes, pl.workspace_bytes)) {
    const how in_dw = {ho.memory_budget, 0, 0}, all_rows = {0, 0, 0};
    lmloss_status st0 = call(&s, in_dw, &o[0]), st1 = call(&s, all_rows, &o[1]);
    if (tg_true(g, st0 == LMLOSS_OK && st1 == LMLOSS_OK, "status %s, %s (%s)",
                lmloss_status_string(st0), lmloss_status_string(st1), lmloss_last_error()))
      outs_agree(g, &o[0], &o[1], 1);
  }
  outs_free(&o[0]), outs_free(&o[1]);
  host_free(&tgt), host_free(&hd.hidden), host_free(&hd.weight);
}

/* lmloss_linear_scale_grads on the backend under test: each present
 * gradient times the device scalar, rounded once to its dtype (s = -0.375
 * makes the fp32 product exact), for a strided dhidden, an odd-sized dW
 * (a vector tail) and dbias in the weight's dtype; an absent gradient is
 * skipped. Then its bad input (CPU). */
static void scale_grads(tgroup *g, lmloss_dtype dt) {
  const int64_t N = 5, H = 13, V = 37;
  const double s = -0.375;
  lmloss_context ctx = tb_ctx();
  lmloss_tensor hid = host_new(dt, N, H, H), w = host_new(dt, V, H, H), b = host_new(dt, V, 1, 1);
  lmloss_tensor gh[3] = {host_new(dt, N, H, H + 3), host_new(dt, V, H, H), host_new(dt, V, 1, 1)};
  lmloss_tensor sc = host_new(LMLOSS_F32, 1, 1, 1), none = {0};
  tset(&sc, 0, 0, s);
  for (int q = 0; q < 3; q++) {
    host_poison(&gh[q]);
    for (int64_t i = 0; i < gh[q].rows; i++)
      for (int64_t j = 0; j < gh[q].cols; j++)
        tset(&gh[q], i, j, rng_normal());
  }
  for (int skip = -1; skip < 3; skip++) { /* skip: the gradient left absent */
    lmloss_tensor d[3], want[3];
    for (int q = 0; q < 3; q++) {
      want[q] = host_clone(&gh[q]);
      if (q != skip)
        for (int64_t i = 0; i < gh[q].rows; i++)
          for (int64_t j = 0; j < gh[q].cols; j++)
            tset(&want[q], i, j, tget(&gh[q], i, j) * s);
      d[q] = q == skip ? none : dev_clone(&gh[q]);
    }
    lmloss_head h = {dev_clone(&hid), dev_clone(&w), dev_clone(&b)};
    lmloss_head_grads gr = {d[0], d[1], d[2]};
    lmloss_tensor dsc = dev_clone(&sc);
    lmloss_status st = lmloss_linear_scale_grads(&ctx, &h, &gr, &dsc);
    tg_true(g, st == LMLOSS_OK, "%s, gradient %d absent: %s %s", dt_name(dt), skip,
            lmloss_status_string(st), lmloss_last_error());
    for (int q = 0; q < 3; q++) {
      lmloss_tensor got = host_clone(&gh[q]);
      if (q != skip) dev_fetch(&got, &d[q]);
      tg_true(g, same_bytes(&got, &want[q]), "%s, gradient %d absent: gradient %d scaled",
              dt_name(dt), skip, q);
      host_free(&got), host_free(&want[q]), dev_free(&d[q]);
    }
    dev_free(&h.hidden), dev_free(&h.weight), dev_free(&h.bias), dev_free(&dsc);
  }
  /* lmloss_scale, one strided tensor: by s, and by 1 (returns early) */
  for (int by_one = 0; by_one < 2; by_one++) {
    lmloss_tensor want = host_clone(&gh[0]), one = host_clone(&sc);
    if (by_one)
      tset(&one, 0, 0, 1.0);
    else
      for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < H; j++)
          tset(&want, i, j, tget(&gh[0], i, j) * s);
    lmloss_tensor d = dev_clone(&gh[0]), dsc = dev_clone(&one), got = host_clone(&gh[0]);
    lmloss_status st = lmloss_scale(&ctx, &d, &dsc);
    dev_fetch(&got, &d);
    tg_true(g, st == LMLOSS_OK && same_bytes(&got, &want), "%s: lmloss_scale by %s: %s",
            dt_name(dt), by_one ? "1" : "s", lmloss_status_string(st));
    host_free(&want), host_free(&one), host_free(&got), dev_free(&d), dev_free(&dsc);
  }
  lmloss_context cpu = lmloss_context_default();
  cpu.backend = LMLOSS_BACKEND_CPU;
  lmloss_tensor hf = host_new(LMLOSS_F32, N, H, H), wf = host_new(LMLOSS_F32, V, H, H);
  lmloss_tensor dwf = host_new(LMLOSS_F32, V, H, H), two = host_new(LMLOSS_F32, 2, 1, 1);
  lmloss_tensor si = host_new(LMLOSS_I64, 1, 1, 1), dbf = host_new(LMLOSS_F32, V, 1, 1);
  lmloss_head hh = {hf, wf, none};
  lmloss_head_grads gw = {none, dwf, none}, gb = {none, none, dbf};
  host_poison(&dwf);
  lmloss_tensor dwp = host_clone(&dwf);
  lmloss_tensor on_gpu = sc; /* never read: the device check comes first */
  on_gpu.device = LMLOSS_CUDA;
  const lmloss_head_grads *grs[] = {NULL, &gw, &gw, &gb, &gw};
  const lmloss_tensor *scs[] = {&sc, &two, &si, &sc, &on_gpu};
  const lmloss_status want[] = {LMLOSS_ERR_NULL_POINTER, LMLOSS_ERR_BAD_SHAPE, LMLOSS_ERR_BAD_DTYPE,
                                LMLOSS_ERR_BAD_SHAPE, LMLOSS_ERR_BAD_DEVICE};
  const char *what[] = {"grads NULL", "scale of 2", "scale I64", "dbias, no bias",
                        "scale on another device"};
  for (int i = 0; i < 5; i++) {
    lmloss_status st = lmloss_linear_scale_grads(&cpu, &hh, grs[i], scs[i]);
    tg_true(g, st == want[i] && lmloss_last_error()[0], "scale_grads %s: got %s", what[i],
            lmloss_status_string(st));
  }
  tg_true(g, same_bytes(&dwf, &dwp), "scale_grads: a refused call wrote dweight");
  host_free(&hid), host_free(&w), host_free(&b), host_free(&sc), host_free(&hf), host_free(&wf);
  host_free(&dwf), host_free(&dwp), host_free(&two), host_free(&si), host_free(&dbf);
  for (int q = 0; q < 3; q++)
    host_free(&gh[q]);
}

/* ---- the suite ---- */

static void ce_suite(lmloss_dtype dt) {
  tgroup g;
  char name[96];
  const char *dn = dt_name(dt);

  snprintf(name, sizeof name, "linear ce margins x V x modes x grads (%s)", dn);
  tg_begin(&g, name);
  for (int m = 0; m < 6; m++)
    for (int v = 0; v < 2; v++)
      for (int md = 0; md < 3; md++) {
        lc_case c = lc_base(12, v ? 4099 : 1003);
        int k = 6 * m + 3 * v + md;
        c.dt = dt, c.margin = margins[m], c.mode = md, c.grads = k % 4, c.bias = k % 2;
        c.idt = k % 3 ? LMLOSS_I64 : LMLOSS_I32, c.pad = k % 5 == 0 ? 3 : 0;
        c.gwdt = dt == LMLOSS_BF16 && k % 2 ? LMLOSS_BF16 : LMLOSS_F32;
        c.opt.reduction = (lmloss_reduction)(k % 4);
        c.opt.num_items = 9.5, c.opt.grad_output = 0.75f;
        rng_seed(1000 + k);
        lc_run(&g, &c);
      }
  tg_end(&g);

  static const char *optname[] = {
      "ignore_index (75%)", "label_smoothing", "z_loss",       "logit_scale", "softcap",
      "temperature",        "token_weight",    "class_weight", "dft",         "plain",
      "ls+zl+tw+cw+ign",    "scale+cap+T+dft", "all"};
  for (int o = 0; o < 13; o++) {
    snprintf(name, sizeof name, "linear ce option %s x reductions (%s)", optname[o], dn);
    tg_begin(&g, name);
    for (int r = 0; r < 4; r++)
      for (int md = FUSED; md <= BWD; md++) {
        int k = 2 * r + md;
        lc_case c = lc_base(o == 0 || o >= 10 ? 24 : 10, k % 3 == 0 ? 4099 : 1003);
        c.dt = dt, c.opt.reduction = (lmloss_reduction)r, c.mode = md;
        c.opt.num_items = 37.5, c.opt.grad_output = 0.75f;
        c.margin = (double[]){-1, 5, 17, -1}[k % 4], c.bias = k % 2, c.outs = k % 3 != 1;
        c.gwdt = dt == LMLOSS_BF16 && k % 2 ? LMLOSS_BF16 : LMLOSS_F32;
        c.chunks = r % 2; /* bf16: dW from vocab tiles, every option through their finish */
        int all = o == 12, mix1 = o == 10 || all, mix2 = o == 11 || all;
        if (o == 0 || mix1) c.ignore_frac = 0.75, c.opt.ignore_index = o == 0 ? -1 : -100;
        if (o == 1 || mix1) c.opt.label_smoothing = 0.1f;
        if (o == 2 || mix1) c.opt.z_loss = 1e-3f;
        if (o == 3 || mix2) c.opt.transform.logit_scale = 0.5f;
        if (o == 4 || mix2) c.opt.transform.softcap = 30.0f;
        if (o == 5 || mix2) c.opt.transform.temperature = 0.7f;
        if (o == 6 || mix1) c.tw = 1;
        if (o == 7 || mix1) c.cw = 1;
        if (o == 8 || mix2) c.opt.dft = 1;
        rng_seed(7000 + 100 * o + k);
        lc_run(&g, &c);
      }
    tg_end(&g);
  }

  snprintf(name, sizeof name, "linear ce all-ignored batch (%s)", dn);
  tg_begin(&g, name);
  for (int r = 0; r < 4; r++)
    for (int md = 0; md < 3; md++) {
      lc_case c = lc_base(6, 1003);
      c.dt = dt, c.all_ignored = 1, c.opt.reduction = (lmloss_reduction)r, c.mode = md;
      c.opt.num_items = 3, c.cw = md % 2, c.bias = 1, c.grads = r % 2 ? G_ALL : G_NO_W;
      rng_seed(100 + 3 * r + md);
      lc_run(&g, &c);
    }
  tg_end(&g);

  /* More rows than a group of the store holds (16-bit heads; an F32 head
   * has no store, and its runs check accumulate over chunks) */
  snprintf(name, sizeof name, "linear ce store in groups; dW added to (%s)", dn);
  tg_begin(&g, name);
  for (int k = 0; k < 4; k++) {
    lc_case c = lc_base(1300, k % 2 ? 601 : 257);
    c.dt = dt, c.chunks = 1, c.groups = dt != LMLOSS_F32, c.mode = k < 2 ? FUSED : BWD;
    c.bias = 1, c.ignore_frac = 0.1, c.opt.label_smoothing = k == 1 ? 0.1f : 0.0f;
    c.opt.reduction = (lmloss_reduction)(k % 2 ? LMLOSS_REDUCE_MEAN : LMLOSS_REDUCE_NONE);
    c.gwdt = dt != LMLOSS_F32 && k == 3 ? dt : LMLOSS_F32, c.accumulate = c.gwdt == LMLOSS_F32;
    rng_seed(300 + k);
    lc_run(&g, &c);
  }
  tg_end(&g);

  snprintf(name, sizeof name, "linear ce chunks: 1-row, 3-row, default; workspace (%s)", dn);
  tg_begin(&g, name);
  for (int k = 0; k < 5; k++) {
    lc_case c = lc_base(13, k % 2 ? 4099 : 1003);
    c.dt = dt, c.chunks = 1, c.mode = k < 2 ? FUSED : BWD, c.bias = 1, c.ignore_frac = 0.3;
    c.opt.reduction = (lmloss_reduction)(k % 2 ? LMLOSS_REDUCE_MEAN : LMLOSS_REDUCE_NONE);
    c.opt.label_smoothing = k == 1 ? 0.1f : 0.0f, c.tw = k == 2, c.opt.z_loss = k == 3 ? 1e-3f : 0;
    if (k == 4) { /* H large next to V: the vocab tiles take the rows in blocks */
      c = lc_base(40, 67);
      c.dt = dt, c.chunks = 1, c.H0 = 200, c.bias = 1, c.cw = 1, c.opt.label_smoothing = 0.1f;
      c.gwdt = dt == LMLOSS_BF16 ? LMLOSS_BF16 : LMLOSS_F32, c.ignore_frac = 0.2;
    }
    rng_seed(200 + k);
    lc_run(&g, &c);
  }
  tg_end(&g);
}

static void lp_suite(lmloss_dtype dt) {
  tgroup g;
  char name[96];
  const char *dn = dt_name(dt);
  static const lmloss_transform trs[] = {
      {1, 0, 1}, {1, 0, 0.7f}, {0.5f, 0, 1}, {1, 30, 1}, {0.8f, 25, 1.3f}};

  snprintf(name, sizeof name, "linear log-probs K x transform x mask x margin (%s)", dn);
  tg_begin(&g, name);
  for (int k = 0; k < 20; k++) {
    lp_case c = lp_base(12, k % 3 ? 1003 : 4099, k % 2 ? 3 : 1);
    c.dt = dt, c.tr = trs[k % 5], c.mask = k % 4 >= 2, c.entropy = k % 3 != 2, c.bias = k % 2;
    c.idt = k % 2 ? LMLOSS_I32 : LMLOSS_I64;
    c.margin = c.tr.temperature < 1 || c.tr.softcap > 0 ? (k % 2 ? 17 : -1) : margins[k % 6];
    c.saved = k % 4 == 1 || k % 4 == 2;
    rng_seed(3000 + k);
    lp_run(&g, &c);
  }
  tg_end(&g);

  snprintf(name, sizeof name, "linear log-probs backward dlogp/dentropy/both (%s)", dn);
  tg_begin(&g, name);
  for (int k = 0; k < 24; k++) {
    lp_case c = lp_base(12, k % 3 ? 1003 : 4099, k % 2 ? 3 : 1);
    c.dt = dt, c.mode = BWD, c.tr = trs[k % 5], c.mask = k % 4 >= 2, c.bias = k % 2;
    c.dlogp = k % 3 != 1, c.dent = k % 3 != 0, c.no_index = k % 2, c.grads = (k / 3) % 4;
    c.gwdt = dt == LMLOSS_BF16 && k % 2 ? LMLOSS_BF16 : LMLOSS_F32;
    c.margin = c.tr.temperature < 1 || c.tr.softcap > 0 ? (k % 2 ? 17 : -1) : margins[k % 6];
    c.chunks = (k / 2) % 2;
    rng_seed(4000 + k);
    lp_run(&g, &c);
  }
  tg_end(&g);

  /* Where the statistics are used (a 16-bit head, dW wanted, more than
   * one chunk, no dbias: the 1-row and 3-row budgets, whichever leave the
   * tiles room) and where they are not (a bias's gradient, F32 heads). */
  snprintf(name, sizeof name, "linear log-probs backward from saved statistics (%s)", dn);
  tg_begin(&g, name);
  for (int k = 0; k < 12; k++) {
    lp_case c = lp_base(12, k % 3 ? 1003 : 4099, k % 2 ? 3 : 1);
    c.dt = dt, c.mode = BWD, c.saved = 1, c.chunks = 1, c.tr = trs[k % 5], c.mask = k % 4 >= 2;
    c.dlogp = k % 3 != 1, c.dent = k % 3 != 0, c.no_index = k % 2,
    c.grads = k % 6 ? G_ALL : G_NO_DH;
    c.bias = k == 5, c.idt = k % 4 == 1 ? LMLOSS_I32 : LMLOSS_I64;
    c.gwdt = dt == LMLOSS_BF16 && k % 2 ? LMLOSS_BF16 : LMLOSS_F32;
    c.margin = c.tr.temperature < 1 || c.tr.softcap > 0 ? (k % 2 ? 17 : -1) : margins[k % 6];
    if (k == 11) { /* dhidden's fp32 sum (40 x 240 x 4 bytes) outgrows 3 rows' budget */
      c.N = 40, c.V = 67, c.K = 2, c.H0 = 200, c.mask = 0, c.saved = 2;
      c.gwdt = dt == LMLOSS_BF16 ? LMLOSS_BF16 : LMLOSS_F32;
    }
    rng_seed(6000 + k);
    lp_run(&g, &c);
  }
  tg_end(&g);

  snprintf(name, sizeof name, "linear log-probs chunks: 1-row, 3-row, default (%s)", dn);
  tg_begin(&g, name);
  for (int k = 0; k < 4; k++) {
    lp_case c = lp_base(11, 1003, 3);
    c.dt = dt, c.chunks = 1, c.mode = k ? BWD : FWD, c.mask = 1, c.bias = 1;
    c.dlogp = k != 2, c.dent = k != 1;
    if (k == 3) { /* rows in blocks in the vocab tiles, as for CE */
      c = lp_base(40, 67, 2);
      c.dt = dt, c.chunks = 1, c.mode = BWD, c.H0 = 200, c.bias = 1, c.dlogp = c.dent = 1;
      c.gwdt = dt == LMLOSS_BF16 ? LMLOSS_BF16 : LMLOSS_F32;
    }
    rng_seed(5000 + k);
    lp_run(&g, &c);
  }
  tg_end(&g);

  /* More indices a row than CUDA's finish has threads for them (its loop
   * after the rest), through the vocab tiles of a 16-bit head: from the
   * chunks' states, and from saved statistics (which K > 127 declines). */
  snprintf(name, sizeof name, "linear log-probs backward, K = 130 (%s)", dn);
  tg_begin(&g, name);
  for (int k = 0; k < 4; k++) {
    lp_case c = lp_base(12, 1003, 130);
    c.dt = dt, c.mode = BWD, c.chunks = 1, c.saved = k % 2, c.dlogp = 1, c.dent = k >= 2;
    c.tr = trs[k % 5], c.margin = k % 2 ? 17 : -1;
    c.gwdt = dt == LMLOSS_BF16 ? LMLOSS_BF16 : LMLOSS_F32;
    rng_seed(5100 + k);
    lp_run(&g, &c);
  }
  tg_end(&g);
}

int main(void) {
  tb_init();
  tgroup g;
  tg_begin(&g, "linear bad input");
  rng_seed(1);
  bad_input(&g);
  tg_end(&g);
  tg_begin(&g, "linear workspace within the budget");
  workspace_in_budget(&g);
  tg_end(&g);
  tg_begin(&g, "linear gradients scaled by a device scalar");
  scale_grads(&g, LMLOSS_F32);
  if (tb_is_cuda()) scale_grads(&g, LMLOSS_BF16);
  tg_end(&g);
  ce_suite(LMLOSS_F32);
  lp_suite(LMLOSS_F32);
  kept_suite();
  if (tb_is_cuda()) { /* the store is a 16-bit head's, and those run on CUDA only */
    tg_begin(&g, "linear store of groups in a 16-bit dweight");
    store_in_dweight(&g);
    tg_end(&g);
    ce_suite(LMLOSS_BF16);
    lp_suite(LMLOSS_BF16);
    printf("bf16 gradients, worst err / bf16 rounding (bound %g): dhidden %.3g dweight %.3g "
           "dbias %.3g\n",
           BF16_FACTOR, bf16_worst[0], bf16_worst[1], bf16_worst[2]);
  }
  return test_finish();
}
