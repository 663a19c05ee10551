"""Library entry points of ``speccal generate`` and ``speccal bench``.

This module owns :func:`generate` (run requests to completion on an engine) and :func:`bench`
(speculative vs plain decoding of the same prompts in one process, with timing and acceptance
statistics). Timing edges are device-synchronised; prefill is timed apart from decoding.
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
