"""The divergences of lmloss.torch: generalized_jsd (TRL's
GKDTrainer.generalized_jsd_loss), kl_div and tvd of a student's logits
from a teacher's, both [..., V], differentiable w.r.t. the student only
(_linear_divergence.py: the same through two fused heads).

Reductions are F.kl_div's and TRL's, over the loss tensor TRL forms (the
elementwise terms of the rows that labels keep):
  "batchmean"  sum / the rows labels keep (at least 1); without labels,
               sum / max(student_logits.size(0), 1): B of a [B, T, V]
               input, as F.kl_div and TRL divide (not B * T)
  "sum"        sum
  "mean"       sum / (the rows kept * V): TRL's jsd.mean() over elements
               (NaN when no row is kept, as there)
  "none"       per-row values [...], rows labels drop 0 (TRL returns the
               elementwise [.., V] tensor there)
and num_items_in_batch (a number or tensor) -> sum / num_items_in_batch
whatever the reduction, as TRL. The C call divides where it can (a
divisor known on the host; batchmean's rows kept, which it counts on the
device), so that a backward from the loss scales the gradient the forward
formed by 1, which costs no pass over it and rounds a 16-bit one once;
other divisions (a tensor num_items, mean's rows kept times V, and the
sharded heads', whose chunks sum first) run in torch on the device.
Nothing reads back to the host.

process_group= (torch.distributed, as cross_entropy's): the logits are this
rank's vocabulary shard [..., V_r] of both models (Megatron's layout,
vocab_start / vocab_size for uneven shards), labels in the whole
vocabulary; every rank gets the whole rows' loss, "mean" divides by the
whole vocabulary, and the student's gradient covers its columns
(_vocab_parallel.Divergence: two collectives in the forward, none in the
backward). Eager only.
"""

from typing import Any, Optional, Union

import torch
from torch import Tensor

from .. import _lib
from .._divergence import sides
from . import _div_ops as D
from ._bridge import backend_code
from . import _vocab_parallel as VP
from ._functional import Number, _bad, _rows, _same_device, _target

REDUCTIONS = ("batchmean", "sum", "mean", "none")
Items = Optional[Union[Number, Tensor]]


def _divisor(reduction, num_items, label, ignore_index, rows, v, size0, device):
    """What the summed loss is divided by (module docstring), or None."""
    if num_items is not None:
        return num_items.to(device) if isinstance(num_items, Tensor) else num_items
    kept = None if label is None else (label != ignore_index).sum()  # on the device
    if reduction == "batchmean":
        return max(size0, 1) if kept is None else kept.clamp_min(1)
    if reduction == "mean":
        return (rows if kept is None else kept) * v
    return None


class _Logits:
    """What _distill differentiates: the student's and teacher's logits [..., V]."""

    name = "student_logits"
    divides = True  # the C call divides the sum (_division)

    def __init__(self, student_logits, teacher_logits):
        if teacher_logits.shape != student_logits.shape:
            raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "teacher_logits has shape %s, "
                             "student_logits %s" % (tuple(teacher_logits.shape),
                                                    tuple(student_logits.shape)))
        _same_device(teacher_logits, student_logits, "teacher_logits", "student_logits")
        self.x = _rows(student_logits, "student_logits")
        self.t = _rows(teacher_logits, "teacher_logits")
        self.like, self.lead, self.v = student_logits, student_logits.shape[:-1], self.x.shape[1]

    def loss(self, label, fopts, iopts, per_row):
        """The C call's per-row values or sum, in the student's graph."""
        x = self.x
        if x.shape[0] == 0:  # no rows: an empty or zero sum, in the graph (the C call needs data)
            loss = x.float().sum(-1)
            return loss if per_row else loss.sum()
        fused = not per_row and torch.is_grad_enabled() and x.requires_grad
        return D.divergence(x, self.t.detach(), label, fopts, iopts, fused)[0]


class _ShardLogits(_Logits):
    """_Logits of a vocabulary shard: the loss through the vocab-parallel op,
    v the whole vocabulary's width (what "mean" divides by)."""

    def __init__(self, student_logits, teacher_logits, process_group, vocab_start, vocab_size):
        super().__init__(student_logits, teacher_logits)
        self.shard = VP.Shard(process_group, self.v, vocab_start, vocab_size)
        self.v = self.shard.vocab

    def loss(self, label, fopts, iopts, per_row):
        if self.x.shape[0] == 0:  # no rows: no exchange either, as on every rank
            return super().loss(label, fopts, iopts, per_row)
        fused = not per_row and torch.is_grad_enabled() and self.x.requires_grad
        return VP.Divergence.apply(self.x, self.t.detach(), label, fopts, iopts, self.shard, fused)


def _pair(student_logits, teacher_logits, process_group, vocab_start, vocab_size):
    if process_group is None:
        return _Logits(student_logits, teacher_logits)
    return _ShardLogits(student_logits, teacher_logits, process_group, vocab_start, vocab_size)


def _distill(pair, labels, kind, beta, temperature, reduction, num_items, teacher_temperature,
             logit_scale, teacher_logit_scale, softcap, teacher_softcap, soft_weight,
             hard_weight, ignore_index, backend, num_threads):
    """The one body of the public functions (these and the fused heads'):
    `pair` has the student's rows' shape (lead), V, the tensor labels go
    with (like, named name) and loss(); then their arguments and the kind."""
    if reduction not in REDUCTIONS:
        raise _bad("reduction must be one of %s, got %r" % (", ".join(REDUCTIONS), reduction))
    lead = pair.lead
    label = None if labels is None else _target(labels, lead, pair.like, pair.name, "labels")
    per_row = reduction == "none" and num_items is None
    c_reduction, items, divisor = (("none", None, None) if per_row else
                                   _division(pair, reduction, num_items, label, ignore_index))
    fopts, iopts = D.div_args(kind, beta, *sides(logit_scale, softcap, temperature,
                                                 teacher_logit_scale, teacher_softcap,
                                                 teacher_temperature),
                              soft_weight, hard_weight, ignore_index, c_reduction,
                              backend_code(backend), num_threads, items)
    loss = pair.loss(label, fopts, iopts, per_row)
    if per_row:
        return loss.reshape(lead)
    return loss if divisor is None else loss / divisor


def _division(pair, reduction, num_items, label, ignore_index):
    """(the C call's reduction, its num_items, what torch divides its sum
    by after it, or None): the C call divides where it can (module
    docstring)."""
    if pair.divides and reduction == "batchmean" and num_items is None and label is not None:
        return "mean", None, None  # C's mean is over the rows not ignored, 0 when none is
    lead = pair.lead
    # size(0) of the logits [..., V] (the student's [V] alone: V), as TRL reads it
    size0 = (tuple(lead) + (pair.v,))[0]
    divisor = _divisor(reduction, num_items, label, ignore_index, lead.numel(), pair.v, size0,
                       pair.like.device)
    if pair.divides and divisor is not None and not isinstance(divisor, Tensor) and divisor > 0:
        return "sum", divisor, None  # a NaN or 0 divides in torch, as it always did
    return "sum", None, divisor


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor,
                    labels: Optional[Tensor] = None, beta: float = 0.5,
                    temperature: float = 1.0, reduction: str = "batchmean",
                    num_items_in_batch: Items = None, *,
                    teacher_temperature: Optional[float] = None, logit_scale: float = 1.0,
                    teacher_logit_scale: Optional[float] = None, softcap: Optional[float] = None,
                    teacher_softcap: Optional[float] = None, soft_weight: float = 1.0,
                    hard_weight: float = 0.0, ignore_index: int = -100, backend: str = "auto",
                    num_threads: int = 0, process_group: Optional[Any] = None,
                    vocab_start: Optional[int] = None,
                    vocab_size: Optional[int] = None) -> Tensor:
    """TRL's GKDTrainer.generalized_jsd_loss (its positional signature and
    results, but "none": module docstring): per row
    beta KL(q || M) + (1 - beta) KL(p || M), M = (1 - beta) p + beta q,
    p = softmax(student_logits / temperature), q the teacher's; beta 0 is
    KL(q || p), 1 is KL(p || q), both exactly.

    student_logits, teacher_logits: [..., V] float32, bfloat16 or float16
    (each its own; float64 computed in float32) on one device; labels:
    [...] integers, rows equal to ignore_index (TRL: -100) dropped.
    Returns float32 (TRL's is in the logits' dtype): 0-d, or [...] for
    "none". Beyond TRL's keywords: teacher_temperature, logit_scale,
    softcap and their teacher_* forms (None: the student's; softcap None
    or 0 is off), applied as in cross_entropy; soft_weight and hard_weight
    make each row's loss soft_weight * D + hard_weight * CE(student,
    labels) (Liger-Kernel's distillation mix; labels needed).

    Cost: a scalar loss whose student needs a gradient computes it in this
    call and holds it (student-sized) until the backward, which scales it
    by the upstream gradient (for a 16-bit student a second rounding,
    unless that is 1).

    process_group, vocab_start, vocab_size: a vocabulary split over ranks
    (module docstring).
    """
    return _distill(_pair(student_logits, teacher_logits, process_group, vocab_start,
                          vocab_size), labels, "jsd", beta, temperature,
                    reduction, num_items_in_batch, teacher_temperature, logit_scale,
                    teacher_logit_scale, softcap, teacher_softcap, soft_weight, hard_weight,
                    ignore_index, backend, num_threads)


def kl_div(student_logits: Tensor, teacher_logits: Tensor, labels: Optional[Tensor] = None, *,
           reverse: bool = False, temperature: float = 1.0, reduction: str = "batchmean",
           num_items_in_batch: Items = None, teacher_temperature: Optional[float] = None,
           logit_scale: float = 1.0, teacher_logit_scale: Optional[float] = None,
           softcap: Optional[float] = None, teacher_softcap: Optional[float] = None,
           soft_weight: float = 1.0, hard_weight: float = 0.0, ignore_index: int = -100,
           backend: str = "auto", num_threads: int = 0, process_group: Optional[Any] = None,
           vocab_start: Optional[int] = None, vocab_size: Optional[int] = None) -> Tensor:
    """KL(q || p) = sum_j q_j log(q_j / p_j) per row, q the teacher's softmax
    and p the student's: F.kl_div(log p, log q, log_target=True) summed
    over the classes (the forward KL of distillation, TRL's beta 0);
    reverse=True: KL(p || q) (TRL's beta 1). Arguments, reductions and
    results as generalized_jsd's."""
    return _distill(_pair(student_logits, teacher_logits, process_group, vocab_start, vocab_size),
                    labels, "reverse_kl" if reverse else "kl", 0.0, temperature, reduction,
                    num_items_in_batch, teacher_temperature, logit_scale, teacher_logit_scale,
                    softcap, teacher_softcap, soft_weight, hard_weight, ignore_index, backend,
                    num_threads)


def tvd(student_logits: Tensor, teacher_logits: Tensor, labels: Optional[Tensor] = None, *,
        temperature: float = 1.0, reduction: str = "batchmean", num_items_in_batch: Items = None,
        teacher_temperature: Optional[float] = None, logit_scale: float = 1.0,
        teacher_logit_scale: Optional[float] = None, softcap: Optional[float] = None,
        teacher_softcap: Optional[float] = None, soft_weight: float = 1.0,
        hard_weight: float = 0.0, ignore_index: int = -100, backend: str = "auto",
        num_threads: int = 0, process_group: Optional[Any] = None,
        vocab_start: Optional[int] = None, vocab_size: Optional[int] = None) -> Tensor:
    """Total variation distance 0.5 sum_j |p_j - q_j| per row; arguments,
    reductions and results as generalized_jsd's."""
    return _distill(_pair(student_logits, teacher_logits, process_group, vocab_start, vocab_size),
                    labels, "tvd", 0.0, temperature,
                    reduction, num_items_in_batch, teacher_temperature, logit_scale,
                    teacher_logit_scale, softcap, teacher_softcap, soft_weight, hard_weight,
                    ignore_index, backend, num_threads)
