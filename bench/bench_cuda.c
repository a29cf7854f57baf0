/*
 * bench_cuda.c - CUDA figures as fractions of the measured copy bandwidth,
 * in one run on one GPU: a device-to-device copy of a logits-sized buffer
 * (bytes read + written), then each case timed with CUDA events (warm-up,
 * median of REPS runs, random non-zero inputs). Bytes counted at the
 * minimum: one read of the logits for the forwards, read + write for the
 * gradients and softmax. Before timing, each kernel's first rows (one of
 * them peaked: the target leads by 30) are checked against the float64
 * REF backend on the host, so a wrong kernel is never timed.
 *
 *   bench_cuda [--csv]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "lmloss.h"

#define REPS 25
#define WARM 3
#define CHECK_ROWS 4

static void cuda_ok(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "CUDA %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
  }
}

static void lm_ok(lmloss_status s, const char *what) {
  if (s != LMLOSS_OK) {
    fprintf(stderr, "%s: %s: %s\n", what, lmloss_status_string(s), lmloss_last_error());
    exit(1);
  }
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* xorshift64*, in (0, 1) */
  rng ^= rng >> 12;
  rng ^= rng << 25;
  rng ^= rng >> 27;
  return ((rng * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0) + 1e-17;
}

static uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static lmloss_tensor tens(void *p, lmloss_dtype d, lmloss_device dev, int64_t r, int64_t c) {
  lmloss_tensor t = {p, d, dev, r, c, c};
  return t;
}

/* Random logits N x V (dtype BF16 or F32) on the device: a block of
 * distinct random rows made on the host, copied over the whole tensor.
 * Row 0 is peaked at its target (+30 over the rest). */
#define BLOCK_ROWS 64
static void fill_logits(void *dev, lmloss_dtype dt, int64_t N, int64_t V, const int64_t *tgt,
                        float *host_f32 /* BLOCK_ROWS x V out */) {
  size_t es = dt == LMLOSS_F32 ? 4 : 2;
  int64_t br = N < BLOCK_ROWS ? N : BLOCK_ROWS;
  void *blk = malloc((size_t)br * V * es);
  for (int64_t i = 0; i < br; i++)
    for (int64_t j = 0; j < V; j++) {
      float x = (float)(4.0 * (urand() - 0.5) + 0.25);
      if (i == 0 && j == tgt[0]) x = 32.0f;
      if (dt == LMLOSS_F32)
        ((float *)blk)[i * V + j] = x;
      else
        ((uint16_t *)blk)[i * V + j] = f32_to_bf16(x);
      host_f32[i * V + j] = dt == LMLOSS_F32 ? x : bf16_to_f32(f32_to_bf16(x));
    }
  for (int64_t r = 0; r < N; r += br) {
    int64_t n = N - r < br ? N - r : br;
    cuda_ok(cudaMemcpy((char *)dev + (size_t)r * V * es, blk, (size_t)n * V * es,
                       cudaMemcpyHostToDevice),
            "fill");
  }
  free(blk);
}

static int cmpf(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}

typedef struct {
  const char *name;
  int64_t N, V;
  double bytes; /* minimum traffic */
  float ms;
  double gbs, frac;
} result;

typedef struct {
  int kind; /* 0 lp, 1 lp+ent, 2 ce fused, 3 lp bwd, 4 softmax */
  lmloss_dtype dt;
  int64_t N, V;
  void *x[2];
  int nbuf;
  void *out; /* dlogits / softmax out */
  int64_t *idx;
  float *logp, *ent, *dlogp, *loss;
  void *ws;
  size_t wsb;
} bench_case;

static void run_case(bench_case *c, int b) {
  lmloss_context ctx = lmloss_context_default();
  lmloss_transform tr = lmloss_transform_default();
  lmloss_tensor x = tens(c->x[b], c->dt, LMLOSS_CUDA, c->N, c->V);
  lmloss_tensor idx = tens(c->idx, LMLOSS_I64, LMLOSS_CUDA, c->N, 1);
  lmloss_tensor logp = tens(c->logp, LMLOSS_F32, LMLOSS_CUDA, c->N, 1);
  lmloss_tensor ent = tens(c->ent, LMLOSS_F32, LMLOSS_CUDA, c->N, 1);
  lmloss_tensor none = tens(NULL, LMLOSS_F32, LMLOSS_CUDA, 0, 0);
  lmloss_tensor out = tens(c->out, c->dt, LMLOSS_CUDA, c->N, c->V);
  switch (c->kind) {
  case 0: lm_ok(lmloss_log_probs(&ctx, &x, &idx, NULL, &tr, &logp, &none), "log_probs"); break;
  case 1: lm_ok(lmloss_log_probs(&ctx, &x, &idx, NULL, &tr, &logp, &ent), "log_probs+H"); break;
  case 2: {
    lmloss_ce_inputs in = {x, idx, none, none};
    lmloss_ce_options o = lmloss_ce_options_default();
    lmloss_ce_outputs co = {tens(c->loss, LMLOSS_F32, LMLOSS_CUDA, 1, 1), none, none, none, out};
    co.argmax.dtype = LMLOSS_I64;
    lm_ok(lmloss_cross_entropy(&ctx, &in, &o, &co, c->ws, c->wsb), "cross_entropy");
    break;
  }
  case 3: {
    lmloss_tensor dl = tens(c->dlogp, LMLOSS_F32, LMLOSS_CUDA, c->N, 1);
    lm_ok(lmloss_log_probs_backward(&ctx, &x, &idx, NULL, &tr, &dl, &none, &out), "lp bwd");
    break;
  }
  case 4: lm_ok(lmloss_softmax(&ctx, &x, 0, &out), "softmax"); break;
  }
}

/* Check the first CHECK_ROWS rows against REF on the host. */
static int check_case(bench_case *c, const float *hx, const int64_t *ht) {
  int64_t R = CHECK_ROWS, V = c->V;
  size_t es = c->dt == LMLOSS_F32 ? 4 : 2;
  lmloss_context ref = lmloss_context_default();
  ref.backend = LMLOSS_BACKEND_REF;
  lmloss_transform tr = lmloss_transform_default();
  lmloss_tensor x = tens((void *)hx, LMLOSS_F32, LMLOSS_CPU, R, V);
  lmloss_tensor idx = tens((void *)ht, LMLOSS_I64, LMLOSS_CPU, R, 1);
  lmloss_tensor none = tens(NULL, LMLOSS_F32, LMLOSS_CPU, 0, 0);
  float rl[CHECK_ROWS], re[CHECK_ROWS], gl[CHECK_ROWS], ge[CHECK_ROWS];
  float *rg = malloc(R * V * sizeof(float)), *gg = malloc(R * V * sizeof(float));
  void *raw = malloc(R * V * es);
  double worst = 0.0;
  run_case(c, 0);
  cuda_ok(cudaDeviceSynchronize(), "check run");
  if (c->kind <= 1) {
    lmloss_tensor lp = tens(rl, LMLOSS_F32, LMLOSS_CPU, R, 1),
                  en = tens(re, LMLOSS_F32, LMLOSS_CPU, R, 1);
    lm_ok(lmloss_log_probs(&ref, &x, &idx, NULL, &tr, &lp, c->kind ? &en : &none), "ref lp");
    cuda_ok(cudaMemcpy(gl, c->logp, sizeof gl, cudaMemcpyDeviceToHost), "copy");
    cuda_ok(cudaMemcpy(ge, c->ent, sizeof ge, cudaMemcpyDeviceToHost), "copy");
    for (int i = 0; i < R; i++) {
      worst = fmax(worst, fabs(gl[i] - rl[i]) / (fabs(rl[i]) + 1e-6));
      if (c->kind) worst = fmax(worst, fabs(ge[i] - re[i]) / (fabs(re[i]) + 1e-6));
    }
  } else {
    lmloss_tensor g = tens(rg, LMLOSS_F32, LMLOSS_CPU, R, V);
    if (c->kind == 2) {
      /* per-row gradient of SUM for the first rows = MEAN gradient x N */
      lmloss_ce_inputs in = {x, idx, none, none};
      lmloss_ce_options o = lmloss_ce_options_default();
      o.reduction = LMLOSS_REDUCE_SUM;
      o.grad_output = 1.0f / (float)c->N;
      float l;
      lmloss_ce_outputs co = {tens(&l, LMLOSS_F32, LMLOSS_CPU, 1, 1), none, none, none, g};
      co.argmax.dtype = LMLOSS_I64;
      size_t wsb = lmloss_cross_entropy_workspace_size(R);
      void *ws = malloc(wsb);
      lm_ok(lmloss_cross_entropy(&ref, &in, &o, &co, ws, wsb), "ref ce");
      free(ws);
    } else if (c->kind == 3) {
      float dl[CHECK_ROWS];
      cuda_ok(cudaMemcpy(dl, c->dlogp, sizeof dl, cudaMemcpyDeviceToHost), "copy");
      lmloss_tensor dlt = tens(dl, LMLOSS_F32, LMLOSS_CPU, R, 1);
      lm_ok(lmloss_log_probs_backward(&ref, &x, &idx, NULL, &tr, &dlt, &none, &g), "ref bwd");
    } else {
      lm_ok(lmloss_softmax(&ref, &x, 0, &g), "ref softmax");
    }
    cuda_ok(cudaMemcpy(raw, c->out, R * V * es, cudaMemcpyDeviceToHost), "copy");
    double tol_abs = 0.0;
    for (int64_t i = 0; i < R * V; i++) {
      gg[i] = es == 4 ? ((float *)raw)[i] : bf16_to_f32(((uint16_t *)raw)[i]);
      tol_abs = fmax(tol_abs, fabs(rg[i]));
    }
    for (int64_t i = 0; i < R * V; i++) {
      double e = fabs(gg[i] - rg[i]) / (fabs(rg[i]) + 1e-6 * tol_abs);
      if (!(e <= worst)) worst = isnan(e) ? INFINITY : fmax(worst, e);
    }
    /* the peaked row's target entry, relative */
    int64_t j = ht[0];
    double e = fabs(gg[j] - rg[j]) / fabs(rg[j]);
    if (!(e < 1e-2)) worst = fmax(worst, 1.0 + e);
  }
  free(rg);
  free(gg);
  free(raw);
  double tol = es == 4 ? 1e-4 : 1e-2;
  if (!(worst <= tol)) {
    fprintf(stderr, "CHECK FAILED: case %d N=%lld V=%lld: worst relative error %.3g > %.1g\n",
            c->kind, (long long)c->N, (long long)c->V, worst, tol);
    return 0;
  }
  return 1;
}

static float time_case(bench_case *c) {
  cudaEvent_t e0, e1;
  float t[REPS];
  cuda_ok(cudaEventCreate(&e0), "event");
  cuda_ok(cudaEventCreate(&e1), "event");
  for (int i = 0; i < WARM; i++)
    run_case(c, i % c->nbuf);
  for (int i = 0; i < REPS; i++) {
    cuda_ok(cudaEventRecord(e0, 0), "record");
    run_case(c, i % c->nbuf);
    cuda_ok(cudaEventRecord(e1, 0), "record");
    cuda_ok(cudaEventSynchronize(e1), "sync");
    cuda_ok(cudaEventElapsedTime(&t[i], e0, e1), "elapsed");
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  qsort(t, REPS, sizeof(float), cmpf);
  return t[REPS / 2];
}

int main(int argc, char **argv) {
  int csv = argc > 1 && !strcmp(argv[1], "--csv");
  int dev = 0, l2 = 0;
  cuda_ok(cudaGetDevice(&dev), "device");
  cuda_ok(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "L2");
  struct cudaDeviceProp prop;
  cuda_ok(cudaGetDeviceProperties(&prop, dev), "props");

  /* Copy bandwidth: D2D of the largest logits tensor, read + write. */
  size_t cb = (size_t)8192 * 152064 * 2;
  void *a, *b;
  cuda_ok(cudaMalloc(&a, cb), "malloc");
  cuda_ok(cudaMalloc(&b, cb), "malloc");
  cuda_ok(cudaMemset(a, 1, cb), "memset");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float ct[REPS];
  for (int i = 0; i < WARM; i++)
    cudaMemcpyAsync(b, a, cb, cudaMemcpyDeviceToDevice, 0);
  for (int i = 0; i < REPS; i++) {
    cudaEventRecord(e0, 0);
    cudaMemcpyAsync(b, a, cb, cudaMemcpyDeviceToDevice, 0);
    cudaEventRecord(e1, 0);
    cuda_ok(cudaEventSynchronize(e1), "copy");
    cudaEventElapsedTime(&ct[i], e0, e1);
  }
  qsort(ct, REPS, sizeof(float), cmpf);
  double copy_gbs = 2.0 * cb / (ct[REPS / 2] * 1e-3) / 1e9;
  cudaFree(a);
  cudaFree(b);
  if (!csv)
    printf("%s, L2 %d MB; copy bandwidth (read+write) %.0f GB/s\n", prop.name, l2 >> 20, copy_gbs);

  struct {
    const char *name;
    int kind;
    lmloss_dtype dt;
    int64_t N, V;
  } cases[] = {
      {"logp K=1 bf16", 0, LMLOSS_BF16, 8192, 152064},
      {"logp+entropy bf16", 1, LMLOSS_BF16, 8192, 152064},
      {"CE fwd+bwd bf16", 2, LMLOSS_BF16, 8192, 152064},
      {"logp bwd bf16", 3, LMLOSS_BF16, 8192, 152064},
      {"logp K=1 bf16", 0, LMLOSS_BF16, 4096, 32768},
      {"logp+entropy bf16", 1, LMLOSS_BF16, 4096, 32768},
      {"CE fwd+bwd bf16", 2, LMLOSS_BF16, 4096, 32768},
      {"logp bwd bf16", 3, LMLOSS_BF16, 4096, 32768},
      {"softmax f32", 4, LMLOSS_F32, 4096, 262144},
  };
  int nc = (int)(sizeof cases / sizeof cases[0]);
  result res[16];
  int failed = 0;
  /* LMLOSS_BENCH_ONLY=i runs case i alone (for a profiler) */
  const char *only = getenv("LMLOSS_BENCH_ONLY");
  for (int ci = 0; ci < nc; ci++) {
    if (only && atoi(only) != ci) {
      res[ci].name = cases[ci].name;
      res[ci].N = cases[ci].N;
      res[ci].V = cases[ci].V;
      res[ci].ms = 0;
      res[ci].gbs = res[ci].frac = res[ci].bytes = 0;
      continue;
    }
    bench_case c = {0};
    c.kind = cases[ci].kind;
    c.dt = cases[ci].dt;
    c.N = cases[ci].N;
    c.V = cases[ci].V;
    size_t es = c.dt == LMLOSS_F32 ? 4 : 2, xb = (size_t)c.N * c.V * es;
    int64_t *ht = malloc(c.N * sizeof(int64_t));
    float *hd = malloc(c.N * sizeof(float));
    for (int64_t i = 0; i < c.N; i++) {
      ht[i] = (int64_t)(urand() * c.V) % c.V;
      hd[i] = (float)(urand() - 0.5);
    }
    float *hx = malloc((size_t)BLOCK_ROWS * c.V * sizeof(float));
    /* rotate two inputs when both would fit in L2 (never at these sizes) */
    c.nbuf = 2 * xb <= (size_t)l2 ? 2 : 1;
    for (int bi = 0; bi < c.nbuf; bi++) {
      cuda_ok(cudaMalloc(&c.x[bi], xb), "malloc x");
      fill_logits(c.x[bi], c.dt, c.N, c.V, ht, hx);
    }
    if (c.kind >= 2) cuda_ok(cudaMalloc(&c.out, xb), "malloc out");
    cuda_ok(cudaMalloc((void **)&c.idx, c.N * 8), "malloc");
    cuda_ok(cudaMalloc((void **)&c.logp, c.N * 4), "malloc");
    cuda_ok(cudaMalloc((void **)&c.ent, c.N * 4), "malloc");
    cuda_ok(cudaMalloc((void **)&c.dlogp, c.N * 4), "malloc");
    cuda_ok(cudaMalloc((void **)&c.loss, 4), "malloc");
    c.wsb = lmloss_cross_entropy_workspace_size(c.N);
    cuda_ok(cudaMalloc(&c.ws, c.wsb), "malloc ws");
    cuda_ok(cudaMemcpy(c.idx, ht, c.N * 8, cudaMemcpyHostToDevice), "copy");
    cuda_ok(cudaMemcpy(c.dlogp, hd, c.N * 4, cudaMemcpyHostToDevice), "copy");
    if (!check_case(&c, hx, ht)) failed = 1;
    float ms = time_case(&c);
    double bytes = (double)xb * (c.kind >= 2 ? 2 : 1);
    res[ci].name = cases[ci].name;
    res[ci].N = c.N;
    res[ci].V = c.V;
    res[ci].bytes = bytes;
    res[ci].ms = ms;
    res[ci].gbs = bytes / (ms * 1e-3) / 1e9;
    res[ci].frac = res[ci].gbs / copy_gbs;
    if (!csv)
      printf("%-18s %5lld x %-6lld  %8.3f ms  %6.0f GB/s  %5.1f%% of copy\n", res[ci].name,
             (long long)c.N, (long long)c.V, ms, res[ci].gbs, 100.0 * res[ci].frac);
    for (int bi = 0; bi < c.nbuf; bi++)
      cudaFree(c.x[bi]);
    cudaFree(c.out);
    cudaFree(c.idx);
    cudaFree(c.logp);
    cudaFree(c.ent);
    cudaFree(c.dlogp);
    cudaFree(c.loss);
    cudaFree(c.ws);
    free(ht);
    free(hd);
    free(hx);
  }
  if (csv) {
    printf("case,N,V,ms,GBps,fraction_of_copy\n");
    for (int i = 0; i < nc; i++)
      printf("%s,%lld,%lld,%.4f,%.1f,%.4f\n", res[i].name, (long long)res[i].N, (long long)res[i].V,
             res[i].ms, res[i].gbs, res[i].frac);
  } else {
    printf("\n| case | N x V | ms | GB/s | of copy (%.0f GB/s) |\n|---|---|---|---|---|\n",
           copy_gbs);
    for (int i = 0; i < nc; i++)
      printf("| %s | %lld x %lld | %.3f | %.0f | %.1f%% |\n", res[i].name, (long long)res[i].N,
             (long long)res[i].V, res[i].ms, res[i].gbs, 100.0 * res[i].frac);
  }
  if (failed) fprintf(stderr, "some kernels FAILED their check against REF\n");
  return failed;
}
