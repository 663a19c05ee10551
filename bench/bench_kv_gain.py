"""KV-aware adaptive draft step vs a single-context table on a growing-context workload
(issue 23, ``kv_aware_gain_pct``).

Two ``draft_step`` tables of the same preset and machine: a multi-context one (the default KV
levels up to ``--max-kv-length``: it carries the KV-aware model) and a single-context one at the
workload's *starting* context (``--prompt-len``: what a user calibrating "at the context they
serve" gets). One pipelined engine on the path the tables were calibrated on (the device's served path, as
``speccal calibrate`` picks it) then decodes the same workload, requests whose KV grows from
``--prompt-len`` to ``--prompt-len + --max-tokens``, under adaptive draft step priced by each
table, interleaved ``--repeats`` times (``speccal.live.policies.run_interleaved``). Reported:

- live decode tokens/s of each (the loop rate: the whole decode wall, prefill excluded), median
  over repeats with every run listed, and ``kv_aware_gain_pct`` = KV-aware over single-context
  minus one;
- the replay prediction of both runs priced by the KV-aware table (the more accurate model), so
  the predicted gain sits next to the measured one;
- each policy's decisions along the run (mean k per KV quartile): the KV-aware policy's move with
  context, the single-context one's hold (or fall back to full width where its table is
  uncalibrated).

    python3 bench/bench_kv_gain.py --model dense-2b --device cuda --dtype bfloat16 --out $OUT/kv
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from speccal.costmodel.table import load_table
from speccal.live.policies import Phase, live_cost_model, replay_prediction, run_interleaved
from speccal.policy import AdaptiveStepConfig, AdaptiveStepPolicy, CostModel
from speccal.runner.engine import Engine, EngineConfig
from speccal.runner.path import KernelConfig, served_path
from speccal.runner.sampling import SamplingParams


def _calibrate(args, out: Path, contexts, console: Console) -> Path:
    cfg = out.with_suffix(".config.json")
    cal = {"request_buckets": [int(b) for b in args.request_buckets.split(",")],
           "warmup_steps": args.warmup_steps, "window_steps": args.window_steps,
           "windows_per_point": args.windows_per_point}
    if contexts is not None:
        cal["contexts"] = contexts
    cfg.write_text(json.dumps({"calibration": cal}))
    calibrate(CalibrateOptions(model=args.model, device=args.device, dtype=args.dtype,
                               draft_width=args.draft_width, config_path=cfg, out=out,
                               max_model_len=args.max_kv_length, overwrite=True,
                               flags={"mode": "draft_step"},
                               accept_noisy=args.accept_noisy), console=console)
    return out


def _k_by_kv_quartile(run) -> list[float]:
    """Mean k of the run's rounds in each quartile of their batch mean KV (decisions vs context)."""
    kv = np.asarray(run.trace.kv_length, dtype=float)
    edges = np.quantile(kv, [0.25, 0.5, 0.75])
    bins = np.searchsorted(edges, kv)
    return [float(run.k[bins == q].mean()) if (bins == q).any() else float("nan")
            for q in range(4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dense-2b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--draft-width", type=int, default=3)
    ap.add_argument("--request-buckets", default="1,2,4,8")
    ap.add_argument("--max-kv-length", type=int, default=4096)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=3072)
    ap.add_argument("--profile", default="0.7,0.5,0.35", help="synthetic acceptance per position")
    ap.add_argument("--warmup-steps", type=int, default=4)
    ap.add_argument("--window-steps", type=int, default=32)
    ap.add_argument("--windows-per-point", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--table-kv", default=None, help="multi-context draft_step table (skip calibrating)")
    ap.add_argument("--table-single", default=None, help="single-context draft_step table")
    ap.add_argument("--accept-noisy", action="store_true")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    console = Console(stderr=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    kv_path = Path(args.table_kv) if args.table_kv else _calibrate(
        args, out / "draft-step-kv.json", None, console)
    single_ctx = [{"prefill_tokens": args.prompt_len, "min_kv_length": 1,
                   "max_kv_length": min(args.max_kv_length, 4 * args.prompt_len + 256)}]
    single_path = Path(args.table_single) if args.table_single else _calibrate(
        args, out / "draft-step-single.json", single_ctx, console)
    calibrate_s = time.perf_counter() - t0
    profile = tuple(float(v) for v in args.profile.split(","))
    engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                 draft_width=args.draft_width, acceptance="synthetic",
                                 acceptance_profile=profile, pipeline=True,
                                 max_model_len=args.max_kv_length,
                                 path=served_path(args.device, KernelConfig()),
                                 request_buckets=tuple(int(b) for b in args.request_buckets.split(","))))
    compat = engine.compatibility()
    t_kv, t_single = load_table(kv_path, expect=compat), load_table(single_path, expect=compat)
    if t_kv.kv_model is None:
        raise SystemExit(f"{kv_path}: no KV-aware model (needs three or more contexts)")
    step_cfg = AdaptiveStepConfig()
    costs = {"kv-aware": live_cost_model(t_kv), "single-context": live_cost_model(t_single)}
    rng = np.random.default_rng(0)
    vocab = engine.loaded.config.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    timed = run_interleaved(
        engine, {n: (lambda c=c: AdaptiveStepPolicy(c, step_cfg)) for n, c in costs.items()},
        "draft_step", prompts, params, repeats=args.repeats, phases=[Phase(0.0, profile)],
        on_run=lambda i, total, spec: console.print(f"live {spec} ({i + 1}/{total}) ..."))
    truth = CostModel.from_table(t_kv)
    runs: dict[str, list[dict]] = {n: [] for n in costs}
    for tr in timed:
        s = tr.run.summary()
        pred = replay_prediction(tr.run, truth, AdaptiveStepPolicy(costs[tr.policy], step_cfg))
        runs[tr.policy].append({
            "loop_tokens_per_s": s["loop_tokens_per_s"], "round_tokens_per_s": s["round_tokens_per_s"],
            "mean_k": s["mean_k"], "rounds": s["rounds"],
            "predicted_tokens_per_s_kv_table": pred["predicted_tokens_per_s"],
            "decisions_match": pred["decisions_match"], "mean_k_by_kv_quartile": _k_by_kv_quartile(tr.run),
        })
    med = {n: statistics.median(r["loop_tokens_per_s"] for r in rs) for n, rs in runs.items()}
    pmed = {n: statistics.median(r["predicted_tokens_per_s_kv_table"] for r in rs)
            for n, rs in runs.items()}
    doc = {
        "kv_aware_gain_pct": 100.0 * (med["kv-aware"] / med["single-context"] - 1.0),
        "predicted_gain_pct": 100.0 * (pmed["kv-aware"] / pmed["single-context"] - 1.0),
        "worst_run_gain_pct": 100.0 * (min(r["loop_tokens_per_s"] for r in runs["kv-aware"])
                                       / max(r["loop_tokens_per_s"] for r in runs["single-context"])
                                       - 1.0),
        "live_loop_tokens_per_s_median": med, "runs": runs,
        "tables": {"kv-aware": str(kv_path), "single-context": str(single_path)},
        "setup": vars(args), "calibrate_s": calibrate_s, "compatibility": compat,
    }
    (out / "kv_gain.json").write_text(json.dumps(doc, indent=1, default=float))
    for n, rs in runs.items():
        console.print(f"{n}: loop tok/s {[round(r['loop_tokens_per_s']) for r in rs]} (median "
                      f"{med[n]:.0f}), mean k {[round(r['mean_k'], 2) for r in rs]}, k by KV "
                      f"quartile {[round(v, 2) for v in rs[0]['mean_k_by_kv_quartile']]}")
    console.print(f"kv_aware_gain_pct {doc['kv_aware_gain_pct']:+.2f} % (predicted "
                  f"{doc['predicted_gain_pct']:+.2f} %, worst-run pairing "
                  f"{doc['worst_run_gain_pct']:+.2f} %)")


if __name__ == "__main__":
    main()
