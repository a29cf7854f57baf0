/*
 * divergence.c - KL, reverse KL, generalized JSD and TVD between a
 * student's and a teacher's rows on the CPU (math/divergence.h), with the
 * student's cross-entropy as a hard term.
 *
 * Per row, both rows are converted to fp32 (x and w) once into a
 * thread's scratch, then read four times from cache: the maxes, the sums
 * (Rs, Rt, D), the losses (and the row constants the gradients need), the
 * gradient. Row sums are kept in double: V terms of mixed sign in D.
 */
#include <stdlib.h>

#include "common.h"
#include "core/validate.h"
#include "math/divergence.h"
#include "rowpass.h"

typedef struct {
  const lmloss_div_options *opt;
  lmloss_xform fs, ft;
  int shared_cap; /* both rows under one transform with a softcap */
  int64_t V;
} div_job;

/* A row pair in fp32: the logits x and their transformed w. */
typedef struct {
  float *xs, *xt, *ws, *wt;
} pair_buf;

/* One row pair's statistics (w units for the maxes, as rowstats.h). */
typedef struct {
  int ok;
  float ms, mt, rs, rt, ell, G;
  int64_t as, at;
} pair_row;

/* Everything the gradient needs from the loss pass. */
typedef struct {
  double div, ce;
  double k_rev;              /* REVERSE_KL: the row's KL(p || q) */
  double k_mix;              /* JSD: the row's KL(p || M) */
  double s_pos, s_neg, s_eq; /* TVD: p's mass where p > q, p < q, p == q */
} row_sums;

/* Both rows into the scratch; 0 when a row holds NaN or +inf (the raw
 * logit, also under softcap) or nothing above -inf. */
static int load_pair(const div_job *jb, const void *xs, lmloss_dtype ds, const void *xt,
                     lmloss_dtype dt, const pair_buf *b) {
  int bad = 0, any_s = 0, any_t = 0;
  for (int64_t j = 0; j < jb->V; j++) {
    const float u = lmloss_load(xs, ds, j), v = lmloss_load(xt, dt, j);
    bad |= (u != u) | (u == INFINITY) | (v != v) | (v == INFINITY);
    any_s |= u > -INFINITY, any_t |= v > -INFINITY;
    b->xs[j] = u, b->xt[j] = v;
    b->ws[j] = lmloss_xform_w(&jb->fs, u);
    b->wt[j] = lmloss_xform_w(&jb->ft, v);
  }
  return !bad && any_s && any_t;
}

/* g = zt - zs between column jt of the teacher and js of the student. */
static float gap(const div_job *jb, const pair_buf *b, int64_t jt, int64_t js) {
  if (jb->shared_cap) return lmloss_capped_gap(&jb->fs, b->xt[jt], b->xs[js]);
  return lmloss_pair_gap(b->wt[jt], jb->ft.k, b->ws[js], jb->fs.k);
}

static pair_row pair_stats(const div_job *jb, const pair_buf *b) {
  pair_row r = {1, b->ws[0], b->wt[0], 0.0f, 0.0f, 0.0f, 0.0f, 0, 0};
  for (int64_t j = 1; j < jb->V; j++) {
    if (b->ws[j] > r.ms) r.ms = b->ws[j], r.as = j;
    if (b->wt[j] > r.mt) r.mt = b->wt[j], r.at = j;
  }
  const float ks = jb->fs.k, kt = jb->ft.k;
  r.G = gap(jb, b, r.at, r.as);
  double rs = 0.0, rt = 0.0, d = 0.0;
  for (int64_t j = 0; j < jb->V; j++) {
    const float es = (b->ws[j] - r.ms) * ks, et = (b->wt[j] - r.mt) * kt;
    if (j != r.as) rs += expf(es);
    if (j != r.at) rt += expf(et);
    d += lmloss_pair_d_term(es, gap(jb, b, j, j) - r.G, et);
  }
  r.rs = (float)rs, r.rt = (float)rt;
  r.ell = lmloss_pair_ell((float)d, r.rs);
  return r;
}

/* Column j's p, q and delta = log q - log p; the argmax's exponent is 0
 * by index, never recomputed. */
static void pair_column(const div_job *jb, const pair_row *r, const pair_buf *b, int64_t j,
                        float *p, float *q, float *delta) {
  const float es = j == r->as ? 0.0f : (b->ws[j] - r->ms) * jb->fs.k;
  const float et = j == r->at ? 0.0f : (b->wt[j] - r->mt) * jb->ft.k;
  *p = expf(es) / (1.0f + r->rs);
  *q = expf(et) / (1.0f + r->rt);
  *delta = (gap(jb, b, j, j) - r->G) - r->ell;
}

/* The divergence's summand at a column. */
static float div_term(const lmloss_div_options *o, float p, float q, float delta, float *mix_term) {
  switch (o->kind) {
  case LMLOSS_DIV_KL: return lmloss_kl_term(q, p, delta);
  case LMLOSS_DIV_REVERSE_KL: return lmloss_kl_term(p, q, -delta);
  case LMLOSS_DIV_TVD: return 0.5f * fabsf(lmloss_p_minus_q(p, q, delta));
  default: {
    const float b = o->beta, M = (1.0f - b) * p + b * q;
    *mix_term = lmloss_kl_term(p, M, -lmloss_jsd_mu(delta, b));
    return b * lmloss_kl_term(q, M, lmloss_jsd_nu(delta, b)) + (1.0f - b) * *mix_term;
  }
  }
}

static row_sums loss_pass(const div_job *jb, const pair_row *r, const pair_buf *b, int64_t y) {
  row_sums s = {0};
  for (int64_t j = 0; j < jb->V; j++) {
    float p, q, delta, mix = 0.0f;
    pair_column(jb, r, b, j, &p, &q, &delta);
    s.div += div_term(jb->opt, p, q, delta, &mix);
    s.k_mix += mix;
    if (jb->opt->kind == LMLOSS_DIV_TVD) {
      const float pq = lmloss_p_minus_q(p, q, delta);
      *(pq > 0.0f ? &s.s_pos : pq < 0.0f ? &s.s_neg : &s.s_eq) += p;
    }
  }
  s.k_rev = s.div;
  if (y >= 0) s.ce = log1pf(r->rs) - (y == r->as ? 0.0f : (b->ws[y] - r->ms) * jb->fs.k);
  return s;
}

/* d divergence / d zs_j. */
static float div_grad(const lmloss_div_options *o, const row_sums *s, float p, float q,
                      float delta) {
  if (p == 0.0f && o->kind != LMLOSS_DIV_KL) return 0.0f; /* whatever delta is */
  switch (o->kind) {
  case LMLOSS_DIV_KL: return lmloss_p_minus_q(p, q, delta);
  case LMLOSS_DIV_REVERSE_KL: return -p * (delta + (float)s->k_rev);
  case LMLOSS_DIV_TVD: {
    /* s_j - sum_k p_k s_k, from the masses so no two large sums cancel */
    const float pq = lmloss_p_minus_q(p, q, delta);
    const double c = pq > 0.0f   ? 2.0 * s->s_neg + s->s_eq
                     : pq < 0.0f ? -(2.0 * s->s_pos + s->s_eq)
                                 : s->s_neg - s->s_pos;
    return 0.5f * p * (float)c;
  }
  default: return -(1.0f - o->beta) * p * (lmloss_jsd_mu(delta, o->beta) + (float)s->k_mix);
  }
}

/* The gradient row dx = scale (soft ddiv/dz + hard dce/dz) dz/dx. */
static void grad_pass(const div_job *jb, const pair_row *r, const row_sums *s, const pair_buf *b,
                      int64_t y, float scale, void *out, lmloss_dtype odt) {
  const lmloss_div_options *o = jb->opt;
  for (int64_t j = 0; j < jb->V; j++) {
    float p, q, delta;
    pair_column(jb, r, b, j, &p, &q, &delta);
    float g = o->soft_weight * div_grad(o, s, p, q, delta);
    if (y >= 0 && o->hard_weight > 0.0f) /* p - [j == y], 1 - p_a = R / (1 + R) */
      g += o->hard_weight * (j != y ? p : j == r->as ? -r->rs / (1.0f + r->rs) : p - 1.0f);
    lmloss_store(out, odt, j, scale * g * lmloss_xform_dzdx(&jb->fs, b->xs[j]));
  }
}

/* A row's label: -1 without labels, -2 for an ignored row. */
static int64_t label_of(const lmloss_div_inputs *in, const lmloss_div_options *o, int64_t i) {
  if (!lmloss_present(&in->label)) return -1;
  const int64_t y = lmloss_index_at(&in->label, i, 0);
  return y == o->ignore_index ? -2 : y;
}

lmloss_status lmloss_cpu_divergence(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                    const lmloss_div_options *opt, const lmloss_div_outputs *out,
                                    const lmloss_tensor *dloss, const lmloss_tensor *dx,
                                    void *ws_bytes, size_t nbytes) {
  const int64_t N = in->student.rows, V = in->student.cols;
  const lmloss_transform *ts = &opt->student, *tt = &opt->teacher;
  const int shared = ts->softcap > 0.0f && ts->softcap == tt->softcap &&
                     ts->logit_scale == tt->logit_scale && ts->temperature == tt->temperature;
  const div_job jb = {opt, lmloss_xform_make(*ts), lmloss_xform_make(*tt), shared, V};
  double *row_loss = (double *)((char *)ws_bytes + LMLOSS_CE_WS_HEADER);
  int64_t valid = 0;
  for (int64_t i = 0; i < N; i++)
    valid += label_of(in, opt, i) != -2;
  const int reduced = opt->reduction != LMLOSS_REDUCE_NONE;
  double factor = 1.0;
  if (opt->reduction == LMLOSS_REDUCE_MEAN) factor = valid > 0 ? 1.0 / (double)valid : 0.0;
  if (opt->reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) factor = 1.0 / opt->num_items;
  int oom = 0;
  const int nt = lmloss_cpu_row_threads(ctx, 2 * N * V);
#pragma omp parallel num_threads(nt)
  {
    float *w = (float *)malloc((size_t)(4 * V) * sizeof(float));
    const pair_buf b = {w, w + V, w + 2 * V, w + 3 * V};
    if (!w) {
#pragma omp atomic write
      oom = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < N; i++) {
      if (!w) continue;
      const int64_t y = label_of(in, opt, i);
      const void *xs = lmloss_cpu_row(&in->student, i);
      void *drow = dx ? lmloss_cpu_row_mut(dx, i) : NULL;
      double div = 0.0, ce = 0.0;
      if (y == -2) {
        if (drow) lmloss_cpu_row_fill(drow, dx->dtype, V, 0.0f);
      } else if (!load_pair(&jb, xs, in->student.dtype, lmloss_cpu_row(&in->teacher, i),
                            in->teacher.dtype, &b)) {
        div = ce = NAN;
        if (drow) lmloss_cpu_row_fill(drow, dx->dtype, V, NAN);
      } else {
        const pair_row r = pair_stats(&jb, &b);
        const row_sums s = loss_pass(&jb, &r, &b, y);
        div = s.div, ce = s.ce;
        if (drow) {
          const float up = dloss ? *lmloss_cpu_f32_at(dloss, reduced ? 0 : i) : opt->grad_output;
          grad_pass(&jb, &r, &s, &b, y, (float)(up * factor), drow, dx->dtype);
        }
      }
      row_loss[i] = y == -2 ? 0.0 : opt->soft_weight * div + opt->hard_weight * ce;
      if (out && lmloss_present(&out->divergence))
        *lmloss_cpu_f32_at(&out->divergence, i) = (float)div;
      if (out && lmloss_present(&out->ce)) *lmloss_cpu_f32_at(&out->ce, i) = (float)ce;
      if (out && !reduced) *lmloss_cpu_f32_at(&out->loss, i) = (float)row_loss[i];
    }
    free(w);
  }
  if (oom) return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "CPU backend: no scratch for a row pair");
  if (out && reduced) {
    double total = 0.0; /* in row order: the same bits for any thread count */
    for (int64_t i = 0; i < N; i++)
      total += row_loss[i];
    *(float *)out->loss.data = (float)(total * factor);
  }
  return LMLOSS_OK;
}
