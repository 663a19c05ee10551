"""Journal: append + fsync per window, resume, torn last line, refusal of another run's journal."""

from __future__ import annotations

import json

import pytest

from speccal.base.errors import InputError, SchemaError
from speccal.calibrate.journal import open_journal

HEADER = {"config": {"a": 1}, "geometry": {"w": 3}, "compatibility": {"draft_width": 3}}


def row(i: int) -> dict:
    return {"context_index": 0, "bcap": 1, "g": 2, "k": 3, "window_index": i, "step_ms": 1.5}


def test_resume_keeps_finished_windows(tmp_path):
    path = tmp_path / "j.jsonl"
    with open_journal(path, HEADER, resume=False) as j:
        j.append(row(0))
        j.append(row(1))
    with open_journal(path, HEADER, resume=True) as j:
        assert j.resumed
        assert j.rows == [row(0), row(1)]
        assert j.done == {(0, 1, 2, 3, 0), (0, 1, 2, 3, 1)}
        j.append(row(2))
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "header"
    assert len(lines) == 4


def test_without_resume_starts_fresh(tmp_path):
    path = tmp_path / "j.jsonl"
    with open_journal(path, HEADER, resume=False) as j:
        j.append(row(0))
    with open_journal(path, HEADER, resume=False) as j:
        assert j.rows == [] and not j.resumed
    assert len(path.read_text().splitlines()) == 1


def test_torn_last_line_dropped(tmp_path):
    path = tmp_path / "j.jsonl"
    with open_journal(path, HEADER, resume=False) as j:
        j.append(row(0))
    with open(path, "a") as fh:
        fh.write('{"kind": "window", "row": {"context_in')
    with open_journal(path, HEADER, resume=True) as j:
        assert j.dropped_torn_line
        assert j.rows == [row(0)]
        j.append(row(1))
    with open_journal(path, HEADER, resume=True) as j:
        assert j.rows == [row(0), row(1)]


def test_journal_of_another_run_refused(tmp_path):
    path = tmp_path / "j.jsonl"
    with open_journal(path, HEADER, resume=False) as j:
        j.append(row(0))
    other = {**HEADER, "compatibility": {"draft_width": 5}}
    with pytest.raises(InputError, match="another run"):
        open_journal(path, other, resume=True)
    assert len(path.read_text().splitlines()) == 2  # untouched


def test_corrupt_middle_line_refused(tmp_path):
    path = tmp_path / "j.jsonl"
    with open_journal(path, HEADER, resume=False) as j:
        j.append(row(0))
    with open(path, "a") as fh:
        fh.write("garbage\n")
    with pytest.raises(SchemaError):
        open_journal(path, HEADER, resume=True)
    path.write_text("not json\n")
    with pytest.raises(InputError, match="not JSON"):
        open_journal(path, HEADER, resume=True)
