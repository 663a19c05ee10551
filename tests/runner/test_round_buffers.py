"""The named round buffers: one arena entry per field, views sized inside the capacity at the
largest bucket, the same views every round of a bucket, and keyword-only round types."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from speccal.runner import buffers
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.results import RoundResult, RoundState
from speccal.runner.round import RoundInputs, RoundOutputs
from speccal.runner.sampling import SamplingParams

W, BUCKETS = 3, (1, 2, 4)


def test_every_field_has_one_arena_entry_and_fits_at_the_largest_bucket():
    layout = buffers.round_layout(max_bucket=4, draft_width=W, max_blocks_per_seq=5)
    names = [f"{g}.{f.name}" for g, cls in buffers.ROUND_GROUPS.items()
             for f in dataclasses.fields(cls)]
    assert sorted(names) == sorted(layout)
    # the host facts lead the arena (one merged copy), the host-only ones among them
    assert list(layout)[:5] == [n for n in names if n.startswith("host.")]
    assert buffers.HOST_ONLY < set(layout)
    for g in (1, 4 * (W + 1)):
        shapes = buffers.derived_shapes(bcap=4, draft_width=W, k=W, g=g)
        assert set(shapes) == set(buffers.ROUND_GROUPS) - {"host"}
        for group, fields in shapes.items():
            assert set(fields) == {f.name for f in dataclasses.fields(buffers.ROUND_GROUPS[group])}
            for name, shape in fields.items():
                assert math.prod(shape) <= layout[f"{group}.{name}"][0], (group, name, shape)


@pytest.mark.parametrize("cls", [*buffers.ROUND_GROUPS.values(), RoundInputs, RoundOutputs,
                                 RoundResult, RoundState])
def test_round_types_are_keyword_only(cls):
    params = dataclasses.fields(cls)
    assert params and all(f.kw_only for f in params), cls.__name__
    with pytest.raises(TypeError):
        cls(*([None] * len(params)))


def test_buffer_groups_are_frozen():
    t = torch.zeros(1)
    rows = buffers.StepRows(pos=t, slot=t, seq=t)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rows.pos = torch.ones(1)


def test_a_bucket_reads_the_same_views_every_round():
    """Captured graphs read fixed addresses: two rounds of one bucket get the same group
    objects (views of the one arena), whichever staging slot they were prepared into."""
    eng = Engine(EngineConfig.flat(model="tiny", draft_width=W, request_buckets=BUCKETS,
                                   block_size=4, prefill_chunk=8, max_model_len=96))
    rng = np.random.default_rng(0)
    for _ in range(2):
        eng.add_request(rng.integers(0, eng.vocab_size, 6).tolist(),
                        SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step(RoundPlan(W))
    eng.drain()
    batch, runner = list(eng._running), eng.runner
    nv = np.full(len(batch), W)
    x1 = runner.prepare(batch, 2, W, nv, 8)
    x2 = runner.prepare(batch, 2, W, nv, 8)
    assert x1.stage != x2.stage
    for group in ("req", "ext", "step", "ver"):
        assert getattr(x1, group) is getattr(x2, group)
    arena = runner.inputs.dev
    for f in dataclasses.fields(buffers.HostFacts):
        a, b = getattr(x1.host, f.name), getattr(x2.host, f.name)
        assert a.data_ptr() == b.data_ptr() == arena[f"host.{f.name}"].data_ptr()
    assert x1.step.pos.shape == (W - 1, 2) and x1.ver.drafts.shape == (2, W)
