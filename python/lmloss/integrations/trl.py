"""lmloss in TRL (opt-in; TRL itself is optional).

selective_log_softmax(logits, index, temperature=1.0, row_mask=None) and
entropy_from_logits(logits, chunk_size=128) are lmloss.torch's, which have
the signatures and results of trl.trainer.utils' functions (the result in
the logits' dtype; values from lmloss's fp32-accumulated, collapse-exact
kernels, one C call for any [..., V], e.g. the padding-free packed GRPO
logits [total_nnz, V]).
ChunkedLogProbFunction stands in for TRL's fused LM head kernel behind
add_fused_lm_head (SFT's and GRPO's loss): per-token log-probs, entropy and
is_top1 from lmloss's fused head, never materializing the logits.
generalized_jsd_loss is GKDTrainer.generalized_jsd_loss (TRL's GKD
distillation loss) through lmloss.torch.generalized_jsd. grpo_compute_loss
is GRPOTrainer._compute_loss (its loss, gradient and logged metrics, every
GRPOConfig option) through lmloss.torch.grpo_loss.

enable(module=None) / disable(module=None): patch (and restore) those names
in `module`, by default trl.trainer.utils together with every imported trl
module that imported them by name (e.g. trl.trainer.grpo_trainer), and
GKDTrainer.generalized_jsd_loss where TRL has that trainer
(trl.experimental.gkd), and GRPOTrainer._compute_loss.
"""

import sys
import types
import warnings
from typing import Any, List, Optional, Sequence

from .. import torch as lt

_saved = {}  # (module name, attribute) -> original


selective_log_softmax = lt.selective_log_softmax
entropy_from_logits = lt.entropy_from_logits


class ChunkedLogProbFunction:
    """TRL's fused LM head (trl.kernels.ChunkedLogProbFunction) through lmloss:
    apply(hidden [N, H], weight [V, H], bias, targets [N], temperature,
    chunk_size, final_logit_softcapping=None, logit_scale=1.0, outputs=...)
    -> (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1). lmloss
    computes log_probs (differentiable), entropy (differentiable unless
    is_top1 is also requested, then detached) and is_top1; a call asking for
    log_sum_sq_probs or mean_logits goes to TRL's original."""

    original = None

    @classmethod
    def apply(cls, hidden: Any, weight: Any, bias: Any, targets: Any, temperature: float,
              chunk_size: int, final_logit_softcapping: Optional[float] = None,
              logit_scale: float = 1.0,
              outputs: Sequence[str] = ("log_probs", "entropy", "is_top1")) -> tuple:
        """TRL's ChunkedLogProbFunction.apply (the class docstring): hidden
        [N, H] and weight [V, H] (bias [V] or None) in one float dtype,
        targets [N] int64; returns float32 [N] log_probs and entropy (or
        None) and bool [N] is_top1 (or None)."""
        if {"log_sum_sq_probs", "mean_logits"} & set(outputs) and cls.original is not None:
            return cls.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                      final_logit_softcapping, logit_scale, outputs)
        kw = dict(bias=bias, temperature=temperature, logit_scale=logit_scale,
                  softcap=final_logit_softcapping)
        want_entropy = "entropy" in outputs
        if "is_top1" in outputs:
            r = lt.linear_cross_entropy(hidden, weight, targets, reduction="none",
                                        return_entropy=want_entropy, return_argmax=True, **kw)
            return -r.loss, r.entropy, None, None, r.argmax == targets
        logp, ent = lt.linear_log_probs(hidden, weight, targets, entropy=True, **kw)
        return logp, (ent if want_entropy else None), None, None, None


def _gkd_trainer():
    """TRL's GKDTrainer, or None where TRL or that module is absent. The
    import keeps trl.experimental's import warning quiet: enable() is not
    the user choosing an experimental API."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
        try:
            from trl.experimental.gkd.gkd_trainer import GKDTrainer
        except ImportError:
            return None
    return GKDTrainer


_JSD_KEY = ("trl.experimental.gkd.gkd_trainer.GKDTrainer", "generalized_jsd_loss")
_JSD_REDUCTIONS = ("batchmean", "sum", "mean")  # TRL's others return its [..., V] terms


def _trl_jsd():
    """TRL's own generalized_jsd_loss (the one enable() replaced, if it did)."""
    if _JSD_KEY in _saved:
        return _saved[_JSD_KEY][1].__func__
    cls = _gkd_trainer()
    if cls is None:
        raise ImportError("lmloss: this call needs TRL's generalized_jsd_loss (reduction "
                          "'none') and trl.experimental.gkd is not importable")
    return cls.generalized_jsd_loss


def generalized_jsd_loss(student_logits: Any, teacher_logits: Any, labels: Any = None,
                         beta: float = 0.5, temperature: float = 1.0,
                         reduction: str = "batchmean", num_items_in_batch: Any = None) -> Any:
    """GKDTrainer.generalized_jsd_loss (a staticmethod there) through
    lmloss.torch.generalized_jsd: its signature and results, as a float32
    tensor (TRL's is in the logits' dtype), exact on identical and
    confident rows where TRL's difference of log-softmaxes cancels.
    student_logits, teacher_logits [B, T, V] (any [..., V]); labels
    [B, T], -100 dropped. Reduction "none" goes to TRL's original (TRL
    returns the elementwise [..., V] terms, lmloss forms rows)."""
    if num_items_in_batch is None and reduction not in _JSD_REDUCTIONS:
        return _trl_jsd()(student_logits, teacher_logits, labels, beta, temperature, reduction,
                          num_items_in_batch)
    return lt.generalized_jsd(student_logits, teacher_logits, labels, beta, temperature,
                              reduction, num_items_in_batch)


_JSD_STATIC = staticmethod(generalized_jsd_loss)


def _patch_gkd():
    """GKDTrainer.generalized_jsd_loss -> generalized_jsd_loss where TRL has
    the trainer; its own staticmethod is saved for disable()."""
    cls = _gkd_trainer()
    old = None if cls is None else vars(cls).get("generalized_jsd_loss")
    if not isinstance(old, staticmethod) or old is _JSD_STATIC:  # absent, or TRL changed it
        return
    _saved[_JSD_KEY] = (cls, old)
    cls.generalized_jsd_loss = _JSD_STATIC


def _grpo_trainer():
    """TRL's GRPOTrainer, or None where TRL or its _compute_loss is absent."""
    try:
        from trl.trainer.grpo_trainer import GRPOTrainer
    except ImportError:
        return None
    return GRPOTrainer if "_compute_loss" in vars(GRPOTrainer) else None


_GRPO_KEY = ("trl.trainer.grpo_trainer.GRPOTrainer", "_compute_loss")
_MODEL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                 "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                 "mm_token_type_ids", "image_position_ids")
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_BY_ITEMS = ("dapo", "cispo", "vespo")


def _grpo_entropy_threshold(self, entropies, mask):
    """TRL's high-entropy threshold over every process's masked entropies:
    on one process on the device (no host sync), else gathered as TRL
    gathers them. NaN (no token kept) where no process has a token."""
    q = 1.0 - self.top_entropy_quantile
    if self.accelerator.num_processes == 1:
        return lt._grpo.high_entropy_threshold(entropies, mask, self.top_entropy_quantile)
    import torch

    pad = -1e9  # entropies are never negative
    local = entropies.detach()[mask.bool()].float()
    gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0,
                                                                             pad_index=pad))
    gathered = gathered[gathered != pad]
    if gathered.numel() == 0:
        return torch.full((), float("nan"), device=entropies.device)
    return torch.quantile(gathered, q)


def _grpo_log_metrics(self, mode, metrics, loss_type, bonus):
    """What TRL's _compute_loss logs, from lmloss's sums and counts: the
    sums reduced over processes before dividing, the per-sequence extremes
    gathered."""
    import torch

    acc = self.accelerator
    log = self._metrics[mode]
    idx = {n: i for i, n in enumerate(lt._grpo.METRIC_NAMES)}

    def mean(key, count):
        tot = acc.reduce(torch.stack([metrics[idx[key]], metrics[idx[count]]]), reduction="sum")
        return (tot[0] / tot[1].clamp(min=1.0)).item()

    def gathered(key, fn):
        g = acc.gather(metrics[idx[key]:idx[key] + 1])
        g = g[~torch.isnan(g)]
        return float("nan") if g.numel() == 0 else fn(g).item()

    if bonus:
        log["policy_loss"].append(acc.gather(metrics[idx["policy_loss"]]).nanmean().item())
    if self.beta != 0.0:
        log["kl"].append(mean("kl", "tokens"))
    log["entropy"].append(mean("entropy", "tokens"))
    if loss_type in _CLIPPED:
        log["clip_ratio/low_mean"].append(mean("clip_low", "clip_count"))
        log["clip_ratio/high_mean"].append(mean("clip_high", "clip_count"))
        log["clip_ratio/region_mean"].append(mean("clip_region", "clip_count"))
        log["clip_ratio/low_min"].append(gathered("clip_low_min", torch.min))
        log["clip_ratio/high_max"].append(gathered("clip_high_max", torch.max))
    elif loss_type == "cispo":
        log["cispo_clip_ratio"].append(mean("cispo_clip", "clip_count"))
    elif loss_type == "vespo":
        log["vespo/phi_seq_mean"].append(mean("phi", "phi_count"))


def _grpo_adaptive_entropy(self, mode, metrics):
    """TRL's adaptive entropy controller: the window's [entropy sum, tokens]
    of the bonus' tokens, and at an optimizer step the coefficient's
    update from their mean over processes."""
    idx = lt._grpo.METRIC_NAMES
    stats = metrics[[idx.index("bonus_entropy"), idx.index("bonus_tokens")]].detach()
    if self.use_adaptive_entropy and mode == "train":
        w = self._entropy_window_stats
        self._entropy_window_stats = stats if w is None else w + stats
        if self.accelerator.sync_gradients:
            tot = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
            world = (tot[0] / tot[1].clamp(min=1.0)).item()
            a = self.args
            if world <= a.entropy_target:
                self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta,
                                        a.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta,
                                        a.entropy_coef_min)
            self._last_world_entropy = world
            self._entropy_window_stats = None
    if mode == "train" and self.accelerator.sync_gradients:
        self._metrics[mode]["entropy_coef"].append(self.entropy_coef)


def grpo_compute_loss(self: Any, model: Any, inputs: dict) -> Any:
    """GRPOTrainer._compute_loss through lmloss.torch.grpo_loss: the same
    loss, gradient and logged metrics for every GRPOConfig option (entropy
    and off-policy masks, the entropy bonus and its adaptive controller,
    vLLM's IS correction, every loss type's normalizer across processes),
    with the ratio and k3 formed exactly and the metrics from one pass."""
    import torch

    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
        model, torch.cat([prompt_ids, completion_ids], dim=1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
        completion_ids.size(1), compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
        **{k: inputs.get(k) for k in _MODEL_INPUTS})
    mode = "train" if self.model.training else "eval"
    train = mode == "train"
    loss_type, args = self.loss_type, self.args
    accum = self.current_gradient_accumulation_steps if train else 1.0
    old = inputs.get("old_per_token_logps")
    if loss_type in _BY_ITEMS:
        items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if train:
            items = items * self.current_gradient_accumulation_steps / args.steps_per_generation
    else:
        items = 1.0
    is_ratio = None
    if loss_type == "vespo" or (self.use_vllm and self.vllm_importance_sampling_correction):
        is_ratio = inputs.get("importance_sampling_ratio")
    threshold = None
    if self.top_entropy_quantile < 1.0:
        threshold = _grpo_entropy_threshold(self, entropies, mask)
    bonus = self._entropy_bonus_enabled
    coef = 0.0
    if bonus:
        coef = self.entropy_coef
        if self.use_adaptive_entropy and self._last_world_entropy > args.entropy_target:
            coef = 0.0
    off = self.off_policy_mask_threshold
    loss, metrics = lt.grpo_loss(
        logps, inputs["advantages"], mask, old, inputs["ref_per_token_logps"] if self.beta != 0.0
        else None, entropies, inputs.get("sampling_per_token_logps", old) if off is not None
        else None, is_ratio, loss_type=loss_type,
        importance_sampling_level=self.importance_sampling_level, epsilon=self.epsilon_low,
        epsilon_high=self.epsilon_high, delta=args.delta, beta=self.beta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg, off_policy_mask_threshold=off,
        entropy_threshold=threshold, entropy_coef=coef, gradient_accumulation_steps=accum,
        max_completion_length=self.max_completion_length, num_items=items,
        return_metrics=True)
    _grpo_log_metrics(self, mode, metrics, loss_type, bonus)
    if bonus:
        _grpo_adaptive_entropy(self, mode, metrics)
    if self.aux_loss_enabled:
        loss = loss + self.router_aux_loss_coef * aux_loss / accum
        self._metrics[mode]["aux_loss"].append(
            self.accelerator.gather_for_metrics(aux_loss).mean().item())
    return loss


def _patch_grpo():
    """GRPOTrainer._compute_loss -> grpo_compute_loss where TRL has it."""
    cls = _grpo_trainer()
    if cls is None or vars(cls)["_compute_loss"] is grpo_compute_loss:
        return
    _saved[_GRPO_KEY] = (cls, vars(cls)["_compute_loss"])
    cls._compute_loss = grpo_compute_loss


_REPLACEMENTS = {"selective_log_softmax": selective_log_softmax,
                 "entropy_from_logits": entropy_from_logits,
                 "_ChunkedLogProbFunction": ChunkedLogProbFunction}


def _targets(module):
    if module is not None:
        return [module]
    import trl.trainer.utils as utils  # ImportError when TRL is absent
    mods = [utils]
    for name, mod in list(sys.modules.items()):
        if name.startswith("trl.") and mod is not None and mod is not utils:
            if any(getattr(mod, a, None) is getattr(utils, a, None) for a in _REPLACEMENTS
                   if hasattr(utils, a)):
                mods.append(mod)
    return mods


def enable(module: Optional[types.ModuleType] = None) -> List[types.ModuleType]:
    """Patch selective_log_softmax, entropy_from_logits and the fused-head
    kernel (where present) in `module` (default: TRL, and then
    GKDTrainer.generalized_jsd_loss too). Returns the patched modules."""
    mods = _targets(module)
    if module is None:
        _patch_gkd()
        _patch_grpo()
    for mod in mods:
        for attr, new in _REPLACEMENTS.items():
            old = getattr(mod, attr, None)
            if old is None or old is new:
                continue
            _saved[(mod.__name__, attr)] = (mod, old)
            if attr == "_ChunkedLogProbFunction":
                ChunkedLogProbFunction.original = old
            setattr(mod, attr, new)
    return mods


def disable(module: Optional[types.ModuleType] = None) -> None:
    """Restore what enable() replaced (in `module` only, when given)."""
    for key, (mod, old) in list(_saved.items()):
        if module is None or mod is module:
            setattr(mod, key[1], old)
            del _saved[key]
