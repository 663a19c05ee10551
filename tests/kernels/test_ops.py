"""CPU tests of the dispatcher: validation errors, reference fallback, lazy triton import."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from speccal.base.errors import InputError, UnsupportedError
from speccal.kernels import _backend, ops
from speccal.kernels import gemv_config as gc
from speccal.kernels import reference as ref
from speccal.kernels.config import (
    DEFAULT_KERNELS,
    AttentionTuning,
    GemvOverride,
    GemvTuning,
    KernelConfig,
    NormFusion,
    PdlConfig,
)


def test_kernels_import_without_triton_and_cpu_uses_reference():
    """With triton unimportable (``sys.modules['triton'] = None``, also where it is installed)
    the ops import and run their references on CPU, no Triton kernel module imported."""
    code = (
        "import sys; sys.modules['triton'] = None; import speccal.kernels.ops as o; import torch;"
        "x = torch.randn(2, 8); w = torch.randn(3, 8);"
        "y = o.linear(x, w); assert torch.allclose(y, x @ w.T);"
        "print(o.use_triton(x), 'speccal.kernels.gemv' in sys.modules)"
    )
    env_code = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True)
    assert env_code.stdout.split() == ["False", "False"]


def test_update_ops_reject_bad_buffers():
    base = torch.tensor([1, 2])
    drafts = torch.tensor([[3, 4], [5, 6]])
    vl = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(InputError):
        ops.verify_token_update(base, drafts, vl, torch.zeros(8, dtype=torch.float32))
    with pytest.raises(InputError):
        ops.verify_token_update(base[:1], drafts, vl, torch.zeros(8, dtype=torch.int64))
    ctx = torch.tensor([3, 4], dtype=torch.int32)
    bt = torch.ones(2, 4, dtype=torch.int32)
    pos, slots = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    seq, cu = torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(InputError) as err:
        ops.verify_metadata_update(vl, ctx, bt, 16, pos, slots.int(), seq, cu, 2)
    assert err.value.field == "slot_mapping.dtype"
    with pytest.raises(InputError) as err:
        ops.verify_metadata_update(vl, ctx, bt, 16, pos, slots, seq, cu[:2], 2)
    assert err.value.field == "cu_q_lens.shape"
    with pytest.raises(InputError, match="grid_rows"):
        ops.verify_metadata_update(vl, ctx, bt, 16, pos, slots, seq, cu, 2,
                                   grid_rows=torch.zeros(3, dtype=torch.int64))
    ops.verify_metadata_update(vl, ctx, bt, 16, pos, slots, seq, cu, 2)
    assert seq.tolist() == [5, 7] and cu.tolist() == [0, 2, 5]


def test_verify_token_update_base_index():
    """``base_index`` gathers the base tokens from a flat view of ``base_tokens`` (the slot state)
    in the op itself; its shape/dtype and the gathered tensor's layout are checked."""
    ext = torch.arange(100, 112).view(4, 3)  # [slots, w + 1]
    drafts = torch.tensor([[3, 4], [5, 6]])
    vl = torch.tensor([1, 2], dtype=torch.int32)
    index = torch.tensor([5, 9])
    ids = torch.zeros(6, dtype=torch.int64)
    assert ops.verify_token_update(ext, drafts, vl, ids, base_index=index) is ids
    assert ids.tolist() == [105, 3, 109, 5, 6, -1]
    with pytest.raises(InputError) as err:
        ops.verify_token_update(ext, drafts, vl, ids, base_index=index[:1])
    assert err.value.field == "base_index.shape"
    with pytest.raises(InputError) as err:
        ops.verify_token_update(ext, drafts, vl, ids, base_index=index.float())
    assert err.value.field == "base_index.dtype"
    with pytest.raises(InputError) as err:
        ops.verify_token_update(ext.float(), drafts, vl, ids, base_index=index)
    assert err.value.field == "base_tokens.dtype"
    with pytest.raises(InputError, match="contiguous") as err:
        ops.verify_token_update(ext.t(), drafts, vl, ids, base_index=index)
    assert err.value.field == "base_tokens"
    with pytest.raises(InputError) as err:  # without an index the base tokens are [B]
        ops.verify_token_update(ext, drafts, vl, ids)
    assert err.value.field == "base_tokens.shape"


def test_verify_metadata_update_max_cu():
    """``max_cu`` caps ``cu_q_lens`` in the op (the runner's former ``cu.clamp_(max=G)``)."""
    vl = torch.tensor([2, 2, 1], dtype=torch.int32)
    ctx = torch.tensor([3, 4, 0], dtype=torch.int32)
    bt = torch.ones(3, 4, dtype=torch.int32)
    pos, slots = torch.zeros(7, dtype=torch.int64), torch.zeros(7, dtype=torch.int64)
    seq, cu = torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    ops.verify_metadata_update(vl, ctx, bt, 16, pos, slots, seq, cu, 2)
    assert cu.tolist() == [0, 3, 6, 8]
    ops.verify_metadata_update(vl, ctx, bt, 16, pos, slots, seq, cu, 2, max_cu=7)
    assert cu.tolist() == [0, 3, 6, 7] and seq.tolist() == [6, 7, 2]
    for bad in (-1, 2.5, 2**31):
        with pytest.raises(InputError) as err:
            ops.verify_metadata_update(vl, ctx, bt, 16, pos, slots, seq, cu, 2, max_cu=bad)
        assert err.value.field == "max_cu"


def _embed_args():
    gen = torch.Generator().manual_seed(4)
    return dict(input_ids=torch.tensor([3, 0, 9], dtype=torch.int32),
                table=torch.randn(10, 8, generator=gen), weight=torch.rand(8, generator=gen),
                eps=1e-6)


def test_embed_rms_norm_fills_its_outputs_like_embedding_then_rms_norm():
    a = _embed_args()
    out_h = torch.full((3, 8), float("nan"))
    out = torch.full((3, 8), float("nan"))
    h, y = ops.embed_rms_norm(**a, out_h=out_h, out=out)
    assert h is out_h and y is out
    want_h = torch.nn.functional.embedding(a["input_ids"].long(), a["table"])
    assert torch.equal(h, want_h)
    assert torch.equal(y, ops.rms_norm(want_h, a["weight"], a["eps"]))
    h2, y2 = ops.embed_rms_norm(**a)  # allocated outputs
    assert torch.equal(h2, h) and torch.equal(y2, y)


@pytest.mark.parametrize("change, field", [
    (dict(input_ids=torch.tensor([1.0, 2.0])), "input_ids.dtype"),
    (dict(input_ids=torch.tensor([[1, 2]])), "input_ids.shape"),
    (dict(input_ids=torch.zeros(0, dtype=torch.int64)), "input_ids.shape"),
    (dict(table=torch.randn(80)), "table.shape"),
    (dict(table=torch.zeros(10, 8, dtype=torch.int64)), "table.dtype"),
    (dict(table=torch.randn(8, 10).t()), "table"),
    (dict(weight=torch.rand(7)), "weight.shape"),
    (dict(weight=torch.ones(8, dtype=torch.int32)), "weight.dtype"),
    (dict(eps=0.0), "eps"),
    (dict(out_h=torch.zeros(3, 8, dtype=torch.float16)), "out_h"),
    (dict(out=torch.zeros(2, 8)), "out"),
])
def test_embed_rms_norm_rejects_bad_input(change, field):
    a = {**_embed_args(), **change}
    with pytest.raises(InputError) as err:
        ops.embed_rms_norm(**a)
    assert err.value.field == field


def test_small_ops_reject_bad_input_and_run_reference():
    x = torch.randn(2, 8)
    with pytest.raises(InputError):
        ops.linear(x, torch.randn(3, 7))
    with pytest.raises(InputError):
        ops.rms_norm(x, torch.randn(7), 1e-6)
    res = torch.randn(2, 8)
    h = x + res
    y = ops.rms_norm(x, torch.ones(8), 1e-6, residual=res)
    assert torch.allclose(res, h)
    assert torch.allclose(y, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    q = torch.randn(3, 4, 8)
    kv = torch.randn(3, 2, 8)
    kc = torch.zeros(4, 4, 2, 8)
    with pytest.raises(InputError) as err:
        ops.rotary_kv_write(q, kv, kv, torch.zeros(3, dtype=torch.int64), torch.randn(9, 8),
                            torch.zeros(3, dtype=torch.int32), kc, kc.clone())
    assert err.value.field == "slot_mapping.dtype"


def test_linear_epilogues_compose_the_reference_ops():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, generator=gen)
    w = torch.randn(8, 32, generator=gen)
    res = torch.randn(3, 8, generator=gen)
    want = ops.linear(x, w) + res
    r = res.clone()
    got = ops.linear(x, w, residual=r)
    assert got is r
    torch.testing.assert_close(got, want)
    y = ops.linear(x, w)  # rows of w read as (gate_0, up_0, gate_1, up_1, ...)
    want = torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]
    torch.testing.assert_close(ops.linear(x, w, epilogue="silu_mul"), want)


def test_linear_norm_writes_the_next_layers_input():
    """``norm=(w, eps, out)``: the residual is updated as without it and ``out`` is the RMSNorm
    of the updated residual (what the separate norm op computes from it)."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 32, generator=gen), torch.randn(8, 32, generator=gen)
    res, nw = torch.randn(3, 8, generator=gen), torch.rand(8, generator=gen) + 0.5
    want = ops.linear(x, w, residual=res.clone())
    r, xn = res.clone(), torch.full((3, 8), float("nan"))
    got = ops.linear(x, w, residual=r, norm=(nw, 1e-6, xn))
    assert got is r
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(xn, ops.rms_norm(want, nw, 1e-6))


@pytest.mark.parametrize("kwargs, field", [
    ({"norm": (torch.ones(8), 1e-6, torch.empty(3, 8))}, "norm"),  # no residual
    ({"residual": torch.empty(3, 8), "norm": (torch.ones(7), 1e-6, torch.empty(3, 8))},
     "norm[0]"),
    ({"residual": torch.empty(3, 8), "norm": (torch.ones(8), 0.0, torch.empty(3, 8))}, "norm[1]"),
    ({"residual": torch.empty(3, 8), "norm": (torch.ones(8), 1e-6, torch.empty(2, 8))},
     "norm[2]"),
    ({"residual": torch.empty(3, 8), "norm": [torch.ones(8), 1e-6, torch.empty(3, 8)]}, "norm"),
])
def test_linear_norm_arguments_are_checked(kwargs, field):
    with pytest.raises(InputError) as err:
        ops.linear(torch.randn(3, 32), torch.randn(8, 32), **kwargs)
    assert err.value.field.startswith(field)


@pytest.mark.parametrize("kwargs, field", [
    ({"epilogue": "gelu"}, "epilogue"),
    ({"epilogue": "silu_mul", "residual": torch.empty(3, 8)}, "residual"),
    ({"epilogue": "silu_mul", "out": torch.empty(3, 8)}, "out"),  # out is [M, N / 2]
    ({"out": torch.empty(3, 8), "residual": torch.empty(3, 8)}, "out"),
    ({"residual": torch.empty(3, 9)}, "residual"),
])
def test_linear_epilogue_arguments_are_checked(kwargs, field):
    with pytest.raises(InputError) as err:
        ops.linear(torch.randn(3, 32), torch.randn(8, 32), **kwargs)
    assert field in str(err.value)


def test_rotary_q_out_and_qk_norm_are_checked():
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    cache = torch.zeros(4, 4, 2, 8)
    args = (q, k, k.clone(), torch.zeros(2, dtype=torch.int64), torch.randn(16, 8),
            torch.zeros(2, dtype=torch.int64), cache, cache.clone())
    with pytest.raises(InputError, match="q_out"):
        ops.rotary_kv_write(*args, q_out=torch.empty(2, 4, 4))
    with pytest.raises(InputError, match="qk_norm"):
        ops.rotary_kv_write(*args, qk_norm=(torch.ones(8), torch.ones(4), 1e-6))


@pytest.mark.parametrize("mode, level", [("off", 0), ("early", 1), ("late", 2), (None, 2)])
def test_pdl_level_defaults_to_late_and_never_on_cpu(mode, level, monkeypatch):
    """``PdlConfig.mode`` selects the programmatic-dependent-launch level (default ``late``) on
    devices of compute capability >= 9.0; CPU tensors and older devices never use it."""
    tune = KernelConfig() if mode is None else KernelConfig(pdl=PdlConfig(mode=mode))
    assert tune.pdl.level == level
    assert _backend.pdl_level(torch.zeros(1), tune) == 0

    class _FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 0)

    monkeypatch.setattr(_backend, "_pdl_device", lambda index: True)
    assert _backend.pdl_level(_FakeCuda(), tune) == level
    monkeypatch.setattr(_backend, "_pdl_device", lambda index: False)  # before sm_90
    assert _backend.pdl_level(_FakeCuda(), tune) == 0


def test_prewait_and_prefetch_switches():
    """``KernelConfig.prewait`` (default on) and ``GemvTuning.prefetch_tiles`` (default 2; 0
    turns it off) take their documented values and refuse others, naming the field."""
    assert KernelConfig().prewait is True and KernelConfig(prewait=False).prewait is False
    assert GemvTuning().prefetch_tiles == 2
    assert GemvTuning(prefetch_tiles=0).prefetch_tiles == 0
    assert GemvTuning(prefetch_tiles=3).prefetch_tiles == 3
    with pytest.raises(InputError, match="kernels.prewait"):
        KernelConfig(prewait="on")
    for bad in (-1, "2", 1.5):
        with pytest.raises(InputError, match="kernels.gemv.prefetch_tiles"):
            GemvTuning(prefetch_tiles=bad)


def test_the_gemv_launch_receives_the_configuration(monkeypatch):
    """What ``ops.linear`` hands the Triton GEMV (a stand-in recording its arguments, so this
    runs without triton): the configuration itself, its prefetch depth, and the caller's
    ``residual_settled`` only where ``prewait`` is on."""
    calls = []
    fake = types.ModuleType("speccal.kernels.gemv")
    fake.linear_triton = lambda x, w, **kw: calls.append(kw) or x
    monkeypatch.setitem(sys.modules, "speccal.kernels.gemv", fake)
    monkeypatch.setattr(ops, "use_triton", lambda t, backend: backend != "reference")
    x, w = torch.zeros(2, 8), torch.zeros(8, 8)
    for tune in (DEFAULT_KERNELS, KernelConfig(prewait=False, gemv=GemvTuning(prefetch_tiles=5))):
        ops.linear(x, w, residual=torch.zeros(2, 8), residual_settled=True, tune=tune)
        assert calls[-1]["tune"] is tune and calls[-1]["pdl"] == 0  # CPU: no PDL
        assert calls[-1]["prefetch"] == tune.gemv.prefetch_tiles
        assert calls[-1]["residual_settled"] is tune.prewait
    ops.linear(x, w, tune=KernelConfig(backend="reference"))
    assert len(calls) == 2


def test_backend_switches_refuse_unknown_values():
    """A mistyped PDL mode / backend / fold switch is an error, not 'off'; ``backend="triton"``
    on a CPU tensor is refused, and the ``backend=`` argument overrides the configuration's."""
    with pytest.raises(InputError, match="kernels.pdl.mode"):
        PdlConfig(mode="yes")
    with pytest.raises(InputError, match="kernels.attention.fold"):
        AttentionTuning(fold="yes")
    with pytest.raises(InputError, match="kernels.backend"):
        KernelConfig(backend="refernce")
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with pytest.raises(InputError, match="backend"):
        ops.linear(x, w, backend="cuda")
    with pytest.raises(UnsupportedError, match="triton"):
        ops.linear(x, w, tune=KernelConfig(backend="triton"))
    y = ops.linear(x, w, backend="reference", tune=KernelConfig(backend="triton"))
    assert torch.allclose(y, x @ w.T)


@pytest.mark.parametrize("k", [0, 1, 5])
@pytest.mark.parametrize("greedy", [True, False])
def test_verify_accept_reference_matches_oracle(k, greedy):
    """Greedy / forced acceptance from the packed rows' argmax and the slot-state writes (the
    fused end of a round) equal the loop oracle; untouched slots keep their poison."""
    from kernel_builders import accept_case, accept_oracle

    args = accept_case(3 + k + greedy, 6, k, 6 * (k + 1) + 2, 32, torch.float32, "cpu")
    want_args = [a.clone() for a in args]
    na, out = ops.verify_accept(*args, greedy=greedy)
    want_na, want_out = accept_oracle(*want_args, greedy=greedy)
    assert torch.equal(na, want_na) and torch.equal(out, want_out)
    assert torch.equal(args[6], want_args[6])
    assert torch.equal(args[7].nan_to_num(-3.0), want_args[7].nan_to_num(-3.0))
    if greedy and k:
        assert len(set(na.tolist())) > 1  # the case exercises several stopping points


def test_verify_accept_refuses_bad_input():
    """Shapes and dtypes of the fused acceptance are checked, naming the field."""
    from kernel_builders import accept_case

    args = accept_case(1, 4, 3, 20, 16, torch.float32, "cpu")
    bad = {1: args[1][:-1], 6: args[6].int(), 7: args[7][:, :2], 0: args[0].float()}
    names = {1: "grid_rows", 6: "ext_tokens", 7: "ext_hidden", 0: "row_tokens"}
    for i, value in bad.items():
        call = list(args)
        call[i] = value
        with pytest.raises(InputError, match=names[i]):
            ops.verify_accept(*call)


@pytest.mark.parametrize("m", [1, 6, 48])
def test_linear_argmax_reference_uses_the_gemv_tile_width(m):
    """The op's partials use the argmax GEMV config's tile (the heuristic forces split 1 with
    the same program count) and reduce to torch.argmax of ``linear``'s output."""
    from kernel_builders import argmax_case

    from speccal.kernels.gemv_config import pick_config

    n, k = 1000, 64
    width = ops.argmax_tile_width(m, n, k)
    assert width == pick_config(m, n, k, epilogue="argmax").block_n
    assert pick_config(m, n, 2048).split_k == 4  # a split-K shape: split 1, 4x the programs
    assert ops.argmax_tile_width(m, n, 2048) == pick_config(m, n, 2048).block_n // 4
    assert ops.argmax_tile_width(4, 151936, 2048) == 64  # the tuned LM head configs
    assert ops.argmax_tile_width(48, 151936, 2048) == 128
    x, w, special = argmax_case(m, m, n, k, torch.bfloat16, "cpu", width)
    tile_max, tile_idx = ops.linear_argmax(x, w)
    want = ref.linear_argmax_ref(x, w, width)
    assert torch.equal(tile_idx, want[1])
    assert torch.equal(tile_max.nan_to_num(1.5), want[0].nan_to_num(1.5))
    tokens = ref.reduce_argmax_partials_ref(tile_max, tile_idx)
    assert torch.equal(tokens, ops.linear(x, w).argmax(dim=-1))
    assert all(int(tokens[r]) == c for r, c in special.items())
    from speccal.kernels.gemv_config import GemvConfig

    got = ops.linear_argmax(x, w, config=GemvConfig(block_n=32))
    assert got[0].shape == (m, -(-n // 32))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"w": torch.randn(8, 31)}, "x/weight shapes"),
    ({"w": torch.randn(8, 32, dtype=torch.float64)}, "x/weight dtype"),
    ({"w": torch.randn(32, 8).t()}, "x/weight"),
    ({"x": torch.randn(0, 32)}, "x/weight shapes"),
    ({"config": "64"}, "config"),
    ({"config": "split"}, "config.split_k"),
])
def test_linear_argmax_rejects_bad_input(kwargs, field):
    from speccal.kernels.gemv_config import GemvConfig

    args = {"x": torch.randn(3, 32), "w": torch.randn(8, 32), "config": None} | kwargs
    if args["config"] == "split":
        args["config"] = GemvConfig(split_k=2)
    with pytest.raises(InputError) as err:
        ops.linear_argmax(args["x"], args["w"], config=args["config"])
    assert err.value.field == field


def _partials_for(row_tok, vocab, block_n, seed):
    from kernel_builders import logits_for_tokens

    logits = logits_for_tokens(row_tok, vocab, torch.Generator().manual_seed(seed))
    assert torch.equal(logits.argmax(-1), row_tok)
    return ref.argmax_partials_ref(logits, block_n)


@pytest.mark.parametrize("k", [0, 1, 5])
@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("vocab, block_n", [(200, 16), (301, 1)])
def test_verify_accept_takes_argmax_partials(k, greedy, vocab, block_n):
    """Acceptance from per-tile partials equals acceptance from the row tokens (ties across
    tiles, NaN rows, a last tile shorter than the rest) and the loop oracle."""
    from kernel_builders import accept_case, accept_oracle

    args = accept_case(5 + k, 6, k, 6 * (k + 1) + 2, 32, torch.float32, "cpu")
    partials = _partials_for(args[0], vocab, block_n, k)
    want_args = [a.clone() for a in args]
    na, out = ops.verify_accept(partials, *args[1:], greedy=greedy)
    want_na, want_out = accept_oracle(*want_args, greedy=greedy)
    assert torch.equal(na, want_na) and torch.equal(out, want_out)
    assert torch.equal(args[6], want_args[6])
    assert torch.equal(args[7].nan_to_num(-3.0), want_args[7].nan_to_num(-3.0))


@pytest.mark.parametrize("k", [0, 5])
def test_verify_accept_takes_argmax_keys(k):
    """Acceptance from the LM head's packed keys (``linear_argmax(keys=...)`` on the reference
    path, the keys zeroed by ``verify_metadata_update(argmax_keys=...)``) equals acceptance from
    the row tokens; a stale buffer (not zeroed) keeps the larger old keys, which is why the
    metadata update zeroes it."""
    from kernel_builders import accept_case, accept_oracle

    args = accept_case(3 + k, 6, k, 6 * (k + 1), 32, torch.float32, "cpu")
    g = args[5].shape[0]
    x = torch.randn(g, 16)
    w = torch.randn(300, 16)
    args[0] = ref.linear_ref(x, w).argmax(-1)
    keys = torch.full((g,), -1, dtype=torch.int64)  # stale: the largest unsigned key
    vl = torch.zeros(2, dtype=torch.int32)
    meta = (torch.zeros(2, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), 16,
            torch.empty(g, dtype=torch.int64), torch.empty(g, dtype=torch.int64),
            torch.empty(2, dtype=torch.int32), torch.empty(3, dtype=torch.int32), 0)
    stale = ops.linear_argmax(x, w, keys=keys.clone())
    assert bool((stale.keys == -1).all())
    ops.verify_metadata_update(vl, *meta, argmax_keys=keys)
    assert int(keys.abs().sum()) == 0
    packed = ops.linear_argmax(x, w, keys=keys)
    assert isinstance(packed, ops.ArgmaxKeys) and packed.keys is keys
    assert torch.equal(packed.tokens(), args[0])
    want_args = [a.clone() for a in args]
    na, out = ops.verify_accept(packed, *args[1:])
    want_na, want_out = accept_oracle(*want_args, greedy=True)
    assert torch.equal(na, want_na) and torch.equal(out, want_out)
    assert torch.equal(args[6], want_args[6])


def test_argmax_keys_refuse_bad_buffers():
    """A keys buffer of the wrong length, dtype or layout is refused by name."""
    from kernel_builders import accept_case

    x, w = torch.randn(4, 16), torch.randn(50, 16)
    for bad, field in [(torch.zeros(3, dtype=torch.int64), "keys"),
                       (torch.zeros(4, dtype=torch.int32), "keys"),
                       (torch.zeros(4, 2, dtype=torch.int64)[:, 0], "keys")]:
        with pytest.raises(InputError, match=field) as err:
            ops.linear_argmax(x, w, keys=bad)
        assert err.value.field == field
    args = accept_case(2, 4, 3, 20, 16, torch.float32, "cpu")
    with pytest.raises(InputError, match="row_tokens.keys"):
        ops.verify_accept(ops.ArgmaxKeys(torch.zeros(19, dtype=torch.int64)), *args[1:])


def test_verify_accept_refuses_bad_partials():
    """The partials tuple is checked: arity, shapes against G and each other, dtypes, layout."""
    from kernel_builders import accept_case

    args = accept_case(2, 4, 3, 20, 16, torch.float32, "cpu")
    tile_max, tile_idx = _partials_for(args[0], 100, 16, 0)
    bad = [
        ((tile_max, tile_idx, tile_idx), "row_tokens"),
        ((tile_max[:-1], tile_idx[:-1]), r"row_tokens\[0\] \(tile_max\).shape"),
        ((tile_max[:, :0], tile_idx[:, :0]), r"row_tokens\[0\] \(tile_max\).shape"),
        ((tile_max.half(), tile_idx), r"row_tokens\[0\] \(tile_max\).dtype"),
        ((tile_max, tile_idx.long()), r"row_tokens\[1\] \(tile_idx\).dtype"),
        ((tile_max, tile_idx[:, :-1]), r"row_tokens\[1\] \(tile_idx\).shape"),
        ((tile_max.t().contiguous().t(), tile_idx), "row_tokens"),
        ((tile_idx, tile_idx), r"row_tokens\[0\] \(tile_max\).dtype"),
    ]
    for partials, field in bad:
        with pytest.raises(InputError, match=field) as err:
            ops.verify_accept(partials, *args[1:])
        assert err.value.field.startswith("row_tokens")


def test_deferred_norm_equals_the_norm_launch():
    """``linear_deferred_norm`` + ``linear(row_scale=...)`` give what ``linear(residual=h)``,
    ``rms_norm`` and the consumer GEMV give (fp32: up to rounding order), and the residual is
    updated in place exactly as the plain residual add does it."""
    gen = torch.Generator().manual_seed(5)
    m, k, n, inter = 3, 64, 48, 40
    x, h = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
    w_o, w_gu = torch.randn(n, k, generator=gen), torch.randn(2 * inter, n, generator=gen)
    nw = 1 + 0.1 * torch.randn(n, generator=gen)
    h1, h2 = h.clone(), h.clone()
    dn = ops.linear_deferred_norm(x, w_o, h1, nw, 1e-6)
    got = ops.linear(dn.xw, w_gu, epilogue="silu_mul", row_scale=dn)
    ops.linear(x, w_o, residual=h2)
    want = ops.linear(ops.rms_norm(h2, nw, 1e-6), w_gu, epilogue="silu_mul")
    assert torch.equal(h1, h2)
    assert dn.ss.shape == (m, 1) and dn.ss.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, field", [
    (dict(norm_weight=torch.ones(7)), "norm_weight"),
    (dict(eps=0.0), "eps"),
    (dict(residual=torch.zeros(3, 7)), "residual"),
    (dict(x=torch.zeros(3, 5)), "x/weight shapes"),
])
def test_deferred_norm_rejects_bad_input(change, field):
    args = dict(x=torch.zeros(3, 8), weight=torch.zeros(6, 8), residual=torch.zeros(3, 6),
                norm_weight=torch.ones(6), eps=1e-6)
    args.update(change)
    with pytest.raises(InputError, match=field):
        ops.linear_deferred_norm(**args)


def test_row_scale_rejects_bad_input():
    x, w = torch.zeros(3, 8), torch.zeros(6, 8)
    dn = ops.DeferredNorm(x, torch.ones(3, 2), 1e-6)
    with pytest.raises(InputError, match="row_scale"):
        ops.linear(x, w, row_scale=(x, 1e-6))
    with pytest.raises(InputError, match="row_scale"):
        ops.linear(x, torch.zeros(8, 8), residual=torch.zeros(3, 8), row_scale=dn)
    with pytest.raises(InputError, match="row_scale.ss"):
        ops.linear(x, w, row_scale=ops.DeferredNorm(x, torch.ones(2, 2), 1e-6))
    with pytest.raises(InputError, match="row_scale.ss"):
        ops.linear(x, w, row_scale=ops.DeferredNorm(x, torch.ones(3, 2, dtype=torch.float64),
                                                    1e-6))
    ops.linear(x, w, row_scale=dn)  # well-formed: runs


def test_norm_defer_switch():
    """``NormFusion.defer``: ``rows`` by default, ``o`` / ``all`` / ``off`` as set, else an
    error naming it; the input norm is deferred for 2-16 row steps under ``rows`` (the upper
    end ``input_defer_max``), always under ``all``, never under ``o`` or ``off``; the
    post-attention norm under every mode but ``off``."""
    rows = (1, 2, 6, 8, 9, 12, 16, 17, 24, 48)
    by_rows = [False] + [True] * 6 + [False] * 3
    norm = NormFusion()
    assert norm.defer == "rows" and norm.input_defer_max == 16 and norm.defer_post
    assert [norm.defer_input(r) for r in rows] == by_rows
    for value, expect in (("all", [True] * 10), ("o", [False] * 10), ("off", [False] * 10),
                          ("rows", by_rows)):
        norm = NormFusion(defer=value)
        assert norm.defer_post is (value != "off")
        assert [norm.defer_input(r) for r in rows] == expect
    v10 = NormFusion(input_defer_max=8)  # the v10 rule
    assert [v10.defer_input(r) for r in rows] == [False] + [True] * 3 + [False] * 6
    for bad in (0, -3, "8"):
        with pytest.raises(InputError, match="kernels.norm.input_defer_max"):
            NormFusion(input_defer_max=bad)
    for bad in ("1", "0", "none"):
        with pytest.raises(InputError, match="kernels.norm.defer"):
            NormFusion(defer=bad)


def test_arrival_counters_are_per_pool_and_reused():
    """One zeroed counter set per (pool, device), allocated once; too few slots give None."""
    dev = torch.device("cpu")
    a = _backend.arrival_counters("test-a", dev, 10, slots=64)
    assert a is not None and a.numel() == 64 and int(a.abs().sum()) == 0
    assert _backend.arrival_counters("test-a", dev, 64) is a
    assert _backend.arrival_counters("test-a", dev, 65) is None
    b = _backend.arrival_counters("test-b", dev, 1, slots=8)
    assert b is not a and b.numel() == 8


def test_register_panel_configs_and_switches():
    """The o projection's register panel: picked at <= PANEL_MAX_ROWS rows, replaced by the
    streaming config (column tile >= 16) where it is switched off (``GemvTuning.panel``) or
    its weights do not fit; the deferred norm's tile count follows the config a launch runs.
    ``panel_max_rows`` moves the row limit (a power of two <= 32)."""
    one = gc.pick_config(1, 2048, 2048, epilogue="residual")
    six = gc.pick_config(6, 2048, 2048, epilogue="residual")
    assert one.panel and six.panel and six.block_n == 16
    assert not gc.pick_config(gc.PANEL_MAX_ROWS + 1, 2048, 2048, epilogue="residual").panel
    twelve = gc.pick_config(12, 2048, 2048, epilogue="residual")  # B = 2 verification
    assert twelve.panel and gc.resolve(twelve, 12, 2048, 2) == twelve
    assert not gc.resolve(twelve, 24, 2048, 2).panel  # B = 4: past PANEL_MAX_ROWS, streams
    assert gc.pick_config(24, 2048, 2048, epilogue="residual") == gc.GemvConfig(16, 256, 1, 4, 4)
    assert gc.pick_config(48, 2048, 2048, epilogue="residual").block_n == 16
    panel = gc.pick_config(1, 2048, 2048, epilogue="residual")
    assert GemvTuning().panel_max_rows == gc.PANEL_MAX_ROWS == 16
    assert gc.panel_fits(16, 2048, panel, 2) and not gc.panel_fits(17, 2048, panel, 2)
    wide = GemvTuning(panel_max_rows=32)  # a bench switch: the panel past 16 rows
    assert gc.panel_fits(32, 2048, panel, 2, wide) and not gc.panel_fits(33, 2048, panel, 2, wide)
    assert gc.resolve(twelve, 24, 2048, 2, wide) == twelve  # B = 4 stays a panel
    assert not gc.panel_fits(12, 2048, panel, 2, GemvTuning(panel_max_rows=8))
    for bad in (64, 12, 0):  # 64: past the kernel's two M tiles of 16; 12: not a power of two
        with pytest.raises(InputError, match="kernels.gemv.panel_max_rows"):
            GemvTuning(panel_max_rows=bad)
    assert not gc.pick_config(1, 2048, 2048).panel  # plain product: the streaming table
    assert gc.resolve(six, 6, 2048, 2) == six
    assert gc.deferred_norm_tiles(6, 2048, 2048) == (128, False)
    narrow = gc.GemvConfig(block_n=8, panel=True)
    assert gc.resolve(narrow, 6, 2048, 4) == narrow  # 8 x 2048 fp32 = 64 KB: fits
    streamed = gc.resolve(six, 6, 2048, 4)  # 16 x 2048 fp32 = 128 KB: streams, tile kept
    assert not streamed.panel and streamed.block_n == 16 and streamed.split_k == 1
    assert gc.resolve(narrow, gc.PANEL_MAX_ROWS + 1, 64, 2).block_n == 16  # too many rows
    assert not gc.panel_fits(1, 8193, narrow, 2)  # K padded to 16384: 256 KB
    off = GemvTuning(panel=False)
    streamed_off = gc.resolve(six, 6, 2048, 2, off)
    assert not streamed_off.panel and streamed_off.block_n == 16
    assert not gc.launch_config(6, 2048, 2048, epilogue="residual", tuning=off).panel
    assert gc.launch_config(6, 2048, 2048, epilogue="residual").panel
    assert gc.deferred_norm_tiles(6, 2048, 2048, tuning=off) == (128, False)
    with pytest.raises(InputError, match="kernels.gemv.panel"):
        GemvTuning(panel="yes")


def test_reduce_release_follows_the_successor():
    """``AttentionTuning.reduce_release``: ``auto`` (default) lets the split-KV reduce release
    its successor early only where that is a register panel; ``early`` / ``wait`` always /
    never; anything else an error naming the field."""
    auto = AttentionTuning()
    assert auto.reduce_release == "auto"
    assert auto.reduce_early(True) is True
    assert auto.reduce_early(False) is False  # a streaming o GEMV
    early, wait = AttentionTuning(reduce_release="early"), AttentionTuning(reduce_release="wait")
    assert early.reduce_early(True) is True and early.reduce_early(False) is True
    assert wait.reduce_early(True) is False and wait.reduce_early(False) is False
    with pytest.raises(InputError, match="kernels.attention.reduce_release"):
        AttentionTuning(reduce_release="late")


def test_unknown_successor_follows_the_panel_switch():
    """A launch that does not say what follows it (``successor_panel=None``) takes the panel
    switch's word: a panel wherever panels are on (``paged_attention._panel_successor``; needs
    Triton importable)."""
    pytest.importorskip("triton")
    from speccal.kernels.paged_attention import _panel_successor

    assert _panel_successor(None, DEFAULT_KERNELS) is True
    assert _panel_successor(None, KernelConfig(gemv=GemvTuning(panel=False))) is False
    assert _panel_successor(False, DEFAULT_KERNELS) is False
    assert _panel_successor(True, KernelConfig(gemv=GemvTuning(panel=False))) is True


def test_residual_panel_tells_the_reduce_what_follows():
    """``ops.residual_panel``: whether the o projection of a step launches as the register panel
    (up to PANEL_MAX_ROWS rows, its 16 x 2048 bf16 panel within 64 KB; fp32 is not), which the
    split-KV reduce's ``auto`` release follows (``AttentionTuning.reduce_early``)."""
    w = torch.zeros(2048, 2048, dtype=torch.bfloat16)
    panel = {m: ops.residual_panel(torch.zeros(m, 2048, dtype=torch.bfloat16), w)
             for m in (1, 6, 12, 16, 17, 24)}
    assert panel == {1: True, 6: True, 12: True, 16: True, 17: False, 24: False}
    assert not ops.residual_panel(torch.zeros(6, 2048), torch.zeros(2048, 2048))  # fp32: 128 KB
    assert [AttentionTuning().reduce_early(panel[m]) for m in (12, 24)] == [True, False]
    h6 = torch.zeros(6, 2048, dtype=torch.bfloat16)
    assert not ops.residual_panel(h6, w, KernelConfig(gemv=GemvTuning(panel=False)))
    h12 = torch.zeros(12, 2048, dtype=torch.bfloat16)
    assert not ops.residual_panel(h12, w, KernelConfig(gemv=GemvTuning(panel_max_rows=8)))


def _overrides(*entries: str, **fields) -> GemvTuning:
    """``GemvTuning`` whose overrides are ``entries`` (``GemvOverride.SYNTAX``), in order."""
    return GemvTuning(overrides=tuple(GemvOverride.parse(e) for e in entries), **fields)


def test_gemv_override_and_panel_chunks():
    """``GemvTuning.overrides`` replace the tables' config of one (N, K) up to MAX_M rows (a
    panel too), the first match winning, and the reference LM head's tile width follows them;
    ``panel_chunks`` takes powers of two; bad values name the field."""
    two = _overrides("4096:2048:8=64/128/1/4/4", "2048:2048:8=16/128/1/4/1/panel")
    assert gc.pick_config(6, 4096, 2048, tuning=two) == gc.GemvConfig(64, 128, 1, 4, 4)
    assert gc.pick_config(6, 4096, 2048) == gc.GemvConfig(64, 256, 1, 4, 3)  # the table
    assert gc.pick_config(9, 4096, 2048, tuning=two) == gc.GemvConfig(64, 128, 1, 4, 4)  # table
    assert gc.pick_config(33, 4096, 2048, tuning=two).block_n == 32  # past MAX_M: the table
    o = gc.pick_config(1, 2048, 2048, epilogue="residual", tuning=two)
    assert o.panel and o.num_warps == 4
    assert gc.pick_config(1, 2048, 2048, epilogue="residual").num_warps == 8  # the table
    # the first match wins: 1 row, then 2-8
    first = _overrides("4096:2048:1=32/128/1/4/6", "4096:2048:8=64/256/1/4/3")
    assert gc.pick_config(1, 4096, 2048, tuning=first) == gc.GemvConfig(32, 128, 1, 4, 6)
    assert gc.pick_config(6, 4096, 2048, tuning=first) == gc.GemvConfig(64, 256, 1, 4, 3)
    # /pfT: the config's own L2 prefetch depth (kept through the silu_mul split-1 rewrite)
    pf = _overrides("2048:2048:32=32/128/1/4/4/pf16", "12288:2048:32=128/128/2/4/4/pf4")
    assert gc.pick_config(24, 2048, 2048, epilogue="residual", tuning=pf).prefetch == 16
    assert gc.pick_config(24, 12288, 2048, epilogue="silu_mul", tuning=pf) == gc.GemvConfig(
        64, 128, 1, 4, 4, prefetch=4)
    assert gc.pick_config(40, 2048, 2048, epilogue="residual", tuning=pf).prefetch is None
    # the LM head: the reference's argmax partials are as wide as the overridden config's tile
    head = _overrides("1000:64:8=32/64/1/4/2")
    x, w = torch.randn(3, 64), torch.randn(1000, 64)
    assert ops.argmax_tile_width(3, 1000, 64) == 64
    assert ops.argmax_tile_width(3, 1000, 64, tuning=head) == 32
    tile_max, _ = ops.linear_argmax(x, w, tune=KernelConfig(gemv=head))
    assert tile_max.shape == (3, 1000 // 32 + 1)
    assert ops.linear_argmax(x, w)[0].shape == (3, 1000 // 64 + 1)
    for bad in ("4096:2048=64", "4096:2048:8=64/128/1/4", "4096:2048:8=64/128/1/4/4/wide",
                "4096:2048:8=64/128/1/4/4/pf", "4096:2048:8=64/128/1/4/4/pf-1",
                "4096:2048:8=64/128/1/4/4/pf2/panel", "4096:2048:8=64/128/1/4/4/panel/pf2/pf3"):
        with pytest.raises(InputError, match="kernels.gemv.overrides"):
            GemvOverride.parse(bad)
    with pytest.raises(InputError, match=r"kernels.gemv.overrides\[0\]"):
        GemvTuning(overrides=("4096:2048:8=64/128/1/4/4",))  # a string, not a GemvOverride
    assert GemvTuning().panel_chunks == 4
    assert GemvTuning(panel_chunks=8).panel_chunks == 8
    for bad in (3, 0, "8"):
        with pytest.raises(InputError, match="kernels.gemv.panel_chunks"):
            GemvTuning(panel_chunks=bad)


def test_gemv_prefetch_depth_follows_the_config():
    """A config's own prefetch depth wins over the caller's, capped at the program's K tiles;
    no prefetch without PDL (``gemv._prefetch``; needs Triton importable)."""
    pytest.importorskip("triton")
    from speccal.kernels.gemv import _prefetch
    from speccal.kernels.gemv_config import GemvConfig

    assert _prefetch(GemvConfig(prefetch=16), 2, 2048, 2) == 16
    assert _prefetch(GemvConfig(block_k=256, prefetch=16), 2, 2048, 2) == 8  # 8 K tiles
    assert _prefetch(GemvConfig(prefetch=0), 2, 2048, 2) == 0
    assert _prefetch(GemvConfig(), 2, 2048, 2) == 2 and _prefetch(GemvConfig(), 2, 2048, 0) == 0


def test_gemv_block_rows():
    """The streaming GEMV's M tile: 16 at one row, the rows' power of two (at least 16) at 2-16,
    at least 64 past 16 rows (``GemvTuning.wide_block_m`` 32 restores the power of two there),
    the power of two for CUDA-core FMAs; bad rows and switch values name what they are."""
    assert [gc.block_rows(m) for m in (1, 2, 6, 8, 12, 16)] == [16] * 6
    assert [gc.block_rows(m) for m in (17, 24, 32, 33, 48, 64, 65)] == [64] * 6 + [128]
    assert [gc.block_rows(m, fma=True) for m in (1, 3, 24)] == [1, 4, 32]
    narrow = GemvTuning(wide_block_m=32)
    assert [gc.block_rows(m, tuning=narrow) for m in (24, 48, 12)] == [32, 64, 16]
    tall = GemvTuning(wide_block_m=32, min_block_m=64)
    assert gc.block_rows(6, tuning=tall) == 64 and gc.block_rows(1, tuning=tall) == 16
    assert gc.block_rows(6, tuning=GemvTuning(min_block_m=4)) == 8  # the rows' power of two
    for bad in (16, 128, 48):
        with pytest.raises(InputError, match="kernels.gemv.wide_block_m"):
            GemvTuning(wide_block_m=bad)
    for bad in (128, 3, 0):
        with pytest.raises(InputError, match="kernels.gemv.min_block_m"):
            GemvTuning(min_block_m=bad)
    with pytest.raises(InputError, match="m"):
        gc.block_rows(0)


def test_resolve_keeps_the_stages_that_fit_in_shared_memory():
    """A streaming config whose pipeline stages of x and weight tiles would pass ``STAGE_BYTES``
    keeps the stages that fit (fp32 at an M tile of 64: 256 KB at 4 stages, past the sm_90
    limit); the ~2B preset's bf16 tables at up to 64 rows are unchanged."""
    cfg = gc.GemvConfig(64, 128, 1, 4, 4)
    assert gc.resolve(cfg, 24, 512, 4).num_stages == 3  # (64 + 64) x 128 x 4 B = 64 KB a stage
    assert gc.resolve(cfg, 12, 512, 4).num_stages == 4  # an M tile of 16: 40 KB a stage
    assert gc.resolve(cfg, 12, 512, 4, GemvTuning(min_block_m=64)).num_stages == 3  # tile of 64
    assert gc.resolve(cfg, 24, 512, 2) == cfg
    huge = gc.GemvConfig(256, 256, 1, 4, 8)
    assert gc.resolve(huge, 64, 512, 4).num_stages == 1  # never below one
    for n, k, epi in ((12288, 2048, "silu_mul"), (2048, 6144, "residual"), (4096, 2048, None),
                      (2048, 2048, "residual"), (151936, 2048, "argmax")):
        for m in (1, 2, 6, 8, 12, 16, 24, 32, 48, 64):
            picked = gc.pick_config(m, n, k, epilogue=epi)
            assert gc.launch_config(m, n, k, epilogue=epi).num_stages == picked.num_stages


def test_launch_config_is_resolved_once_per_shape_and_tuning():
    """``launch_config`` is memoised on its value arguments: the same (shape, epilogue, tuning)
    is one cache entry (an equal tuning built anew included), a different tuning another."""
    gc.launch_config.cache_clear()
    for _ in range(3):
        gc.launch_config(6, 2048, 2048, 132, "residual", 2, None, GemvTuning())
    assert gc.launch_config.cache_info().misses == 1
    off = gc.launch_config(6, 2048, 2048, 132, "residual", 2, None, GemvTuning(panel=False))
    assert gc.launch_config.cache_info().misses == 2 and not off.panel
    listed = GemvTuning(overrides=[GemvOverride.parse("2048:2048:8=16/128/1/4/1/panel")])
    assert isinstance(listed.overrides, tuple)  # hashable: a list is frozen into a tuple
    assert gc.launch_config(6, 2048, 2048, 132, "residual", 2, None, listed).num_warps == 4


def test_defer_scale_switch():
    """``GemvTuning.defer_scale``: ``auto`` by default (late past 16 rows), ``late`` / ``early``
    at every row count, anything else an error naming the field."""
    assert GemvTuning().defer_scale == "auto"
    assert [GemvTuning().scale_late(r) for r in (1, 6, 16, 17, 48)] == [
        False, False, False, True, True]
    late, early = GemvTuning(defer_scale="late"), GemvTuning(defer_scale="early")
    assert late.scale_late(1) and late.scale_late(48)
    assert not early.scale_late(1) and not early.scale_late(48)
    with pytest.raises(InputError, match="kernels.gemv.defer_scale"):
        GemvTuning(defer_scale="soon")


