"""The additive cost model: ``cost(Bcap, G[, k]) = bias + alpha(Bcap) + theta(G) [+ (k - 1) * delta]``.

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

**The draft-forward term** (``k_term``; draft_step tables): a draft-step round runs ``k`` draft
forwards at ``Bcap`` before its verify of ``G`` rows, and a partly filled bucket runs the same
``G`` under different ``k`` (Bcap 8 at k = 1 with 6 requests verifies 12 rows, as Bcap 4 does at
k = 2 with 4; the first round runs one draft forward, the second two). Folding ``k`` into
``theta(G)`` prices both alike. With ``X = [[bcap, g, k]]`` the model adds ``(k - 1) * delta``:

- ``none``: no term (``theta`` absorbs it; every target_verify table: ``k = w`` always);
- ``shared``: one ``delta`` for every Bcap (a draft forward costs the same at every bucket);
- ``per_bcap``: one ``delta`` per Bcap level (each bucket's captured draft graph has its own
  cost);
- ``shared_rows`` / ``per_bcap_rows``: either, plus ``rho * G / (k + 1)``, the requests one
  verify serves (padding included): at one KV interval the verify's attention reads each
  request's KV once, whatever its rows, so in a partly filled bucket part of the cost follows
  the requests, which neither ``theta(G)`` nor ``alpha(Bcap)`` separates. ``rho`` is the last
  value of ``delta_ms``. On two dense-2b draft-step calibrations of an H100 (bench/RESULTS.md,
  ``bench/fit_terms.py``) the worst context's leave-one-point-out error fell from 3.62 / 3.75 %
  (``per_bcap``) to 1.39 / 1.39 % (``shared_rows``).

``(k - 1)`` rather than ``k`` keeps ``bias`` the measured corner cell's cost (the smallest G is
``Bcap * 2``, a k = 1 round). A term the points cannot separate from ``alpha`` and ``theta``
(every Bcap seen at one k only, or k tied to G) leaves the design rank-deficient and is refused
with a ``GridError`` naming ``k_term``; which form a table gets is chosen by held-out error
(``speccal.costmodel.diagnostics.select_additive``). ``delta_ms_`` is ``[0]`` (``none``),
``[1]`` or ``[nb]``.
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from speccal.base.errors import GridError, InputError
from speccal.costmodel.estimator import check_xy, combine_points, single_thread_blas
from speccal.costmodel.grid import check_connected
from speccal.costmodel.lookup import k_part, k_term_of, level_lookup

#: Forms of the draft-forward term, fewest parameters first (the tie-break order).
K_TERMS = ("none", "shared", "per_bcap", "shared_rows", "per_bcap_rows")
#: The forms without the requests column (the KV model's; it has its own rows slope).
K_TERMS_BASE = ("none", "shared", "per_bcap")


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


def k_columns(points: np.ndarray, bcap_levels: np.ndarray, k_term: str,
              groups: np.ndarray | None = None) -> np.ndarray:
    """The draft-forward columns ``[m, 0 | 1 | n_groups]`` of ``points`` ``[m, 3]`` (bcap, g,
    k): ``(k - 1)``, shared or one column per group of Bcap levels (``groups`` ``[nb]``: the
    group of each level, :func:`delta_groups`; default one group per level)."""
    if k_term == "none":
        return np.zeros((len(points), 0))
    base = k_term.removesuffix("_rows")
    extra = points[:, 2] - 1.0
    if base == "shared":
        S = extra[:, None]
    else:
        if groups is None:
            groups = np.arange(len(bcap_levels))
        S = np.zeros((len(points), int(groups.max()) + 1))
        S[np.arange(len(points)), groups[np.searchsorted(bcap_levels, points[:, 0])]] = extra
    if base != k_term:  # the requests one verify serves
        S = np.hstack([S, (points[:, 1] / (points[:, 2] + 1.0))[:, None]])
    return S


def delta_groups(points: np.ndarray, bcap_levels: np.ndarray, g_levels: np.ndarray) -> np.ndarray:
    """``[nb]`` group of each Bcap level's draft-forward slope in the ``per_bcap`` form.

    A bucket's own slope is identifiable only where the points separate its ``k`` from ``G``
    (a partly filled bucket running a G at another k than a full one). Bucket 1 never is
    (every G it runs is its own: one bucket, one request), nor is a bucket whose G levels no
    other k shares; such a slope is tied to the next bucket's: starting from the smallest,
    levels are merged into their neighbour until the design has full rank (one group left:
    the ``shared`` form)."""
    groups = np.arange(len(bcap_levels))
    base = design_matrix(points[:, :2], bcap_levels, g_levels)
    while True:
        D = np.hstack([base, k_columns(points, bcap_levels, "per_bcap", groups)])
        with single_thread_blas():
            if int(np.linalg.matrix_rank(D)) == D.shape[1] or groups.max() == 0:
                return groups
        # merge the smallest group whose removal would lift the rank: try from the smallest
        for j in range(int(groups.max())):
            trial = np.where(groups > j, groups - 1, groups)
            D = np.hstack([base, k_columns(points, bcap_levels, "per_bcap", trial)])
            with single_thread_blas():
                if int(np.linalg.matrix_rank(D)) == D.shape[1]:
                    return trial
        groups = np.where(groups > 0, groups - 1, groups)  # nothing helped alone: merge 0 and 1


def full_design(points: np.ndarray, bcap_levels: np.ndarray, g_levels: np.ndarray,
                k_term: str) -> np.ndarray:
    """:func:`design_matrix` followed by :func:`k_columns` (``points`` with a k column when
    ``k_term`` is not ``none``; ``per_bcap`` with the slopes :func:`delta_groups` ties)."""
    D = design_matrix(points[:, :2], bcap_levels, g_levels)
    if k_term == "none":
        return D
    groups = (delta_groups(points, bcap_levels, g_levels)
              if k_term.startswith("per_bcap") else None)
    return np.hstack([D, k_columns(points, bcap_levels, k_term, groups)])


def check_k_term(k_term: str) -> None:
    if k_term not in K_TERMS:
        raise InputError("k_term", k_term, f"one of {list(K_TERMS)}")


class AdditiveCostModel(RegressorMixin, BaseEstimator):
    """Additive step cost ``bias + alpha(Bcap) + theta(G)`` in ms, categorical levels.

    Parameters
    ----------
    combine : {"median", "mean"}
        How repeated windows of one (Bcap, G) point are combined before the least-squares fit.
    k_term : {"none", "shared", "per_bcap", "shared_rows", "per_bcap_rows"}
        The draft-forward term (module docstring); anything but ``none`` needs ``X`` with a
        ``k`` column.

    Attributes
    ----------
    bias_ms_ : float, cost at (smallest Bcap, smallest G).
    bcap_levels_, alpha_ms_ : ndarray [nb], Bcap levels and their offsets (first is 0).
    g_levels_, theta_ms_ : ndarray [ng], G levels and their offsets (first is 0).
    points_ : ndarray [m, 2 | 3], combined (bcap, g[, k]) points; ``point_ms_`` [m] their
        cost; ``n_windows_`` [m] windows per point.
    delta_ms_ : ndarray [0 | 1 | nb] (+ 1 for the rows forms: rho last), the draft-forward term
        per extra draft forward.
    """

    def __init__(self, *, combine: str = "median", k_term: str = "none"):
        self.combine = combine
        self.k_term = k_term

    def fit(self, X, y):
        """Fit on ``X = [[bcap, g]]`` or ``[[bcap, g, k]]``, ``y`` = step ms; returns ``self``.

        With a ``k`` column, points are combined per (Bcap, G, k). Raises ``GridError`` when
        the (Bcap, G) grid is disconnected or the ``k_term`` cannot be separated from the
        other terms (rank-deficient design).
        """
        check_k_term(self.k_term)
        X, y = check_xy(self, X, y, fit=True, k_column=True)
        if self.k_term != "none" and X.shape[1] != 3:
            raise InputError("X", f"n_features = {X.shape[1]}",
                             f"3 columns [bcap, g, k] for k_term {self.k_term!r}")
        keys, value, count = combine_points(X, y, self.combine, tuple(range(X.shape[1])))
        check_connected(((int(p[0]), int(p[1])) for p in keys), where="additive grid")
        bl = np.unique(keys[:, 0])
        gl = np.unique(keys[:, 1])
        groups = delta_groups(keys, bl, gl) if self.k_term.startswith("per_bcap") else None
        D = np.hstack([design_matrix(keys[:, :2], bl, gl),
                       k_columns(keys, bl, self.k_term, groups)])
        with single_thread_blas():
            coef, _, rank, _ = np.linalg.lstsq(D, value, rcond=None)
        if rank < D.shape[1] and self.k_term != "none":  # a connected grid has full rank
            raise GridError(
                "k_term", self.k_term,
                "a draft-forward term the points separate from alpha(Bcap) and theta(G) (each "
                "Bcap measured at two or more k, with G levels shared across k)")
        nb, ng = len(bl), len(gl)
        self.bias_ms_ = float(coef[0])
        self.bcap_levels_ = bl.astype(np.int64)
        self.alpha_ms_ = np.concatenate([[0.0], coef[1:nb]])
        self.g_levels_ = gl.astype(np.int64)
        self.theta_ms_ = np.concatenate([[0.0], coef[nb : nb + ng - 1]])
        delta = np.asarray(coef[nb + ng - 1 :], dtype=np.float64)
        rows = self.k_term.endswith("_rows")
        if groups is not None:  # one per Bcap level (then rho, the rows forms' last)
            delta = np.concatenate([delta[:-1][groups], delta[-1:]]) if rows else delta[groups]
        self.delta_ms_ = delta
        self.points_ = keys.astype(np.int64)
        self.point_ms_ = value
        self.n_windows_ = count.astype(np.int64)
        return self

    def predict(self, X) -> np.ndarray:
        """Step cost in ms; NaN where the row's Bcap or G is not a measured level (a k-term
        model needs the ``k`` column)."""
        check_is_fitted(self, "bias_ms_")
        X = check_xy(self, X, fit=False, k_column=True)
        return self._predict_levels(X[:, 0], X[:, 1], X[:, 2] if X.shape[1] == 3 else None)

    def _predict_levels(self, bcap, g, k=None) -> np.ndarray:
        a = level_lookup(bcap, self.bcap_levels_.astype(np.float64), self.alpha_ms_)
        t = level_lookup(g, self.g_levels_.astype(np.float64), self.theta_ms_)
        return self.bias_ms_ + a + t + self._k_part(bcap, k, g)

    def _k_part(self, bcap, k, g) -> np.ndarray | float:
        if k is None and self.k_term != "none":
            raise InputError("k", None, f"the draft forwards of each row (k_term {self.k_term!r})")
        return k_part(self.k_term, self.delta_ms_, self.bcap_levels_.astype(np.float64), bcap, k,
                      g)

    @property
    def n_params_(self) -> int:
        """Fitted parameters: bias, the free alpha and theta levels and the delta term."""
        return 1 + len(self.alpha_ms_) - 1 + len(self.theta_ms_) - 1 + len(self.delta_ms_)

    @classmethod
    def from_params(
        cls, bias_ms, bcap_levels, alpha_ms, g_levels, theta_ms, *, combine: str = "median",
        k_term: str | None = None, delta_ms=(),
    ) -> AdditiveCostModel:
        """Rebuild a fitted model from stored parameters (tables persist arrays, never pickles);
        ``k_term`` None infers it from ``len(delta_ms)`` (the forms without a rows term)."""
        delta = np.asarray(delta_ms, dtype=np.float64).reshape(-1)
        m = cls(combine=combine, k_term=k_term or k_term_of(len(delta)))
        check_k_term(m.k_term)
        m.bias_ms_ = float(bias_ms)
        m.bcap_levels_ = np.asarray(bcap_levels, dtype=np.int64)
        m.alpha_ms_ = np.asarray(alpha_ms, dtype=np.float64)
        m.g_levels_ = np.asarray(g_levels, dtype=np.int64)
        m.theta_ms_ = np.asarray(theta_ms, dtype=np.float64)
        m.delta_ms_ = delta
        m.n_features_in_ = 3 if m.k_term != "none" else 2
        return m
