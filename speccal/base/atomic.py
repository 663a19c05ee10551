"""Atomic file writes shared by every package that persists something (tables, journals, traces).

A write goes to a temporary file in the destination directory, is flushed and fsynced, then
renamed over the destination (``os.replace`` is atomic on POSIX and Windows), and finally the
directory is fsynced so the rename itself survives a power loss. A reader therefore sees either
the old file or the complete new one, never a truncated mix; a failure mid-write leaves the old
file untouched and removes the temporary file.

JSON is written canonically (sorted keys, ``allow_nan=False``, two-space indent, trailing
newline) so that saving the same document twice gives identical bytes.

Every file error is reported here, once, as a speccal error naming the option (``field``), the
path and the operating system's reason, so that no command prints a traceback for a bad path:

- writers raise ``OutputError`` (exit 2) instead of ``OSError``;
- ``check_writable(path, field)`` refuses, before any work starts, an output that could not be
  written at the end (an existing directory, a missing parent, a parent that is a file, a
  directory that refuses new files: permission denied, ``/proc``); it creates and removes a
  probe file, because permission bits alone do not say what ``root`` or a special filesystem
  allows;
- readers (``read_bytes``, ``read_text``, ``read_json``) raise ``InputError`` for a missing file,
  a directory, a special file (a FIFO or ``/dev/zero`` would block or never end), an unreadable
  file, bytes that are not UTF-8 and text that is not JSON.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from speccal.base.errors import InputError, OutputError

__all__ = [
    "check_writable",
    "dumps_json",
    "ensure_dir",
    "output_error",
    "read_bytes",
    "read_json",
    "read_text",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; a replaced file keeps its mode, a new one gets the usual 0666 & ~umask.
_UMASK = _read_umask()


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, field: str = "output") -> Path:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename + directory fsync).

    Parameters
    ----------
    path : destination file; its parent directory must exist.
    data : the complete new content.
    field : the option or key that named ``path``, for the error message.

    Returns
    -------
    The destination as a ``Path``.

    Raises
    ------
    OutputError
        Any ``OSError`` of the write (the destination is a directory, its directory is missing or
        refuses new files, the disk is full, ...); the old file is left as it was.
    """
    dest = Path(path)
    directory = dest.parent if str(dest.parent) else Path(".")
    try:
        if dest.is_dir():
            raise IsADirectoryError(21, "Is a directory", str(dest))
        try:
            mode = dest.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_UMASK
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise output_error(field, dest, exc) from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException as exc:
        # Leave the old file as it was; never leave a stray temp file next to it.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise output_error(field, dest, exc) from None
        raise
    _fsync_dir(directory)
    return dest


def write_text_atomic(
    path: str | os.PathLike, text: str, encoding: str = "utf-8", *, field: str = "output"
) -> Path:
    """Write ``text`` to ``path`` atomically; see :func:`write_bytes_atomic`."""
    return write_bytes_atomic(path, text.encode(encoding), field=field)


def dumps_json(obj: Any) -> str:
    """Canonical JSON text: sorted keys, no NaN/Infinity, two-space indent, trailing newline.

    Raises ``ValueError`` when ``obj`` holds a NaN or infinite float.
    """
    return json.dumps(obj, sort_keys=True, allow_nan=False, indent=2, ensure_ascii=False) + "\n"


def nan_to_none(obj: Any) -> Any:
    """``obj`` with every NaN float replaced by None, through dicts and lists (JSON has no NaN)."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [nan_to_none(v) for v in obj]
    return obj


def write_json_atomic(path: str | os.PathLike, obj: Any, *, field: str = "output") -> Path:
    """Serialise ``obj`` with :func:`dumps_json` and write it atomically.

    The document is serialised before the file is touched, so an unserialisable object (e.g. one
    holding NaN) leaves the destination unchanged.
    """
    return write_text_atomic(path, dumps_json(obj), field=field)


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


def output_error(field: str, path: str | os.PathLike, exc: OSError) -> OutputError:
    """The one-line ``OutputError`` for an ``OSError`` raised while writing ``path``.

    For every writer of speccal files, so that they all word an OS failure the same way.
    """
    if isinstance(exc, IsADirectoryError):
        expected = "a file path, not an existing directory"
    elif isinstance(exc, FileNotFoundError):
        expected = "a path in an existing directory that accepts new files"
    elif isinstance(exc, NotADirectoryError):
        expected = "a path whose parent is a directory"
    elif isinstance(exc, PermissionError):
        expected = "a path in a writable directory"
    else:
        expected = "a writable file path"
    return OutputError(field, str(path), expected, hint=exc.strerror or type(exc).__name__)


def _check_parent(parent: Path, field: str, path: Path) -> None:
    """Refuse ``path`` unless ``parent`` is an existing directory (names the missing part)."""
    try:
        st = os.stat(parent)
    except (FileNotFoundError, NotADirectoryError):
        above = parent
        while not os.path.lexists(above) and above != above.parent:
            above = above.parent
        if os.path.lexists(above) and not os.path.isdir(above):
            raise OutputError(
                field, str(path), "a path under a directory", hint=f"{above} is a file"
            ) from None
        raise OutputError(
            field, str(path), "a path in an existing directory", hint=f"{parent} does not exist"
        ) from None
    except OSError as exc:
        raise output_error(field, path, exc) from None
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(field, str(path), "a path under a directory", hint=f"{parent} is a file")


def _probe(directory: Path, field: str, path: Path) -> None:
    """Create and remove a file in ``directory``: the only test of writability that holds for
    root, read-only mounts and special filesystems alike."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name or 'out'}.", suffix=".probe", dir=directory)
    except OSError as exc:
        raise OutputError(
            field,
            str(path),
            "a path in a directory that accepts new files",
            hint=f"cannot create a file in {directory}: {exc.strerror or type(exc).__name__}",
        ) from None
    os.close(fd)
    os.unlink(tmp)


def check_writable(path: str | os.PathLike, field: str, *, directory: bool = False) -> Path:
    """Refuse, before any work, an output path that could not be written at the end.

    Parameters
    ----------
    path : the output: a file written atomically (default), or with ``directory=True`` a
        directory that is created if missing and then filled with files.
    field : the option or key that named ``path`` (``--out``), for the error message.
    directory : check a directory output instead of a file.

    Returns
    -------
    ``path`` as a ``Path``. Nothing is left behind (a probe file is created and removed).

    Raises
    ------
    OutputError
        A file output that is an existing directory or a special file, a missing parent
        directory, a parent that is a file, a directory that refuses new files (permission
        denied, ``/proc``), an existing file without write permission; a directory output that
        is a file or whose nearest existing ancestor is a file or refuses new files.
    """
    p = Path(path)
    try:
        if directory:
            if os.path.lexists(p):
                if not os.path.isdir(p):
                    raise OutputError(
                        field,
                        str(p),
                        "a directory (or a path that does not exist yet)",
                        hint=f"{p} is a file",
                    )
                _probe(p, field, p)
                return p
            above = p.parent
            while not os.path.lexists(above) and above != above.parent:
                above = above.parent
            if not os.path.isdir(above):
                raise OutputError(
                    field, str(p), "a path under a directory", hint=f"{above} is a file"
                )
            _probe(above, field, p)
            return p
        if os.path.isdir(p):
            raise OutputError(field, str(p), "a file path, not an existing directory")
        if os.path.exists(p) and not os.path.isfile(p):
            raise OutputError(
                field, str(p), "a regular file path", hint="it exists and is not a regular file"
            )
        _check_parent(p.parent, field, p)
        _probe(p.parent, field, p)
        if os.path.exists(p) and not os.access(p, os.W_OK):
            raise OutputError(field, str(p), "a writable file", hint="permission denied")
    except OutputError:
        raise
    except OSError as exc:
        raise output_error(field, p, exc) from None
    except ValueError as exc:  # e.g. an embedded NUL byte
        raise OutputError(field, str(p), "a file path", hint=str(exc)) from None
    return p


def ensure_dir(path: str | os.PathLike, field: str = "output") -> Path:
    """Create directory ``path`` (and its parents) if missing; ``OutputError`` when it cannot."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(
            field, str(p), "a directory (or a path that does not exist yet)", hint=f"{p} is a file"
        ) from None
    except OSError as exc:
        raise output_error(field, p, exc) from None
    return p


def read_bytes(path: str | os.PathLike, field: str) -> bytes:
    """The content of the regular file ``path``.

    Raises
    ------
    InputError
        Missing file, a directory, a special file (a FIFO, a device), a file that cannot be read.
    """
    p = Path(path)
    try:
        st = os.stat(p)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(field, str(p), "a file, not a directory")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(field, str(p), "a regular file", hint="it is a special file")
        return p.read_bytes()
    except InputError:
        raise
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(field, str(p), "an existing file") from None
    except OSError as exc:
        raise InputError(
            field, str(p), "a readable file", hint=exc.strerror or type(exc).__name__
        ) from None
    except ValueError as exc:  # e.g. an embedded NUL byte
        raise InputError(field, str(p), "a file path", hint=str(exc)) from None


def read_text(path: str | os.PathLike, field: str, encoding: str = "utf-8") -> str:
    """The content of the text file ``path`` (see :func:`read_bytes`).

    Raises
    ------
    InputError
        As :func:`read_bytes`, and for bytes that are not valid ``encoding`` (names the offset).
    """
    data = read_bytes(path, field)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise InputError(
            field,
            str(path),
            f"a {encoding.upper()} text file",
            hint=f"undecodable byte 0x{data[exc.start]:02x} at offset {exc.start}",
        ) from None


def read_json(path: str | os.PathLike, field: str) -> Any:
    """The JSON document in ``path`` (see :func:`read_text`).

    Raises
    ------
    InputError
        As :func:`read_text`, and for text that is not JSON (names the line and column).
    """
    text = read_text(path, field)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            field, str(path), "a JSON file", hint=f"line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
