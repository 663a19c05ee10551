"""Versioned cost tables: build, save, load (with migration and compatibility checks), look up.

A table is one JSON document (schema version 1, JSON Schema committed under
``tables/schema/cost_table.v1.schema.json``)::

    {"schema_version": 1,
     "calibration": {...effective config: model, draft_width, mode, request_buckets,
                     target_graph_rows, contexts, warmup_steps, window_steps,
                     windows_per_point, token_seed, policy, sources},
     "compatibility": {...see speccal.costmodel.compat},
     "geometry": {...speccal.geometry.Geometry.to_dict()},
     "fits": [{context_index, prefill_tokens, min_kv_length, max_kv_length, model, combine,
               "additive": {bias_ms, bcap_levels, alpha_ms, g_levels, theta_ms, reference}
                 or "sps": {g_levels, cost_ms, bcap_levels},
               "windows": [raw measured windows, so the table can be refitted],
               "diagnostics": {residuals, leave_one_point_out, leave_one_g_out, points}}],
     "provenance": {speccal_version, created, command, python_version, torch_version,
                    driver_version, migrated_from}}

Costs are in milliseconds per full step. Files are written canonically (sorted keys,
``allow_nan=False``) and atomically, so save -> load -> save is byte-identical.

Loading: no ``schema_version`` is a legacy (unversioned) table, migrated forward (a missing
``draft_width`` means 7, a missing geometry is rebuilt from the fits); a newer version is refused
with ``SchemaError``; unreadable JSON and unknown keys are ``SchemaError``; with ``expect`` the
compatibility metadata is checked (``speccal.costmodel.compat``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import warnings
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from speccal import __version__
from speccal.atomic import dumps_json, write_json_atomic
from speccal.costmodel.additive import AdditiveCostModel, level_lookup
from speccal.costmodel.compat import (
    Compatibility,
    SpeccalWarning,
    as_compatibility,
    check_compatibility,
)
from speccal.costmodel.diagnostics import diagnose
from speccal.costmodel.grid import check_contexts
from speccal.costmodel.measurements import context_intervals, validate_measurements
from speccal.costmodel.sps import SPSCostModel, sps_interp
from speccal.errors import GridError, InputError, SchemaError
from speccal.geometry import Geometry, default_target_rows

SCHEMA_VERSION = 1
LEGACY_DRAFT_WIDTH = 7
MODELS = ("additive", "sps")
SCHEMA_PATH = (
    Path(__file__).resolve().parent.parent / "tables" / "schema" / "cost_table.v1.schema.json"
)
#: Reason a lookup gives for a cell whose fitted cost is zero or negative (not a physical cost).
NOT_POSITIVE = "fitted cost not positive"
#: Cells listed by name in a :class:`NonPositiveCostWarning` before "... and N more".
MAX_LISTED_CELLS = 12


class NonPositiveCostWarning(SpeccalWarning):
    """A fit predicts a zero or negative step cost at a calibrated cell (listed in the message).

    Such cells are uncalibrated at lookup (:meth:`CostTable.cost_ms` says
    ``"fitted cost not positive"``; :meth:`CostTable.cost_surface` is NaN there).
    """


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- calibration config block


class ContextInterval(_Strict):
    prefill_tokens: int = Field(ge=0)
    min_kv_length: int = Field(ge=0)
    max_kv_length: int = Field(ge=0)


class PolicyConfig(_Strict):
    """Adaptive-draft-step policy block (defaults from the xLLM seed)."""

    window_size: int = Field(default=20, ge=1)
    update_interval: int = Field(default=5, ge=1)
    switch_min_gain: float = Field(default=0.05, ge=0.0)


class CalibrationConfig(_Strict):
    """The effective calibration config a table was measured with (defaults filled in).

    ``sources`` maps each key to where its value came from (free-form; ``speccal.calibrate``
    writes ``default``/``file``/``flag``/``run``; a table built from bare rows writes
    ``default``, ``measurements``, ``compatibility`` or ``caller``).
    """

    model: Literal["additive", "sps"] = "additive"
    draft_width: int = Field(ge=1)
    mode: Literal["draft_step", "target_verify"] = "draft_step"
    request_buckets: list[int]
    target_graph_rows: dict[int, list[int]]
    contexts: list[ContextInterval]
    warmup_steps: int = Field(default=8, ge=0)
    window_steps: int = Field(default=32, ge=1)
    windows_per_point: int = Field(default=3, ge=1)
    token_seed: int = 1
    policy: PolicyConfig | None = None
    sources: dict[str, str] = Field(default_factory=dict)


class GeometryBlock(_Strict):
    draft_width: int = Field(ge=1)
    request_buckets: list[int]
    target_rows: dict[int, list[int]]
    kv_capacity_tokens: int = Field(default=0, ge=0)
    max_model_len: int = Field(default=0, ge=0)
    block_size: int = Field(default=16, ge=1)


# ---------------------------------------------------------------- fits


class AdditiveParams(_Strict):
    bias_ms: float
    bcap_levels: list[int]
    alpha_ms: list[float]
    g_levels: list[int]
    theta_ms: list[float]
    reference: Literal["smallest_bcap_and_g"] = "smallest_bcap_and_g"


class SPSParams(_Strict):
    g_levels: list[int]
    cost_ms: list[float]
    bcap_levels: list[int]  # coverage: request buckets the curve was measured with


class Window(_Strict):
    """One raw measured window (the context columns live on the enclosing fit)."""

    bcap: int
    num_requests: int
    g: int
    k: int
    window_index: int
    window_steps: int
    elapsed_s: float
    step_ms: float
    mean_kv_length: float


class ErrorBlock(_Strict):
    n_evaluated: int
    n_skipped: int
    mae_ms: float | None
    rmse_ms: float | None
    max_abs_ms: float | None
    mean_abs_pct: float | None
    max_abs_pct: float | None


class PointBlock(_Strict):
    bcap: int
    g: int
    n_windows: int
    step_ms: float
    spread_ms: float
    predicted_ms: float | None
    residual_ms: float | None
    residual_pct: float | None
    lopo_ms: float | None
    logo_ms: float | None


class DiagnosticsBlock(_Strict):
    residuals: ErrorBlock
    leave_one_point_out: ErrorBlock
    leave_one_g_out: ErrorBlock
    points: list[PointBlock]


class ContextFit(_Strict):
    context_index: int = Field(ge=0)
    prefill_tokens: int = Field(ge=0)
    min_kv_length: int = Field(ge=0)
    max_kv_length: int = Field(ge=0)
    model: Literal["additive", "sps"]
    combine: Literal["median", "mean"] = "median"
    additive: AdditiveParams | None = None
    sps: SPSParams | None = None
    windows: list[Window]
    diagnostics: DiagnosticsBlock

    def estimator(self) -> AdditiveCostModel | SPSCostModel:
        """Rebuild the fitted sklearn estimator from the stored parameters."""
        if self.model == "additive":
            p = self.additive
            return AdditiveCostModel.from_params(
                p.bias_ms, p.bcap_levels, p.alpha_ms, p.g_levels, p.theta_ms, combine=self.combine
            )
        p = self.sps
        return SPSCostModel.from_params(p.g_levels, p.cost_ms, combine=self.combine)

    def bcap_levels(self) -> list[int]:
        return (self.additive or self.sps).bcap_levels


class Provenance(_Strict):
    speccal_version: str
    created: str
    command: str | None = None
    python_version: str | None = None
    torch_version: str | None = None
    driver_version: str | None = None
    migrated_from: str | None = None

    @classmethod
    def now(cls, command: str | None = None, **versions: str | None) -> Provenance:
        """Provenance of a table built now by this process (torch version only if imported)."""
        torch = sys.modules.get("torch")
        return cls(
            speccal_version=__version__,
            created=datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
            command=command,
            python_version=platform.python_version(),
            torch_version=versions.pop("torch_version", None)
            or getattr(torch, "__version__", None),
            **versions,
        )

    def versions(self) -> dict[str, str | None]:
        return {
            "speccal_version": self.speccal_version,
            "torch_version": self.torch_version,
            "driver_version": self.driver_version,
        }


class CostLookup(NamedTuple):
    """Answer of :meth:`CostTable.cost_ms`: NaN cost and a reason when uncalibrated."""

    cost_ms: float
    calibrated: bool
    reason: str | None


# ---------------------------------------------------------------- the table


class CostTable(_Strict):
    """A versioned, immutable-by-convention cost table (see module docstring for layout)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    calibration: CalibrationConfig
    compatibility: Compatibility
    # Stored under the JSON key "geometry"; the attribute name leaves ``geometry()`` free for the
    # method returning ``speccal.geometry.Geometry`` (the package contract).
    geometry_block: GeometryBlock = Field(alias="geometry")
    fits: list[ContextFit] = Field(min_length=1)
    provenance: Provenance

    _surface: Callable | None = PrivateAttr(default=None)
    _raw_surface: Callable | None = PrivateAttr(default=None)

    # -- identity
    @property
    def mode(self) -> str:
        """``draft_step`` (points at G = Bcap*(k+1)) or ``target_verify`` (trimmed verify budget)."""
        return self.calibration.mode

    @property
    def model(self) -> str:
        return self.calibration.model

    @property
    def draft_width(self) -> int:
        return self.compatibility.draft_width

    def geometry(self) -> Geometry:
        """The captured geometry the table was calibrated on (``speccal.geometry.Geometry``)."""
        return Geometry.from_dict(self.geometry_block.model_dump())

    # -- lookup
    def fit_for(self, kv_length: float) -> ContextFit | None:
        """The fit whose context interval holds ``kv_length`` (inclusive), or None."""
        for f in self.fits:
            if f.min_kv_length <= kv_length <= f.max_kv_length:
                return f
        return None

    def cost_surface(self) -> Callable[[Any, Any, Any], np.ndarray]:
        """A vectorised ``f(bcap, g, kv_length) -> ndarray`` of ms (NaN = uncalibrated).

        Arguments broadcast against each other. Built once per table and cached; it captures
        plain numpy arrays only (no pydantic objects) so replay can call it 10^6 times cheaply.
        A cell whose fitted cost is not positive is NaN (uncalibrated): a step cost is physical,
        and a policy dividing by a negative cost would prefer exactly the cell the fit got wrong.
        """
        if self._surface is None:
            self._surface = _build_surface(self, positive_only=True)
        return self._surface

    def _fitted_surface(self) -> Callable[[Any, Any, Any], np.ndarray]:
        """:meth:`cost_surface` without the positivity mask (what the fits predict)."""
        if self._raw_surface is None:
            self._raw_surface = _build_surface(self, positive_only=False)
        return self._raw_surface

    def cost_ms(self, bcap: int, g: int, kv_length: float) -> CostLookup:
        """Full-step cost in ms at ``(bcap, g)`` and ``kv_length``, or an explicit uncalibrated answer.

        Reasons: KV length outside every context interval; Bcap not a calibrated request bucket;
        G not a captured target bucket of that Bcap; G not a calibrated level (additive) or
        outside the measured G range (sps); the fitted cost is not positive (``"fitted cost
        not positive"``, with the predicted value).
        """
        reason = self._uncalibrated_reason(bcap, g, kv_length)
        if reason is not None:
            return CostLookup(math.nan, False, reason)
        value = float(self._fitted_surface()(bcap, g, kv_length))
        if not value > 0:
            return CostLookup(
                math.nan,
                False,
                f"{NOT_POSITIVE} ({value:.3f} ms at bcap {bcap}, g {g}): the {self.model} fit "
                "is not physical here",
            )
        return CostLookup(value, True, None)

    def nonpositive_cells(self) -> list[dict[str, Any]]:
        """Calibrated cells where a fit predicts a step cost ``<= 0`` ms, per context interval.

        Every captured ``(bcap, g)`` of the geometry that would otherwise be calibrated is
        checked (a fit is constant over its KV interval). Returns one dict per cell:
        ``context_index, min_kv_length, max_kv_length, bcap, g, cost_ms, measured``.
        """
        # A fresh surface, not the cache: build_table calls this, and a cached callable would
        # make the new table compare unequal to the same table parsed back from its JSON.
        raw = _build_surface(self, positive_only=False)
        cells = []
        for f in self.fits:
            measured = {(p.bcap, p.g) for p in f.diagnostics.points}
            for b in f.bcap_levels():
                for g in self.geometry_block.target_rows.get(b, []):
                    if self._uncalibrated_reason(b, g, f.min_kv_length) is not None:
                        continue
                    value = float(raw(b, g, f.min_kv_length))
                    if not value > 0:
                        cells.append(
                            {
                                "context_index": f.context_index,
                                "min_kv_length": f.min_kv_length,
                                "max_kv_length": f.max_kv_length,
                                "bcap": b,
                                "g": g,
                                "cost_ms": value,
                                "measured": (b, g) in measured,
                            }
                        )
        return cells

    def _uncalibrated_reason(self, bcap: int, g: int, kv_length: float) -> str | None:
        fit = self.fit_for(kv_length)
        if fit is None:
            spans = [[f.min_kv_length, f.max_kv_length] for f in self.fits]
            return f"kv_length {kv_length} outside every calibrated context interval {spans}"
        levels = fit.bcap_levels()
        if bcap not in levels:
            return f"bcap {bcap} is not a calibrated request bucket (calibrated: {levels})"
        rows = self.geometry_block.target_rows.get(bcap, [])
        if g not in rows:
            return f"g {g} is not a captured target bucket of bcap {bcap} (captured: {rows})"
        if fit.model == "additive":
            if g not in fit.additive.g_levels:
                return (
                    f"g {g} is not a calibrated target bucket (calibrated: {fit.additive.g_levels})"
                )
        else:
            lo, hi = fit.sps.g_levels[0], fit.sps.g_levels[-1]
            if not lo <= g <= hi:
                return f"g {g} is outside the calibrated range [{lo}, {hi}] (no extrapolation)"
        return None

    # -- data
    def measurements(self) -> pd.DataFrame:
        """The raw measured windows of every fit as a measurement DataFrame (for refitting)."""
        rows = []
        for f in self.fits:
            for w in f.windows:
                rows.append(
                    {
                        "context_index": f.context_index,
                        "prefill_tokens": f.prefill_tokens,
                        "min_kv_length": f.min_kv_length,
                        "max_kv_length": f.max_kv_length,
                        **w.model_dump(),
                        "warmup_steps": self.calibration.warmup_steps,
                        "mode": self.calibration.mode,
                    }
                )
        return validate_measurements(pd.DataFrame(rows))

    def to_json_dict(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, no NaN), exactly what :func:`save_table` writes."""
        return dumps_json(self.to_json_dict())


def _build_surface(
    table: CostTable, *, positive_only: bool
) -> Callable[[Any, Any, Any], np.ndarray]:
    geom = table.geometry_block
    gmax = max((max(v) for v in geom.target_rows.values() if v), default=0) + 1
    legal = np.array(
        sorted(b * gmax + g for b, rows in geom.target_rows.items() for g in rows), dtype=np.float64
    )
    parts = []
    for f in table.fits:
        if f.model == "additive":
            p = f.additive
            parts.append(
                (
                    float(f.min_kv_length),
                    float(f.max_kv_length),
                    "additive",
                    (
                        p.bias_ms,
                        np.asarray(p.bcap_levels, dtype=np.float64),
                        np.asarray(p.alpha_ms, dtype=np.float64),
                        np.asarray(p.g_levels, dtype=np.float64),
                        np.asarray(p.theta_ms, dtype=np.float64),
                    ),
                )
            )
        else:
            p = f.sps
            parts.append(
                (
                    float(f.min_kv_length),
                    float(f.max_kv_length),
                    "sps",
                    (
                        np.asarray(p.bcap_levels, dtype=np.float64),
                        np.asarray(p.g_levels, dtype=np.float64),
                        np.asarray(p.cost_ms, dtype=np.float64),
                    ),
                )
            )

    def surface(bcap, g, kv_length) -> np.ndarray:
        b, gg, kv = np.broadcast_arrays(
            np.asarray(bcap, dtype=np.float64),
            np.asarray(g, dtype=np.float64),
            np.asarray(kv_length, dtype=np.float64),
        )
        out = np.full(b.shape, np.nan)
        for lo, hi, kind, arrs in parts:
            m = (kv >= lo) & (kv <= hi)
            if not m.any():
                continue
            bm, gm = b[m], gg[m]
            if kind == "additive":
                bias, bl, alpha, gl, theta = arrs
                out[m] = bias + level_lookup(bm, bl, alpha) + level_lookup(gm, gl, theta)
            else:
                bl, gl, cost = arrs
                ok_b = level_lookup(bm, bl, np.zeros(len(bl)))  # 0 where calibrated, NaN where not
                out[m] = sps_interp(gm, gl, cost) + ok_b
        key = b * gmax + gg
        idx = np.clip(np.searchsorted(legal, key), 0, max(len(legal) - 1, 0))
        is_legal = (legal[idx] == key) if len(legal) else np.zeros(b.shape, dtype=bool)
        out[~is_legal] = np.nan
        if positive_only:
            out[~(out > 0)] = np.nan  # NaN stays NaN; zero and negative fitted costs join it
        return out if out.ndim else out[()]

    return surface


# ---------------------------------------------------------------- build


def build_table(
    measurements: pd.DataFrame,
    *,
    model: str | None = None,
    compatibility: Compatibility | Mapping[str, Any],
    calibration: CalibrationConfig | Mapping[str, Any] | None = None,
    geometry: Geometry | Mapping[str, Any] | None = None,
    provenance: Provenance | Mapping[str, Any] | None = None,
    combine: str = "median",
) -> CostTable:
    """Fit one model per context interval and assemble a validated :class:`CostTable`.

    Parameters
    ----------
    measurements : measurement rows (see ``speccal.costmodel.measurements``).
    model : ``additive`` or ``sps``; default ``calibration.model``, else ``additive``.
    compatibility : the run's compatibility metadata (``Engine.compatibility()`` dict).
    calibration : the effective calibration config; default: read back from the rows
        (``sources`` say ``measurements`` or ``default``).
    geometry : the captured geometry; default: the measured Bcaps, each with its measured G plus
        its default legal buckets (``speccal.geometry.default_target_rows``).
    provenance : default: :meth:`Provenance.now`.
    combine : how repeated windows are combined (``median``, ``mean``).

    Raises
    ------
    InputError, GridError
        Bad rows, overlapping contexts, a disconnected additive grid, inconsistent draft widths.

    Warns
    -----
    NonPositiveCostWarning
        A fit predicts a zero or negative step cost at calibrated cells (listed; see
        :meth:`CostTable.nonpositive_cells`). The table is still built; those cells look up
        as uncalibrated.
    """
    df = validate_measurements(measurements)
    compat = as_compatibility(compatibility)
    w = compat.draft_width
    cal = _calibration(df, calibration, model, w)
    model = cal.model
    if cal.draft_width != w:
        raise InputError(
            "calibration.draft_width", cal.draft_width, f"compatibility.draft_width = {w}"
        )
    if cal.mode == "draft_step" and int(df["k"].max()) > w:
        raise InputError("measurements.k", int(df["k"].max()), f"k <= draft_width = {w}")
    geom = _geometry(df, geometry, w)
    if provenance is None:
        prov = Provenance.now()
    elif isinstance(provenance, Provenance):
        prov = provenance
    else:
        prov = Provenance.model_validate(dict(provenance))

    fits = []
    for ci, (prefill, lo, hi) in sorted(context_intervals(df).items()):
        windows = df[df["context_index"] == ci].reset_index(drop=True)
        X = windows[["bcap", "g"]].to_numpy(dtype=np.float64)
        y = windows["step_ms"].to_numpy(dtype=np.float64)
        est = (AdditiveCostModel if model == "additive" else SPSCostModel)(combine=combine)
        est.fit(X, y)
        diag = diagnose(est, windows)
        bcaps = sorted(int(b) for b in windows["bcap"].unique())
        params: dict[str, Any] = {}
        if model == "additive":
            params["additive"] = AdditiveParams(
                bias_ms=est.bias_ms_,
                bcap_levels=est.bcap_levels_.tolist(),
                alpha_ms=est.alpha_ms_.tolist(),
                g_levels=est.g_levels_.tolist(),
                theta_ms=est.theta_ms_.tolist(),
            )
        else:
            params["sps"] = SPSParams(
                g_levels=est.g_levels_.tolist(), cost_ms=est.cost_ms_.tolist(), bcap_levels=bcaps
            )
        fits.append(
            ContextFit(
                context_index=ci,
                prefill_tokens=prefill,
                min_kv_length=lo,
                max_kv_length=hi,
                model=model,
                combine=combine,
                windows=[Window(**_window_row(r)) for r in windows.to_dict("records")],
                diagnostics=_diagnostics_block(diag),
                **params,
            )
        )
    table = CostTable(
        calibration=cal, compatibility=compat, geometry_block=geom, fits=fits, provenance=prov
    )
    cells = table.nonpositive_cells()
    if cells:
        warnings.warn(NonPositiveCostWarning(nonpositive_message(cells, model)), stacklevel=2)
    return table


def nonpositive_message(cells: list[dict[str, Any]], model: str) -> str:
    """The text of a :class:`NonPositiveCostWarning` naming each cell (up to a limit)."""
    listed = "; ".join(
        f"context {c['context_index']} (KV {c['min_kv_length']}-{c['max_kv_length']}) "
        f"Bcap {c['bcap']} G {c['g']}: {c['cost_ms']:.3f} ms"
        + (" (measured)" if c["measured"] else "")
        for c in cells[:MAX_LISTED_CELLS]
    )
    more = f"; and {len(cells) - MAX_LISTED_CELLS} more" if len(cells) > MAX_LISTED_CELLS else ""
    return (
        f"the {model} fit predicts a non-positive step cost at {len(cells)} cell(s): "
        f"{listed}{more}. Lookups treat these cells as uncalibrated ({NOT_POSITIVE}), so "
        "policies fall back to full width there; check the measurements (noise, outliers) "
        "or refit with another model."
    )


def refit_table(
    table: CostTable, *, model: str | None = None, provenance: Provenance | None = None
) -> CostTable:
    """Refit a table from its stored raw windows (optionally with the other model)."""
    cal = table.calibration.model_copy(update={"model": model or table.calibration.model})
    if model and model != table.calibration.model:
        cal = cal.model_copy(update={"sources": {**cal.sources, "model": "caller"}})
    return build_table(
        table.measurements(),
        compatibility=table.compatibility,
        calibration=cal,
        geometry=table.geometry_block.model_dump(),
        provenance=provenance or Provenance.now(),
        combine=table.fits[0].combine,
    )


_WINDOW_KEYS = tuple(Window.model_fields)


def _window_row(r: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: (int(r[k]) if Window.model_fields[k].annotation is int else float(r[k]))
        for k in _WINDOW_KEYS
    }


def _finite(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _diagnostics_block(diag) -> DiagnosticsBlock:
    pts = []
    for r in diag.points.to_dict("records"):
        pts.append(
            PointBlock(
                bcap=int(r["bcap"]),
                g=int(r["g"]),
                n_windows=int(r["n_windows"]),
                step_ms=float(r["step_ms"]),
                spread_ms=float(r["spread_ms"]),
                **{
                    k: _finite(r[k])
                    for k in ("predicted_ms", "residual_ms", "residual_pct", "lopo_ms", "logo_ms")
                },
            )
        )
    return DiagnosticsBlock(
        residuals=ErrorBlock(**diag.residuals.to_dict()),
        leave_one_point_out=ErrorBlock(**diag.leave_one_point_out.to_dict()),
        leave_one_g_out=ErrorBlock(**diag.leave_one_g_out.to_dict()),
        points=pts,
    )


def _calibration(df: pd.DataFrame, calibration, model: str | None, w: int) -> CalibrationConfig:
    if calibration is not None:
        cal = (
            calibration
            if isinstance(calibration, CalibrationConfig)
            else _validate_block(CalibrationConfig, calibration, "calibration", InputError)
        )
        if model is not None and model != cal.model:
            if cal.sources.get("model", "default") != "default":
                raise InputError("model", model, f"calibration.model = {cal.model!r}")
            cal = cal.model_copy(
                update={"model": model, "sources": {**cal.sources, "model": "caller"}}
            )
        return cal
    model_source = "caller" if model else "default"
    model = model or "additive"
    if model not in MODELS:
        raise InputError("model", model, f"one of {list(MODELS)}")
    intervals = context_intervals(df)
    rows: dict[int, list[int]] = {}
    for b, g in df[["bcap", "g"]].drop_duplicates().itertuples(index=False):
        rows.setdefault(int(b), []).append(int(g))
    counts = df.groupby(["context_index", "bcap", "g"]).size()

    def pick(col: str, default: int) -> tuple[int, str]:
        if col in df.columns and df[col].nunique() == 1:
            return int(df[col].iloc[0]), "measurements"
        return default, "default"

    warmup, src_warm = pick("warmup_steps", 8)
    steps, src_steps = pick("window_steps", 32)
    mode = str(df["mode"].iloc[0]) if "mode" in df.columns else "draft_step"
    return CalibrationConfig(
        model=model,
        draft_width=w,
        mode=mode,
        request_buckets=sorted(rows),
        target_graph_rows={b: sorted(gs) for b, gs in sorted(rows.items())},
        contexts=[
            ContextInterval(prefill_tokens=p, min_kv_length=lo, max_kv_length=hi)
            for _, (p, lo, hi) in sorted(intervals.items())
        ],
        warmup_steps=warmup,
        window_steps=steps,
        windows_per_point=int(counts.max()),
        token_seed=1,
        policy=None,
        sources={
            "model": model_source,
            "draft_width": "compatibility",
            "mode": "measurements" if "mode" in df.columns else "default",
            "request_buckets": "measurements",
            "target_graph_rows": "measurements",
            "contexts": "measurements",
            "warmup_steps": src_warm,
            "window_steps": src_steps,
            "windows_per_point": "measurements",
            "token_seed": "default",
        },
    )


def _geometry(df: pd.DataFrame, geometry, w: int) -> GeometryBlock:
    if geometry is None:
        bcaps = sorted(int(b) for b in df["bcap"].unique())
        legal = default_target_rows(bcaps, w)
        rows = {
            b: sorted(set(legal[b]) | set(int(g) for g in df.loc[df["bcap"] == b, "g"]))
            for b in bcaps
        }
        geom = Geometry(draft_width=w, request_buckets=tuple(bcaps), target_rows=rows)
    elif isinstance(geometry, Geometry):
        geom = geometry
    else:
        d = dict(geometry)
        geom = Geometry.from_dict(d)
    if geom.draft_width != w:
        raise InputError(
            "geometry.draft_width", geom.draft_width, f"compatibility.draft_width = {w}"
        )
    d = geom.to_dict()
    d["target_rows"] = {int(b): v for b, v in d["target_rows"].items()}
    return GeometryBlock(**d)


# ---------------------------------------------------------------- save / load


def save_table(table: CostTable, path: str | os.PathLike) -> Path:
    """Write ``table`` atomically as canonical JSON (schema version 1)."""
    return write_json_atomic(path, table.to_json_dict())


def load_table(
    path: str | os.PathLike,
    expect: Compatibility | Mapping[str, Any] | None = None,
    *,
    runtime_versions: Mapping[str, str | None] | None = None,
) -> CostTable:
    """Read, migrate and validate a cost table; check it against ``expect`` when given.

    Parameters
    ----------
    path : the table file.
    expect : compatibility metadata of the running config (``Engine.compatibility()``).
    runtime_versions : ``speccal_version``/``torch_version``/``driver_version`` of the running
        process for the performance-only check; default: this speccal and the imported torch.

    Raises
    ------
    SchemaError
        Missing, empty, truncated or non-JSON file; unknown or missing keys; a newer
        ``schema_version``; internally inconsistent content.
    CompatibilityError
        A semantic mismatch with ``expect`` (names expected and found values).

    Warns
    -----
    CompatibilityWarning
        A performance-only mismatch with ``expect``.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise SchemaError("table", str(p), f"a readable cost table file ({exc.strerror})") from None
    table = parse_table(raw, source=str(p))
    if expect is not None:
        versions = runtime_versions
        if versions is None:
            torch = sys.modules.get("torch")
            versions = {
                "speccal_version": __version__,
                "torch_version": getattr(torch, "__version__", None),
            }
        check_compatibility(
            expect,
            table.compatibility,
            expected_versions=versions,
            found_versions=table.provenance.versions(),
            source=f"table {p.name}",
        )
    return table


def parse_table(raw: bytes | str, source: str = "table") -> CostTable:
    """Parse table bytes (see :func:`load_table`), migrating legacy documents."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    if not text.strip():
        raise SchemaError(source, "empty file", "a JSON cost table")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(
            source,
            f"invalid JSON at line {exc.lineno} column {exc.colno}",
            f"a complete JSON cost table ({exc.msg})",
        ) from None
    if not isinstance(doc, dict):
        raise SchemaError(source, type(doc).__name__, "a JSON object")
    if "schema_version" not in doc:
        doc = migrate_legacy(doc, source)
    version = doc["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SchemaError(f"{source}: schema_version", version, "a positive integer")
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{source}: schema_version",
            version,
            f"<= {SCHEMA_VERSION}: written by a newer speccal; upgrade speccal to read it",
        )
    table = _validate_block(CostTable, doc, source, SchemaError)
    _check_consistent(table, source)
    return table


def _validate_block(cls, doc, source: str, error):
    try:
        return cls.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise error(f"{source}: {loc}", err.get("input"), "no such key (unknown key)") from None
        if err["type"] == "missing":
            raise error(f"{source}: {loc}", "missing", "a required key") from None
        raise error(f"{source}: {loc}", err.get("input"), err["msg"]) from None


def migrate_legacy(doc: dict, source: str = "table") -> dict:
    """Migrate an unversioned (legacy) table document forward to schema version 1.

    A legacy table is laid out like version 1 without ``schema_version``; ``draft_width`` may be
    absent anywhere (read as width 7, as the xLLM seed specifies), ``geometry`` and
    ``provenance`` may be absent (geometry is rebuilt from the fitted levels with the split-graph
    legal buckets; provenance is marked unknown).
    """
    doc = json.loads(json.dumps(doc))  # deep copy of plain JSON
    compat = doc.get("compatibility")
    if not isinstance(compat, dict):
        raise SchemaError(f"{source}: compatibility", compat, "a compatibility object")
    w = compat.get("draft_width", LEGACY_DRAFT_WIDTH)
    compat["draft_width"] = w
    cal = doc.get("calibration")
    if isinstance(cal, dict):
        cal.setdefault("draft_width", w)
    if "geometry" not in doc:
        fits = doc.get("fits") or []
        bcaps: set[int] = set()
        gs: set[int] = set()
        for f in fits:
            params = f.get("additive") or f.get("sps") or {}
            bcaps.update(int(b) for b in params.get("bcap_levels", []))
            gs.update(int(g) for g in params.get("g_levels", []))
        if not bcaps:
            raise SchemaError(f"{source}: fits", "no bcap levels", "fits with bcap_levels")
        legal = default_target_rows(sorted(bcaps), int(w))
        rows = {b: sorted(set(legal[b]) | {g for g in gs if g >= b}) for b in sorted(bcaps)}
        doc["geometry"] = Geometry(
            draft_width=int(w), request_buckets=tuple(sorted(bcaps)), target_rows=rows
        ).to_dict()
    else:
        doc["geometry"].setdefault("draft_width", w)
    if "provenance" not in doc:
        doc["provenance"] = {"speccal_version": "unknown", "created": "unknown"}
    doc["provenance"]["migrated_from"] = "legacy"
    doc["schema_version"] = SCHEMA_VERSION
    return doc


def _check_consistent(t: CostTable, source: str) -> None:
    w = t.compatibility.draft_width
    for name, value in (
        ("calibration.draft_width", t.calibration.draft_width),
        ("geometry.draft_width", t.geometry_block.draft_width),
    ):
        if value != w:
            raise SchemaError(f"{source}: {name}", value, f"compatibility.draft_width = {w}")
    try:
        check_contexts(
            {f.context_index: (f.prefill_tokens, f.min_kv_length, f.max_kv_length) for f in t.fits}
        )
    except GridError as exc:
        raise SchemaError(f"{source}: fits", exc.value, exc.expected) from None
    for i, f in enumerate(t.fits):
        where = f"{source}: fits.{i}"
        if f.min_kv_length > f.max_kv_length:
            raise SchemaError(
                f"{where}.min_kv_length", f.min_kv_length, f"<= max_kv_length {f.max_kv_length}"
            )
        if f.model != t.calibration.model:
            raise SchemaError(
                f"{where}.model", f.model, f"calibration.model = {t.calibration.model!r}"
            )
        params = f.additive if f.model == "additive" else f.sps
        other = f.sps if f.model == "additive" else f.additive
        if params is None or other is not None:
            raise SchemaError(
                f"{where}.{f.model}", None, f"exactly the {f.model!r} parameter block"
            )
        if f.model == "additive":
            pairs = (("bcap_levels", "alpha_ms"), ("g_levels", "theta_ms"))
        else:
            pairs = (("g_levels", "cost_ms"),)
        for lv, val in pairs:
            a, b = getattr(params, lv), getattr(params, val)
            if len(a) == 0 or len(a) != len(b) or a != sorted(set(a)):
                raise SchemaError(
                    f"{where}.{f.model}.{lv}", a, f"ascending distinct levels, one {val} each"
                )
        if f.model == "sps" and (not f.sps.bcap_levels or any(c <= 0 for c in f.sps.cost_ms)):
            raise SchemaError(
                f"{where}.sps", f.sps.cost_ms, "positive costs and non-empty bcap_levels"
            )


def json_schema() -> dict:
    """The JSON Schema of the current table version (committed under ``tables/schema/``)."""
    return CostTable.model_json_schema(mode="serialization", by_alias=True)


def write_json_schema(path: str | os.PathLike = SCHEMA_PATH) -> Path:
    """Regenerate the committed JSON Schema file (run after changing the table models)."""
    return write_json_atomic(path, json_schema())
