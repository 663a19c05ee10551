"""Decode / verify speed of a routed-MoE MLA target on the captured runner vs the bytes a step
actually reads (issue 37).

Usage (GPU): python3 bench/bench_moe.py --out DIR [--model moe-16b-a3b] [--repeats 7]
    [--batches 1,8] [--draft-width 3] [--record]

One run, on ``--model`` (default ``moe-16b-a3b``: DeepSeek-V2-Lite shapes, random weights, bf16,
Triton backend, split graphs, KV 1,024 per request):
- copy bandwidth (1 GiB bf16 copy, read + write bytes / median time);
- the decode step (``B`` requests, greedy fast path): target graph replay time vs its floor =
  bytes the step reads / copy bandwidth, where the bytes are every weight matrix but the input
  embedding, the routed experts counted only for the experts the step activated (each routed
  layer's distinct experts, read from the layer's in-graph mask after one replay: random tokens
  spread rows over experts the way a balanced model does), and the KV the step attends (each
  target layer's cached K and V bytes per token x tokens) [moe_decode_step_floor_ratio: B = 1];
- the full-width verify (``k = --draft-width``, ``k + 1`` rows per request) vs the B-matched
  decode step [moe_verify_full_width_ratio: B = 1; ``_b8`` the largest batch], with the experts
  that verify activated and its own floor;
- a kernel breakdown of the B = 1 decode step (torch.profiler: time and launches per kernel).
Writes ``DIR/moe.json`` after every stage; ``--record`` appends the headline figures to
bench/results.jsonl. Speed goals live here only.

Kernel switches come from ``SPECCAL_*`` variables (``KernelConfig.from_env``): e.g.
``SPECCAL_PDL=0`` runs without programmatic dependent launch, so the breakdown's per-kernel
times are each kernel's own (under PDL a kernel's time includes its wait for the one before).
A run under a non-default config records its metrics with the suffix ``.kernels_env`` and the
config beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_decode import breakdown, copy_bandwidth, fill, target_ms
from results import append_results, git_commit

from speccal.kernels.config import KernelConfig
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.moe import routed_modules

KV = 1024


def step_bytes(eng: Engine, activated: list[int], kv_tokens: int) -> dict[str, int]:
    """Bytes one target forward reads: ``weights`` (every parameter of two or more dims but the
    input embedding, unless the LM head is tied to it), of which ``routed`` are the experts of
    the routed layers counted ``activated[i]`` of ``E`` experts for the i-th routed layer, and
    ``kv`` (each target layer's K and V bytes per token x ``kv_tokens``, the tokens attended over
    all requests). ``activated``: per routed layer of the target, in module order (what
    ``Engine.take_activated_experts()["target"]`` returns)."""
    t = eng.loaded.target
    emb = t.model.embed_tokens.weight
    tied = t.lm_head.weight is emb
    layers = routed_modules(t)
    if len(activated) != len(layers):
        raise ValueError(f"activated: {len(activated)} counts for {len(layers)} routed layers")
    expert_ids: set[int] = set()
    routed = 0
    for m, n in zip(layers, activated, strict=True):
        per_expert = [sum(p.numel() * p.element_size() for p in e.parameters())
                      for e in m.experts]
        expert_ids.update(id(p) for e in m.experts for p in e.parameters())
        if not 0 <= n <= len(per_expert):
            raise ValueError(f"activated: {n} experts of a layer with {len(per_expert)}")
        routed += per_expert[0] * n  # every expert of a layer has the same shape
    other = sum(p.numel() * p.element_size() for p in t.parameters()
                if p.dim() >= 2 and id(p) not in expert_ids and (tied or p is not emb))
    per_token = sum(k[0, 0].numel() * k.element_size() + v[0, 0].numel() * v.element_size()
                    for k, v in eng.kv.layers[: eng.loaded.config.num_hidden_layers])
    kv = per_token * kv_tokens
    return {"weights": other + routed, "routed": routed, "kv": kv, "total": other + routed + kv}


def replay_activated(eng: Engine, key) -> list[int]:
    """Distinct experts per routed target layer of one replay of graph ``key``."""
    eng.take_activated_experts()  # reset
    eng.runner.graphs.replay(key)
    torch.cuda.synchronize()
    return eng.take_activated_experts()["target"]


def measure(args, res: dict, bw: float, save) -> None:
    from speccal.runner.graphs import GraphKey

    common = dict(model=args.model, device="cuda", dtype="bfloat16", attention_backend="triton",
                  kernels=args.kernels, graph_mode="split", max_model_len=KV + 512, block_size=16,
                  request_buckets=tuple(args.batches),
                  kv_capacity_tokens=max(args.batches) * (KV + 520))
    t0 = time.time()
    plain = Engine(EngineConfig.flat(**common, speculative=False, acceptance="greedy"))
    res["build_s_plain"] = time.time() - t0
    dec: dict[int, float] = {}
    for b in args.batches:
        fill(plain, b, 0)
        upd = plain.runner.resolve_update(b, 0, b)
        key = GraphKey("target", b, 0, b, upd, "greedy")
        act = replay_activated(plain, key)
        fb = step_bytes(plain, act, b * KV)
        dec[b] = target_ms(plain, b, 0, b, upd, args.repeats)
        floor = fb["total"] / bw * 1e3
        res[f"decode_b{b}"] = {"ms": dec[b], "floor_ms": floor, "ratio": dec[b] / floor,
                               "bytes": fb, "experts_activated": act}
        if b == 1:
            res["moe_decode_step_floor_ratio"] = dec[b] / floor
            res["breakdown_b1"] = breakdown(plain, key, top=24)
        save()
    del plain
    torch.cuda.empty_cache()
    k = args.draft_width
    t0 = time.time()
    spec = Engine(EngineConfig.flat(**common, draft_width=k, acceptance="forced",
                                    target_rows={b: ((k + 1) * b,) for b in args.batches}))
    res["build_s_spec"] = time.time() - t0
    for b in args.batches:
        fill(spec, b, k)
        key = GraphKey("target", b, k, (k + 1) * b, "in_graph", "greedy")
        act = replay_activated(spec, key)
        fb = step_bytes(spec, act, b * KV)
        v = target_ms(spec, b, k, (k + 1) * b, "in_graph", args.repeats)
        res[f"verify_b{b}"] = {"ms": v, "ratio_to_decode": v / dec[b],
                               "floor_ms": fb["total"] / bw * 1e3, "bytes": fb,
                               "experts_activated": act}
        save()
    res["moe_verify_full_width_ratio"] = res["verify_b1"]["ratio_to_decode"]
    big = max(args.batches)
    if big > 1:
        res[f"moe_verify_full_width_ratio_b{big}"] = res[f"verify_b{big}"]["ratio_to_decode"]
        res[f"moe_decode_step_floor_ratio_b{big}"] = res[f"decode_b{big}"]["ratio"]
    save()


def record(res: dict, args) -> None:
    base = {"device": res["device_name"], "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d"),
            "command": "python3 bench/bench_moe.py " + " ".join(sys.argv[1:]),
            "model": args.model, "dtype": "bfloat16", "kv": KV, "repeats": args.repeats,
            "draft_width": args.draft_width, "copy_bandwidth_gbs": res["copy_bandwidth_gbs"]}
    lines = []
    for name in sorted(res):
        if name.startswith("moe_"):
            ctx = {}
            if name.startswith("moe_decode"):
                b = 1 if name == "moe_decode_step_floor_ratio" else int(name.rsplit("_b", 1)[1])
                ctx = {"decode_ms": res[f"decode_b{b}"]["ms"],
                       "floor_ms": res[f"decode_b{b}"]["floor_ms"], "batch": b}
            else:
                b = 1 if name == "moe_verify_full_width_ratio" else int(name.rsplit("_b", 1)[1])
                ctx = {"verify_ms": res[f"verify_b{b}"]["ms"],
                       "decode_ms": res[f"decode_b{b}"]["ms"], "batch": b}
            suffix = ""
            if args.tiles is not None:
                ctx["expert_tiles"] = args.tiles.label()
                suffix += ".best_tiles"
            if args.kernels != KernelConfig():
                ctx["kernels"] = args.kernels.to_dict()
                suffix += ".kernels_env"
            lines.append({"metric": name + suffix, "value": round(res[name], 4), "unit": "x",
                          **base, **ctx})
    append_results(lines)


def best_tiles(path: str):
    """The best one-row tiles of a ``bench_moe_tiles.py`` result (``moe_tiles.json``) as
    ``ExpertTiles``; ValueError naming the file when it has none."""
    from speccal.kernels.config import ExpertTiles

    try:
        best = json.loads(Path(path).read_text())["by_rows"]["1"]["best"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--tiles-from {path}: {exc!r}; expected a moe_tiles.json with a "
                         "one-row best") from None
    if best is None:
        raise ValueError(f"--tiles-from {path}: no one-row configuration matched the shipped "
                         "tiles' output")
    return ExpertTiles(**{f: best[f] for f in ExpertTiles.__dataclass_fields__})


def use_tiles(path: str, ap: argparse.ArgumentParser):
    """Run the routed experts on :func:`best_tiles` of ``path``: ``ops.fused_moe`` imports
    ``fused_moe_triton`` at each call, so the module attribute is replaced by one bound to
    those tiles (this process only). Returns the tiles."""
    import functools

    try:
        tiles = best_tiles(path)
    except ValueError as exc:
        ap.error(str(exc))
    from speccal.kernels import fused_moe

    fused_moe.fused_moe_triton = functools.partial(fused_moe.fused_moe_triton, tiles=tiles)
    print(f"routed experts on tiles {tiles.label()} (from {path})", flush=True)
    return tiles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--model", default="moe-16b-a3b")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--draft-width", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--tiles-from", default=None, help="a bench_moe_tiles.py moe_tiles.json: "
                    "the routed experts run its best one-row tiles instead of the shipped "
                    "ones (metrics recorded with the suffix .best_tiles)")
    args = ap.parse_args()
    args.tiles = None
    try:
        args.kernels = KernelConfig.from_env()
    except ValueError as exc:  # InputError: the variable, its value, what was expected
        ap.error(str(exc))
    if args.tiles_from is not None:
        args.tiles = use_tiles(args.tiles_from, ap)
    args.batches = sorted({int(v) for v in args.batches.split(",") if v})
    if 1 not in args.batches:
        ap.error(f"--batches {args.batches}: expected 1 among them (the floor ratio uses it)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device_name": torch.cuda.get_device_name(), "model": args.model,
                 "kernels": args.kernels.to_dict()}

    def save() -> None:
        (out / "moe.json").write_text(json.dumps(res, indent=1))

    res["copy_bandwidth_gbs"] = copy_bandwidth() / 1e9
    measure(args, res, res["copy_bandwidth_gbs"] * 1e9, save)
    for name in sorted(res):
        if name.startswith("moe_") or name.startswith("build_s"):
            print(f"{name:40s} {res[name]:10.4f}")
    for b in args.batches:
        d, v = res[f"decode_b{b}"], res[f"verify_b{b}"]
        print(f"B={b}: decode {d['ms']:.3f} ms (floor {d['floor_ms']:.3f}, experts "
              f"{sum(d['experts_activated'])}), verify {v['ms']:.3f} ms (experts "
              f"{sum(v['experts_activated'])})")
    for row in res["breakdown_b1"]:
        print(f"    {row[1]:9.2f} us  x{row[2]!s:<8} {row[0]}")
    if args.record:
        record(res, args)


if __name__ == "__main__":
    main()
