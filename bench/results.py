"""The shared record of the bench scripts: ``bench/results.jsonl``, one JSON object per line.

Every line holds ``metric, value, unit, device, commit, date, command`` plus any context fields a
script adds (model, workload, ...), written with sorted keys. The scripts import this module as
``results`` (``python3 bench/x.py`` puts ``bench/`` first on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.jsonl"
REQUIRED = ("metric", "value", "unit", "device", "commit", "date", "command")


def git_commit() -> str:
    """Short hash of the checked-out commit, ``"unknown"`` outside git.

    ``SPECCAL_COMMIT`` overrides it: a copy of a work tree whose git metadata is older than its
    files (the GPU host's copy is one) would otherwise record the wrong commit. A tree whose
    tracked files differ from that commit gets ``+dirty``.
    """
    env = os.environ.get("SPECCAL_COMMIT", "").strip()
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
            capture_output=True, text=True,
        )
    except OSError:
        return "unknown"
    commit = out.stdout.strip()
    if not commit:
        return "unknown"
    return commit + ("+dirty" if dirty.stdout.strip() else "")


def append_results(lines: Iterable[dict], path: Path = RESULTS) -> None:
    """Append ``lines`` to ``path``, one sorted-key JSON object each.

    Every line is checked for the required keys before anything is written, so a bad line never
    leaves half a record behind.
    """
    lines = list(lines)
    for line in lines:
        missing = [k for k in REQUIRED if k not in line]
        if missing:
            raise ValueError(f"result line {line.get('metric', '?')!r} lacks {', '.join(missing)}")
    with open(path, "a", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line, sort_keys=True) + "\n")
