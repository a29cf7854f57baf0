/* rowpass.c - vectorized per-row passes; see rowpass.h. */
#include <string.h>

#include "math/dtype.h"
#include "rowpass.h"

/* One clone per ISA; the dynamic loader picks one through an ifunc. Never
 * -march=native: the shipped library runs on any x86-64. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LMLOSS_CPU_DISPATCH __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define LMLOSS_CPU_DISPATCH
#endif

const char *lmloss_cpu_isa_name(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (__builtin_cpu_supports("avx512f")) return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
#endif
  return "portable";
}

/* exp(hi + lo) for hi <= 0, 0 below the fp32 normal range (the underflow
 * floor). Cody-Waite reduction, degree-7 Taylor on |r| <= ln2/2 (error
 * 5e-9): pure arithmetic so every loop that calls it vectorizes. */
static inline float exp_neg(float hi, float lo) {
  const float magic = 12582912.0f;       /* 1.5 * 2^23: round to nearest */
  float h = hi > -100.0f ? hi : -100.0f; /* -inf and NaN stay convertible */
  float n = (h * 1.44269504088896341f + magic) - magic;
  float r = fmaf(n, -0.693145751953125f, h);
  r = fmaf(n, -1.428606765330187e-06f, r) + lo;
  float p = 1.0f / 5040.0f;
  p = fmaf(p, r, 1.0f / 720.0f);
  p = fmaf(p, r, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  int32_t ni = (int32_t)n;
  ni = ni < -126 ? -126 : ni;
  float scale = lmloss_bits_f32((uint32_t)(ni + 127) << 23);
  return hi < -87.33654f ? 0.0f : p * scale;
}

/* Convert n elements starting at j0 to fp32. */
static inline void load_x(const void *row, lmloss_dtype dt, int64_t j0, int n, float *buf) {
  if (dt == LMLOSS_F32) {
    memcpy(buf, (const float *)row + j0, (size_t)n * sizeof(float));
  } else if (dt == LMLOSS_BF16) {
    const uint16_t *h = (const uint16_t *)row + j0;
#pragma omp simd
    for (int i = 0; i < n; i++)
      buf[i] = lmloss_bf16_to_f32(h[i]);
  } else {
    const uint16_t *h = (const uint16_t *)row + j0;
#pragma omp simd
    for (int i = 0; i < n; i++)
      buf[i] = lmloss_f16_to_f32(h[i]);
  }
}

static inline void store_block(void *out, lmloss_dtype odt, int64_t j0, int n, const float *g) {
  if (odt == LMLOSS_F32) {
    memcpy((float *)out + j0, g, (size_t)n * sizeof(float));
  } else if (odt == LMLOSS_BF16) {
    uint16_t *h = (uint16_t *)out + j0;
#pragma omp simd
    for (int i = 0; i < n; i++)
      h[i] = lmloss_f32_to_bf16(g[i]);
  } else {
    uint16_t *h = (uint16_t *)out + j0;
#pragma omp simd
    for (int i = 0; i < n; i++)
      h[i] = lmloss_f32_to_f16(g[i]);
  }
}

/* The block's w values: the row itself for fp32 without softcap, else
 * converted (and softcapped) into buf. */
static inline const float *block_w(const void *row, lmloss_dtype dt, int64_t j0, int n,
                                   const lmloss_xform *f, float *buf) {
  if (dt == LMLOSS_F32 && f->cap == 0.0f) return (const float *)row + j0;
  load_x(row, dt, j0, n, buf);
  if (f->cap > 0.0f)
    for (int i = 0; i < n; i++)
      buf[i] = lmloss_xform_w(f, buf[i]);
  return buf;
}

/* The block's state relative to its max mb. Always inlined with constant
 * flags, so each call site is one branch-free vectorized loop. */
static inline __attribute__((always_inline)) void block_sums(const float *restrict buf, int n,
                                                             float mb, float k, const float *cw,
                                                             int need_t, int need_u,
                                                             lmloss_rowstat *b) {
  float r = 0.0f, t = 0.0f, u = 0.0f, c = 0.0f;
  int ties = 0;
#pragma omp simd reduction(+ : r, t, u, c, ties)
  for (int i = 0; i < n; i++) {
    float d = buf[i] - mb;
    float dk = d * k;
    float e = exp_neg(dk, fmaf(d, k, -dk));
    int tie = buf[i] == mb;
    e = tie ? 0.0f : e;
    ties += tie;
    r += e;
    if (need_t) t -= e * dk;
    if (need_u) {
      float cj = cw ? cw[i] : 1.0f;
      u -= cj * dk;
      c += cj;
    }
  }
  b->m = mb;
  b->r = r + (float)(ties - 1);
  b->t = t;
  b->u = u;
  b->c = c;
}

LMLOSS_CPU_DISPATCH
void lmloss_cpu_row_stats(const void *row, lmloss_dtype dt, int64_t V, const lmloss_xform *f,
                          const float *cw, int need_t, int need_u, lmloss_rowstat *st,
                          int *nonfinite) {
  float buf[LMLOSS_CPU_BLOCK];
  lmloss_rowstat s = lmloss_rowstat_empty();
  const float k = f->k;
  int bad = 0;
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    const float *w = block_w(row, dt, j0, n, f, buf);
    float mb = -INFINITY;
    int nans = 0;
#pragma omp simd reduction(max : mb) reduction(+ : nans)
    for (int i = 0; i < n; i++) {
      mb = w[i] > mb ? w[i] : mb;
      nans += w[i] != w[i];
    }
    if (nans || mb == INFINITY) bad = 1;
    if (bad || mb == -INFINITY) continue; /* an all -inf block adds nothing */
    const float *cwb = cw ? cw + j0 : NULL;
    lmloss_rowstat b;
    if (need_u && cwb)
      block_sums(w, n, mb, k, cwb, need_t, 1, &b);
    else if (need_u)
      block_sums(w, n, mb, k, NULL, need_t, 1, &b);
    else if (need_t)
      block_sums(w, n, mb, k, NULL, 1, 0, &b);
    else if (k == 1.0f) /* the common case: no compensation term needed */
      block_sums(w, n, mb, 1.0f, NULL, 0, 0, &b);
    else
      block_sums(w, n, mb, k, NULL, 0, 0, &b);
    b.a = j0;
    if (mb > s.m) /* only a new row max needs its exact first index */
      for (int i = 0; i < n; i++)
        if (w[i] == mb) {
          b.a = j0 + i;
          break;
        }
    s = lmloss_rowstat_merge(s, b, k);
  }
  *st = s;
  *nonfinite = bad;
}

static inline __attribute__((always_inline)) void
grad_block(float *buf, int n, float m, float k, const float *cw, float P, float P2, float Q) {
#pragma omp simd
  for (int i = 0; i < n; i++) {
    float d = buf[i] - m, dk = d * k;
    float e = exp_neg(dk, fmaf(d, k, -dk));
    float cj = cw ? cw[i] : 1.0f;
    buf[i] = (e * (P + P2 * dk) - Q * cj) * k;
  }
}

LMLOSS_CPU_DISPATCH
void lmloss_cpu_row_grad(const void *row, lmloss_dtype dt, int64_t V, const lmloss_xform *f,
                         const float *cw, float m, float P, float P2, float Q, void *out,
                         lmloss_dtype odt) {
  float buf[LMLOSS_CPU_BLOCK];
  const float k = f->k;
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    load_x(row, dt, j0, n, buf);
    if (f->cap > 0.0f) {
      for (int i = 0; i < n; i++) {
        float x = buf[i], w = lmloss_xform_w(f, x);
        float d = w - m, dk = d * k;
        float e = exp_neg(dk, fmaf(d, k, -dk));
        float cj = cw ? cw[j0 + i] : 1.0f;
        buf[i] = (e * (P + P2 * dk) - Q * cj) * lmloss_xform_dzdx(f, x);
      }
    } else {
      const float *cwb = cw ? cw + j0 : NULL;
      if (cwb)
        grad_block(buf, n, m, k, cwb, P, P2, Q);
      else
        grad_block(buf, n, m, k, NULL, P, P2, Q);
    }
    store_block(out, odt, j0, n, buf);
  }
}

LMLOSS_CPU_DISPATCH
void lmloss_cpu_row_softmax(const void *row, lmloss_dtype dt, int64_t V, float m, float P, int log,
                            void *out, lmloss_dtype odt) {
  float buf[LMLOSS_CPU_BLOCK];
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    load_x(row, dt, j0, n, buf);
    if (log) {
#pragma omp simd
      for (int i = 0; i < n; i++)
        buf[i] = (buf[i] - m) - P;
    } else {
#pragma omp simd
      for (int i = 0; i < n; i++)
        buf[i] = exp_neg(buf[i] - m, 0.0f) * P;
    }
    store_block(out, odt, j0, n, buf);
  }
}

void lmloss_cpu_row_fill(void *out, lmloss_dtype odt, int64_t V, float v) {
  float buf[LMLOSS_CPU_BLOCK];
  for (int i = 0; i < LMLOSS_CPU_BLOCK; i++)
    buf[i] = v;
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    store_block(out, odt, j0, n, buf);
  }
}
