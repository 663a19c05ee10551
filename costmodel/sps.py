"""The 1-D SPS cost model: full-step cost as a function of target graph rows G only.

For each measured G the model keeps the combined step cost ``cost_ms(G)`` (median of every window
measured at that G, whatever its Bcap), i.e. steps per second ``SPS(G) = 1000 / cost_ms(G)``.

Between two neighbouring measured G values the cost is **linear in ms** (``np.interp`` on
``cost_ms``; a verify step's cost grows roughly linearly in rows between captured buckets). At a
measured G the lookup returns the measured value exactly. Outside ``[min G, max G]`` the model
never extrapolates: ``predict`` returns NaN, which the table reports as "uncalibrated".

**One curve per k** (draft_step tables): with ``X = [[bcap, g, k]]`` of several ``k`` the
model keeps one curve per ``k`` (a round of ``k`` draft forwards verifying ``G`` rows is not
priced by another ``k``'s curve at that ``G``); ``k_`` is then parallel to ``g_levels_`` (the
curve of ``k`` is the levels where ``k_ == k``, each ascending in G) and ``predict`` needs the
``k`` column. Rows of one ``k`` (every target_verify table) fit one curve, ``k_`` None.

Layout: ``X = [[bcap, g], ...]`` (Bcap is accepted for the shared interface and ignored: the 1-D
table assumes the cost depends on G only), ``y`` = step ms. Fitted: ``g_levels_`` ``[m]``,
``cost_ms_`` ``[m]``, ``n_windows_`` ``[m]``.
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from speccal.costmodel.estimator import check_xy, combine_points
from speccal.costmodel.lookup import sps_curves


class SPSCostModel(RegressorMixin, BaseEstimator):
    """Steps-per-second table over target graph rows G, cost_ms = 1000 / SPS(G).

    Parameters
    ----------
    combine : {"median", "mean"}
        How repeated windows at one G are combined before fitting.

    Attributes
    ----------
    g_levels_ : ndarray [m], measured G values, ascending.
    cost_ms_ : ndarray [m], combined step cost at each G.
    sps_ : ndarray [m], steps per second, ``1000 / cost_ms_``.
    n_windows_ : ndarray [m], windows combined at each G.
    k_ : ndarray [m] or None, the curve (k) of each level (module docstring).
    """

    def __init__(self, *, combine: str = "median"):
        self.combine = combine

    def fit(self, X, y):
        """Fit on ``X = [[bcap, g]]``, ``y`` = step ms; returns ``self``."""
        X, y = check_xy(self, X, y, fit=True, k_column=True)
        per_k = X.shape[1] == 3 and len(np.unique(X[:, 2])) > 1
        keys, value, count = combine_points(X, y, self.combine, (2, 1) if per_k else (1,))
        self.g_levels_ = keys[:, -1].astype(np.int64)
        self.k_ = keys[:, 0].astype(np.int64) if per_k else None
        self.cost_ms_ = value
        self.n_windows_ = count.astype(np.int64)
        return self

    @property
    def sps_(self) -> np.ndarray:
        check_is_fitted(self, "cost_ms_")
        return 1000.0 / self.cost_ms_

    def predict(self, X) -> np.ndarray:
        """Step cost in ms at each row's G; NaN where G is outside the measured range."""
        check_is_fitted(self, "cost_ms_")
        X = check_xy(self, X, fit=False, k_column=True)
        k = X[:, 2] if X.shape[1] == 3 else None
        ks = None if self.k_ is None else self.k_.astype(np.float64)
        return sps_curves(X[:, 1], k, self.g_levels_.astype(np.float64), self.cost_ms_, ks)

    @classmethod
    def from_params(cls, g_levels, cost_ms, *, combine: str = "median", k=None) -> SPSCostModel:
        """Rebuild a fitted model from stored arrays (tables persist arrays, never pickles)."""
        m = cls(combine=combine)
        m.g_levels_ = np.asarray(g_levels, dtype=np.int64)
        m.cost_ms_ = np.asarray(cost_ms, dtype=np.float64)
        m.k_ = None if k is None else np.asarray(k, dtype=np.int64)
        m.n_windows_ = np.ones_like(m.g_levels_)
        m.n_features_in_ = 2 if k is None else 3
        return m
