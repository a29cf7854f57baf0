/*
 * staged.cuh - the row kernels' own plan (every row the held plan of
 * held.cuh does not take): the per-thread max-split accumulator, its block
 * and cluster reductions, the stage (a CTA's chunk of a two-pass row in
 * shared memory, filled by bulk copies), the two passes over a chunk, the
 * gradient's per-vector store, and the launch plan (make_plan,
 * launch_rows). Built on common.cuh; the row layout is common.cuh's.
 */
#ifndef LMLOSS_CUDA_STAGED_CUH
#define LMLOSS_CUDA_STAGED_CUH

#include <cooperative_groups.h>

#include "common.cuh"

namespace lmc {

namespace cg = cooperative_groups;

/* Vector v of a CTA's chunk of a gradient row: w = the transform of the
 * logits x, then fill(w, g) gives the gradient in z units (times k where
 * there is no softcap: the kernels fold k into their coefficients), then
 * the softcap's chain rule and the store (out: a ChunkOut). cap: whether
 * the transform has a softcap (flag_on). */
template <typename In, typename Out, typename Fill, typename Cap>
__device__ __forceinline__ void write_grad(const Xf &X, const Raw<In> &rv, const Out &out, int v,
                                           Cap cap, Fill fill) {
  constexpr int NV = elt<In>::NV;
  float x[NV], g[NV];
  unpack<In, NV>(rv, x);
  if (flag_on(cap)) { /* X.f.cap > 0; without softcap w = x, nothing to keep */
    float w[NV];
#pragma unroll
    for (int e = 0; e < NV; e++)
      w[e] = x[e];
    xform_vec<NV>(X, w);
    fill(w, g);
#pragma unroll
    for (int e = 0; e < NV; e++)
      g[e] *= lmloss_xform_dzdx(&X.f, x[e]);
  } else {
    fill(x, g);
  }
  out.store(v, g);
}

/* ------------------------------------------------------------------ */
/* Per-thread max-split accumulator                                    */
/* ------------------------------------------------------------------ */

/* State in w units for the max, r as in rowstats.h, tn = sum e_j p_j with
 * p_j = (w_j - m) k log2(e) <= 0 (so t = -tn ln 2), u and c for label
 * smoothing (summed only where vec's smoothing is on). r and tn are
 * summed against ref (each term off by the common factor 2^ml, see Ref):
 * true_r() and true_tn() give the sums against m. The vector fast path
 * (no new max, no NaN) costs one FMA, ex2 and add per element (and the
 * max of the vector while the thread may still meet a new max or its
 * argmax). */
struct Acc {
  float m, mref, r, tn, u, c;
  Ref ref;
  long long a;
  int bad, fin; /* fin: saw a logit > -inf (tracked under softcap only) */
  bool look;    /* this thread holds m and has not met its first occurrence */

  __device__ __forceinline__ void init(const Xf &X) {
    m = -INFINITY;
    mref = -FLT_MAX;
    ref.mh = -FLT_MAX; /* -inf logits give ex2(-inf) = 0 before any max is set */
    ref.ml = 0.0f;
    r = tn = u = c = 0.0f;
    a = -1;
    bad = 0;
    fin = X.f.cap > 0.0f ? 0 : 1;
    look = false;
  }

  /* The transform of a loaded vector (its first column at j0(), computed
   * only where needed), checking the raw logits: NaN and +inf make the
   * row non-finite even where softcap would map them to a finite w; -inf
   * is legal (softcap maps it to -cap), but a row of only -inf is
   * non-finite (without softcap that is the empty state). The lanes past
   * V are padding, not logits: -inf there stays -inf, adding nothing. */
  template <int NV, typename J0>
  __device__ __forceinline__ void xform(const Xf &X, float *x, J0 j0, int64_t V) {
    if (X.f.cap > 0.0f) {
      bool ninf = false;
#pragma unroll
      for (int i = 0; i < NV; i++) {
        if (x[i] != x[i] || x[i] == INFINITY) bad = 1;
        if (x[i] > -INFINITY)
          fin = 1;
        else
          ninf = true;
        x[i] = lmloss_xform_w(&X.f, x[i]);
      }
      if (ninf && j0() + NV > V) {
        const int64_t jb = j0();
#pragma unroll
        for (int i = 0; i < NV; i++)
          if (jb + i >= V) x[i] = -INFINITY;
      }
    }
  }

  /* The max is never found element by element: it is set from outside,
   * before the vectors that hold it are added (see first_pass), either
   * once (seed: the CTA's max over a staged chunk) or per batch (raise: a
   * warp's max over its next vectors, the same for every lane). Mt is this
   * thread's own max over the same vectors: a thread holding the new max
   * looks for its first occurrence, the argmax. */
  __device__ __forceinline__ void seed(const Xf &X, float Mt, float M) {
    if (M != M) bad = 1; /* a NaN in the chunk: the row is NaN */
    if (!(M > -INFINITY)) return;
    m = mref = M;
    ref.set(X, M);
    look = Mt == M;
  }

  __device__ __forceinline__ float true_r() const { return r * ref.s(); }
  __device__ __forceinline__ float true_tn() const { return fmaf(-ref.ml, r, tn) * ref.s(); }

  /* Rescale the sums to a larger max M once. A thread that holds no
   * argmax yet (its sums are against m, the warp's) has no 1 to carry. */
  __device__ __forceinline__ void raise(const Xf &X, float M, float Mt) {
    if (Mt != Mt) bad = 1;
    if (!(M > m)) return;
    if (m > -INFINITY) {
      const float rt = true_r(), base = a >= 0 ? 1.0f + rt : rt;
      const float p = fmaxf(m - M, X.dmin) * X.kh, sc = ex2(p); /* cexp, keeping p */
      tn = sc * (true_tn() + p * base);
      r = base * sc;
      u = fmaf((M - m) * X.f.k, c, u);
    }
    m = mref = M;
    ref.set(X, M);
    const float s = fmaf(ref.ml, LN2, 1.0f); /* back to sums against ref */
    tn = fmaf(ref.ml, r, tn) * s;
    r *= s;
    a = -1;
    look = Mt == M;
  }

  /* Whether any of the vector's w equals v (one predicate chain: the
   * index search below runs only on the vector that holds it). */
  template <int NV> __device__ __forceinline__ static bool hit(const float *w, float v) {
    bool h = false;
#pragma unroll
    for (int i = 0; i < NV; i++)
      h |= w[i] == v;
    return h;
  }

  /* Add a vector (w, already transformed; its first element at j0(),
   * computed only where needed) against m. The vector holding this
   * thread's first occurrence of m (see look) has that entry taken out
   * (-inf), so that the exp loop adds everything else, ties included (a
   * tie adds its 1 to r). STAGED: the caller knows that vector (slot_hit);
   * else each vector is searched while the thread looks. (A lambda for
   * the test, capturing w, put the streamed forward's vector in local
   * memory.) */
  template <bool ENTROPY, bool STAGED, int NV, typename J0>
  __device__ __forceinline__ void vec(const Xf &X, float *w, J0 j0, int64_t V, bool smoothing,
                                      const float *cw, int64_t cw_stride, bool slot_hit) {
    if (smoothing) {               /* smoothing sums, the argmax's own term is 0 */
      if (!cw && j0() + NV <= V) { /* the common case: unit weights, a whole vector */
        float d = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; i++)
          d += mref - w[i];
        u = fmaf(d, X.f.k, u);
        c += (float)NV;
      } else {
        const int64_t jb = j0();
#pragma unroll
        for (int i = 0; i < NV; i++) {
          if (jb + i < V) {
            float cj = cw ? cw[(jb + i) * cw_stride] : 1.0f;
            u = fmaf(cj, (mref - w[i]) * X.f.k, u);
            c += cj;
          }
        }
      }
    }
    if (STAGED ? slot_hit : look && hit<NV>(w, m)) {
      int im = NV;
#pragma unroll
      for (int i = NV - 1; i >= 0; i--)
        if (w[i] == m) im = i;
      if (im < NV) {
#pragma unroll
        for (int i = 0; i < NV; i++)
          if (i == im) w[i] = -INFINITY;
        a = j0() + im;
        look = false;
      }
    }
    /* A -inf logit gives ex2(-inf) = 0; only the entropy term, 0 * p,
     * needs the clamp. STAGED: the vector's terms add pairwise (a chain
     * of log2(NV) adds, not NV, for the few warps of a staged CTA); the
     * streamed forward adds them in turn (pairwise there spilled out of
     * its 64 registers). */
    float e[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) {
      const float p = ENTROPY ? fmaxf(ref.p(X, w[i]), X.pmin) : ref.p(X, w[i]);
      e[i] = ex2(p);
      if (ENTROPY) tn = fmaf(e[i], p, tn);
      if (!STAGED) r += e[i];
    }
    if (STAGED) {
#pragma unroll
      for (int h = NV / 2; h > 0; h /= 2)
#pragma unroll
        for (int i = 0; i < h; i++)
          e[i] += e[i + h];
      r += e[0];
    }
  }
};

/* ------------------------------------------------------------------ */
/* Block and cluster reduction of the row state                        */
/* ------------------------------------------------------------------ */

/* A partial row: the merged state, the (u, c) of sub-states holding only
 * -inf (which the merge drops as empty, but which label smoothing must
 * still see), the NaN flag and whether it saw a logit > -inf (Acc::fin).
 * 48 bytes: three 16-byte stores to a cluster peer. */
struct Part {
  lmloss_rowstat s;
  float ue, ce;
  int bad, fin;
};
static_assert(sizeof(Part) == 48, "Part travels as three 16-byte words");

/* A part's lmloss_rowstate flags (a label's is the family's to add). */
__device__ __forceinline__ int part_flags(const Part &P) {
  return (P.bad ? LMLOSS_STATE_NONFINITE : 0) | (P.fin ? LMLOSS_STATE_LOGIT : 0);
}

/* The slice plan of a finish that holds its part of a row in registers
 * (lp_bwd_saved, ce_tile): CTAs of SLICE_BS threads, SLICE_U vectors of
 * nv elements a thread, each issuing all its loads before the row's state
 * is read. A row's slices are equal (*chunk, in elements), a row per
 * blockIdx.y. */
constexpr int SLICE_U = 8, SLICE_BS = 128;

inline dim3 slice_grid(int64_t V, int64_t N, int nv, int64_t *chunk) {
  const int64_t vecs = (V + nv - 1) / nv, most = SLICE_U * SLICE_BS;
  const int64_t slices = (vecs + most - 1) / most;
  *chunk = (vecs + slices - 1) / slices * nv;
  return dim3((unsigned)slices, (unsigned)(N < 65535 ? N : 65535));
}

/* The most threads a row kernel runs (make_plan's larger block). */
constexpr int MAX_ROW_THREADS = 256;

/* Static shared memory of a row kernel: the reductions' slot per warp,
 * the block result, the parts its cluster peers push (one slot per rank,
 * double-buffered by row parity) and the mbarriers counting their bytes,
 * block_max's warp maxima and result, and the stage's two mbarriers
 * (Stage). */
struct RedSmem {
  Part warp[MAX_ROW_THREADS / 32];
  Part block;
  alignas(16) Part cluster[2][16];
  unsigned long long parts[2];
  float wmax[MAX_ROW_THREADS / 32];
  float bmax;
  unsigned long long halves[2];
};

/* The block max of the staged sweep (NaN if any thread saw one). Contains
 * __syncthreads: call uniformly. */
__device__ __forceinline__ float block_max(float M, RedSmem *sm) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    M = max_nan(M, __shfl_xor_sync(0xffffffffu, M, off));
  if ((threadIdx.x & 31) == 0) sm->wmax[threadIdx.x >> 5] = M;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = sm->wmax[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++)
      b = max_nan(b, sm->wmax[w]);
    sm->bmax = b;
  }
  __syncthreads();
  return sm->bmax;
}

/* A CTA's walk over the rows: its rank in the row's cluster, the rows it
 * visits (one cluster per row; it loops only past 2^31 / cs rows), and
 * how many rows it has reduced (the parity of the cluster slots and of
 * their mbarriers' phases). Construct it uniformly: in a cluster it
 * initializes the mbarriers the peers' parts land on, behind a cluster
 * barrier (no peer may push before they exist). finish() is the final
 * cluster barrier: no CTA leaves while a peer may still push to it. */
struct RowWalk {
  int cs, rank;
  unsigned nred;
  int64_t first, step;

  __device__ RowWalk(int cs_, RedSmem *sm)
      : cs(cs_), rank((int)(blockIdx.x % cs_)), nred(0), first(blockIdx.x / cs_),
        step(gridDim.x / cs_) {
#ifdef LMLOSS_SM90
    if (cs == 1) return;
    if (threadIdx.x == 0) mbar_init2(smem_addr(sm->parts));
    cg::this_cluster().sync();
#else
    (void)sm;
#endif
  }

  __device__ __forceinline__ void finish() const {
#ifdef LMLOSS_SM90
    if (cs > 1) cg::this_cluster().sync();
#endif
  }
};

/* Merge in a fixed order (xor butterflies within warps and over the
 * cluster ranks, warp slots in order): bit-reproducible. Every thread of
 * every CTA of the cluster returns the same row state. The lanes of a warp
 * share their max (seed or raise), so a warp's state is plain sums; each
 * lane holding an occurrence of the max took its first one out of r, so
 * all but the first (the lowest index) come back as 1 each. one_max (from
 * first_pass): all the CTA's warps share one finite max and add up the
 * same way; else the warps' states merge (lmloss_rowstat_merge). In a
 * cluster, warp 0 of each CTA pushes its part into every peer's slot with
 * st.async, which counts the bytes on the peer's mbarrier, and merges the
 * cs parts once its own mbarrier has them all: no cluster barrier, whose
 * release fence (MEMBAR.GPU) waited every row for the thread's gradient
 * stores in flight. A slot is pushed again two rows
 * later, after its owner has merged it and pushed the next row's part.
 * Contains __syncthreads: call uniformly. */
template <bool WHOLE_ROW = true>
__device__ __forceinline__ Part reduce_row(const Acc &acc, float k, bool entropy, bool smoothing,
                                           RedSmem *sm, RowWalk &walk, bool one_max) {
  const unsigned nred = walk.nred++;
  float r = acc.true_r(), t = entropy ? -acc.true_tn() * LN2 : 0.0f;
  float u = smoothing ? acc.u : 0.0f, c = smoothing ? acc.c : 0.0f;
  float cnt = acc.a >= 0 ? 1.0f : 0.0f;
  long long a = acc.a >= 0 ? acc.a : LLONG_MAX;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    r += __shfl_xor_sync(0xffffffffu, r, off);
    cnt += __shfl_xor_sync(0xffffffffu, cnt, off);
    a = min(a, __shfl_xor_sync(0xffffffffu, a, off));
    if (entropy) t += __shfl_xor_sync(0xffffffffu, t, off);
    if (smoothing) {
      u += __shfl_xor_sync(0xffffffffu, u, off);
      c += __shfl_xor_sync(0xffffffffu, c, off);
    }
  }
  const int bad = __any_sync(0xffffffffu, acc.bad), fin = __any_sync(0xffffffffu, acc.fin);
  const int nwarps = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    Part &w = sm->warp[threadIdx.x >> 5];
    w.s.m = acc.m, w.s.r = r, w.s.t = t, w.s.u = u, w.s.c = c, w.s.a = a;
    w.ue = cnt, w.ce = 0.0f; /* one_max: the count of occurrences, until added up */
    w.bad = bad, w.fin = fin;
    if (!one_max) {
      if (cnt > 0.0f) {
        w.s.r = r + (cnt - 1.0f);
        w.ue = 0.0f;
      } else { /* only -inf (or NaN): empty, but smoothing still sees it */
        w.s = lmloss_rowstat_empty();
        w.ue = u, w.ce = c;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < 32) { /* warp 0 merges the parts, the others wait */
    Part p = sm->warp[0];
    for (int w = 1; w < nwarps; w++) {
      const Part &o = sm->warp[w];
      if (one_max) {
        p.s.r += o.s.r, p.s.t += o.s.t, p.s.u += o.s.u, p.s.c += o.s.c;
        p.s.a = min(p.s.a, o.s.a);
      } else {
        p.s = lmloss_rowstat_merge(p.s, o.s, k);
      }
      p.ue += o.ue, p.ce += o.ce;
      p.bad |= o.bad, p.fin |= o.fin;
    }
    if (one_max) {
      p.s.r += p.ue - 1.0f;
      p.ue = p.ce = 0.0f;
    }
#ifdef LMLOSS_SM90
    const int cs = walk.cs;
    if (cs > 1) {
      const int lane = threadIdx.x;
      const unsigned slot = nred & 1u, phase = (nred >> 1) & 1u;
      const unsigned bar = smem_addr(&sm->parts[slot]);
      if (lane < cs) { /* lane q pushes this CTA's part to rank q */
        const unsigned dst = mapa(smem_addr(&sm->cluster[slot][walk.rank]), lane);
        const unsigned rbar = mapa(bar, lane);
        uint4 wd[3];
        memcpy(wd, &p, sizeof p);
#pragma unroll
        for (int h = 0; h < 3; h++)
          st_async16(dst + 16u * h, wd[h], rbar);
      }
      if (lane == 0) mbar_expect(bar, (unsigned)cs * (unsigned)sizeof(Part));
      mbar_wait(bar, phase);
      /* lane q < cs takes rank q's part; an xor butterfly (cs is a power
       * of two) merges them in log2(cs) steps on the warp's critical path
       * instead of cs - 1; lane 0's result is the row's, the same
       * sequence of merges in every CTA of the cluster */
      p = sm->cluster[slot][lane < cs ? lane : 0];
      for (int off = 1; off < cs; off <<= 1) {
        Part e;
        e.s.m = __shfl_xor_sync(0xffffffffu, p.s.m, off);
        e.s.r = __shfl_xor_sync(0xffffffffu, p.s.r, off);
        e.s.t = __shfl_xor_sync(0xffffffffu, p.s.t, off);
        e.s.u = __shfl_xor_sync(0xffffffffu, p.s.u, off);
        e.s.c = __shfl_xor_sync(0xffffffffu, p.s.c, off);
        e.s.a = __shfl_xor_sync(0xffffffffu, (long long)p.s.a, off);
        e.ue = __shfl_xor_sync(0xffffffffu, p.ue, off);
        e.ce = __shfl_xor_sync(0xffffffffu, p.ce, off);
        e.bad = __shfl_xor_sync(0xffffffffu, p.bad, off);
        e.fin = __shfl_xor_sync(0xffffffffu, p.fin, off);
        p.s = lmloss_rowstat_merge(p.s, e.s, k);
        p.ue += e.ue, p.ce += e.ce;
        p.bad |= e.bad, p.fin |= e.fin;
      }
    }
#else
    (void)nred;
#endif
    /* a row of only -inf is non-finite (fin is tracked under softcap);
     * !WHOLE_ROW keeps the flags apart, for a vocabulary shard's part,
     * where only -inf is an empty state */
    if (WHOLE_ROW) p.bad |= !p.fin;
    if (threadIdx.x == 0) sm->block = p;
  }
  __syncthreads();
  return sm->block;
}

/* The CTA's part of one row: the logits, its chunk, and whether 16-byte
 * loads apply. keep: a load that will be read again (from L2). */
template <typename In> struct RowPart {
  const In *row;
  Chunk ch;
  int64_t V;
  bool aligned;

  __device__ __forceinline__ Raw<In> load(int64_t v, bool keep) const {
    const int64_t j0 = ch.jb + v * elt<In>::NV;
    return keep ? load_vec<In, KEEP>(row, j0, V, aligned)
                : load_vec<In, STREAM>(row, j0, V, aligned);
  }
};

/* A thread's vectors of its row slice on the slice plan (slice_grid):
 * load issues all SLICE_U loads at once, before the row's state is read;
 * write stores their gradient, fill(v, w, g) forming vector v's g from
 * its transformed logits w, the softcap's form chosen once for the
 * slice. */
template <typename In> struct SliceVecs {
  Raw<In> rv[SLICE_U];

  __device__ __forceinline__ void load(const RowPart<In> &part) {
#pragma unroll
    for (int u = 0; u < SLICE_U; u++) {
      const int v = threadIdx.x + u * SLICE_BS;
      if (v < part.ch.nv) rv[u] = part.load(v, false);
    }
  }

  template <typename Out, typename Fill>
  __device__ __forceinline__ void write(const Xf &X, const Out &out, int64_t nv, Fill fill) const {
    auto run = [&](auto cap) {
#pragma unroll
      for (int u = 0; u < SLICE_U; u++) {
        const int v = threadIdx.x + u * SLICE_BS;
        if (v < nv)
          write_grad(X, rv[u], out, v, cap, [&](const float *w, float *g) { fill(v, w, g); });
      }
    };
    if (X.f.cap > 0.0f)
      run(std::true_type{});
    else
      run(std::false_type{});
  }
};

/* Label smoothing's sums in the first pass (on), with class weights cw. */
struct Smooth {
  bool on;
  const float *cw;
  int64_t cws;
};

/* The max of a vector's w (NaN where it holds one): w of its raw max,
 * one tanh a vector under softcap instead of NV. w(x) = c tanh(s x / c)
 * increases, and so does its float form but at tanhf's change of method,
 * |s x / c| = 0.6, where it steps back one ulp between two adjacent
 * floats (checked over every pair of floats). There m can lie an ulp
 * below another element's w, whose term is then e^(ulp), not <= 1: the
 * sums stay exact about m, which an element holds. Transformed element
 * by element, the streamed pass's softcap loop kept both forms and
 * spilled; this, and that loop compiled apart (first_pass), made the
 * softcap forward much faster. */
template <bool CAP, typename In>
__device__ __forceinline__ float vec_max(const Xf &X, const Raw<In> &r) {
  const float m = raw_max(r);
  return CAP ? lmloss_xform_w(&X.f, m) : m;
}

/* ------------------------------------------------------------------ */
/* The stage: a CTA's chunk of a two-pass row in shared memory         */
/* ------------------------------------------------------------------ */

/* The stage holds vector v of the CTA's chunk in slot v (16 bytes); thread
 * t reads slots t, t + B, ... (q = 0, 1, ...). It is filled in two halves,
 * vectors [0, h) and [h, nv) with h = nh B, so thread t's slots q < nh
 * are exactly its first-half ones: the max sweep starts on the first half
 * while the second is in flight, and the gradient pass hands the first
 * half to the next row as soon as every thread has written its part of
 * it. The whole 16-byte vectors of an aligned row come in by one bulk
 * copy per half (sm_90; per-thread cp.async below); a vector crossing the
 * row's end, and every vector of an unaligned row, is loaded by the
 * thread that owns it with element loads padded with -inf. ready: the
 * stage already holds the row the next first_pass wants. Construct it
 * uniformly: when staged it initializes the barriers behind a
 * __syncthreads. */
struct Stage {
  unsigned slot0, mine, stride; /* shared addresses of slot 0 and slot t; B * 16 */
  unsigned bars, parity;        /* the halves' mbarriers and their next phase (sm_90) */
  int n, nh;                    /* this thread's vectors; vectors per thread in the first half */
  bool ready;

  __device__ Stage(uint4 *stage, unsigned long long *halves, const Chunk &ch, bool staged) {
    ready = false;
    if (!staged) return;
    const int t = threadIdx.x, B = blockDim.x, nv = (int)ch.nv; /* a chunk < 2^31 vectors */
    slot0 = smem_addr(stage);
    mine = slot0 + 16u * (unsigned)t;
    stride = 16u * (unsigned)B;
    bars = smem_addr(halves);
    parity = 0;
    n = nv > t ? (nv - 1 - t) / B + 1 : 0;
    nh = ((nv + B - 1) / B + 1) / 2;
#ifdef LMLOSS_SM90
    if (t == 0) mbar_init2(bars);
#endif
    __syncthreads();
  }

  __device__ __forceinline__ uint4 lds(int q) const { return lds16(mine + (unsigned)q * stride); }

  /* Start filling half `half` with the CTA's chunk of row p (all threads). */
  template <typename In> __device__ __forceinline__ void load(const RowPart<In> &p, int half) {
    constexpr int NV = elt<In>::NV;
    const int t = threadIdx.x, B = blockDim.x, nv = (int)p.ch.nv;
    const int whole = p.aligned ? (int)((p.ch.je - p.ch.jb) / NV) : 0; /* complete vectors */
    const int lo = half ? nh * B : 0, hi = half ? nv : min(nh * B, nv);
    const uint4 *src = (const uint4 *)(p.row + p.ch.jb); /* read only where aligned */
#ifdef LMLOSS_SM90
    if (t == 0) {
      const int wl = min(lo, whole), wh = min(hi, whole);
      const unsigned bytes = wh > wl ? 16u * (unsigned)(wh - wl) : 0u;
      mbar_expect(bars + 8u * half, bytes); /* no bytes: this arrival completes the phase */
      if (bytes) bulk_copy(slot0 + 16u * (unsigned)wl, src + wl, bytes, bars + 8u * half);
    }
    const int from = max(lo, whole);
#else
    const int from = lo;
#endif
    int q = from > t ? (from - t + B - 1) / B : 0;
    for (int v = t + q * B; v < hi; v += B, q++) {
#ifndef LMLOSS_SM90
      if (v < whole) {
        cp_async16(mine + (unsigned)q * stride, src + v);
        continue;
      }
#endif
      sts16(mine + (unsigned)q * stride, p.load(v, false).u);
    }
#ifndef LMLOSS_SM90
    cp_async_commit();
#endif
  }

  /* Wait until half `half` has landed (all threads; each load of a row is
   * waited once per half, in order). */
  __device__ __forceinline__ void wait(int half) {
#ifdef LMLOSS_SM90
    mbar_wait(bars + 8u * half, parity);
    if (half) parity ^= 1u;
#else
    if (half)
      cp_async_wait<0>();
    else
      cp_async_wait<1>();
#endif
  }
};

/* The first pass of a row kernel over a CTA's vectors, adding each to acc
 * in increasing v per thread (a thread meets its first argmax first).
 * Staged: the chunk is loaded into the stage (unless the previous row's
 * second pass already did), the thread sweeps its slots for the max, the
 * first half while the second is in flight, and notes the first slot
 * holding its own max; acc is seeded with the CTA's max, then adds every
 * slot, taking the argmax out of that noted slot; the return value says
 * whether the CTA's max is finite (then reduce_row can just add).
 * Unstaged: register loads, four in flight per thread (keep: held in L2
 * for the second pass); acc is raised to the warp's max before each batch
 * of four. A one-pass row (!keep, aligned) takes its whole batches without
 * bounds checks from one base (in the two-pass kernels, where unstaged
 * rows are rare, that second loop would cost registers). Each vector is
 * transformed and added to acc (with label smoothing's sums where sm.on).
 * Both forms' loops are compiled apart with and without softcap. */
template <bool ENTROPY, typename In>
__device__ __forceinline__ bool first_pass(bool staged, Stage &st, const RowPart<In> &p, bool keep,
                                           const Xf &X, Smooth sm, Acc &acc, RedSmem *red) {
  constexpr int NV = elt<In>::NV;
  const int64_t B = blockDim.x, t = threadIdx.x, nv = p.ch.nv;
  if (staged) {
    if (!st.ready) {
      st.load(p, 0);
      st.load(p, 1);
    }
    st.ready = false;
    const int n = st.n, n0 = min(n, st.nh), Bi = (int)B, ti = (int)t;
    auto sweep = [&](auto capped) {
      constexpr bool CAP = decltype(capped)::value;
      float M = -INFINITY;
      int qa = -1; /* the first slot holding this thread's max */
      auto mx = [&](int q) {
        Raw<In> r;
        r.u = st.lds(q);
        const float vm = vec_max<CAP>(X, r);
        if (vm > M) qa = q;
        M = max_nan(M, vm);
      };
      st.wait(0);
      for (int q = 0; q < n0; q++)
        mx(q);
      st.wait(1);
      for (int q = n0; q < n; q++)
        mx(q);
      const float Mb = block_max(M, red);
      acc.seed(X, M, Mb);
      auto add = [&](int q, bool slot_hit) {
        Raw<In> r;
        r.u = st.lds(q);
        float w[NV];
        unpack<In, NV>(r, w);
        const int v = ti + q * Bi;
        auto j0 = [&] { return p.ch.jb + (int64_t)v * NV; };
        if (CAP) acc.xform<NV>(X, w, j0, p.V);
        acc.vec<ENTROPY, true, NV>(X, w, j0, p.V, sm.on, sm.cw, sm.cws, slot_hit);
      };
      /* The slot holding the thread's first max is added after the others,
       * by every thread that has one at once: inside the loop the warp ran
       * its argmax search once per thread holding the CTA's max (ties are
       * common in 16-bit logits). */
      const int qh = acc.look ? qa : -1;
      for (int q = 0; q < n; q++)
        if (q != qh) add(q, false);
      if (qh >= 0) add(qh, true);
      return Mb > -INFINITY;
    };
    return X.f.cap > 0.0f ? sweep(std::true_type{}) : sweep(std::false_type{});
  }
  /* Compiled apart with and without softcap: left to the compiler, the
   * log-probs forward tested the softcap once per vector here. */
  auto stream = [&](auto capped) {
    constexpr bool CAP = decltype(capped)::value;
    auto step = [&](int64_t v, const Raw<In> &rv) {
      float w[NV];
      unpack<In, NV>(rv, w);
      auto j0 = [&] { return p.ch.jb + v * NV; };
      if (CAP) acc.xform<NV>(X, w, j0, p.V);
      acc.vec<ENTROPY, false, NV>(X, w, j0, p.V, sm.on, sm.cw, sm.cws, false);
    };
    /* Batches of four vectors per lane, the warp in step: the warp's max
     * over the batch is raised once for every lane before the batch is
     * added. */
    auto batch = [&](int64_t v0, Raw<In>(&r)[4], bool check) {
      float Mt = -INFINITY;
#pragma unroll
      for (int q = 0; q < 4; q++)
        Mt = max_nan(Mt, vec_max<CAP>(X, r[q]));
      float M = Mt;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        M = max_nan(M, __shfl_xor_sync(0xffffffffu, M, off));
      acc.raise(X, M, Mt);
#pragma unroll
      for (int q = 0; q < 4; q++)
        if (!check || t + v0 + q * B < nv) step(t + v0 + q * B, r[q]);
    };
    const int64_t t0 = t & ~(int64_t)31;
    int64_t v0 = 0;
    if (p.aligned && !keep) { /* whole batches of complete vectors: one base, no checks */
      const int64_t whole = (p.ch.je - p.ch.jb) / NV;
      const uint4 *base = (const uint4 *)(p.row + p.ch.jb) + t;
      for (; t0 + 31 + v0 + 3 * B < whole; v0 += 4 * B) {
        Raw<In> r[4];
#pragma unroll
        for (int q = 0; q < 4; q++) /* all four loads in flight before any use */
          r[q].u = ld16<STREAM>(base + v0 + q * B);
        batch(v0, r, false);
      }
    }
    for (; t0 + v0 < nv; v0 += 4 * B) { /* the rest: padded with -inf past the chunk */
      Raw<In> r[4];
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const int64_t v = t + v0 + q * B;
        if (v < nv) {
          r[q] = p.load(v, keep);
        } else {
#pragma unroll
          for (int i = 0; i < NV; i++)
            r[q].e[i] = neg_inf<In>();
        }
      }
      batch(v0, r, true);
    }
  };
  if (X.f.cap > 0.0f)
    stream(std::true_type{});
  else
    stream(std::false_type{});
  return false;
}

/* The CTA's next row, row in of x (row stride xs), which second_pass
 * copies into the stage when has (the kernel's rule: staged, in < N, and
 * a row it reads); the kernel's next first_pass then finds it ready. */
template <typename In> struct NextRow {
  bool has;
  RowPart<In> part;

  __device__ __forceinline__ NextRow(bool has_, const void *x, int64_t in, int64_t xs,
                                     const RowPart<In> &cur)
      : has(has_), part(cur) {
    if (has) {
      part.row = (const In *)x + in * xs;
      part.aligned = is_aligned16(part.row);
    }
  }
};

/* The second pass takes each thread's vectors back from the stage, or
 * re-reads them (ld) from L2 newest lines first, two in flight. Staged:
 * once every thread has written its first-half vectors (a barrier), the
 * next row's first half is loaded into them (when next.has), and its
 * second half after the second; so the next row's load overlaps this
 * row's arithmetic and stores without a second stage, and the stage is
 * free when the pass returns. Contains __syncthreads when staged: call
 * uniformly. */
template <typename In, typename Body>
__device__ __forceinline__ void second_pass_loops(bool staged, Stage &st, const RowPart<In> &p,
                                                  const NextRow<In> &next, Body body) {
  const int64_t nv = p.ch.nv;
  auto ld = [&](int64_t v) { return p.load(v, false); };
  if (staged) {
    const int n = st.n, n0 = min(n, st.nh), Bi = blockDim.x, ti = threadIdx.x;
    auto run = [&](int q0, int q1) {
      for (int q = q0; q < q1; q++) {
        Raw<In> rv;
        rv.u = st.lds(q);
        body(ti + q * Bi, rv);
      }
    };
    run(0, n0);
    __syncthreads();
    if (next.has) st.load(next.part, 0);
    run(n0, n);
    __syncthreads();
    if (next.has) st.load(next.part, 1);
    st.ready = next.has;
    return;
  }
  const int64_t B = blockDim.x, t = threadIdx.x;
  int64_t v = nv > t ? nv - 1 - ((nv - 1 - t) % B) : -1;
  for (; v - B >= 0; v -= 2 * B) {
    Raw<In> r0 = ld(v), r1 = ld(v - B);
    body((int)v, r0); /* a chunk holds < 2^31 vectors */
    body((int)(v - B), r1);
  }
  for (; v >= 0; v -= B)
    body((int)v, ld(v));
}

/* The second pass with body(v, rv, flag) given `flag` as a compile-time
 * constant (std::true_type or std::false_type): a row-uniform choice
 * (softcap, log-softmax) is made once per row, not per vector in the
 * loops. */
template <typename In, typename Body>
__device__ __forceinline__ void second_pass(bool staged, Stage &st, const RowPart<In> &p,
                                            const NextRow<In> &next, bool flag, Body body) {
  if (flag)
    second_pass_loops(staged, st, p, next,
                      [&](int v, const Raw<In> &rv) { body(v, rv, std::true_type{}); });
  else
    second_pass_loops(staged, st, p, next,
                      [&](int v, const Raw<In> &rv) { body(v, rv, std::false_type{}); });
}

/* Launch bounds of the CE and log-probs row kernels, built per block
 * size (make_plan's 128 or 256 threads). At 128 threads the stage's shared
 * memory lets five CTAs share an SM, so a thread may hold 96 registers;
 * bounds written for 256 threads (three CTAs) held the CE kernel to 80,
 * where its per-row code spilled, and the reloads stalled its warps every
 * row. The log-probs backward too: at 80 its gradient loop recomputed the
 * output address from the kernel's parameters for every vector. Only fp32
 * logits get a 256-thread kernel (wide_row_kernel): their rows past
 * 16 x 48 KB take chunks of 4096 vectors, where 128 threads ran slower
 * (BENCHMARKS.md); 16-bit rows reach such chunks only past 393216
 * columns, and a 256-thread kernel for every dtype doubled the build. The
 * softmax holds its own in 80 and keeps one kernel of 256 for both. */
#define ROW_BOUNDS(THREADS) __launch_bounds__(THREADS, (THREADS) == 128 ? 5 : 3)

/* The 256-thread kernel of a row kernel family for logits of type In,
 * make(type_tag<In>{}), or none (launch_rows then runs every plan at 128
 * threads): see ROW_BOUNDS. make is a generic lambda, so that the 16-bit
 * dtypes' 256-thread kernels, which no plan launches, are not built (a
 * plain lambda naming them built them). */
template <typename In, typename K, typename Make> static K wide_row_kernel(Make make) {
  if constexpr (std::is_same<In, float>::value)
    return make(type_tag<In>{});
  else
    return K{};
}

/* Launch plan of a row kernel: cluster size, threads, chunk (elements per
 * CTA) and whether the chunk is staged in shared memory. */
struct Plan {
  int cs, bs, staged;
  int64_t chunk; /* a multiple of NV */
  size_t smem;   /* dynamic shared memory bytes */
};

/* Why this shape: a two-pass row (anything that writes a gradient or a
 * softmax) is read from HBM once, into shared memory, by a cluster of cs
 * CTAs, each staging <= 48 KB so three or more CTAs share an SM. Each CTA
 * has its whole chunk in flight at once (two bulk copies, Stage), the
 * cluster's CTAs push their partial states into each other's shared
 * memory (reduce_row), and the CTAs at different stages of their rows
 * (loading, reducing, writing) keep HBM busy. The grid is persistent (as
 * many clusters as the device holds at once), and a CTA loads its next
 * row's chunk half by half as soon as the half's output is written
 * (second_pass), so its next load overlaps its current arithmetic
 * without a second stage (a two-slot stage was slower, since it cost a
 * CTA per SM); a cluster per row instead, scheduled by the hardware, was
 * slower everywhere. Per-thread cp.async copies, a generic stage pointer
 * and a cluster barrier per row each cost issue slots that the bulk
 * copies, shared addresses and pushed partial states do not.
 * A row too wide for 16 x 48 KB takes the largest cluster (16 CTAs,
 * three an SM, beat 8 CTAs of twice the chunk, one an SM). Only rows too
 * wide for 16 x (the opt-in limit) are read twice, the second time from
 * L2. A one-pass row (forward only) is streamed through registers by one
 * CTA: staging it in a cluster cost more in barriers than it saved. Nor
 * do smaller CTAs pay (staged chunks of <= 24 KB in 64-thread CTAs: two
 * warps idle per CTA waiting for its cluster's parts), nor one CTA
 * holding a whole row of up to 64 KB (no cluster) against a cluster of
 * two 32 KB chunks. Threads: 256, so each owns several 16-byte vectors,
 * but 128 for a chunk of fewer than 16384 vectors (4096 when staged):
 * there the per-row code of each warp (prologue, block max, the merge,
 * the row scalars) is paid by half the warps, and more CTAs (rows) share
 * an SM; the thresholds are the one-pass rows' measured best
 * (BENCHMARKS.md). wide_ok: the kernel has a 256-thread build (128
 * threads for every chunk otherwise: ROW_BOUNDS).
 * The plain forms of the two-pass ops take the held plan instead
 * (held.cuh: the row in registers, lean per-row code); this plan serves
 * their options, whose per-row code outweighed 64 elements a thread when
 * the held plan carried it (BENCHMARKS.md). */
static inline Plan make_plan(const DevInfo &d, int64_t V, int NV, int two_pass,
                             size_t extra_per_vector_bits, int maxcs, bool wide_ok) {
  Plan p = {};
  if (!two_pass) maxcs = 1;
  const int64_t nvec = (V + NV - 1) / NV;
  auto bytes = [&](int cs) {
    int64_t v = (nvec + cs - 1) / cs;
    return v * 16 + (v + 31) / 32 * 4 * (int64_t)extra_per_vector_bits;
  };
  for (int cs = 1; two_pass && cs <= maxcs && !p.cs; cs *= 2)
    if (bytes(cs) <= 48 * 1024) p.cs = cs;
  if (two_pass && !p.cs && bytes(maxcs) <= d.smem_optin - 8 * 1024) p.cs = maxcs;
  p.staged = p.cs != 0;
  if (!p.staged) {
    /* spread the row over a cluster so fewer rows (less L2) are in flight */
    p.cs = 1;
    while (p.cs < maxcs && p.cs < 8 && (nvec + p.cs - 1) / p.cs > 8192)
      p.cs *= 2;
  }
  const int64_t nvc = (nvec + p.cs - 1) / p.cs;
  p.chunk = nvc * NV;
  p.bs = wide_ok && nvc >= (p.staged ? 4096 : 16384) ? MAX_ROW_THREADS : 128;
  p.smem =
      (p.staged ? (size_t)nvc * 16 : 0) + (size_t)((nvc + 31) / 32) * 4 * extra_per_vector_bits;
  return p;
}

/* Plan, set the kernel's shared-memory and cluster attributes, and launch
 * one cluster per row, or for staged rows as many clusters as the device
 * holds (see make_plan); rows beyond the grid are looped over. Clusters of
 * 16 are non-portable: where the device cannot schedule one, the plan
 * falls back to 8. k128 and k256 are the kernel built for the plan's 128
 * or 256 threads (one kernel may serve both; no k256: make_plan's
 * wide_ok). Sets the args' cs, chunk and staged. */
template <typename K, typename A>
static lmloss_status launch_rows(K k128, K k256, const DevInfo &d, int NV, int two_pass,
                                 size_t extra_per_vector_bits, cudaStream_t st, A &args,
                                 const char *what) {
  if (args.N <= 0) return LMLOSS_OK;
  for (int maxcs = d.cc_major >= 9 ? 16 : 1;; maxcs /= 2) {
    Plan p = make_plan(d, args.V, NV, two_pass, extra_per_vector_bits, maxcs, k256 != nullptr);
    const K kernel = p.bs == 128 ? k128 : k256;
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p.smem);
    if (e == cudaSuccess && p.cs > 8)
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess)
      return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA %s: attributes (shared memory %zu): %s",
                         what, p.smem, cudaGetErrorString(e));
    const int64_t maxrows = (int64_t)0x7fffffff / p.cs;
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg = cluster_launch(
        (unsigned)((args.N < maxrows ? args.N : maxrows) * p.cs), p.bs, p.smem, p.cs, st, &attr);
    const int resident = p.cs > 8 || p.staged ? resident_clusters(kernel, cfg, p.cs, d) : 0;
    if (p.cs > 8 && resident < 1) continue; /* try clusters of 8 */
    if (p.staged && resident > 0 && resident < (int64_t)cfg.gridDim.x / p.cs)
      cfg.gridDim = dim3((unsigned)resident * (unsigned)p.cs);
    args.cs = p.cs;
    args.chunk = p.chunk;
    args.staged = p.staged;
    e = cudaLaunchKernelEx(&cfg, kernel, args);
    if (e != cudaSuccess)
      return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA %s launch: %s", what,
                         cudaGetErrorString(e));
    return check_launch(what);
  }
}

} // namespace lmc

#endif
