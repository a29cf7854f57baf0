"""Issue 38's logits target: GRPO forward + backward on logits against its peers.

bf16 logits [B, T, V] (8 x 1024 x 152064 by default), completion ids, a
ragged completion mask, old and reference log-probs, advantages [B];
TRL's dapo loss with beta 0.04 (the k3 KL), temperature 0.9; the logits'
gradient produced. Every implementation in one process on the same
tensors:

  lmloss            lmloss.torch.grpo_loss_on_logits (one pass: the
                    logits read once, their gradient written once)
  lmloss 2 passes   lmloss.torch.log_probs then grpo_loss (the log-probs'
                    forward, then their backward from saved statistics)
  liger             Liger-Kernel's triton_grpo_loss (its Triton GRPO loss,
                    on logits with the extra last position it drops)
  torch             TRL's own path in eager torch: log_softmax at the
                    tokens, the dapo formula
  ce-same-rows      not GRPO: lmloss.torch.cross_entropy on the same
                    logits and temperature, the plain CE row op GRPO's pass
                    is built on, in the same harness (the rows' own cost)

The limit is the copy bandwidth measured in the same run (a device-to-
device copy of the logits), against two byte counts: the logits read once
and their gradient written once ("of copy"), and the bytes the op must
move ("of its bytes"): a masked token's gradient row is written (zeros)
but its logits need not be read, as neither lmloss's one pass nor
Liger-Kernel's reads them. --mask full masks no token, so that every row
is read. Time: median of --reps CUDA-event
samples of 5 forward + backward calls queued back to back after a
warm-up, so that each call's host work overlaps the device work of the
one before, as in a training step (the other GPU benchmarks' timing).

    python bench/grpo_logits_gpu.py [--b 8] [--t 1024] [--v 152064] [--reps 9]
        [--impls lmloss,liger,...] [--mask ragged|full] [--profile]
"""
import argparse

import torch

import lmloss.torch as lt
from gpu_timing import timed
from objective_head_gpu import dapo

TEMP, BETA, EPS = 0.9, 0.04, 0.2


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=8)
    ap.add_argument("--t", type=int, default=1024)
    ap.add_argument("--v", type=int, default=152064)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--profile", action="store_true",
                    help="the kernels of one call of lmloss and of ce-same-rows")
    ap.add_argument("--impls", default="", help="comma-separated names to run (default: all)")
    ap.add_argument("--mask", choices=("ragged", "full"), default="ragged",
                    help="ragged: sequence i's first (0.5 + 0.5 i / B) T tokens unmasked; "
                         "full: every token")
    a = ap.parse_args()
    b, t, v = a.b, a.t, a.v
    gen = torch.Generator(device="cuda").manual_seed(0)
    # the extra last position is Liger's input layout; the others take [:, :-1]
    full = torch.randn(b, t + 1, v, device="cuda", generator=gen).bfloat16()
    x = full[:, :-1].contiguous()
    tok = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    mask = torch.ones(b, t, device="cuda")
    for i in range(b if a.mask == "ragged" else 0):
        mask[i, int(t * (0.5 + 0.5 * i / b)):] = 0
    adv = torch.randn(b, device="cuda", generator=gen)
    with torch.no_grad():
        lp0 = torch.cat([(x[i].float() / TEMP).log_softmax(-1).gather(-1, tok[i, :, None])[:, 0]
                         [None] for i in range(b)])
    old = lp0 + 0.05 * torch.randn(b, t, device="cuda", generator=gen)
    ref = lp0 + 0.05 * torch.randn(b, t, device="cuda", generator=gen)

    def lmloss_one(xl):
        return lt.grpo_loss_on_logits(xl, tok, adv, mask, old, ref, temperature=TEMP, beta=BETA)

    def lmloss_two(xl):
        lp = lt.log_probs(xl.reshape(-1, v), tok.reshape(-1), temperature=TEMP).reshape(b, t)
        return lt.grpo_loss(lp, adv, mask, old, ref, beta=BETA)

    def torch_eager(xl):
        lp = (xl.float() / TEMP).log_softmax(-1).gather(-1, tok[..., None])[..., 0]
        return dapo(lp, old, ref, adv, mask, BETA, EPS)

    def ce_same_rows(xl):
        return lt.cross_entropy(xl.reshape(-1, v), tok.reshape(-1), temperature=TEMP)

    impls = {"lmloss": (lmloss_one, False), "lmloss 2 passes": (lmloss_two, False),
             "torch": (torch_eager, False), "ce-same-rows": (ce_same_rows, False)}
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        def liger(xl):
            return triton_grpo_loss(xl, old, ref, tok, adv, mask, temperature=TEMP, beta=BETA,
                                    eps_low=EPS, eps_high=EPS, inplace=False, loss_type="dapo",
                                    reduce=True)[0]
        impls["liger"] = (liger, True)
    except ImportError:
        pass

    if a.impls:
        impls = {k: f for k, f in impls.items() if k in a.impls.split(",")}
    dst = torch.empty_like(x)
    floor = timed(lambda: dst.copy_(x), a.reps, queued=5)[0]  # the logits read once and written once
    bw = 2 * x.numel() * x.element_size() / (floor * 1e-3)
    unmasked = (mask != 0).float().mean().item()
    floor_own = floor * (1 + unmasked) / 2  # every gradient row written, the unmasked rows read
    print(f"{torch.cuda.get_device_name()}, B {b} T {t} V {v} bf16, dapo beta {BETA} T {TEMP}, "
          f"{unmasked:.1%} of tokens unmasked; copy {bw / 1e9:.0f} GB/s, floor (logits read + "
          f"gradient written) {floor:.3f} ms, of its bytes {floor_own:.3f} ms")
    ref_grad = None
    for name, (fn, whole) in impls.items():
        def run():
            xl = (full if whole else x).detach().requires_grad_()
            fn(xl).backward()
            return xl.grad[:, :t] if whole else xl.grad
        try:
            med, lo, hi = timed(run, a.reps, queued=5)
            err = ""
            if name != "ce-same-rows":  # not GRPO: its gradient is not comparable
                g = run().float()
                ref_grad = g if ref_grad is None else ref_grad
                err = f" grad err vs lmloss {((g - ref_grad).norm() / ref_grad.norm()).item():.2e}"
            print(f"  {name:16s} {med:7.3f} ms ({lo:.3f}-{hi:.3f})  {floor / med:6.1%} of copy, "
                  f"{floor_own / med:6.1%} of its bytes{err}", flush=True)
        except Exception as e:  # a peer that cannot run here
            print(f"  {name:16s} {type(e).__name__}: {str(e)[:120]}")
        torch.cuda.empty_cache()
    for fn in (lmloss_one, ce_same_rows) if a.profile else ():
        xl = x.detach().requires_grad_()
        fn(xl).backward()
        xl.grad = None  # else the profiled backward adds into it: a pass over N x V of its own
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn(xl).backward()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
