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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def paged_attention_torch(
    q: torch.Tensor,  # [B, R, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    num_q_rows: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:  # [B, R, num_heads, head_dim]
    """Reference paged attention: gather each request's KV by block table, causal softmax.

    Keys past ``seq_lens[b]`` and past the query's position are masked, and with ``window``
    those ``window`` or more positions before it; rows whose position is negative (front
    padding) may attend to key 0 so that their (discarded) output stays finite.
    """
    num_b, num_r, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_keys = block_table.shape[1] * block_size
    blocks = block_table.reshape(-1).long()  # index_select: the same copy as [] indexing, faster
    keys = k_cache.index_select(0, blocks).view(num_b, max_keys, num_kv_heads, head_dim)
    values = v_cache.index_select(0, blocks).view(num_b, max_keys, num_kv_heads, head_dim)
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
    out = torch.nn.functional.scaled_dot_product_attention(
        qg,
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=mask,
        scale=scale,
    )  # [B, Hkv, group * R, D]
    out = out.view(num_b, num_kv_heads, group, num_r, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_b, num_r, num_heads, head_dim)


def attend_rows(
    q: torch.Tensor,  # [N, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMeta,
    scale: float,
    path: ExecutionPath,
    *,
    window: int = 0,  # sliding window (0: full attention)
) -> torch.Tensor:  # [N, num_heads, head_dim]
    """Scatter flat query rows into the ``[B, R]`` grid, attend with ``path``'s backend, gather
    them back. Packed metadata (``meta.cu_q_lens``) skips the scatter: the kernel reads the rows
    in place.
    """
    if meta.key_slots is not None:
        return attend_own_keys(q, k_cache, v_cache, meta.key_slots, scale, window)
    extra = {"sliding_window": window} if window else {}
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
    if window:
        extra = {"window": window}
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
    flat = torch.cat([out.reshape(num_b * num_r, *q.shape[1:]), grid[-1:]], dim=0)
    return flat.index_select(0, meta.row_index)


def attend_own_keys(
    q: torch.Tensor,  # [N, num_heads, head_dim]: the last N positions of one request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_slots: torch.Tensor,  # [T] int64: the slots of the request's positions 0 .. T - 1
    scale: float,
    window: int = 0,  # sliding window (0: full attention)
) -> torch.Tensor:  # [N, num_heads, head_dim]
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
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if n == t and not (window and window < t):
        out = sdpa(qh, keys[None], values[None], is_causal=True, scale=scale)
    else:
        # row i is position t - n + i: it sees keys 0 .. t - n + i (window: from t - n + i - W + 1)
        mask = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(diagonal=t - n)
        if window:
            mask = mask.triu(diagonal=t - n - window + 1)
        out = sdpa(qh, keys[None], values[None], attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)
