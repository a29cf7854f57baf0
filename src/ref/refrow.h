/*
 * refrow.h - row statistics of the float64 reference, shared by its files.
 *
 * Written independently of src/math/rowstats.h: everything here is double.
 * A row x maps to w (x itself, or c * tanh(s x / c) with softcap c) and
 * z = w * k (k = s / T without softcap, 1 / T with it), so z - max z is
 * formed as (w - max w) * k and never from a large z on its own. The row
 * keeps the max-split sum: max m (in w units), first argmax a and
 * R = sum over j != a of exp((w_j - m) k); lse = m k + log1p(R).
 */
#ifndef LMLOSS_REF_REFROW_H
#define LMLOSS_REF_REFROW_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/backend.h"
#include "math/dtype.h"

typedef struct {
  double s, cap, k;
} ref_xf;

typedef struct {
  int finite; /* 0: the row holds NaN or +inf, or only -inf */
  int64_t a;  /* first argmax */
  double m;   /* max w */
  double r;   /* R */
  double l1r; /* log1p(R) */
  double lse; /* m k + log1p(R) */
  double ent; /* entropy of p */
} ref_row;

static inline ref_xf ref_xf_make(const lmloss_transform *t) {
  ref_xf f;
  f.s = t->logit_scale;
  f.cap = t->softcap;
  f.k = t->softcap > 0.0f ? 1.0 / (double)t->temperature
                          : (double)t->logit_scale / (double)t->temperature;
  return f;
}

static inline ref_xf ref_xf_identity(void) {
  ref_xf f = {1.0, 0.0, 1.0};
  return f;
}

static inline double ref_w(const ref_xf *f, double x) {
  return f->cap > 0.0 ? f->cap * tanh(f->s * x / f->cap) : x;
}

/* dz/dx. With softcap, sech^2(u) = 4 e / (1 + e)^2 with e = exp(-2|u|):
 * no 1 - tanh^2 cancellation. */
static inline double ref_dzdx(const ref_xf *f, double x) {
  if (f->cap > 0.0) {
    double e = exp(-2.0 * fabs(f->s * x / f->cap));
    return f->k * f->s * (4.0 * e / ((1.0 + e) * (1.0 + e)));
  }
  return f->k;
}

static inline const char *ref_row_ptr(const lmloss_tensor *t, int64_t i) {
  return (const char *)t->data + (size_t)(i * t->row_stride) * lmloss_dtype_size(t->dtype);
}

static inline char *ref_row_mut(const lmloss_tensor *t, int64_t i) {
  return (char *)t->data + (size_t)(i * t->row_stride) * lmloss_dtype_size(t->dtype);
}

static inline void ref_load_row(const lmloss_tensor *t, int64_t i, double *x) {
  const char *p = ref_row_ptr(t, i);
  for (int64_t j = 0; j < t->cols; j++)
    x[j] = lmloss_load(p, t->dtype, j);
}

static inline float ref_f32_at(const lmloss_tensor *t, int64_t i) {
  return *(const float *)ref_row_ptr(t, i);
}

/* Round a double to the dtype once: round to odd into fp32, then the
 * round-to-nearest-even of dtype.h (exact for bf16 and fp16, whose
 * precision is at most 11 bits: 24 >= 2 * 11 + 2). */
static inline float ref_round_odd(double v) {
  float f = (float)v;
  if (isnan(v) || isinf(v) || (double)f == v) return f;
  if (fabs((double)f) > fabs(v)) f = nextafterf(f, 0.0f);
  uint32_t u = lmloss_f32_bits(f) | 1u;
  return lmloss_bits_f32(u);
}

static inline void ref_store(void *row, lmloss_dtype d, int64_t j, double v) {
  lmloss_store(row, d, j, d == LMLOSS_F32 ? (float)v : ref_round_odd(v));
}

/* Statistics of one row of loaded logits x (double), w filled. */
static inline void ref_row_stats(const ref_xf *f, const double *x, double *w, int64_t V,
                                 ref_row *st) {
  int bad = 0, any = 0;
  for (int64_t j = 0; j < V; j++) {
    if (isnan(x[j]) || x[j] == INFINITY) bad = 1;
    if (x[j] != -INFINITY) any = 1;
  }
  st->finite = !bad && any;
  st->a = -1;
  st->m = st->r = st->l1r = st->lse = st->ent = NAN;
  if (!st->finite) return;
  for (int64_t j = 0; j < V; j++)
    w[j] = ref_w(f, x[j]);
  st->a = 0;
  st->m = w[0];
  for (int64_t j = 1; j < V; j++)
    if (w[j] > st->m) st->m = w[j], st->a = j;
  double r = 0.0;
  for (int64_t j = 0; j < V; j++)
    if (j != st->a) r += exp((w[j] - st->m) * f->k);
  st->r = r;
  st->l1r = log1p(r);
  st->lse = st->m * f->k + st->l1r;
  /* H = sum p_j (lse - z_j), every term >= 0; p_j = 0 terms are 0. */
  double h = 0.0;
  for (int64_t j = 0; j < V; j++) {
    double gap = (st->m - w[j]) * f->k + st->l1r; /* lse - z_j */
    double p = exp(-gap);
    if (p > 0.0) h += p * gap;
  }
  st->ent = h;
}

/* log p_j (-log1p(R) at the max and at ties). */
static inline double ref_logp(const ref_xf *f, const ref_row *st, double wj) {
  return (wj - st->m) * f->k - st->l1r;
}

/* Host scratch for one or more rows; the REF backend is host-only. */
static inline double *ref_alloc(int64_t n) {
  return (double *)malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
}

#endif
