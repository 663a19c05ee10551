"""Pure-torch paged attention against dense causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.runner.attention import (
    RAGGED_MIN_PADDED_KEYS,
    AttnMeta,
    attend_own_keys,
    attend_rows,
    paged_attention_ragged,
    paged_attention_torch,
    ragged_pays,
)
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


@pytest.mark.parametrize("num_q_rows", [1, 4, 6])
def test_ragged_equals_padded(num_q_rows):
    """Each request over its own keys == the padded batch: unequal lengths, a request shorter
    than its rows (front padding at negative positions sees key 0), a padding request on the
    sentinel block 0 (an all-zero block-table row), fp32 rounding only."""
    g = torch.Generator().manual_seed(2)
    num_blocks, bs, hkv, hq, d = 40, 4, 2, 6, 8
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    lens = [29, 3, 11, num_q_rows, 18]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    block_table = torch.zeros(len(lens), 9, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        if b == 3:  # padding request: its row stays on the sentinel block
            continue
        nb = -(-n // bs)
        block_table[b, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(len(lens), num_q_rows, hq, d, generator=g)
    ref = paged_attention_torch(q, k_cache, v_cache, block_table, seq_lens, num_q_rows, 0.3)
    out = paged_attention_ragged(q, k_cache, v_cache, block_table, seq_lens, num_q_rows, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_attend_rows_takes_the_ragged_path_when_padding_pays(monkeypatch):
    """On a CPU the ragged path serves a batch with at least RAGGED_MIN_PADDED_KEYS padded keys
    (and the rows come back in the grid's order either way); a batch of one never pays."""
    assert ragged_pays([1, 2 * 256 * 16 - RAGGED_MIN_PADDED_KEYS - 1], 256, 16)
    assert not ragged_pays([1, 2 * 256 * 16 - RAGGED_MIN_PADDED_KEYS], 256, 16)
    assert not ragged_pays([4096, 4096], 256, 16)
    assert not ragged_pays([1], 1024, 16)
    calls = []
    import speccal.runner.attention as attention

    real = attention.paged_attention_ragged
    monkeypatch.setattr(attention, "paged_attention_ragged",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    bs, hkv, hq, d, width = 16, 2, 4, 8, 300
    k_cache = torch.randn(2 * width + 1, bs, hkv, d, generator=g)
    v_cache = torch.randn(2 * width + 1, bs, hkv, d, generator=g)
    block_table = (torch.arange(2 * width, dtype=torch.int32) + 1).view(2, width)
    rows = 3
    seq_lens = torch.tensor([40, width * bs], dtype=torch.int32)
    q = torch.randn(2 * rows, hq, d, generator=g)
    meta = AttnMeta(torch.zeros(2 * rows, dtype=torch.int64), torch.arange(2 * rows),
                    block_table, seq_lens, rows)
    out = attend_rows(q, k_cache, v_cache, meta, 0.3, ExecutionPath())
    assert calls == [1]
    ref = paged_attention_torch(q.view(2, rows, hq, d), k_cache, v_cache, block_table, seq_lens,
                                rows, 0.3)
    torch.testing.assert_close(out, ref.reshape(2 * rows, hq, d), rtol=1e-5, atol=1e-6)


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
