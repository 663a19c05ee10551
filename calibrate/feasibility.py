"""Feasibility of a calibration against the warmed runner, checked before any sampling.

What must fit, per context interval ``(prefill_tokens P, min_kv_length lo, max_kv_length hi)``:

- Every synthetic request starts with a prompt of ``lo..P`` tokens and then grows by at most
  ``reserve_tokens(...)`` tokens while its point is measured: worst case every round of the
  transition (prefill + one in-flight round), the warmup and all windows emits ``w + 1`` tokens
  (forced full acceptance). So ``P + reserve <= hi``: KV lengths stay inside the interval.
- ``hi <= max_model_len``: no request outgrows the model context.
- Every in-flight slot of the largest request bucket reserves its worst case at once:
  ``max(Bcap) * blocks(P + reserve) <= KV capacity blocks``.
- Request buckets and target rows must be captured graphs (``Geometry``), and an additive grid
  must be connected through shared G values.

The default context (prefill 2048, KV 1..4096) shrinks to the model context and the KV capacity;
when even a one-token prompt cannot fit, ``default_context`` fails naming the numbers and asking for
a smaller explicit config. Pure Python (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speccal.base.errors import InputError
from speccal.base.geometry import Geometry
from speccal.calibrate.grid import build_grid, check_connected

if TYPE_CHECKING:
    from speccal.calibrate.config import CalibrationConfig

# Rounds a request may advance outside warmup and windows: the prefill round that starts it and
# one more round in flight when its point ends (xLLM reserves two in-flight slots).
TRANSITION_ROUNDS = 2

_SMALLER = (
    "pass --config with a smaller explicit config: fewer/smaller request_buckets, fewer "
    "warmup_steps / window_steps / windows_per_point, or a shorter contexts[].prefill_tokens"
)


def reserve_tokens(
    warmup_steps: int, window_steps: int, windows_per_point: int, draft_width: int
) -> int:
    """Worst-case tokens one request generates while its grid point runs (see module docstring)."""
    return (TRANSITION_ROUNDS + warmup_steps + windows_per_point * window_steps) * (draft_width + 1)


def slot_tokens(geometry: Geometry, max_bcap: int) -> int:
    """KV tokens available to each of ``max_bcap`` concurrent requests, in whole blocks."""
    blocks = geometry.kv_capacity_tokens // geometry.block_size
    return (blocks // max_bcap) * geometry.block_size


def default_context(
    geometry: Geometry,
    max_bcap: int,
    reserve: int,
    *,
    prefill_tokens: int,
    min_kv_length: int,
    max_kv_length: int,
) -> tuple[tuple[int, int, int], str | None]:
    """The documented default interval, shrunk to fit; returns ``((P, lo, hi), note)``.

    Raises
    ------
    InputError
        When not even a ``min_kv_length``-token prompt plus ``reserve`` generated tokens fits.
    """
    hi, why = max_kv_length, []
    if geometry.max_model_len and geometry.max_model_len < hi:
        hi = geometry.max_model_len
        why.append(
            f"max_kv_length {max_kv_length} -> {hi} (model context {geometry.max_model_len})"
        )
    per_slot = slot_tokens(geometry, max_bcap)
    if per_slot < hi:
        why.append(
            f"max_kv_length {hi} -> {per_slot} (KV capacity {geometry.kv_capacity_tokens} tokens "
            f"over {max_bcap} in-flight slots)"
        )
        hi = per_slot
    prefill = min(prefill_tokens, hi - reserve)
    if prefill < min_kv_length:
        raise InputError(
            "contexts",
            f"default prefill {prefill_tokens}, KV {min_kv_length}..{max_kv_length}",
            f"room for a {min_kv_length}-token prompt plus {reserve} worst-case generated tokens per "
            f"request within {hi} tokens (model context {geometry.max_model_len}, KV capacity "
            f"{geometry.kv_capacity_tokens} tokens over {max_bcap} slots)",
            hint=_SMALLER,
        )
    if prefill < prefill_tokens:
        why.append(
            f"prefill_tokens {prefill_tokens} -> {prefill} (reserving {reserve} generated tokens per request)"
        )
    return (prefill, min_kv_length, hi), ("; ".join(why) or None)


#: Most context levels the default calibration measures (``default_contexts``).
DEFAULT_LEVELS = 4
#: Ratio of the upper bounds of neighbouring default levels (geometric levels).
LEVEL_RATIO = 4


def default_contexts(
    geometry: Geometry,
    max_bcap: int,
    reserve: int,
    *,
    prefill_tokens: int,
    min_kv_length: int,
    max_kv_length: int,
    levels: int = DEFAULT_LEVELS,
) -> tuple[tuple[tuple[int, int, int], ...], str | None]:
    """The default context intervals: up to ``levels`` geometric levels spanning the default
    interval shrunk to fit (``default_context``); returns ``(((P, lo, hi), ...), note)``.

    The span ``[min_kv_length, H]`` (``H`` the shrunk ``max_kv_length``) is cut at upper bounds
    ``hi_k = H / LEVEL_RATIO ** (n - 1 - k)``, the lowest raised to ``min_kv_length + reserve``
    when narrower (its requests must have room to grow) and the others spaced geometrically
    above it; intervals are contiguous and never overlap (``lo_{k+1} = hi_k + 1``). Each level's
    prompts reach ``P_k = min(hi_k - reserve, max(lo_k, hi_k // 2))`` tokens, so requests start in
    their interval and end in it, with the top level prefilling what the single default did
    (``H / 2``, at most ``prefill_tokens``). ``n`` is the most levels (``levels`` down to 1)
    whose every interval holds ``reserve`` generated tokens past its first prompt token; with one
    level this is exactly ``default_context``. Several levels let a table fit the KV-aware model
    (``speccal.costmodel.kv``, three or more contexts).

    Raises
    ------
    InputError
        As ``default_context``: not even one interval fits.
    """
    (p1, lo, hi), note = default_context(
        geometry,
        max_bcap,
        reserve,
        prefill_tokens=prefill_tokens,
        min_kv_length=min_kv_length,
        max_kv_length=max_kv_length,
    )
    for n in range(max(levels, 1), 1, -1):
        first = max(hi // LEVEL_RATIO ** (n - 1), lo + reserve)
        if first >= hi:
            continue
        bounds = [round(first * (hi / first) ** (k / (n - 1))) for k in range(n)]
        bounds[-1] = hi
        out, start, ok = [], lo, True
        for b in bounds:
            if b - reserve < start:
                ok = False
                break
            p = min(b - reserve, max(start, min(b // 2, prefill_tokens)))
            out.append((p, start, b))
            start = b + 1
        if ok:
            # The single level's prefill shrink does not apply to these levels.
            kept = [w for w in (note or "").split("; ") if w and not w.startswith("prefill")]
            return tuple(out), "; ".join(kept) or None
    return ((p1, lo, hi),), note


def check_buckets_captured(buckets, geometry: Geometry) -> None:
    """Refuse request buckets the runner did not capture (only warmed graphs are sampled)."""
    for b in buckets:
        if b not in geometry.request_buckets:
            raise InputError(
                "request_buckets",
                b,
                f"a captured request bucket, one of {list(geometry.request_buckets)}",
                hint="only warmed graphs are sampled; pass --request-buckets to capture others",
            )


def check_feasible(cfg: CalibrationConfig, geometry: Geometry) -> None:
    """Refuse a config the warmed runner cannot sample as given. Never samples anything.

    Raises
    ------
    InputError / GridError
        Naming the key, the value that does not fit and the limit it exceeds.
    """
    w = geometry.draft_width
    if cfg.draft_width != w:
        raise InputError("draft_width", cfg.draft_width, f"the run's num_speculative_tokens={w}")
    check_buckets_captured(cfg.request_buckets, geometry)
    for b, gs in cfg.target_graph_rows.items():
        captured = geometry.target_rows.get(b, ())
        for g in gs:
            if g not in captured:
                raise InputError(
                    f"target_graph_rows[{b}]",
                    g,
                    f"a captured target bucket of Bcap={b}, one of {list(captured)}",
                )
            if not b <= g <= b * (w + 1):
                raise InputError(
                    f"target_graph_rows[{b}]", g, f"a legal target bucket in [{b}, {b * (w + 1)}]"
                )
    points = build_grid(cfg)
    if cfg.model == "additive":
        check_connected(points)

    reserve = reserve_tokens(cfg.warmup_steps, cfg.window_steps, cfg.windows_per_point, w)
    max_bcap = max(cfg.request_buckets)
    per_slot = slot_tokens(geometry, max_bcap)
    for i, c in enumerate(cfg.contexts):
        where = f"contexts[{i}]"
        if geometry.max_model_len and c.max_kv_length > geometry.max_model_len:
            raise InputError(
                f"{where}.max_kv_length",
                c.max_kv_length,
                f"at most the model context {geometry.max_model_len}",
                hint=f"set {where}.max_kv_length <= {geometry.max_model_len} in --config, or run with a longer --max-model-len",
            )
        need = c.prefill_tokens + reserve
        if need > c.max_kv_length:
            raise InputError(
                f"{where}.prefill_tokens",
                c.prefill_tokens,
                f"prefill_tokens + {reserve} worst-case generated tokens <= max_kv_length "
                f"{c.max_kv_length} (KV must stay inside the interval)",
                hint=_SMALLER,
            )
        need_blocks = -(-need // geometry.block_size) * geometry.block_size
        if need_blocks > per_slot:
            raise InputError(
                f"{where}.prefill_tokens",
                c.prefill_tokens,
                f"{c.prefill_tokens} + {reserve} generated tokens per request to fit the KV capacity: "
                f"{geometry.kv_capacity_tokens} tokens over {max_bcap} in-flight slots leave {per_slot} each",
                hint=_SMALLER,
            )
