/*
 * shard.cu - the row contract's phases on CUDA (lmloss.h: states of a
 * vocabulary shard, their merge, and the finishes from merged states) for
 * the log-probs, entropy and softmax; cross-entropy's run on the one-shot
 * kernels' plans (ce.cu).
 *
 * One CTA a row: each thread merges its columns' elements into a state
 * with rowstate.h's merge, the CTA merges the threads' states in a fixed
 * tree (so results are bitwise the same run to run), and a finish forms
 * every output from the formulas of src/math. Elements are read and
 * written through dtype.h's scalar load and store, in any dtype, so one
 * kernel serves every dtype: these passes favour a small, exact build
 * over the tuned plans of held.cuh and staged.cuh, which the one-shot
 * calls use.
 */
#include "common.cuh"
#include "math/rowstate.h"

namespace lmc {
namespace {

constexpr int SHARD_THREADS = 256;

/* Row i's logits and their place in the vocabulary. */
struct ShardRows {
  const void *x;
  lmloss_dtype dt;
  int64_t N, n, xs, col0, vocab;
  lmloss_xform f;
  __device__ const void *row(int64_t i) const {
    return (const char *)x + (size_t)(i * xs) * lmloss_dtype_size(dt);
  }
};

/* A row's label (the log-probs' one index) and the rows that are
 * skipped: masked-out ones, as on the CPU. */
struct ShardLabels {
  const void *label; /* NULL: none */
  int label64;
  int64_t ls;
  const unsigned char *mask;
  int64_t ms;
  __device__ long long at(int64_t i) const { return label ? ld_index(label, label64, i * ls) : -1; }
  __device__ bool skipped(int64_t i) const { return mask && !mask[i * ms]; }
};

__device__ __forceinline__ lmloss_rowstat shfl_state(const lmloss_rowstat &s, int off) {
  lmloss_rowstat o;
  o.m = __shfl_xor_sync(0xffffffffu, s.m, off);
  o.r = __shfl_xor_sync(0xffffffffu, s.r, off);
  o.t = __shfl_xor_sync(0xffffffffu, s.t, off);
  o.u = __shfl_xor_sync(0xffffffffu, s.u, off);
  o.c = __shfl_xor_sync(0xffffffffu, s.c, off);
  o.a = __shfl_xor_sync(0xffffffffu, (long long)s.a, off);
  return o;
}

/* Row i of an output [N, n] (dtype dt, row stride os). */
__device__ __forceinline__ void *out_row(void *out, lmloss_dtype dt, int64_t os, int64_t i) {
  return (char *)out + (size_t)(i * os) * lmloss_dtype_size(dt);
}

__device__ void fill_row(void *out, lmloss_dtype dt, int64_t os, int64_t i, int64_t n, float v) {
  void *o = out_row(out, dt, os, i);
  for (int64_t j = threadIdx.x; j < n; j += SHARD_THREADS)
    lmloss_store(o, dt, j, v);
}

/* The sum over the CTA of each thread's t (block_sum), to every thread. */
__device__ double cta_sum(double t) {
  __shared__ double sh[SHARD_THREADS / 32 + 1];
  return block_sum(t, sh);
}

/* f(j, v) over the columns j of a row this thread owns (j = threadIdx.x
 * + q SHARD_THREADS, in order), v the logit: UNROLL loads are issued
 * before their elements are used, so that a thread keeps several reads in
 * flight where each element's work waits on the one before. */
constexpr int UNROLL = 8;
template <typename F>
__device__ __forceinline__ void each_loaded(const void *row, lmloss_dtype dt, int64_t n, F f) {
  int64_t j = threadIdx.x;
  for (; j + (UNROLL - 1) * SHARD_THREADS < n; j += UNROLL * SHARD_THREADS) {
    float v[UNROLL];
#pragma unroll
    for (int q = 0; q < UNROLL; q++)
      v[q] = lmloss_load(row, dt, j + q * SHARD_THREADS);
#pragma unroll
    for (int q = 0; q < UNROLL; q++)
      f(j + q * SHARD_THREADS, v[q]);
  }
  for (; j < n; j += SHARD_THREADS)
    f(j, lmloss_load(row, dt, j));
}

/* f(j, jg, x, dk, e) over the columns of row i this thread owns: j in
 * the shard, jg in the vocabulary, x the logit, dk = (w - m) k (exactly 0
 * at the argmax), e = exp(dk). */
template <typename F>
__device__ __forceinline__ void each_column(const ShardRows &R, const lmloss_rowstat &s, int64_t i,
                                            F f) {
  each_loaded(R.row(i), R.dt, R.n, [&](int64_t j, float x) {
    const int64_t jg = R.col0 + j;
    const float dk = lmloss_rowstat_dk(&s, R.f.k, jg, lmloss_xform_w(&R.f, x));
    f(j, jg, x, dk, expf(dk));
  });
}

/* The CTA's merge of its threads' states, in a fixed tree; every thread
 * gets the result. */
__device__ lmloss_rowstate cta_merge(lmloss_rowstate x, float k) {
  __shared__ lmloss_rowstat warp_s[SHARD_THREADS / 32];
  __shared__ int warp_f[SHARD_THREADS / 32];
  __shared__ lmloss_rowstate all;
  for (int off = 16; off > 0; off >>= 1) {
    lmloss_rowstate y;
    y.s = shfl_state(x.s, off);
    y.flags = __shfl_xor_sync(0xffffffffu, x.flags, off);
    y.wy = x.wy;
    x = lmloss_rowstate_merge(x, y, k);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_s[warp] = x.s, warp_f[warp] = x.flags;
  __syncthreads();
  if (threadIdx.x == 0) {
    lmloss_rowstate m = lmloss_rowstate_empty();
    for (int w = 0; w < SHARD_THREADS / 32; w++) {
      lmloss_rowstate y = lmloss_rowstate_empty();
      y.s = warp_s[w], y.flags = warp_f[w];
      m = lmloss_rowstate_merge(m, y, k);
    }
    all = m;
  }
  __syncthreads();
  lmloss_rowstate r = all;
  __syncthreads(); /* all is read before a next call writes it */
  return r;
}

/* The state of row i's columns (rowpass.h's semantics: softcap maps -inf
 * to -cap; without it a -inf adds nothing), without smoothing's sums. */
__device__ lmloss_rowstate row_state(const ShardRows &R, int64_t i, long long label) {
  const void *row = R.row(i);
  const float k = R.f.k;
  lmloss_rowstate x = lmloss_rowstate_empty();
  each_loaded(row, R.dt, R.n, [&](int64_t j, float v) {
    if (v != v || v == INFINITY) {
      x.flags |= LMLOSS_STATE_NONFINITE;
      return;
    }
    if (v != -INFINITY) x.flags |= LMLOSS_STATE_LOGIT;
    if (v == -INFINITY && R.f.cap == 0.0f) return;
    lmloss_rowstate e = lmloss_rowstate_empty();
    e.s.m = lmloss_xform_w(&R.f, v);
    e.s.a = R.col0 + j;
    x = lmloss_rowstate_merge(x, e, k);
  });
  x = cta_merge(x, k);
  const long long yl = label - R.col0;
  if (yl >= 0 && yl < R.n) {
    x.wy = lmloss_xform_w(&R.f, lmloss_load(row, R.dt, yl));
    x.flags |= LMLOSS_STATE_LABEL;
  }
  return x;
}

__global__ void __launch_bounds__(SHARD_THREADS)
    state_kernel(ShardRows R, ShardLabels L, float *state, int64_t ss) {
  const int64_t i = blockIdx.x;
  lmloss_rowstate x = lmloss_rowstate_empty();
  if (!L.skipped(i)) x = row_state(R, i, L.at(i));
  if (threadIdx.x == 0) lmloss_rowstate_pack(&x, state + i * ss);
}

__global__ void merge_kernel(const float *a, int64_t as, const float *b, int64_t bs, float *out,
                             int64_t os, int64_t N, float k) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const lmloss_rowstate x = lmloss_rowstate_unpack(a + i * as, LMLOSS_STATE_MAX_VOCAB);
  const lmloss_rowstate y = lmloss_rowstate_unpack(b + i * bs, LMLOSS_STATE_MAX_VOCAB);
  const lmloss_rowstate m = lmloss_rowstate_merge(x, y, k);
  lmloss_rowstate_pack(&m, out + i * os);
}

/* ---- log-probs, entropy, softmax ---- */

struct LpFinish {
  ShardRows R;
  ShardLabels L; /* the index as label, and the mask */
  const float *state;
  int64_t ss;
  float *logp, *ent; /* forward */
  lmloss_dtype lpdt;
  int64_t lps, ents;
  const float *dlogp, *dent; /* backward */
  int64_t dlps, dents;
  void *out; /* the backward's dlogits, or the softmax */
  lmloss_dtype odt;
  int64_t os;
  int log; /* softmax: log-softmax */
};

__device__ __forceinline__ bool lp_masked(const LpFinish &a, int64_t i) {
  return a.L.mask && !a.L.mask[i * a.L.ms];
}

/* One thread a row: log p of the index (from the row, or the label's w
 * the merged state carries) and the entropy. */
__global__ void lp_forward_kernel(LpFinish a) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.R.N) return;
  const ShardRows &R = a.R;
  const bool masked = lp_masked(a, i);
  const lmloss_rowstate st = lmloss_rowstate_unpack(a.state + i * a.ss, R.vocab);
  const bool ok = lmloss_rowstate_ok(&st);
  if (a.logp) {
    const long long j = a.L.at(i), jl = j - R.col0;
    const float w = jl >= 0 && jl < R.n ? lmloss_xform_w(&R.f, lmloss_load(R.row(i), R.dt, jl))
                    : st.flags & LMLOSS_STATE_LABEL ? st.wy
                                                    : NAN;
    const float v = masked ? 0.0f : ok ? lmloss_rowstat_logp(&st.s, R.f.k, j, w) : NAN;
    lmloss_store(a.logp + i * a.lps, a.lpdt, 0, v);
  }
  if (a.ent) a.ent[i * a.ents] = masked ? 0.0f : ok ? lmloss_rowstat_entropy(&st.s) : NAN;
}

/* src/cpu/logprob.c's backward: the row-pass shape, and the index's
 * exact entry where the shard holds it. */
__global__ void __launch_bounds__(SHARD_THREADS) lp_backward_kernel(LpFinish a) {
  const int64_t i = blockIdx.x;
  const ShardRows &R = a.R;
  if (lp_masked(a, i)) {
    fill_row(a.out, a.odt, a.os, i, R.n, 0.0f);
    return;
  }
  const lmloss_rowstate st = lmloss_rowstate_unpack(a.state + i * a.ss, R.vocab);
  if (!lmloss_rowstate_ok(&st)) {
    fill_row(a.out, a.odt, a.os, i, R.n, NAN);
    return;
  }
  const lmloss_rowstat &s = st.s;
  const float dl = a.dlogp ? a.dlogp[i * a.dlps] : 0.0f, dh = a.dent ? a.dent[i * a.dents] : 0.0f;
  const long long y = a.dlogp ? a.L.at(i) : -1;
  const float inv = 1.0f / (1.0f + s.r), hbar = s.t * inv;
  const float P = (-dl - dh * hbar) * inv, P2 = -dh * inv;
  void *o = out_row(a.out, a.odt, a.os, i);
  each_column(R, s, i, [&](int64_t j, int64_t jg, float x, float dk, float e) {
    float gz;
    if (jg == y) {
      const float p = e * inv;
      gz = jg == s.a ? dl * (s.r * inv) : dl - dl * p;
      gz -= dh * p * (dk + hbar);
    } else {
      gz = e > 0.0f ? e * (P + P2 * dk) : 0.0f;
    }
    lmloss_store(o, a.odt, j, gz * lmloss_xform_dzdx(&R.f, x));
  });
}

__global__ void __launch_bounds__(SHARD_THREADS) softmax_kernel(LpFinish a) {
  const int64_t i = blockIdx.x;
  const ShardRows &R = a.R;
  const lmloss_rowstate st = lmloss_rowstate_unpack(a.state + i * a.ss, R.vocab);
  if (!lmloss_rowstate_ok(&st)) {
    fill_row(a.out, a.odt, a.os, i, R.n, NAN);
    return;
  }
  const float l1r = log1pf(st.s.r), inv = 1.0f / (1.0f + st.s.r);
  void *o = out_row(a.out, a.odt, a.os, i);
  each_loaded(R.row(i), R.dt, R.n, [&](int64_t j, float x) {
    const float d = x - st.s.m;
    lmloss_store(o, a.odt, j, a.log ? d - l1r : expf(d) * inv);
  });
}

/* The softmax backward over a shard (lmloss.h): R's rows are y. */
struct SoftmaxBwd {
  ShardRows R;
  const void *dy;
  lmloss_dtype gdt;
  int64_t gs;
  const float *state, *dya;
  int64_t ss, das;
  double *part; /* the partial sums: written without dx, read with it */
  int64_t ps;
  void *dx; /* NULL: the partials */
  lmloss_dtype odt;
  int64_t os;
  int log;
};

/* One CTA a row: the partial sum over the shard's columns other than the
 * argmax (terms in fp32, summed in double in a fixed tree), or dx from
 * the summed partials; src/cpu/softmax.c's formulas. */
__global__ void __launch_bounds__(SHARD_THREADS) softmax_bwd_kernel(SoftmaxBwd a) {
  const int64_t i = blockIdx.x, n = a.R.n;
  const lmloss_rowstate st = lmloss_rowstate_unpack(a.state + i * a.ss, a.R.vocab);
  const bool ok = lmloss_rowstate_ok(&st);
  const int64_t at = st.s.a - a.R.col0 >= 0 && st.s.a - a.R.col0 < n ? st.s.a - a.R.col0 : -1;
  const float dya = a.dya[i * a.das];
  const void *yr = a.R.row(i);
  const void *gr = (const char *)a.dy + (size_t)(i * a.gs) * lmloss_dtype_size(a.gdt);
  if (!a.dx) {
    double t = 0.0;
    for (int64_t j = threadIdx.x; j < n; j += SHARD_THREADS) {
      if (j == at) continue;
      const float g = lmloss_load(gr, a.gdt, j);
      t += a.log ? g : lmloss_load(yr, a.R.dt, j) * (dya - g);
    }
    t = cta_sum(t);
    if (threadIdx.x == 0) a.part[i * a.ps] = ok ? t : NAN;
    return;
  }
  if (!ok) {
    fill_row(a.dx, a.odt, a.os, i, n, NAN);
    return;
  }
  const double c = a.part[i * a.ps], pa = 1.0 / (1.0 + (double)st.s.r);
  const float s = a.log ? 0.0f : dya, cf = (float)(a.log ? c + dya : c);
  void *o = out_row(a.dx, a.odt, a.os, i);
  for (int64_t j = threadIdx.x; j < n; j += SHARD_THREADS) {
    const float v = lmloss_load(yr, a.R.dt, j), g = lmloss_load(gr, a.gdt, j);
    float d = a.log ? g - expf(v) * cf : v * ((g - s) + cf);
    if (j == at) d = (float)(a.log ? dya * (st.s.r * pa) - pa * c : pa * c);
    lmloss_store(o, a.odt, j, d);
  }
}

/* ---- host side ---- */

ShardRows shard_rows(const lmloss_tensor *x, const lmloss_shard *sh, lmloss_transform tr) {
  ShardRows R;
  R.x = x->data;
  R.dt = x->dtype;
  R.N = x->rows;
  R.n = x->cols;
  R.xs = x->row_stride;
  R.col0 = sh->col0;
  R.vocab = sh->vocab;
  R.f = lmloss_xform_make(tr);
  return R;
}

ShardLabels shard_labels(const lmloss_tensor *label, const lmloss_tensor *mask) {
  ShardLabels L = {};
  if (label && label->data) {
    L.label = label->data;
    L.label64 = label->dtype == LMLOSS_I64;
    L.ls = label->row_stride;
  }
  if (mask && mask->data) {
    L.mask = (const unsigned char *)mask->data;
    L.ms = mask->row_stride;
  }
  return L;
}

const float *f32_or_null(const lmloss_tensor *t, int64_t *stride) {
  *stride = t && t->data ? t->row_stride : 0;
  return t && t->data ? (const float *)t->data : nullptr;
}

lmloss_status launch_rows(void (*kernel)(LpFinish), const LpFinish &a, cudaStream_t st,
                          const char *what) {
  if (a.R.N > 0) kernel<<<(unsigned)a.R.N, SHARD_THREADS, 0, st>>>(a);
  return check_launch(what);
}

} // namespace
} // namespace lmc

using namespace lmc;

extern "C" {

/* ce.cu */
lmloss_status lmloss_cuda_ce_state(const lmloss_context *, const lmloss_ce_inputs *,
                                   const lmloss_ce_options *, const lmloss_shard *,
                                   const lmloss_tensor *);
lmloss_status lmloss_cuda_ce_finish(const lmloss_context *, const lmloss_ce_inputs *,
                                    const lmloss_ce_options *, const lmloss_shard *,
                                    const lmloss_tensor *, const lmloss_ce_outputs *,
                                    const lmloss_tensor *, const lmloss_tensor *, void *, size_t);

lmloss_status lmloss_cuda_lp_state(const lmloss_context *ctx, const lmloss_tensor *logits,
                                   const lmloss_tensor *index, const lmloss_tensor *mask,
                                   const lmloss_transform *tr, const lmloss_shard *sh,
                                   const lmloss_tensor *state) {
  const ShardRows R = shard_rows(logits, sh, *tr);
  const ShardLabels L = shard_labels(index, mask);
  if (R.N > 0)
    state_kernel<<<(unsigned)R.N, SHARD_THREADS, 0, stream_of(ctx)>>>(R, L, (float *)state->data,
                                                                      state->row_stride);
  return check_launch("log-probs states");
}

lmloss_status lmloss_cuda_lp_finish(const lmloss_context *ctx, const lmloss_tensor *logits,
                                    const lmloss_tensor *index, const lmloss_tensor *mask,
                                    const lmloss_transform *tr, const lmloss_shard *sh,
                                    const lmloss_tensor *state, const lmloss_tensor *logp,
                                    const lmloss_tensor *entropy, const lmloss_tensor *dlogp,
                                    const lmloss_tensor *dentropy, const lmloss_tensor *dlogits) {
  LpFinish a = {};
  a.R = shard_rows(logits, sh, *tr);
  a.L = shard_labels(index, mask);
  a.state = (const float *)state->data;
  a.ss = state->row_stride;
  cudaStream_t st = stream_of(ctx);
  if (dlogits) {
    a.dlogp = f32_or_null(dlogp, &a.dlps);
    a.dent = f32_or_null(dentropy, &a.dents);
    a.out = dlogits->data;
    a.odt = dlogits->dtype;
    a.os = dlogits->row_stride;
    return launch_rows(lp_backward_kernel, a, st, "log-probs backward finish");
  }
  if (logp) {
    a.logp = (float *)logp->data;
    a.lpdt = logp->dtype;
    a.lps = logp->row_stride;
  }
  a.ent = (float *)f32_or_null(entropy, &a.ents);
  if (a.R.N > 0) lp_forward_kernel<<<(unsigned)((a.R.N + 127) / 128), 128, 0, st>>>(a);
  return check_launch("log-probs finish");
}

lmloss_status lmloss_cuda_softmax_finish(const lmloss_context *ctx, const lmloss_tensor *x,
                                         const lmloss_shard *sh, const lmloss_tensor *state,
                                         int log, const lmloss_tensor *out) {
  LpFinish a = {};
  a.R = shard_rows(x, sh, lmloss_transform_default());
  a.state = (const float *)state->data;
  a.ss = state->row_stride;
  a.out = out->data;
  a.odt = out->dtype;
  a.os = out->row_stride;
  a.log = log;
  return launch_rows(softmax_kernel, a, stream_of(ctx), "softmax finish");
}

lmloss_status lmloss_cuda_softmax_bwd(const lmloss_context *ctx, const lmloss_tensor *y,
                                      const lmloss_tensor *dy, int log, const lmloss_shard *sh,
                                      const lmloss_tensor *state, const lmloss_tensor *dy_a,
                                      const lmloss_tensor *partials, const lmloss_tensor *dx) {
  SoftmaxBwd a = {};
  a.R = shard_rows(y, sh, lmloss_transform_default());
  a.dy = dy->data;
  a.gdt = dy->dtype;
  a.gs = dy->row_stride;
  a.state = (const float *)state->data;
  a.ss = state->row_stride;
  a.dya = (const float *)dy_a->data;
  a.das = dy_a->row_stride;
  a.part = (double *)partials->data;
  a.ps = partials->row_stride;
  if (dx) {
    a.dx = dx->data;
    a.odt = dx->dtype;
    a.os = dx->row_stride;
  }
  a.log = log;
  if (a.R.N > 0) softmax_bwd_kernel<<<(unsigned)a.R.N, SHARD_THREADS, 0, stream_of(ctx)>>>(a);
  return check_launch(dx ? "softmax backward finish" : "softmax backward partials");
}

lmloss_status lmloss_cuda_state_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                      const lmloss_tensor *b, const lmloss_transform *tr,
                                      const lmloss_tensor *out) {
  const int64_t N = a->rows;
  if (N > 0)
    merge_kernel<<<(unsigned)((N + 255) / 256), 256, 0, stream_of(ctx)>>>(
        (const float *)a->data, a->row_stride, (const float *)b->data, b->row_stride,
        (float *)out->data, out->row_stride, N, lmloss_xform_make(*tr).k);
  return check_launch("state merge");
}

/* divergence_shard.cu */
lmloss_status lmloss_cuda_div_state(const lmloss_context *, const lmloss_div_inputs *,
                                    const lmloss_div_options *, const lmloss_shard *,
                                    const lmloss_tensor *);
lmloss_status lmloss_cuda_div_merge(const lmloss_context *, const lmloss_tensor *,
                                    const lmloss_tensor *, const lmloss_div_options *,
                                    const lmloss_tensor *);
lmloss_status lmloss_cuda_div_partials(const lmloss_context *, const lmloss_div_inputs *,
                                       const lmloss_div_options *, const lmloss_shard *,
                                       const lmloss_tensor *, const lmloss_tensor *,
                                       const lmloss_tensor *, void *, size_t);
lmloss_status lmloss_cuda_div_finish(const lmloss_context *, const lmloss_div_inputs *,
                                     const lmloss_div_options *, const lmloss_shard *,
                                     const lmloss_tensor *, const lmloss_tensor *,
                                     const lmloss_div_outputs *, const lmloss_tensor *,
                                     const lmloss_tensor *, int, void *, size_t);

extern const lmloss_state_ops lmloss_cuda_states = {
    lmloss_cuda_ce_state,     lmloss_cuda_ce_finish,      lmloss_cuda_lp_state,
    lmloss_cuda_lp_finish,    lmloss_cuda_softmax_finish, lmloss_cuda_softmax_bwd,
    lmloss_cuda_state_merge,  lmloss_cuda_div_state,      lmloss_cuda_div_merge,
    lmloss_cuda_div_partials, lmloss_cuda_div_finish,
};
}
