"""lmloss.softmax / log_softmax / softmax_backward."""

import numpy as np
import pytest

import lmloss
import reference as R
from util import FORMS, MARGINS, check, peaked


@pytest.mark.parametrize("backend", ["cpu", "ref"])
@pytest.mark.parametrize("v", [1, 2, 3, 17, 1003])
@pytest.mark.parametrize("margin", MARGINS)
def test_forward_backward(backend, v, margin):
    rng = np.random.default_rng(v + 3 * margin)
    x, _ = peaked(rng, 4, v, margin)
    p = lmloss.softmax(x, backend=backend, num_threads=1)
    lp = lmloss.log_softmax(x, backend=backend)
    check(p, R.softmax(x), what="softmax")
    check(lp, R.log_softmax(x), what="log_softmax")
    dy = rng.standard_normal(x.shape).astype(np.float32)
    for log, y in ((False, p), (True, lp)):
        ref, fl = R.softmax_backward(y, dy, log)
        check(lmloss.softmax_backward(y, dy, log, backend=backend), ref, bfloor=fl,
              what="backward log=%s" % log)
    # one-hot upstream at the peak: the gradient of log p_a survives collapse
    dy = (x == x.max(axis=1, keepdims=True)).astype(np.float32)
    ref, fl = R.softmax_backward(lp, dy, True)
    check(lmloss.softmax_backward(lp, dy, log=True, backend=backend), ref, bfloor=fl)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("margin", [0, 17, 100])
def test_dtypes(form, margin):
    x, _ = peaked(np.random.default_rng(margin), 3, 100, margin, form)
    p, lp = lmloss.softmax(x), lmloss.log_softmax(x)
    assert p.dtype == lp.dtype == (np.float32 if form == "f32" else x.dtype)
    check(p, R.softmax(x), form=form)
    check(lp, R.log_softmax(x), form=form)
    if form != "f32":
        dy = np.ones_like(x)
        dx = lmloss.softmax_backward(p, dy)
        assert dx.dtype == x.dtype
        check(dx, R.softmax_backward(p, dy)[0], form=form, bfloor=R.softmax_backward(p, dy)[1])


def test_shapes_and_strides():
    x, _ = peaked(np.random.default_rng(1), 6, 80, 20)
    x3 = x.reshape(2, 3, 80)
    assert np.array_equal(lmloss.softmax(x3).reshape(6, 80), lmloss.softmax(x))
    assert np.array_equal(lmloss.log_softmax(x[:, 5:60]), lmloss.log_softmax(x[:, 5:60].copy()))
    check(lmloss.softmax(x[::2, ::3]), R.softmax(x[::2, ::3]))
    assert lmloss.softmax(x[0]).shape == (80,)
    assert lmloss.softmax(x.astype(np.float64)).dtype == np.float32


def test_axis():
    x, _ = peaked(np.random.default_rng(2), 6, 20, 5)
    x3 = x.reshape(2, 3, 20)
    for fn, ref in ((lmloss.softmax, R.softmax), (lmloss.log_softmax, R.log_softmax)):
        got = fn(x3, 1)
        want = np.moveaxis(ref(np.moveaxis(x3, 1, -1).reshape(-1, 3)).reshape(2, 20, 3), -1, 1)
        assert got.shape == x3.shape
        check(got, want)
        assert np.array_equal(fn(x3, axis=-1), fn(x3))
        with pytest.raises(lmloss.Error):
            fn(x3, axis=3)
