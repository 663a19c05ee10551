"""Journal: append + fsync per window, resume, torn last line, refusal of another run's journal,
refusal to discard finished windows, duplicate windows dropped on resume."""

from __future__ import annotations

import json

import pytest

from speccal.base.errors import InputError, SchemaError
from speccal.calibrate.journal import check_discard, existing_windows, open_journal

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


def test_without_resume_a_journal_with_windows_is_refused_unless_overwrite(tmp_path):
    path = tmp_path / "j.jsonl"
    with open_journal(path, HEADER, resume=False) as j:
        j.append(row(0))
        j.append(row(1))
    before = path.read_bytes()
    with pytest.raises(InputError) as exc:
        open_journal(path, HEADER, resume=False)
    msg = str(exc.value)
    assert "2 finished windows" in msg and "--resume" in msg and "--overwrite" in msg
    assert path.read_bytes() == before  # nothing discarded
    with pytest.raises(InputError, match="--overwrite"):
        check_discard(path, resume=False, overwrite=False)
    check_discard(path, resume=True, overwrite=False)
    with open_journal(path, HEADER, resume=False, overwrite=True) as j:
        assert j.rows == [] and not j.resumed
    assert len(path.read_text().splitlines()) == 1
    # A journal without finished windows (killed before its first window) holds nothing to lose.
    assert existing_windows(path) == 0
    with open_journal(path, HEADER, resume=False) as j:
        assert j.rows == []
    assert existing_windows(tmp_path / "missing.jsonl") == 0


def test_resume_keeps_the_first_of_duplicate_windows(tmp_path):
    """Two concurrent --resume runs (before the output lock) appended the same windows twice:
    resume keeps the first line of each window identity, says how many it dropped and rewrites
    the journal without them, so a later resume or fit sees each window once."""
    path = tmp_path / "j.jsonl"
    first = [dict(row(i), step_ms=1.0 + i) for i in range(3)]
    with open_journal(path, HEADER, resume=False) as j:
        for r in first:
            j.append(r)
        for r in first[1:]:
            j.append(dict(r, step_ms=9.0))  # the second run's measurement of windows 1 and 2
        j.append(dict(row(0), mode="draft_step"))  # another identity (mode): kept
    assert existing_windows(path) == 6
    with open_journal(path, HEADER, resume=True) as j:
        assert j.dropped_duplicates == 2
        assert j.rows == [*first, dict(row(0), mode="draft_step")]
        assert len(j.done) == 3
        j.append(row(3))
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 5
    assert [json.loads(x)["row"]["step_ms"] for x in lines[1:4]] == [1.0, 2.0, 3.0]
    with open_journal(path, HEADER, resume=True) as j:
        assert j.dropped_duplicates == 0 and len(j.rows) == 5


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
