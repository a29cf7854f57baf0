"""TRL's fused LM head against lmloss's stand-in for it, the call each
trainer makes through add_fused_lm_head (forward, then the backward of the
log-probs' sum), on the same peaked rows.

  TRL       trl.kernels.chunked_logprob.ChunkedLogProbFunction (TRL's
            chunk of 32768 columns)
  lmloss    lmloss.integrations.trl.ChunkedLogProbFunction, what
            lmloss.integrations.trl.enable() puts in its place

Each trainer's outputs: SFT's and GRPO's (log-probs, entropy, top-1), DPO's
(and the mean logits; with WPO's use_weighting the log sum of squared
probabilities too), KTO's (log-probs, entropy, mean logits). Beside each
time, the call's peak memory beyond its inputs (gpu_timing.peak_mib, the
gradients included); beside lmloss's, the log-probs' largest difference
from TRL's (whose fp32 log p = target logit - log Z reads 0 on the
confident rows), the log sum p^2's and mean logits', top-1 agreement, and
dhidden's relative difference. Needs TRL and transformers importable (a
TRL wheel installed without its trainers' dependencies will do: the ZeRO-3
context its backward imports is then a null one); bf16, H 4096, V 152064
(objective_head_gpu's rows).

    python bench/trl_head_gpu.py [--rows 16384] [--reps 5]
"""
import argparse
import contextlib
import sys
import types

import torch
from gpu_timing import peak_mib, timed
from objective_head_gpu import H, V, tokens
from trl.kernels.chunked_logprob import ChunkedLogProbFunction as TrlHead

from lmloss.integrations.trl import ChunkedLogProbFunction as LmlossHead

try:  # TRL's backward imports its trainers' utilities for their ZeRO-3 gather
    import trl.trainer.utils  # noqa: F401
except ImportError:  # a TRL wheel without its trainers' dependencies (datasets)
    _utils = types.ModuleType("trl.trainer.utils")
    _utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
    sys.modules["trl.trainer.utils"] = _utils

CHUNK = 32768  # TRL's
OUTPUTS = {"SFT/GRPO": ("log_probs", "entropy", "is_top1"),
           "DPO": ("log_probs", "entropy", "mean_logits", "is_top1"),
           "DPO (WPO)": ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"),
           "KTO": ("log_probs", "entropy", "mean_logits")}


def compare(h, w, y, reps):
    """Each trainer's call through both heads, TRL's first."""
    for trainer, outputs in OUTPUTS.items():
        got = {}
        for name, head in (("TRL", TrlHead), ("lmloss", LmlossHead)):
            def run():
                hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
                r = head.apply(hl, wl, None, y, 1.0, CHUNK, None, 1.0, outputs)
                r[0].sum().backward()
                return r, hl.grad
            ms = timed(run, reps)[0]
            mib = peak_mib(run)
            got[name] = run()
            line = f"  {trainer:10s} {name:7s} {ms:9.2f} ms {mib:7.0f} MiB"
            if name == "lmloss":
                (t, tg), (m, mg) = got["TRL"], got["lmloss"]
                line += f"  log-probs max |diff| {(m[0] - t[0]).abs().max().item():.2e}"
                if m[2] is not None:
                    line += f", log sum p^2 {(m[2] - t[2]).abs().max().item():.2e}"
                if m[3] is not None:
                    line += f", mean logits {(m[3] - t[3]).abs().max().item():.2e}"
                if m[4] is not None:
                    line += f", top-1 agree {(m[4] == t[4]).float().mean().item():.4f}"
                line += f", dhidden rel {((mg - tg).float().norm() / tg.float().norm()).item():.2e}"
            print(line, flush=True)
        del got
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, w, y = tokens(a.rows // 1024, 1024, gen)
    print(f"{torch.cuda.get_device_name()}, N {a.rows} H {H} V {V} bf16, peaked rows")
    compare(h, w, y.reshape(-1), a.reps)


if __name__ == "__main__":
    main()
