"""What is truly process-wide for ``speccal.kernels``: Triton availability, SM counts, counters.

Everything that decides *which* kernels run and how is a :class:`speccal.kernels.config.KernelConfig`
passed by the caller; this module only answers questions about the process and its devices:
whether Triton imports, whether Triton's CPU interpreter is on (Triton's own setting), whether a
device supports programmatic dependent launch (PDL), how many SMs it has, and the per-device
arrival counters the folded reductions share. Triton is imported lazily and only here, so
``import speccal.kernels`` works on a CPU-only machine without it.
"""

from __future__ import annotations

import functools

import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.kernels.config import KernelConfig

__all__ = ["arrival_counters", "interpreting", "num_sms", "pdl_level", "triton_available",
           "use_triton"]


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` imports."""
    try:
        import triton  # noqa: F401  (lazy: CPU machines have no triton)
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton's CPU interpreter is on (Triton's own ``knobs.runtime.interpret``, set by
    its ``TRITON_INTERPRET`` variable); False without triton."""
    if not triton_available():
        return False
    import triton  # lazy, see triton_available

    return bool(triton.knobs.runtime.interpret)


def use_triton(t: torch.Tensor, backend: str = "auto") -> bool:
    """Whether an op on ``t`` runs the Triton kernel under ``backend`` (``KernelConfig.backend``).

    ``auto``: Triton for CUDA tensors (or any tensor under the interpreter) when it imports;
    ``reference``: never; ``triton``: always, refused when it cannot run.
    """
    if backend not in ("auto", "triton", "reference"):
        raise InputError("kernels.backend", backend, "one of auto, triton, reference")
    if backend == "reference":
        return False
    ok = triton_available() and (t.is_cuda or interpreting())
    if backend == "triton" and not ok:
        raise UnsupportedError("kernels.backend='triton' needs a CUDA tensor and an importable triton")
    return ok


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_level(t: torch.Tensor, cfg: KernelConfig) -> int:
    """The PDL level launches on ``t``'s device take under ``cfg``: ``cfg.pdl.level`` (0 off,
    1 early, 2 late) on CUDA devices of compute capability >= 9.0, else 0 (never under the
    interpreter)."""
    level = cfg.pdl.level
    if not level or not t.is_cuda or interpreting():
        return 0
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return level if _pdl_device(idx) else 0


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (132, an H200's count, off CUDA: plans stay comparable)."""
    if device.type != "cuda":
        return 132
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


_ARRIVAL: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(pool: str, device: torch.device, needed: int,
                     slots: int = 1 << 16) -> torch.Tensor | None:
    """Per-device int32 arrival counters of a folded reduce (``pool``: one set per kernel family,
    so two families never share a slot), zeros that the kernels reset after use. Allocated once,
    outside any CUDA graph capture: a capture that finds none (or fewer than ``needed``) gets
    None, and its caller takes the reduce launch instead of allocating in the graph's pool."""
    key = (pool, device)
    cnt = _ARRIVAL.get(key)
    if cnt is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        cnt = _ARRIVAL[key] = torch.zeros(slots, dtype=torch.int32, device=device)
    return cnt if needed <= cnt.numel() else None
