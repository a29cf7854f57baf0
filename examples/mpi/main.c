/*
 * Losses over a vocabulary split across MPI ranks (Megatron's layout,
 * uneven shards), with lmloss's public row contract, for each family:
 *
 *   1. each rank: the state of its columns (lmloss_cross_entropy_state,
 *      lmloss_log_probs_state);
 *   2. one MPI_Allgather of each state's leading columns (16 bytes a row,
 *      20 with entropy), merged in rank order with lmloss_row_state_merge,
 *      so every rank holds the same bits;
 *   3. each rank: the finish, the whole rows' outputs and the gradient of
 *      its own columns.
 *
 * A divergence (here the generalized JSD between the rows and a teacher's)
 * takes two exchanges: the two rows' states (32 bytes a row, merged with
 * lmloss_divergence_state_merge), then the per-rank sums of its loss
 * sweep (in double; 16 bytes a row), summed in rank order. Its gradient
 * forms in two halves around the second: lmloss_divergence_partials_grad
 * keeps a quantity a column in the fp32 gradient as it sums, and
 * lmloss_divergence_finish_grad completes it from the student's row alone.
 *
 * The fused head (lmloss_linear_cross_entropy_sharded, the rank's rows of
 * the head's weight) takes one call, which calls back for the exchange.
 *
 * Every rank checks its results against the one-shot calls on the whole
 * rows: cross-entropy, log-probs with entropy (and their backward),
 * softmax (and its backward), the JSD and the fused head's CE (dhidden
 * summed over the ranks), on rows peaked by up to 1000
 * at a label that lies on each rank in turn, where a sum of exp
 * all-reduced in fp32 reads a loss of 0. Exits 1 when they differ.
 */
#include <lmloss.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 48, V = 50257 };

/* A deterministic N(0, 2)-ish logit for (row, column): every rank makes the
 * same rows without communicating. */
static float logit(int64_t i, int64_t j) {
  uint64_t h = (uint64_t)(i * 1000003 + j) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29, h *= 0xBF58476D1CE4E5B9ull, h ^= h >> 32;
  return (float)((double)(h >> 11) / (double)(1ull << 53) * 6.0 - 3.0);
}

static lmloss_tensor view(void *data, lmloss_dtype dt, int64_t rows, int64_t cols, int64_t stride) {
  lmloss_tensor t = {data, dt, LMLOSS_CPU, rows, cols, stride};
  return t;
}

static int rank, world;

/* Every rank's columns [0, cols) of x [N, S] into all [world, N, cols]. */
static float *gather(const float *x, int S, int cols) {
  float *wire = malloc(sizeof(float) * N * cols), *all = malloc(sizeof(float) * N * cols * world);
  for (int64_t i = 0; i < N; i++)
    memcpy(wire + i * cols, x + i * S, sizeof(float) * cols);
  MPI_Allgather(wire, N * cols, MPI_FLOAT, all, N * cols, MPI_FLOAT, MPI_COMM_WORLD);
  free(wire);
  return all;
}

/* Step 2: the leading `cols` columns of every rank's states [N, S] into
 * merged [N, S], the rest 0 (a divergence state's ws_y NaN: no label),
 * merged in rank order: row states (S = LMLOSS_ROW_STATE_COLS) with tr,
 * divergence states (LMLOSS_DIV_STATE_COLS) with dopt. */
static lmloss_status exchange(const float *state, int S, int cols, const lmloss_transform *tr,
                              const lmloss_div_options *dopt, float *merged) {
  float *all = gather(state, S, cols), *part = malloc(sizeof(float) * N * S);
  lmloss_context ctx = lmloss_context_default();
  lmloss_tensor mt = {merged, LMLOSS_F32, LMLOSS_CPU, N, S, S}, pt = mt;
  pt.data = part;
  lmloss_status s = LMLOSS_OK;
  for (int r = 0; r < world && !s; r++) {
    float *dst = r == 0 ? merged : part;
    for (int64_t i = 0; i < N; i++) {
      memset(dst + i * S, 0, sizeof(float) * S);
      if (dopt) dst[i * S + 8] = NAN; /* ws_y */
      memcpy(dst + i * S, all + ((int64_t)r * N + i) * cols, sizeof(float) * cols);
    }
    if (r > 0)
      s = dopt ? lmloss_divergence_state_merge(&ctx, &mt, &pt, dopt, &mt)
               : lmloss_row_state_merge(&ctx, &mt, &pt, tr, &mt);
  }
  free(all), free(part);
  return s;
}

/* The worst relative difference of got [rows, cols] (row stride gs) from
 * ref's columns [c0, c0 + cols) (rs columns a row), each
 * row's difference against the largest magnitude of its whole ref row: a
 * gradient entry that cancels (the entropy's crosses 0) carries the
 * rounding of its row's terms, not of its own size. */
static double worst_of(const float *got, int64_t gs, const float *ref, int64_t rs, int64_t c0,
                       int64_t rows, int64_t cols) {
  double w = 0;
  for (int64_t i = 0; i < rows; i++) {
    double scale = 0, err = 0;
    for (int64_t j = 0; j < rs; j++)
      scale = fmax(scale, fabs(ref[i * rs + j]));
    for (int64_t j = 0; j < cols; j++)
      if (got[i * gs + j] != ref[i * rs + c0 + j])
        err = fmax(err, fabs((double)got[i * gs + j] - ref[i * rs + c0 + j]));
    if (err > 0) w = fmax(w, err / scale);
  }
  return w;
}

/* The fused head's exchange (lmloss_exchange_fn; user: the transform):
 * step 2, inside its call. */
static lmloss_status head_exchange(void *user, const lmloss_tensor *state) {
  float *merged = malloc(sizeof(float) * N * LMLOSS_ROW_STATE_COLS);
  const lmloss_status s = exchange(state->data, LMLOSS_ROW_STATE_COLS,
                                   LMLOSS_ROW_STATE_EXCHANGE_COLS, user, NULL, merged);
  memcpy(state->data, merged, sizeof(float) * N * LMLOSS_ROW_STATE_COLS);
  free(merged);
  return s;
}

#define CHECK(call)                                                                                \
  do {                                                                                             \
    lmloss_status s_ = (call);                                                                     \
    if (s_ != LMLOSS_OK) {                                                                         \
      fprintf(stderr, "%s: %s (%s)\n", #call, lmloss_status_string(s_), lmloss_last_error());      \
      MPI_Abort(MPI_COMM_WORLD, 2);                                                                \
    }                                                                                              \
  } while (0)

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  /* Uneven shards: rank r holds [col0, col0 + n) */
  const int64_t col0 = V * rank / world, n = V * (rank + 1) / world - col0;

  float *x = malloc(sizeof(float) * N * V), *g1 = malloc(sizeof(float) * N * V);
  float *g = malloc(sizeof(float) * N * n);
  int64_t target[N], index[N];
  for (int64_t i = 0; i < N; i++) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < V; j++)
      x[i * V + j] = logit(i, j), mx = fmaxf(mx, x[i * V + j]);
    const int owner = (int)(i % world);
    target[i] = index[i] = V * owner / world + (i * 7919) % (V / world);
    const float margins[] = {0, 5, 17, 30, 50, 1000};
    x[i * V + target[i]] = mx + margins[i % 6];
  }
  target[7] = -100; /* an ignored row */

  lmloss_context ctx = lmloss_context_default();
  const lmloss_transform tr = lmloss_transform_default();
  const lmloss_tensor whole = view(x, LMLOSS_F32, N, V, V),
                      shard_x = view(x + col0, LMLOSS_F32, N, n, V);
  float *state = malloc(sizeof(float) * N * LMLOSS_ROW_STATE_COLS);
  float *merged = malloc(sizeof(float) * N * LMLOSS_ROW_STATE_COLS);
  const lmloss_tensor st = view(state, LMLOSS_F32, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
  const lmloss_tensor mt =
      view(merged, LMLOSS_F32, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
  double worst[5] = {0, 0, 0, 0, 0}; /* CE, log-probs, softmax, JSD, the fused head */

  /* Cross-entropy: the loss of every row, the gradient of this rank's columns */
  lmloss_ce_options opt = lmloss_ce_options_default();
  opt.reduction = LMLOSS_REDUCE_NONE;
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = malloc(wsb);
  float loss1[N], loss[N];
  lmloss_ce_inputs in = {whole, view(target, LMLOSS_I64, N, 1, 1)};
  lmloss_ce_outputs out1 = {.loss = view(loss1, LMLOSS_F32, N, 1, 1),
                            .dlogits = view(g1, LMLOSS_F32, N, V, V)};
  CHECK(lmloss_cross_entropy(&ctx, &in, &opt, &out1, ws, wsb));
  in.logits = shard_x;
  lmloss_shard shard = {col0, V, 0};
  CHECK(lmloss_cross_entropy_state(&ctx, &in, &opt, &shard, &st));
  CHECK(exchange(state, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_EXCHANGE_COLS, &opt.transform, NULL,
                 merged));
  lmloss_ce_outputs out = {.loss = view(loss, LMLOSS_F32, N, 1, 1),
                           .dlogits = view(g, LMLOSS_F32, N, n, n)};
  CHECK(lmloss_cross_entropy_finish(&ctx, &in, &opt, &shard, &mt, &out, ws, wsb));
  worst[0] = fmax(worst_of(loss, 1, loss1, 1, 0, N, 1), worst_of(g, n, g1, V, col0, N, n));

  /* Log-probs of the index and entropy, and their backward from dlogp = dH = 1 */
  float lp1[N], lp[N], h1[N], h[N], ones[N];
  for (int64_t i = 0; i < N; i++)
    ones[i] = 1.0f;
  const lmloss_tensor idx = view(index, LMLOSS_I64, N, 1, 1), one = view(ones, LMLOSS_F32, N, 1, 1);
  const lmloss_tensor lpt = view(lp, LMLOSS_F32, N, 1, 1), ht = view(h, LMLOSS_F32, N, 1, 1);
  const lmloss_tensor lp1t = view(lp1, LMLOSS_F32, N, 1, 1), h1t = view(h1, LMLOSS_F32, N, 1, 1);
  const lmloss_tensor g1t = view(g1, LMLOSS_F32, N, V, V), gt = view(g, LMLOSS_F32, N, n, n);
  CHECK(lmloss_log_probs(&ctx, &whole, &idx, NULL, &tr, &lp1t, &h1t, NULL));
  CHECK(lmloss_log_probs_backward(&ctx, &whole, &idx, NULL, &tr, &one, &one, &g1t, NULL));
  shard.entropy = 1;
  CHECK(lmloss_log_probs_state(&ctx, &shard_x, &idx, NULL, &tr, &shard, &st));
  CHECK(exchange(state, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_EXCHANGE_COLS_ENTROPY, &tr, NULL,
                 merged));
  CHECK(lmloss_log_probs_finish(&ctx, &shard_x, &idx, NULL, &tr, &shard, &mt, &lpt, &ht));
  CHECK(lmloss_log_probs_backward_finish(&ctx, &shard_x, &idx, NULL, &tr, &shard, &mt, &one, &one,
                                         &gt));
  worst[1] = fmax(fmax(worst_of(lp, 1, lp1, 1, 0, N, 1), worst_of(h, 1, h1, 1, 0, N, 1)),
                  worst_of(g, n, g1, V, col0, N, n));

  /* Softmax of this rank's columns */
  shard.entropy = 0;
  CHECK(lmloss_softmax(&ctx, &whole, 0, &g1t));
  CHECK(lmloss_log_probs_state(&ctx, &shard_x, NULL, NULL, &tr, &shard, &st));
  CHECK(exchange(state, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_EXCHANGE_COLS, &tr, NULL, merged));
  CHECK(lmloss_softmax_finish(&ctx, &shard_x, &shard, &mt, 0, &gt));
  worst[2] = worst_of(g, n, g1, V, col0, N, n);
  /* ... and its backward, the logits themselves the upstream dy: dy at
   * the merged state's argmax (column 2) from the rank holding it, then
   * the partial sums of the other columns, each summed over the ranks */
  float *dx1 = malloc(sizeof(float) * N * V), *dx = malloc(sizeof(float) * N * n), dy_a[N];
  double part[N];
  const lmloss_tensor dyat = view(dy_a, LMLOSS_F32, N, 1, 1), pt = view(part, LMLOSS_F64, N, 1, 1);
  const lmloss_tensor dx1t = view(dx1, LMLOSS_F32, N, V, V), dxt = view(dx, LMLOSS_F32, N, n, n);
  CHECK(lmloss_softmax_backward(&ctx, &g1t, &whole, 0, &dx1t));
  for (int64_t i = 0; i < N; i++) {
    const int64_t a = (int64_t)merged[i * LMLOSS_ROW_STATE_COLS + 2] - col0;
    dy_a[i] = a >= 0 && a < n ? x[i * V + col0 + a] : 0.0f;
  }
  MPI_Allreduce(MPI_IN_PLACE, dy_a, N, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(lmloss_softmax_backward_partials(&ctx, &gt, &shard_x, 0, &shard, &mt, &dyat, &pt));
  MPI_Allreduce(MPI_IN_PLACE, part, N, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  CHECK(lmloss_softmax_backward_finish(&ctx, &gt, &shard_x, 0, &shard, &mt, &dyat, &pt, &dxt));
  worst[2] = fmax(worst[2], worst_of(dx, n, dx1, V, col0, N, n));
  free(dx1), free(dx);

  /* The generalized JSD (beta 0.5) from a teacher near the student (row 0:
   * the student itself, exactly 0), per-row losses and this rank's
   * columns of the student's gradient */
  enum { DS = LMLOSS_DIV_STATE_COLS, DP = LMLOSS_DIV_PARTIAL_COLS };
  float *t = malloc(sizeof(float) * N * V), *dstate = malloc(sizeof(float) * N * DS);
  float *dmerged = malloc(sizeof(float) * N * DS);
  double *partials = malloc(sizeof(double) * N * DP), *wire = malloc(sizeof(double) * N * 2);
  double *sums = malloc(sizeof(double) * N * 2 * world);
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < V; j++)
      t[i * V + j] = x[i * V + j] + (i == 0 ? 0.0f : 0.3f * logit(i + N, j));
  lmloss_div_options dopt = lmloss_div_options_default();
  dopt.kind = LMLOSS_DIV_JSD, dopt.beta = 0.5f, dopt.reduction = LMLOSS_REDUCE_NONE;
  lmloss_div_inputs din = {whole, view(t, LMLOSS_F32, N, V, V), view(target, LMLOSS_I64, N, 1, 1)};
  lmloss_div_outputs dout1 = {.loss = view(loss1, LMLOSS_F32, N, 1, 1), .dstudent = g1t};
  CHECK(lmloss_divergence(&ctx, &din, &dopt, &dout1, ws, wsb));
  din.student = shard_x, din.teacher = view(t + col0, LMLOSS_F32, N, n, V);
  const lmloss_tensor dst = view(dstate, LMLOSS_F32, N, DS, DS),
                      dmt = view(dmerged, LMLOSS_F32, N, DS, DS),
                      pat = view(partials, LMLOSS_F64, N, DP, DP);
  CHECK(lmloss_divergence_state(&ctx, &din, &dopt, &shard, &dst));
  CHECK(exchange(dstate, DS, LMLOSS_DIV_STATE_EXCHANGE_COLS, NULL, &dopt, dmerged));
  CHECK(lmloss_divergence_partials_grad(&ctx, &din, &dopt, &shard, &dmt, &pat, &gt, ws, wsb));
  /* the JSD reads the partials' div [0] and mix [2]: sent, then summed in rank order */
  for (int64_t i = 0; i < N; i++)
    wire[2 * i] = partials[i * DP], wire[2 * i + 1] = partials[i * DP + 2];
  MPI_Allgather(wire, 2 * N, MPI_DOUBLE, sums, 2 * N, MPI_DOUBLE, MPI_COMM_WORLD);
  memset(partials, 0, sizeof(double) * N * DP);
  for (int r = 0; r < world; r++)
    for (int64_t i = 0; i < N; i++) {
      partials[i * DP] += sums[((int64_t)r * N + i) * 2];
      partials[i * DP + 2] += sums[((int64_t)r * N + i) * 2 + 1];
    }
  lmloss_div_outputs dout = {.loss = view(loss, LMLOSS_F32, N, 1, 1)};
  CHECK(lmloss_divergence_finish(&ctx, &din, &dopt, &shard, &dmt, &pat, &dout, ws, wsb));
  CHECK(lmloss_divergence_finish_grad(&ctx, &din, &dopt, &shard, &dmt, &pat, &gt, ws, wsb));
  worst[3] = fmax(worst_of(loss, 1, loss1, 1, 0, N, 1), worst_of(g, n, g1, V, col0, N, n));
  int exact = loss[0] == 0.0f;
  for (int64_t j = 0; j < n; j++)
    exact &= g[j] == 0.0f;
  worst[3] = exact ? worst[3] : INFINITY;
  free(t), free(dstate), free(dmerged), free(partials), free(wire), free(sums);

  /* The fused head's CE (mean): hidden [N, HD] the same on every rank, the
   * rank's rows of W [V, HD]; one call, whose exchange is step 2 above;
   * dhidden summed over the ranks */
  enum { HD = 32 };
  float *hid = malloc(sizeof(float) * N * HD), *w = malloc(sizeof(float) * V * HD);
  float *dh1 = malloc(sizeof(float) * N * HD), *dh = malloc(sizeof(float) * N * HD);
  float *dw1 = malloc(sizeof(float) * V * HD), *dw = malloc(sizeof(float) * n * HD), hl1, hl;
  for (int64_t i = 0; i < N * HD; i++)
    hid[i] = logit(i, -1) / 2;
  for (int64_t j = 0; j < V * HD; j++)
    w[j] = logit(-1, j) / 2;
  const lmloss_head head1 = {view(hid, LMLOSS_F32, N, HD, HD), view(w, LMLOSS_F32, V, HD, HD)},
                    head = {head1.hidden, view(w + col0 * HD, LMLOSS_F32, n, HD, HD)};
  const lmloss_head_grads hg1 = {view(dh1, LMLOSS_F32, N, HD, HD),
                                 view(dw1, LMLOSS_F32, V, HD, HD)},
                          hg = {view(dh, LMLOSS_F32, N, HD, HD), view(dw, LMLOSS_F32, n, HD, HD)};
  const lmloss_head_options ho = lmloss_head_options_default();
  const lmloss_tensor tgt = view(target, LMLOSS_I64, N, 1, 1);
  lmloss_ce_outputs ho1 = {.loss = view(&hl1, LMLOSS_F32, 1, 1, 1)}, hout = ho1;
  hout.loss.data = &hl;
  opt.reduction = LMLOSS_REDUCE_MEAN, shard.entropy = 0;
  size_t hb1, hb;
  CHECK(lmloss_linear_workspace_size(&head1, &ho, &hg1, 1, &hb1));
  CHECK(lmloss_linear_workspace_size(&head, &ho, &hg, 1, &hb));
  void *hws = malloc(hb1 > hb ? hb1 : hb);
  CHECK(
      lmloss_linear_cross_entropy(&ctx, &head1, &tgt, NULL, NULL, &opt, &ho, &ho1, &hg1, hws, hb1));
  CHECK(lmloss_linear_cross_entropy_sharded(&ctx, &head, &tgt, NULL, NULL, &opt, &ho, &shard,
                                            head_exchange, &opt.transform, &st, &hout, &hg, hws,
                                            hb));
  MPI_Allreduce(MPI_IN_PLACE, dh, N * HD, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  worst[4] = fmax(fmax(worst_of(&hl, 1, &hl1, 1, 0, 1, 1), worst_of(dh, HD, dh1, HD, 0, N, HD)),
                  worst_of(dw, HD, dw1 + col0 * HD, HD, 0, n, HD));
  free(hid), free(w), free(dh1), free(dh), free(dw1), free(dw), free(hws);

  double all_worst[5];
  MPI_Reduce(worst, all_worst, 5, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  int bad = 0;
  if (rank == 0) {
    printf("vocab-parallel over %d ranks, V = %d, %d rows, one exchange of 16 (CE, softmax) or "
           "20 (log-probs + entropy) bytes a row; the softmax backward two, of 4 and 8; the JSD "
           "two, of 32 and 16; the fused head one, of 16, inside its call\n",
           world, V, N);
    for (int64_t i = 0; i < 6; i++)
      printf("  CE row %lld (margin %s): loss %.9g, one-shot %.9g\n", (long long)i,
             (const char *[]){"0", "5", "17", "30", "50", "1000"}[i], loss[i], loss1[i]);
    const char *names[] = {"CE", "log-probs + entropy", "softmax and its backward",
                           "JSD (beta 0.5)", "the fused head's CE, dhidden and dweight"};
    for (int f = 0; f < 5; f++) {
      printf("%s: worst relative difference from the one-shot call %.3g\n", names[f], all_worst[f]);
      bad |= !(all_worst[f] < 1e-5);
    }
  }
  MPI_Bcast(&bad, 1, MPI_INT, 0, MPI_COMM_WORLD);
  free(x), free(g1), free(g), free(ws), free(state), free(merged);
  MPI_Finalize();
  return bad;
}
