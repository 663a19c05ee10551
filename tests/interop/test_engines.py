"""Each engine's file: it passes the engine's own rules (``engine_rules``, re-implemented from
its code) and the engine then runs what speccal decided."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from speccal.base.errors import InputError
from speccal.costmodel.table import load_table, parse_table
from speccal.costmodel.table_build import refit_table
from speccal.interop import sglang, sglang_adaptive, trtllm, vllm
from speccal.interop.pricing import pricing_block as sglang_pricing
from speccal.policy import CostModel

from .engine_rules import (
    EngineRejects,
    check_sglang,
    check_sglang_adaptive,
    check_trtllm,
    check_vllm,
    sglang_adaptive_steps,
    sglang_step_seconds,
    trtllm_draft_len,
    vllm_dense,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tables" / "tiny-cpu.json"
H200 = ROOT / "tables" / "dense-2b-h200.json"

DECISIONS = [
    {1: 3, 2: 3, 4: 2, 8: 1},
    {1: 2, 2: 3, 4: 3, 8: 3},
    {1: 3, 2: 0, 4: 1, 8: 0},
    {1: 1, 2: 1, 4: 1, 8: 1},
    {1: 0, 2: 2, 4: 2, 8: 0},
]


def _tps(decisions):
    """Made-up tokens/s per bucket peaking at the decided k (1000 at best, -100 per step off)."""
    return {b: {k: 1000.0 - 100 * abs(k - d) for k in range(4)} for b, d in decisions.items()}


@pytest.mark.parametrize("decisions", DECISIONS)
def test_vllm_file_passes_vllms_rules_and_runs_the_decisions(decisions):
    r = vllm.render(decisions, 3, 1)
    cfg = check_vllm(r.text)
    dense = vllm_dense(cfg, 32)
    prev = 0
    for b in sorted(decisions):
        # every batch size a bucket serves, (previous bucket, Bcap], runs the bucket's k
        assert all(dense[bs] == decisions[b] for bs in range(prev + 1, b + 1))
        prev = b
    assert all(dense[bs] == decisions[8] for bs in range(9, 33))  # carried forward
    assert r.decisions == decisions
    assert [vllm.lookup(cfg, bs) for bs in range(1, 33)] == dense[1:]


def test_vllm_merges_equal_neighbours_and_refuses_dp():
    assert vllm.entries({1: 3, 2: 3, 4: 2, 8: 2}) == [[1, 2, 3], [3, 8, 2]]
    with pytest.raises(InputError, match="topology.dp"):
        vllm.render({1: 3}, 3, 2)
    vllm.render({1: 3}, 3, "unknown")  # unknown topology is not refused here


@pytest.mark.parametrize("decisions", DECISIONS)
def test_trtllm_file_passes_trtllms_rules(decisions):
    if all(v == 0 for v in decisions.values()):
        return
    r = trtllm.render(decisions, _tps(decisions), "x.speccal.json")
    spec = check_trtllm(r.text)
    exported = {b: trtllm_draft_len(spec, b) for b in decisions}
    assert exported == r.decisions
    changed = {a["bcap"] for a in r.adjustments}
    assert {b for b in decisions if exported[b] != decisions[b]} == changed
    # past the largest key TensorRT-LLM runs the implicit 0 (no floor for MTP-Eagle)
    assert trtllm_draft_len(spec, 9) == 0 and trtllm_draft_len(spec, 9, 1) == 1
    # every batch size up to a bucket runs that bucket's exported value
    prev = 0
    for b in sorted(decisions):
        assert all(trtllm_draft_len(spec, bs) == exported[b] for bs in range(prev + 1, b + 1))
        prev = b


def test_trtllm_projection_loses_the_least():
    # best k 2 at bucket 1 but 3 elsewhere: raising bucket 1 costs less than clamping the rest
    decisions = {1: 2, 2: 3, 4: 3, 8: 3}
    tps = {
        1: {1: 788, 2: 905, 3: 881},
        2: {1: 1455, 2: 1618, 3: 1778},
        4: {1: 2889, 2: 3244, 3: 3661},
        8: {1: 5571, 2: 6590, 3: 6601},
    }
    vals, changes = trtllm.project(decisions, tps)
    assert vals == {1: 3, 2: 3, 4: 3, 8: 3}
    assert changes[0]["bcap"] == 1 and changes[0]["tokens_per_s_lost_pct"] == pytest.approx(
        100 * (1 - 881 / 905)
    )
    assert trtllm.schedule(vals) == {8: 3}
    with pytest.raises(InputError, match="max_draft_len"):
        trtllm.render({1: 0, 2: 0}, _tps({1: 0, 2: 0}), "x")


def test_engine_rules_reject_what_the_engines_reject():
    with pytest.raises(EngineRejects, match="start at 1"):
        check_vllm(
            json.dumps(
                {
                    "method": "mtp",
                    "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": [[2, 8, 3]],
                }
            )
        )
    with pytest.raises(EngineRejects, match="overlapping"):
        check_vllm(
            json.dumps(
                {
                    "method": "mtp",
                    "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": [[1, 4, 3], [4, 8, 2]],
                }
            )
        )
    bad = "speculative_config:\n  decoding_type: MTP\n  max_draft_len: 2\n  draft_len_schedule:\n    1: 2\n    4: 3\n"
    with pytest.raises(EngineRejects, match="<= max_draft_len"):
        check_trtllm(bad)
    with pytest.raises(EngineRejects, match="uninitialized"):
        check_sglang(
            json.dumps(
                {"sample_batch_tokens": [1], "sample_steps_per_sec": [1.0], "max_batch_tokens": 4}
            )
        )


@pytest.fixture(scope="module", params=[TINY, H200], ids=["tiny-cpu", "dense-2b-h200"])
def verify_table(request):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_table(request.param)


def _full_bucket_costs(t, kv):
    """speccal's lookup at every full bucket and captured G it prices: ``{(bcap, g): ms}``."""
    cost = CostModel.from_table(t)
    geo = t.geometry()
    out = {}
    for bcap in geo.request_buckets:
        for g in geo.target_rows[bcap]:
            ms = float(cost.lookup(np.array([bcap]), np.array([g]), np.array([kv]))[0])
            if np.isfinite(ms):
                out[(bcap, g)] = ms
    return out


@pytest.mark.parametrize("model", ["additive", "sps"])
def test_sglang_file_passes_sglangs_rules_and_prices_like_the_table(verify_table, model):
    t = verify_table if model == "additive" else refit_table(verify_table, model="sps")
    r = sglang.render(t, 1024.0, "x.speccal.json")
    doc = check_sglang(r.text)
    assert doc["_kind"] == model and r.format == (
        sglang.ADDITIVE if model == "additive" else sglang.SPS
    )
    geo = t.geometry()
    ours = _full_bucket_costs(t, 1024.0)
    assert ours
    # at every full bucket and every captured G it reaches, SGLang's reading is the table's
    # cost. SGLang's SPS table has no request axis: at a G several buckets reach, whose costs
    # differ where the lookup has a request term (a KV model's alpha(Bcap)), it reads the median
    # of their costs, so a G one bucket reaches is exact, and every G is for a G-only table.
    spread = {}
    for (bcap, g), ms in ours.items():
        same_g = [v for (_, gg), v in ours.items() if gg == g]
        want = ms if model == "additive" else float(np.median(same_g))
        spread[(bcap, g)] = max(same_g) - min(same_g)
        theirs = 1000 * sglang_step_seconds(doc, bcap, g - bcap)
        assert theirs == pytest.approx(want, rel=1e-9), (bcap, g)
        if spread[(bcap, g)] == 0.0:
            assert theirs == pytest.approx(ms, rel=1e-9), (bcap, g)
    if model == "sps" and t.kv_model is None:
        assert not any(spread.values())  # the G-only fit: exact at every full bucket
    fid = r.fidelity
    assert fid["points"] > 0 and fid["nonpositive"] == 0
    # exact at full buckets (above), up to the SPS pooling; the other differences are partial
    # batches, which speccal pads to the bucket's captured G and SGLang prices at their own M
    worst = fid["worst_point"]
    if fid["max_abs_diff_pct"] > 1e-7 and worst["num_reqs"] in geo.request_buckets:
        cost = CostModel.from_table(t)
        b = worst["num_reqs"]
        g = int(cost.g(np.array([b]), np.array([worst["M"]]))[0])
        assert model == "sps" and spread[(b, g)] > 0, worst


def test_sglang_prices_the_kv_model_at_the_exact_kv():
    """Inside a KV model's span the file is the KV model at that KV, not an interval's fit: two
    KVs of one context interval give different files, each pricing like the lookup there."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = load_table(H200)
    assert t.kv_model is not None and len(t.fits) >= 3
    f = t.fits[len(t.fits) // 2]
    kvs = [float(f.min_kv_length), (f.min_kv_length + f.max_kv_length) / 2, float(f.max_kv_length)]
    docs = []
    for kv in kvs:
        r = sglang.render(t, kv, "x")
        doc = check_sglang(r.text)
        for (bcap, g), ms in _full_bucket_costs(t, kv).items():
            theirs = 1000 * sglang_step_seconds(doc, bcap, g - bcap)
            assert theirs == pytest.approx(ms, rel=1e-9), (kv, bcap, g)
        assert any("KV model" in n for n in r.notes)
        block = sglang_pricing(t, kv)
        assert block["model"] == "kv_model" and block["kv_length"] == kv
        docs.append(r.document)
    # the slope term (slope(x) * x * kv) moves the axis it is on, the largest level most
    axis = "alpha_seconds" if t.kv_model.kv_term in ("shared_bcap", "per_bcap") else "theta_seconds"
    assert docs[0][axis] != docs[1][axis] != docs[2][axis]
    assert docs[2][axis][-1] > docs[0][axis][-1]
    # without the KV model (kv_aware off: the interval's fit) speccal prices these KVs alike
    doc = t.to_json_dict()
    del doc["kv_model"]
    flat = parse_table(json.dumps(doc))
    assert sglang.render(flat, kvs[0], "x").text == sglang.render(flat, kvs[2], "x").text
    assert sglang_pricing(flat, kvs[0])["model"] == "context_fit"


def test_sglang_units_and_axes(verify_table):
    r = sglang.render(verify_table, 1024.0, "x")
    geo = verify_table.geometry()
    ours = _full_bucket_costs(verify_table, 1024.0)
    b0, g0 = geo.request_buckets[0], min(geo.target_rows[geo.request_buckets[0]])
    # seconds; bias = the reference cell's cost (smallest Bcap and G) at that KV
    assert r.document["bias_seconds"] == pytest.approx(ours[(b0, g0)] / 1000, rel=1e-9)
    gmax = max(g for gs in geo.target_rows.values() for g in gs)
    assert r.document["m_probes"][-1] == gmax  # M axis = verify rows = speccal G
    assert r.document["bs_probes"][-1] == geo.request_buckets[-1]  # request axis = speccal Bcap
    sps_table = refit_table(verify_table, model="sps")
    sps = sglang.render(sps_table, 1024.0, "x").document
    assert '"bias_seconds"' not in json.dumps(sps)  # SGLang picks the loader by this key
    # steps per second; the largest G is reached by the largest bucket only (no pooling)
    b_last = geo.request_buckets[-1]
    assert [b for b in geo.request_buckets if gmax in geo.target_rows[b]] == [b_last]
    last = _full_bucket_costs(sps_table, 1024.0)[(b_last, gmax)]
    assert sps["sample_steps_per_sec"][-1] == pytest.approx(1000 / last, rel=1e-9)
    assert sps["max_batch_tokens"] == gmax


def test_sglang_refuses_draft_step_tables_dp_and_foreign_contexts():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = load_table(ROOT / "tables" / "dense-2b-h200-draft-step.json")
        t = load_table(TINY)
    with pytest.raises(InputError, match="target_verify"):
        sglang.render(ds, 512.0, "x")
    with pytest.raises(InputError, match="--kv-length"):
        sglang.render(t, 10_000.0, "x")
    compat = t.compatibility.model_copy(
        update={"topology": t.compatibility.topology.model_copy(update={"dp": 2})}
    )
    dp2 = t.model_copy(update={"compatibility": compat})
    with pytest.raises(InputError, match="dp"):
        sglang.render(dp2, 1024.0, "x")


def test_staircase_serves_each_level_from_the_previous_plus_one():
    assert sglang.staircase([1, 2, 4, 8], [0.0, 1.0, 2.0, 3.0]) == (
        [1, 2, 3, 4, 5, 8],
        [0.0, 1.0, 2.0, 2.0, 3.0, 3.0],
    )


# SGLang's EAGLE / MTP adaptive steps: the rules of python/sglang/srt/speculative/
# adaptive_spec_params.py @ 015c872628e328b530880bcf95ae91222604b225 (_load_adaptive_config,
# AdaptiveStepSlot) and adaptive_step_router.py @ a12239f6ac74d804d169ee5d3cfed3c49fa7162c
# (batch_size_key_for_batch), transcribed in engine_rules.


@pytest.mark.parametrize("decisions", DECISIONS)
@pytest.mark.parametrize("graphs", [None, [1, 2, 4, 8]], ids=["eager", "graphs-at-buckets"])
def test_sglang_adaptive_file_passes_sglangs_rules_and_runs_the_decisions(decisions, graphs):
    if all(v == 0 for v in decisions.values()):
        with pytest.raises(InputError, match="serve without speculative decoding"):
            sglang_adaptive.render(decisions, 1)
        return
    r = sglang_adaptive.render(decisions, 1)
    parsed = check_sglang_adaptive(r.text)
    assert parsed["strategy"] == "ema"
    assert all(len(c) == 1 for c in parsed["slots"].values())  # one candidate: k held
    prev = 0
    for b in sorted(decisions):
        for bs in range(prev + 1, b + 1):  # every batch size the bucket serves
            assert sglang_adaptive_steps(parsed, bs, graphs) == decisions[b]
        prev = b
    for bs in range(9, 33):  # past the largest bucket: the last slot
        assert sglang_adaptive_steps(parsed, bs, graphs) == decisions[8]
    assert r.decisions == decisions
    # any --speculative-num-steps in the union runs the same schedule
    for n in sorted({k for k in decisions.values()}):
        p = check_sglang_adaptive(r.text, num_steps=n)
        assert [sglang_adaptive_steps(p, b) for b in sorted(decisions)] == [
            decisions[b] for b in sorted(decisions)
        ]


def test_sglang_adaptive_slots_are_lower_bounds_merged_and_dp_is_refused():
    assert sglang_adaptive.slots({1: 3, 2: 3, 4: 2, 8: 2}) == {1: 3, 3: 2}
    assert sglang_adaptive.slots({1: 0, 2: 2, 4: 2, 8: 0}) == {1: 0, 2: 2, 5: 0}
    doc = json.loads(sglang_adaptive.render({1: 3, 2: 3, 4: 2, 8: 2}, 1).text)
    assert doc == {"strategy": "ema", "1": {"candidate_steps": [3]}, "3": {"candidate_steps": [2]}}
    with pytest.raises(InputError, match="topology.dp"):
        sglang_adaptive.render({1: 3}, 2)


def test_sglang_adaptive_rules_reject_what_sglang_rejects():
    for bad, why in (
        ("[1]", "JSON object"),
        ('{"strategy": "ucb", "1": {"candidate_steps": [1]}}', "strategy"),
        ('{"strategy": "ema"}', "at least one"),
        ('{"1": {"candidate_steps": []}}', "non-negative"),
        ('{"1": {"candidate_steps": [-1, 2]}}', "non-negative"),
        ('{"1": {"candidate_steps": 3}}', "non-negative"),
    ):
        with pytest.raises(EngineRejects, match=why):
            check_sglang_adaptive(bad)
    with pytest.raises(EngineRejects, match="num-steps"):
        check_sglang_adaptive('{"1": {"candidate_steps": [1, 3]}}', num_steps=2)
    # keys are lower bounds after CUDA-graph padding; below every key, the smallest slot
    p = check_sglang_adaptive('{"4": {"candidate_steps": [1]}, "9": {"candidate_steps": [3]}}')
    assert [sglang_adaptive_steps(p, b) for b in (1, 4, 8, 9, 20)] == [1, 1, 1, 3, 3]
    assert sglang_adaptive_steps(p, 7, cuda_graph_bs=[4, 12]) == 3  # 7 pads to 12
