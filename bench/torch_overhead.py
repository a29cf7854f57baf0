"""Host time against device time of lmloss.torch calls on CUDA.

For each call form (CE forward+backward, CE forward, log-probs forward, and
F.cross_entropy for comparison): the host time per call of 100 calls issued
without synchronizing, and the CUDA-event time per call of 100 queued calls.
When the host time is the larger, the call is host-bound. Then a cProfile
of 200 CE forward+backward calls (where the host time goes) and the
torch.profiler kernel table of 10.

    python bench/torch_overhead.py [--shape N,V]
"""
import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import lmloss.torch as lt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096,32768")
    N, V = (int(s) for s in ap.parse_args().shape.split(","))
    x = (torch.randn(N, V, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
    y = torch.randint(0, V, (N,), device="cuda")

    def ce():
        x.grad = None
        lt.cross_entropy(x, y).backward()

    def ce_fwd():
        with torch.no_grad():
            lt.cross_entropy(x, y)

    def log_probs():
        with torch.no_grad():
            lt.log_probs(x, y)

    def torch_ce():
        x.grad = None
        F.cross_entropy(x.float(), y).backward()

    print(f"{N} x {V} bf16, per call: host (no sync) and device (CUDA events, queued)")
    for name, f in (("ce fwd+bwd", ce), ("ce fwd", ce_fwd), ("log_probs", log_probs),
                    ("F.cross_entropy", torch_ce)):
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            f()
        host = (time.perf_counter() - t) * 10
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(100):
            f()
        e.record()
        e.synchronize()
        print(f"{name:16s} host {host:.3f} ms  device {s.elapsed_time(e) / 100:.3f} ms", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        ce()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            ce()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                 max_name_column_width=50))


if __name__ == "__main__":
    main()
