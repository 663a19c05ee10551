"""The fidelity sweep's policy comparison simulated on a cost table, without a GPU.

Usage: python3 bench/sim_sweep.py --table T.json [--max-tokens 192,512,1024] [--seeds 4]
       [--workloads a,b] [--window-size N --update-interval N --switch-min-gain X] [--json-out F]

What ``bench/bench_sweep.py`` runs live, simulated: each workload of its ``WORKLOADS``
(resolved on the table's request buckets with ``bench_sweep.resolve``: request counts that are
not buckets, per-request ``max_tokens`` so the batch shrinks as requests finish, short and long
prompts, constant or phased synthetic acceptance changing at half the workload's tokens) runs
request by request to completion under ``fixed:1..w`` and the live ``AdaptiveStepPolicy``
object (the table's ``calibration.policy`` or the seeds' 20 / 5 / 0.05), each round priced by
``CostModel.price`` at its bucket, padded G, mean KV and longest request (the table's KV spread
term where it has one), with the pipelined engine's feedback lag (round ``r``'s acceptance
reaches the policy after round ``r + 1`` is planned). Acceptance per request and position is
drawn from the phase's conditional profile (``bench_sweep.profile``), ``--seeds`` runs per
policy with the same seeds for every policy (common random numbers), median tokens/s.

It answers what the live sweep cannot afford to try: how long the runs must be for the
adaptive step's window (``window_size`` batches) to follow a phase change, and what a workload
change does to the adaptive gain, before spending GPU time. It is a model: its tokens/s are the
table's, not a measurement (on an H100 at 3965b8d the live adaptive gains ran 0-3 points below
this simulation at ``--max-tokens 192``; bench/RESULTS.md).

On a ``target_verify`` table it runs ``fixed:1..w`` (``k`` verified drafts per request) and the
live ``AdaptiveVerifyPolicy``: every round drafts ``w``, each draft gets the synthetic score
of ``speccal.runner.sampling.synthetic_draft_scores`` (``--score-informativeness``, default as
``bench_sweep``'s: 0.5 on a target_verify table) and is accepted with that probability, the
adaptive budget's rows go to the drafts of highest prefix survival
(``speccal.policy_rules.allocate_prefixes``, the rule the device runs) and the round is priced
at its verify bucket.

On either table it also runs the **verify bound** (``verify-bound``): every round drafts ``w``
and sends the target exactly the drafts that will pass, known in advance, priced at ``k = w``
and the G of those rows. No verify policy that drafts full width (adaptive target verify,
SPEC 6) can beat it on the table, so its gain over the best fixed ``k``
(``verify_bound_vs_best_fixed_pct``) says what adaptive verify can win at all on a workload.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
from bench_sweep import BY_NAME, WORKLOADS, phase_oracle, profile, resolve, score_informativeness

from speccal.base.errors import InputError
from speccal.costmodel.table import load_table
from speccal.policy import (
    AdaptiveStepConfig,
    AdaptiveStepPolicy,
    AdaptiveVerifyPolicy,
    BatchState,
    CostModel,
    Feedback,
    FixedPolicy,
    table_step_config,
)
from speccal.policy_rules import allocate_prefixes


def simulate(cost: CostModel, spec: dict, policy, seed: int, phase_at: float = 0.5,
             informativeness: float = 0.0) -> dict:
    """One run of a resolved workload (``bench_sweep.resolve``) under ``policy``: tokens,
    priced milliseconds, rounds and per-phase tokens / ms. ``informativeness``: the synthetic
    scores' (target_verify tables). ``policy`` None: the verify bound (every round drafts
    ``w`` and sends the target exactly the drafts that will pass, known in advance; priced at
    ``k = w`` and the G of those rows on either table mode, or the next G the table prices at
    ``k = w``: a draft-step table has no k = w round below its partly filled batches' G): what
    no verify policy that drafts full width can beat on this table."""
    verify = cost.mode == "target_verify"
    bound = policy is None
    w = cost.draft_width
    mt = np.asarray(spec["max_tokens"], dtype=np.float64)
    prompt = np.asarray(spec["prompt_lens"], dtype=np.float64)
    levels = spec["acceptance"]
    total = float(mt.sum())
    rng = np.random.default_rng(seed)
    gen = np.zeros(mt.size)
    emitted, rounds, t_ms = 0.0, 0, 0.0
    by_phase = {p: [0.0, 0.0] for p in range(len(levels))}
    pending: list[Feedback] = []
    while (gen < mt).any():
        idx = np.flatnonzero(gen < mt)
        b = idx.size
        kv = prompt[idx] + gen[idx]
        d = None if bound else policy.decide(BatchState(round_index=rounds, num_requests=b,
                                                        kv_length=float(kv.mean())))
        phase = 0 if len(levels) == 1 or emitted < phase_at * total else 1
        q = np.asarray(profile(levels[phase], w))
        scores = None
        if verify:  # each draft's score, accepted with that probability (E = the profile)
            scores = q + informativeness * ((rng.random((b, w)) < q) - q)
            q = scores
        draws = rng.random((b, w)) < q  # every position drawn: the same stream for every k
        bcap = int(cost.bcap(b))
        k = w if bound else d.k
        passed = np.cumprod(draws, axis=1).sum(axis=1)  # drafts that pass, of all w
        if bound:
            acc = passed
            g = int(cost.g(bcap, b + int(acc.sum())))
        elif verify:
            g = int(d.g)
            nv = (np.asarray(d.verify_tokens) if d.verify_tokens is not None
                  else allocate_prefixes(scores, g - b))
            acc = np.minimum(passed, nv)
        else:
            acc = np.minimum(passed, d.k)
            g = int(cost.g(bcap, b * (d.k + 1)))
        # the bound on a draft-step table: k = w rounds are priced only from the G its partly
        # filled batches verify, so a G below them pays the next G the table prices
        tried = [g] + ([x for x in cost.geometry.target_rows[bcap] if x > g] if bound else [])
        for gg in tried:
            ms = float(cost.price(np.array([bcap]), np.array([gg]), np.array([kv.mean()]),
                                  k, np.array([kv.max()]))[0])
            if math.isfinite(ms) and ms > 0:
                break
        else:
            raise ValueError(f"{spec['name']}: the table does not price Bcap {bcap}, G {g}, "
                             f"KV {kv.mean():.0f} (round {rounds})")
        step = np.minimum(1.0 + acc, mt[idx] - gen[idx])
        gen[idx] += step
        emitted += float(step.sum())
        t_ms += ms
        by_phase[phase][0] += float(step.sum())
        by_phase[phase][1] += ms
        if not bound:  # pipelined: round r observed after round r + 1 was planned
            pending.append(Feedback(round_index=rounds, k=k, accepted=acc.astype(np.int64),
                                    draft_scores=scores))
            if len(pending) == 2:
                policy.observe(pending.pop(0))
        rounds += 1
    return {"tokens": emitted, "ms": t_ms, "rounds": rounds,
            "tokens_per_s": 1000.0 * emitted / t_ms,
            "phases": {str(p): {"tokens": v[0], "ms": v[1]} for p, v in by_phase.items()}}


def workload(cost: CostModel, spec: dict, cfg: AdaptiveStepConfig, seeds: int,
             informativeness: float = 0.0) -> dict:
    """Every policy on one workload, ``seeds`` runs each: median tokens/s, the adaptive gain
    over the best fixed ``k`` and over the per-phase oracle (each phase at its best fixed ``k``'s
    rate, weighted by the adaptive runs' tokens in that phase), and the verify bound's
    (:func:`simulate` without a policy) over the best fixed ``k``."""
    w = cost.draft_width
    makers = {f"fixed:{k}": (lambda k=k: FixedPolicy(cost, k)) for k in range(1, w + 1)}
    ad = "adaptive-verify" if cost.mode == "target_verify" else "adaptive-step"
    makers[ad] = ((lambda: AdaptiveVerifyPolicy(cost)) if ad == "adaptive-verify"
                  else (lambda: AdaptiveStepPolicy(cost, cfg)))
    makers["verify-bound"] = lambda: None
    runs = {name: [simulate(cost, spec, make(), 1000 + s, informativeness=informativeness)
                   for s in range(seeds)]
            for name, make in makers.items()}
    med = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in runs.items()}
    fixed = [n for n in runs if n.startswith("fixed:")]
    best = max(fixed, key=med.get)

    def totals(rs: list[dict]) -> dict[str, tuple[float, float]]:  # phase -> (tokens, seconds)
        return {ph: (sum(r["phases"][ph]["tokens"] for r in rs),
                     sum(r["phases"][ph]["ms"] for r in rs) / 1000.0) for ph in rs[0]["phases"]}

    oracle = phase_oracle(totals(runs[ad]), {n: totals(runs[n]) for n in fixed})["tokens_per_s"]
    return {
        "workload": spec,
        "tokens_per_s": med,
        "rounds": {n: statistics.median(r["rounds"] for r in rs) for n, rs in runs.items()},
        "best_fixed": best,
        "adaptive": ad,
        "gain_vs_best_fixed_pct": 100.0 * (med[ad] / med[best] - 1.0),
        "gain_vs_phase_oracle_pct": 100.0 * (med[ad] / oracle - 1.0),
        "verify_bound_vs_best_fixed_pct": 100.0 * (med["verify-bound"] / med[best] - 1.0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True, help="a cost table (its mode picks the policies)")
    ap.add_argument("--max-tokens", default="192", help="comma-separated values of the 1.0")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--workloads", default=None, help="default: all of bench_sweep's")
    ap.add_argument("--prompt-lens", default="64,512")
    ap.add_argument("--window-size", type=int, default=None, help="default: the table's")
    ap.add_argument("--update-interval", type=int, default=None, help="default: the table's")
    ap.add_argument("--switch-min-gain", type=float, default=None, help="default: the table's")
    ap.add_argument("--score-informativeness", type=float, default=None,
                    help="target_verify tables: the synthetic scores' (default 0.5)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    table = load_table(Path(args.table))
    cost = CostModel.from_table(table)
    try:
        lam = score_informativeness(args.score_informativeness, cost.mode)
    except ValueError as e:
        ap.error(str(e))
    names = args.workloads.split(",") if args.workloads else [w.name for w in WORKLOADS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"--workloads: unknown {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    if args.seeds < 1:
        ap.error(f"--seeds: got {args.seeds}, expected an integer >= 1")
    try:
        lengths = [int(x) for x in args.max_tokens.split(",")]
        prompt_lens = tuple(int(x) for x in args.prompt_lens.split(","))
    except ValueError as e:
        ap.error(f"--max-tokens / --prompt-lens: {e}")
    if not lengths or min(lengths) < 1 or len(prompt_lens) != 2:
        ap.error("--max-tokens: integers >= 1; --prompt-lens: SHORT,LONG")
    base = table_step_config(table) or AdaptiveStepConfig()
    try:
        cfg = AdaptiveStepConfig(
            window_size=base.window_size if args.window_size is None else args.window_size,
            update_interval=(base.update_interval if args.update_interval is None
                             else args.update_interval),
            switch_min_gain=(base.switch_min_gain if args.switch_min_gain is None
                             else args.switch_min_gain))
    except InputError as e:
        ap.error(str(e))
    buckets = tuple(table.calibration.request_buckets)
    out = {"table": args.table, "mode": cost.mode, "policy": vars(cfg), "seeds": args.seeds,
           "score_informativeness": lam, "by_max_tokens": {}}
    ad = "adaptive_verify" if cost.mode == "target_verify" else "adaptive_step"
    for mt in lengths:
        docs = [workload(cost, resolve(BY_NAME[n], buckets, mt, prompt_lens), cfg, args.seeds,
                         lam) for n in names]
        gains = [d["gain_vs_best_fixed_pct"] for d in docs]
        phased = [d["gain_vs_best_fixed_pct"] for d in docs if d["workload"]["phased"]]
        bounds = [d["verify_bound_vs_best_fixed_pct"] for d in docs]
        bounds_phased = [d["verify_bound_vs_best_fixed_pct"] for d in docs
                         if d["workload"]["phased"]]
        out["by_max_tokens"][str(mt)] = {
            f"{ad}_vs_best_fixed_pct_sweep_min": min(gains),
            f"{ad}_vs_best_fixed_pct_phased_min": min(phased) if phased else None,
            "verify_bound_vs_best_fixed_pct_sweep_min": min(bounds),
            "verify_bound_vs_best_fixed_pct_phased_min": min(bounds_phased) if phased else None,
            "workloads": docs,
        }
        print(f"max_tokens {mt}: {ad} vs best fixed min {min(gains):+.2f} %, "
              f"phased min {min(phased) if phased else math.nan:+.2f} %; verify bound min "
              f"{min(bounds):+.2f} %, phased {min(bounds_phased) if phased else math.nan:+.2f} %",
              file=sys.stderr)
        for d in docs:
            print(f"  {d['workload']['name']:28s} best {d['best_fixed']}  "
                  f"{d['gain_vs_best_fixed_pct']:+6.2f} % vs best fixed  "
                  f"{d['gain_vs_phase_oracle_pct']:+6.2f} % vs phase oracle  verify bound "
                  f"{d['verify_bound_vs_best_fixed_pct']:+6.2f} %", file=sys.stderr)
    text = json.dumps(out, indent=1, sort_keys=True, default=float)
    if args.json_out:
        Path(args.json_out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
