/*
 * test_logprob.c - log-probs (K = 1 and K > 1), entropy, entropy-only and
 * the log-probs backward (from dlogp and/or dentropy, separate or in place)
 * of the backend under test against the REF backend, with temperature,
 * logit scale, softcap, mask, strides, every dtype, peaked rows, ties and
 * non-finite rows.
 */
#include "support/testing.h"

typedef struct {
  int64_t N, V, K, stride;
  lmloss_dtype xdt, idt, odt;
  lmloss_transform tr;
  int mask, ent, dlogp, dent, inplace, nonfinite, ties, entropy_only;
  int null_absent; /* pass absent optional tensors as NULL pointers, not {data = NULL} */
  int saved;       /* the backend's backward takes the statistics its forward saved */
  double margin;
} lp_case;

static lmloss_tensor up(const lmloss_tensor *t, int on_dev) { return on_dev ? dev_clone(t) : *t; }
/* An absent optional tensor: {data = NULL} or, with null_absent, NULL. */
static const lmloss_tensor *opt_t(const lp_case *c, const lmloss_tensor *t) {
  return c->null_absent && !t->data ? NULL : t;
}
static void down(lmloss_tensor *h, lmloss_tensor *d, int on_dev) {
  if (on_dev) dev_fetch(h, d), dev_free(d);
}

/* stats: where the forward saves the rows' statistics (absent: not asked). */
static lmloss_status fwd(const lp_case *c, int on_dev, const lmloss_tensor *x,
                         const lmloss_tensor *idx, const lmloss_tensor *mask, lmloss_tensor *logp,
                         lmloss_tensor *ent, lmloss_tensor *stats) {
  lmloss_context ctx = on_dev ? tb_ctx() : ref_ctx();
  lmloss_tensor dx = up(x, on_dev), di = up(idx, on_dev), dm = up(mask, on_dev);
  lmloss_tensor dl = up(logp, on_dev), de = up(ent, on_dev), ds = up(stats, on_dev);
  lmloss_status st = c->entropy_only ? lmloss_entropy(&ctx, &dx, &c->tr, &de)
                                     : lmloss_log_probs(&ctx, &dx, &di, opt_t(c, &dm), &c->tr, &dl,
                                                        opt_t(c, &de), opt_t(c, &ds));
  down(logp, &dl, on_dev), down(ent, &de, on_dev), down(stats, &ds, on_dev);
  if (on_dev) dev_free(&dx), dev_free(&di), dev_free(&dm);
  return st;
}

static lmloss_status bwd(const lp_case *c, int on_dev, const lmloss_tensor *x,
                         const lmloss_tensor *idx, const lmloss_tensor *mask,
                         const lmloss_tensor *dlogp, const lmloss_tensor *dent,
                         const lmloss_tensor *stats, lmloss_tensor *dlogits) {
  lmloss_context ctx = on_dev ? tb_ctx() : ref_ctx();
  lmloss_tensor dg = up(dlogits, on_dev);
  lmloss_tensor dx = c->inplace ? dg : up(x, on_dev);
  lmloss_tensor di = up(idx, on_dev), dm = up(mask, on_dev), dp = up(dlogp, on_dev);
  lmloss_tensor dh = up(dent, on_dev), ds = up(stats, on_dev);
  lmloss_status st = lmloss_log_probs_backward(&ctx, &dx, opt_t(c, &di), opt_t(c, &dm), &c->tr,
                                               opt_t(c, &dp), opt_t(c, &dh), &dg, opt_t(c, &ds));
  down(dlogits, &dg, on_dev);
  if (on_dev) {
    if (!c->inplace) dev_free(&dx);
    dev_free(&di), dev_free(&dm), dev_free(&dp), dev_free(&dh), dev_free(&ds);
  }
  return st;
}

static double dzdx(const lmloss_transform *t, double x) {
  double s = t->logit_scale, cap = t->softcap, T = t->temperature;
  if (cap > 0) {
    double q = exp(-2 * fabs(s * x / cap));
    return s / T * 4 * q / ((1 + q) * (1 + q));
  }
  return s / T;
}

static void run_case(tgroup *g, const lp_case *c) {
  int64_t N = c->N, V = c->V, K = c->K;
  lmloss_tensor x = host_new(c->xdt, N, V, c->stride);
  host_poison(&x);
  lmloss_tensor idx = {0}, mask = {0}, dlogp = {0}, dent = {0};
  int64_t *t0 = malloc(sizeof(int64_t) * (size_t)N);
  if (!c->entropy_only) idx = host_new(c->idt, N, K, K + (K > 1));
  for (int64_t i = 0; i < N; i++) {
    t0[i] = rng_int(V);
    for (int64_t k = 0; k < K && idx.data; k++)
      tset(&idx, i, k, k ? (double)rng_int(V) : t0[i]);
  }
  fill_logits(&x, 2.0, t0, c->margin);
  if (c->ties)
    for (int64_t i = 0; i < N; i++) {
      double mx = -INFINITY;
      for (int64_t j = 0; j < V; j++)
        mx = fmax(mx, tget(&x, i, j));
      for (int t = 0; t < 2; t++)
        tset(&x, i, rng_int(V), mx);
    }
  if (c->nonfinite && N >= 4) {
    tset(&x, 0, rng_int(V), NAN);
    tset(&x, 1, rng_int(V), INFINITY);
    for (int64_t j = 0; j < V; j++)
      tset(&x, 2, j, -INFINITY);
    for (int64_t j = 0; j < V; j++)
      if (j != t0[3] && rng_uniform() < 0.3) tset(&x, 3, j, -INFINITY);
    /* the index alone finite: under softcap the row's mass off it is the
     * -inf columns' -cap terms, and a vector's padding must not add */
    for (int64_t j = 0; j < V && N >= 6; j++)
      if (j != t0[4]) tset(&x, 4, j, -INFINITY);
  }
  if (c->mask) {
    mask = host_new(LMLOSS_BOOL, N, 1, 1);
    for (int64_t i = 0; i < N; i++)
      tset(&mask, i, 0, i % 3 != 1);
  }
  /* forward */
  lmloss_tensor lr = {0}, lg = {0}, er = {0}, eg = {0};
  if (!c->entropy_only) lr = host_new(c->odt, N, K, K), host_poison(&lr), lg = host_clone(&lr);
  if (c->ent || c->entropy_only)
    er = host_new(LMLOSS_F32, N, 1, 1), host_poison(&er), eg = host_clone(&er);
  lmloss_tensor none = {0}, stats = none;
  if (c->saved) stats = host_new(LMLOSS_F32, N, LMLOSS_ROW_STATS, LMLOSS_ROW_STATS + 1);
  if (c->saved) host_poison(&stats);
  lmloss_status sr = fwd(c, 0, &x, &idx, &mask, &lr, &er, &none);
  lmloss_status sg = fwd(c, 1, &x, &idx, &mask, &lg, &eg, &stats);
  size_t before = (size_t)g->fails;
  if (tg_true(g, sr == LMLOSS_OK && sg == LMLOSS_OK, "forward status ref %s got %s (%s)",
              lmloss_status_string(sr), lmloss_status_string(sg), lmloss_last_error())) {
    for (int64_t i = 0; i < N; i++) {
      for (int64_t k = 0; k < K && lr.data; k++) {
        tg_close(g, tget(&lg, i, k), tget(&lr, i, k), c->odt, 0, "logp", i, k);
        tg_true(g, !(tget(&lg, i, k) > 0), "logp[%lld,%lld] = %g > 0", (long long)i, (long long)k,
                tget(&lg, i, k));
      }
      if (er.data) tg_close(g, tget(&eg, i, 0), tget(&er, i, 0), LMLOSS_F32, 0, "entropy", i, 0);
    }
  }
  /* backward */
  if (!c->entropy_only && (c->dlogp || c->dent)) {
    lmloss_tensor el = host_new(LMLOSS_F32, N, 1, 1), ll = host_new(LMLOSS_F32, N, K, K);
    lmloss_transform tr = c->tr;
    lmloss_context rc = ref_ctx();
    lmloss_log_probs(&rc, &x, &idx, NULL, &tr, &ll, &el, NULL); /* p and H for the floors */
    if (c->dlogp) {
      dlogp = host_new(LMLOSS_F32, N, K, K);
      for (int64_t i = 0; i < N; i++)
        for (int64_t k = 0; k < K; k++)
          tset(&dlogp, i, k, 0.25 + rng_uniform());
    }
    if (c->dent) {
      dent = host_new(LMLOSS_F32, N, 1, 1);
      for (int64_t i = 0; i < N; i++)
        tset(&dent, i, 0, rng_uniform() - 0.5);
    }
    lmloss_tensor gr, gg;
    if (c->inplace) {
      gr = host_clone(&x), gg = host_clone(&x);
    } else {
      gr = host_new(c->odt, N, V, V + 2), host_poison(&gr), gg = host_clone(&gr);
    }
    lmloss_tensor idx_b = c->dlogp ? idx : (lmloss_tensor){0};
    sr = bwd(c, 0, c->inplace ? &gr : &x, &idx_b, &mask, &dlogp, &dent, &none, &gr);
    sg = bwd(c, 1, c->inplace ? &gg : &x, &idx_b, &mask, &dlogp, &dent, &stats, &gg);
    if (tg_true(g, sr == LMLOSS_OK && sg == LMLOSS_OK, "backward status ref %s got %s (%s)",
                lmloss_status_string(sr), lmloss_status_string(sg), lmloss_last_error())) {
      double *fl = malloc(sizeof(double) * (size_t)V);
      for (int64_t i = 0; i < N; i++) {
        double H = tget(&el, i, 0), dH = c->dent ? fabs(tget(&dent, i, 0)) : 0, gabs = 0;
        for (int64_t k = 0; k < K && c->dlogp; k++)
          gabs += fabs(tget(&dlogp, i, k));
        int64_t a = 0;
        for (int64_t j = 1; j < V; j++)
          if (tget(&x, i, j) > tget(&x, i, a)) a = j;
        double lp0 = tget(&ll, i, 0), x0 = tget(&x, i, (int64_t)tget(&idx, i, 0)), rest = 0;
        for (int64_t j = 0; j < V; j++) {
          double xj = tget(&x, i, j), s = c->tr.logit_scale, cap = c->tr.softcap;
          double wj = cap > 0 ? cap * tanh(s * xj / cap) : xj,
                 w0 = cap > 0 ? cap * tanh(s * x0 / cap) : x0;
          double lp = lp0 + (wj - w0) * (cap > 0 ? 1.0 : s) / c->tr.temperature, p = exp(lp);
          double D = 0;
          for (int64_t k = 0; k < K && c->dlogp; k++)
            if ((int64_t)tget(&idx, i, k) == j) D += fabs(tget(&dlogp, i, k));
          fl[j] = TOL_CANCEL * (D + p * gabs + (p > 0 ? dH * p * (fabs(lp) + H) : 0)) *
                  dzdx(&c->tr, xj);
          if (!isfinite(fl[j])) fl[j] = 0; /* -inf entries: p_j = 0, no terms */
          if (j != a) rest += fl[j];
        }
        for (int64_t j = 0; j < V; j++) {
          double extra = fl[j];
          if (j == a) extra = fmax(extra, rest);
          tg_close(g, tget(&gg, i, j), tget(&gr, i, j), c->odt, extra, "dlogits", i, j);
        }
      }
      free(fl);
    }
    host_free(&el), host_free(&ll), host_free(&gr), host_free(&gg);
  }
  if ((size_t)g->fails > before && before == 0)
    printf("  case: N=%lld V=%lld K=%lld x=%s idx=%s out=%s s=%g cap=%g T=%g mask=%d ent=%d "
           "dlogp=%d dent=%d inplace=%d nonfinite=%d ties=%d margin=%g saved=%d\n",
           (long long)N, (long long)V, (long long)K, dt_name(c->xdt), dt_name(c->idt),
           dt_name(c->odt), c->tr.logit_scale, c->tr.softcap, c->tr.temperature, c->mask, c->ent,
           c->dlogp, c->dent, c->inplace, c->nonfinite, c->ties, c->margin, c->saved);
  host_free(&stats), host_free(&x), host_free(&idx), host_free(&mask), host_free(&dlogp),
      host_free(&dent);
  host_free(&lr), host_free(&lg), host_free(&er), host_free(&eg);
  free(t0);
}

static const lmloss_dtype fdts[] = {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16};
static const double margins[] = {-1, 0, 5, 17, 20, 30, 50, 100, 1000};

static lp_case base(int64_t N, int64_t V, int64_t K) {
  lp_case c;
  memset(&c, 0, sizeof c);
  c.N = N, c.V = V, c.K = K, c.stride = V, c.xdt = c.odt = LMLOSS_F32, c.idt = LMLOSS_I64;
  c.tr = lmloss_transform_default();
  c.ent = 1, c.dlogp = 1, c.margin = -1, c.null_absent = 1;
  return c;
}

/* The backward from saved statistics against the recomputing one on the
 * backend under test: bit-equal on the CPU (the same fp32 statistics),
 * within the output's tolerance on CUDA (the forward's reduction order
 * differs); the saved argmax is the row's first max; a row whose saved
 * statistics are not finite or whose argmax is out of range (not these
 * logits' statistics) reads NaN, and a masked row 0. */
static void saved_vs_recomputed(tgroup *g, int64_t V, int64_t K, lmloss_dtype dt, float T) {
  const int64_t N = 6;
  lp_case c = base(N, V, K);
  c.xdt = c.odt = dt, c.tr.temperature = T, c.dent = 1, c.mask = 1;
  lmloss_tensor x = host_new(dt, N, V, V), idx = host_new(LMLOSS_I64, N, K, K);
  lmloss_tensor mask = host_new(LMLOSS_BOOL, N, 1, 1), dlogp = host_new(LMLOSS_F32, N, K, K);
  lmloss_tensor dent = host_new(LMLOSS_F32, N, 1, 1);
  lmloss_tensor st = host_new(LMLOSS_F32, N, LMLOSS_ROW_STATS, LMLOSS_ROW_STATS);
  lmloss_tensor lp = host_new(LMLOSS_F32, N, K, K), none = {0};
  int64_t t0[6];
  for (int64_t i = 0; i < N; i++) {
    t0[i] = rng_int(V);
    tset(&mask, i, 0, i != 4);
    tset(&dent, i, 0, rng_uniform() - 0.5);
    for (int64_t k = 0; k < K; k++)
      tset(&idx, i, k, k ? (double)rng_int(V) : t0[i]), tset(&dlogp, i, k, 0.25 + rng_uniform());
  }
  fill_logits(&x, 2.0, t0, 30.0);
  for (int64_t j = 0; j < V; j++) /* a row without a peak */
    tset(&x, 5, j, rng_normal());
  lmloss_status s = fwd(&c, 1, &x, &idx, &mask, &lp, &none, &st);
  tg_true(g, s == LMLOSS_OK, "forward with stats: %s", lmloss_last_error());
  for (int64_t i = 0; i < N; i++) {
    int64_t a = 0;
    for (int64_t j = 1; j < V; j++)
      if (tget(&x, i, j) > tget(&x, i, a)) a = j;
    tg_true(g, tget(&st, i, 3) == (i == 4 ? -1.0 : (double)a),
            "row %lld: saved argmax %g, not %lld", (long long)i, tget(&st, i, 3),
            (long long)(i == 4 ? -1 : a));
  }
  lmloss_tensor ga = host_new(dt, N, V, V), gb = host_new(dt, N, V, V);
  lmloss_status sa = bwd(&c, 1, &x, &idx, &mask, &dlogp, &dent, &none, &ga);
  lmloss_status sb = bwd(&c, 1, &x, &idx, &mask, &dlogp, &dent, &st, &gb);
  tg_true(g, sa == LMLOSS_OK && sb == LMLOSS_OK, "backward: %s", lmloss_last_error());
  if (!tb_is_cuda()) tg_true(g, same_bytes(&ga, &gb), "CPU: saved and recomputed differ");
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < V; j++)
      tg_close(g, tget(&gb, i, j), tget(&ga, i, j), dt, 0, "saved dlogits", i, j);
  /* CUDA forms at most 127 indices from saved statistics; past that it
   * recomputes them (lmloss.h), and does not read bad ones */
  if (!tb_is_cuda() || K <= 127) {
    tset(&st, 0, 0, NAN), tset(&st, 0, 3, -1.0); /* no finite statistics */
    tset(&st, 1, 3, (double)V);                  /* not these logits' */
    tset(&st, 4, 3, (double)V);                  /* masked: not read */
    sb = bwd(&c, 1, &x, &idx, &mask, &dlogp, &dent, &st, &gb);
    tg_true(g, sb == LMLOSS_OK, "backward, bad stats: %s", lmloss_last_error());
    for (int64_t j = 0; j < V; j++) {
      tg_true(g, isnan(tget(&gb, 0, j)) && isnan(tget(&gb, 1, j)), "bad stats, column %lld: %g %g",
              (long long)j, tget(&gb, 0, j), tget(&gb, 1, j));
      tg_true(g, tget(&gb, 4, j) == 0.0, "masked row, column %lld: %g", (long long)j,
              tget(&gb, 4, j));
    }
  }
  host_free(&x), host_free(&idx), host_free(&mask), host_free(&dlogp), host_free(&dent);
  host_free(&st), host_free(&lp), host_free(&ga), host_free(&gb);
}

int main(void) {
  tb_init();
  tgroup g;
  static const int64_t Vs[] = {1, 2, 3, 17, 1003, 40001, 151936};
  for (int v = 0; v < 7; v++) {
    char name[80];
    snprintf(name, sizeof name, "log-probs margins x dtypes x K, V=%lld", (long long)Vs[v]);
    tg_begin(&g, name);
    for (int m = 0; m < 9; m++)
      for (int d = 0; d < 3; d++) {
        int64_t K = (m + d) % 2 && Vs[v] >= 3 ? 3 : 1;
        lp_case c = base(Vs[v] >= 40001 ? 2 : 6, Vs[v], K);
        c.xdt = fdts[d], c.odt = fdts[(d + m) % 3], c.margin = margins[m];
        c.idt = m % 2 ? LMLOSS_I32 : LMLOSS_I64;
        c.stride = m % 3 == 1 ? Vs[v] + 3 : Vs[v];
        c.dent = m % 3 != 0, c.dlogp = m % 3 != 2;
        c.inplace = (m + d) % 4 == 3, c.odt = c.inplace ? c.xdt : c.odt;
        c.saved = (v + m + d) % 2;
        rng_seed(50 * v + 5 * m + d);
        run_case(&g, &c);
      }
    tg_end(&g);
  }
  static const char *tname[] = {"temperature", "logit_scale", "softcap", "all transforms"};
  for (int t = 0; t < 4; t++) {
    char name[80];
    snprintf(name, sizeof name, "log-probs %s x mask x entropy", tname[t]);
    tg_begin(&g, name);
    for (int k = 0; k < 16; k++) {
      lp_case c = base(7, k % 2 ? 17 : 1003, k % 4 < 2 ? 1 : 4);
      if (t == 0 || t == 3) c.tr.temperature = k % 2 ? 0.7f : 1.6f;
      if (t == 1 || t == 3) c.tr.logit_scale = 0.5f;
      if (t == 2 || t == 3) c.tr.softcap = 30.0f;
      c.mask = k % 2, c.ent = k % 4 != 3, c.dent = k % 3 != 0, c.dlogp = k % 3 != 1;
      c.margin = (double[]){-1, 20, 50, 5}[k % 4];
      c.xdt = fdts[k % 3], c.odt = fdts[(k / 3) % 3];
      c.inplace = k % 5 == 4, c.odt = c.inplace ? c.xdt : c.odt;
      c.saved = (k / 2) % 2;
      rng_seed(900 + 20 * t + k);
      run_case(&g, &c);
    }
    tg_end(&g);
  }
  tg_begin(&g, "entropy only (lmloss_entropy)");
  for (int k = 0; k < 12; k++) {
    lp_case c = base(5, (int64_t[]){1, 3, 17, 1003, 40001, 2}[k % 6], 0);
    c.entropy_only = 1, c.margin = margins[k % 9], c.xdt = fdts[k % 3];
    c.tr.temperature = k % 2 ? 0.8f : 1.0f;
    rng_seed(1200 + k);
    run_case(&g, &c);
  }
  tg_end(&g);
  tg_begin(&g, "log-probs ties, NaN/+inf/all -inf rows, -inf, softcap");
  for (int k = 0; k < 12; k++) {
    lp_case c = base(6, k % 2 ? 17 : 1003, k % 3 ? 1 : 2);
    c.ties = k < 4, c.nonfinite = k >= 4, c.xdt = c.odt = fdts[k % 3];
    c.dent = k % 2, c.dlogp = 1, c.mask = k % 4 == 1, c.margin = k % 3 ? 30 : -1;
    c.saved = (k / 2) % 2;
    c.tr.softcap = k % 4 == 2 ? 20.0f : 0.0f;
    rng_seed(1300 + k);
    run_case(&g, &c);
  }
  tg_end(&g);
  /* One index, no entropy gradient, recomputed: on CUDA the held plan
   * (src/cuda/held.cuh), with rows of one to sixteen CTAs. */
  tg_begin(&g, "log-probs backward of one index, recomputed: margins, ties, non-finite rows");
  for (int k = 0; k < 24; k++) {
    const int64_t V = (int64_t[]){1003, 4096, 151936, 262144}[k % 4];
    lp_case c = base(V > 4096 ? 4 : 6, V, 1);
    c.ent = 0, c.dent = 0, c.dlogp = 1, c.saved = 0;
    c.ties = k % 3 == 1, c.nonfinite = k % 3 == 2, c.mask = k % 2;
    c.margin = margins[k % 9], c.xdt = fdts[k % 3], c.odt = fdts[(k / 3) % 3];
    c.idt = k % 2 ? LMLOSS_I32 : LMLOSS_I64;
    c.stride = k % 3 ? (V + 7) / 8 * 8 : V; /* 16-byte aligned rows, as the held plan takes */
    c.inplace = k % 5 == 4, c.odt = c.inplace ? c.xdt : c.odt;
    c.tr.temperature = k % 4 == 1 ? 0.7f : 1.0f;
    rng_seed(1600 + k);
    run_case(&g, &c);
  }
  tg_end(&g);
  tg_begin(&g, "log-probs backward from saved statistics");
  for (int k = 0; k < 9; k++) {
    rng_seed(1500 + k);
    /* K = 300: more indices than the CUDA saved kernel forms (it recomputes) */
    saved_vs_recomputed(&g, (int64_t[]){3, 1003, 40001}[k % 3], k == 7 ? 300 : 1 + k % 2,
                        fdts[k % 3], k % 2 ? 0.7f : 1.0f);
  }
  tg_end(&g);
  /* Last: absent optional tensors as {data = NULL} (lmloss.h: "absent when
   * its data pointer is NULL"), which a backend must not dereference. */
  tg_begin(&g, "log-probs absent optionals as {data = NULL}");
  for (int k = 0; k < 6; k++) {
    lp_case c = base(4, 17, 2);
    c.null_absent = 0, c.ent = k % 2, c.dent = k % 3 == 0, c.dlogp = k % 3 != 0;
    c.mask = k == 5, c.saved = k % 2;
    rng_seed(1400 + k);
    run_case(&g, &c);
  }
  tg_end(&g);
  return test_finish();
}
