"""Domain errors shared by every speccal package.

Library code raises these; only ``speccal.cli`` turns them into a one-line message and an exit
code (2 for bad input, 1 for a runtime failure). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any


class SpeccalError(Exception):
    """Base class of every error speccal raises on purpose."""

    exit_code = 1


class InputError(SpeccalError, ValueError):
    """Bad user input: a config value, a file, a CLI option.

    The message names the field, the value found and what was expected, so that a user can fix
    the input without reading code.
    """

    exit_code = 2

    def __init__(
        self,
        field: str,
        value: Any,
        expected: str,
        *,
        hint: str | None = None,
        found: str | None = None,
    ):
        """``found``: the text shown after "got" in place of ``value`` (never shortened), for a
        value better described than quoted (e.g. the columns a file has)."""
        self.field = field
        self.value = value
        self.expected = expected
        self.hint = hint
        msg = f"{field}: got {_short(value) if found is None else found}, expected {expected}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)


class GridError(InputError):
    """A calibration grid or measurement set that a cost model cannot be fitted on."""


class CompatibilityError(InputError):
    """A saved cost table whose semantic compatibility metadata differs from the running config."""


class SchemaError(InputError):
    """A table or trace document that is unreadable, malformed or of an unsupported version."""


class LineError(SchemaError):
    """A bad line of a line-oriented file (a calibration journal): the message reads
    ``<path>:<line>: <field>=<value>: expected <expected> (<hint>)``.

    ``field`` is ``<path>:<line>: <field>`` like every other error naming a place, and
    ``path``, ``line`` and ``column`` (the field inside the line) are kept for callers.
    """

    def __init__(
        self,
        path: str,
        line: int,
        column: str,
        value: Any,
        expected: str,
        *,
        hint: str | None = None,
    ):
        self.path, self.line, self.column = path, line, column
        super().__init__(
            f"{path}:{line}: {column}", value, expected, hint=hint, found=_short(value)
        )
        msg = f"{path}:{line}: {column}={_short(value)}: expected {expected}"
        self.args = (msg + (f" ({hint})" if hint else ""),)


class OutputError(InputError):
    """An output that cannot be written: an existing directory, a missing parent, a parent that
    is a file, permission denied, a filesystem that refuses new files (``/proc``), a full disk.

    Raised by ``speccal.base.atomic`` (its writers and ``check_writable``) in place of the
    ``OSError``, so every command reports it as one line and exit 2. ``value`` is the path,
    ``hint`` the operating system's reason.
    """


class CapacityError(SpeccalError):
    """The runner ran out of a fixed resource (KV blocks, captured buckets)."""

    exit_code = 2


class UnsupportedError(SpeccalError):
    """A request for a feature, layout or option that speccal refuses on purpose."""

    exit_code = 2


def plain(value: Any) -> Any:
    """``value`` with numpy scalars and arrays as the Python numbers and lists they hold,
    containers element-wise, so a message shows ``0.25``, not ``np.float64(0.25)``.

    The one rule for numbers in messages: library code formats values through it (or through
    :func:`show`); anything else is returned as it is.
    """
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [plain(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    # numpy scalars and arrays (duck-typed: this floor imports no numpy)
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()
    return value


def show(value: Any) -> str:
    """``repr`` of :func:`plain` ``(value)``: how a message shows a value it quotes."""
    return repr(plain(value))


def _short(value: Any, limit: int = 120) -> str:
    text = show(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
