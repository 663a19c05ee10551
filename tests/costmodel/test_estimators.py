"""SPS and additive estimators: parameter recovery, interpolation, refusal, sklearn contract."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.utils.estimator_checks import parametrize_with_checks

from speccal.costmodel.additive import AdditiveCostModel
from speccal.costmodel.sps import SPSCostModel

from .helpers import ALPHA, BCAPS, BIAS, GS, THETA, measurements


def _xy(df):
    return df[["bcap", "g"]].to_numpy(float), df["step_ms"].to_numpy()


def test_additive_recovers_known_parameters_within_the_noise():
    # 4 Bcaps x 4 G each (16 points, 7 distinct G... 10 parameters), 9 windows per point,
    # sigma = 0.05 ms per window. Each parameter estimate has a standard error well below
    # sigma / sqrt(9) * 2 ~ 0.035 ms; tolerance 0.06 ms is > 4 standard errors. Seeded.
    noise = 0.05
    df = measurements(windows_per_point=9, noise_ms=noise, seed=11)
    m = AdditiveCostModel(combine="mean").fit(*_xy(df))
    g0, b0 = min(GS), min(BCAPS)
    # Re-anchor the truth at the stated reference level (smallest Bcap, smallest G).
    assert m.bias_ms_ == pytest.approx(BIAS + ALPHA[b0] + THETA[g0], abs=0.06)
    for b, a in zip(m.bcap_levels_, m.alpha_ms_, strict=True):
        assert a == pytest.approx(ALPHA[int(b)] - ALPHA[b0], abs=0.06)
    for g, t in zip(m.g_levels_, m.theta_ms_, strict=True):
        assert t == pytest.approx(THETA[int(g)] - THETA[g0], abs=0.06)
    assert m.alpha_ms_[0] == 0.0 and m.theta_ms_[0] == 0.0


def test_additive_is_exact_without_noise_and_predicts_unmeasured_level_pairs():
    df = measurements(windows_per_point=1)
    m = AdditiveCostModel().fit(*_xy(df))
    # (Bcap 1, G 16) was never measured: the additive structure still predicts it.
    assert m.predict([[1, 16]])[0] == pytest.approx(BIAS + ALPHA[1] + THETA[16], abs=1e-9)
    assert np.isnan(m.predict([[3, 4], [2, 5]])).all()


def test_sps_reproduces_measured_points_and_interpolates_linearly_in_ms():
    df = measurements(windows_per_point=3, noise_ms=0.02, seed=3)
    df = df[df.bcap == 4]  # one Bcap: the SPS curve is exactly that Bcap's medians
    m = SPSCostModel().fit(*_xy(df))
    med = df.groupby("g").step_ms.median()
    assert np.array_equal(m.g_levels_, med.index.to_numpy())
    assert np.allclose(m.predict([[4, g] for g in med.index]), med.to_numpy(), rtol=0, atol=1e-12)
    assert np.allclose(m.sps_, 1000 / med.to_numpy())
    mid = m.predict([[4, 10]])[0]  # between G=8 and G=12
    assert mid == pytest.approx((med[8] + med[12]) / 2)


def test_sps_never_extrapolates():
    df = measurements()
    m = SPSCostModel().fit(*_xy(df))
    out = m.predict([[1, min(GS) - 0.5], [8, max(GS) + 1], [8, max(GS)]])
    assert np.isnan(out[:2]).all() and np.isfinite(out[2])


def test_from_params_rebuilds_the_same_predictions():
    df = measurements(noise_ms=0.1)
    X, y = _xy(df)
    a = AdditiveCostModel().fit(X, y)
    a2 = AdditiveCostModel.from_params(
        a.bias_ms_, a.bcap_levels_, a.alpha_ms_, a.g_levels_, a.theta_ms_
    )
    assert np.array_equal(a.predict(X), a2.predict(X))
    s = SPSCostModel().fit(X, y)
    s2 = SPSCostModel.from_params(s.g_levels_, s.cost_ms_)
    assert np.array_equal(s.predict(X), s2.predict(X))


def test_combine_option_is_validated():
    with pytest.raises(ValueError, match="combine"):
        SPSCostModel(combine="max").fit([[1, 2], [1, 4]], [1.0, 2.0])


# sklearn's generic checks feed random designs with 1 or 3-10 continuous features. A physical
# cost model has two columns [bcap, g] or three [bcap, g, k] (k: a round's draft forwards), so
# the checks that feed three columns run to their real assertion and pass; every check below
# fails on the feature count first (the additive model would then also refuse the random
# design as a disconnected grid). xfail_strict keeps this list exact: a check that starts
# passing fails the suite until it is removed here.
_FIXED_DESIGN = "X is the physical design [bcap, g(, k)] (2 or 3 columns); the check feeds another count"
_EXPECTED_FAILED = {
    name: _FIXED_DESIGN
    for name in (
        "check_fit_score_takes_y",
        "check_n_features_in_after_fitting",
        "check_positive_only_tag_during_fit",
        "check_estimators_dtypes",
        "check_dtype_object",
        "check_pipeline_consistency",
        "check_regressors_train",
        "check_regressor_data_not_an_array",
        "check_regressors_no_decision_function",
        "check_regressors_int",
        "check_fit2d_1sample",
    )
}


@parametrize_with_checks(
    [SPSCostModel(), AdditiveCostModel()],
    expected_failed_checks=lambda est: _EXPECTED_FAILED,
    xfail_strict=True,
)
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)
