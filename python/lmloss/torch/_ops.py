"""torch.library custom ops over materialized logits [N, V] (2-D; the public
functions in lmloss.torch flatten [..., V] and check the keywords). The
names the public functions call are Differentiable (_dispatch.py): the
custom op under torch.compile, its body and formula eagerly.

Each op has a fake (meta) impl written from symbolic shapes only, so
torch.compile traces it without graph breaks and a new batch size does not
recompile, and an autograd formula whose backward is another op calling the
C backward (lmloss_cross_entropy_backward with dloss read on the device,
lmloss_log_probs_backward, lmloss_softmax_backward). Outputs: per-row
results float32; softmax outputs and every dlogits keep the logits' dtype.
Absent outputs (extras not requested) are empty [0] tensors.

A cross-entropy reduced to a scalar may form its gradient in the forward
(iopts[GRAD], the caller's choice): lmloss_cross_entropy with dlogits at an
upstream 1, one pass over the logits instead of two, then the backward
scales it by the upstream (in place when eager, lmloss_scale: on the
stream, nothing when it is 1), as _linear_ops does for the fused head.
GRAD_OVER_LOGITS writes it over the logits themselves (eager only).

Autocast: no autocast rule is registered, so under torch.autocast these
ops take the logits in the dtype they arrive in (no fp32 upcast copy); the
kernels accumulate in fp32 and return float32 losses.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import _lib
from .._ce import ce_options
from . import _bridge as B
from ._dispatch import Differentiable, call, custom_op

EXTRA_LSE, EXTRA_ENTROPY, EXTRA_ARGMAX = 1, 2, 4
F32 = torch.float32
# Where a CE call forms the logits' gradient (iopts[GRAD]): in the backward
# op, in its forward into a new buffer, or in its forward over the logits.
GRAD, GRAD_IN_BACKWARD, GRAD_IN_FORWARD, GRAD_OVER_LOGITS = 6, 0, 1, 2


def _extras(like, n, extras):
    """lse, entropy, argmax outputs: [n] when requested in `extras`, else [0]."""
    return tuple(like.new_empty((n,) if extras & flag else (0,), dtype=dt)
                 for flag, dt in ((EXTRA_LSE, F32), (EXTRA_ENTROPY, F32),
                                  (EXTRA_ARGMAX, torch.int64)))


def _loss(like, n, reduction):
    return like.new_empty((n,) if reduction == "none" else (), dtype=F32)


REDUCTION_NAMES = tuple(_lib.REDUCTIONS)  # "none", "sum", "mean": index = C code


def ce_args(ignore_index, label_smoothing, z_loss, logit_scale, softcap, temperature,
            reduction, num_items, dft, backend, num_threads, grad=GRAD_IN_BACKWARD):
    """The CE keywords as the ops' two option lists, (fopts, iopts). The ops
    take their scalar options as lists so that their schemas stay short:
    torch.library's autograd wrapper walks an op's schema once per argument
    on every call (fill_defaults; measured on the CPU machine: 38 us a call
    at 16 arguments, 14 at 9, 3.4 at 4). reduction is checked by the caller;
    grad (GRAD_*) is read by the CE op alone."""
    f = _lib.float_option
    items = 0.0 if num_items is None else f("num_items", num_items)
    return ([f("label_smoothing", label_smoothing), f("z_loss", z_loss),
             f("logit_scale", logit_scale), _lib.softcap_value(softcap),
             f("temperature", temperature), items],
            [_lib.int64_option("ignore_index", ignore_index), int(bool(dft)), int(backend),
             _lib.int_option("num_threads", num_threads), REDUCTION_NAMES.index(reduction),
             int(num_items is not None), int(grad)])


def _ce_opt(fopts, iopts):
    label_smoothing, z_loss, logit_scale, softcap, temperature, num_items = fopts
    return ce_options(iopts[0], label_smoothing, z_loss, logit_scale, softcap, temperature,
                      _reduction_name(iopts), num_items if iopts[5] else None, iopts[1])


def _reduction_name(iopts):
    return REDUCTION_NAMES[iopts[4]]


def run_args(iopts):
    """(backend, num_threads) of an iopts list."""
    return iopts[2], iopts[3]


# ---------------------------------------------------------------- cross-entropy

def ce_inputs(logits, target, token_weight, class_weight, keep):
    """lmloss_ce_inputs over the tensors (their views appended to keep)."""
    return _lib.CEInputs(B.view(logits, keep), B.view(target, keep), B.view(token_weight, keep),
                         B.view(class_weight, keep))


def ce_outputs(loss, lse, ent, amax, extras, keep):
    """lmloss_ce_outputs: the loss and the extras that `extras` requests."""
    out = _lib.CEOutputs(loss=B.view(loss.reshape(-1), keep))
    for name, t, flag in (("lse", lse, EXTRA_LSE), ("entropy", ent, EXTRA_ENTROPY),
                          ("argmax", amax, EXTRA_ARGMAX)):
        if extras & flag:
            setattr(out, name, B.view(t, keep))
    return out


@custom_op("lmloss::cross_entropy")
def cross_entropy(logits: Tensor, target: Tensor, token_weight: Optional[Tensor],
                  class_weight: Optional[Tensor], fopts: list[float], iopts: list[int],
                  extras: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """loss, lse, entropy, argmax, then dlogits at an upstream 1 where
    iopts[GRAD] forms them in the forward ([0] otherwise): a new tensor, or
    over the logits the C call read (those given, or their contiguous copy)."""
    opt = _ce_opt(fopts, iopts)
    n = logits.shape[0]
    loss = _loss(logits, n, _reduction_name(iopts))
    lse, ent, amax = _extras(logits, n, extras)
    grad = iopts[GRAD]
    dlogits = _dlogits(logits, grad == GRAD_IN_FORWARD)
    keep = []
    with B.context(logits, *run_args(iopts)) as ctx:
        inputs = ce_inputs(logits, target, token_weight, class_weight, keep)
        out = ce_outputs(loss, lse, ent, amax, extras, keep)
        if grad:
            dlogits = keep[0] if grad == GRAD_OVER_LOGITS else dlogits  # an exact alias
            out.dlogits = B.view(dlogits, keep)
        ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(n), logits.device)
        _lib.check(_lib.cross_entropy(ctx, inputs, opt, out, addr, nbytes))
    if grad == GRAD_OVER_LOGITS:  # autograd's nodes that saved them must raise
        torch.autograd.graph.increment_version(logits)
    return loss, lse, ent, amax, dlogits


def _dlogits(logits, formed):
    """A new dlogits output: [N, V] when formed, else [0]."""
    return torch.empty(logits.shape if formed else (0,), dtype=logits.dtype,
                       device=logits.device)


@cross_entropy.register_fake
def _(logits, target, token_weight, class_weight, fopts, iopts, extras):
    n = logits.shape[0]
    return ((_loss(logits, n, _reduction_name(iopts)),) + _extras(logits, n, extras)
            + (_dlogits(logits, iopts[GRAD] != GRAD_IN_BACKWARD),))


@custom_op("lmloss::cross_entropy_backward")
def cross_entropy_backward(dloss: Tensor, logits: Tensor, target: Tensor,
                           token_weight: Optional[Tensor], class_weight: Optional[Tensor],
                           fopts: list[float], iopts: list[int]) -> Tensor:
    opt = _ce_opt(fopts, iopts)
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    keep = []
    with B.context(logits, *run_args(iopts)) as ctx:
        inputs = ce_inputs(logits, target, token_weight, class_weight, keep)
        dl = B.view(dloss.reshape(-1).to(F32), keep)
        ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(logits.shape[0]), logits.device)
        _lib.check(B.ce_backward(ctx, inputs, opt, dl, B.view(dlogits, keep), addr, nbytes))
    return dlogits


@cross_entropy_backward.register_fake
def _(dloss, logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _ce_setup(ctx, inputs, output):
    logits, target, tw, cw, fopts, iopts = inputs[:6]
    ctx.opts = inputs[4:-1]  # every option but `extras`
    ctx.grad = iopts[GRAD]
    if ctx.grad == GRAD_IN_BACKWARD:
        ctx.save_for_backward(logits, target, tw, cw)
    elif getattr(ctx, "eager", False):
        # The gradient held as an alias beside save_for_backward, for the
        # backward to scale in place (a scaled copy would be a second N x V
        # buffer), and no zeros materialized for the unused outputs. Logits
        # it overwrote are not saved: their version moved on.
        over = ctx.grad == GRAD_OVER_LOGITS
        ctx.save_for_backward(None if over else logits, target, tw, cw)
        ctx.dlogits = output[4].detach()
        ctx.set_materialize_grads(False)
    else:  # a traced graph: functional
        ctx.save_for_backward(logits, target, tw, cw, output[4])


def _ce_backward(ctx, dloss, *_):
    if dloss is None:  # eager, no materialized zeros: the loss itself was not used
        return (None,) * 7
    logits, target, tw, cw, *formed = ctx.saved_tensors
    if formed:
        dlogits = formed[0] * dloss
    elif ctx.grad != GRAD_IN_BACKWARD and ctx.dlogits is not None:
        dlogits, ctx.dlogits = ctx.dlogits, None  # used up, and unshared: autograd keeps it
        B.scale_(dlogits, dloss, *run_args(ctx.opts[1]))
    elif ctx.grad == GRAD_OVER_LOGITS:
        raise RuntimeError("lmloss.torch.cross_entropy(inplace_backward=True) wrote the "
                           "gradient over the logits, which its first backward handed on: a "
                           "second backward through the graph (retain_graph=True) has no "
                           "logits to recompute it from; call it with inplace_backward=False")
    else:  # formed at backward time, or used up by a first backward (retain_graph=True)
        dlogits = call(ctx, cross_entropy_backward, dloss, logits, target, tw, cw, *ctx.opts)
    return (dlogits,) + (None,) * 6


cross_entropy = Differentiable(cross_entropy, _ce_setup, _ce_backward)


# ---------------------------------------------------------------- log-probs, entropy

def _stats_shape(n, want_stats):
    """The rows' saved statistics (lmloss_log_probs' stats): [n, 4] or [0]."""
    return (n, _lib.ROW_STATS) if want_stats else (0,)


@custom_op("lmloss::log_probs")
def log_probs(logits: Tensor, index: Tensor, mask: Optional[Tensor], logit_scale: float,
              softcap: float, temperature: float, want_entropy: bool, want_stats: bool,
              backend: int, num_threads: int) -> tuple[Tensor, Tensor, Tensor]:
    n, k = index.shape
    logp = logits.new_empty((n, k), dtype=F32)
    ent = logits.new_empty((n,) if want_entropy else (0,), dtype=F32)
    stats = logits.new_empty(_stats_shape(n, want_stats), dtype=F32)
    keep = []
    with B.context(logits, backend, num_threads) as ctx:
        ent_t = B.view(ent, keep) if want_entropy else None
        stats_t = B.view(stats, keep) if want_stats else None
        _lib.check(_lib.log_probs(ctx, B.view(logits, keep), B.view(index, keep),
                                  B.ptr(B.view(mask, keep) if mask is not None else None),
                                  B.transform(logit_scale, softcap, temperature),
                                  B.view(logp, keep), B.ptr(ent_t), B.ptr(stats_t)))
    return logp, ent, stats


@log_probs.register_fake
def _(logits, index, mask, logit_scale, softcap, temperature, want_entropy, want_stats, backend,
      num_threads):
    n, k = index.shape
    return (logits.new_empty((n, k), dtype=F32),
            logits.new_empty((n,) if want_entropy else (0,), dtype=F32),
            logits.new_empty(_stats_shape(n, want_stats), dtype=F32))


@custom_op("lmloss::entropy")
def entropy(logits: Tensor, logit_scale: float, softcap: float, temperature: float,
            backend: int, num_threads: int) -> Tensor:
    ent = logits.new_empty((logits.shape[0],), dtype=F32)
    keep = []
    with B.context(logits, backend, num_threads) as ctx:
        _lib.check(_lib.entropy(ctx, B.view(logits, keep),
                                B.transform(logit_scale, softcap, temperature),
                                B.view(ent, keep)))
    return ent


@entropy.register_fake
def _(logits, logit_scale, softcap, temperature, backend, num_threads):
    return logits.new_empty((logits.shape[0],), dtype=F32)


@custom_op("lmloss::log_probs_backward")
def log_probs_backward(logits: Tensor, index: Optional[Tensor], mask: Optional[Tensor],
                       logit_scale: float, softcap: float, temperature: float,
                       dlogp: Optional[Tensor], dentropy: Optional[Tensor],
                       stats: Optional[Tensor], backend: int, num_threads: int) -> Tensor:
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    keep = []

    def opt(t, f32=False):
        if t is None:
            return None
        return B.ptr(B.view(t.to(F32) if f32 else t, keep))

    with B.context(logits, backend, num_threads) as ctx:
        _lib.check(_lib.log_probs_backward(
            ctx, B.view(logits, keep), opt(index), opt(mask),
            B.transform(logit_scale, softcap, temperature), opt(dlogp, True),
            opt(dentropy, True), B.view(dlogits, keep), opt(stats)))
    return dlogits


@log_probs_backward.register_fake
def _(logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _lp_setup(ctx, inputs, output):
    logits, index, mask = inputs[:3]
    ctx.save_for_backward(logits, index, mask, output[2])
    ctx.transform = inputs[3:6]
    ctx.want_entropy, ctx.want_stats = inputs[6:8]
    ctx.run = inputs[8:]


def _lp_backward(ctx, dlogp, dent, _dstats):
    logits, index, mask, stats = ctx.saved_tensors
    dent = dent if ctx.want_entropy else None
    dlogits = call(ctx, log_probs_backward, logits, index, mask, *ctx.transform, dlogp, dent,
                   stats if ctx.want_stats else None, *ctx.run)
    return (dlogits,) + (None,) * 9


log_probs = Differentiable(log_probs, _lp_setup, _lp_backward)


def _ent_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.transform, ctx.run = inputs[1:4], inputs[4:]


def _ent_backward(ctx, dent):
    (logits,) = ctx.saved_tensors
    dlogits = call(ctx, log_probs_backward, logits, None, None, *ctx.transform, None, dent,
                   None, *ctx.run)
    return (dlogits,) + (None,) * 5


entropy = Differentiable(entropy, _ent_setup, _ent_backward)


# ---------------------------------------------------------------- softmax, log-softmax

@custom_op("lmloss::softmax")
def softmax(x: Tensor, log: bool, backend: int, num_threads: int) -> Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    keep = []
    with B.context(x, backend, num_threads) as ctx:
        _lib.check(_lib.softmax(ctx, B.view(x, keep), int(log), B.view(y, keep)))
    return y


@softmax.register_fake
def _(x, log, backend, num_threads):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op("lmloss::softmax_backward")
def softmax_backward(y: Tensor, dy: Tensor, log: bool, backend: int,
                     num_threads: int) -> Tensor:
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)
    keep = []
    with B.context(y, backend, num_threads) as ctx:
        _lib.check(_lib.softmax_backward(ctx, B.view(y, keep), B.view(dy, keep), int(log),
                                         B.view(dx, keep)))
    return dx


@softmax_backward.register_fake
def _(y, dy, log, backend, num_threads):
    return torch.empty_like(dy, memory_format=torch.contiguous_format)


def _sm_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.args = inputs[1:]


def _sm_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return (call(ctx, softmax_backward, y, dy.to(y.dtype), *ctx.args),) + (None,) * 3


softmax = Differentiable(softmax, _sm_setup, _sm_backward)
