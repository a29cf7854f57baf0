"""lmloss.torch on CUDA tensors (marker `cuda`). These tests are skipped when
torch.cuda.is_available() is False, or when the loaded library has no CUDA
backend; that is the only skip of the torch suite. Results are compared with
the CPU backend on the same values; calls run on a side stream and under
torch.cuda.set_sync_debug_mode("error") (torch raises on any synchronizing
torch op inside the forward and backward; the fused head's one count read
is the C library's own)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lmloss  # noqa: E402
import lmloss.torch as lt  # noqa: E402
import util  # noqa: E402
from test_divergence import (IDS, KINDS, TORCH_FNS, oracle, pair, peaked_pair,  # noqa: E402
                             row_floor)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or not lmloss.has_cuda(),
                                 reason="needs a CUDA GPU and a CUDA build of liblmloss")]


def close(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a.detach().cpu().double(), b.detach().cpu().double(), rtol=rtol,
                               atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logits_ops_match_cpu_on_a_side_stream_without_host_sync(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 1003, generator=g) * 3).to(dtype)
    y = torch.randint(0, 1003, (64,), generator=g)
    y[3] = -100
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    # host-to-device copies happen before the no-sync region: only lmloss runs in it
    yg, yg0, items = y.cuda(), y.clamp(min=0).cuda(), torch.tensor(50.0, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda.set_sync_debug_mode("error")
        try:
            lg = lt.cross_entropy(xg, yg, label_smoothing=0.1, z_loss=1e-4, num_items=items)
            lp, ent = lt.log_probs(xg, yg0, entropy=True)
            total = lg + lp.sum() * 1e-3 + lt.entropy(xg).sum() * 1e-3 + \
                lt.log_softmax(xg)[:, 0].sum() + lt.softmax(xg)[:, 1].sum()
            (total * 1024.0).backward()  # GradScaler-style scaled dloss, read on the device
        finally:
            torch.cuda.set_sync_debug_mode(0)
    s.synchronize()
    lc = lt.cross_entropy(xc, y, label_smoothing=0.1, z_loss=1e-4, num_items=50.0)
    lpc, entc = lt.log_probs(xc, y.clamp(min=0), entropy=True)
    totc = lc + lpc.sum() * 1e-3 + lt.entropy(xc).sum() * 1e-3 + \
        lt.log_softmax(xc)[:, 0].sum() + lt.softmax(xc)[:, 1].sum()
    (totc * 1024.0).backward()
    assert lg.device.type == "cuda" and xg.grad.dtype == dtype
    close(lg, lc)
    close(lp, lpc)
    close(ent, entc)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    close(xg.grad, xc.grad, rtol=tol, atol=tol)


def test_logits_ops_replay_in_a_cuda_graph():
    """The logits ops are capturable in a CUDA graph: a forward+backward
    recorded once and replayed on new values gives what eager calls on those
    values give, bit for bit (the row kernels merge in a fixed order); the
    plain cross-entropy's one pass (its gradient formed in the forward,
    scaled on the device in the backward) takes the held plan."""
    g = torch.Generator().manual_seed(2)
    n, v = 96, 4099

    def values():
        x = (torch.randn(n, v, generator=g) * 4).to(torch.bfloat16)
        y = torch.randint(0, v, (n,), generator=g)
        y[::7] = -100
        return x.cuda(), y.cuda()

    def step(x, y):
        held = x[:, :4096].contiguous()  # 16-byte aligned rows: the held plan
        loss = (lt.cross_entropy(x, y, label_smoothing=0.1, z_loss=1e-4)
                + lt.cross_entropy(held, y.clamp(max=4095)))
        lp, ent = lt.log_probs(x, y.clamp(min=0), entropy=True)
        (loss + (lp.sum() + ent.sum()) * 1e-3 + lt.softmax(x)[:, 1].sum()).backward()
        return loss, lp, ent

    xs = torch.zeros(n, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ys = torch.zeros(n, device="cuda", dtype=torch.long)
    x0, y0 = values()
    with torch.no_grad():
        xs.copy_(x0)
        ys.copy_(y0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        for _ in range(2):
            xs.grad = None
            step(xs, ys)
    torch.cuda.current_stream().wait_stream(side)
    xs.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = step(xs, ys)
    for _ in range(2):
        x1, y1 = values()
        with torch.no_grad():
            xs.copy_(x1)
            ys.copy_(y1)
        graph.replay()
        xe = x1.clone().requires_grad_()
        eager = step(xe, y1)
        torch.cuda.synchronize()
        for r, e in zip(recorded, eager):
            assert torch.equal(r, e)
        assert torch.equal(xs.grad, xe.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_on_cuda_and_under_autocast(dtype):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(300, 64, generator=g)
    w = torch.randn(5000, 64, generator=g) * 0.2
    y = torch.randint(0, 5000, (300,), generator=g)
    y[:20] = -100
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    hg, wg = h.cuda().to(dtype).requires_grad_(), w.cuda().to(dtype).requires_grad_()
    lg = lt.linear_cross_entropy(hg, wg, y.cuda(), softcap=30.0)
    lg.backward()
    lc = lt.linear_cross_entropy(hc, wc, y, softcap=30.0)
    lc.backward()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    close(lg, lc, rtol=tol, atol=tol)
    close(hg.grad, hc.grad, rtol=tol, atol=tol)
    close(wg.grad, wc.grad, rtol=tol, atol=tol)
    assert wg.grad.dtype == dtype
    w32 = w.cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32 master weight, bf16 head
        la = lt.linear_cross_entropy(h.cuda(), w32, y.cuda())
        lp = lt.linear_log_probs(h.cuda(), w32, y.clamp(min=0).cuda())
    (la + lp.sum() * 1e-3).backward()
    assert la.dtype == torch.float32 and w32.grad.dtype == torch.float32
    close(la, lc, rtol=2e-2, atol=2e-2)


def test_fused_head_log_probs_backward_from_saved_stats_cuda():
    """A bf16 head over several chunks: the backward takes the forward's row
    statistics (its vocab tiles form dhidden too) and matches the CPU's."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(300, 64, generator=g)
    w = torch.randn(5000, 64, generator=g) * 0.2
    y = torch.randint(0, 5000, (300, 2), generator=g)
    mask = torch.rand(300, generator=g) < 0.8

    def run(hh, ww, **kw):
        dev = hh.device
        lp, ent = lt.linear_log_probs(hh, ww, y.to(dev), mask=mask.to(dev), entropy=True,
                                      temperature=0.9, **kw)
        (lp.sum() + 0.5 * ent.sum()).backward()

    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    run(hc, wc)
    hg, wg = h.cuda().bfloat16().requires_grad_(), w.cuda().bfloat16().requires_grad_()
    run(hg, wg, memory_budget=2 << 20)  # 300 x 5000 fp32 logits are 6 MB: several chunks
    close(hg.grad, hc.grad, rtol=2e-2, atol=2e-2)
    close(wg.grad, wc.grad, rtol=2e-2, atol=2e-2)
    assert not hg.grad[~mask.cuda()].any()


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["kept", "entropy-gradient"])
def test_fused_head_kept_log_probs_cuda(entropy_grad, monkeypatch):
    """A bf16 head whose store of all rows fits: the forward keeps each
    row's gradient of its log-prob and the backward runs two GEMMs from it
    (KeptLogProbs); a GRPO-like loss of the log-probs matches the CPU's
    fp32 gradients, masked rows read 0, and an entropy gradient (not kept)
    takes the recomputing backward, right too."""
    from lmloss.torch import _linear_ops as L
    calls = []
    apply = L.KeptLogProbs.apply
    monkeypatch.setattr(L.KeptLogProbs, "apply", lambda *a: calls.append(1) or apply(*a))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(300, 64, generator=g)
    w = torch.randn(5000, 64, generator=g) * 0.2
    y = torch.randint(0, 5000, (300,), generator=g)
    mask = torch.rand(300, generator=g) < 0.8
    adv = torch.randn(300, generator=g)

    def run(hh, ww):
        dev = hh.device
        lp, ent = lt.linear_log_probs(hh, ww, y.to(dev), mask=mask.to(dev), entropy=True,
                                      temperature=0.9)
        ratio = torch.exp(lp - lp.detach())
        loss = -(ratio * adv.to(dev)).sum() + 0.1 * lp.sum()
        if entropy_grad:
            loss = loss - 0.05 * ent.sum()
        loss.backward()
        return lp, ent

    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    lpc, entc = run(hc, wc)
    hg, wg = h.cuda().bfloat16().requires_grad_(), w.cuda().bfloat16().requires_grad_()
    lpg, entg = run(hg, wg)
    assert calls == [1]
    close(lpg, lpc, rtol=2e-2, atol=2e-2)
    close(entg, entc, rtol=2e-2, atol=2e-2)
    close(hg.grad, hc.grad, rtol=2e-2, atol=2e-2)
    close(wg.grad, wc.grad, rtol=2e-2, atol=2e-2)
    assert not hg.grad[~mask.cuda()].any() and not lpg[~mask.cuda()].any()


@pytest.mark.parametrize("loss_type,option", [("dapo", "kl"), ("grpo", "plain"),
                                               ("cispo", "vllm"), ("bnpo", "off_policy"),
                                               ("dapo", "sequence")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_grpo_on_logits_cuda(loss_type, option, dtype):
    """grpo_loss_on_logits on CUDA (one pass for token-level options; two
    for the off-policy mask and the sequence level) against the CPU's fp32
    call on the same logits: loss, log-probs, metrics, the logits' gradient.
    The one pass reads no masked token's logits: its log-prob is 0."""
    g = torch.Generator().manual_seed(11)
    b, t, v = 4, 33, 5003
    x = torch.randn(b, t, v, generator=g) * 2
    tok = torch.randint(0, v, (b, t), generator=g)
    x.view(-1, v)[torch.arange(0, b * t, 3), tok.view(-1)[::3]] += 30
    x = x.to(dtype).float()  # both sides read the same values
    mask = (torch.rand(b, t, generator=g) < 0.85).float()
    adv = torch.randn(b, generator=g)
    old = -torch.rand(b, t, generator=g) * 3
    ref = old + 0.3 * torch.randn(b, t, generator=g)
    kw = dict(loss_type=loss_type, temperature=0.8, return_metrics=True, return_logps=True)
    if option == "kl":
        kw.update(beta=0.04, ref_per_token_logps=ref)
    if option == "vllm":
        kw.update(importance_sampling_ratio=0.5 + torch.rand(b, t, generator=g))
    if option == "off_policy":
        kw.update(off_policy_mask_threshold=0.01, sampling_per_token_logps=old + 0.1)
    if option == "sequence":
        kw.update(importance_sampling_level="sequence")

    def run(xx):
        xx = xx.detach().requires_grad_()
        dev = xx.device
        moved = {k: (val.to(dev) if isinstance(val, torch.Tensor) else val) for k, val in kw.items()}
        loss, met, lp = lt.grpo_loss_on_logits(xx, tok.to(dev), adv.to(dev), mask.to(dev),
                                               old.to(dev), **moved)
        (0.5 * loss).backward()
        return loss, met, lp, xx.grad

    lc, mc, pc, gc = run(x)
    lg, mg, pg, gg = run(x.cuda().to(dtype))
    close(lg, lc, rtol=1e-4, atol=1e-6)
    if option in ("off_policy", "sequence"):  # two passes: every token's log-prob
        close(pg, pc, rtol=1e-5, atol=1e-6)
    else:
        close(pg, torch.where(mask.bool(), pc, 0.0), rtol=1e-5, atol=1e-6)
    close(torch.nan_to_num(mg), torch.nan_to_num(mc), rtol=1e-4, atol=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    close(gg.float(), gc, rtol=tol, atol=tol * gc.abs().max().item())


MAIN_GRAD_BUDGETS = [(None, "store of all rows"), (16 << 20, "store in groups"),
                     (8 << 20, "vocab tiles")]


@pytest.mark.parametrize("budget,schedule", MAIN_GRAD_BUDGETS,
                         ids=[c[1] for c in MAIN_GRAD_BUDGETS])
def test_fused_head_main_grad_cuda(budget, schedule):
    """A bf16 head adding its fp32 dW to main_grad on each schedule, which
    lt.linear_plan names: the default budget's store of all rows, 16 MiB's
    store in groups summed in main_grad itself (no accumulator of the
    call's own), 8 MiB's vocab tiles. main_grad, prefilled, gets prefill +
    dW for an upstream of 1 and of 0.37 (the backward's correction), dW
    within bf16 rounding of the CPU's fp32 gradient on the same values;
    weight.grad stays None; hidden's and bias's gradients match the CPU."""
    g = torch.Generator().manual_seed(4)
    n, h, v = 3000, 64, 5000
    hid = torch.randn(n, h, generator=g).bfloat16()
    w = (torch.randn(v, h, generator=g) * 0.2).bfloat16()
    b = (torch.randn(v, generator=g) * 0.1).bfloat16()
    y = torch.randint(0, v, (n,), generator=g)
    y[::9] = -100
    prefill = torch.randn(v, h, generator=g) * 1e-3
    plan = lt.linear_plan(hid.cuda(), w.cuda(), b.cuda(), memory_budget=budget,
                          main_grad=prefill.cuda())
    assert plan.accumulator_bytes == 0
    assert (plan.group_rows, plan.logits_gemms) == {"store of all rows": (n, 1),
                                                    "store in groups": (1280, 1),
                                                    "vocab tiles": (0, 2)}[schedule]

    def rel(a, ref):
        return ((a.double().cpu() - ref.double()).norm() / ref.double().norm()).item()

    for up in (1.0, 0.37):
        hc, wc, bc = (t.float().requires_grad_() for t in (hid, w, b))
        (up * lt.linear_cross_entropy(hc, wc, y, bias=bc)).backward()
        main_grad = prefill.cuda()
        hg, wg, bg = (t.cuda().requires_grad_() for t in (hid, w, b))
        loss = lt.linear_cross_entropy(hg, wg, y.cuda(), bias=bg, memory_budget=budget,
                                       main_grad=main_grad)
        (loss if up == 1.0 else up * loss).backward()
        assert wg.grad is None and bg.grad.dtype == torch.bfloat16
        assert rel(main_grad.cpu() - prefill, wc.grad) < 1e-2
        assert rel(hg.grad, hc.grad) < 1e-2 and rel(bg.grad, bc.grad) < 1e-2


def test_compile_on_cuda_without_graph_breaks():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    head = torch.nn.Linear(32, 999, bias=False).cuda()

    def step(h, y):
        return lt.linear_cross_entropy(h, head.weight, y) + lt.cross_entropy(head(h), y)

    f = torch.compile(step, fullgraph=True)
    for n in (64, 96):
        h = torch.randn(n, 32, device="cuda", requires_grad=True)
        y = torch.randint(0, 999, (n,), device="cuda")
        torch._dynamo.mark_dynamic(h, 0)
        torch._dynamo.mark_dynamic(y, 0)
        f(h, y).backward()
        close(h.grad, torch.autograd.grad(step(h, y), h)[0], rtol=1e-4, atol=1e-5)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


def test_tiny_llama_fused_head_peak_memory_cuda():
    import copy

    import transformers
    from lmloss.integrations import transformers as ltf
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    base = transformers.LlamaForCausalLM(cfg).cuda()
    patched = ltf.patch_causal_lm(copy.deepcopy(base))
    ids = torch.randint(0, 32000, (8, 512), device="cuda")
    peaks, losses = {}, {}
    for name, m in (("transformers", base), ("lmloss", patched)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() / 2 ** 20
        losses[name] = out.loss.item()
    print("\nCUDA peak MiB (B=8, T=512, V=32000):", peaks)
    assert abs(losses["lmloss"] - losses["transformers"]) < 1e-3 * losses["transformers"]
    assert peaks["lmloss"] < peaks["transformers"]


# ------------------------------------------------------------------ divergences


def div_rows(v):
    """Student and teacher float32 [14, v]: random pairs, a small gap, and
    peaked rows at margins 0 to 1000 with the teacher's peak on the
    student's column and beside it."""
    rng = np.random.default_rng(20)
    parts = [pair(rng, 4, v), pair(rng, 2, v, gap=1e-2)]
    parts += [peaked_pair(rng, 1, v, m, same) for m in (0.0, 17.0, 50.0, 1000.0)
              for same in (True, False)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@pytest.mark.parametrize("v", [1003, 40001])  # one CTA a row; a cluster of three
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,beta", KINDS, ids=IDS)
def test_divergences_on_cuda_against_the_oracle(kind, beta, dtype, v):
    """Per-row losses and both gradient paths (the fused one of a scalar
    loss; lmloss_divergence_backward from per-row upstreams) against the
    float64 oracle, with labels, ignored rows and the hard term."""
    s, t = div_rows(v)
    sg = torch.from_numpy(s).to(dtype).cuda().requires_grad_()
    tg = torch.from_numpy(t).to(dtype).cuda()
    y = torch.from_numpy(np.random.default_rng(21).integers(0, v, 14))
    y[[1, 9]] = -100
    form = "bf16" if dtype == torch.bfloat16 else "f32"
    ref, grad = oracle(sg.detach().cpu(), tg.cpu(), kind, beta, labels=y, hard=0.25)
    fn = {"kl": lambda **k: lt.kl_div(sg, tg, **k),
          "reverse_kl": lambda **k: lt.kl_div(sg, tg, reverse=True, **k),
          "tvd": lambda **k: lt.tvd(sg, tg, **k),
          "jsd": lambda **k: lt.generalized_jsd(sg, tg, beta=beta, **k)}[kind]
    w = torch.rand(14, generator=torch.Generator().manual_seed(0))
    for red, upstream in (("sum", torch.tensor(3.0)), ("none", w)):
        sg.grad = None
        loss = fn(labels=y.cuda(), hard_weight=0.25, reduction=red)
        want_loss = ref.sum() if red == "sum" else ref
        util.check(loss.detach().cpu().numpy(), want_loss.detach().numpy(), what=red)
        (upstream.cuda() * loss).sum().backward()
        want = grad((upstream.double() * want_loss).sum())
        floor = row_floor(want)
        if red == "sum" and form == "bf16":  # the fused path's second rounding (_div_ops)
            floor = floor + np.abs(want) * 2.0 ** -8 / 1e-5
        util.check(sg.grad.float().cpu().numpy(), want, form, floor, "%s grad" % red)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,beta", KINDS, ids=IDS)
def test_identical_rows_give_exactly_zero_on_cuda(kind, beta, dtype):
    s = torch.from_numpy(div_rows(40001)[0]).to(dtype).cuda().requires_grad_()
    fn, _ = TORCH_FNS[kind]
    loss = lt.generalized_jsd(s, s.detach().clone(), beta=beta) if kind == "jsd" else \
        fn(s, s.detach().clone())
    loss.backward()
    assert loss.item() == 0 and (s.grad == 0).all()


def test_divergence_rows_that_cannot_be_computed_on_cuda():
    """A NaN or +inf logit, a side with no finite logit, and (on the device,
    where the library cannot read labels before the kernel) a label outside
    [0, V) give NaN for their row alone; an ignored row gives 0."""
    v = 40001
    s, t = (torch.from_numpy(a).cuda() for a in div_rows(v))
    s[0, 5], t[2, 7], s[3], t[4] = float("nan"), float("inf"), -float("inf"), -float("inf")
    y = torch.full((14,), 3, device="cuda")
    y[5], y[6] = v + 2, -100
    s.requires_grad_()
    rows = lt.kl_div(s, t, labels=y, hard_weight=0.5, reduction="none")
    rows.sum().backward()
    bad = torch.zeros(14, dtype=torch.bool)
    bad[[0, 2, 3, 4, 5]] = True
    assert rows.isnan().cpu().eq(bad).all()
    assert s.grad.isnan().all(-1).cpu().eq(bad).all()
    assert rows[6].item() == 0 and (s.grad[6] == 0).all()
    assert torch.isfinite(s.grad[~bad.cuda()]).all()


def test_divergences_on_cuda_are_bitwise_reproducible_without_host_sync():
    rng = np.random.default_rng(22)
    s, t = (torch.from_numpy(a).cuda() for a in pair(rng, 6, 152064))
    y = torch.from_numpy(rng.integers(0, 152064, 6)).cuda()
    y[2] = -100
    items = torch.tensor(4.0, device="cuda")
    out = []
    torch.cuda.synchronize()
    st = torch.cuda.Stream()
    for _ in range(2):
        x = s.clone().requires_grad_()
        with torch.cuda.stream(st):
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = lt.generalized_jsd(x, t, y, beta=0.3, temperature=2.0,
                                          num_items_in_batch=items, softcap=30.0,
                                          teacher_softcap=30.0, hard_weight=0.1)
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        st.synchronize()
        out.append((loss.detach(), x.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    xc = s.cpu().requires_grad_()
    lc = lt.generalized_jsd(xc, t.cpu(), y.cpu(), beta=0.3, temperature=2.0,
                            num_items_in_batch=4.0, softcap=30.0, teacher_softcap=30.0,
                            hard_weight=0.1)
    lc.backward()
    close(out[0][0], lc)
    close(out[0][1], xc.grad, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_fused_heads_on_cuda(dtype):
    g = torch.Generator().manual_seed(3)
    hs, ht = torch.randn(96, 48, generator=g), torch.randn(96, 40, generator=g)
    ws, wt = torch.randn(3001, 48, generator=g) * 0.3, torch.randn(3001, 40, generator=g) * 0.3
    y = torch.randint(0, 3001, (96,), generator=g)
    y[:7] = -100
    res = []
    for dev, dt in (("cpu", torch.float32), ("cuda", dtype)):
        h = hs.to(dev, dt).detach().requires_grad_()
        w = ws.to(dev, dt).detach().requires_grad_()
        loss = lt.linear_generalized_jsd(h, w, ht.to(dev, dt), wt.to(dev, dt), y.to(dev),
                                         beta=0.4, hard_weight=0.2, memory_budget=1 << 20)
        loss.backward()
        res.append((loss, h.grad, w.grad))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(res[1], res[0]):
        close(a.float(), b, rtol=tol, atol=tol)
    assert res[1][2].dtype == dtype


def _grpo_cases():
    """test_grpo's (loss type, level, option) cases, or none without TRL
    (its module needs TRL: imported here, so this module runs without it)."""
    try:
        import test_grpo
    except pytest.skip.Exception:
        return []
    return test_grpo.PARAMS


def _clamp_passes_its_bounds():
    """Whether this torch's clamp passes the gradient at its bounds: so
    until 2.13, strictly inside them since 2.14 (pytorch#195931), which
    lmloss follows. TRL's gradient at epsilon 0's clip tie follows the
    installed torch."""
    x = torch.ones((), dtype=torch.float64, requires_grad=True)
    torch.clamp(x, 1.0, 1.0).backward()
    return x.grad.item() != 0.0


@pytest.mark.parametrize("loss_type,level,option", _grpo_cases())
def test_grpo_on_cuda_matches_trl_without_host_sync(loss_type, level, option):
    """lmloss.torch.grpo_loss on CUDA tensors: TRL's loss, gradients and
    metrics (TRL in fp64 on the CPU, as test_grpo's CPU runs), a forward and
    backward that never synchronize the host (entropy quantile and divisor
    on the device), and the same bits when run again."""
    import test_grpo as G

    cfg, given = G.OPTIONS[option]
    cfg = dict(cfg, loss_type=loss_type, importance_sampling_level=level)
    c = G.case(b=6, t=37, seed=3000 + G.PARAMS.index((loss_type, level, option)),
               adv_tokens="adv_tokens" in given)
    kw = G.torch_args(c, cfg, given, device="cuda")
    runs = []
    for _ in range(2):
        logp = torch.tensor(c["logp"], device="cuda", requires_grad=True)
        ent = kw["entropies"].detach().clone().requires_grad_()
        adv, mask = torch.tensor(c["adv"], device="cuda"), torch.tensor(c["mask"], device="cuda")
        args = dict(kw, entropies=ent)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss, metrics = lt.grpo_loss(logp, adv, mask, return_metrics=True, **args)
                (2.5 * loss).backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        s.synchronize()
        runs.append((loss.item(), logp.grad.cpu().numpy(), ent.grad.cpu().numpy(),
                     metrics.detach().cpu().numpy()))
    loss64, dl64, de64, trl_metrics = G.trl(c, cfg, given, torch.float64)
    if option == "on_policy_epsilon_0" and _clamp_passes_its_bounds():
        # an older torch's tie rule: the CPU backend's, which CI holds to TRL on a current one
        _, dl64, de64, _ = G.torch_run(c, cfg, given)
    loss, dl, de, m = runs[0]
    G.assert_close(loss, loss64, "loss")
    G.assert_close(dl / 2.5, dl64, "dlogp")
    G.assert_close(de / 2.5, de64, "dentropy")
    ours = lmloss._grpo.trl_metrics(dict(zip(lmloss._grpo.METRIC_NAMES, m.tolist())), loss_type,
                                    cfg.get("beta", 0.0))
    for k, v in trl_metrics.items():
        if k in ours:
            G.assert_close(ours[k], v, "metric " + k)
    assert runs[1][0] == loss
    for a, b in zip(runs[1][1:], runs[0][1:]):
        assert np.array_equal(a, b, equal_nan=True)


def test_grpo_on_cuda_long_sequences_against_the_cpu():
    """Sequences longer than a CTA's threads (several tokens a thread) and a
    batch wider than the finishing CTA: CUDA against the CPU backend."""
    pytest.importorskip("trl")
    import test_grpo as G

    c = G.case(b=300, t=1500, seed=4)
    for loss_type in G.LOSS_TYPES:
        for level in ("token", "sequence"):
            cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                       entropy_coef=0.01, top_entropy_quantile=0.8,
                       off_policy_mask_threshold=0.01)
            given = ("ref", "sampling", "is_token")
            out = []
            for dev in ("cpu", "cuda"):
                kw = G.torch_args(c, cfg, given, device=dev)
                logp = torch.tensor(c["logp"], device=dev, requires_grad=True)
                ent = kw["entropies"].requires_grad_()
                loss, metrics = lt.grpo_loss(logp, torch.tensor(c["adv"], device=dev),
                                             torch.tensor(c["mask"], device=dev),
                                             return_metrics=True, **kw)
                loss.backward()
                out.append((loss, logp.grad, ent.grad, metrics))
            for a, b in zip(out[1], out[0]):  # metrics undefined for a type are NaN on both
                torch.testing.assert_close(a.detach().cpu().double(), b.detach().cpu().double(),
                                           rtol=1e-6, atol=1e-9, equal_nan=True)


def _dpo_cases():
    """test_dpo's configurations, or none without TRL."""
    try:
        import test_dpo
    except pytest.skip.Exception:
        return []
    return [(n, c) for n, c in test_dpo.CONFIGS if "alpha_divergence" not in n]


@pytest.mark.parametrize("name,cfg", _dpo_cases(), ids=[n for n, _ in _dpo_cases()])
def test_dpo_on_cuda_matches_trl_without_host_sync(name, cfg):
    """lmloss.torch.dpo_loss on CUDA tensors (P = 40 pairs, every loss type):
    TRL's loss and gradient (TRL in fp64 on the CPU), a forward and backward
    that never synchronize the host, the CPU backend's metrics."""
    import test_dpo as D

    c = D.case(p=40, t=9, seed=7)
    p, m = c["p"], c["mask"]
    sums = torch.tensor(c["logp"].astype(np.float64).sum(1).astype(np.float32))
    tokens = torch.tensor(m.sum(1).astype(np.float32))
    ref = torch.tensor(c["ref"])
    w = torch.tensor(D.wpo_weight(c)) if cfg.get("use_weighting") else None
    kw = D.dpo_kwargs(cfg)
    out = {}
    for dev in ("cpu", "cuda"):
        s = sums.detach().to(dev).requires_grad_()
        args = [t.to(dev) for t in (ref[:p], ref[p:], tokens[:p], tokens[p:])]
        wd = None if w is None else w.to(dev)
        torch.cuda.synchronize()
        if dev == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss, metrics = lt.dpo_loss(s[:p], s[p:], args[0], args[1], chosen_tokens=args[2],
                                        rejected_tokens=args[3], weight=wd, return_metrics=True,
                                        **kw)
            (2.0 * loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out[dev] = (loss, s.grad / 2.0, metrics)
    loss64, d64, _ = D.trl(c, cfg)
    D.assert_close(out["cuda"][0].item(), loss64, "loss", D.trl_rtol(cfg))
    D.assert_close(out["cuda"][1].cpu().numpy()[:, None] * m[:, 1:], d64, "d logp", D.trl_rtol(cfg))
    close(out["cuda"][2], out["cpu"][2], rtol=1e-6, atol=1e-6)


def test_kto_on_cuda_matches_cpu_without_host_sync():
    """lmloss.torch.kto_loss on CUDA tensors: the CPU backend's loss,
    gradient and metrics, with no host sync in the forward and backward."""
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(300, generator=g) * 4 - 20
    ref = lp + torch.randn(300, generator=g)
    label = torch.rand(300, generator=g) < 0.4
    out = {}
    for dev in ("cpu", "cuda"):
        x = lp.detach().to(dev).requires_grad_()
        args = (ref.to(dev), label.to(dev), torch.tensor(0.3, device=dev))
        torch.cuda.synchronize()
        if dev == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss, metrics = lt.kto_loss(x, *args, beta=0.2, desirable_weight=1.3,
                                        return_metrics=True)
            (1.5 * loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out[dev] = (loss, x.grad, metrics)
    for a, b in zip(out["cuda"], out["cpu"]):
        close(a, b, rtol=1e-6, atol=1e-9)
