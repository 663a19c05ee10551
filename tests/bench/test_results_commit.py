"""bench/results.py's commit stamp: ``SPECCAL_COMMIT`` wins (a GPU host's copy of the tree can
carry older git metadata than its files), a tree whose tracked files differ from HEAD is marked
``+dirty``, and a clean checkout records HEAD's short hash."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "bench" / "results.py"


def _load(tmp_path: Path):
    """bench/results.py copied into a fresh git repository (its HERE is that repository)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(SRC, repo / "results.py")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "results.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    spec = importlib.util.spec_from_file_location("bench_results_copy", repo / "results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    return mod, repo, head


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_stamp(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECCAL_COMMIT", raising=False)
    mod, repo, head = _load(tmp_path)
    assert mod.git_commit() == head
    (repo / "results.py").write_text((repo / "results.py").read_text() + "\n# edited\n")
    assert mod.git_commit() == head + "+dirty"
    monkeypatch.setenv("SPECCAL_COMMIT", "abc1234")
    assert mod.git_commit() == "abc1234"
