"""SGLang: the DSpark planner's cost table (``--speculative-dspark-sps-table-path``).

SGLang loads one of two JSON documents (``python/sglang/srt/speculative/dspark_components/
dspark_sps_table.py``, ``load_sps_table_from_path``: additive when the text holds
``"bias_seconds"``, else SPS), and its verify-budget planner (``dspark_planner.py``,
``compute_verify_token_budget``) prices a step of ``num_reqs`` requests verifying
``budget`` extra draft tokens, i.e. ``M = num_reqs + budget`` verify tokens:

- ``SpsCostTable {sample_batch_tokens: [int], sample_steps_per_sec: [float],
  max_batch_tokens: int}``: steps **per second** at ``M`` batch tokens, read as a step function
  (``lookup``: the largest probe ``<= M``, the first probe below it); probes strictly
  increasing, one rate per probe, ``max_batch_tokens >= `` the largest probe; a table of one
  probe is SGLang's "uninitialized" flat table (verify-all), so speccal writes at least two.
- ``SpsAdditiveCostTable {bias_seconds, bs_probes, alpha_seconds, m_probes, theta_seconds}``:
  **seconds**, ``step_time = bias + alpha(num_reqs) + theta(num_reqs + budget)``, each term
  linearly interpolated between probes and clamped outside them; probes strictly increasing,
  one value each, ``bias_seconds > 0``.

speccal maps a ``target_verify`` table onto them (the planner trims the verify budget with the
draft at full width: the same experiment): ``bs`` is the request axis (speccal ``Bcap``), ``M``
the verify-row axis (speccal ``G``), ms become s (additive) or steps/s (``1000 / cost_ms``,
SPS). SGLang's table has no KV axis: the file prices one KV length as speccal's lookup does
(``speccal.interop.pricing``: a table's KV model at that KV is additive, its slope term joining
``theta(M)``; without one, the fit of the interval holding it). speccal pads a batch to its captured bucket (``Bcap``, ``G``); SGLang interpolates (and
floors, for SPS), so speccal writes each level as a staircase: a probe at the first integer the
level serves (``previous level + 1``) and one at the level itself, both with the level's value,
so integer lookups between levels get the padded cost. :func:`fidelity` compares SGLang's
reading of the file with the table at every integer ``(num_reqs, M)`` the table prices. The
costs are full-step costs (draft + verify); SGLang's own profiler (``sglang.benchmark.
dspark_sps_profiler``) profiles a live DSpark server as well (static ragged verify, simulated
acceptance length 1, ``1 / median`` server-side step time). SGLang's table carries no model,
device or version metadata: the sidecar is where they live. SGLang's EAGLE / MTP adaptive
steps are ``speccal.interop.sglang_adaptive``.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from speccal.base.errors import InputError
from speccal.interop import pricing
from speccal.interop.report import Rendered
from speccal.policy import CostModel

ENGINE = "sglang"
ADDITIVE = "SpsAdditiveCostTable"
SPS = "SpsCostTable"

MATCHED = [
    {
        "repo": "sgl-project/sglang",
        "path": "python/sglang/srt/speculative/dspark_components/dspark_sps_table.py",
        "functions": [
            "SpsCostTable.__post_init__",
            "SpsCostTable.lookup",
            "floor_probe_index",
            "SpsAdditiveCostTable.__post_init__",
            "SpsAdditiveCostTable.step_time",
            "load_sps_table_from_path",
            "is_uninitialized_sps_table",
        ],
        "commit": "692c5f7d532f129424b57961c262bbd253b411dc",
    },
    {
        "repo": "sgl-project/sglang",
        "path": "python/sglang/srt/speculative/dspark_components/dspark_planner.py",
        "functions": ["compute_verify_token_budget", "build_sps_cost_table"],
        "commit": "45fb003a819aa4b25053bc28311c00592b145153",
    },
]

K0_MEANING = (
    "budget 0: verify only the anchor token of each request (M = num_reqs); the DSpark draft "
    "still runs its full block"
)


def staircase(levels: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    """Probes ``previous + 1`` and ``level`` per level, both at the level's value (ascending,
    distinct): interpolation or floor lookup then returns the padded level's value at every
    integer."""
    xs: list[int] = []
    ys: list[float] = []
    prev = 0
    for lv, v in zip(levels, values, strict=True):
        for x in (prev + 1, lv) if prev + 1 < lv else (lv,):
            xs.append(int(x))
            ys.append(float(v))
        prev = lv
    return xs, ys


def render(table: Any, kv_length: float, sidecar_name: str) -> Rendered:
    """The DSpark cost table JSON of a ``target_verify`` table priced at ``kv_length``.

    The costs are the table's lookup at that KV (``speccal.interop.pricing``): its KV model
    when it has one and ``kv_length`` is in its span, else the fit of the interval holding it.
    """
    if table.mode != "target_verify":
        raise InputError(
            "table.mode",
            table.mode,
            "target_verify (SGLang's planner trims the verify budget with the draft at full "
            "width; a draft_step table prices k draft forwards into its G axis)",
        )
    dp = table.compatibility.topology.dp
    if isinstance(dp, int) and dp != 1:
        raise InputError("table.compatibility.topology.dp", dp, "1 (SGLang DSpark needs dp_size 1)")
    pricing.check_kv(table, kv_length)
    geo = table.geometry()
    if table.model == "additive":
        p = pricing.additive_at(table, kv_length)
        bs = [b for b in p.bcap_levels if b in geo.request_buckets]
        alpha = [p.alpha_ms[p.bcap_levels.index(b)] / 1000.0 for b in bs]
        bs_probes, alpha_s = staircase(bs, alpha)
        m_probes, theta_s = staircase(list(p.g_levels), [t / 1000.0 for t in p.theta_ms])
        doc: dict[str, Any] = {
            "bias_seconds": p.bias_ms / 1000.0,
            "bs_probes": bs_probes,
            "alpha_seconds": alpha_s,
            "m_probes": m_probes,
            "theta_seconds": theta_s,
        }
        kind = ADDITIVE
        if not doc["bias_seconds"] > 0:
            raise InputError(
                "table.kv_model"
                if pricing.uses_kv_model(table, kv_length)
                else "table.fits.additive.bias_ms",
                p.bias_ms,
                f"> 0 at KV {kv_length} (SGLang requires bias_seconds > 0)",
            )
    else:
        captured, ms = pricing.g_curve(table, kv_length)
        # A floor lookup needs one probe per level, at the first integer the level serves.
        probes, rates, prev = [], [], 0
        for g, c in zip(captured, ms, strict=True):
            probes.append(prev + 1)
            rates.append(1000.0 / float(c))
            prev = g
        if len(probes) < 2:
            raise InputError(
                "table.fits.sps.g_levels",
                captured,
                "at least two G levels (SGLang reads a one-probe table as uninitialized)",
            )
        doc = {
            "sample_batch_tokens": probes,
            "sample_steps_per_sec": rates,
            "max_batch_tokens": int(captured[-1]),
        }
        kind = SPS
    text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    fid = fidelity(doc, CostModel.from_table(table), kv_length)
    if fid["nonpositive"]:
        raise InputError(
            "table",
            f"{fid['nonpositive']} (num_reqs, M) points",
            "a positive SGLang step time everywhere the table is calibrated",
        )
    return Rendered(
        engine=ENGINE,
        format=kind,
        text=text,
        document=doc,
        decisions={},
        adjustments=[],
        notes=[
            K0_MEANING,
            _context_note(table, kv_length, kind),
            "outside the calibrated probes SGLang clamps to the nearest probe (speccal calls "
            "those points uncalibrated)",
            f"units: {'seconds' if kind == ADDITIVE else 'steps per second'}; request axis = "
            "num_reqs (speccal Bcap), token axis M = num_reqs + budget (speccal G)",
        ],
        fidelity=fid,
        sidecar_name=sidecar_name,
    )


def _context_note(table: Any, kv_length: float, kind: str) -> str:
    if pricing.uses_kv_model(table, kv_length):
        kvm = table.kv_model
        note = (
            f"context: the table's KV model ({kvm.kv_term} slope, span {kvm.min_kv_length}.."
            f"{kvm.max_kv_length}) at KV {kv_length:g} (SGLang's table has no KV axis)"
        )
        if kind == SPS:
            note += ": a G several request buckets reach takes the median of their costs"
        else:
            note += ": theta(M) carries the slope term slope(G) * G * kv"
        return note
    f = table.fit_for(kv_length)
    return (
        f"context: the table's fit for KV {f.min_kv_length}..{f.max_kv_length} (SGLang's "
        "table has no KV axis)"
    )


def _interp_clamped(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    hi = bisect.bisect_right(xs, x)
    lo = hi - 1
    return ys[lo] + (x - xs[lo]) / (xs[hi] - xs[lo]) * (ys[hi] - ys[lo])


def step_seconds(doc: Mapping[str, Any], num_reqs: int, batch_tokens: int) -> float:
    """SGLang's step time in s for ``num_reqs`` requests and ``M = batch_tokens`` (its rule)."""
    if "bias_seconds" in doc:
        return (
            doc["bias_seconds"]
            + _interp_clamped(doc["bs_probes"], doc["alpha_seconds"], float(num_reqs))
            + _interp_clamped(doc["m_probes"], doc["theta_seconds"], float(batch_tokens))
        )
    probes = doc["sample_batch_tokens"]
    idx = max(0, min(bisect.bisect_right(probes, batch_tokens) - 1, len(probes) - 1))
    return 1.0 / doc["sample_steps_per_sec"][idx]


def fidelity(doc: Mapping[str, Any], cost: CostModel, kv_length: float) -> dict[str, Any]:
    """SGLang's reading of ``doc`` vs the table at every integer ``(num_reqs, M)`` it prices."""
    geo = cost.geometry
    w = geo.draft_width
    worst = (0.0, None)
    n = nonpositive = 0
    for b in range(1, geo.request_buckets[-1] + 1):
        bcap = int(cost.bcap(np.array([b]))[0])
        for m in range(b, b * (w + 1) + 1):
            g = int(cost.g(np.array([bcap]), np.array([m]))[0])
            ours = float(cost.lookup(np.array([bcap]), np.array([g]), np.array([kv_length]))[0])
            if not math.isfinite(ours):
                continue
            theirs = 1000.0 * step_seconds(doc, b, m)
            n += 1
            if theirs <= 0:
                nonpositive += 1
                continue
            rel = abs(theirs / ours - 1.0) * 100.0
            if rel > worst[0] or worst[1] is None:
                worst = (rel, {"num_reqs": b, "M": m, "speccal_ms": ours, "sglang_ms": theirs})
    return {
        "points": n,
        "max_abs_diff_pct": worst[0] if n else None,
        "worst_point": worst[1],
        "nonpositive": nonpositive,
        "rule": "speccal pads (Bcap, G) to captured buckets; SGLang interpolates its probes",
    }
