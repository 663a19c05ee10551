"""The gated delta-net decode / verify ops (``KernelConfig.linear_attention.impl ==
"fused"``): :func:`gated_decay`, :func:`conv_update`, :func:`delta_rule_verify`,
:func:`rmsnorm_gated`
(re-exported by ``speccal.kernels.ops``; Triton in ``gated_delta.py``, references in
``reference``)."""

from __future__ import annotations

import torch

from speccal.kernels import reference as ref
from speccal.kernels._backend import use_triton
from speccal.kernels.config import DEFAULT_KERNELS, KernelConfig
from speccal.kernels.op_checks import FLOATS as _FLOATS
from speccal.kernels.op_checks import check_int as _check_int
from speccal.kernels.op_checks import need as _need
from speccal.kernels.op_checks import shape_of as _shape
from speccal.kernels.precompile import dry_pass_active


def _check_rows(name: str, t: torch.Tensor, lead: tuple[int, ...], dims: int,
                contiguous: bool = True) -> None:
    """A float ``[*lead, ...]`` tensor of ``dims`` axes, its last axis contiguous (or any
    strides: ``contiguous`` False)."""
    _need(isinstance(t, torch.Tensor) and t.dim() == dims and _shape(t)[:len(lead)] == lead
          and t.dtype in _FLOATS and (t.stride(-1) == 1 or not contiguous), name,
          (_shape(t), t.dtype) if isinstance(t, torch.Tensor) else t,
          f"a float tensor of {dims} axes [{', '.join(map(str, lead))}, ...]"
          + (", last contiguous" if contiguous else ""))


def _check_slots(read_slots, write_slots, num_valid, snapshot_rows, num_b: int,
                 num_r: int) -> None:
    _check_int(read_slots, "read_slots", (num_b,), (torch.int64,))
    if write_slots is not None:
        _check_int(write_slots, "write_slots", (num_b,), (torch.int64,))
    if num_valid is not None:
        _check_int(num_valid, "num_valid", (num_b,))
    if snapshot_rows is not None:
        _check_int(snapshot_rows, "snapshot_rows", (num_b, num_r), (torch.int64,))


def _check_out(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype) -> None:
    if t is not None:
        _need(_shape(t) == shape and t.dtype == dtype and t.is_contiguous(), name,
              (_shape(t), t.dtype), f"{list(shape)} {dtype}, contiguous")


def conv_update(
    x: torch.Tensor,  # [B, R, C] conv inputs (any strides)
    conv_state: torch.Tensor,  # [S, C, K - 1] pool, read and written in place
    weight: torch.Tensor,  # [C, K] depthwise kernel
    read_slots: torch.Tensor,  # [B] int64
    write_slots: torch.Tensor | None,  # [B] int64; None: no final window written
    *,
    num_valid: torch.Tensor | None = None,  # [B] int real rows (None: all R)
    snapshots: torch.Tensor | None = None,  # [B, R, C, K - 1] written: window after each row
    snapshot_rows: torch.Tensor | None = None,  # [B, R] int64 pool rows, same, in place
    out: torch.Tensor | None = None,  # [B, R, C] x.dtype
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # [B, R, C] silu(conv)
    """A gated delta-net layer's conv step of a decode / verify (``reference.conv_update_ref``):
    depthwise causal conv1d + SiLU over ``[conv_state[read_slots] | x]`` for every row, the
    ``K - 1`` inputs ending at each request's last real row into ``conv_state[write_slots]``,
    the window after every row into ``snapshots`` / pool rows ``snapshot_rows`` (the snapshot
    strategy). One launch on Triton. Padding rows are convolved too (their output is unused)."""
    _check_rows("x", x, _shape(x)[:1], 3, contiguous=False)
    num_b, num_r, chans = x.shape
    _need(weight.dim() == 2 and weight.shape[0] == chans and weight.shape[1] >= 2, "weight.shape",
          _shape(weight), f"[{chans}, K >= 2]")
    km1 = weight.shape[1] - 1
    _need(conv_state.dim() == 3 and conv_state.shape[1:] == (chans, km1)
          and conv_state.dtype in _FLOATS, "conv_state", (_shape(conv_state), conv_state.dtype),
          f"[S, {chans}, {km1}] float")
    _check_slots(read_slots, write_slots, num_valid, snapshot_rows, num_b, num_r)
    _check_out("snapshots", snapshots, (num_b, num_r, chans, km1), conv_state.dtype)
    _check_out("out", out, (num_b, num_r, chans), x.dtype)
    if out is None:
        out = torch.empty(num_b, num_r, chans, dtype=x.dtype, device=x.device)
    if use_triton(x, backend or tune.backend):
        from speccal.kernels.gated_delta import conv_update_triton

        conv_update_triton(x, conv_state, weight, read_slots, write_slots, num_valid, snapshots,
                           snapshot_rows, out)
        return out.zero_() if dry_pass_active() else out
    return out.copy_(ref.conv_update_ref(x, conv_state, weight, read_slots, write_slots,
                                         num_valid, snapshots, snapshot_rows))


def delta_rule_verify(
    q: torch.Tensor,  # [B, R, Hk, Dk] raw (l2-normed and scaled in the op)
    k: torch.Tensor,  # [B, R, Hk, Dk]
    v: torch.Tensor,  # [B, R, Hv, Dv]
    g: torch.Tensor,  # [B, R, Hv] log decay (float32)
    beta: torch.Tensor,  # [B, R, Hv] write strength
    ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv] float32 pool, read and written in place
    read_slots: torch.Tensor,  # [B] int64
    write_slots: torch.Tensor | None,  # [B] int64; None: no final state written
    *,
    num_valid: torch.Tensor | None = None,  # [B] int real rows: g, beta masked past them
    snapshots: torch.Tensor | None = None,  # [B, R, Hv, Dk, Dv] written: state after each row
    snapshot_rows: torch.Tensor | None = None,  # [B, R] int64 pool rows, same, in place
    out: torch.Tensor | None = None,  # [B, R, Hv, Dv] q.dtype
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # [B, R, Hv, Dv]
    """The gated delta rule of a decode / verify over ``R`` rows per request
    (``reference.delta_rule_verify_ref``): q/k l2-normed (eps 1e-6), q scaled by
    ``Dk ** -0.5``, ``S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q`` from
    ``ssm_state[read_slots]``; rows past ``num_valid`` inert; the final state into
    ``ssm_state[write_slots]``, the state after every row into ``snapshots`` / pool rows
    ``snapshot_rows``. One launch on Triton, the state read once and written once
    (``tune.linear_attention``: value tile and warps)."""
    num_b, num_r = _shape(q)[:2]
    _check_rows("q", q, (num_b, num_r), 4)
    hk, dk = q.shape[2:]
    _check_rows("k", k, (num_b, num_r, hk, dk), 4)
    _check_rows("v", v, (num_b, num_r), 4)
    hv, dv = v.shape[2:]
    _need(hv % hk == 0, "v heads", (hk, hv), "a multiple of the q/k heads")
    _need(q.dtype == k.dtype == v.dtype, "q/k/v dtype", (q.dtype, k.dtype, v.dtype), "alike")
    for name, t in (("g", g), ("beta", beta)):
        _need(isinstance(t, torch.Tensor) and _shape(t) == (num_b, num_r, hv)
              and t.dtype in _FLOATS, name, (_shape(t), t.dtype),
              f"[{num_b}, {num_r}, {hv}] float")
    _need(ssm_state.dim() == 4 and ssm_state.shape[1:] == (hv, dk, dv)
          and ssm_state.dtype == torch.float32, "ssm_state", (_shape(ssm_state), ssm_state.dtype),
          f"[S, {hv}, {dk}, {dv}] float32")
    _check_slots(read_slots, write_slots, num_valid, snapshot_rows, num_b, num_r)
    _check_out("snapshots", snapshots, (num_b, num_r, hv, dk, dv), torch.float32)
    _check_out("out", out, (num_b, num_r, hv, dv), q.dtype)
    if out is None:
        out = torch.empty(num_b, num_r, hv, dv, dtype=q.dtype, device=q.device)
    if use_triton(q, backend or tune.backend):
        from speccal.kernels.gated_delta import delta_rule_verify_triton

        la = tune.linear_attention
        delta_rule_verify_triton(q, k, v, g, beta, ssm_state, read_slots, write_slots, num_valid,
                                 snapshots, snapshot_rows, out, la.block_v, la.warps)
        return out.zero_() if dry_pass_active() else out
    return out.copy_(ref.delta_rule_verify_ref(q, k, v, g, beta, ssm_state, read_slots,
                                               write_slots, num_valid, snapshots,
                                               snapshot_rows))


def rmsnorm_gated(
    x: torch.Tensor,  # [M, D]
    z: torch.Tensor,  # [M, D] gate, or [M / H, H, D] (a strided view: H rows of x per z row)
    weight: torch.Tensor,  # [D]
    eps: float,
    *,
    out: torch.Tensor | None = None,  # [M, D] x.dtype
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # [M, D]
    """``weight * rmsnorm(x) * silu(z)`` (``reference.rmsnorm_gated_ref``: fp32 math, the
    normed row rounded to x's dtype before the weight), the gated delta-net's output norm."""
    _need(x.dim() == 2 and x.stride(1) == 1 and x.dtype in _FLOATS, "x", (_shape(x), x.dtype),
          "[M, D] float, D contiguous")
    m, d = x.shape
    _need((_shape(z) == (m, d) or (z.dim() == 3 and z.shape[2] == d and z.shape[1] > 0
                                    and z.shape[0] * z.shape[1] == m))
          and z.stride(-1) == 1, "z", _shape(z), f"[{m}, {d}] or [{m} / H, H, {d}], D contiguous")
    _need(_shape(weight) == (x.shape[1],) and weight.dtype in _FLOATS, "weight",
          (_shape(weight), weight.dtype), f"[{x.shape[1]}] float")
    _need(eps > 0, "eps", eps, "> 0")
    _check_out("out", out, _shape(x), x.dtype)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if use_triton(x, backend or tune.backend):
        from speccal.kernels.gated_delta import rmsnorm_gated_triton

        rmsnorm_gated_triton(x, z, weight, eps, out)
        return out.zero_() if dry_pass_active() else out
    return out.copy_(ref.rmsnorm_gated_ref(x, z.reshape(m, d), weight, eps))


def gated_decay(
    a: torch.Tensor,  # [N, Hv] decay input (the model's dtype)
    b: torch.Tensor,  # [N, Hv] write-strength input
    dt_bias: torch.Tensor,  # [Hv]
    decay: torch.Tensor,  # [Hv] float32: -exp(A_log)
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # (g, beta) written: [N, Hv] each
    backend: str | None = None,  # overrides tune.backend (comparisons in tests)
    tune: KernelConfig = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:  # g [N, Hv] float32, beta [N, Hv] b's dtype
    """The gated delta rule's per-row gates, ``g = decay * softplus(a + dt_bias)`` and
    ``beta = sigmoid(b)`` (``reference.gated_decay_ref``): one launch on Triton (the torch form
    is five). ``out``: contiguous buffers to write them into (a replay's saves)."""
    _need(a.dim() == 2 and a.dtype in _FLOATS and a.stride(1) == 1, "a", (_shape(a), a.dtype),
          "[N, Hv] float, Hv contiguous")
    n, hv = a.shape
    _need(_shape(b) == (n, hv) and b.dtype in _FLOATS and b.stride(1) == 1, "b",
          (_shape(b), b.dtype), f"[{n}, {hv}] float, Hv contiguous")
    _need(_shape(dt_bias) == (hv,) and dt_bias.dtype in _FLOATS, "dt_bias",
          (_shape(dt_bias), dt_bias.dtype), f"[{hv}] float")
    _need(_shape(decay) == (hv,) and decay.dtype == torch.float32, "decay",
          (_shape(decay), decay.dtype), f"[{hv}] float32")
    if out is not None:
        _check_out("out[0] (g)", out[0], (n, hv), torch.float32)
        _check_out("out[1] (beta)", out[1], (n, hv), b.dtype)
    if use_triton(a, backend or tune.backend):
        from speccal.kernels.gated_delta import gated_decay_triton

        g, beta = out if out is not None else (
            torch.empty(n, hv, dtype=torch.float32, device=a.device),
            torch.empty(n, hv, dtype=b.dtype, device=a.device))
        gated_decay_triton(a, b, dt_bias, decay, g, beta)
        if dry_pass_active():  # skipped launches: finite stand-ins
            g.zero_()
            beta.zero_()
        return g, beta
    g, beta = ref.gated_decay_ref(a, b, dt_bias, decay)
    if out is None:
        return g, beta
    return out[0].copy_(g), out[1].copy_(beta)
