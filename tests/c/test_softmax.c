/*
 * test_softmax.c - softmax / log-softmax forward and backward (from y) of
 * the backend under test against REF: every V, dtype, peaked margin,
 * strides, in place, ties, non-finite rows.
 */
#include "support/testing.h"

static const lmloss_dtype fdts[] = {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16};
static const double margins[] = {-1, 0, 5, 17, 20, 30, 50, 100, 1000};

static void run_case(tgroup *g, int64_t N, int64_t V, int64_t pad, int log, lmloss_dtype xdt,
                     lmloss_dtype odt, double margin, int inplace, int special) {
  lmloss_tensor x = host_new(xdt, N, V, V + pad);
  host_poison(&x);
  int64_t *t0 = malloc(sizeof(int64_t) * (size_t)N);
  for (int64_t i = 0; i < N; i++)
    t0[i] = rng_int(V);
  fill_logits(&x, 2.0, t0, margin);
  if (special && N >= 4) {
    tset(&x, 0, rng_int(V), NAN), tset(&x, 1, rng_int(V), INFINITY);
    for (int64_t j = 0; j < V; j++)
      tset(&x, 2, j, -INFINITY);
    for (int64_t j = 0; j < V; j++)
      if (j != t0[3] && rng_uniform() < 0.3) tset(&x, 3, j, -INFINITY);
  }
  if (inplace) odt = xdt;
  lmloss_tensor yr = inplace ? host_clone(&x) : host_new(odt, N, V, V + 1);
  if (!inplace) host_poison(&yr);
  lmloss_tensor yg = host_clone(&yr);
  lmloss_context rc = ref_ctx(), tc = tb_ctx();
  lmloss_status sr = lmloss_softmax(&rc, inplace ? &yr : &x, log, &yr);
  lmloss_tensor dx = inplace ? dev_clone(&yg) : dev_clone(&x), dy = inplace ? dx : dev_clone(&yg);
  lmloss_status sg = lmloss_softmax(&tc, &dx, log, &dy);
  dev_fetch(&yg, &dy);
  if (!inplace) dev_free(&dx);
  dev_free(&dy);
  size_t before = (size_t)g->fails;
  if (tg_true(g, sr == LMLOSS_OK && sg == LMLOSS_OK, "forward status %s %s (%s)",
              lmloss_status_string(sr), lmloss_status_string(sg), lmloss_last_error())) {
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < V; j++) {
        tg_close(g, tget(&yg, i, j), tget(&yr, i, j), odt, 0, "y", i, j);
        if (log) tg_true(g, !(tget(&yg, i, j) > 0), "log-softmax %g > 0", tget(&yg, i, j));
      }
    /* backward from the REF forward's y (in odt), dy in place over a copy */
    lmloss_tensor up = host_new(odt, N, V, V);
    for (int64_t i = 0; i < N; i++)
      for (int64_t j = 0; j < V; j++)
        tset(&up, i, j, 0.25 + rng_uniform());
    lmloss_tensor gr = inplace ? host_clone(&up) : host_new(odt, N, V, V + 3);
    if (!inplace) host_poison(&gr);
    lmloss_tensor gg = host_clone(&gr);
    sr = lmloss_softmax_backward(&rc, &yr, inplace ? &gr : &up, log, &gr);
    lmloss_tensor dyv = dev_clone(&yr), dup = inplace ? dev_clone(&gg) : dev_clone(&up);
    lmloss_tensor dgx = inplace ? dup : dev_clone(&gg);
    sg = lmloss_softmax_backward(&tc, &dyv, &dup, log, &dgx);
    dev_fetch(&gg, &dgx);
    dev_free(&dyv), dev_free(&dup);
    if (!inplace) dev_free(&dgx);
    if (tg_true(g, sr == LMLOSS_OK && sg == LMLOSS_OK, "backward status %s %s (%s)",
                lmloss_status_string(sr), lmloss_status_string(sg), lmloss_last_error()))
      tg_close_softmax_grad(g, &gg, &gr, &yr, &up, log, TOL_CANCEL);
    host_free(&up), host_free(&gr), host_free(&gg);
  }
  if ((size_t)g->fails > before && before == 0)
    printf("  case: N=%lld V=%lld log=%d x=%s out=%s margin=%g inplace=%d special=%d\n",
           (long long)N, (long long)V, log, dt_name(xdt), dt_name(odt), margin, inplace, special);
  host_free(&x), host_free(&yr), host_free(&yg);
  free(t0);
}

int main(void) {
  tb_init();
  tgroup g;
  static const int64_t Vs[] = {1, 2, 3, 17, 1003, 40001, 151936};
  for (int log = 0; log < 2; log++)
    for (int v = 0; v < 7; v++) {
      char name[80];
      snprintf(name, sizeof name, "%s fwd+bwd margins x dtypes, V=%lld",
               log ? "log-softmax" : "softmax", (long long)Vs[v]);
      tg_begin(&g, name);
      for (int m = 0; m < 9; m++)
        for (int d = 0; d < 3; d++) {
          rng_seed(5000 + 1000 * log + 50 * v + 3 * m + d);
          run_case(&g, Vs[v] >= 40001 ? 2 : 5, Vs[v], margins[m] > 10 ? 2 : 0, log, fdts[d],
                   fdts[(d + m) % 3], margins[m], (m + d) % 4 == 3, 0);
        }
      tg_end(&g);
    }
  tg_begin(&g, "softmax/log-softmax NaN/+inf/all -inf rows, -inf");
  for (int k = 0; k < 12; k++) {
    rng_seed(7000 + k);
    run_case(&g, 6, k % 2 ? 17 : 1003, k % 3 ? 2 : 0, k % 2, fdts[k % 3], fdts[k % 3],
             k % 3 ? 30 : -1, k % 4 == 3, 1);
  }
  tg_end(&g);
  /* Rows in 16-byte aligned strides, which CUDA's held plan
   * (src/cuda/held.cuh) takes: one CTA with the vector crossing V, and
   * clusters of up to 16 CTAs. */
  tg_begin(&g, "softmax/log-softmax, aligned rows: V = 1003, 131072, 262144");
  for (int k = 0; k < 18; k++) {
    const int64_t V = (int64_t[]){1003, 131072, 262144}[k % 3];
    rng_seed(7100 + k);
    run_case(&g, V == 1003 ? 6 : 2, V, V == 1003 ? 5 : 8 * (k % 2), (k / 3) % 2, fdts[k % 3],
             fdts[(k / 3) % 3], margins[(2 * k) % 9], k % 4 == 3, V == 1003 && k % 2);
  }
  tg_end(&g);
  return test_finish();
}
