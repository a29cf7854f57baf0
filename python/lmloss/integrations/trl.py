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
distillation loss) through lmloss.torch.generalized_jsd.

enable(module=None) / disable(module=None): patch (and restore) those names
in `module`, by default trl.trainer.utils together with every imported trl
module that imported them by name (e.g. trl.trainer.grpo_trainer), and
GKDTrainer.generalized_jsd_loss where TRL has that trainer
(trl.experimental.gkd).
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
