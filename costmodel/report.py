"""Plain-data views of a cost table for the CLI and notebooks (no Rich, no printing).

- :func:`summary`: a JSON-ready dict (identity, compatibility, the measured execution path with
  its kernel configuration flattened to dotted fields, provenance, one entry per fit with its
  parameters, error summaries and the cells where it predicts a non-positive cost);
- :func:`cost_grid`: one row per (context, Bcap, captured G) with the looked-up cost, so a
  table can be exported to CSV/markdown or plotted;
- :func:`diff_tables`: what differs between two tables (metadata fields by dotted name, kernel
  configuration fields included, and costs at common grid cells);
- :func:`to_markdown`: a DataFrame as a GitHub markdown table;
- :func:`sources_line`: where a fitted table's mode and draft width came from, in words.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from speccal.costmodel.compat import flatten_config
from speccal.costmodel.coverage import producible
from speccal.costmodel.table_schema import CostTable

ERROR_KEYS = ("residuals", "leave_one_point_out", "leave_one_g_out")


def summary(table: CostTable) -> dict[str, Any]:
    """JSON-ready overview of ``table`` (no raw windows, no per-point diagnostics).

    ``kv_model`` (only for a table that has one): its parameters, errors and candidates,
    without its points. Each fit lists ``nonpositive_cells`` (``[{bcap, g, k, cost_ms, measured}]``; ``k`` None unless the fit prices each k): calibrated cells
    where the fit predicts a step cost ``<= 0`` ms, which lookups treat as uncalibrated.
    """
    bad = table.nonpositive_cells()
    fits = []
    for f in table.fits:
        params = f.additive if f.model == "additive" else f.sps
        fits.append(
            {
                "context_index": f.context_index,
                "prefill_tokens": f.prefill_tokens,
                "min_kv_length": f.min_kv_length,
                "max_kv_length": f.max_kv_length,
                "model": f.model,
                "n_points": len(f.diagnostics.points),
                "n_windows": len(f.windows),
                "params": params.model_dump(mode="json"),
                **{k: getattr(f.diagnostics, k).model_dump(mode="json") for k in ERROR_KEYS},
                "nonpositive_cells": [
                    {k: c[k] for k in ("bcap", "g", "k", "cost_ms", "measured")}
                    for c in bad
                    if c["context_index"] == f.context_index
                ],
            }
        )
    out = {
        "schema_version": table.schema_version,
        "model": table.model,
        "mode": table.mode,
        "draft_width": table.draft_width,
        "execution": execution_path(table),
        "compatibility": table.compatibility.model_dump(mode="json"),
        "calibration": table.calibration.model_dump(mode="json"),
        "provenance": table.provenance.model_dump(mode="json"),
        "fits": fits,
    }
    if table.kv_model is not None:  # absent (not null) for tables without one
        out["kv_model"] = table.kv_model.model_dump(mode="json", exclude={"points"})
    routing = routing_summary(table)
    if routing is not None:  # absent (not null) for a dense target's table
        out["routing"] = routing
    return out


def routing_summary(table: CostTable) -> dict[str, Any] | None:
    """A routed-expert target's ``calibration.routing`` with, per measured point, the mean
    distinct experts a round activated per routed layer (``points``: ``[{context_index, bcap,
    g, k, experts_activated}]``); None for a dense target's table."""
    routing = table.calibration.routing
    if routing is None:
        return None
    return {
        **routing.model_dump(mode="json"),
        "points": [
            {"context_index": f.context_index, "bcap": p.bcap, "g": p.g, "k": p.k,
             "experts_activated": p.experts_activated}
            for f in table.fits for p in f.diagnostics.points
        ],
    }


def routing_line(table: CostTable) -> str | None:
    """One sentence on how a routed-expert target routed while calibrated (None: dense)."""
    r = routing_summary(table)
    if r is None:
        return None
    vals = [p["experts_activated"] for p in r["points"]]
    source = {"random_tokens": "random tokens (uniform-like routing, as a load-balanced "
                               "model's)"}[r["source"]]
    return (f"routing: {r['layers']} routed layers, top {r['top_k']} of {r['experts']} experts, "
            f"calibrated on {source}; distinct experts per layer and round "
            f"{min(vals):.2f}-{max(vals):.2f} over {len(vals)} points")


#: How a table says where a value came from (``calibration.sources``).
SOURCE_TEXT = {
    "flag": "from the command line",
    "compatibility": "from --compat",
    "calibration": "from --calibration",
    "measurements": "read from the rows",
    "default": "default",
}


def sources_line(table: CostTable) -> str:
    """``mode M (where from); draft width W (where from)`` of a table (what ``speccal fit``
    says), from its ``calibration.sources``."""
    src = table.calibration.sources
    mode_src = src.get("mode", "default")
    mode_text = (
        "default: the rows have no mode column; calibrate's default"
        if mode_src == "default"
        else SOURCE_TEXT.get(mode_src, mode_src)
    )
    width_src = src.get("draft_width", "default")
    return (f"mode {table.mode} ({mode_text}); draft width {table.draft_width} "
            f"({SOURCE_TEXT.get(width_src, width_src)})")


def execution_path(table: CostTable) -> dict[str, Any]:
    """The program the table measured: ``graph_mode``, ``attention_backend``, ``input_update``,
    ``kernel_digest`` and ``kernel_config`` (dotted field -> value; None when unknown)."""
    c = table.compatibility
    config = c.kernels.config
    return {
        "graph_mode": c.graph_mode,
        "attention_backend": c.attention_backend,
        "input_update": c.input_update,
        "kernel_digest": c.kernels.digest,
        "kernel_config": None if config is None else flatten_config(config),
    }


def cost_grid(table: CostTable) -> pd.DataFrame:
    """Cost of every captured (Bcap, G) of the table's geometry, per context interval.

    Columns: ``context_index, min_kv_length, max_kv_length, bcap, g, k, measured, calibrated,
    cost_ms, steps_per_s, reason``. ``k`` is ``g / bcap - 1`` in ``draft_step`` mode when G is a
    multiple of Bcap, else empty; a draft_step table whose fit keeps a draft-forward term has
    one row per shape a round can run instead (``(G, k)`` of every batch each bucket holds,
    ``speccal.costmodel.coverage``), priced at its ``k``. Costs are looked up at the interval's
    lower KV bound.
    """
    rows = []
    geom = table.geometry()
    by_k = table.mode == "draft_step" and table.lookup().depends_on_k
    for f in table.fits:
        measured = {(p.bcap, p.g, p.k) if by_k else (p.bcap, p.g) for p in f.diagnostics.points}
        for b in geom.request_buckets:
            if by_k:
                cells = producible(geom, b, "draft_step")
            else:
                cells = [(g, g // b - 1 if table.mode == "draft_step" and g % b == 0 else None)
                         for g in geom.target_rows[b]]
            for g, k in cells:
                look = table.cost_ms(b, g, f.min_kv_length, k)
                rows.append(
                    {
                        "context_index": f.context_index,
                        "min_kv_length": f.min_kv_length,
                        "max_kv_length": f.max_kv_length,
                        "bcap": b,
                        "g": g,
                        "k": k,
                        "measured": ((b, g, k) if by_k else (b, g)) in measured,
                        "calibrated": look.calibrated,
                        "cost_ms": look.cost_ms,
                        "steps_per_s": 1000.0 / look.cost_ms if look.calibrated else math.nan,
                        "reason": look.reason or "",
                    }
                )
    df = pd.DataFrame(rows)
    df["k"] = df["k"].astype("Int64")
    return df


def diff_tables(a: CostTable, b: CostTable) -> dict[str, Any]:
    """Differences between two tables.

    Returns
    -------
    ``{"metadata": [{"field", "a", "b"}], "costs": [{"context_index", "bcap", "g", "a_ms",
    "b_ms", "delta_ms", "delta_pct"}], "max_abs_delta_pct": float | None, "only_in_a": int,
    "only_in_b": int}``: metadata covers compatibility (the kernel configuration field by field,
    ``compatibility.kernels.config.gemv.stages``), calibration and geometry, by dotted name
    (None where one table lacks the field); costs cover grid cells calibrated in both (by
    context index and Bcap, G).
    """
    meta = []
    for block in ("compatibility", "calibration", "geometry"):
        fa = flatten_config(a.to_json_dict()[block], f"{block}.")
        fb = flatten_config(b.to_json_dict()[block], f"{block}.")
        for key in sorted(set(fa) | set(fb)):
            if fa.get(key) != fb.get(key):
                meta.append({"field": key, "a": fa.get(key), "b": fb.get(key)})
    # cells by (context, Bcap, G, k): a draft_step table pricing each k prices one G at several
    # (k = -1 stands for "any": a fit that does not depend on it)
    ga, gb = (g.assign(k=g["k"].fillna(-1).astype(int)) for g in (cost_grid(a), cost_grid(b)))
    keys = ["context_index", "bcap", "g", "k"]
    ga, gb = ga[ga.calibrated][keys + ["cost_ms"]], gb[gb.calibrated][keys + ["cost_ms"]]
    both = ga.merge(gb, on=keys, suffixes=("_a", "_b"))
    costs = [
        {
            "context_index": int(r.context_index),
            "bcap": int(r.bcap),
            "g": int(r.g),
            **({"k": int(r.k)} if r.k >= 0 else {}),
            "a_ms": float(r.cost_ms_a),
            "b_ms": float(r.cost_ms_b),
            "delta_ms": float(r.cost_ms_b - r.cost_ms_a),
            "delta_pct": float(100.0 * (r.cost_ms_b - r.cost_ms_a) / r.cost_ms_a),
        }
        for r in both.itertuples(index=False)
    ]
    return {
        "metadata": meta,
        "costs": costs,
        "max_abs_delta_pct": max((abs(c["delta_pct"]) for c in costs), default=None),
        "only_in_a": int(len(ga) - len(both)),
        "only_in_b": int(len(gb) - len(both)),
    }


def to_markdown(df: pd.DataFrame, floatfmt: str = ".4f") -> str:
    """Render ``df`` as a GitHub markdown table (NaN and NA as empty cells)."""

    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
            return ""
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v).replace("|", "\\|")

    head = "| " + " | ".join(df.columns) + " |"
    sep = "| " + " | ".join("---" for _ in df.columns) + " |"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *body]) + "\n"
