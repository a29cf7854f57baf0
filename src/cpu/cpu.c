/* cpu.c - the CPU backend's function table. */
#include "core/backend.h"
#include "rowpass.h"

lmloss_status lmloss_cpu_cross_entropy(const lmloss_context *, const lmloss_ce_inputs *,
                                       const lmloss_ce_options *, const lmloss_ce_outputs *, void *,
                                       size_t, lmloss_row_keep *);
lmloss_status lmloss_cpu_cross_entropy_backward(const lmloss_context *, const lmloss_ce_inputs *,
                                                const lmloss_ce_options *, const lmloss_tensor *,
                                                const lmloss_tensor *, void *, size_t,
                                                lmloss_row_keep *);
lmloss_status lmloss_cpu_log_probs(const lmloss_context *, const lmloss_tensor *,
                                   const lmloss_tensor *, const lmloss_tensor *,
                                   const lmloss_transform *, const lmloss_tensor *,
                                   const lmloss_tensor *, const lmloss_tensor *);
lmloss_status lmloss_cpu_log_probs_backward(const lmloss_context *, const lmloss_tensor *,
                                            const lmloss_tensor *, const lmloss_tensor *,
                                            const lmloss_transform *, const lmloss_tensor *,
                                            const lmloss_tensor *, const lmloss_tensor *,
                                            const lmloss_tensor *, lmloss_row_keep *);
lmloss_status lmloss_cpu_softmax(const lmloss_context *, const lmloss_tensor *, int,
                                 const lmloss_tensor *);
lmloss_status lmloss_cpu_softmax_backward(const lmloss_context *, const lmloss_tensor *,
                                          const lmloss_tensor *, int, const lmloss_tensor *);
lmloss_status lmloss_cpu_divergence(const lmloss_context *, const lmloss_div_inputs *,
                                    const lmloss_div_options *, const lmloss_div_outputs *,
                                    const lmloss_tensor *, const lmloss_tensor *, void *, size_t);
lmloss_status lmloss_cpu_grpo(const lmloss_context *, const lmloss_grpo_inputs *,
                              const lmloss_grpo_options *, const lmloss_grpo_outputs *,
                              const lmloss_tensor *, const lmloss_tensor *, const lmloss_tensor *,
                              void *, size_t);
lmloss_status lmloss_cpu_preference(const lmloss_context *, const lmloss_pref_inputs *,
                                    const lmloss_pref_options *, const lmloss_pref_outputs *,
                                    const lmloss_tensor *, const lmloss_tensor *,
                                    const lmloss_tensor *, void *, size_t);
lmloss_status lmloss_cpu_kto(const lmloss_context *, const lmloss_kto_inputs *,
                             const lmloss_kto_options *, const lmloss_kto_outputs *,
                             const lmloss_tensor *, const lmloss_tensor *);

lmloss_status lmloss_cpu_ce_state(const lmloss_context *, const lmloss_ce_inputs *,
                                  const lmloss_ce_options *, const lmloss_shard *,
                                  const lmloss_tensor *);
lmloss_status lmloss_cpu_ce_finish(const lmloss_context *, const lmloss_ce_inputs *,
                                   const lmloss_ce_options *, const lmloss_shard *,
                                   const lmloss_tensor *, const lmloss_ce_outputs *,
                                   const lmloss_tensor *, const lmloss_tensor *, void *, size_t);
lmloss_status lmloss_cpu_lp_state(const lmloss_context *, const lmloss_tensor *,
                                  const lmloss_tensor *, const lmloss_tensor *,
                                  const lmloss_transform *, const lmloss_shard *,
                                  const lmloss_tensor *);
lmloss_status lmloss_cpu_lp_finish(const lmloss_context *, const lmloss_tensor *,
                                   const lmloss_tensor *, const lmloss_tensor *,
                                   const lmloss_transform *, const lmloss_shard *,
                                   const lmloss_tensor *, const lmloss_tensor *,
                                   const lmloss_tensor *, const lmloss_tensor *,
                                   const lmloss_tensor *, const lmloss_tensor *, lmloss_row_keep *);
lmloss_status lmloss_cpu_softmax_finish(const lmloss_context *, const lmloss_tensor *,
                                        const lmloss_shard *, const lmloss_tensor *, int,
                                        const lmloss_tensor *);
lmloss_status lmloss_cpu_softmax_bwd_shard(const lmloss_context *, const lmloss_tensor *,
                                           const lmloss_tensor *, int, const lmloss_shard *,
                                           const lmloss_tensor *, const lmloss_tensor *,
                                           const lmloss_tensor *, const lmloss_tensor *);
lmloss_status lmloss_cpu_state_merge(const lmloss_context *, const lmloss_tensor *,
                                     const lmloss_tensor *, const lmloss_transform *,
                                     const lmloss_tensor *);

lmloss_status lmloss_cpu_div_state(const lmloss_context *, const lmloss_div_inputs *,
                                   const lmloss_div_options *, const lmloss_shard *,
                                   const lmloss_tensor *);
lmloss_status lmloss_cpu_div_merge(const lmloss_context *, const lmloss_tensor *,
                                   const lmloss_tensor *, const lmloss_div_options *,
                                   const lmloss_tensor *);
lmloss_status lmloss_cpu_div_partials(const lmloss_context *, const lmloss_div_inputs *,
                                      const lmloss_div_options *, const lmloss_shard *,
                                      const lmloss_tensor *, const lmloss_tensor *,
                                      const lmloss_tensor *, void *, size_t);
lmloss_status lmloss_cpu_div_finish(const lmloss_context *, const lmloss_div_inputs *,
                                    const lmloss_div_options *, const lmloss_shard *,
                                    const lmloss_tensor *, const lmloss_tensor *,
                                    const lmloss_div_outputs *, const lmloss_tensor *,
                                    const lmloss_tensor *, int, void *, size_t);

extern const lmloss_linear_prims lmloss_cpu_linear;

static const lmloss_state_ops cpu_states = {
    lmloss_cpu_ce_state,     lmloss_cpu_ce_finish,      lmloss_cpu_lp_state,
    lmloss_cpu_lp_finish,    lmloss_cpu_softmax_finish, lmloss_cpu_softmax_bwd_shard,
    lmloss_cpu_state_merge,  lmloss_cpu_div_state,      lmloss_cpu_div_merge,
    lmloss_cpu_div_partials, lmloss_cpu_div_finish,
};

/* The fused head takes F32 heads only here (lmloss.h). */
static int cpu_supports(lmloss_capability c) { return c != LMLOSS_CAN_16BIT_HEAD; }

const lmloss_backend_ops lmloss_cpu_ops = {
    lmloss_cpu_cross_entropy,
    lmloss_cpu_cross_entropy_backward,
    lmloss_cpu_log_probs,
    lmloss_cpu_log_probs_backward,
    lmloss_cpu_softmax,
    lmloss_cpu_softmax_backward,
    lmloss_cpu_divergence,
    &lmloss_cpu_linear,
    &cpu_states,
    cpu_supports,
    lmloss_cpu_grpo,
    lmloss_cpu_preference,
    lmloss_cpu_kto,
    NULL,
};

const char *lmloss_cpu_isa(void) { return lmloss_cpu_isa_name(); }
