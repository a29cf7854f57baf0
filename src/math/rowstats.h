/*
 * rowstats.h - the max-split sum, written once for C and CUDA.
 *
 * A row's logits x pass through the transform w = softcap(s * x) (or s * x
 * without softcap) and z = w * k, where k = 1 / T (softcap on) or s / T
 * (off: then w = x). Statistics are kept in w units for the max and in z
 * units for the sums, so every exponent is formed as (w - m) * k: the
 * difference from the row max is scaled, never a large logit on its own.
 *
 * State of a (partial) row: m = max w, a = first index of the max,
 *   r = sum_{j != a} exp((w_j - m) k)       (the max-split sum, R)
 *   t = sum_{j != a} exp((w_j - m) k) (m - w_j) k   (entropy numerator)
 *   u = sum_j c_j (m - w_j) k,  c = sum_j c_j     (label smoothing)
 * a < 0 marks an empty state. Merging is associative, so the same state
 * serves SIMD blocks, threads, warps, CUDA blocks and vocab chunks.
 */
#ifndef LMLOSS_MATH_ROWSTATS_H
#define LMLOSS_MATH_ROWSTATS_H

#include <math.h>
#include <stdint.h>

#include "lmloss.h"

#if defined(__CUDACC__)
#define LMLOSS_HD __host__ __device__ __forceinline__
#else
#define LMLOSS_HD static inline
#endif

typedef struct {
  float m;
  float r;
  float t;
  float u;
  float c;
  int64_t a;
} lmloss_rowstat;

/* How a transform maps x to w and what k is. */
typedef struct {
  float s;       /* logit scale */
  float cap;     /* softcap, 0 = off */
  float inv_cap; /* 1 / cap */
  float k;       /* z = w * k */
} lmloss_xform;

LMLOSS_HD lmloss_xform lmloss_xform_make(lmloss_transform t) {
  lmloss_xform f;
  f.s = t.logit_scale;
  f.cap = t.softcap;
  f.inv_cap = t.softcap > 0.0f ? 1.0f / t.softcap : 0.0f;
  f.k = t.softcap > 0.0f ? 1.0f / t.temperature : (float)((double)t.logit_scale / t.temperature);
  return f;
}

/* w(x): identity without softcap (the scale lives in k then). */
LMLOSS_HD float lmloss_xform_w(const lmloss_xform *f, float x) {
  return f->cap > 0.0f ? f->cap * tanhf(f->s * x * f->inv_cap) : x;
}

/* dz/dx: the chain rule of scale, softcap and 1/T. With softcap,
 * 1 - tanh(u)^2 is formed as 4e / (1 + e)^2, e = exp(-2|u|), which keeps
 * full relative precision where tanh(u) is close to 1. */
LMLOSS_HD float lmloss_xform_dzdx(const lmloss_xform *f, float x) {
  if (f->cap > 0.0f) {
    float e = expf(-2.0f * fabsf(f->s * x * f->inv_cap));
    return f->k * f->s * (4.0f * e / ((1.0f + e) * (1.0f + e)));
  }
  return f->k;
}

LMLOSS_HD lmloss_rowstat lmloss_rowstat_empty(void) {
  lmloss_rowstat s;
  s.m = -INFINITY;
  s.r = 0.0f;
  s.t = 0.0f;
  s.u = 0.0f;
  s.c = 0.0f;
  s.a = -1;
  return s;
}

/* Merge two partial states of one row. Ties keep the lower index as a and
 * count the other occurrence's 1 into r. */
LMLOSS_HD lmloss_rowstat lmloss_rowstat_merge(lmloss_rowstat x, lmloss_rowstat y, float k) {
  if (y.a < 0) return x;
  if (x.a < 0) return y;
  if (y.m > x.m || (y.m == x.m && y.a < x.a)) {
    lmloss_rowstat tmp = x;
    x = y;
    y = tmp;
  }
  lmloss_rowstat o;
  o.m = x.m;
  o.a = x.a;
  o.c = x.c + y.c;
  float d = (x.m - y.m) * k; /* >= 0 */
  float sc = expf(-d);
  o.r = x.r + (1.0f + y.r) * sc;
  o.t = x.t + sc * (y.t + d * (1.0f + y.r));
  o.u = x.u + y.u + d * y.c;
  return o;
}

/* A row whose max is NaN/+inf/-inf (all -inf) has no finite statistics. */
LMLOSS_HD int lmloss_rowstat_finite(const lmloss_rowstat *s) {
  return s->a >= 0 && isfinite(s->m) && !isnan(s->r);
}

/* log(1 + R): the gap between lse and the max, in z units. */
LMLOSS_HD float lmloss_rowstat_l1r(const lmloss_rowstat *s) { return log1pf(s->r); }

LMLOSS_HD float lmloss_rowstat_lse(const lmloss_rowstat *s, float k) {
  return s->m * k + log1pf(s->r);
}

/* dk_j = (w_j - m) k, the gap below the max in z units; exactly 0 at the
 * argmax a, whose w a second pass may recompute with another rounding
 * (tanh of the softcap): one ulp there would be the whole loss of a
 * confident row. */
LMLOSS_HD float lmloss_rowstat_dk(const lmloss_rowstat *s, float k, int64_t j, float w) {
  return j == s->a ? 0.0f : (w - s->m) * k;
}

/* log p_j = dk_j - log1p(R): exactly -log1p(R) at the argmax. */
LMLOSS_HD float lmloss_rowstat_logp(const lmloss_rowstat *s, float k, int64_t j, float w) {
  return lmloss_rowstat_dk(s, k, j, w) - log1pf(s->r);
}

/* Entropy H = t / (1 + R) + log1p(R): a sum of non-negative terms. */
LMLOSS_HD float lmloss_rowstat_entropy(const lmloss_rowstat *s) {
  return s->t / (1.0f + s->r) + log1pf(s->r);
}

/* The log-probs backward at an exact entry j (an index or the argmax) in
 * z units: dj the sum of dlogp over j's indices, rest that over the row's
 * other indices, dh the entropy's upstream, p = p_j, dk = dk_j and
 * hbar = t / (1 + R):
 *   dz_j = dj (1 - p_j) - rest p_j - dh p_j (dk_j + hbar),
 * with 1 - p_a = R / (1 + R) at the argmax. rest is summed apart, never
 * as D - dj, which cancels where dj is most of D (dlogp {1, -1e-6}: D's
 * rounding is 1% of the argmax entry). */
LMLOSS_HD float lmloss_lp_entry_z(const lmloss_rowstat *s, float p, float dk, float hbar, float dj,
                                  float rest, float dh, int is_argmax) {
  const float q = is_argmax ? s->r / (1.0f + s->r) : 1.0f - p;
  return dj * q - rest * p - dh * p * (dk + hbar);
}

/* A saved row's columns (LMLOSS_ROW_STATS of them, lmloss.h). */
enum { LMLOSS_STAT_M, LMLOSS_STAT_R, LMLOSS_STAT_T, LMLOSS_STAT_A };
typedef char lmloss_stat_columns_fit[LMLOSS_STAT_A + 1 == LMLOSS_ROW_STATS ? 1 : -1];

/* A row's statistics as the log-probs forward saves them: m, r, t and a
 * as a float; a row without finite statistics (ok = 0) NaN and -1. */
LMLOSS_HD void lmloss_rowstat_save(const lmloss_rowstat *s, int ok, float *out) {
  out[LMLOSS_STAT_M] = ok ? s->m : NAN;
  out[LMLOSS_STAT_R] = ok ? s->r : NAN;
  out[LMLOSS_STAT_T] = ok ? s->t : NAN;
  out[LMLOSS_STAT_A] = ok ? (float)s->a : -1.0f;
}

/* A masked-out row's saved statistics: zeros, and no argmax (-1). */
LMLOSS_HD void lmloss_rowstat_save_masked(float *out) {
  out[LMLOSS_STAT_M] = out[LMLOSS_STAT_R] = out[LMLOSS_STAT_T] = 0.0f;
  out[LMLOSS_STAT_A] = -1.0f;
}

/* The saved statistics back, for a row of width V: a column outside
 * [0, V) (-1, or stats not from these logits) leaves the state empty,
 * which lmloss_rowstat_finite rejects (a NaN gradient row). */
LMLOSS_HD lmloss_rowstat lmloss_rowstat_load(const float *in, int64_t V) {
  lmloss_rowstat s = lmloss_rowstat_empty();
  const float a = in[LMLOSS_STAT_A];
  if (!(a >= 0.0f && a < (float)V)) return s;
  s.m = in[LMLOSS_STAT_M];
  s.r = in[LMLOSS_STAT_R];
  s.t = in[LMLOSS_STAT_T];
  s.a = (int64_t)a;
  return s;
}

/* Per-row coefficients of the cross-entropy gradient in z units:
 *   dce/dz_j = A p_j - B_j,  A = c_y (1 - e) + e C / V,
 *   B_j = c_y (1 - e) [j == y] + e c_j / V.
 * It sums to zero over j, which gives the argmax entry exactly:
 *   dce/dz_a = (A - B_a) - A R / (1 + R). */
typedef struct {
  float a_coef; /* A */
  float hot;    /* c_y (1 - e) */
  float smooth; /* e / V (times c_j per entry) */
  float csum;   /* C */
} lmloss_ce_coef;

/* cy = class_weight[y], C = sum_j class_weight[j] (V without weights),
 * e = label smoothing over V columns. Without smoothing no division is
 * formed, so that a kernel's constant options fold. */
LMLOSS_HD lmloss_ce_coef lmloss_ce_coef_make(float cy, float C, float e, int64_t V) {
  lmloss_ce_coef q;
  q.hot = cy * (1.0f - e);
  q.smooth = e > 0.0f ? e / (float)V : 0.0f;
  q.a_coef = e > 0.0f ? q.hot + q.smooth * C : q.hot;
  q.csum = C;
  return q;
}

LMLOSS_HD float lmloss_ce_grad_z(const lmloss_ce_coef *q, const lmloss_rowstat *s, float p,
                                 float cj, int is_target, int is_argmax) {
  /* The complement form only where p_a > 1/2: below that A p_a is exact
   * enough and (A - B) - A R / (1 + R) would cancel. A - B_a is formed
   * from its parts, c_y (1 - e) [a != y] + e (C - c_a) / V: as A minus
   * B_a, both near c_y, it would be their rounding where e is small. */
  if (is_argmax && s->r < 1.0f) {
    const float amb = (is_target ? 0.0f : q->hot) + q->smooth * (q->csum - cj);
    return amb - q->a_coef * (s->r / (1.0f + s->r));
  }
  return q->a_coef * p - ((is_target ? q->hot : 0.0f) + q->smooth * cj);
}

#endif /* LMLOSS_MATH_ROWSTATS_H */
