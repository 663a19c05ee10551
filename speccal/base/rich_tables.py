"""Rich output that stays legible: on any terminal width (80 columns included), in a pipe, and
whatever text a user's values hold.

Rich's default for a cell wider than its column is an ellipsis: at 80 columns a ten-column fit
report printed ``0.21…`` and ``leav…`` instead of its numbers and labels. :func:`print_table` is
the one rule every command prints its tables through:

- every column folds instead of truncating (``overflow="fold"``): a value that cannot fit wraps
  onto the next line, digits kept;
- a table whose natural width exceeds the console switches to a compact layout first (a rule
  under the header instead of a box, one space between columns, no edge padding), which fits
  about a fifth more text: the fit reports of ``table show`` and ``calibrate`` fit 80 columns
  whole.

- cells, headers and titles are plain text: a value read from a file or the command line
  (``[true]`` in a kernel configuration, ``:rocket:`` in a path) is shown as it is, never as
  Rich markup or an emoji code.

:func:`make_console` is the one place the CLI's consoles are made (:class:`LegibleConsole`):

- no emoji codes anywhere (``--context 10:100:50`` printed "10💯50"); markup stays on for the
  text of the messages themselves, and every user value in one is passed through
  ``rich.markup.escape`` by the code that formats it;
- not a terminal (a pipe, a file, CI, ``CliRunner``): nothing wraps, at any width, unless the
  environment pins one with ``COLUMNS``: a log or a ``grep`` gets one line per line and whole
  table rows (a fit report, a bench table, a ``table diff`` folded at 80 columns were
  unreadable piped). A terminal keeps its own width.

Ground floor: imports nothing of ours (Rich only).
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, ConsoleDimensions
from rich.table import Table
from rich.text import Text

#: Width the natural (unwrapped) layout of a table is measured at, and the width of a console
#: that is not a terminal.
_UNBOUNDED = 10**6


class LegibleConsole(Console):
    """A ``Console`` as :func:`make_console` describes: a console that is not a terminal and
    has no width of its own (``width=``, ``COLUMNS``) is unbounded, so nothing wraps."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        pinned = self._width is not None or (self._environ.get("COLUMNS") or "").isdigit()
        if pinned or self.is_terminal or self.is_jupyter:
            return dims
        return ConsoleDimensions(_UNBOUNDED, dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


def make_console(*, stderr: bool = True, **kwargs: Any) -> Console:
    """A :class:`LegibleConsole` on stderr (the CLI's human output), emoji codes off.

    ``kwargs`` go to ``Console`` (``file=`` for a console that writes elsewhere).
    """
    return LegibleConsole(stderr=stderr, emoji=False, **kwargs)


def _plain(value: Any) -> Any:
    """``value`` as plain ``Text`` when it is a string (no markup, no emoji codes)."""
    return Text(value) if isinstance(value, str) else value


def natural_width(console: Console, table: Table) -> int:
    """The width ``table`` takes when nothing wraps."""
    return console.measure(table, options=console.options.update_width(_UNBOUNDED)).maximum


def legible(console: Console, table: Table) -> Table:
    """Make ``table`` legible on ``console`` in place (module docstring) and return it."""
    if isinstance(table.title, str):
        table.title = Text(table.title, style="table.title")
    for column in table.columns:
        column.overflow = "fold"
        column.header = _plain(column.header)
        # Rich keeps a column's cells in a private list; there is no public way to reset them
        column._cells = [_plain(c) for c in column._cells]
    if natural_width(console, table) > console.width:
        table.box = box.SIMPLE_HEAD
        table.show_edge = False
        table.pad_edge = False
        table.padding = (0, 1)
        table.collapse_padding = True
    return table


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` on ``console`` through :func:`legible`."""
    console.print(legible(console, table))
