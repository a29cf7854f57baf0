/*
 * grpo.cu - the GRPO family on CUDA (math/grpo.h's stages): one CTA per
 * sequence for its token stages, one CTA for the totals between them and
 * for the final reduction over sequences, both in sequence order. Four
 * launches on the caller's stream, no host read, no allocation: the
 * records live in the caller's workspace. A CTA's sums are each thread's
 * tokens in order, then a fixed shuffle tree, so results do not depend on
 * scheduling.
 */
#include "common.cuh"
#include "math/grpo.h"

namespace lmc {
namespace grpo {

/* Threads of a CTA: a stage's tokens are each thread's serial work, its
 * formula latency-bound in double, so a sequence takes as many threads as
 * fit the stages' registers (512 threads leave each 128). */
constexpr int BS = 512;
constexpr int SH = LMLOSS_GRPO_S_N * (BS / 32 + 1); /* block_sums' doubles for a record */

struct Args {
  lmloss_grpo_par p;
  lmloss_grpo_inputs in;
  double *tot;  /* the workspace's header: stage B's two totals */
  double *recs; /* B records */
  const float *dloss;
  float *dlogp, *dentropy, *loss, *metrics;
  int64_t dls, dhs, ms; /* row strides of dlogp, dentropy, metrics */
  double items;         /* opt->num_items, unless in.num_items */
};

__device__ double threshold(const Args &a) {
  return a.p.thr ? (double)*(const float *)a.in.entropy_threshold.data : 0.0;
}

/* Stage A: a sequence's record. */
__global__ void __launch_bounds__(BS) stage_a(Args a) {
  __shared__ double sh[SH];
  const int64_t b = blockIdx.x, T = a.in.logp.cols;
  const double thr = threshold(a);
  double rec[LMLOSS_GRPO_S_N] = {0};
  for (int64_t t = threadIdx.x; t < T; t += BS) {
    lmloss_grpo_in x = lmloss_grpo_load(&a.p, &a.in, b, t);
    lmloss_grpo_stage_a(&a.p, &x, t, thr, rec);
  }
  block_sums<LMLOSS_GRPO_S_LIS + 1>(rec, sh);
  double *out = a.recs + b * LMLOSS_GRPO_S_N;
  if (threadIdx.x == 0)
    for (int k = 0; k < LMLOSS_GRPO_S_N; k++)
      out[k] = k <= LMLOSS_GRPO_S_LIS ? rec[k] : 0.0;
}

/* Stage B (one CTA): the masks' totals over the sequences. */
__global__ void __launch_bounds__(BS) stage_b(Args a) {
  __shared__ double sh[SH];
  double tot[2] = {0.0, 0.0};
  for (int64_t b = threadIdx.x; b < a.in.logp.rows; b += BS) {
    tot[0] += a.recs[b * LMLOSS_GRPO_S_N + LMLOSS_GRPO_S_MSUM];
    tot[1] += a.recs[b * LMLOSS_GRPO_S_N + LMLOSS_GRPO_S_EFF];
  }
  block_sums<2>(tot, sh);
  if (threadIdx.x == 0) a.tot[0] = tot[0], a.tot[1] = tot[1];
}

/* Stage C: a sequence's losses, metrics and gradients (upstream u). */
__global__ void __launch_bounds__(BS) stage_c(Args a) {
  __shared__ double sh[SH];
  const int64_t b = blockIdx.x, T = a.in.logp.cols;
  const lmloss_grpo_par &p = a.p;
  double *rec = a.recs + b * LMLOSS_GRPO_S_N;
  double seq[LMLOSS_GRPO_S_N]; /* stage A's record; stage C's sums start at 0 */
  for (int k = 0; k < LMLOSS_GRPO_S_N; k++)
    seq[k] = rec[k];
  const double tot[2] = {a.tot[0], a.tot[1]};
  const double thr = threshold(a), u = a.dloss ? (double)*a.dloss : 1.0;
  const double items = a.in.num_items.data ? (double)*(const float *)a.in.num_items.data : a.items;
  const double w = lmloss_grpo_seq_weight(&p, seq[LMLOSS_GRPO_S_MSUM], tot[0], items);
  const double sc = lmloss_grpo_token_scale(&p, seq, tot, items) * u;
  const double de = lmloss_grpo_dentropy(&p, tot) * u;
  double acc[LMLOSS_GRPO_S_N] = {0};
  double g = 0.0;
  for (int64_t t = threadIdx.x; t < T; t += BS) {
    lmloss_grpo_in x = lmloss_grpo_load(&p, &a.in, b, t);
    double dlp = 0.0, dent = 0.0;
    if (x.m != 0.0) {
      int keep_e;
      lmloss_grpo_tok o = lmloss_grpo_stage_c(&p, seq, &x, thr, &keep_e);
      if (a.loss) {
        acc[LMLOSS_GRPO_S_POLICY] += o.loss * x.m * w;
        lmloss_grpo_token_metrics(&p, seq, &x, &o, keep_e, acc);
      }
      dlp = x.m * sc * (o.dlp + (p.seq ? 0.0 : o.dlw));
      g += x.m * sc * o.dlw;
      dent = keep_e ? de * x.m : 0.0;
    }
    if (a.dlogp && !p.seq) a.dlogp[b * a.dls + t] = (float)dlp;
    if (a.dentropy) a.dentropy[b * a.dhs + t] = (float)dent;
  }
  if (a.loss) {
    block_sums<LMLOSS_GRPO_S_BENT - LMLOSS_GRPO_S_POLICY + 1>(acc + LMLOSS_GRPO_S_POLICY, sh);
    if (threadIdx.x == 0) {
      for (int k = LMLOSS_GRPO_S_POLICY; k <= LMLOSS_GRPO_S_BENT; k++)
        seq[k] = acc[k];
      lmloss_grpo_seq_metrics(&p, &a.in, b, seq);
      for (int k = LMLOSS_GRPO_S_POLICY; k <= LMLOSS_GRPO_S_BENT; k++)
        rec[k] = seq[k];
    }
  }
  if (!a.dlogp || !p.seq) return;
  /* SEQUENCE: each token's share of the sequence's log weight */
  g = block_sum(g, sh);
  for (int64_t t = threadIdx.x; t < T; t += BS) {
    lmloss_grpo_in x = lmloss_grpo_load(&p, &a.in, b, t);
    double dlp = 0.0;
    if (x.m != 0.0) {
      int keep_e;
      lmloss_grpo_tok o = lmloss_grpo_stage_c(&p, seq, &x, thr, &keep_e);
      dlp = x.m * sc * o.dlp + g * x.m / fmax(seq[LMLOSS_GRPO_S_MSUM], 1.0);
    }
    a.dlogp[b * a.dls + t] = (float)dlp;
  }
}

/* The loss and metrics (one CTA) from the records in sequence order. */
__global__ void __launch_bounds__(BS) finish(Args a) {
  __shared__ double sh[SH];
  const lmloss_grpo_par &p = a.p;
  double acc[LMLOSS_GRPO_S_N] = {0}, lo = NAN, hi = NAN;
  for (int64_t b = threadIdx.x; b < a.in.logp.rows; b += BS) {
    const double *rec = a.recs + b * LMLOSS_GRPO_S_N;
    for (int k = 0; k < LMLOSS_GRPO_S_N; k++)
      acc[k] += rec[k];
    lo = lmloss_grpo_nanmin(lo, lmloss_grpo_seq_mean(&p, rec, LMLOSS_GRPO_S_LOW));
    hi = lmloss_grpo_nanmax(hi, lmloss_grpo_seq_mean(&p, rec, LMLOSS_GRPO_S_HIGH));
  }
  block_sums<LMLOSS_GRPO_S_N>(acc, sh);
  double ext[2] = {lo, hi}; /* the least and the greatest, ignoring NaN */
  block_fold<2>(ext, sh, [](int k, double x, double y) {
    return k == 0 ? lmloss_grpo_nanmin(x, y) : lmloss_grpo_nanmax(x, y);
  });
  if (threadIdx.x == 0) lmloss_grpo_finish(&p, acc, ext[0], ext[1], a.loss, a.metrics, a.ms);
}

/* lmloss_grpo_logits' one pass (one CTA): each sequence's factor of its
 * tokens' d loss / d logp at upstream 1, lmloss_grpo_token_scale of its
 * mask's sum, into scale [B]. A warp sums a sequence's mask (no barrier
 * a sequence), then the block the sequences', each in a fixed order. */
__global__ void __launch_bounds__(BS) seq_scales(Args a, double *scale) {
  __shared__ double sh[BS / 32 + 1];
  const int64_t B = a.in.mask.rows, T = a.in.mask.cols;
  const int lane = threadIdx.x & 31;
  for (int64_t b = threadIdx.x >> 5; b < B; b += BS / 32) {
    double m = 0.0;
    for (int64_t t = lane; t < T; t += 32)
      m += lmloss_grpo_at(&a.in.mask, b, t);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      m += __shfl_down_sync(0xffffffffu, m, off);
    if (lane == 0) scale[b] = m;
  }
  __syncthreads();
  double part = 0.0;
  for (int64_t b = threadIdx.x; b < B; b += BS)
    part += scale[b];
  const double tot[2] = {block_sum(part, sh), 0.0};
  const double items = a.in.num_items.data ? (double)*(const float *)a.in.num_items.data : a.items;
  for (int64_t b = threadIdx.x; b < B; b += BS) {
    double rec[LMLOSS_GRPO_S_N] = {0};
    rec[LMLOSS_GRPO_S_MSUM] = scale[b];
    scale[b] = lmloss_grpo_token_scale(&a.p, rec, tot, items);
  }
}

} // namespace grpo
} // namespace lmc

extern "C" lmloss_status lmloss_cuda_grpo_scales(const lmloss_context *ctx,
                                                 const lmloss_grpo_inputs *in,
                                                 const lmloss_grpo_options *opt, double *scale) {
  using namespace lmc::grpo;
  Args a = {};
  a.p = lmloss_grpo_par_make(opt, in);
  a.in = *in;
  a.items = opt->num_items;
  seq_scales<<<1, BS, 0, lmc::stream_of(ctx)>>>(a, scale);
  return lmc::check_launch("grpo scales");
}

extern "C" lmloss_status lmloss_cuda_grpo(const lmloss_context *ctx, const lmloss_grpo_inputs *in,
                                          const lmloss_grpo_options *opt,
                                          const lmloss_grpo_outputs *out,
                                          const lmloss_tensor *dloss, const lmloss_tensor *dlogp,
                                          const lmloss_tensor *dentropy, void *ws, size_t) {
  using namespace lmc::grpo;
  Args a = {};
  a.p = lmloss_grpo_par_make(opt, in);
  a.in = *in;
  a.tot = (double *)ws;
  a.recs = (double *)((char *)ws + LMLOSS_GRPO_WS_HEADER);
  a.dloss = dloss ? (const float *)dloss->data : nullptr;
  a.dlogp = dlogp ? (float *)dlogp->data : nullptr;
  a.dls = dlogp ? dlogp->row_stride : 0;
  a.dentropy = dentropy ? (float *)dentropy->data : nullptr;
  a.dhs = dentropy ? dentropy->row_stride : 0;
  a.loss = out ? (float *)out->loss.data : nullptr;
  a.metrics = out && out->metrics.data ? (float *)out->metrics.data : nullptr;
  a.ms = out ? out->metrics.row_stride : 0;
  a.items = opt->num_items;
  const int64_t B = in->logp.rows;
  if (B > INT_MAX) return lmloss_fail(LMLOSS_ERR_BAD_SHAPE, "more than 2^31 - 1 sequences");
  cudaStream_t st = lmc::stream_of(ctx);
  stage_a<<<(unsigned)B, BS, 0, st>>>(a);
  stage_b<<<1, BS, 0, st>>>(a);
  stage_c<<<(unsigned)B, BS, 0, st>>>(a);
  if (out) finish<<<1, BS, 0, st>>>(a);
  return lmc::check_launch("grpo");
}
