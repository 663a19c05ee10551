"""The root CLI: domain errors become one line on stderr and exit 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from speccal.cli import app

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}


def test_bad_input_exits_2_with_one_line(tmp_path):
    missing = tmp_path / "missing.json"
    out = subprocess.run(
        [sys.executable, "-m", "speccal", "table", "show", str(missing)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "missing.json" in lines[0]


def test_garbage_table_exits_2_through_cli_runner(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = CliRunner().invoke(app, ["table", "validate", str(bad)], env=ENV)
    assert res.exit_code == 2
    assert "error:" in res.output and res.exception is None or isinstance(res.exception, SystemExit)


def test_unknown_option_is_a_usage_error():
    res = CliRunner().invoke(app, ["table", "show", "--no-such-flag"], env=ENV)
    assert res.exit_code == 2


def test_version():
    res = CliRunner().invoke(app, ["--version"], env=ENV)
    assert res.exit_code == 0 and res.output.startswith("speccal ")
