/*
 * common.cuh - shared pieces of the CUDA backend: 16-byte vector loads and
 * stores of F32/BF16/F16 rows, the stage (bulk copies), the exp, the
 * per-thread max-split accumulator (its max set per staged CTA or per warp
 * batch), its block and cluster reductions, launch planning and error
 * mapping.
 *
 * Row layout seen by every kernel: a row is cut into `cs` chunks (one per
 * CTA of a thread-block cluster, cs = 1 without clusters), each a multiple
 * of NV elements (16 bytes of input), and a chunk into vectors of NV
 * elements. Thread t of a CTA owns vectors t, t + BS, ... in increasing
 * order, so its first argmax is the first one it sees; merges break ties
 * by the lower index.
 */
#ifndef LMLOSS_CUDA_COMMON_CUH
#define LMLOSS_CUDA_COMMON_CUH

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <limits.h>
#include <mutex>
#include <stdint.h>
#include <type_traits>

extern "C" {
#include "core/backend.h"
}
#include "math/dtype.h"
#include "math/rowstats.h"

/* Hopper features (bulk copies, st.async, cluster addressing); the host
 * never plans clusters or bulk copies below sm_90. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LMLOSS_SM90 1
#endif

namespace lmc {

namespace cg = cooperative_groups;

constexpr float LN2 = 0.693147180559945309f;
constexpr double LOG2E = 1.4426950408889634074;

/* ------------------------------------------------------------------ */
/* Element types                                                       */
/* ------------------------------------------------------------------ */

typedef __nv_bfloat16 bf16;
typedef __half f16;

template <typename T> struct elt {
  static constexpr int NV = 16 / sizeof(T); /* elements per 16-byte vector */
};

__device__ __forceinline__ float tof(float x) { return x; }
__device__ __forceinline__ float tof(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float tof(f16 x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T fromf(float x);
template <> __device__ __forceinline__ float fromf<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 fromf<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ f16 fromf<f16>(float x) { return __float2half_rn(x); }

template <typename T> __device__ __forceinline__ T neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -INFINITY; }
template <> __device__ __forceinline__ bf16 neg_inf<bf16>() { return __ushort_as_bfloat16(0xff80); }
template <> __device__ __forceinline__ f16 neg_inf<f16>() { return __ushort_as_half(0xfc00); }

/* 16 bytes of input, viewed as NV elements. */
template <typename T> union Raw {
  uint4 u;
  T e[elt<T>::NV];
};

/* Cache policy of a global load: KEEP lets L2 hold the line for a second
 * pass; STREAM marks it evict-first (read once). Neither uses the
 * non-coherent path, so exact aliasing of input and output stays safe. */
enum Hint { KEEP = 0, STREAM = 1 };

template <Hint H> __device__ __forceinline__ uint4 ld16(const void *p) {
  const uint4 *q = (const uint4 *)p;
  return H == STREAM ? __ldcs(q) : __ldcg(q);
}

/* Vector v of a row (elements j0 = v * NV ...): 16-byte load when the row
 * is aligned and the vector complete, else element loads padded with -inf
 * (which adds nothing to any statistic). */
template <typename T, Hint H>
__device__ __forceinline__ Raw<T> load_vec(const T *row, int64_t j0, int64_t V, bool aligned) {
  constexpr int NV = elt<T>::NV;
  Raw<T> r;
  if (aligned && j0 + NV <= V) {
    r.u = ld16<H>(row + j0);
  } else {
#pragma unroll
    for (int i = 0; i < NV; i++)
      r.e[i] = j0 + i < V ? row[j0 + i] : neg_inf<T>();
  }
  return r;
}

template <typename T, int NV> __device__ __forceinline__ void unpack(const Raw<T> &r, float *x) {
#pragma unroll
  for (int i = 0; i < NV; i++)
    x[i] = tof(r.e[i]);
}

/* bf16 is the top half of an fp32: one shift or mask per element. */
template <> __device__ __forceinline__ void unpack<bf16, 8>(const Raw<bf16> &r, float *x) {
  const unsigned q[4] = {r.u.x, r.u.y, r.u.z, r.u.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    x[2 * i] = __uint_as_float(q[i] << 16);
    x[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
  }
}

/* Store NV values at p, as vector stores: 16-byte aligned where
 * NV * sizeof(O) >= 16, else 8 bytes, 8-byte aligned. */
template <typename O, int NV> __device__ __forceinline__ void store_whole(O *p, const float *y) {
  constexpr int BYTES = NV * sizeof(O);
  union {
    O e[NV];
    uint4 q[BYTES >= 16 ? BYTES / 16 : 1];
    uint2 d;
  } o;
#pragma unroll
  for (int i = 0; i < NV; i++)
    o.e[i] = fromf<O>(y[i]);
  if (BYTES >= 16) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; i++)
      __stcs((uint4 *)p + i, o.q[i]);
  } else {
    __stcs((uint2 *)p, o.d);
  }
}

__device__ __forceinline__ bool is_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* ------------------------------------------------------------------ */
/* Transform and exponentials                                          */
/* ------------------------------------------------------------------ */

/* The transform with k * log2(e), and the clamp dmin of the max
 * difference below which exp underflows to 0 (keeps -inf logits out of
 * the arithmetic). */
struct Xf {
  lmloss_xform f;
  float kh;   /* k log2(e) */
  float dmin; /* (w - m) below this gives exp = 0 */
  float pmin; /* the same bound on the base-2 exponent */
};

static inline Xf make_xf(lmloss_transform t) {
  Xf x;
  x.f = lmloss_xform_make(t);
  double kk = (double)x.f.k * LOG2E;
  x.kh = (float)kk;
  x.dmin = (float)(-250.0 / kk);
  x.pmin = -250.0f;
  return x;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* NaN-propagating max (sm_80+): a NaN anywhere in a vector sends it down
 * the slow path, where it is flagged. */
__device__ __forceinline__ float max_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

/* exp(d k) for d = w - m <= 0 (already clamped to >= dmin), as one
 * multiply and ex2: the scalar form (the per-element loops use Ref). The
 * rounding of p = d k log2(e) perturbs each term by at most |p| 2^-24
 * relative (5e-6 at the underflow edge, p = -126), well inside the 1e-5
 * the suite holds every backend to; a compensated product cost four more
 * instructions per element, a third of the budget of a bandwidth-bound
 * pass. */
__device__ __forceinline__ float cexp(const Xf &X, float d) { return ex2(d * X.kh); }

/* The reference max of a row's exponentials, for one FMA per element:
 * m k log2(e) = mh + ml exactly (ml the FMA's residual, |ml| <= 2^-24
 * |mh|), so exp(k (w - m)) = ex2(fma(w, kh, -mh)) * 2^-ml. The per-element
 * exponent p' = fma(w, kh, -mh) is rounded once, relative to itself, as
 * good as (w - m) * kh; the common factor 2^-ml = 1 - ml ln 2 to within
 * (ml ln 2)^2 < 1e-8 is applied once per row (s), not per element. */
struct Ref {
  float mh, ml;
  __device__ __forceinline__ void set(const Xf &X, float m) {
    mh = m * X.kh;
    ml = fmaf(m, X.kh, -mh);
  }
  __device__ __forceinline__ float p(const Xf &X, float w) const { return fmaf(w, X.kh, -mh); }
  __device__ __forceinline__ float s() const { return fmaf(-ml, LN2, 1.0f); }
};

template <int NV> __device__ __forceinline__ void xform_vec(const Xf &X, float *x) {
  if (X.f.cap > 0.0f) {
#pragma unroll
    for (int i = 0; i < NV; i++)
      x[i] = lmloss_xform_w(&X.f, x[i]);
  }
}

/* A flag given at run time (bool) or at compile time (std::true_type,
 * std::false_type: second_pass's). */
__device__ __forceinline__ bool flag_on(bool f) { return f; }
template <bool F>
__device__ __forceinline__ constexpr bool flag_on(std::integral_constant<bool, F>) {
  return F;
}

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
 * smoothing (only when U). r and tn are summed against ref (each term off
 * by the common factor 2^ml, see Ref): true_r() and true_tn() give the
 * sums against m. The vector fast path (no new max, no NaN) costs one FMA,
 * ex2 and add per element (and the max of the vector while the thread may
 * still meet a new max or its argmax). */
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

  /* The transform of a loaded vector, checking the raw logits: NaN and
   * +inf make the row non-finite even where softcap would map them to a
   * finite w; -inf is legal (softcap maps it to -cap), but a row of only
   * -inf is non-finite (without softcap that is the empty state). */
  template <int NV> __device__ __forceinline__ void xform(const Xf &X, float *x) {
    if (X.f.cap > 0.0f) {
#pragma unroll
      for (int i = 0; i < NV; i++) {
        if (x[i] != x[i] || x[i] == INFINITY) bad = 1;
        if (x[i] > -INFINITY) fin = 1;
        x[i] = lmloss_xform_w(&X.f, x[i]);
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
   * memory: 12 bytes of spills, 16 more instructions in its loop.) */
  template <bool T, bool STAGED, int NV, typename J0>
  __device__ __forceinline__ void vec(const Xf &X, float *w, J0 j0, int64_t V, bool U,
                                      const float *cw, int64_t cw_stride, bool slot_hit) {
    if (U) {                       /* smoothing sums, the argmax's own term is 0 */
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
     * streamed forward adds them in turn (pairwise there spilled 8-16
     * bytes of its 64 registers). */
    float e[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) {
      const float p = T ? fmaxf(ref.p(X, w[i]), X.pmin) : ref.p(X, w[i]);
      e[i] = ex2(p);
      if (T) tn = fmaf(e[i], p, tn);
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
/* Shared-memory addressing, bulk copies and mbarriers                 */
/* ------------------------------------------------------------------ */

__device__ __forceinline__ unsigned smem_addr(const void *p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
/* Shared-memory accesses by 32-bit shared address: through a generic
 * pointer the compiler re-derived the cluster window of the dynamic
 * stage (S2UR SR_CgaCtaId, four uniform instructions) on every vector
 * (ncu's per-line counts, ce-grad, 54980e5). Volatile keeps them after
 * the waits for the copies that fill them. */
__device__ __forceinline__ uint4 lds16(unsigned a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a));
  return v;
}
__device__ __forceinline__ void sts16(unsigned a, const uint4 &v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

#ifdef LMLOSS_SM90
/* sm_90: the copy engine moves a half chunk in one instruction and counts
 * its bytes on an mbarrier; st.async stores into a cluster peer's shared
 * memory and counts them on the peer's mbarrier (mapa: a peer's address). */
/* Two mbarriers (8 bytes each from bars) with one arrival each, visible
 * to the cluster (thread 0 of the CTA; the caller's barrier follows). */
__device__ __forceinline__ void mbar_init2(unsigned bars) {
  for (int q = 0; q < 2; q++)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8u * q) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!done);
}
__device__ __forceinline__ unsigned mapa(unsigned a, int rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ void st_async16(unsigned a, const uint4 &v, unsigned bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, "
               "%4}, [%5];" ::"r"(a),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void *src, unsigned bytes,
                                          unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
               "[%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
#else
/* Below sm_90: 16-byte asynchronous copies by each thread of its own
 * slots, one commit group per half. */
__device__ __forceinline__ void cp_async16(unsigned dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

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
 * stores in flight (ncu, ce-grad, 54980e5: 2% of the stall samples on
 * the fence, 5% on the cluster wait). A slot is pushed again two rows
 * later, after its owner has merged it and pushed the next row's part.
 * Contains __syncthreads: call uniformly. */
__device__ __forceinline__ Part reduce_row(const Acc &acc, float k, bool T, bool U, RedSmem *sm,
                                           RowWalk &walk, bool one_max) {
  const unsigned nred = walk.nred++;
  float r = acc.true_r(), t = T ? -acc.true_tn() * LN2 : 0.0f;
  float u = U ? acc.u : 0.0f, c = U ? acc.c : 0.0f;
  float cnt = acc.a >= 0 ? 1.0f : 0.0f;
  long long a = acc.a >= 0 ? acc.a : LLONG_MAX;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    r += __shfl_xor_sync(0xffffffffu, r, off);
    cnt += __shfl_xor_sync(0xffffffffu, cnt, off);
    a = min(a, __shfl_xor_sync(0xffffffffu, a, off));
    if (T) t += __shfl_xor_sync(0xffffffffu, t, off);
    if (U) {
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
    /* a row of only -inf is non-finite (fin is tracked under softcap) */
    p.bad |= !p.fin;
    if (threadIdx.x == 0) sm->block = p;
  }
  __syncthreads();
  return sm->block;
}

/* Where this CTA's chunk of a row lies. */
struct Chunk {
  int64_t jb, je; /* elements [jb, je) */
  int64_t nv;     /* vectors in it */
};

template <int NV> __device__ __forceinline__ Chunk my_chunk(int64_t V, int64_t chunk, int rank) {
  Chunk c;
  c.jb = (int64_t)rank * chunk;
  c.je = c.jb + chunk < V ? c.jb + chunk : V;
  if (c.je < c.jb) c.je = c.jb;
  c.nv = (c.je - c.jb + NV - 1) / NV;
  return c;
}

/* Where a CTA writes its chunk of an output row, set once per row: a
 * whole vector (the row 16-byte aligned, the vector inside the chunk) is
 * one vector store at base + v NV, the rest (an unaligned row, the
 * vector that crosses V) element stores below lim. Per-vector 64-bit
 * address and bounds arithmetic (the former store_vec) was about a third
 * of the gradient pass's executed instructions (ncu's per-line counts,
 * ce-grad, 84f54d3). Three values only: a first form that also kept the
 * row, its bounds and flags made the kernels spill. */
template <typename O, int NV> struct ChunkOut {
  O *base;     /* the chunk's first element */
  int64_t lim; /* elements from base to the end of the row */
  int whole;   /* vectors v < whole are stored whole */

  __device__ __forceinline__ ChunkOut(O *row, const Chunk &c, int64_t V)
      : base(row + c.jb), lim(V - c.jb), whole(is_aligned16(row) ? (int)((c.je - c.jb) / NV) : 0) {
    /* opaque: held in registers, not recomputed from the kernel's
     * parameters for every vector (six instructions each, ncu, 1986d60) */
    asm("" : "+l"(base));
    asm("" : "+r"(whole));
  }

  __device__ __forceinline__ void store(int v, const float *y) const {
    O *p = base + v * NV;
    if (v < whole) {
      store_whole<O, NV>(p, y);
    } else {
#pragma unroll
      for (int i = 0; i < NV; i++)
        if ((int64_t)v * NV + i < lim) p[i] = fromf<O>(y[i]);
    }
  }
};

/* A gradient row's store (write_grad's out) that also hands the final
 * value of each element of the vectors at(v) flags to note(j, g): the
 * fused head's exact entries (lmloss_grad_keep), kept in fp32 beside a
 * 16-bit row. at(v) is the test the row's fill already makes for its
 * exact entries, and false throughout where nothing is kept. */
template <int NV, typename Out, typename At, typename Note> struct NotingOut {
  const Out &out;
  At at;
  Note note;
  int64_t jb, V; /* the chunk's first column; the row's width */

  __device__ __forceinline__ void store(int v, const float *y) const {
    out.store(v, y);
    if (at(v)) {
#pragma unroll
      for (int e = 0; e < NV; e++)
        if (jb + (int64_t)v * NV + e < V) note(jb + (int64_t)v * NV + e, y[e]);
    }
  }
};
template <int NV, typename Out, typename At, typename Note>
__device__ __forceinline__ NotingOut<NV, Out, At, Note> noting(const Out &out, At at, Note note,
                                                               int64_t jb, int64_t V) {
  return NotingOut<NV, Out, At, Note>{out, at, note, jb, V};
}

/* Where a row op writes row i's kept entries (lmloss_grad_keep): NULL for
 * a 16-bit input, whose kernels never keep (the fused head's slab is F32:
 * no stores compiled in them). Rank 0's thread 0 writes the columns, and
 * NaN for a column outside [0, V), which no CTA's chunk holds. */
template <typename In>
__device__ __forceinline__ float *kept_vals(const lmloss_grad_keep &kp, int64_t i) {
  if constexpr (std::is_same<In, float>::value) return kp.vals ? kp.vals + i * kp.stride : nullptr;
  return nullptr;
}
__device__ __forceinline__ void keep_col(const lmloss_grad_keep &kp, int64_t i, int s, long long c,
                                         int64_t V) {
  if (!kp.vals) return;
  kp.cols[i * kp.stride + s] = c;
  if (c < 0 || c >= V) kp.vals[i * kp.stride + s] = NAN;
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

/* Label smoothing's sums in the first pass (on), with class weights cw. */
struct Smooth {
  bool on;
  const float *cw;
  int64_t cws;
};

/* Zeros over the CTA's chunk of an output row (the gradient of an ignored
 * or masked row); ChunkOut leaves out the padding past V. */
template <typename In, typename O>
__device__ __forceinline__ void zero_chunk(O *row, const Chunk &c, int64_t V) {
  constexpr int NV = elt<In>::NV;
  float z[NV];
#pragma unroll
  for (int e = 0; e < NV; e++)
    z[e] = 0.0f;
  const ChunkOut<O, NV> out(row, c, V);
  for (int v = threadIdx.x; v < (int)c.nv; v += blockDim.x)
    out.store(v, z);
}

/* Start moving the line holding p into L1 (a load a row ahead of its use
 * whose value nothing waits for). */
__device__ __forceinline__ void prefetch_l1(const void *p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

/* Read a target / index of dtype I32 or I64, or prefetch it. */
__device__ __forceinline__ long long ld_index(const void *p, int is64, int64_t i) {
  return is64 ? ((const long long *)p)[i] : (long long)((const int *)p)[i];
}
__device__ __forceinline__ void prefetch_index(const void *p, int is64, int64_t i) {
  prefetch_l1(is64 ? (const void *)((const long long *)p + i) : (const void *)((const int *)p + i));
}

/* ------------------------------------------------------------------ */
/* Host side                                                           */
/* ------------------------------------------------------------------ */

static inline cudaStream_t stream_of(const lmloss_context *ctx) {
  return ctx ? (cudaStream_t)ctx->stream : (cudaStream_t)0;
}

static inline lmloss_status check_launch(const char *what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA %s: %s", what, cudaGetErrorString(e));
  return LMLOSS_OK;
}

struct DevInfo {
  int id, sms, cc_major, smem_optin;
};

static inline lmloss_status dev_info(DevInfo *d) {
  cudaError_t e = cudaGetDevice(&d->id);
  const int dev = d->id;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&d->sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&d->cc_major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&d->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess)
    return lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA device query: %s", cudaGetErrorString(e));
  return LMLOSS_OK;
}

/* The max of a vector's w (NaN if it holds one): in the input's own
 * packed type where w = x, else through the transform. */
__device__ __forceinline__ float max4(float a, float b, float c, float d) {
  return max_nan(max_nan(a, b), max_nan(c, d));
}
template <typename H2> __device__ __forceinline__ float packed_max(const uint4 &u) {
  H2 q[4];
  memcpy(q, &u, sizeof q);
  H2 x = __hmax2_nan(__hmax2_nan(q[0], q[1]), __hmax2_nan(q[2], q[3]));
  return max_nan(tof(x.x), tof(x.y));
}
__device__ __forceinline__ float raw_max(const Raw<float> &r) {
  return max4(r.e[0], r.e[1], r.e[2], r.e[3]);
}
__device__ __forceinline__ float raw_max(const Raw<bf16> &r) {
  return packed_max<__nv_bfloat162>(r.u);
}
__device__ __forceinline__ float raw_max(const Raw<f16> &r) { return packed_max<__half2>(r.u); }

template <bool CAP, typename In>
__device__ __forceinline__ float vec_max(const Xf &X, const Raw<In> &r) {
  if (!CAP) return raw_max(r);
  constexpr int NV = elt<In>::NV;
  float w[NV];
  unpack<In, NV>(r, w);
  xform_vec<NV>(X, w);
  float m = w[0];
#pragma unroll
  for (int i = 1; i < NV; i++)
    m = max_nan(m, w[i]);
  return m;
}
template <typename In> __device__ __forceinline__ float vec_max(const Xf &X, const Raw<In> &r) {
  return X.f.cap == 0.0f ? vec_max<false>(X, r) : vec_max<true>(X, r);
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
 * whether the CTA's max is finite (then reduce_row can just add). The
 * loops are compiled apart with and without softcap.
 * Unstaged: register loads, four in flight per thread (keep: held in L2
 * for the second pass); acc is raised to the warp's max before each batch
 * of four. A one-pass row (!keep, aligned) takes its whole batches without
 * bounds checks from one base (in the two-pass kernels, where unstaged
 * rows are rare, that second loop would cost registers). Each vector is
 * transformed and added to acc (with label smoothing's sums where sm.on). */
template <bool T, typename In>
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
        if (CAP) acc.xform<NV>(X, w);
        const int v = ti + q * Bi;
        acc.vec<T, true, NV>(
            X, w, [&] { return p.ch.jb + (int64_t)v * NV; }, p.V, sm.on, sm.cw, sm.cws, slot_hit);
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
  auto step = [&](int64_t v, const Raw<In> &rv) {
    float w[NV];
    unpack<In, NV>(rv, w);
    acc.xform<NV>(X, w);
    acc.vec<T, false, NV>(
        X, w, [&] { return p.ch.jb + v * NV; }, p.V, sm.on, sm.cw, sm.cws, false);
  };
  /* Batches of four vectors per lane, the warp in step: the warp's max
   * over the batch is raised once for every lane before the batch is
   * added. */
  auto batch = [&](int64_t v0, Raw<In>(&r)[4], bool check) {
    float Mt = -INFINITY;
#pragma unroll
    for (int q = 0; q < 4; q++)
      Mt = max_nan(Mt, vec_max(X, r[q]));
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
 * (softcap, log-softmax) is made once per row, not per vector (five
 * instructions a vector in the loops, ncu, 1986d60). */
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

/* Launch bounds of a row kernel instantiated per block size (make_plan's
 * 128 or 256 threads). At 128 threads the stage's shared memory lets five
 * CTAs share an SM, so a thread may hold 96 registers; bounds written for
 * 256 threads (three CTAs) held the CE kernel to 80, where its per-row code
 * spilled 48 bytes, whose reloads stalled its warps every row (ncu,
 * ce-grad, 8ce9185: 7% of the stall samples on local loads, all outside
 * the vector loops). The log-probs backward too: at 80 its gradient loop
 * recomputed the output address from the kernel's parameters for every
 * vector. The softmax holds its own in 80 and keeps one kernel for both. */
#define ROW_BOUNDS(BS) __launch_bounds__(BS, (BS) == 128 ? 5 : 3)

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
 * slower everywhere (H200, c0416f8: CE 1.75 against 1.68 ms and the
 * log-probs backward 1.80 against 1.65 at bf16 8192 x 152064, 0.21
 * against 0.20 and 0.23 against 0.21 at 4096 x 32768, softmax fp32
 * 4096 x 262144 2.73 against 2.41). Measured on the H200 (bf16 8192 x
 * 152064, CE fwd+bwd): per-thread cp.async copies, a generic stage
 * pointer and a cluster barrier per row took 2.11 ms (30 instructions per
 * logit issued, 54% of issue slots); the bulk copies and shared addresses
 * 1.92 ms, the pushed partial states 1.80-1.88 ms.
 * A row too wide for 16 x 48 KB takes the largest cluster (measured,
 * softmax fp32 V = 262144: 16 x 64 KB, three CTAs per SM, 3.16 ms against
 * 4.21 for 8 x 128 KB, one per SM). Only rows too wide for 16 x (the
 * opt-in limit) are read twice, the second time from L2. A one-pass row
 * (forward only) is streamed through registers by one CTA: measured on
 * the H200, staging it in a cluster cost more in barriers than it saved
 * (1.9 ms against 1.1 ms at bf16 8192 x 152064). Nor do smaller CTAs
 * pay: staged chunks of <= 24 KB in 64-thread CTAs (ten rows per SM, two
 * warps idle per CTA waiting for its cluster's parts) took 2.01 ms
 * against 1.67 (CE) and 2.00 against 1.66 (log-probs backward), clusters
 * of 16 at 8192 x 152064 (H200, cc94f5e + the change). Nor does one CTA
 * holding a whole row of up to 64 KB (no cluster, three CTAs per SM):
 * bf16 4096 x 32768 took 0.202-0.206 ms against 0.194-0.197 (CE) and
 * 0.209 against 0.207 (log-probs backward) with clusters of two 32 KB
 * chunks (H200, ec7720c + the change). Threads: 256, so each
 * owns several 16-byte vectors, but 128 for a chunk of fewer than 16384
 * vectors (4096 when staged): there the about 800 instructions a warp
 * spends on each row (ncu, ce-grad, 84f54d3: prologue, block max, the
 * merge, the row scalars) are paid by half the warps, and more CTAs
 * (rows) share an SM. Measured for one-pass rows (H200, bf16): at 4096 x
 * 32768, 128 threads below 8192 vectors against below 1024, log-probs
 * 0.079-0.080 against 0.089-0.090 ms, + entropy 0.080-0.081 against
 * 0.093-0.094, CE forward 0.128-0.130 against 0.144-0.145; below 16384
 * against below 8192, log-probs 0.138-0.141 against 0.146-0.147 ms at
 * 4096 x 65536, 0.493-0.497 against 0.515-0.516 at 8192 x 128256, + entropy
 * 0.513-0.514 against 0.545-0.546 there, CE forward even (0.787-0.790).
 * The plain forms of the two-pass ops take the held plan instead
 * (held.cuh: the row in registers, lean per-row code); this plan serves
 * their options, whose per-row code outweighed 64 elements a thread when
 * the held plan carried it (BENCHMARKS.md, fourteenth session). */
static inline Plan make_plan(const DevInfo &d, int64_t V, int NV, int two_pass,
                             size_t extra_per_vector_bits, int maxcs) {
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
  p.bs = nvc >= (p.staged ? 4096 : 16384) ? MAX_ROW_THREADS : 128;
  p.smem =
      (p.staged ? (size_t)nvc * 16 : 0) + (size_t)((nvc + 31) / 32) * 4 * extra_per_vector_bits;
  return p;
}

/* A launch of grid CTAs of bs threads in clusters of cs (none when cs =
 * 1); attr holds the cluster's dimension. */
static inline cudaLaunchConfig_t cluster_launch(unsigned grid, int bs, size_t smem, int cs,
                                                cudaStream_t st, cudaLaunchAttribute *attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(bs);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cs;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = cs > 1 ? 1 : 0;
  return cfg;
}

/* How many clusters of cs CTAs (CTAs when cs = 1) of this configuration
 * the device holds at once; 0 where it cannot schedule one. Cached per
 * kernel, device and configuration: the occupancy query costs host time
 * on every launch otherwise. */
template <typename K>
static int resident_clusters(K kernel, const cudaLaunchConfig_t &cfg, int cs, const DevInfo &d) {
  struct Entry {
    const void *k;
    int dev, cs, bs;
    size_t smem;
    int n;
  };
  static Entry cache[64];
  static int used = 0;
  static std::mutex mu;
  const void *key = reinterpret_cast<const void *>(kernel);
  const int bs = (int)cfg.blockDim.x;
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < used; i++) {
    const Entry &e = cache[i];
    if (e.k == key && e.dev == d.id && e.cs == cs && e.bs == bs && e.smem == cfg.dynamicSmemBytes)
      return e.n;
  }
  int n = 0;
  cudaError_t e =
      cs > 1 ? cudaOccupancyMaxActiveClusters(&n, kernel, &cfg)
             : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, bs, cfg.dynamicSmemBytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* not sticky */
    n = 0;
  } else if (cs == 1) {
    n *= d.sms;
  }
  if (used < 64) cache[used++] = Entry{key, d.id, cs, bs, cfg.dynamicSmemBytes, n};
  return n;
}

/* Plan, set the kernel's shared-memory and cluster attributes, and launch
 * one cluster per row, or for staged rows as many clusters as the device
 * holds (see make_plan); rows beyond the grid are looped over. Clusters of
 * 16 are non-portable: where the device cannot schedule one, the plan
 * falls back to 8. k128 and k256 are the kernel built for the plan's 128
 * or 256 threads (ROW_BOUNDS; one kernel may serve both). Sets the args'
 * cs, chunk and staged. */
template <typename K, typename A>
static lmloss_status launch_rows(K k128, K k256, const DevInfo &d, int NV, int two_pass,
                                 size_t extra_per_vector_bits, cudaStream_t st, A &args,
                                 const char *what) {
  if (args.N <= 0) return LMLOSS_OK;
  for (int maxcs = d.cc_major >= 9 ? 16 : 1;; maxcs /= 2) {
    Plan p = make_plan(d, args.V, NV, two_pass, extra_per_vector_bits, maxcs);
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
