"""Fit diagnostics: residuals, leave-one-point-out, leave-one-G-out."""

from __future__ import annotations

import numpy as np
import pytest

from speccal.costmodel.additive import AdditiveCostModel
from speccal.costmodel.diagnostics import diagnose
from speccal.costmodel.measurements import combine_windows
from speccal.costmodel.sps import SPSCostModel
from speccal.costmodel.synthetic import make_measurements

from .helpers import measurements


def _fit(cls, df):
    return cls().fit(df[["bcap", "g"]].to_numpy(float), df["step_ms"].to_numpy())


def test_closed_form_lopo_equals_explicit_refits():
    df = measurements(windows_per_point=2, noise_ms=0.1, seed=5)
    d = diagnose(_fit(AdditiveCostModel, df), df)
    pts = combine_windows(df)
    checked = 0
    for i, row in pts.iterrows():
        rest = df[~((df.bcap == row.bcap) & (df.g == row.g))]
        try:
            m = _fit(AdditiveCostModel, rest)
            refit = m.predict([[row.bcap, row.g]])[0]
        except ValueError:
            refit = np.nan
        lopo = d.points.loc[i, "lopo_ms"]
        if np.isnan(refit):
            assert np.isnan(lopo), (row.bcap, row.g)
        else:
            assert lopo == pytest.approx(refit, abs=1e-9)
            checked += 1
    assert checked >= 8
    assert d.leave_one_point_out.n_evaluated == checked


def test_sps_lopo_equals_explicit_refits():
    df = measurements(windows_per_point=3, noise_ms=0.1, seed=8)
    m = _fit(SPSCostModel, df)
    d = diagnose(m, df)
    for i, row in combine_windows(df).iterrows():
        rest = df[~((df.bcap == row.bcap) & (df.g == row.g))]
        refit = _fit(SPSCostModel, rest).predict([[row.bcap, row.g]])[0]
        np.testing.assert_allclose(d.points.loc[i, "lopo_ms"], refit, rtol=0, atol=1e-12)
    assert 0 < d.leave_one_point_out.n_skipped < len(d.points)


def test_noise_free_additive_has_zero_residuals_and_exact_logo_on_linear_theta():
    bcaps, gs = (1, 2, 4), (2, 4, 6, 8, 10, 12)
    pts = [(b, g) for b in bcaps for g in gs]
    df = make_measurements(
        bias_ms=3.0,
        alpha_ms={b: 0.1 * b for b in bcaps},
        theta_ms={g: 0.05 * g for g in gs},
        points=pts,
        windows_per_point=1,
    )
    d = diagnose(_fit(AdditiveCostModel, df), df)
    assert d.residuals.max_abs_ms == pytest.approx(0.0, abs=1e-9)
    # theta is linear in G, so interpolating a left-out interior G is exact.
    assert d.leave_one_g_out.max_abs_ms == pytest.approx(0.0, abs=1e-9)
    assert d.leave_one_g_out.n_evaluated == len(bcaps) * (len(gs) - 2)
    assert d.leave_one_g_out.n_skipped == len(bcaps) * 2  # the smallest and largest G


def test_held_out_error_reflects_noise_and_is_in_ms_and_percent():
    df = measurements(windows_per_point=1, noise_ms=0.2, seed=2)
    d = diagnose(_fit(AdditiveCostModel, df), df)
    lopo = d.leave_one_point_out
    assert lopo.mae_ms > d.residuals.mae_ms > 0  # held out is worse than in-sample
    pts = d.points.dropna(subset=["lopo_ms"])
    pct = 100 * np.abs(pts.step_ms - pts.lopo_ms) / pts.step_ms
    assert lopo.mean_abs_pct == pytest.approx(pct.mean())


def test_sps_logo_interpolates_neighbours_and_skips_edges():
    df = measurements(windows_per_point=1)
    df = df[df.bcap == 2]  # G = 2, 4, 6, 8
    m = _fit(SPSCostModel, df)
    d = diagnose(m, df)
    cost = dict(zip(m.g_levels_, m.cost_ms_, strict=True))
    logo = dict(zip(d.points.g, d.points.logo_ms, strict=True))
    assert logo[4] == pytest.approx((cost[2] + cost[6]) / 2)
    assert np.isnan(logo[2]) and np.isnan(logo[8])
    # One Bcap: each G is one point, so leave-one-point-out equals leave-one-G-out.
    np.testing.assert_allclose(d.points.lopo_ms, d.points.logo_ms)
