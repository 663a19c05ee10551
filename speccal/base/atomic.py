"""Atomic file writes shared by every package that persists something (tables, journals, traces).

A write goes to a temporary file in the destination directory, is flushed and fsynced, then
renamed over the destination (``os.replace`` is atomic on POSIX and Windows), and finally the
directory is fsynced so the rename itself survives a power loss. A reader therefore sees either
the old file or the complete new one, never a truncated mix; a failure mid-write leaves the old
file untouched and removes the temporary file.

JSON is written canonically (sorted keys, ``allow_nan=False``, two-space indent, trailing
newline) so that saving the same document twice gives identical bytes.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["dumps_json", "write_bytes_atomic", "write_json_atomic", "write_text_atomic"]


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; a replaced file keeps its mode, a new one gets the usual 0666 & ~umask.
_UMASK = _read_umask()


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename + directory fsync).

    Parameters
    ----------
    path : destination file; its parent directory must exist.
    data : the complete new content.

    Returns
    -------
    The destination as a ``Path``.
    """
    dest = Path(path)
    directory = dest.parent if str(dest.parent) else Path(".")
    try:
        mode = dest.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_UMASK
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        # Leave the old file as it was; never leave a stray temp file next to it.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)
    return dest


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically; see :func:`write_bytes_atomic`."""
    return write_bytes_atomic(path, text.encode(encoding))


def dumps_json(obj: Any) -> str:
    """Canonical JSON text: sorted keys, no NaN/Infinity, two-space indent, trailing newline.

    Raises ``ValueError`` when ``obj`` holds a NaN or infinite float.
    """
    return json.dumps(obj, sort_keys=True, allow_nan=False, indent=2, ensure_ascii=False) + "\n"


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Serialise ``obj`` with :func:`dumps_json` and write it atomically.

    The document is serialised before the file is touched, so an unserialisable object (e.g. one
    holding NaN) leaves the destination unchanged.
    """
    return write_text_atomic(path, dumps_json(obj))


def _fsync_dir(directory: Path) -> None:
    # Directory fsync makes the rename durable; not every platform allows opening a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
