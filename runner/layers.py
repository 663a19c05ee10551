"""Decoder building blocks of the Qwen2 / Qwen3 / MiMo family: RMSNorm, GQA attention, SwiGLU.

This module owns one decoder layer (:class:`DecoderLayer`) shared by the target and the MTP draft
head. Parameter names match Hugging Face checkpoints (``self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``...), so a layer's ``state_dict`` loads by prefix. Layers run on ``N`` flat
token rows ``[N, hidden]``; attention reads and writes the paged KV cache through
``speccal.runner.attention`` (layout documented there).
"""

from __future__ import annotations

import torch
from torch import nn

from speccal.runner.attention import AttnMeta, attend_rows, write_kv
from speccal.runner.config import ModelConfig
from speccal.runner.rope import RotaryTable


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 as the HF models do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
    """GQA self-attention with optional q/k/v bias and per-head q/k RMSNorm (before RoPE)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = d
        self.scale = d**-0.5
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.is_qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.is_qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.is_qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        if cfg.is_qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],  # k_cache, v_cache of this layer
        rotary: RotaryTable,
    ) -> torch.Tensor:  # [N, hidden]
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = rotary(q, k, positions)
        write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        out = attend_rows(q, kv[0], kv[1], meta, self.scale)  # [N, heads, head_dim]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        positions: torch.Tensor,  # [N] int64
        meta: AttnMeta,
        kv: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryTable,
    ) -> torch.Tensor:  # [N, hidden]
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, kv, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))
