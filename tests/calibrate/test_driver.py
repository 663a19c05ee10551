"""The driver's window-major order, windows that replicate one KV range, and the prompt plan that
measures every point at the same mean KV length."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from rich.console import Console

from speccal.base.geometry import default_target_rows
from speccal.calibrate.config import (
    CalibrationConfig,
    ContextInterval,
    UserConfig,
    parse_config_file,
    resolve_config,
)
from speccal.calibrate.driver import (
    calibrated_kv_length,
    mean_measured_rounds,
    prompt_lengths,
    replicate_advance,
    synthetic_prompts,
)
from speccal.calibrate.feasibility import reserve_tokens
from speccal.calibrate.grid import GridPoint, build_grid
from speccal.calibrate.pipeline import CalibrateOptions, calibrate


def _cfg(tmp_path, small_config, engine_factory, **over):
    cfg = json.loads(small_config.read_text())
    cfg.update(over)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "t.json"
    # The quality gate off (test_gate.py tests it): a noisy CI box must not change the windows.
    opts = CalibrateOptions(
        config_path=path, out=out, progress=False, remeasure_rounds=0, accept_noisy=True
    )
    calibrate(opts, console=Console(quiet=True), engine_factory=engine_factory)
    lines = [json.loads(x) for x in opts.journal_path.read_text().splitlines()]
    rows = [x["row"] for x in lines if x.get("kind") == "window"]
    return rows


def test_windows_run_window_major(tmp_path, small_config, engine_factory):
    rows = _cfg(tmp_path, small_config, engine_factory, windows_per_point=3)
    order = [(r["window_index"], r["bcap"], r["g"]) for r in rows]
    assert [o[0] for o in order] == sorted(o[0] for o in order)  # window 0 of all, then 1, ...
    assert len(order) == 4 * 3 and len(set(order)) == 12


def test_windows_of_a_point_are_replicates_at_one_kv(tmp_path, small_config, engine_factory):
    """Every window of a point (re-measures too) starts at the middle of a back-to-back run
    (``replicate_advance`` rounds in), so a point's windows share one mean KV, the interval's
    calibrated KV: the window spread the gate judges holds noise, not the KV growth (windows
    advanced by ``i * window_steps`` rounds sat ``window_steps * (v + 1)`` tokens apart)."""
    rows = _cfg(tmp_path, small_config, engine_factory, windows_per_point=3, window_steps=3)
    assert replicate_advance(replace(_default_like_cfg(), window_steps=3)) == 3
    by_point: dict = {}
    for r in rows:
        by_point.setdefault((r["context_index"], r["bcap"], r["g"], r["k"]), []).append(r)
    assert len(by_point) == 4
    for key, windows in by_point.items():
        assert sorted(r["window_index"] for r in windows) == [0, 1, 2], key
        kv = {r["mean_kv_length"] for r in windows}
        assert len(kv) == 1, (key, kv)


def test_replicate_advance_is_the_middle_of_a_back_to_back_run():
    base = _default_like_cfg()
    assert replicate_advance(base) == 32  # 3 windows of 32 rounds
    assert replicate_advance(replace(base, windows_per_point=1)) == 0
    assert replicate_advance(replace(base, windows_per_point=2, window_steps=7)) == 3
    # mean measured rounds: the transition, warmup, the middle of a window, the advance
    cfg = replace(base, warmup_steps=8, windows_per_point=2, window_steps=7)
    assert mean_measured_rounds(cfg) == 1 + 8 + 4 + 3


def test_advanced_prompts_extend_the_base_prompts(small_config, engine_factory):
    eng = engine_factory(CalibrateOptions())
    cfg = resolve_config(UserConfig.build(parse_config_file(small_config), {}), eng.geometry)
    point = GridPoint(0, 2, 6, 3, (1, 3))
    base = synthetic_prompts(cfg, point, 100)
    adv = synthetic_prompts(cfg, point, 100, advance_rounds=5)
    assert synthetic_prompts(cfg, point, 100) == base  # deterministic
    for b, (p0, p1) in enumerate(zip(base, adv, strict=True)):
        assert p1[: len(p0)] == p0
        assert len(p1) - len(p0) == 5 * ((1, 3)[b] + 1)


def _default_like_cfg(mode: str = "target_verify") -> CalibrationConfig:
    """The documented defaults (prefill 2048, KV 1..4096, 8 warmup, 3 x 32-round windows) over
    every legal G of request buckets 1..128 at w = 3."""
    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    return CalibrationConfig(
        model="additive",
        mode=mode,
        draft_width=3,
        request_buckets=buckets,
        target_graph_rows=default_target_rows(buckets, 3),
        contexts=(ContextInterval(2048, 1, 4096),),
    )


@pytest.mark.parametrize("mode", ["target_verify", "draft_step"])
def test_every_point_is_planned_at_the_same_mean_kv(mode):
    """Planned mean KV over a point's measured rounds (prompt + (v + 1) tokens per round) is the
    interval's calibrated KV for every (Bcap, G) within 0.5 tokens (per-request rounding), and no
    request outgrows the feasibility reserve. Evenly spaced end points put Bcap 1 at a 1-token
    prompt (mean KV ~ 1 + 4 * 57.5 = 231 against ~1255 for the others)."""
    cfg = _default_like_cfg(mode)
    if mode == "draft_step":
        rows = {b: tuple(b * (k + 1) for k in range(1, 4)) for b in cfg.request_buckets}
        cfg = replace(cfg, target_graph_rows=rows)
    rounds = mean_measured_rounds(cfg)
    assert rounds == 1 + 8 + 33 / 2 + 32  # 57.5
    target = calibrated_kv_length(cfg, 0)
    assert target == (1 + 2048) / 2 + 4 * rounds
    reserve = reserve_tokens(8, 32, 3, 3)
    points = build_grid(cfg)
    assert len({p.bcap for p in points}) == 8
    for p in points:
        lengths = prompt_lengths(cfg, p)
        assert len(lengths) == p.bcap and lengths.min() >= 1
        rate = np.asarray(p.verify_tokens or (p.k,) * p.bcap) + 1
        planned = lengths.mean() + rate.mean() * rounds
        assert abs(planned - target) <= 0.5, (p, planned, target)
        assert (lengths + rate * (2 + 8 + 3 * 32)).max() <= 2048 + reserve, p


def test_measured_mean_kv_is_the_same_for_every_bucket(tmp_path, engine_factory):
    """End to end on the tiny preset (Bcap 1, 2, 4 at G/Bcap from 1 to 4, 2 windows of 2
    rounds): every point's mean of ``mean_kv_length`` over its windows is the calibrated KV
    within 0.5 tokens, so all points lie within 1 token of each other (before: Bcap 1 at
    G = 1 sat at 5.5 tokens, the others at 19-35)."""
    cfg = {
        "request_buckets": [1, 2, 4],
        "target_graph_rows": {"1": [1, 4], "2": [3, 4, 8], "4": [4, 6, 16]},
        "contexts": [{"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 128}],
        "warmup_steps": 1,
        "window_steps": 2,
        "windows_per_point": 2,
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    opts = CalibrateOptions(config_path=path, out=tmp_path / "t.json", progress=False)
    calibrate(opts, console=Console(quiet=True), engine_factory=engine_factory)
    rows = [json.loads(x)["row"] for x in opts.journal_path.read_text().splitlines()[1:]]
    by_point: dict = {}
    for r in rows:
        by_point.setdefault((r["bcap"], r["g"]), []).append(r["mean_kv_length"])
    eff = resolve_config(
        UserConfig.build(parse_config_file(path), {}), engine_factory.last.geometry
    )
    target = calibrated_kv_length(eff, 0)
    assert target == 16.5 + 4 * (1 + 1 + 1.5 + 1)  # 34.5
    means = {k: float(np.mean(v)) for k, v in by_point.items()}
    assert len(means) == 8 and {b for b, _ in means} == {1, 2, 4}
    for key, kv in means.items():
        assert abs(kv - target) <= 0.5, (key, kv, target)
    assert max(means.values()) - min(means.values()) <= 1.0


def test_runner_build_and_startup_are_reported(tmp_path, small_config, engine_factory):
    """The cold-start breakdown: the engine's build phases (``Engine.build_timings``) and the
    process's start-up before ``calibrate`` are printed and in the JSON timings."""
    import io

    out = io.StringIO()
    opts = CalibrateOptions(config_path=small_config, out=tmp_path / "t.json", progress=False,
                            remeasure_rounds=0, accept_noisy=True)
    summary = calibrate(opts, console=Console(file=out, width=200), engine_factory=engine_factory)
    build = summary["timings"]["build"]
    assert set(build) >= {"load_s", "setup_s", "fuse_s", "total_s"}
    assert 0 <= build["load_s"] <= build["total_s"]
    assert summary["timings"]["startup_s"] > 0  # Linux /proc (CI and the GPU hosts)
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("runner build "))
    assert "load " in line and "process start-up and imports" in line


def test_missing_bytecode_is_reported(tmp_path, monkeypatch, small_config, engine_factory):
    """A package without cached bytecode under an interpreter that writes none is named (every
    process compiles it from source), once in the human output and in the JSON timings;
    nothing is said when the interpreter writes bytecode or the bytecode exists."""
    import io
    import py_compile
    import sys
    import types

    from speccal.calibrate import machine

    pkg = tmp_path / "site" / "slowpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    monkeypatch.setitem(sys.modules, "slowpkg", types.SimpleNamespace(
        __file__=str(pkg / "__init__.py")))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert machine.missing_bytecode(("slowpkg", "not_imported")) == ["slowpkg"]
    line = machine.describe_missing_bytecode(["slowpkg"])
    assert "slowpkg" in line and str(tmp_path / "site") in line and "compileall" in line
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert machine.missing_bytecode(("slowpkg",)) == []
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    py_compile.compile(str(pkg / "__init__.py"), doraise=True)
    assert machine.missing_bytecode(("slowpkg",)) == []

    monkeypatch.setattr(machine, "missing_bytecode", lambda: ["slowpkg"])
    out = io.StringIO()
    opts = CalibrateOptions(config_path=small_config, out=tmp_path / "t.json", progress=False,
                            remeasure_rounds=0, accept_noisy=True)
    summary = calibrate(opts, console=Console(file=out, width=400), engine_factory=engine_factory)
    assert summary["timings"]["no_bytecode"] == ["slowpkg"]
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("Python: no bytecode")]
    assert len(lines) == 1 and "slowpkg" in lines[0]


def test_windows_are_measured_with_the_collector_paused(tmp_path, small_config, engine_factory):
    """No full collection (60-150 ms with torch loaded) lands inside a window: the collector is
    off while drive() measures, and on again after the calibration."""
    import gc

    seen = []

    def factory(*a, **k):
        eng = engine_factory(*a, **k)
        step = eng.step

        def spy(*sa, **sk):
            seen.append(gc.isenabled())
            return step(*sa, **sk)

        eng.step = spy
        return eng

    assert gc.isenabled()
    _cfg(tmp_path, small_config, factory, windows_per_point=1)
    assert seen and not any(seen[-4:]) and gc.isenabled()
