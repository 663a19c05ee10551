"""CUDA timing helpers shared by the GPU bench scripts.

The scripts import this module as ``cuda_timing`` (``python3 bench/x.py`` puts ``bench/`` first
on ``sys.path``): CUDA-event timing of a callable, the capture of launches into one CUDA graph
(warmed on a side stream first, as capture requires), and environment switches set for one
measurement (the kernels read ``SPECCAL_*`` switches at launch / capture).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch


def events_ms(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` calls (CUDA events), in ms; one
    call first, untimed."""
    fn()
    torch.cuda.synchronize()
    times = []
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


@contextmanager
def env_vars(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` inside the block, restored after it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
