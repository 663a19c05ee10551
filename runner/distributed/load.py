"""Shard-by-shard loading of a tensor-parallel rank's target and MTP head.

This module owns the TP layout of the dense decoder's weights (:data:`SPLIT_DIMS`, by module
parameter name: which dimension of which weight is split, everything else replicated), the
rank's local config (:func:`local_config`: heads, KV heads, intermediate size and vocabulary
divided by ``tp``, each divisibility checked), and :class:`ShardedSource`, a
:class:`~speccal.runner.checkpoint.TensorSource` that returns only this rank's slice of each
tensor. The model is then built by the ordinary loader (``speccal.runner.loader.build``) from
the local config, so its parameters have the shard shapes and every tensor is checked by name
and shape as on one rank.

Reading: an HF folder is read slice by slice (``safe_open(...).get_slice``: only the rank's rows
or columns leave the file); a preset's seeded random source produces each full tensor from
``(seed, key)`` on every rank (identical on all of them) and the rank keeps its slice, one
tensor at a time (never a whole full model). Rank ``r`` of ``t`` holds the contiguous ``1/t``
slice ``[r n/t, (r + 1) n/t)`` of a split dimension of size ``n``. :func:`shard_loaded` slices
a model already built in full on every rank the same way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from speccal.base.errors import InputError, UnsupportedError
from speccal.runner.checkpoint import SafetensorsFolder, TensorSource
from speccal.runner.config import ModelConfig, config_from_hf
from speccal.runner.device import on_meta
from speccal.runner.draft_families import REGISTRY, recognise
from speccal.runner.loader import (
    LoadedModel,
    _draft_shapes,
    _dtype,
    _target_shapes,
    build,
    draft_config,
    preset_fingerprint,
)
from speccal.runner.model import TargetModel
from speccal.runner.mtp import MTPHead
from speccal.runner.presets import HYBRID_PRESETS, PRESETS, RandomSource

#: Split dimension of each sharded parameter, by the last two parts of its module name
#: (column-parallel: dim 0 of q/k/v/gate/up and their biases; row-parallel: dim 1 of o/down,
#: whose biases are replicated and added once after the reduction, speccal.runner.layers;
#: vocabulary-parallel: dim 0 of the embeddings and LM heads). Unlisted: replicated.
SPLIT_DIMS: dict[str, int] = {
    "q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0,
    "q_proj.bias": 0, "k_proj.bias": 0, "v_proj.bias": 0,
    "gate_proj.weight": 0, "up_proj.weight": 0, "gate_proj.bias": 0, "up_proj.bias": 0,
    "o_proj.weight": 1, "down_proj.weight": 1,
    "embed_tokens.weight": 0, "lm_head.weight": 0,  # the target's
    "head.weight": 0, "embed.weight": 0,  # the MTP head's own (MTPHead.head / .embed)
}


def split_dim(param_name: str) -> int | None:
    """The split dimension of a module parameter (:data:`SPLIT_DIMS`), None if replicated."""
    return SPLIT_DIMS.get(".".join(param_name.split(".")[-2:]))


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """A TP rank's config: the sharded sizes divided by ``tp`` (the rest, RoPE included, kept).

    Raises
    ------
    InputError
        ``tp`` does not divide a sharded size (naming the config field, its value and ``tp``).
    """
    if cfg.mla is not None and tp > 1:
        raise UnsupportedError(
            f"tp={tp}: multi-head latent attention (config.json:kv_lora_rank="
            f"{cfg.mla.kv_lora_rank}) is not sharded by the runner's tensor parallelism; "
            "expected tp=1")
    if cfg.moe is not None and tp > 1:
        raise UnsupportedError(
            f"tp={tp} with routed experts (config.json num_experts / n_routed_experts "
            f"{cfg.moe.num_experts}): sharding the experts is not implemented, expected tp=1")
    if cfg.swa is not None and tp > 1:
        raise UnsupportedError(
            f"tp={tp}: sliding layers with their own KV heads and sink logits "
            f"(config.json:model_type={cfg.extra.get('model_type')!r}, "
            f"swa_config.SLIDING_FAMILIES) are not sharded by the runner's tensor "
            "parallelism; expected tp=1")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(cfg, name)
        if value % tp:
            raise InputError(
                f"config.{name}", value,
                f"a multiple of tp={tp} (tensor parallelism splits it evenly over the ranks)")
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=cfg.num_key_value_heads // tp,
        intermediate_size=cfg.intermediate_size // tp,
        vocab_size=cfg.vocab_size // tp,
    )


def split_plan(cfg: ModelConfig, family, need_draft: bool) -> dict[str, int]:
    """Checkpoint key -> split dimension of every sharded tensor of target (and head)."""
    with on_meta():
        target = TargetModel(cfg, 1, 1)
    plan = {n: d for n, _ in target.named_parameters() if (d := split_dim(n)) is not None}
    if family is not None and need_draft:
        with on_meta():
            head = MTPHead(cfg, family)
        for name, key in head.param_key_map(cfg.num_hidden_layers).items():
            d = split_dim(name)
            if d is not None:
                plan[key] = d
    return plan


class ShardedSource:
    """Rank ``rank`` of ``tp``'s slice of every tensor of ``inner`` named in ``plan``.

    ``shape`` reports the local shape (so the loader's checks compare shard shapes); ``get``
    reads only the slice from a safetensors folder, else the full tensor of ``inner`` (seeded
    random presets: identical on every rank) narrowed and copied.
    """

    def __init__(self, inner: TensorSource, plan: dict[str, int], rank: int, tp: int):
        self.inner = inner
        self.plan = plan
        self.rank = rank
        self.tp = tp
        self._files: dict[Path, Any] = {}

    def keys(self) -> list[str]:
        return self.inner.keys()

    def _bounds(self, key: str, full: tuple[int, ...]) -> tuple[int, int, int]:
        d = self.plan[key]
        n = full[d]
        if n % self.tp:
            raise InputError(f"checkpoint tensor {key}", full,
                             f"dimension {d} a multiple of tp={self.tp}")
        size = n // self.tp
        return d, self.rank * size, size

    def shape(self, key: str) -> tuple[int, ...]:
        full = tuple(self.inner.shape(key))
        if key not in self.plan:
            return full
        d, _, size = self._bounds(key, full)
        return full[:d] + (size,) + full[d + 1:]

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        if key not in self.plan:
            return self.inner.get(key, shape, dtype, device)
        full = tuple(self.inner.shape(key))
        d, lo, size = self._bounds(key, full)
        if isinstance(self.inner, SafetensorsFolder):
            sl = self._slice(key)
            index = (slice(None),) * d + (slice(lo, lo + size),)
            return sl[index].to(device=device, dtype=dtype).contiguous()
        return self.inner.get(key, full, dtype, device).narrow(d, lo, size).contiguous()

    def _slice(self, key: str):
        f = self.inner.key_to_file[key]
        if f not in self._files:
            self._files[f] = safe_open(str(f), framework="pt")
        return self._files[f].get_slice(key)


class ModuleSource:
    """The tensors of an already built target (and head) by checkpoint key: what
    :func:`shard_loaded` slices (a :class:`~speccal.runner.checkpoint.TensorSource`)."""

    def __init__(self, loaded: LoadedModel):
        self.tensors = {name: p for name, p in loaded.target.named_parameters()}
        if loaded.draft is not None:
            params = dict(loaded.draft.named_parameters())
            for name, key in loaded.draft.param_key_map(loaded.config.num_hidden_layers).items():
                self.tensors[key] = params[name]

    def keys(self) -> list[str]:
        return sorted(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        return self.tensors[key].detach().to(device=device, dtype=dtype)


def shard_loaded(loaded: LoadedModel, *, rank: int, tp: int, max_model_len: int,
                 max_positions: int) -> tuple[LoadedModel, ModelConfig]:
    """TP rank ``rank`` of ``tp``'s shard of a model already built on one rank (every rank
    must hold the same full weights, e.g. a preset of one seed); as :func:`load_shard`."""
    cfg = loaded.config
    local = local_config(cfg, tp)
    inner = ModuleSource(loaded)
    family = loaded.family if loaded.draft is not None else None
    keys = set(inner.keys()) if family is not None else None
    dcfg = draft_config(cfg, family, keys) if family is not None else cfg
    source = ShardedSource(inner, split_plan(dcfg, family, family is not None), rank, tp)
    p = next(loaded.target.parameters())
    target, draft, fam = build(local, source, device=p.device, dtype=p.dtype,
                               max_model_len=max_model_len, max_positions=max_positions,
                               need_draft=loaded.draft is not None)
    desc = f"{loaded.description}, TP rank {rank}/{tp}"
    return _loaded(target, draft, cfg, fam, loaded.fingerprint, loaded.is_random, desc,
                   loaded.tokenizer_path), local


def _loaded(target, draft, cfg, family, fingerprint, is_random, description, tokenizer):
    return LoadedModel(target=target, draft=draft, config=cfg, family=family,
                       fingerprint=fingerprint, architecture=cfg.architecture,
                       is_random=is_random, description=description, tokenizer_path=tokenizer,
                       capabilities=target.capabilities,
                       num_kv_layers=cfg.num_hidden_layers)  # a dense target: every layer


def load_shard(
    model: str,
    *,
    rank: int,
    tp: int,
    device: torch.device,
    dtype: str,
    seed: int = 0,
    max_model_len: int,
    max_positions: int,
    need_draft: bool = True,
    draft_family: str | None = None,
) -> tuple[LoadedModel, ModelConfig]:
    """TP rank ``rank`` of ``tp``'s shard of ``model`` (a preset name or an HF folder).

    Returns the :class:`LoadedModel` (its ``config`` the *full* config, its modules built from
    the local one, not yet bound to a TP group: ``speccal.runner.distributed.tp.bind_tp``) and
    the local config. The fingerprint is the unsharded model's (the same weights); topology
    is recorded separately. Refusals as ``speccal.runner.loader.load_model``, plus sharded
    sizes ``tp`` does not divide.
    """
    torch_dtype = _dtype(dtype)
    if model in HYBRID_PRESETS:
        raise UnsupportedError(f"model {model!r}: hybrid targets have no tensor-parallel layout")
    if model in PRESETS:
        preset = PRESETS[model]
        fam_name = draft_family or preset.family
        if fam_name not in REGISTRY:
            raise InputError("draft_family", fam_name, f"one of {', '.join(REGISTRY)}")
        family = REGISTRY[fam_name]
        cfg = config_from_hf({**preset.config, "architectures": [f"preset:{preset.name}"]})
        local = local_config(cfg, tp)
        shapes = _target_shapes(cfg)
        shapes.update(_draft_shapes(draft_config(cfg, family, None), family))
        inner = RandomSource(preset, shapes, seed, family, cfg.num_hidden_layers)
        fingerprint = preset_fingerprint(f"{model}/{fam_name}", seed, shapes)
        desc = (f"preset {model!r} ({preset.description}, RANDOM weights of seed {seed}: its "
                f"text is meaningless), TP rank {rank}/{tp}")
        tokenizer = None
        is_random = True
    else:
        if not Path(model).exists():
            raise InputError(
                "model", model, f"a preset ({', '.join(PRESETS)}) or an existing checkpoint folder")
        inner = SafetensorsFolder(model)
        keys = inner.keys()
        cfg = config_from_hf(inner.config, keys)
        local = local_config(cfg, tp)
        found = recognise(cfg.extra, keys, cfg.num_hidden_layers)
        if need_draft and found is None:
            raise UnsupportedError(
                f"checkpoint {model} has no MTP head (no draft family's tensors found): "
                "speculative decoding needs one; run plain decoding instead")
        family = found[0] if found else None
        fingerprint = inner.fingerprint()
        desc = f"checkpoint {model} ({cfg.architecture}), TP rank {rank}/{tp}"
        tokenizer = inner.path if inner.has_tokenizer() else None
        is_random = False
    if family is not None and need_draft:
        keys = None if is_random else set(inner.keys())
        plan = split_plan(draft_config(cfg, family, keys), family, need_draft)
    else:
        plan = split_plan(cfg, None, False)
    source = ShardedSource(inner, plan, rank, tp)
    target, draft, fam = build(local, source, device=device, dtype=torch_dtype,
                               max_model_len=max_model_len, max_positions=max_positions,
                               need_draft=need_draft)
    return _loaded(target, draft, cfg, fam, fingerprint, is_random, desc, tokenizer), local
