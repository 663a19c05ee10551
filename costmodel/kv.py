"""The KV-aware cost model: one fit over every context interval, priced at any attended KV.

Attention reads the whole KV of every verified row, so a round's cost grows with the batch's
mean KV length. Over the combined points of all context intervals (one per ``(context, Bcap,
G)``: median ``step_ms`` of its windows, mean of their recorded ``mean_kv_length``) the model is

``cost_ms(Bcap, G, kv) = bias + alpha(Bcap) + theta(G) + slope(x) * x * kv``

with ``alpha`` and ``theta`` categorical as in ``speccal.costmodel.additive`` (the smallest Bcap
and G are the reference, so ``bias`` is the corner cell's cost at KV 0) and four candidate slope
forms (``kv_term``), two axes ``x`` times two ways of sharing the slope:

- ``shared``: ``x = G``, one slope ``beta`` for every G: the attention work per verified row
  and KV token is the same at every graph shape;
- ``per_g``: ``x = G``, one slope per G level (the attention kernel's tiling differs between
  shapes);
- ``shared_bcap``: ``x = Bcap``, one slope: attention reads each request's KV once, whatever
  number of its rows are verified (the paged kernels read a request's KV blocks once for all
  of its query rows and heads of a group), so memory-bound attention costs ``Bcap * kv``;
- ``per_bcap``: ``x = Bcap``, one slope per Bcap level;
- ``shared_rows`` (draft_step tables only): ``x = G / (k + 1)``, one slope: the requests one
  verify serves, padding included. A partly filled bucket runs fewer requests than ``Bcap``
  (Bcap 64 with 42 requests at k = 2 verifies G = 128 rows of 42 requests, padded to 128 / 3),
  and a draft-step round's ``G`` mixes requests and draft depth, so neither axis above follows
  the attention's reads there. On two dense-2b draft-step calibrations of an H100 (140 points
  over four contexts each, bench/RESULTS.md; ``python3 bench/fit_journal.py`` on the journals
  in bench/journals/) this form with per-Bcap draft slopes held out at 0.91 / 0.92 %
  (leave-one-point-out mean; leave-one-context-out 0.93 / 0.95 %) where the best of the four
  forms above had held out at 2.17 % (leave-one-context-out 2.26 %).

The request axis came second and fits better where attention is memory-bound: on the shipped
tables (76 points over four contexts each) leave-one-context-out mean / max 0.95 / 2.5 %
(``per_bcap``) against 1.45 / 6.7 % (``per_g``) on the H200, and 3.5 / 13.8 % against
7.6 / 35.9 % on the 2-vCPU CPU, where the G forms had priced a calibrated point 23 % off.

Why these and not theta per KV level with interpolation between the contexts: every window of
a context is measured at the same mean KV (``speccal.calibrate.driver.calibrated_kv_length``),
so a per-level model has one KV anchor per context and nothing to say between or beyond them
except by the same linear interpolation, with one ``theta`` vector per context to estimate
(three to four times the parameters of ``shared``); leaving one context out it must
extrapolate its edge contexts from one segment. The linear terms use all contexts for one slope.
Which slope form a table gets is decided by held-out error (:func:`select_kv_model`):
leave-one-context-out first (the question a KV-aware lookup answers: how wrong is the price at a
KV that was not calibrated), then leave-one-point-out; forms within :data:`TIE_PCT` percentage
points of the best count as tied and the one with the fewest slopes wins (``shared`` first, in
:data:`KV_TERMS` order).

**Draft step tables** (rows whose ``k`` varies): the model adds the draft-forward term of
``speccal.costmodel.additive`` (``k_term``: ``(k - 1) * delta``, shared or per Bcap), and the
selection tries every ``kv_term`` with every ``k_term`` (held-out error first, fewest
parameters among ties). ``X`` then has a fourth column ``k``.

Fitted attributes: ``bias_ms_``, ``bcap_levels_`` / ``alpha_ms_`` ``[nb]``, ``g_levels_`` /
``theta_ms_`` ``[ng]``, ``beta_ms_`` (``[1]`` for the shared forms, ``[ng]`` for ``per_g``,
``[nb]`` for ``per_bcap``; ms per unit of ``x`` and KV token), ``points_`` ``[m, 3]`` (bcap, g,
kv) and ``point_ms_`` ``[m]``.
``X`` is ``[n, 3]`` with columns ``[bcap, g, kv_length]``; ``predict`` is NaN for a Bcap or G that
is not a level (the KV span is the lookup's concern, ``speccal.costmodel.lookup``). Parameters
are persisted as arrays (``speccal.costmodel.table_schema.KVModelBlock``), never pickles.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from speccal.base.errors import InputError
from speccal.costmodel.additive import (
    K_TERMS_BASE,
    check_k_term,
    delta_groups,
    design_matrix,
    k_columns,
)
from speccal.costmodel.diagnostics import ErrorSummary
from speccal.costmodel.estimator import COMBINE, single_thread_blas
from speccal.costmodel.grid import check_connected
from speccal.costmodel.lookup import k_part, k_term_of, level_lookup

KV_TERMS = ("shared", "per_g", "shared_bcap", "per_bcap", "shared_rows")
#: kv_term -> (the slope's axis x: "g", "bcap" or "rows" = G / (k + 1), one slope per level of
#: it)
KV_FORMS = {"shared": ("g", False), "per_g": ("g", True),
            "shared_bcap": ("bcap", False), "per_bcap": ("bcap", True),
            "shared_rows": ("rows", False)}
#: the forms whose axis needs each point's k (draft_step rows only)
NEEDS_K = frozenset(t for t, (axis, _) in KV_FORMS.items() if axis == "rows")
#: Held-out errors (percentage points of mean |error|) closer than this count as a tie.
TIE_PCT = 0.1
_HAT_TOL = 1e-9
#: Context intervals a table needs for a KV model (see :func:`select_kv_model`).
MIN_CONTEXTS = 3


def kv_design(
    points: np.ndarray, bcap_levels: np.ndarray, g_levels: np.ndarray, kv_term: str,
    k_term: str = "none",
) -> np.ndarray:
    """Design ``[m, p]``: the additive one-hot columns, the ``x * kv`` slope column(s), then
    the draft-forward column(s) of ``k_term``.

    ``points`` is ``[m, 3]`` (bcap, g, kv) or ``[m, 4]`` (bcap, g, kv, k); KV is scaled to
    thousands of tokens inside the design only (conditioning), the fitted ``beta_ms_`` is per
    token.
    """
    D = design_matrix(points[:, :2], bcap_levels, g_levels)
    axis, per_level = KV_FORMS[kv_term]
    if axis == "rows":
        if points.shape[1] != 4:
            raise InputError("kv_term", kv_term, "a form without k: points have no k column "
                             "(rows = G / (k + 1) needs draft_step points [bcap, g, kv, k])")
        x = points[:, 1] / (points[:, 3] + 1.0)
    else:
        col = 0 if axis == "bcap" else 1
        x = points[:, col]
    levels = bcap_levels if axis == "bcap" else g_levels
    xkv = x * points[:, 2] / 1000.0
    if not per_level:
        S = xkv[:, None]
    else:
        i = np.searchsorted(levels, points[:, col])
        S = np.zeros((len(points), len(levels)))
        S[np.arange(len(points)), i] = xkv
    if k_term == "none":
        return np.hstack([D, S])
    return np.hstack([D, S, k_columns(points[:, [0, 1, 3]], bcap_levels, k_term,
                                      _groups(points, bcap_levels, g_levels, k_term))])


def _groups(points: np.ndarray, bcap_levels: np.ndarray, g_levels: np.ndarray,
            k_term: str) -> np.ndarray | None:
    """The per-Bcap draft-forward slopes' groups (``additive.delta_groups``), None otherwise."""
    if k_term != "per_bcap":
        return None
    return delta_groups(points[:, [0, 1, 3]], bcap_levels, g_levels)


def _n_slopes(kv_term: str, bcap_levels: np.ndarray, g_levels: np.ndarray) -> int:
    axis, per_level = KV_FORMS[kv_term]  # the rows axis has one shared slope
    return (len(bcap_levels) if axis == "bcap" else len(g_levels)) if per_level else 1


def _params(coef: np.ndarray, bcap_levels: np.ndarray, g_levels: np.ndarray,
            kv_term: str = "shared", groups: np.ndarray | None = None) -> tuple:
    """``(bias, bcap_levels, alpha, g_levels, theta, beta, delta)`` of a :func:`kv_design`
    fit's coefficients (reference levels 0, ``beta`` per KV token, ``delta`` the draft-forward
    term, empty without one, one per Bcap level when ``groups`` ties per-Bcap slopes),
    :meth:`KVCostModel.from_params`'s arguments."""
    nb, ng = len(bcap_levels), len(g_levels)
    ns = _n_slopes(kv_term, bcap_levels, g_levels)
    s0 = nb + ng - 1
    delta = np.asarray(coef[s0 + ns :], dtype=np.float64)
    return (float(coef[0]), bcap_levels.astype(np.int64), np.concatenate([[0.0], coef[1:nb]]),
            g_levels.astype(np.int64), np.concatenate([[0.0], coef[nb:s0]]),
            np.asarray(coef[s0 : s0 + ns], dtype=np.float64) / 1000.0,
            delta if groups is None else delta[groups])


class KVCostModel(RegressorMixin, BaseEstimator):
    """``bias + alpha(Bcap) + theta(G) + slope(x) * x * kv`` in ms (see module docstring).

    Parameters
    ----------
    kv_term : {"shared", "per_g", "shared_bcap", "per_bcap"}
        The slope's axis (G or Bcap) and whether it has one slope or one per level.
    combine : {"median", "mean"}
        How repeated windows of one (Bcap, G, KV) point are combined before the fit.
    k_term : {"none", "shared", "per_bcap"}
        The draft-forward term (``speccal.costmodel.additive``); not ``none`` needs a ``k``
        column.
    """

    def __init__(self, *, kv_term: str = "shared", combine: str = "median",
                 k_term: str = "none"):
        self.kv_term = kv_term
        self.combine = combine
        self.k_term = k_term

    def fit(self, X, y):
        """Fit on ``X = [[bcap, g, kv_length(, k)]]``, ``y`` = step ms; returns ``self``.

        Raises ``InputError`` for an unknown ``kv_term``/``k_term``/``combine`` or fewer than
        two distinct KV lengths (no slope to fit), ``GridError`` for a disconnected (Bcap, G)
        grid.
        """
        if self.kv_term not in KV_TERMS:
            raise InputError("kv_term", self.kv_term, f"one of {list(KV_TERMS)}")
        check_k_term(self.k_term)
        if self.k_term not in K_TERMS_BASE:  # the KV model's rows axis is its kv_term
            raise InputError("k_term", self.k_term, f"one of {list(K_TERMS_BASE)} (a KV model)")
        if self.combine not in COMBINE:
            raise InputError("combine", self.combine, f"one of {list(COMBINE)}")
        X, y = validate_data(self, X, y, reset=True, dtype=np.float64, y_numeric=True)
        want = 3 if self.k_term == "none" and self.kv_term not in NEEDS_K else 4
        if X.shape[1] not in (want, 4):
            raise InputError("X", f"n_features = {X.shape[1]}",
                             "3 columns [bcap, g, kv_length]" if want == 3
                             else "4 columns [bcap, g, kv_length, k]")
        keys, inverse = np.unique(X, axis=0, return_inverse=True)
        grouped = pd.Series(y).groupby(inverse.reshape(-1), sort=True)
        value = (grouped.median() if self.combine == "median" else grouped.mean()).to_numpy()
        if len(np.unique(keys[:, 2])) < 2:
            raise InputError(
                "kv_length",
                f"{len(np.unique(keys[:, 2]))} distinct value(s)",
                "at least 2 KV lengths to fit a KV slope",
            )
        check_connected(((int(p[0]), int(p[1])) for p in keys), where="kv model grid")
        bl, gl = np.unique(keys[:, 0]), np.unique(keys[:, 1])
        D = kv_design(keys, bl, gl, self.kv_term, self.k_term)
        with single_thread_blas():
            coef, *_ = np.linalg.lstsq(D, value, rcond=None)
        (self.bias_ms_, self.bcap_levels_, self.alpha_ms_, self.g_levels_, self.theta_ms_,
         self.beta_ms_, self.delta_ms_) = _params(coef, bl, gl, self.kv_term,
                                                  _groups(keys, bl, gl, self.k_term))
        self.points_ = keys
        self.point_ms_ = value
        return self

    def predict(self, X) -> np.ndarray:
        """Step cost in ms; NaN where a row's Bcap or G is not a fitted level."""
        check_is_fitted(self, "bias_ms_")
        X = validate_data(self, X, reset=False, dtype=np.float64)
        return self.predict_at(X[:, 0], X[:, 1], X[:, 2], X[:, 3] if X.shape[1] == 4 else None)

    def predict_at(self, bcap, g, kv_length, k=None) -> np.ndarray:
        """Vectorised prediction over broadcast arrays (what the table lookup calls); NaN
        without ``k`` when the model has a draft-forward term: ``base + per_token * kv`` of
        :meth:`line_at`."""
        base, per_token = self.line_at(bcap, g, k)
        return base + per_token * np.asarray(kv_length, dtype=np.float64)

    def line_at(self, bcap, g, k=None) -> tuple[np.ndarray, np.ndarray]:
        """The model as a line in KV at broadcast ``(bcap, g, k)``: ``(base, per_token)`` in ms
        and ms per KV token, so that :meth:`predict_at` is ``base + per_token * kv`` (the same
        operations in the same order, so a caller holding the line gets identical values)."""
        bcap, g, kk = np.broadcast_arrays(np.asarray(bcap, dtype=np.float64),
                                          np.asarray(g, dtype=np.float64),
                                          np.asarray(np.nan if k is None else k,
                                                     dtype=np.float64))
        kk = None if k is None else kk
        bl, gl = self.bcap_levels_.astype(np.float64), self.g_levels_.astype(np.float64)
        a = level_lookup(bcap, bl, self.alpha_ms_)
        t = level_lookup(g, gl, self.theta_ms_)
        axis, per_level = KV_FORMS[self.kv_term]
        if axis == "rows":  # the requests a verify serves: NaN without k
            x, levels = (np.full(bcap.shape, np.nan) if kk is None else g / (kk + 1.0)), None
        else:
            x, levels = (bcap, bl) if axis == "bcap" else (g, gl)
        if per_level:
            slope = level_lookup(x, levels, self.beta_ms_)
        else:  # NaN off the levels of either axis, as the categorical terms are
            slope = np.where(np.isnan(a + t), np.nan, self.beta_ms_[0])
        extra = k_part(self.k_term, self.delta_ms_, bl, bcap, kk, g)
        return self.bias_ms_ + a + t + extra, slope * x

    def additive_at(self, kv_length: float) -> tuple[float, np.ndarray, np.ndarray]:
        """``(bias, alpha [nb], theta [ng])`` of the additive model this one is at one KV length
        (the slope term folded into ``alpha`` or ``theta``), re-referenced to the smallest Bcap
        and G: what an engine's additive table holds for that KV."""
        check_is_fitted(self, "bias_ms_")
        kv = float(kv_length)
        alpha, theta = self.alpha_ms_.astype(np.float64), self.theta_ms_.astype(np.float64)
        axis, per_level = KV_FORMS[self.kv_term]
        if axis == "rows":  # G / (k + 1): not additive in (Bcap, G) without the round's k
            raise InputError("kv_model.kv_term", self.kv_term,
                             "a slope over Bcap or G (a shared_rows KV model prices G / (k + 1) "
                             "requests: a draft_step table's lookup, with k)")
        levels = self.bcap_levels_ if axis == "bcap" else self.g_levels_
        beta = self.beta_ms_ if per_level else np.full(len(levels), self.beta_ms_[0])
        term = beta * levels.astype(np.float64) * kv
        if axis == "bcap":
            alpha = alpha + term
        else:
            theta = theta + term
        return float(self.bias_ms_ + alpha[0] + theta[0]), alpha - alpha[0], theta - theta[0]

    @classmethod
    def from_params(
        cls, bias_ms, bcap_levels, alpha_ms, g_levels, theta_ms, beta_ms, delta_ms=(), *,
        kv_term: str | None = None, combine="median", k_term: str | None = None,
    ) -> KVCostModel:
        """Rebuild a fitted model from stored parameters; ``kv_term`` None infers the G forms
        from ``len(beta_ms)`` (``shared`` for one slope, else ``per_g``), ``k_term`` None from
        ``len(delta_ms)``."""
        beta = np.asarray(beta_ms, dtype=np.float64)
        delta = np.asarray(delta_ms, dtype=np.float64).reshape(-1)
        if kv_term is None:
            kv_term = "shared" if len(beta) == 1 else "per_g"
        if kv_term not in KV_TERMS:
            raise InputError("kv_term", kv_term, f"one of {list(KV_TERMS)}")
        m = cls(kv_term=kv_term, combine=combine, k_term=k_term or k_term_of(len(delta)))
        check_k_term(m.k_term)
        if m.k_term not in K_TERMS_BASE:
            raise InputError("k_term", m.k_term, f"one of {list(K_TERMS_BASE)} (a KV model)")
        m.delta_ms_ = delta
        m.bias_ms_ = float(bias_ms)
        m.bcap_levels_ = np.asarray(bcap_levels, dtype=np.int64)
        m.alpha_ms_ = np.asarray(alpha_ms, dtype=np.float64)
        m.g_levels_ = np.asarray(g_levels, dtype=np.int64)
        m.theta_ms_ = np.asarray(theta_ms, dtype=np.float64)
        m.beta_ms_ = beta
        m.n_features_in_ = 3 if m.k_term == "none" and kv_term not in NEEDS_K else 4
        return m


# ---------------------------------------------------------------- held-out errors, selection


@dataclass(frozen=True)
class KVFit:
    """A selected KV model with its errors (what a table's ``kv_model`` block stores).

    ``points``: one row per (context, Bcap, G): ``context_index, bcap, g, kv_length, step_ms,
    predicted_ms, lopo_ms, loco_ms`` (NaN where a point could not be held out).
    ``candidates``: per ``(kv_term, k_term)`` its leave-one-context-out and leave-one-point-out
    summaries (``k_term`` is ``none`` for rows of one ``k``).
    """

    model: KVCostModel
    points: pd.DataFrame
    residuals: ErrorSummary
    leave_one_point_out: ErrorSummary
    leave_one_context_out: ErrorSummary
    per_context: dict[int, dict[str, ErrorSummary]]
    candidates: dict[tuple[str, str], dict[str, ErrorSummary]]
    selected_by: str


def kv_points(windows: pd.DataFrame, combine: str = "median") -> pd.DataFrame:
    """Combined points of every context: ``context_index, bcap, g, k, kv_length, step_ms``.

    The cost and the KV length of a point come from the same windows, so that the pair lies on
    the model when its windows do (their KV lengths differ: window ``i`` of a point starts
    ``i * window_steps`` rounds further into its interval): ``median`` takes the median window
    by ``step_ms`` (the mean of the two middle ones for an even count) with its own
    ``mean_kv_length``; ``mean`` the mean of both. A median cost paired with the mean KV would
    be off the line by the KV slope times the windows' KV spread.
    """
    if combine not in COMBINE:
        raise InputError("combine", combine, f"one of {list(COMBINE)}")
    keys = ["context_index", "bcap", "g", "k"]
    df = windows[[*keys, "step_ms", "mean_kv_length"]].sort_values([*keys, "step_ms"])
    if combine == "mean":
        out = df.groupby(keys, sort=True).agg(
            kv_length=("mean_kv_length", "mean"), step_ms=("step_ms", "mean")
        )
        return out.reset_index()
    df = df.reset_index(drop=True)
    grp = df.groupby(keys, sort=True)
    n = grp["step_ms"].transform("size").to_numpy()
    pos = grp.cumcount().to_numpy()
    middle = (pos == (n - 1) // 2) | (pos == n // 2)  # one window (odd n) or two (even n)
    out = (
        df[middle]
        .groupby(keys, sort=True)
        .agg(kv_length=("mean_kv_length", "mean"), step_ms=("step_ms", "mean"))
    )
    return out.reset_index()


def _lopo(P: np.ndarray, y: np.ndarray, kv_term: str, k_term: str = "none") -> np.ndarray:
    """Exact leave-one-point-out predictions (PRESS ``e_i / (1 - h_ii)``), NaN if ``h_ii = 1``
    (all NaN when the design is rank-deficient)."""
    bl, gl = np.unique(P[:, 0]), np.unique(P[:, 1])
    D = kv_design(P, bl, gl, kv_term, k_term)
    with single_thread_blas():
        coef, _, rank, _ = np.linalg.lstsq(D, y, rcond=None)
        if rank < D.shape[1]:
            return np.full(len(y), np.nan)
        q, _ = np.linalg.qr(D)
    resid = y - D @ coef
    h = np.einsum("ij,ij->i", q, q)
    out = np.full(len(y), np.nan)
    ok = h < 1.0 - _HAT_TOL
    out[ok] = y[ok] - resid[ok] / (1.0 - h[ok])
    return out


def _loco(ctx: np.ndarray, P: np.ndarray, y: np.ndarray, kv_term: str,
          k_term: str = "none") -> np.ndarray:
    """Each context's points predicted by the model fitted on the other contexts.

    A fold is skipped (NaN) when fewer than two other contexts remain (one context has one KV:
    no slope), or when the remaining grid lacks a level of the held-out points or is
    disconnected or rank-deficient.
    """
    out = np.full(len(y), np.nan)
    contexts = np.unique(ctx)
    if len(contexts) < 3:
        return out
    for c in contexts:
        test = ctx == c
        train_P, train_y = P[~test], y[~test]
        bl, gl = np.unique(train_P[:, 0]), np.unique(train_P[:, 1])
        D = kv_design(train_P, bl, gl, kv_term, k_term)
        with single_thread_blas():
            coef, _, rank, _ = np.linalg.lstsq(D, train_y, rcond=None)
        if rank < D.shape[1]:
            continue
        m = KVCostModel.from_params(*_params(coef, bl, gl, kv_term,
                                             _groups(train_P, bl, gl, k_term)),
                                    kv_term=kv_term, k_term=k_term)
        k = P[test, 3] if P.shape[1] == 4 else None
        out[test] = m.predict_at(P[test, 0], P[test, 1], P[test, 2], k)
    return out


def select_kv_model(windows: pd.DataFrame, *, combine: str = "median") -> KVFit | None:
    """Fit both slope forms on every context's windows and keep the one with the lower
    held-out error (module docstring); None when the model cannot be fitted and checked:
    fewer than :data:`MIN_CONTEXTS` context intervals (with two, leaving one out leaves a single
    KV level and no slope, so the KV term would ship with no held-out error), or a (Bcap, G)
    grid that is not connected across them.

    Parameters
    ----------
    windows : validated measurement rows of all context intervals (``context_index, bcap, g,
        step_ms, mean_kv_length``).
    combine : how repeated windows of a point are combined.
    """
    if windows["context_index"].nunique() < MIN_CONTEXTS:
        return None
    pts = kv_points(windows, combine)
    several_k = pts["k"].nunique() > 1
    cols = ["bcap", "g", "kv_length"] + (["k"] if several_k else [])
    P = pts[cols].to_numpy(dtype=np.float64)
    y = pts["step_ms"].to_numpy(dtype=np.float64)
    ctx = pts["context_index"].to_numpy()
    try:
        check_connected(((int(p[0]), int(p[1])) for p in P), where="kv model grid")
    except InputError:
        return None
    if len(np.unique(P[:, 2])) < 2:
        return None
    held: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    candidates: dict[tuple[str, str], dict[str, ErrorSummary]] = {}
    for k_term in K_TERMS_BASE if several_k else ("none",):
        for term in KV_TERMS:
            if term in NEEDS_K and not several_k:
                continue
            if not _full_rank(P, term, k_term):
                continue
            lopo, loco = _lopo(P, y, term, k_term), _loco(ctx, P, y, term, k_term)
            held[term, k_term] = (lopo, loco)
            candidates[term, k_term] = {
                "leave_one_context_out": ErrorSummary.of(y, loco),
                "leave_one_point_out": ErrorSummary.of(y, lopo),
            }
    if not candidates:
        return None
    (chosen, k_chosen), selected_by = _choose(candidates)
    # Fit on the combined points (one per context, Bcap, G, k), so every point weighs the same.
    model = KVCostModel(kv_term=chosen, combine=combine, k_term=k_chosen).fit(P, y)
    lopo, loco = held[chosen, k_chosen]
    pred = model.predict_at(P[:, 0], P[:, 1], P[:, 2], P[:, 3] if several_k else None)
    out = pts.copy()
    out["predicted_ms"], out["lopo_ms"], out["loco_ms"] = pred, lopo, loco
    per_context = {
        int(c): {
            "residuals": ErrorSummary.of(y[ctx == c], pred[ctx == c]),
            "leave_one_point_out": ErrorSummary.of(y[ctx == c], lopo[ctx == c]),
        }
        for c in np.unique(ctx)
    }
    return KVFit(
        model=model,
        points=out,
        residuals=ErrorSummary.of(y, pred),
        leave_one_point_out=ErrorSummary.of(y, lopo),
        leave_one_context_out=ErrorSummary.of(y, loco),
        per_context=per_context,
        candidates=candidates,
        selected_by=selected_by,
    )


def _full_rank(P: np.ndarray, kv_term: str, k_term: str) -> bool:
    bl, gl = np.unique(P[:, 0]), np.unique(P[:, 1])
    D = kv_design(P, bl, gl, kv_term, k_term)
    with single_thread_blas():
        return int(np.linalg.matrix_rank(D)) == D.shape[1]


def _choose(
    candidates: dict[tuple[str, str], dict[str, ErrorSummary]],
) -> tuple[tuple[str, str], str]:
    """The ``(kv_term, k_term)`` with the lowest held-out error, and which error decided: among
    the forms within :data:`TIE_PCT` of the best, the one with the fewest slopes, then the
    simplest draft-forward term (KV_TERMS, K_TERMS_BASE order)."""
    def order(c):
        return (K_TERMS_BASE.index(c[1]), KV_FORMS[c[0]][1], KV_TERMS.index(c[0]))

    for metric in ("leave_one_context_out", "leave_one_point_out"):
        errs = {c: v[metric].mean_abs_pct for c, v in candidates.items()}
        if all(e is not None for e in errs.values()):
            best = min(errs.values())
            tied = [c for c in candidates if errs[c] <= best + TIE_PCT]
            return min(tied, key=order), metric
    return min(candidates, key=order), "fewest_parameters"
