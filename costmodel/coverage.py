"""What a table leaves unpriced of an engine's captured geometry (no torch).

A lookup outside the table's request buckets, target rows or calibrated KV span is
"uncalibrated": the policies then fall back to full width, round after round, without a word
(the table was calibrated on buckets 1, 2, 4, 8 while the engine captured 1..32: 62 of 70
adaptive rounds of a 12-request batch ran unpriced). :func:`coverage_gaps` names what is
missing; :func:`warn_coverage` says it once, as a :class:`CoverageWarning`, when a table is put
to work on an engine (``speccal bench --policy``, ``speccal calibrate --cost-table``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from speccal.base.geometry import Geometry
from speccal.costmodel.compat import SpeccalWarning


class CoverageWarning(SpeccalWarning):
    """The table does not price every shape the engine captured."""


@dataclass(frozen=True)
class CoverageGaps:
    """Missing coverage of an engine's geometry.

    Attributes
    ----------
    request_buckets : the engine's request buckets the table has no cost for.
    target_rows : ``{bcap: [g, ...]}`` target buckets of calibrated request buckets that the
        table does not price.
    kv : ``(lo, hi)`` KV lengths of the engine's context (``1..max_model_len``) outside every
        calibrated interval, merged into ranges.
    """

    request_buckets: tuple[int, ...]
    target_rows: dict[int, tuple[int, ...]]
    kv: tuple[tuple[int, int], ...]

    def __bool__(self) -> bool:
        return bool(self.request_buckets or self.target_rows or self.kv)

    def describe(self) -> str:
        """One line naming every gap."""
        parts = []
        if self.request_buckets:
            parts.append(f"request buckets {list(self.request_buckets)} (batches there run "
                         "uncalibrated, at full width)")
        if self.target_rows:
            rows = "; ".join(f"Bcap {b}: G {list(gs)}" for b, gs in sorted(self.target_rows.items()))
            parts.append(f"target rows {rows}")
        if self.kv:
            spans = ", ".join(f"{lo}..{hi}" for lo, hi in self.kv)
            parts.append(f"KV {spans}")
        return "; ".join(parts)


def coverage_gaps(table, engine: Geometry) -> CoverageGaps:
    """What ``table`` (a :class:`~speccal.costmodel.table_schema.CostTable`) does not price of
    the ``engine``'s captured geometry: request buckets, target rows and KV span (the engine's
    model context against the table's calibrated intervals)."""
    lookup = table.lookup()
    mine = table.geometry()
    measured_b = set(table.fits[0].bcap_levels()) if table.fits else set()
    for fit in table.fits[1:]:
        measured_b &= set(fit.bcap_levels())
    missing_b = tuple(b for b in engine.request_buckets
                      if b not in mine.request_buckets or b not in measured_b)
    missing_g: dict[int, tuple[int, ...]] = {}
    kv_probe = _a_calibrated_kv(table)
    for b in engine.request_buckets:
        if b in missing_b or kv_probe is None:
            continue
        gs = tuple(sorted({g for g, k in producible(engine, b, table.mode)
                           if not lookup.cost_ms(b, g, kv_probe, k).calibrated}))
        if gs:
            missing_g[b] = gs
    spans = sorted((f.min_kv_length, f.max_kv_length) for f in table.fits)
    kv_gaps, start = [], 1
    for lo, hi in spans:
        if lo > start:
            kv_gaps.append((start, lo - 1))
        start = max(start, hi + 1)
    if engine.max_model_len and start <= engine.max_model_len:
        kv_gaps.append((start, int(engine.max_model_len)))
    return CoverageGaps(missing_b, missing_g, tuple(kv_gaps))


def producible(engine: Geometry, bcap: int, mode: str) -> list[tuple[int, int | None]]:
    """The ``(G, k)`` shapes a round of the table's mode can run at ``bcap``: in ``draft_step``
    full verification of ``k >= 1`` drafts by every batch the bucket holds (``B`` in (previous
    bucket, ``Bcap``], ``G = pad(B * (k + 1))``: partly filled buckets verify other G), in
    ``target_verify`` every bucket from ``Bcap`` up (trimmed budgets; ``k`` is always ``w``)."""
    if mode != "draft_step":
        return [(g, None) for g in engine.target_rows.get(bcap, ()) if g >= bcap]
    return [(g, k) for g, k, _ in engine.draft_step_shapes(bcap)]


def _a_calibrated_kv(table) -> int | None:
    """A KV length inside the table's first calibrated interval (None without fits)."""
    if not table.fits:
        return None
    f = table.fits[0]
    return (f.min_kv_length + f.max_kv_length) // 2


def warn_coverage(table, engine: Geometry, *, source: str = "cost table") -> CoverageGaps:
    """Warn once (:class:`CoverageWarning`) naming what ``table`` leaves unpriced of the
    engine's geometry; returns the gaps (empty when the table covers everything)."""
    gaps = coverage_gaps(table, engine)
    if gaps:
        warnings.warn(
            f"{source} does not price every shape this engine captured: {gaps.describe()}; "
            "calibrate those buckets (speccal calibrate on this engine) to price them",
            CoverageWarning,
            stacklevel=2,
        )
    return gaps
