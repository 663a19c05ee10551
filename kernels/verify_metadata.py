"""Triton *verify metadata update*: positions, slot mapping, KV lengths and row offsets on device.

Owns the second in-graph input-update family (xLLM's ``spec_verify_metadata_update``). Inputs are
the per-request verify lengths (device, from the draft/acceptance step), the KV lengths cached
before the round and the static block table (prepared on the host before the final draft: it
does not depend on the drafted tokens). Outputs, all static graph buffers: ``positions [G]``,
``slot_mapping [G]`` (padded rows: position 0, sentinel slot 0 in reserved block 0),
``seq_lens [B]`` (KV length including this round's rows) and ``cu_q_lens [B + 1]`` (each entry
at most ``max_cu``: the runner passes ``G``, so padding requests past ``G`` get no rows).
Grid ``(B + 1,)`` like ``verify_tokens``. Reference: ``reference.verify_metadata_update_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccal.kernels.pdl import pdl_enter
from speccal.kernels.verify_tokens import index_blocks, packed_rows

__all__ = ["verify_metadata_update_triton"]

INT32_MAX = 2**31 - 1


@triton.jit(do_not_specialize=("B", "G", "K_MAX", "max_cu"))  # as verify_tokens' kernel
def _verify_metadata_kernel(
    vl_ptr, ctx_ptr, bt_ptr, pos_ptr, slot_ptr, seq_ptr, cu_ptr, grid_ptr,
    B, G, K_MAX, stride_bt, max_blocks, page, max_cu,
    BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, GRID: tl.constexpr,
    PDL: tl.constexpr = False, keys_ptr=None, KEYS: tl.constexpr = False,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    start, n, total = packed_rows(vl_ptr, b, B, K_MAX, BLOCK_B)
    if b < B:
        ctx = tl.load(ctx_ptr + b)
        j = tl.arange(0, BLOCK_R)
        pos = (ctx + j).to(tl.int64)
        blk = tl.minimum(pos // page, max_blocks - 1)
        ok = j < n
        phys = tl.load(bt_ptr + b * stride_bt + blk, mask=ok, other=0).to(tl.int64)
        slot = phys * page + pos % page
        t = start + j
        tl.store(pos_ptr + t, pos.to(pos_ptr.dtype.element_ty), mask=ok & (t < G))
        tl.store(slot_ptr + t, slot.to(slot_ptr.dtype.element_ty), mask=ok & (t < G))
        tl.store(seq_ptr + b, (ctx + n).to(seq_ptr.dtype.element_ty))
        tl.store(cu_ptr + b + 1, tl.minimum(start + n, max_cu).to(cu_ptr.dtype.element_ty))
        if GRID:  # grid cell (b, j) -> its packed row, clamped into [0, G)
            cell = tl.minimum(start + j, G - 1).to(tl.int64)
            tl.store(grid_ptr + b * (K_MAX + 1) + j, cell, mask=j < K_MAX + 1)
    else:
        one = tl.arange(0, 1)
        tl.store(cu_ptr + one, tl.zeros([1], dtype=cu_ptr.dtype.element_ty))
        for t0 in range(0, G, BLOCK_G):
            t = t0 + tl.arange(0, BLOCK_G)
            m = (t >= total) & (t < G)
            tl.store(pos_ptr + t, tl.zeros([BLOCK_G], dtype=pos_ptr.dtype.element_ty), mask=m)
            tl.store(slot_ptr + t, tl.zeros([BLOCK_G], dtype=slot_ptr.dtype.element_ty), mask=m)
            if KEYS:  # every row's argmax key, for this round's LM head (ops.ArgmaxKeys)
                tl.store(keys_ptr + t, tl.zeros([BLOCK_G], dtype=tl.int64), mask=t < G)


def verify_metadata_update_triton(
    verify_lens: torch.Tensor,  # [B] int32
    context_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_blocks] int32
    block_size: int,
    positions: torch.Tensor,  # [G] int64, written
    slot_mapping: torch.Tensor,  # [G] int64, written
    seq_lens: torch.Tensor,  # [B] int32, written
    cu_q_lens: torch.Tensor,  # [B + 1] int32, written
    k_max: int,
    grid_rows: torch.Tensor | None = None,  # [B * (k_max + 1)] int64, written
    max_cu: int | None = None,  # cap of the cu_q_lens entries (None: no cap)
    pdl: bool = False,  # programmatic dependent launch (waits for its predecessor first)
    argmax_keys: torch.Tensor | None = None,  # [G] int64, zeroed
) -> None:
    """One launch; arguments validated by ``ops.verify_metadata_update``."""
    batch = verify_lens.shape[0]
    g = positions.shape[0]
    cap = INT32_MAX if max_cu is None else max_cu  # cu_q_lens is int32: no cap = int32's max
    _verify_metadata_kernel[(batch + 1,)](
        verify_lens, context_lens, block_table, positions, slot_mapping, seq_lens, cu_q_lens,
        grid_rows if grid_rows is not None else positions, batch, g, k_max,
        block_table.stride(0), block_table.shape[1], block_size, cap,
        **index_blocks(batch, k_max, g), GRID=grid_rows is not None, PDL=pdl,
        **({} if argmax_keys is None else dict(keys_ptr=argmax_keys, KEYS=True)),
        num_warps=1, launch_pdl=pdl,
    )
