"""Triton fused routed-expert MLP over the block-aligned pair layout (``reference.moe_align_ref``).

Owns the expert products of ``ops.fused_moe``: two launches over the blocks of ``BLOCK_M``
sorted (row, expert) pairs, each block one expert's (the layout pads every expert's run to a
multiple of ``BLOCK_M``; layout and stacked weights in ``reference``'s module docstring).

1. ``_gate_up_kernel``, grid ``(blocks, cdiv(I, BLOCK_N))``: gate and up of the block's rows in
   one pass over the fused ``gate_up [E, 2 I, hidden]`` (the gate and up tiles of the same
   columns share each loaded x tile), ``silu(gate) * up`` in fp32, written to ``act [P, I]``
   in x's dtype (position-major, the padded layout).
2. ``_down_kernel``, grid ``(blocks, cdiv(hidden, BLOCK_N))``: ``act @ down[e].T``, rounded to
   x's dtype, times the pair's routing weight, written to the pair's row of ``out [N top_k,
   hidden]``.

The model's widths (``H``, ``INTER``) and ``top_k`` are compile-time constants and the pair
count is not specialised (``do_not_specialize``): one specialization per model and dtype,
whatever the row count (every bucket's graph shares it). A block whose expert is -1 (past the last expert's run) returns before it reads anything, so
only active experts' weights are read, each once per block of its rows (once per round for
decode and verify rows, where an expert rarely gets more than ``BLOCK_M`` pairs). Padding
positions (the sentinel pair) load zero rows and store nothing. ``ops.fused_moe`` sums each
row's pairs in ascending expert order (``reference.moe_sum_slots_ref``), as the reference does.
Reference: ``reference.fused_moe_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccal.kernels.config import DEFAULT_TILES, ExpertTiles  # noqa: F401 (re-exported)
from speccal.kernels.pdl import pdl_enter
from speccal.kernels.reference_moe import SIGMOID_NORM_EPS

__all__ = ["DEFAULT_TILES", "ExpertTiles", "fused_moe_one_row_triton", "fused_moe_triton",
           "moe_align_triton", "moe_route_triton", "moe_sum_slots_triton"]


@triton.jit
def _direct_counts(ids_ptr, counts_ptr, act_ptr, stride_act, act_rows, real, TOP_K: tl.constexpr,
                   E: tl.constexpr, EB: tl.constexpr, KB: tl.constexpr):
    """One row's expert counts (1 for each of its experts, none if the row is not ``real``) and
    its experts ORed into ``act_rows`` activated masks: what the layout launch writes."""
    slot = tl.arange(0, EB)
    j = tl.arange(0, KB)
    ex = tl.load(ids_ptr + j, mask=j < TOP_K, other=-1).to(tl.int32)
    hit = tl.sum((ex[None, :] == slot[:, None]).to(tl.int32), axis=1) * (real != 0).to(tl.int32)
    is_e = slot < E
    tl.store(counts_ptr + slot, hit.to(counts_ptr.dtype.element_ty), mask=is_e)
    for r in range(act_rows):
        cur = tl.load(act_ptr + r * stride_act + slot, mask=is_e, other=0)
        tl.store(act_ptr + r * stride_act + slot, ((cur != 0) | (hit > 0)).to(tl.uint8),
                 mask=is_e)


@triton.jit
def _block_pairs(pairs_ptr, experts_ptr, ids_ptr, real_ptr, pid_m, num_pairs, direct, has_real,
                 BLOCK_M: tl.constexpr):
    """Block ``pid_m``'s expert, its ``BLOCK_M`` pair indices (``num_pairs``: padding) and
    whether it runs. Laid out (``direct == 0``): the layout launch's block expert (-1: none)
    and sorted pairs. Direct (one row, no layout launch): block j is pair j, its expert the
    row's j-th choice, run only if the row is real."""
    lane = tl.arange(0, BLOCK_M)
    if direct != 0:
        e = tl.load(ids_ptr + pid_m).to(tl.int64)
        real = tl.load(real_ptr, mask=has_real != 0, other=1)
        pair = tl.where(lane == 0, pid_m, num_pairs).to(tl.int64)
        run = (real != 0).to(tl.int32)
    else:
        e = tl.load(experts_ptr + pid_m).to(tl.int64)
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + lane).to(tl.int64)
        run = (e >= 0).to(tl.int32)
    return e, pair, run


# one compile per model, any row count: the pair count, the direct / mask switches and the
# row-mask and expert-mask pointers (views of other buffers: their alignment varies) are not
# specialised (every bucket's graph, one row or many, shares it)
@triton.jit(do_not_specialize=("num_pairs", "direct", "has_real", "act_rows", "stride_act",
                               "real_ptr", "mask_ptr"))
def _gate_up_kernel(
    x_ptr, w_ptr, pairs_ptr, experts_ptr, act_ptr, num_pairs,
    ids_ptr, real_ptr, counts_ptr, mask_ptr, stride_act, direct, has_real, act_rows,
    stride_x, stride_we, stride_wn, stride_a,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    E: tl.constexpr, EB: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    pdl_enter(PDL)
    if direct != 0:
        if pid_m == 0:
            if pid_n == 0:
                real = tl.load(real_ptr, mask=has_real != 0, other=1)
                _direct_counts(ids_ptr, counts_ptr, mask_ptr, stride_act, act_rows, real, TOP_K,
                               E, EB, KB)
    e, pair, run = _block_pairs(pairs_ptr, experts_ptr, ids_ptr, real_ptr, pid_m, num_pairs,
                                direct, has_real, BLOCK_M)
    if run == 0:  # no expert (past the last run, or a masked row): no weights read
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    is_pair = pair < num_pairs
    row = pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + INTER * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + offs_k
        ok_k = kk < H
        xt = tl.load(x_ptr + row[:, None] * stride_x + kk[None, :],
                     mask=is_pair[:, None] & ok_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        ok_w = ok_k[:, None] & is_col[None, :]
        wg = tl.load(w_gate + kk[:, None], mask=ok_w, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up + kk[:, None], mask=ok_w, other=0.0)
        acc_g = tl.dot(xt, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(xt, wu, acc_u, input_precision=PREC)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = act_ptr + offs_m[:, None].to(tl.int64) * stride_a + offs_n[None, :]
    tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=is_pair[:, None] & is_col[None, :])


@triton.jit(do_not_specialize=("num_pairs", "direct", "has_real", "real_ptr"))
def _down_kernel(
    act_ptr, w_ptr, pairs_ptr, experts_ptr, rw_ptr, out_ptr, num_pairs,
    ids_ptr, real_ptr, direct, has_real,
    stride_a, stride_we, stride_wn, stride_o,
    H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, PDL: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    pdl_enter(PDL)
    e, pair, run = _block_pairs(pairs_ptr, experts_ptr, ids_ptr, real_ptr, pid_m, num_pairs,
                                direct, has_real, BLOCK_M)
    if run == 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    is_pair = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    a_base = act_ptr + offs_m[:, None].to(tl.int64) * stride_a
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + offs_k
        ok_k = kk < INTER
        a = tl.load(a_base + kk[None, :], mask=is_pair[:, None] & ok_k[None, :], other=0.0)
        w = tl.load(w_base + kk[:, None], mask=ok_k[:, None] & is_col[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PREC)
    rw = tl.load(rw_ptr + pair, mask=is_pair, other=0.0).to(tl.float32)
    # round the product to x's dtype first, as nn.Linear's output is, then weight it
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * rw[:, None]
    dst = out_ptr + pair[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=is_pair[:, None] & is_col[None, :])


def fused_moe_triton(
    x: torch.Tensor,  # [N, hidden]
    weights: torch.Tensor,  # [N, top_k]
    gate_up: torch.Tensor,  # [E, 2 I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    sorted_pairs: torch.Tensor,  # [P] int64
    block_expert: torch.Tensor,  # [P / block_m] int64
    prec: str | None,  # tl.dot's input_precision for fp32 operands (None: Triton's default)
    pdl: bool = False,
    tiles: ExpertTiles = DEFAULT_TILES,
) -> torch.Tensor:  # [N * top_k, hidden]: each pair's weighted expert output
    """Two launches over the layout of ``moe_align_triton``; arguments validated by
    ``ops.fused_moe``."""
    num_blocks = block_expert.shape[0]
    block_m = sorted_pairs.shape[0] // num_blocks
    pair_out, _ = _launch(x, weights, gate_up, down, sorted_pairs, block_expert, num_blocks,
                          block_m, None, prec, pdl, tiles)
    return pair_out


def fused_moe_one_row_triton(
    x: torch.Tensor,  # [1, hidden]
    weights: torch.Tensor,  # [1, top_k]
    ids: torch.Tensor,  # [1, top_k] int: distinct experts
    real: torch.Tensor | None,  # [1] bool: whether the row routes (None: it does)
    activated: torch.Tensor | None,  # [R, E] bool, ORed with the row's experts in place
    gate_up: torch.Tensor,  # [E, 2 I, hidden]
    down: torch.Tensor,  # [E, hidden, I]
    block_m: int,
    prec: str | None,
    pdl: bool = False,
    tiles: ExpertTiles = DEFAULT_TILES,
) -> tuple[torch.Tensor, torch.Tensor]:  # pair outputs [top_k, hidden], counts [E] int64
    """One decode row without the layout launch: block j is the row's pair j (its j-th
    expert; distinct experts, so the same weight reads as the laid-out blocks), and the first
    gate/up program writes the counts and the activated masks the layout launch would have.
    Two launches; arguments validated by ``ops.fused_moe``."""
    k = ids.shape[1]
    num_experts = gate_up.shape[0]
    counts = torch.empty(num_experts, dtype=torch.long, device=x.device)
    direct = (ids.to(torch.long).contiguous(), real, activated, counts)
    return _launch(x, weights, gate_up, down, None, None, k, block_m, direct, prec, pdl, tiles)


def _launch(x, weights, gate_up, down, pairs, blocks, num_blocks, block_m, direct, prec, pdl,
            tiles) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gate/up and down launches over ``num_blocks`` blocks of ``block_m`` positions: laid
    out (``pairs``, ``blocks``) or ``direct`` (``(ids, real, activated, counts)``: one row)."""
    n, k = weights.shape
    hidden, inter = x.shape[1], down.shape[2]
    num_experts = gate_up.shape[0]
    act = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(n * k, hidden, dtype=x.dtype, device=x.device)
    rw = weights.reshape(-1)
    # unread pointers get stand-ins of their element type (int64 or uint8): a pointer's type
    # is part of the kernel's signature, and both modes share one compile
    bytes_ = x.view(torch.uint8)
    if direct is None:
        ids = counts = pairs
        real = mask = bytes_
        flags = dict(direct=0, has_real=0)
        act_rows, stride_act = 0, 0
        pairs_, blocks_ = pairs, blocks
    else:
        ids, real, activated, counts = direct
        flags = dict(direct=1, has_real=int(real is not None))
        real = real.view(torch.uint8) if real is not None else bytes_
        mask = activated.view(torch.uint8) if activated is not None else bytes_
        act_rows = activated.shape[0] if activated is not None else 0
        stride_act = activated.stride(0) if activated is not None else 0
        pairs_ = blocks_ = ids
    opts = tiles.launch_options()
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles.gate_up_n))](
        x, gate_up, pairs_, blocks_, act, n * k,
        ids, real, counts, mask, stride_act, flags["direct"], flags["has_real"], act_rows,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        H=hidden, INTER=inter, TOP_K=k, BLOCK_M=block_m, BLOCK_N=tiles.gate_up_n,
        BLOCK_K=tiles.gate_up_k, E=num_experts, EB=triton.next_power_of_2(num_experts),
        KB=triton.next_power_of_2(k), PREC=prec, PDL=pdl, launch_pdl=pdl, **opts,
    )
    _down_kernel[(num_blocks, triton.cdiv(hidden, tiles.down_n))](
        act, down, pairs_, blocks_, rw, out, n * k, ids, real, flags["direct"],
        flags["has_real"], act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        H=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=tiles.down_n, BLOCK_K=tiles.down_k,
        PREC=prec, PDL=pdl, launch_pdl=pdl, **opts,
    )
    return out, (None if direct is None else counts)


@triton.jit
def _pair_chunk(ids_ptr, real_ptr, p0, lane, num_pairs, TOP_K: tl.constexpr, E: tl.constexpr,
                HAS_REAL: tl.constexpr):
    """Pairs ``p0 + lane``: their indices, which exist, and their expert slots (E, the
    sentinel, for rows outside ``real``; -1 past the last pair)."""
    p = p0 + lane
    ok = p < num_pairs
    ex = tl.load(ids_ptr + p, mask=ok, other=-1).to(tl.int32)
    if HAS_REAL:
        real = tl.load(real_ptr + p // TOP_K, mask=ok, other=1)
        ex = tl.where(real != 0, ex, E)
    return p, ok, ex


@triton.jit(do_not_specialize=("num_pairs", "num_blocks"))
def _align_kernel(
    ids_ptr, real_ptr, pairs_ptr, experts_ptr, counts_ptr, act_ptr, num_pairs, num_blocks,
    stride_act,
    TOP_K: tl.constexpr, E: tl.constexpr, EB: tl.constexpr, BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr, HAS_REAL: tl.constexpr, ACT_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    # one program: the whole layout of ``reference.moe_align_ref`` (a stable counting sort by
    # expert; expert slot E is the sentinel of rows outside ``real``), the counts and the
    # activated masks, from ``[EB, CHUNK]`` comparisons of expert slots against pair chunks
    pdl_enter(PDL)
    slot = tl.arange(0, EB)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros([EB], dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p, ok, ex = _pair_chunk(ids_ptr, real_ptr, p0, lane, num_pairs, TOP_K, E, HAS_REAL)
        counts += tl.sum((ex[None, :] == slot[:, None]).to(tl.int32), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [EB]: each slot's run ends here (empty slots add nothing)
    total = num_blocks * BLOCK_M
    for q0 in range(0, total, CHUNK):
        q = q0 + lane
        tl.store(pairs_ptr + q, num_pairs + q * 0, mask=q < total)  # the padding pair
    tl.debug_barrier()  # the fill lands before the scatter below overwrites parts of it
    run = ends - padded  # [EB]: next free position of each slot's run
    for p0 in range(0, num_pairs, CHUNK):
        p, ok, ex = _pair_chunk(ids_ptr, real_ptr, p0, lane, num_pairs, TOP_K, E, HAS_REAL)
        hit = ex[None, :] == slot[:, None]  # [EB, CHUNK]
        base = tl.sum(tl.where(hit, run[:, None], 0), axis=0)  # [CHUNK]
        earlier = (ex[None, :] == ex[:, None]) & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)  # earlier pairs of the chunk, same expert
        tl.store(pairs_ptr + base + rank, p.to(pairs_ptr.dtype.element_ty), mask=ok)
        run += tl.sum(hit.to(tl.int32), axis=1)
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + lane
        # the run a block starts in: how many runs end at or before its start (searchsorted)
        idx = tl.sum((ends[:, None] <= (b * BLOCK_M)[None, :]).to(tl.int32), axis=0)
        tl.store(experts_ptr + b, tl.where(idx < E, idx, -1).to(experts_ptr.dtype.element_ty),
                 mask=b < num_blocks)
    is_e = slot < E
    tl.store(counts_ptr + slot, counts.to(counts_ptr.dtype.element_ty), mask=is_e)
    for r in tl.static_range(ACT_ROWS):  # the activated masks: OR in this call's experts
        cur = tl.load(act_ptr + r * stride_act + slot, mask=is_e, other=0)
        tl.store(act_ptr + r * stride_act + slot, ((cur != 0) | (counts > 0)).to(tl.uint8),
                 mask=is_e)


def moe_align_triton(
    ids: torch.Tensor,  # [N, top_k] int
    num_experts: int,
    block_m: int,
    real: torch.Tensor | None,  # [N] bool: rows that route (None: all); the others' pairs go last
    activated: torch.Tensor | None,  # [R, E] bool, ORed with this call's experts in place
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # as reference.moe_align_ref
    """One launch; arguments validated by ``ops.fused_moe``. The same layout, block experts and
    counts as ``reference.moe_align_ref(ids masked to the sentinel where not real, ...,
    sentinel=real is not None)``."""
    n, k = ids.shape
    num_pairs = n * k
    laid = num_experts + 1 if real is not None else num_experts
    num_blocks = -(-(num_pairs + min(laid, num_pairs) * (block_m - 1)) // block_m)
    dev = ids.device
    pairs = torch.empty(num_blocks * block_m, dtype=torch.long, device=dev)
    experts = torch.empty(num_blocks, dtype=torch.long, device=dev)
    counts = torch.empty(num_experts, dtype=torch.long, device=dev)
    eb = triton.next_power_of_2(laid)
    chunk = max(16, min(64, 8192 // eb))
    act = activated.view(torch.uint8) if activated is not None else counts
    _align_kernel[(1,)](
        ids.contiguous(), real.view(torch.uint8) if real is not None else ids, pairs, experts,
        counts, act, num_pairs, num_blocks, act.stride(0) if activated is not None else 0,
        TOP_K=k, E=num_experts, EB=eb, BLOCK_M=block_m, CHUNK=chunk,
        HAS_REAL=real is not None, ACT_ROWS=activated.shape[0] if activated is not None else 0,
        PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return pairs, experts, counts


@triton.jit
def _sum_slots_kernel(
    y_ptr, ids_ptr, real_ptr, out_ptr, stride_y, stride_o,
    H: tl.constexpr, TOP_K: tl.constexpr, KB: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_REAL: tl.constexpr, PDL: tl.constexpr,
):
    # one row's pair outputs added in ascending expert order, each addition rounded to the
    # output's dtype (``reference.moe_sum_slots_ref``); rows outside ``real`` are zero
    n, pid_h = tl.program_id(0), tl.program_id(1)
    pdl_enter(PDL)
    j = tl.arange(0, KB)
    ex = tl.load(ids_ptr + n * TOP_K + j, mask=j < TOP_K, other=2**30)
    before = (ex[None, :] < ex[:, None]) | ((ex[None, :] == ex[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)  # [KB]: the slot's place in expert order
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    row = y_ptr + (n * TOP_K).to(tl.int64) * stride_y
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        s = tl.sum(tl.where(rank == r, j, 0), axis=0)
        y = tl.load(row + s * stride_y + h, mask=ok, other=0.0).to(tl.float32)
        if r == 0:
            acc = y
        else:
            acc = (acc + y).to(out_ptr.dtype.element_ty).to(tl.float32)
    if HAS_REAL:
        acc = tl.where(tl.load(real_ptr + n) != 0, acc, 0.0)
    tl.store(out_ptr + n.to(tl.int64) * stride_o + h, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_sum_slots_triton(
    pair_out: torch.Tensor,  # [N * top_k, hidden]
    ids: torch.Tensor,  # [N, top_k] int: distinct within a row
    real: torch.Tensor | None,  # [N] bool: rows kept (None: all); the others are zero
    pdl: bool = False,
) -> torch.Tensor:  # [N, hidden] pair_out's dtype
    """One launch: ``reference.moe_sum_slots_ref``, then the rows outside ``real`` zeroed."""
    n, k = ids.shape
    hidden = pair_out.shape[1]
    out = torch.empty(n, hidden, dtype=pair_out.dtype, device=pair_out.device)
    block_h = min(triton.next_power_of_2(hidden), 1024)
    _sum_slots_kernel[(n, triton.cdiv(hidden, block_h))](
        pair_out, ids.contiguous(), real.view(torch.uint8) if real is not None else ids, out,
        pair_out.stride(0), out.stride(0),
        H=hidden, TOP_K=k, KB=triton.next_power_of_2(k), BLOCK_H=block_h,
        HAS_REAL=real is not None, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return out


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, scale, eps,
    E: tl.constexpr, E_P: tl.constexpr, TOP_K: tl.constexpr, K_P: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    NORMALISE: tl.constexpr, PDL: tl.constexpr,
):
    # one row: scores, (group-limited) selection, the top_k by repeated arg-max (ties to the
    # lower expert), their weights; ``reference.moe_route_ref``
    n = tl.program_id(0)
    pdl_enter(PDL)
    cols = tl.arange(0, E_P)
    ok = cols < E
    x = tl.load(logits_ptr + n.to(tl.int64) * stride_l + cols, mask=ok,
                other=float("-inf")).to(tl.float32)
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-x))
        choice = score
        if HAS_BIAS:
            choice = score + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        choice = tl.where(ok, choice, float("-inf"))
        if GROUPS > 1:  # E == E_P here: the [G, E / G] view is exact
            g = tl.reshape(choice, (GROUPS, E // GROUPS))
            within = tl.arange(0, E // GROUPS)
            first = tl.argmax(g, 1)
            best = tl.max(g, 1)
            second = tl.max(tl.where(within[None, :] == first[:, None], float("-inf"), g), 1)
            gscore = best + second  # [G]
            gid = tl.arange(0, GROUPS)
            keep = gid < 0
            for _ in tl.static_range(TOPK_GROUPS):
                top = tl.argmax(gscore, 0)
                keep = keep | (gid == top)
                gscore = tl.where(gid == top, float("-inf"), gscore)
            g = tl.where(keep[:, None], g, float("-inf"))
            choice = tl.reshape(g, (E_P,))
    else:
        big = tl.max(x, 0)
        e = tl.exp(x - big)
        score = e / tl.sum(e, 0)
        choice = tl.where(ok, score, float("-inf"))
    slot = tl.arange(0, K_P)
    picked = tl.zeros([K_P], dtype=tl.int32)
    weight = tl.zeros([K_P], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        top = tl.argmax(choice, 0)
        w = tl.sum(tl.where(cols == top, score, 0.0), 0)
        picked = tl.where(slot == j, top, picked)
        weight = tl.where(slot == j, w, weight)
        choice = tl.where(cols == top, float("-inf"), choice)
    if NORMALISE:
        weight = weight / (tl.sum(weight, 0) + eps)
    weight = weight * scale
    tl.store(w_ptr + n * TOP_K + slot, weight.to(w_ptr.dtype.element_ty), mask=slot < TOP_K)
    tl.store(ids_ptr + n * TOP_K + slot, picked.to(ids_ptr.dtype.element_ty), mask=slot < TOP_K)


def moe_route_triton(logits, bias, top_k, scoring, num_groups, topk_groups, normalise, scale,
                     pdl=False) -> tuple[torch.Tensor, torch.Tensor]:  # weights, ids [N, top_k]
    """One launch, one program a row; arguments validated by ``ops.moe_route``."""
    n, num_experts = logits.shape
    sigmoid = scoring == "sigmoid"
    weights = torch.empty(n, top_k, dtype=torch.float32 if sigmoid else logits.dtype,
                          device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.long, device=logits.device)
    eps = SIGMOID_NORM_EPS if sigmoid and normalise else 0.0
    _route_kernel[(n,)](
        logits, bias if bias is not None else logits, weights, ids, logits.stride(0), scale, eps,
        E=num_experts, E_P=triton.next_power_of_2(num_experts), TOP_K=top_k,
        K_P=triton.next_power_of_2(top_k), SIGMOID=sigmoid,
        HAS_BIAS=bias is not None, GROUPS=num_groups, TOPK_GROUPS=topk_groups,
        NORMALISE=normalise, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return weights, ids
