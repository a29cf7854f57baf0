"""Divergences between a student's and a teacher's logits (lmloss_divergence)."""

import collections
from typing import Optional, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _lib
from ._ce import set_reduction, workspace
from ._tensor import Rows, optional_vector, out_vector, shape_error

DivergenceResult = collections.namedtuple("DivergenceResult",
                                          "loss dstudent divergence ce entropy")
DivergenceResult.__doc__ = """Returned by divergence(return_parts=True): loss as in the
plain form; dstudent (or None without grad=True); divergence D_i (float32
shaped like the rows, ignored rows 0), ce, the student's cross-entropy
against the labels (None without labels), and entropy, the student's
-sum_j p_j log p_j (float32, ignored rows 0)."""


def sides(logit_scale, softcap, temperature, teacher_logit_scale, teacher_softcap,
          teacher_temperature):
    """((scale, softcap, temperature) of the student, the same of the teacher):
    a teacher keyword of None takes the student's value."""
    student = (logit_scale, softcap, temperature)
    teacher = tuple(s if t is None else t for s, t in
                    zip(student, (teacher_logit_scale, teacher_softcap, teacher_temperature)))
    return student, teacher


def div_options(kind, beta, ignore_index, student, teacher, soft_weight, hard_weight,
                reduction, num_items):
    """lmloss_div_options; student and teacher are (scale, softcap, temperature)
    as sides() returns them."""
    if kind not in _lib.DIV_KINDS:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "kind must be one of %s, got %r"
                         % (", ".join(map(repr, _lib.DIV_KINDS)), kind))
    opt = _lib.div_options_default()
    set_reduction(opt, reduction, num_items)
    opt.kind = _lib.DIV_KINDS[kind]
    opt.beta = _lib.float_option("beta", beta)
    opt.student, opt.teacher = _lib.make_transform(*student), _lib.make_transform(*teacher)
    opt.soft_weight = _lib.float_option("soft_weight", soft_weight)
    opt.hard_weight = _lib.float_option("hard_weight", hard_weight)
    opt.ignore_index = _lib.int64_option("ignore_index", ignore_index)
    return opt


def div_outputs(n, reduction, return_parts, labels):
    """(loss array, lmloss_div_outputs over it, (divergence, ce, entropy)
    arrays) for n rows; the parts None unless return_parts (ce: with
    labels)."""
    loss, loss_t = out_vector(n if reduction == "none" else 1)
    outputs = _lib.DivOutputs(loss=loss_t)
    div = ce = ent = None
    if return_parts:
        div, outputs.divergence = out_vector(n)
        ent, outputs.entropy = out_vector(n)
        if labels is not None:
            ce, outputs.ce = out_vector(n)
    return loss, outputs, (div, ce, ent)


def divergence(student: ArrayLike, teacher: ArrayLike, *, kind: str = "kl", beta: float = 0.5,
               labels: Optional[ArrayLike] = None, ignore_index: int = -100,
               temperature: float = 1.0, teacher_temperature: Optional[float] = None,
               logit_scale: float = 1.0, teacher_logit_scale: Optional[float] = None,
               softcap: Optional[float] = None, teacher_softcap: Optional[float] = None,
               soft_weight: float = 1.0, hard_weight: float = 0.0, reduction: str = "mean",
               num_items: Optional[float] = None, grad: bool = False,
               return_parts: bool = False, backend: str = "auto", num_threads: int = 0
               ) -> Union[float, np.ndarray, Tuple[Union[float, np.ndarray], np.ndarray],
                          "DivergenceResult"]:
    """Divergence of a student's logits [..., V] from a teacher's (same shape).

    p = softmax(z_student), q = softmax(z_teacher), each z = transform(x)
    as in cross_entropy (logit_scale, softcap, temperature; a teacher_*
    keyword of None takes the student's value, teacher_softcap=0 is off).
    Per row, by kind:
        "kl"          sum_j q_j log(q_j / p_j)        (KL(q || p), TRL's beta 0)
        "reverse_kl"  sum_j p_j log(p_j / q_j)        (TRL's beta 1)
        "jsd"         beta KL(q || M) + (1 - beta) KL(p || M),
                      M = (1 - beta) p + beta q       (TRL's generalized JSD)
        "tvd"         0.5 sum_j |p_j - q_j|
        loss = soft_weight * D + hard_weight * ce     (ce: the student's
                                                       cross-entropy at labels)
    beta in [0, 1] (read by "jsd" only). labels: optional int [...]; rows
    equal to ignore_index are skipped (loss 0, gradient row 0); needed
    when hard_weight > 0. Identical rows give exactly 0.
    reduction: "none" -> float32 [...]; "sum" -> float; "mean" -> sum over
    the rows not ignored (TRL's "batchmean" with labels), 0 when there are
    none; num_items (> 0) -> sum / num_items with "sum" or "mean".

    grad=True returns (loss, dstudent), the gradient of the returned loss
    (for "none", of its sum) w.r.t. the student's logits in the same pass:
    float32 for fp32/fp64 logits, else the student's dtype. The teacher is
    not differentiated. return_parts=True returns DivergenceResult.

    Dtypes (each side its own): fp32; fp64 (computed in fp32); bf16
    (ml_dtypes.bfloat16, or uint16 bit patterns); fp16. backend: "auto",
    "cpu" or "ref"; num_threads: 0 = OpenMP's default. Raises lmloss.Error.
    """
    opt = div_options(kind, beta, ignore_index,
                      *sides(logit_scale, softcap, temperature, teacher_logit_scale,
                             teacher_softcap, teacher_temperature),
                      soft_weight, hard_weight, reduction, num_items)
    ctx = _lib.make_context(backend, num_threads)
    s, t = Rows(student, "student"), Rows(teacher, "teacher")
    if t.lead + (t.v,) != s.lead + (s.v,):
        raise shape_error("teacher has shape %s, student %s" % (t.lead + (t.v,), s.lead + (s.v,)))
    keep = []
    inputs = _lib.DivInputs(s.t, t.t,
                            optional_vector(labels, s.n, s.lead, "labels", "index", keep))

    loss, outputs, (div, ce, ent) = div_outputs(s.n, reduction, return_parts, labels)
    dstudent = None
    if grad:
        dstudent, outputs.dstudent = s.empty(s.out_dtype())

    ws, addr, nbytes = workspace(s.n)
    _lib.check(_lib.divergence(ctx, inputs, opt, outputs, addr, nbytes))

    loss = loss.reshape(s.lead) if reduction == "none" else float(loss[0])
    if dstudent is not None:
        dstudent = dstudent.reshape(s.lead + (s.v,))
    if return_parts:
        return DivergenceResult(loss, dstudent, div.reshape(s.lead),
                                None if ce is None else ce.reshape(s.lead), ent.reshape(s.lead))
    return (loss, dstudent) if grad else loss
