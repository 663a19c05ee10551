"""How the table commands print (``table show|diff|check``, ``fit``): Rich tables on stderr.

``fit_report`` (the per-context fit report, shared by ``table show`` and ``fit``) and the other
``print_*`` take a ``CostTable`` or a library document (``speccal.costmodel.report.summary``,
``diff_tables``, ``speccal.calibrate.check.check_table``); ``echo_json`` is the ``--json``
output of the table commands (canonical JSON on stdout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from speccal.base.atomic import dumps_json
from speccal.base.rich_tables import make_console, print_table
from speccal.costmodel.report import routing_line, sources_line, summary

err_console = make_console()


def echo_json(obj: Any) -> None:
    typer.echo(dumps_json(obj), nl=False)


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
            base = p.k_term.removesuffix("_rows")
            if base == "shared":
                t.add_row("delta (per draft forward past the first)", "every Bcap",
                          f"{p.delta_ms[0]:.4f}")
            for b, dl in zip(p.bcap_levels if base == "per_bcap" else (), p.delta_ms,
                             strict=False):
                t.add_row("delta(Bcap) (per draft forward past the first)", str(b), f"{dl:.4f}")
            if base != p.k_term:
                t.add_row("rho (per request a verify serves, G / (k + 1))", "every Bcap",
                          f"{p.delta_ms[-1]:.4f}")
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


def print_show(table, path: Path, s: dict[str, Any], params: bool) -> None:
    """``table show``: identity, compatibility, execution path, provenance, fit report and (with
    ``params``) the fitted parameters; ``s`` is the table's ``summary``."""
    c = table.compatibility
    m = c.model
    err_console.print(f"[bold]{escape(str(path))}[/]")
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


def print_diff(d: dict[str, Any], a: Path, b: Path) -> None:
    """``table diff``: the metadata differences and the costs at the cells both tables price."""
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


def print_sources(table, *, bare: bool) -> None:
    """``fit``: where the mode and the draft width came from, and what a bare fit records."""
    err_console.print(sources_line(table), markup=False)
    if bare:
        err_console.print(
            "no --compat: model, topology, graph mode, device and execution path recorded as "
            "unknown, so a real engine refuses this table; refit with --compat FILE (speccal "
            "table compat writes it)"
        )


def print_check(report: dict[str, Any], table: Path) -> None:
    """``table check``: one row per spot point, the runner differences and the verdict."""
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
            _fmt(r["drift_pct"], "+.1f"),
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
