/*
 * rowstate.h - the row contract's state, its merge and the cross-entropy
 * row formulas, written once for C and CUDA.
 *
 * A row op runs in two phases (docs/design.md): a stats phase gives the
 * state of a row's columns [col0, col0 + n) of a vocabulary `vocab` wide,
 * states merge associatively, and a finish phase forms outputs and the
 * gradient of any column range from the merged state. The state is the
 * max-split sum of rowstats.h plus what a finish needs that lies in one
 * column only: the label's transformed logit w_y, carried by the part
 * that holds the label, so the finish of every part knows the loss.
 *
 * Packed (lmloss.h, LMLOSS_ROW_STATE_COLS floats a row, version
 * LMLOSS_ROW_STATE_VERSION): m, r, a (a float: exact for a vocabulary of
 * up to 2^24 columns), w_y, t, u, c, 0, the flags folded into m, a, w_y.
 */
#ifndef LMLOSS_MATH_ROWSTATE_H
#define LMLOSS_MATH_ROWSTATE_H

#include "rowstats.h"

enum {
  LMLOSS_STATE_LABEL = 1,     /* w_y holds the label's w */
  LMLOSS_STATE_NONFINITE = 2, /* a NaN or +inf was seen */
  LMLOSS_STATE_LOGIT = 4      /* a logit above -inf was seen */
};

typedef struct {
  lmloss_rowstat s;
  float wy;
  int flags;
} lmloss_rowstate;

typedef char lmloss_state_columns_fit[LMLOSS_ROW_STATE_COLS == 8 ? 1 : -1];

/* The widest vocabulary whose columns a float holds exactly. */
#define LMLOSS_STATE_MAX_VOCAB ((int64_t)1 << 24)

LMLOSS_HD lmloss_rowstate lmloss_rowstate_empty(void) {
  lmloss_rowstate x;
  x.s = lmloss_rowstat_empty();
  x.wy = 0.0f;
  x.flags = 0;
  return x;
}

/* Merge two parts of one row: the max-split merge of rowstats.h (never a
 * plain sum of 1 + R), the label from the part that holds it, the
 * non-finite flag of either. Associative and commutative up to fp32
 * rounding; the argmax (the lowest column among ties) exactly so. */
LMLOSS_HD lmloss_rowstate lmloss_rowstate_merge(lmloss_rowstate x, lmloss_rowstate y, float k) {
  lmloss_rowstate o;
  o.s = lmloss_rowstat_merge(x.s, y.s, k);
  /* A part without a max (only -inf columns, no softcap) still carries
   * their smoothing sums: c, and u = +inf, their gap to any max. */
  if (y.s.a < 0)
    o.s.u += y.s.u, o.s.c += y.s.c;
  else if (x.s.a < 0)
    o.s.u += x.s.u, o.s.c += x.s.c;
  o.wy = (x.flags & LMLOSS_STATE_LABEL) ? x.wy : y.wy;
  o.flags = x.flags | y.flags;
  return o;
}

/* Statistics a finish can use: finite, and of a row that holds a logit
 * above -inf (with softcap, a part of only -inf has finite sums). */
LMLOSS_HD int lmloss_rowstate_ok(const lmloss_rowstate *x) {
  return (x->flags & (LMLOSS_STATE_NONFINITE | LMLOSS_STATE_LOGIT)) == LMLOSS_STATE_LOGIT &&
         lmloss_rowstat_finite(&x->s);
}

/* ... and its label's w known: what a finish that needs it checks (a
 * state merged from parts none of which held the label has none). */
LMLOSS_HD int lmloss_rowstate_ok_label(const lmloss_rowstate *x) {
  return lmloss_rowstate_ok(x) && (x->flags & LMLOSS_STATE_LABEL);
}

/* Layout version 2 folds the flags into the values (NaN m: non-finite;
 * NaN w_y: no label; a <= -2: no logit above -inf), so that the leading
 * columns alone are a complete state for the families that need no more:
 * an exchange sends LMLOSS_ROW_STATE_EXCHANGE_* columns, not all 8. */
LMLOSS_HD void lmloss_rowstate_pack(const lmloss_rowstate *x, float *out) {
  const float a = (float)x->s.a;
  out[0] = (x->flags & LMLOSS_STATE_NONFINITE) ? NAN : x->s.m;
  out[1] = x->s.r;
  out[2] = x->s.a < 0 ? -1.0f : (x->flags & LMLOSS_STATE_LOGIT) ? a : -2.0f - a;
  out[3] = (x->flags & LMLOSS_STATE_LABEL) ? x->wy : NAN;
  out[4] = x->s.t;
  out[5] = x->s.u;
  out[6] = x->s.c;
  out[7] = 0.0f;
}

/* A packed state back. An argmax outside [0, vocab) (or not an integer:
 * not a state of this vocabulary) reads as non-finite, so its row's
 * results are NaN rather than wrong. */
LMLOSS_HD lmloss_rowstate lmloss_rowstate_unpack(const float *in, int64_t vocab) {
  lmloss_rowstate x = lmloss_rowstate_empty();
  const float m = in[0], wy = in[3];
  float a = in[2];
  if (!isnan(wy)) {
    x.wy = wy;
    x.flags |= LMLOSS_STATE_LABEL;
  }
  if (isnan(m)) x.flags |= LMLOSS_STATE_NONFINITE;
  x.s.u = in[5];
  x.s.c = in[6];
  if (a == -1.0f) return x;
  if (a <= -2.0f)
    a = -2.0f - a;
  else
    x.flags |= LMLOSS_STATE_LOGIT;
  if (!(a >= 0.0f && a < (float)vocab && a == (float)(int64_t)a)) {
    x.flags |= LMLOSS_STATE_NONFINITE;
    return x;
  }
  x.s.m = m;
  x.s.r = in[1];
  x.s.t = in[4];
  x.s.a = (int64_t)a;
  return x;
}

/* What a one-shot row op keeps of its rows for the fused head, each array
 * indexed by the op's row r (NULL: not asked for):
 *  - state[r * LMLOSS_ROW_STATE_COLS]: the row's packed state, as its stats
 *    phase formed it, from which the vocab tiles run the family's finish
 *    (src/core/linear_loop.c);
 *  - the row's exact entries (those a row op forms apart: the K labels'
 *    columns, then the argmax), entry s at cols[r * stride + s] with the
 *    final gradient there, in fp32, at vals[r * stride + s] (NaN for a
 *    column outside [0, V)): a 16-bit gradient row loses much only there,
 *    and dhidden and dbias put it back. */
typedef struct {
  float *state;
  int64_t *cols;
  float *vals;
  int64_t count;  /* entries per row: K (0 without labels) + 1 */
  int64_t stride; /* >= count */
} lmloss_row_keep;

/* Cross-entropy of one row from its merged statistics (lmloss.h's
 * formula): wy = w at the label, cy = class_weight[y], C = sum_j
 * class_weight[j], e = label smoothing over V columns. lse and
 * nll = lse - z_y are formed in double: nll's gap (m - w_y) k is an exact
 * 0 at the max, and GRPO's log-ratio, -nll less an old log-prob, keeps
 * its digits. */
typedef struct {
  double lse, nll;
  float dftw;       /* sg(p_y) with DFT, else 1 */
  double ce;        /* the smoothed, class-weighted CE before DFT */
  lmloss_ce_coef q; /* its gradient's coefficients in z units */
} lmloss_ce_terms;

LMLOSS_HD lmloss_ce_terms lmloss_ce_terms_make(const lmloss_rowstat *s, float k, float wy, float cy,
                                               float C, float e, int64_t V, int dft) {
  lmloss_ce_terms c;
  const float l1r = log1pf(s->r);
  c.lse = (double)s->m * k + l1r;
  c.nll = (double)(s->m - wy) * k + l1r;
  c.dftw = dft ? expf(-(float)c.nll) : 1.0f;
  c.q = lmloss_ce_coef_make(cy, C, e, V);
  c.ce = c.q.hot * c.nll;
  if (e > 0.0f) c.ce += (double)c.q.smooth * ((double)C * l1r + s->u);
  return c;
}

/* loss_i = w_i (sg(p_y) ce_i + z_loss lse^2), in double for the sums. */
LMLOSS_HD double lmloss_ce_row_loss(const lmloss_ce_terms *c, float tw, float z_loss) {
  return (double)tw * (c->dftw * c->ce + (double)z_loss * c->lse * c->lse);
}

/* A row's upstream factor fac (its reduction, weight and dloss) split
 * between the gradient's two parts: ce multiplies the CE's coefficients
 * (fac sg(p_y)), z the z-loss's p_j (fac 2 z_loss lse). */
typedef struct {
  float ce, z;
} lmloss_ce_upstream;

LMLOSS_HD lmloss_ce_upstream lmloss_ce_upstream_make(const lmloss_ce_terms *c, float z_loss,
                                                     float fac) {
  lmloss_ce_upstream u;
  u.ce = c->dftw * fac;
  u.z = fac * 2.0f * z_loss * (float)c->lse;
  return u;
}

/* The gradient of the row's loss at one exact entry, in z units (dz/dx
 * by the caller): p its probability, cj its class weight. */
LMLOSS_HD float lmloss_ce_entry_z(const lmloss_ce_coef *q, const lmloss_rowstat *s,
                                  lmloss_ce_upstream u, float p, float cj, int is_target,
                                  int is_argmax) {
  return u.ce * lmloss_ce_grad_z(q, s, p, cj, is_target, is_argmax) + u.z * p;
}

/* The row-pass coefficients of every other entry (rowpass's shape
 * e_j P - Q c_j, z units): P = (u.ce A + u.z) / (1 + R), Q = u.ce e / V. */
LMLOSS_HD void lmloss_ce_pass_coefs(const lmloss_ce_coef *q, const lmloss_rowstat *s,
                                    lmloss_ce_upstream u, float *P, float *Q) {
  *P = (u.ce * q->a_coef + u.z) * (1.0f / (1.0f + s->r));
  *Q = u.ce * q->smooth;
}

#endif /* LMLOSS_MATH_ROWSTATE_H */
