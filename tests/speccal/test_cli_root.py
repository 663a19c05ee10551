"""The root CLI: domain errors become one line on stderr and exit 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from typer.testing import CliRunner

from speccal.cli import app
from speccal.cli.app import missing_package_message

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


# A machine without torch: the finder refuses every torch module as an absent install does.
NO_TORCH = (
    "import importlib.abc, sys\n"
    "class NoTorch(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path, target=None):\n"
    "        if name.split('.')[0] == 'torch':\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, NoTorch())\n"
)

WITHOUT_TORCH = {
    "calibrate": ["calibrate", "--out", "{d}/t.json"],
    "bench": ["bench", "--max-tokens", "4"],
    "generate": ["generate", "--prompt-ids", "1,2"],
    "trace": ["trace", "--kind", "rounds", "--out", "{d}/r.jsonl"],
}


def test_runner_commands_without_torch_are_one_line_exit_2(tmp_path):
    """Every command that needs the runner says torch is missing in one line, exit 2; the CLI
    itself (and the torch-free commands) starts without it."""
    runs = {name: [a.format(d=tmp_path) for a in args] for name, args in WITHOUT_TORCH.items()}
    runs["replay"] = ["replay", "--scenario", "steady", "--rounds", "50", "--json"]
    code = NO_TORCH + (
        "from speccal.cli import app\n"
        f"for name, args in {runs!r}.items():\n"
        "    print('@@ ' + name, file=sys.stderr, flush=True)\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit as exc:\n"
        "        print('@@rc', exc.code, file=sys.stderr, flush=True)\n"
        "print('@@torch', 'torch' in sys.modules, file=sys.stderr)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, **ENV},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    chunks = {}
    for chunk in res.stderr.split("@@ ")[1:]:
        name, _, rest = chunk.partition("\n")
        body, _, rc = rest.rpartition("@@rc ")
        chunks[name] = ([ln for ln in body.splitlines() if ln.strip()], rc.split()[0])
    for name in WITHOUT_TORCH:
        lines, rc = chunks[name]
        assert rc == "2", (name, lines)
        assert len(lines) == 1 and lines[0].startswith("error:") and "torch" in lines[0], lines
        assert "Traceback" not in res.stderr
    assert "pip install torch" in chunks["bench"][0][0]
    assert chunks["replay"][1] == "0", chunks["replay"]  # torch-free commands still run
    assert res.stderr.strip().endswith("@@torch False")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_missing_package_message_names_package_and_install():
    msg = missing_package_message("bench", ModuleNotFoundError("x", name="torch.cuda"))
    assert msg.startswith("speccal bench needs the Python package 'torch'")
    assert "pip install torch" in msg
    other = missing_package_message("trace", ModuleNotFoundError("x", name="pyarrow.parquet"))
    assert "'pyarrow'" in other and other.endswith("pip install pyarrow")
    # a missing module of ours is a bug, not an installation problem: no message, re-raised
    assert missing_package_message("bench", ModuleNotFoundError("x", name="speccal.nope")) is None
    assert missing_package_message("bench", ModuleNotFoundError("x")) is None
