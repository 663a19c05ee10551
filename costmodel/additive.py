"""The 2-D additive cost model: ``cost(Bcap, G) = bias + alpha(Bcap) + theta(G)``.

``alpha`` and ``theta`` are categorical over the measured levels (no shape is assumed between
buckets). The spec writes the model in seconds; speccal stores every parameter in **milliseconds**
(``cost_s = cost_ms / 1000``, the same model up to scale) because tables and lookups speak ms.

Reference level: ``alpha`` of the **smallest measured Bcap** and ``theta`` of the **smallest
measured G** are fixed at zero, so ``bias`` is the cost of that corner cell. The fit is ordinary
least squares (``numpy.linalg.lstsq``) on the one-hot design ``[1 | onehot(Bcap)[:, 1:] |
onehot(G)[:, 1:]]`` over the combined grid points (median of each point's windows, so every point
weighs the same). The design has full column rank exactly when the bipartite (Bcap, G) graph is
connected (see ``speccal.costmodel.grid``); a disconnected grid is refused with a ``GridError``.

Layout: ``X = [[bcap, g], ...]``, ``y`` = step ms. Fitted: ``bias_ms_``, ``bcap_levels_`` ``[nb]``,
``alpha_ms_`` ``[nb]`` (``alpha_ms_[0] == 0``), ``g_levels_`` ``[ng]``, ``theta_ms_`` ``[ng]``
(``theta_ms_[0] == 0``), and the combined points ``points_`` ``[m, 2]``, ``point_ms_`` ``[m]``,
``n_windows_`` ``[m]``. ``predict`` returns NaN for a Bcap or G that is not a measured level.
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from speccal.costmodel.estimator import check_xy, combine_points, single_thread_blas
from speccal.costmodel.grid import check_connected
from speccal.costmodel.lookup import level_lookup


def design_matrix(points: np.ndarray, bcap_levels: np.ndarray, g_levels: np.ndarray) -> np.ndarray:
    """One-hot design ``[m, 1 + (nb - 1) + (ng - 1)]`` with the smallest levels as reference."""
    nb, ng = len(bcap_levels), len(g_levels)
    bi = np.searchsorted(bcap_levels, points[:, 0])
    gi = np.searchsorted(g_levels, points[:, 1])
    D = np.zeros((len(points), 1 + (nb - 1) + (ng - 1)))
    D[:, 0] = 1.0
    rows = np.arange(len(points))
    mb = bi > 0
    D[rows[mb], bi[mb]] = 1.0
    mg = gi > 0
    D[rows[mg], nb + gi[mg] - 1] = 1.0
    return D


class AdditiveCostModel(RegressorMixin, BaseEstimator):
    """Additive step cost ``bias + alpha(Bcap) + theta(G)`` in ms, categorical levels.

    Parameters
    ----------
    combine : {"median", "mean"}
        How repeated windows of one (Bcap, G) point are combined before the least-squares fit.

    Attributes
    ----------
    bias_ms_ : float, cost at (smallest Bcap, smallest G).
    bcap_levels_, alpha_ms_ : ndarray [nb], Bcap levels and their offsets (first is 0).
    g_levels_, theta_ms_ : ndarray [ng], G levels and their offsets (first is 0).
    points_ : ndarray [m, 2], combined (bcap, g) points; ``point_ms_`` [m] their cost;
        ``n_windows_`` [m] windows per point.
    """

    def __init__(self, *, combine: str = "median"):
        self.combine = combine

    def fit(self, X, y):
        """Fit on ``X = [[bcap, g]]``, ``y`` = step ms; returns ``self``.

        Raises ``GridError`` when the (Bcap, G) grid is disconnected.
        """
        X, y = check_xy(self, X, y, fit=True)
        keys, value, count = combine_points(X, y, self.combine, (0, 1))
        check_connected(((int(b), int(g)) for b, g in keys), where="additive grid")
        bl = np.unique(keys[:, 0])
        gl = np.unique(keys[:, 1])
        D = design_matrix(keys, bl, gl)
        with single_thread_blas():
            coef, *_ = np.linalg.lstsq(D, value, rcond=None)
        nb = len(bl)
        self.bias_ms_ = float(coef[0])
        self.bcap_levels_ = bl.astype(np.int64)
        self.alpha_ms_ = np.concatenate([[0.0], coef[1:nb]])
        self.g_levels_ = gl.astype(np.int64)
        self.theta_ms_ = np.concatenate([[0.0], coef[nb:]])
        self.points_ = keys.astype(np.int64)
        self.point_ms_ = value
        self.n_windows_ = count.astype(np.int64)
        return self

    def predict(self, X) -> np.ndarray:
        """Step cost in ms; NaN where the row's Bcap or G is not a measured level."""
        check_is_fitted(self, "bias_ms_")
        X = check_xy(self, X, fit=False)
        return self._predict_levels(X[:, 0], X[:, 1])

    def _predict_levels(self, bcap, g) -> np.ndarray:
        a = level_lookup(bcap, self.bcap_levels_.astype(np.float64), self.alpha_ms_)
        t = level_lookup(g, self.g_levels_.astype(np.float64), self.theta_ms_)
        return self.bias_ms_ + a + t

    @classmethod
    def from_params(
        cls, bias_ms, bcap_levels, alpha_ms, g_levels, theta_ms, *, combine: str = "median"
    ) -> AdditiveCostModel:
        """Rebuild a fitted model from stored parameters (tables persist arrays, never pickles)."""
        m = cls(combine=combine)
        m.bias_ms_ = float(bias_ms)
        m.bcap_levels_ = np.asarray(bcap_levels, dtype=np.int64)
        m.alpha_ms_ = np.asarray(alpha_ms, dtype=np.float64)
        m.g_levels_ = np.asarray(g_levels, dtype=np.int64)
        m.theta_ms_ = np.asarray(theta_ms, dtype=np.float64)
        m.n_features_in_ = 2
        return m
