/* validate.c - argument checks and backend choice for the core. */
#include <math.h>

#include "validate.h"

static const char *dtype_name(lmloss_dtype d) {
  static const char *names[] = {"F32", "BF16", "F16", "F64", "I32", "I64", "BOOL"};
  return (unsigned)d < 7 ? names[d] : "unknown";
}

lmloss_status lmloss_check_tensor(const lmloss_tensor *t, const char *name, unsigned dtypes,
                                  int64_t rows, int64_t cols) {
  if (!t || !t->data) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "%s: data is NULL", name);
  if ((unsigned)t->dtype > LMLOSS_BOOL || !(dtypes & LMLOSS_MASK(t->dtype)))
    return lmloss_fail(LMLOSS_ERR_BAD_DTYPE, "%s: dtype %s (%d) not allowed here", name,
                       dtype_name(t->dtype), (int)t->dtype);
  if ((unsigned)t->device > LMLOSS_CUDA)
    return lmloss_fail(LMLOSS_ERR_BAD_DEVICE, "%s: unknown device %d", name, (int)t->device);
  if (t->rows < 0 || t->cols < 0)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "%s: negative shape [%lld, %lld]", name,
                       (long long)t->rows, (long long)t->cols);
  if (t->row_stride < t->cols || (t->rows > 1 && t->row_stride < 1))
    return lmloss_fail(LMLOSS_ERR_BAD_STRIDE, "%s: row_stride %lld < cols %lld", name,
                       (long long)t->row_stride, (long long)t->cols);
  if ((rows >= 0 && t->rows != rows) || (cols >= 0 && t->cols != cols))
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "%s: shape [%lld, %lld], expected [%lld, %lld]", name,
                       (long long)t->rows, (long long)t->cols, (long long)rows, (long long)cols);
  return LMLOSS_OK;
}

lmloss_status lmloss_check_optional(const lmloss_tensor *t, const char *name, unsigned dtypes,
                                    int64_t rows, int64_t cols) {
  return lmloss_present(t) ? lmloss_check_tensor(t, name, dtypes, rows, cols) : LMLOSS_OK;
}

lmloss_status lmloss_check_transform(const lmloss_transform *t) {
  if (!t) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "transform is NULL");
  if (!(isfinite(t->logit_scale) && t->logit_scale > 0.0f))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "logit_scale must be finite and > 0, got %g",
                       (double)t->logit_scale);
  /* The reciprocals of a softcap and a temperature finite too: below
   * about 2.9e-39 they are infinite, and 0 * inf makes a NaN where the
   * backends' policies for infinite logits part (fuzz_divergence) */
  if (!(isfinite(t->softcap) && t->softcap >= 0.0f &&
        (t->softcap == 0.0f || isfinite(1.0f / t->softcap))))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION,
                       "softcap must be finite and >= 0, with a finite reciprocal when > 0, got %g",
                       (double)t->softcap);
  if (!(isfinite(t->temperature) && t->temperature > 0.0f && isfinite(1.0f / t->temperature)))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION,
                       "temperature must be finite and > 0 with a finite reciprocal, got %g",
                       (double)t->temperature);
  /* and their ratio, the logits' factor k: an infinite k makes every w
   * infinite, where the backends part as above */
  if (!isfinite(t->logit_scale / t->temperature))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION,
                       "logit_scale / temperature must be finite, got %g / %g",
                       (double)t->logit_scale, (double)t->temperature);
  return LMLOSS_OK;
}

lmloss_status lmloss_check_device(const lmloss_tensor *const *ts, int n, lmloss_device device) {
  for (int i = 0; i < n; i++)
    if (lmloss_present(ts[i]) && ts[i]->device != device)
      return lmloss_fail(LMLOSS_ERR_BAD_DEVICE, "tensors are on different devices");
  return LMLOSS_OK;
}

lmloss_status lmloss_check_indices(const lmloss_tensor *idx, const lmloss_tensor *mask, int64_t V,
                                   int allow_ignore, int64_t ignore, const char *name) {
  if (!lmloss_present(idx) || idx->device != LMLOSS_CPU) return LMLOSS_OK;
  for (int64_t r = 0; r < idx->rows; r++) {
    if (lmloss_present(mask) && !((const unsigned char *)mask->data)[r * mask->row_stride])
      continue;
    for (int64_t c = 0; c < idx->cols; c++) {
      int64_t v = lmloss_index_at(idx, r, c);
      if (allow_ignore && v == ignore) continue;
      if (v < 0 || v >= V)
        return lmloss_fail(LMLOSS_ERR_INDEX_OUT_OF_RANGE,
                           "%s[%lld, %lld] = %lld is outside [0, %lld)", name, (long long)r,
                           (long long)c, (long long)v, (long long)V);
    }
  }
  return LMLOSS_OK;
}

static const char *last_byte(const lmloss_tensor *t) {
  if (t->rows == 0 || t->cols == 0) return (const char *)t->data;
  return (const char *)t->data +
         (size_t)((t->rows - 1) * t->row_stride + t->cols) * lmloss_dtype_size(t->dtype);
}

static int overlap(const lmloss_tensor *a, const lmloss_tensor *b) {
  const char *a0 = (const char *)a->data, *a1 = last_byte(a);
  const char *b0 = (const char *)b->data, *b1 = last_byte(b);
  return a0 < b1 && b0 < a1;
}

lmloss_status lmloss_check_alias(const lmloss_tensor *in, const lmloss_tensor *out,
                                 const char *name) {
  if (in->data == out->data && in->dtype == out->dtype && in->row_stride == out->row_stride)
    return LMLOSS_OK;
  if (overlap(in, out))
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE,
                       "%s overlaps its input without aliasing it exactly (same data, dtype, "
                       "row_stride)",
                       name);
  return LMLOSS_OK;
}

lmloss_status lmloss_check_disjoint(const lmloss_tensor *a, const char *a_name,
                                    const lmloss_tensor *b, const char *b_name) {
  if (lmloss_present(a) && lmloss_present(b) && overlap(a, b))
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "%s overlaps %s", a_name, b_name);
  return LMLOSS_OK;
}

/* The most CPU threads a context may ask for. libgomp prints and exits
 * the process when it cannot start a team's threads (32768 did), and the
 * library must never exit; no CPU it targets has more cores than this. */
#define LMLOSS_MAX_THREADS 1024

lmloss_status lmloss_pick_backend(const lmloss_context *ctx, lmloss_device device,
                                  const lmloss_backend_ops **ops) {
  lmloss_backend b = ctx ? ctx->backend : LMLOSS_BACKEND_AUTO;
  if (ctx && (ctx->num_threads < 0 || ctx->num_threads > LMLOSS_MAX_THREADS))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "num_threads is %d: it must be in [0, %d]",
                       ctx->num_threads, LMLOSS_MAX_THREADS);
  if (b == LMLOSS_BACKEND_AUTO)
    b = device == LMLOSS_CUDA ? LMLOSS_BACKEND_CUDA : LMLOSS_BACKEND_CPU;
  switch (b) {
  case LMLOSS_BACKEND_REF:
  case LMLOSS_BACKEND_CPU:
    if (device != LMLOSS_CPU)
      return lmloss_fail(LMLOSS_ERR_BAD_DEVICE, "the %s backend needs host memory",
                         b == LMLOSS_BACKEND_REF ? "REF" : "CPU");
    *ops = b == LMLOSS_BACKEND_REF ? &lmloss_ref_ops : &lmloss_cpu_ops;
    return LMLOSS_OK;
  case LMLOSS_BACKEND_CUDA:
    if (device != LMLOSS_CUDA)
      return lmloss_fail(LMLOSS_ERR_BAD_DEVICE, "the CUDA backend needs device memory");
#ifdef LMLOSS_WITH_CUDA
    *ops = &lmloss_cuda_ops;
    return LMLOSS_OK;
#else
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "this build of lmloss has no CUDA backend");
#endif
  case LMLOSS_BACKEND_AUTO: break;
  }
  return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "unknown backend %d", (int)b);
}

lmloss_status lmloss_check_reduction(lmloss_reduction r, double num_items, float grad_output) {
  if ((unsigned)r > LMLOSS_REDUCE_SUM_OVER_ITEMS)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "unknown reduction %d", (int)r);
  if (r == LMLOSS_REDUCE_SUM_OVER_ITEMS && !(isfinite(num_items) && num_items > 0))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "num_items must be finite and > 0, got %g",
                       num_items);
  if (!isfinite(grad_output))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "grad_output must be finite");
  return LMLOSS_OK;
}

lmloss_status lmloss_check_ce_options(const lmloss_ce_options *o) {
  TRY(lmloss_check_transform(&o->transform));
  if (!(o->label_smoothing >= 0.0f && o->label_smoothing <= 1.0f))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "label_smoothing must be in [0, 1], got %g",
                       (double)o->label_smoothing);
  if (!(isfinite(o->z_loss) && o->z_loss >= 0.0f))
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "z_loss must be finite and >= 0, got %g",
                       (double)o->z_loss);
  TRY(lmloss_check_reduction(o->reduction, o->num_items, o->grad_output));
  if (o->dft != 0 && o->dft != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "dft must be 0 or 1, got %d", o->dft);
  if (o->zero_ignored_rows != 0 && o->zero_ignored_rows != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "zero_ignored_rows must be 0 or 1");
  return LMLOSS_OK;
}

lmloss_status lmloss_check_ce_rows(const lmloss_ce_outputs *out, int64_t N, lmloss_reduction r) {
  TRY(lmloss_check_tensor(&out->loss, "loss", LMLOSS_MASK(LMLOSS_F32),
                          r == LMLOSS_REDUCE_NONE ? N : 1, 1));
  TRY(lmloss_check_optional(&out->lse, "lse", LMLOSS_MASK(LMLOSS_F32), N, 1));
  TRY(lmloss_check_optional(&out->entropy, "entropy", LMLOSS_MASK(LMLOSS_F32), N, 1));
  return lmloss_check_optional(&out->argmax, "argmax", LMLOSS_MASK(LMLOSS_I64), N, 1);
}

lmloss_status lmloss_check_ce_labels(const lmloss_tensor *target, const lmloss_tensor *tw,
                                     const lmloss_tensor *cw, const lmloss_ce_options *opt,
                                     int64_t N, int64_t V) {
  if (!opt) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "options is NULL");
  TRY(lmloss_check_tensor(target, "target", LMLOSS_INDICES, N, 1));
  TRY(lmloss_check_optional(tw, "token_weight", LMLOSS_MASK(LMLOSS_F32), N, 1));
  TRY(lmloss_check_optional(cw, "class_weight", LMLOSS_MASK(LMLOSS_F32), V, 1));
  return lmloss_check_ce_options(opt);
}

lmloss_status lmloss_check_lp_labels(const lmloss_tensor *index, const lmloss_tensor *mask,
                                     const lmloss_transform *tr, int64_t N, int64_t V) {
  TRY(lmloss_check_optional(index, "index", LMLOSS_INDICES, N, -1));
  if (lmloss_present(index) && index->cols > V)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "index: K = %lld exceeds V = %lld",
                       (long long)index->cols, (long long)V);
  TRY(lmloss_check_optional(mask, "mask", LMLOSS_MASK(LMLOSS_BOOL), N, 1));
  return lmloss_check_transform(tr);
}

lmloss_status lmloss_check_stats(const lmloss_tensor *stats, int64_t N, int64_t V,
                                 lmloss_device device) {
  if (!lmloss_present(stats)) return LMLOSS_OK;
  TRY(lmloss_check_tensor(stats, "stats", LMLOSS_MASK(LMLOSS_F32), N, LMLOSS_ROW_STATS));
  if (V > ((int64_t)1 << 24))
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE,
                       "stats hold the argmax's column as a float: V = %lld exceeds 2^24",
                       (long long)V);
  const lmloss_tensor *ts[] = {stats};
  return lmloss_check_device(ts, 1, device);
}

lmloss_status lmloss_check_lp_upstream(const lmloss_tensor *index, const lmloss_tensor *dlogp,
                                       const lmloss_tensor *dentropy, int64_t N) {
  if (!lmloss_present(dlogp) && !lmloss_present(dentropy))
    return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "dlogp and dentropy are both absent");
  if (lmloss_present(dlogp)) {
    if (!lmloss_present(index))
      return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "dlogp given without index");
    TRY(lmloss_check_tensor(dlogp, "dlogp", LMLOSS_MASK(LMLOSS_F32), N, index->cols));
  }
  return lmloss_check_optional(dentropy, "dentropy", LMLOSS_MASK(LMLOSS_F32), N, 1);
}

lmloss_status lmloss_check_shard(const lmloss_shard *sh, int64_t N, int64_t cols,
                                 const lmloss_tensor *state, int64_t state_cols,
                                 lmloss_device device, lmloss_shard *out) {
  if (!sh) return lmloss_fail(LMLOSS_ERR_NULL_POINTER, "shard is NULL");
  *out = *sh;
  if (out->vocab == 0) out->vocab = cols;
  if (out->col0 < 0 || out->vocab < 1 || out->col0 > out->vocab - cols)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE,
                       "shard: columns [%lld, %lld + %lld) are not inside a vocabulary of %lld",
                       (long long)out->col0, (long long)out->col0, (long long)cols,
                       (long long)out->vocab);
  if (out->vocab > LMLOSS_STATE_MAX_VOCAB)
    return lmloss_fail(LMLOSS_ERR_BAD_SHAPE,
                       "states hold the argmax's column as a float: vocab = %lld exceeds 2^24",
                       (long long)out->vocab);
  if (out->entropy != 0 && out->entropy != 1)
    return lmloss_fail(LMLOSS_ERR_BAD_OPTION, "shard: entropy must be 0 or 1, got %d",
                       out->entropy);
  TRY(lmloss_check_tensor(state, "state", LMLOSS_MASK(LMLOSS_F32), N, state_cols));
  const lmloss_tensor *ts[] = {state};
  return lmloss_check_device(ts, 1, device);
}

lmloss_status lmloss_check_supports(const lmloss_backend_ops *ops, lmloss_capability c,
                                    const char *what) {
  if (ops->supports(c)) return LMLOSS_OK;
  return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "this backend has no %s", what);
}

lmloss_status lmloss_check_state_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                       const lmloss_tensor *b, const lmloss_tensor *out,
                                       int64_t cols, const lmloss_backend_ops **ops) {
  const unsigned f32 = LMLOSS_MASK(LMLOSS_F32);
  TRY(lmloss_check_tensor(a, "a", f32, -1, cols));
  TRY(lmloss_check_tensor(b, "b", f32, a->rows, cols));
  TRY(lmloss_check_tensor(out, "out", f32, a->rows, cols));
  TRY(lmloss_check_alias(a, out, "out"));
  TRY(lmloss_check_alias(b, out, "out"));
  const lmloss_tensor *ts[] = {b, out};
  TRY(lmloss_check_device(ts, 2, a->device));
  TRY(lmloss_pick_backend(ctx, a->device, ops));
  return lmloss_check_supports(*ops, LMLOSS_CAN_ROW_STATES, "row states");
}
