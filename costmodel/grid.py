"""Grid validation: is a set of measured points fittable?

Two rules from the spec. Context intervals ``[min_kv_length, max_kv_length]`` (inclusive) must not
overlap, so a KV length selects at most one fit. The additive model ``bias + alpha(Bcap) +
theta(G)`` is identifiable only when the bipartite graph whose nodes are the measured Bcap levels
and G levels, with an edge per measured ``(Bcap, G)`` point, is connected: two components could
shift their levels against each other at no cost in fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from speccal.base.errors import GridError


def check_contexts(intervals: Mapping[int, tuple[int, int, int]]) -> None:
    """Raise ``GridError`` when two context intervals overlap.

    Parameters
    ----------
    intervals : ``{context_index: (prefill_tokens, min_kv_length, max_kv_length)}``; bounds
        inclusive.
    """
    items = sorted(intervals.items(), key=lambda kv: (kv[1][1], kv[1][2]))
    for (ia, a), (ib, b) in zip(items, items[1:], strict=False):
        if b[1] <= a[2]:
            raise GridError(
                "contexts",
                {ia: [a[1], a[2]], ib: [b[1], b[2]]},
                "non-overlapping KV intervals (inclusive bounds)",
            )


def grid_components(points: Iterable[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
    """Connected components of the bipartite (Bcap, G) graph of measured points.

    Parameters
    ----------
    points : measured ``(bcap, g)`` pairs (duplicates allowed).

    Returns
    -------
    One ``(bcaps, gs)`` pair of sorted level lists per component, ordered by smallest Bcap.
    """
    pts = np.asarray(sorted(set((int(b), int(g)) for b, g in points)), dtype=np.int64).reshape(
        -1, 2
    )
    bl, bi = np.unique(pts[:, 0], return_inverse=True)
    gl, gi = np.unique(pts[:, 1], return_inverse=True)
    nb, ng = len(bl), len(gl)
    # Bcap nodes are 0..nb-1, G nodes nb..nb+ng-1.
    adj = coo_matrix((np.ones(len(pts)), (bi, nb + gi)), shape=(nb + ng, nb + ng))
    n, labels = connected_components(adj, directed=False)
    comps = []
    for c in range(n):
        members = np.flatnonzero(labels == c)
        comps.append(
            (
                [int(bl[m]) for m in members if m < nb],
                [int(gl[m - nb]) for m in members if m >= nb],
            )
        )
    return sorted(comps, key=lambda c: (c[0][:1], c[1][:1]))


def check_connected(points: Iterable[tuple[int, int]], where: str = "grid") -> None:
    """Raise ``GridError`` naming the components when the additive grid is disconnected."""
    comps = grid_components(points)
    if len(comps) > 1:
        named = "; ".join(f"component {i}: bcap={b} g={g}" for i, (b, g) in enumerate(comps))
        raise GridError(
            where,
            f"{len(comps)} disconnected components",
            "one component connected through shared G values (measure a G common to them)",
            hint=named,
        )
