"""The fused head's CE forward + backward against its peers, issue 36's way.

bf16 hidden [N, H] and head [V, H] (N = 8192, H = 4096, V = 152064 by
default), dhidden and dW produced, every implementation through the entry
point its users call, in one process on the same tensors:

  lmloss            lmloss.torch.linear_cross_entropy (default budget: the
                    fastest schedule), with dW added to an fp32 main_grad,
                    and at memory_budget=256 MiB
  torch             F.cross_entropy((h @ w.T).float(), y), eagerly
                    (and compiled with --compile)
  cce, cce-exact    cut-cross-entropy's linear_cross_entropy, its default
                    gradient filter and filter_eps=None
  liger             Liger-Kernel's LigerFusedLinearCrossEntropyLoss
  quack             QuACK's chunked_linear_cross_entropy (its defaults: on
                    an H100/H200 with bf16 and V a multiple of 128, the
                    scaled-exp pipeline), and with chunks of 2048 and 8192
                    rows (its default 4096 fails where H = 4096)

on two kinds of rows: *random* (h and w standard normal / sqrt(H): a flat
softmax) and *peaked* like a trained model's (each row's target lifted
0-15 above the row's max by moving h along its target's row of w), and
on request *peers* (bench/peers_gpu.py's: h standard normal, w times 0.02:
logits of std 1.3), and
with --supervised F a fraction F of the rows supervised (the rest
ignore_index). The limit is the same three GEMMs alone (torch.matmul in
bf16: the logits, dhidden, dW), timed in the same run, and for "lmloss
main_grad" the same with dW added to an fp32 buffer. Time: median of
--reps CUDA-event samples of one forward + backward after a warm-up;
memory: the peak allocated during one, beyond the inputs (gradients
included). dh err: dhidden's relative Frobenius distance from lmloss's
(fp32-exact) one.

    python bench/fused_head_gpu.py [--n 8192] [--h 4096] [--v 152064] [--reps 5]
                                   [--kinds random,peaked] [--supervised 1.0] [--compile]
"""
import argparse

import torch
import torch.nn.functional as F

import lmloss.torch as lt
from gpu_timing import peak_mib, timed


def rows(kind, n, h, v, supervised, gen):
    """(hidden, weight, target) of one kind of rows."""
    x = torch.randn(n, h, device="cuda", generator=gen)
    w = torch.randn(v, h, device="cuda", generator=gen)
    if kind == "peers":  # bench/peers_gpu.py's rows
        w *= 0.02
    else:
        x, w = x / h ** 0.5, w / h ** 0.5
    y = torch.randint(0, v, (n,), device="cuda", generator=gen)
    if kind == "peaked":
        lift = torch.rand(n, device="cuda", generator=gen) * 15
        for i in range(0, n, 1024):  # the logits a block of rows at a time
            z = x[i:i + 1024] @ w.T
            zy = z.gather(1, y[i:i + 1024, None])[:, 0]
            need = z.max(1).values - zy + lift[i:i + 1024]
            wy = w[y[i:i + 1024]]
            x[i:i + 1024] += (need / wy.pow(2).sum(1))[:, None] * wy
    keep = torch.rand(n, device="cuda", generator=gen) < supervised
    y[~keep] = -100
    return x.bfloat16(), w.bfloat16(), y


def impls(compile_, main_grad, dynamic=False):
    """name -> loss(h, w, y) of every implementation that imports here;
    "lmloss main_grad" only with a main_grad buffer."""
    eager = lambda h, w, y: F.cross_entropy((h @ w.T).float(), y)
    out = {"lmloss": lambda h, w, y: lt.linear_cross_entropy(h, w, y),
           "lmloss main_grad": lambda h, w, y: lt.linear_cross_entropy(h, w, y,
                                                                       main_grad=main_grad),
           "lmloss 256 MiB": lambda h, w, y: lt.linear_cross_entropy(h, w, y,
                                                                     memory_budget=256 << 20),
           "torch": eager}
    if main_grad is None:
        del out["lmloss main_grad"]
    if compile_:
        out["torch.compile"] = torch.compile(eager, dynamic=dynamic)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        out["cce"] = lambda h, w, y: cce(h, w, y)
        out["cce-exact"] = lambda h, w, y: cce(h, w, y, filter_eps=None)
    except ImportError:
        pass
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        flce = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda h, w, y: flce(w, h, y)
    except ImportError:
        pass
    try:
        from quack.linear_cross_entropy import chunked_linear_cross_entropy as qce
        out["quack"] = lambda h, w, y: qce(h, w, y)
        # its default chunk of 4096 rows fails where H is 4096 too (its
        # epilogue cannot tell a row vector from a column one): two others
        out["quack 2048"] = lambda h, w, y: qce(h, w, y, chunk_size=2048)
        out["quack 8192"] = lambda h, w, y: qce(h, w, y, chunk_size=8192)
    except Exception as e:  # absent, or its CuTe DSL fails at import
        print(f"quack: {type(e).__name__}: {str(e)[:100]}")
    return out


def step(fn, h, w, y):
    """One forward + backward on leaf copies; returns (dhidden, dW)."""
    hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
    fn(hl, wl, y).backward()
    return hl.grad, wl.grad


def gemms(h, w, main_grad=None):
    """The three GEMMs alone; with main_grad, dW added to it in fp32
    (addmm's out_dtype: the limit of a call that adds to a main_grad)."""
    dl = torch.randn(h.shape[0], w.shape[0], device="cuda", dtype=h.dtype)

    def run():
        h @ w.T
        dl @ w
        if main_grad is None:
            dl.T @ h
        else:
            torch.addmm(main_grad, dl.T, h, out_dtype=torch.float32)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=152064)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", default="random,peaked")
    ap.add_argument("--supervised", type=float, default=1.0)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, N {a.n} H {a.h} V {a.v} bf16, "
          f"{a.supervised:.0%} supervised")
    for kind in a.kinds.split(","):
        h, w, y = rows(kind, a.n, a.h, a.v, a.supervised, gen)
        with torch.no_grad():
            z = (h @ w.T).float()
            ok = y >= 0
            p = z[ok].softmax(-1).gather(1, y[ok, None]).mean().item()
            del z
        limit = timed(gemms(h, w), a.reps)[0]
        main_grad = torch.zeros(w.shape, device="cuda")  # a training loop's fp32 dW sum
        try:
            mg_limit = f"{timed(gemms(h, w, main_grad), a.reps)[0]:.2f} ms"
        except (RuntimeError, TypeError) as e:  # a torch without addmm's out_dtype
            mg_limit = f"not measured ({type(e).__name__})"
        print(f"\n{kind} rows (mean target probability {p:.3g}); three GEMMs {limit:.2f} ms; "
              f"with dW added to an fp32 main_grad {mg_limit}")
        ref = None
        for name, fn in impls(a.compile, main_grad).items():
            try:
                run = lambda: step(fn, h, w, y)
                med, lo, hi = timed(run, a.reps)
                mib = peak_mib(run)
                dh = run()[0].float()
                if ref is None:
                    ref = dh
                err = ((dh - ref).norm() / ref.norm()).item()
                print(f"  {name:15s} {med:8.2f} ms ({lo:.2f}-{hi:.2f}) {med / limit:5.2f}x GEMMs "
                      f"{mib:8.0f} MiB  dh err {err:.2e}", flush=True)
            except Exception as e:  # a peer that cannot run this shape or is absent
                print(f"  {name:15s} {type(e).__name__}: {str(e)[:100]}")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
