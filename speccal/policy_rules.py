"""Pure decision rules of the speculation policies (numpy only, no torch, no state).

Owns the one implementation of each rule of SPEC section 6 that both the live policy objects
(``speccal.policy``) and the vectorised replay (``speccal.replay``) call:

- adaptive draft step: :func:`position_counts`, :func:`prefix_acceptance` (and its plain-list
  twin :func:`prefix_acceptance_list`),
  :func:`score_steps`, :func:`choose_step`;
- adaptive target verify: :func:`survival`, :func:`survival_curve` / :func:`survival_curves`,
  :func:`choose_budget`, :func:`allocate_prefixes_batch` (the prefix allocation rule, over
  rounds; :func:`allocate_prefixes` is its one-round call), on the grid of
  :data:`CURVE_RESOLUTION`. ``speccal.runner.verify_alloc.allocate_prefixes_device`` is the
  device twin of the allocation rule, tested against it.

Layouts: ``w`` is the draft width; per-position arrays are ``[w]`` indexed by draft position
``i = 0..w-1``; step arrays ``[..., w]`` are indexed by ``k - 1`` for ``k = 1..w``; draft scores
are ``[B, w]`` (draft probability of the selected token at each position).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: Relative slack on the min-gain test: a gain that equals ``switch_min_gain`` up to float
#: rounding (e.g. 1.05 * x computed two ways) must not switch; "strictly above" is meant.
GAIN_RTOL = 1e-9

#: Resolution of survival curves: grid points per draft row per request (x = q / Q).
CURVE_RESOLUTION = 4


# --------------------------------------------------------------------------------------------
# Adaptive draft step: pure rules
# --------------------------------------------------------------------------------------------


def position_counts(
    accepted: np.ndarray, k: int, draft_width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-position survival counts of one batch, ``([w], [w])``.

    ``survived[i]`` = requests whose first ``i + 1`` drafts were accepted; ``reached[i]`` =
    requests whose first ``i`` drafts were accepted (``B`` at ``i = 0``). Positions ``i >= k``
    were not drafted: both are 0 there.
    """
    acc = np.asarray(accepted, dtype=np.int64)
    i = np.arange(draft_width)
    survived = (acc[:, None] >= i + 1).sum(axis=0).astype(np.float64)
    reached = np.concatenate(([float(acc.size)], survived[:-1]))
    drafted = i < k
    return np.where(drafted, survived, 0.0), np.where(drafted, reached, 0.0)


def prefix_acceptance(survived: np.ndarray, reached: np.ndarray) -> np.ndarray | None:
    """Prefix acceptance ``p_i = prod_{j <= i} c_j`` (SPEC: requests whose first ``i + 1`` drafts
    were all accepted), ``[w]``; None without feedback. Chained from conditional rates so that a
    window mixing different ``k`` stays monotone."""
    p = prefix_acceptance_list(_floats(survived), _floats(reached))
    return None if p is None else np.asarray(p)


def prefix_acceptance_list(survived: list[float], reached: list[float]) -> list[float] | None:
    """:func:`prefix_acceptance` on plain float lists (the replay's per-re-scoring hot path)."""
    c = _conditional(survived, reached)
    if c is None:
        return None
    out, acc = [], 1.0
    for ci in c:
        acc *= ci
        out.append(acc)
    return out


def _conditional(s: list[float], r: list[float]) -> list[float] | None:
    # Plain floats: w is tiny and this runs once per re-scoring in a 10^6-round replay, where
    # numpy's per-call overhead would dominate.
    if r[0] <= 0:
        return None
    c = []
    last = 1.0
    for si, ri in zip(s, r, strict=True):
        if ri > 0:
            last = si / ri
        c.append(last)
    return c


def _floats(x: Sequence[float] | np.ndarray) -> list[float]:
    """Plain float list of a small vector."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64).tolist()
    return x if isinstance(x, list) else [float(v) for v in x]


def score_steps(
    prefix: np.ndarray, costs: np.ndarray, num_requests: np.ndarray | int
) -> np.ndarray:
    """Predicted tokens per ms of each ``k``: ``B * (1 + sum(p[:k])) / cost_ms(k)``.

    ``prefix`` is ``[..., w]``, ``costs`` ``[..., w]`` (index ``k - 1``); NaN where uncalibrated.
    """
    prefix = np.asarray(prefix, dtype=np.float64)
    b = np.asarray(num_requests, dtype=np.float64)[..., None]
    return b * (1.0 + np.cumsum(prefix, axis=-1)) / np.asarray(costs, dtype=np.float64)


def choose_step(
    prefix: np.ndarray | None,
    costs: np.ndarray,
    num_requests: int,
    current_k: int,
    switch_min_gain: float,
) -> tuple[int, str, float]:
    """One re-scoring of the adaptive draft step: ``(k, reason, predicted_gain)``.

    Scores are :func:`score_steps`: ``B * (1 + sum(p[:k])) / cost_ms(k)``.

    - no feedback yet -> full width (``warmup``);
    - every candidate uncalibrated -> full width (``uncalibrated``);
    - the current ``k`` uncalibrated -> the best calibrated ``k`` (``switch``, gain inf);
    - otherwise switch to the argmax only if ``score(best) / score(current) - 1`` is strictly
      above ``switch_min_gain`` (``switch``), else keep ``current_k`` (``hold``).
    Ties in the argmax go to the smaller ``k`` (less work for the same prediction).
    """
    w = len(costs)
    if prefix is None:
        return w, "warmup", math.nan
    # Scalar loop (same formula as score_steps): w is tiny and this runs per re-scoring.
    scores = []
    total = 1.0
    for p, c in zip(_floats(prefix), _floats(costs), strict=True):
        total += p
        scores.append(num_requests * total / c if c > 0 else math.nan)  # NaN > 0 is False
    finite = [x for x in scores if math.isfinite(x)]
    if not finite:
        return w, "uncalibrated", math.nan
    top = max(finite)
    best = scores.index(top) + 1
    cur = scores[current_k - 1]
    if not math.isfinite(cur):
        return best, "switch", math.inf
    gain = top / cur - 1.0
    if best != current_k and gain > switch_min_gain * (1.0 + GAIN_RTOL) + GAIN_RTOL:
        return best, "switch", gain
    return current_k, "hold", gain


# --------------------------------------------------------------------------------------------
# Adaptive target verify: pure rules
# --------------------------------------------------------------------------------------------


def survival(scores: np.ndarray) -> np.ndarray:
    """Prefix survival ``prod_{j <= i} s_j`` per request and position (same shape as scores).

    Scores are clipped to ``[0, 1]`` so survival never increases along a prefix; NaN (not
    drafted) counts as 0.
    """
    # fmax first: NaN -> 0 (fmax takes the number), then at most 1 (np.clip's values, without
    # nan_to_num's passes)
    s = np.fmin(np.fmax(np.asarray(scores, dtype=np.float64), 0.0), 1.0)
    return np.cumprod(s, axis=-1)


def allocate_prefixes(scores: np.ndarray, budget_rows: int) -> np.ndarray:
    """Prefix-closed verify allocation of one round inside a budget: ``verify_tokens`` ``[B]``.

    :func:`allocate_prefixes_batch` on one round (the rule is written once, there).

    Parameters
    ----------
    scores : ``[B, w]`` draft probabilities of the selected tokens.
    budget_rows : draft rows the target may verify in total (``g - B``), clipped to ``[0, B*w]``.
    """
    s = np.asarray(scores, dtype=np.float64)
    b = s.shape[0]
    return allocate_prefixes_batch(s[None], np.array([b]), np.array([budget_rows]))[0]


def allocate_prefixes_batch(
    scores: np.ndarray,
    num_requests: np.ndarray,
    budget_rows: np.ndarray,
    *,
    presurvived: bool = False,
) -> np.ndarray:
    """Prefix-closed verify allocation inside a budget, over rounds: ``[R, Bmax, w]`` -> ``[R, Bmax]``.

    The rule (the reference of the device allocation): round ``r``'s ``m = budget_rows[r]`` draft
    rows (target rows minus the ``B`` bonus rows, clipped to ``[0, B*w]``) go to the (request,
    position) items of highest prefix survival first; ties go to the shallower position, then the
    lower request index, which keeps every request's allocation a prefix (survival never
    increases along a prefix). Rows ``>= num_requests[r]`` are padding and get 0.

    One sort per round, then a threshold: items above the ``m``-th largest survival are taken,
    and the remaining ``m`` minus that count are taken from the items equal to it in
    position-major order. ``presurvived``: ``scores`` already hold :func:`survival` values.
    """
    s = np.asarray(scores, dtype=np.float64) if presurvived else survival(scores)
    r, bmax, w = s.shape
    nreq = np.asarray(num_requests, dtype=np.int64)
    m = np.clip(np.asarray(budget_rows, dtype=np.int64), 0, nreq * w)
    if bmax * w == 0:
        return np.zeros((r, bmax), dtype=np.int64)
    pad = np.arange(bmax)[None, :, None] >= nreq[:, None, None]
    s = np.where(pad, -1.0, s)
    flat = s.transpose(0, 2, 1).reshape(r, w * bmax)  # position-major: index i * Bmax + b
    top = -np.sort(-flat, axis=1)
    thr = top[np.arange(r), np.maximum(m - 1, 0)][:, None]
    take = m[:, None] > 0
    above = (flat > thr) & take
    need = m - above.sum(axis=1)
    tie = (flat == thr) & take
    chosen = above | (tie & (np.cumsum(tie, axis=1) <= need[:, None]))
    return chosen.reshape(r, w, bmax).sum(axis=1)


def survival_curve(scores: np.ndarray, resolution: int = CURVE_RESOLUTION) -> np.ndarray:
    """Expected accepted drafts per request versus verified draft rows per request, ``[w*Q + 1]``.

    ``f(x)`` = (sum of the top ``x * B`` prefix survivals) / ``B``, on the grid ``x = q / Q``
    (``Q = resolution``), linear between whole items. This is what a budget buys if the scores
    are calibrated acceptance probabilities.
    """
    s = survival(scores)
    return survival_curves(s[None], np.array([s.shape[0]]), resolution, presurvived=True)[0]


def survival_curves(
    scores: np.ndarray,
    num_requests: np.ndarray,
    resolution: int = CURVE_RESOLUTION,
    *,
    presurvived: bool = False,
) -> np.ndarray:
    """Vectorised :func:`survival_curve` over rounds: ``[R, Bmax, w]`` -> ``[R, w*Q + 1]``.

    Rows ``>= num_requests[r]`` of round ``r`` are padding and never counted.
    """
    s = np.asarray(scores, dtype=np.float64) if presurvived else survival(scores)
    r, bmax, w = s.shape
    nreq = np.asarray(num_requests, dtype=np.int64)
    pad = np.arange(bmax)[None, :, None] >= nreq[:, None, None]
    s = np.where(pad, 0.0, s).reshape(r, bmax * w)
    top = np.sort(s, axis=1)[:, ::-1]
    cs = np.zeros((r, bmax * w + 1))
    np.cumsum(top, axis=1, out=cs[:, 1:])  # [R, Bmax*w + 1]: sum of the top-m survivals
    x = np.arange(w * resolution + 1) / resolution
    items = x[None, :] * nreq[:, None]  # [R, n]
    lo = np.floor(items).astype(np.int64)
    hi = np.minimum(lo + 1, bmax * w)
    frac = items - lo
    rows = np.arange(r)[:, None]
    val = cs[rows, lo] * (1 - frac) + cs[rows, hi] * frac
    return val / np.maximum(nreq, 1)[:, None]


def choose_budget(
    curve: np.ndarray | None,
    num_requests: np.ndarray,
    budgets: np.ndarray,
    costs: np.ndarray,
    resolution: int = CURVE_RESOLUTION,
) -> tuple[np.ndarray, np.ndarray]:
    """Padded target budget maximizing predicted tokens per ms; vectorised over batches.

    Predicted tokens of budget ``g`` = ``B * (1 + f((g - B) / B))`` with ``f`` the (window-mean)
    survival curve. Returns ``(g [...], predicted tokens/ms [...])``; full width (the largest
    budget) where there is no curve or every candidate is uncalibrated.

    Parameters
    ----------
    curve : ``[..., w*Q + 1]`` or None (no released feedback yet).
    num_requests : ``[...]`` batch sizes ``B``.
    budgets, costs : ``[..., J]`` from :meth:`speccal.policy.CostModel.verify_candidates` (0 / NaN = missing).
    """
    b = np.asarray(num_requests, dtype=np.float64)
    budgets = np.asarray(budgets)
    costs = np.asarray(costs, dtype=np.float64)
    full = budgets.max(axis=-1)
    if curve is None:
        return full, np.full(full.shape, np.nan)
    curve = np.asarray(curve, dtype=np.float64)
    n = curve.shape[-1]
    w = (n - 1) / resolution
    x = np.clip((budgets - b[..., None]) / np.maximum(b[..., None], 1), 0.0, w) * resolution
    lo = np.minimum(np.floor(x).astype(np.int64), n - 1)
    hi = np.minimum(lo + 1, n - 1)
    frac = x - lo
    if curve.ndim == 1 and lo.ndim == 1:  # one batch (the live policy): plain indexing
        f = curve[lo] * (1 - frac) + curve[hi] * frac
    else:
        f = (np.take_along_axis(curve, lo, -1) * (1 - frac)
             + np.take_along_axis(curve, hi, -1) * frac)
    score = b[..., None] * (1.0 + f) / costs
    score = np.where((budgets > 0) & np.isfinite(score), score, -np.inf)
    best = np.argmax(score, axis=-1)
    if score.ndim == 1:
        best_score, chosen = score[best], budgets[best]
    else:
        best_score = np.take_along_axis(score, best[..., None], -1)[..., 0]
        chosen = np.take_along_axis(budgets, best[..., None], -1)[..., 0]
    ok = np.isfinite(best_score)
    return np.where(ok, chosen, full), np.where(ok, best_score, np.nan)
