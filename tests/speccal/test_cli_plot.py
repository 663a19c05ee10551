"""CLI: ``speccal plot TABLE --out DIR`` (CliRunner, 120 columns)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from speccal.cli import app
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table import save_table
from speccal.costmodel.table_build import build_table
from speccal.scenarios import generate, make_scenario
from speccal.trace import save_trace

from ..costmodel.helpers import COMPAT

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("plot")
    df = make_measurements(
        bias_ms=4.0,
        alpha_ms={1: 0.0, 2: 0.3, 4: 0.9, 8: 2.0},
        theta_ms={g: 0.4 * g for g in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)},
        draft_width=3,
        contexts=((2048, 1, 4096),),
        noise_ms=0.02,
        seed=5,
    )
    path = d / "t.json"
    save_table(build_table(df, compatibility=COMPAT), path)
    return path


def test_plot_writes_table_figures(table_path, tmp_path):
    r = run("plot", table_path, "--out", tmp_path / "figs", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    names = sorted(p.rsplit("/", 1)[-1] for p in d["plots"])
    assert names == ["table_components.png", "table_fit.png", "table_residuals.png"]
    for p in d["plots"]:
        with open(p, "rb") as fh:
            assert fh.read(8) == PNG_MAGIC
    assert "replay" not in d


def test_plot_with_scenario_adds_replay_figures(table_path, tmp_path):
    r = run(
        "plot", table_path, "--out", tmp_path, "--scenario", "transition", "--rounds", 600, "--json"
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    names = {p.rsplit("/", 1)[-1] for p in d["plots"]}
    assert {"replay_timeline.png", "replay_throughput.png", "table_fit.png"} <= names
    assert d["replay"]["rounds"] == 600
    assert d["replay"]["best_fixed"].startswith("fixed:")
    assert "adaptive-step" in d["replay"]["gain_vs_best_fixed_pct"]


def test_plot_with_trace_file(table_path, tmp_path):
    tr = generate(make_scenario("steady", rounds=300, draft_width=3, num_requests=4, seed=1))
    trace = save_trace(tr, tmp_path / "steady.jsonl")
    r = run("plot", table_path, "--out", tmp_path / "o", "--trace", trace)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o" / "replay_timeline.png").read_bytes()[:8] == PNG_MAGIC
    assert "wrote" in r.stderr and "best fixed" in r.stderr


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--scenario", "nope"), "scenario"),
        (("--scenario", "steady", "--trace", "x.jsonl"), "--trace/--scenario"),
        (("--trace", "missing.jsonl"), "trace"),
    ],
)
def test_plot_bad_input_exits_2(table_path, tmp_path, extra, needle):
    r = run("plot", table_path, "--out", tmp_path / "o", *extra)
    assert r.exit_code == 2, r.output
    assert needle in r.stderr
    assert not (tmp_path / "o").exists()  # refused before drawing anything


def test_plot_refuses_unreadable_table_and_file_as_out(table_path, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = run("plot", bad, "--out", tmp_path / "o")
    assert r.exit_code == 2 and "invalid JSON" in r.stderr
    f = tmp_path / "file"
    f.write_text("x")
    r = run("plot", table_path, "--out", f)
    assert r.exit_code == 2 and "--out" in r.stderr
