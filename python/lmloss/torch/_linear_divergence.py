"""The divergences of _divergence.py through two fused heads
(lmloss_linear_divergence): the student's logits student_hidden [..., Hs]
x student_weight[V, Hs]^T (+ student_bias) and the teacher's from its own
[..., Ht] and [V, Ht], neither [N, V] held whole. The arguments,
reductions and results are those of generalized_jsd, kl_div and tvd on
those logits (one body, _divergence._distill), plus the heads' biases and
memory_budget (as linear_cross_entropy's). Differentiable w.r.t. the
student's hidden, weight and bias; the teacher is detached. On the CPU
both heads run in float32 (16-bit inputs upcast, their gradients cast
back by autograd); on CUDA in the heads' dtype (or autocast's), the
logits in float32, a 16-bit weight's gradient rounded once per chunk of
rows.

process_group (torch.distributed), vocab_start, vocab_size: both heads'
weights (and biases) are this rank's rows of the vocabulary, hidden
replicated (Megatron's layout; uneven shards name their first row and the
vocabulary's width); the loss is the whole rows' on every rank, dhidden is
summed over the ranks, dweight and dbias are the rank's rows
(_vocab_parallel.LinearDivergence: two exchanges of row states and sums).
"""

from typing import Any, Optional, Tuple, Union

from torch import Tensor

from .. import _lib
from . import _linear_ops as L
from . import _vocab_parallel as VP
from ._divergence import Items, _distill
from ._functional import _budget, _empty_logits, _grads_in_forward, _head, _same_device

Loss = Union[Tensor, Tuple[Tensor, Tensor]]


class _Heads:
    """What _distill differentiates: the student's head and the teacher's."""

    name = "student_hidden"
    divides = True  # the C call divides the sum (_divergence._division)

    def __init__(self, student_hidden, student_weight, student_bias, teacher_hidden,
                 teacher_weight, teacher_bias, labels, memory_budget):
        self.student = _head(student_hidden, student_weight, student_bias, labels)
        teacher = _head(teacher_hidden, teacher_weight, teacher_bias, labels)
        if (teacher_hidden.shape[:-1] != student_hidden.shape[:-1]
                or teacher_weight.shape[0] != student_weight.shape[0]):
            raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "the teacher's hidden %s and weight %s "
                             "must have the student's rows and V: hidden %s, weight %s"
                             % (tuple(teacher_hidden.shape), tuple(teacher_weight.shape),
                                tuple(student_hidden.shape), tuple(student_weight.shape)))
        _same_device(teacher_hidden, student_hidden, "teacher_hidden", "student_hidden")
        self.teacher = tuple(None if t is None else t.detach() for t in teacher)
        self.like, self.lead = student_hidden, student_hidden.shape[:-1]
        self.v, self.budget = student_weight.shape[0], _budget(memory_budget)

    def loss(self, label, fopts, iopts, per_row):
        """The C call's per-row values or sum, in the graph of the student's
        head; the student's entropy per row into self.entropy."""
        h, w, b = self.student
        if h.shape[0] == 0:  # no rows: an empty or zero sum, in the graph
            loss = _empty_logits(h, w, b).sum(-1)
            self.entropy = loss.detach()
            return loss if per_row else loss.sum()
        need = _grads_in_forward("none" if per_row else "sum", h, w, b)
        out = L.linear_divergence(h, w, b, *self.teacher, label, fopts, iopts, self.budget, need)
        self.entropy = out[1].detach()
        return out[0]

    def result(self, loss, return_entropy):
        """loss, or (loss, the student's entropy [...]) with return_entropy."""
        return (loss, self.entropy.reshape(self.lead)) if return_entropy else loss


class _ShardHeads(_Heads):
    """_Heads whose weights (and biases) are this rank's rows of the
    vocabulary (Megatron's layout), hidden replicated: the loss through the
    vocab-parallel op, v the whole vocabulary's width."""

    divides = False  # its chunks finish apart: "mean" would count a chunk's rows

    def __init__(self, *args, process_group, vocab_start, vocab_size, entropy):
        super().__init__(*args)
        self.shard = VP.Shard(process_group, self.v, vocab_start, vocab_size)
        self.v, self.want_entropy = self.shard.vocab, entropy

    def loss(self, label, fopts, iopts, per_row):
        h, w, b = self.student
        if h.shape[0] == 0:  # no rows: no exchange either, as on every rank
            return super().loss(label, fopts, iopts, per_row)
        loss, self.entropy = VP.LinearDivergence.apply(h, w, b, *self.teacher, label, fopts,
                                                       iopts, self.shard, self.budget, per_row,
                                                       self.want_entropy)
        return loss


def _heads(args, process_group, vocab_start, vocab_size, entropy):
    """_Heads of the functions' head arguments, or _ShardHeads with a
    process group (entropy: whose exchange then carries the entropy)."""
    if process_group is None:
        return _Heads(*args)
    return _ShardHeads(*args, process_group=process_group, vocab_start=vocab_start,
                       vocab_size=vocab_size, entropy=entropy)


def linear_generalized_jsd(student_hidden: Tensor, student_weight: Tensor,
                           teacher_hidden: Tensor, teacher_weight: Tensor,
                           labels: Optional[Tensor] = None, beta: float = 0.5,
                           temperature: float = 1.0, reduction: str = "batchmean",
                           num_items_in_batch: Items = None, *,
                           student_bias: Optional[Tensor] = None,
                           teacher_bias: Optional[Tensor] = None,
                           teacher_temperature: Optional[float] = None, logit_scale: float = 1.0,
                           teacher_logit_scale: Optional[float] = None,
                           softcap: Optional[float] = None,
                           teacher_softcap: Optional[float] = None, soft_weight: float = 1.0,
                           hard_weight: float = 0.0, ignore_index: int = -100,
                           memory_budget: Optional[int] = None, backend: str = "auto",
                           num_threads: int = 0, return_entropy: bool = False,
                           process_group: Optional[Any] = None,
                           vocab_start: Optional[int] = None,
                           vocab_size: Optional[int] = None) -> Loss:
    """generalized_jsd (TRL's generalized_jsd_loss, every keyword) of the
    logits student_hidden [..., Hs] student_weight[V, Hs]^T (+ student_bias
    [V]) and teacher_hidden [..., Ht] teacher_weight[V, Ht]^T (+
    teacher_bias [V]); labels [...]. "batchmean" without labels divides by
    student_hidden.size(0), the logits' size(0). memory_budget: bytes for
    the per-chunk buffers of both heads (None = 400 MiB).

    return_entropy=True returns (loss, entropy): the student's entropy
    -sum_j p_j log p_j per row (float32 [...], ignored rows 0, no
    gradient), from the same pass (TRL's DistillationTrainer logs it).

    Cost: a scalar loss whose student needs a gradient computes it in this
    call (the backward scales it by the upstream gradient), so evaluate
    under torch.no_grad().
    """
    heads = _heads((student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                    teacher_bias, labels, memory_budget), process_group, vocab_start, vocab_size,
                   return_entropy)
    loss = _distill(heads, labels, "jsd", beta, temperature, reduction, num_items_in_batch,
                    teacher_temperature, logit_scale, teacher_logit_scale, softcap,
                    teacher_softcap, soft_weight, hard_weight, ignore_index, backend, num_threads)
    return heads.result(loss, return_entropy)


def linear_kl_div(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                  teacher_weight: Tensor, labels: Optional[Tensor] = None, *,
                  reverse: bool = False, temperature: float = 1.0, reduction: str = "batchmean",
                  num_items_in_batch: Items = None, student_bias: Optional[Tensor] = None,
                  teacher_bias: Optional[Tensor] = None,
                  teacher_temperature: Optional[float] = None, logit_scale: float = 1.0,
                  teacher_logit_scale: Optional[float] = None, softcap: Optional[float] = None,
                  teacher_softcap: Optional[float] = None, soft_weight: float = 1.0,
                  hard_weight: float = 0.0, ignore_index: int = -100,
                  memory_budget: Optional[int] = None, backend: str = "auto",
                  num_threads: int = 0, return_entropy: bool = False,
                  process_group: Optional[Any] = None, vocab_start: Optional[int] = None,
                  vocab_size: Optional[int] = None) -> Loss:
    """kl_div (KL(q || p), reverse=True: KL(p || q)) through the two heads;
    arguments and results as linear_generalized_jsd's."""
    heads = _heads((student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                    teacher_bias, labels, memory_budget), process_group, vocab_start, vocab_size,
                   return_entropy)
    loss = _distill(heads, labels, "reverse_kl" if reverse else "kl", 0.0, temperature, reduction,
                    num_items_in_batch, teacher_temperature, logit_scale, teacher_logit_scale,
                    softcap, teacher_softcap, soft_weight, hard_weight, ignore_index, backend,
                    num_threads)
    return heads.result(loss, return_entropy)


def linear_tvd(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
               teacher_weight: Tensor, labels: Optional[Tensor] = None, *,
               temperature: float = 1.0, reduction: str = "batchmean",
               num_items_in_batch: Items = None, student_bias: Optional[Tensor] = None,
               teacher_bias: Optional[Tensor] = None,
               teacher_temperature: Optional[float] = None, logit_scale: float = 1.0,
               teacher_logit_scale: Optional[float] = None, softcap: Optional[float] = None,
               teacher_softcap: Optional[float] = None, soft_weight: float = 1.0,
               hard_weight: float = 0.0, ignore_index: int = -100,
               memory_budget: Optional[int] = None, backend: str = "auto",
               num_threads: int = 0, return_entropy: bool = False,
               process_group: Optional[Any] = None, vocab_start: Optional[int] = None,
               vocab_size: Optional[int] = None) -> Loss:
    """tvd (0.5 sum_j |p_j - q_j| per row) through the two heads; arguments
    and results as linear_generalized_jsd's."""
    heads = _heads((student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                    teacher_bias, labels, memory_budget), process_group, vocab_start, vocab_size,
                   return_entropy)
    loss = _distill(heads, labels, "tvd", 0.0, temperature, reduction, num_items_in_batch,
                    teacher_temperature, logit_scale, teacher_logit_scale, softcap,
                    teacher_softcap, soft_weight, hard_weight, ignore_index, backend, num_threads)
    return heads.result(loss, return_entropy)
