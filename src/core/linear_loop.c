/*
 * linear_loop.c - the fused head's chunk loop (linear_job.h: what every
 * kind of job shares). The supervised rows are selected first (ignored /
 * masked rows never reach a GEMM). Then, per chunk of at most `rows` of
 * them:
 *   gather hidden rows -> slab = hidden_c W^T (+ bias)           (GEMM 1)
 *   the job's row op on the slab (forward and/or gradient, in place or
 *   into 16-bit dlogits: below)
 *   dhidden_c = dlogits W -> scattered back                      (GEMM 2)
 *   dW += dlogits^T hidden_c, dbias += column sums               (GEMM 3)
 * A 16-bit head keeps its chunks' rounded dlogits and hidden rows in a
 * store, and takes GEMMs 2 and 3 once a group of rows (plan_store); where
 * no store fits the budget, it takes dW after the chunks in vocab tiles
 * (vocab_tiles: each tile's gradient the job's finish over its columns,
 * from the row states the chunks' row op kept): no V x H fp32
 * accumulator, no V x H read-modify-write per chunk, the logits computed
 * twice. Memory beyond inputs and outputs
 * is the workspace, and the workspace is at most the budget. This file
 * holds no math: it sequences the backend's primitives.
 *
 * A 16-bit weight gets dlogits in its dtype, so that GEMMs 2 and 3 run on
 * tensor cores: the row op reads the fp32 slab and writes them. Rounded to
 * bf16, dlogits would cost dhidden more than twice the error of rounding
 * dhidden itself, almost all of it at the row's few large entries (the
 * labels' columns and the argmax), which the row op forms apart; so it
 * also keeps their fp32 values (lmloss_row_keep), and dhidden = dlogits W
 * + what the rounding took from them times their rows of W, summed in
 * fp32; dbias sums the rows with those values in place. dW comes from the
 * rounded dlogits alone (within its bound).
 *
 * The log-probs backward given the forward's saved row statistics (a
 * 16-bit head whose dW takes vocab tiles) skips the chunks: the tiles form
 * the gradient from the statistics and sum dhidden over the tiles in fp32
 * as well as dW, so the logits are computed once in the backward instead
 * of twice (saved_start).
 */
#include <string.h>

#include "linear_job.h"

lmloss_status lmloss_linear_grads_apart(const lmloss_head *head, const lmloss_head_grads *g) {
  if (!g) return LMLOSS_OK;
  const lmloss_tensor *read[] = {&head->hidden, &head->weight, &head->bias, &g->dhidden};
  const char *read_name[] = {"hidden", "weight", "bias", "dhidden"};
  for (int r = 0; r < 4; r++) {
    TRY(lmloss_check_disjoint(&g->dweight, "dweight", read[r], read_name[r]));
    TRY(lmloss_check_disjoint(&g->dbias, "dbias", read[r], read_name[r]));
  }
  return lmloss_check_disjoint(&g->dweight, "dweight", &g->dbias, "dbias");
}

lmloss_row_keep *lmloss_linear_keep_at(const linear_plan *p, char *ws, int64_t first,
                                       lmloss_row_keep *k) {
  if (!p->dl_separate) return NULL;
  k->state = p->tiled ? (float *)(ws + p->state) + first * LMLOSS_ROW_STATE_COLS : NULL;
  k->cols = (int64_t *)(ws + p->cols) + first * p->S;
  k->vals = (float *)(ws + p->vals) + first * p->S;
  k->count = p->S;
  k->stride = p->S;
  return k;
}

/* dhidden of a chunk (compact rows first..) = dl W, scattered back.
 * round_dl: + the rounding error of the exact entries times their rows of
 * W, summed in fp32. */
static lmloss_status chunk_dhidden(const linear_job *j, const lmloss_linear_prims *L,
                                   const linear_plan *p, char *w, const int64_t *list,
                                   const lmloss_row_keep *keep, const lmloss_tensor *dl) {
  const lmloss_head *h = j->head;
  const lmloss_device dev = h->hidden.device;
  const int64_t n = dl->rows, H = h->hidden.cols;
  lmloss_tensor dh = lmloss_ws_view(w + p->dh, h->hidden.dtype, dev, n, H);
  if (p->round_dl) {
    lmloss_tensor acc = lmloss_ws_view(w + p->dh_acc, LMLOSS_F32, dev, n, H);
    TRY(L->gemm(j->ctx, 0, 0, 1.0f, dl, &h->weight, 0.0f, &acc));
    TRY(L->restore_entries(j->ctx, keep, &h->weight, &acc));
    TRY(L->cast(j->ctx, &acc, &dh));
  } else {
    TRY(L->gemm(j->ctx, 0, 0, 1.0f, dl, &h->weight, 0.0f, &dh));
  }
  return L->scatter_rows(j->ctx, &dh, list, &j->grads->dhidden);
}

/* The chunk from compact row `first` of M: its rows, and where its fp32
 * logits go (*slab_at). A store's chunk is wide (wide_chunk_rows), its
 * logits in the store's rows not yet written, so a group's first chunks
 * run wide GEMMs and row passes; then the rest takes the chunk region
 * (wide chunks only shrink); no chunk crosses a group's end. */
static int64_t chunk_at(const linear_plan *p, int64_t V, int64_t M, int64_t first, int store,
                        char *w, char *sb, char **slab_at) {
  int64_t n = M - first < p->rows ? M - first : p->rows;
  *slab_at = w + p->slab;
  if (!store) return n;
  const int64_t in_group = first % p->group;
  const int64_t left =
      (p->group < M - first + in_group ? p->group : M - first + in_group) - in_group;
  const int64_t wide = wide_chunk_rows(left);
  if (wide < 128 || wide <= n) return n < left ? n : left;
  *slab_at = sb + p->store + (size_t)((in_group + wide) * V) * p->dls;
  return wide;
}

char *lmloss_linear_dw_base(const lmloss_tensor *dweight) {
  return lmloss_ws_ptr_up((char *)dweight->data);
}

/* Where the store's offsets count from: the workspace, or dweight's. */
static char *store_base(const linear_job *j, const linear_plan *p, char *w) {
  return p->store_in_dw ? lmloss_linear_dw_base(&j->grads->dweight) : w;
}

lmloss_status lmloss_linear_store_dhidden(const linear_job *j, const lmloss_linear_prims *L,
                                          const linear_plan *p, char *w, const int64_t *list,
                                          int64_t first, const lmloss_tensor *dl,
                                          const lmloss_tensor *hg, const lmloss_tensor *s) {
  const lmloss_head *h = j->head;
  const int64_t n = dl->rows, H = h->hidden.cols;
  const int64_t B = (int64_t)((p->total - p->region) / ((size_t)H * 4));
  for (int64_t b0 = 0; b0 < n; b0 += B) {
    const int64_t bn = n - b0 < B ? n - b0 : B;
    const lmloss_tensor acc = lmloss_ws_view(w + p->region, LMLOSS_F32, h->hidden.device, bn, H);
    const lmloss_tensor dlb = lmloss_rows_of(dl, b0, bn), hb = lmloss_rows_of(hg, b0, bn);
    lmloss_row_keep kept;
    TRY(L->gemm(j->ctx, 0, 0, 1.0f, &dlb, &h->weight, 0.0f, &acc));
    const lmloss_row_keep *keep = lmloss_linear_keep_at(p, w, first + b0, &kept);
    if (keep) TRY(L->restore_entries(j->ctx, keep, &h->weight, &acc));
    if (s) {
      const lmloss_tensor sb = lmloss_rows_of(s, b0, bn);
      TRY(L->scale_rows(j->ctx, &acc, &sb));
    }
    TRY(L->cast(j->ctx, &acc, &hb));
  }
  return L->scatter_rows(j->ctx, hg, list, &j->grads->dhidden);
}

/* dhidden and dW of a store's group: its n compact rows from first on,
 * whose dlogits and hidden rows the store holds (dhidden: lmloss_linear_store_dhidden).
 * beta: 0 for the first group, unless dW is added to the caller's. */
static lmloss_status group_grads(const linear_job *j, const lmloss_linear_prims *L,
                                 const linear_plan *p, char *w, const int64_t *list, int64_t first,
                                 int64_t n, float beta) {
  const lmloss_head *h = j->head;
  const lmloss_head_grads *g = j->grads;
  const lmloss_device dev = h->hidden.device;
  const int64_t H = h->hidden.cols, V = h->weight.rows;
  char *sb = store_base(j, p, w);
  const lmloss_tensor dl = lmloss_ws_view(sb + p->store, h->weight.dtype, dev, n, V);
  const lmloss_tensor hg = lmloss_ws_view(sb + p->ghid, h->hidden.dtype, dev, n, H);
  if (wants(&g->dweight)) {
    const lmloss_tensor dw =
        p->acc_w_size ? lmloss_ws_view(w + p->acc_w, LMLOSS_F32, dev, V, H) : g->dweight;
    TRY(L->gemm(j->ctx, 1, 0, 1.0f, &dl, &hg, beta, &dw));
  }
  if (!wants(&g->dhidden)) return LMLOSS_OK;
  return lmloss_linear_store_dhidden(j, L, p, w, list + first, first, &dl, &hg, NULL);
}

/* The kept log-probs backward (lmloss_linear_log_probs_keep): the store
 * holds every supervised row's gradient of its log-prob u_i and its
 * hidden row h_i, so dW = U^T (dlogp_i h_i) and dhidden_i = dlogp_i (U W)_i:
 * two GEMMs. */
static lmloss_status kept_grads(const linear_job *j, const lmloss_linear_prims *L,
                                const linear_plan *p, char *w, const int64_t *list, int64_t M) {
  const lmloss_head *h = j->head;
  const lmloss_head_grads *g = j->grads;
  const lmloss_device dev = h->hidden.device;
  const int64_t H = h->hidden.cols, V = h->weight.rows;
  const lmloss_tensor s = lmloss_ws_view(w + p->sums, LMLOSS_F32, dev, M, 1);
  const lmloss_tensor dl = lmloss_ws_view(w + p->store, h->weight.dtype, dev, M, V);
  const lmloss_tensor hg = lmloss_ws_view(w + p->ghid, h->hidden.dtype, dev, M, H);
  TRY(L->gather_rows(j->ctx, j->dlogp, list, &s));
  if (wants(&g->dweight)) {
    TRY(L->scale_rows(j->ctx, &hg, &s));
    TRY(L->gemm(j->ctx, 1, 0, 1.0f, &dl, &hg, g->accumulate ? 1.0f : 0.0f, &g->dweight));
  }
  if (!wants(&g->dhidden)) return LMLOSS_OK;
  return lmloss_linear_store_dhidden(j, L, p, w, list, 0, &dl, &hg, &s);
}

/* Whether the log-probs backward runs from the forward's saved
 * statistics (see the file comment; *on), and then the tiles' rows r,
 * gathered before any chunk: the head takes vocab tiles, the call allows
 * it (lmloss.h) and the rows' inputs and dhidden's fp32 sum leave the
 * tiles room for all M rows (one block: dhidden's sum is the fp32 state
 * between tiles) by min(V, 128) columns; narrower tiles would cost more
 * than the logits GEMM they save. */
static lmloss_status saved_start(const linear_job *j, const lmloss_linear_prims *L,
                                 const linear_plan *p, char *w, const int64_t *list, int64_t M,
                                 tile_rows *r, int *on) {
  const lmloss_head *h = j->head;
  const int64_t N = h->hidden.rows, H = h->hidden.cols, V = h->weight.rows;
  if (!j->table->from_stats || !j->stats || !p->tiled || wants(&j->grads->dbias) ||
      p->K > LMLOSS_SAVED_MAX_K)
    return LMLOSS_OK;
  TRY(j->table->tile_rows(j, L, p, w, list, M, 1.0, 1, 0, r));
  const size_t acc = wants(&j->grads->dhidden) ? lmloss_ws_up((size_t)M * H * 4) : 0,
               end = r->end + acc;
  const int64_t c = V < 128 ? V : 128;
  if (end > p->total || p->total - end < tile_bytes(p, M, c, H, 0, M < N, 1) + 3 * LMLOSS_WS_ALIGN)
    return LMLOSS_OK;
  *on = 1;
  TRY(j->table->tile_rows(j, L, p, w, list, M, 1.0, 1, 1, r));
  if (acc) r->acc = lmloss_ws_view(w + r->end, LMLOSS_F32, h->hidden.device, M, H);
  r->end = end;
  return LMLOSS_OK;
}

/* The views of n of the tiles' rows from compact row first on (a
 * stride-0 upstream stays whole). */
static tile_rows tile_rows_of(const tile_rows *r, int64_t first, int64_t n) {
  tile_rows v = *r;
  lmloss_tensor *t[] = {&v.state, &v.labels, &v.weight, &v.dloss, &v.dlogp, &v.dentropy, &v.acc};
  for (size_t k = 0; k < sizeof t / sizeof t[0]; k++)
    if (wants(t[k])) *t[k] = lmloss_rows_of(t[k], first, n);
  return v;
}

/* dW of a 16-bit head whose supervised rows took more than one chunk:
 * rather than sum dW over the chunks (V x H read and written per chunk, in
 * an fp32 copy for a 16-bit dW), each vocab tile of dW is one GEMM over
 * all M rows (or a few blocks of them), written once. The tile's gradient
 * is the job's finish over its columns (one more logits GEMM, in tiles),
 * from the states the chunks' row op kept or (saved) the saved
 * statistics, the tile then adding its part of dhidden too. Worth it
 * where the GEMMs run on tensor cores; an F32 head's GEMMs (the CPU's, or
 * fp32 ones on a GPU) cost more than the read-modify-write they would
 * save. */
static lmloss_status vocab_tiles(const linear_job *j, const lmloss_backend_ops *ops,
                                 const linear_plan *p, char *w, const int64_t *list, int64_t M,
                                 const lmloss_tensor *bias, const tile_rows *r, int saved) {
  const lmloss_linear_prims *L = ops->linear;
  const lmloss_head *h = j->head;
  const lmloss_device dev = h->hidden.device;
  const int64_t H = h->hidden.cols, V = h->weight.rows;
  /* Hidden rows read in place when all are supervised, from saved
   * statistics only: there the bytes go to wider tiles, which dhidden's
   * sum narrows; the CE tiles so widened ran slower (BENCHMARKS.md's
   * history). */
  const int gathered = M < h->hidden.rows || !saved;
  const tile_plan t = lmloss_linear_plan_tiles(p, r->end, gathered, saved, M, H, V);
  const int64_t nb = (M + t.rows - 1) / t.rows;
  for (int64_t j0 = 0; j0 < V; j0 += t.cols) {
    const int64_t tc = V - j0 < t.cols ? V - j0 : t.cols;
    const lmloss_tensor wt = lmloss_rows_of(&h->weight, j0, tc),
                        dwt = lmloss_rows_of(&j->grads->dweight, j0, tc);
    const lmloss_tensor acc = t.acc_f32 ? lmloss_ws_view(w + t.acc, LMLOSS_F32, dev, tc, H) : dwt;
    const lmloss_shard sh = {j0, V, j->dentropy != NULL};
    for (int64_t b = 0; b < nb; b++) {
      const int64_t first = b * t.rows, n = M - first < t.rows ? M - first : t.rows;
      lmloss_tensor hb = t.gathered ? lmloss_ws_view(w + t.hid, h->hidden.dtype, dev, n, H)
                                    : lmloss_rows_of(&h->hidden, first, n);
      lmloss_tensor slab = lmloss_ws_view(w + t.slab, LMLOSS_F32, dev, n, tc);
      slab.row_stride = t.cols; /* the last, narrower tile keeps the rows' alignment */
      if (t.gathered && (nb > 1 || j0 == 0))
        TRY(L->gather_rows(j->ctx, &h->hidden, list + first, &hb));
      const lmloss_tensor bt = wants(bias) ? lmloss_rows_of(bias, j0, tc) : (lmloss_tensor){0};
      TRY(L->logits(j->ctx, &hb, &wt, &bt, &slab));
      lmloss_tensor dl =
          lmloss_ws_view(w + t.dl, h->weight.dtype, dev, n, tc);         /* a 16-bit head's */
      dl.row_stride = t.inplace ? t.cols * 4 / (int64_t)p->dls : t.cols; /* the slab's rows */
      const tile_rows rb = tile_rows_of(r, first, n);
      lmloss_row_keep kept, *keep = saved ? lmloss_linear_keep_at(p, w, first, &kept) : NULL;
      TRY(j->table->tile(j, ops, &rb, &sh, &slab, keep, &dl));
      if (wants(&rb.acc))
        TRY(L->gemm(j->ctx, 0, 0, 1.0f, &dl, &wt, j0 == 0 ? 0.0f : 1.0f, &rb.acc));
      TRY(L->gemm(j->ctx, 1, 0, 1.0f, &dl, &hb, b == 0 && !j->grads->accumulate ? 0.0f : 1.0f,
                  &acc));
    }
    if (t.acc_f32) TRY(L->cast(j->ctx, &acc, &dwt));
  }
  if (!wants(&r->acc)) return LMLOSS_OK;
  /* dhidden: the sum, with what rounding dlogits took from the exact
   * entries, rounded to hidden's dtype; scattered through the gathered
   * hidden rows' buffer (the tiles took all M rows in one block) */
  lmloss_row_keep kept;
  TRY(L->restore_entries(j->ctx, lmloss_linear_keep_at(p, w, 0, &kept), &h->weight, &r->acc));
  if (!t.gathered) return L->cast(j->ctx, &r->acc, &j->grads->dhidden);
  lmloss_tensor dh = lmloss_ws_view(w + t.hid, h->hidden.dtype, dev, M, H);
  TRY(L->cast(j->ctx, &r->acc, &dh));
  return L->scatter_rows(j->ctx, &dh, list, &j->grads->dhidden);
}

lmloss_status lmloss_linear_run(const linear_job *j, void *ws, size_t ws_bytes) {
  const linear_job_table *jt = j->table;
  const lmloss_head *h = j->head;
  const lmloss_device dev = h->hidden.device;
  const lmloss_backend_ops *ops;
  TRY(lmloss_pick_backend(j->ctx, dev, &ops));
  TRY(lmloss_check_supports(ops, LMLOSS_CAN_FUSED_HEAD, "fused linear head"));
  /* Before anything is written. */
  if (h->hidden.dtype != LMLOSS_F32 && !ops->supports(LMLOSS_CAN_16BIT_HEAD))
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED,
                       "this backend's fused head takes F32 hidden/weight only");
  const lmloss_linear_prims *L = ops->linear;
  linear_plan p;
  if (jt->kept) {
    int fits;
    TRY(lmloss_linear_keep_plan(h, j->hopt, &p, &fits));
    if (!fits)
      return lmloss_fail(LMLOSS_ERR_UNSUPPORTED,
                         "kept log-probs: no store of all %lld rows in this budget and dtype "
                         "(lmloss_linear_log_probs_keep_size answers 0)",
                         (long long)h->hidden.rows);
  } else {
    TRY(lmloss_linear_make_plan(h, j->hopt, j->plan_grads ? j->plan_grads : j->grads,
                                j->labels ? j->labels->cols : 0, &p));
  }
  TRY(lmloss_linear_grads_apart(h, j->grads));
  if (!ws) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "workspace is NULL");
  if (ws_bytes < p.total)
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL, "workspace has %zu bytes, needs %zu",
                       ws_bytes, p.total);
  char *w = ws;
  const int64_t H = h->hidden.cols, V = h->weight.rows;
  const lmloss_head_grads *g = j->grads;
  int64_t *list = (int64_t *)(w + p.list), M = 0;
  double scale;
  TRY(jt->select(j, L, list, &M, &scale));
  if (jt->fill) TRY(jt->fill(j, L));
  if (g && wants(&g->dhidden)) TRY(L->fill(j->ctx, &g->dhidden, 0.0));
  /* the logits GEMMs take an F32 bias (a cuBLASLt epilogue's) */
  lmloss_tensor bias = h->bias;
  if (wants(&h->bias) && h->bias.dtype != LMLOSS_F32 && M > 0) {
    bias = lmloss_ws_view(w + p.bias32, LMLOSS_F32, dev, V, 1);
    TRY(L->cast(j->ctx, &h->bias, &bias));
  }

  const int want_grad = has_grads(g);
  lmloss_tensor accb = {0};
  if (g && wants(&g->dbias))
    accb = p.acc_b_f32 ? lmloss_ws_view(w + p.acc_b, LMLOSS_F32, dev, V, 1) : g->dbias;
  const int64_t nchunks = (M + p.rows - 1) / p.rows;
  const int want_dw = want_grad && wants(&g->dweight);
  p.tiled = want_dw && p.tiles && nchunks > 1;
  if (p.tiled && !jt->tile) /* a kind without a finish over columns */
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "fused head: this call takes no vocab tiles");
  tile_rows tr;
  int saved = 0;
  TRY(saved_start(j, L, &p, w, list, M, &tr, &saved));
  /* the row op writes a gradient: a training call's, or the kept log-probs' */
  const int row_grad = want_grad || jt->row_grad;
  const int store = row_grad && p.group > 0; /* dhidden and dW by groups (plan_store) */
  const float beta0 = g && g->accumulate ? 1.0f : 0.0f;
  char *sb = store ? store_base(j, &p, w) : NULL;
  if (jt->from_store && M > 0) TRY(kept_grads(j, L, &p, w, list, M));
  int64_t c = 0, n;
  for (int64_t first = 0; !saved && !jt->from_store && first < M; first += n, c++) {
    char *slab_at;
    n = chunk_at(&p, V, M, first, store, w, sb, &slab_at);
    const int64_t *lc = list + first, in_group = store ? first % p.group : 0;
    char *hid = store ? sb + p.ghid + (size_t)(in_group * H) * p.hs : w + p.hid;
    lmloss_tensor hc = lmloss_ws_view(hid, h->hidden.dtype, dev, n, H);
    lmloss_tensor slab = lmloss_ws_view(slab_at, LMLOSS_F32, dev, n, V);
    TRY(L->gather_rows(j->ctx, &h->hidden, lc, &hc));
    if (!(j->logits_ready && nchunks == 1)) TRY(L->logits(j->ctx, &hc, &h->weight, &bias, &slab));
    char *dlo = store ? sb + p.store + (size_t)(in_group * V) * p.dls : w + p.dl;
    lmloss_tensor dl = p.dl_separate ? lmloss_ws_view(dlo, h->weight.dtype, dev, n, V) : slab;
    lmloss_row_keep kept_at,
        *keep = row_grad ? lmloss_linear_keep_at(&p, w, first, &kept_at) : NULL;
    const linear_chunk ch = {lc, c, n, &slab, row_grad ? &dl : NULL, keep, scale};
    TRY(jt->rows(j, ops, &p, w, &ch));
    if (!want_grad) continue;
    const float beta = c == 0 ? beta0 : 1.0f;
    if (wants(&g->dbias)) TRY(L->colsum(j->ctx, &dl, keep, beta, &accb));
    if (store) {
      const int64_t g0 = first - in_group, gn = first + n - g0;
      if (gn == p.group || first + n == M)
        TRY(group_grads(j, L, &p, w, list, g0, gn, g0 == 0 ? beta0 : 1.0f));
      continue;
    }
    if (wants(&g->dhidden)) TRY(chunk_dhidden(j, L, &p, w, lc, keep, &dl));
    if (want_dw && !p.tiled) TRY(L->gemm(j->ctx, 1, 0, 1.0f, &dl, &hc, beta, &g->dweight));
  }
  if (p.tiled && !saved) TRY(jt->tile_rows(j, L, &p, w, list, M, scale, 0, 1, &tr));
  if (p.tiled) TRY(vocab_tiles(j, ops, &p, w, list, M, &bias, &tr, saved));
  if (want_grad) {
    const lmloss_tensor accw = lmloss_ws_view(w + p.acc_w, LMLOSS_F32, dev, V, H);
    if (want_dw && M == 0 && !beta0) TRY(L->fill(j->ctx, &g->dweight, 0.0));
    if (want_dw && M > 0 && store && p.acc_w_size) TRY(L->cast(j->ctx, &accw, &g->dweight));
    if (wants(&g->dbias)) {
      if (M == 0 && !beta0) TRY(L->fill(j->ctx, &accb, 0.0));
      if (p.acc_b_f32) TRY(L->cast(j->ctx, &accb, &g->dbias));
    }
  }
  return jt->finish ? jt->finish(j, L, &p, w, c, M) : LMLOSS_OK;
}
