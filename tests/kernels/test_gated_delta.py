"""The gated delta-net decode / verify kernels (kernels/gated_delta.py) against their torch
references and against the layer's torch path (runner/linear_attention.py, itself tested
against transformers in tests/runner/test_hybrid_model.py).

``cuda``-marked tests run the Triton kernels: on the GPU, or on the CPU through Triton's
interpreter (``TRITON_INTERPRET=1 SPECCAL_KERNEL_TEST_DEVICE=cpu``). Sizes are odd (head dims
12 and 10, 20 or 150 conv channels, grouped value heads), slots scattered in a pool whose
other rows must stay untouched, read slot != write slot and in place, padding rows. Tolerances:
float32 1e-5 absolute (measured ~2e-7 under the interpreter); bfloat16 rows 1e-2 relative
Frobenius on the GPU (the references round the conv and the norm in bf16 where the kernels keep
fp32), 2e-2 under the interpreter, whose float32 -> bfloat16 conversions truncate (measured:
round toward zero even with ``fp_downcast_rounding="rtne"``; the gated norm rounds three times,
1.04e-2); conv states are copies of inputs, compared exactly; delta-rule states are fp32 in
both, 1e-5.
The unmarked tests run everywhere: the fused wiring of the layer over the ops' torch
references must give the torch path's bits.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from kernel_builders import rel_err

from speccal.kernels import ops
from speccal.kernels import reference as ref
from speccal.kernels.config import KernelConfig, LinearAttentionTuning
from speccal.runner.linear_attention import (
    GatedDeltaNet,
    LinearAttentionConfig,
    LinearState,
    StateMeta,
)
from speccal.runner.path import ExecutionPath, bind_path

DEV = os.environ.get("SPECCAL_KERNEL_TEST_DEVICE", "cuda")
DTYPES = [torch.float32, torch.bfloat16]
SLOTS = 24  # pool rows: the requests' read / write / snapshot rows are scattered among them
READ = [1, 4, 6]
WRITE = [2, 4, 7]  # request 1 in place (plain decode), the others to a scratch row
NUM_VALID = [None, [4, 2, 1], [1, 1, 1]]  # None: every row real
BF16_TOL = 2e-2 if DEV == "cpu" else 1e-2  # the interpreter truncates to bf16 (docstring)


def _snapshot_rows(num_b: int, num_r: int) -> torch.Tensor:  # [B, R] distinct rows, unread
    free = [r for r in reversed(range(SLOTS)) if r not in READ[:num_b]]
    return torch.tensor(free[: num_b * num_r], dtype=torch.int64).view(num_b, num_r)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        assert (got.float() - want.float()).abs().max().item() < 1e-5
    else:
        assert rel_err(got, want) < BF16_TOL


def _slots(num_b: int, num_r: int, num_valid, snap: str | None, write: bool = True):
    rd = torch.tensor(READ[:num_b], device=DEV)
    wr = torch.tensor(WRITE[:num_b], device=DEV) if write else None
    nv = None if num_valid is None else torch.tensor(
        [min(n, num_r) for n in num_valid[:num_b]], device=DEV)
    rows = _snapshot_rows(num_b, num_r).to(DEV) if snap == "rows" else None
    return rd, wr, nv, rows


# ------------------------------------------------------------------------------ the kernels


def _state_grid(cases):
    """A stateful kernel's test grid on the kernel device (``cuda`` marker): shapes x valid
    rows x snapshot mode (none, per-row buffers, pool rows) x dtype."""
    marks = [pytest.mark.parametrize("case", cases, ids=str),
             pytest.mark.parametrize("num_valid", NUM_VALID, ids=["all", "padded", "one"]),
             pytest.mark.parametrize("snap", [None, "buffer", "rows"]),
             pytest.mark.parametrize("dtype", DTYPES, ids=str), pytest.mark.cuda]

    def wrap(fn):
        for mark in marks:
            fn = mark(fn)
        return fn

    return wrap


CONV_CASES = [  # (B, R, C, K)
    (1, 1, 20, 4),  # plain decode
    (3, 4, 20, 4),  # full-width verify, w = 3
    (2, 6, 150, 3),  # two channel blocks, K - 1 = 2 < R
    (3, 2, 33, 5),  # K - 1 = 4 > R: the new window reaches back into the old state
]


@_state_grid(CONV_CASES)
def test_conv_update_equals_its_reference(case, num_valid, snap, dtype):
    """Output rows, the whole pool (write slot, snapshot rows, every other row untouched) and
    the snapshot buffer equal ``conv_update_ref``'s."""
    num_b, num_r, chans, kernel = case
    gen = torch.Generator().manual_seed(sum(case))
    x = torch.randn(num_b, num_r + 1, chans, generator=gen).to(dtype=dtype, device=DEV)[:, 1:]
    weight = torch.randn(chans, kernel, generator=gen).to(dtype=dtype, device=DEV)
    pool = torch.randn(SLOTS, chans, kernel - 1, generator=gen).to(dtype=dtype, device=DEV)
    rd, wr, nv, rows = _slots(num_b, num_r, num_valid, snap, write=snap != "rows")
    bufs = [torch.full((num_b, num_r, chans, kernel - 1), float("nan"), dtype=dtype, device=DEV)
            if snap == "buffer" else None for _ in range(2)]
    pools = [pool.clone(), pool.clone()]
    got = ops.conv_update(x, pools[0], weight, rd, wr, num_valid=nv, snapshots=bufs[0],
                          snapshot_rows=rows, tune=KernelConfig(backend="triton"))
    want = ref.conv_update_ref(x, pools[1], weight, rd, wr, nv, bufs[1], rows)
    _close(got, want, dtype)
    assert torch.equal(pools[0], pools[1])
    if snap == "buffer":
        assert torch.equal(bufs[0], bufs[1])
    assert not torch.equal(pools[0], pool)  # something was written


DELTA_CASES = [  # (B, R, Hk, Hv, Dk, Dv)
    (1, 1, 2, 4, 12, 10),  # plain decode, grouped value heads
    (3, 4, 2, 4, 12, 10),  # verify, w = 3
    (2, 6, 3, 3, 16, 20),  # one value head per key head, Dv past one value tile
]


@_state_grid(DELTA_CASES)
def test_delta_rule_verify_equals_its_reference(case, num_valid, snap, dtype):
    """Output rows, the whole float32 pool and every row's snapshot equal
    ``delta_rule_verify_ref``'s (q / k / v strided views of one row buffer, as the layer
    passes them); ``block_v`` 4 and 16 give the same values as the default tile."""
    num_b, num_r, hk, hv, dk, dv = case
    gen = torch.Generator().manual_seed(sum(case))
    width = 2 * hk * dk + hv * dv
    mixed = torch.randn(num_b, num_r, width, generator=gen).to(dtype=dtype, device=DEV)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    g = (-torch.rand(num_b, num_r, hv, generator=gen)).to(DEV)
    beta = torch.rand(num_b, num_r, hv, generator=gen).to(dtype=dtype, device=DEV)
    pool = (torch.randn(SLOTS, hv, dk, dv, generator=gen) * 0.3).to(DEV)
    rd, wr, nv, rows = _slots(num_b, num_r, num_valid, snap, write=snap != "rows")
    shape = (num_b, num_r, hv, dk, dv)
    want_buf = torch.full(shape, float("nan"), device=DEV) if snap == "buffer" else None
    want_pool = pool.clone()
    want = ref.delta_rule_verify_ref(q, k, v, g, beta, want_pool, rd, wr, nv, want_buf, rows)
    for block_v in (None, 4, 16):
        buf = torch.full(shape, float("nan"), device=DEV) if snap == "buffer" else None
        got_pool = pool.clone()
        tune = KernelConfig(backend="triton",
                            linear_attention=LinearAttentionTuning(block_v=block_v))
        got = ops.delta_rule_verify(q, k, v, g, beta, got_pool, rd, wr, num_valid=nv,
                                    snapshots=buf, snapshot_rows=rows, tune=tune)
        _close(got, want, dtype)
        assert (got_pool - want_pool).abs().max().item() < 1e-5  # every row, untouched too
        if snap == "buffer":
            assert (buf - want_buf).abs().max().item() < 1e-5


@pytest.mark.cuda
def test_delta_rule_padding_rows_leave_the_state_and_match_a_shorter_verify():
    """A request's state after ``num_valid`` real rows of ``R`` equals the state after a
    ``num_valid``-row launch on the same rows (the padding rows are inert), and a verified
    row's state after row ``i`` equals that of ``i + 1`` one-row decode launches in a chain:
    the same kernel arithmetic row for row (what the snapshot strategy relies on)."""
    gen = torch.Generator().manual_seed(5)
    num_r, hk, hv, dk, dv = 4, 2, 4, 12, 10
    q, k = (torch.randn(1, num_r, hk, dk, generator=gen).to(DEV) for _ in range(2))
    v = torch.randn(1, num_r, hv, dv, generator=gen).to(DEV)
    g = (-torch.rand(1, num_r, hv, generator=gen)).to(DEV)
    beta = torch.rand(1, num_r, hv, generator=gen).to(DEV)
    pool = (torch.randn(3, hv, dk, dv, generator=gen) * 0.3).to(DEV)
    one, zero, two = (torch.tensor([i], device=DEV) for i in (1, 0, 2))
    tune = KernelConfig(backend="triton")
    snaps = torch.zeros(1, num_r, hv, dk, dv, device=DEV)
    ops.delta_rule_verify(q, k, v, g, beta, pool, zero, one, num_valid=torch.tensor(
        [2], device=DEV), snapshots=snaps, tune=tune)
    ops.delta_rule_verify(q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], pool, zero, two,
                          tune=tune)
    assert torch.equal(pool[1], pool[2])
    assert torch.equal(snaps[0, 3], pool[1])
    chain = pool[:1].clone()
    for i in range(num_r):  # plain decode, in place, row by row
        ops.delta_rule_verify(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1],
                              beta[:, i:i + 1], chain, zero, zero, tune=tune)
        if i < 2:
            assert torch.equal(chain[0], snaps[0, i]), i


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 10), (7, 10), (33, 128)], ids=str)
def test_rmsnorm_gated_equals_its_reference(shape, dtype):
    """``rmsnorm_gated`` against ``rmsnorm_gated_ref`` (fp32 weight on bf16 rows too)."""
    gen = torch.Generator().manual_seed(shape[0])
    x, z = (torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEV) for _ in range(2))
    for w_dtype in {dtype, torch.float32}:
        w = (1 + 0.3 * torch.randn(shape[1], generator=gen)).to(dtype=w_dtype, device=DEV)
        got = ops.rmsnorm_gated(x, z, w, 1e-6, tune=KernelConfig(backend="triton"))
        _close(got, ref.rmsnorm_gated_ref(x, z, w, 1e-6), dtype)
    # z as a strided [M / H, H, D] view of a wider projection output (the concatenated
    # projection's z columns): the same rows as its contiguous copy
    heads = 7 if shape[0] % 7 == 0 else 1
    wide = torch.randn(shape[0] // heads, heads * shape[1] + 9, generator=gen).to(
        dtype=dtype, device=DEV)
    zv = wide[:, 5:5 + heads * shape[1]].view(shape[0] // heads, heads, shape[1])
    got = ops.rmsnorm_gated(x, zv, w, 1e-6, tune=KernelConfig(backend="triton"))
    assert torch.equal(got, ops.rmsnorm_gated(x, zv.reshape(shape), w, 1e-6,
                                              tune=KernelConfig(backend="triton")))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 13, 300])
def test_gated_decay_equals_its_reference(rows, dtype):
    """``gated_decay`` against ``gated_decay_ref``: g float32 (softplus across its threshold 20
    and deep into its small-exp tail, where log(1 + e) alone would lose every digit), beta in
    the rows' dtype; a float32 bias on bf16 rows as models keep it."""
    gen = torch.Generator().manual_seed(rows)
    hv = 6
    a = (torch.randn(rows, hv, generator=gen) * 12).to(dtype=dtype, device=DEV)
    a[0, :3] = torch.tensor([25.0, -40.0, 19.5])  # above the threshold, e ~ 4e-18, below it
    b = (torch.randn(rows, hv, generator=gen) * 3).to(dtype=dtype, device=DEV)
    decay = -torch.rand(hv, generator=gen).add(0.1).to(DEV)
    for bias_dtype in {dtype, torch.float32}:
        dt_bias = torch.randn(hv, generator=gen).to(dtype=bias_dtype, device=DEV)
        g, beta = ops.gated_decay(a, b, dt_bias, decay, tune=KernelConfig(backend="triton"))
        want_g, want_beta = ref.gated_decay_ref(a, b, dt_bias, decay)
        assert g.dtype == torch.float32 and beta.dtype == dtype
        torch.testing.assert_close(g, want_g, rtol=2e-6, atol=1e-30)
        if dtype == torch.float32:
            torch.testing.assert_close(beta, want_beta, rtol=2e-6, atol=1e-7)
        else:
            assert (beta.float() - want_beta.float()).abs().max().item() <= 2 ** -8


def test_gated_decay_refuses_bad_input():
    a = torch.zeros(3, 4)
    for kwargs, field in ((dict(a=torch.zeros(3, 4, dtype=torch.int64)), "a"),
                          (dict(b=torch.zeros(3, 5)), "b"), (dict(dt_bias=torch.zeros(5)),
                                                             "dt_bias"),
                          (dict(decay=torch.zeros(4, dtype=torch.bfloat16)), "decay")):
        args = dict(a=a, b=torch.zeros(3, 4), dt_bias=torch.zeros(4), decay=torch.zeros(4))
        args.update(kwargs)
        with pytest.raises(Exception, match=field):
            ops.gated_decay(args["a"], args["b"], args["dt_bias"], args["decay"])


# ------------------------------------------------------------------------------ the layer

CFG = LinearAttentionConfig(num_k_heads=2, num_v_heads=4, head_k_dim=12, head_v_dim=10,
                            conv_kernel=4)
HIDDEN = 24
FUSED = LinearAttentionTuning(impl="fused")
FLA = LinearAttentionTuning(impl="fla")  # the torch path (the default is fused)


def _layer(dtype: torch.dtype, device: str) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, CFG, 1e-6)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if name != "norm.weight" else 0.1) + (
                1.0 if name == "norm.weight" else 0.0))
    return layer.to(dtype=dtype, device=device)


def _scenario(name: str, num_r: int, device: str, state: LinearState):
    """``(StateMeta, snapshot pair or None, replay prefix or None)`` of one state strategy's
    forward over requests reading rows ``READ``."""
    rd = torch.tensor(READ, device=device)
    nv = torch.tensor([num_r, max(1, num_r - 2), 1], device=device)
    if name == "decode":  # plain decode: in place, one row, no mask
        return StateMeta(rd, rd, 1), None, None
    if name == "scratch_swap":  # scratch rows, padding, saved inputs, replay of a prefix
        saves = state.replay_buffers(3, num_r, state.layers[0][0].dtype, CFG).views(3, num_r)[0]
        meta = StateMeta(rd, torch.tensor(WRITE, device=device), num_r, nv, replay_saves=[saves])
        return meta, None, torch.tensor([num_r - 1, 0, 1], device=device)
    if name == "snapshots":  # every row's state into ring rows, no final state
        return StateMeta(rd, None, num_r, nv, snapshot_rows=_snapshot_rows(3, num_r).to(
            device)), None, None
    snap = state.snapshot_buffers(3, num_r)[0]  # per-row buffers (StateMeta.snapshots)
    return StateMeta(rd, rd, num_r, nv, snapshots=[snap]), snap, None


def _run_layer(layer, x, scenario, num_r, state0: LinearState, kernels: KernelConfig):
    """The layer's forward (and the scratch strategy's replay) under ``kernels``: the output
    rows, the state pools after it and the snapshot buffers."""
    layer = copy.deepcopy(layer)
    bind_path(layer, ExecutionPath(kernels=kernels))
    state = copy.deepcopy(state0)
    meta, snap, prefix = _scenario(scenario, num_r, str(x.device), state)
    pair = state.layers[0]
    with torch.no_grad():
        out = layer(x, meta, pair, snap, meta.replay_saves[0] if meta.replay_saves else None)
        if prefix is not None:
            layer.replay(pair, meta.read_slots, prefix, meta.replay_saves[0])
    return out, [*pair, *(snap or ())]


SCENARIOS = ["decode", "scratch_swap", "snapshots", "snapshot_buffers"]


def _layer_inputs(dtype, device, scenario):
    num_r = 1 if scenario == "decode" else 4
    state = LinearState(1, SLOTS, CFG, dtype, torch.device(device))
    gen = torch.Generator().manual_seed(1)
    for t in state.layers[0]:
        t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
    x = torch.randn(3 * num_r, HIDDEN, generator=gen).to(dtype=dtype, device=device)
    return x, num_r, state


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fused_wiring_over_the_references_gives_the_torch_paths_bits(scenario):
    """``linear_attention.impl = "fused"`` with the reference backend (the ops' torch
    references: what the fused path runs without Triton) gives the torch path's output, pools,
    snapshots and replayed state bit for bit, for each state strategy's forward."""
    x, num_r, state = _layer_inputs(torch.float32, "cpu", scenario)
    layer = _layer(torch.float32, "cpu")
    want = _run_layer(layer, x, scenario, num_r, state, KernelConfig(linear_attention=FLA))
    got = _run_layer(layer, x, scenario, num_r, state,
                     KernelConfig(backend="reference", linear_attention=FUSED))
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fused_layer_equals_the_torch_path(scenario, dtype):
    """The layer's decode / verify forward on the three Triton kernels against its torch path
    on the CPU (same weights, inputs and state, same dtype): output rows, state pools,
    snapshots and the scratch strategy's replayed state."""
    x, num_r, state = _layer_inputs(dtype, DEV, scenario)
    layer = _layer(dtype, DEV)
    got = _run_layer(layer, x, scenario, num_r, state,
                     KernelConfig(backend="triton", linear_attention=FUSED))
    cpu_state = copy.deepcopy(state)
    cpu_state.layers = [tuple(t.cpu() for t in pair) for pair in state.layers]
    want = _run_layer(layer.cpu(), x.cpu(), scenario, num_r, cpu_state, KernelConfig(linear_attention=FLA))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        assert rel_err(a, b) < tol
