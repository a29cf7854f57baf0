"""lmloss.log_probs / selective_log_softmax / log_probs_backward / entropy."""

import numpy as np
import pytest

import lmloss
import reference as R
from util import FORMS, MARGINS, VOCABS, check, peaked

BACKENDS = ["cpu", "ref"]


def topk_index(rng, y, v, k):
    """[N, K] indices whose first column is y (the peaked entry)."""
    idx = np.stack([rng.permutation(v)[:k] for _ in y])
    for i, t in enumerate(y):
        idx[i, idx[i] == t] = idx[i, 0]
        idx[i, 0] = t
    return idx


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("margin", MARGINS)
def test_margins(backend, v, margin):
    rng = np.random.default_rng(v * 7 + margin)
    x, y = peaked(rng, 2 if v > 10000 else 4, v, margin)
    lp = R.log_softmax(x)
    got, ent = lmloss.log_probs(x, y, entropy=True, backend=backend)
    check(got, lp[np.arange(len(y)), y], what="logp")
    check(ent, R.entropy(x), what="entropy")
    check(lmloss.entropy(x, backend=backend), R.entropy(x), what="entropy()")
    idx = topk_index(rng, y, v, min(v, 3))
    check(lmloss.log_probs(x, idx, backend=backend), np.take_along_axis(lp, idx, 1), what="K")
    g = rng.standard_normal(idx.shape).astype(np.float32)
    ref, fl = R.log_probs_backward(x, idx, g)
    check(lmloss.log_probs_backward(x, idx, g, backend=backend), ref, bfloor=fl, what="dlogp")
    d = rng.standard_normal(len(y)).astype(np.float32)
    ref, fl = R.log_probs_backward(x, None, None, d)
    check(lmloss.log_probs_backward(x, None, None, d, backend=backend), ref, bfloor=fl,
          what="dentropy")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("margin", [0, 20, 50])
def test_keywords(backend, temperature, margin):
    rng = np.random.default_rng(margin)
    x, y = peaked(rng, 6, 129, margin)
    idx = topk_index(rng, y, 129, 4)
    mask = np.array([1, 0, 1, 1, 0, 1], dtype=bool)
    lp = R.log_softmax(x, temperature)
    logp, ent = lmloss.log_probs(x, idx, temperature=temperature, mask=mask, entropy=True,
                                 backend=backend)
    check(logp, np.where(mask[:, None], np.take_along_axis(lp, idx, 1), 0), what="logp")
    check(ent, np.where(mask, R.entropy(x, temperature), 0), what="entropy")
    check(lmloss.entropy(x, temperature=temperature, backend=backend, num_threads=1),
          R.entropy(x, temperature))
    g = rng.standard_normal(idx.shape).astype(np.float32)
    d = rng.standard_normal(6).astype(np.float32)
    ref, fl = R.log_probs_backward(x, idx, g, d, temperature, mask)
    got = lmloss.log_probs_backward(x, idx, g, d, temperature=temperature,
                                    mask=mask.astype(np.uint8), backend=backend, num_threads=2)
    check(got, ref, bfloor=fl, what="backward")
    assert np.all(got[~mask] == 0)


@pytest.mark.parametrize("form", FORMS[1:])
@pytest.mark.parametrize("margin", [0, 17, 30, 100])
def test_half_dtypes(form, margin):
    rng = np.random.default_rng(margin)
    x, y = peaked(rng, 4, 257, margin, form)
    got = lmloss.log_probs(x, y)
    assert got.dtype == np.float32
    check(got, R.log_softmax(x)[np.arange(4), y], what="logp")
    g = rng.standard_normal(4).astype(np.float32)
    dx = lmloss.log_probs_backward(x, y, g)
    assert dx.dtype == x.dtype
    ref, fl = R.log_probs_backward(x, y, g)
    check(dx, ref, form=form, bfloor=fl, what="dlogits")


def test_btv_and_topk_shapes():
    rng = np.random.default_rng(8)
    x, y = peaked(rng, 6, 50, 20)
    x3 = x.reshape(2, 3, 50)
    idx = topk_index(rng, y, 50, 5)
    assert lmloss.log_probs(x3, y.reshape(2, 3)).shape == (2, 3)
    out, ent = lmloss.log_probs(x3, idx.reshape(2, 3, 5), entropy=True)
    assert out.shape == (2, 3, 5) and ent.shape == (2, 3)
    assert np.array_equal(out.reshape(6, 5), lmloss.log_probs(x, idx))
    assert np.array_equal(lmloss.entropy(x3).ravel(), lmloss.entropy(x))
    g = rng.standard_normal((2, 3, 5))
    dx = lmloss.log_probs_backward(x3, idx.reshape(2, 3, 5), g, mask=np.ones((2, 3), bool))
    assert dx.shape == (2, 3, 50)
    assert np.array_equal(dx.reshape(6, 50), lmloss.log_probs_backward(x, idx, g.reshape(6, 5)))


def test_trl_parity():
    """TRL's selective_log_softmax: gather(logits) - logsumexp(logits)."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((2, 8, 300)) * 4).astype(np.float32)
    idx = rng.integers(0, 300, (2, 8))
    z = x.astype(np.float64)
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
    trl = np.take_along_axis(z, idx[..., None], -1)[..., 0] - lse
    check(lmloss.selective_log_softmax(x, idx), trl)


def test_strided_rows():
    rng = np.random.default_rng(10)
    wide, y = peaked(rng, 5, 64, 30)
    x = wide[:, :50]
    y = y % 50
    check(lmloss.log_probs(x, y), R.log_softmax(x)[np.arange(5), y])
    check(lmloss.entropy(wide[:, 3:40]), R.entropy(wide[:, 3:40]))
    idx = np.asfortranarray(topk_index(rng, y, 50, 3))  # strided index: copied
    check(lmloss.log_probs(x, idx), np.take_along_axis(R.log_softmax(x), idx, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_backward_from_saved_stats(backend, form):
    """log_probs(stats=True) and log_probs_backward(stats=...): the same
    gradient as the recomputing backward (bit-equal on the CPU, whose
    statistics are the same fp32 ones), shaped [..., 4] like the rows."""
    rng = np.random.default_rng(12)
    x, y = peaked(rng, 6, 1003, 30, form)
    idx = topk_index(rng, y, 1003, 2)
    mask = np.array([1, 1, 0, 1, 1, 1], dtype=bool)
    kw = dict(temperature=0.7, mask=mask, backend=backend)
    logp, ent, st = lmloss.log_probs(x, idx, entropy=True, stats=True, **kw)
    assert st.shape == (6, 4) and st.dtype == np.float32
    assert np.array_equal(st[mask, 3], R.f64(x)[mask].argmax(1)) and st[2, 3] == -1
    check(logp, np.array(lmloss.log_probs(x, idx, **kw)), what="logp with stats")
    g = rng.standard_normal(idx.shape).astype(np.float32)
    d = rng.standard_normal(6).astype(np.float32)
    want = lmloss.log_probs_backward(x, idx, g, d, **kw)
    got = lmloss.log_probs_backward(x, idx, g, d, stats=st, **kw)
    if backend == "cpu":
        assert np.array_equal(R.f64(got), R.f64(want))
    ref, fl = R.log_probs_backward(x, idx, g, d, 0.7, mask)
    check(got, ref, form=form, bfloor=fl, what="backward from stats")
    x3 = x.reshape(2, 3, 1003)
    _, st3 = lmloss.log_probs(x3, y.reshape(2, 3), stats=True, backend=backend)
    assert st3.shape == (2, 3, 4)
    with pytest.raises(lmloss.Error, match="stats has shape"):
        lmloss.log_probs_backward(x, idx, g, stats=st[:, :3], backend=backend)
