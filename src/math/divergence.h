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

/* The CPU's vectorized loops call these: inlined always there (an
 * outlined copy is the baseline ISA's, with libm's fmaf). */
#if defined(__CUDACC__)
#define LMLOSS_DIV_HD __host__ __device__ __forceinline__
#else
#define LMLOSS_DIV_HD static inline __attribute__((always_inline))
#endif

/* a * b - c * d without the cancellation of two rounded products: each
 * product's rounding error comes back through an fma. */
LMLOSS_DIV_HD float lmloss_diff_of_products(float a, float b, float c, float d) {
  const float ab = a * b, cd = c * d;
  return (ab - cd) + (fmaf(a, b, -ab) - fmaf(c, d, -cd));
}

/* g = zt - zs of one column from the two rows' w and k. */
LMLOSS_DIV_HD float lmloss_pair_gap(float wt, float kt, float ws, float ks) {
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
  return fabsf(g) + fabsf(G) <= fabsf(dt) + fabsf(ds) ? g - G : dt - ds;
}

/* One column's term of D = Rt - Rs, e^dt - e^ds, from its exponents
 * below each row's max and dg = g_j - G (= dt - ds where both are finite). */
LMLOSS_DIV_HD float lmloss_pair_d_term(float ds, float dg, float dt) {
  if (fabsf(dg) <= 0.5f) return expf(ds) * expm1f(dg);
  return expf(dt) - expf(ds); /* no cancellation left to fear; NaN-free for -inf */
}

/* log1p(D / (1 + Rs)): log((1 + Rt) / (1 + Rs)), the part of
 * log q_j - log p_j that the rows' sums add to the columns' gaps. */
LMLOSS_DIV_HD float lmloss_pair_ell(float d, float rs) { return log1pf(d / (1.0f + rs)); }

/* log(1 + e^x) without overflow, and to its own precision where small. */
LMLOSS_DIV_HD float lmloss_softplus(float x) {
  return x > 0.0f ? x + log1pf(expf(-x)) : log1pf(expf(x));
}

/* phi(x) = x - 1 + e^-x >= 0, the KL summand per unit of mass, for
 * |x| < 1 by its series x^2 (1/2 - x/6 + ... + x^10/12!) (error 2e-10 of
 * phi at |x| = 1), where x + expm1(-x) would cancel. Pure arithmetic, so
 * the CPU's loops vectorize over it. */
LMLOSS_DIV_HD float lmloss_phi_series(float x) {
  float s = fmaf(-x, 1.0f / 479001600.0f, 1.0f / 39916800.0f); /* 1/12!, 1/11! */
  s = fmaf(s, -x, 1.0f / 3628800.0f);
  s = fmaf(s, -x, 1.0f / 362880.0f);
  s = fmaf(s, -x, 1.0f / 40320.0f);
  s = fmaf(s, -x, 1.0f / 5040.0f);
  s = fmaf(s, -x, 1.0f / 720.0f);
  s = fmaf(s, -x, 1.0f / 120.0f);
  s = fmaf(s, -x, 1.0f / 24.0f);
  s = fmaf(s, -x, 1.0f / 6.0f);
  s = fmaf(s, -x, 0.5f);
  return x * x * s;
}

/* a log(a / b) - a + b with x = log(a / b): a summand of KL(a || b)
 * whose row sum is the divergence, each one >= 0. a phi(x) by its series
 * inside |x| < 1, directly outside (where at most a factor 3.8 cancels,
 * and e^-x, which would overflow, is not formed); both computed, then a
 * select, so the CPU's loops vectorize. a = 0 gives b, whatever x is. */
LMLOSS_DIV_HD float lmloss_kl_term(float a, float b, float x) {
  const float t = fabsf(x) < 1.0f ? a * lmloss_phi_series(x) : a * x - a + b;
  return a == 0.0f ? b : t;
}

#endif
