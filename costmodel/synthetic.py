"""Synthetic measurement rows from a known additive cost (for tests, the notebook and replay).

The truth is ``step_ms = bias_ms + alpha_ms[bcap] + theta_ms[g] + context offset
+ kv_slope_ms * g * mean_kv_length`` (the KV-aware model's term, 0 by default); each window
adds independent Gaussian noise of standard deviation ``noise_ms`` (clipped so a step never costs
less than ``min_step_ms``). Rows follow the measurement schema of
``speccal.costmodel.measurements`` exactly (``elapsed_s = step_ms * window_steps / 1000``), so
they validate, fit and round-trip like rows from a real calibration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from speccal.base.errors import InputError
from speccal.costmodel.measurements import MODES, validate_measurements

DEFAULT_CONTEXTS: tuple[tuple[int, int, int], ...] = ((2048, 1, 4096),)


def legal_points(
    bcaps: Sequence[int], g_levels: Sequence[int], draft_width: int
) -> list[tuple[int, int]]:
    """Split-graph legal grid: ``(bcap, g)`` with ``g = bcap * j``, ``j = 1 .. w + 1``."""
    gs = set(int(g) for g in g_levels)
    return [
        (int(b), int(b) * j)
        for b in sorted(bcaps)
        for j in range(1, draft_width + 2)
        if int(b) * j in gs
    ]


def make_measurements(
    *,
    bias_ms: float,
    alpha_ms: Mapping[int, float],
    theta_ms: Mapping[int, float],
    points: Sequence[tuple[int, int]] | None = None,
    draft_width: int = 7,
    mode: str = "draft_step",
    contexts: Sequence[tuple[int, int, int]] = DEFAULT_CONTEXTS,
    context_offsets_ms: Sequence[float] | None = None,
    kv_slope_ms: float = 0.0,
    windows_per_point: int = 3,
    window_steps: int = 32,
    noise_ms: float = 0.0,
    min_step_ms: float = 1e-3,
    seed: int = 0,
    shapes: Sequence[tuple[int, int, int, int]] | None = None,
    draft_ms: Mapping[int, float] | None = None,
) -> pd.DataFrame:
    """Measurement rows drawn from a known additive cost plus Gaussian noise.

    Parameters
    ----------
    bias_ms, alpha_ms, theta_ms : the true parameters; ``alpha_ms`` maps Bcap -> ms and
        ``theta_ms`` maps G -> ms (any reference; the fit re-anchors them).
    points : ``(bcap, g)`` pairs to measure; default the split-graph legal grid of
        ``alpha_ms``'s Bcaps and ``theta_ms``'s G (see :func:`legal_points`).
    draft_width : ``w``; sets ``k``: ``g / bcap - 1`` in ``draft_step`` mode (floored, at least
        0), ``w`` in ``target_verify`` mode.
    contexts : ``(prefill_tokens, min_kv_length, max_kv_length)`` per context interval.
    context_offsets_ms : extra cost per context (default 0 for every context).
    kv_slope_ms : ms per verified row and KV token: each window adds
        ``kv_slope_ms * g * mean_kv_length`` at its own (uniformly drawn) mean KV length.
    windows_per_point, window_steps : windows per point and rounds per window.
    noise_ms : standard deviation of per-window Gaussian noise on ``step_ms``.
    seed : seed of ``numpy.random.default_rng``.
    shapes : ``(bcap, g, k, num_requests)`` to measure instead of ``points`` (draft_step: the
        shapes of partly filled buckets, ``speccal.base.geometry.Geometry.draft_step_shapes``).
    draft_ms : Bcap -> ms of one draft forward: a round of ``k`` draft forwards costs ``k *
        draft_ms[bcap]`` more (the draft-forward term of ``speccal.costmodel.additive``).

    Returns
    -------
    A validated measurement DataFrame (one row per window), with ``mode`` set.
    """
    if mode not in MODES:
        raise InputError("mode", mode, f"one of {list(MODES)}")
    if windows_per_point < 1:
        raise InputError("windows_per_point", windows_per_point, "an integer >= 1")
    if noise_ms < 0:
        raise InputError("noise_ms", noise_ms, "a number >= 0")
    if shapes is None:
        if points is None:
            points = legal_points(list(alpha_ms), list(theta_ms), draft_width)
        shapes = [(b, g, draft_width if mode == "target_verify" else max(g // b - 1, 0), b)
                  for b, g in points]
    points = [(b, g) for b, g, _, _ in shapes]
    if not points:
        raise InputError("points", list(points), "at least one (bcap, g) pair")
    offsets = list(context_offsets_ms) if context_offsets_ms is not None else [0.0] * len(contexts)
    if len(offsets) != len(contexts):
        raise InputError("context_offsets_ms", offsets, f"{len(contexts)} values, one per context")
    rng = np.random.default_rng(seed)
    rows = []
    for ci, (prefill, lo, hi) in enumerate(contexts):
        for b, g, k, n in shapes:
            if b not in alpha_ms or g not in theta_ms:
                raise InputError("points", (b, g), "Bcap in alpha_ms and G in theta_ms")
            truth = bias_ms + alpha_ms[b] + theta_ms[g] + offsets[ci]
            truth += k * (draft_ms or {}).get(b, 0.0)
            for w in range(windows_per_point):
                noise = noise_ms * rng.standard_normal()
                kv = float(rng.uniform(lo, hi))  # drawn after the noise: the stream of old seeds
                step_ms = max(truth + kv_slope_ms * g * kv + noise, min_step_ms)
                elapsed_s = step_ms * window_steps / 1000.0
                rows.append(
                    {
                        "context_index": ci,
                        "prefill_tokens": prefill,
                        "min_kv_length": lo,
                        "max_kv_length": hi,
                        "bcap": b,
                        "num_requests": n,
                        "g": g,
                        "k": k,
                        "window_index": w,
                        "window_steps": window_steps,
                        "elapsed_s": elapsed_s,
                        # Derived exactly as a real calibration derives it.
                        "step_ms": 1000.0 * elapsed_s / window_steps,
                        "mean_kv_length": kv,
                        "mode": mode,
                    }
                )
    return validate_measurements(pd.DataFrame(rows))
