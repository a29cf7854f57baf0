/*
 * test_ce.c - cross-entropy (forward, fused forward+backward with dlogits
 * separate or in place over the logits, backward from dloss) of the backend
 * under test against the REF backend: every option, reduction, dtype, index
 * dtype, stride, V and target margin, plus ignored, sparse, tied and
 * non-finite rows.
 */
#include "support/testing.h"

enum { FWD, FUSED, INPLACE, BWD };
static const char *mode_name[] = {"fwd", "fused", "inplace", "bwd"};
enum { PLAIN, NONFINITE, NEGINF, NEGINF_HEAD, NEGINF_REST, TIES, ALL_IGNORED, NEAR_TOP };

typedef struct {
  int64_t N, V, stride;
  lmloss_dtype xdt, idt, gdt;
  lmloss_ce_options opt;
  int tw, cw, mode, outs, special;
  double margin, ignore_frac, sigma;
} ce_case;

typedef struct {
  lmloss_tensor loss, lse, ent, amax, dlogits;
} ce_out;

static ce_out out_new(const ce_case *c, const lmloss_tensor *x) {
  ce_out o;
  o.loss = host_new(LMLOSS_F32, c->opt.reduction == LMLOSS_REDUCE_NONE ? c->N : 1, 1, 1);
  o.lse = host_new(LMLOSS_F32, c->N, 1, 1);
  o.ent = host_new(LMLOSS_F32, c->N, 1, 1);
  o.amax = host_new(LMLOSS_I64, c->N, 1, 1);
  o.dlogits = c->mode == INPLACE ? host_clone(x) : host_new(c->gdt, c->N, c->V, c->V + 3);
  host_poison(&o.loss), host_poison(&o.lse), host_poison(&o.ent), host_poison(&o.amax);
  if (c->mode != INPLACE) host_poison(&o.dlogits);
  return o;
}

static void out_free(ce_out *o) {
  host_free(&o->loss), host_free(&o->lse), host_free(&o->ent), host_free(&o->amax);
  host_free(&o->dlogits);
}

/* Run one call; on_dev: the backend under test in its memory, else REF.
 * `all` gives REF every optional output. */
static lmloss_status call(const ce_case *c, int on_dev, const lmloss_ce_inputs *hin,
                          const lmloss_ce_options *opt, const lmloss_tensor *dloss, ce_out *o,
                          int all) {
  lmloss_context ctx = on_dev ? tb_ctx() : ref_ctx();
  lmloss_ce_inputs in = *hin;
  ce_out d = *o;
  lmloss_tensor dl = dloss ? *dloss : (lmloss_tensor){0};
  size_t wsb = lmloss_cross_entropy_workspace_size(c->N);
  void *ws;
  if (on_dev) {
    in.target = dev_clone(&hin->target), in.token_weight = dev_clone(&hin->token_weight);
    in.class_weight = dev_clone(&hin->class_weight), d.loss = dev_clone(&o->loss);
    d.lse = dev_clone(&o->lse), d.ent = dev_clone(&o->ent), d.amax = dev_clone(&o->amax);
    d.dlogits = dev_clone(&o->dlogits);
    in.logits = c->mode == INPLACE ? d.dlogits : dev_clone(&hin->logits);
    if (dloss) dl = dev_clone(dloss);
    ws = dev_alloc_bytes(wsb);
  } else {
    if (c->mode == INPLACE) in.logits = o->dlogits;
    ws = malloc(wsb);
  }
  lmloss_status st;
  if (c->mode == BWD) {
    st = lmloss_cross_entropy_backward(&ctx, &in, opt, &dl, &d.dlogits, ws, wsb);
  } else {
    lmloss_ce_outputs out = {d.loss, {0}, {0}, {0}, {0}};
    if (all || c->outs) out.lse = d.lse, out.entropy = d.ent, out.argmax = d.amax;
    if (c->mode != FWD) out.dlogits = d.dlogits;
    st = lmloss_cross_entropy(&ctx, &in, opt, &out, ws, wsb);
  }
  if (on_dev) {
    dev_fetch(&o->loss, &d.loss), dev_fetch(&o->lse, &d.lse), dev_fetch(&o->ent, &d.ent);
    dev_fetch(&o->amax, &d.amax), dev_fetch(&o->dlogits, &d.dlogits);
    dev_free(&in.target), dev_free(&in.token_weight), dev_free(&in.class_weight);
    dev_free(&d.loss), dev_free(&d.lse), dev_free(&d.ent), dev_free(&d.amax);
    dev_free(&d.dlogits);
    if (c->mode != INPLACE) dev_free(&in.logits);
    if (dloss) dev_free(&dl);
    dev_free_bytes(ws);
  } else {
    free(ws);
  }
  return st;
}

static int64_t tgt(const lmloss_tensor *t, int64_t i) { return (int64_t)tget(t, i, 0); }

/* Compare the backend's outputs with REF's. */
static void compare(tgroup *g, const ce_case *c, const lmloss_ce_inputs *in, const ce_out *got,
                    const ce_out *ref, const lmloss_tensor *dloss, const lmloss_tensor *poison) {
  const lmloss_ce_options *o = &c->opt;
  int64_t N = c->N, V = c->V;
  if (c->mode != BWD) {
    for (int64_t i = 0; i < got->loss.rows; i++)
      tg_close(g, tget(&got->loss, i, 0), tget(&ref->loss, i, 0), LMLOSS_F32, 0, "loss", i, 0);
    if (c->outs)
      for (int64_t i = 0; i < N; i++) {
        tg_close(g, tget(&got->lse, i, 0), tget(&ref->lse, i, 0), LMLOSS_F32, 0, "lse", i, 0);
        tg_close(g, tget(&got->ent, i, 0), tget(&ref->ent, i, 0), LMLOSS_F32, 0, "entropy", i, 0);
        if (!isnan(tget(&ref->lse, i, 0)))
          tg_true(g, tget(&got->amax, i, 0) == tget(&ref->amax, i, 0), "argmax[%lld] got %g ref %g",
                  (long long)i, tget(&got->amax, i, 0), tget(&ref->amax, i, 0));
      }
  }
  if (c->mode == FWD) return;
  /* Gradient scale pieces for the cancellation floor. */
  double C = 0.0, D = 0.0, factor = 1.0, e = o->label_smoothing;
  for (int64_t j = 0; j < V; j++)
    C += c->cw ? tget(&in->class_weight, j, 0) : 1.0;
  for (int64_t i = 0; i < N; i++) {
    int64_t y = tgt(&in->target, i);
    if (y != o->ignore_index) D += c->cw ? tget(&in->class_weight, y, 0) : 1.0;
  }
  if (o->reduction == LMLOSS_REDUCE_MEAN) factor = D > 0 ? 1.0 / D : 0.0;
  if (o->reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) factor = 1.0 / o->num_items;
  double cap = o->transform.softcap, s = o->transform.logit_scale, T = o->transform.temperature;
  for (int64_t i = 0; i < N; i++) {
    int64_t y = tgt(&in->target, i);
    if (y == o->ignore_index && !o->zero_ignored_rows) {
      /* sparse supervision: the row must be exactly as it was */
      int same = 1;
      for (int64_t j = 0; j < V; j++)
        same &= memcmp((char *)got->dlogits.data + (size_t)(i * got->dlogits.row_stride + j) *
                                                       (c->gdt == LMLOSS_F32 ? 4 : 2),
                       (char *)poison->data +
                           (size_t)(i * poison->row_stride + j) * (c->gdt == LMLOSS_F32 ? 4 : 2),
                       c->gdt == LMLOSS_F32 ? 4 : 2) == 0;
      tg_true(g, same, "ignored dlogits row %lld was written (zero_ignored_rows = 0)",
              (long long)i);
      continue;
    }
    double up = c->mode == BWD ? tget(dloss, o->reduction == LMLOSS_REDUCE_NONE ? i : 0, 0)
                               : o->grad_output;
    double wi = c->tw ? tget(&in->token_weight, i, 0) : 1.0, scale = fabs(wi * factor * up);
    int64_t a = (int64_t)tget(&ref->amax, i, 0);
    double cy = (y >= 0 && y < V && c->cw) ? tget(&in->class_weight, y, 0) : 1.0;
    double hot = cy * (1 - e), A = hot + e * C / V;
    for (int64_t j = 0; j < V; j++) {
      double extra = 0.0;
      if (e > 0 && y != o->ignore_index) {
        double b = (j == y ? hot : 0.0) + e * (c->cw ? tget(&in->class_weight, j, 0) : 1.0) / V;
        double x = tget(&in->logits, i, j), dzdx = s / T;
        if (cap > 0) {
          double u = fabs(s * x / cap), q = exp(-2 * u);
          dzdx = s / T * 4 * q / ((1 + q) * (1 + q));
        }
        extra = TOL_CANCEL * (j == a ? fabs(A - b) : fabs(b)) * scale * dzdx;
      }
      tg_close(g, tget(&got->dlogits, i, j), tget(&ref->dlogits, i, j), c->gdt, extra, "dlogits", i,
               j);
    }
  }
}

static void build_inputs(const ce_case *c, lmloss_ce_inputs *in, int64_t *tv) {
  int64_t N = c->N, V = c->V;
  for (int64_t i = 0; i < N; i++) {
    int ign = c->special == ALL_IGNORED || rng_uniform() < c->ignore_frac;
    tv[i] = ign ? c->opt.ignore_index : rng_int(V);
  }
  memset(in, 0, sizeof *in);
  in->logits = host_new(c->xdt, N, V, c->stride);
  host_poison(&in->logits);
  fill_logits(&in->logits, c->sigma, tv, c->margin);
  if (c->special == TIES)
    for (int64_t i = 0; i < N; i++) {
      double mx = -INFINITY;
      for (int64_t j = 0; j < V; j++)
        mx = fmax(mx, tget(&in->logits, i, j));
      int64_t k = 1 + rng_int(3);
      for (int64_t t = 0; t < k; t++)
        tset(&in->logits, i, rng_int(V), mx);
      if (i % 2 && tv[i] >= 0) tset(&in->logits, i, tv[i], mx);
    }
  if (c->special == NEAR_TOP) /* 1-3 entries 0.5-1 below the target, in its 16-byte vector */
    for (int64_t i = 0; i < N; i++)
      for (int64_t d = 1; tv[i] >= 0 && d <= 1 + i % 3; d++) {
        const int64_t j = (tv[i] & ~(int64_t)3) + ((tv[i] + d) & 3);
        if (j < V) tset(&in->logits, i, j, tget(&in->logits, i, tv[i]) - 0.25 * (d + 1));
      }
  if (c->special == NEGINF)
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < V; j++)
        if (j != tv[i] && rng_uniform() < 0.3) tset(&in->logits, i, j, -INFINITY);
  if (c->special == NEGINF_HEAD) /* -inf over the first 3/4 of the row, the target kept */
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < V * 3 / 4; j++)
        if (j != tv[i]) tset(&in->logits, i, j, -INFINITY);
  if (c->special == NEGINF_REST) /* the target alone finite */
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < V; j++)
        if (j != tv[i]) tset(&in->logits, i, j, -INFINITY);
  if (c->special == NONFINITE && N >= 4) {
    tset(&in->logits, 0, rng_int(V), NAN);
    tset(&in->logits, 1, rng_int(V), INFINITY);
    for (int64_t j = 0; j < V; j++)
      tset(&in->logits, 2, j, -INFINITY);
    for (int64_t i = 0; i < 3; i++)
      tv[i] = rng_int(V);
  }
  in->target = host_new(c->idt, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&in->target, i, 0, (double)tv[i]);
  if (c->tw) {
    in->token_weight = host_new(LMLOSS_F32, N, 1, 1);
    for (int64_t i = 0; i < N; i++)
      tset(&in->token_weight, i, 0, 0.25 + 1.5 * rng_uniform());
  }
  if (c->cw) {
    in->class_weight = host_new(LMLOSS_F32, V, 1, 1);
    for (int64_t j = 0; j < V; j++)
      tset(&in->class_weight, j, 0, rng_uniform() < 0.1 ? 0.0 : 0.5 + rng_uniform());
  }
}

static void run_case(tgroup *g, const ce_case *c) {
  int64_t *tv = malloc(sizeof(int64_t) * (size_t)c->N);
  lmloss_ce_inputs in;
  build_inputs(c, &in, tv);
  lmloss_tensor dloss = {0};
  if (c->mode == BWD) {
    dloss = host_new(LMLOSS_F32, c->opt.reduction == LMLOSS_REDUCE_NONE ? c->N : 1, 1, 1);
    for (int64_t i = 0; i < dloss.rows; i++)
      tset(&dloss, i, 0, 0.5 + rng_uniform());
  }
  ce_out ref = out_new(c, &in.logits), got = out_new(c, &in.logits);
  lmloss_tensor poison = host_clone(&got.dlogits);
  lmloss_status sr = call(c, 0, &in, &c->opt, c->mode == BWD ? &dloss : NULL, &ref, 1);
  lmloss_status sg = call(c, 1, &in, &c->opt, c->mode == BWD ? &dloss : NULL, &got, 0);
  if (tg_true(g, sr == LMLOSS_OK && sg == LMLOSS_OK, "status ref %s got %s (%s)",
              lmloss_status_string(sr), lmloss_status_string(sg), lmloss_last_error())) {
    size_t before = (size_t)g->fails;
    compare(g, c, &in, &got, &ref, &dloss, &poison);
    if (c->special == ALL_IGNORED) {
      if (c->mode != BWD && c->opt.reduction != LMLOSS_REDUCE_NONE)
        tg_true(g, tget(&got.loss, 0, 0) == 0.0, "all-ignored loss %g", tget(&got.loss, 0, 0));
      if (c->mode != FWD)
        for (int64_t i = 0; i < c->N; i++)
          for (int64_t j = 0; j < c->V; j++)
            tg_true(g, tget(&got.dlogits, i, j) == 0.0, "all-ignored dlogits nonzero");
    }
    if (c->opt.zero_ignored_rows == 0 && c->mode != FWD) {
      /* sparse supervision equals the dense path on supervised rows */
      ce_case d = *c;
      d.opt.zero_ignored_rows = 1;
      ce_out dense = out_new(&d, &in.logits);
      if (call(&d, 1, &in, &d.opt, c->mode == BWD ? &dloss : NULL, &dense, 0) == LMLOSS_OK) {
        for (int64_t i = 0; i < c->N; i++)
          if (tv[i] != c->opt.ignore_index)
            for (int64_t j = 0; j < c->V; j++)
              tg_close(g, tget(&got.dlogits, i, j), tget(&dense.dlogits, i, j), c->gdt, 0,
                       "sparse-vs-dense", i, j);
        if (c->mode != BWD)
          tg_close(g, tget(&got.loss, 0, 0), tget(&dense.loss, 0, 0), LMLOSS_F32, 0,
                   "sparse-vs-dense loss", 0, 0);
      } else {
        tg_true(g, 0, "dense call failed");
      }
      out_free(&dense);
    }
    if ((size_t)g->fails > before && before == 0)
      printf("  case: N=%lld V=%lld stride=%lld x=%s idx=%s grad=%s mode=%s margin=%g ls=%g "
             "zl=%g s=%g cap=%g T=%g red=%d dft=%d tw=%d cw=%d special=%d\n",
             (long long)c->N, (long long)c->V, (long long)c->stride, dt_name(c->xdt),
             dt_name(c->idt), dt_name(c->gdt), mode_name[c->mode], c->margin,
             c->opt.label_smoothing, c->opt.z_loss, c->opt.transform.logit_scale,
             c->opt.transform.softcap, c->opt.transform.temperature, (int)c->opt.reduction,
             c->opt.dft, c->tw, c->cw, c->special);
  }
  out_free(&ref), out_free(&got), host_free(&poison), host_free(&dloss);
  host_free(&in.logits), host_free(&in.target), host_free(&in.token_weight);
  host_free(&in.class_weight);
  free(tv);
}

static ce_case base(int64_t N, int64_t V) {
  ce_case c;
  memset(&c, 0, sizeof c);
  c.N = N, c.V = V, c.stride = V, c.xdt = c.gdt = LMLOSS_F32, c.idt = LMLOSS_I64;
  c.opt = lmloss_ce_options_default();
  c.mode = FUSED, c.outs = 1, c.margin = -1, c.sigma = 2.0;
  return c;
}

static const double margins[] = {-1, 0, 5, 17, 20, 30, 50, 100, 1000};
static const lmloss_dtype fdts[] = {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16};

int main(void) {
  tb_init();
  tgroup g;
  static const int64_t Vs[] = {1, 2, 3, 17, 1003, 40001, 151936};

  /* V x margin x dtype, fused forward+backward with every per-row output */
  for (int v = 0; v < 7; v++) {
    char name[64];
    snprintf(name, sizeof name, "ce margins x dtypes, V=%lld", (long long)Vs[v]);
    tg_begin(&g, name);
    for (int m = 0; m < 9; m++)
      for (int d = 0; d < 3; d++) {
        ce_case c = base(Vs[v] >= 40001 ? 2 : 6, Vs[v]);
        c.xdt = c.gdt = fdts[d], c.margin = margins[m];
        c.mode = (m + d) % 4 == 3 ? INPLACE : FUSED;
        c.idt = (m + d) % 2 ? LMLOSS_I32 : LMLOSS_I64;
        c.stride = (m % 3 == 1) ? Vs[v] + 7 : Vs[v];
        rng_seed(1000 * v + 10 * m + d);
        run_case(&g, &c);
      }
    tg_end(&g);
  }

  /* every option (alone and combined) x reduction x mode */
  static const char *optname[] = {"ignore_index", "label_smoothing", "z_loss",  "logit_scale",
                                  "softcap",      "temperature",     "token_w", "class_w",
                                  "dft",          "plain",           "all"};
  for (int o = 0; o < 11; o++) {
    char name[64];
    snprintf(name, sizeof name, "ce option %s x reductions x modes", optname[o]);
    tg_begin(&g, name);
    for (int r = 0; r < 4; r++)
      for (int md = 0; md < 4; md++)
        for (int vi = 0; vi < 2; vi++) {
          ce_case c = base(8, vi ? 1003 : 17);
          int k = r * 4 + md;
          c.opt.reduction = (lmloss_reduction)r;
          c.opt.num_items = 37.5;
          c.mode = md;
          c.margin = (double[]){-1, 20, 100, 5}[k % 4];
          c.xdt = fdts[k % 3], c.gdt = md == INPLACE ? c.xdt : fdts[(k + vi) % 3];
          c.idt = k % 2 ? LMLOSS_I32 : LMLOSS_I64;
          c.stride = c.V + (k % 2) * 5;
          c.outs = k % 2 == 0;
          c.opt.grad_output = 0.75f;
          if (o == 0 || o == 10) c.ignore_frac = 0.3, c.opt.ignore_index = o == 0 ? -1 : -100;
          if (o == 1 || o == 10) c.opt.label_smoothing = 0.1f;
          if (o == 2 || o == 10) c.opt.z_loss = 1e-3f;
          if (o == 3 || o == 10) c.opt.transform.logit_scale = 0.5f;
          if (o == 4 || o == 10) c.opt.transform.softcap = 30.0f;
          if (o == 5 || o == 10) c.opt.transform.temperature = 0.7f;
          if (o == 6 || o == 10) c.tw = 1;
          if (o == 7 || o == 10) c.cw = 1;
          if (o == 8 || o == 10) c.opt.dft = 1;
          rng_seed(7000 + 100 * o + 10 * k + vi);
          run_case(&g, &c);
        }
    tg_end(&g);
  }

  tg_begin(&g, "ce all-ignored batch");
  for (int r = 0; r < 4; r++)
    for (int md = 0; md < 4; md++) {
      ce_case c = base(5, 1003);
      c.special = ALL_IGNORED, c.opt.reduction = (lmloss_reduction)r, c.mode = md;
      c.opt.num_items = 3;
      c.cw = md % 2;
      rng_seed(100 + r * 4 + md);
      run_case(&g, &c);
    }
  tg_end(&g);

  tg_begin(&g, "ce sparse supervision (zero_ignored_rows=0)");
  for (int r = 0; r < 4; r++)
    for (int md = FUSED; md <= BWD; md++) {
      ce_case c = base(9, 1003);
      c.opt.zero_ignored_rows = 0, c.ignore_frac = 0.5, c.opt.reduction = (lmloss_reduction)r;
      c.mode = md, c.opt.label_smoothing = r == 1 ? 0.05f : 0.0f, c.margin = 30;
      c.xdt = c.gdt = fdts[(r + md) % 3];
      rng_seed(200 + r * 4 + md);
      run_case(&g, &c);
    }
  tg_end(&g);

  tg_begin(&g, "ce ties in the max");
  for (int k = 0; k < 12; k++) {
    ce_case c = base(8, k % 2 ? 17 : 1003);
    c.special = TIES, c.margin = k % 3 ? 40 : -1, c.mode = k % 4;
    c.xdt = c.gdt = fdts[k % 3];
    c.opt.label_smoothing = k % 2 ? 0.1f : 0.0f;
    rng_seed(300 + k);
    run_case(&g, &c);
  }
  tg_end(&g);

  tg_begin(&g, "ce NaN/+inf/all -inf rows, -inf entries");
  for (int k = 0; k < 16; k++) {
    ce_case c = base(7, k % 2 ? 17 : 1003);
    c.special = k < 8 ? NONFINITE : NEGINF, c.mode = k % 4;
    c.opt.reduction = (lmloss_reduction)((k / 2) % 4);
    c.xdt = c.gdt = fdts[k % 3];
    c.margin = k % 3 ? 25 : -1;
    c.opt.z_loss = k % 3 == 2 ? 1e-3f : 0.0f;
    c.opt.transform.softcap = k == 5 || k == 12 ? 20.0f : 0.0f;
    rng_seed(400 + k);
    run_case(&g, &c);
  }
  tg_end(&g);

  /* Under softcap a -inf logit is -cap, so such a row's loss is the -inf
   * columns' terms alone: a vector load's padding past V must not add to
   * them (V not a multiple of any vector width). */
  tg_begin(&g, "ce only the target finite, softcap");
  for (int k = 0; k < 12; k++) {
    ce_case c = base(5, k % 2 ? 17 : 1003);
    c.special = NEGINF_REST, c.mode = k % 4;
    c.opt.reduction = LMLOSS_REDUCE_NONE;
    c.xdt = c.gdt = fdts[k % 3];
    c.margin = k % 3 ? 25 : -1;
    c.opt.transform.softcap = 20.0f;
    c.opt.transform.temperature = k % 4 == 1 ? 0.6f : 1.0f;
    rng_seed(450 + k);
    run_case(&g, &c);
  }
  tg_end(&g);

  /* On CUDA a row this wide is split over a cluster: whole CTA chunks see
   * only -inf, which softcap maps to a finite -cap (the row stays finite). */
  tg_begin(&g, "ce -inf over whole chunks of a wide row");
  for (int k = 0; k < 6; k++) {
    ce_case c = base(2, 151936);
    c.special = NEGINF_HEAD, c.mode = k % 2 ? BWD : FUSED;
    c.xdt = c.gdt = fdts[k % 3];
    c.opt.transform.softcap = k < 3 ? 20.0f : 0.0f;
    rng_seed(500 + k);
    run_case(&g, &c);
  }
  tg_end(&g);

  /* The plain options (a gradient; no softcap, smoothing, class weights,
   * DFT, entropy or argmax): on CUDA the held plan (src/cuda/held.cuh),
   * which the groups above reach only in part: peaked, tied and
   * non-finite rows, -inf over whole CTA chunks, rows of one to sixteen
   * CTAs, with the per-row options it keeps (aligned rows: odd k). */
  tg_begin(&g, "ce plain options: margins, ties, non-finite and wide rows");
  static const int specials[] = {PLAIN, TIES, NONFINITE, NEGINF, NEGINF_HEAD};
  for (int k = 0; k < 40; k++) {
    const int64_t V = (int64_t[]){1003, 4096, 151936, 262144}[k % 4];
    ce_case c = base(V > 4096 ? 2 : 6, V);
    c.outs = 0, c.mode = FUSED + k % 3, c.margin = margins[k % 9], c.special = specials[k % 5];
    c.xdt = fdts[(k / 3) % 3], c.gdt = c.mode == INPLACE ? c.xdt : fdts[(k / 4) % 3];
    c.idt = k % 2 ? LMLOSS_I32 : LMLOSS_I64;
    c.stride = k % 2 ? (V + 7) / 8 * 8 + (k % 7 == 3 ? 8 : 0) : V; /* 16-byte aligned rows */
    c.opt.reduction = (lmloss_reduction)(k % 4), c.opt.num_items = 37.5;
    c.opt.grad_output = 0.75f;
    c.opt.z_loss = k % 2 ? 1e-3f : 0.0f;
    c.opt.transform.temperature = k % 5 == 2 ? 0.7f : 1.0f;
    c.tw = k % 3 == 0;
    c.ignore_frac = k % 3 == 1 ? 0.3 : 0.0;
    c.opt.zero_ignored_rows = k % 6 != 4;
    rng_seed(600 + k);
    run_case(&g, &c);
  }
  tg_end(&g);

  /* CUDA's held plan: a thread holding the max sums its terms again
   * without the max where its own sum is below 2 (held.cuh, stats). A
   * peaked max with 1-3 entries 0.5-1 below it in its own vector puts
   * that sum on either side of 2, the rest of the row far below. */
  tg_begin(&g, "ce near-max entries beside a peaked max");
  for (int k = 0; k < 12; k++) {
    const int64_t V = (int64_t[]){1003, 4096, 151936}[k % 3];
    ce_case c = base(6, V);
    c.outs = 0, c.mode = FUSED + k % 3, c.margin = (double[]){17, 30, 100, 20}[k % 4];
    c.special = NEAR_TOP;
    c.xdt = fdts[(k / 3) % 3], c.gdt = c.mode == INPLACE ? c.xdt : fdts[k % 3];
    c.stride = k % 2 ? (V + 7) / 8 * 8 : V; /* 16-byte aligned rows */
    c.opt.reduction = (lmloss_reduction)(k % 4);
    c.opt.z_loss = k % 2 ? 1e-3f : 0.0f;
    rng_seed(700 + k);
    run_case(&g, &c);
  }
  tg_end(&g);

  return test_finish();
}
