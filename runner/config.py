"""The dense decoder's configuration, read from a Hugging Face ``config.json`` dictionary.

This module owns :class:`ModelConfig` (a frozen dataclass the model modules are built from) and
its parsing from HF configs of the Qwen2 / Qwen3 / MiMo family. Structural flags that HF encodes
in the model *class* (q/k bias in Qwen2, per-head q/k norm in Qwen3) are read from the checkpoint's
tensor names when a ``key_names`` set is given, so no code tests a model name.

RoPE: ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5) are both read
into one :class:`RopeConfig`; supported types are ``default``, ``linear``, ``dynamic`` (NTK),
``llama3`` and ``yarn`` (see ``speccal.runner.rope``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from speccal.base.errors import InputError, UnsupportedError

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
        q/k/v projections carry a bias (Qwen2, MiMo).
    is_qk_norm : bool
        Per-head RMSNorm on q and k before RoPE (Qwen3).
    eos_token_ids : tuple of int
    architecture : str
        ``architectures[0]`` of the HF config (identity only, never branched on).
    num_mtp_depths : int
        MTP depths the config publishes (``num_nextn_predict_layers`` or similar), 0 when none.
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
    is_qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "DenseDecoder"
    num_mtp_depths: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
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
        if self.rope.rope_type not in ROPE_TYPES:
            raise UnsupportedError(
                f"rope_scaling type {self.rope.rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_TYPES)})"
            )


# MTP depth fields published by the families speccal knows (data, read by draft_families too).
MTP_DEPTH_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


def _rope_from_hf(cfg: Mapping[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    if scaling:
        params.update(scaling)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = float(cfg.get("partial_rotary_factor", params.pop("partial_rotary_factor", 1.0)))
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


def _require(cfg: Mapping[str, Any], name: str) -> Any:
    if name not in cfg:
        arch = (cfg.get("architectures") or [None])[0]
        raise InputError(
            f"config.json:{name}",
            None,
            "a value (required for a dense attention decoder, the runner's one target "
            f"structure; this config is architecture {arch!r}, model_type "
            f"{cfg.get('model_type')!r})",
        )
    return cfg[name]


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
        Tensor names of the checkpoint; when given, q/k/v bias and q/k norm are read from them
        (``attention_bias`` in the config takes precedence for the bias).
    allow_hybrid : bool
        Parse the shared fields of a hybrid linear-attention / MoE config (``speccal.runner.hybrid``
        reads the rest, ``hybrid_config_from_hf``) instead of refusing it. The dense decoder
        keeps the default (refuse); the loader sends configs whose ``layer_types`` name
        ``linear_attention`` to the hybrid parser (``speccal.runner.hybrid.is_hybrid_config``).

    Raises
    ------
    InputError
        A missing or invalid field, naming it.
    UnsupportedError
        A structure the dense decoder does not implement (non-SiLU MLP, MoE, linear attention).
    """
    if "text_config" in cfg and isinstance(cfg["text_config"], Mapping):
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedError(
            f"config.json:hidden_act={act!r}: only SwiGLU (silu) MLPs are supported"
        )
    for moe_field in ("num_experts", "n_routed_experts", "num_local_experts"):
        if cfg.get(moe_field) and not allow_hybrid:
            raise UnsupportedError(
                f"config.json:{moe_field}={cfg[moe_field]!r}: mixture-of-experts targets are not "
                "supported by the dense decoder"
            )
    layer_types = cfg.get("layer_types") or ()
    known = ("full_attention", "sliding_attention") + (("linear_attention",) if allow_hybrid else ())
    odd = sorted({t for t in layer_types if t not in known})
    if odd:
        raise UnsupportedError(
            f"config.json:layer_types contains {odd}: the dense decoder has full-attention "
            "layers only (hybrid linear-attention targets parse with "
            "speccal.runner.hybrid.hybrid_config_from_hf)"
        )
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise UnsupportedError(
            "config.json:use_sliding_window=true: sliding-window attention is not supported"
        )
    names = set(key_names) if key_names is not None else None
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    if "attention_bias" in cfg:
        is_bias = bool(cfg["attention_bias"])
    elif names is not None:
        is_bias = "model.layers.0.self_attn.q_proj.bias" in names
    else:
        is_bias = False
    if names is not None:
        is_qk_norm = "model.layers.0.self_attn.q_norm.weight" in names
    else:
        is_qk_norm = bool(cfg.get("qk_norm", False))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(
        int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None
    )
    depths = 0
    for f in MTP_DEPTH_FIELDS:
        if cfg.get(f):
            depths = int(cfg[f])
            break
    archs = cfg.get("architectures") or [cfg.get("model_type", "DenseDecoder")]
    return ModelConfig(
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size")),
        num_hidden_layers=int(_require(cfg, "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        is_qkv_bias=is_bias,
        is_qk_norm=is_qk_norm,
        eos_token_ids=eos_ids,
        architecture=str(archs[0]),
        num_mtp_depths=depths,
        extra=dict(cfg),
    )
