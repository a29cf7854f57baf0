"""Vocab-parallel losses on CPU ranks (torch.distributed, gloo): every
family over a vocabulary split into 2, 3 and 4 shards, even and uneven,
against the single-process call on the whole rows, on peaked rows whose
argmax sits on each rank in turn, ties at the max across ranks, a shard
holding only -inf and ignored rows; GRPO's objective on the log-probs and
entropies they give; the divergences (KL both ways, generalized JSD, TVD)
with a teacher sharded alike; and the fused head (and the divergences'
two heads) with its weight's rows split over the ranks."""

import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import lmloss  # noqa: E402
import lmloss.torch as LT  # noqa: E402

N, H = 24, 16
MARGINS = (0.0, 5.0, 17.0, 30.0, 50.0, 1000.0)


def _bounds(V, world, uneven):
    """Each rank's [start, end): Megatron's even split, or uneven widths."""
    if not uneven:
        w = V // world
        return [(r * w, (r + 1) * w) for r in range(world)]
    cuts = [0] + [V * (2 * r + 1) // (2 * world) + r for r in range(1, world)] + [V]
    return list(zip(cuts[:-1], cuts[1:]))


def _rows(V, bounds, seed):
    """Logits [N, V] and labels: row i peaked by MARGINS[i % 6] at its label,
    which lies on rank i % world; row 1 ties its max on two ranks, row 2's
    last shard holds only -inf, rows 3 and 7 are ignored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * 2
    world = len(bounds)
    y = torch.empty(N, dtype=torch.int64)
    for i in range(N):
        s, e = bounds[i % world]
        y[i] = s + int(torch.randint(e - s, (1,), generator=g))
        x[i, y[i]] = x[i].max() + MARGINS[i % len(MARGINS)]
    x[1, bounds[0][0]] = x[1, bounds[-1][0]] = x[1].max() + 3.0
    x[2, bounds[-1][0]:bounds[-1][1]] = float("-inf")
    y[2] = bounds[0][0]
    y[3] = y[7] = -100
    return x, y


def _shard_kw(start, V, uneven):
    """The sharding keywords of a rank whose columns start at start: the
    world group, and with uneven shards where they lie."""
    kw = dict(process_group=dist.group.WORLD)
    if uneven:
        kw.update(vocab_start=start, vocab_size=V)
    return kw


def _close(got, ref, what, rtol=2e-5, atol=1e-6):
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, equal_nan=True, msg=what)


def _grad_of(fn, x):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    loss = out if out.dim() == 0 else (out * torch.linspace(0.5, 1.5, out.numel())
                                       .reshape(out.shape)).sum()
    loss.backward()
    return out.detach(), x.grad


def _check_rank(world, rank, uneven, V):
    bounds = _bounds(V, world, uneven)
    s, e = bounds[rank]
    shard = _shard_kw(s, V, uneven)
    x, y = _rows(V, bounds, seed=world * 10 + uneven)
    xs = x[:, s:e]
    cw = torch.rand(V, generator=torch.Generator().manual_seed(5)) + 0.5
    tw = torch.rand(N, generator=torch.Generator().manual_seed(6)) + 0.5
    ce_cases = [
        dict(),
        dict(reduction="sum", label_smoothing=0.1, class_weight=cw),
        dict(reduction="none", z_loss=1e-3, token_weight=tw),
        dict(softcap=20.0, temperature=0.7, logit_scale=1.3, return_entropy=True,
             return_lse=True, return_argmax=True),
    ]
    for case in ce_cases:
        ref = LT.cross_entropy(x, y, **case)
        got = LT.cross_entropy(xs, y, **shard, **case)
        if isinstance(ref, tuple):
            for a, b, name in zip(got[2:], ref[2:], ("lse", "entropy", "argmax")):
                _close(a, b, "CE %s %s" % (name, case))
            got, ref = got.loss, ref.loss
        _close(got, ref, "CE loss %s" % case)
        fn_ref = lambda t: LT.cross_entropy(t, y, **{k: v for k, v in case.items()
                                                     if not k.startswith("return")})
        fn_got = lambda t: LT.cross_entropy(t, y, **shard,
                                            **{k: v for k, v in case.items()
                                               if not k.startswith("return")})
        _, gref = _grad_of(fn_ref, x)
        _, ggot = _grad_of(fn_got, xs)
        _close(ggot, gref[:, s:e], "CE grad %s" % case)
    with pytest.raises(lmloss.Error, match="one index a row"):
        LT.log_probs(xs, torch.zeros(N, 2, dtype=torch.int64), **shard)
    with pytest.raises(lmloss.Error, match="go together"):
        LT.cross_entropy(xs, y, process_group=dist.group.WORLD, vocab_start=s)
    idx = y.clamp(min=0)
    for ent in (False, True):
        ref = LT.log_probs(x, idx, entropy=ent, temperature=0.9)
        got = LT.log_probs(xs, idx, entropy=ent, temperature=0.9, **shard)
        for a, b in zip(got if ent else (got,), ref if ent else (ref,)):
            _close(a, b, "log_probs entropy=%s" % ent)
        pick = (lambda o: o[0] + o[1]) if ent else (lambda o: o)
        _, gref = _grad_of(lambda t: pick(LT.log_probs(t, idx, entropy=ent, temperature=0.9)), x)
        _, ggot = _grad_of(lambda t: pick(LT.log_probs(t, idx, entropy=ent, temperature=0.9,
                                                        **shard)), xs)
        _close(ggot, gref[:, s:e], "log_probs grad entropy=%s" % ent)
    ref, gref = _grad_of(lambda t: LT.entropy(t), x)
    got, ggot = _grad_of(lambda t: LT.entropy(t, **shard), xs)
    _close(got, ref, "entropy")
    _close(ggot, gref[:, s:e], "entropy grad")
    for log in (False, True):
        fn = LT.log_softmax if log else LT.softmax
        xf = torch.where(torch.isinf(x), torch.zeros_like(x), x)  # finite gradients
        ref, gref = _grad_of(lambda t: (fn(t) * xf).sum(), x)
        got, ggot = _grad_of(lambda t: (fn(t, **shard) * xf[:, s:e]).sum(), xs)
        dist.all_reduce(got)
        _close(got, ref, "softmax log=%s" % log, rtol=1e-4)
        # confident rows' gradients are tiny: held entry by entry, the
        # argmax's too (dy_a - sum_j y_j dy_j would cancel there)
        _close(ggot, gref[:, s:e], "softmax grad log=%s" % log, rtol=1e-4, atol=1e-30)


def _check_grpo(world, rank, uneven, V):
    """GRPO's loss on the policy's log-probs and entropies over the shards:
    every rank forms the same [B, T] of them, so the objective, its
    entropy bonus and the KL to a reference run as in one process, and the
    gradient reaches each rank's columns."""
    bounds = _bounds(V, world, uneven)
    s, e = bounds[rank]
    shard = _shard_kw(s, V, uneven)
    x, y = _rows(V, bounds, seed=world * 10 + uneven + 3)
    x[2] = torch.randn(V, generator=torch.Generator().manual_seed(7))  # no -inf shard here
    idx = y.clamp(min=0)
    g = torch.Generator().manual_seed(8)
    adv = torch.randn(4, generator=g)
    mask = (torch.rand(4, N // 4, generator=g) > 0.2).float()
    old = -torch.rand(4, N // 4, generator=g) * 3
    ref_lp = -torch.rand(4, N // 4, generator=g) * 3
    for kw in (dict(loss_type="grpo", beta=0.04, entropy_coef=0.01),
               dict(loss_type="dapo", importance_sampling_level="sequence", epsilon_high=0.28)):
        def loss(t, **sh):
            lp, ent = LT.log_probs(t, idx, entropy=True, **sh)
            return LT.grpo_loss(lp.view(4, -1), adv, mask, old, ref_lp, ent.view(4, -1), **kw)
        ref, gref = _grad_of(loss, x)
        got, ggot = _grad_of(lambda t: loss(t, **shard), x[:, s:e])
        _close(got, ref, "grpo %s" % kw)
        _close(ggot, gref[:, s:e], "grpo grad %s" % kw, atol=1e-8)


def _check_divergence(world, rank, uneven, V):
    """kl_div, generalized_jsd and tvd of the rank's columns of both models:
    the loss on every rank (the same bits), the student's gradient over its
    columns; rows 0 and 5 have student == teacher (exactly 0 there), row 4
    a small gap, row 2's last shard only -inf in both."""
    bounds = _bounds(V, world, uneven)
    s, e = bounds[rank]
    shard = _shard_kw(s, V, uneven)
    x, y = _rows(V, bounds, seed=world * 10 + uneven + 5)
    t, _ = _rows(V, bounds[::-1], seed=world * 10 + uneven + 6)  # peaked elsewhere
    t[2] = x[2]
    t[2, : bounds[-1][0]] += torch.randn(bounds[-1][0], generator=torch.Generator().manual_seed(9))
    t[0], t[5] = x[0], x[5]
    t[4] = x[4] + 1e-2 * torch.randn(V, generator=torch.Generator().manual_seed(10))
    cases = [
        (LT.kl_div, dict()),
        (LT.kl_div, dict(reverse=True, reduction="none", temperature=0.8,
                         teacher_temperature=1.2)),
        (LT.generalized_jsd, dict(beta=0.5, reduction="sum")),
        (LT.generalized_jsd, dict(beta=0.3, reduction="mean", softcap=20.0, hard_weight=0.5)),
        (LT.generalized_jsd, dict(beta=0.0, temperature=2.0, num_items_in_batch=7)),
        (LT.generalized_jsd, dict(beta=1.0, reduction="none")),
        (LT.tvd, dict(reduction="none")),
        (LT.tvd, dict(hard_weight=1.0, temperature=0.9)),
    ]
    for fn, kw in cases:
        what = "%s %s" % (fn.__name__, kw)
        ref, gref = _grad_of(lambda z: fn(z, t, y, **kw), x)
        got, ggot = _grad_of(lambda z: fn(z, t[:, s:e], y, **kw, **shard), x[:, s:e])
        _close(got, ref, what)
        _close(ggot, gref[:, s:e], what + " grad", atol=1e-7)
        every = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(every, got)
        assert all(torch.equal(a, every[0]) for a in every), what + ": ranks differ"
        rows = fn(x[:, s:e], t[:, s:e], y, **dict(kw, reduction="none", num_items_in_batch=None),
                  **shard)
        same_t = kw.get("teacher_temperature", kw.get("temperature")) == kw.get("temperature")
        if same_t and not kw.get("hard_weight"):  # the loss is the divergence alone
            assert rows[0] == 0 and rows[5] == 0, what + ": identical rows"
            assert not ggot[0].any() and not ggot[5].any(), what + ": identical rows' grad"
        assert not (rows < 0).any(), what + ": negative"
    # bf16 rows, computed in fp32 as the one-shot call: gradients to one bf16 rounding
    xb, tb = x.bfloat16(), t.bfloat16()
    ref, gref = _grad_of(lambda z: LT.generalized_jsd(z, tb, y, beta=0.3), xb)
    got, ggot = _grad_of(lambda z: LT.generalized_jsd(z, tb[:, s:e], y, beta=0.3, **shard),
                         xb[:, s:e])
    _close(got, ref, "bf16 jsd")
    _close(ggot.float(), gref[:, s:e].float(), "bf16 jsd grad", rtol=2 ** -8, atol=1e-30)


def _head_case(world, rank, uneven, V, seed):
    """This rank's [s, e), the sharding keywords, a generator, and hidden
    [N, H], the whole head [V, H] and bias [V]."""
    s, e = _bounds(V, world, uneven)[rank]
    shard = _shard_kw(s, V, uneven)
    g = torch.Generator().manual_seed(seed + world)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) / H ** 0.5
    return s, e, shard, g, h, w, torch.randn(V, generator=g)


def _check_head(world, rank, uneven, V):
    """The fused head with W's rows split: loss, dhidden (summed over the
    ranks), the rank's rows of dW and db, against the whole head."""
    s, e, shard, g, h, w, b = _head_case(world, rank, uneven, V, 7)
    _, y = _rows(V, _bounds(V, world, uneven), seed=world)
    tw = torch.rand(N, generator=g) + 0.5
    cases = [
        dict(),
        dict(reduction="none", token_weight=tw),
        dict(reduction="sum", label_smoothing=0.1, softcap=10.0, logit_scale=40.0),
        dict(num_items=17, z_loss=1e-3),
    ]
    # the shard's logits in chunks of a few rows (then recomputed) or one chunk
    budgets = (None, 16 << 10, 8 << 10, None)
    for case, budget in zip(cases, budgets):
        def run(fn, ww, bb):
            hh, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (h, ww, bb))
            out = fn(hh, w2, y, bias=b2, **case)
            (out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum().backward()
            return out.detach(), hh.grad, w2.grad, b2.grad

        ref = run(LT.linear_cross_entropy, w, b)
        got = run(lambda *a, **k: LT.linear_cross_entropy(*a, **k, **shard, memory_budget=budget),
                  w[s:e], b[s:e])
        _close(got[0], ref[0], "head loss %s" % case, rtol=1e-4)
        _close(got[1], ref[1], "head dhidden %s" % case, rtol=1e-4, atol=1e-5)
        _close(got[2], ref[2][s:e], "head dweight %s" % case, rtol=1e-4, atol=1e-5)
        _close(got[3], ref[3][s:e], "head dbias %s" % case, rtol=1e-4, atol=1e-5)


def _check_head_log_probs(world, rank, uneven, V):
    """The fused head's log-probs and entropy with W's rows split."""
    s, e, shard, g, h, w, b = _head_case(world, rank, uneven, V, 11)
    idx = torch.randint(V, (N,), generator=g)
    mask = torch.arange(N) % 5 != 3
    kw = dict(temperature=0.8, logit_scale=30.0, softcap=12.0, mask=mask, entropy=True)
    for budget in (None, 3 * (e - s) * 12):
        out = []
        for fn, ww, bb, extra in ((LT.linear_log_probs, w, b, {}),
                                  (LT.linear_log_probs, w[s:e], b[s:e],
                                   dict(shard, memory_budget=budget))):
            hh, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (h, ww, bb))
            logp, ent = fn(hh, w2, idx, bias=b2, **kw, **extra)
            (logp * 0.7 - ent * 1.3).sum().backward()
            out.append((logp.detach(), ent.detach(), hh.grad, w2.grad, b2.grad))
        ref, got = out
        for name, a, r in zip(("logp", "entropy", "dhidden"), got[:3], ref[:3]):
            _close(a, r, "head %s, budget %s" % (name, budget), rtol=1e-4, atol=1e-5)
        _close(got[3], ref[3][s:e], "head log-probs dweight", rtol=1e-4, atol=1e-5)
        _close(got[4], ref[4][s:e], "head log-probs dbias", rtol=1e-4, atol=1e-5)


def _check_heads_divergence(world, rank, uneven, V):
    """Two fused heads with both weights' rows split (the teacher of its own
    width): loss, the student's dhidden (summed over the ranks), the rank's
    rows of its dW and db, against the whole heads; one chunk and chunks of
    5 rows (the logits recomputed in each pass)."""
    s, e, shard, g, h, w, b = _head_case(world, rank, uneven, V, 13)
    ht = torch.randn(N, H + 3, generator=g)
    wt = w @ torch.randn(H, H + 3, generator=g) / H ** 0.5
    wt = wt + 0.1 * torch.randn(V, H + 3, generator=g)  # a teacher near the student
    bt = b + 0.1 * torch.randn(V, generator=g)
    _, y = _rows(V, _bounds(V, world, uneven), seed=world + 1)
    cases = [
        (LT.linear_generalized_jsd, dict(beta=0.5, return_entropy=True), None),
        (LT.linear_kl_div, dict(reduction="none", temperature=0.7, return_entropy=True),
         5 * (e - s) * 12),
        (LT.linear_kl_div, dict(reverse=True, hard_weight=0.5, num_items_in_batch=9), None),
        (LT.linear_tvd, dict(reduction="sum", softcap=8.0), 5 * (e - s) * 12),
        (LT.linear_generalized_jsd, dict(beta=0.2, reduction="mean"), 5 * (e - s) * 12),
    ]
    for fn, kw, budget in cases:
        out = []
        for ww, bb, wtt, btt, extra in ((w, b, wt, bt, {}),
                                        (w[s:e], b[s:e], wt[s:e], bt[s:e],
                                         dict(shard, memory_budget=budget))):
            hh, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (h, ww, bb))
            loss = fn(hh, w2, ht, wtt, y, student_bias=b2, teacher_bias=btt, **kw, **extra)
            loss, ent = loss if kw.get("return_entropy") else (loss, None)
            (loss * torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)).sum().backward()
            out.append((loss.detach(), hh.grad, w2.grad, b2.grad, ent))
        ref, got = out
        what = "heads %s %s" % (fn.__name__, kw)
        if ref[4] is not None:
            _close(got[4], ref[4], what + " entropy", rtol=1e-4, atol=1e-6)
        _close(got[0], ref[0], what, rtol=1e-4)
        _close(got[1], ref[1], what + " dhidden", rtol=1e-4, atol=1e-5)
        _close(got[2], ref[2][s:e], what + " dweight", rtol=1e-4, atol=1e-5)
        _close(got[3], ref[3][s:e], what + " dbias", rtol=1e-4, atol=1e-5)


def _check_bf16(world, rank, uneven, V):
    """bf16 logits: computed in fp32 like the one-shot call, so the loss,
    log-probs and entropy agree to fp32 rounding and the bf16 gradients to
    one bf16 rounding."""
    bounds = _bounds(V, world, uneven)
    s, e = bounds[rank]
    shard = _shard_kw(s, V, uneven)
    x, y = _rows(V, bounds, seed=world * 10 + 7)
    x = x.bfloat16()
    for name, fn in (("CE", lambda t, **k: LT.cross_entropy(t, y, reduction="none", **k)),
                     ("log-probs + entropy",
                      lambda t, **k: sum(LT.log_probs(t, y.clamp(min=0), entropy=True, **k)))):
        ref, gref = _grad_of(fn, x)
        got, ggot = _grad_of(lambda t: fn(t, **shard), x[:, s:e])
        _close(got, ref, "bf16 %s" % name)
        _close(ggot.float(), gref[:, s:e].float(), "bf16 %s grad" % name, rtol=2 ** -8,
               atol=1e-30)
    # a 16-bit head's (torch's GEMMs, its logits rounded to bf16): against
    # the F32 head on the same rounded inputs, to that rounding
    _, _, _, _, h, w, _ = _head_case(world, rank, uneven, V, 17)
    h, w = h.bfloat16(), w.bfloat16()
    out = []
    for dt, ww, extra in ((torch.float32, w, {}), (torch.bfloat16, w[s:e], shard)):
        hh, w2 = h.to(dt).requires_grad_(True), ww.to(dt).requires_grad_(True)
        LT.linear_cross_entropy(hh, w2, y, **extra).backward()
        out.append((hh.grad.float(), w2.grad.float()))
    _close(out[1][0], out[0][0], "bf16 head dhidden", rtol=3e-2, atol=1e-3)
    _close(out[1][1], out[0][1][s:e], "bf16 head dweight", rtol=3e-2, atol=1e-3)


def _worker(rank, world, init):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        _check_rank(world, rank, False, 20 * world)
        _check_rank(world, rank, True, 12 * world + 61)
        _check_bf16(world, rank, world == 3, 12 * world + 61 if world == 3 else 20 * world)
        _check_grpo(world, rank, world != 2, 12 * world + 61 if world != 2 else 20 * world)
        _check_divergence(world, rank, world != 3, 12 * world + 61 if world != 3 else 20 * world)
        _check_head(world, rank, False, 20 * world)
        _check_head(world, rank, True, 12 * world + 61)
        uneven = world % 2 == 1
        _check_head_log_probs(world, rank, uneven, 12 * world + 61 if uneven else 20 * world)
        _check_heads_divergence(world, rank, not uneven, 20 * world if uneven else 12 * world + 61)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_vocab_parallel_matches_single_process(world):
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        torch.multiprocessing.spawn(_worker, args=(world, init), nprocs=world)
