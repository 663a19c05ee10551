"""The journal is locked like the table: two runs sharing one journal (the default one named by
``--journal`` elsewhere, a symlink to it, or one ``--journal``) never both run; a stale lock
left by a killed run is taken over with one warning naming the dead holder and the file."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speccal.calibrate.journal import window_key
from speccal.calibrate.lock import OutputLockedError, StaleLockWarning, acquire, lock_path
from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from speccal.cli import app
from tests.calibrate.fakes import CONFIG, fake, patch_cli

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}


@pytest.fixture
def cfg_path(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**CONFIG, "windows_per_point": 1}))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def _second_run_while_first_holds(tmp_path, cfg_path, first: dict, second: dict):
    """Run ``first`` (fake engine); while it holds its locks, run ``second``: its error."""
    seen: list[BaseException | None] = []
    make = fake()

    def factory(opts):
        try:
            calibrate(CalibrateOptions(config_path=cfg_path, **second), engine_factory=fake())
            seen.append(None)
        except OutputLockedError as exc:
            seen.append(exc)
        return make(opts)

    calibrate(CalibrateOptions(config_path=cfg_path, accept_noisy=True, remeasure_rounds=0,
                               **first), engine_factory=factory, clock=make.clock)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("shape", ["default journal", "one --journal", "symlinked journal"])
def test_two_runs_sharing_a_journal_are_refused(tmp_path, cfg_path, shape):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    journal = tmp_path / "j.jsonl"
    if shape == "default journal":  # the first run's OUT.journal.jsonl, named by the second
        first, second = {"out": a}, {"out": b, "journal": tmp_path / "a.json.journal.jsonl"}
    elif shape == "one --journal":
        first, second = {"out": a, "journal": journal}, {"out": b, "journal": journal}
    else:
        os.symlink("j.jsonl", tmp_path / "link.jsonl")
        first, second = {"out": a, "journal": journal}, {"out": b,
                                                         "journal": tmp_path / "link.jsonl"}
    exc = _second_run_while_first_holds(tmp_path, cfg_path, first, second)
    assert exc is not None, "the second run was not refused"
    msg = str(exc)
    assert msg.startswith("--journal: got ") and f"locked by pid {os.getpid()} on host" in msg
    assert not b.exists()
    assert a.exists()  # the first run finished
    rows = [json.loads(x) for x in Path(first.get("journal", tmp_path / "a.json.journal.jsonl"))
            .read_text().splitlines()[1:]]
    keys = [window_key(r.get("row", r)) for r in rows if r.get("kind", "window") == "window"]
    assert keys and len(keys) == len(set(keys))  # one run's windows, each once


def test_stale_lock_is_taken_over_with_a_warning(tmp_path):
    out = tmp_path / "t.json"
    pid = _dead_pid()
    stale = {"pid": pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00+00:00",
             "command": "speccal calibrate --out t.json"}
    lock_path(out).write_text(json.dumps(stale))
    with pytest.warns(StaleLockWarning) as caught:
        with acquire(out, "--out") as held:
            assert held.holder["pid"] == os.getpid()
    text = str(caught[0].message)
    assert f"pid {pid} on host {socket.gethostname()}" in text and str(lock_path(out)) in text
    assert text.startswith("--out: took over the stale lock file ")
    with warnings.catch_warnings():  # a lock file its holder removed: no warning
        warnings.simplefilter("error")
        with acquire(out, "--out"):
            pass


def test_cli_says_so_in_one_warning_line(tmp_path, cfg_path, monkeypatch):
    make = fake()
    patch_cli(monkeypatch, make)
    out = tmp_path / "t.json"
    pid = _dead_pid()
    lock_path(out).write_text(json.dumps({"pid": pid, "host": "h", "started": "s",
                                          "command": None}))
    res = CliRunner().invoke(app, ["calibrate", "--config", str(cfg_path), "--out", str(out),
                                   "--remeasure-rounds", "0", "--accept-noisy"], env=ENV)
    assert res.exit_code == 0, res.output
    lines = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    assert lines == [f"warning: --out: took over the stale lock file {lock_path(out)} of pid "
                     f"{pid} on host h since s, which ended without releasing it (killed?)"]
