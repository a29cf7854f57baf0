/*
 * divergence.cu - KL, reverse KL, generalized JSD and TVD between a
 * student's and a teacher's rows on CUDA, with the student's
 * cross-entropy as a hard term: the CPU's sweeps (cpu/divergence.c), each
 * column by the same formulas (math/divergence.h, math/vmath.h).
 *
 * One row pair a CTA, read once per sweep: the maxes and argmaxes, the
 * sums R and D below them, the loss sweep (with the forward KL's
 * gradient), and the other kinds' gradient. A row split over a cluster
 * of CTAs paid a cluster barrier and exchange a sweep, which cost more
 * than its rows' L2 hits saved (docs/design.md). Each sweep's sums are
 * merged in a fixed order, so the results are bitwise reproducible.
 *
 * Launch sequence on the caller's stream, nothing allocated:
 *   [div_count]    MEAN: the rows not ignored, into the workspace header;
 *   div_rows       per row pair: outputs, row losses, gradient;
 *   [div_finalize] reduced losses: a fixed-order sum of the row losses.
 * Workspace (lmloss_cross_entropy_workspace_size): header [0] the count
 * (double), then the row losses [N] (double). A label outside [0, V) that
 * is not ignore_index gives NaN for its row.
 */
#include "common.cuh"
#include "math/divstate.h"

namespace lmc {

constexpr int DIV_NV = 8;   /* columns a thread takes at a time */
constexpr int DIV_BS = 512; /* threads of a CTA, two an SM */
constexpr int DIV_WARPS = DIV_BS / 32;

struct DivArgs {
  const void *s, *t;
  lmloss_dtype sdt, tdt;
  int64_t ss, ts; /* row strides, elements */
  int64_t N, V;
  const void *label;
  int label64;
  int64_t ls;
  long long ignore;
  lmloss_div_pair pr;
  int mode; /* LMLOSS_DIV_SHARED_CAP | LMLOSS_DIV_STUDENT_CAP */
  float soft, hard;
  int reduction;
  double num_items;
  float grad_output;
  const float *dloss; /* backward */
  int64_t dls;
  void *dx; /* the gradient: NULL for none */
  lmloss_dtype dxt;
  int64_t dxs;
  float *loss, *div, *ce, *ent; /* outputs (NONE: loss [N]) */
  int64_t los, dvs, ces, ens;
  double *count, *row_loss; /* workspace */
};

/* Eight columns of a row from j (16-byte loads where the row allows),
 * as floats; columns at or past V read 0 (the sweeps mask them). */
__device__ __forceinline__ void load8(const void *row, lmloss_dtype dt, int64_t j, int64_t V,
                                      float *x) {
  const bool whole = j + DIV_NV <= V;
  if (dt == LMLOSS_F32) {
    const float *p = (const float *)row + j;
    if (whole && is_aligned16(p)) {
      const float4 a = __ldcg((const float4 *)p), b = __ldcg((const float4 *)p + 1);
      x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z,
      x[7] = b.w;
      return;
    }
#pragma unroll
    for (int e = 0; e < DIV_NV; e++)
      x[e] = j + e < V ? p[e] : 0.0f;
    return;
  }
  const uint16_t *p = (const uint16_t *)row + j;
  uint32_t h[DIV_NV / 2]; /* the columns in pairs, the lower one in the low half */
  if (whole && is_aligned16(p)) {
    const uint4 u = __ldcg((const uint4 *)p);
    memcpy(h, &u, sizeof h);
  } else {
#pragma unroll
    for (int e = 0; e < DIV_NV; e += 2)
      h[e / 2] = (j + e < V ? p[e] : 0u) | (j + e + 1 < V ? (uint32_t)p[e + 1] << 16 : 0u);
  }
  /* one branch a vector, and bf16 widened by a shift or a mask: a select
   * between the two conversions a column cost three instructions */
  if (dt == LMLOSS_BF16) {
#pragma unroll
    for (int e = 0; e < DIV_NV / 2; e++)
      x[2 * e] = __uint_as_float(h[e] << 16), x[2 * e + 1] = __uint_as_float(h[e] & 0xffff0000u);
    return;
  }
#pragma unroll
  for (int e = 0; e < DIV_NV / 2; e++) {
    __half2 v;
    memcpy(&v, &h[e], sizeof v);
    const float2 f = __half22float2(v);
    x[2 * e] = f.x, x[2 * e + 1] = f.y;
  }
}

__device__ __forceinline__ void store8(void *row, lmloss_dtype dt, int64_t j, int64_t V,
                                       const float *g) {
  const bool whole = j + DIV_NV <= V;
  if (dt == LMLOSS_F32) {
    float *p = (float *)row + j;
    if (whole && is_aligned16(p)) {
      ((float4 *)p)[0] = make_float4(g[0], g[1], g[2], g[3]);
      ((float4 *)p)[1] = make_float4(g[4], g[5], g[6], g[7]);
      return;
    }
#pragma unroll
    for (int e = 0; e < DIV_NV; e++)
      if (j + e < V) p[e] = g[e];
    return;
  }
  uint16_t h[DIV_NV];
#pragma unroll
  for (int e = 0; e < DIV_NV; e++)
    h[e] = dt == LMLOSS_BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(g[e]))
                             : __half_as_ushort(__float2half_rn(g[e]));
  uint16_t *p = (uint16_t *)row + j;
  if (whole && is_aligned16(p)) {
    uint4 u;
    memcpy(&u, h, sizeof h);
    *(uint4 *)p = u;
    return;
  }
#pragma unroll
  for (int e = 0; e < DIV_NV; e++)
    if (j + e < V) p[e] = h[e];
}

/* A row's max of w, its first column (a = LLONG_MAX: none yet), and the
 * raw logits of both rows there (x of its own row, o of the other), read
 * with it so that no CTA loads them again after the merge. */
struct MaxAt {
  float m;
  long long a;
  float x, o;
};
__device__ __forceinline__ MaxAt max_at(MaxAt x, MaxAt y) {
  return y.m > x.m || (y.m == x.m && y.a < x.a) ? y : x;
}
__device__ __forceinline__ MaxAt shfl_max_at(MaxAt x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    MaxAt y;
    y.m = __shfl_down_sync(0xffffffffu, x.m, off);
    y.a = __shfl_down_sync(0xffffffffu, x.a, off);
    y.x = __shfl_down_sync(0xffffffffu, x.x, off);
    y.o = __shfl_down_sync(0xffffffffu, x.o, off);
    x = max_at(x, y);
  }
  return x;
}

/* What the first sweep finds: both rows' maxes, and the row's flags
 * (a NaN or +inf logit; any finite logit on each side). */
struct Extent {
  MaxAt s, t;
  int bad, any_s, any_t;
};

/* What a CTA's warps share: their Extents and sums, and the CTA's. */
struct DivShared {
  Extent ext, ext_cta[DIV_WARPS];
  double sums[DIV_WARPS][7], tot[7];
};

/* This CTA's Extent from its threads' (every thread gets it). */
__device__ Extent cta_extent(Extent e, DivShared &sh) {
  e.s = shfl_max_at(e.s), e.t = shfl_max_at(e.t);
  e.bad = __any_sync(0xffffffffu, e.bad), e.any_s = __any_sync(0xffffffffu, e.any_s);
  e.any_t = __any_sync(0xffffffffu, e.any_t);
  const int w = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) sh.ext_cta[w] = e;
  __syncthreads();
  if (threadIdx.x == 0) {
    Extent r = sh.ext_cta[0];
    for (int i = 1; i < DIV_WARPS; i++) {
      const Extent &x = sh.ext_cta[i];
      r.s = max_at(r.s, x.s), r.t = max_at(r.t, x.t);
      r.bad |= x.bad, r.any_s |= x.any_s, r.any_t |= x.any_t;
    }
    sh.ext = r;
  }
  __syncthreads();
  return sh.ext;
}

/* K sums of a row's columns. */
template <int K> struct Sums { double v[K]; };

/* A vector's float sums added to a thread's doubles: a thread sums about
 * V / 4096 vectors, too many terms for fp32 lanes to keep the loss to
 * its 1e-5; only the slots its kind uses (used(k)), so the others cost
 * no double add. */
template <int K, typename U>
__device__ __forceinline__ void add_vector(double (&acc)[K], const float (&v)[K], U used) {
#pragma unroll
  for (int k = 0; k < K; k++)
    if (used(k)) acc[k] += v[k];
}

/* This CTA's sums of K per-thread doubles, the same in every thread. */
template <int K> __device__ Sums<K> cta_sums(const double (&v)[K], DivShared &sh) {
  const int w = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < K; k++) {
    double x = v[k];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      x += __shfl_down_sync(0xffffffffu, x, off);
    if ((threadIdx.x & 31) == 0) sh.sums[w][k] = x;
  }
  __syncthreads();
  if (threadIdx.x < K) {
    double s = 0.0;
    for (int i = 0; i < DIV_WARPS; i++)
      s += sh.sums[i][threadIdx.x];
    sh.tot[threadIdx.x] = s;
  }
  __syncthreads();
  Sums<K> r;
#pragma unroll
  for (int k = 0; k < K; k++)
    r.v[k] = sh.tot[k];
  return r;
}

/* w of a raw logit: a softcap's tanh only in the general kernels
 * (GENERAL), so the plain ones carry no tanh, sinh or cosh. */
template <bool GENERAL> __device__ __forceinline__ float w_of(const lmloss_xform *f, float x) {
  return GENERAL ? lmloss_xform_w(f, x) : x;
}

/* The vectors of a sweep: fn(j, xs, xt, left) for each eight columns from
 * j of the row, both rows' raw logits (0 at or past V), left = V - j of
 * them in the row (8 or more: all). */
template <typename F>
__device__ __forceinline__ void for_vectors(const DivArgs &a, const void *rs, const void *rt,
                                            F fn) {
  const int64_t V = a.V;
  for (int64_t j = (int64_t)threadIdx.x * DIV_NV; j < V; j += (int64_t)DIV_BS * DIV_NV) {
    float xs[DIV_NV], xt[DIV_NV];
    load8(rs, a.sdt, j, V, xs);
    load8(rt, a.tdt, j, V, xt);
    fn(j, xs, xt, (int)(V - j < DIV_NV ? V - j : DIV_NV));
  }
}

/* Whether a copy of a sweep's column code tests the columns' indices. */
template <bool B> struct Tested { static constexpr bool on = B; };

/* fn(e, check) for the columns e < left of a vector: a whole vector
 * without a marked column (an argmax, the label: marked) in a copy that
 * tests no column (check.on false), the others in one that does. */
template <typename F> __device__ __forceinline__ void for_each(int left, bool marked, F fn) {
  if (left == DIV_NV && !marked) {
#pragma unroll
    for (int e = 0; e < DIV_NV; e++)
      fn(e, Tested<false>());
  } else {
#pragma unroll
    for (int e = 0; e < DIV_NV; e++)
      if (e < left) fn(e, Tested<true>());
  }
}

/* Whether column c lies in the vector from j. */
__device__ __forceinline__ bool in_vector(int64_t c, int64_t j) {
  return (uint64_t)(c - j) < (uint64_t)DIV_NV;
}

/* The first of a vector's columns (from j, left of them in the row)
 * where w of its own raw logits x is m, with both rows' logits there (o:
 * the other row's). */
template <bool GENERAL>
__device__ __forceinline__ MaxAt first_in(const lmloss_xform *f, const float *x, const float *o,
                                          int64_t j, int left, float m) {
  MaxAt r = {m, LLONG_MAX, 0.0f, 0.0f};
#pragma unroll
  for (int e = DIV_NV - 1; e >= 0; e--)
    if (e < left && w_of<GENERAL>(f, x[e]) == m) r.a = j + e, r.x = x[e], r.o = o[e];
  return r;
}

/* One row pair per CTA, of the kind K; GENERAL: a softcap on either
 * side or a k of each (the transforms' modes then read at run time), else
 * one k and no softcap (LMLOSS_DIV_ONE_K). */
template <int K, bool GENERAL> __global__ void __launch_bounds__(DIV_BS, 2) div_rows(DivArgs a) {
  __shared__ DivShared sh;
  const int64_t i = blockIdx.x;
  const void *rs = (const char *)a.s + i * a.ss * (int64_t)lmloss_dtype_size(a.sdt);
  const void *rt = (const char *)a.t + i * a.ts * (int64_t)lmloss_dtype_size(a.tdt);
  void *rd = a.dx ? (char *)a.dx + i * a.dxs * (int64_t)lmloss_dtype_size(a.dxt) : nullptr;
  const bool lead = threadIdx.x == 0;
  /* the label: y = -1 without; an ignored row; one outside [0, V) */
  long long y = -1;
  bool ignored = false, bad_label = false;
  if (a.label) {
    const long long l = ld_index(a.label, a.label64, i * a.ls);
    ignored = l == a.ignore;
    bad_label = !ignored && (l < 0 || l >= a.V);
    y = ignored || bad_label ? -1 : l;
  }
  /* the row's scale: the upstream gradient through the reduction */
  double factor = 1.0;
  if (a.reduction == LMLOSS_REDUCE_MEAN) factor = *a.count > 0.0 ? 1.0 / *a.count : 0.0;
  if (a.reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) factor = 1.0 / a.num_items;
  const float up =
      a.dloss ? a.dloss[a.reduction == LMLOSS_REDUCE_NONE ? i * a.dls : 0] : a.grad_output;
  auto finish = [&](double div, double ce, double ent) {
    if (!lead) return;
    const double li = ignored ? 0.0 : a.soft * div + a.hard * ce;
    if (a.div) a.div[i * a.dvs] = (float)div;
    if (a.ce) a.ce[i * a.ces] = (float)ce;
    if (a.ent) a.ent[i * a.ens] = (float)ent;
    if (a.loss && a.reduction == LMLOSS_REDUCE_NONE) a.loss[i * a.los] = (float)li;
    a.row_loss[i] = li;
  };
  auto fill = [&](float v) {
    if (!rd) return;
    float g[DIV_NV];
#pragma unroll
    for (int e = 0; e < DIV_NV; e++)
      g[e] = v;
    for (int64_t j = (int64_t)threadIdx.x * DIV_NV; j < a.V; j += (int64_t)DIV_BS * DIV_NV)
      store8(rd, a.dxt, j, a.V, g);
  };
  if (ignored) {
    fill(0.0f);
    finish(0.0, 0.0, 0.0);
    return;
  }
  const int mode = GENERAL ? a.mode : LMLOSS_DIV_ONE_K;
  /* 1. the maxes and first argmaxes of w. A NaN or +inf logit: the flags
   * with a softcap (which bounds w); without, +inf is the max and a NaN
   * makes sweep 2's sums NaN, which costs the plain sweeps nothing. */
  /* the label's logit, read before any thread writes a gradient over
   * the student, its load in flight during the sweep */
  const float xs_y = y >= 0 ? lmloss_load(rs, a.sdt, y) : 0.0f;
  Extent e = {{-INFINITY, LLONG_MAX, 0.0f, 0.0f}, {-INFINITY, LLONG_MAX, 0.0f, 0.0f}, 0, 0, 0};
  for_vectors(a, rs, rt, [&](int64_t j, const float *xs, const float *xt, int left) {
    float vs = -INFINITY, vt = -INFINITY;
    for_each(left, false, [&](int k, auto) {
      if (GENERAL) {
        e.bad |= (xs[k] != xs[k]) | (xs[k] == INFINITY) | (xt[k] != xt[k]) | (xt[k] == INFINITY);
        e.any_s |= xs[k] > -INFINITY, e.any_t |= xt[k] > -INFINITY;
      }
      vs = fmaxf(vs, w_of<GENERAL>(&a.pr.fs, xs[k])),
      vt = fmaxf(vt, w_of<GENERAL>(&a.pr.ft, xt[k]));
    });
    /* a thread's max rises about ln n times in its n vectors: the argmax
     * is looked for then, in the registers, not read again after */
    if (vs > e.s.m) e.s = first_in<GENERAL>(&a.pr.fs, xs, xt, j, left, vs);
    if (vt > e.t.m) e.t = first_in<GENERAL>(&a.pr.ft, xt, xs, j, left, vt);
  });
  e = cta_extent(e, sh);
  if (!GENERAL) {
    e.bad = e.s.m == INFINITY || e.t.m == INFINITY;
    e.any_s = e.s.m > -INFINITY, e.any_t = e.t.m > -INFINITY;
  }
  auto fail = [&]() {
    fill(NAN);
    finish(NAN, NAN, NAN);
  };
  if (e.bad || !e.any_s || !e.any_t || bad_label) return fail();
  const float ms = e.s.m, mt = e.t.m, ks = a.pr.fs.k;
  const long long as = e.s.a, at = e.t.a;
  const float xs_a = e.s.x, xt_at = e.t.x, xt_as = e.s.o;
  const float G = lmloss_div_gap(&a.pr, a.pr.capped, mt, xt_at, ms, xs_a);
  /* 2. R of each row and D = Rt - Rs below the maxes */
  double b3[3] = {0.0, 0.0, 0.0};
  for_vectors(a, rs, rt, [&](int64_t j, const float *xs, const float *xt, int left) {
    float v[3] = {0.0f, 0.0f, 0.0f};
    for_each(left, in_vector(as, j) || in_vector(at, j), [&](int k, auto check) {
      float es, et, d;
      lmloss_div_stats_terms(&a.pr, mode, w_of<GENERAL>(&a.pr.fs, xs[k]),
                             w_of<GENERAL>(&a.pr.ft, xt[k]), xs[k], xt[k], ms, mt, G, &es, &et, &d);
      v[0] += check.on && j + k == as ? 0.0f : es;
      v[1] += check.on && j + k == at ? 0.0f : et;
      v[2] += d;
    });
    add_vector(b3, v, [](int) { return true; });
  });
  const Sums<3> st = cta_sums<3>(b3, sh);
  if (!GENERAL && !(isfinite(st.v[0]) && isfinite(st.v[1]) && isfinite(st.v[2]))) return fail();
  const lmloss_div_row r = lmloss_div_row_make(&a.pr, ms, mt, (float)st.v[0], (float)st.v[1],
                                               (float)st.v[2], as, xs_a, xt_at, xt_as);
  lmloss_div_grad gc = {};
  gc.y = y, gc.soft = a.soft, gc.scale = (float)(up * factor);
  gc.hard = y >= 0 ? a.hard : 0.0f;
  gc.one_minus_py = y == as ? r.rs / (1.0f + r.rs) : -1.0f;
  auto column = [&](const float *xs, const float *xt, int k) {
    return lmloss_div_column(&a.pr, &r, mode, w_of<GENERAL>(&a.pr.fs, xs[k]),
                             w_of<GENERAL>(&a.pr.ft, xt[k]), xs[k], xt[k]);
  };
  /* 3. the loss sweep, with the forward KL's gradient; each kind sums
   * only what it reads, the entropy only when asked for */
  const bool fused = rd && K == LMLOSS_DIV_KL, want_ent = a.ent != nullptr;
  /* the slots of c7 a kind sums: the divergence, rev, mix, pos, neg, eq
   * (lmloss_div_terms), the entropy */
  const auto used = [want_ent](int k) {
    return k == 0 || (k == 1 && K == LMLOSS_DIV_REVERSE_KL) || (k == 2 && K == LMLOSS_DIV_JSD) ||
           (k >= 3 && k <= 5 && K == LMLOSS_DIV_TVD) || (k == 6 && want_ent);
  };
  double c7[7] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  for_vectors(a, rs, rt, [&](int64_t j, const float *xs, const float *xt, int left) {
    float g[DIV_NV], v[7] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for_each(left, in_vector(as, j) || in_vector(y, j), [&](int k, auto check) {
      const lmloss_div_col c = column(xs, xt, k);
      const lmloss_div_terms t =
          lmloss_div_loss_terms(&a.pr, &r, &c, !(check.on && j + k == as) && c.p != 0.0f, K);
      v[0] += t.div, v[1] += t.rev, v[2] += t.mix;
      v[3] += t.pos, v[4] += t.neg, v[5] += t.eq, v[6] += t.ent;
      if (fused)
        g[k] = lmloss_div_grad_tail(&a.pr, &gc, check.on && j + k == y, c.p, t.h, xs[k], mode);
    });
    add_vector(c7, v, used);
    if (fused) store8(rd, a.dxt, j, a.V, g);
  });
  const Sums<7> lo = cta_sums<7>(c7, sh);
  float es_y = 0.0f;
  if (y >= 0) es_y = y == as ? 0.0f : (w_of<GENERAL>(&a.pr.fs, xs_y) - ms) * ks;
  finish(lo.v[0], y >= 0 ? (double)r.l1s - es_y : 0.0, lo.v[6]);
  /* 4. the other kinds' gradient */
  if (rd && !fused) {
    lmloss_div_grad_sums(&gc, lo.v[1], lo.v[2], lo.v[3], lo.v[4], lo.v[5]);
    for_vectors(a, rs, rt, [&](int64_t j, const float *xs, const float *xt, int left) {
      float g[DIV_NV];
      for_each(left, in_vector(y, j), [&](int k, auto check) {
        const lmloss_div_col c = column(xs, xt, k);
        g[k] = lmloss_div_grad_tail(&a.pr, &gc, check.on && j + k == y, c.p,
                                    lmloss_div_grad_kind(&a.pr, &r, &gc, &c, K), xs[k], mode);
      });
      store8(rd, a.dxt, j, a.V, g);
    });
  }
}

__global__ void div_count(DivArgs a) {
  __shared__ double sh[33];
  double n = 0.0;
  for (int64_t i = threadIdx.x; i < a.N; i += blockDim.x)
    n += !a.label || ld_index(a.label, a.label64, i * a.ls) != a.ignore;
  n = block_sum(n, sh);
  if (threadIdx.x == 0) *a.count = n;
}

__global__ void div_finalize(DivArgs a) {
  __shared__ double sh[33];
  double l = 0.0;
  for (int64_t i = threadIdx.x; i < a.N; i += blockDim.x)
    l += a.row_loss[i];
  l = block_sum(l, sh);
  if (threadIdx.x == 0) {
    double f = 1.0;
    if (a.reduction == LMLOSS_REDUCE_MEAN) f = *a.count > 0.0 ? 1.0 / *a.count : 0.0;
    if (a.reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) f = 1.0 / a.num_items;
    *a.loss = (float)(l * f);
  }
}

template <int K> static void (*pick(const DivArgs &a))(DivArgs) {
  const bool general = a.pr.fs.cap > 0.0f || a.pr.ft.cap > 0.0f || a.pr.fs.k != a.pr.ft.k;
  return general ? div_rows<K, true> : div_rows<K, false>;
}

static lmloss_status launch_rows(const DivArgs &a, int kind, cudaStream_t st) {
  void (*k)(DivArgs) = kind == LMLOSS_DIV_KL           ? pick<LMLOSS_DIV_KL>(a)
                       : kind == LMLOSS_DIV_REVERSE_KL ? pick<LMLOSS_DIV_REVERSE_KL>(a)
                       : kind == LMLOSS_DIV_TVD        ? pick<LMLOSS_DIV_TVD>(a)
                                                       : pick<LMLOSS_DIV_JSD>(a);
  void *args[] = {(void *)&a};
  const cudaError_t e =
      cudaLaunchKernel((const void *)k, dim3((unsigned)a.N), dim3(DIV_BS), args, 0, st);
  if (e != cudaSuccess)
    return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA divergence: %s", cudaGetErrorString(e));
  return check_launch("divergence");
}

static lmloss_status run_div(const lmloss_context *ctx, const lmloss_div_inputs *in,
                             const lmloss_div_options *opt, const lmloss_div_outputs *out,
                             const lmloss_tensor *dloss, const lmloss_tensor *dx, void *ws) {
  lmloss_status s;
  const cudaStream_t st = stream_of(ctx);
  DivArgs a = {};
  a.s = in->student.data, a.t = in->teacher.data;
  a.sdt = in->student.dtype, a.tdt = in->teacher.dtype;
  a.ss = in->student.row_stride, a.ts = in->teacher.row_stride;
  a.N = in->student.rows, a.V = in->student.cols;
  if (lmloss_present(&in->label)) {
    a.label = in->label.data;
    a.label64 = in->label.dtype == LMLOSS_I64;
    a.ls = in->label.row_stride;
  }
  a.ignore = opt->ignore_index;
  a.pr = lmloss_div_pair_make(opt);
  a.mode = lmloss_div_pair_mode(&a.pr);
  a.soft = opt->soft_weight, a.hard = opt->hard_weight;
  a.reduction = opt->reduction;
  a.num_items = opt->num_items;
  a.grad_output = opt->grad_output;
  if (dloss) a.dloss = (const float *)dloss->data, a.dls = dloss->row_stride;
  if (dx) a.dx = dx->data, a.dxt = dx->dtype, a.dxs = dx->row_stride;
  if (out) {
    a.loss = (float *)out->loss.data, a.los = out->loss.row_stride;
    a.div = (float *)out->divergence.data, a.dvs = out->divergence.row_stride;
    a.ce = (float *)out->ce.data, a.ces = out->ce.row_stride;
    a.ent = (float *)out->entropy.data, a.ens = out->entropy.row_stride;
  }
  a.count = (double *)ws;
  a.row_loss = (double *)((char *)ws + LMLOSS_CE_WS_HEADER);
  const bool reduced_out = out && opt->reduction != LMLOSS_REDUCE_NONE;
  if (a.N == 0) {
    if (!reduced_out) return LMLOSS_OK;
    const cudaError_t e = cudaMemsetAsync(out->loss.data, 0, sizeof(float), st);
    if (e != cudaSuccess)
      return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA memset: %s", cudaGetErrorString(e));
    return LMLOSS_OK;
  }
  if (opt->reduction == LMLOSS_REDUCE_MEAN) {
    div_count<<<1, 1024, 0, st>>>(a);
    if ((s = check_launch("divergence count")) != LMLOSS_OK) return s;
  }
  if ((s = launch_rows(a, opt->kind, st)) != LMLOSS_OK) return s;
  if (!reduced_out) return LMLOSS_OK;
  div_finalize<<<1, 1024, 0, st>>>(a);
  return check_launch("divergence finalize");
}

} // namespace lmc

extern "C" lmloss_status
lmloss_cuda_divergence(const lmloss_context *ctx, const lmloss_div_inputs *in,
                       const lmloss_div_options *opt, const lmloss_div_outputs *out,
                       const lmloss_tensor *dloss, const lmloss_tensor *dstudent, void *ws,
                       size_t ws_bytes) {
  (void)ws_bytes;
  return lmc::run_div(ctx, in, opt, out, dloss, dstudent, ws);
}
