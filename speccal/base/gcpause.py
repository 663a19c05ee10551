"""Python's cyclic garbage collector held off while rounds are timed.

A full (generation 2) collection walks every object the process holds: with torch, transformers
and an engine loaded that is ~365k objects and 60-150 ms, one stall that lands in whichever
calibration window or live run happens to be running. On an H100 at 98963ed such stalls were
every "disturbed" sweep run (each ran 0.11-0.14 s long while its CPU and GPU stayed normal) and
the one slow window of each calibration (79 % over its point). :func:`paused_gc` disables the
collector for a timed region and re-enables it after (as ``timeit`` does); reference counting
still frees everything that is not part of a cycle, and the cycles left over are collected at the
next automatic collection outside the region (few: the 22.8 s measuring phase of a default
``speccal calibrate --model tiny`` on the CPU grew the heap by 604 objects and left 10 in cycles).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector for the ``with`` body; nesting-safe (only the outermost
    pause re-enables it, and a collector the caller disabled stays disabled)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
