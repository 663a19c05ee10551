"""Decode / verify speed of the captured runner vs the HBM floor, and the draft->target gap.

Usage (H200): python3 bench/bench_decode.py --out DIR [--repeats N] [--pdl off,late]
    [--variants "nofold:SPECCAL_ATTN_FOLD=0;..."]

One run measures, on the dense-2b preset (bf16, triton backend, graph_mode="split"):
- copy bandwidth (1 GiB bf16 copy; read + write bytes / median time);
- decode step (B=1, KV 1024): target graph replay time of the greedy fast path (forward + LM
  head + argmax + state update; every request greedy) vs floor = (every weight matrix incl. LM
  head, not the embedding; KV attended) / bw [decode_step_floor_ratio]; the general-path graph
  (``sample_plain``: filters and sorts) of the same engine is timed too (``*_general``), and a
  kernel breakdown of one fast-path B=1 step (``breakdown_b1``, from torch.profiler);
- full-width verify (w=5, 6 rows/request) vs the B-matched decode step, B = 1 and 8
  (``--batches`` adds sizes up to 8) [verify_full_width_ratio: the largest], with kernel
  breakdowns of the verify steps and of the B > 1 decode steps (``breakdown_verify_b*``,
  ``breakdown_decode_b*``; ``sequence_*``:
  every kernel of one replay with its start, from which ``critical_*`` derives the mean start and
  end of each kernel of a decoder layer relative to the layer's first kernel; variants record
  the ``critical_*`` timelines of every step they time);
- the registers, spills and shared memory of every compiled Triton kernel (``kernel_resources``);
- draft->target gap from torch.profiler kernel timestamps, fast path (in-graph update) vs
  fallback (host-prepared inputs) [draft_target_gap_us_fast, draft_target_gap_us_fallback].
Prints a table and writes ``DIR/decode.json`` after every stage (partial results survive a
timeout). Speed goals live here only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from cuda_timing import events_ms

from speccal.kernels.config import KernelConfig
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.graphs import GraphKey
from speccal.runner.sampling import SamplingParams

KV = 1024
SEQUENCES: dict = {}  # graph key -> kernels of one replay: [name, us, grid, start us]


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB bf16 device copy (read + write counted)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), 10, 5)
    return 2 * src.numel() * 2 / (ms * 1e-3)


def floor_bytes(eng: Engine, kv_tokens: int) -> int:
    t = eng.loaded.target
    emb = t.model.embed_tokens.weight
    n = sum(p.numel() * p.element_size() for p in t.parameters() if p.dim() == 2 and p is not emb)
    n += (
        t.lm_head.weight.numel() * t.lm_head.weight.element_size() if t.lm_head.weight is emb else 0
    )
    c = eng.loaded.config
    n += (
        c.num_hidden_layers
        * 2
        * kv_tokens
        * c.num_key_value_heads
        * c.head_dim
        * emb.element_size()
    )
    return n


def fill(eng: Engine, batch: int, k: int, kv: int = KV, *, lengths: list[int] | None = None,
         max_tokens: int = 512) -> None:
    """``batch`` requests at KV ~``kv`` (or request ``i`` at ~``lengths[i]``), one real round of
    ``k`` drafts (stages every buffer)."""
    eng.reset()
    vocab = eng.loaded.config.vocab_size
    rng = np.random.default_rng(0)
    for n in lengths if lengths is not None else [kv] * batch:
        eng.add_request(rng.integers(0, vocab, max(n - 1, 1)).tolist(),
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    eng.prefill_pending()
    eng.step(RoundPlan(num_draft_steps=k))
    eng.synchronize()


def target_ms(
    eng: Engine, batch: int, k: int, g: int, update: str, repeats: int, sampling: str = "greedy",
    grid: bool = False,
) -> float:
    """Device time of one target graph's replay (``GraphKey``'s fields; ``grid``: a recurrent
    target's full-grid verify layout, ``RoundInputs.grid``)."""
    key = GraphKey("target", batch, k, g, update, sampling, grid)
    return events_ms(lambda: eng.runner.graphs.replay(key), 50, repeats)


def breakdown(eng: Engine, key: GraphKey, replays: int = 5, top: int = 12) -> list:
    """Kernel time per step of one graph: ``[name, us per step, launches per step]``, largest
    first, then ``["(all kernels)", ...]`` and ``["(span incl. gaps)", ...]``."""
    from torch.profiler import ProfilerActivity, profile

    eng.runner.graphs.replay(key)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            eng.runner.graphs.replay(key)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        trace = json.loads(Path(fh.name).read_text())
    ev = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    agg: dict[str, list[float]] = {}
    for e in ev:
        a = agg.setdefault(str(e["name"])[:80], [0.0, 0])
        a[0] += float(e["dur"]) / replays
        a[1] += 1 / replays
    rows = sorted(([n, round(t, 2), round(c, 2)] for n, (t, c) in agg.items()), key=lambda r: -r[1])
    per = len(ev) // replays
    first = sorted(ev, key=lambda e: float(e["ts"]))[:per]
    t0 = float(first[0]["ts"]) if first else 0.0
    # every kernel of the first replay: [name, us, grid, start us after the step's first kernel]
    # (under PDL a kernel starts when its programs launch, before its predecessor ends)
    SEQUENCES[key] = [[str(e["name"])[:40], round(float(e["dur"]), 2),
                       str(e.get("args", {}).get("grid", "")),
                       round(float(e["ts"]) - t0, 2)] for e in first]
    total = sum(r[1] for r in rows)
    span = max(float(e["ts"]) + float(e["dur"]) for e in ev) - min(float(e["ts"]) for e in ev)
    return rows[:top] + [
        ["(all kernels)", round(total, 2), round(len(ev) / replays, 2)],
        ["(span incl. gaps)", round(span / replays, 2), 0],
    ]


def critical(seq: list) -> list:
    """Mean start and end (us) of each kernel of a decoder layer relative to the start of the
    layer's first kernel (the one before ``_split_kernel``), over the layers that have a
    successor layer: ``[name, grid, start, end]``. Shows what each launch adds to the chain."""
    firsts = [i for i in range(1, len(seq)) if seq[i][0].startswith("_split_kernel")]
    firsts = [i - 1 for i in firsts]
    acc: dict[int, list] = {}
    pairs = list(zip(firsts, firsts[1:], strict=False))
    if not pairs:
        return []
    size = statistics.mode(b - a for a, b in pairs)  # layers of another length are skipped
    for a, b in pairs:
        if b - a != size:
            continue
        t0 = seq[a][3]
        for j in range(a, b):
            row = acc.setdefault(j - a, [seq[j][0], seq[j][2], [], []])
            row[2].append(seq[j][3] - t0)
            row[3].append(seq[j][3] + seq[j][1] - t0)
    return [[r[0], r[1], round(float(np.mean(r[2])), 2), round(float(np.mean(r[3])), 2)]
            for _, r in sorted(acc.items())]


def kernel_resources() -> list:
    """``[kernel, num_warps, registers per thread, spills, shared bytes]`` of every Triton
    kernel compiled in this process (the specialisations of ``speccal.kernels``)."""
    import importlib

    import triton

    rows = []
    for mod in ("gemv", "paged_attention", "rmsnorm", "rotary_kv", "verify_accept",
                "verify_metadata", "verify_tokens", "attention_tiling"):
        m = importlib.import_module(f"speccal.kernels.{mod}")
        for name, fn in vars(m).items():
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                continue
            for cache in getattr(fn, "device_caches", {}).values():
                for k in (cache[0] if isinstance(cache, tuple) else cache).values():
                    try:
                        k._init_handles()
                    except Exception:  # a resource probe, never fatal
                        pass
                    md = getattr(k, "metadata", None)
                    rows.append([f"{mod}.{name}", getattr(md, "num_warps", None),
                                 getattr(k, "n_regs", None), getattr(k, "n_spills", None),
                                 getattr(md, "shared", None)])
    return sorted(rows, key=lambda r: (r[0], str(r[1:])))


def kernels_of(prof) -> list[tuple[float, float]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        trace = json.loads(Path(fh.name).read_text())
    ev = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev)


def gap_us(eng: Engine, k: int, rounds: int) -> float:
    """Median gap (us) between the last draft kernel and the target's first kernel of a round."""
    from torch.profiler import ProfilerActivity, profile

    fill(eng, 1, k)
    key = GraphKey("draft", 1, k)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.runner.graphs.replay(key)
        torch.cuda.synchronize()
    n_draft = len(kernels_of(prof))
    gaps = []
    for _ in range(rounds):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.step(RoundPlan(num_draft_steps=k))
            torch.cuda.synchronize()
        ks = kernels_of(prof)
        gaps.append(ks[n_draft][0] - ks[n_draft - 1][1])
    return statistics.median(gaps)


def measure(args, res: dict, bw: float, save, kernels: KernelConfig, quick: bool = False) -> None:
    """Every figure of one variant (its kernel configuration ``kernels``) into ``res`` (see the
    module docstring); ``quick``: only the decode and verify steps (no general-path graph,
    breakdowns, KV sweep or gaps)."""
    # as the engines record it (a dense target: the linear-attention group at its recorded value)
    res["kernels_digest"] = kernels.for_model(linear_attention=False).digest()
    common = dict(
        kernels=kernels,
        model=args.model,
        device="cuda",
        dtype="bfloat16",
        attention_backend="triton",
        graph_mode="split",
        max_model_len=KV + 512,
        block_size=16,
    )
    t0 = time.time()
    # acceptance="sample": both plain graphs (greedy fast path, general sampler) are captured
    plain = Engine(
        EngineConfig.flat(
            **common,
            speculative=False,
            request_buckets=tuple(args.batches),
            acceptance="sample",
            kv_capacity_tokens=8 * (KV + 520),
        )
    )
    res["capture_s_plain"] = time.time() - t0
    fb = floor_bytes(plain, KV)
    res["decode_floor_ms"] = fb / bw * 1e3
    dec = {}
    for b in args.batches:
        fill(plain, b, 0)  # greedy requests: the host picks the fast path
        upd = plain.runner.resolve_update(b, 0, b)
        dec[b] = target_ms(plain, b, 0, b, upd, args.repeats)
        res[f"decode_step_ms_b{b}"] = dec[b]
        if quick:  # each step's layer timeline (critical_b1, critical_decode_b*)
            if b == 1:
                res["decode_step_floor_ratio"] = dec[1] / res["decode_floor_ms"]
            bkey = GraphKey("target", b, 0, b, upd, "greedy")
            breakdown(plain, bkey)
            res["critical_b1" if b == 1 else f"critical_decode_b{b}"] = critical(SEQUENCES[bkey])
            continue
        res[f"decode_step_ms_b{b}_general"] = target_ms(plain, b, 0, b, upd, args.repeats, "sample")
        if b == 1:
            res["decode_step_floor_ratio"] = dec[1] / res["decode_floor_ms"]
            res["decode_step_floor_ratio_general"] = (
                res["decode_step_ms_b1_general"] / res["decode_floor_ms"]
            )
            bkey = GraphKey("target", 1, 0, 1, upd, "greedy")
            res["breakdown_b1"] = breakdown(plain, bkey, top=20)
            res["sequence_b1"] = SEQUENCES[bkey]
            res["critical_b1"] = critical(SEQUENCES[bkey])
        else:  # the B-matched decode step the verify ratio divides by
            bkey = GraphKey("target", b, 0, b, upd, "greedy")
            res[f"breakdown_decode_b{b}"] = breakdown(plain, bkey, top=20)
            res[f"critical_decode_b{b}"] = critical(SEQUENCES[bkey])
        save()
    for kv in [] if quick else args.kv_sweep:  # decode step vs context (the cost tables carry no KV axis)
        for b in (1, 8):
            fill(plain, b, 0, kv)
            upd = plain.runner.resolve_update(b, 0, b)
            res[f"decode_step_ms_b{b}_kv{kv}"] = target_ms(plain, b, 0, b, upd, args.repeats)
        save()
    del plain
    torch.cuda.empty_cache()
    t0 = time.time()
    spec = Engine(
        EngineConfig.flat(
            **common,
            draft_width=5,
            request_buckets=tuple(args.batches),
            target_rows={b: (6 * b,) for b in args.batches},
            acceptance="forced",
            kv_capacity_tokens=8 * (KV + 520),
        )
    )
    res["capture_s_spec"] = time.time() - t0
    ratios = []
    for b in args.batches:
        fill(spec, b, 5)
        v = target_ms(spec, b, 5, 6 * b, "in_graph", args.repeats)
        res[f"verify_ms_b{b}"] = v
        res[f"verify_full_width_ratio_b{b}"] = v / dec[b]
        ratios.append(v / dec[b])
        vkey = GraphKey("target", b, 5, 6 * b, "in_graph", "greedy")
        if not quick:  # where the verify step's extra time goes (against breakdown_decode_b*)
            res[f"breakdown_verify_b{b}"] = breakdown(spec, vkey, top=20)
            res[f"sequence_verify_b{b}"] = SEQUENCES[vkey]
            res[f"critical_verify_b{b}"] = critical(SEQUENCES[vkey])
        else:
            breakdown(spec, vkey)
            res[f"critical_verify_b{b}"] = critical(SEQUENCES[vkey])
        save()
    res["verify_full_width_ratio"] = max(ratios)
    if quick:
        return
    res["draft_target_gap_us_fast"] = gap_us(spec, 5, 9)
    save()
    del spec
    torch.cuda.empty_cache()
    host = Engine(
        EngineConfig.flat(
            **common,
            draft_width=5,
            request_buckets=(1,),
            target_rows={1: (6,)},
            acceptance="forced",
            input_update="host",
            kv_capacity_tokens=KV + 520,
        )
    )
    res["draft_target_gap_us_fallback"] = gap_us(host, 5, 9)
    res["kernel_resources"] = kernel_resources()
    save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", default="dense-2b")
    ap.add_argument("--pdl", default="late", help="comma list of PDL modes: off, 1, late "
                    "(SPECCAL_PDL at capture); the first mode's figures are top level")
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes for the decode "
                    "and verify steps (1 and 8 required: the floor ratio and the KV sweep use them)")
    ap.add_argument("--variants", default="", help="';'-separated NAME:VAR=VALUE,... runtime "
                    "switch sets (SPECCAL_ATTN_FOLD, SPECCAL_PDL...), measured "
                    "in this order after the PDL modes; decode and verify steps only")
    ap.add_argument("--kv-sweep", default="", help="comma list of KV lengths (<= 1024) at "
                    "which the B=1 and B=8 decode steps are also timed")
    args = ap.parse_args()
    args.kv_sweep = [int(v) for v in args.kv_sweep.split(",") if v]
    args.batches = sorted({int(v) for v in args.batches.split(",") if v})
    if not {1, 8} <= set(args.batches) or args.batches[-1] > 8:
        ap.error(f"--batches {args.batches}: expected 1 and 8 among sizes of at most 8")
    out = Path(args.out)
    res: dict[str, object] = {}

    def save() -> None:
        (out / "decode.json").write_text(json.dumps(res, indent=1))

    bw = copy_bandwidth()
    res["copy_bandwidth_gbs"] = bw / 1e9
    modes = args.pdl.split(",")
    def config(env: dict[str, str]) -> KernelConfig:  # the benchmark's switches, this variant's
        return KernelConfig.from_env({**os.environ, **env})

    first = {"SPECCAL_PDL": {"off": "0"}.get(modes[0], modes[0])}
    for i, mode in enumerate(modes):  # the first mode's figures at the top level
        sub: dict[str, object] = res if i == 0 else {}
        if i:
            res[f"pdl_{mode}"] = sub
        res.setdefault("pdl_modes", modes)
        measure(args, sub, bw, save, config({"SPECCAL_PDL": {"off": "0"}.get(mode, mode)}))
        torch.cuda.empty_cache()
    for spec in filter(None, args.variants.split(";")):
        name, _, assigns = spec.partition(":")
        env = dict(a.split("=", 1) for a in assigns.split(",") if a)
        sub = res[f"variant_{name}"] = {"env": env}
        measure(args, sub, bw, save, config({**first, **env}), quick=True)
        torch.cuda.empty_cache()
    show(res)


def show(res: dict, prefix: str = "") -> None:
    for name, v in res.items():
        if isinstance(v, dict):
            show(v, f"{prefix}{name}.")
        elif isinstance(v, list) and v and isinstance(v[0], list):
            print(prefix + name)
            for row in v:
                if isinstance(row[1], float):
                    print(f"    {row[1]:9.2f} us  x{row[2]!s:<10} {row[0]}")
                else:
                    print("    " + "  ".join(str(c) for c in row))
        elif isinstance(v, float):
            print(f"{prefix + name:44s} {v:10.4f}")
        else:
            print(f"{prefix + name:44s} {v}")


if __name__ == "__main__":
    main()
