"""Append-only JSONL journal of finished measurement windows, so a killed calibration can resume.

Layout (one JSON object per line, sorted keys)::

    {"kind": "header", "journal_version": 1, "key": "<sha256>", "config": {...},
     "geometry": {...}, "compatibility": {...}}
    {"kind": "window", "row": {<one measurement row, see docs/ARCHITECTURE.md>}}
    ...

``key`` hashes the effective calibration config, the captured geometry and the runner's
compatibility metadata: a journal written by another run (other buckets, width, model, device...)
is refused at ``--resume`` instead of mixing its windows into this table.

Durability: the header is written atomically (temp file, fsync, rename, directory fsync); each
window line is appended, flushed and fsynced before the next window starts. A crash can leave at
most one torn last line, which ``open_journal`` drops (and truncates) on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speccal.base.atomic import write_text_atomic
from speccal.base.errors import InputError, SchemaError

JOURNAL_VERSION = 1


def run_key(
    config: Mapping[str, Any], geometry: Mapping[str, Any], compatibility: Mapping[str, Any]
) -> str:
    """Stable hash of what makes two calibration runs interchangeable."""
    blob = json.dumps(
        {"config": config, "geometry": geometry, "compatibility": compatibility},
        sort_keys=True,
        separators=(",", ":"),
        allow_nan=False,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def window_key(row: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    """(context_index, bcap, g, k, window_index) of a measurement row."""
    return (
        int(row["context_index"]),
        int(row["bcap"]),
        int(row["g"]),
        int(row["k"]),
        int(row["window_index"]),
    )


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


@dataclass
class Journal:
    """An open journal: finished rows (in file order) and an append handle.

    Use ``open_journal``; call ``append`` once per finished window and ``close`` at the end.
    """

    path: Path
    key: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    resumed: bool = False
    dropped_torn_line: bool = False
    _fh: Any = None

    @property
    def done(self) -> set[tuple[int, int, int, int, int]]:
        """Keys of the finished windows."""
        return {window_key(r) for r in self.rows}

    def append(self, row: Mapping[str, Any]) -> None:
        """Append one finished window and fsync before returning."""
        line = _dumps({"kind": "window", "row": dict(row)}) + "\n"
        self._fh.write(line)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.rows.append(dict(row))

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_journal(path: str | Path, header: Mapping[str, Any], *, resume: bool) -> Journal:
    """Open ``path`` for appending windows of the run described by ``header``.

    Parameters
    ----------
    path : journal file.
    header : ``{"config", "geometry", "compatibility"}`` of this run (the key is computed here).
    resume : keep the finished windows of an existing journal of the same run; without it an
        existing journal is replaced by a fresh one.

    Raises
    ------
    InputError
        ``--resume`` on a journal of another run (different key) or an unreadable header.
    SchemaError
        A corrupt line other than a torn last line.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    key = run_key(header["config"], header["geometry"], header["compatibility"])
    full_header = {"kind": "header", "journal_version": JOURNAL_VERSION, "key": key, **dict(header)}
    if resume and p.exists() and p.stat().st_size > 0:
        journal = _read(p, key)
    else:
        write_text_atomic(p, _dumps(full_header) + "\n")
        journal = Journal(path=p, key=key, resumed=False)
    journal._fh = open(p, "a", encoding="utf-8")  # noqa: SIM115 - closed by Journal.close
    return journal


def _read(p: Path, key: str) -> Journal:
    data = p.read_bytes()
    lines = data.split(b"\n")
    # A file that does not end in a newline ends in a torn line (killed mid-append).
    torn = lines[-1] != b""
    complete = lines[:-1]
    good_end = sum(len(x) + 1 for x in complete)
    if not complete:
        raise InputError("--journal", str(p), "a calibration journal with a header line")
    try:
        head = json.loads(complete[0])
    except json.JSONDecodeError:
        raise InputError(
            "--journal", str(p), "a calibration journal (first line is not JSON)"
        ) from None
    if not isinstance(head, dict) or head.get("kind") != "header":
        raise InputError("--journal", str(p), "a calibration journal starting with a header line")
    if head.get("journal_version") != JOURNAL_VERSION:
        raise SchemaError("journal_version", head.get("journal_version"), f"{JOURNAL_VERSION}")
    if head.get("key") != key:
        raise InputError(
            "--journal",
            str(p),
            f"a journal of this same calibration (key {key[:12]})",
            hint=f"it belongs to another run (key {str(head.get('key'))[:12]}: different config, geometry "
            "or compatibility); drop --resume or pass another --journal",
        )
    rows = []
    for n, raw in enumerate(complete[1:], start=2):
        try:
            rec = json.loads(raw)
            if rec.get("kind") != "window" or not isinstance(rec.get("row"), dict):
                raise ValueError("not a window record")
            window_key(rec["row"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SchemaError(
                f"{p}:{n}", raw[:80].decode("utf-8", "replace"), f"a window record ({exc})"
            ) from None
        rows.append(rec["row"])
    if torn:
        with open(p, "r+b") as fh:
            fh.truncate(good_end)
            fh.flush()
            os.fsync(fh.fileno())
    return Journal(path=p, key=key, rows=rows, resumed=True, dropped_torn_line=torn)
