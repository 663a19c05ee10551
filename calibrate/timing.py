"""The clocks of one calibration window: the wall clock for its total, device events for its span.

A window is timed between two edges, the only syncs of the window (``Engine.synchronize``):
``start`` syncs the device (every earlier round finished), reads the wall clock and, on CUDA,
records a start event on the engine's current stream; ``stop`` records the end event, syncs and
reads the wall clock again. So the device span (``torch.cuda.Event.elapsed_time``) covers
exactly the device work queued between the edges, and the wall total adds the host work that
did not overlap it plus the closing sync. No event is recorded per round, and nothing here
runs outside calibration windows (serving never times rounds). CPU engines have no device
clock: ``device_ms`` is None there.

**CPU engines: the probe clock** (``clock="cpu_probe"``). A CPU round's wall time moves with
the machine, not the work: on the 2-vCPU VMs this project runs on, the same round shape's
32-round windows have a CV of 15-22 % even with nothing else running (the VM's cores are shared
with other tenants; process CPU time moves with wall time, so it is the cores' speed that
drifts, over fractions of a second to tens of seconds), and another CPU-bound process adds
descheduled gaps on top. No window design averages that out in a minute. Two things cancel
it instead:

1. every round of a window is timed in the calling thread's CPU time (``time.thread_time``;
   torch runs one intra-op thread during calibration, so a CPU round's work is this thread's):
   time the scheduler gave to another process is not counted;
2. after every round a fixed **speed probe** (:class:`SpeedProbe`: 0.2-0.5 ms of the op mix a tiny
   round runs, small matmuls, norms, softmax and an ``index_select`` gather over 2 MiB) is
   timed the same way, and the round's cost is read relative to it: the window's step time is
   ``median over its rounds of (round CPU / probe CPU) * probe_ref_ms``, where
   ``probe_ref_ms`` is the median probe of the first window a driving call measures (kept in
   every journal row; the fit then prices every window at the run's median probe instead,
   :func:`at_run_speed`, so windows of a resumed run or a re-measure round, priced at their
   own first window's reference, come out alike). The probe is timed where
   the rounds leave the caches: back to back, without rounds between, it took 0.17-0.32 ms
   against 0.32-0.54 ms between rounds, and a reference measured so priced rounds ~1.5x below
   their own thread time. The drift is a speed factor common to the round and the probe run a
   millisecond later: over 63 windows of three shapes on a 2-vCPU VM with other work running,
   per-window CV went from 15-19 % (wall) to 12-15 % (thread CPU) to 5 % (the probe ratio;
   measured with a 1.1 ms variant of the probe); bench/RESULTS.md.

The table's costs are then this machine's CPU cost of a round at its median speed over the
run, and ``calibration.timing.clock`` says so (``probe_ref_ms``: that median probe). A window's ``elapsed_s`` is
that normalised total (``window_steps * step_ms``), its ``wall_s`` the wall time between its
edges, as measured. CUDA engines keep the wall clock (their host work is part of a round's
cost, and their device is not shared).

Torch is imported only for a CUDA engine or a probe (``speccal.calibrate`` stays importable
without it; fake engines in tests have no ``device``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

#: How a window's rounds are timed (``calibration.timing.clock``): ``wall`` (wall total between
#: device-synced edges; CUDA adds the device span) or ``cpu_probe`` (module docstring).
CLOCKS = ("wall", "cpu_probe")


@dataclass(frozen=True)
class WindowTime:
    """What one window's edges measured.

    Attributes
    ----------
    elapsed_s : wall seconds between the two edges (both device-synced); under the probe clock
        the window's normalised CPU total, ``window_steps`` times its step time.
    device_ms : device span between the edges in ms (CUDA events); None without a device clock.
    wall_s, probe_ms, probe_ref_ms : probe clock only: the wall seconds between the edges, the
        median probe CPU ms of the window and the reference the rounds are priced at.
    started_s : the clock's reading at the start edge (:meth:`WindowTimer.run`).
    """

    elapsed_s: float
    device_ms: float | None
    wall_s: float | None = None
    probe_ms: float | None = None
    probe_ref_ms: float | None = None
    started_s: float | None = None

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

    def __init__(self, engine: Any, clock: Callable[[], float], *,
                 probe: SpeedProbe | None = None, probe_ref_ms: float | None = None):
        self._engine = engine
        self._clock = clock
        device = engine.device  # a torch.device, or None (a runner without one)
        self._cuda = device is not None and device.type == "cuda"
        self._device = device
        self._t0: float | None = None
        self._ev0: Any = None
        if probe is None and probe_ref_ms is not None:
            raise ValueError("WindowTimer: a probe reference without a probe")
        self._probe = probe
        self.probe_ref_ms = probe_ref_ms

    @property
    def clock_name(self) -> str:
        """``cpu_probe`` with a probe, else ``wall`` (:data:`CLOCKS`)."""
        return "wall" if self._probe is None else "cpu_probe"

    def run(self, step: Callable[[], Any], n: int) -> tuple[list[Any], WindowTime]:
        """Run ``n`` rounds (``step()`` each) as one window; their results and its time.

        The wall clock: ``start``, the rounds back to back, ``stop``. The probe clock: the
        same edges (``wall_s``), and each round timed in thread CPU time followed by one timed
        probe (module docstring).
        """
        if self._probe is None:
            t0 = self.start()
            results = [step() for _ in range(n)]
            return results, replace(self.stop(), started_s=t0)
        cpu = time.thread_time
        probe = self._probe
        ratios, probes, results = [], [], []
        t0 = self.start()
        for _ in range(n):
            c0 = cpu()
            results.append(step())
            c1 = cpu()
            p = probe()
            ratios.append((c1 - c0) / p)
            probes.append(p)
        span = self.stop()
        probe_ms = 1000.0 * _median(sorted(probes))
        if self.probe_ref_ms is None:  # the first window sets the reference
            self.probe_ref_ms = probe_ms
        step_ms = _median(sorted(ratios)) * self.probe_ref_ms
        return results, WindowTime(
            elapsed_s=n * step_ms / 1000.0, device_ms=span.device_ms, wall_s=span.elapsed_s,
            probe_ms=probe_ms, probe_ref_ms=self.probe_ref_ms, started_s=t0,
        )

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


def loop_timing(rows: list[dict[str, Any]], loop: str) -> dict[str, Any]:
    """The calibration block's ``timing`` summary (``costmodel.table_schema.LoopTimingBlock``)
    of the measurement rows the fit uses: the loop, the clock (:data:`CLOCKS`; with the probe
    clock its reference), window counts, and over the windows with a device span the median and
    largest ``wall_over_device`` and the median device ms per round."""
    timed = [r for r in rows if r.get("device_ms") is not None]
    ratios = sorted(float(r["wall_over_device"]) for r in timed)
    per_round = sorted(float(r["device_ms"]) / int(r["window_steps"]) for r in timed)
    probed = [r for r in rows if r.get("clock") == "cpu_probe"]
    return {
        "loop": loop,
        "clock": "cpu_probe" if probed else "wall",
        "probe_ref_ms": float(probed[0]["probe_ref_ms"]) if probed else None,
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


class SpeedProbe:
    """A fixed CPU workload whose thread CPU time measures the machine's speed right now.

    The op mix of a tiny-preset round in miniature (module docstring): eight chained
    ``linear -> rms_norm -> softmax`` steps over ``[8, 64]`` activations (dispatch-bound, as a
    small model's round is) and one ``index_select`` gather of 2,048 rows of a 2 MiB table
    (memory-bound, as the KV gather of a long context is); 0.2-0.5 ms on a 2-vCPU VM. Inputs are
    seeded and allocated once; the output is discarded.
    """

    def __init__(self, *, seed: int = 0):
        import torch  # the probe runs torch ops (module docstring)

        gen = torch.Generator().manual_seed(seed)
        self._torch = torch
        self._w = torch.randn(64, 64, generator=gen)
        self._x = torch.randn(8, 64, generator=gen)
        self._table = torch.randn(8192, 64, generator=gen)
        self._index = torch.randint(0, 8192, (2048,), generator=gen)

    def __call__(self) -> float:
        """Run the workload once; its thread CPU seconds."""
        fn = self._torch.nn.functional
        c0 = time.thread_time()
        y = self._x
        for _ in range(8):
            y = fn.softmax(fn.rms_norm(fn.linear(y, self._w), (64,)), dim=-1)
        self._table.index_select(0, self._index).sum()
        return time.thread_time() - c0



def at_run_speed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Probe-clock rows priced at the run's median probe time instead of the first window's.

    Each row was priced at the reference its driving call's first window set (``probe_ref_ms``:
    one moment's speed, and another one for a re-measure round or a resumed run). The run's
    median probe over every window (``probe_ms``) is the speed the table should state, so each
    row's ``step_ms`` and ``elapsed_s`` are scaled by ``median / probe_ref_ms`` (its round /
    probe ratio is unchanged) and ``probe_ref_ms`` becomes the median. Rows of the wall clock
    are returned as they are.
    """
    probed = [r for r in rows if r.get("clock") == "cpu_probe"]
    if not probed:
        return [dict(r) for r in rows]
    ref = _median(sorted(float(r["probe_ms"]) for r in probed))
    out = []
    for r in rows:
        r = dict(r)
        if r.get("clock") == "cpu_probe":
            f = ref / float(r["probe_ref_ms"])
            r.update(step_ms=float(r["step_ms"]) * f, elapsed_s=float(r["elapsed_s"]) * f,
                     probe_ref_ms=ref)
        out.append(r)
    return out
