"""Triton MLA attention in absorbed form over the paged latent cache (decode and verify rows).

Owns the kernels behind ``speccal.kernels.ops.mla_latent_attention``; its pure-torch twin is
``reference.mla_latent_attention_ref``. MLA in absorbed form is multi-query attention with one
key head of ``[latent | rope]`` channels whose value is the latent part, so every query head of
a request reads the same keys: one program handles one (request, KV split, tile of ``BLOCK_M``
(row, head) cells ``m = i * heads + h`` of the request's rows), and reads each key tile once
for all of them straight from the paged cache (no gather, no fp32 copy, only the keys before
``seq_lens``). The query rows are packed (request ``b``'s rows ``cu_q_lens[b] ..
cu_q_lens[b + 1]``, the verify layout of the Triton path) or a ``[B, R]`` grid; row ``i`` of
``q_len`` is at position ``seq_lens[b] - q_len + i`` and sees keys ``0 .. max(position, 0)``.

1. ``_split_kernel``, grid ``(B, max_splits, cdiv(R * heads, BLOCK_M))``: online softmax over
   the split's keys (request ``b``'s ``seq_lens[b]`` keys cut into ``max_splits`` runs of a
   multiple of ``BLOCK_N``, at least ``MIN_SPLIT``: :func:`plan_max_splits` sizes the grid so
   the programs of a bucket fill the GPU about twice whatever the cache's capacity, and the
   workspace stays a few MB; scores from the latent and rope parts in fp32, the value product
   in the cache's dtype with fp32 accumulation, as flash attention), partial output and
   log-sum-exp to a workspace; splits past the request's keys write an empty partial.
2. ``_merge_kernel``, grid ``(B * R * heads,)``: the splits merged by their log-sum-exp,
   written to the cell's row in the query's dtype (cells past a request's rows exit); packed
   rows past ``cu_q_lens[B]`` (a bucket's padding) are zeroed by the cell of the same flat
   index ``b * R + i`` (no fill launch).

Grids depend only on static shapes (``max_splits`` from the bucket's shape and the block
table's width; each request's split length is derived from its length in the kernel), so the
launches are CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccal.kernels._backend import num_sms
from speccal.kernels.pdl import pdl_enter

__all__ = ["mla_latent_attention_triton"]

_BLOCK_M = 16
_BLOCK_N = 32
MIN_SPLIT = 64  # the fewest keys a split program takes (unless its request has fewer)


def plan_max_splits(batch: int, rows: int, capacity: int, sms: int) -> int:
    """Split programs per request: enough that ``batch x splits x row tiles`` programs fill
    the GPU about twice (``2 sms``), never more than the cache's capacity in ``MIN_SPLIT``-key
    runs, at least one. The grid and the fp32 workspace (``B x splits x rows x latent``) then
    stay bounded by the GPU, not by ``max_model_len``."""
    tiles = triton.cdiv(rows, _BLOCK_M)
    return max(1, min(triton.cdiv(capacity, MIN_SPLIT), triton.cdiv(2 * sms, batch * tiles)))


@triton.jit
def _rows_of(b, cu_ptr, R, PACKED: tl.constexpr):
    """Request ``b``'s first query row and its row count: packed (``cu_q_lens``) or the grid's
    ``R`` rows a request."""
    if PACKED:
        q_start = tl.load(cu_ptr + b)
        q_len = tl.load(cu_ptr + b + 1) - q_start
    else:
        q_start = b * R
        q_len = R
    return q_start, q_len


@triton.jit
def _split_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_ptr, cu_ptr, part_ptr, lse_ptr,
    R, max_blocks, max_splits, scale,
    stride_qn, stride_qh, stride_slot, stride_bt,
    PACKED: tl.constexpr, HEADS: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, LAT_P: tl.constexpr,
    ROPE_P: tl.constexpr, BS: tl.constexpr, MIN_SPLIT_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):
    b, s, pm = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pdl_enter(PDL)
    rows = R * HEADS
    q_start, q_len = _rows_of(b, cu_ptr, R, PACKED)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    i, h = m // HEADS, m % HEADS
    ok_m = (m < rows) & (i < q_len)
    seq = tl.load(seq_ptr + b)
    q_pos = tl.maximum(seq - q_len + i, 0)  # [BLOCK_M]
    # this request's split length: its keys over max_splits programs, whole key tiles
    split = tl.maximum(tl.cdiv(tl.cdiv(seq, max_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT_N)
    start = s * split
    stop = tl.minimum(start + split, seq)
    lat = tl.arange(0, LAT_P)
    rope = tl.arange(0, ROPE_P)
    ok_lat = lat < LAT
    ok_rope = rope < ROPE
    q_row = q_ptr + (q_start + i[:, None]).to(tl.int64) * stride_qn + h[:, None] * stride_qh
    q_lat = tl.load(q_row + lat[None, :], mask=ok_m[:, None] & ok_lat[None, :], other=0.0)
    q_rope = tl.load(q_row + LAT + rope[None, :], mask=ok_m[:, None] & ok_rope[None, :],
                     other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, LAT_P], dtype=tl.float32)
    for t0 in range(start, stop, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok_t = t < stop
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + t // BS, mask=ok_t, other=0)
        slot = (blk.to(tl.int64) * BS + t % BS) * stride_slot
        k_lat = tl.load(cache_ptr + slot[:, None] + lat[None, :],
                        mask=ok_t[:, None] & ok_lat[None, :], other=0.0)  # [BLOCK_N, LAT_P]
        k_rope = tl.load(cache_ptr + slot[:, None] + LAT + rope[None, :],
                         mask=ok_t[:, None] & ok_rope[None, :], other=0.0)
        sc = tl.dot(q_lat, tl.trans(k_lat), input_precision=PREC)
        sc = tl.dot(q_rope, tl.trans(k_rope), sc, input_precision=PREC) * scale
        vis = ok_t[None, :] & (t[None, :] <= q_pos[:, None])
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
        p = tl.exp(sc - base[:, None])
        alpha = tl.exp(m_i - base)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    cell = (b * max_splits + s).to(tl.int64) * rows + m  # [BLOCK_M]
    tl.store(lse_ptr + cell, lse, mask=ok_m)
    tl.store(part_ptr + cell[:, None] * LAT_P + lat[None, :], out, mask=ok_m[:, None])


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, cu_ptr, out_ptr, R, max_splits, stride_on, stride_oh, num_b, num_out,
    PACKED: tl.constexpr, ZERO_TAIL: tl.constexpr, HEADS: tl.constexpr, LAT: tl.constexpr,
    LAT_P: tl.constexpr, SPLITS_P: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pdl_enter(PDL)
    rows = R * HEADS
    b, m = pid // rows, pid % rows
    q_start, q_len = _rows_of(b, cu_ptr, R, PACKED)
    i = m // HEADS
    lat = tl.arange(0, LAT_P)
    if ZERO_TAIL:  # the cell's flat row b * R + i, if it is past every request's rows
        f = b * R + i  # (num_out <= B * R: every padding row is some cell's, once per head)
        if (f >= tl.load(cu_ptr + num_b)) & (f < num_out):
            dst = out_ptr + f.to(tl.int64) * stride_on + (m % HEADS) * stride_oh + lat
            tl.store(dst, tl.zeros([LAT_P], dtype=out_ptr.dtype.element_ty), mask=lat < LAT)
    if i >= q_len:  # a grid cell past the request's rows
        return
    sp = tl.arange(0, SPLITS_P)
    top = tl.full([SPLITS_P], float("-inf"), dtype=tl.float32)
    for s0 in range(0, max_splits, SPLITS_P):
        s = s0 + sp
        cell = (b * max_splits + s).to(tl.int64) * rows + m
        top = tl.maximum(top, tl.load(lse_ptr + cell, mask=s < max_splits, other=float("-inf")))
    big = tl.max(top, 0)
    big = tl.where(big == float("-inf"), 0.0, big)
    den = tl.zeros([SPLITS_P], dtype=tl.float32)
    acc = tl.zeros([LAT_P], dtype=tl.float32)
    for s0 in range(0, max_splits, SPLITS_P):
        s = s0 + sp
        ok = s < max_splits
        cell = (b * max_splits + s).to(tl.int64) * rows + m
        w = tl.exp(tl.load(lse_ptr + cell, mask=ok, other=float("-inf")) - big)  # [SPLITS_P]
        den += w
        part = tl.load(part_ptr + cell[:, None] * LAT_P + lat[None, :],
                       mask=ok[:, None] & (w > 0)[:, None], other=0.0)
        acc += tl.sum(part * w[:, None], 0)
    total = tl.sum(den, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    dst = out_ptr + (q_start + i).to(tl.int64) * stride_on + (m % HEADS) * stride_oh + lat
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=lat < LAT)


def mla_latent_attention_triton(q, cache, block_table, seq_lens, cu_q_lens, num_rows,
                                latent_dim, scale, prec, pdl=False) -> torch.Tensor:
    """``ops.mla_latent_attention`` (its arguments, validated there; ``prec``: tl.dot's
    input_precision for fp32 operands, None: Triton's default) on the kernels above: two
    launches (a third, a zero fill, only for packed rows outnumbering the ``B x R`` cells)."""
    n, heads, dim = q.shape
    num_b = block_table.shape[0]
    bs = cache.shape[1]
    max_blocks = block_table.shape[1]
    max_splits = plan_max_splits(num_b, num_rows * heads, max_blocks * bs, num_sms(q.device))
    rows = num_rows * heads
    rope = dim - latent_dim
    lat_p = max(triton.next_power_of_2(latent_dim), 16)
    packed = cu_q_lens is not None
    part = torch.empty(num_b * max_splits * rows, lat_p, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_b * max_splits * rows, dtype=torch.float32, device=q.device)
    # packed: rows past cu_q_lens[B] (a bucket's padding) are no request's: zeros, written by
    # the merge programs of the cells with those flat rows (a fill launch where there are more
    # rows than cells)
    zero_tail = packed and n <= num_b * num_rows
    out = (torch.zeros if packed and not zero_tail else torch.empty)(
        n, heads, latent_dim, dtype=q.dtype, device=q.device)
    cu = cu_q_lens if packed else seq_lens
    _split_kernel[(num_b, max_splits, triton.cdiv(rows, _BLOCK_M))](
        q, cache, block_table, seq_lens, cu, part, lse,
        num_rows, max_blocks, max_splits, scale,
        q.stride(0), q.stride(1), cache.stride(1), block_table.stride(0),
        PACKED=packed, HEADS=heads, LAT=latent_dim, ROPE=rope, LAT_P=lat_p,
        ROPE_P=max(triton.next_power_of_2(rope), 16), BS=bs, MIN_SPLIT_N=MIN_SPLIT, BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N, PREC=prec, PDL=pdl, num_warps=8 if lat_p >= 256 else 4,
        launch_pdl=pdl,
    )
    _merge_kernel[(num_b * rows,)](
        part, lse, cu, out, num_rows, max_splits, out.stride(0), out.stride(1), num_b, n,
        PACKED=packed, ZERO_TAIL=zero_tail, HEADS=heads, LAT=latent_dim, LAT_P=lat_p,
        SPLITS_P=16, PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )
    return out
