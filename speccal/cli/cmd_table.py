"""CLI commands ``speccal table show|validate|diff|export`` (``check``: ``cmd_check``,
``compat``: ``cmd_compat``) and the ``speccal table`` group.

Human output is Rich on stderr (``speccal.cli.render_table``); ``--json`` writes
machine-readable results to stdout. Domain errors (unreadable table, refused compatibility) are
raised and turned into exit 2 by the root; ``validate --json`` also prints its verdict on stdout
when the table is refused. ``export --format measurements`` writes a table's raw windows as the
measurement rows ``speccal fit`` reads (``CostTable.measurements()``; fitting them again
reproduces the table's fits).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from speccal.base.atomic import check_writable, read_json, write_text_atomic
from speccal.base.errors import InputError, SpeccalError
from speccal.base.paths import check_outputs
from speccal.cli.cmd_check import check
from speccal.cli.cmd_compat import compat
from speccal.cli.help import HelpGroup, SpeccalTyper
from speccal.cli.render_table import echo_json, err_console, print_diff, print_show
from speccal.costmodel.measurements import write_measurements
from speccal.costmodel.report import cost_grid, diff_tables, summary, to_markdown
from speccal.costmodel.table import load_table


def show(
    table_path: Annotated[
        Path, typer.Argument(metavar="TABLE", help="Cost table JSON file.", show_default=False)
    ],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary as JSON on stdout.")
    ] = False,
    params: Annotated[
        bool, typer.Option("--params/--no-params", help="Also print fitted parameters.")
    ] = True,
) -> None:
    """Show a table: identity, compatibility, execution path, provenance, fit report, parameters."""
    table = load_table(table_path)
    s = summary(table)
    if as_json:
        echo_json(s)
        return
    print_show(table, table_path, s, params)


def validate(
    table_path: Annotated[
        Path, typer.Argument(metavar="TABLE", help="Cost table JSON file.", show_default=False)
    ],
    expect: Annotated[
        Path | None,
        typer.Option("--expect", help="Compatibility JSON of the running config to check against."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the verdict as JSON on stdout.")
    ] = False,
) -> None:
    """Validate a table (schema, consistency and, with --expect, compatibility). Exit 2 if refused.

    With --json the verdict is on stdout either way: ``valid`` true with the warnings, or
    false with the ``error`` (the one line stderr also shows)."""
    # a bad --expect is bad input, not a verdict on the table
    expected = None if expect is None else read_json(expect, "--expect")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            table = load_table(table_path, expect=expected)
        except SpeccalError as exc:
            if as_json:
                echo_json({"path": str(table_path), "valid": False, "error": str(exc),
                           "warnings": [str(w.message) for w in caught]})
            raise
    notes = [str(w.message) for w in caught]
    if as_json:
        echo_json({"path": str(table_path), "valid": True,
                   "schema_version": table.schema_version, "warnings": notes})
        return
    for n in notes:
        err_console.print(f"[yellow]warning:[/] {escape(n)}", soft_wrap=True)
    err_console.print(
        f"[green]valid[/] {escape(f'{table_path} ({table.model}, {len(table.fits)} context(s))')}"
    )


def diff(
    a: Annotated[Path, typer.Argument(metavar="TABLE_A", help="First table.", show_default=False)],
    b: Annotated[Path, typer.Argument(metavar="TABLE_B", help="Second table.", show_default=False)],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the differences as JSON on stdout.")
    ] = False,
) -> None:
    """Compare two tables: metadata fields and costs at grid cells calibrated in both."""

    d = diff_tables(load_table(a), load_table(b))
    if as_json:
        echo_json(d)
        return
    print_diff(d, a, b)


EXPORT_FORMATS = ("csv", "markdown", "measurements")


def export(
    table_path: Annotated[
        Path, typer.Argument(metavar="TABLE", help="Cost table JSON file.", show_default=False)
    ],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="csv or markdown: the cost of every captured (Bcap, G); measurements: the "
            "table's raw windows as the measurement rows speccal fit reads (needs --out "
            "FILE.csv or .parquet).",
        ),
    ] = "csv",
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Write here (atomically) instead of stdout.", show_default=False
        ),
    ] = None,
) -> None:
    """Export a table: its cost grid (CSV, markdown) or its raw windows (measurement rows)."""

    if fmt not in EXPORT_FORMATS:
        raise InputError("--format", fmt, " or ".join(EXPORT_FORMATS))
    if fmt == "measurements" and (
        out is None or out.suffix.lower() not in (".csv", ".parquet", ".pq")
    ):
        raise InputError(
            "--out",
            None if out is None else str(out),
            "a .csv or .parquet file for --format measurements",
        )
    if out is not None:
        check_outputs([("--out", out)], [("TABLE", table_path)])
        check_writable(out, "--out")
    table = load_table(table_path)
    if fmt == "measurements":
        rows = table.measurements()
        write_measurements(rows, out)
        err_console.print(
            f"wrote {len(rows)} measurement rows ({table.mode}, w={table.draft_width}) to {out}; "
            f"fit them with: speccal fit {out} --model {table.model} --out FILE.json",
            markup=False,
        )
        return
    grid = cost_grid(table)
    text = grid.to_csv(index=False) if fmt == "csv" else to_markdown(grid)
    if out is None:
        typer.echo(text, nl=False)
    else:
        write_text_atomic(out, text, field="--out")
        err_console.print(f"wrote {len(grid)} rows to {out}", markup=False)


class TableGroup(HelpGroup):
    """``speccal table``: its commands in the order a table is used."""

    command_order = ("show", "validate", "check", "export", "compat", "diff")


def register(app: typer.Typer) -> None:
    """Attach ``speccal table ...`` to the root app."""
    sub = SpeccalTyper(
        name="table",
        cls=TableGroup,
        help="Show, validate, check (re-measure), export and diff cost tables; print a run's "
        "compatibility.",
        no_args_is_help=True,
    )
    sub.command("show")(show)
    sub.command("validate")(validate)
    sub.command("check")(check)
    sub.command("diff")(diff)
    sub.command("export")(export)
    sub.command("compat")(compat)
    app.add_typer(sub, name="table")
