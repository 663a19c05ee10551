"""bench/bench_kv_spread.py on the CPU: its KV layouts keep the mean they are compared at, and
its fill puts each request at the KV length asked for."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
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


def test_table_prices_the_measured_layouts(spread, tmp_path):
    """bench/kv_spread_vs_table.py: every measured layout priced by the table (its mean-KV cost
    plus the spread term at its longest request); the uniform layout gets no spread term, a
    table without spread points none anywhere."""
    sys.path.insert(0, str(BENCH))
    try:
        vs = importlib.import_module("kv_spread_vs_table")
    finally:
        sys.path.remove(str(BENCH))
    from speccal.costmodel.table import load_table
    from speccal.policy import CostModel

    table = Path(__file__).resolve().parents[1] / "costmodel" / "fixtures" / "table_v6_additive.json"
    measured = {"points": [{"batch": 2, "k": 1, "mean_kv": 1500,
                            "ms": {"uniform": 5.0, "two_level": 5.5, "one_long": 6.0}}]}
    rows = vs.compare(measured, table)
    assert [r["layout"] for r in rows] == ["uniform", "two_level", "one_long"]
    by = {r["layout"]: r for r in rows}
    assert by["uniform"]["spread_term_ms"] == 0.0
    assert by["two_level"]["spread_term_ms"] > 0.0
    cost = CostModel.from_table(load_table(table))
    r = by["two_level"]
    base = float(cost.lookup(np.array([2]), np.array([4]), np.array([r["mean_kv"]]), 1)[0])
    assert r["table_ms"] == pytest.approx(base + r["spread_term_ms"])
    assert r["error_pct"] == pytest.approx(100.0 * (r["table_ms"] - 5.5) / 5.5)
    plain = tmp_path / "plain.json"
    doc = json.loads(table.read_text())
    del doc["kv_spread"]
    plain.write_text(json.dumps(doc))
    assert all(r["spread_term_ms"] == 0.0 for r in vs.compare(measured, plain))
