"""Feasibility and grid: every infeasible config is refused with its reason (no engine needed here;
test_driver.py checks that a refused config runs no round on the real engine)."""

from __future__ import annotations

import pytest

from speccal.base.errors import GridError, InputError
from speccal.base.geometry import Geometry
from speccal.calibrate.config import UserConfig, parse_config_obj, resolve_config
from speccal.calibrate.feasibility import check_feasible, reserve_tokens
from speccal.calibrate.grid import build_grid, split_rows

GEO = Geometry(
    draft_width=3, request_buckets=(1, 2, 4), kv_capacity_tokens=4 * 4096, max_model_len=4096
)


def cfg_of(obj, geo=GEO, **flags):
    return resolve_config(UserConfig.build(parse_config_obj(obj), flags), geo)


def test_default_config_is_feasible():
    check_feasible(cfg_of({}), GEO)


@pytest.mark.parametrize(
    "obj, field, words",
    [
        ({"request_buckets": [3]}, "request_buckets", "captured request bucket"),
        (
            {"request_buckets": [1], "target_graph_rows": {"1": [5]}},
            "target_graph_rows",
            "captured",
        ),
        (
            {"contexts": [{"prefill_tokens": 4000, "min_kv_length": 1, "max_kv_length": 4096}]},
            "contexts[0].prefill_tokens",
            "worst-case generated tokens",
        ),
        (
            {"contexts": [{"prefill_tokens": 64, "min_kv_length": 1, "max_kv_length": 8192}]},
            "contexts[0].max_kv_length",
            "model context 4096",
        ),
    ],
)
def test_infeasible_explicit_config_refused(obj, field, words):
    with pytest.raises(InputError) as exc:
        check_feasible(cfg_of(obj), GEO)
    assert exc.value.field.startswith(field)
    assert words in str(exc.value)


def test_kv_capacity_reserves_every_in_flight_slot():
    geo = Geometry(
        draft_width=3, request_buckets=(1, 2, 4), kv_capacity_tokens=4 * 1024, max_model_len=4096
    )
    reserve = reserve_tokens(8, 32, 3, 3)
    fits_one = {
        "contexts": [{"prefill_tokens": 1024 - reserve, "min_kv_length": 1, "max_kv_length": 4096}]
    }
    check_feasible(cfg_of(fits_one, geo), geo)  # 4 slots x 1024 tokens
    too_big = {
        "contexts": [{"prefill_tokens": 1025 - reserve, "min_kv_length": 1, "max_kv_length": 4096}]
    }
    with pytest.raises(InputError, match="KV capacity"):
        check_feasible(cfg_of(too_big, geo), geo)
    # the same prompt fits when fewer slots are in flight
    check_feasible(cfg_of({**too_big, "request_buckets": [1, 2]}, geo), geo)


def test_disconnected_additive_grid_refused_but_sps_accepted():
    geo = Geometry(
        draft_width=1, request_buckets=(1, 4), kv_capacity_tokens=8 * 4096, max_model_len=4096
    )
    # Bcap 1: G in {1, 2}; Bcap 4: G in {4, 8}: no shared G.
    with pytest.raises(GridError) as exc:
        check_feasible(cfg_of({}, geo), geo)
    assert "disconnected" in str(exc.value)
    check_feasible(cfg_of({"model": "sps"}, geo), geo)


def test_grid_target_verify_trims_rows_exactly():
    cfg = cfg_of({"request_buckets": [4]})
    pts = [p for p in build_grid(cfg) if p.context_index == 0]  # the same in every context
    assert [p.g for p in pts] == [4, 6, 8, 12, 16]  # prepared buckets in [Bcap, Bcap*(w+1)]
    for p in pts:
        assert p.k == 3
        assert sum(v + 1 for v in p.verify_tokens) == p.g
        assert max(p.verify_tokens) - min(p.verify_tokens) <= 1


def test_grid_draft_step_one_point_set_per_k():
    cfg = cfg_of({"request_buckets": [2]}, mode="draft_step")
    pts = [p for p in build_grid(cfg) if p.context_index == 0]  # the same in every context
    assert [(p.g, p.k, p.verify_tokens) for p in pts] == [(4, 1, None), (6, 2, None), (8, 3, None)]


def test_split_rows_bounds():
    assert split_rows(3, 5, 2) == (1, 1, 0)
    with pytest.raises(GridError):
        split_rows(3, 10, 2)
