/*
 * held.cuh - the held row plan: a two-pass row (a gradient or a softmax)
 * kept in registers from its load to its store, by one cluster of CTAs a
 * row (non-persistent: the hardware schedules the clusters). A grid of
 * the resident clusters whose CTAs loop over rows, each loading its next
 * row behind its stores, was slower: a new CTA issues all its loads at
 * once; a looping one issued its next row's one behind each store.
 *
 * Why this shape: such a row must move in once and out once. Each thread
 * loads all its vectors (64 KB a CTA: 256 threads of 16 vectors of 16
 * bytes, or 128 threads of 32) before it uses any, so the CTA's whole
 * chunk is in flight at once with no second read (SHARED of a thread's
 * vectors go to shared memory, see HeldRow); a cluster of 16 holds a row
 * of 1 MB (one CTA a row below sm_90, which has no clusters). Two or
 * three CTAs share an SM (held_threads), so that each CTA's loads cover
 * the others' reductions (8 vectors a thread were too few); held_plan
 * says which CTA a row takes. The statistics take two
 * CTA barriers (the CTA's max, then the max-split sum about it, so the
 * warps merge by plain adds) and, in a cluster, one push of each CTA's
 * (m, R) into every peer's shared memory, counted on the peer's mbarrier:
 * no cluster barrier after the start, none at exit (each CTA waits for
 * every part pushed into it, and a release fence there waited for the
 * stores in flight). The code a row costs besides its elements is kept to
 * about the reductions: the same plan built over the staged kernels'
 * general per-row code (options, general merges) ran far slower
 * (BENCHMARKS.md). So the plan serves the ops' plain
 * forms (see each op's *_held_applies); the others keep make_plan's.
 */
#ifndef LMLOSS_CUDA_HELD_CUH
#define LMLOSS_CUDA_HELD_CUH

#include "common.cuh"

namespace lmc {

constexpr int HELD_THREADS = 256; /* the most a CTA runs (HeldSmem's parts, HeldSlots) */
constexpr int HELD_VECS = 4096;   /* 16-byte vectors a CTA holds: T threads of 4096 / T */
constexpr int HELD_MAX_CS = 16;
constexpr int HELD_SHARED_SLOTS = 2; /* CE's and the log-probs backward's (HeldRow's SHARED) */
/* The GRPO pass's: its per-row formula's registers left thread 0 spilling
 * at two slots; six leave it next to none, and its rows ran faster. */
constexpr int HELD_GRPO_SHARED_SLOTS = 6;

struct HeldSmem {
  float wmax[HELD_THREADS / 32];
  float wsum[HELD_THREADS / 32];
  int wties[HELD_THREADS / 32];
  uint4 parts[HELD_MAX_CS]; /* rank q's (m, R), pushed by q */
  alignas(8) unsigned long long bar;
};

/* A held CTA's SHARED slots a thread in shared memory (HeldRow;
 * HeldSlots<0>: none). */
template <int SHARED> struct HeldSlots { uint4 v[SHARED][HELD_THREADS]; };
template <> struct HeldSlots<0> {};

/* Threads of a held CTA (64 KB in registers either way): one CTA a row
 * runs 256, two an SM (128 registers); a cluster's CTAs share an SM three
 * at a time, of 256 threads (80 registers) with 16-bit logits, of 128
 * (168) with fp32 ones, whose 256-thread form spilled (held_plan). 512
 * threads of 8 vectors two an SM (64 registers, no spill) were slower. */
__host__ __device__ constexpr int held_threads(int NV, bool cluster) {
  return cluster && NV == 4 ? 128 : 256;
}
#define HELD_BOUNDS(In, CLUSTER)                                                                   \
  __launch_bounds__(held_threads(elt<In>::NV, CLUSTER), (CLUSTER) ? 3 : 2)

/* The elementwise max of two vectors (NaN where either holds one), in the
 * packed type: the thread's vectors reduced so, then one raw_max, is
 * fewer instructions than a raw_max a vector, and was faster. */
template <typename H2>
__device__ __forceinline__ uint4 packed_vmax(const uint4 &a, const uint4 &b) {
  H2 p[4], q[4];
  memcpy(p, &a, sizeof p);
  memcpy(q, &b, sizeof q);
#pragma unroll
  for (int i = 0; i < 4; i++)
    p[i] = __hmax2_nan(p[i], q[i]);
  uint4 y;
  memcpy(&y, p, sizeof y);
  return y;
}
__device__ __forceinline__ Raw<float> raw_vmax(Raw<float> a, const Raw<float> &b) {
#pragma unroll
  for (int i = 0; i < 4; i++)
    a.e[i] = max_nan(a.e[i], b.e[i]);
  return a;
}
__device__ __forceinline__ Raw<bf16> raw_vmax(Raw<bf16> a, const Raw<bf16> &b) {
  a.u = packed_vmax<__nv_bfloat162>(a.u, b.u);
  return a;
}
__device__ __forceinline__ Raw<f16> raw_vmax(Raw<f16> a, const Raw<f16> &b) {
  a.u = packed_vmax<__half2>(a.u, b.u);
  return a;
}

/* The row's chunk in a held CTA, one CTA a row or a cluster's
 * (HELD_BOUNDS(In, CLUSTER) is its kernel's bound). SHARED of each
 * thread's VECS vectors go to shared memory (cp.async; 8 KB a CTA of 256
 * threads at SHARED = 2), the other IN_REGS to registers. With all 16 in
 * registers (80 a thread at three CTAs an SM) bf16 CE's kernel spilled,
 * and the spills' lines went out to DRAM under the streaming rows; at
 * SHARED = 2 it spills next to nothing, and CE and the log-probs backward
 * ran faster in clusters at every dtype (SHARED = 4 was slower again).
 * The GRPO pass takes more (HELD_GRPO_SHARED_SLOTS). The softmax ran
 * slower with shared slots, so it keeps SHARED = 0. */
template <typename In, bool CLUSTER, int SHARED = 0> struct HeldRow {
  static constexpr int NV = elt<In>::NV, VECS = HELD_VECS / held_threads(NV, CLUSTER);
  static constexpr int IN_REGS = VECS - SHARED; /* slots u < IN_REGS in registers */
  /* not Raw<In>: its 16-bit view had each load's registers repacked,
   * waiting for it, before the next load went out */
  uint4 r[IN_REGS];
  HeldSmem *sm;
  HeldSlots<SHARED> *sl;
  Chunk ch;
  int rank, cs;
  float m, rs; /* the row's max (w = x) and max-split sum R about it */
  Ref ref;     /* set at m */

  __device__ __forceinline__ HeldRow(HeldSmem *sm_, HeldSlots<SHARED> *sl_, int cs_, int64_t chunk,
                                     int64_t V)
      : sm(sm_), sl(sl_), rank((int)(blockIdx.x % cs_)), cs(cs_) {
    ch = my_chunk<NV>(V, chunk, rank);
  }
  __device__ __forceinline__ int vec(int u) const { return threadIdx.x + u * blockDim.x; }
  /* slot u of this thread: a register, or shared memory from IN_REGS on */
  __device__ __forceinline__ const uint4 &slot(int u) const {
    if constexpr (SHARED == 0)
      return r[u];
    else
      return u < IN_REGS ? r[u] : sl->v[u - IN_REGS][threadIdx.x];
  }
  __device__ __forceinline__ uint4 &slot(int u) {
    return const_cast<uint4 &>(static_cast<const HeldRow *>(this)->slot(u));
  }
  __device__ __forceinline__ Raw<In> raw(int u) const {
    Raw<In> q;
    q.u = slot(u);
    return q;
  }
  /* raw(u) for a second sweep that only some threads take: opaque, so
   * that the compiler does not keep the first sweep's unpacked elements
   * (128 floats a thread) live for it, in spilled registers. */
  __device__ __forceinline__ Raw<In> raw_again(int u) const {
    Raw<In> q;
    q.u = slot(u);
    asm("" : "+r"(q.u.x), "+r"(q.u.y), "+r"(q.u.z), "+r"(q.u.w));
    return q;
  }

  /* Issue every load of the thread's vectors (-inf past the chunk) of a
   * 16-byte aligned row (launch_held). The whole vectors are one
   * predicated 16-byte load each, straight into their registers: loads in
   * branches (load_vec's element path beside them) had ptxas copy each
   * result into its register before the next load went out, one load in
   * flight per thread. NC: plain non-coherent loads (ld.global.nc,
   * __ldg), which ran CE and the log-probs backward faster than
   * evict-first ones; else evict-first loads (ld.global.cs, __ldcs), which
   * the softmax keeps, as they ran it faster. Each element is
   * read before any CTA stores over it (in place too), so the read-only
   * path sees no stale line. The vector crossing V follows with element
   * loads. */
  template <bool NC> __device__ __forceinline__ void load(const In *row, int64_t V) {
    Raw<In> ninf;
#pragma unroll
    for (int e = 0; e < NV; e++)
      ninf.e[e] = neg_inf<In>();
    const uint4 *base = (const uint4 *)(row + ch.jb);
    const int whole = (int)((ch.je - ch.jb) / NV);
#pragma unroll
    for (int u = 0; u < IN_REGS; u++) {
      const int v = vec(u);
      r[u] = v < whole ? (NC ? __ldg(base + v) : __ldcs(base + v)) : ninf.u;
    }
#pragma unroll
    for (int u = IN_REGS; u < VECS; u++) {
      const int v = vec(u);
      if (v < whole)
        cp_async16(smem_addr(&slot(u)), base + v);
      else
        slot(u) = ninf.u;
    }
    if constexpr (SHARED > 0) cp_async_commit();
    if (whole < ch.nv) {
#pragma unroll
      for (int u = 0; u < VECS; u++) {
        const int v = vec(u);
        if (v >= whole && v < ch.nv)
          slot(u) = load_vec<In, STREAM>(row, ch.jb + (int64_t)v * NV, V, false).u;
      }
    }
  }
  /* Wait for the shared slots' copies: before their first read, and
   * before a CTA that loaded a row leaves without reading it. */
  __device__ __forceinline__ void settle() const {
    if constexpr (SHARED > 0) cp_async_wait<0>();
  }

  /* In a cluster: the mbarrier the peers' parts land on, made visible to
   * them by a cluster barrier whose wait stats() takes before pushing.
   * Call uniformly over the cluster, after load() (the loads in flight). */
  __device__ __forceinline__ void arrive() const {
#ifdef LMLOSS_SM90
    if (cs == 1) return;
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&sm->bar)) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
  }

  /* The row's m and rs in every thread of the cluster; true when they are
   * finite (no NaN, +inf or all -inf). Within the CTA, R about its max M
   * is S - 1, S the sum of every term (about 1 at each occurrence of M).
   * Where S < 2, R's low bits would be lost in a thread's sum that holds
   * an occurrence, so where a warp holding M sums to less than 2, its
   * threads holding M sum again without the occurrences, counting them
   * apart (R then = the sum + the count - 1, exact at a peaked row); where
   * the warp's sum is 2 or more, R >= 1 and a thread's rounding is its
   * sum's, small beside it. Tested on the thread's own sum instead, the
   * second sum ran in nearly every CTA of normal rows (the max's thread
   * sums little else), one warp's pass on each CTA's path to its stores.
   * A thread's plain sum costs an FMA, an ex2 and an add an element:
   * with the occurrences counted in every warp holding M (16-bit rows
   * often tie at their max), that sum was close to half of CE's
   * instructions. Contains __syncthreads: call uniformly. */
  __device__ __forceinline__ bool stats(const Xf &X) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    settle();
    Raw<In> vm = raw(0); /* see raw_vmax */
#pragma unroll
    for (int u = 1; u < VECS; u++)
      vm = raw_vmax(vm, raw(u));
    const float t = raw_max(vm);
    float M = t;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      M = max_nan(M, __shfl_xor_sync(0xffffffffu, M, off));
    if (lane == 0) sm->wmax[w] = M;
    __syncthreads();
    M = sm->wmax[0];
#pragma unroll
    for (int q = 1; q < HELD_THREADS / 32; q++)
      if (q < nw) M = max_nan(M, sm->wmax[q]);
    ref.set(X, M);
    float s = 0.0f;
    int ties = 0;
#pragma unroll
    for (int u = 0; u < VECS; u++) {
      float x[NV];
      unpack<In, NV>(raw(u), x);
#pragma unroll
      for (int e = 0; e < NV; e++)
        s += ex2(ref.p(X, x[e])); /* -inf: ex2(-inf) = 0 */
    }
    float sw = s;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      sw += __shfl_xor_sync(0xffffffffu, sw, off);
    if (__any_sync(0xffffffffu, t == M) && !(sw >= 2.0f)) { /* see the comment above */
      if (t == M) {
        s = 0.0f;
#pragma unroll
        for (int u = 0; u < VECS; u++) {
          float x[NV];
          unpack<In, NV>(raw_again(u), x);
#pragma unroll
          for (int e = 0; e < NV; e++) {
            const float p = ex2(ref.p(X, x[e]));
            s += x[e] < M ? p : 0.0f;
            ties += x[e] == M;
          }
        }
      }
      sw = s;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        sw += __shfl_xor_sync(0xffffffffu, sw, off);
        ties += __shfl_xor_sync(0xffffffffu, ties, off);
      }
    }
    if (lane == 0) sm->wsum[w] = sw, sm->wties[w] = ties;
    __syncthreads();
    s = sm->wsum[0];
    ties = sm->wties[0];
#pragma unroll
    for (int q = 1; q < HELD_THREADS / 32; q++)
      if (q < nw) s += sm->wsum[q], ties += sm->wties[q];
    lmloss_rowstat st = lmloss_rowstat_empty();
    if (M != -INFINITY) { /* else this CTA saw only -inf: an empty part */
      st.m = M;
      st.r = fmaf(s, ref.s(), (float)(ties - 1));
      st.a = rank;
    }
#ifdef LMLOSS_SM90
    if (cs > 1) {
      asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
      const unsigned bar = smem_addr(&sm->bar);
      if (threadIdx.x < cs)
        st_async16(mapa(smem_addr(&sm->parts[rank]), threadIdx.x),
                   make_uint4(__float_as_uint(st.m), __float_as_uint(st.r), (unsigned)st.a, 0u),
                   mapa(bar, threadIdx.x));
      if (threadIdx.x == 0) mbar_expect(bar, 16u * cs);
      mbar_wait(bar, 0);
      st = merge_parts(X, sm);
      ref.set(X, st.m);
    }
#endif
    m = st.m;
    rs = st.r;
    return lmloss_rowstat_finite(&st);
  }

  /* The cs parts merged by lmloss_rowstat_merge's rule, lane q of each
   * 16 holding part q: the largest m (NaN never: it reaches R) at its
   * lowest rank leads with its R, and each other nonempty part adds
   * (1 + R) exp((m_q - m) k) (cexp, as the elements' terms), summed by an
   * xor butterfly, whose adds commute: the same state, bit for bit, in
   * every thread of the cluster. A butterfly of lmloss_rowstat_merge
   * itself put four dependent shuffles and full merges between the
   * exchange and the stores, and was slower. */
  __device__ __forceinline__ lmloss_rowstat merge_parts(const Xf &X, const HeldSmem *sm) const {
    const int q = threadIdx.x & (HELD_MAX_CS - 1);
    const uint4 p = sm->parts[q < cs ? q : 0];
    const bool has = q < cs && (int)p.z >= 0;
    const float mq = __uint_as_float(p.x), rq = __uint_as_float(p.y);
    float M = has ? mq : -INFINITY;
#pragma unroll
    for (int off = HELD_MAX_CS / 2; off > 0; off >>= 1)
      M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off, HELD_MAX_CS));
    const unsigned tops = __ballot_sync(0xffffffffu, has && mq == M) & 0xffffu;
    const int lead = tops ? __ffs(tops) - 1 : -1;
    float t = !has ? 0.0f : q == lead ? rq : (1.0f + rq) * cexp(X, mq - M);
#pragma unroll
    for (int off = HELD_MAX_CS / 2; off > 0; off >>= 1)
      t += __shfl_xor_sync(0xffffffffu, t, off, HELD_MAX_CS);
    lmloss_rowstat st = lmloss_rowstat_empty();
    if (lead >= 0) st.m = M, st.r = t, st.a = lead;
    return st;
  }

  /* Whether this thread holds vector v of the chunk, and its element e
   * then (selects, not a register array indexed at run time). */
  __device__ __forceinline__ bool holds(int v) const {
    return v < ch.nv && v % (int)blockDim.x == (int)threadIdx.x;
  }
  __device__ __forceinline__ float at(int v, int e) const {
    Raw<In> q = raw(0);
#pragma unroll
    for (int u = 1; u < VECS; u++)
      if (vec(u) == v) q.u = slot(u);
    float x[NV];
    unpack<In, NV>(q, x);
    float y = x[0];
#pragma unroll
    for (int i = 1; i < NV; i++)
      if (i == e) y = x[i];
    return y;
  }

  /* out.store of f(x, y) for each of the thread's vectors in the chunk
   * (x its NV elements as floats, y the NV values to store) of row: the
   * sweep stores whole vectors only, and the one vector crossing V (the
   * output row is 16-byte aligned: launch_held) is read again from the
   * row (in place too: nothing has been stored over it) and stored by
   * elements after it, by the thread that holds it. The element path
   * inside the sweep, one branch a vector (out.store's), cost ptxas
   * registers through the whole sweep, and slowed rows that have no
   * crossing vector; the crossing vector taken from the registers
   * instead, before the sweep, spilled in it. */
  template <typename O, typename F>
  __device__ __forceinline__ void put(const In *row, const ChunkOut<O, NV> &out, F f) const {
#pragma unroll
    for (int u = 0; u < VECS; u++) {
      float x[NV], y[NV];
      unpack<In, NV>(raw(u), x);
      f(x, y);
      const int v = vec(u);
      if (v < out.whole) store_whole<O, NV>(out.base + v * NV, y);
    }
    const int v = out.whole;
    if (v < ch.nv && holds(v)) {
      float x[NV], y[NV];
      /* a chunk ends inside a vector only at V: ch.je = V */
      unpack<In, NV>(load_vec<In, STREAM>(row, ch.jb + (int64_t)v * NV, ch.je, false), x);
      f(x, y);
      out.store(v, y);
    }
  }

  /* Store c exp(k (x_j - m)) for every element of row, then g at element e of
   * vector v where this thread holds it (an exact entry; v = -1: none):
   * the softmax, and the gradients away from their exact entries. */
  template <typename O>
  __device__ __forceinline__ void store_exp(const Xf &X, const In *row, const ChunkOut<O, NV> &out,
                                            float c, int v, int e, float g) const {
    const float cr = c * ref.s(); /* the row factor 2^-ml of Ref */
    put(row, out, [&](const float *x, float *y) {
#pragma unroll
      for (int i = 0; i < NV; i++)
        y[i] = ex2(ref.p(X, x[i])) * cr; /* -inf: ex2(-inf) = 0 */
    });
    if (v >= 0 && holds(v)) out.base[v * NV + e] = fromf<O>(g); /* after its vector's store */
  }
};

/* Where the held plan applies to a row of V (cs = 0: it does not): one
 * CTA where it holds the row, else a cluster of the fewest CTAs that hold
 * it (of held_threads threads); each of as few warps as hold its chunk,
 * in a cluster only where the chunks are at least 3/4 full (48 KB).
 * Measured side by side (BENCHMARKS.md): one CTA a row runs fastest at
 * 256 threads two an SM; a cluster's CTAs three an SM, of 256 threads
 * with 16-bit logits and of 128 with fp32 ones (256 spilled there), and
 * a cluster of the fewest CTAs beat a power-of-two one of part-full
 * chunks and the staged plan. A cluster pays its exchange once a row,
 * which a part-full chunk does not cover (there the staged plan is
 * faster). Nor do more CTAs fill the GPU better: clusters of 6, 7 or 8
 * for a row that 5 hold were no faster.
 * Clusters of more than 8 are non-portable: launch_held checks the device
 * can schedule one. */
struct HeldPlan {
  int cs, bs;
  int64_t chunk;
};

static inline HeldPlan held_plan(const DevInfo &d, int64_t N, int64_t V, int NV) {
  HeldPlan p = {0, 0, 0};
  const int64_t nvec = (V + NV - 1) / NV, need = (nvec + HELD_VECS - 1) / HELD_VECS;
  if (N <= 0 || V <= 0 || need > (d.cc_major >= 9 ? HELD_MAX_CS : 1) || N > INT_MAX / need)
    return p;
  const int cs = (int)need, threads = held_threads(NV, cs > 1);
  const int64_t nvc = (nvec + cs - 1) / cs, u = HELD_VECS / threads;
  if (cs > 1 && 4 * nvc < 3 * HELD_VECS) return p;
  p.cs = cs;
  p.chunk = nvc * NV;
  p.bs = (int)(32 * ((nvc + 32 * u - 1) / (32 * u)));
  return p;
}

/* Launch the kernel of the plan's CTA (one: one CTA a row, cluster: a
 * cluster's) over the args' N rows, whose output rows start at out,
 * out_row_bytes apart; it sets the args' cs and chunk. False (nothing
 * launched) where the plan does not apply, *s the launch's status
 * otherwise. */
template <typename K, typename A>
static bool launch_held(K one, K cluster, const DevInfo &d, int NV, const void *out,
                        int64_t out_row_bytes, cudaStream_t st, A &args, const char *what,
                        lmloss_status *s) {
  /* An unaligned input row's vectors would be element loads (see load):
   * its loads would not all be in flight at once. An unaligned output
   * row's would be element stores (see put). */
  if ((uintptr_t)args.x % 16 != 0 || args.xs * (16 / NV) % 16 != 0) return false;
  if ((uintptr_t)out % 16 != 0 || out_row_bytes % 16 != 0) return false;
  const HeldPlan p = held_plan(d, args.N, args.V, NV);
  if (p.cs == 0) return false;
  const K kernel = p.cs == 1 ? one : cluster;
  cudaError_t e = cudaSuccess;
  if (p.cs > 8) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e != cudaSuccess) {
    *s = lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA %s: cluster attribute: %s", what,
                     cudaGetErrorString(e));
    return true;
  }
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      cluster_launch((unsigned)(args.N * p.cs), p.bs, 0, p.cs, st, &attr);
  if (p.cs > 8 && resident_clusters(kernel, cfg, p.cs, d) < 1) return false;
  args.cs = p.cs;
  args.chunk = p.chunk;
  args.staged = 0;
  e = cudaLaunchKernelEx(&cfg, kernel, args);
  if (e != cudaSuccess)
    *s = lmloss_fail(LMLOSS_ERR_DEVICE_FAILURE, "CUDA %s launch: %s", what, cudaGetErrorString(e));
  else
    *s = check_launch(what);
  return true;
}

/* The held kernels are built for the output dtypes training uses, the
 * logits' own and fp32; any other pair takes the staged plan (a held
 * kernel per pair cost more build time than the staged plan costs those
 * rare pairs). */
template <typename In, typename O> constexpr bool held_built() {
  return std::is_same<In, O>::value || std::is_same<O, float>::value;
}

/* launch(type_tag<O>{}) for the output dtype dt where held_built<In, O>,
 * else false (as launch_held where its plan does not apply). */
template <typename In, typename F> static bool launch_held_for(lmloss_dtype dt, F launch) {
  if (dt == dtype_of<In>()) return launch(type_tag<In>{});
  if constexpr (!std::is_same<In, float>::value)
    if (dt == LMLOSS_F32) return launch(type_tag<float>{});
  return false;
}

} // namespace lmc

#endif
