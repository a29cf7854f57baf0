/*
 * common.cuh - shared pieces of the CUDA backend: 16-byte vector loads and
 * stores of F32/BF16/F16 rows, the exp and its reference max, shared-memory
 * addressing, bulk copies and mbarriers, a CTA's chunk of a row and its
 * output, cluster launches, device queries and error mapping. The row
 * kernels' plans build on it: staged.cuh (the accumulator, reductions,
 * stage and make_plan) and held.cuh.
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

constexpr float LN2 = 0.693147180559945309f;
constexpr double LOG2E = 1.4426950408889634074;

/* ------------------------------------------------------------------ */
/* Element types                                                       */
/* ------------------------------------------------------------------ */

typedef __nv_bfloat16 bf16;
typedef __half f16;

/* A type as a value, for generic lambdas: their bodies are built only
 * for the types they are called with. */
template <typename T> struct type_tag { using type = T; };

template <typename T> struct elt {
  static constexpr int NV = 16 / sizeof(T); /* elements per 16-byte vector */
};

/* The lmloss_dtype of an element type. */
template <typename T> constexpr lmloss_dtype dtype_of() {
  return std::is_same<T, float>::value  ? LMLOSS_F32
         : std::is_same<T, bf16>::value ? LMLOSS_BF16
                                        : LMLOSS_F16;
}

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
 * (which adds nothing to any statistic; under softcap, where a logit of
 * -inf is -cap, Acc::xform keeps the padding at -inf). */
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

/* The max of a vector's raw elements (NaN if it holds one), in the
 * input's own packed type (vec_max transforms it). */
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

/* ------------------------------------------------------------------ */
/* Shared-memory addressing, bulk copies and mbarriers                 */
/* ------------------------------------------------------------------ */

__device__ __forceinline__ unsigned smem_addr(const void *p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
/* Shared-memory accesses by 32-bit shared address: through a generic
 * pointer the compiler re-derived the cluster window of the dynamic
 * stage (S2UR SR_CgaCtaId, four uniform instructions) on every vector.
 * Volatile keeps them after the waits for the copies that fill them. */
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
#endif
/* 16-byte asynchronous copies into shared memory by each thread of its
 * own slots (sm_80 and up): the staged plan's below sm_90, the held
 * plan's shared slots. */
__device__ __forceinline__ void cp_async16(unsigned dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* ------------------------------------------------------------------ */
/* A CTA's chunk of a row, its output, and the row's scalars           */
/* ------------------------------------------------------------------ */

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

/* Vector v of a chunk of an output row from base: whole (v < whole), or
 * by elements below lim (the elements from base to the row's end). */
template <typename O, int NV>
__device__ __forceinline__ void store_chunk_vec(O *base, int v, int whole, int64_t lim,
                                                const float *y) {
  O *p = base + v * NV;
  if (v < whole) {
    store_whole<O, NV>(p, y);
  } else {
#pragma unroll
    for (int i = 0; i < NV; i++)
      if ((int64_t)v * NV + i < lim) p[i] = fromf<O>(y[i]);
  }
}

/* Where a CTA writes its chunk of an output row, set once per row: a
 * whole vector (the row 16-byte aligned, the vector inside the chunk) is
 * one vector store at base + v NV, the rest (an unaligned row, the
 * vector that crosses V) element stores below lim. Per-vector 64-bit
 * address and bounds arithmetic was a large share of the gradient pass's
 * instructions. Three values only: a form that also kept the row, its
 * bounds and flags made the kernels spill. */
template <typename O, int NV> struct ChunkOut {
  O *base;     /* the chunk's first element */
  int64_t lim; /* elements from base to the end of the row */
  int whole;   /* vectors v < whole are stored whole */

  __device__ __forceinline__ ChunkOut(O *row, const Chunk &c, int64_t V)
      : base(row + c.jb), lim(V - c.jb), whole(is_aligned16(row) ? (int)((c.je - c.jb) / NV) : 0) {
    /* opaque: held in registers, not recomputed from the kernel's
     * parameters for every vector */
    asm("" : "+l"(base));
    asm("" : "+r"(whole));
  }

  __device__ __forceinline__ void store(int v, const float *y) const {
    store_chunk_vec<O, NV>(base, v, whole, lim, y);
  }
};

/* ChunkOut for an output dtype known at run time (F32, BF16 or F16), for
 * the staged plans: one kernel serves every output dtype at the cost of a
 * uniform branch a vector, where a type per dtype tripled the kernels the
 * build compiles. row: element `off` of out, a tensor of dtype dt. */
template <int NV> struct DynChunkOut {
  char *base;
  int64_t lim;
  int whole;
  lmloss_dtype dt;

  __device__ __forceinline__ DynChunkOut(void *out, lmloss_dtype dt, int64_t off, const Chunk &c,
                                         int64_t V)
      : lim(V - c.jb), dt(dt) {
    const int64_t es = dt == LMLOSS_F32 ? 4 : 2;
    char *row = (char *)out + off * es;
    base = row + c.jb * es;
    whole = is_aligned16(row) ? (int)((c.je - c.jb) / NV) : 0;
    asm("" : "+l"(base));
    asm("" : "+r"(whole));
  }

  template <typename O> __device__ __forceinline__ void put(int v, const float *y) const {
    store_chunk_vec<O, NV>((O *)base, v, whole, lim, y);
  }

  __device__ __forceinline__ void store(int v, const float *y) const {
    if (dt == LMLOSS_BF16)
      put<bf16>(v, y);
    else if (dt == LMLOSS_F16)
      put<f16>(v, y);
    else
      put<float>(v, y);
  }
};

/* A gradient row's store (write_grad's out) that also hands the final
 * value of each element of the vectors at(v) flags to note(j, g): the
 * fused head's exact entries (lmloss_row_keep), kept in fp32 beside a
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

/* Where a row op writes row i's kept entries (lmloss_row_keep): NULL for
 * a 16-bit input, whose kernels never keep (the fused head's slab is F32:
 * no stores compiled in them). Rank 0's thread 0 writes the columns, and
 * NaN for a column outside [0, V), which no CTA's chunk holds. */
template <typename In>
__device__ __forceinline__ float *kept_vals(const lmloss_row_keep &kp, int64_t i) {
  if constexpr (std::is_same<In, float>::value) return kp.vals ? kp.vals + i * kp.stride : nullptr;
  return nullptr;
}
__device__ __forceinline__ void keep_col(const lmloss_row_keep &kp, int64_t i, int s, long long c,
                                         int64_t V) {
  if (!kp.vals) return;
  kp.cols[i * kp.stride + s] = c;
  if (c < 0 || c >= V) kp.vals[i * kp.stride + s] = NAN;
}

/* Zeros over the CTA's chunk of an output row (the gradient of an ignored
 * or masked row); the Out (a ChunkOut) leaves out the padding past V. */
template <int NV, typename Out>
__device__ __forceinline__ void zero_chunk(const Out &out, const Chunk &c) {
  float z[NV];
#pragma unroll
  for (int e = 0; e < NV; e++)
    z[e] = 0.0f;
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

/* K values a thread folded over a block (a multiple of 32 threads, up to
 * 1024) in place: v[k] becomes op(k, a, b) folded over every thread's
 * v[k], in every thread, in a fixed order (each warp's shuffle tree, then
 * the warps in order), so the bits never depend on scheduling. One pair
 * of barriers for all K, and a third before sh may be written again; sh
 * holds K * (blockDim.x / 32 + 1) doubles. For the per-row or
 * per-sequence values of a call's final reductions, few next to its
 * N x V, so one block does them. */
template <int K, typename Op>
__device__ __forceinline__ void block_fold(double *v, double *sh, Op op) {
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int k = 0; k < K; k++) {
    double x = v[k];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      x = op(k, x, __shfl_down_sync(0xffffffffu, x, off));
    if ((threadIdx.x & 31) == 0) sh[warp * K + k] = x;
  }
  __syncthreads();
  if (threadIdx.x < K) {
    const int k = threadIdx.x;
    double s = sh[k];
    for (int w = 1; w < warps; w++)
      s = op(k, s, sh[w * K + k]);
    sh[warps * K + k] = s;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; k++)
    v[k] = sh[warps * K + k];
  __syncthreads(); /* read by all before a next call writes sh */
}

/* The block's sums of K values a thread, in place (block_fold). */
template <int K> __device__ __forceinline__ void block_sums(double *v, double *sh) {
  block_fold<K>(v, sh, [](int, double a, double b) { return a + b; });
}

/* The block's sum of v, to every thread (sh: blockDim.x / 32 + 1 doubles). */
__device__ __forceinline__ double block_sum(double v, double *sh) {
  block_sums<1>(&v, sh);
  return v;
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

} // namespace lmc

#endif
