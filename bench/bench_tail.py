"""Post-wait tails of the decode layer's PDL GEMVs on one CUDA GPU (H200).

A GEMV that follows a long kernel under programmatic dependent launch (PDL) can do part of its
work before its wait (the register panel loads its whole weight panel there); what the step
pays is the *tail*: from its predecessor's end to its own end. This script measures that tail
without the rest of the step: a one-program spinner kernel (releases its successor at once,
then spins ``--spin-us`` on ``%globaltimer``) precedes each GEMV launch, and

    tail = time(spinner -> GEMV) - time(spinner alone)

both from CUDA graphs of ``--reps`` pairs (weights rotated over copies past the 60 MB L2),
replayed under CUDA events (median of ``--repeats``). Cases: the o projection with the deferred
norm (the layer's real launch: register panel at <= 8 rows, the streaming kernel with the
panel off) at 1 and 6 rows (6 = full-width verification at B = 1), the panel without the
deferred norm, and the QKV GEMV that consumes a deferred norm (``row_scale``) at 1 and 6 rows.
Bench-only panel forms (``_panel_try``, not used by the runner) test where the 6-row panel's
tail goes: x as the dot's A operand, x loaded before the wait (diagnostic only: not a valid
schedule), the batched dot without the deferred norm's epilogue. Writes ``--out/tail.json``.

Usage: python3 bench/bench_tail.py --out DIR [--spin-us 12] [--reps 20] [--repeats 7]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from cuda_timing import capture, events_ms

from speccal.kernels import gemv, ops
from speccal.kernels.config import KernelConfig
from speccal.kernels.gemv import GemvConfig

HIDDEN, QKV_N = 2048, 4096
DT = torch.bfloat16


@triton.jit
def _now(dummy):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(ns):
    tl.extra.cuda.gdc_launch_dependents()
    t0 = _now(ns)
    t = t0
    while t - t0 < ns:
        t = _now(ns)


def spin(ns: int, dummy: torch.Tensor) -> None:
    _spin_kernel[(1,)](ns, num_warps=1)


@triton.jit
def _panel_try(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KC: tl.constexpr,
               NCH: tl.constexpr, XA: tl.constexpr, XEARLY: tl.constexpr,
               nw_ptr, xw_ptr, ss_ptr, stride_xw, P, DEFER: tl.constexpr,
               PRECVT: tl.constexpr = False):
    # the 6-row register panel (gemv._panel_kernel, DOT, RES_EARLY, PDL late) with two knobs:
    # XA: x chunks [NCH, BLOCK_M, KC] as the dot's A operand, the panel transposed as B (the
    # product comes out [M, N], no transpose); XEARLY: x loaded before the wait (diagnostic);
    # PRECVT: a dot with zeros before the wait, so the panel's conversion to the dot operand's
    # registers happens there (the real dot accumulates onto it).
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, KC)
    offs_m = tl.arange(0, BLOCK_M)
    offs_b = tl.arange(0, NCH)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    kk = offs_b[:, None, None] * KC + offs_c[None, None, :]
    w = tl.load(rows[None, :, :] + kk, mask=n_ok[None, :, None] & (kk < K), other=0.0)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_ok[:, None] & n_ok[None, :]
    res = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if XA:
        kx = offs_b[:, None, None] * KC + offs_c[None, None, :]  # [NCH, 1, KC]
        xp = x_ptr + offs_m[None, :, None] * stride_xm + kx
        xmask = m_ok[None, :, None] & (kx < K)
    else:
        kx = offs_b[:, None, None] * KC + offs_c[None, :, None]  # [NCH, KC, 1]
        xp = x_ptr + offs_m[None, None, :] * stride_xm + kx
        xmask = m_ok[None, None, :] & (kx < K)
    if XEARLY:
        x3 = tl.load(xp, mask=xmask, other=0.0)
    if PRECVT:
        acc0 = tl.dot(w, tl.zeros([NCH, KC, BLOCK_M], dtype=w.dtype))
    else:
        acc0 = tl.zeros([NCH, BLOCK_N, BLOCK_M], dtype=tl.float32)
    tl.extra.cuda.gdc_wait()
    if not XEARLY:
        x3 = tl.load(xp, mask=xmask, other=0.0)
    if XA:
        acc = tl.sum(tl.dot(x3, tl.trans(w, (0, 2, 1))), 0)  # [BLOCK_M, BLOCK_N]
    else:
        acc = tl.trans(tl.sum(tl.dot(w, x3, acc0), 0))
    tl.extra.cuda.gdc_launch_dependents()
    gemv._residual_store(acc, res, y_ptrs, y_mask, m_ok, offs_m, offs_n, pid_n, xw_ptr, ss_ptr,
                         stride_xw, P, nw if DEFER else acc, True, True, DEFER)


def panel_try(x, w, h, nw, xw, ss, xa: bool, xearly: bool, defer: bool, nch: int = 4,
              block_n: int = 16, warps: int = 8, block_m: int = 16, precvt: bool = False) -> None:
    m, k = x.shape
    n = w.shape[0]
    _panel_try[(triton.cdiv(n, block_n),)](
        x, w, h, m, n, k, x.stride(0), w.stride(0), h.stride(0),
        BLOCK_M=max(block_m, triton.next_power_of_2(m)), BLOCK_N=block_n, KC=k // nch, NCH=nch,
        XA=xa, XEARLY=xearly, nw_ptr=nw, xw_ptr=xw, ss_ptr=ss, stride_xw=xw.stride(0),
        P=ss.shape[1], DEFER=defer, PRECVT=precvt, num_warps=warps, num_stages=1, launch_pdl=True,
    )


def graph_us(launches, reps: int, repeats: int) -> float:
    """Mean time of one pass over ``launches`` (callables taking the rep index) from a CUDA
    graph of ``reps`` passes, median over ``repeats`` timings of 10 replays."""
    g = capture([functools.partial(f, i) for i in range(reps) for f in launches])
    return events_ms(g.replay, 10, repeats) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--spin-us", type=float, default=12.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--only", default="", help="comma list of case names (default: all)")
    ap.add_argument("--eager", type=int, default=0,
                    help="no graphs: run each case this many times eagerly (for ncu) and exit")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    ns = int(args.spin_us * 1e3)
    dummy = torch.zeros(1, device=dev)
    wo = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=DT) * 0.02 for _ in range(args.copies)]
    wqkv = [torch.randn(QKV_N, HIDDEN, device=dev, dtype=DT) * 0.02 for _ in range(args.copies)]
    nw = torch.rand(HIDDEN, device=dev, dtype=DT) + 0.5
    res: dict = {"spin_us": args.spin_us, "reps": args.reps, "repeats": args.repeats,
                 "device": torch.cuda.get_device_name(), "cases": {}}
    state = {"tune": KernelConfig.from_env()}  # each case's kernel configuration (its env)

    def o_case(m: int, how: str):
        x = torch.randn(m, HIDDEN, device=dev, dtype=DT)
        h = torch.randn(m, HIDDEN, device=dev, dtype=DT)

        def run(i):
            w = wo[i % len(wo)]
            if how == "defer":
                ops.linear_deferred_norm(x, w, h, nw, 1e-6, residual_settled=True,
                                         tune=state["tune"])
            else:
                ops.linear(x, w, residual=h, residual_settled=True, tune=state["tune"])
        return run

    def try_case(m: int, xa: bool, xearly: bool, defer: bool, nch: int = 4, block_n: int = 16,
                 warps: int = 8, block_m: int = 16, precvt: bool = False):
        x = torch.randn(m, HIDDEN, device=dev, dtype=DT)
        h = torch.randn(m, HIDDEN, device=dev, dtype=DT)
        xw = torch.empty_like(h)
        ss = torch.empty(m, HIDDEN // block_n, device=dev, dtype=torch.float32)
        return lambda i: panel_try(x, wo[i % len(wo)], h, nw, xw, ss, xa, xearly, defer, nch,
                                   block_n, warps, block_m, precvt)

    def qkv_case(m: int, config: GemvConfig | None = None, scaled: bool = True):
        hh = torch.randn(m, HIDDEN, device=dev, dtype=DT)
        xo = torch.randn(m, HIDDEN, device=dev, dtype=DT)
        dn = ops.linear_deferred_norm(xo, wo[0], hh, nw, 1e-6, tune=state["tune"])  # row factors

        def run(i):
            ops.linear(dn.xw, wqkv[i % len(wqkv)], row_scale=dn if scaled else None,
                       config=config, tune=state["tune"])
        return run

    def cfg(bn, bk, stages, warps=4):
        return GemvConfig(bn, bk, 1, warps, stages)

    cases = {  # name -> (env, builder)
        "o_defer_m1": ({}, lambda: o_case(1, "defer")),
        "o_defer_m6": ({}, lambda: o_case(6, "defer")),
        "o_defer_m6_ch8": ({"SPECCAL_PANEL_CHUNKS": "8"}, lambda: o_case(6, "defer")),
        "o_defer_m6_stream": ({"SPECCAL_GEMV_PANEL": "0"}, lambda: o_case(6, "defer")),
        "o_defer_m1_stream": ({"SPECCAL_GEMV_PANEL": "0"}, lambda: o_case(1, "defer")),
        "o_res_m6": ({}, lambda: o_case(6, "res")),
        "o_defer_m6_pc": ({"SPECCAL_PANEL_PRECVT": "1"}, lambda: o_case(6, "defer")),
        "o_defer_m6_pc8": ({"SPECCAL_PANEL_PRECVT": "1", "SPECCAL_PANEL_CHUNKS": "8"},
                           lambda: o_case(6, "defer")),
        "o_defer_m6_pc8_bm8": ({"SPECCAL_PANEL_PRECVT": "1", "SPECCAL_PANEL_CHUNKS": "8",
                                "SPECCAL_GEMV_MIN_BLOCK_M": "8"}, lambda: o_case(6, "defer")),
        "o_defer_m2_pc8_bm8": ({"SPECCAL_PANEL_PRECVT": "1", "SPECCAL_PANEL_CHUNKS": "8",
                                "SPECCAL_GEMV_MIN_BLOCK_M": "8"}, lambda: o_case(2, "defer")),
        "o_defer_m8_pc8_bm8": ({"SPECCAL_PANEL_PRECVT": "1", "SPECCAL_PANEL_CHUNKS": "8",
                                "SPECCAL_GEMV_MIN_BLOCK_M": "8"}, lambda: o_case(8, "defer")),
        "try_m6": ({}, lambda: try_case(6, False, False, True)),
        "try_m6_xa": ({}, lambda: try_case(6, True, False, True)),
        "try_m6_xa_ch8": ({}, lambda: try_case(6, True, False, True, 8)),
        "try_m6_xearly": ({}, lambda: try_case(6, False, True, True)),
        "try_m6_xa_xearly": ({}, lambda: try_case(6, True, True, True)),
        "try_m6_nodefer": ({}, lambda: try_case(6, False, False, False)),
        "try_m2": ({}, lambda: try_case(2, False, False, True)),
        "qkv_m1": ({}, lambda: qkv_case(1)),
        "qkv_m6": ({}, lambda: qkv_case(6)),
        "try_m6_w4": ({}, lambda: try_case(6, False, False, True, warps=4)),
        "try_m6_ch8_w8": ({}, lambda: try_case(6, False, False, True, nch=8)),
        "qkv_m6_32x6": ({}, lambda: qkv_case(6, cfg(32, 128, 6))),
        "qkv_m6_32x4": ({}, lambda: qkv_case(6, cfg(32, 128, 4))),
        "qkv_m6_32x256x4": ({}, lambda: qkv_case(6, cfg(32, 256, 4))),
        "qkv_m6_64x6": ({}, lambda: qkv_case(6, cfg(64, 128, 6))),
        "qkv_m6_16x6": ({}, lambda: qkv_case(6, cfg(16, 128, 6))),
        "qkv_m8_32x6": ({}, lambda: qkv_case(8, cfg(32, 128, 6))),
        "qkv_m8": ({}, lambda: qkv_case(8)),
        "try_m6_pc": ({}, lambda: try_case(6, False, False, True, precvt=True)),
        "try_m6_pc_ch8": ({}, lambda: try_case(6, False, False, True, nch=8, precvt=True)),
        "try_m6_bm8_ch8": ({}, lambda: try_case(6, False, False, True, nch=8, block_m=8)),
        "try_m6_bm8_pc_ch4": ({}, lambda: try_case(6, False, False, True, block_m=8,
                                                    precvt=True)),
        "try_m6_bm8_pc_ch8": ({}, lambda: try_case(6, False, False, True, nch=8, block_m=8,
                                                    precvt=True)),
        "try_m8_bm8_pc_ch8": ({}, lambda: try_case(8, False, False, True, nch=8, block_m=8,
                                                    precvt=True)),
        "try_m2_bm8_pc_ch8": ({}, lambda: try_case(2, False, False, True, nch=8, block_m=8,
                                                    precvt=True)),
        "try_m1_bm1_pc_ch8": ({}, lambda: try_case(1, False, False, True, nch=8, block_m=1,
                                                    precvt=True)),
        "try_m1_bm8_pc_ch8": ({}, lambda: try_case(1, False, False, True, nch=8, block_m=8,
                                                    precvt=True)),
        "qkv_m6_bm8": ({"BLOCK_M": "8"}, lambda: qkv_case(6)),
        "qkv_m6_32x6_bm8": ({"BLOCK_M": "8"}, lambda: qkv_case(6, cfg(32, 128, 6))),
        "qkv_m1_bm1": ({"BLOCK_M": "1"}, lambda: qkv_case(1)),
        "qkvp_m6_bm8": ({"BLOCK_M": "8"}, lambda: qkv_case(6, scaled=False)),
        "qkvp_m1": ({}, lambda: qkv_case(1, scaled=False)),
        "qkvp_m6": ({}, lambda: qkv_case(6, scaled=False)),
        "qkvp_m6_32x6": ({}, lambda: qkv_case(6, cfg(32, 128, 6), scaled=False)),
    }
    # the bench-only panel forms against the runner's launch (same inputs)
    for xa in (False, True):
        x = torch.randn(6, HIDDEN, device=dev, dtype=DT)
        h0 = torch.randn(6, HIDDEN, device=dev, dtype=DT)
        h1 = h0.clone()
        ref = ops.linear_deferred_norm(x, wo[0], h0, nw, 1e-6, residual_settled=True)
        xw = torch.empty_like(h1)
        ss = torch.empty(6, HIDDEN // 16, device=dev, dtype=torch.float32)
        panel_try(x, wo[0], h1, nw, xw, ss, xa, False, True)
        torch.cuda.synchronize()
        err = max((h1.float() - h0.float()).abs().max().item(),
                  (xw.float() - ref.xw.float()).abs().max().item(),
                  (ss - ref.ss).abs().max().item() / ref.ss.abs().max().item())
        print(f"panel_try xa={xa}: max abs diff vs the runner's launch {err:.3g}", flush=True)
        res[f"check_xa{int(xa)}"] = err
    only = [c for c in args.only.split(",") if c]
    names = only or list(cases)
    for name in names:
        env, build = cases[name]
        env = dict(env)
        block_m = env.pop("BLOCK_M", None)
        if block_m:  # the streaming kernel's smallest M tile (tl.dot pads M below 16 on the H200)
            env["SPECCAL_GEMV_MIN_BLOCK_M"] = block_m
        state["tune"] = KernelConfig.from_env({**os.environ, **env})
        fn = build()
        if args.eager:
            for i in range(args.eager):
                spin(ns, dummy)
                fn(i)
            torch.cuda.synchronize()
            continue
        both = graph_us([lambda i: spin(ns, dummy), fn], args.reps, args.repeats)
        alone = graph_us([lambda i: spin(ns, dummy)], args.reps, args.repeats)
        cold = graph_us([fn], args.reps, args.repeats)
        res["cases"][name] = {"tail_us": both - alone, "pair_us": both, "spin_us": alone,
                              "alone_us": cold, "env": env}
        print(f"{name:22s} tail {both - alone:6.2f} us  (pair {both:6.2f}, spin {alone:6.2f}, "
              f"kernel alone {cold:6.2f})", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tail.json").write_text(json.dumps(res, indent=1))
    res["wall_s"] = time.time()
    (Path(args.out) / "tail.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
