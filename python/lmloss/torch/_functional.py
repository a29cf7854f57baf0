"""The public functions of lmloss.torch: keyword checks, [..., V] flattening
and dtype handling around the custom ops (pure torch code, traceable by
torch.compile without graph breaks).

Signatures: the tensors positionally, then keyword-only options (a few
positional extras where the names users arrive with have them: softmax's
dim, TRL's selective_log_softmax and entropy_from_logits).

VOCAB_PARALLEL: cross_entropy, log_probs, entropy, softmax, log_softmax,
linear_cross_entropy and linear_log_probs take process_group= (torch.distributed: NCCL on
GPUs, gloo on the CPU) for a vocabulary split over its ranks, Megatron's
layout: rank r holds columns [r V_r, (r + 1) V_r) of the logits (rows of
the head), or [vocab_start, vocab_start + V_r) of vocab_size with
vocab_start= and vocab_size= for uneven shards. Indices, targets and class
weights are the whole vocabulary's, per-row results the whole rows' on
every rank, gradients the rank's columns. One all-gather of 16 bytes a row
(_vocab_parallel.py); eager only (torch.compile breaks the graph there).
The divergences (kl_div, generalized_jsd, tvd in _divergence.py) take it
too, with two exchanges (docs/design.md)."""

from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import _dlpack, _lib
from .._ce import CrossEntropyResult, class_weights
from .._linear import LinearCrossEntropyResult, LinearPlan
from .._linear import linear_plan as _linear_plan
from . import _linear_ops as L
from . import _ops as O
from . import _vocab_parallel as VP
from ._bridge import backend_code
from ._dispatch import _tracing


def _bad(msg):
    return _lib.Error("LMLOSS_ERR_BAD_OPTION", msg)


def _rows(x, name):
    """x [..., V] as 2-D [N, V] (a view when possible); float64 computed in
    float32. V = 0 is refused (LMLOSS_ERR_BAD_SHAPE), as NumPy's API does."""
    if x.dim() < 1:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "%s must have at least one axis" % name)
    if x.shape[-1] == 0:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "%s %s has no classes (V = 0)"
                         % (name, tuple(x.shape)))
    if x.dtype == torch.float64:
        x = x.float()
    return x.reshape(-1, x.shape[-1])


def _index(t):
    return t if t.dtype in (torch.int64, torch.int32) else t.long()


def _same_device(t, like, name, like_name):
    if t.device != like.device:
        raise _lib.Error("LMLOSS_ERR_BAD_DEVICE", "%s is on %s but %s on %s: move it to %s"
                         % (name, t.device, like_name, like.device, like.device))


def _indices(t, like, name, like_name="the logits"):
    """An index tensor (target, index): integers (refused otherwise, as NumPy's
    API refuses them: a float target is not rounded), on like's device."""
    if not isinstance(t, torch.Tensor):
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s must be a tensor, got %s"
                         % (name, type(t).__name__))
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s must hold class indices (an integer "
                         "tensor), got %s%s" % (name, t.dtype, "; class probabilities must have "
                                                "the logits' shape" if name == "target" else ""))
    if t.dtype == torch.uint64:
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s is uint64, whose values need not fit "
                         "int64: convert it to int64" % name)
    _same_device(t, like, name, like_name)
    return _index(t)


def _target(target, lead, like, like_name="the logits", name="target"):
    """CE's class-index target (or another per-row index, `name`), shaped like
    the rows (`lead`), on like's device."""
    target = _indices(target, like, name, like_name)
    if target.shape != lead:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "%s has shape %s, expected %s (one class "
                         "index per row)" % (name, tuple(target.shape), tuple(lead)))
    return target.reshape(-1)


def _empty_rows_ce(zsum, reduction, num_items, divisor, extras, s):
    """Cross-entropy over no rows, as torch gives it: "none" an empty [...],
    "sum" 0, "mean" NaN (0 / 0); the extras empty. zsum: the logits summed
    over the classes, [...] (empty), so the result stays in the graph."""
    loss = _unshift(zsum, s)
    if reduction != "none":
        total = zsum.sum()
        if divisor is not None:
            loss = total / divisor.to(device=total.device, dtype=total.dtype)
        elif num_items is not None:
            loss = total / num_items
        else:
            loss = total if reduction == "sum" else total / 0.0
    if not extras:
        return loss, None
    lead = zsum.shape
    pick = [_unshift(zsum.new_empty(lead, dtype=dt), s) if extras & f else None
            for f, dt in ((O.EXTRA_LSE, torch.float32), (O.EXTRA_ENTROPY, torch.float32),
                          (O.EXTRA_ARGMAX, torch.int64))]
    return loss, pick


def _mask(m):
    if m is None:
        return None
    return (m if m.dtype in (torch.bool, torch.uint8) else m != 0).reshape(-1)


def _f32(t):
    return None if t is None else t.detach().to(torch.float32).reshape(-1)


def _reduction(reduction, num_items):
    """(C reduction, C num_items or None, tensor to divide the sum by or None)."""
    if reduction not in O.REDUCTION_NAMES:
        raise _bad("reduction must be 'none', 'sum' or 'mean', got %r" % (reduction,))
    if num_items is None:
        return reduction, None, None
    if reduction == "none":
        raise _bad("num_items needs reduction 'sum' or 'mean'")
    if isinstance(num_items, torch.Tensor):  # divided on the device: no host read
        return "sum", None, num_items
    return reduction, float(num_items), None


def _extras_flags(return_lse, return_entropy, return_argmax):
    return ((O.EXTRA_LSE if return_lse else 0) | (O.EXTRA_ENTROPY if return_entropy else 0)
            | (O.EXTRA_ARGMAX if return_argmax else 0))


def _finish(loss, lse, ent, amax, lead, reduction, divisor, extras, shift=0):
    if reduction == "none":
        loss = _unshift(loss.reshape(lead), shift)
    if divisor is not None:
        loss = loss / divisor.to(device=loss.device, dtype=loss.dtype)
    if not extras:
        return loss, None
    pick = [_unshift(t.detach().reshape(lead), shift) if extras & f else None
            for t, f in ((lse, O.EXTRA_LSE), (ent, O.EXTRA_ENTROPY), (amax, O.EXTRA_ARGMAX))]
    return loss, pick


def _shift_of(shift, target):
    """cut-cross-entropy's shift (bool or int) as an int in [0, T)."""
    s = int(shift)
    if s and (target.dim() < 1 or not 0 <= s < target.shape[-1]):
        raise _bad("shift must be in [0, T) for targets [..., T], got %r with targets of shape "
                   "%s" % (shift, tuple(target.shape)))
    return s


def _shifted(t, s, value):
    """t [..., T] -> t[..., s:] padded at the end with `value` back to T (a
    row of the last s positions is then ignored: the logits are not copied)."""
    if t is None or not s:
        return t
    return torch.nn.functional.pad(t[..., s:], (0, s), value=value)


def _unshift(t, s):
    """A per-position result [..., T] of a shifted call as cut-cross-entropy's
    [..., T - s] (the positions that predict a token)."""
    return t if t is None or not s else t[..., :t.shape[-1] - s]


Number = Union[int, float]


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, logit_scale: float = 1.0,
                  softcap: Optional[float] = None, temperature: float = 1.0,
                  weight: Optional[Tensor] = None, token_weight: Optional[Tensor] = None,
                  class_weight: Optional[Tensor] = None, reduction: str = "mean",
                  num_items: Optional[Union[Number, Tensor]] = None, dft: bool = False,
                  shift: Union[bool, int] = 0, return_lse: bool = False,
                  return_entropy: bool = False, return_argmax: bool = False,
                  backend: str = "auto", num_threads: int = 0,
                  process_group: Optional[Any] = None, vocab_start: Optional[int] = None,
                  vocab_size: Optional[int] = None,
                  inplace_backward: bool = False) -> Union[Tensor, CrossEntropyResult]:
    """Cross-entropy of logits [..., V] against target [...]: the loss and
    keywords of lmloss.cross_entropy (and of F.cross_entropy with the
    classes last), differentiable w.r.t. logits.

    logits: float32, bfloat16 or float16 (float64 computed in float32), on
    the CPU or CUDA. target: class indices [...] (int64/int32, or another
    integer type that fits int64) on the logits' device; or, as
    F.cross_entropy takes them, class probabilities of the logits' shape
    (a float tensor; loss = -sum_j c_j p_j log softmax(z)_j with
    label_smoothing mixing p with the uniform distribution, "mean" divides
    by the number of rows, as torch does; dft, ignore_index and the
    return_* flags do not apply). weight [V] is the per-class weight of
    F.cross_entropy (class_weight= is another name for it), token_weight
    [...] the per-token weight; neither is differentiated.
    softcap: None (or 0) is off, as in Liger-Kernel and cut-cross-entropy.
    shift (cut-cross-entropy's): position t predicts target t + shift, for
    logits [..., T, V] and target [..., T]: the last `shift` positions of
    the logits and the first `shift` labels are dropped (nothing is copied;
    "none" returns [..., T - shift]).

    Returns a float32 tensor on the logits' device: [...] for "none", 0-d
    otherwise. num_items may be a number or a tensor (transformers'
    num_items_in_batch): a tensor divides the summed loss on the device,
    never read by the host. With return_lse / return_entropy /
    return_argmax, returns CrossEntropyResult(loss, None, lse, entropy,
    argmax), the extras detached. There is no grad= keyword: use autograd.

    A scalar loss ("sum", "mean") of logits that autograd records forms
    their gradient in the forward, in the same pass over them, at an
    upstream gradient of 1; the backward scales it by the upstream on the
    device (a pass over the gradient unless the upstream is 1, as it is for
    a loss backpropagated unscaled). inplace_backward=True (Liger-Kernel's
    LigerCrossEntropyLoss does it always) writes that gradient over the
    logits, so no second [..., V] buffer exists: for callers that make no
    other use of the logits. Their version is bumped, so another op's
    backward that saved them raises autograd's in-place error, and a second
    backward through this graph (retain_graph=True) raises too. It applies
    where the gradient is formed in the forward and the call runs eagerly
    (not under torch.compile, the REF backend, process_group or probability
    targets); elsewhere it changes nothing.

    Vocab-parallel (VOCAB_PARALLEL below): with process_group, logits are
    this rank's columns of the vocabulary, target and class weights the
    whole vocabulary's; every rank gets the whole rows' loss.
    """
    class_weight = class_weights(weight, class_weight)
    if process_group is not None:
        if shift or target.is_floating_point():
            raise _bad("shift and probability targets are not vocab-parallel")
        return VP.cross_entropy(
            logits, target, process_group=process_group, vocab_start=vocab_start,
            vocab_size=vocab_size, ignore_index=ignore_index, label_smoothing=label_smoothing,
            z_loss=z_loss, logit_scale=logit_scale, softcap=softcap, temperature=temperature,
            token_weight=token_weight, class_weight=class_weight, reduction=reduction,
            num_items=num_items, dft=dft, return_lse=return_lse, return_entropy=return_entropy,
            return_argmax=return_argmax, backend=backend, num_threads=num_threads)
    red, items, divisor = _reduction(reduction, num_items)
    if (isinstance(target, torch.Tensor) and target.is_floating_point()
            and target.shape == logits.shape):
        if dft or return_lse or return_entropy or return_argmax:
            raise _bad("dft and return_* need class-index targets, not probabilities")
        return _soft_cross_entropy(logits, target, class_weight, token_weight, label_smoothing,
                                   z_loss, logit_scale, softcap, temperature, red, items,
                                   divisor, _shift_of(shift, target[..., 0]), backend,
                                   num_threads)
    x = _rows(logits, "logits")
    lead = logits.shape[:-1]
    target = _target(target, lead, logits)
    s = _shift_of(shift, target.reshape(lead))
    extras = _extras_flags(return_lse, return_entropy, return_argmax)
    fopts, iopts = O.ce_args(ignore_index, label_smoothing, z_loss, logit_scale, softcap,
                             temperature, red, items, dft, backend_code(backend), num_threads,
                             _grad_in_forward(red, x, backend, inplace_backward, divisor))
    if x.shape[0] == 0:  # no rows: what torch gives (the C call needs data)
        loss, pick = _empty_rows_ce(logits.float().sum(-1), red, items, divisor, extras, s)
    else:
        target = _shifted(target.reshape(lead), s, ignore_index).reshape(-1)
        token_weight = _shifted(token_weight, s, 0.0)
        out = O.cross_entropy(x, target, _f32(token_weight), _f32(class_weight), fopts, iopts,
                              extras)
        loss, pick = _finish(*out[:4], lead, red, divisor, extras, s)
    return loss if pick is None else CrossEntropyResult(loss, None, *pick)


def _grad_in_forward(reduction, x, backend, inplace, divisor):
    """Where the CE op forms the gradient of rows x (O.GRAD_*): in the
    forward when the loss is a scalar and autograd records the call (its
    upstream then scales it: lmloss_scale, which the REF backend lacks),
    over x when asked and eager (a traced op must not write its inputs).
    A num_items tensor divides on the device after the op, so the upstream
    is never 1 and scaling is a second pass over the gradient: the backward
    kernel's one pass is cheaper then (H200, bf16 8192 x 152064), unless the
    gradient is to go over the logits."""
    if (reduction == "none" or backend == "ref" or not torch.is_grad_enabled()
            or not x.requires_grad):
        return O.GRAD_IN_BACKWARD
    if inplace and not _tracing(x):
        return O.GRAD_OVER_LOGITS
    return O.GRAD_IN_BACKWARD if divisor is not None else O.GRAD_IN_FORWARD


def _soft_cross_entropy(logits, target, class_weight, token_weight, label_smoothing, z_loss,
                        logit_scale, softcap, temperature, reduction, num_items, divisor, s,
                        backend, num_threads):
    """F.cross_entropy's loss for class probabilities: log_softmax from lmloss
    (its backward is exact: dx = softmax * sum(q) - q for the weighted
    probabilities q), the weighted sum in torch."""
    _same_device(target, logits, "target", "the logits")
    if s:
        logits, target = logits[..., :-s, :], target[..., s:, :]
        token_weight = None if token_weight is None else token_weight[..., s:]
    z = logits.float()
    if logit_scale != 1.0:
        z = z * float(logit_scale)
    cap = _lib.softcap_value(softcap)
    if cap:
        z = torch.tanh(z / cap) * cap
    if temperature != 1.0:
        z = z / float(temperature)
    lp = log_softmax(z, backend=backend, num_threads=num_threads)
    q = target.detach().to(torch.float32)
    e = float(label_smoothing)
    if not 0.0 <= e <= 1.0:
        raise _bad("label_smoothing must be in [0, 1], got %r" % (label_smoothing,))
    if e:
        q = q * (1.0 - e) + e / q.shape[-1]
    if class_weight is not None:
        q = q * class_weight.detach().to(device=q.device, dtype=torch.float32)
    loss = -(q * lp).sum(-1)
    if z_loss:
        loss = loss + float(z_loss) * torch.logsumexp(z, -1) ** 2
    if token_weight is not None:
        loss = loss * token_weight.detach().to(device=loss.device, dtype=torch.float32)
    if reduction == "none":
        return loss
    total = loss.sum()
    if divisor is not None:
        return total / divisor.to(device=total.device, dtype=total.dtype)
    if num_items is not None:
        return total / num_items
    return total if reduction == "sum" else total / loss.numel()


def _index_2d(index, lead, like, like_name="the logits"):
    """index [...] (K = 1, squeezed result) or [..., K] as [N, K]; the result shape."""
    index = _indices(index, like, "index", like_name)
    if index.shape == lead:
        return index.reshape(-1, 1), lead
    if index.dim() == len(lead) + 1 and index.shape[:-1] == lead:
        return index.reshape(-1, index.shape[-1]), index.shape
    raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "index has shape %s; expected %s or %s + (K,)"
                     % (tuple(index.shape), tuple(lead), tuple(lead)))


def _save_stats(v, *inputs):
    """Whether a log-probs forward over rows v wide saves the rows'
    statistics for its backward: an input needs a gradient and v fits them."""
    return (torch.is_grad_enabled() and v <= _lib.STATS_MAX_V
            and any(t is not None and t.requires_grad for t in inputs))


def log_probs(logits: Tensor, index: Tensor, *, temperature: float = 1.0,
              mask: Optional[Tensor] = None, entropy: bool = False, backend: str = "auto",
              num_threads: int = 0, process_group: Optional[Any] = None,
              vocab_start: Optional[int] = None,
              vocab_size: Optional[int] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """log softmax(logits / temperature) gathered at index, as lmloss.log_probs.

    logits [..., V] (float32, bfloat16, float16; float64 computed in
    float32); index [...] or [..., K] integer with 0 <= index < V, on the
    logits' device. Returns float32 shaped like index, or (logp, entropy
    [...]) with entropy=True. mask [...] (bool): masked-out rows are not
    read and read 0. Differentiable w.r.t. logits (through logp and
    entropy). TRL's signature and dtype are selective_log_softmax's.
    With process_group (VOCAB_PARALLEL), one index a row."""
    if process_group is not None:
        return VP.log_probs(logits, index, process_group=process_group, vocab_start=vocab_start,
                            vocab_size=vocab_size, temperature=temperature, mask=mask,
                            entropy=entropy, backend=backend, num_threads=num_threads)
    x = _rows(logits, "logits")
    lead = logits.shape[:-1]
    idx, shape = _index_2d(index, lead, logits)
    if x.shape[0] == 0:  # no rows: empty results, in the graph
        z = logits.float().sum(-1)
        logp = z if shape == lead else z[..., None].expand(shape)
        return (logp, z) if entropy else logp
    # the backward then reads the logits once (lmloss_log_probs' stats)
    logp, ent, _ = O.log_probs(x, idx, _mask(mask), 1.0, 0.0, float(temperature),
                               bool(entropy), _save_stats(x.shape[-1], x), backend_code(backend),
                               int(num_threads))
    logp = logp.reshape(shape)
    return (logp, ent.reshape(lead)) if entropy else logp


def selective_log_softmax(logits: Tensor, index: Tensor, temperature: float = 1.0,
                          row_mask: Optional[Tensor] = None) -> Tensor:
    """TRL's selective_log_softmax (trl.trainer.utils), its signature and
    result: gather(log_softmax(logits / temperature), index) for logits
    [..., V] and index [...] or [..., K], shaped like index, in the logits'
    dtype (computed by lmloss in fp32). row_mask (index's shape): entries
    where it is 0 read 0, and rows that are 0 throughout are not read."""
    if not temperature > 0:
        raise ValueError("temperature must be positive")
    squeeze = index.dim() == logits.dim() - 1
    keep = None if row_mask is None else row_mask != 0
    rows = keep if keep is None or squeeze else keep.any(-1)
    logp = log_probs(logits, index, temperature=temperature, mask=rows)
    if keep is not None and not squeeze:
        logp = logp.masked_fill(~keep, 0.0)
    return logp.to(logits.dtype)


def entropy(logits: Tensor, *, temperature: float = 1.0, backend: str = "auto",
            num_threads: int = 0, process_group: Optional[Any] = None,
            vocab_start: Optional[int] = None, vocab_size: Optional[int] = None) -> Tensor:
    """Entropy (nats) of softmax(logits / temperature) per row: float32 [...]
    for logits [..., V], differentiable w.r.t. logits. process_group:
    VOCAB_PARALLEL."""
    if process_group is not None:
        return VP.entropy(logits, process_group=process_group, vocab_start=vocab_start,
                          vocab_size=vocab_size, temperature=temperature, backend=backend,
                          num_threads=num_threads)
    x = _rows(logits, "logits")
    if x.shape[0] == 0:
        return logits.float().sum(-1)
    ent = O.entropy(x, 1.0, 0.0, float(temperature), backend_code(backend), int(num_threads))
    return ent.reshape(logits.shape[:-1])


def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """TRL's entropy_from_logits: the entropy of softmax(logits) per row,
    shaped logits.shape[:-1], in the logits' dtype. chunk_size is accepted
    for compatibility: the kernel streams rows and holds no softmax copy."""
    return entropy(logits).to(logits.dtype)


def _softmax(logits, dim, log, backend, num_threads):
    if not isinstance(dim, int):
        raise _bad("dim must be an int, got %r" % (dim,))
    nd = max(logits.dim(), 1)
    if not -nd <= dim < nd:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "dim %d out of range for a %d-D tensor"
                         % (dim, logits.dim()))
    d = dim % nd
    if logits.dim() > 1 and d != nd - 1:  # the classes last, and back
        return _softmax(logits.movedim(d, -1), -1, log, backend, num_threads).movedim(-1, d)
    x = _rows(logits, "logits")
    if x.shape[0] == 0:
        return (x * 0).reshape(logits.shape)
    y = O.softmax(x, log, backend_code(backend), int(num_threads))
    return y.reshape(logits.shape)


def softmax(logits: Tensor, dim: int = -1, *, backend: str = "auto", num_threads: int = 0,
            process_group: Optional[Any] = None, vocab_start: Optional[int] = None,
            vocab_size: Optional[int] = None) -> Tensor:
    """softmax over `dim` (any axis, torch's keyword; the last by default).
    Same shape and dtype as logits (float32 for float64), differentiable.
    process_group: VOCAB_PARALLEL (the vocabulary on the last axis)."""
    if process_group is not None:
        return VP.softmax(logits, process_group=process_group, vocab_start=vocab_start,
                          vocab_size=vocab_size, backend=backend, num_threads=num_threads)
    return _softmax(logits, dim, False, backend, num_threads)


def log_softmax(logits: Tensor, dim: int = -1, *, backend: str = "auto",
                num_threads: int = 0, process_group: Optional[Any] = None,
                vocab_start: Optional[int] = None, vocab_size: Optional[int] = None) -> Tensor:
    """log_softmax over `dim`; as softmax. Its backward is lmloss's exact
    one (dx = dy - softmax * sum(dy), the argmax entry from the others)."""
    if process_group is not None:
        return VP.softmax(logits, log=True, process_group=process_group,
                          vocab_start=vocab_start, vocab_size=vocab_size, backend=backend,
                          num_threads=num_threads)
    return _softmax(logits, dim, True, backend, num_threads)


def _head_dtype(hidden, weight):
    """The dtype the head runs in: float32 on the CPU (its only head dtype);
    on CUDA (and for meta tensors, which describe a call: linear_plan) the
    autocast dtype when autocast is on (as the lm_head matmul would), else
    the lower precision of hidden's and weight's."""
    if hidden.device.type == "cpu":
        return torch.float32
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    dt = hidden.dtype if hidden.dtype.itemsize <= weight.dtype.itemsize else weight.dtype
    return torch.float32 if dt == torch.float64 else dt


_LIGER = ("lmloss takes (hidden [..., H], weight [V, H], target [...]), not Liger-Kernel's "
          "(weight, hidden, target) order: ")


def _check_head(hidden, weight, target):
    """The fused head's arguments in lmloss's order (hidden, weight, target),
    and a clear error for Liger-Kernel's (weight, hidden, target). Shapes
    tell them apart unless N == V; then an nn.Parameter passed as hidden
    with a non-Parameter as weight (the lm_head's weight and the
    activations, swapped) is refused too. Both on one device."""
    if weight.dim() != 2:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "weight must be [V, H], got %s"
                         % (tuple(weight.shape),))
    if weight.shape[0] == 0:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "weight %s has no classes (V = 0)"
                         % (tuple(weight.shape),))
    if hidden.dim() < 1 or weight.shape[1] != hidden.shape[-1]:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "hidden [..., H] and weight [V, H] must share "
                         "H: got hidden %s and weight %s" % (tuple(hidden.shape),
                                                              tuple(weight.shape)))
    if isinstance(hidden, torch.nn.Parameter) and not isinstance(weight, torch.nn.Parameter):
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", _LIGER + "hidden is an nn.Parameter %s and "
                         "weight an activation %s; pass hidden first"
                         % (tuple(hidden.shape), tuple(weight.shape)))
    lead = hidden.shape[:-1]
    if (isinstance(target, torch.Tensor) and target.shape[:len(lead)] != lead
            and target.shape[:1] == weight.shape[:1]):
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", _LIGER + "target %s has weight's rows %s, not "
                         "hidden's %s" % (tuple(target.shape), tuple(weight.shape),
                                          tuple(hidden.shape)))
    if hidden.device != weight.device:
        raise _lib.Error("LMLOSS_ERR_BAD_DEVICE", "hidden is on %s and weight on %s: the head "
                         "needs both on one device" % (hidden.device, weight.device))


def _head(hidden, weight, bias, target=None):
    _check_head(hidden, weight, target)
    dt = _head_dtype(hidden, weight)
    h = hidden.to(dt).reshape(-1, hidden.shape[-1])
    return h, weight.to(dt), None if bias is None else bias.to(dt)


def _empty_logits(h, w, b):
    """The [0, V] logits of a head over no rows (float32, in the graph)."""
    z = h.float() @ w.float().T
    return z if b is None else z + b.float()


def _budget(memory_budget):
    if memory_budget is None:
        return 0
    if int(memory_budget) <= 0:
        raise _bad("memory_budget must be > 0 bytes (None = the default)")
    return int(memory_budget)


def _grads_in_forward(reduction, h, w, b, main_grad=None, divisor=None):
    """The NEED_* flags of the gradients the fused head computes in its
    forward: those autograd will want, when the loss is a scalar (its
    upstream gradient then scales them; per-row losses are recomputed).
    None with main_grad and a num_items tensor: that upstream is never 1,
    and dW added at 1 would cost the backward's correction, a pass over the
    head more than computing every gradient there."""
    if (reduction == "none" or not torch.is_grad_enabled()
            or (main_grad is not None and divisor is not None)):
        return 0
    return ((L.NEED_DH if h.requires_grad else 0) | (L.NEED_DW if w.requires_grad else 0)
            | (L.NEED_DB if b is not None and b.requires_grad else 0))


def _main_grad(main_grad, weight, h):
    """main_grad checked (float32, the weight's shape and device, rows the
    C call adds to in place, never a copy; h, the head's rows, not being
    traced), or None where the weight takes no gradient."""
    if main_grad is None:
        return None
    if _tracing(h):
        raise _lib.Error("LMLOSS_ERR_UNSUPPORTED", "main_grad is eager only: a traced op "
                         "(torch.compile, torch.export, make_fx) may not write an input")
    if not isinstance(main_grad, torch.Tensor):
        raise TypeError("main_grad must be a float32 tensor shaped like the weight, got %s"
                        % type(main_grad).__name__)
    if main_grad.dtype != torch.float32:
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "main_grad must be float32 (the gradient's "
                         "running sum), got %s" % main_grad.dtype)
    if main_grad.shape != weight.shape:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "main_grad has shape %s, the weight %s"
                         % (tuple(main_grad.shape), tuple(weight.shape)))
    _same_device(main_grad, weight, "main_grad", "the weight")
    if _dlpack.torch_view(main_grad) is None:
        raise _lib.Error("LMLOSS_ERR_BAD_STRIDE", "main_grad's rows must be evenly spaced with "
                         "a contiguous last axis: the gradient is added to it in place")
    return main_grad if weight.requires_grad else None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, *,
                         bias: Optional[Tensor] = None, memory_budget: Optional[int] = None,
                         ignore_index: int = -100, label_smoothing: float = 0.0,
                         z_loss: float = 0.0, logit_scale: float = 1.0,
                         softcap: Optional[float] = None, temperature: float = 1.0,
                         token_weight: Optional[Tensor] = None,
                         class_weight: Optional[Tensor] = None, reduction: str = "mean",
                         num_items: Optional[Union[Number, Tensor]] = None, dft: bool = False,
                         shift: Union[bool, int] = 0, return_lse: bool = False,
                         return_entropy: bool = False, return_argmax: bool = False,
                         backend: str = "auto", num_threads: int = 0,
                         process_group: Optional[Any] = None, vocab_start: Optional[int] = None,
                         vocab_size: Optional[int] = None, main_grad: Optional[Tensor] = None
                         ) -> Union[Tensor, LinearCrossEntropyResult]:
    """Cross-entropy of logits = hidden [..., H] weight[V, H]^T (+ bias [V])
    against target [...], never materializing the logits: the keywords of
    lmloss.linear_cross_entropy (weight is the head, so the per-class
    weights are class_weight= [V] and the per-token ones token_weight=
    [...]). softcap None is off; shift as in cross_entropy
    (cut-cross-entropy's: hidden [..., T, H], target [..., T]).
    Differentiable w.r.t. hidden, weight and bias. Returns the loss as
    cross_entropy does, or LinearCrossEntropyResult(loss, None, None, None,
    lse, entropy, argmax) with a return_* flag.

    Dtypes: on the CPU the head runs in float32 (16-bit inputs are upcast,
    their gradients cast back by autograd); on CUDA in bf16/fp16/fp32 (the
    autocast dtype under torch.autocast), fp32-accumulated.

    Cost: a loss reduced to a scalar, with gradients enabled and hidden or
    weight requiring them, computes its gradients in this call (the
    backward only scales them), so evaluate under torch.no_grad().

    main_grad (Megatron's fused weight-gradient accumulation): a float32
    tensor shaped like weight, on its device, with contiguous rows. The
    weight's gradient of this loss is added to it (in fp32, never rounded
    to the weight's dtype) instead of reaching autograd: weight.grad is left
    as it is, unless the weight carries Megatron-core DDP's
    grad_added_to_main_grad, which is then set True with a placeholder
    gradient returned, as Megatron's own layers do. The bias's gradient
    takes autograd's path (summed in fp32, rounded once). A scalar loss
    adds dW in its forward at an upstream gradient of 1; the backward
    reads the upstream to the host, and unless it is exactly 1 adds the
    rest, (upstream - 1) x dW, with a second pass over the head (its logits
    computed again). So results are right for any upstream, and
    loss.backward() on the loss as returned costs nothing more: fold a
    scale into num_items as a number (sum / num_items, computed in the
    call) rather than multiplying the loss. A num_items tensor divides
    after the call (its upstream is never 1): there the gradients are all
    computed in the backward, at the upstream, as for reduction "none".
    A scalar loss made with gradients enabled must be backpropagated: its
    forward's addition stays in main_grad otherwise (evaluate under
    torch.no_grad()). Eager only (a traced op may not write an input), and
    not with process_group yet.

    process_group (VOCAB_PARALLEL): weight [V_r, H] and bias [V_r] are this
    rank's rows of the head, hidden the same on every rank; its gradient
    is summed over the ranks.
    """
    if process_group is not None:
        if shift or return_lse or return_entropy or return_argmax:
            raise _bad("shift and return_* are not vocab-parallel in the fused head")
        if main_grad is not None:
            raise _bad("main_grad is not supported with process_group yet")
        return VP.linear_cross_entropy(
            hidden, weight, target, process_group=process_group, bias=bias,
            vocab_start=vocab_start, vocab_size=vocab_size, memory_budget=memory_budget,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            logit_scale=logit_scale, softcap=softcap, temperature=temperature,
            token_weight=token_weight, class_weight=class_weight, reduction=reduction,
            num_items=num_items, dft=dft, backend=backend, num_threads=num_threads)
    red, items, divisor = _reduction(reduction, num_items)
    h, w, b = _head(hidden, weight, bias, target)
    main_grad = _main_grad(main_grad, weight, h)
    lead = hidden.shape[:-1]
    target = _target(target, lead, hidden, "hidden")
    s = _shift_of(shift, target.reshape(lead))
    extras = _extras_flags(return_lse, return_entropy, return_argmax)
    fopts, iopts = O.ce_args(ignore_index, label_smoothing, z_loss, logit_scale, softcap,
                             temperature, red, items, dft, backend_code(backend), num_threads)
    if h.shape[0] == 0:  # no rows: what torch gives, in the graph of hidden, weight, bias
        wz = w if main_grad is None else w.detach()  # dW = 0: main_grad is as it was
        loss, pick = _empty_rows_ce(_empty_logits(h, wz, b).sum(-1).reshape(lead), red, items,
                                    divisor, extras, s)
    else:
        target = _shifted(target.reshape(lead), s, ignore_index).reshape(-1)
        token_weight = _shifted(token_weight, s, 0.0)
        op = L.linear_cross_entropy if main_grad is None else L.MainGrad(main_grad, weight)
        out = op(h, w, b, target, _f32(token_weight), _f32(class_weight), fopts, iopts,
                 _budget(memory_budget), extras, _grads_in_forward(red, h, w, b, main_grad,
                                                                   divisor))
        loss, pick = _finish(*out[:4], lead, red, divisor, extras, s)
    return loss if pick is None else LinearCrossEntropyResult(loss, None, None, None, *pick)


def linear_plan(hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
                memory_budget: Optional[int] = None, main_grad: Optional[Tensor] = None,
                grad: bool = True, k: int = 1) -> LinearPlan:
    """What linear_cross_entropy (k = 1) or linear_log_probs (k indices a
    row) on these tensors will do and take: lmloss.linear_plan for their
    shapes and the head's dtype, which reads no data, so meta tensors
    (torch.empty(shape, dtype=..., device="meta")) describe a CUDA call
    without its memory. The dtype is the call's: float32 on the CPU, the
    autocast dtype under torch.autocast, else the lower precision of
    hidden's and weight's. grad: the gradients a training step asks
    (hidden's, weight's, bias's); main_grad: the call's main_grad, if any.
    """
    _check_head(hidden, weight, None)
    return _linear_plan(hidden.shape[:-1].numel(), weight.shape[1], weight.shape[0],
                        dtype=str(_head_dtype(hidden, weight)).replace("torch.", ""),
                        bias=bias is not None, memory_budget=memory_budget, grad=grad,
                        main_grad=main_grad is not None, k=k)


def _kept_bytes(h, w, b, idx, backend, memory_budget):
    """The workspace of the kept log-probs (L.KeptLogProbs) where they
    apply, else 0: an eager training call (the weight's gradient wanted,
    not the bias's) of a 16-bit head on CUDA with one index a row, whose
    store of all rows fits the budget."""
    if (_tracing(h) or not torch.is_grad_enabled() or not w.requires_grad or not h.is_cuda
            or (b is not None and b.requires_grad) or idx.shape[1] != 1
            or h.dtype not in (torch.bfloat16, torch.float16) or backend not in ("auto", "cuda")):
        return 0
    return L.kept_bytes(h, w, _budget(memory_budget))


def linear_log_probs(hidden: Tensor, weight: Tensor, index: Tensor, *,
                     bias: Optional[Tensor] = None, temperature: float = 1.0,
                     logit_scale: float = 1.0, softcap: Optional[float] = None,
                     mask: Optional[Tensor] = None, entropy: bool = False,
                     memory_budget: Optional[int] = None, backend: str = "auto",
                     num_threads: int = 0, process_group: Optional[Any] = None,
                     vocab_start: Optional[int] = None, vocab_size: Optional[int] = None
                     ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """log softmax(transform(hidden weight^T + bias)) gathered at index, as
    lmloss.linear_log_probs: float32 shaped like index, or (logp, entropy)
    with entropy=True; masked-out rows are never computed and read 0.
    Differentiable w.r.t. hidden, weight and bias; dtypes as
    linear_cross_entropy. process_group: as linear_cross_entropy's, one
    index a row."""
    if process_group is not None:
        return VP.linear_log_probs(
            hidden, weight, index, process_group=process_group, bias=bias,
            vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature,
            logit_scale=logit_scale, softcap=softcap, mask=mask, entropy=entropy,
            memory_budget=memory_budget, backend=backend, num_threads=num_threads)
    h, w, b = _head(hidden, weight, bias, index)
    lead = hidden.shape[:-1]
    idx, shape = _index_2d(index, lead, hidden, "hidden")
    if h.shape[0] == 0:  # no rows: empty results, in the graph
        z = _empty_logits(h, w, b).sum(-1).reshape(lead)
        logp = z if shape == lead else z[..., None].expand(shape)
        return (logp, z) if entropy else logp
    transform = (float(logit_scale), _lib.softcap_value(softcap), float(temperature))
    kept = _kept_bytes(h, w, b, idx, backend, memory_budget)
    if kept:  # the backward runs two GEMMs from what the forward kept
        logp, ent = L.KeptLogProbs.apply(h, w, b, idx, _mask(mask), transform, bool(entropy),
                                         _budget(memory_budget), backend_code(backend),
                                         int(num_threads), kept)
        logp = logp.reshape(shape)
        return (logp, ent.reshape(lead)) if entropy else logp
    # the backward then computes the logits once (lmloss_linear_log_probs' stats)
    logp, ent, _ = L.linear_log_probs(h, w, b, idx, _mask(mask), *transform,
                                      bool(entropy), _save_stats(w.shape[0], h, w, b),
                                      _budget(memory_budget), backend_code(backend),
                                      int(num_threads))
    logp = logp.reshape(shape)
    return (logp, ent.reshape(lead)) if entropy else logp
