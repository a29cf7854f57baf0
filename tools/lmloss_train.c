/*
 * lmloss_train.c - trains a small byte-level language model on a bundled
 * public-domain text (data/genesis.txt, KJV Genesis) in plain C: the
 * previous C bytes are embedded and concatenated, pass one tanh hidden
 * layer, and the LM head W [V, H] + bias goes through lmloss's fused
 * lmloss_linear_cross_entropy, which returns the loss and the gradients of
 * hidden, W and bias in one pass without holding the [batch, V] logits.
 * The rest of the backward pass is hand-written with CBLAS; Adam updates
 * every parameter. Prints a loss curve (train and held-out), tokens/s, the
 * loss step's memory against materialized logits, and a generated sample.
 * Exits non-zero on any error, or if the held-out loss did not go down.
 */
#include <cblas.h>
#include <ctype.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lmloss.h"

#ifdef LMLOSS_TOOLS_CUDA
#include <cuda_runtime.h>
#endif

#ifndef LMLOSS_DATA_DIR
#define LMLOSS_DATA_DIR "data"
#endif

#define CTX 8          /* bytes of context */
#define EMB 32         /* embedding width per context byte */
#define IN (CTX * EMB) /* hidden layer input width */
#define HID 512        /* hidden width = H of the head */
#define NBYTE 256      /* input alphabet (bytes); the head's V may be larger */

typedef struct {
  long long steps, batch, vocab, seed, budget;
  const char *text;
  int cuda; /* --device cuda: the head runs on the GPU */
} config;

static uint64_t rng_state;
static uint64_t rng_next(void) { /* splitmix64: fixed output for a seed on every platform */
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static float rng_unit(void) { return (float)(rng_next() >> 40) / 16777216.0f; }

static void die(int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("lmloss_train: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(rc);
}

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p)
    die(1, "out of memory for %.1f GiB (a smaller --vocab or --batch?)",
        (double)n * size / (1 << 30));
  return p;
}

static void check(lmloss_status s, const char *what) {
  if (s != LMLOSS_OK) die(1, "%s: %s: %s", what, lmloss_status_string(s), lmloss_last_error());
}

static unsigned char *read_text(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) die(1, "cannot open %s (use --text PATH)", path);
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *buf = xcalloc(len > 0 ? (size_t)len : 1, 1);
  *n = len > 0 ? fread(buf, 1, (size_t)len, f) : 0;
  fclose(f);
  return buf;
}

/* All parameters in one array (and their gradients, Adam moments alike), so
 * one loop updates everything. */
typedef struct {
  size_t n;
  float *p, *g, *m, *v;
  float *emb, *w1, *b1, *w, *b;      /* [NBYTE, EMB], [HID, IN], [HID], [V, HID], [V] */
  float *gemb, *gw1, *gb1, *gw, *gb; /* their gradients */
} model;

static void model_init(model *md, int V) {
  const size_t size[5] = {NBYTE * EMB, HID * IN, HID, (size_t)V * HID, (size_t)V};
  size_t off[6] = {0};
  for (int k = 0; k < 5; k++)
    off[k + 1] = off[k] + size[k];
  md->n = off[5];
  md->p = xcalloc(4 * md->n, 4), md->g = md->p + md->n, md->m = md->g + md->n,
  md->v = md->m + md->n;
  float **pp[5] = {&md->emb, &md->w1, &md->b1, &md->w, &md->b};
  float **gg[5] = {&md->gemb, &md->gw1, &md->gb1, &md->gw, &md->gb};
  /* Uniform with variance 1/fan_in keeps tanh out of saturation at the
   * start; biases start at 0. */
  const float scale[5] = {1.0f, sqrtf(3.0f / IN), 0.0f, sqrtf(3.0f / HID), 0.0f};
  for (int k = 0; k < 5; k++) {
    *pp[k] = md->p + off[k], *gg[k] = md->g + off[k];
    for (size_t i = off[k]; i < off[k + 1]; i++)
      md->p[i] = scale[k] * (2.0f * rng_unit() - 1.0f);
  }
}

static void adam(model *md, int t, float lr) {
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  const float c1 = 1.0f / (1.0f - powf(b1, (float)t)), c2 = 1.0f / (1.0f - powf(b2, (float)t));
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < md->n; i++) {
    float g = md->g[i];
    md->m[i] = b1 * md->m[i] + (1 - b1) * g;
    md->v[i] = b2 * md->v[i] + (1 - b2) * g * g;
    md->p[i] -= lr * (md->m[i] * c1) / (sqrtf(md->v[i] * c2) + eps);
  }
}

/* x [B, IN] = concatenated embeddings of the CTX bytes before each position;
 * h [B, HID] = tanh(x W1^T + b1). */
static void hidden_forward(const model *md, const unsigned char *text, const int64_t *pos, int B,
                           float *x, float *h) {
#pragma omp parallel for schedule(static)
  for (int i = 0; i < B; i++)
    for (int c = 0; c < CTX; c++)
      memcpy(x + (size_t)i * IN + c * EMB, md->emb + (size_t)text[pos[i] - CTX + c] * EMB,
             EMB * sizeof(float));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, HID, IN, 1.0f, x, IN, md->w1, IN, 0.0f, h,
              HID);
#pragma omp parallel for schedule(static)
  for (int i = 0; i < B; i++)
    for (int j = 0; j < HID; j++)
      h[(size_t)i * HID + j] = tanhf(h[(size_t)i * HID + j] + md->b1[j]);
}

/* Everything the loss step needs, built once: the head views and the
 * workspace that lmloss sizes for this batch and memory budget. */
typedef struct {
  lmloss_context ctx;
  lmloss_ce_options opt;
  lmloss_head_options hopt;
  lmloss_head head;
  lmloss_head_grads grads;
  lmloss_tensor target;
  int64_t *tgt;
  void *ws;
  size_t ws_bytes;
  /* --device cuda: GPU copies of the head's tensors (the rest of the
   * model stays on the CPU), refreshed around every loss call */
  lmloss_head dhead;
  lmloss_head_grads dgrads;
  lmloss_tensor dtarget, dloss;
} loss_step;

#ifdef LMLOSS_TOOLS_CUDA
static size_t span(const lmloss_tensor *t) {
  return (size_t)(t->rows * t->cols) * (t->dtype == LMLOSS_I64 ? 8 : 4);
}

static lmloss_tensor gpu_twin(const lmloss_tensor *h) {
  lmloss_tensor d = *h;
  d.device = LMLOSS_CUDA;
  if (cudaMalloc(&d.data, span(h)) != cudaSuccess)
    die(1, "cudaMalloc of %zu bytes failed", span(h));
  return d;
}

static void copy(const lmloss_tensor *dst, const lmloss_tensor *src, enum cudaMemcpyKind kind) {
  if (cudaMemcpy(dst->data, src->data, span(src), kind) != cudaSuccess)
    die(1, "cudaMemcpy failed: %s", cudaGetErrorString(cudaGetLastError()));
}

static void gpu_setup(loss_step *ls) {
  ls->dhead = (lmloss_head){gpu_twin(&ls->head.hidden), gpu_twin(&ls->head.weight),
                            gpu_twin(&ls->head.bias)};
  ls->dgrads = (lmloss_head_grads){gpu_twin(&ls->grads.dhidden), gpu_twin(&ls->grads.dweight),
                                   gpu_twin(&ls->grads.dbias)};
  ls->dtarget = gpu_twin(&ls->target);
  ls->dloss = gpu_twin(&(lmloss_tensor){NULL, LMLOSS_F32, LMLOSS_CPU, 1, 1, 1});
  ls->ctx.backend = LMLOSS_BACKEND_CUDA;
  free(ls->ws);
  if (cudaMalloc(&ls->ws, ls->ws_bytes) != cudaSuccess)
    die(1, "cudaMalloc of the workspace failed");
}

static float gpu_loss_call(loss_step *ls, int with_grads) {
  float loss = 0;
  copy(&ls->dhead.hidden, &ls->head.hidden, cudaMemcpyHostToDevice);
  copy(&ls->dhead.weight, &ls->head.weight, cudaMemcpyHostToDevice);
  copy(&ls->dhead.bias, &ls->head.bias, cudaMemcpyHostToDevice);
  copy(&ls->dtarget, &ls->target, cudaMemcpyHostToDevice);
  lmloss_ce_outputs out = {.loss = ls->dloss};
  check(lmloss_linear_cross_entropy(&ls->ctx, &ls->dhead, &ls->dtarget, NULL, NULL, &ls->opt,
                                    &ls->hopt, &out, with_grads ? &ls->dgrads : NULL, ls->ws,
                                    ls->ws_bytes),
        "lmloss_linear_cross_entropy");
  if (with_grads) {
    copy(&ls->grads.dhidden, &ls->dgrads.dhidden, cudaMemcpyDeviceToHost);
    copy(&ls->grads.dweight, &ls->dgrads.dweight, cudaMemcpyDeviceToHost);
    copy(&ls->grads.dbias, &ls->dgrads.dbias, cudaMemcpyDeviceToHost);
  }
  if (cudaMemcpy(&loss, ls->dloss.data, 4, cudaMemcpyDeviceToHost) != cudaSuccess)
    die(1, "cudaMemcpy of the loss failed");
  return loss;
}
#endif

static float loss_call(loss_step *ls, int with_grads) {
#ifdef LMLOSS_TOOLS_CUDA
  if (ls->ctx.backend == LMLOSS_BACKEND_CUDA) return gpu_loss_call(ls, with_grads);
#endif
  float loss = 0;
  lmloss_ce_outputs out = {.loss = {&loss, LMLOSS_F32, LMLOSS_CPU, 1, 1, 1}};
  check(lmloss_linear_cross_entropy(&ls->ctx, &ls->head, &ls->target, NULL, NULL, &ls->opt,
                                    &ls->hopt, &out, with_grads ? &ls->grads : NULL, ls->ws,
                                    ls->ws_bytes),
        "lmloss_linear_cross_entropy");
  return loss;
}

/* Seconds the run will take: one loss step with its gradients (the head's
 * GEMMs and row pass grow with V: a large --vocab takes hours on a small
 * machine) and one hidden layer, timed on the first b held-out rows, b
 * doubling from 8 until a step takes 0.5 s or holds the batch, then
 * extrapolated linearly from the last two to the batch (a step also has
 * a cost per call, dW's V x H written whatever b is) and scaled to every
 * step and evaluation. The calls write only gradients that each step
 * overwrites and draw no random numbers, so the run is unchanged. */
static double estimate_s(const loss_step *ls, const model *md, const unsigned char *text,
                         const int64_t *vpos, int B, int steps, float *x, float *h) {
  double t = 0.0, t_hid = 0.0, t_prev = 0.0;
  int b = B < 8 ? B : 8, b_prev = 0;
  for (;; b_prev = b, t_prev = t, b = 2 * b < B ? 2 * b : B) {
    loss_step q = *ls;
    q.head.hidden.rows = q.grads.dhidden.rows = q.target.rows = b;
    q.dhead.hidden.rows = q.dgrads.dhidden.rows = q.dtarget.rows = b;
    for (int i = 0; i < b; i++)
      q.tgt[i] = text[vpos[i]];
    double t0 = omp_get_wtime();
    hidden_forward(md, text, vpos, b, x, h);
    double t1 = omp_get_wtime();
    loss_call(&q, 1);
    t = omp_get_wtime() - t1, t_hid = (t1 - t0) * B / b;
    if (b == B || t + (t1 - t0) > 0.5) break;
  }
  if (b < B) /* the first call (b = 8) also paid the warm-up: no slope then */
    t +=
        b_prev ? (t - t_prev > 0.0 ? (t - t_prev) / (b - b_prev) : 0.0) * (B - b) : t * (B - b) / b;
  /* a step: the loss with gradients, the hidden layer and its two
   * backward GEMMs; an evaluation (every 50 steps): a forward only */
  return steps * (t + 3.0 * t_hid) + (steps / 50 + 1) * (t / 3.0 + t_hid);
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: lmloss_train [options]\n"
          "  --steps N      training steps (default 600)\n"
          "  --batch N      positions per step (default 4096)\n"
          "  --vocab V      head width V >= 256; classes past 255 never occur (default 256)\n"
          "  --budget BYTES lmloss memory_budget, K/M suffix allowed (default 1M; 0 = lmloss's\n"
          "                 default of 256 MiB)\n"
          "  --seed N       seed of initialization, batches and sampling (default 1)\n"
          "  --text PATH    training text (default %s/genesis.txt)\n"
          "  --device D     cpu (default) or cuda\n"
          "  --help, --version\n",
          LMLOSS_DATA_DIR);
}

static void parse(int argc, char **argv, config *c) {
  /* A 1 MiB budget makes 128-row chunks at V = 256, far below the batch's
   * logits, yet GEMMs large enough to stay fast. */
  *c = (config){600, 4096, NBYTE, 1, 1 << 20, LMLOSS_DATA_DIR "/genesis.txt", 0};
  static const struct {
    const char *name;
    size_t off;
    long long min;
  } opts[] = {{"--steps", offsetof(config, steps), 1},
              {"--batch", offsetof(config, batch), 1},
              {"--vocab", offsetof(config, vocab), NBYTE},
              {"--seed", offsetof(config, seed), 0},
              {"--budget", offsetof(config, budget), 0}};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[++i] : "";
    int known = 0;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) usage(stdout), exit(0);
    if (!strcmp(a, "--version")) {
      const int lv = lmloss_version();
      printf("lmloss_train %d.%d.%d (library %d.%d.%d)\n", LMLOSS_VERSION_MAJOR,
             LMLOSS_VERSION_MINOR, LMLOSS_VERSION_PATCH, lv / 10000, lv / 100 % 100, lv % 100);
      exit(0);
    }
    for (size_t k = 0; k < sizeof opts / sizeof opts[0]; k++) {
      if (strcmp(a, opts[k].name)) continue;
      char *end; /* a count >= min, with an optional K or M (binary) suffix */
      long long x = strtoll(v, &end, 10);
      x *= *end == 'K' ? 1024 : *end == 'M' ? 1 << 20 : 1;
      end += *end == 'K' || *end == 'M';
      known = end != v && !*end && x >= opts[k].min && x <= INT32_MAX;
      *(long long *)((char *)c + opts[k].off) = x;
    }
    if (!strcmp(a, "--text") && *v) c->text = v, known = 1;
    if (!strcmp(a, "--device") && !strcmp(v, "cpu")) known = 1;
    if (!strcmp(a, "--device") && !strcmp(v, "cuda")) {
#ifdef LMLOSS_TOOLS_CUDA
      int ndev = 0;
      if (!lmloss_has_cuda() || cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1)
        die(2, "--device cuda: no CUDA device here; use --device cpu");
      c->cuda = known = 1;
#else
      die(2, "--device cuda: this build has no CUDA (configure where nvcc is); use --device cpu");
#endif
    }
    if (!known) {
      fprintf(stderr, "lmloss_train: bad option or value: %s %s\n\n", a, v);
      usage(stderr);
      exit(2);
    }
  }
}

/* Progress bar on stderr, so stdout stays a clean loss curve; only to a
 * terminal, where the carriage returns redraw it rather than fill a log. */
static void progress(int step, int steps, float loss, double tok_s) {
  if (!isatty(STDERR_FILENO)) return;
  int w = 30, done = (int)((int64_t)w * step / steps);
  fprintf(stderr, "\r[%.*s%*s] step %d/%d  loss %.4f  %.0f tok/s ", done,
          "##############################", w - done, "", step, steps, loss, tok_s);
  if (step == steps) fputc('\n', stderr);
}

int main(int argc, char **argv) {
  config cf;
  parse(argc, argv, &cf);
  const int B = (int)cf.batch, V = (int)cf.vocab, steps = (int)cf.steps;
  size_t n;
  unsigned char *text = read_text(cf.text, &n);
  /* The last tenth is held out: its loss is the curve the sanity check
   * reads, free of the noise of a random training batch. */
  const int64_t n_train = (int64_t)(n * 9 / 10);
  if (n_train < 2 * CTX || (int64_t)n - n_train < 2 * CTX)
    die(1, "%s: %zu bytes is too short", cf.text, n);
  rng_state = (uint64_t)cf.seed;
  model md;
  model_init(&md, V);

  float *x = xcalloc((size_t)B * IN, 4), *h = xcalloc((size_t)B * HID, 4);
  float *dh = xcalloc((size_t)B * HID, 4), *dx = xcalloc((size_t)B * IN, 4);
  float *ones = xcalloc(B, 4); /* column sums as a GEMV */
  for (int i = 0; i < B; i++)
    ones[i] = 1.0f;
  int64_t *pos = xcalloc(B, 8), *vpos = xcalloc(B, 8);
  loss_step ls = {.ctx = lmloss_context_default(),
                  .opt = lmloss_ce_options_default(),
                  .hopt = lmloss_head_options_default()};
  ls.ctx.backend = LMLOSS_BACKEND_CPU;
  ls.opt.reduction = LMLOSS_REDUCE_MEAN; /* label smoothing stays 0 */
  ls.hopt.memory_budget = (size_t)cf.budget;
  ls.tgt = xcalloc(B, 8);
  ls.target = (lmloss_tensor){ls.tgt, LMLOSS_I64, LMLOSS_CPU, B, 1, 1};
  ls.head.hidden = (lmloss_tensor){h, LMLOSS_F32, LMLOSS_CPU, B, HID, HID};
  ls.head.weight = (lmloss_tensor){md.w, LMLOSS_F32, LMLOSS_CPU, V, HID, HID};
  ls.head.bias = (lmloss_tensor){md.b, LMLOSS_F32, LMLOSS_CPU, V, 1, 1};
  ls.grads.dhidden = (lmloss_tensor){dh, LMLOSS_F32, LMLOSS_CPU, B, HID, HID};
  ls.grads.dweight = (lmloss_tensor){md.gw, LMLOSS_F32, LMLOSS_CPU, V, HID, HID};
  ls.grads.dbias = (lmloss_tensor){md.gb, LMLOSS_F32, LMLOSS_CPU, V, 1, 1};
  check(lmloss_linear_workspace_size(&ls.head, &ls.hopt, &ls.grads, 1, &ls.ws_bytes),
        "lmloss_linear_workspace_size");
  ls.ws = xcalloc(ls.ws_bytes, 1);
#ifdef LMLOSS_TOOLS_CUDA
  if (cf.cuda) gpu_setup(&ls);
#endif

  /* Held-out positions, evenly spaced so every evaluation sees the same rows. */
  const int64_t n_val = (int64_t)n - n_train - CTX;
  for (int i = 0; i < B; i++)
    vpos[i] = n_train + CTX + (int64_t)i * n_val / B;

  printf("lmloss_train: %s, %zu bytes (%lld train, %lld held out), head on the %s (CPU ISA %s)\n",
         cf.text, n, (long long)n_train, (long long)(n - n_train), cf.cuda ? "GPU" : "CPU",
         lmloss_cpu_isa());
  printf("model: %d context bytes x %d-dim embedding -> tanh(%d) -> head V = %d, %zu "
         "parameters; batch %d, %d steps, Adam, seed %lld\n",
         CTX, EMB, HID, V, md.n, B, steps, cf.seed);
  printf("estimate: about %.0f s for %d steps (a loss step timed before the start)\n\n",
         estimate_s(&ls, &md, text, vpos, B, steps, x, h), steps);
  fflush(stdout);
  printf("%6s %12s %12s %14s\n", "step", "train loss", "held-out", "held-out bpb");

  float val0 = 0, val = 0, train_sum = 0;
  int train_cnt = 0;
  double t_train = 0;
  for (int step = 0; step <= steps; step++) {
    if (step % 50 == 0 || step == steps) {
      /* Evaluate on the held-out rows through the same head views. */
      memcpy(pos, vpos, (size_t)B * 8);
      for (int i = 0; i < B; i++)
        ls.tgt[i] = text[pos[i]];
      hidden_forward(&md, text, pos, B, x, h);
      val = loss_call(&ls, 0);
      if (step == 0) val0 = val;
      if (train_cnt)
        printf("%6d %12.4f %12.4f %14.3f\n", step, train_sum / train_cnt, val, val / logf(2.0f));
      else
        printf("%6d %12s %12.4f %14.3f\n", step, "-", val, val / logf(2.0f));
      fflush(stdout);
      train_sum = 0, train_cnt = 0;
    }
    if (step == steps) break;
    double t0 = omp_get_wtime();
    for (int i = 0; i < B; i++) {
      pos[i] = CTX + (int64_t)(rng_next() % (uint64_t)(n_train - CTX));
      ls.tgt[i] = text[pos[i]];
    }
    hidden_forward(&md, text, pos, B, x, h);
    float loss = loss_call(&ls, 1); /* also writes dh, dW, dbias */

    /* Through tanh: d pre = dh (1 - h^2); then W1, b1 and the inputs. */
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < (size_t)B * HID; i++)
      dh[i] *= 1.0f - h[i] * h[i];
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, HID, IN, B, 1.0f, dh, HID, x, IN, 0.0f,
                md.gw1, IN);
    cblas_sgemv(CblasRowMajor, CblasTrans, B, HID, 1.0f, dh, HID, ones, 1, 0.0f, md.gb1, 1);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, IN, HID, 1.0f, dh, HID, md.w1, IN,
                0.0f, dx, IN);
    /* Serial scatter into the embedding rows: same order every run, so the
     * sums (and the run) are reproducible. */
    memset(md.gemb, 0, (size_t)NBYTE * EMB * sizeof(float));
    for (int i = 0; i < B; i++)
      for (int c = 0; c < CTX; c++) {
        float *ge = md.gemb + (size_t)text[pos[i] - CTX + c] * EMB;
        const float *d = dx + (size_t)i * IN + c * EMB;
        for (int e = 0; e < EMB; e++)
          ge[e] += d[e];
      }
    /* Short warmup, then cosine decay to a tenth: fast early progress,
     * and a calm end for the last evaluation. */
    float frac = (float)step / steps, lr = 3e-3f;
    lr *= step < 20 ? (step + 1) / 20.0f : 0.1f + 0.45f * (1.0f + cosf(3.14159265f * frac));
    adam(&md, step + 1, lr);
    t_train += omp_get_wtime() - t0;
    train_sum += loss, train_cnt++;
    progress(step + 1, steps, loss, (double)B * (step + 1) / t_train);
  }

  const double tok_s = (double)B * steps / t_train;
  printf("\ntraining: %.2f s, %.0f tokens/s (positions per second, forward + backward + Adam)\n",
         t_train, tok_s);

  /* Memory of the loss step: lmloss's workspace (chunks sized by the
   * budget) against the [B, V] fp32 logits and their gradient that an
   * unfused head holds at once. */
  size_t ws_default;
  lmloss_head_options hdef = lmloss_head_options_default();
  check(lmloss_linear_workspace_size(&ls.head, &hdef, &ls.grads, 1, &ws_default),
        "lmloss_linear_workspace_size");
  const double mib = 1024.0 * 1024.0, full = 2.0 * B * V * 4;
  printf("loss step memory: lmloss workspace %.2f MiB (memory_budget %.2f MiB; the default 256 "
         "MiB gives %.2f MiB)\n  vs %.2f MiB for materialized fp32 logits + gradient "
         "(2 x %d x %d x 4 bytes): %.1fx %s\n",
         ls.ws_bytes / mib, (cf.budget ? cf.budget : 256 << 20) / mib, ws_default / mib, full / mib,
         B, V, full > ls.ws_bytes ? full / ls.ws_bytes : ls.ws_bytes / full,
         full > ls.ws_bytes ? "less" : "MORE");
  /* Honest about a small V: a chunk row also holds its hidden row and its
   * gradient (2 x H x 4 bytes), more than its V x 4 bytes of logits. */
  if (V < 2 * HID)
    printf("  (at V = %d < 2H a chunk's hidden rows outweigh its logits; the saving grows with V: "
           "--vocab)\n",
           V);

  /* Sample: the last row's logits by one sgemv (temperature 0.7 folded
   * in), softmax by lmloss, an inverse-CDF draw over the byte classes. */
  const char *prompt = "And God said unto ";
  enum { NGEN = 400 };
  unsigned char gen[CTX + NGEN];
  memcpy(gen, prompt + strlen(prompt) - CTX, CTX);
  float *z = xcalloc(V, 4), *p = xcalloc(V, 4);
  lmloss_tensor zt = {z, LMLOSS_F32, LMLOSS_CPU, 1, V, V}, pt = zt;
  pt.data = p;
  for (int64_t t = CTX; t < CTX + NGEN; t++) {
    hidden_forward(&md, gen, &t, 1, x, h);
    memcpy(z, md.b, V * sizeof(float));
    cblas_sgemv(CblasRowMajor, CblasNoTrans, V, HID, 1 / 0.7f, md.w, HID, h, 1, 1 / 0.7f, z, 1);
    check(lmloss_softmax(NULL, &zt, 0, &pt), "lmloss_softmax");
    float mass = 0, acc = p[0];
    for (int k = 0; k < NBYTE; k++)
      mass += p[k];
    int next = 0;
    for (float u = rng_unit() * mass; acc <= u && next < NBYTE - 1;)
      acc += p[++next];
    gen[t] = (unsigned char)next;
  }
  printf("\nsample (temperature 0.7, seed %lld):\n%s", cf.seed, prompt);
  for (int t = CTX; t < CTX + NGEN; t++) /* unprintable bytes as '.': stdout stays text */
    putchar(isprint(gen[t]) || gen[t] == '\n' ? gen[t] : '.');
  printf("\n\nheld-out loss %.4f -> %.4f nats/byte: %s\n", val0, val,
         val < val0 ? "went down" : "DID NOT GO DOWN");
  return val < val0 ? 0 : 1;
}
