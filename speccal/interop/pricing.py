"""What a table prices at one KV length, in the forms engine files carry, and its held-out error.

The owner of the rule "the exported numbers are speccal's lookup" (``speccal.costmodel.lookup``):
a table with a KV model (``kv_model``) is priced by it at the exact KV length anywhere in its
span; a table without one by the fit of the context interval holding the KV length. Exporters
that write costs (SGLang) take them from here, never from ``table.fits`` directly; exporters that
write decisions (vLLM, TensorRT-LLM) price through ``speccal.policy.CostModel`` (the same
lookup) and record the same :func:`pricing_block`.

- :func:`additive_at`: at a fixed KV the KV model ``bias + alpha(Bcap) + theta(G) +
  slope(x) * x * kv`` is additive in Bcap and G: the slope term folds into ``theta`` (``x = G``)
  or ``alpha`` (``x = Bcap``), re-referenced to the smallest level
  (``KVCostModel.additive_at``; so ``bias`` is the reference cell's cost at that KV, the
  convention of ``AdditiveParams``: positive where the cost is).
- :func:`g_curve`: one cost per captured G (an SPS curve). A context's SPS fit is a function of G
  only; the KV model is not (its ``alpha(Bcap)``), so at a G that several request buckets reach
  the curve takes the median of their costs, as the SPS fit pools every Bcap measured at a G;
  at a G one bucket reaches it is that bucket's cost exactly.
- :func:`pricing_block`: the sidecar's record of which model priced the export and at which KV.
- :func:`heldout`: the error a decision margin is compared with, of the model that prices it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from speccal.base.errors import InputError

KV_MODEL = "kv_model"
CONTEXT_FIT = "context_fit"


@dataclass(frozen=True)
class Additive:
    """Additive parameters in ms: ``bias + alpha[bcap_levels.index(b)] + theta[g_levels.index(g)]``."""

    bias_ms: float
    bcap_levels: list[int]
    alpha_ms: list[float]
    g_levels: list[int]
    theta_ms: list[float]


def uses_kv_model(table: Any, kv_length: float) -> bool:
    """True when ``table``'s lookup prices ``kv_length`` with its KV model."""
    kvm = table.kv_model
    return kvm is not None and kvm.min_kv_length <= kv_length <= kvm.max_kv_length


def _context_fit(table: Any, kv_length: float):
    f = table.fit_for(kv_length)
    if f is None:
        spans = [(x.min_kv_length, x.max_kv_length) for x in table.fits]
        raise InputError("--kv-length", kv_length, f"a KV length inside the table's {spans}")
    return f


def check_kv(table: Any, kv_length: float) -> None:
    """Refuse a KV length the table does not price (outside its KV model's span or every
    context interval)."""
    if not uses_kv_model(table, kv_length):
        _context_fit(table, kv_length)


def additive_at(table: Any, kv_length: float) -> Additive:
    """The additive parameters the lookup prices ``kv_length`` with (see module docstring).

    Raises ``InputError`` (``--kv-length``) for a KV length the table does not price.
    """
    if uses_kv_model(table, kv_length):
        kvm = table.kv_model
        bias, alpha, theta = kvm.estimator().additive_at(kv_length)
        return Additive(
            bias_ms=bias,
            bcap_levels=list(kvm.bcap_levels),
            alpha_ms=[float(a) for a in alpha],
            g_levels=list(kvm.g_levels),
            theta_ms=[float(t) for t in theta],
        )
    p = _context_fit(table, kv_length).additive
    if p is None:
        raise InputError("table.model", table.model, "additive (the fit holding --kv-length)")
    return Additive(
        p.bias_ms, list(p.bcap_levels), list(p.alpha_ms), list(p.g_levels), list(p.theta_ms)
    )


def g_curve(table: Any, kv_length: float) -> tuple[list[int], list[float]]:
    """``(G, cost_ms)`` at every captured G the lookup prices at ``kv_length``, ascending."""
    geo = table.geometry()
    if not uses_kv_model(table, kv_length):
        p = _context_fit(table, kv_length).sps
        if p is None:
            raise InputError("table.model", table.model, "sps (the fit holding --kv-length)")
        lo, hi = min(p.g_levels), max(p.g_levels)
        captured = sorted({g for gs in geo.target_rows.values() for g in gs if lo <= g <= hi})
        ms = np.interp(captured, p.g_levels, p.cost_ms)  # speccal's sps rule (ms, linear)
        return captured, [float(c) for c in ms]
    a = additive_at(table, kv_length)
    per_g: dict[int, list[float]] = {}
    for b in geo.request_buckets:
        if b not in a.bcap_levels:
            continue
        for g in geo.target_rows.get(b, []):
            if g in a.g_levels:
                cost = a.bias_ms + a.alpha_ms[a.bcap_levels.index(b)]
                per_g.setdefault(int(g), []).append(cost + a.theta_ms[a.g_levels.index(g)])
    captured = sorted(per_g)
    return captured, [float(np.median(per_g[g])) for g in captured]


def pricing_block(table: Any, kv_length: float | tuple[float, float]) -> dict[str, Any]:
    """Which model priced an export and at which KV (one length, or a ``(min, max)`` range).

    ``model``: ``kv_model`` (with its ``kv_term`` and span) when every KV length is inside its
    span, ``context_fit`` (with the intervals the KV lengths fall in) otherwise; ``mixed`` when
    a range leaves the KV model's span (the lookup calls those rounds uncalibrated).
    """
    scalar = np.isscalar(kv_length)
    lo, hi = (kv_length, kv_length) if scalar else kv_length
    kv_out: Any = float(lo) if scalar else [float(lo), float(hi)]
    kvm = table.kv_model
    if kvm is not None:
        inside = uses_kv_model(table, lo) and uses_kv_model(table, hi)
        return {
            "model": KV_MODEL if inside else "mixed",
            "kv_length": kv_out,
            "kv_term": kvm.kv_term,
            "kv_span": [kvm.min_kv_length, kvm.max_kv_length],
            "form": "bias + alpha(Bcap) + theta(G) + slope(G) * G * kv",
        }
    contexts = [
        [f.min_kv_length, f.max_kv_length]
        for f in table.fits
        if f.max_kv_length >= lo and f.min_kv_length <= hi
    ]
    return {"model": CONTEXT_FIT, "kv_length": kv_out, "fit": table.model, "contexts": contexts}


def heldout(table: Any) -> dict[str, Any]:
    """The table's fit errors per context and the one number decisions are compared with.

    ``pct``: the worst context's leave-one-point-out mean error in % (else leave-one-G-out) of
    the model the lookup prices with: the KV model's per-context errors when the table has one,
    else each context fit's.
    """
    fits = []
    for f in table.fits:
        d = f.diagnostics
        fits.append(
            {
                "kv": [f.min_kv_length, f.max_kv_length],
                "model": f.model,
                "residuals": d.residuals.model_dump(),
                "leave_one_point_out": d.leave_one_point_out.model_dump(),
                "leave_one_g_out": d.leave_one_g_out.model_dump(),
            }
        )
    out: dict[str, Any] = {"fits": fits, "metric": None, "pct": None}
    kvm = table.kv_model
    if kvm is not None:
        out["kv_model"] = {
            "kv_term": kvm.kv_term,
            "leave_one_point_out": kvm.leave_one_point_out.model_dump(),
            "leave_one_context_out": kvm.leave_one_context_out.model_dump(),
        }
        vals = [
            c.leave_one_point_out.mean_abs_pct
            for c in kvm.per_context
            if c.leave_one_point_out.mean_abs_pct is not None
        ]
        if vals:
            out["metric"] = "kv_model.per_context.leave_one_point_out.mean_abs_pct"
            out["pct"] = max(vals)
            return out
    for name in ("leave_one_point_out", "leave_one_g_out"):
        vals = [x[name]["mean_abs_pct"] for x in fits if x[name]["mean_abs_pct"] is not None]
        if vals:
            out["metric"], out["pct"] = f"{name}.mean_abs_pct", max(vals)
            break
    return out
