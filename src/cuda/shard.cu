/*
 * shard.cu - the row contract's phases on CUDA (lmloss.h): the states'
 * merge, the log-probs' forward finish and the softmax's backward. The
 * phases that read the logits once per row run on the one-shot kernels'
 * plans: cross-entropy's states and finishes in ce.cu, the log-probs'
 * states and backward finish in logprob.cu, the softmax's finish in
 * softmax.cu.
 *
 * Here: the log-probs' forward finish (one thread a row: a gather, no
 * pass over the row), the softmax's backward (one CTA a row, its partial
 * sums in a fixed tree, so results are bitwise the same run to run;
 * every element read and written through dtype.h's scalar load and
 * store, one kernel for every dtype), every formula from src/math.
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

__global__ void merge_kernel(const float *a, int64_t as, const float *b, int64_t bs, float *out,
                             int64_t os, int64_t N, float k) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const lmloss_rowstate x = lmloss_rowstate_unpack(a + i * as, LMLOSS_STATE_MAX_VOCAB);
  const lmloss_rowstate y = lmloss_rowstate_unpack(b + i * bs, LMLOSS_STATE_MAX_VOCAB);
  const lmloss_rowstate m = lmloss_rowstate_merge(x, y, k);
  lmloss_rowstate_pack(&m, out + i * os);
}

/* ---- log-probs, entropy, the softmax's backward ---- */

struct LpFinish {
  ShardRows R;
  const void *idx; /* the log-probs' one index a row, or NULL */
  int idx64;
  int64_t is;
  const unsigned char *mask; /* masked-out rows (0), or NULL */
  int64_t ms;
  const float *state;
  int64_t ss;
  float *logp, *ent; /* forward */
  lmloss_dtype lpdt;
  int64_t lps, ents;
};

/* One thread a row: log p of the index (from the row, or the label's w
 * the merged state carries) and the entropy. */
__global__ void lp_forward_kernel(LpFinish a) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.R.N) return;
  const ShardRows &R = a.R;
  const bool masked = a.mask && !a.mask[i * a.ms];
  const lmloss_rowstate st = lmloss_rowstate_unpack(a.state + i * a.ss, R.vocab);
  const bool ok = lmloss_rowstate_ok(&st);
  if (a.logp) {
    const long long j = ld_index(a.idx, a.idx64, i * a.is), jl = j - R.col0;
    const float w = jl >= 0 && jl < R.n ? lmloss_xform_w(&R.f, lmloss_load(R.row(i), R.dt, jl))
                    : st.flags & LMLOSS_STATE_LABEL ? st.wy
                                                    : NAN;
    const float v = masked ? 0.0f : ok ? lmloss_rowstat_logp(&st.s, R.f.k, j, w) : NAN;
    lmloss_store(a.logp + i * a.lps, a.lpdt, 0, v);
  }
  if (a.ent) a.ent[i * a.ents] = masked ? 0.0f : ok ? lmloss_rowstat_entropy(&st.s) : NAN;
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

const float *f32_or_null(const lmloss_tensor *t, int64_t *stride) {
  *stride = t && t->data ? t->row_stride : 0;
  return t && t->data ? (const float *)t->data : nullptr;
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

/* logprob.cu */
lmloss_status lmloss_cuda_lp_state(const lmloss_context *, const lmloss_tensor *,
                                   const lmloss_tensor *, const lmloss_tensor *,
                                   const lmloss_transform *, const lmloss_shard *,
                                   const lmloss_tensor *);
lmloss_status lmloss_cuda_lp_backward_finish(const lmloss_context *, const lmloss_tensor *,
                                             const lmloss_tensor *, const lmloss_tensor *,
                                             const lmloss_transform *, const lmloss_shard *,
                                             const lmloss_tensor *, const lmloss_tensor *,
                                             const lmloss_tensor *, const lmloss_tensor *,
                                             lmloss_row_keep *);

/* softmax.cu */
lmloss_status lmloss_cuda_softmax_finish(const lmloss_context *, const lmloss_tensor *,
                                         const lmloss_shard *, const lmloss_tensor *, int,
                                         const lmloss_tensor *);

lmloss_status lmloss_cuda_lp_finish(const lmloss_context *ctx, const lmloss_tensor *logits,
                                    const lmloss_tensor *index, const lmloss_tensor *mask,
                                    const lmloss_transform *tr, const lmloss_shard *sh,
                                    const lmloss_tensor *state, const lmloss_tensor *logp,
                                    const lmloss_tensor *entropy, const lmloss_tensor *dlogp,
                                    const lmloss_tensor *dentropy, const lmloss_tensor *dlogits,
                                    lmloss_row_keep *keep) {
  if (dlogits)
    return lmloss_cuda_lp_backward_finish(ctx, logits, index, mask, tr, sh, state, dlogp, dentropy,
                                          dlogits, keep);
  LpFinish a = {};
  a.R = shard_rows(logits, sh, *tr);
  if (lmloss_present(index)) {
    a.idx = index->data;
    a.idx64 = index->dtype == LMLOSS_I64;
    a.is = index->row_stride;
  }
  if (lmloss_present(mask)) {
    a.mask = (const unsigned char *)mask->data;
    a.ms = mask->row_stride;
  }
  a.state = (const float *)state->data;
  a.ss = state->row_stride;
  cudaStream_t st = stream_of(ctx);
  if (logp) {
    a.logp = (float *)logp->data;
    a.lpdt = logp->dtype;
    a.lps = logp->row_stride;
  }
  a.ent = (float *)f32_or_null(entropy, &a.ents);
  if (a.R.N > 0) lp_forward_kernel<<<(unsigned)((a.R.N + 127) / 128), 128, 0, st>>>(a);
  return check_launch("log-probs finish");
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

/* divergence.cu */
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
