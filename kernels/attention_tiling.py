"""Triton *attention tiling update*: split-KV fields computed from the KV lengths on device.

Owns the third in-graph input-update family (xLLM's ``spec_verify_attention_tiling_update``):
``num_splits [B] int32`` and ``split_len [B] int32`` for ``paged_attention``, from
``seq_lens [B] int32``. The grid of the attention kernel stays ``(B * KVH, max_splits)`` (static,
so the graph stays valid); these fields decide which programs work and on which KV range.
Formula in ``reference.attention_tiling_update_ref``; one program per 1024 requests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccal.kernels.pdl import pdl_enter

__all__ = ["attention_tiling_update_triton"]


@triton.jit
def _tiling_kernel(
    seq_ptr, nsplit_ptr, split_len_ptr, B, max_splits, block_n, min_split_len,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < B
    s = tl.maximum(tl.load(seq_ptr + offs, mask=ok, other=0), 0)
    n0 = tl.minimum(tl.maximum((s + min_split_len - 1) // min_split_len, 1), max_splits)
    per = (s + n0 - 1) // n0
    sl = tl.maximum((per + block_n - 1) // block_n * block_n, block_n)
    tl.store(split_len_ptr + offs, sl.to(split_len_ptr.dtype.element_ty), mask=ok)
    tl.store(nsplit_ptr + offs, ((s + sl - 1) // sl).to(nsplit_ptr.dtype.element_ty), mask=ok)


def attention_tiling_update_triton(
    seq_lens: torch.Tensor,  # [B] int32
    num_splits: torch.Tensor,  # [B] int32, written
    split_len: torch.Tensor,  # [B] int32, written
    max_splits: int,
    block_n: int,
    min_split_len: int,
    pdl: bool = False,  # programmatic dependent launch (waits for its predecessor first)
) -> None:
    """One launch; arguments validated by ``ops.attention_tiling_update``."""
    batch = seq_lens.shape[0]
    _tiling_kernel[(triton.cdiv(batch, 1024),)](
        seq_lens, num_splits, split_len, batch, max_splits, block_n, min_split_len,
        BLOCK=1024, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
