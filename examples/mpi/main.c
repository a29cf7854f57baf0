/*
 * Cross-entropy over a vocabulary split across MPI ranks (Megatron's
 * layout, uneven shards), with lmloss's public row contract:
 *
 *   1. each rank: lmloss_cross_entropy_state of its columns;
 *   2. one MPI_Allgather of each state's leading
 *      LMLOSS_ROW_STATE_EXCHANGE_COLS floats (16 bytes a row), merged in
 *      rank order with lmloss_row_state_merge, so every rank holds the same
 *      bits;
 *   3. each rank: lmloss_cross_entropy_finish, the whole rows' loss and the
 *      gradient of its own columns.
 *
 * Every rank checks its results against the one-shot call on the whole
 * rows, on rows peaked by up to 1000 at a label that lies on each rank in
 * turn, where a sum of exp all-reduced in fp32 reads a loss of 0. Exits 1
 * when they differ.
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
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  /* Uneven shards: rank r holds [col0, col0 + n) */
  const int64_t col0 = V * rank / world, n = V * (rank + 1) / world - col0;

  float *x = malloc(sizeof(float) * N * V), *g1 = malloc(sizeof(float) * N * V);
  int64_t target[N];
  for (int64_t i = 0; i < N; i++) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < V; j++)
      x[i * V + j] = logit(i, j), mx = fmaxf(mx, x[i * V + j]);
    const int owner = (int)(i % world);
    target[i] = V * owner / world + (i * 7919) % (V / world);
    const float margins[] = {0, 5, 17, 30, 50, 1000};
    x[i * V + target[i]] = mx + margins[i % 6];
  }
  target[7] = -100; /* an ignored row */

  lmloss_context ctx = lmloss_context_default();
  lmloss_ce_options opt = lmloss_ce_options_default();
  opt.reduction = LMLOSS_REDUCE_NONE;
  size_t wsb = lmloss_cross_entropy_workspace_size(N);
  void *ws = malloc(wsb);

  /* the one-shot result on the whole rows, for the check */
  float loss1[N], loss[N];
  lmloss_ce_inputs whole = {view(x, LMLOSS_F32, N, V, V), view(target, LMLOSS_I64, N, 1, 1)};
  lmloss_ce_outputs out1 = {.loss = view(loss1, LMLOSS_F32, N, 1, 1),
                            .dlogits = view(g1, LMLOSS_F32, N, V, V)};
  CHECK(lmloss_cross_entropy(&ctx, &whole, &opt, &out1, ws, wsb));

  /* 1. this rank's state */
  lmloss_ce_inputs in = whole;
  in.logits = view(x + col0, LMLOSS_F32, N, n, V);
  lmloss_shard shard = {col0, V, 0};
  float *state = malloc(sizeof(float) * N * LMLOSS_ROW_STATE_COLS);
  lmloss_tensor st = view(state, LMLOSS_F32, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
  CHECK(lmloss_cross_entropy_state(&ctx, &in, &opt, &shard, &st));

  /* 2. one exchange: the leading columns of every row's state */
  enum { E = LMLOSS_ROW_STATE_EXCHANGE_COLS };
  float *wire = malloc(sizeof(float) * N * E), *all = malloc(sizeof(float) * N * E * world);
  for (int64_t i = 0; i < N; i++)
    memcpy(wire + i * E, state + i * LMLOSS_ROW_STATE_COLS, sizeof(float) * E);
  MPI_Allgather(wire, N * E, MPI_FLOAT, all, N * E, MPI_FLOAT, MPI_COMM_WORLD);
  float *merged = calloc((size_t)N * LMLOSS_ROW_STATE_COLS, sizeof(float));
  float *part = calloc((size_t)N * LMLOSS_ROW_STATE_COLS, sizeof(float));
  lmloss_tensor mt = view(merged, LMLOSS_F32, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
  lmloss_tensor pt = view(part, LMLOSS_F32, N, LMLOSS_ROW_STATE_COLS, LMLOSS_ROW_STATE_COLS);
  for (int r = 0; r < world; r++) {
    float *dst = r == 0 ? merged : part;
    for (int64_t i = 0; i < N; i++)
      memcpy(dst + i * LMLOSS_ROW_STATE_COLS, all + ((int64_t)r * N + i) * E, sizeof(float) * E);
    if (r > 0) CHECK(lmloss_row_state_merge(&ctx, &mt, &pt, &opt.transform, &mt));
  }

  /* 3. the whole rows' loss, this rank's columns of the gradient */
  float *g = malloc(sizeof(float) * N * n);
  lmloss_ce_outputs out = {.loss = view(loss, LMLOSS_F32, N, 1, 1),
                           .dlogits = view(g, LMLOSS_F32, N, n, n)};
  CHECK(lmloss_cross_entropy_finish(&ctx, &in, &opt, &shard, &mt, &out, ws, wsb));

  double worst = 0;
  for (int64_t i = 0; i < N; i++) {
    worst = fmax(worst, fabs(loss[i] - loss1[i]) / fmax(fabs(loss1[i]), 1e-30));
    for (int64_t j = 0; j < n; j++) {
      const double a = g[i * n + j], b = g1[i * V + col0 + j];
      worst = fmax(worst, fabs(a - b) / (fabs(b) + 1e-7));
    }
  }
  double all_worst;
  MPI_Reduce(&worst, &all_worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    printf("vocab-parallel CE over %d ranks, V = %d, %d rows, %d bytes a row exchanged\n", world, V,
           N, (int)(E * sizeof(float)));
    for (int64_t i = 0; i < 6; i++)
      printf("  row %lld (margin %s): loss %.9g, one-shot %.9g\n", (long long)i,
             (const char *[]){"0", "5", "17", "30", "50", "1000"}[i], loss[i], loss1[i]);
    printf("worst relative difference from the one-shot call: %.3g\n", all_worst);
  }
  int bad = rank == 0 && !(all_worst < 1e-4);
  MPI_Bcast(&bad, 1, MPI_INT, 0, MPI_COMM_WORLD);
  free(x), free(g1), free(ws), free(state), free(wire), free(all), free(merged), free(part);
  free(g);
  MPI_Finalize();
  return bad;
}
