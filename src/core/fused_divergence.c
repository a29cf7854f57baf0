/*
 * fused_divergence.c - divergences through two fused heads (lmloss.h):
 * per chunk of rows, both heads' logits into two F32 slabs, the
 * backend's divergence row op on them (its gradient over the student's
 * slab), then the student's dhidden, dweight and dbias GEMMs from it.
 * Rows whose label is ignored are compacted away first.
 *
 * The chunk's row op reduces with SUM_OVER_ITEMS at the whole call's
 * factor (1 / rows kept for MEAN), so each chunk's loss and gradient are
 * already the call's; NONE keeps per-row values. The chunk sums add in
 * chunk order (the backend's sum), so results do not depend on threads.
 */
#include <string.h>

#include "validate.h"
#include "workspace.h"

/* Where everything lives in the workspace: per call the row list and
 * the chunk sums, then a chunk of `rows` rows: both slabs, both heads'
 * gathered hidden rows, dhidden, the gathered labels and upstream, the
 * per-row outputs, the row op's workspace. */
typedef struct {
  size_t list, sums, slab_s, slab_t, hs, ht, dh, label, dloss, loss, div, ce, ent, row_ws, total;
  int64_t rows;
} div_plan;

static lmloss_status plan(const lmloss_head *s, const lmloss_head *t,
                          const lmloss_head_options *hopt, div_plan *p) {
  const int64_t N = s->hidden.rows, V = s->weight.rows, Hs = s->hidden.cols, Ht = t->hidden.cols;
  const size_t budget = hopt->memory_budget ? hopt->memory_budget : LMLOSS_DIV_HEAD_DEFAULT_BUDGET;
  memset(p, 0, sizeof *p);
  size_t off = 0;
  p->list = off, off += lmloss_ws_up((size_t)(N + 2) * 8); /* + 2: select_rows' scratch */
  p->sums = off, off += lmloss_ws_up((size_t)(N + 2) * 4);
  const size_t per_row = (size_t)V * 8 + (size_t)(2 * Hs + Ht) * 4 + 8 + 5 * 4 + 3 * sizeof(double);
  const size_t slack = 13 * LMLOSS_WS_ALIGN + LMLOSS_CE_WS_HEADER;
  const int64_t rows = lmloss_chunk_rows(budget, off + slack, per_row, N);
  if (rows < 1)
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL,
                       "memory_budget of %zu bytes cannot hold one row pair (%zu bytes: two rows "
                       "of V = %lld logits and their buffers) beside %zu bytes of per-call buffers",
                       budget, per_row + slack, (long long)V, off);
  const size_t R = (size_t)rows;
  p->rows = rows;
  p->slab_s = off, off += lmloss_ws_up(R * V * 4);
  p->slab_t = off, off += lmloss_ws_up(R * V * 4);
  p->hs = off, off += lmloss_ws_up(R * Hs * 4);
  p->ht = off, off += lmloss_ws_up(R * Ht * 4);
  p->dh = off, off += lmloss_ws_up(R * Hs * 4);
  p->label = off, off += lmloss_ws_up(R * 8);
  p->dloss = off, off += lmloss_ws_up(R * 4);
  p->loss = off, off += lmloss_ws_up(R * 4);
  p->div = off, off += lmloss_ws_up(R * 4);
  p->ce = off, off += lmloss_ws_up(R * 4);
  p->ent = off, off += lmloss_ws_up(R * 4);
  p->row_ws = off, off += lmloss_ws_up(lmloss_cross_entropy_workspace_size(rows));
  p->total = off;
  return LMLOSS_OK;
}

static lmloss_status check_heads(const lmloss_head *s, const lmloss_head *t,
                                 const lmloss_head_options *hopt) {
  TRY(lmloss_check_head(s, hopt));
  TRY(lmloss_check_head(t, hopt));
  if (t->hidden.rows != s->hidden.rows || t->weight.rows != s->weight.rows)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE,
                       "teacher head: hidden [%lld, .] and weight [%lld, .] where the student's "
                       "are [%lld, .] and [%lld, .]",
                       (long long)t->hidden.rows, (long long)t->weight.rows,
                       (long long)s->hidden.rows, (long long)s->weight.rows);
  return LMLOSS_OK;
}

lmloss_status lmloss_linear_divergence_workspace_size(const lmloss_head *student,
                                                      const lmloss_head *teacher,
                                                      const lmloss_head_options *hopt,
                                                      size_t *bytes) {
  div_plan p;
  if (!student || !teacher || !bytes)
    return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "a head or bytes is NULL");
  TRY(check_heads(student, teacher, hopt));
  TRY(plan(student, teacher, hopt, &p));
  *bytes = p.total;
  return LMLOSS_OK;
}

/* One call: the forward (out; grads at opt->grad_output) or the backward
 * (dloss; grads). */
typedef struct {
  const lmloss_context *ctx;
  const lmloss_head *s, *t;
  const lmloss_tensor *label;
  const lmloss_div_options *opt;
  const lmloss_div_outputs *out;
  const lmloss_tensor *dloss;
  const lmloss_head_grads *g;
} div_call;

static lmloss_status check_call(const div_call *c, const lmloss_head_options *hopt) {
  if (!c->s || !c->t || !c->opt || !hopt)
    return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "a head or the options is NULL");
  TRY(check_heads(c->s, c->t, hopt));
  TRY(lmloss_check_head_grads(c->s, c->g));
  TRY(lmloss_check_div_options(c->opt));
  const int64_t N = c->s->hidden.rows;
  const lmloss_tensor none = {0}, *label = c->label ? c->label : &none;
  TRY(lmloss_check_optional(label, "label", LMLOSS_INDICES, N, 1));
  if (c->opt->hard_weight > 0.0f && !lmloss_present(label))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "hard_weight > 0 needs a label");
  const int reduced = c->opt->reduction != LMLOSS_REDUCE_NONE;
  if (c->out) {
    const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
    TRY(lmloss_check_tensor(&c->out->loss, "loss", f32, reduced ? 1 : N, 1));
    TRY(lmloss_check_optional(&c->out->divergence, "divergence", f32, N, 1));
    TRY(lmloss_check_optional(&c->out->ce, "ce", f32, N, 1));
    TRY(lmloss_check_optional(&c->out->entropy, "entropy", f32, N, 1));
    if (lmloss_present(&c->out->ce) && !lmloss_present(label))
      return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "a ce output needs a label");
    if (lmloss_present(&c->out->dstudent))
      return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "out->dstudent: the fused heads' gradients "
                                                "are grads (dhidden, dweight, dbias)");
  } else {
    TRY(lmloss_check_tensor(c->dloss, "dloss", LMLOSS_MASK(LMLOSS_F32), reduced ? 1 : N, 1));
  }
  const lmloss_head *s = c->s, *t = c->t;
  const lmloss_tensor *ts[] = {&s->hidden, &s->weight, &s->bias, &t->hidden,
                               &t->weight, &t->bias,   label,    c->dloss ? c->dloss : &none};
  TRY(lmloss_check_device(ts, 8, s->hidden.device));
  if (c->out) {
    const lmloss_tensor *os[] = {&c->out->loss, &c->out->divergence, &c->out->ce, &c->out->entropy};
    TRY(lmloss_check_device(os, 4, s->hidden.device));
  }
  if (c->g) {
    const lmloss_tensor *gs[] = {&c->g->dhidden, &c->g->dweight, &c->g->dbias};
    TRY(lmloss_check_device(gs, 3, s->hidden.device));
  }
  return lmloss_check_indices(label, NULL, s->weight.rows, 1, c->opt->ignore_index, "label");
}

static lmloss_status run(const div_call *c, const lmloss_head_options *hopt, void *ws,
                         size_t ws_bytes) {
  TRY(check_call(c, hopt));
  const lmloss_head *s = c->s, *t = c->t;
  const lmloss_device dev = s->hidden.device;
  const lmloss_context *ctx = c->ctx;
  const lmloss_backend_ops *ops;
  TRY(lmloss_pick_backend(ctx, dev, &ops));
  TRY(lmloss_check_supports(ops, LMLOSS_CAN_FUSED_HEAD, "fused linear head"));
  TRY(lmloss_check_supports(ops, LMLOSS_CAN_DIVERGENCE, "divergences"));
  const lmloss_dtype sdt = s->hidden.dtype;
  if (sdt != LMLOSS_F32 || t->hidden.dtype != LMLOSS_F32)
    TRY(lmloss_check_supports(ops, LMLOSS_CAN_16BIT_HEAD, "BF16/F16 heads"));
  const lmloss_linear_prims *L = ops->linear;
  div_plan p;
  TRY(plan(s, t, hopt, &p));
  if (!ws) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "workspace is NULL");
  if (ws_bytes < p.total)
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, p.total);
  char *w = ws;
  const int64_t N = s->hidden.rows, V = s->weight.rows, Hs = s->hidden.cols, Ht = t->hidden.cols;
  const lmloss_tensor *label = c->label && lmloss_present(c->label) ? c->label : NULL;
  int64_t *list = (int64_t *)(w + p.list), M = 0;
  double kept = 0.0;
  lmloss_tensor all = lmloss_ws_view(NULL, LMLOSS_BOOL, dev, N, 1);
  TRY(L->select_rows(ctx, label ? label : &all, label ? c->opt->ignore_index : 0, NULL, list, &M,
                     &kept));
  const lmloss_div_options *o = c->opt;
  const int reduced = o->reduction != LMLOSS_REDUCE_NONE;
  double factor = 1.0;
  if (o->reduction == LMLOSS_REDUCE_MEAN) factor = M > 0 ? 1.0 / (double)M : 0.0;
  if (o->reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) factor = 1.0 / o->num_items;
  lmloss_div_options co = lmloss_div_resolve(o); /* the chunks' options */
  if (reduced) co.reduction = LMLOSS_REDUCE_SUM_OVER_ITEMS, co.num_items = 1.0 / factor;
  if (factor == 0.0) M = 0;

  const lmloss_head_grads *g = c->g;
  const int want_grad = g && (lmloss_present(&g->dhidden) || lmloss_present(&g->dweight) ||
                              lmloss_present(&g->dbias));
  if (c->out) {
    if (!reduced) TRY(L->fill(ctx, &c->out->loss, 0.0));
    if (lmloss_present(&c->out->divergence)) TRY(L->fill(ctx, &c->out->divergence, 0.0));
    if (lmloss_present(&c->out->ce)) TRY(L->fill(ctx, &c->out->ce, 0.0));
    if (lmloss_present(&c->out->entropy)) TRY(L->fill(ctx, &c->out->entropy, 0.0));
  }
  if (want_grad && lmloss_present(&g->dhidden)) TRY(L->fill(ctx, &g->dhidden, 0.0));
  const int64_t nchunks = (M + p.rows - 1) / p.rows;
  for (int64_t k = 0; k < nchunks; k++) {
    const int64_t first = k * p.rows, n = M - first < p.rows ? M - first : p.rows;
    const int64_t *lc = list + first;
    lmloss_tensor hs = lmloss_ws_view(w + p.hs, sdt, dev, n, Hs),
                  ht = lmloss_ws_view(w + p.ht, t->hidden.dtype, dev, n, Ht);
    lmloss_tensor zs = lmloss_ws_view(w + p.slab_s, LMLOSS_F32, dev, n, V);
    lmloss_tensor zt = lmloss_ws_view(w + p.slab_t, LMLOSS_F32, dev, n, V);
    TRY(L->gather_rows(ctx, &s->hidden, lc, &hs));
    TRY(L->gather_rows(ctx, &t->hidden, lc, &ht));
    TRY(L->logits(ctx, &hs, &s->weight, &s->bias, &zs));
    TRY(L->logits(ctx, &ht, &t->weight, &t->bias, &zt));
    lmloss_div_inputs in = {zs, zt, {0}};
    if (label) {
      in.label = lmloss_ws_view(w + p.label, label->dtype, dev, n, 1);
      TRY(L->gather_rows(ctx, label, lc, &in.label));
    }
    const size_t rws = lmloss_cross_entropy_workspace_size(n);
    if (c->out) {
      lmloss_div_outputs oc = {
          reduced ? lmloss_ws_view(w + p.sums + (size_t)k * 4, LMLOSS_F32, dev, 1, 1)
                  : lmloss_ws_view(w + p.loss, LMLOSS_F32, dev, n, 1),
          lmloss_ws_view(w + p.div, LMLOSS_F32, dev, n, 1),
          lmloss_ws_view(w + p.ce, LMLOSS_F32, dev, n, 1),
          {0},
          lmloss_ws_view(w + p.ent, LMLOSS_F32, dev, n, 1)};
      if (!label) oc.ce = (lmloss_tensor){0};
      if (!lmloss_present(&c->out->entropy)) oc.entropy = (lmloss_tensor){0};
      TRY(ops->divergence(ctx, &in, &co, &oc, NULL, want_grad ? &zs : NULL, w + p.row_ws, rws));
      if (!reduced) TRY(L->scatter_rows(ctx, &oc.loss, lc, &c->out->loss));
      if (lmloss_present(&c->out->divergence))
        TRY(L->scatter_rows(ctx, &oc.divergence, lc, &c->out->divergence));
      if (lmloss_present(&c->out->ce)) TRY(L->scatter_rows(ctx, &oc.ce, lc, &c->out->ce));
      if (lmloss_present(&c->out->entropy))
        TRY(L->scatter_rows(ctx, &oc.entropy, lc, &c->out->entropy));
    } else {
      lmloss_tensor up = *c->dloss;
      if (!reduced) {
        up = lmloss_ws_view(w + p.dloss, LMLOSS_F32, dev, n, 1);
        TRY(L->gather_rows(ctx, c->dloss, lc, &up));
      }
      TRY(ops->divergence(ctx, &in, &co, NULL, &up, &zs, w + p.row_ws, rws));
    }
    if (!want_grad) continue;
    /* the slab zs now holds the gradient; the first chunk overwrites dW
     * and dbias unless they are added to (accumulate) */
    const float beta = k == 0 && !g->accumulate ? 0.0f : 1.0f;
    if (lmloss_present(&g->dbias)) TRY(L->colsum(ctx, &zs, NULL, beta, &g->dbias));
    /* a 16-bit head's GEMMs take the gradient in its dtype, over the
     * teacher's slab (read by the row op, free now); an F32 dweight sums
     * the chunks in fp32, a 16-bit one rounds each chunk's sum */
    lmloss_tensor dl = zs;
    if (sdt != LMLOSS_F32) {
      dl = lmloss_ws_view(w + p.slab_t, sdt, dev, n, V);
      TRY(L->cast(ctx, &zs, &dl));
    }
    if (lmloss_present(&g->dweight)) TRY(L->gemm(ctx, 1, 0, 1.0f, &dl, &hs, beta, &g->dweight));
    if (lmloss_present(&g->dhidden)) {
      lmloss_tensor dh = lmloss_ws_view(w + p.dh, sdt, dev, n, Hs);
      TRY(L->gemm(ctx, 0, 0, 1.0f, &dl, &s->weight, 0.0f, &dh));
      TRY(L->scatter_rows(ctx, &dh, lc, &g->dhidden));
    }
  }
  if (want_grad && nchunks == 0 && !g->accumulate) {
    if (lmloss_present(&g->dweight)) TRY(L->fill(ctx, &g->dweight, 0.0));
    if (lmloss_present(&g->dbias)) TRY(L->fill(ctx, &g->dbias, 0.0));
  }
  if (c->out && reduced) {
    if (nchunks == 0) return L->fill(ctx, &c->out->loss, 0.0);
    lmloss_tensor sums = lmloss_ws_view(w + p.sums, LMLOSS_F32, dev, nchunks, 1);
    TRY(L->sum(ctx, &sums, &c->out->loss));
  }
  return LMLOSS_OK;
}

lmloss_status lmloss_linear_divergence(const lmloss_context *ctx, const lmloss_head *student,
                                       const lmloss_head *teacher, const lmloss_tensor *label,
                                       const lmloss_div_options *opt,
                                       const lmloss_head_options *hopt,
                                       const lmloss_div_outputs *out,
                                       const lmloss_head_grads *grads, void *ws, size_t ws_bytes) {
  if (!out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "outputs is NULL");
  const div_call c = {ctx, student, teacher, label, opt, out, NULL, grads};
  return run(&c, hopt, ws, ws_bytes);
}

lmloss_status lmloss_linear_divergence_backward(
    const lmloss_context *ctx, const lmloss_head *student, const lmloss_head *teacher,
    const lmloss_tensor *label, const lmloss_div_options *opt, const lmloss_head_options *hopt,
    const lmloss_tensor *dloss, const lmloss_head_grads *grads, void *ws, size_t ws_bytes) {
  if (!dloss) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "dloss is NULL");
  const div_call c = {ctx, student, teacher, label, opt, NULL, dloss, grads};
  return run(&c, hopt, ws, ws_bytes);
}
