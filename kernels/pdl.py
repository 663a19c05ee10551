"""The programmatic-dependent-launch (PDL) prologue shared by the Triton kernels.

Owns the one rule every PDL kernel of ``speccal.kernels`` follows (``KernelConfig.pdl``, ``_backend.pdl_level``): wait
for the predecessor grid before reading anything it may write, then let the successor launch.
Kernels that release later (the GEMVs after their K loop, ``SPECCAL_PDL=late``; the attention
split kernel with ``SPECCAL_ATTN_RELEASE=loop``) call ``gdc_wait`` / ``gdc_launch_dependents``
themselves. No-op when ``PDL`` is false (and under the interpreter, where PDL is never on).

Also the flag handshake that lets a consumer start before its producer grid completes
(``ops.AttnSignal``, ``SPECCAL_ATTN_POLL``): each producer program that finishes a piece of the
consumer's input counts itself (``signal_done``: CTA barrier, then a gpu-scope release add),
the consumer's programs poll the count with acquire loads (``await_signal``: one warp per
program, its exit warp-uniform, then a CTA barrier) instead of their PDL wait, and the last
consumer program to leave zeroes both counters (``depart``). Safe under
PDL: a consumer grid launches only once every producer program has released it, so every
producer is resident or done while consumers spin.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["await_signal", "depart", "pdl_enter", "signal_done"]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the predecessor, then release the successor (both only with ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def signal_done(sig_ptr):
    """Count this program's finished piece: every thread's stores, then a release add."""
    tl.debug_barrier()
    tl.atomic_add(sig_ptr, 1, sem="release", scope="gpu")


@triton.jit
def await_signal(sig_ptr, target):
    """Wait until the producers' count at ``sig_ptr`` reaches ``target``: warp 0 polls with
    acquire loads, its exit made warp-uniform by a vote (a thread-divergent spin would leave the
    CTA barrier below, an aligned ``bar.sync``, undefined), then every thread meets at the
    barrier (CTA-scope order after warp 0's acquire)."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred p_skip, p_done;
        .reg .b32 r_tid, r_seen;
        mov.u32 r_tid, %tid.x;
        setp.ge.u32 p_skip, r_tid, 32;
        @p_skip bra.uni SIG_DONE;
        SIG_SPIN:
        ld.acquire.gpu.global.b32 r_seen, [$1];
        setp.ge.s32 p_done, r_seen, $2;
        vote.sync.all.pred p_done, p_done, 0xffffffff;
        @!p_done bra.uni SIG_SPIN;
        SIG_DONE:
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [sig_ptr, target], dtype=tl.int32, is_pure=False, pack=1,
    )
    tl.debug_barrier()


@triton.jit
def depart(sig_ptr, nprog):
    """After ``await_signal``: count this program out at ``sig_ptr + 1``; the last of
    ``nprog`` zeroes both counters for the next launch."""
    left = tl.atomic_add(sig_ptr + 1, 1, sem="relaxed", scope="gpu")
    if left == nprog - 1:
        tl.store(sig_ptr, 0)
        tl.store(sig_ptr + 1, 0)
