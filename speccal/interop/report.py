"""The evidence sidecar written next to every exported engine file.

One JSON document (``OUT`` with the suffix ``.speccal.json``; canonical, atomic), schema
version :data:`SIDECAR_VERSION`::

    {"sidecar_version": 1, "created", "speccal_version",
     "engine": {name, format, matched: [{repo, path, functions, commit}], k0_meaning},
     "file": {name, sha256, bytes},                  the exported file it vouches for
     "table": {path, sha256, mode, model, draft_width, request_buckets, contexts,
               heldout: {fits: [...], kv_model?, metric, pct}, compatibility},
     "pricing": {model: kv_model | context_fit | mixed, kv_length, ...},
     "acceptance": {kind, path, draft_width, rounds, requests, kv_length, prefix_acceptance,
                    meta},
     "buckets": [{bcap, rounds, tokens_per_s: {k: ...}, best_k, exported_k, gain_vs_k_pct,
                  margin_pct, decisive, k0_source, adaptive, uncalibrated}],
     "workload": {...} | null, "speccal_workload": {...} | null,
     "adjustments": [...], "fidelity": {...} | null, "notes": [...],
     "caveats": [{id, applies, changes, sources}],   the engine's behaviours that change the
                                                     decision (``applies``: for this file)
     "ranges": [{batch_sizes: [lo, hi], k, evidence: [{batch_size, tokens_per_s, runner_up_k,
                 runner_up_tokens_per_s, cell, runner_up_cell, uncalibrated}]}] | null,
     "per_bucket": {...} | null,                     per-batch-size vs per-bucket decisions
     "valid_for": {table identity, batch sizes, KV span, acceptance source}}

``decisive`` is true when the best ``k``'s predicted margin over the runner-up exceeds the
table's held-out error (``heldout.pct``, ``speccal.interop.pricing.heldout``: the worst
context's leave-one-point-out mean error in %, else its leave-one-G-out one, of the model the
lookup prices with): a smaller margin is inside the model's own error. ``pricing``
(``speccal.interop.pricing.pricing_block``) says which model priced the export (the table's KV
model or its context fits) and at which KV length(s). Floats are rounded to 6 decimals; values
that are not finite are null.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np

from speccal import __version__

SIDECAR_VERSION = 1


@dataclass(frozen=True, eq=False)
class Rendered:
    """One engine file: its text, the parsed document, the decisions it makes the engine run
    (``{Bcap: k}``), what the engine's rules changed, and notes for the sidecar."""

    engine: str
    format: str
    text: str
    document: Any
    decisions: dict[int, int]
    adjustments: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fidelity: dict[str, Any] | None = None
    sidecar_name: str | None = None
    caveats: list[dict[str, Any]] = field(default_factory=list)


def clean(value: Any) -> Any:
    """JSON-ready: numpy scalars as Python, floats rounded to 6 decimals, non-finite as None,
    dict keys as strings."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, np.ndarray):
        return clean(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return round(v, 6) if math.isfinite(v) else None
    return value


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def bucket_rows(scores, exported: dict[int, int], heldout_pct: float | None) -> list[dict]:
    """The per-bucket evidence: tokens/s of every k, the best and the exported k."""
    rows = []
    for s in scores:
        margin = s.margin_pct()
        rows.append(
            {
                "bcap": s.bcap,
                "rounds": s.rounds,
                "tokens_per_s": s.tokens_per_s,
                "best_k": s.best_k,
                "exported_k": exported.get(s.bcap, s.best_k),
                "gain_vs_k_pct": {k: s.gain_pct(k) for k in s.tokens_per_s},
                "margin_pct": margin,
                "decisive": None
                if margin is None or heldout_pct is None
                else bool(margin > heldout_pct),
                "k0_source": s.k0_source,
                "adaptive": s.adaptive,
                "uncalibrated": s.uncalibrated,
            }
        )
    return rows


def sidecar(
    *,
    rendered: Rendered,
    file_name: str,
    file_bytes: bytes,
    table: Any,
    table_path: str,
    table_bytes: bytes,
    acceptance: dict[str, Any] | None,
    buckets: list[dict],
    workload: dict[str, Any] | None,
    speccal_workload: dict[str, Any] | None,
    matched: list[dict],
    k0_meaning: str,
    heldout_block: dict[str, Any],
    pricing: dict[str, Any],
    ranges: list[dict[str, Any]] | None = None,
    per_bucket: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The sidecar document (see module docstring)."""
    geo = table.geometry()
    compat = table.compatibility.model_dump(mode="json")
    contexts = [[f.min_kv_length, f.max_kv_length] for f in table.fits]
    doc = {
        "sidecar_version": SIDECAR_VERSION,
        "created": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "speccal_version": __version__,
        "engine": {
            "name": rendered.engine,
            "format": rendered.format,
            "matched": matched,
            "k0_meaning": k0_meaning,
        },
        "file": {"name": file_name, "sha256": sha256(file_bytes), "bytes": len(file_bytes)},
        "table": {
            "path": table_path,
            "sha256": sha256(table_bytes),
            "mode": table.mode,
            "model": table.model,
            "draft_width": table.draft_width,
            "request_buckets": list(geo.request_buckets),
            "contexts": contexts,
            "heldout": heldout_block,
            "compatibility": compat,
        },
        "pricing": pricing,
        "acceptance": acceptance,
        "buckets": buckets,
        "workload": workload,
        "speccal_workload": speccal_workload,
        "adjustments": rendered.adjustments,
        "fidelity": rendered.fidelity,
        "notes": rendered.notes,
        "caveats": rendered.caveats,
        "ranges": ranges,
        "per_bucket": per_bucket,
        "valid_for": {
            "draft_width": table.draft_width,
            "model": compat["model"],
            "topology": compat["topology"],
            "device": compat["device"],
            "graph_mode": compat["graph_mode"],
            "batch_sizes": [1, int(geo.request_buckets[-1])],
            "kv_length": [min(c[0] for c in contexts), max(c[1] for c in contexts)],
            "acceptance": None if acceptance is None else acceptance.get("source"),
        },
    }
    return clean(doc)
