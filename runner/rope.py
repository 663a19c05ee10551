"""Rotary position embedding: inverse frequencies (with scaling) and the cos/sin table.

This module owns the RoPE math. :func:`inv_freq_and_scale` follows transformers'
``ROPE_INIT_FUNCTIONS`` for ``default``, ``linear``, ``dynamic``, ``llama3`` and ``yarn``;
:class:`RotaryTable` precomputes ``cos``/``sin`` ``[max_positions, rotary_dim]`` once at load,
so a round only gathers rows by position (static shapes, no host work).

``dynamic`` (NTK) is computed once for the engine's ``max_model_len`` instead of per forward as
transformers does: when ``max_model_len`` exceeds the original context the base is scaled as
transformers scales it for a sequence of that length; otherwise frequencies are unscaled. This is
the static-shape choice a captured graph needs; it differs from transformers only for sequences
shorter than ``max_model_len`` but longer than the original context.

The rotation is the non-interleaved ``rotate_half`` layout of Llama / Qwen checkpoints; with
``partial_rotary_factor < 1`` only the first ``rotary_dim`` channels of each head rotate.
"""

from __future__ import annotations

import math

import torch

from speccal.runner.config import ModelConfig, RopeConfig


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").double() / dim))


def inv_freq_and_scale(cfg: ModelConfig, max_model_len: int,
                       rope: RopeConfig | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (float64) and the attention scaling factor of
    ``rope`` (default ``cfg.rope``)."""
    rope = rope or cfg.rope
    dim = int(cfg.head_dim * rope.partial_rotary_factor)
    base = rope.theta
    kind = rope.rope_type
    if kind == "default":
        return _default_inv_freq(base, dim), 1.0
    factor = float(rope.get("factor"))
    if kind == "linear":
        return _default_inv_freq(base, dim) / factor, 1.0
    if kind == "dynamic":
        original = int(rope.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        seq_len = max(max_model_len, original)
        base = base * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim), 1.0
    if kind == "llama3":
        inv_freq = _default_inv_freq(base, dim)
        low = float(rope.get("low_freq_factor"))
        high = float(rope.get("high_freq_factor"))
        old_len = float(rope.get("original_max_position_embeddings"))
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(cfg, rope, dim, base, factor)
    raise AssertionError(kind)  # ModelConfig validated the type


def _yarn(cfg: ModelConfig, rope: RopeConfig, dim: int, base: float,
          factor: float) -> tuple[torch.Tensor, float]:
    original = int(rope.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    attention_factor = rope.get("attention_factor")
    mscale = rope.get("mscale")
    mscale_all_dim = rope.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq, float(attention_factor)


class RotaryTable(torch.nn.Module):
    """Precomputed ``cos``/``sin`` tables ``[max_positions, rotary_dim]`` for one model.

    Computed on the CPU in float64 whatever the default device (the loader moves the table to
    the model's device): under a meta default device the arithmetic would run through
    ``torch._refs``, which imports ``torch._dynamo`` (``speccal.runner.device.on_meta``).

    ``sliding``: the table of ``cfg.sliding_rope`` (the sliding layers' own RoPE,
    MiMo-V2-Flash), None when the config has one RoPE; :meth:`for_layer` picks a layer's.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, max_model_len: int,
                 rope: RopeConfig | None = None):
        super().__init__()
        inv_freq, scale = inv_freq_and_scale(cfg, max_model_len, rope)
        self.sliding = (RotaryTable(cfg, max_positions, max_model_len, cfg.sliding_rope)
                        if rope is None and cfg.sliding_rope is not None else None)
        pos = torch.arange(max_positions, dtype=torch.float64, device="cpu")
        freqs = torch.outer(pos, inv_freq)  # [P, rotary_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, rotary_dim]
        self.rotary_dim = emb.shape[-1]
        self.register_buffer("cos", (emb.cos() * scale).float(), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).float(), persistent=False)
        half = self.rotary_dim // 2
        full = self.rotary_dim == cfg.head_dim
        # ``[P, rotary_dim]`` cos | sin halves: ``ops.rotary_kv_write``'s table (``rope_cache``,
        # partial rotary too); ``cos_sin_cache`` is it where every channel rotates (the dense
        # fused layer and the rotary inside its attention kernel: full rotary only).
        rope_cache = torch.cat([self.cos[:, :half], self.sin[:, :half]], dim=-1)
        self.register_buffer("rope_cache", rope_cache, persistent=False)
        self.register_buffer("cos_sin_cache", rope_cache if full else None, persistent=False)

    def for_layer(self, is_sliding_rope: bool) -> RotaryTable:
        """The table of a layer: :attr:`sliding` for a sliding layer where there is one."""
        return self.sliding if is_sliding_rope and self.sliding is not None else self

    def forward(
        self,
        q: torch.Tensor,  # [N, num_heads, head_dim]
        k: torch.Tensor,  # [N, num_kv_heads, head_dim]
        positions: torch.Tensor,  # [N] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos.index_select(0, positions)[:, None, :]  # [N, 1, rotary_dim]
        sin = self.sin.index_select(0, positions)[:, None, :]
        if q.dtype != k.dtype:
            return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)
        # q and k heads rotated in one pass (elementwise: the same values, half the ops)
        qk = _rotate(torch.cat([q, k], dim=1), cos, sin, self.rotary_dim)
        return qk[:, : q.shape[1]], qk[:, q.shape[1] :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = (rot.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
