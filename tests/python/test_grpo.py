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

import types

import numpy as np
import pytest

import lmloss

torch = pytest.importorskip("torch")
pytest.importorskip("trl.trainer.grpo_trainer")  # TRL and its trainers' own dependencies

import lmloss.torch as lt  # noqa: E402
import lmloss.torch._grpo as lt_grpo  # noqa: E402
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
    "on_policy": (dict(beta=0.04, entropy_coef=0.01), ("ref", "no_old")),
    "on_policy_epsilon_0": (dict(epsilon=0.0), ("no_old",)),
    "everything": (dict(beta=0.05, use_bias_correction_kl=True, delta=1.5,
                        off_policy_mask_threshold=0.0, top_entropy_quantile=0.7,
                        entropy_coef=0.01, use_vllm=True, gradient_accumulation_steps=2),
                   ("ref", "sampling", "is_token")),
}


IS_KEYS = ("is_token", "is_seq", "token_truncate", "token_mask", "sequence_truncate",
           "sequence_mask")


def ratio_key(given):
    """Which of a case's IS ratios the inputs carry (None: none)."""
    return next((k for k in given if k in IS_KEYS), None)


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


def trl_inputs(c, given, dtype):
    """The case's log-probs and entropies (leaves needing a gradient) and
    TRL's inputs dict for them, in dtype."""
    def tt(x):
        return torch.tensor(x, dtype=dtype)
    logp, ent = tt(c["logp"]).requires_grad_(), tt(c["entropy"]).requires_grad_()
    is_key = ratio_key(given)
    old = None if "no_old" in given else tt(c["old"])
    inp = O.inputs(tt(c["mask"]), tt(c["adv"]), old=old,
                   ref=tt(c["ref"]) if "ref" in given else None,
                   sampling=tt(c["sampling"]) if "sampling" in given else None,
                   is_ratio=tt(c[is_key]) if is_key else None, num_items=tt(c["items"]))
    return logp, ent, inp


def trl(c, cfg, given, dtype):
    """TRL's loss, d loss / d logp, d loss / d entropy and logged metrics."""
    logp, ent, inp = trl_inputs(c, given, dtype)
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
    is_key = ratio_key(given)
    return dict(old_logp=None if "no_old" in given else c["old"],
                ref_logp=c["ref"] if "ref" in given else None, entropy=c["entropy"],
                sampling_logp=c["sampling"] if "sampling" in given else None,
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


def torch_args(c, cfg, given, device="cpu"):
    """lmloss.torch.grpo_loss's arguments for a case: tensors on device, the
    divisor as a tensor (as TRL's num_items_in_batch)."""
    kw = lmloss_args(c, cfg, given)

    def tt(x):
        return None if x is None else torch.tensor(x, device=device)
    for k in ("old_logp", "ref_logp", "entropy", "sampling_logp", "importance_sampling_ratio"):
        kw[k] = tt(kw[k])
    kw["num_items"] = torch.tensor(kw["num_items"], device=device)
    return dict(old_per_token_logps=kw.pop("old_logp"), ref_per_token_logps=kw.pop("ref_logp"),
                entropies=kw.pop("entropy"), sampling_per_token_logps=kw.pop("sampling_logp"),
                **kw)


def torch_run(c, cfg, given, device="cpu"):
    """(loss, dlogp, dentropy, metrics dict) of lmloss.torch.grpo_loss."""
    kw = torch_args(c, cfg, given, device)
    logp = torch.tensor(c["logp"], device=device, requires_grad=True)
    ent = kw["entropies"].requires_grad_()
    loss, metrics = lt.grpo_loss(logp, torch.tensor(c["adv"], device=device),
                                 torch.tensor(c["mask"], device=device), return_metrics=True,
                                 **kw)
    (2.5 * loss).backward()  # an upstream gradient other than 1
    return (loss.item(), logp.grad.cpu().numpy() / 2.5, ent.grad.cpu().numpy() / 2.5,
            lt_grpo.metrics_dict(metrics))


@pytest.mark.parametrize("loss_type,level,option", PARAMS)
def test_torch_matches_trl(loss_type, level, option):
    cfg, given = OPTIONS[option]
    cfg = dict(cfg, loss_type=loss_type, importance_sampling_level=level)
    c = case(b=4, t=9, seed=1000 + PARAMS.index((loss_type, level, option)),
             adv_tokens="adv_tokens" in given)
    loss, dl, de, metrics = torch_run(c, cfg, given)
    loss64, dl64, de64, trl_metrics = trl(c, cfg, given, torch.float64)
    assert_close(loss, loss64, "loss")
    assert_close(dl, dl64, "dlogp")
    assert_close(de, de64, "dentropy")
    ours = lmloss._grpo.trl_metrics(metrics, loss_type, cfg.get("beta", 0.0))
    for k, v in trl_metrics.items():
        if k in ours:
            assert_close(ours[k], v, "metric " + k)


def dropin_run(fn, c, cfg, given, dtype=torch.float32):
    """fn (TRL's _compute_loss or the drop-in) on a fresh stand-in: loss,
    gradients w.r.t. logp and entropy, and everything it logged."""
    logp, ent, inp = trl_inputs(c, given, dtype)
    s = O.stand_in(logp, ent, **cfg)
    loss = fn(s, None, inp)
    dl, de = torch.autograd.grad(loss, (logp, ent), allow_unused=True)
    zero = torch.zeros_like(logp)
    logged = {m: dict(d) for m, d in s._metrics.items()}
    return (loss.item(), (zero if dl is None else dl).numpy(),
            (zero if de is None else de).numpy(), logged, s)


@pytest.mark.parametrize("loss_type,level,option", PARAMS)
def test_trl_dropin_matches_trl(loss_type, level, option):
    """GRPOTrainer._compute_loss replaced by the drop-in: TRL's loss, gradients
    and logged metrics (fp32 both sides)."""
    from lmloss.integrations import trl as lmloss_trl

    cfg, given = OPTIONS[option]
    cfg = dict(cfg, loss_type=loss_type, importance_sampling_level=level)
    c = case(b=3, t=6, seed=2000 + PARAMS.index((loss_type, level, option)),
             adv_tokens="adv_tokens" in given)
    got = dropin_run(lmloss_trl.grpo_compute_loss, c, cfg, given)
    want = dropin_run(O.GRPOTrainer._compute_loss, c, cfg, given)
    assert_close(got[0], want[0], "loss", rtol=1e-5, atol=1e-6)
    assert_close(got[1], want[1], "dlogp", rtol=1e-5, atol=1e-7)
    assert_close(got[2], want[2], "dentropy", rtol=1e-5, atol=1e-7)
    assert got[3].keys() == want[3].keys()
    for mode in want[3]:
        assert got[3][mode].keys() == want[3][mode].keys()
        for k, v in want[3][mode].items():
            assert_close(got[3][mode][k], v, "metric %s/%s" % (mode, k), rtol=1e-5, atol=1e-7)


def test_trl_dropin_adaptive_entropy_controller():
    """use_adaptive_entropy: the bonus gated by the last window's entropy and
    the coefficient's update, step after step, as TRL's."""
    from lmloss.integrations import trl as lmloss_trl

    cfg = dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.05,
               entropy_target=1.4, top_entropy_quantile=0.6)
    c = case(seed=7)
    states = []
    for fn in (lmloss_trl.grpo_compute_loss, O.GRPOTrainer._compute_loss):
        s = O.stand_in(torch.tensor(c["logp"], requires_grad=True),
                       torch.tensor(c["entropy"], requires_grad=True), **cfg)
        inp = O.inputs(torch.tensor(c["mask"]), torch.tensor(c["adv"]),
                       old=torch.tensor(c["old"]))
        losses = []
        for step in range(4):
            s._last_world_entropy = (1.0, 2.0, float("inf"), 0.5)[step]
            losses.append(fn(s, None, inp).item())
        states.append((losses, s.entropy_coef, s._last_world_entropy,
                       dict(s._metrics["train"])))
    assert_close(states[0][0], states[1][0], "losses", rtol=1e-5, atol=1e-7)
    assert_close(states[0][1:3], states[1][1:3], "controller", rtol=1e-6)
    for k, v in states[1][3].items():
        assert_close(states[0][3][k], v, "metric " + k, rtol=1e-5, atol=1e-7)


def test_trl_enable_patches_and_restores_compute_loss():
    from lmloss.integrations import trl as lmloss_trl

    orig = O.GRPOTrainer._compute_loss
    lmloss_trl.enable()
    try:
        assert O.GRPOTrainer._compute_loss is lmloss_trl.grpo_compute_loss
    finally:
        lmloss_trl.disable()
    assert O.GRPOTrainer._compute_loss is orig


def test_ratio_from_the_difference_at_log_probs_near_minus_1000():
    """exp(logp) and exp(old) both underflow (to 0 in fp64 too), their ratio
    exp(logp - old) does not: each loss type reads it as TRL's fp64 does."""
    c = case(b=3, t=5, seed=11)
    for k in ("logp", "old", "ref", "sampling"):
        c[k] = (c[k] - 1000.0).astype(np.float32)
    assert np.exp(np.float64(c["logp"])).max() == 0
    for loss_type in LOSS_TYPES:
        cfg = dict(loss_type=loss_type, beta=0.05)
        r = lmloss.grpo_loss(c["logp"], c["adv"], c["mask"], grad=True,
                             **lmloss_args(c, cfg, ("ref",)))
        loss64, dl64, _, _ = trl(c, cfg, ("ref",), torch.float64)
        assert_close(r.loss, loss64, loss_type + " loss")
        assert_close(r.dlogp, dl64, loss_type + " dlogp")


def test_k3_of_small_differences_does_not_cancel():
    """beta's k3 = e^d - 1 - d at d = ref - logp of 1e-3 .. 1e-6 and log-probs
    near 0: lmloss's to 1e-6 of the exact value (fp64 expm1 series), where
    TRL's fp32 e^d - d - 1 cancels (1e-2 off and worse)."""
    logp = np.array([[-1e-6, -3e-5, -2e-3, -0.5]], np.float32)
    ref = (logp + np.array([[1e-6, -4e-6, 1e-4, -1e-3]], np.float32)).astype(np.float32)
    mask = np.ones_like(logp)
    adv = np.zeros(1, np.float32)
    r = lmloss.grpo_loss(logp, adv, mask, ref_logp=ref, beta=1.0, loss_type="bnpo", grad=True)
    d = np.float64(ref) - np.float64(logp)
    k3 = d * d * (0.5 + d / 6 + d * d / 24 + d ** 3 / 120)
    assert_close(r.loss, k3.mean(), "k3 mean")
    assert_close(r.dlogp, -np.expm1(d) / 4, "k3 gradient")
    m = r.metrics
    assert_close(m["kl"] / m["tokens"], k3.mean(), "kl metric")
    c = dict(logp=logp, mask=mask, adv=adv, old=logp, ref=ref, sampling=logp, entropy=mask,
             is_token=mask, is_seq=mask[:, :1], items=np.float32(4))
    loss32 = trl(c, dict(loss_type="bnpo", beta=1.0), ("ref",), torch.float32)[0]
    assert abs(loss32 - k3.mean()) > 1e-2 * k3.mean()  # what exactness buys


def test_masked_tokens_are_not_read():
    """Padding may hold anything (NaN, inf): m = 0 tokens add nothing and get a
    zero gradient; the result equals that of finite padding."""
    c = case(seed=5)
    pad = c["mask"] == 0
    base = lmloss.grpo_loss(c["logp"], c["adv"], c["mask"], grad=True,
                            **lmloss_args(c, dict(loss_type="grpo", beta=0.1), ("ref",)))
    for k, v in (("logp", np.nan), ("old", np.inf), ("ref", -np.inf), ("entropy", np.nan)):
        c[k] = np.where(pad, v, c[k]).astype(np.float32)
    r = lmloss.grpo_loss(c["logp"], c["adv"], c["mask"], grad=True,
                         **lmloss_args(c, dict(loss_type="grpo", beta=0.1), ("ref",)))
    assert r.loss == base.loss
    assert np.array_equal(r.dlogp, base.dlogp) and not r.dlogp[pad].any()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_sequence_and_empty_sequences(loss_type):
    """B = 1, and a batch whose every sequence is empty (loss 0, TRL's too)."""
    for b, empty in ((1, False), (3, True)):
        c = case(b=b, t=4, seed=3)
        if empty:
            c["mask"][:] = 0
        cfg = dict(loss_type=loss_type, beta=0.02, entropy_coef=0.01)
        r = lmloss.grpo_loss(c["logp"], c["adv"], c["mask"], grad=True,
                             **lmloss_args(c, cfg, ("ref",)))
        loss64, dl64, de64, _ = trl(c, cfg, ("ref",), torch.float64)
        assert_close(r.loss, loss64, "loss")
        assert_close(r.dlogp, dl64, "dlogp")
        assert_close(r.dentropy, de64, "dentropy")


def test_results_do_not_depend_on_threads():
    c = case(b=67, t=301, seed=9)
    cfg = dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
               entropy_coef=0.01, top_entropy_quantile=0.3)
    runs = [lmloss.grpo_loss(c["logp"], c["adv"], c["mask"], grad=True, num_threads=n,
                             backend=be, **lmloss_args(c, cfg, ("ref",)))
            for n, be in ((1, "cpu"), (2, "cpu"), (3, "cpu"), (1, "ref"))]
    for r in runs[1:]:
        assert r.loss == runs[0].loss
        assert np.array_equal(r.dlogp, runs[0].dlogp)
        assert np.array_equal(r.dentropy, runs[0].dentropy)


def test_bad_input_says_what():
    c = case(seed=1)
    lp, adv, m = c["logp"], c["adv"], c["mask"]
    for kw, status in ((dict(loss_type="ppo"), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(importance_sampling_level="batch"), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(epsilon=float("nan")), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(beta=0.1), "LMLOSS_ERR_BAD_OPTION"),  # no ref_logp
                       (dict(entropy_coef=0.1), "LMLOSS_ERR_BAD_OPTION"),  # no entropy
                       (dict(gradient_accumulation_steps=0), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(num_items=-1.0), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(delta=-1.0), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(old_logp=lp[:, :3]), "LMLOSS_ERR_BAD_SHAPE"),
                       (dict(importance_sampling_ratio=lp[:, :2]), "LMLOSS_ERR_BAD_SHAPE")):
        with pytest.raises(lmloss.Error) as e:
            lmloss.grpo_loss(lp, adv, m, **kw)
        assert e.value.status == status, kw
    with pytest.raises(lmloss.Error) as e:
        lmloss.grpo_loss(lp[:0], adv[:0], m[:0])
    assert e.value.status == "LMLOSS_ERR_BAD_SHAPE"


def test_torch_compile_fullgraph():
    """grpo_loss traces without graph breaks (options as plain Python, the
    entropy quantile and divisor as tensor ops) and gives eager's loss and
    gradients."""
    c = case(seed=21)
    kw = torch_args(c, dict(loss_type="sapo", beta=0.05, entropy_coef=0.02,
                            top_entropy_quantile=0.6), ("ref",))

    def step(fn):
        logp = torch.tensor(c["logp"], requires_grad=True)
        ent = kw["entropies"].detach().clone().requires_grad_()
        loss = fn(logp, torch.tensor(c["adv"]), torch.tensor(c["mask"]), ent)
        loss.backward()
        return loss, logp.grad, ent.grad

    def f(logp, adv, mask, ent):
        return lt.grpo_loss(logp, adv, mask, **dict(kw, entropies=ent))

    for a, b in zip(step(torch.compile(f, fullgraph=True)), step(f)):
        assert torch.equal(a, b)


def trl_is_ratio(c, mode, lo, hi):
    """vLLM's IS ratio as TRL's _generate_and_score_completions forms it."""
    d = np.nan_to_num((np.float64(c["old"]) - c["sampling"]) * c["mask"], nan=0.0)
    if mode.startswith("sequence"):
        d = d.sum(1, keepdims=True)
    r = np.exp(d)
    lo_ = -np.inf if lo is None else lo
    hi_ = np.inf if hi is None else hi
    if mode.endswith("truncate"):
        return np.clip(r, lo_, hi_)
    return np.where((r < lo_) | (r > hi_), 0.0, r)


@pytest.mark.parametrize("loss_type,mode", [
    (t, m) for t in LOSS_TYPES
    for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    if not (t == "vespo" and m.startswith("sequence"))])  # TRL refuses that pair
def test_vllm_is_modes_form_trls_ratio(loss_type, mode):
    """vllm_importance_sampling_mode: the ratio formed in the C call gives
    what TRL's ratio (formed as TRL forms it, passed in) gives; NaN
    sampling log-probs read as no correction."""
    c = case(seed=31)
    c["sampling"] = (c["old"] + np.random.default_rng(2).normal(0, 0.4, c["old"].shape)
                     ).astype(np.float32)
    c["sampling"][0, 1] = np.nan
    lo, hi = (0.7, 1.6) if "mask" in mode else (None, 1.3)
    cfg = dict(loss_type=loss_type, beta=0.02)
    base = lmloss_args(c, cfg, ("ref",))
    r = lmloss.grpo_loss(c["logp"], c["adv"], c["mask"], grad=True, sampling_logp=c["sampling"],
                         vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=lo,
                         vllm_importance_sampling_clip_max=hi,
                         **{k: v for k, v in base.items() if k != "sampling_logp"})
    c[mode] = trl_is_ratio(c, mode, lo, hi).astype(np.float32)
    loss64, dl64, _, _ = trl(c, dict(cfg, use_vllm=True), ("ref", mode), torch.float64)
    assert_close(r.loss, loss64, "loss")
    assert_close(r.dlogp, dl64, "dlogp")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_from_hidden_states_through_the_fused_head(loss_type):
    """The composition a trainer runs: lt.linear_log_probs (the fused head,
    log-probs and entropy) into grpo_loss, backward into the hidden states
    and the head; against TRL's _compute_loss on torch's own log-softmax of
    the materialized logits (fp64), gradients w.r.t. hidden and weight."""
    b, t, h, v = 3, 5, 16, 37
    g = torch.Generator().manual_seed(8)
    hidden0, weight0 = torch.randn(b * t, h, generator=g), torch.randn(v, h, generator=g) * 0.5
    ids = torch.randint(0, v, (b * t,), generator=g)
    c = case(b=b, t=t, seed=12)
    cfg = dict(loss_type=loss_type, beta=0.04, entropy_coef=0.02, top_entropy_quantile=0.6,
               temperature=0.7)
    kw = torch_args(c, {k: v for k, v in cfg.items() if k != "temperature"}, ("ref",))
    kw.pop("entropies")
    out = []
    for ours in (True, False):
        dt = torch.float32 if ours else torch.float64
        hidden = hidden0.to(dt, copy=True).requires_grad_()
        weight = weight0.to(dt, copy=True).requires_grad_()
        if ours:
            logp, ent = lt.linear_log_probs(hidden, weight, ids, temperature=0.7, entropy=True)
            loss = lt.grpo_loss(logp.reshape(b, t), torch.tensor(c["adv"]),
                                torch.tensor(c["mask"]), entropies=ent.reshape(b, t), **kw)
        else:
            logits = hidden @ weight.T / 0.7
            lsm = torch.log_softmax(logits, -1)
            logp = lsm.gather(-1, ids[:, None])[:, 0].reshape(b, t)
            ent = -(lsm.exp() * lsm).sum(-1).reshape(b, t)
            inp = O.inputs(torch.tensor(c["mask"], dtype=torch.float64),
                           torch.tensor(c["adv"], dtype=torch.float64),
                           old=torch.tensor(c["old"], dtype=torch.float64),
                           ref=torch.tensor(c["ref"], dtype=torch.float64),
                           num_items=torch.tensor(c["items"], dtype=torch.float64))
            loss = O.trl_loss(logp, ent, inp,
                              **{k: v for k, v in cfg.items() if k != "temperature"})[0]
        loss.backward()
        out.append((loss.item(), hidden.grad.double().numpy(), weight.grad.double().numpy()))
    # the fused head's fp32 against fp64: its contract's 1e-4 (design.md)
    for k, what in enumerate(("loss", "d hidden", "d weight")):
        assert_close(out[0][k], out[1][k], what, rtol=1e-4)


class TwinAccelerator(O.Accelerator):
    """Two processes holding the same batch: gathers repeat a tensor, sums
    double; what the drop-in's multi-process paths (the entropy threshold
    over every process's tokens, reduced metric sums, the divisor per
    process) meet."""

    num_processes = 2

    def gather(self, x):
        return torch.cat([x.reshape(-1), x.reshape(-1)]) if x.dim() else torch.stack([x, x])

    def gather_for_metrics(self, x):
        return self.gather(x)

    def reduce(self, x, reduction="sum"):
        return 2 * x


@pytest.mark.parametrize("option", ["everything", "bonus", "off_policy", "kl_bias"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "vespo"])
def test_trl_dropin_on_two_processes(loss_type, option):
    """The drop-in against TRL's own under a two-process accelerator."""
    from lmloss.integrations import trl as lmloss_trl

    cfg, given = OPTIONS[option]
    cfg = dict(cfg, loss_type=loss_type)
    c = case(b=3, t=6, seed=77)
    runs = []
    for fn in (lmloss_trl.grpo_compute_loss, O.GRPOTrainer._compute_loss):
        def tt(x):
            return torch.tensor(x)
        logp, ent = tt(c["logp"]).requires_grad_(), tt(c["entropy"]).requires_grad_()
        is_key = ratio_key(given)
        inp = O.inputs(tt(c["mask"]), tt(c["adv"]), old=tt(c["old"]),
                       ref=tt(c["ref"]) if "ref" in given else None,
                       sampling=tt(c["sampling"]) if "sampling" in given else None,
                       is_ratio=tt(c[is_key]) if is_key else None, num_items=tt(c["items"]))
        s = O.stand_in(logp, ent, **cfg)
        s.accelerator = TwinAccelerator()
        s.get_high_entropy_mask = types.MethodType(O.GRPOTrainer.get_high_entropy_mask, s)
        loss = fn(s, None, inp)
        dl, de = torch.autograd.grad(loss, (logp, ent), allow_unused=True)
        runs.append((loss.item(), dl.numpy(), torch.zeros_like(ent) if de is None else de,
                     dict(s._metrics["train"])))
    assert_close(runs[0][0], runs[1][0], "loss", rtol=1e-5, atol=1e-6)
    assert_close(runs[0][1], runs[1][1], "dlogp", rtol=1e-5, atol=1e-7)
    assert_close(runs[0][2].numpy(), runs[1][2].numpy(), "dentropy", rtol=1e-5, atol=1e-7)
    assert runs[0][3].keys() == runs[1][3].keys()
    for k, v in runs[1][3].items():
        assert_close(runs[0][3][k], v, "metric " + k, rtol=1e-5, atol=1e-7)


ON_LOGITS = ["plain", "kl", "kl_bias", "delta", "off_policy", "vllm_token", "vllm_seq",
             "adv_tokens"]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("option", ON_LOGITS)
def test_on_logits_matches_trl(loss_type, level, option):
    """grpo_loss_on_logits against TRL's loss of log_softmax(logits / 0.7)
    at the tokens, in float64 with autograd down to the logits (a third of
    the tokens peaked by 15: 21 nats at this temperature, where float64's
    log-softmax is still exact; the C tests hold the peaks beyond to REF):
    the loss, the logits' gradient at an upstream of 1.5, the metrics and
    the log-probs it returns."""
    cfg, given = OPTIONS[option]
    cfg = dict(cfg, loss_type=loss_type, importance_sampling_level=level)
    seed = 5000 + 100 * LOSS_TYPES.index(loss_type) + ON_LOGITS.index(option)
    c = case(b=4, t=9, seed=seed, adv_tokens="adv_tokens" in given)
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 2, (4, 9, 257)).astype(np.float32)
    tok = rng.integers(0, 257, (4, 9))
    x.reshape(-1, 257)[np.arange(0, 36, 3), tok.reshape(-1)[::3]] += 15
    x64 = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    logp64 = (x64 / 0.7).log_softmax(-1).gather(-1, torch.tensor(tok)[..., None])[..., 0]
    _, ent, inp = trl_inputs(c, given, torch.float64)
    loss64, s = O.trl_loss(logp64, ent, inp, **cfg)
    (g64,) = torch.autograd.grad(loss64, x64)

    kw = torch_args(c, cfg, given)
    xt = torch.tensor(x, requires_grad=True)
    loss, metrics, logp = lt.grpo_loss_on_logits(
        xt, torch.tensor(tok), torch.tensor(c["adv"]), torch.tensor(c["mask"]),
        temperature=0.7, return_metrics=True, return_logps=True, **kw)
    (1.5 * loss).backward()
    assert_close(loss.item(), loss64.item(), "loss", rtol=1e-5)
    assert_close(xt.grad.numpy() / 1.5, g64.numpy(), "dlogits", rtol=2e-5)
    assert_close(logp.numpy(), logp64.detach().numpy(), "logp", rtol=1e-5, atol=1e-6)
    ours = lmloss._grpo.trl_metrics(lt_grpo.metrics_dict(metrics), loss_type, cfg.get("beta", 0.0))
    mode = "train" if cfg.get("training", True) else "eval"
    for k, v in s._metrics[mode].items():
        if k in ours:
            assert_close(ours[k], v[-1], "metric " + k, rtol=1e-5)


def test_on_logits_second_backward_says_why():
    """The gradient grpo_loss_on_logits formed in its forward is spent by
    the first backward: a second through the same graph raises, never a
    silent zero."""
    x = torch.randn(2, 3, 11, requires_grad=True)
    loss = lt.grpo_loss_on_logits(x, torch.randint(0, 11, (2, 3)), torch.randn(2),
                                  torch.ones(2, 3))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="spent"):
        loss.backward()
