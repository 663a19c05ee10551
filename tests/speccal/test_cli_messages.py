"""Messages: user values are shown as they are (no Rich markup, no emoji codes), piped output
never wraps, usage errors are one ``error:`` line with exit 2, ``--profile`` names its forms."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.table import Table
from typer.testing import CliRunner

from speccal.base.rich_tables import make_console, print_table
from speccal.cli import app

ENV = {"COLUMNS": "80", "NO_COLOR": "1"}
REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "tables" / "tiny-cpu.json"
STEP_TABLE = REPO / "tables" / "dense-2b-h200-draft-step.json"


def _one_error(res) -> str:
    assert res.exit_code == 2, res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_emoji_codes_and_markup_in_values_are_shown_as_typed(tmp_path):
    res = CliRunner().invoke(app, ["table", "check", str(TABLE), "--context", "10:100:50:7"],
                             env=ENV)
    line = _one_error(res)
    assert "got '10:100:50:7'" in line and "\N{HUNDRED POINTS SYMBOL}" not in line
    for name in ("my:rocket:table.json", "a[bold]b[/bold].json", "x[/].json"):
        res = CliRunner().invoke(app, ["table", "show", str(tmp_path / name)], env=ENV)
        assert f"{tmp_path / name}" in _one_error(res)


def test_table_cells_and_titles_are_plain_text(tmp_path):
    out = io.StringIO()
    console = make_console(file=out, width=200)
    t = Table(title="of a[red]b :rocket:")
    t.add_column("[x]")
    t.add_row('{"a": [true], "b": ":100:"}')
    print_table(console, t)
    text = out.getvalue()
    assert "of a[red]b :rocket:" in text and "[x]" in text
    assert '{"a": [true], "b": ":100:"}' in text


def test_piped_output_is_never_wrapped():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    res = subprocess.run([sys.executable, "-m", "speccal", "table", "show", str(TABLE)],
                         capture_output=True, text=True, env={**env, "NO_COLOR": "1"},
                         stdin=subprocess.DEVNULL, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert max(map(len, lines)) > 80  # one line per line, whatever its length
    header = next(x for x in lines if " KV " in x and "points" in x)
    assert [w for w in header.split() if w not in "┃│"] == ["context", "KV", "points", "windows", "error", "n", "MAE", "ms",
                              "max", "ms", "mean", "%", "max", "%"]
    # the model line is one line too (it wrapped at 80 columns)
    assert any(x.startswith("model ") and "device " in x for x in lines)


def test_console_width_unbounded_off_a_terminal_only(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console(file=io.StringIO()).width > 10_000
    assert make_console(file=io.StringIO(), width=80).width == 80
    assert make_console(file=io.StringIO(), force_terminal=True, width=100).width == 100
    monkeypatch.setenv("COLUMNS", "90")
    assert make_console(file=io.StringIO()).width == 90


@pytest.mark.parametrize(
    "args,words",
    [
        (["calibrate", "--draft-width", "abc"], ["--draft-width: got 'abc', expected a valid integer"]),
        (["export", str(TABLE)], ["--to"]),
        (["table", "show", str(TABLE), "--bogus"], ["--bogus"]),
        (["replay", "--rounds", "1.5", "--scenario", "steady"], ["--rounds: got '1.5'"]),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, words):
    line = _one_error(CliRunner().invoke(app, args, env=ENV))
    assert "╭" not in line and "Usage:" not in line
    for w in words:
        assert w in line, line


@pytest.mark.parametrize(
    "profile,hint",
    [
        ("marginal:", "marginal: needs its rates"),
        ("joint:0.5,0.2", "no profile kind 'joint'"),
        ("0.8,0.6,0.4", "name the rates' kind: marginal:0.8,0.6,0.4"),
    ],
)
def test_profile_refusal_names_the_accepted_forms(tmp_path, profile, hint):
    res = CliRunner().invoke(app, ["export", str(STEP_TABLE), "--to", "vllm", "--profile",
                                   profile, "--out", str(tmp_path / "x.json")], env=ENV)
    line = _one_error(res)
    assert f"--profile: got '{profile}'" in line
    assert "marginal:p1,p2,... or conditional:q1,q2,..." in line and hint in line
    assert "existing file" not in line
    assert not (tmp_path / "x.json").exists()


def test_piped_help_keeps_the_help_texts_lines_whole():
    """Typer's help pages folded every 100-column help line at Rich's 80-column fallback when
    piped; off a terminal they are laid out at ``PIPED_HELP_WIDTH``."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    out = subprocess.run([sys.executable, "-m", "speccal", "--help"], capture_output=True,
                         text=True, env=env, check=True).stdout
    line = "Terms: Bcap = the captured draft batch size a batch is padded to; G = target rows verified"
    assert any(ln.strip() == line for ln in out.splitlines()), out
