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
#include "math/vmath.h"
#include "rowpass.h"

#define LMLOSS_DIV_BLOCK 2048
/* every helper a loop calls is inlined into each ISA clone of the loop */
#define DIV_INLINE static inline __attribute__((always_inline))

typedef struct {
  const lmloss_div_options *opt;
  lmloss_div_pair pr;
  int64_t V;
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
  b->ws = side(rs, ds, &jb->pr.fs, j0, b->n, check, b->bxs, b->bws, &b->xs, &b->bad, &b->any_s);
  b->wt = side(rt, dt, &jb->pr.ft, j0, b->n, check, b->bxt, b->bwt, &b->xt, &b->bad, &b->any_t);
}

/* The statistics of a row pair's columns: each row's max (w), its first
 * column and raw x there, R of each row and D = Rt - Rs. */
typedef struct {
  float ms, mt, xs_a, xt_a;
  int64_t as, at;
  double rs, rt, d;
} pair_stats;

static float stats_G(const div_job *jb, const pair_stats *s) {
  return lmloss_div_gap(&jb->pr, jb->pr.capped, s->mt, s->xt_a, s->ms, s->xs_a);
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
  const float G = stats_G(jb, &s), ks = jb->pr.fs.k, kt = jb->pr.ft.k;
  const float ms = s.ms > -INFINITY ? s.ms : 0.0f, mt = s.mt > -INFINITY ? s.mt : 0.0f;
  const float *restrict ws = b->ws, *restrict wt = b->wt, *restrict xs = b->xs,
                        *restrict xt = b->xt;
  float rs = 0.0f, rt = 0.0f, d = 0.0f;
#pragma omp simd reduction(+ : rs, rt, d)
  for (int i = 0; i < b->n; i++) {
    const float as_i = (ws[i] - ms) * ks, at_i = (wt[i] - mt) * kt;
    const float es = lmloss_vexp_neg(as_i, -0.0f), et = lmloss_vexp_neg(at_i, -0.0f);
    const float dg =
        lmloss_pair_dg(lmloss_div_gap(&jb->pr, capped, wt[i], xt[i], ws[i], xs[i]), G, as_i, at_i);
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
  const float ks = jb->pr.fs.k, kt = jb->pr.ft.k;
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

/* A row pair's constants and the loss sweep's sums (in double). */
typedef struct {
  lmloss_div_row c;
  double div, rev, mix, pos, neg, eq, ent;
  float es_y; /* the label's exponent (cross-entropy) */
} pair_row;

/* The loss sweep's block: its sums into r, and with grad (the forward
 * KL) the block's gradient into out. */
DIV_INLINE void loss_block(const div_job *jb, pair_row *r, const pair_block *b, int64_t j0,
                           const lmloss_div_grad *gc, float *out, int grad, int capped, int kind) {
  float div = 0.0f, rev = 0.0f, mix = 0.0f, pos = 0.0f, neg = 0.0f, eq = 0.0f, ent = 0.0f;
  const lmloss_div_row *rc = &r->c;
#pragma omp simd reduction(+ : div, rev, mix, pos, neg, eq, ent)
  for (int i = 0; i < b->n; i++) {
    const lmloss_div_col c =
        lmloss_div_column(&jb->pr, rc, capped, b->ws[i], b->wt[i], b->xs[i], b->xt[i]);
    const lmloss_div_terms t =
        lmloss_div_loss_terms(&jb->pr, rc, &c, j0 + i != rc->as && c.p != 0.0f, kind);
    div += t.div, rev += t.rev, mix += t.mix, pos += t.pos, neg += t.neg, eq += t.eq;
    ent += t.ent;
    if (grad) out[i] = lmloss_div_grad_entry(&jb->pr, rc, gc, j0 + i, &c, b->xs[i], capped, kind);
  }
  r->div += div, r->rev += rev, r->mix += mix, r->pos += pos, r->neg += neg, r->eq += eq;
  r->ent += ent;
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
  lmloss_div_grad gc = {0};
  gc.y = io->y, gc.soft = jb->opt->soft_weight, gc.scale = io->scale;
  gc.hard = io->y >= 0 ? jb->opt->hard_weight : 0.0f;
  gc.one_minus_py = io->y == r->c.as ? r->c.rs / (1.0f + r->c.rs) : -1.0f;
  const int fused = io->grad && kind == LMLOSS_DIV_KL;
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_DIV_BLOCK) {
    load(jb, io->s, io->sdt, io->t, io->tdt, j0, 0, b);
    if (fused)
      loss_block(jb, r, b, j0, &gc, gbuf, 1, capped, kind);
    else
      loss_block(jb, r, b, j0, &gc, gbuf, 0, capped, kind);
    if (io->y >= j0 && io->y < j0 + b->n)
      r->es_y = io->y == r->c.as ? 0.0f : (b->ws[io->y - j0] - r->c.ms) * r->c.ks;
    if (fused) lmloss_cpu_store_block(io->grad, io->gdt, j0, b->n, gbuf);
  }
  if (!io->grad || fused) return;
  lmloss_div_grad_sums(&gc, r->rev, r->mix, r->pos, r->neg, r->eq);
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_DIV_BLOCK) {
    load(jb, io->s, io->sdt, io->t, io->tdt, j0, 0, b);
    grad_block(jb, r, b, j0, &gc, gbuf, capped, kind);
    lmloss_cpu_store_block(io->grad, io->gdt, j0, b->n, gbuf);
  }
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
  r->c = lmloss_div_row_make(&jb->pr, st.ms, st.mt, (float)st.rs, (float)st.rt, (float)st.d, st.as,
                             st.xs_a, st.xt_a, lmloss_load(io->t, io->tdt, st.as));
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
  const int shared = LMLOSS_DIV_SHARED_CAP, student = LMLOSS_DIV_STUDENT_CAP;
  const int mode = (jb->pr.capped ? shared : 0) | (jb->pr.fs.cap > 0.0f ? student : 0);
  if (mode == (shared | student))
    div_pair(jb, io, b, gbuf, r, ok, shared | student);
  else if (mode == student)
    div_pair(jb, io, b, gbuf, r, ok, student);
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
  const div_job jb = {opt, lmloss_div_pair_make(opt), V};
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
                            y};
        pair_row r;
        int ok;
        lmloss_cpu_div_pair(&jb, &io, b, gbuf, &r, &ok);
        div = ok ? r.div : NAN;
        ent = ok ? r.ent : NAN;
        ce = !ok ? NAN : y >= 0 ? r.c.l1s - r.es_y : 0.0;
        if (!ok && drow) lmloss_cpu_row_fill(drow, dx->dtype, V, NAN);
      }
      row_loss[i] = y == -2 ? 0.0 : opt->soft_weight * div + opt->hard_weight * ce;
      if (out && lmloss_present(&out->divergence))
        *lmloss_cpu_f32_at(&out->divergence, i) = (float)div;
      if (out && lmloss_present(&out->ce)) *lmloss_cpu_f32_at(&out->ce, i) = (float)ce;
      if (out && lmloss_present(&out->entropy)) *lmloss_cpu_f32_at(&out->entropy, i) = (float)ent;
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
