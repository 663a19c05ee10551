"""Nothing the round module runs inside a captured region allocates a tensor.

What a draft graph and a target graph capture (``RoundRunner._draft_graph`` /
``_target_graph``: derivation, draft part, verify input update, target, acceptance, slot
advance) views static buffers sized at the largest bucket. Here every tensor factory
(``torch.empty`` / ``zeros`` / ``arange`` / ``full`` / ``*_like`` / ``Tensor.new_*``) called
from ``speccal.runner.round`` or ``speccal.runner.hybrid_state`` (a hybrid target's state rows)
while one of them runs is recorded, over eager CPU rounds of both
input-update paths (the in-graph one on the reference kernels), plain and speculative, greedy
and sampled, fixed verify lengths and a device allocation. Elementwise temporaries of the ops
themselves come from the graph's pool and are not factories.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from speccal.runner import hybrid_state
from speccal.runner import round as round_mod
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams
from tests.runner.test_hybrid_engine import write_checkpoint

W = 3
FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "empty_like", "zeros_like",
             "ones_like", "full_like")
METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
WATCHED = (round_mod.__name__, hybrid_state.__name__)


class Recorder:
    """Records factory calls made from the round module while a captured part runs."""

    def __init__(self, monkeypatch, runner):
        self.inside = 0
        self.calls: list[str] = []
        for name in FACTORIES:
            monkeypatch.setattr(torch, name, self._wrap(getattr(torch, name), f"torch.{name}"))
        for name in METHODS:
            monkeypatch.setattr(torch.Tensor, name,
                                self._wrap(getattr(torch.Tensor, name), f"Tensor.{name}"))
        for part in ("_draft_graph", "_target_graph"):
            monkeypatch.setattr(runner, part, self._region(getattr(runner, part)))

    def _wrap(self, fn, label):
        def call(*a, **kw):
            caller = sys._getframe(1)
            if self.inside and caller.f_globals.get("__name__") in WATCHED:
                self.calls.append(f"{label} at line {caller.f_lineno}")
            return fn(*a, **kw)
        return call

    def _region(self, fn):
        def run(*a, **kw):
            self.inside += 1
            try:
                return fn(*a, **kw)
            finally:
                self.inside -= 1
        return run


def _engine(**kw) -> Engine:
    return Engine(EngineConfig.flat(**{**dict(model="tiny", draft_width=W,
                                              request_buckets=(1, 2, 4), block_size=4,
                                              prefill_chunk=8, max_model_len=96), **kw}))


def _drive(eng: Engine, plans, params) -> None:
    rng = np.random.default_rng(3)
    for prm in params:
        eng.add_request(rng.integers(0, eng.vocab_size, int(rng.integers(4, 15))).tolist(), prm)
    for plan in plans:
        eng.step(plan)
    eng.drain()


@pytest.mark.parametrize("update", ["host", "in_graph"])
@pytest.mark.parametrize("acceptance", ["greedy", "sample"])
def test_captured_parts_allocate_nothing(update, acceptance, monkeypatch):
    eng = _engine(input_update=update, acceptance=acceptance, pipeline=True)
    rec = Recorder(monkeypatch, eng.runner)
    temps = (0.0, 0.9, 0.0) if acceptance == "sample" else (0.0, 0.0, 0.0)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=t) for t in temps]
    plans = [RoundPlan(1), RoundPlan(W), RoundPlan(2, verify_tokens=[2, 0, 1]),
             lambda s: RoundPlan(W, verify_budget=s.num_requests + 2), RoundPlan(W)]
    _drive(eng, plans, params)
    assert rec.calls == []
    plain = _engine(input_update=update, acceptance=acceptance, speculative=False)
    rec = Recorder(monkeypatch, plain.runner)
    _drive(plain, [RoundPlan(0)] * 4, params)
    assert rec.calls == []


@pytest.mark.parametrize("strategy", ["scratch_swap", "snapshots"])
@pytest.mark.parametrize("update", ["host", "in_graph"])
def test_hybrid_state_rows_allocate_nothing(strategy, update, tmp_path, monkeypatch):
    """A hybrid target's verify forward reads its state rows through views of static buffers
    (the in-graph update's grid rows included) and commits them in place."""
    write_checkpoint(tmp_path, "qwen3_5")
    eng = Engine(EngineConfig.flat(model=str(tmp_path), draft_width=W, request_buckets=(1, 2, 4),
                                   max_model_len=64, block_size=4, prefill_chunk=8,
                                   acceptance="greedy", state_strategy=strategy,
                                   input_update=update, pipeline=True))
    rec = Recorder(monkeypatch, eng.runner)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 3
    _drive(eng, [RoundPlan(W), RoundPlan(2, verify_tokens=[2, 0, 1]), RoundPlan(W)], params)
    assert rec.calls == []


def test_the_check_sees_an_allocation(monkeypatch):
    """The recorder is not blind: a factory called from the round module inside a captured
    part is reported."""
    eng = _engine()
    rec = Recorder(monkeypatch, eng.runner)
    scope = dict(vars(round_mod))
    exec("def scratch(x):\n    return torch.empty(4)\n", scope)
    scratch = scope["scratch"]
    assert scratch.__globals__["__name__"] == round_mod.__name__
    derive = eng.runner.derive_inputs

    def derive_and_allocate(x):
        scratch(x)
        derive(x)

    monkeypatch.setattr(eng.runner, "derive_inputs", derive_and_allocate)
    _drive(eng, [RoundPlan(2)] * 2, [SamplingParams(max_tokens=8, ignore_eos=True)])
    assert rec.calls and rec.calls[0].startswith("torch.empty")
