"""Multi-head latent attention (MLA) and DeepSeek sparse attention (DSA) configuration.

This module owns :class:`MLAConfig` / :class:`IndexerConfig` (frozen, validated) and their
parsing from the HF ``config.json`` of the MLA families (:data:`MLA_FAMILIES`: one descriptor
per ``model_type``, the facts transformers encodes in each model *class* rather than in the
config: which key selects the rotary layout, how the dense / routed MLP of a layer is chosen,
whether the attention has a DSA indexer and its rotary layout). It imports nothing of the
runner, so ``speccal.runner.config`` can hold an :class:`MLAConfig` in its ``ModelConfig``.

Transformers' facts this follows (``models/deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``;
``glm4_moe_lite`` builds DeepSeek-V3's attention class; ``glm_moe_dsa``, GLM-5, V3.2's with
the indexer's rotary interleaved and ``indexer_types``: a ``shared`` layer has no indexer and
reuses the top-k of the last ``full`` layer before it, ``MLAConfig.index_shared``):

- softmax scale ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when the
  RoPE type is not ``default`` and ``mscale_all_dim`` is set (``yarn_apply_mscale``);
- the latent norms (``q_a_layernorm``, ``kv_a_layernorm``) use eps ``1e-6`` whatever
  ``rms_norm_eps`` says (the classes build them without it), the indexer's ``k_norm`` is a
  LayerNorm with eps ``1e-6``;
- ``attention_bias`` puts a bias on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` only;
- the MLA rotary layout: DeepSeek-V3 reads ``rope_interleave`` (default true), DeepSeek-V2
  rotates interleaved pairs as complex numbers (the same scores as V3's interleaved form: the
  two differ only by a permutation of the rotary channels, applied to q and k alike),
  DeepSeek-V3.2 always interleaves, and its indexer rotates the half-split (``rotate_half``)
  way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from speccal.base.errors import InputError, UnsupportedError

LATENT_NORM_EPS = 1e-6  # transformers' RMSNorm default: the latent norms are built without eps
INDEXER_NORM_EPS = 1e-6  # the indexer's LayerNorm(index_head_dim, eps=1e-6)


@dataclass(frozen=True)
class IndexerConfig:
    """The DSA indexer of one attention layer (DeepSeek-V3.2).

    Attributes
    ----------
    num_heads, head_dim : int
        ``index_n_heads`` scoring heads of ``index_head_dim`` (its first ``qk_rope_head_dim``
        channels rotate).
    topk : int
        ``index_topk``: keys each query attends to (all visible ones when fewer).
    is_rope_interleaved : bool
        The indexer's rotary layout (V3.2: half-split, False).
    """

    num_heads: int
    head_dim: int
    topk: int
    is_rope_interleaved: bool = False


@dataclass(frozen=True)
class MLAConfig:
    """Shapes and switches of a DeepSeek MLA attention layer.

    Attributes
    ----------
    kv_lora_rank : int
        Width of the cached latent (``kv_a_layernorm`` of the first ``kv_lora_rank`` outputs of
        ``kv_a_proj_with_mqa``).
    q_lora_rank : int or None
        Query LoRA rank (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``); None: one ``q_proj``.
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim : int
        Per-head query/key channels without and with rotary, value channels. The rotary key
        part is one head shared by every query head.
    is_rope_interleaved : bool
        Rotary over interleaved channel pairs (DeepSeek) instead of the two halves.
    softmax_scale : float
        ``qk_head_dim ** -0.5`` with YaRN's ``mscale_all_dim`` folded in.
    is_bias : bool
        ``attention_bias``: biases on ``q_a_proj`` (or none on ``q_proj``),
        ``kv_a_proj_with_mqa`` and ``o_proj``.
    indexer : IndexerConfig or None
        The DSA indexer (sparse attention), None: dense MLA.
    index_shared : tuple of bool
        Per target layer, whether it reuses the top-k of the last layer before it that ran its
        indexer (GLM-5's cross-layer sharing, ``indexer_types`` ``shared``) instead of running
        its own (no indexer weights, no indexer key cache); empty: every layer runs its own.
    """

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    is_rope_interleaved: bool
    softmax_scale: float
    is_bias: bool = False
    indexer: IndexerConfig | None = None
    index_shared: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"config.json:{name}", value, "an integer >= 1")
        if self.qk_rope_head_dim % 2:
            raise InputError("config.json:qk_rope_head_dim", self.qk_rope_head_dim,
                             "an even integer (rotary channels come in pairs)")
        if self.q_lora_rank is not None and (isinstance(self.q_lora_rank, bool)
                                             or not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank < 1):
            raise InputError("config.json:q_lora_rank", self.q_lora_rank,
                             "an integer >= 1 or null")
        if self.indexer is not None and self.q_lora_rank is None:
            raise InputError("config.json:q_lora_rank", None,
                             "an integer: the DSA indexer's query reads the q LoRA latent")
        if self.indexer is not None and self.indexer.head_dim < self.qk_rope_head_dim:
            raise InputError("config.json:index_head_dim", self.indexer.head_dim,
                             f">= qk_rope_head_dim={self.qk_rope_head_dim} (its first "
                             "qk_rope_head_dim channels rotate)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Channels cached per token: the latent and the rotated key, ``[latent | k_rope]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_index_shared(self, layer: int) -> bool:
        """Whether target layer ``layer`` reuses an earlier layer's top-k (:attr:`index_shared`;
        layers past the list, an MTP layer, run their own)."""
        return layer < len(self.index_shared) and self.index_shared[layer]

    def index_dim_of(self, layer: int | None) -> int:
        """Indexer-key channels ``layer`` caches (0 on a sharing layer)."""
        return 0 if layer is not None and self.is_index_shared(layer) else self.index_dim

    @property
    def index_dim(self) -> int:
        """Channels of the indexer's key cached per token (0 without an indexer)."""
        return self.indexer.head_dim if self.indexer is not None else 0


@dataclass(frozen=True)
class MLAFamily:
    """What one transformers MLA ``model_type`` fixes in its classes.

    Attributes
    ----------
    model_type : str
    rope_interleave_key : str or None
        The config key choosing the MLA rotary layout; None: fixed to ``is_rope_interleaved``
        (the key, if present, is refused when it disagrees: transformers would ignore it).
    is_rope_interleaved : bool
        The layout when the key is absent (or fixed).
    indexer_rope_interleaved : bool or None
        The family's attention carries a DSA indexer with this rotary layout; None: no indexer.
    shares_index : bool
        The family's layers may reuse an earlier layer's top-k (``indexer_types``: GLM-5).
    layer_type : str or None
        The ``layer_types`` entry the family's config writes for its layers (accepted).
    """

    model_type: str
    rope_interleave_key: str | None
    is_rope_interleaved: bool
    indexer_rope_interleaved: bool | None = None
    layer_type: str | None = None
    shares_index: bool = False


MLA_FAMILIES: dict[str, MLAFamily] = {
    "deepseek_v2": MLAFamily("deepseek_v2", None, True),
    "deepseek_v3": MLAFamily("deepseek_v3", "rope_interleave", True),
    # GLM-4.7-Flash: DeepSeek-V3's attention class (transformers' Glm4MoeLiteAttention) and
    # GLM-4.5's routed MLP, dense / routed layers by ``mlp_layer_types``
    "glm4_moe_lite": MLAFamily("glm4_moe_lite", "rope_interleave", True),
    "deepseek_v32": MLAFamily("deepseek_v32", None, True, indexer_rope_interleaved=False,
                              layer_type="indexed_attention"),
    # GLM-5: V3.2's DSA with the indexer's rotary interleaved and cross-layer top-k sharing
    "glm_moe_dsa": MLAFamily("glm_moe_dsa", None, True, indexer_rope_interleaved=True,
                             layer_type="indexed_attention", shares_index=True),
}

#: config keys an MLA family implements (no longer refused by ``config.UNIMPLEMENTED_KEYS``)
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "rope_interleave", "indexer_types")

#: config keys of a DSA indexer in families without one (refused: no such model in transformers)
INDEXER_KEYS = ("index_topk", "index_head_dim", "index_n_heads")


def is_mla_config(cfg: Mapping[str, Any]) -> bool:
    """Whether ``cfg`` declares MLA (a ``kv_lora_rank``)."""
    return cfg.get("kv_lora_rank") is not None


def mla_family(cfg: Mapping[str, Any]) -> MLAFamily:
    """The :data:`MLA_FAMILIES` descriptor of an MLA config.

    Raises
    ------
    UnsupportedError
        A ``kv_lora_rank`` in a ``model_type`` the runner has no descriptor for.
    """
    model_type = cfg.get("model_type")
    if model_type not in MLA_FAMILIES:
        raise UnsupportedError(
            f"config.json:kv_lora_rank={cfg.get('kv_lora_rank')!r}: multi-head latent attention "
            f"(MLA) is implemented for model_type {', '.join(MLA_FAMILIES)}; this config's "
            f"model_type is {model_type!r} (its attention layout is not known to the runner)")
    return MLA_FAMILIES[model_type]


def _int(cfg: Mapping[str, Any], name: str, *, optional: bool = False) -> int | None:
    value = cfg.get(name)
    if value is None:
        if optional:
            return None
        raise InputError(f"config.json:{name}", None, "an integer (required for MLA)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"config.json:{name}", value, "an integer")
    return value


def yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``), transformers'
    ``yarn_get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope_type: str, rope_params: Mapping[str, Any]) -> float:
    """``qk_head_dim ** -0.5`` times ``mscale(factor, mscale_all_dim) ** 2`` for a scaled RoPE
    with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = qk_head_dim**-0.5
    mscale_all_dim = rope_params.get("mscale_all_dim") or 0
    if rope_type != "default" and mscale_all_dim:
        m = yarn_mscale(float(rope_params["factor"]), float(mscale_all_dim))
        scale = scale * m * m
    return scale


def mla_from_hf(cfg: Mapping[str, Any], rope_type: str,
                rope_params: Mapping[str, Any]) -> MLAConfig:
    """The :class:`MLAConfig` of an MLA config (:func:`is_mla_config`).

    Raises
    ------
    UnsupportedError
        An unknown ``model_type`` (:func:`mla_family`), a rotary-layout key its family does not
        read set against the family's fixed layout, indexer keys in a family without one.
    InputError
        A missing or invalid shape field, naming it.
    """
    family = mla_family(cfg)
    interleaved = family.is_rope_interleaved
    key = family.rope_interleave_key
    if key is not None and cfg.get(key) is not None:
        if not isinstance(cfg[key], bool):
            raise InputError(f"config.json:{key}", cfg[key], "true or false")
        interleaved = cfg[key]
    elif key is None and cfg.get("rope_interleave") not in (None, interleaved):
        raise UnsupportedError(
            f"config.json:rope_interleave={cfg['rope_interleave']!r}: model_type "
            f"{family.model_type!r} always rotates "
            f"{'interleaved pairs' if interleaved else 'half-split channels'} (transformers does "
            "not read the key), expected it absent or "
            f"{'true' if interleaved else 'false'}")
    indexer = None
    if family.indexer_rope_interleaved is not None:
        indexer = IndexerConfig(num_heads=_int(cfg, "index_n_heads"),
                                head_dim=_int(cfg, "index_head_dim"),
                                topk=_int(cfg, "index_topk"),
                                is_rope_interleaved=family.indexer_rope_interleaved)
        for name in ("num_heads", "head_dim", "topk"):
            if getattr(indexer, name) < 1:
                raise InputError(f"config.json:index_{name.replace('num_heads', 'n_heads')}",
                                 getattr(indexer, name), "an integer >= 1")
    else:
        present = [k for k in INDEXER_KEYS if cfg.get(k) is not None]
        if present:
            raise UnsupportedError(
                f"config.json:{present[0]}={cfg[present[0]]!r}: model_type "
                f"{family.model_type!r} has no DSA indexer in transformers; expected no "
                f"{', '.join(INDEXER_KEYS)}")
    shared: tuple[bool, ...] = ()
    types = cfg.get("indexer_types")
    if types is not None and not family.shares_index:
        raise UnsupportedError(
            f"config.json:indexer_types={types!r}: model_type {family.model_type!r} runs every "
            "layer's indexer (transformers does not read the key); expected it absent")
    if types is not None:
        layers = _int(cfg, "num_hidden_layers")
        if (not isinstance(types, list) or len(types) != layers
                or any(t not in ("full", "shared") for t in types) or types[:1] != ["full"]):
            raise InputError("config.json:indexer_types", types,
                             f"{layers} entries of 'full' / 'shared', the first 'full' (a shared "
                             "layer reuses the last full layer's top-k)")
        shared = tuple(t == "shared" for t in types)
    nope, rope = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim")
    bias = cfg.get("attention_bias")
    if bias is not None and not isinstance(bias, bool):
        raise InputError("config.json:attention_bias", bias, "true or false")
    return MLAConfig(
        kv_lora_rank=_int(cfg, "kv_lora_rank"),
        q_lora_rank=_int(cfg, "q_lora_rank", optional=True),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=_int(cfg, "v_head_dim"),
        is_rope_interleaved=interleaved,
        softmax_scale=softmax_scale(nope + rope, rope_type, rope_params),
        is_bias=bool(bias),
        indexer=indexer,
        index_shared=shared if any(shared) else (),
    )
