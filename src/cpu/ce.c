/*
 * ce.c - cross-entropy on the CPU: forward, fused forward+backward, and
 * backward from dloss. Targets are scanned first, so only supervised rows
 * are ever read (sparse supervision costs its share of the rows); the
 * rows then run in parallel, each with one statistics pass and, for a
 * gradient, one write pass. Reductions add per-row results in row order,
 * so a result never depends on the thread count.
 */
#include <stdlib.h>

#include "common.h"
#include "core/validate.h"
#include "rowpass.h"

typedef struct {
  const lmloss_ce_inputs *in;
  const lmloss_ce_options *opt;
  const lmloss_ce_outputs *out; /* forward only */
  const lmloss_tensor *dloss;   /* backward only */
  const lmloss_tensor *dlogits; /* NULL when no gradient is wanted */
  lmloss_shard sh;              /* the logits' columns in the vocabulary */
  const lmloss_tensor *merged;  /* finish from these states; NULL: form them */
  const lmloss_tensor *states;  /* the stats phase: write the states, nothing else */
  const float *cw;              /* class weights, contiguous, or NULL */
  double class_sum;             /* C */
  double scale;                 /* reduction factor: 1, 1/denominator, 1/num_items */
} ce_job;

/* The state of row i's columns, label y. */
static lmloss_rowstate ce_row_state(const ce_job *jb, int64_t i, int64_t y) {
  const lmloss_tensor *x = &jb->in->logits;
  const lmloss_xform f = lmloss_xform_make(jb->opt->transform);
  return lmloss_cpu_row_state(lmloss_cpu_row(x, i), x->dtype, x->cols, jb->sh.col0, &f,
                              jb->cw ? jb->cw + jb->sh.col0 : NULL, jb->sh.entropy,
                              jb->opt->label_smoothing > 0.0f, y);
}

/* Entry j (a column of this job's logits) of the gradient in x units,
 * exactly (target and argmax). */
static float grad_entry(const ce_job *jb, const lmloss_xform *f, const lmloss_rowstat *s,
                        const lmloss_ce_coef *q, lmloss_ce_upstream u, int64_t j, int64_t y,
                        float x) {
  const float *cw = jb->cw;
  float p = expf(lmloss_rowstat_dk(s, f->k, j, lmloss_xform_w(f, x))) / (1.0f + s->r);
  return lmloss_ce_entry_z(q, s, u, p, cw ? cw[j] : 1.0f, j == y, j == s->a) *
         lmloss_xform_dzdx(f, x);
}

/* One supervised row from its whole row's state: its loss (returned),
 * per-row outputs, and the gradient over this job's columns. */
static double ce_row_finish(const ce_job *jb, int64_t i, int64_t y, const lmloss_rowstate *st) {
  const lmloss_ce_inputs *in = jb->in;
  const lmloss_ce_options *opt = jb->opt;
  const int64_t V = jb->sh.vocab, col0 = jb->sh.col0, n = in->logits.cols;
  const float *cw = jb->cw;
  const void *row = lmloss_cpu_row(&in->logits, i);
  const lmloss_xform f = lmloss_xform_make(opt->transform);
  const int want_entropy = jb->out && lmloss_present(&jb->out->entropy);
  if (!lmloss_rowstate_ok_label(st)) {
    if (jb->out) {
      if (lmloss_present(&jb->out->lse)) *lmloss_cpu_f32_at(&jb->out->lse, i) = NAN;
      if (want_entropy) *lmloss_cpu_f32_at(&jb->out->entropy, i) = NAN;
      if (lmloss_present(&jb->out->argmax))
        ((int64_t *)jb->out->argmax.data)[i * jb->out->argmax.row_stride] = -1;
    }
    if (jb->dlogits)
      lmloss_cpu_row_fill(lmloss_cpu_row_mut(jb->dlogits, i), jb->dlogits->dtype, n, NAN);
    return NAN;
  }
  const lmloss_rowstat s = st->s;
  const float cy = cw ? cw[y] : 1.0f;
  const lmloss_ce_terms c = lmloss_ce_terms_make(&s, f.k, st->wy, cy, (float)jb->class_sum,
                                                 opt->label_smoothing, V, opt->dft);
  const float tw =
      lmloss_present(&in->token_weight) ? *lmloss_cpu_f32_at(&in->token_weight, i) : 1.0f;
  const double loss = lmloss_ce_row_loss(&c, tw, opt->z_loss);
  if (jb->out) {
    if (lmloss_present(&jb->out->lse)) *lmloss_cpu_f32_at(&jb->out->lse, i) = (float)c.lse;
    if (want_entropy) *lmloss_cpu_f32_at(&jb->out->entropy, i) = lmloss_rowstat_entropy(&s);
    if (lmloss_present(&jb->out->argmax))
      ((int64_t *)jb->out->argmax.data)[i * jb->out->argmax.row_stride] = s.a;
  }
  if (!jb->dlogits) return loss;

  float up = opt->grad_output;
  if (jb->dloss) up = *lmloss_cpu_f32_at(jb->dloss, jb->dloss->rows == 1 ? 0 : i);
  const lmloss_ce_upstream u =
      lmloss_ce_upstream_make(&c, opt->z_loss, (float)(up * jb->scale * tw));
  /* Exact entries that lie in these columns first: the pass below may
   * overwrite the logits. */
  const int has_y = y >= col0 && y < col0 + n, has_a = s.a >= col0 && s.a < col0 + n;
  float gy = 0.0f, ga = 0.0f;
  if (has_y)
    gy = grad_entry(jb, &f, &s, &c.q, u, y, y, lmloss_load(row, in->logits.dtype, y - col0));
  if (has_a)
    ga = s.a == y ? gy
                  : grad_entry(jb, &f, &s, &c.q, u, s.a, y,
                               lmloss_load(row, in->logits.dtype, s.a - col0));
  float P, Q;
  lmloss_ce_pass_coefs(&c.q, &s, u, &P, &Q);
  void *g = lmloss_cpu_row_mut(jb->dlogits, i);
  lmloss_cpu_row_grad(row, in->logits.dtype, n, &f, cw ? cw + col0 : NULL, s.m, P, 0.0f, Q, g,
                      jb->dlogits->dtype);
  if (has_y) lmloss_store(g, jb->dlogits->dtype, y - col0, gy);
  if (has_a) lmloss_store(g, jb->dlogits->dtype, s.a - col0, ga);
  return loss;
}

/* A supervised row: its whole row's state, merged by the caller or
 * formed here, then the finish. */
static double ce_row(const ce_job *jb, int64_t i, int64_t y) {
  const lmloss_rowstate st =
      jb->merged ? lmloss_rowstate_unpack(lmloss_cpu_row(jb->merged, i), jb->sh.vocab)
                 : ce_row_state(jb, i, y);
  return ce_row_finish(jb, i, y, &st);
}

static lmloss_status ce_rows(const lmloss_context *ctx, ce_job *jb, void *ws) {
  const lmloss_ce_inputs *in = jb->in;
  const lmloss_ce_options *opt = jb->opt;
  const int64_t N = in->logits.rows, n = in->logits.cols, V = jb->sh.vocab;
  const float *cw = jb->cw;
  /* no rows may come without a workspace (NULL), and nothing indexes it */
  double *row_loss = N ? (double *)((char *)ws + LMLOSS_CE_WS_HEADER) : NULL;
  int64_t *rows = N ? (int64_t *)(row_loss + 2 * N) : NULL;

  int64_t M = 0;
  double denom = 0.0;
  for (int64_t i = 0; i < N; i++) {
    int64_t y = lmloss_index_at(&in->target, i, 0);
    if (y == opt->ignore_index) continue;
    rows[M++] = i;
    denom += cw ? cw[y] : 1.0;
  }
  jb->class_sum = (double)V;
  if (cw) {
    jb->class_sum = 0.0;
    for (int64_t j = 0; j < V; j++)
      jb->class_sum += cw[j];
  }
  switch (opt->reduction) {
  case LMLOSS_REDUCE_MEAN: jb->scale = denom > 0.0 ? 1.0 / denom : 0.0; break;
  case LMLOSS_REDUCE_SUM_OVER_ITEMS: jb->scale = 1.0 / opt->num_items; break;
  default: jb->scale = 1.0;
  }

  const int nt = lmloss_cpu_row_threads(ctx, N * n);
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(dynamic, 4) nowait
    for (int64_t r = 0; r < M; r++) {
      int64_t i = rows[r];
      row_loss[r] = ce_row(jb, i, lmloss_index_at(&in->target, i, 0));
    }
    /* Ignored rows: per-row outputs are zero; gradient rows zeroed on request. */
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; i++) {
      if (lmloss_index_at(&in->target, i, 0) != opt->ignore_index) continue;
      if (jb->out) {
        if (opt->reduction == LMLOSS_REDUCE_NONE) *lmloss_cpu_f32_at(&jb->out->loss, i) = 0.0f;
        if (lmloss_present(&jb->out->lse)) *lmloss_cpu_f32_at(&jb->out->lse, i) = 0.0f;
        if (lmloss_present(&jb->out->entropy)) *lmloss_cpu_f32_at(&jb->out->entropy, i) = 0.0f;
        if (lmloss_present(&jb->out->argmax))
          ((int64_t *)jb->out->argmax.data)[i * jb->out->argmax.row_stride] = -1;
      }
      if (jb->dlogits && opt->zero_ignored_rows)
        lmloss_cpu_row_fill(lmloss_cpu_row_mut(jb->dlogits, i), jb->dlogits->dtype, n, 0.0f);
    }
  }
  if (!jb->out) return LMLOSS_OK;
  if (opt->reduction == LMLOSS_REDUCE_NONE) {
    for (int64_t r = 0; r < M; r++)
      *lmloss_cpu_f32_at(&jb->out->loss, rows[r]) = (float)row_loss[r];
    return LMLOSS_OK;
  }
  double total = 0.0;
  for (int64_t r = 0; r < M; r++)
    total += row_loss[r];
  *(float *)jb->out->loss.data = (float)(total * jb->scale);
  return LMLOSS_OK;
}

/* A [V, 1] F32 tensor as a contiguous array: its own data when the stride
 * is 1, else a copy in *owned (free it). NULL: out of memory. */
static const float *contiguous(const lmloss_tensor *t, float **owned) {
  *owned = NULL;
  if (t->row_stride == 1) return (const float *)t->data;
  float *c = (float *)malloc(sizeof(float) * (size_t)t->rows);
  for (int64_t j = 0; c && j < t->rows; j++)
    c[j] = *lmloss_cpu_f32_at(t, j);
  *owned = c;
  return c;
}

/* The stats phase: every row's state (ignored rows: empty, not read). */
static lmloss_status ce_states(const lmloss_context *ctx, const ce_job *jb) {
  const lmloss_ce_inputs *in = jb->in;
  const int64_t N = in->logits.rows;
  const int nt = lmloss_cpu_row_threads(ctx, N * in->logits.cols);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
  for (int64_t i = 0; i < N; i++) {
    const int64_t y = lmloss_index_at(&in->target, i, 0);
    const lmloss_rowstate st =
        y == jb->opt->ignore_index ? lmloss_rowstate_empty() : ce_row_state(jb, i, y);
    lmloss_rowstate_pack(&st, lmloss_cpu_row_mut(jb->states, i));
  }
  return LMLOSS_OK;
}

/* The job's phase, with the class weights as one contiguous array. */
static lmloss_status ce_run(const lmloss_context *ctx, ce_job *jb, void *ws) {
  float *owned = NULL;
  if (lmloss_present(&jb->in->class_weight)) {
    jb->cw = contiguous(&jb->in->class_weight, &owned);
    if (!jb->cw) return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "no host memory for class weights");
  }
  lmloss_status s = jb->states ? ce_states(ctx, jb) : ce_rows(ctx, jb, ws);
  free(owned);
  return s;
}

lmloss_status lmloss_cpu_cross_entropy(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                       const lmloss_ce_options *opt, const lmloss_ce_outputs *out,
                                       void *ws, size_t ws_bytes, lmloss_row_keep *keep) {
  ce_job jb = {.in = in,
               .opt = opt,
               .out = out,
               .dlogits = lmloss_present(&out->dlogits) ? &out->dlogits : NULL,
               .sh = lmloss_cpu_whole_row(in->logits.cols, lmloss_present(&out->entropy))};
  return ce_run(ctx, &jb, ws);
}

lmloss_status lmloss_cpu_cross_entropy_backward(const lmloss_context *ctx,
                                                const lmloss_ce_inputs *in,
                                                const lmloss_ce_options *opt,
                                                const lmloss_tensor *dloss,
                                                const lmloss_tensor *dlogits, void *ws,
                                                size_t ws_bytes, lmloss_row_keep *keep) {
  ce_job jb = {.in = in,
               .opt = opt,
               .dloss = dloss,
               .dlogits = dlogits,
               .sh = lmloss_cpu_whole_row(in->logits.cols, 0)};
  return ce_run(ctx, &jb, ws);
}

lmloss_status lmloss_cpu_ce_state(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                  const lmloss_ce_options *opt, const lmloss_shard *sh,
                                  const lmloss_tensor *state) {
  ce_job jb = {.in = in, .opt = opt, .sh = *sh, .states = state};
  return ce_run(ctx, &jb, NULL);
}

lmloss_status lmloss_cpu_ce_finish(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                   const lmloss_ce_options *opt, const lmloss_shard *sh,
                                   const lmloss_tensor *state, const lmloss_ce_outputs *out,
                                   const lmloss_tensor *dloss, const lmloss_tensor *dlogits,
                                   void *ws, size_t ws_bytes) {
  ce_job jb = {.in = in,
               .opt = opt,
               .out = out,
               .dloss = dloss,
               .dlogits = dlogits,
               .sh = *sh,
               .merged = state};
  return ce_run(ctx, &jb, ws);
}
