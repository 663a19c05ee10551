"""Synthetic acceptance scenarios and a documented synthetic round cost, for replay without a GPU.

A :class:`Scenario` is a list of :class:`Phase` s; each phase fixes the number of rounds, the
batch size ``B``, the mean KV length and the **conditional** acceptance profile ``q[i]`` =
P(draft position ``i`` accepted | positions ``< i`` accepted). Generation (:func:`generate`),
per request and position: the draft score ``s ~ Beta(q * c, (1 - q) * c)`` (``c`` =
``score_concentration``; mean ``q``), the position is accepted with probability ``s`` (so the
score is a calibrated acceptance probability, raised to ``score_power`` when reported, to model
an over- or under-confident draft), and the accepted length is the leading run of accepted
positions. Rounds are drafted at full width, so the trace supports counterfactual ``k``. Every
parameter is recorded in ``trace.meta["scenario"]``.

:func:`synthetic_cost` is the documented stand-in for a calibrated table (see docs/TRACES.md):
``cost_ms = base_ms + k * (draft_ms + draft_ms_per_req * Bcap) + target_ms + target_ms_per_row * G``
where ``k = G / Bcap - 1`` in ``draft_step`` mode and ``k = w`` in ``target_verify`` mode; NaN
(uncalibrated) outside ``[min_kv_length, max_kv_length]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from speccal.base.errors import InputError
from speccal.base.geometry import Geometry, default_request_buckets
from speccal.base.memory import check_fits, host_memory_available
from speccal.costmodel.compat import make_compatibility
from speccal.costmodel.synthetic import make_measurements
from speccal.costmodel.table_build import build_table
from speccal.policy import CostModel
from speccal.trace import RoundTrace

#: Rounds generated per chunk (bounds memory at about 100 MB for B = 16, w = 7).
CHUNK_ROUNDS = 1 << 17


@dataclass(frozen=True)
class Phase:
    """A stretch of rounds with one acceptance profile, batch size and KV length."""

    name: str
    rounds: int
    acceptance: tuple[float, ...]
    num_requests: int = 8
    kv_length: float = 1024.0

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise InputError(f"phase {self.name}.rounds", self.rounds, "an integer >= 1")
        if self.num_requests < 1:
            raise InputError(
                f"phase {self.name}.num_requests", self.num_requests, "an integer >= 1"
            )
        acc = tuple(float(a) for a in self.acceptance)
        if not acc or any(not 0.0 <= a <= 1.0 for a in acc):
            raise InputError(f"phase {self.name}.acceptance", acc, "probabilities in [0, 1]")
        object.__setattr__(self, "acceptance", acc)

    def profile(self, draft_width: int) -> np.ndarray:
        """Conditional acceptance ``[w]``; a short profile repeats its last value."""
        acc = list(self.acceptance[:draft_width])
        acc += [acc[-1]] * (draft_width - len(acc))
        return np.asarray(acc)


@dataclass(frozen=True)
class Scenario:
    """A named sequence of phases plus the score model's parameters and the seed."""

    name: str
    draft_width: int
    phases: tuple[Phase, ...]
    score_concentration: float = 4.0
    score_power: float = 1.0
    seed: int = 0
    params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.draft_width < 1:
            raise InputError("draft_width", self.draft_width, "an integer >= 1")
        if not self.phases:
            raise InputError("phases", [], "at least one phase")
        if not self.score_concentration > 0:
            raise InputError("score_concentration", self.score_concentration, "a number > 0")
        if not self.score_power > 0:
            raise InputError("score_power", self.score_power, "a number > 0")
        rounds = sum(p.rounds for p in self.phases)
        rows = sum(p.rounds * p.num_requests for p in self.phases)
        check_fits(
            trace_nbytes(rounds, rows, self.draft_width),
            host_memory_available(),
            field="rounds x num_requests",
            value=f"{rounds} rounds, {rows} request rows",
            what="scenario trace",
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["phases"] = [asdict(p) | {"acceptance": list(p.acceptance)} for p in self.phases]
        return d


def trace_nbytes(rounds: int, rows: int, draft_width: int) -> int:
    """Bytes :func:`generate` holds for a trace of ``rounds`` rounds and ``rows`` request rows:
    per row a float32 score per draft position and an int64 accepted length, per round four
    8-byte columns, each twice (the per-phase parts and the concatenated trace), plus one
    chunk's draws (:data:`CHUNK_ROUNDS`)."""
    per_row = 4 * draft_width + 8
    chunk = CHUNK_ROUNDS * max(rows // max(rounds, 1), 1) * (8 + 4 + 4 + 1 + 8) * draft_width
    return 2 * (rows * per_row + rounds * 32) + min(chunk, rows * 25 * draft_width)


def generate(scenario: Scenario) -> RoundTrace:
    """Draw a full-width round trace from a scenario (seeded; see module docstring)."""
    w = scenario.draft_width
    rng = np.random.default_rng(scenario.seed)
    nreq, kv, phase, acc_parts, score_parts = [], [], [], [], []
    c = scenario.score_concentration
    for pi, ph in enumerate(scenario.phases):
        q = np.clip(ph.profile(w), 1e-4, 1 - 1e-4)
        nreq.append(np.full(ph.rounds, ph.num_requests, dtype=np.int64))
        kv.append(np.full(ph.rounds, float(ph.kv_length)))
        phase.append(np.full(ph.rounds, pi, dtype=np.int64))
        left = ph.rounds
        while left > 0:
            n = min(left, CHUNK_ROUNDS) * ph.num_requests
            s = rng.beta(q * c, (1 - q) * c, size=(n, w)).astype(np.float32)
            ok = rng.random((n, w), dtype=np.float32) < s
            acc_parts.append(np.cumprod(ok, axis=1).sum(axis=1).astype(np.int64))
            score_parts.append(s if scenario.score_power == 1.0 else s**scenario.score_power)
            left -= n // ph.num_requests
    nreq_a = np.concatenate(nreq)
    return RoundTrace(
        draft_width=w,
        num_requests=nreq_a,
        kv_length=np.concatenate(kv),
        k=np.full(nreq_a.size, w, dtype=np.int64),
        accepted=np.concatenate(acc_parts),
        draft_scores=np.concatenate(score_parts),
        phase=np.concatenate(phase),
        meta={
            "source": "scenario",
            "scenario": scenario.to_dict(),
            "phases": [p.name for p in scenario.phases],
        },
    )


def _geometric(q0: float, decay: float, w: int) -> tuple[float, ...]:
    return tuple(round(q0 * decay**i, 6) for i in range(w))


def make_scenario(
    name: str,
    *,
    rounds: int = 20_000,
    draft_width: int = 5,
    num_requests: int = 8,
    kv_length: float = 1024.0,
    seed: int = 0,
    score_concentration: float = 4.0,
    score_power: float = 1.0,
) -> Scenario:
    """One of the named scenarios in :data:`SCENARIOS`, scaled to ``rounds`` total rounds.

    - ``steady``: one phase, conditional acceptance 0.8 decaying 5% per position;
    - ``transition``: easy (0.9 flat) for the first half, then hard (0.45 flat);
    - ``batch_change``: steady profile with ``B`` = num_requests, 4x, then num_requests / 4;
    - ``decay``: four phases of falling acceptance 0.95, 0.8, 0.6, 0.4.
    """
    if name not in SCENARIOS:
        raise InputError("scenario", name, f"one of {sorted(SCENARIOS)}")
    if rounds < 4:
        raise InputError("rounds", rounds, "an integer >= 4")
    w, b, kv = draft_width, num_requests, kv_length
    if name == "steady":
        phases = (Phase("steady", rounds, _geometric(0.8, 0.95, w), b, kv),)
    elif name == "transition":
        half = rounds // 2
        phases = (
            Phase("easy", half, (0.9,), b, kv),
            Phase("hard", rounds - half, (0.45,), b, kv),
        )
    elif name == "batch_change":
        third = rounds // 3
        prof = _geometric(0.8, 0.95, w)
        phases = (
            Phase(f"B={b}", third, prof, b, kv),
            Phase(f"B={4 * b}", third, prof, 4 * b, kv),
            Phase(f"B={max(b // 4, 1)}", rounds - 2 * third, prof, max(b // 4, 1), kv),
        )
    else:  # decay
        quarter = rounds // 4
        levels = (0.95, 0.8, 0.6, 0.4)
        phases = tuple(
            Phase(f"q={q}", quarter if i < 3 else rounds - 3 * quarter, (q,), b, kv)
            for i, q in enumerate(levels)
        )
    return Scenario(
        name=name,
        draft_width=w,
        phases=phases,
        score_concentration=score_concentration,
        score_power=score_power,
        seed=seed,
        params={"rounds": rounds, "num_requests": b, "kv_length": kv},
    )


SCENARIOS = ("steady", "transition", "batch_change", "decay")


@dataclass(frozen=True)
class SyntheticCost:
    """Parameters of the documented synthetic round cost (ms; see module docstring)."""

    base_ms: float = 2.0
    draft_ms: float = 0.8
    draft_ms_per_req: float = 0.02
    target_ms: float = 6.0
    target_ms_per_row: float = 0.05
    min_kv_length: float = 1.0
    max_kv_length: float = 4096.0


def synthetic_cost(
    geometry: Geometry, mode: str = "draft_step", params: SyntheticCost | None = None
) -> CostModel:
    """A :class:`~speccal.policy.CostModel` from :class:`SyntheticCost` over ``geometry``.

    Only captured ``(Bcap, G)`` points are calibrated; other points and KV lengths outside the
    interval are NaN, as a real table answers.
    """
    p = params or SyntheticCost()
    w = geometry.draft_width
    legal = {(b, g) for b, gs in geometry.target_rows.items() for g in gs}
    legal_arr = np.array(sorted(legal), dtype=np.int64)

    def cost(bcap: np.ndarray, g: np.ndarray, kv_length: np.ndarray) -> np.ndarray:
        bcap = np.asarray(bcap, dtype=np.int64)
        g = np.asarray(g, dtype=np.int64)
        kv = np.asarray(kv_length, dtype=np.float64)
        key = bcap * (1 << 32) + g
        ok = np.isin(key, legal_arr[:, 0] * (1 << 32) + legal_arr[:, 1])
        ok &= (kv >= p.min_kv_length) & (kv <= p.max_kv_length)
        k = (
            np.full(bcap.shape, float(w))
            if mode == "target_verify"
            else np.maximum(g // np.maximum(bcap, 1) - 1, 0)
        )
        ms = (
            p.base_ms
            + k * (p.draft_ms + p.draft_ms_per_req * bcap)
            + p.target_ms
            + p.target_ms_per_row * g
        )
        return np.where(ok, ms, np.nan)

    return CostModel(cost=cost, geometry=geometry, mode=mode)


@dataclass(frozen=True)
class SyntheticTableTruth:
    """Additive truth of :func:`synthetic_table` (ms): ``bias + per_bcap * Bcap + per_row * G``.

    ``draft_step`` rows price the draft forwards into ``per_row`` (G grows with k); in
    ``target_verify`` mode the ``w`` draft forwards are fixed and folded into ``bias`` and
    ``per_bcap`` (``draft_ms`` and ``draft_ms_per_req`` per step).
    """

    bias_ms: float = 6.0
    per_bcap_ms: float = 0.1
    per_row_ms: float = 0.2
    verify_per_row_ms: float = 0.05
    draft_ms: float = 0.8
    draft_ms_per_req: float = 0.02
    noise_ms: float = 0.05
    min_kv_length: int = 1
    max_kv_length: int = 4096
    seed: int = 0


def synthetic_table(
    geometry: Geometry, mode: str = "draft_step", truth: SyntheticTableTruth | None = None
):
    """A real ``CostTable`` fitted (additive) on synthetic measurement rows over ``geometry``.

    Rows come from ``speccal.costmodel.synthetic.make_measurements`` with the
    :class:`SyntheticTableTruth`, three windows per captured point and Gaussian noise, then
    ``speccal.costmodel.table_build.build_table`` fits them, so replay exercises the same code path
    as with a calibrated table. Compatibility metadata says ``synthetic``. In ``draft_step``
    mode a point whose G is not a multiple of its Bcap is recorded as the partial batch that
    reaches it (``k = ceil(G / Bcap) - 1``, ``B = G // (k + 1)``).
    """
    t = truth or SyntheticTableTruth()
    w = geometry.draft_width
    if mode == "target_verify":
        bias = t.bias_ms + w * t.draft_ms
        per_b, per_row = t.per_bcap_ms + w * t.draft_ms_per_req, t.verify_per_row_ms
    else:
        bias, per_b, per_row = t.bias_ms, t.per_bcap_ms, t.per_row_ms
    gs = sorted({g for rows in geometry.target_rows.values() for g in rows})
    points = [(b, g) for b, rows in geometry.target_rows.items() for g in rows]
    df = make_measurements(
        bias_ms=bias,
        alpha_ms={b: per_b * b for b in geometry.request_buckets},
        theta_ms={g: per_row * g for g in gs},
        points=points,
        draft_width=w,
        mode=mode,
        contexts=((min(2048, t.max_kv_length), t.min_kv_length, t.max_kv_length),),
        noise_ms=t.noise_ms,
        seed=t.seed,
    )
    if mode == "draft_step":
        # A captured G that is not a multiple of Bcap is reached by a partial batch: B requests
        # drafting k, B * (k + 1) rows padded up to G (measurements.check_shapes).
        b, g = df["bcap"].to_numpy(), df["g"].to_numpy()
        k = -(-g // b) - 1
        df = df.assign(k=k, num_requests=np.minimum(b, g // (k + 1)))
    compat = make_compatibility(
        draft_width=w,
        architecture="synthetic",
        fingerprint="synthetic",
        dtype="float32",
        quantization="none",
        verification_mode="synthetic",
        device_name="synthetic",
    )
    return build_table(df, compatibility=compat, geometry=geometry)


def scenario_geometry(draft_width: int, max_requests: int) -> Geometry:
    """Default split-graph geometry covering ``max_requests`` (power-of-two request buckets)."""
    return Geometry(
        draft_width=draft_width, request_buckets=default_request_buckets(max(max_requests, 1))
    )


def max_batch(trace: RoundTrace) -> int:
    return int(trace.num_requests.max())


__all__: Sequence[str] = (
    "Phase",
    "Scenario",
    "SCENARIOS",
    "SyntheticCost",
    "generate",
    "make_scenario",
    "scenario_geometry",
    "synthetic_cost",
    "synthetic_table",
    "SyntheticTableTruth",
)
