"""Pure-torch paged attention against dense causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.runner.attention import attend_own_keys, paged_attention_torch
from speccal.runner.path import ExecutionPath


def _dense(q, k, v, q_pos, scale):  # q [R, Hq, D], k/v [T, Hkv, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("num_q_rows", [1, 3, 6])
def test_paged_equals_dense(num_q_rows):
    g = torch.Generator().manual_seed(0)
    num_blocks, bs, hkv, hq, d = 20, 4, 2, 6, 8
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    seq_lens = torch.tensor([7, 13, num_q_rows], dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # shuffled blocks, block 0 unused
    block_table = torch.zeros(3, 5, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens.tolist()):
        nb = -(-n // bs)
        block_table[b, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(3, num_q_rows, hq, d, generator=g)
    out = paged_attention_torch(q, k_cache, v_cache, block_table, seq_lens, num_q_rows, 0.3)
    for b, n in enumerate(seq_lens.tolist()):
        slots = torch.arange(n)
        blocks = block_table[b, slots // bs].long()
        k = k_cache[blocks, slots % bs]
        v = v_cache[blocks, slots % bs]
        q_pos = n - num_q_rows + torch.arange(num_q_rows)
        torch.testing.assert_close(out[b], _dense(q[b], k, v, q_pos, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("seq_len", "rows"), [(1, 1), (9, 9), (13, 5), (13, 1)])
def test_own_keys_equal_paged_attention(seq_len, rows):
    """The prefill chunk's attention over its own keys (by slot, SDPA) == the paged reference."""
    g = torch.Generator().manual_seed(1)
    num_blocks, bs, hkv, hq, d = 12, 4, 2, 6, 8
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    nb = -(-seq_len // bs)
    block_table = (torch.randperm(num_blocks - 1, generator=g)[:nb] + 1).to(torch.int32)[None]
    q = torch.randn(rows, hq, d, generator=g)
    keys = torch.arange(seq_len)
    key_slots = block_table[0, keys // bs].long() * bs + keys % bs
    out = attend_own_keys(q, k_cache, v_cache, key_slots, 0.3)
    ref = paged_attention_torch(q[None], k_cache, v_cache, block_table,
                                torch.tensor([seq_len], dtype=torch.int32), rows, 0.3)[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_own_keys_equal_paged_attention_cuda(dtype):
    """On CUDA SDPA picks its fused kernels (flash under ``is_causal``, memory-efficient under
    the boolean mask of a later chunk): same rows as the paged reference on the same inputs."""
    g = torch.Generator().manual_seed(2)
    num_blocks, bs, hkv, hq, d = 40, 16, 2, 8, 64
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to("cuda", dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to("cuda", dtype)
    for seq_len, rows in ((300, 300), (300, 44), (517, 5)):
        nb = -(-seq_len // bs)
        block_table = (torch.randperm(num_blocks - 1, generator=g)[:nb] + 1).to(torch.int32)[None]
        q = torch.randn(rows, hq, d, generator=g).to("cuda", dtype)
        keys = torch.arange(seq_len)
        key_slots = (block_table[0, keys // bs].long() * bs + keys % bs).cuda()
        out = attend_own_keys(q, k_cache, v_cache, key_slots, 0.125)
        ref = paged_attention_torch(q[None].float(), k_cache.float(), v_cache.float(),
                                    block_table.cuda(),
                                    torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
                                    rows, 0.125)[0]
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_execution_path_validates_the_backend_and_the_device():
    with pytest.raises(InputError, match="attention_backend"):
        ExecutionPath(attention_backend="flash")
    with pytest.raises(InputError, match="graph_mode"):
        ExecutionPath(graph_mode="unified")
    with pytest.raises(UnsupportedError, match="attention_backend='triton' runs on CUDA"):
        ExecutionPath(attention_backend="triton").check_device(torch.device("cpu"))
    with pytest.raises(UnsupportedError, match="graph_mode='split'"):
        ExecutionPath(graph_mode="split").check_device(torch.device("cpu"))
    ExecutionPath().check_device(torch.device("cpu"))
