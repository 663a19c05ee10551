"""Triton fused RMSNorm, optionally with the residual add in the same pass.

Owns the norm of the decode/verify step: ``h = x + residual`` (stored back into ``residual``,
in place, in the activation dtype) then ``y = h * rsqrt(mean(h^2) + eps) * weight`` from the fp32
``h``. One program per row (rows are 1..few hundred, hidden ~2048: the row fits in registers),
so x, residual and weight are read once and y, h written once. Layout: ``x``, ``residual``,
``out`` ``[M, N]`` with N contiguous; ``weight [N]``. Reference: ``reference.rms_norm_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["norm_row_store", "rms_norm_triton"]


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
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
