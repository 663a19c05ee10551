"""The live policy loop: a policy object (``speccal.policy``) plans every round of a workload.

This module owns :func:`run_live` (one workload under one policy on a warmed
:class:`~speccal.runner.engine.Engine`), :class:`Phase` (a synthetic acceptance profile that takes
over once a fraction of the workload's tokens has been emitted), :class:`LiveRun` (what one run
measured), :func:`replay_prediction` (the same policy replayed on the run's own trace) and
:func:`live_cost_model` (a table's :class:`~speccal.policy.CostModel` with scalar lookups memoised
by ``speccal.costmodel.lookup``, so planning a round costs microseconds; same values).

Per round: the engine admits and prefills waiting requests (``Engine.prefill_pending``, timed
apart, device-synchronised), then ``Engine.step`` calls the plan callback with the round's
``RoundState`` (index, batch size, mean KV length before the round); the callback asks
``policy.decide`` and turns the :class:`~speccal.policy.Decision` into a ``RoundPlan``
(``verify_tokens`` when the decision has them, ``verify_budget = g`` for a ``target_verify``
decision without them, else ``k`` drafts). Under ``verify_budget`` the engine drafts full width
and allocates each request's verified prefix on the device from the round's own draft scores;
``RoundResult.num_verify`` (collected with the round) is what ``verified`` records. After the round, ``policy.observe`` gets
``Feedback.from_round_result`` of the normal result collection (no extra device reads) and the
round goes into a :class:`~speccal.trace.RoundTrace` (the format ``speccal trace`` writes).

Requests may carry their own ``SamplingParams`` (:func:`request_params`; e.g. different
``max_tokens``): they finish at different rounds, so the batch shrinks mid-run, and the phases'
token fractions count the sum of the requests' ``max_tokens``.

Round wall time is ``perf_counter`` around ``Engine.step`` (its result collection is the round's
one device sync), so decode time excludes prefill.

Pipelined engines (``EngineConfig.pipeline``): ``Engine.step`` queues round ``n + 1`` (the plan
callback decides it) and returns round ``n``, so ``policy.observe`` gets round ``n``'s feedback
after ``decide`` planned round ``n + 1``: a decision for round ``r`` has seen rounds ``r - 2``
and earlier (draft step: the completed batches; target verify: its own ``n - 2`` queue now only
releases what actually arrived). Round ``n``'s steady-state cost is its *period*: the wall time
from the previous step's return to the return of the step that collects it (queue ``n + 1`` +
collect ``n``, and the host's feedback and trace bookkeeping in between, which overlaps the
device's next round: a step's own wall time left that device time out and made rounds look 4-7 %
cheaper than their calibrated cost on the H200); periods restart after a prefill, and a step that
collects nothing is not recorded. A synchronous run records each step's own wall time. A pipelined round
also runs the rows of requests whose stop is discovered one round late
(``RoundResult.num_discarded``): the loop records, and the policy observes, the rows the device
ran (``RoundResult.physical``), so the trace holds the batch each decision saw and
``round_tokens_per_s`` counts the tokens the device produced (the discarded ones included;
``tokens_per_s`` counts output tokens). :func:`replay_prediction` replays a pipelined run with
the same lag (``run_sequential(pipelined=True)``). Metrics follow ``speccal.replay``:
``round_tokens_per_s`` = sum over rounds of ``B + accepted`` over decode time (what a replay
predicts); ``tokens_per_s`` = output tokens over prefill + decode time; TPOT =
``sum(round_ms * B) / round tokens``; ``loop_tokens_per_s`` counts the whole loop's wall time
(policy feedback and trace bookkeeping between rounds too, prefill excluded); acceptance rate = accepted / verified drafts; mean accepted
length = accepted drafts per request-round.

Repeats (:func:`run_interleaved`, used by ``speccal bench --policy --repeats N`` and
``bench/bench_live_policy.py --repeats N``): every policy runs ``N`` times on the same workload in
the order of :func:`interleaved_order`: ``N`` round-robin cycles over the policies, cycle ``c``
rotated left by ``c`` (A B C, B C A, C A B, A B C, ...), so drift over the sequence (clocks, heat,
host state) does not always land on the same policy and no policy is always first or last (with
``N`` a multiple of the number of policies each holds every position equally often). Each run gets
a fresh policy object and records its cycle, position and UTC start/end times
(:class:`TimedRun`); :func:`median_summary` folds a policy's run summaries into one (numbers are
medians over the runs, with the min-max ``spread``). ``N = 1`` is the single run of each policy in
the given order, and its summary is the run's own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import numpy as np

from speccal.base.errors import InputError
from speccal.base.gcpause import paused_gc
from speccal.policy import BatchState, CostModel, Decision, Feedback, Policy
from speccal.replay import run_sequential
from speccal.runner.engine import Engine, RoundPlan, RoundState
from speccal.runner.sampling import SamplingParams
from speccal.trace import RoundTrace, RoundTraceBuilder


@dataclass(frozen=True)
class Phase:
    """A synthetic acceptance profile in force once ``start_fraction`` of the workload's tokens
    (``sum(max_tokens)``) have been emitted. Token-based, so every policy sees the same text."""

    start_fraction: float
    profile: tuple[float, ...]

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.start_fraction) < 1.0:
            raise InputError("phase start fraction", self.start_fraction, "a number in [0, 1)")

    @property
    def name(self) -> str:
        return f"from {self.start_fraction:g}: " + ",".join(f"{p:g}" for p in self.profile)


@dataclass(eq=False)
class LiveRun:
    """What one live run measured (arrays are per round)."""

    policy: str
    k: np.ndarray
    g: np.ndarray  # the decision's padded target rows
    g_run: np.ndarray  # target rows the engine ran
    num_requests: np.ndarray
    accepted: np.ndarray  # accepted drafts per round (sum over requests)
    verified: np.ndarray  # drafted tokens sent to the target per round
    round_ms: np.ndarray
    reasons: list[str]
    trace: RoundTrace
    prefill_s: float
    output_tokens: int
    phase: np.ndarray
    stats: dict[str, Any] = field(default_factory=dict)
    loop_s: float = math.nan  # wall time of the whole round loop minus prefill (bookkeeping too)
    pipelined: bool = False  # the engine ran pipelined rounds (feedback one round later)
    priced: np.ndarray | None = None  # [rounds] bool: the table prices the shape the round ran

    @property
    def round_tokens(self) -> np.ndarray:
        return self.num_requests + self.accepted

    @property
    def decode_s(self) -> float:
        return float(self.round_ms.sum()) / 1000.0

    def summary(self) -> dict[str, Any]:
        tok = float(self.round_tokens.sum())
        ms = float(self.round_ms.sum())
        ver = float(self.verified.sum())
        reqs = float(self.num_requests.sum())
        reasons: dict[str, int] = {}
        for r in self.reasons:
            reasons[r] = reasons.get(r, 0) + 1
        return {
            "policy": self.policy,
            "rounds": int(self.k.size),
            "round_tokens_per_s": 1000.0 * tok / ms if ms > 0 else math.nan,
            "tokens_per_s": self.output_tokens / (self.prefill_s + ms / 1000.0)
            if ms > 0
            else math.nan,
            "tpot_ms": float(np.sum(self.round_ms * self.num_requests)) / tok if tok else math.nan,
            "acceptance_rate": float(self.accepted.sum()) / ver if ver else math.nan,
            "mean_accepted_length": float(self.accepted.sum()) / reqs if reqs else math.nan,
            "mean_k": float(np.mean(self.k)) if self.k.size else math.nan,
            "mean_round_ms": ms / max(self.k.size, 1),
            "decode_s": ms / 1000.0,
            "loop_tokens_per_s": tok / self.loop_s if self.loop_s > 0 else math.nan,
            "loop_s": self.loop_s,
            "prefill_s": self.prefill_s,
            "output_tokens": self.output_tokens,
            "round_tokens": tok,
            "switches": int(np.count_nonzero(np.diff(self.k))),
            "reasons": reasons,
            "rounds_priced": None if self.priced is None else int(self.priced.sum()),
            "rounds_uncalibrated": (None if self.priced is None
                                    else int(self.priced.size - self.priced.sum())),
            # how far each round's longest request sat past the mean KV it is priced at
            "kv_spread": self.trace.kv_spread(),
            "timeline": self.timeline(),
        }

    def timeline(self, max_segments: int = 200) -> list[list[int]]:
        """Run-length segments ``[start, stop, k, g]`` of the decisions."""
        key = self.k.astype(np.int64) * (1 << 32) + self.g.astype(np.int64)
        if key.size == 0:
            return []
        starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
        stops = np.concatenate((starts[1:], [key.size]))
        return [
            [int(a), int(b), int(self.k[a]), int(self.g[a])]
            for a, b in zip(starts[:max_segments], stops[:max_segments], strict=True)
        ]


def _priced(policy: Any, bcap: Sequence[int], g: Sequence[int],
            kv_length: Sequence[float], k: Sequence[int]) -> np.ndarray:
    """``[rounds]`` bool: whether the policy's table prices the shape each round ran (its Bcap
    and target rows at the KV its plan saw); False is a round the table could not have chosen
    for ("uncalibrated", e.g. a batch past the table's request buckets). One vectorised lookup
    after the loop: nothing is added to a round's host work."""
    cost = getattr(policy, "cost", None)
    if cost is None or not len(bcap):
        return np.zeros(len(bcap), dtype=bool)
    return np.isfinite(cost.lookup(np.asarray(bcap), np.asarray(g),
                                   np.asarray(kv_length, dtype=np.float64), np.asarray(k)))


def live_cost_model(table: Any) -> CostModel:
    """``CostModel.from_table(table, memo=True)``: scalar lookups memoised (identical values)."""
    return CostModel.from_table(table, memo=True)


def to_plan(decision: Decision, mode: str) -> RoundPlan:
    """The ``RoundPlan`` of a policy decision (see the module docstring)."""
    if decision.verify_tokens is not None:
        return RoundPlan(int(decision.k), verify_tokens=[int(v) for v in decision.verify_tokens])
    if mode == "target_verify" and decision.g > 0:
        return RoundPlan(int(decision.k), verify_budget=int(decision.g))
    # g == 0: the table has no bucket holding this batch (the engine captured more than it
    # calibrated): the full-width admission fallback, every draft verified at the engine's bucket
    return RoundPlan(int(decision.k))


def request_params(
    params: SamplingParams | Sequence[SamplingParams] | Sequence[int], num_requests: int
) -> list[SamplingParams]:
    """One ``SamplingParams`` per request: ``params`` repeated, or the given per-request sequence
    (``SamplingParams`` each, or ``max_tokens`` integers: greedy requests that ignore EOS, so each
    emits exactly its own count). A sequence must have one entry per request."""
    if isinstance(params, SamplingParams):
        return [params] * num_requests
    items = list(params)
    if len(items) != num_requests:
        raise InputError("params", f"{len(items)} entries", f"one per request ({num_requests})")
    out = []
    for x in items:
        if isinstance(x, SamplingParams):
            out.append(x)
        elif isinstance(x, int | np.integer) and not isinstance(x, bool) and x >= 1:
            out.append(SamplingParams(max_tokens=int(x), ignore_eos=True))
        else:
            raise InputError("params", x, "SamplingParams or a max_tokens integer >= 1")
    return out


def run_live(
    engine: Engine,
    policy: Policy,
    mode: str,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | Sequence[int],
    *,
    phases: Sequence[Phase] = (),
    meta: dict[str, Any] | None = None,
) -> LiveRun:
    """Run ``prompts`` to completion with ``policy`` planning each round.

    Parameters
    ----------
    engine : a warmed engine with no unfinished requests (speculative).
    policy : a fresh policy object (``decide`` / ``observe``).
    mode : the cost table's mode (``draft_step`` / ``target_verify``): how decisions become plans.
    params : one ``SamplingParams`` for every request, or one per prompt (requests with
        different ``max_tokens`` finish at different rounds, so the batch shrinks mid-run; see
        :func:`request_params`).
    phases : synthetic acceptance profiles by emitted-token fraction (``acceptance="synthetic"``).
    meta : extra trace metadata (the run's setup); ``source``, ``compatibility``, ``policy`` and
        ``phases`` are filled in.
    """
    if engine.has_unfinished():
        raise InputError("engine", "unfinished requests", "an idle engine (no waiting/running)")
    if not engine.config.speculative:
        raise InputError("engine.speculative", False, "a speculative engine (policies plan k)")
    phases = sorted(phases, key=lambda p: p.start_fraction)
    if phases and phases[0].start_fraction != 0.0:
        raise InputError("phases", phases[0].name, "a first phase starting at fraction 0")
    w = engine.config.draft_width
    base = engine.round_index
    per_request = request_params(params, len(prompts))
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, per_request, strict=True)]
    total_target = sum(sp.max_tokens for sp in per_request)  # phase fractions count these
    builder = RoundTraceBuilder(w)
    rec: dict[str, list] = {
        f: [] for f in ("k", "g", "g_run", "b", "acc", "ver", "ms", "why", "bcap", "kv")
    }
    phase_of_round: list[int] = []
    current_phase = -1
    emitted = 0
    prefill_s = 0.0
    decisions: dict[int, Decision] = {}  # engine round index -> the decision that planned it
    plan_kv: dict[int, float] = {}  # engine round index -> the mean KV its plan saw
    pipelined = bool(engine.config.pipeline)

    def plan_fn(state: RoundState) -> RoundPlan:
        d = policy.decide(
            BatchState(
                round_index=state.round_index - base,
                num_requests=state.num_requests,
                kv_length=state.kv_length,
            )
        )
        decisions[state.round_index] = d
        plan_kv[state.round_index] = float(state.kv_length)
        return to_plan(d, mode)

    with paused_gc():  # no 60-150 ms full collection inside a timed round
        t_loop = time.perf_counter()
        t_prev = None  # pipelined: when the previous step returned (the next round's period starts)
        while engine.has_unfinished():
            want = 0
            for i, ph in enumerate(phases):
                if emitted >= ph.start_fraction * total_target:
                    want = i
            if phases and want != current_phase:
                engine.set_acceptance_profile(phases[want].profile)
                current_phase = want
            t0 = time.perf_counter()
            first = engine.prefill_pending()
            if first:
                engine.synchronize()
                prefill_s += time.perf_counter() - t0
                emitted += len(first)
                t_prev = None  # a round's period never includes a prefill
            t0 = time.perf_counter()
            res = engine.step(plan_fn)
            t1 = time.perf_counter()
            ms = 1000.0 * (t1 - (t0 if t_prev is None or not pipelined else t_prev))
            t_prev = t1
            emitted += sum(len(e) for e in res.emitted)
            d = decisions.pop(res.round_index, None)
            seen_kv = plan_kv.pop(res.round_index, None)
            res = res.physical()  # pipelined: the rows of the extra round too (what the device ran)
            if res.num_requests == 0:
                continue
            if d is None:
                raise RuntimeError("engine.step ran a round without calling the plan callback")
            r = res.round_index - base
            policy.observe(Feedback.from_round_result(res, r))
            builder.add(res.k, res.accepted, res.draft_scores, res.kv_lengths, seen_kv)
            rec["k"].append(res.k)
            rec["g"].append(d.g)
            rec["g_run"].append(res.g)
            rec["b"].append(res.num_requests)
            rec["acc"].append(int(res.accepted.sum()))
            rec["ver"].append(int(res.num_verify.sum()))
            rec["ms"].append(ms)
            rec["why"].append(d.reason)
            rec["bcap"].append(res.bcap)
            rec["kv"].append(float(np.mean(res.kv_lengths)) if seen_kv is None else seen_kv)
            phase_of_round.append(max(current_phase, 0))
    loop_s = time.perf_counter() - t_loop - prefill_s
    outputs = sum(len(engine.requests[r].output) for r in rids)
    for r in rids:
        engine.release(r)
    name = getattr(policy, "name", "policy")
    phase_arr = np.asarray(phase_of_round, dtype=np.int64)
    trace_meta = {
        **(meta or {}),
        "source": "runner",
        "compatibility": engine.compatibility(),
        "policy": name,
        "phases": [p.name for p in phases] or ["run"],
    }
    if pipelined:  # speccal.replay.replay then follows the pipeline's feedback lag
        trace_meta["pipelined"] = True
    trace = builder.build(trace_meta)
    if phase_arr.size:
        trace = replace(trace, phase=phase_arr)
    return LiveRun(
        policy=name,
        k=np.asarray(rec["k"], dtype=np.int64),
        g=np.asarray(rec["g"], dtype=np.int64),
        g_run=np.asarray(rec["g_run"], dtype=np.int64),
        num_requests=np.asarray(rec["b"], dtype=np.int64),
        accepted=np.asarray(rec["acc"], dtype=np.int64),
        verified=np.asarray(rec["ver"], dtype=np.int64),
        round_ms=np.asarray(rec["ms"], dtype=np.float64),
        reasons=rec["why"],
        priced=_priced(policy, rec["bcap"], rec["g_run"], rec["kv"], rec["k"]),
        trace=trace,
        prefill_s=prefill_s,
        output_tokens=int(outputs),
        phase=phase_arr,
        stats=engine.stats.to_dict(),
        loop_s=loop_s,
        pipelined=pipelined,
    )


def replay_prediction(run: LiveRun, cost: CostModel, policy: Policy) -> dict[str, Any]:
    """Replay a fresh ``policy`` on the run's own trace (``speccal.replay.run_sequential``).

    Returns the predicted metrics, whether every decision ``k`` / ``g`` matches the live run,
    whether the drafts sent to the target match per round (``verified_match``; under adaptive
    verify this checks the device allocation against the host rule on the recorded scores), and
    ``error_pct`` = ``|predicted - live| / live`` of ``round_tokens_per_s``.
    """
    pred = run_sequential(run.trace, cost, policy, pipelined=run.pipelined)
    totals = pred.totals() if pred.priced else {}
    live = run.summary()["round_tokens_per_s"]
    predicted = totals.get("tokens_per_s", math.nan)
    same_k = bool(np.array_equal(pred.k, run.k))
    same_g = bool(np.array_equal(pred.g, run.g))
    # Adaptive verify: the replay allocates with the host rule on the trace's (current-round)
    # scores; the live round allocated on the device from the same scores.
    same_verified = bool(np.array_equal(pred.verified, run.verified))
    return {
        "priced": pred.priced,
        "predicted_tokens_per_s": predicted,
        "live_round_tokens_per_s": live,
        "error_pct": 100.0 * abs(predicted - live) / live if live and pred.priced else math.nan,
        "predicted_tpot_ms": totals.get("tpot_ms", math.nan),
        "decisions_match": same_k and same_g,
        "k_match": same_k,
        "verified_match": same_verified,
        "predicted_round_ms": pred.cost_ms,
        "predicted_k": pred.k,
    }


def interleaved_order(names: Sequence[str], repeats: int) -> list[tuple[int, int, str]]:
    """The run order of ``repeats`` cycles over ``names``: ``(cycle, position, name)`` per run.

    Cycle ``c`` is ``names`` rotated left by ``c`` (round-robin, rotated each cycle; see the
    module docstring). ``repeats = 1`` is ``names`` in the given order.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InputError("--repeats", repeats, "an integer >= 1 (runs per policy)")
    names = list(names)
    n = len(names)
    out = []
    for c in range(repeats):
        for pos in range(n):
            out.append((c, pos, names[(c + pos) % n]))
    return out


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@dataclass(eq=False)
class TimedRun:
    """One run of an interleaved sequence: where it sat in the order and when it ran."""

    policy: str
    cycle: int  # 0-based repeat
    position: int  # 0-based place within its cycle
    started_at: str  # UTC, ISO 8601
    ended_at: str
    start_s: float  # perf_counter seconds since the first run of the sequence started
    end_s: float
    run: LiveRun

    def record(self, index: int, summary: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run's place, times and headline numbers (JSON-ready; no arrays); ``summary``:
        the run's ``LiveRun.summary()`` when the caller already has it."""
        s = self.run.summary() if summary is None else summary
        return {
            "index": index,
            "policy": self.policy,
            "cycle": self.cycle,
            "position": self.position,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "round_tokens_per_s": s["round_tokens_per_s"],
            "tokens_per_s": s["tokens_per_s"],
            "loop_tokens_per_s": s["loop_tokens_per_s"],
            "mean_round_ms": s["mean_round_ms"],
            "mean_k": s["mean_k"],
        }


def run_interleaved(
    engine: Engine,
    factories: Mapping[str, Callable[[], Policy]],
    mode: str,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | Sequence[int],
    *,
    repeats: int = 1,
    phases: Sequence[Phase] = (),
    meta: dict[str, Any] | None = None,
    on_run: Callable[[int, int, str], None] | None = None,
    seed: int | None = None,
) -> list[TimedRun]:
    """Run each policy ``repeats`` times in :func:`interleaved_order` (same ``prompts`` each time).

    Parameters
    ----------
    factories : policy name -> a callable building a fresh policy object (one per run), in the
        order of the first cycle.
    params : one ``SamplingParams`` for every request or one per prompt (:func:`request_params`).
    on_run : ``on_run(index, total, name)`` before each run (progress).
    seed : common random numbers: before run ``c`` of every policy (its cycle) the engine's
        generator is seeded with ``seed + c``, so the policies of a cycle draw their synthetic
        acceptance (and sampling) from the same stream: two policies that decide alike accept
        alike, and a comparison of policies is not a comparison of acceptance luck (at 60
        rounds a run, the luck alone moved tokens/s by 5-10 % between runs of one policy on
        the H100). None: the stream runs on from run to run.

    The engine's statistics are reset before every run, so ``LiveRun.stats`` is the run's own.
    """
    order = interleaved_order(list(factories), repeats)
    params = request_params(params, len(prompts))  # refuse a bad sequence before any run
    w = engine.config.draft_width
    out: list[TimedRun] = []
    t_first = time.perf_counter()
    for i, (cycle, pos, name) in enumerate(order):
        if on_run is not None:
            on_run(i, len(order), name)
        engine.stats = type(engine.stats)(w)
        if seed is not None:
            engine.generator.manual_seed(int(seed) + cycle)
        policy = factories[name]()
        started, t0 = _utc_now(), time.perf_counter()
        run = run_live(engine, policy, mode, prompts, params, phases=phases, meta=meta)
        t1, ended = time.perf_counter(), _utc_now()
        out.append(TimedRun(name, cycle, pos, started, ended, t0 - t_first, t1 - t_first, run))
    return out


SPREAD_KEYS = ("round_tokens_per_s", "tokens_per_s", "loop_tokens_per_s")


def _median(values: Sequence[Any]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


def median_summary(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy's run summaries (``LiveRun.summary()``, optionally with a ``replay`` dict) as one.

    A single summary comes back as it is. Otherwise every number is the median over the runs
    (in ``replay`` too; its flags are true only when true in every run), ``timeline`` and
    ``reasons`` are the first run's, and ``repeats`` and ``spread`` (``[min, max]`` of the
    tokens/s metrics and of the replay ``error_pct``) are added.
    """
    if not summaries:
        raise ValueError("median_summary needs at least one summary")
    if len(summaries) == 1:
        return dict(summaries[0])

    def fold(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        out = dict(items[0])
        for key, v in items[0].items():
            if isinstance(v, bool):
                out[key] = all(bool(x[key]) for x in items)
            elif isinstance(v, int | float):
                out[key] = _median([x[key] for x in items])
        return out

    out = fold(summaries)
    spread = {
        key: [float(min(s[key] for s in summaries)), float(max(s[key] for s in summaries))]
        for key in SPREAD_KEYS
    }
    if "replay" in summaries[0]:
        out["replay"] = fold([s["replay"] for s in summaries])
        err = np.asarray([s["replay"]["error_pct"] for s in summaries], dtype=np.float64)
        spread["replay_error_pct"] = [float(err.min()), float(err.max())]
    out["repeats"] = len(summaries)
    out["spread"] = spread
    return out
