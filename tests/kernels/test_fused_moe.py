"""The Triton fused-MoE kernels against the reference, on the GPU (``cuda`` marker).

As ``test_triton_kernels.py``: ``SPECCAL_KERNEL_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1``
runs the same checks through Triton's interpreter on fp32 (small odd widths, masked tiles).
bf16 / fp16 on the GPU, compared by relative Frobenius error with the reference run on fp32
upcasts. Idle experts' weights are NaN: a kernel that read them would show it.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_builders import moe_case, rel_err

from speccal.kernels import ops

pytest.importorskip("triton")
pytestmark = pytest.mark.cuda
DEV = os.environ.get("SPECCAL_KERNEL_TEST_DEVICE", "cuda")
DTYPES = [torch.float32] if DEV == "cpu" else [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5}

MOE_CASES = [
    # (rows, hidden, inter, experts, top_k)
    (1, 40, 24, 6, 2),  # one decode row: most blocks expert-less
    (7, 40, 24, 6, 3),  # odd widths: masked K and N tiles
    (21, 72, 40, 5, 2),  # an expert past one block of 16 pairs
]
if DEV != "cpu":
    # DeepSeek-V2-Lite's layer; DeepSeek-V3's widths and top-8 over 32 of its 256 experts (all
    # 256 take 45 GB of fp32 weights on the host, twice with the reference's copies: on an
    # H100 host the worker was killed)
    MOE_CASES += [(48, 2048, 1408, 64, 6), (6, 7168, 2048, 32, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MOE_CASES)
def test_fused_moe_matches_reference(dtype, case):
    rows, hidden, inter, experts, top_k = case
    x, w, ids, gu, dn = moe_case(11, rows, hidden, inter, experts, top_k, dtype, DEV,
                                 idle=(0, experts - 2))
    got, counts = ops.fused_moe(x, w, ids, gu, dn, backend="triton")
    want, want_counts = ops.fused_moe(x.float(), w, ids, gu.float(), dn.float(),
                                      backend="reference")
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_err(got, want) < TOL[dtype]
    assert torch.equal(counts, want_counts)


@pytest.mark.parametrize("tiles", [dict(gate_up_n=16, gate_up_k=128, num_stages=2),
                                   dict(down_n=64, down_k=16, num_warps=2),
                                   dict(gate_up_n=32, down_n=16, down_k=256, num_warps=8)])
def test_other_expert_tiles_compute_the_same_products(tiles):
    """``fused_moe_triton`` under launch tiles other than the shipped ones (what
    bench/bench_moe_tiles.py sweeps): the reference's result, masked K and N tiles included."""
    from speccal.kernels.config import ExpertTiles
    from speccal.kernels.fused_moe import fused_moe_triton
    from speccal.kernels.reference import moe_align_ref, moe_sum_slots_ref

    dtype = DTYPES[0]
    x, w, ids, gu, dn = moe_case(12, 7, 40, 24, 6, 3, dtype, DEV, idle=(0,))
    pairs, blocks, _ = moe_align_ref(ids, 6, 16)
    prec = "ieee" if dtype == torch.float32 else None
    got = moe_sum_slots_ref(fused_moe_triton(x, w, gu, dn, pairs, blocks, prec,
                                             tiles=ExpertTiles(**tiles)), ids)
    want, _ = ops.fused_moe(x.float(), w, ids, gu.float(), dn.float(), backend="reference")
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_masked_rows_choose_no_expert(backend):
    """``row_mask``: the masked rows' output is zero and their experts are left out of the
    counts (an expert only they chose counts 0, and its NaN weights are never read); the
    other rows equal an unmasked call's."""
    dtype = DTYPES[0]
    rows, hidden, inter, experts, top_k = 9, 40, 24, 6, 2
    x, w, ids, gu, dn = moe_case(5, rows, hidden, inter, experts, top_k, dtype, DEV)
    mask = torch.tensor([True, False, True, True, False, True, True, False, True], device=DEV)
    lonely = experts - 1  # chosen by masked rows only, its weights poisoned
    ids = torch.where(mask[:, None], ids % (experts - 1), ids)
    ids[1, 0] = lonely
    ids[1, 1] = ids[1, 1] % (experts - 1)
    gu[lonely] = dn[lonely] = float("nan")
    got, counts = ops.fused_moe(x, w, ids, gu, dn, row_mask=mask, backend=backend)
    full, _ = ops.fused_moe(x[mask], w[mask], ids[mask], gu, dn, backend=backend)
    assert torch.isfinite(got).all() and torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    assert rel_err(got[mask], full) < TOL[dtype] / 10
    want = torch.bincount(ids[mask].reshape(-1).cpu(), minlength=experts)
    assert torch.equal(counts.cpu(), want) and int(counts[lonely]) == 0


@pytest.mark.parametrize("real", [None, True, False])
def test_one_row_runs_without_the_layout_launch(monkeypatch, real):
    """A single row (a B = 1 decode) skips the layout launch: its experts are its blocks. Its
    output, counts and activated masks equal the laid-out path's (masks ORed, earlier bits
    kept); a masked row gives zeros, counts none and leaves the masks; the idle experts' NaN
    weights are never read; the pair outputs equal the laid-out kernels' exactly."""
    from speccal.kernels import fused_moe as fm
    from speccal.kernels.reference import moe_align_ref

    dtype = DTYPES[0]
    experts, top_k = 9, 3
    x, w, ids, gu, dn = moe_case(21, 1, 40, 24, experts, top_k, dtype, DEV, idle=(0, 4))
    mask = None if real is None else torch.tensor([real], device=DEV)
    act = torch.zeros(2, experts, dtype=torch.bool, device=DEV)
    act[0, 8] = act[1, 0] = True  # bits set by earlier forwards stay
    before = act.clone()

    def no_layout(*a, **kw):
        raise AssertionError("the layout launch ran for one row")

    monkeypatch.setattr(fm, "moe_align_triton", no_layout)
    got, counts = ops.fused_moe(x, w, ids, gu, dn, row_mask=mask, activated=act,
                                backend="triton")
    monkeypatch.undo()
    want, want_counts = ops.fused_moe(x.float(), w, ids, gu.float(), dn.float(),
                                      row_mask=mask, backend="reference")
    assert torch.isfinite(got).all() and rel_err(got, want) < TOL[dtype]
    assert torch.equal(counts.cpu(), want_counts.cpu())
    chosen = torch.zeros(experts, dtype=torch.bool, device=DEV)
    if real is not False:
        chosen[ids[0]] = True
    else:
        assert torch.equal(got, torch.zeros_like(got)) and int(counts.sum()) == 0
    assert torch.equal(act, before | chosen[None])
    # the pair outputs of the two launch plans, bit for bit
    prec = "ieee" if dtype == torch.float32 else None
    pairs, blocks, _ = moe_align_ref(ids, experts, 16)
    laid = fm.fused_moe_triton(x, w, gu, dn, pairs, blocks, prec)
    one, _ = fm.fused_moe_one_row_triton(x, w, ids, None, None, gu, dn, 16, prec)
    assert torch.equal(one, laid)


ALIGN_CASES = [
    # (rows, experts, top_k, block_m, masked)
    (1, 6, 2, 16, False),
    (1, 64, 6, 16, True),  # a decode row of DeepSeek-V2-Lite's layer
    (13, 6, 3, 16, True),
    (40, 16, 4, 16, False),  # experts past one block of 16 pairs
    (37, 64, 6, 32, True),
    (9, 256, 8, 16, True),  # DeepSeek-V3's router: 512 expert slots with the sentinel
]
if DEV != "cpu":
    ALIGN_CASES += [(256, 64, 6, 16, True), (1000, 128, 8, 16, False)]


def _ids(gen, rows, experts, top_k):
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])


@pytest.mark.parametrize("case", ALIGN_CASES)
def test_align_kernel_equals_the_reference_layout(case):
    """The one-program layout (``moe_align_triton``): the same sorted pairs, block experts and
    counts as ``reference.moe_align_ref`` (masked rows' pairs to the sentinel expert), and the
    activated masks ORed with the counts' experts, the bits already set kept."""
    from speccal.kernels.fused_moe import moe_align_triton
    from speccal.kernels.reference import moe_align_ref

    rows, experts, top_k, block_m, masked = case
    gen = torch.Generator().manual_seed(rows * 7 + experts)
    for _ in range(3):
        ids = _ids(gen, rows, experts, top_k)
        real = (torch.rand(rows, generator=gen) < 0.7) if masked else None
        act = torch.rand(2, experts, generator=gen) < 0.1
        before = act.clone()
        act_dev = act.to(DEV)
        got = moe_align_triton(ids.to(DEV), experts, block_m,
                               None if real is None else real.to(DEV), act_dev)
        routed = ids if real is None else torch.where(real[:, None], ids, experts)
        want = moe_align_ref(routed, experts, block_m, sentinel=masked)
        for g, w, name in zip(got, want, ("sorted pairs", "block experts", "counts"),
                              strict=True):
            assert torch.equal(g.cpu(), w), name
        assert torch.equal(act_dev.cpu(), before | (want[2] > 0)[None])


@pytest.mark.parametrize("top_k,masked", [(1, False), (2, True), (6, True), (8, False)])
def test_sum_kernel_adds_in_expert_order(top_k, masked):
    """``moe_sum_slots_triton``: bit-equal to ``reference.moe_sum_slots_ref`` (each row's pair
    outputs in ascending expert order, every addition rounded to the dtype), masked rows zero
    (their pairs' outputs, never written on the Triton path, are NaN here)."""
    from speccal.kernels.fused_moe import moe_sum_slots_triton
    from speccal.kernels.reference import moe_sum_slots_ref

    gen = torch.Generator().manual_seed(top_k)
    rows, hidden = 11, 1100
    ids = _ids(gen, rows, 32, top_k)
    pair_out = torch.randn(rows * top_k, hidden, generator=gen).to(DTYPES[0])
    real = torch.rand(rows, generator=gen) < 0.6 if masked else None
    if masked:
        pair_out.view(rows, top_k, hidden)[~real] = float("nan")
    got = moe_sum_slots_triton(pair_out.to(DEV), ids.to(DEV),
                               None if real is None else real.to(DEV)).cpu()
    want = moe_sum_slots_ref(pair_out, ids)
    if masked:
        want[~real] = 0
    assert torch.equal(got, want)


ROUTE_CASES = [
    # (rows, experts, top_k, scoring, groups, topk_groups, normalise, scale, bias)
    (1, 64, 6, "softmax", 1, 1, False, 1.0, False),  # DeepSeek-V2-Lite's router
    (7, 60, 4, "softmax", 1, 1, True, 1.5, False),  # Qwen3-MoE-like, odd expert count
    (5, 256, 8, "sigmoid", 8, 4, True, 2.5, True),  # DeepSeek-V3's noaux_tc router
    (9, 160, 8, "sigmoid", 1, 1, True, 1.0, True),  # GLM-4.5-like: no groups, 160 experts
    (3, 16, 3, "sigmoid", 4, 2, False, 1.0, False),
]


@pytest.mark.parametrize("case", ROUTE_CASES)
def test_route_kernel_equals_the_reference_rule(case):
    """``ops.moe_route`` on the Triton path: the same experts per row as the reference rule
    (as sets: the reference's sigmoid top-k is unsorted) with the same weights, in the
    reference's dtypes."""
    rows, experts, top_k, scoring, groups, tg, norm, scale, with_bias = case
    gen = torch.Generator().manual_seed(rows + experts)
    logits = torch.randn(rows, experts, generator=gen)
    if scoring == "softmax":
        logits = logits.to(DTYPES[0])
    bias = torch.randn(experts, generator=gen) * 0.1 if with_bias else None
    kw = dict(num_groups=groups, topk_groups=tg, normalise=norm, scale=scale)
    got_w, got_ids = ops.moe_route(logits.to(DEV), None if bias is None else bias.to(DEV),
                                   top_k, scoring, backend="triton", **kw)
    want_w, want_ids = ops.moe_route(logits, bias, top_k, scoring, backend="reference", **kw)
    assert got_w.dtype == want_w.dtype and got_ids.dtype == torch.long
    got_w, got_ids = got_w.cpu(), got_ids.cpu()
    for n in range(rows):
        g = dict(zip(got_ids[n].tolist(), got_w[n].float().tolist(), strict=True))
        w = dict(zip(want_ids[n].tolist(), want_w[n].float().tolist(), strict=True))
        assert set(g) == set(w), n
        for e, v in w.items():
            assert g[e] == pytest.approx(v, rel=1e-5 if got_w.dtype == torch.float32 else 1e-2)


def test_dry_pass_indexes_by_the_reference_layout():
    """In the precompile dry pass a launch is skipped only while its kernel compiles, so the
    expert kernels must never index by a layout launch's buffers (empty if it was skipped:
    an illegal address on an H100); the op returns zeros (the dry pass's rule for
    activations), the real counts, and leaves the activated masks alone."""
    from speccal.kernels import precompile

    x, w, ids, gu, dn = moe_case(2, 9, 40, 24, 6, 2, DTYPES[0], DEV)
    mask = torch.tensor([True, False, True, True, False, True, True, False, True], device=DEV)
    act = torch.zeros(2, 6, dtype=torch.bool, device=DEV)
    token = precompile._DRY.set(True)
    try:
        got, counts = ops.fused_moe(x, w, ids, gu, dn, row_mask=mask, activated=act,
                                    backend="triton")
    finally:
        precompile._DRY.reset(token)
    _, want = ops.fused_moe(x, w, ids, gu, dn, row_mask=mask, backend="reference")
    assert torch.equal(got, torch.zeros_like(got)) and torch.equal(counts, want)
    assert not act.any()


@pytest.mark.skipif(DEV == "cpu", reason="a big layout is slow under the interpreter")
def test_more_pairs_than_one_program_takes_the_torch_layout():
    """Past ``ALIGN_MAX_PAIRS`` (a prefill chunk) the op lays the pairs out in torch and still
    equals the reference."""
    from speccal.kernels.ops_moe import ALIGN_MAX_PAIRS

    rows = ALIGN_MAX_PAIRS // 6 + 7
    x, w, ids, gu, dn = moe_case(3, rows, 64, 32, 16, 6, torch.bfloat16, DEV)
    got, counts = ops.fused_moe(x, w, ids, gu, dn, backend="triton")
    want, want_counts = ops.fused_moe(x.float(), w, ids, gu.float(), dn.float(),
                                      backend="reference")
    assert rel_err(got, want) < TOL[torch.bfloat16] and torch.equal(counts, want_counts)


@pytest.mark.skipif(DEV == "cpu", reason="the interpreter keeps no compiled specializations")
def test_the_kernels_compile_once_for_every_row_count():
    """Cold start: one specialization of each kernel serves every bucket's row count (the pair
    count is not specialised), not one per divisibility class of ``N * top_k``."""
    from speccal.kernels import fused_moe as fm

    kernels = (fm._gate_up_kernel, fm._down_kernel, fm._align_kernel, fm._sum_slots_kernel,
               fm._route_kernel)

    def specializations(kernel):
        return sum(len(caches[0]) for caches in kernel.device_caches.values())

    before = [specializations(k) for k in kernels]
    for rows in (1, 2, 3, 4, 5, 8, 16, 17, 32):
        x, w, ids, gu, dn = moe_case(rows, rows, 40, 24, 6, 2, torch.bfloat16, DEV)
        ops.fused_moe(x, w, ids, gu, dn, backend="triton")
        ops.moe_route(torch.randn(rows, 6, device=DEV), None, 2, "sigmoid", backend="triton")
    after = [specializations(k) for k in kernels]
    # at most one new specialization each (none if an earlier test compiled this shape)
    assert all(a - b <= 1 for a, b in zip(after, before, strict=True)), (before, after)


@pytest.mark.skipif(DEV == "cpu", reason="CUDA graphs need a GPU")
def test_routed_moe_forward_captures_in_a_cuda_graph():
    """The routed layer's whole forward (router, layout, kernels, slot sum, activated-expert
    masks) captured in a CUDA graph and replayed on new rows equals its eager forward, and
    the per-round mask counts the replayed rows' experts."""
    from speccal.runner.moe import RoutedMoE, round_counts
    from speccal.runner.moe_config import MoEConfig

    moe = MoEConfig(num_experts=16, top_k=4, expert_intermediate_size=96, scoring="sigmoid",
                    has_score_bias=True, num_groups=4, topk_groups=2,
                    is_topk_normalised=True, routed_scaling_factor=2.5,
                    shared_intermediate_size=64, shared_form="shared_experts")
    torch.manual_seed(0)
    layer = RoutedMoE(128, moe).to(device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
        layer.gate.float()
        static = torch.randn(12, 128, device=DEV, dtype=torch.bfloat16)
        layer(static)  # warm-up: compiles, stacks the experts, allocates the masks
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(static)
        fresh = torch.randn(12, 128, device=DEV, dtype=torch.bfloat16)
        static.copy_(fresh)
        layer.begin_round()
        graph.replay()
        got = out.clone()
        counted = round_counts([layer])
        layer.begin_round()
        want = layer(fresh)
    assert torch.equal(got, want)
    assert torch.equal(counted, round_counts([layer]))
