"""The draft-forward term of draft_step tables (partly filled buckets, schema version 3).

A partly filled bucket verifies a G that a full bucket of another k verifies too (6 requests in
bucket 8 at k = 1 pad 12 rows to G 12, which bucket 4 runs at k = 2): the table must price the
two rounds apart, by the draft forwards each runs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from speccal.base.errors import SchemaError
from speccal.base.geometry import Geometry, default_target_rows
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table import parse_table
from speccal.costmodel.table_build import build_table
from speccal.policy import CostModel

from .helpers import COMPAT

W = 3
BUCKETS = (1, 2, 4, 8)
GEOM = Geometry(draft_width=W, request_buckets=BUCKETS,
                target_rows=default_target_rows(BUCKETS, W))
ALPHA = {1: 0.0, 2: 0.2, 4: 0.5, 8: 1.1}
THETA = {g: 0.02 * g for gs in GEOM.target_rows.values() for g in gs}
DRAFT = {1: 0.40, 2: 0.45, 4: 0.55, 8: 0.70}  # ms per draft forward, per bucket
BIAS = 3.0
KV = 100.0


def truth(b: int, g: int, k: int) -> float:
    return BIAS + ALPHA[b] + THETA[g] + k * DRAFT[b]


def shapes(partly: bool = True) -> list[tuple[int, int, int, int]]:
    out = []
    for b in BUCKETS:
        out += [(b, g, k, n) for g, k, n in GEOM.draft_step_shapes(b) if partly or n == b]
    return out


def rows(partly: bool = True, noise_ms: float = 0.004):
    return make_measurements(
        bias_ms=BIAS, alpha_ms=ALPHA, theta_ms=THETA, draft_ms=DRAFT, draft_width=W,
        contexts=((64, 1, 256),), windows_per_point=3, window_steps=8, noise_ms=noise_ms,
        shapes=shapes(partly), seed=3,
    )


@pytest.fixture(scope="module")
def table():
    return build_table(rows(), compatibility=COMPAT, geometry=GEOM)


def test_partly_filled_shapes_are_what_serving_pads_to():
    # bucket 8 at k = 1: 5..8 requests verify 10..16 rows, padded to G 12 (6 requests) or 16
    assert [(g, n) for g, k, n in GEOM.draft_step_shapes(8) if k == 1] == [(12, 6), (16, 8)]
    # bucket 4 at k = 3: 3 requests verify 12 rows, the G bucket 4 runs full at k = 2
    assert (12, 3, 3) in GEOM.draft_step_shapes(4) and (12, 2, 4) in GEOM.draft_step_shapes(4)
    assert GEOM.draft_step_shapes(1) == [(2, 1, 1), (3, 2, 1), (4, 3, 1)]  # nothing partly


def test_the_fit_keeps_a_draft_forward_term_chosen_on_partly_filled_points(table):
    p = table.fits[0].additive
    assert p.k_term in ("shared", "per_bcap") and len(p.delta_ms) >= 1
    sel = {c.k_term: c for c in p.k_selection.candidates}
    assert p.k_selection.selected_by == "partly_filled"
    assert sel["none"].partly_filled.n_evaluated > 0
    chosen = sel[p.k_term].partly_filled.mean_abs_pct
    assert chosen < sel["none"].partly_filled.mean_abs_pct
    assert chosen < 1.0
    pts = table.fits[0].diagnostics.points
    assert {(q.bcap, q.g, q.k) for q in pts} == {(b, g, k) for b, g, k, _ in shapes()}
    assert {q.num_requests for q in pts if (q.bcap, q.g, q.k) == (8, 12, 1)} == {6}


def test_lookups_price_each_k_and_refuse_a_missing_k(table):
    for b, g, k, _ in shapes():
        got = table.cost_ms(b, g, KV, k)
        assert got.calibrated and got.cost_ms == pytest.approx(truth(b, g, k), rel=0.02), (b, g, k)
    # the same (Bcap, G) at two k: two prices, a draft forward apart
    diff = table.cost_ms(4, 12, KV, 3).cost_ms - table.cost_ms(4, 12, KV, 2).cost_ms
    assert diff == pytest.approx(DRAFT[4], abs=0.1)
    no_k = table.cost_ms(8, 12, KV)
    assert not no_k.calibrated and "k (the round's draft forwards) is needed" in no_k.reason
    other = table.cost_ms(8, 12, KV, 5)
    assert not other.calibrated and "not a calibrated draft step count" in other.reason


def test_policy_cost_model_prices_a_partly_filled_batch_at_its_own_k(table):
    cost = CostModel.from_table(table)
    assert cost.k_aware
    got = cost.step_costs(np.array([6]), np.array([KV]))[0]  # B = 6 in bucket 8
    want = [truth(8, 12, 1), truth(8, 24, 2), truth(8, 24, 3)]
    np.testing.assert_allclose(got, want, rtol=0.02)


def test_without_partly_filled_points_the_term_is_the_one_the_full_grid_supports():
    t = build_table(rows(partly=False), compatibility=COMPAT, geometry=GEOM)
    sel = t.fits[0].additive.k_selection
    assert sel is None or sel.selected_by in ("leave_one_point_out", "fewest_parameters")


def test_a_target_verify_table_has_no_term():
    df = make_measurements(bias_ms=BIAS, alpha_ms=ALPHA, theta_ms=THETA, draft_width=W,
                           mode="target_verify", contexts=((64, 1, 256),),
                           windows_per_point=2, window_steps=8, seed=1)
    t = build_table(df, compatibility=COMPAT)
    p = t.fits[0].additive
    assert (p.k_term, p.delta_ms, p.k_selection) == ("none", [], None)
    assert not t.lookup().depends_on_k and t.cost_ms(2, 4, KV).calibrated


def test_the_term_persists_and_a_wrong_delta_count_is_refused(table):
    again = parse_table(table.to_json())
    assert again.to_json() == table.to_json()
    assert again.fits == table.fits
    doc = json.loads(table.to_json())
    doc["fits"][0]["additive"]["delta_ms"].append(0.1)
    with pytest.raises(SchemaError, match="delta_ms"):
        parse_table(json.dumps(doc))


def test_sps_keeps_one_curve_per_k():
    t = build_table(rows(), model="sps", compatibility=COMPAT, geometry=GEOM)
    p = t.fits[0].sps
    assert p.k is not None and sorted(set(p.k)) == [1, 2, 3]
    # G 12 is on two curves (k = 1 at bucket 8, k = 2 at bucket 4 ...): each prices its own
    at_k1 = t.cost_ms(8, 12, KV, 1).cost_ms
    at_k2 = t.cost_ms(4, 12, KV, 2).cost_ms
    assert at_k1 != at_k2
    assert parse_table(t.to_json()).fits == t.fits


def test_the_kv_model_keeps_the_term_across_contexts():
    df = make_measurements(
        bias_ms=BIAS, alpha_ms=ALPHA, theta_ms=THETA, draft_ms=DRAFT, draft_width=W,
        contexts=((64, 1, 256), (512, 257, 1024), (2048, 1025, 4096)),
        context_offsets_ms=(0.0, 0.4, 1.5), windows_per_point=2, window_steps=8,
        noise_ms=0.004, shapes=shapes(), seed=5,
    )
    t = build_table(df, compatibility=COMPAT, geometry=GEOM)
    kv = t.kv_model
    assert kv is not None and kv.k_term in ("shared", "per_bcap") and kv.delta_ms
    assert {c.k_term for c in kv.candidates} >= {"none", kv.k_term}
    assert kv.k_levels() == [1, 2, 3]
    assert parse_table(t.to_json()).kv_model == kv
    # between the contexts' KV the model answers, each k apart, and needs the k
    at = 700.0
    k2, k3 = t.cost_ms(4, 12, at, 2), t.cost_ms(4, 12, at, 3)
    assert k2.calibrated and k3.calibrated and k3.cost_ms - k2.cost_ms == pytest.approx(
        DRAFT[4], abs=0.15)
    assert not t.cost_ms(4, 12, at).calibrated
    cost = CostModel.from_table(t)
    assert cost.k_aware and np.isfinite(cost.step_costs(np.array([3]), np.array([at]))).all()


RHO = 0.35  # ms per request one verify serves, G / (k + 1)


def rows_truth_rows(noise_ms: float = 0.004):
    """``rows()`` plus ``RHO * G / (k + 1)``: part of the cost follows the requests a verify
    serves (padding included), which neither theta(G) nor alpha(Bcap) separates."""
    df = rows(noise_ms=noise_ms).copy()
    extra = RHO * df["g"] / (df["k"] + 1.0)
    df["step_ms"] = df["step_ms"] + extra
    df["elapsed_s"] = df["step_ms"] * df["window_steps"] / 1000.0
    return df


def test_a_cost_that_follows_the_requests_gets_a_rows_term():
    """Version 4: the selection keeps a ``*_rows`` form where the truth has one, rho is the
    last ``delta_ms`` value, every shape is priced at its truth, the table round-trips, and a
    version 3 document carrying the form is refused (a version 3 reader could not read it)."""
    t = build_table(rows_truth_rows(), compatibility=COMPAT, geometry=GEOM)
    p = t.fits[0].additive
    assert p.k_term in ("shared_rows", "per_bcap_rows")
    sel = {c.k_term: c for c in p.k_selection.candidates}
    assert sel[p.k_term].partly_filled.mean_abs_pct < 0.5 * min(
        sel[k].partly_filled.mean_abs_pct for k in ("shared", "per_bcap") if k in sel)
    assert p.delta_ms[-1] == pytest.approx(RHO, rel=0.1)
    for b, g, k, _ in shapes():
        got = t.cost_ms(b, g, KV, k)
        want = truth(b, g, k) + RHO * g / (k + 1)
        assert got.calibrated and got.cost_ms == pytest.approx(want, rel=0.02), (b, g, k)
    assert not t.cost_ms(8, 12, KV).calibrated  # k needed
    again = parse_table(t.to_json())
    assert again.to_json() == t.to_json()
    doc = json.loads(t.to_json())
    doc["schema_version"] = 3
    with pytest.raises(SchemaError, match="k_term"):
        parse_table(json.dumps(doc))
    doc = json.loads(t.to_json())
    doc["fits"][0]["additive"]["delta_ms"].pop()
    with pytest.raises(SchemaError, match="delta_ms"):
        parse_table(json.dumps(doc))


def test_without_a_request_cost_the_simpler_term_wins():
    t = build_table(rows(), compatibility=COMPAT, geometry=GEOM)
    assert not t.fits[0].additive.k_term.endswith("_rows")
