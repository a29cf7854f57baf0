"""The divergences on one GPU against their limits and the peers, one run.

logits  KL, reverse KL, generalized JSD (beta 0.5) and TVD forward +
        backward (a scalar loss, the student's gradient produced) on bf16
        logits [N, V], through lmloss.torch; the limit is the copy time of
        the bytes the op must move (read both rows, write the gradient) at
        the device-to-device copy bandwidth measured in this run. Peers:
        TRL's GKDTrainer.generalized_jsd_loss (beta 0, 0.5, 1) and
        Liger-Kernel's LigerJSD (on log_softmax of both, as its users call
        it), LigerKLDIVLoss and LigerTVDLoss, where importable.
heads   the seed's two fused heads: bf16 student hidden [N, Hs] and head
        [V, Hs], teacher [N, Ht] and [V, Ht], generalized JSD at beta 0,
        0.5 and 1, the student's head trainable and frozen, through
        lmloss.torch.linear_generalized_jsd; the limit is the same GEMMs run
        alone (torch.matmul: both heads' logits, dhidden, and dW when the
        head trains). Peers: Liger-Kernel's LigerFusedLinearJSD and TRL's
        dense loss on materialized logits. Peak memory beyond the inputs,
        and the student's dhidden error (relative Frobenius norm) against a
        float64 computation from the same bf16 values.
Rows: "random" (normal logits; heads with normal weights / sqrt(H)) and
"peaked" like a trained model's (each row's argmax lifted 0-15 above the
rest, the teacher's on the same column). Time: median of CUDA-event
samples of 5 calls queued back to back.

    python bench/divergence_gpu.py [--rows N] [--vocab V] [--trl-jsd FILE]
                                   [--skip-logits] [--skip-heads]

--trl-jsd: a file defining generalized_jsd_loss (TRL's function), for a
machine where TRL's own dependencies are not installed.
"""
import argparse
import importlib.util

import torch

import lmloss.torch as lt
from peers_gpu import DEV, copy_gbs, peak_mib, timed


def trl_jsd(path):
    try:
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
        return GKDTrainer.generalized_jsd_loss
    except ImportError:
        if not path:
            return None
    spec = importlib.util.spec_from_file_location("trl_jsd", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.generalized_jsd_loss


def liger():
    try:
        import liger_kernel.transformers as lk
        return lk
    except ImportError:
        return None


def peaked_(z, g):
    """Lift each row's argmax 0-15 above the rest (in place)."""
    a = z.argmax(-1, keepdim=True)
    lift = torch.rand(z.shape[0], 1, device=DEV, generator=g) * 15
    top = z.gather(-1, a)
    second = z.scatter(-1, a, -float("inf")).max(-1, keepdim=True)[0]
    return z.scatter_(-1, a, torch.maximum(top, second + lift))


def logits_rows(n, v, kind, g):
    s = torch.randn(n, v, device=DEV, generator=g) * 2
    t = s + torch.randn(n, v, device=DEV, generator=g)
    if kind == "peaked":
        a = s.argmax(-1, keepdim=True)
        peaked_(s, g)
        t.scatter_(-1, a, s.gather(-1, a) + 1.0)
    return s.bfloat16(), t.bfloat16()


def fwd_bwd(loss_fn, s, t):
    x = s.clone().requires_grad_()

    def run():
        x.grad = None
        loss_fn(x, t).backward()
    return run


def bench_logits(n, v, trl, lk, bw):
    g = torch.Generator(device=DEV).manual_seed(0)
    limit = 3 * n * v * 2 / (bw * 1e6)  # read both rows, write the gradient (bf16)
    ours = {"kl": lambda x, t: lt.kl_div(x, t),
            "reverse_kl": lambda x, t: lt.kl_div(x, t, reverse=True),
            "jsd-0.5": lambda x, t: lt.generalized_jsd(x, t, beta=0.5),
            "tvd": lambda x, t: lt.tvd(x, t)}
    peers = {}
    if trl:
        for name, beta in (("kl", 0.0), ("reverse_kl", 1.0), ("jsd-0.5", 0.5)):
            peers.setdefault(name, []).append(
                ("TRL", lambda x, t, b=beta: trl(x, t, beta=b)))
    if lk:
        for name, beta in (("kl", 0.0), ("reverse_kl", 1.0), ("jsd-0.5", 0.5)):
            jsd = lk.LigerJSD(beta=beta)
            peers.setdefault(name, []).append(
                ("Liger", lambda x, t, f=jsd: f(torch.log_softmax(x.float(), -1),
                                                torch.log_softmax(t.float(), -1))))
        tvd = lk.LigerTVDLoss(reduction="batchmean")
        peers.setdefault("tvd", []).append(
            ("Liger", lambda x, t: tvd(torch.softmax(x.float(), -1),
                                       torch.softmax(t.float(), -1))))
    print(f"logits bf16 {n} x {v}: limit {limit:.3f} ms (copy {bw:.0f} GB/s, 3 N V x 2 bytes)")
    for rows in ("random", "peaked"):
        s, t = logits_rows(n, v, rows, g)
        for name, fn in ours.items():
            ms = timed(fwd_bwd(fn, s, t), 10, queued=5)[0]
            line = f"  {rows:6} {name:10} lmloss {ms:7.3f} ms = {limit / ms:5.1%} of copy"
            for pname, pfn in peers.get(name, []):
                try:
                    pms = timed(fwd_bwd(pfn, s, t), reps=5, queued=5)[0]
                    line += f" | {pname} {pms:7.3f} ms ({pms / ms:4.1f}x)"
                except torch.OutOfMemoryError:
                    line += f" | {pname} out of memory"
                    torch.cuda.empty_cache()
            print(line, flush=True)
        del s, t
        torch.cuda.empty_cache()


def heads(n, hs, ht, v, rows, g):
    h_s = torch.randn(n, hs, device=DEV, generator=g)
    h_t = torch.randn(n, ht, device=DEV, generator=g)
    w_s = torch.randn(v, hs, device=DEV, generator=g) / hs ** 0.5
    w_t = torch.randn(v, ht, device=DEV, generator=g) / ht ** 0.5
    if rows == "peaked":  # each row's target column of W pointed along its hidden state
        y = torch.randint(0, v, (n,), device=DEV, generator=g)
        lift = torch.rand(n, 1, device=DEV, generator=g) * 15 + 5
        w_s[y] += lift * h_s / h_s.pow(2).sum(-1, keepdim=True)
        w_t[y] += (lift + 1) * h_t / h_t.pow(2).sum(-1, keepdim=True)
    return [x.bfloat16() for x in (h_s, w_s, h_t, w_t)]


def jsd64(h_s, w_s, h_t, w_t, beta):
    """The float64 loss (batchmean) and dhidden from the same bf16 values."""
    hs = h_s.double().requires_grad_()
    lp = torch.log_softmax(hs @ w_s.double().T, -1)
    lq = torch.log_softmax(h_t.double() @ w_t.double().T, -1)
    if beta == 0:
        loss = (lq.exp() * (lq - lp)).sum()
    elif beta == 1:
        loss = (lp.exp() * (lp - lq)).sum()
    else:
        lm = torch.logsumexp(torch.stack([lp + torch.log1p(torch.tensor(-beta, dtype=lp.dtype)),
                                          lq + torch.log(torch.tensor(beta, dtype=lp.dtype))]), 0)
        loss = (beta * lq.exp() * (lq - lm) + (1 - beta) * lp.exp() * (lp - lm)).sum()
    loss = loss / h_s.shape[0]
    loss.backward()
    return hs.grad


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def gemm_ms(h_s, w_s, h_t, w_t, train):
    """Both heads' logits, dhidden, and dW when the head trains, alone."""
    a = torch.empty(h_s.shape[0], w_s.shape[0], device=DEV, dtype=torch.bfloat16)

    def gemms():
        torch.matmul(h_s, w_s.T, out=a)
        torch.matmul(h_t, w_t.T, out=a)
        torch.matmul(a, w_s)
        if train:
            torch.matmul(a.T, h_s)
    return timed(gemms, 10, queued=5)[0]


def bench_heads(n, hs, ht, v, trl, lk):
    g = torch.Generator(device=DEV).manual_seed(1)
    print(f"two fused heads bf16: N {n}, Hs {hs}, Ht {ht}, V {v}")
    for rows in ("random", "peaked"):
        h_s, w_s, h_t, w_t = heads(n, hs, ht, v, rows, g)
        for train in (True, False):
            limit = gemm_ms(h_s, w_s, h_t, w_t, train)
            for beta in (0.0, 0.5, 1.0):
                impls = [("lmloss", lambda x, w, beta=beta: lt.linear_generalized_jsd(
                    x, w, h_t, w_t, beta=beta))]
                if lk:
                    f = lk.LigerFusedLinearJSD(jsd_beta=beta)
                    impls.append(("Liger", lambda x, w, f=f: f(x, w, h_t, w_t, None)))
                if trl:
                    impls.append(("TRL", lambda x, w, beta=beta: trl(
                        x @ w.T, h_t @ w_t.T, beta=beta)))
                want = jsd64(h_s, w_s, h_t, w_t, beta)
                line = f"  {rows:6} {'trainable' if train else 'frozen':9} beta {beta:3}: " \
                       f"GEMMs {limit:6.2f} ms"
                for name, fn in impls:
                    x = h_s.clone().requires_grad_()
                    w = w_s.clone().requires_grad_(train)

                    def run():
                        x.grad = w.grad = None
                        fn(x, w).backward()
                    try:
                        ms = timed(run, reps=5, queued=5)[0]
                        mib = peak_mib(run)
                        err = rel_err(x.grad, want)
                        line += f" | {name} {ms:6.2f} ms ({ms / limit:4.2f}x) " \
                                f"{mib:6.0f} MiB err {err:.1e}"
                    except torch.OutOfMemoryError:
                        line += f" | {name} out of memory"
                    torch.cuda.empty_cache()
                print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--trl-jsd", default=None)
    ap.add_argument("--skip-heads", action="store_true")
    ap.add_argument("--skip-logits", action="store_true")
    args = ap.parse_args()
    trl, lk = trl_jsd(args.trl_jsd), liger()
    bw = copy_gbs()
    print(f"device {torch.cuda.get_device_name()}; TRL {'yes' if trl else 'no'}, "
          f"Liger-Kernel {'yes' if lk else 'no'}", flush=True)
    if not args.skip_logits:
        bench_logits(args.rows, args.vocab, trl, lk, bw)
    if not args.skip_heads:
        bench_heads(2048, 2048, 2560, 151936, trl, lk)


if __name__ == "__main__":
    main()
