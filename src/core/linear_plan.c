/*
 * linear_plan.c - the fused head's plans: which schedule a call takes
 * (a store and its groups, chunks, vocab tiles) and where its buffers
 * live, from shapes alone (linear_loop.c says what each schedule does);
 * the argument checks and the size and plan queries.
 */
#include <string.h>

#include "linear_plan.h"

/* What rounding the chunk buffers up to LMLOSS_WS_ALIGN can add. */
static const size_t chunk_slack = 8 * LMLOSS_WS_ALIGN + LMLOSS_CE_WS_HEADER;

/* The chunk buffers of a store plan from p->region on. */
static void layout_store_chunks(linear_plan *p, int64_t V, int64_t H) {
  size_t off = p->region;
  p->slab = off, off += lmloss_ws_up((size_t)p->rows * V * 4);
  p->aux = off, off += lmloss_ws_up((size_t)p->slot_rows * aux_per_row(p->K));
  p->ce_ws = off, off += lmloss_ws_up(lmloss_cross_entropy_workspace_size(p->slot_rows));
  const size_t dh_row = p->region + lmloss_ws_up((size_t)H * 4); /* group_grads' fp32 block */
  p->total = off > dh_row ? off : dh_row;
}

/* Rows of a store that dweight's own bytes hold: a 16-bit dW is written
 * only by the cast of its fp32 accumulator after the last group, so until
 * then its V x H elements can hold a store of groups (an output, outside
 * the budget), from its first LMLOSS_WS_ALIGN-aligned byte (store_base).
 * 0 where dweight cannot: absent, F32 (it is the sum itself), added to, or
 * with rows apart. */
static int64_t dw_store_rows(const lmloss_head_grads *g, const linear_plan *p, int64_t V,
                             int64_t H) {
  const lmloss_tensor *dw = &g->dweight;
  if (!wants(dw) || dw->dtype == LMLOSS_F32 || g->accumulate || dw->row_stride != H) return 0;
  const size_t bytes = (size_t)V * H * lmloss_dtype_size(dw->dtype);
  const size_t per_row = (size_t)V * p->dls + (size_t)H * p->hs;
  const size_t slack = 3 * LMLOSS_WS_ALIGN; /* the base's alignment, two parts rounded up */
  return bytes > slack ? (int64_t)((bytes - slack) / per_row) : 0;
}

/* Three GEMMs for a 16-bit head's dW (p->tiles), when they fit: the chunks'
 * rounded dlogits go to a store of `group` rows beside their hidden rows,
 * and each group takes one dhidden GEMM (through fp32, exact entries put
 * back) and one dW GEMM. A store of all rows needs no fp32 sum of dW, and
 * takes as many bytes as the V x H fp32 accumulator it stands for when
 * N = 2H. Groups sum dW in fp32 (an accumulator, or an F32 dweight), a
 * V x H read-modify-write a group, which costs less than the fourth GEMM
 * only when a group has more than about 4 x (tensor FLOP/s) / (bytes/s)
 * rows (800 on an H200), hence LMLOSS_HEAD_MIN_GROUP. The default budget
 * is the fastest schedule: 256 MiB of chunk buffers beside the bytes of
 * that accumulator, whoever holds dW's sum. Groups take the larger of the
 * store the budget leaves room for and the one dW's own bytes hold. 1 when
 * planned (p filled from `base`, the per-call buffers' end). */
static int plan_store(const lmloss_head *head, const lmloss_head_options *hopt,
                      const lmloss_head_grads *g, linear_plan *p, size_t base) {
  const int64_t N = head->hidden.rows, H = head->hidden.cols, V = head->weight.rows;
  const size_t acc_size = (size_t)V * H * 4, acc = g->dweight.dtype == LMLOSS_F32 ? 0 : acc_size;
  const size_t E =
      hopt->memory_budget ? hopt->memory_budget : LMLOSS_HEAD_DEFAULT_BUDGET + acc_size;
  const size_t per_group_row = (size_t)V * p->dls + (size_t)H * p->hs;
  const size_t per_slot_row = aux_per_row(p->K) + 3 * sizeof(double);
  const size_t per_chunk_row = (size_t)V * 4 + per_slot_row;
  const int64_t min_chunk = N < 128 ? N : 128;
  /* per-row buffers of the widest chunk: N / 3 bounds wide_chunk_rows(G) */
  const size_t wide_slots = (size_t)(N / 3) * per_slot_row;
  int64_t G = N;
  int in_dw = 0;
  size_t A = 0, fixed = base + lmloss_ws_up((size_t)N * per_group_row) + chunk_slack + wide_slots;
  int64_t rows = lmloss_chunk_rows(E, fixed, per_chunk_row, N);
  if (rows < min_chunk) { /* groups of whole chunks of min_chunk rows */
    if (acc && !hopt->fp32_accumulate) return 0;
    A = lmloss_ws_up(acc);
    rows = min_chunk;
    fixed = base + A + chunk_slack + wide_slots + (size_t)rows * per_chunk_row;
    if (E < fixed) return 0;
    G = (int64_t)((E - fixed) / per_group_row);
    const int64_t G_dw = dw_store_rows(g, p, V, H);
    in_dw = G_dw > G;
    if (in_dw) G = G_dw < N ? G_dw : N;
    G -= G % rows;
    if (G < LMLOSS_HEAD_MIN_GROUP) return 0;
  }
  p->store_in_dw = in_dw;
  p->rows = rows;
  p->group = G;
  p->slot_rows = wide_chunk_rows(G) > rows ? wide_chunk_rows(G) : rows;
  p->tiles = 0;
  size_t off = base;
  p->acc_w_size = A;
  p->acc_w = off, off += A;
  p->store_size =
      lmloss_ws_up((size_t)p->group * V * p->dls) + lmloss_ws_up((size_t)p->group * H * p->hs);
  p->store = p->store_in_dw ? 0 : off;
  p->ghid = p->store + lmloss_ws_up((size_t)p->group * V * p->dls);
  if (!p->store_in_dw) off += p->store_size;
  p->region = off;
  layout_store_chunks(p, V, H);
  return 1;
}

lmloss_status lmloss_linear_make_plan(const lmloss_head *head, const lmloss_head_options *hopt,
                                      const lmloss_head_grads *grads, int64_t K, linear_plan *p) {
  const int64_t N = head->hidden.rows, H = head->hidden.cols, V = head->weight.rows;
  const size_t budget = hopt->memory_budget ? hopt->memory_budget : LMLOSS_HEAD_DEFAULT_BUDGET;
  memset(p, 0, sizeof *p);
  p->K = K;
  p->S = K + 1; /* the target or the K indices, and the argmax */
  p->hs = lmloss_dtype_size(head->hidden.dtype);
  p->dl_separate = has_grads(grads) && head->weight.dtype != LMLOSS_F32;
  p->dls = p->dl_separate ? p->hs : 0;
  p->round_dl = p->dl_separate && wants(&grads->dhidden);
  p->tiles = p->dl_separate && wants(&grads->dweight);
  p->acc_w_f32 = p->tiles && grads->dweight.dtype != LMLOSS_F32 && hopt->fp32_accumulate;
  size_t off = 0;
  p->list = off, off += lmloss_ws_up((size_t)(N + 2) * 8); /* + 2: select_rows' scratch */
  /* what the row op keeps for a 16-bit head (lmloss_row_keep) */
  if (p->dl_separate) {
    if (p->tiles) p->state = off, off += lmloss_ws_up((size_t)N * LMLOSS_ROW_STATE_COLS * 4);
    p->cols = off, off += lmloss_ws_up((size_t)N * p->S * 8);
    p->vals = off, off += lmloss_ws_up((size_t)N * p->S * 4);
  }
  p->sums = off, off += lmloss_ws_up((size_t)(N + 2) * 4);
  if (grads && wants(&grads->dbias) && grads->dbias.dtype != LMLOSS_F32 && hopt->fp32_accumulate) {
    p->acc_b_f32 = 1;
    p->acc_b = off, off += lmloss_ws_up((size_t)V * 4);
  }
  if (wants(&head->bias) && head->bias.dtype != LMLOSS_F32) /* logits' bias: F32 */
    p->bias32 = off, off += lmloss_ws_up((size_t)V * 4);
  p->region = off;
  if (p->tiles && plan_store(head, hopt, grads, p, off)) return LMLOSS_OK;
  /* A row of the chunk: fp32 logits, 16-bit dlogits, hidden and dhidden,
   * dhidden's fp32 sum when rounded, the small buffers and the CE
   * workspace's three doubles. */
  const size_t per_row = (size_t)V * (4 + p->dls) + 2 * (size_t)H * p->hs +
                         (p->round_dl ? (size_t)H * 4 : 0) + aux_per_row(K) + 3 * sizeof(double);
  const int64_t rows = lmloss_chunk_rows(budget, off + chunk_slack, per_row, N);
  const size_t tiles_min =
      p->tiles ? tile_rows_bytes(N, K) + tile_bytes(p, 1, 1, H, p->acc_w_f32, 1, 0) : 0;
  if (rows < 1 || budget < off + tiles_min)
    return lmloss_fail(LMLOSS_ERR_WORKSPACE_TOO_SMALL,
                       "memory_budget of %zu bytes cannot hold one row (%zu bytes: V = %lld logits "
                       "and their buffers) beside %zu bytes of per-call buffers",
                       budget, per_row + chunk_slack, (long long)V, off);
  p->rows = p->slot_rows = rows;
  p->slab = off, off += lmloss_ws_up((size_t)rows * V * 4);
  p->dl = off, off += lmloss_ws_up((size_t)rows * V * p->dls);
  p->hid = off, off += lmloss_ws_up((size_t)rows * H * p->hs);
  p->dh = off, off += lmloss_ws_up((size_t)rows * H * p->hs);
  p->dh_acc = off, off += p->round_dl ? lmloss_ws_up((size_t)rows * H * 4) : 0;
  p->aux = off, off += lmloss_ws_up((size_t)rows * aux_per_row(K));
  p->ce_ws = off, off += lmloss_ws_up(lmloss_cross_entropy_workspace_size(rows));
  p->total = off > p->region + tiles_min ? off : p->region + tiles_min;
  return LMLOSS_OK;
}

lmloss_status lmloss_linear_keep_plan(const lmloss_head *head, const lmloss_head_options *hopt,
                                      linear_plan *p, int *fits) {
  static char phantom; /* a plan reads no data, but a gradient is wanted only with some */
  const lmloss_tensor *x = &head->hidden, *w = &head->weight;
  lmloss_head_grads g;
  memset(&g, 0, sizeof g);
  g.dhidden = (lmloss_tensor){&phantom, x->dtype, x->device, x->rows, x->cols, x->cols};
  g.dweight = (lmloss_tensor){&phantom, w->dtype, w->device, w->rows, w->cols, w->cols};
  TRY(lmloss_linear_make_plan(head, hopt, &g, 1, p));
  *fits = p->dl_separate && p->group == x->rows && !p->store_in_dw;
  return LMLOSS_OK;
}

lmloss_status lmloss_linear_log_probs_keep_size(const lmloss_head *head,
                                                const lmloss_head_options *hopt, size_t *bytes) {
  linear_plan p;
  int fits;
  if (!bytes) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "bytes is NULL");
  TRY(lmloss_check_head(head, hopt));
  TRY(lmloss_linear_keep_plan(head, hopt, &p, &fits));
  *bytes = fits ? p.total : 0;
  return LMLOSS_OK;
}

tile_plan lmloss_linear_plan_tiles(const linear_plan *p, size_t base, int gathered, int saved,
                                   int64_t M, int64_t H, int64_t V) {
  const int all_rows = saved;
  const size_t R = p->total - base;
  const int64_t few = V < 128 ? V : 128;
  tile_plan t;
  int64_t B = gathered && !all_rows ? (int64_t)(R / 2 / ((size_t)H * p->hs)) : M;
  B = B < M ? B : M;
  B = B > 1 ? B : 1;
  while (!all_rows && B > 1 && tile_bytes(p, B, few, H, p->acc_w_f32 && B < M, gathered, 0) > R)
    B /= 2;
  if (B > 128 && B < M) B -= B % 128;
  t.rows = B;
  t.acc_f32 = p->acc_w_f32 && B < M;
  t.gathered = gathered;
  const size_t fixed = tile_bytes(p, B, 0, H, 0, gathered, 0) + 3 * LMLOSS_WS_ALIGN;
  const size_t per_col = (size_t)B * (4 + p->dls) + (t.acc_f32 ? (size_t)H * 4 : 0);
  int64_t c = R > fixed ? (int64_t)((R - fixed) / per_col) : 1;
  c = c < V ? c : V;
  t.inplace = 0;
  if (saved) { /* B = M, no dW accumulator */
    int64_t ci = R > fixed ? (int64_t)((R - fixed) / ((size_t)B * 4)) : 1;
    ci = ci < V ? ci : V;
    ci = ci < LMLOSS_TILE_INPLACE_COLS ? ci : LMLOSS_TILE_INPLACE_COLS;
    if (ci > c) c = ci, t.inplace = 1;
  }
  if (c > 128 && c < V) c -= c % 128;
  while (c > 1 && tile_bytes(p, B, c, H, t.acc_f32, gathered, t.inplace) > R) /* the minimum fits */
    c--;
  t.cols = c > 1 ? c : 1;
  t.hid = base;
  t.slab = t.hid + (gathered ? lmloss_ws_up((size_t)B * H * p->hs) : 0);
  t.dl = t.inplace ? t.slab : t.slab + lmloss_ws_up((size_t)B * t.cols * 4);
  t.acc = t.dl + lmloss_ws_up((size_t)B * t.cols * p->dls);
  return t;
}

lmloss_status lmloss_check_head(const lmloss_head *head, const lmloss_head_options *hopt) {
  if (!head || !hopt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "head or options is NULL");
  TRY(lmloss_check_tensor(&head->hidden, "hidden", LMLOSS_FLOATS, -1, -1));
  TRY(lmloss_check_tensor(&head->weight, "weight", LMLOSS_MASK(head->hidden.dtype), -1,
                          head->hidden.cols));
  if (head->weight.rows < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "weight: V must be >= 1");
  if (head->hidden.cols < 1) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "hidden: H must be >= 1");
  TRY(lmloss_check_optional(&head->bias, "bias", LMLOSS_MASK(head->hidden.dtype), head->weight.rows,
                            1));
  if (hopt->fp32_accumulate != 0 && hopt->fp32_accumulate != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "fp32_accumulate must be 0 or 1");
  return LMLOSS_OK;
}

lmloss_status lmloss_check_head_grads(const lmloss_head *head, const lmloss_head_grads *g) {
  if (!g) return LMLOSS_OK;
  const int64_t N = head->hidden.rows, H = head->hidden.cols, V = head->weight.rows;
  const unsigned wdt = LMLOSS_MASK(LMLOSS_F32) | LMLOSS_MASK(head->weight.dtype);
  TRY(lmloss_check_optional(&g->dhidden, "dhidden", LMLOSS_MASK(head->hidden.dtype), N, H));
  TRY(lmloss_check_optional(&g->dweight, "dweight", wdt, V, H));
  TRY(lmloss_check_optional(&g->dbias, "dbias", wdt, V, 1));
  if (wants(&g->dbias) && !wants(&head->bias))
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "dbias given for a head without bias");
  if (wants(&g->dhidden)) TRY(lmloss_check_alias(&head->hidden, &g->dhidden, "dhidden"));
  if (g->accumulate != 0 && g->accumulate != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "accumulate must be 0 or 1");
  if (g->accumulate && ((wants(&g->dweight) && g->dweight.dtype != LMLOSS_F32) ||
                        (wants(&g->dbias) && g->dbias.dtype != LMLOSS_F32)))
    return lmloss_fail(LMLOSS_ERR_BAD_DTYPE, "accumulate: dweight and dbias must be F32 (a "
                                             "16-bit sum would round every step's gradient)");
  return LMLOSS_OK;
}

/* The plan of a size or plan query, its arguments checked. */
static lmloss_status query_plan(const lmloss_head *head, const lmloss_head_options *hopt,
                                const lmloss_head_grads *grads, int64_t k, linear_plan *p) {
  if (k < 0) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "k must be >= 0");
  TRY(lmloss_check_head(head, hopt));
  TRY(lmloss_check_head_grads(head, grads));
  return lmloss_linear_make_plan(head, hopt, grads, k, p);
}

lmloss_status lmloss_linear_plan(const lmloss_head *head, const lmloss_head_options *hopt,
                                 const lmloss_head_grads *grads, int64_t k,
                                 lmloss_head_plan *plan) {
  linear_plan p;
  if (!plan) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "plan is NULL");
  TRY(query_plan(head, hopt, grads, k, &p));
  plan->workspace_bytes = p.total;
  plan->chunk_rows = p.rows;
  plan->group_rows = p.group;
  plan->store_bytes = p.store_size; /* 0 without a store: the plan starts zeroed */
  plan->store_in_dweight = p.store_in_dw;
  plan->accumulator_bytes = p.acc_w_size;
  plan->logits_gemms = p.tiles && head->hidden.rows > p.rows ? 2 : 1;
  return LMLOSS_OK;
}

lmloss_status lmloss_linear_workspace_size(const lmloss_head *head, const lmloss_head_options *hopt,
                                           const lmloss_head_grads *grads, int64_t k,
                                           size_t *bytes) {
  lmloss_head_plan plan;
  if (!bytes) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "bytes is NULL");
  TRY(lmloss_linear_plan(head, hopt, grads, k, &plan));
  *bytes = plan.workspace_bytes;
  return LMLOSS_OK;
}
