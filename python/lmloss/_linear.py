"""The fused linear head: cross-entropy, log-probs and divergences straight
from hidden states and the LM head (lmloss_linear_*), without the [N, V]
logits.

logits = hidden [..., H] x weight[V, H]^T (+ bias [V]) are formed in row
chunks whose transient buffers fit `memory_budget` bytes (None = the C
default: the fastest schedule, lmloss.h's lmloss_head_options; the
divergences' 400 MiB); rows the loss ignores (ignore_index, mask 0) never reach
a GEMM. hidden, weight and bias share one dtype: float32 (float64 is
computed in float32) on the CPU; bf16/fp16 heads need the CUDA backend
(LMLOSS_ERR_UNSUPPORTED here). Gradients come back as float32 for fp32
heads, else in the head's dtype; dhidden is shaped like hidden.
"""

import collections
import ctypes
from typing import Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _lib
from ._ce import ce_options, ce_outputs
from ._divergence import div_options, div_outputs, sides
from ._logprob import backward_args, stats_in, stats_out
from ._tensor import (Rows, absent, as_array, index_shape, matrix, native, optional_vector,
                      out_matrix, out_vector, shape_error, vector, view)

LinearCrossEntropyResult = collections.namedtuple(
    "LinearCrossEntropyResult", "loss dhidden dweight dbias lse entropy argmax")
LinearCrossEntropyResult.__doc__ = """Returned by linear_cross_entropy when a return_*
flag is set: loss as in the plain form; dhidden, dweight, dbias (None without grad=True;
dbias None without bias); lse, entropy (float32) and argmax (int64, -1 on ignored rows),
each shaped like target and None unless requested."""

LinearDivergenceResult = collections.namedtuple(
    "LinearDivergenceResult", "loss dhidden dweight dbias divergence ce entropy")
LinearDivergenceResult.__doc__ = """Returned by linear_divergence(return_parts=True): loss
as in the plain form; the student's dhidden, dweight, dbias (None without grad=True; dbias
None without student_bias); divergence D_i, ce and entropy as in lmloss.DivergenceResult."""

LinearPlan = collections.namedtuple(
    "LinearPlan", "workspace_bytes chunk_rows group_rows store_bytes accumulator_bytes "
    "logits_gemms store_in_dweight")
LinearPlan.__doc__ = """Returned by linear_plan (lmloss_linear_plan's answer): workspace_bytes,
the call's whole transient memory; chunk_rows, the rows of a logits GEMM and its row pass;
group_rows, the rows of the store's dhidden and dweight GEMMs (0: no store); store_bytes and
accumulator_bytes (dweight's fp32 sum over groups), parts of the workspace unless
store_in_dweight (1: the store lies in the 16-bit dweight's own bytes, which are written last,
from the accumulator); logits_gemms, 2 where dweight takes vocab tiles after the chunks (four
GEMMs, not three), else 1."""

_HEAD_DTYPES = {"float32": _lib.F32, "bfloat16": _lib.BF16, "float16": _lib.F16}
_NO_DATA = ctypes.create_string_buffer(1)  # what linear_plan's views point at: it reads no data


class _Head:
    """hidden [..., H], weight [V, H] and bias [V] as an lmloss_head; keeps
    the arrays the C call reads alive. who: the head's name in errors
    ("teacher_"), before "hidden" and "weight"."""

    def __init__(self, hidden, weight, bias, who=""):
        self.x = Rows(hidden, who + "hidden")
        w = np.asarray(weight)
        if w.ndim != 2:
            raise shape_error("%sweight must be [V, H], got shape %s" % (who, w.shape))
        self.w = Rows(w, who + "weight")
        self.n, self.h, self.v = self.x.n, self.x.v, w.shape[0]
        bias_t, self.b = absent(), None
        if bias is not None:
            b = native(as_array(bias))
            if b.dtype == np.float64:
                b = b.astype(np.float32)
            self.b, bias_t = vector(b, self.v, (self.v,), who + "bias", "same")
        self.t = _lib.Head(self.x.t, self.w.t, bias_t)

    def grads(self, dhidden=True, dweight=True, dbias=True, main_grad=None):
        """New gradient arrays (dbias only with a bias) and their
        lmloss_head_grads. With main_grad (accumulate), dweight is added to
        it (None here) and dbias is a float32 sum from 0."""
        dh, dh_t = self.x.empty(self.x.out_dtype()) if dhidden else (None, absent())
        if main_grad is not None:
            dw, dw_t = None, self.main_grad(main_grad)
        else:
            dw, dw_t = self.w.empty(self.w.out_dtype()) if dweight else (None, absent())
        db, db_t = None, absent()
        if dbias and self.b is not None:
            db, db_t = out_vector(self.v, self.w.out_dtype()) if main_grad is None else \
                view(np.zeros(self.v, np.float32), vector=True)
        if dh is not None:
            dh = dh.reshape(self.x.lead + (self.h,))
        return (dh, dw, db), _lib.HeadGrads(dh_t, dw_t, db_t, int(main_grad is not None))

    def main_grad(self, main_grad):
        """main_grad's tensor: a writable float32 [V, H] array (or host
        tensor) whose rows the call adds to in place, never in a copy."""
        if not isinstance(main_grad, np.ndarray) and not hasattr(main_grad, "__dlpack__"):
            raise TypeError("main_grad must be a float32 [V, H] array, got %s"
                            % type(main_grad).__name__)
        m = as_array(main_grad)
        if m.dtype != np.float32:
            raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "main_grad must be float32 (native byte "
                             "order), got %s" % m.dtype)
        if m.shape != (self.v, self.h):
            raise shape_error("main_grad has shape %s, the weight %s" % (m.shape,
                                                                         (self.v, self.h)))
        arr, t = view(m, name="main_grad")
        if arr is not m or not m.flags.writeable:
            raise _lib.Error("LMLOSS_ERR_BAD_STRIDE", "main_grad must be writable with evenly "
                             "spaced rows and a contiguous last axis: the gradient is added "
                             "to it in place")
        return t


def _options(memory_budget):
    hopt = _lib.head_options_default()
    if memory_budget is not None:
        if int(memory_budget) <= 0:
            raise _lib.Error("LMLOSS_ERR_BAD_OPTION",
                             "memory_budget must be > 0 bytes (None = the default)")
        hopt.memory_budget = int(memory_budget)
    return hopt


def _workspace(size_fn, *args):
    """A workspace of the size size_fn(*args, &bytes) gives (an
    lmloss_linear_*workspace_size), 256-byte aligned."""
    size = ctypes.c_size_t(0)
    _lib.check(size_fn(*args, ctypes.byref(size)))
    buf = np.empty(size.value + 256, dtype=np.uint8)
    off = -buf.ctypes.data % 256
    return buf, buf.ctypes.data + off, size.value


def linear_cross_entropy(hidden: ArrayLike, weight: ArrayLike, target: ArrayLike, *,
                         bias: Optional[ArrayLike] = None, memory_budget: Optional[int] = None,
                         ignore_index: int = -100, label_smoothing: float = 0.0,
                         z_loss: float = 0.0, logit_scale: float = 1.0,
                         softcap: Optional[float] = None, temperature: float = 1.0,
                         token_weight: Optional[ArrayLike] = None,
                         class_weight: Optional[ArrayLike] = None, reduction: str = "mean",
                         num_items: Optional[float] = None, dft: bool = False,
                         grad: bool = False, return_lse: bool = False,
                         return_entropy: bool = False, return_argmax: bool = False,
                         backend: str = "auto", num_threads: int = 0,
                         main_grad: Optional[np.ndarray] = None
                         ) -> Union[float, np.ndarray, tuple, "LinearCrossEntropyResult"]:
    """Cross-entropy of logits = hidden [..., H] weight[V, H]^T (+ bias [V])
    against target [...], never holding the logits whole.

    The loss and every option are those of lmloss.cross_entropy, with one
    rename: the per-token weights are `token_weight` ([...], float32), since
    `weight` is the head here. grad=True returns (loss, dhidden, dweight,
    dbias): the gradients of the returned loss (for "none", of its sum),
    computed in the same pass; dbias is None without bias. With any return_*
    flag set, returns LinearCrossEntropyResult instead. memory_budget: a bound
    on the call's workspace in bytes (None = the fastest schedule:
    linear_plan says which and how many bytes); too small for one row raises
    LMLOSS_ERR_WORKSPACE_TOO_SMALL. Raises lmloss.Error.

    main_grad (with grad=True): a float32 [V, H] array, writable, with
    evenly spaced rows (C-contiguous, say), to which dweight is added in
    place (lmloss_head_grads.accumulate: a training loop's running fp32
    sum, Megatron's main_grad); the returned dweight is then None, so that
    nothing adds it twice. dbias is returned as usual (float32).
    """
    if main_grad is not None and not grad:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "main_grad needs grad=True")
    opt = ce_options(ignore_index, label_smoothing, z_loss, logit_scale, softcap, temperature,
                     reduction, num_items, dft)
    ctx = _lib.make_context(backend, num_threads)
    head, hopt = _Head(hidden, weight, bias), _options(memory_budget)
    n, lead, keep = head.n, head.x.lead, []
    target_t = optional_vector(target, n, lead, "target", "index", keep)
    tw_t = optional_vector(token_weight, n, lead, "token_weight", "f32", keep)
    cw_t = optional_vector(class_weight, head.v, (head.v,), "class_weight", "f32", keep)
    loss, outputs, extra = ce_outputs(n, reduction, return_lse, return_entropy, return_argmax)
    (dh, dw, db), grads = head.grads(main_grad=main_grad) if grad else \
        ((None, None, None), None)
    ws, ws_ptr, ws_bytes = _workspace(_lib.linear_workspace_size, head.t, hopt, grads, 1)
    _lib.check(_lib.linear_cross_entropy(ctx, head.t, target_t, tw_t, cw_t, opt, hopt, outputs,
                                         grads, ws_ptr, ws_bytes))
    loss = loss.reshape(lead) if reduction == "none" else float(loss[0])
    if extra:
        extra = {k: v.reshape(lead) for k, v in extra.items()}
        return LinearCrossEntropyResult(loss, dh, dw, db, extra.get("lse"),
                                        extra.get("entropy"), extra.get("argmax"))
    return (loss, dh, dw, db) if grad else loss


def linear_plan(rows: int, hidden_size: int, vocab_size: int, *,
                dtype: Union[str, np.dtype, type] = "float32", bias: bool = False,
                memory_budget: Optional[int] = None, grad: bool = True, main_grad: bool = False,
                k: int = 1) -> LinearPlan:
    """What a fused-head call over hidden [rows, hidden_size] and weight
    [vocab_size, hidden_size] will do and take: lmloss_linear_plan's
    schedule and bytes as a LinearPlan, from the shapes alone (no data;
    docs/design.md section 4, item 4, tabulates them for a large head).

    dtype: the head's, "float32", "bfloat16" or "float16" (or the NumPy
    dtype); 16-bit heads run on CUDA only, but their plan is asked here
    too. grad: the call computes dhidden, dweight and dbias (with bias) in
    the head's dtype, as a training step does; main_grad: dweight is a
    float32 main_grad added to (and dbias float32), as linear_cross_entropy's
    main_grad= asks. k: indices a row (linear_log_probs; 1 for
    cross-entropy). memory_budget as in linear_cross_entropy.
    """
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _HEAD_DTYPES:
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "dtype must be one of %s, got %r"
                         % (sorted(_HEAD_DTYPES), dtype))
    code, f32, data = _HEAD_DTYPES[name], _lib.F32, ctypes.addressof(_NO_DATA)
    n, h, v = int(rows), int(hidden_size), int(vocab_size)

    def t(r, c, dt=code):
        return _lib.Tensor(data, dt, _lib.CPU_DEVICE, r, c, c)
    head = _lib.Head(t(n, h), t(v, h), t(v, 1) if bias else absent())
    grads = None
    if grad:
        grads = _lib.HeadGrads(t(n, h), t(v, h, f32 if main_grad else code),
                               t(v, 1, f32 if main_grad else code) if bias else absent(),
                               int(bool(main_grad)))
    p = _lib.HeadPlan()
    _lib.check(_lib.linear_plan(head, _options(memory_budget), grads, int(k), ctypes.byref(p)))
    return LinearPlan(*(getattr(p, f) for f in LinearPlan._fields))


def linear_log_probs(hidden: ArrayLike, weight: ArrayLike, index: ArrayLike, *,
                     bias: Optional[ArrayLike] = None, temperature: float = 1.0,
                     logit_scale: float = 1.0, softcap: Optional[float] = None,
                     mask: Optional[ArrayLike] = None, entropy: bool = False,
                     stats: bool = False, memory_budget: Optional[int] = None,
                     backend: str = "auto", num_threads: int = 0
                     ) -> Union[np.ndarray, Tuple[np.ndarray, ...]]:
    """log softmax(transform(logits)) gathered at index, logits = hidden
    [..., H] weight[V, H]^T (+ bias [V]); transform as in cross_entropy
    (logit_scale, then softcap, then temperature).

    index [...] or [..., K] int64/int32 with 0 <= index < V. Returns float32
    shaped like index, or (logp, entropy) with entropy=True (float32 [...]).
    mask: optional bool/uint8 [...]; masked-out rows (0) are never computed
    and read 0. stats=True appends the rows' statistics (float32 [..., 4],
    V <= 2^24) for linear_log_probs_backward. memory_budget as in
    linear_cross_entropy.
    """
    ctx = _lib.make_context(backend, num_threads)
    head, hopt = _Head(hidden, weight, bias), _options(memory_budget)
    k, shape = index_shape(head.x, index)
    idx, idx_t = matrix(index, head.n, k, "index", "index")
    keep = [idx]
    mask_t = optional_vector(mask, head.n, head.x.lead, "mask", "mask", keep)
    logp, logp_t = out_matrix(head.n, k)
    ent, ent_t = out_vector(head.n) if entropy else (None, None)
    st, st_t = stats_out(head.n) if stats else (None, None)
    tr = _lib.make_transform(logit_scale, softcap, temperature)
    ws, ws_ptr, ws_bytes = _workspace(_lib.linear_workspace_size, head.t, hopt, None, int(k))
    _lib.check(_lib.linear_log_probs(ctx, head.t, idx_t, mask_t, tr, hopt, logp_t, ent_t, st_t,
                                     ws_ptr, ws_bytes))
    out = (logp.reshape(shape),) + ((ent.reshape(head.x.lead),) if entropy else ())
    out += (st.reshape(head.x.lead + (_lib.ROW_STATS,)),) if stats else ()
    return out if len(out) > 1 else out[0]


def linear_log_probs_backward(hidden: ArrayLike, weight: ArrayLike, index: Optional[ArrayLike],
                              dlogp: Optional[ArrayLike], dentropy: Optional[ArrayLike] = None,
                              *, bias: Optional[ArrayLike] = None, temperature: float = 1.0,
                              logit_scale: float = 1.0, softcap: Optional[float] = None,
                              mask: Optional[ArrayLike] = None, stats: Optional[ArrayLike] = None,
                              memory_budget: Optional[int] = None, backend: str = "auto",
                              num_threads: int = 0
                              ) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """Gradients of sum(dlogp * logp) + sum(dentropy * entropy) of
    linear_log_probs: returns (dhidden, dweight, dbias), dbias None without
    bias. dlogp (shaped like index) may be None when dentropy ([...]) is
    given; index may then be None too. Logits recomputed chunk by chunk.
    stats: what linear_log_probs(stats=True) returned for this head, mask
    and transform; lmloss.h says where they save work (16-bit heads on
    CUDA), or None.
    """
    ctx = _lib.make_context(backend, num_threads)
    head, hopt = _Head(hidden, weight, bias), _options(memory_budget)
    keep, idx_t, dlogp_t, dent_t, k = backward_args(head.x, head.n, index, dlogp, dentropy)
    mask_t = optional_vector(mask, head.n, head.x.lead, "mask", "mask", keep)
    st_t = stats_in(stats, head.x, keep)
    tr = _lib.make_transform(logit_scale, softcap, temperature)
    (dh, dw, db), grads = head.grads()
    ws, ws_ptr, ws_bytes = _workspace(_lib.linear_workspace_size, head.t, hopt, grads, int(k))
    _lib.check(_lib.linear_log_probs_backward(ctx, head.t, idx_t, mask_t, tr, hopt, dlogp_t,
                                              dent_t, st_t, grads, ws_ptr, ws_bytes))
    return dh, dw, db


def linear_divergence(student_hidden: ArrayLike, student_weight: ArrayLike,
                      teacher_hidden: ArrayLike, teacher_weight: ArrayLike, *,
                      student_bias: Optional[ArrayLike] = None,
                      teacher_bias: Optional[ArrayLike] = None, kind: str = "kl",
                      beta: float = 0.5, labels: Optional[ArrayLike] = None,
                      ignore_index: int = -100, temperature: float = 1.0,
                      teacher_temperature: Optional[float] = None, logit_scale: float = 1.0,
                      teacher_logit_scale: Optional[float] = None,
                      softcap: Optional[float] = None, teacher_softcap: Optional[float] = None,
                      soft_weight: float = 1.0, hard_weight: float = 0.0,
                      reduction: str = "mean", num_items: Optional[float] = None,
                      grad: bool = False, return_parts: bool = False,
                      memory_budget: Optional[int] = None, backend: str = "auto",
                      num_threads: int = 0
                      ) -> Union[float, np.ndarray, tuple, "LinearDivergenceResult"]:
    """lmloss.divergence of the student's logits student_hidden [..., Hs]
    student_weight[V, Hs]^T (+ student_bias [V]) from the teacher's
    teacher_hidden [..., Ht] teacher_weight[V, Ht]^T (+ teacher_bias [V]),
    never holding either [N, V] whole: the two heads share the rows and V,
    each has its own H.

    Every keyword is lmloss.divergence's (labels [...]: rows equal to
    ignore_index never reach a GEMM). grad=True returns (loss, dhidden,
    dweight, dbias): the student's gradients of the returned loss (for
    "none", of its sum), computed in the same pass, float32; dbias None
    without student_bias. The teacher is not differentiated. return_parts
    returns LinearDivergenceResult. memory_budget as in
    linear_cross_entropy. float32 heads (float64 computed in float32);
    bf16/fp16 heads raise LMLOSS_ERR_UNSUPPORTED. Raises lmloss.Error.
    """
    opt = div_options(kind, beta, ignore_index,
                      *sides(logit_scale, softcap, temperature, teacher_logit_scale,
                             teacher_softcap, teacher_temperature),
                      soft_weight, hard_weight, reduction, num_items)
    ctx = _lib.make_context(backend, num_threads)
    s = _Head(student_hidden, student_weight, student_bias, "student_")
    t = _Head(teacher_hidden, teacher_weight, teacher_bias, "teacher_")
    if t.x.lead != s.x.lead:
        raise shape_error("teacher_hidden has rows %s, student_hidden %s"
                          % (t.x.lead, s.x.lead))
    hopt, n, lead, keep = _options(memory_budget), s.n, s.x.lead, []
    label_t = optional_vector(labels, n, lead, "labels", "index", keep)
    loss, outputs, (div, ce, ent) = div_outputs(n, reduction, return_parts, labels)
    (dh, dw, db), grads = s.grads() if grad else ((None, None, None), None)
    ws, ws_ptr, ws_bytes = _workspace(_lib.linear_divergence_workspace_size, s.t, t.t, hopt)
    _lib.check(_lib.linear_divergence(ctx, s.t, t.t, label_t, opt, hopt, outputs, grads, ws_ptr,
                                      ws_bytes))
    loss = loss.reshape(lead) if reduction == "none" else float(loss[0])
    if return_parts:
        return LinearDivergenceResult(loss, dh, dw, db, div.reshape(lead),
                                      None if ce is None else ce.reshape(lead),
                                      ent.reshape(lead))
    return (loss, dh, dw, db) if grad else loss


LinearDPOResult = collections.namedtuple(
    "LinearDPOResult", "loss dhidden dweight chosen_logps rejected_logps metrics")
LinearDPOResult.__doc__ = """Returned by linear_dpo_loss: loss (float); dhidden and
dweight (None without grad=True); chosen_logps and rejected_logps (float32 [P]), the
policy's sequence sums (means with average_log_prob); metrics, a dict as dpo_loss's."""


def linear_dpo_loss(hidden: ArrayLike, weight: ArrayLike, index: ArrayLike,
                    mask: Optional[ArrayLike] = None,
                    ref_chosen_logps: Optional[ArrayLike] = None,
                    ref_rejected_logps: Optional[ArrayLike] = None, *,
                    loss_type: Union[str, Sequence[str]] = "sigmoid",
                    loss_weights: Optional[Sequence[float]] = None, beta: float = 0.1,
                    label_smoothing: float = 0.0, f_divergence_type: str = "reverse_kl",
                    f_alpha_divergence_coef: float = 0.5, discopop_tau: float = 0.05,
                    simpo_gamma: float = 0.5, weight_per_pair: Optional[ArrayLike] = None,
                    average_log_prob: bool = False, grad: bool = False,
                    memory_budget: Optional[int] = None,
                    backend: str = "auto", num_threads: int = 0) -> LinearDPOResult:
    """TRL's DPOTrainer loss (dpo_loss's options; the mean over pairs)
    through the fused head: hidden [2P, T, H] of the concatenated batch
    (the P chosen completions first, then the P rejected), weight [V, H],
    index [2P, T] the tokens each position predicts, mask [2P, T] the ones
    that count, ref_*_logps [P] the reference's sums, weight_per_pair [P]
    (WPO); average_log_prob: sequences' means in place of their sums
    (CPO's and ORPO's). The head runs three GEMMs, a group of whole pairs
    at a time, within memory_budget (lmloss_linear_preference); grad=True
    returns the gradients of hidden and weight. Raises lmloss.Error (UNSUPPORTED where
    no group of one pair fits the budget, or of every pair for aot,
    aot_unpaired and sft)."""
    from ._preference import METRIC_NAMES, pref_struct, pref_values
    opt = pref_struct(*pref_values(loss_type, loss_weights, beta, label_smoothing,
                                   f_divergence_type, f_alpha_divergence_coef, discopop_tau,
                                   simpo_gamma))
    idx = native(as_array(index))
    if idx.ndim != 2 or idx.shape[0] % 2:
        raise shape_error("index must be [2P, T] (the chosen, then the rejected), got shape %s"
                          % (idx.shape,))
    p = idx.shape[0] // 2
    ctx = _lib.make_context(backend, num_threads)
    head, hopt = _Head(hidden, weight, None), _options(memory_budget)
    if head.x.lead != idx.shape:
        raise shape_error("hidden %s and index %s disagree" % (head.x.lead, idx.shape))
    n, lead, keep = head.n, head.x.lead, []
    idx_t = optional_vector(idx, n, lead, "index", "index", keep)
    mask_t = optional_vector(mask, n, lead, "mask", "mask", keep)
    pairs = (p,)
    ins = _lib.LinearPrefInputs(p, optional_vector(ref_chosen_logps, p, pairs, "ref_chosen_logps",
                                                   "f32", keep),
                                optional_vector(ref_rejected_logps, p, pairs,
                                                "ref_rejected_logps", "f32", keep),
                                optional_vector(weight_per_pair, p, pairs, "weight_per_pair",
                                                "f32", keep), int(bool(average_log_prob)))
    loss, loss_t = out_vector(1)
    metrics, metrics_t = out_vector(_lib.PREF_METRICS)
    chosen, chosen_t = out_vector(p)
    rejected, rejected_t = out_vector(p)
    outs = _lib.LinearPrefOutputs(loss=loss_t, metrics=metrics_t, chosen=chosen_t,
                                  rejected=rejected_t)
    (dh, dw, _), grads = head.grads(dbias=False) if grad else ((None, None, None), None)
    ws, ws_ptr, ws_bytes = _workspace(_lib.linear_preference_size, head.t, hopt, grads, p, opt)
    if ws_bytes == 0:
        raise _lib.Error("LMLOSS_ERR_UNSUPPORTED", "linear_dpo_loss: no group of pairs fits "
                         "memory_budget (raise it, or use linear_log_probs and dpo_loss)")
    _lib.check(_lib.linear_preference(ctx, head.t, idx_t, mask_t, _lib.transform_default(), hopt,
                                      ins, opt, outs, grads, ws_ptr, ws_bytes))
    return LinearDPOResult(float(loss[0]), dh, dw, chosen, rejected,
                           dict(zip(METRIC_NAMES, (float(v) for v in metrics))))
