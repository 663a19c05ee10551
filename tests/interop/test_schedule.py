"""Per-bucket scoring by replay, the price of k = 0, and the workload comparison."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from speccal.base.errors import InputError
from speccal.costmodel.compat import make_compatibility
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table import load_table
from speccal.costmodel.table_build import build_table
from speccal.interop.schedule import (
    ZeroCost,
    parse_k0_ms,
    rebatch,
    schedule_run,
    score_bucket,
    score_buckets,
    workload_runs,
    zero_cost,
)
from speccal.policy import CostModel
from speccal.replay import ReplayConfig, replay
from speccal.scenarios import Phase, Scenario, generate, scenario_geometry, synthetic_table
from speccal.trace import load_trace

ROOT = Path(__file__).resolve().parents[2]
DRAFT_STEP = ROOT / "tables" / "dense-2b-h200-draft-step.json"
TINY = ROOT / "tables" / "tiny-cpu.json"
TRACE = ROOT / "notebooks" / "data" / "transition.parquet"


@pytest.fixture(scope="module")
def table():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_table(DRAFT_STEP)


@pytest.fixture(scope="module")
def trace():
    return load_trace(TRACE)


def test_rebatch_keeps_rows_order_phases_and_drops_the_remainder(trace):
    tb = rebatch(trace, 3)
    n = (trace.accepted.size // 3) * 3
    assert (tb.num_requests == 3).all() and tb.num_rounds == n // 3
    assert np.array_equal(tb.accepted, trace.accepted[:n])
    assert tb.phase[0] == 0 and tb.phase[-1] == 1  # the easy half first, then the hard one
    assert np.array_equal(tb.draft_scores, trace.draft_scores[:n])
    with pytest.raises(InputError, match="at least 9"):
        rebatch(_tiny(trace, 4), 9)


def _tiny(trace, rows):
    from speccal.trace import RoundTrace

    return RoundTrace(
        draft_width=3,
        num_requests=np.array([rows]),
        kv_length=np.array([10.0]),
        k=np.array([3]),
        accepted=trace.accepted[:rows],
    )


def test_bucket_score_is_the_replays_fixed_k(table, trace):
    cost = CostModel.from_table(table)
    s = score_bucket(cost, trace, 4, zero_cost(table, {}))
    rep = replay(rebatch(trace, 4), cost, ReplayConfig(policies=()))
    for k in (1, 2, 3):
        assert s.tokens_per_s[k] == pytest.approx(rep.run(f"fixed:{k}").totals()["tokens_per_s"])
    assert s.tokens_per_s[0] is None and s.k0_source is None  # nothing measured k = 0
    assert s.best_k == max((1, 2, 3), key=lambda k: s.tokens_per_s[k])
    assert s.adaptive["policy"] == "adaptive-step"
    assert s.margin_pct() > 0


def test_k0_from_the_flag_wins_where_speculation_does_not_pay(table, trace):
    cost = CostModel.from_table(table)
    # a k = 0 step this cheap beats every k at bucket 2 and at none of the others
    zero = zero_cost(table, parse_k0_ms("2=0.5", (1, 2, 4, 8)))
    scores = {s.bcap: s for s in score_buckets(cost, trace, zero)}
    assert scores[2].best_k == 0 and scores[2].tokens_per_s[0] == pytest.approx(2 * 1000 / 0.5)
    assert scores[2].k0_source == "--k0-ms"
    assert all(scores[b].best_k > 0 and scores[b].tokens_per_s[0] is None for b in (1, 4, 8))


def test_k0_from_windows_measured_at_k0(trace):
    """Rows of an engine's benchmark at k = 0 (G = Bcap) price k = 0; others do not."""
    geo = scenario_geometry(3, 8)
    points = [(b, b * (k + 1)) for b in geo.request_buckets for k in range(0, 4)]
    df = make_measurements(
        bias_ms=1.0,
        alpha_ms={b: 0.1 * b for b in geo.request_buckets},
        theta_ms={g: 0.4 * g for g in sorted({g for _, g in points})},
        points=points,
        draft_width=3,
        mode="draft_step",
        contexts=((1024, 1, 4096),),
        noise_ms=0.0,
        seed=0,
    )
    df = df.assign(k=df["g"] // df["bcap"] - 1)
    compat = make_compatibility(draft_width=3)
    t = build_table(df, model="additive", geometry=geo, compatibility=compat)
    zero = zero_cost(t, {})
    assert zero.table_buckets == (1, 2, 4, 8) and "k = 0" in zero.table_source
    s = score_bucket(CostModel.from_table(t), trace, 8, zero)
    # cost(8, 8) = 1 + 0.8 + 3.2 = 5 ms per 8 tokens
    assert s.tokens_per_s[0] == pytest.approx(8000 / 5.0, rel=1e-6)
    # the same table without its k = 0 windows: k = 0 unpriced
    t1 = build_table(df[df["k"] > 0], model="additive", geometry=geo, compatibility=compat)
    assert zero_cost(t1, {}).table_buckets == ()


def test_target_verify_budget_zero_is_the_g_equals_bcap_cell(trace):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = load_table(TINY)
    zero = zero_cost(t, {})
    s = score_bucket(CostModel.from_table(t), trace, 2, zero)
    assert s.tokens_per_s[0] == pytest.approx(2000 / t.cost_ms(2, 2, 1024).cost_ms)
    with pytest.raises(InputError, match="--k0-ms"):
        zero_cost(t, {1: 2.0})


@pytest.mark.parametrize(
    "text, match",
    [("x", "MS or BCAP"), ("3=1.0", "request bucket"), ("1=-1", "> 0"), ("nan", "> 0")],
)
def test_bad_k0_ms(text, match):
    with pytest.raises(InputError, match=match):
        parse_k0_ms(text, (1, 2, 4, 8))


def test_a_bucket_the_table_cannot_price_keeps_full_width(table, trace):
    far = generate(Scenario("far", 3, (Phase("p", 50, (0.8,), 8, 4000.0),)))  # KV past 1..1024
    s = score_bucket(CostModel.from_table(table), far, 4, ZeroCost())
    assert s.uncalibrated and s.best_k == 3 and all(v is None for v in s.tokens_per_s.values())


def test_schedule_run_with_one_k_is_the_replays_fixed_run(table, trace):
    cost = CostModel.from_table(table)
    zero = ZeroCost()
    rep = replay(trace, cost, ReplayConfig(policies=()))
    for k in (1, 2, 3):
        run = schedule_run(trace, cost, {8: k}, zero)
        ref = rep.run(f"fixed:{k}")
        assert run.totals()["tokens_per_s"] == pytest.approx(ref.totals()["tokens_per_s"])
        assert np.array_equal(run.g, ref.g)


def test_workload_gain_over_the_best_single_fixed_k(table):
    # batch sizes 1, 2 and 8: the best k differs per bucket, so a schedule beats any one k
    tr = generate(
        Scenario(
            "mix",
            3,
            tuple(Phase(f"B={b}", 400, (0.6,), b, 512.0) for b in (1, 2, 4, 8)),
            seed=3,
        )
    )
    cost = CostModel.from_table(table)
    zero = zero_cost(table, parse_k0_ms("1=1.5,2=1.5,4=1.7,8=1.9", (1, 2, 4, 8)))
    best = {s.bcap: s.best_k for s in score_buckets(cost, tr, zero)}
    wl = workload_runs(tr, cost, best, zero)
    assert wl["requests_per_round"] == [1, 2, 4, 8]
    fixed = {int(k): v for k, v in wl["fixed_tokens_per_s"].items() if v is not None}
    assert wl["best_fixed_k"] == max(fixed, key=fixed.get)
    assert wl["gain_vs_best_fixed_pct"] == pytest.approx(
        100 * (wl["schedule_tokens_per_s"] / fixed[wl["best_fixed_k"]] - 1)
    )
    assert wl["gain_vs_best_fixed_pct"] >= 0.0
    same = workload_runs(tr, cost, dict.fromkeys(best, wl["best_fixed_k"]), zero)
    assert same["gain_vs_best_fixed_pct"] == pytest.approx(0.0)
    with pytest.raises(InputError, match="decision for every bucket"):
        schedule_run(tr, cost, {8: 3}, zero)


def test_width_mismatch_is_refused(trace):
    cost = CostModel.from_table(synthetic_table(scenario_geometry(2, 8), "draft_step"))
    with pytest.raises(InputError, match="draft_width"):
        score_buckets(cost, trace, ZeroCost())
