"""The Triton MLA attention (absorbed form over the paged latent cache) against the reference,
on the GPU (``cuda`` marker); ``SPECCAL_KERNEL_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1``
runs the same checks through Triton's interpreter on fp32."""

from __future__ import annotations

import os

import pytest
import torch

from speccal.kernels import ops

pytest.importorskip("triton")
pytestmark = pytest.mark.cuda
DEV = os.environ.get("SPECCAL_KERNEL_TEST_DEVICE", "cuda")
DTYPES = [torch.float32] if DEV == "cpu" else [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

CASES = [
    # (requests, rows R, heads, latent, rope, block size, blocks per request)
    (1, 1, 16, 512, 64, 16, 6),  # a decode row of DeepSeek-V2-Lite's layer
    (3, 1, 4, 32, 16, 16, 4),
    (2, 4, 3, 40, 8, 16, 5),  # verify rows, odd widths: masked channel tiles
    (4, 2, 5, 24, 12, 8, 9),  # more splits than one key tile, small blocks
    (12, 2, 16, 32, 16, 16, 200),  # a long cache: 11 splits of several key tiles each
]
if DEV != "cpu":
    CASES += [(8, 4, 16, 512, 64, 16, 80), (2, 1, 128, 512, 64, 64, 40)]  # V3's 128 heads


def _case(seed, b, r, h, lat, rope, bs, mb, dtype):
    gen = torch.Generator().manual_seed(seed)
    dim = lat + rope
    blocks = b * mb + 1
    cache = torch.randn(blocks, bs, 1, dim, generator=gen)
    table = (torch.randperm(blocks - 1, generator=gen)[: b * mb] + 1).view(b, mb).int()
    seq = torch.randint(1, mb * bs + 1, (b,), generator=gen).int()
    seq[0] = mb * bs  # one request at the table's full width
    if b > 2:
        seq[1] = 1  # one whose rows see a single key (front padding rows too)
    q = torch.randn(b * r, h, dim, generator=gen)
    return (q.to(DEV, dtype), cache.to(DEV, dtype), table.to(DEV), seq.to(DEV))


def _packed(seed, b, r, h, dim, dtype, pad=3):
    """Packed rows: request ``i`` has 1 .. ``r`` rows, ``pad`` padding rows after the last."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = torch.randint(1, r + 1, (b,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
    q = torch.randn(int(cu[-1]) + pad, h, dim, generator=gen)
    return q.to(DEV, dtype), cu.to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_mla_attention_matches_reference(dtype, case):
    b, r, h, lat, rope, bs, mb = case
    q, cache, table, seq = _case(7, b, r, h, lat, rope, bs, mb, dtype)
    if not ops.mla_rows_aligned(cache, lat):  # rows off 16 bytes: refused by name, auto: torch
        with pytest.raises(Exception, match="multiples of 16 bytes"):
            ops.mla_latent_attention(q, cache, table, seq, None, r, lat, 0.1, backend="triton")
        auto = ops.mla_latent_attention(q, cache, table, seq, None, r, lat, 0.1)
        assert torch.equal(auto, ops.mla_latent_attention(q, cache, table, seq, None, r, lat,
                                                          0.1, backend="reference"))
        return
    scale = (lat + rope) ** -0.5
    got = ops.mla_latent_attention(q, cache, table, seq, None, r, lat, scale, backend="triton")
    want = ops.mla_latent_attention(q.float(), cache.float(), table, seq, None, r, lat, scale,
                                    backend="reference")
    assert got.shape == (b * r, h, lat) and got.dtype == dtype and torch.isfinite(got).all()
    err = (got.float() - want).norm() / want.norm()
    assert err < TOL[dtype], err
    # the packed layout (the Triton path's verify rows): requests of 1 .. R rows, padding rows
    qp, cu = _packed(8, b, r, h, lat + rope, dtype)
    got = ops.mla_latent_attention(qp, cache, table, seq, cu, r, lat, scale, backend="triton")
    want = ops.mla_latent_attention(qp.float(), cache.float(), table, seq, cu, r, lat, scale,
                                    backend="reference")
    assert torch.isfinite(got).all() and torch.equal(got[int(cu[-1]):],
                                                     torch.zeros_like(got[int(cu[-1]):]))
    err = (got.float() - want).norm() / want.norm()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("pad", [1, 9])
def test_packed_padding_rows_are_zeros(pad):
    """Packed rows past ``cu_q_lens[B]`` come back zero whether the merge programs write them
    (``B x R`` cells cover every row: pad 1) or a fill does (more rows than cells: pad 9); the
    output's memory is poisoned first, so rows nobody writes would show."""
    b, r, h, lat, rope = 3, 3, 4, 32, 16
    q, cache, table, seq = _case(5, b, r, h, lat, rope, 16, 4, torch.float32)
    cu = torch.tensor([0, 2, 3, 5], dtype=torch.int32, device=DEV)  # 5 of the 9 cells' rows
    n = 5 + pad
    qp = torch.randn(n, h, lat + rope, generator=torch.Generator().manual_seed(2)).to(DEV)
    scale = (lat + rope) ** -0.5
    for _ in range(2):  # the allocator hands the poisoned block back for the same size
        poison = torch.full((n, h, lat), float("nan"), device=DEV)
        del poison
        got = ops.mla_latent_attention(qp, cache, table, seq, cu, r, lat, scale, backend="triton")
        assert torch.equal(got[5:], torch.zeros_like(got[5:]))
    want = ops.mla_latent_attention(qp, cache, table, seq, cu, r, lat, scale, backend="reference")
    assert (got[:5] - want[:5]).abs().max() < 1e-5


def test_keys_past_the_length_are_never_read():
    """Keys at or past ``seq_lens`` (and every key a row's position hides) do not move the
    output: poisoned with NaN, the result is unchanged and finite."""
    q, cache, table, seq = _case(3, 3, 2, 4, 32, 16, 16, 4, torch.float32)
    scale = 0.2
    clean = ops.mla_latent_attention(q, cache, table, seq, None, 2, 32, scale, backend="triton")
    bs = cache.shape[1]
    for i in range(3):
        for t in range(int(seq[i]), table.shape[1] * bs):
            cache[int(table[i, t // bs]), t % bs] = float("nan")
    again = ops.mla_latent_attention(q, cache, table, seq, None, 2, 32, scale, backend="triton")
    assert torch.isfinite(again).all() and torch.equal(again, clean)


def test_bad_input_names_the_field():
    q, cache, table, seq = _case(1, 2, 1, 4, 32, 16, 16, 2, torch.float32)
    with pytest.raises(Exception, match="num_rows"):
        ops.mla_latent_attention(q, cache, table, seq, None, 3, 32, 0.1)
    with pytest.raises(Exception, match="latent_dim"):
        ops.mla_latent_attention(q, cache, table, seq, None, 1, 48, 0.1)
    with pytest.raises(Exception, match="cu_q_lens"):
        ops.mla_latent_attention(q, cache, table, seq, seq, 1, 32, 0.1)


def test_split_plan_is_bounded_by_the_gpu_not_the_cache():
    """``plan_max_splits``: about twice the SMs in programs, at most the cache in 64-key runs,
    at least one; so the fp32 workspace is bounded by the GPU or by the rows themselves (one
    split), never by ``max_model_len``."""
    from speccal.kernels.mla_decode import MIN_SPLIT, plan_max_splits

    assert plan_max_splits(1, 16, 1536, 132) == 1536 // MIN_SPLIT  # short cache: 64-key runs
    assert plan_max_splits(1, 16, 131072, 132) == 264  # long cache: the GPU bounds it
    assert plan_max_splits(64, 64, 131072, 132) == 2  # 64 requests x 4 row tiles
    assert plan_max_splits(512, 512, 131072, 132) == 1
    for b, rows, cap in [(1, 16, 131072), (8, 64, 32768), (64, 512, 131072)]:
        splits = plan_max_splits(b, rows, cap, 132)
        workspace = b * splits * rows * 512 * 4
        bound = max(2 * 132 * 16 * 2, b * rows) * 512 * 4
        assert workspace <= bound, (b, rows, cap, workspace)
