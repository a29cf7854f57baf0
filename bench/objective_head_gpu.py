"""Issue 38's head targets: GRPO and DPO through the fused head against their peers.

bf16 hidden [N, H] and head [V, H] (H 4096, V 152064), dhidden and dW
produced, every implementation through its users' entry point, in one
process on the same tensors. The limit is the same three GEMMs alone
(torch.matmul: the logits, dhidden, dW), timed in the same run.

GRPO (--case grpo): B = 8 completions of T = 1024 tokens (N = 8192), TRL's
dapo loss with beta 0.04 (the k3 KL to reference log-probs), old
log-probs, advantages [B], a completion mask with ragged ends; the
policy's entropies computed (TRL logs them; its top-entropy mask reads
them), without a gradient.
  lmloss        lmloss.torch.linear_log_probs(entropy=True) then
                lmloss.torch.grpo_loss (its kept log-probs: three GEMMs);
                at memory_budget=256 MiB, the backward that recomputes
  torch         TRL's own path: the logits materialized, log-softmax at
                the tokens, the entropy under no_grad, the dapo formula
  liger         Liger-Kernel's LigerFusedLinearGRPOLoss (what TRL's
                use_liger_kernel=True calls)
DPO (--case dpo): 4 pairs of 2048-token chosen and rejected completions
(N = 16384), the sigmoid loss on sequence log-prob sums against
precomputed reference sums.
  lmloss pairs  lmloss.torch.linear_dpo_loss: the fused DPO head, a group
                of whole pairs at a time (default budget: groups of one
                pair; "4 GiB": of two, one fp32 read-modify-write of dW's
                sum where the default has three)
  lmloss        linear_log_probs then lmloss.torch.dpo_loss (default
                budget; and with a budget that holds the store of all rows)
  torch         the logits materialized, log-softmax at the tokens
  liger         LigerFusedLinearDPOLoss (use_ref_model=False: it takes no
                reference sums, so its loss is the reference-free form)

    python bench/objective_head_gpu.py [--case grpo,dpo] [--reps 5]
"""
import argparse

import torch
import torch.nn.functional as F

import lmloss.torch as lt
from gpu_timing import peak_mib, timed

H, V = 4096, 152064


def tokens(b, t, gen):
    """hidden [b * t, H], head [V, H] (bf16, peaked rows: each token's
    logit lifted 0-15 above its row's max), token ids [b, t]."""
    x = torch.randn(b * t, H, device="cuda", generator=gen) / H ** 0.5
    w = torch.randn(V, H, device="cuda", generator=gen) / H ** 0.5
    y = torch.randint(0, V, (b * t,), device="cuda", generator=gen)
    lift = torch.rand(b * t, device="cuda", generator=gen) * 15
    for i in range(0, b * t, 1024):
        z = x[i:i + 1024] @ w.T
        need = z.max(1).values - z.gather(1, y[i:i + 1024, None])[:, 0] + lift[i:i + 1024]
        wy = w[y[i:i + 1024]]
        x[i:i + 1024] += (need / wy.pow(2).sum(1))[:, None] * wy
    return x.bfloat16(), w.bfloat16(), y.reshape(b, t)


def torch_logps(h, w, y, entropy=False):
    """TRL's path: the logits, log-softmax at the tokens (and the entropy
    under no_grad)."""
    z = (h @ w.T).float()
    lp = z.log_softmax(-1).gather(-1, y.reshape(-1, 1))[:, 0].reshape(y.shape)
    if not entropy:
        return lp
    with torch.no_grad():
        p = z.softmax(-1)
        ent = -(p * z.log_softmax(-1)).sum(-1).reshape(y.shape)
    return lp, ent


def dapo(lp, old, ref, adv, mask, beta=0.04, eps=0.2):
    """TRL's dapo loss with the k3 KL (GRPOTrainer._compute_loss)."""
    ratio = torch.exp(lp - old)
    a = adv[:, None]
    per = -torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    per = per + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    return (per * mask).sum() / mask.sum().clamp(min=1)


def grpo_impls(b, t, gen):
    adv = torch.randn(b, device="cuda", generator=gen)
    mask = torch.ones(b, t, device="cuda")
    for i in range(b):  # ragged completion ends
        mask[i, int(t * (0.5 + 0.5 * i / b)):] = 0

    def extra(h, w, y):  # old and reference log-probs near the policy's
        with torch.no_grad():
            lp = torch.cat([torch_logps(h[i:i + 1024], w, y.reshape(-1)[i:i + 1024])
                            for i in range(0, h.shape[0], 1024)]).reshape(y.shape)
        noise = lambda: 0.05 * torch.randn(lp.shape, device="cuda", generator=gen)
        return lp + noise(), lp + noise()

    def lmloss_grpo(budget):
        def run(h, w, y, old, ref):
            lp, ent = lt.linear_log_probs(h, w, y.reshape(-1), entropy=True,
                                          memory_budget=budget)
            return lt.grpo_loss(lp.reshape(b, t), adv, mask, old, ref,
                                ent.detach().reshape(b, t), loss_type="dapo", beta=0.04)
        return run

    def torch_grpo(h, w, y, old, ref):
        lp, _ = torch_logps(h, w, y, entropy=True)
        return dapo(lp, old, ref, adv, mask)

    out = {"lmloss": lmloss_grpo(None), "lmloss 256 MiB": lmloss_grpo(256 << 20),
           "torch": torch_grpo}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        lg = LigerFusedLinearGRPOLoss(beta=0.04, loss_type="dapo", use_ref_model=True)
        out["liger"] = lambda h, w, y, old, ref: lg(h.reshape(b, t, -1), w, y, mask, adv,
                                                     ref_per_token_logps=ref,
                                                     old_per_token_logps=old)[0]
    except ImportError:
        pass
    return out, extra


def dpo_impls(b, t, gen):
    ref = torch.randn(2 * b, device="cuda", generator=gen) * 10 - 2000

    def extra(h, w, y):
        return ref[:b], ref[b:]

    def sums(lp):
        s = lp.sum(-1)
        return s[:b], s[b:]

    def lmloss_dpo(budget):
        def run(h, w, y, rc, rr):
            c, r = sums(lt.linear_log_probs(h, w, y.reshape(-1), memory_budget=budget)
                        .reshape(y.shape))
            return lt.dpo_loss(c, r, rc, rr)
        return run

    def torch_dpo(h, w, y, rc, rr):
        c, r = sums(torch_logps(h, w, y))
        return -F.logsigmoid(0.1 * ((c - rc) - (r - rr))).mean()

    def lmloss_pairs(budget):
        def run(h, w, y, rc, rr):
            return lt.linear_dpo_loss(h.reshape(2 * b, t, -1), w, y, None, rc, rr,
                                      memory_budget=budget)
        return run

    store = 2 * 2 * b * t * (V + H) + (1 << 30)  # the store of all rows and room beside it
    out = {"lmloss pairs": lmloss_pairs(None), "pairs 4 GiB": lmloss_pairs(4 << 30),
           "lmloss": lmloss_dpo(None),
           "lmloss kept": lmloss_dpo(store), "torch": torch_dpo}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
        ld = LigerFusedLinearDPOLoss(use_ref_model=False)
        out["liger"] = lambda h, w, y, rc, rr: ld(w, h.reshape(2 * b, t, -1), y)[0]
    except ImportError:
        pass
    return out, extra


def gemms(h, w):
    dl = torch.randn(h.shape[0], w.shape[0], device="cuda", dtype=h.dtype)

    def run():
        h @ w.T
        dl @ w
        dl.T @ h
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="grpo,dpo")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in a.case.split(","):
        b, t = (8, 1024) if case == "grpo" else (4, 2048)
        rows = b * t if case == "grpo" else 2 * b * t
        h, w, y = tokens(rows // t, t, gen)
        impls, extra = grpo_impls(b, t, gen) if case == "grpo" else dpo_impls(b, t, gen)
        args = extra(h, w, y)
        limit = timed(gemms(h, w), a.reps)[0]
        print(f"\n{case}: {torch.cuda.get_device_name()}, N {rows} H {H} V {V} bf16, peaked rows;"
              f" three GEMMs {limit:.2f} ms")
        ref = None
        for name, fn in impls.items():
            def run():
                hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
                fn(hl, wl, y, *args).backward()
                return hl.grad
            try:
                med, lo, hi = timed(run, a.reps)
                mib = peak_mib(run)
                dh = run().float()
                ref = dh if ref is None else ref
                err = ((dh - ref).norm() / ref.norm()).item()
                print(f"  {name:12s} {med:8.2f} ms ({lo:.2f}-{hi:.2f}) {med / limit:5.2f}x GEMMs "
                      f"{mib:8.0f} MiB  dh err vs lmloss {err:.2e}", flush=True)
            except Exception as e:  # a peer that cannot run this shape
                print(f"  {name:12s} {type(e).__name__}: {str(e)[:120]}")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
