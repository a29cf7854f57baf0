/*
 * divergence.c - KL, reverse KL, generalized JSD and TVD between a
 * student's and a teacher's rows on the CPU (math/divergence.h), with the
 * student's cross-entropy as a hard term.
 *
 * A row pair is streamed in blocks of LMLOSS_DIV_BLOCK columns, read
 * from its inputs by each sweep: the statistics (each block's maxes and
 * sums Rs, Rt, D, merged into the row's as math/divergence.h says), then
 * the losses and the row constants a gradient needs (with the forward
 * KL's gradient, which needs none), then the other kinds' gradient. The
 * loops are branch-free and vectorize in the AVX-512 and x86-64-v3 clones
 * (vmath.h); a block's sums run in floats, the row's in double.
 */
#include <stdlib.h>

#include "block.h"
#include "common.h"
#include "core/validate.h"
#include "dispatch.h"
#include "math/divergence.h"
#include "rowpass.h"
#include "vmath.h"

#define LMLOSS_DIV_BLOCK 2048
/* every helper a loop calls is inlined into each ISA clone of the loop */
#define DIV_INLINE static inline __attribute__((always_inline))

typedef struct {
  const lmloss_div_options *opt;
  lmloss_xform fs, ft;
  int capped; /* both rows under one transform with a softcap */
  int64_t V;
  float beta, log_1mb, log_b; /* the JSD's beta, log(1 - beta), log(beta) */
} div_job;

/* A block of both rows: w, and the raw x (the same arrays without a
 * softcap), in place for fp32 rows without one, else converted. */
typedef struct {
  const float *ws, *wt, *xs, *xt;
  int n, bad, any_s, any_t;
  float bws[LMLOSS_DIV_BLOCK], bwt[LMLOSS_DIV_BLOCK], bxs[LMLOSS_DIV_BLOCK], bxt[LMLOSS_DIV_BLOCK];
} pair_block;

/* One side of a block; returns w, *x the raw logits. With check (the
 * statistics' sweep, the one that decides a row is non-finite), *bad and
 * *any gather the non-finite policy of its raw logits. */
static const float *side(const void *row, lmloss_dtype dt, const lmloss_xform *f, int64_t j0, int n,
                         int check, float *bx, float *bw, const float **x, int *bad, int *any) {
  const float *raw = (const float *)row + j0;
  if (dt != LMLOSS_F32 || f->cap > 0.0f) {
    lmloss_cpu_load_block(row, dt, j0, n, bx);
    raw = bx;
  }
  int nan_inf = 0, finite = 0;
#pragma omp simd reduction(+ : nan_inf, finite)
  for (int i = 0; i < (check ? n : 0); i++) {
    nan_inf += (raw[i] != raw[i]) | (raw[i] == INFINITY);
    finite += raw[i] > -INFINITY;
  }
  *bad |= nan_inf > 0, *any |= finite > 0;
  *x = raw;
  if (f->cap == 0.0f) return raw;
  for (int i = 0; i < n; i++)
    bw[i] = lmloss_xform_w(f, raw[i]);
  return bw;
}

static void load(const div_job *jb, const void *rs, lmloss_dtype ds, const void *rt,
                 lmloss_dtype dt, int64_t j0, int check, pair_block *b) {
  b->n = (int)(jb->V - j0 < LMLOSS_DIV_BLOCK ? jb->V - j0 : LMLOSS_DIV_BLOCK);
  b->bad = b->any_s = b->any_t = 0;
  b->ws = side(rs, ds, &jb->fs, j0, b->n, check, b->bxs, b->bws, &b->xs, &b->bad, &b->any_s);
  b->wt = side(rt, dt, &jb->ft, j0, b->n, check, b->bxt, b->bwt, &b->xt, &b->bad, &b->any_t);
}

/* How a loop's columns are transformed, a constant of each compiled
 * version of the loops (the plain one vectorizes): SHARED_CAP, both rows
 * under one transform with a softcap (g through lmloss_capped_gap);
 * STUDENT_CAP, the student's softcap (its chain rule in the gradient). */
enum { SHARED_CAP = 1, STUDENT_CAP = 2 };

/* g = zt - zs of columns of the teacher (w wt, raw xt) and the student. */
DIV_INLINE float gap(const div_job *jb, int capped, float wt, float xt, float ws, float xs) {
  return capped & SHARED_CAP ? lmloss_capped_gap(&jb->fs, xt, xs)
                             : lmloss_pair_gap(wt, jb->ft.k, ws, jb->fs.k);
}

/* The statistics of a row pair's columns: each row's max (w), its first
 * column and raw x there, R of each row and D = Rt - Rs. */
typedef struct {
  float ms, mt, xs_a, xt_a;
  int64_t as, at;
  double rs, rt, d;
} pair_stats;

static float stats_G(const div_job *jb, const pair_stats *s) {
  return gap(jb, jb->capped, s->mt, s->xt_a, s->ms, s->xs_a);
}

static int64_t first_max(const float *w, int n, float *m) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int i = 0; i < n; i++)
    mx = w[i] > mx ? w[i] : mx;
  int a = n - 1; /* the first column at the max, by a vectorized min */
#pragma omp simd reduction(min : a)
  for (int i = 0; i < n; i++)
    a = w[i] == mx && i < a ? i : a;
  *m = mx;
  return a;
}

/* A block's statistics (its columns from j0). A row whose block holds
 * only -inf (no softcap) has max -inf there: its exponents are taken from
 * 0 instead, so they read 0, and merge() counts no mass for it. */
DIV_INLINE pair_stats block_stats(const div_job *jb, const pair_block *b, int64_t j0, int capped) {
  pair_stats s;
  const int as = (int)first_max(b->ws, b->n, &s.ms), at = (int)first_max(b->wt, b->n, &s.mt);
  s.as = j0 + as, s.at = j0 + at, s.xs_a = b->xs[as], s.xt_a = b->xt[at];
  const float G = stats_G(jb, &s), ks = jb->fs.k, kt = jb->ft.k;
  const float ms = s.ms > -INFINITY ? s.ms : 0.0f, mt = s.mt > -INFINITY ? s.mt : 0.0f;
  const float *restrict ws = b->ws, *restrict wt = b->wt, *restrict xs = b->xs,
                        *restrict xt = b->xt;
  float rs = 0.0f, rt = 0.0f, d = 0.0f;
#pragma omp simd reduction(+ : rs, rt, d)
  for (int i = 0; i < b->n; i++) {
    const float as_i = (ws[i] - ms) * ks, at_i = (wt[i] - mt) * kt;
    const float es = lmloss_vexp_neg(as_i, -0.0f), et = lmloss_vexp_neg(at_i, -0.0f);
    const float dg = lmloss_pair_dg(gap(jb, capped, wt[i], xt[i], ws[i], xs[i]), G, as_i, at_i);
    rs += i == as ? 0.0f : es;
    rt += i == at ? 0.0f : et;
    d += fabsf(dg) <= 0.5f ? es * lmloss_vexpm1_small(dg) : et - es;
  }
  s.rs = rs, s.rt = rt, s.d = d;
  return s;
}

/* x then y (later columns): each row's max-split merge (a tie keeps the
 * earlier column), and D = sum over parts of e^(As_P - As) (expm1(G_P - G)
 * St_P + D_P), through lmloss_pair_d_term so neither factor overflows. */
static pair_stats merge(const div_job *jb, const pair_stats *x, const pair_stats *y) {
  const float ks = jb->fs.k, kt = jb->ft.k;
  pair_stats o = *x;
  if (y->ms > x->ms) o.ms = y->ms, o.as = y->as, o.xs_a = y->xs_a;
  if (y->mt > x->mt) o.mt = y->mt, o.at = y->at, o.xt_a = y->xt_a;
  const float G = stats_G(jb, &o);
  const pair_stats *parts[2] = {x, y};
  o.rs = o.rt = o.d = 0.0;
  for (int i = 0; i < 2; i++) {
    const pair_stats *p = parts[i];
    const int no_s = !(p->ms > -INFINITY), no_t = !(p->mt > -INFINITY); /* only -inf there */
    const float ds = (p->ms - o.ms) * ks, dt = (p->mt - o.mt) * kt;
    const double es = no_s ? 0.0 : expf(ds), et = no_t ? 0.0 : expf(dt);
    o.rs += no_s ? 0.0 : p->as == o.as ? p->rs : (1.0 + p->rs) * es;
    o.rt += no_t ? 0.0 : p->at == o.at ? p->rt : (1.0 + p->rt) * et;
    if (no_s || no_t) /* D = St - Ss with one of them 0 */
      o.d += et * (no_t ? 0.0 : 1.0 + p->rt) - es * (no_s ? 0.0 : 1.0 + p->rs);
    else
      o.d += lmloss_pair_d_term(ds, lmloss_pair_dg(stats_G(jb, p), G, ds, dt), dt) * (1.0 + p->rt) +
             es * p->d;
  }
  return o;
}

/* The row's constants once its statistics are known. */
typedef struct {
  float ms, mt, ks, kt, G, is, it, ell, l1s, l1t, rs;
  float dg_a; /* g - G at the student's argmax a */
  /* the JSD at a: log u_a and log w_a, u_a = (1 - beta) p_a / M_a and
   * w_a = beta q_a / M_a, the rows' shares of the mixture there */
  float lu_a, lw_a;
  int64_t as;
  double div, rev, mix, pos, neg, eq; /* the loss sweep's sums */
  float es_y;                         /* the label's exponent (cross-entropy) */
} pair_row;

DIV_INLINE float p_minus_q(float p, float q, float delta) {
  return fabsf(delta) < 1.0f ? -p * lmloss_vexpm1_small(delta) : p - q;
}

/* The JSD's log(M / p) (mu) and log(q / M) (nu): by log1p of the small
 * forms inside |delta| < 1, else from log M as a log-add-exp of the rows'
 * log-probabilities; both computed, then a select (no branch). */
DIV_INLINE void jsd_logs(const div_job *jb, float delta, float lp, float lq, float *mu, float *nu) {
  const float beta = jb->beta, small = fabsf(delta) < 1.0f, d = small ? delta : 0.0f;
  const float u = lp + jb->log_1mb, v = lq + jb->log_b;
  const float hi = u > v ? u : v, lo = u > v ? v : u;
  const float lm = hi + lmloss_vlog1p_mid(lmloss_vexp_neg(lo - hi, -0.0f));
  *mu = small ? lmloss_vlog1p_mid(beta * lmloss_vexpm1_small(d)) : lm - lp;
  *nu = small ? -lmloss_vlog1p_mid((1.0f - beta) * lmloss_vexpm1_small(-d)) : lq - lm;
}

/* The JSD's log(M_j / p_j) - log(M_a / p_a) = log(u_a + w_a e^h_j), h_j =
 * delta_j - delta_a (= dg_j - dg_a): by log1p(w_a expm1(h)) inside
 * |h| < 1, else as a log-add-exp. Never the difference of the two logs:
 * where the student's mass sits on columns the teacher all but ignores,
 * both are log(1 - beta) to 1e-20 and their rounding would be all of it. */
DIV_INLINE float jsd_dmu(const pair_row *r, float h) {
  const float small = fabsf(h) < 1.0f, d = small ? h : 0.0f;
  const float u = r->lu_a, v = r->lw_a + h, hi = u > v ? u : v, lo = u > v ? v : u;
  const float far = hi + lmloss_vlog1p_mid(lmloss_vexp_neg(lo - hi, -0.0f));
  return small ? lmloss_vlog1p_mid(lmloss_vexp_neg(r->lw_a, -0.0f) * lmloss_vexpm1_small(d)) : far;
}

/* Column i of a block: p, q, delta = log q - log p, log p, log q, g - G. */
DIV_INLINE void column(const div_job *jb, const pair_row *r, const pair_block *b, int i, int capped,
                       float *p, float *q, float *delta, float *lp, float *lq, float *dg) {
  const float es = (b->ws[i] - r->ms) * r->ks, et = (b->wt[i] - r->mt) * r->kt;
  *p = lmloss_vexp_neg(es, -0.0f) * r->is;
  *q = lmloss_vexp_neg(et, -0.0f) * r->it;
  *dg = lmloss_pair_dg(gap(jb, capped, b->wt[i], b->xt[i], b->ws[i], b->xs[i]), r->G, es, et);
  *delta = *dg - r->ell;
  *lp = es - r->l1s, *lq = et - r->l1t;
}

/* The gradient's constants from the loss sweep's sums. The reverse KL's
 * -p_j (delta_j + KL(p||q)) and the JSD's -(1 - beta) p_j (mu_j + KL(p||M))
 * are formed as -p_j ((dg_j - dg_a) - rev) and -(1 - beta) p_j
 * (jsd_dmu_j - mix), the sums over j != a: where the teacher peaks away
 * from the student's argmax a, delta_a and the KL are both about the
 * margin, and their sum (a's whole entry) would cancel. */
typedef struct {
  float rev, mix, cpos, cneg, ceq, hard, soft, one_minus_py, scale;
  int64_t y;
} grad_consts;

DIV_INLINE float grad_entry(const div_job *jb, const pair_row *r, const grad_consts *c, int64_t j,
                            float p, float q, float delta, float lp, float lq, float dg, float xs,
                            int capped, int kind) {
  float g = 0.0f;
  if (kind == LMLOSS_DIV_KL) g = p_minus_q(p, q, delta);
  if (kind == LMLOSS_DIV_REVERSE_KL) g = p == 0.0f ? 0.0f : -p * ((dg - r->dg_a) - c->rev);
  if (kind == LMLOSS_DIV_TVD) {
    const float pq = p_minus_q(p, q, delta);
    g = 0.5f * p * (pq > 0.0f ? c->cpos : pq < 0.0f ? c->cneg : c->ceq);
  }
  if (kind == LMLOSS_DIV_JSD)
    g = p == 0.0f ? 0.0f : -(1.0f - jb->beta) * p * (jsd_dmu(r, dg - r->dg_a) - c->mix);
  /* the hard term p - [j == y], with 1 - p_y = R / (1 + R) at the argmax */
  const float ce = j == c->y ? (c->one_minus_py < 0.0f ? p - 1.0f : -c->one_minus_py) : p;
  const lmloss_xform f = jb->fs;
  float dzdx = f.k;
  if (capped & STUDENT_CAP) {
    const float e = lmloss_vexp_neg(-2.0f * fabsf(f.s * xs * f.inv_cap), -0.0f);
    dzdx = f.k * f.s * (4.0f * e / ((1.0f + e) * (1.0f + e)));
  }
  return c->scale * (c->soft * g + c->hard * ce) * dzdx;
}

/* The loss sweep's block: its sums into r, and with grad (the forward
 * KL) the block's gradient into out. */
DIV_INLINE void loss_block(const div_job *jb, pair_row *r, const pair_block *b, int64_t j0,
                           const grad_consts *c, float *out, int grad, int capped, int kind) {
  float div = 0.0f, rev = 0.0f, mix = 0.0f, pos = 0.0f, neg = 0.0f, eq = 0.0f;
  const float beta = jb->beta;
#pragma omp simd reduction(+ : div, rev, mix, pos, neg, eq)
  for (int i = 0; i < b->n; i++) {
    float p, q, delta, lp, lq, dg;
    column(jb, r, b, i, capped, &p, &q, &delta, &lp, &lq, &dg);
    const int rest = j0 + i != r->as && p != 0.0f;
    if (kind == LMLOSS_DIV_KL) div += lmloss_kl_term(q, p, delta);
    if (kind == LMLOSS_DIV_REVERSE_KL) {
      div += lmloss_kl_term(p, q, -delta);
      rev += rest ? p * (dg - r->dg_a) : 0.0f;
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
      jsd_logs(jb, delta, lp, lq, &mu, &nu);
      const float M = (1.0f - beta) * p + beta * q;
      div += beta * lmloss_kl_term(q, M, nu) + (1.0f - beta) * lmloss_kl_term(p, M, -mu);
      mix += rest ? p * jsd_dmu(r, dg - r->dg_a) : 0.0f;
    }
    if (grad)
      out[i] = grad_entry(jb, r, c, j0 + i, p, q, delta, lp, lq, dg, b->xs[i], capped, kind);
  }
  r->div += div, r->rev += rev, r->mix += mix, r->pos += pos, r->neg += neg, r->eq += eq;
}

DIV_INLINE void grad_block(const div_job *jb, const pair_row *r, const pair_block *b, int64_t j0,
                           const grad_consts *c, float *out, int capped, int kind) {
#pragma omp simd
  for (int i = 0; i < b->n; i++) {
    float p, q, delta, lp, lq, dg;
    column(jb, r, b, i, capped, &p, &q, &delta, &lp, &lq, &dg);
    out[i] = grad_entry(jb, r, c, j0 + i, p, q, delta, lp, lq, dg, b->xs[i], capped, kind);
  }
}

/* Where a row pair is read from and its gradient goes. */
typedef struct {
  const void *s, *t;
  lmloss_dtype sdt, tdt;
  void *grad; /* NULL: no gradient */
  lmloss_dtype gdt;
  float scale;
  int64_t y; /* the label, -1 without */
} pair_io;

/* The sweeps after the statistics, for one kind. */
DIV_INLINE void sweeps(const div_job *jb, pair_row *r, const pair_io *io, pair_block *b,
                       float *gbuf, int capped, int kind) {
  const int64_t V = jb->V;
  grad_consts c = {0};
  c.y = io->y, c.soft = jb->opt->soft_weight, c.scale = io->scale;
  c.hard = io->y >= 0 ? jb->opt->hard_weight : 0.0f;
  c.one_minus_py = io->y == r->as ? r->rs / (1.0f + r->rs) : -1.0f;
  const int fused = io->grad && kind == LMLOSS_DIV_KL;
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_DIV_BLOCK) {
    load(jb, io->s, io->sdt, io->t, io->tdt, j0, 0, b);
    if (fused)
      loss_block(jb, r, b, j0, &c, gbuf, 1, capped, kind);
    else
      loss_block(jb, r, b, j0, &c, gbuf, 0, capped, kind);
    if (io->y >= j0 && io->y < j0 + b->n)
      r->es_y = io->y == r->as ? 0.0f : (b->ws[io->y - j0] - r->ms) * r->ks;
    if (fused) lmloss_cpu_store_block(io->grad, io->gdt, j0, b->n, gbuf);
  }
  if (!io->grad || fused) return;
  c.rev = (float)r->rev, c.mix = (float)r->mix;
  c.cpos = (float)(2.0 * r->neg + r->eq), c.cneg = (float)-(2.0 * r->pos + r->eq);
  c.ceq = (float)(r->neg - r->pos);
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_DIV_BLOCK) {
    load(jb, io->s, io->sdt, io->t, io->tdt, j0, 0, b);
    grad_block(jb, r, b, j0, &c, gbuf, capped, kind);
    lmloss_cpu_store_block(io->grad, io->gdt, j0, b->n, gbuf);
  }
}

/* Column j's g - G at the student's argmax and the JSD's shares there. */
static void argmax_terms(const div_job *jb, pair_row *r, const pair_io *io) {
  const int64_t a = r->as;
  const float xs = lmloss_load(io->s, io->sdt, a), xt = lmloss_load(io->t, io->tdt, a);
  const float ws = lmloss_xform_w(&jb->fs, xs), wt = lmloss_xform_w(&jb->ft, xt);
  r->dg_a = lmloss_pair_dg(gap(jb, jb->capped, wt, xt, ws, xs), r->G, 0.0f, (wt - r->mt) * r->kt);
  /* w_a / u_a = beta q_a / ((1 - beta) p_a): each share from its log
   * ratio by softplus, exact where one of them is all but 1 (forming
   * log(1 - beta) - log(M_a / p_a) instead rounded it to 2e-7) */
  const float lr = (jb->log_b - jb->log_1mb) + (r->dg_a - r->ell);
  r->lu_a = -lmloss_softplus(lr), r->lw_a = -lmloss_softplus(-lr);
}

DIV_INLINE void div_pair(const div_job *jb, const pair_io *io, pair_block *b, float *gbuf,
                         pair_row *r, int *ok, int capped) {
  pair_stats st = {0};
  int bad = 0, any_s = 0, any_t = 0;
  for (int64_t j0 = 0; j0 < jb->V; j0 += LMLOSS_DIV_BLOCK) {
    load(jb, io->s, io->sdt, io->t, io->tdt, j0, 1, b);
    bad |= b->bad, any_s |= b->any_s, any_t |= b->any_t;
    const pair_stats bs = block_stats(jb, b, j0, capped);
    st = j0 == 0 ? bs : merge(jb, &st, &bs);
  }
  *ok = !bad && any_s && any_t;
  if (!*ok) return;
  *r = (pair_row){0};
  r->ms = st.ms, r->mt = st.mt, r->ks = jb->fs.k, r->kt = jb->ft.k, r->G = stats_G(jb, &st);
  r->rs = (float)st.rs, r->as = st.as;
  r->is = 1.0f / (1.0f + r->rs), r->it = 1.0f / (1.0f + (float)st.rt);
  r->l1s = log1pf(r->rs), r->l1t = log1pf((float)st.rt);
  r->ell = lmloss_pair_ell((float)st.d, r->rs);
  argmax_terms(jb, r, io);
  switch (jb->opt->kind) {
  case LMLOSS_DIV_KL: sweeps(jb, r, io, b, gbuf, capped, LMLOSS_DIV_KL); break;
  case LMLOSS_DIV_REVERSE_KL: sweeps(jb, r, io, b, gbuf, capped, LMLOSS_DIV_REVERSE_KL); break;
  case LMLOSS_DIV_TVD: sweeps(jb, r, io, b, gbuf, capped, LMLOSS_DIV_TVD); break;
  default: sweeps(jb, r, io, b, gbuf, capped, LMLOSS_DIV_JSD); break;
  }
}

void lmloss_cpu_div_pair(const div_job *jb, const pair_io *io, pair_block *b, float *gbuf,
                         pair_row *r, int *ok);

/* One row pair: *ok = 0 for a non-finite pair (nothing written), else r
 * holds its divergence and cross-entropy, and io->grad its gradient. */
LMLOSS_CPU_DISPATCH
void lmloss_cpu_div_pair(const div_job *jb, const pair_io *io, pair_block *b, float *gbuf,
                         pair_row *r, int *ok) {
  const int mode = (jb->capped ? SHARED_CAP : 0) | (jb->fs.cap > 0.0f ? STUDENT_CAP : 0);
  if (mode == (SHARED_CAP | STUDENT_CAP))
    div_pair(jb, io, b, gbuf, r, ok, SHARED_CAP | STUDENT_CAP);
  else if (mode == STUDENT_CAP)
    div_pair(jb, io, b, gbuf, r, ok, STUDENT_CAP);
  else
    div_pair(jb, io, b, gbuf, r, ok, 0);
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
  const int capped = ts->softcap > 0.0f && ts->softcap == tt->softcap &&
                     ts->logit_scale == tt->logit_scale && ts->temperature == tt->temperature;
  const div_job jb = {opt,       lmloss_xform_make(*ts), lmloss_xform_make(*tt), capped, V,
                      opt->beta, log1pf(-opt->beta),     logf(opt->beta)};
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
    pair_block *b = (pair_block *)malloc(sizeof(pair_block));
    float *gbuf = (float *)malloc(LMLOSS_DIV_BLOCK * sizeof(float));
    if (!b || !gbuf) {
#pragma omp atomic write
      oom = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < N; i++) {
      if (!b || !gbuf) continue;
      const int64_t y = label_of(in, opt, i);
      void *drow = dx ? lmloss_cpu_row_mut(dx, i) : NULL;
      double div = 0.0, ce = 0.0;
      if (y == -2) {
        if (drow) lmloss_cpu_row_fill(drow, dx->dtype, V, 0.0f);
      } else {
        const float up = !drow   ? 0.0f
                         : dloss ? *lmloss_cpu_f32_at(dloss, reduced ? 0 : i)
                                 : opt->grad_output;
        const pair_io io = {lmloss_cpu_row(&in->student, i),
                            lmloss_cpu_row(&in->teacher, i),
                            in->student.dtype,
                            in->teacher.dtype,
                            drow,
                            drow ? dx->dtype : LMLOSS_F32,
                            (float)(up * factor),
                            y};
        pair_row r;
        int ok;
        lmloss_cpu_div_pair(&jb, &io, b, gbuf, &r, &ok);
        div = ok ? r.div : NAN;
        ce = !ok ? NAN : y >= 0 ? r.l1s - r.es_y : 0.0;
        if (!ok && drow) lmloss_cpu_row_fill(drow, dx->dtype, V, NAN);
      }
      row_loss[i] = y == -2 ? 0.0 : opt->soft_weight * div + opt->hard_weight * ce;
      if (out && lmloss_present(&out->divergence))
        *lmloss_cpu_f32_at(&out->divergence, i) = (float)div;
      if (out && lmloss_present(&out->ce)) *lmloss_cpu_f32_at(&out->ce, i) = (float)ce;
      if (out && !reduced) *lmloss_cpu_f32_at(&out->loss, i) = (float)row_loss[i];
    }
    free(b), free(gbuf);
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
