"""Measurement rows: the tidy record of measured windows that every cost model is fitted on.

One row per measured window, held in a pandas DataFrame (column schema in
``docs/ARCHITECTURE.md`` and :data:`REQUIRED_COLUMNS`). This module owns validating such a frame
(names the bad column, value and expectation), reading and writing it as CSV or parquet, and
combining repeated windows of one grid point robustly.

Combining repeated windows: the point cost is the **median** of the windows' ``step_ms`` (one slow
window, e.g. a GC pause or a clock hiccup, moves a median of three by nothing), and the spread
``max - min`` in ms is kept next to it so that noisy points are visible in the fit report.

Each window counts once: rows with the same window identity (:data:`WINDOW_IDENTITY`, with
``mode`` when the frame has it) are kept first-come (as ``speccal calibrate --resume`` keeps the
first journal line of a window) and the others dropped with a :class:`DuplicateWindowWarning`
saying how many and whether their timings differed. :func:`check_shapes` refuses rows no round
of the table's mode and draft width can produce (``k > w``; ``target_verify``: ``k != w`` or
``G`` outside ``[Bcap, Bcap * (w + 1)]``; ``draft_step``: ``G`` outside
``[B * (k + 1), Bcap * (k + 1)]``, i.e. ``G = Bcap * (k + 1)`` for a full batch).
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from speccal.base.atomic import write_bytes_atomic
from speccal.base.errors import GridError, InputError, show
from speccal.costmodel.compat import SpeccalWarning
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
    "loop": "str",  # the engine's round loop (pipelined | synchronous)
    "device_ms": "float",  # device span of the window (CUDA events between its edges)
    "wall_over_device": "float",  # elapsed_s over that span
    # routed-expert targets: distinct experts per routed layer and round, the window's mean
    "experts_activated": "float",
    # the longest request's KV length, the window's mean over its rounds (speccal.costmodel.spread)
    "mean_kv_max_length": "float",
    # a spread point's KV layout (speccal.calibrate.grid.spread_points); absent: calibrated
    "layout": "str",
}

MODES = ("draft_step", "target_verify")
#: The mode of rows without a ``mode`` column: ``speccal calibrate``'s default.
DEFAULT_MODE = "target_verify"
#: Columns naming one measured window (plus ``mode`` when present): a window is counted once.
WINDOW_IDENTITY = ("context_index", "bcap", "g", "k", "window_index")


class DuplicateWindowWarning(SpeccalWarning):
    """Rows repeating a window identity were dropped (the first row of each window is kept)."""


#: ``step_ms`` is derived from ``elapsed_s``; a larger disagreement means the row was edited or
#: corrupted (measurement rows, journal lines and table windows alike).
STEP_MS_RTOL = 1e-6

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
        raise InputError(
            "measurements.columns",
            None,
            f"all of {', '.join(REQUIRED_COLUMNS)}",
            hint=f"missing: {', '.join(missing)}",
            found=", ".join(str(c) for c in df.columns) or "no columns",
        )
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
    out = drop_duplicate_windows(out)
    return out.sort_values(
        ["context_index", "bcap", "g", "window_index"], kind="stable"
    ).reset_index(drop=True)


def row_problem(
    row: Mapping[str, Any], extra_columns: Mapping[str, str] | None = None
) -> tuple[str, Any, str] | None:
    """The first problem of one measurement row given as a plain mapping (a journal line), or
    None: ``(column, value, expected)``.

    The rules of :func:`validate_measurements`, per row and without coercion: every key a
    known column, the window identity (:data:`WINDOW_IDENTITY`) present, integers that are
    JSON integers (not ``true``, not ``2.0``) above their bound, floats finite and positive
    (``mean_kv_length`` >= 0), strings strings, ``num_requests <= bcap``, ``min_kv_length <=
    max_kv_length`` and ``step_ms == 1000 * elapsed_s / window_steps``. Columns other than the
    identity may be absent (``validate_measurements`` names a missing one). ``extra_columns``:
    more known columns (``{name: "int" | "float" | "str"}``) a caller's rows carry.
    """
    kinds = {**REQUIRED_COLUMNS, **OPTIONAL_COLUMNS, **(extra_columns or {})}
    for col, value in row.items():
        if col not in kinds:
            return str(col), value, "no such column (unknown key)"
    for col in WINDOW_IDENTITY:
        if col not in row:
            return col, "missing", "a required column"
    for col, kind in kinds.items():
        if col not in row:
            continue
        v = row[col]
        if kind == "str":
            if not isinstance(v, str):
                return col, v, "a string"
            if col == "mode" and v not in MODES:
                return col, v, f"one of {list(MODES)}"
        elif kind == "int":
            if not isinstance(v, int) or isinstance(v, bool):
                return col, v, "an integer"
            if v < _INT_MIN.get(col, 0):
                return col, v, f"an integer >= {_INT_MIN.get(col, 0)}"
        else:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                return col, v, "a finite number"
            if col == "mean_kv_length" and v < 0:
                return col, v, "a number >= 0"
            if col != "mean_kv_length" and v <= 0:
                return col, v, "a number > 0"
    if "num_requests" in row and "bcap" in row and row["num_requests"] > row["bcap"]:
        return "num_requests", row["num_requests"], f"<= bcap ({row['bcap']})"
    lo, hi = row.get("min_kv_length"), row.get("max_kv_length")
    if lo is not None and hi is not None and lo > hi:
        return "min_kv_length", lo, f"<= max_kv_length ({hi})"
    if all(c in row for c in ("step_ms", "elapsed_s", "window_steps")):
        expected = 1000.0 * row["elapsed_s"] / row["window_steps"]
        if not math.isclose(row["step_ms"], expected, rel_tol=STEP_MS_RTOL, abs_tol=0.0):
            return "step_ms", row["step_ms"], f"1000 * elapsed_s / window_steps = {show(expected)}"
    return None


def _check_consistency(df: pd.DataFrame) -> None:
    expected = 1000.0 * df["elapsed_s"].to_numpy() / df["window_steps"].to_numpy()
    off = ~np.isclose(df["step_ms"].to_numpy(), expected, rtol=STEP_MS_RTOL, atol=0.0)
    if off.any():
        i = int(np.flatnonzero(off)[0])
        raise InputError(
            f"measurements.step_ms[row {i}]",
            float(df["step_ms"].iloc[i]),
            f"1000 * elapsed_s / window_steps = {show(expected[i])}",
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


def drop_duplicate_windows(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with each window identity once (its first row); warns when rows were dropped.

    Warns
    -----
    DuplicateWindowWarning
        Naming how many rows were dropped, how many of them had other timings than the row
        kept, and the first repeated identity.
    """
    key = [c for c in ("mode", *WINDOW_IDENTITY) if c in df.columns]
    dup = df.duplicated(key, keep="first")
    if not dup.any():
        return df
    kept = df[~dup].set_index(key)["step_ms"]
    dropped = df[dup]
    other = (
        dropped["step_ms"].to_numpy()
        != kept.loc[[tuple(r) for r in dropped[key].itertuples(index=False)]].to_numpy()
    )
    first = dropped.iloc[0]
    ident = ", ".join(f"{c}={first[c]}" for c in key)
    warnings.warn(
        DuplicateWindowWarning(
            f"measurements: dropped {int(dup.sum())} row(s) repeating a window identity "
            f"({', '.join(key)}), {int(other.sum())} of them with other timings; each window "
            f"counts once, its first row kept (first repeated: {ident})"
        ),
        stacklevel=3,
    )
    return df[~dup].reset_index(drop=True)


def check_shapes(df: pd.DataFrame, mode: str, draft_width: int) -> None:
    """Refuse rows that no round of ``mode`` at draft width ``w`` can produce.

    Parameters
    ----------
    df : validated measurement rows.
    mode : ``draft_step`` (full verification of ``k`` drafts, ``0 <= k <= w``: ``B * (k + 1)``
        rows padded up to a captured ``G``, so ``B * (k + 1) <= G <= Bcap * (k + 1)``, the
        bucket's own full width being captured; ``G = Bcap * (k + 1)`` when ``B = Bcap``, as in
        calibration) or ``target_verify`` (the draft runs all ``w`` steps: ``k = w``; ``G`` is a
        trimmed verify budget in ``[Bcap, Bcap * (w + 1)]``).
    draft_width : ``w``.

    Raises
    ------
    InputError
        Naming the first offending row, its value and the rule: ``num_requests > bcap``,
        ``k > w``, or a shape outside the mode.
    """
    if mode not in MODES:
        raise InputError("mode", mode, f"one of {list(MODES)}")
    w = int(draft_width)
    bcap, g, k = (df[c].to_numpy() for c in ("bcap", "g", "k"))
    checks = [
        ("num_requests", df["num_requests"].to_numpy() > bcap, lambda i: f"<= bcap ({bcap[i]})"),
        ("k", k > w, lambda i: f"k <= draft_width = {w}"),
    ]
    if mode == "target_verify":
        checks += [
            (
                "k",
                k != w,
                lambda i: (
                    f"k = draft_width = {w} in target_verify mode (the draft runs all w steps)"
                ),
            ),
            (
                "g",
                (g < bcap) | (g > bcap * (w + 1)),
                lambda i: (
                    f"a verify budget in [{bcap[i]}, {bcap[i] * (w + 1)}] for bcap {bcap[i]} "
                    f"(Bcap .. Bcap * (w + 1), w = {w}) in target_verify mode"
                ),
            ),
        ]
    else:
        rows = df["num_requests"].to_numpy() * (k + 1)
        checks.append(
            (
                "g",
                (g < rows) | (g > bcap * (k + 1)),
                lambda i: (
                    f"G in [num_requests * (k + 1), bcap * (k + 1)] = [{rows[i]}, "
                    f"{bcap[i] * (k[i] + 1)}] in draft_step mode (full verification of k drafts, "
                    "padded to a captured G)"
                ),
            )
        )
    for col, bad, expected in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            row = df.iloc[i]
            where = ", ".join(f"{c} {int(row[c])}" for c in WINDOW_IDENTITY)
            raise InputError(
                f"measurements.{col}",
                int(row[col]),
                expected(i),
                hint=f"the window at {where}; {int(bad.sum())} row(s) like it",
            )


def draft_width_of(df: pd.DataFrame, mode: str) -> int:
    """The draft width the rows imply: ``target_verify`` rows all have ``k = w``; ``draft_step``
    rows measure ``k = 1 .. w`` (each candidate on its own), so ``w`` is the largest ``k``.

    Raises
    ------
    InputError
        ``target_verify`` rows with more than one ``k``, or rows whose largest ``k`` is 0.
    """
    ks = sorted(int(v) for v in df["k"].unique())
    if mode == "target_verify" and len(ks) > 1:
        raise InputError(
            "measurements.k", ks, "one k (= the draft width w) in every target_verify row"
        )
    if ks[-1] < 1:
        raise InputError("measurements.k", ks, "a row with k >= 1 to read the draft width from")
    return ks[-1]


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
    One row per ``(context_index, bcap, g, k)`` (a draft_step grid measures one G under several
    k) with ``num_requests`` (the largest), ``n_windows``, ``step_ms`` (median over windows),
    ``spread_ms`` (max - min over windows) and ``mean_kv_length`` (mean).
    """
    grouped = df.groupby(["context_index", "bcap", "g", "k"], sort=True)
    out = grouped.agg(
        num_requests=("num_requests", "max"),
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
