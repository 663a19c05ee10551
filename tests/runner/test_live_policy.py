"""Live policy loop (``speccal.live.policies``) and the engine's plan hook, on the tiny CPU preset.

The live adaptive-step policy must make exactly the decisions its twin makes when replayed on
the run's own recorded trace; adaptive-verify plans must stay inside the budget, prefix-closed,
by the rule of ``speccal.policy_rules.allocate_prefixes``.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.base.geometry import Geometry
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table_build import build_table
from speccal.live.bench import PolicyBenchConfig, run_policy_bench
from speccal.live.policies import (
    Phase,
    interleaved_order,
    live_cost_model,
    median_summary,
    replay_prediction,
    request_params,
    run_interleaved,
    run_live,
)
from speccal.policy import AdaptiveStepConfig, AdaptiveStepPolicy, CostModel, make_policy
from speccal.policy_rules import allocate_prefixes
from speccal.runner.engine import Engine, EngineConfig, RoundPlan, RoundState
from speccal.runner.sampling import SamplingParams
from speccal.runner.verify_alloc import allocate_prefixes_device
from speccal.trace import load_trace, save_trace

W = 3


def _engine(profile=(0.9, 0.9, 0.9), buckets=(1, 2, 4)) -> Engine:
    return Engine(
        EngineConfig(
            model="tiny",
            draft_width=W,
            request_buckets=buckets,
            acceptance="synthetic",
            acceptance_profile=profile,
            seed=0,
        )
    )


def _cost(geometry: Geometry, mode: str = "draft_step", per_row: float = 1.0) -> CostModel:
    """Known costs: a fixed part plus ``per_row`` ms per target row (draft forwards are free in
    target_verify; in draft_step, ``k`` adds 0.4 ms per draft step of G = Bcap * (k + 1))."""

    def f(bcap, g, kv):
        bcap, g = np.asarray(bcap, float), np.asarray(g, float)
        k = g / bcap - 1.0
        return 4.0 + per_row * g + (0.4 * k if mode == "draft_step" else 0.0) + 0 * kv

    return CostModel(cost=f, geometry=geometry, mode=mode)


def _prompts(eng: Engine, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = eng.loaded.config.vocab_size
    return [rng.integers(0, vocab, int(m)).tolist() for m in rng.integers(3, 20, n)]


PHASES = [Phase(0.0, (0.95, 0.95, 0.95)), Phase(0.5, (0.1, 0.1, 0.1))]


def test_live_adaptive_step_decisions_equal_replay_of_its_own_trace(tmp_path):
    eng = _engine()
    cost = _cost(eng.geometry)
    cfg = AdaptiveStepConfig(window_size=8, update_interval=3, switch_min_gain=0.05)
    run = run_live(
        eng,
        AdaptiveStepPolicy(cost, cfg),
        "draft_step",
        _prompts(eng, 6),
        SamplingParams(max_tokens=40, ignore_eos=True),
        phases=PHASES,
    )
    # The transition makes the policy move: full width while acceptance is high, then lower.
    assert run.k.size > 20 and set(run.k.tolist()) >= {3} and run.k.min() < 3
    assert run.phase[0] == 0 and run.phase[-1] == 1
    assert run.trace.num_rounds == run.k.size and (run.trace.k == run.k).all()
    assert (run.trace.num_requests == run.num_requests).all()
    # Round trip through the trace file, then replay a fresh twin policy on it.
    path = save_trace(run.trace, tmp_path / "live.jsonl")
    back = load_trace(path)
    assert back.meta["policy"] == "adaptive-step" and back.meta["source"] == "runner"
    run.trace = back
    pred = replay_prediction(run, cost, AdaptiveStepPolicy(cost, cfg))
    assert pred["decisions_match"] and pred["priced"]
    assert (pred["predicted_k"] == run.k).all()
    # Predicted time = the known cost of each round's (Bcap, G): replay prices the same rounds.
    bcap = cost.bcap(run.num_requests)
    want = cost.lookup(bcap, cost.g(bcap, run.num_requests * (run.k + 1)), 0.0)
    np.testing.assert_allclose(pred["predicted_round_ms"], want)
    tokens = float(run.round_tokens.sum())
    assert pred["predicted_tokens_per_s"] == pytest.approx(1000.0 * tokens / want.sum())
    # A twin that sees a different history decides differently: the check can fail.
    other = run_live(
        eng,
        AdaptiveStepPolicy(cost, cfg),
        "draft_step",
        _prompts(eng, 6),
        SamplingParams(max_tokens=40, ignore_eos=True),
        phases=[Phase(0.0, (0.1, 0.1, 0.1))],
    )
    run.trace = other.trace
    assert not replay_prediction(run, cost, AdaptiveStepPolicy(cost, cfg))["decisions_match"]


def test_plan_callback_sees_batch_after_admission_and_consecutive_rounds():
    eng = _engine(buckets=(1, 2, 4))
    for p in _prompts(eng, 6):  # 6 requests, 4 slots: admission happens mid-run
        eng.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
    seen: list[RoundState] = []

    def plan(state: RoundState) -> RoundPlan:
        seen.append(state)
        return RoundPlan(1 + state.round_index % W)

    results = []
    while eng.has_unfinished():
        results.append(eng.step(plan))
    ran = [r for r in results if r.num_requests]
    assert [s.round_index for s in seen] == list(range(len(ran)))
    assert [r.round_index for r in ran] == list(range(len(ran)))
    for s, r in zip(seen, ran, strict=True):
        assert s.num_requests == r.num_requests and list(s.request_ids) == r.request_ids
        assert r.k == 1 + s.round_index % W
        # mean KV before the round = KV after minus the round's accepted + 1 per request
        assert s.kv_length == pytest.approx(float(np.mean(r.kv_lengths - r.accepted - 1)))
    assert seen[0].num_requests == 4 and any(s.num_requests < 4 for s in seen)


def test_verify_budget_is_respected_prefix_closed_and_follows_the_rule():
    eng = _engine(profile=(0.8, 0.6, 0.4))
    for p in _prompts(eng, 4, seed=1):
        eng.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
    eng.prefill_pending()  # admit now: the batch size is known before the first round
    for budget in (4, 5, 7, 9, 12, 16, 6, 8):
        b = len(eng.running_ids())
        res = eng.step(RoundPlan(W, verify_budget=budget))
        # the rule applied on the device to this round's own draft scores
        fit = max(g for g in eng.geometry.target_rows[res.bcap] if g <= budget)
        want = allocate_prefixes(res.draft_scores, fit - b)
        np.testing.assert_array_equal(res.num_verify, want)
        assert res.g == fit and res.num_verify.sum() == min(fit - b, b * W)
        assert int((res.num_verify + 1).sum()) <= res.g
        assert (res.accepted <= res.num_verify).all()  # only verified prefixes can be accepted
    with pytest.raises(InputError, match="verify_budget"):
        eng.step(RoundPlan(W, verify_budget=1))
    with pytest.raises(InputError, match="verify_budget"):
        eng.step(RoundPlan(W, verify_tokens=[1, 1, 1, 1], verify_budget=8))
    with pytest.raises(InputError, match="full width"):
        eng.step(RoundPlan(W - 1, verify_budget=8))


def test_live_adaptive_verify_stays_inside_its_budgets():
    eng = _engine(profile=(0.9, 0.5, 0.2))
    cost = _cost(eng.geometry, mode="target_verify", per_row=3.0)
    run = run_live(
        eng,
        make_policy("adaptive-verify", cost),
        "target_verify",
        _prompts(eng, 4, seed=2),
        SamplingParams(max_tokens=30, ignore_eos=True),
    )
    assert (run.k == W).all() and (run.g_run <= run.g).all()
    assert (run.verified <= run.g - run.num_requests).all()
    assert run.reasons[:2] == ["warmup", "warmup"] and "scored" in run.reasons
    assert run.g.min() < run.g.max()  # costly rows: the budget shrinks once scored
    pred = replay_prediction(run, cost, make_policy("adaptive-verify", cost))
    assert pred["decisions_match"]  # budgets depend on n-2 feedback only


def test_uncalibrated_points_run_full_width():
    eng = _engine(profile=(0.1, 0.1, 0.1))

    def nan_cost(bcap, g, kv):
        return np.full(np.broadcast(bcap, g, kv).shape, np.nan)

    cost = CostModel(cost=nan_cost, geometry=eng.geometry)
    run = run_live(
        eng,
        make_policy("adaptive-step", cost),
        "draft_step",
        _prompts(eng, 3),
        SamplingParams(max_tokens=20, ignore_eos=True),
    )
    assert (run.k == W).all() and "uncalibrated" in run.reasons
    assert not replay_prediction(run, cost, make_policy("adaptive-step", cost))["priced"]


@pytest.mark.parametrize(
    "policy, mode", [("adaptive-verify", "target_verify"), ("adaptive-step", "draft_step"),
                     ("fixed:2", "draft_step")])
def test_a_batch_past_the_tables_buckets_runs_full_width_and_is_counted(policy, mode):
    """The engine captured buckets 1..8, the table only 1, 2, 4: a batch of 6 has no bucket
    in the table. It runs at full width (adaptive verify once handed the engine a budget of 0
    and the run failed), and every report counts those rounds as unpriced."""
    eng = _engine(profile=(0.9, 0.5, 0.2), buckets=(1, 2, 4, 8))
    small = Geometry(draft_width=W, request_buckets=(1, 2, 4),
                     target_rows={b: eng.geometry.target_rows[b] for b in (1, 2, 4)},
                     kv_capacity_tokens=eng.geometry.kv_capacity_tokens,
                     max_model_len=eng.geometry.max_model_len,
                     block_size=eng.geometry.block_size)
    known = _cost(small, mode=mode, per_row=3.0)

    def table_cost(bcap, g, kv):  # a table prices only its own buckets
        out = known.cost(bcap, g, kv)
        return np.where(np.isin(np.asarray(bcap), small.request_buckets), out, np.nan)

    cost = CostModel(cost=table_cost, geometry=small, mode=mode)
    run = run_live(eng, make_policy(policy, cost), mode, _prompts(eng, 6, seed=3),
                   SamplingParams(max_tokens=12, ignore_eos=True))
    summary = run.summary()
    big = run.num_requests > 4
    assert big.any() and (~big).any()  # requests finish one by one: the batch shrinks to 4
    assert not run.priced[big].any() and run.priced[~big].all()
    assert summary["rounds_uncalibrated"] == int(big.sum())
    assert summary["rounds_priced"] + summary["rounds_uncalibrated"] == summary["rounds"]
    if policy.startswith("adaptive"):
        assert {run.reasons[i] for i in np.flatnonzero(big)} == {"uncalibrated"}
        assert (run.k[big] == W).all() and (run.verified[big] == W * run.num_requests[big]).all()


def test_per_request_max_tokens_shrink_the_batch_mid_run():
    """Requests with their own ``max_tokens`` finish at different rounds: the batch shrinks
    while the others keep running, each request emits its own count, and the phase change
    happens at the fraction of the summed ``max_tokens``."""
    eng = _engine(profile=(0.5, 0.5, 0.5), buckets=(1, 2, 4))
    cost = _cost(eng.geometry)
    max_tokens = [4, 10, 18, 30]
    run = run_live(eng, make_policy("fixed:2", cost), "draft_step", _prompts(eng, 4),
                   max_tokens, phases=[Phase(0.0, (0.9, 0.9, 0.9)), Phase(0.5, (0.1, 0.1, 0.1))])
    b = run.num_requests
    assert b[0] == 4 and b[-1] == 1 and (np.diff(b) <= 0).all()
    assert len(set(b.tolist())) == 4  # 4, 3, 2, 1: one request leaves at a time
    assert run.output_tokens == sum(max_tokens)
    assert run.phase[0] == 0 and run.phase[-1] == 1
    # one SamplingParams for all (the old call) and a per-request sequence of them both work
    same = run_live(eng, make_policy("fixed:2", cost), "draft_step", _prompts(eng, 4),
                    SamplingParams(max_tokens=6, ignore_eos=True))
    assert same.num_requests[0] == 4 and same.output_tokens == 24
    each = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    assert request_params(each, 4) == each
    runs = run_interleaved(eng, {"fixed:1": lambda: make_policy("fixed:1", cost)}, "draft_step",
                           _prompts(eng, 4), max_tokens)
    assert runs[0].run.output_tokens == sum(max_tokens) and runs[0].run.num_requests[-1] == 1
    for bad in ([4, 10], [4, 0, 1, 1], [4, True, 1, 1]):
        with pytest.raises(InputError, match="params"):
            request_params(bad, 4)


def test_live_loop_refusals():
    eng = _engine()
    cost = _cost(eng.geometry)
    with pytest.raises(InputError, match="phases"):
        run_live(eng, make_policy("fixed:1", cost), "draft_step", [[1, 2]],
                 SamplingParams(max_tokens=2), phases=[Phase(0.5, (1, 1, 1))])  # fmt: skip
    with pytest.raises(InputError, match="acceptance_profile"):
        eng.set_acceptance_profile((0.5, 0.5))
    plain = Engine(EngineConfig(model="tiny", draft_width=W, request_buckets=(1, 2)))
    with pytest.raises(UnsupportedError, match="synthetic"):
        plain.set_acceptance_profile((0.5, 0.5, 0.5))
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(InputError, match="idle engine"):
        run_live(eng, make_policy("fixed:1", cost), "draft_step", [[1]], SamplingParams())


@pytest.mark.parametrize("model", ["additive", "sps"])
def test_live_cost_model_is_the_memoised_table_cost_model(model):
    """The live loop plans with the memoised lookups (``speccal.costmodel.lookup``, tested there
    against the plain ones); here: it is memoised and answers what the table answers."""
    df = make_measurements(
        bias_ms=5.0,
        alpha_ms={1: 0.0, 2: 0.5, 4: 1.5},
        theta_ms={2: 0.0, 3: 0.2, 4: 0.4, 6: 0.9, 8: 1.3, 12: 2.0, 16: 2.9},
        draft_width=W,
        contexts=((32, 1, 100), (160, 101, 300)),
        context_offsets_ms=(0.0, 2.0),
        noise_ms=0.05,
    )
    table = build_table(df, model=model, compatibility=_engine(buckets=(1, 2, 4)).compatibility())
    live, ref = live_cost_model(table), CostModel.from_table(table)
    assert live.memo is not None and ref.memo is None
    b, kv = np.array([1, 2, 4, 4, 5]), np.array([10.0, 150.0, 50.0, 250.0, 10.0])
    np.testing.assert_array_equal(live.step_costs(b, kv), ref.step_costs(b, kv))
    for n, x in zip(b.tolist(), kv.tolist(), strict=True):  # scalar calls: the memoised path
        np.testing.assert_array_equal(live.step_costs(n, x), ref.step_costs(n, x))
    assert live.step_costs(4, 50.0)[0] != live.step_costs(4, 200.0)[0]  # the two contexts differ


def test_device_allocation_equals_the_policy_rule():
    rng = np.random.default_rng(3)
    for trial in range(200):
        bcap = int(rng.choice([1, 2, 4, 8]))
        n = int(rng.integers(1, bcap + 1))
        k = int(rng.integers(1, 5))
        s = (
            rng.choice([0.0, 0.25, 0.5, 1.0, np.nan], size=(bcap, k))
            if trial % 2
            else rng.random((bcap, k))
        )
        budget = int(rng.integers(-1, n * k + 3))
        got = allocate_prefixes_device(torch.tensor(s, dtype=torch.float32), n, budget)
        want = allocate_prefixes(s[:n].astype(np.float32).astype(np.float64), budget)
        np.testing.assert_array_equal(got.numpy()[:n], want)
        assert (got.numpy()[n:] == 0).all()
    out = torch.full((4,), -1, dtype=torch.int64)
    allocate_prefixes_device(torch.ones(4, 3), 4, 5, out=out)
    assert out.tolist() == [2, 1, 1, 1]  # position-major ties: all first drafts, then request 0


# ------------------------------------------------------------------ repeats, interleaved


def test_interleaved_order_is_round_robin_rotated_each_cycle():
    order = interleaved_order(["A", "B", "C"], 4)
    assert "".join(n for _, _, n in order) == "ABCBCACABABC"
    assert [c for c, _, _ in order] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert [p for _, p, _ in order] == [0, 1, 2] * 4
    # a multiple of the number of policies: every policy holds every position equally often
    full = interleaved_order(["A", "B", "C"], 3)
    for name in "ABC":
        assert sorted(p for _, p, n in full if n == name) == [0, 1, 2]
    assert interleaved_order(["B", "A"], 1) == [(0, 0, "B"), (0, 1, "A")]  # N = 1: as given
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InputError, match="--repeats"):
            interleaved_order(["A"], bad)


def test_run_interleaved_fresh_policy_per_run_and_timestamps():
    eng = _engine(profile=(1.0, 1.0, 1.0))
    cost = _cost(eng.geometry)
    built = []

    def factory(name):
        def make():
            pol = make_policy(name, cost)
            built.append(pol)
            return pol

        return make

    runs = run_interleaved(
        eng,
        {"fixed:1": factory("fixed:1"), "fixed:3": factory("fixed:3")},
        "draft_step",
        _prompts(eng, 2),
        SamplingParams(max_tokens=6, ignore_eos=True),
        repeats=3,
    )
    order = ["fixed:1", "fixed:3", "fixed:3", "fixed:1", "fixed:1", "fixed:3"]  # rotated cycles
    assert [r.policy for r in runs] == order
    assert len(built) == 6 and len({id(p) for p in built}) == 6
    assert [(r.cycle, r.position) for r in runs] == [(c, p) for c in range(3) for p in range(2)]
    for r in runs:
        assert r.run.output_tokens == 12 and (r.run.k == int(r.policy[-1])).all()
        assert r.start_s < r.end_s
        assert datetime.fromisoformat(r.started_at) <= datetime.fromisoformat(r.ended_at)
        assert r.run.stats["drafted"] == int(r.run.verified.sum())  # stats reset per run
    for a, b in zip(runs, runs[1:], strict=False):
        assert a.end_s <= b.start_s
    rec = runs[1].record(1)
    assert rec["index"] == 1 and rec["cycle"] == 0 and rec["position"] == 1
    assert rec["round_tokens_per_s"] == runs[1].run.summary()["round_tokens_per_s"]


def test_common_random_numbers_make_alike_policies_accept_alike():
    """``seed``: run c of every policy starts the acceptance stream at ``seed + c``, so two
    policies that decide alike (two names for fixed:2) accept the same drafts in the same
    cycle; without it the stream runs on and their acceptance differs by luck."""
    def accepted(seed):
        eng = _engine(profile=(0.6, 0.5, 0.4))
        cost = _cost(eng.geometry)
        runs = run_interleaved(
            eng, {"a": lambda: make_policy("fixed:2", cost),
                  "b": lambda: make_policy("fixed:2", cost)},
            "draft_step", _prompts(eng, 2), SamplingParams(max_tokens=24, ignore_eos=True),
            repeats=2, seed=seed)
        return {(tr.cycle, tr.policy): tr.run.accepted.tolist() for tr in runs}

    got = accepted(seed=11)
    for c in (0, 1):
        assert got[c, "a"] == got[c, "b"]
    assert got[0, "a"] != got[1, "a"]  # cycles draw apart
    assert accepted(seed=11) == got  # and reproducibly
    loose = accepted(seed=None)
    assert any(loose[c, "a"] != loose[c, "b"] for c in (0, 1))


def test_median_summary_takes_medians_over_the_runs():
    def summ(tps, err, match=True):
        return {
            "policy": "fixed:2",
            "rounds": 10,
            "round_tokens_per_s": tps,
            "tokens_per_s": tps / 2,
            "loop_tokens_per_s": tps / 4,
            "timeline": [[0, 10, 2, 6]],
            "replay": {"priced": True, "error_pct": err, "decisions_match": match},
        }

    one = summ(100.0, 3.0)
    assert median_summary([one]) == one  # N = 1: the run's own summary, no extra keys
    runs = [summ(100.0, 3.0), summ(300.0, 1.0, match=False), summ(110.0, 8.0), summ(90.0, 2.0)]
    m = median_summary(runs)
    assert m["round_tokens_per_s"] == 105.0 and m["tokens_per_s"] == 52.5  # even N: mid-mean
    assert m["replay"]["error_pct"] == 2.5 and m["replay"]["decisions_match"] is False
    assert m["replay"]["priced"] is True and m["timeline"] == [[0, 10, 2, 6]]
    assert m["repeats"] == 4 and m["spread"]["round_tokens_per_s"] == [90.0, 300.0]
    assert m["spread"]["replay_error_pct"] == [1.0, 8.0]
    assert median_summary(runs[:3])["round_tokens_per_s"] == 110.0


# ------------------------------------------------------------------ the policy bench library


def _bench_engine_config(**kw) -> EngineConfig:
    base = dict(model="tiny", draft_width=W, request_buckets=(1, 2, 4), seed=0)
    base.update(acceptance="synthetic", acceptance_profile=(0.9, 0.9, 0.9))
    base.update(kw)
    return EngineConfig(**base)


def test_policy_bench_library_without_a_table_runs_fixed_policies_unpriced(tmp_path):
    cfg = PolicyBenchConfig(
        engine=_bench_engine_config(),
        policies=("fixed:1", " FIXED:3 "),
        phases=(Phase(0.5, (0.1, 0.1, 0.1)),),
        num_requests=2,
        prompt_len=8,
        max_tokens=8,
        trace_out=tmp_path / "t.jsonl",
    )
    assert cfg.policies == ("fixed:1", "fixed:3")  # normalised
    assert cfg.phases[0] == Phase(0.0, (0.9, 0.9, 0.9))  # the engine's profile until 0.5
    doc = run_policy_bench(cfg)
    assert [p["policy"] for p in doc["policies"]] == ["fixed:1", "fixed:3"]
    assert [tr.policy for tr in doc["runs"]] == ["fixed:1", "fixed:3"]
    assert doc["cost_table"] is None and doc["table_warnings"] == []
    assert all(p["replay"]["priced"] is False for p in doc["policies"])
    assert doc["traces"]["fixed:3"].endswith("t.fixed3.jsonl")
    assert load_trace(doc["traces"]["fixed:1"]).meta["policy"] == "fixed:1"
    assert doc["setup"]["request_buckets"] == [1, 2, 4] and doc["setup"]["max_tokens"] == 8


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"policies": ()}, "at least one of"),
        ({"policies": ("adaptive-step",)}, "--cost-table"),
        ({"policies": ("fixed:1", "fixed:1")}, "each policy at most once"),
        ({"repeats": 0}, "--repeats"),
        ({"num_requests": 0}, "--num-requests"),
        ({"cost_table": Path("/nonexistent/table.json")}, "an existing cost table file"),
        ({"phases": (Phase(0.2, (0.5, 0.5)),)}, "3 probabilities"),
        ({"engine": _bench_engine_config(acceptance="greedy", acceptance_profile=None),
          "phases": (Phase(0.2, (0.5, 0.5, 0.5)),)}, "only with --acceptance synthetic"),  # fmt: skip
        ({"engine": _bench_engine_config(acceptance="sample", acceptance_profile=None)},
         "--acceptance"),  # fmt: skip
    ],
)
def test_policy_bench_config_refuses_bad_input(kw, match):
    args = {"engine": _bench_engine_config(), "policies": ("fixed:1",), **kw}
    with pytest.raises(InputError, match=match):
        PolicyBenchConfig(**args)


def test_the_collector_is_paused_while_the_live_rounds_run():
    """A full collection (60-150 ms with torch loaded) inside a timed round made whole sweep
    runs look disturbed: the live loop runs with the collector off and restores it after."""
    import gc

    eng = _engine(profile=(0.5, 0.5, 0.5), buckets=(1, 2, 4))
    cost = _cost(eng.geometry)
    policy = make_policy("fixed:2", cost)
    seen = []
    decide = policy.decide
    policy.decide = lambda state: (seen.append(gc.isenabled()), decide(state))[1]
    assert gc.isenabled()
    run_live(eng, policy, "draft_step", _prompts(eng, 3), [12, 12, 12])
    assert seen and not any(seen) and gc.isenabled()


def test_the_collector_is_paused_while_a_timed_bench_run_runs():
    """``speccal bench``'s timed run (prefill and rounds) runs with the collector off too."""
    import gc

    from speccal.live.bench import timed_run

    eng = _engine(profile=(0.5, 0.5, 0.5), buckets=(1, 2, 4))
    seen = []
    step = eng.step

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return step(*a, **k)

    eng.step = spy
    timing, outs = timed_run(eng, _prompts(eng, 2), SamplingParams(max_tokens=6, ignore_eos=True),
                             2)
    assert seen and not any(seen) and gc.isenabled()
    assert [len(o) for o in outs] == [6, 6] and timing.tokens == 12
