/*
 * divergence.cu - KL, reverse KL, generalized JSD and TVD between a
 * student's and a teacher's rows on CUDA, with the student's
 * cross-entropy as a hard term: the CPU's sweeps (cpu/divergence.c), each
 * column by the same formulas (math/divergence.h, math/vmath.h).
 *
 * One row pair a CTA, read once per sweep: the statistics (the maxes and
 * argmaxes, then the sums R and D below them; in one sweep for wide rows,
 * online_stats), the loss sweep (with the forward KL's gradient), and the
 * other kinds' gradient. A row split over a cluster of CTAs paid a
 * cluster barrier and exchange a sweep, which cost more than its rows' L2
 * hits saved (docs/design.md). Each sweep's sums are merged in a fixed
 * order, so the results are bitwise reproducible. The row contract's
 * phases over a vocabulary shard (lmloss.h) are the same sweeps, split
 * where its exchanges fall (DivShard).
 *
 * Workspace (lmloss_cross_entropy_workspace_size): header [0] the count
 * (double), then the row losses [N] (double); the launch sequence is
 * run_rows'. A label outside [0, V) that is not ignore_index gives NaN
 * for its row.
 */
#include "common.cuh"
#include "math/divstate.h"

namespace lmc {

constexpr int DIV_NV = 8;   /* columns a thread takes at a time */
constexpr int DIV_BS = 512; /* threads of a CTA, two an SM */
constexpr int DIV_WARPS = DIV_BS / 32;
/* Rows of at least this many columns take their statistics in one sweep
 * (online_stats), but for the JSD: each warp then takes 16 steps or more,
 * and a step whose max rises costs about as much as a step
 * (docs/benchmarks-history.md: the one sweep was faster at 152064 columns
 * and slower at 32768, where a warp takes eight steps and about four
 * rise). The JSD's sweeps are bound by their instructions, so the read
 * the one sweep saves does not pay for its rises there. */
constexpr int64_t DIV_ONLINE_MIN_COLS = 16 * DIV_BS * DIV_NV;

/* A vocabulary shard's phase (lmloss.h's row contract): the rows hold
 * columns [col0, col0 + V) of vocab. DIV_STATE writes each row pair's
 * state; DIV_PARTIALS the loss sweep's sums from the merged states (and
 * the forward KL's gradient); DIV_FINISH the outputs from the summed
 * partials, and the gradient. */
enum DivPhase { DIV_WHOLE, DIV_STATE, DIV_PARTIALS, DIV_FINISH };
struct DivShard {
  int phase;
  int64_t col0, vocab;
  float *state; /* written by DIV_STATE, else the merged states */
  int64_t sts;
  double *part; /* written by DIV_PARTIALS; read by DIV_FINISH (NULL: none) */
  int64_t ps;
};

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
  DivShard sh;
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

/* The statistics of some of a row pair's columns (a warp's, or the whole
 * row's: math/divstate.h), the teacher's raw logit at the student's
 * argmax, and the flags. */
struct PairStats {
  lmloss_div_stats st;
  float xt_as;
  int flags; /* LMLOSS_PAIR_* */
};

/* What a CTA's warps share: their Extents and sums, and the CTA's (two
 * sweeps); their running maxes and statistics, and the row's (one). */
struct DivShared {
  Extent ext, ext_cta[DIV_WARPS];
  double sums[(DIV_WARPS + 1) * 7]; /* block_sums' */
  PairStats part[DIV_WARPS], row;
  MaxAt top[DIV_WARPS][2]; /* a warp's running maxes (online_stats) */
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

/* The warp's flags (LMLOSS_PAIR_*) from its lanes', in every lane. */
__device__ __forceinline__ int warp_flags(int f) {
  return (__any_sync(0xffffffffu, f & LMLOSS_PAIR_BAD) ? LMLOSS_PAIR_BAD : 0) |
         (__any_sync(0xffffffffu, f & LMLOSS_PAIR_ANY_S) ? LMLOSS_PAIR_ANY_S : 0) |
         (__any_sync(0xffffffffu, f & LMLOSS_PAIR_ANY_T) ? LMLOSS_PAIR_ANY_T : 0);
}

/* A vector's float sums added to a thread's doubles: a thread sums about
 * V / 4096 vectors, too many terms for fp32 lanes to keep the loss to
 * its 1e-5; only the slots its kind uses (used(k)), so the others cost
 * no double add. */
template <int SUMS, typename IsUsed>
__device__ __forceinline__ void add_vector(double (&acc)[SUMS], const float (&v)[SUMS],
                                           IsUsed used) {
#pragma unroll
  for (int k = 0; k < SUMS; k++)
    if (used(k)) acc[k] += v[k];
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

/* Both rows' maxes of w over a vector's columns (-inf: none) into vs
 * and vt; with GENERAL, their flags (LMLOSS_PAIR_*) into flags. */
template <bool GENERAL>
__device__ __forceinline__ void vector_max(const DivArgs &a, const float *xs, const float *xt,
                                           int left, float &vs, float &vt, int &flags) {
  vs = vt = -INFINITY;
  for_each(left, false, [&](int k, auto) {
    if (GENERAL)
      flags |= ((xs[k] != xs[k]) | (xs[k] == INFINITY) | (xt[k] != xt[k]) | (xt[k] == INFINITY)) *
                   LMLOSS_PAIR_BAD |
               (xs[k] > -INFINITY) * LMLOSS_PAIR_ANY_S | (xt[k] > -INFINITY) * LMLOSS_PAIR_ANY_T;
    vs = fmaxf(vs, w_of<GENERAL>(&a.pr.fs, xs[k]));
    vt = fmaxf(vt, w_of<GENERAL>(&a.pr.ft, xt[k]));
  });
}

/* A vector's terms of R and D (math/divstate.h) against the exponents'
 * maxes ms, mt and G, into the thread's sums b3 (Rs, Rt, D); R leaves out
 * the columns as and at, which only a marked vector may hold. */
template <bool GENERAL>
__device__ __forceinline__ void
vector_sums(const DivArgs &a, int mode, const float *xs, const float *xt, int64_t j, int left,
            bool marked, float ms, float mt, float G, long long as, long long at, double (&b3)[3]) {
  float v[3] = {0.0f, 0.0f, 0.0f};
  for_each(left, marked, [&](int k, auto check) {
    float es, et, d;
    lmloss_div_stats_terms(&a.pr, mode, w_of<GENERAL>(&a.pr.fs, xs[k]),
                           w_of<GENERAL>(&a.pr.ft, xt[k]), xs[k], xt[k], ms, mt, G, &es, &et, &d);
    v[0] += check.on && j + k == as ? 0.0f : es;
    v[1] += check.on && j + k == at ? 0.0f : et;
    v[2] += d;
  });
  add_vector(b3, v, [](int) { return true; });
}

/* The max over the warp's lanes, in every lane. */
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

/* The warp's first column where w of its own raw logits x is m (the
 * warp's max v of a lane's vector: lanes hold increasing columns), with
 * both rows' logits there, in every lane. */
template <bool GENERAL>
__device__ __forceinline__ MaxAt warp_first(const lmloss_xform *f, const float *x, const float *o,
                                            int64_t j, int left, float v, float m) {
  const int src = __ffs(__ballot_sync(0xffffffffu, v == m)) - 1;
  MaxAt r = first_in<GENERAL>(f, x, o, j, left, m);
  r.a = __shfl_sync(0xffffffffu, r.a, src);
  r.x = __shfl_sync(0xffffffffu, r.x, src);
  r.o = __shfl_sync(0xffffffffu, r.o, src);
  return r;
}

/* Statistics at the maxes s and t, their sums 0. */
__device__ __forceinline__ lmloss_div_stats stats_at(const MaxAt &s, const MaxAt &t) {
  lmloss_div_stats st;
  st.ms = s.m, st.mt = t.m, st.xs_a = s.x, st.xt_a = t.x, st.as = s.a, st.at = t.a;
  st.rs = st.rt = st.d = 0.0;
  return st;
}

template <typename T> __device__ __forceinline__ T shfl_down(T v, int off) {
  return __shfl_down_sync(0xffffffffu, v, off);
}

/* Part x's statistics merged with the part of the lane off above (not
 * through lmloss_div_state_merge: its struct had ptxas spill more in the
 * one sweep's loop). */
__device__ __forceinline__ PairStats merge_down(const lmloss_div_pair *pr, const PairStats &x,
                                                int off) {
  PairStats y;
  y.st.ms = shfl_down(x.st.ms, off), y.st.mt = shfl_down(x.st.mt, off);
  y.st.xs_a = shfl_down(x.st.xs_a, off), y.st.xt_a = shfl_down(x.st.xt_a, off);
  y.st.as = shfl_down(x.st.as, off), y.st.at = shfl_down(x.st.at, off);
  y.st.rs = shfl_down(x.st.rs, off), y.st.rt = shfl_down(x.st.rt, off);
  y.st.d = shfl_down(x.st.d, off);
  y.xt_as = shfl_down(x.xt_as, off), y.flags = shfl_down(x.flags, off);
  PairStats o;
  o.st = lmloss_div_stats_merge(pr, &x.st, &y.st);
  o.xt_as = o.st.as == x.st.as ? x.xt_as : y.xt_as;
  o.flags = x.flags | y.flags;
  return o;
}

/* The row pair's statistics in one sweep (as the CPU's running blocks,
 * a warp's step of 256 columns a block): each warp keeps both rows' maxes
 * over the columns it has swept, the same in its lanes, and each lane its
 * sums against them; a step whose warp max rises above a row's first
 * moves the lanes' sums to the new maxes (lmloss_div_stats_move, the 1 of
 * each old argmax added in lane 0). A warp's maxes rise in about 2 ln n
 * of its n steps. The warps' parts then merge in a fixed tree. Every
 * thread gets the row's statistics. */
template <bool GENERAL>
__device__ PairStats online_stats(const DivArgs &a, const void *rs, const void *rt, int mode,
                                  DivShared &sh) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t V = a.V;
  /* the maxes with their columns stay in shared memory, out of the
   * loop's registers; the loop keeps the maxes, and those the exponents
   * are taken from (0 for a side of only -inf so far) */
  MaxAt *const top = sh.top[w];
  if (lane == 0) top[0] = top[1] = MaxAt{-INFINITY, LLONG_MAX, 0.0f, 0.0f};
  __syncwarp();
  float ms = -INFINITY, mt = -INFINITY, G = 0.0f, es0 = 0.0f, et0 = 0.0f;
  long long as = LLONG_MAX, at = LLONG_MAX; /* the columns a step that rose found */
  double b3[3] = {0.0, 0.0, 0.0};           /* Rs, Rt, D */
  int flags = 0;
  for (int64_t j0 = (int64_t)(threadIdx.x & ~31) * DIV_NV; j0 < V; j0 += (int64_t)DIV_BS * DIV_NV) {
    const int64_t j = j0 + lane * DIV_NV;
    float xs[DIV_NV], xt[DIV_NV];
    load8(rs, a.sdt, j, V, xs);
    load8(rt, a.tdt, j, V, xt);
    const int left = (int)(V - j < DIV_NV ? V - j : DIV_NV); /* <= 0: none */
    float vs, vt;
    vector_max<GENERAL>(a, xs, xt, left, vs, vt, flags);
    /* one vote a step; the warp's maxes by shuffles only where one rises */
    const bool rise = __any_sync(0xffffffffu, vs > ms || vt > mt);
    if (rise) {
      const float Ws = warp_max(vs), Wt = warp_max(vt);
      const MaxAt os = top[0], ot = top[1];
      const MaxAt ns = Ws > ms ? warp_first<GENERAL>(&a.pr.fs, xs, xt, j, left, vs, Ws) : os;
      const MaxAt nt = Wt > mt ? warp_first<GENERAL>(&a.pr.ft, xt, xs, j, left, vt, Wt) : ot;
      const lmloss_div_stats p = stats_at(os, ot), o = stats_at(ns, nt);
      G = lmloss_div_stats_G(&a.pr, &o);
      const lmloss_div_move mv = lmloss_div_stats_move(&a.pr, &p, &o, G);
      const double one = lane == 0 ? 1.0 : 0.0, r0 = b3[0], r1 = b3[1];
      b3[0] = mv.cs * (mv.one_s * one + r0);
      b3[1] = mv.ct * (mv.one_t * one + r1);
      b3[2] = mv.cd * (one + r1) + mv.cr * (one + r0) + mv.ce * b3[2];
      __syncwarp();
      if (lane == 0) top[0] = ns, top[1] = nt;
      __syncwarp();
      ms = ns.m, mt = nt.m, as = ns.a, at = nt.a;
      es0 = ms > -INFINITY ? ms : 0.0f, et0 = mt > -INFINITY ? mt : 0.0f;
    }
    vector_sums<GENERAL>(a, mode, xs, xt, j, left, rise && (in_vector(as, j) || in_vector(at, j)),
                         es0, et0, G, as, at, b3);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    b3[0] += shfl_down(b3[0], off), b3[1] += shfl_down(b3[1], off), b3[2] += shfl_down(b3[2], off);
  flags = warp_flags(flags);
  if (lane == 0) {
    PairStats &p = sh.part[w];
    p.st = stats_at(top[0], top[1]);
    p.st.rs = b3[0], p.st.rt = b3[1], p.st.d = b3[2];
    p.xt_as = top[0].o, p.flags = flags;
  }
  __syncthreads();
  if (w == 0) {
    PairStats x = sh.part[lane < DIV_WARPS ? lane : 0];
#pragma unroll
    for (int off = DIV_WARPS / 2; off > 0; off >>= 1)
      x = merge_down(&a.pr, x, off);
    if (lane == 0) sh.row = x;
  }
  __syncthreads();
  return sh.row;
}

/* The row pair's statistics in two sweeps: the maxes and first argmaxes
 * (with the flags), then the sums against them. Every thread gets them.
 * PART: the columns are a shard's, whose state a side of only -inf there
 * does not decide: its sums are formed against 0 (as lmloss_div_state's
 * merge expects). */
template <bool GENERAL, bool PART = false>
__device__ PairStats swept_stats(const DivArgs &a, const void *rs, const void *rt, int mode,
                                 DivShared &sh) {
  /* a part's side of only -inf keeps -inf as its logit at the argmax, so
   * that G (and each column's D) reads that side as empty */
  Extent e = {{-INFINITY, LLONG_MAX, 0.0f, 0.0f}, {-INFINITY, LLONG_MAX, 0.0f, 0.0f}, 0, 0, 0};
  if (PART) e.s.x = e.s.o = e.t.x = e.t.o = -INFINITY;
  int flags = 0;
  for_vectors(a, rs, rt, [&](int64_t j, const float *xs, const float *xt, int left) {
    float vs, vt;
    vector_max<GENERAL>(a, xs, xt, left, vs, vt, flags);
    /* a thread's max rises about ln n times in its n vectors: the argmax
     * is looked for then, in the registers, not read again after */
    if (vs > e.s.m) e.s = first_in<GENERAL>(&a.pr.fs, xs, xt, j, left, vs);
    if (vt > e.t.m) e.t = first_in<GENERAL>(&a.pr.ft, xt, xs, j, left, vt);
  });
  /* Extent keeps three ints: one of flags there had ptxas spill in the
   * loss sweeps that follow */
  e.bad = flags & LMLOSS_PAIR_BAD, e.any_s = flags & LMLOSS_PAIR_ANY_S;
  e.any_t = flags & LMLOSS_PAIR_ANY_T;
  e = cta_extent(e, sh);
  PairStats ps;
  ps.st = stats_at(e.s, e.t);
  ps.xt_as = e.s.o;
  ps.flags = (e.bad ? LMLOSS_PAIR_BAD : 0) | (e.any_s ? LMLOSS_PAIR_ANY_S : 0) |
             (e.any_t ? LMLOSS_PAIR_ANY_T : 0);
  /* a row without a finite max on a side is decided by the flags: its
   * sums are not read */
  if (PART ? (ps.flags & LMLOSS_PAIR_BAD) != 0
           : !(e.s.m > -INFINITY && e.t.m > -INFINITY && e.s.m < INFINITY && e.t.m < INFINITY))
    return ps;
  const float ms = PART && e.s.m == -INFINITY ? 0.0f : e.s.m;
  const float mt = PART && e.t.m == -INFINITY ? 0.0f : e.t.m;
  const long long as = e.s.a, at = e.t.a;
  const float G = lmloss_div_stats_G(&a.pr, &ps.st);
  double b3[3] = {0.0, 0.0, 0.0};
  for_vectors(a, rs, rt, [&](int64_t j, const float *xs, const float *xt, int left) {
    vector_sums<GENERAL>(a, mode, xs, xt, j, left, in_vector(as, j) || in_vector(at, j), ms, mt, G,
                         as, at, b3);
  });
  block_sums<3>(b3, sh.sums);
  ps.st.rs = b3[0], ps.st.rt = b3[1], ps.st.d = b3[2];
  return ps;
}

/* One row pair per CTA, of the kind KIND; GENERAL: a softcap on either
 * side or a k of each (the transforms' modes then read at run time), else
 * one k and no softcap (LMLOSS_DIV_ONE_K). SHARD: the row contract's
 * phases over a vocabulary shard (a.sh), in the general two-sweep kernel:
 * a state is the statistics' sweeps, the partials the loss sweep from the
 * merged state (with the forward KL's gradient), a finish the outputs
 * from the summed partials and the gradient sweep. */
template <int KIND, bool GENERAL, bool ONLINE, bool SHARD = false>
__global__ void __launch_bounds__(DIV_BS, 2) div_rows(DivArgs a) {
  static_assert(!SHARD || (GENERAL && !ONLINE), "a shard's phases take the two-sweep kernel");
  __shared__ DivShared sh;
  const int64_t i = blockIdx.x;
  const int phase = SHARD ? a.sh.phase : DIV_WHOLE;
  const int64_t col0 = SHARD ? a.sh.col0 : 0; /* the rows' first column in the vocabulary */
  const void *rs = (const char *)a.s + i * a.ss * (int64_t)lmloss_dtype_size(a.sdt);
  const void *rt = (const char *)a.t + i * a.ts * (int64_t)lmloss_dtype_size(a.tdt);
  void *rd = a.dx ? (char *)a.dx + i * a.dxs * (int64_t)lmloss_dtype_size(a.dxt) : nullptr;
  const bool lead = threadIdx.x == 0;
  /* the label: y = -1 without; an ignored row; one outside [0, V) (a
   * shard's: no column of the row, as on the CPU) */
  long long y = -1;
  bool ignored = false, bad_label = false;
  if (a.label) {
    const long long l = ld_index(a.label, a.label64, i * a.ls);
    ignored = l == a.ignore;
    bad_label = !SHARD && !ignored && (l < 0 || l >= a.V);
    y = ignored || bad_label ? -1 : l;
  }
  const long long yl = y - col0; /* the label's column here (none: outside [0, V)) */
  const bool y_here = SHARD ? y >= 0 && yl >= 0 && yl < a.V : y >= 0;
  /* the row's scale: the upstream gradient through the reduction (a
   * shard's phase without a workspace writes neither) */
  double factor = 1.0;
  if (a.reduction == LMLOSS_REDUCE_MEAN && (!SHARD || a.count))
    factor = *a.count > 0.0 ? 1.0 / *a.count : 0.0;
  if (a.reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) factor = 1.0 / a.num_items;
  const float up =
      a.dloss ? a.dloss[a.reduction == LMLOSS_REDUCE_NONE ? i * a.dls : 0] : a.grad_output;
  auto finish = [&](double div, double ce, double ent) {
    if (!lead) return;
    /* a shard's finish reads no ce without a hard term: an exchange may
     * leave out the label's w */
    const double li = ignored                     ? 0.0
                      : SHARD && !(a.hard > 0.0f) ? a.soft * div
                                                  : a.soft * div + a.hard * ce;
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
  /* the partials' row: the loss sweep's seven sums, then a zero */
  auto put_partials = [&](const double *c7, double v) {
    if (!lead) return;
    double *o = a.sh.part + i * a.sh.ps;
    for (int c = 0; c < LMLOSS_DIV_PARTIAL_COLS; c++)
      o[c] = c < 7 ? (c7 ? c7[c] : v) : 0.0;
  };
  if (ignored) {
    if (phase == DIV_STATE) {
      lmloss_div_state e = {};
      e.st.as = -1; /* empty */
      if (lead) lmloss_div_state_pack(&e, a.sh.state + i * a.sh.sts);
      return;
    }
    fill(0.0f);
    if (phase == DIV_PARTIALS) return put_partials(nullptr, 0.0);
    finish(0.0, 0.0, 0.0);
    return;
  }
  const int mode = GENERAL ? a.mode : LMLOSS_DIV_ONE_K;
  /* the label's logit, read before any thread writes a gradient over
   * the student, its load in flight during the sweep */
  const float xs_y = y_here ? lmloss_load(rs, a.sdt, yl) : 0.0f;
  auto fail = [&]() {
    fill(NAN);
    if (phase == DIV_PARTIALS) return put_partials(nullptr, NAN);
    finish(NAN, NAN, NAN);
  };
  /* 1. the statistics: both rows' maxes and first argmaxes of w, R of
   * each row and D = Rt - Rs below the maxes. A NaN or +inf logit: the
   * flags with a softcap (which bounds w); without, +inf is the max and a
   * NaN makes the sums NaN, which costs the plain sweeps nothing. A
   * shard's partials and finish take them from the merged state. */
  PairStats ps;
  float ws_y = NAN; /* a shard: the student's w at the label, where known */
  if (SHARD && phase != DIV_STATE) {
    const lmloss_div_state m =
        lmloss_div_state_unpack(a.sh.state + i * a.sh.sts, a.sh.vocab, &a.pr);
    ps.st = m.st, ps.xt_as = m.xt_as, ps.flags = m.flags, ws_y = m.ws_y;
  } else {
    ps = ONLINE ? online_stats<GENERAL>(a, rs, rt, mode, sh)
                : swept_stats<GENERAL, SHARD>(a, rs, rt, mode, sh);
  }
  if (phase == DIV_STATE) {
    if (!lead) return;
    lmloss_div_state x;
    x.st = ps.st, x.xt_as = ps.xt_as, x.flags = ps.flags;
    /* the argmaxes in the vocabulary's columns (a side of no max: the
     * shard's first, as its packed form reads) */
    x.st.as = (ps.st.as == LLONG_MAX ? 0 : ps.st.as) + col0;
    x.st.at = (ps.st.at == LLONG_MAX ? 0 : ps.st.at) + col0;
    x.ws_y = y_here ? lmloss_xform_w(&a.pr.fs, xs_y) : NAN;
    lmloss_div_state_pack(&x, a.sh.state + i * a.sh.sts);
    return;
  }
  const lmloss_div_stats &st = ps.st;
  const int flags = GENERAL ? ps.flags
                            : (st.ms == INFINITY || st.mt == INFINITY ? LMLOSS_PAIR_BAD : 0) |
                                  (st.ms > -INFINITY ? LMLOSS_PAIR_ANY_S : 0) |
                                  (st.mt > -INFINITY ? LMLOSS_PAIR_ANY_T : 0);
  if (!lmloss_pair_flags_ok(flags) || bad_label) return fail();
  if (!GENERAL && !(isfinite(st.rs) && isfinite(st.rt) && isfinite(st.d))) return fail();
  const float ms = st.ms;
  const long long as = st.as - col0; /* the student's argmax here (none: outside [0, V)) */
  const float ks = a.pr.fs.k;
  const lmloss_div_row r = lmloss_div_row_make(&a.pr, st.ms, st.mt, (float)st.rs, (float)st.rt,
                                               (float)st.d, st.as, st.xs_a, st.xt_a, ps.xt_as);
  lmloss_div_grad gc = {};
  gc.y = y, gc.soft = a.soft, gc.scale = (float)(up * factor);
  gc.hard = y >= 0 ? a.hard : 0.0f;
  gc.one_minus_py = y == st.as ? r.rs / (1.0f + r.rs) : -1.0f;
  auto column = [&](const float *xs, const float *xt, int k) {
    return lmloss_div_column(&a.pr, &r, mode, w_of<GENERAL>(&a.pr.fs, xs[k]),
                             w_of<GENERAL>(&a.pr.ft, xt[k]), xs[k], xt[k]);
  };
  /* 3. the loss sweep, with the forward KL's gradient; each kind sums
   * only what it reads, the entropy only in the copy that is asked for
   * it (its terms cost instructions a column, not only an add); a
   * shard's partials carry every sum its finish may read */
  const bool fused = rd && KIND == LMLOSS_DIV_KL;
  double c7[7] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  auto loss_sweep = [&](auto want_ent) {
    /* the slots of c7 a kind sums: the divergence, rev, mix, pos, neg, eq
     * (lmloss_div_terms), the entropy */
    const auto used = [](int k) {
      return k == 0 || (k == 1 && KIND == LMLOSS_DIV_REVERSE_KL) ||
             (k == 2 && KIND == LMLOSS_DIV_JSD) || (k >= 3 && k <= 5 && KIND == LMLOSS_DIV_TVD) ||
             (k == 6 && decltype(want_ent)::value);
    };
    for_vectors(a, rs, rt, [&](int64_t j, const float *xs, const float *xt, int left) {
      float g[DIV_NV], v[7] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for_each(left, in_vector(as, j) || in_vector(yl, j), [&](int k, auto check) {
        const lmloss_div_col c = column(xs, xt, k);
        const lmloss_div_terms t =
            lmloss_div_loss_terms(&a.pr, &r, &c, !(check.on && j + k == as) && c.p != 0.0f, KIND);
        v[0] += t.div, v[1] += t.rev, v[2] += t.mix;
        v[3] += t.pos, v[4] += t.neg, v[5] += t.eq, v[6] += t.ent;
        if (fused)
          g[k] = lmloss_div_grad_tail(&a.pr, &gc, check.on && j + k == yl, c.p, t.h, xs[k], mode);
      });
      add_vector(c7, v, used);
      if (fused) store8(rd, a.dxt, j, a.V, g);
    });
  };
  if (phase != DIV_FINISH) {
    if (a.ent || phase == DIV_PARTIALS)
      loss_sweep(std::true_type());
    else
      loss_sweep(std::false_type());
    block_sums<7>(c7, sh.sums);
    if (phase == DIV_PARTIALS) return put_partials(c7, 0.0);
  }
  float es_y = 0.0f;
  if (y >= 0) es_y = y == st.as ? 0.0f : ((SHARD ? ws_y : w_of<GENERAL>(&a.pr.fs, xs_y)) - ms) * ks;
  const double ce = y >= 0 ? (double)r.l1s - es_y : 0.0;
  /* a finish's summed partials (none: the forward KL's backward, which
   * reads none and writes no outputs) */
  const double *p = phase == DIV_FINISH ? a.sh.part : nullptr;
  if (p) p += i * a.sh.ps;
  if (phase != DIV_FINISH)
    finish(c7[0], ce, c7[6]);
  else if (p)
    finish(p[0], ce, p[6]);
  /* 4. the other kinds' gradient (a shard's finish: every kind's) */
  if (rd && (phase == DIV_FINISH || !fused)) {
    if (phase != DIV_FINISH)
      lmloss_div_grad_sums(&gc, c7[1], c7[2], c7[3], c7[4], c7[5]);
    else if (p)
      lmloss_div_grad_sums(&gc, p[1], p[2], p[3], p[4], p[5]);
    for_vectors(a, rs, rt, [&](int64_t j, const float *xs, const float *xt, int left) {
      float g[DIV_NV];
      for_each(left, in_vector(yl, j), [&](int k, auto check) {
        const lmloss_div_col c = column(xs, xt, k);
        g[k] = lmloss_div_grad_tail(&a.pr, &gc, check.on && j + k == yl, c.p,
                                    lmloss_div_grad_kind(&a.pr, &r, &gc, &c, KIND), xs[k], mode);
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

template <int KIND, bool GENERAL> static void (*pick_stats(const DivArgs &a))(DivArgs) {
  if constexpr (KIND != LMLOSS_DIV_JSD)
    if (a.V >= DIV_ONLINE_MIN_COLS) return div_rows<KIND, GENERAL, true>;
  return div_rows<KIND, GENERAL, false>;
}
template <int KIND> static void (*pick(const DivArgs &a))(DivArgs) {
  if (a.sh.phase != DIV_WHOLE) return div_rows<KIND, true, false, true>;
  const bool general = a.pr.fs.cap > 0.0f || a.pr.ft.cap > 0.0f || a.pr.fs.k != a.pr.ft.k;
  return general ? pick_stats<KIND, true>(a) : pick_stats<KIND, false>(a);
}

/* A row pair's merge of two parts' states (lmloss.h), one thread a row. */
__global__ void div_merge(const float *a, int64_t as, const float *b, int64_t bs, float *out,
                          int64_t os, int64_t N, lmloss_div_pair pr) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const lmloss_div_state x = lmloss_div_state_unpack(a + i * as, LMLOSS_STATE_MAX_VOCAB, &pr);
  const lmloss_div_state y = lmloss_div_state_unpack(b + i * bs, LMLOSS_STATE_MAX_VOCAB, &pr);
  const lmloss_div_state m = lmloss_div_state_merge(&pr, &x, &y);
  lmloss_div_state_pack(&m, out + i * os);
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

/* A call's rows, labels, pair and reduction; the workspace (NULL: none)
 * holds MEAN's count and the row losses (lmloss_cross_entropy_workspace_size). */
static DivArgs div_args(const lmloss_div_inputs *in, const lmloss_div_options *opt,
                        const lmloss_tensor *dloss, const lmloss_tensor *dx, void *ws) {
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
  if (ws) {
    a.count = (double *)ws;
    a.row_loss = (double *)((char *)ws + LMLOSS_CE_WS_HEADER);
  }
  return a;
}

static void set_outputs(DivArgs &a, const lmloss_div_outputs *out) {
  a.loss = (float *)out->loss.data, a.los = out->loss.row_stride;
  a.div = (float *)out->divergence.data, a.dvs = out->divergence.row_stride;
  a.ce = (float *)out->ce.data, a.ces = out->ce.row_stride;
  a.ent = (float *)out->entropy.data, a.ens = out->entropy.row_stride;
}

/* The launch sequence on the caller's stream, nothing allocated:
 *   [div_count]    MEAN with a workspace: the rows not ignored into its
 *                  header;
 *   div_rows       per row pair;
 *   [div_finalize] a reduced loss: a fixed-order sum of the row losses. */
static lmloss_status run_rows(const lmloss_context *ctx, const DivArgs &a, int kind) {
  lmloss_status s;
  const cudaStream_t st = stream_of(ctx);
  const bool reduced_out = a.loss && a.reduction != LMLOSS_REDUCE_NONE;
  if (a.N == 0) {
    if (!reduced_out) return LMLOSS_OK;
    const cudaError_t e = cudaMemsetAsync(a.loss, 0, sizeof(float), st);
    if (e != cudaSuccess)
      return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA memset: %s", cudaGetErrorString(e));
    return LMLOSS_OK;
  }
  if (a.reduction == LMLOSS_REDUCE_MEAN && a.count) {
    div_count<<<1, 1024, 0, st>>>(a);
    if ((s = check_launch("divergence count")) != LMLOSS_OK) return s;
  }
  if ((s = launch_rows(a, kind, st)) != LMLOSS_OK) return s;
  if (!reduced_out) return LMLOSS_OK;
  div_finalize<<<1, 1024, 0, st>>>(a);
  return check_launch("divergence finalize");
}

/* A shard's phase: a call's arguments over the shard's columns. */
static DivArgs shard_args(const lmloss_div_inputs *in, const lmloss_div_options *opt,
                          const lmloss_shard *sh, int phase, const lmloss_tensor *state,
                          const lmloss_tensor *dloss, const lmloss_tensor *dx, void *ws) {
  DivArgs a = div_args(in, opt, dloss, dx, ws);
  a.sh.phase = phase;
  a.sh.col0 = sh->col0, a.sh.vocab = sh->vocab;
  a.sh.state = (float *)state->data, a.sh.sts = state->row_stride;
  return a;
}

} // namespace lmc

extern "C" lmloss_status
lmloss_cuda_divergence(const lmloss_context *ctx, const lmloss_div_inputs *in,
                       const lmloss_div_options *opt, const lmloss_div_outputs *out,
                       const lmloss_tensor *dloss, const lmloss_tensor *dstudent, void *ws,
                       size_t ws_bytes) {
  (void)ws_bytes;
  lmc::DivArgs a = lmc::div_args(in, opt, dloss, dstudent, ws);
  if (out) lmc::set_outputs(a, out);
  return lmc::run_rows(ctx, a, opt->kind);
}

/* The row contract's divergence phases over a vocabulary shard
 * (lmloss.h), on div_rows. */
extern "C" lmloss_status lmloss_cuda_div_state(const lmloss_context *ctx,
                                               const lmloss_div_inputs *in,
                                               const lmloss_div_options *opt,
                                               const lmloss_shard *sh, const lmloss_tensor *state) {
  const lmc::DivArgs a = lmc::shard_args(in, opt, sh, lmc::DIV_STATE, state, NULL, NULL, NULL);
  return lmc::run_rows(ctx, a, opt->kind);
}

extern "C" lmloss_status lmloss_cuda_div_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                               const lmloss_tensor *b,
                                               const lmloss_div_options *opt,
                                               const lmloss_tensor *out) {
  const int64_t N = a->rows;
  if (N > 0)
    lmc::div_merge<<<(unsigned)((N + 255) / 256), 256, 0, lmc::stream_of(ctx)>>>(
        (const float *)a->data, a->row_stride, (const float *)b->data, b->row_stride,
        (float *)out->data, out->row_stride, N, lmloss_div_pair_make(opt));
  return lmc::check_launch("divergence state merge");
}

/* With dx, the forward KL's whole gradient in the same sweep; another
 * kind's dx is left, and its finish (kept) forms the gradient from the
 * rows. */
extern "C" lmloss_status
lmloss_cuda_div_partials(const lmloss_context *ctx, const lmloss_div_inputs *in,
                         const lmloss_div_options *opt, const lmloss_shard *sh,
                         const lmloss_tensor *state, const lmloss_tensor *partials,
                         const lmloss_tensor *dx, void *ws, size_t ws_bytes) {
  (void)ws_bytes;
  const bool kl_grad = dx && opt->kind == LMLOSS_DIV_KL;
  lmc::DivArgs a = lmc::shard_args(in, opt, sh, lmc::DIV_PARTIALS, state, NULL, kl_grad ? dx : NULL,
                                   kl_grad ? ws : NULL);
  a.sh.part = (double *)partials->data, a.sh.ps = partials->row_stride;
  return lmc::run_rows(ctx, a, opt->kind);
}

extern "C" lmloss_status
lmloss_cuda_div_finish(const lmloss_context *ctx, const lmloss_div_inputs *in,
                       const lmloss_div_options *opt, const lmloss_shard *sh,
                       const lmloss_tensor *state, const lmloss_tensor *partials,
                       const lmloss_div_outputs *out, const lmloss_tensor *dloss,
                       const lmloss_tensor *dx, int kept, void *ws, size_t ws_bytes) {
  (void)kept, (void)ws_bytes;
  lmc::DivArgs a = lmc::shard_args(in, opt, sh, lmc::DIV_FINISH, state, dloss, dx, ws);
  if (partials) a.sh.part = (double *)partials->data, a.sh.ps = partials->row_stride;
  if (out) lmc::set_outputs(a, out);
  return lmc::run_rows(ctx, a, opt->kind);
}
