/*
 * divergence.h - the divergences between a student row p and a teacher
 * row q, written once for C and CUDA (design.md, section 3).
 *
 * Everything is formed from delta_j = log q_j - log p_j, never from the
 * difference of two log-sum-exps of two rows: with g_j = zt_j - zs_j and
 * G = g's value between the rows' maxes (zt at the teacher's max minus zs
 * at the student's),
 *   delta_j = (g_j - G) - log1p(D / (1 + Rs)),  D = Rt - Rs,
 * and D is summed term by term as e^dt_j - e^ds_j (ds, dt each row's
 * exponent below its max), through e^ds_j expm1(g_j - G) where the two
 * are close. Student == teacher gives g - G = 0 and D = 0 exactly, so
 * every loss and gradient is exactly 0; confident rows keep D's tiny
 * terms; small gaps keep delta to its own rounding.
 */
#ifndef LMLOSS_MATH_DIVERGENCE_H
#define LMLOSS_MATH_DIVERGENCE_H

#include "rowstats.h"
#include "vmath.h"

/* The CPU's vectorized loops call these: inlined always there (an
 * outlined copy is the baseline ISA's, with libm's fmaf). */
#if defined(__CUDACC__)
#define LMLOSS_DIV_HD __host__ __device__ __forceinline__
#else
#define LMLOSS_DIV_HD static inline __attribute__((always_inline))
#endif

/* e^x for x <= 0 (x >= -inf). On the GPU ex2 of x log2(e): one MUFU
 * op, 2 ulp, and the product's rounding costs |x| 2^-24 relative (8e-6
 * at fp32's underflow edge), inside the 1e-5 the suite holds every
 * backend to; results below FLT_MIN flush to 0, the suite's floor. So
 * the CE kernels' exp (design.md, section 5): the divergences there are
 * bound by their instructions, not their bytes. On the CPU the
 * vectorizable series. */
LMLOSS_DIV_HD float lmloss_div_exp(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
#else
  return lmloss_vexp_neg(x, -0.0f);
#endif
}

/* a * b - c * d without the cancellation of two rounded products: each
 * product's rounding error comes back through an fma. */
LMLOSS_DIV_HD float lmloss_diff_of_products(float a, float b, float c, float d) {
  const float ab = a * b, cd = c * d;
  return (ab - cd) + (fmaf(a, b, -ab) - fmaf(c, d, -cd));
}

/* g = zt - zs of one column from the two rows' w and k. On the GPU,
 * where the divergences are bound by their instructions, rows of one k
 * take (wt - ws) k: a rounding more than the recovered products (2 ulp
 * of g), in two instructions instead of nine (the CPU's loops of one k
 * take it through LMLOSS_DIV_ONE_K). */
LMLOSS_DIV_HD float lmloss_pair_gap(float wt, float kt, float ws, float ks) {
#if defined(__CUDA_ARCH__)
  if (kt == ks) return (wt - ws) * ks;
#endif
  if (!(wt > -INFINITY) || !(ws > -INFINITY)) return wt * kt - ws * ks; /* +-inf or NaN */
  return lmloss_diff_of_products(wt, kt, ws, ks);
}

/* g = zt - zs for rows that share one transform with a softcap c:
 * (c / T)(tanh ut - tanh us) = (c / T) sinh(ut - us) / (cosh ut cosh us),
 * u = s x / c, so g keeps its own precision instead of the fp32 rounding
 * of w at c's magnitude, which would be all of a small gap. */
LMLOSS_DIV_HD float lmloss_capped_gap(const lmloss_xform *f, float xt, float xs) {
  const float ut = f->s * xt * f->inv_cap, us = f->s * xs * f->inv_cap;
  if (fabsf(ut) < 40.0f && fabsf(us) < 40.0f)
    return f->cap * f->k * sinhf(f->s * (xt - xs) * f->inv_cap) / (coshf(ut) * coshf(us));
  return (lmloss_xform_w(f, xt) - lmloss_xform_w(f, xs)) * f->k; /* far out: w is exact enough */
}

/* g_j - G = dt_j - ds_j, each side of it a difference: the gap form
 * where the rows are close (its operands small: a small gap keeps its
 * precision, identical rows give 0), the exponents' where the rows sit
 * far apart (a teacher offset by 1e30 leaves g - G nothing). */
LMLOSS_DIV_HD float lmloss_pair_dg(float g, float G, float ds, float dt) {
  const float near = g - G;
  /* near - near == 0: near is finite (g and G overflow where k x w does:
   * a temperature near FLT_MIN; the exponents' difference is right there) */
  return fabsf(g) + fabsf(G) <= fabsf(dt) + fabsf(ds) && near - near == 0.0f ? near : dt - ds;
}

/* One column's term of D = Rt - Rs, e^dt - e^ds, from both exponentials
 * (es = e^ds, et = e^dt) and dg = g_j - G (= dt - ds where both are
 * finite): es expm1(dg) where the rows are close, else the difference,
 * where nothing cancels (and -inf exponents give no NaN). The series runs
 * on 0 elsewhere: no branch a column. */
LMLOSS_DIV_HD float lmloss_pair_d_of(float es, float et, float dg) {
  const int near = fabsf(dg) <= 0.5f;
  const float em = lmloss_vexpm1_small(near ? dg : 0.0f);
  return near ? es * em : et - es;
}

/* log1p(D / (1 + Rs)): log((1 + Rt) / (1 + Rs)), the part of
 * log q_j - log p_j that the rows' sums add to the columns' gaps. */
LMLOSS_DIV_HD float lmloss_pair_ell(float d, float rs, float rt) {
  const float x = d / (1.0f + rs);
  /* near x = -1 (a flat student, a peaked teacher) 1 + x would cancel
   * D's rounding up to 1e4-fold; there the two sums part, and their own
   * logs lose nothing */
  return x < -0.5f ? log1pf(rt) - log1pf(rs) : log1pf(x);
}

/* log(1 + e^x) without overflow, and to its own precision where small. */
LMLOSS_DIV_HD float lmloss_softplus(float x) {
  return x > 0.0f ? x + log1pf(expf(-x)) : log1pf(expf(x));
}

/* phi(x) = x - 1 + e^-x >= 0, the KL summand per unit of mass, for
 * |x| < 1 as x^2 times expm1's tail at -x (lmloss_vexpm1_tail), where
 * x + expm1(-x) would cancel. Pure arithmetic, so the CPU's loops
 * vectorize over it. */
LMLOSS_DIV_HD float lmloss_phi_series(float x) { return x * x * lmloss_vexpm1_tail(-x); }

/* a log(a / b) - a + b with x = log(a / b): a summand of KL(a || b)
 * whose row sum is the divergence, each one >= 0. a phi(x) by its series
 * inside |x| < 1, directly outside (where at most a factor 3.8 cancels,
 * and e^-x, which would overflow, is not formed); both computed, then a
 * select, so the CPU's loops vectorize. a = 0 gives b, whatever x is. */
LMLOSS_DIV_HD float lmloss_kl_term(float a, float b, float x) {
  const float t = fabsf(x) < 1.0f ? a * lmloss_phi_series(x) : a * x - a + b;
  return a == 0.0f ? b : t;
}

/* The forward KL's summand q log(q / p) - q + p, and p - q into *pq, from
 * delta = log(q / p): inside |delta| < 1 from one series, s = (e^delta -
 * 1 - delta) / delta^2, as p delta^2 (1 - s (1 - delta)) (each >= 0, no
 * cancellation) and -p expm1(delta); outside directly, where at most a
 * factor 3.8 cancels in the summand and 1.6 in p - q. q = 0 gives p,
 * whatever delta is. */
LMLOSS_DIV_HD float lmloss_kl_fwd(float p, float q, float delta, float *pq) {
  const int small = fabsf(delta) < 1.0f;
  const float d = small ? delta : 0.0f, s = lmloss_vexpm1_tail(d);
  *pq = small ? -p * (d * fmaf(s, d, 1.0f)) : p - q;
  const float t = small ? p * (d * d) * fmaf(s, d - 1.0f, 1.0f) : q * delta - q + p;
  return q == 0.0f ? p : t;
}

/* The pair's constants of a call: both rows' transforms, whether they
 * share one with a softcap (g by lmloss_capped_gap), and the JSD's beta,
 * log(1 - beta) and log(beta). */
typedef struct {
  lmloss_xform fs, ft;
  int capped;
  float beta, log_1mb, log_b;
} lmloss_div_pair;

LMLOSS_DIV_HD lmloss_div_pair lmloss_div_pair_make(const lmloss_div_options *o) {
  const lmloss_transform *ts = &o->student, *tt = &o->teacher;
  lmloss_div_pair pr;
  pr.fs = lmloss_xform_make(*ts), pr.ft = lmloss_xform_make(*tt);
  pr.capped = ts->softcap > 0.0f && ts->softcap == tt->softcap &&
              ts->logit_scale == tt->logit_scale && ts->temperature == tt->temperature;
  pr.beta = o->beta, pr.log_1mb = log1pf(-o->beta), pr.log_b = logf(o->beta);
  return pr;
}

/* How a pass's columns are transformed, a constant of each compiled
 * version of the loops (the plain one vectorizes): SHARED_CAP, both rows
 * under one transform with a softcap (g through lmloss_capped_gap);
 * STUDENT_CAP, the student's softcap (its chain rule in the gradient);
 * ONE_K: one k for both rows and no shared softcap, so g is
 * lmloss_pair_gap's GPU form (wt - ws) k with no test a column. */
enum { LMLOSS_DIV_SHARED_CAP = 1, LMLOSS_DIV_STUDENT_CAP = 2, LMLOSS_DIV_ONE_K = 4 };

/* The pair's mode: which of the two its transforms make. */
LMLOSS_DIV_HD int lmloss_div_pair_mode(const lmloss_div_pair *pr) {
  return (pr->capped ? LMLOSS_DIV_SHARED_CAP : 0) |
         (pr->fs.cap > 0.0f ? LMLOSS_DIV_STUDENT_CAP : 0);
}

/* g = zt - zs of columns of the teacher (w wt, raw xt) and the student. */
LMLOSS_DIV_HD float lmloss_div_gap(const lmloss_div_pair *pr, int capped, float wt, float xt,
                                   float ws, float xs) {
  if (capped & LMLOSS_DIV_ONE_K) return (wt - ws) * pr->fs.k;
  return capped & LMLOSS_DIV_SHARED_CAP ? lmloss_capped_gap(&pr->fs, xt, xs)
                                        : lmloss_pair_gap(wt, pr->ft.k, ws, pr->fs.k);
}

/* A row pair's constants once its statistics are known, and the loss
 * sweep's sums. */
typedef struct {
  float ms, mt, ks, kt, G, is, it, ell, l1s, l1t, rs;
  float dg_a; /* g - G at the student's argmax a */
  /* the JSD at a: log u_a and log w_a, u_a = (1 - beta) p_a / M_a and
   * w_a = beta q_a / M_a, the rows' shares of the mixture there */
  float lu_a, lw_a;
  int64_t as;
} lmloss_div_row;

/* From the statistics: each row's max (w) and R, D = Rt - Rs, the
 * student's first argmax as with raw xs_a, and the teacher's argmax's raw
 * xt_at; the raw x of both rows at as (xs_a, xt_as) give the argmax terms:
 * g - G there and the JSD's shares, each from its log ratio by softplus,
 * exact where one of them is all but 1 (forming log(1 - beta) -
 * log(M_a / p_a) instead rounded it to 2e-7). */
LMLOSS_DIV_HD lmloss_div_row lmloss_div_row_make(const lmloss_div_pair *pr, float ms, float mt,
                                                 float rs, float rt, float d, int64_t as,
                                                 float xs_a, float xt_at, float xt_as) {
  lmloss_div_row r;
  r.ms = ms, r.mt = mt, r.ks = pr->fs.k, r.kt = pr->ft.k, r.rs = rs, r.as = as;
  r.G = lmloss_div_gap(pr, pr->capped, mt, xt_at, ms, xs_a);
  r.is = 1.0f / (1.0f + rs), r.it = 1.0f / (1.0f + rt);
  r.l1s = log1pf(rs), r.l1t = log1pf(rt);
  r.ell = lmloss_pair_ell(d, rs, rt);
  const float ws = lmloss_xform_w(&pr->fs, xs_a), wt = lmloss_xform_w(&pr->ft, xt_as);
  r.dg_a = lmloss_pair_dg(lmloss_div_gap(pr, pr->capped, wt, xt_as, ws, xs_a), r.G, 0.0f,
                          (wt - mt) * r.kt);
  const float lr = (pr->log_b - pr->log_1mb) + (r.dg_a - r.ell);
  r.lu_a = -lmloss_softplus(lr), r.lw_a = -lmloss_softplus(-lr);
  return r;
}

LMLOSS_DIV_HD float lmloss_div_p_minus_q(float p, float q, float delta) {
  return fabsf(delta) < 1.0f ? -p * lmloss_vexpm1_small(delta) : p - q;
}

/* The JSD's log(M / p) (mu) and log(q / M) (nu): inside |delta| < 1 the
 * smaller of the two by log1p of its small form (mu's beta expm1(delta)
 * for beta <= 1/2, else nu's) and the other as delta minus it, which is
 * at least delta / 2 (no cancellation); outside from log M as a
 * log-add-exp of the rows' log-probabilities. Both arguments are formed,
 * then a select, then one log1p: no branch, and one logarithm a column. */
LMLOSS_DIV_HD void lmloss_div_jsd_logs(const lmloss_div_pair *pr, float delta, float lp, float lq,
                                       float *mu, float *nu) {
  const float beta = pr->beta, small = fabsf(delta) < 1.0f, d = small ? delta : 0.0f;
  const float u = lp + pr->log_1mb, v = lq + pr->log_b;
  const float hi = u > v ? u : v, lo = u > v ? v : u;
  const int mu_first = beta <= 0.5f;
  /* mu (beta <= 1/2), or -nu = log1p((1 - beta) expm1(-delta)) */
  const float c = mu_first ? beta : 1.0f - beta, x = mu_first ? d : -d;
  const float y = small ? c * lmloss_vexpm1_small(x) : lmloss_div_exp(lo - hi);
  const float one = lmloss_vlog1p_mid(y), lm = hi + one;
  *mu = small ? (mu_first ? one : d + one) : lm - lp;
  *nu = small ? (mu_first ? d - one : -one) : lq - lm;
}

/* The JSD's log(M_j / p_j) - log(M_a / p_a) = log(u_a + w_a e^h_j), h_j =
 * delta_j - delta_a (= dg_j - dg_a): by log1p(w_a expm1(h)) inside
 * |h| < 1, else as a log-add-exp. Never the difference of the two logs:
 * where the student's mass sits on columns the teacher all but ignores,
 * both are log(1 - beta) to 1e-20 and their rounding would be all of it. */
LMLOSS_DIV_HD float lmloss_div_jsd_dmu(const lmloss_div_row *r, float h) {
  const float small = fabsf(h) < 1.0f, d = small ? h : 0.0f;
  const float u = r->lu_a, v = r->lw_a + h, hi = u > v ? u : v, lo = u > v ? v : u;
  const float y =
      small ? lmloss_div_exp(r->lw_a) * lmloss_vexpm1_small(d) : lmloss_div_exp(lo - hi);
  const float one = lmloss_vlog1p_mid(y);
  return small ? one : hi + one;
}

/* One column of a row pair, from both rows' w and raw x. */
typedef struct {
  float p, q, delta, lp, lq, dg; /* delta = log q - log p, dg = g - G */
} lmloss_div_col;

/* The student's p at a column of transformed logit ws. */
LMLOSS_DIV_HD float lmloss_div_p(const lmloss_div_row *r, float ws) {
  return lmloss_div_exp((ws - r->ms) * r->ks) * r->is;
}

/* The column from its p and q, formed by the caller (the CPU's loss
 * sweep from the statistics' kept exponentials). */
LMLOSS_DIV_HD lmloss_div_col lmloss_div_column_pq(const lmloss_div_pair *pr,
                                                  const lmloss_div_row *r, int capped, float ws,
                                                  float wt, float xs, float xt, float p, float q) {
  lmloss_div_col c;
  const float es = (ws - r->ms) * r->ks, et = (wt - r->mt) * r->kt;
  c.p = p, c.q = q;
  c.dg = lmloss_pair_dg(lmloss_div_gap(pr, capped, wt, xt, ws, xs), r->G, es, et);
  c.delta = c.dg - r->ell;
  c.lp = es - r->l1s, c.lq = et - r->l1t;
  return c;
}

LMLOSS_DIV_HD lmloss_div_col lmloss_div_column(const lmloss_div_pair *pr, const lmloss_div_row *r,
                                               int capped, float ws, float wt, float xs, float xt) {
  return lmloss_div_column_pq(pr, r, capped, ws, wt, xs, xt, lmloss_div_p(r, ws),
                              lmloss_div_exp((wt - r->mt) * r->kt) * r->it);
}

/* A column's share of the loss sweep's sums: the divergence, the row
 * constants the gradients of the reverse KL (rev), the JSD (mix) and TVD
 * (the student's mass where p > q, p < q, p = q) need, and the student's
 * entropy (-p log p, each term >= 0). rest: the column is not the
 * student's argmax and has mass. */
typedef struct {
  float div, rev, mix, pos, neg, eq, ent;
  float h; /* what the kind's gradient reads beside p (lmloss_div_grad_h) */
} lmloss_div_terms;

/* The quantity of a column that its kind's gradient entry reads beside p
 * (lmloss_div_grad_of): p - q for the forward KL and TVD, dg - dg_a for
 * the reverse KL, log(M / p) - log(M_a / p_a) for the JSD. */
LMLOSS_DIV_HD float lmloss_div_grad_h(const lmloss_div_row *r, const lmloss_div_col *c, int kind) {
  if (kind == LMLOSS_DIV_KL || kind == LMLOSS_DIV_TVD)
    return lmloss_div_p_minus_q(c->p, c->q, c->delta);
  if (kind == LMLOSS_DIV_REVERSE_KL) return c->dg - r->dg_a;
  return lmloss_div_jsd_dmu(r, c->dg - r->dg_a);
}

LMLOSS_DIV_HD lmloss_div_terms lmloss_div_loss_terms(const lmloss_div_pair *pr,
                                                     const lmloss_div_row *r,
                                                     const lmloss_div_col *c, int rest, int kind) {
  lmloss_div_terms t = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  t.ent = c->p == 0.0f ? 0.0f : -c->p * c->lp;
  if (kind == LMLOSS_DIV_KL) t.div = lmloss_kl_fwd(c->p, c->q, c->delta, &t.h);
  if (kind == LMLOSS_DIV_REVERSE_KL) {
    t.div = lmloss_kl_term(c->p, c->q, -c->delta);
    t.h = lmloss_div_grad_h(r, c, kind);
    t.rev = rest ? c->p * t.h : 0.0f;
  }
  if (kind == LMLOSS_DIV_TVD) {
    const float pq = t.h = lmloss_div_grad_h(r, c, kind);
    t.div = 0.5f * fabsf(pq);
    t.pos = pq > 0.0f ? c->p : 0.0f;
    t.neg = pq < 0.0f ? c->p : 0.0f;
    t.eq = pq == 0.0f ? c->p : 0.0f;
  }
  if (kind == LMLOSS_DIV_JSD) {
    const float beta = pr->beta;
    float mu, nu;
    lmloss_div_jsd_logs(pr, c->delta, c->lp, c->lq, &mu, &nu);
    const float M = (1.0f - beta) * c->p + beta * c->q;
    t.div = beta * lmloss_kl_term(c->q, M, nu) + (1.0f - beta) * lmloss_kl_term(c->p, M, -mu);
    t.h = lmloss_div_grad_h(r, c, kind);
    t.mix = rest ? c->p * t.h : 0.0f;
  }
  return t;
}

/* The gradient's constants from the loss sweep's sums. The reverse KL's
 * -p_j (delta_j + KL(p||q)) and the JSD's -(1 - beta) p_j (mu_j + KL(p||M))
 * are formed as -p_j ((dg_j - dg_a) - rev) and -(1 - beta) p_j
 * (jsd_dmu_j - mix), the sums over j != a: where the teacher peaks away
 * from the student's argmax a, delta_a and the KL are both about the
 * margin, and their sum (a's whole entry) would cancel. */
typedef struct {
  float rev, mix, cpos, cneg, ceq; /* from the loss sweep's sums */
  float hard, soft, scale;         /* the terms' weights; the upstream gradient */
  float one_minus_py;              /* 1 - p_y when the label is the argmax, else -1 */
  int64_t y;                       /* the label (< 0: none) */
} lmloss_div_grad;

/* The constants from the row's sums over its columns (the loss sweep's,
 * in double); rev and the others as lmloss_div_terms names them. */
LMLOSS_DIV_HD void lmloss_div_grad_sums(lmloss_div_grad *g, double rev, double mix, double pos,
                                        double neg, double eq) {
  g->rev = (float)rev, g->mix = (float)mix;
  g->cpos = (float)(2.0 * neg + eq), g->cneg = (float)-(2.0 * pos + eq);
  g->ceq = (float)(neg - pos);
}

/* A column's entry of the student's gradient from g, its kind's part
 * (lmloss_div_grad_kind), and its raw student logit xs: the hard term,
 * the softcap's chain rule and the scale; label: the column is the
 * row's label. */
LMLOSS_DIV_HD float lmloss_div_grad_tail(const lmloss_div_pair *pr, const lmloss_div_grad *gc,
                                         int label, float p, float g, float xs, int capped) {
  /* the hard term p - [j == y], with 1 - p_y = R / (1 + R) at the argmax */
  const float ce = label ? (gc->one_minus_py < 0.0f ? p - 1.0f : -gc->one_minus_py) : p;
  const lmloss_xform f = pr->fs;
  float dzdx = f.k;
  if (capped & LMLOSS_DIV_STUDENT_CAP) {
    const float e = lmloss_div_exp(-2.0f * fabsf(f.s * xs * f.inv_cap));
    dzdx = f.k * f.s * (4.0f * e / ((1.0f + e) * (1.0f + e)));
  }
  return gc->scale * (gc->soft * g + gc->hard * ce) * dzdx;
}

/* The kind's part of a column's gradient entry from its p and h
 * (lmloss_div_grad_h), with the row's sums in gc. */
LMLOSS_DIV_HD float lmloss_div_grad_of(const lmloss_div_pair *pr, const lmloss_div_grad *gc,
                                       float p, float h, int kind) {
  if (kind == LMLOSS_DIV_KL) return h;
  if (kind == LMLOSS_DIV_REVERSE_KL) return p == 0.0f ? 0.0f : -p * (h - gc->rev);
  if (kind == LMLOSS_DIV_TVD)
    return 0.5f * p * (h > 0.0f ? gc->cpos : h < 0.0f ? gc->cneg : gc->ceq);
  return p == 0.0f ? 0.0f : -(1.0f - pr->beta) * p * (h - gc->mix);
}

/* The kind's part of a column's gradient entry, from its column c. */
LMLOSS_DIV_HD float lmloss_div_grad_kind(const lmloss_div_pair *pr, const lmloss_div_row *r,
                                         const lmloss_div_grad *gc, const lmloss_div_col *c,
                                         int kind) {
  return lmloss_div_grad_of(pr, gc, c->p, lmloss_div_grad_h(r, c, kind), kind);
}

/* Column j's entry of the student's gradient, from its column c and its
 * raw student logit xs. */
LMLOSS_DIV_HD float lmloss_div_grad_entry(const lmloss_div_pair *pr, const lmloss_div_row *r,
                                          const lmloss_div_grad *gc, int64_t j,
                                          const lmloss_div_col *c, float xs, int capped, int kind) {
  return lmloss_div_grad_tail(pr, gc, j == gc->y, c->p, lmloss_div_grad_kind(pr, r, gc, c, kind),
                              xs, capped);
}

#endif
