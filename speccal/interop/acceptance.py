"""Measured acceptance of full-width rounds, and its conversion into a speccal round trace.

An :class:`Acceptance` is what an engine's acceptance data says once parsed: one accepted
length ``a`` (drafts accepted, ``0..w``, the bonus token not counted) per (request, speculative
step), every step drafted at full width ``w``. Rows may carry the round they ran in (a recorded
batch) and their KV length. Engines that only publish counters give a histogram
``counts[j]`` = steps that accepted exactly ``j`` drafts; :func:`from_histogram` expands it into
rows (shuffled with a fixed seed, so any batch of rows is a fair sample), exactly when there are
at most ``max_rows`` steps and scaled down by largest-remainder rounding otherwise
(``exact = False``; per-position acceptance then within ``1 / max_rows``).

:meth:`Acceptance.to_trace` batches rows into rounds (the recorded rounds, else consecutive
groups of ``num_requests``) and returns a full-width :class:`~speccal.trace.RoundTrace` without
draft scores (no engine format here publishes them). Per-position (prefix) acceptance
``p_i`` = fraction of steps with ``a >= i + 1`` is the same in the rows and in the trace:
``trace.survival_counts().sum(axis=0) / N``.

Steps of a dynamic-K deployment draft ``d <= w`` tokens, so position ``j`` (0-based) is only
verified when ``d >= j + 1``. :func:`prefix_from_draft_lengths` estimates per-position prefix
acceptance from ``counts[d, a]`` (steps that drafted ``d`` and accepted ``a``) with the
product-limit (Kaplan-Meier) estimator: a step that accepted all ``d`` of its drafts is censored
at ``d`` (its position ``d`` was never verified), any other step fails at position ``a``.
Position ``j``'s conditional acceptance is ``q_j = passed_j / reached_j`` over the steps that
verified it (``reached_j``: ``d >= j + 1`` and ``a >= j``; ``passed_j``: ``d >= j + 1`` and
``a >= j + 1``) and ``p_j = q_0 * ... * q_j``. It is unbiased when the draft length does not
depend on how the step's drafts would be accepted (a batch-size schedule: ``K`` follows the batch,
not the tokens); pooling the per-position counts over the steps instead (``per_pos / steps``)
counts every short draft as a rejection at its unverified positions and is biased low.
:func:`from_draft_lengths` turns that estimate into full-width rows (``exact = False``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speccal.base.errors import InputError
from speccal.trace import RoundTrace

#: Steps an imported histogram is expanded into at most (about 2 MB of trace).
MAX_ROWS = 1 << 18
#: Rows a profile given only as rates is expanded into.
PROFILE_ROWS = 1 << 14


@dataclass(frozen=True, eq=False)
class Acceptance:
    """Accepted drafts per (request, step) of full-width rounds (see module docstring)."""

    draft_width: int
    accepted: np.ndarray  # [N] int64 in 0..w
    round_ids: np.ndarray | None = None  # [N] int64: rows sharing an id ran in one round
    kv_length: np.ndarray | None = None  # [N] float64 per row
    exact: bool = True
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        w = int(self.draft_width)
        if w < 1:
            raise InputError("draft_width", self.draft_width, "an integer >= 1")
        acc = np.asarray(self.accepted, dtype=np.int64).reshape(-1)
        if acc.size == 0:
            raise InputError("acceptance", "0 steps", "at least one speculative step")
        if acc.min() < 0 or acc.max() > w:
            bad = int(acc[(acc < 0) | (acc > w)][0])
            raise InputError("accepted", bad, f"accepted drafts in 0..draft_width={w}")
        object.__setattr__(self, "draft_width", w)
        object.__setattr__(self, "accepted", acc)
        for name in ("round_ids", "kv_length"):
            v = getattr(self, name)
            if v is not None:
                arr = np.asarray(v, dtype=np.int64 if name == "round_ids" else np.float64)
                if arr.shape != acc.shape:
                    raise InputError(name, arr.shape, f"one value per step ({acc.size})")
                object.__setattr__(self, name, arr)

    @property
    def num_steps(self) -> int:
        return int(self.accepted.size)

    def histogram(self) -> np.ndarray:
        """``[w + 1]``: steps that accepted exactly ``j`` drafts."""
        return np.bincount(self.accepted, minlength=self.draft_width + 1)

    def prefix_acceptance(self) -> np.ndarray:
        """``[w]``: fraction of steps whose first ``i + 1`` drafts were all accepted."""
        return survival_counts(self.histogram()) / self.num_steps

    def to_trace(
        self, num_requests: int, kv_length: float, meta: dict[str, Any] | None = None
    ) -> RoundTrace:
        """Full-width rounds: the recorded ones, else consecutive groups of ``num_requests``.

        ``kv_length`` is used where the rows carry none. The last group may be smaller.
        """
        if num_requests < 1:
            raise InputError("num_requests", num_requests, "an integer >= 1")
        if not kv_length >= 0:
            raise InputError("kv_length", kv_length, "a number >= 0")
        n = self.num_steps
        if self.round_ids is not None:
            order = np.argsort(self.round_ids, kind="stable")
            ids = self.round_ids[order]
            starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
        else:
            order = np.arange(n)
            starts = np.arange(0, n, num_requests)
        sizes = np.diff(np.concatenate((starts, [n])))
        kv_rows = np.full(n, float(kv_length)) if self.kv_length is None else self.kv_length[order]
        kv = np.add.reduceat(kv_rows, starts) / sizes
        w = self.draft_width
        return RoundTrace(
            draft_width=w,
            num_requests=sizes,
            kv_length=kv,
            kv_max_length=None if self.kv_length is None else np.maximum.reduceat(kv_rows, starts),
            k=np.full(sizes.size, w, dtype=np.int64),
            accepted=self.accepted[order],
            draft_scores=None,
            meta={
                "source": "import",
                **self.source,
                "exact": self.exact,
                "steps": n,
                "prefix_acceptance": [round(float(p), 9) for p in self.prefix_acceptance()],
                "phases": ["imported"],
                **(meta or {}),
            },
        )

    def import_summary(self, trace: RoundTrace, path: Any) -> dict[str, Any]:
        """What ``speccal import`` reports of the ``trace`` it wrote at ``path`` from this
        acceptance (``shape``, ``estimator``: which vllm-requests shape was read, how it was
        estimated, when the source says)."""
        out = {
            "path": str(path),
            "format": trace.meta["format"],
            "draft_width": trace.draft_width,
            "rounds": trace.num_rounds,
            "steps": self.num_steps,
            "exact": self.exact,
            "prefix_acceptance": trace.meta["prefix_acceptance"],
        }
        for key in ("shape", "estimator"):
            if key in self.source:
                out[key] = self.source[key]
        return out


def survival_counts(hist: np.ndarray) -> np.ndarray:
    """``[w]`` steps with at least ``i + 1`` accepted drafts, from a ``[w + 1]`` histogram."""
    return np.cumsum(np.asarray(hist)[::-1])[::-1][1:]


def histogram_from_survival(num_steps: int, survival: np.ndarray) -> np.ndarray:
    """The ``[w + 1]`` histogram whose survival counts are ``survival`` (``[w]``) over
    ``num_steps`` steps (vLLM's per-position counters are survival counts)."""
    c = np.concatenate(([num_steps], np.asarray(survival, dtype=np.int64), [0]))
    return c[:-1] - c[1:]


def apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Non-negative integers proportional to ``weights`` summing to ``total`` (largest
    remainder; ties to the lower index)."""
    wts = np.asarray(weights, dtype=np.float64)
    share = wts / wts.sum() * total
    out = np.floor(share).astype(np.int64)
    left = int(total - out.sum())
    if left:
        rem = share - out
        out[np.argsort(-rem, kind="stable")[:left]] += 1
    return out


def from_histogram(
    counts: np.ndarray,
    *,
    source: dict[str, Any],
    max_rows: int = MAX_ROWS,
    seed: int = 0,
) -> Acceptance:
    """Rows of a histogram ``counts[j]`` (steps that accepted exactly ``j`` drafts), shuffled
    with ``seed``; scaled to ``max_rows`` steps when there are more (``exact = False``)."""
    hist = np.asarray(counts, dtype=np.int64)
    total = int(hist.sum())
    if total <= 0:
        raise InputError("acceptance", "0 steps", "at least one speculative step")
    exact = total <= max_rows
    if not exact:
        hist = apportion(hist, max_rows)
    rows = np.repeat(np.arange(hist.size, dtype=np.int64), hist)
    rows = rows[np.random.default_rng(seed).permutation(rows.size)]
    src = dict(source)
    src["counts"] = [int(v) for v in np.asarray(counts, dtype=np.int64)]
    return Acceptance(draft_width=hist.size - 1, accepted=rows, exact=exact, source=src)


def from_prefix(
    prefix: np.ndarray,
    *,
    source: dict[str, Any],
    rows: int = PROFILE_ROWS,
    seed: int = 0,
    field: str = "marginal_accept_rates",
) -> Acceptance:
    """Rows whose prefix acceptance is ``prefix`` (``[w]``, non-increasing, in ``[0, 1]``)
    within ``1 / rows`` (largest-remainder rounding of the implied histogram)."""
    p = np.asarray(prefix, dtype=np.float64).reshape(-1)
    if p.size == 0:
        raise InputError(field, [], "one rate per draft position")
    if not np.isfinite(p).all() or (p < 0).any() or (p > 1).any():
        raise InputError(field, p.tolist(), "rates in [0, 1]")
    rises = np.flatnonzero(np.diff(p) > 1e-9)
    if rises.size:
        i = int(rises[0]) + 1
        raise InputError(
            f"{field}[{i}]",
            float(p[i]),
            f"<= position {i - 1}'s rate {p[i - 1]:g} (all of the first {i + 1} drafts accepted "
            f"cannot be likelier than the first {i})",
        )
    weights = np.concatenate(([1.0], p)) - np.concatenate((p, [0.0]))
    hist = apportion(np.maximum(weights, 0.0), rows)
    acc = from_histogram(hist, source=source, max_rows=rows, seed=seed)
    return Acceptance(
        draft_width=acc.draft_width,
        accepted=acc.accepted,
        exact=False,
        source={**source, "rates": [float(v) for v in p], "rows": int(rows)},
    )


def prefix_from_draft_lengths(
    counts: np.ndarray, field: str = "acceptance_histogram_by_draft_length"
) -> tuple[np.ndarray, np.ndarray]:
    """Product-limit prefix acceptance ``[w]`` and the steps that verified each position
    ``[w]`` from ``counts[d, a]`` (``[w + 1, w + 1]``: steps that drafted ``d`` tokens and
    accepted ``a <= d``); see the module docstring."""
    c = np.asarray(counts, dtype=np.int64)
    w = c.shape[0] - 1
    if w < 1 or c.shape != (w + 1, w + 1) or (c < 0).any():
        raise InputError(field, c.shape, "[w + 1, w + 1] step counts >= 0 (draft length, accepted)")
    if np.triu(c, 1).any():  # c[d, a] with a > d
        raise InputError(field, c.tolist(), "accepted <= the step's draft length")
    prefix = np.zeros(w)
    reached = np.zeros(w, dtype=np.int64)
    p = 1.0
    for j in range(w):
        longer = c[j + 1 :]  # steps whose draft reached position j
        reached[j] = int(longer[:, j:].sum())
        passed = int(longer[:, j + 1 :].sum())
        if reached[j] == 0:
            if p > 0 and not longer.any():
                raise InputError(
                    field,
                    f"no step drafted {j + 1} or more tokens",
                    f"every position 1..{w} verified at least once (position {j + 1} never was)",
                    hint="a deployment that never drafts num_spec_tokens cannot price the "
                    "deepest positions; import with the largest K it ran",
                )
            p = 0.0  # every step that drafted this deep failed earlier
        else:
            p *= passed / reached[j]
        prefix[j] = p
    return prefix, reached


def from_draft_lengths(
    counts: np.ndarray,
    *,
    source: dict[str, Any],
    rows: int = PROFILE_ROWS,
    seed: int = 0,
    field: str = "acceptance_histogram_by_draft_length",
) -> Acceptance:
    """Full-width rows whose prefix acceptance is the product-limit estimate of ``counts[d, a]``
    (within ``1 / rows``); the source records the estimate, its inputs and the estimator."""
    c = np.asarray(counts, dtype=np.int64)
    prefix, reached = prefix_from_draft_lengths(c, field)
    src = {
        **source,
        "estimator": "product-limit over draft lengths (a step that accepted its whole draft "
        "is censored there)",
        "steps_by_draft_length": {str(d): int(n) for d, n in enumerate(c.sum(axis=1)) if n},
        "counts_by_draft_length": c.tolist(),
        "positions_verified": reached.tolist(),
        "prefix_acceptance_estimated": [float(v) for v in prefix],
    }
    return from_prefix(prefix, source=src, rows=rows, seed=seed, field=field)
