"""Where a row kernel's time goes, from ncu's per-SASS-line counts.

Reads a CSV that `bench/gpu_check.sh kernels` writes (ncu-ce-grad-sass.csv.gz,
ncu-logprob-bwd-sass.csv.gz: --page source --print-source sass --csv) and
splits executed instructions and warp stall samples by how often each line
ran: lines run per vector (the hot loops), per row by every warp, and per
row by one warp only (the cluster merge), with the top stall reasons of
each class and the lines holding the most samples.

    python3 bench/sass_stalls.py ncu-ce-grad-sass.csv.gz --rows 8192 --ctas 8 --warps 4
"""
import argparse
import collections
import csv
import gzip


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu source-page CSV, gzipped")
    ap.add_argument("--rows", type=int, default=8192, help="rows of the profiled call")
    ap.add_argument("--ctas", type=int, default=8, help="CTAs per row (the cluster size)")
    ap.add_argument("--warps", type=int, default=4, help="warps per CTA")
    ap.add_argument("--top", type=int, default=15, help="lines to list")
    args = ap.parse_args()

    lines = gzip.open(args.csv, "rt").readlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"Address"'))
    table = list(csv.reader(lines[start:]))
    head, body = table[0], [r for r in table[1:] if len(r) == len(table[0])]
    col = {name: i for i, name in enumerate(head)}
    stalls = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    samples_of = lambda r: number(r[col["Warp Stall Sampling (All Samples)"]])
    executed_of = lambda r: number(r[col["Instructions Executed"]])
    total = sum(samples_of(r) for r in body) or 1.0

    one_warp = args.rows * args.ctas  # a line run once per row by one warp of each CTA
    every_warp = one_warp * args.warps

    def kind(executed):
        if executed > 2 * every_warp:
            return "per vector"
        if executed > 2 * one_warp:
            return "per row, every warp"
        return "per row, one warp"

    classes = collections.defaultdict(lambda: [0.0, 0.0, collections.Counter()])
    for r in body:
        if executed_of(r) == 0 and samples_of(r) == 0:
            continue
        c = classes[kind(executed_of(r))]
        c[0] += executed_of(r)
        c[1] += samples_of(r)
        for s in stalls:
            c[2][s] += number(r[col[s]])
    print(f"{sum(c[0] for c in classes.values()) / 1e6:.1f} M warp instructions, "
          f"{total:.0f} stall samples")
    for name, (executed, samples, reasons) in sorted(classes.items()):
        top = ", ".join(f"{s[6:]} {v / total * 100:.1f}%" for s, v in reasons.most_common(4))
        print(f"{name:20s} {executed / 1e6:8.1f} M instr  {samples / total * 100:5.1f}% of samples"
              f"  ({top})")
    print("lines with the most samples:")
    for r in sorted(body, key=samples_of, reverse=True)[: args.top]:
        reason = max(stalls, key=lambda s: number(r[col[s]]))[6:]
        print(f"  {r[col['Address']][-6:]} {samples_of(r) / total * 100:5.2f}%"
              f"  {kind(executed_of(r)):20s} {reason:18s} {r[col['Source']].strip()[:60]}")


if __name__ == "__main__":
    main()
