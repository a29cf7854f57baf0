/*
 * test_divergence.c - KL, reverse KL, generalized JSD and TVD (with the
 * hard CE term) of the backend under test against REF: every kind and
 * beta, dtypes, odd V, peaked rows to margin 1000, small student-teacher
 * gaps, identical rows (exactly 0), ties, -inf columns, non-finite and
 * ignored rows, per-side transforms, reductions, the backward from dloss,
 * thread counts, and bad arguments.
 *
 * Floors (testing.h's cancel): every value comes from delta_j =
 * log q_j - log p_j, formed from g_j = zt_j - zs_j, G (the maxes' gap)
 * and ell = lse_t - lse_s - G, so delta carries TOL_REL (min(|g_j| + |G|,
 * |dt_j| + |ds_j|) + |ell|) from its terms; a gradient entry gets that times its
 * derivative in delta, a row's divergence the sum over columns.
 */
#include <float.h>

#include "support/testing.h"

typedef struct {
  lmloss_divergence_kind kind;
  float beta;
} kind_case;

static const kind_case kinds[] = {{LMLOSS_DIV_KL, 0.5f},  {LMLOSS_DIV_REVERSE_KL, 0.5f},
                                  {LMLOSS_DIV_JSD, 0.0f}, {LMLOSS_DIV_JSD, 0.1f},
                                  {LMLOSS_DIV_JSD, 0.5f}, {LMLOSS_DIV_JSD, 0.9f},
                                  {LMLOSS_DIV_JSD, 1.0f}, {LMLOSS_DIV_TVD, 0.5f}};
#define NKINDS (int)(sizeof kinds / sizeof *kinds)

enum { ROWS_RANDOM, ROWS_GAP, ROWS_PEAKED, ROWS_SAME, ROWS_SPIKE, ROWS_SPECIAL };

/* z of a logit under a transform, in double (refrow.h's form). */
static double zof(const lmloss_transform *t, double x) {
  if (t->softcap > 0.0f) return t->softcap * tanh(t->logit_scale * x / t->softcap) / t->temperature;
  return x * t->logit_scale / t->temperature;
}

static double dzdx(const lmloss_transform *t, double x) {
  if (t->softcap > 0.0f) {
    double c = cosh(t->logit_scale * x / t->softcap);
    return t->logit_scale / (t->temperature * c * c);
  }
  return t->logit_scale / t->temperature;
}

/* Per row, the floors of its divergence and of each gradient entry (per
 * unit of the row's gradient scale), from the inputs in double. The
 * reverse KL's and the JSD's entries are differences from the student's
 * argmax a (lmloss's form): h_j = delta_j - delta_a carries TOL times the
 * operands of dg_j and dg_a (dg = g - G, or dt - ds where the rows sit far
 * apart), and is 0 at a, so a's floor is only its row sum's. */
static void floors(const lmloss_tensor *s, const lmloss_tensor *t, const lmloss_div_options *o,
                   int64_t i, double *row_floor, double *gf) {
  const int64_t V = s->cols;
  double *zs = malloc(sizeof(double) * (size_t)V), *zt = malloc(sizeof(double) * (size_t)V);
  double ms = -INFINITY, mt = -INFINITY, ss = 0, st = 0;
  int64_t a = 0;
  for (int64_t j = 0; j < V; j++) {
    zs[j] = zof(&o->student, tget(s, i, j)), zt[j] = zof(&o->teacher, tget(t, i, j));
    if (zs[j] > ms) ms = zs[j], a = j;
    mt = fmax(mt, zt[j]);
  }
  for (int64_t j = 0; j < V; j++)
    ss += exp(zs[j] - ms), st += exp(zt[j] - mt);
  const double ls = ms + log(ss), lt = mt + log(st), G = mt - ms, ell = lt - ls - G;
  const double b = o->beta;
  const int rev = o->kind == LMLOSS_DIV_REVERSE_KL || (o->kind == LMLOSS_DIV_JSD && b == 1);
  const int fwd = o->kind == LMLOSS_DIV_KL || (o->kind == LMLOSS_DIV_JSD && b == 0);
#define P(j) exp(zs[j] - ls)
#define Q(j) exp(zt[j] - lt)
#define D(j) ((zt[j] - lt) - (zs[j] - ls))
/* g_j - G's operands, in lmloss's better-conditioned form of the two */
#define DG(j)                                                                                      \
  (isfinite(zt[j] - zs[j])                                                                         \
       ? fmin(fabs(zt[j] - zs[j]) + fabs(G), fabs(zt[j] - mt) + fabs(zs[j] - ms))                  \
       : 0.0)
/* log(M_j / p_j) - the same at a, as log(u_a + w_a e^h), h = D(j) - D(a):
 * lmloss's form, which double needs too (both logs are log(1 - beta) to
 * 1e-20 where the teacher ignores the student's mass) */
#define DMU(j)                                                                                     \
  (fabs(D(j) - D(a)) < 1                                                                           \
       ? log1p(exp(lw_a) * expm1(D(j) - D(a)))                                                     \
       : fmax(lu_a, lw_a + D(j) - D(a)) + log1p(exp(-fabs(lu_a - lw_a - (D(j) - D(a))))))
  /* the errors of the row sums the entries subtract */
  double e_rev = 0, e_mix = 0, amb = 0, sum_h = 0, sum_mu = 0;
  const double lr = log(b) - log1p(-b) + D(a), dga = DG(a);
  const double lu_a = -(lr > 0 ? lr + log1p(exp(-lr)) : log1p(exp(lr)));
  const double lw_a = -(lr < 0 ? -lr + log1p(exp(lr)) : log1p(exp(-lr)));
  for (int64_t j = 0; j < V; j++) {
    double p = P(j), e_d = TOL_CANCEL * (DG(j) + fabs(ell));
    if (isfinite(D(j)) && fabs(D(j)) <= e_d) amb += p;
    if (j == a || p == 0) continue;
    double h = D(j) - D(a), e_h = TOL_CANCEL * (DG(j) + dga);
    e_rev += p * (e_h + TOL_CANCEL * fabs(h)), sum_h += p * h;
    double dmu = DMU(j); /* its error: TOL |dmu| and h's times d dmu / dh */
    e_mix += p * (TOL_CANCEL * fabs(dmu) + e_h * exp(lw_a + h - dmu)), sum_mu += p * dmu;
  }
  *row_floor = 0;
  for (int64_t j = 0; j < V; j++) {
    double p = P(j), q = Q(j), e_d = TOL_CANCEL * (DG(j) + fabs(ell));
    double e_h = j == a ? 0 : TOL_CANCEL * (DG(j) + dga), f;
    /* where p or q is 0 the summand and p - q are exact whatever delta is */
    const double both = p > 0 && q > 0 ? p + q : 0;
    *row_floor += e_d * both;
    if (fwd)
      f = e_d * both;
    else if (p == 0)
      f = 0; /* the entry is 0 by construction */
    else if (rev)
      f = p * (e_h + e_rev + TOL_CANCEL * fabs((D(j) - D(a)) - sum_h));
    else if (o->kind == LMLOSS_DIV_JSD) {
      double dmu = j == a ? 0 : DMU(j);
      double e_mu = j == a ? 0 : TOL_CANCEL * fabs(dmu) + e_h * exp(lw_a + D(j) - D(a) - dmu);
      f = (1 - b) * p * (e_mu + e_mix + TOL_CANCEL * fabs(dmu - sum_mu));
    } else /* TVD: a sign within delta's error may flip, moving p_j's mass */
      f = p * ((isfinite(D(j)) && fabs(D(j)) <= e_d) ? 1.0 : 0.0) + p * amb + TOL_CANCEL * p;
    gf[j] = o->soft_weight * f;
  }
#undef P
#undef Q
#undef D
#undef DG
#undef DMU
  free(zs), free(zt);
}

static void fill_rows(const lmloss_tensor *s, const lmloss_tensor *t, int rows, double margin) {
  const int64_t N = s->rows, V = s->cols;
  for (int64_t i = 0; i < N; i++) {
    int64_t a = rng_int(V);
    for (int64_t j = 0; j < V; j++) {
      double x = rows == ROWS_SPIKE ? 6.0 * rng_uniform() - 3.0 : 2.0 * rng_normal();
      tset(s, i, j, x);
      if (rows == ROWS_GAP)
        tset(t, i, j, tget(s, i, j) + 1e-2 * rng_normal());
      else if (rows == ROWS_SAME || rows == ROWS_SPIKE)
        tset(t, i, j, tget(s, i, j));
      else
        tset(t, i, j, 2.0 * rng_normal());
    }
    if (rows == ROWS_PEAKED) { /* both rows confident at a, the teacher by another margin */
      tset(s, i, a, 4.0 + margin);
      tset(t, i, (i % 3 == 2) ? (a + 1) % V : a, 4.0 + margin + (i % 2 ? 1.0 : -0.5));
      /* the student's mass on two columns the teacher all but ignores */
      if (i % 3 == 2 && V > 3) tset(s, i, (a + 2) % V, 3.9 + margin);
    }
    /* a flat student, the teacher it with a spike: (1 + Rt) / (1 + Rs)
     * down to 1e-4, where log1p(D / (1 + Rs)) would cancel D's rounding */
    if (rows == ROWS_SPIKE) tset(t, i, a, tget(s, i, a) + 20.0);
    if (rows == ROWS_SPECIAL) {
      if (i == 0) tset(s, i, a, NAN);
      if (i == 1) tset(t, i, a, INFINITY);
      for (int64_t j = 0; j < V; j++) {
        if (i == 2) tset(t, i, j, -INFINITY);
        if ((i == 3 || i == 4) && j != a && rng_uniform() < 0.2)
          tset(i == 3 ? s : t, i, j, -INFINITY);
        if (i == 5 && j % 3 == 0) tset(s, i, j, tget(s, i, a)); /* ties at the max */
      }
      if (i == 6) tset(t, i, (a + 2) % V, 1e30); /* g - G from 1e30s: nothing left */
      /* whole blocks of the CPU's sweeps (2048 columns) of -inf in one row */
      for (int64_t j = 0; V > 3 * 2048 && j < 2048 + 17; j++) {
        if (i == 3 && j != a) tset(s, i, j, -INFINITY);
        if (i == 4 && V - 1 - j != a) tset(t, i, V - 1 - j, -INFINITY);
      }
    }
  }
}

/* One call of every output against REF; then the backward from dloss. */
static void run_case(tgroup *g, int64_t N, int64_t V, lmloss_dtype sdt, lmloss_dtype tdt,
                     lmloss_dtype gdt, int rows, double margin, const lmloss_div_options *o,
                     int labels) {
  lmloss_tensor s = host_new(sdt, N, V, V + 1), t = host_new(tdt, N, V, V + 2);
  fill_rows(&s, &t, rows, margin);
  lmloss_tensor y = host_new(LMLOSS_I64, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&y, i, 0, (labels && i % 4 == 1) ? (double)o->ignore_index : (double)rng_int(V));
  const int reduced = o->reduction != LMLOSS_REDUCE_NONE;
  lmloss_tensor lr = host_new(LMLOSS_F32, reduced ? 1 : N, 1, 1),
                dr = host_new(LMLOSS_F32, N, 1, 1);
  lmloss_tensor cr = host_new(LMLOSS_F32, N, 1, 1), gr = host_new(gdt, N, V, V);
  lmloss_tensor er = host_new(LMLOSS_F32, N, 1, 1);
  lmloss_tensor lg = host_clone(&lr), dg = host_clone(&dr), cg = host_clone(&cr),
                gg = host_clone(&gr), eg = host_clone(&er);
  lmloss_div_inputs hin = {s, t, labels ? y : (lmloss_tensor){0}};
  lmloss_div_outputs hout = {lr, dr, labels ? cr : (lmloss_tensor){0}, gr, er};
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *hws = malloc(wsb);
  lmloss_context rc = ref_ctx(), tc = tb_ctx();
  lmloss_status sr = lmloss_divergence(&rc, &hin, o, &hout, hws, wsb);
  lmloss_div_inputs din = {dev_clone(&s), dev_clone(&t),
                           labels ? dev_clone(&y) : (lmloss_tensor){0}};
  lmloss_div_outputs dout = {dev_clone(&lg), dev_clone(&dg),
                             labels ? dev_clone(&cg) : (lmloss_tensor){0}, dev_clone(&gg),
                             dev_clone(&eg)};
  void *dws = dev_alloc_bytes(wsb);
  lmloss_status sg = lmloss_divergence(&tc, &din, o, &dout, dws, wsb);
  dev_fetch(&lg, &dout.loss), dev_fetch(&dg, &dout.divergence), dev_fetch(&gg, &dout.dstudent);
  dev_fetch(&eg, &dout.entropy);
  if (labels) dev_fetch(&cg, &dout.ce);
  long before = g->fails;
  double *gf = malloc(sizeof(double) * (size_t)V);
  if (tg_true(g, sr == LMLOSS_OK && sg == LMLOSS_OK, "status %s %s (%s)", lmloss_status_string(sr),
              lmloss_status_string(sg), lmloss_last_error())) {
    double lfloor = 0;
    int64_t valid = 0;
    for (int64_t i = 0; i < N; i++)
      valid += !(labels && tget(&y, i, 0) == (double)o->ignore_index);
    double factor = o->reduction == LMLOSS_REDUCE_MEAN             ? (valid ? 1.0 / valid : 0)
                    : o->reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS ? 1.0 / o->num_items
                                                                   : 1.0;
    for (int64_t i = 0; i < N; i++) {
      double rf = 0;
      const int ignored = labels && tget(&y, i, 0) == (double)o->ignore_index;
      if (!ignored) floors(&s, &t, o, i, &rf, gf);
      double dv = tget(&dg, i, 0);
      tg_close(g, dv, tget(&dr, i, 0), LMLOSS_F32, rf, "divergence", i, 0);
      tg_true(g, !(dv < 0), "divergence %g < 0 at row %lld", dv, (long long)i);
      if (rows == ROWS_SAME && !ignored) tg_true(g, dv == 0, "identical rows: divergence %g", dv);
      if (labels) tg_close(g, tget(&cg, i, 0), tget(&cr, i, 0), LMLOSS_F32, 0, "ce", i, 0);
      tg_close(g, tget(&eg, i, 0), tget(&er, i, 0), LMLOSS_F32, 0, "entropy", i, 0);
      if (!reduced)
        tg_close(g, tget(&lg, i, 0), tget(&lr, i, 0), LMLOSS_F32, o->soft_weight * rf, "loss", i,
                 0);
      lfloor += o->soft_weight * rf;
      const double scale = fabs(o->grad_output * factor);
      for (int64_t j = 0; j < V; j++) {
        double fl = ignored ? 0 : scale * gf[j] * dzdx(&o->student, tget(&s, i, j));
        tg_close(g, tget(&gg, i, j), tget(&gr, i, j), gdt, fl, "dstudent", i, j);
        if (rows == ROWS_SAME && o->hard_weight == 0)
          tg_true(g, tget(&gg, i, j) == 0, "identical rows: dstudent %g", tget(&gg, i, j));
      }
    }
    if (reduced)
      tg_close(g, tget(&lg, 0, 0), tget(&lr, 0, 0), LMLOSS_F32, lfloor * factor, "loss", 0, 0);
    /* the backward from dloss = grad_output: the fused gradient's bits */
    lmloss_tensor up = host_new(LMLOSS_F32, reduced ? 1 : N, 1, 1);
    for (int64_t i = 0; i < up.rows; i++)
      tset(&up, i, 0, o->grad_output);
    lmloss_tensor gb = host_clone(&gg), dup = dev_clone(&up), dgb = dev_clone(&gb);
    host_poison(&gb);
    sg = lmloss_divergence_backward(&tc, &din, o, &dup, &dgb, dws, wsb);
    dev_fetch(&gb, &dgb);
    if (tg_true(g, sg == LMLOSS_OK, "backward status %s (%s)", lmloss_status_string(sg),
                lmloss_last_error()))
      tg_true(g, same_bytes(&gb, &gg), "backward from dloss differs from the fused gradient");
    dev_free(&dup), dev_free(&dgb), host_free(&up), host_free(&gb);
  }
  if (g->fails > before && before == 0)
    printf("  case: N=%lld V=%lld s=%s t=%s g=%s rows=%d margin=%g kind=%d beta=%g labels=%d\n",
           (long long)N, (long long)V, dt_name(sdt), dt_name(tdt), dt_name(gdt), rows, margin,
           (int)o->kind, (double)o->beta, labels);
  dev_free(&din.student), dev_free(&din.teacher), dev_free(&din.label);
  dev_free(&dout.loss), dev_free(&dout.divergence), dev_free(&dout.ce), dev_free(&dout.dstudent);
  dev_free(&dout.entropy), host_free(&er), host_free(&eg);
  dev_free_bytes(dws), free(hws), free(gf);
  host_free(&s), host_free(&t), host_free(&y), host_free(&lr), host_free(&dr), host_free(&cr);
  host_free(&gr), host_free(&lg), host_free(&dg), host_free(&cg), host_free(&gg);
}

/* Bad arguments: the status, and every output left as it was. */
static void bad_input(tgroup *g) {
  const int64_t N = 3, V = 7;
  lmloss_tensor s = host_new(LMLOSS_F32, N, V, V), t = host_new(LMLOSS_F32, N, V, V);
  lmloss_tensor t2 = host_new(LMLOSS_F32, N, V + 1, V + 1), y = host_new(LMLOSS_I64, N, 1, 1);
  fill_rows(&s, &t, ROWS_RANDOM, 0);
  for (int64_t i = 0; i < N; i++)
    tset(&y, i, 0, i == 2 ? V : 1);
  lmloss_tensor loss = host_new(LMLOSS_F32, 1, 1, 1), d = host_new(LMLOSS_F32, N, V, V);
  host_poison(&loss), host_poison(&d);
  lmloss_tensor l0 = host_clone(&loss), d0 = host_clone(&d);
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = malloc(wsb);
  lmloss_context ctx = tb_ctx();
  lmloss_div_outputs out = {loss, {0}, {0}, d};
  lmloss_div_options o = lmloss_div_options_default(), bad;
  lmloss_div_inputs in = {s, t, {0}}, in_shape = {s, t2, {0}}, in_label = {s, t, y};
  struct {
    const char *what;
    const lmloss_div_inputs *in;
    float beta, hard;
    int kind;
    void *ws;
    lmloss_status want;
  } cases[] = {
      {"beta 1.5", &in, 1.5f, 0, LMLOSS_DIV_JSD, ws, LMLOSS_ERR_BAD_OPTION},
      {"beta NaN", &in, NAN, 0, LMLOSS_DIV_JSD, ws, LMLOSS_ERR_BAD_OPTION},
      {"kind 9", &in, 0.5f, 0, 9, ws, LMLOSS_ERR_BAD_OPTION},
      {"hard_weight without a label", &in, 0.5f, 1, LMLOSS_DIV_KL, ws, LMLOSS_ERR_BAD_OPTION},
      {"hard_weight -1", &in_label, 0.5f, -1, LMLOSS_DIV_KL, ws, LMLOSS_ERR_BAD_OPTION},
      {"teacher [N, V + 1]", &in_shape, 0.5f, 0, LMLOSS_DIV_KL, ws, LMLOSS_ERR_BAD_SHAPE},
      /* host labels to the CUDA backend: its labels live on the device,
       * where a row outside [0, V) gives NaN (test_torch_cuda.py) */
      {"label V", &in_label, 0.5f, 0, LMLOSS_DIV_KL, ws,
       tb_is_cuda() ? LMLOSS_ERR_BAD_DEVICE : LMLOSS_ERR_INDEX_OUT_OF_RANGE},
      {"no workspace", &in, 0.5f, 0, LMLOSS_DIV_KL, NULL, LMLOSS_ERR_NULL_POINTER},
  };
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    bad = o;
    bad.beta = cases[k].beta, bad.hard_weight = cases[k].hard, bad.kind = cases[k].kind;
    bad.reduction = LMLOSS_REDUCE_SUM;
    lmloss_status st = lmloss_divergence(&ctx, cases[k].in, &bad, &out, cases[k].ws, wsb);
    tg_true(g, st == cases[k].want, "%s: %s, want %s", cases[k].what, lmloss_status_string(st),
            lmloss_status_string(cases[k].want));
    tg_true(g, same_bytes(&loss, &l0) && same_bytes(&d, &d0), "%s: an output was written",
            cases[k].what);
  }
  host_free(&s), host_free(&t), host_free(&t2), host_free(&y), host_free(&loss), host_free(&d);
  host_free(&l0), host_free(&d0), free(ws);
}

/* Results never depend on the thread count. */
static void threads(tgroup *g) {
  const int64_t N = 9, V = 40001;
  lmloss_tensor s = host_new(LMLOSS_BF16, N, V, V), t = host_new(LMLOSS_F32, N, V, V);
  fill_rows(&s, &t, ROWS_RANDOM, 0);
  lmloss_tensor l1 = host_new(LMLOSS_F32, 1, 1, 1), g1 = host_new(LMLOSS_F32, N, V, V);
  lmloss_tensor l2 = host_clone(&l1), g2 = host_clone(&g1);
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = malloc(wsb);
  lmloss_div_options o = lmloss_div_options_default();
  o.kind = LMLOSS_DIV_JSD;
  lmloss_div_inputs in = {s, t, {0}};
  lmloss_div_outputs o1 = {l1, {0}, {0}, g1}, o2 = {l2, {0}, {0}, g2};
  lmloss_context c1 = {LMLOSS_BACKEND_CPU, NULL, 1}, c2 = {LMLOSS_BACKEND_CPU, NULL, 2};
  lmloss_status a = lmloss_divergence(&c1, &in, &o, &o1, ws, wsb);
  lmloss_status b = lmloss_divergence(&c2, &in, &o, &o2, ws, wsb);
  tg_true(g, a == LMLOSS_OK && b == LMLOSS_OK, "status %d %d", a, b);
  tg_true(g, same_bytes(&l1, &l2) && same_bytes(&g1, &g2), "1 and 2 threads differ");
  host_free(&s), host_free(&t), host_free(&l1), host_free(&g1), host_free(&l2), host_free(&g2);
  free(ws);
}

/* A [rows, cols] F32 tensor of N(0, sigma). */
static lmloss_tensor normal(int64_t rows, int64_t cols, double sigma) {
  lmloss_tensor t = host_new(LMLOSS_F32, rows, cols, cols);
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++)
      tset(&t, i, j, sigma * rng_normal());
  return t;
}

/* z = h w^T + b of a head, in double, rounded once to F32. */
static lmloss_tensor head_logits(const lmloss_head *h) {
  const int64_t N = h->hidden.rows, V = h->weight.rows, H = h->hidden.cols;
  lmloss_tensor z = host_new(LMLOSS_F32, N, V, V);
  for (int64_t i = 0; i < N; i++)
    for (int64_t v = 0; v < V; v++) {
      double acc = h->bias.data ? tget(&h->bias, v, 0) : 0.0;
      for (int64_t k = 0; k < H; k++)
        acc += tget(&h->hidden, i, k) * tget(&h->weight, v, k);
      tset(&z, i, v, acc);
    }
  return z;
}

/* |a - b|_F <= tol |b|_F + floor: the fused head's contract (design.md). */
static void close_frobenius(tgroup *g, const lmloss_tensor *a, const double *b, const char *what) {
  double d = 0, n = 0;
  for (int64_t i = 0; i < a->rows; i++)
    for (int64_t j = 0; j < a->cols; j++) {
      const double r = b[i * a->cols + j], e = tget(a, i, j) - r;
      d += e * e, n += r * r;
    }
  tg_true(g, sqrt(d) <= 1e-4 * sqrt(n) + 1e-30, "%s: |diff| %g of |ref| %g", what, sqrt(d),
          sqrt(n));
}

/* The two fused heads against lmloss_divergence on the logits they make:
 * outputs to 1e-4 (the GEMMs' summation order), gradients in Frobenius
 * norm to 1e-4 of the dense gradient pushed through the head; the
 * backward from dloss gives the forward's gradient bits. */
/* The fused call on the backend under test, its tensors copied to its
 * memory and the results back: the forward (up NULL) into lf, df and gr,
 * or the backward from up into gr. */
static lmloss_status fused_on_backend(const lmloss_head *s, const lmloss_head *t,
                                      const lmloss_tensor *lab, const lmloss_div_options *o,
                                      const lmloss_head_options *hopt, const lmloss_tensor *up,
                                      lmloss_tensor *lf, lmloss_tensor *df, lmloss_head_grads *gr) {
  lmloss_context tc = tb_ctx();
  lmloss_head ds = {dev_clone(&s->hidden), dev_clone(&s->weight), dev_clone(&s->bias)};
  lmloss_head dt = {dev_clone(&t->hidden), dev_clone(&t->weight), dev_clone(&t->bias)};
  lmloss_tensor dlab = lab ? dev_clone(lab) : (lmloss_tensor){0};
  lmloss_head_grads dg = {dev_clone(&gr->dhidden), dev_clone(&gr->dweight), dev_clone(&gr->dbias)};
  size_t fb = 0;
  lmloss_status st = lmloss_linear_divergence_workspace_size(&ds, &dt, hopt, &fb);
  void *fws = dev_alloc_bytes(fb ? fb : 1);
  if (st == LMLOSS_OK && up) {
    lmloss_tensor dup = dev_clone(up);
    st = lmloss_linear_divergence_backward(&tc, &ds, &dt, lab ? &dlab : NULL, o, hopt, &dup, &dg,
                                           fws, fb);
    dev_free(&dup);
  } else if (st == LMLOSS_OK) {
    lmloss_div_outputs fo = {dev_clone(lf), dev_clone(df), {0}, {0}};
    st = lmloss_linear_divergence(&tc, &ds, &dt, lab ? &dlab : NULL, o, hopt, &fo, &dg, fws, fb);
    dev_fetch(lf, &fo.loss), dev_fetch(df, &fo.divergence);
    dev_free(&fo.loss), dev_free(&fo.divergence);
  }
  dev_fetch(&gr->dhidden, &dg.dhidden), dev_fetch(&gr->dweight, &dg.dweight);
  dev_fetch(&gr->dbias, &dg.dbias);
  dev_free(&dg.dhidden), dev_free(&dg.dweight), dev_free(&dg.dbias), dev_free_bytes(fws);
  dev_free(&ds.hidden), dev_free(&ds.weight), dev_free(&ds.bias), dev_free(&dt.hidden);
  dev_free(&dt.weight), dev_free(&dt.bias), dev_free(&dlab);
  return st;
}

static void fused_case(tgroup *g, const lmloss_div_options *o, int labels, size_t budget) {
  const int64_t N = 9, V = 1003, Hs = 24, Ht = 40;
  lmloss_head s = {normal(N, Hs, 1.0), normal(V, Hs, 0.4), normal(V, 1, 0.5)};
  lmloss_head t = {normal(N, Ht, 1.0), normal(V, Ht, 0.3), normal(V, 1, 0.5)};
  lmloss_tensor y = host_new(LMLOSS_I64, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&y, i, 0, i % 3 == 1 ? (double)o->ignore_index : (double)rng_int(V));
  const lmloss_tensor *lab = labels ? &y : NULL;
  const int reduced = o->reduction != LMLOSS_REDUCE_NONE;
  /* dense reference */
  lmloss_tensor zs = head_logits(&s), zt = head_logits(&t), dz = host_new(LMLOSS_F32, N, V, V);
  lmloss_tensor lr = host_new(LMLOSS_F32, reduced ? 1 : N, 1, 1),
                dr = host_new(LMLOSS_F32, N, 1, 1);
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = malloc(wsb);
  lmloss_context cpu = {LMLOSS_BACKEND_CPU, NULL, 0};
  lmloss_div_inputs din = {zs, zt, labels ? y : (lmloss_tensor){0}};
  lmloss_div_outputs dout = {lr, dr, {0}, dz};
  lmloss_status sd = lmloss_divergence(&cpu, &din, o, &dout, ws, wsb);
  /* fused */
  lmloss_head_options hopt = lmloss_head_options_default();
  hopt.memory_budget = budget;
  lmloss_tensor lf = host_clone(&lr), df = host_clone(&dr);
  lmloss_head_grads gr = {host_new(LMLOSS_F32, N, Hs, Hs), host_new(LMLOSS_F32, V, Hs, Hs),
                          host_new(LMLOSS_F32, V, 1, 1)};
  host_poison(&gr.dhidden), host_poison(&gr.dweight), host_poison(&gr.dbias);
  lmloss_status sf = fused_on_backend(&s, &t, lab, o, &hopt, NULL, &lf, &df, &gr);
  if (tg_true(g, sd == LMLOSS_OK && sf == LMLOSS_OK, "status %s %s (%s)", lmloss_status_string(sd),
              lmloss_status_string(sf), lmloss_last_error())) {
    for (int64_t i = 0; i < lr.rows; i++)
      tg_close(g, tget(&lf, i, 0), tget(&lr, i, 0), LMLOSS_F32, 1e-4 * fabs(tget(&lr, i, 0)),
               "loss", i, 0);
    for (int64_t i = 0; i < N; i++)
      tg_close(g, tget(&df, i, 0), tget(&dr, i, 0), LMLOSS_F32, 1e-4 * fabs(tget(&dr, i, 0)),
               "divergence", i, 0);
    double *dh = calloc((size_t)(N * Hs), sizeof(double)),
           *dw = calloc((size_t)(V * Hs), sizeof(double));
    double *db = calloc((size_t)V, sizeof(double));
    for (int64_t i = 0; i < N; i++)
      for (int64_t v = 0; v < V; v++) {
        const double d = tget(&dz, i, v);
        db[v] += d;
        for (int64_t k = 0; k < Hs; k++) {
          dh[i * Hs + k] += d * tget(&s.weight, v, k);
          dw[v * Hs + k] += d * tget(&s.hidden, i, k);
        }
      }
    close_frobenius(g, &gr.dhidden, dh, "dhidden");
    close_frobenius(g, &gr.dweight, dw, "dweight");
    close_frobenius(g, &gr.dbias, db, "dbias");
    free(dh), free(dw), free(db);
    /* the backward from dloss = grad_output */
    lmloss_tensor up = host_new(LMLOSS_F32, reduced ? 1 : N, 1, 1);
    for (int64_t i = 0; i < up.rows; i++)
      tset(&up, i, 0, o->grad_output);
    lmloss_head_grads gb = {host_clone(&gr.dhidden), host_clone(&gr.dweight),
                            host_clone(&gr.dbias)};
    host_poison(&gb.dhidden), host_poison(&gb.dweight), host_poison(&gb.dbias);
    lmloss_status sb = fused_on_backend(&s, &t, lab, o, &hopt, &up, NULL, NULL, &gb);
    tg_true(g, sb == LMLOSS_OK, "backward %s (%s)", lmloss_status_string(sb), lmloss_last_error());
    tg_true(g,
            same_bytes(&gb.dhidden, &gr.dhidden) && same_bytes(&gb.dweight, &gr.dweight) &&
                same_bytes(&gb.dbias, &gr.dbias),
            "the backward's gradients differ from the forward's");
    host_free(&up), host_free(&gb.dhidden), host_free(&gb.dweight), host_free(&gb.dbias);
  }
  free(ws);
  host_free(&s.hidden), host_free(&s.weight), host_free(&s.bias), host_free(&t.hidden);
  host_free(&t.weight), host_free(&t.bias), host_free(&y), host_free(&zs), host_free(&zt);
  host_free(&dz), host_free(&lr), host_free(&dr), host_free(&lf), host_free(&df);
  host_free(&gr.dhidden), host_free(&gr.dweight), host_free(&gr.dbias);
}

/* The two heads' default budget at the seed's shape (N 2048, Hs 2048, Ht
 * 2560, V 151936): more than 256 MiB, which held chunks of 128 rows
 * there, and no more than the 400 MiB the heads may take beside their
 * inputs and gradients; an explicit budget bounds the workspace. A size
 * query reads no data. */
static void default_budget(tgroup *g) {
  static float none;
  const int64_t N = 2048, V = 151936, Hs = 2048, Ht = 2560;
  const lmloss_head s = {
      {&none, LMLOSS_F32, LMLOSS_CPU, N, Hs, Hs}, {&none, LMLOSS_F32, LMLOSS_CPU, V, Hs, Hs}, {0}};
  const lmloss_head t = {
      {&none, LMLOSS_F32, LMLOSS_CPU, N, Ht, Ht}, {&none, LMLOSS_F32, LMLOSS_CPU, V, Ht, Ht}, {0}};
  lmloss_head_options hopt = lmloss_head_options_default();
  size_t fb = 0;
  lmloss_status st = lmloss_linear_divergence_workspace_size(&s, &t, &hopt, &fb);
  tg_true(g, st == LMLOSS_OK && fb > ((size_t)256 << 20) && fb <= ((size_t)400 << 20),
          "default: %s, %zu bytes", lmloss_status_string(st), fb);
  hopt.memory_budget = (size_t)256 << 20;
  st = lmloss_linear_divergence_workspace_size(&s, &t, &hopt, &fb);
  tg_true(g, st == LMLOSS_OK && fb <= hopt.memory_budget, "256 MiB: %s, %zu bytes",
          lmloss_status_string(st), fb);
}

/* A temperature near FLT_MIN takes k x w past FLT_MAX, so the gaps of far
 * rows overflow: each row's divergence reads what REF's reads (inf for
 * the KLs, a finite one for the bounded kinds), never NaN. fuzz_divergence
 * found the CPU's NaN. */
static void overflowing_temperature(tgroup *g) {
  const int64_t N = 4, V = 22;
  for (int k = 0; k < NKINDS; k++) {
    lmloss_div_options o = lmloss_div_options_default();
    o.kind = kinds[k].kind, o.beta = kinds[k].beta;
    o.reduction = LMLOSS_REDUCE_NONE;
    o.student.temperature = o.teacher.temperature = FLT_MIN;
    o.student.softcap = o.teacher.softcap = 44.5f;
    rng_seed(9950 + k);
    lmloss_tensor s = host_new(LMLOSS_F32, N, V, V), t = host_new(LMLOSS_BF16, N, V, V);
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < V; j++)
        tset(&s, i, j, 32 * rng_uniform() - 16), tset(&t, i, j, 32 * rng_uniform() - 16);
    lmloss_tensor d[2] = {host_new(LMLOSS_F32, N, 1, 1), host_new(LMLOSS_F32, N, 1, 1)};
    lmloss_tensor loss = host_new(LMLOSS_F32, N, 1, 1);
    size_t wsb = lmloss_cross_entropy_workspace_size(N);
    void *hws = malloc(wsb), *dws = dev_alloc_bytes(wsb);
    const lmloss_div_inputs hin = {s, t, {0}};
    const lmloss_div_outputs rout = {loss, d[0], {0}, {0}, {0}};
    lmloss_context rc = ref_ctx(), tc = tb_ctx();
    const lmloss_status sr = lmloss_divergence(&rc, &hin, &o, &rout, hws, wsb);
    lmloss_div_inputs din = {dev_clone(&s), dev_clone(&t), {0}};
    lmloss_div_outputs dout = {dev_clone(&loss), dev_clone(&d[1]), {0}, {0}, {0}};
    const lmloss_status sg = lmloss_divergence(&tc, &din, &o, &dout, dws, wsb);
    dev_fetch(&d[1], &dout.divergence);
    if (tg_true(g, sr == LMLOSS_OK && sg == LMLOSS_OK, "kind %d: status %s %s", k,
                lmloss_status_string(sr), lmloss_status_string(sg)))
      for (int64_t i = 0; i < N; i++) {
        const double got = tget(&d[1], i, 0), ref = tget(&d[0], i, 0);
        const int agree =
            isinf(ref) ? got == ref : isfinite(got) && fabs(got - ref) <= 1e-3 * fabs(ref) + 1e-6;
        tg_true(g, agree, "kind %d, row %lld: divergence %g, REF %g", k, (long long)i, got, ref);
      }
    dev_free(&din.student), dev_free(&din.teacher), dev_free(&dout.loss);
    dev_free(&dout.divergence), dev_free_bytes(dws), free(hws);
    host_free(&s), host_free(&t), host_free(&d[0]), host_free(&d[1]), host_free(&loss);
  }
}

int main(void) {
  tb_init();
  tgroup g;
  static const int64_t Vs[] = {1, 3, 17, 1003, 151936};
  static const double margins[] = {0, 17, 50, 1000};
  static const lmloss_dtype dts[] = {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16};
  for (int rows = ROWS_RANDOM; rows <= ROWS_SPECIAL; rows++) {
    static const char *names[] = {"random rows",
                                  "student + 1e-2 noise",
                                  "peaked rows",
                                  "identical rows",
                                  "a flat student, the teacher it with a spike",
                                  "NaN/+inf/-inf rows, -inf columns, ties"};
    char name[96];
    snprintf(name, sizeof name, "every kind, %s", names[rows]);
    tg_begin(&g, name);
    for (int k = 0; k < NKINDS; k++)
      for (int v = 0; v < 5; v++) {
        /* half the kinds at full width on the CPU (CI's time); every kind
         * on CUDA, whose rows that wide take the one-sweep statistics */
        if (Vs[v] == 151936 && k % 2 && !tb_is_cuda()) continue;
        lmloss_div_options o = lmloss_div_options_default();
        o.kind = kinds[k].kind, o.beta = kinds[k].beta;
        o.reduction = (lmloss_reduction)((k + v) % 4);
        o.num_items = 7.5;
        o.grad_output = 0.75f;
        o.hard_weight = (k + v) % 3 == 0 ? 0.5f : 0.0f;
        o.soft_weight = (k + v) % 5 == 4 ? 2.0f : 1.0f;
        if ((k + v) % 4 == 1) o.teacher.temperature = 2.0f, o.student.temperature = 0.5f;
        if ((k + v) % 4 == 2) o.student.softcap = 4.0f, o.teacher.softcap = 4.0f;
        if ((k + v) % 4 == 3) o.student.softcap = 3.0f, o.teacher.logit_scale = 1.5f;
        if (rows == ROWS_SAME) o.teacher = o.student;
        const int labels = o.hard_weight > 0 || (k + v) % 2;
        rng_seed(9000 + 100 * rows + 10 * k + v);
        const lmloss_dtype sdt = rows == ROWS_SAME ? dts[v % 3] : dts[(k + v) % 2];
        run_case(&g,
                 rows == ROWS_SPECIAL ? 7
                 : Vs[v] > 40000      ? 2
                                      : 5,
                 Vs[v], sdt, rows == ROWS_SAME ? sdt : dts[(k + 2 * v) % 3], dts[(k + v) % 3], rows,
                 margins[(k + v) % 4], &o, labels);
      }
    tg_end(&g);
  }
  /* Every kind at every margin without a hard term, which would dominate
   * the entries: a third of the rows with the teacher's peak elsewhere. */
  tg_begin(&g, "every kind x margin 0-1000, soft term only");
  for (int k = 0; k < NKINDS; k++)
    for (int m = 0; m < 4; m++)
      for (int v = 2; v < 4; v++) {
        lmloss_div_options o = lmloss_div_options_default();
        o.kind = kinds[k].kind, o.beta = kinds[k].beta;
        o.reduction = LMLOSS_REDUCE_SUM;
        rng_seed(9700 + 40 * k + 4 * m + v);
        run_case(&g, 6, Vs[v], dts[(k + m) % 2], dts[m % 2], LMLOSS_F32, ROWS_PEAKED, margins[m],
                 &o, m % 2);
      }
  tg_end(&g);
  tg_begin(&g, "two fused heads against the logits they make, one and several chunks");
  for (int k = 0; k < NKINDS; k++)
    for (int r = 0; r < 4; r++) {
      lmloss_div_options o = lmloss_div_options_default();
      o.kind = kinds[k].kind, o.beta = kinds[k].beta;
      o.reduction = (lmloss_reduction)r, o.num_items = 5.0, o.grad_output = 0.5f;
      o.hard_weight = r == 1 ? 0.25f : 0.0f;
      o.teacher.temperature = r == 2 ? 2.0f : 1.0f;
      rng_seed(9900 + 10 * k + r);
      fused_case(&g, &o, r != 3 || o.hard_weight > 0, (k + r) % 2 ? 0 : 40000);
    }
  tg_end(&g);
  tg_begin(&g, "two fused heads: the default budget at the seed's shape");
  default_budget(&g);
  tg_end(&g);
  tg_begin(&g, "bad arguments leave every output untouched");
  bad_input(&g);
  tg_end(&g);
  tg_begin(&g, "a temperature near FLT_MIN: what REF reads, never NaN");
  overflowing_temperature(&g);
  tg_end(&g);
  tg_begin(&g, "1 and 2 threads: the same bits");
  threads(&g);
  tg_end(&g);
  return test_finish();
}
