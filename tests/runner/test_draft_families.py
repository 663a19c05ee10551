"""Synthetic checkpoints in every key layout: loading, refusals, and the draft forward checked
against an independent dense pure-torch reference (no paging, whole sequences recomputed).

Checkpoints are written with ``safetensors`` under explicit key names (this file does not use
the registry's key builders), one of them sharded with ``model.safetensors.index.json``.
Reference tolerance: float32, draft probabilities within 1e-4 absolute; tokens exactly equal.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from speccal.base.errors import InputError, UnsupportedError
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams

V, H, FF, L, NH, NKV, D = 96, 32, 64, 2, 4, 2, 8
THETA = 10000.0


def _layer_tensors(
    g: torch.Generator, prefix: str, bias: bool, qk_norm: bool
) -> dict[str, torch.Tensor]:
    def w(*shape, s=0.3):
        return torch.randn(*shape, generator=g) * s

    t = {
        "input_layernorm.weight": 1 + w(H, s=0.1),
        "post_attention_layernorm.weight": 1 + w(H, s=0.1),
        "self_attn.q_proj.weight": w(NH * D, H),
        "self_attn.k_proj.weight": w(NKV * D, H),
        "self_attn.v_proj.weight": w(NKV * D, H),
        "self_attn.o_proj.weight": w(H, NH * D),
        "mlp.gate_proj.weight": w(FF, H),
        "mlp.up_proj.weight": w(FF, H),
        "mlp.down_proj.weight": w(H, FF),
    }
    if bias:
        t |= {
            "self_attn.q_proj.bias": w(NH * D),
            "self_attn.k_proj.bias": w(NKV * D),
            "self_attn.v_proj.bias": w(NKV * D),
        }
    if qk_norm:
        t |= {
            "self_attn.q_norm.weight": 1 + w(D, s=0.1),
            "self_attn.k_norm.weight": 1 + w(D, s=0.1),
        }
    return {prefix + k: v for k, v in t.items()}


def make_checkpoint(
    path,
    layout: str,
    *,
    depths: int = 1,
    config_depths: int | None = None,
    bias: bool = False,
    qk_norm: bool = True,
    sharded: bool = False,
    drop: str | None = None,
    reshape: str | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Write a tiny HF-style checkpoint with an MTP head in ``layout``; returns its tensors."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "model.embed_tokens.weight": torch.randn(V, H, generator=g),
        "lm_head.weight": torch.randn(V, H, generator=g) * 0.3,
        "model.norm.weight": 1 + torch.randn(H, generator=g) * 0.1,
    }
    for layer in range(L):
        t |= _layer_tensors(g, f"model.layers.{layer}.", bias, qk_norm)
    for d in range(depths):
        if layout == "mimo":
            p = f"model.mtp_layers.{d}."
            t |= _layer_tensors(g, p, bias, qk_norm)
            t |= {
                p + "token_layernorm.weight": 1 + torch.randn(H, generator=g) * 0.1,
                p + "hidden_layernorm.weight": 1 + torch.randn(H, generator=g) * 0.1,
                p + "input_proj.weight": torch.randn(H, 2 * H, generator=g) * 0.3,
                p + "final_layernorm.weight": 1 + torch.randn(H, generator=g) * 0.1,
            }
        elif layout == "deepseek":
            p = f"model.layers.{L + d}."
            t |= _layer_tensors(g, p, bias, qk_norm)
            t |= {
                p + "enorm.weight": 1 + torch.randn(H, generator=g) * 0.1,
                p + "hnorm.weight": 1 + torch.randn(H, generator=g) * 0.1,
                p + "eh_proj.weight": torch.randn(H, 2 * H, generator=g) * 0.3,
                p + "shared_head.norm.weight": 1 + torch.randn(H, generator=g) * 0.1,
                p + "shared_head.head.weight": torch.randn(V, H, generator=g) * 0.3,
                p + "embed_tokens.weight": torch.randn(V, H, generator=g),
            }
        elif layout == "qwen3_5":
            t |= _layer_tensors(g, f"mtp.layers.{d}.", bias, qk_norm)
            t |= {
                "mtp.fc.weight": torch.randn(H, 2 * H, generator=g),
                "mtp.norm.weight": torch.ones(H),
                "mtp.pre_fc_norm_embedding.weight": torch.ones(H),
                "mtp.pre_fc_norm_hidden.weight": torch.ones(H),
            }
    if drop:
        del t[drop]
    if reshape:
        t[reshape] = torch.zeros(t[reshape].shape[0] + 1, *t[reshape].shape[1:])
    cfg = {
        "architectures": ["TestForCausalLM"],
        "model_type": "test",
        "vocab_size": V,
        "hidden_size": H,
        "intermediate_size": FF,
        "num_hidden_layers": L,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": D,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": THETA,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "attention_bias": bias,
    }
    if depths or config_depths:
        cfg["num_nextn_predict_layers"] = depths if config_depths is None else config_depths
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if sharded:
        keys = sorted(t)
        half = len(keys) // 2
        shards = {
            "model-00001-of-00002.safetensors": keys[:half],
            "model-00002-of-00002.safetensors": keys[half:],
        }
        for fname, ks in shards.items():
            save_file({k: t[k].contiguous() for k in ks}, str(path / fname))
        index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return t


# ---------------------------------------------------------------------------- dense reference


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos):  # x [T, heads, D]
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cos(ang).float()[:, None], torch.sin(ang).float()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _ref_layer(W, p, x, pos):
    T = x.shape[0]
    h = _rms(x, W[p + "input_layernorm.weight"])

    def proj(name, heads):
        y = h @ W[p + f"self_attn.{name}_proj.weight"].T
        if p + f"self_attn.{name}_proj.bias" in W:
            y = y + W[p + f"self_attn.{name}_proj.bias"]
        return y.view(T, heads, D)

    q, k, v = proj("q", NH), proj("k", NKV), proj("v", NKV)
    if p + "self_attn.q_norm.weight" in W:
        q, k = _rms(q, W[p + "self_attn.q_norm.weight"]), _rms(k, W[p + "self_attn.k_norm.weight"])
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, NH * D)
    x = x + o @ W[p + "self_attn.o_proj.weight"].T
    m = _rms(x, W[p + "post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(m @ W[p + "mlp.gate_proj.weight"].T) * (
        m @ W[p + "mlp.up_proj.weight"].T
    )
    return x + mlp @ W[p + "mlp.down_proj.weight"].T


def ref_target(W, tokens):
    """Hidden states after the final norm [T, H] and logits [T, V] of the whole sequence."""
    pos = torch.arange(len(tokens))
    x = W["model.embed_tokens.weight"][torch.tensor(tokens)]
    for layer in range(L):
        x = _ref_layer(W, f"model.layers.{layer}.", x, pos)
    h = _rms(x, W["model.norm.weight"])
    return h, h @ W["lm_head.weight"].T


def ref_mtp(W, layout, hidden, tokens):
    """MTP over rows (hidden_i, token_i) at positions 0..T-1: feedback [T, H], logits [T, V]."""
    pos = torch.arange(len(tokens))
    ids = torch.tensor(tokens)
    if layout == "mimo":
        p = "model.mtp_layers.0."
        e = _rms(W["model.embed_tokens.weight"][ids], W[p + "token_layernorm.weight"])
        h = _rms(hidden, W[p + "hidden_layernorm.weight"])
        x = torch.cat([h, e], -1) @ W[p + "input_proj.weight"].T
        x = _ref_layer(W, p, x, pos)
        normed = _rms(x, W[p + "final_layernorm.weight"])
        return normed, normed @ W["lm_head.weight"].T
    p = f"model.layers.{L}."
    e = _rms(W[p + "embed_tokens.weight"][ids], W[p + "enorm.weight"])
    h = _rms(hidden, W[p + "hnorm.weight"])
    x = torch.cat([e, h], -1) @ W[p + "eh_proj.weight"].T
    x = _ref_layer(W, p, x, pos)
    return x, _rms(x, W[p + "shared_head.norm.weight"]) @ W[p + "shared_head.head.weight"].T


def ref_round(W, layout, seq, k):
    """Reference drafts, their probabilities and the forced bonus for committed ``seq``.

    ``seq`` ends with the pending token; the draft sees (h_i, seq[i+1]) for every i.
    """
    h, _ = ref_target(W, seq)
    hid, toks = h[:-1], list(seq[1:])
    drafts, probs = [], []
    for _ in range(k):
        fb, logits = ref_mtp(W, layout, hid, toks)
        d = int(logits[-1].argmax())
        drafts.append(d)
        probs.append(float(logits[-1].softmax(-1)[d]))
        hid = torch.cat([hid, fb[-1:]], 0)
        toks.append(d)
    _, tl = ref_target(W, list(seq) + drafts)
    return drafts, probs, int(tl[-1].argmax())


# ---------------------------------------------------------------------------- tests


def _engine(path, **kw):
    base = dict(
        model=str(path),
        draft_width=3,
        request_buckets=(1, 2),
        acceptance="forced",
        block_size=4,
        prefill_chunk=4,
        max_model_len=128,
    )
    return Engine(EngineConfig(**(base | kw)))


@pytest.mark.parametrize(
    "layout,bias,qk_norm,sharded",
    [
        ("mimo", True, False, False),
        ("mimo", False, True, True),
        ("deepseek", False, True, False),
        ("deepseek", True, True, True),
    ],
)
def test_draft_forward_matches_reference(tmp_path, layout, bias, qk_norm, sharded):
    W = make_checkpoint(
        tmp_path / "ckpt", layout, bias=bias, qk_norm=qk_norm, sharded=sharded, seed=3
    )
    eng = _engine(tmp_path / "ckpt")
    assert eng.loaded.family.name == {"mimo": "mimo_mtp", "deepseek": "deepseek_mtp"}[layout]
    prompt = [5, 17, 33, 2, 90, 41, 7, 64, 12, 3, 77]  # 11 tokens: 3 prefill chunks, 3 blocks
    rid = eng.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    seq = list(prompt)
    _, logits = ref_target(W, seq)
    seq.append(int(logits[-1].argmax()))
    for round_index in range(3):  # round 2+ checks the draft context update after acceptance
        res = eng.step(RoundPlan(3))
        drafts, probs, bonus = ref_round(W, layout, seq, 3)
        emitted = res.emitted[0][1:] if round_index == 0 else res.emitted[0]
        if round_index == 0:
            assert res.emitted[0][0] == seq[-1]  # first token from prefill
        assert emitted == drafts + [bonus], f"round {round_index}"
        torch.testing.assert_close(
            torch.tensor(res.draft_scores[0]), torch.tensor(probs), atol=1e-4, rtol=0
        )
        seq += drafts + [bonus]
    assert eng.requests[rid].output == seq[len(prompt) :]


def test_reference_discriminates_layouts(tmp_path):
    """The reference is layout-sensitive: reading a MiMo head with DeepSeek semantics differs."""
    W = make_checkpoint(tmp_path / "m", "mimo", seed=3)
    seq = [5, 17, 33, 2, 90, 41]
    fb, logits = ref_mtp(W, "mimo", ref_target(W, seq)[0][:-1], seq[1:])
    p = "model.mtp_layers.0."
    e = _rms(W["model.embed_tokens.weight"][torch.tensor(seq[1:])], W[p + "token_layernorm.weight"])
    h = _rms(ref_target(W, seq)[0][:-1], W[p + "hidden_layernorm.weight"])
    swapped = torch.cat([e, h], -1) @ W[p + "input_proj.weight"].T  # wrong concat order
    x = _ref_layer(W, p, swapped, torch.arange(len(seq) - 1))
    wrong = _rms(x, W[p + "final_layernorm.weight"]) @ W["lm_head.weight"].T
    assert (wrong - logits).abs().max() > 0.1


def test_target_loader_drops_draft_keys_and_plain_matches_spec(tmp_path):
    make_checkpoint(tmp_path / "c", "deepseek", seed=1)
    plain = _engine(tmp_path / "c", speculative=False, acceptance="greedy")
    assert plain.loaded.draft is None and len(plain.kv.layers) == L
    spec = _engine(tmp_path / "c", acceptance="greedy")
    assert len(spec.kv.layers) == L + 1
    from speccal.live.generate import generate

    prm = SamplingParams(max_tokens=12, ignore_eos=True)
    assert generate(plain, [[1, 2, 3, 4, 5]], prm, 0) == generate(spec, [[1, 2, 3, 4, 5]], prm, 3)


def test_qwen3_5_layout_is_recognised_and_refused(tmp_path):
    make_checkpoint(tmp_path / "q", "qwen3_5")
    with pytest.raises(
        UnsupportedError, match="qwen3_5_mtp.*recognised but refused.*linear-attention"
    ):
        _engine(tmp_path / "q")


@pytest.mark.parametrize("layout", ["mimo", "deepseek"])
def test_more_depths_than_composed_is_refused(tmp_path, layout):
    make_checkpoint(tmp_path / "d", layout, depths=2)
    with pytest.raises(UnsupportedError, match="publishes 2 MTP depths.*composes 1"):
        _engine(tmp_path / "d")


def test_config_publishing_more_depths_than_keys_is_refused(tmp_path):
    make_checkpoint(tmp_path / "d", "mimo", depths=1, config_depths=2)
    with pytest.raises(UnsupportedError, match="num_nextn_predict_layers=2"):
        _engine(tmp_path / "d")


@pytest.mark.parametrize(
    "key",
    [
        "model.mtp_layers.0.input_proj.weight",
        "model.mtp_layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ],
)
def test_missing_tensor_is_refused_by_name(tmp_path, key):
    make_checkpoint(tmp_path / "m", "mimo", drop=key)
    with pytest.raises(InputError, match=f"checkpoint tensor {key}: got 'missing'"):
        _engine(tmp_path / "m")


@pytest.mark.parametrize(
    "key", ["model.layers.2.eh_proj.weight", "model.layers.0.mlp.down_proj.weight"]
)
def test_shape_mismatch_is_refused_by_name(tmp_path, key):
    make_checkpoint(tmp_path / "s", "deepseek", reshape=key)
    with pytest.raises(
        InputError, match=rf"checkpoint tensor {key}: got \(\d+, \d+\), expected shape"
    ):
        _engine(tmp_path / "s")


def test_checkpoint_without_head(tmp_path):
    make_checkpoint(tmp_path / "n", "mimo", depths=0)
    with pytest.raises(UnsupportedError, match="no MTP head"):
        _engine(tmp_path / "n")
    assert _engine(tmp_path / "n", speculative=False).loaded.draft is None
    make_checkpoint(tmp_path / "c", "mimo", depths=0, config_depths=1)
    with pytest.raises(InputError, match="num_nextn_predict_layers"):
        _engine(tmp_path / "c")


def test_fingerprint_tracks_file_contents(tmp_path):
    make_checkpoint(tmp_path / "a", "mimo", seed=1)
    make_checkpoint(tmp_path / "b", "mimo", seed=1)
    make_checkpoint(tmp_path / "c", "mimo", seed=2)
    fa, fb, fc = (_engine(tmp_path / n).compatibility()["model"]["fingerprint"] for n in "abc")
    assert fa == fb != fc
