"""bench/bench_policy_host.py on the committed tiny tables: a record line with the host time
the adaptive policy adds per round and its ratio to fixed:1's; bad input refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_policy_host.py"


@pytest.mark.parametrize(("table", "metric"), [
    ("tiny-cpu-draft-step.json", "adaptive_step_host_us_per_round"),
    ("tiny-cpu.json", "adaptive_verify_host_us_per_round"),
])
def test_records_the_adaptive_policys_host_time_per_round(tmp_path, table, metric):
    out = tmp_path / "r.jsonl"
    proc = subprocess.run([sys.executable, str(BENCH), "--table", str(ROOT / "tables" / table),
                           "--batch", "3", "--rounds", "200", "--repeats", "2", "--record",
                           "--results", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["metric"] == metric and line["unit"] == "us" and line["value"] > 0
    assert line["fixed_1_us"] > 0
    assert line["ratio_to_fixed_1"] == pytest.approx(line["value"] / line["fixed_1_us"], rel=0.02)
    assert line["p95_us"] >= line["value"] * 0.5 and line["batch"] == 3


def test_refuses_a_batch_past_the_tables_buckets():
    proc = subprocess.run([sys.executable, str(BENCH), "--table",
                           str(ROOT / "tables" / "tiny-cpu.json"), "--batch", "999"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "--batch" in proc.stderr
