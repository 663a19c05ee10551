"""Hybrid presets (runner/presets.py HYBRID_PRESETS): Qwen3.5-0.8B / 2B text shapes, checked
against transformers' Qwen3_5ForCausalLM on the meta device (full size, no memory), and built
with random weights only at tiny scale."""

from __future__ import annotations

import pytest
import torch

from speccal.base.errors import InputError
from speccal.runner.attention import AttnMeta
from speccal.runner.hybrid import HybridModel, hybrid_config_from_hf
from speccal.runner.kv_cache import KVCache
from speccal.runner.linear_attention import StateMeta
from speccal.runner.loader import hybrid_preset, load_model
from speccal.runner.presets import HYBRID_PRESETS, PRESETS

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("transformers without Qwen3.5 (needs >= 5)", allow_module_level=True)

# text-stack parameters (tied head counted once), by hand from the shapes: V*H + 18 delta-net
# layers + 6 gated-attention layers + final norm
TEXT_PARAMS = {"qwen3.5-0.8b": 752_393_024, "qwen3.5-2b": 1_881_825_088}


@pytest.mark.parametrize("name", sorted(HYBRID_PRESETS))
def test_preset_shapes_equal_transformers_text_model(name):
    raw = HYBRID_PRESETS[name].config
    ref_cfg = transformers.Qwen3_5TextConfig(**{k: v for k, v in raw.items()
                                                if k != "mtp_num_hidden_layers"})
    with torch.device("meta"):
        ref = transformers.Qwen3_5ForCausalLM(ref_cfg)
        ours = HybridModel(hybrid_config_from_hf(raw), 1, 1)
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want
    assert sum(p.numel() for p in ours.parameters()) == TEXT_PARAMS[name]
    assert ours.num_kv_layers == 6 and ours.num_state_layers == 18


def test_hybrid_presets_load_through_load_model_with_their_head():
    """``load_model`` serves the hybrid presets by name (the Engine's entry point) with a
    random ``qwen3_5_mtp`` head in the published key layout; on the meta device, so no weights
    are made (full size). An unknown name lists both registries."""
    assert not set(HYBRID_PRESETS) & set(PRESETS)
    loaded = load_model("qwen3.5-0.8b", device=torch.device("meta"), dtype="bfloat16",
                        max_model_len=64, max_positions=64)
    assert loaded.is_random and loaded.family.name == "qwen3_5_mtp"
    assert loaded.num_kv_layers == 6 and loaded.capabilities.has_recurrent_state
    keys = set(loaded.draft.param_key_map(24).values())
    assert len(keys) == 15 and all(k.startswith("mtp.") for k in keys)
    assert loaded.fingerprint.startswith("preset:")
    with pytest.raises(InputError, match="qwen3.5-2b"):
        load_model("qwen3.5-9b", device=torch.device("meta"), dtype="float32",
                   max_model_len=64, max_positions=64)


TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            vocab_size=512)


def _logits(model: HybridModel, ids: list[int]) -> torch.Tensor:
    cfg = model.config.base
    kv = KVCache(model.num_kv_layers, 8, 16, cfg.num_key_value_heads, cfg.head_dim,
                 torch.float32, torch.device("cpu"))
    state = model.new_state(1, torch.float32, torch.device("cpu"))
    n = len(ids)
    meta = AttnMeta(torch.arange(16, 16 + n), torch.arange(n),
                    torch.arange(1, 8, dtype=torch.int32)[None], torch.tensor([n],
                                                                             dtype=torch.int32), n)
    smeta = StateMeta(torch.tensor([0]), torch.tensor([0]), n, is_chunked=True)
    with torch.no_grad():
        return model.logits(model(torch.tensor(ids), torch.arange(n), meta, kv.layers, smeta,
                                  state))


@pytest.mark.parametrize("name", sorted(HYBRID_PRESETS))
def test_tiny_scale_preset_builds_with_seeded_random_weights(name):
    kw = dict(device=torch.device("cpu"), dtype="float32", max_model_len=64, max_positions=64,
              overrides=TINY)
    a, cfg = hybrid_preset(name, seed=1, **kw)
    b, _ = hybrid_preset(name, seed=1, **kw)
    c, _ = hybrid_preset(name, seed=2, **kw)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.base.rope.partial_rotary_factor == 0.25 and cfg.base.rope.theta == 1e7
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    la, lb, lc = _logits(a, ids), _logits(b, ids), _logits(c, ids)
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)
    assert torch.isfinite(la).all() and la.std() > 0.1


def test_state_bytes_per_request_slot_of_the_0_8b_shape():
    """What a scratch-row copy or a snapshot moves per request: 18 delta-net layers x (conv
    state 6144 x 3 in bf16 + ssm state 16 x 128 x 128 in fp32) = 19,537,920 bytes."""
    cfg = hybrid_config_from_hf(HYBRID_PRESETS["qwen3.5-0.8b"].config)
    with torch.device("meta"):
        model = HybridModel(cfg, 1, 1)
    state = model.new_state(1, torch.bfloat16, torch.device("cpu"))
    assert state.bytes_per_slot() == 18 * (6144 * 3 * 2 + 16 * 128 * 128 * 4)
