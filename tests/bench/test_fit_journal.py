"""bench/fit_journal.py on a committed journal (H100, 0e3a505: 140 grid points and 24 spread
points): the table of a calibration's journal, its KV spread term included and the spread
points' windows kept out of the grid's fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
JOURNAL = ROOT / "bench" / "journals" / "dense-2b-h100-draft-step-0e3a505.journal.jsonl"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """``(table path, fit_journal's stdout)`` of the committed journal."""
    out = tmp_path_factory.mktemp("fit") / "t.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fit_journal.py"), str(JOURNAL),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc.stdout


def test_journal_table_has_the_grid_and_the_spread_term(fitted):
    out, stdout = fitted
    assert "48 spread windows: 24 spread points fitted" in stdout
    doc = json.loads(out.read_text())
    cal = doc["calibration"]
    assert cal["mode"] == "draft_step" and cal["request_buckets"] == [1, 2, 4, 8, 16, 32, 64]
    assert cal["policy"] == {"switch_min_gain": 0.05, "update_interval": 5, "window_size": 20}
    points = doc["kv_spread"]["points"]
    assert len(points) == 24
    assert {p["context_index"] for p in points} == {0, 1, 2, 3}
    # the grid's fit saw no two-level window: at every spread point's key the table's step
    # cost is the uniform windows' own (spread windows there are slower)
    rows = [json.loads(x)["row"] for x in JOURNAL.read_text().splitlines()[1:]]
    assert len(doc["kv_model"]["points"]) == 140
    by_key = {(p["context_index"], p["bcap"], p["g"], p["k"]): p["step_ms"]
              for p in doc["kv_model"]["points"]}
    checked = 0
    for sp in points:
        key = (sp["context_index"], sp["bcap"], sp["g"], sp["k"])
        uniform = [r["step_ms"] for r in rows if not r.get("layout")
                   and (r["context_index"], r["bcap"], r["g"], r["k"]) == key]
        spread = [r["step_ms"] for r in rows if r.get("layout")
                  and (r["context_index"], r["bcap"], r["g"], r["k"]) == key]
        assert spread and min(uniform) <= by_key[key] <= max(uniform)
        checked += 1
    assert checked == 24


def test_the_live_lines_price_a_decoding_batch_as_the_surface_does(fitted):
    """A KV-aware, k-aware draft-step table (shared_rows KV slope, per-Bcap draft term): the live
    cost model prices each batch size's candidates on their lines in KV (the exact-KV memo
    never hits while a batch decodes) with the surface's values bit for bit, at every request
    count and at KV inside, on the edges of and outside the calibrated span; the adaptive
    policy decides the same rounds on both."""
    from speccal.costmodel.table import load_table
    from speccal.policy import BatchState, CostModel, Feedback, make_policy

    table = load_table(fitted[0])
    live, ref = CostModel.from_table(table, memo=True), CostModel.from_table(table)
    assert live.k_aware and live.kv_span is not None and ref.memo is None
    lo, hi = live.kv_span
    rng = np.random.default_rng(0)
    kvs = [lo - 1.0, lo, lo + 0.5, hi, hi + 0.25, *rng.uniform(lo, hi, 40).tolist()]
    finite = 0
    for b in range(0, max(live.geometry.request_buckets) + 2):
        for kv in kvs:
            got, want = live.step_costs(b, kv), ref.step_costs(b, kv)
            assert np.array_equal(got, want, equal_nan=True), (b, kv, got, want)
            finite += int(np.isfinite(got).sum())
    assert finite > 1000
    assert len(live.memo) < 200  # one line per batch size (and the bucket answers), not per KV
    policies = [make_policy("adaptive-step", c) for c in (live, ref)]
    for r in range(300):
        state = BatchState(round_index=r, num_requests=12, kv_length=400.0 + 1.5 * r)
        d_live, d_ref = (p.decide(state) for p in policies)
        assert (d_live.k, d_live.g, d_live.reason) == (d_ref.k, d_ref.g, d_ref.reason)
        assert np.array_equal(d_live.predicted_gain, d_ref.predicted_gain, equal_nan=True)
        accepted = rng.integers(0, d_live.k + 1, 12)
        for p in policies:
            p.observe(Feedback(round_index=r, k=d_live.k, accepted=accepted))
