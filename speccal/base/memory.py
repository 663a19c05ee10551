"""How much memory a process may still allocate, and the one refusal when a size exceeds it.

Owns the host-memory probe (Linux ``/proc/meminfo`` ``MemAvailable``; ``None`` elsewhere, where
the check is skipped rather than guessed) and :func:`check_fits`, which every allocation sized
by user input calls *before* allocating (the runner's KV cache and static buffers, a scenario
trace): a size that cannot fit is one ``InputError`` naming the option, its value, the bytes
needed and the bytes available, instead of a ``MemoryError`` traceback or the OOM killer.
Imports nothing of ours but the errors; no torch (device memory is ``speccal.runner.device``).
"""

from __future__ import annotations

from typing import Any

from speccal.base.errors import InputError

MEMINFO = "/proc/meminfo"


def host_memory_available(meminfo: str = MEMINFO) -> int | None:
    """Bytes the kernel reports as available for new allocations (``MemAvailable``), or None
    when it does not say (not Linux, an unreadable ``/proc``)."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    parts = line.split()
                    return int(parts[1]) * (1024 if parts[-1].lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def format_bytes(n: float) -> str:
    """``n`` bytes as a short human size (``52.5 GB``; decimal units)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


def check_fits(
    need_bytes: int,
    available: int | None,
    *,
    field: str,
    value: Any,
    what: str,
    where: str = "host",
) -> None:
    """Refuse ``need_bytes`` of ``what`` when more than ``available`` bytes (None: unknown,
    nothing is refused).

    Raises
    ------
    InputError
        ``field: got value, expected a value whose <what> fits in <where> memory (needs N,
        M available)``: exit 2, one line.
    """
    if available is None or need_bytes <= available:
        return
    raise InputError(
        field,
        value,
        f"a value whose {what} fits in {where} memory",
        hint=f"needs {format_bytes(need_bytes)} ({need_bytes} bytes), "
        f"{format_bytes(available)} available",
    )
