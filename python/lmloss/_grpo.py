"""The GRPO family of RL objectives on per-token log-probs (lmloss_grpo)."""

import collections
from typing import Optional

import numpy as np
from numpy.typing import ArrayLike

from . import _lib
from ._tensor import as_array, native, shape_error, view

GRPOResult = collections.namedtuple("GRPOResult", "loss dlogp dentropy metrics")
GRPOResult.__doc__ = """Returned by grpo_loss: loss (float); dlogp and dentropy (float32
[B, T], or None without grad=True; dentropy None without entropy);
metrics, a dict of METRIC_NAMES -> float (sums and counts over this
call's tokens: trl_metrics turns them into TRL's logged means)."""

# lmloss_grpo_metric's order
METRIC_NAMES = ("tokens", "kl", "entropy", "clip_low", "clip_high", "clip_region", "clip_count",
                "clip_low_min", "clip_high_max", "cispo_clip", "phi", "phi_count",
                "policy_loss", "bonus_entropy", "bonus_tokens")


# lmloss_grpo_options' real fields and integer fields, in the order of
# grpo_values' lists
FKEYS = ("epsilon_low", "epsilon_high", "delta", "beta", "sapo_temperature_pos",
         "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
         "vespo_lambda_neg", "off_policy_threshold", "entropy_coef", "accumulation_steps",
         "is_min", "is_max")
IKEYS = ("loss_type", "level", "bias_correction_kl", "off_policy_mask", "max_completion_length",
         "is_mode")
# TRL picks these per sequence with torch.where of two Python floats, which
# makes an fp32 tensor: its loss uses them rounded to fp32.
_FP32_KEYS = FKEYS[4:10]


def grpo_values(loss_type, importance_sampling_level, epsilon, epsilon_high, delta, beta,
                use_bias_correction_kl, sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos,
                vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, off_policy_mask_threshold,
                entropy_coef, gradient_accumulation_steps, max_completion_length,
                vllm_importance_sampling_mode, vllm_importance_sampling_clip_min,
                vllm_importance_sampling_clip_max):
    """grpo_loss's keywords (GRPOConfig's names) as (fopts, iopts), numbers
    in FKEYS' and IKEYS' order: plain Python, which torch.compile traces.
    The C library checks their ranges."""
    f = _lib.float_option
    if loss_type not in _lib.GRPO_LOSS_TYPES:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "loss_type must be one of %s, got %r"
                         % (", ".join(_lib.GRPO_LOSS_TYPES), loss_type))
    if importance_sampling_level not in _lib.GRPO_LEVELS:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "importance_sampling_level must be 'token' or "
                         "'sequence', got %r" % (importance_sampling_level,))
    if delta is not None and not f("delta", delta) > 0:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "delta must be > 0 or None, got %r" % delta)
    if vllm_importance_sampling_mode not in _lib.GRPO_IS_MODES:
        raise _lib.Error("LMLOSS_ERR_BAD_OPTION", "vllm_importance_sampling_mode must be None or "
                         "one of %s, got %r" % (", ".join(m for m in _lib.GRPO_IS_MODES if m),
                                                vllm_importance_sampling_mode))
    lo, hi = vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max
    eps = f("epsilon", epsilon)
    fopts = [eps, eps if epsilon_high is None else f("epsilon_high", epsilon_high),
             0.0 if delta is None else f("delta", delta), f("beta", beta),
             f("sapo_temperature_pos", sapo_temperature_pos),
             f("sapo_temperature_neg", sapo_temperature_neg), f("vespo_k_pos", vespo_k_pos),
             f("vespo_lambda_pos", vespo_lambda_pos), f("vespo_k_neg", vespo_k_neg),
             f("vespo_lambda_neg", vespo_lambda_neg),
             0.0 if off_policy_mask_threshold is None
             else f("off_policy_mask_threshold", off_policy_mask_threshold),
             f("entropy_coef", entropy_coef),
             f("gradient_accumulation_steps", gradient_accumulation_steps),
             -float("inf") if lo is None else f("vllm_importance_sampling_clip_min", lo),
             float("inf") if hi is None else f("vllm_importance_sampling_clip_max", hi)]
    iopts = [_lib.GRPO_LOSS_TYPES[loss_type], _lib.GRPO_LEVELS[importance_sampling_level],
             int(bool(use_bias_correction_kl)), int(off_policy_mask_threshold is not None),
             0 if max_completion_length is None
             else _lib.int64_option("max_completion_length", max_completion_length),
             _lib.GRPO_IS_MODES[vllm_importance_sampling_mode]]
    return fopts, iopts


def grpo_struct(fopts, iopts):
    """lmloss_grpo_options of grpo_values' lists (num_items: its default)."""
    opt = _lib.grpo_options_default()
    for k, v in zip(FKEYS, fopts):
        setattr(opt, k, float(np.float32(v)) if k in _FP32_KEYS else v)
    for k, v in zip(IKEYS, iopts):
        setattr(opt, k, v)
    return opt


def trl_metrics(metrics: dict, loss_type: str, beta: float) -> dict:
    """The means TRL's GRPOTrainer logs, from grpo_loss's metrics (sums and
    counts) of one process: {"kl", "entropy", "clip_ratio/low_mean", ...},
    with TRL's names, each present where TRL logs it."""
    m = metrics
    out = {}

    def mean(key, count):
        return m[key] / max(m[count], 1.0)

    if beta != 0.0:
        out["kl"] = mean("kl", "tokens")
    out["entropy"] = mean("entropy", "tokens")
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        out["clip_ratio/low_mean"] = mean("clip_low", "clip_count")
        out["clip_ratio/high_mean"] = mean("clip_high", "clip_count")
        out["clip_ratio/region_mean"] = mean("clip_region", "clip_count")
        out["clip_ratio/low_min"] = m["clip_low_min"]
        out["clip_ratio/high_max"] = m["clip_high_max"]
    elif loss_type == "cispo":
        out["cispo_clip_ratio"] = mean("cispo_clip", "clip_count")
    elif loss_type == "vespo":
        out["vespo/phi_seq_mean"] = mean("phi", "phi_count")
    return out


def _matrix(x, b, t, name, cols_one=False):
    """An F32 [B, T] input (or [B] / [B, 1] as [B, 1] where cols_one), as
    (array, tensor); None: (None, absent)."""
    if x is None:
        return None, _lib.Tensor()
    a = native(as_array(x))
    if a.dtype.kind not in "biuf":
        raise _lib.Error("LMLOSS_ERR_BAD_DTYPE", "%s must hold real numbers, got dtype %s"
                         % (name, a.dtype))
    a = np.ascontiguousarray(a, dtype=np.float32)
    if cols_one and a.shape in ((b,), (b, 1)):
        a = a.reshape(b, 1)
    elif a.shape != (b, t):
        want = "(%d, %d)%s" % (b, t, " or (%d,) / (%d, 1)" % (b, b) if cols_one else "")
        raise shape_error("%s has shape %s, expected %s" % (name, a.shape, want))
    return view(a, name=name)


def entropy_threshold(entropy, mask, top_entropy_quantile):
    """TRL's get_high_entropy_mask threshold on one process: the
    (1 - top_entropy_quantile) quantile of the fp32 entropies where mask is
    set, +inf where none is. Formed as torch.quantile forms it (the rank
    from the fp32 quantile in double, the weight rounded to fp32, then
    torch.lerp's two-sided form), so a token at the threshold falls on
    TRL's side of it."""
    e = np.sort(np.asarray(entropy, np.float32)[np.asarray(mask) != 0])
    if e.size == 0:
        return np.float32(np.inf)
    rank = float(np.float32(1.0 - top_entropy_quantile)) * (e.size - 1)
    i = int(np.floor(rank))
    w = np.float32(rank - i)
    lo, hi = e[i], e[min(i + 1, e.size - 1)]
    d = hi - lo
    return lo + w * d if w < 0.5 else hi - d * (np.float32(1) - w)


def grpo_loss(logp: ArrayLike, advantages: ArrayLike, mask: ArrayLike, *,
              old_logp: Optional[ArrayLike] = None, ref_logp: Optional[ArrayLike] = None,
              entropy: Optional[ArrayLike] = None, sampling_logp: Optional[ArrayLike] = None,
              importance_sampling_ratio: Optional[ArrayLike] = None,
              loss_type: str = "dapo", importance_sampling_level: str = "token",
              epsilon: float = 0.2, epsilon_high: Optional[float] = None,
              delta: Optional[float] = None, beta: float = 0.0,
              use_bias_correction_kl: bool = False, sapo_temperature_pos: float = 1.0,
              sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0,
              vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
              vespo_lambda_neg: float = 2.0, off_policy_mask_threshold: Optional[float] = None,
              top_entropy_quantile: float = 1.0, entropy_threshold_value: Optional[float] = None,
              entropy_coef: float = 0.0, gradient_accumulation_steps: float = 1.0,
              max_completion_length: Optional[int] = None, num_items: Optional[float] = None,
              vllm_importance_sampling_mode: Optional[str] = None,
              vllm_importance_sampling_clip_min: Optional[float] = None,
              vllm_importance_sampling_clip_max: Optional[float] = None,
              grad: bool = False, backend: str = "auto", num_threads: int = 0) -> GRPOResult:
    """TRL's GRPOTrainer loss (_compute_loss) from per-token log-probs.

    logp [B, T]: the policy's per-token log-probs (differentiated);
    advantages [B] (or [B, T]); mask [B, T] (completion mask, 0/1);
    old_logp (absent: logp, ratio 1), ref_logp (needed for beta > 0),
    entropy, sampling_logp (the off-policy mask's; absent: old_logp) [B, T];
    importance_sampling_ratio [B, T] or [B, 1] (vLLM's, as TRL's inputs
    carry it: it multiplies the per-token loss, or enters VESPO's weight).
    The other keywords are GRPOConfig's: loss_type ("grpo", "bnpo",
    "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"),
    importance_sampling_level, epsilon, epsilon_high (None: epsilon),
    delta, beta, use_bias_correction_kl, the sapo_ and vespo_ parameters,
    off_policy_mask_threshold, top_entropy_quantile (< 1: the entropy mask
    at this process's quantile; entropy_threshold_value gives the
    threshold itself, e.g. one over all processes), entropy_coef (the
    entropy bonus), gradient_accumulation_steps (TRL's
    current_gradient_accumulation_steps in training, 1 in evaluation),
    max_completion_length (dr_grpo; None: T) and num_items, the divisor of
    dapo, cispo and vespo (TRL: num_items_in_batch.clamp(min=1) /
    num_processes * accumulation / steps_per_generation; None: the
    mask's sum, at least 1). vllm_importance_sampling_mode ("token_truncate",
    "token_mask", "sequence_truncate", "sequence_mask") forms vLLM's IS
    ratio here, from old_logp - sampling_logp, as TRL forms it at
    generation (clip_min / clip_max: None is no bound); then
    importance_sampling_ratio is not given.

    Returns GRPOResult; with grad=True the gradients of the loss w.r.t.
    logp and entropy (the bonus'; the entropy mask has none). Values are
    exact where TRL's fp32 arithmetic rounds (ratios of log-probs near
    -1000, k3 of small differences). Raises lmloss.Error.
    """
    opt = grpo_struct(*grpo_values(loss_type, importance_sampling_level, epsilon, epsilon_high,
                                   delta, beta, use_bias_correction_kl, sapo_temperature_pos,
                                   sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos,
                                   vespo_k_neg, vespo_lambda_neg, off_policy_mask_threshold,
                                   entropy_coef, gradient_accumulation_steps,
                                   max_completion_length, vllm_importance_sampling_mode,
                                   vllm_importance_sampling_clip_min,
                                   vllm_importance_sampling_clip_max))
    ctx = _lib.make_context(backend, num_threads)
    lp = native(as_array(logp))
    if lp.ndim != 2:
        raise shape_error("logp must be [B, T], got shape %s" % (lp.shape,))
    b, t = lp.shape
    keep = []

    def mat(x, name, cols_one=False):
        a, tensor = _matrix(x, b, t, name, cols_one)
        keep.append(a)
        return tensor

    mask_a, mask_t = _matrix(mask, b, t, "mask")
    keep.append(mask_a)
    inputs = _lib.GRPOInputs(logp=mat(lp, "logp"), mask=mask_t,
                             advantages=mat(advantages, "advantages", True),
                             old_logp=mat(old_logp, "old_logp"),
                             ref_logp=mat(ref_logp, "ref_logp"),
                             sampling_logp=mat(sampling_logp, "sampling_logp"),
                             is_ratio=mat(importance_sampling_ratio, "importance_sampling_ratio",
                                          True),
                             entropy=mat(entropy, "entropy"))
    thr = entropy_threshold_value
    if thr is None and top_entropy_quantile < 1.0 and entropy is not None:
        thr = entropy_threshold(entropy, mask_a, top_entropy_quantile)
    if thr is not None:
        thr_a, inputs.entropy_threshold = view(np.full((1, 1), thr, np.float32))
        keep.append(thr_a)
    if num_items is None:
        num_items = max(float(np.sum(mask_a, dtype=np.float64)), 1.0)
    opt.num_items = _lib.float_option("num_items", num_items)

    loss, metrics = np.zeros((1, 1), np.float32), np.zeros((_lib.GRPO_METRICS, 1), np.float32)
    outputs = _lib.GRPOOutputs(loss=view(loss)[1], metrics=view(metrics)[1])
    dlogp = dentropy = None
    if grad:
        dlogp, outputs.dlogp = view(np.empty((b, t), np.float32))
        if entropy is not None:
            dentropy, outputs.dentropy = view(np.empty((b, t), np.float32))
    nbytes = int(_lib.grpo_workspace_size(b))
    ws = np.empty(nbytes + 64, np.uint8)
    addr = ws.ctypes.data + (-ws.ctypes.data % 64)
    _lib.check(_lib.grpo(ctx, inputs, opt, outputs, addr, nbytes))
    return GRPOResult(float(loss[0, 0]), dlogp, dentropy,
                      dict(zip(METRIC_NAMES, (float(v) for v in metrics[:, 0]))))
