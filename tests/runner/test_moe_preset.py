"""The routed-expert presets: ``moe-16b-a3b`` (DeepSeek-V2-Lite shapes, parsed and laid out on
the meta device only: 15.7B parameters are never built here) and ``moe-tiny`` (the same config
with its sizes shrunk), which runs on the CPU and reports the experts each round activated."""

from __future__ import annotations

import math

import torch

from speccal.base.runner_face import Routing
from speccal.runner.config import config_from_hf
from speccal.runner.draft_families import REGISTRY
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.loader import _draft_shapes, _target_shapes, draft_config
from speccal.runner.presets import MOE_TINY_SIZES, PRESETS
from speccal.runner.sampling import SamplingParams


def _config(name: str):
    return config_from_hf({**PRESETS[name].config, "architectures": [f"preset:{name}"]})


def test_the_16b_preset_parses_to_deepseek_v2_lite_shapes():
    cfg = _config("moe-16b-a3b")
    mla, moe = cfg.mla, cfg.moe
    assert (mla.kv_lora_rank, mla.q_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim,
            mla.v_head_dim) == (512, None, 64, 128, 128)
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.scoring) == (
        64, 6, 1408, "softmax")
    assert (moe.shared_form, moe.shared_intermediate_size, moe.is_topk_normalised) == (
        "shared_experts", 2 * 1408, False)
    assert moe.sparse_layers == tuple(range(1, 27))  # the first layer dense
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_mtp_depths) == (
        27, 2048, 102400, 1)
    assert cfg.rope.rope_type == "yarn"
    # laid out on the meta device, as the loader does: DeepSeek-V2-Lite's 15.7B parameters
    shapes = _target_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    assert 15.70e9 < total < 15.71e9, total
    assert shapes["model.layers.1.mlp.experts.63.down_proj.weight"] == (2048, 1408)
    assert shapes["model.layers.5.self_attn.kv_b_proj.weight"] == (16 * (128 + 128), 512)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (10944, 2048)
    assert "model.layers.0.mlp.gate.weight" not in shapes
    fam = REGISTRY[PRESETS["moe-16b-a3b"].family]
    head = _draft_shapes(draft_config(cfg, fam, None), fam)
    assert head["model.layers.27.eh_proj.weight"] == (2048, 4096)
    assert head["model.layers.27.mlp.gate.weight"] == (64, 2048)  # a routed MTP layer


def test_the_tiny_preset_is_the_16b_one_shrunk():
    big, tiny = PRESETS["moe-16b-a3b"].config, PRESETS["moe-tiny"].config
    assert set(big) == set(tiny)
    assert {k for k in big if big[k] != tiny[k]} == set(MOE_TINY_SIZES)
    assert PRESETS["moe-tiny"].family == PRESETS["moe-16b-a3b"].family == "deepseek_mtp"


def _rounds(pipeline: bool) -> tuple[Engine, list]:
    eng = Engine(EngineConfig.flat(model="moe-tiny", device="cpu", draft_width=2,
                                   request_buckets=(1, 2), max_model_len=128,
                                   acceptance="forced", pipeline=pipeline))
    for prompt in ([5, 6, 7, 8, 9], [3, 4, 5]):
        eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    eng.prefill_pending()
    eng.take_activated_experts()  # the prefill's (a round's count leaves them out)
    sync = []
    for k in (2, 1, 2, 2):
        res = eng.step(RoundPlan(k))
        if not pipeline:  # the existing per-step read agrees with the per-round count
            assert tuple(eng.take_activated_experts()["target"]) == res.experts_activated
        sync.append(res)
    return eng, [r for r in sync + eng.drain() if r.round_index >= 0]


def test_the_tiny_preset_runs_and_counts_experts_per_round():
    torch.set_num_threads(1)
    eng, sync = _rounds(pipeline=False)
    assert eng.routing == Routing(experts=16, top_k=4, layers=2)
    assert eng.loaded.draft is not None
    counts = [r.experts_activated for r in sync]
    assert len(counts) == 4 and all(len(c) == 2 for c in counts)
    assert all(4 <= c <= 16 for cs in counts for c in cs)
    assert len(set(counts)) > 1  # the rounds' tokens differ, and so do their experts
    # the pipelined loop counts each round exactly: the same rounds, the same counts
    _, piped = _rounds(pipeline=True)
    assert [r.round_index for r in piped] == [0, 1, 2, 3]
    assert [r.experts_activated for r in piped] == counts


def test_a_dense_target_reports_no_routing():
    eng = Engine(EngineConfig.flat(model="tiny", device="cpu", draft_width=1,
                                   request_buckets=(1,), max_model_len=64))
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    assert eng.routing is None and eng.step(RoundPlan(1)).experts_activated == ()
