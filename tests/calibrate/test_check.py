"""``speccal table check`` on the fake engine: spot points, drift, bound, verdict, CLI."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from speccal.base.errors import InputError
from speccal.calibrate.check import check_table, spot_points
from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from speccal.costmodel.table import load_table, parse_table, save_table
from speccal.costmodel.table_build import refit_table
from tests.calibrate.fakes import CONFIG, fake

#: Two contexts, so the spot points cover the first and last interval.
TWO_CONTEXTS = {
    **CONFIG,
    "contexts": [
        {"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 100},
        {"prefill_tokens": 120, "min_kv_length": 101, "max_kv_length": 200},
    ],
}


@pytest.fixture
def table_path(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(TWO_CONTEXTS))
    make = fake()
    opts = CalibrateOptions(config_path=cfg, out=tmp_path / "t.json", progress=False)
    calibrate(
        opts, console=Console(file=open("/dev/null", "w")), engine_factory=make, clock=make.clock
    )
    return tmp_path / "t.json"


def _check(path, **kw):
    make = fake(**kw.pop("engine", {}))
    return check_table(path, model="fake", engine_factory=make, clock=make.clock, **kw), make


def test_spot_points_are_the_grid_extremes(table_path):
    pts = spot_points(load_table(table_path))
    # Bcap 1 at G 2 and 4 (full width), Bcap 2 at G 2 and 8, in both contexts.
    assert [(p.context_index, p.bcap, p.g) for p in pts] == [
        (c, b, g) for c in (0, 1) for b, g in ((1, 2), (1, 4), (2, 2), (2, 8))
    ]


def test_the_table_just_calibrated_passes(table_path):
    report, make = _check(table_path)
    assert report["passed"] and report["drifting"] == []
    assert len(report["points"]) == 8
    assert report["median_abs_drift_pct"] < 1e-6  # the fake prices every round exactly
    assert report["bound_pct"] == 10.0 and "floor" in report["bound_source"]
    assert make.last.windows == 8 * TWO_CONTEXTS["windows_per_point"]


def test_a_drifting_point_is_named_and_the_check_fails(table_path):
    # Every spot point costs 30 % more here; then only Bcap 2 at G 8, by 3 ms (3.5 -> 6.5 ms).
    slow = {(b, g): 30.0 for b, g in ((1, 2), (1, 4), (2, 2), (2, 8))}
    report, _ = _check(table_path, engine={"factors": {k: [1.3] * 9 for k in slow}})
    assert not report["passed"]
    assert report["median_abs_drift_pct"] == pytest.approx(30.0, abs=1e-6)
    assert {(r["bcap"], r["g"]) for r in report["drifting"]} == set(slow)
    one, _ = _check(table_path, engine={"extra_ms": {(2, 8): 3.0}})
    assert one["passed"]  # median of 8 points is still 0
    assert [(r["context_index"], r["bcap"], r["g"]) for r in one["drifting"]] == [
        (0, 2, 8),
        (1, 2, 8),
    ]


def test_a_perturbed_parameter_fails_and_an_explicit_bound_is_used(table_path, tmp_path):
    # The table of a machine 1.5x slower: every window slowed, refitted (a table whose stored
    # parameters disagree with its own points is refused at load: test_table_forged.py).
    table = load_table(table_path)
    doc = table.to_json_dict()
    for fit in doc["fits"]:
        for w in fit["windows"]:
            w["elapsed_s"] *= 1.5
            w["step_ms"] *= 1.5
    slow = parse_table(json.dumps(doc), source="slowed windows")
    bad = tmp_path / "perturbed.json"
    save_table(refit_table(slow), bad)
    report, _ = _check(bad)
    assert not report["passed"] and len(report["drifting"]) == 8
    loose, _ = _check(bad, max_drift_pct=60.0)
    assert loose["passed"] and loose["bound_source"] == "flag"


def test_bad_options_are_refused(table_path):
    with pytest.raises(InputError, match="--windows"):
        _check(table_path, windows=0)
    with pytest.raises(InputError, match="--max-drift-pct"):
        _check(table_path, max_drift_pct=-1.0)


def _cli(monkeypatch, path, *args, **engine):
    import functools

    from typer.testing import CliRunner

    from speccal.calibrate import check as check_mod
    from speccal.cli.app import app

    make = fake(**engine)
    monkeypatch.setattr(
        check_mod,
        "check_table",
        functools.partial(check_table, engine_factory=make, clock=make.clock),
    )
    return CliRunner().invoke(
        app, ["table", "check", str(path), "--model", "fake", *args], env={"COLUMNS": "100"}
    )


def test_cli_exit_status_json_and_named_points(monkeypatch, table_path):
    ok = _cli(monkeypatch, table_path, "--json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["passed"] is True
    factors = {k: [1.3] * 9 for k in ((1, 2), (1, 4), (2, 2), (2, 8))}
    bad = _cli(monkeypatch, table_path, factors=factors)
    assert bad.exit_code == 1
    assert "FAILED: median |drift| 30.0 %" in bad.stderr and "recalibrate" in bad.stderr
    assert bad.stderr.count("DRIFT") == 8
    refused = _cli(monkeypatch, table_path, "--windows", "0")
    assert refused.exit_code == 2 and "--windows" in refused.stderr


def test_explicit_contexts_are_measured_instead_and_must_lie_in_the_span(table_path):
    report, make = _check(table_path, contexts=[(30, 20, 100)])
    assert report["passed"] and len(report["points"]) == 4
    assert {r["context_index"] for r in report["points"]} == {None}
    assert all(
        r["context"] == [30, 20, 100] and 20 <= r["kv_length"] <= 100 for r in report["points"]
    )
    known, _ = _check(table_path, contexts=[(120, 101, 200)])
    assert {r["context_index"] for r in known["points"]} == {1}
    with pytest.raises(InputError, match="inside the table's span"):
        _check(table_path, contexts=[(300, 250, 400)])


def test_cli_context_option(monkeypatch, table_path):
    res = _cli(monkeypatch, table_path, "--context", "30:20:100", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["points"][0]["context"] == [30, 20, 100]
    bad = _cli(monkeypatch, table_path, "--context", "60:20")
    assert bad.exit_code == 2 and "PREFILL:MIN_KV:MAX_KV" in bad.stderr
