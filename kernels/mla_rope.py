"""Triton rotary + latent-cache write of an MLA layer (decode, verify and prefill rows).

Owns the kernel behind ``speccal.kernels.ops.mla_rope_cache``; its pure-torch twin is
``reference.mla_rope_cache_ref``. Between an MLA layer's projections and its attention the torch
path runs a dozen small launches per layer (two cats, the rotary's fp32 products and sums, the
rounding, the cache row's cat and ``index_copy_``, the query's cat); here one launch does them,
grid ``(N, H + 1)``: program ``(n, h < H)`` writes row ``n``'s query head ``h`` as ``[q_first |
rotated q_pe]``, program ``(n, H)`` writes ``[latent | rotated k_pe]`` into the row's cache slot.

Rotary (``rotate_pairs``): output channel ``j`` of ``rope`` is ``x[a_j] * cos[c_j] +
(sign_j * x[b_j]) * sin[c_j]`` in fp32, with ``sign_j = -1`` in the first half: the halves form
(``rotate_half``) pairs ``a_j = j`` with ``b_j = j +- rope / 2`` and ``c_j = j``; the interleaved
form (DeepSeek's, written out as ``[even' | odd']``) pairs ``2i`` and ``2i + 1`` with ``c_j = i``.
The same products and sum as the reference's, in the same order and without contraction into
fused multiply-adds, so fp32 results are the reference's bits; the rotated key is rounded to its
own dtype before the cache's, as the reference's ``.to`` chain does. Padding rows write the
sentinel slot (several at once: only padding reads it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["mla_rope_cache_triton"]


@triton.jit
def _rotated(src, cos_row, sin_row, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
             INTERLEAVED: tl.constexpr):
    """``[ROPE_P]`` fp32: the rope channels at ``src`` rotated (channels past ``ROPE``: 0)."""
    j = tl.arange(0, ROPE_P)
    ok = j < ROPE
    half = ROPE // 2
    first = j < half
    if INTERLEAVED:
        i = tl.where(first, j, j - half)
        a = tl.where(first, 2 * i, 2 * i + 1)
        b = tl.where(first, 2 * i + 1, 2 * i)
        c = i
    else:
        a = j
        b = tl.where(first, j + half, j - half)
        c = j
    xa = tl.load(src + a, mask=ok, other=0.0).to(tl.float32)
    xb = tl.load(src + b, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_row + c, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + c, mask=ok, other=0.0).to(tl.float32)
    return xa * cos + tl.where(first, -xb, xb) * sin


@triton.jit
def _rope_cache_kernel(
    first_ptr, qpe_ptr, kpe_ptr, lat_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, out_ptr,
    stride_fn, stride_fh, stride_qn, stride_qh, stride_kn, stride_ln, stride_cn, stride_sn,
    stride_on, stride_oh,
    HEADS: tl.constexpr, FIRST: tl.constexpr, FIRST_P: tl.constexpr, LAT: tl.constexpr,
    LAT_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.arange(0, ROPE_P)
    cos_row = cos_ptr + n * stride_cn
    sin_row = sin_ptr + n * stride_sn
    if h < HEADS:
        rot = _rotated(qpe_ptr + n * stride_qn + h * stride_qh, cos_row, sin_row, ROPE, ROPE_P,
                       INTERLEAVED)
        dst = out_ptr + n * stride_on + h * stride_oh
        f = tl.arange(0, FIRST_P)
        head = tl.load(first_ptr + n * stride_fn + h * stride_fh + f, mask=f < FIRST)
        tl.store(dst + f, head.to(out_ptr.dtype.element_ty), mask=f < FIRST)
        tl.store(dst + FIRST + j, rot.to(out_ptr.dtype.element_ty), mask=j < ROPE)
    else:
        # the key's own dtype first, as the reference (its own name: the query branch's ``rot``
        # stays fp32, and a compiled if / else must not give one name two types)
        key_rot = _rotated(kpe_ptr + n * stride_kn, cos_row, sin_row, ROPE, ROPE_P,
                           INTERLEAVED).to(kpe_ptr.dtype.element_ty)
        dst = cache_ptr + tl.load(slot_ptr + n).to(tl.int64) * (LAT + ROPE)
        c = tl.arange(0, LAT_P)
        lat = tl.load(lat_ptr + n * stride_ln + c, mask=c < LAT)
        tl.store(dst + c, lat.to(cache_ptr.dtype.element_ty), mask=c < LAT)
        tl.store(dst + LAT + j, key_rot.to(cache_ptr.dtype.element_ty), mask=j < ROPE)


def mla_rope_cache_triton(q_first, q_pe, k_pe, latent, cos, sin, slot_mapping, cache,
                          is_interleaved) -> torch.Tensor:
    """``ops.mla_rope_cache`` (its arguments, validated there) in one launch."""
    n, heads, first = q_first.shape
    rope = q_pe.shape[-1]
    lat = latent.shape[-1]
    out = torch.empty(n, heads, first + rope, dtype=q_first.dtype, device=q_first.device)
    if n == 0:
        return out
    _rope_cache_kernel[(n, heads + 1)](
        q_first, q_pe, k_pe, latent, cos, sin, slot_mapping, cache, out,
        q_first.stride(0), q_first.stride(1), q_pe.stride(0), q_pe.stride(1), k_pe.stride(0),
        latent.stride(0), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, FIRST=first, FIRST_P=triton.next_power_of_2(first), LAT=lat,
        LAT_P=triton.next_power_of_2(lat), ROPE=rope, ROPE_P=triton.next_power_of_2(rope),
        INTERLEAVED=bool(is_interleaved), num_warps=4, enable_fp_fusion=False,
    )
    return out
