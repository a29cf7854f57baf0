/*
 * backend.h - what every backend implements (ref, cpu, cuda).
 *
 * The core validates every argument before it calls a backend, so a
 * backend may assume: pointers are non-NULL where required, dtypes and
 * shapes agree with lmloss.h, strides are sane, options are in range, the
 * workspace is large enough, and (for host memory) every target and index
 * is in range. Entry points have the public signatures (the row ops: plus
 * keep, below).
 */
#ifndef LMLOSS_CORE_BACKEND_H
#define LMLOSS_CORE_BACKEND_H

#include "lmloss.h"
#include "math/dtype.h" /* and math/rowstats.h */
#include "math/rowstate.h"

/* Building blocks of the fused linear head (src/core/linear_loop.c runs
 * the chunk loop with them). Tensors are row-major views; shapes are
 * those of the tensors passed. */
typedef struct {
  /* c = alpha * op(a) op(b) + beta * c, op = transpose when t_a / t_b. */
  lmloss_status (*gemm)(const lmloss_context *, int t_a, int t_b, float alpha,
                        const lmloss_tensor *a, const lmloss_tensor *b, float beta,
                        const lmloss_tensor *c);
  /* Indices of the rows to keep into list, in increasing order (device
   * memory of the backend):
   * label != ignore for I32/I64 labels, != 0 for BOOL. On the host: their
   * count and the sum of class_weight[label] (of 1s without weights).
   * list has room for N + 2 entries; the last two are scratch. */
  lmloss_status (*select_rows)(const lmloss_context *, const lmloss_tensor *labels, int64_t ignore,
                               const lmloss_tensor *class_weight, int64_t *list, int64_t *count,
                               double *weight_sum);
  /* dst[r] = src[list[r]] and dst[list[r]] = src[r], r < rows of the
   * compact side; same dtype. */
  lmloss_status (*gather_rows)(const lmloss_context *, const lmloss_tensor *src,
                               const int64_t *list, const lmloss_tensor *dst);
  lmloss_status (*scatter_rows)(const lmloss_context *, const lmloss_tensor *src,
                                const int64_t *list, const lmloss_tensor *dst);
  lmloss_status (*fill)(const lmloss_context *, const lmloss_tensor *t, double v);
  /* c (F32) = h w^T + bias ([cols, 1] F32, on every row; absent: no data) */
  lmloss_status (*logits)(const lmloss_context *, const lmloss_tensor *h, const lmloss_tensor *w,
                          const lmloss_tensor *bias, const lmloss_tensor *c);
  /* out ([cols, 1]) = beta * out + column sums of a; with entries
   * (16-bit heads only, else NULL), a's values at its rows' exact entries
   * (entries->cols, entries->vals: the first occurrence of a column in a
   * row) are taken from vals instead of a. */
  lmloss_status (*colsum)(const lmloss_context *, const lmloss_tensor *a,
                          const lmloss_row_keep *entries, float beta, const lmloss_tensor *out);
  /* dst [1] = sum of src [n, 1] (F32), in a fixed order */
  lmloss_status (*sum)(const lmloss_context *, const lmloss_tensor *src, const lmloss_tensor *dst);
  /* dst = src, converted (rounded to nearest even), same shape */
  lmloss_status (*cast)(const lmloss_context *, const lmloss_tensor *src, const lmloss_tensor *dst);
  /* t *= s[0] (s: one F32 in the backend's memory) */
  lmloss_status (*scale)(const lmloss_context *, const lmloss_tensor *t, const float *s);
  /* 16-bit heads only (NULL in a backend without them). entries: n rows
   * of a row op's lmloss_row_keep. acc [n, H] (F32) += (v - v rounded to
   * weight's dtype) weight[c] for each distinct column c = cols[r, s] in
   * [0, V) of row r, v = vals[r, s]: the part of the exact entries that
   * rounding the gradient rows lost, put back into dhidden. */
  lmloss_status (*restore_entries)(const lmloss_context *, const lmloss_row_keep *entries,
                                   const lmloss_tensor *weight, const lmloss_tensor *acc);
  /* t [n, cols] (F32/BF16/F16): row r *= s[r] (s: F32 [n, 1]) */
  lmloss_status (*scale_rows)(const lmloss_context *, const lmloss_tensor *t,
                              const lmloss_tensor *s);
} lmloss_linear_prims;

/* The most indices a row of a backward from saved statistics forms on
 * CUDA (one thread each, beside the argmax's, in a 128-thread CTA). */
#define LMLOSS_SAVED_MAX_K 127
/* The widest F32 logits a log-probs finish writes a 16-bit gradient over
 * (the fused head's tiles; CUDA: one CTA holds a row's tile in registers,
 * SAVED_U x SAVED_BS x 4 floats). */
#define LMLOSS_TILE_INPLACE_COLS 4096

/* The row contract's phases over a vocabulary shard (lmloss.h): the
 * logits hold the columns [sh->col0, sh->col0 + cols) of rows sh->vocab
 * wide (the core resolves vocab 0); states are [N, LMLOSS_ROW_STATE_COLS]
 * F32. A finish takes merged states and the stats call's arguments. */
typedef struct {
  lmloss_status (*ce_state)(const lmloss_context *, const lmloss_ce_inputs *,
                            const lmloss_ce_options *, const lmloss_shard *,
                            const lmloss_tensor *state);
  /* the forward's outputs (out), or the backward's dlogits from dloss */
  lmloss_status (*ce_finish)(const lmloss_context *, const lmloss_ce_inputs *,
                             const lmloss_ce_options *, const lmloss_shard *,
                             const lmloss_tensor *state, const lmloss_ce_outputs *out,
                             const lmloss_tensor *dloss, const lmloss_tensor *dlogits, void *,
                             size_t);
  lmloss_status (*lp_state)(const lmloss_context *, const lmloss_tensor *logits,
                            const lmloss_tensor *index, const lmloss_tensor *mask,
                            const lmloss_transform *, const lmloss_shard *,
                            const lmloss_tensor *state);
  /* the forward (logp, entropy) without dlogits, the backward with it.
   * The backward's state may also be the forward's saved statistics [N,
   * LMLOSS_ROW_STATS] (what a state holds but the label, which it does not
   * read). For the fused head's vocab tiles: keep (its entries only) gets
   * the exact entries that fall in the shard's columns in vals, and at
   * col0 = 0 every entry's column in cols (NaN in vals for one outside
   * [0, vocab)); dlogits (16-bit) may lie over F32 logits of at most
   * LMLOSS_TILE_INPLACE_COLS columns (each dlogits row at the start of its
   * logits row): a row is read whole before any of it is written. */
  lmloss_status (*lp_finish)(const lmloss_context *, const lmloss_tensor *logits,
                             const lmloss_tensor *index, const lmloss_tensor *mask,
                             const lmloss_transform *, const lmloss_shard *,
                             const lmloss_tensor *state, const lmloss_tensor *logp,
                             const lmloss_tensor *entropy, const lmloss_tensor *dlogp,
                             const lmloss_tensor *dentropy, const lmloss_tensor *dlogits,
                             lmloss_row_keep *keep);
  lmloss_status (*softmax_finish)(const lmloss_context *, const lmloss_tensor *x,
                                  const lmloss_shard *, const lmloss_tensor *state, int log,
                                  const lmloss_tensor *out);
  /* the softmax backward's partial sums (dx NULL), or dx from the summed ones */
  lmloss_status (*softmax_bwd)(const lmloss_context *, const lmloss_tensor *y,
                               const lmloss_tensor *dy, int log, const lmloss_shard *,
                               const lmloss_tensor *state, const lmloss_tensor *dy_a,
                               const lmloss_tensor *partials, const lmloss_tensor *dx);
  lmloss_status (*merge)(const lmloss_context *, const lmloss_tensor *a, const lmloss_tensor *b,
                         const lmloss_transform *, const lmloss_tensor *out);
  /* The divergences' phases (NULL on a backend without them): states
   * [N, LMLOSS_DIV_STATE_COLS], their merge, the partials (F64) [N,
   * LMLOSS_DIV_PARTIAL_COLS] from merged states (with dstudent: the
   * forward KL's gradient at upstream grad_output, as the finish forms
   * it, ws then the finish's workspace; another kind's F32 dstudent the
   * backend's to keep what its finish with kept reads), and the finish:
   * the forward's outputs (out), or the backward's dstudent from dloss
   * (out NULL; partials NULL for the forward KL), or, with kept (out and
   * dloss NULL), dstudent at upstream grad_output after div_partials
   * wrote it. */
  lmloss_status (*div_state)(const lmloss_context *, const lmloss_div_inputs *,
                             const lmloss_div_options *, const lmloss_shard *,
                             const lmloss_tensor *state);
  lmloss_status (*div_merge)(const lmloss_context *, const lmloss_tensor *a, const lmloss_tensor *b,
                             const lmloss_div_options *, const lmloss_tensor *out);
  lmloss_status (*div_partials)(const lmloss_context *, const lmloss_div_inputs *,
                                const lmloss_div_options *, const lmloss_shard *,
                                const lmloss_tensor *state, const lmloss_tensor *partials,
                                const lmloss_tensor *dstudent, void *ws, size_t ws_bytes);
  lmloss_status (*div_finish)(const lmloss_context *, const lmloss_div_inputs *,
                              const lmloss_div_options *, const lmloss_shard *,
                              const lmloss_tensor *state, const lmloss_tensor *partials,
                              const lmloss_div_outputs *out, const lmloss_tensor *dloss,
                              const lmloss_tensor *dstudent, int kept, void *, size_t);
} lmloss_state_ops;

/* What a backend runs beyond the row ops every backend has. */
typedef enum {
  LMLOSS_CAN_FUSED_HEAD, /* the linear prims */
  LMLOSS_CAN_16BIT_HEAD, /* BF16/F16 hidden and head */
  LMLOSS_CAN_ROW_STATES, /* the state ops */
  LMLOSS_CAN_DIVERGENCE  /* the divergence op */
} lmloss_capability;

/* The row ops take the public arguments, plus (for the ops that write a
 * gradient) keep: NULL, or lmloss_row_keep's arrays in the backend's
 * memory, which a backend with 16-bit fused heads fills for every row it
 * writes a gradient for (the states, when given: the vocab tiles'; the
 * exact entries, when given: count = K + 1, 2 for cross-entropy); the
 * others leave them. The fused head asks for them with F32 logits (its
 * slab) only, and the CUDA backend supports that case alone (no 16-bit
 * kernel carries the stores). */
typedef struct {
  lmloss_status (*cross_entropy)(const lmloss_context *, const lmloss_ce_inputs *,
                                 const lmloss_ce_options *, const lmloss_ce_outputs *, void *,
                                 size_t, lmloss_row_keep *keep);
  lmloss_status (*cross_entropy_backward)(const lmloss_context *, const lmloss_ce_inputs *,
                                          const lmloss_ce_options *, const lmloss_tensor *dloss,
                                          const lmloss_tensor *dlogits, void *, size_t,
                                          lmloss_row_keep *keep);
  /* index may be absent (K = 0, entropy only). */
  lmloss_status (*log_probs)(const lmloss_context *, const lmloss_tensor *logits,
                             const lmloss_tensor *index, const lmloss_tensor *mask,
                             const lmloss_transform *, const lmloss_tensor *logp,
                             const lmloss_tensor *entropy, const lmloss_tensor *stats);
  lmloss_status (*log_probs_backward)(const lmloss_context *, const lmloss_tensor *logits,
                                      const lmloss_tensor *index, const lmloss_tensor *mask,
                                      const lmloss_transform *, const lmloss_tensor *dlogp,
                                      const lmloss_tensor *dentropy, const lmloss_tensor *dlogits,
                                      const lmloss_tensor *stats, lmloss_row_keep *keep);
  lmloss_status (*softmax)(const lmloss_context *, const lmloss_tensor *x, int log,
                           const lmloss_tensor *out);
  lmloss_status (*softmax_backward)(const lmloss_context *, const lmloss_tensor *y,
                                    const lmloss_tensor *dy, int log, const lmloss_tensor *dx);
  /* The forward's outputs (out), or the backward's dstudent from dloss
   * (out NULL); dstudent may be given with out (fused). */
  lmloss_status (*divergence)(const lmloss_context *, const lmloss_div_inputs *,
                              const lmloss_div_options *, const lmloss_div_outputs *out,
                              const lmloss_tensor *dloss, const lmloss_tensor *dstudent, void *,
                              size_t);
  const lmloss_linear_prims *linear; /* when it supports LMLOSS_CAN_FUSED_HEAD */
  const lmloss_state_ops *states;    /* when it supports LMLOSS_CAN_ROW_STATES */
  int (*supports)(lmloss_capability);
  /* The GRPO family (every backend): the forward's outputs (out), or the
   * backward from dloss (out NULL); dlogp and dentropy each optional. */
  lmloss_status (*grpo)(const lmloss_context *, const lmloss_grpo_inputs *,
                        const lmloss_grpo_options *, const lmloss_grpo_outputs *out,
                        const lmloss_tensor *dloss, const lmloss_tensor *dlogp,
                        const lmloss_tensor *dentropy, void *, size_t);
  /* The DPO family (every backend), likewise. */
  lmloss_status (*preference)(const lmloss_context *, const lmloss_pref_inputs *,
                              const lmloss_pref_options *, const lmloss_pref_outputs *out,
                              const lmloss_tensor *dloss, const lmloss_tensor *dchosen,
                              const lmloss_tensor *drejected, void *, size_t);
  /* KTO (every backend), likewise. */
  lmloss_status (*kto)(const lmloss_context *, const lmloss_kto_inputs *,
                       const lmloss_kto_options *, const lmloss_kto_outputs *out,
                       const lmloss_tensor *dloss, const lmloss_tensor *dlogps);
  /* GRPO on logits in one pass (NULL: the core's two): the log-probs of
   * index [N, 1] into in->logp (rows of T, N = B T; 0 at masked tokens,
   * whose logits it need not read) and dlogits at upstream 1, for
   * options lmloss_grpo_one_pass takes; the loss and metrics are then
   * grpo's. ws: the sequences' scales (B doubles), the rows' masks and
   * target logits from lmloss_grpo_pass_rows(B) (N float pairs), then the
   * cross-entropy row op's workspace from lmloss_grpo_pass_ce_ws(B, N). */
  lmloss_status (*grpo_logits)(const lmloss_context *, const lmloss_tensor *logits,
                               const lmloss_tensor *index, const lmloss_transform *,
                               const lmloss_grpo_inputs *, const lmloss_grpo_options *,
                               const lmloss_tensor *dlogits, void *, size_t);
} lmloss_backend_ops;

extern const lmloss_backend_ops lmloss_ref_ops;
extern const lmloss_backend_ops lmloss_cpu_ops;
#ifdef LMLOSS_WITH_CUDA
extern const lmloss_backend_ops lmloss_cuda_ops;
#endif

/* The one GRPO pass's workspace (grpo_logits), each part on a 256-byte
 * boundary: the sequences' scales (B doubles), the rows' masks and
 * target logits (N float pairs) from lmloss_grpo_pass_rows, the row op's
 * from lmloss_grpo_pass_ce_ws. */
static inline size_t lmloss_grpo_pass_rows(int64_t sequences) {
  return ((size_t)sequences * 8 + 255) / 256 * 256;
}
static inline size_t lmloss_grpo_pass_ce_ws(int64_t sequences, int64_t rows) {
  return lmloss_grpo_pass_rows(sequences) + ((size_t)rows * 8 + 255) / 256 * 256;
}

/* Absent optional tensor. */
static inline int lmloss_present(const lmloss_tensor *t) { return t && t->data; }

/* Workspace layout of the cross-entropy family, shared by every backend:
 * per-row loss [N] and per-row weight [N] in double, then the compacted
 * list of supervised rows [N] int64 and a small header for reductions. */
#define LMLOSS_CE_WS_HEADER 256

/* Error reporting (status.c): records the message, returns the status. */
lmloss_status lmloss_fail(lmloss_status s, const char *fmt, ...);

#endif
