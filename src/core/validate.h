/*
 * validate.h - argument checks shared by the core entry points, and the
 * choice of backend. Each check records a message naming the argument.
 */
#ifndef LMLOSS_CORE_VALIDATE_H
#define LMLOSS_CORE_VALIDATE_H

#include "backend.h"

/* Return the status of x when it is not LMLOSS_OK. */
#define TRY(x)                                                                                     \
  do {                                                                                             \
    lmloss_status st_ = (x);                                                                       \
    if (st_ != LMLOSS_OK) return st_;                                                              \
  } while (0)

#define LMLOSS_MASK(d) (1u << (d))
#define LMLOSS_FLOATS (LMLOSS_MASK(LMLOSS_F32) | LMLOSS_MASK(LMLOSS_BF16) | LMLOSS_MASK(LMLOSS_F16))
#define LMLOSS_INDICES (LMLOSS_MASK(LMLOSS_I32) | LMLOSS_MASK(LMLOSS_I64))

/* Check a tensor's pointer, dtype (a mask of allowed dtypes), stride, and,
 * where rows/cols >= 0, its shape. */
lmloss_status lmloss_check_tensor(const lmloss_tensor *t, const char *name, unsigned dtypes,
                                  int64_t rows, int64_t cols);

/* Same, for an optional tensor: OK when absent. */
lmloss_status lmloss_check_optional(const lmloss_tensor *t, const char *name, unsigned dtypes,
                                    int64_t rows, int64_t cols);

lmloss_status lmloss_check_transform(const lmloss_transform *t);

/* The labels of a cross-entropy call over [N, V] (target [N]; optional
 * token weights [N] and class weights [V]) and its options. Devices and
 * the range of the targets are the caller's, once its backend is known. */
lmloss_status lmloss_check_ce_labels(const lmloss_tensor *target, const lmloss_tensor *tw,
                                     const lmloss_tensor *cw, const lmloss_ce_options *opt,
                                     int64_t N, int64_t V);

/* The labels of a log-probs call over [N, V]: optional index [N, K <= V],
 * optional mask [N], the transform. */
lmloss_status lmloss_check_lp_labels(const lmloss_tensor *index, const lmloss_tensor *mask,
                                     const lmloss_transform *tr, int64_t N, int64_t V);

/* The upstream gradients of a log-probs backward: dlogp [N, K] (with the
 * index) and/or dentropy [N], at least one. */
lmloss_status lmloss_check_lp_upstream(const lmloss_tensor *index, const lmloss_tensor *dlogp,
                                       const lmloss_tensor *dentropy, int64_t N);

/* Saved row statistics (optional F32 [N, LMLOSS_ROW_STATS] on device) of
 * rows V wide: they hold the argmax's column as a float, so V <= 2^24. */
lmloss_status lmloss_check_stats(const lmloss_tensor *stats, int64_t N, int64_t V,
                                 lmloss_device device);

/* The per-row outputs of a cross-entropy call (loss, lse, entropy, argmax). */
lmloss_status lmloss_check_ce_rows(const lmloss_ce_outputs *out, int64_t N, lmloss_reduction r);

/* A reduction, its item count (SUM_OVER_ITEMS) and a fused call's
 * upstream gradient. */
lmloss_status lmloss_check_reduction(lmloss_reduction r, double num_items, float grad_output);

/* Every cross-entropy option in range (also checks its transform). */
lmloss_status lmloss_check_ce_options(const lmloss_ce_options *o);

/* Every tensor in `ts` (absent ones skipped) on `device`. */
lmloss_status lmloss_check_device(const lmloss_tensor *const *ts, int n, lmloss_device device);

/* Host-side range check of an index tensor (skipped on CUDA memory and
 * for an absent one, whose rows may say anything):
 * every entry in [0, V), except `ignore` when allow_ignore. Rows whose
 * mask entry is 0 are not read. */
lmloss_status lmloss_check_indices(const lmloss_tensor *idx, const lmloss_tensor *mask, int64_t V,
                                   int allow_ignore, int64_t ignore, const char *name);

/* Exact aliasing is allowed, partial overlap is not. */
lmloss_status lmloss_check_alias(const lmloss_tensor *in, const lmloss_tensor *out,
                                 const char *name);

/* No byte in common (either absent: none). */
lmloss_status lmloss_check_disjoint(const lmloss_tensor *a, const char *a_name,
                                    const lmloss_tensor *b, const char *b_name);

/* A shard of a vocabulary (lmloss.h) for logits [N, cols] on `device`:
 * *out is the shard with its vocabulary resolved (0: cols), and state
 * must be F32 [N, state_cols] there (LMLOSS_ROW_STATE_COLS, or
 * LMLOSS_DIV_STATE_COLS for a divergence). */
lmloss_status lmloss_check_shard(const lmloss_shard *sh, int64_t N, int64_t cols,
                                 const lmloss_tensor *state, int64_t state_cols,
                                 lmloss_device device, lmloss_shard *out);

/* A divergence's options in range (their transforms too), and the kind
 * that runs: JSD's ends are the KLs (TRL's beta 0 and 1, where the
 * mixture alone would read 0). */
lmloss_status lmloss_check_div_options(const lmloss_div_options *o);
lmloss_div_options lmloss_div_resolve(const lmloss_div_options *opt);

/* The DPO family's options (preference.c). */
lmloss_status lmloss_check_pref_options(const lmloss_pref_options *o);

/* A fused head's tensors and options, and the gradients of one (each
 * optional; F32 or the weight's dtype for dweight and dbias). */
lmloss_status lmloss_check_head(const lmloss_head *head, const lmloss_head_options *hopt);
lmloss_status lmloss_check_head_grads(const lmloss_head *head, const lmloss_head_grads *g);

/* The chunk buffers' bytes at memory_budget 0 (the fastest schedule: the
 * fused head's store may add what a V x H fp32 accumulator would take). */
#define LMLOSS_HEAD_DEFAULT_BUDGET ((size_t)256 << 20)
/* The two fused heads' default: at V = 152k two fp32 slabs a row leave
 * 256 MiB chunks of 128 rows, and every chunk reads both heads and reads
 * and writes dweight again; 400 MiB, the transient memory the heads are
 * allowed beside their inputs and gradients, holds 256. */
#define LMLOSS_DIV_HEAD_DEFAULT_BUDGET ((size_t)400 << 20)
/* The fewest rows a group of the fused head's store may hold when dW sums
 * over groups (plan_store in linear_plan.c says why). */
#define LMLOSS_HEAD_MIN_GROUP 1024

/* UNSUPPORTED, saying so, when the backend cannot run `what`. */
lmloss_status lmloss_check_supports(const lmloss_backend_ops *ops, lmloss_capability c,
                                    const char *what);

/* Resolve the backend for tensors on `device`. */
lmloss_status lmloss_pick_backend(const lmloss_context *ctx, lmloss_device device,
                                  const lmloss_backend_ops **ops);

/* A merge of packed row states out = merge(a, b): F32 [N, cols] each on
 * one device, out aliasing a or b only exactly; *ops the backend, which
 * holds row states. */
lmloss_status lmloss_check_state_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                       const lmloss_tensor *b, const lmloss_tensor *out,
                                       int64_t cols, const lmloss_backend_ops **ops);

static inline int64_t lmloss_index_at(const lmloss_tensor *t, int64_t r, int64_t c) {
  const char *p =
      (const char *)t->data + (size_t)(r * t->row_stride + c) * lmloss_dtype_size(t->dtype);
  return t->dtype == LMLOSS_I64 ? *(const int64_t *)p : (int64_t) * (const int32_t *)p;
}

#endif
