"""Where a fused-head step's GPU time goes, kernel by kernel (torch.profiler).

    python bench/profile_gpu.py [--n 8192] [--v 152064] [--h 4096] [--supervised 1.0] [--bias]
                                [--logprob] [--budget BYTES]

One warm-up, then one lmloss.torch.linear_cross_entropy forward+backward
(bf16 hidden and head, dhidden and dW produced; with --bias a bias and its
gradient too; with --logprob GRPO's head instead: linear_log_probs with
entropy, the loss sum(A logp) + 0.01 sum(entropy), rows masked where not
supervised) under the profiler: each
kernel's total CUDA time, calls and share, grouped by name, and the step's
wall time, so that GEMMs, row passes and gaps can be told apart.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import lmloss.torch as lt


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--v", type=int, default=152064)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--supervised", type=float, default=1.0)
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--logprob", action="store_true")
    ap.add_argument("--budget", type=int, default=None, help="memory_budget (default: the C one)")
    args = ap.parse_args()
    dev = "cuda"
    h = torch.randn(args.n, args.h, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(args.v, args.h, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    b = ((torch.randn(args.v, device=dev, dtype=torch.bfloat16) * 0.5).requires_grad_()
         if args.bias else None)
    y = torch.randint(0, args.v, (args.n,), device=dev)
    keep = torch.rand(args.n, device=dev) < args.supervised
    y[~keep] = -100
    adv = torch.randn(args.n, device=dev)

    def loss():
        if not args.logprob:
            return lt.linear_cross_entropy(h, w, y, bias=b, memory_budget=args.budget)
        logp, ent = lt.linear_log_probs(h, w, y.clamp(min=0), bias=b, mask=keep, entropy=True,
                                        memory_budget=args.budget)
        return (adv * logp).sum() + 0.01 * ent.sum()

    def step():
        h.grad = w.grad = None
        if b is not None:
            b.grad = None
        loss().backward()

    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in kernels)
    print(f"step {start.elapsed_time(end):.2f} ms wall, kernels {total / 1e3:.2f} ms")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:20]:
        print(f"{e.device_time_total / 1e3:9.2f} ms {e.count:5d} calls "
              f"{100 * e.device_time_total / total:5.1f}%  {e.key[:90]}")


if __name__ == "__main__":
    main()
