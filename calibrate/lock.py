"""Advisory lock on a calibration's outputs, so that two runs never write one table or journal.

A run holds ``OUT.lock`` (next to the table) and ``JOURNAL.lock`` (next to its journal: the
default ``OUT.journal.jsonl`` too, since another run may name that file with ``--journal``;
:func:`run_outputs`) from before the runner is built until the table is written: an exclusive
``fcntl.flock`` on an open descriptor, released by the kernel when the process dies, so a killed
run (SIGKILL, SIGTERM, power loss) never leaves a stale lock behind, only a stale file that the
next run takes over, saying so (a ``StaleLockWarning`` naming the file and the dead holder).
A lock file sits next to the file its output resolves to (symlinks followed), so two spellings
of one output share one lock.

Layout: the lock file holds one JSON object describing its holder, written after the lock is
taken: ``{"pid": int, "host": str, "started": ISO-8601 UTC, "command": str | null}``. A run that
finds the lock taken reads it and refuses, naming that holder; a run that gets the lock of a file
still describing a holder (which never removed it: it was killed) warns before replacing it.

Removal: the holder unlinks the file before releasing it. A run that opened the file just
before the unlink could then lock an inode no longer at that path, while a third run creates a new
file and locks that one; so after ``flock`` succeeds the acquirer checks that the path still names
the inode it locked, and starts over if not.

POSIX only (``fcntl``): the embedded runner runs on Linux.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import socket
import warnings
from pathlib import Path
from typing import Any

from speccal.base.atomic import output_error
from speccal.base.errors import InputError
from speccal.costmodel.compat import SpeccalWarning


class OutputLockedError(InputError):
    """Another live calibration holds the lock on this output."""


class StaleLockWarning(SpeccalWarning):
    """A lock file left by a run that ended without removing it was taken over."""


def lock_path(path: str | os.PathLike) -> Path:
    """The lock file of output ``path``: the file ``path`` resolves to (symlinks followed) with
    ``.lock`` appended to its name."""
    p = Path(os.path.realpath(path))
    return p.with_name(p.name + ".lock")


def run_outputs(out: str | os.PathLike, journal: str | os.PathLike) -> list[tuple[Path, str]]:
    """``(output, option)`` of everything a calibration locks: its table and its journal
    (the default ``OUT.journal.jsonl`` too: another run may name it with ``--journal``)."""
    return [(Path(out), "--out"), (Path(journal), "--journal")]


def read_holder(path: str | os.PathLike) -> dict[str, Any] | None:
    """The holder recorded in lock file ``path``; None if missing, empty or unreadable."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def describe_holder(holder: dict[str, Any] | None) -> str:
    """``pid 123 on host h since 2025-01-01T00:00:00Z (speccal calibrate ...)``."""
    if not holder:
        return "a process that has not yet recorded itself"
    text = (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since "
        f"{holder.get('started', '?')}"
    )
    if holder.get("command"):
        text += f" ({holder['command']})"
    return text


class OutputLock:
    """An exclusive advisory lock on one output; use :func:`acquire` (or as a context manager).

    Attributes
    ----------
    path : the lock file.
    field : the option that named the locked output, for messages.
    holder : what this process recorded in the lock file.
    """

    def __init__(self, path: Path, field: str, fd: int, holder: dict[str, Any]):
        self.path = path
        self.field = field
        self.holder = holder
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            # Unlink first, while still holding the lock (module docstring: removal).
            if _same_file(self.path, self._fd):
                self.path.unlink()
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _recorded_holder(fd: int) -> dict[str, Any] | None:
    """The holder a lock file just locked still records (its holder died holding it)."""
    try:
        doc = json.loads(os.pread(fd, 65536, 0) or b"null")
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc else None


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def acquire(
    output: str | os.PathLike, field: str, *, command: str | None = None, _retries: int = 20
) -> OutputLock:
    """Take the exclusive lock of ``output`` (its ``OUT.lock`` file) without waiting.

    Parameters
    ----------
    output : the output file the lock protects (the lock file is ``lock_path(output)``).
    field : the option that named ``output`` (``--out``), for the error message.
    command : the command line recorded for other runs to see.

    Raises
    ------
    OutputLockedError
        Another process holds the lock: names its pid, host, start time and command.
    OutputError
        The lock file cannot be created (see ``speccal.base.atomic.check_writable``).
    """
    path = lock_path(output)
    for _ in range(_retries):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise output_error(field, path, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputLockedError(
                field,
                str(output),
                "an output no other calibration is writing",
                hint=f"locked by {describe_holder(read_holder(path))}; wait for that run to "
                f"finish or pass another {field}",
            ) from None
        except OSError as exc:
            os.close(fd)
            raise output_error(field, path, exc) from None
        if not _same_file(path, fd):  # removed by its previous holder meanwhile: start over
            os.close(fd)
            continue
        stale = _recorded_holder(fd)
        if stale:
            warnings.warn(
                StaleLockWarning(
                    f"{field}: took over the stale lock file {path} of "
                    f"{describe_holder(stale)}, which ended without releasing it (killed?)"
                ),
                stacklevel=2,
            )
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command,
        }
        data = (json.dumps(holder, sort_keys=True) + "\n").encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            raise output_error(field, path, exc) from None
        return OutputLock(path, field, fd, holder)
    raise OutputLockedError(
        field,
        str(output),
        "an output no other calibration is writing",
        hint="the lock file kept changing",
    )
