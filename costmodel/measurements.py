"""Measurement rows: the tidy record of measured windows that every cost model is fitted on.

One row per measured window, held in a pandas DataFrame (column schema in
``docs/ARCHITECTURE.md`` and :data:`REQUIRED_COLUMNS`). This module owns validating such a frame
(names the bad column, value and expectation), reading and writing it as CSV or parquet, and
combining repeated windows of one grid point robustly.

Combining repeated windows: the point cost is the **median** of the windows' ``step_ms`` (one slow
window, e.g. a GC pause or a clock hiccup, moves a median of three by nothing), and the spread
``max - min`` in ms is kept next to it so that noisy points are visible in the fit report.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pandas as pd

from speccal.base.atomic import write_bytes_atomic
from speccal.base.errors import GridError, InputError
from speccal.costmodel.grid import check_contexts

#: Required columns and their kind: ``int`` or ``float``.
REQUIRED_COLUMNS: dict[str, str] = {
    "context_index": "int",
    "prefill_tokens": "int",
    "min_kv_length": "int",
    "max_kv_length": "int",
    "bcap": "int",
    "num_requests": "int",
    "g": "int",
    "k": "int",
    "window_index": "int",
    "window_steps": "int",
    "elapsed_s": "float",
    "step_ms": "float",
    "mean_kv_length": "float",
}

#: Optional columns kept when present.
OPTIONAL_COLUMNS: dict[str, str] = {
    "warmup_steps": "int",
    "mode": "str",
    "device": "str",
    "timestamp": "str",
}

MODES = ("draft_step", "target_verify")

# step_ms is derived from elapsed_s; a larger disagreement means the row was edited or corrupted.
_STEP_MS_RTOL = 1e-6

# Lower bounds per integer column (inclusive).
_INT_MIN = {
    "context_index": 0,
    "prefill_tokens": 0,
    "min_kv_length": 0,
    "max_kv_length": 0,
    "bcap": 1,
    "num_requests": 1,
    "g": 1,
    "k": 0,
    "window_index": 0,
    "window_steps": 1,
    "warmup_steps": 0,
}


def validate_measurements(df: pd.DataFrame) -> pd.DataFrame:
    """Check a measurement frame and return a clean copy with canonical dtypes.

    Parameters
    ----------
    df : one row per measured window, with at least :data:`REQUIRED_COLUMNS`.

    Returns
    -------
    A copy with integer columns as ``int64``, float columns as ``float64``, extra columns dropped,
    sorted by ``(context_index, bcap, g, window_index)``.

    Raises
    ------
    InputError
        A missing column, NaN, non-integral, negative or inconsistent value (names column, row and
        value), or an empty frame.
    GridError
        A context index with more than one interval, or overlapping context intervals.
    """
    if not isinstance(df, pd.DataFrame):
        raise InputError("measurements", type(df).__name__, "a pandas DataFrame")
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise InputError("measurements.columns", missing, f"all of {list(REQUIRED_COLUMNS)}")
    if len(df) == 0:
        raise InputError("measurements", "0 rows", "at least one measured window")
    out = pd.DataFrame(index=range(len(df)))
    for col, kind in {**REQUIRED_COLUMNS, **OPTIONAL_COLUMNS}.items():
        if col not in df.columns:
            continue
        values = df[col].reset_index(drop=True)
        if kind == "str":
            if values.isna().any():
                raise InputError(f"measurements.{col}", None, "a string in every row")
            out[col] = values.astype(str)
            continue
        num = pd.to_numeric(values, errors="coerce")
        bad = num.isna() | ~np.isfinite(num.to_numpy(dtype=float, na_value=np.nan))
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise InputError(f"measurements.{col}[row {i}]", values.iloc[i], "a finite number")
        arr = num.to_numpy(dtype=float)
        if kind == "int":
            frac = arr != np.round(arr)
            if frac.any():
                i = int(np.flatnonzero(frac)[0])
                raise InputError(f"measurements.{col}[row {i}]", values.iloc[i], "an integer")
            lo = _INT_MIN[col]
            low = arr < lo
            if low.any():
                i = int(np.flatnonzero(low)[0])
                raise InputError(
                    f"measurements.{col}[row {i}]", values.iloc[i], f"an integer >= {lo}"
                )
            out[col] = arr.astype(np.int64)
        else:
            if col == "mean_kv_length":
                bad_sign = arr < 0
                need = "a number >= 0"
            else:
                bad_sign = arr <= 0
                need = "a number > 0"
            if bad_sign.any():
                i = int(np.flatnonzero(bad_sign)[0])
                raise InputError(f"measurements.{col}[row {i}]", values.iloc[i], need)
            out[col] = arr
    _check_consistency(out)
    check_contexts(context_intervals(out))
    return out.sort_values(
        ["context_index", "bcap", "g", "window_index"], kind="stable"
    ).reset_index(drop=True)


def _check_consistency(df: pd.DataFrame) -> None:
    expected = 1000.0 * df["elapsed_s"].to_numpy() / df["window_steps"].to_numpy()
    off = ~np.isclose(df["step_ms"].to_numpy(), expected, rtol=_STEP_MS_RTOL, atol=0.0)
    if off.any():
        i = int(np.flatnonzero(off)[0])
        raise InputError(
            f"measurements.step_ms[row {i}]",
            float(df["step_ms"].iloc[i]),
            f"1000 * elapsed_s / window_steps = {expected[i]!r}",
        )
    inverted = df["min_kv_length"].to_numpy() > df["max_kv_length"].to_numpy()
    if inverted.any():
        i = int(np.flatnonzero(inverted)[0])
        raise InputError(
            f"measurements.min_kv_length[row {i}]",
            int(df["min_kv_length"].iloc[i]),
            f"<= max_kv_length ({int(df['max_kv_length'].iloc[i])})",
        )
    if "mode" in df.columns:
        modes = sorted(set(df["mode"]))
        if any(m not in MODES for m in modes) or len(modes) > 1:
            raise InputError("measurements.mode", modes, f"one of {list(MODES)} in every row")


def context_intervals(df: pd.DataFrame) -> dict[int, tuple[int, int, int]]:
    """``{context_index: (prefill_tokens, min_kv_length, max_kv_length)}`` of a frame.

    Raises ``GridError`` when one context index carries more than one interval.
    """
    out: dict[int, tuple[int, int, int]] = {}
    cols = ["context_index", "prefill_tokens", "min_kv_length", "max_kv_length"]
    for ci, group in df[cols].drop_duplicates().groupby("context_index"):
        if len(group) != 1:
            found = [tuple(int(v) for v in r) for r in group[cols[1:]].to_numpy()]
            raise GridError(
                f"measurements.context_index={int(ci)}",
                found,
                "one (prefill_tokens, min_kv_length, max_kv_length) per context index",
            )
        row = group.iloc[0]
        out[int(ci)] = (int(row.prefill_tokens), int(row.min_kv_length), int(row.max_kv_length))
    return out


def combine_windows(df: pd.DataFrame) -> pd.DataFrame:
    """Median cost per grid point over its repeated windows.

    Parameters
    ----------
    df : validated measurement rows (see :func:`validate_measurements`).

    Returns
    -------
    One row per ``(context_index, bcap, g)`` with ``k`` (first), ``n_windows``, ``step_ms``
    (median over windows), ``spread_ms`` (max - min over windows) and ``mean_kv_length`` (mean).
    """
    grouped = df.groupby(["context_index", "bcap", "g"], sort=True)
    out = grouped.agg(
        k=("k", "first"),
        n_windows=("step_ms", "size"),
        step_ms=("step_ms", "median"),
        min_ms=("step_ms", "min"),
        max_ms=("step_ms", "max"),
        mean_kv_length=("mean_kv_length", "mean"),
    ).reset_index()
    out["spread_ms"] = out["max_ms"] - out["min_ms"]
    return out.drop(columns=["min_ms", "max_ms"])


def read_measurements(path: str | os.PathLike) -> pd.DataFrame:
    """Read and validate measurement rows from ``.csv`` or ``.parquet``.

    Raises ``InputError`` for a missing, unreadable or wrongly-suffixed file and for bad rows.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError("measurements", str(p), "an existing .csv or .parquet file")
    suffix = p.suffix.lower()
    try:
        if suffix == ".csv":
            df = pd.read_csv(p)
        elif suffix in (".parquet", ".pq"):
            df = pd.read_parquet(p)
        else:
            raise InputError("measurements", str(p), "a file ending in .csv or .parquet")
    except InputError:
        raise
    except Exception as exc:  # pandas/pyarrow raise many types for unreadable files
        raise InputError(
            "measurements", str(p), f"a readable {suffix} file ({type(exc).__name__}: {exc})"
        ) from None
    return validate_measurements(df)


def write_measurements(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Validate and write measurement rows atomically as ``.csv`` or ``.parquet`` (by suffix)."""
    clean = validate_measurements(df)
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".csv":
        data = clean.to_csv(index=False).encode()
    elif suffix in (".parquet", ".pq"):
        buf = io.BytesIO()
        clean.to_parquet(buf, index=False)
        data = buf.getvalue()
    else:
        raise InputError("path", str(p), "a file ending in .csv or .parquet")
    return write_bytes_atomic(p, data)
