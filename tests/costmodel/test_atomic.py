"""speccal.base.atomic: a failed write leaves the old file intact and no temp file behind; every
file error is one ``OutputError`` / ``InputError`` naming the option, the path and the reason."""

from __future__ import annotations

import os

import pytest

from speccal.base import atomic
from speccal.base.atomic import (
    check_writable,
    ensure_dir,
    read_bytes,
    read_json,
    read_text,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from speccal.base.errors import InputError, OutputError


def test_write_replaces_content_and_keeps_mode(tmp_path):
    p = tmp_path / "f.json"
    write_json_atomic(p, {"b": 1, "a": [1.5]})
    assert p.read_text() == '{\n  "a": [\n    1.5\n  ],\n  "b": 1\n}\n'
    os.chmod(p, 0o640)
    write_bytes_atomic(p, b"new")
    assert p.read_bytes() == b"new" and (p.stat().st_mode & 0o777) == 0o640


def test_failure_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "table.json"
    p.write_bytes(b"old complete content")

    def broken_fsync(fd):  # the data is half on its way to disk when the machine fails
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(atomic.os, "fsync", broken_fsync)
    with pytest.raises(OutputError, match="Input/output") as exc:
        write_bytes_atomic(p, b"new content " * 1000, field="--out")
    assert exc.value.field == "--out" and exc.value.value == str(p)
    assert exc.value.exit_code == 2
    assert p.read_bytes() == b"old complete content"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["table.json"]


def test_unserialisable_json_does_not_touch_the_file(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{}")
    with pytest.raises(ValueError):
        write_json_atomic(p, {"x": float("nan")})
    assert p.read_text() == "{}" and len(list(tmp_path.iterdir())) == 1


def _setup(tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("keep")


# (path relative to tmp_path or absolute, words in the message)
BAD_FILE_OUTPUTS = [
    ("adir", "not an existing directory"),
    ("missing/t.json", "missing does not exist"),
    ("afile/t.json", "afile is a file"),
    ("afile/deeper/t.json", "afile is a file"),
    ("/proc/speccal-test.json", "cannot create a file in /proc"),
    ("/proc/self/speccal-test.json", "cannot create a file in /proc/self"),
    ("/dev/null", "not a regular file"),
]


@pytest.mark.parametrize("rel, words", BAD_FILE_OUTPUTS)
def test_check_writable_refuses_what_a_write_would_fail_on(tmp_path, rel, words):
    _setup(tmp_path)
    before = sorted(x.name for x in tmp_path.iterdir())
    with pytest.raises(OutputError) as exc:
        check_writable(tmp_path / rel, "--out")
    msg = str(exc.value)
    assert msg.startswith("--out: got ") and words in msg and "\n" not in msg
    assert sorted(x.name for x in tmp_path.iterdir()) == before  # no probe left behind
    assert (tmp_path / "afile").read_text() == "keep"


@pytest.mark.parametrize("rel, words", BAD_FILE_OUTPUTS[:5])
def test_writers_raise_output_error_not_oserror(tmp_path, rel, words):
    _setup(tmp_path)
    with pytest.raises(OutputError) as exc:
        write_text_atomic(tmp_path / rel, "x", field="--out")
    assert exc.value.field == "--out" and "\n" not in str(exc.value)
    assert (tmp_path / "afile").read_text() == "keep" and (tmp_path / "adir").is_dir()


def test_permission_denied_is_refused(tmp_path, monkeypatch):
    def denied(*args, **kwargs):  # what a non-root user gets in a read-only directory
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic.tempfile, "mkstemp", denied)
    with pytest.raises(OutputError, match="Permission denied"):
        check_writable(tmp_path / "t.json", "--out")
    with pytest.raises(OutputError, match="writable directory.*Permission denied"):
        write_bytes_atomic(tmp_path / "t.json", b"x")
    assert not (tmp_path / "t.json").exists()


def test_check_writable_accepts_new_and_existing_files(tmp_path):
    assert check_writable(tmp_path / "new.json", "--out") == tmp_path / "new.json"
    (tmp_path / "old.json").write_text("old")
    check_writable(tmp_path / "old.json", "--out")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["old.json"]
    assert (tmp_path / "old.json").read_text() == "old"


def test_check_writable_directory_outputs(tmp_path):
    _setup(tmp_path)
    assert check_writable(tmp_path / "adir", "--out", directory=True) == tmp_path / "adir"
    check_writable(tmp_path / "new" / "deeper", "--out", directory=True)
    assert not (tmp_path / "new").exists()  # checked, not created
    for rel, words in (("afile", "afile is a file"), ("afile/sub", "afile is a file")):
        with pytest.raises(OutputError, match=words):
            check_writable(tmp_path / rel, "--plot", directory=True)
    with pytest.raises(OutputError, match="cannot create a file in /proc"):
        check_writable("/proc/speccal-test-dir", "--out", directory=True)
    with pytest.raises(OutputError, match="afile is a file"):
        ensure_dir(tmp_path / "afile", "--out")
    assert ensure_dir(tmp_path / "made" / "here").is_dir()


def test_readers_refuse_bad_files_with_one_line(tmp_path):
    _setup(tmp_path)
    (tmp_path / "bin.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    (tmp_path / "text.json").write_text("{not json")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would block forever: refused without opening it
    cases = [
        ("missing.json", "an existing file"),
        ("adir", "a file, not a directory"),
        ("fifo", "a regular file"),
        ("bin.json", "UTF-8 text file (undecodable byte 0x89 at offset 0)"),
        ("text.json", "a JSON file (line 1 column 2"),
    ]
    for rel, words in cases:
        with pytest.raises(InputError) as exc:
            read_json(tmp_path / rel, "--compat")
        msg = str(exc.value)
        assert msg.startswith("--compat: got ") and words in msg and "\n" not in msg, msg
    assert read_bytes(tmp_path / "afile", "--x") == b"keep"
    assert read_text(tmp_path / "afile", "--x") == "keep"
    (tmp_path / "ok.json").write_text('{"a": [1]}')
    assert read_json(tmp_path / "ok.json", "--x") == {"a": [1]}
