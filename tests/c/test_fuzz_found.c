/*
 * test_fuzz_found.c - every defect the fuzz targets (fuzz/) found, as a
 * test on the host backends (CPU and REF; the inputs are host memory).
 * They are undefined behaviour rather than wrong numbers, so they fail
 * only under a sanitizer that checks it: clang's UBSan (fuzz/run.sh's
 * build) for both, gcc's with -fsanitize=float-cast-overflow (not part
 * of -fsanitize=undefined) for the second; elsewhere they pass quietly.
 *
 * - fuzz_ce: a cross-entropy call of N = 0 rows may pass a NULL workspace
 *   (of the size asked for); the CPU backend offset the NULL pointer to
 *   its row buffers.
 * - fuzz_logprob: a log-probs backward from saved statistics that are not
 *   of these logits (a max far below the row's) converted exp's exponent,
 *   +inf, to int in the CPU's row pass.
 * - fuzz_softmax: a softmax backward whose y row holds only -inf or NaN:
 *   the CPU's argmax took clang's OpenMP max (started at -FLT_MAX, which
 *   no element equals) for a max and wrote the argmax entry one past the
 *   row. Here the rows' padding holds a sentinel, so a build whose
 *   OpenMP starts a max there (clang's) sees it without a sanitizer; gcc's
 *   starts at -inf and never wrote past; the input is in fuzz_softmax's
 *   corpus too.
 */
#include "support/testing.h"

static void zero_rows(tgroup *g, lmloss_backend be) {
  float x[5] = {0}, loss[1] = {7.0f}, dl[5] = {0};
  int64_t y[1] = {0};
  lmloss_context ctx = lmloss_context_default();
  ctx.backend = be;
  const size_t wsb = lmloss_cross_entropy_workspace_size(0); /* its header: no rows */
  lmloss_ce_inputs in = {{x, LMLOSS_F32, LMLOSS_CPU, 0, 5, 5},
                         {y, LMLOSS_I64, LMLOSS_CPU, 0, 1, 1}};
  for (int r = 0; r < 4; r++) {
    lmloss_ce_options opt = lmloss_ce_options_default();
    opt.reduction = (lmloss_reduction)r;
    opt.num_items = 3.0;
    lmloss_ce_outputs out = {.loss = {loss, LMLOSS_F32, LMLOSS_CPU, r ? 1 : 0, 1, 1}};
    out.dlogits = (lmloss_tensor){dl, LMLOSS_F32, LMLOSS_CPU, 0, 5, 5};
    lmloss_status st = lmloss_cross_entropy(&ctx, &in, &opt, &out, NULL, wsb);
    tg_true(g, st == LMLOSS_OK, "N = 0, reduction %d, no workspace: %s (%s)", r,
            lmloss_status_string(st), lmloss_last_error());
    if (r && st == LMLOSS_OK)
      tg_true(g, loss[0] == 0.0f, "N = 0, reduction %d: loss %g", r, loss[0]);
    lmloss_tensor dloss = {loss, LMLOSS_F32, LMLOSS_CPU, r ? 1 : 0, 1, 1};
    st = lmloss_cross_entropy_backward(&ctx, &in, &opt, &dloss, &out.dlogits, NULL, wsb);
    tg_true(g, st == LMLOSS_OK, "N = 0, reduction %d, backward, no workspace: %s (%s)", r,
            lmloss_status_string(st), lmloss_last_error());
  }
}

/* Statistics saved for other logits: whatever the gradient reads, the
 * call returns OK without undefined behaviour. */
static void foreign_stats(tgroup *g) {
  enum { V = 40 };
  float x[V], dx[V], stats[LMLOSS_ROW_STATS] = {-FLT_MAX, 0.5f, 0.0f, 3.0f}, dlp[1] = {1.0f};
  int64_t idx[1] = {7};
  for (int j = 0; j < V; j++)
    x[j] = (float)(j % 5);
  lmloss_tensor xt = {x, LMLOSS_F32, LMLOSS_CPU, 1, V, V},
                gt = {dx, LMLOSS_F32, LMLOSS_CPU, 1, V, V};
  lmloss_tensor it = {idx, LMLOSS_I64, LMLOSS_CPU, 1, 1, 1},
                dt = {dlp, LMLOSS_F32, LMLOSS_CPU, 1, 1, 1};
  lmloss_tensor stt = {stats, LMLOSS_F32, LMLOSS_CPU, 1, LMLOSS_ROW_STATS, LMLOSS_ROW_STATS};
  lmloss_transform tr = lmloss_transform_default();
  lmloss_context ctx = lmloss_context_default();
  ctx.backend = LMLOSS_BACKEND_CPU;
  for (int t = 0; t < 2; t++) {
    tr.temperature = t ? 0.01f : 1.0f; /* exponents of 3e38 and +inf */
    lmloss_status st = lmloss_log_probs_backward(&ctx, &xt, &it, NULL, &tr, &dt, NULL, &gt, &stt);
    tg_true(g, st == LMLOSS_OK, "foreign statistics, temperature %g: %s (%s)", tr.temperature,
            lmloss_status_string(st), lmloss_last_error());
  }
}

/* y rows of only -inf and only NaN: dx's padding after each row stays. */
static void no_max(tgroup *g) {
  const float sentinel = 123.0f;
  float y[4] = {-INFINITY, 0.0f, NAN, 0.0f}, dy[4] = {1.0f, 0.0f, 1.0f, 0.0f};
  lmloss_tensor yt = {y, LMLOSS_F32, LMLOSS_CPU, 2, 1, 2},
                gt = {dy, LMLOSS_F32, LMLOSS_CPU, 2, 1, 2};
  lmloss_context ctx = lmloss_context_default();
  ctx.backend = LMLOSS_BACKEND_CPU;
  for (int log = 0; log < 2; log++) {
    float dx[4] = {0.0f, sentinel, 0.0f, sentinel};
    lmloss_tensor xt = {dx, LMLOSS_F32, LMLOSS_CPU, 2, 1, 2};
    lmloss_status st = lmloss_softmax_backward(&ctx, &yt, &gt, log, &xt);
    tg_true(g, st == LMLOSS_OK, "log %d: %s (%s)", log, lmloss_status_string(st),
            lmloss_last_error());
    tg_true(g, dx[1] == sentinel && dx[3] == sentinel, "log %d: wrote past a row (%g, %g)", log,
            dx[1], dx[3]);
  }
}

int main(void) {
  tb_init();
  tgroup g;
  tg_begin(&g, "fuzz_ce: N = 0 without a workspace, CPU and REF");
  zero_rows(&g, LMLOSS_BACKEND_CPU);
  zero_rows(&g, LMLOSS_BACKEND_REF);
  tg_end(&g);
  tg_begin(&g, "fuzz_logprob: a backward from statistics of other logits");
  foreign_stats(&g);
  tg_end(&g);
  tg_begin(&g, "fuzz_softmax: a backward whose rows hold no max");
  no_max(&g);
  tg_end(&g);
  return test_finish();
}
