/* preference.c - the DPO family on the host, pair after pair
 * (math/preference.h's stages in their order), for REF and the CPU: a
 * batch of pairs is a few hundred numbers, no work for threads. */
#include "math/preference.h"
#include "core/backend.h"

lmloss_status lmloss_ref_preference(const lmloss_context *ctx, const lmloss_pref_inputs *in,
                                    const lmloss_pref_options *opt, const lmloss_pref_outputs *out,
                                    const lmloss_tensor *dloss, const lmloss_tensor *dchosen,
                                    const lmloss_tensor *drejected, void *ws, size_t ws_bytes) {
  const lmloss_pref_par p = lmloss_pref_par_make(opt, in->chosen.rows);
  const double u = dloss ? ((const float *)dloss->data)[0] : 1.0;
  lmloss_pref_host(&p, in, (double *)((char *)ws + LMLOSS_PREF_WS_HEADER), u,
                   out ? (float *)out->loss.data : NULL,
                   out && out->metrics.data ? (float *)out->metrics.data : NULL,
                   out ? out->metrics.row_stride : 0, dchosen, drejected);
  return LMLOSS_OK;
}
