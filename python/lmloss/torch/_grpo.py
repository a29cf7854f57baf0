"""The GRPO family in lmloss.torch: grpo_loss, TRL's GRPOTrainer loss from
per-token log-probs (lt.log_probs, lt.selective_log_softmax or the fused
head's lt.linear_log_probs make them from logits or hidden states),
differentiable w.r.t. the log-probs and the entropies.

One custom op, lmloss::grpo: its forward returns the loss, the metrics
(lmloss_grpo_metric's sums and counts) and, when autograd wants them, the
gradients at an upstream gradient of 1 ([B, T] each, the size of the
log-probs, formed in the same pass); the backward scales them by the
upstream scalar. Every input and the divisor stay on the device: the C
call reads the entropy threshold and num_items there, so a CUDA step
never synchronizes the host.

Options travel as two lists (_ops.ce_args says why): fopts
lmloss._grpo.FKEYS' values, iopts IKEYS' then [backend, num_threads, want
dlogp, want dentropy].
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .. import _lib
from .._grpo import IKEYS, METRIC_NAMES, grpo_struct, grpo_values
from . import _bridge as B
from ._dispatch import Differentiable, custom_op

F32 = torch.float32


def _options(fopts, iopts):
    return grpo_struct(fopts, iopts[:len(IKEYS)])


def _grads(logp, entropy, iopts):
    want = (iopts[-2], iopts[-1] and entropy is not None)
    return tuple(logp.new_empty(logp.shape if w else (0,), dtype=F32) for w in want)


@custom_op("lmloss::grpo")
def grpo(logp: Tensor, mask: Tensor, advantages: Tensor, old_logp: Optional[Tensor],
         ref_logp: Optional[Tensor], sampling_logp: Optional[Tensor],
         is_ratio: Optional[Tensor], entropy: Optional[Tensor],
         entropy_threshold: Optional[Tensor], num_items: Tensor, fopts: list[float],
         iopts: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """loss (0-d), metrics [LMLOSS_GRPO_METRICS], dlogp and dentropy at an
    upstream gradient of 1 ([0] when not wanted); F32 inputs, 2-D."""
    loss = logp.new_empty((), dtype=F32)
    metrics = logp.new_empty((_lib.GRPO_METRICS,), dtype=F32)
    dlogp, dentropy = _grads(logp, entropy, iopts)
    keep = []

    def v(t):
        return B.view(t, keep)

    with B.context(logp, iopts[-4], iopts[-3]) as ctx:
        inputs = _lib.GRPOInputs(v(logp), v(mask), v(advantages), v(old_logp), v(ref_logp),
                                 v(sampling_logp), v(is_ratio), v(entropy),
                                 v(None if entropy_threshold is None
                                   else entropy_threshold.reshape(1)), v(num_items.reshape(1)))
        out = _lib.GRPOOutputs(loss=v(loss.reshape(1)), metrics=v(metrics))
        if dlogp.numel():
            out.dlogp = v(dlogp)
        if dentropy.numel():
            out.dentropy = v(dentropy)
        ws, addr, nbytes = B.workspace(_lib.grpo_workspace_size(logp.shape[0]), logp.device)
        _lib.check(_lib.grpo(ctx, inputs, _options(fopts, iopts), out, addr, nbytes))
    return loss, metrics, dlogp, dentropy


@grpo.register_fake
def _(logp, mask, advantages, old_logp, ref_logp, sampling_logp, is_ratio, entropy,
      entropy_threshold, num_items, fopts, iopts):
    return ((logp.new_empty((), dtype=F32), logp.new_empty((_lib.GRPO_METRICS,), dtype=F32))
            + _grads(logp, entropy, iopts))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[2], output[3])


def _backward(ctx, dloss, _dmetrics, _ddlogp, _ddentropy):
    dlogp, dentropy = ctx.saved_tensors
    grads = [None] * 12
    if dloss is not None and ctx.needs_input_grad[0] and dlogp.numel():
        grads[0] = dlogp * dloss
    if dloss is not None and ctx.needs_input_grad[7] and dentropy.numel():
        grads[7] = dentropy * dloss
    return tuple(grads)


grpo = Differentiable(grpo, _setup, _backward)

Number = Union[int, float]


def _f32(t, like, name):
    """t as F32 on like's device, 2-D ([B] -> [B, 1]), or None."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s must be a tensor" % name)
    if t.device != like.device:
        raise _lib.Error("LMLOSS_ERR_BAD_DEVICE", "%s is on %s, per_token_logps on %s"
                         % (name, t.device, like.device))
    t = t.to(F32)
    return t.unsqueeze(1) if t.dim() == 1 else t


def _divisor(num_items, mask):
    """dapo's, cispo's and vespo's divisor as an F32 tensor on mask's
    device (None: the mask's sum, at least 1), never read to the host."""
    if num_items is None:
        return mask.sum().clamp(min=1.0)
    if isinstance(num_items, Tensor):
        return num_items
    return torch.tensor(_lib.float_option("num_items", num_items), dtype=F32, device=mask.device)


def high_entropy_threshold(entropies: Tensor, mask: Tensor, top_entropy_quantile: float) -> Tensor:
    """TRL's get_high_entropy_mask threshold on one process, on the device
    without a host sync: the (1 - top_entropy_quantile) quantile of the
    fp32 entropies where mask is set (torch.nanquantile over the others
    as NaN: torch.quantile's value on the kept ones), NaN where none is
    (which keeps no token, as TRL's empty mask)."""
    e = torch.where(mask.bool(), entropies.detach().float(), float("nan")).flatten()
    return torch.nanquantile(e, 1.0 - top_entropy_quantile)


def grpo_loss(per_token_logps: Tensor, advantages: Tensor, completion_mask: Tensor,
              old_per_token_logps: Optional[Tensor] = None,
              ref_per_token_logps: Optional[Tensor] = None, entropies: Optional[Tensor] = None,
              sampling_per_token_logps: Optional[Tensor] = None,
              importance_sampling_ratio: Optional[Tensor] = None, *, loss_type: str = "dapo",
              importance_sampling_level: str = "token", epsilon: float = 0.2,
              epsilon_high: Optional[float] = None, delta: Optional[float] = None,
              beta: float = 0.0, use_bias_correction_kl: bool = False,
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
              vespo_lambda_neg: float = 2.0, off_policy_mask_threshold: Optional[float] = None,
              top_entropy_quantile: float = 1.0, entropy_threshold: Optional[Tensor] = None,
              entropy_coef: float = 0.0, gradient_accumulation_steps: Number = 1,
              max_completion_length: Optional[int] = None,
              num_items: Optional[Union[Number, Tensor]] = None,
              vllm_importance_sampling_mode: Optional[str] = None,
              vllm_importance_sampling_clip_min: Optional[float] = None,
              vllm_importance_sampling_clip_max: Optional[float] = None,
              return_metrics: bool = False,
              backend: str = "auto", num_threads: int = 0
              ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """TRL's GRPOTrainer loss (_compute_loss) from the policy's per-token
    log-probs [B, T], differentiable w.r.t. them and entropies [B, T] (the
    entropy bonus' gradient; the entropy mask has none).

    Inputs as TRL names them: advantages [B] (or [B, T]), completion_mask
    [B, T] (times the tool mask where TRL has one), old, reference and
    sampling (vLLM's) per-token log-probs, importance_sampling_ratio
    [B, T] or [B, 1] (vLLM's correction as TRL's inputs carry it). Options
    are GRPOConfig's (lmloss.grpo_loss lists them); entropy_threshold
    (0-d tensor) replaces the one top_entropy_quantile forms on this
    process; num_items (number or tensor) is the divisor of dapo, cispo
    and vespo (TRL: num_items_in_batch.clamp(min=1) / num_processes *
    accumulation / steps_per_generation; None: the mask's sum, at least
    1); gradient_accumulation_steps divides the other types' loss and the
    bonus (TRL: current_gradient_accumulation_steps in training, 1 in
    evaluation); vllm_importance_sampling_mode and its clip bounds form
    vLLM's IS ratio from the old and sampling log-probs instead of taking
    importance_sampling_ratio (lmloss.grpo_loss says how).

    Returns the float32 0-d loss, or (loss, metrics) with return_metrics:
    a float32 [16] tensor of lmloss_grpo_metric's sums and counts (names:
    lmloss._grpo.METRIC_NAMES; metrics_dict and lmloss._grpo.trl_metrics
    make them TRL's logged means). CPU and CUDA tensors.
    """
    fopts, iopts = grpo_values(loss_type, importance_sampling_level, epsilon, epsilon_high,
                               delta, beta, use_bias_correction_kl, sapo_temperature_pos,
                               sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                               vespo_lambda_neg, off_policy_mask_threshold, entropy_coef,
                               gradient_accumulation_steps, max_completion_length,
                               vllm_importance_sampling_mode, vllm_importance_sampling_clip_min,
                               vllm_importance_sampling_clip_max)
    logp = per_token_logps
    if logp.dim() != 2:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "per_token_logps must be [B, T], got %s"
                         % (tuple(logp.shape),))
    mask = _f32(completion_mask, logp, "completion_mask")
    ent = entropies
    if entropy_threshold is None and top_entropy_quantile < 1.0 and ent is not None:
        entropy_threshold = high_entropy_threshold(ent, mask, top_entropy_quantile)
    num_items = _divisor(num_items, mask)
    want = torch.is_grad_enabled()
    iopts = iopts + [B.backend_code(backend), _lib.int_option("num_threads", num_threads),
                     int(want and logp.requires_grad),
                     int(want and ent is not None and ent.requires_grad)]
    loss, metrics, _, _ = grpo(
        logp.to(F32) if logp.dtype != F32 else logp, mask, _f32(advantages, logp, "advantages"),
        _f32(old_per_token_logps, logp, "old_per_token_logps"),
        _f32(ref_per_token_logps, logp, "ref_per_token_logps"),
        _f32(sampling_per_token_logps, logp, "sampling_per_token_logps"),
        _f32(importance_sampling_ratio, logp, "importance_sampling_ratio"),
        None if ent is None else (ent.to(F32) if ent.dtype != F32 else ent),
        None if entropy_threshold is None else _f32(entropy_threshold.reshape(1), logp,
                                                    "entropy_threshold"),
        _f32(num_items.reshape(1), logp, "num_items"), fopts, iopts)
    return (loss, metrics) if return_metrics else loss


class _OnLogits(torch.autograd.Function):
    """grpo_loss_on_logits' autograd: the forward forms dlogits at an
    upstream of 1 in the same C call (lmloss_grpo_logits), the backward
    scales them by the upstream scalar in place (no host read)."""

    @staticmethod
    def forward(ctx, logits, index, mask, advantages, old, ref, samp, is_ratio, ent, num_items,
                fopts, iopts, transform, backend, num_threads):
        b, t = mask.shape
        x = logits.reshape(b * t, logits.shape[-1])
        want = ctx.needs_input_grad[0]
        dlogits = torch.empty_like(x) if want else None
        logp = mask.new_empty((b, t))
        loss = mask.new_empty(())
        metrics = mask.new_empty((_lib.GRPO_METRICS,))
        keep = []

        def v(t_):
            return B.view(t_, keep)

        with B.context(x, backend, num_threads) as c:
            inputs = _lib.GRPOInputs(v(logp), v(mask), v(advantages), v(old), v(ref), v(samp),
                                     v(is_ratio), v(ent), v(None), v(num_items.reshape(1)))
            out = _lib.GRPOOutputs(loss=v(loss.reshape(1)), metrics=v(metrics))
            ws, addr, nbytes = B.workspace(_lib.grpo_logits_workspace_size(b, t), x.device)
            _lib.check(_lib.grpo_logits(c, v(x), v(index.reshape(-1)), B.transform(*transform),
                                        inputs, grpo_struct(fopts, iopts), out,
                                        B.ptr(v(dlogits) if want else None), addr, nbytes))
        ctx.dlogits, ctx.shape, ctx.run = dlogits, logits.shape, (backend, num_threads)
        ctx.mark_non_differentiable(logp, metrics)
        return loss, logp, metrics

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dloss, _dlogp, _dmetrics):
        dlogits, ctx.dlogits = ctx.dlogits, None
        if dloss is None:
            return (None,) * 15
        if dlogits is None:
            raise RuntimeError("grpo_loss_on_logits formed its gradient in the forward and the "
                               "first backward spent it: call it again to differentiate twice")
        B.scale_(dlogits, dloss, *ctx.run)
        return (dlogits.view(ctx.shape),) + (None,) * 14


def grpo_loss_on_logits(logits: Tensor, completion_ids: Tensor, advantages: Tensor,
                        completion_mask: Tensor, old_per_token_logps: Optional[Tensor] = None,
                        ref_per_token_logps: Optional[Tensor] = None,
                        entropies: Optional[Tensor] = None,
                        sampling_per_token_logps: Optional[Tensor] = None,
                        importance_sampling_ratio: Optional[Tensor] = None, *,
                        temperature: float = 1.0, loss_type: str = "dapo",
                        importance_sampling_level: str = "token", epsilon: float = 0.2,
                        epsilon_high: Optional[float] = None, delta: Optional[float] = None,
                        beta: float = 0.0, use_bias_correction_kl: bool = False,
                        sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                        vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
                        vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
                        off_policy_mask_threshold: Optional[float] = None,
                        gradient_accumulation_steps: Number = 1,
                        max_completion_length: Optional[int] = None,
                        num_items: Optional[Union[Number, Tensor]] = None,
                        vllm_importance_sampling_mode: Optional[str] = None,
                        vllm_importance_sampling_clip_min: Optional[float] = None,
                        vllm_importance_sampling_clip_max: Optional[float] = None,
                        return_metrics: bool = False, return_logps: bool = False,
                        backend: str = "auto", num_threads: int = 0
                        ) -> Union[Tensor, Tuple[Tensor, ...]]:
    """grpo_loss with the policy's log-probs taken from its logits [B, T,
    V] (or [B T, V]) at completion_ids [B, T] under temperature, in one C
    call (lmloss_grpo_logits): on CUDA, for token-level options without
    the off-policy mask, VESPO or a sequence IS mode, the gradient w.r.t.
    the logits is formed in the log-probs' own pass (the logits read once,
    dlogits written once); otherwise the log-probs, then their backward.
    Differentiable w.r.t. logits (in their dtype); entropies, when given,
    feed the metrics with no gradient (no entropy mask or bonus here:
    grpo_loss on lt.log_probs has them). Returns the loss, and (as
    grpo_loss) the metrics with return_metrics, then the per-token
    log-probs [B, T] (float32, no gradient) with return_logps; the one
    pass does not read the logits of a token whose mask is 0 (its
    gradient is 0) and returns 0 as its log-prob."""
    fopts, iopts = grpo_values(loss_type, importance_sampling_level, epsilon, epsilon_high,
                               delta, beta, use_bias_correction_kl, sapo_temperature_pos,
                               sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                               vespo_lambda_neg, off_policy_mask_threshold, 0.0,
                               gradient_accumulation_steps, max_completion_length,
                               vllm_importance_sampling_mode, vllm_importance_sampling_clip_min,
                               vllm_importance_sampling_clip_max)
    mask = completion_mask.to(device=logits.device, dtype=F32).contiguous()
    if mask.dim() != 2:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "completion_mask must be [B, T], got %s"
                         % (tuple(mask.shape),))
    num_items = _divisor(num_items, mask)
    like = mask
    loss, logp, metrics = _OnLogits.apply(
        logits, completion_ids.to(logits.device), mask, _f32(advantages, like, "advantages"),
        _f32(old_per_token_logps, like, "old_per_token_logps"),
        _f32(ref_per_token_logps, like, "ref_per_token_logps"),
        _f32(sampling_per_token_logps, like, "sampling_per_token_logps"),
        _f32(importance_sampling_ratio, like, "importance_sampling_ratio"),
        None if entropies is None else _f32(entropies.detach(), like, "entropies"),
        _f32(num_items.reshape(1), like, "num_items"), fopts, iopts,
        (1.0, _lib.softcap_value(None), float(temperature)), B.backend_code(backend),
        _lib.int_option("num_threads", num_threads))
    out = (loss,) + ((metrics,) if return_metrics else ()) + ((logp,) if return_logps else ())
    return out[0] if len(out) == 1 else out


def metrics_dict(metrics: Tensor) -> dict:
    """grpo_loss's metrics tensor as {name: float} (reads it to the host)."""
    return dict(zip(METRIC_NAMES, metrics.tolist()))
