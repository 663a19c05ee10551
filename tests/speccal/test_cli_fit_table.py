"""CLI: ``speccal fit`` then ``speccal table show|validate|diff|export`` (CliRunner, 120 columns)."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speccal.cli import app
from speccal.costmodel.measurements import write_measurements
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table_schema import SCHEMA_VERSION

from ..costmodel.helpers import COMPAT, compat, kernels_with

GOLDEN = Path(__file__).parents[1] / "costmodel" / "fixtures" / "table_v2_additive.json"

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
    assert doc["schema_version"] == SCHEMA_VERSION and doc["compatibility"] == COMPAT
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
        "schema_version": SCHEMA_VERSION,
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


def test_show_displays_the_execution_path(tables):
    a, s = tables
    human = run("table", "show", a, "--no-params")
    assert human.exit_code == 0, human.output
    for text in (
        "attention_backend",
        "triton",
        "in_graph",
        COMPAT["kernels"]["digest"],
        "kernels.gemv.stages",
        "kernels.pdl.mode",
        '"late"',
    ):
        assert text in human.stderr, text
    execution = json.loads(run("table", "show", a, "--json").stdout)["execution"]
    assert execution["kernel_config"]["gemv.panel_max_rows"] == 16
    bare = run("table", "show", s, "--no-params")  # a bare fit records no kernels
    assert "kernels" in bare.stderr and "unknown (not recorded)" in bare.stderr


def test_diff_names_differing_kernel_fields(files, tables):
    a, _ = tables
    other = compat(kernels=kernels_with(**{"gemv.stages": 4}), input_update="host")
    (files / "other_kernels.json").write_text(json.dumps(other))
    fitted = run(
        "fit", files / "m.csv", "--compat", files / "other_kernels.json", "--out", files / "k.json"
    )
    assert fitted.exit_code == 0, fitted.output
    out = json.loads(run("table", "diff", a, files / "k.json", "--json").stdout)
    meta = {m["field"]: (m["a"], m["b"]) for m in out["metadata"]}
    assert meta == {
        "compatibility.input_update": ("in_graph", "host"),
        "compatibility.kernels.config.gemv.stages": (3, 4),
        "compatibility.kernels.digest": (COMPAT["kernels"]["digest"], other["kernels"]["digest"]),
    }
    human = run("table", "diff", a, files / "k.json")
    assert "compatibility.kernels.config.gemv.stages" in human.stderr
    warned = run("table", "validate", files / "k.json", "--expect", files / "compat.json", "--json")
    (note,) = json.loads(warned.stdout)["warnings"]
    assert "gemv.stages: table=4 running=3" in note


def _nan_table(tmp_path, where: str, value: float) -> Path:
    doc = json.loads(GOLDEN.read_text())
    node = doc
    *parents, leaf = where.split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(leaf) if leaf.isdigit() else leaf] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))  # NaN / Infinity tokens, as a careless writer leaves them
    return path


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("fits.0.additive.bias_ms", math.nan),
        ("fits.1.additive.theta_ms.3", math.inf),
        ("fits.0.additive.bias_ms", -1.0),
        ("fits.0.windows.2.elapsed_s", -0.5),
    ],
)
@pytest.mark.parametrize("command", ["validate", "show"])
def test_validate_and_show_refuse_unphysical_tables(tmp_path, command, where, value):
    bad = _nan_table(tmp_path, where, value)
    result = run("table", command, bad)
    assert result.exit_code == 2, result.output
    assert f"{where}: got {value!r}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_bench_with_an_all_nan_table_is_refused_with_the_real_cause(tmp_path):
    doc = json.loads(GOLDEN.read_text())
    for f in doc["fits"]:
        p = f["additive"]
        p["bias_ms"] = math.nan
        p["alpha_ms"] = [math.nan] * len(p["alpha_ms"])
        p["theta_ms"] = [math.nan] * len(p["theta_ms"])
    bad = tmp_path / "nan.json"
    bad.write_text(json.dumps(doc))
    result = run(
        "bench",
        "--policy",
        "adaptive-step",
        "--cost-table",
        bad,
        "--request-buckets",
        "1,2,4",
        "--num-requests",
        "2",
        "--max-tokens",
        "4",
        "--prompt-len",
        "8",
    )
    assert result.exit_code == 2, result.output
    assert "fits.0.additive.bias_ms: got nan" in result.stderr and "finite" in result.stderr
    assert "Traceback" not in result.output


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
