"""Divergences through two fused heads (lmloss.linear_divergence;
lmloss.torch's linear_generalized_jsd, linear_kl_div, linear_tvd and
LinearGeneralizedJSD) against the dense path on the logits the heads make:
hidden @ weight.T + bias in float64, cast to float32, then lmloss's own
divergence on those logits (test_divergence.py holds it to its oracle),
with autograd through the products for the student's dhidden, dweight
and dbias.

Tolerance (the fused head's fp32 contract, as test_linear.py): the loss
and each gradient within TOL Frobenius-relative of the dense path's (the
fused GEMMs round in float32 where the dense products are float64).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lmloss  # noqa: E402
import lmloss.torch as lt  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from util import one_row_budget  # noqa: E402

TOL = 1e-4
N_LEAD, V, HS, HT = (2, 5), 301, 24, 16
# kind -> (the logits' function, the heads' function, their keywords)
KINDS = {"kl": (lt.kl_div, lt.linear_kl_div, {}),
         "reverse_kl": (lt.kl_div, lt.linear_kl_div, {"reverse": True}),
         "tvd": (lt.tvd, lt.linear_tvd, {}),
         "jsd-0": (lt.generalized_jsd, lt.linear_generalized_jsd, {"beta": 0.0}),
         "jsd-0.25": (lt.generalized_jsd, lt.linear_generalized_jsd, {"beta": 0.25}),
         "jsd-1": (lt.generalized_jsd, lt.linear_generalized_jsd, {"beta": 1.0})}


def head(rng, lead, h, bias=True, sigma=2.0):
    """float32 hidden [*lead, h], weight [V, h], bias [V] (or None): logits ~ N(0, sigma^2)."""
    hid = torch.from_numpy(rng.standard_normal(lead + (h,)).astype(np.float32))
    w = torch.from_numpy((rng.standard_normal((V, h)) * sigma / np.sqrt(h)).astype(np.float32))
    b = torch.from_numpy((0.5 * rng.standard_normal(V)).astype(np.float32)) if bias else None
    return hid, w, b


def heads(seed, lead=N_LEAD, student_bias=True, teacher_bias=True):
    """(student (hidden, weight, bias) requiring grad, teacher (hidden, weight, bias))."""
    rng = np.random.default_rng(seed)
    student = tuple(None if t is None else t.requires_grad_()
                    for t in head(rng, lead, HS, student_bias))
    return student, head(rng, lead, HT, teacher_bias)


def labels_for(seed, lead=N_LEAD, ignored=0.3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, V, lead)
    return torch.from_numpy(np.where(rng.random(lead) < ignored, -100, y))


def logits(h, w, b):
    """The logits a head makes: float64 products cast to float32, in h, w, b's graph."""
    z = h.double() @ w.double().T
    return (z if b is None else z + b.double()).float()


def fused(kind, student, teacher, labels, budget=None, **kw):
    (sh, sw, sb), (th, tw, tb) = student, teacher
    fn, kkw = KINDS[kind][1], KINDS[kind][2]
    return fn(sh, sw, th, tw, labels, student_bias=sb, teacher_bias=tb, memory_budget=budget,
              **kkw, **kw)


def dense(kind, student, teacher, labels, **kw):
    fn, kkw = KINDS[kind][0], KINDS[kind][2]
    return fn(logits(*student), logits(*teacher).detach(), labels, **kkw, **kw)


def close(got, want, what):
    err = (got.detach().double() - want.detach().double()).norm().item()
    ref = want.detach().double().norm().item()
    assert err <= TOL * ref, "%s: |got - want| = %.3g, |want| = %.3g" % (what, err, ref)


def compare(kind, student, teacher, labels, upstream, budget=None, **kw):
    """The loss and the student's gradients of sum(upstream * loss), fused
    against dense; returns the fused loss."""
    got = fused(kind, student, teacher, labels, budget, **kw)
    want = dense(kind, student, teacher, labels, **kw)
    what = "%s %s labels=%s" % (kind, kw, labels is not None)
    close(got, want, what + " loss")
    params = [t for t in student if t is not None]
    g = torch.autograd.grad((upstream * got).sum(), params)
    gw = torch.autograd.grad((upstream * want).sum(), params)
    for name, a, b in zip(("dhidden", "dweight", "dbias"), g, gw):
        close(a, b, "%s %s" % (what, name))
    return got


REDUCTIONS = [("batchmean", None), ("sum", None), ("mean", None), ("batchmean", 9),
              ("mean", torch.tensor(9.0))]


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_and_reduction_against_the_dense_path(kind):
    """TRL's reductions with and without labels (ignored rows among them)
    and num_items_in_batch (a number, a tensor): the gradients formed in
    the forward, scaled by an upstream 1.7 in the backward; "none" with a
    random per-row upstream: the backward entry."""
    student, teacher = heads(1)
    y = labels_for(2)
    rows = torch.rand(N_LEAD, generator=torch.Generator().manual_seed(3))
    for labels in (None, y):
        for reduction, items in REDUCTIONS:
            compare(kind, student, teacher, labels, 1.7, reduction=reduction,
                    num_items_in_batch=items)
        loss = compare(kind, student, teacher, labels, rows, reduction="none")
        assert loss.shape == N_LEAD
        if labels is not None:
            assert (loss[labels == -100] == 0).all()


@pytest.mark.parametrize("kind", ["kl", "jsd-0.25", "tvd"])
def test_transforms_and_the_hard_term(kind):
    """Each side its own transform, soft and hard weights, heads without bias."""
    student, teacher = heads(4, student_bias=False, teacher_bias=False)
    y = labels_for(5)
    kw = dict(temperature=0.8, teacher_temperature=1.3, softcap=6.0, teacher_softcap=0,
              teacher_logit_scale=0.5, soft_weight=0.75, hard_weight=0.25)
    for reduction in ("batchmean", "none"):
        compare(kind, student, teacher, y, 0.5, reduction=reduction, **kw)


@pytest.mark.parametrize("kind", ["reverse_kl", "jsd-0.25"])
def test_several_chunks(kind):
    """Chunks of one row and of a few, fused path and backward entry alike."""
    student, teacher = heads(6)
    y = labels_for(7)
    (sh, sw, sb), (th, tw, tb) = student, teacher
    f = [t.detach().numpy() for t in (sh, sw, th, tw)]
    b1 = one_row_budget(lambda m: lmloss.linear_divergence(
        *f, student_bias=sb.detach().numpy(), teacher_bias=tb.numpy(), labels=y.numpy(),
        grad=True, memory_budget=m))
    rows = torch.rand(N_LEAD, generator=torch.Generator().manual_seed(8))
    for budget in (b1, 2 * b1):
        compare(kind, student, teacher, y, 1.7, budget)
        compare(kind, student, teacher, y, rows, budget, reduction="none")
    with pytest.raises(lmloss.Error) as e:
        fused(kind, student, teacher, y, b1 - 1)
    assert e.value.status == "LMLOSS_ERR_WORKSPACE_TOO_SMALL"


def test_frozen_parts_repeated_backward_and_the_teacher():
    """A frozen weight and bias (only dhidden computed), a second backward
    through one graph (the forward's gradients used up: it recomputes),
    and a teacher that asks for gradients gets none."""
    student, teacher = heads(9)
    (sh, sw, sb), (th, tw, tb) = student, teacher
    for t in (th, tw, tb):
        t.requires_grad_()
    y = labels_for(10)
    got = lt.linear_generalized_jsd(sh, sw.detach(), th, tw, y, student_bias=sb.detach(),
                                    teacher_bias=tb)
    want = lt.generalized_jsd(logits(sh, sw.detach(), sb.detach()), logits(th, tw, tb).detach(), y)
    (gw,) = torch.autograd.grad(want, sh)
    for _ in range(2):
        sh.grad = None
        (2.0 * got).backward(retain_graph=True)
        close(sh.grad, 2.0 * gw, "dhidden")
        assert th.grad is None and tw.grad is None and tb.grad is None


def test_no_rows_and_all_rows_ignored():
    student, teacher = heads(11, lead=(0, 3))
    loss = fused("kl", student, teacher, None)
    assert loss.item() == 0 and loss.requires_grad
    assert fused("kl", student, teacher, None, reduction="none").shape == (0, 3)
    student, teacher = heads(12)
    none = torch.full(N_LEAD, -100)
    loss = fused("jsd-0.25", student, teacher, none)
    loss.backward()
    assert loss.item() == 0 and student[1].grad.abs().max() == 0
    assert fused("tvd", student, teacher, none, reduction="mean").isnan()


def test_liger_module_divides_by_the_rows():
    """LinearGeneralizedJSD: [B, T, H] inputs flattened, the sum over every
    row (no labels) or over the rows shift_labels keep, as Liger's."""
    student, teacher = heads(13, student_bias=False, teacher_bias=False)
    (sh, sw, _), (th, tw, _) = student, teacher
    y = labels_for(14)
    m = lt.LinearGeneralizedJSD(jsd_beta=0.3, temperature=1.5)
    total = lt.linear_generalized_jsd(sh, sw, th, tw, None, 0.3, 1.5, "sum")
    torch.testing.assert_close(m(sh, sw, th, tw), total / sh.shape[:-1].numel())
    kept = lt.linear_generalized_jsd(sh, sw, th, tw, y, 0.3, 1.5, "sum")
    torch.testing.assert_close(m(sh, sw, th, tw, y), kept / (y != -100).sum())


def test_compiles_without_graph_breaks():
    student, teacher = heads(15, lead=(2, 3))
    (sh, sw, sb), (th, tw, tb) = student, teacher
    y = torch.tensor([[-100, 3, 4], [5, -100, 1]])

    def step(sh, sw, sb, th, tw, tb, y):
        return lt.linear_generalized_jsd(sh, sw, th, tw, y, beta=0.25, temperature=0.8,
                                         student_bias=sb, teacher_bias=tb)

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(sh, sw, sb, th, tw, tb, y)
    g = torch.autograd.grad(3.0 * got, (sh, sw, sb))
    want = step(sh, sw, sb, th, tw, tb, y)
    gw = torch.autograd.grad(3.0 * want, (sh, sw, sb))
    torch.testing.assert_close(got, want)
    for a, b in zip(g, gw):
        torch.testing.assert_close(a, b)
    assert sum(counters["graph_break"].values()) == 0


def np_logits(h, w, b=None):
    """logits() of NumPy arrays."""
    return logits(*(None if a is None else torch.from_numpy(a) for a in (h, w, b))).numpy()


def test_numpy_against_the_dense_path():
    """lmloss.linear_divergence: the loss, the student's gradients and the
    parts, against lmloss.divergence on the logits the heads make."""
    student, teacher = heads(16)
    s = [x.detach().numpy() for x in student]
    t = [x.numpy() for x in teacher]
    y = labels_for(17).numpy()
    zs, zt = np_logits(*s), np_logits(*t)
    for reduction in ("mean", "none"):
        kw = dict(kind="jsd", beta=0.25, labels=y, hard_weight=0.5, reduction=reduction,
                  return_parts=True)
        got = lmloss.linear_divergence(s[0], s[1], t[0], t[1], student_bias=s[2],
                                       teacher_bias=t[2], grad=True, **kw)
        want = lmloss.divergence(zs, zt, grad=True, **kw)
        ds = want.dstudent.reshape(-1, V).astype(np.float64)
        for name, a, b in (("loss", got.loss, want.loss),
                           ("divergence", got.divergence, want.divergence),
                           ("ce", got.ce, want.ce),
                           ("dhidden", got.dhidden, (ds @ s[1]).reshape(got.dhidden.shape)),
                           ("dweight", got.dweight, ds.T @ s[0].reshape(-1, HS)),
                           ("dbias", got.dbias, ds.sum(0))):
            close(torch.as_tensor(a), torch.as_tensor(b), "%s %s" % (reduction, name))
    plain = lmloss.linear_divergence(s[0], s[1], t[0], t[1], kind="tvd")
    want = lmloss.divergence(np_logits(s[0], s[1]), np_logits(t[0], t[1]), kind="tvd")
    assert abs(plain - want) <= TOL * abs(want)


def test_bad_input():
    (sh, sw, _), (th, tw, _) = heads(18)
    s = [x.detach().numpy() for x in (sh, sw)]
    t = [x.numpy() for x in (th, tw)]
    bf16 = [torch.from_numpy(a).bfloat16().view(torch.int16).numpy().view(np.uint16)
            for a in s + t]
    for call, status in (
            (lambda: lmloss.linear_divergence(s[0], s[1], t[0][:1], t[1]), "BAD_SHAPE"),
            (lambda: lmloss.linear_divergence(s[0], s[1], t[0], t[1][:-1]), "BAD_SHAPE"),
            (lambda: lmloss.linear_divergence(*bf16), "UNSUPPORTED"),
            (lambda: lmloss.linear_divergence(*s, *t, hard_weight=1.0), "BAD_OPTION"),
            (lambda: lmloss.linear_divergence(*s, *t, kind="js"), "BAD_OPTION"),
            (lambda: lt.linear_kl_div(sh, sw, th[:1], tw), "BAD_SHAPE"),
            (lambda: lt.linear_kl_div(sh, sw, th, tw[:-1]), "BAD_SHAPE"),
            (lambda: lt.linear_tvd(sh, sw, th, tw, reduction="avg"), "BAD_OPTION"),
            (lambda: lt.linear_generalized_jsd(sh, sw, th, tw, memory_budget=0), "BAD_OPTION")):
        with pytest.raises(lmloss.Error) as e:
            call()
        assert e.value.status == "LMLOSS_ERR_" + status, e.value
