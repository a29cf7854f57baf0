"""The drop-ins: transformers (LOSS_MAPPING and the fused-head patch on a tiny
random Llama / Gemma2 built here, no download) and TRL (selective_log_softmax,
entropy_from_logits, the fused head behind add_fused_lm_head). Each result
is compared with the same step without the drop-in. TRL is optional: its
functions are patched in a stand-in module holding TRL's reference forms,
and in trl.trainer.utils too when TRL is installed. Peak CPU memory of a
training step is measured with torch's profiler (profile_memory) and
printed (pytest -s) with and without the fused-head patch."""

import copy
import types

import pytest

torch = pytest.importorskip("torch")

import transformers  # noqa: E402

import lmloss  # noqa: E402
from lmloss.integrations import transformers as ltf  # noqa: E402
from lmloss.integrations import trl as ltrl  # noqa: E402

try:
    import trl.trainer.utils as trl_utils
except ImportError:  # TRL is optional; the stand-in below still runs every check
    trl_utils = None


def tiny_llama(vocab=2048, tie=True):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def batch(vocab, b=4, t=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return ids, labels


def peak_mib(fn):
    """Peak of the CPU bytes torch allocates while fn() runs (profiler events)."""
    with torch.autograd.profiler.profile(profile_memory=True) as prof:
        fn()
    cur = top = 0
    for e in sorted(prof.function_events, key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        top = max(top, cur)
    return top / 2 ** 20


def train(model, steps, vocab, num_items=False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for s in range(steps):
        ids, labels = batch(vocab, seed=s)
        kw = {"num_items_in_batch": (labels[:, 1:] != -100).sum()} if num_items else {}
        out = model(input_ids=ids, labels=labels, **kw)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return losses, out


def test_loss_mapping_enable_disable():
    from transformers.loss.loss_utils import LOSS_MAPPING
    original = LOSS_MAPPING["ForCausalLM"]
    model = tiny_llama(vocab=512)
    ids, labels = batch(512)
    want = model(input_ids=ids, labels=labels).loss
    ltf.enable()
    try:
        assert LOSS_MAPPING["ForCausalLM"] is ltf.for_causal_lm_loss
        got = model(input_ids=ids, labels=labels).loss
        n = torch.tensor(100)
        logits = torch.randn(2, 6, 512)
        lab = torch.randint(0, 512, (2, 6))
        torch.testing.assert_close(ltf.for_causal_lm_loss(logits, lab, 512, n),
                                   original(logits, lab, 512, n), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ltf.for_causal_lm_loss(logits, None, 512, shift_labels=lab),
                                   original(logits, None, 512, shift_labels=lab))
    finally:
        ltf.disable()
    assert LOSS_MAPPING["ForCausalLM"] is original
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_items", [False, True])
def test_tiny_llama_trains_the_same_with_the_fused_head(num_items):
    vocab = 8192
    base = tiny_llama(vocab)
    patched = ltf.patch_causal_lm(copy.deepcopy(base))
    want, _ = train(base, 3, vocab, num_items)
    got, out = train(patched, 3, vocab, num_items)
    assert out.logits is None  # training mode: no logits built
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)
    ids, labels = batch(vocab, seed=9)

    def step(model):
        return lambda: model(input_ids=ids, labels=labels).loss.backward()

    mem = {name: peak_mib(step(m)) for name, m in (("transformers", base),
                                                    ("lmloss fused head", patched))}
    print("\npeak CPU MiB of one step (B=4, T=64, V=%d, H=64):" % vocab, mem)
    assert mem["lmloss fused head"] < mem["transformers"]
    patched.eval()
    with torch.no_grad():
        assert patched(input_ids=ids, labels=labels).logits.shape == (4, 64, vocab)
    ltf.unpatch(patched)
    assert "forward" not in patched.__dict__


def test_patch_respects_softcap_tied_weights_and_logits_to_keep():
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16,
                                    final_logit_softcapping=5.0, tie_word_embeddings=True)
    base = transformers.Gemma2ForCausalLM(cfg)
    patched = ltf.patch_causal_lm(copy.deepcopy(base))
    ids, labels = batch(300, t=16)
    for model in (base, patched):
        model(input_ids=ids, labels=labels).loss.backward()
    torch.testing.assert_close(patched(input_ids=ids, labels=labels).loss,
                               base(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
    e0, e1 = (m.get_input_embeddings().weight.grad for m in (base, patched))
    torch.testing.assert_close(e1, e0, rtol=1e-4, atol=1e-6)  # tied: head + embedding grads
    k = 5
    got = patched(input_ids=ids, labels=labels, logits_to_keep=k).loss
    logits = base(input_ids=ids).logits[:, -k:]
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:][:, -k:]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), shift.reshape(-1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_patch_adds_the_head_gradient_to_main_grad():
    """A head weight with a main_grad attribute (Megatron- and NeMo-style
    training) gets its gradient added there, not in .grad; every other
    gradient, and the loss, are the unpatched model's."""
    base = tiny_llama(vocab=512, tie=False)
    patched = ltf.patch_causal_lm(copy.deepcopy(base))
    head = patched.get_output_embeddings().weight
    prefill = torch.randn(head.shape)
    head.main_grad = prefill.clone()
    ids, labels = batch(512)
    losses = [m(input_ids=ids, labels=labels).loss for m in (base, patched)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert head.grad is None
    want = base.get_output_embeddings().weight.grad
    torch.testing.assert_close(head.main_grad - prefill, want, rtol=1e-4, atol=1e-6)
    for (name, p0), p1 in zip(base.named_parameters(), patched.parameters()):
        if p1 is not head:
            torch.testing.assert_close(p1.grad, p0.grad, rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------ TRL

def trl_reference_module():
    """A stand-in for trl.trainer.utils: TRL's reference forms of the functions."""
    def selective_log_softmax(logits, index, temperature=1.0, row_mask=None):
        logits = logits / temperature
        squeeze = index.ndim == logits.ndim - 1
        idx = index.unsqueeze(-1) if squeeze else index
        out = torch.gather(logits.log_softmax(-1), -1, idx)
        out = out.squeeze(-1) if squeeze else out
        return out if row_mask is None else out.masked_fill(row_mask == 0, 0.0)

    def entropy_from_logits(logits, chunk_size=128):
        lp = torch.log_softmax(logits, -1)
        return -(lp.exp() * lp).sum(-1)

    return types.SimpleNamespace(__name__="trl_standin", selective_log_softmax=selective_log_softmax,
                                 entropy_from_logits=entropy_from_logits)


TARGETS = [trl_reference_module()] + ([trl_utils] if trl_utils else [])


def grpo_loss(mod, logits, completion_ids, mask, old_logps, advantages, eps=0.2):
    """GRPO's clipped objective as TRL writes it, through mod.selective_log_softmax."""
    logps = mod.selective_log_softmax(logits, completion_ids)
    ratio = torch.exp(logps - old_logps)
    per_token = -torch.min(ratio * advantages[:, None],
                           torch.clamp(ratio, 1 - eps, 1 + eps) * advantages[:, None])
    ent = mod.entropy_from_logits(logits.detach())
    return (per_token * mask).sum() / mask.sum(), ent


@pytest.mark.parametrize("mod", TARGETS, ids=lambda m: m.__name__)
def test_grpo_step_same_with_and_without_the_drop_in(mod):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 10, 301, generator=g) * 4).requires_grad_()
    ids = torch.randint(0, 301, (3, 10), generator=g)
    mask = (torch.rand(3, 10, generator=g) > 0.2).float()
    old = mod.selective_log_softmax(logits.detach(), ids) + 0.1 * torch.randn(3, 10, generator=g)
    adv = torch.randn(3, generator=g)
    results = []
    for patch in (False, True):
        if patch:
            ltrl.enable(mod)
            assert mod.selective_log_softmax is ltrl.selective_log_softmax
        try:
            loss, ent = grpo_loss(mod, logits, ids, mask, old, adv)
            (grad,) = torch.autograd.grad(loss, logits)
        finally:
            ltrl.disable(mod)
        results.append((loss, ent, grad))
    assert mod.selective_log_softmax is not ltrl.selective_log_softmax
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_trl_functions_match_reference_forms_and_packed_call_is_one_call(monkeypatch):
    ref = trl_reference_module()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 97, generator=g) * 3
    idx = torch.randint(0, 97, (2, 5, 4), generator=g)
    row_mask = torch.rand(2, 5, 4, generator=g) > 0.3
    for args in ((logits, idx[..., 0]), (logits, idx), (logits, idx, 0.7, row_mask),
                 (logits.bfloat16(), idx[..., 0])):
        got, want = ltrl.selective_log_softmax(*args), ref.selective_log_softmax(*args)
        assert got.dtype == want.dtype
        tol = 1e-2 if got.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(ltrl.entropy_from_logits(logits, chunk_size=3),
                               ref.entropy_from_logits(logits), rtol=1e-5, atol=1e-6)
    calls = []
    real = lmloss._lib.log_probs
    monkeypatch.setattr(lmloss._lib, "log_probs", lambda *a: calls.append(1) or real(*a))
    packed = torch.randn(1000, 97, generator=g)  # padding-free GRPO: logits [total_nnz, V]
    ltrl.selective_log_softmax(packed, torch.randint(0, 97, (1000,), generator=g))
    assert len(calls) == 1


def test_fused_head_kernel_matches_logits_forms():
    g = torch.Generator().manual_seed(4)
    hs = torch.randn(20, 16, generator=g).requires_grad_()
    w = (torch.randn(101, 16, generator=g) * 0.3).requires_grad_()
    y = torch.randint(0, 101, (20,), generator=g)
    logits = 2.0 * torch.tanh(0.9 * (hs @ w.T) / 2.0) / 1.1
    lp = torch.log_softmax(logits, -1)
    want = (lp.gather(1, y[:, None])[:, 0], -(lp.exp() * lp).sum(-1), logits.argmax(-1) == y)
    for outputs in (("log_probs", "entropy"), ("log_probs", "entropy", "is_top1")):
        got = ltrl.ChunkedLogProbFunction.apply(hs, w, None, y, 1.1, 4096, 2.0, 0.9, outputs)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        if "is_top1" in outputs:
            assert torch.equal(got[4], want[2])
        gh, gw = torch.autograd.grad(got[0].sum(), (hs, w))
        rh, rw = torch.autograd.grad(want[0].sum(), (hs, w), retain_graph=True)
        torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-5)


def test_fused_head_kernel_mean_logits():
    """mean_logits by linearity (hidden times W's column means): against
    the logits' own mean in float64, and against TRL's kernel (its torch
    form on the CPU) on the same inputs."""
    g = torch.Generator().manual_seed(7)
    hs = torch.randn(30, 16, generator=g)
    w = torch.randn(103, 16, generator=g) * 0.3
    b = torch.randn(103, generator=g)
    y = torch.randint(0, 103, (30,), generator=g)
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    got = ltrl.ChunkedLogProbFunction.apply(hs, w, b, y, 0.7, 4096, None, 1.3, outputs)
    want = ((hs.double() @ w.double().T + b.double()) * 1.3 / 0.7).mean(-1)
    assert got[3].dtype == torch.float32 and got[2] is None
    torch.testing.assert_close(got[3].double(), want, rtol=1e-5, atol=1e-6)
    if trl_utils is not None:
        trl_out = trl_utils._ChunkedLogProbFunction.apply(hs, w, b, y, 0.7, 4096, None, 1.3, outputs)
        torch.testing.assert_close(got[3], trl_out[3], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0], trl_out[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[4], trl_out[4])


@pytest.mark.parametrize("softcap", [None, 0.0, 3.0])
def test_fused_head_kernel_wpo_and_softcap_mean(softcap):
    """WPO's log_sum_sq_probs and the mean logits under a softcap (from the
    logits, a block of rows at a time; a softcap of 0 is off, as lmloss's
    own head takes it): against float64 on rows whose
    column 5 leads by about 20 after the scale and temperature (log sum p^2
    about -1e-7 there, which a difference of fp32 logs of sums near 1 keeps
    to a bit or two), with blocks of a few rows; against TRL's kernel on
    the same inputs."""
    g = torch.Generator().manual_seed(8)
    hs = torch.randn(30, 16, generator=g)
    w = torch.randn(103, 16, generator=g) * 0.3
    b = torch.randn(103, generator=g)
    b[5] += 11.0
    y = torch.randint(0, 103, (30,), generator=g)
    z = (hs.double() @ w.double().T + b.double()) * 1.3
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / 0.7
    lsq = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
    for outputs in (("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
                    ("log_probs", "log_sum_sq_probs")):
        got = ltrl.ChunkedLogProbFunction.apply(hs, w, b, y, 0.7, 4096, softcap, 1.3, outputs)
        torch.testing.assert_close(got[2].double(), lsq, rtol=1e-5, atol=1e-9)
        if "mean_logits" in outputs:
            torch.testing.assert_close(got[3].double(), z.mean(-1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[0].double(), z.log_softmax(-1).gather(1, y[:, None])[:, 0],
                                   rtol=1e-5, atol=1e-6)
    if not softcap:
        assert ((lsq > -1e-3) & (lsq < -1e-8)).all()  # the confident rows this test is about
    sq, _ = ltrl._logit_sums(hs, w, b, 1.3, softcap or None, 0.7, True, False,
                             block_bytes=4 * 103 * 7)
    torch.testing.assert_close(sq.double(), lsq, rtol=1e-5, atol=1e-9)
    if trl_utils is not None and softcap != 0.0:  # TRL's kernel divides by a softcap of 0
        trl_out = trl_utils._ChunkedLogProbFunction.apply(hs, w, b, y, 0.7, 4096, softcap, 1.3,
                                                          outputs)
        torch.testing.assert_close(got[2], trl_out[2], rtol=1e-3, atol=1e-6)


def sft_step(model, fused):
    ids, labels = batch(1024, b=2, t=32, seed=5)
    if fused:  # TRL's SFTTrainer.compute_loss through add_fused_lm_head
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        extra = tuple(x for x in (out.log_probs, out.entropy, out.is_top1, out.mean_logits,
                                  getattr(out, "log_sum_sq_probs", None)) if x is not None)
    else:  # the transformers path: outputs.loss
        out = model(input_ids=ids, labels=labels)
        extra = ()
    out.loss.backward()
    return (out.loss,) + extra + tuple(p.grad for p in model.parameters() if p.grad is not None)


def test_sft_step_same_with_and_without_the_drop_ins():
    base = tiny_llama(1024)
    ours = ltf.patch_causal_lm(copy.deepcopy(base))
    for a, b in zip(sft_step(base, False), sft_step(ours, False)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if trl_utils is None:
        return  # no TRL: the fused_lm_head path below needs add_fused_lm_head
    # SFTTrainer's outputs, DPOTrainer's (their mean logits too; with WPO's
    # use_weighting the sum of squared probabilities), KTOTrainer's
    compared = []
    for outputs in (("log_probs", "entropy", "is_top1"),
                    ("log_probs", "entropy", "mean_logits", "is_top1"),
                    ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"),
                    ("log_probs", "entropy", "mean_logits")):
        m0, m1 = copy.deepcopy(base), copy.deepcopy(base)
        for m in (m0, m1):
            m.zero_grad()
            trl_utils.add_fused_lm_head(m, outputs=outputs)
        want = sft_step(m0, True)
        ltrl.enable()
        try:
            assert trl_utils._ChunkedLogProbFunction is ltrl.ChunkedLogProbFunction
            got = sft_step(m1, True)
        finally:
            ltrl.disable()
        assert trl_utils._ChunkedLogProbFunction is not ltrl.ChunkedLogProbFunction
        assert len(got) == len(want)
        compared.append(len(got))
        for a, b in zip(got, want):
            if a.dtype == torch.bool:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    n = compared[0]
    assert compared == [n, n + 1, n + 2, n]  # mean logits, WPO's sums, no top-1
