/*
 * linear_plan.h - where a fused-head call's buffers live in its workspace
 * (and, for a store in dweight, in dweight's bytes): the plan that
 * linear_plan.c makes from the shapes, the options and the gradients
 * asked for, and that linear_loop.c's chunk loop follows.
 */
#ifndef LMLOSS_CORE_LINEAR_PLAN_H
#define LMLOSS_CORE_LINEAR_PLAN_H

#include "validate.h"
#include "workspace.h"

/* Where everything lives in the workspace. The whole-call buffers come
 * first; from `region` on, the chunk buffers (rows per chunk) and, after
 * the chunks, the vocab tiles' buffers (tile_plan) share the same bytes. */
typedef struct {
  int64_t rows, K, S; /* S: exact entries kept per row (keep_entries) */
  int64_t slot_rows;  /* rows the per-row buffers hold: rows, or a store's widest chunk */
  size_t hs, dls;     /* bytes of a hidden element; of a dlogits one (0: in place, F32) */
  size_t list, state, cols, vals, sums, acc_b, bias32, region;
  size_t slab, dl, hid, dh, dh_acc, aux, ce_ws, total;
  int dl_separate; /* dlogits in the weight's 16-bit dtype, beside the fp32 slab */
  int round_dl;    /* dhidden from them, summed in fp32 at dh_acc with the exact entries */
  int acc_b_f32;
  int tiles;     /* dW may come from vocab tiles: wanted, of a 16-bit head */
  int acc_w_f32; /* a 16-bit dW tile sums over row blocks in fp32 */
  int tiled;     /* set per call: it does (more than one row chunk) */
  /* The store (plan_store): the 16-bit dlogits and gathered hidden rows of
   * `group` rows (all N, or whole chunks) are kept, for one dhidden and one
   * dW GEMM a group; dW sums over groups in fp32 (acc_w, or an F32
   * dweight). 0: no store. store_in_dw: the store lies in dweight's own
   * bytes (dw_store_rows), not in the workspace. */
  int64_t group;
  size_t store, ghid, acc_w, store_size;
  size_t acc_w_size; /* bytes of the fp32 accumulator at acc_w (0: none) */
  int store_in_dw;
} linear_plan;

static inline int wants(const lmloss_tensor *t) { return lmloss_present(t); }

static inline int has_grads(const lmloss_head_grads *g) {
  return g && (wants(&g->dhidden) || wants(&g->dweight) || wants(&g->dbias));
}

/* Rows of a store's wide chunk with `left` rows of its group to go: as
 * many as the store's free rows past it hold twice over (fp32 logits in
 * 16-bit rows), in whole tiles of 128 (the slab stays 16-byte aligned).
 * The plan sizes the per-row buffers by it and the chunk loop cuts by it:
 * one formula, or the buffers overrun. */
static inline int64_t wide_chunk_rows(int64_t left) { return left / 3 - left / 3 % 128; }

/* Bytes of small per-row buffers (chunk_slots): K * 8 + 5 * 8 + K * 4 +
 * LMLOSS_ROW_STATS * 4 + LMLOSS_ROW_STATE_COLS * 4. */
static inline size_t aux_per_row(int64_t K) { return 96 + (size_t)K * 16; }

/* Bytes of the vocab tiles' buffers: a block of `rows` hidden rows
 * (when gathered), their logits slab for `cols` columns, its 16-bit
 * gradient (unless written over the slab: inplace), and (acc) the fp32
 * sum of the dW tile over the row blocks. */
static inline size_t tile_bytes(const linear_plan *p, int64_t rows, int64_t cols, int64_t H,
                                int acc, int gathered, int inplace) {
  return (gathered ? lmloss_ws_up((size_t)rows * H * p->hs) : 0) +
         lmloss_ws_up((size_t)rows * cols * 4) +
         (inplace ? 0 : lmloss_ws_up((size_t)rows * cols * p->dls)) +
         (acc ? lmloss_ws_up((size_t)cols * H * 4) : 0);
}

/* Bytes of the vocab tiles' per-row inputs (linear_job.h's tile_rows)
 * for N rows of K labels, at most: the labels, their upstream, and a
 * token weight and an upstream (or one value of it) a row. */
static inline size_t tile_rows_bytes(int64_t N, int64_t K) {
  const size_t k = K > 1 ? (size_t)K : 1;
  return lmloss_ws_up((size_t)N * k * 8) + lmloss_ws_up((size_t)N * k * 4) +
         2 * lmloss_ws_up((size_t)N * 4);
}

/* The vocab tiles' shape in the workspace from `base` on: blocks of
 * `rows` supervised rows (all M when their hidden rows take at most half
 * of it, or from saved statistics), tiles of `cols` columns filling the
 * rest. Hidden rows are gathered, or (only when every row is supervised:
 * the list is then 0..N-1) read in place. From saved statistics the
 * gradient may be written over the slab (the log-probs' finish, at most
 * LMLOSS_TILE_INPLACE_COLS columns): 4 bytes a logit rather than 6, where
 * that makes the tiles wider. */
typedef struct {
  int64_t rows, cols;
  size_t hid, slab, dl, acc;
  int acc_f32, gathered, inplace;
} tile_plan;

/* The plan of a call: BAD_SHAPE / WORKSPACE_TOO_SMALL when none fits
 * the budget (the arguments already checked). */
lmloss_status lmloss_linear_make_plan(const lmloss_head *head, const lmloss_head_options *hopt,
                                      const lmloss_head_grads *grads, int64_t K, linear_plan *p);

/* The plan of the kept log-probs (lmloss_linear_log_probs_keep) and of
 * their backward: the three-GEMM plan of a call that wants dhidden and a
 * dweight in the head's 16-bit dtype, whose store must hold all N rows in
 * the workspace (*fits 0 where it does not, or for an F32 head). */
lmloss_status lmloss_linear_keep_plan(const lmloss_head *head, const lmloss_head_options *hopt,
                                      linear_plan *p, int *fits);

/* The vocab tiles' shape in the workspace from `base` on (tile_plan). */
tile_plan lmloss_linear_plan_tiles(const linear_plan *p, size_t base, int gathered, int saved,
                                   int64_t M, int64_t H, int64_t V);

#endif
