"""The fused decode layer (``DecoderLayer.forward_fused``) against the unfused torch layer, on CPU.

``forward_fused`` is the launch plan of the Triton path (residual adds and SwiGLU in GEMV
epilogues over interleaved gate/up rows, q/k norm + rotary + KV write in one op); on CPU tensors
every op it calls runs its pure-torch reference, so the composition is checked here and the
kernels on the GPU (tests/kernels).
"""

from __future__ import annotations

import pytest
import torch

from speccal.runner.attention import AttnMeta
from speccal.runner.config import ModelConfig
from speccal.runner.layers import DecoderLayer, RMSNorm
from speccal.runner.model import TargetModel
from speccal.runner.rope import RotaryTable


def _layer(qk_norm: bool, bias: bool) -> tuple[DecoderLayer, RotaryTable, ModelConfig]:
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      is_qk_norm=qk_norm, is_qkv_bias=bias)
    torch.manual_seed(3)
    layer = DecoderLayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    layer.self_attn.fuse_weights()
    layer.mlp.fuse_weights()
    return layer, RotaryTable(cfg, 512, 512), cfg


def _packed_meta(ctx, rows, block_size=4, max_blocks=16):
    """Requests with ``ctx[b]`` cached tokens sending ``rows[b]`` new rows, packed, + 1 pad row."""
    slots, pos = [], []
    bt = torch.zeros(len(ctx), max_blocks, dtype=torch.int32)
    for b, (c, r) in enumerate(zip(ctx, rows, strict=True)):
        blocks = torch.arange(1 + b * max_blocks, 1 + (b + 1) * max_blocks)[: max_blocks]
        bt[b] = blocks.to(torch.int32)
        for i in range(r):
            p = c + i
            pos.append(p)
            slots.append(int(blocks[p // block_size]) * block_size + p % block_size)
    pos.append(0)
    slots.append(0)  # padding row -> sentinel slot
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([c + r for c, r in zip(ctx, rows, strict=True)], dtype=torch.int32)
    meta = AttnMeta(torch.tensor(slots), None, bt, seq, max(rows), cu)
    nb = 1 + len(ctx) * max_blocks
    return meta, torch.tensor(pos), nb


def _case(cfg: ModelConfig, seed: int):
    """Two requests' packed rows (3 + 1, one padding row), a random paged KV cache and input."""
    meta, pos, nb = _packed_meta(ctx=[5, 11], rows=[3, 1])
    gen = torch.Generator().manual_seed(seed)
    shape = (nb, 4, cfg.num_key_value_heads, cfg.head_dim)
    kv0 = [torch.randn(shape, generator=gen) for _ in range(2)]
    return meta, pos, kv0, torch.randn(pos.shape[0], cfg.hidden_size, generator=gen)


@pytest.mark.parametrize("fuse_rope", [False, True])
@pytest.mark.parametrize("qk_norm, bias", [(True, False), (False, True)])
def test_forward_fused_matches_unfused_layer(qk_norm, bias, fuse_rope):
    layer, rotary, cfg = _layer(qk_norm, bias)
    meta, pos, kv0, x = _case(cfg, 0)
    kv_ref = [t.clone() for t in kv0]
    with torch.no_grad():
        want = layer(x, pos, meta, tuple(kv_ref), rotary)  # torch path: not fused on CPU
        kv_fused = [t.clone() for t in kv0]
        h = x.clone()
        got = layer.forward_fused(h, pos, meta, tuple(kv_fused), rotary, fuse_rope=fuse_rope)
    assert got is h  # the residual stream is updated in place
    real = slice(0, int(meta.cu_q_lens[-1]))
    torch.testing.assert_close(got[real], want[real], rtol=2e-4, atol=2e-4)
    for a, b in zip(kv_fused, kv_ref, strict=True):
        torch.testing.assert_close(a[1:], b[1:], rtol=2e-4, atol=2e-4)  # block 0: the sentinel


def test_can_fuse_needs_the_triton_path():
    layer, rotary, _ = _layer(True, False)
    assert not layer.can_fuse(torch.zeros(1, 64), rotary)  # CPU tensor: torch path


def test_fuse_weights_keeps_every_parameter_and_the_output():
    """``fuse_weights`` interleaves gate/up rows and concatenates q/k/v; the parameters stay
    (strided) views with their values, so the unfused path computes exactly what it did."""
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      is_qk_norm=True)
    torch.manual_seed(5)
    layer = DecoderLayer(cfg)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(3, 64)
    with torch.no_grad():
        y0 = layer.mlp(x)
        layer.self_attn.fuse_weights()
        layer.mlp.fuse_weights()
        y1 = layer.mlp(x)
    after = layer.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    gu = layer.mlp.gate_up_weight
    assert torch.equal(gu[0::2], before["mlp.gate_proj.weight"])
    assert torch.equal(gu[1::2], before["mlp.up_proj.weight"])
    assert layer.mlp.gate_proj.weight.data_ptr() == gu.data_ptr()  # a view, not a copy
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)


def test_fused_layer_takes_its_normed_input_and_writes_the_next_norm():
    """``normed``: the input norm computed by the layer before; ``next_norm``: the down GEMV's
    reduce also writes that norm of the updated residual (the next layer's input)."""
    layer, rotary, cfg = _layer(True, False)
    meta, pos, kv0, x = _case(cfg, 1)
    nxt = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    with torch.no_grad():
        nxt.weight.uniform_(0.5, 1.5)
        want = layer.forward_fused(x.clone(), pos, meta, tuple(t.clone() for t in kv0), rotary,
                                   fuse_rope=True)
        h, out = x.clone(), torch.full_like(x, float("nan"))
        normed = layer.input_layernorm(h)
        got = layer.forward_fused(h, pos, meta, tuple(t.clone() for t in kv0), rotary,
                                  fuse_rope=True, normed=normed, next_norm=(nxt, out))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, nxt(got), rtol=1e-5, atol=1e-5)


def _model_case():
    """A 3-layer fused target, packed rows of two requests (+ 1 padding row), KV, token ids."""
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      is_qk_norm=True)
    torch.manual_seed(8)
    model = TargetModel(cfg, 512, 512)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.fuse_weights()
    meta, pos, nb = _packed_meta(ctx=[5, 11], rows=[3, 1])
    gen = torch.Generator().manual_seed(2)
    shape = (nb, 4, cfg.num_key_value_heads, cfg.head_dim)
    kv0 = [[torch.randn(shape, generator=gen) for _ in range(2)] for _ in range(3)]
    ids = torch.randint(0, 64, pos.shape, generator=gen)
    return model, meta, pos, kv0, ids


def _kv(kv0):
    return [tuple(t.clone() for t in kv) for kv in kv0]


def test_fused_model_forward_matches_the_torch_forward():
    """``TargetModel._forward_fused`` (the launch plan of decode / verify rows: the embedding
    gather with layer 0's norm, then each down reduce writing the next norm, the last one the
    final norm) computes what the torch forward does."""
    model, meta, pos, kv0, ids = _model_case()
    with torch.no_grad():
        want = model(ids, pos, meta, _kv(kv0))
        got = model._forward_fused(ids, pos, meta, _kv(kv0))
    real = slice(0, int(meta.cu_q_lens[-1]))
    torch.testing.assert_close(got[real], want[real], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("defer", ["o", "all", "off", "rows"])
def test_fused_forward_gathers_the_embedding_inside_the_first_norm(defer, monkeypatch,
                                                                   fused_on_cpu):
    """On the fused path ``forward`` runs no embedding module and no norm launch of its own:
    one ``ops.embed_rms_norm`` writes the residual stream (the embedding rows, which the layers
    then update in place) and layer 0's normed input. The post-attention norm is deferred into
    the o / gate-up GEMVs (``NormFusion(defer="o")``), with ``all`` also the next input norm
    into the down / next QKV GEMVs, with ``rows`` (the default) that too for this case's 5 rows
    (2-8 rows), or they are launched / reduced (``off``). The
    Triton path is simulated on CPU (every op runs its reference), so this checks the launch
    plan, not the kernels."""
    from speccal.kernels import ops
    from speccal.kernels.config import KernelConfig, NormFusion
    from speccal.runner.path import bind_path

    model, meta, pos, kv0, ids = _model_case()
    with torch.no_grad():
        want = model(ids, pos, meta, _kv(kv0))  # the torch path (CPU tensors)
    bind_path(model, fused_on_cpu(KernelConfig(norm=NormFusion(defer=defer))))
    calls = {"embed_rms_norm": [], "rms_norm": 0, "deferred": 0}
    real_embed, real_norm, real_defer = ops.embed_rms_norm, ops.rms_norm, ops.linear_deferred_norm

    def spy_defer(*args, **kwargs):
        calls["deferred"] += 1
        return real_defer(*args, **kwargs)


    def spy_embed(*args, **kwargs):
        out = real_embed(*args, **kwargs)
        calls["embed_rms_norm"].append(out)
        return out

    def spy_norm(*args, **kwargs):
        calls["rms_norm"] += 1
        return real_norm(*args, **kwargs)

    def no_embedding(*args, **kwargs):
        raise AssertionError("the fused path must not run the embedding module")

    monkeypatch.setattr(ops, "embed_rms_norm", spy_embed)
    monkeypatch.setattr(ops, "rms_norm", spy_norm)
    monkeypatch.setattr(ops, "linear_deferred_norm", spy_defer)
    monkeypatch.setattr(model.model.embed_tokens, "forward", no_embedding)
    with torch.no_grad():
        got = model(ids, pos, meta, _kv(kv0))
    assert len(calls["embed_rms_norm"]) == 1
    # per layer only the post-attention norm may be a norm launch (the down reduce writes the
    # next); deferred, it is none
    layers = len(model.model.layers)
    assert calls["rms_norm"] == (layers if defer == "off" else 0)
    # deferred: each o projection ("o"), and with "all" (and "rows" at 5 rows) each down
    # projection but the last (its reduce writes the final norm for the LM head)
    assert calls["deferred"] == {"o": layers, "all": 2 * layers - 1, "rows": 2 * layers - 1,
                                 "off": 0}[defer]
    h, _ = calls["embed_rms_norm"][0]
    assert not torch.equal(h, model.model.embed_tokens.weight[ids])  # updated in place by layers
    real = slice(0, int(meta.cu_q_lens[-1]))
    torch.testing.assert_close(got[real], want[real], rtol=2e-4, atol=2e-4)
