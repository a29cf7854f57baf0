"""The fused linear head (lmloss.linear_*) against a float64 NumPy oracle:
logits = hidden @ weight.T + bias in float64 from the float32 inputs, then
reference.py; dhidden, dweight, dbias formed in float64 from the reference
dlogits.

Tolerance (the fused head's contract for fp32): per-row values and dhidden
rows within TOL relative (norm of the row), dweight and dbias within TOL
Frobenius-relative; results with different memory budgets (chunk sizes)
agree within CHUNK_TOL on rows that are not peaked (the GEMM's rounding
depends on the chunk's row count, and a peaked row turns one ulp of a large
logit into ~1e-6 relative on its tiny loss and entropy).
"""

import ctypes

import ml_dtypes
import numpy as np
import pytest

import lmloss
import reference as R
from lmloss import _lib
from util import one_row_budget

TOL = 1e-4
CHUNK_TOL = 1e-6
FLOOR = 2.0 ** -126


def make_head(rng, n, v, margin=None, target=None, h0=16, bias=True, sigma=2.0):
    """float32 hidden [n, h0 + n], weight [v, h0 + n], bias [v]. With a
    margin, row i owns hidden dimension h0 + i and weight[target[i], h0 + i]
    makes logit target[i] lead the row's other max by the margin."""
    hd = h0 + n
    hid = np.zeros((n, hd), np.float32)
    hid[:, :h0] = rng.standard_normal((n, h0))
    w = np.zeros((v, hd), np.float32)
    w[:, :h0] = rng.standard_normal((v, h0)) * sigma / np.sqrt(h0)
    b = (0.5 * rng.standard_normal(v)).astype(np.float32) if bias else None
    if margin is not None:
        x = logits64(hid, w, b)
        for i, y in enumerate(target):
            if y < 0 or y >= v:
                continue
            hid[i, h0 + i] = 1.0
            w[y, h0 + i] = np.float32(np.delete(x[i], y).max() + margin - x[i, y])
    return hid, w, b


def logits64(hid, w, b):
    x = R.f64(hid) @ R.f64(w).T
    return x + R.f64(b) if b is not None else x


def head_grads(g, hid, w, b):
    """Exact dhidden, dweight, dbias from dlogits g [N, V]."""
    return g @ R.f64(w), g.T @ R.f64(hid), (g.sum(axis=0) if b is not None else None)


def rows_close(got, ref, tol=TOL, what=""):
    got = R.f64(got).reshape(len(ref), -1)
    ref = np.asarray(ref, np.float64).reshape(len(ref), -1)
    assert np.isfinite(got).all(), what
    err = np.linalg.norm(got - ref, axis=1)
    den = np.linalg.norm(ref, axis=1)
    bad = err > tol * den + FLOOR
    assert not bad.any(), "%s: rows %s rel err %s" % (what, np.nonzero(bad)[0],
                                                      (err / np.maximum(den, FLOOR))[bad])


def tensor_close(got, ref, tol=TOL, what=""):
    got, ref = R.f64(got), np.asarray(ref, np.float64)
    assert got.shape == ref.shape and np.isfinite(got).all(), what
    err, den = np.linalg.norm(got - ref), np.linalg.norm(ref)
    assert err <= tol * den + FLOOR, "%s: rel err %g" % (what, err / max(den, FLOOR))


def targets(rng, n, v, ignore_frac=0.0, ignore_index=-100):
    y = rng.choice(v, n, replace=False)
    return np.where(rng.random(n) < ignore_frac, ignore_index, y)


def check_ce(hid, w, b, y, tw=None, cw=None, budget=None, **kw):
    """linear_cross_entropy(grad=True) against the oracle; returns the results."""
    res = lmloss.linear_cross_entropy(hid, w, y, bias=b, token_weight=tw, class_weight=cw,
                                      grad=True, memory_budget=budget, return_lse=True,
                                      return_entropy=True, **kw)
    ref = R.cross_entropy(logits64(hid, w, b), y, token_weight=tw, class_weight=cw, **kw)
    if kw.get("reduction") == "none":
        rows_close(res.loss, ref["loss"], what="loss")
    else:
        assert abs(res.loss - ref["loss"]) <= TOL * abs(ref["loss"]) + FLOOR, (res.loss, ref)
    rows_close(res.lse, ref["lse"], what="lse")
    rows_close(res.entropy, ref["entropy"], what="entropy")
    dh, dw, db = head_grads(ref["grad"], hid, w, b)
    assert res.dhidden.dtype == np.float32 and res.dhidden.shape == hid.shape
    rows_close(res.dhidden, dh, what="dhidden")
    tensor_close(res.dweight, dw, what="dweight")
    if b is None:
        assert res.dbias is None
    else:
        tensor_close(res.dbias, db, what="dbias")
    return res


@pytest.mark.parametrize("margin", [0, 5, 17, 30, 50])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_ce_margins(margin, reduction):
    rng = np.random.default_rng(margin)
    y = targets(rng, 8, 1003)
    hid, w, b = make_head(rng, 8, 1003, margin, y, bias=margin % 2 == 1)
    check_ce(hid, w, b, y, reduction=reduction)


OPTIONS = [
    dict(label_smoothing=0.1),
    dict(z_loss=1e-3),
    dict(logit_scale=0.5),
    dict(softcap=30.0),
    dict(temperature=0.7),
    dict(dft=True),
    dict(tw=True),
    dict(cw=True),
    dict(ignore=0.75),
    dict(reduction="sum"),
    dict(num_items=37.5),
    dict(reduction="none", label_smoothing=0.2, z_loss=1e-4, tw=True),
    dict(cw=True, tw=True, label_smoothing=0.1, ignore=0.5, ignore_index=-1),
    dict(logit_scale=0.8, softcap=25.0, temperature=1.3, dft=True, reduction="sum"),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(sorted(o)))
def test_ce_options(opts):
    kw = dict(opts)
    rng = np.random.default_rng(len(str(kw)))
    n, v = 16, 1003
    ignore_index = kw.get("ignore_index", -100)
    y = targets(rng, n, v, kw.pop("ignore", 0.0), ignore_index)
    tw = (0.25 + 1.5 * rng.random(n)).astype(np.float32) if kw.pop("tw", False) else None
    cw = None
    if kw.pop("cw", False):
        cw = np.where(rng.random(v) < 0.1, 0.0, 0.5 + rng.random(v)).astype(np.float32)
    hid, w, b = make_head(rng, n, v, 5, y)
    check_ce(hid, w, b, y, tw, cw, **kw)


def test_ce_chunks():
    rng = np.random.default_rng(1)
    n, v = 13, 1003
    y = targets(rng, n, v, 0.3)
    hid, w, b = make_head(rng, n, v)  # not peaked: see CHUNK_TOL
    kw = dict(reduction="none", label_smoothing=0.1)
    b1 = one_row_budget(lambda m: lmloss.linear_cross_entropy(hid, w, y, bias=b, grad=True,
                                                              memory_budget=m, **kw))
    runs = [check_ce(hid, w, b, y, budget=m, **kw) for m in (b1, 3 * b1, None)]
    for r in runs[:2]:
        for name in ("loss", "lse", "entropy", "dhidden"):
            rows_close(getattr(r, name), R.f64(getattr(runs[2], name)), CHUNK_TOL, name)
        tensor_close(r.dweight, R.f64(runs[2].dweight), CHUNK_TOL, "dweight")
        tensor_close(r.dbias, R.f64(runs[2].dbias), CHUNK_TOL, "dbias")
    with pytest.raises(lmloss.Error) as e:
        lmloss.linear_cross_entropy(hid, w, y, bias=b, grad=True, memory_budget=b1 - 1, **kw)
    assert e.value.status == "LMLOSS_ERR_WORKSPACE_TOO_SMALL"


def test_ce_strided_class_weight():
    """A class_weight view with a stride (every other element of a buffer)
    reads as its elements, in chunks of three rows and in one chunk."""
    rng = np.random.default_rng(11)
    n, v = 13, 1003
    y = targets(rng, n, v, ignore_frac=0.2)
    hid, w, b = make_head(rng, n, v)
    cw = rng.uniform(0.5, 2.0, 2 * v).astype(np.float32)[::2]
    b1 = one_row_budget(lambda m: lmloss.linear_cross_entropy(
        hid, w, y, bias=b, class_weight=cw, grad=True, memory_budget=m))
    check_ce(hid, w, b, y, cw=cw, budget=3 * b1, label_smoothing=0.1, reduction="sum")
    check_ce(hid, w, b, y, cw=cw, label_smoothing=0.1, reduction="none")


def test_ce_leading_axes_and_outputs():
    rng = np.random.default_rng(2)
    y = targets(rng, 6, 50, 0.3)
    hid, w, b = make_head(rng, 6, 50, 5, y)
    res = lmloss.linear_cross_entropy(hid.reshape(2, 3, -1), w, y.reshape(2, 3), bias=b,
                                      grad=True, reduction="none", return_argmax=True)
    ref = R.cross_entropy(logits64(hid, w, b), y, reduction="none")
    assert res.loss.shape == (2, 3) and res.dhidden.shape == (2, 3, hid.shape[1])
    assert res.lse is None and res.entropy is None
    assert (res.argmax.ravel() == ref["argmax"]).all()
    rows_close(res.loss.ravel(), ref["loss"])
    loss, dh, dw, db = lmloss.linear_cross_entropy(hid, w, y, grad=True)
    assert db is None and dh.shape == hid.shape and dw.shape == w.shape
    assert isinstance(lmloss.linear_cross_entropy(hid, w, y), float)


def test_ce_all_ignored():
    rng = np.random.default_rng(3)
    hid, w, b = make_head(rng, 5, 40)
    y = np.full(5, -100)
    for reduction in ("mean", "sum", "none"):
        loss, dh, dw, db = lmloss.linear_cross_entropy(hid, w, y, bias=b, grad=True,
                                                       reduction=reduction)
        assert np.all(np.asarray(loss) == 0)
        assert not dh.any() and not dw.any() and not db.any()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_ce_main_grad(reduction):
    """main_grad (float32 [V, H], prefilled) gets prefill + dweight, in one
    chunk and in several (an F32 head sums over the chunks in place); the
    returned dweight is None, the other results the plain call's."""
    rng = np.random.default_rng(12)
    n, v = 13, 1003
    y = targets(rng, n, v, 0.2)
    hid, w, b = make_head(rng, n, v)
    prefill = rng.standard_normal(w.shape).astype(np.float32)
    b1 = one_row_budget(lambda m: lmloss.linear_cross_entropy(
        hid, w, y, bias=b, grad=True, main_grad=prefill.copy(), memory_budget=m))
    for budget in (None, 3 * b1):
        loss, dh, dw, db = lmloss.linear_cross_entropy(hid, w, y, bias=b, grad=True,
                                                       reduction=reduction,
                                                       memory_budget=budget)
        main_grad = prefill.copy()
        got = lmloss.linear_cross_entropy(hid, w, y, bias=b, grad=True, reduction=reduction,
                                          memory_budget=budget, main_grad=main_grad)
        assert got[2] is None
        np.testing.assert_allclose(main_grad, prefill + dw, rtol=1e-6, atol=1e-6)
        for a, want in zip((got[0], got[1], got[3]), (loss, dh, db)):
            np.testing.assert_array_equal(a, want)


def test_ce_main_grad_errors():
    """main_grad must be float32 [V, H], writable, its rows added to in
    place (never a copy), and comes with grad=True."""
    rng = np.random.default_rng(13)
    y = targets(rng, 6, 50)
    hid, w, b = make_head(rng, 6, 50)

    def status(main_grad, grad=True):
        with pytest.raises(lmloss.Error) as e:
            lmloss.linear_cross_entropy(hid, w, y, grad=grad, main_grad=main_grad)
        return e.value.status.replace("LMLOSS_ERR_", "")

    ok = np.zeros(w.shape, np.float32)
    ro = ok.copy()
    ro.flags.writeable = False
    assert status(ok.astype(np.float64)) == "BAD_DTYPE"
    assert status(ok.astype(">f4")) == "BAD_DTYPE"
    assert status(ok.T) == "BAD_SHAPE"
    assert status(np.zeros((50, 2 * w.shape[1]), np.float32)[:, ::2]) == "BAD_STRIDE"
    assert status(ro) == "BAD_STRIDE"
    assert status(ok, grad=False) == "BAD_OPTION"
    with pytest.raises(TypeError, match="main_grad"):
        lmloss.linear_cross_entropy(hid, w, y, grad=True, main_grad=ok.tolist())
    assert not ok.any()


def test_linear_plan():
    """lmloss_linear_plan from shapes alone: the issue's bf16 head (the
    table of docs/design.md section 4) keeps a store of all rows at the
    default budget, with a float32 main_grad too and no accumulator of its
    own; 256 MiB takes vocab tiles (the logits twice); twice the rows at 4
    GiB take groups and dweight's fp32 accumulator, and at the default
    budget groups stored in dweight's own bytes. A float32 head's plan
    is the workspace its call asks."""
    n, h, v, mib = 8192, 4096, 152064, 1 << 20
    default = lmloss.linear_plan(n, h, v, dtype="bfloat16")
    added = lmloss.linear_plan(n, h, v, dtype=ml_dtypes.bfloat16, main_grad=True)
    for p in (default, added):
        assert (p.group_rows, p.logits_gemms, p.accumulator_bytes) == (n, 1, 0)
        assert p.store_bytes < p.workspace_bytes <= 256 * mib + 4 * v * h
    tiles = lmloss.linear_plan(n, h, v, dtype="bfloat16", memory_budget=256 * mib)
    assert (tiles.group_rows, tiles.logits_gemms) == (0, 2)
    assert tiles.workspace_bytes <= 256 * mib
    groups = lmloss.linear_plan(2 * n, h, v, dtype="bfloat16", memory_budget=4096 * mib)
    assert 1024 <= groups.group_rows < 2 * n and groups.accumulator_bytes == 4 * v * h
    in_dw = lmloss.linear_plan(2 * n, h, v, dtype="bfloat16")
    assert (in_dw.group_rows, in_dw.logits_gemms, in_dw.store_in_dweight) == (3968, 1, 1)
    assert in_dw.store_bytes <= 2 * v * h and in_dw.accumulator_bytes == 4 * v * h
    assert in_dw.workspace_bytes <= 256 * mib + 4 * v * h
    assert not any(p.store_in_dweight for p in (default, added, tiles, groups))
    rng = np.random.default_rng(14)
    hid, w, b = make_head(rng, 6, 50)
    head = lmloss._linear._Head(hid, w, b)
    size = ctypes.c_size_t()
    for k, grads in ((1, head.grads()[1]), (3, None)):
        _lib.check(_lib.linear_workspace_size(head.t, _lib.head_options_default(), grads, k,
                                              ctypes.byref(size)))
        plan = lmloss.linear_plan(6, hid.shape[1], 50, bias=True, grad=grads is not None, k=k)
        assert plan.workspace_bytes == size.value
    with pytest.raises(lmloss.Error, match="dtype"):
        lmloss.linear_plan(6, 8, 50, dtype="int8")


def check_lp(hid, w, b, idx, budget=None, mask=None, **tr):
    logp, ent = lmloss.linear_log_probs(hid, w, idx, bias=b, mask=mask, entropy=True,
                                        memory_budget=budget, **tr)
    z = R.transform(logits64(hid, w, b), **tr)[0]
    _, lp, p, _, _ = R.stats(z)
    n = len(hid)
    ref_lp = np.take_along_axis(lp, idx.reshape(n, -1), axis=1).reshape(idx.shape)
    ref_ent = R.entropy_terms(lp, p)[0]
    if mask is not None:
        ref_lp = np.where(mask.reshape((n,) + (1,) * (idx.ndim - 1)), ref_lp, 0.0)
        ref_ent = np.where(mask, ref_ent, 0.0)
    assert logp.shape == idx.shape and logp.dtype == np.float32
    rows_close(logp, ref_lp, what="logp")
    rows_close(ent, ref_ent, what="entropy")
    return logp, ent


TRANSFORMS = [dict(), dict(temperature=0.7), dict(logit_scale=0.5, softcap=30.0),
              dict(logit_scale=0.8, softcap=25.0, temperature=1.3)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("tr", TRANSFORMS, ids=lambda t: ",".join(sorted(t)) or "plain")
@pytest.mark.parametrize("masked", [False, True])
def test_log_probs(k, tr, masked):
    rng = np.random.default_rng(10 * k + len(tr))
    n, v = 10, 1003
    y = targets(rng, n, v)
    hid, w, b = make_head(rng, n, v, 17, y)
    idx = y if k == 1 else np.stack([y] + [rng.integers(0, v, n) for _ in range(k - 1)], 1)
    mask = rng.random(n) < 0.7 if masked else None
    check_lp(hid, w, b, idx, mask=mask, **tr)


@pytest.mark.parametrize("which", ["dlogp", "dentropy", "both"])
@pytest.mark.parametrize("tr", TRANSFORMS[:3], ids=lambda t: ",".join(sorted(t)) or "plain")
def test_log_probs_backward(which, tr):
    rng = np.random.default_rng(len(which) + 7 * len(tr))
    n, v, k = 10, 1003, 3
    y = targets(rng, n, v)
    hid, w, b = make_head(rng, n, v, 30, y)
    idx = np.stack([y, rng.integers(0, v, n), rng.integers(0, v, n)], 1)
    mask = rng.random(n) < 0.7
    dlogp = rng.standard_normal((n, k)).astype(np.float32) if which != "dentropy" else None
    dent = rng.standard_normal(n).astype(np.float32) if which != "dlogp" else None
    index = None if which == "dentropy" else idx
    dh, dw, db = lmloss.linear_log_probs_backward(hid, w, index, dlogp, dent, bias=b, mask=mask,
                                                  **tr)
    g, _ = R.log_probs_backward(logits64(hid, w, b), idx, dlogp, dent, mask=mask, **tr)
    rdh, rdw, rdb = head_grads(g, hid, w, b)
    rows_close(dh, rdh, what="dhidden")
    assert not dh[~mask].any()
    tensor_close(dw, rdw, what="dweight")
    tensor_close(db, rdb, what="dbias")


def test_log_probs_stats():
    """stats=True: those of log_probs over the logits; the backward takes
    them (a float32 head's recomputes: lmloss.h) with the same gradients."""
    rng = np.random.default_rng(12)
    n, v = 10, 1003
    y = targets(rng, n, v)
    hid, w, b = make_head(rng, n, v, 30, y)
    mask = rng.random(n) < 0.7
    logp, ent, st = lmloss.linear_log_probs(hid, w, y, bias=b, mask=mask, entropy=True,
                                            stats=True, temperature=0.9)
    x = (logits64(hid, w, b)).astype(np.float32)
    _, _, ref = lmloss.log_probs(x, y, mask=mask, entropy=True, stats=True, temperature=0.9)
    assert st.shape == (n, 4) and st.dtype == np.float32
    assert np.array_equal(st[:, 3], ref[:, 3]) and np.all(st[~mask] == [0, 0, 0, -1])
    rows_close(st[:, :3], R.f64(ref[:, :3]), what="stats")
    dlogp = rng.standard_normal(n).astype(np.float32)
    dent = rng.standard_normal(n).astype(np.float32)
    kw = dict(bias=b, mask=mask, temperature=0.9)
    got = lmloss.linear_log_probs_backward(hid, w, y, dlogp, dent, stats=st, **kw)
    want = lmloss.linear_log_probs_backward(hid, w, y, dlogp, dent, **kw)
    for a, e in zip(got, want):
        assert np.array_equal(a, e)
    with pytest.raises(lmloss.Error, match="BAD_SHAPE"):
        lmloss.linear_log_probs_backward(hid, w, y, dlogp, dent, stats=st[:5], **kw)


def test_log_probs_chunks():
    rng = np.random.default_rng(4)
    n, v = 11, 1003
    y = targets(rng, n, v)
    hid, w, b = make_head(rng, n, v)  # not peaked: see CHUNK_TOL
    idx = np.stack([y, rng.integers(0, v, n)], 1)
    mask = rng.random(n) < 0.7
    dlogp = rng.standard_normal((n, 2)).astype(np.float32)
    dent = rng.standard_normal(n).astype(np.float32)
    b1 = one_row_budget(lambda m: lmloss.linear_log_probs(hid, w, idx, bias=b, memory_budget=m))
    fwd = [check_lp(hid, w, b, idx, budget=m, mask=mask) for m in (b1, 3 * b1, None)]

    def backward(m):
        return lmloss.linear_log_probs_backward(hid, w, idx, dlogp, dent, bias=b, mask=mask,
                                                memory_budget=m)
    b1 = one_row_budget(backward)  # its own: the backward's buffers differ
    bwd = [backward(m) for m in (b1, 3 * b1, None)]
    for i in range(2):
        rows_close(fwd[i][0], R.f64(fwd[2][0]), CHUNK_TOL, "logp")
        rows_close(fwd[i][1], R.f64(fwd[2][1]), CHUNK_TOL, "entropy")
        rows_close(bwd[i][0], R.f64(bwd[2][0]), CHUNK_TOL, "dhidden")
        tensor_close(bwd[i][1], R.f64(bwd[2][1]), CHUNK_TOL, "dweight")
        tensor_close(bwd[i][2], R.f64(bwd[2][2]), CHUNK_TOL, "dbias")


H = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
W = np.random.default_rng(1).standard_normal((10, 8)).astype(np.float32)
Y = np.array([1, 2, 3, 4])

ERRORS = [
    ("H mismatch", lmloss.linear_cross_entropy, (H, W[:, :7], Y), {}, "BAD_SHAPE"),
    ("weight 1-D", lmloss.linear_cross_entropy, (H, W[0], Y), {}, "BAD_SHAPE"),
    ("bias shape", lmloss.linear_cross_entropy, (H, W, Y), dict(bias=np.ones(9)), "BAD_SHAPE"),
    ("target shape", lmloss.linear_cross_entropy, (H, W, Y[:3]), {}, "BAD_SHAPE"),
    ("token_weight shape", lmloss.linear_cross_entropy, (H, W, Y),
     dict(token_weight=np.ones(3)), "BAD_SHAPE"),
    ("dtype mismatch", lmloss.linear_cross_entropy, (H, W.astype(ml_dtypes.bfloat16), Y), {},
     "BAD_DTYPE"),
    ("bf16 head on the CPU", lmloss.linear_cross_entropy,
     (H.astype(ml_dtypes.bfloat16), W.astype(ml_dtypes.bfloat16), Y), {}, "UNSUPPORTED"),
    ("bf16 head log-probs", lmloss.linear_log_probs,
     (H.astype(ml_dtypes.bfloat16), W.astype(ml_dtypes.bfloat16), Y), {}, "UNSUPPORTED"),
    ("ref backend", lmloss.linear_cross_entropy, (H, W, Y), dict(backend="ref"), "UNSUPPORTED"),
    ("target out of range", lmloss.linear_cross_entropy, (H, W, [1, 2, 3, 10]), {},
     "INDEX_OUT_OF_RANGE"),
    ("index out of range", lmloss.linear_log_probs, (H, W, [0, 1, 2, 10]), {},
     "INDEX_OUT_OF_RANGE"),
    ("budget too small", lmloss.linear_cross_entropy, (H, W, Y), dict(memory_budget=16),
     "WORKSPACE_TOO_SMALL"),
    ("budget 0", lmloss.linear_cross_entropy, (H, W, Y), dict(memory_budget=0), "BAD_OPTION"),
    ("temperature 0", lmloss.linear_log_probs, (H, W, Y), dict(temperature=0.0), "BAD_OPTION"),
    ("label_smoothing", lmloss.linear_cross_entropy, (H, W, Y), dict(label_smoothing=2.0),
     "BAD_OPTION"),
    ("reduction", lmloss.linear_cross_entropy, (H, W, Y), dict(reduction="avg"), "BAD_OPTION"),
    ("dlogp shape", lmloss.linear_log_probs_backward, (H, W, Y, np.ones(3)), {}, "BAD_SHAPE"),
    ("no upstream", lmloss.linear_log_probs_backward, (H, W, Y, None), {}, "NULL_POINTER"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors(case):
    _, fn, args, kw, status = case
    with pytest.raises(lmloss.Error) as e:
        fn(*args, **kw)
    assert e.value.status == "LMLOSS_ERR_" + status and e.value.message


def test_struct_layout():
    """lmloss_head, lmloss_head_options, lmloss_head_grads on LP64 (checked with gcc)."""
    assert ctypes.sizeof(_lib.Head) == 120 and _lib.Head.bias.offset == 80
    assert ctypes.sizeof(_lib.HeadOptions) == 16 and _lib.HeadOptions.fp32_accumulate.offset == 8
    assert ctypes.sizeof(_lib.HeadGrads) == 128 and _lib.HeadGrads.dweight.offset == 40
    assert _lib.HeadGrads.accumulate.offset == 120
    assert ctypes.sizeof(_lib.HeadPlan) == 48 and _lib.HeadPlan.logits_gemms.offset == 40
    d = _lib.head_options_default()
    assert (d.memory_budget, d.fp32_accumulate) == (0, 1)
