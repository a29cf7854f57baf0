/*
 * test_badinput.c - every public function on bad arguments: the documented
 * status, a non-empty lmloss_last_error(), and outputs left untouched
 * (poisoned before the call, compared byte for byte after).
 */
#include "support/testing.h"

static tgroup g;
static lmloss_tensor X, T, L, D, LP, IDX, E;
static lmloss_tensor PL, PD, PLP, PE;

static void expect(lmloss_status got, lmloss_status want, const char *what) {
  int ok = got == want && lmloss_last_error()[0];
  ok &= same_bytes(&L, &PL) && same_bytes(&D, &PD) && same_bytes(&LP, &PLP) && same_bytes(&E, &PE);
  tg_true(&g, ok, "%s: got %s want %s, message '%s', outputs untouched %d", what,
          lmloss_status_string(got), lmloss_status_string(want), lmloss_last_error(),
          same_bytes(&L, &PL) && same_bytes(&D, &PD) && same_bytes(&LP, &PLP) &&
              same_bytes(&E, &PE));
}

int main(void) {
  tb_init();
  int64_t N = 4, V = 17;
  lmloss_context ctx = lmloss_context_default();
  ctx.backend = LMLOSS_BACKEND_CPU;
  X = host_new(LMLOSS_F32, N, V, V), T = host_new(LMLOSS_I64, N, 1, 1);
  fill_logits(&X, 1.0, NULL, -1);
  for (int64_t i = 0; i < N; i++)
    tset(&T, i, 0, (double)(i % V));
  IDX = host_new(LMLOSS_I32, N, 2, 2);
  for (int64_t i = 0; i < N; i++)
    tset(&IDX, i, 0, 1), tset(&IDX, i, 1, 3);
  L = host_new(LMLOSS_F32, 1, 1, 1), D = host_new(LMLOSS_F32, N, V, V);
  LP = host_new(LMLOSS_F32, N, 2, 2), E = host_new(LMLOSS_F32, N, 1, 1);
  host_poison(&L), host_poison(&D), host_poison(&LP), host_poison(&E);
  PL = host_clone(&L), PD = host_clone(&D), PLP = host_clone(&LP), PE = host_clone(&E);
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = malloc(wsb);
  lmloss_ce_inputs in = {X, T, {0}, {0}};
  lmloss_ce_options o = lmloss_ce_options_default();
  lmloss_ce_outputs out = {L, {0}, {0}, {0}, D};
  lmloss_tensor dl = host_new(LMLOSS_F32, 1, 1, 1);
  lmloss_transform tr = lmloss_transform_default();

  tg_begin(&g, "bad input: cross-entropy");
  expect(lmloss_cross_entropy(&ctx, NULL, &o, &out, ws, wsb), LMLOSS_ERR_NULL_POINTER,
         "inputs NULL");
  expect(lmloss_cross_entropy(&ctx, &in, NULL, &out, ws, wsb), LMLOSS_ERR_NULL_POINTER, "opt NULL");
  expect(lmloss_cross_entropy(&ctx, &in, &o, NULL, ws, wsb), LMLOSS_ERR_NULL_POINTER, "out NULL");
  expect(lmloss_cross_entropy(&ctx, &in, &o, &out, NULL, wsb), LMLOSS_ERR_NULL_POINTER, "ws NULL");
  {
    lmloss_ce_inputs b = in;
    b.logits.data = NULL;
    expect(lmloss_cross_entropy(&ctx, &b, &o, &out, ws, wsb), LMLOSS_ERR_NULL_POINTER,
           "logits NULL");
    b = in, b.logits.dtype = (lmloss_dtype)42;
    expect(lmloss_cross_entropy(&ctx, &b, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DTYPE, "dtype 42");
    b = in, b.logits.dtype = LMLOSS_I64;
    expect(lmloss_cross_entropy(&ctx, &b, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DTYPE, "logits I64");
    b = in, b.target.dtype = LMLOSS_F32;
    expect(lmloss_cross_entropy(&ctx, &b, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DTYPE, "target F32");
    b = in, b.logits.row_stride = V - 1;
    expect(lmloss_cross_entropy(&ctx, &b, &o, &out, ws, wsb), LMLOSS_ERR_BAD_STRIDE, "stride < V");
    b = in, b.target.device = LMLOSS_CUDA;
    expect(lmloss_cross_entropy(&ctx, &b, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DEVICE,
           "mixed devices");
    tset(&T, 1, 0, V);
    expect(lmloss_cross_entropy(&ctx, &in, &o, &out, ws, wsb), LMLOSS_ERR_INDEX_OUT_OF_RANGE,
           "target = V");
    tset(&T, 1, 0, -5);
    expect(lmloss_cross_entropy(&ctx, &in, &o, &out, ws, wsb), LMLOSS_ERR_INDEX_OUT_OF_RANGE,
           "target -5");
    tset(&T, 1, 0, 1);
  }
  expect(lmloss_cross_entropy(&ctx, &in, &o, &out, ws, wsb - 1), LMLOSS_ERR_WORKSPACE_TOO_SMALL,
         "workspace");
  {
    struct {
      const char *n;
      lmloss_ce_options o;
    } bad[9];
    for (int k = 0; k < 9; k++)
      bad[k].o = o;
    bad[0].n = "temperature 0", bad[0].o.transform.temperature = 0.0f;
    bad[1].n = "temperature NaN", bad[1].o.transform.temperature = NAN;
    bad[2].n = "label_smoothing 1.5", bad[2].o.label_smoothing = 1.5f;
    bad[3].n = "num_items 0", bad[3].o.reduction = LMLOSS_REDUCE_SUM_OVER_ITEMS,
    bad[3].o.num_items = 0;
    bad[4].n = "softcap -1", bad[4].o.transform.softcap = -1.0f;
    bad[5].n = "logit_scale NaN", bad[5].o.transform.logit_scale = NAN;
    bad[6].n = "z_loss -1", bad[6].o.z_loss = -1.0f;
    bad[7].n = "reduction 9", bad[7].o.reduction = (lmloss_reduction)9;
    bad[8].n = "dft 2", bad[8].o.dft = 2;
    for (int k = 0; k < 9; k++) {
      expect(lmloss_cross_entropy(&ctx, &in, &bad[k].o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION,
             bad[k].n);
      expect(lmloss_cross_entropy_backward(&ctx, &in, &bad[k].o, &dl, &D, ws, wsb),
             LMLOSS_ERR_BAD_OPTION, bad[k].n);
    }
  }
  lmloss_context cu = ctx;
  cu.backend = LMLOSS_BACKEND_CUDA;
  expect(lmloss_cross_entropy(&cu, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DEVICE,
         "CUDA on host memory");
  expect(lmloss_cross_entropy_backward(&ctx, &in, &o, NULL, &D, ws, wsb), LMLOSS_ERR_NULL_POINTER,
         "dloss NULL");
  expect(lmloss_cross_entropy_backward(&ctx, &in, &o, &dl, NULL, ws, wsb), LMLOSS_ERR_NULL_POINTER,
         "dlogits NULL");
  expect(lmloss_cross_entropy_backward(&cu, &in, &o, &dl, &D, ws, wsb), LMLOSS_ERR_BAD_DEVICE,
         "bwd CUDA on host");
  tg_end(&g);

  tg_begin(&g, "bad input: log-probs, entropy, softmax");
  expect(lmloss_log_probs(&ctx, NULL, &IDX, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_NULL_POINTER,
         "logits NULL");
  expect(lmloss_log_probs(&ctx, &X, NULL, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_NULL_POINTER,
         "index NULL");
  expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, NULL, &LP, &E, NULL), LMLOSS_ERR_NULL_POINTER,
         "transform NULL");
  expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, NULL, &E, NULL), LMLOSS_ERR_NULL_POINTER,
         "logp NULL");
  {
    lmloss_tensor b = X;
    b.dtype = (lmloss_dtype)42;
    expect(lmloss_log_probs(&ctx, &b, &IDX, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_BAD_DTYPE,
           "dtype 42");
    expect(lmloss_entropy(&ctx, &b, &tr, &E), LMLOSS_ERR_BAD_DTYPE, "entropy dtype 42");
    expect(lmloss_softmax(&ctx, &b, 0, &D), LMLOSS_ERR_BAD_DTYPE, "softmax dtype 42");
    b = X, b.row_stride = 3;
    expect(lmloss_log_probs(&ctx, &b, &IDX, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_BAD_STRIDE,
           "stride");
    expect(lmloss_softmax(&ctx, &b, 1, &D), LMLOSS_ERR_BAD_STRIDE, "softmax stride");
    b = IDX, b.cols = V + 1, b.row_stride = V + 1;
    expect(lmloss_log_probs(&ctx, &X, &b, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_BAD_SHAPE, "K > V");
    tset(&IDX, 2, 1, V);
    expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &LP, &E, NULL),
           LMLOSS_ERR_INDEX_OUT_OF_RANGE, "index = V");
    tset(&IDX, 2, 1, 3);
    b = LP, b.dtype = LMLOSS_I32;
    expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &b, &E, NULL), LMLOSS_ERR_BAD_DTYPE,
           "logp I32");
    b = E, b.device = LMLOSS_CUDA;
    expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &LP, &b, NULL), LMLOSS_ERR_BAD_DEVICE,
           "mixed devices");
    /* the saved row statistics: F32 [N, LMLOSS_ROW_STATS], V <= 2^24 */
    lmloss_tensor S = host_new(LMLOSS_F32, X.rows, LMLOSS_ROW_STATS, LMLOSS_ROW_STATS);
    b = S, b.dtype = LMLOSS_F16;
    expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &LP, &E, &b), LMLOSS_ERR_BAD_DTYPE,
           "stats F16");
    b = S, b.cols = 3;
    expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &LP, &E, &b), LMLOSS_ERR_BAD_SHAPE,
           "stats [N, 3]");
    b = S, b.rows = X.rows - 1;
    expect(lmloss_log_probs_backward(&ctx, &X, &IDX, NULL, &tr, &LP, NULL, &D, &b),
           LMLOSS_ERR_BAD_SHAPE, "bwd stats [N - 1, 4]");
    b = S, b.row_stride = 2;
    expect(lmloss_log_probs_backward(&ctx, &X, &IDX, NULL, &tr, &LP, NULL, &D, &b),
           LMLOSS_ERR_BAD_STRIDE, "bwd stats stride 2");
    b = S, b.device = LMLOSS_CUDA;
    expect(lmloss_log_probs_backward(&ctx, &X, &IDX, NULL, &tr, &LP, NULL, &D, &b),
           LMLOSS_ERR_BAD_DEVICE, "bwd stats on another device");
    lmloss_tensor wide = X; /* never read: the shape is refused first; in place */
    wide.cols = wide.row_stride = ((int64_t)1 << 24) + 1;
    expect(lmloss_log_probs_backward(&ctx, &wide, &IDX, NULL, &tr, &LP, NULL, &wide, &S),
           LMLOSS_ERR_BAD_SHAPE, "stats with V > 2^24");
    expect(lmloss_log_probs(&ctx, &wide, &IDX, NULL, &tr, &LP, &E, &S), LMLOSS_ERR_BAD_SHAPE,
           "fwd stats with V > 2^24");
    host_free(&S);
  }
  lmloss_transform bt = tr;
  bt.temperature = 0.0f;
  expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &bt, &LP, &E, NULL), LMLOSS_ERR_BAD_OPTION,
         "temperature 0");
  expect(lmloss_entropy(&ctx, &X, &bt, &E), LMLOSS_ERR_BAD_OPTION, "entropy temperature 0");
  bt = tr, bt.softcap = -1.0f;
  expect(lmloss_log_probs_backward(&ctx, &X, &IDX, NULL, &bt, &LP, NULL, &D, NULL),
         LMLOSS_ERR_BAD_OPTION, "bwd softcap -1");
  expect(lmloss_log_probs_backward(&ctx, &X, &IDX, NULL, &tr, NULL, NULL, &D, NULL),
         LMLOSS_ERR_NULL_POINTER, "no dlogp/dentropy");
  expect(lmloss_log_probs(&cu, &X, &IDX, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_BAD_DEVICE,
         "CUDA on host");
  expect(lmloss_entropy(&ctx, &X, &tr, NULL), LMLOSS_ERR_NULL_POINTER, "entropy NULL");
  expect(lmloss_softmax(&ctx, NULL, 0, &D), LMLOSS_ERR_NULL_POINTER, "softmax x NULL");
  expect(lmloss_softmax(&ctx, &X, 2, &D), LMLOSS_ERR_BAD_OPTION, "softmax log 2");
  expect(lmloss_softmax(&cu, &X, 0, &D), LMLOSS_ERR_BAD_DEVICE, "softmax CUDA on host");
  expect(lmloss_softmax_backward(&ctx, &X, NULL, 0, &D), LMLOSS_ERR_NULL_POINTER, "dy NULL");
  expect(lmloss_softmax_backward(&ctx, &X, &X, 1, NULL), LMLOSS_ERR_NULL_POINTER, "dx NULL");
  tg_end(&g);
  host_free(&dl);
  free(ws);
  return test_finish();
}
