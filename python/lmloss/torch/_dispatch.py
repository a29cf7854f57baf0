"""Which path a differentiable op takes.

While a graph is made (torch.compile, torch.export, make_fx) the
torch.library custom op, traced through its fake impl, with its
registered autograd formula. Eagerly, the
same body, setup and formula called straight from a torch.autograd.Function:
torch.library's eager dispatch costs host time on every call (measured on
the GPU machine with torch 2.11: about 0.38 ms per op call in
custom_ops.py's backend_impl, more than the kernels of a 4096 x 32768
cross-entropy take), and the losses of a training step mostly run eagerly.
A call autograd would not record (grad mode off, or no input requiring
grad: a reference policy's log-probs, say) runs the body alone.
"""

import torch

_BODIES = {}


def custom_op(name):
    """torch.library.custom_op (nothing mutated) that remembers the op's body."""
    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=())(fn)
        _BODIES[op] = fn
        return op
    return wrap


def call(ctx, op, *args):
    """Call a custom op from an autograd formula: its body when the forward
    ran eagerly (ctx from _Eager), else the op, which compiled graphs trace."""
    return _BODIES[op](*args) if getattr(ctx, "eager", False) else op(*args)


class Differentiable:
    """A custom op with its autograd formula registered; calling it picks
    the path (module docstring)."""

    def __init__(self, op, setup, backward):
        op.register_autograd(backward, setup_context=setup)
        self.op, self.body, self.setup, self.backward = op, _BODIES[op], setup, backward

    def __call__(self, *args):
        if _tracing(args[0]):
            return self.op(*args)
        if not _needs_graph(args):
            return self.body(*args)
        return _Eager.apply(*args, self)


def _needs_graph(args):
    """Whether autograd records this call: grad mode on and a tensor input requiring grad."""
    if not torch.is_grad_enabled():
        return False
    for t in args:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False


def _tracing(x):
    """Whether a graph is being made (torch.compile, torch.export, make_fx:
    a dispatch mode, or a tensor that is not a plain one): then the custom
    op, which tracing records; eager bodies read data pointers."""
    return (torch.compiler.is_compiling() or type(x) is not torch.Tensor
            or torch._C._len_torch_dispatch_stack() > 0)


class _Eager(torch.autograd.Function):
    # The Differentiable rides last, so ctx.needs_input_grad[i] is the op's
    # input i, as in the formulas registered with torch.library.
    @staticmethod
    def forward(ctx, *args):
        d, args = args[-1], args[:-1]
        out = d.body(*args)
        ctx.eager = True
        d.setup(ctx, args, out)
        ctx.differentiable = d
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative raises
    def backward(ctx, *grads):
        return tuple(ctx.differentiable.backward(ctx, *grads)) + (None,)
