"""``speccal table check TABLE``: re-measure the table's spot points here and report drift.

Parses options and calls ``speccal.calibrate.check.check_table`` (imported inside the command:
measuring needs the runner, hence torch); prints one row per spot point and the verdict on
stderr (``speccal.cli.render_table.print_check``), ``--json`` prints the report on stdout.
Exit 0 when the median drift is within the bound, 1 when it is not (a CI gate for a shipped
table), 2 for bad input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speccal.base.atomic import dumps_json
from speccal.cli import parse
from speccal.cli.render_table import err_console, print_check


def check(
    table: Annotated[Path, typer.Argument(help="The cost table to check.", show_default=False)],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="Model preset to measure (default: the table's preset:NAME).",
            show_default=False,
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device", help="cpu, cuda or npu (default: the table's).", show_default=False
        ),
    ] = None,
    windows: Annotated[
        int | None,
        typer.Option(
            "--windows",
            help="Windows per spot point (default: the table's windows_per_point).",
            show_default=False,
        ),
    ] = None,
    max_drift_pct: Annotated[
        float | None,
        typer.Option(
            "--max-drift-pct",
            help="Bound on the median |drift| in %. Default: max(10 % cpu / 5 % cuda, "
            "2 x the table's held-out error).",
            show_default=False,
        ),
    ] = None,
    context: Annotated[
        list[str] | None,
        typer.Option(
            "--context",
            help="Measure at this interval PREFILL:MIN_KV:MAX_KV instead of the table's first "
            "and last (repeatable; inside the table's KV span), e.g. between two calibrated "
            "levels to check the KV model there.",
            show_default=False,
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON on stdout.")
    ] = False,
) -> None:
    """Re-measure the grid extremes (Bcap, G, context) with the table's execution path and
    compare with its predictions. Exit 1 when the drift is beyond the bound."""
    # lazy: the runner needs torch; the CLI starts (and names a missing torch) without it
    from speccal.calibrate.check import check_table

    report = check_table(
        table,
        model=model,
        device=device,
        windows=windows,
        max_drift_pct=max_drift_pct,
        contexts=[parse.context(c) for c in context] if context else None,
    )
    print_check(report, table)
    if json_out:
        typer.echo(dumps_json(report), nl=False)
    if not report["passed"]:
        err_console.print(
            "the table no longer describes this machine: recalibrate (speccal calibrate) "
            "and ship the new table",
            soft_wrap=True,
        )
        raise typer.Exit(1)
