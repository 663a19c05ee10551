"""speccal.base.progress: plain log lines at a stated cadence when the console is not a terminal
(fake clock), a live bar and no log lines on a terminal, nothing when disabled."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from speccal.base.progress import ProgressReporter, format_seconds, is_live


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def log_console() -> Console:
    return Console(file=io.StringIO(), width=120)  # a file: not a terminal


def test_a_file_or_pipe_is_not_live_a_terminal_is():
    assert not is_live(log_console())
    assert is_live(Console(file=io.StringIO(), force_terminal=True))


def test_counted_work_logs_a_start_line_every_ten_percent_and_the_end():
    clock, console = Clock(), log_console()
    with ProgressReporter(
        "calibrate", console=console, total=57, unit="windows", clock=clock
    ) as rep:
        for i in range(57):
            clock.now += 0.1  # fast windows: no heartbeat, only the 10 % steps
            rep.update(advance=1, detail=f"window {i}")
    assert rep.lines[0] == "calibrate: 0/57 windows, 0 %"
    done = [int(x.split()[1].split("/")[0]) for x in rep.lines]
    # 6/57 is the first count at >= 10 %, 12/57 at >= 20 %, ..., 57/57 at 100 %
    assert done == [0, 6, 12, 18, 23, 29, 35, 40, 46, 52, 57]
    assert rep.lines[1].startswith("calibrate: 6/57 windows, 11 %")
    assert "ETA" in rep.lines[1] and "(window 5)" in rep.lines[1]
    assert rep.lines[-1].startswith("calibrate: 57/57 windows, 100 %, 6 s elapsed")
    assert console.file.getvalue().splitlines() == rep.lines  # plain text, one per line


def test_slow_work_logs_a_heartbeat_every_interval():
    clock, console = Clock(), log_console()
    with ProgressReporter(
        "trace", console=console, unit="rounds", phase="recording rounds", clock=clock
    ) as rep:
        for _ in range(10):
            clock.now += 3.0
            rep.update(advance=1)
    # no total: no start line; a line at 12 s and 24 s (10 s after the previous), then the end
    assert rep.lines == [
        "trace: recording rounds, 4 rounds, 12 s elapsed",
        "trace: recording rounds, 8 rounds, 24 s elapsed",
        "trace: recording rounds, 10 rounds, 30 s elapsed",
    ]


def test_a_new_phase_logs_at_once_and_the_end_says_done():
    clock, console = Clock(), log_console()
    with ProgressReporter("bench", console=console, clock=clock) as rep:
        rep.update(phase="loading")
        clock.now += 2.0
        rep.update(phase="warm-up")
        rep.update(phase="warm-up")  # the same phase: no new line
        clock.now += 61.0
        rep.update(phase="live fixed:1 (1/2)")
    assert rep.lines == [
        "bench: loading",
        "bench: warm-up, 2 s elapsed",
        "bench: live fixed:1 (1/2), 1 min 03 s elapsed",
        "bench: done in 1 min 03 s",
    ]


def test_work_found_on_the_way_extends_the_total():
    clock, console = Clock(), log_console()
    with ProgressReporter(
        "calibrate", console=console, total=10, unit="windows", clock=clock
    ) as rep:
        rep.update(advance=10)
        rep.update(total=13, phase="re-measure 1/2")
        rep.update(advance=3)
    assert rep.lines[-2].startswith("calibrate: re-measure 1/2, 10/13 windows, 77 %")
    assert rep.lines[-1].startswith("calibrate: re-measure 1/2, 13/13 windows, 100 %")


def test_resumed_work_does_not_count_towards_the_rate():
    clock, console = Clock(), log_console()
    with ProgressReporter(
        "calibrate", console=console, total=100, completed=50, unit="windows", clock=clock
    ) as rep:
        clock.now += 10.0
        rep.update(advance=10)  # 10 windows in 10 s: 40 left -> 40 s
    assert "ETA 40 s" in rep.lines[-1]


def test_a_terminal_gets_a_live_bar_and_no_log_lines():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with ProgressReporter("calibrate", console=console, total=4, unit="windows") as rep:
        for _ in range(4):
            rep.update(advance=1)
    assert rep.live and rep.lines == []
    assert "calibrate" in out.getvalue() and "4/4" in out.getvalue()


@pytest.mark.parametrize("live", [True, False])
def test_disabled_shows_nothing(live):
    out = io.StringIO()
    console = Console(file=out, force_terminal=live)
    with ProgressReporter("x", console=console, total=3, enabled=False) as rep:
        rep.update(advance=3, phase="p")
    assert out.getvalue() == "" and rep.lines == []


def test_format_seconds():
    assert [format_seconds(s) for s in (0.4, 42, 185, 3725)] == [
        "0 s",
        "42 s",
        "3 min 05 s",
        "1 h 02 min",
    ]
