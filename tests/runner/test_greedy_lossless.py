"""Greedy speculative decoding equals plain greedy decoding token for token (CPU, float32).

Tiny preset (random weights whose MTP head agrees with the target ~40% of the time, so rounds
see every accepted length), block size 4 (requests cross many block boundaries) and prefill
chunks of 5 tokens (prompts of 3..23 tokens span up to 5 chunks).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from speccal.live.generate import generate
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams

W = 5
MAX_TOKENS = 28
PROMPT_LENS = (3, 23, 9, 14)


def _config(**kw) -> EngineConfig:
    base = dict(
        model="tiny",
        draft_width=W,
        request_buckets=(1, 2, 4),
        block_size=4,
        prefill_chunk=5,
        max_model_len=256,
    )
    base.update(kw)
    return EngineConfig(**base)


def _prompts(batch: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 512, n).tolist() for n in PROMPT_LENS[:batch]]


@functools.cache
def _plain(batch: int) -> tuple[tuple[int, ...], ...]:
    eng = Engine(_config(speculative=False))
    outs = generate(eng, _prompts(batch), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), 0)
    return tuple(tuple(o) for o in outs)


@functools.cache
def _spec_engine() -> Engine:
    return Engine(_config())


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_speculative_greedy_equals_plain_greedy(k, batch):
    eng = _spec_engine()
    eng.reset()
    outs = generate(eng, _prompts(batch), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), k)
    assert tuple(tuple(o) for o in outs) == _plain(batch)
    # the comparison is only meaningful if drafts were accepted *and* rejected
    hist = eng.stats.hist
    assert eng.stats.num_accepted > 0 and hist[0] > 0, hist
    if k >= 2:
        assert hist[1:k].sum() > 0, hist  # partial acceptance happened


def test_plain_output_is_not_degenerate():
    outs = _plain(4)
    assert all(len(set(o)) > 8 for o in outs)  # not one repeated token
    assert len({o for o in outs}) == 4


def test_trimmed_verify_is_still_lossless():
    eng = _spec_engine()
    eng.reset()
    prompts = _prompts(4)
    rids = [
        eng.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in prompts
    ]
    rng = np.random.default_rng(0)
    seen_g = set()
    while eng.has_unfinished():
        eng.prefill_pending()
        n = len(eng.running_ids())
        res = eng.step(RoundPlan(4, verify_tokens=rng.integers(0, 5, n).tolist()))
        seen_g.add(res.g)
        assert (res.accepted <= res.num_verify).all()
    outs = tuple(tuple(eng.requests[r].output) for r in rids)
    assert outs == _plain(4)
    assert len(seen_g) > 1  # trimmed budgets pick different target buckets


def test_stop_token_inside_accepted_prefix():
    """A stop id emitted mid-round (inside the accepted drafts) ends the request exactly there."""
    plain = _plain(1)[0]
    eng = _spec_engine()
    eng.reset()
    prompt = _prompts(1)[0]
    rid = eng.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    chunks = []
    while eng.has_unfinished():
        res = eng.step(RoundPlan(W))
        chunks += [e for r, e in zip(res.request_ids, res.emitted, strict=False) if r == rid]
    eng.release(rid)
    # a token that first occurs strictly inside a multi-token round, not at its end
    out, stop = [], None
    for chunk in chunks:
        for j, t in enumerate(chunk):
            if stop is None and j < len(chunk) - 1 and t not in out and len(out) > 0:
                stop = t
            out.append(t)
    assert stop is not None
    cut = plain.index(stop) + 1
    rid = eng.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,)))
    dropped = 0
    while eng.has_unfinished():
        res = eng.step(RoundPlan(W))
        for r, e, a in zip(res.request_ids, res.emitted, res.accepted, strict=False):
            if r == rid and r in res.finished:
                dropped = int(a) + 1 - len(e) + (1 if res.first_tokens.get(rid) is not None else 0)
    req = eng.requests[rid]
    assert tuple(req.output) == plain[:cut]
    assert req.finish_reason == "stop"
    assert dropped > 0  # the round produced tokens after the stop id, and they were dropped
    eng.release(rid)
    assert eng.num_free_kv_tokens == eng.geometry.kv_capacity_tokens  # blocks returned


def test_max_tokens_and_eos():
    plain = _plain(1)[0]
    eng = _spec_engine()
    eng.reset()
    outs = generate(eng, _prompts(1), SamplingParams(max_tokens=7, ignore_eos=True), 5)
    assert tuple(outs[0]) == plain[:7]
    eos = plain[12]
    eng2 = Engine(_config())
    object.__setattr__(eng2.loaded.config, "eos_token_ids", (eos,))
    out = generate(eng2, _prompts(1), SamplingParams(max_tokens=MAX_TOKENS), 3)[0]
    assert tuple(out) == plain[: plain.index(eos) + 1]
    out = generate(eng2, _prompts(1), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), 3)[0]
    assert tuple(out) == plain
