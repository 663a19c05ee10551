"""Triton fused RMSNorm, optionally with the residual add or the embedding gather in the same pass.

Owns the norm of the decode/verify step: ``h = x + residual`` (stored back into ``residual``,
in place, in the activation dtype) then ``y = h * rsqrt(mean(h^2) + eps) * weight`` from the fp32
``h``. One program per row (rows are 1..few hundred, hidden ~2048: the row fits in registers),
so x, residual and weight are read once and y, h written once. Layout: ``x``, ``residual``,
``out`` ``[M, N]`` with N contiguous; ``weight [N]``. Reference: ``reference.rms_norm_ref``.

The step's first norm (layer 0's input norm) also gathers its rows from the embedding table:
``h = table[input_ids]`` (the residual stream, copied bit for bit) and ``y = norm(h)`` in one
launch (``embed_rms_norm_triton``; reference ``reference.embed_rms_norm_ref``), instead of an
index_select and a norm launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccal.kernels.pdl import pdl_enter

__all__ = ["embed_rms_norm_triton", "norm_row_store", "rms_norm_triton"]


@triton.jit
def norm_row_store(h, w, out_ptr, offs, ok, N, eps):
    """Store ``h * rsqrt(mean(h^2) + eps) * w`` for one fp32 row ``h`` and the fp32 weight
    ``w`` (both ``[BLOCK]``, masked). Callers load ``w`` before their PDL wait (weights are
    never written), off the serial path behind the row's sum."""
    inv = tl.math.rsqrt(tl.sum(h * h, 0) / N + eps)
    tl.store(out_ptr + offs, (h * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, N, stride_x, stride_r, stride_o, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    h = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * stride_r + offs, h.to(res_ptr.dtype.element_ty), mask=ok)
    norm_row_store(h, w, out_ptr + row * stride_o, offs, ok, N, eps)


def rms_norm_triton(
    x: torch.Tensor,  # [M, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [M, N], updated in place to x + residual
    out: torch.Tensor | None = None,  # [M, N]
    pdl: bool = False,
) -> torch.Tensor:  # out
    """One launch; arguments validated by ``ops.rms_norm``."""
    m, n = x.shape
    if out is None:
        out = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _rms_norm_kernel[(m,)](
        x, res, weight, out, n, x.stride(0), res.stride(0), out.stride(0), eps,
        HAS_RES=residual is not None, BLOCK=block, PDL=pdl,
        num_warps=min(16, max(1, block // 256)), launch_pdl=pdl,
    )
    return out


@triton.jit
def _embed_rms_norm_kernel(
    ids_ptr, table_ptr, w_ptr, h_ptr, out_ptr, N, V, stride_id, stride_t, stride_h, stride_o,
    eps, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    pdl_enter(PDL)  # the ids are the predecessor's output (the verify token update)
    tok = tl.load(ids_ptr + row * stride_id).to(tl.int64)
    live = (tok >= 0) & (tok < V)  # an id outside the table gives a zero row, never a stray read
    e = tl.load(table_ptr + tok * stride_t + offs, mask=ok & live, other=0.0)
    tl.store(h_ptr + row * stride_h + offs, e.to(h_ptr.dtype.element_ty), mask=ok)
    norm_row_store(e.to(tl.float32), w, out_ptr + row * stride_o, offs, ok, N, eps)


def embed_rms_norm_triton(
    input_ids: torch.Tensor,  # [M] int
    table: torch.Tensor,  # [V, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    out_h: torch.Tensor,  # [M, N], written: table[input_ids]
    out: torch.Tensor,  # [M, N], written: rms_norm(out_h) * weight
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (out_h, out)
    """One launch; arguments validated by ``ops.embed_rms_norm``."""
    m = input_ids.shape[0]
    v, n = table.shape
    block = triton.next_power_of_2(n)
    _embed_rms_norm_kernel[(m,)](
        input_ids, table, weight, out_h, out, n, v, input_ids.stride(0), table.stride(0),
        out_h.stride(0), out.stride(0), eps, BLOCK=block, PDL=pdl,
        num_warps=min(16, max(1, block // 256)), launch_pdl=pdl,
    )
    return out_h, out
