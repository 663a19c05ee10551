"""Draft-family registry: one descriptor per MTP head layout, recognised from the checkpoint.

This module owns :class:`DraftFamily` (structure, key names, how to recognise the head from the
checkpoint's own config and tensor names) and :data:`REGISTRY`. The draft loader maps module
parameters to checkpoint keys with :meth:`DraftFamily.key_for`; the *target* loader drops every
key :meth:`DraftFamily.is_draft_key` claims, from the same descriptor. Nothing here or in the
runner tests a model name: adding a family is one descriptor plus one registry entry.

Head structure (DeepSeek-V3 / MiMo / Qwen3.5 form, one depth composed, run ``k`` times):
``h' = layer(proj(cat(order of [embed_norm(embed(token)), hidden_norm(hidden)])))``; logits
``= head(final_norm(h'))`` where ``final_norm`` / ``head`` / ``embed`` fall back to the target's
final norm / LM head / embedding when the family has none; the hidden fed to the next step is
``final_norm(h')`` when ``is_feedback_normed`` else ``h'``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from speccal.base.errors import InputError, UnsupportedError
from speccal.runner.config import MTP_DEPTH_FIELDS


@dataclass(frozen=True)
class DraftFamily:
    """Descriptor of one MTP-head checkpoint layout.

    Attributes
    ----------
    name : registry key.
    key_regex : regular expression matching the family's tensor names; its ``index`` group is
        the depth (or the layer number when ``is_index_after_target_layers``).
    prefix : format string of one depth's key prefix (``{depth}``, ``{layer}`` = target layers +
        depth).
    head_prefix : prefix of the head-level stems (fusion norms and projection, final norm, own
        LM head / embedding) when they sit outside the depth's prefix (Qwen3.5: ``mtp.fc`` next
        to ``mtp.layers.0.*``); None: under ``prefix``.
    is_index_after_target_layers : the head's layers are numbered after the target's
        (``model.layers.{num_hidden_layers + depth}``).
    embed_norm, hidden_norm, proj : key stems (under the prefix) of the fusion block.
    concat_order : order of the normed ``"embed"`` and ``"hidden"`` halves fed to ``proj``.
    final_norm, head, embed : the head's own final norm / LM head / embedding stems, or None to
        use the target's.
    is_feedback_normed : the hidden fed back to the next draft step is after ``final_norm``.
    max_composed_depths : MTP depths the runner composes (one layer run ``k`` times).
    target_structure : the target structure whose full-attention layer the head's layer is:
        ``dense`` (``speccal.runner.mtp.MTPHead``: RMSNorm, the dense decoder layer) or
        ``hybrid`` (``speccal.runner.hybrid.HybridMTPHead``: zero-centred norms, gated
        attention). A head on a target of the other structure is refused.
    layer_type : the target's ``layer_types`` kind the head's layer is built as:
        ``full_attention``, or ``sliding_attention`` (the target's window, and where the
        target's sliding layers have them their KV head count, sink logits and RoPE:
        ``speccal.runner.swa_config``).
    layer_renames : ``(module stem prefix, checkpoint stem prefix)`` pairs of the head's layer
        whose checkpoint name differs from the target layers' (MiMo-V2-Flash:
        ``pre_mlp_layernorm.`` for ``post_attention_layernorm.``).
    refusal : if set, the family is recognised but refused at construction with this reason.
    """

    name: str
    key_regex: str
    prefix: str
    head_prefix: str | None = None
    is_index_after_target_layers: bool = False
    embed_norm: str = "enorm"
    hidden_norm: str = "hnorm"
    proj: str = "eh_proj"
    concat_order: tuple[str, str] = ("embed", "hidden")
    final_norm: str | None = None
    head: str | None = None
    embed: str | None = None
    is_feedback_normed: bool = False
    max_composed_depths: int = 1
    target_structure: str = "dense"
    layer_type: str = "full_attention"
    layer_renames: tuple[tuple[str, str], ...] = ()
    refusal: str | None = None

    def _match(self, key: str, num_target_layers: int) -> int | None:
        m = re.match(self.key_regex, key)
        if m is None:
            return None
        index = m.groupdict().get("index")
        depth = int(index) if index is not None else 0
        if self.is_index_after_target_layers:
            depth -= num_target_layers
        return depth if depth >= 0 else None

    def is_draft_key(self, key: str, num_target_layers: int) -> bool:
        """Whether ``key`` belongs to this family's head (the target loader drops it)."""
        return self._match(key, num_target_layers) is not None

    def depths(self, keys: Iterable[str], num_target_layers: int) -> set[int]:
        """The MTP depths whose tensors appear among ``keys``."""
        out = set()
        for key in keys:
            d = self._match(key, num_target_layers)
            if d is not None:
                out.add(d)
        return out

    def key_for(self, stem: str, num_target_layers: int, depth: int = 0) -> str:
        """Checkpoint key of ``stem`` (e.g. ``eh_proj.weight``) at ``depth``."""
        pre = self.prefix
        if self.head_prefix is not None and self.is_head_stem(stem):
            pre = self.head_prefix
        return pre.format(depth=depth, layer=num_target_layers + depth) + stem

    def layer_stem(self, stem: str) -> str:
        """The checkpoint stem (under the prefix) of the head layer's module stem ``stem``."""
        for module, key in self.layer_renames:
            if stem.startswith(module):
                return key + stem[len(module):]
        return stem

    def is_head_stem(self, stem: str) -> bool:
        """Whether ``stem`` names a head-level part (fusion, final norm, head, embedding)."""
        parts = (self.embed_norm, self.hidden_norm, self.proj, self.final_norm, self.head,
                 self.embed)
        return any(p is not None and stem.startswith(p + ".") for p in parts)


REGISTRY: dict[str, DraftFamily] = {
    "mimo_mtp": DraftFamily(
        name="mimo_mtp",
        key_regex=r"^model\.mtp_layers\.(?P<index>\d+)\.",
        prefix="model.mtp_layers.{depth}.",
        embed_norm="token_layernorm",
        hidden_norm="hidden_layernorm",
        proj="input_proj",
        concat_order=("hidden", "embed"),
        final_norm="final_layernorm",
        is_feedback_normed=True,
    ),
    "deepseek_mtp": DraftFamily(
        name="deepseek_mtp",
        key_regex=r"^model\.layers\.(?P<index>\d+)\.",
        prefix="model.layers.{layer}.",
        is_index_after_target_layers=True,
        embed_norm="enorm",
        hidden_norm="hnorm",
        proj="eh_proj",
        concat_order=("embed", "hidden"),
        final_norm="shared_head.norm",
        head="shared_head.head",
        embed="embed_tokens",
        is_feedback_normed=False,
    ),
    # MiMo-V2-Flash (vLLM mimo_v2_flash_mtp.py reads this layout): enorm / hnorm / eh_proj /
    # final_layernorm around one sliding-window layer with sinks whose post-attention norm is
    # named pre_mlp_layernorm; the target's embedding and LM head; vLLM feeds the head's
    # final-normed output to its next step
    "mimo_v2_mtp": DraftFamily(
        name="mimo_v2_mtp",
        key_regex=r"^model\.mtp\.layers\.(?P<index>\d+)\.",
        prefix="model.mtp.layers.{depth}.",
        embed_norm="enorm",
        hidden_norm="hnorm",
        proj="eh_proj",
        concat_order=("embed", "hidden"),
        final_norm="final_layernorm",
        is_feedback_normed=True,
        layer_type="sliding_attention",
        layer_renames=(("post_attention_layernorm.", "pre_mlp_layernorm."),),
    ),
    "qwen3_5_mtp": DraftFamily(
        name="qwen3_5_mtp",
        key_regex=r"^mtp\.(?:layers\.(?P<index>\d+)\.)?",
        prefix="mtp.layers.{depth}.",
        head_prefix="mtp.",  # mtp.fc / mtp.pre_fc_norm_* / mtp.norm (vLLM qwen3_5_mtp.py)
        embed_norm="pre_fc_norm_embedding",
        hidden_norm="pre_fc_norm_hidden",
        proj="fc",
        concat_order=("embed", "hidden"),
        final_norm="norm",
        is_feedback_normed=True,  # vLLM feeds the head's normed output to the next step
        target_structure="hybrid",
    ),
}


def is_any_draft_key(key: str, num_target_layers: int) -> bool:
    """Whether any registered family claims ``key`` (the target loader drops such keys)."""
    return any(f.is_draft_key(key, num_target_layers) for f in REGISTRY.values())


def published_depths(cfg: Mapping[str, Any]) -> tuple[str, int] | None:
    """The config field that publishes MTP depths and its value, or None."""
    for field in MTP_DEPTH_FIELDS:
        if cfg.get(field):
            return field, int(cfg[field])
    return None


TARGET_STRUCTURES = {  # DraftFamily.target_structure -> what the refusal calls it
    "dense": "a dense attention decoder",
    "hybrid": "a hybrid linear-attention model (gated delta-net + gated attention layers)",
}


def recognise(
    cfg: Mapping[str, Any],
    keys: Iterable[str],
    num_target_layers: int,
    target_structure: str = "dense",
    *,
    need_head: bool = True,
) -> tuple[DraftFamily, int] | None:
    """Find the draft family of a checkpoint from its tensor names and config.

    ``target_structure``: the loaded target's (a :data:`TARGET_STRUCTURES` key); a family
    built for the other structure is refused. ``need_head`` False (plain decoding, no head
    built): a family refused as a whole (:attr:`DraftFamily.refusal`) is returned, not
    raised, so its tensors are dropped and the target still serves.

    Returns
    -------
    (family, num_depths) or None when the checkpoint has no MTP head.

    Raises
    ------
    UnsupportedError
        A recognised family that is refused, or more depths than the block composes.
    InputError
        The config publishes MTP depths but no family's tensors are present, or two families'.
    """
    keys = list(keys)
    found = []
    for fam in REGISTRY.values():
        depths = fam.depths(keys, num_target_layers)
        if depths:
            found.append((fam, depths))
    published = published_depths(cfg)
    if not found:
        if published:
            looked = ", ".join(
                f.prefix.format(depth="N", layer="L+N") + "*" for f in REGISTRY.values()
            )
            raise InputError(
                f"config.json:{published[0]}",
                published[1],
                f"MTP tensors in the checkpoint (none found; looked for {looked})",
            )
        return None
    if len(found) > 1:
        raise InputError(
            "checkpoint MTP tensors",
            sorted(f.name for f, _ in found),
            "the tensors of exactly one draft family",
        )
    fam, depths = found[0]
    if fam.refusal and not need_head:
        return fam, len(depths)
    if fam.refusal:
        raise UnsupportedError(
            f"draft family {fam.name!r} is recognised but refused: {fam.refusal}"
        )
    if fam.target_structure != target_structure:
        raise UnsupportedError(
            f"draft family {fam.name!r} is recognised but refused: its head's layer is a "
            f"layer of {TARGET_STRUCTURES[fam.target_structure]} "
            f"(target_structure={fam.target_structure!r}), and this target is "
            f"{TARGET_STRUCTURES[target_structure]}"
        )
    num_depths = max(len(depths), published[1] if published else 0)
    if num_depths > fam.max_composed_depths:
        where = f"config.json:{published[0]}={published[1]}, " if published else ""
        raise UnsupportedError(
            f"draft family {fam.name!r}: the checkpoint publishes {num_depths} MTP depths "
            f"({where}tensors for depths {sorted(depths)}) but the MTP block composes "
            f"{fam.max_composed_depths}; refusing rather than silently using a subset"
        )
    return fam, num_depths
