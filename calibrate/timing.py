"""The clocks of one calibration window: the wall clock for its total, device events for its span.

A window is timed between two edges, the only syncs of the window (``Engine.synchronize``):
``start`` syncs the device (every earlier round finished), reads the wall clock and, on CUDA,
records a start event on the engine's current stream; ``stop`` records the end event, syncs and
reads the wall clock again. So the device span (``torch.cuda.Event.elapsed_time``) covers
exactly the device work queued between the edges, and the wall total adds the host work that
did not overlap it plus the closing sync. No event is recorded per round, and nothing here
runs outside calibration windows (serving never times rounds). CPU engines have no device
clock: ``device_ms`` is None there.

Torch is imported only for a CUDA engine (``speccal.calibrate`` stays importable without it;
fake engines in tests have no ``device``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WindowTime:
    """What one window's edges measured.

    Attributes
    ----------
    elapsed_s : wall seconds between the two edges (both device-synced).
    device_ms : device span between the edges in ms (CUDA events); None without a device clock.
    """

    elapsed_s: float
    device_ms: float | None

    @property
    def wall_over_device(self) -> float | None:
        """Wall total over device span (1.0 = the host never made the device wait); None
        without a device span."""
        if self.device_ms is None or self.device_ms <= 0:
            return None
        return 1000.0 * self.elapsed_s / self.device_ms


class WindowTimer:
    """Start/stop one window at a time on ``engine`` (see module docstring).

    Parameters
    ----------
    engine : the calibration engine (``synchronize()``; ``device``, a ``torch.device``, when it
        has one).
    clock : wall-clock seconds (``time.perf_counter``; tests inject a fake one).
    """

    def __init__(self, engine: Any, clock: Callable[[], float]):
        self._engine = engine
        self._clock = clock
        device = getattr(engine, "device", None)
        self._cuda = getattr(device, "type", None) == "cuda"
        self._device = device
        self._t0: float | None = None
        self._ev0: Any = None

    @property
    def has_device_clock(self) -> bool:
        return self._cuda

    def _event(self) -> Any:
        import torch  # only CUDA engines get here (module docstring)

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self._device))
        return ev

    def start(self) -> float:
        """Sync, read the wall clock, record the start event; returns the wall time read."""
        self._engine.synchronize()
        self._t0 = self._clock()
        self._ev0 = self._event() if self._cuda else None
        return self._t0

    def stop(self) -> WindowTime:
        """Record the end event, sync, read the wall clock: the window's :class:`WindowTime`."""
        if self._t0 is None:
            raise RuntimeError("WindowTimer.stop without start")
        ev1 = self._event() if self._cuda else None
        self._engine.synchronize()
        elapsed = self._clock() - self._t0
        device_ms = float(self._ev0.elapsed_time(ev1)) if ev1 is not None else None
        self._t0 = self._ev0 = None
        return WindowTime(elapsed_s=elapsed, device_ms=device_ms)


#: The round loops ``speccal calibrate --loop`` takes (``EngineConfig.pipeline`` True / False).
LOOPS = ("pipelined", "synchronous")


def loop_timing(rows: list[dict[str, Any]], loop: str) -> dict[str, Any]:
    """The calibration block's ``timing`` summary (``costmodel.table_schema.LoopTimingBlock``)
    of the measurement rows the fit uses: the loop, window counts, and over the windows with a
    device span the median and largest ``wall_over_device`` and the median device ms per round."""
    timed = [r for r in rows if r.get("device_ms") is not None]
    ratios = sorted(float(r["wall_over_device"]) for r in timed)
    per_round = sorted(float(r["device_ms"]) / int(r["window_steps"]) for r in timed)
    return {
        "loop": loop,
        "windows": len(rows),
        "device_windows": len(timed),
        "wall_over_device_median": _median(ratios),
        "wall_over_device_max": ratios[-1] if ratios else None,
        "device_step_ms_median": _median(per_round),
    }


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
