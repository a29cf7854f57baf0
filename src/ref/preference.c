/* preference.c - the DPO family in the float64 reference: math/preference.h's
 * stages pair after pair, the order CUDA's CTA is held to. */
#include "math/preference.h"
#include "core/backend.h"

lmloss_status lmloss_ref_preference(const lmloss_context *ctx, const lmloss_pref_inputs *in,
                                    const lmloss_pref_options *opt, const lmloss_pref_outputs *out,
                                    const lmloss_tensor *dloss, const lmloss_tensor *dchosen,
                                    const lmloss_tensor *drejected, void *ws, size_t ws_bytes) {
  return lmloss_pref_host_call(in, opt, out, dloss, dchosen, drejected, ws);
}

lmloss_status lmloss_ref_kto(const lmloss_context *ctx, const lmloss_kto_inputs *in,
                             const lmloss_kto_options *opt, const lmloss_kto_outputs *out,
                             const lmloss_tensor *dloss, const lmloss_tensor *dlogps) {
  return lmloss_kto_host_call(in, opt, out, dloss, dlogps);
}
