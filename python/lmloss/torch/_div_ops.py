"""torch.library custom ops of the divergences (lmloss_divergence): a
student's and a teacher's logits [N, V] and optional labels [N]; only the
student gets a gradient, in its dtype. As the fused head's cross-entropy
does, a loss reduced to a scalar whose student needs a gradient computes
it in the forward at an upstream gradient of 1, and the backward scales it
by the upstream scalar (in place when eager), so a step reads the two
[N, V] inputs once; per-row losses, and a second backward through the
same graph, call lmloss_divergence_backward with dloss on the device. A
16-bit student's gradient on the fused path is rounded twice (by the C
call, then by the product) unless the upstream is 1, as the fused head's.

Options travel as two lists (_ops.ce_args says why): fopts [beta, the
student's logit_scale, softcap, temperature, the teacher's three,
soft_weight, hard_weight, num_items (0: none)]; iopts CE's layout with
the kind in dft's place [ignore_index, kind, backend, num_threads,
reduction], so _ops' readers of it serve both.
"""

from typing import Optional

from torch import Tensor

from .. import _lib
from .._divergence import div_options
from . import _bridge as B
from ._dispatch import Differentiable, call, custom_op
from ._ops import F32, REDUCTION_NAMES, _loss, _reduction_name, run_args

KIND_NAMES = tuple(_lib.DIV_KINDS)  # index = C code


def div_args(kind, beta, student, teacher, soft_weight, hard_weight, ignore_index, reduction,
             backend, num_threads, num_items=None):
    """The options as (fopts, iopts); student and teacher are (logit_scale,
    softcap, temperature) as _divergence.sides() returns them. kind and
    reduction are checked by the caller."""
    f = _lib.float_option

    def side(scale, softcap, temperature):
        return [f("logit_scale", scale), _lib.softcap_value(softcap),
                f("temperature", temperature)]

    return ([f("beta", beta)] + side(*student) + side(*teacher)
            + [f("soft_weight", soft_weight), f("hard_weight", hard_weight),
               0.0 if num_items is None else f("num_items", num_items)],
            [_lib.int64_option("ignore_index", ignore_index), KIND_NAMES.index(kind),
             int(backend), _lib.int_option("num_threads", num_threads),
             REDUCTION_NAMES.index(reduction)])


def _div_opt(fopts, iopts):
    return div_options(KIND_NAMES[iopts[1]], fopts[0], iopts[0], fopts[1:4], fopts[4:7],
                       fopts[7], fopts[8], _reduction_name(iopts), fopts[9] or None)


def _inputs(student, teacher, label, keep):
    return _lib.DivInputs(B.view(student, keep), B.view(teacher, keep), B.view(label, keep))


def _dstudent(student, want):
    """The student's gradient [N, V] in its dtype, or [0] when not wanted."""
    return student.new_empty(student.shape if want else (0,))


@custom_op("lmloss::divergence")
def divergence(student: Tensor, teacher: Tensor, label: Optional[Tensor], fopts: list[float],
               iopts: list[int], fused: bool) -> tuple[Tensor, Tensor]:
    """loss, and with `fused` (a scalar reduction only) dstudent at an
    upstream gradient of 1 ([0] otherwise)."""
    opt = _div_opt(fopts, iopts)
    n = student.shape[0]
    loss, dstudent = _loss(student, n, _reduction_name(iopts)), _dstudent(student, fused)
    keep = []
    with B.context(student, *run_args(iopts)) as ctx:
        out = _lib.DivOutputs(loss=B.view(loss.reshape(-1), keep))
        if fused:
            out.dstudent = B.view(dstudent, keep)
        ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(n), student.device)
        _lib.check(_lib.divergence(ctx, _inputs(student, teacher, label, keep), opt, out, addr,
                                   nbytes))
    return loss, dstudent


@divergence.register_fake
def _(student, teacher, label, fopts, iopts, fused):
    return _loss(student, student.shape[0], _reduction_name(iopts)), _dstudent(student, fused)


@custom_op("lmloss::divergence_backward")
def divergence_backward(dloss: Tensor, student: Tensor, teacher: Tensor, label: Optional[Tensor],
                        fopts: list[float], iopts: list[int]) -> Tensor:
    opt = _div_opt(fopts, iopts)
    dstudent = _dstudent(student, True)
    keep = []
    with B.context(student, *run_args(iopts)) as ctx:
        dl = B.view(dloss.reshape(-1).to(F32), keep)
        ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(student.shape[0]), student.device)
        _lib.check(_lib.divergence_backward(ctx, _inputs(student, teacher, label, keep), opt, dl,
                                            B.view(dstudent, keep), addr, nbytes))
    return dstudent


@divergence_backward.register_fake
def _(dloss, student, *rest):
    return _dstudent(student, True)


def _div_setup(ctx, inputs, output):
    ctx.fused, ctx.opts = inputs[5], inputs[3:5]
    if getattr(ctx, "eager", False):
        # The forward's gradient held as an alias, scaled in place by the
        # backward (a scaled copy would be a second [N, V]); no zeros
        # materialized for the unused gradient output either.
        ctx.save_for_backward(*inputs[:3])
        ctx.fwd_grad = output[1].detach()
        ctx.set_materialize_grads(False)
    else:  # a traced graph: functional
        ctx.save_for_backward(*inputs[:3], output[1])


def _div_backward(ctx, dloss, _ddstudent):
    if dloss is None or not ctx.needs_input_grad[0]:  # the loss unused, or a frozen student
        return (None,) * 6
    saved = ctx.saved_tensors
    if ctx.fused and getattr(ctx, "eager", False):
        ctx.fused = False  # used up: another backward through this graph recomputes
        dstudent, ctx.fwd_grad = B.scale_(ctx.fwd_grad, dloss, *run_args(ctx.opts[1])), None
    elif ctx.fused:
        dstudent = saved[3] * dloss
    else:
        dstudent = call(ctx, divergence_backward, dloss, *saved[:3], *ctx.opts)
    return (dstudent,) + (None,) * 5


divergence = Differentiable(divergence, _div_setup, _div_backward)
