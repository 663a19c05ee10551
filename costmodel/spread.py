"""The KV spread term: what a round costs past its mean-KV price when its requests' KV lengths
spread.

A table prices a round at its batch's mean KV length (``speccal.costmodel.kv``): attention
reads every request's keys, so the total work follows the mean. But a request's keys are split
over a bounded number of attention programs, so the longest request sets the attention's
critical path: at one mean KV, half the requests short and half long cost more than all at the
mean (on an H100, dense-2b: 0.1-3.5 % for a two-level layout, up to 66 % for one long request
among short ones; ``bench/bench_kv_spread.py``). Calibration measures every point with the
requests' prompts at midpoint quantiles of a narrow interval (nearly uniform), so the spread a
serving batch has is not in the fits.

The calibration therefore adds one **spread point** per request bucket (``Bcap >= 2``) at every
context that can spread (``speccal.calibrate.driver.spread_contexts``): the bucket's full point
at ``k = 1`` (draft_step) or full width (target_verify), with the same mean KV as the calibrated
point but half of the requests at a quarter of it and half at seven quarters (``two_level``).
With ``excess = max KV - mean KV`` of a round (the windows' mean of the longest request's KV
minus the mean KV), the bucket's slope at that context is

``slope(c, Bcap) = (ms(spread) - ms(calibrated)) / (excess(spread) - excess(calibrated))``

(clipped at 0), and a round at mean KV ``m`` is priced

``cost(Bcap, G, m, kv_max) = cost(Bcap, G, m) + slope(m, Bcap) * max(0, (kv_max - m) -
excess_ref(m, Bcap))``

with ``excess_ref(c, Bcap)`` the calibrated point's own excess at context ``c`` (what the fits
already hold there: 0 at a context whose prompts all start alike, ~3.5 % of the mean KV at the
longest) and ``slope(m, .)``, ``excess_ref(m, .)`` linear in ``m`` between the contexts' points,
flat past the first and the last (:class:`SpreadPricer`). Both move with the mean KV: on the H100
the same two-level layout cost +8.5 % at Bcap 32 and +0.2 % at Bcap 64 at a mean of 2,174,
while the short-prompt workloads' residual sat at low KV. On the same H100 live runs of the
sweep's mixed-prompt workloads the worst replay error was 4.38 % without the term, 3.25 % with
one context's points and 2.23 % per context (bench/RESULTS.md, 0e3a505). Tables of schema
version 5 hold one context's points, which price every KV alike. A bucket
without a spread point (Bcap 1: one request has no spread) adds nothing. One slope per bucket,
not per layout: on the H100 points the extra cost per token of excess agreed between the
two-level and the one-long layout at B = 8 (0.13 / 0.14 us) but not at B = 32 (0.17-0.19 against
0.49 us: one very long request among many short ones is underpriced; ``speccal replay`` still
cautions and reports the longest-KV floor there).

Pure numpy; the table block is ``speccal.costmodel.table_schema.KVSpreadBlock``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

#: The layout the spread points are measured with (``speccal.calibrate.driver``).
SPREAD_LAYOUT = "two_level"


def split_windows(
    rows: Iterable[Mapping[str, Any]],
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """Measurement rows as ``(grid, spread)``: the spread points' windows carry a ``layout``
    (``speccal.calibrate.driver``) and share their grid twins' keys, so they are told apart by it
    (a rank's skew and the grid's fit judge the grid alone; :func:`fit_spread` takes both)."""
    grid, spread = [], []
    for r in rows:
        (spread if r.get("layout") else grid).append(r)
    return grid, spread


def _median_by_point(rows: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, float]]:
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        key = (int(r["bcap"]), int(r["g"]), int(r["k"]))
        groups.setdefault(key, []).append(r)
    out = {}
    for key, rs in groups.items():
        mean_kv = np.array([float(r["mean_kv_length"]) for r in rs])
        max_kv = np.array([float(r.get("mean_kv_max_length", np.nan)) for r in rs])
        out[key] = {
            "ms": float(np.median([float(r["step_ms"]) for r in rs])),
            "mean_kv": float(np.mean(mean_kv)),
            "excess": float(np.mean(max_kv - mean_kv)),
            "windows": len(rs),
        }
    return out


def fit_spread(
    calibrated: Iterable[Mapping[str, Any]],
    spread: Iterable[Mapping[str, Any]],
) -> dict[str, Any] | None:
    """The ``kv_spread`` table block (a plain dict) from the calibrated windows and the spread
    points' windows: one point per (context, bucket) that has both, each against its calibrated
    twin of the same context; None where none has both (or their ``mean_kv_max_length`` is
    missing). Rows are measurement rows (``step_ms``, ``mean_kv_length``,
    ``mean_kv_max_length``, ``context_index``, ``bcap``, ``g``, ``k``)."""
    calibrated, spread = list(calibrated), list(spread)
    points = []
    for ci in sorted({int(r["context_index"]) for r in spread}):
        base = _median_by_point(r for r in calibrated if int(r["context_index"]) == ci)
        wide = _median_by_point(r for r in spread if int(r["context_index"]) == ci)
        for key in sorted(wide):
            if key not in base:
                continue
            b, s = base[key], wide[key]
            d_excess = s["excess"] - b["excess"]
            if not (np.isfinite(d_excess) and d_excess > 0):
                continue
            slope = max(0.0, (s["ms"] - b["ms"]) / d_excess)
            points.append({
                "context_index": ci, "bcap": key[0], "g": key[1], "k": key[2],
                "mean_kv_length": b["mean_kv"],
                "calibrated_excess": b["excess"], "spread_excess": s["excess"],
                "calibrated_ms": b["ms"], "spread_ms": s["ms"],
                "slope_ms_per_token": slope,
                "windows": s["windows"],
            })
    if not points:
        return None
    return {"layout": SPREAD_LAYOUT, "points": points}


class SpreadPricer:
    """``extra_ms(bcap, kv_mean, kv_max)``: the spread term of a table's ``kv_spread`` block
    (module docstring), vectorised and broadcasting; 0 for a bucket without a spread point.

    A bucket with spread points at several mean KV lengths (one per context) takes its slope and
    its reference excess piecewise linearly in the round's mean KV between them, held flat past
    the first and the last (``numpy.interp``); with one point both are that point's."""

    def __init__(self, block: Any):
        """``block``: a ``KVSpreadBlock`` (its ``points``)."""
        by_bcap: dict[int, list[tuple[float, float, float]]] = {}
        for p in block.points:
            by_bcap.setdefault(int(p.bcap), []).append(
                (float(p.mean_kv_length), float(p.slope_ms_per_token), float(p.calibrated_excess)))
        self._curves = {b: tuple(np.array(col) for col in zip(*sorted(pts), strict=True))
                        for b, pts in by_bcap.items()}

    def extra_ms(self, bcap: Any, kv_mean: Any, kv_max: Any) -> np.ndarray:
        b, mean, top = np.broadcast_arrays(np.asarray(bcap, dtype=np.int64),
                                           np.asarray(kv_mean, dtype=np.float64),
                                           np.asarray(kv_max, dtype=np.float64))
        slope = np.zeros(b.shape)
        ref = np.zeros(b.shape)
        for bucket, (means, slopes, refs) in self._curves.items():
            at = b == bucket
            if at.any():
                slope[at] = np.interp(mean[at], means, slopes)
                ref[at] = np.interp(mean[at], means, refs)
        return slope * np.maximum(0.0, (top - mean) - ref)
