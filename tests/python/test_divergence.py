"""Divergences (lmloss.divergence; lmloss.torch's generalized_jsd, kl_div,
tvd; the TRL drop-in) against a float64 oracle written here and against
TRL's GKDTrainer.generalized_jsd_loss run in float64 on the same inputs
(those tests skip without TRL).

The oracle forms every term from d_j = log p_j - log q_j of a max-split
log-softmax (log p_a = -log1p(R) at the argmax, so a confident row's tiny
divergence survives): KL terms q_j (-d_j), JSD's log(q / M) and
log(p / M) as -log1p((1 - beta) expm1(d)) or -log1p(beta expm1(-d)),
whichever has no overflow, TVD's |p_j - q_j| as q_j |expm1(d_j)| (or
p_j |expm1(-d_j)|). Autograd gives its gradients w.r.t. the transformed
student logits z but at z's argmax, where autograd's sum of the row's
terms cancels (1/(1 + R) - q_a on a confident row); there the gradient is
minus the others' sum, as for any loss of softmax(z).

Tolerance: util.check's (fp32 results 1e-5 relative of the oracle above
the FLT_MIN floor; 16-bit gradients one rounding more). Every gradient
entry of a divergence is a difference of terms (p_j - q_j for KL, p_j
(d_j - D) for the reverse, likewise JSD, TVD and the CE term), so an
entry is also allowed 1e-5 of the largest |entry| of its row (bfloor).
"""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lmloss  # noqa: E402
import lmloss.torch as lt  # noqa: E402
import reference  # noqa: E402
import util  # noqa: E402
from lmloss.integrations import trl as ltrl  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
        TRL_JSD = GKDTrainer.generalized_jsd_loss  # TRL's own, before any enable()
    except ImportError:  # TRL is optional
        GKDTrainer = TRL_JSD = None
needs_trl = pytest.mark.skipif(TRL_JSD is None, reason="TRL (trl.experimental.gkd) not importable")

F64 = torch.float64
KINDS = [("kl", 0.5), ("reverse_kl", 0.5), ("tvd", 0.5)] + [("jsd", b) for b in
                                                           (0.0, 0.25, 0.5, 0.9, 1.0)]
IDS = ["%s-%g" % kb for kb in KINDS]


# ------------------------------------------------------------------ the oracle

def transform64(x, scale=1.0, softcap=0.0, temperature=1.0):
    f = reference.f32  # the options as the C structs hold them
    z = x * f(scale)
    if softcap:
        z = f(softcap) * torch.tanh(z / f(softcap))
    return z / f(temperature)


class Expm1(torch.autograd.Function):
    """expm1 whose derivative is exp(x): torch's, expm1(x) + 1, reads 0 below -37."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.expm1(x)

    @staticmethod
    def backward(ctx, g):
        return g * torch.exp(ctx.saved_tensors[0])


def log_softmax64(z):
    """Max-split log-softmax of float64 z [N, V]: exact at the argmax."""
    m, a = z.max(-1, keepdim=True)
    r = torch.exp(z - m).scatter(-1, a, 0.0).sum(-1, keepdim=True)
    return z - m - torch.log1p(r)


def oracle(s, t, kind="kl", beta=0.5, labels=None, ignore_index=-100, student=(1.0, 0.0, 1.0),
           teacher=None, soft=1.0, hard=0.0):
    """(per-row losses [N] float64, grad) for student and teacher logits (NumPy
    in any util form, or torch); grad(total) is the gradient [N, V] of a
    scalar `total` formed from the losses w.r.t. the student's logits."""
    def rows(a):
        a = a.detach().to(F64) if isinstance(a, torch.Tensor) else torch.from_numpy(
            reference.f64(a))
        return a.reshape(-1, a.shape[-1])

    x, y = rows(s).requires_grad_(), rows(t)
    zs = transform64(x, *student)
    lp, lq = log_softmax64(zs), log_softmax64(transform64(y, *(teacher or student)))
    p, q, d = lp.exp(), lq.exp(), lp - lq
    dn, dp = d.clamp(max=0), d.clamp(min=0)  # each form where it cannot overflow
    b = reference.f32(beta)
    if kind == "kl" or (kind == "jsd" and b == 0):
        div = (q * -d).sum(-1)
    elif kind == "reverse_kl" or (kind == "jsd" and b == 1):
        div = (p * d).sum(-1)
    elif kind == "jsd":
        a1 = -torch.log1p((1 - b) * Expm1.apply(dn))  # log(q / M) where d <= 0
        a2 = -torch.log1p(b * Expm1.apply(-dp))  # log(p / M) where d >= 0
        lqm, lpm = torch.where(d <= 0, a1, a2 - d), torch.where(d <= 0, a1 + d, a2)
        div = (b * q * lqm + (1 - b) * p * lpm).sum(-1)
    else:
        div = 0.5 * torch.where(d > 0, -p * Expm1.apply(-dp), -q * Expm1.apply(dn)).sum(-1)
    loss = reference.f32(soft) * div
    if labels is not None:
        lab = torch.as_tensor(np.asarray(labels)).reshape(-1)
        keep = lab != ignore_index
        if hard:
            ce = torch.nn.functional.cross_entropy(zs, torch.where(keep, lab, 0),
                                                   reduction="none")
            loss = loss + reference.f32(hard) * ce
        loss = torch.where(keep, loss, 0.0)

    def grad(total):
        gz = torch.autograd.grad(total, zs, retain_graph=True)[0]
        a = zs.detach().max(-1, keepdim=True)[1]  # log_softmax64's argmax
        gz = gz.scatter(-1, a, 0.0)
        gz = gz.scatter(-1, a, -gz.sum(-1, keepdim=True))
        return (gz * torch.autograd.grad(zs.sum(), x, retain_graph=True)[0]).numpy()

    return loss, grad


def row_floor(g):
    """bfloor: the largest |entry| of each gradient row (module docstring)."""
    g = np.asarray(g).reshape(-1, np.shape(g)[-1])
    return np.abs(g).max(-1, keepdims=True)


def check_rows(got_loss, got_grad, ref_rows, grad, form="f32", what=""):
    """Per-row losses and the gradient of their sum against the oracle's."""
    util.check(got_loss, ref_rows.detach().numpy().reshape(np.shape(got_loss)), what=what)
    g = grad(ref_rows.sum())
    util.check(np.asarray(got_grad).reshape(g.shape), g, form, row_floor(g), what + " grad")


# ------------------------------------------------------------------ inputs

def pair(rng, n, v, scale=3.0, gap=2.0):
    """student [n, v] float32 of scale * N(0, 1) and a teacher gap * N(0, 1) from it."""
    s = (rng.standard_normal((n, v)) * scale).astype(np.float32)
    return s, (s + gap * rng.standard_normal((n, v))).astype(np.float32)


def peaked_pair(rng, n, v, margin, same):
    """Rows whose student leads at y by `margin` (util.peaked) and whose teacher
    leads by margin + 1, at y when `same`, else at the next column."""
    s, y = util.peaked(rng, n, v, margin)
    t = rng.standard_normal((n, v)) * 2.0
    col = y if same else (y + 1) % v
    for i in range(n):
        t[i, col[i]] = np.delete(t[i], col[i]).max() + margin + 1.0
    return s, t.astype(np.float32)


def labels_for(rng, lead, v, ignored=0.3):
    y = rng.integers(0, v, lead)
    return np.where(rng.random(lead) < ignored, -100, y)


# ------------------------------------------------------------------ NumPy API

@pytest.mark.parametrize("backend", ["cpu", "ref"])
@pytest.mark.parametrize("kind,beta", KINDS, ids=IDS)
def test_every_kind_and_beta_against_the_oracle(kind, beta, backend):
    rng = np.random.default_rng(1)
    s, t = pair(rng, 6, 1003)
    y = labels_for(rng, 6, 1003)
    r = lmloss.divergence(s, t, kind=kind, beta=beta, labels=y, reduction="none", grad=True,
                          return_parts=True, backend=backend)
    ref, grad = oracle(s, t, kind, beta, labels=y)
    check_rows(r.loss, r.dstudent, ref, grad, what=kind)
    util.check(r.divergence, ref.detach().numpy(), what="parts")
    assert r.ce is not None and (r.ce[y == -100] == 0).all()
    assert (r.dstudent[y == -100] == 0).all()


@pytest.mark.parametrize("form", ["f32", "bf16"])
@pytest.mark.parametrize("kind,beta", KINDS, ids=IDS)
def test_identical_rows_give_exactly_zero(kind, beta, form):
    rng = np.random.default_rng(2)
    s = np.concatenate([pair(rng, 3, 301)[0], util.peaked(rng, 3, 301, 50.0)[0]])
    s = util.as_form(s, form)
    loss, g = lmloss.divergence(s, s.copy(), kind=kind, beta=beta, reduction="none", grad=True)
    assert (loss == 0).all() and (reference.f64(g) == 0).all()
    if kind == "jsd":  # the torch path, its gradient fused into the forward
        x = torch.from_numpy(reference.f64(s)).to(torch.bfloat16 if form == "bf16" else
                                                  torch.float32).requires_grad_()
        out = lt.generalized_jsd(x, x.detach().clone(), beta=beta)
        out.backward()
        assert out.item() == 0 and (x.grad == 0).all()


def test_divergences_are_never_negative():
    rng = np.random.default_rng(3)
    for scale, gap in ((0.1, 0.01), (3.0, 1e-3), (10.0, 5.0)):
        s, t = pair(rng, 64, 50, scale, gap)
        for kind, beta in KINDS:
            loss = lmloss.divergence(s, t, kind=kind, beta=beta, reduction="none")
            assert (loss >= 0).all(), (kind, beta, scale, loss.min())


@pytest.mark.parametrize("same", [True, False], ids=["same-peak", "other-peak"])
@pytest.mark.parametrize("margin", [0.0, 17.0, 50.0, 1000.0])
@pytest.mark.parametrize("kind,beta", KINDS, ids=IDS)
def test_peaked_rows_keep_loss_and_gradient(kind, beta, margin, same):
    # other-peak at margins 17 and 50 is where the reverse KL's and the
    # JSD's argmax entry once cancelled (delta_a against a KL near it)
    rng = np.random.default_rng(4)
    s, t = peaked_pair(rng, 4, 257, margin, same)
    loss, g = lmloss.divergence(s, t, kind=kind, beta=beta, reduction="none", grad=True)
    ref, grad = oracle(s, t, kind, beta)
    check_rows(loss, g, ref, grad, what="%s margin %g" % (kind, margin))


@pytest.mark.parametrize("kind,beta", KINDS, ids=IDS)
def test_small_student_teacher_gaps(kind, beta):
    rng = np.random.default_rng(5)
    s, t = pair(rng, 8, 1003, gap=1e-2)
    loss, g = lmloss.divergence(s, t, kind=kind, beta=beta, reduction="none", grad=True)
    ref, grad = oracle(s, t, kind, beta)
    check_rows(loss, g, ref, grad, what="gap 1e-2")


@pytest.mark.parametrize("kind,beta", KINDS, ids=IDS)
def test_flat_student_spiked_teacher(kind, beta):
    """(1 + Rt) / (1 + Rs) near 1e-4: where log1p(D / (1 + Rs)) would cancel
    D's rounding 1e4-fold (the JSD's gradient at the spike was 8e-5 off)."""
    rng = np.random.default_rng(8)
    s = rng.uniform(-3.0, 3.0, (4, 50257)).astype(np.float32)
    t = s.copy()
    t[np.arange(4), rng.integers(0, 50257, 4)] += 20.0
    loss, g = lmloss.divergence(s, t, kind=kind, beta=beta, reduction="none", grad=True)
    ref, grad = oracle(s, t, kind, beta)
    check_rows(loss, g, ref, grad, what="spike")


@pytest.mark.parametrize("v", [1, 3, 17, 1003])
@pytest.mark.parametrize("kind,beta", KINDS, ids=IDS)
def test_odd_vocab(kind, beta, v):
    rng = np.random.default_rng(6)
    s, t = pair(rng, 5, v)
    loss, g = lmloss.divergence(s, t, kind=kind, beta=beta, reduction="none", grad=True)
    ref, grad = oracle(s, t, kind, beta)
    check_rows(loss, g, ref, grad, what="V %d" % v)
    if v == 1:
        assert (loss == 0).all() and (g == 0).all()


def test_ignored_rows_and_reductions():
    rng = np.random.default_rng(7)
    s, t = pair(rng, 12, 101)
    y = labels_for(rng, (3, 4), 101, 0.4)
    s, t = s.reshape(3, 4, 101), t.reshape(3, 4, 101)
    ref, grad = oracle(s, t, "jsd", 0.25, labels=y)
    kw = dict(kind="jsd", beta=0.25, labels=y)
    rows, g = lmloss.divergence(s, t, reduction="none", grad=True, **kw)
    assert rows.shape == (3, 4) and (rows[y == -100] == 0).all() and (g[y == -100] == 0).all()
    kept = (y != -100).sum()
    for red, items, total in (("sum", None, ref.sum()), ("mean", None, ref.sum() / int(kept)),
                              ("sum", 7.0, ref.sum() / 7.0), ("mean", 7.0, ref.sum() / 7.0)):
        loss, g = lmloss.divergence(s, t, reduction=red, num_items=items, grad=True, **kw)
        assert isinstance(loss, float)
        want = grad(total)
        util.check(loss, total.item(), what=red)
        util.check(g.reshape(want.shape), want, bfloor=row_floor(want), what=red + " grad")
    none = np.full((3, 4), -100)
    loss, g = lmloss.divergence(s, t, reduction="mean", grad=True, kind="jsd", labels=none)
    assert loss == 0 and (g == 0).all()


@pytest.mark.parametrize("form", ["bf16", "bf16bits"])
@pytest.mark.parametrize("kind,beta", [("kl", 0.5), ("jsd", 0.5), ("tvd", 0.5)])
def test_bf16_inputs(kind, beta, form):
    rng = np.random.default_rng(8)
    s, t = pair(rng, 6, 1003)
    s = util.as_form(s, form)
    for teacher in (util.as_form(t, form), t):  # a bf16 or an fp32 teacher
        loss, g = lmloss.divergence(s, teacher, kind=kind, beta=beta, reduction="none", grad=True)
        assert g.dtype == s.dtype
        ref, grad = oracle(s, teacher, kind, beta)
        check_rows(loss, g, ref, grad, form=form, what=form)


@pytest.mark.parametrize("backend", ["cpu", "ref"])
def test_the_students_entropy(backend):
    """return_parts' entropy: -sum p log p of the student's transformed row,
    peaked rows to margin 1000 included; ignored rows 0."""
    rng = np.random.default_rng(16)
    s = np.concatenate([pair(rng, 3, 301)[0]] + [util.peaked(rng, 1, 301, m)[0]
                                                 for m in (17.0, 50.0, 1000.0)])
    t = pair(rng, 6, 301)[1]
    y = np.array([1, -100, 2, 3, 4, 5])
    res = lmloss.divergence(s, t, labels=y, temperature=1.5, return_parts=True, backend=backend)
    lp = log_softmax64(transform64(torch.from_numpy(s).double(), temperature=1.5))
    want = torch.where(torch.from_numpy(y) != -100, -(lp.exp() * lp).sum(-1), 0.0)
    util.check(res.entropy, want.numpy(), what="entropy")


def test_hard_weight_adds_the_students_cross_entropy():
    rng = np.random.default_rng(9)
    s, t = pair(rng, 8, 503)
    y = labels_for(rng, 8, 503)
    r = lmloss.divergence(s, t, kind="kl", labels=y, soft_weight=0.7, hard_weight=0.3,
                          reduction="none", grad=True, return_parts=True)
    lab = torch.from_numpy(y)
    ce = torch.nn.functional.cross_entropy(torch.from_numpy(s).double(), lab, reduction="none")
    util.check(r.ce, ce.numpy(), what="ce part")
    ref, grad = oracle(s, t, "kl", labels=y, soft=0.7, hard=0.3)
    check_rows(r.loss, r.dstudent, ref, grad, what="soft + hard")


def test_each_side_has_its_own_transform():
    rng = np.random.default_rng(10)
    s, t = pair(rng, 6, 211)
    side = dict(temperature=2.0, logit_scale=1.5, softcap=5.0, teacher_temperature=0.5,
                teacher_logit_scale=0.8, teacher_softcap=0.0)
    loss, g = lmloss.divergence(s, t, kind="jsd", beta=0.25, reduction="none", grad=True, **side)
    ref, grad = oracle(s, t, "jsd", 0.25, student=(1.5, 5.0, 2.0), teacher=(0.8, 0.0, 0.5))
    check_rows(loss, g, ref, grad, what="per-side transform")
    same = lmloss.divergence(s, t, kind="kl", temperature=2.0, reduction="none")
    ref, _ = oracle(s, t, "kl", student=(1.0, 0.0, 2.0))  # teacher_temperature None: the same
    util.check(same, ref.detach().numpy())


def test_numpy_errors():
    rng = np.random.default_rng(11)
    s, t = pair(rng, 4, 17)
    cases = [(dict(teacher=t[:, :16]), "LMLOSS_ERR_BAD_SHAPE"),
             (dict(teacher=t.reshape(2, 2, 17), student=s.reshape(4, 1, 17)),
              "LMLOSS_ERR_BAD_SHAPE"),
             (dict(kind="jsd", beta=1.5), "LMLOSS_ERR_BAD_OPTION"),
             (dict(kind="jsd", beta=-0.1), "LMLOSS_ERR_BAD_OPTION"),
             (dict(hard_weight=0.5), None),  # no labels: the C library's status
             (dict(kind="js"), "LMLOSS_ERR_BAD_OPTION"),
             (dict(reduction="batchmean"), "LMLOSS_ERR_BAD_OPTION"),
             (dict(labels=np.zeros(3, np.int64)), "LMLOSS_ERR_BAD_SHAPE")]
    for kw, status in cases:
        args = dict(student=s, teacher=t)
        args.update(kw)
        with pytest.raises(lmloss.Error) as e:
            lmloss.divergence(args.pop("student"), args.pop("teacher"), **args)
        assert status is None or e.value.status == status, (kw, e.value)


# ------------------------------------------------------------------ torch

def tensors(rng, lead, v, dtype=torch.float32, **kw):
    s, t = pair(rng, int(np.prod(lead)), v, **kw)
    return (torch.from_numpy(s).reshape(*lead, v).to(dtype).requires_grad_(),
            torch.from_numpy(t).reshape(*lead, v).to(dtype))


@needs_trl
@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_generalized_jsd_is_trls_loss(beta):
    """TRL's own function in float64 on the same values: every reduction,
    labels or not, num_items_in_batch as a number and as a tensor; the
    loss and the student's gradient."""
    rng = np.random.default_rng(12)
    s, t = tensors(rng, (3, 5), 301)
    y = torch.from_numpy(labels_for(rng, (3, 5), 301))
    for labels in (None, y):
        for reduction, items in (("batchmean", None), ("sum", None), ("mean", None),
                                 ("batchmean", 9), ("mean", torch.tensor(9))):
            args = (labels, beta, 1.7, reduction, items)
            got = lt.generalized_jsd(s, t, *args)
            s64 = s.detach().double().requires_grad_()
            want = TRL_JSD(s64, t.double(), *args)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-12)
            (g,) = torch.autograd.grad(got, s)
            (gw,) = torch.autograd.grad(want, s64)
            torch.testing.assert_close(g.double(), gw, rtol=1e-5,
                                       atol=1e-5 * gw.abs().max().item())
        rows = lt.generalized_jsd(s, t, labels, beta, 1.7, "none")
        elem = TRL_JSD(s.detach().double(), t.double(), labels, beta, 1.7, "none").sum(-1)
        torch.testing.assert_close(rows.double() if labels is None else rows[y != -100].double(),
                                   elem, rtol=1e-5, atol=1e-12)


def test_trl_reductions_without_trl():
    """TRL's divisions, spelled out: "batchmean" without labels divides by
    B of [B, T, V] (not B * T), with labels by the kept rows (at least 1);
    "mean" by the elements; num_items_in_batch wins over the reduction."""
    rng = np.random.default_rng(13)
    s, t = tensors(rng, (2, 3), 41)
    y = torch.tensor([[-100, 3, 4], [-100, -100, 1]])
    total = lt.generalized_jsd(s, t, reduction="sum")
    torch.testing.assert_close(lt.generalized_jsd(s, t), total / 2)
    torch.testing.assert_close(lt.generalized_jsd(s, t, reduction="mean"), total / (6 * 41))
    kept = lt.generalized_jsd(s, t, y, reduction="sum")
    torch.testing.assert_close(lt.generalized_jsd(s, t, y), kept / 3)
    torch.testing.assert_close(lt.generalized_jsd(s, t, y, reduction="mean"), kept / (3 * 41))
    torch.testing.assert_close(lt.generalized_jsd(s, t, y, num_items_in_batch=5), kept / 5)
    none = torch.full((2, 3), -100)
    assert lt.generalized_jsd(s, t, none).item() == 0
    assert lt.generalized_jsd(s, t, none, reduction="mean").isnan()
    empty = torch.zeros(0, 3, 41)  # no rows: TRL's 0 (and an empty "none")
    assert lt.generalized_jsd(empty, empty).item() == 0
    assert lt.generalized_jsd(empty, empty, reduction="none").shape == (0, 3)


TORCH_FNS = {"kl": (lambda s, t, **k: lt.kl_div(s, t, **k), 0.5),
             "reverse_kl": (lambda s, t, **k: lt.kl_div(s, t, reverse=True, **k), 0.5),
             "tvd": (lambda s, t, **k: lt.tvd(s, t, **k), 0.5),
             "jsd": (lambda s, t, **k: lt.generalized_jsd(s, t, beta=0.9, **k), 0.9)}


@pytest.mark.parametrize("kw", [dict(), dict(labels=True), dict(num_items_in_batch=7),
                                dict(reduction="mean")], ids=["batchmean", "batchmean-labels",
                                                              "num-items", "mean"])
@pytest.mark.parametrize("kind", list(TORCH_FNS))
def test_torch_bf16_gradient_is_rounded_once(kind, kw):
    """The C call divides the sum (batchmean by the rows or the rows kept, a
    number num_items, mean without labels): a bf16 student's gradient is
    its fp32 one rounded once, never rounded at the sum and again after the
    division by an upstream of 1 / N."""
    fn, _ = TORCH_FNS[kind]
    rng = np.random.default_rng(21)
    s, t = tensors(rng, (3, 5), 257, torch.bfloat16)
    kw = dict(kw)
    if kw.pop("labels", False):
        kw["labels"] = torch.from_numpy(labels_for(rng, (3, 5), 257))
    grads = []
    for x in (s.detach().float(), s.detach()):
        x.requires_grad_()
        fn(x, t.float(), **kw).backward()
        grads.append(x.grad)
    assert torch.equal(grads[1], grads[0].bfloat16()), kw


@pytest.mark.parametrize("backend", ["cpu", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(TORCH_FNS))
def test_torch_gradients_against_the_oracle(kind, dtype, backend):
    """The fused path (a scalar loss: the gradient formed in the forward,
    scaled by the upstream: lmloss_scale, or torch on the REF backend), the
    per-row path (lmloss_divergence_backward from a per-row upstream), and
    a second backward through one graph; the teacher gets no gradient."""
    fn, beta = TORCH_FNS[kind]
    rng = np.random.default_rng(14)
    s, t = tensors(rng, (2, 4), 503, dtype)
    t.requires_grad_()
    y = torch.from_numpy(labels_for(rng, (2, 4), 503))
    form = "bf16" if dtype == torch.bfloat16 else "f32"
    ref, grad = oracle(s, t, kind, beta, labels=y, hard=0.25)
    w = torch.rand(2, 4, generator=torch.Generator().manual_seed(0))
    for red, upstream in (("sum", torch.tensor(3.0)), ("none", w)):
        loss = fn(s, t, labels=y, hard_weight=0.25, reduction=red, backend=backend)
        want_loss = ref.sum() if red == "sum" else ref.reshape(2, 4)
        util.check(loss.detach().numpy(), want_loss.detach().numpy(), what=red)
        want = grad((upstream.double() * want_loss).sum())
        for _ in range(2):  # the second recomputes (the fused gradient is used up)
            s.grad = t.grad = None
            (upstream * loss).sum().backward(retain_graph=True)
            assert t.grad is None
            floor = row_floor(want)
            if red == "sum" and form == "bf16":  # the fused path's second rounding (_div_ops)
                floor = floor + np.abs(want) * 2.0 ** -8 / 1e-5
            util.check(s.grad.float().numpy().reshape(want.shape), want, form, floor,
                       red + " grad")


def test_generalized_jsd_compiles_without_graph_breaks():
    rng = np.random.default_rng(15)
    s, t = tensors(rng, (2, 3), 37)
    y = torch.tensor([[-100, 3, 4], [5, -100, 1]])

    def step(s, t, y):
        return lt.generalized_jsd(s, t, y, beta=0.25, temperature=0.8)

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(s, t, y)
    (g,) = torch.autograd.grad(got, s)
    want = step(s, t, y)
    (gw,) = torch.autograd.grad(want, s)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g, gw)
    assert sum(counters["graph_break"].values()) == 0


def test_torch_errors():
    rng = np.random.default_rng(16)
    s, t = tensors(rng, (2, 3), 17)
    for call, status in ((lambda: lt.kl_div(s, t[:, :2]), "LMLOSS_ERR_BAD_SHAPE"),
                         (lambda: lt.kl_div(s, t.reshape(3, 2, 17)), "LMLOSS_ERR_BAD_SHAPE"),
                         (lambda: lt.generalized_jsd(s, t, beta=1.5), "LMLOSS_ERR_BAD_OPTION"),
                         (lambda: lt.tvd(s, t, reduction="avg"), "LMLOSS_ERR_BAD_OPTION"),
                         (lambda: lt.kl_div(s, t, torch.zeros(3, dtype=torch.long)),
                          "LMLOSS_ERR_BAD_SHAPE"),
                         (lambda: lt.kl_div(s, t, hard_weight=1.0), None)):
        with pytest.raises(lmloss.Error) as e:
            call()
        assert status is None or e.value.status == status, e.value


# ------------------------------------------------------------------ the TRL drop-in

@needs_trl
def test_trl_drop_in_patches_gkd_trainer_and_restores_it():
    rng = np.random.default_rng(17)
    s, t = tensors(rng, (2, 5), 97)
    y = torch.from_numpy(labels_for(rng, (2, 5), 97))
    original = vars(GKDTrainer)["generalized_jsd_loss"]
    ltrl.enable()
    try:
        assert GKDTrainer.generalized_jsd_loss is ltrl.generalized_jsd_loss
        trainer = object.__new__(GKDTrainer)  # called as GKDTrainer.compute_loss does
        got = trainer.generalized_jsd_loss(student_logits=s, teacher_logits=t, labels=y,
                                           beta=0.5, num_items_in_batch=torch.tensor(4))
        elem = trainer.generalized_jsd_loss(s, t, y, 0.5, 1.0, "none")  # TRL's original
        assert elem.shape == ((y != -100).sum().item(), 97)
    finally:
        ltrl.disable()
    assert vars(GKDTrainer)["generalized_jsd_loss"] is original
    want = TRL_JSD(s.detach().double(), t.double(), y, 0.5, num_items_in_batch=torch.tensor(4))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(elem, TRL_JSD(s, t, y, 0.5, 1.0, "none"))


def _trl_distillation():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import trl.trainer.distillation_trainer as mod
            return mod
        except ImportError:
            return None


@pytest.mark.skipif(_trl_distillation() is None,
                    reason="TRL's DistillationTrainer not importable")
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_trl_distillation_two_head_loss_is_trls(beta):
    """DistillationTrainer's _chunked_divergence_loss and lmloss's drop-in on
    the same heads (float64 inputs on TRL's side): the loss, the student's entropy
    sum, the count, and the student's gradients; each model its own width,
    bias, logit scale, the student's softcap, a temperature, masked
    positions; enable() patches the module and disable() restores it."""
    mod = _trl_distillation()
    trl_fn = mod._chunked_divergence_loss
    g = torch.Generator().manual_seed(30)
    hs, ht = torch.randn(2, 7, 24, generator=g), torch.randn(2, 7, 40, generator=g)
    ws, wt = torch.randn(301, 24, generator=g) * 0.4, torch.randn(301, 40, generator=g) * 0.3
    bs, bt = torch.randn(301, generator=g), torch.randn(301, generator=g)
    mask = (torch.rand(2, 7, generator=g) > 0.3).long()
    kw = dict(student_logit_scale=1.5, teacher_logit_scale=0.8,
              student_final_logit_softcapping=20.0, temperature=2.0)
    for items in (None, torch.tensor(9.0)):
        res = []
        for fn, dt in ((trl_fn, torch.float64), (ltrl.chunked_divergence_loss, torch.float32)):
            h, w, b = (a.detach().to(dt).requires_grad_() for a in (hs, ws, bs))
            loss, ent, n = fn(h, ht.to(dt), w, wt.to(dt), mask, beta, items,
                              student_lm_head_bias=b, teacher_lm_head_bias=bt.to(dt), **kw)
            loss.backward()
            res.append((loss, ent, n, h.grad, w.grad, b.grad))
        (tl, te, tn, *tg), (ll, le, ln, *lg) = res
        assert int(tn) == int(ln) == int(mask.sum())
        torch.testing.assert_close(ll.double(), tl.double(), rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(le.double(), te.detach().double(), rtol=1e-5, atol=1e-6)
        for a, b in zip(lg, tg):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-7)
    ltrl.enable()
    try:
        assert mod._chunked_divergence_loss is ltrl.chunked_divergence_loss
    finally:
        ltrl.disable()
    assert mod._chunked_divergence_loss is trl_fn
