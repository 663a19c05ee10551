"""bench/fit_journal.py on a committed journal (H100, 0e3a505: 140 grid points and 24 spread
points): the table of a calibration's journal, its KV spread term included and the spread
points' windows kept out of the grid's fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOURNAL = ROOT / "bench" / "journals" / "dense-2b-h100-draft-step-0e3a505.journal.jsonl"


def test_journal_table_has_the_grid_and_the_spread_term(tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fit_journal.py"), str(JOURNAL),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "48 spread windows: 24 spread points fitted" in proc.stdout
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
