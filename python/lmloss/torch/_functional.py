"""The public functions of lmloss.torch: keyword checks, [..., V] flattening
and dtype handling around the custom ops (pure torch code, traceable by
torch.compile without graph breaks)."""

import torch

from .. import _lib
from .._ce import CrossEntropyResult, class_weights
from .._linear import LinearCrossEntropyResult
from . import _linear_ops as L
from . import _ops as O
from ._bridge import backend_code


def _bad(msg):
    return _lib.Error("LMLOSS_ERR_BAD_OPTION", msg)


def _rows(x, name):
    """x [..., V] as 2-D [N, V] (a view when possible); float64 computed in float32."""
    if x.dim() < 1:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "%s must have at least one axis" % name)
    if x.dtype == torch.float64:
        x = x.float()
    return x.reshape(-1, x.shape[-1])


def _index(t):
    return t if t.dtype in (torch.int64, torch.int32) else t.long()


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


def _finish(loss, lse, ent, amax, lead, reduction, divisor, extras):
    if reduction == "none":
        loss = loss.reshape(lead)
    if divisor is not None:
        loss = loss / divisor.to(device=loss.device, dtype=loss.dtype)
    if not extras:
        return loss, None
    pick = [t.detach().reshape(lead) if extras & f else None
            for t, f in ((lse, O.EXTRA_LSE), (ent, O.EXTRA_ENTROPY), (amax, O.EXTRA_ARGMAX))]
    return loss, pick


def cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  logit_scale=1.0, softcap=None, temperature=1.0, weight=None,
                  token_weight=None, class_weight=None, reduction="mean", num_items=None,
                  dft=False, return_lse=False, return_entropy=False, return_argmax=False,
                  backend="auto", num_threads=0):
    """Cross-entropy of logits [..., V] against target [...]: the loss and
    keywords of lmloss.cross_entropy, differentiable w.r.t. logits.

    Returns a float32 tensor on the logits' device: [...] for "none", 0-d
    otherwise. num_items may be a number or a tensor (transformers'
    num_items_in_batch): a tensor divides the summed loss on the device,
    never read by the host. weight [V] is the per-class weight of
    F.cross_entropy (class_weight= is another name for it), token_weight
    [...] the per-token weight; neither is differentiated.
    With return_lse / return_entropy / return_argmax, returns
    CrossEntropyResult(loss, None, lse, entropy, argmax), the extras
    detached. There is no grad= keyword: use autograd.
    """
    class_weight = class_weights(weight, class_weight)
    red, items, divisor = _reduction(reduction, num_items)
    x = _rows(logits, "logits")
    lead = logits.shape[:-1]
    extras = _extras_flags(return_lse, return_entropy, return_argmax)
    fopts, iopts = O.ce_args(ignore_index, label_smoothing, z_loss, logit_scale, softcap,
                             temperature, red, items, dft, backend_code(backend), num_threads)
    out = O.cross_entropy(x, _index(target).reshape(-1), _f32(token_weight), _f32(class_weight),
                          fopts, iopts, extras)
    loss, pick = _finish(*out, lead, red, divisor, extras)
    return loss if pick is None else CrossEntropyResult(loss, None, *pick)


def _index_2d(index, lead):
    """index [...] (K = 1, squeezed result) or [..., K] as [N, K]; the result shape."""
    if index.dim() == len(lead):
        return _index(index).reshape(-1, 1), lead
    return _index(index).reshape(-1, index.shape[-1]), index.shape


def _save_stats(v, *inputs):
    """Whether a log-probs forward over rows v wide saves the rows'
    statistics for its backward: an input needs a gradient and v fits them."""
    return (torch.is_grad_enabled() and v <= _lib.STATS_MAX_V
            and any(t is not None and t.requires_grad for t in inputs))


def log_probs(logits, index, *, temperature=1.0, mask=None, entropy=False, backend="auto",
              num_threads=0):
    """log softmax(logits / temperature) gathered at index, as lmloss.log_probs:
    logits [..., V]; index [...] or [..., K]; float32 result shaped like
    index, or (logp, entropy [...]) with entropy=True. mask [...] (bool):
    masked-out rows are not read and read 0. Differentiable w.r.t. logits
    (through logp and entropy)."""
    x = _rows(logits, "logits")
    lead = logits.shape[:-1]
    idx, shape = _index_2d(index, lead)
    # the backward then reads the logits once (lmloss_log_probs' stats)
    logp, ent, _ = O.log_probs(x, idx, _mask(mask), 1.0, 0.0, float(temperature),
                               bool(entropy), _save_stats(x.shape[-1], x), backend_code(backend),
                               int(num_threads))
    logp = logp.reshape(shape)
    return (logp, ent.reshape(lead)) if entropy else logp


selective_log_softmax = log_probs


def entropy(logits, *, temperature=1.0, backend="auto", num_threads=0):
    """Entropy of softmax(logits / temperature) per row: float32 [...],
    differentiable w.r.t. logits."""
    x = _rows(logits, "logits")
    ent = O.entropy(x, 1.0, 0.0, float(temperature), backend_code(backend), int(num_threads))
    return ent.reshape(logits.shape[:-1])


def _softmax(logits, log, backend, num_threads):
    x = _rows(logits, "logits")
    y = O.softmax(x, log, backend_code(backend), int(num_threads))
    return y.reshape(logits.shape)


def softmax(logits, *, backend="auto", num_threads=0):
    """softmax over the last axis; same shape, the logits' dtype (float32 for
    float64), differentiable."""
    return _softmax(logits, False, backend, num_threads)


def log_softmax(logits, *, backend="auto", num_threads=0):
    """log_softmax over the last axis; as softmax."""
    return _softmax(logits, True, backend, num_threads)


def _head_dtype(hidden, weight):
    """The dtype the head runs in: float32 on the CPU (its only head dtype);
    on CUDA the autocast dtype when autocast is on (as the lm_head matmul
    would), else the lower precision of hidden's and weight's."""
    if hidden.device.type != "cuda":
        return torch.float32
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    dt = hidden.dtype if hidden.dtype.itemsize <= weight.dtype.itemsize else weight.dtype
    return torch.float32 if dt == torch.float64 else dt


def _head(hidden, weight, bias):
    if weight.dim() != 2:
        raise _lib.Error("LMLOSS_ERR_BAD_SHAPE", "weight must be [V, H], got %s"
                         % (tuple(weight.shape),))
    dt = _head_dtype(hidden, weight)
    h = hidden.to(dt).reshape(-1, hidden.shape[-1])
    return h, weight.to(dt), None if bias is None else bias.to(dt)


def _budget(memory_budget):
    if memory_budget is None:
        return 0
    if int(memory_budget) <= 0:
        raise _bad("memory_budget must be > 0 bytes (None = the default)")
    return int(memory_budget)


def _grads_in_forward(reduction, h, w, b):
    """The NEED_* flags of the gradients the fused head computes in its
    forward: those autograd will want, when the loss is a scalar (its
    upstream gradient then scales them; per-row losses are recomputed)."""
    if reduction == "none" or not torch.is_grad_enabled():
        return 0
    return ((L.NEED_DH if h.requires_grad else 0) | (L.NEED_DW if w.requires_grad else 0)
            | (L.NEED_DB if b is not None and b.requires_grad else 0))


def linear_cross_entropy(hidden, weight, target, *, bias=None, memory_budget=None,
                         ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_scale=1.0,
                         softcap=None, temperature=1.0, token_weight=None, class_weight=None,
                         reduction="mean", num_items=None, dft=False, return_lse=False,
                         return_entropy=False, return_argmax=False, backend="auto",
                         num_threads=0):
    """Cross-entropy of logits = hidden [..., H] weight[V, H]^T (+ bias)
    against target [...], never materializing the logits: the keywords of
    lmloss.linear_cross_entropy (per-token weights are token_weight=).
    Differentiable w.r.t. hidden, weight and bias. Returns the loss as
    cross_entropy does, or LinearCrossEntropyResult(loss, None, None, None,
    lse, entropy, argmax) with a return_* flag.

    Dtypes: on the CPU the head runs in float32 (16-bit inputs are upcast,
    their gradients cast back by autograd); on CUDA in bf16/fp16/fp32 (the
    autocast dtype under torch.autocast), fp32-accumulated.

    Cost: a loss reduced to a scalar, with gradients enabled and hidden or
    weight requiring them, computes its gradients in this call (the
    backward only scales them), so evaluate under torch.no_grad().
    """
    red, items, divisor = _reduction(reduction, num_items)
    h, w, b = _head(hidden, weight, bias)
    lead = hidden.shape[:-1]
    extras = _extras_flags(return_lse, return_entropy, return_argmax)
    fopts, iopts = O.ce_args(ignore_index, label_smoothing, z_loss, logit_scale, softcap,
                             temperature, red, items, dft, backend_code(backend), num_threads)
    out = L.linear_cross_entropy(h, w, b, _index(target).reshape(-1), _f32(token_weight),
                                 _f32(class_weight), fopts, iopts, _budget(memory_budget), extras,
                                 _grads_in_forward(red, h, w, b))
    loss, pick = _finish(*out[:4], lead, red, divisor, extras)
    return loss if pick is None else LinearCrossEntropyResult(loss, None, None, None, *pick)


def linear_log_probs(hidden, weight, index, *, bias=None, temperature=1.0, logit_scale=1.0,
                     softcap=None, mask=None, entropy=False, memory_budget=None, backend="auto",
                     num_threads=0):
    """log softmax(transform(hidden weight^T + bias)) gathered at index, as
    lmloss.linear_log_probs: float32 shaped like index, or (logp, entropy)
    with entropy=True; masked-out rows are never computed and read 0.
    Differentiable w.r.t. hidden, weight and bias; dtypes as
    linear_cross_entropy."""
    h, w, b = _head(hidden, weight, bias)
    lead = hidden.shape[:-1]
    idx, shape = _index_2d(index, lead)
    # the backward then computes the logits once (lmloss_linear_log_probs' stats)
    logp, ent, _ = L.linear_log_probs(h, w, b, idx, _mask(mask), float(logit_scale),
                                      _lib.softcap_value(softcap), float(temperature), bool(entropy),
                                      _save_stats(w.shape[0], h, w, b), _budget(memory_budget),
                                      backend_code(backend), int(num_threads))
    logp = logp.reshape(shape)
    return (logp, ent.reshape(lead)) if entropy else logp
