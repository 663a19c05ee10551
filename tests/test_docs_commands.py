"""Every ``speccal`` command shown in the user docs runs, in order, and succeeds.

Scheme: in README.md, docs/*.md and tables/README.md (in that order), each line of a fenced
```` ```bash ```` block is split on ``&&``; every segment that starts with ``speccal `` is one
command (``pip``/``python3`` segments are set-up, run by CI itself). Commands run through
``CliRunner`` on ``speccal.cli.app`` in one scratch directory holding a copy of ``tables/`` and
``notebooks/data/``, so later commands see the files earlier ones wrote (the README's calibrate
writes ``tiny-cpu.json``, which its replay reads). A command repeated verbatim runs once.

Inputs a reader brings themselves are provided here: ``measurements.csv`` (rows from a known
additive truth, ``speccal.costmodel.synthetic``) and ``compat.json`` (the running config's
compatibility; here the shipped table's own). ``speccal calibrate`` commands that sample get a
smaller grid (``--warmup-steps 1 --window-steps 4 --windows-per-point 1``): the same code path,
a fraction of the rounds; such short windows on a shared CI box are noisy, so they also get
``--accept-noisy`` (the quality gate would refuse the table, ``speccal.calibrate.gate``). Pipes and redirections are refused in examples, so every line stays
runnable as shown.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speccal.cli import app
from speccal.costmodel.measurements import write_measurements
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table import load_table

ROOT = Path(__file__).resolve().parents[1]
ENV = {"COLUMNS": "120", "NO_COLOR": "1"}
FAST_CALIBRATION = [
    "--warmup-steps",
    "1",
    "--window-steps",
    "4",
    "--windows-per-point",
    "1",
    "--accept-noisy",
]
FENCE = re.compile(r"^```bash[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def doc_files() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "tables" / "README.md",
    ]


def doc_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every ``speccal`` command in the docs, in order, first occurrence."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for block in FENCE.finditer(text):
            first = text[: block.start()].count("\n") + 2
            for i, line in enumerate(block.group(1).splitlines()):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                for seg in (s.strip() for s in line.split("&&")):
                    if not seg.startswith("speccal "):
                        continue
                    where = f"{path.relative_to(ROOT)}:{first + i}"
                    assert not re.search(r"[|<>;]", seg), (
                        f"{where}: keep examples free of pipes/redirections: {seg}"
                    )
                    argv = shlex.split(seg)[1:]
                    if tuple(argv) not in seen:
                        seen.add(tuple(argv))
                        out.append((where, argv))
    return out


def test_docs_show_every_workflow():
    """The extraction finds the commands the README promises (so the run below is not empty)."""
    cmds = [" ".join(argv[:2]) for _, argv in doc_commands()]
    for want in (
        "calibrate --model",
        "fit measurements.csv",
        "table show",
        "table validate",
        "table diff",
        "table export",
        "trace --scenario",
        "replay --table",
        "plot tiny-cpu.json",
    ):
        assert any(c.startswith(want) for c in cmds), f"no documented command starts with {want!r}"
    quick = (ROOT / "README.md").read_text()
    assert (
        'pip install torch==2.13.0 && pip install -e ".[dev]" && speccal calibrate --model tiny --out tiny-cpu.json'
        in quick
    )
    assert "python3 -m pytest -q" in quick


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    shutil.copytree(ROOT / "tables", tmp_path / "tables")
    shutil.copytree(ROOT / "notebooks" / "data", tmp_path / "notebooks" / "data")
    # The table as loaded (a schema version 1 file migrates: its execution path reads unknown).
    compat = load_table(ROOT / "tables" / "tiny-cpu.json").compatibility.model_dump(mode="json")
    (tmp_path / "compat.json").write_text(json.dumps(compat))
    w = compat["draft_width"]
    rows = make_measurements(
        bias_ms=5.0,
        alpha_ms={1: 0.0, 2: 0.2, 4: 0.5, 8: 1.1},
        theta_ms={g: 0.03 * g for g in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)},
        draft_width=w,
        noise_ms=0.02,
        seed=11,
    )
    write_measurements(rows, tmp_path / "measurements.csv")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_documented_command_succeeds(workdir):
    runner = CliRunner()
    for where, argv in doc_commands():
        if argv[0] == "calibrate" and "--cost-table" not in argv:
            argv = argv + FAST_CALIBRATION
        r = runner.invoke(app, argv, env=ENV)
        assert r.exit_code == 0, (
            f"{where}: speccal {' '.join(argv)} exited {r.exit_code}:\n{r.output}"
        )
        if "--out" in argv:
            out = workdir / argv[argv.index("--out") + 1]
            assert out.exists(), f"{where}: --out {out} was not written"


def test_relative_links_in_docs_resolve():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for path in doc_files():
        for target in link.findall(path.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), (
                f"{path.relative_to(ROOT)}: broken link {target}"
            )
