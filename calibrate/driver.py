"""Drive a warmed runner through the calibration grid: warmup rounds, then timed windows.

Per grid point (``speccal.calibrate.grid.GridPoint``):

1. **Transition** (advanced, not counted): the previous point's requests are released, ``Bcap``
   fresh synthetic requests are added, and one step prefills them and runs the first round at the
   point's shape (``Engine.step`` admits and prefills before its round).
2. **Warmup**: ``warmup_steps`` unmeasured rounds of the point's plan.
3. **Windows**: ``windows_per_point`` windows of ``window_steps`` complete rounds each. The device
   is synchronised only at window edges (never per round); a window's cost is its wall time over
   its rounds (completion-time windows of the round loop). Round results are inspected only after
   the closing sync: every round must have run exactly the grid's (Bcap, G, k).

Synthetic requests: token ids drawn from ``numpy.random.default_rng((token_seed, context, Bcap, G,
k))`` (same prompts for a point on resume). Prompt lengths are spread evenly over
``[min_kv_length, prefill_tokens]`` across the batch, so the batch's KV lengths cover the lower
part of the interval from the first round and then grow by up to ``w + 1`` tokens per round
(forced full acceptance) toward ``prefill_tokens + reserve <= max_kv_length``; every window
records the batch's mean KV length over its rounds (``mean_kv_length``).

Each finished window becomes one measurement row (columns of ``docs/ARCHITECTURE.md``) appended
to the journal (fsync) before the next window starts; windows already in the journal are skipped.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from speccal.calibrate.config import CalibrationConfig
from speccal.calibrate.feasibility import reserve_tokens
from speccal.calibrate.grid import GridPoint
from speccal.calibrate.journal import Journal
from speccal.errors import SpeccalError


class ShapeMismatchError(SpeccalError):
    """The runner executed a different shape than the grid point asked for."""


@dataclass(frozen=True)
class DriveStats:
    """What one ``drive`` call did.

    Attributes
    ----------
    points_total, points_done : grid points, and points with every window in the journal at the end.
    points_skipped : points already complete in the journal at start (resume).
    windows_measured : windows timed by this call.
    rounds : engine rounds run by this call (transition + warmup + windows).
    transition_s, warmup_s, sampling_s : wall time of prefill/transition rounds, warmup rounds and
        timed windows.
    """

    points_total: int
    points_done: int
    points_skipped: int
    windows_measured: int
    rounds: int
    transition_s: float
    warmup_s: float
    sampling_s: float


def synthetic_prompts(cfg: CalibrationConfig, point: GridPoint, vocab_size: int) -> list[list[int]]:
    """The ``point.bcap`` synthetic prompts of a point (deterministic in ``token_seed``)."""
    ctx = cfg.contexts[point.context_index]
    rng = np.random.default_rng((cfg.token_seed, point.context_index, point.bcap, point.g, point.k))
    lengths = np.linspace(ctx.min_kv_length, ctx.prefill_tokens, point.bcap).round().astype(int)
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]


def measurement_row(
    cfg: CalibrationConfig,
    point: GridPoint,
    window_index: int,
    elapsed_s: float,
    mean_kv_length: float,
    device: str,
) -> dict[str, Any]:
    """One journal / measurement row (required + optional columns of ARCHITECTURE.md)."""
    ctx = cfg.contexts[point.context_index]
    return {
        "context_index": point.context_index,
        "prefill_tokens": ctx.prefill_tokens,
        "min_kv_length": ctx.min_kv_length,
        "max_kv_length": ctx.max_kv_length,
        "bcap": point.bcap,
        "num_requests": point.bcap,
        "g": point.g,
        "k": point.k,
        "window_index": window_index,
        "window_steps": cfg.window_steps,
        "elapsed_s": elapsed_s,
        "step_ms": 1000.0 * elapsed_s / cfg.window_steps,
        "mean_kv_length": mean_kv_length,
        "warmup_steps": cfg.warmup_steps,
        "mode": cfg.mode,
        "device": device,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _check_shape(res: Any, point: GridPoint, phase: str) -> None:
    found = (int(res.num_requests), int(res.bcap), int(res.g), int(res.k))
    want = (point.bcap, point.bcap, point.g, point.k)
    if found != want:
        raise ShapeMismatchError(
            f"{phase} round ran (B, Bcap, G, k) = {found}, the grid point asks for {want}: "
            "calibration needs forced full acceptance and captured shapes"
        )


def drive(
    engine: Any,
    cfg: CalibrationConfig,
    points: tuple[GridPoint, ...],
    journal: Journal,
    *,
    device: str,
    vocab_size: int,
    on_window: Callable[[int, int, GridPoint], None] | None = None,
) -> DriveStats:
    """Measure every window of ``points`` not yet in ``journal``.

    Parameters
    ----------
    engine : a warmed ``speccal.runner.engine.Engine`` with ``acceptance="forced"``.
    cfg : effective, feasible configuration (``feasibility.check_feasible`` passed).
    points : the grid (``grid.build_grid(cfg)``).
    journal : open journal; finished windows are skipped, new ones appended.
    device : device label stored in each row.
    vocab_size : token ids of the synthetic prompts are drawn from ``[0, vocab_size)``.
    on_window : ``f(windows_done, points_done, point)`` after each window (progress display).
    """
    from speccal.runner.engine import RoundPlan
    from speccal.runner.sampling import SamplingParams

    done = journal.done
    w = cfg.windows_per_point
    max_tokens = reserve_tokens(cfg.warmup_steps, cfg.window_steps, w, cfg.draft_width)
    points_done = sum(all((*p.key, i) in done for i in range(w)) for p in points)
    skipped = points_done
    windows_done = sum(1 for p in points for i in range(w) if (*p.key, i) in done)
    measured = rounds = 0
    t_transition = t_warmup = t_sampling = 0.0

    for point in points:
        todo = [i for i in range(w) if (*point.key, i) not in done]
        if not todo:
            continue
        plan = RoundPlan(num_draft_steps=point.k, verify_tokens=point.verify_tokens)

        # Transition: fresh requests, prefilled until the batch decodes at this shape.
        t0 = time.perf_counter()
        engine.reset()
        for prompt in synthetic_prompts(cfg, point, vocab_size):
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        # Engine.step admits and prefills waiting requests, then runs one round: this first step
        # is the transition (prefill + first round at the point's shape), never counted.
        res = engine.step(plan)
        rounds += 1
        _check_shape(res, point, "transition")
        engine.synchronize()
        t1 = time.perf_counter()
        t_transition += t1 - t0

        for _ in range(cfg.warmup_steps):
            res = engine.step(plan)
            _check_shape(res, point, "warmup")
        rounds += cfg.warmup_steps
        engine.synchronize()
        t2 = time.perf_counter()
        t_warmup += t2 - t1

        for window_index in todo:
            results = []
            engine.synchronize()
            start = time.perf_counter()
            for _ in range(cfg.window_steps):
                results.append(engine.step(plan))
            engine.synchronize()
            elapsed = time.perf_counter() - start
            rounds += cfg.window_steps
            t_sampling += elapsed
            for res in results:
                _check_shape(res, point, "measured")
            mean_kv = float(
                np.mean([np.mean(np.asarray(r.kv_lengths, dtype=float)) for r in results])
            )
            journal.append(measurement_row(cfg, point, window_index, elapsed, mean_kv, device))
            measured += 1
            windows_done += 1
            if on_window is not None:
                on_window(windows_done, points_done + (window_index == todo[-1]), point)
        points_done += 1
    engine.reset()
    return DriveStats(
        points_total=len(points),
        points_done=points_done,
        points_skipped=skipped,
        windows_measured=measured,
        rounds=rounds,
        transition_s=t_transition,
        warmup_s=t_warmup,
        sampling_s=t_sampling,
    )
