/*
 * backend.h - what every backend implements (ref, cpu, cuda).
 *
 * The core validates every argument before it calls a backend, so a
 * backend may assume: pointers are non-NULL where required, dtypes and
 * shapes agree with lmloss.h, strides are sane, options are in range, the
 * workspace is large enough, and (for host memory) every target and index
 * is in range. Entry points have the public signatures.
 */
#ifndef LMLOSS_CORE_BACKEND_H
#define LMLOSS_CORE_BACKEND_H

#include "lmloss.h"

typedef struct {
  lmloss_status (*cross_entropy)(const lmloss_context *, const lmloss_ce_inputs *,
                                 const lmloss_ce_options *, const lmloss_ce_outputs *, void *,
                                 size_t);
  lmloss_status (*cross_entropy_backward)(const lmloss_context *, const lmloss_ce_inputs *,
                                          const lmloss_ce_options *, const lmloss_tensor *dloss,
                                          const lmloss_tensor *dlogits, void *, size_t);
  /* index may be absent (K = 0, entropy only). */
  lmloss_status (*log_probs)(const lmloss_context *, const lmloss_tensor *logits,
                             const lmloss_tensor *index, const lmloss_tensor *mask,
                             const lmloss_transform *, const lmloss_tensor *logp,
                             const lmloss_tensor *entropy);
  lmloss_status (*log_probs_backward)(const lmloss_context *, const lmloss_tensor *logits,
                                      const lmloss_tensor *index, const lmloss_tensor *mask,
                                      const lmloss_transform *, const lmloss_tensor *dlogp,
                                      const lmloss_tensor *dentropy, const lmloss_tensor *dlogits);
  lmloss_status (*softmax)(const lmloss_context *, const lmloss_tensor *x, int log,
                           const lmloss_tensor *out);
  lmloss_status (*softmax_backward)(const lmloss_context *, const lmloss_tensor *y,
                                    const lmloss_tensor *dy, int log, const lmloss_tensor *dx);
} lmloss_backend_ops;

extern const lmloss_backend_ops lmloss_ref_ops;
extern const lmloss_backend_ops lmloss_cpu_ops;
#ifdef LMLOSS_WITH_CUDA
extern const lmloss_backend_ops lmloss_cuda_ops;
#endif

/* Absent optional tensor. */
static inline int lmloss_present(const lmloss_tensor *t) { return t && t->data; }

/* Element pointer arithmetic in 64 bits. */
static inline size_t lmloss_dtype_size(lmloss_dtype d) {
  switch (d) {
  case LMLOSS_F64:
  case LMLOSS_I64: return 8;
  case LMLOSS_F32:
  case LMLOSS_I32: return 4;
  case LMLOSS_BF16:
  case LMLOSS_F16: return 2;
  case LMLOSS_BOOL: return 1;
  }
  return 0;
}

/* Workspace layout of the cross-entropy family, shared by every backend:
 * per-row loss [N] and per-row weight [N] in double, then the compacted
 * list of supervised rows [N] int64 and a small header for reductions. */
#define LMLOSS_CE_WS_HEADER 256

/* Error reporting (status.c): records the message, returns the status. */
lmloss_status lmloss_fail(lmloss_status s, const char *fmt, ...);

#endif
