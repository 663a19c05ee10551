"""bench/sim_sweep.py on the CPU: the sweep's workloads simulated on the committed tiny
draft-step table (no engine): every policy runs each workload to completion, deterministically."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "bench" / "sim_sweep.py"
TABLE = ROOT / "tables" / "tiny-cpu-draft-step.json"


def _run(tmp_path, *extra, name="sim.json"):
    out = tmp_path / name
    proc = subprocess.run([sys.executable, str(SIM), "--table", str(TABLE), "--json-out", str(out),
                           *extra], capture_output=True, text=True, cwd=ROOT, timeout=300)
    return proc, out


def test_simulated_sweep_runs_every_policy_to_completion_deterministically(tmp_path):
    args = ("--workloads", "n3-short-easy,n6-short-easy-to-hard", "--max-tokens", "16,48",
            "--seeds", "2", "--prompt-lens", "8,40")
    proc, out = _run(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["policy"] == {"window_size": 20, "update_interval": 5, "switch_min_gain": 0.05}
    assert list(doc["by_max_tokens"]) == ["16", "48"]
    for part in doc["by_max_tokens"].values():
        ws = part["workloads"]
        assert [w["workload"]["name"] for w in ws] == ["n3-short-easy", "n6-short-easy-to-hard"]
        assert part["adaptive_step_vs_best_fixed_pct_sweep_min"] == pytest.approx(
            min(w["gain_vs_best_fixed_pct"] for w in ws))
        assert part["adaptive_step_vs_best_fixed_pct_phased_min"] == pytest.approx(
            ws[1]["gain_vs_best_fixed_pct"])
        for w in ws:
            assert set(w["tokens_per_s"]) == {"fixed:1", "fixed:2", "fixed:3", "adaptive-step",
                                              "verify-bound"}
            assert all(v > 0 for v in w["tokens_per_s"].values())
            r = w["rounds"]
            if not w["workload"]["phased"]:  # easy throughout: more drafts, fewer rounds
                assert r["fixed:1"] > r["fixed:2"] > r["fixed:3"]
            assert w["best_fixed"] == max(("fixed:1", "fixed:2", "fixed:3"),
                                          key=w["tokens_per_s"].get)
    # longer runs take more rounds; the same seeds give the same figures
    short, long_ = (doc["by_max_tokens"][m]["workloads"][0]["rounds"]["fixed:1"]
                    for m in ("16", "48"))
    assert long_ > short
    again, out2 = _run(tmp_path, *args, name="again.json")
    assert again.returncode == 0 and json.loads(out2.read_text()) == doc
    other, out3 = _run(tmp_path, *args, "--window-size", "4", "--update-interval", "2",
                       name="other.json")
    assert other.returncode == 0
    assert json.loads(out3.read_text())["policy"] == {"window_size": 4, "update_interval": 2,
                                                      "switch_min_gain": 0.05}


def test_simulated_sweep_refuses_bad_input(tmp_path):
    proc, _ = _run(tmp_path, "--workloads", "n3-short-easy,nope")
    assert proc.returncode == 2 and "nope" in proc.stderr
    proc, _ = _run(tmp_path, "--max-tokens", "0")
    assert proc.returncode == 2 and "--max-tokens" in proc.stderr
    proc, _ = _run(tmp_path, "--window-size", "0")
    assert proc.returncode == 2 and "window_size" in proc.stderr
    verify = ROOT / "tables" / "tiny-cpu.json"  # a target_verify table
    proc = subprocess.run([sys.executable, str(SIM), "--table", str(verify),
                           "--score-informativeness", "1.5"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "--score-informativeness" in proc.stderr


def test_simulated_verify_sweep_scores_drafts_as_the_engine_does(tmp_path):
    """A target_verify table: fixed:1..3 and adaptive-verify, each draft scored and accepted as
    the engine's synthetic acceptance does (default informativeness 0.5, as bench_sweep's);
    the informativeness reaches the runs, and the same arguments give the same figures."""
    verify = ROOT / "tables" / "tiny-cpu.json"
    args = ("--workloads", "n6-short-easy-to-hard,n56-short-hard-to-easy", "--max-tokens", "48",
            "--seeds", "2", "--prompt-lens", "8,40")
    docs = {}
    for lam in (None, "0", "1"):
        extra = () if lam is None else ("--score-informativeness", lam)
        out = tmp_path / f"verify-{lam}.json"
        proc = subprocess.run([sys.executable, str(SIM), "--table", str(verify), "--json-out",
                               str(out), *args, *extra], capture_output=True, text=True,
                              cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr
        docs[lam] = json.loads(out.read_text())
    assert docs[None]["mode"] == "target_verify" and docs[None]["score_informativeness"] == 0.5
    for doc in docs.values():
        part = doc["by_max_tokens"]["48"]
        ws = part["workloads"]
        assert part["adaptive_verify_vs_best_fixed_pct_sweep_min"] == pytest.approx(
            min(w["gain_vs_best_fixed_pct"] for w in ws))
        assert part["verify_bound_vs_best_fixed_pct_sweep_min"] == pytest.approx(
            min(w["verify_bound_vs_best_fixed_pct"] for w in ws))
        assert part["verify_bound_vs_best_fixed_pct_phased_min"] == pytest.approx(
            min(w["verify_bound_vs_best_fixed_pct"] for w in ws if w["workload"]["phased"]))
        for w in ws:
            assert w["adaptive"] == "adaptive-verify"
            assert set(w["tokens_per_s"]) == {"fixed:1", "fixed:2", "fixed:3", "adaptive-verify",
                                              "verify-bound"}
            assert all(v > 0 for v in w["tokens_per_s"].values())

    assert docs["0"]["score_informativeness"] == 0.0 and docs["1"]["score_informativeness"] == 1.0
    assert docs["0"]["by_max_tokens"] != docs["1"]["by_max_tokens"]
    again = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, str(SIM), "--table", str(verify), "--json-out",
                           str(again), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0 and json.loads(again.read_text()) == docs[None]


@pytest.mark.parametrize("table", ["tiny-cpu-draft-step.json", "tiny-cpu.json"])
def test_the_verify_bound_emits_what_full_width_emits_on_fewer_rows(table):
    """The verify bound (no policy: every round drafts w and verifies exactly the drafts that
    pass) draws as ``fixed:w`` does: the same tokens in the same rounds, each round on at most
    fixed:w's target rows, so never priced above it where the table's cost grows with G; its
    gain over the best fixed k is reported per workload with the sweep's minimum."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from bench_sweep import BY_NAME, resolve
        from sim_sweep import simulate

        from speccal.costmodel.table import load_table
        from speccal.policy import CostModel, FixedPolicy
    finally:
        sys.path.remove(str(ROOT / "bench"))
    t = load_table(ROOT / "tables" / table)
    cost = CostModel.from_table(t)
    w = cost.draft_width
    spec = resolve(BY_NAME["n6-short-easy-to-hard"], tuple(t.calibration.request_buckets), 48,
                   (8, 40))
    full = simulate(cost, spec, FixedPolicy(cost, w), 7)
    bound = simulate(cost, spec, None, 7)
    assert bound["tokens"] == full["tokens"] and bound["rounds"] == full["rounds"]
    assert 0 < bound["ms"] <= full["ms"] * (1 + 1e-9)
