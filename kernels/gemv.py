"""Triton split-K GEMV / skinny GEMM for decode: ``y[M, N] = x[M, K] @ w[N, K].T``, M small.

Owns the weight-streaming matmul of the decode and verify steps (M = 1..64 rows), where time is
the weight bytes over memory bandwidth. One program reads a ``[BLOCK_N, K / split_k]`` panel of
``w`` exactly once for all M rows (one M tile covers every row, so weights are never re-read),
accumulating in fp32. ``split_k > 1`` splits K across programs to put enough loads in flight
when N is small (o_proj, down_proj); the fp32 partials ``[split_k, M, N]`` are summed by a
second tiny kernel. Two inner products: ``tl.dot`` (tensor cores, M padded to 16) and, for
M <= 4, a broadcast-multiply-sum on the CUDA cores (``fma``). Configs come from
``pick_config`` (a table tuned on an H200, see bench/KERNEL_NOTES.md) or are passed explicitly.
Weight layout is nn.Linear's ``[N, K]`` row-major (K contiguous). Reference:
``reference.linear_ref``.

Epilogue fusions of the decode layer (each saves a launch and a round trip of the activations):
``silu_mul`` (the gate/up weight's rows interleave ``gate_i, up_i``, so one program holds both
halves of its outputs and stores ``silu(gate) * up``) and a residual add (``residual +=
x @ w.T`` in place). Prologues (norm, SwiGLU applied to x tiles as they load) were tried and
dropped: math on a dot operand stopped Triton 3.6 from pipelining the loop's loads (2-6x slower
GEMVs on the H200, bench/KERNEL_NOTES.md). With ``pdl`` > 0 the launch is a programmatic
dependent launch (Hopper, ``SPECCAL_PDL``, default ``late``): the kernel waits for its predecessor
(``griddepcontrol.wait``) before its first read and lets its successor launch either at once
(mode 1) or after its K loop (mode 2, ``late``), so launch latency overlaps the previous kernel.
Before its wait a program does what the predecessor cannot change: an L2 prefetch of its first
weight tiles (``prefetch``), the residual where the caller vouches for it (``residual_settled``)
and, in the split-K reduce, the norm weight and the residual row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from speccal.errors import InputError
from speccal.kernels._backend import num_sms
from speccal.kernels.rmsnorm import norm_row_store, rms_norm_triton

__all__ = ["GemvConfig", "linear_triton", "pick_config"]


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of the skinny GEMM (all powers of two)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fma: bool = False


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
    PREFETCH: tl.constexpr, LINE: tl.constexpr, RES_EARLY: tl.constexpr,
):
    # GLU: weight rows interleave (gate_i, up_i); y[:, i] = silu(gate_i) * up_i (y is [M, N/2]),
    # split 1 only. RES: y += acc (y is the residual stream; at split > 1 the reduce adds).
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
    if RES_EARLY:
        res = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    if PDL > 0:  # 1: let the next kernel launch now; 2: only once this one's K loop is done
        tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()
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
            acc = tl.dot(x, tl.trans(w), acc)  # [BLOCK_M, BLOCK_N]
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    if GLU:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        act = gate / (1.0 + tl.exp(-gate)) * up  # [BLOCK_M, BLOCK_N // 2]
        offs_h = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_h[None, :],
                 act.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_h < N // 2)[None, :])
    elif DIRECT:
        if RES_EARLY:
            acc += res
        elif RES:
            acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        p_ptrs = part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _splitk_reduce_kernel(part_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr,
                          BLOCK: tl.constexpr, RES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=ok, other=0.0)
    acc += res
    h = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * stride_ym + offs, h, mask=ok)
    norm_row_store(h.to(tl.float32), w, xn_ptr + m * stride_xm, offs, ok, N, eps)


def _cfg(bn: int, bk: int, split: int, stages: int = 4) -> GemvConfig:
    return GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=stages)


# (N, K) -> [(max_m, config)], first max_m >= m wins. The ~2B preset's shapes, tuned on an H200
# (bench/bench_kernels.py --sweep; runs v1 and v2 in bench/KERNEL_NOTES.md: qkv and o come from
# the wider v2 sweep); other shapes use the heuristic, which encodes the same pattern.
_TABLE: dict[tuple[int, int], list[tuple[int, GemvConfig]]] = {
    (12288, 2048): [(64, _cfg(128, 128, 1))],  # gate_up
    (2048, 6144): [(64, _cfg(64, 128, 4))],  # down
    (151936, 2048): [(8, _cfg(64, 256, 1, 3)), (64, _cfg(128, 128, 1))],  # lm_head
    (4096, 2048): [(64, _cfg(32, 128, 1, 6))],  # qkv
    (2048, 2048): [(1, _cfg(64, 128, 4)), (64, _cfg(32, 128, 1, 6))],  # o
}


# residual-add launches: o at split 1 (add in the epilogue) measured 6.4 us vs 6.5 + a reduce;
# down keeps split 4 (10.7 us) and adds in the reduce (split 1 measured 13.4 us), H200, M = 1
_RESIDUAL_TABLE: dict[tuple[int, int], list[tuple[int, GemvConfig]]] = {
    (2048, 2048): [(64, _cfg(16, 256, 1, 4))],  # o + residual
}


def _heuristic(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    # v1 sweep: one wave of ~100-130 programs streaming long K panels beat more, shorter ones
    block_n = 128 if n >= 8192 else 64
    block_k = 128
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= num_sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return _cfg(block_n, block_k, split)


def pick_config(m: int, n: int, k: int, num_sms: int = 132,
                epilogue: str | None = None) -> GemvConfig:
    """Config for an ``[m, k] x [n, k]^T`` product: the tuned table, else a heuristic.

    ``epilogue``: ``"residual"`` looks in ``_RESIDUAL_TABLE`` first (split 1 where adding in the
    GEMV's epilogue beats a split-K reduce that adds); ``"silu_mul"`` forces split 1, a split-K
    entry becoming one program per ``block_n / split_k`` rows (same program count).
    """
    cfg = None
    first = _RESIDUAL_TABLE.get((n, k), []) if epilogue == "residual" else []
    for max_m, c in first + _TABLE.get((n, k), []):
        if m <= max_m:
            cfg = c
            break
    cfg = cfg or _heuristic(m, n, k, num_sms)
    if epilogue == "silu_mul" and cfg.split_k > 1:
        bn = max(16, cfg.block_n // cfg.split_k)
        cfg = GemvConfig(block_n=bn, block_k=cfg.block_k, split_k=1, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, fma=cfg.fma)
    return cfg


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
    residual_settled: bool = False,  # the previous kernel does not write ``residual``
) -> torch.Tensor:  # out
    """``x @ weight.T`` (then SwiGLU, or ``+ residual`` in place); validated by ``ops.linear``.

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
    cfg = config or pick_config(m, n, k, num_sms(x.device),
                                epilogue="residual" if residual is not None else epilogue)
    if glu and cfg.block_n % 2:
        raise InputError("config.block_n", cfg.block_n, "even for the silu_mul epilogue")
    if residual is not None:
        out = residual
    elif out is None:
        out = torch.empty(m, n // 2 if glu else n, dtype=x.dtype, device=x.device)
    block_m = triton.next_power_of_2(max(m, 1)) if cfg.fma else max(16, triton.next_power_of_2(m))
    split = 1 if glu else max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    direct = split == 1
    part = out if direct else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    even_k = k % k_per_split == 0 and k_per_split % cfg.block_k == 0
    _skinny_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, out, part, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DIRECT=direct,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=even_k, FMA=cfg.fma, GLU=glu,
        RES=residual is not None, PDL=int(pdl),
        PREFETCH=min(prefetch, k_per_split // cfg.block_k) if pdl > 0 else 0,
        LINE=max(1, min(cfg.block_k, 128 // weight.element_size())),
        RES_EARLY=direct and residual is not None and residual_settled,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl > 0,
    )
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
