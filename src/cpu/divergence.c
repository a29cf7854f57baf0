/*
 * divergence.c - KL, reverse KL, generalized JSD and TVD between a
 * student's and a teacher's rows on the CPU (math/divergence.h), with the
 * student's cross-entropy as a hard term.
 *
 * Per row, both rows are converted to fp32 once into a thread's scratch,
 * then read from cache by branch-free loops that vectorize in the
 * AVX-512 and x86-64-v3 clones (vmath.h): the maxes; the sums Rs, Rt, D,
 * leaving each column's exponents and g - G in the scratch; the losses
 * (and the row constants a gradient needs); the gradient. Sums run in
 * floats of LMLOSS_DIV_RUN columns added in double: D's terms have both
 * signs.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "core/validate.h"
#include "dispatch.h"
#include "math/divergence.h"
#include "rowpass.h"
#include "vmath.h"

#define LMLOSS_DIV_RUN 256
/* every helper a loop calls is inlined into each ISA clone of the loop */
#define DIV_INLINE static inline __attribute__((always_inline))

typedef struct {
  const lmloss_div_options *opt;
  lmloss_xform fs, ft;
  int shared_cap; /* both rows under one transform with a softcap */
  int64_t V;
} div_job;

/* A row pair's scratch, V floats each. Loaded: xs, ws (in es), wt (in
 * et), xt (in dg); after the sums: the exponents below each row's max
 * and g - G. */
typedef struct {
  float *xs, *es, *et, *dg, *grad;
} pair_buf;

/* The row's statistics and, after the loss pass, its constants. */
typedef struct {
  float ms, mt, G, rs, rt, ell, l1s, l1t, es_y;
  float mu_a; /* JSD: log(M / p) at the student's argmax */
  int64_t as, at;
  /* the divergence; the gradients' row sums over j != as (rev: p_j h_j,
   * mix: p_j (mu_j - mu_a), h_j = log(q_j / p_j) - the same at as), which
   * stay small where the sums they stand for cancel; TVD's masses */
  double div, rev, mix, pos, neg, eq;
} pair_row;

/* Both rows into the scratch; 0 when a row holds NaN or +inf (the raw
 * logit, also under softcap) or nothing above -inf. */
static int load_pair(const div_job *jb, const void *xs, lmloss_dtype ds, const void *xt,
                     lmloss_dtype dt, const pair_buf *b) {
  int bad = 0, any_s = 0, any_t = 0;
  for (int64_t j = 0; j < jb->V; j++) {
    const float u = lmloss_load(xs, ds, j), v = lmloss_load(xt, dt, j);
    bad |= (u != u) | (u == INFINITY) | (v != v) | (v == INFINITY);
    any_s |= u > -INFINITY, any_t |= v > -INFINITY;
    b->xs[j] = u, b->dg[j] = v;
    b->es[j] = lmloss_xform_w(&jb->fs, u);
    b->et[j] = lmloss_xform_w(&jb->ft, v);
  }
  return !bad && any_s && any_t;
}

static int64_t first_max(const float *w, int64_t V, float *m) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < V; j++)
    mx = w[j] > mx ? w[j] : mx;
  int64_t a = 0;
  while (w[a] != mx)
    a++;
  *m = mx;
  return a;
}

/* The sums: each column's exponents below its row's max over its w, and
 * g - G over its teacher x. Locals and restrict throughout, so the
 * compiler sees no store that could move a pointer and vectorizes. */
DIV_INLINE void sums(const div_job *jb, pair_row *r, const pair_buf *b, int capped) {
  float *restrict es = b->es, *restrict et = b->et, *restrict dgs = b->dg;
  const float *restrict xs = b->xs;
  const float ms = r->ms, mt = r->mt, G = r->G, ks = jb->fs.k, kt = jb->ft.k;
  const int64_t as = r->as, at = r->at;
  const lmloss_xform f = jb->fs;
  double rs = 0.0, rt = 0.0, d = 0.0;
  for (int64_t j0 = 0; j0 < jb->V; j0 += LMLOSS_DIV_RUN) {
    const int64_t j1 = jb->V - j0 < LMLOSS_DIV_RUN ? jb->V : j0 + LMLOSS_DIV_RUN;
    float s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s1, s2, s3)
    for (int64_t j = j0; j < j1; j++) {
      const float ws = es[j], wt = et[j];
      const float g =
          capped ? lmloss_capped_gap(&f, dgs[j], xs[j]) : lmloss_pair_gap(wt, kt, ws, ks);
      const float a = (ws - ms) * ks, c = (wt - mt) * kt, dg = g - G;
      const float e_s = lmloss_vexp_neg(a, -0.0f), e_t = lmloss_vexp_neg(c, -0.0f);
      es[j] = a, et[j] = c, dgs[j] = dg;
      s3 += fabsf(dg) <= 0.5f ? e_s * lmloss_vexpm1_small(dg) : e_t - e_s;
      s1 += j == as ? 0.0f : e_s;
      s2 += j == at ? 0.0f : e_t;
    }
    rs += s1, rt += s2, d += s3;
  }
  r->rs = (float)rs, r->rt = (float)rt;
  r->l1s = log1pf(r->rs), r->l1t = log1pf(r->rt);
  r->ell = lmloss_pair_ell((float)d, r->rs);
}

/* a log(a / b) - a + b with x = log(a / b) (lmloss_kl_term's value):
 * a phi(x) by its series inside |x| < 1, directly outside, where at most
 * a factor 3.8 cancels. */
DIV_INLINE float kl_term(float a, float b, float x) {
  const float t = fabsf(x) < 1.0f ? a * lmloss_phi_series(x) : a * x - a + b;
  return a == 0.0f ? b : t;
}

DIV_INLINE float p_minus_q(float p, float q, float delta) {
  return fabsf(delta) < 1.0f ? -p * lmloss_vexpm1_small(delta) : p - q;
}

/* The JSD's log(M / p) (mu) and log(q / M) (nu): by log1p of the small
 * forms inside |delta| < 1, else from log M as a log-add-exp of the rows'
 * log-probabilities. */
typedef struct {
  float beta, log_1mb, log_b; /* beta, log(1 - beta), log(beta) */
} jsd_beta;

DIV_INLINE void jsd_logs(float delta, float lp, float lq, const jsd_beta *jb, float *mu,
                         float *nu) {
  const float beta = jb->beta, small = fabsf(delta) < 1.0f, d = small ? delta : 0.0f;
  const float u = lp + jb->log_1mb, v = lq + jb->log_b;
  const float hi = u > v ? u : v, lo = u > v ? v : u;
  const float lm = hi + lmloss_vlog1p_mid(lmloss_vexp_neg(lo - hi, -0.0f));
  /* both forms, then a select: no branch, so the loops vectorize */
  *mu = small ? lmloss_vlog1p_mid(beta * lmloss_vexpm1_small(d)) : lm - lp;
  *nu = small ? -lmloss_vlog1p_mid((1.0f - beta) * lmloss_vexpm1_small(-d)) : lq - lm;
}

/* What the loss and gradient passes read: the scratch after the sums and
 * the row's constants, as locals. */
typedef struct {
  const float *restrict es, *restrict et, *restrict dg, *restrict xs;
  float is, it, ell, l1s, l1t;
} pair_view;

DIV_INLINE pair_view view_of(const pair_row *r, const pair_buf *b) {
  pair_view v = {b->es,  b->et,  b->dg, b->xs, 1.0f / (1.0f + r->rs), 1.0f / (1.0f + r->rt),
                 r->ell, r->l1s, r->l1t};
  return v;
}

/* Column j's p, q, delta and log-probabilities. */
DIV_INLINE void column(const pair_view *v, int64_t j, float *p, float *q, float *delta, float *lp,
                       float *lq) {
  *p = lmloss_vexp_neg(v->es[j], -0.0f) * v->is;
  *q = lmloss_vexp_neg(v->et[j], -0.0f) * v->it;
  *delta = v->dg[j] - v->ell;
  *lp = v->es[j] - v->l1s, *lq = v->et[j] - v->l1t;
}

DIV_INLINE void losses(const div_job *jb, pair_row *r, const pair_buf *b, const jsd_beta *jbe,
                       int kind) {
  const pair_view v = view_of(r, b);
  const float beta = jbe->beta, dg_a = b->dg[r->as];
  const int64_t as = r->as;
  float mu_a = 0.0f;
  if (kind == LMLOSS_DIV_JSD) {
    float p, q, delta, lp, lq, nu;
    column(&v, as, &p, &q, &delta, &lp, &lq);
    jsd_logs(delta, lp, lq, jbe, &mu_a, &nu);
  }
  r->mu_a = mu_a;
  for (int64_t j0 = 0; j0 < jb->V; j0 += LMLOSS_DIV_RUN) {
    const int64_t j1 = jb->V - j0 < LMLOSS_DIV_RUN ? jb->V : j0 + LMLOSS_DIV_RUN;
    float div = 0.0f, rev = 0.0f, mix = 0.0f, pos = 0.0f, neg = 0.0f, eq = 0.0f;
#pragma omp simd reduction(+ : div, rev, mix, pos, neg, eq)
    for (int64_t j = j0; j < j1; j++) {
      float p, q, delta, lp, lq;
      column(&v, j, &p, &q, &delta, &lp, &lq);
      const int rest = j != as && p != 0.0f;
      if (kind == LMLOSS_DIV_KL) div += kl_term(q, p, delta);
      if (kind == LMLOSS_DIV_REVERSE_KL) {
        div += kl_term(p, q, -delta);
        rev += rest ? p * (v.dg[j] - dg_a) : 0.0f;
      }
      if (kind == LMLOSS_DIV_TVD) {
        const float pq = p_minus_q(p, q, delta);
        div += 0.5f * fabsf(pq);
        pos += pq > 0.0f ? p : 0.0f;
        neg += pq < 0.0f ? p : 0.0f;
        eq += pq == 0.0f ? p : 0.0f;
      }
      if (kind == LMLOSS_DIV_JSD) {
        float mu, nu;
        jsd_logs(delta, lp, lq, jbe, &mu, &nu);
        const float M = (1.0f - beta) * p + beta * q;
        div += beta * kl_term(q, M, nu) + (1.0f - beta) * kl_term(p, M, -mu);
        mix += rest ? p * (mu - mu_a) : 0.0f;
      }
    }
    r->div += div, r->rev += rev, r->mix += mix, r->pos += pos, r->neg += neg, r->eq += eq;
  }
}

/* dx = scale (soft d div/dz + hard d ce/dz) dz/dx into b->grad. */
/* The reverse KL's -p_j (delta_j + KL(p||q)) and the JSD's
 * -(1 - beta) p_j (mu_j + KL(p||M)) are formed as -p_j (h_j - rev) and
 * -(1 - beta) p_j ((mu_j - mu_a) - mix): where the teacher peaks away from
 * the student's argmax a, delta_a and the KL are both about the margin
 * and their sum, a's whole entry, would cancel. */
DIV_INLINE void gradient(const div_job *jb, const pair_row *r, const pair_buf *b,
                         const jsd_beta *jbe, int64_t y, float scale, int kind) {
  const lmloss_div_options *o = jb->opt;
  const float beta = jbe->beta, rev = (float)r->rev, mix = (float)r->mix, dg_a = b->dg[r->as];
  const float cpos = (float)(2.0 * r->neg + r->eq), cneg = (float)-(2.0 * r->pos + r->eq);
  const float ceq = (float)(r->neg - r->pos), hard = y >= 0 ? o->hard_weight : 0.0f;
  const float one_minus_py = y == r->as ? r->rs / (1.0f + r->rs) : -1.0f;
  const lmloss_xform f = jb->fs;
  const pair_view v = view_of(r, b);
  const float mu_a = r->mu_a, soft = o->soft_weight;
  float *restrict out = b->grad;
#pragma omp simd
  for (int64_t j = 0; j < jb->V; j++) {
    float p, q, delta, lp, lq, g = 0.0f;
    column(&v, j, &p, &q, &delta, &lp, &lq);
    if (kind == LMLOSS_DIV_KL) g = p_minus_q(p, q, delta);
    if (kind == LMLOSS_DIV_REVERSE_KL) g = p == 0.0f ? 0.0f : -p * ((v.dg[j] - dg_a) - rev);
    if (kind == LMLOSS_DIV_TVD) {
      const float pq = p_minus_q(p, q, delta);
      g = 0.5f * p * (pq > 0.0f ? cpos : pq < 0.0f ? cneg : ceq);
    }
    if (kind == LMLOSS_DIV_JSD) {
      float mu, nu;
      jsd_logs(delta, lp, lq, jbe, &mu, &nu);
      g = p == 0.0f ? 0.0f : -(1.0f - beta) * p * ((mu - mu_a) - mix);
    }
    /* the hard term p - [j == y], with 1 - p_y = R / (1 + R) at the argmax */
    const float ce = j == y ? (one_minus_py < 0.0f ? p - 1.0f : -one_minus_py) : p;
    const float e = lmloss_vexp_neg(-2.0f * fabsf(f.s * v.xs[j] * f.inv_cap), -0.0f);
    const float dzdx = f.cap > 0.0f ? f.k * f.s * (4.0f * e / ((1.0f + e) * (1.0f + e))) : f.k;
    out[j] = scale * (soft * g + hard * ce) * dzdx;
  }
}

/* Everything of one row pair that reads the scratch, per kind. */
DIV_INLINE void pair_kind(const div_job *jb, pair_row *r, const pair_buf *b, int64_t y, int grad,
                          float scale, int kind) {
  const float beta = jb->opt->beta;
  const jsd_beta jbe = {beta, log1pf(-beta), logf(beta)};
  losses(jb, r, b, &jbe, kind);
  if (grad) gradient(jb, r, b, &jbe, y, scale, kind);
}

void lmloss_cpu_div_pair(const div_job *jb, pair_row *r, const pair_buf *b, int64_t y, int grad,
                         float scale);

/* The row pair's statistics, losses and (grad) gradient into b->grad. */
LMLOSS_CPU_DISPATCH
void lmloss_cpu_div_pair(const div_job *jb, pair_row *r, const pair_buf *b, int64_t y, int grad,
                         float scale) {
  r->as = first_max(b->es, jb->V, &r->ms);
  r->at = first_max(b->et, jb->V, &r->mt);
  r->G = jb->shared_cap ? lmloss_capped_gap(&jb->fs, b->dg[r->at], b->xs[r->as])
                        : lmloss_pair_gap(r->mt, jb->ft.k, r->ms, jb->fs.k);
  r->es_y = y >= 0 && y != r->as ? (b->es[y] - r->ms) * jb->fs.k : 0.0f;
  if (jb->shared_cap)
    sums(jb, r, b, 1);
  else
    sums(jb, r, b, 0);
  r->div = r->rev = r->mix = r->pos = r->neg = r->eq = 0.0;
  switch (jb->opt->kind) {
  case LMLOSS_DIV_KL: pair_kind(jb, r, b, y, grad, scale, LMLOSS_DIV_KL); break;
  case LMLOSS_DIV_REVERSE_KL: pair_kind(jb, r, b, y, grad, scale, LMLOSS_DIV_REVERSE_KL); break;
  case LMLOSS_DIV_TVD: pair_kind(jb, r, b, y, grad, scale, LMLOSS_DIV_TVD); break;
  default: pair_kind(jb, r, b, y, grad, scale, LMLOSS_DIV_JSD); break;
  }
}

/* A row's label: -1 without labels, -2 for an ignored row. */
static int64_t label_of(const lmloss_div_inputs *in, const lmloss_div_options *o, int64_t i) {
  if (!lmloss_present(&in->label)) return -1;
  const int64_t y = lmloss_index_at(&in->label, i, 0);
  return y == o->ignore_index ? -2 : y;
}

static void store_row(const float *g, int64_t V, void *out, lmloss_dtype odt) {
  if (odt == LMLOSS_F32) {
    memcpy(out, g, (size_t)V * sizeof(float));
    return;
  }
  for (int64_t j = 0; j < V; j++)
    lmloss_store(out, odt, j, g[j]);
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
    float *w = (float *)malloc((size_t)(5 * V) * sizeof(float));
    const pair_buf b = {w, w + V, w + 2 * V, w + 3 * V, w + 4 * V};
    if (!w) {
#pragma omp atomic write
      oom = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < N; i++) {
      if (!w) continue;
      const int64_t y = label_of(in, opt, i);
      void *drow = dx ? lmloss_cpu_row_mut(dx, i) : NULL;
      double div = 0.0, ce = 0.0;
      if (y == -2) {
        if (drow) lmloss_cpu_row_fill(drow, dx->dtype, V, 0.0f);
      } else if (!load_pair(&jb, lmloss_cpu_row(&in->student, i), in->student.dtype,
                            lmloss_cpu_row(&in->teacher, i), in->teacher.dtype, &b)) {
        div = ce = NAN;
        if (drow) lmloss_cpu_row_fill(drow, dx->dtype, V, NAN);
      } else {
        const float up = !drow   ? 0.0f
                         : dloss ? *lmloss_cpu_f32_at(dloss, reduced ? 0 : i)
                                 : opt->grad_output;
        pair_row r;
        lmloss_cpu_div_pair(&jb, &r, &b, y, drow != NULL, (float)(up * factor));
        div = r.div, ce = y >= 0 ? r.l1s - r.es_y : 0.0;
        if (drow) store_row(b.grad, V, drow, dx->dtype);
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
