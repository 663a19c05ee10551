"""The quality gate of every calibration: noisy points re-measured, a noisy table refused.

A table whose prediction moves by more than the gains it arbitrates is worse than none, and a
calibration on a busy machine looks like any other unless something checks it (on a busy 2-core
machine one default CPU calibration had windows of one point from 46 to 467 ms, leave-one-point-out
errors above 100 %, and still wrote its table). The gate has three parts.

**Noisy points** (while measuring). A point's windows are measured in *rounds* of
``windows_per_point`` windows; round 0 is the calibration's own windows, round ``r >= 1`` a
re-measurement. The *spread* of a round is ``(max - min) / median`` of its windows' step times,
in % (one number per round, the statistic the fit report's ``spread ms`` shows in ms). A round is
noisy when its spread exceeds ``max_spread_pct``. Chosen over a robust MAD rule because with the
default three windows a MAD is the median of two deviations and says little, while a max/min
spread is what a user compares against ("within 3 %"); it needs >= 2 windows (with one window
per point nothing is flagged, and the record says the spread was not measurable).

**Fewer windows where the spread is tiny** (``EarlyStop``, optional: the calibration config's
``min_windows_per_point`` and ``early_stop_spread_pct``; on by default on cuda,
``calibrate.config.KIND_DEFAULTS``). Round 0 is measured in two passes, each window-major: every
point's first ``min_windows`` windows (indices ``0 .. min_windows - 1``), then the rest of the
round (``min_windows .. windows_per_point - 1``) for the points whose first windows spread more
than the early-stop bound (:func:`points_for_more_windows`). A point whose first windows agree
has a complete round 0 of ``min_windows`` windows. The bound is capped by ``max_spread_pct``, so
a round that stopped early is never noisy, and a noisy point always had its full round 0 before
it is re-measured; re-measure rounds always take ``windows_per_point`` windows (their point
disagreed once). Which points get the rest is a function of the journal's rows, like the
re-measurement plan, so ``--resume`` measures exactly the windows still missing and fits the
same ones.

**Re-measurement** (bounded). After every point has its round 0, a point whose rounds so far are
all noisy gets one more round, up to ``remeasure_rounds`` extra rounds. Round ``r``'s windows
take window indices ``r * windows_per_point + i`` (``i`` = 0..w-1), so every window keeps a unique
identity in the journal ((mode, context, Bcap, G, k, window index)); window ``r * w + i`` starts at
the KV lengths of window ``i`` (``speccal.calibrate.driver``). Whether round ``r`` is due is a
function of the journal's rows only (:func:`points_to_remeasure`), so ``--resume`` continues the
same plan. The fit pools every complete round of a point: its cost is the median of all of their
windows (``build_table``'s ``combine="median"``), and the table records the spread of each round.

Why pooled, not the quietest round (the rule until 2026-12-02). A re-measured point is one whose
windows disagreed; picking the round whose three windows happen to agree best keeps three
windows out of up to nine and says nothing about their level: on a 2-vCPU VM the machine's speed
drifts by ~10 % within a second even when quiet (bench/RESULTS.md: 15,360 rounds of one shape,
window means at lag 1.5 s uncorrelated) and other processes slow whole stretches of seconds by up
to 2x, so three agreeing windows are as likely to sit in one slow stretch as in a fast one. On
three journals of the default tiny calibration (76 points, 45-64 of them re-measured) the
additive fit's leave-one-point-out error (worst context) was 14.8 / 7.4 / 4.8 % from the
quietest rounds, 11.8 / 7.9 / 6.2 % from round 0 alone and 9.4 / 7.6 / 3.9 % from every round
pooled (bench/RESULTS.md): on the first the pick made the table worse than not re-measuring at
all, and pooled was never far from the best.
The median of all windows is robust to a minority of slow windows (the case the old rule was
written for: a busy host only slows rounds down) and uses every window measured. Nothing about
the judgement changes: a round is noisy by the same spread and bound, re-measurement is planned
the same way, and the table is refused by the same held-out statistic and bound, now computed
on the better estimate. The rounds' spreads stay in the table's quality record.

**Refusal** (after the fit). The held-out error gated is the leave-one-point-out mean absolute
error in % of the measured cost (``diagnostics.leave_one_point_out.mean_abs_pct``), the worst over
the context intervals. Beyond ``max_heldout_pct`` the table is not written (the journal keeps
every window, so ``--resume --accept-noisy`` writes it without measuring again) unless
``accept_noisy`` is set, which the table then records as an override. A grid where no point can
be held out (each point the only evidence for one of its levels) has no held-out error: the gate
then passes on it and says so.

Default bounds, per device kind (``DEFAULTS``): CPU windows are timed by the probe clock
(``speccal.calibrate.timing``) and a CPU point has six of them (``calibrate.config.
KIND_DEFAULTS``); beside another busy process on a 2-vCPU VM their spread was 14-20 % in five
default runs (the range of six windows of ~5 % CV) at 0.5-1.7 % held-out, so CPU allows 25 %
spread (a point past it is one a neighbour really disturbed) and 10 % held-out, with one
re-measure round (``KIND_REMEASURE_ROUNDS``: six more windows); a GPU's rounds are steadier
(H200: spread <= 3 %, held-out <= 2-3 %), so cuda and npu allow 3 % spread, 5 % held-out and
two re-measure rounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speccal.base.errors import InputError, SpeccalError
from speccal.calibrate.grid import GridPoint
from speccal.calibrate.journal import window_key

#: Default bounds per device kind: (max_spread_pct, max_heldout_pct).
DEFAULTS = {"cpu": (25.0, 10.0), "cuda": (3.0, 5.0), "npu": (3.0, 5.0)}
DEFAULT_REMEASURE_ROUNDS = 2
#: Device kinds whose re-measure rounds default otherwise (cpu: a point has 8 windows, so one
#: more round is 8 more; see ``DEFAULTS``).
KIND_REMEASURE_ROUNDS = {"cpu": 1}
#: The most re-measure rounds a run may ask for ("a bounded number of times").
MAX_REMEASURE_ROUNDS = 5
#: The held-out statistic the gate compares with ``max_heldout_pct``.
HELDOUT_METRIC = "leave_one_point_out.mean_abs_pct"


class QualityGateError(SpeccalError):
    """The fitted table's held-out error is beyond the gate's bound (no table written).

    A runtime outcome, not bad input: exit status 1. The message says how to write the table
    anyway (``--resume --accept-noisy``) or measure again.
    """

    exit_code = 1

    def __init__(self, message: str, *, summary: Mapping[str, Any] | None = None):
        super().__init__(message)
        #: the run's ``--json`` summary (``status: refused``), for callers that print it anyway
        self.summary = dict(summary or {})


@dataclass(frozen=True)
class GateConfig:
    """Bounds of the quality gate (validated on construction).

    Attributes
    ----------
    max_spread_pct : a round of windows whose (max - min) / median exceeds this is noisy.
    max_heldout_pct : the most leave-one-point-out mean absolute error (%) a written table has.
    remeasure_rounds : extra rounds of windows a noisy point gets, at most.
    accept_noisy : write the table even beyond ``max_heldout_pct`` (recorded as an override).
    sources : per field, ``default`` (with the device kind) or ``flag``.
    """

    max_spread_pct: float
    max_heldout_pct: float
    remeasure_rounds: int = DEFAULT_REMEASURE_ROUNDS
    accept_noisy: bool = False
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_bounds(self.max_spread_pct, self.max_heldout_pct, self.remeasure_rounds)

    @classmethod
    def resolve(
        cls,
        device_kind: str,
        *,
        max_spread_pct: float | None = None,
        max_heldout_pct: float | None = None,
        remeasure_rounds: int | None = None,
        accept_noisy: bool = False,
    ) -> GateConfig:
        """The gate of a run on ``device_kind``: flags where given, else ``DEFAULTS``."""
        spread, heldout = DEFAULTS.get(device_kind, DEFAULTS["cuda"])
        default = f"default ({device_kind})"
        return cls(
            max_spread_pct=spread if max_spread_pct is None else float(max_spread_pct),
            max_heldout_pct=heldout if max_heldout_pct is None else float(max_heldout_pct),
            remeasure_rounds=(
                KIND_REMEASURE_ROUNDS.get(device_kind, DEFAULT_REMEASURE_ROUNDS)
                if remeasure_rounds is None else int(remeasure_rounds)
            ),
            accept_noisy=bool(accept_noisy),
            sources={
                "max_spread_pct": default if max_spread_pct is None else "flag",
                "max_heldout_pct": default if max_heldout_pct is None else "flag",
                "remeasure_rounds": (
                    ("default" if device_kind not in KIND_REMEASURE_ROUNDS else default)
                    if remeasure_rounds is None else "flag"
                ),
                "accept_noisy": "flag" if accept_noisy else "default",
            },
        )


def check_bounds(
    max_spread_pct: float | None, max_heldout_pct: float | None, remeasure_rounds: int | None
) -> None:
    """Refuse gate bounds no run can use (None: not given), naming the flag.

    Raises
    ------
    InputError
        A bound that is not a finite number > 0, or re-measure rounds outside
        ``0..MAX_REMEASURE_ROUNDS``.
    """
    for name, value in (
        ("--max-spread-pct", max_spread_pct),
        ("--max-heldout-pct", max_heldout_pct),
    ):
        if value is not None and not (
            isinstance(value, (int, float)) and math.isfinite(value) and value > 0
        ):
            raise InputError(name, value, "a finite percentage > 0, e.g. 10")
    if remeasure_rounds is not None and not (
        isinstance(remeasure_rounds, int) and 0 <= remeasure_rounds <= MAX_REMEASURE_ROUNDS
    ):
        raise InputError(
            "--remeasure-rounds", remeasure_rounds, f"an integer in 0..{MAX_REMEASURE_ROUNDS}"
        )


# ------------------------------------------------------------------------- spread and rounds


def spread_pct(step_ms: Sequence[float]) -> float | None:
    """``(max - min) / median`` of ``step_ms`` in %; None with fewer than two windows."""
    if len(step_ms) < 2:
        return None
    x = np.asarray(step_ms, dtype=float)
    return float(100.0 * (x.max() - x.min()) / np.median(x))


def point_key(row: Mapping[str, Any]) -> tuple:
    """``GridPoint.key`` of a measurement row (the layout appended for a spread point)."""
    return window_key(row)[:-1]


def rounds_of(
    rows: Iterable[Mapping[str, Any]], windows_per_point: int
) -> dict[tuple[int, int, int, int], dict[int, dict[int, Mapping[str, Any]]]]:
    """``{point key: {round: {window index: row}}}`` (round = window index // w)."""
    out: dict[tuple[int, int, int, int], dict[int, dict[int, Mapping[str, Any]]]] = {}
    for row in rows:
        wi = int(row["window_index"])
        rnd = out.setdefault(point_key(row), {}).setdefault(wi // windows_per_point, {})
        rnd[wi] = row
    return out


def round_spreads(
    rounds: Mapping[int, Mapping[int, Mapping[str, Any]]],
    windows_per_point: int,
    early: EarlyStop | None = None,
    *,
    judge: bool = True,
) -> dict[int, float | None]:
    """Spread (%) of every complete round of one point, in round order: a round of
    ``windows_per_point`` windows, or a round 0 that ``early`` stopped (``EarlyStop.stopped``)."""
    return {
        r: spread_pct([float(row["step_ms"]) for _, row in sorted(windows.items())])
        for r, windows in sorted(rounds.items())
        if len(windows) == windows_per_point
        or (r == 0 and early is not None and early.stopped(windows, judge=judge))
    }


@dataclass(frozen=True)
class EarlyStop:
    """The adaptive window count of round 0 (module docstring).

    Attributes
    ----------
    windows_per_point : the most windows round 0 takes.
    min_windows : windows every point gets first (2 .. ``windows_per_point - 1``).
    spread_pct : a point whose first windows spread more than this (%) gets the rest.
    """

    windows_per_point: int
    min_windows: int
    spread_pct: float

    def __post_init__(self) -> None:
        if not 2 <= self.min_windows < self.windows_per_point:
            raise InputError("min_windows_per_point", self.min_windows,
                             f"an integer in 2..{self.windows_per_point - 1}")
        if not (math.isfinite(self.spread_pct) and self.spread_pct > 0):
            raise InputError("early_stop_spread_pct", self.spread_pct, "a finite percentage > 0")

    @classmethod
    def of(cls, cfg: Any, gate: GateConfig) -> EarlyStop | None:
        """The rule of an effective ``CalibrationConfig`` and gate (None: a fixed count); the
        bound is ``cfg.early_stop_spread_pct`` (the gate's ``max_spread_pct`` if None), capped
        by ``max_spread_pct``."""
        if not cfg.adaptive_windows:
            return None
        bound = gate.max_spread_pct
        if cfg.early_stop_spread_pct is not None:
            bound = min(bound, float(cfg.early_stop_spread_pct))
        return cls(cfg.windows_per_point, cfg.min_windows_per_point, bound)

    @property
    def first(self) -> range:
        """Window indices every point gets."""
        return range(self.min_windows)

    @property
    def rest(self) -> range:
        """Window indices of round 0 a point with spread first windows gets."""
        return range(self.min_windows, self.windows_per_point)

    def stopped(self, windows: Mapping[int, Mapping[str, Any]], *, judge: bool = True) -> bool:
        """Whether round 0's ``windows`` (``{window index: row}``) are exactly the first ones
        and within the bound (a complete round 0). ``judge=False`` skips the bound: the fit's
        selection, after every due window was measured, on rows the probe clock may have
        re-priced (``timing.at_run_speed``), which must not undo the journal's decision."""
        if sorted(windows) != list(self.first):
            return False
        if not judge:
            return True
        spread = spread_pct([float(row["step_ms"]) for _, row in sorted(windows.items())])
        return spread is not None and spread <= self.spread_pct

    def to_dict(self) -> dict[str, Any]:
        return {"windows_per_point": self.windows_per_point, "min_windows": self.min_windows,
                "spread_pct": self.spread_pct}


def points_for_more_windows(
    rows: Iterable[Mapping[str, Any]], points: Sequence[GridPoint], early: EarlyStop
) -> tuple[GridPoint, ...]:
    """The points whose rest of round 0 is due: every first window is measured and their
    spread is beyond ``early.spread_pct``. A function of the journal's rows only."""
    by_point = rounds_of(rows, early.windows_per_point)
    due = []
    for p in points:
        first = {i: row for i, row in by_point.get(p.key, {}).get(0, {}).items()
                 if i in early.first}
        if len(first) == early.min_windows and not early.stopped(first):
            due.append(p)
    return tuple(due)


def is_noisy(spread: float | None, gate: GateConfig) -> bool:
    """A round is noisy when its spread is known and above the bound."""
    return spread is not None and spread > gate.max_spread_pct


def points_to_remeasure(
    rows: Iterable[Mapping[str, Any]],
    points: Sequence[GridPoint],
    windows_per_point: int,
    round_index: int,
    gate: GateConfig,
    early: EarlyStop | None = None,
) -> tuple[GridPoint, ...]:
    """The points whose round ``round_index`` (>= 1) is due: rounds ``0 .. round_index - 1`` are
    all complete (round 0 possibly stopped by ``early``) and all noisy. A function of the
    journal's rows only (module docstring)."""
    if round_index < 1 or round_index > gate.remeasure_rounds:
        return ()
    by_point = rounds_of(rows, windows_per_point)
    due = []
    for p in points:
        spreads = round_spreads(by_point.get(p.key, {}), windows_per_point, early)
        earlier = [r for r in range(round_index) if r in spreads]
        if len(earlier) == round_index and all(is_noisy(spreads[r], gate) for r in earlier):
            due.append(p)
    return tuple(due)


@dataclass(frozen=True)
class PointQuality:
    """The rounds of one point; the fit pools rounds ``0 .. kept_round`` (every complete one)."""

    point: GridPoint
    spreads: tuple[float | None, ...]  # per complete round, in round order
    kept_round: int  # the last round the fit uses (it pools rounds 0 .. kept_round)
    noisy: bool  # every round is above the bound (no re-measurement came out quiet)

    @property
    def kept_spread(self) -> float | None:
        """The largest spread among the rounds the fit uses (None when none is measurable)."""
        known = [s for s in self.spreads[: self.kept_round + 1] if s is not None]
        return max(known) if known else None

    def to_dict(self) -> dict[str, Any]:
        p = self.point
        return {
            "context_index": p.context_index,
            "bcap": p.bcap,
            "g": p.g,
            "k": p.k,
            "spread_pct": list(self.spreads),
            "kept_round": self.kept_round,
            "noisy": self.noisy,
        }


@dataclass(frozen=True)
class Selection:
    """The windows the fit uses (every complete round of each point) and every point's record."""

    rows: list[dict[str, Any]]
    points: tuple[PointQuality, ...]

    @property
    def flagged(self) -> tuple[PointQuality, ...]:
        """Points whose first round was noisy (re-measured or not)."""
        return tuple(q for q in self.points if len(q.spreads) > 1 or q.noisy)

    @property
    def noisy(self) -> tuple[PointQuality, ...]:
        """Points above the spread bound in every round."""
        return tuple(q for q in self.points if q.noisy)

    @property
    def spread_max_pct(self) -> float | None:
        """The largest spread among the rounds the fit uses (None when none is measurable)."""
        known = [q.kept_spread for q in self.points if q.kept_spread is not None]
        return max(known) if known else None

    @property
    def last_round_spread_max_pct(self) -> float | None:
        """The largest spread of each point's last complete round: the machine's noise once
        re-measuring is done (a slow window of a re-measured point's first round stays in
        :attr:`spread_max_pct`, since the fit pools it)."""
        known = [q.spreads[q.kept_round] for q in self.points
                 if q.spreads and q.spreads[q.kept_round] is not None]
        return max(known) if known else None


def select_windows(
    rows: Iterable[Mapping[str, Any]],
    points: Sequence[GridPoint],
    windows_per_point: int,
    gate: GateConfig,
    early: EarlyStop | None = None,
) -> Selection:
    """Every complete round of each point, pooled (module docstring); with ``early``, a round
    0 it stopped is complete with its first windows.

    A point without any complete round (an interrupted run is never fitted, so only rows of a
    journal edited by hand) keeps all of its windows; windows of an incomplete last round are
    left out (the re-measurement was cut short: a partial round would weigh its windows unlike
    the others').
    """
    by_point = rounds_of(rows, windows_per_point)
    kept: list[dict[str, Any]] = []
    records = []
    for p in points:
        rounds = by_point.get(p.key, {})
        spreads = round_spreads(rounds, windows_per_point, early, judge=False)
        if not spreads:
            kept.extend(dict(r) for w in rounds.values() for r in w.values())
            continue
        # Complete rounds are 0 .. n-1: a round is only due after every earlier one completed.
        for r in sorted(spreads):
            kept.extend(dict(row) for _, row in sorted(rounds[r].items()))
        records.append(
            PointQuality(
                point=p,
                spreads=tuple(spreads[r] for r in sorted(spreads)),
                kept_round=max(spreads),
                noisy=all(is_noisy(s, gate) for s in spreads.values()),
            )
        )
    kept.sort(key=lambda r: (int(r["window_index"]), point_key(r)))
    return Selection(rows=kept, points=tuple(records))


# ------------------------------------------------------------------------- held-out error


@dataclass(frozen=True)
class HeldOut:
    """The gated held-out error of a table: the worst context's LOPO mean absolute error."""

    pct: float | None  # None: no point could be held out in any context
    context_index: int | None
    n_evaluated: int

    def passes(self, gate: GateConfig) -> bool:
        return self.pct is None or self.pct <= gate.max_heldout_pct


def held_out(table: Any) -> HeldOut:
    """:class:`HeldOut` of a ``CostTable`` or the ``TableFit`` it is assembled from (their
    fits' ``diagnostics.leave_one_point_out``)."""
    worst: tuple[float, int] | None = None
    n = 0
    for fit in table.fits:
        e = fit.diagnostics.leave_one_point_out
        n += e.n_evaluated
        if e.mean_abs_pct is not None and (worst is None or e.mean_abs_pct > worst[0]):
            worst = (float(e.mean_abs_pct), fit.context_index)
    if worst is None:
        return HeldOut(pct=None, context_index=None, n_evaluated=n)
    return HeldOut(pct=worst[0], context_index=worst[1], n_evaluated=n)


def describe_point(q: PointQuality) -> str:
    """``Bcap=2 G=4 k=3: 23.1 % -> 2.0 %`` (spread of every round)."""
    p = q.point
    spreads = " -> ".join("n/a" if s is None else f"{s:.1f} %" for s in q.spreads)
    ctx = f"context {p.context_index} " if p.context_index else ""
    return f"{ctx}Bcap={p.bcap} G={p.g} k={p.k}: {spreads}"
