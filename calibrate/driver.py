"""Drive a warmed runner through the calibration grid: warmup rounds, then timed windows.

Windows run in window-major order: window 0 of every grid point, then window 1 of every point,
and so on, so the ``windows_per_point`` windows of one point are spread over the whole
calibration instead of sitting back to back; inside each window round the context intervals
alternate (``(Bcap, G, k)`` major, context minor), so no interval is measured in one stretch of
host drift either: a KV-aware fit compares contexts, and a slow stretch over one interval would
read as a KV effect. A point's cost is the median of its windows; a
round's wall time includes the runner's host work, which on a shared host drifts over seconds
(measured on the H200 host: the same point's windows 17-19 % apart between two calibrations in
one process while the device time of its rounds moved < 1 %), and back-to-back windows would
all land in the same slow or fast stretch. Per (point, window):

1. **Transition** (advanced, not counted): the previous requests are released, ``Bcap`` fresh
   synthetic requests are added, and one step prefills them and runs the first round at the
   point's shape (``Engine.step`` admits and prefills before its round). Every window of a
   point is a **replicate**: its prompts are longer by the tokens ``replicate_advance`` rounds
   emit (``synthetic_prompts``'s ``advance_rounds``; ``(windows_per_point - 1) * window_steps //
   2``, the middle of a back-to-back run of the point), so all of a point's windows run the same
   KV lengths and differ only by the machine's noise. Windows advanced by ``i * window_steps``
   (a back-to-back run) put the KV growth between them into the window spread the quality gate
   judges as noise: on the H200 the default grid's Bcap 8, G 32 point at the shortest context
   ran windows at mean KV 103 / 231 / 359 in 2.448 / 2.481 / 2.528 ms, a 3.2 % "spread" that
   was the attention's KV slope, flagged and re-measured on every calibration.
2. **Warmup**: ``warmup_steps`` unmeasured rounds of the point's plan.
3. **Window**: ``window_steps`` complete rounds, timed by ``speccal.calibrate.timing``: the
   window edges are its only syncs (never per round). The start edge syncs, so every
   transition and warmup round has finished on the device before the clock starts; exactly
   ``window_steps`` rounds are queued between the edges (``Engine.round_index`` counts them),
   and the end edge waits for the last of them. The row records the wall total
   (``elapsed_s``, ``step_ms``) and, on CUDA, the device span between the edges
   (``device_ms``) and ``wall_over_device``; ``loop`` names the engine's round loop. Under the
   pipelined loop (``EngineConfig.pipeline``, calibration's default) the rounds inside the
   window run steady state (round ``n + 1`` queued while ``n`` runs; one host prepare before
   the first is the only bubble), results arrive one step late: the window's first step
   returns the last warmup round and its last round is collected (``Engine.drain``) after the
   end edge, outside the timed span. Round results are inspected only after the closing sync,
   selected by ``round_index``: every round must have run exactly the grid's (Bcap, G, k).

Synthetic requests: prefixes of one token sequence drawn from ``numpy.random.default_rng`` of
``token_seed`` (``synthetic_base``; same prompts for a point on resume). An engine that supports
it (``Engine.supports_prompt_source``) prefills the longest prompt once
(``Engine.set_prompt_source``) and admits each window's requests by copying their KV from it,
so a transition costs a copy and one round instead of ``Bcap`` prefills; a hybrid target's
source also keeps the recurrent state after every prompt length of the grid
(``source_lengths``), copied into each request's state row. Every point is measured at the same mean KV length
(``calibrated_kv_length``), whatever its Bcap and G, because a per-interval fit has no KV axis:
a KV effect that differed between points would be fitted into alpha(Bcap) or theta(G). The KV
axis comes from several intervals (``speccal.costmodel.kv``, fitted on each window's recorded
KV). ``prompt_lengths`` says how (midpoint quantiles of ``[min_kv_length, prefill_tokens]``,
each request led by the tokens its slower growth would not reach); every window records the
batch's mean KV length over its rounds (``mean_kv_length``).

Routed-expert targets (``Engine.routing`` not None): every round reports, per routed layer, the
distinct experts its forwards activated for its requests' rows (padding rows route to no
expert: ``speccal.runner.moe.bind_real_rows``; counted on the device and read with the round's
results at collect, so exact per round on the pipelined loop too:
``RoundResult.experts_activated``); a window's row carries their mean over the routed layers
and the window's rounds (``experts_activated``, :func:`mean_experts_activated`). The synthetic
prompts are random tokens, so the router's rows spread over the experts much as a balanced
model's do (the table says so: ``calibration.routing.source`` ``random_tokens``).

Each finished window becomes one measurement row (columns of ``docs/ARCHITECTURE.md``) appended
to the journal (fsync) before the next window starts; windows already in the journal are skipped.
Re-measurement rounds of noisy points (``speccal.calibrate.gate``) call ``drive`` again with
window indices ``r * windows_per_point + i``; such a window is one more replicate.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from speccal.base.errors import SpeccalError
from speccal.base.gcpause import paused_gc
from speccal.base.runner_face import Routing
from speccal.calibrate.config import CalibrationConfig
from speccal.calibrate.feasibility import TRANSITION_ROUNDS, reserve_tokens
from speccal.calibrate.grid import GridPoint, spread_points
from speccal.calibrate.journal import Journal
from speccal.calibrate.timing import SpeedProbe, WindowTime, WindowTimer


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

    def plus(self, other: DriveStats) -> DriveStats:
        """Work of ``self`` and of a later call over (some of) the same points: counts and times
        add up, the point tallies stay this call's."""
        return DriveStats(
            points_total=self.points_total,
            points_done=self.points_done,
            points_skipped=self.points_skipped,
            windows_measured=self.windows_measured + other.windows_measured,
            rounds=self.rounds + other.rounds,
            transition_s=self.transition_s + other.transition_s,
            warmup_s=self.warmup_s + other.warmup_s,
            sampling_s=self.sampling_s + other.sampling_s,
        )


def mean_measured_rounds(cfg: CalibrationConfig) -> float:
    """Rounds a request has run, as ``RoundResult.kv_lengths`` counts them (after the round),
    averaged over the measured rounds of all of a point's windows.

    Round ``m`` (0-based) of every window is preceded by the ``replicate_advance`` rounds the
    window's advanced prompt stands for, the transition round and ``warmup_steps``:
    ``replicate_advance + 1 + warmup_steps + m + 1`` rounds after it. The mean over ``m`` is
    ``1 + warmup_steps + (window_steps + 1) / 2 + replicate_advance`` (the mean of a back-to-back
    run of the point's windows, up to half a round when ``windows_per_point`` is even and
    ``window_steps`` odd).
    """
    return 1 + cfg.warmup_steps + (cfg.window_steps + 1) / 2 + replicate_advance(cfg)


def replicate_advance(cfg: CalibrationConfig) -> int:
    """Rounds every window's prompts are advanced by (module docstring, step 1): the middle
    window's start in a back-to-back run, ``(windows_per_point - 1) * window_steps // 2``."""
    return (cfg.windows_per_point - 1) * cfg.window_steps // 2


def calibrated_kv_length(cfg: CalibrationConfig, context_index: int) -> float:
    """The mean KV length every point of a context interval is measured at (see
    ``prompt_lengths``): ``(min_kv_length + prefill_tokens) / 2 + (w + 1) * mean_measured_rounds``."""
    ctx = cfg.contexts[context_index]
    centre = (ctx.min_kv_length + ctx.prefill_tokens) / 2
    return centre + (cfg.draft_width + 1) * mean_measured_rounds(cfg)


def prompt_lengths(cfg: CalibrationConfig, point: GridPoint) -> np.ndarray:
    """Base prompt length of each of the point's ``B`` requests (before window advance; ``B`` =
    ``Bcap`` but for a partly filled draft_step point).

    Every point, whatever its Bcap and G, is measured at the same mean KV length
    (``calibrated_kv_length``), in two steps:

    1. **Midpoint quantiles**: request ``i`` of ``B`` takes the ``(i + 0.5) / B`` quantile of
       ``[min_kv_length, prefill_tokens]``, so every bucket's mean prompt is the interval's centre
       (B = 1 sits at the centre, not at ``min_kv_length``: evenly spaced end points would give
       Bcap 1 a one-token prompt and fold a KV effect into alpha(Bcap)). Chosen over one shared
       set of quantile levels with B = 1 rotating through them over windows: a point's cost is
       the median of its windows, which would pick one level for B = 1 instead of the mean.
    2. **Growth lead**: under forced acceptance request ``i`` grows by ``v_i + 1`` tokens per
       round (``v_i`` = its verify length; ``k`` in draft_step mode), so a point with fewer target
       rows per request would drift less far into the interval. Each prompt is lengthened by
       ``(w - v_i) * mean_measured_rounds(cfg)``, the tokens it falls behind a full-width request
       over the average measured round; the batch's mean KV over all windows is then
       ``calibrated_kv_length`` for every point, up to rounding (at most half a token).

    Every window is advanced by ``replicate_advance`` rounds (``synthetic_prompts``), the
    middle of a back-to-back run of the point's windows. Feasibility is unchanged:
    the mean number of rounds is below the worst case, so a request's lead plus its own growth
    stays below a full-width request's worst-case growth and no KV length passes
    ``prefill_tokens + reserve_tokens(...)`` (``feasibility.check_feasible``).
    """
    ctx = cfg.contexts[point.context_index]
    lo, hi = ctx.min_kv_length, ctx.prefill_tokens
    b = point.requests
    levels = (np.arange(b) + 0.5) / b
    verify = np.asarray(point.verify_tokens or (point.k,) * b, dtype=float)
    lead = (cfg.draft_width - verify) * mean_measured_rounds(cfg)
    ramp = np.round(lo + levels * (hi - lo) + lead).astype(int)
    if point.layout is None:
        return ramp
    return two_level(ramp, spread_room(cfg, point))


def spread_growth(cfg: CalibrationConfig, point: GridPoint) -> int:
    """Tokens a request of ``point`` grows past its base prompt at most: the window advance,
    the transition rounds, the warm-up and one window, ``max(v) + 1`` tokens each."""
    v = max(point.verify_tokens or (point.k,))
    return (replicate_advance(cfg) + TRANSITION_ROUNDS + cfg.warmup_steps
            + cfg.window_steps) * (v + 1)


def spread_room(cfg: CalibrationConfig, point: GridPoint, limit: int | None = None) -> int:
    """The longest base prompt a spread point's request may take: its context's
    ``max_kv_length`` (and ``limit``, the tokens a request may hold) less its growth."""
    cap = cfg.contexts[point.context_index].max_kv_length
    if limit is not None:
        cap = min(cap, limit)
    return cap - spread_growth(cfg, point)


def two_level(ramp: np.ndarray, room: int) -> np.ndarray:
    """The ``two_level`` layout of a spread point (``speccal.costmodel.spread``): the first half
    of the requests at a quarter of the calibrated mean prompt, the rest at what keeps the mean
    (seven quarters for an even count), the long ones capped at ``room`` (the short ones then
    longer, the mean kept; never below one token)."""
    n = ramp.size
    total = int(ramp.sum())
    n_lo = n // 2
    n_hi = n - n_lo
    short = max(total // (4 * n), 1)
    long_ = (total - n_lo * short) // n_hi
    if long_ > room:
        long_ = max(room, 1)
        short = max((total - n_hi * long_) // max(n_lo, 1), 1)
    out = np.array([short] * n_lo + [long_] * n_hi, dtype=np.int64)
    out[-1] += total - int(out.sum())  # the rounding remainder: the mean exactly
    return out


def spread_contexts(cfg: CalibrationConfig, limit: int | None = None) -> tuple[int, ...]:
    """The contexts the spread points are measured at: every one where the largest bucket's long
    requests reach at least a quarter of the mean KV past it (7/4 of the mean, capped by the
    context and ``limit``: ``spread_room``); none where no bucket holds two requests. One set
    per context, because what a spread costs and what the calibrated point already holds both
    move with the mean KV (``speccal.costmodel.spread``)."""
    out = []
    for ci in range(len(cfg.contexts)):
        points = spread_points(cfg, (ci,))
        if not points:
            return ()
        point = points[-1]  # the largest bucket
        mean = float(prompt_lengths(cfg, replace(point, layout=None)).mean())
        reach = min(spread_room(cfg, point, limit), 7 * mean / 4) - mean
        if reach >= mean / 4:
            out.append(ci)
    return tuple(out)


def synthetic_base(cfg: CalibrationConfig, vocab_size: int) -> np.ndarray:
    """The token sequence every synthetic prompt is a prefix of (deterministic in
    ``token_seed``), as long as the longest interval's ``max_kv_length``."""
    n = max(ctx.max_kv_length for ctx in cfg.contexts)
    return np.random.default_rng((cfg.token_seed, 0x5EED)).integers(0, vocab_size, size=n)


def window_prompt_lengths(cfg: CalibrationConfig, point: GridPoint,
                          advance_rounds: int = 0) -> np.ndarray:
    """Prompt length of each of the point's requests in a window advanced by
    ``advance_rounds`` rounds: ``prompt_lengths`` plus the tokens each request emits in that many
    rounds under forced full acceptance (``verify_tokens[b] + 1`` per round)."""
    verify = np.asarray(point.verify_tokens or (point.k,) * point.requests, dtype=np.int64)
    return prompt_lengths(cfg, point) + advance_rounds * (verify + 1)


def synthetic_prompts(
    cfg: CalibrationConfig, point: GridPoint, vocab_size: int, advance_rounds: int = 0
) -> list[list[int]]:
    """The ``point.requests`` synthetic prompts of a window: prefixes of ``synthetic_base`` of
    ``window_prompt_lengths`` tokens.

    ``advance_rounds``: each prompt is extended by the tokens its request emits in that many
    rounds, so a window measured after a fresh transition starts at the KV lengths it would have
    had ``advance_rounds`` rounds into a sequential run. Every prompt being a prefix of one
    sequence lets the engine admit it by copying KV (``Engine.set_prompt_source``) instead of a
    prefill; content does not matter to a round's time (forced acceptance: every shape is the
    grid's whatever the tokens).
    """
    base = synthetic_base(cfg, vocab_size)
    return [base[: int(n)].tolist() for n in window_prompt_lengths(cfg, point, advance_rounds)]


def longest_prompt(cfg: CalibrationConfig, points: Sequence[GridPoint],
                   window_indices: Sequence[int]) -> int:
    """The longest synthetic prompt of these points' windows (the prompt source's length);
    ``window_indices`` must not be empty (every window is a replicate: they share prompts)."""
    if not window_indices:
        raise ValueError("longest_prompt: no window to measure")
    return max(int(window_prompt_lengths(cfg, p, replicate_advance(cfg)).max()) for p in points)


def source_lengths(cfg: CalibrationConfig, points: Sequence[GridPoint]) -> list[int]:
    """Every synthetic prompt length these points' windows admit (the lengths a hybrid
    target's prompt source keeps a recurrent state for; every window is a replicate, so the
    window index does not change them)."""
    advance = replicate_advance(cfg)
    return sorted({int(n) for p in points for n in window_prompt_lengths(cfg, p, advance)})


def measurement_row(
    cfg: CalibrationConfig,
    point: GridPoint,
    window_index: int,
    elapsed_s: float,
    mean_kv_length: float,
    device: str,
    *,
    device_ms: float | None = None,
    loop: str | None = None,
    span: WindowTime | None = None,
    experts_activated: float | None = None,
    mean_kv_max_length: float | None = None,
) -> dict[str, Any]:
    """One journal / measurement row (required + optional columns of ARCHITECTURE.md).

    ``device_ms`` (the window's device span, CUDA events) adds ``device_ms`` and
    ``wall_over_device`` (wall total over device span); ``loop`` adds the round loop; a
    probe-clock ``span`` adds ``clock``, ``wall_s``, ``probe_ms`` and ``probe_ref_ms``;
    ``experts_activated`` (a routed-expert target) the window's mean distinct experts per
    routed layer and round; ``mean_kv_max_length`` the window's mean of its rounds' longest
    KV length; a spread point adds its ``layout`` (``speccal.costmodel.spread``).
    """
    ctx = cfg.contexts[point.context_index]
    row = {
        "context_index": point.context_index,
        "prefill_tokens": ctx.prefill_tokens,
        "min_kv_length": ctx.min_kv_length,
        "max_kv_length": ctx.max_kv_length,
        "bcap": point.bcap,
        "num_requests": point.requests,
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
    if loop is not None:
        row["loop"] = loop
    if device_ms is not None and device_ms > 0:
        row["device_ms"] = device_ms
        row["wall_over_device"] = 1000.0 * elapsed_s / device_ms
    if experts_activated is not None:
        row["experts_activated"] = experts_activated
    if mean_kv_max_length is not None:
        row["mean_kv_max_length"] = mean_kv_max_length
    if point.layout is not None:
        row["layout"] = point.layout
    if span is not None and span.probe_ref_ms is not None:
        # the probe clock (speccal.calibrate.timing): elapsed_s is the normalised CPU total
        row.update(clock="cpu_probe", wall_s=span.wall_s, probe_ms=span.probe_ms,
                   probe_ref_ms=span.probe_ref_ms)
    return row


def mean_experts_activated(results: Sequence[Any], routing: Routing | None) -> float | None:
    """The mean over the routed layers and ``results``' rounds of the distinct experts each
    round activated (``RoundResult.experts_activated``), or None for a dense target.

    Raises
    ------
    ShapeMismatchError
        A round that reports another number of routed layers than ``routing.layers``.
    """
    if routing is None:
        return None
    counts = [tuple(r.experts_activated) for r in results]
    bad = [c for c in counts if len(c) != routing.layers]
    if bad or not counts:
        raise ShapeMismatchError(
            f"a round reported experts activated for {len(bad[0]) if bad else 0} routed layers, "
            f"the runner has {routing.layers}")
    return float(np.mean(counts))


def loop_of(engine: Any) -> str:
    """The engine's round loop as its compatibility records it (``pipelined`` |
    ``synchronous``; engines that record none run the synchronous loop)."""
    return str(engine.compatibility().get("loop", "synchronous"))


def prompt_fill(engine: Any) -> str:
    """How ``drive`` puts the synthetic prompts into this engine's KV cache: ``kv_copy``
    (``Engine.set_prompt_source``) or ``prefill`` (one prefill per prompt)."""
    return "kv_copy" if engine.supports_prompt_source else "prefill"


def _window_results(
    results: Sequence[Any], point: GridPoint, first: int, window_steps: int, queued: int
) -> list[Any]:
    """The window's rounds among every result of one (point, window), checked.

    ``first`` is the index of the window's first round: rounds before it (transition, warmup)
    must have the point's shape too; the window must hold exactly rounds ``first ..
    first + window_steps - 1``, each queued between the edges (``queued`` rounds were).
    """
    if queued != window_steps:
        raise ShapeMismatchError(
            f"{queued} rounds ran between the window edges, the window asks for {window_steps}"
        )
    live = [r for r in results if int(r.round_index) >= 0]  # -1: a pipelined step's empty result
    for r in live:
        _check_shape(r, point, "measured" if r.round_index >= first else "warmup")
    window = [r for r in live if first <= r.round_index < first + window_steps]
    if [int(r.round_index) for r in window] != list(range(first, first + window_steps)):
        raise ShapeMismatchError(
            f"window rounds {[int(r.round_index) for r in window]} collected, expected rounds "
            f"{first}..{first + window_steps - 1}"
        )
    return window


def _check_shape(res: Any, point: GridPoint, phase: str) -> None:
    found = (int(res.num_requests), int(res.bcap), int(res.g), int(res.k))
    want = (point.requests, point.bcap, point.g, point.k)
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
    window_indices: Sequence[int] | None = None,
    on_window: Callable[[GridPoint, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    probe: SpeedProbe | None = None,
) -> DriveStats:
    """Measure every window of ``points`` not yet in ``journal``.

    Parameters
    ----------
    engine : a warmed ``speccal.runner.engine.Engine`` with ``acceptance="forced"``.
    cfg : effective, feasible configuration (``feasibility.check_feasible`` passed).
    points : the grid (``grid.build_grid(cfg)``), or the noisy points of a re-measure round.
    journal : open journal; finished windows are skipped, new ones appended.
    device : device label stored in each row.
    vocab_size : token ids of the synthetic prompts are drawn from ``[0, vocab_size)``.
    window_indices : the windows to measure of each point, in order (default
        ``range(windows_per_point)``; a re-measure round ``r`` passes ``range(r * w, (r + 1) * w)``).
    on_window : ``f(point, window_index)`` after each window (progress display).
    clock : wall-clock seconds read at window edges (default ``time.perf_counter``; tests
        inject a fake one).
    probe : time the windows with the probe clock (``speccal.calibrate.timing``: CPU engines;
        the call's first window sets the reference, and the fit re-prices every row at the
        run's median probe, ``timing.at_run_speed``); None: the wall clock.
    """
    with paused_gc():  # a full collection is a 60-150 ms stall inside some window
        return _drive(engine, cfg, points, journal, device=device, vocab_size=vocab_size,
                      window_indices=window_indices, on_window=on_window, clock=clock,
                      probe=probe)


def _drive(engine: Any, cfg: CalibrationConfig, points: tuple[GridPoint, ...], journal: Journal,
           *, device: str, vocab_size: int, window_indices: Sequence[int] | None,
           on_window: Callable[[GridPoint, int], None] | None, clock: Callable[[], float],
           probe: SpeedProbe | None) -> DriveStats:
    """:func:`drive`'s body (the collector paused)."""
    from speccal.runner.engine import RoundPlan
    from speccal.runner.sampling import SamplingParams

    done = journal.done
    timer = WindowTimer(engine, clock, probe=probe)
    loop = loop_of(engine)
    routing = engine.routing
    w = cfg.windows_per_point
    indices = tuple(range(w) if window_indices is None else window_indices)
    max_tokens = reserve_tokens(cfg.warmup_steps, cfg.window_steps, 1, cfg.draft_width)
    left = {p.key: sum((*p.key, i) not in done for i in indices) for p in points}
    points_done = skipped = sum(n == 0 for n in left.values())
    measured = rounds = 0
    t_transition = t_warmup = t_sampling = 0.0
    todo = [p for p in points if left[p.key]]
    advance = replicate_advance(cfg)
    if todo and prompt_fill(engine) == "kv_copy":
        t0 = clock()
        engine.set_prompt_source(
            synthetic_base(cfg, vocab_size)[: longest_prompt(cfg, todo, indices)].tolist(),
            lengths=source_lengths(cfg, todo))
        t_transition += clock() - t0

    # Window-major order: window i of every point, then window i + 1; inside a window round the
    # contexts alternate point by point (module docstring). One context: the grid's order.
    order = sorted(points, key=lambda p: (p.bcap, p.g, p.k, p.context_index))
    for window_index in indices:
        for point in order:
            if (*point.key, window_index) in done:
                continue
            plan = RoundPlan(num_draft_steps=point.k, verify_tokens=point.verify_tokens)

            # Transition: fresh requests whose prompts already hold the tokens the middle of a
            # back-to-back run would have generated (every window, re-measures included, is a
            # replicate at the same KV); prefilled until the batch decodes.
            t0 = clock()
            engine.reset()
            for prompt in synthetic_prompts(cfg, point, vocab_size, advance_rounds=advance):
                engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            # Engine.step admits and prefills waiting requests, then runs one round: this first
            # step is the transition (prefill + first round at the point's shape), never counted.
            # A pipelined engine returns each round one step later (round_index says which).
            before = [engine.step(plan)]
            rounds += 1
            engine.synchronize()
            t1 = clock()
            t_transition += t1 - t0

            for _ in range(cfg.warmup_steps):
                before.append(engine.step(plan))
            rounds += cfg.warmup_steps

            # The window: every round queued before it has finished at the start edge; exactly
            # window_steps rounds are queued between the edges, and the end edge waits for the
            # last of them. A pipelined engine's last round is collected after the edge.
            first = engine.round_index
            inside, span = timer.run(lambda: engine.step(plan), cfg.window_steps)  # noqa: B023
            t_warmup += span.started_s - t1  # the start edge synced: the warm-up had finished
            queued = engine.round_index - first
            rounds += cfg.window_steps
            t_sampling += span.elapsed_s if span.wall_s is None else span.wall_s
            after = engine.drain()
            results = _window_results(before + inside + after, point, first, cfg.window_steps,
                                      queued)
            kv = [np.asarray(r.kv_lengths, dtype=float) for r in results]
            journal.append(
                measurement_row(cfg, point, window_index, span.elapsed_s,
                                float(np.mean([x.mean() for x in kv])), device,
                                device_ms=span.device_ms, loop=loop, span=span,
                                experts_activated=mean_experts_activated(results, routing),
                                mean_kv_max_length=float(np.mean([x.max() for x in kv])))
            )
            measured += 1
            left[point.key] -= 1
            points_done += left[point.key] == 0
            if on_window is not None:
                on_window(point, window_index)
    engine.reset()
    if todo and prompt_fill(engine) == "kv_copy":
        engine.set_prompt_source(None)
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
