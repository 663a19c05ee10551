"""Triton split-K GEMV / skinny GEMM for decode: ``y[M, N] = x[M, K] @ w[N, K].T``, M small.

Owns the weight-streaming matmul of the decode and verify steps (M = 1..64 rows), where time is
the weight bytes over memory bandwidth. One program reads a ``[BLOCK_N, K / split_k]`` panel of
``w`` exactly once for all M rows (one M tile covers every row, so weights are never re-read),
accumulating in fp32. ``split_k > 1`` splits K across programs to put enough loads in flight
when N is small (o_proj, down_proj); the fp32 partials ``[split_k, M, N]`` are summed by a
second tiny kernel. Two inner products: ``tl.dot`` (tensor cores, M padded to 16) and, for
M <= 4, a broadcast-multiply-sum on the CUDA cores (``fma``). Configs come from
``gemv_config.pick_config`` (a table tuned on an H200, see bench/KERNEL_NOTES.md) or are
passed explicitly.
Weight layout is nn.Linear's ``[N, K]`` row-major (K contiguous). Reference:
``reference.linear_ref``.

A second kernel, the register panel (``_panel_kernel``, ``GemvConfig(panel=True)``: the o
projection at <= 8 rows), serves a GEMV whose predecessor is long and latency-bound (attention):
each program loads its whole ``[block_n, K]`` weight panel before its PDL wait, so the weights
stream in while the predecessor runs, and after the wait only x and the math remain (one row:
CUDA-core FMAs; 2-8 rows: a batched tensor-core dot over K chunks). Split 1, same epilogues as
the streaming kernel's split 1 (residual, deferred norm).

Epilogue fusions of the decode layer (each saves a launch and a round trip of the activations):
``silu_mul`` (the gate/up weight's rows interleave ``gate_i, up_i``, so one program holds both
halves of its outputs and stores ``silu(gate) * up``), a residual add (``residual +=
x @ w.T`` in place) and, for the LM head of argmax-only rounds, an argmax: each program stores
per row the max of its ``BLOCK_N`` logits and its column (``tile_max [M, T]`` fp32, ``tile_idx
[M, T]`` int32, ``T = cdiv(N, BLOCK_N)``) instead of the logits, and the acceptance kernel
reduces the ``T`` partials (no logits write, no argmax launch). A deferred RMSNorm spans two
GEMVs: the producer's residual epilogue also stores ``h * weight`` and per-tile sums of
``h^2`` (at split K in the last program of each column tile, arrival counters, no reduce
launch), the consumer scales its product's rows by ``rsqrt(mean + eps)`` (``defer`` /
``row_scale``; ``ops.linear_deferred_norm``). Prologues (norm, SwiGLU applied to x tiles as
they load) were tried and dropped: math on a dot operand stopped Triton 3.6 from pipelining the
loop's loads (2-6x slower GEMVs on the H200, bench/KERNEL_NOTES.md). With ``pdl`` > 0 the launch is a programmatic
dependent launch (Hopper, ``SPECCAL_PDL``, default ``late``): the kernel waits for its predecessor
(``griddepcontrol.wait``) before its first read and lets its successor launch either at once
(mode 1) or after its K loop (mode 2, ``late``), so launch latency overlaps the previous kernel.
Before its wait a program does what the predecessor cannot change: an L2 prefetch of its first
weight tiles (``prefetch``), the residual where the caller vouches for it (``residual_settled``)
and, in the split-K reduce, the norm weight and the residual row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccal.base.errors import InputError
from speccal.kernels._backend import arrival_counters, num_sms
from speccal.kernels.config import DEFAULT_KERNELS, KernelConfig
from speccal.kernels.gemv_config import (
    PANEL_TILE_M,
    GemvConfig,
    block_rows,
    k_splits,
    launch_config,
    pick_config,
)
from speccal.kernels.pdl import await_signal, depart, pdl_enter
from speccal.kernels.rmsnorm import norm_row_store, rms_norm_triton

__all__ = ["GemvConfig", "fold_counters", "linear_argmax_triton", "linear_triton", "pick_config"]


@triton.jit
def _prefetch_tiles(w_ptr, offs_n, k_lo, N, K, stride_wn, BLOCK_K: tl.constexpr,
                    TILES: tl.constexpr, LINE: tl.constexpr):
    """``prefetch.global.L2`` of the first ``TILES`` ``[BLOCK_N, BLOCK_K]`` weight tiles from
    ``k_lo``: one request per ``LINE`` elements (a 128-byte line); indices clamped in bounds."""
    rows = tl.minimum(offs_n, N - 1)
    lines = tl.arange(0, BLOCK_K // LINE) * LINE
    for t in tl.static_range(TILES):
        cols = tl.minimum(k_lo + t * BLOCK_K + lines, K - 1)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
            [w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]],
            dtype=tl.int32, is_pure=False, pack=1,
        )


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DIRECT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, FMA: tl.constexpr,
    GLU: tl.constexpr, RES: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, LINE: tl.constexpr, RES_EARLY: tl.constexpr, ARGMAX: tl.constexpr,
    nw_ptr=None, xw_ptr=None, ss_ptr=None, stride_xw=0, P=1, norm_n=1, eps=0.0, cnt_ptr=None,
    DEFER: tl.constexpr = False, SCALE: tl.constexpr = 0, P_PAD: tl.constexpr = 1,
    FOLD: tl.constexpr = False, SPLIT: tl.constexpr = 1, PREC: tl.constexpr = None,
):
    # PREC: tl.dot's input_precision (``Precision.dot``: "ieee" for fp32 operands, so fp32 is
    # fp32; None, Triton's default, for bf16 / fp16).
    # GLU: weight rows interleave (gate_i, up_i); y[:, i] = silu(gate_i) * up_i (y is [M, N/2]),
    # split 1 only. RES: y += acc (y is the residual stream; at split > 1 the reduce adds).
    # ARGMAX (split 1): no logits; 1: y is tile_max [M, T] fp32 and part tile_idx [M, T] int32
    # (stride_ym = T), this program's column pid_n: the max of its BLOCK_N outputs per row and
    # the column where it first occurs; 2: y is keys [M] (int64, zero before the launch), each
    # program's (max, column) packed into one 64-bit key per row and folded in by an unsigned
    # atomic max, so the row's argmax is whole when the grid ends (no partials to reduce).
    # DEFER (split 1, RES): the next RMSNorm, deferred: besides the updated residual h, store
    # xw = h * nw (rounded) and ss[m, pid_n] = sum of h^2 over this program's columns ([M, P]).
    # SCALE: the consumer's side: each row's product is scaled by rsqrt(sum_p ss[m, p] / norm_n
    # + eps) before the epilogue, so x = xw gives the product of the normed rows (no norm launch);
    # the ss loads are issued after the PDL wait, reduced before the K loop (1) or after it (2).
    # FOLD (split K, with RES): no reduce launch: after storing its partial, a program counts
    # itself in cnt[pid_n]; the last of the SPLIT programs of its column tile sums the partials
    # (read through L2 after the acquire), adds the residual, stores h (and with DEFER the
    # deferred norm's pieces) and resets the counter (zero between launches).
    # x goes to the dot as loaded (math on a dot operand stops Triton pipelining the K loop).
    # Before the PDL wait (the predecessor may still run): PREFETCH of this program's first
    # weight tiles into L2 (weights are never written), and with RES_EARLY the residual tile
    # (the caller vouches that the predecessor does not write it).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_k * k_per_split
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_ok[:, None] & n_ok[None, :]
    if PREFETCH > 0:
        _prefetch_tiles(w_ptr, offs_n, k_lo, N, K, stride_wn, BLOCK_K, PREFETCH, LINE)
    res = _early_residual(y_ptrs, y_mask, RES_EARLY)
    if DEFER:
        nw = tl.load(nw_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if PDL > 0:  # 1: let the next kernel launch now; 2: only once this one's K loop is done
        tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()
    if SCALE:  # 1: the row scales before the K loop; 2: loaded here, reduced after it
        offs_p = tl.arange(0, P_PAD)
        sq = tl.load(ss_ptr + offs_m[:, None] * P + offs_p[None, :],
                     mask=m_ok[:, None] & (offs_p < P)[None, :], other=0.0)
        if SCALE == 1:
            row_scale = tl.math.rsqrt(tl.sum(sq, 1) / norm_n + eps)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FMA:
            prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, 2)  # [BLOCK_M, BLOCK_N]
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)  # [BLOCK_M, BLOCK_N]
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if SCALE == 2:
        row_scale = tl.math.rsqrt(tl.sum(sq, 1) / norm_n + eps)
    if SCALE:
        acc = acc * row_scale[:, None]
    if GLU:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        act = gate / (1.0 + tl.exp(-gate)) * up  # [BLOCK_M, BLOCK_N // 2]
        offs_h = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_h[None, :],
                 act.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_h < N // 2)[None, :])
    elif ARGMAX:
        # compare the logits as they would be stored (rounded to x's dtype, what torch.argmax
        # of linear()'s output sees); columns past N are -inf; a NaN beats every number, as in
        # torch.argmax: a tile holding one reports its first NaN. Ties: the first column.
        v = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        v = tl.where(n_ok[None, :], v, float("-inf"))
        is_nan = v != v
        best, col = tl.max(tl.where(is_nan, float("-inf"), v), 1, return_indices=True,
                           return_indices_tie_break_left=True)  # [BLOCK_M]
        cols = tl.arange(0, BLOCK_N)
        first_nan = tl.min(tl.where(is_nan, cols[None, :], BLOCK_N), 1)  # [BLOCK_M]
        has_nan = first_nan < BLOCK_N
        best = tl.where(has_nan, float("nan"), best)
        col = tl.where(has_nan, first_nan, col)
        if ARGMAX == 2:  # one packed key per row, unsigned atomic max (reference.argmax_keys_ref)
            bits = tl.where(best == 0.0, 0.0, best).to(tl.int32, bitcast=True)  # -0 as +0
            bits = tl.where(has_nan, 0x7FFFFFFF, bits)
            key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
            low = 0xFFFFFFFF - (pid_n * BLOCK_N + col).to(tl.uint32)
            packed = (key.to(tl.uint64) << 32) | low.to(tl.uint64)
            tl.atomic_max(y_ptr.to(tl.pointer_type(tl.uint64)) + offs_m, packed, mask=m_ok,
                          sem="relaxed", scope="gpu")
        else:
            t_offs = offs_m * stride_ym + pid_n
            tl.store(y_ptr + t_offs, best, mask=m_ok)
            tl.store(part_ptr + t_offs, (pid_n * BLOCK_N + col).to(tl.int32), mask=m_ok)
    elif DIRECT:
        _residual_store(acc, res, y_ptrs, y_mask, m_ok, offs_m, offs_n, pid_n, xw_ptr, ss_ptr,
                        stride_xw, P, nw if DEFER else acc, RES, RES_EARLY, DEFER)
    else:
        p_ptrs = part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
        if FOLD:
            tl.debug_barrier()  # every thread's partial stores before the release below
            done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:
                tl.store(cnt_ptr + pid_n, 0)
                tot = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)  # the residual
                for s in tl.static_range(SPLIT):
                    tot += tl.load(part_ptr + (s * M + offs_m[:, None]) * N + offs_n[None, :],
                                   mask=y_mask, other=0.0, cache_modifier=".cg")
                _store_h(tot, y_ptrs, y_mask, m_ok, offs_m, offs_n, pid_n, xw_ptr, ss_ptr,
                         stride_xw, P, nw if DEFER else tot, DEFER)


@triton.jit
def _early_residual(y_ptrs, y_mask, RES_EARLY: tl.constexpr):
    """The residual tile read before the PDL wait (``RES_EARLY``), else unused zeros."""
    if RES_EARLY:
        res = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    else:
        res = tl.zeros(y_mask.shape, dtype=tl.float32)
    return res


@triton.jit
def _residual_store(acc, res, y_ptrs, y_mask, m_ok, offs_m, offs_n, pid_n, xw_ptr, ss_ptr,
                    stride_xw, P, nw, RES: tl.constexpr, RES_EARLY: tl.constexpr,
                    DEFER: tl.constexpr):
    """A split-1 epilogue: ``acc`` plus the residual (``res`` from ``_early_residual``, or read
    now with ``RES``), then ``_store_h``."""
    if RES_EARLY:
        acc += res
    elif RES:
        acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    _store_h(acc, y_ptrs, y_mask, m_ok, offs_m, offs_n, pid_n, xw_ptr, ss_ptr, stride_xw, P, nw,
             DEFER)


@triton.jit
def _store_h(acc, y_ptrs, y_mask, m_ok, offs_m, offs_n, pid_n, xw_ptr, ss_ptr, stride_xw, P, nw,
             DEFER: tl.constexpr):
    """Store the updated residual tile ``h = acc`` (rounded); with DEFER also the deferred norm's
    ``xw = h * nw`` and this column tile's sums of ``h^2`` per row (``ss[m, pid_n]``)."""
    hb = acc.to(y_ptrs.dtype.element_ty)
    tl.store(y_ptrs, hb, mask=y_mask)
    if DEFER:
        hf = tl.where(y_mask, hb.to(tl.float32), 0.0)
        tl.store(xw_ptr + offs_m[:, None] * stride_xw + offs_n[None, :],
                 (hf * nw[None, :]).to(xw_ptr.dtype.element_ty), mask=y_mask)
        tl.store(ss_ptr + offs_m * P + pid_n, tl.sum(hf * hf, 1), mask=m_ok)


@triton.jit
def _panel_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KC: tl.constexpr, NCH: tl.constexpr,
    RES: tl.constexpr, RES_EARLY: tl.constexpr, PDL: tl.constexpr, DOT: tl.constexpr,
    nw_ptr=None, xw_ptr=None, ss_ptr=None, stride_xw=0, P=1, DEFER: tl.constexpr = False,
    PRECVT: tl.constexpr = False, sig_ptr=None, sig_target=0, POLL: tl.constexpr = False,
    TWO: tl.constexpr = False, PREC: tl.constexpr = None,
):
    # The program's whole weight panel [BLOCK_N, NCH * KC] is loaded before the PDL wait, so a
    # GEMV that follows a long kernel (the o projection after attention) has its weights in hand
    # when its input lands; after the wait only x (M rows, L2) and the math remain. One row
    # (not DOT, NCH 1, BLOCK_M 1): the panel in registers, CUDA-core FMAs. DOT (2-8 rows, an M
    # tile BLOCK_M >= 8 that tl.dot pads): the panel as NCH K chunks [NCH, BLOCK_N, KC] of one
    # batched tensor-core dot (independent accumulation chains; Triton stages the panel in
    # shared memory before the wait).
    # PRECVT (DOT): a dot of the panel with zeros before the wait, onto which the real dot
    # accumulates, so the panel's conversion to the dot operand's registers happens before the
    # wait and after it only x goes through shared memory (an inf weight would give NaN, not
    # inf, in its column). POLL (``ops.AttnSignal``): instead of the PDL wait, poll until the
    # attention launch has counted ``sig_target`` finished pieces of x at ``sig_ptr``; the last
    # program out zeroes the counters. RES / RES_EARLY / DEFER as in _skinny_kernel's split 1.
    # TWO (DOT): M rows in two M tiles of BLOCK_M, one dot after the other on the same panel (an
    # M tile of 32 spills on sm_90: 255 registers; two of 16 in a loop take 174, no spills).
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, KC)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if DOT:
        offs_b = tl.arange(0, NCH)
        kk = offs_b[:, None, None] * KC + offs_c[None, None, :]
        w = tl.load(rows[None, :, :] + kk, mask=n_ok[None, :, None] & (kk < K), other=0.0)
    else:
        w = tl.load(rows + offs_c[None, :], mask=n_ok[:, None] & (offs_c < K)[None, :],
                    other=0.0)  # [BLOCK_N, KC]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_ok[:, None] & n_ok[None, :]
    res = _early_residual(y_ptrs, y_mask, RES_EARLY)
    if TWO:  # the second M tile's residual: rows BLOCK_M .. 2 BLOCK_M - 1
        m_ok2 = BLOCK_M + offs_m < M
        res2 = _early_residual(y_ptrs + BLOCK_M * stride_ym, m_ok2[:, None] & n_ok[None, :],
                               RES_EARLY)
    if DEFER:
        nw = tl.load(nw_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if DOT:
        if PRECVT:
            acc0 = tl.dot(w, tl.zeros([NCH, KC, BLOCK_M], dtype=w.dtype), input_precision=PREC)
        else:
            acc0 = tl.zeros([NCH, BLOCK_N, BLOCK_M], dtype=tl.float32)
    if POLL:
        await_signal(sig_ptr, sig_target)
        depart(sig_ptr, tl.num_programs(0))
    elif PDL > 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if TWO:  # a loop of runtime trip count: the second tile's x addresses are not computed
        # (and held) before the first tile's dot (unrolled, that took 255 registers and spilled)
        for t in range(0, tl.cdiv(M, BLOCK_M)):
            offs_t = t * BLOCK_M + offs_m
            ok_t = offs_t < M
            acc = _panel_dot(w, acc0, x_ptr, stride_xm, offs_t, ok_t, offs_b, offs_c, K, KC,
                             PREC)
            y_mask_t = ok_t[:, None] & n_ok[None, :]
            _residual_store(acc, tl.where(t == 0, res, res2), y_ptrs + t * BLOCK_M * stride_ym,
                            y_mask_t, ok_t, offs_t, offs_n, pid_n, xw_ptr, ss_ptr, stride_xw, P,
                            nw if DEFER else acc, RES, RES_EARLY, DEFER)
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
    else:
        if DOT:
            acc = _panel_dot(w, acc0, x_ptr, stride_xm, offs_m, m_ok, offs_b, offs_c, K, KC,
                             PREC)
        else:
            xr = tl.load(x_ptr + offs_c, mask=offs_c < K, other=0.0).to(tl.float32)
            acc = tl.sum(w.to(tl.float32) * xr[None, :], 1)[None, :]  # [1, BLOCK_N]
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
        _residual_store(acc, res, y_ptrs, y_mask, m_ok, offs_m, offs_n, pid_n, xw_ptr, ss_ptr,
                        stride_xw, P, nw if DEFER else acc, RES, RES_EARLY, DEFER)


@triton.jit
def _panel_dot(w, acc0, x_ptr, stride_xm, offs_m, m_ok, offs_b, offs_c, K, KC: tl.constexpr,
               PREC: tl.constexpr):
    """One M tile of the register panel's batched dot: x^T chunks ``[NCH, KC, BLOCK_M]`` of the
    rows ``offs_m`` against the panel ``w [NCH, BLOCK_N, KC]`` -> ``[BLOCK_M, BLOCK_N]`` fp32."""
    kx = offs_b[:, None, None] * KC + offs_c[None, :, None]
    x3 = tl.load(x_ptr + offs_m[None, None, :] * stride_xm + kx,
                 mask=m_ok[None, None, :] & (kx < K), other=0.0)
    return tl.trans(tl.sum(tl.dot(w, x3, acc0, input_precision=PREC), 0))


@triton.jit
def _splitk_reduce_kernel(part_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr,
                          BLOCK: tl.constexpr, RES: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    if RES:
        acc += tl.load(y_ptr + m * stride_ym + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _splitk_reduce_norm_kernel(part_ptr, y_ptr, nw_ptr, xn_ptr, M, N, stride_ym, stride_xm, eps,
                               SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # one program per row: y += sum of the partials (the residual stream, rounded to its dtype),
    # then xn = rmsnorm(y) * nw from that rounded row (what a separate norm launch would read).
    # The norm weight (never written) and the residual row load before the PDL wait: the
    # predecessor, the split GEMV, does not write y, and it lets this kernel launch only after
    # its own wait, so y's last writer has finished.
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    w = tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(y_ptr + m * stride_ym + offs, mask=ok, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    acc += res
    h = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * stride_ym + offs, h, mask=ok)
    norm_row_store(h.to(tl.float32), w, xn_ptr + m * stride_xm, offs, ok, N, eps)


def linear_triton(
    x: torch.Tensor,  # [M, K], K contiguous
    weight: torch.Tensor,  # [N, K], K contiguous
    out: torch.Tensor | None = None,  # [M, N] ([M, N / 2] for epilogue "silu_mul")
    config: GemvConfig | None = None,
    *,
    epilogue: str | None = None,  # None | "silu_mul" (weight rows interleave gate_i, up_i)
    residual: torch.Tensor | None = None,  # [M, N]: residual += result (the output)
    pdl: int = 0,  # 0 off, 1 next kernel may launch at once, 2 after this one's K loop
    norm: tuple | None = None,  # (weight [N], eps, out [M, N]): out = rmsnorm(residual) * weight
    prefetch: int = 0,  # weight tiles per program prefetched into L2 before the PDL wait
    tune: KernelConfig = DEFAULT_KERNELS,  # the caller's kernel configuration
    residual_settled: bool = False,  # the previous kernel does not write ``residual``
    defer: tuple | None = None,  # (norm weight [N], xw [M, N], ss [M, P]), residual at split 1
    row_scale: tuple | None = None,  # (ss [M, P] fp32, eps): rows scaled by rsqrt(sum/K + eps)
    after=None,  # ops.AttnSignal armed by the attention launch that writes x (panel, PDL only)
) -> torch.Tensor:  # out
    """``x @ weight.T`` (then SwiGLU, or ``+ residual`` in place); validated by ``ops.linear``.

    ``defer`` / ``row_scale``: the two halves of a deferred RMSNorm (``ops.linear_deferred_norm``
    and ``ops.linear(row_scale=...)``): the producer (residual add, split 1) stores
    ``xw = h * weight`` and per-column-tile sums of ``h^2`` (``P = cdiv(N, block_n)``), the
    consumer scales each row of its product by ``rsqrt(sum / K + eps)``.

    SwiGLU needs every K of an output in one program (split 1); a residual add runs in the
    GEMV's epilogue at split 1, else in the split-K reduce (``pick_config(..., epilogue=...)``).
    ``norm`` (with a residual): the split-K reduce, one program per row, also writes the RMSNorm
    of the updated residual (the next layer's input: one launch fewer); at split 1 a norm
    launch follows.

    With PDL, work that does not depend on the predecessor runs before the kernel's wait:
    ``prefetch`` L2 prefetches of the program's first weight tiles, the norm weight, and the
    residual where nothing the predecessor does can change it (``residual_settled``: the
    previous launch does not write it; the split-K reduce's predecessor never does).
    """
    m = x.shape[0]
    n, k = weight.shape
    glu = epilogue == "silu_mul"
    cfg = launch_config(m, n, k, num_sms(x.device),
                        "residual" if residual is not None else epilogue, x.element_size(), config,
                        tune.gemv)
    prec = _precision(x, tune)
    if glu and cfg.block_n % 2:
        raise InputError("config.block_n", cfg.block_n, "even for the silu_mul epilogue")
    if residual is not None:
        out = residual
    elif out is None:
        out = torch.empty(m, n // 2 if glu else n, dtype=x.dtype, device=x.device)
    if after is not None and after.target and not (cfg.panel and pdl > 0):
        raise InputError("after", "an armed AttnSignal",
                         "None unless the launch is a register panel under PDL")
    if cfg.panel:
        if glu or row_scale is not None:
            raise InputError("config.panel", True, "False for the silu_mul epilogue and row_scale")
        poll = {}
        if after is not None and after.target:
            poll = dict(sig_ptr=after.counters, sig_target=after.target, POLL=True)
        _panel_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_N=cfg.block_n, **_panel_chunks(m, k, tune), RES=residual is not None,
            RES_EARLY=residual is not None and residual_settled, PDL=int(pdl),
            **_norm_args(defer, None, k, m, tune), **poll, PREC=prec, num_warps=cfg.num_warps,
            num_stages=1,
            launch_pdl=pdl > 0,
        )
        if norm is not None:
            rms_norm_triton(out, norm[0], norm[1], out=norm[2], pdl=pdl > 0)
        return out
    block_m = block_rows(m, cfg.fma, tune.gemv)
    split, k_per_split = k_splits(k, cfg, glu)
    direct = split == 1
    part = out if direct else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    fold = {}
    if defer is not None and not direct:  # the deferred norm needs whole sums: fold the reduce
        cnt = fold_counters(x.device, triton.cdiv(n, cfg.block_n))
        if cnt is None:
            raise InputError("defer", "split-K without fold counters",
                             "counters allocated before capture (run the op once eagerly)")
        fold = dict(cnt_ptr=cnt, FOLD=True, SPLIT=split)
    even_k = k % k_per_split == 0 and k_per_split % cfg.block_k == 0
    _skinny_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, out, part, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DIRECT=direct,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=even_k, FMA=cfg.fma, GLU=glu,
        RES=residual is not None, PDL=int(pdl),
        PREFETCH=_prefetch(cfg, prefetch, k_per_split, pdl),
        LINE=max(1, min(cfg.block_k, 128 // weight.element_size())),
        RES_EARLY=direct and residual is not None and residual_settled, ARGMAX=False,
        **_norm_args(defer, row_scale, k, m, tune), **fold, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl > 0,
    )
    if fold:  # the last program of each column tile reduced it
        return out
    if not direct and norm is not None:
        nw, eps, xn = norm
        block = triton.next_power_of_2(n)
        _splitk_reduce_norm_kernel[(m,)](
            part, out, nw, xn, m, n, out.stride(0), xn.stride(0), eps, SPLIT_K=split,
            BLOCK=block, PDL=pdl > 0, num_warps=min(16, max(1, block // 256)),
            launch_pdl=pdl > 0,
        )
    elif not direct:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=block,
            RES=residual is not None, PDL=pdl > 0, num_warps=4, launch_pdl=pdl > 0,
        )
    elif norm is not None:
        rms_norm_triton(out, norm[0], norm[1], out=norm[2], pdl=pdl > 0)
    return out


def _prefetch(cfg: GemvConfig, prefetch: int, k_per_split: int, pdl: int) -> int:
    """Weight tiles a program prefetches into L2 before its PDL wait: the config's own count
    (``GemvConfig.prefetch``), else the caller's, at most the program's K tiles; none without
    PDL."""
    tiles = prefetch if cfg.prefetch is None else cfg.prefetch
    return min(tiles, k_per_split // cfg.block_k) if pdl > 0 else 0


def fold_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """Arrival counters of the folded split-K reduce (``_backend.arrival_counters``, pool
    ``splitk``): None inside a capture that finds none, and the caller cannot fold."""
    return arrival_counters("splitk", device, needed, slots=4096)


def _precision(x: torch.Tensor, tune: KernelConfig) -> str | None:
    """``tl.dot``'s input_precision for operands like ``x``: the config's fp32 precision
    (``ieee`` by default) for float32, Triton's default (None) otherwise."""
    return tune.precision.fp32_dot if x.dtype == torch.float32 else None


def _panel_chunks(m: int, k: int, tune: KernelConfig) -> dict:
    """The register panel's math: one row on the CUDA cores over the whole K; more rows on the
    tensor cores (M tile ``tune.gemv.panel_min_block_m`` or the rows' power of two, whichever is larger;
    tl.dot pads it to the instruction), K in ``tune.gemv.panel_chunks`` chunks of one batched dot, so that
    many accumulation chains run side by side. On the H200 the CUDA-core panel at 6-8 rows
    kept an fp32 copy of the panel live across its rows (193 registers at 8 x 16, too many to
    sit beside the attention programs), and in K chunks its row x chunk reductions were 2-3x
    slower than streaming (bench/KERNEL_NOTES.md v9)."""
    pad = triton.next_power_of_2(k)
    if m == 1:
        return dict(KC=pad, NCH=1, BLOCK_M=1, DOT=False)
    nch = max(1, min(tune.gemv.panel_chunks, pad // 16))
    block_m = max(tune.gemv.panel_min_block_m, triton.next_power_of_2(m))
    two = block_m > PANEL_TILE_M  # past PANEL_TILE_M rows: two M tiles, one after the other
    if block_m > 2 * PANEL_TILE_M:
        raise InputError("rows", m, f"at most {2 * PANEL_TILE_M} for the register panel")
    return dict(KC=pad // nch, NCH=nch, BLOCK_M=block_m // 2 if two else block_m, DOT=True,
                PRECVT=tune.gemv.panel_preconvert, TWO=two)


def _norm_args(defer: tuple | None, row_scale: tuple | None, k: int, m: int,
               tune: KernelConfig) -> dict:
    """Kernel arguments of the deferred norm's producer (``defer``) or consumer (``row_scale``,
    ``m`` rows)."""
    if defer is not None:
        nw, xw, ss = defer
        return dict(nw_ptr=nw, xw_ptr=xw, ss_ptr=ss, stride_xw=xw.stride(0), P=ss.shape[1],
                    DEFER=True)
    if row_scale is not None:
        ss, eps = row_scale
        late = tune.gemv.scale_late(m)
        return dict(ss_ptr=ss, P=ss.shape[1], norm_n=k, eps=eps, SCALE=2 if late else 1,
                    P_PAD=triton.next_power_of_2(ss.shape[1]))
    return {}


def linear_argmax_triton(
    x: torch.Tensor,  # [M, K], K contiguous
    weight: torch.Tensor,  # [N, K], K contiguous
    config: GemvConfig | None = None,  # split_k must be 1 (None: pick_config(..., "argmax"))
    *,
    pdl: int = 0,  # as in linear_triton
    prefetch: int = 0,  # as in linear_triton
    keys: torch.Tensor | None = None,  # [M] int64, zeros: one packed key per row instead
    tune: KernelConfig = DEFAULT_KERNELS,  # the caller's kernel configuration
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:  # (tile_max, tile_idx) or keys
    """Per-tile argmax of ``x @ weight.T`` (the GEMV's ``ARGMAX`` epilogue): no logits written.
    With ``keys``: each row's whole argmax as a packed key (``reference.argmax_keys_ref``),
    folded in by atomic max, so ``keys`` must hold zeros before the launch.

    ``T = cdiv(N, config.block_n)``; ``tile_max[m, t]`` / ``tile_idx[m, t]`` are the max of
    row ``m``'s columns ``[t * block_n, (t + 1) * block_n)`` rounded to ``x``'s dtype and the
    first column holding it (a NaN beats every number). ``reference.reduce_argmax_partials_ref``
    or ``ops.verify_accept`` finish the argmax. Validated by ``ops.linear_argmax``.
    """
    m = x.shape[0]
    n, k = weight.shape
    cfg = launch_config(m, n, k, num_sms(x.device), "argmax", x.element_size(), config,
                        tune.gemv)
    if cfg.split_k != 1:
        raise InputError("config.split_k", cfg.split_k, "1 for the argmax epilogue")
    tiles = triton.cdiv(n, cfg.block_n)
    if keys is not None:
        tile_max = tile_idx = keys
    else:
        tile_max = torch.empty(m, tiles, dtype=torch.float32, device=x.device)
        tile_idx = torch.empty(m, tiles, dtype=torch.int32, device=x.device)
    k_per_split = triton.cdiv(k, cfg.block_k) * cfg.block_k
    _skinny_kernel[(tiles, 1)](
        x, weight, tile_max, tile_idx, m, n, k, x.stride(0), weight.stride(0), tiles,
        k_per_split, BLOCK_M=block_rows(m, cfg.fma, tune.gemv), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DIRECT=True, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0, FMA=cfg.fma,
        GLU=False, RES=False, PDL=int(pdl),
        PREFETCH=_prefetch(cfg, prefetch, k_per_split, pdl),
        LINE=max(1, min(cfg.block_k, 128 // weight.element_size())), RES_EARLY=False,
        ARGMAX=1 if keys is None else 2, PREC=_precision(x, tune), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=pdl > 0,
    )
    return keys if keys is not None else (tile_max, tile_idx)
