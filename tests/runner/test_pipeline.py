"""Pipelined rounds (``EngineConfig(pipeline=True)``) equal the synchronous loop token for token.

Tiny CPU preset (random weights; the MTP head agrees with the target ~40 % of the time, so
rounds see every accepted length), block size 4, prefill chunks of 5 tokens. The pipelined
engine queues round ``n + 1`` before it collects round ``n``; its metadata is derived on the
device from the per-slot state (``RoundRunner.derive_inputs``); stop rules fire one round late
and the extra round's tokens are discarded. Both input-update paths (``host`` on the torch
backend, ``in_graph`` with the reference kernels) run the pipelined code path.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from speccal.runner import round as round_mod
from speccal.runner.buffers import StaticInputs
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams
from tests.runner.host_rule import host_inputs

W = 4
MAX_TOKENS = (5, 17, 9, 12, 3, 20, 1, 8)  # 1: finishes at prefill; 3, 5: mid-round


def _cfg(**kw) -> EngineConfig:
    base = dict(
        model="tiny",
        draft_width=W,
        request_buckets=(1, 2, 4),
        block_size=4,
        prefill_chunk=5,
        max_model_len=128,
    )
    return EngineConfig.flat(**(base | kw))


@functools.cache
def _engine(pipeline: bool, **kw) -> Engine:
    return Engine(_cfg(pipeline=pipeline, **kw))


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, int(m)).tolist() for m in rng.integers(3, 24, n)]


def _run(eng: Engine, prompts, params, plan, arrive_every: int = 0):
    """Run to completion; with ``arrive_every`` > 0 the requests arrive one per that many steps.

    Returns (outputs by arrival order, results). Checks that the emitted tokens of the results
    concatenate to each request's output (the first token included) and that no request emits
    after it finished.
    """
    eng.reset()
    rids: list[int] = []
    pending = list(zip(prompts, params, strict=True))
    if not arrive_every:
        rids = [eng.add_request(p, sp) for p, sp in pending]
        pending = []
    results = []
    emitted: dict[int, list[int]] = {}
    done: set[int] = set()
    step = 0
    while pending or eng.has_unfinished():
        if pending and step % arrive_every == 0:
            p, sp = pending.pop(0)
            rids.append(eng.add_request(p, sp))
        res = eng.step(plan)
        results.append(res)
        for rid, em in zip(res.request_ids, res.emitted, strict=True):
            assert rid not in done, f"request {rid} emitted after it finished"
            emitted.setdefault(rid, []).extend(em)
        for rid, tok in res.first_tokens.items():
            if rid not in res.request_ids:
                emitted.setdefault(rid, []).append(tok)
        done.update(res.finished)
        step += 1
        assert step < 500
    outs = [list(eng.requests[r].output) for r in rids]
    for r, o in zip(rids, outs, strict=True):
        assert emitted[r] == o
        assert r in done
    assert eng.num_free_kv_tokens == eng.geometry.kv_capacity_tokens  # every block freed
    return outs, results


def _params(n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], ignore_eos=True, **kw)
            for i in range(n)]


def _both(plan, n=6, arrive_every=0, params=None, **kw):
    prompts = _prompts(n)
    params = params or _params(n)
    sync = _run(_engine(False, **kw), prompts, params, plan, arrive_every)
    pipe = _run(_engine(True, **kw), prompts, params, plan, arrive_every)
    return sync, pipe


@pytest.mark.parametrize("update", ["auto", "in_graph"])
@pytest.mark.parametrize("k", range(1, W + 1))
def test_pipelined_greedy_equals_synchronous(k, update):
    # 6 requests > the largest bucket (4): some wait for a slot freed one round late
    (s_out, s_res), (p_out, p_res) = _both(RoundPlan(k), input_update=update)
    assert p_out == s_out
    eng = _engine(True, input_update=update)
    assert eng.stats.num_accepted > 0 and eng.stats.hist[0] > 0
    # the lag is real: the first step collects nothing, finished requests cost extra rows
    assert p_res[0].round_index == -1 and p_res[0].num_requests == 0
    assert sum(r.num_discarded for r in p_res) > 0
    ran = [r.round_index for r in p_res if r.round_index >= 0]
    assert ran == list(range(len(ran)))
    # per-request acceptance is batch-invariant under greedy: the same statistics
    np.testing.assert_array_equal(eng.stats.hist, _engine(False, input_update=update).stats.hist)


@pytest.mark.parametrize("update", ["auto", "in_graph"])
def test_requests_arriving_every_few_rounds(update):
    (s_out, _), (p_out, p_res) = _both(RoundPlan(3), n=8, arrive_every=3, input_update=update)
    assert p_out == s_out
    assert max(r.num_requests for r in p_res) >= 2


def test_stop_tokens_inside_accepted_prefixes():
    prompts = _prompts(4, seed=3)
    free = _run(_engine(False), prompts, _params(4), RoundPlan(W))[0]
    # stop on each request's 4th..6th token: inside a round's accepted prefix in general
    stops = [SamplingParams(max_tokens=30, stop_token_ids=(o[min(3 + i, len(o) - 1)],))
             for i, o in enumerate(free)]
    s_out, _ = _run(_engine(False), prompts, stops, RoundPlan(W))
    p_out, p_res = _run(_engine(True), prompts, stops, RoundPlan(W))
    assert p_out == s_out
    for o, sp in zip(p_out, stops, strict=True):
        assert o[-1] in sp.stop_token_ids and sp.stop_token_ids[0] not in o[:-1]
    assert sum(r.num_discarded for r in p_res) > 0


def test_forced_acceptance_equal_and_full():
    (s_out, s_res), (p_out, p_res) = _both(RoundPlan(3), acceptance="forced")
    assert p_out == s_out
    for r in p_res:
        if r.num_requests:
            # forced: every verified draft accepted, so each live row is full
            assert (r.accepted == r.num_verify).all()


def test_synthetic_acceptance_one_request():
    kw = dict(acceptance="synthetic", acceptance_profile=(0.8, 0.6, 0.5, 0.3), seed=1)
    prompts = _prompts(1)
    params = [SamplingParams(max_tokens=40, ignore_eos=True)]
    s = _run(_engine(False, **kw), prompts, params, RoundPlan(W))
    p = _run(_engine(True, **kw), prompts, params, RoundPlan(W))
    assert p[0] == s[0]
    acc_s = [int(r.accepted[0]) for r in s[1] if r.num_requests]
    acc_p = [int(r.accepted[0]) for r in p[1] if r.num_requests]
    assert acc_p == acc_s and len(set(acc_s)) > 1  # the same draws, several lengths


@pytest.mark.parametrize("update", ["auto", "in_graph"])
def test_adaptive_verify_budget(update):
    budgets = iter(range(10**6))

    def plan(state):
        return RoundPlan(W, verify_budget=state.num_requests + 1 + next(budgets) % 7)

    (s_out, _), (p_out, p_res) = _both(plan, input_update=update)
    assert p_out == s_out
    nv = np.concatenate([r.num_verify for r in p_res if r.num_requests])
    assert nv.min() < W and nv.max() > 0  # the allocation trimmed and verified


def test_trimmed_verify_tokens():
    def plan(state):
        return RoundPlan(3, verify_tokens=[(state.round_index + i) % 4 for i in range(state.num_requests)])

    (s_out, _), (p_out, _) = _both(plan)
    assert p_out == s_out


def test_the_pipelined_loop_derives_its_inputs_on_the_device(monkeypatch):
    calls = []
    orig = round_mod.RoundRunner.derive_inputs

    def spy(self, x):
        calls.append(x.stage)
        return orig(self, x)

    monkeypatch.setattr(round_mod.RoundRunner, "derive_inputs", spy)
    eng = _engine(True)
    _run(eng, _prompts(2), _params(2), RoundPlan(2))
    assert calls and set(calls) == {0, 1}  # alternating staging slots
    assert all(a != b for a, b in zip(calls, calls[1:], strict=False))
    # a wrong slot state would change the outputs: the derivation is what the rounds read
    eng.reset()
    rid = eng.add_request(_prompts(1)[0], SamplingParams(max_tokens=12, ignore_eos=True))
    eng.step(RoundPlan(2))
    eng.runner.slot_len[eng.requests[rid].slot] -= 1
    while eng.has_unfinished():
        eng.step(RoundPlan(2))
    good = _run(_engine(False), _prompts(1), [SamplingParams(max_tokens=12, ignore_eos=True)],
                RoundPlan(2))[0][0]
    assert eng.requests[rid].output != good


def test_slot_and_blocks_held_while_a_queued_round_writes_them():
    prompt = _prompts(1)[0]
    free = _run(_engine(True), [prompt], _params(1), RoundPlan(2))[0][0]
    eng = _engine(True)
    eng.reset()
    # stops on the first round's first token: discovered when round 0 is collected
    rid = eng.add_request(prompt, SamplingParams(max_tokens=30, stop_token_ids=(free[1],)))
    eng.step(RoundPlan(2))  # prefill + round 0 queued
    req = eng.requests[rid]
    res = eng.step(RoundPlan(2))  # round 1 queued (req still live), round 0 collected: finished
    assert rid in res.finished and req.num_inflight == 1 and req.output == free[:2]
    assert req.slot >= 0 and req.blocks  # round 1 still writes them
    assert rid not in eng.running_ids()
    res = eng.step(RoundPlan(2))  # nothing queued; round 1 collected, its row discarded
    assert res.num_discarded == 1 and res.num_requests == 0
    assert req.slot == -1 and not req.blocks
    assert not eng.has_unfinished() and req.output == free[:2]


def test_a_foreseeable_length_stop_costs_no_extra_round():
    eng = _engine(True)
    eng.reset()
    rid = eng.add_request(_prompts(1)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step(RoundPlan(2))  # prefill (1 token) + round 0 queued: it emits >= 1, so 2 are reached
    req = eng.requests[rid]
    res = eng.step(RoundPlan(2))  # nothing queued: the request sits out; round 0 collected
    assert eng.num_inflight == 0 and rid in res.finished and len(req.output) == 2
    assert req.slot == -1 and not req.blocks and res.num_discarded == 0


def test_release_while_queued_and_drain():
    eng = _engine(True)
    eng.reset()
    a = eng.add_request(_prompts(1)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    b = eng.add_request(_prompts(2)[1], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step(RoundPlan(2))
    eng.step(RoundPlan(2))
    req = eng.requests[a]
    eng.release(a)
    assert req.num_inflight == 1 and req.blocks  # freed when its queued round is collected
    res = eng.step(RoundPlan(2))
    assert res.request_ids == [b] and res.num_discarded == 1 and not req.blocks
    assert eng.num_inflight == 1
    out = eng.drain()
    assert len(out) == 1 and out[0].request_ids == [b] and eng.num_inflight == 0


def test_pipeline_switch_is_validated():
    from speccal.base.errors import InputError

    with pytest.raises(InputError, match="pipeline"):
        EngineConfig(pipeline=1)


def test_double_buffered_host_arenas():
    x = StaticInputs({"a": (4, torch.int64), "b": (4, torch.int32)}, torch.device("cpu"),
                     num_host_slots=2)
    x.use(0)
    x.put("a", np.arange(4))
    x.flush()
    x.use(1)
    dev = x.put("a", np.arange(4) + 10)
    # staging slot 1 never touches slot 0's pinned memory (a queued copy may still read it)
    assert x._hosts[0]["a"].tolist() == [0, 1, 2, 3]
    x.flush()
    assert dev.tolist() == [10, 11, 12, 13]
    x.put("b", np.ones(4, np.int32))
    with pytest.raises(RuntimeError, match="flush"):
        x.use(0)
    with pytest.raises(ValueError):
        StaticInputs({"a": (4, torch.int64)}, torch.device("cpu"), num_host_slots=0)


def test_plain_decoding_and_sample_mode_greedy_rows():
    (s_out, _), (p_out, _) = _both(RoundPlan(0), speculative=False)
    assert p_out == s_out
    (s_out, _), (p_out, _) = _both(RoundPlan(2), acceptance="sample")
    assert p_out == s_out


@pytest.mark.parametrize("k", range(1, W + 1))
@pytest.mark.parametrize("static", [False, True])
def test_device_derivation_equals_the_host_rule(k, static, monkeypatch):
    """Every input derived on the device from the slot state (draft extend, draft steps, the
    host update's packed verify rows) equals the host rule computed from num_computed /
    num_extend (tests/runner/host_rule.py), eager (trimmed block table) and graph layouts."""
    eng = Engine(_cfg(pipeline=True))
    for p in _prompts(3, seed=5):
        eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    for i in range(5):
        eng.step(RoundPlan(1 + i % W))
    eng.drain()  # host state caught up with the device
    runner = eng.runner
    batch = list(eng._running)
    slots = [r.slot for r in batch]
    assert runner.slot_len[slots].tolist() == [r.num_computed for r in batch]
    assert runner.slot_ext[slots].tolist() == [r.num_extend for r in batch]
    assert max(r.num_extend for r in batch) > 1  # multi-row draft extends are derived
    monkeypatch.setattr(runner, "static", static)
    bcap = 4
    nv = np.array([k, max(k - 1, 0), min(1, k)])
    g = int((nv + 1).sum()) + 2  # two padding rows past the packed ones
    x = runner.prepare(batch, bcap, k, nv, g, None, np.array([r.num_computed for r in batch]))
    runner.derive_inputs(x)
    runner.derive_verify(x)
    want = host_inputs(runner, batch, bcap, k, nv, g, x.host.block_table.numpy())
    assert x.num_ext_rows == W + 1 and x.update == "host"
    assert {"ext.index", "ext.row", "ver.slot", "req.ctx_lens"} <= want.keys()
    assert ("step.slot" in want) == (k > 1)
    for name, v in want.items():
        group, field = name.split(".")
        got = getattr(getattr(x, group), field)
        assert tuple(got.shape) == v.shape, name
        np.testing.assert_array_equal(got.numpy(), v, err_msg=name)


# ------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("graph_mode", ["eager", "split"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pipelined_equals_synchronous_cuda(graph_mode, backend):
    """On the GPU the pipelined loop overlaps for real (derivation captured at the head of the
    draft graph, slot advance at the tail of the target graph): same tokens as the synchronous
    loop, fixed k, trimmed verify and an adaptive budget."""
    kw = dict(device="cuda", dtype="float32", attention_backend=backend, graph_mode=graph_mode)
    for plan in (RoundPlan(1), RoundPlan(W),
                 lambda s: RoundPlan(W, verify_budget=s.num_requests + 1 + s.round_index % 7)):
        (s_out, _), (p_out, p_res) = _both(plan, **kw)
        assert p_out == s_out
        assert p_res[0].round_index == -1


def test_a_pipelined_round_stages_its_host_facts_in_one_copy():
    eng = Engine(_cfg(pipeline=True, input_update="in_graph"))
    for p in _prompts(3):
        eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step(RoundPlan(2))
    before = eng.runner.inputs.copies
    for _ in range(4):
        eng.step(RoundPlan(2, verify_tokens=[2, 1, 0]))
    assert eng.runner.inputs.copies - before == 4


def test_sampled_requests_and_eos_run_to_completion():
    """Non-greedy rows (rejection sampling) and EOS stops: no equality to expect (random draws
    follow the batch), but every request ends by its rules and every block is freed."""
    eng = _engine(True, acceptance="sample", seed=2)
    params = [SamplingParams(max_tokens=m, temperature=t, top_k=50)
              for m, t in zip(MAX_TOKENS[:6], (0.0, 0.8, 1.0, 0.0, 0.7, 1.2), strict=True)]
    outs, res = _run(eng, _prompts(6), params, RoundPlan(3), arrive_every=2)
    for o, sp in zip(outs, params, strict=True):
        eos = set(eng.loaded.config.eos_token_ids)
        assert len(o) == sp.max_tokens or (o and o[-1] in eos)
        assert not eos & set(o[:-1])


@pytest.mark.cuda
@pytest.mark.parametrize("graph_mode", ["eager", "split"])
def test_queueing_a_pipelined_round_never_syncs_cuda(graph_mode, monkeypatch):
    """Host preparation and launch of a pipelined round (in-graph update, fixed k and an
    adaptive budget) run under ``torch.cuda.set_sync_debug_mode("error")``: no ``.item()``, no
    blocking copy, no stream sync; the host waits only in ``collect`` (an event)."""
    eng = Engine(_cfg(pipeline=True, device="cuda", dtype="float32", attention_backend="triton",
                      graph_mode=graph_mode, input_update="in_graph"))
    for p in _prompts(3):
        eng.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True))
    eng.step(RoundPlan(2))
    eng.step(RoundPlan(2))
    runner = eng.runner

    def guarded(fn):
        def call(*a, **kw):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        return call

    monkeypatch.setattr(runner, "prepare", guarded(runner.prepare))
    monkeypatch.setattr(runner, "execute", guarded(runner.execute))
    for i in range(6):
        eng.step(RoundPlan(1 + i % W))
        eng.step(lambda s: RoundPlan(W, verify_budget=s.num_requests + 2))
    assert eng.num_inflight == 1
