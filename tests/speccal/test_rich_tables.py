"""speccal.base.rich_tables: no cell truncated with an ellipsis at 80 columns, in the helper and
in the commands that print tables (table show, table diff, replay); a table that fits keeps its
box."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from speccal.base.rich_tables import legible, natural_width, print_table
from speccal.cli import app

ROOT = Path(__file__).resolve().parents[2]
ENV80 = {"COLUMNS": "80", "NO_COLOR": "1"}
FIT_COLUMNS = (
    "context",
    "KV",
    "points",
    "windows",
    "error",
    "n",
    "MAE ms",
    "max ms",
    "mean %",
    "max %",
)
FIT_ROW = (
    "0",
    "1-4096",
    "19",
    "57",
    "leave-1-point-out",
    "16/19",
    "0.2160",
    "0.4208",
    "4.39",
    "8.02",
)


def render(table: Table, width: int) -> str:
    console = Console(file=io.StringIO(), width=width)
    print_table(console, table)
    return console.file.getvalue()


def fit_table() -> Table:
    t = Table(title="fit report (ms; % of measured cost)")
    for col in FIT_COLUMNS:
        t.add_column(col, justify="right")
    t.add_row(*FIT_ROW)
    return t


def test_rich_alone_truncates_the_fit_report_at_80_columns():
    """The failure this module exists for (so the next test would fail without it)."""
    console = Console(file=io.StringIO(), width=80)
    console.print(fit_table())
    assert "…" in console.file.getvalue()


def test_fit_report_fits_80_columns_whole():
    text = render(fit_table(), 80)
    assert "…" not in text
    for value in FIT_ROW[:4] + FIT_ROW[5:]:  # every number whole, on one line
        assert value in text, value
    assert max(len(line) for line in text.splitlines()) <= 80


def test_a_table_too_wide_for_any_layout_folds_instead_of_truncating():
    t = Table()
    for i in range(16):
        t.add_column(f"column {i}")
    t.add_row(*(f"{1000 + i}.{i:03d}" for i in range(16)))
    text = render(t, 80)
    assert "…" not in text
    # folded, not cut: every digit of every header and value is printed
    given = [f"column {i}" for i in range(16)] + [f"{1000 + i}.{i:03d}" for i in range(16)]
    assert Counter(ch for ch in text if ch.isdigit()) == Counter(
        ch for cell in given for ch in cell if ch.isdigit()
    )


def test_a_table_that_fits_keeps_its_box():
    t = Table()
    t.add_column("a")
    t.add_column("b")
    t.add_row("1", "2")
    console = Console(file=io.StringIO(), width=80)
    assert natural_width(console, t) < 80
    legible(console, t)
    assert t.box is not None and t.show_edge
    assert "┏" in render(t, 80)


def _no_ellipsis(res) -> str:
    assert res.exit_code == 0, res.output
    text = res.stderr
    assert "…" not in text, text
    return text


def test_table_show_at_80_columns():
    res = CliRunner().invoke(
        app, ["table", "show", str(ROOT / "tables" / "tiny-cpu.json")], env=ENV80
    )
    text = _no_ellipsis(res)
    assert "leave-1-" in text and "MAE ms" in text


def test_table_diff_at_80_columns():
    res = CliRunner().invoke(
        app,
        [
            "table",
            "diff",
            str(ROOT / "tables" / "tiny-cpu.json"),
            str(ROOT / "tables" / "dense-2b-h200.json"),
        ],
        env=ENV80,
    )
    text = _no_ellipsis(res)
    assert "compatibility.model.fingerprint" in text


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.parquet"
    res = CliRunner().invoke(
        app,
        [
            "trace",
            "--scenario",
            "transition",
            "--draft-width",
            "3",
            "--rounds",
            "400",
            "--out",
            str(path),
        ],
        env=ENV80,
    )
    assert res.exit_code == 0, res.output
    return path


def test_replay_at_80_columns_and_its_log_lines(trace):
    res = CliRunner().invoke(
        app,
        ["replay", "--table", str(ROOT / "tables" / "tiny-cpu.json"), "--trace", str(trace)],
        env=ENV80,
    )
    text = _no_ellipsis(res)
    assert "tokens/s" in text
    # not a terminal: the replay's stages are plain lines, not a spinner's last frame
    assert "replay: fixed baselines" in text.splitlines()
    assert any(line.startswith("replay: done in ") for line in text.splitlines())
