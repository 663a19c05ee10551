"""Host time a policy adds to every live round: ``decide`` + ``observe`` per round.

Usage: python3 bench/bench_policy_host.py --table T.json [--batch 12] [--rounds 2000]
       [--kv 600] [--repeats 5] [--record] [--results PATH]

The pipelined live loop prepares round ``n + 1`` while the device runs round ``n``; whatever
the host does per round (prepare, collect, stop rules, and the policy's ``decide`` / ``observe``)
must fit inside the device's round or the device waits, and the table, which prices
device-bound rounds, then underprices the run. This bench times the policy's share alone, the
way ``speccal.live`` calls it: the memoised live cost model (``live_cost_model``), one batch of
``--batch`` requests whose mean KV grows by one token a round from ``--kv`` (as a decoding
batch's does: an exact-KV memo never hits; a KV-aware table's candidates are priced on their
lines in KV, ``TableLookup.kv_line``), each round's feedback observed one round late
(the pipelined lag), accepted lengths drawn uniformly. Per policy (``fixed:1`` and the table's
adaptive one): median over ``--repeats`` of the per-round median and 95th percentile, in us,
and the ratio of the adaptive policy's median to ``fixed:1``'s. A CPU figure: it depends on
the host's single-core speed, so say on which machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from speccal.base.gcpause import paused_gc
from speccal.costmodel.table import load_table
from speccal.live.policies import live_cost_model
from speccal.policy import BatchState, Feedback, make_policy, table_step_config


def per_round_us(make, batch: int, rounds: int, kv0: float, seed: int) -> np.ndarray:
    """Per-round host microseconds of ``decide`` + ``observe`` for a fresh policy."""
    policy = make()
    rng = np.random.default_rng(seed)
    w = policy.cost.draft_width
    pending: list[Feedback] = []
    out = np.empty(rounds)
    with paused_gc():
        for r in range(rounds):
            t0 = time.perf_counter()
            d = policy.decide(BatchState(round_index=r, num_requests=batch,
                                         kv_length=kv0 + r))
            scores = (rng.random((batch, w)) if policy.cost.mode == "target_verify" else None)
            pending.append(Feedback(round_index=r, k=d.k,
                                    accepted=rng.integers(0, d.k + 1, batch),
                                    draft_scores=scores))
            if len(pending) == 2:
                policy.observe(pending.pop(0))
            out[r] = 1e6 * (time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--kv", type=float, default=600.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--results", default=None)
    ap.add_argument("--device-label", default=None)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.rounds < 100 or args.repeats < 1:
        ap.error("--batch >= 1, --rounds >= 100, --repeats >= 1")
    table = load_table(Path(args.table))
    cost = live_cost_model(table)
    if not 1 <= args.batch <= max(cost.geometry.request_buckets):
        ap.error(f"--batch: got {args.batch}, expected 1..{max(cost.geometry.request_buckets)}")
    adaptive = "adaptive-verify" if cost.mode == "target_verify" else "adaptive-step"
    step_cfg = table_step_config(table)
    makers = {
        "fixed:1": lambda: make_policy("fixed:1", live_cost_model(table)),
        adaptive: lambda: make_policy(adaptive, live_cost_model(table), step_config=step_cfg),
    }
    skip = args.rounds // 10  # the first rounds fill the memo and the window
    doc: dict[str, dict[str, float]] = {}
    for name, make in makers.items():
        meds, p95s = [], []
        for rep in range(args.repeats):
            us = per_round_us(make, args.batch, args.rounds, args.kv, rep)[skip:]
            meds.append(float(np.median(us)))
            p95s.append(float(np.percentile(us, 95)))
        doc[name] = {"median_us": statistics.median(meds), "p95_us": statistics.median(p95s),
                     "runs_median_us": meds}
        print(f"{name:16s} median {doc[name]['median_us']:7.1f} us  p95 "
              f"{doc[name]['p95_us']:7.1f} us  (runs {', '.join(f'{m:.1f}' for m in meds)})")
    ratio = doc[adaptive]["median_us"] / doc["fixed:1"]["median_us"]
    print(f"{adaptive} / fixed:1: {ratio:.1f}x")
    if args.record:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import results

        device = args.device_label or f"cpu ({os.cpu_count()} cores)"
        line = {
            "metric": f"{adaptive.replace('-', '_')}_host_us_per_round",
            "value": round(doc[adaptive]["median_us"], 1), "unit": "us", "device": device,
            "commit": results.git_commit(), "date": date.today().isoformat(),
            "command": "python3 bench/bench_policy_host.py " + " ".join(argv or sys.argv[1:]),
            "fixed_1_us": round(doc["fixed:1"]["median_us"], 1), "ratio_to_fixed_1":
            round(ratio, 2), "p95_us": round(doc[adaptive]["p95_us"], 1), "batch": args.batch,
            "rounds": args.rounds, "repeats": args.repeats, "kv_start": args.kv,
            "table": args.table,
        }
        results.append_results([line], Path(args.results) if args.results else results.RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
