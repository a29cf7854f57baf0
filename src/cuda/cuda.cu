/*
 * cuda.cu - the CUDA backend's function table. Each op lives in its own
 * file (ce.cu, logprob.cu, softmax.cu); every kernel runs on the caller's
 * stream, never synchronizes the host and never allocates.
 */
#include "common.cuh"

extern "C" {
lmloss_status lmloss_cuda_cross_entropy(const lmloss_context *, const lmloss_ce_inputs *,
                                        const lmloss_ce_options *, const lmloss_ce_outputs *,
                                        void *, size_t, lmloss_row_keep *);
lmloss_status lmloss_cuda_cross_entropy_backward(const lmloss_context *, const lmloss_ce_inputs *,
                                                 const lmloss_ce_options *, const lmloss_tensor *,
                                                 const lmloss_tensor *, void *, size_t,
                                                 lmloss_row_keep *);
lmloss_status lmloss_cuda_log_probs(const lmloss_context *, const lmloss_tensor *,
                                    const lmloss_tensor *, const lmloss_tensor *,
                                    const lmloss_transform *, const lmloss_tensor *,
                                    const lmloss_tensor *, const lmloss_tensor *);
lmloss_status lmloss_cuda_log_probs_backward(const lmloss_context *, const lmloss_tensor *,
                                             const lmloss_tensor *, const lmloss_tensor *,
                                             const lmloss_transform *, const lmloss_tensor *,
                                             const lmloss_tensor *, const lmloss_tensor *,
                                             const lmloss_tensor *, lmloss_row_keep *);
lmloss_status lmloss_cuda_softmax(const lmloss_context *, const lmloss_tensor *, int,
                                  const lmloss_tensor *);
lmloss_status lmloss_cuda_softmax_backward(const lmloss_context *, const lmloss_tensor *,
                                           const lmloss_tensor *, int, const lmloss_tensor *);
lmloss_status lmloss_cuda_divergence(const lmloss_context *, const lmloss_div_inputs *,
                                     const lmloss_div_options *, const lmloss_div_outputs *,
                                     const lmloss_tensor *, const lmloss_tensor *, void *, size_t);
extern const lmloss_linear_prims lmloss_cuda_linear; /* fused_linear.cu */
extern const lmloss_state_ops lmloss_cuda_states;    /* shard.cu */
lmloss_status lmloss_cuda_grpo(const lmloss_context *, const lmloss_grpo_inputs *,
                               const lmloss_grpo_options *, const lmloss_grpo_outputs *,
                               const lmloss_tensor *, const lmloss_tensor *, const lmloss_tensor *,
                               void *, size_t); /* grpo.cu */
lmloss_status lmloss_cuda_preference(const lmloss_context *, const lmloss_pref_inputs *,
                                     const lmloss_pref_options *, const lmloss_pref_outputs *,
                                     const lmloss_tensor *, const lmloss_tensor *,
                                     const lmloss_tensor *, void *, size_t); /* preference.cu */
lmloss_status lmloss_cuda_kto(const lmloss_context *, const lmloss_kto_inputs *,
                              const lmloss_kto_options *, const lmloss_kto_outputs *,
                              const lmloss_tensor *, const lmloss_tensor *); /* preference.cu */
lmloss_status lmloss_cuda_grpo_logits(const lmloss_context *, const lmloss_tensor *,
                                      const lmloss_tensor *, const lmloss_transform *,
                                      const lmloss_grpo_inputs *, const lmloss_grpo_options *,
                                      const lmloss_tensor *, void *, size_t); /* ce.cu */

/* Everything: the fused head, also of 16-bit heads, row states and the
 * divergences. */
static int cuda_supports(lmloss_capability c) { return c <= LMLOSS_CAN_DIVERGENCE; }

extern const lmloss_backend_ops lmloss_cuda_ops = {
    lmloss_cuda_cross_entropy, lmloss_cuda_cross_entropy_backward,
    lmloss_cuda_log_probs,     lmloss_cuda_log_probs_backward,
    lmloss_cuda_softmax,       lmloss_cuda_softmax_backward,
    lmloss_cuda_divergence,    &lmloss_cuda_linear,
    &lmloss_cuda_states,       cuda_supports,
    lmloss_cuda_grpo,          lmloss_cuda_preference,
    lmloss_cuda_kto,           lmloss_cuda_grpo_logits,
};
}
