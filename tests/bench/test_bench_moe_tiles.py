"""bench/bench_moe_tiles.py without a GPU: the configurations it sweeps (the shipped tiles
first, every one a valid ``ExpertTiles``, no two alike), its refusals, and the routings its
calls cycle through (one-row calls on disjoint expert sets)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_moe_tiles.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          timeout=120)


def test_the_list_starts_with_the_shipped_tiles_and_has_no_twins():
    from speccal.kernels.config import DEFAULT_TILES

    res = _run("--list")
    assert res.returncode == 0, res.stderr
    labels = res.stdout.split()
    assert labels[0] == DEFAULT_TILES.label() and len(labels) == len(set(labels)) >= 10


@pytest.mark.parametrize("args, says", [
    (("--tiles", "gu1x1"), "--tiles: unknown gu1x1"),
    (("--rows", "0"), "--rows: got [0]"),
    (("--rows", "a"), "--rows: got 'a'"),
    (("--top-k", "9", "--experts", "8"), "--top-k / --experts: got 9 / 8"),
    (("--timing", "wall"), "--timing: invalid choice: 'wall'"),
])
def test_bad_options_are_refused_by_name(args, says):
    res = _run(*args)
    assert res.returncode == 2 and says in res.stderr, res.stderr


def test_the_calls_rotate_through_disjoint_expert_sets():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_moe_tiles
    finally:
        sys.path.remove(str(BENCH.parent))
    routes = bench_moe_tiles._routings(3, 64, 6, "cpu")
    assert routes.shape == (10, 3, 6)
    firsts = [set(r[0].tolist()) for r in routes]  # one-row calls: disjoint expert sets
    assert all(len(s) == 6 for s in firsts)
    assert all(not (a & b) for i, a in enumerate(firsts) for b in firsts[i + 1:])
    # every row routes to six distinct experts of the 64
    assert all(len(set(row.tolist())) == 6 for r in routes for row in r)
    assert int(routes.max()) < 64 and int(routes.min()) >= 0
