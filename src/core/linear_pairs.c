/*
 * linear_pairs.c - the DPO family through the fused head
 * (lmloss_linear_preference). A pair's upstream is known once its rows'
 * log-probs are, so the call takes a group of whole pairs at a time:
 *   each sequence of the group: its rows' logits, chunk by chunk, through
 *   the kept log-probs' row op (their log-probs, and each log-prob's
 *   gradient onehot - p into the store, with its exact entries)  (GEMM 1)
 *   the sequences' sums, and the objective's gradient in them (the
 *   preference op on the group's pairs, at upstream k / P)
 *   dW += store^T (s h), dhidden = s (store W), s each row's sequence's
 *   gradient                                                (GEMMs 2, 3)
 * so the head runs three GEMMs and the store holds one group, not the
 * batch. The loss and metrics come from the preference op over all pairs
 * at the end. A 16-bit dW summed in an fp32 accumulator is written only by
 * the last cast, so until then its bytes hold the store's first rows.
 */
#include <stdlib.h>
#include <string.h>

#include "linear_job.h"

/* The plan: the fields of a linear_plan that the shared row op and
 * dhidden read (K, S, the keep, sums, slab, aux, ce_ws, region, total),
 * and the pair call's own buffers. */
typedef struct {
  linear_plan lp;
  int64_t T, per_group, cap; /* a sequence's rows; pairs a group; a group's rows */
  int64_t in_dw;             /* the store's first rows, whose gradient lies in dweight */
  int grad, acc;             /* gradients wanted; dW summed in the fp32 accumulator */
  size_t seqs, dseq, tokens, inv, scalar, ones, up, logp, bias32, pref, acc_w, ghid, store, hid;
} pair_plan;

/* The types whose terms couple pairs: one group must hold them all. */
static int couples_pairs(const lmloss_pref_options *o) {
  const double *w = o->loss_weights;
  return w[LMLOSS_PREF_AOT] != 0.0 || w[LMLOSS_PREF_AOT_UNPAIRED] != 0.0 ||
         w[LMLOSS_PREF_SFT] != 0.0;
}

/* The most rows of a wide chunk (group_rows): its logits and its rows of
 * the store within the group's store, and one sequence at most. */
static int64_t wide_rows(const pair_plan *q, int64_t T) {
  const int64_t w = q->cap * q->lp.dls / (q->lp.dls + 4);
  return w < T ? w : T;
}

/* The layout for groups of k pairs and chunks of c rows; its total. */
static size_t pair_layout(const lmloss_head *head, int64_t P, int64_t k, int64_t c, pair_plan *q) {
  const int64_t N = head->hidden.rows, H = head->hidden.cols, V = head->weight.rows, T = q->T;
  linear_plan *p = &q->lp;
  q->per_group = k, q->cap = 2 * T * k;
  const int64_t cap = q->cap, in_dw = q->in_dw < cap ? q->in_dw : cap;
  size_t off = 0;
  p->list = off, off += lmloss_ws_up((size_t)(N + 2) * 8); /* + 2: select_rows' scratch */
  if (p->dl_separate) {
    p->cols = off, off += lmloss_ws_up((size_t)cap * p->S * 8);
    p->vals = off, off += lmloss_ws_up((size_t)cap * p->S * 4);
  }
  p->sums = off, off += lmloss_ws_up((size_t)(T + 2) * 4); /* the row op's scratch */
  q->seqs = off, off += lmloss_ws_up((size_t)P * 8);
  q->dseq = off, off += lmloss_ws_up((size_t)P * 8);
  q->tokens = off, off += lmloss_ws_up((size_t)P * 8);
  q->inv = off, off += lmloss_ws_up((size_t)P * 8); /* 1 / tokens (average) */
  q->scalar = off, off += LMLOSS_WS_ALIGN;
  q->ones = off, off += lmloss_ws_up((size_t)T * 4); /* a sequence's rows */
  q->up = off, off += lmloss_ws_up((size_t)cap * 4);
  q->logp = off, off += lmloss_ws_up((size_t)N * 4);
  q->bias32 = off, off += wants(&head->bias) ? lmloss_ws_up((size_t)V * 4) : 0;
  q->pref = off, off += lmloss_ws_up(lmloss_preference_workspace_size(P));
  q->acc_w = off, off += q->acc ? lmloss_ws_up((size_t)V * H * 4) : 0;
  q->ghid = off, off += q->grad ? lmloss_ws_up((size_t)cap * H * p->hs) : 0;
  q->store = off, off += q->grad ? lmloss_ws_up((size_t)(cap - in_dw) * V * p->dls) : 0;
  p->region = off;
  q->hid = off, off += q->grad ? 0 : lmloss_ws_up((size_t)c * H * p->hs);
  p->slab = off, off += lmloss_ws_up((size_t)c * V * 4);
  const int64_t wide = q->grad ? wide_rows(q, T) : 0;
  p->rows = c;
  p->slot_rows = wide > c ? wide : c;
  p->aux = off, off += lmloss_ws_up((size_t)p->slot_rows * aux_per_row(1));
  p->ce_ws = off, off += lmloss_ws_up(lmloss_cross_entropy_workspace_size(p->slot_rows));
  const size_t dh_row = p->region + lmloss_ws_up((size_t)H * 4); /* dhidden's fp32 block */
  return p->total = off > dh_row ? off : dh_row;
}

/* The plan within the budget (as the three-GEMM cross-entropy's: the
 * default is 256 MiB beside the bytes of a V x H fp32 sum of dW): the most
 * pairs a group, with chunks of at least 256 rows (or T), then chunks as
 * wide as the rest allows. *fits 0 where not one pair fits (every pair,
 * for a type that couples them; a call without gradients keeps no store
 * and takes them all). */
static void pair_make_plan(const lmloss_head *head, const lmloss_head_options *hopt,
                           const lmloss_head_grads *g, int64_t P, const lmloss_pref_options *opt,
                           pair_plan *q, int *fits) {
  const int64_t N = head->hidden.rows, H = head->hidden.cols, V = head->weight.rows;
  linear_plan *p = &q->lp;
  memset(q, 0, sizeof *q);
  q->T = N / (2 * P);
  p->K = 1, p->S = 2, p->hs = lmloss_dtype_size(head->hidden.dtype);
  q->grad = has_grads(g);
  p->dl_separate = q->grad && head->weight.dtype != LMLOSS_F32;
  p->dls = q->grad ? lmloss_dtype_size(head->weight.dtype) : 0;
  const lmloss_tensor *dw = q->grad ? &g->dweight : NULL;
  q->acc = dw && wants(dw) && dw->dtype != LMLOSS_F32 && hopt->fp32_accumulate;
  if (q->acc && dw->row_stride == H) {
    const size_t bytes = (size_t)V * H * lmloss_dtype_size(dw->dtype);
    q->in_dw = (int64_t)((bytes - LMLOSS_WS_ALIGN) / ((size_t)V * p->dls));
  }
  const size_t E =
      hopt->memory_budget ? hopt->memory_budget : LMLOSS_HEAD_DEFAULT_BUDGET + (size_t)V * H * 4;
  const int64_t min_c = q->T < 256 ? q->T : 256;
  const int64_t k_min = q->grad && !couples_pairs(opt) ? 1 : P;
  int64_t k = P;
  while (k > k_min && pair_layout(head, P, k, min_c, q) > E)
    k--;
  *fits = pair_layout(head, P, k, min_c, q) <= E;
  if (!*fits) return;
  /* the rest widens the chunks, in whole tiles of 128 */
  const size_t per_row =
      (size_t)V * 4 + aux_per_row(1) + 3 * sizeof(double) + (q->grad ? 0 : (size_t)H * p->hs);
  int64_t c = min_c + (int64_t)((E - p->total) / per_row);
  c = c < q->T ? c : q->T;
  if (c > 128) c -= c % 128;
  while (c > min_c && pair_layout(head, P, k, c, q) > E)
    c -= c > 128 ? 128 : 1;
  pair_layout(head, P, k, c > min_c ? c : min_c, q);
}

/* A call: its arguments, backend, plan and workspace. */
typedef struct {
  const lmloss_context *ctx;
  const lmloss_head *head;
  const lmloss_tensor *index, *mask;
  const lmloss_transform *tr;
  const lmloss_head_options *hopt;
  const lmloss_linear_pref_inputs *in;
  const lmloss_pref_options *opt;
  const lmloss_head_grads *grads;
  const lmloss_backend_ops *ops;
  pair_plan q;
  char *w;
  lmloss_tensor bias, logp; /* the logits' F32 bias; every token's log-prob [N, 1] */
} pair_call;

/* A F32 [n, 1] view of the workspace at byte off, element first on. */
static lmloss_tensor f32_at(const pair_call *c, size_t off, int64_t first, int64_t n) {
  return lmloss_ws_view(c->w + off + (size_t)first * 4, LMLOSS_F32, c->head->hidden.device, n, 1);
}

/* One sequence as a job of the kept log-probs: its rows of hidden, index,
 * mask, log-probs and dhidden (its fields point into itself: made in
 * place, never copied). */
typedef struct {
  lmloss_head head;
  lmloss_tensor index, mask, logp;
  lmloss_head_grads grads;
  linear_job job;
} seq_view;

static void seq_view_make(const pair_call *c, int64_t s, seq_view *v) {
  const int64_t T = c->q.T, first = s * T;
  memset(v, 0, sizeof *v);
  v->head = *c->head;
  v->head.hidden = lmloss_rows_of(&c->head->hidden, first, T);
  v->head.bias = c->bias;
  v->index = lmloss_rows_of(c->index, first, T);
  v->mask = wants(c->mask) ? lmloss_rows_of(c->mask, first, T)
                           : lmloss_ws_view(NULL, LMLOSS_BOOL, c->head->hidden.device, T, 1);
  v->logp = lmloss_rows_of(&c->logp, first, T);
  if (c->grads && wants(&c->grads->dhidden))
    v->grads.dhidden = lmloss_rows_of(&c->grads->dhidden, first, T);
  v->job = (linear_job){.table = &lmloss_lp_keep_forward_job,
                        .ctx = c->ctx,
                        .head = &v->head,
                        .labels = &v->index,
                        .tr = c->tr,
                        .hopt = c->hopt,
                        .logp = &v->logp,
                        .grads = &v->grads};
}

/* Where store row r lies (in one part of it: dweight's bytes, rows
 * 0..in_dw, or the workspace's, the rest up to cap). */
static char *store_at(const pair_call *c, int64_t r) {
  const pair_plan *q = &c->q;
  const size_t row = (size_t)c->head->weight.rows * q->lp.dls;
  return r < q->in_dw ? lmloss_linear_dw_base(&c->grads->dweight) + (size_t)r * row
                      : c->w + q->store + (size_t)(r - q->in_dw) * row;
}

/* Store rows first..first+n (in one part of it). */
static lmloss_tensor store_rows(const pair_call *c, int64_t first, int64_t n) {
  return lmloss_ws_view(store_at(c, first), c->head->weight.dtype, c->head->hidden.device, n,
                        c->head->weight.rows);
}

/* A chunk of up to `left` rows of a sequence from store row pos: n rows
 * (none across the store's parts), and where their fp32 logits go. The
 * store's rows not yet written lie free until the group's gradients: a
 * chunk there is wide (up to wide_rows, in whole tiles of 128 unless it
 * ends the sequence), its logits in the free rows after its own, so the
 * logits GEMMs and row passes run on wide chunks where the slab would
 * have cut them short; then chunks take the slab. Not the CE head's
 * wide_chunk_rows: here the store has two parts and a chunk starts at any
 * row (sequences of any count), so the room is counted in bytes, with
 * the slack that aligns the slab. */
static int64_t chunk_at(const pair_call *c, int64_t pos, int64_t left, char **slab_at) {
  const pair_plan *q = &c->q;
  const size_t row = (size_t)c->head->weight.rows * q->lp.dls;
  const int64_t end = pos < q->in_dw ? q->in_dw : q->cap; /* this part's end */
  int64_t n = left < q->lp.rows ? left : q->lp.rows;
  if (pos + n > end) n = end - pos;
  *slab_at = c->w + q->lp.slab;
  const size_t room = (size_t)(end - pos) * row;
  int64_t w = room > LMLOSS_WS_ALIGN
                  ? (int64_t)((room - LMLOSS_WS_ALIGN) / (row + (size_t)c->head->weight.rows * 4))
                  : 0;
  w = w < q->lp.slot_rows ? w : q->lp.slot_rows;
  if (w < left) w -= w % 128;
  w = w < left ? w : left;
  if (w < 128 || w <= n) return n;
  *slab_at = lmloss_ws_ptr_up(store_at(c, pos + w));
  return w;
}

/* A sequence's rows in the store: first..first+n. */
typedef struct {
  int64_t seq, first, n;
} seq_rows;

/* Sequence s's list: its selected rows (compact, from its first row),
 * from entry s T of the call's list. */
static const int64_t *seq_list(const pair_call *c, int64_t s) {
  return (const int64_t *)(c->w + c->q.lp.list) + s * c->q.T;
}

/* Each sequence's rows that count, selected once for the call (their
 * count to the host: the call's only synchronizations, before any GEMM),
 * into count[s] and, as a float, its token count. */
static lmloss_status select_sequences(const pair_call *c, int64_t *count) {
  const lmloss_linear_prims *L = c->ops->linear;
  for (int64_t s = 0; s < 2 * c->in->pairs; s++) {
    seq_view v;
    seq_view_make(c, s, &v);
    double wsum;
    TRY(L->select_rows(c->ctx, &v.mask, 0, NULL, (int64_t *)seq_list(c, s), &count[s], &wsum));
    const lmloss_tensor tok = f32_at(c, c->q.tokens, s, 1), inv = f32_at(c, c->q.inv, s, 1);
    TRY(L->fill(c->ctx, &tok, (double)count[s]));
    if (c->in->average) TRY(L->fill(c->ctx, &inv, count[s] ? 1.0 / (double)count[s] : 0.0));
  }
  return LMLOSS_OK;
}

/* The group's sequences (the chosen of pairs g0..g1, then the rejected;
 * count[s] rows each) through the row op, chunk by chunk, their rows into
 * the store from row 0 on (without gradients, each chunk in place): where
 * each one's rows went into segs, their count into *rows. */
static lmloss_status group_rows(const pair_call *c, int64_t g0, int64_t g1, const int64_t *count,
                                seq_rows *segs, int64_t *rows) {
  const lmloss_linear_prims *L = c->ops->linear;
  const pair_plan *q = &c->q;
  const lmloss_device dev = c->head->hidden.device;
  const int64_t H = c->head->hidden.cols, V = c->head->weight.rows, P = c->in->pairs;
  int64_t pos = 0, k = 0, n;
  for (int side = 0; side < 2; side++) {
    for (int64_t i = g0; i < g1; i++, k++) {
      const int64_t s = side * P + i, m = count[s], *list = seq_list(c, s);
      seq_view v;
      seq_view_make(c, s, &v);
      segs[k] = (seq_rows){s, pos, m};
      for (int64_t first = 0; first < m; first += n, pos += n) {
        char *slab_at = c->w + q->lp.slab;
        n = q->grad ? chunk_at(c, pos, m - first, &slab_at)
                    : (m - first < q->lp.rows ? m - first : q->lp.rows);
        char *hid = q->grad ? c->w + q->ghid + (size_t)pos * H * q->lp.hs : c->w + q->hid;
        const lmloss_tensor hc = lmloss_ws_view(hid, c->head->hidden.dtype, dev, n, H);
        const lmloss_tensor slab = lmloss_ws_view(slab_at, LMLOSS_F32, dev, n, V);
        TRY(L->gather_rows(c->ctx, &v.head.hidden, list + first, &hc));
        TRY(L->logits(c->ctx, &hc, &c->head->weight, &c->bias, &slab));
        const lmloss_tensor dl = q->grad ? store_rows(c, pos, n) : slab;
        lmloss_row_keep kept;
        const linear_chunk ch = {
            list + first, 0, n, &slab, &dl, lmloss_linear_keep_at(&q->lp, c->w, pos, &kept), 1.0};
        TRY(lmloss_lp_keep_forward_job.rows(&v.job, c->ops, &q->lp, c->w, &ch));
      }
    }
  }
  *rows = pos;
  return LMLOSS_OK;
}

/* The preference op's inputs for pairs g0..g0+n: the policy's sums and
 * token counts from the workspace, the rest the caller's. */
static lmloss_pref_inputs pairs_in(const pair_call *c, int64_t g0, int64_t n) {
  const lmloss_linear_pref_inputs *in = c->in;
  const int64_t P = in->pairs;
  lmloss_pref_inputs x;
  memset(&x, 0, sizeof x);
  x.chosen = f32_at(c, c->q.seqs, g0, n), x.rejected = f32_at(c, c->q.seqs, P + g0, n);
  x.chosen_tokens = f32_at(c, c->q.tokens, g0, n);
  x.rejected_tokens = f32_at(c, c->q.tokens, P + g0, n);
  if (wants(&in->ref_chosen)) x.ref_chosen = lmloss_rows_of(&in->ref_chosen, g0, n);
  if (wants(&in->ref_rejected)) x.ref_rejected = lmloss_rows_of(&in->ref_rejected, g0, n);
  if (wants(&in->weight)) x.weight = lmloss_rows_of(&in->weight, g0, n);
  return x;
}

/* Pairs g0..g1 after their rows (segs, rows): the sequences' sums, the
 * objective's gradient in them (its share k / P of the mean over all P
 * pairs), each store row's upstream s, then dW (beta: 0 for the first
 * group unless added to the caller's) and dhidden. */
static lmloss_status group_grads(const pair_call *c, int64_t g0, int64_t g1, const seq_rows *segs,
                                 int64_t rows, float beta) {
  const lmloss_linear_prims *L = c->ops->linear;
  const pair_plan *q = &c->q;
  const lmloss_head_grads *g = c->grads;
  const lmloss_device dev = c->head->hidden.device;
  const int64_t H = c->head->hidden.cols, V = c->head->weight.rows, P = c->in->pairs;
  const int64_t T = q->T, nseq = 2 * (g1 - g0);
  for (int64_t k = 0; k < nseq; k++) { /* each sequence's sum, or mean */
    const lmloss_tensor lp = lmloss_rows_of(&c->logp, segs[k].seq * T, T);
    const lmloss_tensor sum = f32_at(c, q->seqs, segs[k].seq, 1);
    TRY(L->sum(c->ctx, &lp, &sum));
    if (c->in->average)
      TRY(L->scale(c->ctx, &sum, (const float *)f32_at(c, q->inv, segs[k].seq, 1).data));
  }
  if (!q->grad) return LMLOSS_OK;
  const lmloss_pref_inputs x = pairs_in(c, g0, g1 - g0);
  const lmloss_tensor share = f32_at(c, q->scalar, 0, 1);
  const lmloss_tensor dc = f32_at(c, q->dseq, g0, g1 - g0),
                      dr = f32_at(c, q->dseq, P + g0, g1 - g0);
  TRY(L->fill(c->ctx, &share, (double)(g1 - g0) / (double)P));
  TRY(c->ops->preference(c->ctx, &x, c->opt, NULL, &share, &dc, &dr, c->w + q->pref,
                         lmloss_preference_workspace_size(g1 - g0)));
  for (int64_t k = 0; k < nseq; k++) { /* s = ones x the sequence's gradient: a GEMM of k = 1 */
    if (segs[k].n == 0) continue;
    const lmloss_tensor ones = f32_at(c, q->ones, 0, segs[k].n);
    const lmloss_tensor d = f32_at(c, q->dseq, segs[k].seq, 1);
    if (c->in->average) /* d loss / d sum = d loss / d mean / tokens */
      TRY(L->scale(c->ctx, &d, (const float *)f32_at(c, q->inv, segs[k].seq, 1).data));
    const lmloss_tensor s = f32_at(c, q->up, segs[k].first, segs[k].n);
    TRY(L->gemm(c->ctx, 0, 0, 1.0f, &ones, &d, 0.0f, &s));
  }
  if (rows == 0) return LMLOSS_OK;
  const lmloss_tensor hg = lmloss_ws_view(c->w + q->ghid, c->head->hidden.dtype, dev, rows, H);
  const lmloss_tensor s = f32_at(c, q->up, 0, rows);
  const int64_t A = rows < q->in_dw ? rows : q->in_dw; /* rows in dweight's bytes */
  if (wants(&g->dweight)) {
    const lmloss_tensor dw =
        q->acc ? lmloss_ws_view(c->w + q->acc_w, LMLOSS_F32, dev, V, H) : g->dweight;
    TRY(L->scale_rows(c->ctx, &hg, &s));
    const int64_t part[3] = {0, A, rows};
    for (int k = 0; k < 2; k++) {
      if (part[k + 1] == part[k]) continue;
      const int64_t n = part[k + 1] - part[k];
      const lmloss_tensor dl = store_rows(c, part[k], n), hk = lmloss_rows_of(&hg, part[k], n);
      TRY(L->gemm(c->ctx, 1, 0, 1.0f, &dl, &hk, beta, &dw));
      beta = 1.0f;
    }
  }
  if (!wants(&g->dhidden)) return LMLOSS_OK;
  for (int64_t k = 0; k < nseq; k++) { /* each sequence, split where the store's parts meet */
    seq_view v;
    seq_view_make(c, segs[k].seq, &v);
    const int64_t *list = seq_list(c, segs[k].seq);
    for (int64_t a = segs[k].first, end = a + segs[k].n, b; a < end; a = b) {
      b = a < A && end > A ? A : end;
      const lmloss_tensor dl = store_rows(c, a, b - a), hk = lmloss_rows_of(&hg, a, b - a);
      const lmloss_tensor sk = lmloss_rows_of(&s, a, b - a);
      TRY(lmloss_linear_store_dhidden(&v.job, L, &q->lp, c->w, list + (a - segs[k].first), a, &dl,
                                      &hk, &sk));
    }
  }
  return LMLOSS_OK;
}

/* After the groups: dW's sum cast once (or zeros where no row was
 * supervised), the loss and metrics over all pairs, the sums asked for
 * (the log-probs went where the call keeps them: its output, if given). */
static lmloss_status pairs_finish(const pair_call *c, const lmloss_linear_pref_outputs *out,
                                  int any_rows) {
  const lmloss_linear_prims *L = c->ops->linear;
  const pair_plan *q = &c->q;
  const lmloss_head_grads *g = c->grads;
  const int64_t P = c->in->pairs, V = c->head->weight.rows, H = c->head->hidden.cols;
  if (q->grad && wants(&g->dweight)) {
    const lmloss_tensor acc =
        lmloss_ws_view(c->w + q->acc_w, LMLOSS_F32, c->head->hidden.device, V, H);
    if (!any_rows && !g->accumulate) TRY(L->fill(c->ctx, q->acc ? &acc : &g->dweight, 0.0));
    if (q->acc) TRY(L->cast(c->ctx, &acc, &g->dweight));
  }
  const lmloss_pref_inputs x = pairs_in(c, 0, P);
  lmloss_pref_outputs po;
  memset(&po, 0, sizeof po);
  po.loss = out->loss, po.metrics = out->metrics, po.pair_loss = out->pair_loss;
  TRY(c->ops->preference(c->ctx, &x, c->opt, &po, NULL, NULL, NULL, c->w + q->pref,
                         lmloss_preference_workspace_size(P)));
  if (wants(&out->chosen)) TRY(L->cast(c->ctx, &x.chosen, &out->chosen));
  return wants(&out->rejected) ? L->cast(c->ctx, &x.rejected, &out->rejected) : LMLOSS_OK;
}

/* The sequences' selection, the groups, then the finish; count (2P) and
 * segs (two a pair of a group): host memory. */
static lmloss_status run_groups(const pair_call *c, int64_t *count, seq_rows *segs,
                                const lmloss_linear_pref_outputs *out) {
  const int64_t P = c->in->pairs;
  int any_rows = 0;
  TRY(select_sequences(c, count));
  for (int64_t g0 = 0; g0 < P; g0 += c->q.per_group) {
    const int64_t g1 = g0 + c->q.per_group < P ? g0 + c->q.per_group : P;
    int64_t rows;
    TRY(group_rows(c, g0, g1, count, segs, &rows));
    const float beta = !any_rows && !(c->grads && c->grads->accumulate) ? 0.0f : 1.0f;
    TRY(group_grads(c, g0, g1, segs, rows, beta));
    any_rows |= rows > 0;
  }
  return pairs_finish(c, out, any_rows);
}

/* The arguments (not the workspace); P and T checked first, the plan's. */
static lmloss_status check_pairs(const lmloss_head *head, const lmloss_head_options *hopt,
                                 const lmloss_head_grads *grads, int64_t P,
                                 const lmloss_pref_options *opt) {
  TRY(lmloss_check_head(head, hopt));
  TRY(lmloss_check_head_grads(head, grads));
  if (!opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "options is NULL");
  TRY(lmloss_check_pref_options(opt));
  const int64_t N = head->hidden.rows;
  if (P < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "pairs must be >= 1, got %lld", (long long)P);
  if (N < 2 * P || N % (2 * P) != 0)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE,
                       "hidden: N = %lld rows are not 2P = %lld sequences of equal length",
                       (long long)N, (long long)(2 * P));
  if (grads && wants(&grads->dbias))
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "dbias: the pair head forms no column sums "
                                               "(lmloss_linear_log_probs_backward has them)");
  return LMLOSS_OK;
}

lmloss_status lmloss_linear_preference_size(const lmloss_head *head,
                                            const lmloss_head_options *hopt,
                                            const lmloss_head_grads *grads, int64_t pairs,
                                            const lmloss_pref_options *opt, size_t *bytes) {
  if (!bytes) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "bytes is NULL");
  TRY(check_pairs(head, hopt, grads, pairs, opt));
  pair_plan q;
  int fits;
  pair_make_plan(head, hopt, grads, pairs, opt, &q, &fits);
  *bytes = fits ? q.lp.total : 0;
  return LMLOSS_OK;
}

/* The inputs and outputs beside the head's (their shapes and devices). */
static lmloss_status check_pair_tensors(const lmloss_head *head, const lmloss_tensor *index,
                                        const lmloss_tensor *mask, const lmloss_transform *tr,
                                        const lmloss_linear_pref_inputs *in,
                                        const lmloss_pref_options *opt,
                                        const lmloss_linear_pref_outputs *out) {
  const int64_t N = head->hidden.rows, V = head->weight.rows, P = in->pairs;
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  if (!wants(index)) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "index: data is NULL");
  if (index->cols != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "index: the pair head takes K = 1");
  if (in->average != 0 && in->average != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "average must be 0 or 1, got %d", in->average);
  TRY(lmloss_check_lp_labels(index, mask, tr, N, V));
  TRY(lmloss_check_optional(&in->ref_chosen, "ref_chosen", f32, P, 1));
  TRY(lmloss_check_optional(&in->ref_rejected, "ref_rejected", f32, P, 1));
  TRY(lmloss_check_optional(&in->weight, "weight", f32, P, 1));
  if ((opt->loss_weights[LMLOSS_PREF_AOT] != 0.0 ||
       opt->loss_weights[LMLOSS_PREF_AOT_UNPAIRED] != 0.0) &&
      wants(&in->weight))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "AOT's sorted terms take no pair weights");
  TRY(lmloss_check_tensor(&out->loss, "loss", f32, 1, 1));
  TRY(lmloss_check_optional(&out->metrics, "metrics", f32, LMLOSS_PREF_METRICS, 1));
  TRY(lmloss_check_optional(&out->pair_loss, "pair_loss", f32, P, 1));
  TRY(lmloss_check_optional(&out->chosen, "chosen", f32, P, 1));
  TRY(lmloss_check_optional(&out->rejected, "rejected", f32, P, 1));
  TRY(lmloss_check_optional(&out->logp, "logp", f32, N, 1));
  const lmloss_tensor *ts[] = {&head->hidden,  &head->weight,   &head->bias,       index,
                               mask,           &in->ref_chosen, &in->ref_rejected, &in->weight,
                               &out->loss,     &out->metrics,   &out->pair_loss,   &out->chosen,
                               &out->rejected, &out->logp};
  TRY(lmloss_check_device(ts, 14, head->hidden.device));
  return lmloss_check_indices(index, mask, V, 0, 0, "index");
}

/* The outputs share no byte with dweight, which may hold the store, and
 * the log-probs, written as the groups go, none with the inputs they read. */
static lmloss_status outputs_apart(const lmloss_head *head, const lmloss_tensor *index,
                                   const lmloss_head_grads *g,
                                   const lmloss_linear_pref_outputs *out) {
  const lmloss_tensor *read[] = {&head->hidden, &head->weight, index};
  const char *read_name[] = {"hidden", "weight", "index"};
  for (int r = 0; r < 3; r++)
    TRY(lmloss_check_disjoint(&out->logp, "logp", read[r], read_name[r]));
  if (!g) return LMLOSS_OK;
  const lmloss_tensor *o[] = {&out->loss,   &out->metrics,  &out->pair_loss,
                              &out->chosen, &out->rejected, &out->logp};
  const char *names[] = {"loss", "metrics", "pair_loss", "chosen", "rejected", "logp"};
  for (int k = 0; k < 6; k++)
    TRY(lmloss_check_disjoint(&g->dweight, "dweight", o[k], names[k]));
  return LMLOSS_OK;
}

lmloss_status lmloss_linear_preference(const lmloss_context *ctx, const lmloss_head *head,
                                       const lmloss_tensor *index, const lmloss_tensor *mask,
                                       const lmloss_transform *tr, const lmloss_head_options *hopt,
                                       const lmloss_linear_pref_inputs *in,
                                       const lmloss_pref_options *opt,
                                       const lmloss_linear_pref_outputs *out,
                                       const lmloss_head_grads *grads, void *ws, size_t ws_bytes) {
  if (!in || !out) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "inputs or outputs is NULL");
  TRY(check_pairs(head, hopt, grads, in->pairs, opt));
  TRY(check_pair_tensors(head, index, mask, tr, in, opt, out));
  pair_call c;
  memset(&c, 0, sizeof c);
  c.ctx = ctx, c.head = head, c.index = index, c.mask = mask, c.tr = tr, c.hopt = hopt;
  c.in = in, c.opt = opt, c.grads = has_grads(grads) ? grads : NULL;
  TRY(lmloss_pick_backend(ctx, head->hidden.device, &c.ops));
  TRY(lmloss_check_supports(c.ops, LMLOSS_CAN_FUSED_HEAD, "fused linear head"));
  if (head->hidden.dtype != LMLOSS_F32 && !c.ops->supports(LMLOSS_CAN_16BIT_HEAD))
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED,
                       "this backend's fused head takes F32 hidden/weight only");
  int fits;
  pair_make_plan(head, hopt, c.grads, in->pairs, opt, &c.q, &fits);
  if (!fits)
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED,
                       "the pair head: no group of %s in this budget "
                       "(lmloss_linear_preference_size answers 0)",
                       couples_pairs(opt) ? "all pairs (the type couples them)" : "one pair");
  TRY(lmloss_linear_grads_apart(head, c.grads));
  TRY(outputs_apart(head, index, c.grads, out));
  if (!ws) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "workspace is NULL");
  if (ws_bytes < c.q.lp.total)
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, c.q.lp.total);
  c.w = ws;
  if (c.q.in_dw > 0) { /* the plan assumed dweight's worst alignment; its own may hold a row more */
    const lmloss_tensor *dw = &c.grads->dweight;
    const size_t skip = (size_t)(lmloss_linear_dw_base(dw) - (char *)dw->data);
    const size_t bytes = (size_t)dw->rows * dw->cols * lmloss_dtype_size(dw->dtype) - skip;
    c.q.in_dw = (int64_t)(bytes / ((size_t)head->weight.rows * c.q.lp.dls));
  }
  const lmloss_linear_prims *L = c.ops->linear;
  const lmloss_device dev = head->hidden.device;
  const int64_t N = head->hidden.rows, V = head->weight.rows, P = in->pairs;
  c.logp = wants(&out->logp) ? out->logp : lmloss_ws_view(c.w + c.q.logp, LMLOSS_F32, dev, N, 1);
  TRY(L->fill(ctx, &c.logp, 0.0));
  c.bias = head->bias; /* the logits GEMMs take an F32 bias */
  if (wants(&head->bias) && head->bias.dtype != LMLOSS_F32) {
    c.bias = lmloss_ws_view(c.w + c.q.bias32, LMLOSS_F32, dev, V, 1);
    TRY(L->cast(ctx, &head->bias, &c.bias));
  }
  if (c.grads && wants(&c.grads->dhidden)) TRY(L->fill(ctx, &c.grads->dhidden, 0.0));
  if (c.q.grad) {
    const lmloss_tensor ones = f32_at(&c, c.q.ones, 0, c.q.T);
    TRY(L->fill(ctx, &ones, 1.0));
  }
  int64_t *count = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)P);
  seq_rows *segs = (seq_rows *)malloc(sizeof(seq_rows) * 2 * (size_t)c.q.per_group);
  lmloss_status s = LMLOSS_OK;
  if (!count || !segs)
    s = lmloss_fail(LMLOSS_ERR_OUT_OF_MEMORY, "the pair head: no host memory");
  else
    s = run_groups(&c, count, segs, out);
  free(count), free(segs);
  return s;
}
