"""Megatron-LM's vocab_parallel_cross_entropy beside lmloss's process_group
path on the same peaked rows, CPU ranks over gloo:
  PYTHONPATH=<Megatron-LM checkout>:python python3 bench/megatron_vocab_parallel.py [ranks]

Rows: N(0, 1) logits over V = 32000 columns, the label lifted by a margin
above the row's max and placed on the last rank; the exact loss and the
label's gradient from float64. Megatron upcasts to fp32, all-reduces the
max, then sum(exp(x - max)): at a margin of 17 or more that sum is 1 in
fp32, so the loss reads 0 and the label's gradient p_y - 1 reads 0, where
the others' gradients do not. Also times one forward + backward of each
on [1024, 32000 / ranks] a rank (one thread a rank)."""

import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

import lmloss.torch as LT

V = 32000
MARGINS = (0.0, 5.0, 17.0, 30.0, 50.0)


def _rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g)
    y = torch.full((n,), V - 7, dtype=torch.int64)
    return x, y


def _exact(x, y):
    """float64 loss and d loss / d x_y of each row, from the others' sum
    R = sum_{j != y} exp(x_j - x_y): log1p(R) and -R / (1 + R)."""
    rows = torch.arange(len(y))
    d = x.double() - x.double()[rows, y][:, None]
    d[rows, y] = float("-inf")
    r = torch.exp(d).sum(-1)
    return torch.log1p(r), -r / (1 + r)


def _both(xs, y, group):
    out = {}
    for name in ("megatron", "lmloss"):
        t = xs.detach().clone().requires_grad_(True)
        if name == "megatron":
            loss = vocab_parallel_cross_entropy(t, y, 0.0, group)
        else:
            loss = LT.cross_entropy(t, y, process_group=group, reduction="none")
        loss.sum().backward()
        out[name] = (loss.detach(), t.grad)
    return out


def _worker(rank, world, init):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.group.WORLD
    w = V // world
    s = rank * w
    x, y = _rows(len(MARGINS))
    for i, m in enumerate(MARGINS):
        x[i, y[i]] = x[i].max() + m
    exact_loss, exact_dy = _exact(x, y)
    out = _both(x[:, s:s + w], y, group)
    if rank == world - 1:
        j = y[0] - s
        print("margin | exact loss | Megatron | lmloss | exact dx_y | Megatron | lmloss")
        for i, m in enumerate(MARGINS):
            print("%g | %.6g | %.6g | %.6g | %.6g | %.6g | %.6g"
                  % (m, exact_loss[i], out["megatron"][0][i], out["lmloss"][0][i],
                     exact_dy[i],
                     out["megatron"][1][i, j], out["lmloss"][1][i, j]))
    xt, yt = _rows(1024, 1)
    xs = xt[:, s:s + w].contiguous()
    times = {}
    for name in ("megatron", "lmloss"):
        for _ in range(2):
            _both(xs, yt, group)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            t = xs.detach().clone().requires_grad_(True)
            loss = (vocab_parallel_cross_entropy(t, yt, 0.0, group).mean() if name == "megatron"
                    else LT.cross_entropy(t, yt, process_group=group))
            loss.backward()
            ts.append(time.perf_counter() - t0)
        times[name] = statistics.median(ts)
    if rank == 0:
        print("fwd+bwd [1024, %d] a rank, %d ranks: Megatron %.1f ms, lmloss %.1f ms"
              % (w, world, times["megatron"] * 1e3, times["lmloss"] * 1e3))
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(world, "file://" + tmp + "/rdv"), nprocs=world)
