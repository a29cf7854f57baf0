/* rowpass.c - vectorized per-row passes; see rowpass.h. */
#include <string.h>

#include "block.h"
#include "dispatch.h"
#include "math/dtype.h"
#include "math/vmath.h"
#include "rowpass.h"

const char *lmloss_cpu_isa_name(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (__builtin_cpu_supports("avx512f")) return "avx512";
  if (__builtin_cpu_supports("x86-64-v3")) return "avx2";
#endif
  return "portable";
}

/* The exponent (w - m) k; lo carries the product's rounding error (fma),
 * so a scale or temperature costs no accuracy. The subtraction's own
 * rounding is at most |w - m| 2^-24: 5e-6 relative on p at the bottom of
 * the normal range, inside the 1e-5 contract. */
static inline float exponent(float w, float m, float k, int unit_k, float *lo) {
  float d = w - m;
  if (unit_k) {
    *lo = -0.0f; /* x + -0 is x exactly: the compiler drops the add */
    return d;
  }
  float dk = d * k;
  *lo = fmaf(d, k, -dk);
  return dk;
}

/* w = softcap(x) of a block. Every pass forms w through this one loop, so
 * a w recomputed by a later pass has the same rounding as the statistics
 * saw. */
static inline void softcap_block(const lmloss_xform *f, int n, const float *x, float *w) {
  for (int i = 0; i < n; i++)
    w[i] = lmloss_xform_w(f, x[i]);
}

/* The block's w values: the row itself for fp32 without softcap, else
 * converted (and softcapped) into buf. Softcap maps +-inf to +-cap, so the
 * non-finite policy is read off the raw x first: *bad for NaN or +inf,
 * *all_ninf when every x is -inf. */
static inline const float *block_w(const void *row, lmloss_dtype dt, int64_t j0, int n,
                                   const lmloss_xform *f, float *buf, int *bad, int *all_ninf) {
  *bad = 0;
  *all_ninf = 0;
  if (dt == LMLOSS_F32 && f->cap == 0.0f) return (const float *)row + j0;
  lmloss_cpu_load_block(row, dt, j0, n, buf);
  if (f->cap > 0.0f) {
    int nans = 0, pinf = 0, ninf = 0;
#pragma omp simd reduction(+ : nans, pinf, ninf)
    for (int i = 0; i < n; i++) {
      nans += buf[i] != buf[i];
      pinf += buf[i] == INFINITY;
      ninf += buf[i] == -INFINITY;
    }
    *bad = nans || pinf;
    *all_ninf = ninf == n;
    softcap_block(f, n, buf, buf);
  }
  return buf;
}

/* Sums of a block relative to a max m: with `careful`, m is the block's
 * own max and the ties with it are left out of r and counted (the block's
 * state for a merge); otherwise m is the row's running max from an earlier
 * block, so every element here is "j != a" and simply adds (a tie adds its
 * exp(0) = 1), and the loop also returns the block's max so the caller can
 * check the assumption. Always inlined with constant flags: one
 * branch-free loop per call site (vectorized in the AVX-512 and x86-64-v3 clones). */
static inline __attribute__((always_inline)) void
block_sums(const float *restrict buf, int n, float m, float k, int unit_k, const float *cw,
           int need_t, int need_u, int careful, lmloss_rowstat *b, float *mb_out, int *nans) {
  /* careful: r in runs of 256 added in double. Where this loop is not
   * vectorized (the portable clone: no FMA; the x86-64-v3 one before
   * -fno-trapping-math) r is one running float sum, and a peaked row's
   * 1002 equal terms came out 1.2e-5 high (AVX2 EPYC, tests/python
   * test_collapse_margin_30). The careful block is a row's first and any
   * that raises its max; the common one keeps its single run. */
  const int run = careful ? 256 : n;
  float t = 0.0f, u = 0.0f, c = 0.0f, mb = -INFINITY;
  double rd = 0.0;
  int ties = 0, nn = 0;
  for (int i0 = 0; i0 < n; i0 += run) {
    const int i1 = n - i0 < run ? n : i0 + run;
    float r = 0.0f;
#pragma omp simd reduction(+ : r, t, u, c, ties, nn) reduction(max : mb)
    for (int i = i0; i < i1; i++) {
      float lo, dk = exponent(buf[i], m, k, unit_k, &lo);
      float e = lmloss_vexp_neg(dk, lo);
      if (careful) {
        int tie = buf[i] == m;
        e = tie ? 0.0f : e;
        ties += tie;
      } else {
        mb = buf[i] > mb ? buf[i] : mb;
        nn += buf[i] != buf[i];
      }
      r += e;
      if (need_t) t -= e > 0.0f ? e * dk : 0.0f; /* -inf entries add 0, not NaN */
      if (need_u) {
        float cj = cw ? cw[i] : 1.0f;
        u -= cj * dk;
        c += cj;
      }
    }
    rd += r;
  }
  b->m = m;
  b->r = careful ? (float)(rd + (ties - 1)) : (float)rd;
  b->t = t;
  b->u = u;
  b->c = c;
  if (!careful) *mb_out = mb, *nans = nn;
}

/* One call per option set, so each loop is compiled without the others'
 * branches. */
static inline __attribute__((always_inline)) void
block_sums_for(const float *restrict w, int n, float m, float k, const float *cwb, int need_t,
               int need_u, int careful, lmloss_rowstat *b, float *mb, int *nans) {
  if (need_u && cwb)
    block_sums(w, n, m, k, 0, cwb, need_t, 1, careful, b, mb, nans);
  else if (need_u)
    block_sums(w, n, m, k, 0, NULL, need_t, 1, careful, b, mb, nans);
  else if (need_t)
    block_sums(w, n, m, k, 0, NULL, 1, 0, careful, b, mb, nans);
  else if (k == 1.0f) /* the common case */
    block_sums(w, n, m, 1.0f, 1, NULL, 0, 0, careful, b, mb, nans);
  else
    block_sums(w, n, m, k, 0, NULL, 0, 0, careful, b, mb, nans);
}

LMLOSS_CPU_DISPATCH
lmloss_rowstate lmloss_cpu_row_state(const void *row, lmloss_dtype dt, int64_t V, int64_t col0,
                                     const lmloss_xform *f, const float *cw, int need_t, int need_u,
                                     int64_t label) {
  float buf[LMLOSS_CPU_BLOCK];
  lmloss_rowstat s = lmloss_rowstat_empty();
  const float k = f->k;
  int bad = 0, logit = 0;
  float ninf_u = 0.0f, ninf_c = 0.0f; /* all -inf blocks' smoothing sums */
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    int raw_bad, all_ninf;
    const float *w = block_w(row, dt, j0, n, f, buf, &raw_bad, &all_ninf);
    if (raw_bad) bad = 1;
    if (!all_ninf) logit = 1;
    const float *cwb = cw ? cw + j0 : NULL;
    lmloss_rowstat b;
    float mb;
    int nans;
    if (s.a >= 0 && !bad) { /* the common block: below the running max */
      block_sums_for(w, n, s.m, k, cwb, need_t, need_u, 0, &b, &mb, &nans);
      if (nans || mb == INFINITY) {
        bad = 1;
        continue;
      }
      if (mb <= s.m) {
        s.r += b.r, s.t += b.t, s.u += b.u, s.c += b.c;
        continue;
      }
    }
    mb = -INFINITY;
    nans = 0;
#pragma omp simd reduction(max : mb) reduction(+ : nans)
    for (int i = 0; i < n; i++) {
      mb = w[i] > mb ? w[i] : mb;
      nans += w[i] != w[i];
    }
    if (nans || mb == INFINITY) bad = 1;
    if (mb == -INFINITY && need_u) /* no max, but an infinite gap under smoothing */
      for (int i = 0; i < n; i++) {
        const float cj = cwb ? cwb[i] : 1.0f;
        ninf_u += cj * INFINITY, ninf_c += cj;
      }
    if (bad || mb == -INFINITY) continue;
    block_sums_for(w, n, mb, k, cwb, need_t, need_u, 1, &b, NULL, NULL);
    b.a = j0;
    if (mb > s.m) /* only a new row max needs its exact first index */
      for (int i = 0; i < n; i++)
        if (w[i] == mb) {
          b.a = j0 + i;
          break;
        }
    s = lmloss_rowstat_merge(s, b, k);
  }
  lmloss_rowstate st = lmloss_rowstate_empty();
  st.s = s;
  st.s.u += ninf_u, st.s.c += ninf_c;
  if (s.a >= 0) st.s.a += col0;
  /* Without softcap every -inf adds nothing, so the state is empty unless
   * the row holds a logit above -inf. */
  if (f->cap == 0.0f) logit = s.a >= 0;
  st.flags = (bad ? LMLOSS_STATE_NONFINITE : 0) | (logit ? LMLOSS_STATE_LOGIT : 0);
  if (label >= col0 && label < col0 + V) {
    st.wy = lmloss_xform_w(f, lmloss_load(row, dt, label - col0));
    st.flags |= LMLOSS_STATE_LABEL;
  }
  return st;
}

/* dst_j = (e_j (P + P2 dk_j) - Q c_j) k from a block's w values (dst may
 * be src: element for element). Always inlined with constant flags (no P2
 * term: cross-entropy; no Q: no label smoothing; k = 1), so the common
 * loops carry no dead work. */
static inline __attribute__((always_inline)) void grad_block(const float *src, float *dst, int n,
                                                             float m, float k, int unit_k,
                                                             const float *cw, float P, float P2,
                                                             float Q, int has_p2, int has_q) {
  const float Pk = P * k, P2k = P2 * k, Qk = Q * k;
#pragma omp simd
  for (int i = 0; i < n; i++) {
    float lo, dk = exponent(src[i], m, k, unit_k, &lo);
    float e = lmloss_vexp_neg(dk, lo);
    float g = has_p2 ? (e > 0.0f ? e * (Pk + P2k * dk) : 0.0f) : e * Pk;
    if (has_q) g -= Qk * (cw ? cw[i] : 1.0f);
    dst[i] = g;
  }
}

LMLOSS_CPU_DISPATCH
void lmloss_cpu_row_grad(const void *row, lmloss_dtype dt, int64_t V, const lmloss_xform *f,
                         const float *cw, float m, float P, float P2, float Q, void *out,
                         lmloss_dtype odt) {
  float buf[LMLOSS_CPU_BLOCK], wbuf[LMLOSS_CPU_BLOCK];
  const float k = f->k;
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    if (f->cap > 0.0f) {
      lmloss_cpu_load_block(row, dt, j0, n, buf);
      softcap_block(f, n, buf, wbuf);
      for (int i = 0; i < n; i++) {
        float x = buf[i], w = wbuf[i];
        float lo, dk = exponent(w, m, k, 0, &lo);
        float e = lmloss_vexp_neg(dk, lo);
        float cj = cw ? cw[j0 + i] : 1.0f;
        buf[i] = ((e > 0.0f ? e * (P + P2 * dk) : 0.0f) - Q * cj) * lmloss_xform_dzdx(f, x);
      }
    } else {
      /* fp32 in and out: straight from the row to the output (in place
       * too: element for element), no copies through buf */
      const int direct = dt == LMLOSS_F32 && odt == LMLOSS_F32;
      const float *src = direct ? (const float *)row + j0 : buf;
      float *dst = direct ? (float *)out + j0 : buf;
      if (!direct) lmloss_cpu_load_block(row, dt, j0, n, buf);
      const float *cwb = cw ? cw + j0 : NULL;
      if (P2 != 0.0f)
        grad_block(src, dst, n, m, k, 0, NULL, P, P2, Q, 1, 0); /* log-probs: Q is 0 */
      else if (Q != 0.0f && cwb)
        grad_block(src, dst, n, m, k, 0, cwb, P, 0.0f, Q, 0, 1);
      else if (Q != 0.0f) /* a constant NULL: no masked loads at address 0 */
        grad_block(src, dst, n, m, k, 0, NULL, P, 0.0f, Q, 0, 1);
      else if (k == 1.0f)
        grad_block(src, dst, n, m, 1.0f, 1, NULL, P, 0.0f, 0.0f, 0, 0);
      else
        grad_block(src, dst, n, m, k, 0, NULL, P, 0.0f, 0.0f, 0, 0);
      if (direct) continue;
    }
    lmloss_cpu_store_block(out, odt, j0, n, buf);
  }
}

LMLOSS_CPU_DISPATCH
void lmloss_cpu_row_softmax(const void *row, lmloss_dtype dt, int64_t V, float m, float P, int log,
                            void *out, lmloss_dtype odt) {
  float buf[LMLOSS_CPU_BLOCK];
  const int direct = dt == LMLOSS_F32 && odt == LMLOSS_F32; /* as in lmloss_cpu_row_grad */
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    const float *src = direct ? (const float *)row + j0 : buf;
    float *dst = direct ? (float *)out + j0 : buf;
    if (!direct) lmloss_cpu_load_block(row, dt, j0, n, buf);
    if (log) {
#pragma omp simd
      for (int i = 0; i < n; i++)
        dst[i] = (src[i] - m) - P;
    } else {
#pragma omp simd
      for (int i = 0; i < n; i++) {
        float lo, d = exponent(src[i], m, 1.0f, 1, &lo);
        dst[i] = lmloss_vexp_neg(d, lo) * P;
      }
    }
    if (!direct) lmloss_cpu_store_block(out, odt, j0, n, buf);
  }
}

/* A block of a row as fp32: in place, or converted into buf. */
static inline const float *block_f32(const void *row, lmloss_dtype dt, int64_t j0, int n,
                                     float *buf) {
  if (dt == LMLOSS_F32) return (const float *)row + j0;
  lmloss_cpu_load_block(row, dt, j0, n, buf);
  return buf;
}

LMLOSS_CPU_DISPATCH
int64_t lmloss_cpu_row_argmax(const void *row, lmloss_dtype dt, int64_t V) {
  float buf[LMLOSS_CPU_BLOCK], mx = -INFINITY;
  int64_t at = 0;
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    const int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    const float *v = block_f32(row, dt, j0, n, buf);
    float bm;
    const int first = lmloss_cpu_first_max(v, n, &bm);
    if (bm > mx) mx = bm, at = j0 + first; /* else an earlier block holds the first max */
  }
  return at;
}

LMLOSS_CPU_DISPATCH
double lmloss_cpu_row_softmax_bwd_sum(const void *y, lmloss_dtype ydt, const void *dy,
                                      lmloss_dtype gdt, int64_t V, int64_t a, float s, int log,
                                      double *sy) {
  float ybuf[LMLOSS_CPU_BLOCK], gbuf[LMLOSS_CPU_BLOCK];
  double sum = 0.0, ys = 0.0;
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    const int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    const int ab = a >= j0 && a < j0 + n ? (int)(a - j0) : -1;
    const float *g = block_f32(dy, gdt, j0, n, gbuf);
    if (log) {
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < n; i++)
        sum += i == ab ? 0.0f : g[i];
    } else {
      const float *v = block_f32(y, ydt, j0, n, ybuf);
#pragma omp simd reduction(+ : sum, ys)
      for (int i = 0; i < n; i++) {
        sum += i == ab ? 0.0f : v[i] * (s - g[i]);
        ys += i == ab ? 0.0f : v[i];
      }
    }
  }
  if (sy) *sy = ys;
  return sum;
}

LMLOSS_CPU_DISPATCH
void lmloss_cpu_row_softmax_bwd(const void *y, lmloss_dtype ydt, const void *dy, lmloss_dtype gdt,
                                int64_t V, float s, float c, int log, void *dx, lmloss_dtype odt) {
  float ybuf[LMLOSS_CPU_BLOCK], gbuf[LMLOSS_CPU_BLOCK], obuf[LMLOSS_CPU_BLOCK];
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    const int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    const float *restrict v = block_f32(y, ydt, j0, n, ybuf);
    const float *g = block_f32(dy, gdt, j0, n, gbuf);
    /* an fp32 dx is written in place: element for element, so dx may be dy */
    float *o = odt == LMLOSS_F32 ? (float *)dx + j0 : obuf;
    if (log) {
#pragma omp simd
      for (int i = 0; i < n; i++) /* a NaN y stays NaN (vmath's exp takes it as -104) */
        o[i] = g[i] - (v[i] == v[i] ? lmloss_vexp_neg(v[i], -0.0f) : v[i]) * c;
    } else {
#pragma omp simd
      for (int i = 0; i < n; i++)
        o[i] = v[i] * ((g[i] - s) + c);
    }
    if (odt != LMLOSS_F32) lmloss_cpu_store_block(dx, odt, j0, n, obuf);
  }
}

void lmloss_cpu_row_fill(void *out, lmloss_dtype odt, int64_t V, float v) {
  float buf[LMLOSS_CPU_BLOCK];
  for (int i = 0; i < LMLOSS_CPU_BLOCK; i++)
    buf[i] = v;
  for (int64_t j0 = 0; j0 < V; j0 += LMLOSS_CPU_BLOCK) {
    int n = (int)(V - j0 < LMLOSS_CPU_BLOCK ? V - j0 : LMLOSS_CPU_BLOCK);
    lmloss_cpu_store_block(out, odt, j0, n, buf);
  }
}
