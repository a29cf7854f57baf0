"""lmloss.cross_entropy against the float64 NumPy reference and backend="ref"."""

import numpy as np
import pytest

import lmloss
import reference as R
from util import FORMS, MARGINS, VOCABS, as_form, check, peaked

BACKENDS = ["cpu", "ref"]


def rows_for(v):
    return 2 if v > 10000 else 5


def compare(x, y, backend="cpu", form="f32", **kw):
    """Run lmloss (grad=True) and the reference; check loss and dlogits.
    kw's weight= (per-class, as torch's) is the reference's class_weight."""
    loss, dx = lmloss.cross_entropy(x, y, grad=True, backend=backend, **kw)
    rkw = dict(kw)
    if "weight" in rkw:
        rkw["class_weight"] = rkw.pop("weight")
    ref = R.cross_entropy(x, y, **rkw)
    check(loss, ref["loss"], what="loss %s" % kw)
    assert dx.dtype == (np.float32 if form == "f32" else x.dtype)
    check(dx, ref["grad"], form=form, bfloor=ref["floor"], what="dlogits %s" % kw)
    return loss, dx


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("margin", MARGINS)
def test_margins(backend, v, margin):
    x, y = peaked(np.random.default_rng(v + margin), rows_for(v), v, margin)
    for reduction in ("none", "mean"):
        compare(x, y, backend, reduction=reduction)


OPTIONS = [
    dict(label_smoothing=0.1),
    dict(label_smoothing=1.0, reduction="sum"),
    dict(z_loss=1e-3),
    dict(logit_scale=0.5),
    dict(softcap=15.0),
    dict(temperature=0.7),
    dict(temperature=3.0, logit_scale=2.0, softcap=30.0),
    dict(dft=True),
    dict(reduction="sum"),
    dict(reduction="none", label_smoothing=0.2, z_loss=1e-4),
    dict(num_items=7.0),
    dict(num_items=3, reduction="sum"),
    dict(ignore_index=2),
    dict(token_weight="w"),
    dict(class_weight="c"),
    dict(weight="c", reduction="sum"),
    dict(class_weight="c", token_weight="w", label_smoothing=0.1, reduction="mean"),
    dict(class_weight="c", label_smoothing=0.3, dft=True, z_loss=1e-4, temperature=1.3),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v", [17, 1003])
@pytest.mark.parametrize("margin", [0, 5, 30, 100])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(sorted(o)))
def test_options(backend, v, margin, opts):
    rng = np.random.default_rng(margin)
    x, y = peaked(rng, 6, v, margin)
    y[1] = -100 if opts.get("ignore_index") is None else opts["ignore_index"]
    kw = dict(opts)
    if kw.get("token_weight") == "w":
        kw["token_weight"] = rng.uniform(0, 2, 6).astype(np.float32)
    for name in ("weight", "class_weight"):
        if kw.get(name) == "c":
            kw[name] = rng.uniform(0.5, 2, v).astype(np.float32)
    compare(x, y, backend, **kw)


@pytest.mark.parametrize("form", FORMS[1:])
@pytest.mark.parametrize("v", [3, 1003])
@pytest.mark.parametrize("margin", [0, 17, 30, 100])
def test_half_dtypes(form, v, margin):
    x, y = peaked(np.random.default_rng(margin), 4, v, margin, form)
    for kw in (dict(), dict(label_smoothing=0.1, reduction="sum")):
        loss, dx = compare(x, y, form=form, **kw)
        if form == "bf16bits":
            loss2, dx2 = lmloss.cross_entropy(x.view(as_form(0, "bf16").dtype), y, grad=True,
                                              **kw)
            assert loss == loss2 and np.array_equal(dx.view(np.uint16), dx2.view(np.uint16))


def test_collapse_margin_30():
    v = 1003
    x = np.zeros((1, v), dtype=np.float32)
    x[0, 7] = 30.0
    m = x.max(axis=1, keepdims=True)  # the naive fp32 form collapses to 0
    naive = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)) - x[:, 7:8])[0, 0]
    assert naive == 0.0
    expect = np.log1p((v - 1) * np.exp(-30.0))
    loss, dx = lmloss.cross_entropy(x, [7], grad=True)
    assert abs(loss - expect) <= 1e-5 * expect
    r = (v - 1) * np.exp(-30.0)
    assert abs(dx[0, 7] + r / (1 + r)) <= 1e-5 * r
    assert abs(dx.astype(np.float64).sum()) <= 1e-5 * r


@pytest.mark.parametrize("backend", BACKENDS)
def test_extra_outputs(backend):
    x, y = peaked(np.random.default_rng(1), 5, 17, 30)
    y[2] = -100
    ref = R.cross_entropy(x, y, temperature=0.9)
    res = lmloss.cross_entropy(x, y, temperature=0.9, return_lse=True, return_entropy=True,
                               return_argmax=True, backend=backend)
    assert isinstance(res, lmloss.CrossEntropyResult) and res.dlogits is None
    check(res.loss, ref["loss"])
    check(res.lse, ref["lse"], what="lse")
    check(res.entropy, ref["entropy"], what="entropy")
    assert res.argmax.dtype == np.int64 and list(res.argmax) == list(ref["argmax"])
    only = lmloss.cross_entropy(x, y, return_lse=True, grad=True)
    assert only.entropy is None and only.argmax is None and only.dlogits.shape == x.shape


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction):
    x = np.random.default_rng(0).standard_normal((4, 9)).astype(np.float32)
    loss, dx = lmloss.cross_entropy(x, np.full(4, -100), reduction=reduction, grad=True)
    assert np.all(np.asarray(loss) == 0) and np.all(dx == 0)


def test_btv_shapes():
    x, y = peaked(np.random.default_rng(2), 6, 33, 20)
    x3, y3 = x.reshape(2, 3, 33), y.reshape(2, 3)
    loss, dx = lmloss.cross_entropy(x3, y3, reduction="none", grad=True)
    assert loss.shape == (2, 3) and dx.shape == (2, 3, 33)
    flat, dflat = lmloss.cross_entropy(x, y, reduction="none", grad=True)
    assert np.array_equal(loss.ravel(), flat) and np.array_equal(dx.reshape(6, 33), dflat)
    w = np.linspace(0, 1, 6).reshape(2, 3)
    compare(x3.reshape(6, 33), y, token_weight=w.ravel())
    assert (lmloss.cross_entropy(x3, y3, token_weight=w)
            == lmloss.cross_entropy(x, y, token_weight=w.ravel()))


def test_weight_is_per_class_as_in_torch():
    """weight= is F.cross_entropy's per-class weight [V] (class_weight= is
    another name for it); per-token weights are token_weight=."""
    x, y = peaked(np.random.default_rng(7), 5, 11, 3)
    cw = np.linspace(0.5, 2.0, 11).astype(np.float32)
    a = lmloss.cross_entropy(x, y, weight=cw)
    assert a == lmloss.cross_entropy(x, y, class_weight=cw)
    check(a, R.cross_entropy(x, y, class_weight=cw)["loss"])
    with pytest.raises(lmloss.Error, match="token_weight"):
        lmloss.cross_entropy(x, y, weight=cw, class_weight=cw)
    with pytest.raises(lmloss.Error):  # a per-token vector is not a class weight
        lmloss.cross_entropy(x, y, weight=np.ones(5, np.float32))


def test_strided_rows():
    wide, y = peaked(np.random.default_rng(3), 5, 40, 17)
    x = wide[:, :31]  # rows 40 apart: passed with row_stride, no copy
    y = y % 31
    compare(x, y)
    compare(wide[::2, 1:30], y[::2] % 29)  # every other row
    compare(wide[:, ::2], y % 20)  # non-contiguous last axis: copied


def test_input_conversions():
    x, y = peaked(np.random.default_rng(4), 5, 17, 5)
    base = lmloss.cross_entropy(x, y)
    assert lmloss.cross_entropy(x.astype(np.float64), y) == base  # fp64 computed in fp32
    assert lmloss.cross_entropy(x, y.astype(np.int32)) == base
    assert lmloss.cross_entropy(x, y.astype(np.uint8)) == base
    assert lmloss.cross_entropy(x, y.tolist()) == base
    assert isinstance(base, float)
    one = lmloss.cross_entropy(x[0], y[0], reduction="none")  # a single row [V]
    assert one.shape == () and one == lmloss.cross_entropy(x[:1], y[:1], reduction="sum")


def test_num_threads():
    x, y = peaked(np.random.default_rng(5), 64, 1003, 20)
    a = lmloss.cross_entropy(x, y, reduction="none", num_threads=1)
    b = lmloss.cross_entropy(x, y, reduction="none", num_threads=2)
    check(a, R.cross_entropy(x, y, reduction="none")["loss"])
    check(b, a)
