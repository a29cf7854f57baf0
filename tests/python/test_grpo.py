"""lmloss.grpo_loss and lmloss.torch.grpo_loss against TRL's own
GRPOTrainer._compute_loss (trl_grpo_oracle.py's stand-in self) on the same
fp32 inputs: every loss type at both importance-sampling levels with every
option (KL with its bias correction, delta, epsilon_high, the off-policy
and entropy masks, the entropy bonus, vLLM's IS ratio per token and per
sequence, advantages per token, accumulation and evaluation), loss and
gradient w.r.t. the per-token log-probs and entropies to 1e-6 relative,
and TRL's logged metrics. TRL runs in float64 on the fp32 values (the
exact answer lmloss's double per-token arithmetic is held to) and in
float32 (what a user compares with). Then the exactness cases TRL's fp32
loses (log-probs near -1000, k3 of small differences), masked tokens,
empty sequences, B = 1, thread counts and bad input."""

import numpy as np
import pytest

import lmloss

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

import trl_grpo_oracle as O  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

# name -> (GRPOConfig keywords, which optional inputs the case gives)
OPTIONS = {
    "plain": ({}, ()),
    "kl": (dict(beta=0.04), ("ref",)),
    "kl_bias": (dict(beta=0.1, use_bias_correction_kl=True), ("ref",)),
    "delta": (dict(delta=1.1, epsilon_high=0.28), ()),
    "epsilon": (dict(epsilon=0.1, epsilon_high=5.0), ()),
    "off_policy": (dict(off_policy_mask_threshold=0.02), ("sampling",)),
    "entropy_mask": (dict(top_entropy_quantile=0.4), ()),
    "bonus": (dict(entropy_coef=0.01, top_entropy_quantile=0.5), ()),
    "vllm_token": (dict(use_vllm=True), ("is_token",)),
    "vllm_seq": (dict(use_vllm=True), ("is_seq",)),
    "adv_tokens": (dict(beta=0.02), ("ref", "adv_tokens")),
    "accumulate": (dict(gradient_accumulation_steps=4, steps_per_generation=2,
                        max_completion_length=9, entropy_coef=0.02), ()),
    "eval": (dict(training=False, beta=0.05, entropy_coef=0.03), ("ref",)),
    "everything": (dict(beta=0.05, use_bias_correction_kl=True, delta=1.5,
                        off_policy_mask_threshold=0.0, top_entropy_quantile=0.7,
                        entropy_coef=0.01, use_vllm=True, gradient_accumulation_steps=2),
                   ("ref", "sampling", "is_token")),
}


def case(b=5, t=7, seed=0, adv_tokens=False):
    """fp32 inputs: log-probs in (-3, 0), old ones around them (ratios across
    the clip range), a padded tail and one empty sequence."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 3.0, (b, t)).astype(np.float32)
    mask = np.ones((b, t), np.float32)
    for i in range(b):
        mask[i, t - rng.integers(0, t // 2 + 1):] = 0
    if b > 2:
        mask[2] = 0
    f = np.float32
    return dict(logp=logp, mask=mask,
                old=(logp + rng.normal(0, 0.25, (b, t))).astype(f),
                ref=(logp + rng.normal(0, 0.5, (b, t))).astype(f),
                sampling=(logp + rng.normal(0, 0.2, (b, t))).astype(f),
                entropy=rng.uniform(0, 3, (b, t)).astype(f),
                adv=rng.normal(0, 1, (b, t) if adv_tokens else (b,)).astype(f),
                is_token=rng.uniform(0.5, 1.5, (b, t)).astype(f),
                is_seq=rng.uniform(0.5, 1.5, (b, 1)).astype(f), items=f(mask.sum() * 1.5))


def trl(c, cfg, given, dtype):
    """TRL's loss, d loss / d logp, d loss / d entropy and logged metrics."""
    def tt(x):
        return torch.tensor(x, dtype=dtype)
    logp, ent = tt(c["logp"]).requires_grad_(), tt(c["entropy"]).requires_grad_()
    is_key = "is_token" if "is_token" in given else "is_seq" if "is_seq" in given else None
    inp = O.inputs(tt(c["mask"]), tt(c["adv"]), old=tt(c["old"]),
                   ref=tt(c["ref"]) if "ref" in given else None,
                   sampling=tt(c["sampling"]) if "sampling" in given else None,
                   is_ratio=tt(c[is_key]) if is_key else None, num_items=tt(c["items"]))
    loss, s = O.trl_loss(logp, ent, inp, **cfg)
    dl, de = torch.autograd.grad(loss, (logp, ent), allow_unused=True)
    mode = "train" if cfg.get("training", True) else "eval"
    metrics = {k: v[-1] for k, v in s._metrics[mode].items()}
    zero = np.zeros_like(c["logp"], np.float64)
    return (loss.item(), zero if dl is None else dl.double().numpy(),
            zero if de is None else de.double().numpy(), metrics)


def trl_divisor(c, cfg):
    """TRL's dapo / cispo / vespo divisor (one process)."""
    d = max(float(c["items"]), 1.0)
    if cfg.get("training", True):
        d = d * cfg.get("gradient_accumulation_steps", 1) / cfg.get("steps_per_generation", 1)
    return d


def lmloss_args(c, cfg, given):
    """grpo_loss's arguments for a case (TRL's config keywords translated)."""
    kw = {k: v for k, v in cfg.items() if k not in ("training", "use_vllm",
                                                      "steps_per_generation")}
    train = cfg.get("training", True)
    kw["gradient_accumulation_steps"] = cfg.get("gradient_accumulation_steps", 1) if train else 1
    kw["num_items"] = trl_divisor(c, cfg)
    kw.setdefault("max_completion_length", 512)
    is_key = "is_token" if "is_token" in given else "is_seq" if "is_seq" in given else None
    return dict(old_logp=c["old"], ref_logp=c["ref"] if "ref" in given else None,
                entropy=c["entropy"], sampling_logp=c["sampling"] if "sampling" in given else None,
                importance_sampling_ratio=c[is_key] if is_key else None, **kw)


def assert_close(got, want, what, rtol=1e-6, atol=0.0):
    """Each entry to rtol relative, with a floor of rtol 1e-3 of the largest
    (entries that cancel to about 0) and atol."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.max(np.abs(want)), 1e-30)
    err = np.max(np.abs(got - want) - rtol * np.abs(want) - rtol * 1e-3 * scale - atol,
                 initial=0)
    assert err <= 0, "%s: got %s, want %s" % (what, got, want)


PARAMS = [(lt_, lv, o) for lt_ in LOSS_TYPES for lv in ("token", "sequence") for o in OPTIONS]


@pytest.mark.parametrize("loss_type,level,option", PARAMS)
def test_numpy_matches_trl(loss_type, level, option):
    cfg, given = OPTIONS[option]
    cfg = dict(cfg, loss_type=loss_type, importance_sampling_level=level)
    c = case(seed=len(PARAMS) and PARAMS.index((loss_type, level, option)),
             adv_tokens="adv_tokens" in given)
    r = lmloss.grpo_loss(c["logp"], c["adv"], c["mask"], grad=True, **lmloss_args(c, cfg, given))
    loss64, dl64, de64, metrics = trl(c, cfg, given, torch.float64)
    assert_close(r.loss, loss64, "loss")
    assert_close(r.dlogp, dl64, "dlogp")
    assert_close(r.dentropy, de64, "dentropy")
    loss32, dl32, _, _ = trl(c, cfg, given, torch.float32)
    # TRL's fp32 sums round each O(1) term: their absolute error
    assert_close(r.loss, loss32, "loss against TRL's fp32", rtol=1e-5, atol=1e-6)
    assert_close(r.dlogp, dl32, "dlogp against TRL's fp32", rtol=1e-5, atol=1e-7)
    ours = lmloss._grpo.trl_metrics(r.metrics, loss_type, cfg.get("beta", 0.0))
    for k, v in metrics.items():
        if k in ours:
            assert_close(ours[k], v, "metric " + k)
    assert set(ours) <= set(metrics) | {"kl"}
