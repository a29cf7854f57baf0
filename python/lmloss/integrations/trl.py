"""lmloss in TRL (opt-in; TRL itself is optional).

selective_log_softmax(logits, index, temperature=1.0, row_mask=None) and
entropy_from_logits(logits, chunk_size=128) are lmloss.torch's, which have
the signatures and results of trl.trainer.utils' functions (the result in
the logits' dtype; values from lmloss's fp32-accumulated, collapse-exact
kernels, one C call for any [..., V], e.g. the padding-free packed GRPO
logits [total_nnz, V]).
ChunkedLogProbFunction stands in for TRL's fused LM head kernel behind
add_fused_lm_head (SFT's, GRPO's, DPO's and KTO's): per-token log-probs,
entropy, is_top1 and mean logits from lmloss's fused head, never
materializing the logits.
generalized_jsd_loss is GKDTrainer.generalized_jsd_loss (TRL's GKD
distillation loss) through lmloss.torch.generalized_jsd, and
chunked_divergence_loss DistillationTrainer's two-head loss through
lmloss.torch.linear_generalized_jsd. grpo_compute_loss
is GRPOTrainer._compute_loss (its loss, gradient and logged metrics, every
GRPOConfig option) through lmloss.torch.grpo_loss; dpo_compute_loss
DPOTrainer._compute_loss through lmloss.torch.dpo_loss, kto_compute_loss
KTOTrainer's through lmloss.torch.kto_loss; cpo_loss and odds_ratio_loss
the per-pair losses of CPOTrainer and ORPOTrainer (trl.experimental).

enable(module=None) / disable(module=None): patch (and restore) those names
in `module`, by default trl.trainer.utils together with every imported trl
module that imported them by name (e.g. trl.trainer.grpo_trainer), and
GKDTrainer.generalized_jsd_loss where TRL has that trainer
(trl.experimental.gkd), DistillationTrainer's _chunked_divergence_loss,
GRPOTrainer's, DPOTrainer's and KTOTrainer's _compute_loss, and
CPOTrainer.cpo_loss and ORPOTrainer.odds_ratio_loss.
"""

import sys
import types
import warnings
from typing import Any, List, Optional, Sequence

from .. import _lib
from .. import _shard as S
from .. import torch as lt
from .._preference import KTO_METRIC_NAMES as _KTO_METRICS
from .._preference import METRIC_NAMES as _DPO_METRICS
from .._preference import kto_trl_metrics as _kto_trl_metrics
from .._preference import trl_metrics as _dpo_trl_metrics
from ..torch import _bridge as B
from ..torch import _vocab_parallel as VP

_saved = {}  # (module name, attribute) -> original


selective_log_softmax = lt.selective_log_softmax
entropy_from_logits = lt.entropy_from_logits


class ChunkedLogProbFunction:
    """TRL's fused LM head (trl.kernels.ChunkedLogProbFunction) through lmloss:
    apply(hidden [N, H], weight [V, H], bias, targets [N], temperature,
    chunk_size, final_logit_softcapping=None, logit_scale=1.0, outputs=...)
    -> (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1). lmloss's
    fused head computes log_probs (differentiable), entropy (differentiable
    unless is_top1 is also requested, then detached) and is_top1; without a
    softcap mean_logits comes by linearity (_mean_logits), and WPO's
    log_sum_sq_probs, or mean_logits under a softcap, from the logits a
    block of rows at a time (_logit_sums: one more logits GEMM, no grad)."""

    @staticmethod
    def apply(hidden: Any, weight: Any, bias: Any, targets: Any, temperature: float,
              chunk_size: int, final_logit_softcapping: Optional[float] = None,
              logit_scale: float = 1.0,
              outputs: Sequence[str] = ("log_probs", "entropy", "is_top1")) -> tuple:
        """TRL's ChunkedLogProbFunction.apply (the class docstring): hidden
        [N, H] and weight [V, H] (bias [V] or None) in one float dtype,
        targets [N] int64; returns float32 [N] log_probs, entropy,
        log_sum_sq_probs and mean_logits (or None) and bool [N] is_top1 (or
        None)."""
        cap = final_logit_softcapping or None  # 0 is off, as lmloss's softcap keyword
        kw = dict(bias=bias, temperature=temperature, logit_scale=logit_scale, softcap=cap)
        want_entropy, want_mean = "entropy" in outputs, "mean_logits" in outputs
        want_sq = "log_sum_sq_probs" in outputs
        sq = mean = None
        capped_mean = want_mean and cap is not None  # not linear in the logits
        if want_sq or capped_mean:
            sq, mean = _logit_sums(hidden, weight, bias, logit_scale, cap, temperature, want_sq,
                                   capped_mean)
        if want_mean and mean is None:
            mean = _mean_logits(hidden, weight, bias, logit_scale / temperature)
        if "is_top1" in outputs:
            r = lt.linear_cross_entropy(hidden, weight, targets, reduction="none",
                                        return_entropy=want_entropy, return_argmax=True, **kw)
            return -r.loss, r.entropy, sq, mean, r.argmax == targets
        logp, ent = lt.linear_log_probs(hidden, weight, targets, entropy=True, **kw)
        return logp, (ent if want_entropy else None), sq, mean, None


def _mean_logits(hidden: Any, weight: Any, bias: Any, scale: float, block: int = 8192) -> Any:
    """float32 [N]: each row's logits (hidden W^T + bias) times scale,
    averaged over the vocabulary, without the logits: the mean is linear,
    hidden's product with W's column means (+ the bias' mean), summed in
    fp32 a block of rows at a time (no fp32 copy of W or hidden)."""
    import torch

    with torch.no_grad():
        V = weight.shape[0]
        wsum = sum(w.float().sum(0) for w in weight.split(block))
        mean = torch.cat([h.float() @ wsum for h in hidden.split(block)]) / V
        if bias is not None:
            mean = mean + bias.float().mean()
        return mean * scale


def _logit_sums(hidden: Any, weight: Any, bias: Any, logit_scale: float, softcap: Optional[float],
                temperature: float, want_sq: bool, want_mean: bool,
                block_bytes: int = 1 << 29) -> tuple:
    """(log_sum_sq_probs, mean_logits), each float32 [N] or None, from the
    logits as TRL's kernel forms them (the GEMM in the head's dtype; scale,
    softcap and temperature in fp32), a block of rows at a time, without
    gradient: at most block_bytes of the GEMM's output and, for the mean,
    its fp32 copy. log sum p^2 comes from two of lmloss's row states of
    the GEMM's block (_log_sum_sq_probs); the mean, wanted here only under
    a softcap, from the block transformed in fp32."""
    import torch

    with torch.no_grad():
        width = weight.element_size() + (4 if want_mean else 0)
        rows = max(1, block_bytes // (width * weight.shape[0]))
        sq, mean = [], []
        for h in hidden.split(rows):
            z = h @ weight.T
            if bias is not None:
                z += bias
            if want_sq:
                sq.append(_log_sum_sq_probs(z, logit_scale, softcap, temperature))
            if want_mean:
                z = z.float().mul_(logit_scale)  # the GEMM's own tensor when it is fp32
                if softcap is not None:
                    z.div_(softcap).tanh_().mul_(softcap)
                mean.append(z.div_(temperature).mean(-1))
        return (torch.cat(sq) if want_sq else None), (torch.cat(mean) if want_mean else None)


def _log_sum_sq_probs(z: Any, logit_scale: float, softcap: Optional[float],
                      temperature: float) -> Any:
    """float32 [n]: log sum_j p_j^2 of the rows of raw logits z [n, V]
    under lmloss's transform, as log1p(S2) - 2 log1p(R): R and S2 are the
    max-split sums of e^(z - max) and e^2(z - max) over all but the row's
    first max, the r of its row state at the temperature and at half of it
    (lmloss.h's packed state; the max is the same). A confident row keeps
    its tiny value where log(sum e^2z) - 2 log Z would cancel. Each state
    is one read of z by lmloss's kernel."""
    import torch

    whole, run, r = S.Shard(0, z.shape[1], 0), (B.backend_code("auto"), 0), []
    for t in (temperature, temperature / 2):
        state = z.new_empty((z.shape[0], S.STATE_COLS), dtype=torch.float32)
        tr = B.transform(logit_scale, _lib.softcap_value(softcap), t)
        VP.lp_state_into(z, None, None, tr, whole, state, run)
        r.append(state[:, 1])
    return r[1].log1p() - 2 * r[0].log1p()


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


def _full(t, dtype=None):
    """A DTensor (FSDP2's sharded or replicated head) as one plain tensor,
    gathered once per call; a plain tensor as it is."""
    if t is None or not hasattr(t, "full_tensor"):
        return t
    t = t.full_tensor()
    return t if dtype is None else t.to(dtype)


def chunked_divergence_loss(student_hidden_states: Any, teacher_hidden_states: Any,
                            student_lm_head_weight: Any, teacher_lm_head_weight: Any,
                            completion_mask: Any, beta: float, num_items_in_batch: Any = None,
                            student_lm_head_bias: Any = None, teacher_lm_head_bias: Any = None,
                            student_logit_scale: float = 1.0, teacher_logit_scale: float = 1.0,
                            student_final_logit_softcapping: Optional[float] = None,
                            teacher_final_logit_softcapping: Optional[float] = None,
                            temperature: float = 1.0) -> Any:
    """DistillationTrainer's two-head loss (trl.trainer.distillation_trainer.
    _chunked_divergence_loss) through lmloss.torch.linear_generalized_jsd:
    its signature and results, (loss, the student's entropy summed over the
    completion positions, their count), the loss divided by
    num_items_in_batch, else by that count (at least 1). Hidden states [B,
    K, H] of each model with its own width, completion_mask [B, K]; the
    masked positions are compacted away before either head's GEMM, with no
    host synchronization."""
    import torch

    h_s = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])
    h_t = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    labels = torch.where(valid, 0, -100)
    divisor = n_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss, entropy = lt.linear_generalized_jsd(
        h_s, _full(student_lm_head_weight, h_s.dtype), h_t,
        _full(teacher_lm_head_weight, h_t.dtype), labels, beta, temperature, "sum", divisor,
        student_bias=_full(student_lm_head_bias), teacher_bias=_full(teacher_lm_head_bias),
        logit_scale=student_logit_scale, teacher_logit_scale=teacher_logit_scale,
        softcap=student_final_logit_softcapping,
        teacher_softcap=teacher_final_logit_softcapping or 0.0, return_entropy=True)
    return loss, entropy.sum(), n_valid


_DISTILL_KEY = ("trl.trainer.distillation_trainer", "_chunked_divergence_loss")


def _patch_distillation():
    """DistillationTrainer's _chunked_divergence_loss -> chunked_divergence_loss
    where TRL has it."""
    try:
        import trl.trainer.distillation_trainer as mod
    except ImportError:  # an older TRL, or one without its dependencies
        return
    old = getattr(mod, _DISTILL_KEY[1], None)
    if old is None or old is chunked_divergence_loss:
        return
    _saved[_DISTILL_KEY] = (mod, old)
    setattr(mod, _DISTILL_KEY[1], chunked_divergence_loss)


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


def _dpo_trainer():
    """TRL's DPOTrainer, or None where TRL or its _compute_loss is absent."""
    try:
        from trl.trainer.dpo_trainer import DPOTrainer
    except ImportError:
        return None
    return DPOTrainer if "_compute_loss" in vars(DPOTrainer) else None


_DPO_KEY = ("trl.trainer.dpo_trainer.DPOTrainer", "_compute_loss")


def _dpo_original():
    cls = _dpo_trainer()
    return _saved[_DPO_KEY][1] if _DPO_KEY in _saved else vars(cls)["_compute_loss"]


def _dpo_sums(self, per_token_logps, shift_mask):
    """Each completion's log-prob sum, or with ld_alpha (LD-DPO) its shared
    part plus ld_alpha times its tail beyond the pair's shorter length."""
    import torch

    if self.ld_alpha is None:
        return per_token_logps.sum(dim=1)
    pos = shift_mask.cumsum(dim=1)
    lens = shift_mask.sum(dim=1).long()
    shared = torch.minimum(*lens.chunk(2, dim=0)).repeat(2).unsqueeze(1)
    in_shared = (pos > 0) & (pos <= shared)
    return ((per_token_logps * in_shared).sum(dim=1)
            + self.ld_alpha * (per_token_logps * (pos > shared)).sum(dim=1))


def _dpo_log_metrics(self, mode, inputs, outputs, seq_len, shift_mask, metrics):
    """What TRL's DPOTrainer logs: the token metrics from the fused head's
    outputs, the rewards and log-prob means from lmloss's sums (gathered
    over processes)."""
    acc = self.accelerator
    log = self._metrics[mode]
    mask = shift_mask
    ent_sum = acc.gather_for_metrics((outputs.entropy[:, -seq_len:].detach() * mask).sum()).sum()
    tokens = acc.gather_for_metrics(mask.sum()).sum()
    log["entropy"].append((ent_sum / tokens).item() if tokens > 0 else 0.0)
    if mode == "train":
        n = acc.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
        self._total_train_tokens += n // self._tp_size
    log["num_tokens"] = [self._total_train_tokens]
    cm, rm = mask.chunk(2, dim=0)
    for name, logits, m in zip(("chosen", "rejected"),
                               outputs.mean_logits[:, -seq_len:].chunk(2, dim=0), (cm, rm)):
        total = acc.gather_for_metrics(logits[m.bool()].sum()).sum().item()
        count = acc.gather_for_metrics(m.sum()).sum().item()
        log["logits/" + name].append(total / count if count > 0 else 0.0)
    top1 = outputs.is_top1[:, -seq_len:].chunk(2, dim=0)[0] & cm.bool()
    correct = acc.gather_for_metrics(top1.sum()).sum()
    count = acc.gather_for_metrics(cm.sum()).sum()
    log["mean_token_accuracy"].append((correct / count).item() if count > 0 else 0.0)
    m = acc.gather(metrics.detach()).reshape(-1, metrics.numel()).sum(0).tolist()
    for k, v in _dpo_trl_metrics(dict(zip(_DPO_METRICS, m))).items():
        log[k].append(v)


def dpo_compute_loss(self: Any, model: Any, inputs: dict, return_outputs: bool) -> Any:
    """DPOTrainer._compute_loss through lmloss.torch.dpo_loss: the same model
    forward (the fused head's per-token log-probs), then every loss type,
    weight, f-divergence, label smoothing and WPO weighting of TRL's, exact
    at large margins, and TRL's logged metrics. return_outputs, and SFT
    with ld_alpha (whose SFT term reads the plain sums), go to TRL's own."""
    import torch

    if return_outputs or ("sft" in self.loss_types and self.ld_alpha is not None):
        return _dpo_original()(self, model, inputs, return_outputs)
    mode = "train" if self.model.training else "eval"
    skip = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
    kwargs = {k: v for k, v in inputs.items() if k not in skip}
    kwargs["use_cache"] = False
    if self.aux_loss_enabled:
        kwargs["output_router_logits"] = True
    completion_mask = inputs["completion_mask"]
    shift_mask = completion_mask[..., 1:]
    labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
    outputs = model(**kwargs, labels=labels, fused_lm_head=True)
    seq_len = shift_mask.size(1)
    per_token_logps = outputs.log_probs[:, -seq_len:]
    chosen, rejected = _dpo_sums(self, per_token_logps, shift_mask).chunk(2, dim=0)
    if self.precompute_ref_logps:
        ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    else:
        ref_model = self.model if self.ref_model is None else self.ref_model
        ref_chosen, ref_rejected = self.compute_ref_log_probs(ref_model, inputs)
    # TRL's sft counts the shifted mask, ipo and sigmoid_norm the unshifted one
    tokens = (shift_mask if "sft" in self.loss_types else completion_mask).sum(dim=1)
    weight = None
    if self.use_weighting:
        with torch.no_grad():
            aligned = (per_token_logps - outputs.log_sum_sq_probs[:, -seq_len:]) * shift_mask
            w = torch.exp(aligned.sum(dim=1) / shift_mask.sum(dim=1).clamp_min(1))
            weight = w.chunk(2, dim=0)[0] * w.chunk(2, dim=0)[1]
    loss, metrics = lt.dpo_loss(
        chosen, rejected, ref_chosen, ref_rejected, loss_type=list(self.loss_types),
        loss_weights=list(self.loss_weights), beta=self.beta,
        label_smoothing=self.label_smoothing, f_divergence_type=self.f_divergence_type,
        f_alpha_divergence_coef=self.f_alpha_divergence_coef,
        discopop_tau=self.args.discopop_tau, chosen_tokens=tokens.chunk(2, dim=0)[0],
        rejected_tokens=tokens.chunk(2, dim=0)[1], weight=weight, return_metrics=True)
    if self.aux_loss_enabled:
        loss = loss + self.router_aux_loss_coef * outputs.aux_loss
        self._metrics[mode]["aux_loss"].append(
            self.accelerator.gather_for_metrics(outputs.aux_loss).mean().item())
    _dpo_log_metrics(self, mode, inputs, outputs, seq_len, shift_mask, metrics)
    return loss


def _kto_trainer():
    """TRL's KTOTrainer, or None where TRL or its _compute_loss is absent."""
    try:
        from trl.trainer.kto_trainer import KTOTrainer
    except ImportError:
        return None
    return KTOTrainer if "_compute_loss" in vars(KTOTrainer) else None


_KTO_KEY = ("trl.trainer.kto_trainer.KTOTrainer", "_compute_loss")
_KTO_SKIP = {"completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask",
             "KL_token_type_ids", "KL_mm_token_type_ids", "label", "ref_logps", "ref_KL_logps"}


def kto_compute_loss(self: Any, model: Any, inputs: dict, return_outputs: bool) -> Any:
    """KTOTrainer._compute_loss through lmloss.torch.kto_loss: the same model
    forwards and KL estimate, both loss types, the weights, TRL's nanmean,
    exact at large margins, and TRL's logged metrics. return_outputs, and
    a reference model run in the step (precompute_ref_logps off), go to
    TRL's own."""
    import torch

    if return_outputs or not self.precompute_ref_logps:
        return (_saved[_KTO_KEY][1] if _KTO_KEY in _saved
                else vars(_kto_trainer())["_compute_loss"])(self, model, inputs, return_outputs)
    mode = "train" if self.model.training else "eval"
    acc = self.accelerator
    batch = {k: (v.to(acc.device) if isinstance(v, torch.Tensor) else v)
             for k, v in inputs.items()}
    kl_logps = self._compute_kl_logps(model, batch)
    kwargs = {k: v for k, v in batch.items() if k not in _KTO_SKIP}
    kwargs["use_cache"] = False
    if self.aux_loss_enabled:
        kwargs["output_router_logits"] = True
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    outputs = model(**kwargs, labels=labels, fused_lm_head=True)
    seq_len = batch["input_ids"].size(1) - 1
    logps = outputs.log_probs[:, -seq_len:].sum(-1)
    kl = None
    if self.calculate_KL:
        kl = (kl_logps - batch["ref_KL_logps"]).mean().detach()
        kl = acc.gather_for_metrics(kl).mean().clamp(min=0)
    desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=logps.device)
    loss, metrics = lt.kto_loss(logps, batch["ref_logps"], desirable, kl,
                                loss_type=self.loss_type, beta=self.beta,
                                desirable_weight=self.desirable_weight,
                                undesirable_weight=self.undesirable_weight, return_metrics=True)
    log = self._metrics[mode]
    log["kl"].append(0.0 if kl is None else kl.item())
    mask = batch["completion_mask"][:, 1:]
    ent = acc.gather_for_metrics((outputs.entropy[:, -seq_len:].detach() * mask).sum()).sum()
    tokens = acc.gather_for_metrics(mask.sum()).sum()
    log["entropy"].append((ent / tokens).item() if tokens > 0 else 0.0)
    if mode == "train":
        n = acc.gather_for_metrics(batch["attention_mask"].sum()).sum().item()
        self._total_train_tokens += n // self._tp_size
    log["num_tokens"] = [self._total_train_tokens]
    mean_logits = outputs.mean_logits[:, -seq_len:]
    for name, keep in (("chosen", desirable), ("rejected", ~desirable)):
        m = mask[keep]
        total = acc.gather_for_metrics(mean_logits[keep][m.bool()].sum()).sum().item()
        count = acc.gather_for_metrics(m.sum()).sum().item()
        if count > 0:
            log["logits/" + name].append(total / count)
    sums = acc.gather_for_metrics(metrics.detach()).reshape(-1, metrics.numel()).sum(0).tolist()
    for k, v in _kto_trl_metrics(dict(zip(_KTO_METRICS, sums))).items():
        log[k].append(v)
    if self.aux_loss_enabled:
        loss = loss + self.router_aux_loss_coef * outputs.aux_loss
        log["aux_loss"].append(acc.gather_for_metrics(outputs.aux_loss).mean().item())
    return loss


def _experimental(module, name):
    """trl.experimental's trainer class `name` of `module`, or None; its
    import warning kept quiet (enable() is not the user choosing it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
        try:
            mod = __import__("trl.experimental.%s" % module, fromlist=[name])
        except ImportError:
            return None
    return getattr(mod, name, None)


_CPO_KEY = ("trl.experimental.cpo.cpo_trainer.CPOTrainer", "cpo_loss")
_ORPO_KEY = ("trl.experimental.orpo.orpo_trainer.ORPOTrainer", "odds_ratio_loss")
_CPO_TYPES = {"sigmoid": "cpo_sigmoid", "hinge": "hinge", "ipo": "cpo_ipo", "simpo": "simpo"}


def _original(key, find):
    return _saved[key][1] if key in _saved else vars(find())[key[1]]


def _cpo_trainer():
    return _experimental("cpo.cpo_trainer", "CPOTrainer")


def _orpo_trainer():
    return _experimental("orpo.orpo_trainer", "ORPOTrainer")


def cpo_loss(self: Any, policy_chosen_logps: Any, policy_rejected_logps: Any) -> tuple:
    """CPOTrainer.cpo_loss through lmloss.torch.dpo_loss's CPO types: TRL's
    (losses, chosen_rewards, rejected_rewards), the per-pair losses
    differentiable. AlphaPO (alpha != 0), whose rewards are transformed,
    goes to TRL's own."""
    if self.alpha != 0.0 or self.loss_type not in _CPO_TYPES:
        return _original(_CPO_KEY, _cpo_trainer)(self, policy_chosen_logps,
                                                 policy_rejected_logps)
    dev = self.accelerator.device
    losses = lt.dpo_loss(policy_chosen_logps, policy_rejected_logps,
                         loss_type=_CPO_TYPES[self.loss_type], beta=self.beta,
                         label_smoothing=self.label_smoothing,
                         simpo_gamma=getattr(self, "simpo_gamma", 0.5), reduction="none")
    return (losses.to(dev), self.beta * policy_chosen_logps.to(dev).detach(),
            self.beta * policy_rejected_logps.to(dev).detach())


def odds_ratio_loss(self: Any, policy_chosen_logps: Any, policy_rejected_logps: Any) -> tuple:
    """ORPOTrainer.odds_ratio_loss through lmloss.torch.dpo_loss's "orpo":
    TRL's (losses, chosen_rewards, rejected_rewards, mean log sigmoid of the
    log odds, mean log odds), the losses (minus lmloss's per-pair terms)
    differentiable, exact where p is near 1 or the log odds are large."""
    dev = self.accelerator.device
    terms, metrics = lt.dpo_loss(policy_chosen_logps, policy_rejected_logps, loss_type="orpo",
                                 beta=self.beta, reduction="none", return_metrics=True)
    losses = -terms
    n = policy_chosen_logps.shape[0]
    log_odds = metrics[_DPO_METRICS.index("orpo_log_odds")] / n
    return (losses.to(dev), self.beta * policy_chosen_logps.to(dev).detach(),
            self.beta * policy_rejected_logps.to(dev).detach(),
            (losses.detach() / self.beta).mean().to(dev), log_odds.to(dev))


def _patch_trainer(key, find, new):
    """cls.<key[1]> -> new where TRL has the trainer (find() returns it)."""
    cls = find()
    if cls is None or key[1] not in vars(cls) or vars(cls)[key[1]] is new:
        return
    _saved[key] = (cls, vars(cls)[key[1]])
    setattr(cls, key[1], new)


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
        _patch_distillation()
        _patch_trainer(_GRPO_KEY, _grpo_trainer, grpo_compute_loss)
        _patch_trainer(_DPO_KEY, _dpo_trainer, dpo_compute_loss)
        _patch_trainer(_KTO_KEY, _kto_trainer, kto_compute_loss)
        _patch_trainer(_CPO_KEY, _cpo_trainer, cpo_loss)
        _patch_trainer(_ORPO_KEY, _orpo_trainer, odds_ratio_loss)
    for mod in mods:
        for attr, new in _REPLACEMENTS.items():
            old = getattr(mod, attr, None)
            if old is None or old is new:
                continue
            _saved[(mod.__name__, attr)] = (mod, old)
            setattr(mod, attr, new)
    return mods


def disable(module: Optional[types.ModuleType] = None) -> None:
    """Restore what enable() replaced (in `module` only, when given)."""
    for key, (mod, old) in list(_saved.items()):
        if module is None or mod is module:
            setattr(mod, key[1], old)
            del _saved[key]
