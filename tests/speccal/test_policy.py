"""Speculation policies (speccal.policy_rules, speccal.policy): pinned by small exact cases."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from speccal.base.errors import InputError, UnsupportedError
from speccal.base.geometry import Geometry
from speccal.policy import (
    AdaptiveStepConfig,
    AdaptiveStepPolicy,
    AdaptiveVerifyConfig,
    AdaptiveVerifyPolicy,
    BatchState,
    CostModel,
    Feedback,
    FixedPolicy,
    LaggedFeedback,
    check_adaptive_modes,
    make_policy,
    parse_policy,
)
from speccal.policy_rules import (
    CURVE_RESOLUTION,
    allocate_prefixes,
    allocate_prefixes_batch,
    choose_budget,
    choose_step,
    position_counts,
    prefix_acceptance,
    score_steps,
    survival,
    survival_curve,
    survival_curves,
)


def geom(w: int = 4, buckets=(1, 2, 4, 8)) -> Geometry:
    return Geometry(draft_width=w, request_buckets=buckets)


def table_cost(
    per_k: dict[int, float], w: int = 4, mode: str = "draft_step", max_kv: float = 4096.0
) -> CostModel:
    """Cost depending only on G / Bcap (= k + 1); NaN above ``max_kv``."""

    def f(bcap, g, kv):
        j = np.asarray(g) // np.asarray(bcap)
        out = np.array([per_k.get(int(x) - 1, np.nan) for x in np.ravel(j)], dtype=float).reshape(
            np.shape(j)
        )
        return np.where(np.asarray(kv) <= max_kv, out, np.nan)

    return CostModel(cost=f, geometry=geom(w), mode=mode)


def linear_cost(w: int = 4, mode: str = "draft_step", max_kv: float = 4096.0) -> CostModel:
    def f(bcap, g, kv):
        ms = 5.0 + 0.1 * np.asarray(bcap) + 0.2 * np.asarray(g)
        return np.where(np.asarray(kv) <= max_kv, ms, np.nan)

    return CostModel(cost=f, geometry=geom(w), mode=mode)


# ------------------------------------------------------------------ adaptive draft step rules


def test_score_steps_is_the_spec_formula():
    p = np.array([0.9, 0.6, 0.3, 0.1])
    cost = np.array([10.0, 12.0, 14.0, 16.0])
    b = 8
    expect = [b * (1 + p[:k].sum()) / cost[k - 1] for k in range(1, 5)]
    np.testing.assert_allclose(score_steps(p, cost, b), expect)


def test_choose_step_is_argmax_of_the_formula_when_switching_is_free():
    rng = np.random.default_rng(3)
    for _ in range(200):
        p = np.cumprod(rng.uniform(0.05, 1.0, size=5))
        cost = np.sort(rng.uniform(5, 30, size=5))
        b = int(rng.integers(1, 64))
        scores = [b * (1 + p[:k].sum()) / cost[k - 1] for k in range(1, 6)]
        best = int(np.argmax(scores)) + 1
        k, reason, _ = choose_step(p, cost, b, current_k=best % 5 + 1, switch_min_gain=0.0)
        assert k == best
        assert reason in ("switch", "hold")


@pytest.mark.parametrize(
    ("ratio", "switch"),
    [(1.04, False), (1.05, False), (1.0500001, True), (1.06, True)],
)
def test_min_gain_hysteresis_is_strict(ratio, switch):
    # k=1 scores 1.5 * B / 1.0; k=2 scores 2.0 * B / c2 with c2 chosen for the given gain.
    p = np.array([0.5, 0.5])
    cost = np.array([1.0, 2.0 / (1.5 * ratio)])
    k, reason, gain = choose_step(p, cost, 4, current_k=1, switch_min_gain=0.05)
    assert gain == pytest.approx(ratio - 1.0, rel=1e-6)
    assert (k, reason) == ((2, "switch") if switch else (1, "hold"))


def test_choose_step_fallbacks():
    p = np.array([0.9, 0.8])
    assert choose_step(None, np.array([1.0, 2.0]), 4, 1, 0.05)[:2] == (2, "warmup")
    assert choose_step(p, np.array([np.nan, np.nan]), 4, 1, 0.05)[:2] == (2, "uncalibrated")
    # The current k is uncalibrated: move to the best calibrated k whatever the gain.
    k, reason, gain = choose_step(p, np.array([1.0, np.nan]), 4, 2, 0.05)
    assert (k, reason, gain) == (1, "switch", math.inf)


def test_prefix_acceptance_mixes_k_monotonically_and_extrapolates():
    s1, r1 = position_counts(np.array([1, 1, 0, 1]), k=1, draft_width=4)  # p0 = 0.75
    s2, r2 = position_counts(np.array([2, 1, 0, 2]), k=2, draft_width=4)
    np.testing.assert_array_equal(s1, [3, 0, 0, 0])
    np.testing.assert_array_equal(r2, [4, 3, 0, 0])  # position 2 was not drafted
    p = prefix_acceptance(s1 + s2, r1 + r2)
    c0 = 6 / 8  # both batches drafted position 0
    c1 = 2 / 3  # only the k=2 batch drafted position 1: 2 of its 3 survivors
    np.testing.assert_allclose(p, [c0, c0 * c1, c0 * c1**2, c0 * c1**3])
    assert prefix_acceptance(np.zeros(4), np.zeros(4)) is None


def feed(policy, r: int, accepted, k: int, scores=None):
    policy.observe(Feedback(round_index=r, k=k, accepted=np.asarray(accepted), draft_scores=scores))


def test_adaptive_step_window_and_interval_bookkeeping():
    cost = table_cost({1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0})
    pol = AdaptiveStepPolicy(cost, AdaptiveStepConfig(window_size=20, update_interval=5))
    state = lambda r: BatchState(round_index=r, num_requests=4, kv_length=100.0)  # noqa: E731
    # Round 0: no feedback yet -> full width (the only k that observes every position).
    d = pol.decide(state(0))
    assert (d.k, d.reason) == (4, "warmup")
    feed(pol, 0, [0, 0, 0, 0], d.k)  # nothing accepted: the best k is 1
    # The first scoring comes with the first feedback, not a whole interval later.
    d = pol.decide(state(1))
    assert (d.k, d.reason) == (1, "switch")
    feed(pol, 1, [0, 0, 0, 0], d.k)
    # Then every update_interval completed batches: rounds 2..4 hold, round 5 re-scores.
    for r in range(2, 5):
        d = pol.decide(state(r))
        assert (d.k, d.reason) == (1, "hold")
        feed(pol, r, [0, 0, 0, 0], d.k)
    d = pol.decide(state(5))
    assert (d.k, d.reason) == (1, "hold")  # re-scored (still 1), no switch
    assert math.isfinite(d.predicted_gain)
    # Feedback turning perfect must not move k before the next re-scoring point (round 10).
    for r in range(5, 10):
        if r > 5:
            d = pol.decide(state(r))
            assert (d.k, d.reason) == (1, "hold") and math.isnan(d.predicted_gain)
        feed(pol, r, [d.k] * 4, d.k)
    # Window holds rounds 0..9: position 0 reached 40 times, survived 20 (rounds 5..9).
    s, reached = pol.window_counts()
    assert (s[0], reached[0]) == (20.0, 40.0)
    d = pol.decide(state(10))
    assert d.reason in ("switch", "hold")
    # After 20 more perfect rounds the zero-acceptance rounds left the 20-batch window.
    r = 10
    for _ in range(20):
        feed(pol, r, [d.k] * 4, d.k)
        r += 1
        d = pol.decide(state(r))
    s, reached = pol.window_counts()
    assert s[0] == reached[0] == 80.0
    assert pol.completed == 30
    assert d.k == 4  # perfect acceptance and nearly flat cost: full width


def test_adaptive_step_uncalibrated_round_runs_full_width_and_keeps_held_k():
    cost = table_cost({1: 10.0, 2: 20.0, 3: 30.0, 4: 40.0}, max_kv=1000.0)
    pol = AdaptiveStepPolicy(cost, AdaptiveStepConfig(update_interval=1))
    feed(pol, 0, [0, 0], 4)
    d = pol.decide(BatchState(1, 2, 500.0))
    assert d.k == 1
    feed(pol, 1, [0, 0], 1)
    d = pol.decide(BatchState(2, 2, 5000.0))  # outside the calibrated KV interval
    assert (d.k, d.reason) == (4, "uncalibrated")
    assert pol.held_k == 4  # re-scored with every candidate uncalibrated -> full width
    feed(pol, 2, [0, 0], 4)
    d = pol.decide(BatchState(3, 2, 500.0))
    assert d.k == 1


def test_adaptive_step_refuses_a_verify_table():
    with pytest.raises(UnsupportedError):
        AdaptiveStepPolicy(linear_cost(mode="target_verify"))


# ------------------------------------------------------------------ adaptive target verify rules


def test_lagged_feedback_releases_only_rounds_at_least_two_old():
    q = LaggedFeedback(lag=2)
    for r in range(6):
        q.push(Feedback(round_index=r, k=1, accepted=np.zeros(1, dtype=int)))
    assert [fb.round_index for fb in q.release(3)] == [0, 1]
    assert [fb.round_index for fb in q.release(3)] == []
    assert [fb.round_index for fb in q.release(7)] == [2, 3, 4, 5]
    with pytest.raises(InputError):
        LaggedFeedback(lag=1)
    assert not hasattr(q, "pending") and not hasattr(q, "_pending")


def test_adaptive_verify_cannot_see_round_n_minus_1():
    cost = linear_cost(mode="target_verify")
    rng = np.random.default_rng(0)
    cfg = AdaptiveVerifyConfig(window_size=1)  # the curve is the newest released round
    a, b = AdaptiveVerifyPolicy(cost, cfg), AdaptiveVerifyPolicy(cost, cfg)
    for r in range(12):
        st = BatchState(round_index=r, num_requests=4, kv_length=100.0)
        da, db = a.decide(st), b.decide(st)
        assert da == db
        assert all(u <= r - 2 for u in a.used_rounds)
        low = rng.uniform(0.0, 0.05, size=(4, 4))
        high = np.ones((4, 4))
        # Same history up to round r-1; the newest round differs wildly between a and b, and
        # each later decide must not depend on it until it is two rounds old.
        feed(a, r, [0] * 4, 4, low)
        feed(b, r, [0] * 4, 4, high if r == 11 else low)
    st = BatchState(round_index=12, num_requests=4, kv_length=100.0)
    assert a.decide(st) == b.decide(st)
    st = BatchState(round_index=13, num_requests=4, kv_length=100.0)
    assert a.decide(st).g < b.decide(st).g  # round 11 is now visible: b verifies more


def test_adaptive_verify_budget_warmup_and_uncalibrated_fall_back_to_full_width():
    cost = linear_cost(mode="target_verify", max_kv=1000.0)
    pol = AdaptiveVerifyPolicy(cost)
    d = pol.decide(BatchState(0, 3, 100.0))
    assert (d.k, d.g, d.reason) == (4, 4 * 5, "warmup")  # Bcap 4, full width
    for r in range(3):
        feed(pol, r, [0, 0, 0], 4, np.full((3, 4), 0.01))
    d = pol.decide(BatchState(3, 3, 100.0))
    assert d.g == 4  # hopeless drafts: the smallest budget that holds the bonus rows
    d = pol.decide(BatchState(4, 3, 5000.0))
    assert (d.g, d.reason) == (20, "uncalibrated")


def test_choose_budget_is_argmax_of_predicted_tokens_per_ms():
    rng = np.random.default_rng(1)
    cost = linear_cost(mode="target_verify")
    for _ in range(50):
        b = int(rng.integers(1, 9))
        scores = rng.uniform(0, 1, size=(b, 4))
        curve = survival_curve(scores)
        budgets, costs = cost.verify_candidates(b, 100.0)
        g, best = choose_budget(curve, b, budgets, costs)
        sv = np.sort(survival(scores).ravel())[::-1]
        preds = []
        for gg, cc in zip(budgets, costs, strict=True):
            if gg == 0:
                continue
            m = min(gg - b, b * 4)  # whole items
            preds.append((b * (1 + sv[:m].sum() / b) / cc, gg))
        # The curve is sampled every 1/CURVE_RESOLUTION drafts per request and linear between
        # samples, so a budget off that grid is priced by interpolation: the pick must be the
        # exact argmax up to that interpolation error (1% here), and exact on grid points.
        exact = dict((gg, p) for p, gg in preds)
        assert exact[int(g)] >= max(preds)[0] * (1 - 1e-2)
        on_grid = [(p, gg) for p, gg in preds if ((gg - b) * CURVE_RESOLUTION) % b == 0]
        if on_grid and all(((gg - b) * CURVE_RESOLUTION) % b == 0 for _, gg in preds):
            assert g == max(on_grid)[1]


def test_survival_curve_end_points_and_batch_agree():
    rng = np.random.default_rng(2)
    scores = rng.uniform(0, 1, size=(3, 4))
    c = survival_curve(scores)
    assert c[0] == 0.0
    assert c[-1] == pytest.approx(survival(scores).sum() / 3)
    pad = np.zeros((2, 5, 4))
    pad[0, :3] = scores
    pad[1, :5] = rng.uniform(0, 1, size=(5, 4))
    both = survival_curves(pad, np.array([3, 5]))
    np.testing.assert_allclose(both[0], c)
    np.testing.assert_allclose(both[1], survival_curve(pad[1]))


def test_survival_clips_scores_and_counts_nan_as_zero():
    s = survival(np.array([[np.nan, 0.5], [1.5, 0.5], [-0.2, 0.9], [np.inf, -np.inf],
                           [0.8, np.nan]], dtype=np.float32))
    assert s.tolist() == [[0.0, 0.0], [1.0, 0.5], [0.0, 0.0], [1.0, 0.0],
                          [pytest.approx(0.8), 0.0]]


def test_one_batchs_budget_equals_its_row_of_the_vectorised_choice():
    """The live policy's one-batch call and replay's rounds-at-once call pick the same budget
    with the same score, to the bit (live and replayed decisions must agree)."""
    rng = np.random.default_rng(3)
    cost = linear_cost(mode="target_verify")
    for _ in range(100):
        b = int(rng.integers(1, 9))
        curve = survival_curve(rng.uniform(0, 1, size=(b, 4)))
        budgets, costs = cost.verify_candidates(b, 100.0)
        if rng.random() < 0.3:
            costs = np.where(rng.random(costs.shape) < 0.5, np.nan, costs)
        one = choose_budget(curve, b, budgets, costs)
        many = choose_budget(np.stack([curve, curve]), np.array([b, b]),
                             np.stack([budgets, budgets]), np.stack([costs, costs]))
        assert one[0] == many[0][1] and np.array_equal(one[1], many[1][0], equal_nan=True)


def test_allocation_is_prefix_closed_highest_survival_first():
    rng = np.random.default_rng(4)
    for _ in range(200):
        b, w = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        scores = rng.uniform(0, 1, size=(b, w))
        scores[rng.uniform(size=(b, w)) < 0.2] = 1.0  # ties along prefixes
        for m in range(b * w + 2):
            v = allocate_prefixes(scores, m)
            assert v.sum() == min(m, b * w)
            assert ((v >= 0) & (v <= w)).all()
            s = survival(scores)
            taken = np.arange(w)[None, :] < v[:, None]  # a prefix per request by construction
            if taken.any() and (~taken).any():
                assert s[taken].min() >= s[~taken].max()  # nothing better was left out


def test_allocation_ties_go_shallow_first_then_lower_request():
    v = allocate_prefixes(np.ones((2, 3)), 3)
    np.testing.assert_array_equal(v, [2, 1])
    v = allocate_prefixes(np.array([[0.5, 1.0], [0.9, 0.1]]), 2)
    np.testing.assert_array_equal(v, [1, 1])  # survival [0.5, 0.5] vs [0.9, 0.09]: tie -> shallow
    v = allocate_prefixes(np.array([[0.5, 1.0], [0.9, 0.9]]), 2)
    np.testing.assert_array_equal(v, [0, 2])  # a deep 0.81 beats a shallow 0.5


def _sorted_allocation(scores: np.ndarray, budget_rows: int) -> np.ndarray:
    """The allocation rule written the slow, obvious way: visit items position-major, stable-sort
    them by survival descending and take the first ``budget_rows``."""
    s = survival(scores)
    b, w = s.shape
    order = np.arange(b * w).reshape(b, w).T.reshape(-1)  # position-major
    picked = order[np.argsort(-s.reshape(-1)[order], kind="stable")[: max(budget_rows, 0)]]
    return np.bincount(picked // w, minlength=b)


def test_batched_allocation_equals_the_sorted_rule():
    rng = np.random.default_rng(5)
    nreq = rng.integers(1, 6, size=40)
    scores = rng.uniform(0, 1, size=(40, 5, 3))
    scores[rng.uniform(size=scores.shape) < 0.3] = 1.0
    scores[rng.uniform(size=scores.shape) < 0.05] = np.nan  # not drafted: survival 0
    budgets = rng.integers(-1, 18, size=40)
    got = allocate_prefixes_batch(scores, nreq, budgets)
    for r in range(40):
        ref = _sorted_allocation(scores[r, : nreq[r]], budgets[r])
        np.testing.assert_array_equal(got[r, : nreq[r]], ref)
        np.testing.assert_array_equal(allocate_prefixes(scores[r, : nreq[r]], budgets[r]), ref)
        assert (got[r, nreq[r] :] == 0).all()
    assert allocate_prefixes(np.zeros((0, 3)), 4).shape == (0,)


# ------------------------------------------------------------------ specs, fixed, feedback


def test_combined_adaptive_modes_are_refused():
    with pytest.raises(UnsupportedError):
        parse_policy("adaptive-step+adaptive-verify")
    with pytest.raises(UnsupportedError):
        check_adaptive_modes(adaptive_draft_step=True, adaptive_target_verify=True)
    check_adaptive_modes(adaptive_draft_step=True, adaptive_target_verify=False)


@pytest.mark.parametrize("text", ["fixed:0", "fixed:x", "adaptive", "fixed:2+fixed:3"])
def test_bad_specs_name_the_field(text):
    with pytest.raises(InputError, match="policy"):
        parse_policy(text)


def test_fixed_policy_plans_in_both_modes():
    d = make_policy("fixed:2", linear_cost()).decide(BatchState(0, 3, 10.0))
    # B=3 -> Bcap 4; 3 * (2 + 1) = 9 rows pad to the next prepared bucket of Bcap 4
    assert (d.k, d.g, d.verify_tokens) == (2, 10, None)
    d = FixedPolicy(linear_cost(mode="target_verify"), 2).decide(BatchState(0, 3, 10.0))
    assert (d.k, d.g) == (4, 10)
    np.testing.assert_array_equal(d.verify_tokens, [2, 2, 2])
    with pytest.raises(InputError):
        FixedPolicy(linear_cost(), 5)


def test_feedback_from_round_result_uses_plain_numpy():
    res = SimpleNamespace(
        k=3, accepted=[1, 3], draft_scores=[[0.5, 0.4, 0.3], [0.9, 0.9, 0.9]], num_verify=[3, 3]
    )
    fb = Feedback.from_round_result(res, round_index=7)
    assert fb.round_index == 7 and fb.k == 3
    assert isinstance(fb.accepted, np.ndarray) and fb.draft_scores.shape == (2, 3)
    np.testing.assert_array_equal(fb.verify_tokens, [3, 3])
    with pytest.raises(InputError, match="accepted"):
        Feedback(round_index=0, k=2, accepted=np.array([3]))
