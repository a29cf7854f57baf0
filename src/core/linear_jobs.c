/*
 * linear_jobs.c - the fused head's kinds of job (linear_job.h): for
 * cross-entropy and the log-probs, forward and backward, the kept
 * log-probs, and cross-entropy over a sharded vocabulary (a shard's
 * states; its forward and backward from merged states), which rows each
 * selects, its row op on a chunk's logits (the backend's logits op, so
 * the numerics are exactly those of the logits ops), the outputs it
 * scatters, and what it fills or sums outside the chunks.
 */
#include <string.h>

#include "linear_job.h"
#include "math/rowstate.h"

/* The per-row compact buffers of a chunk (n <= p->slot_rows rows), each in a
 * slot of the aux area: labels [rows, K] x 8 bytes, five scalar slots of
 * 8 bytes a row, [rows, K] floats, the statistics, then the states;
 * aux_per_row covers it. */
typedef struct {
  lmloss_tensor labels;  /* target or index, gathered */
  lmloss_tensor row;     /* F32: loss (NONE), dloss, entropy (log-probs), dentropy */
  lmloss_tensor lse;     /* F32 */
  lmloss_tensor weight;  /* F32 token weights, gathered */
  lmloss_tensor entropy; /* F32, cross-entropy's */
  lmloss_tensor argmax;  /* I64 */
  lmloss_tensor per_k;   /* F32 [n, K]: logp, dlogp */
  lmloss_tensor stats;   /* F32 [n, LMLOSS_ROW_STATS], log-probs' */
  lmloss_tensor state;   /* F32 [n, LMLOSS_ROW_STATE_COLS], a shard's */
} chunk_slots;

/* The chunk's slots, its labels gathered into theirs. */
static lmloss_status chunk_slots_of(const linear_job *j, const lmloss_linear_prims *L,
                                    const linear_plan *p, char *ws, const linear_chunk *ch,
                                    chunk_slots *s) {
  const lmloss_device dev = j->head->hidden.device;
  const int64_t K = p->K > 0 ? p->K : 1, n = ch->n;
  const size_t R = (size_t)p->slot_rows, scalars = R * (size_t)K * 8;
  char *aux = ws + p->aux;
  s->labels = lmloss_ws_view(aux, LMLOSS_I64, dev, n, K);
  s->row = lmloss_ws_view(aux + scalars, LMLOSS_F32, dev, n, 1);
  s->lse = lmloss_ws_view(aux + scalars + R * 8, LMLOSS_F32, dev, n, 1);
  s->weight = lmloss_ws_view(aux + scalars + 2 * R * 8, LMLOSS_F32, dev, n, 1);
  s->entropy = lmloss_ws_view(aux + scalars + 3 * R * 8, LMLOSS_F32, dev, n, 1);
  s->argmax = lmloss_ws_view(aux + scalars + 4 * R * 8, LMLOSS_I64, dev, n, 1);
  s->per_k = lmloss_ws_view(aux + scalars + 5 * R * 8, LMLOSS_F32, dev, n, K);
  const size_t stats = scalars + 5 * R * 8 + R * (size_t)K * 4;
  s->stats = lmloss_ws_view(aux + stats, LMLOSS_F32, dev, n, LMLOSS_ROW_STATS);
  s->state = lmloss_ws_view(aux + stats + R * LMLOSS_ROW_STATS * 4, LMLOSS_F32, dev, n,
                            LMLOSS_ROW_STATE_COLS);
  if (!j->labels || p->K == 0) return LMLOSS_OK;
  s->labels.dtype = j->labels->dtype;
  s->labels.row_stride = s->labels.cols;
  return L->gather_rows(j->ctx, j->labels, ch->list, &s->labels);
}

/* ------------------------------------------------------------------ */
/* Cross-entropy                                                        */
/* ------------------------------------------------------------------ */

/* The rows whose target is not ignore_index; the loss's factor of its
 * reduction (mean: over their class weights; 0 with none, and no row). */
static lmloss_status ce_select(const linear_job *j, const lmloss_linear_prims *L, int64_t *list,
                               int64_t *M, double *scale) {
  double wsum = 0.0;
  TRY(L->select_rows(j->ctx, j->labels, j->opt->ignore_index, j->cw, list, M, &wsum));
  *scale = 1.0;
  if (j->opt->reduction == LMLOSS_REDUCE_MEAN) *scale = wsum > 0.0 ? 1.0 / wsum : 0.0;
  if (j->opt->reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) *scale = 1.0 / j->opt->num_items;
  if (*scale == 0.0) *M = 0; /* mean over zero weight: 0 with a zero gradient */
  return LMLOSS_OK;
}

/* The options of a row op on some of the rows: a reduced loss as their
 * share of it (the global divisor, scale the select's factor). */
static lmloss_ce_options ce_part_options(const linear_job *j, double scale) {
  lmloss_ce_options o = *j->opt;
  o.zero_ignored_rows = 1;
  if (o.reduction != LMLOSS_REDUCE_NONE) {
    o.reduction = LMLOSS_REDUCE_SUM_OVER_ITEMS;
    o.num_items = 1.0 / scale;
  }
  return o;
}

/* The chunk's slots, and its cross-entropy inputs and options. */
static lmloss_status ce_chunk(const linear_job *j, const lmloss_linear_prims *L,
                              const linear_plan *p, char *ws, const linear_chunk *ch,
                              chunk_slots *sl, lmloss_ce_inputs *in, lmloss_ce_options *o) {
  TRY(chunk_slots_of(j, L, p, ws, ch, sl));
  *o = ce_part_options(j, ch->scale);
  *in = (lmloss_ce_inputs){*ch->slab, sl->labels, {0}, *j->cw};
  if (!wants(j->tw)) return LMLOSS_OK;
  in->token_weight = sl->weight;
  return L->gather_rows(j->ctx, j->tw, ch->list, &sl->weight);
}

/* A shard's finish of the chunk's rows from their merged states: the
 * forward's outputs co or the backward's upstream d, the gradient into
 * ch->dl. */
static lmloss_status shard_finish(const linear_job *j, const lmloss_backend_ops *ops,
                                  const linear_plan *p, char *ws, const linear_chunk *ch,
                                  chunk_slots *sl, const lmloss_ce_inputs *in,
                                  const lmloss_ce_options *o, const lmloss_ce_outputs *co,
                                  const lmloss_tensor *d) {
  TRY(ops->linear->gather_rows(j->ctx, j->state, ch->list, &sl->state));
  return ops->states->ce_finish(j->ctx, in, o, j->shard, &sl->state, co, d, ch->dl, ws + p->ce_ws,
                                lmloss_cross_entropy_workspace_size(ch->n));
}

static lmloss_status ce_forward_rows(const linear_job *j, const lmloss_backend_ops *ops,
                                     const linear_plan *p, char *ws, const linear_chunk *ch) {
  const lmloss_linear_prims *L = ops->linear;
  const lmloss_ce_outputs *out = j->out;
  chunk_slots sl;
  lmloss_ce_inputs in;
  lmloss_ce_options o;
  TRY(ce_chunk(j, L, p, ws, ch, &sl, &in, &o));
  const int per_row = j->opt->reduction == LMLOSS_REDUCE_NONE;
  lmloss_ce_outputs co;
  memset(&co, 0, sizeof co);
  co.loss = per_row ? sl.row
                    : lmloss_ws_view(ws + p->sums + (size_t)ch->c * 4, LMLOSS_F32,
                                     j->head->hidden.device, 1, 1);
  if (wants(&out->lse)) co.lse = sl.lse;
  if (wants(&out->entropy)) co.entropy = sl.entropy;
  if (wants(&out->argmax)) co.argmax = sl.argmax;
  if (ch->dl) co.dlogits = *ch->dl;
  if (j->shard)
    TRY(shard_finish(j, ops, p, ws, ch, &sl, &in, &o, &co, NULL));
  else
    TRY(ops->cross_entropy(j->ctx, &in, &o, &co, ws + p->ce_ws,
                           lmloss_cross_entropy_workspace_size(ch->n), ch->keep));
  if (per_row) TRY(L->scatter_rows(j->ctx, &sl.row, ch->list, &out->loss));
  if (wants(&out->lse)) TRY(L->scatter_rows(j->ctx, &sl.lse, ch->list, &out->lse));
  if (wants(&out->entropy)) TRY(L->scatter_rows(j->ctx, &sl.entropy, ch->list, &out->entropy));
  if (wants(&out->argmax)) TRY(L->scatter_rows(j->ctx, &sl.argmax, ch->list, &out->argmax));
  return LMLOSS_OK;
}

static lmloss_status ce_backward_rows(const linear_job *j, const lmloss_backend_ops *ops,
                                      const linear_plan *p, char *ws, const linear_chunk *ch) {
  const lmloss_linear_prims *L = ops->linear;
  chunk_slots sl;
  lmloss_ce_inputs in;
  lmloss_ce_options o;
  TRY(ce_chunk(j, L, p, ws, ch, &sl, &in, &o));
  lmloss_tensor d = *j->dloss;
  if (j->opt->reduction == LMLOSS_REDUCE_NONE) {
    d = sl.row;
    TRY(L->gather_rows(j->ctx, j->dloss, ch->list, &d));
  }
  if (j->shard) return shard_finish(j, ops, p, ws, ch, &sl, &in, &o, NULL, &d);
  return ops->cross_entropy_backward(j->ctx, &in, &o, &d, ch->dl, ws + p->ce_ws,
                                     lmloss_cross_entropy_workspace_size(ch->n), ch->keep);
}

/* A shard's states of the chunk's rows, scattered into the call's. */
static lmloss_status ce_state_rows(const linear_job *j, const lmloss_backend_ops *ops,
                                   const linear_plan *p, char *ws, const linear_chunk *ch) {
  const lmloss_linear_prims *L = ops->linear;
  chunk_slots sl;
  lmloss_ce_inputs in;
  lmloss_ce_options o;
  TRY(ce_chunk(j, L, p, ws, ch, &sl, &in, &o));
  TRY(ops->states->ce_state(j->ctx, &in, &o, j->shard, &sl.state));
  return L->scatter_rows(j->ctx, &sl.state, ch->list, j->state);
}

/* The rows no chunk visits (the ignored ones): the empty state, packed
 * as lmloss_cross_entropy_state writes it; one fill of 0, then a fill of
 * each column that differs. */
static lmloss_status ce_state_fill(const linear_job *j, const lmloss_linear_prims *L) {
  const lmloss_rowstate empty = lmloss_rowstate_empty();
  float v[LMLOSS_ROW_STATE_COLS];
  lmloss_rowstate_pack(&empty, v);
  TRY(L->fill(j->ctx, j->state, 0.0));
  for (int c = 0; c < LMLOSS_ROW_STATE_COLS; c++) {
    if (v[c] == 0.0f) continue;
    lmloss_tensor col = *j->state;
    col.data = (float *)col.data + c;
    col.cols = 1;
    TRY(L->fill(j->ctx, &col, v[c]));
  }
  return LMLOSS_OK;
}

static lmloss_status ce_fill(const linear_job *j, const lmloss_linear_prims *L) {
  const lmloss_ce_outputs *out = j->out;
  if (j->opt->reduction == LMLOSS_REDUCE_NONE) TRY(L->fill(j->ctx, &out->loss, 0.0));
  if (wants(&out->lse)) TRY(L->fill(j->ctx, &out->lse, 0.0));
  if (wants(&out->entropy)) TRY(L->fill(j->ctx, &out->entropy, 0.0));
  if (wants(&out->argmax)) TRY(L->fill(j->ctx, &out->argmax, -1.0));
  return LMLOSS_OK;
}

/* A reduced loss: the sum of the chunks' shares. */
static lmloss_status ce_sum_chunks(const linear_job *j, const lmloss_linear_prims *L,
                                   const linear_plan *p, char *ws, int64_t chunks, int64_t M) {
  if (j->opt->reduction == LMLOSS_REDUCE_NONE) return LMLOSS_OK;
  if (M == 0) return L->fill(j->ctx, &j->out->loss, 0.0);
  const lmloss_tensor sums =
      lmloss_ws_view(ws + p->sums, LMLOSS_F32, j->head->hidden.device, chunks, 1);
  return L->sum(j->ctx, &sums, &j->out->loss);
}

/* The vocab tiles' rows: the targets, token weights and upstream of the
 * M rows (the backward's dloss, or the forward's grad_output), and the
 * states the chunks' row op kept. */
static lmloss_status ce_tile_rows(const linear_job *j, const lmloss_linear_prims *L,
                                  const linear_plan *p, char *ws, const int64_t *list, int64_t M,
                                  double scale, int saved, int gather, tile_rows *r) {
  (void)saved; /* a log-probs backward's alone */
  const lmloss_device dev = j->head->hidden.device;
  const int per_row = j->opt->reduction == LMLOSS_REDUCE_NONE;
  size_t off = p->region;
  memset(r, 0, sizeof *r);
  r->scale = scale;
  r->state = lmloss_ws_view(ws + p->state, LMLOSS_F32, dev, M, LMLOSS_ROW_STATE_COLS);
  r->labels = lmloss_ws_view(ws + off, j->labels->dtype, dev, M, 1);
  off += lmloss_ws_up((size_t)M * 8);
  if (wants(j->tw))
    r->weight = lmloss_ws_view(ws + off, LMLOSS_F32, dev, M, 1), off += lmloss_ws_up((size_t)M * 4);
  if (j->dloss && per_row) {
    r->dloss = lmloss_ws_view(ws + off, LMLOSS_F32, dev, M, 1), off += lmloss_ws_up((size_t)M * 4);
  } else { /* one value for every row */
    r->dloss = j->dloss ? *j->dloss : lmloss_ws_view(ws + off, LMLOSS_F32, dev, 1, 1);
    if (!j->dloss) off += LMLOSS_WS_ALIGN;
    r->dloss.rows = M, r->dloss.row_stride = 0;
  }
  r->end = off;
  if (!gather) return LMLOSS_OK;
  TRY(L->gather_rows(j->ctx, j->labels, list, &r->labels));
  if (wants(j->tw)) TRY(L->gather_rows(j->ctx, j->tw, list, &r->weight));
  if (j->dloss && per_row) return L->gather_rows(j->ctx, j->dloss, list, &r->dloss);
  if (j->dloss) return LMLOSS_OK;
  lmloss_tensor g = r->dloss;
  g.rows = 1;
  return L->fill(j->ctx, &g, j->opt->grad_output);
}

/* A tile's gradient: the cross-entropy's finish (keep: none asked). */
static lmloss_status ce_tile(const linear_job *j, const lmloss_backend_ops *ops, const tile_rows *r,
                             const lmloss_shard *sh, const lmloss_tensor *slab,
                             lmloss_row_keep *keep, const lmloss_tensor *dl) {
  (void)keep;
  const lmloss_ce_options o = ce_part_options(j, r->scale);
  const lmloss_ce_inputs in = {*slab, r->labels, r->weight, *j->cw};
  return ops->states->ce_finish(j->ctx, &in, &o, sh, &r->state, NULL, &r->dloss, dl, NULL, 0);
}

const linear_job_table lmloss_ce_forward_job = {.select = ce_select,
                                                .rows = ce_forward_rows,
                                                .fill = ce_fill,
                                                .finish = ce_sum_chunks,
                                                .tile_rows = ce_tile_rows,
                                                .tile = ce_tile};
const linear_job_table lmloss_ce_backward_job = {
    .select = ce_select, .rows = ce_backward_rows, .tile_rows = ce_tile_rows, .tile = ce_tile};
const linear_job_table lmloss_ce_state_job = {
    .select = ce_select, .rows = ce_state_rows, .fill = ce_state_fill};

/* ------------------------------------------------------------------ */
/* Log-probs                                                            */
/* ------------------------------------------------------------------ */

/* The rows the mask keeps, or all. */
static lmloss_status lp_select(const linear_job *j, const lmloss_linear_prims *L, int64_t *list,
                               int64_t *M, double *scale) {
  double wsum;
  *scale = 1.0;
  if (wants(j->mask)) return L->select_rows(j->ctx, j->mask, 0, NULL, list, M, &wsum);
  const lmloss_tensor all =
      lmloss_ws_view(NULL, LMLOSS_BOOL, j->head->hidden.device, j->head->hidden.rows, 1);
  return L->select_rows(j->ctx, &all, 0, NULL, list, M, &wsum);
}

static lmloss_status lp_forward_rows(const linear_job *j, const lmloss_backend_ops *ops,
                                     const linear_plan *p, char *ws, const linear_chunk *ch) {
  const lmloss_linear_prims *L = ops->linear;
  chunk_slots sl;
  TRY(chunk_slots_of(j, L, p, ws, ch, &sl));
  lmloss_tensor lp = sl.per_k, ent_t = sl.row, *ent = wants(j->entropy) ? &ent_t : NULL;
  const lmloss_tensor *st = j->stats ? &sl.stats : NULL;
  if (j->logp) lp.dtype = j->logp->dtype, lp.row_stride = p->K;
  TRY(ops->log_probs(j->ctx, ch->slab, p->K > 0 ? &sl.labels : NULL, NULL, j->tr,
                     j->logp ? &lp : NULL, ent, st));
  if (j->logp) TRY(L->scatter_rows(j->ctx, &lp, ch->list, j->logp));
  if (ent) TRY(L->scatter_rows(j->ctx, ent, ch->list, j->entropy));
  if (st) TRY(L->scatter_rows(j->ctx, st, ch->list, j->stats));
  return LMLOSS_OK;
}

static lmloss_status lp_backward_rows(const linear_job *j, const lmloss_backend_ops *ops,
                                      const linear_plan *p, char *ws, const linear_chunk *ch) {
  const lmloss_linear_prims *L = ops->linear;
  chunk_slots sl;
  TRY(chunk_slots_of(j, L, p, ws, ch, &sl));
  lmloss_tensor dlp = sl.per_k, dent = sl.row;
  if (j->dlogp) TRY(L->gather_rows(j->ctx, j->dlogp, ch->list, &dlp));
  if (j->dentropy) TRY(L->gather_rows(j->ctx, j->dentropy, ch->list, &dent));
  return ops->log_probs_backward(j->ctx, ch->slab, j->dlogp && p->K > 0 ? &sl.labels : NULL, NULL,
                                 j->tr, j->dlogp ? &dlp : NULL, j->dentropy ? &dent : NULL, ch->dl,
                                 NULL, ch->keep);
}

static lmloss_status lp_fill(const linear_job *j, const lmloss_linear_prims *L) {
  if (j->logp) TRY(L->fill(j->ctx, j->logp, 0.0));
  if (wants(j->entropy)) TRY(L->fill(j->ctx, j->entropy, 0.0));
  if (!j->stats) return LMLOSS_OK;
  /* a masked row's statistics, as lmloss_rowstat_save_masked: 0, no argmax */
  lmloss_tensor argmax = *j->stats;
  argmax.data = (float *)argmax.data + LMLOSS_STAT_A;
  argmax.cols = 1;
  TRY(L->fill(j->ctx, j->stats, 0.0));
  return L->fill(j->ctx, &argmax, -1.0);
}

/* The kept forward (K = 1): the cross-entropy against the index at
 * upstream -1, whose loss is -logp and whose gradient is logp's, onehot
 * - p, written to the store with its exact entries. */
static lmloss_status lp_keep_forward_rows(const linear_job *j, const lmloss_backend_ops *ops,
                                          const linear_plan *p, char *ws, const linear_chunk *ch) {
  const lmloss_linear_prims *L = ops->linear;
  chunk_slots sl;
  TRY(chunk_slots_of(j, L, p, ws, ch, &sl));
  lmloss_ce_options o = lmloss_ce_options_default();
  o.ignore_index = -1; /* never an index: they lie in [0, V) */
  o.transform = *j->tr;
  o.reduction = LMLOSS_REDUCE_NONE;
  o.grad_output = -1.0f;
  const lmloss_ce_inputs in = {*ch->slab, sl.labels, {0}, {0}};
  lmloss_ce_outputs co;
  memset(&co, 0, sizeof co);
  co.loss = sl.row;
  if (j->entropy) co.entropy = sl.entropy;
  co.dlogits = *ch->dl;
  TRY(ops->cross_entropy(j->ctx, &in, &o, &co, ws + p->ce_ws,
                         lmloss_cross_entropy_workspace_size(ch->n), ch->keep));
  /* logp = -loss, by a -1 past the sums' N rows (unused by log-probs) */
  const lmloss_tensor minus = lmloss_ws_view(ws + p->sums + (size_t)j->head->hidden.rows * 4,
                                             LMLOSS_F32, j->head->hidden.device, 1, 1);
  TRY(L->fill(j->ctx, &minus, -1.0));
  TRY(L->scale(j->ctx, &sl.row, (const float *)minus.data));
  TRY(L->scatter_rows(j->ctx, &sl.row, ch->list, j->logp));
  return j->entropy ? L->scatter_rows(j->ctx, &sl.entropy, ch->list, j->entropy) : LMLOSS_OK;
}

/* The vocab tiles' rows: the indices and upstream of the M rows, and
 * their states: kept by the chunks' row op, or (saved) the forward's
 * saved statistics, gathered. */
static lmloss_status lp_tile_rows(const linear_job *j, const lmloss_linear_prims *L,
                                  const linear_plan *p, char *ws, const int64_t *list, int64_t M,
                                  double scale, int saved, int gather, tile_rows *r) {
  (void)scale; /* no reduction */
  const lmloss_device dev = j->head->hidden.device;
  const int64_t K = p->K;
  size_t off = p->region;
  memset(r, 0, sizeof *r);
  if (saved) {
    r->state = lmloss_ws_view(ws + off, LMLOSS_F32, dev, M, LMLOSS_ROW_STATS);
    off += lmloss_ws_up((size_t)M * LMLOSS_ROW_STATS * 4);
  } else {
    r->state = lmloss_ws_view(ws + p->state, LMLOSS_F32, dev, M, LMLOSS_ROW_STATE_COLS);
  }
  if (j->dlogp && K > 0) {
    r->labels = lmloss_ws_view(ws + off, j->labels->dtype, dev, M, K);
    off += lmloss_ws_up((size_t)M * K * 8);
    r->dlogp = lmloss_ws_view(ws + off, LMLOSS_F32, dev, M, K);
    off += lmloss_ws_up((size_t)M * K * 4);
  }
  if (j->dentropy)
    r->dentropy = lmloss_ws_view(ws + off, LMLOSS_F32, dev, M, 1),
    off += lmloss_ws_up((size_t)M * 4);
  r->end = off;
  if (!gather) return LMLOSS_OK;
  if (saved) TRY(L->gather_rows(j->ctx, j->stats, list, &r->state));
  if (wants(&r->labels)) TRY(L->gather_rows(j->ctx, j->labels, list, &r->labels));
  if (wants(&r->dlogp)) TRY(L->gather_rows(j->ctx, j->dlogp, list, &r->dlogp));
  if (j->dentropy) TRY(L->gather_rows(j->ctx, j->dentropy, list, &r->dentropy));
  return LMLOSS_OK;
}

/* A tile's gradient: the log-probs' backward finish. */
static lmloss_status lp_tile(const linear_job *j, const lmloss_backend_ops *ops, const tile_rows *r,
                             const lmloss_shard *sh, const lmloss_tensor *slab,
                             lmloss_row_keep *keep, const lmloss_tensor *dl) {
  const int idx = wants(&r->labels);
  return ops->states->lp_finish(j->ctx, slab, idx ? &r->labels : NULL, NULL, j->tr, sh, &r->state,
                                NULL, NULL, idx ? &r->dlogp : NULL,
                                j->dentropy ? &r->dentropy : NULL, dl, keep);
}

const linear_job_table lmloss_lp_forward_job = {
    .select = lp_select, .rows = lp_forward_rows, .fill = lp_fill};
const linear_job_table lmloss_lp_backward_job = {.from_stats = 1,
                                                 .select = lp_select,
                                                 .rows = lp_backward_rows,
                                                 .tile_rows = lp_tile_rows,
                                                 .tile = lp_tile};
const linear_job_table lmloss_lp_keep_forward_job = {
    .kept = 1, .row_grad = 1, .select = lp_select, .rows = lp_keep_forward_rows, .fill = lp_fill};
const linear_job_table lmloss_lp_keep_backward_job = {
    .kept = 1, .from_store = 1, .select = lp_select};
