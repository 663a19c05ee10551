"""Triton paged attention for decode and verification, split-KV (flash-decoding) with a reduce.

Optionally fused with the step before it (``rope``): per-head q/k RMSNorm, rotary on q and on
the new k rows, and the new rows' KV-cache write, so the decode layer needs no separate rotary
launch (``ops.rope_paged_attention``).

Owns the kernel behind ``speccal.kernels.ops.paged_attention``; its pure-torch twin is
``reference.paged_attention_ref`` (same arguments, same semantics, see that module's docstring
for the layouts). One program handles one (request, KV head, KV split): its M tile stacks the
query rows and the query heads of one GQA group (``m = row * group + head_in_group``), so each K/V
tile is read once for all of them. Partial results ``[B, max_splits, R, H, D]`` fp32 and their
log2-sum-exp ``[B, max_splits, R, H]`` go to a workspace; a second kernel merges the splits,
one program per (request, row, head) loading every split at once (a serial loop over splits was
the slow part of version 1, see bench/KERNEL_NOTES.md). Where the merge is light
(``ops.fold_wanted``: few rows x splits, a grid that fits the SMs; ``AttentionTuning.fold``
forces or forbids it)
the split program that finishes last for its (request, KV head) merges instead (an arrival
counter per pair, acquire/release, reset by that program; a CUDA graph capture that finds no
counters yet falls back to the reduce launch).
With ``max_splits == 1`` the first kernel writes the normalised output directly (one launch).
Grids depend only on static shapes and ``max_splits``; the per-request split counts and lengths
are device tensors (``attention_tiling_update``), so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speccal.kernels._backend import arrival_counters, interpreting, num_sms
from speccal.kernels.config import DEFAULT_KERNELS, KernelConfig
from speccal.kernels.ops import fold_wanted, spread_wanted
from speccal.kernels.pdl import await_signal, depart, pdl_enter, signal_done

__all__ = ["paged_attention_triton"]

# q layout modes (constexpr)
_DENSE, _DENSE_QLENS, _PACKED = 0, 1, 2

def _counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The folded reduce's arrival counters (``_backend.arrival_counters``, pool ``attention``)."""
    return arrival_counters("attention", device, needed)


@triton.jit
def _row_layout(b, q_lens_ptr, cu_q_ptr, R, Q_MODE: tl.constexpr):
    if Q_MODE == 2:
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
    elif Q_MODE == 1:
        q_start = b * R
        q_len = tl.load(q_lens_ptr + b)
    else:
        q_start = b * R
        q_len = R
    return q_start, q_len


@triton.jit
def _rope_tables(pos, mask, cs_ptr, stride_cs, nw_ptr, offs_d, HEAD_DIM: tl.constexpr,
                 QK_NORM: tl.constexpr):
    """What the rotary of rows at ``pos`` needs besides the rows: ``cos``, ``sin`` ``[rows,
    D_PAD]`` and the norm weight at each lane and at its partner lane (positions and weights
    only, so a program may load them before its PDL wait)."""
    half = HEAD_DIM // 2
    lane = offs_d % half
    d_ok = offs_d < HEAD_DIM
    cs_row = cs_ptr + pos[:, None] * stride_cs + lane[None, :]
    cos = tl.load(cs_row, mask=mask, other=0.0)
    sin = tl.load(cs_row + half, mask=mask, other=0.0)
    if QK_NORM:
        w = tl.load(nw_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        ws = tl.load(nw_ptr + (offs_d + half) % HEAD_DIM, mask=d_ok, other=0.0).to(tl.float32)
    else:
        w = cos
        ws = cos
    return cos, sin, w, ws


@triton.jit
def _rope_rows(x_ptrs, xs_ptrs, mask, cos, sin, w, ws, offs_d, eps,
               HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """Rows of one head each, ``[rows, D_PAD]``: optional RMSNorm over D, then neox rotary
    (``cos``, ``sin``, ``w``, ``ws`` from ``_rope_tables``).

    ``xs_ptrs`` point at the partner lane ``(d + D/2) % D``, so ``rotate_half`` is a second
    (L1-hitting) load instead of a register shuffle. fp32 result."""
    half = HEAD_DIM // 2
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    xs = tl.load(xs_ptrs, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        inv = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = x * inv * w[None, :]
        xs = xs * inv * ws[None, :]
    sign = tl.where(offs_d < half, -1.0, 1.0)[None, :]
    return x * cos + sign * xs * sin


@triton.jit
def _prefetch_kv(k_ptr, v_ptr, bt_row, start, end, kvh, stride_kb, stride_ks, stride_kh,
                 stride_vb, stride_vs, stride_vh, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
                 PAGE: tl.constexpr, TILES: tl.constexpr, LINE: tl.constexpr):
    """``prefetch.global.L2`` of the K and V lines of the first ``TILES`` tiles of
    ``[start, end)`` (one request per ``LINE`` elements, a 128-byte line). Rows past ``end``
    point at page 0 (an allocated block): a prefetch never faults and changes no data."""
    lines = tl.arange(0, D_PAD // LINE) * LINE
    for t in tl.static_range(TILES):
        offs_n = start + t * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE, mask=ok, other=0).to(tl.int64)
        within = tl.where(ok, offs_n % PAGE, 0)
        k_row = page * stride_kb + within * stride_ks + kvh * stride_kh
        v_row = page * stride_vb + within * stride_vs + kvh * stride_vh
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
            [k_ptr + k_row[:, None] + lines[None, :]], dtype=tl.int32, is_pure=False, pack=1,
        )
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
            [v_ptr + v_row[:, None] + lines[None, :]], dtype=tl.int32, is_pure=False, pack=1,
        )


@triton.jit
def _split_setup(b, s, kvh, q_lens_ptr, cu_q_ptr, seq_lens_ptr, nsplit_ptr, split_len_ptr,
                 bt_ptr, stride_bt, cs_ptr, stride_cs, qw_ptr, kw_ptr, k_ptr, v_ptr,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, R,
                 NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                 D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, Q_MODE: tl.constexpr, DIRECT: tl.constexpr,
                 ROPE: tl.constexpr, QK_NORM: tl.constexpr, R_PAD: tl.constexpr,
                 FOLD: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
                 SPREAD: tl.constexpr = False):
    """Everything of a split program that depends on metadata only (row layout, KV range,
    rotary tables, the new rows' pages) and, with ``PREFETCH``, the L2 prefetch of its first
    cached K/V tiles: none of it reads what the predecessor kernel writes (the QKV GEMV), so a
    caller that vouches for the metadata (``META_EARLY``) runs it before the PDL wait."""
    q_start, q_len = _row_layout(b, q_lens_ptr, cu_q_ptr, R, Q_MODE)
    seq_len = tl.load(seq_lens_ptr + b)
    n_splits = tl.load(nsplit_ptr + b)
    split_len = tl.load(split_len_ptr + b)
    if DIRECT:
        # one split covering everything; never skip, so unused dense rows still get zeros
        start = 0
        end = seq_len
        live = s >= 0
    else:
        start = s * split_len
        end = tl.minimum(start + split_len, seq_len)
        if FOLD or SPREAD:
            # a request with no KV (n_splits 0) still needs its rows merged (to zeros): split 0
            # runs (empty range) and is the last (the only merger) of one
            n_splits = tl.maximum(n_splits, 1)
        live = s < n_splits
    offs_d = tl.arange(0, D_PAD)
    offs_m = tl.arange(0, BLOCK_M)
    r = offs_m // GROUP
    row_ok = (r < q_len) & (offs_m < R * GROUP)
    pos = seq_len - q_len + r  # [BLOCK_M] position of each query row
    nr = tl.arange(0, R_PAD)
    npos = seq_len - q_len + nr
    new_ok = (nr < q_len) & (npos >= start) & (npos < end)
    if ROPE:
        d_ok = (offs_d < HEAD_DIM)[None, :]
        q_cs = _rope_tables(pos, row_ok[:, None] & d_ok, cs_ptr, stride_cs, qw_ptr, offs_d,
                            HEAD_DIM, QK_NORM)
        k_cs = _rope_tables(npos, new_ok[:, None] & d_ok, cs_ptr, stride_cs, kw_ptr, offs_d,
                            HEAD_DIM, QK_NORM)
        npage = tl.load(bt_ptr + b * stride_bt + npos // PAGE, mask=new_ok, other=0)
    else:  # no rotary tables (the dummy pointers must not be read)
        q_cs = (pos, pos, pos, pos)
        k_cs = (npos, npos, npos, npos)
        npage = npos
    if PREFETCH > 0:
        if live:
            _prefetch_kv(k_ptr, v_ptr, bt_ptr + b * stride_bt, start,
                         tl.minimum(end, seq_len - q_len), kvh, stride_kb, stride_ks, stride_kh,
                         stride_vb, stride_vs, stride_vh, BLOCK_N, D_PAD, PAGE, PREFETCH, LINE)
    return (q_start, q_len, seq_len, n_splits, start, end, live, row_ok, pos, npos, new_ok,
            q_cs, k_cs, npage)


@triton.jit
def _attend_tile(q, k, v, offs_n, n_ok, pos, row_ok, scale_log2, m_i, l_i, acc,
                 PREC: tl.constexpr):
    """One K/V tile ``[BLOCK_N, D_PAD]`` into the online softmax of the query rows ``q``
    (``PREC``: the dots' input_precision, "ieee" for fp32 caches)."""
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_M, BLOCK_N] fp32
    ok = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :] & row_ok[:, None]
    qk = tl.where(ok, qk * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _split_wait(PDL: tl.constexpr, RELEASE: tl.constexpr):
    """The split kernel's PDL wait; with ``RELEASE == 0`` the successor launches right after it
    (else after the program's KV loop)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if RELEASE == 0:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, q_lens_ptr, cu_q_ptr, nsplit_ptr, split_len_ptr,
    out_ptr, part_o_ptr, part_lse_ptr, kn_ptr, vn_ptr, cs_ptr, qw_ptr, kw_ptr, cnt_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
    R, max_splits, scale_log2, eps, batch, total_rows,
    NUM_KV_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_MODE: tl.constexpr, DIRECT: tl.constexpr,
    ROPE: tl.constexpr, QK_NORM: tl.constexpr, R_PAD: tl.constexpr, PDL: tl.constexpr,
    FOLD: tl.constexpr, S_PAD: tl.constexpr, MERGE_ROWS: tl.constexpr, G_PAD: tl.constexpr,
    META_EARLY: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, RELEASE: tl.constexpr,
    sig_ptr=None, SIGNAL: tl.constexpr = False, SPREAD: tl.constexpr = False,
    PREC: tl.constexpr = None,
):
    # META_EARLY: the caller vouches that the predecessor kernel writes no metadata (seq_lens,
    # cu_q_lens, tiling, block table), so the setup (``_split_setup``: row layout, KV range,
    # rotary tables, new rows' pages, and with PREFETCH the L2 prefetch of the first cached K/V
    # tiles) runs before the PDL wait. RELEASE (PDL): 0 lets the successor launch right after
    # the wait, 1 only after this program's KV loop (the successor's programs then land on SMs
    # that the split programs have left), 2 before the wait.
    # SIGNAL (``ops.AttnSignal``): the program that finishes a piece of the output (DIRECT:
    # every program; FOLD: the merging one) counts itself done at ``sig_ptr`` (pdl.signal_done).
    # FOLD (split-KV without a reduce launch): every live program writes its partial, then
    # counts itself in ``cnt_ptr[b * KVH + kvh]``; the last one of its (request, KV head)
    # merges all splits into the output and resets the counter (zero between launches).
    # SPREAD (split-KV without a reduce launch, the merge spread over the live programs; the host
    # grants it only to a grid that fits the SMs at once, ``ops.spread_wanted``): every live
    # program writes its partial and counts itself in ``cnt_ptr[2 * pid]``, waits until all
    # ``n_splits`` of its (request, KV head) have (``pdl.await_signal``), merges rows ``s``,
    # ``s + n_splits``, ... of its ``R * GROUP`` and counts itself out (``pdl.depart``: the last
    # one zeroes both counters).
    # ROPE: q is the raw projection; each program rotates (and q/k-norms) its query rows, and the
    # program whose KV range holds a new row writes that row's rotated k and v (its KV head) to
    # the cache before reading any tile: no separate rotary + KV-write launch.
    pid = tl.program_id(0)
    s = tl.program_id(1)
    b = pid // NUM_KV_HEADS
    kvh = pid % NUM_KV_HEADS
    if PDL and RELEASE == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if not META_EARLY:
        _split_wait(PDL, RELEASE)
    (q_start, q_len, seq_len, n_splits, start, end, live, row_ok, pos, npos, new_ok, q_cs,
     k_cs, npage) = _split_setup(
        b, s, kvh, q_lens_ptr, cu_q_ptr, seq_lens_ptr, nsplit_ptr, split_len_ptr, bt_ptr,
        stride_bt, cs_ptr, stride_cs, qw_ptr, kw_ptr, k_ptr, v_ptr, stride_kb, stride_ks,
        stride_kh, stride_vb, stride_vs, stride_vh, R, NUM_KV_HEADS, GROUP, HEAD_DIM, D_PAD,
        PAGE, BLOCK_M, BLOCK_N, Q_MODE, DIRECT, ROPE, QK_NORM, R_PAD, FOLD, PREFETCH, LINE,
        SPREAD)
    if META_EARLY:  # the setup above ran before the wait (PREFETCH is 0 otherwise)
        _split_wait(PDL, RELEASE)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    if (FOLD or SPREAD) and Q_MODE == 2:
        if s == 0:  # packed rows of no request (t >= cu_q_lens[B]) get zeros, strided over b
            offs_g = tl.arange(0, G_PAD)
            zd = tl.arange(0, D_PAD)
            z_ok = (offs_g < GROUP)[:, None] & (zd < HEAD_DIM)[None, :]
            zero = tl.zeros([G_PAD, D_PAD], dtype=out_ptr.dtype.element_ty)
            for t in range(tl.load(cu_q_ptr + batch) + b, total_rows, batch):
                tl.store(out_ptr + t * stride_ot + (kvh * GROUP + offs_g)[:, None] * stride_oh
                         + zd[None, :], zero, mask=z_ok)
    if live:
        offs_m = tl.arange(0, BLOCK_M)
        r = offs_m // GROUP
        h = kvh * GROUP + offs_m % GROUP
        q_rows = q_ptr + (q_start + r)[:, None] * stride_qt + h[:, None] * stride_qh
        q_mask = row_ok[:, None] & d_ok[None, :]
        if ROPE:
            swap = (offs_d + HEAD_DIM // 2) % HEAD_DIM
            q = _rope_rows(q_rows + offs_d[None, :], q_rows + swap[None, :], q_mask, q_cs[0],
                           q_cs[1], q_cs[2], q_cs[3], offs_d, eps, HEAD_DIM, QK_NORM)
            q = q.to(k_ptr.dtype.element_ty)  # [BLOCK_M, D_PAD], as the unfused path stores it
            # new rows of this request inside [start, end): rotate k, write k and v to the cache
            nr = tl.arange(0, R_PAD)
            n_mask = new_ok[:, None] & d_ok[None, :]
            k_rows = kn_ptr + (q_start + nr)[:, None] * stride_knt + kvh * stride_knh
            kr = _rope_rows(k_rows + offs_d[None, :], k_rows + swap[None, :], n_mask, k_cs[0],
                            k_cs[1], k_cs[2], k_cs[3], offs_d, eps, HEAD_DIM, QK_NORM)
            nslot = npage.to(tl.int64) * PAGE + npos % PAGE  # [R_PAD]
            tl.store(k_ptr + nslot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                     kr.to(k_ptr.dtype.element_ty), mask=n_mask)
            vnew = tl.load(vn_ptr + (q_start + nr)[:, None] * stride_vnt + kvh * stride_vnh
                           + offs_d[None, :], mask=n_mask, other=0.0)
            tl.store(v_ptr + nslot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                     vnew.to(v_ptr.dtype.element_ty), mask=n_mask)
            tl.debug_barrier()  # the CTA's own cache writes before its tile loads
        else:
            q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)  # [BLOCK_M, D_PAD]
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + offs_nb
            n_ok = offs_n < end
            page = tl.load(bt_ptr + b * stride_bt + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            within = offs_n % PAGE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(
                k_ptr + page[:, None] * stride_kb + within[:, None] * stride_ks + kvh * stride_kh
                + offs_d[None, :],
                mask=kv_mask, other=0.0,
            )  # [BLOCK_N, D_PAD]
            v = tl.load(
                v_ptr + page[:, None] * stride_vb + within[:, None] * stride_vs + kvh * stride_vh
                + offs_d[None, :],
                mask=kv_mask, other=0.0,
            )  # [BLOCK_N, D_PAD]
            m_i, l_i, acc = _attend_tile(q, k, v, offs_n, n_ok, pos, row_ok, scale_log2,
                                         m_i, l_i, acc, PREC)
        if PDL and RELEASE == 1:
            tl.extra.cuda.gdc_launch_dependents()
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if DIRECT:
            if Q_MODE == 2:
                st_ok = row_ok
            else:
                st_ok = offs_m < R * GROUP  # dense: rows past q_len get the zeros computed above
            tl.store(
                out_ptr + (q_start + r)[:, None] * stride_ot + h[:, None] * stride_oh
                + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty), mask=st_ok[:, None] & d_ok[None, :],
            )
            if SIGNAL:
                signal_done(sig_ptr)
        else:
            lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            base = ((b * max_splits + s) * R + r) * NUM_HEADS + h  # [BLOCK_M]
            tl.store(part_lse_ptr + base, lse, mask=row_ok)
            tl.store(
                part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], o,
                mask=row_ok[:, None] & d_ok[None, :],
            )
            if FOLD:
                tl.debug_barrier()  # every thread's partial stores before the release below
                done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
                if done == n_splits - 1:
                    tl.store(cnt_ptr + pid, 0)
                    _merge_rows(part_o_ptr, part_lse_ptr, out_ptr, b, kvh, q_start, q_len,
                                n_splits, R, max_splits, stride_ot, stride_oh, NUM_HEADS, GROUP,
                                HEAD_DIM, D_PAD, S_PAD, R_PAD, MERGE_ROWS, Q_MODE)
                    if SIGNAL:
                        signal_done(sig_ptr)
            if SPREAD:
                signal_done(cnt_ptr + 2 * pid)  # CTA barrier, then a release add
                await_signal(cnt_ptr + 2 * pid, n_splits)
                for m in range(s, R * GROUP, n_splits):
                    _merge_one(part_o_ptr, part_lse_ptr, out_ptr, b, kvh, m, q_start, q_len,
                               n_splits, R, max_splits, stride_ot, stride_oh, NUM_HEADS, GROUP,
                               HEAD_DIM, D_PAD, S_PAD, Q_MODE)
                depart(cnt_ptr + 2 * pid, n_splits)


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, b, r, h, n, R, max_splits, NUM_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
                  CACHE: tl.constexpr):
    """Query row ``r``, head ``h`` of request ``b`` merged over its first ``n`` splits, all
    loaded at once: ``[D_PAD]`` fp32 (zeros for ``n == 0``). ``CACHE``: the partials' load
    cache modifier (``.cg`` where other programs of the same grid wrote them)."""
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < n
    base = ((b * max_splits + offs_s) * R + r) * NUM_HEADS + h  # [S_PAD]
    lse = tl.load(part_lse_ptr + base, mask=s_ok, other=float("-inf"), cache_modifier=CACHE)
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.math.exp2(lse - top)  # [S_PAD], 0 for absent splits
    o = tl.load(part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0,
                cache_modifier=CACHE)  # [S_PAD, D_PAD]
    den = tl.sum(w, 0)
    return tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)


@triton.jit
def _merge_one(part_o_ptr, part_lse_ptr, out_ptr, b, kvh, m, q_start, q_len, n_splits, R,
               max_splits, stride_ot, stride_oh, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
               Q_MODE: tl.constexpr):
    """Row ``m = row * GROUP + head_in_group`` of one (request, KV head), every split at once:
    the reduce kernel's merge (``_merge_splits``), by a split program of the ``SPREAD`` form
    (partials of other programs through L2, ``.cg``, after the counter's acquire)."""
    r = m // GROUP
    h = kvh * GROUP + m % GROUP
    offs_d = tl.arange(0, D_PAD)
    n = tl.where(r < q_len, n_splits, 0)  # rows past q_len: no partials, zeros
    res = _merge_splits(part_o_ptr, part_lse_ptr, b, r, h, n, R, max_splits, NUM_HEADS,
                        HEAD_DIM, D_PAD, S_PAD, ".cg")
    if Q_MODE != 2 or r < q_len:  # dense rows past q_len get zeros; packed ones belong to none
        tl.store(out_ptr + (q_start + r) * stride_ot + h * stride_oh + offs_d,
                 res.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _merge_rows(part_o_ptr, part_lse_ptr, out_ptr, b, kvh, q_start, q_len, n_splits, R,
                max_splits, stride_ot, stride_oh, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
                R_PAD: tl.constexpr, MERGE_ROWS: tl.constexpr, Q_MODE: tl.constexpr):
    """The reduce kernel's merge for the ``R * GROUP`` rows of one (request, KV head), done by
    the split program that finished last: ``MERGE_ROWS`` rows x every split per load. Partials
    of other programs are read through L2 (``.cg``), after the counter's acquire."""
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < n_splits
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    for m0 in tl.static_range(0, R_PAD * GROUP, MERGE_ROWS):
        mm = m0 + tl.arange(0, MERGE_ROWS)
        r = mm // GROUP
        h = kvh * GROUP + mm % GROUP
        dense_ok = r < R
        ok = (r < q_len) & dense_ok
        base = ((b * max_splits + offs_s[None, :]) * R + r[:, None]) * NUM_HEADS + h[:, None]
        ls_ok = ok[:, None] & s_ok[None, :]  # [MERGE_ROWS, S_PAD]
        lse = tl.load(part_lse_ptr + base, mask=ls_ok, other=float("-inf"), cache_modifier=".cg")
        top = tl.max(lse, 1)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.math.exp2(lse - top[:, None])  # 0 for absent splits / rows
        o = tl.load(part_o_ptr + base[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                    mask=ls_ok[:, :, None] & d_ok[None, None, :], other=0.0,
                    cache_modifier=".cg")  # [MERGE_ROWS, S_PAD, D_PAD]
        den = tl.sum(w, 1)
        res = tl.sum(w[:, :, None] * o, 1) / tl.where(den > 0, den, 1.0)[:, None]
        if Q_MODE == 2:
            st_ok = ok
        else:
            st_ok = dense_ok  # dense rows past q_len get zeros (w is 0 there)
        tl.store(out_ptr + (q_start + r)[:, None] * stride_ot + h[:, None] * stride_oh
                 + offs_d[None, :], res.to(out_ptr.dtype.element_ty),
                 mask=st_ok[:, None] & d_ok[None, :])


@triton.jit
def _reduce_kernel(
    part_o_ptr, part_lse_ptr, nsplit_ptr, q_lens_ptr, cu_q_ptr, out_ptr,
    stride_ot, stride_oh, R, max_splits, batch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
    Q_MODE: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    sig_ptr=None, SIGNAL: tl.constexpr = False,
):
    # one program per (request, row, head); all splits loaded in one shot (no serial loop).
    # SIGNAL: every program counts itself done at ``sig_ptr`` after its store (pdl.signal_done).
    # Packed: programs past batch * R zero the padding rows (t >= cu_q_lens[B]), no memset.
    # EARLY (PDL): the successor may launch before this kernel's wait (its own wait covers both).
    if PDL and EARLY:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    else:
        pdl_enter(PDL)
    pid = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    if pid >= batch * R:
        t = pid - batch * R
        if t >= tl.load(cu_q_ptr + batch):
            tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d,
                     tl.zeros([D_PAD], dtype=out_ptr.dtype.element_ty), mask=d_ok)
    else:
        b = pid // R
        r = pid % R
        q_start, q_len = _row_layout(b, q_lens_ptr, cu_q_ptr, R, Q_MODE)
        out_ptrs = out_ptr + (q_start + r) * stride_ot + h * stride_oh + offs_d
        if r < q_len:
            res = _merge_splits(part_o_ptr, part_lse_ptr, b, r, h, tl.load(nsplit_ptr + b), R,
                                max_splits, NUM_HEADS, HEAD_DIM, D_PAD, S_PAD, "")
            tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=d_ok)
        elif Q_MODE != 2:
            tl.store(out_ptrs, tl.zeros([D_PAD], dtype=out_ptr.dtype.element_ty), mask=d_ok)
    if SIGNAL:
        signal_done(sig_ptr)


def _panel_successor(successor_panel: bool | None, tune: KernelConfig) -> bool:
    """Whether the launch after attention is a register panel (None: wherever panels are on)."""
    return tune.gemv.panel if successor_panel is None else bool(successor_panel)


def paged_attention_triton(
    q: torch.Tensor,  # [B, R, H, D] dense or [T, H, D] packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    num_q_rows: int,
    scale: float,
    num_splits: torch.Tensor,  # [B] int32 (attention_tiling_update)
    split_len: torch.Tensor,  # [B] int32
    max_splits: int,
    *,
    q_lens: torch.Tensor | None = None,  # [B] int32, dense only
    cu_q_lens: torch.Tensor | None = None,  # [B + 1] int32, packed only
    out: torch.Tensor | None = None,  # like q
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    rope: tuple | None = None,  # (k_new [T, KVH, D], v_new [T, KVH, D], cos_sin_cache, qk_norm)
    pdl: bool = False,
    meta_settled: bool = False,
    signal=None,  # ops.AttnSignal: counted done per finished piece, its target set here
    successor_panel: bool | None = None,  # the next launch is a register panel (reduce release)
    tune: KernelConfig = DEFAULT_KERNELS,  # the caller's kernel configuration
) -> torch.Tensor:
    """Launch the split kernel (and the reduce when ``max_splits > 1``). Inputs are validated by
    ``ops.paged_attention`` / ``ops.rope_paged_attention``; this function trusts them.

    ``rope``: q is the raw projection (any row/head stride); the kernel applies the optional
    per-head q/k norm (``qk_norm = (q_w, k_w, eps)`` or None) and rotary to q and to the new k
    rows, and writes the new k, v rows to the cache itself (packed layout).

    ``meta_settled``: the caller vouches that the kernel launched just before this one writes
    none of the metadata (``seq_lens``, ``q_lens``/``cu_q_lens``, the tiling, the block table), so
    each program reads it (and, with PDL, prefetches its first cached K/V tiles into L2,
    ``AttentionTuning.prefetch_tiles``) before its PDL wait.

    ``signal`` (an ``ops.AttnSignal``, PDL only): the launch counts its finished pieces in
    ``signal.counters[0]`` (one per program of a single-split or reduce launch, one per merge of
    a folded one) and sets ``signal.target`` to their number, for the consumer to poll."""
    batch = block_table.shape[0]
    _, page, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[-2]
    group = num_heads // num_kv_heads
    q3 = q.reshape(-1, num_heads, head_dim)  # [rows, H, D] view (q is contiguous in its rows)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    o3 = out.reshape(-1, num_heads, head_dim)
    direct = max_splits == 1
    if cu_q_lens is not None:
        mode = _PACKED
        if direct:
            o3.zero_()  # rows of no request (the reduce kernel zeroes them otherwise)
    elif q_lens is not None:
        mode = _DENSE_QLENS
    else:
        mode = _DENSE
    dummy = seq_lens
    att = tune.attention
    fold = not direct and fold_wanted(batch, num_kv_heads, max_splits, num_q_rows, group,
                                      num_sms(q.device), att.fold_override, att.fold_max_merge)
    cnt = _counters(q.device, batch * num_kv_heads) if fold else None
    fold = cnt is not None
    spread = (not direct and not fold and signal is None and not interpreting()
              and spread_wanted(batch, num_kv_heads, max_splits, num_q_rows, num_sms(q.device),
                                att.spread_override))
    if spread:  # [B * KVH, 2]: arrivals, departures
        cnt = arrival_counters("attention_spread", q.device, 2 * batch * num_kv_heads)
        spread = cnt is not None
    block_m = max(att.min_block_m, triton.next_power_of_2(num_q_rows * group))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    s_pad = triton.next_power_of_2(max_splits)
    num_warps = att.warps or num_warps
    num_stages = att.stages or num_stages
    # rows merged per load by the last split program: ~64 fp32 of partials per thread
    merge_rows = max(1, min(triton.next_power_of_2(num_q_rows) * group,
                            64 * 32 * num_warps // (s_pad * d_pad)))
    merge_rows = 1 << (merge_rows.bit_length() - 1)  # a power of two
    if direct:
        part_o = part_lse = o3  # unused
    else:
        part_o = torch.empty(batch, max_splits, num_q_rows, num_heads, head_dim,
                             dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, max_splits, num_q_rows, num_heads,
                               dtype=torch.float32, device=q.device)
    log2e = 1.4426950408889634
    early = meta_settled and tune.prewait and att.prewait_rows(num_q_rows)
    if rope is not None:
        k_new, v_new, cos_sin, qk_norm = rope
        qw, kw, eps = qk_norm if qk_norm is not None else (cos_sin, cos_sin, 0.0)
        extra = (k_new, v_new, cos_sin, qw, kw)
        extra_strides = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
                         cos_sin.stride(0))
    else:
        extra, extra_strides, eps = (o3,) * 5, (0,) * 5, 0.0
    reduce_grid = (batch * num_q_rows + (o3.shape[0] if mode == _PACKED else 0), num_heads)
    sig = {}
    if signal is not None:
        signal.target = (batch * num_kv_heads if direct or fold
                         else reduce_grid[0] * reduce_grid[1])
        sig = dict(sig_ptr=signal.counters, SIGNAL=True)
    _split_kernel[(batch * num_kv_heads, max_splits)](
        q3, k_cache, v_cache, block_table, seq_lens,
        q_lens if q_lens is not None else dummy, cu_q_lens if cu_q_lens is not None else dummy,
        num_splits, split_len, o3, part_o, part_lse, *extra, cnt if fold or spread else dummy,
        q3.stride(0), q3.stride(1), o3.stride(0), o3.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        *extra_strides, num_q_rows, max_splits, scale * log2e, eps, batch, o3.shape[0],
        NUM_KV_HEADS=num_kv_heads, NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        SPREAD=spread, D_PAD=d_pad, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, Q_MODE=mode, DIRECT=direct,
        ROPE=rope is not None, QK_NORM=rope is not None and rope[3] is not None,
        R_PAD=triton.next_power_of_2(num_q_rows), PDL=pdl, FOLD=fold, S_PAD=s_pad,
        MERGE_ROWS=merge_rows, G_PAD=triton.next_power_of_2(group),
        META_EARLY=early, PREFETCH=att.prefetch_tiles if pdl and early else 0,
        LINE=max(1, 128 // k_cache.element_size()), RELEASE=att.release_level if pdl else 0,
        PREC=tune.precision.fp32_dot if k_cache.dtype == torch.float32 else None,
        **(sig if direct or fold else {}),
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    if not direct and not fold and not spread:
        _reduce_kernel[reduce_grid](
            part_o, part_lse, num_splits,
            q_lens if q_lens is not None else dummy, cu_q_lens if cu_q_lens is not None else dummy,
            o3, o3.stride(0), o3.stride(1), num_q_rows, max_splits, batch,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
            S_PAD=s_pad, Q_MODE=mode, PDL=pdl,
            EARLY=pdl and att.reduce_early(_panel_successor(successor_panel, tune)), **sig,
            num_warps=num_warps,
            launch_pdl=pdl,
        )
    return out
