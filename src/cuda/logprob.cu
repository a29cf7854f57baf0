/*
 * logprob.cu - log-probs (selective log-softmax), entropy, and their
 * backward on CUDA.
 *
 * Forward: logp[i, k] = (w_idx - m) k - log1p(R) (exact -log1p(R) at the
 * max), entropy = t / (1 + R) + log1p(R). An index outside [0, V) (not
 * checked on the host for device memory) gives NaN for that entry.
 * Backward, in z units, with D = sum_k dlogp_k, inv = 1 / (1 + R):
 *   dz_j = sum_{k: idx_k = j} dlogp_k - D p_j - dH p_j ((w_j - m) k + t inv)
 * (log p_j + H = (w_j - m) k + t / (1 + R): the log1p(R) cancels
 * analytically), and at the argmax the dlogp part uses 1 - p_a = R inv.
 * An out-of-range index makes its whole gradient row NaN. The backward
 * takes the row's statistics from its own first pass (lp_bwd, or lp_held
 * for one index and no entropy gradient) or from the forward's saved ones
 * (lp_bwd_saved, which reads the row once; it is also the finish from
 * merged states, over a vocabulary shard or a fused head's vocab tile).
 */
#include <type_traits>

#include "held.cuh"
#include "staged.cuh"

namespace lmc {

struct LpArgs {
  const void *x;
  int64_t N, V, xs;
  /* the indices and the argmax are columns of rows vh wide, of which x
   * holds V from column j0 on (a fused head's vocab tile: lp_bwd_saved
   * only); else vh = V, j0 = 0 */
  int64_t vh, j0;
  const void *idx;
  int idx64;
  int64_t is, K;
  const unsigned char *mask;
  int64_t ms;
  Xf X;
  void *logp;
  int64_t lps;
  lmloss_dtype lpt; /* logp's dtype */
  float *ent;
  int64_t ents;
  float *stats; /* LMLOSS_ROW_STATS a row: written (forward) or read (lp_bwd_saved) */
  /* a vocabulary shard's packed states (lmloss.h's row contract) in place
   * of stats: written by lp_fwd (x holds columns j0.. of vh), read by
   * lp_bwd_saved (merged) */
  float *state;
  int64_t sts; /* stats' or state's row stride */
  const float *dlogp;
  int64_t dlps;
  const float *dent;
  int64_t dents;
  void *dx;
  int64_t dxs;
  lmloss_dtype dxt;     /* dx's dtype */
  lmloss_row_keep keep; /* optional arrays, backward */
  int cs;
  int64_t chunk;
  int staged;
};

/* Row i's state over its shard's columns from the CTA's part P (the
 * label: the row's one index, where the shard holds it). */
template <typename In>
__device__ __forceinline__ void shard_state(const LpArgs &a, int64_t i, const In *row,
                                            const Part &P) {
  lmloss_rowstate x;
  x.s = P.s;
  if (x.s.a >= 0) x.s.a += a.j0;
  x.wy = 0.0f;
  x.flags = part_flags(P);
  const long long y = a.idx ? ld_index(a.idx, a.idx64, i * a.is) - a.j0 : -1;
  if (y >= 0 && y < a.V) {
    x.wy = lmloss_xform_w(&a.X.f, tof(row[y]));
    x.flags |= LMLOSS_STATE_LABEL;
  }
  lmloss_rowstate_pack(&x, a.state + i * a.sts);
}

/* One pass over the row, launched as make_plan (staged.cuh) plans a
 * one-pass row: one CTA streaming it through registers (see first_pass).
 * The chunk, cluster and stage parameters are the shared row machinery's
 * (rank 0 gathers the K log-probs after the merge). Four CTAs per SM (64
 * registers, no spills): more loads in flight than at three, and
 * faster. */
template <typename In, bool ENTROPY> __global__ void __launch_bounds__(256, 4) lp_fwd(LpArgs a) {
  constexpr int NV = elt<In>::NV;
  extern __shared__ uint4 stage[];
  __shared__ RedSmem red;
  RowWalk rw(a.cs, &red);
  const Xf &X = a.X;
  const float k = X.f.k;
  const Chunk ch = my_chunk<NV>(a.V, a.chunk, rw.rank);
  Stage st(stage, red.halves, ch, false);
  for (int64_t i = rw.first; i < a.N; i += rw.step) {
    if (a.mask && !a.mask[i * a.ms]) {
      if (rw.rank == 0) {
        for (int64_t q = threadIdx.x; q < a.K; q += blockDim.x)
          lmloss_store(a.logp, a.lpt, i * a.lps + q, 0.0f);
        if (a.ent && threadIdx.x == 0) a.ent[i * a.ents] = 0.0f;
        if (a.stats && threadIdx.x == 0) lmloss_rowstat_save_masked(a.stats + i * a.sts);
        if (a.state && threadIdx.x == 0) {
          const lmloss_rowstate e = lmloss_rowstate_empty();
          lmloss_rowstate_pack(&e, a.state + i * a.sts);
        }
      }
      continue;
    }
    const In *row = (const In *)a.x + i * a.xs;
    const bool al = is_aligned16(row);
    Acc acc;
    acc.init(X);
    /* never staged (a one-pass plan): a literal false keeps the staged
     * loops out of this kernel and its 64 registers */
    const bool one_max = first_pass<ENTROPY>(false, st, RowPart<In>{row, ch, a.V, al}, false, X,
                                             Smooth{}, acc, &red);

    /* the flags apart: a shard's part of only -inf is an empty state */
    Part P = reduce_row<false>(acc, k, ENTROPY, false, &red, rw, one_max);
    if (rw.rank != 0) continue;
    if (a.state) {
      if (threadIdx.x == 0) shard_state(a, i, row, P);
      continue;
    }
    const lmloss_rowstat &s = P.s;
    const bool ok = !P.bad && P.fin && lmloss_rowstat_finite(&s);
    const float l1r = log1pf(s.r);
    for (int64_t q = threadIdx.x; q < a.K; q += blockDim.x) {
      long long j = ld_index(a.idx, a.idx64, i * a.is + q);
      float lp = NAN;
      if (ok && j >= 0 && j < a.V) {
        float wj = lmloss_xform_w(&X.f, tof(row[j]));
        lp = (float)((double)(wj - s.m) * k - l1r);
      }
      lmloss_store(a.logp, a.lpt, i * a.lps + q, lp);
    }
    if (a.ent && threadIdx.x == 0) a.ent[i * a.ents] = ok ? lmloss_rowstat_entropy(&s) : NAN;
    if (a.stats && threadIdx.x == 0) lmloss_rowstat_save(&s, ok, a.stats + i * a.sts);
  }
  rw.finish();
}

/* Row i's upstream gradients: D = sum_k dlogp (every thread sums in the
 * same order), dH, and whether every index lies in [0, vh). */
struct LpUp {
  float D, dH;
  bool idx_ok;
};
__device__ __forceinline__ LpUp lp_upstream(const LpArgs &a, int64_t i) {
  LpUp u = {0.0f, a.dent ? a.dent[i * a.dents] : 0.0f, true};
  if (a.dlogp) {
    for (int64_t q = 0; q < a.K; q++) {
      long long j = ld_index(a.idx, a.idx64, i * a.is + q);
      if (j < 0 || j >= a.vh) u.idx_ok = false;
      u.D += a.dlogp[i * a.dlps + q];
    }
  }
  return u;
}

/* Row i's gradient from its statistics s (bad: the row held a NaN or
 * +inf), in the file comment's form: g = e_j (C1 d_j + C0) away from the
 * exact entries, which entry() forms. */
template <bool ENTROPY> struct LpGrad {
  lmloss_rowstat s;
  LpUp up;
  bool ok;
  float inv, tinv, kx, c0, c1, C0, C1;
  Ref ref;

  __device__ __forceinline__ LpGrad(const Xf &X, const lmloss_rowstat &s_, bool bad, const LpUp &u)
      : s(s_), up(u) {
    const float k = X.f.k;
    ok = u.idx_ok && !bad && lmloss_rowstat_finite(&s);
    inv = 1.0f / (1.0f + s.r);
    tinv = ENTROPY ? s.t * inv : 0.0f;
    /* without softcap dx = k dz, folded into the coefficients (kx) */
    kx = X.f.cap > 0.0f ? 1.0f : k;
    c0 = -inv * (u.D + u.dH * tinv) * kx;
    c1 = -inv * u.dH * k * kx;
    if (!ok) c0 = c1 = NAN;
    /* d_j = w_j - m = (p'_j - ml) / kh (Ref) */
    ref.set(X, s.m);
    C1 = c1 * ref.s() / X.kh;
    C0 = (c0 - c1 * ref.ml / X.kh) * ref.s();
  }

  /* Flag the vectors of chunk ch holding the argmax or an index in the
   * bitmap bm (cleared by the caller before a barrier). Contains
   * __syncthreads: call uniformly. */
  __device__ __forceinline__ void flag(const LpArgs &a, int64_t i, const Chunk &ch, int NV,
                                       unsigned *bm) const {
    __syncthreads();
    if (threadIdx.x == 0 && s.a >= ch.jb && s.a < ch.je) {
      int64_t v = (s.a - ch.jb) / NV;
      atomicOr(&bm[v >> 5], 1u << (v & 31));
    }
    if (a.dlogp) {
      for (int64_t q = threadIdx.x; q < a.K; q += blockDim.x) {
        long long j = ld_index(a.idx, a.idx64, i * a.is + q);
        if (j >= ch.jb && j < ch.je) {
          int64_t v = (j - ch.jb) / NV;
          atomicOr(&bm[v >> 5], 1u << (v & 31));
        }
      }
    }
    __syncthreads();
  }

  /* The gradient of NV elements with transformed logits w, away from
   * the exact entries. */
  template <int NV>
  __device__ __forceinline__ void fast(const Xf &X, const float *w, float *g) const {
#pragma unroll
    for (int e = 0; e < NV; e++) {
      if constexpr (ENTROPY) { /* the clamp keeps C1 p finite at -inf logits */
        const float p = fmaxf(ref.p(X, w[e]), X.pmin);
        g[e] = ex2(p) * fmaf(C1, p, C0);
      } else { /* C1 = 0; a -inf logit gives ex2(-inf) = 0 */
        g[e] = ex2(ref.p(X, w[e])) * C0;
      }
    }
  }

  /* Column j's gradient (before the softcap's chain rule) if it is an
   * exact entry (the argmax or an index), with transformed logit w. */
  __device__ __forceinline__ bool entry(const LpArgs &a, int64_t i, const Xf &X, long long j,
                                        float w, float *g) const {
    float Dj = 0.0f, rest = 0.0f;
    bool hit = j == s.a;
    if (a.dlogp) {
      for (int64_t q = 0; q < a.K; q++) {
        if (ld_index(a.idx, a.idx64, i * a.is + q) == j) {
          Dj += a.dlogp[i * a.dlps + q];
          hit = true;
        } else {
          rest += a.dlogp[i * a.dlps + q];
        }
      }
    }
    if (!hit) return false;
    /* d = 0 at the argmax, as lmloss_rowstat_dk: a recomputed logit (the
     * fused head's tiles) one ulp off the max would be the row's whole
     * entropy gradient there */
    const float d = j == s.a ? 0.0f : fmaxf(w - s.m, X.dmin), pj = cexp(X, d) * inv;
    const float gz = lmloss_lp_entry_z(&s, pj, d * X.f.k, tinv, Dj, rest, up.dH, j == s.a);
    *g = ok ? gz * kx : NAN;
    return true;
  }

  /* entry's gradient at column j from its raw logit x, through the
   * softcap's chain rule (0 where j is no exact entry). */
  __device__ __forceinline__ float entry_dx(const LpArgs &a, int64_t i, const Xf &X, long long j,
                                            float x) const {
    float g = 0.0f;
    entry(a, i, X, j, lmloss_xform_w(&X.f, x), &g);
    return g * (X.f.cap > 0.0f ? lmloss_xform_dzdx(&X.f, x) : 1.0f);
  }

  /* fast, then the exact entries of a vector (j0..) that holds one. */
  template <int NV>
  __device__ __forceinline__ void fill(const LpArgs &a, int64_t i, const Xf &X, int64_t j0,
                                       bool exact, const float *w, float *g) const {
    fast<NV>(X, w, g);
    if (!exact) return;
#pragma unroll
    for (int e = 0; e < NV; e++)
      entry(a, i, X, j0 + e, w[e], &g[e]);
  }
};

__device__ __forceinline__ bool flagged(const unsigned *bm, int v) {
  return (bm[v >> 5] >> (v & 31)) & 1u;
}

/* Same shape as the cross-entropy gradient (see ce_rows). Positions that
 * need the exact formula (the argmax, the K indices) are flagged in a
 * per-vector bitmap in shared memory, so the hot loop pays one shared load
 * per 16 bytes whatever K is. */
template <typename In, bool ENTROPY, int THREADS = 128>
__global__ void ROW_BOUNDS(THREADS) lp_bwd(LpArgs a) {
  constexpr int NV = elt<In>::NV;
  extern __shared__ uint4 stage[];
  __shared__ RedSmem red;
  RowWalk rw(a.cs, &red);
  const Xf &X = a.X;
  const float k = X.f.k;
  const Chunk ch = my_chunk<NV>(a.V, a.chunk, rw.rank);
  const int64_t nvmax = a.chunk / NV;
  unsigned *bm = (unsigned *)(stage + (a.staged ? nvmax : 0));
  const int64_t nwords = (nvmax + 31) / 32;
  Stage st(stage, red.halves, ch, a.staged);

  /* The next row's mask, indices and upstream gradients are prefetched
   * into L1 a row ahead, and loaded before pass 1 (see ce_rows). */
  for (int64_t i = rw.first; i < a.N; i += rw.step) {
    const In *row = (const In *)a.x + i * a.xs;
    const int64_t in = i + rw.step;
    if (in < a.N) {
      if (a.mask) prefetch_l1(a.mask + in * a.ms);
      if (a.dlogp && a.K > 0) {
        prefetch_index(a.idx, a.idx64, in * a.is);
        prefetch_l1(a.dlogp + in * a.dlps);
      }
      if (a.dent) prefetch_l1(a.dent + in * a.dents);
    }
    if (a.mask && !a.mask[i * a.ms]) {
      zero_chunk<NV>(DynChunkOut<NV>(a.dx, a.dxt, i * a.dxs, ch, a.V), ch);
      continue;
    }
    const LpUp up = lp_upstream(a, i);

    const bool in_al = is_aligned16(row);
    const RowPart<In> part = {row, ch, a.V, in_al};
    Acc acc;
    acc.init(X);
    const bool one_max = first_pass<ENTROPY>(a.staged, st, part, true, X, Smooth{}, acc, &red);
    /* Its barriers also order the previous row's bitmap reads before the clear. */
    Part P = reduce_row(acc, k, ENTROPY, false, &red, rw, one_max);
    for (int64_t q = threadIdx.x; q < nwords; q += blockDim.x)
      bm[q] = 0u;
    const LpGrad<ENTROPY> G(X, P.s, P.bad, up);
    float *const kv = kept_vals<In>(a.keep, i);   /* entries: the K indices, then the argmax */
    if constexpr (std::is_same<In, float>::value) /* the only logits keep is asked with */
      if (rw.rank == 0 && threadIdx.x == 0) {
        if (a.keep.state) { /* the finish reads no label */
          lmloss_rowstate x;
          x.s = P.s, x.wy = 0.0f;
          x.flags = part_flags(P);
          lmloss_rowstate_pack(&x, a.keep.state + i * LMLOSS_ROW_STATE_COLS);
        }
        for (int64_t q = 0; q < a.K; q++)
          keep_col(a.keep, i, (int)q, ld_index(a.idx, a.idx64, i * a.is + q), a.V);
        keep_col(a.keep, i, (int)a.K, G.s.a, a.V);
      }
    G.flag(a, i, ch, NV, bm);

    const DynChunkOut<NV> out(a.dx, a.dxt, i * a.dxs, ch, a.V);
    const auto kout = noting<NV>(
        out, [&](int v) { return kv && flagged(bm, v); },
        [&](int64_t j, float g) {
          for (int64_t q = 0; q < a.K; q++)
            if (ld_index(a.idx, a.idx64, i * a.is + q) == j) kv[q] = g;
          if (j == G.s.a) kv[a.K] = g;
        },
        ch.jb, a.V);
    auto body = [&](int v, const Raw<In> &rv, auto cap) {
      write_grad(X, rv, kout, v, cap, [&](const float *w, float *g) {
        G.template fill<NV>(a, i, X, ch.jb + (int64_t)v * NV, flagged(bm, v), w, g);
      });
    };

    /* the next row, copied in unless masked */
    const bool has = a.staged && in < a.N && (!a.mask || a.mask[in * a.ms]);
    const NextRow<In> next(has, a.x, in, a.xs, part);
    second_pass(a.staged, st, part, next, X.f.cap > 0.0f, body);
  }
  rw.finish();
}

/* The held plan (held.cuh) takes the recomputing backward of one index a
 * row without the entropy's gradient, softcap or kept entries. The row's
 * scalars (mask, index, upstream gradient) are loaded with its vectors,
 * not before them (see ce_held): a masked row is read too. */
static bool lp_held_applies(const LpArgs &a, bool entropy) {
  return !a.stats && !entropy && a.dlogp && a.K == 1 && a.vh == a.V && a.X.f.cap == 0.0f &&
         !a.keep.state && !a.keep.vals;
}

template <typename In, typename O, bool CLUSTER>
__global__ void HELD_BOUNDS(In, CLUSTER) lp_held(LpArgs a) {
  constexpr int NV = elt<In>::NV;
  __shared__ HeldSmem sm;
  __shared__ HeldSlots<HELD_SHARED_SLOTS> slots;
  const int64_t i = blockIdx.x / a.cs;
  HeldRow<In, CLUSTER, HELD_SHARED_SLOTS> h(&sm, &slots, a.cs, a.chunk, a.V);
  const In *xrow = (const In *)a.x + i * a.xs;
  h.load<true>(xrow, a.V);
  /* after the row's loads (see ce_held) */
  const bool on = !a.mask || a.mask[i * a.ms];
  const long long j = ld_index(a.idx, a.idx64, i * a.is);
  const float D = a.dlogp[i * a.dlps];
  O *drow = (O *)a.dx + i * a.dxs;
  if (!on) { /* the whole cluster returns here */
    zero_chunk<NV>(ChunkOut<O, NV>(drow, h.ch, a.V), h.ch);
    h.settle();
    return;
  }
  h.arrive();
  const Xf &X = a.X;
  const float k = X.f.k;
  const bool ok = h.stats(X) && j >= 0 && j < a.V;
  const float m = h.m, inv = 1.0f / (1.0f + h.rs);
  /* The index's entry (LpGrad::entry for K = 1), by the thread holding it;
   * 1 - p there is R / (1 + R) at the max. */
  const int64_t jj = j - h.ch.jb;
  const int vj = ok && jj >= 0 && j < h.ch.je ? (int)(jj / NV) : -1, ej = (int)(jj % NV);
  float gj = 0.0f;
  if (vj >= 0 && h.holds(vj)) {
    const float x = h.at(vj, ej);
    const bool top = x == m;
    const float pj = cexp(X, top ? 0.0f : fmaxf(x - m, X.dmin)) * inv;
    gj = (top ? D * (h.rs * inv) : D - D * pj) * k;
  }
  /* dx_j = -k D p_j off the index */
  h.store_exp(X, xrow, ChunkOut<O, NV>(drow, h.ch, a.V), ok ? -inv * D * k : NAN, vj, ej, gj);
}

/* A merged state's statistics, empty (a NaN row) where it has none. */
__device__ __forceinline__ lmloss_rowstat merged_stats(const float *state, int64_t vocab) {
  const lmloss_rowstate x = lmloss_rowstate_unpack(state, vocab);
  return lmloss_rowstate_ok(&x) ? x.s : lmloss_rowstat_empty();
}

/* Row i's statistics: its merged state's, or the forward's saved ones. */
__device__ __forceinline__ lmloss_rowstat saved_stats(const LpArgs &a, int64_t i) {
  return a.state ? merged_stats(a.state + i * a.sts, a.vh)
                 : lmloss_rowstat_load(a.stats + i * a.sts, a.vh);
}

static_assert(SLICE_BS == LMLOSS_SAVED_MAX_K + 1, "a thread per index and one for the argmax");
static_assert(SLICE_U * SLICE_BS * 4 == LMLOSS_TILE_INPLACE_COLS, "a tile row of floats per CTA");

/* The backward from the forward's saved statistics: no reduction, so
 * each logit is read once and its gradient written once, a copy's
 * traffic, on the slice plan (slice_grid). Why that shape: each
 * thread's SLICE_U 16-byte loads are issued before anything waits (the
 * row's scalars are formed while they fly), and 128-thread CTAs, six to
 * an SM, keep the loads in flight across the CTAs' barriers: measured
 * (BENCHMARKS.md) against 8 x 256 (three CTAs an SM), 4 x 256, 16 x 128,
 * and a persistent grid loading a CTA's next slice while it writes the
 * current one. The hot loop has no exact-entry test: the slice's exact
 * entries (thread q: index q, thread K: the argmax; more than SLICE_BS
 * of them: lp_late_entries) are formed from their logits and stored over
 * the fast form after it, and into the fused head's kept entries
 * (a.keep) when asked. Only where
 * dlogits alias the logits do the stores wait for the entries' logits
 * (index, then logit: two dependent loads): a barrier there for every
 * CTA held the whole slice's stores behind them. */
template <typename In, typename O, bool ENTROPY>
__global__ void __launch_bounds__(SLICE_BS, 6) lp_bwd_saved(LpArgs a) {
  constexpr int NV = elt<In>::NV;
  const Xf &X = a.X;
  const Chunk ch = my_chunk<NV>(a.V, a.chunk, blockIdx.x);
  /* dlogits alias the logits exactly or not at all (lmloss_check_alias;
   * the fused head's in-place tiles share the slab's pointer) */
  const bool in_place = a.dx == a.x;
  for (int64_t i = blockIdx.y; i < a.N; i += gridDim.y) {
    O *drow = (O *)a.dx + i * a.dxs;
    if (a.mask && !a.mask[i * a.ms]) {
      zero_chunk<NV>(ChunkOut<O, NV>(drow, ch, a.V), ch);
      continue;
    }
    const In *row = (const In *)a.x + i * a.xs;
    const RowPart<In> part = {row, ch, a.V, is_aligned16(row)};
    const lmloss_rowstat s = saved_stats(a, i);
    const int q = threadIdx.x;
    const long long c = q == a.K             ? s.a
                        : q < a.K && a.dlogp ? ld_index(a.idx, a.idx64, i * a.is + q)
                                             : -1;
    SliceVecs<In> sv;
    sv.load(part);
    const LpGrad<ENTROPY> G(X, s, false, lp_upstream(a, i));
    const long long cx = c - a.j0; /* its column in x */
    const bool mine = cx >= ch.jb && cx < ch.je;
    const float gc = mine ? G.entry_dx(a, i, X, c, tof(row[cx])) : 0.0f;
    if (a.keep.vals && q <= a.K) { /* entry q: the index's, then the argmax's */
      const int64_t e = i * a.keep.stride + q;
      if (a.j0 == 0 && blockIdx.x == 0) {
        a.keep.cols[e] = c;
        if (c < 0 || c >= a.vh) a.keep.vals[e] = NAN;
      }
      if (mine) a.keep.vals[e] = gc;
    }
    /* the entries' logits are read before any store over them: in place
     * only (elsewhere the stores go out while the entries' dependent
     * loads, index then logit, are in flight) */
    if (in_place) __syncthreads();
    sv.write(X, ChunkOut<O, NV>(drow, ch, a.V), ch.nv,
             [&](int, const float *w, float *g) { G.template fast<NV>(X, w, g); });
    __syncthreads(); /* the entries over the fast form (a column held
                        twice, an index at the argmax, gets one value twice) */
    if (mine) drow[cx] = fromf<O>(gc);
  }
}

/* After lp_bwd_saved, where a row has more entries than its CTAs have
 * threads (K >= SLICE_BS: the fused head's tiles of many indices, F32
 * logits, not in place): those past them, a thread each, in a kernel of
 * their own so that the common case's registers do not pay for it. */
template <typename O, bool ENTROPY> __global__ void lp_late_entries(LpArgs a) {
  const Xf &X = a.X;
  const int64_t per = a.K + 1 - SLICE_BS;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < a.N * per;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = t / per, e = SLICE_BS + t % per;
    if (a.mask && !a.mask[i * a.ms]) continue;
    const lmloss_rowstat s = saved_stats(a, i);
    const long long c = e == a.K ? s.a : ld_index(a.idx, a.idx64, i * a.is + e), cx = c - a.j0;
    if (cx < 0 || cx >= a.V) continue;
    const LpGrad<ENTROPY> G(X, s, false, lp_upstream(a, i));
    ((O *)a.dx)[i * a.dxs + cx] =
        fromf<O>(G.entry_dx(a, i, X, c, ((const float *)a.x)[i * a.xs + cx]));
  }
}

template <typename In>
static lmloss_status launch_fwd(const DevInfo &d, LpArgs &a, bool entropy, cudaStream_t st) {
  auto k = entropy ? lp_fwd<In, true> : lp_fwd<In, false>;
  return launch_rows(k, k, d, elt<In>::NV, 0, 0, st, a, "log_probs");
}

template <typename In, typename O>
static lmloss_status launch_saved(LpArgs &a, bool entropy, cudaStream_t st) {
  if (a.N <= 0) return LMLOSS_OK;
  const dim3 grid = slice_grid(a.V, a.N, elt<In>::NV, &a.chunk);
  if (entropy)
    lp_bwd_saved<In, O, true><<<grid, SLICE_BS, 0, st>>>(a);
  else
    lp_bwd_saved<In, O, false><<<grid, SLICE_BS, 0, st>>>(a);
  const lmloss_status s = check_launch("log_probs_backward (saved statistics)");
  if constexpr (std::is_same<In, float>::value) {
    const int64_t n = a.N * (a.K + 1 - SLICE_BS);
    if (s != LMLOSS_OK || n <= 0) return s;
    const unsigned blocks = (unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
    if (entropy)
      lp_late_entries<O, true><<<blocks, 256, 0, st>>>(a);
    else
      lp_late_entries<O, false><<<blocks, 256, 0, st>>>(a);
    return check_launch("log_probs_backward (saved statistics, late entries)");
  }
  return s;
}

/* The saved statistics' kernel for dlogits of any dtype. */
template <typename In>
static lmloss_status launch_saved_for(LpArgs &a, bool entropy, cudaStream_t st) {
  switch (a.dxt) {
  case LMLOSS_BF16: return launch_saved<In, bf16>(a, entropy, st);
  case LMLOSS_F16: return launch_saved<In, f16>(a, entropy, st);
  default: return launch_saved<In, float>(a, entropy, st);
  }
}

/* The staged kernels take every gradient dtype at run time, the held
 * ones those launch_held_for builds. */
template <typename In>
static lmloss_status launch_bwd(const DevInfo &d, LpArgs &a, bool entropy, cudaStream_t st) {
  if (a.stats && a.K <= LMLOSS_SAVED_MAX_K) return launch_saved_for<In>(a, entropy, st);
  lmloss_status s;
  if (lp_held_applies(a, entropy) && launch_held_for<In>(a.dxt, [&](auto o) {
        using O = typename decltype(o)::type;
        return launch_held(lp_held<In, O, false>, lp_held<In, O, true>, d, elt<In>::NV, a.dx,
                           a.dxs * (int64_t)sizeof(O), st, a, "log_probs_backward", &s);
      }))
    return s;
  using K = void (*)(LpArgs);
  const K k256 = wide_row_kernel<In, K>([&](auto in) {
    using I = typename decltype(in)::type;
    return entropy ? lp_bwd<I, true, 256> : lp_bwd<I, false, 256>;
  });
  return launch_rows(entropy ? lp_bwd<In, true> : lp_bwd<In, false>, k256, d, elt<In>::NV, 1, 1, st,
                     a, "log_probs_backward");
}

template <typename In>
static lmloss_status dispatch(const DevInfo &d, LpArgs &a, bool entropy, int bwd, cudaStream_t st) {
  return bwd ? launch_bwd<In>(d, a, entropy, st) : launch_fwd<In>(d, a, entropy, st);
}

static LpArgs common_args(const lmloss_tensor *logits, const lmloss_tensor *index,
                          const lmloss_tensor *mask, const lmloss_transform *tr) {
  LpArgs a = {};
  a.x = logits->data;
  a.N = logits->rows;
  a.V = a.vh = logits->cols;
  a.xs = logits->row_stride;
  if (lmloss_present(index)) {
    a.idx = index->data;
    a.idx64 = index->dtype == LMLOSS_I64;
    a.is = index->row_stride;
    a.K = index->cols;
  }
  if (lmloss_present(mask)) {
    a.mask = (const unsigned char *)mask->data;
    a.ms = mask->row_stride;
  }
  a.X = make_xf(*tr);
  return a;
}

/* A backward's upstream gradients, output and saved statistics. */
static void backward_args(LpArgs &a, const lmloss_tensor *dlogp, const lmloss_tensor *dentropy,
                          const lmloss_tensor *dlogits, const lmloss_tensor *stats) {
  if (lmloss_present(dlogp)) {
    a.dlogp = (const float *)dlogp->data;
    a.dlps = dlogp->row_stride;
  } else {
    a.K = 0;
  }
  if (lmloss_present(dentropy)) {
    a.dent = (const float *)dentropy->data;
    a.dents = dentropy->row_stride;
  }
  a.dx = dlogits->data;
  a.dxs = dlogits->row_stride;
  a.dxt = dlogits->dtype;
  if (stats) {
    a.stats = (float *)stats->data;
    a.sts = stats->row_stride;
  }
}

static lmloss_status run(LpArgs &a, lmloss_dtype in, bool entropy, int bwd,
                         const lmloss_context *ctx) {
  DevInfo d;
  lmloss_status s = dev_info(&d);
  if (s != LMLOSS_OK) return s;
  cudaStream_t st = stream_of(ctx);
  switch (in) {
  case LMLOSS_BF16: return dispatch<bf16>(d, a, entropy, bwd, st);
  case LMLOSS_F16: return dispatch<f16>(d, a, entropy, bwd, st);
  default: return dispatch<float>(d, a, entropy, bwd, st);
  }
}

} // namespace lmc

extern "C" lmloss_status
lmloss_cuda_log_probs(const lmloss_context *ctx, const lmloss_tensor *logits,
                      const lmloss_tensor *index, const lmloss_tensor *mask,
                      const lmloss_transform *tr, const lmloss_tensor *logp,
                      const lmloss_tensor *entropy, const lmloss_tensor *stats) {
  lmc::LpArgs a = lmc::common_args(logits, index, mask, tr);
  if (lmloss_present(logp)) {
    a.logp = logp->data;
    a.lps = logp->row_stride;
    a.lpt = logp->dtype;
  } else {
    a.K = 0;
  }
  if (lmloss_present(entropy)) {
    a.ent = (float *)entropy->data;
    a.ents = entropy->row_stride;
  }
  if (stats) { /* with t, which a backward with dentropy needs */
    a.stats = (float *)stats->data;
    a.sts = stats->row_stride;
  }
  return lmc::run(a, logits->dtype, a.ent || a.stats, 0, ctx);
}

extern "C" lmloss_status
lmloss_cuda_log_probs_backward(const lmloss_context *ctx, const lmloss_tensor *logits,
                               const lmloss_tensor *index, const lmloss_tensor *mask,
                               const lmloss_transform *tr, const lmloss_tensor *dlogp,
                               const lmloss_tensor *dentropy, const lmloss_tensor *dlogits,
                               const lmloss_tensor *stats, lmloss_row_keep *keep) {
  lmc::LpArgs a = lmc::common_args(logits, index, mask, tr);
  if (keep) a.keep = *keep;
  if (keep && logits->dtype != LMLOSS_F32)
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "CUDA: kept gradient entries of F32 logits only");
  if (keep && stats) /* the fused head's tiles take lmloss_cuda_lp_backward_finish */
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "CUDA: kept entries of whole rows from saved "
                                               "statistics");
  lmc::backward_args(a, dlogp, dentropy, dlogits, stats);
  return lmc::run(a, logits->dtype, a.dent != NULL, 1, ctx);
}

/* The log-probs' phases over a vocabulary shard (lmloss.h): the states
 * by the forward's one pass, the backward's finish by the saved
 * statistics' kernel from the merged states or saved statistics (x holds
 * columns col0.. of vocab; a fused head's vocab tile is such a shard). */
extern "C" lmloss_status lmloss_cuda_lp_state(const lmloss_context *ctx,
                                              const lmloss_tensor *logits,
                                              const lmloss_tensor *index, const lmloss_tensor *mask,
                                              const lmloss_transform *tr, const lmloss_shard *sh,
                                              const lmloss_tensor *state) {
  lmc::LpArgs a = lmc::common_args(logits, index, mask, tr);
  a.K = 0; /* no log-probs written: the index is the state's label */
  a.j0 = sh->col0;
  a.vh = sh->vocab;
  a.state = (float *)state->data;
  a.sts = state->row_stride;
  return lmc::run(a, logits->dtype, sh->entropy, 0, ctx);
}

extern "C" lmloss_status lmloss_cuda_lp_backward_finish(
    const lmloss_context *ctx, const lmloss_tensor *logits, const lmloss_tensor *index,
    const lmloss_tensor *mask, const lmloss_transform *tr, const lmloss_shard *sh,
    const lmloss_tensor *state, const lmloss_tensor *dlogp, const lmloss_tensor *dentropy,
    const lmloss_tensor *dlogits, lmloss_row_keep *keep) {
  const bool in_place = dlogits->data == logits->data;
  if (in_place && dlogits->dtype != logits->dtype && logits->cols > LMLOSS_TILE_INPLACE_COLS)
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED, "CUDA: a tile of %lld columns written over itself",
                       (long long)logits->cols); /* backend.h */
  const int64_t K = lmloss_present(dlogp) ? index->cols : 0;
  if ((in_place || keep || logits->dtype != LMLOSS_F32) && K > LMLOSS_SAVED_MAX_K)
    return lmloss_fail(LMLOSS_ERR_UNSUPPORTED,
                       "CUDA: more than %d indices a row, in place, with kept entries or on "
                       "16-bit logits",
                       LMLOSS_SAVED_MAX_K);
  lmc::LpArgs a = lmc::common_args(logits, index, mask, tr);
  a.j0 = sh->col0;
  a.vh = sh->vocab;
  const bool saved = state->cols == LMLOSS_ROW_STATS;
  lmc::backward_args(a, dlogp, dentropy, dlogits, saved ? state : NULL);
  if (!saved) {
    a.state = (float *)state->data;
    a.sts = state->row_stride;
  }
  if (keep) a.keep = *keep;
  const bool entropy = a.dent != NULL;
  cudaStream_t st = lmc::stream_of(ctx);
  switch (logits->dtype) {
  case LMLOSS_BF16: return lmc::launch_saved_for<lmc::bf16>(a, entropy, st);
  case LMLOSS_F16: return lmc::launch_saved_for<lmc::f16>(a, entropy, st);
  default: return lmc::launch_saved_for<float>(a, entropy, st);
  }
}
