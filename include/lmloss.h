/*
 * lmloss.h - losses over the vocabulary axis, exact under softmax collapse.
 *
 * This header is the whole public contract. Every function returns an
 * lmloss_status; on any status other than LMLOSS_OK no output has been
 * written, and lmloss_last_error() (thread-local) says which argument was
 * wrong and why. The library never allocates behind the caller's back on a
 * device, never exits, aborts or prints.
 *
 * Tensors are row-major views: `rows` x `cols` elements with `row_stride`
 * elements between row starts (row_stride >= cols; contiguous columns).
 * A 1-D tensor of length N is rows = N, cols = 1 (row_stride >= 1).
 * An optional tensor is absent when its data pointer is NULL.
 *
 * Logits may be F32, BF16 or F16; all accumulation is in fp32 (the REF
 * backend accumulates in fp64). Indices may be I64 or I32.
 *
 * Numerics: every row statistic is the max-split sum (m, a, R): the max m,
 * its first index a, and R = sum over j != a of exp(z_j - m). Then
 * lse = m + log1p(R), log p_a = -log1p(R), 1 - p_a = R / (1 + R), so a
 * confident row keeps its loss and every gradient entry to full relative
 * precision. Results whose magnitude is below FLT_MIN (2^-126) may flush to
 * zero; that is the documented underflow floor.
 *
 * Non-finite logits: a row holding a NaN or +inf, or holding only -inf,
 * yields NaN for every per-row result of that row (loss, lse, log-probs,
 * entropy, and its gradient row); reductions then read NaN. -inf entries in
 * an otherwise finite row are legal (probability exactly 0).
 */
#ifndef LMLOSS_H
#define LMLOSS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(LMLOSS_BUILDING) && defined(__GNUC__)
#define LMLOSS_API __attribute__((visibility("default")))
#else
#define LMLOSS_API
#endif

#define LMLOSS_VERSION_MAJOR 0
#define LMLOSS_VERSION_MINOR 1
#define LMLOSS_VERSION_PATCH 0

/* Stability. The sections up to and including softmax, and the library
 * functions at the end, are STABLE: within a major version their functions
 * and the meaning of every existing field keep their behaviour (new fields
 * go to the ends of option structs, set by the *_default() initializers).
 * The sections marked EXPERIMENTAL (the fused head, the row contract) may
 * still change in a minor version. */

/* Status codes. Values are pinned: they never change meaning. */
typedef enum {
  LMLOSS_OK = 0,
  LMLOSS_ERR_NULL_POINTER = 1,       /* a required pointer is NULL */
  LMLOSS_ERR_BAD_DTYPE = 2,          /* dtype not allowed for that argument */
  LMLOSS_ERR_BAD_SHAPE = 3,          /* rows/cols inconsistent between tensors */
  LMLOSS_ERR_BAD_STRIDE = 4,         /* row_stride < cols, or negative */
  LMLOSS_ERR_INDEX_OUT_OF_RANGE = 5, /* target/index outside [0, V), not ignored */
  LMLOSS_ERR_BAD_OPTION = 6,         /* option value NaN, out of range, unknown */
  LMLOSS_ERR_WORKSPACE_TOO_SMALL = 7,
  LMLOSS_ERR_BAD_DEVICE = 8,      /* tensors on different devices */
  LMLOSS_ERR_UNSUPPORTED = 9,     /* backend not built in (e.g. CUDA) */
  LMLOSS_ERR_DEVICE_FAILURE = 10, /* the device runtime reported an error */
  LMLOSS_ERR_OUT_OF_MEMORY = 11   /* no host memory for the CPU backend's scratch */
} lmloss_status;

typedef enum {
  LMLOSS_F32 = 0,
  LMLOSS_BF16 = 1,
  LMLOSS_F16 = 2,
  LMLOSS_F64 = 3,
  LMLOSS_I32 = 4,
  LMLOSS_I64 = 5,
  LMLOSS_BOOL = 6 /* one byte, 0 = false */
} lmloss_dtype;

typedef enum { LMLOSS_CPU = 0, LMLOSS_CUDA = 1 } lmloss_device;

typedef struct {
  void *data;
  lmloss_dtype dtype;
  lmloss_device device;
  int64_t rows;
  int64_t cols;
  int64_t row_stride; /* in elements */
} lmloss_tensor;

/* Which implementation runs a call. AUTO picks CPU or CUDA from the
 * tensors' device; REF is the float64 scalar reference (host memory only),
 * the oracle of the test suite. */
typedef enum {
  LMLOSS_BACKEND_AUTO = 0,
  LMLOSS_BACKEND_REF = 1,
  LMLOSS_BACKEND_CPU = 2,
  LMLOSS_BACKEND_CUDA = 3
} lmloss_backend;

/* Execution context: passed by pointer to every op; NULL means defaults. */
typedef struct {
  lmloss_backend backend;
  void *stream;    /* cudaStream_t for CUDA calls; NULL = default stream */
  int num_threads; /* CPU threads: 0 = OpenMP's default, else 1..1024 (outside: BAD_OPTION) */
} lmloss_context;

LMLOSS_API lmloss_context lmloss_context_default(void);

/* Input transform applied to every logit, in this order:
 * logit scale s, softcap c (c * tanh(x / c), off when c == 0), temperature
 * T (x / T). Requires s > 0, c >= 0, T > 0, all finite, and 1 / T,
 * (c > 0) 1 / c (above about 2.9e-39) and s / T finite (else BAD_OPTION).
 * The backward applies their chain rule. */
typedef struct {
  float logit_scale;
  float softcap;
  float temperature;
} lmloss_transform;

LMLOSS_API lmloss_transform lmloss_transform_default(void); /* {1, 0, 1} */

/* ------------------------------------------------------------------ */
/* Cross-entropy over logits [N, V]                                    */
/* ------------------------------------------------------------------ */

typedef enum {
  LMLOSS_REDUCE_NONE = 0,          /* loss is [N]; ignored rows read 0 */
  LMLOSS_REDUCE_SUM = 1,           /* loss is [1] */
  LMLOSS_REDUCE_MEAN = 2,          /* sum / (sum over valid rows of class_weight[y]);
                                      0 with zero gradient when that is 0 */
  LMLOSS_REDUCE_SUM_OVER_ITEMS = 3 /* sum / num_items (transformers' and
                                      TRL's num_items_in_batch) */
} lmloss_reduction;

/* Per row i with target y (rows with y == ignore_index contribute nothing
 * and are not read), z = transform(x_i), p = softmax(z), class weights c
 * (all 1 when absent, C = sum_j c_j), smoothing e:
 *   ce_i   = c_y (1 - e) (lse - z_y) + (e / V) sum_j c_j (lse - z_j)
 *   ce_i  *= sg(p_y)                 when dft (DFT, seed 001)
 *   loss_i = w_i (ce_i + z_loss * lse^2)   (w = token weight, 1 if absent)
 * The gradient is that of the reduced loss; for REDUCE_NONE it is the
 * gradient of sum_i dloss_i * loss_i. */
typedef struct {
  int64_t ignore_index;  /* default -100 */
  float label_smoothing; /* in [0, 1] */
  float z_loss;          /* >= 0 */
  lmloss_transform transform;
  lmloss_reduction reduction;
  double num_items; /* > 0, for LMLOSS_REDUCE_SUM_OVER_ITEMS */
  int dft;          /* 0 or 1 */
  /* Fused forward+backward only (outputs.dlogits present): the upstream
   * gradient of the returned loss (or of every row's loss, for NONE). */
  float grad_output; /* default 1 */
  /* When 0, dlogits rows of ignored rows are left untouched (sparse
   * supervision: only supervised rows are read and written). Default 1:
   * they are written with zeros. */
  int zero_ignored_rows;
} lmloss_ce_options;

LMLOSS_API lmloss_ce_options lmloss_ce_options_default(void);

typedef struct {
  lmloss_tensor logits;       /* [N, V] F32/BF16/F16 */
  lmloss_tensor target;       /* [N] I64/I32 */
  lmloss_tensor token_weight; /* optional [N] F32 */
  lmloss_tensor class_weight; /* optional [V] F32 (rows = V, cols = 1) */
} lmloss_ce_inputs;

typedef struct {
  lmloss_tensor loss;    /* required: F32 [N] for NONE, [1] otherwise */
  lmloss_tensor lse;     /* optional F32 [N] logsumexp of z; ignored rows 0 */
  lmloss_tensor entropy; /* optional F32 [N] entropy of p; ignored rows 0 */
  lmloss_tensor argmax;  /* optional I64 [N] first argmax of z (token
                            accuracy); ignored rows -1 */
  lmloss_tensor dlogits; /* optional [N, V] F32/BF16/F16: fused forward and
                            backward with upstream grad_output. May alias
                            logits exactly (same data, dtype, stride): the
                            gradient then overwrites the logits. */
} lmloss_ce_outputs;

/* Bytes of workspace that lmloss_cross_entropy and its backward need for N
 * rows (the same for every backend). */
LMLOSS_API size_t lmloss_cross_entropy_workspace_size(int64_t rows);

/* Forward (and, with outputs->dlogits, the gradient in the same pass).
 * Errors: NULL_POINTER (inputs/opt/out/logits/target/loss data),
 * BAD_DTYPE, BAD_SHAPE (target not [N], weights wrong length, loss not [N]
 * or [1]), BAD_STRIDE, INDEX_OUT_OF_RANGE (a target outside [0, V) that is
 * not ignore_index; checked on CPU backends only, a CUDA kernel writes NaN
 * for that row), BAD_OPTION, WORKSPACE_TOO_SMALL, BAD_DEVICE. */
LMLOSS_API lmloss_status lmloss_cross_entropy(const lmloss_context *ctx, const lmloss_ce_inputs *in,
                                              const lmloss_ce_options *opt,
                                              const lmloss_ce_outputs *out, void *workspace,
                                              size_t workspace_bytes);

/* Backward: dlogits [N, V] from dloss (F32, [1] for reduced losses, [N] for
 * NONE; on the logits' device, never read by the host). Recomputes the row
 * statistics from the logits. Same errors as the forward. */
LMLOSS_API lmloss_status lmloss_cross_entropy_backward(const lmloss_context *ctx,
                                                       const lmloss_ce_inputs *in,
                                                       const lmloss_ce_options *opt,
                                                       const lmloss_tensor *dloss,
                                                       const lmloss_tensor *dlogits,
                                                       void *workspace, size_t workspace_bytes);

/* ------------------------------------------------------------------ */
/* Log-probs (selective log-softmax) and entropy                      */
/* ------------------------------------------------------------------ */

/* logp[i, k] = log softmax(z_i)[index[i, k]], z = transform(x).
 * index [N, K] I64/I32 with 0 <= index < V (K >= 1; K = 0 only in the
 * entropy-only forms). mask: optional BOOL [N]; a masked-out row (0) is not
 * read, and its logp and entropy read 0 (its gradient row 0).
 * logp: F32/BF16/F16 [N, K]. entropy: optional F32 [N].
 * stats: optional F32 [N, 4] (LMLOSS_ROW_STATS columns, V <= 2^24): each
 * row's max-split sum, for a backward that then reads the logits once. */
LMLOSS_API lmloss_status lmloss_log_probs(const lmloss_context *ctx, const lmloss_tensor *logits,
                                          const lmloss_tensor *index, const lmloss_tensor *mask,
                                          const lmloss_transform *transform,
                                          const lmloss_tensor *logp, const lmloss_tensor *entropy,
                                          const lmloss_tensor *stats);

/* The row statistics the log-probs forward saves: per row the max m (in
 * units of the softcapped logit), R, the entropy sum t (rowstats.h in the
 * sources) and the argmax's column as a float (exact: V <= 2^24); a row
 * without finite statistics saves NaN and -1, a masked-out row 0 and -1.
 * They hold for the logits, mask and transform they were formed from. */
#define LMLOSS_ROW_STATS 4

/* dlogits = d/dx of sum_ik dlogp[i,k] logp[i,k] + sum_i dentropy[i] H_i.
 * dlogp: optional F32 [N, K] (absent = 0; index may then be absent too);
 * dentropy: optional F32 [N]; at least one is present. dlogits
 * F32/BF16/F16 [N, V]; may alias logits exactly. stats: optional, what
 * lmloss_log_probs saved for these logits: the row is then read once (no
 * reduction pass), with the same numerics; absent, it is recomputed (as
 * on CUDA for K > 127, whose saved-statistics kernel forms at most 127
 * indices per row). */
LMLOSS_API lmloss_status lmloss_log_probs_backward(
    const lmloss_context *ctx, const lmloss_tensor *logits, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *transform, const lmloss_tensor *dlogp,
    const lmloss_tensor *dentropy, const lmloss_tensor *dlogits, const lmloss_tensor *stats);

/* entropy [N] F32 of softmax(transform(x)): lmloss_log_probs with K = 0. */
LMLOSS_API lmloss_status lmloss_entropy(const lmloss_context *ctx, const lmloss_tensor *logits,
                                        const lmloss_transform *transform,
                                        const lmloss_tensor *entropy);

/* ------------------------------------------------------------------ */
/* Softmax and log-softmax, any width                                  */
/* ------------------------------------------------------------------ */

/* out [N, V] F32/BF16/F16 = softmax(x) (log_softmax when `log`). out may
 * alias x exactly. */
LMLOSS_API lmloss_status lmloss_softmax(const lmloss_context *ctx, const lmloss_tensor *x, int log,
                                        const lmloss_tensor *out);

/* dx from the forward's output y and the upstream dy ([N, V] each):
 * softmax: dx = y * (dy - sum(dy * y)); log: dx = dy - exp(y) sum(dy).
 * The argmax entry is formed from the others' sum, so it survives
 * collapse. dx may alias dy exactly. */
LMLOSS_API lmloss_status lmloss_softmax_backward(const lmloss_context *ctx, const lmloss_tensor *y,
                                                 const lmloss_tensor *dy, int log,
                                                 const lmloss_tensor *dx);

/* ================================================================== */
/* EXPERIMENTAL from here to the library functions                     */
/* ================================================================== */

/* ------------------------------------------------------------------ */
/* Divergences between a student's and a teacher's logits [N, V]       */
/* ------------------------------------------------------------------ */

/* p = softmax(student z), q = softmax(teacher z), each side with its own
 * transform. Per row:
 *   KL:         sum_j q_j log(q_j / p_j)           (forward, KL(q || p))
 *   REVERSE_KL: sum_j p_j log(p_j / q_j)           (KL(p || q))
 *   JSD:        beta KL(q || M) + (1 - beta) KL(p || M),
 *               M = (1 - beta) p + beta q; beta 0 is KL and beta 1 is
 *               REVERSE_KL, as TRL's generalized_jsd_loss defines them
 *   TVD:        0.5 sum_j |p_j - q_j|
 * loss_i = soft_weight * D_i + hard_weight * ce_i, ce_i the student's
 * cross-entropy against label_i (Liger-Kernel's distillation losses mix
 * them so). Only the student is differentiated. Every value is formed
 * from log(q_j / p_j) computed without cancellation, so identical rows
 * give exactly 0 and a zero gradient, and confident rows keep theirs. */
typedef enum {
  LMLOSS_DIV_KL = 0,
  LMLOSS_DIV_REVERSE_KL = 1,
  LMLOSS_DIV_JSD = 2,
  LMLOSS_DIV_TVD = 3
} lmloss_divergence_kind;

typedef struct {
  lmloss_divergence_kind kind;
  float beta;               /* JSD's mixture weight, in [0, 1] */
  lmloss_transform student; /* each side's scale, softcap, temperature */
  lmloss_transform teacher;
  float soft_weight;          /* >= 0, default 1 */
  float hard_weight;          /* >= 0, default 0; > 0 needs a label */
  int64_t ignore_index;       /* default -100: rows with that label are skipped */
  lmloss_reduction reduction; /* MEAN: over rows not ignored (TRL's batchmean) */
  double num_items;           /* > 0, for LMLOSS_REDUCE_SUM_OVER_ITEMS */
  float grad_output;          /* fused forward + backward: the upstream, default 1 */
} lmloss_div_options;

LMLOSS_API lmloss_div_options lmloss_div_options_default(void);

typedef struct {
  lmloss_tensor student; /* [N, V] F32/BF16/F16 */
  lmloss_tensor teacher; /* [N, V] F32/BF16/F16, any of them */
  lmloss_tensor label;   /* optional [N] I64/I32: ignore_index skips a row;
                            the target of the hard term */
} lmloss_div_inputs;

typedef struct {
  lmloss_tensor loss;       /* required: F32 [N] for NONE, [1] otherwise */
  lmloss_tensor divergence; /* optional F32 [N]: D_i (ignored rows 0) */
  lmloss_tensor ce;         /* optional F32 [N]: ce_i (needs a label) */
  lmloss_tensor dstudent;   /* optional [N, V]: fused forward and backward;
                               may alias the student's logits exactly */
  lmloss_tensor entropy;    /* optional F32 [N]: the student's entropy
                               -sum_j p_j log p_j (ignored rows 0) */
} lmloss_div_outputs;

/* Forward (and with outputs->dstudent the gradient, upstream
 * opt->grad_output). workspace: lmloss_cross_entropy_workspace_size(N)
 * bytes. A row whose student or teacher holds NaN or +inf, or only -inf,
 * reads NaN (its gradient row too). Errors as lmloss_cross_entropy.
 * Every backend (REF, CPU, CUDA) has them. */
LMLOSS_API lmloss_status lmloss_divergence(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                           const lmloss_div_options *opt,
                                           const lmloss_div_outputs *out, void *workspace,
                                           size_t workspace_bytes);

/* Backward: dstudent [N, V] from dloss (F32, [1] or [N] for NONE). */
LMLOSS_API lmloss_status lmloss_divergence_backward(const lmloss_context *ctx,
                                                    const lmloss_div_inputs *in,
                                                    const lmloss_div_options *opt,
                                                    const lmloss_tensor *dloss,
                                                    const lmloss_tensor *dstudent, void *workspace,
                                                    size_t workspace_bytes);

/* ------------------------------------------------------------------ */
/* Fused linear head: the same losses from hidden states and the head */
/* ------------------------------------------------------------------ */

/* logits = hidden [N, H] x weight [V, H]^T (+ bias [V]), never held whole:
 * rows are processed in chunks whose transient slabs fit the caller's
 * memory budget. Rows a loss ignores (ignore_index, mask 0) are compacted
 * away before the GEMMs, so they cost nothing. hidden, weight and bias
 * share one dtype: F32 on every backend; BF16/F16 on CUDA only (the CPU
 * backend returns LMLOSS_ERR_UNSUPPORTED for them). fp32 inputs use true
 * fp32 GEMMs (no TF32). On CUDA the call reads the number of supervised
 * rows back to the host once (it sizes the GEMMs): this is the one host
 * synchronization of the fused-head calls. */
typedef struct {
  lmloss_tensor hidden; /* [N, H] */
  lmloss_tensor weight; /* [V, H] */
  lmloss_tensor bias;   /* optional [V] (rows = V, cols = 1) */
} lmloss_head;

typedef struct {
  /* 0 (the default): the fastest schedule. When dweight is wanted from a
   * BF16/F16 head, the chunks' rounded dlogits and hidden rows are kept (a
   * store) for one dhidden and one dweight GEMM a group of rows: three
   * GEMMs. The store may take what a V x H fp32 accumulator would, beside
   * 256 MiB of chunk buffers (the logits slab of a chunk of rows, per-row
   * scalars); lmloss_linear_divergence takes 400 MiB (its chunks hold two
   * fp32 slabs), every other call 256 MiB.
   * Any other value bounds the whole workspace (lmloss_linear_workspace_size
   * never asks for more): three GEMMs when a store of all rows fits, or of
   * groups of at least 1024 rows with dweight summed over groups in fp32 (a
   * V x H accumulator in the budget, or in an F32 dweight); else dweight
   * is computed after the chunks in vocab tiles, each written once, at the
   * price of the logits computed again (a fourth GEMM). An F32 head sums
   * dweight over the chunks in place. lmloss_linear_plan tells which. A
   * budget that cannot hold one row gives LMLOSS_ERR_WORKSPACE_TOO_SMALL. */
  size_t memory_budget;
  /* When dweight / dbias are BF16/F16, sum them in fp32 and round once: a
   * dbias buffer of V*4 bytes, and a dweight tile's fp32 sum when the vocab
   * tiles take the rows in more than one block (all inside the budget).
   * Default 1. */
  int fp32_accumulate;
} lmloss_head_options;

LMLOSS_API lmloss_head_options lmloss_head_options_default(void);

/* Gradients of a fused-head call; each one optional (absent = frozen).
 * dhidden: [N, H] in hidden's dtype (rows the loss ignores read 0);
 * dweight [V, H] and dbias [V]: F32 or the weight's dtype, sharing no
 * byte with the head, dhidden or each other (a 16-bit dweight's bytes
 * may serve the call as scratch before its values are written:
 * lmloss_head_plan.store_in_dweight). */
typedef struct {
  lmloss_tensor dhidden;
  lmloss_tensor dweight;
  lmloss_tensor dbias;
  /* 0: every gradient is overwritten. 1: dweight and dbias (F32 then) are
   * added to, as to Megatron's main_grad: the training loop's own fp32
   * gradient sums the steps, and a 16-bit head's three-GEMM schedule needs
   * no accumulator of its own. dhidden is overwritten either way. */
  int accumulate;
} lmloss_head_grads;

/* Workspace bytes for any fused-head call with these shapes, options and
 * requested gradients (k: indices per row for log-probs, 1 for CE). */
LMLOSS_API lmloss_status lmloss_linear_workspace_size(const lmloss_head *head,
                                                      const lmloss_head_options *hopt,
                                                      const lmloss_head_grads *grads, int64_t k,
                                                      size_t *bytes);

/* What a fused-head call with these shapes, options and gradients will do
 * (lmloss_head_options' memory_budget says how it is chosen). */
typedef struct {
  size_t workspace_bytes;   /* lmloss_linear_workspace_size's answer */
  int64_t chunk_rows;       /* rows of a logits GEMM and its row pass */
  int64_t group_rows;       /* rows of a store's dhidden and dweight GEMMs (0: no store) */
  size_t store_bytes;       /* the store's dlogits and hidden rows */
  size_t accumulator_bytes; /* dweight's fp32 sum over the store's groups */
  int logits_gemms;         /* 2 when dweight takes vocab tiles and the rows more than one chunk */
  int store_in_dweight;     /* 1: the store lies in a 16-bit dweight's own bytes (it is written
                               last, from the accumulator), not in the workspace */
} lmloss_head_plan;

LMLOSS_API lmloss_status lmloss_linear_plan(const lmloss_head *head,
                                            const lmloss_head_options *hopt,
                                            const lmloss_head_grads *grads, int64_t k,
                                            lmloss_head_plan *plan);

/* Cross-entropy of the fused head, every option of lmloss_cross_entropy.
 * out->dlogits must be absent. With grads present, their gradients are
 * computed in the same pass for upstream opt->grad_output. */
LMLOSS_API lmloss_status lmloss_linear_cross_entropy(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *target,
    const lmloss_tensor *token_weight, const lmloss_tensor *class_weight,
    const lmloss_ce_options *opt, const lmloss_head_options *hopt, const lmloss_ce_outputs *out,
    const lmloss_head_grads *grads, void *workspace, size_t workspace_bytes);

/* Gradients from dloss (F32 [1] or [N] for NONE, on the device);
 * recomputes the logits chunk by chunk. */
LMLOSS_API lmloss_status lmloss_linear_cross_entropy_backward(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *target,
    const lmloss_tensor *token_weight, const lmloss_tensor *class_weight,
    const lmloss_ce_options *opt, const lmloss_head_options *hopt, const lmloss_tensor *dloss,
    const lmloss_head_grads *grads, void *workspace, size_t workspace_bytes);

/* Log-probs (and entropy) of the fused head: as lmloss_log_probs, stats
 * (optional F32 [N, LMLOSS_ROW_STATS]) included. */
LMLOSS_API lmloss_status lmloss_linear_log_probs(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *transform, const lmloss_head_options *hopt,
    const lmloss_tensor *logp, const lmloss_tensor *entropy, const lmloss_tensor *stats,
    void *workspace, size_t workspace_bytes);

/* Gradients from dlogp [N, K] and/or dentropy [N] (entropy's gradient is
 * the real one). stats: optional, what lmloss_linear_log_probs saved for
 * this head, mask and transform. A 16-bit head whose dweight is wanted and
 * whose rows take more than one chunk then computes the logits once
 * instead of twice: the vocab tiles form dhidden as well as dweight,
 * summing it in fp32 over the tiles (M x H x 4 bytes of the budget, M the
 * rows the mask keeps). Without room for that sum, with dbias wanted, for
 * K > 127, or for an F32 head (whose backward computes the logits once
 * anyway), the statistics are checked and not used. */
LMLOSS_API lmloss_status lmloss_linear_log_probs_backward(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *transform, const lmloss_head_options *hopt,
    const lmloss_tensor *dlogp, const lmloss_tensor *dentropy, const lmloss_tensor *stats,
    const lmloss_head_grads *grads, void *workspace, size_t workspace_bytes);

/* Log-probs whose backward runs two GEMMs and no logits: any objective of
 * the log-probs (GRPO, DPO, ...) then costs the head three GEMMs, as the
 * fused cross-entropy does. The forward keeps, in its workspace, each
 * supervised row's gradient of its log-prob (onehot - p, in the weight's
 * dtype, with its exact entries) beside its hidden row: a store of all N
 * rows, 2V + 2H bytes a row. lmloss_linear_log_probs_keep_size answers
 * its workspace bytes, or 0 where the store of all rows does not fit the
 * budget (memory_budget as in lmloss_head_options; the default's room is
 * that of the three-GEMM cross-entropy) or the head is not BF16/F16 (the
 * backends that take 16-bit heads: CUDA). */
LMLOSS_API lmloss_status lmloss_linear_log_probs_keep_size(const lmloss_head *head,
                                                           const lmloss_head_options *hopt,
                                                           size_t *bytes);

/* The forward: as lmloss_linear_log_probs with K = 1 (index [N, 1]), logp
 * F32, no stats. The workspace (keep_size's bytes) must reach
 * lmloss_linear_log_probs_backward_kept unchanged. UNSUPPORTED where
 * keep_size answers 0. */
LMLOSS_API lmloss_status lmloss_linear_log_probs_keep(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *transform, const lmloss_head_options *hopt,
    const lmloss_tensor *logp, const lmloss_tensor *entropy, void *workspace,
    size_t workspace_bytes);

/* The backward from the kept workspace, for dlogp (F32 [N, 1]): with the
 * same head, index, mask, transform and options as the forward.
 * dhidden = dlogp_i (U W)_i, dweight = U^T (dlogp_i h_i): the entropy's
 * gradient and dbias are not kept (lmloss_linear_log_probs_backward has
 * them). The workspace's contents are spent. */
LMLOSS_API lmloss_status lmloss_linear_log_probs_backward_kept(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *transform, const lmloss_head_options *hopt,
    const lmloss_tensor *dlogp, const lmloss_head_grads *grads, void *workspace,
    size_t workspace_bytes);

/* Multiplies the gradients present in grads, in place, by scale (F32 [1]
 * on the head's device), on the context's stream, with no host
 * synchronization: the upstream gradient of a loss whose gradients a
 * forward call computed at grad_output 1, known only on the device. */
LMLOSS_API lmloss_status lmloss_linear_scale_grads(const lmloss_context *ctx,
                                                   const lmloss_head *head,
                                                   const lmloss_head_grads *grads,
                                                   const lmloss_tensor *scale);

/* t *= scale (F32 [1] on t's device) in place, on the context's stream,
 * with no host synchronization: what lmloss_linear_scale_grads does for
 * one tensor, such as the dlogits a fused forward and backward formed at
 * grad_output 1. A scale of 1 leaves t untouched at the cost of a launch.
 * t: F32, BF16 or F16. UNSUPPORTED on the REF backend. */
LMLOSS_API lmloss_status lmloss_scale(const lmloss_context *ctx, const lmloss_tensor *t,
                                      const lmloss_tensor *scale);

/* Divergences through two fused heads (lmloss_divergence's every kind
 * and option): the student's logits student->hidden [N, Hs] x weight
 * [V, Hs]^T (+ bias) and the teacher's from its own [N, Ht] and [V, Ht],
 * neither N x V held whole: row chunks within hopt->memory_budget, the
 * rows whose label is ignore_index compacted away before the GEMMs.
 * label: optional [N] I64/I32. out->dstudent must be absent; grads are
 * the student's (dhidden, dweight, dbias; the teacher is never
 * differentiated), computed in the same pass for upstream
 * opt->grad_output. F32 heads; UNSUPPORTED on a backend without
 * divergences (CUDA, for now). */
LMLOSS_API lmloss_status lmloss_linear_divergence_workspace_size(const lmloss_head *student,
                                                                 const lmloss_head *teacher,
                                                                 const lmloss_head_options *hopt,
                                                                 size_t *bytes);

LMLOSS_API lmloss_status lmloss_linear_divergence(
    const lmloss_context *ctx, const lmloss_head *student, const lmloss_head *teacher,
    const lmloss_tensor *label, const lmloss_div_options *opt, const lmloss_head_options *hopt,
    const lmloss_div_outputs *out, const lmloss_head_grads *grads, void *workspace,
    size_t workspace_bytes);

/* The backward: the student's grads from dloss (F32 [1], or [N] for
 * NONE), recomputing both heads' logits chunk by chunk. */
LMLOSS_API lmloss_status lmloss_linear_divergence_backward(
    const lmloss_context *ctx, const lmloss_head *student, const lmloss_head *teacher,
    const lmloss_tensor *label, const lmloss_div_options *opt, const lmloss_head_options *hopt,
    const lmloss_tensor *dloss, const lmloss_head_grads *grads, void *workspace,
    size_t workspace_bytes);

/* ------------------------------------------------------------------ */
/* The row contract over a sharded vocabulary                          */
/* ------------------------------------------------------------------ */

/* Every row op above is two phases (docs/design.md): the *state* of a
 * row's columns, an associative *merge* of states, and a *finish* that
 * forms outputs and gradients of any column range from the merged state.
 * These functions expose the phases, so a caller whose vocabulary is
 * split over ranks (Megatron's layout: rank r holds columns [col0, col0 +
 * V_r) of every row) computes exactly the one-shot result with its own
 * NCCL or MPI:
 *
 *   1. each rank: lmloss_cross_entropy_state (or _log_probs_state) of its
 *      columns -> state [N, LMLOSS_ROW_STATE_COLS];
 *   2. exchange: all-gather the states and merge them with
 *      lmloss_row_state_merge (any order, or a tree), or an MPI all-reduce
 *      whose user op calls it. Never an all-reduce of a sum of exp: that
 *      is the collapse again;
 *   3. each rank: the *_finish call of its columns with the merged state:
 *      every per-row output (loss, lse, entropy, log-prob of the label) is
 *      the whole row's on every rank; gradients cover the rank's columns.
 *
 * With one shard of all V columns, state then finish gives the one-shot
 * call's result. Merging k shards' states changes results only by fp32
 * rounding (the max-split merge; the argmax, lowest column among ties,
 * is exact). Backends: CPU and CUDA (states on the logits' device); REF
 * returns LMLOSS_ERR_UNSUPPORTED.
 *
 * The packed state, F32, LMLOSS_ROW_STATE_COLS = 8 columns (32 bytes) a
 * row, layout version LMLOSS_ROW_STATE_VERSION; w is the transformed
 * logit before temperature (softcap(s x), or x without softcap), k the
 * factor that makes it z = w k (lmloss_transform):
 *   [0] m      max of w over the columns; NaN: they hold a NaN or +inf
 *   [1] r      R = sum over j != a of exp((w_j - m) k)
 *   [2] a      the first argmax's column in the vocabulary, as a float
 *              (exact: vocab <= 2^24); -1 for an empty state (the row is
 *              ignored or masked out, or its columns hold only -inf
 *              without softcap); -2 - a where the columns hold no logit
 *              above -inf but softcap makes them -cap
 *   [3] w_y    w at the row's label; NaN where the label is elsewhere
 *   [4] t      sum over j != a of exp((w_j - m) k) (m - w_j) k
 *              (entropy: with lmloss_shard.entropy, else unspecified)
 *   [5] u      sum_j c_j (m - w_j) k   (label smoothing, else unspecified)
 *   [6] c      sum_j c_j               (label smoothing, else unspecified)
 *   [7] 0      reserved
 * An exchange need send only the columns a finish reads: m, r and a
 * always, w_y with a label, t with entropy, u and c with label smoothing;
 * the receiver fills the others with 0 (w_y with NaN). The leading ones
 * serve as such a set: LMLOSS_ROW_STATE_EXCHANGE_COLS (16 bytes a row:
 * cross-entropy, log-probs of a label, softmax), _ENTROPY (an entropy
 * output or gradient) or _SMOOTHING (cross-entropy with label
 * smoothing). A state must be finished with the logits' transform and
 * options that formed it. */
#define LMLOSS_ROW_STATE_VERSION 2
#define LMLOSS_ROW_STATE_COLS 8
#define LMLOSS_ROW_STATE_EXCHANGE_COLS 4
#define LMLOSS_ROW_STATE_EXCHANGE_COLS_ENTROPY 5
#define LMLOSS_ROW_STATE_EXCHANGE_COLS_SMOOTHING 7

/* Which columns a call's logits hold, and which sums its state carries. */
typedef struct {
  int64_t col0;  /* the first column of the shard (>= 0) */
  int64_t vocab; /* the whole vocabulary's width: col0 + the logits' cols
                    <= vocab <= 2^24; 0 means the logits' cols (no shard) */
  int entropy;   /* 1: carry t, needed for an entropy output or gradient
                    (the finish checks it); 0: cheaper, without entropy */
} lmloss_shard;

LMLOSS_API lmloss_shard lmloss_shard_default(void); /* {0, 0, 0} */

/* State of a shard for cross-entropy: in->logits [N, V_r] are the shard's
 * columns, in->target [N] the rows' labels in the whole vocabulary (rows
 * equal to opt->ignore_index are not read: their state is empty),
 * in->class_weight the whole vocabulary's [vocab] (every rank passes all
 * of it), in->token_weight unused. state: F32 [N, LMLOSS_ROW_STATE_COLS]
 * on the logits' device. Errors as lmloss_cross_entropy, plus BAD_SHAPE
 * for a shard outside the vocabulary. */
LMLOSS_API lmloss_status lmloss_cross_entropy_state(const lmloss_context *ctx,
                                                    const lmloss_ce_inputs *in,
                                                    const lmloss_ce_options *opt,
                                                    const lmloss_shard *shard,
                                                    const lmloss_tensor *state);

/* lmloss_cross_entropy's outputs from merged states, for the same inputs
 * and options: out->loss (the whole rows' loss, reduced as opt says), lse,
 * entropy and argmax (whole rows), and out->dlogits [N, V_r] over the
 * shard's columns (upstream opt->grad_output). Workspace as
 * lmloss_cross_entropy_workspace_size. */
LMLOSS_API lmloss_status lmloss_cross_entropy_finish(
    const lmloss_context *ctx, const lmloss_ce_inputs *in, const lmloss_ce_options *opt,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_ce_outputs *out,
    void *workspace, size_t workspace_bytes);

/* lmloss_cross_entropy_backward over the shard's columns from merged
 * states: dlogits [N, V_r] from dloss. */
LMLOSS_API lmloss_status lmloss_cross_entropy_backward_finish(
    const lmloss_context *ctx, const lmloss_ce_inputs *in, const lmloss_ce_options *opt,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_tensor *dloss,
    const lmloss_tensor *dlogits, void *workspace, size_t workspace_bytes);

/* The exchange of a sharded call: it replaces each row of state [N,
 * LMLOSS_ROW_STATE_COLS] (this shard's states, on the call's device) with
 * the merged states of every shard, by an all-gather and
 * lmloss_row_state_merge or an all-reduce whose op merges. On CUDA the
 * states are written on the context's stream, so the exchange's work must
 * be ordered after that work on the stream. user is the pointer given to
 * the call. A status other than LMLOSS_OK ends the call with that status. */
typedef lmloss_status (*lmloss_exchange_fn)(void *user, const lmloss_tensor *state);

/* The fused head's cross-entropy over a sharded vocabulary (Megatron's
 * layout): head->weight [V_r, H] (and bias [V_r]) are the shard's rows,
 * columns [col0, col0 + V_r) of the logits; hidden [N, H] is the whole
 * batch's on every rank; target and class_weight are the whole
 * vocabulary's. One call: the shard's states into state [N,
 * LMLOSS_ROW_STATE_COLS] (ignored rows: the empty state), exchange(user,
 * state), which leaves the merged states there, then the outputs of
 * lmloss_cross_entropy_finish (whole rows) and, with grads, this shard's
 * part of dhidden (sum it over the ranks, as Megatron does) and dweight /
 * dbias of the shard's rows at upstream opt->grad_output. The logits exist
 * a chunk of rows at a time, as in lmloss_linear_cross_entropy (the same
 * options, budget and workspace: lmloss_linear_workspace_size of this
 * head and grads); where the rows take more than one chunk, they are
 * computed in both passes (one logits GEMM more than the one-shot head).
 * _backward_finish takes the merged states and dloss (a per-row loss's
 * backward). F32 hidden and weight only (LMLOSS_ERR_UNSUPPORTED otherwise:
 * a 16-bit head's rounded gradient needs exact entries that a shard's
 * finish does not keep); the backends with states. */
LMLOSS_API lmloss_status lmloss_linear_cross_entropy_sharded(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *target,
    const lmloss_tensor *token_weight, const lmloss_tensor *class_weight,
    const lmloss_ce_options *opt, const lmloss_head_options *hopt, const lmloss_shard *shard,
    lmloss_exchange_fn exchange, void *user, const lmloss_tensor *state,
    const lmloss_ce_outputs *out, const lmloss_head_grads *grads, void *workspace,
    size_t workspace_bytes);

LMLOSS_API lmloss_status lmloss_linear_cross_entropy_backward_finish(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *target,
    const lmloss_tensor *token_weight, const lmloss_tensor *class_weight,
    const lmloss_ce_options *opt, const lmloss_head_options *hopt, const lmloss_shard *shard,
    const lmloss_tensor *state, const lmloss_tensor *dloss, const lmloss_head_grads *grads,
    void *workspace, size_t workspace_bytes);

/* State of a shard for log-probs, entropy and softmax: logits [N, V_r];
 * index: optional [N, 1], each row's one index in the whole vocabulary
 * (the label the state carries; absent for entropy and softmax); mask:
 * optional BOOL [N] (masked-out rows are not read). */
LMLOSS_API lmloss_status lmloss_log_probs_state(
    const lmloss_context *ctx, const lmloss_tensor *logits, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *transform, const lmloss_shard *shard,
    const lmloss_tensor *state);

/* lmloss_log_probs' outputs from merged states: logp [N, 1] (with index)
 * and/or entropy [N] (needs shard->entropy), for the whole rows. */
LMLOSS_API lmloss_status lmloss_log_probs_finish(
    const lmloss_context *ctx, const lmloss_tensor *logits, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *transform, const lmloss_shard *shard,
    const lmloss_tensor *state, const lmloss_tensor *logp, const lmloss_tensor *entropy);

/* lmloss_log_probs_backward over the shard's columns from merged states:
 * dlogits [N, V_r] from dlogp [N, 1] and/or dentropy [N] (needs
 * shard->entropy). dlogits may alias logits exactly. */
LMLOSS_API lmloss_status lmloss_log_probs_backward_finish(
    const lmloss_context *ctx, const lmloss_tensor *logits, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *transform, const lmloss_shard *shard,
    const lmloss_tensor *state, const lmloss_tensor *dlogp, const lmloss_tensor *dentropy,
    const lmloss_tensor *dlogits);

/* Softmax (log_softmax when `log`) of the shard's columns, out [N, V_r],
 * from the merged states of lmloss_log_probs_state with the default
 * transform and no index. out may alias x exactly. */
LMLOSS_API lmloss_status lmloss_softmax_finish(const lmloss_context *ctx, const lmloss_tensor *x,
                                               const lmloss_shard *shard,
                                               const lmloss_tensor *state, int log,
                                               const lmloss_tensor *out);

/* The backward of lmloss_softmax_finish over the shard's columns, y [N,
 * V_r] its output and dy [N, V_r] the upstream, around the exchanges its
 * row sums need. a is the merged state's argmax column (state column 2),
 * dy_a F32 [N] dy there (the rank holding it reads it, the others give 0,
 * and an all-reduce sums them); then
 *   1. each rank: lmloss_softmax_backward_partials -> partials F64 [N,
 *      1], over the shard's columns k != a: softmax, sum y_k (dy_a -
 *      dy_k); log, sum dy_k; all-reduce them (a plain sum);
 *   2. each rank: lmloss_softmax_backward_finish -> dx [N, V_r]: softmax
 *      dx_j = y_j ((dy_j - dy_a) + c), log dx_j = dy_j - p_j (c + dy_a),
 *      c the summed partials; dx_a from 1 - p_a = R / (1 + R) of the
 *      state, so a confident row keeps it.
 * Softmax's sum cancels only where the row's dy does, which is why it
 * waits for dy_a (log-softmax needs no first exchange: dy_a is read by
 * the finish alone). dx may alias dy exactly. Backends: CPU and CUDA. */
LMLOSS_API lmloss_status lmloss_softmax_backward_partials(
    const lmloss_context *ctx, const lmloss_tensor *y, const lmloss_tensor *dy, int log,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_tensor *dy_a,
    const lmloss_tensor *partials);

LMLOSS_API lmloss_status lmloss_softmax_backward_finish(
    const lmloss_context *ctx, const lmloss_tensor *y, const lmloss_tensor *dy, int log,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_tensor *dy_a,
    const lmloss_tensor *partials, const lmloss_tensor *dx);

/* out = merge(a, b), row by row: states [N, LMLOSS_ROW_STATE_COLS] of two
 * disjoint column sets of the same rows, formed with `transform` (for
 * cross-entropy: opt->transform). out may alias a or b exactly. On the
 * host this is also usable as an MPI user op over rows. */
LMLOSS_API lmloss_status lmloss_row_state_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                                const lmloss_tensor *b,
                                                const lmloss_transform *transform,
                                                const lmloss_tensor *out);

/* Divergences (lmloss_divergence) over a sharded vocabulary: rank r holds
 * columns [col0, col0 + V_r) of both the student's and the teacher's rows.
 * A divergence's loss is a sum over columns of terms that need both rows'
 * log-sum-exps, so it takes two exchanges where cross-entropy takes one:
 *
 *   1. each rank: lmloss_divergence_state of its columns -> state [N,
 *      LMLOSS_DIV_STATE_COLS]; all-gather, merge with
 *      lmloss_divergence_state_merge (any order, or a tree);
 *   2. each rank: lmloss_divergence_partials of its columns from the
 *      merged state -> partials [N, LMLOSS_DIV_PARTIAL_COLS], sums of
 *      per-column terms formed against the whole rows' maxes and sums;
 *      all-reduce them (a plain sum: every term the loss sums is >= 0, so
 *      no collapse). They are F64, as the one-shot call's row sums: the
 *      gradient's rev and mix are sums of terms of both signs, and each
 *      rank's part rounded to fp32 would carry an error of its own size,
 *      not of the row's sum;
 *   3. each rank: lmloss_divergence_finish (or _backward_finish) of its
 *      columns: every per-row output is the whole row's on every rank,
 *      dstudent covers the rank's columns.
 *
 * The forward KL's gradient p - q needs the merged state alone: its
 * backward_finish takes no partials (NULL). A forward that wants the
 * gradient at once may split it around the second exchange instead:
 * lmloss_divergence_partials_grad in step 2 (the forward KL's whole
 * gradient, as the one-shot call fuses it into its loss sweep; another
 * kind's per-column quantity, kept in an F32 dstudent), then the finish
 * without out->dstudent and lmloss_divergence_finish_grad, which reads
 * the student's row alone (not the teacher's, no logarithm), and nothing
 * for the forward KL. With one shard of all V
 * columns the three calls give the one-shot call's result up to fp32
 * rounding of the packed sums. Backends: CPU and CUDA (states and
 * partials on the inputs' device); REF returns LMLOSS_ERR_UNSUPPORTED.
 *
 * The packed state, F32, LMLOSS_DIV_STATE_COLS = 12 columns a row, layout
 * version LMLOSS_DIV_STATE_VERSION; each side's w and k as lmloss.h's row
 * state (ws, ks the student's, wt, kt the teacher's), s the student's row,
 * t the teacher's:
 *   [0]  ms     max of ws; NaN: either row holds a NaN or +inf
 *   [1]  rs     sum over j != as of exp((ws_j - ms) ks)
 *   [2]  as     the student's first argmax column, a float (exact: vocab
 *               <= 2^24); -1 for an empty state (an ignored row); -2 - as
 *               where the student's columns hold no logit above -inf
 *   [3]  mt     max of wt
 *   [4]  rt     sum over j != at of exp((wt_j - mt) kt)
 *   [5]  at     the teacher's first argmax column; -2 - at as [2]
 *   [6]  d      Rt - Rs summed term by term against G, the gap zt - zs
 *               between the maxes (math/divergence.h), never as the
 *               difference of the two sums
 *   [7]  xt_as  the teacher's raw logit at the student's argmax
 *   [8]  ws_y   ws at the row's label; NaN where the label is elsewhere
 *   [9]  xs_a   the student's raw logit at as (read with a student softcap)
 *   [10] xt_at  the teacher's raw logit at at (read with a teacher softcap)
 *   [11] 0      reserved
 * An exchange need send only the columns a finish reads: the leading
 * LMLOSS_DIV_STATE_EXCHANGE_COLS (32 bytes a row), ws_y with a hard term
 * or a ce output, xs_a and xt_at with a softcap on that side; the receiver
 * fills the others with 0 (ws_y with NaN). 32 bytes is the floor of two
 * rows: each row's m, R and argmax (24 bytes), D (4) and the teacher at
 * the student's argmax (4); cross-entropy's 16 is one row's.
 *
 * The partials, F64, LMLOSS_DIV_PARTIAL_COLS = 8 columns a row, the sums
 * over the rank's columns (ignored rows 0, rows the state marks
 * non-finite NaN):
 *   [0] div  the divergence's terms (every kind)
 *   [1] rev  REVERSE_KL: the gradient's sum_{j != as} p_j (dg_j - dg_as)
 *   [2] mix  JSD (0 < beta < 1): the gradient's mixture sum
 *   [3] pos, [4] neg, [5] eq  TVD: p's mass where p > q, p < q, p = q
 *   [6] ent  the student's entropy terms (an entropy output)
 *   [7] 0    reserved
 * The all-reduce need send only the columns its kind reads: [0] (KL, 8
 * bytes a row), [0, 1] (REVERSE_KL, 16), [0, 2] (JSD, 16), [0, 3, 4, 5]
 * (TVD, 32), plus [6] with an entropy output. A JSD with beta 0 or 1 is
 * the KL or REVERSE_KL. */
#define LMLOSS_DIV_STATE_VERSION 1
#define LMLOSS_DIV_STATE_COLS 12
#define LMLOSS_DIV_STATE_EXCHANGE_COLS 8
#define LMLOSS_DIV_PARTIAL_COLS 8

/* State of a shard for a divergence: in->student and in->teacher [N, V_r]
 * the shard's columns, in->label (optional) [N] in the whole vocabulary
 * (rows equal to opt->ignore_index are not read: their state is empty).
 * state: F32 [N, LMLOSS_DIV_STATE_COLS]. Errors as lmloss_divergence,
 * plus BAD_SHAPE for a shard outside the vocabulary; shard->entropy is
 * not read (the partials carry the entropy). */
LMLOSS_API lmloss_status lmloss_divergence_state(const lmloss_context *ctx,
                                                 const lmloss_div_inputs *in,
                                                 const lmloss_div_options *opt,
                                                 const lmloss_shard *shard,
                                                 const lmloss_tensor *state);

/* out = merge(a, b), row by row: divergence states of two disjoint column
 * sets of the same rows, formed with opt's transforms. out may alias a or
 * b exactly. On the host also usable as an MPI user op over rows. */
LMLOSS_API lmloss_status lmloss_divergence_state_merge(const lmloss_context *ctx,
                                                       const lmloss_tensor *a,
                                                       const lmloss_tensor *b,
                                                       const lmloss_div_options *opt,
                                                       const lmloss_tensor *out);

/* The shard's partial sums from merged states: partials F64 [N,
 * LMLOSS_DIV_PARTIAL_COLS]. */
LMLOSS_API lmloss_status lmloss_divergence_partials(
    const lmloss_context *ctx, const lmloss_div_inputs *in, const lmloss_div_options *opt,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_tensor *partials);

/* lmloss_divergence_partials and, in the same sweep, the first half of
 * dstudent [N, V_r] over the shard's columns: the forward KL's whole
 * gradient (upstream opt->grad_output, as lmloss_divergence_finish forms
 * it, the reduction's factor included); for another kind, whose gradient
 * reads the summed partials, what lmloss_divergence_finish_grad reads
 * (dstudent F32 then, overlapping neither input). Workspace as
 * lmloss_divergence. */
LMLOSS_API lmloss_status lmloss_divergence_partials_grad(
    const lmloss_context *ctx, const lmloss_div_inputs *in, const lmloss_div_options *opt,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_tensor *partials,
    const lmloss_tensor *dstudent, void *workspace, size_t workspace_bytes);

/* The second half: dstudent, as lmloss_divergence_partials_grad left it,
 * becomes the gradient of the shard's columns (upstream
 * opt->grad_output) from the summed partials; the forward KL's is left as
 * it is. The same inputs, options, shard and state as the first half. */
LMLOSS_API lmloss_status lmloss_divergence_finish_grad(
    const lmloss_context *ctx, const lmloss_div_inputs *in, const lmloss_div_options *opt,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_tensor *partials,
    const lmloss_tensor *dstudent, void *workspace, size_t workspace_bytes);

/* lmloss_divergence's outputs from merged states and summed partials, for
 * the same inputs and options: out->loss, divergence, ce and entropy of
 * the whole rows, out->dstudent [N, V_r] over the shard's columns
 * (upstream opt->grad_output). Workspace as lmloss_divergence. */
LMLOSS_API lmloss_status lmloss_divergence_finish(
    const lmloss_context *ctx, const lmloss_div_inputs *in, const lmloss_div_options *opt,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_tensor *partials,
    const lmloss_div_outputs *out, void *workspace, size_t workspace_bytes);

/* lmloss_divergence_backward over the shard's columns: dstudent [N, V_r]
 * from dloss; partials may be NULL for the forward KL (and a JSD with
 * beta 0). */
LMLOSS_API lmloss_status lmloss_divergence_backward_finish(
    const lmloss_context *ctx, const lmloss_div_inputs *in, const lmloss_div_options *opt,
    const lmloss_shard *shard, const lmloss_tensor *state, const lmloss_tensor *partials,
    const lmloss_tensor *dloss, const lmloss_tensor *dstudent, void *workspace,
    size_t workspace_bytes);

/* ------------------------------------------------------------------ */
/* RL objectives on per-token log-probs: the GRPO family               */
/* ------------------------------------------------------------------ */

/* TRL's GRPOTrainer loss (its _compute_loss) over B sequences of T tokens,
 * from the policy's per-token log-probs logp [B, T] (lmloss_log_probs or
 * the fused head's). With r = logp - old_logp (old absent: r = 0, the
 * gradient still flowing through logp) the log importance weight is
 * lw = r (TOKEN) or, per sequence, sum_t r m / max(sum_t m, 1) (SEQUENCE),
 * and c = exp(lw). Per token, A the advantage:
 *   GRPO, BNPO, DR_GRPO, DAPO, LUSPO: -min(c' A, clip(c, 1 - eps_low,
 *        1 + eps_high) A), c' = min(c, delta) when delta > 0
 *   CISPO: -sg(min(c, eps_high)) A logp          (sg: no gradient)
 *   SAPO:  -4 / tau sigmoid(tau (c - 1)) A, tau the positive or negative
 *          advantage's temperature
 *   VESPO: -sg(phi) A logp, phi the sequence's gamma weight of
 *          w = exp(clip(sum_t clip(r, -20, 20) m + sum log IS, log 1e-8,
 *          20)): exp(lambda + k log w - lambda w), (k, lambda) by A's sign
 * times the off-policy mask (keep a sequence when A >= 0 or the mean of
 * sampling_logp - logp over its tokens <= threshold), the entropy mask
 * (entropy m >= entropy_threshold, where given) and the vLLM
 * importance-sampling ratio (where given; VESPO reads it in phi instead),
 * plus beta k3, k3 = e^d - 1 - d, d = ref_logp - logp (times c with
 * bias_correction_kl). Reduced over the mask m: GRPO and SAPO the mean
 * over sequences of each one's mean over its tokens, BNPO the mean over
 * all tokens, DR_GRPO the sum / (B max_completion_length), LUSPO the sum
 * / B, each divided by accumulation_steps; DAPO, CISPO and VESPO the sum
 * / num_items. Then minus entropy_coef times the mean entropy over the
 * tokens m and the entropy mask keep, / accumulation_steps.
 *
 * Numerics: c - 1 is expm1(lw) and c is exp of the difference, never two
 * exponentials subtracted (log-probs of -1000 whose exponentials
 * underflow keep their ratio); k3 and its gradient -expm1(d) do not
 * cancel at small d. Per-token values are formed in double; sums over
 * tokens and sequences are in a fixed order, so results do not depend on
 * the thread count. Tokens with m = 0 are not read (they add nothing and
 * get a zero gradient), but for VESPO's sum of log IS ratios, which runs
 * over every token as TRL's. */
typedef enum {
  LMLOSS_GRPO_GRPO = 0,
  LMLOSS_GRPO_BNPO = 1,
  LMLOSS_GRPO_DR_GRPO = 2,
  LMLOSS_GRPO_DAPO = 3,
  LMLOSS_GRPO_CISPO = 4,
  LMLOSS_GRPO_SAPO = 5,
  LMLOSS_GRPO_LUSPO = 6,
  LMLOSS_GRPO_VESPO = 7
} lmloss_grpo_loss_type;

typedef enum { LMLOSS_GRPO_TOKEN = 0, LMLOSS_GRPO_SEQUENCE = 1 } lmloss_grpo_level;

/* vLLM's importance-sampling correction (TRL's vllm_importance_sampling_mode):
 * GIVEN takes inputs->is_ratio as it is (or none); the others form it
 * from old_logp - sampling_logp (times m, NaN as 0), per token or summed
 * per sequence, exp of that, then clipped to [is_min, is_max] (TRUNCATE)
 * or set to 0 outside it (MASK). */
typedef enum {
  LMLOSS_GRPO_IS_GIVEN = 0,
  LMLOSS_GRPO_IS_TOKEN_TRUNCATE = 1,
  LMLOSS_GRPO_IS_TOKEN_MASK = 2,
  LMLOSS_GRPO_IS_SEQUENCE_TRUNCATE = 3,
  LMLOSS_GRPO_IS_SEQUENCE_MASK = 4
} lmloss_grpo_is_mode;

/* Real options are doubles: TRL's are Python floats, and a ratio clipped
 * at 1 - 0.2f or a KL weighted by 0.1f would differ from its loss. */
typedef struct {
  lmloss_grpo_loss_type loss_type;      /* default DAPO, TRL's */
  lmloss_grpo_level level;              /* importance_sampling_level, default TOKEN */
  double epsilon_low;                   /* >= 0, default 0.2 */
  double epsilon_high;                  /* >= 0, default 0.2 (CISPO: the ratio's cap) */
  double delta;                         /* > 0: the two-sided clip's cap; 0 = off */
  double beta;                          /* >= 0, the KL's weight (needs ref_logp) */
  int bias_correction_kl;               /* 0 or 1: k3 times c */
  double sapo_temperature_pos;          /* > 0, default 1 */
  double sapo_temperature_neg;          /* > 0, default 1.05 */
  double vespo_k_pos, vespo_lambda_pos; /* default 2, 3 */
  double vespo_k_neg, vespo_lambda_neg; /* default 3, 2 */
  int off_policy_mask;                  /* 0 or 1 */
  double off_policy_threshold;          /* finite */
  double entropy_coef;                  /* finite; != 0 needs entropy */
  double accumulation_steps;            /* > 0, default 1 */
  int64_t max_completion_length;        /* DR_GRPO's; 0 = T */
  /* > 0, DAPO's, CISPO's and VESPO's divisor, default 1 (TRL's
   * num_items_in_batch.clamp(1) / num_processes * accumulation /
   * steps_per_generation) */
  double num_items;
  lmloss_grpo_is_mode is_mode; /* default GIVEN; others need sampling_logp,
                                  and no is_ratio */
  double is_min, is_max;       /* not NaN; -inf / inf: no bound (defaults) */
} lmloss_grpo_options;

LMLOSS_API lmloss_grpo_options lmloss_grpo_options_default(void);

/* F32 tensors on one device. */
typedef struct {
  lmloss_tensor logp;              /* [B, T]: the policy's (differentiated) */
  lmloss_tensor mask;              /* [B, T]: the completion mask, 0 or 1 */
  lmloss_tensor advantages;        /* [B, 1] or [B, T] */
  lmloss_tensor old_logp;          /* optional [B, T]: absent = logp */
  lmloss_tensor ref_logp;          /* optional [B, T]: needed when beta > 0 */
  lmloss_tensor sampling_logp;     /* optional [B, T]: the off-policy mask's
                                      (NaN reads as no evidence); absent = old */
  lmloss_tensor is_ratio;          /* optional [B, T] or [B, 1]: vLLM's ratio */
  lmloss_tensor entropy;           /* optional [B, T]: needed by the entropy
                                      mask, the bonus and its metric */
  lmloss_tensor entropy_threshold; /* optional [1]: the entropy mask's */
  lmloss_tensor num_items;         /* optional [1]: replaces opt->num_items
                                      (on the device: no host read) */
} lmloss_grpo_inputs;

/* What the metrics output holds (F32 [LMLOSS_GRPO_METRICS]): sums and
 * counts over this call's tokens, so that processes can add theirs before
 * dividing (TRL's global means). "Clip" values are per token, or per
 * sequence (counted once) for SEQUENCE with advantages [B, 1]; NaN where
 * the inputs do not define them. */
typedef enum {
  LMLOSS_GRPO_M_TOKENS = 0,         /* sum of m */
  LMLOSS_GRPO_M_KL = 1,             /* sum of k3 m (k3 c with bias_correction_kl) */
  LMLOSS_GRPO_M_ENTROPY = 2,        /* sum of entropy m */
  LMLOSS_GRPO_M_CLIP_LOW = 3,       /* c' < 1 - eps_low and A < 0 */
  LMLOSS_GRPO_M_CLIP_HIGH = 4,      /* c' > 1 + eps_high and A > 0 */
  LMLOSS_GRPO_M_CLIP_REGION = 5,    /* either */
  LMLOSS_GRPO_M_CLIP_COUNT = 6,     /* their count: sum of m, or B */
  LMLOSS_GRPO_M_CLIP_LOW_MIN = 7,   /* least sequence mean of CLIP_LOW */
  LMLOSS_GRPO_M_CLIP_HIGH_MAX = 8,  /* greatest sequence mean of CLIP_HIGH */
  LMLOSS_GRPO_M_CISPO_CLIP = 9,     /* c > eps_high and A > 0 (CISPO) */
  LMLOSS_GRPO_M_PHI = 10,           /* sum of VESPO's phi */
  LMLOSS_GRPO_M_PHI_COUNT = 11,     /* B for advantages [B, 1], else sum of m */
  LMLOSS_GRPO_M_POLICY_LOSS = 12,   /* the loss before accumulation_steps and
                                       the entropy bonus */
  LMLOSS_GRPO_M_BONUS_ENTROPY = 13, /* sum of entropy over the bonus' tokens */
  LMLOSS_GRPO_M_BONUS_TOKENS = 14,  /* the bonus' tokens (m and entropy mask) */
  LMLOSS_GRPO_METRICS = 16
} lmloss_grpo_metric;

typedef struct {
  lmloss_tensor loss;     /* required F32 [1] */
  lmloss_tensor metrics;  /* optional F32 [LMLOSS_GRPO_METRICS] (rows) */
  lmloss_tensor dlogp;    /* optional F32 [B, T]: the gradient (upstream 1) */
  lmloss_tensor dentropy; /* optional F32 [B, T]: the bonus' gradient (the
                             entropy mask has none) */
} lmloss_grpo_outputs;

/* Bytes of workspace for B sequences (every backend). */
LMLOSS_API size_t lmloss_grpo_workspace_size(int64_t sequences);

/* Forward, with the gradients present in out in the same pass. Errors:
 * NULL_POINTER, BAD_DTYPE, BAD_SHAPE (B or T < 1, a tensor's shape),
 * BAD_STRIDE, BAD_OPTION (unknown loss type or level, NaN or out-of-range
 * values, beta > 0 without ref_logp, entropy_coef != 0 or a threshold
 * without entropy), WORKSPACE_TOO_SMALL, BAD_DEVICE. */
LMLOSS_API lmloss_status lmloss_grpo(const lmloss_context *ctx, const lmloss_grpo_inputs *in,
                                     const lmloss_grpo_options *opt, const lmloss_grpo_outputs *out,
                                     void *workspace, size_t workspace_bytes);

/* Backward: dlogp and/or dentropy (F32 [B, T], at least one) from dloss
 * (F32 [1] on the device, never read by the host). */
LMLOSS_API lmloss_status lmloss_grpo_backward(
    const lmloss_context *ctx, const lmloss_grpo_inputs *in, const lmloss_grpo_options *opt,
    const lmloss_tensor *dloss, const lmloss_tensor *dlogp, const lmloss_tensor *dentropy,
    void *workspace, size_t workspace_bytes);

/* GRPO on logits [B T, V] (row b T + t holds sequence b's token t): the
 * policy's log-probs of index [B T] (I64/I32 [N], or [N, 1]) under
 * transform, written to in->logp (F32 [B, T], row stride T), then
 * lmloss_grpo's loss and metrics on them (out->dlogp and dentropy absent),
 * and, with dlogits (optional [B T, V], F32/BF16/F16, may alias logits
 * exactly), the gradient at upstream 1. in->entropy, where given, is an
 * input no gradient flows through, so entropy_coef must be 0 (compose
 * lmloss_log_probs, lmloss_grpo and lmloss_log_probs_backward, which takes
 * the bonus' dentropy). Where a token's gradient needs only its own
 * log-prob (token level; no off-policy or entropy mask, VESPO or sequence
 * IS ratio) the CUDA backend forms it in the log-probs' own pass: the
 * logits are read once and dlogits written once, and a token with m = 0
 * (no part in the loss or the metrics, a zero gradient) has its dlogits
 * row written as zeros without its logits being read, and its log-prob
 * written as 0 (as Liger-Kernel's GRPO kernel leaves it). Otherwise, and
 * on the CPU, two passes: the log-probs of every token, then their
 * backward. */
LMLOSS_API size_t lmloss_grpo_logits_workspace_size(int64_t sequences, int64_t tokens);
LMLOSS_API lmloss_status lmloss_grpo_logits(
    const lmloss_context *ctx, const lmloss_tensor *logits, const lmloss_tensor *index,
    const lmloss_transform *transform, const lmloss_grpo_inputs *in, const lmloss_grpo_options *opt,
    const lmloss_grpo_outputs *out, const lmloss_tensor *dlogits, void *workspace,
    size_t workspace_bytes);

/* ------------------------------------------------------------------ */
/* Preference objectives on sequence log-probs: the DPO family         */
/* ------------------------------------------------------------------ */

/* TRL's DPOTrainer losses over P pairs, from the policy's sequence
 * log-prob sums of the chosen (c) and rejected (r) completions and the
 * reference's (rc, rr; absent: 0). With lc = c - rc, lr = r - rr, the
 * f-divergence's scores s(lc), s(lr) and z = beta (s(lc) - s(lr)), per
 * pair as TRL's loss types define them (SIGMOID -log sigmoid(z), HINGE,
 * IPO and SIGMOID_NORM on scores per token (the token counts), EXO_PAIR
 * and ROBUST with label_smoothing, NCA_PAIR, BCO_PAIR, SPPO_HARD, APO_ZERO
 * and APO_DOWN on beta lc and beta lr, DISCOPOP with discopop_tau), AOT
 * and AOT_UNPAIRED on the batch's sorted log ratios, and SFT, minus the
 * chosen log-prob sums over the chosen tokens. The loss is the sum over
 * types of loss_weights[type] times the mean over pairs (times the pair's
 * weight, WPO's, where given). Every log sigmoid is a softplus, every
 * 1 - sigmoid a sigmoid and forward KL's score -expm1(-lc): none cancels.
 * Sums run in pair order, so results do not depend on threads. */
typedef enum {
  LMLOSS_PREF_SIGMOID = 0,
  LMLOSS_PREF_HINGE = 1,
  LMLOSS_PREF_IPO = 2,
  LMLOSS_PREF_EXO_PAIR = 3,
  LMLOSS_PREF_NCA_PAIR = 4,
  LMLOSS_PREF_ROBUST = 5,
  LMLOSS_PREF_BCO_PAIR = 6,
  LMLOSS_PREF_SPPO_HARD = 7,
  LMLOSS_PREF_AOT = 8,
  LMLOSS_PREF_AOT_UNPAIRED = 9,
  LMLOSS_PREF_APO_ZERO = 10,
  LMLOSS_PREF_APO_DOWN = 11,
  LMLOSS_PREF_DISCOPOP = 12,
  LMLOSS_PREF_SFT = 13,
  LMLOSS_PREF_SIGMOID_NORM = 14,
  /* CPOTrainer's and ORPOTrainer's (trl.experimental), on the policy's sums
   * or means with no reference: */
  LMLOSS_PREF_CPO_SIGMOID = 15, /* (1 - e) softplus(-z) + e softplus(z) */
  LMLOSS_PREF_SIMPO = 16,       /* the same at z - simpo_gamma */
  LMLOSS_PREF_CPO_IPO = 17,     /* (s(lc) - s(lr) - 1 / (2 beta))^2 */
  LMLOSS_PREF_ORPO = 18,        /* -beta log sigmoid(log odds(c) - log odds(r)) */
  LMLOSS_PREF_TYPES = 19
} lmloss_pref_type;

/* TRL's f_divergence_type: the score of a log ratio x. */
typedef enum {
  LMLOSS_PREF_FDIV_REVERSE_KL = 0, /* x (standard DPO) */
  LMLOSS_PREF_FDIV_FORWARD_KL = 1, /* 1 - e^-x */
  LMLOSS_PREF_FDIV_JS = 2,         /* log 2 + log sigmoid(x) */
  LMLOSS_PREF_FDIV_ALPHA = 3,      /* (e^((alpha - 1) x) - 1) / (alpha - 1),
                                      the exponent clipped at 80 as TRL's */
  LMLOSS_PREF_FDIV_ALPHAPO = 4     /* CPO's AlphaPO reward (1 - e^(-alpha x)) /
                                      alpha (x at alpha 0) */
} lmloss_pref_fdiv;

typedef struct {
  double loss_weights[LMLOSS_PREF_TYPES]; /* finite; default SIGMOID 1, others 0 */
  double beta;                            /* > 0, default 0.1 */
  double label_smoothing;                 /* in [0, 1) (ROBUST: [0, 0.5); EXO: > 0) */
  lmloss_pref_fdiv f_divergence;          /* default REVERSE_KL */
  double f_alpha;                         /* ALPHA's coefficient, default 0.5 */
  double discopop_tau;                    /* > 0, default 0.05 */
  double simpo_gamma;                     /* finite, default 0.5 */
} lmloss_pref_options;

LMLOSS_API lmloss_pref_options lmloss_pref_options_default(void);

/* F32 vectors [P] (rows P, cols 1) on one device. */
typedef struct {
  lmloss_tensor chosen;          /* the policy's sums (differentiated) */
  lmloss_tensor rejected;        /* likewise */
  lmloss_tensor ref_chosen;      /* optional: absent = 0 */
  lmloss_tensor ref_rejected;    /* optional */
  lmloss_tensor chosen_tokens;   /* optional: needed by IPO, SIGMOID_NORM, SFT */
  lmloss_tensor rejected_tokens; /* optional: needed by IPO, SIGMOID_NORM */
  lmloss_tensor weight;          /* optional: each pair's (WPO), not with AOT */
} lmloss_pref_inputs;

/* The metrics output (F32 [LMLOSS_PREF_METRICS]): sums over this call's
 * pairs, TRL's rewards being beta lc and beta lr. */
typedef enum {
  LMLOSS_PREF_M_PAIRS = 0,
  LMLOSS_PREF_M_REWARD_CHOSEN = 1,
  LMLOSS_PREF_M_REWARD_REJECTED = 2,
  LMLOSS_PREF_M_ACCURACY = 3, /* pairs with beta lc > beta lr */
  LMLOSS_PREF_M_MARGIN = 4,
  LMLOSS_PREF_M_LOGP_CHOSEN = 5,
  LMLOSS_PREF_M_LOGP_REJECTED = 6,
  LMLOSS_PREF_M_ORPO_LOG_ODDS = 7, /* ORPO's log odds ratio */
  LMLOSS_PREF_METRICS = 8
} lmloss_pref_metric;

typedef struct {
  lmloss_tensor loss;      /* required F32 [1] */
  lmloss_tensor metrics;   /* optional F32 [LMLOSS_PREF_METRICS] */
  lmloss_tensor dchosen;   /* optional F32 [P]: the gradient (upstream 1) */
  lmloss_tensor drejected; /* optional F32 [P] */
  lmloss_tensor pair_loss; /* optional F32 [P]: each pair's own terms
                              (all but AOT's and SFT's), weighted, before
                              the mean */
} lmloss_pref_outputs;

/* Bytes of workspace for P pairs (every backend). */
LMLOSS_API size_t lmloss_preference_workspace_size(int64_t pairs);

/* Forward, with the gradients present in out. Errors as lmloss_grpo's
 * (BAD_OPTION also for a type's missing token counts, or weights with
 * AOT). */
LMLOSS_API lmloss_status lmloss_preference(const lmloss_context *ctx, const lmloss_pref_inputs *in,
                                           const lmloss_pref_options *opt,
                                           const lmloss_pref_outputs *out, void *workspace,
                                           size_t workspace_bytes);

/* Backward: dchosen and/or drejected (F32 [P]) from dloss (F32 [1], on the
 * device). */
LMLOSS_API lmloss_status lmloss_preference_backward(
    const lmloss_context *ctx, const lmloss_pref_inputs *in, const lmloss_pref_options *opt,
    const lmloss_tensor *dloss, const lmloss_tensor *dchosen, const lmloss_tensor *drejected,
    void *workspace, size_t workspace_bytes);

/* The DPO family through the fused head, in one call that also forms the
 * gradients (at upstream 1: lmloss_linear_scale_grads scales them).
 * hidden [N, H] holds 2P sequences of T = N / (2P) tokens, the P chosen
 * completions first and then the P rejected (TRL's concatenated batch);
 * index [N, 1] their tokens; mask (optional BOOL [N]) the tokens that
 * count (completion tokens). Each sequence's log-prob sum is formed from
 * the head's logits, and the objective's gradient with respect to it is
 * applied in the same call, a group of whole pairs at a time: the head
 * runs three GEMMs, never holds N x V logits, and keeps at most one
 * group's gradient rows (16-bit heads: in dweight's own bytes where it is
 * 16-bit, and the workspace). The types that couple pairs (AOT,
 * AOT_UNPAIRED, SFT) need every pair in one group. dbias is not formed. */
typedef struct {
  int64_t pairs;              /* P >= 1 */
  lmloss_tensor ref_chosen;   /* optional F32 [P] (absent: 0) */
  lmloss_tensor ref_rejected; /* optional F32 [P] */
  lmloss_tensor weight;       /* optional F32 [P]: each pair's (WPO) */
  int average;                /* 1: each sequence's mean log-prob over its tokens
                                 that count (0 for none) in place of its sum:
                                 CPO's and ORPO's average_log_prob, SimPO's */
} lmloss_linear_pref_inputs;

typedef struct {
  lmloss_tensor loss;      /* required F32 [1] */
  lmloss_tensor metrics;   /* optional F32 [LMLOSS_PREF_METRICS] */
  lmloss_tensor pair_loss; /* optional F32 [P], as lmloss_pref_outputs */
  lmloss_tensor chosen;    /* optional F32 [P]: the policy's log-prob sums (means) */
  lmloss_tensor rejected;  /* optional F32 [P] */
  lmloss_tensor logp;      /* optional F32 [N, 1]: each token's (0 where masked) */
} lmloss_linear_pref_outputs;

/* Workspace bytes of lmloss_linear_preference for these shapes, options
 * and gradients; 0 where no group of one pair (of all pairs, for a type
 * that couples them) fits the budget. */
LMLOSS_API lmloss_status lmloss_linear_preference_size(
    const lmloss_head *head, const lmloss_head_options *hopt, const lmloss_head_grads *grads,
    int64_t pairs, const lmloss_pref_options *opt, size_t *bytes);

/* UNSUPPORTED where _size answers 0. Errors otherwise as
 * lmloss_linear_log_probs' and lmloss_preference's. */
LMLOSS_API lmloss_status lmloss_linear_preference(
    const lmloss_context *ctx, const lmloss_head *head, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *transform, const lmloss_head_options *hopt,
    const lmloss_linear_pref_inputs *in, const lmloss_pref_options *opt,
    const lmloss_linear_pref_outputs *out, const lmloss_head_grads *grads, void *workspace,
    size_t workspace_bytes);

/* KTOTrainer's losses over N unpaired completions, from the policy's
 * sequence log-prob sums and the reference's (absent: 0), lr = logp -
 * ref: desirable ones (label 1) desirable_weight (1 - sigmoid(beta (lr -
 * kl))), undesirable ones undesirable_weight (1 - sigmoid(beta (kl - lr)))
 * for KTO (kl: the caller's detached batch estimate, TRL's clamped mean
 * of the KL completions' log ratios; absent: 0), 1 - sigmoid(beta lr) and
 * sigmoid(beta lr) for APO_ZERO_UNPAIRED; the loss is their mean over the
 * completions whose loss is not NaN (TRL's nanmean). 1 - sigmoid is a
 * sigmoid, so a margin of 80 nats keeps its e^-80. */
typedef enum { LMLOSS_KTO_KTO = 0, LMLOSS_KTO_APO_ZERO_UNPAIRED = 1 } lmloss_kto_type;

typedef struct {
  lmloss_kto_type loss_type; /* default KTO */
  double beta;               /* > 0, default 0.1 */
  double desirable_weight;   /* finite, default 1 */
  double undesirable_weight; /* finite, default 1 */
} lmloss_kto_options;

LMLOSS_API lmloss_kto_options lmloss_kto_options_default(void);

typedef struct {
  lmloss_tensor logps;     /* F32 [N]: the policy's sums (differentiated) */
  lmloss_tensor ref_logps; /* optional F32 [N] */
  lmloss_tensor label;     /* BOOL [N]: desirable */
  lmloss_tensor kl;        /* optional F32 [1] */
} lmloss_kto_inputs;

/* The metrics output (F32 [LMLOSS_KTO_METRICS]): sums over this call's
 * completions (rewards beta lr; NaN ones skipped, as TRL's nansum). */
typedef enum {
  LMLOSS_KTO_M_CHOSEN = 0, /* desirable completions */
  LMLOSS_KTO_M_REJECTED = 1,
  LMLOSS_KTO_M_REWARD_CHOSEN = 2,
  LMLOSS_KTO_M_REWARD_REJECTED = 3,
  LMLOSS_KTO_M_LOGP_CHOSEN = 4,
  LMLOSS_KTO_M_LOGP_REJECTED = 5,
  LMLOSS_KTO_METRICS = 8
} lmloss_kto_metric;

typedef struct {
  lmloss_tensor loss;    /* required F32 [1] */
  lmloss_tensor metrics; /* optional F32 [LMLOSS_KTO_METRICS] */
  lmloss_tensor dlogps;  /* optional F32 [N]: the gradient (upstream 1) */
} lmloss_kto_outputs;

/* Forward (with dlogps when present) and backward from dloss (F32 [1] on
 * the device). No workspace. Errors as lmloss_preference's. */
LMLOSS_API lmloss_status lmloss_kto(const lmloss_context *ctx, const lmloss_kto_inputs *in,
                                    const lmloss_kto_options *opt, const lmloss_kto_outputs *out);
LMLOSS_API lmloss_status lmloss_kto_backward(const lmloss_context *ctx, const lmloss_kto_inputs *in,
                                             const lmloss_kto_options *opt,
                                             const lmloss_tensor *dloss,
                                             const lmloss_tensor *dlogps);

/* ================================================================== */
/* STABLE again: the library                                          */
/* ================================================================== */

/* The version the library was built as, MAJOR * 10000 + MINOR * 100 +
 * PATCH: compare it with this header's LMLOSS_VERSION_* at run time. */
LMLOSS_API int lmloss_version(void);

/* sizeof the public struct named `name` ("lmloss_tensor", "lmloss_shard",
 * ...), 0 for a name that is none: how a binding that mirrors the structs
 * (lmloss's ctypes layer) checks its mirrors against this build. */
LMLOSS_API size_t lmloss_struct_size(const char *name);

LMLOSS_API const char *lmloss_status_string(lmloss_status s); /* "LMLOSS_ERR_..." */
LMLOSS_API const char *lmloss_last_error(void); /* message of this thread's last error */
LMLOSS_API int lmloss_has_cuda(void);           /* 1 when the CUDA backend is built in */
LMLOSS_API const char *lmloss_cpu_isa(void);    /* "avx512", "avx2" or "portable" */

#ifdef __cplusplus
}
#endif
#endif /* LMLOSS_H */
