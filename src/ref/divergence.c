/*
 * divergence.c - float64 reference of the divergences (lmloss.h), written
 * from their definitions apart from math/divergence.h.
 *
 * Per row pair, in double: log p and log q from each row's max-split
 * statistics (refrow.h), delta_j = log q_j - log p_j, the mixture's
 * log M_j as a log-add-exp of the two, and every summand in its
 * non-negative form a log(a / b) - a + b; p - q as -p expm1(delta) (two
 * near-1 probabilities of a confident row would cancel even in double).
 * Gradients with respect to the student's z (a the student's argmax;
 * the row sums relative to a's value, which even double would lose where
 * the teacher peaks elsewhere and both terms are about the margin):
 *   KL: p - q;  REVERSE_KL: -p ((delta - delta_a) - sum_k p_k (delta_k - delta_a));
 *   JSD: -(1 - beta) p (dmu_j - sum_k p_k dmu_k), dmu = log(M / p) - the
 *        same at a, as log(u_a + w_a e^(delta - delta_a)) (jsd_dmu);
 *   TVD: p (s_j - sum_k p_k s_k) / 2, s = sign(p - q);  CE: p - [j == y].
 */
#include "refrow.h"

/* a log(a / b) - a + b with x = log(a / b). */
static double kl_term(double a, double b, double x) {
  if (a == 0.0) return b;
  if (x < -1.0) return b + a * (x - 1.0);
  if (fabs(x) < 1e-3) return a * x * x * (0.5 - x / 6.0 + x * x / 24.0);
  return a * (x + expm1(-x));
}

/* log(M / p) = log(1 - beta + beta e^delta): a log-add-exp would round
 * log(1 - beta) + log(beta)'s parts to 1e-17 where delta is 0. */
static double log_m_over_p(double delta, double beta) {
  if (delta > 700.0) return delta + log(beta) + log1p((1.0 - beta) * exp(-delta) / beta);
  return log1p(beta * expm1(delta));
}

/* log(q / M) = -log(beta + (1 - beta) e^-delta), likewise. */
static double log_q_over_m(double delta, double beta) {
  if (delta < -700.0) return delta - log1p(-beta) - log1p(beta * exp(delta) / (1.0 - beta));
  return -log1p((1.0 - beta) * expm1(-delta));
}

/* log(M_j / p_j) - log(M_a / p_a) = log(u_a + w_a e^h), h = delta_j -
 * delta_a, u_a and w_a the rows' shares of M at a: the difference of the
 * two logs would lose it in double too where both are log(1 - beta). */
static double jsd_dmu(double lu_a, double lw_a, double h) {
  if (fabs(h) < 1.0) return log1p(exp(lw_a) * expm1(h));
  const double u = lu_a, v = lw_a + h, hi = u > v ? u : v, lo = u > v ? v : u;
  return hi + log1p(exp(lo - hi));
}

static int64_t label_at(const lmloss_div_inputs *in, const lmloss_div_options *o, int64_t i) {
  if (!lmloss_present(&in->label)) return -1;
  const char *p = ref_row_ptr(&in->label, i);
  int64_t y = in->label.dtype == LMLOSS_I64 ? *(const int64_t *)p : *(const int32_t *)p;
  return y == o->ignore_index ? -2 : y;
}

typedef struct {
  double *xs, *ws, *xt, *wt, *lp, *lq;
} ref_pair;

/* One row pair: D, ce and the student's entropy returned, the gradient
 * written when drow. */
static void pair_row(const lmloss_div_options *o, const ref_pair *b, int64_t V, int64_t y,
                     double scale, double *div, double *ce, double *ent, char *drow,
                     lmloss_dtype odt) {
  ref_xf fs = ref_xf_make(&o->student), ft = ref_xf_make(&o->teacher);
  ref_row s, t;
  ref_row_stats(&fs, b->xs, b->ws, V, &s);
  ref_row_stats(&ft, b->xt, b->wt, V, &t);
  if (!s.finite || !t.finite) {
    *div = *ce = *ent = NAN;
    for (int64_t j = 0; drow && j < V; j++)
      ref_store(drow, odt, j, NAN);
    return;
  }
  const double beta = o->beta;
  double sum = 0.0, rev = 0.0, mix = 0.0, pos = 0.0, neg = 0.0, eq = 0.0, h = 0.0;
  for (int64_t j = 0; j < V; j++)
    b->lp[j] = ref_logp(&fs, &s, b->ws[j]), b->lq[j] = ref_logp(&ft, &t, b->wt[j]);
  const int64_t a = s.a;
  const double d_a = b->lq[a] - b->lp[a];
  /* the shares u_a, w_a of M at a from their log ratio (softplus) */
  const double lr = log(beta) - log1p(-beta) + d_a;
  const double lu_a = -(lr > 0 ? lr + log1p(exp(-lr)) : log1p(exp(lr)));
  const double lw_a = -(lr < 0 ? -lr + log1p(exp(lr)) : log1p(exp(-lr)));
  for (int64_t j = 0; j < V; j++) {
    const double lp = b->lp[j], lq = b->lq[j], p = exp(lp), q = exp(lq);
    const double delta = lq - lp, pq = p > 0.0 ? -p * expm1(delta) : -q;
    if (p > 0.0) h -= p * lp;
    if (o->kind == LMLOSS_DIV_KL) sum += kl_term(q, p, delta);
    if (o->kind == LMLOSS_DIV_REVERSE_KL) sum += kl_term(p, q, -delta);
    if (j != a && p > 0.0) rev += p * (delta - d_a);
    if (o->kind == LMLOSS_DIV_TVD) {
      sum += 0.5 * fabs(pq);
      *(pq > 0.0 ? &pos : pq < 0.0 ? &neg : &eq) += p;
    }
    if (o->kind == LMLOSS_DIV_JSD) {
      const double mu = log_m_over_p(delta, beta), M = (1.0 - beta) * p + beta * q;
      sum += beta * kl_term(q, M, log_q_over_m(delta, beta)) + (1.0 - beta) * kl_term(p, M, -mu);
      if (j != a && p > 0.0) mix += p * jsd_dmu(lu_a, lw_a, delta - d_a);
    }
  }
  *div = sum, *ent = h;
  *ce = y >= 0 ? -b->lp[y] : 0.0;
  for (int64_t j = 0; drow && j < V; j++) {
    const double lp = b->lp[j], p = exp(lp), delta = b->lq[j] - lp;
    const double pq = p > 0.0 ? -p * expm1(delta) : -exp(b->lq[j]);
    double g = pq; /* KL */
    if (o->kind == LMLOSS_DIV_REVERSE_KL) g = p > 0.0 ? -p * ((delta - d_a) - rev) : 0.0;
    if (o->kind == LMLOSS_DIV_TVD)
      g = 0.5 * p * (pq > 0.0 ? 2.0 * neg + eq : pq < 0.0 ? -(2.0 * pos + eq) : neg - pos);
    if (o->kind == LMLOSS_DIV_JSD) {
      g = p > 0.0 ? -(1.0 - beta) * p * (jsd_dmu(lu_a, lw_a, delta - d_a) - mix) : 0.0;
    }
    g *= o->soft_weight;
    if (y >= 0) g += o->hard_weight * (j == y ? expm1(lp) : p);
    ref_store(drow, odt, j, scale * g * ref_dzdx(&fs, b->xs[j]));
  }
}

static lmloss_status div_run(const lmloss_div_inputs *in, const lmloss_div_options *o,
                             const lmloss_div_outputs *out, const lmloss_tensor *dloss,
                             const lmloss_tensor *dx) {
  const int64_t N = in->student.rows, V = in->student.cols;
  ref_pair b = {ref_alloc(V), ref_alloc(V), ref_alloc(V), ref_alloc(V), ref_alloc(V), ref_alloc(V)};
  lmloss_status st = LMLOSS_OK;
  if (!b.xs || !b.ws || !b.xt || !b.wt || !b.lp || !b.lq) {
    st = lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "REF backend: out of host memory");
    goto done;
  }
  int64_t valid = 0;
  for (int64_t i = 0; i < N; i++)
    valid += label_at(in, o, i) != -2;
  const int reduced = o->reduction != LMLOSS_REDUCE_NONE;
  double factor = 1.0, total = 0.0;
  if (o->reduction == LMLOSS_REDUCE_MEAN) factor = valid > 0 ? 1.0 / (double)valid : 0.0;
  if (o->reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) factor = 1.0 / o->num_items;
  for (int64_t i = 0; i < N; i++) {
    const int64_t y = label_at(in, o, i);
    char *drow = dx ? ref_row_mut(dx, i) : NULL;
    double div = 0.0, ce = 0.0, ent = 0.0;
    if (y == -2) {
      for (int64_t j = 0; drow && j < V; j++)
        ref_store(drow, dx->dtype, j, 0.0);
    } else {
      ref_load_row(&in->student, i, b.xs);
      ref_load_row(&in->teacher, i, b.xt);
      double up = dloss ? ref_f32_at(dloss, reduced ? 0 : i) : o->grad_output;
      pair_row(o, &b, V, y, up * factor, &div, &ce, &ent, drow, drow ? dx->dtype : LMLOSS_F32);
    }
    const double loss = y == -2 ? 0.0 : o->soft_weight * div + o->hard_weight * ce;
    total += loss;
    if (!out) continue;
    if (!reduced) *(float *)ref_row_mut(&out->loss, i) = (float)loss;
    if (lmloss_present(&out->divergence)) *(float *)ref_row_mut(&out->divergence, i) = (float)div;
    if (lmloss_present(&out->ce)) *(float *)ref_row_mut(&out->ce, i) = (float)ce;
    if (lmloss_present(&out->entropy)) *(float *)ref_row_mut(&out->entropy, i) = (float)ent;
  }
  if (out && reduced) *(float *)out->loss.data = (float)(total * factor);
done:
  free(b.xs), free(b.ws), free(b.xt), free(b.wt), free(b.lp), free(b.lq);
  return st;
}

lmloss_status lmloss_ref_divergence(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                    const lmloss_div_options *opt, const lmloss_div_outputs *out,
                                    const lmloss_tensor *dloss, const lmloss_tensor *dx, void *ws,
                                    size_t ws_bytes) {
  return div_run(in, opt, out, dloss, dx);
}
