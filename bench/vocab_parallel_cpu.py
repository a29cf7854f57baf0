"""Vocab-parallel losses on CPU ranks (gloo) against the single-process call
on the same work per rank:
    python3 bench/vocab_parallel_cpu.py [ranks] [N] [V] [op]
op: ce (default), logprob (log-probs of the label with the entropy, the
loss their sum), softmax or log_softmax (the loss its sum of squares),
kl, jsd (beta 0.5), tvd, head (the fused head's CE: hidden [N, 256]
replicated, the rank's rows of W; dhidden all-reduced) or head-logprob
(its log-probs of the label with the entropy, the loss their sum).

Each rank runs lmloss.torch's op (forward + backward) with process_group
on its [N, V / ranks] shard, one thread each; the reference is the
one-shot call on an [N, V / ranks] block, one thread, the same arithmetic
without the exchanges and the merges: in one process with the others
idle, and on every rank at once (the machine as loaded as the ranks
load it). Rows are peaked
(each label lifted 0-15 above its row's max); a divergence's teacher is
the student plus N(0, 1) noise. Prints medians."""

import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import lmloss.torch as LT


def _rows(n, v, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g)
    y = torch.randint(v, (n,), generator=g)
    x[torch.arange(n), y] = x.max(1).values + torch.rand(n, generator=g) * 15
    return x, y


def _time(fn, reps=7):
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _step(fn, x):
    def run():
        xx = x.detach().requires_grad_(True)
        fn(xx).backward()
    return run


def _op(name, y, teacher, **kw):
    """The loss of student logits z: lmloss.torch's op of name."""
    if name == "ce":
        return lambda z: LT.cross_entropy(z, y, **kw)
    if name == "logprob":
        def lp(z):
            logp, ent = LT.log_probs(z, y, entropy=True, **kw)
            return logp.sum() + ent.sum()
        return lp
    if name in ("softmax", "log_softmax"):
        return lambda z: getattr(LT, name)(z, **kw).square().sum()
    fn, extra = {"kl": (LT.kl_div, {}), "jsd": (LT.generalized_jsd, dict(beta=0.5)),
                 "tvd": (LT.tvd, {})}[name]
    return lambda z: fn(z, teacher, **extra, **kw)


H = 256  # the fused head's width


def _head_step(op, h, w, y, **kw):
    def run():
        hh, ww = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
        if op == "head":
            LT.linear_cross_entropy(hh, ww, y, **kw).backward()
            return
        logp, ent = LT.linear_log_probs(hh, ww, y, entropy=True, **kw)
        (logp.sum() + ent.sum()).backward()
    return run


def _head(op, rank, world, n, v):
    """The fused head's steps: a rank's shard of W, and one process's head
    of V / world rows on the same hidden."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(n, H, generator=g)
    w = torch.randn(v, H, generator=g) / H ** 0.5
    y = torch.randint(v, (n,), generator=g)
    c = v // world
    return (_head_step(op, h, w[rank * c:(rank + 1) * c].contiguous(), y,
                       process_group=dist.group.WORLD),
            _head_step(op, h, w[:c].contiguous(), y % c, num_threads=1))


def _steps(rank, world, n, v, op):
    """The rank's sharded step and the one-shot step on a block of its size."""
    if op in ("head", "head-logprob"):
        return _head(op, rank, world, n, v)
    x, y = _rows(n, v, 0)
    t = x + torch.randn(n, v, generator=torch.Generator().manual_seed(2))
    w = v // world
    xs, ts = (z[:, rank * w:(rank + 1) * w].contiguous() for z in (x, t))
    xb, yb = _rows(n, w, 1)
    tb = xb + torch.randn(n, w, generator=torch.Generator().manual_seed(3))
    return (_step(_op(op, y, ts, process_group=dist.group.WORLD), xs),
            _step(_op(op, yb, tb, num_threads=1), xb))


def _worker(rank, world, init, n, v, op):
    """Times, on rank 0: the sharded step; the one-shot step alone (the
    other ranks idle); and the one-shot step on every rank at once, each
    its own block, which shares the cores' caches, memory bandwidth and
    (on SMT machines) execution units as the ranks do."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    shard, one = _steps(rank, world, n, v, op)
    t_shard = _time(shard)
    dist.barrier()
    t_one = _time(one) if rank == 0 else 0.0
    dist.barrier()
    t_all = _time(one)
    dist.barrier()
    st = torch.zeros(n, 4)
    parts = torch.empty(world * n, 4)
    t_x = _time(lambda: dist.all_gather_into_tensor(parts, st))
    if rank == 0:
        print("%s, ranks %d, N %d, V %d (%d a rank), fwd+bwd: rank %.2f ms; the one-shot call on "
              "a block of that size alone %.2f ms (ratio %.2f), on every rank at once %.2f ms "
              "(ratio %.2f); a 16-byte-a-row all-gather alone %.2f ms"
              % (op, world, n, v, v // world, t_shard * 1e3, t_one * 1e3, t_shard / t_one,
                 t_all * 1e3, t_shard / t_all, t_x * 1e3))
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    v = int(sys.argv[3]) if len(sys.argv) > 3 else 65536
    op = sys.argv[4] if len(sys.argv) > 4 else "ce"
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(world, "file://" + tmp + "/rdv", n, v, op),
                                    nprocs=world)
