"""lmloss.torch on CUDA tensors (marker `cuda`). These tests are skipped when
torch.cuda.is_available() is False, or when the loaded library has no CUDA
backend; that is the only skip of the torch suite. Results are compared with
the CPU backend on the same values; calls run on a side stream and under
torch.cuda.set_sync_debug_mode("error") (torch raises on any synchronizing
torch op inside the forward and backward; the fused head's one count read
is the C library's own)."""

import pytest

torch = pytest.importorskip("torch")

import lmloss  # noqa: E402
import lmloss.torch as lt  # noqa: E402

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
    plain cross-entropy's backward takes the held plan."""
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
