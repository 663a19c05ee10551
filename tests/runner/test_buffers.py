"""StaticInputs: one arena per side, staged puts, merged copies that never cross device data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speccal.runner.buffers import StaticInputs
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams

SIZES = {
    "a": (5, torch.int64),
    "b": (3, torch.int32),
    "dev": (4, torch.int64),
    "c": (6, torch.int64),
}


def _inputs() -> StaticInputs:
    return StaticInputs(SIZES, torch.device("cpu"), device_written=frozenset({"dev"}))


def test_put_reaches_the_device_only_at_flush():
    s = _inputs()
    view = s.put("a", np.arange(4).reshape(2, 2))
    assert view.shape == (2, 2) and view.dtype == torch.int64
    assert view.sum().item() == 0  # staged on the host only
    s.flush()
    assert view.tolist() == [[0, 1], [2, 3]]
    assert s.copies == 1
    s.flush()  # nothing new: no copy
    assert s.copies == 1


def test_adjacent_puts_merge_into_one_copy():
    s = _inputs()
    s.put("a", np.arange(2))  # a prefix: the copy runs over a's stale tail into b
    s.put("b", np.array([7, 8, 9], dtype=np.int32))
    assert len(s.runs()) == 1
    s.flush()
    assert s.dev["a"][:2].tolist() == [0, 1] and s.dev["b"].tolist() == [7, 8, 9]


def test_a_copy_never_spans_device_written_data():
    s = _inputs()
    s.dev["dev"].copy_(torch.tensor([4, 3, 2, 1]))  # written by "device code"
    s.put("b", np.array([1, 2, 3], dtype=np.int32))
    s.put("c", np.arange(6))
    assert len(s.runs()) == 2  # split around "dev"
    s.flush()
    assert s.dev["dev"].tolist() == [4, 3, 2, 1]
    assert s.dev["c"].tolist() == list(range(6))
    s.put("b", np.array([0, 0, 0], dtype=np.int32))
    s.put("dev", np.arange(4))  # put this round: the run may cover it
    s.put("c", np.arange(6))
    assert len(s.runs()) == 1
    s.flush()
    assert s.dev["dev"].tolist() == [0, 1, 2, 3]


def test_an_empty_put_copies_nothing():
    s = _inputs()
    assert s.put("a", np.zeros(0, dtype=np.int64)).shape == (0,)
    s.flush()
    assert s.copies == 0


def test_views_are_aligned_and_stable():
    s = _inputs()
    ptrs = {n: s.dev[n].data_ptr() for n in SIZES}
    assert all(p % 64 == ptrs["a"] % 64 for p in ptrs.values())
    s.put("c", np.arange(6))
    s.flush()
    assert {n: s.dev[n].data_ptr() for n in SIZES} == ptrs


def test_unknown_device_written_name_is_refused():
    with pytest.raises(ValueError, match="unknown input names"):
        StaticInputs(SIZES, torch.device("cpu"), device_written=frozenset({"nope"}))


def test_a_round_stages_its_inputs_in_few_copies():
    eng = Engine(EngineConfig(model="tiny", draft_width=3, request_buckets=(2,)))
    for p in ([1, 2, 3, 4], [5, 6, 7]):
        eng.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True))
    eng.prefill_pending()
    inputs = eng.runner.inputs
    for k in (1, 2, 3):
        before = inputs.copies
        eng.step(RoundPlan(num_draft_steps=k))
        # ~20 names in one copy, plus the host update's drafts after its sync (CPU: host path)
        assert eng.runner.resolve_update(2, k, 2 * (k + 1)) == "host"
        assert inputs.copies - before == 2, k
    plain = Engine(EngineConfig(model="tiny", speculative=False, request_buckets=(2,)))
    plain.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    plain.prefill_pending()
    before = plain.runner.inputs.copies
    plain.step(RoundPlan(num_draft_steps=0))
    assert plain.runner.inputs.copies - before == 1  # ext_* / step_* not staged, copied over
