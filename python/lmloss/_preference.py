"""The DPO family of preference objectives on sequence log-probs
(lmloss_preference)."""

import collections
from typing import Optional, Sequence, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _lib
from ._tensor import as_array, native, shape_error, view

DPOResult = collections.namedtuple("DPOResult", "loss dchosen drejected metrics")
KTOResult = collections.namedtuple("KTOResult", "loss dlogps metrics")
KTOResult.__doc__ = """Returned by kto_loss: loss (float); dlogps (float32 [N], or None
without grad=True); metrics, a dict of KTO_METRIC_NAMES -> float (sums)."""
KTO_METRIC_NAMES = ("chosen", "rejected", "reward_chosen", "reward_rejected", "logp_chosen",
                    "logp_rejected")
DPOResult.__doc__ = """Returned by dpo_loss: loss (float); dchosen and drejected (float32
[P], or None without grad=True); metrics, a dict of METRIC_NAMES ->
float (sums over the pairs: trl_metrics makes them TRL's logged means)."""

METRIC_NAMES = ("pairs", "reward_chosen", "reward_rejected", "accuracy", "margin", "logp_chosen",
                "logp_rejected", "orpo_log_odds")


def pref_values(loss_type, loss_weights, beta, label_smoothing, f_divergence_type,
                f_alpha_divergence_coef, discopop_tau, simpo_gamma):
    """DPOConfig's options as (fopts, f-divergence code): fopts the 15 loss
    weights (loss_type one name or TRL's list, loss_weights one each, None:
    1 each), beta, label_smoothing, f_alpha, discopop_tau, simpo_gamma.
    Plain Python, which torch.compile traces; the C library checks the
    ranges."""
    f = _lib.float_option
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(types):
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "loss_weights has %d entries for %d loss types"
                         % (len(weights), len(types)))
    per_type = [0.0] * len(_lib.PREF_TYPES)
    for t, w in zip(types, weights):
        if t not in _lib.PREF_TYPES:
            raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "loss_type must be among %s, got %r"
                             % (", ".join(_lib.PREF_TYPES), t))
        per_type[_lib.PREF_TYPES.index(t)] += f("loss_weights", w)
    if f_divergence_type not in _lib.PREF_FDIVS:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "f_divergence_type must be one of %s, got %r"
                         % (", ".join(_lib.PREF_FDIVS), f_divergence_type))
    return (per_type + [f("beta", beta), f("label_smoothing", label_smoothing),
                        f("f_alpha_divergence_coef", f_alpha_divergence_coef),
                        f("discopop_tau", discopop_tau), f("simpo_gamma", simpo_gamma)],
            _lib.PREF_FDIVS[f_divergence_type])


def pref_struct(fopts, fdiv):
    """lmloss_pref_options of pref_values' results."""
    opt = _lib.pref_options_default()
    for k in range(len(_lib.PREF_TYPES)):
        opt.loss_weights[k] = fopts[k]
    opt.beta, opt.label_smoothing, opt.f_alpha, opt.discopop_tau, opt.simpo_gamma = fopts[-5:]
    opt.f_divergence = fdiv
    return opt


def trl_metrics(metrics: dict) -> dict:
    """TRL's DPOTrainer rewards and log-prob means (one process) from
    dpo_loss's sums."""
    n = max(metrics["pairs"], 1.0)
    return {"rewards/chosen": metrics["reward_chosen"] / n,
            "rewards/rejected": metrics["reward_rejected"] / n,
            "rewards/accuracies": metrics["accuracy"] / n,
            "rewards/margins": metrics["margin"] / n,
            "logps/chosen": metrics["logp_chosen"] / n,
            "logps/rejected": metrics["logp_rejected"] / n}


def dpo_loss(chosen_logps: ArrayLike, rejected_logps: ArrayLike,
             ref_chosen_logps: Optional[ArrayLike] = None,
             ref_rejected_logps: Optional[ArrayLike] = None, *,
             loss_type: Union[str, Sequence[str]] = "sigmoid",
             loss_weights: Optional[Sequence[float]] = None, beta: float = 0.1,
             label_smoothing: float = 0.0, f_divergence_type: str = "reverse_kl",
             f_alpha_divergence_coef: float = 0.5, discopop_tau: float = 0.05,
             simpo_gamma: float = 0.5, reduction: str = "mean",
             chosen_tokens: Optional[ArrayLike] = None,
             rejected_tokens: Optional[ArrayLike] = None, weight: Optional[ArrayLike] = None,
             grad: bool = False, backend: str = "auto", num_threads: int = 0) -> DPOResult:
    """TRL's DPOTrainer loss from the policy's sequence log-prob sums of P
    chosen and rejected completions [P] and the reference's (None: 0).

    DPOConfig's options: loss_type (one of "sigmoid", "hinge", "ipo",
    "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
    "sigmoid_norm", or a list of them with loss_weights), beta,
    label_smoothing, f_divergence_type, f_alpha_divergence_coef,
    discopop_tau. Also CPOTrainer's and ORPOTrainer's (trl.experimental)
    on the policy's sums or means without a reference: "cpo_sigmoid"
    (CPO's "sigmoid"), "simpo" (with simpo_gamma), "cpo_ipo", "hinge", and
    "orpo" (minus ORPOTrainer's odds_ratio_loss), f_divergence_type
    "alphapo" with f_alpha_divergence_coef as CPO's alpha. reduction
    "none": loss is each pair's own terms [P] (every type but aot,
    aot_unpaired and sft) and the gradients are those of their sum.
    chosen_tokens, rejected_tokens [P]: the completions'
    token counts (ipo, sigmoid_norm, sft); weight [P]: each pair's (WPO's
    use_weighting: the product of its two sequences' weights).
    grad=True: the gradients w.r.t. the chosen and rejected sums. Raises
    lmloss.Error.
    """
    opt = pref_struct(*pref_values(loss_type, loss_weights, beta, label_smoothing,
                                   f_divergence_type, f_alpha_divergence_coef, discopop_tau,
                                   simpo_gamma))
    if reduction not in ("mean", "none"):
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "reduction must be 'mean' or 'none', got %r"
                         % (reduction,))
    per_pair = reduction == "none"
    if per_pair and any(opt.loss_weights[_lib.PREF_TYPES.index(t)]
                        for t in ("aot", "aot_unpaired", "sft")):
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "reduction 'none' has no per-pair value of "
                         "aot, aot_unpaired or sft")
    ctx = _lib.make_context(backend, num_threads)
    c = native(as_array(chosen_logps))
    if c.ndim != 1:
        raise shape_error("chosen_logps must be [P], got shape %s" % (c.shape,))
    n = c.shape[0]
    keep = []

    def vec(x, name):
        if x is None:
            return _lib.Tensor()
        a = np.ascontiguousarray(native(as_array(x)), dtype=np.float32)
        if a.shape != (n,):
            raise shape_error("%s has shape %s, expected (%d,)" % (name, a.shape, n))
        a, t = view(a, vector=True, name=name)
        keep.append(a)
        return t

    inputs = _lib.PrefInputs(vec(c, "chosen_logps"), vec(rejected_logps, "rejected_logps"),
                             vec(ref_chosen_logps, "ref_chosen_logps"),
                             vec(ref_rejected_logps, "ref_rejected_logps"),
                             vec(chosen_tokens, "chosen_tokens"),
                             vec(rejected_tokens, "rejected_tokens"), vec(weight, "weight"))
    loss, metrics = np.zeros((1, 1), np.float32), np.zeros((_lib.PREF_METRICS, 1), np.float32)
    outputs = _lib.PrefOutputs(loss=view(loss)[1], metrics=view(metrics)[1])
    dc = dr = None
    if grad:
        dc, outputs.dchosen = view(np.empty(n, np.float32), vector=True)
        dr, outputs.drejected = view(np.empty(n, np.float32), vector=True)
    pairs, outputs.pair_loss = view(np.empty(n, np.float32), vector=True)
    nbytes = int(_lib.pref_workspace_size(n))
    ws = np.empty(nbytes + 64, np.uint8)
    addr = ws.ctypes.data + (-ws.ctypes.data % 64)
    _lib.check(_lib.preference(ctx, inputs, opt, outputs, addr, nbytes))
    if per_pair and grad:  # the mean's gradient of pair-local terms, times P
        dc, dr = dc * np.float32(n), dr * np.float32(n)
    return DPOResult(pairs if per_pair else float(loss[0, 0]), dc, dr,
                     dict(zip(METRIC_NAMES, (float(v) for v in metrics[:, 0]))))


def kto_values(loss_type, beta, desirable_weight, undesirable_weight):
    """KTOConfig's options as (fopts [beta, desirable_weight,
    undesirable_weight], type code): plain Python, which torch.compile
    traces."""
    if loss_type not in _lib.KTO_TYPES:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "loss_type must be 'kto' or "
                         "'apo_zero_unpaired', got %r" % (loss_type,))
    f = _lib.float_option
    return ([f("beta", beta), f("desirable_weight", desirable_weight),
             f("undesirable_weight", undesirable_weight)], _lib.KTO_TYPES[loss_type])


def kto_struct(fopts, code):
    """lmloss_kto_options of kto_values' results."""
    opt = _lib.kto_options_default()
    opt.loss_type = code
    opt.beta, opt.desirable_weight, opt.undesirable_weight = fopts
    return opt


def kto_trl_metrics(metrics: dict) -> dict:
    """KTOTrainer's rewards and log-prob means (one process) from kto_loss's
    sums, each where TRL logs it."""
    out = {}
    for side in ("chosen", "rejected"):
        if metrics[side] > 0:
            out["rewards/" + side] = metrics["reward_" + side] / metrics[side]
            out["logps/" + side] = metrics["logp_" + side] / metrics[side]
    if metrics["chosen"] > 0 and metrics["rejected"] > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def kto_loss(logps: ArrayLike, ref_logps: Optional[ArrayLike], label: ArrayLike, *,
             kl: Optional[float] = None, loss_type: str = "kto", beta: float = 0.1,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0, grad: bool = False,
             backend: str = "auto", num_threads: int = 0) -> KTOResult:
    """KTOTrainer's loss from N completions' sequence log-prob sums [N], the
    reference's (None: 0) and their labels [N] (True: desirable): loss_type
    "kto" (with kl, the batch's detached KL estimate, TRL's clamped mean;
    None: 0) or "apo_zero_unpaired", beta, desirable_weight,
    undesirable_weight (KTOConfig's). The mean skips NaN losses, as TRL's
    nanmean. grad=True: the gradient w.r.t. logps. Raises lmloss.Error."""
    opt = kto_struct(*kto_values(loss_type, beta, desirable_weight, undesirable_weight))
    ctx = _lib.make_context(backend, num_threads)
    lp = native(as_array(logps))
    if lp.ndim != 1:
        raise shape_error("logps must be [N], got shape %s" % (lp.shape,))
    n = lp.shape[0]
    keep = []

    def vec(x, name, dtype=np.float32):
        if x is None:
            return _lib.Tensor()
        a = np.ascontiguousarray(native(as_array(x)), dtype=dtype)
        if a.shape != (n,) and name != "kl":
            raise shape_error("%s has shape %s, expected (%d,)" % (name, a.shape, n))
        a, t = view(a.reshape(-1), vector=True, name=name)
        keep.append(a)
        return t

    inputs = _lib.KTOInputs(vec(lp, "logps"), vec(ref_logps, "ref_logps"),
                            vec(np.asarray(label) != 0, "label", np.bool_),
                            vec(None if kl is None else np.full(1, kl, np.float32), "kl"))
    loss, metrics = np.zeros((1, 1), np.float32), np.zeros((_lib.KTO_METRICS, 1), np.float32)
    outputs = _lib.KTOOutputs(loss=view(loss)[1], metrics=view(metrics)[1])
    d = None
    if grad:
        d, outputs.dlogps = view(np.empty(n, np.float32), vector=True)
    _lib.check(_lib.kto(ctx, inputs, opt, outputs))
    return KTOResult(float(loss[0, 0]), d,
                     dict(zip(KTO_METRIC_NAMES, (float(v) for v in metrics[:6, 0]))))
