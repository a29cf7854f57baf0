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
  const float *cw;              /* class weights, contiguous, or NULL */
  double class_sum;             /* C */
  double scale;                 /* reduction factor: 1, 1/denominator, 1/num_items */
} ce_job;

/* Entry j of the gradient in x units, exactly (target and argmax). */
static float grad_entry(const ce_job *jb, const lmloss_xform *f, const lmloss_rowstat *s,
                        const lmloss_ce_coef *q, int64_t j, int64_t y, float x, float fac,
                        float dftw, float lse) {
  const float *cw = jb->cw;
  float p = expf(lmloss_rowstat_dk(s, f->k, j, lmloss_xform_w(f, x))) / (1.0f + s->r);
  float gz = dftw * lmloss_ce_grad_z(q, s, p, cw ? cw[j] : 1.0f, j == y, j == s->a) +
             2.0f * jb->opt->z_loss * lse * p;
  return fac * gz * lmloss_xform_dzdx(f, x);
}

/* One supervised row: its loss (returned), per-row outputs, gradient. */
static double ce_row(const ce_job *jb, int64_t i, int64_t y) {
  const lmloss_ce_inputs *in = jb->in;
  const lmloss_ce_options *opt = jb->opt;
  const int64_t V = in->logits.cols;
  const float *cw = jb->cw;
  const void *row = lmloss_cpu_row(&in->logits, i);
  const lmloss_xform f = lmloss_xform_make(opt->transform);
  const int want_entropy = jb->out && lmloss_present(&jb->out->entropy);
  const float e = opt->label_smoothing;
  lmloss_rowstat s;
  int bad;
  lmloss_cpu_row_stats(row, in->logits.dtype, V, &f, cw, want_entropy, e > 0.0f, &s, &bad);
  if (bad || !lmloss_rowstat_finite(&s)) {
    if (jb->out) {
      if (lmloss_present(&jb->out->lse)) *lmloss_cpu_f32_at(&jb->out->lse, i) = NAN;
      if (want_entropy) *lmloss_cpu_f32_at(&jb->out->entropy, i) = NAN;
      if (lmloss_present(&jb->out->argmax))
        ((int64_t *)jb->out->argmax.data)[i * jb->out->argmax.row_stride] = -1;
    }
    if (jb->dlogits)
      lmloss_cpu_row_fill(lmloss_cpu_row_mut(jb->dlogits, i), jb->dlogits->dtype, V, NAN);
    return NAN;
  }
  const float l1r = lmloss_rowstat_l1r(&s);
  const float lse = lmloss_rowstat_lse(&s, f.k);
  const float xy = lmloss_load(row, in->logits.dtype, y);
  const float nll = l1r - lmloss_rowstat_dk(&s, f.k, y, lmloss_xform_w(&f, xy));
  const float cy = cw ? cw[y] : 1.0f;
  const float C = (float)jb->class_sum;
  const float dftw = opt->dft ? expf(-nll) : 1.0f;
  float ce = cy * (1.0f - e) * nll;
  if (e > 0.0f) ce += e / (float)V * (s.u + C * l1r);
  const float tw =
      lmloss_present(&in->token_weight) ? *lmloss_cpu_f32_at(&in->token_weight, i) : 1.0f;
  const double loss = (double)tw * ((double)dftw * ce + (double)opt->z_loss * lse * lse);
  if (jb->out) {
    if (lmloss_present(&jb->out->lse)) *lmloss_cpu_f32_at(&jb->out->lse, i) = lse;
    if (want_entropy) *lmloss_cpu_f32_at(&jb->out->entropy, i) = lmloss_rowstat_entropy(&s);
    if (lmloss_present(&jb->out->argmax))
      ((int64_t *)jb->out->argmax.data)[i * jb->out->argmax.row_stride] = s.a;
  }
  if (!jb->dlogits) return loss;

  float up = opt->grad_output;
  if (jb->dloss) up = *lmloss_cpu_f32_at(jb->dloss, jb->dloss->rows == 1 ? 0 : i);
  const float fac = (float)(up * jb->scale * tw);
  lmloss_ce_coef q;
  q.hot = cy * (1.0f - e);
  q.smooth = e / (float)V;
  q.a_coef = q.hot + e * C / (float)V;
  /* Exact entries first: the pass below may overwrite the logits. */
  const float xa = s.a == y ? xy : lmloss_load(row, in->logits.dtype, s.a);
  const float gy = grad_entry(jb, &f, &s, &q, y, y, xy, fac, dftw, lse);
  const float ga = s.a == y ? gy : grad_entry(jb, &f, &s, &q, s.a, y, xa, fac, dftw, lse);
  const float P = fac * (dftw * q.a_coef + 2.0f * opt->z_loss * lse) / (1.0f + s.r);
  const float Q = fac * dftw * q.smooth;
  void *g = lmloss_cpu_row_mut(jb->dlogits, i);
  lmloss_cpu_row_grad(row, in->logits.dtype, V, &f, cw, s.m, P, 0.0f, Q, g, jb->dlogits->dtype);
  lmloss_store(g, jb->dlogits->dtype, y, gy);
  lmloss_store(g, jb->dlogits->dtype, s.a, ga);
  return loss;
}

static lmloss_status ce_rows(const lmloss_context *ctx, ce_job *jb, void *ws) {
  const lmloss_ce_inputs *in = jb->in;
  const lmloss_ce_options *opt = jb->opt;
  const int64_t N = in->logits.rows, V = in->logits.cols;
  const float *cw = jb->cw;
  double *row_loss = (double *)((char *)ws + LMLOSS_CE_WS_HEADER);
  int64_t *rows = (int64_t *)(row_loss + 2 * N);

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

  const int nt = lmloss_cpu_row_threads(ctx, N * V);
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
        lmloss_cpu_row_fill(lmloss_cpu_row_mut(jb->dlogits, i), jb->dlogits->dtype, V, 0.0f);
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

/* The rows, with the class weights as one contiguous array. */
static lmloss_status ce_run(const lmloss_context *ctx, ce_job *jb, void *ws) {
  float *owned = NULL;
  if (lmloss_present(&jb->in->class_weight)) {
    jb->cw = contiguous(&jb->in->class_weight, &owned);
    if (!jb->cw) return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "no host memory for class weights");
  }
  lmloss_status s = ce_rows(ctx, jb, ws);
  free(owned);
  return s;
}

lmloss_status lmloss_cpu_cross_entropy(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                       const lmloss_ce_options *opt, const lmloss_ce_outputs *out,
                                       void *ws, size_t ws_bytes, lmloss_grad_keep *keep) {
  ce_job jb = {.in = in,
               .opt = opt,
               .out = out,
               .dlogits = lmloss_present(&out->dlogits) ? &out->dlogits : NULL};
  return ce_run(ctx, &jb, ws);
}

lmloss_status lmloss_cpu_cross_entropy_backward(const lmloss_context *ctx,
                                                const lmloss_ce_inputs *in,
                                                const lmloss_ce_options *opt,
                                                const lmloss_tensor *dloss,
                                                const lmloss_tensor *dlogits, void *ws,
                                                size_t ws_bytes, lmloss_grad_keep *keep) {
  ce_job jb = {.in = in, .opt = opt, .dloss = dloss, .dlogits = dlogits};
  return ce_run(ctx, &jb, ws);
}
