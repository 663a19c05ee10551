"""The programmatic-dependent-launch (PDL) prologue shared by the Triton kernels.

Owns the one rule every PDL kernel of ``speccal.kernels`` follows (``_backend.pdl_mode``): wait
for the predecessor grid before reading anything it may write, then let the successor launch.
Kernels that release later (the GEMVs after their K loop, ``SPECCAL_PDL=late``; the attention
split kernel with ``SPECCAL_ATTN_RELEASE=loop``) call ``gdc_wait`` / ``gdc_launch_dependents``
themselves. No-op when ``PDL`` is false (and under the interpreter, where PDL is never on).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["pdl_enter"]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the predecessor, then release the successor (both only with ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
