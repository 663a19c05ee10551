"""CLI commands ``speccal table show|validate|diff|export|compat`` and the fit report shared
with ``fit``.

Human output is Rich on stderr; ``--json`` writes machine-readable results to stdout. Domain
errors (unreadable table, refused compatibility) are raised and turned into exit 2 by the root;
``validate --json`` also prints its verdict on stdout when the table is refused.
``export --format measurements`` writes a table's raw windows as the measurement rows ``speccal
fit`` reads (``CostTable.measurements()``; fitting them again reproduces the table's fits).
``compat`` builds the runner as ``speccal calibrate`` does (``speccal.calibrate.pipeline.make_engine``,
imported inside the command: it needs torch) and writes its ``Engine.compatibility()``, what
``fit --compat`` and ``validate --expect`` take.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from speccal.base.atomic import (
    check_writable,
    dumps_json,
    read_json,
    write_json_atomic,
    write_text_atomic,
)
from speccal.base.errors import InputError, SpeccalError
from speccal.base.paths import check_outputs
from speccal.base.rich_tables import make_console, print_table
from speccal.cli.cmd_check import check
from speccal.cli.help import HelpGroup, SpeccalTyper
from speccal.costmodel.measurements import write_measurements
from speccal.costmodel.report import cost_grid, diff_tables, routing_line, summary, to_markdown
from speccal.costmodel.table import load_table

err_console = make_console()


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def fit_report(table, console: Console = err_console, *, nonpositive: bool = True) -> None:
    """Print the per-context fit report (points, residual and held-out errors) as Rich tables.

    ``nonpositive``: also list the cells fitted at a cost <= 0 (``fit`` passes False: its
    ``NonPositiveCostWarning`` already names them, shown once by the CLI root).
    """
    s = summary(table)
    console.print(
        f"[bold]{escape(str(s['model']))}[/] cost table, mode [bold]{escape(str(s['mode']))}[/], "
        f"draft width "
        f"{s['draft_width']}, schema v{s['schema_version']}"
    )
    t = Table(title="fit report (ms; % of measured cost)", title_justify="left")
    for col in (
        "context",
        "KV",
        "points",
        "windows",
        "error",
        "n",
        "MAE ms",
        "max ms",
        "mean %",
        "max %",
    ):
        t.add_column(col, justify="right" if col not in ("context", "KV", "error") else "left")
    labels = {
        "residuals": "residual",
        "leave_one_point_out": "leave-1-point-out",
        "leave_one_g_out": "leave-1-G-out",
    }
    for f in s["fits"]:
        for i, key in enumerate(labels):
            e = f[key]
            t.add_row(
                str(f["context_index"]) if i == 0 else "",
                f"{f['min_kv_length']}-{f['max_kv_length']}" if i == 0 else "",
                str(f["n_points"]) if i == 0 else "",
                str(f["n_windows"]) if i == 0 else "",
                labels[key],
                f"{e['n_evaluated']}/{e['n_evaluated'] + e['n_skipped']}",
                _fmt(e["mae_ms"], ".4f"),
                _fmt(e["max_abs_ms"], ".4f"),
                _fmt(e["mean_abs_pct"], ".2f"),
                _fmt(e["max_abs_pct"], ".2f"),
            )
    print_table(console, t)
    routing = routing_line(table)
    if routing is not None:
        console.print(routing, soft_wrap=True, markup=False)
        _routing_table(s["routing"], console)
    kv = s.get("kv_model")
    if kv is not None:
        loco, lopo = kv["leave_one_context_out"], kv["leave_one_point_out"]
        console.print(
            f"KV model ({kv['kv_term']} slope, chosen by {kv['selected_by']}) prices KV "
            f"{kv['min_kv_length']}-{kv['max_kv_length']}: leave-1-context-out mean "
            f"{_fmt(loco['mean_abs_pct'], '.2f')} % ({loco['n_evaluated']} points), "
            f"leave-1-point-out mean {_fmt(lopo['mean_abs_pct'], '.2f')} %",
            soft_wrap=True,
            markup=False,
        )
    for f in s["fits"] if nonpositive else ():
        cells = f.get("nonpositive_cells") or []
        if cells:
            shown = ", ".join(
                f"Bcap {c['bcap']} G {c['g']}: {c['cost_ms']:.3f} ms" for c in cells[:8]
            )
            more = f" (+{len(cells) - 8} more)" if len(cells) > 8 else ""
            console.print(
                f"[bold yellow]warning:[/] context {f['context_index']}: fitted cost not positive "
                f"at {shown}{more}; these cells are uncalibrated (policies fall back to full width)"
            )


def _routing_table(routing: dict[str, Any], console: Console) -> None:
    """Per measured point, the mean distinct experts a round activated per routed layer."""
    t = Table(title=f"routed experts per layer and round (of {routing['experts']}, "
              f"top {routing['top_k']})", title_justify="left")
    for col in ("context", "Bcap", "G", "k", "experts"):
        t.add_column(col, justify="right")
    for p in routing["points"]:
        t.add_row(str(p["context_index"]), str(p["bcap"]), str(p["g"]), _fmt(p["k"], "d"),
                  _fmt(p["experts_activated"], ".2f"))
    print_table(console, t)


def _params_tables(table, console: Console) -> None:
    for f in table.fits:
        if f.model == "additive":
            p = f.additive
            t = Table(
                title=f"context {f.context_index}: bias {p.bias_ms:.4f} ms (reference Bcap {p.bcap_levels[0]}, G {p.g_levels[0]})",
                title_justify="left",
            )
            t.add_column("level")
            t.add_column("value", justify="right")
            t.add_column("offset ms", justify="right")
            for b, a in zip(p.bcap_levels, p.alpha_ms, strict=True):
                t.add_row("alpha(Bcap)", str(b), f"{a:.4f}")
            for g, th in zip(p.g_levels, p.theta_ms, strict=True):
                t.add_row("theta(G)", str(g), f"{th:.4f}")
            if p.k_term == "shared":
                t.add_row("delta (per draft forward past the first)", "every Bcap",
                          f"{p.delta_ms[0]:.4f}")
            for b, dl in zip(p.bcap_levels if p.k_term == "per_bcap" else (), p.delta_ms,
                             strict=False):
                t.add_row("delta(Bcap) (per draft forward past the first)", str(b), f"{dl:.4f}")
        else:
            p = f.sps
            t = Table(
                title=f"context {f.context_index}: SPS over G (Bcaps {p.bcap_levels})",
                title_justify="left",
            )
            ks = p.k if p.k is not None else [None] * len(p.g_levels)
            for col in (("k",) if p.k is not None else ()) + ("G", "cost ms", "steps/s"):
                t.add_column(col, justify="right")
            for g, c, k in zip(p.g_levels, p.cost_ms, ks, strict=True):
                t.add_row(*((str(k),) if k is not None else ()), str(g), f"{c:.4f}",
                          f"{1000.0 / c:.1f}")
        print_table(console, t)


def _execution_table(path: dict[str, Any], console: Console) -> None:
    """The measured program: graph mode, attention backend, input update, kernel configuration."""
    t = Table(title="execution path", title_justify="left")
    t.add_column("field")
    t.add_column("value")
    for key in ("graph_mode", "attention_backend", "input_update", "kernel_digest"):
        t.add_row(key, str(path[key]))
    config = path["kernel_config"]
    if config is None:
        t.add_row("kernels", "unknown (not recorded)")
    for key, value in (config or {}).items():
        t.add_row(f"kernels.{key}", json.dumps(value))
    print_table(console, t)


def _echo_json(obj: Any) -> None:
    typer.echo(dumps_json(obj), nl=False)


def _read_compat(path: Path | None) -> dict | None:
    if path is None:
        return None
    return read_json(path, "--expect")  # missing, unreadable, binary or not JSON: InputError


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
        _echo_json(s)
        return
    c = table.compatibility
    m = c.model
    err_console.print(f"[bold]{escape(str(table_path))}[/]")
    err_console.print(
        f"model {m.architecture} ({m.fingerprint}, {m.dtype}, quant {m.quantization}); "
        f"tp={c.topology.tp} dp={c.topology.dp}; graph {c.graph_mode}; verify {c.verification_mode}; "
        f"device {c.device.kind}/{c.device.name}",
        markup=False,
    )
    _execution_table(s["execution"], err_console)
    p = table.provenance
    err_console.print(
        f"speccal {p.speccal_version}, created {p.created}, torch {p.torch_version or '?'}"
        + (f", migrated from {p.migrated_from}" if p.migrated_from else ""),
        markup=False,
    )
    fit_report(table)
    if params:
        _params_tables(table, err_console)


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
    expected = _read_compat(expect)  # a bad --expect is bad input, not a verdict on the table
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            table = load_table(table_path, expect=expected)
        except SpeccalError as exc:
            if as_json:
                _echo_json(
                    {
                        "path": str(table_path),
                        "valid": False,
                        "error": str(exc),
                        "warnings": [str(w.message) for w in caught],
                    }
                )
            raise
    notes = [str(w.message) for w in caught]
    if as_json:
        _echo_json(
            {
                "path": str(table_path),
                "valid": True,
                "schema_version": table.schema_version,
                "warnings": notes,
            }
        )
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
        _echo_json(d)
        return
    if d["metadata"]:
        t = Table(title=f"metadata (a = {a}, b = {b})", title_justify="left")
        t.add_column("field", no_wrap=True)  # dotted names, kernel-config fields included
        for col in ("a", "b"):
            t.add_column(col, overflow="fold")
        for m in d["metadata"]:
            t.add_row(m["field"], json.dumps(m["a"]), json.dumps(m["b"]))
        print_table(err_console, t)
    t = Table(title="cost at common cells (ms)", title_justify="left")
    for col in ("context", "Bcap", "G", "a", "b", "delta", "delta %"):
        t.add_column(col, justify="right")
    for c in d["costs"]:
        t.add_row(
            *(str(c[k]) for k in ("context_index", "bcap", "g")),
            f"{c['a_ms']:.4f}",
            f"{c['b_ms']:.4f}",
            f"{c['delta_ms']:+.4f}",
            f"{c['delta_pct']:+.2f}",
        )
    print_table(err_console, t)
    err_console.print(
        f"{len(d['metadata'])} metadata difference(s); {len(d['costs'])} common cells, max |delta| "
        f"{_fmt(d['max_abs_delta_pct'], '.2f')}%; only in a: {d['only_in_a']}, only in b: "
        f"{d['only_in_b']}",
        markup=False,
    )


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


def compat(
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Write the JSON here (atomically) instead of stdout.",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str, typer.Option("--model", help="Runner preset name or checkpoint folder.")
    ] = "tiny",
    device: Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N or npu.")] = "cpu",
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="float32, bfloat16 or float16 (runner default if unset).",
            show_default=False,
        ),
    ] = None,
    draft_width: Annotated[
        int | None,
        typer.Option(
            "--draft-width",
            help="num_speculative_tokens w (runner default if unset).",
            show_default=False,
        ),
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            "--max-model-len", help="Model context (runner default if unset).", show_default=False
        ),
    ] = None,
    graph_mode: Annotated[
        str | None,
        typer.Option(
            "--graph-mode",
            help="eager or split (captured CUDA/NPU graphs). Default: what calibrate uses.",
            show_default=False,
        ),
    ] = None,
    attention_backend: Annotated[
        str | None,
        typer.Option(
            "--attention-backend",
            help="torch or triton. Default: what calibrate uses.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print a run's compatibility metadata (Engine.compatibility()), for --compat / --expect.

    The runner is built exactly as speccal calibrate builds it, with the same options."""
    # lazy: the runner needs torch; the CLI starts (and names a missing torch) without it
    from speccal.calibrate.pipeline import CalibrateOptions, make_engine

    if out is not None:
        if out.suffix.lower() != ".json":
            raise InputError("--out", str(out), "a path ending in .json")
        check_writable(out, "--out")  # before the runner is built
    engine = make_engine(
        CalibrateOptions(
            model=model,
            device=device,
            dtype=dtype,
            draft_width=draft_width,
            max_model_len=max_model_len,
            graph_mode=graph_mode,
            attention_backend=attention_backend,
        )
    )
    doc = engine.compatibility()
    if out is None:
        _echo_json(doc)
        return
    write_json_atomic(out, doc, field="--out")
    err_console.print(
        f"wrote the compatibility of {doc['model']['architecture']} (w={doc['draft_width']}, "
        f"{doc['device']['kind']}, graph {doc['graph_mode']}) to {out}",
        markup=False,
    )


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
