"""Speculation policy objects for the live runner and the offline replay (pure numpy, no torch).

Owns the stateful side of SPEC section 6 and the small objects the runner exchanges with it; the
pure decision rules they apply live in :mod:`speccal.policy_rules`:

- :class:`CostModel`: a vectorised full-round cost ``cost(bcap, g, kv_length) -> ms`` (NaN =
  uncalibrated) plus the :class:`~speccal.base.geometry.Geometry` and table ``mode`` it belongs to.
  ``CostModel.from_table(table, memo=...)`` adapts a ``speccal.costmodel.table_schema.CostTable``;
  what a table answers, and the one memo of scalar answers, are ``speccal.costmodel.lookup``.
- :class:`BatchState` (what the runner knows before a round), :class:`Decision` (the plan:
  ``k`` draft forwards, padded target rows ``g``, optional per-request ``verify_tokens``) and
  :class:`Feedback` (built from the runner's normal ``RoundResult``: accepted lengths, draft
  scores; plain numpy).
- Policies with one API, ``decide(state) -> Decision`` and ``observe(feedback)``:
  :class:`FixedPolicy` (``fixed:K``), :class:`AdaptiveStepPolicy` (``adaptive-step``) and
  :class:`AdaptiveVerifyPolicy` (``adaptive-verify``, reading feedback through
  :class:`LaggedFeedback`). :func:`parse_policy` / :func:`make_policy` turn a spec string into
  one; :func:`check_adaptive_modes` refuses the two adaptive modes together.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from speccal.base.errors import InputError, UnsupportedError
from speccal.base.geometry import Geometry
from speccal.base.vocab import POLICY_DEFAULTS
from speccal.costmodel.lookup import LookupMemo, TableLookup, evaluate, memoised, scalar
from speccal.costmodel.spread import SpreadPricer
from speccal.policy_rules import (
    CURVE_RESOLUTION,
    choose_budget,
    choose_step,
    position_counts,
    prefix_acceptance,
    survival_curve,
)

MODES = ("draft_step", "target_verify")

CostFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


# --------------------------------------------------------------------------------------------
# Cost lookups
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """A vectorised full-round cost with the geometry it was calibrated on.

    Attributes
    ----------
    cost : ``f(bcap, g, kv_length) -> ndarray`` of ms per round; NaN where uncalibrated.
    geometry : captured buckets; ``bcap_for`` / ``g_for`` pad logical sizes up.
    mode : ``draft_step`` (``G = Bcap * (k + 1)`` means ``k`` draft forwards) or
        ``target_verify`` (the draft always runs ``w`` steps; ``G`` is the trimmed verify budget).
    memo : a :class:`~speccal.costmodel.lookup.LookupMemo` of scalar answers (exact for a
        table's cost), or None (every call computes).
    step_config : the adaptive draft step's settings the table was calibrated for (its
        ``calibration.policy``), the default of every adaptive-step policy built on this cost
        model (None: the defaults).
    k_aware : whether ``cost`` takes the rounds' draft forwards as a fourth argument,
        ``f(bcap, g, kv_length, k)`` (a draft_step table whose fit keeps a draft-forward term:
        a partly filled bucket verifies the G of another k, ``speccal.costmodel.lookup``).
    spread : the table's KV spread term (``speccal.costmodel.spread``: what a round whose
        longest request runs past its mean KV costs more), or None (a table without one prices
        every round at its mean KV). :meth:`price` adds it where a round's longest KV is known;
        decisions are taken on :meth:`lookup` (the mean KV), live and in replay alike.
    kv_lines : the table's ``TableLookup`` when it has a KV model (its cost is a line in KV:
        ``kv_line``, ``surface_on_line``), else None. With a memo, :meth:`step_costs` and
        :meth:`verify_candidates` of one batch size keep the lines of their candidates and
        price each round's KV on them (a decoding batch's KV moves every round, so the exact-KV
        memo never hits): the same values in a few microseconds instead of a surface
        evaluation per round.
    """

    cost: CostFn
    geometry: Geometry
    mode: str = "draft_step"
    memo: LookupMemo | None = field(default=None, compare=False, repr=False)
    k_aware: bool = False
    step_config: AdaptiveStepConfig | None = field(default=None, compare=False)
    spread: SpreadPricer | None = field(default=None, compare=False)
    kv_lines: TableLookup | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError("mode", self.mode, f"one of {list(MODES)}")
        if not callable(self.cost):
            raise InputError("cost", self.cost, "a callable f(bcap, g, kv_length) -> ndarray")

    @classmethod
    def from_table(cls, table: Any, *, memo: bool = False) -> CostModel:
        """Adapt a ``speccal.costmodel.table_schema.CostTable`` (its cost surface, geometry and mode).

        ``memo=True`` memoises scalar answers (the live loop; same values, see
        ``speccal.costmodel.lookup``).
        """
        lookup = table.lookup()
        return cls(
            cost=lookup.surface,
            geometry=table.geometry(),
            mode=str(table.mode),
            memo=lookup.memo() if memo else None,
            k_aware=lookup.depends_on_k,
            step_config=table_step_config(table),
            spread=None if getattr(table, "kv_spread", None) is None
            else SpreadPricer(table.kv_spread),
            kv_lines=None if lookup.kv_span is None else lookup,
        )

    @property
    def kv_span(self) -> tuple[float, float] | None:
        """The inclusive KV span the table's KV model prices (None without one)."""
        return None if self.kv_lines is None else self.kv_lines.kv_span

    @property
    def draft_width(self) -> int:
        return self.geometry.draft_width

    @memoised("bcap", kv=False)
    def bcap(self, num_requests: np.ndarray) -> np.ndarray:
        """``geometry.pad_requests``: the request bucket of each batch, 0 where none holds it."""
        return self.geometry.pad_requests(num_requests)

    @memoised("g", kv=False)
    def g(self, bcap: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``geometry.pad_rows``: the captured target bucket holding the rows, 0 where none does."""
        return self.geometry.pad_rows(bcap, rows)

    def lookup(self, bcap: np.ndarray, g: np.ndarray, kv_length: np.ndarray,
               k: np.ndarray | int | None = None) -> np.ndarray:
        """Cost in ms with NaN for a missing bucket (0) or an uncalibrated point; ``k``, the
        rounds' draft forwards, reaches a ``k_aware`` cost (``w`` when not given: a
        target_verify round drafts all ``w``)."""
        if not self.k_aware:
            return evaluate(self.cost, bcap, g, kv_length)
        return evaluate(self.cost, bcap, g, kv_length, self.draft_width if k is None else k)

    def spread_ms(self, bcap: np.ndarray, kv_length: np.ndarray,
                  kv_max_length: np.ndarray | None) -> np.ndarray:
        """The KV spread term of rounds whose longest request is at ``kv_max_length`` (0
        without a spread term or without the longest KV)."""
        if self.spread is None or kv_max_length is None:
            return np.zeros(np.broadcast_shapes(np.shape(bcap), np.shape(kv_length)))
        return self.spread.extra_ms(bcap, kv_length, kv_max_length)

    def price(self, bcap: np.ndarray, g: np.ndarray, kv_length: np.ndarray,
              k: np.ndarray | int | None = None,
              kv_max_length: np.ndarray | None = None) -> np.ndarray:
        """What a round costs: :meth:`lookup` at its mean KV plus the spread term where its
        longest request's KV is given (NaN stays NaN)."""
        base = self.lookup(bcap, g, kv_length, k)
        if self.spread is None or kv_max_length is None:  # the per-round replay loop's case
            return base
        return np.asarray(base, dtype=np.float64) + self.spread.extra_ms(bcap, kv_length,
                                                                         kv_max_length)

    def _line_key(self, name: str, num_requests: Any, kv_length: Any) -> tuple | None:
        """The memo key of a batch size's candidate lines, or None (no memo, no KV line, or an
        argument that is not a scalar): the caller then evaluates the surface."""
        if self.memo is None or self.kv_lines is None or scalar(kv_length) is None:
            return None
        return self.memo.key(name, (num_requests,))

    def _line_of(self, bcap: np.ndarray, g: np.ndarray,
                 k: np.ndarray | int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`lookup`'s cost as a line in KV (NaN base where a bucket is 0 or the point is
        uncalibrated at every KV)."""
        if self.k_aware:
            base, per_token = self.kv_lines.kv_line(bcap, g,
                                                    self.draft_width if k is None else k)
        else:
            base, per_token = self.kv_lines.kv_line(bcap, g)
        return np.where((bcap > 0) & (g > 0), base, np.nan), per_token

    def _on_line(self, line: tuple[np.ndarray, np.ndarray], kv_length: Any) -> np.ndarray:
        """:meth:`lookup` at a scalar ``kv_length`` from a line (``surface_on_line``)."""
        return self.kv_lines.surface_on_line(line, float(scalar(kv_length)))

    def step_costs(self, num_requests: np.ndarray, kv_length: np.ndarray) -> np.ndarray:
        """Cost of ``k = 1..w`` full-verify rounds, ``[..., w]``: G = g_for(Bcap, B * (k + 1))."""
        key = self._line_key("step_line", num_requests, kv_length)
        if key is None:
            return self._step_costs(num_requests, kv_length)
        ks = np.arange(1, self.draft_width + 1)

        def line() -> tuple[np.ndarray, np.ndarray]:
            bcap = np.full(len(ks), self.bcap(num_requests))
            return self._line_of(bcap, self.g(bcap, int(num_requests) * (ks + 1)), ks)

        return self._on_line(self.memo.get(key, line), kv_length)

    @memoised("step", kv=True)
    def _step_costs(self, num_requests: np.ndarray, kv_length: np.ndarray) -> np.ndarray:
        b, kv, inv = _unique_states(num_requests, kv_length)
        ks = np.arange(1, self.draft_width + 1)
        bcap = self.bcap(b)[:, None]
        out = self.lookup(bcap, self.g(bcap, b[:, None] * (ks + 1)), kv[:, None], ks)
        return out[inv].reshape(np.shape(num_requests) + (self.draft_width,))

    def verify_candidates(
        self, num_requests: np.ndarray, kv_length: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Target budgets of each batch's Bcap and their costs, ``([..., J], [..., J])``.

        ``J`` is the most target buckets any Bcap has; missing entries have ``g = 0`` and NaN
        cost. Budgets below ``B`` rows (not even the bonus rows fit) are dropped the same way.
        """
        key = self._line_key("verify_line", num_requests, kv_length)
        if key is None:
            return self._verify_candidates(num_requests, kv_length)

        def line() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            gs, bcap = self._budgets(np.asarray(num_requests, dtype=np.int64).reshape(1))
            return (gs[0],) + self._line_of(np.full(gs.shape[1], bcap[0]), gs[0])

        gs, *at = self.memo.get(key, line)
        return gs, self._on_line(tuple(at), kv_length)

    def _budgets(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(budgets [U, J], bcap [U])`` of distinct batch sizes ``b`` (g 0: none)."""
        bcap = self.bcap(b)
        width = max(len(gs) for gs in self.geometry.target_rows.values())
        gs = np.zeros(b.shape + (width,), dtype=np.int64)
        for cap, levels in self.geometry.target_rows.items():
            gs[bcap == cap, : len(levels)] = levels
        return np.where(gs >= b[:, None], gs, 0), bcap

    @memoised("verify", kv=True)
    def _verify_candidates(
        self, num_requests: np.ndarray, kv_length: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        b, kv, inv = _unique_states(num_requests, kv_length)
        gs, bcap = self._budgets(b)
        costs = self.lookup(bcap[:, None], gs, kv[:, None])
        shape = np.shape(num_requests) + (gs.shape[-1],)
        return gs[inv].reshape(shape), costs[inv].reshape(shape)


def table_step_config(table: Any) -> AdaptiveStepConfig | None:
    """The table's ``calibration.policy`` as an :class:`AdaptiveStepConfig` (None without one)."""
    p = getattr(getattr(table, "calibration", None), "policy", None)
    if p is None:
        return None
    return AdaptiveStepConfig(window_size=p.window_size, update_interval=p.update_interval,
                              switch_min_gain=p.switch_min_gain)


def _unique_states(
    num_requests: np.ndarray, kv_length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct ``(B, kv)`` pairs of (broadcast) inputs: ``(b [U], kv [U], inverse [N])``.

    Traces repeat a few batch states over 10^6 rounds; looking each state up once keeps the
    table's cost surface off the hot path. Pairs are keyed as complex numbers (B + i * kv), which
    numpy sorts lexicographically.
    """
    b, kv = np.broadcast_arrays(
        np.asarray(num_requests, dtype=np.int64), np.asarray(kv_length, dtype=np.float64)
    )
    if b.size == 1:  # one live round's state: itself (np.unique is most of a scalar lookup)
        return b.reshape(1).copy(), kv.reshape(1).copy(), np.zeros(1, dtype=np.int64)
    key = b.reshape(-1).astype(np.float64) + 1j * kv.reshape(-1)
    uniq, inv = np.unique(key, return_inverse=True)
    return uniq.real.astype(np.int64), uniq.imag.copy(), inv.reshape(-1)


# --------------------------------------------------------------------------------------------
# Runner-facing records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchState:
    """What the runner knows before a round: its index, the batch size and mean KV length."""

    round_index: int
    num_requests: int
    kv_length: float


@dataclass(frozen=True)
class Decision:
    """The plan of one round.

    Attributes
    ----------
    k : draft forwards to run (``1..w``).
    g : padded target rows (a captured bucket of ``bcap``): the verify budget. 0 when the batch
        has no captured bucket.
    verify_tokens : ``[B]`` drafted tokens per request sent to the target (prefix-closed), or
        None = all ``k``. Adaptive verify leaves it None; the device fills it with
        :func:`~speccal.policy_rules.allocate_prefixes` from the current round's scores inside ``g``.
    reason : ``fixed``, ``warmup`` (no feedback yet), ``switch``, ``hold``, ``uncalibrated``
        or ``scored`` (adaptive verify).
    predicted_gain : predicted relative gain of the chosen plan over the previous one (NaN when
        not scored).
    """

    k: int
    g: int
    verify_tokens: np.ndarray | None = None
    reason: str = "fixed"
    predicted_gain: float = math.nan


@dataclass(frozen=True, eq=False)
class Feedback:
    """Per-round statistics the policies learn from; plain numpy, no torch.

    Attributes
    ----------
    round_index : index of the round that produced it.
    k : draft forwards that ran.
    accepted : ``[B]`` accepted draft tokens per request (``0..k``).
    draft_scores : ``[B, k]`` draft probability of each selected token, or None.
    verify_tokens : ``[B]`` drafted tokens each request sent to the target, or None (= ``k``).
    """

    round_index: int
    k: int
    accepted: np.ndarray
    draft_scores: np.ndarray | None = None
    verify_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        acc = np.asarray(self.accepted, dtype=np.int64).reshape(-1)
        if acc.size and (acc.min() < 0 or acc.max() > self.k):
            raise InputError("accepted", acc.tolist(), f"values in 0..k={self.k}")
        object.__setattr__(self, "accepted", acc)
        if self.draft_scores is not None:
            s = np.asarray(self.draft_scores, dtype=np.float64)
            if s.ndim != 2 or s.shape[0] != acc.size:
                raise InputError("draft_scores", s.shape, f"shape [B={acc.size}, k]")
            object.__setattr__(self, "draft_scores", s)
        if self.verify_tokens is not None:
            object.__setattr__(
                self, "verify_tokens", np.asarray(self.verify_tokens, dtype=np.int64).reshape(-1)
            )

    @classmethod
    def from_round_result(cls, result: Any, round_index: int) -> Feedback:
        """Build feedback from a runner ``RoundResult`` (fields collected anyway each round).

        Uses ``accepted`` (``[B]``), ``k``, ``draft_scores`` (``[B, k]``) and ``num_verify``
        (``[B]``, drafted tokens sent to the target) when present; arrays are converted with
        ``numpy.asarray`` (no torch import here).
        """
        scores = getattr(result, "draft_scores", None)
        verify = getattr(result, "num_verify", None)
        return cls(
            round_index=int(round_index),
            k=int(result.k),
            accepted=np.asarray(result.accepted),
            draft_scores=None if scores is None else np.asarray(scores),
            verify_tokens=None if verify is None else np.asarray(verify),
        )


class Policy(Protocol):
    """The one API the live runner and the replay call."""

    name: str

    def decide(self, state: BatchState) -> Decision: ...

    def observe(self, feedback: Feedback) -> None: ...


# --------------------------------------------------------------------------------------------
# Policy objects
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdaptiveStepConfig:
    """Adaptive draft step settings (SPEC section 4 defaults)."""

    window_size: int = POLICY_DEFAULTS["window_size"]
    update_interval: int = POLICY_DEFAULTS["update_interval"]
    switch_min_gain: float = POLICY_DEFAULTS["switch_min_gain"]

    def __post_init__(self) -> None:
        if self.window_size < 1:
            raise InputError("policy.window_size", self.window_size, "an integer >= 1")
        if self.update_interval < 1:
            raise InputError("policy.update_interval", self.update_interval, "an integer >= 1")
        # a relative gain: 1 would ask a switch to double the throughput (the seeds' 0.05 = 5 %)
        if not 0 <= self.switch_min_gain < 1:
            raise InputError("policy.switch_min_gain", self.switch_min_gain, "a number in [0, 1)")


@dataclass(frozen=True)
class AdaptiveVerifyConfig:
    """Adaptive target verify settings.

    ``window_size`` lagged rounds are averaged into the survival curve; ``feedback_lag`` is the
    age a round's feedback must reach before the host may read it (2: round ``n`` sees ``n - 2``
    and older, because ``n - 1`` is still in flight when ``n`` is planned).
    """

    window_size: int = 20
    feedback_lag: int = 2
    resolution: int = CURVE_RESOLUTION

    def __post_init__(self) -> None:
        if self.window_size < 1:
            raise InputError("window_size", self.window_size, "an integer >= 1")
        if self.feedback_lag < 2:
            raise InputError("feedback_lag", self.feedback_lag, "an integer >= 2 (n-2 rule)")
        if self.resolution < 1:
            raise InputError("resolution", self.resolution, "an integer >= 1")


class FixedPolicy:
    """Baseline: ``k`` drafts every round (draft_step) or ``k`` verified drafts per request
    (target_verify: the draft runs ``w``, the first ``k`` of each request are verified)."""

    def __init__(self, cost: CostModel, k: int):
        w = cost.draft_width
        if not 1 <= k <= w:
            raise InputError("policy", f"fixed:{k}", f"fixed:K with 1 <= K <= draft_width={w}")
        self.cost = cost
        self.k = int(k)
        self.name = f"fixed:{k}"

    def decide(self, state: BatchState) -> Decision:
        b = state.num_requests
        bcap = int(self.cost.bcap(b))
        g = int(self.cost.g(bcap, b * (self.k + 1)))
        if self.cost.mode == "target_verify":
            tokens = np.full(b, self.k, dtype=np.int64)
            return Decision(k=self.cost.draft_width, g=g, verify_tokens=tokens, reason="fixed")
        return Decision(k=self.k, g=g, reason="fixed")

    def observe(self, feedback: Feedback) -> None:
        """Fixed policies learn nothing."""


class AdaptiveStepPolicy:
    """Adaptive draft step: one batch-wide ``k`` from windowed prefix acceptance and the table.

    Bookkeeping: each observed batch adds its per-position counts to a window of the last
    ``window_size`` batches. ``decide`` scores first as soon as one batch has completed (full
    width before: the only ``k`` that observes every position), then re-scores at every
    multiple of ``update_interval`` completed batches, and otherwise holds ``k``. (The seed fixes
    the re-scoring interval, not the first scoring; waiting a whole interval before it ran the
    first ``update_interval`` + 1 pipelined rounds at full width, 1-2.6 % of a 150-round run
    where ``k = 1`` was right on an H100 at 98963ed.) A round whose lookup at the held ``k`` is
    uncalibrated runs full width without changing the held ``k``.
    """

    def __init__(self, cost: CostModel, config: AdaptiveStepConfig | None = None):
        if cost.mode != "draft_step":
            raise UnsupportedError(
                f"adaptive-step needs a draft_step cost table; got mode {cost.mode!r}"
            )
        self.cost = cost
        self.config = config or cost.step_config or AdaptiveStepConfig()
        self.name = "adaptive-step"
        w = cost.draft_width
        self._window: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.config.window_size)
        self._completed = 0
        self._next_score = 1  # completed batches at which decide() scores next
        self._k = w
        self._last_reason = "warmup"
        self._last_gain = math.nan

    @property
    def completed(self) -> int:
        """Batches observed so far."""
        return self._completed

    @property
    def held_k(self) -> int:
        return self._k

    def window_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(survived [w], reached [w])`` summed over the window."""
        w = self.cost.draft_width
        if not self._window:
            return np.zeros(w), np.zeros(w)
        s = np.sum([x[0] for x in self._window], axis=0)
        r = np.sum([x[1] for x in self._window], axis=0)
        return s, r

    def observe(self, feedback: Feedback) -> None:
        self._window.append(position_counts(feedback.accepted, feedback.k, self.cost.draft_width))
        self._completed += 1

    def decide(self, state: BatchState) -> Decision:
        costs = self.cost.step_costs(state.num_requests, state.kv_length)
        interval = self.config.update_interval
        warm = self._next_score == 1  # no scoring yet
        if self._completed >= self._next_score:
            self._next_score = (self._completed // interval + 1) * interval
            k, reason, gain = choose_step(
                prefix_acceptance(*self.window_counts()),
                costs,
                state.num_requests,
                self._k,
                self.config.switch_min_gain,
            )
            self._k, self._last_reason, self._last_gain = k, reason, gain
            fresh = True
        else:
            fresh = False
        w = self.cost.draft_width
        k = self._k
        reason = self._last_reason if fresh else ("warmup" if warm else "hold")
        if not np.isfinite(costs[k - 1]):
            k, reason = w, "uncalibrated"
        bcap = int(self.cost.bcap(state.num_requests))
        g = int(self.cost.g(bcap, state.num_requests * (k + 1)))
        return Decision(
            k=k, g=g, reason=reason, predicted_gain=self._last_gain if fresh else math.nan
        )


class LaggedFeedback:
    """Feedback queue that only releases entries at least ``lag`` rounds old.

    The adaptive verify policy keeps its feedback here and nowhere else, and can only read it
    through :meth:`release`, so planning round ``n`` cannot see round ``n - 1`` (or newer) even
    when the runner has already delivered it.
    """

    def __init__(self, lag: int = 2):
        if lag < 2:
            raise InputError("feedback_lag", lag, "an integer >= 2 (n-2 rule)")
        self.lag = lag
        self.__pending: deque[Feedback] = deque()

    def push(self, feedback: Feedback) -> None:
        self.__pending.append(feedback)

    def release(self, round_index: int) -> list[Feedback]:
        """Pop and return queued feedback of rounds ``<= round_index - lag`` (oldest first)."""
        out, keep = [], deque()
        limit = round_index - self.lag
        for fb in self.__pending:
            (out if fb.round_index <= limit else keep).append(fb)
        self.__pending = keep
        return sorted(out, key=lambda fb: fb.round_index)

    def __len__(self) -> int:
        return len(self.__pending)


class AdaptiveVerifyPolicy:
    """Adaptive target verify: full-width draft, padded budget from n-2 feedback and the table.

    ``decide`` releases feedback at least ``feedback_lag`` rounds old from its
    :class:`LaggedFeedback`, folds each into a window of survival curves, and picks the budget
    ``g`` maximizing ``B * (1 + f((g - B) / B)) / cost(Bcap, g, kv)``. The device then fills
    ``verify_tokens`` with :func:`~speccal.policy_rules.allocate_prefixes` on the current round's
    scores (the current scores never reach the host before the target runs).
    """

    def __init__(self, cost: CostModel, config: AdaptiveVerifyConfig | None = None):
        if cost.mode != "target_verify":
            raise UnsupportedError(
                f"adaptive-verify needs a target_verify cost table; got mode {cost.mode!r}"
            )
        self.cost = cost
        self.config = config or AdaptiveVerifyConfig()
        self.name = "adaptive-verify"
        self._feedback = LaggedFeedback(self.config.feedback_lag)
        self._curves: deque[np.ndarray] = deque(maxlen=self.config.window_size)
        self.used_rounds: list[int] = []  # rounds whose feedback has been folded in (for tests)

    def observe(self, feedback: Feedback) -> None:
        if feedback.draft_scores is None:
            raise InputError("feedback.draft_scores", None, "[B, w] draft scores (adaptive verify)")
        self._feedback.push(feedback)

    def decide(self, state: BatchState) -> Decision:
        for fb in self._feedback.release(state.round_index):
            self._curves.append(survival_curve(fb.draft_scores, self.config.resolution))
            self.used_rounds.append(fb.round_index)
        curve = np.mean(self._curves, axis=0) if self._curves else None
        budgets, costs = self.cost.verify_candidates(state.num_requests, state.kv_length)
        g, _ = choose_budget(curve, state.num_requests, budgets, costs, self.config.resolution)
        reason = "warmup" if curve is None else "scored"
        if int(g) == 0 or (curve is not None and not np.isfinite(costs).any()):
            reason = "uncalibrated"  # g == 0: no bucket of the table holds the batch
        return Decision(k=self.cost.draft_width, g=int(g), reason=reason)


# --------------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicySpec:
    """A parsed ``--policy`` value: ``kind`` in fixed / adaptive-step / adaptive-verify."""

    kind: str
    k: int | None = None
    text: str = field(default="", compare=False)


ADAPTIVE = ("adaptive-step", "adaptive-verify")


def parse_policy(text: str) -> PolicySpec:
    """Parse ``fixed:K``, ``adaptive-step`` or ``adaptive-verify``.

    A combined spec (``adaptive-step+adaptive-verify``) is refused with ``UnsupportedError``.
    """
    t = str(text).strip().lower()
    parts = [p.strip() for p in t.split("+")]
    if len(parts) > 1:
        check_adaptive_modes(
            adaptive_draft_step="adaptive-step" in parts,
            adaptive_target_verify="adaptive-verify" in parts,
        )
        raise InputError("policy", text, "one policy: fixed:K, adaptive-step or adaptive-verify")
    if t in ADAPTIVE:
        return PolicySpec(kind=t, text=t)
    if t.startswith("fixed:"):
        try:
            k = int(t.split(":", 1)[1])
        except ValueError:
            k = 0
        if k >= 1:
            return PolicySpec(kind="fixed", k=k, text=f"fixed:{k}")
    raise InputError("policy", text, "fixed:K (K >= 1), adaptive-step or adaptive-verify")


def check_adaptive_modes(*, adaptive_draft_step: bool, adaptive_target_verify: bool) -> None:
    """Refuse enabling adaptive draft step and adaptive target verify together (SPEC 6)."""
    if adaptive_draft_step and adaptive_target_verify:
        raise UnsupportedError(
            "adaptive draft step and adaptive target verify cannot be combined: enable one of them"
        )


def make_policy(
    spec: str | PolicySpec,
    cost: CostModel,
    *,
    step_config: AdaptiveStepConfig | None = None,
    verify_config: AdaptiveVerifyConfig | None = None,
) -> Policy:
    """Build the policy object a spec names, for the given cost model."""
    p = parse_policy(spec) if isinstance(spec, str) else spec
    if p.kind == "fixed":
        return FixedPolicy(cost, int(p.k))
    if p.kind == "adaptive-step":
        return AdaptiveStepPolicy(cost, step_config)
    return AdaptiveVerifyPolicy(cost, verify_config)
