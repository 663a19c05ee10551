"""The target model: a config-driven dense decoder and its declared capabilities.

This module owns :class:`TargetModel` (HF parameter names: ``model.embed_tokens``,
``model.layers.N.*``, ``model.norm``, ``lm_head``) and :class:`ModelCapabilities`, the data the
runner asks instead of model names. Forwards run on ``N`` flat rows; the returned hidden states
``[N, hidden]`` are *after* the final norm (what the MTP head consumes and the LM head reads).

Tensor parallelism (``speccal.runner.distributed``): a rank's model is built from its local
config (vocabulary divided by ``tp``), so ``embed_tokens`` and ``lm_head`` hold its vocabulary
rows; once a TP group is bound (:class:`TPBound`) the embedding is vocabulary-parallel,
:meth:`TargetModel.logits` gathers the shards (sampling needs the whole distribution) and
:meth:`TargetModel.argmax_partials` / :meth:`TargetModel.greedy_tokens` reduce the shards'
``(max, index)`` pairs instead (no logits gathered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from speccal.kernels import ops
from speccal.runner.attention import AttnMeta
from speccal.runner.config import ModelConfig
from speccal.runner.distributed.tp import TPBound, vocab_argmax, vocab_embed, vocab_gather
from speccal.runner.layers import RMSNorm
from speccal.runner.mla import decoder_layer, link_shared_index
from speccal.runner.moe import bind_real_rows
from speccal.runner.path import ExecutionPath, PathBound
from speccal.runner.rope import RotaryTable

# rows up to which an LM head runs on the fused GEMV kernels (``fused_head``); past them the
# torch matmul, whose tensor-core tiles win at many rows
FUSED_HEAD_MAX_ROWS = 64


def fused_head(hidden: torch.Tensor, path: ExecutionPath) -> bool:
    """Whether an LM head over ``hidden [N, H]`` runs on the fused GEMV kernels under ``path``."""
    return path.fused(hidden) and hidden.shape[0] <= FUSED_HEAD_MAX_ROWS


@dataclass(frozen=True)
class ModelCapabilities:
    """What a target declares about speculative verification (cached at load).

    Attributes
    ----------
    requires_causal_chunked_prefill : bool
        Verification rows must be processed as a causal chunk (true for every attention target).
    supports_in_graph_input_update : bool
        Token/metadata updates of the verify input may run inside the captured target graph.
    has_recurrent_state : bool
        The target keeps state that cannot roll back like KV (hybrid linear attention).
    """

    requires_causal_chunked_prefill: bool = True
    supports_in_graph_input_update: bool = True
    has_recurrent_state: bool = False


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        if cfg.mla is not None and cfg.mla.index_shared:
            link_shared_index(self.layers)  # GLM-5: layers reusing an earlier layer's top-k
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(TPBound, PathBound, nn.Module):
    """Dense decoder-only LM (Llama / Mistral / Qwen2 / Qwen3 / MiMo family) over a paged KV
    cache."""

    def __init__(self, cfg: ModelConfig, max_positions: int, max_model_len: int):
        super().__init__()
        self._init_path()
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryTable(cfg, max_positions, max_model_len)
        self.capabilities = ModelCapabilities()

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (k, v) per layer
    ) -> torch.Tensor:  # [N, hidden], after the final norm
        layers = self.model.layers
        bind_real_rows(self, meta.slot_mapping, kv_caches[0][0].shape[1])
        # decode / verify rows on Triton (the ids have the rows' device and count)
        if all(layer.can_fuse(input_ids, self.rotary) for layer in layers):
            return self._forward_fused(input_ids, positions, meta, kv_caches)
        x = vocab_embed(self.model.embed_tokens, input_ids, self.tp)
        residual = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer.forward_residual(x, residual, positions, meta, kv, self.rotary)
        norm = self.model.norm
        if self.path.fused(x):
            return ops.rms_norm(x, norm.weight, norm.eps, residual=residual, tune=self.kx)
        return norm(x + residual)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Decode / verify rows through the fused layers: one launch gathers the embedding rows
        (the residual stream ``h``, updated in place by the layers) and writes layer 0's input
        norm of them; each layer's down GEMV defers the next layer's input norm into that layer's
        QKV GEMV (``NormFusion.defer_input`` of the step's rows; else its reduce writes the norm,
        two buffers alternating), and the last one's reduce writes the final norm."""
        kx = self.kx
        layers = self.model.layers
        ln = layers[0].input_layernorm
        h, normed = ops.embed_rms_norm(input_ids, self.model.embed_tokens.weight, ln.weight,
                                       ln.eps, tune=kx)
        spare = torch.empty_like(h)
        defer = kx.norm.defer_input(input_ids.shape[0])
        for i, (layer, kv) in enumerate(zip(layers, kv_caches, strict=True)):
            last = i + 1 == len(layers)
            nxt = self.model.norm if last else layers[i + 1].input_layernorm
            out = None if defer and not last else spare  # deferred into the next QKV GEMV
            nxt_in = layer.forward_fused_to_next(h, positions, meta, kv, self.rotary,
                                                 fuse_rope=True, normed=normed,
                                                 next_norm=(nxt, out))
            if out is not None:
                spare = normed if isinstance(normed, torch.Tensor) else torch.empty_like(h)
            normed = nxt_in
        return normed

    def fuse_weights(self) -> None:
        """Concatenate q/k/v and gate/up weights (views keep the parameters): fewer launches."""
        for layer in self.model.layers:
            layer.self_attn.fuse_weights()
            layer.mlp.fuse_weights()

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]``, float32 unless ``upcast`` is False (the argmax-only
        greedy path: the bf16 logits' argmax is the same index, with no fp32 copy to write).
        Under TP the vocabulary shards are gathered."""
        out = vocab_gather(self.local_logits(hidden), self.tp)
        return out.float() if upcast else out

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, V / tp]
        """This rank's vocabulary shard of the logits (all of them on one rank), model dtype."""
        if fused_head(hidden, self.path):
            return ops.linear(hidden.contiguous(), self.lm_head.weight, tune=self.kx)
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [N] int64
        """``argmax`` of each row's logits; under TP from the shards' ``(max, index)`` pairs
        (``vocab_argmax``: one ``[N]`` all-reduce, no logits gathered)."""
        return vocab_argmax(self.local_logits(hidden), self.tp)

    def argmax_partials(
        self,
        hidden: torch.Tensor,  # [N, hidden]
        keys: torch.Tensor | None = None,  # [N] int64 zeros (ops.ArgmaxKeys), fused kernels only
    ):  # [N] tokens, ([N, T] fp32, [N, T] int32) partials or ops.ArgmaxKeys
        """The argmax of each row's logits, for ``ops.verify_accept``, which takes every form:
        on the fused kernels (``fused_head``) the LM head GEMV's packed per-row keys where ``keys``
        is given (zeros: ``ops.verify_metadata_update(argmax_keys=...)``), else its per-tile
        partials (``ops.linear_argmax``: no logits written, no argmax launch); off them ``[N]``
        tokens from :meth:`logits` (the same index: the argmax of the same bf16 logits). Under
        TP ``[N]`` tokens from :meth:`greedy_tokens` (the per-tile partials are one shard's)."""
        if self.tp is not None and self.tp.tp_size > 1:
            return self.greedy_tokens(hidden)
        if fused_head(hidden, self.path):
            return ops.linear_argmax(hidden.contiguous(), self.lm_head.weight, keys=keys,
                                     tune=self.kx)
        return self.logits(hidden, upcast=False).argmax(dim=-1)
