"""speccal.base.atomic: a failed write leaves the old file intact and no temp file behind."""

from __future__ import annotations

import os

import pytest

from speccal.base import atomic
from speccal.base.atomic import write_bytes_atomic, write_json_atomic


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
    with pytest.raises(OSError, match="Input/output"):
        write_bytes_atomic(p, b"new content " * 1000)
    assert p.read_bytes() == b"old complete content"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["table.json"]


def test_unserialisable_json_does_not_touch_the_file(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{}")
    with pytest.raises(ValueError):
        write_json_atomic(p, {"x": float("nan")})
    assert p.read_text() == "{}" and len(list(tmp_path.iterdir())) == 1
