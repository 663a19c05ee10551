"""What a round is asked to run and what it returns: :class:`RoundPlan` (the policy's choice),
what it means for the engine's buckets (:func:`check_plan`, :func:`round_shape`),
:class:`RoundState` (what a plan callback sees) and :class:`RoundResult` (the host-side result
of one ``Engine.step``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from speccal.base.errors import CapacityError, InputError
from speccal.base.geometry import Geometry


@dataclass(frozen=True)
class RoundPlan:
    """What the next round runs: ``k`` draft steps and optional per-request verify lengths.

    ``verify_tokens [B]``: drafts each request sends to the target (host-chosen, prefix-closed);
    None = all ``k``. The target runs ``geometry.g_for(bcap, sum(verify_tokens + 1))`` rows.

    ``verify_budget`` (adaptive target verify, exclusive with ``verify_tokens``; needs
    ``num_draft_steps == draft_width``): padded target rows ``G`` the round may use. The target
    runs at ``G`` taken down to the largest target bucket of the batch's ``Bcap`` that fits (the
    smallest bucket when none does; then no draft row is verified). The draft runs full width;
    then, on the device and without a host wait, each request gets a prefix of its drafts by the
    rule of ``speccal.policy_rules.allocate_prefixes`` applied to this round's draft scores (highest
    prefix survival first, prefix-closed, at most ``min(G, verify_budget) - B`` draft rows);
    rows past the allocation pad to the sentinel slot. ``RoundResult.num_verify`` reports the
    allocation (collected with the round's results). There is no host fallback.
    """

    num_draft_steps: int
    verify_tokens: Sequence[int] | None = None
    verify_budget: int | None = None


def check_plan(plan: RoundPlan, n: int, *, draft_width: int,
               speculative: bool) -> tuple[int, np.ndarray | None]:
    """``(k, verify_tokens [B])`` of a plan over ``n`` running requests, each field checked
    (``InputError`` naming it); verify_tokens is None under a verify budget (device)."""
    k, w = plan.num_draft_steps, draft_width
    if speculative:
        if not isinstance(k, int) or not 1 <= k <= w:
            raise InputError("num_draft_steps", k, f"an integer in [1, {w}] (draft_width)")
    elif k != 0:
        raise InputError("num_draft_steps", k, "0 (the engine was built with speculative=False)")
    budget = plan.verify_budget
    if budget is not None:
        if plan.verify_tokens is not None:
            raise InputError(
                "verify_budget", budget, "None when verify_tokens is given (one or the other)")
        if not isinstance(budget, (int, np.integer)) or budget < n:
            raise InputError(
                "verify_budget", budget, f"an integer >= {n} target rows (one per request)")
        if k != w:
            raise InputError("num_draft_steps", k,
                             f"{w} (draft_width) with verify_budget: the draft runs full width")
        return k, None
    if plan.verify_tokens is None:
        return k, np.full(n, k, dtype=np.int64)
    nv = np.asarray(list(plan.verify_tokens), dtype=np.int64)
    if nv.shape != (n,) or (nv < 0).any() or (nv > k).any():
        raise InputError("verify_tokens", list(plan.verify_tokens),
                         f"{n} integers in [0, {k}] (one per running request)")
    return k, nv


def round_shape(plan: RoundPlan, n: int, k: int, nv: np.ndarray | None,
                geometry: Geometry) -> tuple[int, int, int | None]:
    """``(Bcap, G, budget draft rows or None)`` of a round over ``n > 0`` requests with
    :func:`check_plan`'s ``(k, nv)``. Under a verify budget ``G`` is the largest target bucket
    of ``Bcap`` that fits the budget (else the smallest holding the ``n`` bonus rows) and the
    draft rows are ``min(G, budget) - n``."""
    bcap = geometry.bcap_for(n)
    if bcap is None:
        raise CapacityError(f"no captured request bucket for {n} requests")
    budget_rows = None
    if nv is None:  # verify budget: allocated on the device from this round's scores
        budget = int(plan.verify_budget)
        g = geometry.g_within(bcap, budget, n)
        budget_rows = min(g, budget) - n if g is not None else 0
        rows = n
    else:
        rows = int((nv + 1).sum())
        g = geometry.g_for(bcap, rows) if k > 0 else geometry.g_for(bcap, bcap)
    if g is None:
        raise CapacityError(f"no captured target bucket for {n} requests / {rows} target rows")
    return bcap, g, budget_rows


def full_grid(k: int, g: int, bcap: int) -> bool:
    """A verify shape whose target runs the whole ``[bcap, k + 1]`` grid: ``k > 0`` and
    ``G = bcap * (k + 1)`` (the shape :func:`grid_rows` rounds run at)."""
    return k > 0 and g == bcap * (k + 1)


def grid_rows(k: int, g: int, bcap: int, n: int, num_verify: np.ndarray | None,
              budget_rows: int | None) -> bool:
    """Whether a verify round's packed target rows are the ``[bcap, k + 1]`` grid in order
    (``RoundInputs.grid``): ``G = bcap * (k + 1)`` and each of the ``n`` requests verifies all
    ``k`` drafts, host-chosen (``num_verify [n]``) or under a budget of at least ``n * k``
    draft rows (the allocation then takes every draft, ``policy_rules.allocate_prefixes``).
    Requests' rows are packed in order and padding requests have none, so request ``b``'s
    rows are grid row ``b``'s and the padding rows fill the padding requests' grid rows."""
    if not full_grid(k, g, bcap):
        return False
    if num_verify is not None:
        return bool(np.all(num_verify == k))
    return budget_rows is not None and budget_rows >= n * k


@dataclass(frozen=True, kw_only=True)
class RoundState:
    """What a plan callback sees after admission, before the round is planned.

    ``round_index`` counts rounds over a non-empty batch, consecutively from 0 (reset by
    :meth:`Engine.reset`); ``kv_length`` is the batch's mean target KV length before the round.
    """

    round_index: int
    num_requests: int
    kv_length: float
    request_ids: tuple[int, ...]


PlanFn = Callable[[RoundState], RoundPlan]


@dataclass(kw_only=True)
class RoundResult:
    """Host-side results of one :meth:`Engine.step`.

    Arrays are aligned with ``request_ids`` (the running batch of the round, in slot order).
    ``emitted[i]`` holds request ``i``'s new tokens of this step (the prefill's first token, if
    any, then ``accepted[i] + 1`` round tokens, truncated by stop rules).
    """

    num_requests: int
    bcap: int
    g: int
    k: int
    request_ids: list[int]
    accepted: np.ndarray  # [B] int64
    num_verify: np.ndarray  # [B] int64
    emitted: list[list[int]]
    finished: list[int]
    draft_scores: np.ndarray  # [B, k] float32
    kv_lengths: np.ndarray  # [B] int64, after the round
    num_prefill_tokens: int = 0
    # recurrent-state bytes the round moved (hybrid targets: StateTraffic.total of the round's
    # shape under the engine's state strategy; 0 without recurrent state)
    state_bytes: int = 0
    first_tokens: dict[int, int] = field(default_factory=dict)
    round_index: int = -1  # -1: no round ran (empty batch)
    num_discarded: int = 0  # pipelined: rows of already-finished requests the round also ran
    # pipelined: what the device computed for those rows (never emitted): [D], [D], [D, k], [D]
    discarded_accepted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    discarded_num_verify: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    discarded_draft_scores: np.ndarray | None = None
    discarded_kv_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # per routed-expert layer of the target (``Engine.routing``), the distinct experts this
    # round's forwards activated (counted on the device, read at collect; every row the round
    # ran, padding and discarded rows included); () for a dense target or no round
    experts_activated: tuple[int, ...] = ()

    @property
    def accept_matrix(self) -> np.ndarray:  # [B, k] bool: draft position j of request b accepted
        return np.arange(self.k)[None, :] < np.asarray(self.accepted)[:, None]

    def physical(self) -> RoundResult:
        """The rows the device ran: the live rows, then (pipelined) the discarded ones.

        Under a pipelined engine a round also computes the rows of requests whose stop was
        discovered one round late; their outcomes (accepted lengths, draft scores, verify
        lengths and the KV length the device reached) are real measurements of that round
        and what its cost was paid for, so the live policy loop records and observes them
        (the replay then sees the same batch as the decision). Returns ``self`` when none.
        """
        if not self.num_discarded:
            return self
        k = self.k
        ds = self.discarded_draft_scores
        if ds is None:
            ds = np.zeros((self.num_discarded, k), np.float32)
        acc = np.concatenate([self.accepted, self.discarded_accepted])
        return replace(
            self,
            num_requests=self.num_requests + self.num_discarded,
            accepted=acc,
            num_verify=np.concatenate([self.num_verify, self.discarded_num_verify]),
            draft_scores=np.concatenate([self.draft_scores, ds]),
            kv_lengths=np.concatenate([self.kv_lengths, self.discarded_kv_lengths]),
            num_discarded=0,
        )
