/*
 * softmax.cu - softmax / log-softmax of any width and their backward on
 * CUDA.
 *
 * Forward: y_j = exp(x_j - m) / (1 + R), or (x_j - m) - log1p(R); the
 * argmax gets exactly 1 / (1 + R) and -log1p(R). A non-finite row (NaN,
 * +inf, all -inf) gives NaN everywhere.
 * Backward from y with a = first argmax of y:
 *   softmax: dx_j = y_j (dy_j - S), S = sum_k dy_k y_k;
 *            dx_a = y_a sum_{k != a} (dy_a - dy_k) y_k
 *                 = y_a (dy_a Y_rest - S_rest)
 *   log:     dx_j = dy_j - exp(y_j) sum_k dy_k;
 *            dx_a = dy_a (-expm1(y_a)) - exp(y_a) sum_{k != a} dy_k
 * so the argmax entry never forms 1 - y_a.
 */
#include "held.cuh"
#include "staged.cuh"

namespace lmc {

struct SmArgs {
  const void *x;
  int64_t N, V, xs;
  void *y;
  int64_t ys;
  int log;
  Xf X;
  int cs;
  int64_t chunk;
  int staged;
  /* a vocabulary shard's finish (lmloss.h's row contract): x holds some
   * columns of rows whose merged states these are (vocab columns in all),
   * so the first pass is skipped; NULL for whole rows */
  const float *state;
  int64_t sts, vocab;
};

/* Same shape as the other two-pass kernels (see ce_rows, make_plan): x is
 * read once and y written once (fp32 V = 262144 is 1 MB: 16 CTAs x 64 KB). */
template <typename In, typename O> __global__ void __launch_bounds__(256, 3) sm_fwd(SmArgs a) {
  constexpr int NV = elt<In>::NV;
  extern __shared__ uint4 stage[];
  __shared__ RedSmem red;
  RowWalk rw(a.cs, &red);
  const Xf &X = a.X;
  const Chunk ch = my_chunk<NV>(a.V, a.chunk, rw.rank);
  Stage st(stage, red.halves, ch, a.staged);
  for (int64_t i = rw.first; i < a.N; i += rw.step) {
    const In *row = (const In *)a.x + i * a.xs;
    O *yrow = (O *)a.y + i * a.ys;
    const bool in_al = is_aligned16(row);
    const RowPart<In> part = {row, ch, a.V, in_al};
    lmloss_rowstat s;
    bool ok;
    if (a.state) {
      const lmloss_rowstate x = lmloss_rowstate_unpack(a.state + i * a.sts, a.vocab);
      s = x.s;
      ok = lmloss_rowstate_ok(&x);
    } else {
      Acc acc;
      acc.init(X);
      const bool one_max = first_pass<false>(a.staged, st, part, true, X, Smooth{}, acc, &red);
      const Part P = reduce_row(acc, 1.0f, false, false, &red, rw, one_max);
      s = P.s;
      ok = !P.bad && lmloss_rowstat_finite(&s);
    }
    const float m = s.m;
    float inv = 1.0f / (1.0f + s.r), l1r = log1pf(s.r);
    if (!ok) inv = l1r = NAN;
    Ref ref;
    ref.set(X, m);
    const float invs = inv * ref.s();
    const ChunkOut<O, NV> out(yrow, ch, a.V);
    auto body = [&](int v, const Raw<In> &rv, auto log) {
      float x[NV];
      unpack<In, NV>(rv, x);
      if constexpr (decltype(log)::value) {
#pragma unroll
        for (int e = 0; e < NV; e++)
          x[e] = (x[e] - m) - l1r;
      } else {
#pragma unroll
        for (int e = 0; e < NV; e++)
          x[e] = ex2(ref.p(X, x[e])) * invs; /* -inf: ex2(-inf) = 0 */
      }
      out.store(v, x);
    };
    const int64_t in = i + rw.step; /* the next row, copied in during this one's writes */
    const NextRow<In> next(a.staged && in < a.N, a.x, in, a.xs, part);
    second_pass(a.staged, st, part, next, a.log != 0, body);
  }
  rw.finish();
}

/* The held plan (held.cuh) of sm_fwd, for a row it holds. */
template <typename In, typename O, bool CLUSTER>
__global__ void HELD_BOUNDS(In, CLUSTER) sm_held(SmArgs a) {
  constexpr int NV = elt<In>::NV;
  __shared__ HeldSmem sm;
  const int64_t i = blockIdx.x / a.cs;
  HeldRow<In, CLUSTER> h(&sm, nullptr, a.cs, a.chunk, a.V);
  const In *xrow = (const In *)a.x + i * a.xs;
  h.load<false>(xrow, a.V);
  h.arrive();
  const Xf &X = a.X;
  const bool ok = h.stats(X);
  const float m = h.m;
  float inv = 1.0f / (1.0f + h.rs), l1r = log1pf(h.rs);
  if (!ok) inv = l1r = NAN;
  const ChunkOut<O, NV> out((O *)a.y + i * a.ys, h.ch, a.V);
  if (a.log) {
    h.put(xrow, out, [&](const float *x, float *y) {
#pragma unroll
      for (int e = 0; e < NV; e++)
        y[e] = (x[e] - m) - l1r;
    });
  } else {
    h.store_exp(X, xrow, out, inv, -1, 0, 0.0f);
  }
}

/* Backward state of a partial row: first argmax a of y with y_a, dy_a, and
 * the sums over the other entries: s1 = sum y (softmax) or sum dy (log),
 * s2 = sum dy y (softmax). */
struct SbState {
  float ym, dya, s1, s2;
  long long a;
};

__device__ __forceinline__ SbState sb_merge(SbState x, SbState y, int log) {
  if (y.a >= 0 && (x.a < 0 || y.ym > x.ym || (y.ym == x.ym && y.a < x.a))) {
    SbState t = x;
    x = y;
    y = t;
  }
  x.s1 += y.s1;
  x.s2 += y.s2;
  if (y.a >= 0) {
    x.s1 += log ? y.dya : y.ym;
    if (!log) x.s2 = fmaf(y.dya, y.ym, x.s2);
  }
  return x;
}

__device__ __forceinline__ size_t esz(lmloss_dtype d) { return d == LMLOSS_F32 ? 4 : 2; }

struct SbArgs {
  const void *y, *dy;
  void *dx;
  lmloss_dtype yt, dyt, dxt;
  int64_t N, V, ys, dys, dxs;
  int log;
};

/* One 512-thread CTA per row, two passes over (y, dy), the second in
 * reverse so the most recently read lines are still in L2. Element loads
 * of any dtype mix (coalesced, 4 in flight per thread): the backward is
 * not on the hot path of training loops, one kernel serves all 27 dtype
 * combinations. */
__global__ void __launch_bounds__(512) sm_bwd(SbArgs a) {
  __shared__ SbState sh[32];
  __shared__ SbState res;
  const int64_t B = blockDim.x;
  for (int64_t i = blockIdx.x; i < a.N; i += gridDim.x) {
    const void *yr = (const char *)a.y + (size_t)(i * a.ys) * esz(a.yt);
    const void *dyr = (const char *)a.dy + (size_t)(i * a.dys) * esz(a.dyt);
    void *dxr = (char *)a.dx + (size_t)(i * a.dxs) * esz(a.dxt);
    SbState s = {-INFINITY, 0.0f, 0.0f, 0.0f, -1};
    for (int64_t j = threadIdx.x; j < a.V; j += B) {
      float y = lmloss_load(yr, a.yt, j), dy = lmloss_load(dyr, a.dyt, j);
      if (y > s.ym) {
        if (s.a >= 0) {
          s.s1 += a.log ? s.dya : s.ym;
          if (!a.log) s.s2 = fmaf(s.dya, s.ym, s.s2);
        }
        s.ym = y;
        s.dya = dy;
        s.a = j;
      } else {
        s.s1 += a.log ? dy : y;
        if (!a.log) s.s2 = fmaf(dy, y, s.s2);
      }
    }
    for (int off = 1; off < 32; off <<= 1) {
      SbState o;
      o.ym = __shfl_xor_sync(0xffffffffu, s.ym, off);
      o.dya = __shfl_xor_sync(0xffffffffu, s.dya, off);
      o.s1 = __shfl_xor_sync(0xffffffffu, s.s1, off);
      o.s2 = __shfl_xor_sync(0xffffffffu, s.s2, off);
      o.a = __shfl_xor_sync(0xffffffffu, s.a, off);
      s = (threadIdx.x & off) == 0 ? sb_merge(s, o, a.log) : sb_merge(o, s, a.log);
    }
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      SbState b = sh[0];
      for (int w = 1; w < (int)(B >> 5); w++)
        b = sb_merge(b, sh[w], a.log);
      res = b;
    }
    __syncthreads();
    const SbState r = res;
    const float S = fmaf(r.dya, r.ym, r.s2); /* softmax: sum dy y */
    const float Sd = r.dya + r.s1;           /* log: sum dy */
    int64_t last = a.V > threadIdx.x ? a.V - 1 - ((a.V - 1 - threadIdx.x) % B) : -1;
    for (int64_t j = last; j >= 0; j -= B) {
      float y = lmloss_load(yr, a.yt, j), dy = lmloss_load(dyr, a.dyt, j), g;
      if (j == r.a)
        g = a.log ? dy * -expm1f(y) - expf(y) * r.s1 : y * fmaf(dy, r.s1, -r.s2);
      else
        g = a.log ? dy - expf(y) * Sd : y * (dy - S);
      lmloss_store(dxr, a.dxt, j, g);
    }
    __syncthreads(); /* res and sh are rewritten by the next row */
  }
}

/* A shard's finish reads its columns once: the one-pass plan. */
template <typename In, typename O>
static lmloss_status launch_fwd(const DevInfo &d, SmArgs &a, cudaStream_t st) {
  lmloss_status s;
  if constexpr (held_built<In, O>())
    if (!a.state && launch_held(sm_held<In, O, false>, sm_held<In, O, true>, d, elt<In>::NV, a.y,
                                a.ys * (int64_t)sizeof(O), st, a, "softmax", &s))
      return s;
  return launch_rows(sm_fwd<In, O>, sm_fwd<In, O>, d, elt<In>::NV, !a.state, 0, st, a, "softmax");
}

template <typename In>
static lmloss_status fwd_out(const DevInfo &d, SmArgs &a, lmloss_dtype od, cudaStream_t st) {
  switch (od) {
  case LMLOSS_BF16: return launch_fwd<In, bf16>(d, a, st);
  case LMLOSS_F16: return launch_fwd<In, f16>(d, a, st);
  default: return launch_fwd<In, float>(d, a, st);
  }
}

static lmloss_status run_fwd(const lmloss_context *ctx, const lmloss_tensor *x, int log,
                             const lmloss_tensor *out, const lmloss_shard *sh,
                             const lmloss_tensor *state) {
  DevInfo d;
  lmloss_status s = dev_info(&d);
  if (s != LMLOSS_OK) return s;
  SmArgs a = {};
  a.x = x->data;
  a.N = x->rows;
  a.V = x->cols;
  a.xs = x->row_stride;
  a.y = out->data;
  a.ys = out->row_stride;
  a.log = log;
  a.X = make_xf(lmloss_transform_default());
  if (state) {
    a.state = (const float *)state->data;
    a.sts = state->row_stride;
    a.vocab = sh->vocab;
  }
  cudaStream_t st = stream_of(ctx);
  switch (x->dtype) {
  case LMLOSS_BF16: return fwd_out<bf16>(d, a, out->dtype, st);
  case LMLOSS_F16: return fwd_out<f16>(d, a, out->dtype, st);
  default: return fwd_out<float>(d, a, out->dtype, st);
  }
}

} // namespace lmc

extern "C" lmloss_status lmloss_cuda_softmax(const lmloss_context *ctx, const lmloss_tensor *x,
                                             int log, const lmloss_tensor *out) {
  return lmc::run_fwd(ctx, x, log, out, NULL, NULL);
}

/* The row contract's softmax finish over a vocabulary shard (lmloss.h). */
extern "C" lmloss_status lmloss_cuda_softmax_finish(const lmloss_context *ctx,
                                                    const lmloss_tensor *x, const lmloss_shard *sh,
                                                    const lmloss_tensor *state, int log,
                                                    const lmloss_tensor *out) {
  return lmc::run_fwd(ctx, x, log, out, sh, state);
}

extern "C" lmloss_status lmloss_cuda_softmax_backward(const lmloss_context *ctx,
                                                      const lmloss_tensor *y,
                                                      const lmloss_tensor *dy, int log,
                                                      const lmloss_tensor *dx) {
  lmc::SbArgs a = {};
  a.y = y->data;
  a.dy = dy->data;
  a.dx = dx->data;
  a.yt = y->dtype;
  a.dyt = dy->dtype;
  a.dxt = dx->dtype;
  a.N = y->rows;
  a.V = y->cols;
  a.ys = y->row_stride;
  a.dys = dy->row_stride;
  a.dxs = dx->row_stride;
  a.log = log;
  if (a.N <= 0) return LMLOSS_OK;
  int64_t grid = a.N < (1 << 30) ? a.N : (1 << 30);
  lmc::sm_bwd<<<(unsigned)grid, 512, 0, lmc::stream_of(ctx)>>>(a);
  return lmc::check_launch("softmax_backward");
}
