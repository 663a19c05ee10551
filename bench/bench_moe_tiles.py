"""The routed experts' two Triton kernels (gate/up, down) under other launch tiles, on a GPU.

Usage: python3 bench/bench_moe_tiles.py [--out DIR] [--rows 1,8] [--tiles LABEL,...]
       [--hidden 2048 --inter 1408 --experts 64 --top-k 6] [--repeats 7] [--record]
       [--timing graph|eager] [--no-pdl]
       python3 bench/bench_moe_tiles.py --list       (the configurations, no GPU needed)

Why: on the H100 the B = 1 moe-16b-a3b decode step spends ~2.0 ms of its ~4.1 ms in these two
kernels, reading 2.7 GB of expert weights at ~1.6 TB/s where a copy runs at ~3.0 TB/s
(bench/RESULTS.md): issue 37's `moe_decode_step_floor_ratio` <= 2.0 needs them faster, and how
is an empirical question of tiles, warps and pipeline stages (``fused_moe.ExpertTiles``).

What it times: one MoE layer's experts of moe-16b-a3b's shapes (default: hidden 2048, expert
width 1408, 64 experts, top-6; random bf16 weights stacked as ``ops.fused_moe`` reads them),
``--rows`` rows routed uniformly (the first row of consecutive calls to disjoint expert sets,
so a one-row call does not find its weights in L2 from the call before), the layouts built
once (``moe_align_triton``), then ``fused_moe_triton`` (gate/up + down) per tile
configuration. Timing (``--timing``): ``graph`` (default) captures one pass over the calls'
routings (one call per disjoint expert set) into a CUDA graph, launched with PDL as the served
graphs are (``--no-pdl``: without), and times its replays (CUDA events, median of ``--repeats``
means of 20 replays, per call); ``eager`` times 20 Python-launched calls. Eager timing of one
row measures the launches, not the kernels: at 97e7eb6 on an H100 every tile configuration took
113-124 us, where the served graphs' profile gives the two kernels ~76 us a layer (3b0d4cc,
``bench_moe.py``) against a 35 us floor. Floor: the weight bytes of the experts a call activates (3 x hidden x width x 2 B each, the mean over the calls) over
the device's copy bandwidth measured in the same run (a 1 GiB copy). Every configuration's output
is checked against the default tiles' (bf16 rounding); one that differs is reported and never
ranked. Prints a table per row count and writes ``DIR/moe_tiles.json``; ``--record`` appends
``moe_expert_kernels_floor_ratio`` (the default tiles) and
``moe_expert_kernels_floor_ratio_best`` (the best configuration, named) per row count.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from dataclasses import asdict
from datetime import date
from pathlib import Path

#: The configurations swept by default: the shipped tiles first, then narrower / deeper gate-up
#: tiles (more programs for a decode round's few active blocks), wider down tiles, more warps
#: and explicit pipeline depths.
SWEEP = (
    dict(),
    dict(gate_up_n=32),
    dict(gate_up_n=32, gate_up_k=128),
    dict(gate_up_n=16, gate_up_k=128),
    dict(gate_up_k=128),
    dict(gate_up_n=32, num_stages=4),
    dict(gate_up_n=32, down_k=64, num_stages=4),  # 32 x 64, 4 stages for both: a common M = 1 tile
    dict(gate_up_n=32, gate_up_k=128, num_stages=3),
    dict(down_n=16),
    dict(down_n=16, down_k=256),
    dict(down_n=64, down_k=64),
    dict(down_k=64),
    dict(num_warps=8),
    dict(num_warps=2),
    dict(num_stages=2),
    dict(num_stages=5),
    dict(gate_up_n=32, down_n=16, num_stages=4),
    dict(gate_up_n=32, gate_up_k=128, down_n=16, down_k=256, num_stages=3),
)


def configurations():
    from speccal.kernels.config import ExpertTiles

    return [ExpertTiles(**kw) for kw in SWEEP]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="1,8", help="row counts (decode rows of a round)")
    ap.add_argument("--tiles", default="", help="comma list of configuration labels "
                    "(--list names them; default: all)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--timing", choices=("graph", "eager"), default="graph",
                    help="graph: replays of a captured pass over the calls (the served way); "
                    "eager: Python-launched calls (host-bound at one row)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="graph timing without programmatic dependent launch")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--results", default=None, help="default: bench/results.jsonl")
    args = ap.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        ap.error(f"--rows: got {args.rows!r}, expected comma-separated integers")
    if not args.rows or min(args.rows) < 1:
        ap.error(f"--rows: got {args.rows}, expected integers >= 1")
    if args.top_k < 1 or args.experts < args.top_k:
        ap.error(f"--top-k / --experts: got {args.top_k} / {args.experts}, expected "
                 "1 <= top-k <= experts")
    known = {t.label(): t for t in configurations()}
    wanted = [x for x in args.tiles.split(",") if x]
    unknown = [x for x in wanted if x not in known]
    if unknown:
        ap.error(f"--tiles: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    args.configs = [known[x] for x in wanted] if wanted else list(known.values())
    return args


def _routings(rows: int, experts: int, top_k: int, device):
    """The routings of the calls a timing cycles through, ``[S, rows, top_k]`` int64: row 0 of
    call ``s`` routes to the ``s``-th of disjoint expert sets (so a one-row call never finds its
    weights in L2 from the call before), every other row to ``top_k`` distinct experts drawn
    uniformly (a batch spreads over many experts, as a round's random tokens do)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(experts, generator=gen)
    sets = [perm[i:i + top_k] for i in range(0, experts - top_k + 1, top_k)]
    calls = []
    for s in sets:
        rows_ = [s[torch.randperm(top_k, generator=gen)]]
        rows_ += [torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows - 1)]
        calls.append(torch.stack(rows_))
    return torch.stack(calls).to(device)


def measure(args) -> dict:
    import torch
    from bench_decode import copy_bandwidth
    from cuda_timing import capture, events_ms

    from speccal.kernels.fused_moe import DEFAULT_TILES, fused_moe_triton, moe_align_triton

    dev = torch.device("cuda")
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    gen = torch.Generator(device=dev).manual_seed(1)
    gate_up = (torch.randn(e, 2 * i, h, device=dev, generator=gen) * h ** -0.5).bfloat16()
    down = (torch.randn(e, h, i, device=dev, generator=gen) * i ** -0.5).bfloat16()
    copy_bw = copy_bandwidth()  # bytes/s of a 1 GiB copy, read + write
    doc = {"device": torch.cuda.get_device_name(dev), "copy_bandwidth_gbs": copy_bw / 1e9,
           "shape": {"hidden": h, "inter": i, "experts": e, "top_k": k}, "by_rows": {},
           "timing": args.timing + (" + pdl" if args.timing == "graph" and not args.no_pdl
                                    else "")}
    for rows in args.rows:
        routes = _routings(rows, e, k, dev)
        n_sets = routes.shape[0]
        x = torch.randn(rows, h, device=dev, generator=gen).bfloat16()
        w = torch.softmax(torch.randn(rows, k, device=dev, generator=gen), -1)
        layouts = [moe_align_triton(routes[s], e, 16, None, None)[:2] for s in range(n_sets)]
        # the experts a call reads, averaged over the calls the timing cycles through
        active = statistics.mean(len(set(r.reshape(-1).tolist())) for r in routes)
        floor_ms = active * 3 * h * i * 2 / copy_bw * 1e3
        want = None
        table = []
        pdl = args.timing == "graph" and not args.no_pdl
        for tiles in args.configs:
            def call(s, tiles=tiles, x=x, w=w, layouts=layouts, pdl=pdl):
                return fused_moe_triton(x, w, gate_up, down, *layouts[s], None, pdl=pdl,
                                        tiles=tiles)

            out = call(0)
            if want is None:
                want = out.float()
            ok = bool(torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2))
            if args.timing == "graph":
                graph = capture([functools.partial(call, s) for s in range(n_sets)])
                ms = events_ms(graph.replay, 20, args.repeats) / n_sets
                del graph
            else:
                state = {"s": -1}

                def cycle(state=state, call=call, n_sets=n_sets):
                    state["s"] = (state["s"] + 1) % n_sets
                    return call(state["s"])

                ms = events_ms(cycle, 20, args.repeats)
            table.append({"tiles": tiles.label(), **asdict(tiles), "ms": ms,
                          "floor_ratio": ms / floor_ms, "equal_to_default": ok})
            print(f"rows {rows:3d}  {tiles.label():36s} {ms * 1e3:8.1f} us  "
                  f"{ms / floor_ms:5.2f}x floor{'' if ok else '  OUTPUT DIFFERS'}", flush=True)
        ranked = sorted((r for r in table if r["equal_to_default"]), key=lambda r: r["ms"])
        default = next(r for r in table if r["tiles"] == DEFAULT_TILES.label())
        doc["by_rows"][str(rows)] = {"floor_ms": floor_ms, "active_experts": active,
                                     "configs": table, "default": default,
                                     "best": ranked[0] if ranked else None}
        if ranked:
            print(f"rows {rows}: default {default['ms'] * 1e3:.1f} us "
                  f"({default['floor_ratio']:.2f}x), best {ranked[0]['tiles']} "
                  f"{ranked[0]['ms'] * 1e3:.1f} us "
                  f"({ranked[0]['floor_ratio']:.2f}x)", flush=True)
    return doc


def record(doc: dict, args, argv) -> None:
    import results

    lines = []
    for rows, r in doc["by_rows"].items():
        ctx = {"unit": "x", "device": doc["device"], "commit": results.git_commit(),
               "date": date.today().isoformat(), "rows": int(rows),
               "command": "python3 bench/bench_moe_tiles.py " + " ".join(argv),
               "copy_bandwidth_gbs": round(doc["copy_bandwidth_gbs"], 1), **doc["shape"],
               "floor_ms": round(r["floor_ms"], 4), "repeats": args.repeats,
               "timing": doc["timing"]}
        d = r["default"]
        lines.append({"metric": "moe_expert_kernels_floor_ratio",
                      "value": round(d["floor_ratio"], 4), "tiles": d["tiles"],
                      "ms": round(d["ms"], 4), **ctx})
        if r["best"] is not None:
            b = r["best"]
            lines.append({"metric": "moe_expert_kernels_floor_ratio_best",
                          "value": round(b["floor_ratio"], 4), "tiles": b["tiles"],
                          "ms": round(b["ms"], 4), "default_ms": round(d["ms"], 4), **ctx})
    results.append_results(lines, Path(args.results) if args.results else results.RESULTS)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.list:
        for t in args.configs:
            print(t.label())
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_moe_tiles: needs a CUDA device (--list works without one)", file=sys.stderr)
        return 2
    doc = measure(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_tiles.json").write_text(json.dumps(doc, indent=1, sort_keys=True, default=float))
    if args.record:
        record(doc, args, argv)
    best = [r["best"]["floor_ratio"] for r in doc["by_rows"].values() if r["best"]]
    print(f"best floor ratio over row counts: {statistics.median(best):.2f}x (median)"
          if best else "no configuration matched the default's output")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
