/*
 * fuzz_common.h - what every fuzz target shares: a reader that decodes
 * shapes, dtypes, options and data from the fuzzer's bytes, tensors built
 * from it (sometimes malformed: a NULL pointer, a short stride, a wrong
 * dtype, a negative size), and the checks each call must pass whatever
 * its input: it returns a known status, and on any status but OK its
 * outputs hold the bytes they held before (lmloss.h: nothing is
 * written). Where the CPU and REF backends both run a call they must
 * agree on its status. A failed check aborts, which libFuzzer reports
 * as a crash with its input.
 *
 * Sizes stay small (a few rows, up to a few thousand columns: the CPU's
 * multi-block row path starts at 2048) so that each input runs in
 * milliseconds under ASan and UBSan.
 */
#ifndef LMLOSS_FUZZ_COMMON_H
#define LMLOSS_FUZZ_COMMON_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmloss.h"
#include "math/dtype.h"

typedef struct {
  const uint8_t *p;
  size_t n;
  uint64_t rng; /* data past the input's end: a stream seeded by it */
} fz_in;

static inline uint8_t fz_u8(fz_in *in) {
  if (in->n) {
    in->rng = in->rng * 6364136223846793005ull + *in->p;
    return in->n--, *in->p++;
  }
  in->rng = in->rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint8_t)(in->rng >> 56);
}

/* An integer in [lo, hi]. */
static inline int64_t fz_range(fz_in *in, int64_t lo, int64_t hi) {
  uint32_t v = (uint32_t)fz_u8(in) | (uint32_t)fz_u8(in) << 8;
  return lo + (int64_t)(v % (uint64_t)(hi - lo + 1));
}

/* 1 with probability k/256. */
static inline int fz_chance(fz_in *in, int k) { return fz_u8(in) < k; }

/* A float: mostly moderate logits, sometimes one of the values that
 * break the usual forms (a peak, an extreme, a non-finite value). */
static inline float fz_float(fz_in *in) {
  static const float special[] = {0.0f,     -0.0f,   1.0f,     -1.0f,    17.0f,     30.0f,
                                  50.0f,    1000.0f, -1000.0f, 1e-30f,   1e30f,     FLT_MAX,
                                  -FLT_MAX, FLT_MIN, 1e-45f,   INFINITY, -INFINITY, NAN,
                                  88.7f,    -103.9f, 65504.0f, 3.4e38f};
  const uint8_t k = fz_u8(in);
  if (k < 24) return special[k % (sizeof special / sizeof *special)];
  return (float)((int)fz_range(in, -32768, 32767)) / 2048.0f; /* within +-16 */
}

/* A finite logit within +-1000: the peaks and margins of the accuracy
 * contract, or a moderate value. */
static inline float fz_float_tame(fz_in *in) {
  static const float peak[] = {0.0f, 1.0f, -1.0f, 17.0f, 30.0f, 50.0f, 100.0f, 1000.0f, -1000.0f};
  const uint8_t k = fz_u8(in);
  if (k < 18) return peak[k % (sizeof peak / sizeof *peak)];
  return (float)((int)fz_range(in, -32768, 32767)) / 2048.0f;
}

/* Allocations of one input, released together. */
#define FZ_MAX_ALLOCS 256
typedef struct {
  void *p[FZ_MAX_ALLOCS];
  int n;
} fz_pool;

static inline void *fz_alloc(fz_pool *pool, size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p || pool->n == FZ_MAX_ALLOCS) abort();
  pool->p[pool->n++] = p;
  return p;
}

static inline void fz_release(fz_pool *pool) {
  for (int i = 0; i < pool->n; i++)
    free(pool->p[i]);
  pool->n = 0;
}

static inline size_t fz_elem(lmloss_dtype dt) {
  return dt == LMLOSS_F64 || dt == LMLOSS_I64   ? 8
         : dt == LMLOSS_F32 || dt == LMLOSS_I32 ? 4
         : dt == LMLOSS_BOOL                    ? 1
                                                : 2;
}

/* Bytes a tensor's view spans (0 when it spans nothing). */
static inline size_t fz_span(const lmloss_tensor *t) {
  if (!t->data || t->rows <= 0 || t->cols <= 0 || t->row_stride < t->cols) return 0;
  return ((size_t)(t->rows - 1) * (size_t)t->row_stride + (size_t)t->cols) * fz_elem(t->dtype);
}

/* Mostly `want`; sometimes another dtype, valid or not. */
static inline lmloss_dtype fz_dtype(fz_in *in, lmloss_dtype want) {
  if (!fz_chance(in, 12)) return want;
  return (lmloss_dtype)fz_range(in, 0, 7); /* 7: no such dtype */
}

/* A float dtype for logits: F32, BF16 or F16. */
static inline lmloss_dtype fz_float_dtype(fz_in *in) {
  static const lmloss_dtype d[] = {LMLOSS_F32, LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16};
  return fz_dtype(in, d[fz_range(in, 0, 3)]);
}

/* A host tensor [rows, cols] of dtype dt. Its memory always holds the
 * view the fields describe; sometimes the fields lie (a NULL pointer, a
 * short or negative stride, a negative size), which the library must
 * refuse. Float data from fz_float; indices in [-2, V + 1] (or
 * `ignore`); bools 0 or 1. */
static inline lmloss_tensor fz_tensor(fz_in *in, fz_pool *pool, lmloss_dtype dt, int64_t rows,
                                      int64_t cols, int64_t V, int64_t ignore) {
  lmloss_tensor t = {NULL, dt, LMLOSS_CPU, rows, cols, cols + fz_range(in, 0, 2)};
  if (rows < 0 || cols < 0) return t;
  const size_t es = fz_elem(dt), n = (size_t)rows * (size_t)t.row_stride;
  unsigned char *d = fz_alloc(pool, n * es);
  const int wild = fz_chance(in, 96); /* else finite: the contract's ground */
  for (size_t i = 0; i < n; i++) {
    if (dt == LMLOSS_F32 || dt == LMLOSS_BF16 || dt == LMLOSS_F16)
      lmloss_store(d, dt, (int64_t)i, wild ? fz_float(in) : fz_float_tame(in));
    else if (dt == LMLOSS_F64)
      ((double *)d)[i] = fz_float(in);
    else if (dt == LMLOSS_BOOL)
      d[i] = fz_u8(in) & 1;
    else {
      const int64_t v = fz_chance(in, 16)  ? ignore
                        : fz_chance(in, 8) ? fz_range(in, -2, V + 1)
                                           : fz_range(in, 0, V > 0 ? V - 1 : 0);
      if (dt == LMLOSS_I64)
        ((int64_t *)d)[i] = v;
      else if (dt == LMLOSS_I32)
        ((int32_t *)d)[i] = (int32_t)v;
      else
        memset(d + i * es, 0x5a, es);
    }
  }
  t.data = d;
  const uint8_t lie = fz_u8(in);
  if (lie == 0) t.data = NULL;
  if (lie == 1) t.row_stride = cols - 1;
  if (lie == 2) t.row_stride = -1;
  if (lie == 3) t.rows = -rows - 1;
  if (lie == 4) t.device = LMLOSS_CUDA; /* data in host memory: must be refused */
  return t;
}

/* An optional tensor: absent (data NULL) half the time. */
static inline lmloss_tensor fz_optional(fz_in *in, fz_pool *pool, lmloss_dtype dt, int64_t rows,
                                        int64_t cols, int64_t V, int64_t ignore) {
  if (fz_chance(in, 128)) return (lmloss_tensor){0};
  return fz_tensor(in, pool, dt, rows, cols, V, ignore);
}

/* A transform: mostly valid, sometimes out of range (0, negative, NaN). */
static inline lmloss_transform fz_transform(fz_in *in) {
  lmloss_transform t = lmloss_transform_default();
  if (fz_chance(in, 64))
    t.logit_scale = fz_chance(in, 200) ? 0.25f + fz_u8(in) / 64.0f : fz_float(in);
  if (fz_chance(in, 64)) t.softcap = fz_chance(in, 200) ? 1.0f + fz_u8(in) / 4.0f : fz_float(in);
  if (fz_chance(in, 64))
    t.temperature = fz_chance(in, 200) ? 0.1f + fz_u8(in) / 32.0f : fz_float(in);
  return t;
}

/* A context of backend b with 0 to 3 threads (sometimes an invalid count). */
static inline lmloss_context fz_context(fz_in *in, lmloss_backend b) {
  lmloss_context c = lmloss_context_default();
  c.backend = b;
  c.num_threads = (int)fz_range(in, 0, 3);
  if (fz_chance(in, 4)) c.num_threads = fz_chance(in, 128) ? -1 : 5000;
  return c;
}

/* Outputs of a call: tensors whose bytes must stay as they were unless
 * the call returns OK. The backends' copies are separate. */
#define FZ_MAX_OUTS 8
typedef struct {
  lmloss_tensor *t[FZ_MAX_OUTS];
  unsigned char *before[FZ_MAX_OUTS];
  size_t bytes[FZ_MAX_OUTS];
  int n;
} fz_outs;

static inline void fz_watch(fz_outs *o, fz_pool *pool, lmloss_tensor *t) {
  if (o->n == FZ_MAX_OUTS) abort();
  const size_t b = fz_span(t);
  o->t[o->n] = t;
  o->bytes[o->n] = b;
  o->before[o->n] = fz_alloc(pool, b);
  if (b) memset(t->data, 0x5a, b), memcpy(o->before[o->n], t->data, b);
  o->n++;
}

/* A copy of t (fresh memory, same bytes), for a second backend's outputs. */
static inline lmloss_tensor fz_clone(fz_pool *pool, const lmloss_tensor *t) {
  lmloss_tensor c = *t;
  const size_t b = fz_span(t);
  if (t->data && b) {
    c.data = fz_alloc(pool, b);
    memcpy(c.data, t->data, b);
  }
  return c;
}

static inline void fz_fail(const char *what, lmloss_status st) {
  fprintf(stderr, "fuzz: %s (status %d %s: %s)\n", what, (int)st, lmloss_status_string(st),
          lmloss_last_error());
  abort();
}

/* The checks every call passes: a known status; outputs untouched unless
 * OK. */
static inline void fz_check(lmloss_status st, const fz_outs *o, const char *call) {
  if ((int)st < LMLOSS_OK || (int)st > LMLOSS_ERR_OUT_OF_MEMORY) fz_fail(call, st);
  if (st != LMLOSS_OK) {
    if (!lmloss_last_error() || !*lmloss_last_error()) fz_fail("an error without a message", st);
    for (int i = 0; i < o->n; i++)
      if (o->bytes[i] && memcmp(o->t[i]->data, o->before[i], o->bytes[i]))
        fz_fail("an output was written on an error", st);
  }
}

/* CPU and REF agree on a call's status (REF runs neither the fused head
 * nor row states, and a backend out of host memory may say so alone). */
static inline void fz_agree(lmloss_status cpu, lmloss_status ref, const char *call) {
  if (cpu == ref || cpu == LMLOSS_ERR_OUT_OF_MEMORY || ref == LMLOSS_ERR_OUT_OF_MEMORY) return;
  fprintf(stderr, "fuzz: %s: CPU %s, REF %s\n", call, lmloss_status_string(cpu),
          lmloss_status_string(ref));
  abort();
}

/* Inputs whose fp32 results lmloss.h bounds to 1e-5 relative of the
 * float64 reference (docs/design.md, the accuracy contract): F32 logits,
 * finite and within +-1000, and a transform of moderate scale and
 * temperature. */
static inline int fz_tame(const lmloss_tensor *x, const lmloss_transform *t) {
  if (x->dtype != LMLOSS_F32 || !x->data || x->rows <= 0 || x->cols <= 0 || x->device) return 0;
  if (!(t->logit_scale >= 0.0625f && t->logit_scale <= 16.0f && t->temperature >= 0.0625f &&
        t->temperature <= 16.0f &&
        (t->softcap == 0.0f || (t->softcap >= 1.0f && t->softcap <= 1000.0f))))
    return 0;
  /* softcap's w is rounded to fp32 at the cap's magnitude, so an exponent
   * carries cap / T ulps of 1 from the input alone (design.md, section 8) */
  if (t->softcap > 0.0f && t->softcap / t->temperature > 8.0f) return 0;
  for (int64_t i = 0; i < x->rows; i++)
    for (int64_t j = 0; j < x->cols; j++) {
      const float v = ((const float *)x->data)[i * x->row_stride + j];
      if (!(fabsf(v) <= 1000.0f)) return 0;
    }
  return 1;
}

/* A differential check: every entry of got (F32) within 1e-5 |ref| of
 * REF's, the underflow floor FLT_MIN, NaN where REF has NaN. Results
 * that are sums of terms of one sign (losses, log-probs, entropies) have
 * no cancellation that would excuse more. */
static inline void fz_close(const lmloss_tensor *got, const lmloss_tensor *ref, const char *what) {
  if (!got->data || got->dtype != LMLOSS_F32) return;
  for (int64_t i = 0; i < got->rows; i++)
    for (int64_t j = 0; j < got->cols; j++) {
      const double g = ((const float *)got->data)[i * got->row_stride + j];
      const double r = ((const float *)ref->data)[i * ref->row_stride + j];
      if (isnan(r) ? isnan(g) : fabs(g - r) <= 1e-5 * fabs(r) + FLT_MIN || g == r) continue;
      fprintf(stderr, "fuzz: %s[%lld, %lld]: CPU %.9g, REF %.9g (rel %.3g)\n", what, (long long)i,
              (long long)j, g, r, fabs(g - r) / fabs(r));
      abort();
    }
}

#endif
