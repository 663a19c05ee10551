"""CUDA timing helpers shared by the GPU bench scripts.

The scripts import this module as ``cuda_timing`` (``python3 bench/x.py`` puts ``bench/`` first
on ``sys.path``): CUDA-event timing of a callable, the capture of launches into one CUDA graph
(warmed on a side stream first, as capture requires). Kernel switches are a
``KernelConfig.from_env`` each script builds per variant and passes down.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from speccal.base.gcpause import paused_gc


def events_ms(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` calls (CUDA events), in ms; one
    call first, untimed."""
    fn()
    torch.cuda.synchronize()
    times = []
    with paused_gc():  # no 60-150 ms full collection inside a repeat (speccal.base.gcpause)
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def capture(fns: Sequence[Callable[[], object]], reps: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``reps`` passes over ``fns``, after one warm pass on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    torch.cuda.synchronize()
    return g
