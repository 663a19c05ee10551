"""Shape presets with seeded random weights (clearly random: for cost work, not for text).

This module owns :data:`PRESETS` (HF-style config dictionaries of public shapes plus an MTP head
in a registered family's key layout) and :class:`RandomSource`, a tensor source that produces
every weight from ``(seed, key)`` alone, so a preset's weights do not depend on load order.

Initialisation ("imitating draft", so that acceptance is non-trivial although the weights mean
nothing): embeddings ``N(0, 1)``; linear weights ``N(0, init_scale^2 / fan_in)``; norms 1; biases
0; an untied LM head copies the embedding; attention output projections are damped by
``attn_scale`` and MLPs of layers >= 1 by ``deep_scale``, so the target is close to a bigram model
of its first MLP; the MTP head's fusion projection is the identity on its embedding half and its
MLP copies the target's first MLP. The tiny preset then accepts roughly 40% of drafts at w=3
with varied output; ``attn_scale -> 0`` approaches 100%.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from speccal.runner.draft_families import DraftFamily

_QWEN3_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False}


@dataclass(frozen=True)
class Preset:
    """A named shape with random weights."""

    name: str
    description: str
    config: dict[str, Any]
    family: str = "mimo_mtp"
    init_scale: float = 3.0
    attn_scale: float = 0.05
    deep_scale: float = 0.3
    default_dtype: str = "float32"


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        description="2-layer toy decoder (hidden 64, vocab 512) for CPU tests; runs in seconds",
        config={
            **_QWEN3_COMMON,
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "qk_norm": True,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
            "eos_token_id": 2,
            "num_nextn_predict_layers": 1,
        },
    ),
    "dense-0.5b": Preset(
        name="dense-0.5b",
        description="Qwen2.5-0.5B shapes (24 layers, hidden 896, GQA 14/2, qkv bias, tied)",
        config={
            **_QWEN3_COMMON,
            "attention_bias": True,
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
            "eos_token_id": 151643,
            "num_nextn_predict_layers": 1,
        },
        default_dtype="bfloat16",
    ),
    "dense-2b": Preset(
        name="dense-2b",
        description="Qwen3-1.7B shapes (28 layers, hidden 2048, GQA 16/8, q/k norm, tied; ~2B with MTP)",
        config={
            **_QWEN3_COMMON,
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "qk_norm": True,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
            "eos_token_id": 151645,
            "num_nextn_predict_layers": 1,
        },
        default_dtype="bfloat16",
    ),
    "mimo-7b": Preset(
        name="mimo-7b",
        description="MiMo-7B-Base shapes (36 layers, hidden 4096, GQA 32/8, qkv bias, untied, 1 MTP layer)",
        config={
            **_QWEN3_COMMON,
            "attention_bias": True,
            "vocab_size": 151680,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_theta": 640000.0,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "eos_token_id": 151643,
            "num_nextn_predict_layers": 1,
        },
        default_dtype="bfloat16",
    ),
}


# Routed mixture-of-experts shapes (speccal.runner.moe) with multi-head latent attention
# (speccal.runner.mla): DeepSeek-V2-Lite's published config.json (Moonlight-16B-A3B has the same
# layout with a 163840-token vocabulary and sigmoid routing), plus one MTP layer in the
# DeepSeek-V3 key layout (``deepseek_mtp``: ``model.layers.27.{enorm, hnorm, eh_proj,
# shared_head.*, embed_tokens}`` and a routed decoder layer). Softmax top-6 of 64 routed experts
# (``topk_method`` greedy, not renormalised), 2 shared experts, layer 0 dense.
_MOE_16B_A3B = {
    "model_type": "deepseek_v2",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,  # layer 0's dense MLP
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "num_nextn_predict_layers": 1,
}

#: The fields ``moe-tiny`` shrinks (every other key, the routing and attention layout, is
#: ``moe-16b-a3b``'s): 3 layers (layer 0 dense), hidden 64, 16 experts of width 32, top 4.
MOE_TINY_SIZES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

PRESETS["moe-16b-a3b"] = Preset(
    name="moe-16b-a3b",
    description="DeepSeek-V2-Lite shapes (27 layers, hidden 2048, MLA: kv_lora_rank 512, "
    "rope 64 + nope 128, v 128, no q LoRA; 64 routed experts top-6 of width 1408 + 2 shared, "
    "layer 0 dense; vocab 102400; ~16B, ~2.7B active) + 1 DeepSeek MTP layer (routed)",
    config=_MOE_16B_A3B,
    family="deepseek_mtp",
    default_dtype="bfloat16",
)
PRESETS["moe-tiny"] = Preset(
    name="moe-tiny",
    description="moe-16b-a3b shrunk for CPU tests (3 layers, hidden 64, MLA, 16 routed "
    "experts top-4 + 2 shared, layer 0 dense, vocab 512, 1 routed DeepSeek MTP layer)",
    config={**_MOE_16B_A3B, **MOE_TINY_SIZES},
    family="deepseek_mtp",
)


# Hybrid linear-attention shapes (speccal.runner.hybrid), served by the Engine through
# loader.load_model (a separate registry: they build a HybridModel, not a TargetModel). Text stacks of the public Qwen3.5 checkpoints (the vision
# tower is not modelled), from transformers' Qwen3_5TextConfig fields and the models' configs;
# with the 15-tensor MTP head and the vision tower they reproduce the InfiniLM seed's measured
# tensor counts (488 / 632) and, to within 2,592 parameters common to both, their bytes.
_QWEN3_5_COMMON = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "vocab_size": 248320,
    "num_hidden_layers": 24,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # x 6, see _qwen3_5
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "mtp_num_hidden_layers": 1,
}


def _qwen3_5(**fields: Any) -> dict[str, Any]:
    cfg = {**_QWEN3_5_COMMON, **fields}
    cfg["layer_types"] = list(_QWEN3_5_COMMON["layer_types"]) * (cfg["num_hidden_layers"] // 4)
    return cfg


HYBRID_PRESETS: dict[str, Preset] = {
    "qwen3.5-0.8b": Preset(
        name="qwen3.5-0.8b",
        description="Qwen3.5-0.8B text shapes (24 layers = 6 x [3 gated delta-net + 1 gated "
        "attention], hidden 1024, GQA 8/2 x 256, delta-net 16/16 x 128, tied, 1 MTP layer)",
        config=_qwen3_5(hidden_size=1024, intermediate_size=3584),
        family="qwen3_5_mtp",
        attn_scale=0.03,  # w = 3, seed 0, CPU fp32: 64% of drafts accepted (partial and full)
        deep_scale=0.2,
        default_dtype="bfloat16",
    ),
    "qwen3.5-2b": Preset(
        name="qwen3.5-2b",
        description="Qwen3.5-2B text shapes (24 layers = 6 x [3 gated delta-net + 1 gated "
        "attention], hidden 2048, GQA 8/2 x 256, delta-net 16/16 x 128, tied, 1 MTP layer)",
        config=_qwen3_5(hidden_size=2048, intermediate_size=6144),
        family="qwen3_5_mtp",
        attn_scale=0.03,
        deep_scale=0.2,
        default_dtype="bfloat16",
    ),
}


class HybridRandomSource:
    """Seeded random weights for a hybrid target and its head, each tensor from ``(seed, key)``.

    Zero-centred norms 0 (identity), the gated norm 1, ``A_log = log(uniform(1, 16))``,
    ``dt_bias`` 1 (transformers' initialisation), embeddings ``N(0, 1)``, every other weight
    ``N(0, init_scale^2 / fan_in)`` (conv kernels: fan-in = kernel width). The "imitating
    draft" of :class:`RandomSource`, so that acceptance is non-trivial: token-mixer output
    projections (``o_proj``, ``linear_attn.out_proj``) damped by ``attn_scale`` and the MLPs of
    layers >= 1 by ``deep_scale`` (the target is close to a bigram model of its first MLP);
    the head's fusion projection is the identity on its embedding half and its MLP copies the
    target's first MLP (``family``: the head's key layout; None: no head keys expected).
    """

    def __init__(self, preset: Preset, shapes: dict[str, tuple[int, ...]], seed: int,
                 family: DraftFamily | None = None, num_target_layers: int = 0):
        self.preset = preset
        self.shapes = shapes
        self.seed = seed
        self.family = family
        self.num_target_layers = num_target_layers

    def keys(self) -> list[str]:
        return sorted(self.shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key]

    def _generator(self, key: str, device: torch.device) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))
        return g

    def _randn(self, key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        # drawn on the target device, as RandomSource does: a 2B-shape target's weights drawn
        # on the host took 26 s of a 48 s cold engine build on the H200 (bench/RESULTS.md)
        return torch.randn(shape, generator=self._generator(key, device), device=device)

    def get(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if torch.device(device).type == "meta":  # shapes only (a full-size layout check)
            return torch.empty(shape, dtype=dtype, device="meta")
        device = torch.device(device)
        p = self.preset
        fam = self.family
        is_draft = fam is not None and fam.is_draft_key(key, self.num_target_layers)
        m = None if is_draft else re.search(r"layers\.(\d+)\.", key)
        layer = int(m.group(1)) if m else 0
        fan_in = shape[-1] if len(shape) > 1 else 1
        scale = p.init_scale / fan_in**0.5
        if key.endswith("linear_attn.norm.weight"):
            out = torch.ones(shape, device=device)
        elif "norm" in key.rsplit(".", 2)[-2]:
            out = torch.zeros(shape, device=device)
        elif key.endswith("A_log"):
            out = torch.empty(shape, device=device).uniform_(
                1.0, 16.0, generator=self._generator(key, device)).log()
        elif key.endswith("dt_bias"):
            out = torch.ones(shape, device=device)
        elif key.endswith("embed_tokens.weight"):
            out = self._randn(key, shape, device)
        elif is_draft and key == fam.key_for(f"{fam.proj}.weight", self.num_target_layers):
            h = shape[0]
            out = self._randn(key, shape, device) * (0.02 / shape[1] ** 0.5)
            half = slice(0, h) if fam.concat_order[0] == "embed" else slice(h, 2 * h)
            out[:, half] += torch.eye(h, device=device)
        elif is_draft and ".mlp." in key:  # the head's MLP copies the target's first MLP
            out = self._randn("model.layers.0.mlp." + key.split(".mlp.", 1)[1], shape, device) * scale
        else:
            if key.endswith(("o_proj.weight", "linear_attn.out_proj.weight")):
                scale *= p.attn_scale
            if not is_draft and layer >= 1 and ".mlp." in key:
                scale *= p.deep_scale
            out = self._randn(key, shape, device) * scale
        return out.to(device=device, dtype=dtype)


class RandomSource:
    """Seeded random weights for a preset: each tensor depends only on ``(seed, key)``."""

    def __init__(
        self,
        preset: Preset,
        shapes: dict[str, tuple[int, ...]],
        seed: int,
        family: DraftFamily,
        num_target_layers: int,
    ):
        self.preset = preset
        self.shapes = shapes
        self.seed = seed
        self.family = family
        self.num_target_layers = num_target_layers

    def keys(self) -> list[str]:
        return sorted(self.shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key]

    def _randn(self, key: str, shape, device: torch.device) -> torch.Tensor:
        g = torch.Generator(device=device)
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32)

    def get(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        p = self.preset
        is_draft = self.family.is_draft_key(key, self.num_target_layers)
        stem = key.rsplit(".", 2)[-2] if key.count(".") >= 1 else key
        m = None if is_draft else re.search(r"layers\.(\d+)\.", key)
        layer = int(m.group(1)) if m else 0
        if "norm" in stem:
            out = torch.ones(shape, device=device)
        elif key.endswith(".bias"):
            out = torch.zeros(shape, device=device)
        elif key.endswith("embed_tokens.weight") or key.endswith("head.weight"):
            out = self._randn("model.embed_tokens.weight", shape, device)
        elif is_draft and key.endswith(f"{self.family.proj}.weight"):
            h = shape[0]
            out = self._randn(key, shape, device) * (0.02 / shape[1] ** 0.5)
            eye = torch.eye(h, device=device)
            if self.family.concat_order[0] == "embed":
                out[:, :h] += eye
            else:
                out[:, h:] += eye
        elif is_draft and ".mlp." in key:
            # The head's MLP copies the target's first MLP: the draft imitates the target.
            out = self._randn("model.layers.0.mlp." + key.split(".mlp.")[1], shape, device)
            out = out * (p.init_scale / shape[1] ** 0.5)
        else:
            scale = p.init_scale / shape[1] ** 0.5
            if key.endswith("o_proj.weight"):
                scale *= p.attn_scale
            if not is_draft and layer >= 1 and ".mlp." in key:
                scale *= p.deep_scale
            out = self._randn(key, shape, device) * scale
        return out.to(dtype)
