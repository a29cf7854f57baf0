"""The DPO family through the fused head (lmloss_linear_preference):
linear_dpo_loss, TRL's DPOTrainer loss from the policy's hidden states of
the concatenated batch (the chosen completions, then the rejected) and the
head, never holding the logits. A pair's gradient is known once its rows'
log-probs are, so the C call forms the loss's gradients in its forward, a
group of whole pairs at a time (three GEMMs); the backward scales them by
the upstream scalar in place, as the fused cross-entropy's does, and a
second backward through the same graph recomputes."""

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _lib
from .._preference import pref_struct, pref_values
from . import _bridge as B
from ._dispatch import Differentiable, custom_op
from ._functional import _budget, _head, _index_2d, _mask
from ._grpo import F32
from ._linear_ops import (NEED_DH, NEED_DW, _fused_formula, _grads, _grads_struct, _head as
                          _head_struct, _hopt, _workspace)
from ._ops import run_args


def _outputs(hidden, pairs):
    return (hidden.new_empty((), dtype=F32), hidden.new_empty((_lib.PREF_METRICS,), dtype=F32),
            hidden.new_empty((pairs,), dtype=F32), hidden.new_empty((pairs,), dtype=F32),
            hidden.new_empty((pairs,), dtype=F32))


def _call(hidden, weight, bias, index, mask, ref_chosen, ref_rejected, pair_weight, fopts, iopts,
          memory_budget, need, scale=None):
    """The C call: (loss, metrics, pair_loss, chosen, rejected) and the
    gradients in `need` (times the device scalar scale, when given)."""
    pairs = iopts[1]
    outs = _outputs(hidden, pairs)
    grads = _grads(hidden, weight, bias, need)
    keep, hopt = [], _hopt(memory_budget)
    opt = pref_struct(fopts, iopts[0])

    def v(t):
        return B.view(t, keep)

    with B.context(hidden, *run_args(iopts)) as ctx:
        head = _head_struct(hidden, weight, bias, keep)
        gs = _grads_struct(grads, keep) if need else None
        ws, addr, nbytes = _workspace(hidden.device, _lib.linear_preference_size, head, hopt,
                                      B.ptr(gs), pairs, opt)
        if not nbytes:
            raise _lib.Error("LMLOSS_ERR_UNSUPPORTED", "linear_dpo_loss: no group of %s fits "
                             "memory_budget; raise it, or use linear_log_probs and dpo_loss"
                             % ("all pairs (the loss type couples them)"
                                if any(fopts[_lib.PREF_TYPES.index(t)]
                                       for t in ("aot", "aot_unpaired", "sft")) else "one pair"))
        inputs = _lib.LinearPrefInputs(pairs, v(ref_chosen), v(ref_rejected), v(pair_weight),
                                        iopts[4])
        out = _lib.LinearPrefOutputs(v(outs[0].reshape(1)), v(outs[1]), v(outs[2]), v(outs[3]),
                                     v(outs[4]))
        _lib.check(_lib.linear_preference(ctx, head, v(index), v(mask),
                                          _lib.transform_default(), hopt, inputs, opt, out,
                                          B.ptr(gs), addr, nbytes))
        if scale is not None and need:
            _lib.check(_lib.linear_scale_grads(ctx, head, gs,
                                               v(scale.reshape(1).to(F32))))
    return outs + grads


@custom_op("lmloss::linear_preference")
def linear_preference(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor,
                      mask: Optional[Tensor], ref_chosen: Optional[Tensor],
                      ref_rejected: Optional[Tensor], pair_weight: Optional[Tensor],
                      fopts: list[float], iopts: list[int], memory_budget: int, need: int
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """loss (0-d), metrics [LMLOSS_PREF_METRICS], each pair's terms, the
    chosen and rejected sums [P], then the (hidden, weight, bias)
    gradients in `need` at an upstream gradient of 1 ([0] otherwise).
    iopts: [f-divergence, P, backend, num_threads, average]."""
    return _call(hidden, weight, bias, index, mask, ref_chosen, ref_rejected, pair_weight, fopts,
                 iopts, memory_budget, need)


@linear_preference.register_fake
def _(hidden, weight, bias, index, mask, ref_chosen, ref_rejected, pair_weight, fopts, iopts,
      memory_budget, need):
    return _outputs(hidden, iopts[1]) + _grads(hidden, weight, bias, need)


@custom_op("lmloss::linear_preference_backward")
def linear_preference_backward(dloss: Tensor, hidden: Tensor, weight: Tensor,
                               bias: Optional[Tensor], index: Tensor, mask: Optional[Tensor],
                               ref_chosen: Optional[Tensor], ref_rejected: Optional[Tensor],
                               pair_weight: Optional[Tensor], fopts: list[float],
                               iopts: list[int], memory_budget: int, need: int
                               ) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients again (a second backward through the graph), times dloss."""
    return _call(hidden, weight, bias, index, mask, ref_chosen, ref_rejected, pair_weight, fopts,
                 iopts, memory_budget, need, dloss)[5:]


@linear_preference_backward.register_fake
def _(dloss, hidden, weight, bias, *rest):
    return _grads(hidden, weight, bias, rest[-1])


linear_preference = Differentiable(linear_preference,
                                   *_fused_formula(8, 5, linear_preference_backward))


def linear_dpo_loss(hidden: Tensor, weight: Tensor, index: Tensor,
                    mask: Optional[Tensor] = None, ref_chosen_logps: Optional[Tensor] = None,
                    ref_rejected_logps: Optional[Tensor] = None, *,
                    bias: Optional[Tensor] = None,
                    loss_type: Union[str, Sequence[str]] = "sigmoid",
                    loss_weights: Optional[Sequence[float]] = None, beta: float = 0.1,
                    label_smoothing: float = 0.0, f_divergence_type: str = "reverse_kl",
                    f_alpha_divergence_coef: float = 0.5, discopop_tau: float = 0.05,
                    simpo_gamma: float = 0.5, weight_per_pair: Optional[Tensor] = None,
                    average_log_prob: bool = False, memory_budget: Optional[int] = None,
                    return_metrics: bool = False,
                    backend: str = "auto", num_threads: int = 0
                    ) -> Union[Tensor, Tuple[Tensor, dict]]:
    """TRL's DPOTrainer loss (lmloss.dpo_loss lists the options; the mean
    over pairs) from the policy's hidden states [2P, T, H] of the
    concatenated batch, the P chosen completions first, and the head
    weight [V, H] (+ bias), with index [2P, T] the tokens each position
    predicts and mask [2P, T] the ones that count (TRL's completion mask);
    the reference's sequence sums ref_*_logps [P]. Never holds the [2P T,
    V] logits: the head runs three GEMMs, a group of whole pairs at a time
    (the forward forms the gradients, the backward scales them), within
    memory_budget (None: that of the three-GEMM cross-entropy). The types
    that couple pairs (aot, aot_unpaired, sft) need every pair in one
    group. average_log_prob: each sequence's mean log-prob over its tokens
    that count in place of its sum (CPOTrainer's and ORPOTrainer's, for
    "simpo", "cpo_ipo", "orpo"; 0 for a completion with none).
    Differentiable w.r.t. hidden and weight (not bias). Returns the
    float32 0-d loss, or (loss, metrics) with return_metrics: float32
    tensors, "metrics" [8] as dpo_loss's, "chosen_logps" and
    "rejected_logps" [P] the policy's sums or means (detached)."""
    fopts, fdiv = pref_values(loss_type, loss_weights, beta, label_smoothing, f_divergence_type,
                              f_alpha_divergence_coef, discopop_tau, simpo_gamma)
    if hidden.dim() == 3 and index.dim() == 2 and hidden.shape[:2] != index.shape:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "hidden %s and index %s disagree"
                         % (tuple(hidden.shape), tuple(index.shape)))
    if index.dim() != 2 or index.shape[0] % 2:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "index must be [2P, T] (the chosen, then the "
                         "rejected), got %s" % (tuple(index.shape),))
    pairs = index.shape[0] // 2
    h, w, b = _head(hidden, weight, bias, index)
    if b is not None and b.requires_grad and torch.is_grad_enabled():
        raise _lib.Error("LMLOSS_ERR_UNSUPPORTED", "linear_dpo_loss forms no bias gradient "
                         "(linear_log_probs and dpo_loss do)")
    idx, _ = _index_2d(index.reshape(-1), h.shape[:1], h, "hidden")

    def vec(t):
        return None if t is None else t.detach().to(F32).reshape(-1)

    need = 0
    if torch.is_grad_enabled():
        need = (NEED_DH if h.requires_grad else 0) | (NEED_DW if w.requires_grad else 0)
    iopts = [fdiv, pairs, B.backend_code(backend), _lib.int_option("num_threads", num_threads),
             int(bool(average_log_prob))]
    loss, metrics, _, chosen, rejected, *_ = linear_preference(
        h, w, b, idx, _mask(mask), vec(ref_chosen_logps), vec(ref_rejected_logps),
        vec(weight_per_pair), fopts, iopts, _budget(memory_budget), need)
    if not return_metrics:
        return loss
    return loss, {"metrics": metrics.detach(), "chosen_logps": chosen.detach(),
                  "rejected_logps": rejected.detach()}
