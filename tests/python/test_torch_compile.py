"""torch.compile(fullgraph=True) of a training step through every lmloss op:
zero graph breaks (torch._dynamo.utils.counters), and a second batch size
under mark_dynamic traces no new graph. backend="aot_eager" runs the fake
impls and the registered autograd through AOTAutograd (what inductor sees)
in seconds; one step also runs under the default inductor backend."""

import pytest

torch = pytest.importorskip("torch")

import lmloss  # noqa: E402
import lmloss.torch as lt  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

V, H = 50, 16


def make():
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)

    def step(ids, labels):
        h = emb(ids)
        logits = head(h)
        loss = lt.linear_cross_entropy(h, head.weight, labels, label_smoothing=0.1)
        loss = loss + 0.5 * lt.cross_entropy(logits, labels, z_loss=1e-4)
        lp, ent = lt.log_probs(logits, labels.clamp(min=0), entropy=True)
        loss = loss - 0.1 * lp.mean() + 0.01 * ent.mean() + 0.01 * lt.entropy(logits).mean()
        loss = loss + lt.log_softmax(logits)[..., 0].mean() + lt.softmax(logits)[..., 1].mean()
        return loss + lt.linear_log_probs(h, head.weight, labels.clamp(min=0)).mean()

    return step, [emb.weight, head.weight]


def batch(b, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, 7), generator=g)
    labels = torch.randint(0, V, (b, 7), generator=g)
    labels[0, :2] = -100
    return ids, labels


def grads(fn, params, ids, labels):
    loss = fn(ids, labels)
    gs = torch.autograd.grad(loss, params)
    return loss, gs


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_training_step_compiles_without_graph_breaks_or_recompiles(backend):
    step, params = make()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for b, seed in ((4, 1), (6, 2)) if backend == "aot_eager" else ((4, 1),):
        ids, labels = batch(b, seed)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(labels, 0)
        loss, gs = grads(compiled, params, ids, labels)
        ref_loss, ref_gs = grads(step, params, ids, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for g, r in zip(gs, ref_gs):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1  # the second batch size reused the graph
    ids, labels = batch(4, 3)
    assert torch._dynamo.explain(step)(ids, labels).graph_break_count == 0


def test_inplace_backward_is_functional_when_compiled():
    """A compiled graph forms the CE gradient in the forward into a new
    tensor and multiplies it by the upstream: inplace_backward leaves the
    logits alone there."""
    torch.manual_seed(0)
    x, y = torch.randn(6, V), torch.randint(0, V, (6,))
    fn = torch.compile(lambda a, b: 0.37 * lt.cross_entropy(a, b, inplace_backward=True),
                       fullgraph=True, backend="aot_eager")
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    fn(xg, y).backward()
    (0.37 * lt.cross_entropy(xr, y)).backward()
    assert torch.equal(xg.detach(), x)
    torch.testing.assert_close(xg.grad, xr.grad)


def test_main_grad_is_refused_when_compiled():
    """main_grad is eager only (a traced op may not write its inputs): a
    compiled call raises (fullgraph: as dynamo's Unsupported) rather than
    dropping the weight's gradient."""
    h, w, y = torch.randn(6, H), torch.randn(V, H, requires_grad=True), torch.randint(0, V, (6,))
    main_grad = torch.zeros(V, H)
    for fullgraph in (False, True):
        fn = torch.compile(lambda a, b: lt.linear_cross_entropy(a, b, y, main_grad=main_grad),
                           fullgraph=fullgraph, backend="aot_eager")
        with pytest.raises((lmloss.Error, torch._dynamo.exc.Unsupported),
                           match="main_grad is eager only"):
            fn(h, w)
    assert not main_grad.any()
