/* grpo.c - the GRPO family in the float64 reference: math/grpo.h's stages
 * one sequence after another on one thread, the order the CPU's threads
 * and the CUDA kernels are held to. */
#include "math/grpo.h"
#include "core/backend.h"

lmloss_status lmloss_ref_grpo(const lmloss_context *ctx, const lmloss_grpo_inputs *in,
                              const lmloss_grpo_options *opt, const lmloss_grpo_outputs *out,
                              const lmloss_tensor *dloss, const lmloss_tensor *dlogp,
                              const lmloss_tensor *dentropy, void *ws, size_t ws_bytes) {
  return lmloss_grpo_host(in, opt, out, dloss, dlogp, dentropy, ws, 1);
}
