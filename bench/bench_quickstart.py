"""The README's quick start, as a new user runs it, on a shared machine: wall, exit, held-out.

Usage: python3 bench/bench_quickstart.py [--runs 5] [--hogs 1] [--record]

Each run starts from an empty folder and runs the Quick start's main job exactly as the README
prints it (``mkdir -p out && speccal calibrate --model tiny --out out/tiny-cpu.json``) in a
fresh process, while ``--hogs`` other CPU-bound processes (a pure-Python busy loop each) run
beside it for the whole run. Per run: the command's wall time (from before the process starts
to its exit), its exit status, the written table's held-out error (the quality gate's
statistic, ``calibration.quality.heldout_pct``), its window spread and the load average. The
figures issue 34 asks for are the worst of the runs: ``quickstart_wall_s_cpu_loaded`` (bound
60 s) and ``quickstart_heldout_pct_cpu_loaded`` (bound 5 %), each run quoted in the record.
A run that exits non-zero or writes no table counts as failed (its held-out is the gate's
refusal, read from its ``--json`` summary when there is one). bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results

COMMAND = ["speccal", "calibrate", "--model", "tiny", "--out", "out/tiny-cpu.json"]
HOG = [sys.executable, "-c", "while True: pass"]


def one_run(index: int, hogs: int) -> dict:
    """One quick start in a fresh folder beside ``hogs`` busy loops."""
    spinning = [subprocess.Popen(HOG) for _ in range(hogs)]
    try:
        time.sleep(0.5)  # the busy loops are running before the command starts
        load_before = os.getloadavg()
        with tempfile.TemporaryDirectory(prefix="speccal-quickstart-") as tmp:
            Path(tmp, "out").mkdir()
            t0 = time.perf_counter()
            proc = subprocess.run(COMMAND, cwd=tmp, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            table = Path(tmp, "out", "tiny-cpu.json")
            quality = {}
            if table.exists():
                quality = json.loads(table.read_text())["calibration"]["quality"] or {}
    finally:
        for p in spinning:
            p.kill()
            p.wait()
    tail = [line for line in proc.stderr.splitlines() if line.startswith(("error", "quality"))]
    return {
        "run": index,
        "wall_s": round(wall, 2),
        "exit": proc.returncode,
        "table_written": bool(quality),
        "heldout_pct": (round(float(quality["heldout_pct"]), 2)
                        if quality.get("heldout_pct") is not None else None),
        "window_spread_pct_max": (round(float(quality["window_spread_pct_max"]), 1)
                                  if quality.get("window_spread_pct_max") is not None else None),
        "remeasured_windows": quality.get("remeasured_windows"),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "last_lines": tail[-2:],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hogs", type=int, default=1, help="CPU-bound processes beside each run")
    ap.add_argument("--record", action="store_true", help="append to bench/results.jsonl")
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        r = one_run(i + 1, args.hogs)
        runs.append(r)
        print(json.dumps(r), flush=True)
    failed = [r["run"] for r in runs if r["exit"] != 0 or not r["table_written"]]
    walls = [r["wall_s"] for r in runs]
    held = [r["heldout_pct"] for r in runs if r["heldout_pct"] is not None]
    summary = {
        "runs": len(runs), "failed_runs": failed,
        "wall_s_worst": max(walls), "wall_s_all": walls,
        "heldout_pct_worst": max(held) if held else None, "heldout_pct_all": held,
    }
    print(json.dumps(summary))
    if not args.record:
        return
    base = {
        "device": f"{os.cpu_count()}-vCPU CPU VM, {args.hogs} busy-loop process(es) beside it",
        "commit": results.git_commit(),
        "date": _dt.date.today().isoformat(),
        "command": f"python3 bench/bench_quickstart.py --runs {args.runs} --hogs {args.hogs} "
                   f"(each run: mkdir -p out && {' '.join(COMMAND)})",
        "judged_by": "the worst run",
        "runs": runs,
        "failed_runs": failed,
    }
    results.append_results([
        {**base, "metric": "quickstart_wall_s_cpu_loaded", "value": max(walls), "unit": "s",
         "bound": 60},
        {**base, "metric": "quickstart_heldout_pct_cpu_loaded",
         "value": max(held) if held else None, "unit": "%", "bound": 5},
    ])


if __name__ == "__main__":
    main()
