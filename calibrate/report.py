"""Human-readable calibration output (Rich, on stderr): the effective configuration with the
source of every value (the calibration keys, torch's thread count and the quality gate's bounds)
and the captured graph geometry, the grid, the fit report, the quality gate's verdict, and the
reuse of a saved table. Every table prints through ``speccal.base.rich_tables.print_table``, so
it stays legible at 80 columns.

Also builds the plain-dict form of the effective configuration used by ``--json``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from speccal.base.geometry import Geometry
from speccal.base.rich_tables import print_table
from speccal.calibrate.config import KEYS, CalibrationConfig
from speccal.calibrate.driver import calibrated_kv_length
from speccal.calibrate.gate import EarlyStop, GateConfig, HeldOut, Selection, describe_point
from speccal.calibrate.grid import GridPoint
from speccal.calibrate.machine import ThreadPin
from speccal.costmodel.report import routing_line


def _value(cfg: CalibrationConfig, key: str) -> str:
    if key.startswith("policy."):
        return str(getattr(cfg.policy, key.split(".", 1)[1]))
    if key == "target_graph_rows":
        return "; ".join(f"{b}: {list(g)}" for b, g in cfg.target_graph_rows.items())
    if key == "contexts":
        return "; ".join(
            f"prefill {c.prefill_tokens}, KV {c.min_kv_length}..{c.max_kv_length}"
            for c in cfg.contexts
        )
    value = getattr(cfg, key)
    return str(list(value)) if isinstance(value, tuple) else str(value)


def gate_dict(gate: GateConfig) -> dict[str, Any]:
    """The quality gate's bounds as JSON."""
    return {
        "max_spread_pct": gate.max_spread_pct,
        "max_heldout_pct": gate.max_heldout_pct,
        "remeasure_rounds": gate.remeasure_rounds,
        "accept_noisy": gate.accept_noisy,
        "heldout_metric": "leave_one_point_out.mean_abs_pct",
    }


def effective_config_dict(
    cfg: CalibrationConfig,
    geometry: Geometry,
    compatibility: Mapping[str, Any],
    threads: ThreadPin | None = None,
    gate: GateConfig | None = None,
) -> dict:
    """``{"config", "windows", "sources", "notes", "geometry", "graph_mode", "loop", "threads",
    "gate"}`` (``sources`` also names where ``threads`` and each gate bound came from;
    ``windows``: the window-count rule, ``CalibrationConfig.windows_dict``)."""
    sources = dict(cfg.sources)
    if threads is not None:
        sources["threads"] = threads.source
    if gate is not None:
        sources.update({f"gate.{k}": v for k, v in gate.sources.items()})
    return {
        "config": cfg.to_dict(),
        "windows": cfg.windows_dict(),
        "kv_spread": cfg.kv_spread,
        "sources": sources,
        "notes": dict(cfg.notes),
        "geometry": geometry.to_dict(),
        "graph_mode": compatibility.get("graph_mode"),
        "loop": compatibility.get("loop"),
        "threads": None if threads is None else threads.threads,
        "gate": None if gate is None else gate_dict(gate),
    }


def print_effective_config(
    console: Console,
    cfg: CalibrationConfig,
    geometry: Geometry,
    compatibility: Mapping[str, Any],
    threads: ThreadPin | None = None,
    gate: GateConfig | None = None,
) -> None:
    """Print every effective value with its source (calibration keys, then torch's intra-op
    threads and the quality gate), then the captured graph geometry."""
    t = Table(title="effective calibration configuration", title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value", overflow="fold")
    t.add_column("source")
    for key in KEYS:
        source = cfg.sources.get(key, "default")
        note = cfg.notes.get(key)
        t.add_row(key, _value(cfg, key), source + (f" ({note})" if note else ""))
    if threads is not None:
        t.add_row("threads", str(threads.threads), threads.note())
    if gate is not None:
        for key in ("max_spread_pct", "remeasure_rounds", "max_heldout_pct", "accept_noisy"):
            value = getattr(gate, key)
            t.add_row(
                f"gate.{key}",
                f"{value:g}" if isinstance(value, float) else str(value),
                gate.sources.get(key, "default"),
            )
    print_table(console, t)
    if gate is not None:
        console.print(
            f"quality gate: a point whose windows spread more than {gate.max_spread_pct:g} % "
            f"((max - min) / median) is re-measured, at most {gate.remeasure_rounds} more "
            f"round(s); a table whose leave-one-point-out error exceeds {gate.max_heldout_pct:g} % "
            "is not written"
            + (
                " unless --accept-noisy (given)"
                if gate.accept_noisy
                else " (--accept-noisy to write it anyway)"
            ),
            soft_wrap=True,
        )
    print_geometry(console, geometry, compatibility)


def print_geometry(console: Console, geometry: Geometry, compatibility: Mapping[str, Any]) -> None:
    """The captured graph geometry of the warmed runner."""
    g = Table(title="captured graph geometry", title_justify="left")
    g.add_column("item", style="bold")
    g.add_column("value", overflow="fold")
    g.add_row("graph mode", str(compatibility.get("graph_mode")))
    g.add_row("round loop", str(compatibility.get("loop", "synchronous")))
    g.add_row("draft width w", str(geometry.draft_width))
    g.add_row("request buckets Bcap", str(list(geometry.request_buckets)))
    g.add_row(
        "target rows G per Bcap",
        "; ".join(f"{b}: {list(r)}" for b, r in geometry.target_rows.items()),
    )
    g.add_row("KV capacity (tokens)", str(geometry.kv_capacity_tokens))
    g.add_row("model context", str(geometry.max_model_len))
    g.add_row("block size", str(geometry.block_size))
    model = compatibility.get("model") or {}
    device = compatibility.get("device") or {}
    g.add_row(
        "model",
        f"{model.get('architecture')} {model.get('dtype')} ({str(model.get('fingerprint'))[:12]})",
    )
    g.add_row("device", f"{device.get('kind')} {device.get('name')}")
    print_table(console, g)


def print_grid(
    console: Console, points: tuple[GridPoint, ...], cfg: CalibrationConfig, done: int
) -> None:
    """One line: how much will be sampled, and the mean KV length every point is measured at."""
    windows = cfg.min_windows_per_point if cfg.adaptive_windows else cfg.windows_per_point
    rounds = len(points) * (cfg.warmup_steps + windows * cfg.window_steps)
    kv = ", ".join(f"{calibrated_kv_length(cfg, i):.1f}" for i in range(len(cfg.contexts)))
    count = (
        f"{windows} windows (up to {cfg.windows_per_point} where they spread)"
        if cfg.adaptive_windows else f"{windows} windows"
    )
    console.print(
        f"grid: {len(points)} points x {count} of {cfg.window_steps} rounds "
        f"({cfg.mode}, ~{rounds} rounds incl. warmup), every point at mean KV {kv}; "
        f"{done} windows already in the journal"
    )


def print_more_windows(console: Console, early: EarlyStop, due: tuple, points: int) -> None:
    """One line after every point's first windows: how many stop there, how many get the rest."""
    shown = ", ".join(f"Bcap={p.bcap} G={p.g} k={p.k}" for p in due[:8])
    more = f" and {len(due) - 8} more" if len(due) > 8 else ""
    console.print(
        f"early stop: {points - len(due)} of {points} points keep {early.min_windows} windows "
        f"(spread within {early.spread_pct:g} %); {len(due)} get windows "
        f"{early.min_windows + 1}..{early.windows_per_point}" + (f": {shown}{more}" if due else ""),
        soft_wrap=True,
    )


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_fit_report(console: Console, table: Any) -> None:
    """Per-point residuals and held-out errors of every fitted context of a ``CostTable``
    (draft_step: each point's ``k`` and requests ``B``, and the draft-forward term chosen)."""
    by_k = table.mode == "draft_step"
    routed = table.calibration.routing is not None
    for fit in table.fits:
        d = fit.diagnostics
        t = Table(
            title=f"{fit.model} fit, context {fit.context_index} (prefill {fit.prefill_tokens}, "
            f"KV {fit.min_kv_length}..{fit.max_kv_length})",
            title_justify="left",
        )
        for col in (
            "Bcap",
            *(("B", "k") if by_k else ()),
            "G",
            "windows",
            "step ms",
            "spread ms",
            "fit ms",
            "resid ms",
            "resid %",
            "LOPO ms",
            "LOGO ms",
            *(("experts",) if routed else ()),
        ):
            t.add_column(col, justify="right")
        for p in d.points:
            t.add_row(
                str(p.bcap),
                *((_fmt(p.num_requests, "d"), _fmt(p.k, "d")) if by_k else ()),
                str(p.g),
                str(p.n_windows),
                _fmt(p.step_ms),
                _fmt(p.spread_ms),
                _fmt(p.predicted_ms),
                _fmt(p.residual_ms),
                _fmt(p.residual_pct, ".1f"),
                _fmt(p.lopo_ms),
                _fmt(p.logo_ms),
                *((_fmt(p.experts_activated, ".2f"),) if routed else ()),
            )
        print_table(console, t)
        for name, e in (
            ("residuals", d.residuals),
            ("leave-one-point-out", d.leave_one_point_out),
            ("leave-one-G-out", d.leave_one_g_out),
        ):
            console.print(
                f"  {name}: MAE {_fmt(e.mae_ms)} ms ({_fmt(e.mean_abs_pct, '.1f')} %), max "
                f"{_fmt(e.max_abs_ms)} ms ({_fmt(e.max_abs_pct, '.1f')} %), {e.n_evaluated} points"
                + (f", {e.n_skipped} skipped" if e.n_skipped else "")
            )
        sel = fit.additive.k_selection if fit.additive is not None else None
        if sel is not None:
            errs = ", ".join(
                f"{c.k_term} {_fmt(c.partly_filled.mean_abs_pct, '.1f')} %"
                for c in sel.candidates)
            console.print(
                f"  draft-forward term: {fit.additive.k_term} (by {sel.selected_by}; partly "
                f"filled points held out: {errs})", soft_wrap=True)
        elif fit.sps is not None and fit.sps.k is not None:
            console.print("  sps: one curve per k (draft forwards)")


def print_routing(console: Console, table: Any) -> None:
    """One line on a routed-expert target's routing during calibration (nothing when dense)."""
    line = routing_line(table)
    if line is not None:
        console.print(line, soft_wrap=True, markup=False)


def kv_model_errors(table: Any) -> dict | None:
    """The KV-aware model's held-out errors (None for a table without one): leave-one-context-
    out per point as a percentage of the measured cost, its median / mean / max, per context
    interval, and the leave-one-point-out mean."""
    kv = getattr(table, "kv_model", None)
    if kv is None:
        return None
    pct = [(p.context_index, 100.0 * abs(p.loco_ms - p.step_ms) / p.step_ms)
           for p in kv.points if p.loco_ms is not None]
    vals = [v for _, v in pct]

    def median(xs):
        return statistics.median(xs) if xs else None

    return {
        "kv_term": kv.kv_term,
        "selected_by": kv.selected_by,
        "min_kv_length": kv.min_kv_length,
        "max_kv_length": kv.max_kv_length,
        "leave_one_context_out_median_pct": median(vals),
        "leave_one_context_out_mean_pct": kv.leave_one_context_out.mean_abs_pct,
        "leave_one_context_out_max_pct": kv.leave_one_context_out.max_abs_pct,
        "leave_one_point_out_mean_pct": kv.leave_one_point_out.mean_abs_pct,
        "per_context_loco_median_pct": {
            int(c): median([v for ci, v in pct if ci == c]) for c in sorted({c for c, _ in pct})
        },
        "points": len(kv.points),
    }


def print_kv_model(console: Console, table: Any) -> None:
    """One paragraph on the KV-aware model of a multi-context table (nothing without one)."""
    e = kv_model_errors(table)
    if e is None:
        return
    per = ", ".join(f"context {c} {_fmt(v, '.2f')} %" for c, v in e["per_context_loco_median_pct"].items())
    console.print(
        f"KV model ({e['kv_term']} slope, chosen by {e['selected_by'].replace('_', ' ')}) prices "
        f"any KV in {e['min_kv_length']}..{e['max_kv_length']}: leave-one-context-out median "
        f"{_fmt(e['leave_one_context_out_median_pct'], '.2f')} %, mean "
        f"{_fmt(e['leave_one_context_out_mean_pct'], '.2f')} %, max "
        f"{_fmt(e['leave_one_context_out_max_pct'], '.2f')} % ({per}); leave-one-point-out mean "
        f"{_fmt(e['leave_one_point_out_mean_pct'], '.2f')} % over {e['points']} points",
        soft_wrap=True,
    )


def print_kv_spread(console: Console, table: Any) -> None:
    """One line per context on the KV spread term (``speccal.costmodel.spread``; nothing
    without one)."""
    block = getattr(table, "kv_spread", None)
    if block is None:
        return
    by_ctx: dict[int, list] = {}
    for p in block.points:
        by_ctx.setdefault(p.context_index, []).append(p)
    for ci, pts in sorted(by_ctx.items()):
        parts = ", ".join(
            f"Bcap {p.bcap} +{100.0 * (p.spread_ms / p.calibrated_ms - 1.0):.1f} % "
            f"({1e3 * p.slope_ms_per_token:.3f} us/token)" for p in pts)
        pt = pts[0]
        console.print(
            f"KV spread ({block.layout}, context {ci}, mean KV {pt.mean_kv_length:.0f}, longest "
            f"request +{pt.spread_excess:.0f} past it): {parts}",
            soft_wrap=True,
        )
    console.print("rounds whose longest request runs past their mean KV are priced that much "
                  "more (slope and reference linear in the mean KV between contexts)",
                  soft_wrap=True)


def fit_summary(table: Any) -> list[dict]:
    """``--json`` form of the fit report: error summaries per context."""
    out = []
    for fit in table.fits:
        d = fit.diagnostics
        out.append(
            {
                "context_index": fit.context_index,
                "model": fit.model,
                "points": len(d.points),
                "residuals": d.residuals.model_dump(),
                "leave_one_point_out": d.leave_one_point_out.model_dump(),
                "leave_one_g_out": d.leave_one_g_out.model_dump(),
            }
        )
    return out


def print_reused_table(console: Console, table: Any, path: Any) -> None:
    """Source, saved calibration config and coverage of a table reused with ``--cost-table``."""
    cal = table.calibration
    console.print(
        f"reusing cost table {escape(str(path))} (schema {table.schema_version}, created {table.provenance.created})"
    )
    console.print(
        f"  saved calibration: model {cal.model}, mode {cal.mode}, draft_width {cal.draft_width}, "
        f"request_buckets {cal.request_buckets}, windows {cal.windows_per_point} x {cal.window_steps} rounds"
    )
    for fit in table.fits:
        console.print(
            f"  coverage: context {fit.context_index} KV {fit.min_kv_length}..{fit.max_kv_length}, "
            f"Bcap {fit.bcap_levels()}, held-out MAE "
            f"{_fmt(fit.diagnostics.leave_one_point_out.mae_ms)} ms"
        )
    console.print("  sampling and fitting skipped; compatibility checked against this run")


def print_remeasure(console: Console, round_index: int, gate: GateConfig, due: tuple) -> None:
    """One line before a re-measure round: which points, and why."""
    shown = ", ".join(f"Bcap={p.bcap} G={p.g} k={p.k}" for p in due[:8])
    more = f" and {len(due) - 8} more" if len(due) > 8 else ""
    console.print(
        f"re-measuring {len(due)} noisy point(s) (window spread above {gate.max_spread_pct:g} %), "
        f"round {round_index} of at most {gate.remeasure_rounds}: {shown}{more}",
        soft_wrap=True,
    )


def print_gate(
    console: Console, quality: Mapping[str, Any], selection: Selection, held: HeldOut
) -> None:
    """The quality gate's verdict: spreads, re-measured points, load, held-out error."""
    spread = quality["window_spread_pct_max"]
    bound = quality["max_spread_pct"]
    spread_text = (
        "not measurable (one window per point)"
        if spread is None
        else f"max {spread:.1f} % (bound {bound:g} %)"
    )
    last = selection.last_round_spread_max_pct
    if spread is not None and last is not None and selection.flagged and last < spread:
        spread_text += f", {last:.1f} % in each point's last round"
    console.print(
        f"quality gate: window spread {spread_text}; {len(selection.flagged)} point(s) flagged, "
        f"{quality['remeasured_windows']} window(s) re-measured",
        soft_wrap=True,
    )
    for q in selection.flagged:
        pooled = f"rounds 0-{q.kept_round} pooled"
        state = f"still noisy, {pooled}" if q.noisy else pooled
        console.print(f"  {describe_point(q)} ({state})", soft_wrap=True)
    if held.pct is None:
        verdict = (
            "not evaluable: no point can be held out on this grid (each is the only evidence "
            "for a level); only the window spread was checked"
        )
    else:
        where = f", context {held.context_index}" if held.context_index else ""
        verdict = (
            f"{held.pct:.1f} % (leave-one-point-out mean{where}; bound "
            f"{quality['max_heldout_pct']:g} %): "
        )
        if quality["passed"]:
            verdict += "passed"
        elif quality["override_used"]:
            verdict += "[bold yellow]beyond the bound[/], written because of --accept-noisy (recorded in the table)"
        else:
            verdict += "[bold red]beyond the bound[/]"
    console.print(f"quality gate: held-out error {verdict}", soft_wrap=True)


def print_timing(console: Console, timing: Any) -> None:
    """One line on how the windows were timed: the round loop and, with device spans (CUDA),
    the windows' wall total over device span (``calibration.timing``)."""
    if timing is None:
        return
    text = f"windows timed on the {timing.loop} round loop"
    if timing.device_windows:
        text += (
            f": wall / device span median {timing.wall_over_device_median:.3f}, max "
            f"{timing.wall_over_device_max:.3f} over {timing.device_windows} windows; device "
            f"{timing.device_step_ms_median:.3f} ms per round (median)"
        )
    else:
        text += " (no device clock: wall time only)"
    console.print(text, soft_wrap=True)
