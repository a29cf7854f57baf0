"""Vocab-parallel CE on CPU ranks (gloo) against the single-process call on
the same work per rank: python3 bench/vocab_parallel_cpu.py [ranks] [N] [V].

Each rank runs lmloss.torch's cross_entropy (forward + backward) with
process_group on its [N, V / ranks] shard, one thread each; the reference
is the one-shot call on an [N, V / ranks] block in one process, one
thread: the same arithmetic without the exchange and the merge. Rows are
peaked (each label lifted 0-15 above its row's max). Prints medians."""

import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from lmloss.torch import _vocab_parallel as VP
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


def _worker(rank, world, init, n, v):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    x, y = _rows(n, v, 0)
    w = v // world
    xs = x[:, rank * w:(rank + 1) * w].contiguous()
    t_shard = _time(_step(lambda t: VP.cross_entropy(t, y, process_group=dist.group.WORLD), xs))
    dist.barrier()
    if rank == 0:
        xb, yb = _rows(n, w, 1)
        t_one = _time(_step(lambda t: LT.cross_entropy(t, yb, num_threads=1), xb))
        st = torch.zeros(n, 4)
        parts = torch.empty(world * n, 4)
        t_x = _time(lambda: dist.all_gather_into_tensor(parts, st))
        print("ranks %d, N %d, V %d (%d a rank), fwd+bwd: rank %.2f ms, one-shot on the same "
              "block %.2f ms (ratio %.2f); the all-gather alone %.2f ms"
              % (world, n, v, w, t_shard * 1e3, t_one * 1e3, t_shard / t_one, t_x * 1e3))
    else:
        _time(lambda: dist.all_gather_into_tensor(torch.empty(world * n, 4), torch.zeros(n, 4)))
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    v = int(sys.argv[3]) if len(sys.argv) > 3 else 65536
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(world, "file://" + tmp + "/rdv", n, v),
                                    nprocs=world)
