"""Library entry points of ``speccal bench``: timed live runs of the embedded runner.

This module owns :func:`bench` (speculative vs plain decoding of the same random prompts in one
process, or on every rank of a ``torchrun`` run with ``comm``: :func:`timed_run_ranks`;
tokens/s, TPOT, acceptance, speed-up), :func:`bench_policies` (the same workload under
each policy object on one engine, through ``speccal.live.policies``, each policy ``repeats`` times
in an interleaved, rotated order with per-policy medians and the replay prediction of every run)
and :func:`run_policy_bench` (``speccal bench --policy``: a validated :class:`PolicyBenchConfig`
-> engine, cost table, :func:`bench_policies`, trace files, one JSON-ready document). The CLI and
notebooks call these. Timing edges are device-synchronised; prefill is timed apart from decoding.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from speccal.base.errors import InputError
from speccal.base.gcpause import paused_gc
from speccal.costmodel.coverage import warn_coverage
from speccal.costmodel.table import load_table
from speccal.live.policies import (
    Phase,
    interleaved_order,
    live_cost_model,
    median_summary,
    replay_prediction,
    run_interleaved,
    run_live,
)
from speccal.policy import CostModel, check_adaptive_modes, make_policy, parse_policy
from speccal.runner.distributed.dp import DataParallelRunner
from speccal.runner.distributed.engine import DistributedEngine
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams
from speccal.runner.stats import SpecStats
from speccal.trace import save_trace

#: Acceptance modes a bench may run: its requests are greedy, so ``sample`` has nothing to do.
BENCH_ACCEPTANCE = ("greedy", "synthetic", "forced")


#: The most requests one bench decodes: 8x the largest default request bucket (32). Requests
#: past the largest bucket queue, so the run time grows linearly and with no new information (100000
#: requests ran for many minutes); a larger workload is a serving benchmark, not this one.
MAX_NUM_REQUESTS = 256


def check_workload(num_requests: int, prompt_len: int, max_tokens: int) -> None:
    """Refuse a bench workload whose sizes are not each an integer >= 1, or with more than
    :data:`MAX_NUM_REQUESTS` requests."""
    for name, value in (
        ("--num-requests", num_requests),
        ("--prompt-len", prompt_len),
        ("--max-tokens", max_tokens),
    ):
        if value < 1:
            raise InputError(name, value, "an integer >= 1")
    if num_requests > MAX_NUM_REQUESTS:
        raise InputError(
            "--num-requests",
            num_requests,
            f"an integer in [1, {MAX_NUM_REQUESTS}] (requests past the largest bucket only queue)",
        )


def _check_acceptance(acceptance: str) -> None:
    if acceptance not in BENCH_ACCEPTANCE:
        expected = f"one of {', '.join(BENCH_ACCEPTANCE)} (bench requests are greedy)"
        raise InputError("--acceptance", acceptance, expected)


@dataclasses.dataclass
class RunTiming:
    """One timed generation: output tokens, prefill and decode wall time, derived rates."""

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
    outs, prefill_s, decode_s = _replica_run(engine, rids, k, None)
    return _run_timing(outs, prefill_s, decode_s), outs


def _run_timing(outs: list[list[int]], prefill_s: float, decode_s: float) -> RunTiming:
    """A run's :class:`RunTiming` from its outputs and its prefill and decode spans."""
    total = sum(len(o) for o in outs)
    per_req_decode = np.mean([max(len(o) - 1, 1) for o in outs])
    return RunTiming(
        tokens=total,
        prefill_s=prefill_s,
        decode_s=decode_s,
        tokens_per_s=total / max(prefill_s + decode_s, 1e-12),
        decode_tokens_per_s=(total - len(outs)) / max(decode_s, 1e-12),
        tpot_ms=1000.0 * decode_s / per_req_decode,
    )


def _replica_run(engine: Engine, rids: Sequence[int], k: int, comm: Any | None
                 ) -> tuple[list[list[int]], float, float]:
    """A timed run over the added requests ``rids`` (on ``comm``'s ranks: this rank's part; DP
    replicas run in step, ``DataParallelRunner``: one agreed round per step, so ``k`` is the
    agreed one there). Returns the outputs and the prefill and decode spans."""
    engine.synchronize()
    with paused_gc():  # no 60-150 ms full collection inside the timed run
        t0 = time.perf_counter()
        engine.prefill_pending()
        engine.synchronize()
        t1 = time.perf_counter()
        if comm is not None and comm.dp_size > 1:
            runner = DataParallelRunner(engine, comm)
            while runner.step()[1]:
                pass
            engine.drain()
        else:
            plan = RoundPlan(k)
            while engine.has_unfinished():
                engine.step(plan)
        engine.synchronize()
        t2 = time.perf_counter()
    outs = [list(engine.requests[r].output) for r in rids]
    for r in rids:
        engine.release(r)
    return outs, t1 - t0, t2 - t1


def timed_run_ranks(
    engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, k: int, comm: Any,
    phase: str = "bench: timed run",
) -> tuple[RunTiming, list[list[int]]]:
    """:func:`timed_run` on every rank of ``comm`` (collective: every rank calls, the same
    ``prompts``): replica ``d`` runs prompts ``d, d + D, ...``.

    The requests are added behind an error barrier (``Comm.agree``: a refusal on any rank is
    raised on every rank naming it, and the ranks start the clock together); a rank failing
    inside the run, where its peers may be blocked in a collective with it, leaves the group
    after ``Topology.failure_grace_s`` and they report it (``Comm.agree``). The timing
    is the whole run's: every replica's tokens over the slowest rank's prefill and decode spans
    (a TP step and a DP round last as long as their slowest rank). Returns every prompt's
    tokens, in order, on every rank.
    """
    mine = list(prompts)[comm.dp_rank :: comm.dp_size]
    rids = comm.agree(f"{phase}: add the requests",
                      lambda: [engine.add_request(p, params) for p in mine])
    local = comm.agree(phase, lambda: _replica_run(engine, rids, k, comm))
    seen = comm.all_gather_object(local)  # world-rank order; the TP ranks of a replica agree
    outs: list[list[int]] = [[] for _ in prompts]
    for d in range(comm.dp_size):
        for j, tokens in enumerate(seen[d * comm.tp_size][0]):
            outs[d + j * comm.dp_size] = tokens
    prefill_s = max(p for _, p, _ in seen)
    decode_s = max(d for *_, d in seen)
    return _run_timing(outs, prefill_s, decode_s), outs


def pooled_stats(engine: Engine, comm: Any) -> SpecStats:
    """Every DP replica's speculative statistics summed (collective; the TP ranks of a replica
    hold the same ones, so each replica counts once)."""
    seen = comm.all_gather_object(engine.stats)
    out = SpecStats(engine.config.draft_width)
    for d in range(comm.dp_size):
        s = seen[d * comm.tp_size]
        out.num_rounds += s.num_rounds
        out.num_drafted += s.num_drafted
        out.num_accepted += s.num_accepted
        out.num_emitted += s.num_emitted
        out.drafted_at += s.drafted_at
        out.accepted_at += s.accepted_at
        out.hist += s.hist
    return out


def workload_prompts(
    vocab_size: int, num_requests: int, prompt_len: int, seed: int
) -> list[list[int]]:
    """Random prompts of ``prompt_len`` tokens (deterministic in ``seed``; same for every run)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, prompt_len).tolist() for _ in range(num_requests)]


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
    comm: Any = None,
) -> dict:
    """Speculative (``config``) vs plain decoding of the same random prompts, one process.

    Each side runs one warm-up generation, then ``repeats`` timed ones; the medians are
    reported. Greedy requests ignore EOS so both sides generate ``max_tokens`` tokens. The
    arguments are checked before any engine is built.

    With ``comm`` (a ``speccal.runner.distributed.comm.Comm``, under ``torchrun``) every rank
    calls this: each builds its ``DistributedEngine``, DP replica ``d`` decodes prompts ``d, d +
    D, ...`` (with ``D > 1`` the replicas agree on every round, so ``num_draft_steps`` is the
    agreed ``k``), the timing of each run is the whole world's (:func:`timed_run_ranks`), the
    acceptance statistics are pooled over the replicas and ``setup.topology`` records the run
    (``tp``, ``dp``, ``world_size``, every rank's device). Every rank returns the same result.
    """
    _check_acceptance(config.acceptance)
    check_workload(num_requests, prompt_len, max_tokens)
    if not 1 <= num_draft_steps <= config.draft_width:
        raise InputError(
            "--k", num_draft_steps, f"an integer in [1, {config.draft_width}] (--draft-width)"
        )
    if repeats < 1:
        raise InputError("--repeats", repeats, "an integer >= 1")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    results: dict[str, Any] = {}
    outputs = {}
    plain = dataclasses.replace(
        config, speculative=False, acceptance="greedy", acceptance_profile=None
    )
    def run(engine, prompts, params, k, what):
        if comm is None:
            return timed_run(engine, prompts, params, k)
        return timed_run_ranks(engine, prompts, params, k, comm, phase=f"bench: {what}")

    topology = None
    for name, cfg, k in (("plain", plain, 0), ("spec", config, num_draft_steps)):
        if comm is None:
            engine = Engine(cfg)
        else:
            engine = comm.agree(f"bench: build the {name} runner",
                                lambda cfg=cfg: DistributedEngine(cfg, comm))
        prompts = workload_prompts(engine.loaded.config.vocab_size, num_requests, prompt_len, seed)
        run(engine, prompts, dataclasses.replace(params, max_tokens=min(4, max_tokens)), k,
            f"{name} warm-up")
        engine.stats = type(engine.stats)(engine.config.draft_width)
        runs = []
        for i in range(repeats):
            if on_progress:
                on_progress(f"{name} run {i + 1}/{repeats}")
            timing, outs = run(engine, prompts, params, k, f"{name} run {i + 1}")
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
            stats = engine.stats if comm is None else pooled_stats(engine, comm)
            results[name].update(stats.to_dict())
        results.setdefault("engine", {})[name] = _engine_doc(engine)
        if comm is not None:
            topology = dict(engine.compatibility()["topology"])
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
    if topology is not None:
        results["setup"]["topology"] = topology
    return results


def _engine_doc(engine: Engine) -> dict[str, Any]:
    """What a bench result records of the engine it ran on."""
    return {
        "description": engine.description,
        "is_random_weights": engine.is_random_weights,
        "compatibility": engine.compatibility(),
    }


def bench_policies(
    engine: Engine,
    policies: Sequence[str],
    cost: CostModel,
    *,
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    phases: Sequence[Phase] = (),
    seed: int = 0,
    repeats: int = 1,
    warmup_tokens: int = 8,
    on_progress: Callable[[str], None] | None = None,
) -> dict:
    """Live runs of the same workload under each policy, one engine, one process.

    ``policies`` are policy specs (``fixed:K``, ``adaptive-step``, ``adaptive-verify``); every run
    builds a fresh object on ``cost``. A short warm-up run at every ``k`` precedes the timed runs.
    Each policy runs ``repeats`` times, interleaved (``speccal.live.policies.interleaved_order``),
    run ``c`` of every policy on the engine's generator seeded ``seed + c`` (common random
    numbers: policies that decide alike accept alike, so the gains compare decisions).
    Returns ``{"policies": [summary...], "runs": [TimedRun...], "best_fixed", "setup"}``: one
    summary per policy (``median_summary`` of its runs), each with ``gain_vs_best_fixed_pct``
    (median ``round_tokens_per_s``) and, when the cost model prices the run, its ``replay``
    prediction (a fresh twin replayed on each run's own trace). With ``repeats > 1`` the result
    also holds ``repeats``, ``order`` (the scheme and the policy sequence) and ``run_log`` (per
    run: cycle, position, UTC start/end, tokens/s, replay error).
    """
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
        seed=seed,  # common random numbers: run c of every policy draws acceptance alike
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


@dataclasses.dataclass(frozen=True)
class PolicyBenchConfig:
    """What ``speccal bench --policy`` runs; validated on construction, before any engine exists.

    Attributes
    ----------
    engine : the engine to build (speculative; ``acceptance`` greedy, synthetic or forced).
    policies : policy specs, each at most once (``fixed:K``, ``adaptive-step``,
        ``adaptive-verify``; the two adaptive modes together are refused). Stored normalised.
    cost_table : the cost table (loaded against the engine's compatibility); adaptive policies
        need one. Without it the cost model prices nothing (fixed policies only, no replay).
    phases : synthetic acceptance profiles by emitted-token fraction (``acceptance="synthetic"``
        only, ``draft_width`` probabilities each); without a phase at 0 the engine's own
        ``acceptance_profile`` holds until the first one.
    num_requests, prompt_len, max_tokens, seed : the workload (random prompts).
    repeats : runs per policy, interleaved (``speccal.live.policies.interleaved_order``).
    trace_out : write each run's round trace here (several policies add ``.<policy>``, repeats
        ``.r<cycle>``, before the suffix).
    """

    engine: EngineConfig
    policies: tuple[str, ...]
    cost_table: Path | None = None
    phases: tuple[Phase, ...] = ()
    num_requests: int = 4
    prompt_len: int = 32
    max_tokens: int = 64
    seed: int = 0
    repeats: int = 1
    trace_out: Path | None = None

    def __post_init__(self) -> None:
        specs = tuple(parse_policy(p).text for p in self.policies)
        if not specs:
            expected = "at least one of fixed:K, adaptive-step, adaptive-verify"
            raise InputError("--policy", list(self.policies), expected)
        check_adaptive_modes(
            adaptive_draft_step="adaptive-step" in specs,
            adaptive_target_verify="adaptive-verify" in specs,
        )
        if len(set(specs)) != len(specs):
            raise InputError("--policy", ",".join(specs), "each policy at most once")
        object.__setattr__(self, "policies", specs)
        interleaved_order(specs, self.repeats)  # refuses a bad repeats
        if any(s.startswith("adaptive") for s in specs) and self.cost_table is None:
            raise InputError(
                "--cost-table", None, "a cost table path (adaptive policies price rounds with it)"
            )
        if self.cost_table is not None and not Path(self.cost_table).is_file():
            raise InputError("--cost-table", str(self.cost_table), "an existing cost table file")
        _check_acceptance(self.engine.acceptance)
        check_workload(self.num_requests, self.prompt_len, self.max_tokens)
        phases = tuple(self.phases)
        if phases and self.engine.acceptance != "synthetic":
            raise InputError("--phase", phases[0].name, "only with --acceptance synthetic")
        w = self.engine.draft_width
        for p in phases:
            if len(p.profile) != w or not all(0.0 <= x <= 1.0 for x in p.profile):
                raise InputError("--phase", p.name, f"{w} probabilities in [0, 1] after the ':'")
        if phases and min(p.start_fraction for p in phases) != 0.0:
            phases = (Phase(0.0, tuple(self.engine.acceptance_profile or ())), *phases)
        object.__setattr__(self, "phases", phases)


def _trace_path(policy: str, cycle: int, config: PolicyBenchConfig) -> tuple[str, Path]:
    """``(run key, path)`` of a run's trace: key ``policy`` (``policy#cycle`` with repeats); the
    path adds ``.<policy>`` with several policies and ``.r<cycle>`` with repeats."""
    tag = policy.replace(":", "") if len(config.policies) > 1 else ""
    if config.repeats > 1:
        tag = f"{tag}.r{cycle + 1}" if tag else f"r{cycle + 1}"
    key = policy if config.repeats == 1 else f"{policy}#{cycle + 1}"
    base = Path(config.trace_out)
    return key, base.with_name(f"{base.stem}.{tag}{base.suffix}") if tag else base


def trace_outputs(config: PolicyBenchConfig) -> list[Path]:
    """``trace_out`` and the path of every run's trace, each once (one policy run once writes
    ``trace_out`` itself); none without ``trace_out``. What a caller checks before the runs."""
    if config.trace_out is None:
        return []
    paths = [config.trace_out, *(_trace_path(p, c, config)[1]
                                 for p in config.policies for c in range(config.repeats))]
    return list(dict.fromkeys(Path(x) for x in paths))


def coverage(summary: dict[str, Any]) -> str:
    """``priced/rounds`` of a policy's live run (a median over repeats); ``-`` without one."""
    priced, rounds = summary.get("rounds_priced"), summary.get("rounds")
    if priced is None or not rounds:
        return "-"
    return f"{priced:.0f}/{rounds:.0f}"


def _unpriced(bcap: np.ndarray, g: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """The cost of a bench without a table: NaN everywhere (fixed policies run, nothing priced)."""
    return np.full(np.broadcast(bcap, g, kv).shape, np.nan)


def run_policy_bench(
    config: PolicyBenchConfig, on_progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """``speccal bench --policy``: build the engine, load the table, run :func:`bench_policies`.

    Returns the :func:`bench_policies` result (``runs`` holds the :class:`TimedRun` objects; drop
    it for JSON) with ``cost_table``, ``table_mode``, ``table_warnings`` (the messages of the
    performance-only mismatches the load warned about), ``traces`` (run key -> written path),
    ``engine`` (description, random weights, compatibility) and the engine setup in ``setup``.
    Numbers may be NaN where a run has none.
    """
    if on_progress:
        on_progress("loading")
    engine = Engine(config.engine)
    table_warnings: list[str] = []
    if config.cost_table is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            table = load_table(
                config.cost_table,
                expect=engine.compatibility(),
                runtime_versions=engine.runtime_versions(),
            )
            warn_coverage(table, engine.geometry, source=str(config.cost_table))
        table_warnings = [str(w.message) for w in caught]
        cost = live_cost_model(table)
    else:
        cost = CostModel(cost=_unpriced, geometry=engine.geometry, mode="draft_step")
    w = config.engine.draft_width
    if cost.draft_width != w:
        raise InputError("--cost-table", str(config.cost_table), f"a table of draft_width={w}")
    res = bench_policies(
        engine,
        config.policies,
        cost,
        num_requests=config.num_requests,
        prompt_len=config.prompt_len,
        max_tokens=config.max_tokens,
        phases=config.phases,
        seed=config.seed,
        repeats=config.repeats,
        on_progress=on_progress,
    )
    written = {}
    if config.trace_out is not None:
        for tr in res["runs"]:
            key, path = _trace_path(tr.policy, tr.cycle, config)
            written[key] = str(save_trace(tr.run.trace, path))
    return {
        **res,
        "cost_table": None if config.cost_table is None else str(config.cost_table),
        "table_mode": cost.mode,
        "table_spread_priced": cost.spread is not None,  # rounds' KV spread priced
        "table_warnings": table_warnings,
        "traces": written,
        "engine": _engine_doc(engine),
        "setup": {
            **res["setup"],
            "model": config.engine.model,
            "device": config.engine.device,
            "dtype": engine.dtype_name,
            "draft_width": w,
            "acceptance": config.engine.acceptance,
            "acceptance_profile": (None if config.engine.acceptance_profile is None
                                   else list(config.engine.acceptance_profile)),
            "score_informativeness": config.engine.score_informativeness,
            "request_buckets": list(config.engine.request_buckets),
        },
    }
