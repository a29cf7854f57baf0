"""nn.Module forms of the lmloss.torch losses (options fixed at construction)."""

from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import _functional as F
from ._linear_divergence import linear_generalized_jsd

Items = Optional[Union[int, float, Tensor]]


class CrossEntropyLoss(torch.nn.Module):
    """Like torch.nn.CrossEntropyLoss over logits [..., V] (float32, bf16,
    fp16) and target [...] (class indices, or class probabilities of the
    logits' shape), weight = per-class weights [V] as torch's, plus the
    lmloss options z_loss, logit_scale, softcap, temperature, dft, shift,
    num_items and inplace_backward (the gradient written over the logits,
    as Liger-Kernel's LigerCrossEntropyLoss does: lmloss.torch.cross_entropy
    says when). forward(logits, target, token_weight=None, num_items=None) ->
    float32 loss (0-d, or [...] for reduction="none"; token_weight [...]
    per-token weights); a num_items given to forward overrides the
    module's. The function is lmloss.torch.cross_entropy."""

    def __init__(self, weight: Optional[Tensor] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                 logit_scale: float = 1.0, softcap: Optional[float] = None,
                 temperature: float = 1.0, dft: bool = False, num_items: Items = None,
                 shift: Union[bool, int] = 0, backend: str = "auto",
                 inplace_backward: bool = False) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.options = dict(ignore_index=ignore_index, reduction=reduction,
                            label_smoothing=label_smoothing, z_loss=z_loss,
                            logit_scale=logit_scale, softcap=softcap, temperature=temperature,
                            dft=dft, shift=shift, backend=backend,
                            inplace_backward=inplace_backward)
        self.num_items = num_items

    def forward(self, logits: Tensor, target: Tensor, token_weight: Optional[Tensor] = None,
                num_items: Items = None) -> Tensor:
        items = self.num_items if num_items is None else num_items
        return F.cross_entropy(logits, target, weight=self.weight, token_weight=token_weight,
                               num_items=items, **self.options)


class LinearCrossEntropyLoss(torch.nn.Module):
    """The fused-head cross-entropy: forward(hidden [..., H], head_weight
    [V, H], labels [...], bias=None, token_weight=None, num_items=None) ->
    loss, without materializing the logits. Keywords of
    lmloss.torch.linear_cross_entropy (class_weight, ignore_index,
    label_smoothing, z_loss, logit_scale, softcap, temperature, reduction,
    dft, shift, memory_budget) are fixed at construction.

    The order is (hidden, weight, labels), as cut-cross-entropy's and
    lmloss.torch.linear_cross_entropy's, not Liger-Kernel's
    LigerFusedLinearCrossEntropyLoss (weight, hidden, labels): Liger's
    order raises lmloss.Error (LMLOSS_ERR_BAD_SHAPE) where the shapes tell
    (head_weight.shape[1] must be hidden.shape[-1], labels shaped like
    hidden.shape[:-1]), and where they cannot (N == V) when hidden is an
    nn.Parameter and head_weight is not (the lm_head's weight passed
    first); hidden and head_weight must share a device
    (LMLOSS_ERR_BAD_DEVICE)."""

    def __init__(self, *, class_weight: Optional[Tensor] = None, num_items: Items = None,
                 **options: Any) -> None:
        super().__init__()
        self.register_buffer("class_weight", class_weight)
        self.options, self.num_items = options, num_items

    def forward(self, hidden: Tensor, head_weight: Tensor, labels: Tensor,
                bias: Optional[Tensor] = None, token_weight: Optional[Tensor] = None,
                num_items: Items = None) -> Tensor:
        items = self.num_items if num_items is None else num_items
        return F.linear_cross_entropy(hidden, head_weight, labels, bias=bias,
                                      class_weight=self.class_weight, token_weight=token_weight,
                                      num_items=items, **self.options)


class LinearLogProbs(torch.nn.Module):
    """Per-token log-probs of the fused head: forward(hidden [..., H],
    head_weight [V, H], index [...] or [..., K], bias=None, mask=None) ->
    float32 logp shaped like index (or (logp, entropy) with entropy=True).
    Keywords of lmloss.torch.linear_log_probs are fixed at construction."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def forward(self, hidden: Tensor, head_weight: Tensor, index: Tensor,
                bias: Optional[Tensor] = None, mask: Optional[Tensor] = None) -> Any:
        return F.linear_log_probs(hidden, head_weight, index, bias=bias, mask=mask,
                                  **self.options)


class LinearGeneralizedJSD(torch.nn.Module):
    """TRL's generalized JSD through two fused heads, called as
    Liger-Kernel's LigerFusedLinearJSD: forward(student_input [..., Hs],
    student_weight [V, Hs], teacher_input [..., Ht], teacher_weight [V, Ht],
    shift_labels=None [...]) -> the float32 0-d loss, beta weighting the
    teacher as Liger's jsd_beta does (0: KL(q || p), 1: KL(p || q)).

    As Liger's, the sum is divided by the rows shift_labels keep, or by all
    rows without labels (the inputs are flattened to rows first, so a
    [B, T, H] input divides by B * T, where linear_generalized_jsd divides
    by B as TRL does). Unlike Liger's: every row ignored gives 0 (Liger
    divides by 0), the GEMMs run in float32 on the CPU (no CUDA yet), and
    further keywords of lmloss.torch.linear_generalized_jsd (student_bias,
    teacher_bias, softcap, memory_budget, ...) are fixed at construction."""

    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100,
                 temperature: float = 1.0, **options: Any) -> None:
        super().__init__()
        self.jsd_beta, self.ignore_index, self.temperature = jsd_beta, ignore_index, temperature
        self.options = options

    def forward(self, student_input: Tensor, student_weight: Tensor, teacher_input: Tensor,
                teacher_weight: Tensor, shift_labels: Optional[Tensor] = None) -> Tensor:
        labels = None if shift_labels is None else shift_labels.reshape(-1)
        return linear_generalized_jsd(
            student_input.reshape(-1, student_input.shape[-1]), student_weight,
            teacher_input.reshape(-1, teacher_input.shape[-1]), teacher_weight, labels,
            self.jsd_beta, self.temperature, ignore_index=self.ignore_index, **self.options)
