"""torch.library custom ops of the fused linear head (lmloss_linear_*):
hidden [N, H] x weight [V, H]^T (+ bias [V]), never holding the [N, V]
logits. hidden, weight and bias share one dtype (the public functions in
lmloss.torch cast them). The backward ops recompute the logits chunk by
chunk (lmloss_linear_cross_entropy_backward with dloss on the device,
lmloss_linear_log_probs_backward, given the forward's row statistics
where the logits need a gradient) and return only the gradients autograd
asks for (an empty [0] tensor for the others): dhidden in hidden's dtype,
dweight and dbias in the weight's dtype (summed in fp32, rounded once).
A cross-entropy reduced to a scalar is the exception: its forward computes
the gradients too (lmloss_linear_cross_entropy with grads, at an upstream
gradient of 1), and the backward scales them (in place when eager: no
second copy of dW) by the upstream scalar (lmloss_linear_scale_grads: on
the stream, no host synchronization), so the logits GEMMs and row passes
run once per step, not twice; a second backward through the same graph
(retain_graph=True) recomputes. The divergences through two fused heads
(lmloss_linear_divergence: a student's head and a teacher's) do the same
for the student's gradients; the teacher is never differentiated.
On CUDA each call reads the supervised-row count to the host once (the
C library's one synchronization of the fused head).

MainGrad is linear_cross_entropy's eager path that adds the weight's
gradient to a caller's float32 main_grad (lmloss_head_grads.accumulate,
Megatron's fused weight-gradient accumulation); docs/design.md section 7
says how it treats the upstream gradient.
"""

import ctypes
from typing import Optional

import torch
from torch import Tensor

from .. import _lib
from . import _bridge as B
from ._dispatch import _BODIES, Differentiable, _Eager, _needs_graph, call, custom_op
from ._div_ops import _div_opt
from ._ops import F32, _ce_opt, _extras, _loss, _reduction_name, _stats_shape, run_args

NEED_DH, NEED_DW, NEED_DB = 1, 2, 4


def _head(hidden, weight, bias, keep):
    return _lib.Head(B.view(hidden, keep), B.view(weight, keep), B.view(bias, keep))


def _hopt(memory_budget):
    hopt = _lib.head_options_default()
    if memory_budget > 0:
        hopt.memory_budget = int(memory_budget)
    return hopt


def _grads(hidden, weight, bias, need, main_grad=None):
    """New gradient tensors ([0] when not needed) as (tensors, shapes only).
    With main_grad, dweight goes into it ([0] here) and dbias is a zeroed
    float32 sum (accumulate adds to both, and takes them F32 only)."""
    def new(t, flag, like):
        ok = t is not None and need & flag
        return like.new_empty(t.shape if ok else (0,), dtype=like.dtype)
    dh = new(hidden, NEED_DH, hidden)
    if main_grad is None:
        return dh, new(weight, NEED_DW, weight), new(bias, NEED_DB, weight)
    db_shape = bias.shape if bias is not None and need & NEED_DB else (0,)
    return dh, weight.new_empty(0), weight.new_zeros(db_shape, dtype=F32)


def _grads_struct(grads, keep, main_grad=None):
    """lmloss_head_grads of grads ([0] = absent); with main_grad, dweight
    is main_grad, added to (accumulate: MainGrad's calls, which all want
    the weight's gradient)."""
    def v(t):
        return B.view(t, keep) if t.numel() else _lib.Tensor()
    gs = _lib.HeadGrads(*(v(t) for t in grads))
    if main_grad is not None:
        gs.dweight, gs.accumulate = B.view(main_grad, keep), 1
    return gs


def _workspace(device, size_fn, *args):
    """B.workspace of the size size_fn(*args, &bytes) gives (an lmloss_linear_*workspace_size)."""
    size = ctypes.c_size_t(0)
    _lib.check(size_fn(*args, ctypes.byref(size)))
    return B.workspace(size.value, device)


def _need(ctx, bias):
    n = ctx.needs_input_grad
    return (NEED_DH if n[0] else 0) | (NEED_DW if n[1] else 0) | \
        (NEED_DB if bias is not None and n[2] else 0)


def _back(grads, need, n_opts):
    dh, dw, db = grads
    return (dh if need & NEED_DH else None, dw if need & NEED_DW else None,
            db if need & NEED_DB else None) + (None,) * n_opts


# ---------------------------------------------------------------- cross-entropy

def _ce_forward(hidden, weight, bias, target, token_weight, class_weight, fopts, iopts,
                memory_budget, extras, need, main_grad=None):
    """The body of the linear_cross_entropy op; with main_grad (MainGrad),
    dweight is added to it."""
    opt = _ce_opt(fopts, iopts)
    n = hidden.shape[0]
    loss = _loss(hidden, n, _reduction_name(iopts))
    lse, ent, amax = _extras(hidden, n, extras)
    grads = _grads(hidden, weight, bias, need, main_grad)
    keep, hopt = [], _hopt(memory_budget)
    with B.context(hidden, *run_args(iopts)) as ctx:
        head = _head(hidden, weight, bias, keep)
        out = _lib.CEOutputs(loss=B.view(loss.reshape(-1), keep))
        for name, t in (("lse", lse), ("entropy", ent), ("argmax", amax)):
            if t.numel():
                setattr(out, name, B.view(t, keep))
        gs = _grads_struct(grads, keep, main_grad) if need else None
        ws, addr, nbytes = _workspace(hidden.device, _lib.linear_workspace_size, head, hopt,
                                      B.ptr(gs), 1)
        _lib.check(_lib.linear_cross_entropy(ctx, head, B.view(target, keep),
                                             B.ptr(B.view(token_weight, keep)),
                                             B.ptr(B.view(class_weight, keep)), opt, hopt, out,
                                             B.ptr(gs), addr, nbytes))
    return (loss, lse, ent, amax) + grads


@custom_op("lmloss::linear_cross_entropy")
def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                         token_weight: Optional[Tensor], class_weight: Optional[Tensor],
                         fopts: list[float], iopts: list[int], memory_budget: int, extras: int,
                         need: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                             Tensor]:
    """loss, lse, entropy, argmax, then the gradients in `need` (NEED_*
    flags; a scalar reduction only) at an upstream gradient of 1."""
    return _ce_forward(hidden, weight, bias, target, token_weight, class_weight, fopts, iopts,
                       memory_budget, extras, need)


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, target, token_weight, class_weight, fopts, iopts, memory_budget,
      extras, need):
    n = hidden.shape[0]
    return ((_loss(hidden, n, _reduction_name(iopts)),) + _extras(hidden, n, extras)
            + _grads(hidden, weight, bias, need))


def _ce_backward(dloss, hidden, weight, bias, target, token_weight, class_weight, fopts, iopts,
                 memory_budget, need, main_grad=None):
    """The body of the linear_cross_entropy_backward op; with main_grad
    (MainGrad), dweight is added to it."""
    opt = _ce_opt(fopts, iopts)
    grads = _grads(hidden, weight, bias, need, main_grad)
    keep, hopt = [], _hopt(memory_budget)
    with B.context(hidden, *run_args(iopts)) as ctx:
        head = _head(hidden, weight, bias, keep)
        gs = _grads_struct(grads, keep, main_grad)
        ws, addr, nbytes = _workspace(hidden.device, _lib.linear_workspace_size, head, hopt, gs, 1)
        _lib.check(_lib.linear_cross_entropy_backward(
            ctx, head, B.view(target, keep), B.ptr(B.view(token_weight, keep)),
            B.ptr(B.view(class_weight, keep)), opt, hopt,
            B.view(dloss.reshape(-1).to(F32), keep), gs, addr, nbytes))
    return grads


@custom_op("lmloss::linear_cross_entropy_backward")
def linear_cross_entropy_backward(
        dloss: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
        token_weight: Optional[Tensor], class_weight: Optional[Tensor], fopts: list[float],
        iopts: list[int], memory_budget: int, need: int) -> tuple[Tensor, Tensor, Tensor]:
    return _ce_backward(dloss, hidden, weight, bias, target, token_weight, class_weight, fopts,
                        iopts, memory_budget, need)


@linear_cross_entropy_backward.register_fake
def _(dloss, hidden, weight, bias, *rest):
    return _grads(hidden, weight, bias, rest[-1])


def _scale_grads(ctx, grads, need, dloss):
    """grads (those in `need`) *= dloss, in place."""
    hidden, weight, bias = ctx.saved_tensors[:3]
    keep = []
    with B.context(hidden, *run_args(ctx.opts[1])) as c:
        sel = tuple(g if need & f else g.new_empty(0)
                    for g, f in zip(grads, (NEED_DH, NEED_DW, NEED_DB)))
        _lib.check(_lib.linear_scale_grads(c, _head(hidden, weight, bias, keep),
                                           _grads_struct(sel, keep),
                                           B.view(dloss.reshape(1).to(F32), keep)))


def _fused_formula(tensors, first_grad, backward_op):
    """(setup_context, backward) of a loss op whose inputs are `tensors`
    tensors (hidden, weight, bias first), fopts, iopts, memory_budget, and
    `need` last, and whose outputs from first_grad on are the gradients in
    `need` at an upstream 1 (a scalar loss). backward_op(dloss, the
    tensors, fopts, iopts, memory_budget, need) recomputes them."""

    def setup(ctx, inputs, output):
        ctx.computed = inputs[-1]  # the gradients the forward computed (need)
        ctx.opts = inputs[tensors:tensors + 3]
        ctx.n_opts = len(inputs) - 3  # the inputs after hidden, weight and bias
        if getattr(ctx, "eager", False):
            # Held beside save_for_backward, as aliases (no reference cycle
            # through the outputs), so the backward can scale them in place:
            # a scaled copy would be a second dW. Nor does autograd get to
            # fill zero gradients for the gradient outputs (another dW).
            ctx.save_for_backward(*inputs[:tensors])
            ctx.fwd_grads = tuple(g.detach() for g in output[first_grad:])
            ctx.set_materialize_grads(False)
        else:  # a traced graph: functional
            ctx.save_for_backward(*inputs[:tensors], *output[first_grad:])

    def backward(ctx, dloss, *_):
        saved = ctx.saved_tensors
        need = _need(ctx, saved[2])
        if dloss is None:  # eager, no materialized zeros: the loss itself was not used
            return _back((None, None, None), 0, ctx.n_opts)
        if (need & ctx.computed) == need:  # computed at an upstream 1: scale (dloss is a scalar)
            if getattr(ctx, "eager", False):
                ctx.computed = 0  # used up: another backward through this graph recomputes
                grads, ctx.fwd_grads = ctx.fwd_grads, None  # unshared: autograd keeps them
                _scale_grads(ctx, grads, need, dloss)
            else:
                grads = tuple(g * dloss if need & f else g
                              for g, f in zip(saved[tensors:], (NEED_DH, NEED_DW, NEED_DB)))
        else:
            grads = call(ctx, backward_op, dloss, *saved[:tensors], *ctx.opts, need)
        return _back(grads, need, ctx.n_opts)

    return setup, backward


_ce_setup, _ce_formula = _fused_formula(6, 4, linear_cross_entropy_backward)
linear_cross_entropy = Differentiable(linear_cross_entropy, _ce_setup, _ce_formula)


class MainGrad:
    """linear_cross_entropy (called with its arguments, as the
    Differentiable) adding the weight's gradient to main_grad, float32
    shaped like the weight, instead of handing it to autograd. Eager only
    (a traced op may not write its inputs: the caller refuses tracing).
    param: the caller's weight (the op's may be a cast of it), which
    carries Megatron-core's DDP flags.

    A scalar loss's forward adds dW at an upstream gradient of 1, as the
    other path computes its gradients, but main_grad cannot be scaled
    afterwards (it holds earlier sums): the backward reads the upstream to
    the host and, unless it is exactly 1, adds (upstream - 1) x dW through
    the recomputing backward. Per-row losses and a second backward through
    the graph add upstream x dW in the backward."""

    def __init__(self, main_grad, param):
        self.main_grad, self.param = main_grad, param

    def __call__(self, *args):
        if not _needs_graph(args):
            return _ce_forward(*args)
        return _Eager.apply(*args, self)

    def body(self, *args):
        return _ce_forward(*args, main_grad=self.main_grad)

    setup = staticmethod(_ce_setup)

    def backward(self, ctx, dloss, *_):
        saved = ctx.saved_tensors
        need = _need(ctx, saved[2])
        if (need & ctx.computed) == need and need & NEED_DW:  # dW is in main_grad at upstream 1
            ctx.computed = 0  # used up: another backward through this graph recomputes
            grads, ctx.fwd_grads = ctx.fwd_grads, None
            up = saved[0].new_zeros((), dtype=F32) if dloss is None else dloss.to(F32)
            if float(up) != 1.0:  # this mode's one host read
                _ce_backward(up - 1.0, *saved, *ctx.opts, NEED_DW, self.main_grad)
            if dloss is not None and need & ~NEED_DW:
                _scale_grads(ctx, grads, need & ~NEED_DW, dloss)
        elif dloss is not None:
            grads = _ce_backward(dloss, *saved, *ctx.opts, need, self.main_grad)
        if dloss is None:  # eager, no materialized zeros: the loss itself was not used
            return _back((None, None, None), 0, ctx.n_opts)
        dh, _, db = grads
        return _back((dh, self._weight_grad(saved[1]), db.to(saved[1].dtype)), need, ctx.n_opts)

    def _weight_grad(self, weight):
        """None, or, for a weight Megatron-core's DDP tracks, its flag set
        and a placeholder gradient as Megatron's own layers return: the
        DDP's hook asserts that one arrived (overlap_grad_reduce), then
        drops it."""
        if not hasattr(self.param, "grad_added_to_main_grad"):
            return None
        self.param.grad_added_to_main_grad = True
        if getattr(self.param, "zero_out_wgrad", False):
            return torch.zeros_like(weight)
        return torch.empty_like(weight)


# ---------------------------------------------------------------- divergences

@custom_op("lmloss::linear_divergence")
def linear_divergence(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                      teacher_hidden: Tensor, teacher_weight: Tensor,
                      teacher_bias: Optional[Tensor], label: Optional[Tensor],
                      fopts: list[float], iopts: list[int], memory_budget: int,
                      need: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """loss, the student's entropy per row (float32 [N], ignored rows 0),
    then the student's (hidden, weight, bias) gradients in `need` (a
    scalar reduction only) at an upstream gradient of 1. Options as
    _div_ops' (fopts, iopts)."""
    opt = _div_opt(fopts, iopts)
    loss = _loss(hidden, hidden.shape[0], _reduction_name(iopts))
    entropy = hidden.new_empty((hidden.shape[0],), dtype=F32)
    grads = _grads(hidden, weight, bias, need)
    keep, hopt = [], _hopt(memory_budget)
    with B.context(hidden, *run_args(iopts)) as ctx:
        s = _head(hidden, weight, bias, keep)
        t = _head(teacher_hidden, teacher_weight, teacher_bias, keep)
        gs = _grads_struct(grads, keep) if need else None
        ws, addr, nbytes = _workspace(hidden.device, _lib.linear_divergence_workspace_size, s, t,
                                      hopt)
        out = _lib.DivOutputs(loss=B.view(loss.reshape(-1), keep),
                              entropy=B.view(entropy, keep))
        _lib.check(_lib.linear_divergence(ctx, s, t, B.view(label, keep), opt, hopt, out,
                                          B.ptr(gs), addr, nbytes))
    return (loss, entropy) + grads


@linear_divergence.register_fake
def _(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, label, fopts, iopts,
      memory_budget, need):
    loss = _loss(hidden, hidden.shape[0], _reduction_name(iopts))
    entropy = hidden.new_empty((hidden.shape[0],), dtype=F32)
    return (loss, entropy) + _grads(hidden, weight, bias, need)


@custom_op("lmloss::linear_divergence_backward")
def linear_divergence_backward(
        dloss: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
        teacher_hidden: Tensor, teacher_weight: Tensor, teacher_bias: Optional[Tensor],
        label: Optional[Tensor], fopts: list[float], iopts: list[int], memory_budget: int,
        need: int) -> tuple[Tensor, Tensor, Tensor]:
    opt = _div_opt(fopts, iopts)
    grads = _grads(hidden, weight, bias, need)
    keep, hopt = [], _hopt(memory_budget)
    with B.context(hidden, *run_args(iopts)) as ctx:
        s = _head(hidden, weight, bias, keep)
        t = _head(teacher_hidden, teacher_weight, teacher_bias, keep)
        ws, addr, nbytes = _workspace(hidden.device, _lib.linear_divergence_workspace_size, s, t,
                                      hopt)
        _lib.check(_lib.linear_divergence_backward(
            ctx, s, t, B.view(label, keep), opt, hopt, B.view(dloss.reshape(-1).to(F32), keep),
            _grads_struct(grads, keep), addr, nbytes))
    return grads


@linear_divergence_backward.register_fake
def _(dloss, hidden, weight, bias, *rest):
    return _grads(hidden, weight, bias, rest[-1])


linear_divergence = Differentiable(linear_divergence,
                                   *_fused_formula(7, 2, linear_divergence_backward))


# ---------------------------------------------------------------- log-probs, entropy

@custom_op("lmloss::linear_log_probs")
def linear_log_probs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], index: Tensor,
                     mask: Optional[Tensor], logit_scale: float, softcap: float,
                     temperature: float, want_entropy: bool, want_stats: bool, memory_budget: int,
                     backend: int, num_threads: int) -> tuple[Tensor, Tensor, Tensor]:
    n, k = index.shape
    logp = hidden.new_empty((n, k), dtype=F32)
    ent = hidden.new_empty((n,) if want_entropy else (0,), dtype=F32)
    stats = hidden.new_empty(_stats_shape(n, want_stats), dtype=F32)
    keep, hopt = [], _hopt(memory_budget)
    with B.context(hidden, backend, num_threads) as ctx:
        head = _head(hidden, weight, bias, keep)
        ws, addr, nbytes = _workspace(hidden.device, _lib.linear_workspace_size, head, hopt, None,
                                      k)
        _lib.check(_lib.linear_log_probs(
            ctx, head, B.view(index, keep), B.ptr(B.view(mask, keep)),
            B.transform(logit_scale, softcap, temperature), hopt, B.view(logp, keep),
            B.ptr(B.view(ent, keep) if want_entropy else None),
            B.ptr(B.view(stats, keep) if want_stats else None), addr, nbytes))
    return logp, ent, stats


@linear_log_probs.register_fake
def _(hidden, weight, bias, index, mask, logit_scale, softcap, temperature, want_entropy,
      want_stats, memory_budget, backend, num_threads):
    n, k = index.shape
    return (hidden.new_empty((n, k), dtype=F32),
            hidden.new_empty((n,) if want_entropy else (0,), dtype=F32),
            hidden.new_empty(_stats_shape(n, want_stats), dtype=F32))


@custom_op("lmloss::linear_log_probs_backward")
def linear_log_probs_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                              index: Tensor, mask: Optional[Tensor], logit_scale: float,
                              softcap: float, temperature: float, dlogp: Tensor,
                              dentropy: Optional[Tensor], stats: Optional[Tensor],
                              memory_budget: int, backend: int, num_threads: int,
                              need: int) -> tuple[Tensor, Tensor, Tensor]:
    grads = _grads(hidden, weight, bias, need)
    keep, hopt = [], _hopt(memory_budget)
    with B.context(hidden, backend, num_threads) as ctx:
        head, gs = _head(hidden, weight, bias, keep), _grads_struct(grads, keep)
        ws, addr, nbytes = _workspace(hidden.device, _lib.linear_workspace_size, head, hopt, gs,
                                      index.shape[1])
        dent = None if dentropy is None else B.view(dentropy.to(F32), keep)
        _lib.check(_lib.linear_log_probs_backward(
            ctx, head, B.view(index, keep), B.ptr(B.view(mask, keep)),
            B.transform(logit_scale, softcap, temperature), hopt,
            B.view(dlogp.to(F32), keep), B.ptr(dent),
            B.ptr(B.view(stats, keep) if stats is not None else None), gs, addr, nbytes))
    return grads


@linear_log_probs_backward.register_fake
def _(hidden, weight, bias, *rest):
    return _grads(hidden, weight, bias, rest[-1])


def _llp_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5], output[2])
    ctx.transform, ctx.want_entropy, ctx.want_stats = inputs[5:8], inputs[8], inputs[9]
    ctx.run = inputs[10:]


def _llp_backward(ctx, dlogp, dent, _dstats):
    *saved, stats = ctx.saved_tensors
    need = _need(ctx, saved[2])
    grads = call(ctx, linear_log_probs_backward, *saved, *ctx.transform, dlogp,
                 dent if ctx.want_entropy else None, stats if ctx.want_stats else None,
                 *ctx.run, need)
    return _back(grads, need, 10)


linear_log_probs = Differentiable(linear_log_probs, _llp_setup, _llp_backward)


def kept_bytes(hidden, weight, memory_budget):
    """lmloss_linear_log_probs_keep_size of this head (shapes and dtype
    only): its workspace, or 0 where it keeps nothing."""
    size = ctypes.c_size_t(0)
    _lib.check(_lib.linear_log_probs_keep_size(_head(hidden, weight, None, []),
                                               _hopt(memory_budget), ctypes.byref(size)))
    return size.value


class KeptLogProbs(torch.autograd.Function):
    """Eager linear_log_probs with one index a row whose forward keeps
    every row's gradient of its log-prob (lmloss_linear_log_probs_keep), so
    the backward runs two GEMMs and a loss of the log-probs costs the head
    three. The entropy's gradient is not kept: an upstream one takes the
    recomputing backward instead, as does a second backward through the
    same graph (retain_graph=True). No bias gradient (the caller's choice).
    args: hidden, weight, bias, index [N, 1], mask, (logit_scale, softcap,
    temperature), want_entropy, memory_budget, backend, num_threads, and
    kept_bytes' answer."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, index, mask, transform, want_entropy, memory_budget,
                backend, num_threads, nbytes):
        n = hidden.shape[0]
        logp = hidden.new_empty((n, 1), dtype=F32)
        ent = hidden.new_empty((n,) if want_entropy else (0,), dtype=F32)
        keep, hopt = [], _hopt(memory_budget)
        ws, addr, nbytes = B.workspace(nbytes, hidden.device)
        with B.context(hidden, backend, num_threads) as c:
            _lib.check(_lib.linear_log_probs_keep(
                c, _head(hidden, weight, bias, keep), B.view(index, keep),
                B.ptr(B.view(mask, keep)), B.transform(*transform), hopt, B.view(logp, keep),
                B.ptr(B.view(ent, keep) if want_entropy else None), addr, nbytes))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, index, mask)
        ctx.kept = ws, addr, nbytes
        ctx.args = transform, memory_budget, backend, num_threads
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dlogp, dent):
        hidden, weight, bias, index, mask = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None  # spent either way
        transform, memory_budget, backend, num_threads = ctx.args
        need = _need(ctx, bias)
        if dlogp is None:
            dlogp = hidden.new_zeros((hidden.shape[0], 1), dtype=F32)
        if dent is not None or kept is None:  # not kept (or spent): recompute the logits
            del kept
            grads = _BODIES[linear_log_probs_backward](
                hidden, weight, bias, index, mask, *transform, dlogp, dent, None,
                memory_budget, backend, num_threads, need)
            return _back(grads, need, 8)
        grads = _grads(hidden, weight, bias, need)
        ws, addr, nbytes = kept
        keep = [ws]
        with B.context(hidden, backend, num_threads) as c:
            _lib.check(_lib.linear_log_probs_backward_kept(
                c, _head(hidden, weight, bias, keep), B.view(index, keep),
                B.ptr(B.view(mask, keep)), B.transform(*transform), _hopt(memory_budget),
                B.view(dlogp.contiguous().to(F32), keep), _grads_struct(grads, keep), addr,
                nbytes))
        return _back(grads, need, 8)
