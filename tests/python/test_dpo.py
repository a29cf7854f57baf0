"""lmloss.dpo_loss and lmloss.torch.dpo_loss against TRL's own
DPOTrainer._compute_loss, called with a stand-in self and model whose
fused-head outputs are given per-token log-probs: every loss type, each
f-divergence where TRL allows it, label smoothing, combined loss types
with weights, WPO's weighting; loss and gradient w.r.t. the per-token
log-probs (through the sums) to 1e-6 relative, and the rewards TRL logs.
Then the exact forms where TRL's fp32 rounds (large margins), and bad
input."""

import collections
import types

import numpy as np
import pytest

import lmloss

torch = pytest.importorskip("torch")
pytest.importorskip("trl.trainer.dpo_trainer")  # TRL and its trainers' own dependencies

import lmloss.torch as lt  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402

LOSS_TYPES = lmloss._lib.PREF_TYPES[:15]  # DPOTrainer's; CPO's and ORPO's follow
F_DIV_TYPES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x


def case(p=6, t=7, seed=0, scale=1.0):
    """Per-token log-probs of 2P completions ([chosen; rejected]) after a
    one-token prompt, their masks and reference sums."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((2 * p, t + 1), np.int64)
    for i in range(2 * p):
        mask[i, 1:1 + rng.integers(1, t + 1)] = 1
    # multiples of 2^-12: their sums are exact in fp32, as TRL's fp64 forms them
    logp = np.round(-rng.uniform(0.01, 2.0, (2 * p, t)) * scale * 4096) / 4096
    logp = (logp * mask[:, 1:]).astype(np.float32)
    sums = logp.astype(np.float64).sum(1)
    ref = (sums + rng.normal(0, 1.0 * scale, 2 * p)).astype(np.float32)
    lss = (logp - rng.uniform(0.5, 3.0, (2 * p, t))).astype(np.float32)
    return dict(logp=logp, mask=mask, ref=ref, lss=lss, p=p)


def trl(c, cfg, dtype=torch.float64):
    """TRL's loss, its gradient w.r.t. the per-token log-probs, and logged
    metrics; in fp32 for the alpha divergence (TRL's clip of its exponent
    knows no fp64)."""
    if cfg.get("f_divergence_type") == "alpha_divergence":
        dtype = torch.float32
    return _trl(c, cfg, dtype)


def stand_in(c, cfg, dtype):
    """(self, model, inputs, per-token log-probs) for DPOTrainer._compute_loss:
    the model returns the case's fused-head outputs."""
    p = c["p"]
    logp = torch.tensor(c["logp"], dtype=dtype, requires_grad=True)
    mask = torch.tensor(c["mask"])
    rng = np.random.default_rng(1)
    outputs = types.SimpleNamespace(
        log_probs=logp, entropy=torch.tensor(rng.uniform(0, 2, logp.shape), dtype=dtype),
        mean_logits=torch.tensor(rng.normal(0, 1, logp.shape), dtype=dtype),
        is_top1=torch.tensor(rng.uniform(size=logp.shape) < 0.5),
        log_sum_sq_probs=torch.tensor(c["lss"], dtype=dtype))
    args = types.SimpleNamespace(discopop_tau=cfg.get("discopop_tau", 0.05),
                                 gradient_checkpointing_kwargs=None)
    types_ = cfg.get("loss_type", ["sigmoid"])
    s = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(),
        aux_loss_enabled=False, ld_alpha=cfg.get("ld_alpha"), precompute_ref_logps=True,
        f_divergence_type=cfg.get("f_divergence_type", "reverse_kl"),
        f_alpha_divergence_coef=cfg.get("f_alpha_divergence_coef", 0.5), loss_types=types_,
        loss_weights=cfg.get("loss_weights") or [1.0] * len(types_), beta=cfg.get("beta", 0.1),
        label_smoothing=cfg.get("label_smoothing", 0.0), args=args,
        use_weighting=cfg.get("use_weighting", False),
        _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    ref = torch.tensor(c["ref"], dtype=dtype)
    inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask),
              "completion_mask": mask, "ref_chosen_logps": ref[:p], "ref_rejected_logps": ref[p:]}
    return s, (lambda **kw: outputs), inputs, logp


def _trl(c, cfg, dtype, fn=None):
    s, model, inputs, logp = stand_in(c, cfg, dtype)
    loss = (fn or DPOTrainer._compute_loss)(s, model, inputs, False)
    (g,) = torch.autograd.grad(loss, (logp,))
    metrics = {k: v[-1] for k, v in s._metrics["train"].items()}
    # on the completions' tokens (the fused head's log-probs elsewhere are
    # constants: labels -100)
    return loss.item(), g.double().numpy() * c["mask"][:, 1:], metrics


def wpo_weight(c):
    """WPO's pair weights as TRL forms them (the product of the two
    sequences' exp of their mean aligned log-prob)."""
    m = c["mask"][:, 1:]
    mean = ((c["logp"].astype(np.float64) - c["lss"]) * m).sum(1) / np.maximum(m.sum(1), 1)
    w = np.exp(mean)
    return (w[:c["p"]] * w[c["p"]:]).astype(np.float32)


def dpo_kwargs(cfg):
    """lmloss's dpo_loss keywords for a TRL DPOConfig's (cfg)."""
    return dict(loss_type=cfg.get("loss_type", ["sigmoid"]), loss_weights=cfg.get("loss_weights"),
                beta=cfg.get("beta", 0.1), label_smoothing=cfg.get("label_smoothing", 0.0),
                f_divergence_type=cfg.get("f_divergence_type", "reverse_kl"),
                f_alpha_divergence_coef=cfg.get("f_alpha_divergence_coef", 0.5),
                discopop_tau=cfg.get("discopop_tau", 0.05))


def trl_rtol(cfg):
    """How close to TRL's fp64 loss: its alpha divergence clips in fp32."""
    return 1e-5 if cfg.get("f_divergence_type") == "alpha_divergence" else 1e-6


def ours(c, cfg, api="numpy"):
    """lmloss's loss and the gradient w.r.t. the per-token log-probs (the
    sums' gradient on each token of its completion)."""
    p, m = c["p"], c["mask"]
    sums = c["logp"].astype(np.float64).sum(1).astype(np.float32)
    tokens = m.sum(1).astype(np.float32)  # TRL's ipo / sigmoid_norm count the unshifted mask
    kw = dpo_kwargs(cfg)
    w = wpo_weight(c) if cfg.get("use_weighting") else None
    if api == "numpy":
        r = lmloss.dpo_loss(sums[:p], sums[p:], c["ref"][:p], c["ref"][p:], grad=True,
                            chosen_tokens=tokens[:p], rejected_tokens=tokens[p:], weight=w, **kw)
        loss, d, metrics = r.loss, np.concatenate([r.dchosen, r.drejected]), r.metrics
    else:
        s = torch.tensor(sums, requires_grad=True)
        tt = torch.tensor
        loss, mt = lt.dpo_loss(s[:p], s[p:], tt(c["ref"][:p]), tt(c["ref"][p:]),
                               chosen_tokens=tt(tokens[:p]), rejected_tokens=tt(tokens[p:]),
                               weight=None if w is None else tt(w), return_metrics=True, **kw)
        (3.0 * loss).backward()
        loss, d = loss.item(), s.grad.numpy() / 3.0
        metrics = dict(zip(lmloss._preference.METRIC_NAMES, mt.tolist()))
    return loss, d[:, None] * m[:, 1:], metrics


def assert_close(got, want, what, rtol=1e-6):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.max(np.abs(want)), 1e-30)
    err = np.max(np.abs(got - want) - rtol * np.abs(want) - rtol * 1e-3 * scale, initial=0)
    assert err <= 0, "%s: got %s, want %s" % (what, got, want)


def configs():
    out = []
    for t in LOSS_TYPES:
        eps = 0.1 if t in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0
        out.append(("%s" % t, dict(loss_type=[t], label_smoothing=eps, beta=0.3)))
        if t in F_DIV_TYPES:
            for f in ("forward_kl", "js_divergence", "alpha_divergence"):
                out.append(("%s-%s" % (t, f), dict(loss_type=[t], label_smoothing=eps,
                                                   f_divergence_type=f, beta=0.2)))
        # TRL refuses AOT with weights; its hinge and sft break under them (in-place products)
        if t not in ("aot", "aot_unpaired", "hinge", "sft"):
            out.append(("%s-wpo" % t, dict(loss_type=[t], label_smoothing=eps,
                                           use_weighting=True)))
    out.append(("mixed", dict(loss_type=["sigmoid", "bco_pair", "sft"],
                              loss_weights=[0.8, 0.2, 1.0])))
    out.append(("alpha_1", dict(f_divergence_type="alpha_divergence",
                                f_alpha_divergence_coef=1.0)))
    out.append(("discopop_tau", dict(loss_type=["discopop"], discopop_tau=0.3, beta=0.5)))
    return out


CONFIGS = configs()


@pytest.mark.parametrize("api", ["numpy", "torch"])
@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[n for n, _ in CONFIGS])
def test_matches_trl(name, cfg, api):
    c = case(seed=[n for n, _ in CONFIGS].index(name))
    loss, d, metrics = ours(c, cfg, api)
    loss64, d64, trl_metrics = trl(c, cfg)
    rtol = trl_rtol(cfg)
    assert_close(loss, loss64, "loss", rtol)
    assert_close(d, d64, "d logp", rtol)
    got = lmloss._preference.trl_metrics(metrics)
    for k, v in got.items():
        assert_close(v, trl_metrics[k], "metric " + k)


def test_large_margins_stay_exact():
    """Margins of hundreds of nats: sigmoid's loss e^-z and its gradient,
    apo's 1 - sigmoid, forward KL's 1 - e^-x to full precision (fp64 TRL
    agrees; TRL's fp32 rounds 1 - sigmoid to 0)."""
    c = case(seed=3, scale=40.0)
    for t in ("sigmoid", "apo_zero", "apo_down", "bco_pair", "nca_pair"):
        cfg = dict(loss_type=[t], beta=1.0)
        loss, d, _ = ours(c, cfg)
        loss64, d64, _ = trl(c, cfg)
        assert_close(loss, loss64, t + " loss")
        assert_close(d, d64, t + " d logp")


def test_bad_input_says_what():
    c = np.zeros(3, np.float32)
    for kw, status in ((dict(loss_type="dpo"), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(beta=0.0), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(loss_type="ipo"), "LMLOSS_ERR_BAD_OPTION"),  # no token counts
                       (dict(loss_type="exo_pair"), "LMLOSS_ERR_BAD_OPTION"),  # smoothing 0
                       (dict(loss_type="robust", label_smoothing=0.5), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(loss_type="aot", weight=c), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(f_divergence_type="kl"), "LMLOSS_ERR_BAD_OPTION"),
                       (dict(loss_type=["sigmoid"], loss_weights=[1, 2]),
                        "LMLOSS_ERR_BAD_OPTION"),
                       (dict(ref_chosen_logps=c[:2]), "LMLOSS_ERR_BAD_SHAPE")):
        with pytest.raises(lmloss.Error) as e:
            lmloss.dpo_loss(c, c, **kw)
        assert e.value.status == status, kw


DROPIN = [(n, cfg) for n, cfg in CONFIGS if "alpha_divergence" not in n] + [
    ("ld_alpha", dict(ld_alpha=0.5, loss_type=["sigmoid", "ipo"])),
    ("ld_alpha_sft", dict(ld_alpha=0.5, loss_type=["sft"]))]


@pytest.mark.parametrize("name,cfg", DROPIN, ids=[n for n, _ in DROPIN])
def test_trl_dropin_matches_trl(name, cfg):
    """DPOTrainer._compute_loss replaced by the drop-in: TRL's loss, gradient
    and every logged metric (LD-DPO's ld_alpha too), the model's outputs in
    fp64 on both sides (the drop-in hands lmloss their fp32 values, exact
    here)."""
    from lmloss.integrations import trl as lmloss_trl

    c = case(seed=50 + [n for n, _ in DROPIN].index(name))
    got = _trl(c, cfg, torch.float64, lmloss_trl.dpo_compute_loss)
    want = _trl(c, cfg, torch.float64)
    assert_close(got[0], want[0], "loss")
    assert_close(got[1], want[1], "d logp")
    assert got[2].keys() == want[2].keys()
    for k, v in want[2].items():
        assert_close(got[2][k], v, "metric " + k)


def test_trl_enable_patches_and_restores_dpo():
    from lmloss.integrations import trl as lmloss_trl

    orig = DPOTrainer._compute_loss
    lmloss_trl.enable()
    try:
        assert DPOTrainer._compute_loss is lmloss_trl.dpo_compute_loss
    finally:
        lmloss_trl.disable()
    assert DPOTrainer._compute_loss is orig


def test_torch_compile_fullgraph():
    """dpo_loss traces without graph breaks and gives eager's results."""
    g = torch.Generator().manual_seed(0)
    c0, r0 = torch.randn(5, generator=g) - 20, torch.randn(5, generator=g) - 22

    def step(fn):
        c, r = c0.clone().requires_grad_(), r0.clone().requires_grad_()
        loss = fn(c, r)
        loss.backward()
        return loss, c.grad, r.grad

    def f(c, r):
        return lt.dpo_loss(c, r, c0 + 0.5, r0 - 0.5, loss_type=["sigmoid", "apo_down"],
                           loss_weights=[1.0, 0.3], f_divergence_type="js_divergence")

    for a, b in zip(step(torch.compile(f, fullgraph=True)), step(f)):
        assert torch.equal(a, b)


def cpo_stand_in(cls, **kw):
    return types.SimpleNamespace(accelerator=_Accelerator(), **kw)


CPO = [("sigmoid", 0.0, 0.0), ("sigmoid", 0.1, 0.0), ("hinge", 0.0, 0.0), ("ipo", 0.0, 0.0),
       ("simpo", 0.1, 0.0), ("sigmoid", 0.0, 0.3), ("simpo", 0.0, -0.2), ("ipo", 0.0, 0.5)]


@pytest.mark.parametrize("loss_type,eps,alpha", CPO)
@pytest.mark.parametrize("api", ["numpy", "torch"])
def test_cpo_matches_trl(loss_type, eps, alpha, api):
    """CPOTrainer.cpo_loss (trl.experimental), its per-pair losses and their
    gradient, AlphaPO's transform included (exact where TRL's 1 - p^-alpha
    cancels)."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    g = np.random.default_rng(5)
    c64 = -g.uniform(0.2, 3.0, 9)
    r64 = -g.uniform(0.2, 3.0, 9)
    s = cpo_stand_in(CPOTrainer, alpha=alpha, loss_type=loss_type, simpo_gamma=0.7, beta=0.3,
                     label_smoothing=eps)
    c, r = torch.tensor(c64, requires_grad=True), torch.tensor(r64, requires_grad=True)
    losses, _, _ = CPOTrainer.cpo_loss(s, c, r)
    w = torch.linspace(0.5, 1.5, 9, dtype=torch.float64)
    gc, gr = torch.autograd.grad((losses * w).sum(), (c, r))
    name = {"sigmoid": "cpo_sigmoid", "ipo": "cpo_ipo"}.get(loss_type, loss_type)
    kw = dict(loss_type=name, beta=0.3, label_smoothing=eps, simpo_gamma=0.7,
              f_divergence_type="alphapo", f_alpha_divergence_coef=alpha, reduction="none")
    c32, r32 = c64.astype(np.float32), r64.astype(np.float32)
    if api == "numpy":
        res = lmloss.dpo_loss(c32, r32, grad=True, **kw)
        got, dc, dr = res.loss, res.dchosen * w.numpy(), res.drejected * w.numpy()
    else:
        ct, rt = torch.tensor(c32, requires_grad=True), torch.tensor(r32, requires_grad=True)
        got = lt.dpo_loss(ct, rt, **kw)
        (got * w.float()).sum().backward()
        got, dc, dr = got.detach().numpy(), ct.grad.numpy(), rt.grad.numpy()
    # TRL on the fp32 values in fp64: the same inputs
    c, r = torch.tensor(c32, dtype=torch.float64, requires_grad=True), \
        torch.tensor(r32, dtype=torch.float64, requires_grad=True)
    losses, _, _ = CPOTrainer.cpo_loss(s, c, r)
    gc, gr = torch.autograd.grad((losses * w).sum(), (c, r))
    assert_close(got, losses.detach().numpy(), "losses")
    assert_close(dc, gc.numpy(), "d chosen", 2e-6)
    assert_close(dr, gr.numpy(), "d rejected", 2e-6)


@pytest.mark.parametrize("api", ["numpy", "torch"])
def test_orpo_matches_trl(api):
    """ORPOTrainer.odds_ratio_loss (trl.experimental): lmloss's "orpo" is minus
    its per-pair losses, with their gradient and the mean log odds it logs,
    on log-probs near 0 (log1mexp's cancelling side) and far below."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    c32 = np.array([-1e-4, -0.3, -2.0, -0.05, -7.0, -0.6], np.float32)
    r32 = np.array([-2e-3, -0.9, -0.4, -3.0, -0.01, -0.69], np.float32)
    s = types.SimpleNamespace(accelerator=_Accelerator(), beta=0.25)
    c = torch.tensor(c32, dtype=torch.float64, requires_grad=True)
    r = torch.tensor(r32, dtype=torch.float64, requires_grad=True)
    losses, _, _, _, log_odds = ORPOTrainer.odds_ratio_loss(s, c, r)
    gc, gr = torch.autograd.grad(losses.sum(), (c, r))
    if api == "numpy":
        res = lmloss.dpo_loss(c32, r32, loss_type="orpo", beta=0.25, reduction="none", grad=True)
        got, dc, dr, m = res.loss, res.dchosen, res.drejected, res.metrics
    else:
        ct, rt = torch.tensor(c32, requires_grad=True), torch.tensor(r32, requires_grad=True)
        got, mt = lt.dpo_loss(ct, rt, loss_type="orpo", beta=0.25, reduction="none",
                              return_metrics=True)
        got.sum().backward()
        got, dc, dr = got.detach().numpy(), ct.grad.numpy(), rt.grad.numpy()
        m = lt._preference.metrics_dict(mt)
    assert_close(got, -losses.detach().numpy(), "losses")
    assert_close(dc, -gc.numpy(), "d chosen", 2e-6)
    assert_close(dr, -gr.numpy(), "d rejected", 2e-6)
    assert_close(m["orpo_log_odds"] / m["pairs"], log_odds.item(), "mean log odds")


def kto_case(n=9, t=6, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.zeros((n, t + 1), np.int64)
    for i in range(n):
        mask[i, 1:1 + rng.integers(1, t + 1)] = 1
    logp = np.round(-rng.uniform(0.01, 2.0, (n, t)) * 4096) / 4096
    logp = (logp * mask[:, 1:]).astype(np.float32)
    ref = (logp.astype(np.float64).sum(1) + rng.normal(0, 1, n)).astype(np.float32)
    label = rng.uniform(size=n) < 0.5
    label[:2] = [True, False]
    kl_policy = rng.normal(-5, 1, n).astype(np.float32)
    kl_ref = (kl_policy - rng.normal(0.3, 0.2, n)).astype(np.float32)  # a KL of about 0.3
    return dict(logp=logp, mask=mask, ref=ref, label=label, kl_policy=kl_policy, kl_ref=kl_ref)


def trl_kto(c, cfg, fn=None):
    """KTOTrainer._compute_loss (or fn) on a stand-in self and model (fp64):
    the loss, its gradient w.r.t. the per-token log-probs, and logged
    metrics."""
    from trl.trainer.kto_trainer import KTOTrainer

    logp = torch.tensor(c["logp"], dtype=torch.float64, requires_grad=True)
    rng = np.random.default_rng(4)
    outputs = types.SimpleNamespace(
        log_probs=logp, entropy=torch.tensor(rng.uniform(0, 2, logp.shape)),
        mean_logits=torch.tensor(rng.normal(0, 1, logp.shape)))
    s = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(),
        aux_loss_enabled=False, precompute_ref_logps=True,
        calculate_KL=cfg.get("calculate_KL", True), loss_type=cfg.get("loss_type", "kto"),
        beta=cfg.get("beta", 0.1), desirable_weight=cfg.get("desirable_weight", 1.0),
        undesirable_weight=cfg.get("undesirable_weight", 1.0),
        _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        _compute_kl_logps=lambda model, batch: (
            torch.tensor(c["kl_policy"], dtype=torch.float64) if cfg.get("calculate_KL", True)
            else None))
    mask = torch.tensor(c["mask"])
    batch = {"label": torch.tensor(c["label"]), "input_ids": torch.zeros_like(mask),
             "attention_mask": torch.ones_like(mask), "completion_mask": mask,
             "ref_logps": torch.tensor(c["ref"], dtype=torch.float64),
             "ref_KL_logps": torch.tensor(c["kl_ref"], dtype=torch.float64)}
    loss = (fn or KTOTrainer._compute_loss)(s, lambda **kw: outputs, batch, False)
    (g,) = torch.autograd.grad(loss, (logp,))
    metrics = {k: v[-1] for k, v in s._metrics["train"].items()}
    return loss.item(), g.numpy() * c["mask"][:, 1:], metrics


KTO = [dict(), dict(beta=0.3, desirable_weight=1.33, undesirable_weight=0.7),
       dict(calculate_KL=False), dict(loss_type="apo_zero_unpaired", beta=0.2)]


@pytest.mark.parametrize("api", ["numpy", "torch"])
@pytest.mark.parametrize("cfg", KTO, ids=["kto", "weights", "no_kl", "apo_zero_unpaired"])
def test_kto_matches_trl(cfg, api):
    c = kto_case(seed=len(str(cfg)))
    loss64, d64, metrics = trl_kto(c, cfg)
    sums = c["logp"].astype(np.float64).sum(1).astype(np.float32)
    kl = None
    if cfg.get("calculate_KL", True):
        kl = max(float(np.mean(np.float64(c["kl_policy"]) - c["kl_ref"])), 0.0)
    kw = {k: v for k, v in cfg.items() if k != "calculate_KL"}
    if api == "numpy":
        r = lmloss.kto_loss(sums, c["ref"], c["label"], kl=kl, grad=True, **kw)
        loss, d, m = r.loss, r.dlogps, r.metrics
    else:
        s = torch.tensor(sums, requires_grad=True)
        loss, mt = lt.kto_loss(s, torch.tensor(c["ref"]), torch.tensor(c["label"]), kl,
                               return_metrics=True, **kw)
        (2.0 * loss).backward()
        loss, d = loss.item(), s.grad.numpy() / 2.0
        m = dict(zip(lmloss._preference.KTO_METRIC_NAMES, mt.tolist()))
    assert_close(loss, loss64, "loss")
    assert_close(d[:, None] * c["mask"][:, 1:], d64, "d logp")
    for k, v in lmloss._preference.kto_trl_metrics(m).items():
        assert_close(v, metrics[k], "metric " + k)


@pytest.mark.parametrize("cfg", KTO, ids=["kto", "weights", "no_kl", "apo_zero_unpaired"])
def test_kto_trl_dropin_matches_trl(cfg):
    """KTOTrainer._compute_loss replaced by the drop-in: TRL's loss, gradient
    and every logged metric."""
    from lmloss.integrations import trl as lmloss_trl

    c = kto_case(seed=40 + len(str(cfg)))
    got = trl_kto(c, cfg, lmloss_trl.kto_compute_loss)
    want = trl_kto(c, cfg)
    assert_close(got[0], want[0], "loss")
    assert_close(got[1], want[1], "d logp")
    assert got[2].keys() == want[2].keys()
    for k, v in want[2].items():
        assert_close(got[2][k], v, "metric " + k)


def test_trl_enable_patches_and_restores_kto():
    from lmloss.integrations import trl as lmloss_trl
    from trl.trainer.kto_trainer import KTOTrainer

    orig = KTOTrainer._compute_loss
    lmloss_trl.enable()
    try:
        assert KTOTrainer._compute_loss is lmloss_trl.kto_compute_loss
    finally:
        lmloss_trl.disable()
    assert KTOTrainer._compute_loss is orig


@pytest.mark.parametrize("loss_type,eps,alpha", CPO)
def test_cpo_and_orpo_trl_dropins_match_trl(loss_type, eps, alpha):
    """CPOTrainer.cpo_loss and ORPOTrainer.odds_ratio_loss replaced by the
    drop-ins: TRL's tuples, and the gradient of the per-pair losses."""
    from lmloss.integrations import trl as lmloss_trl
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    g = np.random.default_rng(6)
    c32 = (-g.uniform(0.01, 3.0, 7)).astype(np.float32)
    r32 = (-g.uniform(0.01, 3.0, 7)).astype(np.float32)
    w = torch.linspace(0.5, 1.5, 7, dtype=torch.float64)
    cpo = cpo_stand_in(CPOTrainer, alpha=alpha, loss_type=loss_type, simpo_gamma=0.7, beta=0.3,
                       label_smoothing=eps)
    orpo = types.SimpleNamespace(accelerator=_Accelerator(), beta=0.3)
    for s, ours, theirs in ((cpo, lmloss_trl.cpo_loss, CPOTrainer.cpo_loss),
                            (orpo, lmloss_trl.odds_ratio_loss, ORPOTrainer.odds_ratio_loss)):
        out = []
        for fn in (ours, theirs):
            c = torch.tensor(c32, dtype=torch.float64, requires_grad=True)
            r = torch.tensor(r32, dtype=torch.float64, requires_grad=True)
            res = fn(s, c, r)
            gc, gr = torch.autograd.grad((res[0] * w).sum(), (c, r))
            out.append([x.detach().double().numpy() for x in res] + [gc.numpy(), gr.numpy()])
        for k, (a, b) in enumerate(zip(*out)):
            assert_close(a, b, "output %d" % k, 2e-6)


def test_trl_enable_patches_cpo_and_orpo():
    from lmloss.integrations import trl as lmloss_trl
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    orig = CPOTrainer.cpo_loss, ORPOTrainer.odds_ratio_loss
    lmloss_trl.enable()
    try:
        assert CPOTrainer.cpo_loss is lmloss_trl.cpo_loss
        assert ORPOTrainer.odds_ratio_loss is lmloss_trl.odds_ratio_loss
    finally:
        lmloss_trl.disable()
    assert (CPOTrainer.cpo_loss, ORPOTrainer.odds_ratio_loss) == orig
