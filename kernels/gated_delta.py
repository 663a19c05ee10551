"""Triton kernels of a gated delta-net layer's decode / verify (Qwen3.5 / Qwen3-Next).

Owns the four launches that replace the torch ops of ``speccal.runner.linear_attention``'s
decode / verify forward when ``KernelConfig.linear_attention.impl`` is ``fused``:

- ``conv_update_triton``: depthwise causal conv1d over ``[conv_state[read] | rows]`` + SiLU,
  one program per (request, channel block); the window ending at the request's last real row
  into ``conv_state[write]``, optionally the window after every row into snapshot buffers or
  pool rows (the ``snapshots`` strategy). Reference: ``reference.conv_update_ref``.
- ``delta_rule_verify_triton``: the gated delta rule over the ``R`` rows of a request with q/k
  l2-normed in the kernel (fla's ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x^2) + 1e-6)``,
  q scaled by ``Dk ** -0.5``), rows past ``num_valid`` inert. Grid ``(B * Hv, cdiv(Dv,
  BLOCK_V))``: each program holds its float32 state tile ``[Dk, BLOCK_V]`` in registers across
  the rows, read once from ``ssm_state[read]`` and written once to ``ssm_state[write]``, and
  stores the tile after every row into the snapshots in the same launch (fla's fused recurrent
  kernel returns only the final state, so the ``fla`` path calls it once per row). Grouped
  value heads: v head ``h`` reads q/k head ``h // (Hv // Hk)``. Reference:
  ``reference.delta_rule_verify_ref``.
- ``gated_decay_triton``: the per-row gates ``g = decay * softplus(a + dt_bias)`` (float32;
  ``log1p`` by Kahan's form, the threshold 20 of torch's softplus) and ``beta = sigmoid(b)``
  (rounded to b's dtype) in one launch instead of five torch ops. Reference:
  ``reference.gated_decay_ref``.
- ``rmsnorm_gated_triton``: ``weight * rmsnorm(x) * silu(z)``, fp32 math with the reference's
  roundings (the normed row to x's dtype before the weight, the weighted row to x's dtype
  when the weight is). Reference: ``reference.rmsnorm_gated_ref``.

Layouts: rows ``[B, R, ...]`` request-major with any batch / row / head strides (the last
axis contiguous); pools ``conv_state [S, C, K - 1]``, ``ssm_state [S, Hv, Dk, Dv]`` float32;
slots ``[B]`` int64. Arguments are validated by ``speccal.kernels.ops``.

In-place pools: a program reads its own tile before writing it (a barrier between), so the
write slot may be the read slot (plain decode). Two requests of one launch naming the same
slot (the padding requests' trash slot) race, as they may: only padding reads that slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv_update_triton", "delta_rule_verify_triton", "gated_decay_triton",
           "rmsnorm_gated_triton"]

L2NORM_EPS = 1e-6  # fla's and transformers' l2norm epsilon (kernels.reference.l2norm)
CONV_BLOCK_C = 128  # channels per conv program
DELTA_BLOCK_V = 8  # fla's value tile of its fused recurrent kernel (one warp)
NORM_BLOCK_M = 4  # rows per gated-norm program
GATE_BLOCK = 256  # (row, head) gates per gating program
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus: x above it is returned as is


@triton.jit
def _conv_cols(state_row, x_req, offs_c, c_ok, cols, cols_ok, stride_sc, stride_st,
               stride_xr, stride_xc, KM1: tl.constexpr):
    """Columns ``cols [M, J]`` of the virtual ``[state (K - 1) | rows (R)]`` sequence for the
    channels ``offs_c``: ``[BLOCK_C, M, J]`` in the rows' dtype (the state converted as torch's
    ``conv_state.to(x.dtype)``)."""
    is_state = (cols < KM1)[None, :, :]
    c3 = offs_c[:, None, None]
    mask = c_ok[:, None, None] & cols_ok[None, :, :]
    s = tl.load(state_row + c3 * stride_sc + cols[None, :, :] * stride_st,
                mask=mask & is_state, other=0.0)
    x = tl.load(x_req + (cols - KM1)[None, :, :] * stride_xr + c3 * stride_xc,
                mask=mask & ~is_state, other=0.0)
    return tl.where(is_state, s.to(x.dtype), x)


@triton.jit
def _conv_update_kernel(
    x_ptr, state_ptr, w_ptr, out_ptr, read_ptr, write_ptr, nv_ptr, snap_ptr, rows_ptr,
    C, stride_xb, stride_xr, stride_xc, stride_ss, stride_sc, stride_st, stride_wc, stride_wk,
    stride_ob, stride_or, stride_oc, stride_pb, stride_pr, stride_pc, stride_pt,
    stride_rb, stride_rr,
    R: tl.constexpr, RP: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_WRITE: tl.constexpr, HAS_NV: tl.constexpr,
    HAS_SNAP: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    # every row at once, each window loaded before anything is stored (a load after a store
    # the compiler cannot prove apart waits for it); rows are the middle axis of [C, RP, taps]
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    taps = tl.arange(0, BLOCK_K)
    ri = tl.arange(0, RP)
    r_ok = ri < R
    KM1: tl.constexpr = K - 1
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + taps[None, :] * stride_wk,
                mask=c_ok[:, None] & (taps < K)[None, :], other=0.0).to(tl.float32)
    state_row = state_ptr + tl.load(read_ptr + b).to(tl.int64) * stride_ss
    x_req = x_ptr + b.to(tl.int64) * stride_xb
    win_ok = taps < KM1
    cols = ri[:, None] + taps[None, :]  # [RP, taps]: row i's inputs are columns i .. i + K - 1
    full = _conv_cols(state_row, x_req, offs_c, c_ok, cols,
                      r_ok[:, None] & (taps < K)[None, :], stride_sc, stride_st, stride_xr,
                      stride_xc, KM1)
    acc = tl.sum(full.to(tl.float32) * w[:, None, :], axis=2)  # [BLOCK_C, RP]
    y = acc / (1.0 + tl.exp(-acc))
    if HAS_SNAP or HAS_ROWS:  # the window after row i: columns i + 1 .. i + K - 1
        win_mask = r_ok[:, None] & win_ok[None, :]
        wins = _conv_cols(state_row, x_req, offs_c, c_ok, cols + 1, win_mask, stride_sc,
                          stride_st, stride_xr, stride_xc, KM1)  # [BLOCK_C, RP, taps]
    if HAS_WRITE:  # the window ending at the last real row
        if HAS_NV:
            nv = tl.load(nv_ptr + b).to(tl.int32)
        else:
            nv = R
        last = _conv_cols(state_row, x_req, offs_c, c_ok, nv + taps[None, :], win_ok[None, :],
                          stride_sc, stride_st, stride_xr, stride_xc, KM1)  # [BLOCK_C, 1, taps]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + ri[None, :] * stride_or
             + offs_c[:, None] * stride_oc, y.to(out_ptr.dtype.element_ty),
             mask=c_ok[:, None] & r_ok[None, :])
    c3 = offs_c[:, None, None]
    t3 = taps[None, None, :]
    if HAS_SNAP:
        tl.store(snap_ptr + b.to(tl.int64) * stride_pb + ri[None, :, None] * stride_pr
                 + c3 * stride_pc + t3 * stride_pt, wins.to(snap_ptr.dtype.element_ty),
                 mask=c_ok[:, None, None] & win_mask[None, :, :])
    if HAS_ROWS:
        rows = tl.load(rows_ptr + b * stride_rb + ri * stride_rr, mask=r_ok, other=0).to(tl.int64)
        tl.store(state_ptr + rows[None, :, None] * stride_ss + c3 * stride_sc + t3 * stride_st,
                 wins.to(state_ptr.dtype.element_ty),
                 mask=c_ok[:, None, None] & win_mask[None, :, :])
    if HAS_WRITE:
        tl.debug_barrier()  # every read of the read slot before the (maybe same) write slot
        dst = state_ptr + tl.load(write_ptr + b).to(tl.int64) * stride_ss
        tl.store(dst + c3 * stride_sc + t3 * stride_st, last.to(state_ptr.dtype.element_ty),
                 mask=c_ok[:, None, None] & win_ok[None, None, :])


def conv_update_triton(
    x: torch.Tensor,  # [B, R, C]
    conv_state: torch.Tensor,  # [S, C, K - 1]
    weight: torch.Tensor,  # [C, K]
    read_slots: torch.Tensor,  # [B] int64
    write_slots: torch.Tensor | None,  # [B] int64
    num_valid: torch.Tensor | None,  # [B] int
    snapshots: torch.Tensor | None,  # [B, R, C, K - 1]
    snapshot_rows: torch.Tensor | None,  # [B, R] int64
    out: torch.Tensor,  # [B, R, C]
) -> torch.Tensor:  # out
    """One launch; arguments validated by ``ops.conv_update``."""
    num_b, num_r, chans = x.shape
    kernel = weight.shape[1]
    snap = snapshots if snapshots is not None else out.new_empty(1, 1, 1, 1)
    rows = snapshot_rows if snapshot_rows is not None else read_slots.view(1, -1)
    grid = (num_b, triton.cdiv(chans, CONV_BLOCK_C))
    _conv_update_kernel[grid](
        x, conv_state, weight, out, read_slots,
        write_slots if write_slots is not None else read_slots,
        num_valid if num_valid is not None else read_slots, snap, rows,
        chans, *x.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
        *snap.stride(), *rows.stride(),
        R=num_r, RP=max(2, triton.next_power_of_2(num_r)), K=kernel, BLOCK_C=CONV_BLOCK_C,
        BLOCK_K=triton.next_power_of_2(kernel),
        HAS_WRITE=write_slots is not None, HAS_NV=num_valid is not None,
        HAS_SNAP=snapshots is not None, HAS_ROWS=snapshot_rows is not None, num_warps=4,
    )
    return out


@triton.jit
def _row_of(x, sel):
    """Row ``i`` of a ``[RP, N]`` tile (``sel = rows == i``, ``[RP]``): ``[N]``, exact."""
    return tl.sum(tl.where(sel[:, None], x, 0.0), 0)


@triton.jit
def _elem_of(x, sel):
    """Element ``i`` of an ``[RP]`` vector (``sel = rows == i``): a scalar, exact."""
    return tl.sum(tl.where(sel, x, 0), 0)


@triton.jit
def _delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, read_ptr, write_ptr, nv_ptr,
    snap_ptr, rows_ptr,
    stride_qb, stride_qr, stride_qh, stride_kb, stride_kr, stride_kh,
    stride_vb, stride_vr, stride_vh, stride_gb, stride_gr, stride_gh,
    stride_bb, stride_br, stride_bh, stride_ss, stride_sh, stride_sk, stride_sv,
    stride_ob, stride_or, stride_oh, stride_pb, stride_pr, stride_ph, stride_pk, stride_pv,
    stride_rb, stride_rr,
    scale, eps, HV, GROUP, DK, DV,
    R: tl.constexpr, RP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_WRITE: tl.constexpr, HAS_NV: tl.constexpr, HAS_SNAP: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // HV).to(tl.int64)
    h = pid % HV
    hk = h // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    tile = offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    tile_ok = k_ok[:, None] & v_ok[None, :]
    src = state_ptr + tl.load(read_ptr + b).to(tl.int64) * stride_ss + h * stride_sh
    s = tl.load(src + tile, mask=tile_ok, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    # every row's inputs are loaded before the recurrence stores anything (a load after a store
    # the compiler cannot prove apart waits for it: one memory round trip a row otherwise)
    ri = tl.arange(0, RP)
    r_ok = ri < R
    qk_ok = r_ok[:, None] & k_ok[None, :]
    q_all = tl.load(q_ptr + b * stride_qb + ri[:, None] * stride_qr + hk * stride_qh
                    + offs_k[None, :], mask=qk_ok, other=0.0).to(tl.float32)  # [RP, BLOCK_K]
    k_all = tl.load(k_ptr + b * stride_kb + ri[:, None] * stride_kr + hk * stride_kh
                    + offs_k[None, :], mask=qk_ok, other=0.0).to(tl.float32)
    q_all = q_all * tl.math.rsqrt(tl.sum(q_all * q_all, 1) + eps)[:, None] * scale
    k_all = k_all * tl.math.rsqrt(tl.sum(k_all * k_all, 1) + eps)[:, None]
    v_all = tl.load(v_ptr + b * stride_vb + ri[:, None] * stride_vr + h * stride_vh
                    + offs_v[None, :], mask=r_ok[:, None] & v_ok[None, :],
                    other=0.0).to(tl.float32)  # [RP, BLOCK_V]
    g_all = tl.load(g_ptr + b * stride_gb + ri * stride_gr + h * stride_gh, mask=r_ok,
                    other=0.0).to(tl.float32)  # [RP]
    beta_all = tl.load(beta_ptr + b * stride_bb + ri * stride_br + h * stride_bh, mask=r_ok,
                       other=0.0).to(tl.float32)
    if HAS_NV:  # padding rows: zero decay, zero write
        nv = tl.load(nv_ptr + b).to(tl.int32)
        g_all = tl.where(ri < nv, g_all, 0.0)
        beta_all = tl.where(ri < nv, beta_all, 0.0)
    if HAS_ROWS:
        pool_rows = tl.load(rows_ptr + b * stride_rb + ri * stride_rr, mask=r_ok,
                            other=0).to(tl.int64)
    for i in tl.static_range(R):
        sel = ri == i
        q = _row_of(q_all, sel)
        k = _row_of(k_all, sel)
        v = _row_of(v_all, sel)
        g = _elem_of(g_all, sel)
        beta = _elem_of(beta_all, sel)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + b * stride_ob + i * stride_or + h * stride_oh + offs_v,
                 o.to(out_ptr.dtype.element_ty), mask=v_ok)
        if HAS_SNAP:
            tl.store(snap_ptr + b * stride_pb + i * stride_pr + h * stride_ph
                     + offs_k[:, None] * stride_pk + offs_v[None, :] * stride_pv,
                     s.to(snap_ptr.dtype.element_ty), mask=tile_ok)
        if HAS_ROWS:
            row = _elem_of(pool_rows, sel)
            tl.store(state_ptr + row * stride_ss + h * stride_sh + tile,
                     s.to(state_ptr.dtype.element_ty), mask=tile_ok)
    if HAS_WRITE:
        tl.debug_barrier()  # the tile was read before; the write slot may be the read slot
        dst = state_ptr + tl.load(write_ptr + b).to(tl.int64) * stride_ss + h * stride_sh
        tl.store(dst + tile, s.to(state_ptr.dtype.element_ty), mask=tile_ok)


def delta_rule_verify_triton(
    q: torch.Tensor,  # [B, R, Hk, Dk]
    k: torch.Tensor,  # [B, R, Hk, Dk]
    v: torch.Tensor,  # [B, R, Hv, Dv]
    g: torch.Tensor,  # [B, R, Hv]
    beta: torch.Tensor,  # [B, R, Hv]
    ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv] float32
    read_slots: torch.Tensor,  # [B] int64
    write_slots: torch.Tensor | None,  # [B] int64
    num_valid: torch.Tensor | None,  # [B] int
    snapshots: torch.Tensor | None,  # [B, R, Hv, Dk, Dv]
    snapshot_rows: torch.Tensor | None,  # [B, R] int64
    out: torch.Tensor,  # [B, R, Hv, Dv]
    block_v: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:  # out
    """One launch; arguments validated by ``ops.delta_rule_verify``."""
    num_b, num_r, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    block_v = min(block_v or DELTA_BLOCK_V, triton.next_power_of_2(dv))
    snap = snapshots if snapshots is not None else out.new_empty(1, 1, 1, 1, 1)
    rows = snapshot_rows if snapshot_rows is not None else read_slots.view(1, -1)
    grid = (num_b * hv, triton.cdiv(dv, block_v))
    _delta_rule_kernel[grid](
        q, k, v, g, beta, ssm_state, out, read_slots,
        write_slots if write_slots is not None else read_slots,
        num_valid if num_valid is not None else read_slots, snap, rows,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
        *ssm_state.stride(), *out.stride()[:3], *snap.stride(), *rows.stride(),
        dk**-0.5, L2NORM_EPS, hv, hv // hk, dk, dv,
        R=num_r, RP=max(2, triton.next_power_of_2(num_r)), BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=block_v,
        HAS_WRITE=write_slots is not None, HAS_NV=num_valid is not None,
        HAS_SNAP=snapshots is not None, HAS_ROWS=snapshot_rows is not None,
        num_warps=warps or 1,
    )
    return out


@triton.jit
def _rmsnorm_gated_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, M, D, stride_x, stride_z, stride_zh, HZ, stride_o, eps,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_NORM: tl.constexpr,
    ROUND_WEIGHTED: tl.constexpr,
):
    # z row r: (r // HZ) * stride_z + (r % HZ) * stride_zh (a [N, HZ, D] view of any strides)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < M)[:, None] & (cols < D)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    z_row = (rows // HZ) * stride_z + (rows % HZ) * stride_zh
    z = tl.load(z_ptr + z_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    n = xf * tl.math.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]
    if ROUND_NORM:  # torch: xf.to(dtype)
        n = n.to(x.dtype).to(tl.float32)
    wn = w[None, :] * n
    if ROUND_WEIGHTED:  # torch: weight * normed in x's dtype
        wn = wn.to(x.dtype).to(tl.float32)
    y = wn * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=ok)


def rmsnorm_gated_triton(
    x: torch.Tensor,  # [M, D]
    z: torch.Tensor,  # [M, D] or [M / H, H, D] (any strides, D contiguous)
    weight: torch.Tensor,  # [D]
    eps: float,
    out: torch.Tensor,  # [M, D]
) -> torch.Tensor:  # out
    """One launch; arguments validated by ``ops.rmsnorm_gated``."""
    m, d = x.shape
    is_low = x.dtype != torch.float32
    weighted = torch.promote_types(weight.dtype, x.dtype)
    _rmsnorm_gated_kernel[(triton.cdiv(m, NORM_BLOCK_M),)](
        x, z, weight, out, m, d, x.stride(0), z.stride(0), z.stride(1) if z.dim() == 3 else 0,
        z.shape[1] if z.dim() == 3 else 1, out.stride(0), eps,
        BLOCK_M=NORM_BLOCK_M, BLOCK_D=triton.next_power_of_2(d), ROUND_NORM=is_low,
        ROUND_WEIGHTED=weighted != torch.float32, num_warps=4,
    )
    return out


@triton.jit(do_not_specialize=("total",))  # one compile per layer shape, any row count
def _gated_decay_kernel(a_ptr, b_ptr, dt_ptr, decay_ptr, g_ptr, beta_ptr, total, HV,
                        stride_an, stride_bn, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    row = (offs // HV).to(tl.int64)
    h = offs % HV
    x = (tl.load(a_ptr + row * stride_an + h, mask=ok, other=0.0).to(tl.float32)
         + tl.load(dt_ptr + h, mask=ok, other=0.0).to(tl.float32))
    e = tl.exp(x)
    u = 1.0 + e
    # log1p(e) accurate to the last bit where 1 + e rounds (Kahan): log(u) * e / (u - 1)
    soft = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    soft = tl.where(x > 20.0, x, soft)
    g = tl.load(decay_ptr + h, mask=ok, other=0.0) * soft
    bb = tl.load(b_ptr + row * stride_bn + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(g_ptr + offs, g, mask=ok)
    tl.store(beta_ptr + offs, tl.sigmoid(bb).to(beta_ptr.dtype.element_ty), mask=ok)


def gated_decay_triton(
    a: torch.Tensor,  # [N, Hv]
    b: torch.Tensor,  # [N, Hv]
    dt_bias: torch.Tensor,  # [Hv]
    decay: torch.Tensor,  # [Hv] float32
    g: torch.Tensor,  # [N, Hv] float32, contiguous
    beta: torch.Tensor,  # [N, Hv] b's dtype, contiguous
) -> None:
    """One launch; arguments validated by ``ops.gated_decay``."""
    n, hv = a.shape
    total = n * hv
    _gated_decay_kernel[(triton.cdiv(total, GATE_BLOCK),)](
        a, b, dt_bias, decay, g, beta, total, hv, a.stride(0), b.stride(0), BLOCK=GATE_BLOCK,
        num_warps=4,
    )
