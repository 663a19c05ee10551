"""Rich tables that stay legible at any terminal width (80 columns included).

Rich's default for a cell wider than its column is an ellipsis: at 80 columns a ten-column fit
report printed ``0.21…`` and ``leav…`` instead of its numbers and labels. :func:`print_table` is
the one rule every command prints its tables through:

- every column folds instead of truncating (``overflow="fold"``): a value that cannot fit wraps
  onto the next line, digits kept;
- a table whose natural width exceeds the console switches to a compact layout first (a rule
  under the header instead of a box, one space between columns, no edge padding), which fits
  about a fifth more text: the fit reports of ``table show`` and ``calibrate`` fit 80 columns
  whole.

Ground floor: imports nothing of ours (Rich only).
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

#: Width the natural (unwrapped) layout of a table is measured at.
_UNBOUNDED = 10**6


def natural_width(console: Console, table: Table) -> int:
    """The width ``table`` takes when nothing wraps."""
    return console.measure(table, options=console.options.update_width(_UNBOUNDED)).maximum


def legible(console: Console, table: Table) -> Table:
    """Make ``table`` legible on ``console`` in place (module docstring) and return it."""
    for column in table.columns:
        column.overflow = "fold"
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
