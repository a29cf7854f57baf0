"""Cross-entropy over the vocabulary axis (lmloss_cross_entropy)."""

import collections
from typing import Optional, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _lib
from ._tensor import Rows, optional_vector, out_vector

CrossEntropyResult = collections.namedtuple("CrossEntropyResult",
                                            "loss dlogits lse entropy argmax")
CrossEntropyResult.__doc__ = """Returned by cross_entropy when a return_* flag is set:
loss as in the plain form; dlogits (or None without grad=True); lse,
entropy (float32, shaped like target) and argmax (int64, -1 on ignored
rows), each None unless requested."""


def ce_outputs(n, reduction, return_lse, return_entropy, return_argmax):
    """(loss array, lmloss_ce_outputs over it, {name: array} of the requested
    per-row extras), for n rows."""
    loss, loss_t = out_vector(n if reduction == "none" else 1)
    outputs = _lib.CEOutputs(loss=loss_t)
    extra = {}
    for name, flag, dtype in (("lse", return_lse, np.float32),
                              ("entropy", return_entropy, np.float32),
                              ("argmax", return_argmax, np.int64)):
        if flag:
            extra[name], t = out_vector(n, dtype)
            setattr(outputs, name, t)
    return loss, outputs, extra


def class_weights(weight, class_weight):
    """The class weights of cross_entropy's weight= or class_weight= (one of them)."""
    if weight is not None and class_weight is not None:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "weight= and class_weight= are the same "
                         "(per-class weights [V]): give one; per-token weights are token_weight=")
    return class_weight if weight is None else weight


def ce_options(ignore_index, label_smoothing, z_loss, logit_scale, softcap, temperature,
               reduction, num_items, dft):
    """lmloss_ce_options from cross_entropy's keywords (shared with the fused head)."""
    opt = _lib.ce_options_default()
    set_reduction(opt, reduction, num_items)
    opt.ignore_index = _lib.int64_option("ignore_index", ignore_index)
    opt.label_smoothing = _lib.float_option("label_smoothing", label_smoothing)
    opt.z_loss = _lib.float_option("z_loss", z_loss)
    opt.transform = _lib.make_transform(logit_scale, softcap, temperature)
    opt.dft = int(bool(dft))
    return opt


def set_reduction(opt, reduction, num_items):
    """opt.reduction (and opt.num_items) of an options struct from the
    keywords reduction ("none", "sum", "mean") and num_items (None, or > 0:
    the sum over num_items, with "sum" or "mean")."""
    if reduction not in _lib.REDUCTIONS:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "reduction must be 'none', 'sum' or 'mean', "
                         "got %r" % (reduction,))
    if num_items is not None and reduction == "none":
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "num_items needs reduction 'sum' or 'mean'")
    opt.reduction = _lib.REDUCTIONS[reduction]
    if num_items is not None:
        opt.reduction = _lib.REDUCE_SUM_OVER_ITEMS
        opt.num_items = _lib.float_option("num_items", num_items)


def workspace(n):
    """(array, address, bytes) of the workspace of a CE-sized call over n rows
    (lmloss_cross_entropy_workspace_size), 8-byte aligned."""
    nbytes = _lib.ce_workspace_size(n)
    ws = np.empty(max(1, -(-nbytes // 8)), dtype=np.float64)
    return ws, ws.ctypes.data, ws.nbytes


def cross_entropy(logits: ArrayLike, target: ArrayLike, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, logit_scale: float = 1.0,
                  softcap: Optional[float] = None, temperature: float = 1.0,
                  weight: Optional[ArrayLike] = None, token_weight: Optional[ArrayLike] = None,
                  class_weight: Optional[ArrayLike] = None, reduction: str = "mean",
                  num_items: Optional[float] = None, dft: bool = False, grad: bool = False,
                  return_lse: bool = False, return_entropy: bool = False,
                  return_argmax: bool = False, backend: str = "auto", num_threads: int = 0
                  ) -> Union[float, np.ndarray, Tuple[Union[float, np.ndarray], np.ndarray],
                             "CrossEntropyResult"]:
    """Cross-entropy of logits [..., V] against target [...] (int64/int32).

    Per row with target y != ignore_index, z = transform(x) (x * logit_scale,
    then softcap * tanh(. / softcap) unless softcap is None or 0, then
    / temperature), class weights c (weight [V], as torch's
    F.cross_entropy(weight=); all 1 when None), smoothing e:
        ce   = c_y (1 - e) (lse - z_y) + (e / V) sum_j c_j (lse - z_j)
        ce  *= stop_gradient(p_y)              when dft (DFT)
        loss = w (ce + z_loss * lse^2)         (w = token_weight [...], else 1)
    class_weight= is another name for weight= (the fused head's, whose
    weight= is the head); give one of them.
    reduction: "none" -> float32 array shaped like target (ignored rows 0);
    "sum" -> float; "mean" -> sum / (sum of c_y over non-ignored rows), 0
    (zero gradient) when that is 0. num_items given (> 0) -> sum / num_items
    whether reduction is "sum" or "mean" (transformers' num_items_in_batch);
    an error with "none".

    grad=True returns (loss, dlogits): the gradient of the returned loss
    with upstream 1 (for "none", of its sum), computed in the same pass.
    dlogits is float32 for fp32/fp64 logits, else the logits' dtype.
    With any return_* flag set, returns CrossEntropyResult instead.

    Dtypes: fp32; fp64 (computed in fp32); bf16 (ml_dtypes.bfloat16, or
    uint16 bit patterns); fp16. backend: "auto", "cpu" or "ref" (float64
    reference); num_threads: 0 = OpenMP's default. Raises lmloss.Error.
    """
    class_weight = class_weights(weight, class_weight)
    opt = ce_options(ignore_index, label_smoothing, z_loss, logit_scale, softcap, temperature,
                     reduction, num_items, dft)
    ctx = _lib.make_context(backend, num_threads)
    x = Rows(logits, "logits")
    n, keep = x.n, []
    inputs = _lib.CEInputs(x.t, optional_vector(target, n, x.lead, "target", "index", keep),
                           optional_vector(token_weight, n, x.lead, "token_weight", "f32", keep),
                           optional_vector(class_weight, x.v, (x.v,), "weight", "f32", keep))

    loss, outputs, extra = ce_outputs(n, reduction, return_lse, return_entropy, return_argmax)
    dlogits = None
    if grad:
        dlogits, outputs.dlogits = x.empty(x.out_dtype())

    ws, addr, nbytes = workspace(n)
    _lib.check(_lib.cross_entropy(ctx, inputs, opt, outputs, addr, nbytes))

    loss = loss.reshape(x.lead) if reduction == "none" else float(loss[0])
    if dlogits is not None:
        dlogits = dlogits.reshape(x.lead + (x.v,))
    if extra:
        extra = {k: v.reshape(x.lead) for k, v in extra.items()}
        return CrossEntropyResult(loss, dlogits, extra.get("lse"), extra.get("entropy"),
                                  extra.get("argmax"))
    return (loss, dlogits) if grad else loss
