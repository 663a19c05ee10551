"""CLI command ``speccal plot TABLE --out DIR``: PNG figures of a cost table (and of a replay).

Calls ``speccal.plots_table.write_table_plots`` (measured vs fitted cost by G, residual map,
additive components). With ``--trace`` or ``--scenario`` it also replays the table's adaptive
policy and the fixed-k baselines (``speccal.replay_run.replay_table_policy``: the library's
``speccal.replay.replay``, as ``speccal replay``) and draws the decision timeline and throughput per policy through
``speccal.plots_replay.write_plots``. Human output on stderr, ``--json`` summary on stdout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from speccal.base.atomic import check_writable
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.cli.render_replay import print_plot
from speccal.costmodel.table import load_table
from speccal.plots_replay import THROUGHPUT_PNG, TIMELINE_PNG, write_plots
from speccal.plots_table import (
    COMPONENTS_PNG,
    FIT_PNG,
    RESIDUALS_PNG,
    table_title,
    write_table_plots,
)
from speccal.replay_run import plot_summary, replay_table_policy

#: The files ``plot`` writes into ``--out``: the table's, and the replay's with --trace/--scenario.
TABLE_PNGS = (FIT_PNG, RESIDUALS_PNG, COMPONENTS_PNG)
REPLAY_PNGS = (TIMELINE_PNG, THROUGHPUT_PNG)


def plot_cmd(
    table_path: Annotated[
        Path, typer.Argument(metavar="TABLE", help="Cost table JSON file.", show_default=False)
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out", help="Directory for the PNG files (created if missing).", show_default=False
        ),
    ],
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            help="Also replay this trace (.parquet / .jsonl) and plot the timeline and throughput per policy.",
        ),
    ] = None,
    scenario: Annotated[
        str | None,
        typer.Option(
            "--scenario",
            help="Also replay a synthetic scenario: steady, transition, batch_change, decay.",
        ),
    ] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Scenario rounds.")] = 4000,
    num_requests: Annotated[int, typer.Option("--num-requests", help="Scenario batch size B.")] = 8,
    kv_length: Annotated[
        float | None,
        typer.Option(
            "--kv-length",
            help="Scenario mean KV length (default: middle of the table's first context interval).",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Scenario seed.")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the written paths as JSON on stdout.")
    ] = False,
) -> None:
    """Plot a cost table: measured vs fitted cost by G, residual map, additive components."""
    if trace is not None and scenario is not None:
        raise InputError("--trace/--scenario", f"{trace} and {scenario}", "at most one of them")
    replays = trace is not None or scenario is not None
    names = (*TABLE_PNGS, *(REPLAY_PNGS if replays else ()))
    check_outputs([("--out", out / n) for n in names], [("TABLE", table_path), ("--trace", trace)])
    check_writable(out, "--out", directory=True)  # before the replay and the figures
    table = load_table(table_path)
    report = None
    if replays:
        report = replay_table_policy(table, trace, scenario, rounds, num_requests, kv_length, seed)
    paths = write_table_plots(table, out)
    if report is not None:
        paths += write_plots(report, out, title=table_title(table))
    summary = plot_summary(table_path, out, paths, report)
    if as_json:
        typer.echo(json.dumps(summary, sort_keys=True, allow_nan=False))
    else:
        print_plot(summary)


def register(app: typer.Typer) -> None:
    """Attach ``speccal plot`` to the root app."""
    app.command("plot")(plot_cmd)
