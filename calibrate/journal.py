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

Every window line is validated where it is read (``speccal.costmodel.measurements.row_problem``:
known columns, integers that are integers, finite positive times, ``step_ms`` equal to
``1000 * elapsed_s / window_steps``, the header's ``window_steps`` and ``mode``). ``--resume``
refuses a journal with an invalid line, naming ``<path>:<line>: <field>=<value>``, and says how
to keep the other windows: ``--resume --drop-bad-windows`` rewrites the journal without the
invalid lines (atomically; a warning names them) and measures those windows again. A failed
append (a full disk) is one ``OutputError`` naming the journal and the operating system's
reason; the partial line is cut off, so the earlier lines stay intact and ``--resume`` works
once there is room.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speccal.base.atomic import write_bytes_atomic, write_text_atomic
from speccal.base.errors import InputError, LineError, OutputError, SchemaError, show
from speccal.costmodel.compat import SpeccalWarning
from speccal.costmodel.measurements import row_problem

JOURNAL_VERSION = 1
#: The option that drops invalid window lines at ``--resume`` (``speccal calibrate``).
DROP_FLAG = "--drop-bad-windows"


#: Window-line columns beyond the measurement columns: the probe clock's
#: (``speccal.calibrate.driver.measurement_row``).
EXTRA_ROW_COLUMNS = {
    "clock": "str",
    "wall_s": "float",
    "probe_ms": "float",
    "probe_ref_ms": "float",
}


class DroppedWindowLinesWarning(SpeccalWarning):
    """``--resume --drop-bad-windows`` removed invalid window lines (named) from the journal;
    their windows are measured again."""


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


def window_key(row: Mapping[str, Any]) -> tuple:
    """(context_index, bcap, g, k, window_index) of a measurement row; a spread point's rows
    (``layout``: ``speccal.calibrate.grid.spread_points``) carry the layout before the window
    index, as their ``GridPoint.key`` does."""
    base = (int(row["context_index"]), int(row["bcap"]), int(row["g"]), int(row["k"]))
    layout = row.get("layout")
    return (*base, int(row["window_index"])) if layout is None else (
        *base, str(layout), int(row["window_index"]))


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
    dropped_bad_lines: list[int] = field(default_factory=list)  # line numbers (1 = header)
    _fh: Any = None

    @property
    def done(self) -> set[tuple[int, int, int, int, int]]:
        """Keys of the finished windows."""
        return {window_key(r) for r in self.rows}

    def append(self, row: Mapping[str, Any]) -> None:
        """Append one finished window and fsync before returning.

        Raises
        ------
        OutputError
            The write or fsync failed (a full disk, an I/O error): names the journal and the
            operating system's reason. The partial line is cut off, so the journal keeps
            exactly its earlier lines.
        """
        data = (_dumps({"kind": "window", "row": dict(row)}) + "\n").encode("utf-8")
        fd = self._fh.fileno()
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[self._fh.write(view) :]
            os.fsync(fd)
        except OSError as exc:
            try:  # keep the earlier lines exactly: no torn line left behind
                os.ftruncate(fd, start)
            except OSError:
                pass
            reason = exc.strerror or type(exc).__name__
            raise OutputError(
                "--journal",
                str(self.path),
                "a journal file that accepts the next window",
                hint=f"{reason}; its {len(self.rows)} earlier window(s) are kept: free space "
                "and rerun with --resume",
            ) from None
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
    path: str | Path,
    header: Mapping[str, Any],
    *,
    resume: bool,
    overwrite: bool = False,
    drop_bad: bool = False,
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
    drop_bad : with ``resume``, drop invalid window lines (``Journal.dropped_bad_lines``,
        :class:`DroppedWindowLinesWarning`) instead of refusing the journal.

    Raises
    ------
    InputError
        ``--resume`` on a journal of another run (different key) or an unreadable header; an
        existing journal with finished windows and neither ``resume`` nor ``overwrite``.
    LineError
        With ``resume`` and without ``drop_bad``: an invalid line other than a torn last line
        (names path, line, field and value, and how to keep the other windows).
    OutputError
        The journal cannot be written.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    key = run_key(
        header["config"], header["geometry"], header["compatibility"], header.get("measurement")
    )
    full_header = {"kind": "header", "journal_version": JOURNAL_VERSION, "key": key, **dict(header)}
    if resume and p.exists() and p.stat().st_size > 0:
        journal = _read(p, key, header, drop_bad=drop_bad)
    else:
        check_discard(p, resume=resume, overwrite=overwrite)
        write_text_atomic(p, _dumps(full_header) + "\n", field="--journal")
        journal = Journal(path=p, key=key, resumed=False)
    try:
        journal._fh = open(p, "ab", buffering=0)  # closed by Journal.close
    except OSError as exc:
        raise OutputError(
            "--journal", str(p), "a writable journal file", hint=exc.strerror
        ) from None
    return journal


def _line_problem(
    raw: bytes, config: Mapping[str, Any]
) -> tuple[str, Any, str] | tuple[None, dict[str, Any], None]:
    """``(field, value, expected)`` of an invalid window line, else ``(None, row, None)``."""
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return "line", raw[:80].decode("utf-8", "replace"), f"a JSON window record ({exc})"
    if not isinstance(rec, dict) or rec.get("kind") != "window":
        return "kind", rec.get("kind") if isinstance(rec, dict) else rec, "'window'"
    extra = sorted(set(rec) - {"kind", "row"})
    if extra:
        return extra[0], rec[extra[0]], "no such key (unknown key)"
    row = rec.get("row")
    if not isinstance(row, dict):
        return "row", row, "a measurement row object"
    bad = row_problem(row, EXTRA_ROW_COLUMNS)
    if bad is not None:
        return bad
    # the header's config is part of the key: a row disagreeing with it was edited
    for col in ("window_steps", "mode"):
        want = config.get(col)
        if want is not None and col in row and row[col] != want:
            return col, row[col], f"{show(want)}, the journal header's config.{col}"
    return None, row, None


def _read(p: Path, key: str, header: Mapping[str, Any], *, drop_bad: bool = False) -> Journal:
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(
            "--journal", str(p), "a readable journal file", hint=exc.strerror
        ) from None
    lines = data.split(b"\n")
    # A file that does not end in a newline ends in a torn line (killed mid-append).
    torn = lines[-1] != b""
    complete = lines[:-1]
    good_end = sum(len(x) + 1 for x in complete)
    if not complete:
        raise InputError("--journal", str(p), "a calibration journal with a header line")
    try:
        head = json.loads(complete[0])
    except (ValueError, UnicodeDecodeError):
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
    config = header.get("config")
    config = config if isinstance(config, Mapping) else {}
    rows = []
    kept_lines = [complete[0]]
    seen: set[tuple[Any, ...]] = set()
    bad: list[tuple[int, str, Any, str]] = []
    for n, raw in enumerate(complete[1:], start=2):
        col, value, expected = _line_problem(raw, config)
        if col is not None:
            bad.append((n, col, value, expected))
            continue
        ident = window_identity(value)
        if ident in seen:  # the first measurement of a window stands (module docstring)
            continue
        seen.add(ident)
        rows.append(value)
        kept_lines.append(raw)
    if bad and not drop_bad:
        n, col, value, expected = bad[0]
        numbers = ", ".join(str(b[0]) for b in bad[:10]) + (", ..." if len(bad) > 10 else "")
        raise LineError(
            str(p),
            n,
            col,
            value,
            expected,
            hint=f"{len(bad)} invalid window line(s) ({numbers}) of {len(complete) - 1}; to keep "
            f"the other windows rerun with --resume {DROP_FLAG} (the dropped windows are "
            "measured again) or delete those lines; --overwrite discards every window",
        )
    dropped = len(complete) - len(kept_lines) - len(bad)
    if dropped or bad:
        # Rewriting also drops a torn last line.
        write_bytes_atomic(p, b"".join(x + b"\n" for x in kept_lines), field="--journal")
    elif torn:
        try:
            with open(p, "r+b") as fh:
                fh.truncate(good_end)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise OutputError(
                "--journal", str(p), "a writable journal file", hint=exc.strerror
            ) from None
    if bad:
        listed = "; ".join(f"line {n}: {c}={show(v)}" for n, c, v, _ in bad[:10])
        warnings.warn(
            DroppedWindowLinesWarning(
                f"{p}: dropped {len(bad)} invalid window line(s) ({listed}"
                f"{'; ...' if len(bad) > 10 else ''}); those windows are measured again"
            ),
            stacklevel=3,
        )
    return Journal(
        path=p,
        key=key,
        rows=rows,
        resumed=True,
        dropped_torn_line=torn,
        dropped_duplicates=dropped,
        dropped_bad_lines=[b[0] for b in bad],
    )
