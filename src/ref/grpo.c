/*
 * grpo.c - the GRPO family on the host, one sequence after another
 * (math/grpo.h's stages in their sequential order): the oracle the CPU
 * backend's threads and the CUDA kernels are held to.
 */
#include <stdlib.h>

#include "core/backend.h"
#include "math/grpo.h"

/* The stages over sequences [0, B) with `threads` OpenMP threads (1: none),
 * shared with the CPU backend, whose results must not depend on them. */
lmloss_status lmloss_grpo_host(const lmloss_grpo_inputs *in, const lmloss_grpo_options *opt,
                               const lmloss_grpo_outputs *out, const lmloss_tensor *dloss,
                               const lmloss_tensor *dlogp, const lmloss_tensor *dentropy, void *ws,
                               int threads) {
  const lmloss_grpo_par p = lmloss_grpo_par_make(opt, in);
  const int64_t B = in->logp.rows;
  double *tot = (double *)ws, *recs = (double *)((char *)ws + LMLOSS_GRPO_WS_HEADER);
  const double thr = p.thr ? ((const float *)in->entropy_threshold.data)[0] : 0.0;
  const double items =
      lmloss_present(&in->num_items) ? ((const float *)in->num_items.data)[0] : opt->num_items;
  const double u = dloss ? ((const float *)dloss->data)[0] : 1.0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < B; b++)
    lmloss_grpo_host_a(&p, in, b, thr, recs + b * LMLOSS_GRPO_S_N);
  tot[0] = tot[1] = 0.0;
  for (int64_t b = 0; b < B; b++) {
    tot[0] += recs[b * LMLOSS_GRPO_S_N + LMLOSS_GRPO_S_MSUM];
    tot[1] += recs[b * LMLOSS_GRPO_S_N + LMLOSS_GRPO_S_EFF];
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < B; b++)
    lmloss_grpo_host_c(&p, in, b, thr, items, tot, u, out != NULL, dlogp, dentropy,
                       recs + b * LMLOSS_GRPO_S_N);
  if (out)
    lmloss_grpo_host_finish(&p, recs, B, (float *)out->loss.data,
                            lmloss_present(&out->metrics) ? (float *)out->metrics.data : NULL,
                            out->metrics.row_stride);
  return LMLOSS_OK;
}

lmloss_status lmloss_ref_grpo(const lmloss_context *ctx, const lmloss_grpo_inputs *in,
                              const lmloss_grpo_options *opt, const lmloss_grpo_outputs *out,
                              const lmloss_tensor *dloss, const lmloss_tensor *dlogp,
                              const lmloss_tensor *dentropy, void *ws, size_t ws_bytes) {
  return lmloss_grpo_host(in, opt, out, dloss, dlogp, dentropy, ws, 1);
}
