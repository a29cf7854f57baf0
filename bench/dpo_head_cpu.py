"""lmloss's DPO through the fused head on the CPU against the log-probs op
it sits on, same process (issue 38's CPU target: within 10% of it).

Times (best of REPS after a warm-up), in ms, forward and backward with
dhidden and dW, for P pairs of T-token completions, fp32 hidden [2P, T, H]
and head [V, H]:
  log_probs   lmloss.torch.linear_log_probs (the op the objective sits on)
  fused       lmloss.torch.linear_dpo_loss (sigmoid, reference sums)
  composite   linear_log_probs, the sequences' sums, then dpo_loss
Run on an otherwise idle machine (2 cores: any load shows at once).

  python bench/dpo_head_cpu.py [P T H V] [--threads N]
"""

import argparse

import torch

import lmloss.torch as lt
from divergence_cpu import best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[2, 256, 512, 32000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    p, t, h, v = a.shape
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(2 * p, t, h, generator=g)
    w = torch.randn(v, h, generator=g) / h ** 0.5
    ids = torch.randint(0, v, (2 * p, t), generator=g)
    rc, rr = torch.randn(p, generator=g) - 10 * t, torch.randn(p, generator=g) - 10 * t

    def leaves():
        return hid.clone().requires_grad_(), w.clone().requires_grad_()

    def log_probs():
        x, y = leaves()
        lt.linear_log_probs(x.reshape(-1, h), y, ids.reshape(-1)).sum().backward()

    def fused():
        x, y = leaves()
        lt.linear_dpo_loss(x, y, ids, None, rc, rr).backward()

    def composite():
        x, y = leaves()
        s = lt.linear_log_probs(x.reshape(-1, h), y, ids.reshape(-1)).reshape(2 * p, t).sum(-1)
        lt.dpo_loss(s[:p], s[p:], rc, rr).backward()

    print("P=%d T=%d H=%d V=%d fp32, ms (best of %d)" % (p, t, h, v, a.reps))
    base = best(log_probs, a.reps)
    print("  log_probs  %8.1f" % base)
    for name, fn in (("fused", fused), ("composite", composite)):
        ms = best(fn, a.reps)
        print("  %-10s %8.1f  %.2fx the log-probs op" % (name, ms, ms / base))


if __name__ == "__main__":
    main()
