/*
 * divergence_shard.cu - the divergences over a sharded vocabulary on CUDA
 * (lmloss.h): a shard's state of a row pair, the states' merge, the loss
 * sweep's partial sums from merged states, and the finish (the whole
 * rows' outputs, the student's gradient over the shard's columns).
 *
 * As shard.cu does for one row: one CTA a row pair, sums formed per
 * thread and added in a fixed tree (bitwise the same run to run), every
 * element read and written through dtype.h's scalar load and store (one
 * kernel for every dtype), every formula from math/divergence.h and
 * math/divstate.h, which the CPU backend's sweeps use too. These passes
 * favour a small, exact build over divergence.cu's tuned cluster plan,
 * which the one-shot call keeps.
 */
#include "common.cuh"
#include "math/divstate.h"

namespace lmc {
namespace {

constexpr int DS_THREADS = 256;
constexpr int ROW_LOSS = LMLOSS_CE_WS_HEADER / sizeof(double); /* in the CE workspace */
constexpr long long NO_COL = LLONG_MAX;

/* A call's row pairs: the shard's columns of both rows, the labels, the
 * pair's constants and how its columns are transformed. */
struct PairRows {
  const void *s, *t;
  lmloss_dtype sdt, tdt;
  int64_t N, n, ss, ts, col0, vocab;
  const void *label; /* NULL: none */
  int label64;
  int64_t ls;
  long long ignore;
  lmloss_div_pair pr;
  int capped, kind;
  __device__ const void *srow(int64_t i) const {
    return (const char *)s + (size_t)(i * ss) * lmloss_dtype_size(sdt);
  }
  __device__ const void *trow(int64_t i) const {
    return (const char *)t + (size_t)(i * ts) * lmloss_dtype_size(tdt);
  }
  /* the row's label: -1 without labels, -2 for an ignored row */
  __device__ long long y(int64_t i) const {
    if (!label) return -1;
    const long long v = ld_index(label, label64, i * ls);
    return v == ignore ? -2 : v;
  }
};

/* The CTA's sums of K doubles a thread (block_sums), to every thread. */
template <int SUMS> __device__ void cta_sum(double (&v)[SUMS]) {
  __shared__ double sh[SUMS * (DS_THREADS / 32 + 1)];
  block_sums<SUMS>(v, sh);
}

/* A max and its first column. */
struct MaxAt {
  float m;
  long long a;
};

__device__ __forceinline__ MaxAt max_at(MaxAt x, MaxAt y) {
  return y.m > x.m || (y.m == x.m && y.a < x.a) ? y : x;
}

/* The CTA's max and first column of it; every thread gets it. */
__device__ MaxAt cta_max_at(MaxAt x) {
  __shared__ MaxAt warp[DS_THREADS / 32];
  for (int off = 16; off > 0; off >>= 1) {
    MaxAt y;
    y.m = __shfl_xor_sync(0xffffffffu, x.m, off);
    y.a = __shfl_xor_sync(0xffffffffu, x.a, off);
    x = max_at(x, y);
  }
  if (threadIdx.x % 32 == 0) warp[threadIdx.x / 32] = x;
  __syncthreads();
  MaxAt m = warp[0];
  for (int w = 1; w < DS_THREADS / 32; w++)
    m = max_at(m, warp[w]);
  __syncthreads();
  return m;
}

/* f(j, xs, xt, ws, wt) over the shard's columns j of row i this thread
 * owns: both rows' raw logits and w. */
template <typename F> __device__ __forceinline__ void each_pair(const PairRows &P, int64_t i, F f) {
  const void *rs = P.srow(i), *rt = P.trow(i);
  for (int64_t j = threadIdx.x; j < P.n; j += DS_THREADS) {
    const float xs = lmloss_load(rs, P.sdt, j), xt = lmloss_load(rt, P.tdt, j);
    f(j, xs, xt, lmloss_xform_w(&P.pr.fs, xs), lmloss_xform_w(&P.pr.ft, xt));
  }
}

/* The state of row i's columns: the maxes and flags, then the sums
 * against them (math/divstate.h's terms, as a CPU block's). */
__global__ void __launch_bounds__(DS_THREADS) state_kernel(PairRows P, float *state, int64_t sts) {
  const int64_t i = blockIdx.x;
  const long long y = P.y(i);
  lmloss_div_state s;
  s.st.as = -1;
  if (y == -2) {
    if (threadIdx.x == 0) lmloss_div_state_pack(&s, state + i * sts);
    return;
  }
  MaxAt mxs = {-INFINITY, NO_COL}, mxt = {-INFINITY, NO_COL};
  int bad = 0, any_s = 0, any_t = 0;
  each_pair(P, i, [&](int64_t j, float xs, float xt, float ws, float wt) {
    bad |= xs != xs || xs == INFINITY || xt != xt || xt == INFINITY;
    any_s |= xs > -INFINITY, any_t |= xt > -INFINITY;
    mxs = max_at(mxs, MaxAt{ws, j}), mxt = max_at(mxt, MaxAt{wt, j});
  });
  mxs = cta_max_at(mxs), mxt = cta_max_at(mxt);
  s.flags = (__syncthreads_or(bad) ? LMLOSS_PAIR_BAD : 0) |
            (__syncthreads_or(any_s) ? LMLOSS_PAIR_ANY_S : 0) |
            (__syncthreads_or(any_t) ? LMLOSS_PAIR_ANY_T : 0);
  /* a side of only NaN has no max: any column (the row reads NaN) */
  const int64_t as = mxs.a == NO_COL ? 0 : mxs.a, at = mxt.a == NO_COL ? 0 : mxt.a;
  const void *rs = P.srow(i), *rt = P.trow(i);
  lmloss_div_stats &st = s.st;
  st.ms = mxs.m, st.mt = mxt.m, st.as = P.col0 + as, st.at = P.col0 + at;
  st.xs_a = lmloss_load(rs, P.sdt, as), st.xt_a = lmloss_load(rt, P.tdt, at);
  const float G = lmloss_div_stats_G(&P.pr, &st);
  const float ms = st.ms > -INFINITY ? st.ms : 0.0f, mt = st.mt > -INFINITY ? st.mt : 0.0f;
  double v[3] = {0.0, 0.0, 0.0}; /* Rs, Rt, D */
  each_pair(P, i, [&](int64_t j, float xs, float xt, float ws, float wt) {
    float es, et, d;
    lmloss_div_stats_terms(&P.pr, P.capped, ws, wt, xs, xt, ms, mt, G, &es, &et, &d);
    v[0] += j == as ? 0.0f : es, v[1] += j == at ? 0.0f : et, v[2] += d;
  });
  cta_sum(v);
  if (threadIdx.x != 0) return;
  st.rs = v[0], st.rt = v[1], st.d = v[2];
  s.xt_as = lmloss_load(rt, P.tdt, as);
  s.ws_y = y >= P.col0 && y < P.col0 + P.n
               ? lmloss_xform_w(&P.pr.fs, lmloss_load(rs, P.sdt, y - P.col0))
               : NAN;
  lmloss_div_state_pack(&s, state + i * sts);
}

__global__ void merge_kernel(const float *a, int64_t as, const float *b, int64_t bs, float *out,
                             int64_t os, int64_t N, lmloss_div_pair pr) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const lmloss_div_state x = lmloss_div_state_unpack(a + i * as, LMLOSS_STATE_MAX_VOCAB, &pr);
  const lmloss_div_state y = lmloss_div_state_unpack(b + i * bs, LMLOSS_STATE_MAX_VOCAB, &pr);
  const lmloss_div_state m = lmloss_div_state_merge(&pr, &x, &y);
  lmloss_div_state_pack(&m, out + i * os);
}

/* The loss sweep's sums of row i's columns from its merged state. */
__global__ void __launch_bounds__(DS_THREADS)
    partials_kernel(PairRows P, const float *state, int64_t sts, double *part, int64_t ps) {
  const int64_t i = blockIdx.x;
  double *o = part + i * ps;
  const long long y = P.y(i);
  const lmloss_div_state s = lmloss_div_state_unpack(state + i * sts, P.vocab, &P.pr);
  const bool ok = lmloss_pair_flags_ok(s.flags);
  if (y == -2 || !ok) {
    for (int c = threadIdx.x; c < LMLOSS_DIV_PARTIAL_COLS; c += DS_THREADS)
      o[c] = y == -2 || c == LMLOSS_DIV_PARTIAL_COLS - 1 ? 0.0 : NAN;
    return;
  }
  const lmloss_div_row r = lmloss_div_state_row(&P.pr, &s);
  double v[7] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  each_pair(P, i, [&](int64_t j, float xs, float xt, float ws, float wt) {
    const lmloss_div_col c = lmloss_div_column(&P.pr, &r, P.capped, ws, wt, xs, xt);
    const lmloss_div_terms t =
        lmloss_div_loss_terms(&P.pr, &r, &c, P.col0 + j != r.as && c.p != 0.0f, P.kind);
    v[0] += t.div, v[1] += t.rev, v[2] += t.mix, v[3] += t.pos, v[4] += t.neg, v[5] += t.eq;
    v[6] += t.ent;
  });
  cta_sum(v);
  if (threadIdx.x != 0) return;
  for (int c = 0; c < 7; c++)
    o[c] = v[c];
  o[7] = 0.0;
}

/* ---- the finish ---- */

struct DivFinish {
  PairRows P;
  const float *state;
  int64_t sts;
  const double *part; /* NULL: the forward KL's backward */
  int64_t ps;
  float soft, hard, grad_output;
  int reduction;
  double num_items;
  const float *dloss;           /* the backward's, else NULL */
  int64_t dls;                  /* 0: one upstream for every row */
  float *loss, *div, *ce, *ent; /* the forward's (loss required there) */
  int64_t los, divs, ces, ents;
  void *dx; /* optional: the student's gradient over the shard's columns */
  lmloss_dtype dxdt;
  int64_t dxs;
  double *ws; /* [0] the rows not ignored; per-row losses from ROW_LOSS */
};

__device__ __forceinline__ double div_scale(const DivFinish &a) {
  if (a.reduction == LMLOSS_REDUCE_MEAN) return a.ws[0] > 0.0 ? 1.0 / a.ws[0] : 0.0;
  if (a.reduction == LMLOSS_REDUCE_SUM_OVER_ITEMS) return 1.0 / a.num_items;
  return 1.0;
}

/* MEAN's denominator: the rows not ignored, in a fixed order. */
__global__ void __launch_bounds__(DS_THREADS) count_kernel(DivFinish a) {
  double v[1] = {0.0};
  for (int64_t i = threadIdx.x; i < a.P.N; i += DS_THREADS)
    v[0] += a.P.y(i) != -2;
  cta_sum(v);
  if (threadIdx.x == 0) a.ws[0] = v[0];
}

__device__ void fill_row(const DivFinish &a, int64_t i, float v) {
  void *g = (char *)a.dx + (size_t)(i * a.dxs) * lmloss_dtype_size(a.dxdt);
  for (int64_t j = threadIdx.x; j < a.P.n; j += DS_THREADS)
    lmloss_store(g, a.dxdt, j, v);
}

__global__ void __launch_bounds__(DS_THREADS) finish_kernel(DivFinish a) {
  const PairRows &P = a.P;
  const int64_t i = blockIdx.x;
  const long long y = P.y(i);
  const lmloss_div_state s = lmloss_div_state_unpack(a.state + i * a.sts, P.vocab, &P.pr);
  const bool ok = y != -2 && lmloss_pair_flags_ok(s.flags);
  const lmloss_div_row r = lmloss_div_state_row(&P.pr, &s);
  const double *p = a.part ? a.part + i * a.ps : nullptr;
  if (threadIdx.x == 0 && a.loss) {
    double div = 0.0, ce = 0.0, ent = 0.0, l = 0.0;
    if (y != -2) {
      const float es_y = y < 0 || y == r.as ? 0.0f : (s.ws_y - s.st.ms) * P.pr.fs.k;
      div = ok ? p[0] : NAN, ent = ok ? p[6] : NAN;
      ce = !ok ? NAN : y >= 0 ? r.l1s - es_y : 0.0;
      /* without a hard term ce is not read: an exchange may leave out ws_y */
      l = a.soft * div + (a.hard > 0.0f ? a.hard * ce : 0.0);
    }
    a.ws[ROW_LOSS + i] = l;
    if (a.reduction == LMLOSS_REDUCE_NONE) a.loss[i * a.los] = (float)l;
    if (a.div) a.div[i * a.divs] = (float)div;
    if (a.ce) a.ce[i * a.ces] = (float)ce;
    if (a.ent) a.ent[i * a.ents] = (float)ent;
  }
  if (!a.dx) return;
  if (!ok) {
    fill_row(a, i, y == -2 ? 0.0f : NAN);
    return;
  }
  const float up = a.dloss ? a.dloss[i * a.dls] : a.grad_output;
  lmloss_div_grad gc = {};
  gc.y = y, gc.soft = a.soft, gc.scale = (float)(up * div_scale(a));
  gc.hard = y >= 0 ? a.hard : 0.0f;
  gc.one_minus_py = y == r.as ? r.rs / (1.0f + r.rs) : -1.0f;
  if (p) lmloss_div_grad_sums(&gc, p[1], p[2], p[3], p[4], p[5]);
  void *g = (char *)a.dx + (size_t)(i * a.dxs) * lmloss_dtype_size(a.dxdt);
  each_pair(P, i, [&](int64_t j, float xs, float xt, float ws, float wt) {
    const lmloss_div_col c = lmloss_div_column(&P.pr, &r, P.capped, ws, wt, xs, xt);
    lmloss_store(g, a.dxdt, j,
                 lmloss_div_grad_entry(&P.pr, &r, &gc, P.col0 + j, &c, xs, P.capped, P.kind));
  });
}

/* A reduced loss: the rows' losses summed in a fixed order. */
__global__ void __launch_bounds__(DS_THREADS) reduce_kernel(DivFinish a) {
  double v[1] = {0.0};
  for (int64_t i = threadIdx.x; i < a.P.N; i += DS_THREADS)
    v[0] += a.ws[ROW_LOSS + i];
  cta_sum(v);
  if (threadIdx.x == 0) a.loss[0] = (float)(v[0] * div_scale(a));
}

PairRows pair_rows(const lmloss_div_inputs *in, const lmloss_div_options *opt,
                   const lmloss_shard *sh) {
  PairRows P = {};
  P.s = in->student.data, P.t = in->teacher.data;
  P.sdt = in->student.dtype, P.tdt = in->teacher.dtype;
  P.N = in->student.rows, P.n = in->student.cols;
  P.ss = in->student.row_stride, P.ts = in->teacher.row_stride;
  P.col0 = sh->col0, P.vocab = sh->vocab;
  if (in->label.data) {
    P.label = in->label.data;
    P.label64 = in->label.dtype == LMLOSS_I64;
    P.ls = in->label.row_stride;
  }
  P.ignore = opt->ignore_index;
  P.pr = lmloss_div_pair_make(opt);
  P.capped = lmloss_div_pair_mode(&P.pr);
  P.kind = opt->kind;
  return P;
}

const float *f32_or_null(const lmloss_tensor *t, int64_t *stride) {
  *stride = t && t->data ? t->row_stride : 0;
  return t && t->data ? (const float *)t->data : nullptr;
}

} // namespace
} // namespace lmc

using namespace lmc;

extern "C" {

lmloss_status lmloss_cuda_div_state(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                    const lmloss_div_options *opt, const lmloss_shard *sh,
                                    const lmloss_tensor *state) {
  const PairRows P = pair_rows(in, opt, sh);
  if (P.N > 0)
    state_kernel<<<(unsigned)P.N, DS_THREADS, 0, stream_of(ctx)>>>(P, (float *)state->data,
                                                                   state->row_stride);
  return check_launch("divergence states");
}

lmloss_status lmloss_cuda_div_merge(const lmloss_context *ctx, const lmloss_tensor *a,
                                    const lmloss_tensor *b, const lmloss_div_options *opt,
                                    const lmloss_tensor *out) {
  const int64_t N = a->rows;
  if (N > 0)
    merge_kernel<<<(unsigned)((N + 255) / 256), 256, 0, stream_of(ctx)>>>(
        (const float *)a->data, a->row_stride, (const float *)b->data, b->row_stride,
        (float *)out->data, out->row_stride, N, lmloss_div_pair_make(opt));
  return check_launch("divergence state merge");
}

lmloss_status lmloss_cuda_div_finish(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                     const lmloss_div_options *opt, const lmloss_shard *sh,
                                     const lmloss_tensor *state, const lmloss_tensor *partials,
                                     const lmloss_div_outputs *out, const lmloss_tensor *dloss,
                                     const lmloss_tensor *dx, int kept, void *ws, size_t ws_bytes) {
  DivFinish a = {};
  a.P = pair_rows(in, opt, sh);
  a.state = (const float *)state->data;
  a.sts = state->row_stride;
  if (partials) {
    a.part = (const double *)partials->data;
    a.ps = partials->row_stride;
  }
  a.soft = opt->soft_weight, a.hard = opt->hard_weight, a.grad_output = opt->grad_output;
  a.reduction = opt->reduction;
  a.num_items = opt->num_items;
  if (dloss) {
    a.dloss = (const float *)dloss->data;
    a.dls = opt->reduction == LMLOSS_REDUCE_NONE ? dloss->row_stride : 0;
  }
  if (out) {
    a.loss = (float *)out->loss.data;
    a.los = out->loss.row_stride;
    a.div = (float *)f32_or_null(&out->divergence, &a.divs);
    a.ce = (float *)f32_or_null(&out->ce, &a.ces);
    a.ent = (float *)f32_or_null(&out->entropy, &a.ents);
  }
  if (dx) {
    a.dx = dx->data;
    a.dxdt = dx->dtype;
    a.dxs = dx->row_stride;
  }
  a.ws = (double *)ws;
  if (a.P.N == 0 && !a.loss) return LMLOSS_OK;
  cudaStream_t st = stream_of(ctx);
  count_kernel<<<1, DS_THREADS, 0, st>>>(a);
  if (a.P.N > 0) finish_kernel<<<(unsigned)a.P.N, DS_THREADS, 0, st>>>(a);
  if (a.loss && a.reduction != LMLOSS_REDUCE_NONE) reduce_kernel<<<1, DS_THREADS, 0, st>>>(a);
  return check_launch("divergence finish");
}

/* With dx, the forward KL's: the partials' kernel then the finish's
 * gradient alone (on the GPU each is a read of the rows, as the finish
 * after the exchange would be); the other kinds' dx is left, and their
 * finish from it (kept) recomputes the gradient from the rows. */
lmloss_status lmloss_cuda_div_partials(const lmloss_context *ctx, const lmloss_div_inputs *in,
                                       const lmloss_div_options *opt, const lmloss_shard *sh,
                                       const lmloss_tensor *state, const lmloss_tensor *partials,
                                       const lmloss_tensor *dx, void *ws, size_t ws_bytes) {
  const PairRows P = pair_rows(in, opt, sh);
  if (P.N > 0)
    partials_kernel<<<(unsigned)P.N, DS_THREADS, 0, stream_of(ctx)>>>(
        P, (const float *)state->data, state->row_stride, (double *)partials->data,
        partials->row_stride);
  const lmloss_status s = check_launch("divergence partials");
  if (s != LMLOSS_OK || !dx || opt->kind != LMLOSS_DIV_KL) return s;
  return lmloss_cuda_div_finish(ctx, in, opt, sh, state, NULL, NULL, NULL, dx, 0, ws, ws_bytes);
}
}
