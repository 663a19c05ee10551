"""Sliding-window layers shaped apart from the full-attention ones (no torch).

This module owns :class:`SlidingAttention` (which layers are ``sliding_attention`` layers, their
KV head count, whether they add a learned per-head sink logit to the softmax, and their window)
and :data:`SLIDING_FAMILIES`, one descriptor per transformers ``model_type`` whose *class*
builds its sliding layers differently from its full ones (facts the config does not carry).
``speccal.runner.config`` parses it into ``ModelConfig.swa``; ``speccal.runner.layers`` builds
the attention from it.

MiMo-V2-Flash (transformers 5 ``models/mimo_v2_flash``, the reference): a ``sliding_attention``
layer has twice ``num_key_value_heads`` KV heads and a ``[num_attention_heads]`` sink logit
(``self_attn.attention_sink_bias`` in the checkpoint, ``sinks`` in the module) that joins each
query row's softmax denominator and is dropped from its weights; every layer caches values of
``v_head_dim`` channels and scales them by ``attention_value_scale``; each layer type has its
own ``rope_parameters`` entry (``speccal.runner.config.ModelConfig.sliding_rope``). The hub's
own config keys (``swa_num_key_value_heads``, ``hybrid_layer_pattern``, ...) are not read by
transformers' class: where present they must describe what the class builds
(:func:`hub_key_expectations`), else they are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from speccal.base.errors import InputError, UnsupportedError

#: the checkpoint stem of a layer's sink logits (transformers' ``self_attn.sinks``)
SINK_STEM = "self_attn.attention_sink_bias"


@dataclass(frozen=True)
class SlidingFamily:
    """What one transformers ``model_type`` fixes in its classes about its sliding layers.

    Attributes
    ----------
    model_type : str
    kv_head_factor : int
        A sliding layer has ``kv_head_factor * num_key_value_heads`` KV heads.
    has_sinks : bool
        Sliding layers carry a per-head sink logit (:data:`SINK_STEM`).
    """

    model_type: str
    kv_head_factor: int = 1
    has_sinks: bool = False


SLIDING_FAMILIES: dict[str, SlidingFamily] = {
    "mimo_v2_flash": SlidingFamily("mimo_v2_flash", kv_head_factor=2, has_sinks=True),
}

#: hub config keys of MiMo-V2-Flash that transformers' class does not read (checked instead)
HUB_KEYS = ("swa_num_key_value_heads", "swa_num_attention_heads", "swa_head_dim",
            "swa_v_head_dim", "add_swa_attention_sink_bias", "add_full_attention_sink_bias",
            "hybrid_layer_pattern", "sliding_window_size", "layernorm_epsilon",
            "rope_theta", "swa_rope_theta", "partial_rotary_factor")


@dataclass(frozen=True)
class SlidingAttention:
    """The attention of a target's ``sliding_attention`` layers where it differs from the
    full-attention layers'.

    Attributes
    ----------
    layers : tuple of int
        The sliding layers (``layer_types``); they keep this shape (and RoPE) even where the
        engine's context drops their window (``ModelConfig.for_context``).
    num_kv_heads : int
        KV heads of a sliding layer.
    has_sinks : bool
        A learned per-head logit joins each row's softmax denominator (no value).
    window : int
        ``sliding_window`` (the MTP head's sliding layer reads it); 0 where the engine's
        context fits in it (``ModelConfig.for_context``).
    """

    layers: tuple[int, ...]
    num_kv_heads: int
    has_sinks: bool
    window: int

    def __post_init__(self) -> None:
        if isinstance(self.num_kv_heads, bool) or not isinstance(self.num_kv_heads, int) \
                or self.num_kv_heads < 1:
            raise InputError("sliding layers' num_key_value_heads", self.num_kv_heads,
                             "an integer >= 1")


def sliding_family(cfg: Mapping[str, Any]) -> SlidingFamily | None:
    """The :data:`SLIDING_FAMILIES` descriptor of ``cfg``'s ``model_type``, or None."""
    return SLIDING_FAMILIES.get(cfg.get("model_type"))


def sliding_from_hf(cfg: Mapping[str, Any], family: SlidingFamily, layer_types: Sequence[str],
                    num_kv_heads: int) -> SlidingAttention:
    """The :class:`SlidingAttention` of a :data:`SLIDING_FAMILIES` config.

    Raises
    ------
    InputError
        No ``layer_types`` (transformers writes them; its class's default pattern is not
        guessed), or no integer ``sliding_window`` >= 1 (the class always has one).
    """
    if not layer_types:
        raise InputError("config.json:layer_types", None,
                         f"a list of layer types (model_type {family.model_type!r}: "
                         "transformers' save_pretrained writes it; the runner does not guess "
                         "the class's default pattern)")
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InputError("config.json:sliding_window", window,
                         f"an integer >= 1 (model_type {family.model_type!r} always has a "
                         "window for its sliding_attention layers)")
    return SlidingAttention(
        layers=tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention"),
        num_kv_heads=family.kv_head_factor * num_kv_heads,
        has_sinks=family.has_sinks,
        window=window,
    )


def hub_key_expectations(swa: SlidingAttention, *, num_layers: int,
                         num_heads: int, head_dim: int, v_head_dim: int, rms_norm_eps: float,
                         full_rope: tuple[float, float], sliding_rope: tuple[float, float]
                         ) -> dict[str, Any]:
    """Each :data:`HUB_KEYS` key -> the value that describes what transformers' class builds
    (``*_rope``: ``(theta, partial_rotary_factor)`` of each layer type)."""
    sliding = set(swa.layers)
    return {
        "swa_num_key_value_heads": swa.num_kv_heads,
        "swa_num_attention_heads": num_heads,
        "swa_head_dim": head_dim,
        "swa_v_head_dim": v_head_dim,
        "add_swa_attention_sink_bias": swa.has_sinks,
        "add_full_attention_sink_bias": False,
        "hybrid_layer_pattern": [int(i in sliding) for i in range(num_layers)],
        "sliding_window_size": swa.window - 1,  # transformers: sliding_window = size + 1
        "layernorm_epsilon": rms_norm_eps,
        "rope_theta": full_rope[0],
        "swa_rope_theta": sliding_rope[0],
        "partial_rotary_factor": full_rope[1],
    }


def check_hub_keys(cfg: Mapping[str, Any], expected: Mapping[str, Any], model_type: str) -> None:
    """Refuse a hub key (:data:`HUB_KEYS`) that describes another model than the one
    transformers' class builds from the rest of the config.

    Raises
    ------
    UnsupportedError
        Naming the key, its value and the value expected.
    """
    for key, want in expected.items():
        got = cfg.get(key)
        if got is None or got == want:
            continue
        raise UnsupportedError(
            f"config.json:{key}={got!r}: transformers' {model_type} class does not read this "
            f"key and builds {want!r} from the rest of the config (layer_types, "
            "num_key_value_heads, head_dim, v_head_dim, sliding_window, rope_parameters, "
            f"rms_norm_eps); expected {want!r} or no such key")
