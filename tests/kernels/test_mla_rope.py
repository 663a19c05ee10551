"""The Triton MLA rotary + latent-cache write against the reference, on the GPU (``cuda``
marker); ``SPECCAL_KERNEL_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` runs the same checks
through Triton's interpreter on fp32. fp32 results are the reference's bits (the same products
and sums, no fused multiply-adds); bf16 within one rounding."""

from __future__ import annotations

import os

import pytest
import torch

from speccal.kernels import ops

pytest.importorskip("triton")
pytestmark = pytest.mark.cuda
DEV = os.environ.get("SPECCAL_KERNEL_TEST_DEVICE", "cuda")
DTYPES = [torch.float32] if DEV == "cpu" else [torch.float32, torch.bfloat16]

CASES = [
    # (rows N, heads, first channels F, latent, rope, block size, blocks)
    (1, 16, 512, 512, 64, 16, 4),  # a decode row of DeepSeek-V2-Lite's layer (absorbed query)
    (7, 3, 24, 40, 8, 8, 6),  # verify rows, odd widths: masked channel tiles
    (5, 4, 16, 24, 12, 16, 3),  # q_nope as the first part (a prefill chunk), rope 12
    (9, 5, 33, 17, 2, 4, 30),  # the smallest rope, padding rows on the sentinel slot
]


def _case(seed, n, h, first, lat, rope, bs, blocks, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, first + 2 + rope, generator=gen)  # q_pe a strided view of a wider q
    ckv = torch.randn(n, lat + rope, generator=gen)
    latent = torch.randn(n, lat, generator=gen)
    angles = torch.rand(n, rope // 2, generator=gen) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()], -1)  # cat(freqs, freqs), as RotaryTable rows
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    slots = torch.randperm(blocks * bs - 1, generator=gen)[:n] + 1
    if n > 4:
        slots[-2:] = 0  # padding rows: the sentinel slot
    cache = torch.randn(blocks, bs, 1, lat + rope, generator=gen)
    to = dict(device=DEV, dtype=dtype)
    q, ckv = q.to(**to), ckv.to(**to)  # moved whole, then sliced: the views keep their strides
    return (q[..., :first], q[..., first + 2:], ckv[:, lat:], latent.to(**to), cos.to(DEV),
            sin.to(DEV), slots.to(DEV), cache.to(**to))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_mla_rope_cache_matches_reference(dtype, interleaved, case):
    first, q_pe, k_pe, latent, cos, sin, slots, cache = _case(3, *case, dtype)
    # q_pe is a view with gaps between heads; q_first too
    assert not q_pe.is_contiguous() and not first.is_contiguous()
    want_cache = cache.clone()
    want = ops.mla_rope_cache(first, q_pe, k_pe, latent, cos, sin, slots, want_cache,
                              interleaved, backend="reference")
    got_cache = cache.clone()
    got = ops.mla_rope_cache(first, q_pe, k_pe, latent, cos, sin, slots, got_cache, interleaved,
                             backend="triton")
    n, h, f = first.shape
    assert got.shape == (n, h, f + q_pe.shape[-1]) and got.dtype == dtype
    real = slots != 0  # the sentinel slot takes several padding rows: any of them
    flat_got = got_cache.view(-1, got_cache.shape[-1])
    flat_want = want_cache.view(-1, want_cache.shape[-1])
    if dtype == torch.float32:
        assert torch.equal(got, want)
        assert torch.equal(flat_got[slots[real]], flat_want[slots[real]])
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(flat_got[slots[real]].float(),
                                   flat_want[slots[real]].float(), rtol=1e-2, atol=1e-2)
    untouched = torch.ones(flat_got.shape[0], dtype=torch.bool, device=flat_got.device)
    untouched[slots] = False
    assert torch.equal(flat_got[untouched], cache.view(-1, cache.shape[-1])[untouched])


def test_mla_rope_cache_refuses_bad_shapes_by_name():
    first, q_pe, k_pe, latent, cos, sin, slots, cache = _case(3, 3, 2, 8, 8, 4, 4, 4,
                                                              torch.float32)
    with pytest.raises(Exception, match="k_pe"):
        ops.mla_rope_cache(first, q_pe, k_pe[:, :2], latent, cos, sin, slots, cache, True)
    with pytest.raises(Exception, match="cos"):
        ops.mla_rope_cache(first, q_pe, k_pe, latent, cos[:, :2], sin, slots, cache, True)
    with pytest.raises(Exception, match="cache"):
        ops.mla_rope_cache(first, q_pe, k_pe, latent, cos, sin, slots, cache[..., :-1], True)
