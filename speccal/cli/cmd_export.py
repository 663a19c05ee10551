"""CLI commands ``speccal export`` (a table's decisions in an engine's format) and ``speccal
import`` (an engine's acceptance data as a speccal trace).

``export`` calls ``speccal.interop.export.run_export``: the engine file (``--out``) and its
evidence sidecar (``OUT.speccal.json``, or ``--sidecar``), both checked writable before any
work and written atomically; it prints per bucket the predicted tokens/s of every ``k``, the
best and the exported ``k``, and the whole workload's gain over the best single fixed ``k``
(``--json``: the sidecar on stdout). ``import`` reads one acceptance file
(``speccal.interop.importers``) and writes a full-width round trace for ``replay`` and
``export``. docs/INTEROP.md describes both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from speccal.base.atomic import check_writable, dumps_json
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.base.rich_tables import print_table
from speccal.cli.cmd_table import err_console
from speccal.interop.acceptance import MAX_ROWS
from speccal.interop.export import ENGINES, ExportRequest, run_export
from speccal.interop.importers import FORMATS, read_acceptance
from speccal.trace import save_trace

#: The kinds of an inline ``--profile KIND:r1,r2,...``.
INLINE_KINDS = ("marginal", "conditional")
#: What ``--profile`` takes (its help and its refusal).
PROFILE_FORMS = (
    "an engine file (vLLM /metrics scrape, vLLM per-request stats, speculation_profile.json, "
    "CSV of accepted lengths), marginal:p1,p2,... or conditional:q1,q2,..."
)


def _check_profile(text: str | None) -> None:
    """Refuse a ``--profile`` that is neither a file nor an inline profile, naming the forms
    (an inline one's rates are checked by ``speccal.interop.export``)."""
    if text is None or os.path.exists(text):
        return
    head, sep, rest = text.partition(":")
    if head in INLINE_KINDS and rest.strip():
        return
    if sep and head in INLINE_KINDS:
        hint = f"{head}: needs its rates, one per position"
    elif sep and head.isidentifier():
        hint = f"no profile kind {head!r}; the kinds are {' and '.join(INLINE_KINDS)}"
    elif _numbers(text):
        hint = f"name the rates' kind: marginal:{text} (prefix acceptance) or conditional:{text}"
    else:
        hint = "no such file"
    raise InputError("--profile", text, PROFILE_FORMS, hint=hint)


def _numbers(text: str) -> bool:
    try:
        return all(float(x) >= 0 for x in text.split(","))
    except ValueError:
        return False


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print_export(report: dict, out: Path, sidecar: Path) -> None:
    w = report["table"]["draft_width"]
    buckets = report["buckets"]
    if buckets:
        t = Table(
            title=f"{report['engine']['name']} {report['engine']['format']}: predicted tokens/s "
            f"per bucket (table {report['table']['mode']}, w={w})",
            title_justify="left",
        )
        for col in ("Bcap", *(f"k={k}" for k in range(w + 1)), "best", "exported", "margin %"):
            t.add_column(col, justify="right")
        for b in buckets:
            tps = b["tokens_per_s"]
            decisive = {True: "", False: " (within error)", None: ""}[b["decisive"]]
            t.add_row(
                str(b["bcap"]),
                *(_fmt(tps.get(str(k)), ",.0f") for k in range(w + 1)),
                "uncalibrated" if b["uncalibrated"] else str(b["best_k"]),
                str(b["exported_k"]),
                _fmt(b["margin_pct"], ".2f") + decisive,
            )
        print_table(err_console, t)
    held = report["table"]["heldout"]
    if held["metric"]:
        err_console.print(
            f"table held-out error: {held['pct']:.2f} % ({held['metric']})", markup=False
        )
    wl = report["workload"]
    if wl and "schedule_tokens_per_s" in wl:
        where = f"{wl['rounds']:,} rounds" if "rounds" in wl else "equal time per bucket"
        err_console.print(
            f"workload ({where}): exported schedule "
            f"{wl['schedule_tokens_per_s']:,.1f} tokens/s, "
            f"{wl['gain_vs_best_fixed_pct']:+.2f} % over the best single fixed k "
            f"(k={wl['best_fixed_k']})",
            markup=False,
        )
    elif wl and wl.get("adaptive_gain_vs_best_fixed_pct") is not None:
        err_console.print(
            f"workload ({wl['rounds']:,} rounds): {wl['adaptive_policy']} (the planner's "
            f"analogue) {wl['adaptive_gain_vs_best_fixed_pct']:+.2f} % over {wl['best_fixed']}",
            markup=False,
        )
    for a in report["adjustments"]:
        err_console.print(
            f"engine rule: Bcap {a['bcap']} exported k={a['exported_k']} (best {a['best_k']}, "
            f"{_fmt(a['tokens_per_s_lost_pct'], '.2f')} % tokens/s lost): {a['why']}",
            markup=False,
        )
    pb = report.get("per_bucket")
    if pb and pb["gain_pct"] is not None:
        err_console.print(
            f"per batch size vs per bucket: {pb['tokens_per_s']:,.1f} vs "
            f"{pb['per_bucket_tokens_per_s']:,.1f} tokens/s ({pb['gain_pct']:+.2f} %, at most "
            f"{pb['max_gain_pct']:+.2f} % at one batch size; {len(report['ranges'])} ranges; "
            f"batch sizes whose k differs: {pb['batch_sizes_differing'] or 'none'})",
            markup=False,
        )
    for c in report.get("caveats", []):
        if c["applies"]:
            err_console.print(
                f"warning: {report['engine']['name']} {c['id']}: {c['changes']} "
                f"({', '.join(c['sources'])})",
                markup=False,
                soft_wrap=True,
            )
    fid = report["fidelity"]
    if fid:
        err_console.print(
            f"engine reading vs table: max {_fmt(fid['max_abs_diff_pct'], '.2f')} % over "
            f"{fid['points']} priced (num_reqs, M) points",
            markup=False,
        )
    err_console.print(f"wrote {out} and {sidecar}", markup=False)


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
    _check_profile(profile)
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
    _print_export(result.report, result.out, result.sidecar)


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
    summary = {
        "path": str(out),
        "format": trace.meta["format"],
        "draft_width": trace.draft_width,
        "rounds": trace.num_rounds,
        "steps": acc.num_steps,
        "exact": acc.exact,
        "prefix_acceptance": trace.meta["prefix_acceptance"],
    }
    for key in ("shape", "estimator"):  # vllm-requests: which shape was read, how estimated
        if key in acc.source:
            summary[key] = acc.source[key]
    if json_out:
        typer.echo(dumps_json(summary), nl=False)
        return
    p = ", ".join(f"{v:.3f}" for v in summary["prefix_acceptance"])
    err_console.print(
        f"wrote {out}: {summary['steps']:,} steps of {summary['format']} as "
        f"{summary['rounds']:,} rounds, w={trace.draft_width}, per-position acceptance [{p}]"
        + ("" if acc.exact else " (scaled to --max-rows)")
        + (f"; shape {summary['shape']}" if "shape" in summary else "")
        + ("; estimated per position over several draft lengths" if "estimator" in summary else ""),
        markup=False,
        soft_wrap=True,  # one line, whatever the path's length
    )


def register(app: typer.Typer) -> None:
    """Attach ``speccal export`` and ``speccal import`` to the root app."""
    app.command("export")(export_cmd)
    app.command("import")(import_cmd)
