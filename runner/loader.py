"""Build the target model and its MTP draft head from a checkpoint folder or a preset.

This module owns loading: it reads the config, recognises the draft family from the tensor
names (``speccal.runner.draft_families``), drops the draft's keys from the target load (same
descriptor), builds both modules on the meta device, materialises them on the target device and
fills every parameter from a :class:`~speccal.runner.checkpoint.TensorSource`, refusing missing
tensors and shape mismatches by name. The result, :class:`LoadedModel`, also carries the model
fingerprint used by cost-table compatibility.

The loader is strict (SPEC section 7): every tensor of the checkpoint is consumed by a module of
the target or its head, or ignored on purpose for a named reason (:data:`IGNORED_TENSORS`; the
head's tensors when no head is built, claimed by its family's descriptor; a tied LM head; a
vision tower next to the text model), or the load is refused listing the tensors no module
consumes (:func:`check_consumed`). Config features are checked by ``speccal.runner.config``.

Hybrid linear-attention targets (a ``linear_attention`` entry in ``layer_types``: Qwen3.5 /
Qwen3-Next, :func:`speccal.runner.hybrid.is_hybrid_config`) load into
:class:`~speccal.runner.hybrid.HybridModel` and their head into
:class:`~speccal.runner.hybrid.HybridMTPHead` by the same steps; which head class a family
builds is the descriptor's ``target_structure`` (:data:`HEAD_CLASSES`), never a model name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.runner.checkpoint import SafetensorsFolder, TensorSource
from speccal.runner.config import ModelConfig, config_from_hf
from speccal.runner.device import on_meta
from speccal.runner.draft_families import REGISTRY, DraftFamily, is_any_draft_key, recognise
from speccal.runner.expert_source import per_expert
from speccal.runner.hybrid import (
    HybridConfig,
    HybridModel,
    HybridMTPHead,
    hybrid_config_from_hf,
    is_hybrid_config,
)
from speccal.runner.model import ModelCapabilities, TargetModel
from speccal.runner.mtp import MTPHead
from speccal.runner.presets import HYBRID_PRESETS, PRESETS, HybridRandomSource, RandomSource
from speccal.runner.rope import RotaryTable


@dataclass
class LoadedModel:
    """A loaded target (and draft head, when the checkpoint has one)."""

    target: TargetModel
    draft: MTPHead | None
    config: ModelConfig
    family: DraftFamily | None
    fingerprint: str
    architecture: str
    is_random: bool
    description: str
    tokenizer_path: Path | None
    capabilities: ModelCapabilities
    num_kv_layers: int  # target layers with a paged KV cache (all of a dense target's)
    hybrid: HybridConfig | None = None  # the full config of a hybrid target


# DraftFamily.target_structure -> the head module it builds
HEAD_CLASSES = {"dense": MTPHead, "hybrid": HybridMTPHead}

#: Checkpoint tensors no module consumes on purpose: regular expression -> the reason. Any other
#: tensor that no module of the target or its head consumes is refused by name.
IGNORED_TENSORS: dict[str, str] = {
    r"(?:^|\.)rotary_emb\.inv_freq$": "RoPE inverse frequencies (older checkpoints save them); "
                                      "recomputed from config.json by speccal.runner.rope",
}
TIED_HEAD_REASON = "the LM head is tied to embed_tokens (tie_word_embeddings), as transformers ties it"
DRAFT_REASON = "the MTP head's tensors (its family's descriptor claims them): no head is built"
UNUSED_SHOWN = 6  # unused tensor names a refusal lists before the count of the rest


def ignored_reason(key: str, *, is_tied: bool, is_head_dropped: bool, num_layers: int,
                   extra: tuple[tuple[str, str], ...] = ()) -> str | None:
    """Why ``key`` is not consumed on purpose, or None (then it must be consumed).

    ``is_head_dropped``: no MTP head is built (plain decoding), so the keys a draft family
    claims are dropped; ``extra``: (key prefix, reason) pairs of the layout (a vision tower).
    """
    for pattern, reason in IGNORED_TENSORS.items():
        if re.search(pattern, key):
            return reason
    if is_tied and key == "lm_head.weight":
        return TIED_HEAD_REASON
    if is_head_dropped and is_any_draft_key(key, num_layers):
        return DRAFT_REASON
    for prefix, reason in extra:
        if key.startswith(prefix):
            return reason
    return None


def check_consumed(keys: set[str], used: set[str], what: str, **ignored) -> None:
    """Refuse a checkpoint holding tensors that no module consumes and no rule ignores.

    ``ignored``: the keyword arguments of :func:`ignored_reason`.

    Raises
    ------
    InputError
        Naming the first :data:`UNUSED_SHOWN` unused tensors and their count.
    """
    unused = sorted(k for k in keys - used if ignored_reason(k, **ignored) is None)
    if not unused:
        return
    shown = ", ".join(unused[:UNUSED_SHOWN])
    more = f" and {len(unused) - UNUSED_SHOWN} more" if len(unused) > UNUSED_SHOWN else ""
    raise InputError(
        "checkpoint tensors", None,
        f"every tensor consumed by the {what} or ignored on purpose "
        "(speccal.runner.loader.IGNORED_TENSORS): a tensor the runner has no module for is a "
        "feature it does not implement, refused rather than computed without",
        found=f"{len(unused)} that no module consumes ({shown}{more})",
    )


def _target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with on_meta():
        model = TargetModel(cfg, 1, 1)
    return {
        k: tuple(v.shape)
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and cfg.tie_word_embeddings)
    }


def _head_flags(family: DraftFamily, keys: set[str], layers: int) -> dict[str, bool]:
    """Bias / q-k norm flags of the head's layer, read from the head's own keys."""
    def has(stem: str) -> bool:
        return family.key_for(stem, layers) in keys

    return dict(is_qkv_bias=has("self_attn.q_proj.bias"), is_o_bias=has("self_attn.o_proj.bias"),
                is_mlp_bias=has("mlp.gate_proj.bias"))


def _head_attention(cfg: ModelConfig, family: DraftFamily) -> ModelConfig:
    """``cfg`` with every layer of the head family's :attr:`DraftFamily.layer_type`: full
    attention (no window), or a sliding layer of the target's (:attr:`ModelConfig.swa`: its
    window, KV heads, sink logits and RoPE).

    Raises
    ------
    UnsupportedError
        A sliding head on a target without :attr:`ModelConfig.swa` (a ``model_type`` outside
        ``speccal.runner.swa_config.SLIDING_FAMILIES``).
    """
    if family.layer_type == "full_attention":
        return dataclasses.replace(cfg, sliding_windows=(), swa=None, sliding_rope=None)
    if cfg.swa is None:
        raise UnsupportedError(
            f"draft family {family.name!r}: its layer is a {family.layer_type} layer shaped as "
            f"the target's, and model_type {cfg.extra.get('model_type')!r} has no such layer "
            "the runner knows (speccal.runner.swa_config.SLIDING_FAMILIES)")
    every = tuple(range(cfg.num_hidden_layers))
    window = cfg.swa.window  # 0 where the engine's context fits in it (for_context)
    return dataclasses.replace(cfg, sliding_windows=(window,) * len(every) if window else (),
                               swa=dataclasses.replace(cfg.swa, layers=every))


def draft_config(cfg: ModelConfig, family: DraftFamily, keys: set[str] | None) -> ModelConfig:
    """The draft layer's config: the target's shapes, biases / q-k norm read from the draft
    keys, the attention of its family's layer type (:func:`_head_attention`: full, or the
    target's sliding layers'), and the routed-expert MLP where the head's keys name a router
    (``<prefix>mlp.gate.weight``; its score bias and shared-expert gate read from the head's
    keys too), else the dense one.

    The head builds its one layer as layer 0; a routed head marks every layer index sparse, so
    layer 0 is and no dense width is asked for."""
    cfg = _head_attention(cfg, family)
    layers = cfg.num_hidden_layers
    moe = cfg.moe
    if moe is not None and keys is not None:
        def has(stem: str) -> bool:
            return family.key_for(stem, layers) in keys

        moe = None if not has("mlp.gate.weight") else dataclasses.replace(
            moe, has_score_bias=has("mlp.gate.e_score_correction_bias"),
            is_shared_gated=has("mlp.shared_expert_gate.weight"))
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=tuple(range(layers)))
    elif cfg.moe is not None and cfg.intermediate_size < 1:
        raise InputError("config.json:intermediate_size", None,
                         f"a value: the MTP head's layer has a dense SwiGLU MLP (no "
                         f"{family.key_for('mlp.gate.weight', layers)} router tensor)")
    cfg = dataclasses.replace(cfg, moe=moe)
    if keys is None:
        return cfg
    return dataclasses.replace(
        cfg,
        **_head_flags(family, keys, layers),
        is_qk_norm=family.key_for("self_attn.q_norm.weight", layers) in keys,
    )


def _draft_shapes(cfg: ModelConfig, family: DraftFamily) -> dict[str, tuple[int, ...]]:
    with on_meta():
        head = MTPHead(cfg, family)
    shapes = dict(head.named_parameters())
    return {
        key: tuple(shapes[name].shape)
        for name, key in head.param_key_map(cfg.num_hidden_layers).items()
    }


def _fill(
    module: torch.nn.Module,
    key_map: dict[str, str],
    source: TensorSource,
    keys: set[str],
    dtype,
    device,
    what: str,
) -> set[str]:  # the keys consumed
    params = dict(module.named_parameters())
    # modules that keep float32 parameters whatever the model dtype (a sigmoid MoE router)
    keep32 = {f"{prefix}.{name}" for prefix, m in module.named_modules()
              if getattr(m, "is_float32", False) for name, _ in m.named_parameters()}
    for name, key in key_map.items():
        p = params[name]
        if key not in keys:
            raise InputError(
                f"checkpoint tensor {key}",
                "missing",
                f"a tensor of shape {tuple(p.shape)} for the {what}",
            )
        shape = tuple(source.shape(key))
        if shape != tuple(p.shape):
            raise InputError(
                f"checkpoint tensor {key}", shape, f"shape {tuple(p.shape)} for the {what}"
            )
        with torch.no_grad():
            p.data = source.get(key, shape, torch.float32 if name in keep32 else dtype, device)
    return set(key_map.values())


def _empty(device: torch.device, cls: type[torch.nn.Module], *args) -> torch.nn.Module:
    """``cls(*args)`` built on the meta device, then uninitialised storage on ``device`` for
    every parameter and buffer (the loader fills them).

    What ``Module.to_empty`` does, with ``torch.empty`` of each tensor's shape and dtype rather
    than its ``empty_like`` of the meta tensor: that one runs through ``torch._refs`` and
    imports sympy (seconds of a cold start on a host without bytecode; ``device.on_meta``).
    """
    with on_meta():
        module = cls(*args)
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def build(
    cfg: ModelConfig,
    source: TensorSource,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    max_positions: int,
    need_draft: bool,
) -> tuple[TargetModel, MTPHead | None, DraftFamily | None]:
    """Build target and draft from ``source`` (see module docstring for the refusals).

    ``cfg``'s sliding windows are taken for ``max_model_len`` (``ModelConfig.for_context``)."""
    keys = set(source.keys())
    cfg = cfg.for_context(max_model_len)
    layers = cfg.num_hidden_layers
    found = recognise(cfg.extra, keys, layers, need_head=need_draft)
    target = _empty(device, TargetModel, cfg, 1, 1)
    target_keys = {k for k in keys if not is_any_draft_key(k, layers)}
    key_map = {name: name for name, _ in target.named_parameters()}
    if cfg.tie_word_embeddings:
        key_map.pop("lm_head.weight", None)
    used = _fill(target, key_map, source, target_keys, dtype, device, "target")
    if cfg.tie_word_embeddings:
        target.lm_head.weight = target.model.embed_tokens.weight
    target.rotary = RotaryTable(cfg, max_positions, max_model_len).to(device)
    target.eval()
    head = None
    if found is not None and need_draft:
        family = found[0]
        head = _empty(device, MTPHead, draft_config(cfg, family, keys), family)
        used |= _fill(head, head.param_key_map(layers), source, keys, dtype, device,
                      f"MTP head ({family.name})")
        head.eval()
    check_consumed(keys, used, "target or its MTP head", is_tied=cfg.tie_word_embeddings,
                   is_head_dropped=head is None, num_layers=layers)
    return target, head, found[0] if found else None


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise InputError("dtype", name, f"one of {', '.join(table)}")
    return table[name]


def preset_fingerprint(name: str, seed: int, shapes: dict[str, tuple[int, ...]]) -> str:
    h = hashlib.sha256(f"preset:{name}:seed={seed}".encode())
    for key in sorted(shapes):
        h.update(f"{key}:{shapes[key]}".encode())
    return "preset:" + h.hexdigest()[:32]


def load_model(
    model: str,
    *,
    device: torch.device,
    dtype: str,
    seed: int = 0,
    max_model_len: int,
    max_positions: int,
    need_draft: bool = True,
    draft_family: str | None = None,
) -> LoadedModel:
    """Load ``model`` (a preset name or an HF checkpoint folder) onto ``device``.

    Parameters
    ----------
    draft_family : str, optional
        Presets only: key layout of the random MTP head (a :data:`REGISTRY` name); default the
        preset's own.

    Raises
    ------
    InputError
        Unknown preset / folder, missing tensor, shape mismatch, bad dtype.
    UnsupportedError
        A refused draft family or depth count, or an unsupported target structure.
    """
    torch_dtype = _dtype(dtype)
    if model in HYBRID_PRESETS:
        return _load_hybrid_preset(model, device=device, dtype=dtype, seed=seed,
                                   max_model_len=max_model_len, max_positions=max_positions,
                                   need_draft=need_draft, draft_family=draft_family)
    if model in PRESETS:
        preset = PRESETS[model]
        fam_name = draft_family or preset.family
        if fam_name not in REGISTRY:
            raise InputError("draft_family", fam_name, f"one of {', '.join(REGISTRY)}")
        family = REGISTRY[fam_name]
        cfg = config_from_hf({**preset.config, "architectures": [f"preset:{preset.name}"]})
        shapes = _target_shapes(cfg)
        shapes.update(_draft_shapes(draft_config(cfg, family, None), family))
        source = RandomSource(preset, shapes, seed, family, cfg.num_hidden_layers)
        fingerprint = preset_fingerprint(f"{model}/{fam_name}", seed, shapes)
        target, draft, fam = build(
            cfg,
            source,
            device=device,
            dtype=torch_dtype,
            max_model_len=max_model_len,
            max_positions=max_positions,
            need_draft=need_draft,
        )
        desc = f"preset {model!r} ({preset.description}, RANDOM weights of seed {seed}: its text is meaningless)"
        return LoadedModel(
            target,
            draft,
            cfg,
            fam,
            fingerprint,
            cfg.architecture,
            True,
            desc,
            None,
            target.capabilities,
            cfg.num_hidden_layers,
        )
    if not Path(model).exists():
        raise InputError(
            "model", model,
            f"a preset ({', '.join([*PRESETS, *HYBRID_PRESETS])}) or an existing checkpoint "
            "folder",
        )
    folder = SafetensorsFolder(model)
    source = per_expert(folder)  # stacked experts read as per-expert tensors
    keys = source.keys()
    if is_hybrid_config(folder.config):
        return _load_hybrid_folder(folder, device=device, dtype=dtype,
                                   max_model_len=max_model_len, max_positions=max_positions,
                                   need_draft=need_draft)
    cfg = config_from_hf(folder.config, keys)
    if need_draft and recognise(cfg.extra, keys, cfg.num_hidden_layers) is None:
        raise UnsupportedError(
            f"checkpoint {model} has no MTP head (no draft family's tensors found): speculative "
            "decoding needs one; run plain decoding instead (speccal generate --plain)"
        )
    target, draft, fam = build(
        cfg,
        source,
        device=device,
        dtype=torch_dtype,
        max_model_len=max_model_len,
        max_positions=max_positions,
        need_draft=need_draft,
    )
    desc = f"checkpoint {model} ({cfg.architecture})"
    tok = folder.path if folder.has_tokenizer() else None
    return LoadedModel(
        target,
        draft,
        cfg,
        fam,
        folder.fingerprint(),
        cfg.architecture,
        False,
        desc,
        tok,
        target.capabilities,
        cfg.num_hidden_layers,
    )


# where a checkpoint keeps the text stack (``model.X`` of HybridModel): a causal LM's own, or
# the language model of a vision-language checkpoint (Qwen3.5's published ones), with the
# tensors that layout holds besides the text model (the vision tower, not read) and why
TEXT_PREFIXES = ("model.", "model.language_model.")
TEXT_PREFIX_IGNORED: dict[str, tuple[tuple[str, str], ...]] = {
    "model.": (),
    "model.language_model.": (
        ("model.visual.", "the vision tower of a vision-language checkpoint (the text model "
                          "is served)"),),
}


def text_prefix(keys: set[str]) -> str:
    """The :data:`TEXT_PREFIXES` entry under which ``keys`` hold ``embed_tokens.weight``."""
    found = [p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in keys]
    if len(found) != 1:
        raise InputError("checkpoint tensor names", sorted(p + "embed_tokens.weight"
                                                           for p in found) or "none",
                         f"exactly one of {[p + 'embed_tokens.weight' for p in TEXT_PREFIXES]}")
    return found[0]


def _build_hybrid(cfg: HybridConfig, source: TensorSource, device: torch.device,
                  dtype: torch.dtype, max_model_len: int, max_positions: int,
                  consumed: dict | None = None) -> HybridModel:
    """The hybrid target; ``consumed``, when given, gets the keys filled (``"used"``) and the
    :func:`ignored_reason` arguments of the layout (the caller checks after the head); without
    it the target is checked alone (no head built)."""
    layers = cfg.base.num_hidden_layers
    target = _empty(device, HybridModel, cfg, 1, 1)
    prefix = text_prefix(set(source.keys()))
    key_map = {name: prefix + name.removeprefix("model.") if name.startswith("model.") else name
               for name, _ in target.named_parameters()}
    if cfg.base.tie_word_embeddings:
        key_map.pop("lm_head.weight", None)
    target_keys = {k for k in source.keys() if not is_any_draft_key(k, layers)}
    used = _fill(target, key_map, source, target_keys, dtype, device, "hybrid target")
    if cfg.base.tie_word_embeddings:
        target.lm_head.weight = target.model.embed_tokens.weight
    target.rotary = RotaryTable(cfg.base, max_positions, max_model_len).to(device)
    target.eval()
    ignored = dict(is_tied=cfg.base.tie_word_embeddings, num_layers=layers,
                   extra=TEXT_PREFIX_IGNORED[prefix])
    if consumed is None:
        check_consumed(set(source.keys()), used, "hybrid target", is_head_dropped=True,
                       **ignored)
    else:
        consumed.update(used=used, ignored=ignored)
    return target


def hybrid_head_config(cfg: HybridConfig, family: DraftFamily,
                       keys: set[str] | None) -> HybridConfig:
    """The head layer's config: the target's, with biases read from the head's own keys and
    the routed MoE MLP only where they name a router (``<prefix>mlp.gate.weight``); ``keys``
    None keeps the target's."""
    if keys is None:
        return cfg
    layers = cfg.base.num_hidden_layers
    cfg = dataclasses.replace(cfg, base=dataclasses.replace(
        cfg.base, **_head_flags(family, keys, layers)))
    if cfg.moe is None or family.key_for("mlp.gate.weight", layers) in keys:
        return cfg
    if cfg.base.intermediate_size < 1:
        raise InputError("config.json:intermediate_size", None,
                         f"a value: the MTP head's layer has a dense SwiGLU MLP (no "
                         f"{family.key_for('mlp.gate.weight', layers)} router tensor)")
    return dataclasses.replace(cfg, moe=None)


def _hybrid_head_shapes(cfg: HybridConfig, family: DraftFamily) -> dict[str, tuple[int, ...]]:
    with on_meta():
        head = HybridMTPHead(cfg, family)
    shapes = dict(head.named_parameters())
    return {key: tuple(shapes[name].shape)
            for name, key in head.param_key_map(cfg.base.num_hidden_layers).items()}


def _build_hybrid_head(cfg: HybridConfig, family: DraftFamily, source: TensorSource,
                       device: torch.device, dtype: torch.dtype
                       ) -> tuple[HybridMTPHead, set[str]]:  # the head, the keys it consumed
    keys = set(source.keys())
    head = _empty(device, HybridMTPHead, hybrid_head_config(cfg, family, keys), family)
    used = _fill(head, head.param_key_map(cfg.base.num_hidden_layers), source, keys, dtype,
                 device, f"MTP head ({family.name})")
    head.eval()
    return head, used


def _hybrid_loaded(cfg: HybridConfig, source: TensorSource, *, device, dtype: str,
                   max_model_len: int, max_positions: int, need_draft: bool,
                   fingerprint: str, is_random: bool, description: str,
                   tokenizer_path: Path | None) -> LoadedModel:
    """Target + head of a hybrid checkpoint or preset (family recognised from the keys)."""
    torch_dtype = _dtype(dtype)
    layers = cfg.base.num_hidden_layers
    found = recognise(cfg.base.extra, source.keys(), layers, target_structure="hybrid")
    consumed: dict = {}
    target = _build_hybrid(cfg, source, device, torch_dtype, max_model_len, max_positions,
                           consumed)
    head = None
    used = consumed["used"]
    if found is not None and need_draft:
        head, head_used = _build_hybrid_head(cfg, found[0], source, device, torch_dtype)
        used = used | head_used
    check_consumed(set(source.keys()), used, "hybrid target or its MTP head",
                   is_head_dropped=head is None, **consumed["ignored"])
    return LoadedModel(target, head, cfg.base, found[0] if found else None, fingerprint,
                       cfg.base.architecture, is_random, description, tokenizer_path,
                       target.capabilities, target.num_kv_layers, cfg)


def _load_hybrid_folder(folder: SafetensorsFolder, *, device, dtype: str, max_model_len: int,
                        max_positions: int, need_draft: bool) -> LoadedModel:
    source = per_expert(folder)
    keys = source.keys()
    cfg = hybrid_config_from_hf(folder.config, keys)
    if need_draft and recognise(cfg.base.extra, keys, cfg.base.num_hidden_layers,
                                target_structure="hybrid") is None:
        raise UnsupportedError(
            f"checkpoint {folder.path} has no MTP head (no draft family's tensors found): "
            "speculative decoding needs one; run plain decoding instead (speccal generate "
            "--plain)"
        )
    tok = folder.path if folder.has_tokenizer() else None
    return _hybrid_loaded(cfg, source, device=device, dtype=dtype, max_model_len=max_model_len,
                          max_positions=max_positions, need_draft=need_draft,
                          fingerprint=folder.fingerprint(), is_random=False,
                          description=f"checkpoint {folder.path} ({cfg.base.architecture})",
                          tokenizer_path=tok)


def _hybrid_preset_source(name: str, seed: int, overrides: dict | None,
                          draft_family: str | None) -> tuple[HybridConfig, HybridRandomSource,
                                                             str]:
    if name not in HYBRID_PRESETS:
        raise InputError("hybrid preset", name, f"one of {', '.join(HYBRID_PRESETS)}")
    preset = HYBRID_PRESETS[name]
    fam_name = draft_family or preset.family
    if fam_name not in REGISTRY:
        raise InputError("draft_family", fam_name, f"one of {', '.join(REGISTRY)}")
    raw = {**preset.config, **(overrides or {}), "architectures": [f"preset:{name}"]}
    if "num_hidden_layers" in (overrides or {}) and "layer_types" not in (overrides or {}):
        raw["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
        raw["layer_types"] = raw["layer_types"] * (raw["num_hidden_layers"] // 4)
    cfg = hybrid_config_from_hf(raw)
    with on_meta():
        shapes = {k: tuple(v.shape) for k, v in HybridModel(cfg, 1, 1).state_dict().items()}
    if cfg.base.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    shapes.update(_hybrid_head_shapes(cfg, REGISTRY[fam_name]))
    fingerprint = preset_fingerprint(f"{name}/{fam_name}", seed, shapes)
    source = HybridRandomSource(preset, shapes, seed, REGISTRY[fam_name],
                                cfg.base.num_hidden_layers)
    return cfg, source, fingerprint


def _load_hybrid_preset(name: str, *, device, dtype: str, seed: int, max_model_len: int,
                        max_positions: int, need_draft: bool,
                        draft_family: str | None) -> LoadedModel:
    cfg, source, fingerprint = _hybrid_preset_source(name, seed, None, draft_family)
    desc = (f"preset {name!r} ({HYBRID_PRESETS[name].description}, RANDOM weights of seed "
            f"{seed}: its text is meaningless)")
    return _hybrid_loaded(cfg, source, device=device, dtype=dtype, max_model_len=max_model_len,
                          max_positions=max_positions, need_draft=need_draft,
                          fingerprint=fingerprint, is_random=True, description=desc,
                          tokenizer_path=None)


def hybrid_preset(
    name: str,
    *,
    device: torch.device,
    dtype: str,
    seed: int = 0,
    max_model_len: int,
    max_positions: int,
    overrides: dict | None = None,
) -> tuple[HybridModel, HybridConfig]:
    """A :data:`HYBRID_PRESETS` shape with seeded random weights (text is meaningless).

    ``overrides`` replaces config fields (tests shrink the shape: ``hidden_size``,
    ``num_hidden_layers`` (a multiple of 4 keeps the 3 + 1 layer pattern), head counts...).
    """
    cfg, source, _ = _hybrid_preset_source(name, seed, overrides, None)
    model = _build_hybrid(cfg, source, device, _dtype(dtype), max_model_len, max_positions)
    return model, cfg


def load_hybrid(
    model: str | Path,
    *,
    device: torch.device,
    dtype: str,
    max_model_len: int,
    max_positions: int,
) -> tuple[HybridModel, HybridConfig]:
    """Load only the hybrid linear-attention target of an HF folder (no head).

    The draft head's keys (``mtp.*`` for ``qwen3_5_mtp``) are dropped by the same descriptor
    the draft loader uses. Missing tensors and shape mismatches are refused by name.

    Raises
    ------
    InputError
        Not a folder, missing or misshapen tensor, bad dtype, a config without linear layers.
    """
    folder = per_expert(SafetensorsFolder(model))
    cfg = hybrid_config_from_hf(folder.config, folder.keys())
    target = _build_hybrid(cfg, folder, device, _dtype(dtype), max_model_len, max_positions)
    return target, cfg
