"""Host time per round of the tiny preset on a CPU, at the default calibration's grid points.

Usage: python3 bench/bench_cpu_round.py [--reps 5] [--loop pipelined|synchronous]
       [--points out/cpu-round-points.json] [--base DIR]

Each of six points of the default tiny calibration (contexts 0, 1 and 3; Bcap 1, 4 and 8) runs
``--reps`` times: fresh requests with the point's synthetic prompts (admitted by KV copy from
one prompt source, as calibration does), a transition step, 8 warm-up steps, 32 timed
``Engine.step`` calls (``perf_counter`` around each; on a CPU a step is the round's whole host
work). Prints one JSON object: the median ms per point. ``--points`` holds the points' prompts:
written from this tree's calibration driver when missing, read otherwise, so that ``--base``
(a runner imported from another tree, e.g. ``git archive C | tar -x -C DIR``) times the very
same rounds. bench/RESULTS.md, issue 25.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

WANT = [(0, 1, 1), (0, 8, 32), (1, 4, 12), (3, 1, 1), (3, 8, 8), (3, 8, 32)]


def write_points(path: Path) -> None:
    from speccal.calibrate import driver
    from speccal.calibrate.config import UserConfig, resolve_config
    from speccal.calibrate.grid import build_grid
    from speccal.calibrate.pipeline import CalibrateOptions, make_engine

    cfg = resolve_config(UserConfig.build(None, {}), make_engine(CalibrateOptions()).geometry)
    out = []
    for p in build_grid(cfg):
        if (p.context_index, p.bcap, p.g) in WANT:
            prompts = driver.synthetic_prompts(cfg, p, 512,
                                               advance_rounds=driver.replicate_advance(cfg))
            out.append({"name": f"ctx{p.context_index} B{p.bcap} G{p.g}", "k": p.k,
                        "verify_tokens": list(p.verify_tokens), "prompts": prompts})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))


def use_tree(base: str) -> None:
    """Import speccal's packages from another unpacked tree (its package-dir layout)."""
    import speccal

    speccal.__path__ = [f"{base}/speccal"]
    for pkg in ("runner", "calibrate", "kernels", "costmodel"):
        importlib.import_module(f"speccal.{pkg}").__path__ = [f"{base}/{pkg}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--loop", default="pipelined", choices=("pipelined", "synchronous"))
    ap.add_argument("--points", type=Path, default=Path("out/cpu-round-points.json"))
    ap.add_argument("--base", default=None)
    args = ap.parse_args()
    if not args.points.exists():
        if args.base:
            sys.exit(f"{args.points} missing: write it from this tree first (no --base)")
        write_points(args.points)
    if args.base:
        use_tree(args.base)
    import numpy as np
    import torch

    from speccal.calibrate.pipeline import CalibrateOptions, make_engine
    from speccal.runner.engine import RoundPlan
    from speccal.runner.sampling import SamplingParams

    torch.set_num_threads(1)
    points = json.loads(args.points.read_text())
    eng = make_engine(CalibrateOptions(loop=args.loop))
    eng.set_prompt_source(max((p for x in points for p in x["prompts"]), key=len))
    times: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for x in points:
            plan = RoundPlan(num_draft_steps=x["k"], verify_tokens=tuple(x["verify_tokens"]))
            eng.reset()
            for prompt in x["prompts"]:
                eng.add_request(prompt, SamplingParams(max_tokens=300, ignore_eos=True))
            eng.step(plan)
            for _ in range(8):
                eng.step(plan)
            eng.synchronize()
            for _ in range(32):
                t0 = time.perf_counter()
                eng.step(plan)
                times.setdefault(x["name"], []).append(time.perf_counter() - t0)
            eng.drain()
    print(json.dumps({k: round(1e3 * float(np.median(v)), 3) for k, v in times.items()}))


if __name__ == "__main__":
    main()
