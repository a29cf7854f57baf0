/*
 * ref.c - the float64 scalar reference backend: the oracle of the test
 * suite, selectable as LMLOSS_BACKEND_REF (host memory only). Plain loops,
 * one row at a time, all math in double, each output rounded once.
 */
#include "core/backend.h"

lmloss_status lmloss_ref_cross_entropy(const lmloss_context *, const lmloss_ce_inputs *,
                                       const lmloss_ce_options *, const lmloss_ce_outputs *, void *,
                                       size_t, lmloss_row_keep *);
lmloss_status lmloss_ref_cross_entropy_backward(const lmloss_context *, const lmloss_ce_inputs *,
                                                const lmloss_ce_options *, const lmloss_tensor *,
                                                const lmloss_tensor *, void *, size_t,
                                                lmloss_row_keep *);
lmloss_status lmloss_ref_log_probs(const lmloss_context *, const lmloss_tensor *,
                                   const lmloss_tensor *, const lmloss_tensor *,
                                   const lmloss_transform *, const lmloss_tensor *,
                                   const lmloss_tensor *, const lmloss_tensor *);
lmloss_status lmloss_ref_log_probs_backward(const lmloss_context *, const lmloss_tensor *,
                                            const lmloss_tensor *, const lmloss_tensor *,
                                            const lmloss_transform *, const lmloss_tensor *,
                                            const lmloss_tensor *, const lmloss_tensor *,
                                            const lmloss_tensor *, lmloss_row_keep *);
lmloss_status lmloss_ref_softmax(const lmloss_context *, const lmloss_tensor *, int,
                                 const lmloss_tensor *);
lmloss_status lmloss_ref_softmax_backward(const lmloss_context *, const lmloss_tensor *,
                                          const lmloss_tensor *, int, const lmloss_tensor *);
lmloss_status lmloss_ref_divergence(const lmloss_context *, const lmloss_div_inputs *,
                                    const lmloss_div_options *, const lmloss_div_outputs *,
                                    const lmloss_tensor *, const lmloss_tensor *, void *, size_t);
lmloss_status lmloss_ref_grpo(const lmloss_context *, const lmloss_grpo_inputs *,
                              const lmloss_grpo_options *, const lmloss_grpo_outputs *,
                              const lmloss_tensor *, const lmloss_tensor *, const lmloss_tensor *,
                              void *, size_t);
lmloss_status lmloss_ref_preference(const lmloss_context *, const lmloss_pref_inputs *,
                                    const lmloss_pref_options *, const lmloss_pref_outputs *,
                                    const lmloss_tensor *, const lmloss_tensor *,
                                    const lmloss_tensor *, void *, size_t);
lmloss_status lmloss_ref_kto(const lmloss_context *, const lmloss_kto_inputs *,
                             const lmloss_kto_options *, const lmloss_kto_outputs *,
                             const lmloss_tensor *, const lmloss_tensor *);

/* Neither the fused head (its oracle is the full product in the tests)
 * nor row states (theirs is the one-shot call). */
static int ref_supports(lmloss_capability c) { return c == LMLOSS_CAN_DIVERGENCE; }

const lmloss_backend_ops lmloss_ref_ops = {
    lmloss_ref_cross_entropy,
    lmloss_ref_cross_entropy_backward,
    lmloss_ref_log_probs,
    lmloss_ref_log_probs_backward,
    lmloss_ref_softmax,
    lmloss_ref_softmax_backward,
    lmloss_ref_divergence,
    NULL,
    NULL,
    ref_supports,
    lmloss_ref_grpo,
    lmloss_ref_preference,
    lmloss_ref_kto,
    NULL,
};
