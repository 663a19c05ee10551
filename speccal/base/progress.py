"""Progress of long-running work on stderr, legible on a terminal and in a log.

One helper for every progress display of the project (calibration windows, bench phases,
trace recording, generation, replay). On a terminal it is a live Rich bar. Anywhere else (CI,
``nohup``, a pipe, a file) a live bar shows nothing until its final state, so it prints plain log
lines instead, one per event worth a line::

    calibrate: 0/57 windows, 0 %
    calibrate: 6/57 windows, 11 %, 4 s elapsed, ETA 34 s (points 2/19, Bcap=2 G=4 k=3)
    ...
    calibrate: re-measure 1/2, 57/63 windows, 90 %, 38 s elapsed, ETA 4 s (...)
    calibrate: re-measure 1/2, 63/63 windows, 100 %, 42 s elapsed
    bench: live fixed:1 (1/3)

Cadence of the log lines (``ProgressReporter``): a start line for counted work; then a line
whenever the completed count crosses the next ``percent_step`` (10 %) of the total, whenever
``interval_s`` (10 s) passed since the last line, and whenever the caller names a new phase
(``update(phase=...)``: bench and replay stages); and a last line at the end. Lines are only
printed from ``update`` calls (no timer thread): work that reports nothing for a minute prints
nothing for a minute. The ETA is the remaining count at the rate measured since the reporter
started (a resumed run's earlier work does not count towards the rate).

Ground floor: imports nothing of ours (Rich only), so library code (``speccal.calibrate``,
``speccal.live``) and the CLI share it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

#: Seconds between heartbeat lines in log mode.
DEFAULT_INTERVAL_S = 10.0
#: Percent of the total between progress lines in log mode.
DEFAULT_PERCENT_STEP = 10.0


def is_live(console: Console) -> bool:
    """Whether ``console`` can redraw a live bar: a terminal (or Jupyter), not a pipe or a file."""
    return bool(console.is_terminal or console.is_jupyter)


def format_seconds(seconds: float) -> str:
    """``42 s``, ``3 min 05 s`` or ``1 h 02 min``: short enough for a log line."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


class ProgressReporter:
    """A progress display: live Rich bar on a terminal, plain log lines elsewhere.

    Use as a context manager and call :meth:`update`. ``total`` None is work of unknown size
    (a spinner with a count and/or a phase).

    Parameters
    ----------
    label : what is progressing, first word of every line (``calibrate``, ``bench``, ``trace``).
    console : where it prints (stderr in the CLI).
    total : count at completion, or None.
    completed : count already done at start (a resumed calibration).
    unit : name of the counted things (``windows``, ``tokens``, ``rounds``); "" for none.
    phase : the stage the work starts in (see :meth:`update`).
    enabled : False shows nothing at all.
    transient : live mode only: remove the bar at the end (log lines are never removed).
    live : force the live bar (True) or log lines (False); default :func:`is_live`.
    interval_s, percent_step : log-mode cadence (module docstring).
    clock : monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        label: str,
        *,
        console: Console,
        total: int | None = None,
        completed: int = 0,
        unit: str = "",
        phase: str | None = None,
        enabled: bool = True,
        transient: bool = False,
        live: bool | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        percent_step: float = DEFAULT_PERCENT_STEP,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label = label
        self.console = console
        self.total = total
        self.completed = completed
        self.unit = unit
        self.enabled = enabled
        self.transient = transient
        self.live = is_live(console) if live is None else live
        self.interval_s = interval_s
        self.percent_step = percent_step
        self.clock = clock
        self.phase = phase
        self.detail: str | None = None
        self.lines: list[str] = []  # log lines printed (log mode), for callers and tests
        self._start_completed = completed
        self._t0 = 0.0
        self._last_line_t = 0.0
        self._last_line_state: tuple[Any, ...] | None = None
        self._next_pct = 0.0
        self._progress: Progress | None = None
        self._task: Any = None

    # -- context manager
    def __enter__(self) -> ProgressReporter:
        self._t0 = self._last_line_t = self.clock()
        if not self.enabled:
            return self
        if self.live:
            self._progress = Progress(
                *self._columns(), console=self.console, transient=self.transient
            )
            self._progress.start()
            self._task = self._progress.add_task(
                self._description(), total=self.total, completed=self.completed, detail=""
            )
        elif self.total is not None:
            self._next_pct = self._pct_floor(self._percent()) + self.percent_step
            self._emit()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            return
        if self.total is None and not self.completed:
            # Phases only: say that the last one finished (nothing if none was announced).
            if self.lines and exc_type is None:
                now = self.clock()
                text = f"{self.label}: done in {format_seconds(now - self._t0)}"
                self.console.print(text, markup=False, highlight=False, soft_wrap=True)
                self.lines.append(text)
            return
        if self._state() != self._last_line_state:
            self._emit()

    # -- updates
    def update(
        self,
        *,
        completed: int | None = None,
        advance: int = 0,
        total: int | None = None,
        detail: str | None = None,
        phase: str | None = None,
    ) -> None:
        """Record progress; in log mode print a line when the cadence says so.

        Parameters
        ----------
        completed : new absolute count (else ``advance`` is added).
        advance : count to add.
        total : new total (work found on the way, e.g. re-measured windows).
        detail : short text shown after the count (where the work is); never prints by itself.
        phase : a new stage of the work; in log mode a changed phase prints a line at once.
        """
        if completed is not None:
            self.completed = completed
        self.completed += advance
        if total is not None:
            self.total = total
        if detail is not None:
            self.detail = detail
        new_phase = phase is not None and phase != self.phase
        if phase is not None:
            self.phase = phase
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(
                self._task,
                completed=self.completed,
                total=self.total,
                description=self._description(),
                detail=self.detail or "",
            )
            return
        now = self.clock()
        pct = self._percent()
        due = (
            new_phase
            or now - self._last_line_t >= self.interval_s
            or (pct is not None and pct >= self._next_pct)
        )
        if due:
            self._emit(now)

    # -- log mode
    def line(self, now: float | None = None) -> str:
        """The log line of the current state."""
        now = self.clock() if now is None else now
        elapsed = now - self._t0
        parts = [self.phase] if self.phase else []
        if self.total is not None:
            pct = self._percent() or 0.0
            parts.append(f"{self.completed}/{self.total}" + (f" {self.unit}" if self.unit else ""))
            parts.append(f"{pct:.0f} %")
        elif self.completed or self.unit:
            parts.append(f"{self.completed}" + (f" {self.unit}" if self.unit else ""))
        if elapsed >= 1.0 or (self.total is not None and self.completed >= self.total):
            parts.append(f"{format_seconds(elapsed)} elapsed")
        eta = self._eta(elapsed)
        if eta is not None:
            parts.append(f"ETA {format_seconds(eta)}")
        text = f"{self.label}: {', '.join(parts)}" if parts else self.label
        return text + (f" ({self.detail})" if self.detail else "")

    def _emit(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        text = self.line(now)
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        self.lines.append(text)
        self._last_line_t = now
        self._last_line_state = self._state()
        pct = self._percent()
        if pct is not None:
            self._next_pct = self._pct_floor(pct) + self.percent_step

    def _state(self) -> tuple[Any, ...]:
        return (self.completed, self.total, self.phase, self.detail)

    def _percent(self) -> float | None:
        if self.total is None:
            return None
        if self.total <= 0:
            return 100.0
        return 100.0 * min(self.completed, self.total) / self.total

    def _pct_floor(self, pct: float | None) -> float:
        if pct is None or self.percent_step <= 0:
            return 0.0
        return math.floor(pct / self.percent_step) * self.percent_step

    def _eta(self, elapsed: float) -> float | None:
        if self.total is None or elapsed <= 0:
            return None
        done = self.completed - self._start_completed
        left = self.total - self.completed
        if done <= 0 or left <= 0:
            return None
        return left * elapsed / done

    # -- live mode
    def _description(self) -> str:
        return self.label + (f" {self.phase}" if self.phase else "")

    def _columns(self) -> list[ProgressColumn | str]:
        unit = f" {self.unit}" if self.unit else ""
        if self.total is not None:
            return [
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(unit.strip()),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[detail]}"),
            ]
        columns: list[ProgressColumn | str] = [
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
        ]
        if self.unit:
            columns.append(TextColumn("{task.completed}" + unit))
        columns += [TimeElapsedColumn(), TextColumn("{task.fields[detail]}")]
        return columns
