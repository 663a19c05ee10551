"""Fit speed and held-out error of the SPS and additive cost models on synthetic measurements.

Run: ``python3 bench/bench_fit.py [--repeats 7] [--record]``. ``--record`` appends one JSON line
per metric to ``bench/results.jsonl`` (``metric, value, unit, device, commit, date, command``).

- Speed: 1,000 measured points (a full 40 Bcap x 25 G target-verify grid, one window each,
  G in 40..232) fitted by each
  estimator alone, and by ``build_table`` (fit + residuals + leave-one-point-out +
  leave-one-G-out diagnostics); median wall time of ``--repeats`` runs after one warm-up.
- Error: the split-graph legal grid of Bcap 1..16 (powers of two), w = 7, 3 windows per point,
  truth = linear in Bcap and G plus a 0.3 ms step at every G divisible by 3, Gaussian noise
  0.05 ms per window, seed 0; leave-one-point-out and leave-one-G-out error of each model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date

import numpy as np
from results import append_results, git_commit

from speccal.costmodel.additive import AdditiveCostModel
from speccal.costmodel.compat import make_compatibility
from speccal.costmodel.sps import SPSCostModel
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table_build import build_table

DEVICE = "cpu (2-core dev machine)"
COMPAT = make_compatibility(
    draft_width=7,
    architecture="bench",
    fingerprint="bench",
    dtype="float32",
    quantization="none",
    device_name="bench",
)


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up: imports, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(repeats: int) -> dict[str, float]:
    bcaps = list(range(1, 41))
    gs = [40 + 8 * i for i in range(25)]  # G >= Bcap everywhere: a legal target_verify grid
    df = make_measurements(
        bias_ms=5.0,
        alpha_ms={b: 0.05 * b for b in bcaps},
        theta_ms={g: 0.02 * g for g in gs},
        points=[(b, g) for b in bcaps for g in gs],
        mode="target_verify",
        windows_per_point=1,
        noise_ms=0.05,
        seed=0,
    )
    assert len(df) == 1000
    X, y = df[["bcap", "g"]].to_numpy(float), df["step_ms"].to_numpy()
    return {
        "fit_additive_1000_points_ms": 1000
        * median_time(lambda: AdditiveCostModel().fit(X, y), repeats),
        "fit_sps_1000_points_ms": 1000 * median_time(lambda: SPSCostModel().fit(X, y), repeats),
        "build_table_additive_1000_points_ms": 1000
        * median_time(lambda: build_table(df, model="additive", compatibility=COMPAT), repeats),
        "build_table_sps_1000_points_ms": 1000
        * median_time(lambda: build_table(df, model="sps", compatibility=COMPAT), repeats),
    }


def held_out() -> dict[str, float]:
    bcaps = [1, 2, 4, 8, 16]
    gs = sorted({b * j for b in bcaps for j in range(1, 9)})
    df = make_measurements(
        bias_ms=5.0,
        alpha_ms={b: 0.05 * b for b in bcaps},
        theta_ms={g: 0.02 * g + (0.3 if g % 3 == 0 else 0.0) for g in gs},
        draft_width=7,
        windows_per_point=3,
        noise_ms=0.05,
        seed=0,
    )
    out = {}
    for model in ("additive", "sps"):
        d = build_table(df, model=model, compatibility=COMPAT).fits[0].diagnostics
        for scheme, short in (("leave_one_point_out", "lopo"), ("leave_one_g_out", "logo")):
            e = getattr(d, scheme)
            out[f"heldout_{short}_{model}_mae_ms"] = e.mae_ms
            out[f"heldout_{short}_{model}_mean_abs_pct"] = e.mean_abs_pct
            out[f"heldout_{short}_{model}_evaluated"] = e.n_evaluated
        out[f"residual_{model}_mae_ms"] = d.residuals.mae_ms
    out["heldout_points"] = float(np.int64(len(d.points)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--record", action="store_true", help="append JSON lines to bench/results.jsonl"
    )
    args = ap.parse_args()
    results = {**speed(args.repeats), **held_out()}
    commit = git_commit()
    command = "python3 bench/bench_fit.py " + " ".join(sys.argv[1:])
    lines = []
    for metric, value in results.items():
        unit = "ms" if metric.endswith("_ms") else "%" if metric.endswith("_pct") else "count"
        lines.append(
            {
                "metric": metric,
                "value": round(float(value), 6),
                "unit": unit,
                "device": DEVICE,
                "commit": commit,
                "date": date.today().isoformat(),
                "command": command.strip(),
            }
        )
    for line in lines:
        print(json.dumps(line, sort_keys=True))
    if args.record:
        append_results(lines)


if __name__ == "__main__":
    main()
