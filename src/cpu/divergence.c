/*
 * divergence.c - KL, reverse KL, generalized JSD and TVD between a
 * student's and a teacher's rows on the CPU (math/divergence.h), with the
 * student's cross-entropy as a hard term.
 *
 * A row pair is streamed in blocks of LMLOSS_DIV_BLOCK columns, read
 * from its inputs by each sweep: the statistics (a block's sums Rs, Rt,
 * D against the maxes of the blocks before it, or, where a max rises, its
 * own maxes and sums merged into the row's as math/divstate.h says), then
 * the losses and the row constants a gradient needs (with the forward
 * KL's gradient, which needs none), then the other kinds' gradient. The
 * loops are branch-free and vectorize in the AVX-512 and x86-64-v3 clones
 * (vmath.h); their sums run in double, or (LMLOSS_DIV_RUN says which) in
 * float over short runs added into double.
 *
 * Over a sharded vocabulary (lmloss.h) the same sweeps run apart: the
 * statistics of the shard's columns (a state; states merge as blocks do),
 * the loss sweep's sums from the merged state (the partials), and the
 * gradient sweep from those summed over the shards.
 */
#include <stdlib.h>

#include "block.h"
#include "common.h"
#include "core/validate.h"
#include "dispatch.h"
#include "math/divstate.h"
#include "math/vmath.h"
#include "rowpass.h"

#define LMLOSS_DIV_BLOCK 2048
/* The loss sweep's sums of non-negative terms run in float over this
 * many columns, then add into double: short enough that a scalar build's
 * running float sum stays inside the suite's 1e-5, long enough that the
 * vector loops pay little for the step into double. The running
 * statistics' sums (R and D, on which a shard and the one-shot call,
 * partitioning a row differently, must agree) run in written-out lanes
 * over the same runs (stat_lanes); the reverse KL's and JSD's signed sums
 * keep double lanes. */
#define LMLOSS_DIV_RUN 256
/* The longest rows whose statistics keep their exponentials for the loss
 * sweep, which keeps p and h over them for the gradient sweep (16 MB a
 * thread). */
#define LMLOSS_DIV_KEEP_MAX (1 << 21)
/* every helper a loop calls is inlined into each ISA clone of the loop */
#define DIV_INLINE static inline __attribute__((always_inline))

typedef struct {
  const lmloss_div_options *opt;
  lmloss_div_pair pr;
  int64_t V;    /* the row's columns here */
  int64_t col0; /* the first one's column in the vocabulary (a shard's) */
} div_job;

/* A block of both rows: w, and the raw x (the same arrays without a
 * softcap), in place for fp32 rows without one, else converted. */
typedef struct {
  const float *ws, *wt, *xs, *xt;
  int n, bad, any_s, any_t;
  float bws[LMLOSS_DIV_BLOCK], bwt[LMLOSS_DIV_BLOCK], bxs[LMLOSS_DIV_BLOCK], bxt[LMLOSS_DIV_BLOCK];
  float p[LMLOSS_DIV_BLOCK], q[LMLOSS_DIV_BLOCK]; /* the loss sweep's (block_pq) */
} pair_block;

/* One side of a block; returns w, *x the raw logits. */
DIV_INLINE const float *side(const void *row, lmloss_dtype dt, const lmloss_xform *f, int64_t j0,
                             int n, float *bx, float *bw, const float **x) {
  const float *raw = (const float *)row + j0;
  if (dt != LMLOSS_F32 || f->cap > 0.0f) {
    lmloss_cpu_load_block(row, dt, j0, n, bx);
    raw = bx;
  }
  *x = raw;
  if (f->cap == 0.0f) return raw;
  for (int i = 0; i < n; i++)
    bw[i] = lmloss_xform_w(f, raw[i]);
  return bw;
}

DIV_INLINE void load(const div_job *jb, const void *rs, lmloss_dtype ds, const void *rt,
                     lmloss_dtype dt, int64_t j0, pair_block *b) {
  b->n = (int)(jb->V - j0 < LMLOSS_DIV_BLOCK ? jb->V - j0 : LMLOSS_DIV_BLOCK);
  b->ws = side(rs, ds, &jb->pr.fs, j0, b->n, b->bxs, b->bws, &b->xs);
  b->wt = side(rt, dt, &jb->pr.ft, j0, b->n, b->bxt, b->bwt, &b->xt);
}

/* The non-finite policy of a block's raw logits (the statistics decide a
 * row is non-finite): b->bad for a NaN or +inf, b->any_s and b->any_t
 * for a logit above -inf on each side. */
DIV_INLINE void block_check(pair_block *b) {
  const float *restrict xs = b->xs, *restrict xt = b->xt;
  int bad = 0, fs = 0, ft = 0;
#pragma omp simd reduction(+ : bad, fs, ft)
  for (int i = 0; i < b->n; i++) {
    bad += !(xs[i] < INFINITY) | !(xt[i] < INFINITY);
    fs += xs[i] > -INFINITY, ft += xt[i] > -INFINITY;
  }
  b->bad = bad > 0, b->any_s = fs > 0, b->any_t = ft > 0;
}

/* The running statistics' sums run in float lanes: column i of a run of
 * LMLOSS_DIV_RUN adds into lane i % DIV_LANES, and each run's lanes add
 * into double lanes. The order is written out, not left to the
 * vectorizer: a scalar build adds the same floats in the same order (a
 * shard and the one-shot call, which cut a row apart differently, then
 * agree as closely as a vector build's do), and a lane sums 16 terms of a
 * run where a scalar float run summed 256. */
#define DIV_LANES 16

typedef struct {
  float rs[DIV_LANES], rt[DIV_LANES], d[DIV_LANES], mbs[DIV_LANES], mbt[DIV_LANES];
  int bad[DIV_LANES];
} stat_lanes;

/* Column i's terms into lane l (R's without the columns as and at). */
DIV_INLINE void lane_add(const div_job *jb, const pair_block *b, stat_lanes *ln, int i, int l,
                         float ms, float mt, float G, int as, int at, float *restrict kes,
                         float *restrict ket, int capped) {
  float es, et, di;
  lmloss_div_stats_terms(&jb->pr, capped, b->ws[i], b->wt[i], b->xs[i], b->xt[i], ms, mt, G, &es,
                         &et, &di);
  ln->rs[l] += i == as ? 0.0f : es, ln->rt[l] += i == at ? 0.0f : et, ln->d[l] += di;
  if (kes) kes[i] = es, ket[i] = et;
  ln->mbs[l] = b->ws[i] > ln->mbs[l] ? b->ws[i] : ln->mbs[l];
  ln->mbt[l] = b->wt[i] > ln->mbt[l] ? b->wt[i] : ln->mbt[l];
  ln->bad[l] += !(b->xs[i] < INFINITY) | !(b->xt[i] < INFINITY);
}

/* A block's terms against the maxes ms, mt and G (R's without the
 * columns as and at; -1: none) into st's sums; returns 0 and adds nothing
 * where a max rises above ms or mt or a raw logit is NaN or +inf, as soon
 * as a run of LMLOSS_DIV_RUN columns shows it (a max rises in about ln B
 * of a row's B blocks: a good share of a short row's). */
DIV_INLINE int block_sums(const div_job *jb, const pair_block *b, lmloss_div_stats *st, float ms,
                          float mt, float G, int as, int at, float *restrict kes,
                          float *restrict ket, int capped) {
  stat_lanes ln;
  double rs[DIV_LANES], rt[DIV_LANES], d[DIV_LANES];
  for (int l = 0; l < DIV_LANES; l++) {
    ln.mbs[l] = ln.mbt[l] = -INFINITY, ln.bad[l] = 0;
    rs[l] = rt[l] = d[l] = 0.0;
  }
  for (int r0 = 0; r0 < b->n; r0 += LMLOSS_DIV_RUN) {
    const int r1 = b->n - r0 < LMLOSS_DIV_RUN ? b->n : r0 + LMLOSS_DIV_RUN;
    for (int l = 0; l < DIV_LANES; l++)
      ln.rs[l] = ln.rt[l] = ln.d[l] = 0.0f;
    int i0 = r0;
    for (; i0 + DIV_LANES <= r1; i0 += DIV_LANES) {
#pragma omp simd
      for (int l = 0; l < DIV_LANES; l++)
        lane_add(jb, b, &ln, i0 + l, l, ms, mt, G, as, at, kes, ket, capped);
    }
    for (int i = i0; i < r1; i++)
      lane_add(jb, b, &ln, i, i - i0, ms, mt, G, as, at, kes, ket, capped);
    int stop = 0; /* a run that raises a max ends the block's loop early */
#pragma omp simd reduction(+ : stop)
    for (int l = 0; l < DIV_LANES; l++) {
      rs[l] += ln.rs[l], rt[l] += ln.rt[l], d[l] += ln.d[l];
      stop += ln.bad[l] + (ln.mbs[l] > ms) + (ln.mbt[l] > mt);
    }
    if (stop) return 0;
  }
  double srs = 0.0, srt = 0.0, sd = 0.0;
  for (int l = 0; l < DIV_LANES; l++)
    srs += rs[l], srt += rt[l], sd += d[l];
  st->rs += srs, st->rt += srt, st->d += sd;
  return 1;
}

/* A block against the running statistics st of the blocks before it,
 * where both rows have a max: its terms are taken against st's maxes and
 * G, so they add to st's sums as they are. Added when neither row's max
 * rises and no raw logit is NaN or +inf (returns 1); else nothing is, and
 * the block takes block_stats' way. So a row's common block costs one
 * loop, with no pass of its own for the maxes or the checks. */
DIV_INLINE int running_block(const div_job *jb, const pair_block *b, lmloss_div_stats *st,
                             float *restrict kes, float *restrict ket, int capped) {
  return block_sums(jb, b, st, st->ms, st->mt, lmloss_div_stats_G(&jb->pr, st), -1, -1, kes, ket,
                    capped);
}

/* A block's statistics (its columns from j0), its sums in block_sums'
 * lanes. A row whose block holds only -inf (no softcap) has max -inf
 * there: its exponents are taken from 0 instead, so they read 0, and
 * merge() counts no mass for it. A block with a NaN or +inf raw logit
 * adds no sums: block_check has flagged its row. */
DIV_INLINE lmloss_div_stats block_stats(const div_job *jb, const pair_block *b, int64_t j0,
                                        float *restrict kes, float *restrict ket, int capped) {
  lmloss_div_stats s;
  const int as = lmloss_cpu_first_max(b->ws, b->n, &s.ms),
            at = lmloss_cpu_first_max(b->wt, b->n, &s.mt);
  s.as = j0 + as, s.at = j0 + at, s.xs_a = b->xs[as], s.xt_a = b->xt[at];
  s.rs = s.rt = s.d = 0.0;
  const float ms = s.ms > -INFINITY ? s.ms : 0.0f, mt = s.mt > -INFINITY ? s.mt : 0.0f;
  block_sums(jb, b, &s, ms, mt, lmloss_div_stats_G(&jb->pr, &s), as, at, kes, ket, capped);
  return s;
}

/* A row pair's statistics, constants and the loss sweep's sums (in double). */
typedef struct {
  lmloss_div_state s; /* the statistics (a shard's state) */
  lmloss_div_row c;
  double div, rev, mix, pos, neg, eq, ent;
  float es_y; /* the label's exponent (cross-entropy) */
} pair_row;

/* What a call of a row pair runs: all of it (the one-shot call), or a
 * shard's phase: the statistics (PAIR_STATE), the loss sweep's sums
 * (PAIR_PARTIALS) or the gradient (PAIR_FINISH; PAIR_KEPT from the h its
 * partials kept in the gradient row), the last three with r->c (and the
 * finishes with r's sums) from the merged state. */
enum { PAIR_WHOLE, PAIR_STATE, PAIR_PARTIALS, PAIR_FINISH, PAIR_KEPT };

/* The statistics' exponentials kept for the loss sweep of a one-shot
 * call (pair_io.ex, EX_FLOATS(V) floats): each column's e^((w - m) k) of
 * the student's row (V floats) and the teacher's (V), against the maxes
 * m its block's statistics took (the running ones, or the block's own
 * where a max rose), then two floats a block: those maxes, which
 * exp_factors turns into the factors that take a column's exponential
 * to p and q. The loss sweep then forms no exponential. */
#define EX_FLOATS(V) (2 * (V) + 2 * (((V) + LMLOSS_DIV_BLOCK - 1) / LMLOSS_DIV_BLOCK))

/* The blocks' maxes into the factors e^((m_b - m) k) / (1 + R) of each
 * row (0 for a block whose side held only -inf: its exponentials are 0). */
DIV_INLINE void exp_factors(const pair_row *r, int64_t V, float *ex) {
  const lmloss_div_row *c = &r->c;
  float *f = ex + 2 * V;
  for (int64_t blk = 0; blk < (V + LMLOSS_DIV_BLOCK - 1) / LMLOSS_DIV_BLOCK; blk++, f += 2) {
    f[0] = f[0] > -INFINITY ? expf((f[0] - c->ms) * c->ks) * c->is : 0.0f;
    f[1] = f[1] > -INFINITY ? expf((f[1] - c->mt) * c->kt) * c->it : 0.0f;
  }
}

/* A block's p and q into b->p and b->q: from the statistics' kept
 * exponentials (ex, the block's first column's), or formed. */
DIV_INLINE void block_pq(const pair_row *r, pair_block *b, const float *ex, int64_t V, int64_t j0) {
  const lmloss_div_row *c = &r->c;
  float *restrict p = b->p, *restrict q = b->q;
  if (ex) {
    const float *restrict es = ex + j0, *restrict et = ex + V + j0;
    const float *f = ex + 2 * V + 2 * (j0 / LMLOSS_DIV_BLOCK);
    const float fs = f[0], ft = f[1];
#pragma omp simd
    for (int i = 0; i < b->n; i++)
      p[i] = es[i] * fs, q[i] = et[i] * ft;
    return;
  }
  const float *restrict ws = b->ws, *restrict wt = b->wt;
#pragma omp simd
  for (int i = 0; i < b->n; i++)
    p[i] = lmloss_div_p(c, ws[i]), q[i] = lmloss_div_exp((wt[i] - c->mt) * c->kt) * c->it;
}

/* Column c's index in the block of n columns from j0, or -1: the
 * loops compare 32-bit lanes, not 64-bit columns. */
DIV_INLINE int in_block(int64_t c, int64_t j0, int n) {
  return c >= j0 && c < j0 + n ? (int)(c - j0) : -1;
}

/* The TVD's column as a shard's partials keep it in the F32 gradient row,
 * where the other kinds keep h: its gradient reads p and the sign of
 * p - q alone, so one float holds both and the finish reads neither row.
 * p > q keeps p, p < q keeps -p, p = q keeps p's bits moved up by 2^30
 * (p <= 1, so they land in [2, inf]: exact, and apart from the others). */
DIV_INLINE float tvd_keep(float p, float pq) {
  return pq > 0.0f ? p : pq < 0.0f ? -p : lmloss_bits_f32(lmloss_f32_bits(p) + 0x40000000u);
}

/* p back from tvd_keep's v, and into *h a stand-in for p - q of its sign. */
DIV_INLINE float tvd_kept(float v, float *h) {
  const int eq = v >= 2.0f;
  *h = eq ? 0.0f : v < 0.0f ? -1.0f : 1.0f;
  return eq ? lmloss_bits_f32(lmloss_f32_bits(v) - 0x40000000u) : fabsf(v);
}

/* The loss sweep's block (its p and q in b, block_pq's): its sums into
 * r; with grad (the forward KL) the block's gradient into out; with
 * keep_p and keep_h, each column's p and h (lmloss_div_grad_h) into kp
 * and kh, for the gradient sweep; with keep_h alone (a shard's partials)
 * h, or for the TVD p and h's sign in one float (tvd_keep). */
DIV_INLINE void loss_block(const div_job *jb, pair_row *r, const pair_block *b, int64_t j0,
                           const lmloss_div_grad *gc, float *out, int grad, int keep_p, int keep_h,
                           float *restrict kp, float *restrict kh, int capped, int kind) {
  const lmloss_div_row *rc = &r->c;
  const int a = in_block(rc->as, j0, b->n), y = in_block(gc->y, j0, b->n);
  double rev = 0.0, mix = 0.0; /* signed terms: double lanes throughout */
  for (int i0 = 0; i0 < b->n; i0 += LMLOSS_DIV_RUN) {
    const int i1 = b->n - i0 < LMLOSS_DIV_RUN ? b->n : i0 + LMLOSS_DIV_RUN;
    float div = 0.0f, pos = 0.0f, neg = 0.0f, eq = 0.0f, ent = 0.0f;
#pragma omp simd reduction(+ : div, rev, mix, pos, neg, eq, ent)
    for (int i = i0; i < i1; i++) {
      const lmloss_div_col c = lmloss_div_column_pq(&jb->pr, rc, capped, b->ws[i], b->wt[i],
                                                    b->xs[i], b->xt[i], b->p[i], b->q[i]);
      const lmloss_div_terms t =
          lmloss_div_loss_terms(&jb->pr, rc, &c, i != a && c.p != 0.0f, kind);
      div += t.div, rev += t.rev, mix += t.mix, pos += t.pos, neg += t.neg, eq += t.eq;
      ent += t.ent;
      if (grad) /* the forward KL's p - q, from the summand's series */
        out[i] = lmloss_div_grad_tail(&jb->pr, gc, i == y, c.p, t.h, b->xs[i], capped);
      if (keep_p) kp[i] = c.p;
      if (keep_h) kh[i] = kind == LMLOSS_DIV_TVD && !keep_p ? tvd_keep(c.p, t.h) : t.h;
    }
    r->div += div, r->pos += pos, r->neg += neg, r->eq += eq, r->ent += ent;
  }
  r->rev += rev, r->mix += mix;
}

DIV_INLINE void grad_block(const div_job *jb, const pair_row *r, const pair_block *b, int64_t j0,
                           const lmloss_div_grad *gc, float *out, int capped, int kind) {
#pragma omp simd
  for (int i = 0; i < b->n; i++) {
    const lmloss_div_col c =
        lmloss_div_column(&jb->pr, &r->c, capped, b->ws[i], b->wt[i], b->xs[i], b->xt[i]);
    out[i] = lmloss_div_grad_entry(&jb->pr, &r->c, gc, j0 + i, &c, b->xs[i], capped, kind);
  }
}

/* A block of the gradient from the loss sweep's kept p and h of its n
 * columns (xs: the student's raw logits, read with a student softcap). */
DIV_INLINE void kept_grad_block(const div_job *jb, const lmloss_div_grad *gc, const float *kp,
                                const float *kh, const float *xs, int64_t j0, int n, float *out,
                                int capped, int kind) {
  const int y = in_block(gc->y, j0, n);
#pragma omp simd
  for (int i = 0; i < n; i++)
    out[i] =
        lmloss_div_grad_tail(&jb->pr, gc, i == y, kp[i],
                             lmloss_div_grad_of(&jb->pr, gc, kp[i], kh[i], kind), xs[i], capped);
}

/* A block of the gradient from the h a shard's partials kept in its F32
 * row g (the kinds other than the forward KL): p from the student's row
 * alone, so neither the teacher's row nor a logarithm is read; the TVD's
 * p and h from g alone (tvd_keep), its student's row read only for a
 * student softcap's chain rule. */
DIV_INLINE void kept_finish_block(const div_job *jb, const pair_row *r, const void *s,
                                  lmloss_dtype sdt, int64_t j0, int64_t col, pair_block *b,
                                  const lmloss_div_grad *gc, float *g, int capped, int kind) {
  const int n = (int)(jb->V - j0 < LMLOSS_DIV_BLOCK ? jb->V - j0 : LMLOSS_DIV_BLOCK);
  const int y = in_block(gc->y, col, n);
  /* kind and capped are constants here: the TVD without a student
   * softcap reads no row at all */
  const int tvd = kind == LMLOSS_DIV_TVD, read = !tvd || (capped & LMLOSS_DIV_STUDENT_CAP);
  const float *xs = NULL, *ws = NULL;
  if (read) ws = side(s, sdt, &jb->pr.fs, j0, n, b->bxs, b->bws, &xs);
#pragma omp simd
  for (int i = 0; i < n; i++) {
    float h = g[i];
    const float p = tvd ? tvd_kept(g[i], &h) : lmloss_div_p(&r->c, ws[i]);
    g[i] = lmloss_div_grad_tail(&jb->pr, gc, i == y, p, lmloss_div_grad_of(&jb->pr, gc, p, h, kind),
                                read ? xs[i] : 0.0f, capped);
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
  float *ex; /* EX_FLOATS(V) floats (one-shot calls): the statistics'
                exponentials for the loss sweep (exp_factors), and over
                them the p and h it keeps for the gradient sweep, which
                then reads neither row; NULL: each sweep forms them */
} pair_io;

/* The sweeps after the statistics, for one kind: the loss sweep (not in
 * a finish), then the gradient's unless the loss sweep wrote it. Columns
 * (j0 + i here) are the vocabulary's from jb->col0. A shard's partials
 * with io->grad write the forward KL's gradient, or the other kinds' h
 * (the TVD's p and sign) into the F32 gradient row (kept_finish's). */
DIV_INLINE void sweeps(const div_job *jb, pair_row *r, const pair_io *io, pair_block *b,
                       float *gbuf, int phase, int capped, int kind) {
  const int64_t V = jb->V, c0 = jb->col0, y = io->y;
  lmloss_div_grad gc = {0};
  gc.y = y, gc.soft = jb->opt->soft_weight, gc.scale = io->scale;
  gc.hard = y >= 0 ? jb->opt->hard_weight : 0.0f;
  gc.one_minus_py = y == r->c.as ? r->c.rs / (1.0f + r->c.rs) : -1.0f;
  const int fused =
      io->grad && kind == LMLOSS_DIV_KL && (phase == PAIR_WHOLE || phase == PAIR_PARTIALS);
  float *const kp = io->grad && !fused && phase == PAIR_WHOLE ? io->ex : NULL;
  float *const kh = kp                                             ? kp + V
                    : io->grad && !fused && phase == PAIR_PARTIALS ? (float *)io->grad
                                                                   : NULL;
  if (phase == PAIR_KEPT) {
    lmloss_div_grad_sums(&gc, r->rev, r->mix, r->pos, r->neg, r->eq);
    for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_DIV_BLOCK)
      kept_finish_block(jb, r, io->s, io->sdt, j0, c0 + j0, b, &gc, (float *)io->grad + j0, capped,
                        kind);
    return;
  }
  /* an F32 gradient is written in place of gbuf (element for element:
   * it may alias the student's row, so w_y is read before) */
  const int direct = io->grad && io->gdt == LMLOSS_F32;
  const float *const ex = phase == PAIR_WHOLE ? io->ex : NULL;
  for (int64_t j0 = 0; phase != PAIR_FINISH && j0 < V; j0 += LMLOSS_DIV_BLOCK) {
    load(jb, io->s, io->sdt, io->t, io->tdt, j0, b);
    const int yb = in_block(y, c0 + j0, b->n);
    if (yb >= 0) r->es_y = y == r->c.as ? 0.0f : (b->ws[yb] - r->c.ms) * r->c.ks;
    float *const out = direct ? (float *)io->grad + j0 : gbuf;
    block_pq(r, b, ex, V, j0);
    if (fused)
      loss_block(jb, r, b, c0 + j0, &gc, out, 1, 0, 0, NULL, NULL, capped, kind);
    else if (kp)
      loss_block(jb, r, b, c0 + j0, &gc, gbuf, 0, 1, 1, kp + j0, kh + j0, capped, kind);
    else if (kh)
      loss_block(jb, r, b, c0 + j0, &gc, gbuf, 0, 0, 1, NULL, kh + j0, capped, kind);
    else
      loss_block(jb, r, b, c0 + j0, &gc, gbuf, 0, 0, 0, NULL, NULL, capped, kind);
    if (fused && !direct) lmloss_cpu_store_block(io->grad, io->gdt, j0, b->n, gbuf);
  }
  if (!io->grad || fused || phase == PAIR_PARTIALS) return;
  lmloss_div_grad_sums(&gc, r->rev, r->mix, r->pos, r->neg, r->eq);
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_DIV_BLOCK) {
    const int n = (int)(V - j0 < LMLOSS_DIV_BLOCK ? V - j0 : LMLOSS_DIV_BLOCK);
    float *const out = direct ? (float *)io->grad + j0 : gbuf;
    if (kp && !(capped & LMLOSS_DIV_STUDENT_CAP)) { /* xs unread: kp stands in */
      kept_grad_block(jb, &gc, kp + j0, kh + j0, kp + j0, c0 + j0, n, out, capped, kind);
    } else {
      load(jb, io->s, io->sdt, io->t, io->tdt, j0, b);
      if (kp)
        kept_grad_block(jb, &gc, kp + j0, kh + j0, b->xs, c0 + j0, n, out, capped, kind);
      else
        grad_block(jb, r, b, c0 + j0, &gc, out, capped, kind);
    }
    if (!direct) lmloss_cpu_store_block(io->grad, io->gdt, j0, n, gbuf);
  }
}

/* A row pair's statistics into r (with ex, pair_io.ex, its exponentials
 * kept: a constant NULL compiles the statistics' phase without). */
DIV_INLINE void pair_stats(const div_job *jb, const pair_io *io, pair_block *b, pair_row *r,
                           float *ex, int capped) {
  lmloss_div_stats st = {0};
  int bad = 0, any_s = 0, any_t = 0;
  for (int64_t j0 = 0, blk = 0; j0 < jb->V; j0 += LMLOSS_DIV_BLOCK, blk++) {
    load(jb, io->s, io->sdt, io->t, io->tdt, j0, b);
    float *const kes = ex ? ex + j0 : NULL, *const ket = ex ? ex + jb->V + j0 : NULL;
    float *const ref = ex ? ex + 2 * jb->V + 2 * blk : NULL;
    if (!bad && any_s && any_t && st.ms > -INFINITY && st.mt > -INFINITY) {
      const float ms = st.ms, mt = st.mt;
      if (running_block(jb, b, &st, kes, ket, capped)) {
        if (ref) ref[0] = ms, ref[1] = mt;
        continue;
      }
    }
    block_check(b);
    bad |= b->bad, any_s |= b->any_s, any_t |= b->any_t;
    const lmloss_div_stats bs = block_stats(jb, b, jb->col0 + j0, kes, ket, capped);
    if (ref) ref[0] = bs.ms, ref[1] = bs.mt;
    st = j0 == 0 ? bs : lmloss_div_stats_merge(&jb->pr, &st, &bs);
  }
  *r = (pair_row){0};
  r->s.st = st;
  r->s.flags = (bad ? LMLOSS_PAIR_BAD : 0) | (any_s ? LMLOSS_PAIR_ANY_S : 0) |
               (any_t ? LMLOSS_PAIR_ANY_T : 0);
  r->s.xt_as = lmloss_load(io->t, io->tdt, st.as - jb->col0);
}

DIV_INLINE void div_pair(const div_job *jb, const pair_io *io, pair_block *b, float *gbuf,
                         pair_row *r, int phase, int capped) {
  if (phase == PAIR_WHOLE || phase == PAIR_STATE) {
    if (io->ex)
      pair_stats(jb, io, b, r, io->ex, capped);
    else
      pair_stats(jb, io, b, r, NULL, capped);
    if (phase == PAIR_STATE || !lmloss_pair_flags_ok(r->s.flags)) return;
    r->c = lmloss_div_state_row(&jb->pr, &r->s);
    if (io->ex) exp_factors(r, jb->V, io->ex);
  }
  switch (jb->opt->kind) {
  case LMLOSS_DIV_KL: sweeps(jb, r, io, b, gbuf, phase, capped, LMLOSS_DIV_KL); break;
  case LMLOSS_DIV_REVERSE_KL:
    sweeps(jb, r, io, b, gbuf, phase, capped, LMLOSS_DIV_REVERSE_KL);
    break;
  case LMLOSS_DIV_TVD: sweeps(jb, r, io, b, gbuf, phase, capped, LMLOSS_DIV_TVD); break;
  default: sweeps(jb, r, io, b, gbuf, phase, capped, LMLOSS_DIV_JSD); break;
  }
}

void lmloss_cpu_div_pair(const div_job *jb, const pair_io *io, pair_block *b, float *gbuf,
                         pair_row *r, int phase);

/* One row pair's phase. PAIR_WHOLE: r->s.flags not ok for a non-finite
 * pair (nothing written), else r holds its divergence and cross-entropy,
 * and io->grad its gradient. */
LMLOSS_CPU_DISPATCH
void lmloss_cpu_div_pair(const div_job *jb, const pair_io *io, pair_block *b, float *gbuf,
                         pair_row *r, int phase) {
  const int shared = LMLOSS_DIV_SHARED_CAP, student = LMLOSS_DIV_STUDENT_CAP;
  const int mode = lmloss_div_pair_mode(&jb->pr);
  if (mode == (shared | student))
    div_pair(jb, io, b, gbuf, r, phase, shared | student);
  else if (mode == student)
    div_pair(jb, io, b, gbuf, r, phase, student);
  else if (jb->pr.fs.k == jb->pr.ft.k)
    div_pair(jb, io, b, gbuf, r, phase, LMLOSS_DIV_ONE_K);
  else
    div_pair(jb, io, b, gbuf, r, phase, 0);
}

/* A row's label: -1 without labels, -2 for an ignored row. */
static int64_t label_of(const lmloss_div_inputs *in, const lmloss_div_options *o, int64_t i) {
  if (!lmloss_present(&in->label)) return -1;
  const int64_t y = lmloss_index_at(&in->label, i, 0);
  return y == o->ignore_index ? -2 : y;
}

/* A shard's merged states and summed partials (the finish's), or none
 * (the one-shot call). */
typedef struct {
  const lmloss_tensor *state, *partials;
  int64_t vocab;
  int kept; /* the gradient rows hold the h their partials kept */
} shard_in;

/* The factor of the reduction: a row's loss and gradient times it give the
 * reduced loss's share. */
static double reduction_factor(const lmloss_div_inputs *in, const lmloss_div_options *opt) {
  if (opt->reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) return 1.0 / opt->num_items;
  if (opt->reduction != LMLOSS_REDUCE_MEAN) return 1.0;
  int64_t valid = 0;
  for (int64_t i = 0; i < in->student.rows; i++)
    valid += label_of(in, opt, i) != -2;
  return valid > 0 ? 1.0 / (double)valid : 0.0;
}

/* The finish's row from the merged state and the summed partials: r's
 * constants and sums as the one-shot sweeps leave them. */
static void finish_row(const div_job *jb, const shard_in *si, int64_t i, int64_t y, pair_row *r) {
  *r = (pair_row){0};
  r->s = lmloss_div_state_unpack(lmloss_cpu_row(si->state, i), si->vocab, &jb->pr);
  if (!lmloss_pair_flags_ok(r->s.flags)) return;
  r->c = lmloss_div_state_row(&jb->pr, &r->s);
  const double *p = si->partials ? (const double *)lmloss_cpu_row(si->partials, i) : NULL;
  /* partials absent (the forward KL's backward): its gradient reads none */
  r->div = p ? p[0] : 0.0, r->rev = p ? p[1] : 0.0, r->mix = p ? p[2] : 0.0;
  r->pos = p ? p[3] : 0.0, r->neg = p ? p[4] : 0.0, r->eq = p ? p[5] : 0.0;
  r->ent = p ? p[6] : 0.0;
  r->es_y = y < 0 || y == r->s.st.as ? 0.0f : (r->s.ws_y - r->s.st.ms) * jb->pr.fs.k;
}

/* The rows of a one-shot call (si NULL) or a shard's finish: per-row
 * outputs, the reduced loss, and the gradient of the columns here. */
static lmloss_status div_rows(const lmloss_context *ctx, const lmloss_div_inputs *in,
                              const lmloss_div_options *opt, const div_job *jb, const shard_in *si,
                              const lmloss_div_outputs *out, const lmloss_tensor *dloss,
                              const lmloss_tensor *dx, void *ws_bytes) {
  const int64_t N = in->student.rows, V = in->student.cols;
  double *row_loss = (double *)((char *)ws_bytes + LMLOSS_CE_WS_HEADER);
  const int reduced = opt->reduction != LMLOSS_REDUCE_NONE;
  const double factor = reduction_factor(in, opt);
  int oom = 0;
  const int nt = lmloss_cpu_row_threads(ctx, 2 * N * V);
#pragma omp parallel num_threads(nt)
  {
    pair_block *b = (pair_block *)malloc(sizeof(pair_block));
    float *gbuf = (float *)malloc(LMLOSS_DIV_BLOCK * sizeof(float));
    /* pair_io.ex (past LMLOSS_DIV_KEEP_MAX columns, or without the
     * memory: none, each sweep forms its exponentials) */
    float *ex =
        !si && V <= LMLOSS_DIV_KEEP_MAX ? (float *)malloc(EX_FLOATS(V) * sizeof(float)) : NULL;
    if (!b || !gbuf) {
#pragma omp atomic write
      oom = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < N; i++) {
      if (!b || !gbuf) continue;
      const int64_t y = label_of(in, opt, i);
      void *drow = dx ? lmloss_cpu_row_mut(dx, i) : NULL;
      double div = 0.0, ce = 0.0, ent = 0.0;
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
                            y,
                            ex};
        pair_row r;
        if (si) finish_row(jb, si, i, y, &r);
        if (!si || lmloss_pair_flags_ok(r.s.flags))
          lmloss_cpu_div_pair(jb, &io, b, gbuf, &r,
                              !si        ? PAIR_WHOLE
                              : si->kept ? PAIR_KEPT
                                         : PAIR_FINISH);
        const int ok = lmloss_pair_flags_ok(r.s.flags);
        div = ok ? r.div : NAN;
        ent = ok ? r.ent : NAN;
        ce = !ok ? NAN : y >= 0 ? r.c.l1s - r.es_y : 0.0;
        if (!ok && drow) lmloss_cpu_row_fill(drow, dx->dtype, V, NAN);
      }
      /* without a hard term ce is not read: a shard's exchange may leave out w_y */
      row_loss[i] = y == -2 ? 0.0
                            : opt->soft_weight * div +
                                  (opt->hard_weight > 0.0f ? opt->hard_weight * ce : 0.0);
      if (out && lmloss_present(&out->divergence))
        *lmloss_cpu_f32_at(&out->divergence, i) = (float)div;
      if (out && lmloss_present(&out->ce)) *lmloss_cpu_f32_at(&out->ce, i) = (float)ce;
      if (out && lmloss_present(&out->entropy)) *lmloss_cpu_f32_at(&out->entropy, i) = (float)ent;
      if (out && !reduced) *lmloss_cpu_f32_at(&out->loss, i) = (float)row_loss[i];
    }
    free(b), free(gbuf), free(ex);
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

lmloss_status lmloss_cpu_divergence(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                    const lmloss_div_options *opt, const lmloss_div_outputs *out,
                                    const lmloss_tensor *dloss, const lmloss_tensor *dx,
                                    void *ws_bytes, size_t nbytes) {
  const div_job jb = {opt, lmloss_div_pair_make(opt), in->student.cols, 0};
  return div_rows(ctx, in, opt, &jb, NULL, out, dloss, dx, ws_bytes);
}

/* ------------------------------------------------------------------ */
/* Over a sharded vocabulary                                            */
/* ------------------------------------------------------------------ */

/* A job over a shard's columns. */
static div_job shard_job(const lmloss_div_inputs *in, const lmloss_div_options *opt,
                         const lmloss_shard *sh) {
  const div_job jb = {opt, lmloss_div_pair_make(opt), in->student.cols, sh->col0};
  return jb;
}

/* A row's inputs (no gradient). */
static pair_io row_io(const lmloss_div_inputs *in, int64_t i, int64_t y) {
  const pair_io io = {lmloss_cpu_row(&in->student, i),
                      lmloss_cpu_row(&in->teacher, i),
                      in->student.dtype,
                      in->teacher.dtype,
                      NULL,
                      LMLOSS_F32,
                      0.0f,
                      y,
                      NULL};
  return io;
}

/* The state phase (partials 0) or the partials phase (from merged states
 * in `state`) of every row; with dx, the partials phase writes the first
 * half of the gradient in its sweep (sweeps: the forward KL's whole, as
 * the one-shot call does; the other kinds' h, dx F32). */
static lmloss_status shard_rows(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                const lmloss_div_options *opt, const lmloss_shard *sh,
                                const lmloss_tensor *state, const lmloss_tensor *partials,
                                const lmloss_tensor *dx) {
  const div_job jb = shard_job(in, opt, sh);
  const int64_t N = in->student.rows, c0 = sh->col0;
  const float scale = /* the forward KL's whole gradient; the others' h is unscaled */
      dx && opt->kind == LMLOSS_DIV_KL ? (float)(opt->grad_output * reduction_factor(in, opt))
                                       : 0.0f;
  int oom = 0;
  const int nt = lmloss_cpu_row_threads(ctx, 2 * N * jb.V);
#pragma omp parallel num_threads(nt)
  {
    pair_block *b = (pair_block *)malloc(sizeof(pair_block));
    float *gbuf = dx ? (float *)malloc(LMLOSS_DIV_BLOCK * sizeof(float)) : NULL;
    if (!b || (dx && !gbuf)) {
#pragma omp atomic write
      oom = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < N; i++) {
      if (!b || (dx && !gbuf)) continue;
      const int64_t y = label_of(in, opt, i);
      pair_io io = row_io(in, i, y);
      if (dx) io.grad = lmloss_cpu_row_mut(dx, i), io.gdt = dx->dtype, io.scale = scale;
      pair_row r;
      if (!partials) { /* the shard's statistics, and the label's w where it lies here */
        if (y != -2) {
          lmloss_cpu_div_pair(&jb, &io, b, NULL, &r, PAIR_STATE);
          r.s.ws_y = y >= c0 && y < c0 + jb.V
                         ? lmloss_xform_w(&jb.pr.fs, lmloss_load(io.s, in->student.dtype, y - c0))
                         : NAN;
        }
        if (y == -2) r.s.st.as = -1; /* empty */
        lmloss_div_state_pack(&r.s, lmloss_cpu_row_mut(state, i));
        continue;
      }
      double *o = lmloss_cpu_row_mut(partials, i);
      for (int c = 0; c < LMLOSS_DIV_PARTIAL_COLS; c++)
        o[c] = 0.0f;
      if (y == -2) {
        if (dx) lmloss_cpu_row_fill(io.grad, dx->dtype, jb.V, 0.0f);
        continue;
      }
      r = (pair_row){0};
      r.s = lmloss_div_state_unpack(lmloss_cpu_row(state, i), sh->vocab, &jb.pr);
      if (!lmloss_pair_flags_ok(r.s.flags)) {
        for (int c = 0; c < LMLOSS_DIV_PARTIAL_COLS - 1; c++)
          o[c] = NAN;
        if (dx) lmloss_cpu_row_fill(io.grad, dx->dtype, jb.V, NAN);
        continue;
      }
      r.c = lmloss_div_state_row(&jb.pr, &r.s);
      lmloss_cpu_div_pair(&jb, &io, b, gbuf, &r, PAIR_PARTIALS);
      o[0] = r.div, o[1] = r.rev, o[2] = r.mix, o[3] = r.pos, o[4] = r.neg, o[5] = r.eq;
      o[6] = r.ent;
    }
    free(b), free(gbuf);
  }
  if (oom) return lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "CPU backend: no scratch for a row pair");
  return LMLOSS_OK;
}

lmloss_status lmloss_cpu_div_state(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                   const lmloss_div_options *opt, const lmloss_shard *sh,
                                   const lmloss_tensor *state) {
  return shard_rows(ctx, in, opt, sh, state, NULL, NULL);
}

lmloss_status lmloss_cpu_div_partials(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                      const lmloss_div_options *opt, const lmloss_shard *sh,
                                      const lmloss_tensor *state, const lmloss_tensor *partials,
                                      const lmloss_tensor *dx, void *ws, size_t ws_bytes) {
  return shard_rows(ctx, in, opt, sh, state, partials, dx);
}

lmloss_status lmloss_cpu_div_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                   const lmloss_tensor *b, const lmloss_div_options *opt,
                                   const lmloss_tensor *out) {
  const lmloss_div_pair pr = lmloss_div_pair_make(opt);
  /* Merging is a few flops a row: threads would cost more than they save. */
  for (int64_t i = 0; i < a->rows; i++) {
    const lmloss_div_state x =
        lmloss_div_state_unpack(lmloss_cpu_row(a, i), LMLOSS_STATE_MAX_VOCAB, &pr);
    const lmloss_div_state y =
        lmloss_div_state_unpack(lmloss_cpu_row(b, i), LMLOSS_STATE_MAX_VOCAB, &pr);
    const lmloss_div_state o = lmloss_div_state_merge(&pr, &x, &y);
    lmloss_div_state_pack(&o, lmloss_cpu_row_mut(out, i));
  }
  return LMLOSS_OK;
}

lmloss_status lmloss_cpu_div_finish(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                    const lmloss_div_options *opt, const lmloss_shard *sh,
                                    const lmloss_tensor *state, const lmloss_tensor *partials,
                                    const lmloss_div_outputs *out, const lmloss_tensor *dloss,
                                    const lmloss_tensor *dx, int kept, void *ws_bytes,
                                    size_t nbytes) {
  const div_job jb = shard_job(in, opt, sh);
  const shard_in si = {state, partials, sh->vocab, kept};
  return div_rows(ctx, in, opt, &jb, &si, out, dloss, dx, ws_bytes);
}
