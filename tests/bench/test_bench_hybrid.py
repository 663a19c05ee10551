"""bench/bench_hybrid.py on the CPU (fp32, eager): the small random Qwen3.5 checkpoint (with an
``mtp.*`` head) of ``tests/runner/test_hybrid_engine.py``, every stage run with reduced sizes,
and the JSON's figures checked for finiteness and against the state strategies' accounting
(``speccal.runner.hybrid_state``): scratch-swap moves two state rows each way per request at
every k plus the saved replay inputs, snapshots read one row and write ``k + 1``, so snapshots
write more state-row bytes than scratch-swap from k = 2 on and fewer in total at k = 1 when the
saved inputs are counted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the random Qwen3.5 checkpoint of the hybrid engine tests (skips without transformers >= 5)
from tests.runner.test_hybrid_engine import SHAPES, write_checkpoint

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_hybrid.py"
W = 3
BATCH = 2
PROMPTS = 2
LARGE = 2  # the second decode batch (8 on the GPU)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_hybrid")
    folder = root / "ckpt"
    write_checkpoint(folder, "qwen3_5")
    out = root / "out"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--model", str(folder), "--out",
           str(out), "--kv", "24", "--repeats", "3", "--draft-width", str(W), "--round-batch",
           str(BATCH), "--round-prompt", "12", "--rounds", "2", "--round-warmup", "1",
           "--check-prompts", str(PROMPTS), "--check-tokens", "8", "--hf-steps", "3",
           "--large-batch", str(LARGE)]
    # one intra-op thread: on a shared 2-core host two threads per op run this tiny model's
    # small ops several times slower (6 s vs 36 s for the whole run here)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "hybrid.json").read_text()), proc.stdout


def _finite_numbers(obj, where="") -> list[str]:
    """Paths of every non-finite number in a JSON value."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _finite_numbers(v, f"{where}.{k}")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _finite_numbers(v, f"{where}[{i}]")]
    if isinstance(obj, float) and not math.isfinite(obj):
        return [where]
    return []


def test_every_figure_is_present_finite_and_positive(report):
    res, stdout = report
    assert res["device"] == "cpu" and res["versions"]["torch"] == torch.__version__
    assert {"triton", "fla", "transformers"} <= set(res["versions"])
    assert not _finite_numbers(res)
    assert not res["skipped"]
    for key in ("copy_bandwidth_gbs", "decode_step_ms_b1", "decode_floor_ms", "ours_tok_s_b1",
                "hf_tok_s_b1", "hybrid_decode_step_floor_ratio",
                "hybrid_decode_speedup_vs_hf_b1"):
        assert res[key] > 0, key
    assert res["hybrid_decode_speedup_vs_hf_b1"] == pytest.approx(
        res["ours_tok_s_b1"] / res["hf_tok_s_b1"])
    assert res["hf_config_b1"] in ("static cache, no compile", "dynamic cache, no compile")
    assert res["hf_compile_status"].startswith("not tried")
    assert "hybrid_decode_step_floor_ratio" in stdout  # the printed summary


def test_the_large_batch_has_its_floor_step_and_peer(report):
    """B = LARGE: the floor moves each request's state row and KV once and the weights once;
    the step, our tokens/s and the transformers peer at that batch are recorded."""
    res, stdout = report
    b = LARGE
    big = res[f"floor_bytes_b{b}"]
    assert big["weight_bytes"] == res["weight_bytes"]
    assert big["state_bytes"] == b * res["state_bytes"]
    assert big["kv_bytes"] == b * res["kv_bytes"]
    assert res[f"decode_floor_ms_b{b}"] == pytest.approx(
        sum(big.values()) / (res["copy_bandwidth_gbs"] * 1e9) * 1e3)
    assert res[f"hybrid_decode_step_floor_ratio_b{b}"] == pytest.approx(
        res[f"decode_step_ms_b{b}"] / res[f"decode_floor_ms_b{b}"])
    assert res[f"hybrid_decode_speedup_vs_hf_b{b}"] == pytest.approx(
        res[f"ours_tok_s_b{b}"] / res[f"hf_tok_s_b{b}"])
    assert res[f"hf_config_b{b}"] in ("static cache, no compile", "dynamic cache, no compile")
    assert f"hybrid_decode_step_floor_ratio_b{b}" in stdout


def test_floor_is_weights_state_and_kv_over_the_copy_bandwidth(report):
    res, _ = report
    h, v, kvh, d = (SHAPES[k] for k in ("hidden_size", "vocab_size", "num_key_value_heads",
                                        "head_dim"))
    assert res["weight_bytes"] > h * v * 4  # at least the LM head, fp32
    # 3 delta-net layers: conv state (conv_dim x 3) and delta-rule state, fp32, read + written
    conv_dim = 2 * 2 * 8 + 4 * 12
    assert res["state_bytes"] == 2 * 3 * (conv_dim * 3 * 4 + 4 * 8 * 12 * 4)
    assert res["kv_bytes"] == 1 * 2 * 24 * kvh * d * 4  # one attention layer, KV 24
    total = res["weight_bytes"] + res["state_bytes"] + res["kv_bytes"]
    assert res["decode_floor_ms"] == pytest.approx(total / (res["copy_bandwidth_gbs"] * 1e9) * 1e3)
    assert res["hybrid_decode_step_floor_ratio"] == pytest.approx(
        res["decode_step_ms_b1"] / res["decode_floor_ms"])


def test_both_strategies_at_every_k_with_the_bytes_their_mechanisms_move(report):
    res, _ = report
    table = res["hybrid_state_strategy_round_ms"]
    assert set(table) == {"scratch_swap", "snapshots"}
    for per_k in table.values():
        assert set(per_k) == {f"k{k}" for k in range(1, W + 1)}
        assert all(ms > 0 for ms in per_k.values())
    rows = res["strategy_rounds"]
    assert res["hybrid_state_bytes_per_round"] == {
        name: {kk: r["state_bytes"]["total"] for kk, r in per_k.items()}
        for name, per_k in rows.items()}
    s = res["state_bytes"] // 2 * BATCH  # one state row per request of the bucket
    for k in range(1, W + 1):
        swap, snap = rows["scratch_swap"][f"k{k}"]["state_bytes"], rows["snapshots"][f"k{k}"][
            "state_bytes"]
        assert swap["read"] == swap["written"] == 2 * s and swap["saved_inputs"] > 0
        assert snap["read"] == s and snap["written"] == (k + 1) * s and snap["saved_inputs"] == 0
        for t in (swap, snap):
            assert t["total"] == t["read"] + t["written"] + t["index_bytes"] + t["saved_inputs"]
        if k >= 2:  # a snapshot row per verified position against one scratch row
            assert snap["written"] > swap["written"]
        if k == 1:
            assert snap["total"] < swap["total"]


def test_speculative_greedy_equals_plain_greedy_on_cpu_fp32(report):
    """fp32 on the CPU: every K of both strategies emits the plain tokens (no divergence to
    explain); the verdict fields say so."""
    res, _ = report
    checks = res["greedy_check"]
    assert set(checks) == {"scratch_swap", "snapshots"}
    for c in checks.values():
        assert set(c) == {f"k{k}" for k in range(1, W + 1)}
        for v in c.values():
            assert v["identical_prompts"] == PROMPTS and v["divergences"] == []
            assert 0.0 <= v["acceptance_rate"] <= 1.0
    assert res["greedy_k1_identical"] is True and res["greedy_divergences_explained"] is True


def _bench_module():
    """``bench/bench_hybrid.py`` imported as the scripts import each other (``bench/`` first on
    ``sys.path``: its sibling modules ``bench_decode``, ``results``, ...)."""
    import importlib

    sys.path.insert(0, str(BENCH.parent))
    try:
        return importlib.import_module("bench_hybrid")
    finally:
        sys.path.remove(str(BENCH.parent))


def test_top2_margin_is_the_plain_paths_next_token_and_its_gap(tmp_path):
    """The divergence explanation (run only where a divergence happens, so never by the CPU
    run above): the margin's top-1 is the token plain greedy emits after the same tokens, the
    margin is the top-1 minus top-2 logit, and one fp32 step at the top-1 logit is its ulp."""
    from speccal.live.generate import generate
    from speccal.runner.engine import Engine, EngineConfig
    from speccal.runner.sampling import SamplingParams

    bench = _bench_module()
    write_checkpoint(tmp_path / "q", "qwen3_5")
    plain = Engine(EngineConfig(model=str(tmp_path / "q"), speculative=False,
                                request_buckets=(1,), max_model_len=64))
    prompt = [5, 17, 3, 88, 41, 9, 60, 2]
    want = generate(plain, [prompt], SamplingParams(max_tokens=4, ignore_eos=True), 0)[0]
    for i in range(4):
        m = bench.top2_margin(plain, prompt + want[:i])
        assert m["top1"] == want[i] and m["top2"] != m["top1"]
        assert m["margin"] >= 0 and m["explained"] is (m["margin"] < m["dtype_step"])
        assert 0 < m["dtype_step"] < 1e-3  # 2 ** -23 relative: fp32 logits of order one


def test_a_divergence_is_reported_with_its_position_tokens_and_margin(tmp_path):
    """``greedy_check`` against a reference whose third token is wrong: the speculative run
    (which emits the true greedy tokens) diverges there, and the row names both tokens and the
    plain path's margin after the reference's first two tokens."""
    from speccal.live.generate import generate
    from speccal.runner.engine import Engine, EngineConfig
    from speccal.runner.sampling import SamplingParams

    bench = _bench_module()
    write_checkpoint(tmp_path / "q", "qwen3_5")
    cfg = dict(model=str(tmp_path / "q"), request_buckets=(1,), max_model_len=64, draft_width=2)
    plain = Engine(EngineConfig(**cfg, speculative=False))
    spec = Engine(EngineConfig(**cfg, state_strategy="snapshots"))
    prompt = [5, 17, 3, 88, 41, 9, 60, 2]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    true = generate(plain, [prompt], params, 0)[0]
    wrong = list(true)
    wrong[2] = (true[2] + 1) % SHAPES["vocab_size"]
    out = bench.greedy_check(plain, spec, [prompt], [wrong], params, 2)
    for k in (1, 2):
        (row,) = out[f"k{k}"]["divergences"]
        assert out[f"k{k}"]["identical_prompts"] == 0
        assert (row["prompt"], row["position"], row["spec"], row["plain"]) == (
            0, 2, true[2], wrong[2])
        assert row == {**row, **bench.top2_margin(plain, prompt + wrong[:2])}


def test_the_verify_breakdown_names_what_grows(capsys):
    """``log_breakdown_delta``: the kernels whose time per step grows most from the decode step
    to the full-width verify, largest change first, then the totals."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    try:
        import bench_hybrid
    finally:
        sys.path.remove(str(bench))
    decode = [["gemv", 100.0, 10], ["delta", 5.0, 3], ["(all kernels)", 105.0, 13],
              ["(span incl. gaps)", 120.0, 0]]
    verify = [["gemv", 104.0, 10], ["delta", 45.0, 3], ["snap", 7.0, 3],
              ["(all kernels)", 156.0, 16], ["(span incl. gaps)", 170.0, 0]]
    bench_hybrid.log_breakdown_delta(decode, verify)
    out = [x for x in capsys.readouterr().out.splitlines() if x.strip()]
    body = [x.split("]", 1)[1].split() for x in out[1:]]
    assert [b[-1] for b in body[:3]] == ["delta", "snap", "gemv"]  # +40, +7, +4
    assert body[0][0] == "+40.0" and body[1][2] == "->"
    assert body[-2][-2:] == ["(all", "kernels)"] and body[-2][0] == "+51.0"


def test_linear_attention_stage_both_strategies(tmp_path):
    """``--linear-attention fused --la-strategy snapshots,scratch_swap``: an engine per strategy
    (the verify timings need captured graphs: CUDA only), the plain and K = 1 tokens of the
    first; an unknown strategy is refused by name before anything runs."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "qwen3_5")
    base = [sys.executable, str(BENCH), "--device", "cpu", "--model", str(folder), "--kv", "24",
            "--repeats", "2", "--draft-width", "2", "--check-tokens", "6",
            "--skip", "hf,compile,strategies,greedy", "--linear-attention", "fused"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    bad = subprocess.run(base + ["--out", str(tmp_path / "bad"), "--la-strategy",
                                 "snapshots,rollback"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert bad.returncode == 2 and "--la-strategy ['rollback']" in bad.stderr
    assert not (tmp_path / "bad").exists()
    proc = subprocess.run(base + ["--out", str(tmp_path / "out"), "--la-strategy",
                                  "snapshots,scratch_swap"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads((tmp_path / "out" / "hybrid.json").read_text())["linear_attention"]["fused"]
    assert len(row["tokens_plain"]) == len(row["tokens_k1"]) == 6
    assert row["tokens_plain"] == row["tokens_k1"]  # fp32, greedy: speculation changes nothing
