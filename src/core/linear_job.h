/*
 * linear_job.h - a fused-head call as data. The entry points
 * (fused_linear.c) check a call's arguments and make its job: the
 * arguments and the table of its kind. The tables (linear_jobs.c) hold
 * all that the kinds do differently: which rows they select, the row op
 * of a chunk and the outputs it scatters, the fill of the rows no chunk
 * visits, the reduced loss. The chunk loop (linear_loop.c) holds what
 * they share: the plan, the GEMMs, the store, the vocab tiles. The DPO
 * pair head (linear_pairs.c) runs the kept forward's row op and the
 * store's dhidden below, a sequence at a time, in a loop of its own.
 */
#ifndef LMLOSS_CORE_LINEAR_JOB_H
#define LMLOSS_CORE_LINEAR_JOB_H

#include "linear_plan.h"

typedef struct linear_job_table linear_job_table;

/* A call's arguments (the ones it lacks NULL). */
typedef struct {
  const linear_job_table *table;
  const lmloss_context *ctx;
  const lmloss_head *head;
  const lmloss_tensor *labels; /* target [N, 1] or index [N, K] (absent: K = 0) */
  const lmloss_tensor *mask, *tw;
  const lmloss_tensor *cw; /* cross-entropy's class weights (absent: a tensor of no data) */
  const lmloss_ce_options *opt;
  const lmloss_transform *tr; /* the logits' transform (cross-entropy's: opt's) */
  const lmloss_head_options *hopt;
  const lmloss_ce_outputs *out;
  const lmloss_tensor *dloss, *logp, *entropy, *dlogp, *dentropy;
  const lmloss_tensor *stats; /* log-probs: saved (forward) or given (backward) */
  const lmloss_head_grads *grads;
  /* a sharded head (weight: the shard's rows): the resolved shard, and the
   * row states its state pass writes or its finish reads (merged) */
  const lmloss_shard *shard;
  const lmloss_tensor *state;
  /* the sharded forward's passes plan for the finish's gradients (state
   * pass: plan_grads, grads NULL), so that the logits of a batch that fits
   * one chunk stay in the slab for the finish (logits_ready) */
  const lmloss_head_grads *plan_grads;
  int logits_ready;
} linear_job;

/* The row op of one chunk: its n compact rows (list, from compact row
 * first) whose logits are in slab, chunk number c; dl, where the row op
 * writes their gradient (NULL: none), keep what it keeps of it for a
 * 16-bit head (lmloss_row_keep; NULL otherwise); scale, the loss's
 * factor (the select's). */
typedef struct {
  const int64_t *list;
  int64_t c, n;
  const lmloss_tensor *slab, *dl;
  lmloss_row_keep *keep;
  double scale;
} linear_chunk;

/* The vocab tiles' per-row inputs (linear_loop.c's vocab_tiles) for the
 * M supervised rows in compact order, or a view of n of them: each row's
 * state (the row op's, kept, or the forward's saved statistics), labels
 * and upstream, gathered once from the region on (the chunks are done
 * with it) up to end; dhidden's fp32 sum over the tiles (from saved
 * statistics only: acc, absent otherwise). */
typedef struct {
  lmloss_tensor state;  /* F32 [M, LMLOSS_ROW_STATE_COLS], or saved [M, LMLOSS_ROW_STATS] */
  lmloss_tensor labels; /* target [M, 1] or index [M, K] */
  /* cross-entropy's token weights and upstream (its reduction's: a row of
   * stride 0), the chunks' loss factor */
  lmloss_tensor weight, dloss;
  double scale;
  lmloss_tensor dlogp, dentropy; /* the log-probs' upstream */
  lmloss_tensor acc;
  size_t end;
} tile_rows;

/* What a kind of job does where the kinds differ. */
struct linear_job_table {
  /* the plan of the kept log-probs: a store of all N rows (their forward
   * and backward); else the budget's */
  int kept;
  /* the row op writes a gradient without the head's grads (the kept
   * forward's, into the store) */
  int row_grad;
  /* the gradients come from the kept forward's store, not from chunks */
  int from_store;
  /* the backward may run from the forward's saved statistics */
  int from_stats;
  /* the supervised rows into list, their count *M, the loss's factor *scale */
  lmloss_status (*select)(const linear_job *, const lmloss_linear_prims *, int64_t *list,
                          int64_t *M, double *scale);
  lmloss_status (*rows)(const linear_job *, const lmloss_backend_ops *, const linear_plan *,
                        char *ws, const linear_chunk *);
  /* outputs of the rows that no chunk visits (NULL: none; the loop fills dhidden) */
  lmloss_status (*fill)(const linear_job *, const lmloss_linear_prims *);
  /* after the chunks: the outputs summed over them (NULL: none) */
  lmloss_status (*finish)(const linear_job *, const lmloss_linear_prims *, const linear_plan *,
                          char *ws, int64_t chunks, int64_t M);
  /* The vocab tiles (a job that writes a gradient): the rows' inputs r
   * (saved: with the forward's saved statistics as the states), laid out
   * from the region on, gathered for the M rows of list unless only the
   * layout is asked (gather 0); and the gradient of a tile, the family's
   * finish over the tile's columns (sh) of the rows r views, its logits
   * slab into dl (keep: the exact entries, from saved statistics). */
  lmloss_status (*tile_rows)(const linear_job *, const lmloss_linear_prims *, const linear_plan *,
                             char *ws, const int64_t *list, int64_t M, double scale, int saved,
                             int gather, tile_rows *r);
  lmloss_status (*tile)(const linear_job *, const lmloss_backend_ops *, const tile_rows *r,
                        const lmloss_shard *sh, const lmloss_tensor *slab, lmloss_row_keep *keep,
                        const lmloss_tensor *dl);
};

extern const linear_job_table lmloss_ce_forward_job, lmloss_ce_backward_job;
extern const linear_job_table lmloss_ce_state_job; /* a shard's states (no gradient) */
extern const linear_job_table lmloss_lp_forward_job, lmloss_lp_backward_job;
extern const linear_job_table lmloss_lp_keep_forward_job, lmloss_lp_keep_backward_job;

/* What the row op keeps for compact rows first.. (16-bit heads, NULL
 * otherwise): the rows' states, from which the vocab tiles run the
 * family's finish (a call that takes tiles only: p->tiled), and the exact
 * entries (S a row: the labels' columns and the argmax), what rounding
 * dlogits took from which the dhidden GEMMs add, and which dbias sums in
 * place of their rounded values. */
lmloss_row_keep *lmloss_linear_keep_at(const linear_plan *p, char *ws, int64_t first,
                                       lmloss_row_keep *k);

/* dhidden of a store's n rows, compact rows first.. (their own list: dl,
 * their rounded gradient rows; hg, their hidden rows): through fp32 in
 * blocks of the chunk region, the exact entries put back, each row scaled
 * by its s (optional [n, 1]), rounded into hg once dW has read it, and
 * scattered into j's dhidden. */
lmloss_status lmloss_linear_store_dhidden(const linear_job *j, const lmloss_linear_prims *L,
                                          const linear_plan *p, char *w, const int64_t *list,
                                          int64_t first, const lmloss_tensor *dl,
                                          const lmloss_tensor *hg, const lmloss_tensor *s);

/* A call's dweight and dbias share no byte with what it reads or with
 * each other: dweight may hold the store (dw_store_rows) while the inputs
 * are read. Not asked of a size or plan query, whose tensors point at no
 * data. */
lmloss_status lmloss_linear_grads_apart(const lmloss_head *head, const lmloss_head_grads *g);

/* dweight's first LMLOSS_WS_ALIGN-aligned byte, where a store in its bytes
 * starts (a caller's dweight need not start at an aligned one). */
char *lmloss_linear_dw_base(const lmloss_tensor *dweight);

/* Runs a checked job in the workspace ws (linear_loop.c). */
lmloss_status lmloss_linear_run(const linear_job *j, void *ws, size_t ws_bytes);

#endif
