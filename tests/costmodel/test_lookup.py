"""The one lookup module: table answers, the policies' guard, and the memo of scalar answers."""

from __future__ import annotations

import numpy as np
import pytest

from speccal.costmodel.lookup import (
    LookupMemo,
    TableLookup,
    evaluate,
    level_lookup,
    sps_interp,
)
from speccal.costmodel.table_build import build_table
from speccal.policy import CostModel

from .helpers import COMPAT, measurements

KVS = (0.0, 1.0, 512.5, 1024.0, 1024.5, 1025.0, 4096.0, 4097.0)


@pytest.fixture(scope="module", params=["additive", "sps"])
def table(request):
    df = measurements(contexts=((512, 1, 1024), (2048, 1025, 4096)), context_offsets_ms=(0.0, 2.0))
    return build_table(df, model=request.param, compatibility=COMPAT)


def test_primitives():
    levels = np.array([1.0, 2.0, 4.0])
    got = level_lookup(np.array([1, 3, 4, 5]), levels, np.array([10.0, 20.0, 40.0]))
    np.testing.assert_array_equal(got, [10.0, np.nan, 40.0, np.nan])
    got = sps_interp(np.array([0, 1, 3, 4, 5]), levels, np.array([1.0, 2.0, 6.0]))
    np.testing.assert_array_equal(got, [np.nan, 1.0, 4.0, 6.0, np.nan])


def test_the_table_methods_are_the_lookup(table):
    look = table.lookup()
    assert table.lookup() is look  # built once
    assert table.cost_surface() == look.surface
    assert table.cost_ms(4, 12, 10) == look.cost_ms(4, 12, 10)
    assert look.intervals == ((1.0, 1024.0), (1025.0, 4096.0))
    # the cached lookup does not leak into the document
    assert table.to_json() == build_table(table.measurements(), **_same(table)).to_json()


def _same(table):
    return dict(
        model=table.model,
        compatibility=table.compatibility,
        calibration=table.calibration,
        geometry=table.geometry_block.model_dump(),
        provenance=table.provenance,
    )


def test_evaluate_skips_missing_buckets():
    seen = []

    def cost(b, g, kv):
        seen.append(np.asarray(b).copy())
        return np.full(np.shape(b), 7.0)

    out = evaluate(cost, np.array([0, 1, 2]), np.array([3, 0, 4]), 5.0)
    np.testing.assert_array_equal(out, [np.nan, np.nan, 7.0])
    np.testing.assert_array_equal(seen[0], [2])
    assert np.isnan(evaluate(cost, 0, 0, 1.0)).all() and len(seen) == 1


def test_memo_key_is_exact_for_kv_intervals():
    memo = LookupMemo(((1, 100), (101, 300)))
    assert memo.key("step", (2,), 5.0) == memo.key("step", (2,), 100.0)
    assert memo.key("step", (2,), 100.0) != memo.key("step", (2,), 100.5)  # in neither
    assert memo.key("step", (2,), 100.5) == memo.key("step", (2,), 0.0)
    assert memo.key("step", (2,), 101.0) != memo.key("step", (2,), 5.0)
    assert memo.key("step", (np.array([1, 2]),), 5.0) is None
    assert memo.key("g", (2, 2.5)) is None and memo.key("g", (2, float("nan"))) is None
    assert memo.key("g", (np.int64(2), 4.0)) == ("g", 2, 4)


def test_memoised_cost_model_equals_the_plain_one(table):
    live = CostModel.from_table(table, memo=True)
    ref = CostModel.from_table(table)
    assert ref.memo is None and isinstance(live.memo, LookupMemo)
    for b in range(1, 10):  # 9: no bucket
        for kv in KVS:
            for _ in range(2):  # the second call hits the memo
                np.testing.assert_array_equal(live.step_costs(b, kv), ref.step_costs(b, kv))
                for x, y in zip(
                    live.verify_candidates(b, kv), ref.verify_candidates(b, kv), strict=True
                ):
                    np.testing.assert_array_equal(x, y)
            assert int(live.bcap(b)) == int(ref.bcap(b))
            assert int(live.g(ref.bcap(b), 3 * b)) == int(ref.g(ref.bcap(b), 3 * b))
    assert live.step_costs(4, 50.0)[0] != live.step_costs(4, 2000.0)[0]  # keyed on the interval


def test_kv_lines_price_verify_candidates_as_the_surface_does():
    """The committed CPU target_verify table has a KV model: the live cost model keeps one
    line per batch size and answers every KV (in, on the edges of, outside the span; not
    integers) with the surface's budgets and costs, bit for bit."""
    from pathlib import Path

    from speccal.costmodel.table import load_table

    table = load_table(Path(__file__).resolve().parents[2] / "tables" / "tiny-cpu.json")
    live, ref = CostModel.from_table(table, memo=True), CostModel.from_table(table)
    assert live.kv_span is not None and not live.k_aware
    lo, hi = live.kv_span
    kvs = (lo - 0.5, lo, 7.25, 700.0, 701.0, hi - 0.5, hi, hi + 1.0)
    for b in range(0, max(live.geometry.request_buckets) + 2):
        for kv in kvs:
            for got, want in zip(live.verify_candidates(b, kv), ref.verify_candidates(b, kv),
                                 strict=True):
                assert np.array_equal(got, want, equal_nan=True), (b, kv)
            assert np.array_equal(live.step_costs(b, kv), ref.step_costs(b, kv), equal_nan=True)
    assert np.isfinite(live.verify_candidates(4, 700.0)[1]).any()
    assert len(live.memo) <= 4 * (max(live.geometry.request_buckets) + 2)


def test_memo_computes_once_returns_copies_and_skips_arrays(table):
    live = CostModel.from_table(table, memo=True)
    first = live.step_costs(2, 10.0)
    n = len(live.memo)
    first[:] = -1.0  # a caller mutating its answer must not corrupt the memo
    again = live.step_costs(2, 11.0)  # same interval: a hit
    assert len(live.memo) == n and (again > 0).all()
    live.step_costs(np.array([1, 2]), np.array([10.0, 20.0]))  # vectorised: computed directly
    live.step_costs(2, kv_length=10.0)  # keywords: computed directly
    assert len(live.memo) == n
    assert isinstance(TableLookup(table).memo(), LookupMemo)
