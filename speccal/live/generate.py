"""Library entry points of ``speccal generate`` and ``speccal bench``.

This module owns :func:`generate` (run requests to completion on an engine), :func:`bench`
(speculative vs plain decoding of the same prompts in one process, with timing and acceptance
statistics) and :func:`bench_policies` (``speccal bench --policy``: the same workload under each
policy object through ``speccal.live.policies``, each policy ``repeats`` times in an interleaved,
rotated order with per-policy medians). Timing edges are device-synchronised; prefill is
timed apart from decoding.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    num_draft_steps: int,
    on_step: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Run ``prompts`` to completion; returns each request's generated token ids.

    ``on_step(num_new_tokens)`` is called after every round (progress bars).
    """
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
    plan = RoundPlan(num_draft_steps)
    while engine.has_unfinished():
        res = engine.step(plan)
        if on_step is not None:
            on_step(sum(len(e) for e in res.emitted))
    out = [list(engine.requests[r].output) for r in rids]
    for r in rids:
        engine.release(r)
    return out


@dataclasses.dataclass
class RunTiming:
    tokens: int
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    decode_tokens_per_s: float
    tpot_ms: float


def timed_run(
    engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, k: int
) -> tuple[RunTiming, list[list[int]]]:
    """One timed generation: prefill (synced), then rounds until every request finishes."""
    rids = [engine.add_request(p, params) for p in prompts]
    engine.synchronize()
    t0 = time.perf_counter()
    engine.prefill_pending()
    engine.synchronize()
    t1 = time.perf_counter()
    plan = RoundPlan(k)
    while engine.has_unfinished():
        engine.step(plan)
    engine.synchronize()
    t2 = time.perf_counter()
    outs = [list(engine.requests[r].output) for r in rids]
    for r in rids:
        engine.release(r)
    total = sum(len(o) for o in outs)
    per_req_decode = np.mean([max(len(o) - 1, 1) for o in outs])
    timing = RunTiming(
        tokens=total,
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        tokens_per_s=total / (t2 - t0),
        decode_tokens_per_s=(total - len(outs)) / max(t2 - t1, 1e-12),
        tpot_ms=1000.0 * (t2 - t1) / per_req_decode,
    )
    return timing, outs


def bench(
    config: EngineConfig,
    *,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    num_draft_steps: int,
    repeats: int = 3,
    seed: int = 0,
    on_progress: Callable[[str], None] | None = None,
) -> dict:
    """Speculative (``config``) vs plain decoding of the same random prompts, one process.

    Each side runs one warm-up generation, then ``repeats`` timed ones; the medians are
    reported. Greedy requests ignore EOS so both sides generate ``max_tokens`` tokens.
    """
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    results = {}
    outputs = {}
    for name, cfg, k in (
        (
            "plain",
            dataclasses.replace(
                config, speculative=False, acceptance="greedy", acceptance_profile=None
            ),
            0,
        ),
        ("spec", config, num_draft_steps),
    ):
        engine = Engine(cfg)
        vocab = engine.loaded.config.vocab_size
        prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(num_requests)]
        rng = np.random.default_rng(seed)  # same prompts on both sides
        timed_run(engine, prompts, dataclasses.replace(params, max_tokens=min(4, max_tokens)), k)
        engine.stats = type(engine.stats)(engine.config.draft_width)
        runs = []
        for i in range(repeats):
            if on_progress:
                on_progress(f"{name} run {i + 1}/{repeats}")
            timing, outs = timed_run(engine, prompts, params, k)
            runs.append(timing)
        outputs[name] = outs
        results[name] = {
            "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
            "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs),
            "tpot_ms": statistics.median(r.tpot_ms for r in runs),
            "prefill_s": statistics.median(r.prefill_s for r in runs),
            "runs_tokens_per_s": [r.tokens_per_s for r in runs],
            "tokens_per_run": runs[0].tokens,
        }
        if k > 0:
            results[name].update(engine.stats.to_dict())
        results.setdefault("engine", {})[name] = {
            "description": engine.description,
            "is_random_weights": engine.is_random_weights,
            "compatibility": engine.compatibility(),
        }
        del engine
    results["speedup"] = results["spec"]["tokens_per_s"] / results["plain"]["tokens_per_s"]
    results["tpot_speedup"] = results["plain"]["tpot_ms"] / results["spec"]["tpot_ms"]
    results["outputs_equal"] = outputs["plain"] == outputs["spec"]
    results["setup"] = {
        "model": config.model,
        "device": config.device,
        "dtype": config.dtype,
        "draft_width": config.draft_width,
        "num_draft_steps": num_draft_steps,
        "acceptance": config.acceptance,
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "repeats": repeats,
    }
    return results


def workload_prompts(
    vocab_size: int, num_requests: int, prompt_len: int, seed: int
) -> list[list[int]]:
    """Random prompts of ``prompt_len`` tokens (deterministic in ``seed``; same for every policy)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, prompt_len).tolist() for _ in range(num_requests)]


def bench_policies(
    engine: Engine,
    policies: Sequence[str],
    cost,
    *,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    phases: Sequence = (),
    seed: int = 0,
    repeats: int = 1,
    warmup_tokens: int = 8,
    on_progress: Callable[[str], None] | None = None,
) -> dict:
    """Live runs of the same workload under each policy, one engine, one process.

    ``policies`` are policy specs (``fixed:K``, ``adaptive-step``, ``adaptive-verify``); every run
    builds a fresh object on ``cost`` (a ``speccal.policy.CostModel``). A short warm-up run at
    every ``k`` precedes the timed runs. Each policy runs ``repeats`` times, interleaved
    (``speccal.live.policies.interleaved_order``). Returns ``{"policies": [summary...], "runs":
    [TimedRun...], "best_fixed", "setup"}``: one summary per policy (``median_summary`` of its
    runs), each with ``gain_vs_best_fixed_pct`` (median ``round_tokens_per_s``) and, when the cost
    model prices the run, its ``replay`` prediction (a fresh twin replayed on each run's own
    trace). With ``repeats > 1`` the result also holds ``repeats``, ``order`` (the scheme and the
    policy sequence) and ``run_log`` (per run: cycle, position, UTC start/end, tokens/s, replay
    error).
    """
    from speccal.live.policies import (
        interleaved_order,
        median_summary,
        replay_prediction,
        run_interleaved,
        run_live,
    )
    from speccal.policy import make_policy

    interleaved_order(policies, repeats)  # refuses a bad repeats before anything runs
    prompts = workload_prompts(engine.loaded.config.vocab_size, num_requests, prompt_len, seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    w = engine.config.draft_width
    if on_progress:
        on_progress("warm-up")
    warm = SamplingParams(max_tokens=min(warmup_tokens, max_tokens), ignore_eos=True)
    for k in range(1, w + 1):
        run_live(
            engine, make_policy(f"fixed:{k}", cost), "draft_step", prompts, warm, phases=phases
        )
    meta = {
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "seed": seed,
    }

    def progress(i: int, total: int, name: str) -> None:
        if on_progress:
            on_progress(f"live {name}" if repeats == 1 else f"live {name} ({i + 1}/{total})")

    factories = {name: (lambda name=name: make_policy(name, cost)) for name in policies}
    runs = run_interleaved(
        engine,
        factories,
        cost.mode,
        prompts,
        params,
        repeats=repeats,
        phases=phases,
        meta=meta,
        on_run=progress,
    )
    per_policy: dict[str, list[dict]] = {name: [] for name in policies}
    log = []
    for i, tr in enumerate(runs):
        s = tr.run.summary()
        pred = replay_prediction(tr.run, cost, make_policy(tr.policy, cost))
        s["replay"] = {k: v for k, v in pred.items() if not isinstance(v, np.ndarray)}
        per_policy[tr.policy].append(s)
        log.append(
            {
                **tr.record(i, s),
                "replay_error_pct": pred["error_pct"],
                "decisions_match": pred["decisions_match"],
            }
        )
    summaries = [median_summary(per_policy[name]) for name in policies]
    fixed = [s for s in summaries if s["policy"].startswith("fixed:")]
    best = max(fixed, key=lambda s: s["round_tokens_per_s"]) if fixed else None
    for s in summaries:
        s["gain_vs_best_fixed_pct"] = (
            100.0 * (s["round_tokens_per_s"] / best["round_tokens_per_s"] - 1.0) if best else None
        )
    out = {
        "policies": summaries,
        "runs": runs,
        "best_fixed": best["policy"] if best else None,
        "setup": {**meta, "phases": [p.name for p in phases], "mode": cost.mode},
    }
    if repeats > 1:
        out["repeats"] = repeats
        out["order"] = {
            "scheme": "round-robin over the policies, each cycle rotated left by its index",
            "sequence": [tr.policy for tr in runs],
        }
        out["run_log"] = log
    return out
