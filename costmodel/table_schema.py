"""The cost-table document (schema version 1): its pydantic blocks and lookups on it.

Owns the in-memory shape of a table and the answers it gives; building one from measurements is
``speccal.costmodel.table_build``, reading and writing the file is ``speccal.costmodel.table``.
The document (JSON Schema committed under ``tables/schema/cost_table.v1.schema.json``)::

    {"schema_version": 1,
     "calibration": {...effective config: model, draft_width, mode, request_buckets,
                     target_graph_rows, contexts, warmup_steps, window_steps,
                     windows_per_point, token_seed, policy, sources},
     "compatibility": {...see speccal.costmodel.compat},
     "geometry": {...speccal.base.geometry.Geometry.to_dict()},
     "fits": [{context_index, prefill_tokens, min_kv_length, max_kv_length, model, combine,
               "additive": {bias_ms, bcap_levels, alpha_ms, g_levels, theta_ms, reference}
                 or "sps": {g_levels, cost_ms, bcap_levels},
               "windows": [raw measured windows, so the table can be refitted],
               "diagnostics": {residuals, leave_one_point_out, leave_one_g_out, points}}],
     "provenance": {speccal_version, created, command, python_version, torch_version,
                    driver_version, migrated_from}}

Costs are in milliseconds per full step. :meth:`CostTable.cost_ms` answers one cell (NaN and a
reason when uncalibrated); :meth:`CostTable.cost_surface` is the vectorised numpy form.
:func:`validate_block` turns a pydantic validation failure into a domain error.
"""

from __future__ import annotations

import math
import platform
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Literal, NamedTuple

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from speccal import __version__
from speccal.base.atomic import dumps_json
from speccal.base.geometry import Geometry
from speccal.costmodel.additive import AdditiveCostModel, level_lookup
from speccal.costmodel.compat import Compatibility
from speccal.costmodel.measurements import validate_measurements
from speccal.costmodel.sps import SPSCostModel, sps_interp

SCHEMA_VERSION = 1
#: Reason a lookup gives for a cell whose fitted cost is zero or negative (not a physical cost).
NOT_POSITIVE = "fitted cost not positive"


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
    # method returning ``speccal.base.geometry.Geometry`` (the package contract).
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
        """The captured geometry the table was calibrated on (``speccal.base.geometry.Geometry``)."""
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


def validate_block(cls, doc, source: str, error):
    """``cls.model_validate(doc)``, raising ``error(field, value, expected)`` on the first problem."""
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
