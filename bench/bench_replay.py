"""Replay speed and the "transition" done-when numbers of the adaptive policies (CPU).

Run: ``python3 bench/bench_replay.py [--rounds 1000000] [--record]``. ``--record`` appends one
JSON line per metric to ``bench/results.jsonl`` (``metric, value, unit, device, commit, date,
command``).

- Trace: ``speccal.scenarios.make_scenario("transition", rounds, draft_width=5,
  num_requests=8, kv_length=1024, seed=0)``: conditional acceptance 0.9 for the first half, 0.45
  for the second; draft scores ~ Beta(4q, 4(1-q)), accepted with probability = score.
- Tables: ``speccal.scenarios.synthetic_table`` (costmodel synthetic generator + additive fit,
  noise 0.05 ms per window, seed 0) over the default geometry (w = 5, Bcap 1, 2, 4, 8), one
  ``draft_step`` and one ``target_verify`` table.
- Speed: wall time of ``speccal.replay.replay`` for each adaptive policy (every fixed k and the
  per-phase oracle included), median of ``--repeats`` after one warm-up on a 10^4-round trace;
  wall time and process CPU time (the dev machine is shared: wall time includes waiting for a
  core, CPU time is what the replay itself costs).
- Quality: tokens/s of the adaptive policy vs the best fixed k and vs the per-phase oracle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from results import append_results, git_commit

from speccal.policy import CostModel
from speccal.replay import ReplayConfig, replay
from speccal.scenarios import generate, make_scenario, scenario_geometry, synthetic_table

HERE = Path(__file__).resolve().parent
DEVICE = "cpu (2-core dev machine)"


def run(rounds: int, repeats: int) -> dict[str, float]:
    t0 = time.perf_counter()
    trace = generate(
        make_scenario("transition", rounds=rounds, draft_width=5, num_requests=8, seed=0)
    )
    gen_s = time.perf_counter() - t0
    small = generate(
        make_scenario("transition", rounds=10_000, draft_width=5, num_requests=8, seed=1)
    )
    geo = scenario_geometry(5, 8)
    out: dict[str, float] = {"generate_transition_trace_s": gen_s}
    for mode, pol, tag in (
        ("draft_step", "adaptive-step", "adaptive_step"),
        ("target_verify", "adaptive-verify", "adaptive_verify"),
    ):
        cost = CostModel.from_table(synthetic_table(geo, mode))
        cfg = ReplayConfig(policies=(pol,))
        replay(small, cost, cfg)  # warm-up
        times, cpu, rep = [], [], None
        for _ in range(repeats):
            t, c = time.perf_counter(), time.process_time()
            rep = replay(trace, cost, cfg)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        d = rep.to_dict()
        by = {p["name"]: p for p in d["policies"]}
        best = by[d["best_fixed"]]["tokens_per_s"]
        oracle = by["oracle:per-phase"]["tokens_per_s"]
        ada = by[pol]["tokens_per_s"]
        out[f"replay_{rounds}_rounds_{tag}_wall_s"] = statistics.median(times)
        out[f"replay_{rounds}_rounds_{tag}_cpu_s"] = statistics.median(cpu)
        out[f"{tag}_gain_vs_best_fixed_pct"] = 100 * (ada / best - 1)
        out[f"{tag}_vs_phase_oracle_pct"] = 100 * (ada / oracle - 1)
        out[f"{tag}_tokens_per_s"] = ada
        out[f"{tag}_best_fixed_tokens_per_s"] = best
        print(
            f"{pol}: best fixed {d['best_fixed']}, oracle {d['oracle_per_phase']}", file=sys.stderr
        )
    return out


UNITS = {"_tokens_per_s": "tokens/s (predicted)", "_pct": "%", "_s": "s"}


def unit(metric: str) -> str:
    for suffix, u in UNITS.items():
        if metric.endswith(suffix):
            return u
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--record", action="store_true", help="append the metrics to bench/results.jsonl"
    )
    args = ap.parse_args()
    res = run(args.rounds, args.repeats)
    commit = git_commit()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "speccal", "bench/bench_replay.py"],
        capture_output=True,
        text=True,
        cwd=HERE,
    ).stdout.strip()
    if dirty:
        commit += " (+ uncommitted replay work)"
    command = "python3 bench/bench_replay.py " + " ".join(sys.argv[1:])
    lines = [
        {
            "metric": m,
            "value": round(v, 4),
            "unit": unit(m),
            "device": DEVICE,
            "commit": commit,
            "date": date.today().isoformat(),
            "command": command.strip(),
        }
        for m, v in res.items()
    ]
    for line in lines:
        print(json.dumps(line, sort_keys=True))
    if args.record:
        append_results(lines)


if __name__ == "__main__":
    main()
