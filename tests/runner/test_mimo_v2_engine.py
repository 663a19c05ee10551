"""MiMo-V2-Flash as transformers writes it (issue 37), CPU fp32, against transformers.

One random-weight checkpoint written by ``save_pretrained`` with no config edit (4 layers:
full, sliding, sliding, full; window 5, so the prompts and continuations outgrow it; the
sliding layers with twice the KV heads and sink logits; keys of 12 channels and values of 8,
scaled by ``attention_value_scale``; per-layer-type RoPE of different thetas on a third of
each head; dense and routed MLPs mixed), plus an MTP head in the layout vLLM's
``mimo_v2_flash_mtp`` reads (``model.mtp.layers.0.{enorm, hnorm, eh_proj, final_layernorm}``
around a sliding layer with sinks and a routed MLP, its post-attention norm named
``pre_mlp_layernorm``). That layer's weights are a second transformers model's layer 1, so
the head's drafts are checked against transformers' own sliding layer.

Every token comparison is exact: plain greedy (the mixed batch: three requests in the bucket of
four, one stopping at a stop token) and speculative greedy (K = 1..3, with the oracle draft of
``test_hybrid_engine`` forcing every accepted length) emit transformers' greedy tokens.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speccal.base.errors import UnsupportedError
from speccal.runner.config import config_from_hf
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MiMoV2FlashForCausalLM"):
    pytest.skip("transformers without MiMo-V2-Flash (needs >= 5)", allow_module_level=True)

from tests.runner.engine_checks import greedy_refs, oracle_run, scheduled_accepts  # noqa: E402
from tests.runner.engine_checks import run_requests as _run  # noqa: E402
from tests.runner.test_moe_engine import _randomise  # noqa: E402

V = 96  # the oracle draft's wrong tokens are (t + 1) % 96
WINDOW = 5
CONFIG = dict(vocab_size=V, hidden_size=40, intermediate_size=44, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=1, head_dim=12, v_head_dim=8,
              moe_intermediate_size=20, n_routed_experts=6, num_experts_per_tok=2,
              sliding_window=WINDOW, attention_value_scale=0.6, tie_word_embeddings=False,
              layer_types=["full_attention", "sliding_attention", "sliding_attention",
                           "full_attention"],
              mlp_layer_types=["dense", "sparse", "dense", "sparse"],
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
PROMPTS = ([5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14], [7, 1, 62, 30],
           [44, 12, 90, 23, 8, 66, 19, 51, 3, 77, 28, 35, 10])
MAX_TOKENS = (12, 8, 10)
W = 3
MTP_LAYER = 1  # the second model's layer that becomes the head's (sliding, routed)


def _model(seed: int):
    torch.manual_seed(0)
    hf = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**CONFIG)).eval()
    _randomise(hf, seed)
    return hf


def _add_mtp(folder, donor_folder) -> None:
    """``model.mtp.layers.0.*``: the fusion block and final norm, and the donor checkpoint's
    layer :data:`MTP_LAYER` (its post-attention norm renamed as the hub names it)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(3)
    h, pre = CONFIG["hidden_size"], "model.mtp.layers.0."
    for stem, shape in {"enorm.weight": (h,), "hnorm.weight": (h,), "final_layernorm.weight": (h,),
                        "eh_proj.weight": (h, 2 * h)}.items():
        t = torch.randn(shape, generator=g)
        tensors[pre + stem] = 1.0 + 0.2 * t if len(shape) == 1 else 0.35 * t
    layer = f"model.layers.{MTP_LAYER}."
    for key, t in load_file(str(donor_folder / "model.safetensors")).items():
        if key.startswith(layer):
            stem = key.removeprefix(layer).replace("post_attention_layernorm.",
                                                   "pre_mlp_layernorm.")
            tensors[pre + stem] = t
    save_file(tensors, str(path), metadata={"format": "pt"})


def _hf_refs(hf) -> list[list[int]]:
    refs = greedy_refs(hf, PROMPTS, MAX_TOKENS)
    assert len({t for r in refs for t in r}) > 6  # not degenerate
    return refs


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_v2")
    hf, donor = _model(1), _model(2)
    hf.save_pretrained(root / "target")
    donor.save_pretrained(root / "donor")
    _add_mtp(root / "target", root / "donor")
    return root / "target", hf, donor, _hf_refs(hf)


def _engine(folder, **kw) -> Engine:
    cfg = dict(model=str(folder), draft_width=W, request_buckets=(1, 2, 4), max_model_len=64,
               block_size=4, prefill_chunk=8, acceptance="greedy")
    return Engine(EngineConfig.flat(**{**cfg, **kw}))


def _stop_case(refs):
    stop = refs[0][5]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    params[0] = SamplingParams(max_tokens=MAX_TOKENS[0], ignore_eos=True, stop_token_ids=(stop,))
    want = [list(r) for r in refs]
    want[0] = want[0][: want[0].index(stop) + 1]
    return params, want


def test_config_reads_the_sliding_layers_as_transformers_builds_them(mimo):
    """The written config, unedited: sliding layers 1 and 2 with twice the KV heads and sinks,
    the window on them only, values of v_head_dim, two RoPEs; the KV cache per layer."""
    folder, hf, _, _ = mimo
    cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    assert cfg.swa.layers == (1, 2) and cfg.swa.num_kv_heads == 2 and cfg.swa.has_sinks
    assert cfg.sliding_windows == (0, WINDOW, WINDOW, 0)
    assert [cfg.kv_cache_dims(1, i) for i in range(4)] == [(1, 12, 8), (2, 12, 8),
                                                           (2, 12, 8), (1, 12, 8)]
    assert (cfg.rope.theta, cfg.sliding_rope.theta) == (5_000_000.0, 10_000.0)
    eng = _engine(folder, speculative=False)
    assert [tuple(k.shape[2:]) + (v.shape[-1],) for k, v in eng.kv.layers] == \
        [(1, 12, 8), (2, 12, 8), (2, 12, 8), (1, 12, 8)]
    sinks = eng.loaded.target.model.layers[1].self_attn.attention_sink_bias
    assert torch.equal(sinks, hf.model.layers[1].self_attn.sinks.detach())


def test_plain_greedy_equals_transformers(mimo):
    """Plain greedy, the mixed batch with a stop token (the head's tensors dropped)."""
    folder, _, _, refs = mimo
    eng = _engine(folder, speculative=False)
    assert eng.loaded.draft is None
    params, want = _stop_case(refs)
    got, _ = _run(eng, PROMPTS, params, 0)
    assert got == want


@pytest.fixture(scope="module")
def spec_engine(mimo):
    folder = mimo[0]
    return _engine(folder)


def test_head_drafts_equal_transformers_sliding_layer(mimo, spec_engine):
    """The head's first round of drafts (K = 3, batch 1) equals a reference built from
    transformers' modules: its layer is the donor's layer 1 (sliding window, sinks, routed)."""
    folder, hf, donor, refs = mimo
    eng = spec_engine
    assert eng.loaded.family.name == "mimo_v2_mtp"
    attn = eng.loaded.draft.layer.self_attn
    assert attn.num_kv_heads == 2 and attn.window == WINDOW
    assert attn.attention_sink_bias is not None and eng.loaded.draft.layer.is_sparse
    tensors = load_file(str(folder / "model.safetensors"))
    recorded = []
    real = eng.runner.draft_part

    def record(x):
        drafts, scores = real(x)
        recorded.append(drafts[: x.num_requests].tolist())
        return drafts, scores

    eng.runner.draft_part = record
    try:
        prompt = PROMPTS[0]
        _run(eng, [prompt], [SamplingParams(max_tokens=2, ignore_eos=True)], W)
    finally:
        del eng.runner.draft_part
    want = _head_reference(hf, donor, tensors, prompt, refs[0][0], W)
    assert recorded[0] == [want]


def _head_reference(hf, donor, tensors, prompt: list[int], first: int, k: int) -> list[int]:
    """The head's ``k`` greedy drafts after ``prompt`` + ``first`` from transformers' modules:
    the target's final-normed hidden states, the fusion block, the donor's sliding layer (its
    sinks; its window as an additive mask; the sliding RoPE) recomputed over every row each
    step, the final norm fed back, and the target's LM head."""
    pre = "model.mtp.layers.0."
    eps = hf.config.rms_norm_eps

    def norm(x, name):
        xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return tensors[pre + name + ".weight"] * xf

    layer = donor.model.layers[MTP_LAYER]
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]  # [L, H]
        feeds = list(hidden)
        tokens = [*prompt[1:], first]
        drafts = []
        for _ in range(k):
            n = len(feeds)
            e = norm(hf.model.embed_tokens(torch.tensor(tokens)), "enorm")
            h = norm(torch.stack(feeds), "hnorm")
            x = torch.cat([e, h], dim=-1) @ tensors[pre + "eh_proj.weight"].T
            pos = torch.arange(n)[None]
            cos_sin = hf.model.rotary_emb(x[None], pos, "sliding_attention")
            i, j = torch.arange(n)[:, None], torch.arange(n)[None]
            visible = (j <= i) & (i - j < WINDOW)
            mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
            out = layer(x[None], attention_mask=mask, position_embeddings=cos_sin,
                        position_ids=pos)[0]
            normed = norm(out[-1], "final_layernorm")
            d = int(hf.lm_head(normed).argmax())
            drafts.append(d)
            feeds.append(normed)
            tokens.append(d)
    return drafts


def test_speculative_greedy_equals_transformers_every_accepted_length(mimo, spec_engine):
    """K = 1..3: batch 1 with the head's own drafts, then the oracle's mixed batch (every
    accepted length 0..K happens, tokens exact)."""
    _, _, _, refs = mimo
    eng = spec_engine
    params, want = _stop_case(refs)
    for k in range(1, W + 1):
        got, _ = _run(eng, PROMPTS[:1], [SamplingParams(max_tokens=MAX_TOKENS[0],
                                                        ignore_eos=True)], k)
        assert got == [refs[0]], (k, "batch 1")
        got, results, oracle = oracle_run(eng, PROMPTS, refs, params, k, V)
        assert got == want, (k, "mixed batch")
        accepted = scheduled_accepts(results, oracle, k)
        assert set(accepted) == set(range(k + 1)), (k, accepted)


def test_sinks_change_the_tokens(mimo, tmp_path):
    """The sink logits matter at these weights: with them zeroed the greedy tokens differ
    (so the exact comparisons above check them)."""
    folder, _, _, refs = mimo
    tensors = load_file(str(folder / "model.safetensors"))
    for key in tensors:
        if key.endswith("attention_sink_bias") and key.startswith("model.layers."):
            tensors[key] = torch.full_like(tensors[key], -30.0)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    got, _ = _run(_engine(tmp_path, speculative=False), PROMPTS,
                  [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS], 0)
    assert got != refs


def test_triton_backend_is_refused_naming_the_sinks(mimo):
    """The Triton attention has no window and no sinks: building the fused path refuses the
    sliding layer by its tensor (CPU: the layer's own check, as the engine calls it on CUDA)."""
    folder = mimo[0]
    eng = _engine(folder, speculative=False)
    with pytest.raises(UnsupportedError, match=r"attention_sink_bias.*attention_backend='torch'"):
        eng.loaded.target.model.layers[1].self_attn.fuse_weights()
    with pytest.raises(UnsupportedError, match=r"v_head_dim=8.*attention_backend='torch'"):
        eng.loaded.target.model.layers[0].self_attn.fuse_weights()


@pytest.mark.parametrize("key, value, match", [
    ("swa_num_key_value_heads", 4, r"swa_num_key_value_heads=4.*expected 2"),
    ("hybrid_layer_pattern", [0, 1, 0, 0], r"hybrid_layer_pattern=\[0, 1, 0, 0\].*expected \[0, 1, 1, 0\]"),
    ("add_swa_attention_sink_bias", False, r"add_swa_attention_sink_bias=False.*expected True"),
    ("sliding_window_size", 9, r"sliding_window_size=9.*expected 4"),
])
def test_hub_keys_are_read_only_where_they_describe_the_built_model(mimo, key, value, match):
    """The hub's own keys (transformers' class does not read them) are accepted where they say
    what the class builds, refused by name otherwise."""
    raw = json.loads((mimo[0] / "config.json").read_text())
    hub = dict(swa_num_key_value_heads=2, hybrid_layer_pattern=[0, 1, 1, 0],
               add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
               sliding_window_size=WINDOW - 1, swa_head_dim=12, swa_v_head_dim=8,
               layernorm_epsilon=raw["rms_norm_eps"])
    assert config_from_hf({**raw, **hub}).swa == config_from_hf(raw).swa
    with pytest.raises(UnsupportedError, match=match):
        config_from_hf({**raw, **hub, key: value})


def test_head_window_follows_the_context(mimo):
    """A context that fits in the window drops it for the target's sliding layers and the
    head's alike; their KV heads and sinks stay."""
    folder = mimo[0]
    eng = _engine(folder, max_model_len=WINDOW, request_buckets=(1,))
    target, head = eng.loaded.target.model.layers[1].self_attn, eng.loaded.draft.layer.self_attn
    assert (target.window, head.window) == (0, 0)
    assert head.num_kv_heads == 2 and head.attention_sink_bias is not None
    assert dataclasses.replace(eng.loaded.config.swa, window=WINDOW) == \
        config_from_hf(json.loads((folder / "config.json").read_text())).swa
