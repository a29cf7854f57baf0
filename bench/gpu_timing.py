"""CUDA-event timing and peak memory, shared by the GPU benchmarks."""
import statistics

import torch


def timed(fn, reps, queued=1):
    """(median, min, max) over `reps` samples of the per-call time of `queued`
    calls queued back to back between two CUDA events, after a warm-up call:
    each call's host work overlaps the device work of the one before, as in
    a training step, so what is timed is the device. A sample's first
    event is queued behind a lead call, untimed, so that the first timed
    call's host work overlaps it too (queued > 1; a lone call keeps its
    host time, as `--queue 1` in lmloss bench)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued > 1:
            fn()
        s.record()
        for _ in range(queued):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / queued)
    return statistics.median(ts), min(ts), max(ts)


def peak_mib(fn):
    """MiB allocated at the peak of one call beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20
