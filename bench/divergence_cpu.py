"""lmloss's divergences on the CPU against their limit and TRL, same process.

Times (best of REPS after a warm-up, time.perf_counter), in ms, fp32 rows
[N, V] of normal logits for the student and an independent teacher:
  limit    lmloss.cross_entropy over both inputs stacked ([2N, V], forward
           only): one read + exp pass of the bytes a divergence must read
  lmloss   lmloss.divergence(s, t, kind, beta, grad=True): forward and the
           student's gradient (reduction "sum")
  TRL      trl's GKDTrainer.generalized_jsd_loss (beta 0 = KL, 1 = reverse
           KL, 0.5) and .backward(), eager torch, when TRL is installed
Run on an otherwise idle machine (2 cores: any load shows at once).

  python bench/divergence_cpu.py [N V] [--threads T]
"""

import argparse
import time
import warnings

import numpy as np

import lmloss


def best(f, reps):
    f()
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - t0)
    return 1e3 * t


def trl_loss():
    try:
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
        return GKDTrainer.generalized_jsd_loss
    except ImportError:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[16, 152064])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    n, v = a.shape
    rng = np.random.default_rng(0)
    s = rng.standard_normal((n, v), dtype=np.float32)
    t = rng.standard_normal((n, v), dtype=np.float32)
    both, y = np.concatenate([s, t]), np.zeros(2 * n, np.int64)
    kw = dict(backend="cpu", num_threads=a.threads)
    limit = best(lambda: lmloss.cross_entropy(both, y, **kw), a.reps)
    print(f"{n} x {v} fp32, limit (read + exp of both inputs) {limit:.2f} ms")
    trl = trl_loss()
    for kind, beta in [("kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5), ("tvd", None)]:
        ms = best(lambda: lmloss.divergence(s, t, kind=kind, beta=beta or 0.5, grad=True,
                                            reduction="sum", **kw), a.reps)
        peer = ""
        if trl is not None and beta is not None:
            import torch
            st, tt = torch.from_numpy(s), torch.from_numpy(t)

            def run():
                x = st.clone().requires_grad_()
                trl(x, tt, beta=beta).backward()
            peer = f", TRL {best(run, a.reps):.1f} ms"
        print(f"  {kind:10s} {ms:8.1f} ms = {ms / limit:5.1f}x the limit{peer}")


if __name__ == "__main__":
    main()
