"""An output that is one of the command's inputs (or another of its outputs) is refused before
anything is written: same spelling, another spelling, a symlink, a hard link; one line naming
both options and the path, exit 2, the input's bytes untouched."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speccal.base.errors import OutputError
from speccal.base.paths import check_outputs, same_file
from speccal.cli import app

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}
REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "tables" / "tiny-cpu.json"  # target_verify
STEP_TABLE = REPO / "tables" / "dense-2b-h200-draft-step.json"  # draft_step (vllm export)


def _invoke(tmp_path: Path, *args: str):
    cwd = os.getcwd()
    os.chdir(tmp_path)  # relative spellings resolve here
    try:
        return CliRunner().invoke(app, list(args), env=ENV)
    finally:
        os.chdir(cwd)


def _one_error(res) -> str:
    assert res.exit_code == 2, res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture
def files(tmp_path):
    """Copies of the shipped tables, a trace, a config; their bytes to compare afterwards."""
    shutil.copy(TABLE, tmp_path / "T.json")
    shutil.copy(STEP_TABLE, tmp_path / "D.json")
    (tmp_path / "C.json").write_text(json.dumps({"warmup_steps": 1}))
    res = _invoke(tmp_path, "trace", "--scenario", "steady", "--rounds", "50", "--draft-width", "3",
                  "--out", "TR.jsonl")
    assert res.exit_code == 0, res.output
    res = _invoke(tmp_path, "table", "export", "T.json", "--format", "measurements", "--out",
                  "rows.csv")
    assert res.exit_code == 0, res.output
    os.symlink("T.json", tmp_path / "L.json")
    os.link(tmp_path / "T.json", tmp_path / "H.json")
    return {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}


def _unchanged(tmp_path: Path, before: dict[str, bytes]) -> None:
    now = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert now == before  # nothing written, nothing removed


@pytest.mark.parametrize(
    "args,field,other",
    [
        (["table", "export", "T.json", "--format", "markdown", "--out", "T.json"], "--out", "TABLE"),
        (["table", "export", "T.json", "--out", "./T.json"], "--out", "TABLE"),
        (["table", "export", "T.json", "--out", "L.json"], "--out", "TABLE"),  # symlink
        (["table", "export", "T.json", "--out", "H.json"], "--out", "TABLE"),  # hard link
        (["table", "export", "H.json", "--format", "csv", "--out", "L.json"], "--out", "TABLE"),
        (["fit", "rows.csv", "--compat", "C.json", "--out", "C.json"], "--out", "--compat"),
        (["fit", "rows.csv", "--calibration", "C.json", "--out", "./C.json"], "--out",
         "--calibration"),
        (["export", "D.json", "--to", "vllm", "--trace", "TR.jsonl", "--out", "D.json"], "--out",
         "TABLE"),
        (["export", "D.json", "--to", "vllm", "--trace", "TR.jsonl", "--out", "TR.jsonl"], "--out",
         "--trace"),
        (["export", "D.json", "--to", "vllm", "--trace", "TR.jsonl", "--out", "x.json",
          "--sidecar", "D.json"], "--sidecar", "TABLE"),
        (["import", "TR.jsonl", "--out", "TR.jsonl"], "--out", "PATH"),
        (["trace", "--kind", "tokens", "--out", "a.jsonl", "--rounds-out", "a.jsonl"],
         "--rounds-out", "--out"),  # refused before the runner records anything
        (["calibrate", "--config", "C.json", "--out", "C.json"], "--out", "--config"),
        (["calibrate", "--config", "C.json", "--out", "t.json", "--journal", "C.json"], "--journal",
         "--config"),
        (["calibrate", "--out", "t.json", "--journal", "t.json"], "--journal", "--out"),
    ],
)
def test_output_naming_an_input_is_refused_and_nothing_is_written(tmp_path, files, args, field,
                                                                   other):
    line = _one_error(_invoke(tmp_path, *args))
    out = str(Path(args[args.index(field) + 1]))
    assert line.startswith(f"error: {field}: got '{out}', expected a path other than {other} "
                           f"(it is the same file as {other} "), line
    _unchanged(tmp_path, files)


def test_figures_directory_holding_an_input_is_refused(tmp_path, files):
    (tmp_path / "figs").mkdir()
    shutil.copy(tmp_path / "T.json", tmp_path / "figs" / "table_fit.png")  # a table named so
    (tmp_path / "figs" / "replay_timeline.png").write_bytes(files["TR.jsonl"])
    before = {p.name: p.read_bytes() for p in (tmp_path / "figs").iterdir()}
    line = _one_error(_invoke(tmp_path, "plot", "figs/table_fit.png", "--out", "figs"))
    assert line.startswith("error: --out: got 'figs/table_fit.png', expected a path other than "
                           "TABLE"), line
    line = _one_error(_invoke(tmp_path, "replay", "--trace", "figs/replay_timeline.png",
                              "--plot", "figs"))
    assert line.startswith("error: --plot: got 'figs/replay_timeline.png', expected a path other "
                           "than --trace"), line
    assert {p.name: p.read_bytes() for p in (tmp_path / "figs").iterdir()} == before


def test_distinct_outputs_still_work(tmp_path, files):
    res = _invoke(tmp_path, "table", "export", "L.json", "--format", "markdown", "--out", "T.md")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "T.md").read_text().startswith("|")


def test_same_file_and_check_outputs(tmp_path):
    a = tmp_path / "a"
    a.write_text("x")
    os.symlink(a, tmp_path / "s")
    os.link(a, tmp_path / "h")
    assert same_file(a, tmp_path / "s") and same_file(tmp_path / "h", tmp_path / "s")
    assert same_file(tmp_path / "new", tmp_path / "." / "new")  # not existing: by spelling
    assert not same_file(a, tmp_path / "b")
    check_outputs([("--out", tmp_path / "missing")], [("IN", tmp_path / "missing")])  # no input
    check_outputs([("--out", tmp_path / "b"), ("--x", None)], [("IN", a), ("--y", None)])
    with pytest.raises(OutputError) as exc:
        check_outputs([("--out", tmp_path / "o"), ("--side", tmp_path / "d" / ".." / "o")])
    assert str(exc.value).startswith("--side: got ") and "other than --out" in str(exc.value)
    assert exc.value.exit_code == 2
