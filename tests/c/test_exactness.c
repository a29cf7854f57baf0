/*
 * test_exactness.c - gradient entries that a cancellation once cost their
 * precision (issue 35's reproducers, found by a differential fuzz against
 * the float64 oracle), on the backend under test against REF with no
 * cancellation floor: every entry within TOL_REL of REF, and every
 * gradient row summing to zero within 1e-6 of its entries' magnitudes.
 *
 * - log-probs backward, K > 1, upstream gradients of different sizes: the
 *   argmax entry is dlogp_a R / (1 + R) - (the other indices' dlogp) p_a;
 *   from D - dlogp_a the second term kept only D's rounding. Also through
 *   the fused head's dweight.
 * - cross-entropy with small label smoothing at a confident target: the
 *   argmax entry is e (C - c_y) / V - A R / (1 + R); as A - B_y it kept
 *   only the rounding of A and B_y, both near 1.
 */
#include "support/testing.h"

/* Every entry of got against ref (both [N, V] F32), and each row's sum.
 * bfloor: NULL (no floor), or per entry the magnitude of the constant
 * the entry subtracts (testing.h's cancellation floor: B_j, and A - B_a
 * at the argmax, which the fixed cancellation missed by far more). */
static void check_rows(tgroup *g, const lmloss_tensor *got, const lmloss_tensor *ref,
                       const double *bfloor, const char *what) {
  const int64_t V = got->cols;
  for (int64_t i = 0; i < got->rows; i++) {
    double sum = 0.0, mag = 0.0;
    for (int64_t j = 0; j < V; j++) {
      const double v = tget(got, i, j);
      const double extra = bfloor ? TOL_CANCEL * bfloor[i * V + j] : 0.0;
      tg_close(g, v, tget(ref, i, j), LMLOSS_F32, extra, what, i, j);
      sum += v, mag += fabs(v);
    }
    tg_true(g, fabs(sum) <= 1e-6 * mag, "%s: row %lld sums to %g (entries' magnitude %g)", what,
            (long long)i, sum, mag);
  }
}

/* log_probs_backward of x [N, V] at index [N, K] with dlogp [N, K] (and
 * dentropy [N] when given) on REF and the backend under test. */
static void lp_case(tgroup *g, const char *what, const lmloss_tensor *x, const lmloss_tensor *idx,
                    const lmloss_tensor *dlogp, const lmloss_tensor *dent) {
  const lmloss_transform tr = lmloss_transform_default();
  lmloss_tensor ref = host_new(LMLOSS_F32, x->rows, x->cols, x->cols);
  lmloss_tensor got = host_new(LMLOSS_F32, x->rows, x->cols, x->cols);
  lmloss_context rc = ref_ctx(), tc = tb_ctx();
  lmloss_status sr = lmloss_log_probs_backward(&rc, x, idx, NULL, &tr, dlogp, dent, &ref, NULL);
  lmloss_tensor dx = dev_clone(x), di = dev_clone(idx), dp = dev_clone(dlogp);
  lmloss_tensor de = dent ? dev_clone(dent) : (lmloss_tensor){0}, dg = dev_clone(&got);
  lmloss_status sg =
      lmloss_log_probs_backward(&tc, &dx, &di, NULL, &tr, &dp, dent ? &de : NULL, &dg, NULL);
  dev_fetch(&got, &dg);
  dev_free(&dx), dev_free(&di), dev_free(&dp), dev_free(&de), dev_free(&dg);
  if (tg_true(g, sr == LMLOSS_OK && sg == LMLOSS_OK, "%s: status %s %s (%s)", what,
              lmloss_status_string(sr), lmloss_status_string(sg), lmloss_last_error()))
    check_rows(g, &got, &ref, NULL, what);
  host_free(&ref), host_free(&got);
}

/* Issue 35's log-probs reproducer and its neighbours: a row that leads by
 * `margin` at column 0, indices {0, 1} (or {0, 1, 0}: a duplicated
 * argmax), dlogp {1, -small}, with and without an entropy gradient. */
static void lp_group(void) {
  tgroup g;
  tg_begin(&g, "log-probs backward, K > 1, upstream gradients of different sizes");
  static const double smalls[] = {1e-6, 1e-7, 3e-5};
  static const double margins[] = {30, 17, 50};
  static const int64_t Vs[] = {4, 1003};
  for (int v = 0; v < 2; v++)
    for (int m = 0; m < 3; m++)
      for (int s = 0; s < 3; s++)
        for (int k3 = 0; k3 < 2; k3++)
          for (int ent = 0; ent < 2; ent++) {
            const int64_t V = Vs[v], K = 2 + k3;
            rng_seed(100 + 37 * v + 11 * m + 5 * s + 2 * k3 + ent);
            lmloss_tensor x = host_new(LMLOSS_F32, 1, V, V);
            for (int64_t j = 0; j < V; j++) /* issue 35's row is {30, 0, 0, 0} */
              tset(&x, 0, j, V == 4 ? 0.0 : rng_normal());
            tset(&x, 0, 0, (V == 4 ? 0.0 : 4.0) + margins[m]);
            lmloss_tensor idx = host_new(LMLOSS_I64, 1, K, K);
            lmloss_tensor dl = host_new(LMLOSS_F32, 1, K, K);
            tset(&idx, 0, 0, 0), tset(&idx, 0, 1, 1);
            tset(&dl, 0, 0, 1.0), tset(&dl, 0, 1, -smalls[s]);
            if (K == 3) tset(&idx, 0, 2, 0), tset(&dl, 0, 2, 0.5);
            lmloss_tensor dh = host_new(LMLOSS_F32, 1, 1, 1);
            tset(&dh, 0, 0, 0.25);
            char what[96];
            snprintf(what, sizeof what, "V=%lld margin %g dlogp {1, -%g%s}%s", (long long)V,
                     margins[m], smalls[s], K == 3 ? ", 0.5 at the argmax again" : "",
                     ent ? " dentropy 0.25" : "");
            lp_case(&g, what, &x, &idx, &dl, ent ? &dh : NULL);
            host_free(&x), host_free(&idx), host_free(&dl), host_free(&dh);
          }
  tg_end(&g);
}

/* The fused head's dweight for the log-probs reproducer: hidden = I (2 x
 * 2), so row i's logits are weight's column i and dweight's column i is
 * row i's dlogits, which REF's log_probs_backward gives. */
static void lp_head_group(void) {
  tgroup g;
  tg_begin(&g, "fused head: log-probs backward's dweight, K = 2, dlogp {1, -1e-6}");
  const int64_t N = 2, H = 2, V = 4, K = 2;
  lmloss_tensor hid = host_new(LMLOSS_F32, N, H, H), w = host_new(LMLOSS_F32, V, H, H);
  lmloss_tensor logits = host_new(LMLOSS_F32, N, V, V);
  lmloss_tensor idx = host_new(LMLOSS_I64, N, K, K), dl = host_new(LMLOSS_F32, N, K, K);
  for (int64_t i = 0; i < N; i++)
    for (int64_t h = 0; h < H; h++)
      tset(&hid, i, h, i == h);
  for (int64_t v = 0; v < V; v++)
    for (int64_t h = 0; h < H; h++) {
      const double l = (h == 0 && v == 0) || (h == 1 && v == 2) ? 30.0 : 0.0;
      tset(&w, v, h, l), tset(&logits, h, v, l);
    }
  const int64_t ix[2][2] = {{0, 1}, {2, 3}};
  const double dv[2][2] = {{1.0, -1e-6}, {1.0, -1e-7}};
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < K; k++)
      tset(&idx, i, k, (double)ix[i][k]), tset(&dl, i, k, dv[i][k]);
  lmloss_tensor ref = host_new(LMLOSS_F32, N, V, V);
  const lmloss_transform tr = lmloss_transform_default();
  lmloss_context rc = ref_ctx(), tc = tb_ctx();
  lmloss_status sr =
      lmloss_log_probs_backward(&rc, &logits, &idx, NULL, &tr, &dl, NULL, &ref, NULL);

  lmloss_tensor dw = host_new(LMLOSS_F32, V, H, H);
  lmloss_head head = {dev_clone(&hid), dev_clone(&w), {0}};
  lmloss_tensor di = dev_clone(&idx), dd = dev_clone(&dl), ddw = dev_clone(&dw);
  lmloss_head_grads gr = {{0}, ddw, {0}};
  lmloss_head_options ho = lmloss_head_options_default();
  size_t wsb = 0;
  lmloss_status sg = lmloss_linear_workspace_size(&head, &ho, &gr, K, &wsb);
  void *ws = dev_alloc_bytes(wsb);
  if (sg == LMLOSS_OK)
    sg = lmloss_linear_log_probs_backward(&tc, &head, &di, NULL, &tr, &ho, &dd, NULL, NULL, &gr, ws,
                                          wsb);
  dev_fetch(&dw, &ddw);
  dev_free(&head.hidden), dev_free(&head.weight), dev_free(&di), dev_free(&dd), dev_free(&ddw);
  dev_free_bytes(ws);
  if (tg_true(&g, sr == LMLOSS_OK && sg == LMLOSS_OK, "status %s %s (%s)", lmloss_status_string(sr),
              lmloss_status_string(sg), lmloss_last_error())) {
    lmloss_tensor got = host_new(LMLOSS_F32, N, V, V); /* dweight's columns as rows */
    for (int64_t i = 0; i < N; i++)
      for (int64_t v = 0; v < V; v++)
        tset(&got, i, v, tget(&dw, v, i));
    check_rows(&g, &got, &ref, NULL, "dweight");
    host_free(&got);
  }
  host_free(&hid), host_free(&w), host_free(&logits), host_free(&idx), host_free(&dl);
  host_free(&ref), host_free(&dw);
  tg_end(&g);
}

/* cross_entropy with a gradient on REF and the backend under test; rows
 * whose argmax is amax[i]. */
static void ce_case(tgroup *g, const char *what, const lmloss_tensor *x, const lmloss_tensor *y,
                    const lmloss_tensor *cw, const lmloss_ce_options *opt, const int64_t *amax) {
  const int64_t N = x->rows, V = x->cols;
  /* B_j (A - B_a at the argmax) times the reduction's factor */
  double *bf = malloc(sizeof(double) * (size_t)(N * V)), den = 0.0;
  const double e = opt->label_smoothing;
  double C = 0.0;
  for (int64_t j = 0; j < V; j++)
    C += cw ? tget(cw, j, 0) : 1.0;
  for (int64_t i = 0; i < N; i++)
    den += cw ? tget(cw, (int64_t)tget(y, i, 0), 0) : 1.0;
  for (int64_t i = 0; i < N; i++) {
    const int64_t yi = (int64_t)tget(y, i, 0);
    const double scale = opt->reduction == LMLOSS_REDUCE_MEAN ? 1.0 / den : 1.0;
    const double cy = cw ? tget(cw, yi, 0) : 1.0;
    for (int64_t j = 0; j < V; j++) {
      const double cj = cw ? tget(cw, j, 0) : 1.0, hot = j == yi ? cy * (1.0 - e) : 0.0;
      bf[i * V + j] = scale * (j == amax[i] ? fabs(cy * (1.0 - e) - hot + e * (C - cj) / (double)V)
                                            : hot + e * cj / (double)V);
    }
  }
  const int none = opt->reduction == LMLOSS_REDUCE_NONE;
  lmloss_tensor lr = host_new(LMLOSS_F32, none ? N : 1, 1, 1), lg = host_clone(&lr);
  lmloss_tensor ref = host_new(LMLOSS_F32, N, V, V), got = host_clone(&ref);
  const size_t wsb = lmloss_cross_entropy_workspace_size(N);
  lmloss_context rc = ref_ctx(), tc = tb_ctx();
  void *hws = malloc(wsb);
  lmloss_ce_inputs in = {*x, *y, {0}, cw ? *cw : (lmloss_tensor){0}};
  lmloss_ce_outputs out = {.loss = lr, .dlogits = ref};
  lmloss_status sr = lmloss_cross_entropy(&rc, &in, opt, &out, hws, wsb);
  free(hws);
  lmloss_ce_inputs din = {dev_clone(x), dev_clone(y), {0}, cw ? dev_clone(cw) : (lmloss_tensor){0}};
  lmloss_ce_outputs dout = {.loss = dev_clone(&lg), .dlogits = dev_clone(&got)};
  void *ws = dev_alloc_bytes(wsb);
  lmloss_status sg = lmloss_cross_entropy(&tc, &din, opt, &dout, ws, wsb);
  dev_fetch(&lg, &dout.loss), dev_fetch(&got, &dout.dlogits);
  dev_free(&din.logits), dev_free(&din.target), dev_free(&din.class_weight);
  dev_free(&dout.loss), dev_free(&dout.dlogits), dev_free_bytes(ws);
  if (tg_true(g, sr == LMLOSS_OK && sg == LMLOSS_OK, "%s: status %s %s (%s)", what,
              lmloss_status_string(sr), lmloss_status_string(sg), lmloss_last_error())) {
    for (int64_t i = 0; i < lr.rows; i++)
      tg_close(g, tget(&lg, i, 0), tget(&lr, i, 0), LMLOSS_F32, 0.0, "loss", i, 0);
    check_rows(g, &got, &ref, bf, what);
  }
  free(bf);
  host_free(&lr), host_free(&lg), host_free(&ref), host_free(&got);
}

/* Issue 35's CE reproducer (V = 8191, smoothing 1.43e-4, a target that
 * leads by 30, reduction sum) and its neighbours: other smoothings,
 * margins, reductions, class weights, an argmax that is not the target. */
static void ce_group(void) {
  tgroup g;
  tg_begin(&g, "cross-entropy gradient at the argmax with label smoothing");
  static const double eps[] = {1.43e-4, 1e-6, 1e-3, 0.1};
  static const double margins[] = {30, 17, 50};
  static const lmloss_reduction reds[] = {LMLOSS_REDUCE_SUM, LMLOSS_REDUCE_MEAN,
                                          LMLOSS_REDUCE_NONE};
  const int64_t N = 2;
  for (int e = 0; e < 4; e++)
    for (int m = 0; m < 3; m++)
      for (int r = 0; r < 3; r++)
        for (int w = 0; w < 2; w++)
          for (int other = 0; other < 2; other++) {
            const int64_t V = (e == 0 && m == 0) ? 8191 : 1003;
            rng_seed(900 + 101 * e + 31 * m + 7 * r + 3 * w + other);
            lmloss_tensor x = host_new(LMLOSS_F32, N, V, V), y = host_new(LMLOSS_I64, N, 1, 1);
            int64_t t0[2], lead[2];
            for (int64_t i = 0; i < N; i++) {
              t0[i] = rng_int(V);
              lead[i] = other ? (t0[i] + 1 + rng_int(V - 1)) % V : t0[i];
              tset(&y, i, 0, (double)t0[i]);
            }
            fill_logits(&x, 2.0, lead, margins[m]);
            lmloss_tensor cw = host_new(LMLOSS_F32, V, 1, 1);
            for (int64_t j = 0; j < V; j++)
              tset(&cw, j, 0, 0.5 + rng_uniform());
            lmloss_ce_options opt = lmloss_ce_options_default();
            opt.label_smoothing = (float)eps[e];
            opt.reduction = reds[r];
            char what[112];
            snprintf(what, sizeof what, "V=%lld e %g margin %g %s%s%s", (long long)V, eps[e],
                     margins[m],
                     r == 0   ? "sum"
                     : r == 1 ? "mean"
                              : "none",
                     w ? " class weights" : "", other ? " argmax not the target" : "");
            ce_case(&g, what, &x, &y, w ? &cw : NULL, &opt, lead);
            host_free(&x), host_free(&y), host_free(&cw);
          }
  tg_end(&g);
}

int main(void) {
  tb_init();
  lp_group();
  lp_head_group();
  ce_group();
  return test_finish();
}
