"""``speccal table check TABLE``: re-measure the table's spot points here and report drift.

Parses options and calls ``speccal.calibrate.check.check_table`` (imported inside the command:
measuring needs the runner, hence torch); prints one row per spot point and the verdict on
stderr, ``--json`` prints the report on stdout. Exit 0 when the median drift is within the
bound, 1 when it is not (a CI gate for a shipped table), 2 for bad input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from speccal.base.atomic import dumps_json
from speccal.base.errors import InputError
from speccal.base.rich_tables import make_console, print_table

err_console = make_console()


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}"


def parse_context(text: str) -> tuple[int, int, int]:
    """``P:LO:HI`` -> ``(prefill_tokens, min_kv_length, max_kv_length)``."""
    parts = text.split(":")
    try:
        p, lo, hi = (int(x) for x in parts)
    except ValueError:
        raise InputError("--context", text, "PREFILL:MIN_KV:MAX_KV, three integers") from None
    return p, lo, hi


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
        contexts=[parse_context(c) for c in context] if context else None,
    )
    grid = Table(title=f"spot points of {table}")
    for col in ("ctx", "Bcap", "G", "k", "KV", "measured ms", "table ms", "drift %", ""):
        grid.add_column(col, justify="right")
    for r in report["points"]:
        grid.add_row(
            "new" if r["context_index"] is None else str(r["context_index"]),
            str(r["bcap"]),
            str(r["g"]),
            str(r["k"]),
            f"{r['kv_length']:.0f}",
            f"{r['measured_ms']:.3f}",
            "-" if r["predicted_ms"] is None else f"{r['predicted_ms']:.3f}",
            _pct(r["drift_pct"]),
            "DRIFT" if r["beyond"] else "",
        )
    print_table(err_console, grid)
    for line in report["compatibility"]:
        err_console.print(
            f"note: measured runner differs from the table: {line}", soft_wrap=True, markup=False
        )
    held = report["heldout_pct"]
    verdict = "passed" if report["passed"] else "[bold red]FAILED[/]"
    med = report["median_abs_drift_pct"]
    err_console.print(
        f"{verdict}: median |drift| {'-' if med is None else f'{med:.1f}'} % over "
        f"{len(report['points'])} points, bound {report['bound_pct']:.1f} % "
        f"({escape(str(report['bound_source']))}; table held-out "
        f"{'unknown' if held is None else f'{held:.1f} %'}); "
        f"{len(report['drifting'])} point(s) beyond it",
        soft_wrap=True,
    )
    if json_out:
        typer.echo(dumps_json(report), nl=False)
    if not report["passed"]:
        err_console.print(
            "the table no longer describes this machine: recalibrate (speccal calibrate) "
            "and ship the new table",
            soft_wrap=True,
        )
        raise typer.Exit(1)
