"""TRL's own GRPOTrainer._compute_loss on given per-token tensors, without a
model: a stand-in `self` carrying what the method reads, whose
_get_per_token_logps_and_entropies returns the caller's tensors. Shared by
test_grpo.py and test_torch_cuda.py."""

import collections
import types

import torch

from trl.trainer.grpo_trainer import GRPOTrainer


class Accelerator:
    """One process: gathers and reductions are the identity."""

    num_processes = 1
    sync_gradients = True

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


# GRPOConfig's defaults of what _compute_loss reads
DEFAULTS = dict(loss_type="dapo", importance_sampling_level="token", epsilon=0.2,
                epsilon_high=None, delta=None, beta=0.0, use_bias_correction_kl=False,
                sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                off_policy_mask_threshold=None, top_entropy_quantile=1.0, entropy_coef=0.0,
                use_adaptive_entropy=False, entropy_target=0.2, max_completion_length=512,
                steps_per_generation=1, gradient_accumulation_steps=1, use_vllm=False,
                vllm_importance_sampling_correction=True, training=True)


def stand_in(logp, entropy, **cfg):
    """The stand-in self for GRPOTrainer._compute_loss; cfg: DEFAULTS' keys."""
    c = dict(DEFAULTS, **cfg)
    args = types.SimpleNamespace(
        use_bias_correction_kl=c["use_bias_correction_kl"], delta=c["delta"],
        sapo_temperature_pos=c["sapo_temperature_pos"],
        sapo_temperature_neg=c["sapo_temperature_neg"], vespo_k_pos=c["vespo_k_pos"],
        vespo_lambda_pos=c["vespo_lambda_pos"], vespo_k_neg=c["vespo_k_neg"],
        vespo_lambda_neg=c["vespo_lambda_neg"], steps_per_generation=c["steps_per_generation"],
        entropy_target=c["entropy_target"], entropy_coef_delta=0.005, entropy_coef_min=0.0,
        entropy_coef_max=1.0)
    s = types.SimpleNamespace(
        args=args, accelerator=Accelerator(), model=types.SimpleNamespace(training=c["training"]),
        aux_loss_enabled=False, top_entropy_quantile=c["top_entropy_quantile"],
        off_policy_mask_threshold=c["off_policy_mask_threshold"],
        importance_sampling_level=c["importance_sampling_level"], beta=c["beta"],
        loss_type=c["loss_type"], epsilon_low=c["epsilon"],
        epsilon_high=c["epsilon"] if c["epsilon_high"] is None else c["epsilon_high"],
        use_vllm=c["use_vllm"],
        vllm_importance_sampling_correction=c["vllm_importance_sampling_correction"],
        current_gradient_accumulation_steps=c["gradient_accumulation_steps"],
        max_completion_length=c["max_completion_length"],
        entropy_coef=c["entropy_coef"], use_adaptive_entropy=c["use_adaptive_entropy"],
        _entropy_bonus_enabled=c["entropy_coef"] != 0.0 or c["use_adaptive_entropy"],
        _last_world_entropy=float("inf"), _entropy_window_stats=None,
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights)
    s.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, s)
    s._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
    return s


def inputs(mask, advantages, old=None, ref=None, sampling=None, is_ratio=None, num_items=None):
    """The inputs dict of _compute_loss (prompt ids: one column of zeros)."""
    b, t = mask.shape
    d = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long, device=mask.device),
         "prompt_mask": torch.ones(b, 1, dtype=torch.long, device=mask.device),
         "completion_ids": torch.zeros(b, t, dtype=torch.long, device=mask.device),
         "completion_mask": mask, "advantages": advantages}
    for k, v in (("old_per_token_logps", old), ("ref_per_token_logps", ref),
                 ("sampling_per_token_logps", sampling), ("importance_sampling_ratio", is_ratio),
                 ("num_items_in_batch", num_items)):
        if v is not None:
            d[k] = v
    return d


def trl_loss(logp, entropy, inp, **cfg):
    """(loss, the stand-in, so its _metrics can be read) of TRL's method."""
    s = stand_in(logp, entropy, **cfg)
    return GRPOTrainer._compute_loss(s, None, inp), s
