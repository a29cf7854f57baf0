/*
 * test_context.c - the execution context's num_threads is bounded: a count
 * libgomp cannot start (32768 made it print and exit, 65536 crashed) is
 * refused with LMLOSS_ERR_BAD_OPTION and a message, nothing written, on
 * every op family and every host backend; counts within [0, 1024] run.
 */
#include <limits.h>

#include "support/testing.h"

enum { N = 4, V = 33 };

/* One call of each family with ctx; 0: CE, 1: log-probs, 2: softmax,
 * 3: row-state merge, 4: fused head. out: the tensor the call writes. */
static lmloss_status call(int fam, const lmloss_context *ctx, const lmloss_tensor *x,
                          const lmloss_tensor *y, const lmloss_tensor *out) {
  const lmloss_transform tr = lmloss_transform_default();
  switch (fam) {
  case 0: {
    lmloss_ce_inputs in = {*x, *y, {0}, {0}};
    lmloss_ce_options opt = lmloss_ce_options_default();
    opt.reduction = LMLOSS_REDUCE_NONE;
    lmloss_ce_outputs o = {.loss = *out};
    size_t wsb = lmloss_cross_entropy_workspace_size(N);
    void *ws = malloc(wsb);
    lmloss_status st = lmloss_cross_entropy(ctx, &in, &opt, &o, ws, wsb);
    free(ws);
    return st;
  }
  case 1: return lmloss_log_probs(ctx, x, y, NULL, &tr, out, NULL, NULL);
  case 2: return lmloss_softmax(ctx, x, 0, out);
  case 3: {
    lmloss_tensor a = host_new(LMLOSS_F32, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
    lmloss_shard sh = lmloss_shard_default();
    lmloss_context c0 = *ctx;
    c0.num_threads = 1;
    lmloss_status st = lmloss_log_probs_state(&c0, x, y, NULL, &tr, &sh, &a);
    if (st == LMLOSS_OK) st = lmloss_row_state_merge(ctx, &a, &a, &tr, out);
    host_free(&a);
    return st;
  }
  default: {
    lmloss_tensor h = host_new(LMLOSS_F32, N, 1, 1), w = host_new(LMLOSS_F32, V, 1, 1);
    for (int64_t i = 0; i < N; i++)
      tset(&h, i, 0, 1.0);
    for (int64_t j = 0; j < V; j++)
      tset(&w, j, 0, 0.1 * (double)j);
    lmloss_head head = {h, w, {0}};
    lmloss_head_options ho = lmloss_head_options_default();
    size_t wsb = 0;
    lmloss_status st = lmloss_linear_workspace_size(&head, &ho, NULL, 1, &wsb);
    void *ws = malloc(wsb);
    if (st == LMLOSS_OK)
      st = lmloss_linear_log_probs(ctx, &head, y, NULL, &tr, &ho, out, NULL, NULL, ws, wsb);
    free(ws), host_free(&h), host_free(&w);
    return st;
  }
  }
}

int main(void) {
  tb_init();
  static const char *fams[] = {"cross-entropy", "log-probs", "softmax", "row-state merge",
                               "fused head"};
  static const int bad[] = {1025, 32768, 65536, INT_MAX, -1, INT_MIN};
  static const int good[] = {0, 1, 3, 64, 1024};
  lmloss_tensor x = host_new(LMLOSS_F32, N, V, V), y = host_new(LMLOSS_I64, N, 1, 1);
  for (int64_t i = 0; i < N; i++)
    tset(&y, i, 0, (double)rng_int(V));
  fill_logits(&x, 2.0, NULL, -1);
  for (int b = 0; b < 2; b++) {
    tgroup g;
    char name[64];
    const lmloss_backend be = b ? LMLOSS_BACKEND_REF : LMLOSS_BACKEND_CPU;
    snprintf(name, sizeof name, "num_threads bounds, %s backend", b ? "REF" : "CPU");
    tg_begin(&g, name);
    for (int f = 0; f < 5; f++) {
      const int64_t oc = f == 2 ? V : f == 3 ? LMLOSS_ROW_STATE_COLS : 1;
      lmloss_tensor out = host_new(LMLOSS_F32, N, oc, oc);
      if (f >= 3 && be == LMLOSS_BACKEND_REF) { /* REF has no row states, no fused head */
        host_free(&out);
        continue;
      }
      for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        lmloss_context ctx = lmloss_context_default();
        ctx.backend = be, ctx.num_threads = bad[k];
        host_poison(&out);
        lmloss_tensor before = host_clone(&out);
        lmloss_status st = call(f, &ctx, &x, &y, &out);
        const char *msg = lmloss_last_error();
        tg_true(&g, st == LMLOSS_ERR_BAD_OPTION && strstr(msg, "num_threads"),
                "%s, num_threads %d: %s (%s)", fams[f], bad[k], lmloss_status_string(st), msg);
        tg_true(&g, same_bytes(&out, &before), "%s, num_threads %d: output written", fams[f],
                bad[k]);
        host_free(&before);
      }
      for (size_t k = 0; k < sizeof good / sizeof *good; k++) {
        lmloss_context ctx = lmloss_context_default();
        ctx.backend = be, ctx.num_threads = good[k];
        lmloss_status st = call(f, &ctx, &x, &y, &out);
        tg_true(&g, st == LMLOSS_OK, "%s, num_threads %d: %s (%s)", fams[f], good[k],
                lmloss_status_string(st), lmloss_last_error());
      }
      host_free(&out);
    }
    tg_end(&g);
  }
  host_free(&x), host_free(&y);
  return test_finish();
}
