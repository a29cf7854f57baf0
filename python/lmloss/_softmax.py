"""Softmax and log-softmax over the last axis, and their backward."""

import operator

import numpy as np
from numpy.typing import ArrayLike

from . import _lib
from ._tensor import Rows, shape_error


def _forward(logits, axis, log, backend, num_threads):
    ctx = _lib.make_context(backend, num_threads)
    if axis != -1:
        a = logits if hasattr(logits, "ndim") else np.asarray(logits)
        try:
            ax = operator.index(axis)
        except TypeError:
            raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "axis must be an int, got %r" % (axis,))
        if not -max(a.ndim, 1) <= ax < max(a.ndim, 1):
            raise shape_error("axis %d out of range for a %d-D array" % (ax, a.ndim))
        if a.ndim > 1 and ax % a.ndim != a.ndim - 1:  # the classes last, and back
            moved = np.moveaxis(np.asarray(a), ax, -1)
            return np.moveaxis(_forward(moved, -1, log, backend, num_threads), -1, ax)
    x = Rows(logits, "logits")
    out, out_t = x.empty(x.out_dtype())
    _lib.check(_lib.softmax(ctx, x.t, int(log), out_t))
    return out.reshape(x.lead + (x.v,))


def softmax(logits: ArrayLike, axis: int = -1, *, backend: str = "auto",
            num_threads: int = 0) -> np.ndarray:
    """softmax over `axis` (the last by default) of logits [..., V]. Same
    shape; float32 for fp32/fp64 input, else the input's dtype (bf16 as
    ml_dtypes.bfloat16 or uint16 bits, fp16)."""
    return _forward(logits, axis, False, backend, num_threads)


def log_softmax(logits: ArrayLike, axis: int = -1, *, backend: str = "auto",
                num_threads: int = 0) -> np.ndarray:
    """log_softmax over `axis`; shapes and dtypes as softmax."""
    return _forward(logits, axis, True, backend, num_threads)


def softmax_backward(y: ArrayLike, dy: ArrayLike, log: bool = False, *, backend: str = "auto",
                     num_threads: int = 0) -> np.ndarray:
    """dx from the forward output y and upstream dy (both [..., V], the
    forward's dtypes):
    softmax: dx = y * (dy - sum(dy * y)); log: dx = dy - exp(y) sum(dy).
    dx is float32 for fp32/fp64 dy, else dy's dtype."""
    ctx = _lib.make_context(backend, num_threads)
    y, dy = Rows(y, "y"), Rows(dy, "dy")
    if dy.lead + (dy.v,) != y.lead + (y.v,):
        raise shape_error("dy has shape %s, y has %s" % (dy.lead + (dy.v,), y.lead + (y.v,)))
    dx, dx_t = dy.empty(dy.out_dtype())
    _lib.check(_lib.softmax_backward(ctx, y.t, dy.t, int(bool(log)), dx_t))
    return dx.reshape(dy.lead + (dy.v,))
