/*
 * preference.cu - the DPO family on CUDA (math/preference.h): one CTA over
 * the P pairs (a batch of pairs is a few hundred numbers): the SFT sums
 * and AOT's lists, their sorted copies, then each pair's terms and
 * gradient, the sums in a fixed order (each thread's pairs in order, then
 * a fixed shuffle tree). One launch on the caller's stream, no host read;
 * AOT's lists live in the caller's workspace.
 */
#include "common.cuh"
#include "math/preference.h"

namespace lmc {
namespace pref {

constexpr int BS = 256;

struct Args {
  lmloss_pref_par p;
  lmloss_pref_inputs in;
  double *ws;
  const float *dloss;
  float *loss, *metrics, *dc, *dr, *own;
  int64_t ms, dcs, drs, os;
};

__global__ void __launch_bounds__(BS) run(Args a) {
  __shared__ double sh[BS / 32 + 1];
  const int64_t P = a.in.chosen.rows;
  const lmloss_pref_par &p = a.p;
  const int aot = p.w[LMLOSS_PREF_AOT] != 0.0 || p.w[LMLOSS_PREF_AOT_UNPAIRED] != 0.0;
  double sft[3] = {0, 0, 0};
  for (int64_t i = threadIdx.x; i < P; i += BS) {
    lmloss_pref_in x = lmloss_pref_load(&a.in, i);
    lmloss_pref_sft_add(&x, sft);
    if (aot) lmloss_pref_lists(&x, a.ws, P, i);
  }
  for (int k = 0; k < 3; k++)
    sft[k] = block_sum(sft[k], sh); /* its barriers order the lists' stores, too */
  for (int64_t i = threadIdx.x; aot && i < P; i += BS)
    lmloss_pref_sort(a.ws, P, i);
  __syncthreads();
  double dsft;
  const double lsft = lmloss_pref_sft(&p, sft, &dsft), u = a.dloss ? (double)*a.dloss : 1.0;
  double total = 0.0, m[LMLOSS_PREF_METRICS] = {0};
  for (int64_t i = threadIdx.x; i < P; i += BS) {
    lmloss_pref_in x = lmloss_pref_load(&a.in, i);
    double dc, dr, own;
    total += lmloss_pref_element(&p, &x, a.ws, P, i, &dc, &dr, &own);
    if (a.own) a.own[i * a.os] = (float)own;
    lmloss_pref_metrics_add(&p, &x, m);
    if (a.dc) a.dc[i * a.dcs] = (float)(u * (dc / p.P + dsft));
    if (a.dr) a.dr[i * a.drs] = (float)(u * dr / p.P);
  }
  if (!a.loss) return;
  total = block_sum(total, sh);
  for (int k = 0; k < LMLOSS_PREF_METRICS; k++)
    m[k] = block_sum(m[k], sh);
  if (threadIdx.x == 0) {
    *a.loss = (float)(total / p.P + lsft);
    for (int k = 0; a.metrics && k < LMLOSS_PREF_METRICS; k++)
      a.metrics[k * a.ms] = (float)m[k];
  }
}

} // namespace pref
} // namespace lmc

extern "C" lmloss_status
lmloss_cuda_preference(const lmloss_context *ctx, const lmloss_pref_inputs *in,
                       const lmloss_pref_options *opt, const lmloss_pref_outputs *out,
                       const lmloss_tensor *dloss, const lmloss_tensor *dchosen,
                       const lmloss_tensor *drejected, void *ws, size_t) {
  lmc::pref::Args a = {};
  a.p = lmloss_pref_par_make(opt, in->chosen.rows);
  a.in = *in;
  a.ws = (double *)((char *)ws + LMLOSS_PREF_WS_HEADER);
  a.dloss = dloss ? (const float *)dloss->data : nullptr;
  a.loss = out ? (float *)out->loss.data : nullptr;
  a.metrics = out && out->metrics.data ? (float *)out->metrics.data : nullptr;
  a.ms = out ? out->metrics.row_stride : 0;
  a.own = out && out->pair_loss.data ? (float *)out->pair_loss.data : nullptr;
  a.os = out ? out->pair_loss.row_stride : 0;
  a.dc = dchosen ? (float *)dchosen->data : nullptr;
  a.dcs = dchosen ? dchosen->row_stride : 0;
  a.dr = drejected ? (float *)drejected->data : nullptr;
  a.drs = drejected ? drejected->row_stride : 0;
  lmc::pref::run<<<1, lmc::pref::BS, 0, lmc::stream_of(ctx)>>>(a);
  return lmc::check_launch("preference");
}

namespace lmc {
namespace pref {

struct KtoArgs {
  lmloss_kto_par p;
  lmloss_kto_inputs in;
  const float *dloss;
  float *loss, *metrics, *d;
  int64_t ms, ds;
};

/* KTO in one CTA: the sums (the mean's divisor among them), then each
 * completion's gradient. */
__global__ void __launch_bounds__(BS) kto(KtoArgs a) {
  __shared__ double sh[BS / 32 + 1];
  const int64_t N = a.in.logps.rows;
  const double kl = a.in.kl.data ? (double)*(const float *)a.in.kl.data : 0.0;
  const double u = a.dloss ? (double)*a.dloss : 1.0;
  double m[8] = {0}, lp, lr, d;
  int des;
  for (int64_t i = threadIdx.x; i < N; i += BS) {
    lmloss_kto_load(&a.in, i, &lp, &lr, &des);
    lmloss_kto_add(&a.p, lp, lr, des, lmloss_kto_term(&a.p, lr, des, kl, &d), m);
  }
  for (int k = 0; k < 8; k++)
    m[k] = block_sum(m[k], sh);
  for (int64_t i = threadIdx.x; a.d && i < N; i += BS) {
    lmloss_kto_load(&a.in, i, &lp, &lr, &des);
    const double l = lmloss_kto_term(&a.p, lr, des, kl, &d);
    a.d[i * a.ds] = (float)(isnan(l) ? 0.0 : u * d / m[6]);
  }
  if (threadIdx.x == 0 && a.loss) {
    *a.loss = (float)(m[7] / m[6]);
    for (int k = 0; a.metrics && k < LMLOSS_KTO_METRICS; k++)
      a.metrics[k * a.ms] = (float)(k < 6 ? m[k] : 0.0);
  }
}

} // namespace pref
} // namespace lmc

extern "C" lmloss_status lmloss_cuda_kto(const lmloss_context *ctx, const lmloss_kto_inputs *in,
                                         const lmloss_kto_options *opt,
                                         const lmloss_kto_outputs *out, const lmloss_tensor *dloss,
                                         const lmloss_tensor *dlogps) {
  lmc::pref::KtoArgs a = {};
  a.p = lmloss_kto_par_make(opt);
  a.in = *in;
  a.dloss = dloss ? (const float *)dloss->data : nullptr;
  a.loss = out ? (float *)out->loss.data : nullptr;
  a.metrics = out && out->metrics.data ? (float *)out->metrics.data : nullptr;
  a.ms = out ? out->metrics.row_stride : 0;
  a.d = dlogps ? (float *)dlogps->data : nullptr;
  a.ds = dlogps ? dlogps->row_stride : 0;
  lmc::pref::kto<<<1, lmc::pref::BS, 0, lmc::stream_of(ctx)>>>(a);
  return lmc::check_launch("kto");
}
