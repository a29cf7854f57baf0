"""lmloss.torch on the CPU against PyTorch reference forms run in float64.

Inputs are made in float32 (or bf16/fp16); the reference computes on the
same values in float64 with plain torch ops and autograd. Tolerance: fp32
results rtol 2e-5, atol 1e-6 (fp32 accumulation of the C kernels); the
fused head (fp32 GEMMs) rtol 1e-4; 16-bit gradients one unit of their
dtype's roundoff. gradcheck runs on float32 inputs with eps = 1e-3 and
atol/rtol suited to fp32 finite differences (the C library computes in
fp32, so float64 gradcheck tolerances cannot hold); the exact check of
every backward is the float64 parity here.
"""

import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lmloss  # noqa: E402
import lmloss.torch as lt  # noqa: E402
from lmloss.torch import _bridge  # noqa: E402

F64 = torch.float64


def close(got, ref, rtol=2e-5, atol=1e-6):
    torch.testing.assert_close(got.detach().to(F64), ref.detach().to(F64), rtol=rtol, atol=atol)


def transform(x, logit_scale=1.0, softcap=0.0, temperature=1.0):
    z = x * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def ref_ce(x, y, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_scale=1.0,
           softcap=None, temperature=1.0, token_weight=None, class_weight=None, weight=None,
           reduction="mean", num_items=None, dft=False):
    """The loss of include/lmloss.h in float64 torch ops, rows [N, V];
    weight= is class_weight= (per class, as in torch)."""
    class_weight = weight if class_weight is None else class_weight
    z = transform(x, logit_scale, softcap, temperature)
    v = z.shape[-1]
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    valid = y != ignore_index
    yc = torch.where(valid, y, 0)
    c = torch.ones(v, dtype=F64) if class_weight is None else class_weight.to(F64)
    nll = -logp.gather(1, yc[:, None])[:, 0]
    ce = c[yc] * (1 - label_smoothing) * nll + label_smoothing / v * (-(logp * c).sum(-1))
    if dft:
        ce = ce * (-nll).exp().detach()
    loss = ce + z_loss * lse ** 2
    if token_weight is not None:
        loss = loss * token_weight.to(F64)
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if num_items is not None:
        return loss.sum() / float(num_items)
    if reduction == "sum":
        return loss.sum()
    den = (c[yc] * valid).sum()
    return loss.sum() / den if den > 0 else loss.sum() * 0


def data(n=12, v=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 3).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[1] = -100
    y[5] = -100
    return x, y


CE_CASES = [dict(), dict(reduction="sum"), dict(reduction="none"),
            dict(label_smoothing=0.1), dict(z_loss=1e-3), dict(softcap=4.0, temperature=0.7),
            dict(logit_scale=0.5), dict(dft=True), dict(ignore_index=3),
            dict(reduction="sum", num_items=7), dict(class_weight="cw", label_smoothing=0.2),
            dict(token_weight="tw", reduction="none"), dict(weight="cw"),
            dict(weight="cw", token_weight="tw", reduction="sum", label_smoothing=0.1)]


@pytest.mark.parametrize("case", CE_CASES, ids=[str(c) for c in CE_CASES])
def test_cross_entropy_matches_float64_reference(case):
    x, y = data()
    kw = dict(case)
    for name in ("weight", "class_weight"):
        if kw.get(name) == "cw":
            kw[name] = torch.rand(37, generator=torch.Generator().manual_seed(1)) + 0.5
    if kw.get("token_weight") == "tw":
        kw["token_weight"] = torch.rand(12, generator=torch.Generator().manual_seed(2))
    if "ignore_index" in kw:
        y = torch.where(y == -100, kw["ignore_index"], y)
    xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
    got, ref = lt.cross_entropy(xg.view(3, 4, 37), y.view(3, 4), **kw), ref_ce(xr, y, **kw)
    assert got.dtype == torch.float32
    assert got.shape == ((3, 4) if kw.get("reduction") == "none" else ())
    close(got.reshape(-1), ref.reshape(-1))
    up = torch.rand(got.shape, dtype=torch.float32) if got.dim() else torch.tensor(1.7)
    (got * up).sum().backward()
    (ref * up.reshape(ref.shape).to(F64)).sum().backward()
    close(xg.grad, xr.grad)


def test_num_items_tensor_divides_on_device_and_gradscaler_scale():
    x, y = data()
    n = torch.tensor(9.0)
    xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
    got = lt.cross_entropy(xg, y, reduction="sum", num_items=n)
    ref = ref_ce(xr, y, reduction="sum", num_items=9.0)
    close(got, ref)
    (got * 65536.0).backward()  # GradScaler's scaled backward: dloss is a device tensor
    (ref * 65536.0).backward()
    close(xg.grad, xr.grad, atol=1e-2)


def test_extras_and_collapse_exactness():
    x, y = data()
    y[1] = y[5] = 0
    x[0] = 0.0
    x[0, y[0]] = 25.0  # a collapsed row: fp32 log_softmax gives exactly 0 loss
    r = lt.cross_entropy(x, y, reduction="none", return_lse=True, return_entropy=True,
                         return_argmax=True)
    x64 = x.to(F64)
    close(r.loss[1:], ref_ce(x64, y, reduction="none")[1:], atol=0)
    assert torch.nn.functional.cross_entropy(x[:1], y[:1]) == 0
    close(r.loss[0], (36.0 * torch.exp(torch.tensor(-25.0, dtype=F64))).log1p(),
          atol=0)
    close(r.lse, torch.logsumexp(x64, -1), atol=0)
    p = torch.softmax(x64, -1)
    close(r.entropy, -(p * torch.log_softmax(x64, -1)).sum(-1), atol=1e-12)
    assert torch.equal(r.argmax, x.argmax(-1))
    assert r.dlogits is None


@pytest.mark.parametrize("kw", [dict(), dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3),
                                dict(num_items=torch.tensor(7.0), weight="cw", dft=True),
                                dict(softcap=4.0, temperature=0.7, return_lse=True)],
                         ids=["mean", "sum", "num_items tensor", "softcap"])
def test_cross_entropy_gradient_in_forward(kw, monkeypatch):
    """A scalar loss forms its gradient in the forward's pass (no backward
    call) and scales it by the upstream; a second backward through the
    graph recomputes it (the first scaled the formed one in place). A
    num_items tensor divides after the op: its backward kernel runs."""
    x, y = data()
    kw = {k: torch.rand(37) + 0.5 if v == "cw" else v for k, v in kw.items()}
    rkw = {k: v for k, v in kw.items() if k != "return_lse"}
    calls, real = [], _bridge.ce_backward
    monkeypatch.setattr(_bridge, "ce_backward", lambda *a: calls.append(1) or real(*a))
    xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
    got = lt.cross_entropy(xg, y, **kw)
    got = got.loss if kw.get("return_lse") else got
    ref = ref_ce(xr, y, **rkw)
    (0.37 * got).backward(retain_graph=True)
    (0.37 * ref).backward()
    first = int(torch.is_tensor(kw.get("num_items")))
    assert len(calls) == first
    close(xg.grad, xr.grad)
    (0.37 * got).backward()
    assert len(calls) == first + 1
    close(xg.grad, 2 * xr.grad)


def test_cross_entropy_inplace_backward():
    """inplace_backward=True (the module's too) writes the gradient over
    the logits (strided rows included), bumps their version so that
    another op that saved them raises, and refuses a second backward;
    where the gradient is not formed in the forward it leaves them alone."""
    x, y = data()
    xr = x.to(F64).requires_grad_()
    (0.37 * ref_ce(xr, y)).backward()
    big = torch.cat([x, torch.ones(12, 5)], 1).requires_grad_()
    loss = lt.cross_entropy(big[:, :37], y, inplace_backward=True)
    (0.37 * loss).backward(retain_graph=True)
    close(big.grad[:, :37], xr.grad)
    assert torch.equal(big.detach()[:, :37], big.grad[:, :37]) and big.grad[:, 37:].eq(0).all()
    assert big.detach()[:, 37:].eq(1).all()
    with pytest.raises(RuntimeError, match="inplace_backward"):
        loss.backward()
    xg = x.clone().requires_grad_()
    total = (xg * xg).sum() + lt.CrossEntropyLoss(inplace_backward=True)(xg, y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        total.backward()
    for kw in (dict(reduction="none"), dict(backend="ref")):
        xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
        loss = lt.cross_entropy(xg, y, inplace_backward=True, **kw)
        assert torch.equal(xg, x)
        loss.sum().backward()
        ref_ce(xr, y, reduction=kw.get("reduction", "mean")).sum().backward()
        close(xg.grad, xr.grad)
    lt.cross_entropy(x, y, inplace_backward=True)  # no gradient wanted
    assert torch.equal(x, data()[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_logits_accumulate_in_fp32(dtype):
    x, y = data(dtype=dtype)
    xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
    got, ref = lt.cross_entropy(xg, y), ref_ce(xr, y)
    assert got.dtype == torch.float32
    close(got, ref)
    got.backward()
    ref.backward()
    assert xg.grad.dtype == dtype
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    close(xg.grad, xr.grad, rtol=eps, atol=1e-5)


def test_strided_rows_are_passed_without_copy():
    big, y = data(v=50)
    x = big[:, :37]
    keep = []
    view = _bridge.view(x, keep)
    assert keep == [x] and view.data == x.data_ptr() and view.row_stride == 50
    keep = []
    col = _bridge.view(big[:, 3], keep)  # 1-D, evenly spaced: [N, 1], row stride 50
    assert col.data == big[:, 3].data_ptr() and (col.rows, col.cols, col.row_stride) == (12, 1, 50)
    keep = []
    _bridge.view(big[:, ::2], keep)  # strided last axis: copied
    assert keep[0].is_contiguous() and keep[0].data_ptr() != big.data_ptr()
    xg = x.clone().requires_grad_()
    close(lt.cross_entropy(x, y.clamp(max=36)), lt.cross_entropy(xg, y.clamp(max=36)))
    close(lt.log_probs(x, y.clamp(0, 36)), lt.log_probs(xg, y.clamp(0, 36)))


@pytest.mark.parametrize("k", [None, 3])
def test_log_probs_and_entropy_match_reference(k):
    x, _ = data()
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 37, (12,) if k is None else (12, k), generator=g)
    mask = torch.ones(12, dtype=torch.bool)
    mask[4] = False
    xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
    logp, ent = lt.log_probs(xg, idx, temperature=0.8, mask=mask, entropy=True)
    lp = torch.log_softmax(xr / 0.8, -1)
    ridx = idx if k else idx[:, None]
    rlogp = torch.where(mask[:, None], lp.gather(1, ridx), 0.0).reshape(idx.shape)
    rent = torch.where(mask, -(lp.exp() * lp).sum(-1), 0.0)
    close(logp, rlogp)
    close(ent, rent)
    a, b = torch.randn(idx.shape, generator=g), torch.randn(12, generator=g)
    ((logp * a).sum() + (ent * b).sum()).backward()
    ((rlogp * a.to(F64)).sum() + (rent * b.to(F64)).sum()).backward()
    close(xg.grad, xr.grad)


def trl_selective_log_softmax(logits, index, temperature=1.0, row_mask=None):
    """TRL's reference form (trl.trainer.utils without its Triton kernel)."""
    logits = logits / temperature
    squeeze = index.dim() == logits.dim() - 1
    idx = index.unsqueeze(-1) if squeeze else index
    lp = torch.log_softmax(logits, -1).gather(-1, idx)
    lp = lp.squeeze(-1) if squeeze else lp
    return lp if row_mask is None else lp.masked_fill(row_mask == 0, 0.0)


@pytest.mark.parametrize("k", [None, 2])
def test_trl_names_in_lmloss_torch(k):
    """TRL's selective_log_softmax(logits, index, temperature, row_mask) and
    entropy_from_logits(logits, chunk_size) signatures and results (the
    logits' dtype), in lmloss.torch itself."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 41, generator=g) * 3
    idx = torch.randint(0, 41, (2, 5) if k is None else (2, 5, k), generator=g)
    mask = torch.ones(idx.shape, dtype=torch.long)
    mask[0, 1] = 0
    xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
    got = lt.selective_log_softmax(xg, idx, 0.7, mask)  # TRL's positional order
    want = trl_selective_log_softmax(xr, idx, 0.7, mask)
    assert got.dtype == torch.float32 and got.shape == idx.shape
    close(got, want)
    got.sum().backward()
    want.sum().backward()
    close(xg.grad, xr.grad)
    assert lt.selective_log_softmax(x.bfloat16(), idx).dtype == torch.bfloat16
    ent = lt.entropy_from_logits(x, chunk_size=3)
    close(ent, -(torch.softmax(x.to(F64), -1) * torch.log_softmax(x.to(F64), -1)).sum(-1))
    assert lt.entropy_from_logits(x.half()).dtype == torch.float16
    with pytest.raises(ValueError):
        lt.selective_log_softmax(x, idx, 0.0)
    from lmloss.integrations import trl as ltrl
    assert ltrl.selective_log_softmax is lt.selective_log_softmax
    assert ltrl.entropy_from_logits is lt.entropy_from_logits


def test_softcap_none_and_liger_keywords():
    """softcap=None is off (Liger-Kernel's and cut-cross-entropy's default);
    ignore_index as theirs."""
    x, y = data()
    y3 = torch.where(y == -100, 3, y)
    w = torch.randn(37, 37, generator=torch.Generator().manual_seed(14)) * 0.1
    for fn in (lambda **kw: lt.cross_entropy(x, y3, ignore_index=3, **kw),
               lambda **kw: lt.linear_cross_entropy(x, w, y, **kw),
               lambda **kw: lt.linear_log_probs(x, w, y.clamp(min=0), **kw)):
        assert torch.equal(fn(softcap=None), fn(softcap=0.0))
    close(lt.cross_entropy(x, y3, ignore_index=3, softcap=None),
          torch.nn.functional.cross_entropy(x.to(F64), y3, ignore_index=3))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shift", [1, True, 3])
def test_shift_as_cut_cross_entropy(reduction, shift):
    """shift (cut-cross-entropy's): position t predicts label t + shift for
    [B, T] labels: the last positions of the logits and the first labels
    are dropped; "none" gives [B, T - shift]."""
    s = int(shift)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 7, 23, generator=g) * 2
    y = torch.randint(0, 23, (2, 7), generator=g)
    y[0, 4] = -100
    tw = torch.rand(2, 7, generator=g)
    xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
    got = lt.cross_entropy(xg, y, shift=shift, reduction=reduction)
    flat = lambda t: t.reshape(-1, t.shape[-1]) if t.dim() == 3 else t.reshape(-1)  # noqa: E731
    want = torch.nn.functional.cross_entropy(flat(xr[:, :-s]), flat(y[:, s:]),
                                             reduction=reduction)
    if reduction == "none":
        assert got.shape == (2, 7 - s)
        want = want.reshape(2, 7 - s)
    close(got, want)
    got.sum().backward()
    want.sum().backward()
    close(xg.grad, xr.grad)
    assert not xg.grad[:, -s:].any()
    wt = lt.cross_entropy(x, y, shift=s, token_weight=tw, reduction="none")
    close(wt, lt.cross_entropy(x[:, :-s], y[:, s:], token_weight=tw[:, s:], reduction="none"))
    hs, w = torch.randn(2, 7, 16, generator=g), torch.randn(23, 16, generator=g)
    close(lt.linear_cross_entropy(hs, w, y, shift=shift, reduction=reduction),
          lt.linear_cross_entropy(hs[:, :-s], w, y[:, s:], reduction=reduction), rtol=1e-5)
    r = lt.cross_entropy(x, y, shift=s, reduction=reduction, return_lse=True)
    assert r.lse.shape == (2, 7 - s)
    with pytest.raises(lmloss.Error, match="shift"):
        lt.cross_entropy(x, y, shift=7)


def test_softmax_dim():
    """dim= on softmax and log_softmax: any axis (moved last and back)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 17, 4, generator=g) * 3
    for ours, ref in ((lt.softmax, torch.softmax), (lt.log_softmax, torch.log_softmax)):
        for dim in (0, 1, -1, -3):
            xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
            got, want = ours(xg, dim), ref(xr, dim)
            assert got.shape == x.shape
            close(got, want)
            up = torch.randn(x.shape, generator=g)
            (got * up).sum().backward()
            (want * up.to(F64)).sum().backward()
            close(xg.grad, xr.grad)
        assert torch.equal(ours(x, dim=1), ours(x.movedim(1, -1)).movedim(-1, 1))
    with pytest.raises(lmloss.Error):
        lt.softmax(x, dim=3)


SOFT_CASES = [dict(), dict(reduction="sum"), dict(reduction="none"), dict(label_smoothing=0.2),
              dict(weight="cw"), dict(weight="cw", label_smoothing=0.1, reduction="sum")]


@pytest.mark.parametrize("case", SOFT_CASES, ids=[str(c) for c in SOFT_CASES])
def test_soft_targets_as_torch(case):
    """Class-probability targets of the logits' shape, as F.cross_entropy
    takes them (weight, label_smoothing and the reductions as torch
    defines them), with the exact gradient softmax * sum(q) - q."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 6, 29, generator=g) * 3
    p = torch.softmax(torch.randn(2, 6, 29, generator=g), -1)
    kw = dict(case)
    if kw.get("weight") == "cw":
        kw["weight"] = torch.rand(29, generator=g) + 0.5
    rkw = {k: (v.to(F64) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
    got = lt.cross_entropy(xg, p, **kw)
    want = torch.nn.functional.cross_entropy(xr.movedim(-1, 1), p.to(F64).movedim(-1, 1), **rkw)
    assert got.dtype == torch.float32
    close(got, want)
    up = torch.rand(got.shape, generator=g) if got.dim() else torch.tensor(1.3)
    (got * up).sum().backward()
    (want * up.to(F64)).sum().backward()
    close(xg.grad, xr.grad)


def test_soft_targets_collapse_and_shift():
    """A confident row keeps its loss with a one-hot probability target (the
    log-softmax is lmloss's), and shift applies to soft targets too."""
    x = torch.zeros(1, 1003)
    x[0, 7] = 30.0
    p = torch.zeros(1, 1003)
    p[0, 7] = 1.0
    got = lt.cross_entropy(x, p, reduction="sum")
    want = torch.log1p(torch.tensor(1002.0, dtype=F64) * torch.exp(torch.tensor(-30.0, dtype=F64)))
    assert torch.nn.functional.cross_entropy(x, p, reduction="sum") == 0
    close(got, want, atol=0)
    g = torch.Generator().manual_seed(13)
    x3 = torch.randn(2, 5, 11, generator=g)
    p3 = torch.softmax(torch.randn(2, 5, 11, generator=g), -1)
    close(lt.cross_entropy(x3, p3, shift=2), lt.cross_entropy(x3[:, :-2], p3[:, 2:]))
    with pytest.raises(lmloss.Error):
        lt.cross_entropy(x3, p3, return_lse=True)
    close(lt.cross_entropy(x3[0, 0], p3[0, 0]),  # one row [V], as F.cross_entropy takes it
          torch.nn.functional.cross_entropy(x3[0, 0].to(F64), p3[0, 0].to(F64)))
    with pytest.raises(lmloss.Error) as e:
        lt.cross_entropy(x3, [[1] * 5] * 2)
    assert e.value.status == "LMLOSS_ERR_BAD_DTYPE"


def test_log_probs_backward_reads_saved_stats(monkeypatch):
    """Autograd's backward takes the forward's row statistics (the logits
    are then read once), and its gradient is the recomputing one's."""
    x, _ = data()
    idx = torch.randint(0, 37, (12,), generator=torch.Generator().manual_seed(5))
    seen, real = [], lmloss._lib.log_probs_backward
    monkeypatch.setattr(lmloss._lib, "log_probs_backward",
                        lambda *a: seen.append(a[-1]) or real(*a))
    xg = x.clone().requires_grad_()
    logp, ent = lt.log_probs(xg, idx, temperature=0.8, entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert len(seen) == 1 and seen[0] is not None
    want = lmloss.log_probs_backward(x.numpy(), idx.numpy(), np.ones(12, np.float32),
                                     np.ones(12, np.float32), temperature=0.8)
    assert torch.equal(xg.grad, torch.from_numpy(want))


def test_entropy_softmax_log_softmax_match_reference():
    x, _ = data()
    g = torch.Generator().manual_seed(4)
    for ours, ref in ((lambda t: lt.entropy(t, temperature=1.3),
                       lambda t: -(torch.softmax(t / 1.3, -1) * torch.log_softmax(t / 1.3, -1)
                                   ).sum(-1)),
                      (lt.softmax, lambda t: torch.softmax(t, -1)),
                      (lt.log_softmax, lambda t: torch.log_softmax(t, -1))):
        xg, xr = x.clone().requires_grad_(), x.to(F64).requires_grad_()
        got, want = ours(xg), ref(xr)
        close(got, want)
        up = torch.randn(got.shape, generator=g)
        (got * up).sum().backward()
        (want * up.to(F64)).sum().backward()
        close(xg.grad, xr.grad)
    assert lt.softmax(x.to(torch.bfloat16)).dtype == torch.bfloat16


def head(n=10, h=16, v=37, bias=True, seed=5):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.5
    b = torch.randn(v, generator=g) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[2] = -100
    return hs, w, b, y


LIN_CASES = [dict(), dict(reduction="sum"), dict(reduction="none", token_weight="tw"),
             dict(softcap=5.0, logit_scale=0.7, temperature=1.2, label_smoothing=0.1,
                  z_loss=1e-3), dict(memory_budget=4096)]


@pytest.mark.parametrize("case", LIN_CASES, ids=[str(c) for c in LIN_CASES])
def test_linear_cross_entropy_matches_reference(case):
    hs, w, b, y = head()
    kw = dict(case)
    if kw.get("token_weight") == "tw":
        kw["token_weight"] = torch.rand(10)
    params = [t.clone().requires_grad_() for t in (hs, w, b)]
    ref_params = [t.to(F64).requires_grad_() for t in (hs, w, b)]
    got = lt.linear_cross_entropy(params[0], params[1], y, bias=params[2], **kw)
    rh, rw, rb = ref_params
    rkw = {k: v for k, v in kw.items() if k != "memory_budget"}
    ref = ref_ce(rh @ rw.T + rb, y, **rkw)
    close(got, ref, rtol=1e-4)
    got.sum().backward()
    ref.sum().backward()
    for p, r in zip(params, ref_params):
        close(p.grad, r.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(reduction="sum", label_smoothing=0.1),
                                dict(num_items=torch.tensor(7.0)), dict(reduction="none")],
                         ids=["mean", "sum", "num_items tensor", "none"])
def test_linear_cross_entropy_upstream_gradient(kw):
    """A scalar loss's gradients come from its forward (computed at an
    upstream 1) and are scaled by the upstream gradient; per-row losses are
    recomputed. Both against float64, with an upstream that is not 1, and
    with the weight frozen (only dhidden computed)."""
    hs, w, b, y = head()
    up = torch.linspace(0.5, 2.0, 10, dtype=F64) if kw.get("reduction") == "none" else 2.5
    for frozen in (False, True):
        params = [hs.clone().requires_grad_(), w.clone().requires_grad_(not frozen), b.clone()]
        refp = [hs.to(F64).requires_grad_(), w.to(F64).requires_grad_(not frozen), b.to(F64)]
        got = lt.linear_cross_entropy(params[0], params[1], y, bias=params[2], **kw)
        ref = ref_ce(refp[0] @ refp[1].T + refp[2], y, **kw)
        close(got, ref, rtol=1e-4)
        (got.to(F64) * up).sum().backward()
        (ref * up).sum().backward()
        close(params[0].grad, refp[0].grad, rtol=1e-4, atol=1e-5)
        if frozen:
            assert params[1].grad is None
        else:
            close(params[1].grad, refp[1].grad, rtol=1e-4, atol=1e-5)


def test_linear_cross_entropy_second_backward():
    """The forward's gradients are scaled in place by the first backward (no
    second dW); a second backward through the same graph recomputes them,
    so it adds the same gradients again, not twice-scaled ones."""
    hs, w, b, y = head()
    hg, wg = hs.clone().requires_grad_(), w.clone().requires_grad_()
    loss = lt.linear_cross_entropy(hg, wg, y, bias=b)
    (3.0 * loss).backward(retain_graph=True)
    first = hg.grad.clone(), wg.grad.clone()
    (3.0 * loss).backward()
    close(hg.grad, 2 * first[0], rtol=1e-5, atol=1e-7)
    close(wg.grad, 2 * first[1], rtol=1e-5, atol=1e-7)


def test_linear_cross_entropy_weight_grad_is_not_copied():
    """The dW the forward computed becomes weight.grad itself: autograd
    takes it over rather than cloning it (a second dW-sized buffer)."""
    hs, w, b, y = head()
    hg, wg = hs.clone().requires_grad_(), w.clone().requires_grad_()
    loss = lt.linear_cross_entropy(hg, wg, y, bias=b)
    nodes, node = [loss.grad_fn], None
    while node is None and nodes:
        fn = nodes.pop()
        node = fn if hasattr(fn, "fwd_grads") else None
        nodes += [n for n, _ in fn.next_functions if n is not None]
    ptr = node.fwd_grads[1].untyped_storage().data_ptr()
    loss.backward()
    assert wg.grad.untyped_storage().data_ptr() == ptr


MAIN_GRAD_CASES = [
    ("mean, upstream 1", dict(), None),
    ("mean, upstream 0.37", dict(), 0.37),
    ("sum, smoothing, chunks, upstream 0.37", dict(reduction="sum", label_smoothing=0.1,
                                                   memory_budget=4096), 0.37),
    ("num_items number, upstream 1", dict(reduction="sum", num_items=7.0), None),
    ("num_items tensor", dict(num_items=torch.tensor(7.0)), None),
    ("none, weighted sum", dict(reduction="none"), torch.linspace(0.5, 2.0, 10)),
]


def _backward(loss, up):
    (loss if up is None else (loss * up).sum()).backward()


@pytest.mark.parametrize("case", MAIN_GRAD_CASES, ids=[c[0] for c in MAIN_GRAD_CASES])
def test_linear_cross_entropy_main_grad(case, monkeypatch):
    """main_grad (float32, prefilled) gets prefill + dW, dW being what the
    ordinary path leaves in weight.grad, for any upstream, while
    weight.grad stays None; hidden's and bias's gradients are the ordinary
    ones. A scalar loss backpropagated as it is (an upstream of 1) runs no
    backward pass: the forward added dW; any other upstream runs one, the
    (upstream - 1) x dW correction; a num_items tensor's upstream (never 1)
    is met in the backward alone."""
    from lmloss.torch import _linear_ops
    _, kw, up = case
    hs, w, b, y = head()
    params = [t.clone().requires_grad_() for t in (hs, w, b)]
    _backward(lt.linear_cross_entropy(params[0], params[1], y, bias=params[2], **kw), up)
    prefill = torch.randn(w.shape, generator=torch.Generator().manual_seed(3))
    main_grad = prefill.clone()
    calls = []
    real = _linear_ops._ce_backward
    monkeypatch.setattr(_linear_ops, "_ce_backward",  # records `need`
                        lambda *a: calls.append(a[-2]) or real(*a))
    hg, wg, bg = (t.clone().requires_grad_() for t in (hs, w, b))
    loss = lt.linear_cross_entropy(hg, wg, y, bias=bg, main_grad=main_grad, **kw)
    _backward(loss, up)
    assert wg.grad is None
    close(main_grad, prefill + params[1].grad, rtol=1e-5, atol=1e-6)
    close(hg.grad, params[0].grad, rtol=1e-5, atol=1e-7)
    close(bg.grad, params[2].grad, rtol=1e-5, atol=1e-7)
    every = _linear_ops.NEED_DH | _linear_ops.NEED_DW | _linear_ops.NEED_DB
    if kw.get("reduction") == "none" or isinstance(kw.get("num_items"), torch.Tensor):
        assert calls == [every]
    else:
        assert calls == ([] if up is None else [_linear_ops.NEED_DW])


def test_linear_cross_entropy_main_grad_second_backward_and_cast_weight():
    """A second backward through the graph adds the weight's gradient
    again, scaled by its upstream, as it would accumulate weight.grad; a
    bf16 weight (run in fp32 on the CPU: the op's weight is its cast)
    keeps no .grad either. A frozen weight, grad mode off and no rows leave
    main_grad as it was."""
    hs, w, b, y = head()
    wr = w.clone().requires_grad_()
    lt.linear_cross_entropy(hs, wr, y, bias=b).backward()
    main_grad = torch.zeros_like(w)
    wg = w.clone().requires_grad_()
    loss = lt.linear_cross_entropy(hs, wg, y, bias=b, main_grad=main_grad)
    (0.37 * loss).backward(retain_graph=True)
    (2.0 * loss).backward()
    close(main_grad, 2.37 * wr.grad, rtol=1e-5, atol=1e-6)
    assert wg.grad is None
    wb = w.bfloat16().requires_grad_()
    main_grad.zero_()
    lt.linear_cross_entropy(hs, wb, y, bias=b, main_grad=main_grad).backward()
    wr = wb.detach().float().requires_grad_()
    lt.linear_cross_entropy(hs, wr, y, bias=b).backward()
    assert wb.grad is None
    close(main_grad, wr.grad, rtol=1e-5, atol=1e-6)
    main_grad.zero_()
    lt.linear_cross_entropy(hs.requires_grad_(), w, y, main_grad=main_grad).backward()
    with torch.no_grad():
        lt.linear_cross_entropy(hs, wg, y, main_grad=main_grad)
    h0 = torch.empty(0, 16, requires_grad=True)
    lt.linear_cross_entropy(h0, wg, y[:0], reduction="sum", main_grad=main_grad).backward()
    assert not main_grad.any() and wg.grad is None


def test_linear_cross_entropy_main_grad_megatron_flags():
    """A weight that Megatron-core's DDP tracks (grad_added_to_main_grad)
    has the flag set, and gets a placeholder gradient, as Megatron's own
    layers return (its hook asserts that one arrived, then drops it):
    zeros with zero_out_wgrad."""
    hs, w, b, y = head()
    main_grad = torch.zeros_like(w)
    for zero_out in (False, True):
        wp = torch.nn.Parameter(w.clone())
        wp.main_grad, wp.grad_added_to_main_grad, wp.zero_out_wgrad = main_grad, False, zero_out
        lt.linear_cross_entropy(hs, wp, y, main_grad=wp.main_grad).backward()
        assert wp.grad_added_to_main_grad and wp.grad.shape == w.shape
        assert not zero_out or not wp.grad.any()
    wr = w.clone().requires_grad_()
    lt.linear_cross_entropy(hs, wr, y).backward()
    close(main_grad, 2 * wr.grad, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_main_grad_errors():
    """main_grad must be a float32 tensor of the weight's shape, on its
    device, with rows the call can add to in place; not while tracing, and
    not vocab-parallel yet."""
    from torch.fx.experimental.proxy_tensor import make_fx
    hs, w, b, y = head()
    w = w.requires_grad_()

    def status(main_grad, **kw):
        with pytest.raises(lmloss.Error) as e:
            lt.linear_cross_entropy(hs, w, y, main_grad=main_grad, **kw)
        return e.value.status.replace("LMLOSS_ERR_", "")

    assert status(torch.zeros(37, 16, dtype=F64)) == "BAD_DTYPE"
    assert status(torch.zeros(37, 16, dtype=torch.bfloat16)) == "BAD_DTYPE"
    assert status(torch.zeros(16, 37)) == "BAD_SHAPE"
    assert status(torch.zeros(37, 16, device="meta")) == "BAD_DEVICE"
    assert status(torch.zeros(37, 32)[:, ::2]) == "BAD_STRIDE"
    assert status(torch.zeros(37, 16), process_group=object()) == "BAD_OPTION"
    with pytest.raises(TypeError, match="main_grad"):
        lt.linear_cross_entropy(hs, w, y, main_grad=np.zeros((37, 16), np.float32))
    main_grad = torch.zeros(37, 16)
    with pytest.raises(lmloss.Error, match="eager only"):
        make_fx(lambda a, c: lt.linear_cross_entropy(a, c, y, main_grad=main_grad))(hs, w)
    assert not main_grad.any()


def test_linear_plan_reads_shapes_only():
    """lt.linear_plan is lmloss.linear_plan for the call's head dtype: meta
    tensors describe the issue's bf16 head (docs/design.md section 4's
    table) without its memory. The default budget keeps a store of all rows
    (three GEMMs), with a float32 main_grad too and no accumulator of its
    own; 256 MiB takes vocab tiles (the logits twice). CPU tensors run in
    float32, whose head has no store."""
    n, h, v = 8192, 4096, 152064
    hid = torch.empty(n, h, dtype=torch.bfloat16, device="meta")
    w = torch.empty(v, h, dtype=torch.bfloat16, device="meta")
    main_grad = torch.empty(v, h, device="meta")
    plans = [lt.linear_plan(hid, w), lt.linear_plan(hid, w, main_grad=main_grad),
             lt.linear_plan(hid, w, memory_budget=256 << 20)]
    assert plans[0] == lmloss.linear_plan(n, h, v, dtype="bfloat16")
    for p in plans[:2]:
        assert (p.group_rows, p.logits_gemms, p.accumulator_bytes) == (n, 1, 0)
        assert p.store_bytes < p.workspace_bytes <= (256 << 20) + 4 * v * h
    assert (plans[2].group_rows, plans[2].logits_gemms) == (0, 2)
    assert plans[2].workspace_bytes <= 256 << 20
    hs, wc, b, y = head()
    p = lt.linear_plan(hs.bfloat16().reshape(2, 5, 16), wc.bfloat16(), b)
    assert p == lmloss.linear_plan(10, 16, 37, bias=True) and p.group_rows == 0


def test_linear_log_probs_matches_reference_and_frozen_head():
    hs, w, b, y = head()
    idx = torch.stack([y.clamp(min=0), (y + 1).clamp(0, 36)], -1)
    mask = y != -100
    hg, wg = hs.clone().requires_grad_(), w.clone().requires_grad_()
    hr, wr = hs.to(F64).requires_grad_(), w.to(F64).requires_grad_()
    logp, ent = lt.linear_log_probs(hg, wg, idx, bias=b, mask=mask, softcap=3.0, entropy=True)
    lp = torch.log_softmax(3.0 * torch.tanh((hr @ wr.T + b.to(F64)) / 3.0), -1)
    rlogp = torch.where(mask[:, None], lp.gather(1, idx), 0.0)
    rent = torch.where(mask, -(lp.exp() * lp).sum(-1), 0.0)
    close(logp, rlogp, rtol=1e-4, atol=1e-5)
    close(ent, rent, rtol=1e-4, atol=1e-5)
    (logp.sum() + 0.5 * ent.sum()).backward()
    (rlogp.sum() + 0.5 * rent.sum()).backward()
    close(hg.grad, hr.grad, rtol=1e-4, atol=1e-5)
    close(wg.grad, wr.grad, rtol=1e-4, atol=1e-5)
    hf = hs.clone().requires_grad_()  # frozen head: only dhidden is asked for
    lt.linear_cross_entropy(hf, w, y).backward()
    assert hf.grad is not None and w.grad is None


def test_linear_sixteen_bit_on_cpu_runs_in_fp32():
    hs, w, b, y = head(bias=False)
    hb, wb = hs.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    loss = lt.linear_cross_entropy(hb, wb, y)
    close(loss, ref_ce(hb.detach().to(F64) @ wb.detach().to(F64).T, y), rtol=1e-4)
    loss.backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16


def test_weight_is_torch_class_weight():
    """weight= is F.cross_entropy's per-class weight (issue 35: it meant
    per-token weights, 2.88 where torch gives 2.58); the module agrees."""
    x, y = data()
    cw = torch.rand(37, generator=torch.Generator().manual_seed(8)) + 0.5
    for kw in (dict(), dict(label_smoothing=0.1), dict(reduction="sum"),
               dict(reduction="none")):
        want = torch.nn.functional.cross_entropy(x.to(F64), y, weight=cw.to(F64), **kw)
        close(lt.cross_entropy(x, y, weight=cw, **kw), want)
        close(lt.CrossEntropyLoss(weight=cw, **kw)(x, y), want)
    tw = torch.rand(12)
    close(lt.CrossEntropyLoss(reduction="none")(x, y, token_weight=tw),
          lt.cross_entropy(x, y, token_weight=tw, reduction="none"), atol=0)
    with pytest.raises(lmloss.Error, match="token_weight"):
        lt.cross_entropy(x, y, weight=cw, class_weight=cw)


def test_modules():
    x, y = data()
    cw = torch.rand(37) + 0.5
    ours = lt.CrossEntropyLoss(weight=cw, label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=cw.to(F64), label_smoothing=0.1)
    close(ours(x, y), theirs(x.to(F64), y))
    close(lt.CrossEntropyLoss(reduction="none", softcap=2.0)(x, y),
          ref_ce(x.to(F64), y, reduction="none", softcap=2.0))
    hs, w, b, y = head()
    close(lt.LinearCrossEntropyLoss(label_smoothing=0.1)(hs, w, y, bias=b),
          lt.linear_cross_entropy(hs, w, y, bias=b, label_smoothing=0.1), atol=0)
    close(lt.LinearLogProbs(temperature=0.9)(hs, w, y.clamp(min=0)),
          lt.linear_log_probs(hs, w, y.clamp(min=0), temperature=0.9), atol=0)


def test_linear_module_refuses_liger_order():
    """forward(hidden, weight, target); Liger's (weight, hidden, target) is
    refused with a message that names it, even when N == V."""
    hs, w, b, y = head(n=10, v=37)
    loss_fn = lt.LinearCrossEntropyLoss()
    lm_head = torch.nn.Linear(16, 37, bias=False)
    loss_fn(hs, lm_head.weight, y)  # lmloss's order
    with pytest.raises(lmloss.Error, match="Liger") as e:
        loss_fn(lm_head.weight, hs, y)  # N != V: the target has hidden's rows
    assert e.value.status == "LMLOSS_ERR_BAD_SHAPE"
    sq = torch.nn.Linear(16, 10, bias=False)  # N == V == 10: shapes cannot tell
    with pytest.raises(lmloss.Error, match="Liger"):
        loss_fn(sq.weight, hs, y.clamp(min=0))
    with pytest.raises(lmloss.Error, match="Liger"):
        lt.linear_log_probs(sq.weight, hs, y.clamp(min=0))
    with pytest.raises(lmloss.Error, match="share H"):
        loss_fn(hs, torch.randn(37, 15), y)
    with pytest.raises(lmloss.Error) as e:
        loss_fn(hs, w.to("meta"), y)
    assert e.value.status == "LMLOSS_ERR_BAD_DEVICE" and "meta" in str(e.value)
    close(loss_fn(hs, sq.weight.detach().T.contiguous().T, y.clamp(max=9)),
          lt.linear_cross_entropy(hs, sq.weight, y.clamp(max=9)), atol=0)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")  # float32 inputs, on purpose
def test_gradcheck_float32():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, generator=g, requires_grad=True)
    y = torch.tensor([1, -100, 4])
    hs = torch.randn(3, 4, generator=g, requires_grad=True)
    w = torch.randn(5, 4, generator=g, requires_grad=True)
    tol = dict(eps=1e-3, atol=2e-3, rtol=1e-2)
    assert torch.autograd.gradcheck(lambda t: lt.cross_entropy(t, y, z_loss=0.1), (x,), **tol)
    fns = [lambda t: lt.log_probs(t, y.clamp(min=0), entropy=True),
           lambda t: lt.entropy(t, temperature=0.7), lt.softmax, lt.log_softmax]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (x,), **tol)
    assert torch.autograd.gradcheck(
        lambda a, b: lt.linear_cross_entropy(a, b, y, label_smoothing=0.1), (hs, w), **tol)
    assert torch.autograd.gradcheck(
        lambda a, b: lt.linear_log_probs(a, b, y.clamp(min=0), entropy=True), (hs, w), **tol)


def test_errors():
    x, y = data()
    with pytest.raises(lmloss.Error) as e:
        lt.cross_entropy(x, y, reduction="avg")
    assert e.value.status == "LMLOSS_ERR_BAD_OPTION"
    with pytest.raises(lmloss.Error) as e:
        lt.cross_entropy(x, torch.full((12,), 99))
    assert e.value.status == "LMLOSS_ERR_INDEX_OUT_OF_RANGE"
    fake_cuda = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
    if not lmloss.has_cuda():
        with pytest.raises(lmloss.Error, match="built without CUDA") as e:
            _bridge.check_device(fake_cuda)
        assert e.value.status == "LMLOSS_ERR_UNSUPPORTED"


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_no_rows_return_what_torch_returns(lead):
    """N = 0: torch's results ("none" empty, "sum" 0, "mean" NaN; empty
    log-probs, entropy, softmax), in the graph, where the C call had
    "data is NULL"."""
    x = torch.empty(*lead, 7, requires_grad=True)
    y = torch.empty(lead, dtype=torch.long)
    for red in ("none", "sum", "mean"):
        got = lt.cross_entropy(x, y, reduction=red)
        want = torch.nn.functional.cross_entropy(x.detach().reshape(-1, 7), y.reshape(-1),
                                                 reduction=red)
        assert got.dtype == torch.float32
        assert got.shape == (lead if red == "none" else ())
        torch.testing.assert_close(got.detach().reshape(want.shape), want, equal_nan=True)
        got.sum().backward()
        assert x.grad.shape == x.shape
    h, w = torch.empty(*lead, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True)
    loss = lt.linear_cross_entropy(h, w, y, reduction="sum")
    loss.backward()
    assert loss == 0 and torch.equal(w.grad, torch.zeros(7, 4))
    assert lt.linear_cross_entropy(h, w, y).isnan()
    r = lt.cross_entropy(x, y, reduction="none", return_lse=True, return_argmax=True)
    assert r.lse.shape == lead and r.argmax.dtype == torch.int64
    assert lt.log_probs(x, y).shape == lead
    logp, ent = lt.log_probs(x, y[..., None].expand(*lead, 3), entropy=True)
    assert logp.shape == lead + (3,) and ent.shape == lead
    assert lt.entropy(x).shape == lead and lt.softmax(x).shape == x.shape
    assert lt.log_softmax(x.double()).dtype == torch.float32
    assert lt.linear_log_probs(h, w, y).shape == lead


def test_bad_input_errors():
    """V = 0, float or [N, 1] targets, uint64 targets, a target on another
    device: lmloss errors, as NumPy's API gives them."""
    x, y = data()

    def status(fn, *args, **kw):
        with pytest.raises(lmloss.Error) as e:
            fn(*args, **kw)
        return e.value.status.replace("LMLOSS_ERR_", ""), str(e.value)

    assert status(lt.cross_entropy, torch.empty(3, 0), torch.zeros(3, dtype=torch.long))[0] \
        == "BAD_SHAPE"
    assert status(lt.softmax, torch.empty(3, 0))[0] == "BAD_SHAPE"
    assert status(lt.log_probs, torch.empty(0, 0), torch.zeros(0, dtype=torch.long))[0] \
        == "BAD_SHAPE"
    assert status(lt.linear_cross_entropy, torch.randn(3, 4), torch.empty(0, 4),
                  torch.zeros(3, dtype=torch.long))[0] == "BAD_SHAPE"
    st, msg = status(lt.cross_entropy, x, y.float())
    assert st == "BAD_DTYPE" and "probabilities" in msg
    assert status(lt.cross_entropy, x, y[:, None])[0] == "BAD_SHAPE"
    assert status(lt.cross_entropy, x, y[:6])[0] == "BAD_SHAPE"
    assert status(lt.log_probs, x, y.clamp(min=0).double())[0] == "BAD_DTYPE"
    assert status(lt.log_probs, x, torch.zeros(12, 2, 1, dtype=torch.long))[0] == "BAD_SHAPE"
    assert status(lt.linear_cross_entropy, torch.randn(12, 4), torch.randn(37, 4),
                  y.float())[0] == "BAD_DTYPE"
    assert status(lt.cross_entropy, x, y.to(torch.uint64))[0] == "BAD_DTYPE"
    assert status(lt.cross_entropy, x, y, ignore_index=2 ** 63)[0] == "BAD_OPTION"
    for dev in ("meta",):
        st, msg = status(lt.cross_entropy, x, y.to(dev))
        assert st == "BAD_DEVICE" and "meta" in msg and "target" in msg
        st, msg = status(lt.log_probs, x, y.clamp(min=0).to(dev))
        assert st == "BAD_DEVICE" and "index" in msg
        st, msg = status(lt.cross_entropy, x, torch.softmax(x, -1).to(dev))
        assert st == "BAD_DEVICE"
    st, msg = status(lt.cross_entropy, x.to("meta"), y.to("meta"))
    assert st == "BAD_DEVICE" and "meta" in msg
    assert torch.equal(lt.cross_entropy(x, y.to(torch.int16)), lt.cross_entropy(x, y))


def test_import_lmloss_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import lmloss\n"
            "try:\n    import lmloss.torch\nexcept ImportError:\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_eager_calls_skip_torch_library_dispatch_with_the_same_results():
    """Eagerly, the op bodies run from a torch.autograd.Function (torch.library's
    dispatch cost 0.38 ms of host time per op call on the GPU machine); the
    custom op itself, which torch.compile traces, gives the same loss and
    gradient bit for bit."""
    from lmloss.torch import _ops
    torch.manual_seed(0)
    x = torch.randn(6, 50, requires_grad=True)
    y = torch.randint(0, 50, (6,))
    loss = lt.cross_entropy(x, y, label_smoothing=0.1)
    assert type(loss.grad_fn).__name__ == "_EagerBackward"
    loss.backward()
    grad, x.grad = x.grad, None
    fopts, iopts = _ops.ce_args(-100, 0.1, 0.0, 1.0, 0.0, 1.0, "mean", None, False, 0, 0)
    op_loss = torch.ops.lmloss.cross_entropy(x, y, None, None, fopts, iopts, 0)[0]
    assert type(op_loss.grad_fn).__name__ != "_EagerBackward"
    op_loss.backward()
    assert torch.equal(loss, op_loss) and torch.equal(grad, x.grad)


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_tracing_records_the_custom_ops(mode):
    """make_fx (real or fake tensors, as non-strict export uses) records the
    custom ops, not the eager path that reads data pointers."""
    from torch.fx.experimental.proxy_tensor import make_fx
    x, y = torch.randn(4, 10), torch.randint(0, 10, (4,))
    g = make_fx(lambda a, b: lt.cross_entropy(a, b) + lt.log_probs(a, b).sum(),
                tracing_mode=mode)(x, y)
    assert "lmloss.cross_entropy" in str(g.graph) and "lmloss.log_probs" in str(g.graph)
