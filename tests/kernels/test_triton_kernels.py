"""Triton kernels against their pure-torch references, on the GPU (``cuda`` marker).

Fresh random inputs per case, outputs poisoned with NaN before each launch, bf16/fp16 compared by
relative Frobenius error against the reference run on fp32 upcasts (bf16 operands: < 1e-2).
``SPECCAL_KERNEL_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` runs the same checks through
Triton's interpreter on fp32 (debugging without a GPU).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from kernel_builders import (
    block_table_for,
    cos_sin_table,
    paged_kv,
    rel_err,
    split_qkv,
    verify_oracle,
)

from speccal.kernels import _backend, ops
from speccal.kernels import reference as ref
from speccal.kernels.config import (
    AttentionTuning,
    GemvOverride,
    GemvTuning,
    KernelConfig,
)

pytestmark = pytest.mark.cuda
DEV = os.environ.get("SPECCAL_KERNEL_TEST_DEVICE", "cuda")
DTYPES = [torch.float32] if DEV == "cpu" else [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-4}


def _attention_case(seed, seq_lens, rows, heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(seed)
    h, kvh = heads
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 2
    nb = len(seq_lens) * max_blocks + 3
    kc, vc = paged_kv(nb, block_size, kvh, head_dim, dtype, DEV, gen)
    bt = block_table_for(seq_lens, block_size, max_blocks, nb, gen, DEV)
    q = torch.randn(len(seq_lens), rows, h, head_dim, generator=gen).to(dtype=dtype, device=DEV)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return q, kc, vc, bt, seq


ATTN_CASES = [
    # (seq_lens, rows, (heads, kv_heads), head_dim, block_size)
    ([1024], 1, (16, 8), 128, 16),  # ~2B preset decode, B=1
    ([7, 300, 1024, 2049], 1, (16, 8), 128, 16),
    ([6, 100, 1030, 5000], 6, (16, 8), 128, 16),  # full-width verify, w=5
    ([64, 513], 6, (32, 4), 64, 32),  # group 8 -> M tile 48
    ([33, 900], 3, (8, 8), 128, 64),  # MHA
    ([257], 2, (12, 2), 96, 16),  # head_dim not a power of two
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
@pytest.mark.parametrize("splits", ["one", "auto", "many"])
def test_paged_attention_dense(dtype, case, splits):
    seq_lens, rows, heads, d, bs = ATTN_CASES[case]
    q, kc, vc, bt, seq = _attention_case(case, seq_lens, rows, heads, d, bs, dtype)
    plan = {"one": ops.SplitPlan(1), "auto": ops.plan_splits(len(seq_lens), heads[1]),
            "many": ops.SplitPlan(max_splits=16, block_n=32, min_split_len=32)}[splits]
    scale = 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(q, kc, vc, bt, seq, rows, scale, plan=plan, out=out, backend="triton")
    want = ref.paged_attention_ref(q.float(), kc.float(), vc.float(), bt, seq, rows, scale)
    assert not out.isnan().any()
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_splits, fold, settled", [
    (1, "on", False), (8, "on", False), (8, "off", False), (8, "auto", False), (8, "on", True),
    (8, "off", True),
])
def test_paged_attention_ragged_and_packed(dtype, max_splits, fold, settled):
    """``fold`` (``AttentionTuning.fold``): the split kernel's last program merges the splits
    (on) or a reduce launch does (off; auto: the rule, here a reduce); both zero the unused
    dense rows and the packed padding rows, and the folded path leaves its arrival counters at
    zero. ``settled``: the metadata is read before the kernel's PDL wait (``meta_settled``,
    with the tiling given, and ``prewait="on"``: at every row count)."""
    tune = KernelConfig(attention=AttentionTuning(fold=fold, prewait="on" if settled else "rows"))
    seq_lens, rows = [6, 40, 700, 1500, 3], 6
    q, kc, vc, bt, seq = _attention_case(11, seq_lens, rows, (16, 8), 128, 16, dtype)
    plan = ops.SplitPlan(max_splits=max_splits, block_n=64, min_split_len=64)
    tiling = None
    if settled:
        tiling = (torch.empty_like(seq), torch.empty_like(seq))
        ops.attention_tiling_update(seq, *tiling, plan, tune=tune)
    q_lens = torch.tensor([1, 6, 3, 5, 2], dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(q, kc, vc, bt, seq, rows, 0.1, q_lens=q_lens, plan=plan, out=out,
                        backend="triton", tiling=tiling, meta_settled=settled, tune=tune)
    want = ref.paged_attention_ref(q.float(), kc.float(), vc.float(), bt, seq, rows, 0.1,
                                   q_lens=q_lens)
    assert rel_err(out, want) < TOL[dtype]
    assert torch.equal(out[0, 1:], torch.zeros_like(out[0, 1:]))  # unused rows are zeros

    lens = q_lens.tolist()
    packed = torch.cat([q[b, : lens[b]] for b in range(5)] + [q[0, :4]])  # 4 padding rows
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    pout = torch.full_like(packed, float("nan"))
    ops.paged_attention(packed, kc, vc, bt, seq, rows, 0.1, cu_q_lens=cu, plan=plan, out=pout,
                        backend="triton", tiling=tiling, meta_settled=settled, tune=tune)
    pwant = ref.paged_attention_ref(packed.float(), kc.float(), vc.float(), bt, seq, rows, 0.1,
                                    cu_q_lens=cu)
    assert rel_err(pout, pwant) < TOL[dtype]
    assert torch.equal(pout[-4:], torch.zeros_like(pout[-4:]))
    cnt = _backend._ARRIVAL.get(("attention", pout.device))
    if fold == "on" and max_splits > 1:
        assert cnt is not None and int(cnt.abs().sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, spread", [(6, "auto"), (3, "auto"), (1, "on")])
def test_paged_attention_spread_merge(dtype, rows, spread):
    """The spread merge (``ops.spread_wanted``: each live split program waits for the others of
    its (request, KV head), then merges some rows): dense with ragged rows and packed with
    padding rows, against the reference and against the reduce launch's output bit for bit
    (same partials, same merge arithmetic), three launches back to back, counters left at
    zero. A request with one KV row only has one live split: it merges every row itself.
    ``spread``: ``AttentionTuning.spread`` (``fold="off"``: these light merges would fold
    otherwise)."""
    if DEV == "cpu":
        pytest.skip("the spread merge's programs wait for each other: not under the interpreter")
    seq_lens = [6, 700, 1]
    q, kc, vc, bt, seq = _attention_case(19, seq_lens, rows, (16, 8), 128, 16, dtype)
    plan = ops.SplitPlan(max_splits=4, block_n=64, min_split_len=64)
    assert ops.spread_wanted(3, 8, 4, rows, _backend.num_sms(q.device),
                             None if spread == "auto" else True)
    q_lens = torch.tensor([min(rows, 6), rows, 1], dtype=torch.int32, device=DEV)
    lens = q_lens.tolist()
    pad = q[0, :1].repeat(2, 1, 1)  # 2 padding rows
    packed = torch.cat([q[b, : lens[b]] for b in range(3)] + [pad])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)

    def run(mode):
        tune = KernelConfig(attention=AttentionTuning(fold="off", spread=mode))
        dense = []
        for _ in range(3):
            out = torch.full_like(q, float("nan"))
            ops.paged_attention(q, kc, vc, bt, seq, rows, 0.1, q_lens=q_lens, plan=plan,
                                out=out, backend="triton", tune=tune)
            pout = torch.full_like(packed, float("nan"))
            ops.paged_attention(packed, kc, vc, bt, seq, rows, 0.1, cu_q_lens=cu, plan=plan,
                                out=pout, backend="triton", tune=tune)
            dense.append((out, pout))
        return dense

    spread_runs = run(spread)
    cnt = _backend._ARRIVAL.get(("attention_spread", q.device))
    assert cnt is not None and int(cnt.abs().sum()) == 0
    out, pout = spread_runs[0]
    for o2, p2 in spread_runs[1:]:
        assert torch.equal(o2, out) and torch.equal(p2, pout)
    want = ref.paged_attention_ref(q.float(), kc.float(), vc.float(), bt, seq, rows, 0.1,
                                   q_lens=q_lens)
    assert rel_err(out, want) < TOL[dtype]
    pwant = ref.paged_attention_ref(packed.float(), kc.float(), vc.float(), bt, seq, rows, 0.1,
                                    cu_q_lens=cu)
    assert rel_err(pout, pwant) < TOL[dtype]
    assert torch.equal(pout[-2:], torch.zeros_like(pout[-2:]))
    if rows > 1:
        assert torch.equal(out[2, 1:], torch.zeros_like(out[2, 1:]))  # unused dense rows
    reduce_out, reduce_pout = run("off")[0]
    assert torch.equal(out, reduce_out) and torch.equal(pout, reduce_pout)


def _verify_inputs(seed, batch, k_max, g, block_size=16, max_blocks=40):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 151936, (batch,), generator=gen)
    drafts = torch.randint(0, 151936, (batch, k_max), generator=gen)
    vl = torch.randint(-1, k_max + 2, (batch,), generator=gen).to(torch.int32)  # some clamped
    ctx = torch.randint(0, max_blocks * block_size - k_max - 2, (batch,), generator=gen).int()
    bt = torch.randint(1, 4000, (batch, max_blocks), generator=gen).to(torch.int32)
    return base, drafts, vl, ctx, bt


@pytest.mark.parametrize("batch, k_max, g", [(1, 5, 6), (3, 5, 18), (8, 3, 40), (37, 5, 256)])
def test_verify_updates_and_tiling_match_oracle(batch, k_max, g):
    base, drafts, vl, ctx, bt = _verify_inputs(batch, batch, k_max, g)
    w_ids, w_pos, w_slots, w_seq, w_cu = verify_oracle(base, drafts, vl, ctx, bt, 16, g)
    w_ids, w_pos, w_slots = w_ids[:g], w_pos[:g], w_slots[:g]
    d = dict(base=base.to(DEV), drafts=drafts.to(DEV), vl=vl.to(DEV), ctx=ctx.to(DEV),
             bt=bt.to(DEV))
    ids = torch.full((g,), 99, dtype=torch.int64, device=DEV)
    ops.verify_token_update(d["base"], d["drafts"], d["vl"], ids, pad_id=-1, backend="triton")
    pos = torch.full((g,), -9, dtype=torch.int64, device=DEV)
    slots = torch.full((g,), -9, dtype=torch.int64, device=DEV)
    seq = torch.full((batch,), -9, dtype=torch.int32, device=DEV)
    cu = torch.full((batch + 1,), -9, dtype=torch.int32, device=DEV)
    grid = torch.full((batch * (k_max + 1),), -9, dtype=torch.int64, device=DEV)
    ops.verify_metadata_update(d["vl"], d["ctx"], d["bt"], 16, pos, slots, seq, cu, k_max,
                               grid_rows=grid, backend="triton")
    assert grid.tolist() == [min(w_cu[i] + j, g - 1) for i in range(batch)
                             for j in range(k_max + 1)]
    if len(w_cu) - 1 == batch and w_cu[-1] <= g:
        assert ids.tolist() == w_ids
        assert pos.tolist() == w_pos and slots.tolist() == w_slots
    assert seq.tolist() == w_seq and cu.tolist() == w_cu
    plan = ops.plan_splits(batch, 8)
    ns = torch.full((batch,), -1, dtype=torch.int32, device=DEV)
    sl = torch.full((batch,), -1, dtype=torch.int32, device=DEV)
    ops.attention_tiling_update(seq, ns, sl, plan, backend="triton")
    ns_r, sl_r = ns.clone(), sl.clone()
    ops.attention_tiling_update(seq, ns_r, sl_r, plan, backend="reference")
    assert torch.equal(ns, ns_r) and torch.equal(sl, sl_r)


@pytest.mark.parametrize("batch, k_max, g", [(1, 5, 6), (3, 5, 9), (8, 3, 12)])
def test_verify_updates_base_index_and_max_cu_match_reference(batch, k_max, g):
    """The in-kernel pending gather (``base_index`` into the slot state) and the ``cu_q_lens``
    cap (``max_cu = G``, here below the rows of all requests) equal the reference, which equals
    the torch gather and clamp they replace (test_reference.py)."""
    _, drafts, vl, ctx, bt = _verify_inputs(batch + 50, batch, k_max, g)
    gen = torch.Generator().manual_seed(batch)
    slots, w1 = batch + 3, k_max + 1
    ext = torch.randint(0, 151936, (slots, w1), generator=gen)
    index = torch.randperm(slots, generator=gen)[:batch] * w1 + torch.randint(0, w1, (batch,),
                                                                              generator=gen)
    outs = {}
    for backend in ("triton", "reference"):
        a = [x.to(DEV) for x in (ext, drafts, vl, ctx, bt, index)]
        ids = torch.full((g,), 99, dtype=torch.int64, device=DEV)
        ops.verify_token_update(a[0], a[1], a[2], ids, pad_id=0, base_index=a[5], backend=backend)
        pos = torch.full((g,), -9, dtype=torch.int64, device=DEV)
        slot = torch.full((g,), -9, dtype=torch.int64, device=DEV)
        seq = torch.full((batch,), -9, dtype=torch.int32, device=DEV)
        cu = torch.full((batch + 1,), -9, dtype=torch.int32, device=DEV)
        ops.verify_metadata_update(a[2], a[3], a[4], 16, pos, slot, seq, cu, k_max, max_cu=g,
                                   backend=backend)
        outs[backend] = [t.cpu() for t in (ids, pos, slot, seq, cu)]
    for got, want in zip(outs["triton"], outs["reference"], strict=True):
        assert torch.equal(got, want)
    assert int(outs["triton"][4].max()) <= g
    assert outs["triton"][0][0] == ext.view(-1)[index[0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n", [(1, 2048), (6, 2048), (48, 1000)])
def test_embed_rms_norm_matches_reference(dtype, m, n):
    """Embedding rows copied bit for bit (ids of both int dtypes, one outside the table: a zero
    row); their norm equals ``ops.rms_norm`` of those rows (the same kernel math) and the
    fp32 reference."""
    vocab = 3000
    gen = torch.Generator().manual_seed(m + n)
    table = (torch.randn(vocab, n, generator=gen) * 2).to(dtype=dtype, device=DEV)
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype=dtype, device=DEV)
    ids = torch.randint(0, vocab, (m,), generator=gen)
    ids[-1] = vocab - 1
    for id_dtype in (torch.int64, torch.int32):
        i = ids.to(dtype=id_dtype, device=DEV)
        h = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        ops.embed_rms_norm(i, table, w, 1e-6, out_h=h, out=out, backend="triton")
        assert torch.equal(h, table[i.long()])
        assert torch.equal(out, ops.rms_norm(h, w, 1e-6, backend="triton"))
        assert rel_err(out, ref.rms_norm_ref(h.float(), w.float(), 1e-6)) < TOL[dtype]
    bad = torch.tensor([-1, 5, vocab], device=DEV)
    h, out = ops.embed_rms_norm(bad, table, w, 1e-6, backend="triton")
    want_h, want_out = ref.embed_rms_norm_ref(bad, table, w, 1e-6)
    assert torch.equal(h, want_h) and rel_err(out, want_out) < TOL[dtype]
    assert int(torch.count_nonzero(h[0])) == 0 and int(torch.count_nonzero(out[0])) == 0 and int(torch.count_nonzero(h[2])) == 0


@pytest.mark.skipif(DEV == "cpu", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_verify_round_in_cuda_graph_matches_reference(backend):
    """Token/metadata/tiling updates + attention captured once, replayed on three new rounds.

    Both backends: the reference is the fallback inside captured graphs when Triton is absent.
    """
    batch, k_max, g, bs, heads, kvh, d = 4, 5, 24, 16, 16, 8, 128
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    kc, vc = paged_kv(600, bs, kvh, d, dtype, DEV, gen)
    s = {  # static buffers, stable addresses
        "base": torch.zeros(batch, dtype=torch.int64, device=DEV),
        "drafts": torch.zeros(batch, k_max, dtype=torch.int64, device=DEV),
        "vl": torch.zeros(batch, dtype=torch.int32, device=DEV),
        "ctx": torch.zeros(batch, dtype=torch.int32, device=DEV),
        "bt": torch.zeros(batch, 40, dtype=torch.int32, device=DEV),
        "q": torch.zeros(g, heads, d, dtype=dtype, device=DEV),
        "ids": torch.zeros(g, dtype=torch.int64, device=DEV),
        "pos": torch.zeros(g, dtype=torch.int64, device=DEV),
        "slots": torch.zeros(g, dtype=torch.int64, device=DEV),
        "seq": torch.zeros(batch, dtype=torch.int32, device=DEV),
        "cu": torch.zeros(batch + 1, dtype=torch.int32, device=DEV),
        "ns": torch.zeros(batch, dtype=torch.int32, device=DEV),
        "sl": torch.zeros(batch, dtype=torch.int32, device=DEV),
        "out": torch.zeros(g, heads, d, dtype=dtype, device=DEV),
    }
    plan = ops.plan_splits(batch, kvh)

    def round_():
        ops.verify_token_update(s["base"], s["drafts"], s["vl"], s["ids"], backend=backend)
        ops.verify_metadata_update(s["vl"], s["ctx"], s["bt"], bs, s["pos"], s["slots"], s["seq"],
                                   s["cu"], k_max, backend=backend)
        ops.attention_tiling_update(s["seq"], s["ns"], s["sl"], plan, backend=backend)
        ops.paged_attention(s["q"], kc, vc, s["bt"], s["seq"], k_max + 1, 0.088,
                            cu_q_lens=s["cu"], tiling=(s["ns"], s["sl"]), plan=plan,
                            out=s["out"], backend=backend)

    def load(seed):
        base, drafts, vl, ctx, bt = _verify_inputs(seed, batch, k_max, g, bs, 40)
        bt = torch.randperm(599, generator=gen)[: batch * 40].view(batch, 40).int() + 1
        for key, val in (("base", base), ("drafts", drafts), ("vl", vl), ("ctx", ctx),
                         ("bt", bt), ("q", torch.randn(g, heads, d, generator=gen))):
            s[key].copy_(val.to(s[key].dtype))
        return base, drafts, vl, ctx, bt

    load(100)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        round_()  # warm-up compiles every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_()
    for seed in (7, 8, 9):
        base, drafts, vl, ctx, bt = load(seed)
        s["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        w_ids, w_pos, w_slots, w_seq, w_cu = verify_oracle(base, drafts, vl, ctx, bt, bs, g)
        assert s["ids"].tolist() == w_ids and s["pos"].tolist() == w_pos
        assert s["slots"].tolist() == w_slots and s["seq"].tolist() == w_seq
        want = ref.paged_attention_ref(s["q"].float(), kc.float(), vc.float(), s["bt"], s["seq"],
                                       k_max + 1, 0.088, cu_q_lens=s["cu"])
        assert rel_err(s["out"], want) < 1e-2


GEMV_SHAPES = [(2048, 2048), (4096, 2048), (2048, 6144), (1000, 2100), (151936 // 16, 2048)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 16, 24, 48])
@pytest.mark.parametrize("shape", GEMV_SHAPES)
def test_linear_matches_reference(dtype, m, shape):
    from speccal.kernels.gemv import GemvConfig

    n, k = shape
    gen = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEV)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype=dtype, device=DEV)
    want = ref.linear_ref(x.float(), w.float())
    configs = [None, GemvConfig(block_n=64, block_k=128, split_k=4),
               GemvConfig(block_n=128, block_k=64, split_k=1)]
    if m <= 4:
        configs.append(GemvConfig(block_n=32, block_k=128, split_k=2, fma=True))
    for cfg in configs:
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        ops.linear(x, w, out=out, config=cfg, backend="triton")
        assert rel_err(out, want) < TOL[dtype] / 2, cfg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 6, 24, 48])
@pytest.mark.parametrize("k_in", [2048, 6144])
@pytest.mark.parametrize("scale", ["late", "early"])
def test_deferred_norm_matches_the_norm_launch(dtype, m, k_in, scale):
    """The deferred-norm producer (residual add, ``xw = h * w``, per-tile sums of squares) and
    the consumer's row scale against the reference chain residual add -> RMSNorm -> SwiGLU
    GEMV. K 2048: the o projection (split 1, the epilogue); K 6144: the down projection (split
    K, the last program of each column tile reduces; its counters end at zero). The consumer
    reduces its row scales after its K loop (``late``) or before it (``early``:
    ``GemvTuning.defer_scale``)."""
    tune = KernelConfig(gemv=GemvTuning(defer_scale=scale))
    gen = torch.Generator().manual_seed(70 + m)
    n, inter = 2048, 256
    x = torch.randn(m, k_in, generator=gen).to(dtype=dtype, device=DEV)
    h = (torch.randn(m, n, generator=gen) * 2).to(dtype=dtype, device=DEV)
    w_o = (torch.randn(n, k_in, generator=gen) / math.sqrt(k_in)).to(dtype=dtype, device=DEV)
    w_gu = (torch.randn(2 * inter, n, generator=gen) / math.sqrt(n)).to(dtype=dtype, device=DEV)
    nw = (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype=dtype, device=DEV)
    h1 = h.clone()
    dn = ops.linear_deferred_norm(x, w_o, h1, nw, 1e-6, backend="triton", tune=tune)
    assert dn.ss.shape[1] > 1  # the GEMV epilogue wrote per-tile partials (no torch fallback)
    act = torch.full((m, inter), float("nan"), dtype=dtype, device=DEV)
    ops.linear(dn.xw, w_gu, out=act, epilogue="silu_mul", row_scale=dn, backend="triton",
               tune=tune)
    h2 = h.float().clone()
    ref.linear_ref(x.float(), w_o.float(), None, h2)
    want = ref.linear_ref(ref.rms_norm_ref(h2, nw.float(), 1e-6), w_gu.float(), "silu_mul")
    assert rel_err(h1, h2) < TOL[dtype]
    assert rel_err(dn.xw, h2 * nw.float()) < TOL[dtype]
    torch.testing.assert_close(dn.ss.sum(1), h1.float().pow(2).sum(1), rtol=1e-4, atol=1e-3)
    assert rel_err(act, want) < 2 * TOL[dtype]
    cnt = _backend._ARRIVAL.get(("splitk", h1.device))
    assert cnt is None or int(cnt.abs().sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n", [(1, 2048), (48, 2048), (7, 1000)])
def test_rms_norm_matches_reference(dtype, m, n):
    gen = torch.Generator().manual_seed(m * n)
    x, r = (torch.randn(2, m, n, generator=gen) * 3).to(dtype=dtype, device=DEV)
    w = torch.randn(n, generator=gen).to(dtype=dtype, device=DEV)
    y0, h0 = ref.rms_norm_ref(x, w, 1e-6, r)
    res = r.clone()
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(x, w, 1e-6, residual=res, out=out, backend="triton")
    assert rel_err(out, y0) < TOL[dtype] and rel_err(res, h0) < TOL[dtype]
    out2 = ops.rms_norm(x, w, 1e-6, backend="triton")
    assert rel_err(out2, ref.rms_norm_ref(x, w, 1e-6)) < TOL[dtype]


def _rotary_case(seed, t, heads, kvh, d, dtype):
    """``t`` rows of a fused QKV output, the cos/sin table, positions and KV slots (never the
    sentinel slot 0) of a 64-block x 16 cache; the generator continues for further draws."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=gen).to(dtype=dtype, device=DEV)
    pos = torch.randint(0, 4096, (t,), generator=gen).to(DEV)
    slots = (torch.randperm(64 * 16 - 16, generator=gen)[:t] + 16).to(DEV)
    return gen, qkv, cos_sin_table(d, DEV), pos, slots


def _nan_caches(kvh, d, dtype):
    """K/V caches of 64 blocks x 16 slots poisoned with NaN: unwritten slots stay NaN."""
    kc = torch.full((64, 16, kvh, d), float("nan"), dtype=dtype, device=DEV)
    return kc, kc.clone()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, heads, kvh, d", [(1, 16, 8, 128), (48, 16, 8, 128), (5, 12, 2, 64)])
def test_rotary_kv_write_matches_reference(dtype, t, heads, kvh, d):
    gen, qkv, cs, pos, slots = _rotary_case(t * heads, t, heads, kvh, d, dtype)
    results = []
    for backend in ("triton", "reference"):
        buf = qkv.clone()
        q, k, v = split_qkv(buf, heads, kvh, d)
        kc, vc = _nan_caches(kvh, d, dtype)
        ops.rotary_kv_write(q, k, v, pos, cs, slots, kc, vc, backend=backend)
        results.append((q.clone(), kc.view(-1, kvh, d)[slots], vc.view(-1, kvh, d)[slots],
                        kc.isnan().sum()))
    (q1, k1, v1, n1), (q2, k2, v2, n2) = results
    assert rel_err(q1, q2) < TOL[dtype] / 4 and rel_err(k1, k2) < TOL[dtype] / 4
    assert torch.equal(v1, v2)
    assert n1 == n2  # exactly the same slots written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 48])
@pytest.mark.parametrize("shape", [(2048, 2048), (1000, 2100), (12288, 2048)])
@pytest.mark.parametrize("fusion", ["silu_mul", "residual"])
def test_fused_linear_matches_reference(dtype, m, shape, fusion):
    """SwiGLU (interleaved gate/up rows) and residual epilogues of the decode layer's GEMVs."""
    from speccal.kernels.gemv import GemvConfig

    n, k = shape
    gen = torch.Generator().manual_seed(n + k + m + len(fusion))
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype=dtype, device=DEV)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype=dtype, device=DEV)
    res0 = torch.randn(m, n, generator=gen).to(dtype=dtype, device=DEV)
    glu = fusion == "silu_mul"
    f32 = (lambda t: t.float()) if dtype != torch.float32 else (lambda t: t.clone())
    want = ref.linear_ref(f32(x), f32(w), "silu_mul" if glu else None,
                          None if glu else f32(res0))
    # residual_settled: the residual loads before the K loop (before the PDL wait on a GPU)
    for cfg, settled in ((None, True), (GemvConfig(block_n=16, block_k=256, split_k=1), False),
                         (GemvConfig(block_n=64, block_k=128, split_k=4), True)):
        res = None if glu else res0.clone()  # SwiGLU: split forced to 1
        out = torch.full((m, n // 2), float("nan"), dtype=dtype, device=DEV) if glu else None
        got = ops.linear(x, w, out=out, config=cfg, epilogue="silu_mul" if glu else None,
                         residual=res, residual_settled=settled and not glu, backend="triton")
        assert got is (out if glu else res)
        assert rel_err(got, want) < TOL[dtype], (fusion, cfg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 6, 8])
@pytest.mark.parametrize("shape, block_n", [((2048, 2048), None), ((1000, 600), 8),
                                            ((40, 1000), 16)])
def test_register_panel_matches_reference(dtype, m, shape, block_n):
    """The register-panel GEMV (``GemvConfig(panel=True)``: the o projection at <= 8 rows):
    plain output, residual add (settled or not), the deferred norm's pieces and a norm launch,
    against the reference; N not a multiple of the column tile and K not a power of two."""
    from speccal.kernels.gemv import GemvConfig
    from speccal.kernels.gemv_config import deferred_norm_tiles

    n, k = shape
    gen = torch.Generator().manual_seed(n + k + m + 7)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEV)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype=dtype, device=DEV)
    res0 = torch.randn(m, n, generator=gen).to(dtype=dtype, device=DEV)
    nw = (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype=dtype, device=DEV)
    cfg = None if block_n is None else GemvConfig(block_n=block_n, num_warps=8, num_stages=1,
                                                  panel=True)
    want = ref.linear_ref(x.float(), w.float())
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    ops.linear(x, w, out=out, config=cfg, backend="triton")
    assert rel_err(out, want) < TOL[dtype] / 2
    h_want = res0.float() + want
    for settled in (False, True):
        res = res0.clone()
        got = ops.linear(x, w, config=cfg, residual=res, residual_settled=settled,
                         backend="triton")
        assert got is res and rel_err(res, h_want) < TOL[dtype]
    res, xn = res0.clone(), torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    ops.linear(x, w, config=cfg, residual=res, norm=(nw, 1e-6, xn), backend="triton")
    assert rel_err(xn, ref.rms_norm_ref(h_want, nw.float(), 1e-6)) < 2 * TOL[dtype]
    if block_n is None:  # the table's config: the deferred norm through ops
        res = res0.clone()
        dn = ops.linear_deferred_norm(x, w, res, nw, 1e-6, residual_settled=True,
                                      backend="triton")
        assert dn.ss.shape[1] == deferred_norm_tiles(m, n, k, element_size=x.element_size())[0]
        assert rel_err(res, h_want) < TOL[dtype]
        assert rel_err(dn.xw, res.float() * nw.float()) < TOL[dtype]
        torch.testing.assert_close(dn.ss.sum(1), res.float().pow(2).sum(1), rtol=1e-4,
                                   atol=1e-3)


@pytest.mark.parametrize("m", [12, 16, 17, 24, 32])
def test_register_panel_past_eight_rows(m):
    """The o projection's register panel at 9-16 rows (an M tile of 16) and, under
    ``GemvTuning(panel_max_rows=32)`` (a bench switch), 17-32 rows (two M tiles of 16, ``TWO``):
    the product, the residual add and the deferred norm's pieces against the reference, through
    the config the o projection would pick (the interpreter: fp32 at an 8-column panel, 64 KB)."""
    from speccal.kernels import gemv_config as gc

    width = 8 if DEV == "cpu" else 16
    tuning = GemvTuning(panel_max_rows=32, overrides=(
        GemvOverride.parse(f"2048:2048:32={width}/128/1/8/1/panel"),))
    tune = KernelConfig(gemv=tuning)
    dtype = torch.float32 if DEV == "cpu" else DTYPES[0]
    n = k = 2048
    cfg = gc.launch_config(m, n, k, epilogue="residual", element_size=2, tuning=tuning)
    assert cfg.panel
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEV)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype=dtype, device=DEV)
    res0 = torch.randn(m, n, generator=gen).to(dtype=dtype, device=DEV)
    nw = (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype=dtype, device=DEV)
    want = ref.linear_ref(x.float(), w.float())
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    ops.linear(x, w, out=out, config=cfg, backend="triton", tune=tune)
    assert rel_err(out, want) < TOL[dtype] / 2
    res = res0.clone()
    dn = ops.linear_deferred_norm(x, w, res, nw, 1e-6, residual_settled=True, backend="triton",
                                  tune=tune)
    assert rel_err(res, res0.float() + want) < TOL[dtype]
    assert rel_err(dn.xw, res.float() * nw.float()) < TOL[dtype]
    torch.testing.assert_close(dn.ss.sum(1), res.float().pow(2).sum(1), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 48])
@pytest.mark.parametrize("shape", [(2048, 6144), (1000, 2100)])
def test_linear_residual_norm_matches_reference(dtype, m, shape):
    """The down GEMV's reduce writing the next layer's RMSNorm (split-K), and the split-1
    fallback (a norm launch after the GEMV)."""
    from speccal.kernels.gemv import GemvConfig

    n, k = shape
    gen = torch.Generator().manual_seed(n + m)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEV)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype=dtype, device=DEV)
    res0 = torch.randn(m, n, generator=gen).to(dtype=dtype, device=DEV)
    nw = (torch.rand(n, generator=gen) + 0.5).to(dtype=dtype, device=DEV)
    f32 = (lambda t: t.float()) if dtype != torch.float32 else (lambda t: t.clone())
    want_h = ref.linear_ref(f32(x), f32(w), None, f32(res0))
    for cfg in (GemvConfig(block_n=64, block_k=128, split_k=4),
                GemvConfig(block_n=16, block_k=256, split_k=1)):
        res = res0.clone()
        xn = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        got = ops.linear(x, w, config=cfg, residual=res, norm=(nw, 1e-6, xn), backend="triton")
        assert got is res
        assert rel_err(res, want_h) < TOL[dtype], cfg
        # the norm of the residual as stored (rounded), as a separate norm launch would read it
        want_n = ref.rms_norm_ref(f32(res), f32(nw), 1e-6)
        assert rel_err(xn, want_n) < TOL[dtype] / 4, cfg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, heads, kvh, d", [(1, 16, 8, 128), (48, 16, 8, 128), (5, 12, 2, 64)])
def test_rotary_kv_write_qk_norm_and_q_out(dtype, t, heads, kvh, d):
    """Qwen3's per-head q/k norm folded into the rotary kernel, q written to a separate buffer."""
    gen, qkv, cs, pos, slots = _rotary_case(7 * t + d, t, heads, kvh, d, dtype)
    qw, kw = (1 + 0.2 * torch.randn(2, d, generator=gen)).to(dtype=dtype, device=DEV)
    results = []
    for backend in ("triton", "reference"):
        buf = qkv.clone()
        q, k, v = split_qkv(buf, heads, kvh, d)
        kc, vc = _nan_caches(kvh, d, dtype)
        q_out = torch.full((t, heads, d), float("nan"), dtype=dtype, device=DEV)
        got = ops.rotary_kv_write(q, k, v, pos, cs, slots, kc, vc, q_out=q_out,
                                  qk_norm=(qw, kw, 1e-6), backend=backend)
        assert got is q_out
        assert torch.equal(buf, qkv)  # the QKV buffer is left as it was
        results.append((q_out.clone(), kc.view(-1, kvh, d)[slots], vc.view(-1, kvh, d)[slots]))
    (q1, k1, v1), (q2, k2, v2) = results
    assert rel_err(q1, q2) < TOL[dtype] / 4 and rel_err(k1, k2) < TOL[dtype] / 4
    assert torch.equal(v1, v2)
    # the norm really happened: per-head RMS of the rotated q is that of the norm weight
    assert abs(float(q2.float().pow(2).mean()) - float(qw.float().pow(2).mean())) < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, heads, kvh, d, r", [(1, 8, 2, 256, 64), (7, 6, 2, 64, 16),
                                                 (3, 4, 1, 48, 12)])
def test_rotary_kv_write_partial_rotary_gated_q(dtype, t, heads, kvh, d, r):
    """Partial rotary (the first ``r`` of ``d`` channels rotate: Qwen3.5 / Qwen3-Next gated
    attention), the per-head q/k norm with fp32 weights over all ``d`` channels, q read from
    the gated projection's ``[q | gate]`` heads (head stride ``2 d``), written to ``q_out``."""
    gen = torch.Generator().manual_seed(31 * t + r)
    qg = torch.randn(t, heads, 2 * d, generator=gen).to(dtype=dtype, device=DEV)
    kv = torch.randn(t, 2, kvh, d, generator=gen).to(dtype=dtype, device=DEV)
    pos = torch.randint(0, 4096, (t,), generator=gen).to(DEV)
    slots = (torch.randperm(64 * 16 - 16, generator=gen)[:t] + 16).to(DEV)
    cs = cos_sin_table(r, DEV)
    qw, kw = (1 + 0.2 * torch.randn(2, d, generator=gen)).to(DEV)  # fp32 (frozen 1 + w)
    results = []
    for backend in ("triton", "reference"):
        buf = qg.clone()
        q, k, v = buf[..., :d], kv[:, 0], kv[:, 1]
        kc, vc = _nan_caches(kvh, d, dtype)
        q_out = torch.full((t, heads, d), float("nan"), dtype=dtype, device=DEV)
        ops.rotary_kv_write(q, k, v, pos, cs, slots, kc, vc, q_out=q_out,
                            qk_norm=(qw, kw, 1e-6), backend=backend)
        assert torch.equal(buf, qg)  # the gate half and q are left as they were
        results.append((q_out.clone(), kc.view(-1, kvh, d)[slots], vc.view(-1, kvh, d)[slots],
                        kc.isnan().sum()))
    (q1, k1, v1, n1), (q2, k2, v2, n2) = results
    assert not q1.isnan().any()
    assert rel_err(q1, q2) < TOL[dtype] / 4 and rel_err(k1, k2) < TOL[dtype] / 4
    # the channels past r only normed: the same on both sides
    assert rel_err(q1[..., r:], q2[..., r:]) < TOL[dtype] / 4
    assert torch.equal(v1, v2) and n1 == n2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("max_splits, settled", [(1, False), (8, False), (1, True), (8, True)])
def test_rope_paged_attention_matches_reference(dtype, qk_norm, max_splits, settled):
    """Attention fused with q/k norm + rotary + the new rows' KV write (packed verify rows;
    request 1's six rows straddle a KV split boundary). ``settled``: the metadata, rotary
    tables and new rows' pages are read before the PDL wait (``meta_settled``, and
    ``prewait="on"``: at every row count)."""
    gen = torch.Generator().manual_seed(11 + max_splits)
    heads, kvh, d, bs = 16, 8, 128, 16
    ctx = [1017, 60, 3]
    rows = [1, 6, 4]
    seq = [c + r for c, r in zip(ctx, rows, strict=True)]
    max_blocks = max(-(-n // bs) for n in seq) + 1
    nb = len(seq) * max_blocks + 3
    kc0, vc0 = paged_kv(nb, bs, kvh, d, dtype, DEV, gen)
    bt = block_table_for(seq, bs, max_blocks, nb, gen, DEV)
    t_rows = sum(rows) + 2  # two padding rows
    cu = torch.tensor([0, 1, 7, 11], dtype=torch.int32, device=DEV)
    qkv = torch.randn(t_rows, (heads + 2 * kvh) * d, generator=gen).to(dtype=dtype, device=DEV)
    q, k, v = split_qkv(qkv, heads, kvh, d)
    cs = cos_sin_table(d, DEV)
    norm = None
    if qk_norm:
        qw, kw = (1 + 0.2 * torch.randn(2, d, generator=gen)).to(dtype=dtype, device=DEV)
        norm = (qw, kw, 1e-6)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=DEV)
    plan = ops.SplitPlan(max_splits=max_splits, block_n=64, min_split_len=16)
    tiling = None
    tune = KernelConfig(attention=AttentionTuning(prewait="on" if settled else "rows"))
    if settled:
        tiling = (torch.empty_like(seq_t), torch.empty_like(seq_t))
        ops.attention_tiling_update(seq_t, *tiling, plan, tune=tune)
    outs = []
    for backend in ("triton", "reference"):
        kc, vc = kc0.clone(), vc0.clone()
        out = ops.paged_attention(q, kc, vc, bt, seq_t, max(rows), d ** -0.5, cu_q_lens=cu,
                                  plan=plan, rope=(k, v, cs, norm), backend=backend,
                                  tiling=tiling, meta_settled=settled, tune=tune)
        outs.append((out, kc[1:], vc[1:]))  # block 0: the sentinel (reference pads write it)
    (o1, k1, v1), (o2, k2, v2) = outs
    assert rel_err(o1, o2) < TOL[dtype]
    assert rel_err(k1, k2) < TOL[dtype] / 4
    assert torch.equal(v1, v2)
    assert torch.equal(o1[sum(rows):], torch.zeros_like(o1[sum(rows):]))  # padding rows


def _assert_accepted(na, out, args, want_args, greedy):
    """``verify_accept``'s results and slot writes equal the loop oracle run on ``want_args``
    (hidden rows bit for bit: a copy)."""
    from kernel_builders import accept_oracle

    want_na, want_out = accept_oracle(*want_args, greedy=greedy)
    assert torch.equal(na.cpu(), want_na) and torch.equal(out.cpu(), want_out)
    assert torch.equal(args[6].cpu(), want_args[6])
    assert torch.equal(args[7].cpu().float().nan_to_num(-3.0),
                       want_args[7].float().nan_to_num(-3.0))


@pytest.mark.parametrize("k, batch, hidden", [(0, 1, 2048), (5, 1, 2048), (5, 8, 2048), (3, 5, 100)])
@pytest.mark.parametrize("greedy", [True, False])
def test_verify_accept_matches_oracle(k, batch, hidden, greedy):
    """The fused acceptance kernel: tokens, accepted lengths and slot writes equal the oracle
    (hidden rows bit for bit: a copy)."""
    from kernel_builders import accept_case

    args = accept_case(7 + k, batch, k, batch * (k + 1) + 3, hidden, torch.bfloat16, DEV)
    want_args = [a.cpu().clone() for a in args]
    na, out = ops.verify_accept(*args, greedy=greedy, backend="triton")
    _assert_accepted(na, out, args, want_args, greedy)


# interpreter: small shapes; GPU: also the LM head of the ~2B preset (both tuned configs)
ARGMAX_SHAPES = [(1000, 128), (3072, 64)] + ([(151936, 2048)] if DEV != "cpu" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 6, 48])
@pytest.mark.parametrize("shape", ARGMAX_SHAPES)
def test_linear_argmax_matches_reference(dtype, m, shape):
    """The GEMV's argmax epilogue: partials equal the reference's bit for bit (integer inputs:
    exact sums), so rounding ties, exact ties, NaN and the partial last tile are settled as
    torch.argmax of the stored logits settles them; explicit configs incl. the fma path."""
    from kernel_builders import argmax_case

    from speccal.kernels.gemv import GemvConfig

    n, k = shape
    configs = [None, GemvConfig(block_n=64, block_k=64, num_stages=3)]
    if m <= 4:
        configs.append(GemvConfig(block_n=32, block_k=32, fma=True))
    for cfg in configs:
        width = ops.argmax_tile_width(m, n, k, config=cfg)
        x, w, special = argmax_case(n + m, m, n, k, dtype, DEV, width)
        tile_max, tile_idx = ops.linear_argmax(x, w, config=cfg, backend="triton")
        want_max, want_idx = ref.linear_argmax_ref(x.cpu(), w.cpu(), width)
        assert torch.equal(tile_idx.cpu(), want_idx), cfg
        assert torch.equal(tile_max.cpu().nan_to_num(0.5), want_max.nan_to_num(0.5)), cfg
        tokens = ref.reduce_argmax_partials_ref(tile_max, tile_idx).cpu()
        assert torch.equal(tokens, ref.linear_ref(x.cpu(), w.cpu()).argmax(-1)), cfg
        assert all(int(tokens[r]) == c for r, c in special.items()), cfg
        # packed keys: every tile's atomic max leaves the whole row's key, bit for bit
        keys = torch.zeros(m, dtype=torch.int64, device=DEV)
        packed = ops.linear_argmax(x, w, config=cfg, keys=keys, backend="triton")
        assert packed.keys is keys
        assert torch.equal(keys.cpu(), ref.argmax_keys_ref(ref.linear_ref(x.cpu(), w.cpu()))), cfg


@pytest.mark.parametrize("k, batch", [(0, 1), (1, 3), (5, 1), (5, 8)])
@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("vocab, block_n, chunk", [(200, 16, None), (1500, 1, None),
                                                   (1500, 1, 4096)])
def test_verify_accept_partials_match_oracle(k, batch, greedy, vocab, block_n, chunk,
                                             monkeypatch):
    """The acceptance kernel reducing per-tile partials itself: the same results as from the
    row tokens. ``block_n = 1`` gives T = 1500 tiles; a 4096-partial chunk cap makes that
    several BLOCK_T chunks (512 at k = 5): tokens shifted to columns 600..649 put NaN rows'
    ``+inf`` a chunk before their NaN and many tied columns a chunk after the first."""
    from kernel_builders import accept_case, logits_for_tokens

    from speccal.kernels import verify_accept as va

    if chunk is not None:
        monkeypatch.setattr(va, "PARTIAL_CHUNK", chunk)

    args = accept_case(11 + k, batch, k, batch * (k + 1) + 3, 64, torch.bfloat16, DEV)
    if vocab > 1000:
        args[0] += 600  # row tokens
        args[2] += 600  # drafts (greedy acceptance compares them to the tokens)
    gen = torch.Generator().manual_seed(k + batch)
    logits = logits_for_tokens(args[0].cpu(), vocab, gen)
    partials = tuple(p.to(DEV) for p in ref.argmax_partials_ref(logits, block_n))
    want_args = [a.cpu().clone() for a in args]
    na, out = ops.verify_accept(partials, *args[1:], greedy=greedy, backend="triton")
    _assert_accepted(na, out, args, want_args, greedy)


@pytest.mark.parametrize("k, batch", [(0, 1), (5, 1), (5, 8), (3, 5)])
@pytest.mark.parametrize("greedy", [True, False])
def test_verify_accept_keys_match_oracle(k, batch, greedy):
    """The acceptance kernel reading packed argmax keys (``ops.ArgmaxKeys``, the LM head's
    atomics on the Triton path, zeroed by the metadata update kernel first): the same results
    as from the row tokens."""
    from kernel_builders import accept_case

    dtype = DTYPES[0]  # bf16 on the GPU (the interpreter's bf16 dot is not exact)
    args = accept_case(13 + k, batch, k, batch * (k + 1) + 3, 64, dtype, DEV)
    g = args[5].shape[0]
    gen = torch.Generator().manual_seed(k + batch)
    # logits with each row's token as its unique max, as x = I @ w.T (exact in bf16)
    logits = torch.randint(-5, 6, (g, 700), generator=gen).float()
    logits[torch.arange(g), args[0].cpu()] = 9.0
    kdim = -(-g // 16) * 16
    x = torch.eye(g, kdim).to(dtype).to(DEV)
    w = torch.zeros(700, kdim)
    w[:, :g] = logits.t()
    w = w.to(dtype).to(DEV)
    keys = torch.full((g,), -1, dtype=torch.int64, device=DEV)  # stale
    vl = torch.zeros(batch, dtype=torch.int32, device=DEV)
    ops.verify_metadata_update(
        vl, torch.zeros(batch, dtype=torch.int32, device=DEV),
        torch.zeros(batch, 3, dtype=torch.int32, device=DEV), 16,
        torch.empty(g, dtype=torch.int64, device=DEV), torch.empty(g, dtype=torch.int64,
                                                                   device=DEV),
        torch.empty(batch, dtype=torch.int32, device=DEV),
        torch.empty(batch + 1, dtype=torch.int32, device=DEV), 0, argmax_keys=keys,
        backend="triton")
    assert int(keys.abs().sum()) == 0
    packed = ops.linear_argmax(x, w, keys=keys, backend="triton")
    want_args = [a.cpu().clone() for a in args]
    na, out = ops.verify_accept(packed, *args[1:], greedy=greedy, backend="triton")
    _assert_accepted(na, out, args, want_args, greedy)


@pytest.mark.skipif(DEV == "cpu", reason="the flag handshake needs PDL (a GPU)")
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("max_splits, fold", [(1, "auto"), (8, "on"), (8, "off")])
def test_attention_signal_lets_the_panel_poll(rows, max_splits, fold):
    """``AttentionTuning(poll=True)``: attention (single split, folded merge, reduce launch)
    counts its finished pieces in an ``AttnSignal`` and the register-panel o projection polls
    it instead of its PDL wait: same output bits as the waiting launch, the counters back at
    zero, and the target the launch's piece count. Repeated launches reuse the counters, also back to back
    in a CUDA graph (where the panel's programs do spin while attention runs)."""

    def tuned(poll):
        return KernelConfig(attention=AttentionTuning(fold=fold, poll=poll))

    gen = torch.Generator().manual_seed(5 + rows + max_splits)
    heads, kvh, d, bs, dtype = 16, 8, 128, 16, torch.bfloat16
    seq = [1000 + rows]
    max_blocks = -(-seq[0] // bs) + 1
    nb = max_blocks + 3
    kc0, vc0 = paged_kv(nb, bs, kvh, d, dtype, DEV, gen)
    bt = block_table_for(seq, bs, max_blocks, nb, gen, DEV)
    cu = torch.tensor([0, rows], dtype=torch.int32, device=DEV)
    qkv = torch.randn(rows, (heads + 2 * kvh) * d, generator=gen).to(dtype=dtype, device=DEV)
    q, k, v = split_qkv(qkv, heads, kvh, d)
    cs = cos_sin_table(d, DEV)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=DEV)
    plan = ops.SplitPlan(max_splits=max_splits, block_n=64, min_split_len=16)
    wo = (0.02 * torch.randn(heads * d, heads * d, generator=gen)).to(dtype=dtype, device=DEV)
    nw = (1 + 0.1 * torch.randn(heads * d, generator=gen)).to(dtype=dtype, device=DEV)
    h0 = torch.randn(rows, heads * d, generator=gen).to(dtype=dtype, device=DEV)
    results = []
    for poll in (False, True, True):
        tune = tuned(poll)
        kc, vc, h = kc0.clone(), vc0.clone(), h0.clone()
        sig = ops.attention_signal(h, wo, tune)
        assert (sig is None) == (not poll)
        out = ops.paged_attention(q, kc, vc, bt, seq_t, rows, d ** -0.5, cu_q_lens=cu, plan=plan,
                                  rope=(k, v, cs, None), signal=sig, tune=tune)
        if sig is not None:
            expect = (1 * kvh if max_splits == 1 or fold == "on"
                      else (rows + rows) * heads)  # reduce grid: rows + packed tail rows
            assert sig.target == expect
        dn = ops.linear_deferred_norm(out.reshape(rows, heads * d), wo, h, nw, 1e-6,
                                      residual_settled=True, after=sig, tune=tune)
        torch.cuda.synchronize()
        if sig is not None:
            assert sig.counters.tolist() == [0, 0]
        results.append((out, h, dn.xw, dn.ss))
    for got in results[1:]:
        for a, b in zip(results[0], got, strict=True):
            assert torch.equal(a, b)
    graphs = []
    for poll in (False, True):
        tune = tuned(poll)
        kc, vc, h = kc0.clone(), vc0.clone(), h0.clone()

        def layer_pairs(kc=kc, vc=vc, h=h, tune=tune):
            for _ in range(6):  # same new rows each time: the KV writes repeat, h accumulates
                sig = ops.attention_signal(h, wo, tune)
                out = ops.paged_attention(q, kc, vc, bt, seq_t, rows, d ** -0.5, cu_q_lens=cu,
                                          plan=plan, rope=(k, v, cs, None), signal=sig,
                                          tune=tune)
                dn = ops.linear_deferred_norm(out.reshape(rows, heads * d), wo, h, nw, 1e-6,
                                              residual_settled=True, after=sig, tune=tune)
            return dn

        layer_pairs()  # warm (compiles, counters allocated outside the capture)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dn = layer_pairs()
        h.copy_(h0)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        graphs.append((h.clone(), dn.xw.clone(), dn.ss.clone()))
        if poll:
            assert ops.attention_signal(h, wo, tune).counters.tolist() == [0, 0]
    for a, b in zip(*graphs, strict=True):
        assert torch.equal(a, b)


def test_index_kernels_compile_once_for_every_bucket():
    """Cold start: the verify token / metadata kernels compile one specialization for every
    (Bcap, k, G) of a default grid up to 16 requests (``verify_tokens.index_blocks``, shape
    integers not specialised), not one per shape (48 of dense-2b's 133 precompiled kernels)."""
    if DEV == "cpu":
        pytest.skip("the interpreter keeps no compiled specializations")
    from speccal.kernels.verify_metadata import _verify_metadata_kernel
    from speccal.kernels.verify_tokens import _verify_token_kernel

    def specializations(kernel):
        return sum(len(caches[0]) for caches in kernel.device_caches.values())

    before = (specializations(_verify_token_kernel), specializations(_verify_metadata_kernel))
    for batch in (1, 2, 4, 8, 16):
        for k_max in (1, 2, 3, 5):
            g = batch * (k_max + 1)
            if g > 64:  # past index_blocks' one-compile sizes
                continue
            base, drafts, vl, ctx, bt = _verify_inputs(batch * 7 + k_max, batch, k_max, g)
            base, drafts, vl, ctx, bt = (x.to(DEV) for x in (base, drafts, vl, ctx, bt))
            ids = torch.empty(g, dtype=torch.int64, device=DEV)
            ops.verify_token_update(base, drafts, vl, ids, pad_id=-1, backend="triton")
            pos = torch.empty(g, dtype=torch.int64, device=DEV)
            slots = torch.empty(g, dtype=torch.int64, device=DEV)
            seq = torch.empty(batch, dtype=torch.int32, device=DEV)
            cu = torch.empty(batch + 1, dtype=torch.int32, device=DEV)
            ops.verify_metadata_update(vl, ctx, bt, 16, pos, slots, seq, cu, k_max, max_cu=g,
                                       backend="triton")
    after = (specializations(_verify_token_kernel), specializations(_verify_metadata_kernel))
    # at most one new specialization each (none if an earlier test compiled the same flag set)
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1, (before, after)
