"""Outputs that name an input: the one check every command runs before it writes anything.

``speccal table export T --out T`` replaced the table by its own export, ``speccal export D
--to vllm --trace TR --out TR`` the trace by the engine file, ``speccal calibrate --config C
--out C`` the config by the table, all with exit 0. :func:`check_outputs` refuses, before any
work, an output that is the same file as one of the command's inputs or as another of its
outputs (the engine file and its sidecar, a trace and its ``--rounds-out``), with one line
naming both options and the path (``OutputError``, exit 2): nothing is written.

"The same file" is the filesystem's answer, not the spelling's: two existing paths are the
same when ``os.path.samefile`` says so (one device and inode: a symlink, a hard link, ``./T``
and ``/abs/T`` all count); a path that does not exist yet is compared by ``os.path.realpath``
(symlinks in its parents resolved). An input that does not exist is skipped: nothing can
destroy it, and its reader says what is wrong with it. A directory output (``plot --out DIR``)
is checked as the files the command writes into it.

Ground floor: imports nothing of ours but the errors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from speccal.base.errors import OutputError

#: ``(option, path)``: a path a command reads or writes and the option (or argument) naming it;
#: a None path (an option not given) is skipped.
Named = tuple[str, "str | os.PathLike[str] | None"]


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name one file (module docstring)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # one of them does not exist (yet), or is no path at all
        try:
            return os.path.realpath(a) == os.path.realpath(b)
        except (OSError, ValueError):
            return False


def check_outputs(outputs: Iterable[Named], inputs: Iterable[Named] = ()) -> None:
    """Refuse an output that is one of ``inputs`` or another of ``outputs``.

    Parameters
    ----------
    outputs : ``(option, path)`` of every file the command writes (a directory output as the
        files it writes there).
    inputs : ``(option, path)`` of every file the command reads; ``TABLE`` for an argument.

    Raises
    ------
    OutputError
        ``--out: got './T', expected a path other than TABLE (it is the same file as TABLE
        'T')``.
    """
    outs = [(f, p) for f, p in outputs if p is not None]
    ins = [(f, p) for f, p in inputs if p is not None and _exists(p)]
    for i, (field, path) in enumerate(outs):
        for other_field, other in [*ins, *outs[:i]]:
            if same_file(path, other):
                raise OutputError(
                    field,
                    str(path),
                    f"a path other than {other_field}",
                    hint=f"it is the same file as {other_field} {str(other)!r}",
                )


def _exists(path: str | os.PathLike[str]) -> bool:
    try:
        return os.path.exists(path)
    except (OSError, ValueError):
        return False
