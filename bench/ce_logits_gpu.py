"""Cross-entropy on materialized logits through lmloss.torch against the
one-pass C kernel it calls (issue 36, item 4: forward+backward within 1.10x
of that kernel alone).

Cases, on bf16 logits [N, V] (randn * 2, "random"; and "peaked": each
target lifted 0-15 above its row's max), targets uniform in [0, V):

  lmloss            lt.cross_entropy(x, y) forward + loss.backward() (the
                    forward forms dlogits in its one pass, the backward
                    scales them by the upstream 1)
  lmloss inplace    the same with inplace_backward=True (dlogits written
                    over the logits)
  lmloss num_items  reduction="sum", num_items=<a tensor> (transformers'
                    num_items_in_batch): the sum is divided on the device,
                    so the upstream is never 1 and the op leaves the
                    gradient to its backward (scaling a formed one measured
                    slower)
  lmloss two-pass   the op with the gradient left to its backward (the path
                    before the one-pass forward: the backward re-reads the
                    logits)
  C one-pass        lmloss_cross_entropy with dlogits through the C API
                    (lmloss._lib), views and buffers made once: no autograd,
                    no allocation, the limit the target refers to
  copy              dst.copy_(src) of the logits: read + write of N x V x 2
                    bytes, the copy bandwidth
  liger             Liger-Kernel's LigerCrossEntropyLoss forward+backward
                    (it writes the gradient over the logits too; where
                    installed, CUDA only)
  torch             F.cross_entropy(x.float(), y) forward+backward, eager

Timing: every sample first refreshes the working logits from a source
tensor (a device copy, outside the timed region: the in-place cases find
fresh logits, and every case the same cache state), then times one call
between two CUDA events. The samples are queued without synchronizing, so
the host runs ahead of the GPU and a sample is device time, unless the
host cannot keep up (bench/torch_overhead.py measures that) or a call
synchronizes it. Warm-up calls first; median and min-max of --reps
samples. On the CPU (--device cpu, a smoke run of the logic) each sample
is perf_counter around the call. Before timing, the gradients of the
first three cases are checked against each other.

    python bench/ce_logits_gpu.py [--shape N,V ...] [--reps 20]
    python bench/ce_logits_gpu.py --device cpu --shape 64,1000 --reps 3
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import lmloss.torch as lt
from lmloss import _lib
from lmloss._ce import ce_options
from lmloss.torch import _bridge as B
from lmloss.torch import _ops as O

SHAPES = ["8192,152064", "4096,32768"]


def logits(n, v, peaked, gen):
    """bf16 [n, v] randn * 2 and targets [n] on gen's device; peaked:
    x[i, y_i] = max_i + U(0, 15)."""
    dev = gen.device
    x = torch.randn(n, v, generator=gen, device=dev) * 2
    y = torch.randint(0, v, (n,), generator=gen, device=dev)
    if peaked:
        lift = torch.rand(n, generator=gen, device=dev) * 15
        x[torch.arange(n, device=dev), y] = x.max(-1).values + lift
    return x.to(torch.bfloat16), y


def c_one_pass(x, y):
    """run() calling lmloss_cross_entropy (mean, dlogits at upstream 1) on
    x, and the dlogits it writes; every view and buffer made here."""
    keep = []
    loss, dx = x.new_empty((1,), dtype=torch.float32), torch.empty_like(x)
    inputs = _lib.CEInputs(B.view(x, keep), B.view(y, keep), _lib.Tensor(), _lib.Tensor())
    out = _lib.CEOutputs(loss=B.view(loss, keep), dlogits=B.view(dx, keep))
    opt = ce_options(-100, 0.0, 0.0, 1.0, None, 1.0, "mean", None, False)
    ws, addr, nbytes = B.workspace(_lib.ce_workspace_size(x.shape[0]), x.device)

    def run():
        with B.context(x, 0, 0) as ctx:
            _lib.check(_lib.cross_entropy(ctx, inputs, opt, out, addr, nbytes))
    run.buffers = keep, ws  # the tensors the views point at live as long as run
    return run, dx


def backward_of(loss_fn, x, y):
    """run(): loss_fn(x, y).backward() with x's gradient cleared first."""
    def run():
        x.grad = None
        loss_fn(x, y).backward()
    return run


def cases(work, y, device):
    """(name, run) of every case over the working logits `work` (a leaf)."""
    c_run, _ = c_one_pass(work.detach(), y)
    dst = torch.empty_like(work)
    items = torch.tensor(float(y.numel()), device=y.device)
    fopts, iopts = O.ce_args(-100, 0.0, 0.0, 1.0, None, 1.0, "mean", None, False, 0, 0)
    out = [("lmloss", backward_of(lt.cross_entropy, work, y)),
           ("lmloss inplace", backward_of(
               lambda a, b: lt.cross_entropy(a, b, inplace_backward=True), work, y)),
           ("lmloss num_items", backward_of(
               lambda a, b: lt.cross_entropy(a, b, reduction="sum", num_items=items), work, y)),
           ("lmloss two-pass", backward_of(
               lambda a, b: O.cross_entropy(a, b, None, None, fopts, iopts, 0)[0], work, y)),
           ("C one-pass", c_run),
           ("copy", lambda: dst.copy_(work.detach()))]
    if device == "cuda":
        try:
            from liger_kernel.transformers import LigerCrossEntropyLoss
            out.append(("liger", backward_of(LigerCrossEntropyLoss(), work, y)))
        except ImportError:
            pass
    out.append(("torch", backward_of(lambda a, b: F.cross_entropy(a.float(), b), work, y)))
    return out


def samples(run, refresh, reps, warmup, device):
    """Per-sample ms of run() (module docstring: a refresh before each)."""
    for _ in range(warmup):
        refresh()
        run()
    if device != "cuda":
        ts = []
        for _ in range(reps):
            refresh()
            t = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t) * 1e3)
        return ts
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        refresh()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def check(src, y):
    """Largest |difference| of the gradients of lmloss, lmloss inplace and
    the C one-pass call on the same logits (one bf16 rounding apart at most)."""
    grads = []
    for inplace in (False, True):
        x = src.clone().requires_grad_()
        lt.cross_entropy(x, y, inplace_backward=inplace).backward()
        grads.append(x.grad.float())
    run, dx = c_one_pass(src, y)
    run()
    ref = dx.float()
    return max((g - ref).abs().max().item() for g in grads)


def report(n, v, peaked, gen, args):
    """Check and time every case on one shape and kind of logits, one line each."""
    dev = args.device
    src, y = logits(n, v, peaked, gen)
    work = src.clone().requires_grad_()

    def refresh():
        work.grad = None
        with torch.no_grad():
            work.copy_(src)

    print(f"\n{n} x {v} {'peaked' if peaked else 'random'}: gradients agree to "
          f"{check(src, y):.2e}", flush=True)
    times = {c: samples(run, refresh, args.reps, args.warmup, dev)
             for c, run in cases(work, y, dev)}
    med = {c: statistics.median(t) for c, t in times.items()}
    for c, t in times.items():
        print(f"  {c:15s} {med[c]:8.3f} ms ({min(t):.3f}-{max(t):.3f})  "
              f"{med[c] / med['C one-pass']:5.2f}x C  {med[c] / med['copy']:5.2f}x copy",
              flush=True)
    gbs = 2 * src.numel() * src.element_size() / (med["copy"] * 1e6)
    print(f"  copy bandwidth {gbs:.0f} GB/s; lmloss / C one-pass "
          f"{med['lmloss'] / med['C one-pass']:.3f} (target <= 1.10)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", help="N,V (repeatable; default %s)" % SHAPES)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(0)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"{name}, bf16 logits, ms: median (min-max) of {args.reps} samples; "
          "ratios to the C one-pass call and to the copy")
    for shape in args.shape or SHAPES:
        n, v = (int(s) for s in shape.split(","))
        for peaked in (False, True):
            report(n, v, peaked, gen, args)
            if dev == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
