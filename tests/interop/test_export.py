"""``speccal export`` / ``speccal import`` end to end: golden files from the shipped tables and
trace, the engines' rules on every golden, the sidecar's evidence, and bad inputs."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from speccal.cli import app
from speccal.costmodel.table import load_table
from speccal.interop.export import ExportRequest, run_export, sidecar_path
from speccal.trace import load_trace

from . import engine_files
from .engine_rules import (
    check_sglang,
    check_sglang_adaptive,
    check_trtllm,
    check_vllm,
    sglang_adaptive_steps,
    trtllm_draft_len,
    vllm_dense,
)
from .make_fixtures import EXPORTS, GOLDEN, K0_MS

ROOT = Path(__file__).resolve().parents[2]
ENV = {"COLUMNS": "100", "NO_COLOR": "1"}
RULES = {
    "vllm": check_vllm,
    "trtllm": check_trtllm,
    "sglang": check_sglang,
    "sglang-adaptive": check_sglang_adaptive,
}
TRACE = "notebooks/data/transition.parquet"
DRAFT_STEP = "tables/dense-2b-h200-draft-step.json"


@pytest.fixture()
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _sidecar(path: Path) -> dict:
    d = json.loads(path.read_text())
    d.pop("created")
    return d


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_exports_match_their_golden_files_and_pass_the_engines_rules(name, at_root, tmp_path):
    table, engine, opts = EXPORTS[name]
    out = tmp_path / name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_export(ExportRequest(table=table, engine=engine, out=out, **opts))
    golden = ROOT / GOLDEN / name
    assert out.read_text() == golden.read_text()
    assert _sidecar(res.sidecar) == _sidecar(sidecar_path(golden))
    RULES[engine](golden.read_text())  # the engine's loader accepts the committed file


def test_vllm_golden_runs_the_replays_best_k_per_bucket(at_root):
    cfg = check_vllm((GOLDEN / "vllm.json").read_text())
    side = json.loads(sidecar_path(GOLDEN / "vllm.json").read_text())
    dense = vllm_dense(cfg, 8)
    for b in side["buckets"]:
        tps = {int(k): v for k, v in b["tokens_per_s"].items() if v is not None}
        assert set(tps) == {1, 2, 3}  # every k; k = 0 not priced in this table
        assert b["best_k"] == max(tps, key=tps.get) == dense[b["bcap"]]
        assert b["gain_vs_k_pct"][str(b["best_k"])] == 0.0
    # the held-out error decisions are compared with is the table's own: the worst context's
    # leave-one-point-out mean error, else its leave-one-G-out one (no KV model here)
    t = load_table(ROOT / DRAFT_STEP)
    assert t.kv_model is None
    held = side["table"]["heldout"]
    lopo = [f.diagnostics.leave_one_point_out.mean_abs_pct for f in t.fits]
    logo = [f.diagnostics.leave_one_g_out.mean_abs_pct for f in t.fits]
    name, vals = (
        ("leave_one_point_out", lopo)
        if any(v is not None for v in lopo)
        else ("leave_one_g_out", logo)
    )
    assert held["metric"] == f"{name}.mean_abs_pct"
    assert held["pct"] == pytest.approx(max(v for v in vals if v is not None), abs=1e-6)
    for b in side["buckets"]:
        assert b["decisive"] == (b["margin_pct"] > held["pct"])
    assert side["pricing"] == {
        "model": "context_fit",
        "kv_length": side["acceptance"]["kv_length"],
        "fit": t.model,
        "contexts": [[f.min_kv_length, f.max_kv_length] for f in t.fits],
    }
    assert side["table"]["compatibility"]["device"]["name"] == "NVIDIA H200"
    assert side["valid_for"]["batch_sizes"] == [1, 8] and side["valid_for"]["kv_length"] == [
        1,
        1024,
    ]
    assert side["engine"]["matched"][0]["commit"] == "a6f6bb1d3c1707ede85d03a7c7d47a105a1873fc"
    assert (
        side["file"]["sha256"]
        == __import__("hashlib").sha256((GOLDEN / "vllm.json").read_bytes()).hexdigest()
    )
    wl = side["workload"]
    fixed = {int(k): v for k, v in wl["fixed_tokens_per_s"].items() if v is not None}
    assert wl["rounds"] == 2000 and wl["best_fixed_k"] == max(fixed, key=fixed.get)


def test_k0_golden_prices_no_speculation_from_the_flag(at_root):
    side = json.loads(sidecar_path(GOLDEN / "vllm-metrics-k0.json").read_text())
    assert side["acceptance"]["kind"] == "profile"
    assert side["acceptance"]["meta"]["format"] == "vllm-metrics"
    for b in side["buckets"]:
        assert b["k0_source"] == "--k0-ms"
        ms = dict(x.split("=") for x in K0_MS.split(","))[str(b["bcap"])]
        assert b["tokens_per_s"]["0"] == pytest.approx(1000 * b["bcap"] / float(ms), rel=1e-6)
    wl = side["workload"]  # a profile: equal serving time at every bucket
    assert wl["buckets"] == [1, 2, 4, 8] and wl["gain_vs_best_fixed_pct"] >= 0.0
    rates = [b["tokens_per_s"][str(b["exported_k"])] for b in side["buckets"]]
    assert wl["schedule_tokens_per_s"] == pytest.approx(np.mean(rates), rel=1e-6)


def _check_trtllm_adjustments(spec, side):
    """The sidecar lists exactly the buckets where TensorRT-LLM runs another k than the best
    (the engine's rule applied), with what it runs; the unconstrained schedule is kept then."""
    runs = {b["bcap"]: trtllm_draft_len(spec, b["bcap"]) for b in side["buckets"]}
    assert {b["bcap"]: b["exported_k"] for b in side["buckets"]} == runs
    assert spec["max_draft_len"] == runs[min(runs)] == max(runs.values())
    changed = {b["bcap"]: (b["best_k"], runs[b["bcap"]]) for b in side["buckets"]}
    changed = {b: v for b, v in changed.items() if v[0] != v[1]}
    assert {a["bcap"]: (a["best_k"], a["exported_k"]) for a in side["adjustments"]} == changed
    assert (side["speccal_workload"] is not None) == bool(changed)
    return changed


def test_trtllm_golden_records_the_engine_rule_it_applied(at_root):
    spec = check_trtllm((GOLDEN / "trtllm.yaml").read_text())
    side = json.loads(sidecar_path(GOLDEN / "trtllm.yaml").read_text())
    _check_trtllm_adjustments(spec, side)


def test_trtllm_export_applies_the_smallest_key_rule(at_root, tmp_path):
    # k = 0 priced far cheaper than any speculative step at bucket 1 only: its best k is 0,
    # which TensorRT-LLM cannot run there (the smallest key carries max_draft_len > 0)
    out = tmp_path / "t.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_export(
            ExportRequest(
                table=Path(DRAFT_STEP), engine="trtllm", out=out, trace=Path(TRACE), k0_ms="1=0.001"
            )
        )
    spec = check_trtllm(out.read_text())
    side = res.report
    best = {b["bcap"]: b["best_k"] for b in side["buckets"]}
    assert best[1] == 0 and max(best.values()) > 0
    changed = _check_trtllm_adjustments(spec, side)
    assert changed[1] == (0, spec["max_draft_len"])
    (adj,) = [a for a in side["adjustments"] if a["bcap"] == 1]
    assert "max_draft_len" in adj["why"] and adj["tokens_per_s_lost_pct"] > 0


def test_sglang_golden_sidecar_holds_the_metadata_sglang_lacks(at_root):
    side = json.loads(sidecar_path(GOLDEN / "sglang-additive.json").read_text())
    assert side["table"]["compatibility"]["model"]["architecture"] == "preset:tiny"
    assert side["fidelity"]["points"] > 0
    assert side["workload"]["adaptive_policy"] == "adaptive-verify"  # the trace has scores
    assert {b["bcap"] for b in side["buckets"]} == {1, 2, 4, 8}
    no_acc = json.loads(sidecar_path(GOLDEN / "sglang-sps.json").read_text())
    assert no_acc["acceptance"] is None and no_acc["buckets"] == []


def test_sglang_export_of_a_kv_model_table_records_the_model_and_kv(at_root, tmp_path):
    table = Path("tables/dense-2b-h200.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = load_table(table)
        res = run_export(
            ExportRequest(table=table, engine="sglang", out=tmp_path / "s.json", kv_length=1500.0)
        )
    kvm = t.kv_model
    assert res.report["pricing"] == {
        "model": "kv_model",
        "kv_length": 1500.0,
        "kv_term": kvm.kv_term,
        "kv_span": [kvm.min_kv_length, kvm.max_kv_length],
        "form": "bias + alpha(Bcap) + theta(G) + slope(G) * G * kv",
    }
    # decisions are compared with the error of the model that prices them
    held = res.report["table"]["heldout"]
    worst = max(c.leave_one_point_out.mean_abs_pct for c in kvm.per_context)
    assert held["metric"].startswith("kv_model.") and held["pct"] == pytest.approx(worst, abs=1e-6)
    assert any("KV model" in n and "1500" in n for n in res.report["notes"])


def _run(*args):
    return CliRunner().invoke(app, list(args), env=ENV)


def test_cli_export_json_is_the_sidecar(at_root, tmp_path):
    out = tmp_path / "v.json"
    r = _run("export", DRAFT_STEP, "--to", "vllm", "--trace", TRACE, "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc == json.loads((tmp_path / "v.speccal.json").read_text())
    check_vllm(out.read_text())


def test_cli_export_human_output(at_root, tmp_path):
    out = tmp_path / "t.yaml"
    r = _run("export", DRAFT_STEP, "--to", "trtllm", "--trace", TRACE, "--out", str(out))
    assert r.exit_code == 0, r.output
    for needle in ("k=0", "k=3", "held-out error", "over the best single fixed k", "wrote"):
        assert needle in r.output, needle
    side = json.loads((tmp_path / "t.speccal.json").read_text())
    # the output marks every margin inside the held-out error, and every engine-rule change
    assert ("within error" in r.output) == any(b["decisive"] is False for b in side["buckets"])
    assert ("draft_len_schedule[smallest key]" in r.output) == bool(side["adjustments"])
    # k = 0 priced half the held-out error above bucket 1's best k: bucket 1's best is k = 0
    # by a margin inside the error, and TensorRT-LLM cannot run 0 at its smallest key
    b1 = next(b for b in side["buckets"] if b["bcap"] == 1)
    pct = side["table"]["heldout"]["pct"]
    k0_ms = 1000.0 / (b1["tokens_per_s"][str(b1["best_k"])] * (1 + pct / 200))
    r = _run(
        "export", DRAFT_STEP, "--to", "trtllm", "--trace", TRACE, "--out", str(out),
        "--k0-ms", f"1={k0_ms!r}",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    side = json.loads((tmp_path / "t.speccal.json").read_text())
    b1 = next(b for b in side["buckets"] if b["bcap"] == 1)
    assert b1["best_k"] == 0 and b1["decisive"] is False
    assert b1["margin_pct"] == pytest.approx(pct / 2, rel=1e-3)
    assert "within error" in r.output and "draft_len_schedule[smallest key]" in r.output
    k1 = side["buckets"][0]["exported_k"]
    assert side["buckets"][0]["bcap"] == 1 and k1 > 0
    assert f"engine rule: Bcap 1 exported k={k1} (best 0," in r.output


@pytest.mark.parametrize(
    "args, field",
    [
        (["tables/tiny-cpu.json", "--to", "vllm", "--trace", TRACE], "table.mode"),
        ([DRAFT_STEP, "--to", "sglang"], "table.mode"),
        (["tables/tiny-cpu.json", "--to", "sglang-adaptive", "--trace", TRACE], "table.mode"),
        ([DRAFT_STEP, "--to", "vllm"], "--trace/--profile"),
        ([DRAFT_STEP, "--to", "tgi", "--trace", TRACE], "--to"),
        (
            [DRAFT_STEP, "--to", "vllm", "--trace", TRACE, "--profile", "marginal:0.5"],
            "--trace/--profile",
        ),
        ([DRAFT_STEP, "--to", "vllm", "--profile", "marginal:0.5,x"], "--profile"),
        ([DRAFT_STEP, "--to", "vllm", "--profile", "marginal:0.5,0.7,0.1"], "--profile[1]"),
        ([DRAFT_STEP, "--to", "vllm", "--profile", "marginal:0.5,0.4"], "trace.draft_width"),
        ([DRAFT_STEP, "--to", "vllm", "--trace", TRACE, "--k0-ms", "3=1"], "--k0-ms"),
        (["tables/tiny-cpu.json", "--to", "sglang", "--k0-ms", "1"], "--k0-ms"),
        ([DRAFT_STEP, "--to", "vllm", "--trace", "missing.parquet"], "trace"),
        ([DRAFT_STEP, "--to", "vllm", "--profile", "missing.prom"], "--profile"),
        ([DRAFT_STEP, "--to", "vllm", "--trace", TRACE, "--kv-length", "-1"], "--kv-length"),
    ],
)
def test_cli_export_bad_inputs_are_one_line_and_write_nothing(at_root, tmp_path, args, field):
    out = tmp_path / "x.json"
    r = _run("export", *args, "--out", str(out))
    assert r.exit_code == 2, r.output
    err = r.output.strip()
    assert err.startswith("error:") and field in err and "\n" not in err, err
    assert not out.exists() and not (tmp_path / "x.speccal.json").exists()


def test_cli_export_checks_outputs_before_the_work(at_root, tmp_path):
    r = _run(
        "export",
        DRAFT_STEP,
        "--to",
        "vllm",
        "--trace",
        TRACE,
        "--out",
        str(tmp_path / "no" / "x.json"),
    )
    assert r.exit_code == 2 and "--out" in r.output
    r = _run(
        "export",
        DRAFT_STEP,
        "--to",
        "vllm",
        "--trace",
        TRACE,
        "--out",
        str(tmp_path / "x.json"),
        "--sidecar",
        str(tmp_path / "x.json"),
    )
    assert r.exit_code == 2 and "--sidecar" in r.output


def test_cli_import_then_replay_keeps_the_per_position_acceptance(at_root, tmp_path):
    out = tmp_path / "imported.parquet"
    r = _run("import", "notebooks/data/interop/vllm-metrics.prom", "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    c = engine_files.counts(load_trace(ROOT / TRACE))
    assert summary["prefix_acceptance"] == pytest.approx([v / c["drafts"] for v in c["per_pos"]])
    r = _run("replay", "--table", DRAFT_STEP, "--trace", str(out), "--json")
    assert r.exit_code == 0, r.output
    fixed3 = next(p for p in json.loads(r.stdout)["policies"] if p["name"] == "fixed:3")
    assert fixed3["mean_accepted_length"] == pytest.approx(c["accepted"] / c["drafts"])
    assert fixed3["acceptance_rate"] == pytest.approx(c["accepted"] / c["draft_tokens"])


def test_cli_import_bad_file_is_one_line(tmp_path):
    p = tmp_path / "m.prom"
    p.write_text("")
    r = _run("import", str(p), "--out", str(tmp_path / "t.parquet"))
    assert r.exit_code == 2 and "empty" in r.output and "\n" not in r.output.strip()
    assert not (tmp_path / "t.parquet").exists()


def test_time_in_the_engine_fit_in_speccal_export_back(at_root, tmp_path):
    """Rows timed in an engine at k = 0..w (k = 0: G = Bcap) -> speccal fit -> export: vLLM's
    K = 0 is priced only from --k0-ms (its K = 0 step still runs a drafter forward), so the
    fitted table's k = 0 windows are not used; with --k0-ms the schedule drops speculation
    where it loses."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = load_table(ROOT / DRAFT_STEP).measurements()
    k0 = rows[rows["k"] == 1].copy()
    k0["k"] = 0
    k0["g"] = k0["bcap"]
    k0["step_ms"] = 0.6 * k0["step_ms"]  # a plain step well below a k = 1 round
    k0["elapsed_s"] = k0["step_ms"] * k0["window_steps"] / 1000.0
    csv = tmp_path / "engine-steps.csv"
    pd.concat([rows, k0]).to_csv(csv, index=False)
    fitted = tmp_path / "fitted.json"
    r = _run("fit", str(csv), "--out", str(fitted))
    assert r.exit_code == 0, r.output
    out = tmp_path / "vllm.json"
    hard = "conditional:0.2,0.2,0.2"  # acceptance this low: speculation loses everywhere
    args = ["export", str(fitted), "--to", "vllm", "--profile", hard, "--kv-length", "512"]
    r = _run(*args, "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    side = json.loads(r.stdout)
    assert all(b["k0_source"] is None and b["best_k"] > 0 for b in side["buckets"])
    k0_ms = ",".join(f"{b}={ms:.4f}" for b, ms in k0.groupby("bcap")["step_ms"].median().items())
    r = _run(*args, "--k0-ms", k0_ms, "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    side = json.loads(r.stdout)
    assert all(b["k0_source"] == "--k0-ms" for b in side["buckets"])
    assert all(b["best_k"] == 0 for b in side["buckets"])
    assert check_vllm(out.read_text())["num_speculative_tokens_per_batch_size"] == [[1, 8, 0]]
    easy = "conditional:0.9,0.9,0.9"
    r = _run(
        "export",
        str(fitted),
        "--to",
        "vllm",
        "--profile",
        easy,
        "--kv-length",
        "512",
        "--out",
        str(out),
        "--json",
    )
    assert all(b["best_k"] > 0 for b in json.loads(r.stdout)["buckets"])
    assert os.path.exists(tmp_path / "vllm.speccal.json")
    assert np.isfinite(json.loads(r.stdout)["workload"]["schedule_tokens_per_s"])


def test_sglang_adaptive_golden_runs_the_best_k_of_a_dynamic_k_deployments_acceptance(at_root):
    """The golden exports acceptance imported from a dynamic-K vLLM deployment's per-request
    stats (product-limit estimate) as SGLang adaptive steps; SGLang's own parsing (engine_rules,
    from adaptive_spec_params.py @ 015c8726) runs each bucket's best k."""
    golden = ROOT / GOLDEN / "sglang-adaptive.json"
    side = json.loads(sidecar_path(golden).read_text())
    parsed = check_sglang_adaptive(golden.read_text())
    assert side["engine"]["format"] == "speculative_adaptive_config"
    assert side["table"]["mode"] == "draft_step"
    assert side["acceptance"]["meta"]["shape"] == "metrics.speculative_decoding"
    assert side["acceptance"]["meta"]["draft_lengths"] == "variable"
    for b in side["buckets"]:
        assert sglang_adaptive_steps(parsed, b["bcap"]) == b["best_k"] == b["exported_k"]
        best = max(v for v in b["tokens_per_s"].values() if v is not None)
        assert b["tokens_per_s"][str(b["best_k"])] == best


def test_cli_export_sglang_refuses_a_draft_step_table_pointing_at_sglang_adaptive(
    at_root, tmp_path
):
    r = _run("export", DRAFT_STEP, "--to", "sglang", "--out", str(tmp_path / "x.json"))
    assert r.exit_code == 2 and "sglang-adaptive" in r.output, r.output
    r = _run("export", "tables/tiny-cpu.json", "--to", "sglang-adaptive", "--trace", TRACE,
             "--out", str(tmp_path / "y.json"))  # fmt: skip
    assert r.exit_code == 2 and "--to sglang" in r.output, r.output
    assert "expected draft_step" in r.output


def test_cli_import_says_which_vllm_shape_it_read_and_how_it_estimated(at_root, tmp_path):
    out = tmp_path / "dk.parquet"
    r = _run("import", "notebooks/data/interop/vllm-requests-dynamic-k.json", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "shape metrics.speculative_decoding" in r.output
    assert "estimated per position over several draft lengths" in r.output
    r = _run(
        "import", "notebooks/data/interop/vllm-requests-legacy.json", "--out", str(out), "--json"
    )
    summary = json.loads(r.stdout)
    assert summary["shape"] == "choices[].speculative_decoding_stats" and "estimator" not in summary
    assert load_trace(out).meta["shape"] == summary["shape"]
