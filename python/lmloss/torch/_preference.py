"""The DPO family in lmloss.torch: dpo_loss, TRL's DPOTrainer loss from the
policy's sequence log-prob sums (of lt.log_probs or the fused head's
per-token log-probs), differentiable w.r.t. the chosen and rejected sums.

One custom op, lmloss::preference, as lmloss::grpo: the loss, the metrics
and the two gradients at an upstream gradient of 1 ([P] each, formed in
the same call), scaled by the upstream scalar in the backward. Options
travel as fopts [the 15 loss weights, beta, label_smoothing, f_alpha,
discopop_tau] and iopts [f_divergence, backend, num_threads, want
gradients]."""

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _lib
from .._preference import METRIC_NAMES, kto_struct, kto_values, pref_struct, pref_values
from . import _bridge as B
from ._dispatch import Differentiable, custom_op
from ._grpo import F32, _f32


def _options(fopts, iopts):
    return pref_struct(fopts, iopts[0])


def _grads(chosen, iopts):
    shape = chosen.shape if iopts[3] else (0,)
    return chosen.new_empty(shape, dtype=F32), chosen.new_empty(shape, dtype=F32)


@custom_op("lmloss::preference")
def preference(chosen: Tensor, rejected: Tensor, ref_chosen: Optional[Tensor],
               ref_rejected: Optional[Tensor], chosen_tokens: Optional[Tensor],
               rejected_tokens: Optional[Tensor], weight: Optional[Tensor], fopts: list[float],
               iopts: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """loss (0-d), metrics [LMLOSS_PREF_METRICS], dchosen and drejected at an
    upstream gradient of 1 ([0] when not wanted), each pair's own terms
    [P]; F32 vectors [P]."""
    loss = chosen.new_empty((), dtype=F32)
    metrics = chosen.new_empty((_lib.PREF_METRICS,), dtype=F32)
    dc, dr = _grads(chosen, iopts)
    pairs = chosen.new_empty(chosen.shape, dtype=F32)
    keep = []

    def v(t):
        return B.view(t, keep)

    with B.context(chosen, iopts[1], iopts[2]) as ctx:
        inputs = _lib.PrefInputs(v(chosen), v(rejected), v(ref_chosen), v(ref_rejected),
                                 v(chosen_tokens), v(rejected_tokens), v(weight))
        out = _lib.PrefOutputs(loss=v(loss.reshape(1)), metrics=v(metrics), pair_loss=v(pairs))
        if dc.numel():
            out.dchosen, out.drejected = v(dc), v(dr)
        ws, addr, nbytes = B.workspace(_lib.pref_workspace_size(chosen.shape[0]), chosen.device)
        _lib.check(_lib.preference(ctx, inputs, _options(fopts, iopts), out, addr, nbytes))
    return loss, metrics, dc, dr, pairs


@preference.register_fake
def _(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, weight, fopts,
      iopts):
    return ((chosen.new_empty((), dtype=F32),
             chosen.new_empty((_lib.PREF_METRICS,), dtype=F32)) + _grads(chosen, iopts)
            + (chosen.new_empty(chosen.shape, dtype=F32),))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[2], output[3])


def _backward(ctx, dloss, _dmetrics, _ddc, _ddr, dpairs):
    """The mean's gradient scaled by its upstream; the pairs' (pair-local
    terms: each pair's gradient is P times its share of the mean's) by
    theirs."""
    dc, dr = ctx.saved_tensors
    grads = [None] * 9
    if not dc.numel():
        return tuple(grads)
    for i, d in ((0, dc), (1, dr)):
        if not ctx.needs_input_grad[i]:
            continue
        g = None if dloss is None else d * dloss
        if dpairs is not None:
            gp = d * (dpairs * d.shape[0])
            g = gp if g is None else g + gp
        grads[i] = g
    return tuple(grads)


preference = Differentiable(preference, _setup, _backward)


def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor,
             ref_chosen_logps: Optional[Tensor] = None,
             ref_rejected_logps: Optional[Tensor] = None, *,
             loss_type: Union[str, Sequence[str]] = "sigmoid",
             loss_weights: Optional[Sequence[float]] = None, beta: float = 0.1,
             label_smoothing: float = 0.0, f_divergence_type: str = "reverse_kl",
             f_alpha_divergence_coef: float = 0.5, discopop_tau: float = 0.05,
             simpo_gamma: float = 0.5, reduction: str = "mean",
             chosen_tokens: Optional[Tensor] = None, rejected_tokens: Optional[Tensor] = None,
             weight: Optional[Tensor] = None, return_metrics: bool = False,
             backend: str = "auto", num_threads: int = 0
             ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """TRL's DPOTrainer loss (lmloss.dpo_loss lists the options) from the
    policy's sequence log-prob sums chosen_logps, rejected_logps [P] and
    the reference's, differentiable w.r.t. the policy's. Returns the
    float32 0-d loss (reduction "none": each pair's own terms [P], as
    lmloss.dpo_loss says), or (loss, metrics) with return_metrics (float32
    [8]:
    lmloss._preference.METRIC_NAMES; metrics_dict reads them). CPU and
    CUDA tensors; nothing is read to the host."""
    fopts, fdiv = pref_values(loss_type, loss_weights, beta, label_smoothing, f_divergence_type,
                              f_alpha_divergence_coef, discopop_tau, simpo_gamma)
    if reduction not in ("mean", "none"):
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "reduction must be 'mean' or 'none', got %r"
                         % (reduction,))
    if reduction == "none" and any(fopts[_lib.PREF_TYPES.index(t)]
                                   for t in ("aot", "aot_unpaired", "sft")):
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "reduction 'none' has no per-pair value of "
                         "aot, aot_unpaired or sft")
    c = chosen_logps
    if c.dim() != 1:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "chosen_logps must be [P], got %s"
                         % (tuple(c.shape),))
    want = int(torch.is_grad_enabled() and (c.requires_grad or rejected_logps.requires_grad))
    iopts = [fdiv, B.backend_code(backend), _lib.int_option("num_threads", num_threads), want]

    def vec(t, name):  # [P] F32, as the C call's [P, 1]
        t = _f32(t, c, name)
        return None if t is None else t.reshape(-1)

    loss, metrics, _, _, pairs = preference(
        vec(c, "chosen_logps"), vec(rejected_logps, "rejected_logps"),
        vec(ref_chosen_logps, "ref_chosen_logps"), vec(ref_rejected_logps, "ref_rejected_logps"),
        vec(chosen_tokens, "chosen_tokens"), vec(rejected_tokens, "rejected_tokens"),
        vec(weight, "weight"), fopts, iopts)
    if reduction == "none":
        loss = pairs
    return (loss, metrics) if return_metrics else loss


def metrics_dict(metrics: Tensor) -> dict:
    """dpo_loss's metrics tensor as {name: float} (reads it to the host)."""
    return dict(zip(METRIC_NAMES, metrics.tolist()))


@custom_op("lmloss::kto")
def kto(logps: Tensor, ref_logps: Optional[Tensor], label: Tensor, kl: Optional[Tensor],
        fopts: list[float], iopts: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """loss (0-d), metrics [LMLOSS_KTO_METRICS] and dlogps at an upstream
    gradient of 1 ([0] when not wanted); iopts [type, backend, num_threads,
    want the gradient]."""
    loss = logps.new_empty((), dtype=F32)
    metrics = logps.new_empty((_lib.KTO_METRICS,), dtype=F32)
    d = logps.new_empty(logps.shape if iopts[3] else (0,), dtype=F32)
    keep = []

    def v(t):
        return B.view(t, keep)

    with B.context(logps, iopts[1], iopts[2]) as ctx:
        inputs = _lib.KTOInputs(v(logps), v(ref_logps), v(label), v(kl))
        out = _lib.KTOOutputs(loss=v(loss.reshape(1)), metrics=v(metrics))
        if d.numel():
            out.dlogps = v(d)
        _lib.check(_lib.kto(ctx, inputs, kto_struct(fopts, iopts[0]), out))
    return loss, metrics, d


@kto.register_fake
def _(logps, ref_logps, label, kl, fopts, iopts):
    return (logps.new_empty((), dtype=F32), logps.new_empty((_lib.KTO_METRICS,), dtype=F32),
            logps.new_empty(logps.shape if iopts[3] else (0,), dtype=F32))


def _kto_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2])


def _kto_backward(ctx, dloss, _dmetrics, _dd):
    (d,) = ctx.saved_tensors
    grads = [None] * 6
    if dloss is not None and d.numel() and ctx.needs_input_grad[0]:
        grads[0] = d * dloss
    return tuple(grads)


kto = Differentiable(kto, _kto_setup, _kto_backward)


def kto_loss(logps: Tensor, ref_logps: Optional[Tensor], label: Tensor,
             kl: Optional[Union[float, Tensor]] = None, *, loss_type: str = "kto",
             beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             return_metrics: bool = False, backend: str = "auto", num_threads: int = 0
             ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """KTOTrainer's loss (lmloss.kto_loss says what) from the policy's
    sequence log-prob sums [N], the reference's and the labels [N],
    differentiable w.r.t. logps; kl a number or a tensor (detached). Returns
    the float32 0-d loss, or (loss, metrics [8]) with return_metrics."""
    fopts, code = kto_values(loss_type, beta, desirable_weight, undesirable_weight)
    if logps.dim() != 1:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "logps must be [N], got %s"
                         % (tuple(logps.shape),))
    want = int(torch.is_grad_enabled() and logps.requires_grad)
    iopts = [code, B.backend_code(backend), _lib.int_option("num_threads", num_threads), want]
    if kl is not None and not isinstance(kl, Tensor):
        kl = torch.tensor(_lib.float_option("kl", kl), dtype=F32, device=logps.device)
    lab = label.to(device=logps.device, dtype=torch.bool).reshape(-1)
    loss, metrics, _ = kto(_f32(logps, logps, "logps"), _f32(ref_logps, logps, "ref_logps"), lab,
                           None if kl is None else _f32(kl.detach().reshape(1), logps, "kl"),
                           fopts, iopts)
    return (loss, metrics) if return_metrics else loss
