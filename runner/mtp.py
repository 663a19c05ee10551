"""The MTP draft head (DeepSeek-V3 / MiMo form), structured by a draft-family descriptor.

This module owns :class:`MTPHead`. One step over ``N`` flat rows takes the target's (or its own
previous) hidden state ``[N, hidden]`` and the next token ``[N]``, and returns the hidden state to
feed back ``[N, hidden]`` plus the vector the LM head reads. The head's single decoder layer keeps
its own paged KV cache (same block table and positions as the target's).

Tensor parallelism: the head's layer is sharded as the target's (``speccal.runner.layers``), its
own embedding and LM head (when the family has them) by vocabulary rows; with a TP group bound
the embedding is vocabulary-parallel, :meth:`MTPHead.logits` gathers the shards and
:meth:`MTPHead.greedy_draft` picks the token and its probability from them without a gather.
"""

from __future__ import annotations

import torch
from torch import nn

from speccal.kernels import ops
from speccal.runner.attention import AttnMeta
from speccal.runner.config import ModelConfig
from speccal.runner.distributed.tp import (
    TPBound,
    vocab_argmax,
    vocab_embed,
    vocab_gather,
    vocab_token_probability,
)
from speccal.runner.draft_families import DraftFamily
from speccal.runner.layers import RMSNorm
from speccal.runner.mla import decoder_layer
from speccal.runner.model import TargetModel, fused_head
from speccal.runner.moe import bind_real_rows
from speccal.runner.path import PathBound


class MTPHead(TPBound, PathBound, nn.Module):
    """One MTP depth: fusion of normed embedding and hidden state, one decoder layer, a head.

    Parameters
    ----------
    cfg : ModelConfig
        The draft layer's config (the target's shapes; bias / q-k norm from the draft's keys).
    family : DraftFamily
        Which optional parts (own final norm, LM head, embedding) exist and the concat order.
    """

    def __init__(self, cfg: ModelConfig, family: DraftFamily):
        super().__init__()
        self._init_path()
        h = cfg.hidden_size
        self.config = cfg  # the head layer's (its KV cache shape: ModelConfig.kv_cache_dims)
        self.family = family
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.layer = decoder_layer(cfg)
        self.final_norm = RMSNorm(h, cfg.rms_norm_eps) if family.final_norm else None
        self.head = nn.Linear(h, cfg.vocab_size, bias=False) if family.head else None
        self.embed = nn.Embedding(cfg.vocab_size, h) if family.embed else None

    def forward(
        self,
        target: TargetModel,
        hidden: torch.Tensor,  # [N, hidden]: target hidden (or this head's previous output)
        input_ids: torch.Tensor,  # [N] int64: the token after the hidden's position
        positions: torch.Tensor,  # [N] int64: the hidden's position
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # feedback [N, hidden], normed [N, hidden]
        bind_real_rows(self, meta.slot_mapping, kv[0].shape[1])
        embed = self.embed if self.embed is not None else target.model.embed_tokens
        e = self.embed_norm(vocab_embed(embed, input_ids, self.tp))
        h = self.hidden_norm(hidden)
        parts = {"embed": e, "hidden": h}
        x = self.proj(torch.cat([parts[name] for name in self.family.concat_order], dim=-1))
        x = self.layer(x, positions, meta, kv, target.rotary)
        norm = self.final_norm if self.final_norm is not None else target.model.norm
        normed = norm(x)
        return (normed if self.family.is_feedback_normed else x), normed

    def logits(self, target: TargetModel, normed: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32 through the head's own or the target's LM head
        (under TP the vocabulary shards gathered)."""
        return vocab_gather(self.local_logits(target, normed), self.tp).float()

    def local_logits(self, target: TargetModel, normed: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard ``[N, V / tp]`` of the draft logits, float32."""
        head = self.head if self.head is not None else target.lm_head
        if fused_head(normed, self.path):
            return ops.linear(normed.contiguous(), head.weight, tune=self.kx).float()
        return head(normed).float()

    def greedy_draft(self, target: TargetModel, normed: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # [N] int64, [N] float32
        """The draft token (argmax) and its probability (the adaptive-verify score,
        ``sampling.draft_token_probability``) of each row; under TP from the vocabulary shards
        by ``[N]`` reductions, never gathering the logits."""
        local = self.local_logits(target, normed)
        tok = vocab_argmax(local, self.tp)
        return tok, vocab_token_probability(local, tok, self.tp)

    def param_key_map(self, num_target_layers: int) -> dict[str, str]:
        """Module parameter name -> checkpoint key, from the family descriptor."""
        fam = self.family
        out = {}
        for name, _ in self.named_parameters():
            first, _, rest = name.partition(".")
            stem = {
                "embed_norm": fam.embed_norm,
                "hidden_norm": fam.hidden_norm,
                "proj": fam.proj,
                "final_norm": fam.final_norm,
                "head": fam.head,
                "embed": fam.embed,
            }.get(first)
            key_stem = fam.layer_stem(rest) if first == "layer" else f"{stem}.{rest}"
            out[name] = fam.key_for(key_stem, num_target_layers)
        return out
