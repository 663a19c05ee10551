"""vLLM export: the schedule keyed by logical batch size (issue 39 item 4) and the caveats of
what vLLM does with it (item 2), on the shipped draft-step table."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from speccal.cli import app
from speccal.costmodel.table import load_table
from speccal.interop.export import ExportRequest, run_export
from speccal.interop.schedule import zero_cost
from speccal.policy import CostModel

from .engine_rules import check_vllm, vllm_dense

ROOT = Path(__file__).resolve().parents[2]
DRAFT_STEP = ROOT / "tables/dense-2b-h200-draft-step.json"
# an acceptance whose best k changes inside buckets 4 and 8 (found by scanning profiles)
PARTLY = "marginal:0.7,0.45,0.25"
FULL = "marginal:0.8,0.6,0.4"  # best k = w = 3 at every batch size


def _export(tmp_path: Path, profile: str, **opts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_export(
            ExportRequest(
                table=DRAFT_STEP,
                engine="vllm",
                out=tmp_path / "vllm.json",
                profile=profile,
                kv_length=1024.0,
                **opts,
            )
        )


def _caveats(report: dict) -> dict[str, bool]:
    return {c["id"]: c["applies"] for c in report["caveats"]}


def test_per_batch_size_export_differs_from_per_bucket_on_partly_filled_batches(tmp_path):
    res = _export(tmp_path, PARTLY)
    cfg = check_vllm(res.out.read_text())
    dense = vllm_dense(cfg, 8)
    pb = res.report["per_bucket"]
    rows = {r["batch_size"]: r for r in pb["rows"]}
    # every B = 1..8 scored; B = 3 and 6 (partly filled buckets 4 and 8) pick another k than
    # their bucket's full batch, and the engine runs that k there
    assert sorted(rows) == list(range(1, 9))
    assert pb["batch_sizes_differing"] == [3, 6]
    for b in (3, 6):
        assert dense[b] == rows[b]["k"] != rows[b]["per_bucket_k"]
        assert rows[b]["tokens_per_s"] > rows[b]["per_bucket_tokens_per_s"]
    for b in (1, 2, 4, 5, 7, 8):
        assert dense[b] == rows[b]["k"] == rows[b]["per_bucket_k"]
    # measured on this table and profile: +2.84 % over equal time at every batch size, +11.6 %
    # at B = 3: there k = 2 and k = 3 both pad to G = 12 of bucket 4 (3 * 3 = 9 and 3 * 4 = 12
    # rows), so k = 3 drafts a token for free; at the full B = 4 k = 3 costs G = 16 (vs 12)
    assert pb["gain_pct"] == pytest.approx(2.838, abs=0.01)
    assert pb["max_gain_pct"] == pytest.approx(11.628, abs=0.01)
    assert cfg["num_speculative_tokens_per_batch_size"] == [
        [1, 2, 2],
        [3, 3, 3],
        [4, 5, 2],
        [6, 6, 3],
        [7, 8, 2],
    ]


def test_ranges_carry_the_evidence_of_each_batch_size(tmp_path):
    res = _export(tmp_path, PARTLY)
    cost = CostModel.from_table(load_table(DRAFT_STEP))
    ranges = res.report["ranges"]
    entries = res.rendered.document["num_speculative_tokens_per_batch_size"]
    assert [[*r["batch_sizes"], r["k"]] for r in ranges] == entries
    for r in ranges:
        lo, hi = r["batch_sizes"]
        assert [e["batch_size"] for e in r["evidence"]] == list(range(lo, hi + 1))
        for e in r["evidence"]:
            b, k = e["batch_size"], r["k"]
            assert e["tokens_per_s"] >= e["runner_up_tokens_per_s"]
            assert e["runner_up_k"] != k
            cap = int(cost.bcap(np.array([b]))[0])
            g = int(cost.g(np.array([cap]), np.array([b * (k + 1)]))[0])
            assert e["cell"] == {"bcap": cap, "g": g}


def test_caveats_apply_where_they_change_the_decision(tmp_path):
    full = _export(tmp_path, FULL).report
    assert _caveats(full) == {
        "batch_size_counts_prefill": True,
        "mrv2_ignores_k": False,  # every K = w: nothing for Model Runner V2 to ignore
        "mrv1_piecewise": False,
        "k0_drafter_forward": False,
    }
    part = _export(tmp_path, PARTLY).report
    c = _caveats(part)
    assert c["mrv2_ignores_k"] and c["mrv1_piecewise"] and not c["k0_drafter_forward"]
    mrv2 = next(x for x in part["caveats"] if x["id"] == "mrv2_ignores_k")
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in mrv2["changes"]
    assert {"#44443", "#51510", "#51575", "#57053"} <= set(mrv2["sources"])


def test_k0_for_vllm_is_priced_only_from_k0_ms(tmp_path):
    # without --k0-ms, K = 0 is never priced nor chosen
    res = _export(tmp_path, "marginal:0.05,0.01,0.0")
    assert all(b["tokens_per_s"]["0"] is None for b in res.report["buckets"])
    assert all(e[2] > 0 for e in res.rendered.document["num_speculative_tokens_per_batch_size"])
    # a measured K = 0 step cheap enough to win is chosen, and the caveat says what it costs
    res = _export(tmp_path, "marginal:0.05,0.01,0.0", k0_ms="0.05")
    assert {e[2] for e in res.rendered.document["num_speculative_tokens_per_batch_size"]} == {0}
    k0 = next(x for x in res.report["caveats"] if x["id"] == "k0_drafter_forward")
    assert k0["applies"] and "#49548" in k0["sources"]


def test_vllm_zero_cost_ignores_the_tables_k0_windows():
    table = load_table(DRAFT_STEP)
    z = zero_cost(table, {}, table_k0=False)
    assert z.table_buckets == () and z.flag_ms == {}
    assert zero_cost(table, {1: 2.0}, table_k0=False).flag_ms == {1: 2.0}


def test_cli_prints_each_applicable_caveat(tmp_path):
    out = tmp_path / "vllm.json"
    args = ["export", str(DRAFT_STEP), "--to", "vllm", "--out", str(out)]
    args += ["--profile", PARTLY, "--kv-length", "1024"]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    for cid in ("batch_size_counts_prefill", "mrv2_ignores_k", "mrv1_piecewise"):
        assert f"warning: vllm {cid}:" in text
    assert "k0_drafter_forward" not in text
    assert "per batch size vs per bucket:" in text and "+2.84 %" in text
    side = json.loads(out.with_suffix(".speccal.json").read_text())
    assert side["per_bucket"]["batch_sizes_differing"] == [3, 6]


def test_per_batch_size_export_on_a_table_that_measured_partly_filled_buckets(tmp_path):
    """``tables/tiny-cpu-draft-step.json`` measured the shapes partly filled buckets run and
    prices each round's draft forwards: 3 requests at k = 2 and k = 3 both verify G 12 of
    bucket 4, and k = 3 is no longer a free token (the shipped H200 table, version 2, priced
    both alike). The per-batch-size schedule still differs from the per-bucket one where a
    partly filled bucket's best k differs from its full batch's, by the predicted tokens/s
    recorded here (CPU table, profile ``PARTLY``, KV 60)."""
    table = ROOT / "tables/tiny-cpu-draft-step.json"
    cost = CostModel.from_table(load_table(table))
    ms = cost.step_costs(np.array([3]), np.array([60.0]))[0]
    assert cost.g(np.array([4]), np.array([9]))[0] == cost.g(np.array([4]), np.array([12]))[0]
    assert ms[2] - ms[1] > 0.5  # one more draft forward at bucket 4 (its delta), same G
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_export(ExportRequest(table=table, engine="vllm", out=tmp_path / "v.json",
                                       profile=PARTLY, kv_length=60.0))
    pb = res.report["per_bucket"]
    assert pb["batch_sizes_differing"] == [3, 5]
    assert pb["gain_pct"] == pytest.approx(0.682, abs=0.01)
    assert pb["max_gain_pct"] == pytest.approx(3.624, abs=0.01)
    rows = {r["batch_size"]: r for r in pb["rows"]}
    for b in (3, 5):
        assert rows[b]["tokens_per_s"] > rows[b]["per_bucket_tokens_per_s"]
