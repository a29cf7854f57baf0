"""lmloss.torch.linear_dpo_loss (the DPO family through the fused head)
against the same loss formed in float64 torch from the logits: log-softmax
at the tokens, masked sums per sequence, then lmloss.torch.dpo_loss (which
test_dpo.py holds to TRL's own loss) with the token counts; the loss, the
sums, and the gradients of hidden and weight, at the default budget and at
the least that fits (groups of one pair), with masks, references, pair
weights, types that couple pairs, a frozen head, a second backward; then
bad input. CUDA: the same in bf16 against float64 on the rounded inputs."""

import ctypes

import pytest

torch = pytest.importorskip("torch")

import lmloss  # noqa: E402
import lmloss.torch as lt  # noqa: E402
from lmloss.torch import _bridge as B  # noqa: E402
from lmloss.torch import _linear_ops as L  # noqa: E402


def inputs(p, t, h, v, device="cpu", dtype=torch.float32, seed=0, masked=True):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(2 * p, t, h, generator=g)
    w = torch.randn(v, h, generator=g) / h ** 0.5 * 3
    y = torch.randint(0, v, (2 * p, t), generator=g)
    m = torch.rand(2 * p, t, generator=g) > 0.25 if masked else None
    if masked:
        m[p] = False  # a rejected completion with no token that counts
    rc = torch.randn(p, generator=g) - 2.0 * t
    rr = torch.randn(p, generator=g) - 2.0 * t
    pw = torch.rand(p, generator=g) + 0.5
    return [x if x is None else x.to(device) for x in
            (hid.to(dtype), w.to(dtype), y, m, rc, rr, pw)]


def reference(hid, w, y, m, rc, rr, average=False, **kw):
    """(loss, chosen sums, rejected sums, dhidden, dweight) in float64;
    average: the sequences' means."""
    p = y.shape[0] // 2
    h64 = hid.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    mask = torch.ones_like(y, dtype=torch.float64) if m is None else m.double()
    lp = torch.log_softmax(h64 @ w64.T, -1).gather(-1, y[..., None])[..., 0] * mask
    tok = mask.sum(-1)
    s = lp.sum(-1) / tok.clamp_min(1) if average else lp.sum(-1)
    loss = lt.dpo_loss(s[:p], s[p:], rc, rr, chosen_tokens=tok[:p], rejected_tokens=tok[p:], **kw)
    loss.backward()
    return loss.double(), s[:p].detach(), s[p:].detach(), h64.grad, w64.grad


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def least_budget(hid, w, p, loss_type="sigmoid"):
    """The least memory_budget at which the call fits (bisection on the
    size query, with both gradients wanted)."""
    fopts, fdiv = lmloss._preference.pref_values(loss_type, None, 0.1, 0.0, "reverse_kl", 0.5,
                                                 0.05, 0.5)
    opt = lmloss._preference.pref_struct(fopts, fdiv)
    keep = []
    h2 = hid.reshape(-1, hid.shape[-1])
    head = L._head(h2, w, None, keep)
    grads = L._grads_struct((torch.empty_like(h2), torch.empty_like(w), w.new_empty(0)), keep)
    lo, hi = 1, 1 << 40
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        hopt = L._hopt(mid)
        size = ctypes.c_size_t(0)
        ok = lmloss._lib.linear_preference_size(head, hopt, B.ptr(grads), p, opt,
                                                ctypes.byref(size)) == 0
        lo, hi = (lo, mid) if ok and size.value else (mid, hi)
    return hi


CASES = [
    ("sigmoid", {}),
    ("ipo", {}),
    ("robust", {"label_smoothing": 0.1}),
    ("weighted", {"weight": True}),
    ("aot+sft", {"loss_type": ["aot", "sft"], "loss_weights": [1.0, 0.5]}),
    ("apo_zero", {"loss_type": "apo_zero"}),
    ("bco_pair", {"loss_type": "bco_pair", "beta": 0.3}),
    ("simpo means", {"loss_type": "simpo", "average": True, "simpo_gamma": 0.3}),
    ("orpo+sft means", {"loss_type": ["orpo", "sft"], "average": True}),
]


@pytest.mark.parametrize("budget", ["default", "least"])
@pytest.mark.parametrize("name,cfg", CASES, ids=[n for n, _ in CASES])
def test_matches_the_composite_loss(name, cfg, budget):
    p, t, h, v = 3, 5, 16, 37
    hid, w, y, m, rc, rr, pw = inputs(p, t, h, v, seed=len(name))
    kw = {k: x for k, x in cfg.items() if k not in ("weight", "average")}
    avg = cfg.get("average", False)
    kw.setdefault("loss_type", name if name in ("ipo", "robust") else "sigmoid")
    weight = pw if cfg.get("weight") else None
    if avg:  # no empty completion: its mean would be 0, ORPO's log odds of it infinite
        m[p] = True
    ref = reference(hid, w, y, m, rc, rr, weight=weight, average=avg, **kw)
    couples = any(t in kw["loss_type"] for t in ("aot", "sft"))
    mb = None if budget == "default" else least_budget(hid, w, p)
    hl, wl = hid.clone().requires_grad_(), w.clone().requires_grad_()
    if couples and mb is not None:  # groups of one pair cannot hold a coupled type
        with pytest.raises(lmloss.Error, match="all pairs"):
            lt.linear_dpo_loss(hl, wl, y, m, rc, rr, weight_per_pair=weight, memory_budget=mb,
                               average_log_prob=avg, **kw)
        return
    loss, extra = lt.linear_dpo_loss(hl, wl, y, m, rc, rr, weight_per_pair=weight,
                                     memory_budget=mb, average_log_prob=avg, return_metrics=True,
                                     **kw)
    (3.0 * loss).backward()
    scale = float(0.1 * (ref[1].abs().sum() + ref[2].abs().sum()))
    assert abs(loss.item() - ref[0].item()) <= 1e-5 * (scale + abs(ref[0].item()))
    assert rel(extra["chosen_logps"], ref[1]) < 1e-5
    assert rel(extra["rejected_logps"], ref[2]) < 1e-5
    assert rel(hl.grad, 3.0 * ref[3]) < 1e-4
    assert rel(wl.grad, 3.0 * ref[4]) < 1e-4
    if not avg:
        assert (hl.grad[p] == 0).all()  # the masked completion


def test_frozen_head_and_second_backward():
    p, t, h, v = 2, 4, 8, 29
    hid, w, y, m, rc, rr, _ = inputs(p, t, h, v, masked=False)
    ref = reference(hid, w, y, m, rc, rr)
    hl = hid.clone().requires_grad_()
    loss = lt.linear_dpo_loss(hl, w, y, None, rc, rr)
    loss.backward(retain_graph=True)
    first = hl.grad.clone()
    loss.backward()  # recomputes: the forward's gradients were used up
    assert rel(first, ref[3]) < 1e-4
    assert rel(hl.grad, 2.0 * ref[3]) < 1e-4
    with torch.no_grad():
        assert abs(lt.linear_dpo_loss(hid, w, y, None, rc, rr).item() - ref[0].item()) < 1e-5


def test_numpy_matches_torch():
    p, t, h, v = 2, 6, 8, 31
    hid, w, y, m, rc, rr, pw = inputs(p, t, h, v, seed=3)
    ref = reference(hid, w, y, m, rc, rr, weight=pw, loss_type="ipo")
    r = lmloss.linear_dpo_loss(hid.numpy(), w.numpy(), y.numpy(), m.numpy(), rc.numpy(),
                               rr.numpy(), loss_type="ipo", weight_per_pair=pw.numpy(), grad=True)
    assert abs(r.loss - ref[0].item()) < 1e-5 * (1 + abs(ref[0].item()))
    assert rel(torch.from_numpy(r.chosen_logps), ref[1]) < 1e-5
    assert rel(torch.from_numpy(r.dhidden), ref[3]) < 1e-4
    assert rel(torch.from_numpy(r.dweight), ref[4]) < 1e-4
    assert r.metrics["pairs"] == p
    assert lmloss.linear_dpo_loss(hid.numpy(), w.numpy(), y.numpy()).dhidden is None


def test_bad_input_says_what():
    hid, w, y, m, rc, rr, _ = inputs(2, 4, 8, 29)
    with pytest.raises(lmloss.Error, match=r"\[2P, T\]"):
        lt.linear_dpo_loss(hid[:3], w, y[:3], None, rc, rr)
    b = torch.zeros(29, requires_grad=True)
    with pytest.raises(lmloss.Error, match="bias"):
        lt.linear_dpo_loss(hid, w, y, m, rc, rr, bias=b)
    with pytest.raises(lmloss.Error, match="loss_type"):
        lt.linear_dpo_loss(hid, w, y, m, rc, rr, loss_type="nope")
    bad = y.clone()
    bad[0, 0] = 29
    with pytest.raises(lmloss.Error, match="INDEX_OUT_OF_RANGE|index"):
        lt.linear_dpo_loss(hid, w, bad, None, rc, rr)
    with pytest.raises(lmloss.Error, match="ref_chosen"):
        lt.linear_dpo_loss(hid, w, y, m, rc[:1], rr)
    with pytest.raises(lmloss.Error, match="index"):
        lmloss.linear_dpo_loss(hid.numpy(), w.numpy(), y.numpy()[:3])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not lmloss.has_cuda(),
                    reason="needs a CUDA GPU and a CUDA build of liblmloss")
@pytest.mark.parametrize("budget", ["default", "least"])
def test_cuda_bf16_matches_float64(budget):
    """bf16 hidden and head: the sums and loss as in fp32 (the logits
    accumulate in fp32), the gradients within a few bf16 roundings."""
    p, t, h, v = 3, 40, 64, 1003
    hid, w, y, m, rc, rr, _ = inputs(p, t, h, v, device="cuda", dtype=torch.bfloat16)
    ref = reference(hid, w, y, m, rc, rr)
    mb = None if budget == "default" else least_budget(hid, w, p)
    hl, wl = hid.clone().requires_grad_(), w.clone().requires_grad_()
    loss, extra = lt.linear_dpo_loss(hl, wl, y, m, rc, rr, memory_budget=mb, return_metrics=True)
    loss.backward()
    assert abs(loss.item() - ref[0].item()) < 1e-4
    assert rel(extra["chosen_logps"], ref[1]) < 1e-5
    assert rel(hl.grad, ref[3]) < 2e-2
    assert rel(wl.grad, ref[4]) < 2e-2


def test_torch_compile_fullgraph():
    """The ops' fake impls trace: no graph break, the eager result."""
    p, t, h, v = 2, 4, 8, 29
    hid, w, y, _, rc, rr, _ = inputs(p, t, h, v, masked=False)
    hl, wl = hid.clone().requires_grad_(), w.clone().requires_grad_()
    f = torch.compile(lambda a, b: lt.linear_dpo_loss(a, b, y, None, rc, rr), fullgraph=True)
    loss = f(hl, wl)
    loss.backward()
    ref = reference(hid, w, y, None, rc, rr)
    assert abs(loss.item() - ref[0].item()) < 1e-5
    assert rel(hl.grad, ref[3]) < 1e-4 and rel(wl.grad, ref[4]) < 1e-4
