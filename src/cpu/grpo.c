/* grpo.c - the GRPO family on the CPU: math/grpo.h's stages with OpenMP
 * threads over sequences; every sum keeps its sequence order, so results
 * are the same bits for any thread count. */
#include "math/grpo.h"
#include "common.h"

lmloss_status lmloss_cpu_grpo(const lmloss_context *ctx, const lmloss_grpo_inputs *in,
                              const lmloss_grpo_options *opt, const lmloss_grpo_outputs *out,
                              const lmloss_tensor *dloss, const lmloss_tensor *dlogp,
                              const lmloss_tensor *dentropy, void *ws, size_t ws_bytes) {
  /* a token's work is about that of 100 logits of a row op */
  const int threads = lmloss_cpu_row_threads(ctx, in->logp.rows * in->logp.cols * 100);
  return lmloss_grpo_host(in, opt, out, dloss, dlogp, dentropy, ws, threads);
}
