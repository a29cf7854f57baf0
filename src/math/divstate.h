/*
 * divstate.h - a row pair's statistics over some of its columns, their
 * merge, and the packed divergence state of a vocabulary shard (lmloss.h,
 * LMLOSS_DIV_STATE_COLS, version LMLOSS_DIV_STATE_VERSION), written once
 * for C and CUDA: the CPU merges its blocks with it, both backends their
 * shards' states.
 */
#ifndef LMLOSS_MATH_DIVSTATE_H
#define LMLOSS_MATH_DIVSTATE_H

#include "divergence.h"

/* The statistics of a row pair's columns: each row's max (w), its first
 * column and raw x there, R of each row and D = Rt - Rs (the sums in
 * double: a row's blocks and shards add into them). */
typedef struct {
  float ms, mt, xs_a, xt_a;
  int64_t as, at;
  double rs, rt, d;
} lmloss_div_stats;

/* G: zt - zs between the two rows' maxes. */
LMLOSS_DIV_HD float lmloss_div_stats_G(const lmloss_div_pair *pr, const lmloss_div_stats *s) {
  return lmloss_div_gap(pr, pr->capped, s->mt, s->xt_a, s->ms, s->xs_a);
}

/* One column's terms of a part's sums (w and raw x of both rows), against
 * the part's maxes ms, mt (0 for a side whose max is -inf, so its
 * exponents read 0) and its G: e^ds into *es, e^dt into *et, and its term
 * of D, e^dt - e^ds, through e^ds expm1(dg) where the rows are close. */
LMLOSS_DIV_HD void lmloss_div_stats_terms(const lmloss_div_pair *pr, int capped, float ws, float wt,
                                          float xs, float xt, float ms, float mt, float G,
                                          float *es, float *et, float *d) {
  const float as = (ws - ms) * pr->fs.k, at = (wt - mt) * pr->ft.k;
  *es = lmloss_div_exp(as), *et = lmloss_div_exp(at);
  const float dg = lmloss_pair_dg(lmloss_div_gap(pr, capped, wt, xt, ws, xs), G, as, at);
  *d = lmloss_pair_d_of(*es, *et, dg);
}

/* How a part's sums move to the maxes of a state o that holds it (G:
 * o's): Rs' = cs (one_s + Rs), Rt' = ct (one_t + Rt) and D' = cd (1 + Rt)
 * + cr (1 + Rs) + ce D. one_s is 1 where o's student argmax lies outside
 * the part (the part's own argmax then counts in R) and 0 where it is the
 * part's (cs is then 1); one_t likewise. D moves as e^(As_P - As)
 * (expm1(G_P - G) St_P + D_P), through lmloss_pair_d_of so neither factor
 * overflows. A part of only -inf on a side (max -inf, no softcap) counts
 * no mass there, and its D is then the difference of the sides' sums.
 * The CPU's blocks and CUDA's warps move their running sums so. */
typedef struct {
  double cs, ct, cd, cr, ce;
  int one_s, one_t;
} lmloss_div_move;

LMLOSS_DIV_HD lmloss_div_move lmloss_div_stats_move(const lmloss_div_pair *pr,
                                                    const lmloss_div_stats *p,
                                                    const lmloss_div_stats *o, float G) {
  lmloss_div_move m;
  const int no_s = !(p->ms > -INFINITY), no_t = !(p->mt > -INFINITY); /* only -inf there */
  const float ds = (p->ms - o->ms) * pr->fs.k, dt = (p->mt - o->mt) * pr->ft.k;
  m.cs = no_s ? 0.0 : expf(ds), m.ct = no_t ? 0.0 : expf(dt);
  m.one_s = p->as != o->as, m.one_t = p->at != o->at;
  if (no_s || no_t) {
    m.cd = m.ct, m.cr = -m.cs, m.ce = 0.0;
  } else {
    m.cd = lmloss_pair_d_of((float)m.cs, (float)m.ct,
                            lmloss_pair_dg(lmloss_div_stats_G(pr, p), G, ds, dt));
    m.cr = 0.0, m.ce = m.cs;
  }
  return m;
}

/* Two parts of a row: each row's max-split merge (a tie keeps the lower
 * column, so parts merge in any order), each part's sums moved to the
 * merged maxes. */
LMLOSS_DIV_HD lmloss_div_stats lmloss_div_stats_merge(const lmloss_div_pair *pr,
                                                      const lmloss_div_stats *x,
                                                      const lmloss_div_stats *y) {
  lmloss_div_stats o = *x;
  if (y->ms > x->ms || (y->ms == x->ms && y->as < x->as))
    o.ms = y->ms, o.as = y->as, o.xs_a = y->xs_a;
  if (y->mt > x->mt || (y->mt == x->mt && y->at < x->at))
    o.mt = y->mt, o.at = y->at, o.xt_a = y->xt_a;
  const float G = lmloss_div_stats_G(pr, &o);
  const lmloss_div_stats *parts[2] = {x, y};
  o.rs = o.rt = o.d = 0.0;
  for (int i = 0; i < 2; i++) {
    const lmloss_div_stats *p = parts[i];
    const lmloss_div_move m = lmloss_div_stats_move(pr, p, &o, G);
    o.rs += m.cs * (m.one_s + p->rs);
    o.rt += m.ct * (m.one_t + p->rt);
    o.d += m.cd * (1.0 + p->rt) + m.cr * (1.0 + p->rs) + m.ce * p->d;
  }
  return o;
}

/* What a row pair's flags say: each row held a logit above -inf, either
 * held a NaN or +inf. */
enum { LMLOSS_PAIR_ANY_S = 1, LMLOSS_PAIR_ANY_T = 2, LMLOSS_PAIR_BAD = 4 };

LMLOSS_DIV_HD int lmloss_pair_flags_ok(int flags) {
  return flags == (LMLOSS_PAIR_ANY_S | LMLOSS_PAIR_ANY_T);
}

/* A shard's state: the statistics, the flags, and what lies in one
 * column: the teacher's raw logit at the student's argmax, the student's
 * w at the label (NaN: elsewhere). st.as < 0: empty (an ignored row). */
typedef struct {
  lmloss_div_stats st;
  float xt_as, ws_y;
  int flags;
} lmloss_div_state;

/* The packed columns (lmloss.h, layout version 1). */
enum {
  LMLOSS_DST_MS,
  LMLOSS_DST_RS,
  LMLOSS_DST_AS,
  LMLOSS_DST_MT,
  LMLOSS_DST_RT,
  LMLOSS_DST_AT,
  LMLOSS_DST_D,
  LMLOSS_DST_XT_AS,
  LMLOSS_DST_WS_Y,
  LMLOSS_DST_XS_A,
  LMLOSS_DST_XT_AT,
  LMLOSS_DST_ZERO
};
typedef char lmloss_div_state_columns_fit[LMLOSS_DST_ZERO + 1 == LMLOSS_DIV_STATE_COLS ? 1 : -1];

/* An argmax column packed: a, or -2 - a where its row held no logit above
 * -inf (-1 is the empty state's). */
LMLOSS_DIV_HD float lmloss_div_pack_col(int64_t a, int any) {
  return any ? (float)a : -2.0f - (float)a;
}

LMLOSS_DIV_HD void lmloss_div_state_pack(const lmloss_div_state *s, float *o) {
  const lmloss_div_stats *st = &s->st;
  for (int c = 0; c < LMLOSS_DIV_STATE_COLS; c++)
    o[c] = 0.0f;
  o[LMLOSS_DST_WS_Y] = NAN;
  o[LMLOSS_DST_AS] = -1.0f;
  if (st->as < 0) return;
  o[LMLOSS_DST_MS] = s->flags & LMLOSS_PAIR_BAD ? NAN : st->ms;
  o[LMLOSS_DST_RS] = (float)st->rs, o[LMLOSS_DST_RT] = (float)st->rt;
  o[LMLOSS_DST_D] = (float)st->d;
  o[LMLOSS_DST_AS] = lmloss_div_pack_col(st->as, s->flags & LMLOSS_PAIR_ANY_S);
  o[LMLOSS_DST_MT] = st->mt;
  o[LMLOSS_DST_AT] = lmloss_div_pack_col(st->at, s->flags & LMLOSS_PAIR_ANY_T);
  o[LMLOSS_DST_XT_AS] = s->xt_as, o[LMLOSS_DST_WS_Y] = s->ws_y;
  o[LMLOSS_DST_XS_A] = st->xs_a, o[LMLOSS_DST_XT_AT] = st->xt_a;
}

/* An argmax column back: *any its flag; 0 (and *col 0) when not a column
 * of this vocabulary (not a state of these rows: the row reads
 * non-finite). The float is cast only once it is known to fit. */
LMLOSS_DIV_HD int lmloss_div_unpack_col(float a, int64_t vocab, int64_t *col, int *any) {
  *any = a >= 0.0f;
  if (a < 0.0f) a = -2.0f - a;
  const int ok = a >= 0.0f && a < (float)vocab && a == floorf(a);
  *col = ok ? (int64_t)a : 0;
  return ok;
}

/* A packed state back. Without a softcap on a side, the raw logit at its
 * argmax is its max (w = x): those columns are not read, so an exchange
 * need not send them. */
LMLOSS_DIV_HD lmloss_div_state lmloss_div_state_unpack(const float *in, int64_t vocab,
                                                       const lmloss_div_pair *pr) {
  lmloss_div_state s;
  s.st.ms = s.st.mt = s.st.xs_a = s.st.xt_a = 0.0f;
  s.st.rs = s.st.rt = s.st.d = 0.0;
  s.st.as = -1, s.st.at = -1;
  s.xt_as = 0.0f, s.ws_y = in[LMLOSS_DST_WS_Y], s.flags = 0;
  if (in[LMLOSS_DST_AS] == -1.0f) return s;
  int any_s, any_t;
  const int good = lmloss_div_unpack_col(in[LMLOSS_DST_AS], vocab, &s.st.as, &any_s) &
                   lmloss_div_unpack_col(in[LMLOSS_DST_AT], vocab, &s.st.at, &any_t);
  s.flags = (any_s ? LMLOSS_PAIR_ANY_S : 0) | (any_t ? LMLOSS_PAIR_ANY_T : 0) |
            (good && !isnan(in[LMLOSS_DST_MS]) ? 0 : LMLOSS_PAIR_BAD);
  if (!good) s.st.as = s.st.at = 0; /* a valid column: merges keep the flag */
  s.st.ms = in[LMLOSS_DST_MS], s.st.rs = in[LMLOSS_DST_RS];
  s.st.mt = in[LMLOSS_DST_MT], s.st.rt = in[LMLOSS_DST_RT];
  s.st.d = in[LMLOSS_DST_D];
  s.xt_as = in[LMLOSS_DST_XT_AS];
  s.st.xs_a = pr->fs.cap > 0.0f ? in[LMLOSS_DST_XS_A] : s.st.ms;
  s.st.xt_a = pr->ft.cap > 0.0f ? in[LMLOSS_DST_XT_AT] : s.st.mt;
  return s;
}

/* Two parts of a row (states of disjoint columns). */
LMLOSS_DIV_HD lmloss_div_state lmloss_div_state_merge(const lmloss_div_pair *pr,
                                                      const lmloss_div_state *x,
                                                      const lmloss_div_state *y) {
  if (y->st.as < 0 || x->st.as < 0) return y->st.as < 0 ? *x : *y;
  lmloss_div_state o;
  o.st = lmloss_div_stats_merge(pr, &x->st, &y->st);
  o.ws_y = isnan(x->ws_y) ? y->ws_y : x->ws_y;
  o.xt_as = o.st.as == x->st.as ? x->xt_as : y->xt_as;
  o.flags = x->flags | y->flags;
  return o;
}

/* The row pair's constants from its (merged) statistics. */
LMLOSS_DIV_HD lmloss_div_row lmloss_div_state_row(const lmloss_div_pair *pr,
                                                  const lmloss_div_state *s) {
  const lmloss_div_stats *st = &s->st;
  return lmloss_div_row_make(pr, st->ms, st->mt, (float)st->rs, (float)st->rt, (float)st->d, st->as,
                             st->xs_a, st->xt_a, s->xt_as);
}

#endif
