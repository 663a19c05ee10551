"""The calibration grid: which (context, Bcap, G, k) points are measured and with what round plan.

A ``GridPoint`` is one measured shape. In ``target_verify`` mode the draft runs all ``w`` steps and
the target receives exactly ``G`` rows: request ``i`` of the ``Bcap`` synthetic requests verifies
``verify_tokens[i]`` drafted tokens, spread as evenly as possible so that
``sum(verify_tokens[i] + 1) == G``. In ``draft_step`` mode each candidate ``k`` is its own point set
with ``G = Bcap * (k + 1)`` (full verification of ``k`` drafts, ``verify_tokens`` None), and the
shapes partly filled buckets run (``CalibrationConfig.partly_filled``): ``B < Bcap`` requests
verifying ``k`` drafts each, ``B * (k + 1)`` rows padded to a captured ``G`` no full batch of
``Bcap`` verifies (serving rarely fills its bucket; a round of ``k`` draft forwards at that G is
not the round of another ``k`` at the same G).

Pure Python (no torch): the grid is built and checked before any sampling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speccal.base.errors import GridError
from speccal.costmodel import grid
from speccal.costmodel.spread import SPREAD_LAYOUT

if TYPE_CHECKING:
    from speccal.calibrate.config import CalibrationConfig


@dataclass(frozen=True)
class GridPoint:
    """One measured shape.

    Attributes
    ----------
    context_index : index into ``CalibrationConfig.contexts``.
    bcap : physical draft request bucket.
    g : physical target rows.
    k : draft forwards per round (``num_draft_steps``).
    verify_tokens : per request, drafted tokens sent to the target (prefix length); None = all k.
    num_requests : requests the point runs (``B``); None = ``bcap`` (a full bucket). A draft_step
        point of a partly filled bucket runs fewer.
    layout : how the requests' KV lengths are laid out: None (the calibrated layout, midpoint
        quantiles of the context interval: ``speccal.calibrate.driver.prompt_lengths``) or
        ``"two_level"`` (a spread point, :func:`spread_points`: the same mean KV, half the
        requests short and half long), which the fits never see.
    """

    context_index: int
    bcap: int
    g: int
    k: int
    verify_tokens: tuple[int, ...] | None = None
    num_requests: int | None = None
    layout: str | None = None

    @property
    def requests(self) -> int:
        """``B``, the requests every round of the point runs."""
        return self.bcap if self.num_requests is None else self.num_requests

    @property
    def key(self) -> tuple:
        """Identity of the point in the journal and in measurement rows: ``(context_index, bcap,
        g, k)``, with the layout appended for a spread point (``journal.window_key``)."""
        base = (self.context_index, self.bcap, self.g, self.k)
        return base if self.layout is None else (*base, self.layout)


def split_rows(bcap: int, g: int, draft_width: int) -> tuple[int, ...]:
    """Per-request verify lengths ``v`` (0..w) with ``sum(v + 1) == g``, as even as possible."""
    extra = g - bcap
    if extra < 0 or extra > bcap * draft_width:
        raise GridError(
            "target_graph_rows",
            g,
            f"a row count in [{bcap}, {bcap * (draft_width + 1)}] for Bcap={bcap}",
        )
    base, rem = divmod(extra, bcap)
    return tuple(base + 1 if i < rem else base for i in range(bcap))


def build_grid(cfg: CalibrationConfig) -> tuple[GridPoint, ...]:
    """All points of ``cfg``, ordered by context, then Bcap, then G (measurement order)."""
    w = cfg.draft_width
    partly: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for b, g, k, n in cfg.partly_filled:
        partly.setdefault((b, g), []).append((k, n))
    points: list[GridPoint] = []
    for ci in range(len(cfg.contexts)):
        for b in cfg.request_buckets:
            for g in cfg.target_graph_rows[b]:
                if cfg.mode != "draft_step":
                    points.append(GridPoint(ci, b, g, w, split_rows(b, g, w)))
                    continue
                full = g % b == 0 and 2 <= g // b <= w + 1
                if not full and (b, g) not in partly:
                    raise GridError(
                        f"target_graph_rows[{b}]",
                        g,
                        f"Bcap * (k + 1) for k in 1..{w} in draft_step mode, or a G a partly "
                        "filled bucket pads to (CalibrationConfig.partly_filled)",
                    )
                at = [(g // b - 1, None)] if full else []
                at += sorted(partly.get((b, g), ()))
                points.extend(GridPoint(ci, b, g, k, None, n) for k, n in sorted(at))
    return tuple(points)


def spread_points(cfg: CalibrationConfig, contexts: Iterable[int]) -> tuple[GridPoint, ...]:
    """The spread points (``speccal.costmodel.spread``): at each of ``contexts``, one per
    request bucket ``Bcap >= 2``, the bucket's full point at ``k = 1`` (draft_step,
    ``G = 2 Bcap``) or at full width (target_verify, ``G = Bcap (w + 1)``), where that G is
    calibrated, measured with the ``two_level`` layout."""
    w = cfg.draft_width
    out = []
    for ci in contexts:
        for b in cfg.request_buckets:
            if b < 2:
                continue
            if cfg.mode == "draft_step":
                if 2 * b in cfg.target_graph_rows[b]:
                    out.append(GridPoint(ci, b, 2 * b, 1, layout=SPREAD_LAYOUT))
            elif b * (w + 1) in cfg.target_graph_rows[b]:
                g = b * (w + 1)
                out.append(GridPoint(ci, b, g, w, split_rows(b, g, w), layout=SPREAD_LAYOUT))
    return tuple(out)


def check_connected(points: tuple[GridPoint, ...]) -> None:
    """Refuse an additive grid that is not connected through shared G values (before sampling)."""
    grid.check_connected(
        [(p.bcap, p.g) for p in points],
        where="target_graph_rows",
    )
