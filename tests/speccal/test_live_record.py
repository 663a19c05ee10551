"""``speccal.live.record``: the runner's trace recorder (``speccal trace``) on the tiny preset."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from speccal.base.errors import InputError
from speccal.live.record import TraceRecording, record_trace


class _Prog:
    def __init__(self, log, phase):
        self.log, self.phase = log, phase

    def update(self, advance=1):
        self.log[self.phase] = self.log.get(self.phase, 0) + advance


def _progress(log):
    @contextlib.contextmanager
    def make(phase, unit, total):
        yield _Prog(log, phase)
    return make


def _rec(**kw) -> TraceRecording:
    base = dict(kind="rounds", model="tiny", device="cpu", dtype=None, draft_width=3,
                num_requests=3, prompt_len=6, max_tokens=7, acceptance="greedy",
                acceptance_profile=None, seed=0)
    return TraceRecording(**{**base, **kw})


def test_a_round_trace_records_the_kv_each_plan_saw():
    log: dict = {}
    tr, extra = record_trace(_rec(), _progress(log))
    assert extra is None and tr.num_rounds == log["recording rounds"] > 0
    assert tr.plan_kv_length is not None and tr.plan_kv_length.shape == (tr.num_rounds,)
    # the plan sees the KV before its round: below the KV the round ends with
    assert (tr.plan_kv_length < tr.kv_length).all()
    assert tr.meta["source"] == "runner" and tr.meta["compatibility"]["draft_width"] == 3


def test_a_token_trace_drafts_from_every_position():
    log: dict = {}
    tr, rounds = record_trace(_rec(kind="tokens", max_tokens=5), _progress(log))
    assert rounds is not None and rounds.plan_kv_length is not None
    # 3 requests x (5 outputs - 1) positions a round can start from
    assert tr.request.size == 12 == log["drafting from every position"]
    assert np.unique(tr.request).tolist() == [0, 1, 2]


def test_a_token_trace_needs_greedy_acceptance():
    with pytest.raises(InputError, match="greedy for --kind tokens"):
        _rec(kind="tokens", acceptance="synthetic")
