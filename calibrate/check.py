"""``speccal table check``: re-measure a shipped table's spot points here and report drift.

A table predicts step costs for the machine and program it was measured on. This module
re-measures a few **spot points** on the current machine, with the table's recorded execution
path, and compares each with what the table predicts:

- **Spot points** (:func:`spot_points`): the extremes of the grid: the smallest and largest
  calibrated Bcap, each at its smallest and largest calibrated G, in the first and last context
  interval (at most 8 points; fewer when extremes coincide), or in the intervals given instead
  (``contexts``, ``--context P:LO:HI``: e.g. a KV between two calibrated levels, where only the KV
  model prices it; such a point reports ``context_index`` None).
- **Measurement**: the runner is built from the table (``preset:NAME`` architecture, device
  kind, dtype, draft width, captured request buckets, model context, graph mode, attention
  backend; ``model`` may override the preset, e.g. to check a table against another model), and
  the points are driven exactly as ``speccal calibrate`` drives them
  (``speccal.calibrate.driver.drive``: window-major, the table's warm-up and window length,
  ``windows`` windows per point, in memory, no journal). A field of the built runner's
  compatibility that differs from the table's is listed (``compatibility``), never refused:
  measuring the difference is the point of a check.
- **Drift** of a point: ``100 * (measured - predicted) / predicted``, ``measured`` the median of
  its windows, ``predicted`` the table's lookup at the point's measured mean KV length (the KV
  model's price when the table has one).
- **Bound**: ``max_drift_pct`` when given, else ``max(floor, 2 * heldout_pct)``, ``heldout_pct``
  the table's own held-out error (the worst context's leave-one-point-out mean, or the KV model's
  leave-one-context-out mean when that is larger) and ``floor`` the calibration gate's held-out
  bound of the device kind (10 % cpu, 5 % cuda/npu, ``speccal.calibrate.gate.DEFAULTS``): the
  table cannot be expected to predict a re-measurement better than it predicts its own held-out
  points, and a re-measurement adds its own window noise.
- **Verdict**: ``passed`` when the median absolute drift over the points is within the bound;
  points beyond the bound are named either way. ``speccal table check`` exits 1 when not passed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speccal.base.errors import InputError
from speccal.calibrate import machine
from speccal.calibrate.config import CalibrationConfig, ContextInterval
from speccal.calibrate.driver import drive
from speccal.calibrate.feasibility import check_feasible
from speccal.calibrate.gate import DEFAULTS, held_out
from speccal.calibrate.grid import build_grid
from speccal.calibrate.pipeline import CalibrateOptions, make_engine
from speccal.costmodel.compat import as_compatibility, compare
from speccal.costmodel.table import load_table
from speccal.costmodel.table_schema import CostTable

PRESET = "preset:"


@dataclass(frozen=True)
class SpotPoint:
    """One point to re-measure: its context interval ``(prefill, lo, hi)``, the table's index
    of it (None for a context the table did not calibrate) and the grid shape."""

    context: tuple[int, int, int]
    context_index: int | None
    bcap: int
    g: int


def spot_points(
    table: CostTable, contexts: Sequence[tuple[int, int, int]] | None = None
) -> list[SpotPoint]:
    """The grid extremes of ``table`` (module docstring), in (context, Bcap, G) order.

    ``contexts``: measure at these ``(prefill_tokens, min_kv_length, max_kv_length)`` intervals
    instead of the table's first and last (e.g. a KV between two calibrated levels, to check what
    the KV model predicts there); each must lie inside the table's calibrated span.
    """
    cal = table.calibration
    rows = {int(b): sorted(int(g) for g in gs) for b, gs in cal.target_graph_rows.items()}
    bcaps = sorted(b for b in rows if rows[b])
    if not bcaps:
        raise InputError("calibration.target_graph_rows", rows, "at least one measured point")
    if contexts is None:
        ends = {f.context_index: f for f in (table.fits[0], table.fits[-1])}
        chosen = [
            ((f.prefill_tokens, max(f.min_kv_length, 1), f.max_kv_length), ci)
            for ci, f in sorted(ends.items())
        ]
    else:
        lo = min(f.min_kv_length for f in table.fits)
        hi = max(f.max_kv_length for f in table.fits)
        chosen = []
        for c in contexts:
            p, a, b = (int(x) for x in c)
            if not (lo <= a <= b <= hi):
                raise InputError(
                    "--context", f"{p}:{a}:{b}", f"KV bounds inside the table's span [{lo}, {hi}]"
                )
            known = [
                f.context_index
                for f in table.fits
                if (f.prefill_tokens, f.min_kv_length, f.max_kv_length) == (p, a, b)
            ]
            chosen.append(((p, a, b), known[0] if known else None))
    out = []
    for ctx, ci in chosen:
        for b in sorted({bcaps[0], bcaps[-1]}):
            for g in sorted({rows[b][0], rows[b][-1]}):
                out.append(SpotPoint(ctx, ci, b, g))
    return out


class _MemoryJournal:
    """What ``drive`` needs of a journal, kept in memory (a check writes nothing)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.done: set[tuple] = set()

    def append(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))
        key = (row["context_index"], row["bcap"], row["g"], row["k"], row["window_index"])
        self.done.add(key)


def engine_options(table: CostTable, *, model: str | None, device: str | None) -> CalibrateOptions:
    """The runner options that rebuild the table's recorded program (module docstring)."""
    compat = table.compatibility
    arch = compat.model.architecture
    if model is None:
        if not arch.startswith(PRESET):
            raise InputError(
                "compatibility.model.architecture",
                arch,
                "a preset:NAME the runner can rebuild (pass --model to choose the model)",
            )
        model = arch[len(PRESET) :]
    kind = compat.device.kind
    if device is None:
        if kind == "unknown":
            raise InputError("compatibility.device.kind", kind, "cpu, cuda or npu (pass --device)")
        device = kind
    known = {"unknown", None}
    geom = table.geometry_block
    return CalibrateOptions(
        model=model,
        device=device,
        dtype=None if compat.model.dtype in known else compat.model.dtype,
        draft_width=table.draft_width,
        request_buckets=tuple(geom.request_buckets),
        max_model_len=geom.max_model_len or None,
        graph_mode=None if compat.graph_mode in known else compat.graph_mode,
        attention_backend=None if compat.attention_backend in known else compat.attention_backend,
        # a table that never recorded its loop was measured before calibration was pipelined
        loop="synchronous" if compat.loop in known else compat.loop,
        # the kernels the table measured (None when it never recorded them: the defaults)
        kernels=compat.kernels.config,
        progress=False,
    )


def _spot_config(table: CostTable, points: list[SpotPoint], windows: int) -> CalibrationConfig:
    cal = table.calibration
    contexts = list(dict.fromkeys(p.context for p in points))
    rows: dict[int, set[int]] = {}
    for p in points:
        rows.setdefault(p.bcap, set()).add(p.g)
    return CalibrationConfig(
        # Nothing is fitted: "sps" keeps feasibility from asking the spot grid (corners only)
        # to be connected like an additive calibration grid.
        model="sps",
        mode=cal.mode,
        draft_width=cal.draft_width,
        request_buckets=tuple(sorted(rows)),
        target_graph_rows={b: tuple(sorted(gs)) for b, gs in sorted(rows.items())},
        contexts=tuple(ContextInterval(*c) for c in contexts),
        warmup_steps=cal.warmup_steps,
        window_steps=cal.window_steps,
        windows_per_point=windows,
        token_seed=cal.token_seed,
    )


def table_heldout_pct(table: CostTable) -> float | None:
    """The table's own held-out error (%): the larger of the worst context's leave-one-point-out
    mean and the KV model's leave-one-context-out mean; None when nothing was held out."""
    values = [held_out(table).pct]
    if table.kv_model is not None:
        values.append(table.kv_model.leave_one_context_out.mean_abs_pct)
    values = [float(v) for v in values if v is not None]
    return max(values) if values else None


def check_table(
    path: str | Path,
    *,
    model: str | None = None,
    device: str | None = None,
    windows: int | None = None,
    max_drift_pct: float | None = None,
    contexts: Sequence[tuple[int, int, int]] | None = None,
    engine_factory: Callable[[CalibrateOptions], Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Re-measure the spot points of the table at ``path`` and report drift (module docstring).

    Parameters
    ----------
    path : the cost table.
    model, device : override the table's recorded preset / device kind.
    windows : windows per spot point (default the table's ``windows_per_point``).
    max_drift_pct : the bound on the median absolute drift (default ``max(floor, 2 * held-out)``).
    contexts : intervals to measure instead of the table's first and last (:func:`spot_points`).
    engine_factory, clock : as for ``speccal.calibrate.pipeline.calibrate`` (tests inject fakes).

    Returns
    -------
    The ``--json`` report: ``table``, ``passed``, ``bound_pct``, ``bound_source``,
    ``heldout_pct``, ``median_abs_drift_pct``, ``max_abs_drift_pct``, ``points`` (per point:
    ``context_index`` (None for a context the table did not calibrate), ``context``, ``bcap, g, k,
    kv_length, measured_ms, predicted_ms, uncalibrated, drift_pct, beyond``),
    ``drifting`` (the points beyond the bound), ``compatibility`` (fields where the measured
    runner differs from the table), ``options`` (the runner that measured), ``wall_s``.
    """
    t0 = time.perf_counter()
    if windows is not None and (not isinstance(windows, int) or windows < 1):
        raise InputError("--windows", windows, "an integer >= 1")
    if max_drift_pct is not None and not max_drift_pct > 0:
        raise InputError("--max-drift-pct", max_drift_pct, "a number > 0")
    table = load_table(path)
    points = spot_points(table, contexts)
    opts = engine_options(table, model=model, device=device)
    cfg = _spot_config(table, points, windows or table.calibration.windows_per_point)
    journal = _MemoryJournal()
    # The thread count the table was measured with (one on cpu when it did not record one).
    with machine.pin_threads(opts.device, table.calibration.threads):
        engine = (engine_factory or make_engine)(opts)
        running = as_compatibility(engine.compatibility())
        differs = [str(m) for m in compare(running, table.compatibility)]
        check_feasible(cfg, engine.geometry)
        grid = build_grid(cfg)
        kind = str(running.device.kind)
        drive(
            engine,
            cfg,
            grid,
            journal,
            device=f"{kind}:{running.device.name}",
            vocab_size=int(engine.vocab_size),
            clock=clock,
        )
    # grid context i is the i-th distinct spot context (``_spot_config``)
    cis = [p.context_index for p in dict((p.context, p) for p in points).values()]
    spans = list(dict.fromkeys(p.context for p in points))
    lookup = table.lookup()
    rows = []
    for gp in grid:
        mine = [r for r in journal.rows
                if (r["context_index"], r["bcap"], r["g"], r["k"]) == gp.key[:4]]
        measured = statistics.median(float(r["step_ms"]) for r in mine)
        kv = statistics.fmean(float(r["mean_kv_length"]) for r in mine)
        answer = lookup.cost_ms(gp.bcap, gp.g, kv, gp.k)
        drift = 100.0 * (measured - answer.cost_ms) / answer.cost_ms if answer.calibrated else None
        rows.append(
            {
                "context_index": cis[gp.context_index],
                "context": list(spans[gp.context_index]),
                "bcap": gp.bcap,
                "g": gp.g,
                "k": gp.k,
                "kv_length": kv,
                "measured_ms": measured,
                "predicted_ms": answer.cost_ms if answer.calibrated else None,
                "uncalibrated": answer.reason,
                "drift_pct": drift,
            }
        )
    heldout = table_heldout_pct(table)
    if max_drift_pct is not None:
        bound, source = float(max_drift_pct), "flag"
    else:
        floor = DEFAULTS.get(kind, DEFAULTS["cuda"])[1]
        bound = max(floor, 2.0 * heldout) if heldout is not None else floor
        source = f"max({floor:g} % {kind} floor, 2 x held-out)"
    for r in rows:
        r["beyond"] = r["drift_pct"] is None or abs(r["drift_pct"]) > bound
    drifts = [abs(r["drift_pct"]) for r in rows if r["drift_pct"] is not None]
    median = statistics.median(drifts) if drifts else None
    passed = median is not None and median <= bound and len(drifts) == len(rows)
    return {
        "table": str(path),
        "passed": passed,
        "bound_pct": bound,
        "bound_source": source,
        "heldout_pct": heldout,
        "median_abs_drift_pct": median,
        "max_abs_drift_pct": max(drifts) if drifts else None,
        "points": rows,
        "drifting": [r for r in rows if r["beyond"]],
        "compatibility": differs,
        "options": {
            "model": opts.model,
            "device": opts.device,
            "graph_mode": running.graph_mode,
            "attention_backend": running.attention_backend,
            "windows_per_point": cfg.windows_per_point,
            "window_steps": cfg.window_steps,
            "warmup_steps": cfg.warmup_steps,
        },
        "wall_s": time.perf_counter() - t0,
    }
