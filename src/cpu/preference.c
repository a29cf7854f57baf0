/* preference.c - the DPO family on the CPU: math/preference.h's stages on
 * one thread (a batch of pairs is a few hundred numbers, no work for
 * threads). */
#include "math/preference.h"
#include "common.h"

lmloss_status lmloss_cpu_preference(const lmloss_context *ctx, const lmloss_pref_inputs *in,
                                    const lmloss_pref_options *opt, const lmloss_pref_outputs *out,
                                    const lmloss_tensor *dloss, const lmloss_tensor *dchosen,
                                    const lmloss_tensor *drejected, void *ws, size_t ws_bytes) {
  return lmloss_pref_host_call(in, opt, out, dloss, dchosen, drejected, ws);
}

lmloss_status lmloss_cpu_kto(const lmloss_context *ctx, const lmloss_kto_inputs *in,
                             const lmloss_kto_options *opt, const lmloss_kto_outputs *out,
                             const lmloss_tensor *dloss, const lmloss_tensor *dlogps) {
  return lmloss_kto_host_call(in, opt, out, dloss, dlogps);
}
