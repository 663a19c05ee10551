"""Calibration on the pipelined round loop: every window holds exactly ``window_steps`` rounds
of its point's shape between its edges (the transition and warm-up rounds before them), the
loop is recorded in rows, compatibility and ``calibration.timing``, journals resume, a table of
one loop warns (and loads) under the other, and a device span becomes ``device_ms`` and
``wall_over_device``.

The spy's clock moves one second per round queued, so a window's ``elapsed_s`` is the number of
rounds queued between its edges (exact, whatever the CI box's load)."""

from __future__ import annotations

import io
import json
import warnings
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from speccal.base.errors import InputError
from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from speccal.calibrate.timing import WindowTimer, loop_timing
from speccal.cli import app
from speccal.costmodel.compat import CompatibilityWarning
from speccal.costmodel.table import load_table

from .conftest import SMALL, real_engine
from .fakes import FakeClock, FakeEngine

QUIET = Console(quiet=True)
ROUNDS_PER_WINDOW = 1 + SMALL["warmup_steps"] + SMALL["window_steps"]  # transition + warm-up + window


class SpyEngine:
    """A real Engine whose rounds are counted: per transition (``reset``) the shape of every
    round (from the results, ``step`` and ``drain``, by ``round_index``) and how many were
    queued; its clock advances one second per round queued."""

    def __init__(self, engine, stop_after_windows: int | None = None):
        self._engine = engine
        self.now = 0.0
        self.segments: list[dict] = []
        self.stop_after_windows = stop_after_windows

    def clock(self) -> float:
        return self.now

    @property
    def windows(self) -> list[dict]:
        """The segments that ran rounds (the driver's closing ``reset`` runs none)."""
        return [s for s in self.segments if s["queued"]]

    def reset(self):
        self._engine.reset()
        if self.stop_after_windows is not None and len(self.segments) >= self.stop_after_windows:
            raise KeyboardInterrupt
        self.segments.append({"queued": 0, "shapes": {}})

    def _record(self, res) -> None:
        if res.round_index >= 0 and self.segments:
            self.segments[-1]["shapes"][res.round_index] = (res.num_requests, res.bcap, res.g,
                                                            res.k)

    def step(self, plan):
        before = self._engine.round_index
        res = self._engine.step(plan)
        queued = self._engine.round_index - before
        self.now += queued
        if self.segments:
            self.segments[-1]["queued"] += queued
        self._record(res)
        return res

    def drain(self):
        out = self._engine.drain()
        for res in out:
            self._record(res)
        return out

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _run(tmp_path, loop="pipelined", spy=None, **over):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(SMALL))
    spy = spy or SpyEngine(real_engine(3, loop == "pipelined"))
    # the wall clock: these tests count the spy clock's ticks (test_probe_clock.py: the CPU one)
    opts = CalibrateOptions(config_path=cfg, out=tmp_path / "t.json", progress=False,
                            remeasure_rounds=0, accept_noisy=True, loop=loop, clock="wall",
                            **over)
    summary = calibrate(opts, console=QUIET, engine_factory=lambda o: spy, clock=spy.clock)
    lines = [json.loads(x) for x in opts.journal_path.read_text().splitlines()]
    rows = [x["row"] for x in lines if x.get("kind") == "window"]
    return summary, rows, spy, opts


@pytest.mark.parametrize("loop", ["pipelined", "synchronous"])
def test_each_window_holds_exactly_window_steps_rounds_of_its_shape(tmp_path, loop):
    summary, rows, spy, opts = _run(tmp_path, loop)
    n = SMALL["window_steps"]
    assert len(rows) == 4 * SMALL["windows_per_point"]
    # the clock moved by exactly the rounds queued between the window's edges
    assert [r["elapsed_s"] for r in rows] == [float(n)] * len(rows)
    assert len(spy.windows) == len(rows)
    for seg, row in zip(spy.windows, rows, strict=True):
        # transition + warm-up + window rounds, each collected once, all of the window's shape
        assert seg["queued"] == ROUNDS_PER_WINDOW
        assert sorted(seg["shapes"]) == list(range(ROUNDS_PER_WINDOW))
        assert set(seg["shapes"].values()) == {(row["bcap"], row["bcap"], row["g"], row["k"])}
    assert {r["loop"] for r in rows} == {loop}
    assert all("device_ms" not in r for r in rows)  # no device clock on cpu
    table = load_table(opts.out, expect=spy.compatibility())
    assert table.compatibility.loop == loop
    assert table.calibration.timing.model_dump() == {
        "loop": loop, "clock": "wall", "probe_ref_ms": None, "windows": len(rows),
        "device_windows": 0, "wall_over_device_median": None, "wall_over_device_max": None,
        "device_step_ms_median": None,
    }
    assert summary["timing"]["loop"] == loop and summary["effective_config"]["loop"] == loop


def test_the_pipelined_windows_measure_the_rounds_the_synchronous_ones_do(tmp_path):
    """Same prompts, same rounds: the KV lengths the windows record agree between the loops."""
    (tmp_path / "p").mkdir()
    (tmp_path / "s").mkdir()
    _, piped, _, _ = _run(tmp_path / "p", "pipelined")
    _, sync, _, _ = _run(tmp_path / "s", "synchronous")
    assert [(r["bcap"], r["g"], r["window_index"], r["mean_kv_length"]) for r in piped] == [
        (r["bcap"], r["g"], r["window_index"], r["mean_kv_length"]) for r in sync
    ]


def test_a_pipelined_run_resumes_from_its_journal_and_refuses_another_loop(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, spy=SpyEngine(real_engine(3, True), stop_after_windows=3))
    with pytest.raises(InputError, match="(?i)journal"):
        _run(tmp_path, "synchronous", resume=True)  # another loop: another run's journal
    summary, rows, spy, opts = _run(tmp_path, resume=True)
    assert summary["points_resumed"] == 0 and summary["windows_measured"] == len(rows) - 3
    assert len({(r["bcap"], r["g"], r["window_index"]) for r in rows}) == len(rows) == 8
    assert len(spy.windows) == len(rows) - 3  # only the missing windows were measured
    assert load_table(opts.out, expect=spy.compatibility()).compatibility.loop == "pipelined"


def test_a_table_of_one_loop_warns_under_the_other(tmp_path):
    _, _, spy, opts = _run(tmp_path)
    with pytest.warns(CompatibilityWarning, match="loop: expected 'synchronous', found 'pipelined'"):
        table = load_table(opts.out, expect=real_engine(3, False).compatibility())
    assert table.compatibility.loop == "pipelined"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_table(opts.out, expect=real_engine(3, True).compatibility(), runtime_versions={})


def test_the_engine_records_its_loop_and_make_engine_defaults_to_pipelined():
    from speccal.calibrate.pipeline import make_engine

    assert real_engine(3, True).compatibility()["loop"] == "pipelined"
    assert real_engine(3, False).compatibility()["loop"] == "synchronous"
    eng = make_engine(CalibrateOptions(max_model_len=64, request_buckets=(1,)))
    assert eng.config.pipeline and eng.compatibility()["loop"] == "pipelined"
    sync = make_engine(CalibrateOptions(max_model_len=64, request_buckets=(1,), loop="synchronous"))
    assert not sync.config.pipeline


def test_cli_loop_option(tmp_path, monkeypatch, engine_factory, small_config):
    monkeypatch.setattr("speccal.calibrate.pipeline.make_engine", engine_factory)
    out = tmp_path / "t.json"
    args = ["calibrate", "--config", str(small_config), "--out", str(out), "--remeasure-rounds",
            "0", "--accept-noisy"]
    res = CliRunner().invoke(app, [*args, "--loop", "synchronous"], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    assert "round loop" in res.stderr and "synchronous" in res.stderr
    assert "windows timed on the synchronous round loop (no device clock" in res.stderr
    assert json.loads(out.read_text())["compatibility"]["loop"] == "synchronous"
    bad = CliRunner().invoke(app, [*args, "--loop", "async", "--overwrite"],
                             env={"COLUMNS": "120"})
    assert bad.exit_code == 2 and "--loop" in bad.stderr


class _Event:
    """A CUDA event stand-in: its time is the fake clock's, scaled (device = 0.8 x wall)."""

    def __init__(self, clock):
        self.t = clock.now * 0.8

    def elapsed_time(self, end) -> float:
        return 1000.0 * (end.t - self.t)


def test_a_device_span_becomes_device_ms_and_wall_over_device(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(WindowTimer, "_event", lambda self: _Event(clock))

    def make(opts):
        eng = FakeEngine(clock)
        eng.device = SimpleNamespace(type="cuda")
        return eng

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(SMALL))
    opts = CalibrateOptions(config_path=cfg, out=tmp_path / "t.json", progress=False,
                            remeasure_rounds=0, accept_noisy=True)
    console = Console(record=True, width=200, file=io.StringIO())
    calibrate(opts, console=console, engine_factory=make, clock=clock)
    assert "wall / device span median 1.250, max 1.250" in console.export_text()
    lines = [json.loads(x) for x in opts.journal_path.read_text().splitlines()]
    rows = [x["row"] for x in lines if x.get("kind") == "window"]
    for r in rows:
        assert r["device_ms"] == pytest.approx(800.0 * r["elapsed_s"])
        assert r["wall_over_device"] == pytest.approx(1.25)
    timing = load_table(opts.out).calibration.timing
    assert timing.device_windows == len(rows) and timing.wall_over_device_max == pytest.approx(1.25)
    per_round = sorted(r["device_ms"] / r["window_steps"] for r in rows)
    assert timing.device_step_ms_median == pytest.approx(
        (per_round[len(rows) // 2 - 1] + per_round[len(rows) // 2]) / 2)


def test_loop_timing_summarises_only_windows_with_a_device_span():
    rows = [{"device_ms": 4.0, "wall_over_device": 1.0, "window_steps": 2},
            {"device_ms": 8.0, "wall_over_device": 1.5, "window_steps": 2},
            {"window_steps": 2}]
    assert loop_timing(rows, "pipelined") == {
        "loop": "pipelined", "clock": "wall", "probe_ref_ms": None, "windows": 3,
        "device_windows": 2, "wall_over_device_median": 1.25, "wall_over_device_max": 1.5,
        "device_step_ms_median": 3.0,
    }


def test_table_check_rebuilds_the_loop_the_table_was_measured_with(tmp_path):
    from speccal.calibrate.check import engine_options

    _, _, _, opts = _run(tmp_path, "pipelined")
    table = load_table(opts.out)
    assert engine_options(table, model=None, device=None).loop == "pipelined"
    doc = json.loads(opts.out.read_text())
    doc["compatibility"]["loop"] = "unknown"  # saved before the loop was recorded
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    assert engine_options(load_table(old), model=None, device=None).loop == "synchronous"


def test_state_strategy_option_reaches_the_engine_and_bad_values_are_refused():
    from speccal.base.vocab import STATE_STRATEGIES
    from speccal.calibrate.pipeline import make_engine
    from speccal.runner.hybrid_state import STATE_STRATEGIES as RUNNER_STRATEGIES

    assert STATE_STRATEGIES == RUNNER_STRATEGIES
    eng = make_engine(CalibrateOptions(max_model_len=64, request_buckets=(1,),
                                       state_strategy="snapshots"))
    assert eng.config.state_strategy == "snapshots"
    res = CliRunner().invoke(app, ["calibrate", "--state-strategy", "rollback", "--out", "x.json"],
                             env={"COLUMNS": "120"})
    assert 2 in (res.exit_code, getattr(res.exception, "exit_code", None))
    assert "--state-strategy: got 'rollback'" in res.stderr
