"""The live policy loop on a pipelined engine, and its replay with the pipeline's feedback lag.

A pipelined ``Engine.step`` plans round ``n + 1`` before it returns round ``n``, so the policy
observes round ``n`` after deciding ``n + 1``; ``speccal.replay.run_sequential(pipelined=True)``
(what ``replay_prediction`` uses for a pipelined run) drives the same policy objects with the
same lag and reproduces every decision.
"""

from __future__ import annotations

import numpy as np

from speccal.live.policies import Phase, replay_prediction, run_live
from speccal.policy import AdaptiveStepConfig, AdaptiveStepPolicy, CostModel, make_policy
from speccal.replay import run_sequential
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.sampling import SamplingParams

W = 3
PHASES = [Phase(0.0, (0.95, 0.95, 0.95)), Phase(0.4, (0.1, 0.1, 0.1))]


def _engine(profile=(0.9, 0.9, 0.9)) -> Engine:
    return Engine(EngineConfig(model="tiny", draft_width=W, request_buckets=(1, 2, 4),
                               acceptance="synthetic", acceptance_profile=profile, seed=0,
                               pipeline=True))


def _cost(eng: Engine, mode: str = "draft_step", per_row: float = 1.0) -> CostModel:
    def f(bcap, g, kv):
        bcap, g = np.asarray(bcap, float), np.asarray(g, float)
        k = g / bcap - 1.0
        return 4.0 + per_row * g + (0.4 * k if mode == "draft_step" else 0.0) + 0 * kv

    return CostModel(cost=f, geometry=eng.geometry, mode=mode)


def _prompts(eng: Engine, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = eng.loaded.config.vocab_size
    return [rng.integers(0, vocab, int(m)).tolist() for m in rng.integers(3, 20, n)]


def test_pipelined_adaptive_step_replays_with_the_pipeline_lag():
    eng = _engine()
    cost = _cost(eng)
    cfg = AdaptiveStepConfig(window_size=4, update_interval=1, switch_min_gain=0.0)
    run = run_live(eng, AdaptiveStepPolicy(cost, cfg), "draft_step", _prompts(eng, 4),
                   SamplingParams(max_tokens=60, ignore_eos=True), phases=PHASES)
    assert run.pipelined and run.k.size > 20 and run.k.min() < W <= run.k.max()
    assert run.trace.num_rounds == run.k.size
    pred = replay_prediction(run, cost, AdaptiveStepPolicy(cost, cfg))
    assert pred["decisions_match"] and (pred["predicted_k"] == run.k).all()
    # the lag is what makes them agree: the synchronous feedback order decides otherwise
    sync = run_sequential(run.trace, cost, AdaptiveStepPolicy(cost, cfg), pipelined=False)
    assert not np.array_equal(sync.k, run.k)
    assert not eng.has_unfinished() and eng.num_inflight == 0


def test_pipelined_adaptive_verify_replays():
    eng = _engine(profile=(0.9, 0.5, 0.2))
    cost = _cost(eng, mode="target_verify", per_row=3.0)
    run = run_live(eng, make_policy("adaptive-verify", cost), "target_verify",
                   _prompts(eng, 4, seed=2), SamplingParams(max_tokens=30, ignore_eos=True))
    assert (run.g_run <= run.g).all() and run.g.min() < run.g.max()
    assert (run.verified <= run.g - run.num_requests).all()
    pred = replay_prediction(run, cost, make_policy("adaptive-verify", cost))
    assert pred["decisions_match"] and pred["verified_match"]


def test_replay_of_a_pipelined_trace_follows_its_lag(tmp_path):
    from speccal.replay import ReplayConfig, replay
    from speccal.trace import load_trace, save_trace

    eng = _engine()
    cost = _cost(eng)
    cfg = AdaptiveStepConfig(window_size=4, update_interval=1, switch_min_gain=0.0)
    # a full-width live run (what the vectorised replay needs), recorded on the pipeline
    run = run_live(eng, make_policy(f"fixed:{W}", cost), "draft_step", _prompts(eng, 4),
                   SamplingParams(max_tokens=60, ignore_eos=True), phases=PHASES)
    trace = load_trace(save_trace(run.trace, tmp_path / "pipe.jsonl"))
    assert trace.meta["pipelined"] is True
    conf = ReplayConfig(policies=("adaptive-step",), step=cfg)
    rep = replay(trace, cost, conf)
    want = run_sequential(trace, cost, AdaptiveStepPolicy(cost, cfg), pipelined=True)
    np.testing.assert_array_equal(rep.run("adaptive-step").k, want.k)
    assert rep.to_dict()["config"]["pipelined"] is True
    trace.meta.pop("pipelined")  # the vectorised twin of the synchronous order differs
    sync = replay(trace, cost, conf).run("adaptive-step")
    assert not np.array_equal(sync.k, want.k)
    np.testing.assert_array_equal(
        sync.k, run_sequential(trace, cost, AdaptiveStepPolicy(cost, cfg)).k)


class _SlowObserver:
    """A fixed-k policy whose feedback handling takes ``delay`` seconds (host bookkeeping)."""

    name = "slow"

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def decide(self, state):
        return self.inner.decide(state)

    def observe(self, feedback):
        import time

        time.sleep(self.delay)
        self.inner.observe(feedback)


def test_pipelined_round_cost_is_its_period_including_the_host_work_between_steps():
    """A pipelined run prices each round by its period (previous step's return to this one's):
    the host's work between steps is in it, and the periods add up to the loop's wall time; a
    synchronous run prices the step alone (the host work is not round cost there)."""
    delay = 0.004
    for pipeline in (True, False):
        eng = Engine(EngineConfig(model="tiny", draft_width=W, request_buckets=(1, 2),
                                  seed=0, pipeline=pipeline))
        cost = _cost(eng)
        policy = _SlowObserver(make_policy("fixed:2", cost=cost), delay)
        run = run_live(eng, policy, "draft_step", _prompts(eng, 2),
                       SamplingParams(max_tokens=24, ignore_eos=True))
        total = run.round_ms.sum() / 1000.0
        if pipeline:
            # every period but the first holds the observer's delay: the first runs from the
            # prefill's empty step to round 0's return, before any feedback was observed
            assert run.round_ms[1:].min() >= 1000.0 * delay
            assert total >= 0.9 * run.loop_s
        else:
            assert total <= run.loop_s - 0.9 * delay * run.k.size


def test_replay_decides_on_the_kv_the_live_plan_saw():
    """A cost whose best k flips at KV 40: the live plan of round n sees the KV of the rounds
    collected so far (two behind on the pipelined loop), and the trace records it
    (``plan_kv_length``), so the replay switches k at the same round; deciding on the trace's
    after-round KV (a trace without the record) switches earlier (H200, bench_kv_gain: every
    single-context replay missed the round its table ran out of calibrated KV)."""
    from dataclasses import replace

    eng = _engine()

    def f(bcap, g, kv):
        g, kv = np.asarray(g, float), np.asarray(kv, float)
        return 4.0 + np.where(kv < 40.0, 0.2, 20.0) * g

    cost = CostModel(cost=f, geometry=eng.geometry, mode="draft_step")
    cfg = AdaptiveStepConfig(window_size=4, update_interval=1, switch_min_gain=0.0)
    run = run_live(eng, AdaptiveStepPolicy(cost, cfg), "draft_step", _prompts(eng, 4),
                   SamplingParams(max_tokens=60, ignore_eos=True))
    trace = run.trace
    assert trace.plan_kv_length is not None and trace.plan_kv_length.size == run.k.size
    assert trace.plan_kv_length.mean() < trace.kv_length.mean()  # the plan saw an older KV
    assert run.k.max() == W and run.k.min() == 1  # the flip happened inside the run
    pred = replay_prediction(run, cost, AdaptiveStepPolicy(cost, cfg))
    assert pred["decisions_match"]
    bare = run_sequential(replace(trace, plan_kv_length=None), cost,
                          AdaptiveStepPolicy(cost, cfg), pipelined=True)
    assert not np.array_equal(bare.k, run.k)
