"""lmloss's GRPO loss on the CPU against the log-probs op it sits on and
TRL's own loss, same process.

Times (best of REPS after a warm-up, time.perf_counter), in ms, for B
sequences of T tokens over a vocabulary of V (fp32 logits [B T, V]):
  log_probs  lmloss.torch.log_probs(logits, ids) forward and backward
             (the op the objective sits on)
  lmloss     lmloss.torch.grpo_loss on its per-token log-probs and
             entropies, forward and backward (loss type, beta and entropy
             options below)
  TRL        GRPOTrainer._compute_loss on the same tensors through
             tests/python/trl_grpo_oracle.py's stand-in self, forward and
             backward, when TRL is installed
Run on an otherwise idle machine (2 cores: any load shows at once).

  python bench/grpo_cpu.py [B T V] [--loss-type dapo] [--threads N]
"""

import argparse
import os
import sys

import torch

import lmloss.torch as lt
from divergence_cpu import best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[8, 1024, 4096])
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    b, t, v = a.shape
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b * t, v, generator=g)
    ids = torch.randint(0, v, (b * t,), generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.9).float()
    adv = torch.randn(b, generator=g)
    with torch.no_grad():
        lp0, ent0 = lt.log_probs(logits, ids, entropy=True)
    lp0, ent0 = lp0.reshape(b, t), ent0.reshape(b, t)
    old = lp0 + 0.05 * torch.randn(b, t, generator=g)
    ref = lp0 + 0.1 * torch.randn(b, t, generator=g)
    kw = dict(loss_type=a.loss_type, beta=0.04, entropy_coef=0.01, top_entropy_quantile=0.8,
              num_items=mask.sum())

    def log_probs():
        x = logits.clone().requires_grad_()
        lt.log_probs(x, ids).sum().backward()

    def ours():
        lp, ent = lp0.clone().requires_grad_(), ent0.clone().requires_grad_()
        lt.grpo_loss(lp, adv, mask, old, ref, ent, **kw).backward()

    print("B=%d T=%d V=%d loss_type=%s, ms (best of %d)" % (b, t, v, a.loss_type, a.reps))
    print("  log_probs fwd+bwd   %8.3f" % best(log_probs, a.reps))
    print("  lmloss grpo_loss    %8.3f" % best(ours, a.reps))
    try:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
        import trl_grpo_oracle as O
    except ImportError:
        return
    inp = O.inputs(mask, adv, old=old, ref=ref, num_items=mask.sum())
    cfg = dict(loss_type=a.loss_type, beta=0.04, entropy_coef=0.01, top_entropy_quantile=0.8)

    def trl():
        lp, ent = lp0.clone().requires_grad_(), ent0.clone().requires_grad_()
        O.trl_loss(lp, ent, inp, **cfg)[0].backward()

    print("  TRL _compute_loss   %8.3f" % best(trl, a.reps))


if __name__ == "__main__":
    main()
