"""Kernel benchmarks on one CUDA GPU: speccal.kernels (Triton) against the torch/cuBLAS peer.

Method (docs: bench/KERNEL_NOTES.md): the copy bandwidth is measured first in the same run (a
2 GiB device-to-device copy, bytes read + written) and every floor is ``bytes / copy_bw``;
inputs are random, rotated over enough copies to exceed the 60 MB L2 several times; each timing
is the median over repeats (``triton.testing.do_bench``) of a CUDA-graph replay holding many
launches, divided by the launches in it, so host launch cost is out of the numbers (as in the
captured decode step). Prints a table last; writes JSON lines to ``--out``.

Usage: ``python3 bench/bench_kernels.py --out $OUT [--budget-s 200] [--sweep]``
"""

# ruff: noqa: B023  (closures are called inside the loop iteration that made them: capture)
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
import triton
from cuda_timing import capture
from triton.testing import do_bench

from speccal.kernels import ops
from speccal.kernels.gemv import GemvConfig, linear_triton, pick_config

L2_BYTES = 60 * 2**20
DT = torch.bfloat16
# ~2B dense preset (Qwen3-1.7B-like): hidden 2048, 16 heads / 8 KV heads x 128, inter 6144
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 2048, 16, 8, 128, 6144, 151936, 28
SHAPES = {  # name -> (N, K) of nn.Linear weight [N, K]; largest share of the step first
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
}
ROWS = [1, 6, 8, 48]  # 6: full-width verify (w = 5) at B = 1

RECORDS: list[dict] = []
TABLE: list[tuple] = []
T0 = time.time()


def record(metric, value, unit, **ctx):
    RECORDS.append({"metric": metric, "value": value, "unit": unit, **ctx})


def graph_time_us(fns, reps=1, rep_ms=40):
    """Median time of one call, from a CUDA graph holding ``reps`` passes over ``fns``."""
    g = capture(fns, reps)
    ms = do_bench(g.replay, warmup=10, rep=rep_ms, return_mode="median")
    del g
    return 1000.0 * ms / (reps * len(fns))


def copies_for(nbytes, lo=1, hi=48):
    return max(lo, min(hi, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def copy_bandwidth():
    n = 2**30  # 1 GiB each way... x2 buffers of 1 GiB bf16 elements = 2 GiB
    x = torch.randn(n // 2, device="cuda", dtype=DT)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    bw = 2 * x.numel() * 2 / (ms * 1e-3) / 1e9
    ms2 = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    bw2 = 2 * x.numel() * 2 / (ms2 * 1e-3) / 1e9
    return max(bw, bw2), (bw, bw2)


# ---------------------------------------------------------------------------------------------
# GEMV / skinny GEMM


def _configs(m, n, k):
    out = []
    tiles = [(64, 128, 4, 4), (128, 128, 4, 4), (64, 256, 3, 4), (32, 256, 4, 4), (128, 64, 5, 4),
             (16, 512, 4, 4), (32, 512, 3, 4), (64, 256, 4, 8), (128, 128, 6, 8), (32, 128, 6, 4)]
    for bn, bk, st, wp in tiles:
        nt = triton.cdiv(n, bn)
        for split in (1, 2, 4, 8, 16):
            if split > 1 and (nt * split > 10 * 132 or k // split < bk):
                continue
            if split == 1 or nt * split >= 66:
                out.append(GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=wp,
                                      num_stages=st))
    if m <= 2:
        for bn, bk, split in ((32, 128, 1), (16, 128, 4)):
            if split == 1 or triton.cdiv(n, bn) * split <= 10 * 132:
                out.append(GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=4,
                                      num_stages=3, fma=True))
    return out


def bench_gemv(copy_bw, sweep, budget_s):
    best = {}
    for name, (n, k) in SHAPES.items():
        wbytes = n * k * 2
        ncopy = copies_for(wbytes)
        ws = [torch.randn(n, k, device="cuda", dtype=DT) / math.sqrt(k) for _ in range(ncopy)]
        for m in ROWS:
            xs = [torch.randn(m, k, device="cuda", dtype=DT) for _ in range(ncopy)]
            ys = [torch.empty(m, n, device="cuda", dtype=DT) for _ in range(ncopy)]
            nbytes = wbytes + m * k * 2 + m * n * 2
            floor_us = nbytes / (copy_bw * 1e9) * 1e6
            reps = max(1, 16 // ncopy)

            def mk(fn, i):
                return lambda: fn(xs[i], ws[i], ys[i])

            t_cublas = graph_time_us(
                [mk(lambda x, w, y: torch.mm(x, w.t(), out=y), i) for i in range(ncopy)], reps)
            heur = pick_config(m, n, k)
            cands = [heur] + (_configs(m, n, k) if sweep and time.time() - T0 < budget_s else [])
            results = []
            for cfg in cands:
                try:
                    ref = linear_triton(xs[0], ws[0], config=cfg)
                    err = ((ref.float() - xs[0].float() @ ws[0].float().t()).norm()
                           / (xs[0].float() @ ws[0].float().t()).norm()).item()
                    if not err < 1e-2:
                        print(f"BAD {name} m={m} {cfg} rel_err={err}")
                        continue
                    t = graph_time_us(
                        [mk(lambda x, w, y, c=cfg: linear_triton(x, w, out=y, config=c), i)
                         for i in range(ncopy)], reps)
                except Exception as e:  # a config that does not compile is skipped, with reason
                    print(f"SKIP {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                results.append((t, cfg))
            t_heur = results[0][0] if results and results[0][1] == heur else float("nan")
            t_best, cfg_best = min(results, key=lambda r: r[0])
            best[(name, m)] = (t_best, cfg_best)
            for label, t in (("cublas", t_cublas), ("triton_heur", t_heur),
                             ("triton_best", t_best)):
                TABLE.append(("gemv", f"{name} M={m} N={n} K={k}", label, t,
                              nbytes / (t * 1e-6) / 1e9, t / floor_us, t / t_cublas))
                record("kernel_gemv_us", round(t, 3), "us", kernel="gemv", variant=label,
                       shape=name, m=m, n=n, k=k, floor_us=round(floor_us, 3),
                       floor_ratio=round(t / floor_us, 4), ratio_to_cublas=round(t / t_cublas, 4),
                       config=repr(cfg_best) if label == "triton_best" else
                       (repr(heur) if label == "triton_heur" else None))
            print(f"[{time.time() - T0:6.1f}s] gemv {name} m={m}: cublas {t_cublas:.2f} "
                  f"heur {t_heur:.2f} best {t_best:.2f} us ({cfg_best}) floor {floor_us:.2f}",
                  flush=True)
        torch.cuda.empty_cache()
    return best


def bench_chain(copy_bw, best):
    """The whole matmul chain of one decode step (28 layers + LM head) in one graph."""
    layers = [{nm: torch.randn(*SHAPES[nm], device="cuda", dtype=DT) / 45 for nm in
               ("qkv", "o", "gate_up", "down")} for _ in range(LAYERS)]
    lm = torch.randn(*SHAPES["lm_head"], device="cuda", dtype=DT) / 45
    wbytes = sum(w.numel() * 2 for lay in layers for w in lay.values()) + lm.numel() * 2
    for m in ROWS:
        x = {nm: torch.randn(m, SHAPES[nm][1], device="cuda", dtype=DT) for nm in SHAPES}
        y = {nm: torch.empty(m, SHAPES[nm][0], device="cuda", dtype=DT) for nm in SHAPES}
        floor_us = (wbytes + 0.0) / (copy_bw * 1e9) * 1e6

        def chain(fn):
            def run():
                for lay in layers:
                    for nm, w in lay.items():
                        fn(x[nm], w, y[nm], nm)
                fn(x["lm_head"], lm, y["lm_head"], "lm_head")
            return run

        t_cublas = graph_time_us([chain(lambda a, w, o, nm: torch.mm(a, w.t(), out=o))], 1, 200)
        cfgs = {nm: (best.get((nm, m), (0, None))[1]) for nm in SHAPES}
        t_tri = graph_time_us(
            [chain(lambda a, w, o, nm: linear_triton(a, w, out=o, config=cfgs[nm]))], 1, 200)
        t_heur = graph_time_us([chain(lambda a, w, o, nm: linear_triton(a, w, out=o))], 1, 200)
        for label, t in (("cublas", t_cublas), ("triton_best", t_tri), ("triton_heur", t_heur)):
            TABLE.append(("matmul_chain", f"28L+lm_head M={m} ({wbytes / 1e9:.2f} GB)", label, t,
                          wbytes / (t * 1e-6) / 1e9, t / floor_us, t / t_cublas))
            record("kernel_matmul_chain_floor_ratio", round(t / floor_us, 4), "ratio",
                   kernel="matmul_chain", variant=label, m=m, time_us=round(t, 2),
                   floor_us=round(floor_us, 2), weight_bytes=wbytes,
                   ratio_to_cublas=round(t / t_cublas, 4))
        print(f"[{time.time() - T0:6.1f}s] chain m={m}: cublas {t_cublas:.1f} triton "
              f"{t_tri:.1f} heur {t_heur:.1f} floor {floor_us:.1f} us", flush=True)
    torch.cuda.empty_cache()


FUSED_CANDIDATES = [  # (block_n, block_k, stages) for the split-1 o / down launches
    (16, 256, 4), (16, 512, 3), (32, 128, 6),
]


def bench_fused_chain(copy_bw):
    """The decode step's matmul chain as the fused layer launches it (residual epilogue on o and
    down, SwiGLU epilogue on gate_up) + LM head, one graph; per o/down config (None: the table),
    without / with programmatic dependent launch (PDL modes 0, 1, 2 of ``gemv.linear_triton``)."""
    layers = [{nm: torch.randn(*SHAPES[nm], device="cuda", dtype=DT) / 45 for nm in
               ("qkv", "o", "gate_up", "down")} for _ in range(LAYERS)]
    lm = torch.randn(*SHAPES["lm_head"], device="cuda", dtype=DT) / 45
    wbytes = sum(w.numel() * 2 for lay in layers for w in lay.values()) + lm.numel() * 2
    floor_us = wbytes / (copy_bw * 1e9) * 1e6
    for m in (1, 8, 48):
        h = torch.randn(m, HIDDEN, device="cuda", dtype=DT)
        attn = torch.randn(m, HEADS * HEAD_DIM, device="cuda", dtype=DT)
        qkv = torch.empty(m, SHAPES["qkv"][0], device="cuda", dtype=DT)
        act = torch.empty(m, INTER, device="cuda", dtype=DT)
        logits = torch.empty(m, VOCAB, device="cuda", dtype=DT)

        def chain(cfg_od, pdl):
            def run():
                for lay in layers:
                    linear_triton(h, lay["qkv"], out=qkv, pdl=pdl)
                    linear_triton(attn, lay["o"], config=cfg_od, residual=h, pdl=pdl)
                    linear_triton(h, lay["gate_up"], out=act, epilogue="silu_mul", pdl=pdl)
                    linear_triton(act, lay["down"], config=cfg_od, residual=h, pdl=pdl)
                linear_triton(h, lm, out=logits, pdl=pdl)
            return run

        for cand in [None, *FUSED_CANDIDATES]:
            cfg = None if cand is None else GemvConfig(block_n=cand[0], block_k=cand[1],
                                                        split_k=1, num_warps=4,
                                                        num_stages=cand[2])
            for pdl in (0, 1, 2):
                try:
                    t = graph_time_us([chain(cfg, pdl)], 1, 200)
                except Exception as e:  # a config that does not compile is skipped, with reason
                    print(f"SKIP fused m={m} {cfg} pdl={pdl}: {type(e).__name__}: {e}"[:200])
                    continue
                name = "table" if cand is None else f"{cand[0]}x{cand[1]}s{cand[2]}"
                label = f"fused {name}" + ("", " pdl", " pdl-late")[pdl]
                TABLE.append(("fused_chain", f"28L+lm_head M={m}", label, t,
                              wbytes / (t * 1e-6) / 1e9, t / floor_us, float("nan")))
                record("kernel_fused_chain_floor_ratio", round(t / floor_us, 4), "ratio",
                       kernel="fused_chain", variant=label, m=m, time_us=round(t, 2),
                       floor_us=round(floor_us, 2), pdl=pdl, config=repr(cfg))
                print(f"[{time.time() - T0:6.1f}s] {label} m={m}: {t:.1f} us = "
                      f"{t / floor_us:.3f} floor", flush=True)
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# attention, updates, norm, rotary


def bench_attention(copy_bw):
    bs = 16
    for batch, rows, kv_len in [(1, 1, 1024), (1, 1, 8192), (1, 1, 32768), (8, 1, 1024),
                                (32, 1, 1024), (1, 6, 1024), (8, 6, 1024), (8, 6, 8192)]:
        nblk = batch * (kv_len // bs + 2) + 1
        kvbytes = batch * kv_len * KV_HEADS * HEAD_DIM * 2 * 2
        ncopy = copies_for(kvbytes, hi=8)
        caches = [(torch.randn(nblk, bs, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT),
                   torch.randn(nblk, bs, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT))
                  for _ in range(ncopy)]
        bt = (torch.randperm(nblk - 1, device="cuda")[: batch * (kv_len // bs)] + 1).view(
            batch, -1).int()
        seq = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, rows, HEADS, HEAD_DIM, device="cuda", dtype=DT)
        out = torch.empty_like(q)
        nbytes = kvbytes + 2 * q.numel() * 2
        floor_us = nbytes / (copy_bw * 1e9) * 1e6
        res = {}
        plan_v1 = ops.SplitPlan(max_splits=min(64, -(-2 * 132 // (batch * KV_HEADS))))
        for label, plan in (("triton_1split", ops.SplitPlan(1)),
                            ("triton_splitkv_v1plan", plan_v1),
                            ("triton_splitkv", ops.plan_splits(batch, KV_HEADS))):
            ns = torch.empty(batch, dtype=torch.int32, device="cuda")
            sl = torch.empty_like(ns)
            ops.attention_tiling_update(seq, ns, sl, plan)
            fns = [lambda kc=kc, vc=vc, p=plan, ns=ns, sl=sl: ops.paged_attention(
                q, kc, vc, bt, seq, rows, 0.088, tiling=(ns, sl), plan=p, out=out)
                for kc, vc in caches]
            res[label] = graph_time_us(fns, max(1, 8 // ncopy))
        # peer: SDPA over contiguous (unpaged) K/V, GQA, causal offset mask for verify rows
        kd = [c[0].view(-1, KV_HEADS, HEAD_DIM)[: batch * kv_len].view(batch, kv_len, KV_HEADS,
              HEAD_DIM).transpose(1, 2).contiguous() for c in caches]
        vd = [c[1].view(-1, KV_HEADS, HEAD_DIM)[: batch * kv_len].view(batch, kv_len, KV_HEADS,
              HEAD_DIM).transpose(1, 2).contiguous() for c in caches]
        qt = q.transpose(1, 2).contiguous()
        mask = None
        if rows > 1:
            pos = kv_len - rows + torch.arange(rows, device="cuda")
            mask = torch.arange(kv_len, device="cuda")[None, :] <= pos[:, None]
        res["sdpa_contig"] = graph_time_us(
            [lambda k=k, v=v: F.scaled_dot_product_attention(qt, k, v, attn_mask=mask,
                                                             enable_gqa=True)
             for k, v in zip(kd, vd, strict=True)], max(1, 8 // ncopy))
        for label, t in res.items():
            TABLE.append(("paged_attn", f"B={batch} rows={rows} kv={kv_len}", label, t,
                          nbytes / (t * 1e-6) / 1e9, t / floor_us, t / res["sdpa_contig"]))
            record("kernel_paged_attention_us", round(t, 3), "us", kernel="paged_attention",
                   variant=label, batch=batch, rows=rows, kv_len=kv_len,
                   floor_us=round(floor_us, 3), floor_ratio=round(t / floor_us, 4),
                   ratio_to_sdpa=round(t / res["sdpa_contig"], 4))
        print(f"[{time.time() - T0:6.1f}s] attn B={batch} R={rows} kv={kv_len}: "
              + " ".join(f"{k} {v:.2f}" for k, v in res.items()) + f" floor {floor_us:.2f}",
              flush=True)
        torch.cuda.empty_cache()


def bench_updates():
    for batch, k_max in [(1, 5), (8, 5), (48, 5)]:
        g = batch * (k_max + 1)
        base = torch.randint(0, VOCAB, (batch,), device="cuda")
        drafts = torch.randint(0, VOCAB, (batch, k_max), device="cuda")
        vl = torch.randint(0, k_max + 1, (batch,), device="cuda", dtype=torch.int32)
        ctx = torch.randint(0, 4000, (batch,), device="cuda", dtype=torch.int32)
        bt = torch.randint(1, 9000, (batch, 300), device="cuda", dtype=torch.int32)
        ids = torch.empty(g, dtype=torch.int64, device="cuda")
        pos, slots = torch.empty_like(ids), torch.empty_like(ids)
        seq = torch.empty(batch, dtype=torch.int32, device="cuda")
        cu = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
        ns, sl = torch.empty_like(seq), torch.empty_like(seq)
        plan = ops.plan_splits(batch, KV_HEADS)

        def three(backend):
            def run():
                ops.verify_token_update(base, drafts, vl, ids, backend=backend)
                ops.verify_metadata_update(vl, ctx, bt, 16, pos, slots, seq, cu, k_max,
                                           backend=backend)
                ops.attention_tiling_update(seq, ns, sl, plan, backend=backend)
            return run

        t_tri = graph_time_us([three("triton")], 16)
        t_ref = graph_time_us([three("reference")], 16)
        for label, t in (("triton_3_launches", t_tri), ("torch_reference", t_ref)):
            TABLE.append(("verify_updates", f"B={batch} k={k_max} G={g}", label, t, float("nan"),
                          float("nan"), t / t_ref))
            record("kernel_verify_updates_us", round(t, 3), "us", kernel="verify_updates",
                   variant=label, batch=batch, k_max=k_max, g=g)
        print(f"[{time.time() - T0:6.1f}s] updates B={batch}: triton {t_tri:.2f} us, torch ref "
              f"{t_ref:.2f} us", flush=True)


def bench_norm_rotary(copy_bw):
    for m in (1, 48):
        n = 16
        xs = [torch.randn(m, HIDDEN, device="cuda", dtype=DT) for _ in range(n)]
        rs = [torch.randn(m, HIDDEN, device="cuda", dtype=DT) for _ in range(n)]
        w = torch.randn(HIDDEN, device="cuda", dtype=DT)
        outs = [torch.empty_like(x) for x in xs]
        nbytes = 4 * m * HIDDEN * 2 + HIDDEN * 2
        floor_us = nbytes / (copy_bw * 1e9) * 1e6
        t_tri = graph_time_us([lambda i=i: ops.rms_norm(xs[i], w, 1e-6, residual=rs[i],
                                                        out=outs[i]) for i in range(n)])
        t_ref = graph_time_us([lambda i=i: ops.rms_norm(xs[i], w, 1e-6, residual=rs[i],
                                                        out=outs[i], backend="reference")
                               for i in range(n)])
        for label, t in (("triton", t_tri), ("torch_eager_ops", t_ref)):
            TABLE.append(("add_rms_norm", f"M={m} N={HIDDEN}", label, t,
                          nbytes / (t * 1e-6) / 1e9, t / floor_us, t / t_ref))
            record("kernel_add_rms_norm_us", round(t, 3), "us", kernel="add_rms_norm",
                   variant=label, m=m, n=HIDDEN, floor_ratio=round(t / floor_us, 4))
        t = m
        qkv = [torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DT)
               for _ in range(n)]
        inv = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
        ang = torch.arange(40960, device="cuda").float()[:, None] * inv[None, :]
        cs = torch.cat([ang.cos(), ang.sin()], -1)
        pos = torch.randint(0, 40960, (t,), device="cuda")
        slots = torch.randperm(4000 * 16, device="cuda")[:t] + 16
        kc = torch.randn(4000, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT)
        vc = torch.randn_like(kc)

        def rot(i, backend):
            b = qkv[i]
            return lambda: ops.rotary_kv_write(
                b[:, : HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM),
                b[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM),
                b[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(t, KV_HEADS, HEAD_DIM),
                pos, cs, slots, kc, vc, backend=backend)

        t_tri = graph_time_us([rot(i, "triton") for i in range(n)])
        t_ref = graph_time_us([rot(i, "reference") for i in range(n)])
        for label, tt in (("triton", t_tri), ("torch_eager_ops", t_ref)):
            TABLE.append(("rotary_kv_write", f"T={t} H={HEADS}/{KV_HEADS}", label, tt,
                          float("nan"), float("nan"), tt / t_ref))
            record("kernel_rotary_kv_write_us", round(tt, 3), "us", kernel="rotary_kv_write",
                   variant=label, t=t)
        print(f"[{time.time() - T0:6.1f}s] norm/rotary m={m} done", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--sweep", action="store_true", help="time the GEMV config sweep")
    ap.add_argument("--only", default="", help="comma list: copy,gemv,chain,fused,attn,upd,norm")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} sms={props.multi_processor_count} torch={torch.__version__} "
          f"triton={triton.__version__}", flush=True)
    copy_bw, both = copy_bandwidth()
    record("kernel_copy_bandwidth_GBps", round(copy_bw, 1), "GB/s", kernel="copy",
           runs=[round(b, 1) for b in both])
    print(f"copy bandwidth {copy_bw:.0f} GB/s (runs {both[0]:.0f}, {both[1]:.0f})", flush=True)
    best = {}
    try:
        if not only or "gemv" in only:
            best = bench_gemv(copy_bw, args.sweep, args.budget_s)
        if not only or "chain" in only:
            bench_chain(copy_bw, best)
        if not only or "fused" in only:
            bench_fused_chain(copy_bw)
        if not only or "attn" in only:
            bench_attention(copy_bw)
        if not only or "upd" in only:
            bench_updates()
        if not only or "norm" in only:
            bench_norm_rotary(copy_bw)
    finally:
        with open(f"{args.out}/bench_kernels.jsonl", "w") as f:
            for r in RECORDS:
                f.write(json.dumps({**r, "device": props.name}, sort_keys=True) + "\n")
        with open(f"{args.out}/gemv_best.json", "w") as f:
            json.dump({f"{nm}|{m}": [t, repr(c)] for (nm, m), (t, c) in best.items()}, f,
                      indent=1)
        print(f"\ncopy bandwidth {copy_bw:.0f} GB/s; ratios: time/floor and time/peer")
        print(f"{'kernel':16} {'shape':34} {'variant':18} {'us':>9} {'GB/s':>7} {'floor':>6} "
              f"{'peer':>6}")
        for kname, shape, label, t, gbs, fr, pr in TABLE:
            print(f"{kname:16} {shape:34} {label:18} {t:9.2f} {gbs:7.0f} {fr:6.2f} {pr:6.2f}")


if __name__ == "__main__":
    main()
