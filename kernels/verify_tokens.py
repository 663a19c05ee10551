"""Triton *verify token update*: the target's input ids for one round, written on device.

Owns the first of the three in-graph input-update families (the xLLM MTP verify PR's
``spec_verify_token_update``). It runs at the start of the captured target graph, reading the
final draft's output buffer directly, so no host work sits between the last draft kernel and
the target. Layout (packed verify rows, see ``reference``): request ``b`` owns rows
``cu[b] .. cu[b] + verify_lens[b]`` (``cu`` = exclusive cumsum of ``verify_lens + 1``): its base
token then its first ``verify_lens[b]`` drafts; rows ``cu[B] .. G`` get ``pad_id``.
Grid ``(B + 1,)``: program ``b < B`` writes request ``b``'s rows (its offset is a masked sum over
the lengths, no scan across programs); program ``B`` writes the padding.
Reference: ``reference.verify_token_update_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["index_blocks", "packed_rows", "verify_token_update_triton"]


def index_blocks(batch: int, k_max: int, g: int) -> dict[str, int]:
    """Block sizes of the index kernels here and in ``verify_metadata``: one compile serves
    every bucket up to 16 requests, 7 draft steps and 64 rows (padded lanes are masked; one warp
    runs the whole block either way), so a cold start compiles one specialization per flag set
    instead of one per (Bcap, k, G) (the precompile pass counted 48 of 133 kernels on dense-2b).
    Past those sizes a larger power of two, as before."""
    return {"BLOCK_B": max(16, triton.next_power_of_2(batch)),
            "BLOCK_R": max(8, triton.next_power_of_2(k_max + 1)),
            "BLOCK_G": min(1024, max(64, triton.next_power_of_2(g)))}


@triton.jit
def packed_rows(vl_ptr, b, B, K_MAX, BLOCK_B: tl.constexpr):
    """Request ``b``'s packed verify rows: ``(first row, row count, rows of all requests)``;
    each request sends ``clamp(verify_lens, 0, K_MAX) + 1`` rows (a masked sum, no scan)."""
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.minimum(tl.maximum(tl.load(vl_ptr + offs_b, mask=offs_b < B, other=0), 0), K_MAX)
    rows = tl.where(offs_b < B, lens + 1, 0)
    start = tl.sum(tl.where(offs_b < b, rows, 0), 0)
    n = tl.sum(tl.where(offs_b == b, rows, 0), 0)
    return start, n, tl.sum(rows, 0)


# The shape integers are not specialised (Triton would compile B = 1, G = 1, K_MAX = 1 and
# multiples of 16 apart): an index kernel gains nothing from it (``index_blocks``).
@triton.jit(do_not_specialize=("B", "G", "K_MAX", "stride_d", "pad_id"))
def _verify_token_kernel(
    base_ptr, bidx_ptr, draft_ptr, vl_ptr, ids_ptr, B, G, K_MAX, stride_d, pad_id,
    BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, INDEXED: tl.constexpr,
):
    b = tl.program_id(0)
    start, n, total = packed_rows(vl_ptr, b, B, K_MAX, BLOCK_B)
    if b < B:
        j = tl.arange(0, BLOCK_R)
        draft = tl.load(draft_ptr + b * stride_d + (j - 1), mask=(j >= 1) & (j < n), other=0)
        if INDEXED:  # the base token sits at a flat index into base_tokens
            base = tl.load(base_ptr + tl.load(bidx_ptr + b).to(tl.int64))
        else:
            base = tl.load(base_ptr + b)
        tok = tl.where(j == 0, base, draft)
        t = start + j
        tl.store(ids_ptr + t, tok.to(ids_ptr.dtype.element_ty), mask=(j < n) & (t < G))
    else:
        for t0 in range(0, G, BLOCK_G):
            t = t0 + tl.arange(0, BLOCK_G)
            pad = tl.zeros([BLOCK_G], dtype=tl.int64) + pad_id
            tl.store(ids_ptr + t, pad.to(ids_ptr.dtype.element_ty), mask=(t >= total) & (t < G))


def verify_token_update_triton(
    base_tokens: torch.Tensor,  # [B] int ([...] int, contiguous, with base_index)
    draft_tokens: torch.Tensor,  # [B, k_max] int
    verify_lens: torch.Tensor,  # [B] int32
    input_ids: torch.Tensor,  # [G] int, written
    pad_id: int = -1,
    base_index: torch.Tensor | None = None,  # [B] int: flat index into base_tokens
) -> torch.Tensor:
    """One launch; arguments validated by ``ops.verify_token_update``."""
    batch, k_max = draft_tokens.shape
    g = input_ids.shape[0]
    _verify_token_kernel[(batch + 1,)](
        base_tokens, base_index if base_index is not None else base_tokens, draft_tokens,
        verify_lens, input_ids, batch, g, k_max, draft_tokens.stride(0), pad_id,
        **index_blocks(batch, k_max, g), INDEXED=base_index is not None, num_warps=1,
    )
    return input_ids
