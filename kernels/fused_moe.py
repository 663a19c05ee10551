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

from speccal.kernels.pdl import pdl_enter

__all__ = ["fused_moe_triton"]

_BLOCK_N = 64
_BLOCK_K = 64


@triton.jit(do_not_specialize=("num_pairs",))  # one compile per model, any row count
def _gate_up_kernel(
    x_ptr, w_ptr, pairs_ptr, experts_ptr, act_ptr, num_pairs,
    stride_x, stride_we, stride_wn, stride_a,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, PDL: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    pdl_enter(PDL)
    e = tl.load(experts_ptr + pid_m)
    if e < 0:  # past the last expert's run: no weights read
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    is_pair = pair < num_pairs
    row = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
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


@triton.jit(do_not_specialize=("num_pairs",))
def _down_kernel(
    act_ptr, w_ptr, pairs_ptr, experts_ptr, rw_ptr, out_ptr, num_pairs,
    stride_a, stride_we, stride_wn, stride_o,
    H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr, PDL: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    pdl_enter(PDL)
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    is_pair = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
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
) -> torch.Tensor:  # [N * top_k, hidden]: each pair's weighted expert output
    """Two launches; arguments validated by ``ops.fused_moe``."""
    n, k = weights.shape
    hidden, inter = x.shape[1], down.shape[2]
    num_blocks = block_expert.shape[0]
    block_m = sorted_pairs.shape[0] // num_blocks
    act = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(n * k, hidden, dtype=x.dtype, device=x.device)
    rw = weights.reshape(-1)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, _BLOCK_N))](
        x, gate_up, sorted_pairs, block_expert, act, n * k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        H=hidden, INTER=inter, TOP_K=k, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        PREC=prec, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    _down_kernel[(num_blocks, triton.cdiv(hidden, _BLOCK_N))](
        act, down, sorted_pairs, block_expert, rw, out, n * k,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        H=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        PREC=prec, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return out
