"""CLI commands ``speccal export`` (a table's decisions in an engine's format) and ``speccal
import`` (an engine's acceptance data as a speccal trace).

``export`` calls ``speccal.interop.export.run_export`` (after ``check_profile``): the engine file (``--out``) and its
evidence sidecar (``OUT.speccal.json``, or ``--sidecar``), both checked writable before any
work and written atomically; it prints per bucket the predicted tokens/s of every ``k``, the
best and the exported ``k``, and the whole workload's gain over the best single fixed ``k``
(``--json``: the sidecar on stdout). ``import`` reads one acceptance file
(``speccal.interop.importers``) and writes a full-width round trace for ``replay`` and
``export``. Printing is ``speccal.cli.render_replay``; docs/INTEROP.md describes both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from speccal.base.atomic import check_writable, dumps_json
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.cli.render_replay import err_console, print_export, print_import
from speccal.interop.acceptance import MAX_ROWS
from speccal.interop.export import (
    ENGINES,
    PROFILE_FORMS,
    ExportRequest,
    check_profile,
    run_export,
)
from speccal.interop.importers import FORMATS, read_acceptance
from speccal.trace import save_trace


def export_cmd(
    table: Annotated[Path, typer.Argument(help="Cost table JSON.", show_default=False)],
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help=f"Engine: {', '.join(ENGINES)} (sglang: the DSpark cost table, from a "
            "target_verify table; sglang-adaptive: EAGLE/MTP --speculative-adaptive-config "
            "steps per batch size, from a draft_step table).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", help="Engine file to write (atomically).", show_default=False)
    ],
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Acceptance: a round trace (.parquet/.jsonl, full width)."),
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile",
            help=f"Acceptance instead of --trace: {PROFILE_FORMS}.",
        ),
    ] = None,
    fmt: Annotated[
        str, typer.Option("--format", help=f"Format of --profile: auto or {', '.join(FORMATS)}.")
    ] = "auto",
    k0_ms: Annotated[
        str | None,
        typer.Option(
            "--k0-ms",
            help="Step time at k = 0 measured in the target engine (draft_step tables): MS or "
            "BCAP=MS,... Default: the table's k = 0 windows, else k = 0 is not priced; --to "
            "vllm prices k = 0 only from this (its K = 0 step still runs a drafter forward).",
        ),
    ] = None,
    num_requests: Annotated[
        int | None,
        typer.Option(
            "--num-requests", help="--profile: requests per round (default: largest bucket)."
        ),
    ] = None,
    kv_length: Annotated[
        float | None,
        typer.Option(
            "--kv-length",
            help="--profile: KV length of the rounds; sglang: the context to export (default: "
            "the acceptance's mean, else the table's first prefill_tokens).",
        ),
    ] = None,
    sidecar: Annotated[
        Path | None,
        typer.Option("--sidecar", help="Evidence sidecar path (default: OUT.speccal.json)."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the sidecar on stdout.")] = False,
) -> None:
    """Export a table's decisions in an engine's own format, with an evidence sidecar."""
    req = ExportRequest(
        table=table,
        engine=to,
        out=out,
        trace=trace,
        profile=profile,
        profile_format=fmt,
        k0_ms=k0_ms,
        num_requests=num_requests,
        kv_length=kv_length,
        sidecar=sidecar,
    )
    check_profile(profile)
    check_outputs(
        [("--out", req.out), ("--sidecar", req.sidecar_path)],
        [("TABLE", table), ("--trace", trace), ("--profile", profile)],
    )
    check_writable(req.out, "--out")  # before the work: a bad path never costs the replay
    check_writable(req.sidecar_path, "--sidecar")
    with err_console.status(escape(f"exporting to {to}")):
        result = run_export(req)
    if json_out:
        typer.echo(dumps_json(result.report), nl=False)
        return
    print_export(result.report, result.out, result.sidecar)


def import_cmd(
    path: Annotated[Path, typer.Argument(help="Acceptance file of an engine.", show_default=False)],
    out: Annotated[
        Path, typer.Option("--out", help="Trace to write (.parquet or .jsonl).", show_default=False)
    ],
    fmt: Annotated[
        str, typer.Option("--format", help=f"auto or one of {', '.join(FORMATS)}.")
    ] = "auto",
    num_requests: Annotated[
        int, typer.Option("--num-requests", help="Requests per round where the file has no rounds.")
    ] = 8,
    kv_length: Annotated[
        float, typer.Option("--kv-length", help="KV length of rounds the file gives none for.")
    ] = 1024.0,
    draft_width: Annotated[
        int | None,
        typer.Option("--draft-width", help="Draft width (CSV without a drafted column)."),
    ] = None,
    since: Annotated[
        Path | None,
        typer.Option("--since", help="vllm-metrics: an earlier scrape to subtract."),
    ] = None,
    model_name: Annotated[
        str | None,
        typer.Option("--model-name", help="vllm-metrics: the model_name label to read."),
    ] = None,
    max_rows: Annotated[
        int, typer.Option("--max-rows", help="Most steps a histogram expands into (else scaled).")
    ] = MAX_ROWS,
    seed: Annotated[int, typer.Option("--seed", help="Shuffle of histogram rows.")] = 0,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print a summary as JSON on stdout.")
    ] = False,
) -> None:
    """Import acceptance measured in vLLM / SGLang-style tools as a speccal round trace."""
    if num_requests < 1:
        raise InputError("--num-requests", num_requests, "an integer >= 1")
    if not kv_length >= 0:
        raise InputError("--kv-length", kv_length, "a number >= 0")
    if max_rows < 1:
        raise InputError("--max-rows", max_rows, "an integer >= 1")
    check_outputs([("--out", out)], [("PATH", path), ("--since", since)])
    check_writable(out, "--out")
    acc = read_acceptance(
        path,
        fmt,
        draft_width=draft_width,
        since=since,
        model_name=model_name,
        max_rows=max_rows,
        seed=seed,
    )
    trace = acc.to_trace(num_requests, kv_length)
    save_trace(trace, out)
    summary = acc.import_summary(trace, out)
    if json_out:
        typer.echo(dumps_json(summary), nl=False)
        return
    print_import(summary)


def register(app: typer.Typer) -> None:
    """Attach ``speccal export`` and ``speccal import`` to the root app."""
    app.command("export")(export_cmd)
    app.command("import")(import_cmd)
