"""Paged attention for the runner: KV writes, the pure-torch attention, the backend switch.

This module owns the attention metadata of one forward (:class:`AttnMeta`) and the single entry
point :func:`attend_rows` every layer calls with its engine's execution path: the pure-torch
attention (:func:`paged_attention_torch`) or the Triton kernel (``speccal.kernels.ops``, same
arguments), chosen by ``path.attention_backend``.

Data layout (shared with ``speccal.kernels``, see docs/ARCHITECTURE.md):

- ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer; block 0
  is reserved: padded rows write to its slot 0 (the sentinel slot) and unused block-table entries
  point at it.
- A forward runs on ``N`` flat token rows (dense ops cost ``N``). For attention the rows are
  scattered into a ``[B, R]`` grid (``R = num_q_rows``) by ``row_index [N]`` (into ``B * R``;
  padded rows point at the extra trash row ``B * R``). Query row ``i`` of request ``b`` sits at
  position ``seq_lens[b] - R + i`` and attends causally to KV ``[0, that position]``.
- ``slot_mapping [N]`` int64: the KV slot (``block * block_size + offset``) each row writes.

Sliding window (``window`` W > 0, transformers' ``sliding_window``): a query at position ``p``
attends to keys ``p - W + 1 .. p`` only; every path here masks it (the Triton kernel refuses
it: ``speccal.kernels.ops.paged_attention``).

Attention sinks (``sinks`` ``[num_heads]``, MiMo-V2-Flash's sliding layers): head ``h``'s
logit ``s_h`` joins every row's softmax denominator and no value, so a row's output is
``sum_j exp(a_j) v_j / (sum_j exp(a_j) + exp(s_h))``. The torch paths compute it as one more
key column of zero key and zero value whose additive mask is ``s_h`` (:func:`sdpa`). The
Triton kernel has none: ``speccal.runner.layers.Attention.fuse_weights`` refuses such layers.

Value heads may be narrower or wider than query / key heads (``v_cache`` has its own channel
count, MiMo-V2-Flash's ``v_head_dim``): outputs have the value's channels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speccal.base.errors import UnsupportedError
from speccal.kernels import ops
from speccal.runner.path import ExecutionPath

MAX_KERNEL_Q_ROWS = 64  # query rows per request the Triton kernel serves (decode / verify)


@dataclass
class AttnMeta:
    """Attention metadata of one forward over ``N`` flat rows of ``B`` requests.

    Two layouts: the ``[B, R]`` grid (``row_index``, any backend) and the *packed* verify layout
    (``cu_q_lens``, written on device by ``speccal.kernels.ops.verify_metadata_update``): rows
    of request ``b`` are ``cu_q_lens[b] .. cu_q_lens[b + 1]``, attended by
    ``speccal.kernels.ops.paged_attention`` directly (no scatter), with the split-KV ``tiling``
    from ``attention_tiling_update`` and the bucket's static ``plan``.
    """

    slot_mapping: torch.Tensor  # [N] int64
    row_index: torch.Tensor | None  # [N] int64 into B * num_q_rows (+1 trash row); None: packed
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    num_q_rows: int  # R (packed: the most rows of one request)
    cu_q_lens: torch.Tensor | None = None  # [B + 1] int32 (packed layout)
    tiling: tuple[torch.Tensor, torch.Tensor] | None = None  # (num_splits [B], split_len [B])
    plan: object | None = None  # speccal.kernels.ops.SplitPlan of the bucket
    # one request's rows (prefill): the slots of its positions 0 .. seq_len - 1; its N rows are
    # the last N positions and attend to these keys read by slot (``attend_own_keys``)
    key_slots: torch.Tensor | None = None  # [seq_len] int64
    # values every layer of this forward derives alike from the metadata (the MLA layers'
    # causal visibility, their rotary rows), computed by the first layer that needs them: a
    # metadata object lives for one forward (the round builds one per forward)
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def once(self, key: object, make):
        """``make()`` the first time ``key`` is asked for in this forward, the same value after
        (:attr:`memo`)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [N, num_kv_heads, head_dim]
    v: torch.Tensor,  # [N, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [N] int64
) -> None:
    """Store the rows' K and V at their slots (padded rows hit the sentinel slot)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def sdpa(
    q: torch.Tensor,  # [..., H, L, D]
    keys: torch.Tensor,  # [..., H, S, D]
    values: torch.Tensor,  # [..., H, S, Dv]
    mask: torch.Tensor | None,  # [..., 1 | H, L, S] bool (True: attend); None: causal
    scale: float,
    sink: torch.Tensor | None = None,  # [1 | ..., H, L, 1]: each row's sink logit; None: none
) -> torch.Tensor:  # [..., H, L, Dv]
    """``scaled_dot_product_attention`` with an optional sink logit per row: one more key of
    zeros (its score 0) carrying the sink as its additive mask, and a value of zeros, so the
    sink only grows the softmax denominator (see the module docstring)."""
    fn = torch.nn.functional.scaled_dot_product_attention
    if sink is None:
        if mask is None:
            return fn(q, keys, values, is_causal=True, scale=scale)
        return fn(q, keys, values, attn_mask=mask, scale=scale)
    if mask is None:
        n, t = q.shape[-2], keys.shape[-2]
        mask = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(diagonal=t - n)
    shape = (*torch.broadcast_shapes(q.shape[:-2], mask.shape[:-2]), q.shape[-2])
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
        ~mask, float("-inf")).expand(*shape, keys.shape[-2])
    bias = torch.cat([bias, sink.to(q.dtype).expand(*shape, 1)], dim=-1)
    pad_k = keys.new_zeros(*keys.shape[:-2], 1, keys.shape[-1])
    pad_v = values.new_zeros(*values.shape[:-2], 1, values.shape[-1])
    return fn(q, torch.cat([keys, pad_k], dim=-2), torch.cat([values, pad_v], dim=-2),
              attn_mask=bias, scale=scale)


def paged_attention_torch(
    q: torch.Tensor,  # [B, R, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    num_q_rows: int,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits
) -> torch.Tensor:  # [B, R, num_heads, v_head_dim]
    """Reference paged attention: gather each request's KV by block table, causal softmax.

    Keys past ``seq_lens[b]`` and past the query's position are masked, and with ``window``
    those ``window`` or more positions before it; rows whose position is negative (front
    padding) may attend to key 0 so that their (discarded) output stays finite. ``sinks``
    join each head's softmax denominator (:func:`sdpa`).
    """
    num_b, num_r, num_heads, head_dim = q.shape
    block_size, num_kv_heads, v_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    group = num_heads // num_kv_heads
    max_keys = block_table.shape[1] * block_size
    blocks = block_table.reshape(-1).long()  # index_select: the same copy as [] indexing, faster
    keys = k_cache.index_select(0, blocks).view(num_b, max_keys, num_kv_heads, head_dim)
    values = v_cache.index_select(0, blocks).view(num_b, max_keys, num_kv_heads, v_dim)
    q_pos = seq_lens.long()[:, None] - num_q_rows + torch.arange(num_r, device=q.device)  # [B, R]
    key_pos = torch.arange(max_keys, device=q.device)
    is_visible = key_pos[None, None, :] <= q_pos.clamp_min(0)[:, :, None]  # [B, R, T]
    if window:
        is_visible &= key_pos[None, None, :] > q_pos[:, :, None] - window
    # [B, Hkv, group * R, D]: the heads of one KV group are stacked along the query axis.
    qg = q.view(num_b, num_r, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(num_b, num_kv_heads, group * num_r, head_dim)
    mask = is_visible[:, None, None].expand(num_b, 1, group, num_r, max_keys)
    mask = mask.reshape(num_b, 1, group * num_r, max_keys)
    sink = None
    if sinks is not None:  # query head kv * group + g sits on rows g * R .. of KV group kv
        sink = sinks.view(1, num_kv_heads, group, 1, 1).expand(1, num_kv_heads, group, num_r, 1)
        sink = sink.reshape(1, num_kv_heads, group * num_r, 1)
    out = sdpa(qg, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
               mask, scale, sink)  # [B, Hkv, group * R, Dv]
    out = out.view(num_b, num_kv_heads, group, num_r, v_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_b, num_r, num_heads, v_dim)


def attend_rows(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMeta,
    scale: float,
    path: ExecutionPath,
    *,
    window: int = 0,  # sliding window (0: full attention)
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits (torch backend only)
) -> torch.Tensor:  # [N, num_heads, v_head_dim]
    """Scatter flat query rows into the ``[B, R]`` grid, attend with ``path``'s backend, gather
    them back. Packed metadata (``meta.cu_q_lens``) skips the scatter: the kernel reads the rows
    in place.
    """
    if meta.key_slots is not None:
        return attend_own_keys(q, k_cache, v_cache, meta.key_slots, scale, window, sinks)
    extra = {"sliding_window": window} if window else {}
    if sinks is not None and (meta.cu_q_lens is not None or path.attention_backend == "triton"):
        # Attention.fuse_weights refuses such layers first, naming the tensor
        raise UnsupportedError("attention sinks (self_attn.attention_sink_bias): the Triton "
                               "attention kernels have none; expected attention_backend='torch'")
    if meta.cu_q_lens is not None:
        return ops.paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            meta.block_table,
            meta.seq_lens,
            meta.num_q_rows,
            scale,
            cu_q_lens=meta.cu_q_lens,
            tiling=meta.tiling,
            plan=meta.plan,
            tune=path.kernels,
            **extra,
        )
    num_b = meta.block_table.shape[0]
    num_r = meta.num_q_rows
    grid = q.new_zeros(num_b * num_r + 1, *q.shape[1:])
    grid.index_copy_(0, meta.row_index, q)
    fn = paged_attention_torch
    extra = {"window": window, "sinks": sinks} if window or sinks is not None else {}
    # prefill chunks stay on torch: the kernel is built for decode/verify rows
    if path.attention_backend == "triton" and num_r <= MAX_KERNEL_Q_ROWS:
        fn = ops.paged_attention
        extra = {"tune": path.kernels, **({"sliding_window": window} if window else {})}
        if meta.plan is not None:
            extra.update(plan=meta.plan, tiling=meta.tiling)
    out = fn(
        grid[: num_b * num_r].view(num_b, num_r, *q.shape[1:]),
        k_cache,
        v_cache,
        meta.block_table,
        meta.seq_lens,
        num_r,
        scale,
        **extra,
    )
    flat = out.reshape(num_b * num_r, *out.shape[2:])
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])], dim=0)  # the trash row
    return flat.index_select(0, meta.row_index)


def attend_own_keys(
    q: torch.Tensor,  # [N, num_heads, head_dim]: the last N positions of one request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_slots: torch.Tensor,  # [T] int64: the slots of the request's positions 0 .. T - 1
    scale: float,
    window: int = 0,  # sliding window (0: full attention)
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits
) -> torch.Tensor:  # [N, num_heads, v_head_dim]
    """Causal attention of one request's rows over its own keys, read by slot (a prefill chunk).

    The keys are gathered by ``key_slots`` (no block-table gather, no padding to the table's
    width) and attended with ``scaled_dot_product_attention`` under a causal mask aligned to the
    last row: ``is_causal`` when the rows are the whole sequence (flash kernel), a boolean
    lower-right mask otherwise (memory-efficient kernel; also under a sliding ``window``, which
    masks keys ``window`` or more positions before each row). Not torch's ``causal_lower_right``
    bias: importing ``torch.nn.attention.bias`` imports ``torch._dynamo`` and sympy, seconds of
    the first prefill on a host without bytecode (measured in a cold H200 calibration), for an
    attention that is a small part of a prefill chunk. Equal to :func:`paged_attention_torch`
    on the same rows (tests).
    """
    n, num_heads, head_dim = q.shape
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    group = num_heads // flat_k.shape[1]
    keys = flat_k.index_select(0, key_slots).to(q.dtype).transpose(0, 1)  # [Hkv, T, D]
    values = flat_v.index_select(0, key_slots).to(q.dtype).transpose(0, 1)
    if group > 1:
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
    t = keys.shape[1]
    qh = q.transpose(0, 1)[None]  # [1, H, N, D]
    sink = None if sinks is None else sinks.view(1, num_heads, 1, 1)
    mask = None  # the flash kernel's own causal mask
    if not (n == t and not (window and window < t)):
        # row i is position t - n + i: it sees keys 0 .. t - n + i (window: from t - n + i - W + 1)
        mask = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(diagonal=t - n)
        if window:
            mask = mask.triu(diagonal=t - n - window + 1)
    out = sdpa(qh, keys[None], values[None], mask, scale, sink)
    return out[0].transpose(0, 1)
