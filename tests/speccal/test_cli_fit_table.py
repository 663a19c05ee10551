"""CLI: ``speccal fit`` then ``speccal table show|validate|diff|export`` (CliRunner, 120 columns)."""

from __future__ import annotations

import csv
import io
import json

import pytest
from typer.testing import CliRunner

from speccal.cli import app
from speccal.costmodel.measurements import write_measurements
from speccal.costmodel.synthetic import make_measurements

from ..costmodel.helpers import COMPAT

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    df = make_measurements(
        bias_ms=4.0,
        alpha_ms={1: 0.0, 2: 0.3, 4: 0.9},
        theta_ms={g: 0.05 * g for g in (1, 2, 3, 4, 6, 8, 12, 16)},
        draft_width=3,
        noise_ms=0.02,
        seed=3,
    )
    write_measurements(df, d / "m.parquet")
    write_measurements(df, d / "m.csv")
    (d / "compat.json").write_text(json.dumps(COMPAT))
    return d


@pytest.fixture(scope="module")
def tables(files):
    a = run(
        "fit",
        files / "m.parquet",
        "--model",
        "additive",
        "--compat",
        files / "compat.json",
        "--out",
        files / "a.json",
    )
    assert a.exit_code == 0, a.output
    s = run("fit", files / "m.csv", "--model", "sps", "--draft-width", 3, "--out", files / "s.json")
    assert s.exit_code == 0, s.output
    return files / "a.json", files / "s.json"


def test_fit_prints_the_report_and_writes_a_loadable_table(files, tables):
    result = run(
        "fit", files / "m.csv", "--compat", files / "compat.json", "--out", files / "again.json"
    )
    assert result.exit_code == 0
    assert "leave-1-point-out" in result.stderr and "leave-1-G-out" in result.stderr
    assert result.stdout == ""
    doc = json.loads((files / "again.json").read_text())
    assert doc["schema_version"] == 1 and doc["compatibility"] == COMPAT
    assert doc["provenance"]["command"].startswith("speccal fit")


def test_fit_json_goes_to_stdout(files):
    result = run(
        "fit",
        files / "m.csv",
        "--model",
        "sps",
        "--draft-width",
        3,
        "--out",
        files / "j.json",
        "--json",
    )
    assert result.exit_code == 0
    out = json.loads(result.stdout)
    assert out["model"] == "sps" and out["draft_width"] == 3
    assert out["compatibility"]["model"]["fingerprint"] == "unknown"  # bare fit, fails closed
    assert out["fits"][0]["residuals"]["n_evaluated"] == 12


def test_show_human_and_json(tables):
    a, _ = tables
    human = run("table", "show", a)
    assert human.exit_code == 0 and "tiny-mtp" in human.stderr and "alpha(Bcap)" in human.stderr
    js = run("table", "show", a, "--json")
    s = json.loads(js.stdout)
    assert s["model"] == "additive" and s["fits"][0]["params"]["bcap_levels"] == [1, 2, 4]


def test_validate_with_expect(files, tables):
    a, s = tables
    ok = run("table", "validate", a, "--expect", files / "compat.json", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout) == {
        "path": str(a),
        "valid": True,
        "schema_version": 1,
        "warnings": json.loads(ok.stdout)["warnings"],
    }
    # The bare SPS fit has an unknown model fingerprint: refused, one line, no traceback.
    refused = run("table", "validate", s, "--expect", files / "compat.json")
    assert refused.exit_code == 2
    assert "model.architecture" in refused.stderr and "Traceback" not in refused.output
    (files / "other_gpu.json").write_text(
        json.dumps({**COMPAT, "device": {"kind": "cpu", "name": "other"}})
    )
    warned = run("table", "validate", a, "--expect", files / "other_gpu.json", "--json")
    assert warned.exit_code == 0
    assert any("device.name" in w for w in json.loads(warned.stdout)["warnings"])


def test_diff_reports_cost_deltas(tables):
    a, s = tables
    out = json.loads(run("table", "diff", a, s, "--json").stdout)
    assert {"field": "calibration.model", "a": "additive", "b": "sps"} in out["metadata"]
    assert out["costs"] and out["max_abs_delta_pct"] > 0
    same = json.loads(run("table", "diff", a, a, "--json").stdout)
    assert same["metadata"] == [] and same["max_abs_delta_pct"] == 0.0


@pytest.mark.parametrize("fmt", ["csv", "markdown"])
def test_export(tables, fmt, tmp_path):
    a, _ = tables
    result = run("table", "export", a, "--format", fmt)
    assert result.exit_code == 0
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(result.stdout)))
        cell = next(r for r in rows if r["bcap"] == "2" and r["g"] == "8")
        assert cell["calibrated"] == "True" and float(cell["cost_ms"]) == pytest.approx(
            4.7, abs=0.05
        )
    else:
        assert result.stdout.startswith("| context_index |")
    to_file = run("table", "export", a, "--format", fmt, "--out", tmp_path / f"x.{fmt}")
    assert (tmp_path / f"x.{fmt}").read_text() == result.stdout and to_file.exit_code == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fit", "{d}/m.csv", "--model", "cubic", "--out", "{d}/x.json"], "--model"),
        (["fit", "{d}/missing.csv", "--out", "{d}/x.json"], "measurements"),
        (["fit", "{d}/m.csv", "--draft-width", "1", "--out", "{d}/x.json"], "k <= draft_width"),
        (
            [
                "fit",
                "{d}/m.csv",
                "--draft-width",
                "5",
                "--compat",
                "{d}/compat.json",
                "--out",
                "{d}/x.json",
            ],
            "--draft-width",
        ),
        (["table", "show", "{d}/m.csv"], "invalid JSON"),
        (["table", "export", "{d}/a.json", "--format", "xlsx"], "--format"),
    ],
)
def test_bad_input_exits_2_with_one_line(files, tables, args, message):
    result = run(*[a.format(d=files) for a in args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
