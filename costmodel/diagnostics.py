"""Fit diagnostics: how well does a fitted cost model predict step time?

Works on the combined grid points of one context interval (one row per (Bcap, G), cost = median
of its windows, see ``speccal.costmodel.measurements.combine_windows``) and reports, in ms and in
% of the measured cost:

- **residuals**: measured - predicted at every point, model fitted on all points;
- **leave-one-point-out** (LOPO): each point predicted by a model fitted without it. For the
  additive model this is the exact closed form of least squares (PRESS residual
  ``e_i / (1 - h_ii)`` from the hat matrix of the one-hot design), identical to refitting; a point
  with ``h_ii == 1`` is the only evidence for one of its levels (or a bridge of the grid), cannot
  be predicted without it and is counted as skipped. For SPS only the level at the point's G
  changes (the other Bcaps' windows at that G, or interpolation between the neighbouring G when
  none remain), computed directly, identical to refitting; a point whose G is then outside the
  measured range is skipped.
- **leave-one-G-out** (LOGO): all points at one G are predicted by a model fitted without that G.
  Neither model knows an unmeasured G, so this asks "how wrong would the table be at a G that was
  not measured, filled by linear interpolation between the neighbouring measured G": SPS
  interpolates its cost, the additive model interpolates ``theta``. Points at the smallest or
  largest G, points whose Bcap was only measured at that G, and folds that disconnect the grid are
  skipped.

Points are one per (Bcap, G, k): a draft_step grid measures a G under several k (partly filled
buckets), and a fit with a draft-forward term (``k_term``) predicts each with its own k; an sps
fit with one curve per k holds a point out of its own curve.

:func:`select_additive` chooses a draft_step table's draft-forward term: it fits every form of
``speccal.costmodel.additive.K_TERMS`` the grid can identify and keeps the one with the lowest
leave-one-point-out error **on the partly filled points** (``num_requests < bcap``: the shapes
serving produces that a full-batch grid never measured; all points when there are none), the
fewest parameters among forms within :data:`TIE_PCT` percentage points.

Every summary carries ``n_evaluated`` and ``n_skipped``; its error fields are None when nothing
could be evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from speccal.base.errors import GridError
from speccal.costmodel.additive import K_TERMS, AdditiveCostModel, full_design
from speccal.costmodel.estimator import single_thread_blas
from speccal.costmodel.lookup import k_part, level_lookup, sps_interp
from speccal.costmodel.measurements import combine_windows
from speccal.costmodel.sps import SPSCostModel

# h_ii this close to 1 means the remaining design loses rank without the point.
_HAT_TOL = 1e-9
#: Held-out errors (percentage points of mean |error|) closer than this count as a tie.
TIE_PCT = 0.1


@dataclass(frozen=True)
class ErrorSummary:
    """Error of one scheme over the points it could evaluate (ms and % of measured)."""

    n_evaluated: int
    n_skipped: int
    mae_ms: float | None
    rmse_ms: float | None
    max_abs_ms: float | None
    mean_abs_pct: float | None
    max_abs_pct: float | None

    @classmethod
    def of(cls, measured: np.ndarray, predicted: np.ndarray) -> ErrorSummary:
        ok = np.isfinite(predicted)
        n = int(ok.sum())
        if n == 0:
            return cls(0, int(len(measured)), None, None, None, None, None)
        err = measured[ok] - predicted[ok]
        pct = 100.0 * np.abs(err) / measured[ok]
        return cls(
            n_evaluated=n,
            n_skipped=int(len(measured) - n),
            mae_ms=float(np.mean(np.abs(err))),
            rmse_ms=float(np.sqrt(np.mean(err**2))),
            max_abs_ms=float(np.max(np.abs(err))),
            mean_abs_pct=float(np.mean(pct)),
            max_abs_pct=float(np.max(pct)),
        )

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class FitDiagnostics:
    """Diagnostics of one fitted context: per-point table plus three summaries."""

    points: pd.DataFrame  # bcap, g, k, num_requests, n_windows, step_ms, spread_ms,
    # predicted_ms, residual_ms, residual_pct, lopo_ms, logo_ms (NaN where skipped)
    residuals: ErrorSummary
    leave_one_point_out: ErrorSummary
    leave_one_g_out: ErrorSummary


def diagnose(model, windows: pd.DataFrame) -> FitDiagnostics:
    """Residuals and held-out errors of a fitted ``model`` on the windows it was fitted on.

    Parameters
    ----------
    model : a ``SPSCostModel`` or ``AdditiveCostModel`` fitted on ``windows``.
    windows : validated measurement rows of one context interval (at least ``bcap, g, k,
        step_ms, mean_kv_length, context_index``).
    """
    points = combine_windows(windows)
    X = points[["bcap", "g", "k"]].to_numpy(dtype=np.float64)
    y = points["step_ms"].to_numpy(dtype=np.float64)
    pred = model.predict(X)
    if isinstance(model, AdditiveCostModel):
        lopo = _additive_lopo(X, y, model.k_term)
        logo = _additive_logo(X, y, model.combine, model.k_term)
    elif isinstance(model, SPSCostModel):
        wx = windows[["bcap", "g", "k"]].to_numpy(dtype=np.float64)
        wy = windows["step_ms"].to_numpy(dtype=np.float64)
        lopo = _sps_lopo(X, wx, wy, model)
        logo = _sps_logo(X, model)
    else:
        raise TypeError(f"no diagnostics for {type(model).__name__}")
    out = points[["bcap", "g", "k", "num_requests", "n_windows", "step_ms", "spread_ms"]].copy()
    out["predicted_ms"] = pred
    out["residual_ms"] = y - pred
    out["residual_pct"] = 100.0 * (y - pred) / y
    out["lopo_ms"] = lopo
    out["logo_ms"] = logo
    return FitDiagnostics(
        points=out.reset_index(drop=True),
        residuals=ErrorSummary.of(y, pred),
        leave_one_point_out=ErrorSummary.of(y, lopo),
        leave_one_g_out=ErrorSummary.of(y, logo),
    )


def _additive_lopo(X: np.ndarray, y: np.ndarray, k_term: str = "none") -> np.ndarray:
    bl, gl = np.unique(X[:, 0]), np.unique(X[:, 1])
    D = full_design(X, bl, gl, k_term)
    with single_thread_blas():
        coef, *_ = np.linalg.lstsq(D, y, rcond=None)
        # Hat diagonal from a thin QR: h_ii = ||Q_i||^2 (D has full column rank when connected).
        q, _ = np.linalg.qr(D)
    resid = y - D @ coef
    h = np.einsum("ij,ij->i", q, q)
    out = np.full(len(y), np.nan)
    ok = h < 1.0 - _HAT_TOL
    out[ok] = y[ok] - resid[ok] / (1.0 - h[ok])
    return out


def _additive_logo(X: np.ndarray, y: np.ndarray, combine: str,
                   k_term: str = "none") -> np.ndarray:
    out = np.full(len(y), np.nan)
    glev = np.unique(X[:, 1])
    for g in glev[1:-1]:  # an edge G cannot be interpolated
        test = X[:, 1] == g
        try:
            m = AdditiveCostModel(combine=combine, k_term=k_term).fit(X[~test], y[~test])
        except GridError:
            continue
        bl = m.bcap_levels_.astype(np.float64)
        theta = np.interp(g, m.g_levels_.astype(np.float64), m.theta_ms_)
        alpha = level_lookup(X[test, 0], bl, m.alpha_ms_)
        extra = k_part(m.k_term, m.delta_ms_, bl, X[test, 0], X[test, 2], X[test, 1])
        out[test] = m.bias_ms_ + alpha + theta + extra
    return out


@dataclass(frozen=True)
class KTermChoice:
    """The draft-forward term :func:`select_additive` chose, with every candidate's errors.

    ``candidates``: per ``k_term`` the fit could identify, ``leave_one_point_out`` (all points)
    and ``partly_filled`` (leave-one-point-out on the ``num_requests < bcap`` points only).
    ``selected_by``: ``partly_filled``, ``leave_one_point_out`` (no partly filled point was
    measured or none could be held out) or ``fewest_parameters`` (nothing could be held out).
    """

    k_term: str
    selected_by: str
    candidates: dict[str, dict[str, ErrorSummary]]


def select_additive(windows: pd.DataFrame, *, combine: str = "median") -> KTermChoice:
    """Choose the draft-forward term of an additive fit on one context's windows (module
    docstring). Rows of one ``k`` (target_verify) give ``none`` with no candidates."""
    points = combine_windows(windows)
    if points["k"].nunique() < 2:
        return KTermChoice("none", "fewest_parameters", {})
    X = points[["bcap", "g", "k"]].to_numpy(dtype=np.float64)
    y = points["step_ms"].to_numpy(dtype=np.float64)
    partly = (points["num_requests"] < points["bcap"]).to_numpy()
    bl, gl = np.unique(X[:, 0]), np.unique(X[:, 1])
    candidates: dict[str, dict[str, ErrorSummary]] = {}
    for k_term in K_TERMS:
        D = full_design(X, bl, gl, k_term)
        with single_thread_blas():
            if int(np.linalg.matrix_rank(D)) < D.shape[1]:
                continue
        lopo = _additive_lopo(X, y, k_term)
        candidates[k_term] = {
            "leave_one_point_out": ErrorSummary.of(y, lopo),
            "partly_filled": ErrorSummary.of(y[partly], lopo[partly]),
        }
    for metric in ("partly_filled", "leave_one_point_out"):
        errs = {t: c[metric].mean_abs_pct for t, c in candidates.items()}
        if errs and all(e is not None for e in errs.values()):
            best = min(errs.values())
            tied = [t for t in K_TERMS if t in errs and errs[t] <= best + TIE_PCT]
            return KTermChoice(tied[0], metric, candidates)
    return KTermChoice("none", "fewest_parameters", candidates)


def _sps_lopo(X: np.ndarray, wx: np.ndarray, wy: np.ndarray, model: SPSCostModel) -> np.ndarray:
    # Exactly what refitting on the windows of every other point gives, without refitting:
    # only the level at this point's G changes. Other Bcaps' windows at the same G keep that G
    # measured (their median/mean); if none remain, G is interpolated from its neighbours, or
    # skipped at the edge of the range.
    # With one curve per k, everything happens on the point's own curve.
    fn = np.median if model.combine == "median" else np.mean
    glev = model.g_levels_.astype(np.float64)
    klev = None if model.k_ is None else model.k_.astype(np.float64)
    out = np.full(len(X), np.nan)
    for i, (b, g, k) in enumerate(X):
        same = wx[:, 1] == g
        curve = np.ones(len(glev), dtype=bool)
        if klev is not None:
            same &= wx[:, 2] == k
            curve = klev == k
        rest = np.flatnonzero(same & (wx[:, 0] != b))
        if len(rest):
            out[i] = fn(wy[rest])
        else:
            keep = curve & (glev != g)
            if keep.any():
                out[i] = sps_interp(np.array([g]), glev[keep], model.cost_ms_[keep])[0]
    return out


def _sps_logo(X: np.ndarray, model: SPSCostModel) -> np.ndarray:
    # Dropping every window at G leaves the other G levels unchanged, so refitting equals
    # interpolating the fitted curve without that level.
    out = np.full(len(X), np.nan)
    glev = model.g_levels_.astype(np.float64)
    klev = np.zeros(len(glev)) if model.k_ is None else model.k_.astype(np.float64)
    for kk in np.unique(klev):
        idx = np.flatnonzero(klev == kk)
        for j in idx[1:-1]:  # an edge G of the curve cannot be interpolated
            keep = idx[idx != j]
            at = X[:, 1] == glev[j]
            if model.k_ is not None:
                at &= X[:, 2] == kk
            out[at] = sps_interp(X[at, 1], glev[keep], model.cost_ms_[keep])
    return out
