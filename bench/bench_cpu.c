/*
 * bench_cpu.c - CPU figures for BENCHMARKS.md, measured side by side in one
 * run: the machine's limit pass (read every logit once and take a
 * vectorized exp of each, glibc's libmvec), then lmloss's log-prob forward
 * (K = 1) and cross-entropy forward+backward (fused, separate dlogits), at
 * each shape and thread count. Median of repeated runs.
 *
 * Then the fused linear head (fp32, N = 1024, H = 1024, V = 32768): CE
 * forward+backward producing dhidden and dW, against the same three
 * OpenBLAS GEMMs alone (logits, dhidden, dW) on materialized logits.
 *
 *   bench_cpu [N V]...      default: 4096 32768 and 1024 151936
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "lmloss.h"

#define REPS 7

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The limit: one read of each logit and one vectorized exp (glibc's
 * libmvec, one clone per ISA like the library's passes). */
__attribute__((target_clones("avx512f", "avx2,fma", "default"))) static float limit_pass(const float *x, int64_t N, int64_t V, int nt) {
  float total = 0.0f;
#pragma omp parallel for num_threads(nt) reduction(+ : total)
  for (int64_t i = 0; i < N; i++) {
    const float *r = x + i * V;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < V; j++)
      s += expf(r[j]);
    total += s;
  }
  return total;
}

typedef struct {
  float *x, *g, *loss;
  int64_t *y;
  int64_t N, V;
  void *ws;
  size_t wsb;
  int nt;
} bench_case;

static void check(lmloss_status s) {
  if (s != LMLOSS_OK) {
    fprintf(stderr, "lmloss: %s: %s\n", lmloss_status_string(s), lmloss_last_error());
    exit(1);
  }
}

static double time_op(bench_case *b, int op) {
  double t[REPS];
  lmloss_context ctx = lmloss_context_default();
  ctx.backend = LMLOSS_BACKEND_CPU;
  ctx.num_threads = b->nt;
  lmloss_tensor logits = {b->x, LMLOSS_F32, LMLOSS_CPU, b->N, b->V, b->V};
  lmloss_tensor idx = {b->y, LMLOSS_I64, LMLOSS_CPU, b->N, 1, 1};
  lmloss_tensor out = {b->loss, LMLOSS_F32, LMLOSS_CPU, b->N, 1, 1};
  lmloss_transform tr = lmloss_transform_default();
  lmloss_ce_options opt = lmloss_ce_options_default();
  lmloss_ce_inputs in = {logits, idx, {0}, {0}};
  lmloss_ce_outputs ceo = {{b->loss, LMLOSS_F32, LMLOSS_CPU, 1, 1, 1}};
  ceo.dlogits = (lmloss_tensor){b->g, LMLOSS_F32, LMLOSS_CPU, b->N, b->V, b->V};
  volatile float sink = 0.0f;
  for (int r = -1; r < REPS; r++) {
    double t0 = now();
    if (op == 0) sink += limit_pass(b->x, b->N, b->V, b->nt);
    if (op == 1) check(lmloss_log_probs(&ctx, &logits, &idx, NULL, &tr, &out, NULL));
    if (op == 2) check(lmloss_cross_entropy(&ctx, &in, &opt, &ceo, b->ws, b->wsb));
    if (r >= 0) t[r] = now() - t0;
  }
  (void)sink;
  qsort(t, REPS, sizeof t[0], cmp);
  return t[REPS / 2];
}

static float *random_floats(size_t n, float scale) {
  float *p = malloc(n * sizeof(float));
  if (!p) exit(1);
  for (size_t i = 0; i < n; i++) p[i] = scale * (2.0f * ((float)rand() / RAND_MAX) - 1.0f);
  return p;
}

static double median(double *t, int n) {
  qsort(t, n, sizeof t[0], cmp);
  return t[n / 2];
}

/* Fused-head CE fwd+bwd vs its three GEMMs alone, in one run. */
static void bench_fused_head(int64_t N, int64_t H, int64_t V) {
  float *h = random_floats((size_t)(N * H), 1.0f), *W = random_floats((size_t)(V * H), 0.05f);
  float *dh = malloc((size_t)(N * H) * 4), *dW = malloc((size_t)(V * H) * 4);
  float *logits = malloc((size_t)(N * V) * 4), loss;
  int64_t *y = malloc((size_t)N * 8);
  for (int64_t i = 0; i < N; i++) y[i] = rand() % V;
  lmloss_head head = {{h, LMLOSS_F32, LMLOSS_CPU, N, H, H}, {W, LMLOSS_F32, LMLOSS_CPU, V, H, H}};
  lmloss_head_grads g = {{dh, LMLOSS_F32, LMLOSS_CPU, N, H, H}, {dW, LMLOSS_F32, LMLOSS_CPU, V, H, H}};
  lmloss_head_options ho = lmloss_head_options_default();
  lmloss_ce_options opt = lmloss_ce_options_default();
  lmloss_ce_outputs out = {{&loss, LMLOSS_F32, LMLOSS_CPU, 1, 1, 1}};
  lmloss_tensor tgt = {y, LMLOSS_I64, LMLOSS_CPU, N, 1, 1};
  size_t wsb;
  check(lmloss_linear_workspace_size(&head, &ho, &g, 1, &wsb));
  void *ws = malloc(wsb);
  double tg[REPS], tf[REPS];
  for (int r = -1; r < REPS; r++) {
    double t0 = now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, H, 1.0f, h, H, W, H, 0.0f, logits, V);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, H, V, 1.0f, logits, V, W, H, 0.0f, dh, H);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, H, N, 1.0f, logits, V, h, H, 0.0f, dW, H);
    double t1 = now();
    check(lmloss_linear_cross_entropy(NULL, &head, &tgt, NULL, NULL, &opt, &ho, &out, &g, ws, wsb));
    double t2 = now();
    if (r >= 0) tg[r] = t1 - t0, tf[r] = t2 - t1;
  }
  double gemm = median(tg, REPS), fused = median(tf, REPS);
  printf("\nfused head CE fwd+bwd (dhidden, dW), fp32, N=%lld H=%lld V=%lld, OpenBLAS threads "
         "default\n", (long long)N, (long long)H, (long long)V);
  printf("  3 GEMMs alone %.1f ms | lmloss fused %.1f ms | ratio %.3f | workspace %.1f MiB "
         "(materialized fp32 logits: %.1f MiB)\n",
         gemm * 1e3, fused * 1e3, fused / gemm, wsb / 1048576.0, N * V * 4 / 1048576.0);
  free(h), free(W), free(dh), free(dW), free(logits), free(y), free(ws);
}

int main(int argc, char **argv) {
  int64_t shapes[8][2] = {{4096, 32768}, {1024, 151936}};
  int ns = 2;
  if (argc >= 3) {
    ns = 0;
    for (int a = 1; a + 1 < argc && ns < 8; a += 2, ns++) {
      shapes[ns][0] = atoll(argv[a]);
      shapes[ns][1] = atoll(argv[a + 1]);
    }
  }
  printf("lmloss CPU benchmark, isa %s, %d hardware threads, fp32, median of %d\n",
         lmloss_cpu_isa(), omp_get_num_procs(), REPS);
  printf("%-14s %3s %10s %12s %9s %12s %9s\n", "shape", "thr", "limit ms", "logprob ms", "x limit",
         "ce f+b ms", "x limit");
  for (int s = 0; s < ns; s++) {
    bench_case b = {0};
    b.N = shapes[s][0];
    b.V = shapes[s][1];
    size_t n = (size_t)(b.N * b.V);
    b.x = malloc(n * sizeof(float));
    b.g = malloc(n * sizeof(float));
    b.y = malloc((size_t)b.N * sizeof(int64_t));
    b.loss = malloc((size_t)b.N * sizeof(float));
    b.wsb = lmloss_cross_entropy_workspace_size(b.N);
    b.ws = malloc(b.wsb);
    if (!b.x || !b.g || !b.y || !b.loss || !b.ws) return 1;
    srand(7);
    for (size_t i = 0; i < n; i++)
      b.x[i] = 4.0f * ((float)rand() / RAND_MAX) - 2.0f;
    for (int64_t i = 0; i < b.N; i++)
      b.y[i] = rand() % b.V;
    memset(b.g, 0, n * sizeof(float));
    for (int nt = 1; nt <= 2; nt++) {
      b.nt = nt;
      double lim = time_op(&b, 0), lp = time_op(&b, 1), ce = time_op(&b, 2);
      char shape[32];
      snprintf(shape, sizeof shape, "%lldx%lld", (long long)b.N, (long long)b.V);
      printf("%-14s %3d %10.2f %12.2f %9.2f %12.2f %9.2f\n", shape, nt, lim * 1e3, lp * 1e3,
             lp / lim, ce * 1e3, ce / lim);
      fflush(stdout);
    }
    free(b.x), free(b.g), free(b.y), free(b.loss), free(b.ws);
  }
  bench_fused_head(1024, 1024, 32768);
  return 0;
}
