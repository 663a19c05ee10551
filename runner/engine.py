"""The embedded speculative-decoding engine: requests in, rounds out.

This module owns :class:`Engine`, the API calibration and the CLI drive (see
docs/ARCHITECTURE.md), and re-exports what it takes and returns (:class:`EngineConfig`,
``runner/engine_config.py``; :class:`RoundPlan`, :class:`RoundResult`, ``runner/results.py``);
how it is built and what it reports is :class:`~speccal.runner.engine_build.EngineBuild`. ``Engine.step`` prefills newly admitted requests (chunked), then queues one
round over the running batch through :class:`~speccal.runner.round.RoundRunner`
(prepare -> execute) and collects rounds (collect, stop rules on the host) until at most
:attr:`Engine.queue_depth` stay queued.

Batching: at most ``max(request_buckets)`` requests run at once (others wait, admitted in
arrival order as slots free up); the physical batch is ``geometry.bcap_for(B)``; target rows are
``sum(verify + 1)`` padded to ``geometry.g_for(bcap, rows)``, or, under
``RoundPlan.verify_budget``, the budget's bucket ``G`` with the verify lengths allocated on the
device from the round's own draft scores (see :class:`RoundPlan`).

One loop, two queue depths: 0 (the synchronous loop, the default) collects each round in the
step that queued it; 1 (``EngineConfig.pipeline=True``, the pipelined loop) queues round
``n + 1`` before it collects round ``n`` and returns round ``n``'s result (one step late;
``Engine.drain`` collects what is still queued). Stop rules are
discovered one round late: a finished request's row in the extra round is discarded
(``RoundResult.num_discarded``; ``RoundResult.physical`` keeps what the device computed for it),
and its KV blocks and slot are freed once no queued round writes them. See :meth:`Engine.step`.

Hybrid linear-attention targets (``ModelCapabilities.has_recurrent_state``: Qwen3.5 /
Qwen3-Next, recognised by their config's ``layer_types``): the KV cache holds only their
full-attention layers (``LoadedModel.num_kv_layers``) and the head's; each slot also owns
recurrent state rows kept consistent under rejected drafts by ``EngineConfig.state_strategy``
(``speccal.runner.hybrid_state``), whose prefill fills them. ``RoundResult.state_bytes`` is
the state traffic of the round's shape; the strategy is part of :meth:`Engine.compatibility`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from speccal.base.errors import CapacityError, InputError, UnsupportedError
from speccal.runner.device import synchronize
from speccal.runner.engine_build import EngineBuild

# re-exported: the engine's API in one import (``from speccal.runner.engine import ...``)
from speccal.runner.engine_config import (  # noqa: F401 (ACCEPTANCE_MODES: re-exported)
    ACCEPTANCE_MODES,
    EngineConfig,
)
from speccal.runner.moe import RoutedMoE, round_counts, routed_modules
from speccal.runner.prefill import prefill
from speccal.runner.prompt_source import PromptSource
from speccal.runner.request import Request
from speccal.runner.results import (
    PlanFn,
    RoundPlan,
    RoundResult,
    RoundState,
    check_plan,
    round_shape,
)
from speccal.runner.round import RoundInputs
from speccal.runner.sampling import SamplingParams, check_supported
from speccal.runner.stats import SpecStats

__all__ = ["Engine", "EngineConfig", "PlanFn", "RoundPlan", "RoundResult", "RoundState"]


class Engine(EngineBuild):
    """Target model + MTP head + paged KV + batch of requests. See the module docstring; its
    construction and description live in :class:`~speccal.runner.engine_build.EngineBuild`."""

    def _init_requests(self, max_bucket: int) -> None:
        """The request lifecycle's state, empty (called by the build, before a warm-up prefill)."""
        w = self.config.draft_width
        self.stats = SpecStats(w)
        self._ids = itertools.count()
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._free_slots = list(range(max_bucket - 1, -1, -1))
        self.requests: dict[int, Request] = {}
        self._early_finished: list[int] = []
        self._round_index = 0
        self._inflight: list[_Flight] = []  # queued rounds not yet collected, oldest first
        self.prompt_source: PromptSource | None = None
        # routed-expert layers: the target's are counted per round, the head's only reset
        self._routed: list[RoutedMoE] = routed_modules(self.loaded.target)
        self._routed_all = self._routed + (routed_modules(self.loaded.draft)
                                           if self.loaded.draft is not None else [])
        for m in self._routed_all:  # the captures' warm-up forwards activated no request's
            m.take_activated()

    def running_ids(self) -> list[int]:
        return [r.rid for r in self._running]

    def kv_lengths(self) -> np.ndarray:
        """KV length (tokens in the target cache) of each running request, in :meth:`running_ids` order."""
        return np.array([r.num_computed for r in self._running], dtype=np.int64)

    @property
    def num_free_kv_tokens(self) -> int:
        return self.kv.allocator.num_free * self.kv.allocator.block_size

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or (pipelined) a queued round not yet collected."""
        return bool(self._waiting or self._running or self._inflight)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Refuses bad ids, unsupported options, impossible sizes."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InputError("params", params, "a SamplingParams")
        check_supported(params)
        if self.config.acceptance == "greedy" and not params.is_greedy:
            raise UnsupportedError(
                f"temperature={params.temperature}: acceptance='greedy' verifies greedily; use acceptance='sample'"
            )
        prompt = [int(t) for t in prompt_ids]
        vocab = self.loaded.config.vocab_size
        if not prompt:
            raise InputError("prompt_ids", prompt, "at least one token id")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InputError("prompt_ids", bad[:5], f"token ids in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise InputError(
                "prompt length + max_tokens", total, f"<= max_model_len={self.max_model_len}"
            )
        need = total + self.config.draft_width + 1 + self._lag_slots
        if need > self.geometry.kv_capacity_tokens:
            raise CapacityError(
                f"request needs up to {need} KV slots but the cache holds {self.geometry.kv_capacity_tokens}; "
                "raise kv_capacity_tokens"
            )
        rid = next(self._ids)
        req = Request(rid, prompt, params, eos_token_ids=self.loaded.config.eos_token_ids)
        self.requests[rid] = req
        self._waiting.append(req)
        return rid

    def _finish(self, req: Request) -> None:
        self.kv.allocator.free(req.blocks)
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1
        if req in self._running:
            self._running.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)

    def release(self, rid: int) -> None:
        """Drop a request (running or waiting) and free its KV blocks and slot."""
        req = self.requests.pop(rid, None)
        if req is None:
            raise InputError(
                "request id", rid, f"one of the engine's requests {sorted(self.requests)[:8]}"
            )
        if req.finish_reason is None:
            req.finish_reason = "released"
        if req.num_inflight:  # a queued round still writes its KV and slot: freed at collect
            if req in self._running:
                self._running.remove(req)
            return
        self._finish(req)

    def reset(self) -> None:
        """Release every request (the KV cache and slots become free); pipelined engines drain
        their queued rounds first (results dropped)."""
        self.drain()
        for rid in list(self.requests):
            self.release(rid)
        self.kv.allocator.sort_free()  # a fresh batch's block layout does not depend on history
        self._early_finished = []
        self._round_index = 0
        self.stats = SpecStats(self.config.draft_width)
        if self.runner.state is not None:
            self.runner.state.reset_traffic()

    def set_acceptance_profile(self, profile: Sequence[float]) -> None:
        """``synthetic`` only: replace the per-position acceptance profile (``w`` values) in place
        (phase changes of a synthetic workload)."""
        if self.config.acceptance != "synthetic":
            raise UnsupportedError(
                f"set_acceptance_profile: acceptance={self.config.acceptance!r} (needs 'synthetic')"
            )
        w = self.config.draft_width
        vals = [float(p) for p in profile]
        if len(vals) != w or not all(0.0 <= p <= 1.0 for p in vals):
            raise InputError("acceptance_profile", list(profile), f"{w} probabilities in [0, 1]")
        self.runner.profile.copy_(torch.tensor(vals, dtype=torch.float32))

    @property
    def round_index(self) -> int:
        """Index the next round over a non-empty batch will get."""
        return self._round_index

    def synchronize(self) -> None:
        synchronize(self.device)

    # ------------------------------------------------------------------ the step

    def prefill_pending(self) -> dict[int, int]:
        """Admit waiting requests into free slots and prefill them now; returns their first tokens.

        :meth:`step` does this itself; calling it first separates prefill from round timing.
        """
        first: dict[int, int] = {}
        _, finished = self._admit(first)
        self._early_finished.extend(finished)
        return first

    def _admit(self, result_first: dict[int, int]) -> tuple[int, list[int]]:
        admitted = []
        while self._waiting and self._free_slots:
            req = self._waiting.pop(0)
            req.slot = self._free_slots.pop()
            self._running.append(req)
            admitted.append(req)
        src = self.prompt_source
        copied = [r for r in admitted if src is not None and src.covers(r.prompt)]
        filled = dict(zip((r.rid for r in copied),
                          src.admit(copied, self.runner.target, self.kv, self.generator,
                                    self.device, self.runner.state) if copied else [],
                          strict=True))
        num_tokens = 0
        finished = []
        for req in admitted:
            if req.rid in filled:
                tok, hidden = filled[req.rid]
            else:
                # a hybrid target's prefill also fills the slot's state rows
                fill = prefill if self.runner.state is None else self.runner.state.prefill
                tok, hidden = fill(
                    req,
                    self.runner.target,
                    self.runner.draft,
                    self.kv,
                    chunk=self.config.prefill_chunk,
                    generator=self.generator,
                    device=self.device,
                )
            num_tokens += len(req.prompt)
            result_first[req.rid] = tok
            self.runner.set_slot(req, tok, hidden)
            req.append([tok])
            if req.is_finished:
                finished.append(req.rid)
                self._finish(req)
        return num_tokens, finished

    def _resolve(self, plan: RoundPlan | PlanFn, batch: list[Request]) -> tuple[RoundPlan, int, np.ndarray | None]:
        """The round's plan (callback called for a non-empty batch) and its ``(k, verify [B])``."""
        n = len(batch)
        if callable(plan):
            if n == 0:
                plan = RoundPlan(self.config.draft_width if self.config.speculative else 0)
            else:
                kv = float(np.mean([r.num_computed for r in batch]))
                state = RoundState(round_index=self._round_index, num_requests=n,
                                   kv_length=kv, request_ids=tuple(r.rid for r in batch))
                plan = plan(state)
                if not isinstance(plan, RoundPlan):
                    raise InputError("plan callback result", plan, "a RoundPlan")
        k, nv = check_plan(plan, n, draft_width=self.config.draft_width,
                           speculative=self.config.speculative)
        return plan, k, nv

    @staticmethod
    def _empty_result(k: int, first: dict[int, int], finished: list[int], num_prefill: int) -> RoundResult:
        # keyword-only (RoundResult is kw_only): this empty result was once built by position
        # and shifted three fields (kv_lengths got the accept matrix, num_prefill_tokens an
        # array, state_bytes the prefill count)
        empty = np.zeros(0, dtype=np.int64)
        return RoundResult(
            num_requests=0, bcap=0, g=0, k=k, request_ids=[], accepted=empty,
            num_verify=empty, emitted=[[first[r]] for r in first], finished=finished,
            draft_scores=np.zeros((0, k), np.float32), kv_lengths=empty,
            num_prefill_tokens=num_prefill, first_tokens=first,
        )

    @property
    def queue_depth(self) -> int:
        """Rounds left queued, not collected, when :meth:`step` returns: 0 (the synchronous
        loop: a round is collected before the next is prepared) or 1 (``EngineConfig.pipeline``:
        round ``n + 1`` is queued before round ``n`` is collected; two staging slots)."""
        return 1 if self.config.pipeline else 0

    def step(self, plan: RoundPlan | PlanFn) -> RoundResult:
        """Admit and prefill waiting requests, queue one round over the running batch, then
        collect rounds until at most :attr:`queue_depth` stay queued; return the oldest
        collected round's result (depth 0: this step's round).

        ``plan`` is a :class:`RoundPlan` or a callback ``plan(RoundState) -> RoundPlan`` called
        after admission (so a policy sees the round's batch size and mean KV length); it is not
        called when the batch is empty.

        Order: admit + prefill waiting requests into free slots; plan the round over the
        running batch (every request not yet *known* finished; at depth 1 stop rules are
        discovered one round late, when its round is collected, except a request whose queued
        rounds surely reach ``max_tokens``, one token each at least, which sits the round out)
        and queue it (host facts staged into a staging slot, metadata derived on the device
        from the per-slot state, results copied to pinned memory at its end); then collect
        (wait for the oldest queued round's result copy, stop rules, bookkeeping).

        Depth 1: results are reported one step late. The first call after an idle pipeline
        returns an empty result (``round_index == -1``, ``num_requests == 0``, prefill facts
        only when no round was queued). A round's first tokens / prefill-finished ids are those
        of the requests admitted just before it was queued. Rows of requests that finished in
        an earlier round (the extra round a lagged stop costs, or a request released while
        queued) are dropped from the result: arrays, ``request_ids`` and ``emitted`` hold the
        live rows only; ``num_discarded`` counts the others; their tokens are never appended.
        A finished request's KV blocks and slot are freed once no queued round writes them
        (``Request.num_inflight == 0``), so a slot is reused only after that. The plan callback
        sees ``RoundState.kv_length`` as of the collected rounds (lagged by the round in
        flight); adaptive policies get feedback with the pipeline's lag. A prefill (admission)
        runs on the same stream behind the queued round and reads its first token back, so it
        waits for that round.
        """
        first: dict[int, int] = {}
        num_prefill, finished = self._admit(first)
        finished = self._early_finished + finished
        self._early_finished = []
        # a request whose queued rounds surely reach max_tokens (each emits >= 1 token) sits
        # this round out: no wasted row for a length stop the host can foresee
        batch = [r for r in self._running
                 if len(r.output) + r.num_inflight < r.params.max_tokens]
        n = len(batch)
        plan, k, nv = self._resolve(plan, batch)
        if n > 0:
            bcap, g, budget_rows = round_shape(plan, n, k, nv, self.geometry)
            bound = np.array(
                [r.num_computed + sum(f.k + 1 for f in self._inflight if r.rid in f.rids)
                 for r in batch],
                dtype=np.int64,
            )
            x = self.runner.prepare(batch, bcap, k, nv, g, budget_rows, bound)
            for m in self._routed_all:  # the round's own experts, not the prefill's
                m.begin_round()
            self.runner.execute(x)
            experts = round_counts(self._routed) if self._routed else None
            for r in batch:
                r.num_inflight += 1
            self._inflight.append(
                _Flight(x=x, batch=batch, first=first, finished=finished, num_prefill=num_prefill,
                        round_index=self._round_index, g=g, experts=experts))
            self._round_index += 1
            first, finished, num_prefill = {}, [], 0
        res = None
        if len(self._inflight) > self.queue_depth or (n == 0 and self._inflight):
            res = self._collect(self._inflight.pop(0))
        if res is None:
            return self._empty_result(k, first, finished, num_prefill)
        res.first_tokens.update(first)
        res.finished.extend(finished)
        res.num_prefill_tokens += num_prefill
        return res

    def _collect(self, f: _Flight) -> RoundResult:
        """Collect one queued round: lagged stop rules, bookkeeping, deferred frees."""
        x = f.x
        k = x.k
        accepted, nv, out_tokens, scores = self.runner.collect(x)
        keep: list[int] = []
        emitted = []
        finished = list(f.finished)
        num_emitted = 0
        for b, req in enumerate(f.batch):
            req.num_inflight -= 1
            if req.is_finished:  # stopped in an earlier round or released: discard
                continue
            keep.append(b)
            a = int(accepted[b])
            req.num_computed += a + 1
            req.num_extend = a + 1
            kept = req.append([int(t) for t in out_tokens[b, : a + 1]])
            num_emitted += len(kept)
            emitted.append(([f.first[req.rid]] if req.rid in f.first else []) + kept)
            if req.is_finished:
                finished.append(req.rid)
        live = [f.batch[b] for b in keep]
        kv_lens = np.array([r.num_computed for r in live], dtype=np.int64)
        for req in f.batch:
            if req.is_finished:
                if req in self._running:
                    self._running.remove(req)
                if req.num_inflight == 0:
                    self._finish(req)
        idx = np.array(keep, dtype=np.int64)
        gone = (np.setdiff1d(np.arange(len(f.batch)), idx) if len(keep) < len(f.batch)
                else idx[:0])  # nothing discarded (every round but a stop's): no set op
        d_kv = np.array([f.batch[b].num_computed + int(accepted[b]) + 1 for b in gone], np.int64)
        d_acc, d_nv, d_sc = accepted[gone], nv[gone], scores[gone]
        accepted, nv, scores = accepted[idx], nv[idx], scores[idx]
        if k > 0:
            self.stats.add(nv, accepted, num_emitted)
        return RoundResult(
            num_requests=len(live),
            bcap=x.bcap,
            g=f.g,
            k=k,
            request_ids=[r.rid for r in live],
            accepted=accepted,
            num_verify=nv,
            emitted=emitted,
            finished=finished,
            draft_scores=scores,
            kv_lengths=kv_lens,
            num_prefill_tokens=f.num_prefill,
            first_tokens=dict(f.first),
            round_index=f.round_index,
            state_bytes=self._state_bytes(x.bcap, k),
            num_discarded=len(f.batch) - len(live),
            discarded_accepted=d_acc,
            discarded_num_verify=d_nv,
            discarded_draft_scores=d_sc,
            discarded_kv_lengths=d_kv,
            # the round is complete (collected above): a read of L integers
            experts_activated=() if f.experts is None else tuple(f.experts.tolist()),
        )

    def drain(self) -> list[RoundResult]:
        """Collect every queued round (oldest first) and return their results; the queue is
        then empty (depth 0: always ``[]``)."""
        out = []
        while self._inflight:
            out.append(self._collect(self._inflight.pop(0)))
        return out

    @property
    def num_inflight(self) -> int:
        """Rounds queued and not yet collected (pipelined engines: 0 or 1 between steps)."""
        return len(self._inflight)


@dataclass(kw_only=True)
class _Flight:
    """One queued (pipelined) round: its inputs, batch and the prefill facts reported with it."""

    x: RoundInputs
    batch: list[Request]
    first: dict[int, int]
    finished: list[int]
    num_prefill: int
    round_index: int
    g: int
    experts: Any = None  # [L] int64 device tensor: distinct experts per routed target layer
    rids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self.rids = frozenset(r.rid for r in self.batch)

    @property
    def k(self) -> int:
        return self.x.k
