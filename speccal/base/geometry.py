"""Captured graph geometry shared by the runner, calibration, cost tables and policies.

A runner captures one draft graph per physical request bucket ``Bcap`` and, for each ``Bcap``,
target graphs at a set of physical row counts ``G``. In the split-graph layout speccal uses, the
runner prepares the global target buckets ``{Bcap * j : j = 1 .. w + 1}`` over all request
buckets, and the legal target buckets of ``Bcap`` are those between ``Bcap`` and
``Bcap * (w + 1)``: full verification of ``k`` drafts for ``B`` requests pads ``B * (k + 1)`` rows
up to the next legal bucket, and every trimmed verify budget has a captured shape.

This module owns the bucketing rules, once each: padding a batch to its request bucket
(:meth:`Geometry.bcap_for`, vectorised :meth:`Geometry.pad_requests`), padding target rows up to a
captured target bucket (:meth:`Geometry.g_for`, vectorised :meth:`Geometry.pad_rows`) and fitting
a verify budget into the captured buckets (:meth:`Geometry.g_within`). The runner, the policies
and the replay call these; none of them pads on its own. No torch: numpy only.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from speccal.base.errors import InputError

MAX_REQUEST_BUCKETS = 128


#: The request buckets an engine captures when none are given, per device kind: the one bucket
#: set ``speccal calibrate``, ``bench``, ``generate`` and the exports share, so a table prices
#: what the engine serves (a calibration of 1, 2, 4, 8 beside a bench engine of 1..32 left 62 of
#: 70 rounds of a 12-request batch unpriced). cuda / npu: powers of two up to 64 (a serving
#: engine captures many buckets); cpu: up to 8, so the tiny preset's default CPU calibration
#: stays within a minute (``--request-buckets`` widens it, up to :data:`MAX_REQUEST_BUCKETS`).
SERVED_REQUEST_BUCKETS: dict[str, tuple[int, ...]] = {
    "cuda": (1, 2, 4, 8, 16, 32, 64),
    "npu": (1, 2, 4, 8, 16, 32, 64),
    "cpu": (1, 2, 4, 8),
}


def served_request_buckets(device: str) -> tuple[int, ...]:
    """:data:`SERVED_REQUEST_BUCKETS` of a device spec (``cpu``, ``cuda:1``, ...)."""
    kind = str(device).split(":", 1)[0]
    if kind not in SERVED_REQUEST_BUCKETS:
        raise InputError("device", device, f"one of {', '.join(SERVED_REQUEST_BUCKETS)}[:N]")
    return SERVED_REQUEST_BUCKETS[kind]


def default_request_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to ``max_batch`` plus ``max_batch`` itself (1, 2, 4, 8, ...)."""
    if max_batch < 1:
        raise InputError("max_batch", max_batch, "an integer >= 1")
    out = []
    b = 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


def default_target_rows(request_buckets: Iterable[int], draft_width: int) -> dict[int, tuple[int, ...]]:
    """Legal target row buckets per request bucket.

    The runner prepares one global set of target row buckets: every ``Bcap * j`` for
    ``j = 1 .. w + 1`` over all request buckets. A request bucket may use every prepared bucket
    between ``Bcap`` (one row per request) and ``Bcap * (w + 1)`` (full width). Sharing G levels
    across request buckets is what makes the additive model over-determined: a G level measured
    under several Bcap values pins theta(G) independently of alpha(Bcap).
    """
    buckets = sorted(set(request_buckets))
    prepared = sorted({b * j for b in buckets for j in range(1, draft_width + 2)})
    return {
        b: tuple(g for g in prepared if b <= g <= b * (draft_width + 1)) for b in buckets
    }


@dataclass(frozen=True)
class Geometry:
    """What a warmed runner can execute without recapture.

    Attributes
    ----------
    draft_width : the most draft tokens a round can propose (``w``).
    request_buckets : captured physical draft request buckets ``Bcap``, ascending.
    target_rows : for each ``Bcap``, the captured target row buckets ``G``, ascending; always
        includes full width ``Bcap * (w + 1)``.
    kv_capacity_tokens : KV cache slots available to requests (blocks * block_size).
    max_model_len : the model's context limit (prompt + generated tokens per request).
    block_size : tokens per KV block.
    """

    draft_width: int
    request_buckets: tuple[int, ...]
    target_rows: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    kv_capacity_tokens: int = 0
    max_model_len: int = 0
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.draft_width < 1:
            raise InputError("draft_width", self.draft_width, "an integer >= 1")
        buckets = tuple(self.request_buckets)
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise InputError("request_buckets", buckets, "a non-empty ascending list of distinct integers >= 1")
        if len(buckets) > MAX_REQUEST_BUCKETS:
            raise InputError("request_buckets", len(buckets), f"at most {MAX_REQUEST_BUCKETS} buckets")
        object.__setattr__(self, "request_buckets", buckets)
        rows = dict(self.target_rows) or default_target_rows(buckets, self.draft_width)
        fixed: dict[int, tuple[int, ...]] = {}
        for b in buckets:
            gs = tuple(sorted(set(rows.get(b, ()))))
            full = b * (self.draft_width + 1)
            if full not in gs:
                raise InputError(f"target_rows[{b}]", gs, f"a set including full width {full}")
            if gs[0] < b:
                raise InputError(f"target_rows[{b}]", gs, f"buckets >= Bcap={b}")
            fixed[b] = gs
        object.__setattr__(self, "target_rows", fixed)

    def bcap_for(self, num_requests: int) -> int | None:
        """Smallest captured request bucket holding ``num_requests``; None when none does (the
        scalar :meth:`pad_requests`, by bisection: every round asks it on the host)."""
        buckets = self.request_buckets
        i = bisect.bisect_left(buckets, num_requests)
        return buckets[i] if i < len(buckets) else None

    def g_for(self, bcap: int, rows: int) -> int | None:
        """Smallest captured target bucket of ``bcap`` holding ``rows`` rows; None when none does
        (the scalar :meth:`pad_rows`)."""
        gs = self.target_rows.get(bcap)
        if not gs:
            return None
        i = bisect.bisect_left(gs, rows)
        return gs[i] if i < len(gs) else None

    def pad_requests(self, num_requests: Any) -> np.ndarray:
        """Vectorised :meth:`bcap_for` (int64, same shape as ``num_requests``); 0 where none holds it."""
        buckets = np.asarray(self.request_buckets, dtype=np.int64)
        i = np.searchsorted(buckets, np.asarray(num_requests, dtype=np.int64), side="left")
        return np.where(i < buckets.size, buckets[np.minimum(i, buckets.size - 1)], 0)

    def pad_rows(self, bcap: Any, rows: Any) -> np.ndarray:
        """Vectorised :meth:`g_for` (int64, broadcast shape of the inputs); 0 where no captured
        target bucket of ``bcap`` holds the rows (or ``bcap`` is not a request bucket)."""
        keys, span = self._row_keys
        bcap = np.asarray(bcap, dtype=np.int64)
        # rows clipped to [0, span]: a query never reaches into a neighbouring bucket's keys
        rows = np.clip(np.asarray(rows, dtype=np.int64), 0, span)
        j = np.searchsorted(keys, bcap * span + rows, side="left")
        hit = keys[np.minimum(j, keys.size - 1)]
        return np.where((j < keys.size) & (hit // span == bcap), hit % span, 0)

    def g_within(self, bcap: int, budget: int, min_rows: int) -> int | None:
        """Target bucket of a verify budget: the largest captured target bucket of ``bcap`` in
        ``[min_rows, budget]``, else the smallest holding ``min_rows`` (the bonus rows); None
        when none does."""
        gs = self.target_rows.get(bcap, ())
        i = bisect.bisect_right(gs, budget) - 1
        if i >= 0 and gs[i] >= min_rows:
            return gs[i]
        return self.g_for(bcap, min_rows)

    def draft_step_shapes(self, bcap: int) -> list[tuple[int, int, int]]:
        """Every ``(G, k, B)`` a draft-step round of ``bcap`` runs: ``k`` = 1..w draft forwards
        for every batch ``B`` the bucket holds (previous bucket < B <= ``bcap``), ``G =
        g_for(bcap, B * (k + 1))``, one entry per ``(G, k)`` with the largest such ``B``. Full
        batches give ``G = bcap * (k + 1)``; partly filled ones pad to other G (12 requests at
        k = 1 in bucket 16 verify 24 rows: a G a full bucket 16 never runs). Sorted by (G, k)."""
        i = self.request_buckets.index(bcap)
        prev = self.request_buckets[i - 1] if i else 0
        shapes: dict[tuple[int, int], int] = {}
        for n in range(prev + 1, bcap + 1):
            for k in range(1, self.draft_width + 1):
                g = self.g_for(bcap, n * (k + 1))
                if g:
                    shapes[g, k] = max(n, shapes.get((g, k), 0))
        return sorted((g, k, n) for (g, k), n in shapes.items())

    @cached_property
    def _row_keys(self) -> tuple[np.ndarray, int]:
        """Every captured ``(Bcap, G)`` as one sorted key ``Bcap * span + G`` (``span`` > every G),
        so :meth:`pad_rows` is one ``searchsorted`` over all buckets."""
        span = max(max(gs) for gs in self.target_rows.values()) + 1
        keys = [b * span + g for b in self.request_buckets for g in self.target_rows[b]]
        return np.asarray(keys, dtype=np.int64), span

    def to_dict(self) -> dict:
        return {
            "draft_width": self.draft_width,
            "request_buckets": list(self.request_buckets),
            "target_rows": {str(b): list(g) for b, g in self.target_rows.items()},
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Geometry:
        return cls(
            draft_width=int(d["draft_width"]),
            request_buckets=tuple(int(b) for b in d["request_buckets"]),
            target_rows={int(b): tuple(int(g) for g in gs) for b, gs in d.get("target_rows", {}).items()},
            kv_capacity_tokens=int(d.get("kv_capacity_tokens", 0)),
            max_model_len=int(d.get("max_model_len", 0)),
            block_size=int(d.get("block_size", 16)),
        )
