"""The collapse picture: relative error of the cross-entropy loss and of the
target's gradient against the target's margin (0 to 100), for PyTorch,
Liger-Kernel and lmloss, fp32 and bf16 logits, against a float64 reference
written collapse-free (loss = log1p(R), dx_y = -R / (1 + R), R = sum over
j != y of exp(x_j - x_y), for rows whose target is the max).

    python bench/collapse_plot.py --out DIR      (CUDA for Liger; CPU otherwise)

writes DIR/collapse.png and DIR/collapse.csv. An error of 1 means the value
read 0: the collapse.
"""
import argparse
import csv
import os

import numpy as np
import torch
import torch.nn.functional as F

import lmloss.torch as lt

V = 32000


def reference(x64, y):
    """loss and dloss/dx_y per row, float64, collapse-free."""
    others = x64.clone()
    others[torch.arange(len(y)), y] = -torch.inf
    xy = x64[torch.arange(len(y)), y]
    r = torch.exp(others - xy[:, None]).sum(-1)  # the target is each row's max
    return torch.log1p(r), -r / (1 + r)


def loss_and_grad(fn, x, y):
    xg = x.detach().clone().requires_grad_(True)
    loss = fn(xg, y)
    loss.sum().backward()
    return loss.detach().double(), xg.grad[torch.arange(len(y)), y].double()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    margins = np.arange(0, 101, 2)
    gen = torch.Generator().manual_seed(0)
    base = torch.rand(len(margins), V, generator=gen, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, V, (len(margins),), generator=gen)
    base[torch.arange(len(y)), y] = 1.0 + torch.tensor(margins, dtype=torch.float64)
    impls = {"PyTorch": lambda x, t: F.cross_entropy(x.float(), t, reduction="none"),
             "lmloss": lambda x, t: lt.cross_entropy(x, t, reduction="none")}
    if dev == "cuda":
        try:
            from liger_kernel.transformers import LigerCrossEntropyLoss
            impls["Liger-Kernel"] = LigerCrossEntropyLoss(reduction="none")
        except ImportError:
            pass
    rows = []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for dtype, style in [(torch.float32, "-"), (torch.bfloat16, "--")]:
        x = base.to(dtype)
        ref_loss, ref_grad = reference(x.double(), y)  # same rounded inputs
        for name, fn in impls.items():
            loss, grad = loss_and_grad(fn, x.to(dev), y.to(dev))
            el = ((loss.cpu() - ref_loss).abs() / ref_loss.abs()).clamp(1e-12, 1).numpy()
            eg = ((grad.cpu() - ref_grad).abs() / ref_grad.abs()).clamp(1e-12, 1).numpy()
            tag = f"{name} {'fp32' if dtype == torch.float32 else 'bf16'}"
            axes[0].plot(margins, el, style, label=tag)
            axes[1].plot(margins, eg, style, label=tag)
            rows += [dict(impl=name, dtype=str(dtype).split(".")[1], margin=int(m), loss_rel_err=a,
                          grad_rel_err=b) for m, a, b in zip(margins, el, eg)]
    for ax, what in zip(axes, ["loss", "gradient of the target logit"]):
        ax.set_yscale("log")
        ax.set_xlabel("target margin (logit units)")
        ax.set_ylabel(f"relative error of the {what}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"softmax collapse, V = {V} ({'GPU' if dev == 'cuda' else 'CPU'}); "
                 "1 = the value read 0")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "collapse.png"), dpi=110)
    with open(os.path.join(args.out, "collapse.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    print("wrote", os.path.join(args.out, "collapse.png"))


if __name__ == "__main__":
    main()
