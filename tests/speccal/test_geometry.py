"""The bucketing rules of ``speccal.base.geometry.Geometry`` (the one owner of padding)."""

from __future__ import annotations

import numpy as np
import pytest

from speccal.base.errors import InputError
from speccal.base.geometry import Geometry, default_target_rows
from speccal.policy import CostModel


def _smallest_at_least(levels, x):
    return min((v for v in levels if v >= x), default=None)


GEOMETRIES = [
    Geometry(draft_width=3, request_buckets=(1, 2, 4, 8)),
    Geometry(draft_width=5, request_buckets=(3, 7)),
    # sparse, hand-picked target buckets (a calibration subset)
    Geometry(draft_width=2, request_buckets=(1, 4), target_rows={1: (1, 3), 4: (6, 12)}),
]


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_pad_rows_is_the_smallest_captured_bucket_holding_the_rows(geo):
    top = max(max(gs) for gs in geo.target_rows.values())
    bcaps = [0, *geo.request_buckets, max(geo.request_buckets) + 1]
    for b in bcaps:
        rows = np.arange(-2, top + 4)
        got = geo.pad_rows(b, rows)
        want = [_smallest_at_least(geo.target_rows.get(b, ()), r) or 0 for r in rows]
        np.testing.assert_array_equal(got, want)
        for r, g in zip(rows.tolist(), want, strict=True):
            assert geo.g_for(b, r) == (g or None)


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_pad_requests_is_the_smallest_request_bucket(geo):
    n = np.arange(0, max(geo.request_buckets) + 3)
    want = [_smallest_at_least(geo.request_buckets, x) or 0 for x in n]
    np.testing.assert_array_equal(geo.pad_requests(n), want)
    assert [geo.bcap_for(int(x)) for x in n] == [w or None for w in want]


def test_pad_rows_broadcasts_bcap_and_rows():
    geo = GEOMETRIES[0]
    bcap = np.array([[1], [4]])
    rows = np.array([1, 3, 5, 17])
    got = geo.pad_rows(bcap, rows)
    assert got.shape == (2, 4)
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [4, 4, 6, 0]])


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_g_within_fits_a_budget_into_the_captured_buckets(geo):
    for b, gs in geo.target_rows.items():
        for n in range(1, b + 1):
            for budget in range(0, max(gs) + 3):
                fit = [g for g in gs if n <= g <= budget]
                want = max(fit) if fit else _smallest_at_least(gs, n)
                assert geo.g_within(b, budget, n) == want, (b, n, budget)
    assert geo.g_within(999, 10, 1) is None


def test_cost_model_pads_with_the_geometry_rule():
    geo = GEOMETRIES[2]
    cost = CostModel(cost=lambda b, g, kv: np.ones(np.shape(b)), geometry=geo)
    rows = np.arange(0, 14)
    for b in (1, 4, 5):
        np.testing.assert_array_equal(cost.g(b, rows), geo.pad_rows(b, rows))
    np.testing.assert_array_equal(cost.bcap(np.arange(6)), geo.pad_requests(np.arange(6)))


def test_default_target_rows_share_g_levels_across_buckets():
    rows = default_target_rows((1, 2, 4), 3)
    assert rows[1] == (1, 2, 3, 4) and rows[2] == (2, 3, 4, 6, 8) and rows[4][-1] == 16
    with pytest.raises(InputError, match="full width"):
        Geometry(draft_width=2, request_buckets=(1,), target_rows={1: (1, 2)})


def test_one_served_bucket_set_per_device_kind():
    """calibrate, bench and generate build their engines from EngineConfig, whose default
    buckets are the device kind's served set: one set, so a table prices what serving runs."""
    from speccal.base.geometry import SERVED_REQUEST_BUCKETS, served_request_buckets
    from speccal.runner.engine import EngineConfig

    assert served_request_buckets("cuda:1") == (1, 2, 4, 8, 16, 32, 64)
    assert served_request_buckets("cpu") == (1, 2, 4, 8)
    for kind, buckets in SERVED_REQUEST_BUCKETS.items():
        assert EngineConfig(device=kind).request_buckets == buckets
    assert EngineConfig(device="cuda", request_buckets=(1, 3)).request_buckets == (1, 3)
    with pytest.raises(InputError, match="device"):
        served_request_buckets("tpu")
