"""Shared input handling of the cost-model estimators (``SPSCostModel``, ``AdditiveCostModel``).

Both estimators take the same design so that tables, diagnostics and replay treat them alike:

- ``X``: ``[n_windows, 2]``, columns ``[bcap, g]``: the physical draft request bucket and the
  physical target graph rows of each measured window. The estimators only need finite numbers
  (levels are matched exactly); integrality and positivity are checked where measurements enter
  (``speccal.costmodel.measurements.validate_measurements``).
- ``y``: ``[n_windows]``, the measured full-step cost in **milliseconds** (``step_ms``), > 0.

Repeated windows of one grid point are combined before fitting (median by default, see
``combine``): every grid point then weighs the same in the fit, however many windows it had.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.utils.validation import check_array, validate_data
from threadpoolctl import ThreadpoolController

from speccal.base.errors import InputError

COMBINE = ("median", "mean")

_CONTROLLER = None


def single_thread_blas():
    """Context manager limiting BLAS to one thread.

    The least-squares problems here are small (a few hundred parameters at most): OpenBLAS
    threads give nothing on them, and on a loaded 2-core machine their spinning made one
    1,000-point fit vary from 6 ms to 900 ms (bench/bench_fit.py).
    """
    global _CONTROLLER
    if _CONTROLLER is None:
        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api="blas")


def check_xy(estimator, X, y=None, *, fit: bool, k_column: bool = False):
    """Validate ``X`` (and ``y`` when given) with sklearn, then the physical constraints.

    With ``fit=True`` ``y`` is required and ``n_features_in_`` is reset. Returns ``X`` as
    ``float64 [n, 2]``, and ``(X, y)`` with ``y`` as ``float64 [n]`` when fitting. ``y`` only has
    to be finite here; positive step costs are checked where measurements enter. With
    ``k_column`` a third column (``k``, draft forwards) is accepted too.
    """
    if not fit and k_column:  # a model without a k term ignores a k column, and vice versa
        X = check_array(X, dtype=np.float64)
    elif not fit:
        X = validate_data(estimator, X, reset=False, dtype=np.float64)
    else:
        if y is None:
            raise ValueError(
                f"{type(estimator).__name__} requires y to be passed, but the target y is None"
            )
        X, y = validate_data(estimator, X, y, reset=True, dtype=np.float64, y_numeric=True)
    if X.shape[1] != 2 and not (k_column and X.shape[1] == 3):
        raise InputError("X", f"n_features = {X.shape[1]}",
                         "2 columns [bcap, g]" + (" or 3 [bcap, g, k]" if k_column else ""))
    return (X, y) if fit else X


def combine_points(X: np.ndarray, y: np.ndarray, combine: str, key_cols: tuple[int, ...]):
    """Combine repeated rows sharing the same values in ``key_cols``.

    Returns
    -------
    keys : ``[m, len(key_cols)]`` unique keys, sorted lexicographically.
    value : ``[m]`` combined cost (median or mean).
    count : ``[m]`` windows per key.
    """
    if combine not in COMBINE:
        raise InputError("combine", combine, f"one of {list(COMBINE)}")
    keys, inverse, count = np.unique(
        X[:, key_cols], axis=0, return_inverse=True, return_counts=True
    )
    # pandas' grouped median/mean is vectorised (a Python loop per group costs ~20 us each).
    grouped = pd.Series(y).groupby(inverse.reshape(-1), sort=True)
    value = (grouped.median() if combine == "median" else grouped.mean()).to_numpy(np.float64)
    return keys, value, count
