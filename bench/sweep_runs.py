"""The sweep's live runs on disk, and their replay against another table (CPU, no engine).

A GPU sweep (``bench/bench_sweep.py --save-runs DIR``) writes every timed run of every workload:
``DIR/<workload>/<i>-<policy>.jsonl`` (its round trace, ``speccal.trace.save_trace``) and
``.npz`` (the live run's per-round arrays: k, G, rows run, requests, accepted, verified, round
ms, phase, priced) with its scalars in ``.json``. This module reads them back as
:class:`speccal.live.policies.LiveRun` values and replays them, so a change to how a table
prices a round is judged on the runs the GPU already measured, without GPU time:

    python3 bench/sweep_runs.py --runs DIR --table T [--json-out PATH] [--window-size 20 ...]

prints, per workload and policy, every run's live vs replay error and the worst, and the
residual breakdown (``bench_sweep.round_residuals``) summed over the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ARRAYS = ("k", "g", "g_run", "num_requests", "accepted", "verified", "round_ms", "phase")


def save_run(run, stem: Path, extra: dict | None = None) -> None:
    """Write one ``LiveRun`` as ``stem.jsonl`` (trace), ``stem.npz`` and ``stem.json``."""
    from speccal.base.atomic import write_bytes_atomic
    from speccal.trace import save_trace

    stem.parent.mkdir(parents=True, exist_ok=True)
    save_trace(run.trace, stem.with_suffix(".jsonl"))
    arrays = {n: np.asarray(getattr(run, n)) for n in ARRAYS}
    if run.priced is not None:
        arrays["priced"] = np.asarray(run.priced, dtype=bool)
    with open(stem.with_suffix(".npz"), "wb") as f:
        np.savez_compressed(f, **arrays)
    scalars = {"policy": run.policy, "prefill_s": run.prefill_s,
               "output_tokens": run.output_tokens, "loop_s": run.loop_s,
               "pipelined": run.pipelined, "reasons": list(run.reasons), **(extra or {})}
    write_bytes_atomic(stem.with_suffix(".json"),
                       json.dumps(scalars, default=float, sort_keys=True).encode())


def load_run(stem: Path):
    """The ``LiveRun`` :func:`save_run` wrote at ``stem``, and its extra scalars."""
    from speccal.live.policies import LiveRun
    from speccal.trace import load_trace

    scalars = json.loads(stem.with_suffix(".json").read_text())
    with np.load(stem.with_suffix(".npz")) as z:
        arrays = {n: z[n] for n in z.files}
    run = LiveRun(
        policy=scalars["policy"], trace=load_trace(stem.with_suffix(".jsonl")),
        reasons=list(scalars["reasons"]), prefill_s=float(scalars["prefill_s"]),
        output_tokens=int(scalars["output_tokens"]), loop_s=float(scalars["loop_s"]),
        pipelined=bool(scalars["pipelined"]), priced=arrays.pop("priced", None),
        **{n: arrays[n] for n in ARRAYS})
    return run, scalars


def runs_in(root: Path) -> dict[str, list[Path]]:
    """Workload -> the stems of its saved runs, in run order."""
    out: dict[str, list[Path]] = {}
    for p in sorted(Path(root).glob("*/*.npz")):
        out.setdefault(p.parent.name, []).append(p.with_suffix(""))
    return out


def rereplay(root: Path, table_path: Path, step_cfg) -> dict:
    """Every saved run replayed against ``table_path``: per workload and policy, the runs'
    errors and the worst; ``residual_breakdown`` as the sweep sums it."""
    from bench_live_policy import policy_factory
    from bench_sweep import residual_breakdown, round_residuals

    from speccal.costmodel.table import load_table
    from speccal.live.policies import replay_prediction
    from speccal.policy import CostModel

    cost = CostModel.from_table(load_table(table_path))
    out: dict = {"table": str(table_path), "workloads": {}}
    docs = []
    for name, stems in runs_in(root).items():
        policies: dict[str, dict] = {}
        for stem in stems:
            run, _ = load_run(stem)
            p = replay_prediction(run, cost, policy_factory(run.policy, cost, step_cfg)())
            pol = policies.setdefault(run.policy, {"errors": [], "decisions_match": True,
                                                   "runs": []})
            pol["errors"].append(p["error_pct"])
            pol["decisions_match"] &= bool(p["decisions_match"])
            pol["runs"].append({"residual": round_residuals(run, p["predicted_round_ms"], cost),
                                "live_tokens_per_s": p["live_round_tokens_per_s"],
                                "replay_tokens_per_s": p["predicted_tokens_per_s"]})
        for pol in policies.values():
            errs = pol["errors"]
            pol["error_pct_max"] = max(errs) if all(math.isfinite(e) for e in errs) else math.nan
        out["workloads"][name] = policies
        docs.append({"policies": policies,
                     "adaptive": next((n for n in policies if n.startswith("adaptive")), "")})
    out["residual_breakdown"] = residual_breakdown(docs)
    finite = [p["error_pct_max"] for w in out["workloads"].values() for p in w.values()]
    out["replay_vs_live_error_pct_sweep_max"] = (
        max(finite) if finite and all(math.isfinite(e) for e in finite) else math.nan)
    return out


def main(argv: list[str] | None = None) -> int:
    from speccal.policy import AdaptiveStepConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="a bench_sweep --save-runs folder")
    ap.add_argument("--table", required=True)
    ap.add_argument("--window-size", type=int, default=20)
    ap.add_argument("--update-interval", type=int, default=5)
    ap.add_argument("--switch-min-gain", type=float, default=0.05)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if not runs_in(Path(args.runs)):
        ap.error(f"--runs: {args.runs} holds no saved runs (DIR/<workload>/<run>.npz)")
    res = rereplay(Path(args.runs), Path(args.table),
                   AdaptiveStepConfig(args.window_size, args.update_interval,
                                      args.switch_min_gain))
    for name, pols in res["workloads"].items():
        print(name)
        for pname, p in pols.items():
            errs = ", ".join(f"{e:.2f}" for e in p["errors"])
            print(f"  {pname:16s} errors {errs}  max {p['error_pct_max']:.2f} %  decisions "
                  f"match {p['decisions_match']}")
    print(f"worst {res['replay_vs_live_error_pct_sweep_max']:.2f} %")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
