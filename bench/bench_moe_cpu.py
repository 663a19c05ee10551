"""One routed-expert layer's experts on a CPU: ``ops.fused_moe`` with ``backend="auto"`` (the
per-expert row gather a CPU round runs) against the capture-safe static-layout reference.

Usage: python3 bench/bench_moe_cpu.py [--reps 5] [--threads 1] [--record]

Shape: a quarter-width DeepSeek-V2-Lite layer (hidden 512, expert intermediate 352, 64 experts,
top-6), random weights and routing, rows N = 1, 8, 24, 128. Prints one JSON object per N (median
ms of ``--reps`` calls after one warm-up, both backends, and their ratio); ``--record`` appends
``moe_cpu_expert_loop_speedup`` lines to bench/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date

import results
import torch

from speccal.kernels import ops

HIDDEN, INTER, EXPERTS, TOP_K = 512, 352, 64, 6


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.05
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.05
    lines = []
    for n in (1, 8, 24, 128):
        x = torch.randn(n, HIDDEN, generator=g)
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(n)])
        w = torch.rand(n, TOP_K, generator=g)
        args_ = (x, w, ids, gate_up, down)
        ms = {be: _median_ms(lambda be=be, a=args_: ops.fused_moe(*a, backend=be), args.reps)
              for be in ("auto", "reference")}
        row = {"rows": n, "auto_ms": round(ms["auto"], 3),
               "reference_ms": round(ms["reference"], 3),
               "speedup": round(ms["reference"] / ms["auto"], 2)}
        print(json.dumps(row))
        lines.append({"metric": "moe_cpu_expert_loop_speedup", "value": row["speedup"],
                      "unit": "x", "device": f"CPU, {args.threads} thread(s)",
                      "commit": results.git_commit(), "date": date.today().isoformat(),
                      "command": "python3 bench/bench_moe_cpu.py " + " ".join(sys.argv[1:]),
                      "shape": f"H{HIDDEN} I{INTER} E{EXPERTS} top{TOP_K}", **row})
    if args.record:
        results.append_results(lines)


if __name__ == "__main__":
    main()
