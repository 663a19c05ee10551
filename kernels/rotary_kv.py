"""Triton fused (per-head q/k RMSNorm +) rotary embedding + KV-cache write.

Owns the step between the QKV projection and attention: optionally the per-head RMSNorm of q and
k (Qwen3's ``q_norm`` / ``k_norm``, fp32, no rounding in between), neox-style rotary on q and k
(on the first ``R`` channels of each head, the rest unrotated: partial rotary), rotated q written to ``q_out`` (in place by default; a contiguous buffer for the attention
kernel saves a copy), rotated k and plain v written to their KV slots, one pass over q, k, v.
One program per token row handles every head. Layout: ``q [T, H, D]``, ``k``/``v [T, KVH, D]``
(views of the fused QKV output are fine: any row and head stride, D contiguous); ``positions [T] int64``;
``cos_sin_cache [max_pos, R]`` fp32 (``R <= D`` even), cos in ``[:R/2]`` and sin in ``[R/2:]``;
``slot_mapping [T] int64`` (padded rows point at the sentinel slot 0); caches
``[num_blocks, block_size, KVH, D]``. Reference: ``reference.rotary_kv_write_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccal.kernels.pdl import pdl_enter

__all__ = ["rotary_kv_write_triton"]


@triton.jit
def _rope(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rope_heads(src, dst, h_ok, cos, sin, nw_ptr, offs_d, d_ok, offs_p, p_ok, eps,
                HALF: tl.constexpr, PASS: tl.constexpr, QK_NORM: tl.constexpr):
    """Heads ``[heads, HALF_PAD]`` pointers at each head's first channel: load the rotating
    halves ``[0, HALF)`` and ``[HALF, 2 HALF)`` and the ``PASS`` channels after them (partial
    rotary: they keep their values), optional per-head RMSNorm over all ``2 HALF + PASS``
    channels (fp32), rotary on the halves, store every channel to ``dst`` (its dtype)."""
    mask = h_ok[:, None] & d_ok[None, :]
    x1 = tl.load(src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    pm = h_ok[:, None] & p_ok[None, :]  # all False without partial rotary (PASS_PAD 1)
    x3 = tl.load(src + 2 * HALF + offs_p[None, :], mask=pm, other=0.0).to(tl.float32)
    if QK_NORM:
        ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(x3 * x3, 1)
        inv = tl.math.rsqrt(ss / (2 * HALF + PASS) + eps)[:, None]
        x1 = x1 * inv * tl.load(nw_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x2 = x2 * inv * tl.load(nw_ptr + HALF + offs_d, mask=d_ok,
                                other=0.0).to(tl.float32)[None, :]
        x3 = x3 * inv * tl.load(nw_ptr + 2 * HALF + offs_p, mask=p_ok,
                                other=0.0).to(tl.float32)[None, :]
    o1, o2 = _rope(x1, x2, cos[None, :], sin[None, :])
    tl.store(dst + offs_d[None, :], o1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs_d[None, :], o2.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + 2 * HALF + offs_p[None, :], x3.to(dst.dtype.element_ty), mask=pm)


@triton.jit
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, qo_ptr, qn_ptr, kn_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h, stride_qot, stride_qoh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    PASS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr, D_PAD: tl.constexpr,
    QK_NORM: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    offs_p = tl.arange(0, PASS_PAD)
    p_ok = offs_p < PASS
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)

    offs_h = tl.arange(0, H_PAD)
    _rope_heads(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh,
                qo_ptr + t * stride_qot + offs_h[:, None] * stride_qoh,
                offs_h < NUM_HEADS, cos, sin, qn_ptr, offs_d, d_ok, offs_p, p_ok, eps, HALF,
                PASS, QK_NORM)
    offs_kh = tl.arange(0, KV_PAD)
    _rope_heads(k_ptr + t * stride_kt + offs_kh[:, None] * stride_kh,
                kc_ptr + slot * stride_kc_slot + offs_kh[:, None] * stride_kc_h,
                offs_kh < NUM_KV_HEADS, cos, sin, kn_ptr, offs_d, d_ok, offs_p, p_ok, eps, HALF,
                PASS, QK_NORM)

    offs_v = tl.arange(0, D_PAD)
    vm = (offs_kh < NUM_KV_HEADS)[:, None] & (offs_v < HEAD_DIM)[None, :]
    vp = v_ptr + t * stride_vt + offs_kh[:, None] * stride_vh + offs_v[None, :]
    vcp = vc_ptr + slot * stride_vc_slot + offs_kh[:, None] * stride_vc_h + offs_v[None, :]
    tl.store(vcp, tl.load(vp, mask=vm, other=0.0).to(vc_ptr.dtype.element_ty), mask=vm)


def rotary_kv_write_triton(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, R]: R <= D rotating channels
    slot_mapping: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    *,
    q_out: torch.Tensor | None = None,  # [T, H, D]; None: q in place
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q_w [D], k_w [D], eps)
    pdl: bool = False,
) -> torch.Tensor:  # q_out (q when None)
    """One launch; arguments validated by ``ops.rotary_kv_write``."""
    t, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    rest = d - 2 * half
    qo = q if q_out is None else q_out
    qn, kn, eps = qk_norm if qk_norm is not None else (cos_sin_cache, cos_sin_cache, 0.0)
    _rotary_kv_kernel[(t,)](
        q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, qo, qn, kn, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), qo.stride(0), qo.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, PASS=rest, HEAD_DIM=d,
        H_PAD=triton.next_power_of_2(num_heads), KV_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half), PASS_PAD=triton.next_power_of_2(max(rest, 1)),
        D_PAD=triton.next_power_of_2(d), QK_NORM=qk_norm is not None, PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )
    return qo
