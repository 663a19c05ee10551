"""The two MLA attention forms of ``speccal.runner.mla`` compute one function.

The absorbed form (decode and verify rows: ``q_nope @ W_uk`` scored against the cached latents,
the weighted latents through ``W_uv``) against the expanded one (prefill chunks, transformers':
every cached latent through ``kv_b_proj`` into per-head keys and values), on the same rows and
cache, fp32, for the three row layouts (a prefill chunk read by slot, the ``[B, R]`` grid, the
packed verify rows), dense and with the DSA indexer's top-k (which must mask both alike).
Tolerance: 2e-5 relative / absolute (fp32 rounding of sums in another order, values O(1)).
"""

from __future__ import annotations

import pytest
import torch

from speccal.runner.attention import AttnMeta
from speccal.runner.mla import attend_expanded, attend_latent, latent_keys
from tests.runner.test_fused_layer import _packed_meta

HEADS, NOPE, ROPE, LATENT, V_DIM = 4, 16, 8, 24, 12
INDEX_HEADS, INDEX_DIM = 2, 8


def _layouts(name: str) -> tuple[AttnMeta, int, torch.Tensor]:
    """``(meta, num_blocks, real rows)`` of the packed verify rows (3 + 1 rows after 5 and 11
    cached tokens, one padding row), the same requests on the ``[B, R]`` grid, or one prefill
    chunk (the last 6 of 15 positions, keys read by slot)."""
    meta, _, nb = _packed_meta(ctx=[5, 11], rows=[3, 1])
    if name == "packed":
        return meta, nb, torch.tensor([True, True, True, True, False])
    if name == "grid":  # rows 0..2 -> request 0's 3 rows, row 3 -> request 1's last cell
        rows = torch.tensor([0, 1, 2, 5])
        grid = AttnMeta(meta.slot_mapping[:4], rows, meta.block_table, meta.seq_lens, 3)
        return grid, nb, torch.ones(4, dtype=torch.bool)
    slots = meta.block_table[1].long().repeat_interleave(4) * 4 + torch.arange(4).repeat(16)
    chunk = AttnMeta(slots[9:15], None, meta.block_table[1:], torch.tensor([15], dtype=torch.int32),
                     6, key_slots=slots[:15])
    return chunk, nb, torch.ones(6, dtype=torch.bool)


def _forms(layout: str, topk: int | None, seed: int = 0):
    meta, nb, real = _layouts(layout)
    n = meta.slot_mapping.shape[0]
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(nb, 4, 1, LATENT + ROPE, generator=g)
    v_cache = torch.randn(nb, 4, 1, INDEX_DIM if topk else 0, generator=g)
    q = torch.randn(n, HEADS, NOPE + ROPE, generator=g)
    w_kv = torch.randn(HEADS, NOPE + V_DIM, LATENT, generator=g) * LATENT ** -0.5
    index = None
    if topk:
        index = (torch.randn(n, INDEX_HEADS, INDEX_DIM, generator=g),
                 torch.randn(n, INDEX_HEADS, generator=g), topk)
    scale = (NOPE + ROPE) ** -0.5
    lk = latent_keys(n, k_cache, v_cache, meta, index)
    q_lat = torch.einsum("nhd,hdl->nhl", q[..., :NOPE], w_kv[:, :NOPE])
    absorbed = attend_latent(torch.cat([q_lat, q[..., NOPE:]], -1), lk, scale, LATENT)
    absorbed = torch.einsum("nhl,hvl->nhv", absorbed, w_kv[:, NOPE:])
    expanded = attend_expanded(q, lk, w_kv, scale)
    return absorbed[real], expanded[real]


@pytest.mark.parametrize("layout", ["packed", "grid", "prefill"])
@pytest.mark.parametrize("topk", [None, 4])
def test_absorbed_and_expanded_forms_agree(layout, topk):
    absorbed, expanded = _forms(layout, topk)
    assert absorbed.shape == expanded.shape and absorbed.shape[1:] == (HEADS, V_DIM)
    torch.testing.assert_close(absorbed, expanded, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("layout", ["packed", "prefill"])
def test_the_indexer_selection_masks_both_forms(layout):
    """The DSA top-k changes each form's output (rows see more than 4 keys), and alike."""
    dense_abs, dense_exp = _forms(layout, 10_000)  # every visible key selected
    sparse_abs, sparse_exp = _forms(layout, 4)
    assert not torch.allclose(sparse_abs, dense_abs, atol=1e-3)
    assert not torch.allclose(sparse_exp, dense_exp, atol=1e-3)
    torch.testing.assert_close(sparse_abs, sparse_exp, rtol=2e-5, atol=2e-5)
