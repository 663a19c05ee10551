"""CLI command ``speccal trace``: write a synthetic scenario trace, or record one.

A scenario is ``speccal.replay_run.scenario_trace``; recording drives the embedded runner
through ``speccal.live.record.record_trace`` (imported inside the command: torch is only needed
for recording): a round trace (``--kind rounds``) or the per-token acceptance matrix
(``--kind tokens``: greedy, drafting from every output position).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from speccal.base.atomic import check_writable
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.base.progress import ProgressReporter
from speccal.cli import options as o
from speccal.cli import parse
from speccal.cli.render_replay import err_console
from speccal.replay_run import scenario_trace
from speccal.trace import save_trace, trace_summary


def trace_cmd(
    out: Annotated[Path, typer.Option("--out", help="Trace file to write (.parquet or .jsonl).")],
    scenario: Annotated[
        str | None,
        typer.Option("--scenario", help="Write a synthetic scenario trace instead of recording."),
    ] = None,
    kind: Annotated[
        str,
        typer.Option(
            "--kind",
            help="rounds (per-round acceptance) or tokens (per-token acceptance matrix, greedy).",
        ),
    ] = "rounds",
    model: o.Model = "tiny",
    device: o.Device = "cpu",
    dtype: o.Dtype = None,
    draft_width: Annotated[
        int, typer.Option("--draft-width", help="Draft width w (every round drafts w).")
    ] = 3,
    num_requests: Annotated[
        int, typer.Option("--num-requests", help="Concurrent requests (batch size B).")
    ] = 4,
    prompt_len: Annotated[
        int, typer.Option("--prompt-len", help="Random prompt tokens per request.")
    ] = 32,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Generated tokens per request.")
    ] = 64,
    acceptance: Annotated[
        str, typer.Option("--acceptance", help="greedy or synthetic (rounds only).")
    ] = "greedy",
    acceptance_profile: Annotated[
        str | None,
        typer.Option(
            "--acceptance-profile",
            "--profile",
            help="Synthetic: comma-separated conditional acceptance per position.",
        ),
    ] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Scenario rounds.")] = 20_000,
    kv_length: Annotated[
        float, typer.Option("--kv-length", help="Scenario mean KV length.")
    ] = 1024.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of prompts / scenario / runner.")] = 0,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print a summary as JSON on stdout.")
    ] = False,
    rounds_out: Annotated[
        Path | None,
        typer.Option(
            "--rounds-out",
            help="With --kind tokens: also write the round trace of the full-width run.",
        ),
    ] = None,
) -> None:
    """Record an acceptance trace with the embedded runner (or write a synthetic scenario)."""
    if kind not in ("rounds", "tokens"):
        raise InputError("--kind", kind, "rounds or tokens")
    if scenario is not None and kind != "rounds":
        raise InputError("--kind", kind, "rounds with --scenario (scenarios are round traces)")
    check_outputs([("--out", out), ("--rounds-out", rounds_out)])
    check_writable(out, "--out")  # before recording: a bad path never costs the run
    if rounds_out is not None:
        if scenario is not None or kind != "tokens":  # refused before --out is written
            raise InputError("--rounds-out", str(rounds_out), "only with --kind tokens (recording)")
        check_writable(rounds_out, "--rounds-out")
    t0 = time.perf_counter()
    round_trace = None
    if scenario is not None:
        tr = scenario_trace(scenario, rounds, draft_width, num_requests, kv_length, seed)
    else:
        # lazy: the runner imports torch; the CLI starts (and reports a missing torch) without it
        from speccal.live.record import TraceRecording, record_trace

        tr, round_trace = record_trace(
            TraceRecording(
                kind=kind, model=model, device=device, dtype=dtype, draft_width=draft_width,
                num_requests=num_requests, prompt_len=prompt_len, max_tokens=max_tokens,
                acceptance=acceptance, seed=seed, acceptance_profile=parse.floats(
                    acceptance_profile, "--acceptance-profile")),
            _progress,
        )
    path = save_trace(tr, out)
    if rounds_out is not None:
        save_trace(round_trace, rounds_out)
    summary = trace_summary(tr, path, time.perf_counter() - t0)
    if json_out:
        typer.echo(json.dumps(summary, sort_keys=True, allow_nan=False))
    else:
        err_console.print(
            f"wrote {summary['kind']} trace {path}: {summary['records']:,} records, "
            f"w={summary['draft_width']} ({summary['elapsed_s']} s)",
            markup=False,
        )


def _progress(phase: str, unit: str, total: int | None = None) -> ProgressReporter:
    """The trace recording's progress on stderr (a bar on a terminal, log lines elsewhere)."""
    return ProgressReporter(
        "trace", console=err_console, total=total, unit=unit, phase=phase, transient=True
    )


def register(app: typer.Typer) -> None:
    """Attach ``speccal trace`` to the root app."""
    app.command("trace")(trace_cmd)
