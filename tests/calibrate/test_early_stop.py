"""Fewer windows where the spread is tiny (``speccal.calibrate.gate.EarlyStop``): every point
gets ``min_windows_per_point`` windows, only a point whose windows spread beyond the early-stop
bound gets the rest of ``windows_per_point`` (window-major, journaled, resumable); the rule is
resolved per device kind, validated, reported, and the fit and the gate work on the mixed counts.

The fake engine prices every round exactly (``tests.calibrate.fakes``): a point without factors
has windows 0 % apart, a factor list makes its n-th window slower by that factor.
"""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from speccal.base.errors import InputError
from speccal.base.geometry import Geometry
from speccal.calibrate.config import (
    KIND_DEFAULTS,
    UserConfig,
    parse_config_obj,
    resolve_config,
)
from speccal.calibrate.gate import (
    EarlyStop,
    GateConfig,
    points_for_more_windows,
    points_to_remeasure,
    select_windows,
)
from speccal.calibrate.grid import GridPoint
from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from speccal.cli import app
from speccal.costmodel.table import load_table
from tests.calibrate.fakes import CONFIG, POINTS, fake, patch_cli

#: Four windows at most, two first: the rest of round 0 is two windows, so their order shows.
EARLY = {**CONFIG, "windows_per_point": 4, "min_windows_per_point": 2,
         "early_stop_spread_pct": 1.0}
GATE = GateConfig(max_spread_pct=10.0, max_heldout_pct=10.0, remeasure_rounds=2)


def _cfg(tmp_path, doc) -> object:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(doc))
    return path


def run(tmp_path, doc, make, *, console=None, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("max_spread_pct", 10.0)
    kw.setdefault("remeasure_rounds", 2)
    opts = CalibrateOptions(config_path=_cfg(tmp_path, doc), out=tmp_path / "t.json", **kw)
    return calibrate(opts, console=console or Console(stderr=True, quiet=True),
                     engine_factory=make, clock=make.clock)


def journal_rows(tmp_path) -> list[dict]:
    lines = (tmp_path / "t.json.journal.jsonl").read_text().splitlines()
    return [json.loads(x)["row"] for x in lines[1:]]


def windows_of(rows) -> dict:
    out: dict = {}
    for r in rows:
        b, g, wi = ((r["bcap"], r["g"], r["window_index"]) if isinstance(r, dict)
                    else (r.bcap, r.g, r.window_index))
        out.setdefault((b, g), []).append(wi)
    return {k: sorted(v) for k, v in out.items()}


def _row(g, wi, step_ms):
    return {"context_index": 0, "bcap": 1, "g": g, "k": 3, "window_index": wi,
            "step_ms": step_ms}


# ------------------------------------------------------------------------- the rule


def test_rest_of_round_zero_is_due_only_past_the_bound():
    early = EarlyStop(windows_per_point=3, min_windows=2, spread_pct=1.0)
    quiet, noisy, half = GridPoint(0, 1, 2, 3), GridPoint(0, 1, 4, 3), GridPoint(0, 1, 6, 3)
    rows = [_row(2, 0, 3.0), _row(2, 1, 3.02),  # 0.67 %: stops
            _row(4, 0, 3.0), _row(4, 1, 3.1),  # 3.3 %: the rest is due
            _row(6, 0, 3.0)]  # its first windows are not all measured yet
    assert points_for_more_windows(rows, (quiet, noisy, half), early) == (noisy,)
    rows.append(_row(4, 2, 3.0))  # the rest measured: still due (drive skips what is done)
    assert points_for_more_windows(rows, (quiet, noisy, half), early) == (noisy,)
    # the fit: the quiet point's round 0 is complete with two windows, the noisy one's with
    # three, the third point's is not
    sel = select_windows(rows, (quiet, noisy, half), 3, GATE, early)
    assert [q.point for q in sel.points] == [quiet, noisy]
    assert sel.points[0].spreads[0] == pytest.approx(100 * 0.02 / 3.01)
    assert sel.points[1].spreads[0] == pytest.approx(100 * 0.1 / 3.0)
    assert {(r["g"], r["window_index"]) for r in sel.rows} >= {(2, 0), (2, 1), (4, 2)}
    # without the rule every round needs three windows: the quiet point has no complete round
    assert [q.point for q in select_windows(rows, (quiet, noisy), 3, GATE).points] == [noisy]
    # the gate's spread bound caps the early stop's (a stopped round is never noisy)
    class Cfg:
        adaptive_windows, windows_per_point, min_windows_per_point = True, 3, 2
        early_stop_spread_pct = 50.0
    assert EarlyStop.of(Cfg, GATE).spread_pct == GATE.max_spread_pct
    Cfg.early_stop_spread_pct = None
    assert EarlyStop.of(Cfg, GATE).spread_pct == GATE.max_spread_pct
    Cfg.adaptive_windows = False
    assert EarlyStop.of(Cfg, GATE) is None


def test_remeasure_waits_for_the_rest_of_round_zero():
    early = EarlyStop(windows_per_point=3, min_windows=2, spread_pct=1.0)
    noisy = GridPoint(0, 1, 4, 3)
    rows = [_row(4, 0, 3.0), _row(4, 1, 4.0)]  # 33 % over its first two windows
    assert points_to_remeasure(rows, (noisy,), 3, 1, GATE, early) == ()
    rows.append(_row(4, 2, 3.0))
    assert points_to_remeasure(rows, (noisy,), 3, 1, GATE, early) == (noisy,)


# ------------------------------------------------------------------------- calibration runs


def test_quiet_points_keep_two_windows_a_noisy_one_gets_the_rest(tmp_path):
    # G 4 at Bcap 1 is 5 % slow in its second window: beyond 1 %, within the gate's 10 %
    make = fake(factors={(1, 4): [1.0, 1.05]})
    out = io.StringIO()
    summary = run(tmp_path, EARLY, make, console=Console(file=out, width=200))
    rows = journal_rows(tmp_path)
    got = windows_of(rows)
    assert got.pop((1, 4)) == [0, 1, 2, 3]
    assert got == {p: [0, 1] for p in POINTS if p != (1, 4)}
    assert make.last.windows == len(POINTS) * 2 + 2
    # window-major: every point's first two windows before any of the rest
    assert [r["window_index"] for r in rows] == [0] * 5 + [1] * 5 + [2, 3]
    table = load_table(tmp_path / "t.json")
    n = {(p.bcap, p.g): p.n_windows for p in table.fits[0].diagnostics.points}
    assert n == {p: 4 if p == (1, 4) else 2 for p in POINTS}
    q = table.calibration.quality
    assert q.passed and q.heldout_pct == pytest.approx(0.0, abs=1e-6)
    assert q.flagged_points == [] and q.remeasured_windows == 0
    assert table.calibration.sources["min_windows_per_point"] == "file"
    count = summary["window_count"]
    assert count["rule"] == "early_stop" and count["points_by_round0_windows"] == {"2": 4, "4": 1}
    assert count["early_stop"] == {"windows_per_point": 4, "min_windows": 2, "spread_pct": 1.0}
    assert summary["effective_config"]["windows"] == {
        "windows_per_point": 4, "min_windows_per_point": 2, "early_stop_spread_pct": 1.0}
    phases = summary["timings"]["phases"]
    assert (phases["first"]["windows"], phases["more"]["windows"]) == (10, 2)
    text = out.getvalue()
    assert "early stop: 4 of 5 points keep 2 windows (spread within 1 %); 1 get windows 3..4" in text
    for phase in ("compile/capture", "transitions", "warm-up rounds", "measuring", "fit"):
        assert phase in text.split("total ")[-1]


def test_a_fixed_count_measures_every_window(tmp_path):
    summary = run(tmp_path, {**CONFIG, "windows_per_point": 4}, fake())
    assert windows_of(journal_rows(tmp_path)) == {p: [0, 1, 2, 3] for p in POINTS}
    assert summary["window_count"]["rule"] == "fixed"
    assert summary["window_count"]["points_by_round0_windows"] == {"4": 5}
    assert "more" not in summary["timings"]["phases"]


def test_a_noisy_point_is_completed_then_remeasured(tmp_path):
    make = fake(factors={(1, 4): [1.0, 1.3, 1.0, 1.0]})
    run(tmp_path, EARLY, make)
    assert windows_of(journal_rows(tmp_path))[(1, 4)] == list(range(8))  # round 0 + round 1
    q = load_table(tmp_path / "t.json").calibration.quality
    (flagged,) = q.flagged_points
    assert flagged.spread_pct == pytest.approx([30.0, 0.0]) and not flagged.noisy
    assert q.remeasured_windows == 4


def test_resume_mid_rest_measures_only_what_is_missing(tmp_path):
    factors = {(1, 4): [1.0, 1.05], (2, 4): [1.0, 0.95]}
    # 10 first windows, then the crash at the second window of the rest
    make = fake(factors=factors, stop_after_windows=len(POINTS) * 2 + 1)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, EARLY, make)
    assert [(r["g"], r["bcap"], r["window_index"]) for r in journal_rows(tmp_path)][10:] == [
        (4, 1, 2)]
    again, out = fake(), io.StringIO()
    run(tmp_path, EARLY, again, resume=True, progress=True,
        console=Console(file=out, width=200))
    # the journal, not the resumed engine's own (quiet) windows, decides: windows 3 of (1, 4)
    # and 2, 3 of (2, 4) are missing, in window-major order
    assert again.last.windows == 3
    rows = journal_rows(tmp_path)
    assert [(r["bcap"], r["g"], r["window_index"]) for r in rows][10:] == [
        (1, 4, 2), (2, 4, 2), (1, 4, 3), (2, 4, 3)]
    total = len(POINTS) * 2 + 4
    assert f"more windows, {total - 3}/{total} windows" in out.getvalue()
    assert f"more windows, {total}/{total} windows" in out.getvalue()
    fitted = windows_of(load_table(tmp_path / "t.json").fits[0].windows)

    # the same plan uninterrupted fits the same windows
    whole = tmp_path / "whole"
    whole.mkdir()
    run(whole, EARLY, fake(factors=factors))
    assert windows_of(load_table(whole / "t.json").fits[0].windows) == fitted
    assert windows_of(journal_rows(whole)) == windows_of(rows)

    # once more: nothing is missing, nothing measured
    last = fake()
    run(tmp_path, EARLY, last, resume=True)
    assert last.last.windows == 0


def test_a_journal_of_the_other_rule_is_another_run(tmp_path):
    run(tmp_path, {**CONFIG, "windows_per_point": 4}, fake())
    with pytest.raises(InputError, match="another run"):
        run(tmp_path, EARLY, fake(), resume=True)


# ------------------------------------------------------------------------- defaults and bad values


def _geometry() -> Geometry:
    return Geometry(draft_width=3, request_buckets=(1, 2), kv_capacity_tokens=65536,
                    max_model_len=8192)


def _resolve(kind="cuda", **flags):
    return resolve_config(UserConfig.build(flags=flags), _geometry(), device_kind=kind)


def test_on_by_default_on_cuda_only():
    gpu = _resolve("cuda")
    assert (gpu.min_windows_per_point, gpu.early_stop_spread_pct) == (
        KIND_DEFAULTS["cuda"]["min_windows_per_point"],
        KIND_DEFAULTS["cuda"]["early_stop_spread_pct"])
    assert gpu.adaptive_windows and gpu.sources["min_windows_per_point"] == "default (cuda)"
    cpu = _resolve("cpu")
    assert not cpu.adaptive_windows and cpu.min_windows_per_point is None
    assert cpu.early_stop_spread_pct is None and cpu.windows_per_point == 6
    # a default never refuses a run: too few windows to save one, or the count fixed by hand
    two = _resolve("cuda", windows_per_point=2)
    assert two.min_windows_per_point is None and two.early_stop_spread_pct is None
    assert "no window for the early stop" in two.notes["min_windows_per_point"]
    off = _resolve("cuda", min_windows_per_point=3)
    assert not off.adaptive_windows and off.early_stop_spread_pct is None
    # asked for on cpu: the gate's spread bound unless given
    asked = _resolve("cpu", min_windows_per_point=3)
    assert asked.adaptive_windows and asked.early_stop_spread_pct is None
    assert asked.windows_dict() == {"windows_per_point": 6, "min_windows_per_point": 3,
                                    "early_stop_spread_pct": None}
    assert "min_windows_per_point" not in asked.to_dict()  # the table's block stays as it was


@pytest.mark.parametrize("flags, field, expected", [
    ({"min_windows_per_point": 1}, "min_windows_per_point", "an integer in 2..windows_per_point=3"),
    ({"min_windows_per_point": 4}, "min_windows_per_point", "an integer in 2..windows_per_point=3"),
    ({"min_windows_per_point": True}, "min_windows_per_point", "an integer in 2.."),
    ({"early_stop_spread_pct": 0.0}, "early_stop_spread_pct", "a finite percentage > 0"),
    ({"early_stop_spread_pct": float("nan")}, "early_stop_spread_pct", "a finite percentage"),
    ({"early_stop_spread_pct": -1.0}, "early_stop_spread_pct", "a finite percentage > 0"),
])
def test_bad_values_refused_naming_the_key(flags, field, expected):
    with pytest.raises(InputError) as info:
        _resolve("cuda", windows_per_point=3, **flags)
    assert info.value.field == field and expected in info.value.expected


def test_a_bound_without_an_adaptive_count_is_refused():
    with pytest.raises(InputError) as info:
        _resolve("cpu", early_stop_spread_pct=2.0)
    assert info.value.field == "early_stop_spread_pct"
    assert "min_windows_per_point < windows_per_point=6" in info.value.expected


def test_config_file_keys_are_strict():
    parsed = parse_config_obj({"min_windows_per_point": 2, "early_stop_spread_pct": 1})
    cfg = resolve_config(UserConfig.build(parsed), _geometry(), device_kind="cpu")
    assert (cfg.min_windows_per_point, cfg.early_stop_spread_pct) == (2, 1.0)
    assert cfg.sources["early_stop_spread_pct"] == "file"
    with pytest.raises(InputError) as info:
        parse_config_obj({"calibration": {"min_windows_per_point": "2"}})
    assert info.value.field == "calibration.min_windows_per_point"


def test_cli_options_set_and_refuse_the_rule(tmp_path, monkeypatch):
    make = fake()
    patch_cli(monkeypatch, make)
    cfg = _cfg(tmp_path, {**CONFIG, "windows_per_point": 4})
    runner = CliRunner()
    base = ["calibrate", "--config", str(cfg), "--out", str(tmp_path / "t.json"), "--json",
            "--max-spread-pct", "10"]
    res = runner.invoke(app, [*base, "--min-windows-per-point", "2",
                              "--early-stop-spread-pct", "0.5"], terminal_width=200)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["effective_config"]["windows"]["early_stop_spread_pct"] == 0.5
    assert summary["effective_config"]["sources"]["min_windows_per_point"] == "flag"
    assert summary["window_count"]["points_by_round0_windows"] == {"2": 5}
    bad = runner.invoke(app, [*base, "--overwrite", "--min-windows-per-point", "5"],
                        terminal_width=200)
    assert bad.exit_code == 2 and "min_windows_per_point" in bad.stderr
