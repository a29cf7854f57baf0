/*
 * test_refgrad.c - the REF backend's own gradients against central finite
 * differences (Richardson-extrapolated, objective summed in double from the
 * REF forward): CE with every option on random and peaked rows, log-probs
 * with entropy, softmax and log-softmax. Also: each gradient row sums to 0
 * within rounding and log p is never positive. Small V; needs no backend
 * but REF. Agreement: |fd - g| <= 1e-4 max_j |g_j| + 2e-5 (1 + |f|), the
 * second term the noise of differencing fp32 objective values f. DFT's
 * sg(p_y) has no finite-difference form: its gradient is checked as p_y
 * times the plain CE gradient. Zero row sums hold without z-loss/softcap.
 */
#include "support/testing.h"

typedef double (*objective)(void *ctx, const lmloss_tensor *x);

static double fd(objective f, void *c, const lmloss_tensor *x, int64_t i, int64_t j) {
  double x0 = tget(x, i, j), d[2];
  for (int r = 0; r < 2; r++) {
    double h = r ? 1.0 / 32 : 1.0 / 16;
    tset(x, i, j, x0 + h);
    double fp = f(c, x);
    tset(x, i, j, x0 - h);
    double fm = f(c, x);
    d[r] = (fp - fm) / (2 * h);
  }
  tset(x, i, j, x0);
  return (4 * d[1] - d[0]) / 3;
}

static void check_grad(tgroup *g, objective f, void *c, const lmloss_tensor *x,
                       const lmloss_tensor *grad, int zero_sum) {
  for (int64_t i = 0; i < x->rows; i++) {
    double mx = 0, sum = 0, sabs = 0, fv = fabs(f(c, x));
    for (int64_t j = 0; j < x->cols; j++)
      mx = fmax(mx, fabs(tget(grad, i, j)));
    for (int64_t j = 0; j < x->cols; j++) {
      double gj = tget(grad, i, j), n = fd(f, c, x, i, j);
      sum += gj, sabs += fabs(gj);
      g->checks++;
      if (!(fabs(n - gj) <= 1e-4 * mx + 2e-5 * (1 + fv))) {
        if (g->fails < 8)
          printf("  mismatch %s: grad[%lld,%lld] = %.9g, finite differences %.9g\n", g->name,
                 (long long)i, (long long)j, gj, n);
        g->fails++;
      }
      if (mx > 0 && fabs(n - gj) / mx > g->worst) g->worst = fabs(n - gj) / mx;
    }
    if (zero_sum)
      tg_true(g, fabs(sum) <= 1e-6 * sabs + TOL_FLOOR, "row %lld sums to %g (sum |g| %g)",
              (long long)i, sum, sabs);
  }
}

/* ---- cross-entropy ---- */
typedef struct {
  lmloss_ce_inputs in;
  lmloss_ce_options opt;
} ce_ctx;

static double ce_obj(void *p, const lmloss_tensor *x) {
  ce_ctx *c = p;
  lmloss_context rc = ref_ctx();
  lmloss_ce_inputs in = c->in;
  in.logits = *x;
  lmloss_tensor loss = host_new(LMLOSS_F32, 1, 1, 1);
  lmloss_ce_outputs out = {loss, {0}, {0}, {0}, {0}};
  size_t wsb = lmloss_cross_entropy_workspace_size(x->rows);
  void *ws = malloc(wsb);
  lmloss_cross_entropy(&rc, &in, &c->opt, &out, ws, wsb);
  double v = tget(&loss, 0, 0) * c->opt.grad_output;
  free(ws), host_free(&loss);
  return v;
}

static void ce_group(tgroup *g, int o, double margin) {
  int64_t N = 3, V = 7;
  ce_ctx c;
  memset(&c, 0, sizeof c);
  c.opt = lmloss_ce_options_default();
  c.opt.reduction = (lmloss_reduction)(1 + o % 3); /* SUM, MEAN, SUM_OVER_ITEMS */
  c.opt.num_items = 5;
  c.opt.grad_output = 0.8f;
  if (o == 1 || o == 9) c.opt.label_smoothing = 0.2f;
  if (o == 2 || o == 9) c.opt.z_loss = 0.05f;
  if (o == 3 || o == 9) c.opt.transform.logit_scale = 0.6f;
  if (o == 4 || o == 9) c.opt.transform.softcap = 15.0f;
  if (o == 5 || o == 9) c.opt.transform.temperature = 0.7f;
  if (o == 8) c.opt.dft = 1;
  int64_t tv[3];
  for (int64_t i = 0; i < N; i++)
    tv[i] = rng_int(V);
  if (o == 0 || o == 9) tv[1] = c.opt.ignore_index;
  c.in.logits = host_new(LMLOSS_F32, N, V, V);
  fill_logits(&c.in.logits, 1.5, tv, margin);
  c.in.target = host_new(LMLOSS_I64, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&c.in.target, i, 0, (double)tv[i]);
  if (o == 6 || o == 9) {
    c.in.token_weight = host_new(LMLOSS_F32, N, 1, 1);
    for (int64_t i = 0; i < N; i++)
      tset(&c.in.token_weight, i, 0, 0.5 + rng_uniform());
  }
  if (o == 7 || o == 9) {
    c.in.class_weight = host_new(LMLOSS_F32, V, 1, 1);
    for (int64_t j = 0; j < V; j++)
      tset(&c.in.class_weight, j, 0, 0.5 + rng_uniform());
  }
  lmloss_tensor grad = host_new(LMLOSS_F32, N, V, V), loss = host_new(LMLOSS_F32, 1, 1, 1);
  lmloss_ce_outputs out = {loss, {0}, {0}, {0}, grad};
  lmloss_context rc = ref_ctx();
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = malloc(wsb);
  if (tg_true(g, lmloss_cross_entropy(&rc, &c.in, &c.opt, &out, ws, wsb) == LMLOSS_OK,
              "ref CE failed: %s", lmloss_last_error())) {
    if (!c.opt.dft)
      check_grad(g, ce_obj, &c, &c.in.logits, &grad, o != 2 && o != 4 && o != 9);
    else {
      /* DFT: the gradient is sg(p_y) times the plain one */
      lmloss_tensor g0 = host_new(LMLOSS_F32, N, V, V), lse = host_new(LMLOSS_F32, N, 1, 1);
      lmloss_ce_options o0 = c.opt;
      o0.dft = 0;
      lmloss_ce_outputs out0 = {loss, lse, {0}, {0}, g0};
      lmloss_cross_entropy(&rc, &c.in, &o0, &out0, ws, wsb);
      for (int64_t i = 0; i < N; i++) {
        double py = exp(tget(&c.in.logits, i, tv[i]) - tget(&lse, i, 0));
        for (int64_t j = 0; j < V; j++)
          tg_close(g, tget(&grad, i, j), py * tget(&g0, i, j), LMLOSS_F32, 0, "dft grad", i, j);
      }
      host_free(&g0), host_free(&lse);
    }
  }
  free(ws), host_free(&grad), host_free(&loss), host_free(&c.in.logits);
  host_free(&c.in.target), host_free(&c.in.token_weight), host_free(&c.in.class_weight);
}

/* ---- log-probs with entropy ---- */
typedef struct {
  lmloss_tensor idx, dlogp, dent;
  lmloss_transform tr;
} lp_ctx;

static double lp_obj(void *p, const lmloss_tensor *x) {
  lp_ctx *c = p;
  lmloss_context rc = ref_ctx();
  lmloss_tensor lp = host_new(LMLOSS_F32, x->rows, c->idx.cols, c->idx.cols);
  lmloss_tensor h = host_new(LMLOSS_F32, x->rows, 1, 1);
  lmloss_log_probs(&rc, x, &c->idx, NULL, &c->tr, &lp, &h, NULL);
  double v = 0;
  for (int64_t i = 0; i < x->rows; i++) {
    for (int64_t k = 0; k < c->idx.cols; k++)
      v += tget(&c->dlogp, i, k) * tget(&lp, i, k);
    v += tget(&c->dent, i, 0) * tget(&h, i, 0);
  }
  host_free(&lp), host_free(&h);
  return v;
}

static void lp_group(tgroup *g, int t, double margin) {
  int64_t N = 3, V = 7, K = 2;
  lp_ctx c;
  c.tr = lmloss_transform_default();
  if (t == 1) c.tr.temperature = 0.7f;
  if (t == 2) c.tr.softcap = 15.0f, c.tr.logit_scale = 1.3f;
  c.idx = host_new(LMLOSS_I64, N, K, K);
  c.dlogp = host_new(LMLOSS_F32, N, K, K);
  c.dent = host_new(LMLOSS_F32, N, 1, 1);
  int64_t tv[3];
  for (int64_t i = 0; i < N; i++) {
    tv[i] = rng_int(V);
    tset(&c.idx, i, 0, (double)tv[i]), tset(&c.idx, i, 1, (double)rng_int(V));
    tset(&c.dlogp, i, 0, 0.5 + rng_uniform()), tset(&c.dlogp, i, 1, rng_uniform() - 0.5);
    tset(&c.dent, i, 0, rng_uniform() - 0.3);
  }
  lmloss_tensor x = host_new(LMLOSS_F32, N, V, V), grad = host_new(LMLOSS_F32, N, V, V);
  fill_logits(&x, 1.5, tv, margin);
  lmloss_context rc = ref_ctx();
  lmloss_tensor lp = host_new(LMLOSS_F32, N, K, K);
  lmloss_log_probs(&rc, &x, &c.idx, NULL, &c.tr, &lp, NULL, NULL);
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < K; k++)
      tg_true(g, tget(&lp, i, k) <= 0, "log p = %g > 0", tget(&lp, i, k));
  if (tg_true(g,
              lmloss_log_probs_backward(&rc, &x, &c.idx, NULL, &c.tr, &c.dlogp, &c.dent, &grad,
                                        NULL) == LMLOSS_OK,
              "ref log-probs backward failed: %s", lmloss_last_error()))
    check_grad(g, lp_obj, &c, &x, &grad, t != 2);
  host_free(&x), host_free(&grad), host_free(&lp), host_free(&c.idx), host_free(&c.dlogp);
  host_free(&c.dent);
}

/* ---- softmax / log-softmax: objective sum dy * y ---- */
typedef struct {
  lmloss_tensor dy;
  int log;
} sm_ctx;

static double sm_obj(void *p, const lmloss_tensor *x) {
  sm_ctx *c = p;
  lmloss_context rc = ref_ctx();
  lmloss_tensor y = host_new(LMLOSS_F32, x->rows, x->cols, x->cols);
  lmloss_softmax(&rc, x, c->log, &y);
  double v = 0;
  for (int64_t i = 0; i < x->rows; i++)
    for (int64_t j = 0; j < x->cols; j++)
      v += tget(&c->dy, i, j) * tget(&y, i, j);
  host_free(&y);
  return v;
}

static void sm_group(tgroup *g, int log, double margin) {
  int64_t N = 3, V = 7;
  sm_ctx c;
  c.log = log;
  c.dy = host_new(LMLOSS_F32, N, V, V);
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < V; j++)
      tset(&c.dy, i, j, rng_uniform() - 0.5);
  int64_t tv[3] = {rng_int(V), rng_int(V), rng_int(V)};
  lmloss_tensor x = host_new(LMLOSS_F32, N, V, V), y = host_new(LMLOSS_F32, N, V, V);
  lmloss_tensor dx = host_new(LMLOSS_F32, N, V, V);
  fill_logits(&x, 1.5, tv, margin);
  lmloss_context rc = ref_ctx();
  lmloss_softmax(&rc, &x, log, &y);
  for (int64_t i = 0; i < N && log; i++)
    for (int64_t j = 0; j < V; j++)
      tg_true(g, tget(&y, i, j) <= 0, "log-softmax > 0");
  if (tg_true(g, lmloss_softmax_backward(&rc, &y, &c.dy, log, &dx) == LMLOSS_OK,
              "ref softmax backward failed: %s", lmloss_last_error()))
    check_grad(g, sm_obj, &c, &x, &dx, !log);
  host_free(&x), host_free(&y), host_free(&dx), host_free(&c.dy);
}

int main(void) {
  tgroup g;
  static const double margins[] = {-1, 0, 5, 17};
  static const char *oname[] = {
      "ignore_index", "label_smoothing", "z_loss",  "logit_scale", "softcap",
      "temperature",  "token_w",         "class_w", "dft",         "all"};
  for (int o = 0; o < 10; o++) {
    char name[80];
    snprintf(name, sizeof name, "ref CE gradient vs finite differences: %s", oname[o]);
    tg_begin(&g, name);
    for (int m = 0; m < 4; m++)
      rng_seed(100 * o + m), ce_group(&g, o, margins[m]);
    tg_end(&g);
  }
  static const char *tname[] = {"plain", "temperature", "softcap+scale"};
  for (int t = 0; t < 3; t++) {
    char name[80];
    snprintf(name, sizeof name, "ref log-probs+entropy gradient vs FD: %s", tname[t]);
    tg_begin(&g, name);
    for (int m = 0; m < 4; m++)
      rng_seed(2000 + 10 * t + m), lp_group(&g, t, margins[m]);
    tg_end(&g);
  }
  for (int log = 0; log < 2; log++) {
    tg_begin(&g, log ? "ref log-softmax backward vs FD" : "ref softmax backward vs FD");
    for (int m = 0; m < 4; m++)
      rng_seed(3000 + 10 * log + m), sm_group(&g, log, margins[m]);
    tg_end(&g);
  }
  return test_finish();
}
