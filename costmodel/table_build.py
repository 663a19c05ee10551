"""Building a cost table from measurement rows: fit one model per context interval, refit.

``build_table`` validates the rows, fills in the effective calibration config and geometry
(read back from the rows when not given), fits the ``additive`` or ``sps`` estimator per context
interval with its diagnostics, fits the KV-aware model over all contexts when there are three or
more (``speccal.costmodel.kv``; absent otherwise), and warns about fitted costs that are not positive.
``build_table`` is two steps a caller may also take itself: ``fit_table`` (the validated parts:
config, geometry, fits, KV model; a :class:`TableFit`) and ``assemble_table`` (the one
``CostTable`` of them, with an optional ``calibration.quality`` computed from the fits: what
``speccal.calibrate`` records). ``refit_table`` rebuilds a table from the raw windows it stores.
The document itself is
``speccal.costmodel.table_schema``; saving and loading it is ``speccal.costmodel.table``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from speccal.base.errors import GridError, InputError, show
from speccal.base.geometry import Geometry, default_target_rows
from speccal.costmodel.additive import AdditiveCostModel
from speccal.costmodel.compat import Compatibility, SpeccalWarning, as_compatibility
from speccal.costmodel.diagnostics import KTermChoice, diagnose, select_additive
from speccal.costmodel.kv import KVFit, select_kv_model
from speccal.costmodel.lookup import NOT_POSITIVE
from speccal.costmodel.measurements import (
    DEFAULT_MODE,
    check_shapes,
    context_intervals,
    validate_measurements,
)
from speccal.costmodel.sps import SPSCostModel
from speccal.costmodel.table_schema import (
    AdditiveParams,
    CalibrationConfig,
    ContextFit,
    ContextInterval,
    CostTable,
    DiagnosticsBlock,
    ErrorBlock,
    GeometryBlock,
    KTermCandidate,
    KTermSelection,
    KVCandidate,
    KVContextErrors,
    KVModelBlock,
    KVPoint,
    KVSpreadBlock,
    PointBlock,
    Provenance,
    QualityBlock,
    SPSParams,
    Window,
    validate_block,
)

MODELS = ("additive", "sps")
#: Cells listed by name in a :class:`NonPositiveCostWarning` before "... and N more".
MAX_LISTED_CELLS = 12


class NonPositiveCostWarning(SpeccalWarning):
    """A fit predicts a zero or negative step cost at a calibrated cell (listed in the message).

    Such cells are uncalibrated at lookup (:meth:`CostTable.cost_ms` says
    ``"fitted cost not positive"``; :meth:`CostTable.cost_surface` is NaN there).
    """


@dataclass(frozen=True)
class TableFit:
    """The validated parts of a table before the document is assembled (:func:`fit_table`).

    A caller that records something computed from the fits (``speccal.calibrate``'s quality
    gate reads their held-out errors) reads it here, then builds the table once with it
    (:func:`assemble_table`).
    """

    calibration: CalibrationConfig
    compatibility: Compatibility
    geometry: GeometryBlock
    fits: tuple[ContextFit, ...]
    kv_model: KVModelBlock | None
    provenance: Provenance

    @property
    def model(self) -> str:
        """``additive`` or ``sps``: the fitted model (``calibration.model``)."""
        return self.calibration.model


def build_table(measurements: pd.DataFrame, **options: Any) -> CostTable:
    """Fit one model per context interval and assemble a validated :class:`CostTable`:
    :func:`assemble_table` of :func:`fit_table` (``options``: its keyword arguments ``model``,
    ``compatibility``, ``calibration``, ``geometry``, ``provenance``, ``combine``, ``sources``;
    its errors and warnings, and :func:`assemble_table`'s).
    """
    return assemble_table(fit_table(measurements, stacklevel=3, **options), stacklevel=3)


def fit_table(
    measurements: pd.DataFrame,
    *,
    model: str | None = None,
    compatibility: Compatibility | Mapping[str, Any],
    calibration: CalibrationConfig | Mapping[str, Any] | None = None,
    geometry: Geometry | Mapping[str, Any] | None = None,
    provenance: Provenance | Mapping[str, Any] | None = None,
    combine: str = "median",
    sources: Mapping[str, str] | None = None,
    stacklevel: int = 2,
) -> TableFit:
    """Fit one model per context interval: the validated parts of a table (:class:`TableFit`).

    Parameters
    ----------
    measurements : measurement rows (see ``speccal.costmodel.measurements``).
    model : ``additive`` or ``sps``; default ``calibration.model``, else ``additive``.
    compatibility : the run's compatibility metadata (``Engine.compatibility()`` dict).
    calibration : the effective calibration config; default: read back from the rows
        (``sources`` say ``measurements`` or ``default``; without a ``mode`` column the mode is
        ``target_verify``, calibrate's default).
    geometry : the captured geometry; default: the measured Bcaps, each with its default legal
        buckets (``speccal.base.geometry.default_target_rows``), which hold every legal G.
    provenance : default: :meth:`Provenance.now`.
    combine : how repeated windows are combined (``median``, ``mean``).
    sources : where the caller's values came from (e.g. ``{"draft_width": "flag"}``), merged
        over the sources of a calibration config read back from the rows.
    stacklevel : the frame a warning names (2: the caller).

    Raises
    ------
    InputError, GridError
        Bad rows, overlapping contexts, a disconnected additive grid, inconsistent draft widths,
        rows no round of the mode can produce (``measurements.check_shapes``: ``k > w``, a ``G``
        outside ``[Bcap, Bcap * (w + 1)]``, ...), measured points outside the given geometry,
        a ``calibration.mode`` other than the rows' ``mode``, an additive fit with a negative
        bias (the reference cell's cost; a table refuses it).

    Warns
    -----
    NonPositiveCostWarning
        The KV model prices a calibrated cell at <= 0 ms (the parts keep only the per-interval
        fits); :func:`assemble_table` warns about the per-interval fits' cells.
    """
    df = validate_measurements(measurements)
    compat = as_compatibility(compatibility)
    w = compat.draft_width
    cal = _calibration(df, calibration, model, w)
    if sources:
        cal = cal.model_copy(update={"sources": {**cal.sources, **sources}})
    model = cal.model
    if cal.draft_width != w:
        raise InputError(
            "calibration.draft_width", cal.draft_width, f"compatibility.draft_width = {w}"
        )
    if "mode" in df.columns and str(df["mode"].iloc[0]) != cal.mode:
        raise InputError(
            "calibration.mode", cal.mode, f"the rows' mode {str(df['mode'].iloc[0])!r}"
        )
    check_shapes(df, cal.mode, w)
    check_routing_rows(df, cal)
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
        # A draft_step round's k is its draft forwards (a term of its own, or one sps curve per
        # k); a target_verify round always drafts w, whatever its rows verify.
        by_k = cal.mode == "draft_step"
        X = windows[["bcap", "g", "k"] if by_k else ["bcap", "g"]].to_numpy(dtype=np.float64)
        y = windows["step_ms"].to_numpy(dtype=np.float64)
        choice = None
        if model == "additive" and by_k:
            # rows of several k: the draft-forward term the held-out error picks
            choice = select_additive(windows, combine=combine)
            est = AdditiveCostModel(combine=combine, k_term=choice.k_term)
        elif model == "additive":
            est = AdditiveCostModel(combine=combine)
        else:
            est = SPSCostModel(combine=combine)
        est.fit(X, y)
        diag = diagnose(est, windows)
        bcaps = sorted(int(b) for b in windows["bcap"].unique())
        params: dict[str, Any] = {}
        if model == "additive":
            if est.bias_ms_ < 0:
                raise GridError(
                    f"fits.{len(fits)}.additive.bias_ms",
                    round(float(est.bias_ms_), 6),
                    f">= 0 ms: the fitted cost of the reference cell (Bcap "
                    f"{int(est.bcap_levels_[0])}, G {int(est.g_levels_[0])}) of context {ci} is "
                    "negative, so the additive model does not describe these measurements "
                    "(check them for outliers, or fit sps)",
                )
            params["additive"] = AdditiveParams(
                bias_ms=est.bias_ms_,
                bcap_levels=est.bcap_levels_.tolist(),
                alpha_ms=est.alpha_ms_.tolist(),
                g_levels=est.g_levels_.tolist(),
                theta_ms=est.theta_ms_.tolist(),
                k_term=est.k_term,
                delta_ms=est.delta_ms_.tolist(),
                k_selection=_k_selection(choice),
            )
        else:
            params["sps"] = SPSParams(
                g_levels=est.g_levels_.tolist(), cost_ms=est.cost_ms_.tolist(), bcap_levels=bcaps,
                k=None if est.k_ is None else est.k_.tolist(),
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
                diagnostics=_diagnostics_block(diag, _point_experts(windows)),
                **params,
            )
        )
    kv = select_kv_model(df, combine=combine)
    kv_model = None if kv is None else kv_block(kv, fits)
    if kv_model is not None:
        bad = kv_model.nonpositive_cells(geom.target_rows)
        if bad:
            # a table refuses such a model (speccal.costmodel.table): keep the per-interval fits
            b, g, x, cost = bad[0]
            warnings.warn(
                NonPositiveCostWarning(
                    f"the KV model ({kv_model.kv_term}) prices {len(bad)} calibrated cell end(s) "
                    f"at <= 0 ms (first: Bcap {b}, G {g}, KV {x}: {cost:.3f} ms); the table "
                    "keeps only the per-interval fits (no kv_model block)"
                ),
                stacklevel=stacklevel,
            )
            kv_model = None
    return TableFit(calibration=cal, compatibility=compat, geometry=geom, fits=tuple(fits),
                    kv_model=kv_model, provenance=prov)


def assemble_table(
    parts: TableFit, *, quality: Mapping[str, Any] | None = None,
    kv_spread: Mapping[str, Any] | None = None, stacklevel: int = 2
) -> CostTable:
    """The one validated :class:`CostTable` of ``parts``, with ``calibration.quality`` set to
    ``quality`` (a :class:`~speccal.costmodel.table_schema.QualityBlock` document, validated
    here) when given, and the KV spread term ``kv_spread`` (``speccal.costmodel.spread.fit_spread``,
    validated here as a :class:`~speccal.costmodel.table_schema.KVSpreadBlock`) when given.

    Warns :class:`NonPositiveCostWarning` when a fit predicts a zero or negative step cost at
    calibrated cells (listed; see :meth:`CostTable.nonpositive_cells`). The table is still
    built; those cells look up as uncalibrated. ``stacklevel``: the frame the warning names.
    """
    cal = parts.calibration
    if quality is not None:
        block = validate_block(QualityBlock, dict(quality), "calibration.quality", InputError)
        cal = cal.model_copy(update={"quality": block})
    table = CostTable(
        calibration=cal,
        compatibility=parts.compatibility,
        geometry_block=parts.geometry,
        fits=list(parts.fits),
        kv_model=parts.kv_model,
        kv_spread=None if kv_spread is None else validate_block(
            KVSpreadBlock, dict(kv_spread), "kv_spread", InputError),
        provenance=parts.provenance,
    )
    cells = table.nonpositive_cells()
    if cells:
        warnings.warn(NonPositiveCostWarning(nonpositive_message(cells, parts.model)),
                      stacklevel=stacklevel)
    return table


def _k_selection(choice: KTermChoice | None) -> KTermSelection | None:
    """The table block of a draft-forward term's selection (None: rows of one k)."""
    if choice is None or not choice.candidates:
        return None
    return KTermSelection(
        selected_by=choice.selected_by,
        candidates=[
            KTermCandidate(
                k_term=t,
                leave_one_point_out=ErrorBlock(**e["leave_one_point_out"].to_dict()),
                partly_filled=ErrorBlock(**e["partly_filled"].to_dict()),
            )
            for t, e in choice.candidates.items()
        ],
    )


def kv_block(kv: KVFit, fits: list[ContextFit]) -> KVModelBlock:
    """The table block of a selected KV model; its span is the contexts' outer bounds."""
    m = kv.model
    return KVModelBlock(
        kv_term=m.kv_term,
        combine=m.combine,
        min_kv_length=min(f.min_kv_length for f in fits),
        max_kv_length=max(f.max_kv_length for f in fits),
        bias_ms=m.bias_ms_,
        bcap_levels=m.bcap_levels_.tolist(),
        alpha_ms=m.alpha_ms_.tolist(),
        g_levels=m.g_levels_.tolist(),
        theta_ms=m.theta_ms_.tolist(),
        beta_ms=m.beta_ms_.tolist(),
        k_term=m.k_term,
        delta_ms=m.delta_ms_.tolist(),
        selected_by=kv.selected_by,
        residuals=ErrorBlock(**kv.residuals.to_dict()),
        leave_one_point_out=ErrorBlock(**kv.leave_one_point_out.to_dict()),
        leave_one_context_out=ErrorBlock(**kv.leave_one_context_out.to_dict()),
        per_context=[
            KVContextErrors(
                context_index=c,
                residuals=ErrorBlock(**e["residuals"].to_dict()),
                leave_one_point_out=ErrorBlock(**e["leave_one_point_out"].to_dict()),
            )
            for c, e in sorted(kv.per_context.items())
        ],
        candidates=[
            KVCandidate(
                kv_term=t,
                k_term=kt,
                leave_one_context_out=ErrorBlock(**e["leave_one_context_out"].to_dict()),
                leave_one_point_out=ErrorBlock(**e["leave_one_point_out"].to_dict()),
            )
            for (t, kt), e in kv.candidates.items()
        ],
        points=[
            KVPoint(
                context_index=int(r["context_index"]),
                bcap=int(r["bcap"]),
                g=int(r["g"]),
                k=int(r["k"]),
                kv_length=float(r["kv_length"]),
                step_ms=float(r["step_ms"]),
                predicted_ms=float(r["predicted_ms"]),
                lopo_ms=_finite(r["lopo_ms"]),
                loco_ms=_finite(r["loco_ms"]),
            )
            for r in kv.points.to_dict("records")
        ],
    )


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
    refitted = build_table(
        table.measurements(),
        compatibility=table.compatibility,
        calibration=cal,
        geometry=table.geometry_block.model_dump(),
        provenance=provenance or Provenance.now(),
        combine=table.fits[0].combine,
    )
    # the spread points are not windows of the fits: the term stays as measured
    return refitted.model_copy(update={"kv_spread": table.kv_spread})


_WINDOW_KEYS = tuple(k for k in Window.model_fields if k != "experts_activated")


def _window_row(r: Mapping[str, Any]) -> dict[str, Any]:
    out = {
        k: (int(r[k]) if Window.model_fields[k].annotation is int else float(r[k]))
        for k in _WINDOW_KEYS
    }
    if "experts_activated" in r:  # routed-expert targets only (check_routing_rows)
        out["experts_activated"] = float(r["experts_activated"])
    return out


def check_routing_rows(df: pd.DataFrame, cal: CalibrationConfig) -> None:
    """Rows count routed experts (``experts_activated``) exactly when ``calibration.routing``
    says what they count, each within ``[top_k, experts]`` (a round routes every row to
    ``top_k`` distinct experts of ``experts``).

    Raises
    ------
    InputError
        Counts without a routing block, a routing block without counts, a count out of range
        (naming the row).
    """
    has = "experts_activated" in df.columns
    routing = cal.routing
    if has and routing is None:
        raise InputError(
            "calibration.routing", None,
            "the routing the rows' experts_activated counts were measured under ({source, "
            "experts, top_k, layers}): pass the table's calibration block (speccal fit "
            "--calibration) or drop the column")
    if routing is None:
        return
    if not has:
        raise InputError(
            "measurements.experts_activated", "missing",
            f"a count in every row: calibration.routing says the target routes ({routing.layers} "
            f"layers, top {routing.top_k} of {routing.experts} experts)")
    vals = df["experts_activated"].to_numpy(dtype=float)
    bad = (vals < routing.top_k) | (vals > routing.experts)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"measurements.experts_activated[row {i}]", float(vals[i]),
            f"a mean in [top_k, experts] = [{routing.top_k}, {routing.experts}] "
            "(calibration.routing)")


def _point_experts(windows: pd.DataFrame) -> dict[tuple[int, int, int], float]:
    """Per point ``(bcap, g, k)``, the mean ``experts_activated`` of its windows ({} for rows
    without the column)."""
    if "experts_activated" not in windows.columns:
        return {}
    means = windows.groupby(["bcap", "g", "k"])["experts_activated"].mean()
    return {(int(b), int(g), int(k)): float(v) for (b, g, k), v in means.items()}


def _finite(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _diagnostics_block(diag, experts: Mapping[tuple[int, int, int], float]) -> DiagnosticsBlock:
    pts = []
    for r in diag.points.to_dict("records"):
        pts.append(
            PointBlock(
                bcap=int(r["bcap"]),
                g=int(r["g"]),
                k=int(r["k"]),
                num_requests=int(r["num_requests"]),
                n_windows=int(r["n_windows"]),
                step_ms=float(r["step_ms"]),
                spread_ms=float(r["spread_ms"]),
                experts_activated=experts.get((int(r["bcap"]), int(r["g"]), int(r["k"]))),
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
            else validate_block(CalibrationConfig, calibration, "calibration", InputError)
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
    mode = str(df["mode"].iloc[0]) if "mode" in df.columns else DEFAULT_MODE
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
    """The table's geometry: given, or the measured Bcaps with their legal buckets (which, by
    ``check_shapes``, hold every measured G up to ``Bcap * (w + 1)`` that a captured split
    geometry prepares; a G it does not prepare is added to its Bcap's buckets, never beyond
    full width). Every measured point must be a bucket of the geometry."""
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
    for b, g in df[["bcap", "g"]].drop_duplicates().itertuples(index=False):
        if int(g) not in geom.target_rows.get(int(b), ()):
            raise InputError(
                "measurements",
                f"bcap {int(b)}, g {int(g)}",
                "a point the geometry captured: target_rows["
                f"{int(b)}] = {show(list(geom.target_rows.get(int(b), ())))}",
            )
    d = geom.to_dict()
    d["target_rows"] = {int(b): v for b, v in d["target_rows"].items()}
    return GeometryBlock(**d)
