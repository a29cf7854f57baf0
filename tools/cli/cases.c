/* cases.c - one op at one shape/dtype/device: inputs, outputs, a run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "math/dtype.h"

static const char *names[OP_COUNT] = {
    "ce",          "ce-grad",           "ce-bwd",  "logprob",     "logprob-entropy",
    "logprob-bwd", "logprob-bwd-saved", "softmax", "log-softmax", "softmax-bwd",
    "linear-ce",   "linear-logprob",    "kl",      "reverse-kl",  "jsd",
    "tvd"};

const char *cli_op_name(cli_op op) { return names[op]; }

int cli_op_parse(const char *name, cli_op *op) {
  for (int i = 0; i < OP_COUNT; i++)
    if (!strcmp(name, names[i])) return *op = (cli_op)i, 1;
  return 0;
}

int cli_op_is_linear(cli_op op) { return op == OP_LINEAR_CE || op == OP_LINEAR_LP; }

int cli_op_is_div(cli_op op) { return op >= OP_KL && op <= OP_TVD; }

int cli_op_is_ce(cli_op op) {
  return op == OP_CE || op == OP_CE_GRAD || op == OP_CE_BWD || op == OP_LINEAR_CE;
}

double cli_op_bytes(const cli_case *c) {
  double x = (double)c->N * c->V * lmloss_dtype_size(c->dt);
  switch (c->op) {
  case OP_CE:
  case OP_LOGPROB:
  case OP_LOGPROB_ENT: return x;     /* read once */
  case OP_SOFTMAX_BWD: return 3 * x; /* read y and dy, write dx */
  case OP_KL:
  case OP_REVERSE_KL:
  case OP_JSD:
  case OP_TVD: return 3 * x; /* read both rows, write the student's gradient */
  case OP_LINEAR_CE:
  case OP_LINEAR_LP: return 0;
  default: return 2 * x; /* read once, write once */
  }
}

double cli_op_flops(const cli_case *c) {
  return cli_op_is_linear(c->op) ? 3.0 * 2.0 * c->N * c->V * c->H : 0.0;
}

static unsigned rng_state;
static double urand(void) { /* in [0, 1) */
  rng_state = rng_state * 1664525u + 1013904223u;
  return (rng_state >> 8) * (1.0 / 16777216.0);
}

/* Logits uniform in [-2, 2); with a margin, each row's target (the first
 * of its K indices) lifted that far above the rest. */
static void random_rows(double *x, int64_t N, int64_t V, const double *tgt, int64_t K,
                        double margin) {
  for (int64_t i = 0; i < N; i++) {
    double mx = -1e300;
    for (int64_t j = 0; j < V; j++) {
      x[i * V + j] = 4.0 * urand() - 2.0;
      if (j != (int64_t)tgt[i * K]) mx = fmax(mx, x[i * V + j]);
    }
    if (margin > 0) x[i * V + (int64_t)tgt[i * K]] = mx + margin;
  }
}

static lmloss_tensor make(cli_case *c, lmloss_dtype dt, int64_t rows, int64_t cols,
                          const double *host) {
  lmloss_tensor t = {NULL, dt, c->dev, rows, cols, cols};
  size_t n = (size_t)(rows * cols), bytes = n * lmloss_dtype_size(dt);
  char *h = cli_host_alloc(bytes, 1, 0);
  for (size_t i = 0; host && i < n; i++) {
    if (dt == LMLOSS_I64)
      ((int64_t *)h)[i] = (int64_t)host[i];
    else
      lmloss_store(h, dt, (int64_t)i, (float)host[i]);
  }
  t.data = cli_alloc(c->dev, bytes ? bytes : 1);
  if (host) cli_upload(c->dev, t.data, h, bytes);
  free(h);
  return t;
}

static void release(cli_case *c, lmloss_tensor *t) {
  if (t->data) cli_free(c->dev, t->data);
  t->data = NULL;
}

int cli_case_init(cli_case *c, cli_op op, int64_t N, int64_t V, int64_t H, lmloss_dtype dt,
                  lmloss_device dev, double margin, int plain, double supervised, unsigned seed) {
  memset(c, 0, sizeof *c);
  c->op = op, c->N = N, c->V = V, c->H = H, c->K = plain ? 1 : 2, c->dt = dt, c->dev = dev;
  c->margin = margin;
  c->plain = plain;
  if (V < 3 || N < 1 || (cli_op_is_linear(op) && H < 1)) return 0;
  rng_state = seed;
  const int64_t K = c->K;
  double *tgt = cli_host_alloc((size_t)N * K, sizeof(double), 0);
  for (int64_t i = 0; i < N; i++) {
    for (int64_t k = 0; k < K; k++)
      tgt[i * K + k] = (double)((i * 7919 + k * 13) % V);
  }
  if (!cli_op_is_linear(op)) {
    double *x = cli_host_alloc((size_t)(N * V), sizeof(double), 0);
    random_rows(x, N, V, tgt, K, margin);
    if (op == OP_SOFTMAX_BWD) { /* the input is a softmax output: y = softmax(x) */
      for (int64_t i = 0; i < N; i++) {
        double m = -1e300, s = 0;
        for (int64_t j = 0; j < V; j++)
          m = fmax(m, x[i * V + j]);
        for (int64_t j = 0; j < V; j++)
          s += exp(x[i * V + j] - m);
        for (int64_t j = 0; j < V; j++)
          x[i * V + j] = exp(x[i * V + j] - m) / s;
      }
      c->y = make(c, dt, N, V, x);
      for (size_t j = 0; j < (size_t)(N * V); j++)
        x[j] = urand() - 0.5;
    }
    c->x = make(c, dt, N, V, x);
    if (cli_op_is_div(op)) { /* the teacher: its own rows, as peaked at the same targets */
      random_rows(x, N, V, tgt, K, margin);
      c->teacher = make(c, dt, N, V, x);
    }
    free(x);
  } else {
    /* Peaked rows get their own hidden dimension: h_i[H0 + i] = 1 and
     * W[y_i][H0 + i] lifts exactly their target by the margin. */
    const int64_t H0 = margin > 0 ? H - N : H;
    double *h = cli_host_alloc((size_t)(N * H), sizeof(double), 1),
           *w = cli_host_alloc((size_t)(V * H), sizeof(double), 1);
    double *b = cli_host_alloc((size_t)V, sizeof(double), 0);
    for (int64_t i = 0; i < N * H; i++)
      h[i] = (i % H) < H0 ? urand() - 0.5 : 0.0;
    for (int64_t i = 0; i < V * H; i++)
      w[i] = (i % H) < H0 ? 0.2 * (urand() - 0.5) : 0.0;
    for (int64_t j = 0; j < V; j++)
      b[j] = 0.1 * (urand() - 0.5);
    if (margin > 0 && H0 > 0) {
      for (int64_t i = 0; i < N; i++) {
        int64_t y = (int64_t)tgt[i * K];
        double mx = -1e300, zy = 0;
        for (int64_t j = 0; j < V; j++) {
          double z = b[j];
          for (int64_t k = 0; k < H0; k++)
            z += h[i * H + k] * w[j * H + k];
          if (j == y)
            zy = z;
          else
            mx = fmax(mx, z);
        }
        h[i * H + H0 + i] = 1.0;
        w[y * H + H0 + i] = mx + margin - zy;
      }
    }
    c->hidden = make(c, dt, N, H, h);
    c->weight = make(c, dt, V, H, w);
    c->bias = make(c, dt, V, 1, b);
    free(h), free(w), free(b);
  }
  if (cli_op_is_ce(op)) {
    for (int64_t i = 0; i < N; i++) {
      if (i % 5 == 3 && !plain) tgt[i] = -100;                                 /* ignored rows */
      if (floor((i + 1) * supervised) == floor(i * supervised)) tgt[i] = -100; /* spread evenly */
    }
    c->idx = make(c, LMLOSS_I64, N, 1, tgt);
  } else {
    double *t2 = cli_host_alloc((size_t)N * K, sizeof(double), 0);
    for (int64_t i = 0; i < N * K; i++)
      t2[i] = tgt[i];
    c->idx = make(c, LMLOSS_I64, N, K, t2);
    free(t2);
  }
  double *d = cli_host_alloc((size_t)N * K, sizeof(double), 0);
  for (int64_t i = 0; i < N * K; i++)
    d[i] = urand() - 0.5;
  if (op == OP_CE_BWD) c->dloss = make(c, LMLOSS_F32, 1, 1, (double[]){0.75});
  if (op == OP_LOGPROB_BWD || op == OP_LOGPROB_BWD_SAVED || op == OP_LINEAR_LP) {
    c->dlogp = make(c, LMLOSS_F32, N, K, d);
    if (!plain) c->dent = make(c, LMLOSS_F32, N, 1, d);
  }
  if (op == OP_LOGPROB_BWD_SAVED || op == OP_LINEAR_LP)
    c->stats = make(c, LMLOSS_F32, N, LMLOSS_ROW_STATS, NULL);
  if (op == OP_LOGPROB_BWD_SAVED) c->stats_logp = make(c, LMLOSS_F32, N, K, NULL);
  free(d), free(tgt);

  int n = 0;
  switch (op) {
  case OP_CE:
    c->out[n++] = make(c, LMLOSS_F32, 1, 1, NULL);
    c->out[n++] = make(c, LMLOSS_F32, N, 1, NULL);
    c->out[n++] = make(c, LMLOSS_F32, N, 1, NULL);
    break;
  case OP_CE_GRAD: c->out[n++] = make(c, LMLOSS_F32, 1, 1, NULL); /* fall through */
  case OP_CE_BWD:
  case OP_LOGPROB_BWD:
  case OP_LOGPROB_BWD_SAVED:
  case OP_SOFTMAX:
  case OP_LOG_SOFTMAX:
  case OP_SOFTMAX_BWD: c->out[n++] = make(c, dt, N, V, NULL); break;
  case OP_KL:
  case OP_REVERSE_KL:
  case OP_JSD:
  case OP_TVD:
    c->out[n++] = make(c, LMLOSS_F32, 1, 1, NULL);
    c->out[n++] = make(c, dt, N, V, NULL);
    break;
  case OP_LOGPROB_ENT:
  case OP_LOGPROB:
    c->out[n++] = make(c, LMLOSS_F32, N, c->K, NULL);
    if (op == OP_LOGPROB_ENT) c->out[n++] = make(c, LMLOSS_F32, N, 1, NULL);
    break;
  case OP_LINEAR_CE:
  case OP_LINEAR_LP:
    if (op == OP_LINEAR_CE)
      c->out[n++] = make(c, LMLOSS_F32, 1, 1, NULL);
    else {
      c->out[n++] = make(c, LMLOSS_F32, N, c->K, NULL);
      c->out[n++] = make(c, LMLOSS_F32, N, 1, NULL);
    }
    c->out[n++] = make(c, dt, N, H, NULL);
    c->out[n++] = make(c, LMLOSS_F32, V, H, NULL);
    if (op == OP_LINEAR_CE) c->out[n++] = make(c, LMLOSS_F32, V, 1, NULL);
    break;
  case OP_COUNT: break;
  }
  c->nout = n;
  if (op == OP_CE || op == OP_CE_GRAD || op == OP_CE_BWD || cli_op_is_div(op)) {
    c->ws_bytes = lmloss_cross_entropy_workspace_size(N);
  } else if (cli_op_is_linear(op)) {
    lmloss_head head = {c->hidden, c->weight, op == OP_LINEAR_CE ? c->bias : (lmloss_tensor){0}};
    lmloss_head_grads g = {c->out[n - (op == OP_LINEAR_CE ? 3 : 2)],
                           c->out[n - (op == OP_LINEAR_CE ? 2 : 1)]};
    lmloss_head_options ho = lmloss_head_options_default();
    if (lmloss_linear_workspace_size(&head, &ho, &g, c->K, &c->ws_bytes) != LMLOSS_OK) return 0;
  }
  c->ws = c->ws_bytes ? cli_alloc(dev, c->ws_bytes) : NULL;
  return 1;
}

static lmloss_ce_options ce_options(const cli_case *c) {
  lmloss_ce_options o = lmloss_ce_options_default();
  if (!c->plain) {
    o.label_smoothing = 0.1f;
    o.z_loss = 1e-4f;
  }
  return o;
}

static lmloss_status run_divergence(cli_case *c, const lmloss_context *ctx) {
  static const lmloss_divergence_kind kinds[] = {LMLOSS_DIV_KL, LMLOSS_DIV_REVERSE_KL,
                                                 LMLOSS_DIV_JSD, LMLOSS_DIV_TVD};
  lmloss_div_options o = lmloss_div_options_default();
  o.kind = kinds[c->op - OP_KL];
  o.beta = 0.5f;
  lmloss_div_inputs in = {c->x, c->teacher, {0}};
  lmloss_div_outputs out;
  memset(&out, 0, sizeof out);
  out.loss = c->out[0], out.dstudent = c->out[1];
  return lmloss_divergence(ctx, &in, &o, &out, c->ws, c->ws_bytes);
}

/* The fused head on the REF backend: the full product in double, then the
 * REF logits ops, then the gradient products in double. */
static lmloss_status linear_reference(cli_case *c, const lmloss_context *ctx);

lmloss_status cli_case_run(cli_case *c, const lmloss_context *ctx) {
  lmloss_transform tr = lmloss_transform_default();
  lmloss_ce_options o = ce_options(c);
  lmloss_ce_inputs in = {c->x, c->idx, {0}, {0}};
  lmloss_ce_outputs out;
  memset(&out, 0, sizeof out);
  switch (c->op) {
  case OP_CE:
    out.loss = c->out[0], out.lse = c->out[1], out.entropy = c->out[2];
    return lmloss_cross_entropy(ctx, &in, &o, &out, c->ws, c->ws_bytes);
  case OP_CE_GRAD:
    out.loss = c->out[0], out.dlogits = c->out[1];
    return lmloss_cross_entropy(ctx, &in, &o, &out, c->ws, c->ws_bytes);
  case OP_CE_BWD:
    return lmloss_cross_entropy_backward(ctx, &in, &o, &c->dloss, &c->out[0], c->ws, c->ws_bytes);
  case OP_LOGPROB: return lmloss_log_probs(ctx, &c->x, &c->idx, NULL, &tr, &c->out[0], NULL, NULL);
  case OP_LOGPROB_ENT:
    return lmloss_log_probs(ctx, &c->x, &c->idx, NULL, &tr, &c->out[0], &c->out[1], NULL);
  case OP_LOGPROB_BWD:
    return lmloss_log_probs_backward(ctx, &c->x, &c->idx, NULL, &tr, &c->dlogp, &c->dent,
                                     &c->out[0], NULL);
  case OP_LOGPROB_BWD_SAVED:
    if (!c->stats_ready) {
      lmloss_status s =
          lmloss_log_probs(ctx, &c->x, &c->idx, NULL, &tr, &c->stats_logp, NULL, &c->stats);
      if (s != LMLOSS_OK) return s;
      c->stats_ready = 1;
    }
    return lmloss_log_probs_backward(ctx, &c->x, &c->idx, NULL, &tr, &c->dlogp, &c->dent,
                                     &c->out[0], &c->stats);
  case OP_SOFTMAX: return lmloss_softmax(ctx, &c->x, 0, &c->out[0]);
  case OP_LOG_SOFTMAX: return lmloss_softmax(ctx, &c->x, 1, &c->out[0]);
  case OP_SOFTMAX_BWD: return lmloss_softmax_backward(ctx, &c->y, &c->x, 0, &c->out[0]);
  case OP_KL:
  case OP_REVERSE_KL:
  case OP_JSD:
  case OP_TVD: return run_divergence(c, ctx);
  case OP_LINEAR_CE:
  case OP_LINEAR_LP: break;
  case OP_COUNT: return LMLOSS_ERR_BAD_OPTION;
  }
  if (ctx && ctx->backend == LMLOSS_BACKEND_REF) return linear_reference(c, ctx);
  lmloss_head_options ho = lmloss_head_options_default();
  if (c->op == OP_LINEAR_CE) {
    lmloss_head head = {c->hidden, c->weight, c->bias};
    lmloss_head_grads g = {c->out[1], c->out[2], c->out[3]};
    out.loss = c->out[0];
    return lmloss_linear_cross_entropy(ctx, &head, &c->idx, NULL, NULL, &o, &ho, &out, &g, c->ws,
                                       c->ws_bytes);
  }
  lmloss_head head = {c->hidden, c->weight, {0}};
  lmloss_head_grads g = {c->out[2], c->out[3], {0}};
  /* the backward from the forward's statistics, as lmloss.torch runs it */
  lmloss_status s = lmloss_linear_log_probs(ctx, &head, &c->idx, NULL, &tr, &ho, &c->out[0],
                                            &c->out[1], &c->stats, c->ws, c->ws_bytes);
  if (s != LMLOSS_OK) return s;
  return lmloss_linear_log_probs_backward(ctx, &head, &c->idx, NULL, &tr, &ho, &c->dlogp, &c->dent,
                                          &c->stats, &g, c->ws, c->ws_bytes);
}

double *cli_case_fetch(const cli_case *c, int k, size_t *n, int64_t *cols) {
  const lmloss_tensor *t = &c->out[k];
  *n = (size_t)(t->rows * t->cols);
  *cols = t->cols;
  size_t bytes = *n * lmloss_dtype_size(t->dtype);
  char *h = cli_host_alloc(bytes, 1, 0);
  cli_download(c->dev, h, t->data, bytes);
  double *d = cli_host_alloc(*n, sizeof(double), 0);
  for (size_t i = 0; i < *n; i++)
    d[i] =
        t->dtype == LMLOSS_I64 ? (double)((int64_t *)h)[i] : lmloss_load(h, t->dtype, (int64_t)i);
  free(h);
  return d;
}

void cli_case_free(cli_case *c) {
  lmloss_tensor *ts[] = {&c->x,      &c->idx,  &c->dloss, &c->dlogp, &c->dent,       &c->hidden,
                         &c->weight, &c->bias, &c->y,     &c->stats, &c->stats_logp, &c->teacher};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
    release(c, ts[i]);
  for (int k = 0; k < c->nout; k++)
    release(c, &c->out[k]);
  if (c->ws) cli_free(c->dev, c->ws);
  c->ws = NULL;
}

static double *as_doubles(const lmloss_tensor *t) {
  size_t n = (size_t)(t->rows * t->cols);
  double *d = cli_host_alloc(n, sizeof(double), 0);
  cli_case tmp = {.dev = LMLOSS_CPU};
  tmp.out[0] = *t;
  size_t m;
  int64_t cols;
  double *f = cli_case_fetch(&tmp, 0, &m, &cols);
  memcpy(d, f, sizeof(double) * n);
  free(f);
  return d;
}

static lmloss_status linear_reference(cli_case *c, const lmloss_context *ctx) {
  const int64_t N = c->N, V = c->V, H = c->H;
  double *h = as_doubles(&c->hidden), *w = as_doubles(&c->weight), *b = as_doubles(&c->bias);
  float *x = cli_host_alloc((size_t)(N * V), sizeof(float), 0),
        *dl = cli_host_alloc((size_t)(N * V), sizeof(float), 0);
  const int with_bias = c->op == OP_LINEAR_CE;
  for (int64_t i = 0; i < N; i++)
    for (int64_t j = 0; j < V; j++) {
      double z = with_bias ? b[j] : 0.0;
      for (int64_t k = 0; k < H; k++)
        z += h[i * H + k] * w[j * H + k];
      x[i * V + j] = (float)z;
    }
  lmloss_tensor xt = {x, LMLOSS_F32, LMLOSS_CPU, N, V, V}, dlt = xt;
  dlt.data = dl;
  lmloss_transform tr = lmloss_transform_default();
  lmloss_status s;
  if (with_bias) {
    lmloss_ce_options o = ce_options(c);
    lmloss_ce_inputs in = {xt, c->idx, {0}, {0}};
    lmloss_ce_outputs out;
    memset(&out, 0, sizeof out);
    out.loss = c->out[0], out.dlogits = dlt;
    size_t wsb = lmloss_cross_entropy_workspace_size(N);
    void *ws = cli_host_alloc(wsb, 1, 0);
    s = lmloss_cross_entropy(ctx, &in, &o, &out, ws, wsb);
    free(ws);
  } else {
    s = lmloss_log_probs(ctx, &xt, &c->idx, NULL, &tr, &c->out[0], &c->out[1], NULL);
    if (s == LMLOSS_OK)
      s = lmloss_log_probs_backward(ctx, &xt, &c->idx, NULL, &tr, &c->dlogp, &c->dent, &dlt, NULL);
  }
  const int g0 = with_bias ? 1 : 2;
  float *dw = c->out[g0 + 1].data, *db = with_bias ? c->out[3].data : NULL;
  for (int64_t i = 0; s == LMLOSS_OK && i < N; i++)
    for (int64_t k = 0; k < H; k++) {
      double acc = 0;
      for (int64_t j = 0; j < V; j++)
        acc += (double)dl[i * V + j] * w[j * H + k];
      lmloss_store(c->out[g0].data, c->dt, i * H + k, (float)acc);
    }
  for (int64_t j = 0; s == LMLOSS_OK && j < V; j++) {
    double sb = 0;
    for (int64_t i = 0; i < N; i++)
      sb += dl[i * V + j];
    if (db) db[j] = (float)sb;
    for (int64_t k = 0; k < H; k++) {
      double acc = 0;
      for (int64_t i = 0; i < N; i++)
        acc += (double)dl[i * V + j] * h[i * H + k];
      dw[j * H + k] = (float)acc;
    }
  }
  free(h), free(w), free(b), free(x), free(dl);
  return s;
}
