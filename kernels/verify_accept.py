"""Triton *verify acceptance*: the end of a round's target graph in one launch.

Owns what the runner's argmax-only rounds do after the LM head's argmax (greedy acceptance, the
forced mode of benchmarks, and the plain decode step, ``k = 0``): each request's target tokens
gathered from the packed rows (``grid_rows``, written by ``verify_metadata_update``), the
accepted prefix, the emitted tokens, and the next round's slot state (``ext_tokens`` and the
hidden rows ``ext_hidden`` the draft extends from). Before, that was a dozen small torch launches
after the argmax. One program per request; its rows' hidden vectors are copied together, in
``BLOCK_H`` chunks.

The argmax comes either as row tokens ``[G]`` or as the LM head GEMV's per-tile partials
(``tile_max [G, T]`` fp32, ``tile_idx [G, T]`` int32, ``ops.linear_argmax``): then each program
finishes the argmax of its request's ``k + 1`` rows itself (largest max, a NaN above every
number, ties to the first tile, whose columns are the lowest: ``torch.argmax``'s answer), so the
argmax needs no launch of its own. It loads ``BLOCK_T`` tiles of all of those rows at a time,
all ``T`` at once up to 32K partials per request (a loop of 512-wide chunks, each a dependent
load, took 14.7 us at k = 5 on the H200; at once, 9.5 us). Or the argmax comes as the LM head's
packed keys (``ops.ArgmaxKeys``, one per row, already whole): the token is a key's low bits.
Reference: ``reference.verify_accept_ref`` (after ``reference.reduce_argmax_partials_ref`` or
``reference.unpack_argmax_keys_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccal.kernels.pdl import pdl_enter

__all__ = ["verify_accept_triton"]

# partials of one request's rows reduced per chunk (BLOCK_J x BLOCK_T; 64 per thread of 16 warps)
PARTIAL_CHUNK = 32768


@triton.jit
def _partials_argmax(tmax_ptr, tidx_ptr, rows, row_ok, T, BLOCK_J: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    """Column of the max of each of ``rows`` ([BLOCK_J] packed rows, ``row_ok`` masked) from
    its ``T`` tile partials: the running best tile of each row is replaced only by a strictly
    larger chunk max or a first NaN, so ties keep the earliest tile."""
    offs_t = tl.arange(0, BLOCK_T)
    base = rows.to(tl.int64) * T  # [BLOCK_J]
    best = tl.full([BLOCK_J], float("-inf"), tl.float32)
    best_t = tl.zeros([BLOCK_J], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs_t
        ok = row_ok[:, None] & (t < T)[None, :]
        v = tl.load(tmax_ptr + base[:, None] + t[None, :], mask=ok, other=float("-inf"))
        is_nan = v != v
        c_max, c_t = tl.max(tl.where(is_nan, float("-inf"), v), 1, return_indices=True,
                            return_indices_tie_break_left=True)  # [BLOCK_J]
        first_nan = tl.min(tl.where(is_nan, offs_t[None, :], BLOCK_T), 1)
        c_nan = first_nan < BLOCK_T
        take = (best == best) & (c_nan | (c_max > best))  # a NaN best is never replaced
        best = tl.where(take, tl.where(c_nan, float("nan"), c_max), best)
        best_t = tl.where(take, t0 + tl.where(c_nan, first_nan, c_t), best_t)
    return tl.load(tidx_ptr + base + best_t, mask=row_ok, other=-1).to(tl.int64)


@triton.jit
def _verify_accept_kernel(
    row_tok_ptr, tmax_ptr, tidx_ptr, grid_ptr, draft_ptr, nv_ptr, slot_ptr, h_ptr, ext_tok_ptr,
    ext_h_ptr, na_ptr, out_ptr, K, H, T, stride_d, stride_h, stride_et, stride_es, stride_er,
    GREEDY: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    # PARTIALS 1: row_tok_ptr is unused; the target tokens come from tile_max / tile_idx [G, T];
    # 2: from the packed argmax keys [G] int64 in tmax_ptr (``ops.ArgmaxKeys``)
    pdl_enter(PDL)
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK_J)
    j_ok = j <= K
    rows = tl.load(grid_ptr + b * (K + 1) + j, mask=j_ok, other=0)
    if PARTIALS == 2:  # packed keys [G] (reference.argmax_keys_ref): the column is in the low bits
        key = tl.load(tmax_ptr + rows, mask=j_ok, other=0)
        target = tl.where(j_ok, 0xFFFFFFFF - (key & 0xFFFFFFFF), -1)
    elif PARTIALS:
        target = _partials_argmax(tmax_ptr, tidx_ptr, rows, j_ok, T, BLOCK_J, BLOCK_T)
    else:
        target = tl.load(row_tok_ptr + rows, mask=j_ok, other=-1).to(tl.int64)
    draft = tl.load(draft_ptr + b * stride_d + j, mask=j < K, other=-1).to(tl.int64)
    nv = tl.minimum(tl.maximum(tl.load(nv_ptr + b).to(tl.int32), 0), K)
    if GREEDY:  # accepted while the draft equals the target's argmax, within num_verify
        first_bad = tl.min(tl.where((j < nv) & (target != draft), j, K + 1), 0)
        na = tl.minimum(first_bad, nv)
    else:  # forced: every verified draft is accepted
        na = nv
    out = tl.where(j < na, draft, tl.where(j == na, target, -1))
    tl.store(out_ptr + b * (K + 1) + j, out, mask=j_ok)
    tl.store(na_ptr + b, na.to(tl.int64))
    slot = tl.load(slot_ptr + b).to(tl.int64)
    tl.store(ext_tok_ptr + slot * stride_et + j, out, mask=j_ok)
    offs = tl.arange(0, BLOCK_H)
    src = h_ptr + rows.to(tl.int64)[:, None] * stride_h  # [BLOCK_J, 1]: all rows at once
    dst = ext_h_ptr + slot * stride_es + j.to(tl.int64)[:, None] * stride_er
    for h0 in range(0, H, BLOCK_H):
        ok = j_ok[:, None] & (h0 + offs < H)[None, :]
        v = tl.load(src + h0 + offs[None, :], mask=ok)
        tl.store(dst + h0 + offs[None, :], v, mask=ok)


def verify_accept_triton(
    row_tokens,  # [G] int: each packed row's argmax, (tile_max [G, T], tile_idx [G, T]) or keys
    grid_rows: torch.Tensor,  # [B * (k + 1)] int
    draft_tokens: torch.Tensor,  # [B, k] int
    num_verify: torch.Tensor,  # [B] int
    slot_index: torch.Tensor,  # [B] int
    hidden: torch.Tensor,  # [G, H]
    ext_tokens: torch.Tensor,  # [slots, >= k + 1] int64, written
    ext_hidden: torch.Tensor,  # [slots, >= k + 1, H], written
    greedy: bool,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, tokens [B, k + 1] int64
    """One launch; arguments validated by ``ops.verify_accept``."""
    batch, k = draft_tokens.shape
    h = hidden.shape[1]
    drafts = draft_tokens if k else num_verify  # an empty tensor may have no address
    num_accepted = torch.empty(batch, dtype=torch.int64, device=hidden.device)
    out = torch.empty(batch, k + 1, dtype=torch.int64, device=hidden.device)
    partials = isinstance(row_tokens, tuple)
    keys = getattr(row_tokens, "keys", None)  # ops.ArgmaxKeys
    if keys is not None:
        tile_max = tile_idx = keys
    else:
        tile_max, tile_idx = row_tokens if partials else (row_tokens, row_tokens)
    tiles = tile_max.shape[1] if partials else 1
    block_j = triton.next_power_of_2(k + 1)
    # one program per request, its loads issued at once where they fit: up to 32K partials of
    # the request's rows per chunk and 16K hidden values per copy (16 warps: 64 / 32 per thread)
    block_t = max(16, min(triton.next_power_of_2(tiles), PARTIAL_CHUNK // block_j))
    block_h = max(16, min(triton.next_power_of_2(h), 16384 // block_j))
    warps = 16 if partials and block_j * block_t >= 8192 else 4
    _verify_accept_kernel[(batch,)](
        tile_idx, tile_max, tile_idx, grid_rows, drafts, num_verify, slot_index, hidden,
        ext_tokens, ext_hidden, num_accepted, out, k, h, tiles,
        draft_tokens.stride(0) if k else 0, hidden.stride(0), ext_tokens.stride(0),
        ext_hidden.stride(0), ext_hidden.stride(1), GREEDY=greedy,
        PARTIALS=2 if keys is not None else int(partials),
        BLOCK_J=block_j, BLOCK_T=block_t, BLOCK_H=block_h, PDL=pdl, num_warps=warps,
        launch_pdl=pdl,
    )
    return num_accepted, out
