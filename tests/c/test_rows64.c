/*
 * test_rows64.c - 64-bit row offsets: the row ops (CE with its gradient,
 * log-probs + entropy and their backward, softmax) on a batch whose
 * element offsets pass 2^31. On CUDA that is 8192 x 262144 logits in bf16
 * and fp32, rows strided V + 64 (the last row starts past 2^31 elements,
 * past 2^32 bytes); the CPU runs the same program at a small shape, since
 * CI has neither the GPU nor the 17 GB. Row i repeats pattern i % P, so
 * every output is checked against REF on the P pattern rows: the per-row
 * outputs on all rows, the [N, V] ones on the first, middle and last rows.
 */
#include "support/testing.h"

#define P 7

typedef struct {
  int64_t N, V, S; /* S: the row stride of the [N, V] tensors */
  lmloss_dtype dt;
} shape;

/* A device tensor [N, V] (stride S), row i a copy of pattern row i % P. */
static lmloss_tensor dev_tiled(const shape *s, const lmloss_tensor *pat) {
  lmloss_tensor d = {NULL, s->dt, tb_is_cuda() ? LMLOSS_CUDA : LMLOSS_CPU, s->N, s->V, s->S};
  const size_t es = tensor_bytes(pat) / (size_t)(P * s->V);
  d.data = dev_alloc_bytes(((size_t)(s->N - 1) * s->S + s->V) * es);
  for (int64_t i = 0; i < s->N; i++)
    dev_put((char *)d.data + (size_t)i * s->S * es, (char *)pat->data + (size_t)(i % P) * s->V * es,
            (size_t)s->V * es);
  return d;
}

/* [N, K] index-like host tensor tiled from P values per column. */
static lmloss_tensor tiled_small(lmloss_dtype dt, int64_t N, const lmloss_tensor *pat) {
  lmloss_tensor t = host_new(dt, N, pat->cols, pat->cols);
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < pat->cols; k++)
      tset(&t, i, k, tget(pat, i % P, k));
  return t;
}

/* Per-row outputs: every row against its pattern's REF value. */
static void check_rows(tgroup *g, const lmloss_tensor *got, const lmloss_tensor *ref,
                       const char *what) {
  for (int64_t i = 0; i < got->rows; i++)
    for (int64_t k = 0; k < got->cols; k++)
      tg_close(g, tget(got, i, k), tget(ref, i % P, k), got->dtype, 0, what, i, k);
}

/* [N, V] outputs: sampled rows, fetched one at a time, against REF. */
/* The rows check_wide reads, overwritten with 0x5a bytes. */
static void poison_wide(const shape *s, const lmloss_tensor *dev) {
  const int64_t rows[] = {0, 1, s->N / 2, s->N - 2, s->N - 1};
  lmloss_tensor h = host_new(s->dt, 1, s->V, s->V);
  const size_t es = tensor_bytes(&h) / (size_t)s->V;
  host_poison(&h);
  for (int r = 0; r < 5; r++)
    dev_put((char *)dev->data + (size_t)rows[r] * s->S * es, h.data, (size_t)s->V * es);
  host_free(&h);
}

static void check_wide(tgroup *g, const shape *s, const lmloss_tensor *dev,
                       const lmloss_tensor *ref, const char *what) {
  const int64_t rows[] = {0, 1, s->N / 2, s->N - 2, s->N - 1};
  lmloss_tensor h = host_new(s->dt, 1, s->V, s->V);
  const size_t es = tensor_bytes(&h) / (size_t)s->V;
  for (int r = 0; r < 5; r++) {
    lmloss_tensor v = *dev;
    v.rows = 1;
    v.data = (char *)dev->data + (size_t)rows[r] * s->S * es;
    dev_fetch(&h, &v);
    for (int64_t j = 0; j < s->V; j++)
      tg_close(g, tget(&h, 0, j), tget(ref, rows[r] % P, j), s->dt, 0, what, rows[r], j);
  }
  host_free(&h);
}

static int ok(tgroup *g, lmloss_status a, lmloss_status b, const char *what) {
  return tg_true(g, a == LMLOSS_OK && b == LMLOSS_OK, "%s: status %s / %s (%s)", what,
                 lmloss_status_string(a), lmloss_status_string(b), lmloss_last_error());
}

static void run(const shape *s) {
  char name[96];
  snprintf(name, sizeof name, "64-bit row offsets: %lld x %lld, stride %lld, %s", (long long)s->N,
           (long long)s->V, (long long)s->S, dt_name(s->dt));
  tgroup g;
  tg_begin(&g, name);
  const int64_t N = s->N, V = s->V;
  lmloss_context rc = ref_ctx(), tc = tb_ctx();
  lmloss_transform tr = lmloss_transform_default();
  /* P pattern rows; pattern 3 is peaked (its target leads by 20) */
  lmloss_tensor pat = host_new(s->dt, P, V, V), tp = host_new(LMLOSS_I64, P, 1, 1);
  int64_t t0[P];
  for (int p = 0; p < P; p++)
    t0[p] = rng_int(V), tset(&tp, p, 0, (double)t0[p]);
  fill_logits(&pat, 1.5, t0, -1);
  lmloss_tensor peak = {(char *)pat.data + tensor_bytes(&pat) / P * 3, s->dt, LMLOSS_CPU, 1, V, V};
  fill_logits(&peak, 1.5, &t0[3], 20.0);
  /* out starts as a copy of x: a row an op leaves unwritten fails */
  lmloss_tensor x = dev_tiled(s, &pat), out = dev_tiled(s, &pat);
  lmloss_tensor ref = host_new(s->dt, P, V, V);

  /* CE, reduction SUM, with the gradient; REF per row (NONE) */
  lmloss_tensor tgt = tiled_small(LMLOSS_I64, N, &tp), dtgt = dev_clone(&tgt);
  lmloss_tensor lse = host_new(LMLOSS_F32, N, 1, 1), loss = host_new(LMLOSS_F32, 1, 1, 1);
  lmloss_tensor rl = host_new(LMLOSS_F32, P, 1, 1), rlse = host_new(LMLOSS_F32, P, 1, 1);
  lmloss_tensor dlse = dev_clone(&lse), dloss = dev_clone(&loss);
  lmloss_ce_options o = lmloss_ce_options_default();
  o.reduction = LMLOSS_REDUCE_NONE;
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *rws = malloc(wsb), *dws = dev_alloc_bytes(wsb);
  lmloss_ce_inputs rin = {pat, tp, {0}, {0}}, din = {x, dtgt, {0}, {0}};
  lmloss_ce_outputs rout = {rl, rlse, {0}, {0}, ref}, dout = {dloss, dlse, {0}, {0}, out};
  lmloss_status sr = lmloss_cross_entropy(&rc, &rin, &o, &rout, rws, wsb);
  o.reduction = LMLOSS_REDUCE_SUM;
  lmloss_status sg = lmloss_cross_entropy(&tc, &din, &o, &dout, dws, wsb);
  dev_fetch(&lse, &dlse), dev_fetch(&loss, &dloss);
  if (ok(&g, sr, sg, "cross-entropy")) {
    double sum = 0.0;
    for (int64_t i = 0; i < N; i++)
      sum += tget(&rl, i % P, 0);
    tg_close(&g, tget(&loss, 0, 0), (float)sum, LMLOSS_F32, 0, "loss (sum)", 0, 0);
    check_rows(&g, &lse, &rlse, "lse");
    check_wide(&g, s, &out, &ref, "dlogits");
  }
  dout.dlogits = (lmloss_tensor){0}; /* the forward alone streams each row once */
  sg = lmloss_cross_entropy(&tc, &din, &o, &dout, dws, wsb);
  dev_fetch(&lse, &dlse);
  if (ok(&g, sr, sg, "cross-entropy forward")) check_rows(&g, &lse, &rlse, "lse (forward)");

  /* log-probs (K = 1) + entropy, then the backward from dlogp */
  lmloss_tensor rlp = host_new(LMLOSS_F32, P, 1, 1), rent = host_new(LMLOSS_F32, P, 1, 1);
  lmloss_tensor lp = host_new(LMLOSS_F32, N, 1, 1), ent = host_new(LMLOSS_F32, N, 1, 1);
  lmloss_tensor dlp = dev_clone(&lp), dent = dev_clone(&ent);
  sr = lmloss_log_probs(&rc, &pat, &tp, NULL, &tr, &rlp, &rent, NULL);
  sg = lmloss_log_probs(&tc, &x, &dtgt, NULL, &tr, &dlp, &dent, NULL);
  dev_fetch(&lp, &dlp), dev_fetch(&ent, &dent);
  if (ok(&g, sr, sg, "log-probs"))
    check_rows(&g, &lp, &rlp, "logp"), check_rows(&g, &ent, &rent, "entropy");
  lmloss_tensor up = host_new(LMLOSS_F32, P, 1, 1);
  for (int p = 0; p < P; p++)
    tset(&up, p, 0, rng_uniform() - 0.5);
  lmloss_tensor upn = tiled_small(LMLOSS_F32, N, &up), dup = dev_clone(&upn);
  sr = lmloss_log_probs_backward(&rc, &pat, &tp, NULL, &tr, &up, NULL, &ref, NULL);
  sg = lmloss_log_probs_backward(&tc, &x, &dtgt, NULL, &tr, &dup, NULL, &out, NULL);
  if (ok(&g, sr, sg, "log-probs backward")) check_wide(&g, s, &out, &ref, "dlogits (log-probs)");
  /* the same backward from the row statistics the forward saved, over
   * the checked rows poisoned first */
  poison_wide(s, &out);
  lmloss_tensor st = host_new(LMLOSS_F32, N, LMLOSS_ROW_STATS, LMLOSS_ROW_STATS);
  lmloss_tensor dst = dev_clone(&st);
  sg = lmloss_log_probs(&tc, &x, &dtgt, NULL, &tr, &dlp, &dent, &dst);
  if (sg == LMLOSS_OK)
    sg = lmloss_log_probs_backward(&tc, &x, &dtgt, NULL, &tr, &dup, NULL, &out, &dst);
  if (ok(&g, sr, sg, "log-probs backward from saved statistics"))
    check_wide(&g, s, &out, &ref, "dlogits (log-probs, saved statistics)");
  dev_free(&dst), host_free(&st);

  /* softmax */
  sr = lmloss_softmax(&rc, &pat, 0, &ref);
  sg = lmloss_softmax(&tc, &x, 0, &out);
  if (ok(&g, sr, sg, "softmax")) check_wide(&g, s, &out, &ref, "softmax");

  dev_free(&x), dev_free(&out), dev_free(&dtgt), dev_free(&dlse), dev_free(&dloss);
  dev_free(&dlp), dev_free(&dent), dev_free(&dup), dev_free_bytes(dws), free(rws);
  host_free(&pat), host_free(&tp), host_free(&ref), host_free(&tgt), host_free(&lse);
  host_free(&loss), host_free(&rl), host_free(&rlse), host_free(&rlp), host_free(&rent);
  host_free(&lp), host_free(&ent), host_free(&up), host_free(&upn);
  tg_end(&g);
}

int main(void) {
  tb_init();
  rng_seed(64);
  const lmloss_dtype dts[] = {LMLOSS_BF16, LMLOSS_F32};
  for (int d = 0; d < 2; d++) {
    shape s = {8192, 262144, 262144 + 64, dts[d]};
    if (!tb_is_cuda()) s.N = 64, s.V = 1003, s.S = 1003 + 64;
    run(&s);
  }
  return test_finish();
}
