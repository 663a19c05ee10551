"""The dense decoder's configuration, read from a Hugging Face ``config.json`` dictionary.

This module owns :class:`ModelConfig` (a frozen dataclass the model modules are built from) and
its parsing from HF configs of the Llama / Mistral / Qwen2 / Qwen3 / MiMo family and of their
routed-expert relatives (Qwen2-MoE, Qwen3-MoE, GLM-4.5 MoE, the DeepSeek-V3 router; the
routing is :class:`~speccal.runner.moe_config.MoEConfig`, parsed there). Structural flags
that HF encodes in the model *class* (q/k/v bias in Qwen2, per-head q/k norm in Qwen3, which
projections ``attention_bias`` puts a bias on) are read from the checkpoint's tensor names when a
``key_names`` set is given, so no code tests a model name; an explicit ``attention_bias`` /
``mlp_bias`` that the tensors contradict is refused.

Strictness (SPEC section 7): every config feature that changes the computation is implemented or
refused naming its key. Sliding-window attention is implemented (:func:`layer_windows`: the
``layer_types`` / ``use_sliding_window`` + ``max_window_layers`` / Mistral-style rules of
transformers); the keys of :data:`UNIMPLEMENTED_KEYS` (soft-capping, MLA, multipliers ...) are
refused when set to anything but their neutral value, and tensors of unimplemented features
(:data:`UNIMPLEMENTED_STEMS`: attention sinks) by their name; integer fields of a wrong JSON type
are refused naming key, value and the type expected. Per-layer-type ``rope_parameters``
(MiMo-V2-Flash) are one RoPE when the layer types in use share one entry, and
``attention_value_scale`` scales the attention values (:attr:`ModelConfig.value_scale`).

RoPE: ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5) are both read
into one :class:`RopeConfig`; supported types are ``default``, ``linear``, ``dynamic`` (NTK),
``llama3`` and ``yarn`` (see ``speccal.runner.rope``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from speccal.base.errors import InputError, UnsupportedError
from speccal.runner.mla_config import (
    MLA_KEYS,
    MLAConfig,
    is_mla_config,
    mla_family,
    mla_from_hf,
)
from speccal.runner.moe_config import MoEConfig, expert_count, moe_config_from_hf
from speccal.runner.swa_config import (
    HUB_KEYS,
    SINK_STEM,
    SlidingAttention,
    check_hub_keys,
    hub_key_expectations,
    sliding_family,
    sliding_from_hf,
)

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``params`` holds the type-specific scaling fields."""

    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and structural flags of a dense decoder-only target.

    Attributes
    ----------
    vocab_size, hidden_size, intermediate_size, num_hidden_layers : int
    num_attention_heads, num_key_value_heads, head_dim : int
        GQA: ``num_attention_heads`` query heads share ``num_key_value_heads`` KV heads.
    rms_norm_eps : float
    rope : RopeConfig
    max_position_embeddings : int
    tie_word_embeddings : bool
        The LM head reuses ``embed_tokens.weight``.
    is_qkv_bias : bool
        q/k/v projections carry a bias (Qwen2, MiMo; ``attention_bias`` of Llama / Qwen3).
    is_o_bias : bool
        The attention output projection carries a bias (``attention_bias`` of Llama / Qwen3).
    is_mlp_bias : bool
        gate / up / down projections carry a bias (``mlp_bias`` of Llama).
    sliding_windows : tuple of int
        Per layer, the attention window (a query at position ``p`` sees keys ``p - W + 1 .. p``,
        transformers' ``sliding_window``) or 0 for full attention; empty: every layer full.
    is_qk_norm : bool
        Per-head RMSNorm on q and k before RoPE (Qwen3).
    eos_token_ids : tuple of int
    architecture : str
        ``architectures[0]`` of the HF config (identity only, never branched on).
    num_mtp_depths : int
        MTP depths the config publishes (``num_nextn_predict_layers`` or similar), 0 when none.
    mla : MLAConfig or None
        Multi-head latent attention (``speccal.runner.mla``) in every layer, with its DSA
        indexer when set; then ``head_dim`` is ``qk_rope_head_dim`` (the rotary table's width)
        and the KV heads fields are unused.
    moe : MoEConfig or None
        The routed-expert MLP and the layers that have it (``speccal.runner.moe_config``);
        the other layers have the dense SwiGLU of ``intermediate_size``.
    value_scale : float
        Multiplies the attention values before they are cached (MiMo-V2-Flash's
        ``attention_value_scale``); 1: none.
    v_head_dim : int
        Channels of a value head (MiMo-V2-Flash's ``v_head_dim``); 0: ``head_dim``.
    swa : SlidingAttention or None
        The sliding layers' own KV head count and sink logits
        (``speccal.runner.swa_config``); None: shaped as the full-attention layers.
    sliding_rope : RopeConfig or None
        The ``sliding_attention`` entry of a per-layer-type ``rope_parameters`` where it differs
        from ``rope`` (the ``full_attention`` entry); None: one RoPE.
    extra : mapping
        The raw HF config, for draft-family recognition.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    is_qkv_bias: bool = False
    is_o_bias: bool = False
    is_mlp_bias: bool = False
    is_qk_norm: bool = False
    sliding_windows: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "DenseDecoder"
    num_mtp_depths: int = 0
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    value_scale: float = 1.0
    v_head_dim: int = 0
    swa: SlidingAttention | None = None
    sliding_rope: RopeConfig | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 0:
            raise InputError("config.intermediate_size", self.intermediate_size,
                             "an integer >= 1 (0: no dense MLP, a routed-expert target)")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"config.{name}", value, "an integer >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InputError(
                "config.num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads={self.num_attention_heads}",
            )
        for rope in (self.rope, self.sliding_rope):
            if rope is not None and rope.rope_type not in ROPE_TYPES:
                raise UnsupportedError(
                    f"rope_scaling type {rope.rope_type!r} is not supported "
                    f"(supported: {', '.join(ROPE_TYPES)})"
                )
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise InputError("config.sliding_windows", len(self.sliding_windows),
                             f"{self.num_hidden_layers} entries (one per layer) or none")
        if isinstance(self.v_head_dim, bool) or not isinstance(self.v_head_dim, int) \
                or self.v_head_dim < 0:
            raise InputError("config.v_head_dim", self.v_head_dim, "an integer >= 1 (0: head_dim)")
        if self.swa is not None:
            if self.num_attention_heads % self.swa.num_kv_heads:
                raise InputError("config.swa_num_key_value_heads", self.swa.num_kv_heads,
                                 f"a divisor of num_attention_heads={self.num_attention_heads}")
            if any(not 0 <= i < self.num_hidden_layers for i in self.swa.layers):
                raise InputError("config.swa.layers", self.swa.layers,
                                 f"layer indices below num_hidden_layers={self.num_hidden_layers}")
        dense = self.dense_mlp_layers()
        if dense and self.intermediate_size < 1 and self.moe is not None:
            raise InputError("config.json:intermediate_size", None,
                             f"a value: layers {dense} have a dense SwiGLU MLP")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the routed-expert one."""
        return self.moe is not None and self.moe.is_sparse(layer)

    def dense_mlp_layers(self) -> list[int]:
        """Indices of the layers whose MLP is the dense SwiGLU (not routed experts)."""
        return [i for i in range(self.num_hidden_layers) if not self.is_sparse(i)]

    @property
    def value_dim(self) -> int:
        """Channels of a value head (``v_head_dim``, else ``head_dim``)."""
        return self.v_head_dim or self.head_dim

    def is_swa(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding layer with its own shape (:attr:`swa`)."""
        return self.swa is not None and layer in self.swa.layers

    def kv_heads(self, layer: int) -> int:
        """KV heads of ``layer``'s attention."""
        return self.swa.num_kv_heads if self.is_swa(layer) else self.num_key_value_heads

    def has_sinks(self, layer: int) -> bool:
        """Whether ``layer``'s softmax has a learned per-head sink logit."""
        return self.is_swa(layer) and self.swa.has_sinks

    def rope_for(self, layer: int) -> RopeConfig:
        """The RoPE of ``layer`` (:attr:`sliding_rope` for a sliding layer that has one)."""
        return self.sliding_rope if self.is_swa(layer) and self.sliding_rope else self.rope

    def kv_cache_dims(self, num_kv_heads: int, layer: int | None = None) -> tuple[int, int, int]:
        """``(heads, k channels, v channels)`` of one layer's paged cache: GQA caches
        ``num_kv_heads`` heads of K and ``value_dim`` channels of V (a sliding layer of
        :attr:`swa`, when ``layer`` names one, its own head count); MLA one head of
        ``[latent | k_rope]`` as K and the DSA indexer's key as V (no channels without an
        indexer): ``speccal.runner.mla``."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, self.mla.index_dim_of(layer)
        heads = self.swa.num_kv_heads if layer is not None and self.is_swa(layer) else num_kv_heads
        return heads, self.head_dim, self.value_dim

    def window(self, layer: int) -> int:
        """The attention window of ``layer`` (0: full attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def for_context(self, max_model_len: int) -> ModelConfig:
        """This config for an engine of ``max_model_len`` positions: a window that holds every
        position (``W >= max_model_len``) attends as full attention, so it is dropped (the
        served paths that cannot mask a window then accept the config; :attr:`swa` keeps its
        layers' shape and sinks, its ``window`` 0)."""
        windows = tuple(0 if w >= max_model_len else w for w in self.sliding_windows)
        if not any(windows):
            windows = ()
        swa = self.swa
        if swa is not None and swa.window >= max_model_len:
            swa = replace(swa, window=0)
        if windows == self.sliding_windows and swa == self.swa:
            return self
        return replace(self, sliding_windows=windows, swa=swa)


# MTP depth fields published by the families speccal knows (data, read by draft_families too).
MTP_DEPTH_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")

_NEUTRAL_SCALE = (None, 1, 1.0)

#: Config keys some transformers family reads that change the computation and that the runner
#: does not implement: key -> (the neutral values, accepted; what the key does). A key absent or
#: neutral is accepted; any other value is refused naming the key.
UNIMPLEMENTED_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "attn_logit_softcapping": ((None,), "attention logit soft-capping"),
    "final_logit_softcapping": ((None,), "final logit soft-capping"),
    "query_pre_attn_scalar": ((None,), "a query scale other than head_dim ** -0.5"),
    "attention_multiplier": (_NEUTRAL_SCALE, "a query-scale multiplier"),
    "embedding_multiplier": (_NEUTRAL_SCALE, "an embedding multiplier"),
    "residual_multiplier": (_NEUTRAL_SCALE, "a residual-branch multiplier"),
    "logits_scaling": (_NEUTRAL_SCALE, "a logit divisor"),
    "scale_emb": (_NEUTRAL_SCALE, "an embedding scale"),
    "scale_depth": ((None,), "depth-scaled residual branches"),
    "kv_lora_rank": ((None,), "multi-head latent attention (MLA)"),
    "q_lora_rank": ((None,), "multi-head latent attention (MLA)"),
    "attention_chunk_size": ((None,), "chunked local attention"),
    # true with q_norm / k_norm weights (GLM-4.5): the per-head RMSNorm, read from the tensors
    "use_qk_norm": ((None, False), "L2 q/k norm without weights (Llama 4)"),
    "clip_qkv": ((None,), "q/k/v clipping"),
    "rope_interleave": ((None, False), "interleaved (GPT-J) rotary"),
    "use_bidirectional_attention": ((None, False), "bidirectional attention"),
    "dual_chunk_attention_config": ((None,), "dual chunk attention"),
    # MiMo-V2-Flash's hub form: read for model_types of swa_config.SLIDING_FAMILIES (checked
    # against what transformers' class builds), refused elsewhere
    "add_swa_attention_sink_bias": ((None, False), "attention sinks"),
    "add_full_attention_sink_bias": ((None, False), "attention sinks"),
    "swa_num_key_value_heads": ((None,), "sliding-window layers with their own KV head count"),
    "hybrid_layer_pattern": ((None,), "a hybrid attention pattern (expected layer_types)"),
}

#: per-layer tensor stems (any target layer) of features the runner does not implement, refused
#: before the shapes are checked; any other unknown tensor is refused by the strict loader as
#: unconsumed. Sinks are implemented for the model_types of swa_config.SLIDING_FAMILIES (whose
#: class places them: MiMo-V2-Flash's sliding layers), refused in any other
UNIMPLEMENTED_STEMS: dict[str, str] = {
    SINK_STEM: "attention sinks (a learned per-head logit in the softmax) outside a "
               "model_type whose sliding layers have them (speccal.runner.swa_config."
               "SLIDING_FAMILIES)",
}

_MISSING = object()


def _structure(allow_hybrid: bool, is_moe: bool = False) -> str:
    if allow_hybrid:
        return "a hybrid linear-attention target"
    return "a routed-expert attention decoder" if is_moe else "a dense attention decoder"


def _require(cfg: Mapping[str, Any], name: str, structure: str) -> Any:
    if name not in cfg or cfg[name] is None:
        arch = (cfg.get("architectures") or [None])[0]
        raise InputError(
            f"config.json:{name}",
            None,
            f"a value (required for {structure}; this config is architecture {arch!r}, "
            f"model_type {cfg.get('model_type')!r})",
        )
    return cfg[name]


def _int(cfg: Mapping[str, Any], name: str, structure: str, default: Any = _MISSING) -> int:
    """The integer field ``name`` (a JSON integer: not a bool, string or float)."""
    if default is not _MISSING and cfg.get(name) is None:
        return default
    value = _require(cfg, name, structure)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"config.json:{name}", value, "an integer")
    return value


def _float(cfg: Mapping[str, Any], name: str, default: float) -> float:
    value = cfg.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"config.json:{name}", value, "a number")
    return float(value)


def _bool(cfg: Mapping[str, Any], name: str) -> bool | None:
    """``cfg[name]`` as a bool, None when absent or null."""
    value = cfg.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise InputError(f"config.json:{name}", value, "true or false")
    return value


def _ropes_from_hf(cfg: Mapping[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """The RoPE of the full-attention layers and, where a per-layer-type ``rope_parameters``
    (MiMo-V2-Flash) gives the ``sliding_attention`` layers another, theirs (else None)."""
    raw = cfg.get("rope_parameters") or {}
    if not isinstance(raw, Mapping):
        raise InputError("config.json:rope_parameters", raw, "a mapping of RoPE parameters")
    nested = sorted(k for k, v in raw.items() if isinstance(v, Mapping))
    used = set(cfg.get("layer_types") or ())
    if not nested:
        return _rope_from_hf(cfg, raw, is_per_type=False), None
    known = {"full_attention", "sliding_attention"}
    if len(nested) != len(raw) or not used or not used <= set(nested) or not set(nested) <= known:
        raise UnsupportedError(
            f"config.json:rope_parameters has per-layer-type entries {nested}: one flat mapping, "
            "or one entry per layer type of layer_types (full_attention / sliding_attention) "
            "is supported")
    ropes = {t: _rope_from_hf(cfg, raw[t], is_per_type=True) for t in nested}
    full = ropes.get("full_attention", ropes.get("sliding_attention"))
    sliding = ropes.get("sliding_attention")
    return full, (sliding if sliding != full else None)


def _rope_from_hf(cfg: Mapping[str, Any], raw: Mapping[str, Any], *,
                  is_per_type: bool) -> RopeConfig:
    """One RoPE from a flat parameter mapping (``rope_scaling`` and the top-level
    ``rope_theta`` / ``partial_rotary_factor`` too, unless it is a per-layer-type entry, which
    alone describes its layers as transformers reads it)."""
    params = dict(raw)
    scaling = {} if is_per_type else cfg.get("rope_scaling") or {}
    if not isinstance(scaling, Mapping):
        raise InputError("config.json:rope_scaling", scaling, "a mapping or null")
    if scaling:
        params.update(scaling)
    top = {} if is_per_type else cfg
    theta = float(params.pop("rope_theta", _float(top, "rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = float(top.get("partial_rotary_factor", params.pop("partial_rotary_factor", 1.0)))
    params.pop("partial_rotary_factor", None)
    if rope_type in ("linear", "dynamic", "llama3", "yarn") and "factor" not in params:
        raise InputError(f"rope_scaling.factor ({rope_type})", None, "a scaling factor > 0")
    return RopeConfig(
        theta=theta,
        rope_type=str(rope_type),
        partial_rotary_factor=partial,
        params=tuple(
            sorted(
                (str(k), tuple(v) if isinstance(v, list) else v)
                for k, v in params.items()
                if not isinstance(v, dict)
            )
        ),
    )


def layer_windows(cfg: Mapping[str, Any], num_layers: int, *,
                  is_layer_typed: bool = False) -> tuple[int, ...]:
    """Each layer's attention window (0: full), by transformers' three forms of the keys.

    - ``use_sliding_window`` present (Qwen2 / Qwen3): the window only when it is true.
    - ``layer_types`` present (transformers 5, Qwen2 / Qwen3 / Ministral): the
      ``sliding_attention`` layers use ``sliding_window``, the others attend fully.
    - else ``max_window_layers`` with ``use_sliding_window`` (transformers 4 Qwen2 configs):
      layers from ``max_window_layers`` on; else (Mistral: ``sliding_window`` alone) every layer.

    A config with ``layer_types`` but no sliding layer, a ``sliding_window`` and no
    ``use_sliding_window`` reads one way in Mistral's code (every layer windowed) and the other
    in the layer-typed families' (none): refused rather than guessed, unless ``is_layer_typed``
    (a ``model_type`` whose class applies the window to ``sliding_attention`` layers only:
    ``speccal.runner.swa_config.SLIDING_FAMILIES``).
    """
    window = cfg.get("sliding_window")
    switch = _bool(cfg, "use_sliding_window")
    if "use_sliding_window" in cfg and not switch:
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise InputError("config.json:sliding_window", window, "an integer >= 1 or null")
    layer_types = cfg.get("layer_types")
    if layer_types:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise InputError("config.json:layer_types", layer_types,
                             f"a list of {num_layers} entries (num_hidden_layers)")
        sliding = [t == "sliding_attention" for t in layer_types]
        if any(sliding) and window is None:
            raise InputError("config.json:sliding_window", cfg.get("sliding_window"),
                             "a window (layer_types names sliding_attention layers"
                             + (", and use_sliding_window is false" if switch is False else "")
                             + ")")
        if not any(sliding) and window is not None and switch is None and not is_layer_typed:
            raise UnsupportedError(
                f"config.json:sliding_window={window}: with layer_types naming no "
                "sliding_attention layer and no use_sliding_window key, transformers' families "
                "disagree on whether the window applies (Mistral: every layer; layer-typed "
                "families: none); expected use_sliding_window or a sliding_window of null")
        return tuple(window if s else 0 for s in sliding) if any(sliding) else ()
    if window is None:
        return ()
    if switch:
        first = _int(cfg, "max_window_layers", "a sliding-window config", 0)
        return tuple(window if i >= first else 0 for i in range(num_layers))
    return (window,) * num_layers


def _refuse_unimplemented(cfg: Mapping[str, Any], stems: set[str] | None,
                          implemented: tuple[str, ...] = ()) -> None:
    for key, (neutral, what) in UNIMPLEMENTED_KEYS.items():
        if key == "use_qk_norm" and stems is not None and "self_attn.q_norm.weight" in stems:
            continue  # weighted per-head RMSNorm, read from the tensors (is_qk_norm)
        if key in cfg and cfg[key] not in neutral and key not in implemented:
            raise UnsupportedError(
                f"config.json:{key}={cfg[key]!r}: {what} is not implemented by the runner, "
                f"expected {' or '.join(json_repr(v) for v in neutral)} (or no such key)")
    for stem, what in UNIMPLEMENTED_STEMS.items():
        if stems is not None and stem in stems and stem not in implemented:
            raise UnsupportedError(
                f"checkpoint tensors model.layers.N.{stem}: {what} are not implemented by the "
                "runner, expected no such tensor")
    v_dim, head_dim = cfg.get("v_head_dim"), cfg.get("head_dim")
    if v_dim is not None and v_dim != head_dim and "v_head_dim" not in implemented:
        raise UnsupportedError(
            f"config.json:v_head_dim={v_dim!r}: value heads narrower or wider than the query / "
            f"key heads are not implemented (the paged KV cache has one head_dim), expected "
            f"head_dim={head_dim!r}")
    no_rope = cfg.get("no_rope_layers")
    if no_rope and not all(no_rope):
        raise UnsupportedError(
            f"config.json:no_rope_layers={no_rope!r}: layers without RoPE are not implemented, "
            "expected every entry 1 (or no such key)")


def json_repr(value: Any) -> str:
    """``value`` as it reads in a ``config.json`` (``null``, ``false``, ``1.0``)."""
    if value is None or isinstance(value, bool):
        return {None: "null", False: "false", True: "true"}[value]
    return repr(value)


# checkpoint tensors of a target layer that carry each bias flag (any target layer)
_BIAS_STEMS = {
    "is_qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "is_o_bias": ("self_attn.o_proj.bias",),
    "is_mlp_bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"),
}
_LAYER_KEY = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")


def _target_stems(names: Iterable[str], num_layers: int) -> set[str]:
    """The per-layer stems (``self_attn.q_proj.bias``) of the target layers' tensors."""
    out = set()
    for key in names:
        m = _LAYER_KEY.match(key)
        if m is not None and int(m.group(1)) < num_layers:
            out.add(m.group(2))
    return out


def _bias_flags(cfg: Mapping[str, Any], names: set[str] | None,
                num_layers: int) -> dict[str, bool]:
    """q/k/v, o and MLP bias flags: from the tensors when named, checked against the config.

    Without tensor names (presets) ``attention_bias`` means the q/k/v bias the presets
    describe (the Qwen2 form) and ``mlp_bias`` the MLP's. With them, the projections that have
    a bias tensor are the ones that carry one (Qwen2 has q/k/v bias and no key; Llama / Qwen3
    ``attention_bias`` puts one on q/k/v/o; MiMo's configs say ``attention_bias`` with q/k/v
    only), and the config's explicit keys must agree: ``false`` with bias tensors present
    (transformers would build no bias and drop them) or ``true`` with none is refused.
    """
    attn, mlp = _bool(cfg, "attention_bias"), _bool(cfg, "mlp_bias")
    if names is None:
        return {"is_qkv_bias": bool(attn), "is_o_bias": False, "is_mlp_bias": bool(mlp)}
    stems = _target_stems(names, num_layers)
    flags = {flag: any(s in stems for s in group) for flag, group in _BIAS_STEMS.items()}
    for key, value, groups in (("attention_bias", attn, ("is_qkv_bias", "is_o_bias")),
                               ("mlp_bias", mlp, ("is_mlp_bias",))):
        present = sorted(s for g in groups for s in _BIAS_STEMS[g] if s in stems)
        if value is False and present:
            raise InputError(
                f"config.json:{key}", False,
                f"true for a checkpoint with bias tensors ({', '.join(present)} in its layers; "
                "transformers builds no bias under false and drops them)")
        if value is True and not present:
            want = _BIAS_STEMS[groups[0]][0]
            raise InputError(
                f"config.json:{key}", True,
                f"false for a checkpoint without bias tensors (no model.layers.N.{want})")
    return flags


def config_from_hf(
    cfg: Mapping[str, Any],
    key_names: Iterable[str] | None = None,
    *,
    allow_hybrid: bool = False,
) -> ModelConfig:
    """Build a :class:`ModelConfig` from an HF ``config.json`` dictionary.

    Parameters
    ----------
    cfg : mapping
        The parsed ``config.json``; a nested ``text_config`` is used when present.
    key_names : iterable of str, optional
        Tensor names of the checkpoint; when given, the q/k/v, o and MLP biases and the q/k
        norm are read from them (:func:`_bias_flags` checks them against ``attention_bias`` /
        ``mlp_bias``).
    allow_hybrid : bool
        Parse the shared fields of a hybrid linear-attention / MoE config (``speccal.runner.hybrid``
        reads the rest, ``hybrid_config_from_hf``) instead of refusing it. The dense decoder
        keeps the default (refuse); the loader sends configs whose ``layer_types`` name
        ``linear_attention`` to the hybrid parser (``speccal.runner.hybrid.is_hybrid_config``).
            A config whose every MLP is routed needs no ``intermediate_size`` (0: no dense MLP).

    Raises
    ------
    InputError
        A missing or invalid field (a wrong JSON type included), naming it.
    UnsupportedError
        A structure or feature the runner does not implement (non-SiLU MLP, a routing feature
        of ``speccal.runner.moe_config``, linear attention, a :data:`UNIMPLEMENTED_KEYS` key or
        :data:`UNIMPLEMENTED_STEMS` tensor), naming the key.
    """
    if not isinstance(cfg, Mapping):
        raise InputError("config.json", type(cfg).__name__, "a JSON object")
    if "text_config" in cfg and isinstance(cfg["text_config"], Mapping):
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    structure = _structure(allow_hybrid, expert_count(cfg) is not None)
    family = mla_family(cfg) if is_mla_config(cfg) and not allow_hybrid else None
    for act_key in ("hidden_act", "hidden_activation"):
        act = cfg.get(act_key)
        if act is not None and act not in ("silu", "swish"):
            raise UnsupportedError(
                f"config.json:{act_key}={act!r}: only SwiGLU (silu) MLPs are supported, "
                "expected 'silu'")
    names = set(key_names) if key_names is not None else None
    layers = _int(cfg, "num_hidden_layers", structure)
    stems = _target_stems(names, layers) if names is not None else None
    swa_family = sliding_family(cfg) if family is None and not allow_hybrid else None
    implemented: tuple[str, ...] = ()
    if family is not None:
        implemented = (*MLA_KEYS, "v_head_dim")
    elif swa_family is not None:
        implemented = (*HUB_KEYS, "v_head_dim", SINK_STEM)
    _refuse_unimplemented(cfg, stems, implemented)
    layer_types = cfg.get("layer_types") or ()
    known = ("full_attention", "sliding_attention") + (("linear_attention",) if allow_hybrid else ())
    if family is not None and family.layer_type is not None:
        known += (family.layer_type,)
    odd = sorted({str(t) for t in layer_types if t not in known})
    if odd:
        raise UnsupportedError(
            f"config.json:layer_types contains {odd}: the dense decoder has full-attention "
            "and sliding-window layers only (hybrid linear-attention targets parse with "
            "speccal.runner.hybrid.hybrid_config_from_hf)"
        )
    hidden = _int(cfg, "hidden_size", structure)
    heads = _int(cfg, "num_attention_heads", structure)
    # the hybrid families' routers always renormalise and write no norm_topk_prob
    moe = moe_config_from_hf(cfg, names, layers, default_norm=True if allow_hybrid else None)
    # without it every layer must be routed (ModelConfig names the dense ones otherwise)
    inter = _int(cfg, "intermediate_size", structure, 0 if moe is not None else _MISSING)
    if inter < 1 and moe is None:
        raise InputError("config.json:intermediate_size", inter, "an integer >= 1")
    if names is not None:
        is_qk_norm = "self_attn.q_norm.weight" in _target_stems(names, layers)
    else:
        is_qk_norm = bool(cfg.get("qk_norm", False))
    eos = cfg.get("eos_token_id")
    eos_list = eos if isinstance(eos, (list, tuple)) else [eos]
    if any(e is not None and (isinstance(e, bool) or not isinstance(e, int)) for e in eos_list):
        raise InputError("config.json:eos_token_id", eos, "an integer, a list of integers or null")
    eos_ids = tuple(int(e) for e in eos_list if e is not None)
    depths = 0
    for f in MTP_DEPTH_FIELDS:
        if cfg.get(f):
            depths = _int(cfg, f, structure)
            break
    archs = cfg.get("architectures") or [cfg.get("model_type", "DenseDecoder")]
    tie = _bool(cfg, "tie_word_embeddings")
    rope, sliding_rope = _ropes_from_hf(cfg)
    mla = mla_from_hf(cfg, rope.rope_type, dict(rope.params)) if family is not None else None
    head_dim = (mla.qk_rope_head_dim if mla is not None
                else _int(cfg, "head_dim", structure, hidden // heads if heads else 0))
    kv_heads = _int(cfg, "num_key_value_heads", structure, heads)
    eps = _float(cfg, "rms_norm_eps", 1e-6)
    v_head_dim = 0 if mla is not None else _int(cfg, "v_head_dim", structure, 0)
    swa = None
    if swa_family is not None:
        swa = sliding_from_hf(cfg, swa_family, layer_types, kv_heads)
        srope = sliding_rope or rope
        check_hub_keys(cfg, hub_key_expectations(
            swa, num_layers=layers, num_heads=heads, head_dim=head_dim,
            v_head_dim=v_head_dim or head_dim, rms_norm_eps=eps,
            full_rope=(rope.theta, rope.partial_rotary_factor),
            sliding_rope=(srope.theta, srope.partial_rotary_factor)), swa_family.model_type)
    return ModelConfig(
        vocab_size=_int(cfg, "vocab_size", structure),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope=rope,
        max_position_embeddings=_int(cfg, "max_position_embeddings", structure, 4096),
        tie_word_embeddings=bool(tie),
        **_bias_flags(cfg, names, layers),
        is_qk_norm=is_qk_norm,
        sliding_windows=layer_windows(cfg, layers, is_layer_typed=swa is not None),
        eos_token_ids=eos_ids,
        architecture=str(archs[0]),
        num_mtp_depths=depths,
        mla=mla,
        moe=moe,
        value_scale=_float(cfg, "attention_value_scale", 1.0),
        v_head_dim=v_head_dim,
        swa=swa,
        sliding_rope=sliding_rope,
        extra=dict(cfg),
    )
