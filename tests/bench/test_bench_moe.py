"""bench/bench_moe.py's floor on the CPU: the bytes a routed-MoE step reads, counted from the
experts the step activated (``moe-tiny``: MLA, 16 routed experts top-4 + 2 shared, layer 0
dense, one routed MTP layer)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.moe import routed_modules

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_moe():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bench_moe")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig.flat(model="moe-tiny", device="cpu", draft_width=2,
                                    request_buckets=(1, 2), max_model_len=64))


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_step_bytes_counts_only_the_activated_experts(bench_moe, engine):
    t = engine.loaded.target
    layers = routed_modules(t)
    num_experts = len(layers[0].experts)
    per_expert = _bytes(layers[0].experts[0].parameters())
    emb = t.model.embed_tokens.weight
    every = _bytes(p for p in t.parameters() if p.dim() >= 2 and p is not emb)
    full = bench_moe.step_bytes(engine, [num_experts] * len(layers), 0)
    assert full["weights"] == every and full["kv"] == 0
    none = bench_moe.step_bytes(engine, [0] * len(layers), 0)
    assert none["routed"] == 0
    assert full["weights"] - none["weights"] == per_expert * num_experts * len(layers)
    two = bench_moe.step_bytes(engine, [2] + [0] * (len(layers) - 1), 0)
    assert two["routed"] == 2 * per_expert
    # the KV the step attends: every target layer's cached bytes per token x tokens
    c = engine.loaded.config
    per_token = sum(k[0, 0].numel() * k.element_size() + v[0, 0].numel() * v.element_size()
                    for k, v in engine.kv.layers[: c.num_hidden_layers])
    assert bench_moe.step_bytes(engine, [0] * len(layers), 10)["kv"] == 10 * per_token
    with pytest.raises(ValueError, match="routed layers"):
        bench_moe.step_bytes(engine, [1], 0)
    with pytest.raises(ValueError, match="experts of a layer"):
        bench_moe.step_bytes(engine, [num_experts + 1] * len(layers), 0)


def test_a_plain_round_activates_at_most_top_k_experts_per_row(bench_moe):
    """What the bench feeds step_bytes: one B = 1 decode round activates between 1 and top-k
    experts in each routed target layer (the engine's per-layer counts)."""
    engine = Engine(EngineConfig.flat(model="moe-tiny", device="cpu", speculative=False,
                                      request_buckets=(1,), max_model_len=64))
    rid = engine.add_request([5, 6, 7, 8])
    engine.prefill_pending()
    engine.take_activated_experts()
    engine.step(RoundPlan(num_draft_steps=0))
    engine.synchronize()
    counts = engine.take_activated_experts()["target"]
    top_k = routed_modules(engine.loaded.target)[0].moe.top_k
    assert counts and all(1 <= n <= top_k for n in counts)
    got = bench_moe.step_bytes(engine, counts, 5)
    assert 0 < got["routed"] < got["weights"] < got["total"]
    engine.release(rid)


def test_best_tiles_reads_the_one_row_best_and_names_a_bad_file(bench_moe, tmp_path):
    from speccal.kernels.config import DEFAULT_TILES, ExpertTiles

    want = ExpertTiles(gate_up_n=32, down_k=64, num_stages=4)
    row = {"tiles": want.label(), "gate_up_n": 32, "gate_up_k": 64, "down_n": 32, "down_k": 64,
           "num_warps": 4, "num_stages": 4, "ms": 0.05, "equal_to_default": True}
    doc = {"by_rows": {"1": {"best": row, "default": {**row, "tiles": DEFAULT_TILES.label()}},
                       "8": {"best": None}}}
    path = tmp_path / "moe_tiles.json"
    path.write_text(json.dumps(doc))
    got = bench_moe.best_tiles(str(path))
    assert got == want and got.label() == "gu32x64-d32x64-w4-s4"
    doc["by_rows"]["1"]["best"] = None
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="no one-row configuration"):
        bench_moe.best_tiles(str(path))
    with pytest.raises(ValueError, match="moe_tiles.json with a one-row best"):
        bench_moe.best_tiles(str(tmp_path / "missing.json"))


def test_a_run_under_other_kernels_records_its_metrics_apart(bench_moe, monkeypatch):
    """``SPECCAL_PDL=0`` (or any non-default kernel config) must not land under the headline
    metric names: its lines get ``.kernels_env`` and the config; the default keeps the names."""
    import argparse

    from speccal.kernels.config import KernelConfig

    got = []
    monkeypatch.setattr(bench_moe, "append_results", lambda lines: got.extend(lines))
    res = {"device_name": "gpu", "copy_bandwidth_gbs": 3000.0,
           "decode_b1": {"ms": 3.4, "floor_ms": 1.6}, "verify_b1": {"ms": 5.4},
           "moe_decode_step_floor_ratio": 2.125, "moe_verify_full_width_ratio": 1.588}
    for env, suffix in (({}, ""), ({"SPECCAL_PDL": "0"}, ".kernels_env")):
        got.clear()
        args = argparse.Namespace(model="moe-16b-a3b", repeats=7, draft_width=3, tiles=None,
                                  kernels=KernelConfig.from_env(env))
        bench_moe.record(res, args)
        assert sorted(line["metric"] for line in got) == [
            "moe_decode_step_floor_ratio" + suffix, "moe_verify_full_width_ratio" + suffix]
        assert all(("kernels" in line) == bool(suffix) for line in got)
    assert got[0]["kernels"]["pdl"]["mode"] == "off"
