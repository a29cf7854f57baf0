"""lmloss vs PyTorch on the CPU, fp32, per shape and thread count (1 and 2).

Times (median of REPS runs after a warm-up, time.perf_counter), in ms:
  limit     read every logit once + vectorized exp        `build/lmloss bench`
  lp C      lmloss_log_probs (K = 2) from C                `build/lmloss bench`
  lp py     lmloss.log_probs(x, idx)                        this process
  lp torch  torch.log_softmax(x, -1).gather(-1, idx[:, None])
  ce C      lmloss_cross_entropy fwd+bwd from C (label smoothing 0.1,
            z-loss 1e-4, 1 row in 5 ignored)               `build/lmloss bench`
  ce py     lmloss.cross_entropy(x, y, grad=True)           this process
  ce torch  F.cross_entropy(x, y) then loss.backward()      (x.grad reset)
Python and torch run the plain ops (K = 1, mean CE); the C options cost
lmloss the same to within noise. The ratios are torch / lmloss-through-
Python: same process, same arrays, and both allocate their outputs (dlogits,
x.grad) per call, while the C command writes into preallocated buffers (so
ce py - ce C is mostly the first touch of a fresh dlogits, not Python).
lmloss runs with backend="cpu", num_threads=t; torch with set_num_threads(t).
Without torch the torch columns stay empty. The machine must be otherwise
idle: with 2 cores, any other load shows up at once in the 2-thread rows.

  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2
  python -m pip install numpy torch     # PyPI's torch runs on the CPU
  python bench/bench_cpu_torch.py [--csv out.csv] [N V ...]
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
import lmloss  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    torch, TORCH_ERROR = None, e

REPS = 7
THREADS = (1, 2)
COLUMNS = ["shape", "thr", "limit", "lp C", "lp py", "lp torch", "torch/lm",
           "ce C", "ce py", "ce torch", "torch/lm"]


def median_ms(fn, reps=REPS):
    fn()  # warm-up
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(t)


def c_bench(cli, n, v, threads):
    """`lmloss bench logprob ce-grad` at one shape and thread count, as CSV;
    returns (limit, logprob, ce-grad) ms. The limit is the read+exp pass it
    measured beside logprob."""
    args = [cli, "bench", "logprob", "ce-grad", "--shape", "%d,%d" % (n, v),
            "--threads", str(threads), "--reps", str(REPS), "--csv"]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    rows = {r["op"]: r for r in csv.DictReader(out.splitlines())}
    return float(rows["logprob"]["limit"]), float(rows["logprob"]["ms"]), \
        float(rows["ce-grad"]["ms"])


def ratio(a, b):
    return None if a is None else a / b


def bench_shape(n, v, cli):
    rng = np.random.default_rng(7)
    x = rng.uniform(-2.0, 2.0, size=(n, v)).astype(np.float32)
    y = rng.integers(0, v, size=n, dtype=np.int64)
    if torch is not None:
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        tx_req = torch.from_numpy(x).requires_grad_(True)  # same memory
        ref = F.cross_entropy(tx, ty).item()
        got = lmloss.cross_entropy(x, y, backend="cpu")
        assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)

        def torch_ce():
            tx_req.grad = None
            F.cross_entropy(tx_req, ty).backward()

    for t in THREADS:
        shape = "%dx%d" % (n, v)
        limit, lp_c, ce_c = c_bench(cli, n, v, t)
        lp_py = median_ms(lambda: lmloss.log_probs(x, y, backend="cpu", num_threads=t))
        ce_py = median_ms(lambda: lmloss.cross_entropy(x, y, grad=True, backend="cpu",
                                                       num_threads=t))
        lp_t = ce_t = None
        if torch is not None:
            torch.set_num_threads(t)
            with torch.no_grad():
                lp_t = median_ms(lambda: torch.log_softmax(tx, -1).gather(-1, ty[:, None]))
            ce_t = median_ms(torch_ce)
        yield [shape, t, limit, lp_c, lp_py, lp_t, ratio(lp_t, lp_py),
               ce_c, ce_py, ce_t, ratio(ce_t, ce_py)]


def fmt(v):
    if v is None:
        return "-"
    return "%.2f" % v if isinstance(v, float) else str(v)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dims", nargs="*", type=int, help="N V pairs (default 4096 32768 1024 151936)")
    p.add_argument("--csv", metavar="PATH", help="also write the table as CSV")
    p.add_argument("--cli", default=os.path.join(ROOT, "build", "lmloss"),
                   help="the lmloss command (default build/lmloss)")
    a = p.parse_args()
    dims = a.dims or [4096, 32768, 1024, 151936]
    if len(dims) % 2:
        p.error("dims must be N V pairs")
    shapes = list(zip(dims[::2], dims[1::2]))

    if torch is None:
        print("torch is not importable (%s): torch columns left empty" % TORCH_ERROR)
    else:
        print("torch %s, cpu capability %s" % (torch.__version__,
                                               torch.backends.cpu.get_cpu_capability()))
    print("lmloss %s (%s), ms, median of %d" % (lmloss.__version__, lmloss.cpu_isa(), REPS))
    widths = [14, 3] + [9] * (len(COLUMNS) - 2)
    print(" ".join(c.rjust(w) for c, w in zip(COLUMNS, widths)))
    rows = []
    for n, v in shapes:
        for row in bench_shape(n, v, a.cli):
            rows.append(row)
            print(" ".join(fmt(c).rjust(w) for c, w in zip(row, widths)), flush=True)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["shape", "threads", "limit_ms", "lmloss_logprob_c_ms",
                        "lmloss_logprob_py_ms", "torch_logprob_ms", "torch_over_lmloss_logprob",
                        "lmloss_ce_fb_c_ms", "lmloss_ce_fb_py_ms", "torch_ce_fb_ms",
                        "torch_over_lmloss_ce"])
            w.writerows([["" if c is None else (round(c, 3) if isinstance(c, float) else c)
                          for c in r] for r in rows])


if __name__ == "__main__":
    main()
