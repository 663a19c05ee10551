"""Measurement rows: validation of bad rows, CSV/parquet round trip, robust window combining."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from speccal.base.errors import GridError, InputError
from speccal.costmodel.measurements import (
    REQUIRED_COLUMNS,
    combine_windows,
    read_measurements,
    validate_measurements,
    write_measurements,
)

from .helpers import measurements


def test_synthetic_rows_satisfy_the_schema():
    df = measurements(windows_per_point=2)
    assert set(REQUIRED_COLUMNS) <= set(df.columns)
    assert np.allclose(df.step_ms, 1000 * df.elapsed_s / df.window_steps)
    assert (df.k == df.g // df.bcap - 1).all()


def test_empty_frame_is_refused():
    with pytest.raises(InputError, match="at least one measured window"):
        validate_measurements(measurements().iloc[0:0])


def test_missing_column_is_named():
    with pytest.raises(InputError, match="elapsed_s"):
        validate_measurements(measurements().drop(columns=["elapsed_s"]))


@pytest.mark.parametrize(
    ("column", "value", "expected"),
    [
        ("step_ms", np.nan, "a finite number"),
        ("elapsed_s", -0.5, "> 0"),
        ("bcap", 0, ">= 1"),
        ("g", 2.5, "an integer"),
        ("window_steps", "many", "a finite number"),
    ],
)
def test_bad_value_names_column_row_and_expectation(column, value, expected):
    df = measurements().astype({column: object})
    df.loc[3, column] = value
    with pytest.raises(InputError) as info:
        validate_measurements(df)
    msg = str(info.value)
    assert f"measurements.{column}[row 3]" in msg and expected in msg


def test_step_ms_must_match_elapsed():
    df = measurements()
    df.loc[0, "step_ms"] *= 1.01
    with pytest.raises(InputError, match="1000 \\* elapsed_s / window_steps"):
        validate_measurements(df)


def test_one_context_index_with_two_intervals_is_a_grid_error():
    df = measurements()
    df.loc[0, "max_kv_length"] = 8192
    with pytest.raises(GridError, match="context_index=0"):
        validate_measurements(df)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_round_trip_through_files(tmp_path, suffix):
    df = measurements(noise_ms=0.1)
    path = write_measurements(df, tmp_path / f"m{suffix}")
    back = read_measurements(path)
    pd.testing.assert_frame_equal(back, validate_measurements(df), check_exact=True)


def test_unknown_suffix_and_missing_file(tmp_path):
    with pytest.raises(InputError, match=".csv or .parquet"):
        read_measurements(tmp_path / "nope.csv")
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(InputError, match="ending in .csv or .parquet"):
        read_measurements(tmp_path / "m.txt")


def test_garbage_csv_is_an_input_error(tmp_path):
    (tmp_path / "m.csv").write_bytes(b"\x00\x01 not,a\ncsv")
    with pytest.raises(InputError):
        read_measurements(tmp_path / "m.csv")


def test_median_ignores_one_outlier_window_and_reports_spread():
    df = measurements(windows_per_point=3)
    # One slow window (e.g. a GC pause) at one point; the median of three must not move.
    i = df.index[(df.bcap == 2) & (df.g == 4) & (df.window_index == 1)][0]
    df.loc[i, "elapsed_s"] *= 10
    df.loc[i, "step_ms"] *= 10
    pts = combine_windows(validate_measurements(df)).set_index(["bcap", "g"])
    clean = combine_windows(measurements(windows_per_point=3)).set_index(["bcap", "g"])
    assert pts.loc[(2, 4), "step_ms"] == pytest.approx(clean.loc[(2, 4), "step_ms"])
    assert pts.loc[(2, 4), "spread_ms"] == pytest.approx(9 * clean.loc[(2, 4), "step_ms"])
    assert (pts.n_windows == 3).all()
