/*
 * test_badinput.c - every public function on bad arguments: the documented
 * status, a non-empty lmloss_last_error(), and outputs left untouched
 * (poisoned before the call, compared byte for byte after).
 *
 * The same bad input gets the same status on every backend: each case runs
 * under LMLOSS_BACKEND_REF and LMLOSS_BACKEND_CPU on host memory and, with
 * LMLOSS_TEST_BACKEND=cuda, under LMLOSS_BACKEND_CUDA on device memory;
 * every backend must give the documented status, and a last group compares
 * the statuses case by case. "Another device" is the other kind of memory
 * than the run's (a flag flipped: the data is never read); "the other
 * backend" is CUDA for host memory and CPU for device memory.
 * Not run on device memory: the index range, which lmloss.h documents as
 * checked on host memory only (a CUDA kernel writes NaN for such a row).
 * Not run under REF: the fused head's workspace checks (REF has no fused
 * head; they come after the backend's choice).
 */
#include "support/testing.h"

enum { B_REF, B_CPU, B_CUDA, NB };
static const char *bname[] = {"REF", "CPU", "CUDA"};
#define MAXCASES 256
#define SKIPPED (-1)

static tgroup g;
static int be, on_dev;
static int seen[NB][MAXCASES], ncase[NB];
static const char *seen_name[NB][MAXCASES];

/* Watched outputs: poisoned host prototypes and the tensors the calls get
 * (copies in the run's memory): loss, dlogits, logp, entropy, dhidden,
 * dweight, dbias. */
enum { W_L, W_D, W_LP, W_E, W_DH, W_DW, W_DB, NW };
static lmloss_tensor proto[NW], cur[NW];

static void record(int st, const char *what) {
  if (ncase[be] < MAXCASES) seen[be][ncase[be]] = st, seen_name[be][ncase[be]] = what;
  ncase[be]++;
}

static int untouched(void) {
  int ok = 1;
  for (int k = 0; k < NW; k++) {
    if (!on_dev) {
      ok &= same_bytes(&cur[k], &proto[k]);
      continue;
    }
    lmloss_tensor h = host_clone(&proto[k]);
    dev_fetch(&h, &cur[k]);
    ok &= same_bytes(&h, &proto[k]);
    host_free(&h);
  }
  return ok;
}

static void expect(lmloss_status got, lmloss_status want, const char *what) {
  const char *msg = lmloss_last_error();
  int same = untouched(), ok = got == want && msg[0] && same;
  tg_true(&g, ok, "%s %s: got %s want %s, message '%s', outputs untouched %d", bname[be], what,
          lmloss_status_string(got), lmloss_status_string(want), msg, same);
  record((int)got, what);
}

static void skip(const char *what) { record(SKIPPED, what); }

/* The tensor in the run's memory (a host copy for REF and CPU). */
static lmloss_tensor put(const lmloss_tensor *h) { return on_dev ? dev_clone(h) : host_clone(h); }
static void drop(lmloss_tensor *t) {
  if (on_dev)
    dev_free(t);
  else
    host_free(t);
}
static void *ws_alloc(size_t n) { return on_dev ? dev_alloc_bytes(n) : malloc(n ? n : 1); }
static void ws_free(void *p) {
  if (on_dev)
    dev_free_bytes(p);
  else
    free(p);
}
/* host value into the run's copy of an index tensor */
static void set_index(lmloss_tensor *t, int64_t i, int64_t j, double v) {
  if (on_dev) return; /* index-range cases run on host memory only */
  tset(t, i, j, v);
}

/* The tensor in the other kind of memory: for a host run, its own memory
 * flagged CUDA (never read: nothing reads device memory on the host); for
 * a device run, a host copy of h (the core may read host indices before it
 * picks the backend). */
static lmloss_tensor pool[64];
static int npool;
static lmloss_tensor away(const lmloss_tensor *t, const lmloss_tensor *h) {
  lmloss_tensor r = *t;
  if (!on_dev) {
    r.device = LMLOSS_CUDA;
    return r;
  }
  if (npool == 64) {
    fprintf(stderr, "FAIL: test_badinput: pool exhausted\n");
    exit(1);
  }
  return pool[npool++] = host_clone(h);
}

static lmloss_tensor hX, hT, hIDX, hS, hDL;
static const int64_t N = 4, V = 17, H = 8;

static const char *group(const char *what) {
  static char name[NB * 4][96];
  static int n;
  char *s = name[n++ % (NB * 4)];
  snprintf(s, sizeof name[0], "bad input: %s (%s)", what, bname[be]);
  return s;
}

static void run_backend(int b) {
  be = b, on_dev = b == B_CUDA;
  lmloss_context ctx = lmloss_context_default(), oth = ctx;
  ctx.backend = b == B_REF   ? LMLOSS_BACKEND_REF
                : b == B_CPU ? LMLOSS_BACKEND_CPU
                             : LMLOSS_BACKEND_CUDA;
  oth.backend = on_dev ? LMLOSS_BACKEND_CPU : LMLOSS_BACKEND_CUDA; /* the other backend */
  const lmloss_device other = on_dev ? LMLOSS_CPU : LMLOSS_CUDA;
  for (int k = 0; k < NW; k++)
    cur[k] = put(&proto[k]);
  const lmloss_tensor L = cur[W_L], D = cur[W_D], LP = cur[W_LP], E = cur[W_E];
  lmloss_tensor X = put(&hX), T = put(&hT), IDX = put(&hIDX), dl = put(&hDL);
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = ws_alloc(wsb);
  lmloss_ce_inputs in = {X, T, {0}, {0}};
  lmloss_ce_options o = lmloss_ce_options_default();
  lmloss_ce_outputs out = {L, {0}, {0}, {0}, D};
  lmloss_transform tr = lmloss_transform_default();

  tg_begin(&g, group("cross-entropy"));
  expect(lmloss_cross_entropy(&ctx, NULL, &o, &out, ws, wsb), LMLOSS_ERR_NULL_POINTER,
         "inputs NULL");
  expect(lmloss_cross_entropy(&ctx, &in, NULL, &out, ws, wsb), LMLOSS_ERR_NULL_POINTER, "opt NULL");
  expect(lmloss_cross_entropy(&ctx, &in, &o, NULL, ws, wsb), LMLOSS_ERR_NULL_POINTER, "out NULL");
  expect(lmloss_cross_entropy(&ctx, &in, &o, &out, NULL, wsb), LMLOSS_ERR_NULL_POINTER, "ws NULL");
  {
    lmloss_ce_inputs bi = in;
    bi.logits.data = NULL;
    expect(lmloss_cross_entropy(&ctx, &bi, &o, &out, ws, wsb), LMLOSS_ERR_NULL_POINTER,
           "logits NULL");
    bi = in, bi.logits.dtype = (lmloss_dtype)42;
    expect(lmloss_cross_entropy(&ctx, &bi, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DTYPE, "dtype 42");
    bi = in, bi.logits.dtype = LMLOSS_I64;
    expect(lmloss_cross_entropy(&ctx, &bi, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DTYPE, "logits I64");
    bi = in, bi.target.dtype = LMLOSS_F32;
    expect(lmloss_cross_entropy(&ctx, &bi, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DTYPE, "target F32");
    bi = in, bi.logits.row_stride = V - 1;
    expect(lmloss_cross_entropy(&ctx, &bi, &o, &out, ws, wsb), LMLOSS_ERR_BAD_STRIDE, "stride < V");
    bi = in, bi.target.device = other;
    expect(lmloss_cross_entropy(&ctx, &bi, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DEVICE,
           "mixed devices");
    if (on_dev) {
      skip("target = V"), skip("target -5");
    } else {
      set_index(&T, 1, 0, V);
      expect(lmloss_cross_entropy(&ctx, &in, &o, &out, ws, wsb), LMLOSS_ERR_INDEX_OUT_OF_RANGE,
             "target = V");
      set_index(&T, 1, 0, -5);
      expect(lmloss_cross_entropy(&ctx, &in, &o, &out, ws, wsb), LMLOSS_ERR_INDEX_OUT_OF_RANGE,
             "target -5");
      set_index(&T, 1, 0, 1);
    }
  }
  expect(lmloss_cross_entropy(&ctx, &in, &o, &out, ws, wsb - 1), LMLOSS_ERR_WORKSPACE_TOO_SMALL,
         "workspace");
  {
    struct {
      const char *n;
      lmloss_ce_options o;
    } bad[11];
    for (int k = 0; k < 11; k++)
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
    bad[9].n = "temperature 1e-45 (1 / T overflows)", bad[9].o.transform.temperature = 1e-45f;
    bad[10].n = "softcap 1e-45 (1 / c overflows)", bad[10].o.transform.softcap = 1e-45f;
    for (int k = 0; k < 11; k++) {
      expect(lmloss_cross_entropy(&ctx, &in, &bad[k].o, &out, ws, wsb), LMLOSS_ERR_BAD_OPTION,
             bad[k].n);
      expect(lmloss_cross_entropy_backward(&ctx, &in, &bad[k].o, &dl, &D, ws, wsb),
             LMLOSS_ERR_BAD_OPTION, bad[k].n);
    }
  }
  {
    lmloss_ce_inputs wi = {away(&X, &hX), away(&T, &hT), {0}, {0}};
    lmloss_ce_outputs wo = {away(&L, &proto[W_L]), {0}, {0}, {0}, away(&D, &proto[W_D])};
    lmloss_tensor wdl = away(&dl, &hDL), wD = away(&D, &proto[W_D]);
    expect(lmloss_cross_entropy(&ctx, &wi, &o, &wo, ws, wsb), LMLOSS_ERR_BAD_DEVICE,
           "memory of another device");
    expect(lmloss_cross_entropy_backward(&ctx, &wi, &o, &wdl, &wD, ws, wsb), LMLOSS_ERR_BAD_DEVICE,
           "bwd memory of another device");
  }
  expect(lmloss_cross_entropy(&oth, &in, &o, &out, ws, wsb), LMLOSS_ERR_BAD_DEVICE,
         "the other backend");
  expect(lmloss_cross_entropy_backward(&ctx, &in, &o, NULL, &D, ws, wsb), LMLOSS_ERR_NULL_POINTER,
         "dloss NULL");
  expect(lmloss_cross_entropy_backward(&ctx, &in, &o, &dl, NULL, ws, wsb), LMLOSS_ERR_NULL_POINTER,
         "dlogits NULL");
  expect(lmloss_cross_entropy_backward(&oth, &in, &o, &dl, &D, ws, wsb), LMLOSS_ERR_BAD_DEVICE,
         "bwd the other backend");
  tg_end(&g);

  tg_begin(&g, group("log-probs, entropy, softmax"));
  expect(lmloss_log_probs(&ctx, NULL, &IDX, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_NULL_POINTER,
         "logits NULL");
  expect(lmloss_log_probs(&ctx, &X, NULL, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_NULL_POINTER,
         "index NULL");
  expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, NULL, &LP, &E, NULL), LMLOSS_ERR_NULL_POINTER,
         "transform NULL");
  expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, NULL, &E, NULL), LMLOSS_ERR_NULL_POINTER,
         "logp NULL");
  {
    lmloss_tensor bt = X;
    bt.dtype = (lmloss_dtype)42;
    expect(lmloss_log_probs(&ctx, &bt, &IDX, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_BAD_DTYPE,
           "dtype 42");
    expect(lmloss_entropy(&ctx, &bt, &tr, &E), LMLOSS_ERR_BAD_DTYPE, "entropy dtype 42");
    expect(lmloss_softmax(&ctx, &bt, 0, &D), LMLOSS_ERR_BAD_DTYPE, "softmax dtype 42");
    bt = X, bt.row_stride = 3;
    expect(lmloss_log_probs(&ctx, &bt, &IDX, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_BAD_STRIDE,
           "stride");
    expect(lmloss_softmax(&ctx, &bt, 1, &D), LMLOSS_ERR_BAD_STRIDE, "softmax stride");
    bt = IDX, bt.cols = V + 1, bt.row_stride = V + 1;
    expect(lmloss_log_probs(&ctx, &X, &bt, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_BAD_SHAPE,
           "K > V");
    if (on_dev) {
      skip("index = V");
    } else {
      set_index(&IDX, 2, 1, V);
      expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &LP, &E, NULL),
             LMLOSS_ERR_INDEX_OUT_OF_RANGE, "index = V");
      set_index(&IDX, 2, 1, 3);
    }
    bt = LP, bt.dtype = LMLOSS_I32;
    expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &bt, &E, NULL), LMLOSS_ERR_BAD_DTYPE,
           "logp I32");
    bt = E, bt.device = other;
    expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &LP, &bt, NULL), LMLOSS_ERR_BAD_DEVICE,
           "mixed devices");
    /* the saved row statistics: F32 [N, LMLOSS_ROW_STATS], V <= 2^24 */
    lmloss_tensor S = put(&hS);
    bt = S, bt.dtype = LMLOSS_F16;
    expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &LP, &E, &bt), LMLOSS_ERR_BAD_DTYPE,
           "stats F16");
    bt = S, bt.cols = 3;
    expect(lmloss_log_probs(&ctx, &X, &IDX, NULL, &tr, &LP, &E, &bt), LMLOSS_ERR_BAD_SHAPE,
           "stats [N, 3]");
    bt = S, bt.rows = X.rows - 1;
    expect(lmloss_log_probs_backward(&ctx, &X, &IDX, NULL, &tr, &LP, NULL, &D, &bt),
           LMLOSS_ERR_BAD_SHAPE, "bwd stats [N - 1, 4]");
    bt = S, bt.row_stride = 2;
    expect(lmloss_log_probs_backward(&ctx, &X, &IDX, NULL, &tr, &LP, NULL, &D, &bt),
           LMLOSS_ERR_BAD_STRIDE, "bwd stats stride 2");
    bt = S, bt.device = other;
    expect(lmloss_log_probs_backward(&ctx, &X, &IDX, NULL, &tr, &LP, NULL, &D, &bt),
           LMLOSS_ERR_BAD_DEVICE, "bwd stats on another device");
    lmloss_tensor wide = X; /* never read: the shape is refused first; in place */
    wide.cols = wide.row_stride = ((int64_t)1 << 24) + 1;
    expect(lmloss_log_probs_backward(&ctx, &wide, &IDX, NULL, &tr, &LP, NULL, &wide, &S),
           LMLOSS_ERR_BAD_SHAPE, "stats with V > 2^24");
    expect(lmloss_log_probs(&ctx, &wide, &IDX, NULL, &tr, &LP, &E, &S), LMLOSS_ERR_BAD_SHAPE,
           "fwd stats with V > 2^24");
    drop(&S);
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
  expect(lmloss_log_probs(&oth, &X, &IDX, NULL, &tr, &LP, &E, NULL), LMLOSS_ERR_BAD_DEVICE,
         "the other backend");
  {
    lmloss_tensor wx = away(&X, &hX), wi = away(&IDX, &hIDX), wlp = away(&LP, &proto[W_LP]);
    lmloss_tensor we = away(&E, &proto[W_E]), wd = away(&D, &proto[W_D]);
    expect(lmloss_log_probs(&ctx, &wx, &wi, NULL, &tr, &wlp, &we, NULL), LMLOSS_ERR_BAD_DEVICE,
           "memory of another device");
    expect(lmloss_softmax(&ctx, &wx, 0, &wd), LMLOSS_ERR_BAD_DEVICE,
           "softmax memory of another device");
  }
  expect(lmloss_entropy(&ctx, &X, &tr, NULL), LMLOSS_ERR_NULL_POINTER, "entropy NULL");
  expect(lmloss_softmax(&ctx, NULL, 0, &D), LMLOSS_ERR_NULL_POINTER, "softmax x NULL");
  expect(lmloss_softmax(&ctx, &X, 2, &D), LMLOSS_ERR_BAD_OPTION, "softmax log 2");
  expect(lmloss_softmax(&oth, &X, 0, &D), LMLOSS_ERR_BAD_DEVICE, "softmax the other backend");
  expect(lmloss_softmax_backward(&ctx, &X, NULL, 0, &D), LMLOSS_ERR_NULL_POINTER, "dy NULL");
  expect(lmloss_softmax_backward(&ctx, &X, &X, 1, NULL), LMLOSS_ERR_NULL_POINTER, "dx NULL");
  tg_end(&g);

  /* the fused linear head: hidden [N, H], weight [V, H], bias [V] */
  tg_begin(&g, group("fused linear head"));
  {
    lmloss_tensor hh = host_new(LMLOSS_F32, N, H, H), hw = host_new(LMLOSS_F32, V, H, H);
    lmloss_tensor hb = host_new(LMLOSS_F32, V, 1, 1), hsc = host_new(LMLOSS_F32, 2, 1, 1);
    fill_logits(&hh, 1.0, NULL, -1), fill_logits(&hw, 0.5, NULL, -1);
    lmloss_head head = {put(&hh), put(&hw), put(&hb)};
    lmloss_head_options ho = lmloss_head_options_default();
    lmloss_head_grads gr = {cur[W_DH], cur[W_DW], cur[W_DB]}, none = {{0}, {0}, {0}};
    lmloss_ce_outputs lo = {L, {0}, {0}, {0}, {0}};
    lmloss_tensor sc = put(&hsc);
    size_t lwsb = 0;
    lmloss_status s = lmloss_linear_workspace_size(&head, &ho, &gr, 3, &lwsb);
    tg_true(&g, s == LMLOSS_OK, "%s workspace size: %s", bname[be], lmloss_status_string(s));
    void *lws = ws_alloc(lwsb);
    expect(lmloss_linear_cross_entropy(&ctx, NULL, &T, NULL, NULL, &o, &ho, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_NULL_POINTER, "head NULL");
    expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, NULL, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_NULL_POINTER, "head options NULL");
    expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, &ho, NULL, &gr, lws, lwsb),
           LMLOSS_ERR_NULL_POINTER, "head outputs NULL");
    lmloss_head bh = head;
    bh.hidden.dtype = (lmloss_dtype)42;
    expect(lmloss_linear_cross_entropy(&ctx, &bh, &T, NULL, NULL, &o, &ho, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_BAD_DTYPE, "hidden dtype 42");
    bh = head, bh.weight.dtype = LMLOSS_BF16;
    expect(lmloss_linear_cross_entropy(&ctx, &bh, &T, NULL, NULL, &o, &ho, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_BAD_DTYPE, "weight BF16 under F32 hidden");
    bh = head, bh.weight.cols = H - 1;
    expect(lmloss_linear_cross_entropy(&ctx, &bh, &T, NULL, NULL, &o, &ho, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_BAD_SHAPE, "weight [V, H - 1]");
    bh = head, bh.bias.data = NULL;
    expect(lmloss_linear_cross_entropy(&ctx, &bh, &T, NULL, NULL, &o, &ho, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_BAD_SHAPE, "dbias without bias");
    lmloss_head_grads bg = gr;
    bg.dweight.dtype = LMLOSS_I32;
    expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, &ho, &lo, &bg, lws, lwsb),
           LMLOSS_ERR_BAD_DTYPE, "dweight I32");
    expect(lmloss_linear_plan(&head, &ho, &gr, 3, NULL), LMLOSS_ERR_NULL_POINTER, "plan NULL");
    bg = gr, bg.accumulate = 2;
    expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, &ho, &lo, &bg, lws, lwsb),
           LMLOSS_ERR_BAD_OPTION, "accumulate 2");
    bh = head, bh.hidden.dtype = bh.weight.dtype = bh.bias.dtype = LMLOSS_BF16;
    bg = gr, bg.dhidden.dtype = bg.dweight.dtype = LMLOSS_BF16, bg.accumulate = 1;
    expect(lmloss_linear_cross_entropy(&ctx, &bh, &T, NULL, NULL, &o, &ho, &lo, &bg, lws, lwsb),
           LMLOSS_ERR_BAD_DTYPE, "accumulate into a BF16 dweight");
    lmloss_head_options bo = ho;
    bo.fp32_accumulate = 2;
    expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, &bo, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_BAD_OPTION, "fp32_accumulate 2");
    lmloss_ce_options bl = o;
    bl.label_smoothing = 1.5f;
    expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &bl, &ho, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_BAD_OPTION, "head label_smoothing 1.5");
    lmloss_ce_outputs bd = lo;
    bd.dlogits = D;
    expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, &ho, &bd, &gr, lws, lwsb),
           LMLOSS_ERR_BAD_SHAPE, "head with dlogits");
    if (on_dev) {
      skip("head target = V");
    } else {
      set_index(&T, 2, 0, V);
      expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, &ho, &lo, &gr, lws, lwsb),
             LMLOSS_ERR_INDEX_OUT_OF_RANGE, "head target = V");
      set_index(&T, 2, 0, 2);
    }
    lmloss_tensor bT = T;
    bT.device = other;
    expect(lmloss_linear_cross_entropy(&ctx, &head, &bT, NULL, NULL, &o, &ho, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_BAD_DEVICE, "head mixed devices");
    {
      lmloss_head wh = {away(&head.hidden, &hh), away(&head.weight, &hw), away(&head.bias, &hb)};
      lmloss_head_grads wg = {away(&gr.dhidden, &proto[W_DH]), away(&gr.dweight, &proto[W_DW]),
                              away(&gr.dbias, &proto[W_DB])};
      lmloss_ce_outputs wo = {away(&L, &proto[W_L]), {0}, {0}, {0}, {0}};
      lmloss_tensor wT = away(&T, &hT);
      expect(lmloss_linear_cross_entropy(&ctx, &wh, &wT, NULL, NULL, &o, &ho, &wo, &wg, lws, lwsb),
             LMLOSS_ERR_BAD_DEVICE, "head memory of another device");
    }
    expect(lmloss_linear_cross_entropy(&oth, &head, &T, NULL, NULL, &o, &ho, &lo, &gr, lws, lwsb),
           LMLOSS_ERR_BAD_DEVICE, "head the other backend");
    expect(lmloss_linear_cross_entropy_backward(&ctx, &head, &T, NULL, NULL, &o, &ho, &dl, &none,
                                                lws, lwsb),
           LMLOSS_ERR_NULL_POINTER, "head bwd no gradient requested");
    expect(lmloss_linear_cross_entropy_backward(&ctx, &head, &T, NULL, NULL, &o, &ho, &sc, &gr, lws,
                                                lwsb),
           LMLOSS_ERR_BAD_SHAPE, "head bwd dloss [2]");
    expect(lmloss_linear_log_probs(&ctx, &head, NULL, NULL, &tr, &ho, &LP, &E, NULL, lws, lwsb),
           LMLOSS_ERR_NULL_POINTER, "head log-probs index NULL");
    lmloss_tensor bi = IDX;
    bi.cols = bi.row_stride = V + 1;
    expect(lmloss_linear_log_probs(&ctx, &head, &bi, NULL, &tr, &ho, &LP, &E, NULL, lws, lwsb),
           LMLOSS_ERR_BAD_SHAPE, "head log-probs K > V");
    expect(lmloss_linear_log_probs(&ctx, &head, &IDX, NULL, &bt, &ho, &LP, &E, NULL, lws, lwsb),
           LMLOSS_ERR_BAD_OPTION, "head log-probs softcap -1");
    expect(lmloss_linear_log_probs_backward(&ctx, &head, &IDX, NULL, &tr, &ho, NULL, NULL, NULL,
                                            &gr, lws, lwsb),
           LMLOSS_ERR_NULL_POINTER, "head log-probs bwd no dlogp/dentropy");
    expect(lmloss_linear_scale_grads(&ctx, &head, &gr, &sc), LMLOSS_ERR_BAD_SHAPE,
           "scale_grads scale [2]");
    expect(lmloss_linear_scale_grads(&ctx, &head, NULL, &sc), LMLOSS_ERR_NULL_POINTER,
           "scale_grads grads NULL");
    expect(lmloss_scale(&ctx, &head.hidden, &sc), LMLOSS_ERR_BAD_SHAPE, "scale by [2]");
    expect(lmloss_scale(&ctx, &head.hidden, NULL), LMLOSS_ERR_NULL_POINTER, "scale NULL");
    expect(lmloss_scale(&ctx, &IDX, &head.hidden), LMLOSS_ERR_BAD_DTYPE, "scale an integer tensor");
    bo = ho, bo.memory_budget = 16;
    expect(lmloss_linear_workspace_size(&head, &bo, &gr, 1, &lwsb), LMLOSS_ERR_WORKSPACE_TOO_SMALL,
           "workspace_size budget 16");
    lmloss_linear_workspace_size(&head, &ho, &gr, 1, &lwsb);
    if (be == B_REF) {
      skip("head workspace NULL"), skip("head workspace 1 byte short");
      skip("head budget 16");
    } else {
      expect(
          lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, &ho, &lo, &gr, NULL, lwsb),
          LMLOSS_ERR_NULL_POINTER, "head workspace NULL");
      expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, &ho, &lo, &gr, lws,
                                         lwsb - 1),
             LMLOSS_ERR_WORKSPACE_TOO_SMALL, "head workspace 1 byte short");
      expect(lmloss_linear_cross_entropy(&ctx, &head, &T, NULL, NULL, &o, &bo, &lo, &gr, lws, lwsb),
             LMLOSS_ERR_WORKSPACE_TOO_SMALL, "head budget 16");
    }
    ws_free(lws);
    drop(&head.hidden), drop(&head.weight), drop(&head.bias), drop(&sc);
    host_free(&hh), host_free(&hw), host_free(&hb), host_free(&hsc);
  }
  tg_end(&g);

  ws_free(ws);
  while (npool > 0)
    host_free(&pool[--npool]);
  drop(&X), drop(&T), drop(&IDX), drop(&dl);
  for (int k = 0; k < NW; k++)
    drop(&cur[k]);
}

int main(void) {
  tb_init();
  hX = host_new(LMLOSS_F32, N, V, V), hT = host_new(LMLOSS_I64, N, 1, 1);
  fill_logits(&hX, 1.0, NULL, -1);
  for (int64_t i = 0; i < N; i++)
    tset(&hT, i, 0, (double)(i % V));
  hIDX = host_new(LMLOSS_I32, N, 2, 2);
  for (int64_t i = 0; i < N; i++)
    tset(&hIDX, i, 0, 1), tset(&hIDX, i, 1, 3);
  hS = host_new(LMLOSS_F32, N, LMLOSS_ROW_STATS, LMLOSS_ROW_STATS);
  hDL = host_new(LMLOSS_F32, 1, 1, 1);
  tset(&hDL, 0, 0, 1.0);
  proto[W_L] = host_new(LMLOSS_F32, 1, 1, 1), proto[W_D] = host_new(LMLOSS_F32, N, V, V);
  proto[W_LP] = host_new(LMLOSS_F32, N, 2, 2), proto[W_E] = host_new(LMLOSS_F32, N, 1, 1);
  proto[W_DH] = host_new(LMLOSS_F32, N, H, H), proto[W_DW] = host_new(LMLOSS_F32, V, H, H);
  proto[W_DB] = host_new(LMLOSS_F32, V, 1, 1);
  for (int k = 0; k < NW; k++)
    host_poison(&proto[k]);

  const int nb = tb_is_cuda() ? 3 : 2;
  for (int b = 0; b < nb; b++)
    run_backend(b);

  /* the same bad input, the same status on every backend */
  be = B_REF;
  tg_begin(&g, "bad input: the same status on every backend");
  for (int b = 1; b < nb; b++)
    tg_true(&g, ncase[b] == ncase[B_REF], "%s ran %d cases, REF %d", bname[b], ncase[b],
            ncase[B_REF]);
  for (int c = 0; c < ncase[B_REF] && c < MAXCASES; c++) {
    int want = SKIPPED, from = -1;
    for (int b = 0; b < nb; b++) {
      if (c >= ncase[b]) continue;
      tg_true(&g, !strcmp(seen_name[b][c], seen_name[B_REF][c]), "case %d: %s is %s under %s", c,
              seen_name[B_REF][c], seen_name[b][c], bname[b]);
      if (seen[b][c] == SKIPPED) continue;
      if (from < 0) {
        want = seen[b][c], from = b;
        continue;
      }
      tg_true(&g, seen[b][c] == want, "%s: %s under %s, %s under %s", seen_name[B_REF][c],
              lmloss_status_string((lmloss_status)want), bname[from],
              lmloss_status_string((lmloss_status)seen[b][c]), bname[b]);
    }
  }
  tg_end(&g);

  host_free(&hX), host_free(&hT), host_free(&hIDX), host_free(&hS), host_free(&hDL);
  for (int k = 0; k < NW; k++)
    host_free(&proto[k]);
  return test_finish();
}
