"""Adaptive target verify in the round: ``RoundPlan(verify_budget=G)`` on the tiny CPU preset.

The draft runs full width; the device allocates each request's verified prefix from the
round's own draft scores (``RoundResult.draft_scores``) by the rule of
``speccal.policy_rules.allocate_prefixes`` inside ``G - B`` draft rows, between the draft and the
target part with no host read; both input-update paths run the same allocation.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from speccal.live.generate import generate
from speccal.live.policies import replay_prediction, run_live
from speccal.policy import CostModel, make_policy
from speccal.policy_rules import allocate_prefixes
from speccal.runner import round as round_mod
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams
from speccal.trace import load_trace, save_trace

W = 3
BUDGETS = (4, 5, 7, 9, 12, 16, 6, 8, 10, 11)


def _cfg(**kw) -> EngineConfig:
    base = dict(model="tiny", draft_width=W, request_buckets=(1, 2, 4), max_model_len=128, seed=0)
    return EngineConfig.flat(**(base | kw))


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, int(m)).tolist() for m in rng.integers(3, 24, n)]


def _fit(eng: Engine, bcap: int, budget: int) -> int:
    return max(g for g in eng.geometry.target_rows[bcap] if g <= budget)


def _run_budgets(eng: Engine, prompts, max_tokens: int = 30) -> list:
    """Run ``prompts`` to completion, round ``i`` with ``verify_budget = BUDGETS[i % len]``."""
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    eng.prefill_pending()
    results = []
    i = 0
    while eng.has_unfinished():
        results.append((len(eng.running_ids()), BUDGETS[i % len(BUDGETS)]))
        res = eng.step(RoundPlan(W, verify_budget=BUDGETS[i % len(BUDGETS)]))
        results[-1] += (res,)
        i += 1
    return results


CASES = [
    ("host", "greedy", None),
    ("in_graph", "greedy", None),
    ("host", "synthetic", (0.9, 0.6, 0.3)),
    ("in_graph", "synthetic", (0.9, 0.6, 0.3)),
]


@pytest.mark.parametrize("update,acceptance,profile", CASES)
def test_allocation_is_the_rule_on_this_rounds_scores(update, acceptance, profile):
    # synthetic: scores that say something about each draft (0 would report the profile
    # itself every round, the same allocation every round)
    extra = {"score_informativeness": 0.5} if acceptance == "synthetic" else {}
    eng = Engine(_cfg(input_update=update, acceptance=acceptance, acceptance_profile=profile,
                      **extra))
    rounds = _run_budgets(eng, _prompts(4))
    prev: dict[int, np.ndarray] = {}
    differs_from_previous_scores = 0
    trimmed = 0
    for b, budget, res in rounds:
        assert res.k == W and res.draft_scores.shape == (b, W)
        fit = _fit(eng, res.bcap, budget)
        want = allocate_prefixes(res.draft_scores, fit - b)
        np.testing.assert_array_equal(res.num_verify, want)
        # budget: G is the largest bucket inside it, the allocation fills G - B rows at most
        assert res.g == fit <= budget
        assert res.num_verify.sum() == min(fit - b, b * W)
        assert int((res.num_verify + 1).sum()) <= res.g
        assert ((res.num_verify >= 0) & (res.num_verify <= W)).all()
        # prefix closure: only verified drafts can be accepted, in order
        assert (res.accepted <= res.num_verify).all()
        assert (res.accept_matrix.sum(axis=1) == res.accepted).all()
        trimmed += int((res.num_verify < W).any())
        if all(r in prev for r in res.request_ids):
            old = np.stack([prev[r] for r in res.request_ids])
            differs_from_previous_scores += int(
                not np.array_equal(allocate_prefixes(old, fit - b), res.num_verify)
            )
        prev = {r: res.draft_scores[i] for i, r in enumerate(res.request_ids)}
    assert trimmed > len(rounds) // 2  # budgets really trimmed the verify
    # the allocation follows this round's scores, not the previous round's
    assert differs_from_previous_scores > 0


def test_budget_below_every_bucket_verifies_no_draft():
    eng = Engine(_cfg(acceptance="forced"))  # forced: every verified draft is accepted
    for p in _prompts(3):
        eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    eng.prefill_pending()
    res = eng.step(RoundPlan(W, verify_budget=3))  # Bcap 4: the smallest bucket is 4 rows
    assert res.g == 4 and res.num_verify.tolist() == [0, 0, 0] and res.accepted.sum() == 0
    res = eng.step(RoundPlan(W, verify_budget=5))  # G = 4 (no bucket 5): one draft row
    assert res.g == 4 and res.num_verify.sum() == 1 and res.accepted.sum() == 1


@pytest.mark.parametrize("acceptance,profile", [("greedy", None), ("synthetic", (0.9, 0.6, 0.3))])
def test_in_graph_and_host_updates_agree(acceptance, profile):
    runs = {}
    extra = {"score_informativeness": 0.5} if acceptance == "synthetic" else {}
    for update in ("host", "in_graph"):
        eng = Engine(_cfg(input_update=update, acceptance=acceptance, acceptance_profile=profile,
                          **extra))
        rounds = _run_budgets(eng, _prompts(4, seed=3))
        assert eng.runner.resolve_update(4, W, 8) == update
        runs[update] = [(r.request_ids, r.num_verify.tolist(), r.emitted) for _, _, r in rounds]
    assert runs["host"] == runs["in_graph"]


@functools.cache
def _plain(n: int) -> tuple[tuple[int, ...], ...]:
    eng = Engine(_cfg(speculative=False, block_size=4, prefill_chunk=5))
    outs = generate(eng, _prompts(n), SamplingParams(max_tokens=28, ignore_eos=True), 0)
    return tuple(tuple(o) for o in outs)


@pytest.mark.parametrize("update", ["host", "in_graph"])
def test_greedy_is_lossless_under_device_trimmed_verify(update):
    eng = Engine(_cfg(input_update=update, block_size=4, prefill_chunk=5))
    rids = [eng.add_request(p, SamplingParams(max_tokens=28, ignore_eos=True)) for p in _prompts(4)]
    rng = np.random.default_rng(0)
    partial = 0
    while eng.has_unfinished():
        eng.prefill_pending()
        n = len(eng.running_ids())
        res = eng.step(RoundPlan(W, verify_budget=int(rng.integers(n, n * (W + 1) + 1))))
        # a rejection-free trimmed prefix ends the round at the trim (the bonus is the target's)
        partial += int(((res.accepted == res.num_verify) & (res.num_verify < W)).any())
    outs = tuple(tuple(eng.requests[r].output) for r in rids)
    assert outs == _plain(4)
    assert partial > 0 and eng.stats.num_accepted > 0


def test_no_host_read_between_draft_and_target_in_graph(monkeypatch):
    """In-graph update: from the draft to the end of the target part no sync, no tensor value
    reaches Python (``item`` / ``tolist`` / ``nonzero`` / ``bool`` raise); the host update
    syncs exactly once (its fallback boundary), the collection once more."""
    counts = {"sync": 0}
    real_sync = round_mod.synchronize

    def counting_sync(device):
        counts["sync"] += 1
        real_sync(device)

    monkeypatch.setattr(round_mod, "synchronize", counting_sync)
    for update, syncs in (("in_graph", 0), ("host", 1)):
        eng = Engine(_cfg(input_update=update))
        for p in _prompts(4):
            eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True))
        eng.prefill_pending()
        batch = list(eng._running)
        bcap = eng.geometry.bcap_for(len(batch))
        x = eng.runner.prepare(batch, bcap, W, None, 8, 8 - len(batch))
        counts["sync"] = 0
        with monkeypatch.context() as m:
            if update == "in_graph":

                def boom(*a, **k):
                    raise AssertionError("host read of a tensor value inside execute")

                for name in ("item", "tolist", "nonzero", "__bool__"):
                    m.setattr(torch.Tensor, name, boom)
            eng.runner.execute(x)
        assert counts["sync"] == syncs
        accepted, nv, _, scores = eng.runner.collect(x)
        np.testing.assert_array_equal(nv, allocate_prefixes(scores, 8 - len(batch)))
        assert nv.sum() == 4 and (accepted <= nv).all()


def test_live_adaptive_verify_trace_replays_the_device_allocation(tmp_path):
    eng = Engine(_cfg(acceptance="synthetic", acceptance_profile=(0.9, 0.5, 0.2),
                      score_informativeness=0.7))

    def per_row(bcap, g, kv):  # known costs: 4 ms + 3 ms per target row
        return 4.0 + 3.0 * np.asarray(g, float) + 0 * np.asarray(bcap, float) + 0 * kv

    cost = CostModel(cost=per_row, geometry=eng.geometry, mode="target_verify")
    run = run_live(
        eng,
        make_policy("adaptive-verify", cost),
        "target_verify",
        _prompts(4, seed=2),
        SamplingParams(max_tokens=30, ignore_eos=True),
    )
    assert (run.k == W).all() and (run.g_run == run.g).all()
    assert run.g.min() < run.g.max() and (run.verified < run.num_requests * W).any()
    run.trace = load_trace(save_trace(run.trace, tmp_path / "verify.jsonl"))
    pred = replay_prediction(run, cost, make_policy("adaptive-verify", cost))
    assert pred["decisions_match"] and pred["priced"]
    # the replay's host allocation on the recorded scores = the live device allocation
    assert pred["verified_match"]


@pytest.mark.cuda
@pytest.mark.parametrize("update", ["host", "in_graph"])
def test_split_graphs_equal_eager_under_verify_budget_cuda(update):
    """Captured graphs: the allocation runs between the draft and target replays (CUDA only;
    the same ``RoundRunner.execute`` sequence the CPU tests above run eagerly)."""
    kw = dict(device="cuda", dtype="float32", input_update=update, attention_backend="triton")
    runs = []
    for mode in ("eager", "split"):
        rounds = _run_budgets(Engine(_cfg(graph_mode=mode, **kw)), _prompts(4, seed=5))
        runs.append([(r.num_verify.tolist(), r.emitted) for _, _, r in rounds])
        for b, _, res in rounds:
            want = allocate_prefixes(res.draft_scores, res.g - b)
            np.testing.assert_array_equal(res.num_verify, want)
    assert runs[0] == runs[1]


def test_cli_bench_adaptive_verify_trace_replays(tmp_path):
    """``speccal bench --policy adaptive-verify`` on a real target_verify calibration of the tiny
    preset, then ``speccal replay`` of the recorded trace."""
    import json

    from rich.console import Console
    from typer.testing import CliRunner

    from speccal.calibrate.pipeline import CalibrateOptions, calibrate
    from speccal.cli import app

    cfg = tmp_path / "cfg.json"
    calib = {
        "request_buckets": [1, 2, 4],
        # windows long enough (median of 3) that CPU timing noise cannot make a fitted cell
        # non-positive, which would leave the replay unpriced
        "warmup_steps": 2,
        "window_steps": 16,
        "windows_per_point": 3,
    }
    calib["contexts"] = [{"prefill_tokens": 16, "min_kv_length": 1, "max_kv_length": 256}]
    cfg.write_text(json.dumps({"version": 1, "calibration": calib}))
    table = tmp_path / "tv.json"
    opts = CalibrateOptions(
        model="tiny",
        request_buckets=(1, 2, 4),
        config_path=cfg,
        out=table,
        progress=False,
        flags={"mode": "target_verify"},
        # the replay path is under test, not this machine's timing noise: no gate
        remeasure_rounds=0,
        accept_noisy=True,
    )
    calibrate(opts, console=Console(stderr=True, quiet=True))
    args = ["bench", "--policy", "adaptive-verify", "--cost-table", str(table)]
    args += ["--request-buckets", "1,2,4", "--num-requests", "4", "--max-tokens", "30"]
    args += ["--acceptance", "synthetic", "--profile", "0.9,0.5,0.2", "--prompt-len", "8"]
    args += ["--trace-out", str(tmp_path / "run.jsonl"), "--json"]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    (pol,) = doc["policies"]
    assert doc["table_mode"] == "target_verify" and pol["mean_k"] == 3
    assert pol["replay"]["decisions_match"] and pol["replay"]["verified_match"]
    assert pol["output_tokens"] == 4 * 30
    trace = doc["traces"]["adaptive-verify"]
    args = ["replay", "--table", str(table), "--trace", trace, "--policy", "adaptive-verify"]
    r = CliRunner().invoke(app, [*args, "--json"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["mode"] == "target_verify" and rep["policies"][0]["priced"]
