"""The best ``k`` per batch bucket, from replaying measured acceptance against a cost table.

For each request bucket ``Bcap`` of the table, the acceptance trace's request rows are regrouped
into full batches of ``Bcap`` requests (:func:`rebatch`: consecutive rows, the order and phases
kept, the remainder dropped) and replayed (``speccal.replay.replay``): every fixed ``k = 1..w``
and speccal's adaptive policy of the table's mode. ``k = 0`` (no speculation) is priced only
where something measured it (:class:`ZeroCost`): ``--k0-ms`` (a step time measured in the target
engine with speculation at 0), or, in a ``draft_step`` table, windows measured at ``k = 0``
(``G = Bcap``); in a ``target_verify`` table "0" is the verify budget ``G = Bcap`` (the draft
still runs ``w`` steps). The bucket's best ``k`` maximises predicted tokens/s (ties to the
smaller ``k``); a bucket the table cannot price is ``uncalibrated`` and keeps full width ``w``
(the policies' fallback, SPEC section 3).

:func:`workload_runs` replays a whole trace (its own batch sizes) under a per-bucket decision
map (what an exported schedule makes the engine run) and under every single fixed ``k``, so
the gain over the best single fixed ``k`` is measured on the same rounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speccal.base.errors import InputError
from speccal.policy import CostModel
from speccal.replay import PolicyRun, ReplayConfig, replay
from speccal.trace import RoundTrace


@dataclass(frozen=True)
class ZeroCost:
    """How ``k = 0`` is priced per bucket: ``flag_ms`` (a fixed step time) or the table."""

    flag_ms: dict[int, float] = field(default_factory=dict)
    table_buckets: tuple[int, ...] = ()  # buckets whose G = Bcap cell prices k = 0
    table_source: str = ""

    def source(self, bcap: int) -> str | None:
        if bcap in self.flag_ms:
            return "--k0-ms"
        if bcap in self.table_buckets:
            return self.table_source
        return None

    def costs(self, cost: CostModel, bcap: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """``[R]`` ms of a ``k = 0`` round per round (NaN where unpriced)."""
        bcap = np.asarray(bcap, dtype=np.int64)
        out = np.full(bcap.shape, np.nan)
        table = np.isin(bcap, np.asarray(self.table_buckets, dtype=np.int64))
        if table.any():
            out[table] = cost.lookup(bcap[table], bcap[table], np.asarray(kv)[table], 0)
        for b, ms in self.flag_ms.items():
            out[bcap == b] = ms
        return out


def parse_k0_ms(text: str | None, buckets: tuple[int, ...]) -> dict[int, float]:
    """``--k0-ms``: ``MS`` for every bucket or ``BCAP=MS,...``; ms must be finite and > 0."""
    if text is None:
        return {}
    out: dict[int, float] = {}
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        if len(parts) == 1 and "=" not in parts[0]:
            out = {b: float(parts[0]) for b in buckets}
        else:
            for p in parts:
                b, ms = p.split("=")
                out[int(b)] = float(ms)
    except ValueError:
        raise InputError("--k0-ms", text, "MS or BCAP=MS,... (e.g. 1=4.1,8=5.2)") from None
    for b, ms in out.items():
        if b not in buckets:
            raise InputError("--k0-ms", b, f"a request bucket of the table {list(buckets)}")
        if not (math.isfinite(ms) and ms > 0):
            raise InputError("--k0-ms", ms, "a step time in ms > 0")
    return out


def zero_cost(table: Any, k0_ms: dict[int, float], *, table_k0: bool = True) -> ZeroCost:
    """Where ``k = 0`` is priced for ``table`` (see module docstring).

    ``table_k0=False``: only ``--k0-ms`` prices ``k = 0`` (vLLM, whose ``K = 0`` step still runs
    a drafter forward that speccal's ``k = 0`` windows do not measure); without it ``k = 0`` is
    never chosen.
    """
    buckets = tuple(table.geometry().request_buckets)
    if table.mode == "draft_step" and not table_k0:
        return ZeroCost(flag_ms=dict(k0_ms))
    if table.mode == "draft_step":
        measured = sorted(
            {w.bcap for f in table.fits for w in f.windows if w.k == 0 and w.g == w.bcap}
        )
        return ZeroCost(
            flag_ms=dict(k0_ms),
            table_buckets=tuple(measured),
            table_source="table (windows measured at k = 0, G = Bcap)",
        )
    if k0_ms:
        raise InputError(
            "--k0-ms",
            sorted(k0_ms),
            "a draft_step table (in a target_verify table budget 0 is the table's G = Bcap cell)",
        )
    return ZeroCost(table_buckets=buckets, table_source="table (verify budget G = Bcap)")


def rebatch(trace: RoundTrace, num_requests: int) -> RoundTrace:
    """The trace's request rows regrouped, in order, into rounds of ``num_requests`` requests.

    Each new round's KV length is the mean of its rows' rounds' and its phase the phase of its
    first row's round; rows past the last full round are dropped.
    """
    n = (trace.accepted.size // num_requests) * num_requests
    if n == 0:
        raise InputError(
            "trace",
            f"{trace.accepted.size} request rows",
            f"at least {num_requests} (one batch of the bucket)",
        )
    rounds = n // num_requests
    src_round = np.repeat(np.arange(trace.num_rounds), trace.num_requests)[:n]
    scores = None if trace.draft_scores is None else trace.draft_scores[:n]
    return RoundTrace(
        draft_width=trace.draft_width,
        num_requests=np.full(rounds, num_requests, dtype=np.int64),
        kv_length=trace.kv_length[src_round].reshape(rounds, num_requests).mean(axis=1),
        k=np.full(rounds, trace.draft_width, dtype=np.int64),
        accepted=trace.accepted[:n],
        draft_scores=scores,
        phase=trace.phase[src_round[::num_requests]],
        meta=dict(trace.meta),
    )


@dataclass(frozen=True)
class BucketScore:
    """Predicted tokens/s of every ``k`` at one request bucket (None: not priced)."""

    bcap: int
    rounds: int
    tokens_per_s: dict[int, float | None]
    best_k: int
    k0_source: str | None
    adaptive: dict[str, Any] | None = None
    uncalibrated: str | None = None

    @property
    def best_tokens_per_s(self) -> float | None:
        return self.tokens_per_s.get(self.best_k)

    def gain_pct(self, k: int) -> float | None:
        """Gain of the best ``k`` over ``k`` in % (None when either is not priced)."""
        a, b = self.best_tokens_per_s, self.tokens_per_s.get(k)
        return None if a is None or b is None else 100.0 * (a / b - 1.0)

    def margin_pct(self) -> float | None:
        """Gain of the best ``k`` over the runner-up, in %: how decisive the choice is."""
        others = [v for k, v in self.tokens_per_s.items() if k != self.best_k and v is not None]
        best = self.best_tokens_per_s
        return None if best is None or not others else 100.0 * (best / max(others) - 1.0)


def _adaptive_name(cost: CostModel, trace: RoundTrace) -> str | None:
    if cost.mode == "draft_step":
        return "adaptive-step"
    return "adaptive-verify" if trace.draft_scores is not None else None


def score_bucket(cost: CostModel, trace: RoundTrace, bcap: int, zero: ZeroCost) -> BucketScore:
    """Replay ``trace`` rebatched to ``bcap`` (every fixed ``k``, the adaptive policy, k = 0)."""
    w = cost.draft_width
    tb = rebatch(trace, bcap)
    adaptive = _adaptive_name(cost, tb)
    try:
        rep = replay(tb, cost, ReplayConfig(policies=(adaptive,) if adaptive else ()))
    except InputError as exc:
        return BucketScore(
            bcap=bcap,
            rounds=tb.num_rounds,
            tokens_per_s={k: None for k in range(w + 1)},
            best_k=w,
            k0_source=zero.source(bcap),
            uncalibrated=str(exc),
        )
    tps: dict[int, float | None] = {}
    cap = int(cost.bcap(np.array([bcap]))[0])  # a batch size between buckets pads up
    c0 = zero.costs(cost, np.full(tb.num_rounds, cap), tb.kv_length)
    if np.isfinite(c0).all() and (c0 > 0).all():
        tps[0] = 1000.0 * float(tb.num_requests.sum()) / float(c0.sum())
    else:
        tps[0] = None
    for k in range(1, w + 1):
        run = rep.run(f"fixed:{k}")
        tps[k] = run.totals()["tokens_per_s"] if run.priced else None
    priced = [(v, -k) for k, v in tps.items() if v is not None]
    best_k = -max(priced)[1]
    ad = None
    if adaptive:
        run = rep.run(adaptive)
        best_fixed = rep.run(rep.best_fixed).totals()["tokens_per_s"]
        t = run.totals()["tokens_per_s"] if run.priced else None
        ad = {
            "policy": adaptive,
            "tokens_per_s": t,
            "gain_vs_best_fixed_pct": None if t is None else 100.0 * (t / best_fixed - 1.0),
            "best_fixed": rep.best_fixed,
        }
    return BucketScore(
        bcap=bcap,
        rounds=tb.num_rounds,
        tokens_per_s=tps,
        best_k=best_k,
        k0_source=zero.source(cap),
        adaptive=ad,
    )


def score_buckets(cost: CostModel, trace: RoundTrace, zero: ZeroCost) -> list[BucketScore]:
    """:func:`score_bucket` for every request bucket of the table that the trace can fill."""
    if trace.draft_width != cost.draft_width:
        raise InputError(
            "trace.draft_width", trace.draft_width, f"the table's draft_width = {cost.draft_width}"
        )
    buckets = [b for b in cost.geometry.request_buckets if b <= trace.accepted.size]
    return [score_bucket(cost, trace, b, zero) for b in buckets]


def schedule_run(
    trace: RoundTrace,
    cost: CostModel,
    k_of_bcap: Mapping[int, int],
    zero: ZeroCost,
    name: str = "schedule",
    per_batch_size: bool = False,
) -> PolicyRun:
    """The trace (its own batches) with ``k = k_of_bcap[bcap_for(B)]`` each round
    (``per_batch_size``: ``k = k_of_bcap[B]``, the map keyed by logical batch size)."""
    b = trace.num_requests
    bcap = cost.bcap(b)
    key = b if per_batch_size else bcap
    missing = sorted(set(np.unique(key).tolist()) - set(k_of_bcap))
    if missing:
        what = "batch size" if per_batch_size else "bucket"
        raise InputError("schedule", missing, f"a decision for every {what} the trace uses")
    k = np.array([k_of_bcap[int(x)] for x in key], dtype=np.int64)
    cum = np.concatenate(
        (np.zeros((b.size, 1)), np.cumsum(trace.survival_counts(), axis=1)), axis=1
    )
    rows = np.arange(b.size)
    accepted = cum[rows, k]
    costs = cost.step_costs(b, trace.kv_length)
    spec = costs[rows, np.maximum(k, 1) - 1]
    cost_ms = np.where(k > 0, spec, zero.costs(cost, bcap, trace.kv_length))
    verify_k = k if cost.mode == "draft_step" else np.full(b.size, cost.draft_width)
    return PolicyRun(
        name=name,
        kind="schedule",
        k=verify_k,
        g=cost.g(bcap, b * (k + 1)),
        tokens=b + accepted,
        accepted=accepted,
        verified=(b * k).astype(np.float64),
        cost_ms=cost_ms,
        num_requests=b,
        phase=trace.phase,
        reasons={"schedule": int(b.size)},
    )


def workload_runs(
    trace: RoundTrace,
    cost: CostModel,
    k_of_bcap: Mapping[int, int],
    zero: ZeroCost,
    per_batch_size: bool = False,
) -> dict[str, Any]:
    """Tokens/s of the trace under the decisions and under every fixed ``k`` (``0`` only where
    priced at every round); the gain of the decisions over the best single fixed ``k`` (all on
    the same rounds). ``per_batch_size``: the decisions are keyed by logical batch size."""
    sched = schedule_run(trace, cost, k_of_bcap, zero, per_batch_size=per_batch_size)
    w = cost.draft_width
    fixed = {
        k: schedule_run(
            trace,
            cost,
            dict.fromkeys(k_of_bcap, k),
            zero,
            name=f"fixed:{k}",
            per_batch_size=per_batch_size,
        )
        for k in range(0, w + 1)
    }
    fixed_tps = {k: (r.totals()["tokens_per_s"] if r.priced else None) for k, r in fixed.items()}
    priced = {k: v for k, v in fixed_tps.items() if v is not None}
    if not priced or not sched.priced:
        raise InputError(
            "table",
            "rounds the table cannot price",
            "a table calibrated at every round of the acceptance (bucket and KV interval)",
        )
    best = max(priced, key=lambda k: (priced[k], -k))
    t = sched.totals()
    return {
        "weighting": "the trace's rounds (tokens/s = sum(tokens) / sum(time), as replay)",
        "rounds": int(trace.num_rounds),
        "requests_per_round": sorted(int(x) for x in np.unique(trace.num_requests)),
        "schedule_tokens_per_s": t["tokens_per_s"],
        "schedule_tpot_ms": t["tpot_ms"],
        "fixed_tokens_per_s": fixed_tps,
        "best_fixed_k": best,
        "gain_vs_best_fixed_pct": 100.0 * (t["tokens_per_s"] / priced[best] - 1.0),
        "mean_k": float(np.mean(sched.k)) if cost.mode == "draft_step" else None,
    }


def equal_time_workload(scores: list[BucketScore], k_of_bcap: Mapping[int, int]) -> dict[str, Any]:
    """Equal serving time at every bucket (a profile has no batch sizes of its own): the mean
    of the buckets' tokens/s under the decisions and under every single fixed ``k``.

    Per-bucket best rates maximise this mean, so the gain is never negative; over a fixed number
    of rounds per bucket (a ratio of sums) a per-bucket choice can lose a little instead.
    """
    scores = [s for s in scores if s.uncalibrated is None]
    if not scores:
        raise InputError("table", "no bucket priced", "a table calibrated at the acceptance's KV")
    ks = sorted({k for s in scores for k in s.tokens_per_s})

    def mean(rates: list[float | None]) -> float | None:
        return None if any(r is None for r in rates) else float(np.mean(rates))

    sched = mean([s.tokens_per_s.get(k_of_bcap[s.bcap]) for s in scores])
    fixed = {k: mean([s.tokens_per_s.get(k) for s in scores]) for k in ks}
    priced = {k: v for k, v in fixed.items() if v is not None}
    if sched is None or not priced:
        raise InputError("table", "unpriced decisions", "a price for every bucket's k")
    best = max(priced, key=lambda k: (priced[k], -k))
    return {
        "weighting": "equal time at every bucket (the mean of the buckets' tokens/s)",
        "buckets": [s.bcap for s in scores],
        "schedule_tokens_per_s": sched,
        "fixed_tokens_per_s": fixed,
        "best_fixed_k": best,
        "gain_vs_best_fixed_pct": 100.0 * (sched / priced[best] - 1.0),
    }


def score_batch_sizes(cost: CostModel, trace: RoundTrace, zero: ZeroCost) -> list[BucketScore]:
    """:func:`score_bucket` at every logical batch size ``B = 1 .. largest bucket`` the trace can
    fill (``BucketScore.bcap`` holds ``B``): a partly filled bucket is priced at its own
    ``G = pad(B * (k + 1))``, not at the bucket's full batch."""
    if trace.draft_width != cost.draft_width:
        raise InputError(
            "trace.draft_width", trace.draft_width, f"the table's draft_width = {cost.draft_width}"
        )
    top = min(int(cost.geometry.request_buckets[-1]), int(trace.accepted.size))
    return [score_bucket(cost, trace, b, zero) for b in range(1, top + 1)]


def per_bucket_k(cost: CostModel, k_of_bcap: Mapping[int, int], top: int) -> dict[int, int]:
    """``{B: k}`` for ``B = 1 .. top`` from a per-bucket map: each ``B`` runs its bucket's ``k``."""
    caps = cost.bcap(np.arange(1, top + 1))
    return {b: int(k_of_bcap[int(c)]) for b, c in zip(range(1, top + 1), caps, strict=True)}


def ranges(
    cost: CostModel, scores: list[BucketScore], exported: Mapping[int, int]
) -> list[dict[str, Any]]:
    """Per-batch-size scores merged into ranges of equal exported ``k``, with their evidence:
    per batch size the chosen ``k``'s and the runner-up's predicted tokens/s and the table cell
    (``Bcap``, ``G = pad(B * (k + 1))``) each prices."""
    out: list[dict[str, Any]] = []
    for s in scores:
        k = int(exported.get(s.bcap, s.best_k))
        others = [(v, -kk) for kk, v in s.tokens_per_s.items() if kk != k and v is not None]
        ru = -max(others)[1] if others else None
        cap = int(cost.bcap(np.array([s.bcap]))[0])

        def cell(kk: int | None, cap: int = cap, b: int = s.bcap) -> dict[str, int] | None:
            if kk is None:
                return None
            g = cap if kk == 0 else int(cost.g(np.array([cap]), np.array([b * (kk + 1)]))[0])
            return {"bcap": cap, "g": g}

        row = {
            "batch_size": s.bcap,
            "tokens_per_s": s.tokens_per_s.get(k),
            "runner_up_k": ru,
            "runner_up_tokens_per_s": None if ru is None else s.tokens_per_s[ru],
            "cell": cell(k),
            "runner_up_cell": cell(ru),
            "uncalibrated": s.uncalibrated,
        }
        if out and out[-1]["k"] == k:
            out[-1]["batch_sizes"][1] = s.bcap
            out[-1]["evidence"].append(row)
        else:
            out.append({"batch_sizes": [s.bcap, s.bcap], "k": k, "evidence": [row]})
    return out


def compare_per_bucket(
    scores: list[BucketScore], per_b: Mapping[int, int], per_bucket: Mapping[int, int]
) -> dict[str, Any]:
    """Predicted tokens/s of the per-batch-size decisions vs each batch size running its
    bucket's decision, at every batch size and as the mean over batch sizes (equal time each)."""
    rows = []
    for s in scores:
        a, b = s.tokens_per_s.get(per_b[s.bcap]), s.tokens_per_s.get(per_bucket[s.bcap])
        rows.append(
            {
                "batch_size": s.bcap,
                "k": int(per_b[s.bcap]),
                "per_bucket_k": int(per_bucket[s.bcap]),
                "tokens_per_s": a,
                "per_bucket_tokens_per_s": b,
                "gain_pct": None if a is None or b is None else 100.0 * (a / b - 1.0),
            }
        )
    priced = [r for r in rows if r["gain_pct"] is not None]
    mean_a = float(np.mean([r["tokens_per_s"] for r in priced])) if priced else None
    mean_b = float(np.mean([r["per_bucket_tokens_per_s"] for r in priced])) if priced else None
    return {
        "weighting": "equal time at every batch size 1 .. largest bucket",
        "batch_sizes_differing": [r["batch_size"] for r in rows if r["k"] != r["per_bucket_k"]],
        "tokens_per_s": mean_a,
        "per_bucket_tokens_per_s": mean_b,
        "gain_pct": None if not priced else 100.0 * (mean_a / mean_b - 1.0),
        "max_gain_pct": max((r["gain_pct"] for r in priced), default=None),
        "rows": rows,
    }
