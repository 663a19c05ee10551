"""CLI command ``speccal replay``: policies against a cost table, on a trace or a scenario.

It loads a table (or takes the synthetic one, ``speccal.scenarios.synthetic_table``) and a trace
(a file, or a synthetic ``--scenario``), resolves them with ``speccal.replay_run.prepare_replay``,
runs ``speccal.replay.replay`` and prints a Rich table on stderr (``--json``: the report on
stdout, ``speccal.replay_run.replay_doc``; ``--plot DIR``: PNGs) and a line naming each adaptive
policy's gain over the best fixed ``k`` (``speccal.cli.render_replay.print_replay``). Without
``--table`` the rounds are priced by invented costs: the human output says so in a banner line
before anything else (``--json``: ``table.synthetic``), and the synthetic table takes
calibrate's defaults (mode ``target_verify``, the trace's draft width, else 3 as calibrate's
runner and ``trace``). ``speccal trace`` is ``cmd_trace``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from speccal.base.atomic import check_writable
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.base.progress import ProgressReporter
from speccal.cli.render_replay import err_console, print_replay
from speccal.costmodel.table import load_table
from speccal.plots_replay import THROUGHPUT_PNG, TIMELINE_PNG, write_plots
from speccal.plots_table import table_title
from speccal.policy import parse_policy
from speccal.replay import replay
from speccal.replay_run import prepare_replay, replay_doc

SYNTHETIC_BANNER = (
    "SYNTHETIC COSTS: no --table given, so every round is priced by an invented cost "
    "(speccal.scenarios.synthetic_table, docs/TRACES.md), not by a calibration of this "
    "machine; pass --table TABLE.json for a real prediction"
)


def replay_cmd(
    table: Annotated[
        Path | None,
        typer.Option(
            "--table",
            help="Cost table JSON; default: the synthetic table (speccal.scenarios.synthetic_table).",
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Trace file (.parquet / .jsonl, see docs/TRACES.md)."),
    ] = None,
    scenario: Annotated[
        str | None,
        typer.Option(
            "--scenario",
            help="Synthetic trace instead of --trace: steady, transition, batch_change, decay.",
        ),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            help="adaptive-step, adaptive-verify or fixed:K (repeatable); fixed:1..w always run.",
        ),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            help="Synthetic table mode (no --table): target_verify (default, as calibrate) or "
            "draft_step.",
            show_default=False,
        ),
    ] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Scenario rounds.")] = 20_000,
    draft_width: Annotated[
        int | None,
        typer.Option(
            "--draft-width",
            help="Scenario draft width. Default: the table's, else 3 (calibrate's and trace's).",
            show_default=False,
        ),
    ] = None,
    num_requests: Annotated[int, typer.Option("--num-requests", help="Scenario batch size B.")] = 8,
    kv_length: Annotated[
        float, typer.Option("--kv-length", help="Scenario mean KV length (tokens).")
    ] = 1024.0,
    seed: Annotated[int, typer.Option("--seed", help="Scenario seed.")] = 0,
    window_size: Annotated[
        int | None,
        typer.Option(
            "--window-size", help="Adaptive step: completed batches in the acceptance window "
            "(default: the table's calibration.policy, else 20)."
        ),
    ] = None,
    update_interval: Annotated[
        int | None,
        typer.Option("--update-interval", help="Adaptive step: batches between re-scorings "
                     "(default: the table's, else 5).")
    ] = None,
    switch_min_gain: Annotated[
        float | None,
        typer.Option(
            "--switch-min-gain",
            help="Adaptive step: predicted relative gain a switch must exceed, in [0, 1) "
            "(default: the table's, else 0.05).",
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON on stdout.")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Directory for replay_timeline.png and replay_throughput.png."),
    ] = None,
) -> None:
    """Replay speculation policies against a cost table and report predicted throughput."""
    if (trace is None) == (scenario is None):
        raise InputError(
            "--trace/--scenario",
            None if trace is None else f"{trace} and {scenario}",
            "exactly one of --trace PATH or --scenario NAME",
        )
    specs = [parse_policy(p) for p in (policy or [])]  # refuses a combined adaptive spec first
    if plot is not None:
        check_outputs(
            [("--plot", plot / n) for n in (TIMELINE_PNG, THROUGHPUT_PNG)],
            [("--table", table), ("--trace", trace)],
        )
        check_writable(plot, "--plot", directory=True)  # before the replay, not after it
    setup = prepare_replay(
        table=None if table is None else load_table(table), specs=specs, trace=trace,
        scenario=scenario, mode=mode, rounds=rounds, draft_width=draft_width,
        num_requests=num_requests, kv_length=kv_length, seed=seed,
        step=(window_size, update_interval, switch_min_gain),
    )
    if table is None and not json_out:
        err_console.print(f"[bold yellow]{SYNTHETIC_BANNER}[/]", soft_wrap=True)
    with ProgressReporter("replay", console=err_console, transient=True) as prog:
        report = replay(setup.trace, setup.cost, setup.config,
                        on_step=lambda s: prog.update(phase=s))
    d = replay_doc(report, setup, table)
    if plot is not None:
        # The synthetic table is a real CostTable too: its title says it is synthetic.
        d["plots"] = [str(p) for p in write_plots(report, plot, title=table_title(setup.table))]
    if json_out:
        typer.echo(json.dumps(d, sort_keys=True, allow_nan=False))
    else:
        print_replay(d)
        for p in d.get("plots", []):
            err_console.print(f"wrote {p}", markup=False)


def register(app: typer.Typer) -> None:
    """Attach ``speccal replay`` to the root app."""
    app.command("replay")(replay_cmd)
