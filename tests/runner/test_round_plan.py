"""A round plan's checks and the shape it runs at (``runner.results.check_plan`` /
``round_shape``), without an engine."""

from __future__ import annotations

import numpy as np
import pytest

from speccal.base.errors import CapacityError, InputError
from speccal.base.geometry import Geometry
from speccal.runner.results import RoundPlan, check_plan, round_shape

GEO = Geometry(draft_width=3, request_buckets=(1, 2, 4, 8),
               target_rows={1: (1, 2, 4), 2: (2, 4, 8), 4: (4, 8, 12, 16),
                            8: (8, 16, 24, 32)})


def test_a_plain_plan_verifies_every_draft():
    k, nv = check_plan(RoundPlan(2), 3, draft_width=3, speculative=True)
    assert k == 2 and nv.tolist() == [2, 2, 2]
    assert round_shape(RoundPlan(2), 3, k, nv, GEO) == (4, 12, None)  # 9 rows pad to 12


def test_per_request_verify_lengths_pad_their_rows():
    plan = RoundPlan(3, verify_tokens=[0, 3, 1])
    k, nv = check_plan(plan, 3, draft_width=3, speculative=True)
    assert nv.tolist() == [0, 3, 1]
    assert round_shape(plan, 3, k, nv, GEO) == (4, 8, None)  # 1 + 4 + 2 rows


def test_a_budget_takes_the_largest_bucket_inside_it_or_the_smallest_holding_the_bonus_rows():
    plan = RoundPlan(3, verify_budget=14)
    k, nv = check_plan(plan, 3, draft_width=3, speculative=True)
    assert nv is None
    assert round_shape(plan, 3, k, nv, GEO) == (4, 12, 9)  # G 12, 12 - 3 draft rows
    # a budget under every bucket but the bonus rows: the smallest bucket holding them
    tight = RoundPlan(3, verify_budget=5)
    assert round_shape(tight, 5, 3, None, GEO) == (8, 8, 0)  # min(8, 5) - 5


@pytest.mark.parametrize("plan, n, field", [
    (RoundPlan(0), 2, "num_draft_steps"),
    (RoundPlan(4), 2, "num_draft_steps"),  # past draft_width
    (RoundPlan(2, verify_tokens=[1]), 2, "verify_tokens"),  # one per request
    (RoundPlan(2, verify_tokens=[1, 3]), 2, "verify_tokens"),  # past k
    (RoundPlan(3, verify_budget=1), 2, "verify_budget"),  # under the bonus rows
    (RoundPlan(3, verify_tokens=[1, 1], verify_budget=8), 2, "verify_budget"),  # both
    (RoundPlan(2, verify_budget=8), 2, "num_draft_steps"),  # a budget drafts full width
])
def test_bad_plans_name_the_field(plan, n, field):
    with pytest.raises(InputError, match=field):
        check_plan(plan, n, draft_width=3, speculative=True)


def test_plain_decoding_takes_k_0_only():
    assert check_plan(RoundPlan(0), 2, draft_width=3, speculative=False)[0] == 0
    with pytest.raises(InputError, match="speculative=False"):
        check_plan(RoundPlan(1), 2, draft_width=3, speculative=False)
    # k = 0 rounds run at the bucket's own row count
    assert round_shape(RoundPlan(0), 3, 0, np.zeros(3, np.int64), GEO) == (4, 4, None)


def test_past_the_captured_buckets_is_a_capacity_error():
    with pytest.raises(CapacityError, match="9 requests"):
        round_shape(RoundPlan(1), 9, 1, np.ones(9, np.int64), GEO)


def test_grid_rows_only_when_every_request_verifies_every_draft_at_the_full_grid():
    from speccal.runner.results import grid_rows

    full = np.array([2, 2, 2])
    assert grid_rows(2, 12, 4, 3, full, None)  # 3 requests of bucket 4, G = 4 x 3
    assert not grid_rows(2, 9, 4, 3, full, None)  # G below the grid
    assert not grid_rows(2, 12, 4, 3, np.array([2, 1, 2]), None)  # a shorter verify
    assert not grid_rows(0, 4, 4, 3, np.zeros(3, np.int64), None)  # plain decoding
    assert grid_rows(2, 12, 4, 3, None, 6) and grid_rows(2, 12, 4, 3, None, 9)  # budget >= 3 x 2
    assert not grid_rows(2, 12, 4, 3, None, 5)  # the allocation may drop a draft
