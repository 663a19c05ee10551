"""Append-only JSONL journal of finished measurement windows, so a killed calibration can resume.

Layout (one JSON object per line, sorted keys)::

    {"kind": "header", "journal_version": 1, "key": "<sha256>", "config": {...},
     "geometry": {...}, "compatibility": {...}, "measurement": {"threads": 1}}
    {"kind": "window", "row": {<one measurement row, see docs/ARCHITECTURE.md>}}
    ...

``key`` hashes the effective calibration config, the captured geometry, the runner's
compatibility metadata and the measurement conditions (torch's intra-op threads): a journal
written by another run (other buckets, width, model, device, thread count...) is refused at
``--resume`` instead of mixing its windows into this table. Re-measured windows of noisy points
(``speccal.calibrate.gate``) are window lines like any other, with window indices past
``windows_per_point``.

Durability: the header is written atomically (temp file, fsync, rename, directory fsync); each
window line is appended, flushed and fsynced before the next window starts. A crash can leave at
most one torn last line, which ``open_journal`` drops (and truncates) on resume.

No measurement is lost or counted twice:

- starting afresh over a journal that holds finished windows is refused unless the caller says
  ``overwrite`` (``check_discard``; ``speccal calibrate --overwrite``), so a rerun that forgot
  ``--resume`` does not silently throw the windows away;
- two runs never append to one journal at once: ``speccal.calibrate.lock`` holds the output;
- a journal written before that lock existed (two concurrent ``--resume`` runs) may hold the same
  window twice: resume keeps the first line of each window identity (``window_identity``: mode,
  context, Bcap, G, k, window index), drops the others and rewrites the file without them
  (atomically), so the fit sees each window once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speccal.base.atomic import write_bytes_atomic, write_text_atomic
from speccal.base.errors import InputError, SchemaError

JOURNAL_VERSION = 1


def run_key(
    config: Mapping[str, Any],
    geometry: Mapping[str, Any],
    compatibility: Mapping[str, Any],
    measurement: Mapping[str, Any] | None = None,
) -> str:
    """Stable hash of what makes two calibration runs interchangeable (``measurement``: the
    conditions that change timings without changing the program, e.g. ``{"threads": 1}``)."""
    parts: dict[str, Any] = {"config": config, "geometry": geometry, "compatibility": compatibility}
    if measurement is not None:
        parts["measurement"] = measurement
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), allow_nan=False)
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


def window_identity(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """(mode, context_index, bcap, g, k, window_index): one window, measured once."""
    return (row.get("mode"), *window_key(row))


def existing_windows(path: str | Path) -> int:
    """Finished windows in the journal at ``path`` (complete lines after the header; 0 if the
    file is missing or empty). Does not validate the lines (``open_journal`` does)."""
    try:
        data = Path(path).read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return 0
    except OSError as exc:
        raise InputError(
            "--journal", str(path), "a readable journal file", hint=exc.strerror
        ) from None
    return max(data.count(b"\n") - 1, 0)


def check_discard(path: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to replace a journal holding finished windows unless asked to (module docstring).

    Raises
    ------
    InputError
        ``path`` holds finished windows and neither ``resume`` nor ``overwrite`` is set.
    """
    if resume or overwrite:
        return
    n = existing_windows(path)
    if n:
        raise InputError(
            "--journal",
            f"{path} ({n} finished window{'s' if n != 1 else ''})",
            "no journal to discard",
            hint="pass --resume to continue it or --overwrite to discard its windows",
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
    dropped_duplicates: int = 0
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


def open_journal(
    path: str | Path, header: Mapping[str, Any], *, resume: bool, overwrite: bool = False
) -> Journal:
    """Open ``path`` for appending windows of the run described by ``header``.

    Parameters
    ----------
    path : journal file.
    header : ``{"config", "geometry", "compatibility"}`` of this run, optionally
        ``"measurement"`` (the key is computed here).
    resume : keep the finished windows of an existing journal of the same run (duplicates of a
        window dropped, ``Journal.dropped_duplicates``).
    overwrite : without ``resume``, replace an existing journal even if it holds finished windows.

    Raises
    ------
    InputError
        ``--resume`` on a journal of another run (different key) or an unreadable header; an
        existing journal with finished windows and neither ``resume`` nor ``overwrite``.
    SchemaError
        A corrupt line other than a torn last line.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    key = run_key(
        header["config"], header["geometry"], header["compatibility"], header.get("measurement")
    )
    full_header = {"kind": "header", "journal_version": JOURNAL_VERSION, "key": key, **dict(header)}
    if resume and p.exists() and p.stat().st_size > 0:
        journal = _read(p, key)
    else:
        check_discard(p, resume=resume, overwrite=overwrite)
        write_text_atomic(p, _dumps(full_header) + "\n", field="--journal")
        journal = Journal(path=p, key=key, resumed=False)
    journal._fh = open(p, "a", encoding="utf-8")  # closed by Journal.close
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
            hint=f"it belongs to another run (key {str(head.get('key'))[:12]}: different config, geometry, "
            "compatibility or --threads); pass --overwrite (without --resume) to replace it or another --journal",
        )
    rows = []
    kept_lines = [complete[0]]
    seen: set[tuple[Any, ...]] = set()
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
        ident = window_identity(rec["row"])
        if ident in seen:  # the first measurement of a window stands (module docstring)
            continue
        seen.add(ident)
        rows.append(rec["row"])
        kept_lines.append(raw)
    dropped = len(complete) - len(kept_lines)
    if dropped:
        # Rewriting also drops a torn last line.
        write_bytes_atomic(p, b"".join(x + b"\n" for x in kept_lines), field="--journal")
    elif torn:
        with open(p, "r+b") as fh:
            fh.truncate(good_end)
            fh.flush()
            os.fsync(fh.fileno())
    return Journal(
        path=p,
        key=key,
        rows=rows,
        resumed=True,
        dropped_torn_line=torn,
        dropped_duplicates=dropped,
    )
