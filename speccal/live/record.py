"""Recording acceptance traces with the embedded runner (``speccal trace``).

This module owns :func:`record_trace`: full-width rounds over random prompts, recorded as a
round trace (every round's accepted lengths, draft scores, KV lengths and the mean KV its plan
saw, as :func:`speccal.live.policies.run_live` records them), and for a token trace one more
full-width round from every position of every output (the match length at each position).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from speccal.base.errors import InputError
from speccal.base.run_spec import RunSpec
from speccal.live.bench import workload_prompts
from speccal.runner.engine import Engine, EngineConfig, RoundPlan, RoundState
from speccal.runner.engine_config import from_spec
from speccal.runner.sampling import SamplingParams
from speccal.trace import RoundTrace, RoundTraceBuilder, TokenTrace, TokenTraceBuilder


@dataclass(frozen=True)
class TraceRecording:
    """What ``speccal trace`` records (``kind``: ``rounds`` or ``tokens``)."""

    kind: str
    model: str
    device: str
    dtype: str | None
    draft_width: int
    num_requests: int
    prompt_len: int
    max_tokens: int
    acceptance: str
    acceptance_profile: tuple[float, ...] | None
    seed: int

    def __post_init__(self) -> None:
        if self.kind not in ("rounds", "tokens"):
            raise InputError("--kind", self.kind, "rounds or tokens")
        if self.kind == "tokens" and self.acceptance != "greedy":
            raise InputError("--acceptance", self.acceptance,
                             "greedy for --kind tokens (the matrix is only exact for greedy)")

    @property
    def request_buckets(self) -> tuple[int, ...]:
        return tuple(sorted({1, 2, 4, 8, self.num_requests}))

    def engine_config(self) -> EngineConfig:
        return from_spec(RunSpec(
            model=self.model, device=self.device, dtype=self.dtype,
            draft_width=self.draft_width, request_buckets=self.request_buckets,
            acceptance=self.acceptance, acceptance_profile=self.acceptance_profile,
            seed=self.seed, loop="synchronous"))


Progress = Callable[[str, str, int | None], Any]  # (phase, unit, total) -> a reporter context


def record_trace(rec: TraceRecording, progress: Progress) -> tuple[RoundTrace | TokenTrace,
                                                                  RoundTrace | None]:
    """``(trace, round trace)``: for ``rounds`` the round trace and None; for ``tokens`` the
    token trace and the round trace of the full-width run it drafted from.

    ``progress(phase, unit, total)`` returns a context manager with ``update(advance=n)``
    (``speccal.base.progress.ProgressReporter``)."""
    eng = Engine(rec.engine_config())
    w = rec.draft_width
    prompts = workload_prompts(eng.loaded.config.vocab_size, rec.num_requests, rec.prompt_len,
                               rec.seed)
    meta = {
        "source": "runner",
        "compatibility": eng.compatibility(),
        "num_requests": rec.num_requests,
        "prompt_len": rec.prompt_len,
        "max_tokens": rec.max_tokens,
        "seed": rec.seed,
        "phases": ["run"],
    }
    rounds = RoundTraceBuilder(w)
    outputs: dict[int, list[int]] = {}
    params = SamplingParams(max_tokens=rec.max_tokens, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in prompts]
    plan_kv: dict[int, float] = {}  # round index -> the mean KV its plan saw

    def full_width(state: RoundState) -> RoundPlan:
        plan_kv[state.round_index] = float(state.kv_length)
        return RoundPlan(num_draft_steps=w)

    with progress("recording rounds", "rounds", None) as prog:
        while eng.has_unfinished():
            res = eng.step(full_width)
            for rid, toks in zip(res.request_ids, res.emitted, strict=True):
                outputs.setdefault(rid, []).extend(toks)
            for rid, tok in res.first_tokens.items():
                if rid not in res.request_ids:
                    outputs.setdefault(rid, []).append(tok)
            rounds.add(res.k, res.accepted, res.draft_scores, res.kv_lengths,
                       plan_kv.pop(res.round_index, None))
            prog.update(advance=1)
    if rec.kind == "rounds":
        return rounds.build(meta), None
    # Drafting from every position t: a request whose prompt is prompt + y[:t] prefills y[t] and
    # runs one full-width round from there, whose accepted length is the match length at t.
    # Positions 0 .. len(y) - 2 are the ones a round can start from (the last token ends the run).
    tokens = TokenTraceBuilder(w)
    jobs = [(i, t) for i, rid in enumerate(rids) for t in range(len(outputs[rid]) - 1)]
    cap = max(rec.request_buckets)
    with progress("drafting from every position", "positions", len(jobs)) as prog:
        for j0 in range(0, len(jobs), cap):
            batch = jobs[j0 : j0 + cap]
            ids = {}
            for i, t in batch:
                y = outputs[rids[i]]
                ids[eng.add_request(prompts[i] + y[:t],
                                    SamplingParams(max_tokens=w + 2, ignore_eos=True))] = (i, t)
            res = eng.step(RoundPlan(num_draft_steps=w))
            for b, rid in enumerate(res.request_ids):
                i, t = ids[rid]
                tokens.add(i, t, rec.prompt_len + t + 1, int(res.accepted[b]),
                           res.draft_scores[b])
            eng.reset()
            prog.update(advance=len(batch))
    meta["round_trace_rounds"] = len(rounds)
    return tokens.build(meta), rounds.build(meta)
