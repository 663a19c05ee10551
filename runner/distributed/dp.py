"""Data-parallel replicas that agree on one physical target bucket per round.

This module owns the round-boundary agreement of DP replicas: before each round every rank
publishes a small :class:`ReplicaState` (batch size after admission, its Bcap, mean KV length,
whether work is left, and the *lagged* feedback of the last round it collected); one host-side
``all_gather_object`` gives every rank the same list, and :func:`agree_round` (pure, the same
on every rank) turns it into one :class:`AgreedRound`: the draft steps ``k`` and a physical
target bucket ``G`` common to every replica's Bcap. Each replica then runs its own round with
``RoundPlan(verify_budget=G)``: its own verify allocation, made on its device from its own
draft scores inside ``G`` rows. There is no collective between draft and target inside a
round, and no device read-back beyond the collect each engine already does.

The rule (documented, deterministic): ``v = min(w, ceil(a) + 1)`` verify rows per request from
the pooled lagged acceptance ``a`` (accepted tokens per request over every replica's last
collected round; ``w`` before any feedback), each replica wanting ``n_r (v + 1)`` rows; ``G`` is
the smallest bucket common to every active replica's bucket set that holds the largest want,
else the largest common bucket. When the replicas' Bcaps share no bucket (``target_rows``
without a common size), each takes its own ``g_for`` and the round is recorded as not common.
TP ranks of one replica publish identical states; the replica is represented by its TP rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from speccal.base.geometry import Geometry
from speccal.runner.distributed.comm import Comm
from speccal.runner.engine import Engine, RoundPlan, RoundResult
from speccal.runner.sampling import SamplingParams


@dataclass(frozen=True)
class ReplicaState:
    """What one replica publishes at a round boundary (host values only)."""

    dp_rank: int
    num_requests: int
    bcap: int  # geometry.bcap_for(num_requests); 0 when the batch is empty
    kv_length: float
    has_unfinished: bool
    lag_requests: int  # requests in the last collected round (0: no feedback yet)
    lag_accepted: int  # accepted draft tokens in it


@dataclass(frozen=True)
class AgreedRound:
    """The round every replica runs: ``k`` draft steps, target bucket ``g`` (0: idle replica),
    per replica, and whether one bucket served them all."""

    k: int
    g: tuple[int, ...]  # per DP rank
    common: bool
    verify_rows: int  # v + 1, the rows per request the rule asked for


def agree_round(states: Sequence[ReplicaState], geometry: Geometry, *, speculative: bool
                ) -> AgreedRound:
    """The rule of the module docstring over every replica's state (DP-rank order)."""
    w = geometry.draft_width
    k = w if speculative else 0
    reqs = sum(s.lag_requests for s in states)
    acc = sum(s.lag_accepted for s in states)
    v = 0 if not speculative else (w if reqs == 0 else min(w, math.ceil(acc / reqs) + 1))
    active = [s for s in states if s.num_requests > 0]
    if not active:
        return AgreedRound(k, tuple(0 for _ in states), True, v + 1)
    sets = [set(geometry.target_rows[s.bcap]) for s in active]
    common = sorted(set.intersection(*sets))
    want = max(s.num_requests * (v + 1) for s in active)
    if common:
        fits = [g for g in common if g >= want]
        g = fits[0] if fits else common[-1]
        return AgreedRound(k, tuple(g if s.num_requests else 0 for s in states), True, v + 1)
    own = tuple(geometry.g_for(s.bcap, s.num_requests * (v + 1)) or 0 if s.num_requests else 0
                for s in states)
    return AgreedRound(k, own, False, v + 1)


class DataParallelRunner:
    """Drives one rank's engine in step with the other DP replicas (module docstring).

    ``engine`` is this rank's (``DistributedEngine`` or any ``Engine``); ``comm`` the run's.
    Every rank of the world calls :meth:`step` the same number of times (:meth:`generate`
    loops until no replica has work left).
    """

    def __init__(self, engine: Engine, comm: Comm):
        self.engine = engine
        self.comm = comm
        self.rounds: list[AgreedRound] = []  # every agreed round, in order
        self.physical: list[int] = []  # the G this replica's engine ran in each (0: idle)
        self._lag = (0, 0)  # (requests, accepted) of the last collected round

    def state(self) -> ReplicaState:
        """This replica's state after admitting and prefilling waiting requests."""
        eng = self.engine
        ids = eng.running_ids()
        if eng.config.pipeline:  # the engine sits out requests its queued rounds surely finish
            ids = [r for r in ids if len(eng.requests[r].output) + eng.requests[r].num_inflight
                   < eng.requests[r].params.max_tokens]
        n = len(ids)
        kv = eng.kv_lengths()
        return ReplicaState(
            dp_rank=self.comm.dp_rank, num_requests=n,
            bcap=(eng.geometry.bcap_for(n) or 0) if n else 0,
            kv_length=float(kv.mean()) if kv.size else 0.0,
            has_unfinished=eng.has_unfinished(),
            lag_requests=self._lag[0], lag_accepted=self._lag[1],
        )

    def exchange(self) -> list[ReplicaState]:
        """Every replica's state, in DP-rank order (one host-side gather over the world)."""
        mine = self.state()
        seen = self.comm.all_gather_object(mine)
        tp = self.comm.tp_size
        return [seen[d * tp] for d in range(self.comm.dp_size)]

    def step(self) -> tuple[RoundResult | None, bool]:
        """Admit + prefill, agree on the round, run it. Returns ``(result, more)``: the round's
        result (None when this replica was idle) and whether any replica has work left."""
        eng = self.engine
        first = eng.prefill_pending()
        states = self.exchange()
        if not any(s.has_unfinished for s in states):
            return None, False
        agreed = agree_round(states, eng.geometry, speculative=eng.config.speculative)
        self.rounds.append(agreed)
        g = agreed.g[self.comm.dp_rank]
        if g == 0 and not eng.has_unfinished():
            self.physical.append(0)
            return None, True
        if agreed.k == 0 or g == 0:
            plan = RoundPlan(agreed.k)
        else:
            plan = RoundPlan(agreed.k, verify_budget=g)
        res = eng.step(plan)
        self.physical.append(int(res.g) if res.num_requests else 0)
        if res.num_requests:
            self._lag = (int(res.num_requests), int(np.asarray(res.accepted).sum()))
        if first:  # prefilled before the step: report their first tokens with it
            emitted = [([first[r]] if r in first else []) + list(e)
                       for r, e in zip(res.request_ids, res.emitted, strict=True)]
            res = replace(res, emitted=emitted, first_tokens={**first, **res.first_tokens})
        return res, True

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams
                 ) -> list[list[int]]:
        """Run this replica's ``prompts`` to completion in step with the others; returns each
        request's generated tokens (a replica may have no prompts)."""
        eng = self.engine
        rids = [eng.add_request(p, params) for p in prompts]
        while True:
            _, more = self.step()
            if not more:
                break
        eng.drain()  # nothing is queued once no replica has work; kept for safety
        out = [list(eng.requests[r].output) for r in rids]
        for r in rids:
            eng.release(r)
        return out
