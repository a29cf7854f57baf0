"""Vocab-parallel over several processes, one GPU each (NCCL) or CPU ranks
(gloo): issue 40's run.

  torchrun --nproc_per_node=2 bench/vocab_parallel_multi.py            # GPUs, NCCL, bf16
  torchrun --nproc_per_node=2 bench/vocab_parallel_multi.py --cpu --rows 256 --vocab 8000 --hidden 64

Megatron-LM's vocab_parallel_cross_entropy runs beside lmloss when its
checkout is on PYTHONPATH (megatron/core is enough). Rank 0 prints:
1. correctness: every family through lmloss.torch with process_group
   against the one-process call on the same global batch (each rank also
   computes the whole batch alone), on peaked rows whose label lies on
   each rank in turn: CE (plain; smoothing and class weights), log-probs +
   entropy, entropy, softmax, log-softmax, the fused head's CE and
   log-probs; outputs and gradients as relative Frobenius differences;
2. CE forward + backward on the global N x V logits split over the ranks:
   a rank's time against the one-process call on all of V (target <=
   0.55x), and Megatron's on the same shards, with peak memory;
3. the fused head, W split by rows, hidden replicated (dhidden all-reduced):
   a rank against the one-process fused head, at the default budget and
   at 4 GiB;
4. Megatron's and lmloss's loss at margins 17, 30 and 50 against float64.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import lmloss.torch as LT

MARGINS = torch.tensor([0.0, 5, 17, 30, 50, 1000])


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="gloo on CPU ranks, float32")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--hidden", type=int, default=4096)
    return p.parse_args()


class Run:
    def __init__(self, a):
        self.cpu = a.cpu
        dist.init_process_group("gloo" if a.cpu else "nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dev = torch.device("cpu") if a.cpu else torch.device("cuda", self.rank)
        if not a.cpu:
            torch.cuda.set_device(self.dev)
        self.dt = torch.float32 if a.cpu else torch.bfloat16
        self.n, self.v, self.h = a.rows, a.vocab, a.hidden
        self.s = self.v * self.rank // self.world
        self.e = self.v * (self.rank + 1) // self.world
        self.shard = dict(process_group=dist.group.WORLD, vocab_start=self.s, vocab_size=self.v)

    def say(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    def rows(self, n, seed=0):
        """Peaked logits [n, V] (the same on every rank) and labels: row i's
        label on rank i % world, lifted by MARGINS[i % 6] above its row."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, self.v, generator=g)
        y = torch.empty(n, dtype=torch.int64)
        for r in range(self.world):
            lo, hi = self.v * r // self.world, self.v * (r + 1) // self.world
            y[r::self.world] = torch.randint(lo, hi, (len(range(r, n, self.world)),), generator=g)
        rows = torch.arange(n)
        x[rows, y] = x.max(1).values + MARGINS[rows % 6]
        y[3::17] = -100
        return x.to(self.dev, self.dt), y.to(self.dev)

    def sync(self):
        if not self.cpu:
            torch.cuda.synchronize()

    def timed(self, fn, reps=10):
        fn()
        self.sync()
        dist.barrier()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    def peak(self, fn):
        if self.cpu:
            return float("nan")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def grad_pair(fn_one, fn_shard, x, s, e):
    """(output rel, grad rel) of the sharded call against the one-process
    call; a per-column output (softmax) is compared and weighted on the
    rank's columns."""
    out = []
    for fn, t in ((fn_one, x), (fn_shard, x[:, s:e])):
        t = t.detach().clone().requires_grad_(True)
        o = fn(t)
        wts = torch.linspace(0.5, 1.5, x.numel() if o.dim() == 2 else o.numel(), device=o.device)
        wts = wts.reshape(x.shape)[:, s:e] if o.dim() == 2 and o.shape[1] != x.shape[1] else \
            wts.reshape(x.shape) if o.dim() == 2 else wts
        (o.float() * wts).sum().backward()
        out.append((o.detach(), t.grad))
    ref_out = out[0][0][:, s:e] if out[0][0].dim() == 2 else out[0][0]
    return rel(out[1][0], ref_out), rel(out[1][1], out[0][1][:, s:e])


def correctness(R):
    x, y = R.rows(min(R.n, 1024))
    cw = torch.rand(R.v, generator=torch.Generator().manual_seed(3)).to(R.dev) + 0.5
    idx = y.clamp(min=0)
    fams = [
        ("CE", lambda t, **k: LT.cross_entropy(t, y, **k)),
        ("CE smoothing 0.1 + class weights, none",
         lambda t, **k: LT.cross_entropy(t, y, label_smoothing=0.1, weight=cw, reduction="none",
                                         **k)),
        ("log-probs + entropy",
         lambda t, **k: sum(LT.log_probs(t, idx, entropy=True, temperature=0.8, **k))),
        ("entropy", lambda t, **k: LT.entropy(t, **k)),
        ("softmax", lambda t, **k: LT.softmax(t, **k)),
        ("log-softmax", lambda t, **k: LT.log_softmax(t, **k)),
    ]
    for name, fn in fams:
        o, g = grad_pair(fn, lambda t, fn=fn: fn(t, **R.shard), x, R.s, R.e)
        R.say("  %-40s output %.2e  grad %.2e" % (name, o, g))
    g = torch.Generator().manual_seed(5)
    n, h = min(R.n, 1024), min(R.h, 1024)
    hid = (torch.randn(n, h, generator=g) / 2).to(R.dev, R.dt)
    w = (torch.randn(R.v, h, generator=g) / h ** 0.5).to(R.dev, R.dt)
    for name, fn in (("fused head CE", LT.linear_cross_entropy),
                     ("fused head log-probs", LT.linear_log_probs)):
        res = []
        for ww, kw in ((w, {}), (w[R.s:R.e], R.shard)):
            hh = hid.detach().clone().requires_grad_(True)
            w2 = ww.detach().clone().requires_grad_(True)
            o = fn(hh, w2, idx[:n] if "log" in name else y[:n], **kw)
            o.float().sum().backward()
            res.append((o.detach(), hh.grad, w2.grad))
        R.say("  %-40s output %.2e  dhidden %.2e  dW %.2e"
              % (name, rel(res[1][0], res[0][0]), rel(res[1][1], res[0][1]),
                 rel(res[1][2], res[0][2][R.s:R.e])))


def megatron_ce():
    try:
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
        return vocab_parallel_cross_entropy
    except ImportError:
        return None


def speed(R):
    x, y = R.rows(R.n)
    xs = x[:, R.s:R.e].contiguous()

    def step(fn, t):
        def run():
            tt = t.detach().requires_grad_(True)
            fn(tt).backward()
        return run

    one = step(lambda t: LT.cross_entropy(t, y), x)
    shard = step(lambda t: LT.cross_entropy(t, y, **R.shard), xs)
    t1, ts = R.timed(one), R.timed(shard)
    R.say("CE fwd+bwd %dx%d %s: one process %.3f ms; a rank of %d %.3f ms (%.2fx), peak %.0f MiB"
          % (R.n, R.v, str(R.dt)[6:], t1, R.world, ts, ts / t1, R.peak(shard)))
    mega = megatron_ce()
    if mega is not None:
        m = step(lambda t: mega(t, y, 0.0, dist.group.WORLD).mean(), xs)
        tm = R.timed(m)
        R.say("  Megatron-LM vocab_parallel_cross_entropy, a rank: %.3f ms (%.2fx), peak %.0f MiB"
              % (tm, tm / t1, R.peak(m)))
    del x, xs
    g = torch.Generator().manual_seed(1)
    hid = (torch.randn(R.n, R.h, generator=g) / 4).to(R.dev, R.dt)
    w = (torch.randn(R.v, R.h, generator=g) / R.h ** 0.5).to(R.dev, R.dt)

    def head(ww, **kw):
        def run():
            hh, w2 = hid.detach().requires_grad_(True), ww.detach().requires_grad_(True)
            LT.linear_cross_entropy(hh, w2, y, **kw).backward()
        return run

    f1 = R.timed(head(w), reps=5)
    ws = w[R.s:R.e].contiguous()
    for budget in (None, 4 << 30):
        fr = R.timed(head(ws, memory_budget=budget, **R.shard), reps=5)
        R.say("fused head %dx%dx%d: one process %.2f ms; a rank, budget %s: %.2f ms (%.2fx)"
              % (R.n, R.h, R.v, f1, budget, fr, fr / f1))


def collapse(R):
    """Loss at margins 17, 30, 50 (rows of N(0, 1), label on the last rank)."""
    n = 3
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, R.v, generator=g, dtype=torch.float64)
    y = torch.full((n,), R.v - 7, dtype=torch.int64)
    for i, m in enumerate((17.0, 30.0, 50.0)):
        x[i, y[i]] = x[i].max() + m
    d = x - x[torch.arange(n), y][:, None]
    d[torch.arange(n), y] = float("-inf")
    exact = torch.log1p(torch.exp(d).sum(-1))
    xs = x[:, R.s:R.e].to(R.dev, torch.float32)
    ours = LT.cross_entropy(xs, y.to(R.dev), reduction="none", **R.shard).cpu()
    mega = megatron_ce()
    theirs = mega(xs.clone(), y.to(R.dev), 0.0, dist.group.WORLD).cpu() if mega else None
    for i, m in enumerate((17, 30, 50)):
        R.say("  margin %d: exact %.6g, lmloss %.6g, Megatron-LM %s"
              % (m, exact[i], ours[i], "%.6g" % theirs[i] if theirs is not None else "-"))


def main():
    R = Run(args())
    what = "gloo, CPU" if R.cpu else "NCCL, %s" % torch.cuda.get_device_name()
    R.say("%d ranks, %s" % (R.world, what))
    R.say("correctness against the one-process call:")
    correctness(R)
    R.say("the collapse, fp32 logits:")
    collapse(R)
    speed(R)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the machine's notes: multicast stays off
    main()
