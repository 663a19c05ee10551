"""Replay on a growing-context trace: a KV-aware table moves the adaptive step with context.

The truth is additive plus a KV term (``kv_slope_ms`` per verified row and KV token): at long
context every extra verified row costs more, so the best draft step falls as the conversation
grows. A table calibrated at three contexts prices that (its KV model); a table calibrated at one
context prices every round alike and holds one k. Both tables' decisions are priced by the
KV-aware table (the truth here, up to the fit) on the same trace.
"""

from __future__ import annotations

import numpy as np

from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table_build import build_table
from speccal.policy import CostModel
from speccal.replay import ReplayConfig, replay
from speccal.scenarios import Phase, Scenario, generate
from tests.costmodel.helpers import COMPAT

W = 3
BCAPS = (1, 2, 4, 8)
POINTS = [(b, b * j) for b in BCAPS for j in range(2, W + 2)]
TRUTH = dict(
    bias_ms=2.0,
    alpha_ms={1: 0.0, 2: 0.1, 4: 0.3, 8: 0.6},
    theta_ms={g: 0.02 * g for _, g in POINTS},
    kv_slope_ms=1e-4,  # G = 32 rows at KV 8k: +26 ms; at KV 300: +1 ms
)
KVS = (300.0, 1000.0, 2500.0, 4500.0, 6500.0, 8000.0)


def _table(contexts):
    rows = make_measurements(
        **TRUTH,
        points=POINTS,
        draft_width=W,
        mode="draft_step",
        contexts=contexts,
        windows_per_point=3,
        noise_ms=0.01,
        seed=5,
    )
    return build_table(rows, compatibility=COMPAT)


def _trace():
    phases = tuple(Phase(f"kv{int(kv)}", 300, (0.7,), 8, kv) for kv in KVS)
    return generate(Scenario("growing-context", W, phases, seed=1))


def _adaptive(trace, cost):
    return replay(trace, cost, ReplayConfig(policies=("adaptive-step",))).run("adaptive-step")


def test_kv_aware_decisions_move_with_context_and_beat_one_context():
    kv_table = _table(((256, 1, 512), (2048, 513, 4096), (6000, 4097, 8192)))
    one_table = _table(((4096, 1, 8192),))
    assert kv_table.kv_model is not None and one_table.kv_model is None
    trace = _trace()
    kv_cost = CostModel.from_table(kv_table)
    aware = _adaptive(trace, kv_cost)
    flat = _adaptive(trace, CostModel.from_table(one_table))
    ks_by_phase = [int(np.median(aware.k[trace.phase == p])) for p in range(len(KVS))]
    # Long context makes verified rows expensive: the step falls as the context grows.
    assert ks_by_phase[0] == W and ks_by_phase[-1] < ks_by_phase[0]
    assert all(a >= b for a, b in zip(ks_by_phase, ks_by_phase[1:], strict=False))
    assert len(set(flat.k[trace.phase >= 1].tolist())) == 1  # one context: one k throughout
    # The one-context decisions priced by the KV-aware costs: the same tokens (acceptance does not
    # depend on the cost), each round at the KV-aware cost of its k.
    costs = kv_cost.step_costs(trace.num_requests, trace.kv_length)  # [R, w]
    flat_ms = costs[np.arange(trace.kv_length.size), flat.k - 1]
    flat_tps = 1000.0 * flat.tokens.sum() / flat_ms.sum()
    gain_pct = 100.0 * (aware.totals()["tokens_per_s"] / flat_tps - 1.0)
    assert gain_pct > 2.0, gain_pct


def test_replay_reports_the_kv_spread_and_cautions_where_it_is_wide():
    """A trace that recorded each round's longest request: the replay's report carries how far
    it sat past the mean the round is priced at, and its line cautions when many rounds spread
    far (a trace without it reports nothing)."""
    from dataclasses import replace

    from speccal.cli.render_replay import kv_spread_line

    trace = _trace()
    cost = CostModel.from_table(_table(((256, 1, 512), (2048, 513, 4096), (6000, 4097, 8192))))
    cfg = ReplayConfig(policies=("adaptive-step",))
    assert replay(trace, cost, cfg).to_dict()["kv_spread"] is None
    # every third round has one request at 3x the mean, the others at the mean
    wide = np.where(np.arange(trace.num_rounds) % 3 == 0, 3.0, 1.0) * trace.kv_length
    spread = replay(replace(trace, kv_max_length=wide), cost, cfg).to_dict()["kv_spread"]
    assert spread["median_max_over_mean"] == 1.0 and spread["p90_max_over_mean"] == 3.0
    assert abs(spread["rounds_past_1_5x_pct"] - 100 / 3) < 1.0
    line = kv_spread_line(spread)
    assert "1.00x" in line and "33 % of rounds past 1.5x" in line and "optimistic" in line
    narrow = kv_spread_line({**spread, "rounds_past_1_5x_pct": 5.0})
    assert "optimistic" not in narrow and kv_spread_line(None) is None


def test_the_longest_request_prices_a_floor_under_the_mean_price():
    """``price_at_kv``: at the rounds' own mean KV it reproduces every run's replay cost; at
    each round's longest request (every request that long) it costs more where the KV grows
    the cost, so each policy's tokens/s there is a floor under its mean-priced tokens/s, and
    the report and its line carry it."""
    from dataclasses import replace

    from speccal.cli.render_replay import kv_spread_line
    from speccal.replay import price_at_kv

    trace = _trace()
    cost = CostModel.from_table(_table(((256, 1, 512), (2048, 513, 4096), (6000, 4097, 8192))))
    wide = np.where(np.arange(trace.num_rounds) % 2 == 0, 2.0, 1.0) * trace.kv_length
    wide = np.minimum(wide, 8192.0)  # inside the table's KV span
    rep = replay(replace(trace, kv_max_length=wide), cost,
                 ReplayConfig(policies=("adaptive-step",)))
    for run in rep.runs:
        np.testing.assert_allclose(price_at_kv(run, cost, trace.kv_length), run.cost_ms)
        assert (run.cost_ms_at_longest >= run.cost_ms - 1e-12).all()
    d = rep.to_dict()
    for p in d["policies"]:
        if p["priced"]:
            assert p["tokens_per_s_at_longest_kv"] < p["tokens_per_s"], p["name"]
    line = kv_spread_line(d["kv_spread"], d["policies"])
    assert "a floor" in line and "adaptive-step" in line
