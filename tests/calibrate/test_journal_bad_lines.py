"""Journal lines validated where they are read (issue 34, item 5) and a failed append reported
as one line with the earlier lines intact (item 4)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from speccal.base.errors import LineError, OutputError
from speccal.calibrate.journal import DroppedWindowLinesWarning, open_journal

HEADER = {
    "config": {"window_steps": 4, "mode": "target_verify"},
    "geometry": {"w": 3},
    "compatibility": {"draft_width": 3},
}


def row(i: int, **over) -> dict:
    r = {
        "context_index": 0,
        "prefill_tokens": 8,
        "min_kv_length": 1,
        "max_kv_length": 64,
        "bcap": 2,
        "num_requests": 2,
        "g": 8,
        "k": 3,
        "window_index": i,
        "window_steps": 4,
        "elapsed_s": 0.02,
        "step_ms": 5.0,
        "mean_kv_length": 20.0,
        "mode": "target_verify",
    }
    r.update(over)
    return r


def write_journal(path, rows) -> None:
    with open_journal(path, HEADER, resume=False) as j:
        for r in rows:
            j.append(r)


def forge_line(path, line_no: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[line_no - 1] = text
    path.write_text("\n".join(lines) + "\n")


def window_line(r: dict) -> str:
    return json.dumps({"kind": "window", "row": r}, sort_keys=True)


@pytest.mark.parametrize(
    ("over", "field", "shown"),
    [
        ({"elapsed_s": float("nan")}, "elapsed_s", "nan"),
        ({"elapsed_s": -0.02, "step_ms": -5.0}, "elapsed_s", "-0.02"),
        ({"step_ms": 7.5}, "step_ms", "7.5"),  # disagrees with its elapsed_s
        ({"bcap": 2.0}, "bcap", "2.0"),  # an int that is not an int
        ({"k": True}, "k", "True"),
        ({"window_steps": 8, "step_ms": 2.5}, "window_steps", "8"),  # not the header's
        ({"mode": "draft_step"}, "mode", "'draft_step'"),
        ({"num_requests": 3}, "num_requests", "3"),
        ({"spurious": 1}, "spurious", "1"),
        ({"mean_kv_length": float("inf")}, "mean_kv_length", "inf"),
    ],
)
def test_resume_names_path_line_field_and_value_of_a_bad_window(tmp_path, over, field, shown):
    path = tmp_path / "j.jsonl"
    write_journal(path, [row(0), row(1), row(2)])
    forge_line(path, 3, window_line(row(1, **over)))  # line 3 = the second window
    before = path.read_bytes()
    with pytest.raises(LineError) as exc:
        open_journal(path, HEADER, resume=True)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:3: {field}={shown}: expected "), msg
    assert "--drop-bad-windows" in msg and "1 invalid window line(s) (3) of 3" in msg
    assert exc.value.exit_code == 2
    assert path.read_bytes() == before  # refusing changes nothing


def test_a_non_json_middle_line_is_named_and_droppable(tmp_path):
    path = tmp_path / "j.jsonl"
    write_journal(path, [row(0), row(1)])
    forge_line(path, 2, '{"kind": "window", "row": {')
    with pytest.raises(LineError, match=r"j\.jsonl:2: line="):
        open_journal(path, HEADER, resume=True)
    with pytest.warns(DroppedWindowLinesWarning, match="line 2"):
        j = open_journal(path, HEADER, resume=True, drop_bad=True)
    j.close()
    assert j.rows == [row(1)]


def test_drop_bad_windows_keeps_the_others_and_rewrites_the_journal(tmp_path):
    path = tmp_path / "j.jsonl"
    write_journal(path, [row(0), row(1), row(2)])
    forge_line(path, 3, window_line(row(1, elapsed_s=float("nan"))))
    with pytest.warns(DroppedWindowLinesWarning, match=r"line 3: elapsed_s=nan"):
        with open_journal(path, HEADER, resume=True, drop_bad=True) as j:
            assert j.rows == [row(0), row(2)]
            assert j.dropped_bad_lines == [3]
            assert j.done == {(0, 2, 8, 3, 0), (0, 2, 8, 3, 2)}  # window 1 is measured again
            j.append(row(1))
    # the rewritten journal resumes cleanly, every window once
    with open_journal(path, HEADER, resume=True) as j:
        assert sorted(r["window_index"] for r in j.rows) == [0, 1, 2]


def test_valid_journal_resumes_without_warnings(tmp_path, recwarn):
    path = tmp_path / "j.jsonl"
    write_journal(path, [row(0), row(1)])
    with open_journal(path, HEADER, resume=True) as j:
        assert j.rows == [row(0), row(1)] and j.dropped_bad_lines == []
    assert not [w for w in recwarn if issubclass(w.category, DroppedWindowLinesWarning)]


def test_full_disk_on_append_is_one_line_and_keeps_the_earlier_lines(tmp_path, monkeypatch):
    path = tmp_path / "j.jsonl"
    j = open_journal(path, HEADER, resume=False)
    j.append(row(0))
    before = path.read_bytes()
    real_write = j._fh.write

    def full(data):  # half the line reaches the file, then the disk is full
        real_write(bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(j._fh, "write", full, raising=False)
    with pytest.raises(OutputError) as exc:
        j.append(row(1))
    msg = str(exc.value)
    assert str(path) in msg and "No space left on device" in msg and "--resume" in msg
    assert exc.value.__cause__ is None and exc.value.__suppress_context__
    assert exc.value.exit_code == 2
    j.close()
    assert path.read_bytes() == before  # no torn half line
    with open_journal(path, HEADER, resume=True) as j2:
        assert j2.rows == [row(0)] and not j2.dropped_torn_line


def test_full_disk_on_fsync_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "j.jsonl"
    j = open_journal(path, HEADER, resume=False)
    j.append(row(0))
    before = path.read_bytes()

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OutputError, match="No space left on device"):
        j.append(row(1))
    monkeypatch.undo()
    j.close()
    assert path.read_bytes() == before
