"""Peer benchmarks on one GPU, side by side in one run.

lmloss against PyTorch eager, torch.compile (of the same fp32 formulas),
Liger-Kernel and cut-cross-entropy (and QuACK for the fused head), on five cases:

  logprob    log-probs forward, K = 1 (TRL's selective_log_softmax), bf16 logits
  logprob-grad  log-probs forward + backward (dlogits produced) of GRPO's token
             loss -A exp(logp - sg(logp)), bf16 logits; Liger-Kernel's GRPO
             loss kernel on the same logits (its forward saves the lse)
  ce         cross-entropy forward + backward on bf16 logits (dlogits produced)
  linear-ce  fused-head cross-entropy forward + backward, bf16 hidden and head,
             H = 4096 (dhidden and dW produced)
  linear-logprob-grad  GRPO's token loss (as logprob-grad) through the fused
             head, same shapes as linear-ce (dhidden and dW produced)

over vocabulary sizes 32k-262k (N = 4096) and N from 1k to 32k (V = 152064).
Time: median of 10 CUDA-event samples after a warm-up, each over 5 calls queued
back to back (per call); memory: peak allocated
during one forward+backward beyond what was allocated before it: the
inputs and, with a backward, the previous call's gradients, which the call
frees before it makes its own (fused_head_gpu.py counts the gradients).
The hardware limit drawn with them: the copy time of the bytes the op must
move (logits ops; device-to-device copy bandwidth measured in this run) or
the time of the three GEMMs alone (fused head; torch.matmul in bf16).

    python bench/peers_gpu.py --out DIR [--quick]
    python bench/peers_gpu.py --out DIR --plot-only DIR/peers.csv --device-name NAME

writes DIR/peers.csv and DIR/peers_<case>.png (time and memory vs V and vs N);
--plot-only redraws the figures from a CSV (no GPU needed).
"""
import argparse
import csv
import os

import torch
import torch.nn.functional as F

import lmloss.torch as lt
from fused_head_gpu import gemms, impls as head_impls, rows as head_rows
from gpu_timing import peak_mib, timed

DEV = "cuda"
H = 4096
VOCABS = [32768, 65536, 131072, 152064, 262144]
ROWS = [1024, 2048, 4096, 8192, 16384, 32768]


def copy_gbs():
    a = torch.empty(2**31, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), 20, queued=5)[0]
    return 2 * a.numel() / (ms * 1e6)


# ---- implementations: each returns a zero-argument callable ----------------

def logprob_impls():
    def eager(x, y):
        return lambda: x.float().log_softmax(-1).gather(-1, y[:, None])

    comp = torch.compile(lambda x, y: x.float().log_softmax(-1).gather(-1, y[:, None]),
                         dynamic=True)
    impls = {"lmloss": lambda x, y: (lambda: lt.log_probs(x, y)),
             "torch": eager, "torch.compile": lambda x, y: (lambda: comp(x, y))}
    try:
        from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

        def liger(x, y):
            x3 = torch.cat([x, x[:1]])[None]  # Liger reads L + 1 positions
            return lambda: fused_selective_log_softmax(x3, y[None], temperature=1.0)
        impls["liger"] = liger
    except ImportError:
        pass
    return impls


def with_backward(loss_fn):
    """make(*tensors, y) -> run(): loss_fn forward and backward on leaf
    copies of the tensors (their gradients produced), targets y."""
    def make(*args):
        leaves = [t.detach().requires_grad_(True) for t in args[:-1]]

        def run():
            for t in leaves:
                t.grad = None
            loss_fn(*leaves, args[-1]).backward()
        return run
    return make


_advantages = {}


def grpo(logp_fn):
    """GRPO's token loss -A exp(logp - sg(logp)) of logp_fn(*tensors, y),
    one advantage per row, drawn once per shape."""
    def loss(*args):
        y = args[-1]
        if y.shape not in _advantages:
            _advantages[y.shape] = torch.randn(y.shape, device=y.device)
        lp = logp_fn(*args)
        return -(_advantages[y.shape] * torch.exp(lp - lp.detach())).mean()
    return loss


def logprob_grad_impls():
    def torch_lp(x, y):
        return x.float().log_softmax(-1).gather(-1, y[:, None])[:, 0]

    comp = torch.compile(torch_lp, dynamic=True)
    impls = {"lmloss": with_backward(grpo(lambda x, y: lt.log_probs(x, y))),
             "torch": with_backward(grpo(torch_lp)), "torch.compile": with_backward(grpo(comp))}
    try:
        from liger_kernel.ops.grpo_loss import GrpoLossFunction

        def liger(x, y):
            x3 = torch.cat([x, x[:1]])[None].detach().requires_grad_(True)  # L + 1 positions
            adv = torch.randn(1, device=x.device)

            def run():
                x3.grad = None
                GrpoLossFunction.apply(x3, None, None, y[None], adv, None, 1.0, 0.0, 0.2, 0.2,
                                       False)[0].backward()
            return run
        impls["liger"] = liger
    except ImportError:
        pass
    return impls


def ce_impls():
    comp = torch.compile(lambda x, y: F.cross_entropy(x.float(), y), dynamic=True)
    impls = {"lmloss": with_backward(lambda x, y: lt.cross_entropy(x, y)),
             "torch": with_backward(lambda x, y: F.cross_entropy(x.float(), y)),
             "torch.compile": with_backward(comp)}
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
        impls["liger"] = with_backward(LigerCrossEntropyLoss())
    except ImportError:
        pass
    return impls


def linear_impls(compiled=True):
    """fused_head_gpu.py's implementations but the slowest (cut-cross-entropy's
    exact form) and main_grad's."""
    return {name: with_backward(fn) for name, fn in head_impls(compiled, None, True).items()
            if name != "cce-exact"}


def linear_logprob_grad_impls(compiled=True):
    def eager(h, w, y):
        return (h @ w.T).float().log_softmax(-1).gather(-1, y[:, None])[:, 0]
    impls = {"lmloss": with_backward(grpo(lambda h, w, y: lt.linear_log_probs(h, w, y))),
             "torch": with_backward(grpo(eager))}
    if compiled:
        impls["torch.compile"] = with_backward(grpo(torch.compile(eager, dynamic=True)))
    return impls


def gemm_ms(h, w, reps):
    """The fused head's limit: its three GEMMs alone (logits, dhidden, dW) in bf16."""
    return timed(gemms(h, w), reps, queued=5)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--issue", action="store_true",
                    help="only the issues' shapes (logits ops at 8192x152064 and 4096x32768; the "
                         "fused head at 8192x4096x152064, all rows and 25%% supervised, without "
                         "torch.compile), into peers-issue.csv, no plots")
    ap.add_argument("--case", action="append",
                    choices=["logprob", "logprob-grad", "ce", "linear-ce",
                             "linear-logprob-grad"],
                    help="only this case (repeatable; default: all five)")
    ap.add_argument("--rows", choices=["peers", "random", "peaked"], default="peers",
                    help="the fused head's rows (fused_head_gpu.py's kinds; default: h standard "
                         "normal, w times 0.02); other than peers, the files are named "
                         "peers-ROWS.csv and peers_CASE-ROWS.png")
    ap.add_argument("--only-n", type=int, metavar="N",
                    help="only the shapes with N rows (a point re-measured; no plots)")
    ap.add_argument("--plot-only", metavar="CSV")
    ap.add_argument("--device-name", default="")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.plot_only:
        with open(args.plot_only) as f:
            rows = [{k: (v if k in ("case", "sweep", "impl") else float(v)) for k, v in r.items()}
                    for r in csv.DictReader(f)]
        tag = "" if args.rows == "peers" else "-" + args.rows
        return plot(rows, args.out, args.device_name, tag)
    torch.manual_seed(0)
    reps = 5 if args.quick else 10
    bw = copy_gbs()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s", flush=True)
    rows_out = []
    tag = "" if args.rows == "peers" else "-" + args.rows
    csv_path = os.path.join(args.out, "peers-issue.csv" if args.issue else
                            f"peers{tag}-n{args.only_n}.csv" if args.only_n else f"peers{tag}.csv")
    cases = [("logprob", logprob_impls(), 1), ("logprob-grad", logprob_grad_impls(), 2),
             ("ce", ce_impls(), 2),
             ("linear-ce", linear_impls(compiled=not args.issue), 0),
             ("linear-logprob-grad", linear_logprob_grad_impls(compiled=not args.issue), 0)]
    cases = [c for c in cases if not args.case or c[0] in args.case]
    for case, impls, passes in cases:
        head = case.startswith("linear")
        sweeps = [("V", v, 4096) for v in VOCABS] + [("N", 152064, n) for n in ROWS]
        if args.issue:
            sweeps = ([("N", 152064, 8192), ("25% supervised", 152064, 8192)] if case == "linear-ce"
                      else [("N", 152064, 8192)] if head
                      else [("N", 152064, 8192), ("V", 32768, 4096)])
        for sweep, V, N in sweeps:
            if (head and N > 16384) or args.only_n not in (None, N):
                continue
            y = torch.randint(0, V, (N,), device=DEV)
            if sweep == "25% supervised":  # every fourth row supervised, the rest ignored
                y[torch.arange(N, device=DEV) % 4 != 3] = -100
            if head:
                gen = torch.Generator(device=DEV).manual_seed(0)
                h, w, y = head_rows(args.rows, N, H, V, 0.25 if sweep == "25% supervised" else 1.0,
                               gen)
                limit = gemm_ms(h, w, 3 if args.issue else reps)
                args_ = (h, w, y)
            else:
                x = torch.randn(N, V, device=DEV, dtype=torch.bfloat16) * 2
                limit = passes * x.numel() * 2 / (bw * 1e6)
                args_ = (x, y)
            for name, make in impls.items():
                try:
                    fn = make(*args_)
                    ms = timed(fn, 3 if head and args.issue else reps, queued=5)[0]
                    mib = peak_mib(fn)
                except Exception as e:  # a peer that cannot run this shape
                    print(f"  {case} {name} V={V} N={N}: {type(e).__name__}: {str(e)[:80]}")
                    ms = mib = float("nan")
                rows_out.append(dict(case=case, sweep=sweep, impl=name, N=N, V=V, ms=ms,
                                     peak_mib=mib, limit_ms=limit))
                print(f"{case:9s} {sweep} N={N:6d} V={V:6d} {name:18s} {ms:9.3f} ms "
                      f"{mib:9.1f} MiB  (limit {limit:.3f} ms)", flush=True)
            del args_
            torch.cuda.empty_cache()
            write_csv(rows_out, csv_path)  # after each shape: a cut-short run keeps what it took
    if not args.issue and args.only_n is None:
        plot(rows_out, args.out, torch.cuda.get_device_name(), tag)


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def plot(rows, out, device_name, tag=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for case in sorted({r["case"] for r in rows}):
        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        for col, (sweep, key) in enumerate([("V", "V"), ("N", "N")]):
            sel = [r for r in rows if r["case"] == case and r["sweep"] == sweep]
            for row, (metric, label) in enumerate([("ms", "time (ms)"),
                                                   ("peak_mib", "peak memory (MiB)")]):
                ax = axes[row][col]
                for impl in dict.fromkeys(r["impl"] for r in sel):
                    pts = [(r[key], r[metric]) for r in sel if r["impl"] == impl
                           and r[metric] == r[metric]]  # NaN: the peer could not run it
                    if not pts:
                        continue
                    ax.plot(*zip(*pts), marker="o", label=impl)
                if metric == "ms":
                    lim = sorted({(r[key], r["limit_ms"]) for r in sel})
                    ax.plot(*zip(*lim), "k--", label="hardware limit")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel(key)
                ax.set_ylabel(label)
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=7)
        fig.suptitle(f"{case} on {device_name}, bf16" + (f", {tag[1:]} rows" if tag else ""))
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"peers_{case}{tag}.png"), dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main()
