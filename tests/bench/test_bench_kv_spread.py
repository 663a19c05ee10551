"""bench/bench_kv_spread.py on the CPU: its KV layouts keep the mean they are compared at, and
its fill puts each request at the KV length asked for."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from speccal.runner.engine import Engine, EngineConfig

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def spread():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bench_kv_spread")
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("batch,mean", [(8, 900), (32, 350), (5, 120), (2, 64)])
def test_layouts_share_the_mean_within_rounding(spread, batch, mean):
    ways = spread.layouts(batch, mean, 4096)
    assert set(ways) == {"uniform", "two_level", "one_long"}
    for name, lengths in ways.items():
        assert len(lengths) == batch and min(lengths) >= 16 and max(lengths) <= 4096, name
        assert abs(sum(lengths) / batch - mean) <= 1.0 + mean / batch, (name, lengths)
    assert ways["two_level"][0] < mean < ways["two_level"][-1]
    assert spread.layouts(1, 100, 4096) == {"uniform": [100]}


def test_fill_puts_each_request_at_its_length(spread):
    eng = Engine(EngineConfig.flat(model="tiny", device="cpu", dtype="float32",
                                   max_model_len=400, block_size=16, request_buckets=(4,),
                                   draft_width=2, acceptance="forced", target_rows={4: (8, 12)},
                                   kv_capacity_tokens=4 * 400))
    lengths = [20, 300, 64, 150]
    spread.fill(eng, lengths, 1)
    # the prompt's KV plus the first round's accepted tokens (forced acceptance: k + 1)
    assert eng.kv_lengths().tolist() == [n + 1 for n in lengths]
