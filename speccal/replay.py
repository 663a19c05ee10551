"""Replay: simulate speculation policies against a cost table, round by round, from traces.

Owns the simulation and the report. Two engines, one set of decision rules
(``speccal.policy_rules``):

- **vectorised** (:func:`replay`, round traces): fixed ``k`` for every ``k`` at once; adaptive
  draft step as a loop over re-scoring points only (every ``update_interval`` rounds), with the
  window held as running sums ``Q [R + 1, w]`` of per-position survival counts; adaptive target
  verify fully vectorised because its budget depends only on lagged draft scores (never on past
  decisions): survival curves per round, a lagged window mean by cumulative sums, one batched
  :func:`~speccal.policy_rules.choose_budget` and
  :func:`~speccal.policy_rules.allocate_prefixes_batch`.
- **sequential** (:func:`run_sequential`): drives a live policy object (``decide`` /
  ``observe``) exactly as the runner does; used for token traces (exact counterfactual greedy
  replay: positions advance by ``a + 1``) and to cross-check the vectorised engine in tests.

Per simulated round ``r`` a :class:`PolicyRun` holds ``k``, ``g``, emitted tokens
(``sum(a + 1)``), accepted drafts, verified drafts, cost in ms, ``B`` and phase, all ``[R]``.
Summary metrics: tokens/s = sum(tokens) / sum(cost); TPOT = sum(cost * B) / sum(tokens) (ms per
output token of a request); acceptance rate = accepted / verified drafts; mean accepted length =
accepted drafts per request-round.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from speccal.base.errors import InputError, UnsupportedError
from speccal.policy import (
    AdaptiveStepConfig,
    AdaptiveVerifyConfig,
    BatchState,
    CostModel,
    Feedback,
    Policy,
    PolicySpec,
    make_policy,
    parse_policy,
)
from speccal.policy_rules import (
    allocate_prefixes,
    allocate_prefixes_batch,
    choose_budget,
    choose_step,
    prefix_acceptance_list,
    survival,
    survival_curves,
)
from speccal.trace import RoundTrace, TokenTrace

#: Rounds processed per chunk in the vectorised verify path (bounds memory).
CHUNK = 1 << 16

REASONS = ("fixed", "warmup", "switch", "hold", "uncalibrated", "scored")


@dataclass(eq=False)
class PolicyRun:
    """Per-round outcome of one policy over a trace (all arrays ``[R]``)."""

    name: str
    kind: str
    k: np.ndarray
    g: np.ndarray
    tokens: np.ndarray
    accepted: np.ndarray
    verified: np.ndarray
    cost_ms: np.ndarray
    num_requests: np.ndarray
    phase: np.ndarray
    reasons: dict[str, int] = field(default_factory=dict)
    # [R] the same decisions priced as if every request sat at its round's longest KV
    # (price_at_longest_kv); None where the trace did not record the longest
    cost_ms_at_longest: np.ndarray | None = None

    @property
    def priced(self) -> bool:
        """Every round has a finite, positive cost and the predicted tokens/s is finite and > 0.

        A cost table can only price a round with a positive cost; a run with any other round has
        no meaningful throughput and must never be compared (nor be the best fixed ``k``).
        """
        c = self.cost_ms
        if c.size == 0 or not bool((np.isfinite(c) & (c > 0)).all()):
            return False
        tps = self.totals()["tokens_per_s"]
        return math.isfinite(tps) and tps > 0

    def totals(self, sel: np.ndarray | None = None) -> dict[str, float]:
        s = slice(None) if sel is None else sel
        t_ms = float(np.sum(self.cost_ms[s]))
        tok = float(np.sum(self.tokens[s]))
        acc = float(np.sum(self.accepted[s]))
        ver = float(np.sum(self.verified[s]))
        reqs = float(np.sum(self.num_requests[s]))
        return {
            "tokens_per_s": 1000.0 * tok / t_ms if t_ms > 0 else math.nan,
            "tpot_ms": float(np.sum(self.cost_ms[s] * self.num_requests[s])) / tok
            if tok
            else math.nan,
            "acceptance_rate": acc / ver if ver else math.nan,
            "mean_accepted_length": acc / reqs if reqs else math.nan,
            "total_tokens": tok,
            "total_time_s": t_ms / 1000.0,
        }

    def timeline(self, max_segments: int = 2000) -> tuple[list[list[int]], int]:
        """Run-length segments ``[start, stop, k, g]`` of the decisions; ``(segments, dropped)``."""
        key = self.k.astype(np.int64) * (1 << 32) + self.g.astype(np.int64)
        starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
        stops = np.concatenate((starts[1:], [key.size]))
        segs = [
            [int(a), int(b), int(self.k[a]), int(self.g[a])]
            for a, b in zip(starts[:max_segments], stops[:max_segments], strict=True)
        ]
        return segs, max(int(starts.size) - max_segments, 0)


@dataclass(frozen=True)
class ReplayConfig:
    """What to replay: policy specs (baselines ``fixed:1..w`` are always added) and settings."""

    policies: tuple[str, ...] = ("adaptive-step",)
    # None: the cost model's (the table's ``calibration.policy``), else the defaults
    step: AdaptiveStepConfig | None = None
    verify: AdaptiveVerifyConfig = field(default_factory=AdaptiveVerifyConfig)
    max_segments: int = 2000
    # feedback with the pipelined engine's lag (round r observed after deciding r + 1); also
    # taken from a trace whose meta says ``"pipelined": true`` (a pipelined live run's trace)
    pipelined: bool = False


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def check_replayable(
    trace: RoundTrace | TokenTrace, cost: CostModel, specs: Sequence[PolicySpec]
) -> None:
    """Refuse before running: width mismatch, censored traces, missing scores, wrong mode,
    batches without a bucket, and rounds the table cannot price even at full width."""
    w = cost.draft_width
    if trace.draft_width != w:
        raise InputError("trace.draft_width", trace.draft_width, f"the table's draft_width = {w}")
    for p in specs:
        if p.kind == "adaptive-step" and cost.mode != "draft_step":
            raise UnsupportedError(
                "adaptive-step replay needs a draft_step table (mode is target_verify)"
            )
        if p.kind == "adaptive-verify" and cost.mode != "target_verify":
            raise UnsupportedError(
                "adaptive-verify replay needs a target_verify table (mode is draft_step)"
            )
        if p.kind == "fixed" and p.k > w:
            raise InputError("policy", p.text, f"fixed:K with K <= draft_width = {w}")
        if p.kind == "adaptive-verify" and trace.draft_scores is None:
            raise InputError(
                "trace.draft_scores", None, "per-request draft scores for adaptive-verify"
            )
    if isinstance(trace, RoundTrace):
        if not trace.full_width:
            n = int((trace.k < w).sum())
            raise InputError(
                "trace.k",
                f"{n} rounds with k < {w}",
                f"every round drafted at full width k = {w}",
                hint="accepted lengths beyond a recorded k are unknown; record with k = w",
            )
        b, kv = trace.num_requests, trace.kv_length
    else:
        b, kv = (
            np.array([np.unique(trace.request).size]),
            np.array([float(np.mean(trace.kv_length))]),
        )
    bcap = cost.bcap(b)
    if (bcap == 0).any():
        i = int(np.argmax(bcap == 0))
        raise InputError(
            "trace.num_requests",
            int(b[i]),
            f"<= the largest request bucket {cost.geometry.request_buckets[-1]}",
        )
    if isinstance(trace, RoundTrace):
        full = cost.step_costs(b, kv)[:, -1]
        unpriced = ~(np.isfinite(full) & (full > 0))  # a non-positive cost is no price either
        if unpriced.any():
            i = int(np.argmax(unpriced))
            raise InputError(
                "table",
                f"round {i}: B={int(b[i])}, kv_length={kv[i]:g}",
                "a table calibrated at every round's full-width point (bucket and KV interval)",
            )


# --------------------------------------------------------------------------------------------
# Vectorised engine (round traces)
# --------------------------------------------------------------------------------------------


def _spread_extra(trace: RoundTrace, cost: CostModel) -> np.ndarray:
    """``[R]`` the KV spread term of every round (``CostModel.spread_ms``: 0 without a spread
    term in the table or without the rounds' longest KV in the trace). Decisions stay on the
    mean-KV costs, as the live policy takes them."""
    return cost.spread_ms(cost.bcap(trace.num_requests), trace.kv_length, trace.kv_max_length)


def _fixed_runs(trace: RoundTrace, cost: CostModel, H: np.ndarray,
                extra: np.ndarray) -> list[PolicyRun]:
    w = trace.draft_width
    b = trace.num_requests
    cum = np.cumsum(H, axis=1)  # [R, w]: accepted drafts with k = index + 1
    costs = cost.step_costs(b, trace.kv_length)  # [R, w]
    bcap = cost.bcap(b)
    runs = []
    for k in range(1, w + 1):
        runs.append(
            PolicyRun(
                name=f"fixed:{k}",
                kind="fixed",
                k=np.full(b.size, w if cost.mode == "target_verify" else k),
                g=cost.g(bcap, b * (k + 1)),
                tokens=b + cum[:, k - 1],
                accepted=cum[:, k - 1].astype(np.float64),
                verified=(b * k).astype(np.float64),
                cost_ms=costs[:, k - 1] + extra,
                num_requests=b,
                phase=trace.phase,
                reasons={"fixed": int(b.size)},
            )
        )
    return runs


def _adaptive_step_run(
    trace: RoundTrace, cost: CostModel, H: np.ndarray, cfg: AdaptiveStepConfig,
    extra: np.ndarray,
) -> PolicyRun:
    """Vectorised twin of :class:`~speccal.policy.AdaptiveStepPolicy` with lag-0 feedback.

    Round ``r`` sees the feedback of rounds ``< r``; scoring happens at round 1 (the first
    feedback) and then at rounds ``start`` = ``update_interval * j`` (``j >= 1``) from the window
    ``[start - window_size, start)``. The window is a difference of running sums ``Q`` of masked
    survival counts, kept at block edges (a block runs from one scoring to the next, one held
    ``k``), so a block costs O(w) unless one of its rounds is uncalibrated at the held ``k``
    (then that block is summed round by round).
    """
    r_total, w = H.shape
    b = trace.num_requests
    costs = cost.step_costs(b, trace.kv_length)  # [R, w]
    bad = ~np.isfinite(costs)
    Hf = H.astype(np.float64)
    reached = np.concatenate((b[:, None], H[:, :-1]), axis=1).astype(np.float64)
    zero = np.zeros((1, w))
    ch_s = np.concatenate((zero, np.cumsum(Hf, axis=0)))  # unmasked running sums [R + 1, w]
    ch_r = np.concatenate((zero, np.cumsum(reached, axis=0)))
    interval, window, gain_min = cfg.update_interval, cfg.window_size, cfg.switch_min_gain
    starts = np.unique(np.concatenate(([0, 1], np.arange(interval, r_total, interval))))
    starts = starts[starts < r_total]
    stops = np.concatenate((starts[1:], [r_total]))
    nblocks = starts.size
    start_list = starts.tolist()
    bad_block = np.logical_or.reduceat(bad, starts, axis=0).tolist()  # [nblocks][w]
    # Per-block unmasked sums and per-start lookups as plain lists: the loop below runs once
    # per block (2 * 10^5 times for 10^6 rounds) on vectors of length w, where numpy's
    # per-call overhead would dominate.
    blk_s = (ch_s[stops] - ch_s[starts]).tolist()
    blk_r = (ch_r[stops] - ch_r[starts]).tolist()
    start_costs = costs[starts].tolist()
    start_b = b[starts].tolist()
    qs: list[list[float]] = [[0.0] * w]  # masked running sums at block edges
    qr: list[list[float]] = [[0.0] * w]
    k_block = np.empty(nblocks, dtype=np.int64)
    why_block = np.empty(nblocks, dtype=np.int8)
    irregular: dict[
        int, tuple[np.ndarray, np.ndarray, np.ndarray]
    ] = {}  # block -> (ks, cum_s, cum_r)
    code = {name: i for i, name in enumerate(REASONS)}

    def q_at(r: int) -> tuple[list[float], list[float]]:
        j = bisect_right(start_list, r) - 1
        off = r - start_list[j]
        if off == 0:
            return qs[j], qr[j]
        if j in irregular:
            _, cs_, cr_ = irregular[j]
            return (np.asarray(qs[j]) + cs_[off - 1]).tolist(), (
                np.asarray(qr[j]) + cr_[off - 1]
            ).tolist()
        k = int(k_block[j])
        st = int(starts[j])
        ds = (ch_s[r, :k] - ch_s[st, :k]).tolist()
        dr = (ch_r[r, :k] - ch_r[st, :k]).tolist()
        return (
            [x + y for x, y in zip(qs[j][:k], ds, strict=True)] + qs[j][k:],
            [x + y for x, y in zip(qr[j][:k], dr, strict=True)] + qr[j][k:],
        )

    held = w
    for j in range(nblocks):
        if j == 0:
            why = code["warmup"]
        else:
            lo_s, lo_r = q_at(max(0, start_list[j] - window))
            qs_j, qr_j = qs[j], qr[j]
            prefix = prefix_acceptance_list(
                [x - y for x, y in zip(qs_j, lo_s, strict=True)],
                [x - y for x, y in zip(qr_j, lo_r, strict=True)],
            )
            held, name, _ = choose_step(prefix, start_costs[j], start_b[j], held, gain_min)
            why = code[name]
        k_block[j], why_block[j] = held, why
        if not bad_block[j][held - 1]:
            k = held
            qs.append([x + y for x, y in zip(qs[j][:k], blk_s[j][:k], strict=True)] + qs[j][k:])
            qr.append([x + y for x, y in zip(qr[j][:k], blk_r[j][:k], strict=True)] + qr[j][k:])
        else:
            start, stop = int(starts[j]), int(stops[j])
            ks = np.where(bad[start:stop, held - 1], w, held)
            mk = np.arange(w)[None, :] < ks[:, None]
            cs_ = np.cumsum(Hf[start:stop] * mk, axis=0)
            cr_ = np.cumsum(reached[start:stop] * mk, axis=0)
            irregular[j] = (ks, cs_, cr_)
            qs.append((np.asarray(qs[j]) + cs_[-1]).tolist())
            qr.append((np.asarray(qr[j]) + cr_[-1]).tolist())
    sizes = stops - starts
    k_round = np.repeat(k_block, sizes)
    reason = np.repeat(
        np.where(why_block == code["warmup"], code["warmup"], code["hold"]).astype(np.int8), sizes
    )
    reason[starts] = why_block
    for j, (ks, _, _) in irregular.items():
        k_round[starts[j] : stops[j]] = ks
        reason[starts[j] : stops[j]][ks != k_block[j]] = code["uncalibrated"]
    cum = np.cumsum(Hf, axis=1)
    rows = np.arange(r_total)
    reason[bad[rows, k_round - 1]] = code["uncalibrated"]
    acc = cum[rows, k_round - 1]
    bcap = cost.bcap(b)
    return PolicyRun(
        name="adaptive-step",
        kind="adaptive-step",
        k=k_round,
        g=cost.g(bcap, b * (k_round + 1)),
        tokens=b + acc,
        accepted=acc,
        verified=(b * k_round).astype(np.float64),
        cost_ms=costs[rows, k_round - 1] + extra,
        num_requests=b,
        phase=trace.phase,
        reasons={n: int((reason == i).sum()) for i, n in enumerate(REASONS) if (reason == i).any()},
    )


def _adaptive_verify_run(
    trace: RoundTrace, cost: CostModel, cfg: AdaptiveVerifyConfig, extra: np.ndarray
) -> PolicyRun:
    """Vectorised twin of :class:`~speccal.policy.AdaptiveVerifyPolicy`.

    One pass over chunks of rounds: survival of the current scores -> survival curves -> running
    sums ``cs [R + 1, n]`` of curves -> window mean over rounds ``[r - lag - W + 1, r - lag]``
    (all already summed, as ``lag >= 2``) -> budget -> prefix allocation of the current scores.
    """
    r_total, w = trace.num_rounds, trace.draft_width
    b = trace.num_requests
    res = cfg.resolution
    n = w * res + 1
    lag, window = cfg.feedback_lag, cfg.window_size
    budgets, costs = cost.verify_candidates(b, trace.kv_length)
    full = budgets.max(axis=1)
    cs = np.zeros((r_total + 1, n))
    g = np.empty(r_total, dtype=np.int64)
    accepted = np.empty(r_total)
    verified = np.empty(r_total)
    for c0 in range(0, r_total, CHUNK):
        c1 = min(c0 + CHUNK, r_total)
        acc_full, sc = trace.padded(c0, c1)
        surv = survival(sc)
        cs[c0 + 1 : c1 + 1] = cs[c0] + np.cumsum(
            survival_curves(surv, b[c0:c1], res, presurvived=True), axis=0
        )
        rounds = np.arange(c0, c1)
        hi = np.maximum(rounds - lag + 1, 0)  # exclusive end: rounds <= r - lag
        lo = np.maximum(hi - window, 0)
        mean = (cs[hi] - cs[lo]) / np.maximum(hi - lo, 1)[:, None]
        gc, _ = choose_budget(mean, b[c0:c1], budgets[c0:c1], costs[c0:c1], res)
        g[c0:c1] = np.where(hi > 0, gc, full[c0:c1])
        v = allocate_prefixes_batch(surv, b[c0:c1], g[c0:c1] - b[c0:c1], presurvived=True)
        accepted[c0:c1] = np.minimum(acc_full, v).sum(axis=1)
        verified[c0:c1] = v.sum(axis=1)
    have = np.arange(r_total) - lag + 1 > 0
    reasons = np.where(have, REASONS.index("scored"), REASONS.index("warmup"))
    reasons = np.where(
        have & ~np.isfinite(costs).any(axis=1), REASONS.index("uncalibrated"), reasons
    )
    g_cost = np.take_along_axis(costs, np.argmax(budgets == g[:, None], axis=1)[:, None], 1)[:, 0]
    return PolicyRun(
        name="adaptive-verify",
        kind="adaptive-verify",
        k=np.full(r_total, w),
        g=g,
        tokens=b + accepted,
        accepted=accepted,
        verified=verified,
        cost_ms=np.where(g > 0, g_cost, np.nan) + extra,
        num_requests=b,
        phase=trace.phase,
        reasons={
            n_: int((reasons == i).sum()) for i, n_ in enumerate(REASONS) if (reasons == i).any()
        },
    )


def _phase_oracle(fixed: list[PolicyRun], phase: np.ndarray) -> tuple[PolicyRun, dict[int, str]]:
    """Per-phase best fixed ``k`` in hindsight, stitched into one run."""
    priced = [r for r in fixed if r.priced]
    out = {
        f: np.array(getattr(priced[0], f), dtype=np.float64, copy=True)
        for f in ("k", "g", "tokens", "accepted", "verified", "cost_ms")
    }
    choice = {}
    for ph in np.unique(phase):
        sel = phase == ph
        best = max(priced, key=lambda r: r.totals(sel)["tokens_per_s"])
        choice[int(ph)] = best.name
        for f in out:
            out[f][sel] = getattr(best, f)[sel]
    run = PolicyRun(
        name="oracle:per-phase",
        kind="oracle",
        k=out["k"].astype(np.int64),
        g=out["g"].astype(np.int64),
        tokens=out["tokens"],
        accepted=out["accepted"],
        verified=out["verified"],
        cost_ms=out["cost_ms"],
        num_requests=priced[0].num_requests,
        phase=phase,
    )
    return run, choice


# --------------------------------------------------------------------------------------------
# Sequential engine (live policy objects)
# --------------------------------------------------------------------------------------------


def run_sequential(
    trace: RoundTrace | TokenTrace,
    cost: CostModel,
    policy: Policy,
    *,
    max_rounds: int | None = None,
    pipelined: bool = False,
) -> PolicyRun:
    """Drive a policy object through a trace as the live runner would (decide, run, observe).

    ``pipelined`` follows the pipelined engine (``EngineConfig.pipeline``): round ``r``'s
    feedback reaches ``policy.observe`` only after ``decide`` planned round ``r + 1`` (the live
    loop collects round ``r`` after it queued ``r + 1``), so a decision sees rounds ``r - 2``
    and earlier; the last round's feedback is observed at the end. False: observed right after
    its round (the synchronous engine).

    Round traces: round ``r`` of the trace is the batch of round ``r``; accepted length under the
    plan is ``min(accepted_full, verify_tokens or k)``. Token traces: every request starts in the
    first round, advances by ``a + 1`` positions per round and leaves when it runs past its
    last recorded position (exact counterfactual greedy replay).
    """
    rec: dict[str, list] = {
        f: []
        for f in ("k", "g", "tokens", "accepted", "verified", "cost_ms", "b", "phase", "reason")
    }

    def step(
        r: int, acc_full: np.ndarray, scores: np.ndarray | None, kv: float, phase: int,
        decide_kv: float | None = None, kv_max: float | None = None,
    ) -> np.ndarray:
        # decide on the KV the plan saw (decide_kv), price at the round's own KV (kv; plus the
        # spread term where its longest request's KV, kv_max, is known)
        nb = acc_full.size
        d = policy.decide(BatchState(round_index=r, num_requests=nb,
                                     kv_length=kv if decide_kv is None else decide_kv))
        if d.verify_tokens is not None:
            v = np.asarray(d.verify_tokens, dtype=np.int64)
        elif cost.mode == "target_verify" and scores is not None:
            # The device step: prefix-closed allocation of the current scores inside g.
            v = allocate_prefixes(scores, d.g - nb)
        else:
            v = np.full(nb, d.k, dtype=np.int64)
        a = np.minimum(acc_full, v)
        bcap = int(cost.bcap(nb))
        rec["k"].append(d.k)
        rec["g"].append(d.g)
        rec["tokens"].append(float(a.sum() + nb))
        rec["accepted"].append(float(a.sum()))
        rec["verified"].append(float(v.sum()))
        rec["cost_ms"].append(float(cost.price(bcap, d.g, kv, d.k, kv_max)))
        rec["b"].append(nb)
        rec["phase"].append(phase)
        rec["reason"].append(d.reason)
        fb = Feedback(
            round_index=r,
            k=d.k,
            accepted=np.minimum(a, d.k),
            draft_scores=None if scores is None else scores[:, : d.k],
            verify_tokens=v,
        )
        if pipelined:  # observe the previous round now, this one after the next decision
            if held:
                policy.observe(held.pop())
            held.append(fb)
        else:
            policy.observe(fb)
        return a

    held: list[Feedback] = []  # pipelined: the round collected after the next decision

    if isinstance(trace, RoundTrace):
        cu = trace.cu_requests
        n = trace.num_rounds if max_rounds is None else min(max_rounds, trace.num_rounds)
        plan_kv = trace.decision_kv  # what the live plan saw, where the trace recorded it
        kv_max = trace.kv_max_length
        for r in range(n):
            sl = slice(cu[r], cu[r + 1])
            sc = (
                None
                if trace.draft_scores is None
                else np.nan_to_num(trace.draft_scores[sl].astype(np.float64))
            )
            step(r, trace.accepted[sl], sc, float(trace.kv_length[r]), int(trace.phase[r]),
                 float(plan_kv[r]), None if kv_max is None else float(kv_max[r]))
    else:
        match = trace.match_length
        ids, starts, lengths = np.unique(trace.request, return_index=True, return_counts=True)
        at = np.zeros(ids.size, dtype=np.int64)
        r = 0
        while True:
            live = np.flatnonzero(at < lengths)
            if live.size == 0 or (max_rounds is not None and r >= max_rounds):
                break
            row = starts[live] + at[live]
            sc = None if trace.draft_scores is None else trace.draft_scores[row].astype(np.float64)
            a = step(r, match[row], sc, float(trace.kv_length[row].mean()), 0)
            at[live] += a + 1
            r += 1
    if held:  # the pipeline's last collection
        policy.observe(held.pop())
    reasons: dict[str, int] = {}
    for x in rec["reason"]:
        reasons[x] = reasons.get(x, 0) + 1
    return PolicyRun(
        name=getattr(policy, "name", "policy"),
        kind=getattr(policy, "name", "policy").split(":")[0],
        k=np.asarray(rec["k"], dtype=np.int64),
        g=np.asarray(rec["g"], dtype=np.int64),
        tokens=np.asarray(rec["tokens"]),
        accepted=np.asarray(rec["accepted"]),
        verified=np.asarray(rec["verified"]),
        cost_ms=np.asarray(rec["cost_ms"]),
        num_requests=np.asarray(rec["b"], dtype=np.int64),
        phase=np.asarray(rec["phase"], dtype=np.int64),
        reasons=reasons,
    )


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class ReplayReport:
    """Result of :func:`replay`: every run plus the derived comparison."""

    runs: list[PolicyRun]
    best_fixed: str
    phase_choice: dict[int, str]
    phase_names: list[str]
    mode: str
    draft_width: int
    trace_meta: dict[str, Any]
    config: ReplayConfig
    elapsed_s: float = 0.0
    kv_spread: dict[str, float] | None = None  # RoundTrace.kv_spread of the replayed trace
    spread_priced: bool = False  # rounds carry the table's KV spread term (CostModel.spread)

    def run(self, name: str) -> PolicyRun:
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        best = self.run(self.best_fixed).totals()["tokens_per_s"]
        policies = []
        for r in self.runs:
            t = r.totals() if r.priced else {}
            segs, dropped = r.timeline(self.config.max_segments)
            phases = {}
            for ph in np.unique(r.phase):
                name = self.phase_names[ph] if ph < len(self.phase_names) else str(int(ph))
                phases[name] = _clean(r.totals(r.phase == ph)) if r.priced else None
            policies.append(
                {
                    "name": r.name,
                    "kind": r.kind,
                    "priced": r.priced,
                    "rounds": int(r.cost_ms.size),
                    "rounds_priced": int(np.count_nonzero(np.isfinite(r.cost_ms) & (r.cost_ms > 0))),
                    **{k: _f(v) for k, v in t.items()},
                    "gain_vs_best_fixed_pct": _f(100.0 * (t["tokens_per_s"] / best - 1.0))
                    if t
                    else None,
                    "tokens_per_s_at_longest_kv": _at_longest(r) if r.priced else None,
                    "mean_k": float(np.mean(r.k)),
                    "mean_g": float(np.mean(r.g)),
                    "switches": int(np.count_nonzero(np.diff(r.k)))
                    if r.kind != "adaptive-verify"
                    else int(np.count_nonzero(np.diff(r.g))),
                    "reasons": r.reasons,
                    "per_phase": phases,
                    "timeline": segs,
                    "timeline_dropped_segments": dropped,
                }
            )
        return {
            "mode": self.mode,
            "draft_width": self.draft_width,
            "rounds": int(self.runs[0].k.size),
            "best_fixed": self.best_fixed,
            "oracle_per_phase": {
                self.phase_names[p] if p < len(self.phase_names) else str(p): n
                for p, n in self.phase_choice.items()
            },
            "policies": policies,
            "trace": self.trace_meta,
            "config": {
                "policies": list(self.config.policies),
                "window_size": self.config.step.window_size,
                "update_interval": self.config.step.update_interval,
                "switch_min_gain": self.config.step.switch_min_gain,
                "verify_window_size": self.config.verify.window_size,
                "feedback_lag": self.config.verify.feedback_lag,
                "pipelined": self.config.pipelined
                or bool(self.trace_meta.get("pipelined", False)),
            },
            "kv_spread": self.kv_spread,
            "spread_priced": self.spread_priced,
            "elapsed_s": round(self.elapsed_s, 4),
        }


def price_at_kv(run: PolicyRun, cost: CostModel, kv_length: np.ndarray) -> np.ndarray:
    """``[R]`` the cost of ``run``'s decisions (its ``k`` and ``G`` per round) at other KV
    lengths: at each round's longest request (``RoundTrace.kv_max_length``) it prices the
    round as if every request were that long, an upper bound on its cost where the KV spreads
    (the table prices the mean: a lower one in every spread layout measured)."""
    bcap = cost.bcap(run.num_requests)
    k = run.k if cost.mode == "draft_step" else None
    return np.asarray(cost.lookup(bcap, run.g, np.asarray(kv_length, dtype=np.float64), k),
                      dtype=np.float64)


def _at_longest(run: PolicyRun) -> float | None:
    """tokens/s of ``run`` priced at each round's longest KV; None where any round is
    unpriced there (past the table's KV span) or it was not recorded."""
    c = run.cost_ms_at_longest
    if c is None or c.size == 0 or not bool((np.isfinite(c) & (c > 0)).all()):
        return None
    return _f(1000.0 * float(np.sum(run.tokens)) / float(np.sum(c)))


def _f(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _clean(d: dict[str, float]) -> dict[str, float | None]:
    return {k: _f(v) for k, v in d.items()}


def replay(
    trace: RoundTrace | TokenTrace,
    cost: CostModel,
    config: ReplayConfig | None = None,
    *,
    on_step: Callable[[str], None] | None = None,
) -> ReplayReport:
    """Replay the configured policies, every fixed ``k`` and the per-phase oracle.

    Round traces use the vectorised engine; token traces the sequential one (live objects).
    Pipelined feedback (``config.pipelined``, or a trace recorded on a pipelined engine): the
    adaptive draft step runs its live object sequentially with the pipeline's lag
    (:func:`run_sequential` with ``pipelined=True``); adaptive verify is unchanged (it decides
    from rounds ``r - 2`` and earlier either way).
    Raises ``InputError`` / ``UnsupportedError`` before simulating anything (see
    :func:`check_replayable`).
    """
    cfg = config or ReplayConfig()
    if cfg.step is None:
        cfg = replace(cfg, step=cost.step_config or AdaptiveStepConfig())
    specs = [parse_policy(p) for p in cfg.policies]
    check_replayable(trace, cost, specs)
    pipelined = cfg.pipelined or bool(trace.meta.get("pipelined", False))
    t0 = time.perf_counter()
    w = cost.draft_width
    note = on_step or (lambda _s: None)
    if isinstance(trace, RoundTrace):
        H = trace.survival_counts()
        extra = _spread_extra(trace, cost)  # [R], once: every vectorised run adds it
        note("fixed baselines")
        fixed = _fixed_runs(trace, cost, H, extra)
        runs = []
        for p in specs:
            note(p.text)
            if p.kind == "adaptive-step" and pipelined:
                # the pipeline's extra round of lag: the live policy object, sequentially
                policy = make_policy(p, cost, step_config=cfg.step, verify_config=cfg.verify)
                runs.append(run_sequential(trace, cost, policy, pipelined=True))
            elif p.kind == "adaptive-step":
                runs.append(_adaptive_step_run(trace, cost, H, cfg.step, extra))
            elif p.kind == "adaptive-verify":
                # decides from rounds <= r - feedback_lag (>= 2): the same under the pipeline
                runs.append(_adaptive_verify_run(trace, cost, cfg.verify, extra))
        phase = trace.phase
    else:
        fixed = []
        for k in range(1, w + 1):
            note(f"fixed:{k}")
            fixed.append(run_sequential(trace, cost, make_policy(f"fixed:{k}", cost)))
        runs = []
        for p in specs:
            if p.kind != "fixed":
                note(p.text)
                runs.append(
                    run_sequential(
                        trace,
                        cost,
                        make_policy(p, cost, step_config=cfg.step, verify_config=cfg.verify),
                        pipelined=pipelined,
                    )
                )
        phase = np.zeros(1, dtype=np.int64)
    priced = [r for r in fixed if r.priced]  # finite, positive costs and tokens/s only
    if not priced:
        raise InputError(
            "table",
            "no fixed k priced on every round (finite, positive cost and tokens/s)",
            "a table covering the trace's buckets and KV lengths",
        )
    best = max(priced, key=lambda r: r.totals()["tokens_per_s"])
    if isinstance(trace, RoundTrace):
        oracle, choice = _phase_oracle(fixed, phase)
        all_runs = runs + [oracle] + fixed
        if trace.kv_max_length is not None:
            for r in all_runs:
                r.cost_ms_at_longest = price_at_kv(r, cost, trace.kv_max_length)
    else:
        choice = {0: best.name}
        all_runs = runs + fixed
    names = list(trace.meta.get("phases", [])) or ["all"]
    return ReplayReport(
        runs=all_runs,
        best_fixed=best.name,
        phase_choice=choice,
        phase_names=names,
        mode=cost.mode,
        draft_width=w,
        trace_meta=dict(trace.meta),
        config=cfg,
        elapsed_s=time.perf_counter() - t0,
        kv_spread=trace.kv_spread() if isinstance(trace, RoundTrace) else None,
        spread_priced=isinstance(trace, RoundTrace) and trace.kv_max_length is not None
        and cost.spread is not None,
    )
