"""Every ``speccal`` command shown in the user docs runs, in order, and succeeds.

Scheme: in README.md, docs/*.md and tables/README.md (in that order), each line of a fenced
```` ```bash ```` block is split on ``&&``; every segment that starts with ``speccal `` is one
command, ``mkdir -p DIR`` segments create their folders, and ``pip``/``python3`` segments are
set-up, run by CI itself. Commands run through ``CliRunner`` on ``speccal.cli.app``, in the order
shown, in one scratch directory holding only what a fresh clone ships that the docs read
(``tables/``, ``notebooks/data/``): every other input is written by an earlier documented
command (the README's calibrate writes ``out/tiny-cpu.json``, ``table export --format
measurements`` the rows its ``fit`` reads, ``table compat`` the ``out/compat.json`` its
``validate --expect`` reads), so the chain runs from nothing. Every output lands under ``out/``
(git-ignored), never at the top of the clone. A command repeated verbatim runs once, except a
``calibrate``, which runs each time it is shown (a second run onto the same journal is what a
reader following the docs meets).

``speccal calibrate`` commands that sample get a smaller grid (``--warmup-steps 1 --window-steps
4 --windows-per-point 1``): the same code path, a fraction of the rounds; such short windows on a
shared CI box are noisy, so they also get ``--accept-noisy`` (the quality gate would refuse the
table, ``speccal.calibrate.gate``). Pipes and redirections are refused in examples, so every line
stays runnable as shown.
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


#: What a fresh clone holds that the documented commands read; everything else they make.
SHIPPED = ("tables", "notebooks")


def doc_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every ``speccal`` command (argv without ``speccal``) and ``mkdir -p``
    (argv ``["mkdir", "-p", ...]``) in the docs, in order, first occurrence."""
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
                    if not seg.startswith(("speccal ", "mkdir -p ")):
                        continue
                    where = f"{path.relative_to(ROOT)}:{first + i}"
                    assert not re.search(r"[|<>;]", seg), (
                        f"{where}: keep examples free of pipes/redirections: {seg}"
                    )
                    argv = shlex.split(seg)
                    argv = argv if argv[0] == "mkdir" else argv[1:]
                    # a calibration runs again when shown again (a rerun onto a finished
                    # journal is what a reader following the docs would hit)
                    if tuple(argv) not in seen or argv[0] == "calibrate":
                        seen.add(tuple(argv))
                        out.append((where, argv))
    return out


def test_docs_show_every_workflow():
    """The extraction finds the commands the README promises (so the run below is not empty)."""
    cmds = [" ".join(argv) for _, argv in doc_commands()]
    for want in (
        "calibrate --model",
        "table export out/tiny-cpu.json --format measurements --out out/measurements.csv",
        "table compat --model tiny --out out/compat.json",
        "fit out/measurements.csv",
        "table show",
        "table validate out/tiny-cpu.json --expect out/compat.json",
        "table diff",
        "table export",
        "trace --scenario",
        "replay --table",
        "plot out/tiny-cpu.json",
        "bench --model tiny --policy",
    ):
        assert any(c.startswith(want) for c in cmds), f"no documented command starts with {want!r}"
    quick = (ROOT / "README.md").read_text()
    assert (
        'pip install torch==2.13.0 && pip install -e ".[dev]" && mkdir -p out && '
        "speccal calibrate --model tiny --out out/tiny-cpu.json" in quick
    )
    # the README's test command is the one CI runs
    readme_tests = re.findall(r"^python3 -m pytest -q.*$", quick, re.MULTILINE)
    ci_tests = re.findall(r"^python3 -m pytest.*$", (ROOT / ".ci" / "run").read_text(),
                          re.MULTILINE)
    assert readme_tests == ci_tests == ["python3 -m pytest -q -n 2"], (readme_tests, ci_tests)
    # Inputs come before the commands reading them: the chain runs in the order shown.
    order = [c for c in cmds if "out/measurements.csv" in c or "out/compat.json" in c]
    assert order[0].startswith("table export") and order[1].startswith("table compat"), order
    # Benches of policies repeat, so they report medians and a spread.
    policy_benches = [c for c in cmds if c.startswith("bench") and "--policy" in c]
    assert policy_benches and all(
        int(c.split("--repeats ")[1].split()[0]) >= 3 for c in policy_benches
    ), policy_benches


def test_documented_outputs_stay_under_out():
    """Every path a documented command writes (``--out``, ``--plot``, ...) is under ``out/``."""
    for where, argv in doc_commands():
        for flag in ("--out", "--plot", "--trace-out", "--journal", "--rounds-out"):
            if flag in argv:
                path = argv[argv.index(flag) + 1]
                assert path.startswith("out/"), f"{where}: {flag} {path} is not under out/"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A scratch clone: only the shipped files the docs read; nothing a command should make."""
    shutil.copytree(ROOT / "tables", tmp_path / "tables")
    shutil.copytree(ROOT / "notebooks" / "data", tmp_path / "notebooks" / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_documented_command_succeeds(workdir):
    runner = CliRunner()
    outputs = {}
    for where, argv in doc_commands():
        if argv[0] == "mkdir":
            for d in argv[2:]:
                (workdir / d).mkdir(parents=True, exist_ok=True)
            continue
        if argv[0] == "calibrate" and "--cost-table" not in argv:
            argv = argv + FAST_CALIBRATION
        r = runner.invoke(app, argv, env=ENV)
        assert r.exit_code == 0, (
            f"{where}: speccal {' '.join(argv)} exited {r.exit_code}:\n{r.output}"
        )
        outputs[" ".join(argv)] = r
        if "--out" in argv:
            out = workdir / argv[argv.index("--out") + 1]
            assert out.exists(), f"{where}: --out {out} was not written"
    # Nothing written at the top of the clone: outputs live under out/.
    assert sorted(p.name for p in workdir.iterdir()) == sorted([*SHIPPED, "out"])
    # The README's round trip: the refitted table validates against the run's compatibility.
    (verdict,) = [r for c, r in outputs.items() if c.startswith("table validate out/fitted.json")]
    assert json.loads(verdict.stdout)["valid"] is True
    compat = json.loads((workdir / "out" / "compat.json").read_text())
    fitted = load_table(workdir / "out" / "fitted.json")
    assert fitted.compatibility.model_dump(mode="json") == compat
    # The showcase replay prints a clear gain for the adaptive policy (README: about +6.6 %).
    (show,) = [r for c, r in outputs.items() if c.startswith("replay --table tables/dense-2b")]
    gain = re.search(r"adaptive-step: ([+-][0-9.]+) % tokens/s over the best fixed k", show.stderr)
    assert gain and float(gain.group(1)) > 3.0, show.stderr


def test_relative_links_in_docs_resolve():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for path in doc_files():
        for target in link.findall(path.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), (
                f"{path.relative_to(ROOT)}: broken link {target}"
            )
