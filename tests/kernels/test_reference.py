"""CPU tests of the pure-torch references against loop oracles (what CI runs)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_builders import (
    attention_oracle,
    block_table_for,
    moe_case,
    moe_oracle,
    paged_kv,
    rel_err,
    verify_oracle,
)

from speccal.kernels import ops
from speccal.kernels import reference as ref


def _attn_case(seed, seq_lens, rows, heads=(8, 2), head_dim=32, block_size=16):
    gen = torch.Generator().manual_seed(seed)
    h, kvh = heads
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    nb = len(seq_lens) * max_blocks + 2
    kc, vc = paged_kv(nb, block_size, kvh, head_dim, torch.float32, "cpu", gen)
    bt = block_table_for(seq_lens, block_size, max_blocks, nb, gen, "cpu")
    q = torch.randn(len(seq_lens), rows, h, head_dim, generator=gen)
    return q, kc, vc, bt, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("rows", [1, 6])
def test_paged_attention_ref_dense_matches_oracle(heads, rows):
    q, kc, vc, bt, seq = _attn_case(1, [rows, 37, 64, 130], rows, heads)
    scale = 1 / math.sqrt(q.shape[-1])
    out = ref.paged_attention_ref(q, kc, vc, bt, seq, rows, scale)
    want = attention_oracle(list(q), kc, vc, bt, seq, scale)
    assert out.shape == q.shape
    assert rel_err(out, torch.stack(want)) < 1e-5


def test_paged_attention_ref_ragged_rows_and_zero_padding():
    q, kc, vc, bt, seq = _attn_case(2, [3, 50, 17], 4)
    q_lens = torch.tensor([1, 4, 2], dtype=torch.int32)
    out = ref.paged_attention_ref(q, kc, vc, bt, seq, 4, 0.3, q_lens=q_lens)
    want = attention_oracle([q[b, : int(q_lens[b])] for b in range(3)], kc, vc, bt, seq, 0.3)
    for b in range(3):
        n = int(q_lens[b])
        assert rel_err(out[b, :n], want[b]) < 1e-5
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))


def test_paged_attention_ref_packed_matches_dense_rows():
    q, kc, vc, bt, seq = _attn_case(3, [9, 70, 33], 6)
    lens = [2, 6, 1]
    cu = torch.tensor([0, 2, 8, 9], dtype=torch.int32)
    packed = torch.cat([q[b, : lens[b]] for b in range(3)] + [q[0, :3]])  # 3 padding rows
    out = ref.paged_attention_ref(packed, kc, vc, bt, seq, 6, 0.2, cu_q_lens=cu)
    want = attention_oracle([q[b, : lens[b]] for b in range(3)], kc, vc, bt, seq, 0.2)
    assert rel_err(out[:9], torch.cat(want)) < 1e-5
    assert torch.equal(out[9:], torch.zeros_like(out[9:]))


@pytest.mark.parametrize("max_splits", [2, 5])
def test_paged_attention_ref_split_kv_equals_unsplit(max_splits):
    q, kc, vc, bt, seq = _attn_case(4, [6, 100, 257], 6)
    ns = torch.empty(3, dtype=torch.int32)
    sl = torch.empty(3, dtype=torch.int32)
    ref.attention_tiling_update_ref(seq, ns, sl, max_splits, 16, 16)
    assert int(ns.max()) > 1  # the case really splits
    whole = ref.paged_attention_ref(q, kc, vc, bt, seq, 6, 0.25)
    split = ref.paged_attention_ref(q, kc, vc, bt, seq, 6, 0.25, num_splits=ns, split_len=sl,
                                    max_splits=max_splits)
    assert rel_err(split, whole) < 1e-5


def test_attention_tiling_ref_covers_each_kv_range_once():
    seq = torch.tensor([0, 1, 15, 16, 17, 64, 1000, 4097, 32768], dtype=torch.int32)
    for max_splits, block_n, min_len in [(1, 64, 64), (8, 64, 64), (16, 32, 256), (64, 16, 16)]:
        ns = torch.full_like(seq, -1)
        sl = torch.full_like(seq, -1)
        ref.attention_tiling_update_ref(seq, ns, sl, max_splits, block_n, min_len)
        for n, k, length in zip(seq.tolist(), ns.tolist(), sl.tolist(), strict=True):
            assert length % block_n == 0 and length >= block_n
            assert 0 <= k <= max_splits
            assert k * length >= n > (k - 1) * length or (n == 0 and k == 0)
            if n >= min_len * max_splits:
                assert k == max_splits or k == -(-n // length)


def test_verify_updates_ref_match_loop_oracle():
    gen = torch.Generator().manual_seed(5)
    b, k_max, bs, g = 5, 4, 8, 30
    base = torch.randint(0, 50000, (b,), generator=gen)
    drafts = torch.randint(0, 50000, (b, k_max), generator=gen)
    vl = torch.tensor([4, 0, 2, 9, -3], dtype=torch.int32)  # 9 and -3 are clamped
    ctx = torch.tensor([0, 7, 31, 100, 5], dtype=torch.int32)
    bt = torch.randint(1, 500, (b, 20), generator=gen).to(torch.int32)
    ids = torch.full((g,), 77, dtype=torch.int64)
    ref.verify_token_update_ref(base, drafts, vl, ids, pad_id=-1)
    pos = torch.full((g,), -5, dtype=torch.int64)
    slots = torch.full((g,), -5, dtype=torch.int64)
    seq = torch.full((b,), -5, dtype=torch.int32)
    cu = torch.full((b + 1,), -5, dtype=torch.int32)
    grid = torch.full((b * (k_max + 1),), -5, dtype=torch.int64)
    ref.verify_metadata_update_ref(vl, ctx, bt, bs, pos, slots, seq, cu, k_max, grid)
    w_ids, w_pos, w_slots, w_seq, w_cu = verify_oracle(base, drafts, vl, ctx, bt, bs, g)
    assert grid.tolist() == [min(w_cu[i] + j, g - 1) for i in range(b) for j in range(k_max + 1)]
    assert ids.tolist() == w_ids
    assert pos.tolist() == w_pos
    assert slots.tolist() == w_slots
    assert seq.tolist() == w_seq
    assert cu.tolist() == w_cu


def test_verify_token_ref_cuts_rows_past_g():
    base = torch.tensor([1, 2])
    drafts = torch.tensor([[10, 11, 12], [20, 21, 22]])
    ids = torch.zeros(5, dtype=torch.int64)
    ref.verify_token_update_ref(base, drafts, torch.tensor([3, 3], dtype=torch.int32), ids)
    assert ids.tolist() == [1, 10, 11, 12, 2]


def test_verify_token_ref_base_index_gathers_the_pending_tokens():
    """``base_index``: the base tokens are ``base_tokens.view(-1)[base_index]`` (the runner's
    pending token in its ``ext_tokens [slots, w + 1]`` slot state), the torch gather it replaces."""
    gen = torch.Generator().manual_seed(11)
    slots, w1, k_max, g = 6, 4, 3, 14
    ext = torch.randint(0, 50000, (slots, w1), generator=gen)
    drafts = torch.randint(0, 50000, (4, k_max), generator=gen)
    vl = torch.tensor([3, 0, 1, 2], dtype=torch.int32)
    index = torch.tensor([0 * w1 + 2, 5 * w1 + 0, 3 * w1 + 3, 1 * w1 + 1])  # slot * w1 + num_ext - 1
    ids = torch.full((g,), 77, dtype=torch.int64)
    ref.verify_token_update_ref(ext, drafts, vl, ids, pad_id=-1, base_index=index)
    want = torch.full((g,), 77, dtype=torch.int64)
    ref.verify_token_update_ref(ext.view(-1)[index], drafts, vl, want, pad_id=-1)
    assert ids.tolist() == want.tolist()
    w_ids = verify_oracle(ext.view(-1)[index], drafts, vl, torch.zeros(4, dtype=torch.int32),
                          torch.ones(4, 4, dtype=torch.int32), 16, g)[0]
    assert ids.tolist() == w_ids
    assert ids[0] == ext[0, 2] and ids[4] == ext[5, 0]  # not base_tokens[b]: the gather


def test_verify_metadata_ref_max_cu_clamps_the_row_offsets():
    """``max_cu``: ``cu_q_lens`` equals the unclamped offsets after ``cu.clamp_(max=max_cu)``
    (what the runner did in a launch of its own); every other output is unchanged."""
    gen = torch.Generator().manual_seed(12)
    b, k_max, bs, g = 5, 3, 8, 9
    vl = torch.tensor([3, 2, 0, 3, 1], dtype=torch.int32)  # 14 rows: requests 2.. run past G
    ctx = torch.tensor([4, 0, 9, 30, 2], dtype=torch.int32)
    bt = torch.randint(1, 500, (b, 10), generator=gen).to(torch.int32)

    def run(max_cu):
        out = [torch.full((g,), -5, dtype=torch.int64), torch.full((g,), -5, dtype=torch.int64),
               torch.full((b,), -5, dtype=torch.int32), torch.full((b + 1,), -5, dtype=torch.int32),
               torch.full((b * (k_max + 1),), -5, dtype=torch.int64)]
        ref.verify_metadata_update_ref(vl, ctx, bt, bs, *out[:4], k_max, out[4], max_cu=max_cu)
        return out

    plain, capped = run(None), run(g)
    assert plain[3].tolist() == [0, 4, 7, 8, 12, 14]
    assert capped[3].tolist() == plain[3].clamp(max=g).tolist() == [0, 4, 7, 8, 9, 9]
    for a, c in zip(plain[:3] + plain[4:], capped[:3] + capped[4:], strict=True):
        assert torch.equal(a, c)
    assert run(100)[3].tolist() == plain[3].tolist()  # a cap above every offset changes nothing


def test_embed_rms_norm_ref_is_the_embedding_then_the_norm():
    """``h`` is exactly what ``nn.Embedding`` returns (no scale, no padding row) and the normed
    rows exactly ``rms_norm_ref(h)``; ids outside the table give zero rows, not a stray read."""
    gen = torch.Generator().manual_seed(13)
    emb = torch.nn.Embedding(50, 24)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(50, 24, generator=gen) * 3)
    w = torch.rand(24, generator=gen) + 0.5
    for dtype in (torch.float32, torch.bfloat16):
        table = emb.weight.detach().to(dtype)
        ids = torch.tensor([0, 49, 7, 7, 31], dtype=torch.int32)
        h, y = ref.embed_rms_norm_ref(ids, table, w.to(dtype), 1e-6)
        assert h.dtype == y.dtype == dtype
        assert torch.equal(h, torch.nn.functional.embedding(ids.long(), table))
        assert torch.equal(y, ref.rms_norm_ref(h, w.to(dtype), 1e-6))
    h, y = ref.embed_rms_norm_ref(torch.tensor([-1, 3, 50]), emb.weight.detach(), w, 1e-6)
    assert torch.equal(h[1], emb.weight[3].detach())
    assert h[0].abs().sum() == 0 and h[2].abs().sum() == 0
    assert y[0].abs().sum() == 0 and y[2].abs().sum() == 0


def test_linear_rms_norm_rotary_refs():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 64, generator=gen, dtype=torch.float64)
    w = torch.randn(40, 64, generator=gen, dtype=torch.float64)
    assert torch.allclose(ref.linear_ref(x, w), x @ w.T)

    r = torch.randn(3, 64, generator=gen, dtype=torch.float64)
    g = torch.randn(64, generator=gen, dtype=torch.float64)
    y, h = ref.rms_norm_ref(x, g, 1e-6, r)
    s = x + r
    assert torch.allclose(h, s)
    assert torch.allclose(y, s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6) * g)

    # rotary against the complex-number form: (x1 + i x2) * e^{i theta}
    t, hq, hk, d = 4, 3, 1, 8
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hk, d, generator=gen)
    v = torch.randn(t, hk, d, generator=gen)
    theta = torch.rand(16, d // 2, generator=gen) * 6
    cs = torch.cat([theta.cos(), theta.sin()], -1)
    pos = torch.tensor([3, 0, 15, 7])
    slots = torch.tensor([5, 9, 2, 11])
    kc = torch.zeros(4, 4, hk, d)
    vc = torch.zeros(4, 4, hk, d)
    q0 = q.clone()
    ref.rotary_kv_write_ref(q, k, v, pos, cs, slots, kc, vc)

    def crot(x):
        z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
        z = z * torch.polar(torch.ones_like(theta[pos]).double(), theta[pos].double())[:, None]
        return torch.cat([z.real, z.imag], -1)

    assert torch.allclose(q.double(), crot(q0), atol=1e-5)
    assert torch.allclose(kc.view(-1, hk, d)[slots].double(), crot(k), atol=1e-5)
    assert torch.equal(vc.view(-1, hk, d)[slots], v)
    assert torch.equal(kc.view(-1, hk, d)[0], torch.zeros(hk, d))  # untouched slot

    # partial rotary (R = 4 of D = 8): the first R channels rotate as a head of width R, the
    # rest pass through unchanged
    r = 4
    cs_r = torch.cat([theta[:, : r // 2].cos(), theta[:, : r // 2].sin()], -1)
    q_p, kc, vc = q0.clone(), torch.zeros_like(kc), torch.zeros_like(vc)
    ref.rotary_kv_write_ref(q_p, k, v, pos, cs_r, slots, kc, vc)

    def crot_r(x):
        z = torch.complex(x[..., : r // 2].double(), x[..., r // 2 : r].double())
        z = z * torch.polar(torch.ones_like(theta[pos, : r // 2]).double(),
                            theta[pos, : r // 2].double())[:, None]
        return torch.cat([z.real, z.imag, x[..., r:].double()], -1)

    assert torch.allclose(q_p.double(), crot_r(q0), atol=1e-5)
    assert torch.equal(q_p[..., r:], q0[..., r:])
    assert torch.allclose(kc.view(-1, hk, d)[slots].double(), crot_r(k), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 6, 48])
@pytest.mark.parametrize("n, block_n", [(1000, 64), (1024, 128), (777, 16)])
def test_argmax_partials_reduce_to_torch_argmax(dtype, m, n, block_n):
    """Per-tile partials of ``linear_ref``'s output, reduced, give ``torch.argmax`` of that
    output: bf16/fp16 rounding ties (the first column, not the larger fp32 value), exact ties
    across tiles, NaN above ``+inf``, N not a multiple of the tile."""
    from kernel_builders import argmax_case

    x, w, special = argmax_case(m + n, m, n, 64, dtype, "cpu", block_n)
    logits = ref.linear_ref(x, w)  # [m, n] in dtype
    tile_max, tile_idx = ref.linear_argmax_ref(x, w, block_n)
    tiles = -(-n // block_n)
    assert tile_max.shape == tile_idx.shape == (m, tiles)
    assert tile_max.dtype == torch.float32 and tile_idx.dtype == torch.int32
    # each partial is its tile's torch.argmax: inside the tile, holding the tile max
    first = torch.arange(tiles) * block_n
    assert ((tile_idx >= first) & (tile_idx < (first + block_n).clamp(max=n))).all()
    held = logits.float().gather(1, tile_idx.long())
    assert torch.equal(held.nan_to_num(7.5), tile_max.nan_to_num(7.5))
    for t in range(tiles):
        cols = logits[:, t * block_n:(t + 1) * block_n]
        assert torch.equal(tile_idx[:, t].long(), cols.argmax(-1) + t * block_n)
    tokens = ref.reduce_argmax_partials_ref(tile_max, tile_idx)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))
    for row, col in special.items():
        assert int(tokens[row]) == col, (row, col)


def _umax(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    flip = -(1 << 63)  # unsigned order of the int64 bits
    return torch.maximum(a ^ flip, b ^ flip) ^ flip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, block_n", [(1000, 64), (777, 16)])
def test_argmax_keys_fold_tiles_into_torch_argmax(dtype, n, block_n):
    """Packed keys: any order of unsigned maxes over the column tiles' keys (what the LM head's
    atomics do) equals the whole row's key, whose low bits give ``torch.argmax`` of the stored
    logits: rounding ties, exact ties across tiles, NaN above ``+inf``."""
    from kernel_builders import argmax_case

    x, w, special = argmax_case(n, 6, n, 64, dtype, "cpu", block_n)
    logits = ref.linear_ref(x, w)
    whole = ref.argmax_keys_ref(logits)
    tokens = ref.unpack_argmax_keys_ref(whole)
    assert torch.equal(tokens, logits.argmax(-1))
    assert all(int(tokens[r]) == c for r, c in special.items())
    tiles = []
    for t0 in range(0, n, block_n):
        key = ref.argmax_keys_ref(logits[:, t0:t0 + block_n])
        tiles.append(key - t0)  # the column sits in the low bits as 2**32 - 1 - column
    for order in (tiles, tiles[::-1], tiles[1::2] + tiles[::2]):
        acc = torch.zeros_like(whole)
        for key in order:
            acc = _umax(acc, key)
        assert torch.equal(acc, whole)


def test_argmax_keys_rules():
    """-0 ties +0 (the first column), NaN beats +inf (the first NaN), -inf rows pick column 0,
    and every key is above zero (the empty buffer)."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[-0.0, 0.0, -1.0], [1.0, inf, nan], [nan, 2.0, nan],
                           [-inf, -inf, -inf], [-3.0, -2.0, -2.0]])
    keys = ref.argmax_keys_ref(logits)
    assert ref.unpack_argmax_keys_ref(keys).tolist() == [0, 2, 0, 0, 1]
    assert torch.equal(_umax(keys, torch.zeros_like(keys)), keys)
    # larger logits give larger keys whatever their signs
    vals = torch.tensor([[-inf], [-5.0], [-1.0], [0.0], [1e-30], [2.0], [inf], [nan]])
    k = ref.argmax_keys_ref(vals) ^ -(1 << 63)
    assert bool((k[1:] > k[:-1]).all())


def test_reduce_argmax_partials_rules():
    """Largest tile max; a NaN beats +inf and the first NaN tile wins; ties go to the first
    tile (the lowest column)."""
    inf, nan = float("inf"), float("nan")
    tile_max = torch.tensor([[1.0, 3.0, 3.0, 2.0], [inf, nan, 1.0, nan], [-inf, -inf, -inf, -inf],
                             [0.5, 0.5, 0.5, 0.7]])
    tile_idx = torch.tensor([[1, 17, 40, 50], [3, 20, 33, 60], [0, 16, 32, 48], [2, 18, 34, 49]],
                            dtype=torch.int32)
    tokens = ref.reduce_argmax_partials_ref(tile_max, tile_idx)
    assert tokens.tolist() == [17, 20, 0, 49]


# ---------------------------------------------------------------------------------------------
# routed experts


@pytest.mark.parametrize("rows,experts,top_k,block_m", [(1, 4, 2, 16), (7, 6, 3, 16),
                                                        (40, 5, 2, 4), (9, 16, 4, 1),
                                                        (2, 40, 4, 8), (1, 64, 6, 16)])
def test_moe_align_ref_lays_every_pair_once_in_its_experts_blocks(rows, experts, top_k, block_m):
    """Static size ``N k + min(E, N k) (block_m - 1)`` rounded up to blocks; each pair once, in a block
    of its own expert, ascending within the expert's run; padding and expert-less blocks hold
    the sentinel; ``counts`` are the pairs per expert."""
    x, w, ids, gu, dn = moe_case(3, rows, 8, 4, experts, top_k, torch.float32, "cpu",
                                 idle=(1,))
    pairs, blocks, counts = ref.moe_align_ref(ids, experts, block_m)
    num_pairs = rows * top_k
    padding = min(experts, num_pairs) * (block_m - 1)
    assert pairs.shape[0] == -(-(num_pairs + padding) // block_m) * block_m
    assert blocks.shape[0] * block_m == pairs.shape[0]
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    real = pairs < num_pairs
    assert sorted(pairs[real].tolist()) == list(range(num_pairs))
    pos_expert = blocks.repeat_interleave(block_m)
    assert torch.equal(ids.reshape(-1)[pairs[real]], pos_expert[real])
    assert (pairs[pos_expert < 0] == num_pairs).all()
    for e in range(experts):
        run = pairs[real & (pos_expert == e)]
        assert torch.equal(run, run.sort().values) and run.numel() == counts[e]
    assert not (blocks == 1).any()  # an idle expert gets no block


@pytest.mark.parametrize("rows,hidden,inter,experts,top_k", [(1, 16, 8, 4, 2), (7, 40, 24, 6, 3),
                                                             (33, 24, 20, 8, 1)])
def test_fused_moe_ref_matches_oracle(rows, hidden, inter, experts, top_k):
    """The reference op against a per-row loop over each row's experts (float64); idle
    experts' NaN weights never reach the output."""
    x, w, ids, gu, dn = moe_case(5, rows, hidden, inter, experts, top_k, torch.float32, "cpu",
                                 idle=(0, experts - 1))
    out, counts = ops.fused_moe(x, w, ids, gu, dn, backend="reference")
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, moe_oracle(x, w, ids, gu, dn)) < 1e-6
    assert counts[0] == counts[-1] == 0


def test_fused_moe_ref_sums_each_rows_experts_in_ascending_order():
    """Per row the weighted expert outputs are added one after the other in ascending expert
    order, starting from zero (a per-expert loop adding into a zero result, transformers'
    order): bitwise equal to that sum of the pair outputs."""
    x, w, ids, gu, dn = moe_case(7, 11, 24, 12, 6, 4, torch.float32, "cpu")
    pairs, blocks, _ = ref.moe_align_ref(ids, 6, 16)
    pair_out = ref.fused_moe_ref(x, w, gu, dn, pairs, blocks).view(11, 4, 24)
    want = torch.zeros_like(x)
    for e in range(6):
        for n, j in zip(*(ids == e).nonzero(as_tuple=True), strict=True):
            want[n] += pair_out[n, j]
    assert torch.equal(ref.moe_sum_slots_ref(pair_out.view(44, 24), ids), want)
