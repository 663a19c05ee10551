"""Live adaptive draft step vs fixed k, and the replay prediction of the live run, in one process.

Run: ``python3 bench/bench_live_policy.py [--model tiny] [--device cpu] [--table PATH]
[--table-out PATH] [--json-out PATH] [--repeats N] [--record]`` (on the H200: ``--model dense-2b --device cuda
--dtype bfloat16``).

Steps, all in this process on one machine:

1. calibrate a ``draft_step`` cost table of the preset (``speccal.calibrate.pipeline.calibrate``,
   the library call of ``speccal calibrate``; forced acceptance, the explicit small grid printed
   in the output) and write it to ``--table-out``, or load ``--table``;
2. build the live engine (same model, seed, buckets; synthetic acceptance) and load the table
   against its compatibility (``load_table(expect=...)``);
3. run the same workload live under ``fixed:1..w`` and ``adaptive-step``
   (``speccal.live.policies.run_live``): ``--num-requests`` random prompts (lengths spread over
   ``[--prompt-min, --prompt-max]``) of ``--max-tokens`` tokens each, at most the largest bucket
   in flight, acceptance profile ``--profile`` switching to ``--phase`` profiles at emitted-token
   fractions (default: the ``transition`` scenario shape, easy then hard); with ``--repeats N``
   each policy runs ``N`` times, interleaved (``speccal.live.policies.run_interleaved``): cycle
   ``c`` is the policy list rotated left by ``c`` (``fixed:1 fixed:2 fixed:3 adaptive-step``,
   ``fixed:2 fixed:3 adaptive-step fixed:1``, ...), so drift over the sequence does not always
   land on one policy; ``N = 1`` is the single pass in that order;
4. replay a fresh twin policy on every run's own recorded trace against the table
   (``speccal.replay.run_sequential``) and compare.

Reported: ``replay_vs_live_error_pct`` = |predicted - live| / live decode tokens/s of the adaptive
run (tokens = ``B + accepted`` per round, time = the rounds' wall time; prefill excluded, as the
table prices rounds only), ``decisions_match`` (replayed k per round == live k), and
``adaptive_step_gain_vs_best_fixed_pct`` (live tokens/s of adaptive-step over the best live fixed
k, same workload, same process). With ``N > 1`` both are computed from per-policy medians (the
median of the adaptive runs' replay errors; the gain from median tokens/s), ``adaptive_timeline``
and ``adaptive_by_shape`` are the first adaptive run's, and the JSON adds ``repeats``, ``order``
(scheme and sequence), ``run_log`` (per run: cycle, position, UTC start/end, seconds since the
first run, tokens/s, replay error; for plotting drift) and ``spread`` (min-max per policy).
``--record`` appends both metrics to ``bench/results.jsonl``.

``--pipeline`` builds the live engine with ``EngineConfig(pipeline=True)`` (pipelined rounds:
results one step late, feedback with the pipeline's lag, replayed with the same lag by
``replay_prediction``), and the table is calibrated on the same round loop (the calibration
engine is pipelined too). The JSON's ``setup.pipeline`` records it.

The steps are functions (:func:`build_live_engine`, :func:`load_checked_table`,
:func:`warm_up`, :func:`run_and_replay`), so ``bench_sweep.py`` runs the same code per workload.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

from results import append_results, git_commit


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.replace(",", " ").split())


# The steps of main() as functions, so other benches (bench_sweep.py) run the same code. Imports
# are local: ``--help`` and the sweep's parent process stay free of torch.


def build_live_engine(common: dict, profile: tuple[float, ...], pipeline: bool):
    """The live engine: ``common`` (``EngineConfig.flat`` keywords: model, device, dtype,
    draft_width, request_buckets, seed, graph_mode, attention_backend) with synthetic acceptance
    at ``profile`` and the kernels of the environment."""
    from speccal.kernels.config import KernelConfig
    from speccal.runner.engine import Engine, EngineConfig

    return Engine(EngineConfig.flat(kernels=KernelConfig.from_env(), **common,
                                    acceptance="synthetic", acceptance_profile=profile,
                                    pipeline=pipeline))


def load_checked_table(path: Path, engine) -> tuple:
    """``(table, warnings, document)``: the table at ``path`` loaded against the engine's
    compatibility (``load_table(expect=...)``), the messages of the mismatches it warned about,
    and its JSON document."""
    from speccal.costmodel.table import load_table

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = load_table(path, expect=engine.compatibility())
    return table, [str(x.message) for x in caught], json.loads(Path(path).read_text())


def policy_factory(spec: str, cost, step_cfg):
    """A callable building a fresh ``spec`` policy on ``cost`` (``adaptive-step`` with
    ``step_cfg``, an ``AdaptiveStepConfig``; anything else through ``make_policy``)."""
    from speccal.policy import AdaptiveStepPolicy, make_policy

    if spec == "adaptive-step":
        return lambda: AdaptiveStepPolicy(cost, step_cfg)
    return lambda: make_policy(spec, cost)


def warm_up(engine, cost, prompts, max_tokens: int = 8) -> float:
    """Run every fixed ``k`` once on ``prompts`` (``max_tokens`` each) so every shape has run
    before timing; returns the seconds it took."""
    from speccal.live.policies import run_live
    from speccal.policy import make_policy
    from speccal.runner.sampling import SamplingParams

    t0 = time.perf_counter()
    warm = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for k in range(1, engine.config.draft_width + 1):
        run_live(engine, make_policy(f"fixed:{k}", cost), cost.mode, prompts, warm)
    return time.perf_counter() - t0


def run_and_replay(engine, names, cost, replay_cost, prompts, params, *, step_cfg, phases,
                   repeats, meta, on_run=None, seed=None, on_replay=None):
    """Steps 3 and 4: every policy of ``names`` ``repeats`` times, interleaved
    (``run_interleaved``, planning with ``cost``), then a fresh twin replayed on every run's own
    trace against ``replay_cost``; ``seed``: common random numbers per cycle
    (``run_interleaved``). Returns ``(timed, per_policy, run_log)``: the
    :class:`TimedRun` list, policy -> its runs' summaries (each with ``replay``, the prediction
    without arrays), and per run its place, times, tokens/s and replay error. ``on_replay(tr,
    prediction)``: each run's full prediction (its per-round arrays too) as it is made."""
    import numpy as np

    from speccal.live.policies import replay_prediction, run_interleaved

    timed = run_interleaved(
        engine,
        {n: policy_factory(n, cost, step_cfg) for n in names},
        cost.mode,
        prompts,
        params,
        repeats=repeats,
        phases=phases,
        meta=meta,
        on_run=on_run,
        seed=seed,
    )
    per_policy: dict[str, list[dict]] = {n: [] for n in names}
    run_log = []
    for i, tr in enumerate(timed):
        p = replay_prediction(tr.run, replay_cost, policy_factory(tr.policy, replay_cost,
                                                                  step_cfg)())
        if on_replay is not None:
            on_replay(tr, p)
        s = tr.run.summary()
        s["replay"] = {k: v for k, v in p.items() if not isinstance(v, np.ndarray)}
        per_policy[tr.policy].append(s)
        run_log.append(
            {
                **tr.record(i, s),
                "replay_error_pct": p["error_pct"],
                "replay_vs_live_loop_error_pct": 100.0
                * abs(p["predicted_tokens_per_s"] - s["loop_tokens_per_s"])
                / s["loop_tokens_per_s"],
                "decisions_match": p["decisions_match"],
            }
        )
    return timed, per_policy, run_log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--draft-width", type=int, default=3)
    ap.add_argument("--request-buckets", default="1,2,4,8")
    ap.add_argument("--graph-mode", default="eager", help="EngineConfig.graph_mode (both engines)")
    ap.add_argument("--attention-backend", default="torch", help="torch or triton (both engines)")
    ap.add_argument("--table", default=None, help="load this draft_step table (skip calibration)")
    ap.add_argument("--table-out", default=None, help="write the calibrated table here")
    ap.add_argument("--prefill-tokens", type=int, default=256, help="calibration context")
    ap.add_argument("--max-kv-length", type=int, default=1024, help="calibration context")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--window-steps", type=int, default=16)
    ap.add_argument("--windows-per-point", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--profile", default="0.9,0.9,0.9", help="phase 0 acceptance profile")
    ap.add_argument(
        "--phase",
        action="append",
        default=None,
        help="FRACTION:p1,..,pw (repeatable); default 0.5:0.2,0.2,0.2",
    )
    ap.add_argument("--window-size", type=int, default=20)
    ap.add_argument("--update-interval", type=int, default=5)
    ap.add_argument("--switch-min-gain", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy, interleaved")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--json-out", default=None, help="write the full result JSON here")
    ap.add_argument("--device-label", default=None)
    ap.add_argument("--record", action="store_true", help="append to bench/results.jsonl")
    ap.add_argument("--pipeline", action="store_true",
                    help="live engine with EngineConfig.pipeline=True (pipelined rounds)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: got {args.repeats}, expected an integer >= 1")

    import numpy as np
    import torch
    from rich.console import Console

    from speccal.calibrate.pipeline import CalibrateOptions, calibrate
    from speccal.kernels.config import KernelConfig
    from speccal.live.policies import Phase, live_cost_model, median_summary, replay_prediction
    from speccal.policy import AdaptiveStepConfig, AdaptiveStepPolicy, CostModel
    from speccal.runner.engine import Engine, EngineConfig
    from speccal.runner.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    t_start = time.perf_counter()
    w = args.draft_width
    buckets = tuple(int(b) for b in args.request_buckets.split(","))
    step_cfg = AdaptiveStepConfig(args.window_size, args.update_interval, args.switch_min_gain)
    calib_cfg = {
        "version": 1,
        "policy": {
            "window_size": args.window_size,
            "update_interval": args.update_interval,
            "switch_min_gain": args.switch_min_gain,
        },
        "calibration": {
            "model": "additive",
            "request_buckets": list(buckets),
            "contexts": [
                {
                    "prefill_tokens": args.prefill_tokens,
                    "min_kv_length": 1,
                    "max_kv_length": args.max_kv_length,
                }
            ],
            "warmup_steps": args.warmup_steps,
            "window_steps": args.window_steps,
            "windows_per_point": args.windows_per_point,
        },
    }
    common = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "draft_width": w,
        "request_buckets": buckets,
        "seed": args.seed,
        "graph_mode": args.graph_mode,
        "attention_backend": args.attention_backend,
    }

    # 1. table
    calib_summary = None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.table:
            table_path = Path(args.table)
        else:
            table_path = Path(args.table_out or Path(tmp) / "table.json")
            cfg_path = Path(tmp) / "calibration.json"
            cfg_path.write_text(json.dumps(calib_cfg))
            opts = CalibrateOptions(
                model=args.model,
                device=args.device,
                dtype=args.dtype,
                draft_width=w,
                request_buckets=buckets,
                config_path=cfg_path,
                out=table_path,
                journal=Path(tmp) / "journal.jsonl",
                seed=args.seed,
                loop="pipelined" if args.pipeline else "synchronous",
            )

            def factory(o: CalibrateOptions) -> Engine:  # the live engine's round loop
                return Engine(EngineConfig.flat(kernels=KernelConfig.from_env(), **common,
                                                acceptance="forced", pipeline=args.pipeline))

            calib_summary = calibrate(opts, console=console, engine_factory=factory)
            gc.collect()  # the calibration engine (and its graphs) before the live one
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        calibrate_s = time.perf_counter() - t0

        # 2. live engine + table checked against it
        engine = build_live_engine(common, floats(args.profile), args.pipeline)
        table, table_warnings, table_doc = load_checked_table(table_path, engine)
    cost = live_cost_model(table)  # the policies' lookups, cached (same values)
    replay_cost = CostModel.from_table(table)  # the replay's own, uncached
    if cost.mode != "draft_step":
        raise SystemExit(f"{table_path}: adaptive-step needs a draft_step table, got {cost.mode}")

    # 3. workload and live runs
    phases = [Phase(0.0, floats(args.profile))]
    for text in args.phase or ["0.5:0.2,0.2,0.2"]:
        frac, _, prof = text.partition(":")
        phases.append(Phase(float(frac), floats(prof)))
    rng = np.random.default_rng(args.seed)
    vocab = engine.loaded.config.vocab_size
    lengths = rng.integers(args.prompt_min, args.prompt_max + 1, args.num_requests)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in lengths]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    meta = {
        "num_requests": args.num_requests,
        "prompt_len": [args.prompt_min, args.prompt_max],
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }
    t0 = time.perf_counter()
    warmup_s = warm_up(engine, cost, prompts)  # every shape once before timing
    names = [f"fixed:{k}" for k in range(1, w + 1)] + ["adaptive-step"]

    def announce(i, total, spec):
        console.print(f"live {spec} ({i + 1}/{total}) ...")

    timed, per_policy, run_log = run_and_replay(
        engine, names, cost, replay_cost, prompts, params, step_cfg=step_cfg, phases=phases,
        repeats=args.repeats, meta=meta, on_run=announce,
    )
    live_s = time.perf_counter() - t0
    for tr in timed:
        s = tr.run.summary()
        console.print(
            f"  {tr.policy}: {s['round_tokens_per_s']:.1f} tok/s, {s['rounds']} rounds, mean k "
            f"{s['mean_k']:.2f}, acceptance {s['acceptance_rate']:.3f}, mean round "
            f"{s['mean_round_ms']:.2f} ms"
        )

    # 4. (in run_and_replay) replay of every run on its own trace (fresh twin, uncached table)
    summaries = {n: median_summary(per_policy[n]) for n in names}
    ad = next(tr.run for tr in timed if tr.policy == "adaptive-step")  # the first adaptive run
    pred = replay_prediction(ad, replay_cost, AdaptiveStepPolicy(replay_cost, step_cfg))
    ad_sum = summaries["adaptive-step"]
    fixed = {n: s for n, s in summaries.items() if n.startswith("fixed:")}
    best = max(fixed, key=lambda n: fixed[n]["round_tokens_per_s"])
    gain = 100.0 * (ad_sum["round_tokens_per_s"] / fixed[best]["round_tokens_per_s"] - 1.0)
    # Per-round detail of the prediction: where the error comes from.
    live_ms = ad.round_ms
    pred_ms = pred["predicted_round_ms"]
    by_shape = {}
    bcap = cost.bcap(ad.num_requests)
    for key in sorted(set(zip(bcap.tolist(), ad.k.tolist(), strict=True))):
        sel = (bcap == key[0]) & (ad.k == key[1])
        by_shape[f"bcap{key[0]}_k{key[1]}"] = {
            "rounds": int(sel.sum()),
            "live_ms_median": float(np.median(live_ms[sel])),
            "live_ms_mean": float(np.mean(live_ms[sel])),
            "table_ms": float(np.mean(pred_ms[sel])),
        }
    # Fixed runs priced by the table as well (replay of each fixed run on its own trace).
    fixed_pred = {n: summaries[n]["replay"]["error_pct"] for n in fixed}
    loop_err = [x["replay_vs_live_loop_error_pct"] for x in run_log if x["policy"] == ad.policy]
    result = {
        "replay_vs_live_error_pct": ad_sum["replay"]["error_pct"],
        "adaptive_step_gain_vs_best_fixed_pct": gain,
        "decisions_match": ad_sum["replay"]["decisions_match"],
        "best_fixed": best,
        "live_round_tokens_per_s": {n: s["round_tokens_per_s"] for n, s in summaries.items()},
        "predicted_adaptive_tokens_per_s": ad_sum["replay"]["predicted_tokens_per_s"],
        "replay_vs_live_loop_error_pct": float(np.median(loop_err)),
        "fixed_replay_vs_live_error_pct": fixed_pred,
        "adaptive_timeline": ad_sum["timeline"],
        "adaptive_by_shape": by_shape,
        "summaries": {
            n: {k: v for k, v in s.items() if k not in ("timeline", "replay", "repeats", "spread")}
            for n, s in summaries.items()
        },
        "table_warnings": table_warnings,
        "table_path": str(args.table_out or args.table or ""),
        "table_calibration": table_doc.get("calibration"),
        "compatibility": engine.compatibility(),
        "engine": engine.description,
        "setup": {
            **meta,
            "profile": floats(args.profile),
            "phases": [p.name for p in phases],
            "policy": {
                "window_size": args.window_size,
                "update_interval": args.update_interval,
                "switch_min_gain": args.switch_min_gain,
            },
            "calibration_config": None if args.table else calib_cfg,
            "graph_mode": args.graph_mode,
            "attention_backend": args.attention_backend,
            "pipeline": args.pipeline,
        },
        "timings_s": {
            "calibrate": calibrate_s,
            "live_warmup": warmup_s,
            "live_runs": live_s,
            "total": time.perf_counter() - t_start,
        },
        "calibration_timings": None if calib_summary is None else calib_summary["timings"],
        "command": "python3 bench/bench_live_policy.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }
    if args.repeats > 1:
        result["repeats"] = args.repeats
        result["order"] = {
            "scheme": "round-robin over the policies, each cycle rotated left by its index",
            "sequence": [tr.policy for tr in timed],
        }
        result["run_log"] = run_log
        result["spread"] = {n: s["spread"] for n, s in summaries.items()}
    text = json.dumps(result, indent=1, sort_keys=True, default=float)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)
    if args.record:
        label = args.device_label or (
            f"cpu ({os.cpu_count()} cores)"
            if args.device == "cpu"
            else engine.compatibility()["device"]["name"]
        )
        append_results(
            {
                "metric": metric,
                "value": round(float(result[metric]), 3),
                "unit": "%",
                "device": label,
                "commit": result["commit"],
                "date": result["date"][:10],
                "command": result["command"],
                "model": args.model,
                "decisions_match": result["decisions_match"],
                "best_fixed": best,
                **({"repeats": args.repeats} if args.repeats > 1 else {}),
            }
            for metric in ("replay_vs_live_error_pct", "adaptive_step_gain_vs_best_fixed_pct")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
