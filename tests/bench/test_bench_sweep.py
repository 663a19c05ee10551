"""bench/bench_sweep.py on the CPU: the tiny preset and the committed ``tables/tiny-cpu.json``
(``target_verify``: ``fixed:1..3`` and ``adaptive-verify``, both priced by the table on
partly filled buckets), a small sweep of three workloads (request counts that are not buckets,
per-request ``max_tokens`` so the batch shrinks mid-run, both phase directions), each in its own
child process. Every round must be priced and every run's live decisions must equal the replay's
on its own trace; the record lines carry the issue's metric names.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_sweep.py"
TABLE = ROOT / "tables" / "tiny-cpu.json"
WORKLOADS = ("n3-short-easy", "n40-long-easy-to-hard", "n56-short-hard-to-easy")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_sweep")
    cmd = [sys.executable, str(BENCH), "--table", str(TABLE), "--model", "tiny", "--device",
           "cpu", "--workloads", ",".join(WORKLOADS), "--repeats", "2", "--max-tokens", "12",
           "--prompt-lens", "8,40", "--json-out", str(out / "sweep.json"), "--plot",
           str(out / "errors.png"), "--record", "--results", str(out / "results.jsonl"),
           "--save-runs", str(out / "runs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "sweep.json").read_text())
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    return doc, lines, out


def _module():
    """bench/bench_sweep.py imported (it imports ``results`` from bench/, as a script does)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("bench_sweep_under_test", BENCH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses resolve their annotations through it
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return mod


def test_small_sweep_prices_every_round_and_replays_the_live_decisions(sweep):
    doc, _, _ = sweep
    assert doc["failures"] == []
    assert [d["workload"]["name"] for d in doc["workloads"]] == list(WORKLOADS)
    buckets = (1, 2, 4, 8)
    counts = [d["workload"]["num_requests"] for d in doc["workloads"]]
    assert counts == [3, 5, 7] and not any(n in buckets for n in counts)
    for d in doc["workloads"]:
        assert d["mode"] == "target_verify" and d["adaptive"] == "adaptive-verify"
        # a target_verify table: the synthetic acceptance's scores rank the drafts
        assert d["setup"]["score_informativeness"] == 0.5
        assert set(d["policies"]) == {"fixed:1", "fixed:2", "fixed:3", "adaptive-verify"}
        assert len(set(d["workload"]["max_tokens"])) > 1
        for name, p in d["policies"].items():
            assert len(p["runs"]) == 2
            for r in p["runs"]:
                # every round priced: the table covers every partly filled bucket it ran
                assert r["rounds_priced"] == r["rounds"] > 0 and r["rounds_uncalibrated"] == 0
                assert r["decisions_match"] and r["verified_match"], (d["workload"]["name"], name)
                assert np.isfinite(r["error_pct"]) and r["replay_tokens_per_s"] > 0
                # requests with their own max_tokens leave one by one: the batch shrinks
                assert r["batch_max"] == d["workload"]["num_requests"] > r["batch_min"]
                assert r["output_tokens"] == sum(d["workload"]["max_tokens"])
                # the live trace records each round's longest request: never below its mean
                assert r["kv_spread"]["median_max_over_mean"] >= 1.0
                # per phase: rounds and tokens add up to the run's; k stays inside the width
                assert sum(x["rounds"] for x in r["phases"]) == r["rounds"]
                assert len(r["phases"]) == (2 if d["workload"]["phased"] else 1)
                assert all(1 <= x["mean_k"] <= 3 and x["seconds"] > 0 for x in r["phases"])
                assert sum(seg[1] for seg in r["k_timeline"]) == r["rounds"]
                # what the machine did during the run: this process ran, nothing on a GPU
                h = r["host"]
                assert h["wall_s"] > 0 and h["cpu_s"] > 0 and h["involuntary_switches"] >= 0
                assert h["gpu_before"] is None and h["gpu_after"] is None
                assert len(h["gc_collections"]) == 3 and min(h["gc_collections"]) >= 0
                assert 0 < r["round_ms_median"] <= r["round_ms_max"]
                # the run's rounds split into transitions (a new batch size) and steady ones,
                # and into buckets; each part's live and replay ms add up to the whole
                res = r["residual"]
                tr, st = res["transition"], res["steady"]
                assert tr["rounds"] >= 2 and tr["rounds"] + st["rounds"] == r["rounds"]
                assert sum(x["rounds"] for x in res["by_bcap"].values()) == r["rounds"]
                assert sum(x["rounds"] for x in res["by_kv"].values()) == r["rounds"]
                assert set(res["by_kv"]) <= {"0-256", "256-512", "512-1024", "1024-2048",
                                             "2048-inf"}
                live_ms = tr["live_ms"] + st["live_ms"]
                rep_ms = tr["replay_ms"] + st["replay_ms"]
                assert abs(sum(x["excess_ms"] for x in res["by_bcap"].values())
                           - (live_ms - rep_ms)) < 1e-2
                # the replay's tokens/s is its tokens over these ms: its error is theirs
                assert r["error_pct"] == pytest.approx(100 * abs(live_ms - rep_ms) / rep_ms,
                                                       rel=1e-2, abs=1e-2)
        assert np.isfinite(d["gain_vs_best_fixed_pct"])
        assert np.isfinite(d["gain_vs_phase_oracle_pct"])
        assert len(d["phases"]) == (2 if d["workload"]["phased"] else 1)
    m = doc["metrics"]
    br = doc["context"]["residual_breakdown"]
    assert set(br) == {"all", "fixed", "adaptive"}
    total = sum(r["residual"]["transition"]["rounds"] + r["residual"]["steady"]["rounds"]
                for d in doc["workloads"] for p in d["policies"].values() for r in p["runs"])
    assert br["all"]["transition"]["rounds"] + br["all"]["steady"]["rounds"] == total
    assert set(br["all"]["by_bcap"]) <= {"1", "2", "4", "8"}
    assert m["uncalibrated_rounds_pct_sweep_max"] == 0.0
    assert doc["context"]["decisions_match"] and doc["context"]["unpriced_runs"] == 0
    worst = max(r["error_pct"] for d in doc["workloads"] for p in d["policies"].values()
                for r in p["runs"])
    assert m["replay_vs_live_error_pct_sweep_max"] == pytest.approx(worst)
    gains = [d["gain_vs_best_fixed_pct"] for d in doc["workloads"]]
    assert m["adaptive_verify_vs_best_fixed_pct_sweep_min"] == pytest.approx(min(gains))
    assert m["adaptive_verify_vs_best_fixed_pct_phased_min"] == pytest.approx(min(gains[1:]))


def test_small_sweep_records_the_metrics_and_plots(sweep):
    doc, lines, out = sweep
    names = {x["metric"] for x in lines}
    assert names == {
        "replay_vs_live_error_pct_sweep_max",
        "replay_vs_live_error_pct_sweep_max_undisturbed",
        "uncalibrated_rounds_pct_sweep_max",
        "adaptive_verify_vs_best_fixed_pct_sweep_min",
        "adaptive_verify_vs_best_fixed_pct_phased_min",
        "adaptive_verify_vs_phase_oracle_pct_sweep_min",
        "adaptive_verify_vs_phase_oracle_pct_phased_min",
    }
    for x in lines:
        for key in ("metric", "value", "unit", "device", "commit", "date", "command"):
            assert key in x
        assert x["table_mode"] == "target_verify" and x["repeats"] == 2
        assert len(x["workloads"]) == 3 and x["decisions_match"] is True
        assert list(x["by_workload"]) == list(WORKLOADS)
        assert [w["num_requests"] for w in x["by_workload"].values()] == [3, 5, 7]
    png = (out / "errors.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_saved_runs_replay_to_the_sweeps_own_errors(sweep):
    """bench/sweep_runs.py reads every saved run back and replays it against the same table:
    the same error for every run as the sweep reported, the same decisions."""
    doc, _, out = sweep
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import sweep_runs

        from speccal.policy import AdaptiveStepConfig

        res = sweep_runs.rereplay(out / "runs", TABLE, AdaptiveStepConfig(20, 5, 0.05))
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert sorted(res["workloads"]) == sorted(WORKLOADS)
    for d in doc["workloads"]:
        again = res["workloads"][d["workload"]["name"]]
        assert sorted(again) == sorted(d["policies"])
        for name, p in d["policies"].items():
            assert len(again[name]["errors"]) == len(p["runs"]) == 2
            # runs are saved in run order; each policy's runs keep their order
            np.testing.assert_allclose(again[name]["errors"],
                                       [r["error_pct"] for r in p["runs"]], rtol=1e-9)
            assert again[name]["decisions_match"] == p["decisions_match"]
    assert res["residual_breakdown"]["all"]["steady"]["rounds"] > 0


def test_merge_recomputes_the_sweeps_metrics_from_its_workload_documents(sweep, tmp_path):
    """--merge over the per-workload documents a sweep wrote (as two calls would leave them)
    gives the sweep's own metrics; a workload twice or a different setup is refused."""
    doc, lines, out = sweep
    parts = [str(out / f"sweep.{name}.json") for name in reversed(WORKLOADS)]
    cmd = [sys.executable, str(BENCH), "--table", "carried/ds.json", "--merge", *parts,
           "--json-out", str(tmp_path / "merged.json"), "--record", "--results",
           str(tmp_path / "results.jsonl")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [d["workload"]["name"] for d in merged["workloads"]] == list(WORKLOADS)
    assert merged["metrics"] == doc["metrics"]
    again = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(x["metric"], x["value"]) for x in again] == [(x["metric"], x["value"]) for x in lines]
    assert again[0]["device"].startswith("cpu") and again[0]["table"] == "carried/ds.json"
    twice = subprocess.run(cmd[:5] + [parts[0], parts[0]], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
    assert twice.returncode == 2 and "given twice" in twice.stderr
    other = json.loads(Path(parts[0]).read_text())
    other["setup"]["repeats"] = 5
    (tmp_path / "other.json").write_text(json.dumps(other))
    mixed = subprocess.run(cmd[:5] + [str(tmp_path / "other.json"), parts[1]],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert mixed.returncode == 2 and "repeats" in mixed.stderr
    assert other["setup"]["max_tokens"] == 12  # runs of another length are another sweep
    other["setup"] |= {"repeats": 2, "max_tokens": 1024}
    (tmp_path / "other.json").write_text(json.dumps(other))
    longer = subprocess.run(cmd[:5] + [str(tmp_path / "other.json"), parts[1]],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert longer.returncode == 2 and "max_tokens" in longer.stderr


def test_workload_counts_are_not_buckets_over_the_whole_range():
    mod = _module()
    assert len(mod.WORKLOADS) >= 8
    cuda = [mod.scaled_count(w.requests_of_64, (1, 2, 4, 8, 16, 32, 64)) for w in mod.WORKLOADS]
    assert cuda == [3, 5, 6, 12, 24, 40, 48, 56, 62]
    small = {mod.scaled_count(w.requests_of_64, (1, 2, 4, 8)) for w in mod.WORKLOADS}
    assert small == {3, 5, 6, 7}  # every count below the top bucket 8 that is not a bucket
    phased = [w.acceptance for w in mod.WORKLOADS if w.phased]
    assert ("easy", "hard") in phased and ("hard", "easy") in phased
    assert {p for w in mod.WORKLOADS for p in w.prompts} == {"short", "long"}


def test_phase_oracle_takes_the_best_fixed_rate_of_each_phase():
    mod = _module()

    def run(phase, tokens, ms):
        return SimpleNamespace(phase=np.asarray(phase), round_tokens=np.asarray(tokens, float),
                               round_ms=np.asarray(ms, float))

    # fixed:1 runs 1000 tok/s in phase 0 and 500 in phase 1; fixed:3 the other way round
    fixed = {"fixed:1": [run([0, 1], [10, 10], [10, 20])],
             "fixed:3": [run([0, 1], [10, 10], [20, 10])]}
    adaptive = [run([0, 0, 1], [30, 30, 40], [1, 1, 1])]  # 60 tokens in phase 0, 40 in phase 1
    got = mod.oracle_tokens_per_s(adaptive, fixed)
    assert got["best_per_phase"] == {"0": "fixed:1", "1": "fixed:3"}
    assert got["tokens_per_s"] == pytest.approx(100.0 / (60 / 1000.0 + 40 / 1000.0))
    fixed["fixed:1"] = [run([0, 1], [10, 10], [10, 40])]  # slower in phase 1: no change
    assert mod.oracle_tokens_per_s(adaptive, fixed)["tokens_per_s"] == pytest.approx(1000.0)


def test_a_draft_step_table_prices_partly_filled_rounds_at_their_own_k(tmp_path):
    """``tables/tiny-cpu-draft-step.json`` (schema 3: the partly filled shapes measured, a
    draft-forward term per Bcap): ``fixed:1..3`` and ``adaptive-step`` at 3 and 5 requests
    (buckets 4 and 8 partly filled, shrinking), every round priced, live == replay."""
    table = ROOT / "tables" / "tiny-cpu-draft-step.json"
    cmd = [sys.executable, str(BENCH), "--table", str(table), "--model", "tiny", "--device",
           "cpu", "--workloads", "n3-short-easy,n40-long-easy-to-hard", "--repeats", "1",
           "--max-tokens", "12", "--prompt-lens", "8,40", "--json-out", str(tmp_path / "s.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["failures"] == []
    for d in doc["workloads"]:
        assert d["mode"] == "draft_step" and d["adaptive"] == "adaptive-step"
        for name, p in d["policies"].items():
            for r in p["runs"]:
                assert r["rounds_priced"] == r["rounds"] > 0 and r["rounds_uncalibrated"] == 0
                assert r["decisions_match"], (d["workload"]["name"], name)
                assert r["batch_max"] == d["workload"]["num_requests"] > r["batch_min"]
    assert doc["metrics"]["uncalibrated_rounds_pct_sweep_max"] == 0.0


def test_a_run_slower_for_the_same_work_is_flagged_and_kept_in_the_worst():
    """The H100's disturbed runs (n3-short-easy fixed:1 at 0a2c622): live 1,524 / 980 / 1,508
    tok/s against replays of 1,517 / 1,541 / 1,497: the second ran the same work 35 % slower.
    It is flagged, stays in the headline (judged by the worst) and is left out of the
    undisturbed figure; a run whose replay moved too (other work) is not flagged, nor are two
    runs (no majority)."""
    mod = _module()

    def rows(live, rep):
        return [{"live_tokens_per_s": a, "replay_tokens_per_s": b,
                 "error_pct": 100 * abs(b - a) / a, "uncalibrated_pct": 0.0}
                for a, b in zip(live, rep, strict=True)]

    seen = rows([1524.0, 980.0, 1508.0], [1517.0, 1541.0, 1497.0])
    mod.flag_disturbed(seen)
    assert [r["disturbed"] for r in seen] == [False, True, False]
    assert seen[1]["live_vs_median_pct"] == pytest.approx(100 * (980 / 1508 - 1))
    other = rows([1524.0, 980.0, 1508.0], [1517.0, 1000.0, 1497.0])  # its replay slowed too
    mod.flag_disturbed(other)
    assert not any(r["disturbed"] for r in other)
    two = rows([1524.0, 980.0], [1517.0, 1541.0])
    mod.flag_disturbed(two)
    assert not any(r["disturbed"] for r in two) and two[0]["live_vs_median_pct"] is None
    doc = {"workload": {"name": "n3-short-easy", "phased": False, "num_requests": 3},
           "adaptive": "adaptive-step",
           "policies": {"fixed:1": {"runs": seen, "decisions_match": True,
                                    "error_pct_max": max(r["error_pct"] for r in seen),
                                    "uncalibrated_pct_max": 0.0}},
           "gain_vs_best_fixed_pct": 0.0, "gain_vs_phase_oracle_pct": 0.0,
           "best_fixed": "fixed:1"}
    got = mod.sweep_metrics([doc])
    assert got["metrics"]["replay_vs_live_error_pct_sweep_max"] == pytest.approx(
        100 * (1541 - 980) / 980)
    assert got["metrics"]["replay_vs_live_error_pct_sweep_max_undisturbed"] == pytest.approx(
        max(seen[0]["error_pct"], seen[2]["error_pct"]))
    assert got["context"]["disturbed_runs"] == [
        {"workload": "n3-short-easy", "policy": "fixed:1", "run": 1,
         "error_pct": round(seen[1]["error_pct"], 3),
         "live_vs_median_pct": round(seen[1]["live_vs_median_pct"], 3), "host": None}]
