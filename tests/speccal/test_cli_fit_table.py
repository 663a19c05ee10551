"""CLI: ``speccal fit`` then ``speccal table show|validate|diff|export`` (CliRunner, 120 columns)."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from speccal.calibrate.pipeline import CalibrateOptions, make_engine
from speccal.cli import app
from speccal.costmodel.measurements import write_measurements
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table import load_table
from speccal.costmodel.table_schema import SCHEMA_VERSION

from ..costmodel.helpers import COMPAT, compat, kernels_with

GOLDEN = Path(__file__).parents[1] / "costmodel" / "fixtures" / "table_v6_additive.json"
TINY = Path(__file__).parents[2] / "tables" / "tiny-cpu.json"

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


# ------------------------------------------------------------------------ fit: reading the rows


def _rows(tmp_path, name, *, mode="draft_step", drop_mode=False, **kw):
    df = make_measurements(
        bias_ms=4.0,
        alpha_ms={1: 0.0, 2: 0.3, 4: 0.9},
        theta_ms={g: 0.05 * g for g in (1, 2, 3, 4, 6, 8, 12, 16)},
        draft_width=3,
        noise_ms=0.02,
        seed=3,
        mode=mode,
        **kw,
    )
    if drop_mode:
        df = df.drop(columns=["mode"])
    path = tmp_path / name
    df.to_csv(path, index=False)
    return df, path


def test_fit_refuses_k_above_the_draft_width(tmp_path):
    _, path = _rows(tmp_path, "k3.csv")  # draft_step rows measure k = 1..3
    r = run("fit", path, "--draft-width", 2, "--out", tmp_path / "t.json")
    assert r.exit_code == 2 and "measurements.k: got 3, expected k <= draft_width = 2" in r.stderr
    assert not (tmp_path / "t.json").exists()


def test_fit_counts_each_window_once(tmp_path):
    df, _ = _rows(tmp_path, "m.csv")
    twice = df.iloc[:4].copy()  # exact copies (a journal read twice)
    other = df.iloc[4:6].copy()
    other["elapsed_s"] *= 2  # same windows measured again with other timings
    other["step_ms"] *= 2
    pd.concat([df, twice, other]).to_csv(tmp_path / "dup.csv", index=False)
    r = run("fit", tmp_path / "dup.csv", "--out", tmp_path / "t.json", "--json")
    assert r.exit_code == 0, r.output
    (warning,) = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert "dropped 6 row(s) repeating a window identity" in warning
    assert "2 of them with other timings" in warning and "first row kept" in warning
    table = load_table(tmp_path / "t.json")
    assert sum(len(f.windows) for f in table.fits) == len(df)
    assert {p.n_windows for p in table.fits[0].diagnostics.points} == {3}
    # the first row of each window is kept: the refit equals the fit of the clean rows
    clean = run("fit", tmp_path / "m.csv", "--out", tmp_path / "c.json")
    assert clean.exit_code == 0, clean.output
    assert load_table(tmp_path / "c.json").fits == table.fits


def test_fit_without_a_mode_column_is_target_verify_and_says_so(tmp_path):
    _, tv = _rows(tmp_path, "tv.csv", mode="target_verify", drop_mode=True)
    r = run("fit", tv, "--out", tmp_path / "t.json")
    assert r.exit_code == 0, r.output
    assert "mode target_verify (default: the rows have no mode column; calibrate's default)" in (
        " ".join(r.stderr.split())
    )
    table = load_table(tmp_path / "t.json")
    assert table.mode == "target_verify" and table.calibration.sources["mode"] == "default"
    # draft_step rows without their mode column are impossible target_verify rows: refused ...
    _, ds = _rows(tmp_path, "ds.csv", drop_mode=True)
    r = run("fit", ds, "--out", tmp_path / "d.json")
    assert r.exit_code == 2
    assert "one k (= the draft width w) in every target_verify row" in r.stderr
    r = run("fit", ds, "--draft-width", 3, "--out", tmp_path / "d.json")
    assert r.exit_code == 2
    assert "k = draft_width = 3 in target_verify mode" in r.stderr
    # ... unless the user says what they are
    r = run("fit", ds, "--mode", "draft_step", "--out", tmp_path / "d.json")
    assert r.exit_code == 0, r.output
    d = load_table(tmp_path / "d.json")
    assert d.mode == "draft_step" and d.calibration.sources["mode"] == "flag"


def test_fit_never_widens_the_geometry_past_full_width(tmp_path):
    df, _ = _rows(tmp_path, "tv.csv", mode="target_verify")
    assert run("fit", tmp_path / "tv.csv", "--out", tmp_path / "t.json").exit_code == 0
    geo = load_table(tmp_path / "t.json").geometry()
    assert all(max(gs) == b * 4 for b, gs in geo.target_rows.items())
    wide = df.copy()
    wide.loc[(wide["bcap"] == 2) & (wide["g"] == 8), "g"] = 12  # > Bcap * (w + 1) = 8
    wide.to_csv(tmp_path / "wide.csv", index=False)
    r = run("fit", tmp_path / "wide.csv", "--out", tmp_path / "w.json")
    assert r.exit_code == 2 and "measurements.g: got 12" in r.stderr
    assert "[2, 8] for bcap 2" in r.stderr and not (tmp_path / "w.json").exists()


@pytest.mark.parametrize(
    ("args", "source", "width"),
    [(["--draft-width", "3"], "flag", 3), ([], "measurements", 3)],
)
def test_a_bare_fit_invents_nothing_about_the_run(tmp_path, args, source, width):
    _, path = _rows(tmp_path, "m.csv")
    r = run("fit", path, *args, "--out", tmp_path / "t.json")
    assert r.exit_code == 0, r.output
    table = load_table(tmp_path / "t.json")
    c = table.compatibility
    assert (c.topology.tp, c.topology.dp, c.graph_mode, c.device.kind) == ("unknown",) * 4
    assert table.draft_width == width and table.calibration.sources["draft_width"] == source
    assert "recorded as unknown, so a real engine refuses this table" in " ".join(r.stderr.split())
    # against a real engine's compatibility: refused, naming the fields it does not know
    (tmp_path / "c.json").write_text(json.dumps(COMPAT))
    refused = run("table", "validate", tmp_path / "t.json", "--expect", tmp_path / "c.json")
    assert refused.exit_code == 2
    for field in ("topology.tp: expected 1, found 'unknown'", "graph_mode: expected 'split'"):
        assert field in refused.stderr, field
    assert "device.kind: expected 'cpu', found 'unknown'" in refused.stderr


def test_fit_records_the_compat_width_source(files):
    r = run("fit", files / "m.csv", "--compat", files / "compat.json", "--out", files / "w.json")
    assert r.exit_code == 0, r.output
    assert load_table(files / "w.json").calibration.sources["draft_width"] == "compatibility"


# ------------------------------------------------------------------------ export, compat


def assert_close(a, b, where="fit"):
    """Equal structure and values, floats to 1e-9 relative (another machine's summation order)."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for k in a:
            assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (where, a, b)
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
@pytest.mark.parametrize("source", ["shipped", "shipped-draft-step", "fitted"])
def test_export_measurements_round_trips_through_fit(tables, tmp_path, source, suffix):
    table_path = {
        "shipped": TINY,  # target_verify, calibrated on a CPU
        "shipped-draft-step": TINY.with_name("dense-2b-h200-draft-step.json"),  # H200
        "fitted": tables[0],
    }[source]
    table = load_table(table_path)
    (tmp_path / "compat.json").write_text(json.dumps(table.compatibility.model_dump(mode="json")))
    rows = tmp_path / f"rows{suffix}"
    r = run("table", "export", table_path, "--format", "measurements", "--out", rows)
    assert r.exit_code == 0, r.output
    assert f"fit them with: speccal fit {rows}" in " ".join(r.stderr.split())
    fit = run(
        "fit",
        rows,
        "--model",
        table.model,
        "--compat",
        tmp_path / "compat.json",
        "--out",
        tmp_path / "refit.json",
    )
    assert fit.exit_code == 0, fit.output
    refit = load_table(tmp_path / "refit.json")
    if source == "fitted":  # fitted here: the same windows through the same arithmetic
        assert refit.fits == table.fits  # parameters, raw windows and diagnostics, exactly
    for a, b in zip(refit.fits, table.fits, strict=True):  # shipped: fitted on another machine
        assert a.windows == b.windows
        if source == "shipped-draft-step":
            # a schema 2 draft_step fit had no draft-forward term; refitted, the selection
            # chooses one: the measured points stay priced within their noise
            for p in b.diagnostics.points:
                got = refit.cost_ms(p.bcap, p.g, a.min_kv_length, p.k)
                assert got.calibrated
                assert got.cost_ms == pytest.approx(p.step_ms, rel=0.05), (p.bcap, p.g)
            continue
        assert_close(a.model_dump(), b.model_dump())  # to rounding of the last digits
    assert refit.mode == table.mode and refit.compatibility == table.compatibility
    for key in ("request_buckets", "target_graph_rows", "contexts", "window_steps"):
        assert getattr(refit.calibration, key) == getattr(table.calibration, key), key


def test_table_compat_writes_the_engine_compatibility_calibrate_builds(tmp_path):
    r = run("table", "compat", "--model", "tiny", "--out", tmp_path / "c.json")
    assert r.exit_code == 0, r.output
    written = json.loads((tmp_path / "c.json").read_text())
    assert written == make_engine(CalibrateOptions(model="tiny")).compatibility()
    assert written["verification_mode"] == "forced" and written["draft_width"] == 3
    stdout = run("table", "compat", "--model", "tiny", "--draft-width", "2")
    assert stdout.exit_code == 0 and json.loads(stdout.stdout)["draft_width"] == 2
    # what validate --expect takes: the shipped tiny table loads against it (warnings only)
    ok = run("table", "validate", TINY, "--expect", tmp_path / "c.json", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["valid"] is True
