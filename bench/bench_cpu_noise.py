"""How a CPU machine's speed drifts: one fixed tiny round shape, timed for a while.

Usage: python3 bench/bench_cpu_noise.py [--bcap 1] [--kv 100] [--seconds 60]

Runs batches of 40 pipelined rounds (8 warm-up, 32 kept) of one shape and prints, over the
32-round windows: wall vs process CPU time per round, the windows' CV, the autocorrelation of
consecutive windows' means, and the (max - min) / median spread of three windows (the quality
gate's statistic) when they are adjacent or drawn at random over the run. bench/RESULTS.md,
issue 25.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from speccal.calibrate.pipeline import CalibrateOptions, make_engine
from speccal.runner.engine import RoundPlan
from speccal.runner.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bcap", type=int, default=1)
    ap.add_argument("--kv", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    eng = make_engine(CalibrateOptions(loop="pipelined"))
    base = np.random.default_rng(0).integers(0, 512, size=4096).tolist()
    eng.set_prompt_source(base[: args.kv + 10])
    plan = RoundPlan(num_draft_steps=eng.geometry.draft_width)
    wall, cpu, windows = [], [], []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        eng.reset()
        for i in range(args.bcap):
            eng.add_request(base[: args.kv - 2 * i], SamplingParams(max_tokens=200, ignore_eos=True))
        eng.step(plan)
        for _ in range(8):
            eng.step(plan)
        eng.synchronize()
        w = []
        for _ in range(32):
            t0, c0 = time.perf_counter(), time.process_time()
            eng.step(plan)
            w.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        eng.drain()
        wall += w
        windows.append(1e3 * float(np.mean(w)))
    m = np.asarray(windows)
    x = m - m.mean()
    rng = np.random.default_rng(0)
    spread = lambda v: 100 * float(np.ptp(v) / np.median(v))  # noqa: E731
    adj = [spread(m[i : i + 3]) for i in range(0, len(m) - 2, 3)]
    far = [spread(m[rng.choice(len(m), 3, replace=False)]) for _ in range(500)]
    print(json.dumps({
        "rounds": len(wall), "windows": len(m),
        "median_wall_ms": round(1e3 * float(np.median(wall)), 3),
        "median_cpu_ms": round(1e3 * float(np.median(cpu)), 3),
        "window_cv_pct": round(100 * float(m.std() / m.mean()), 2),
        "autocorr_lag1": round(float((x[:-1] * x[1:]).mean() / x.var()), 3),
        "autocorr_lag10": round(float((x[:-10] * x[10:]).mean() / x.var()), 3),
        "spread3_adjacent_median_p90": [round(float(np.median(adj)), 1),
                                        round(float(np.percentile(adj, 90)), 1)],
        "spread3_random_median_p90": [round(float(np.median(far)), 1),
                                      round(float(np.percentile(far, 90)), 1)],
    }))


if __name__ == "__main__":
    main()
