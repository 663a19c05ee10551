"""A table's coverage of an engine's captured geometry (``speccal.costmodel.coverage``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speccal.base.geometry import Geometry, default_target_rows
from speccal.cli.app import app
from speccal.costmodel.coverage import CoverageWarning, coverage_gaps, warn_coverage
from speccal.costmodel.table import load_table

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tables" / "tiny-cpu.json"  # buckets 1, 2, 4, 8; KV 1..4096; w = 3


def _engine(buckets, max_model_len=4096) -> Geometry:
    return Geometry(draft_width=3, request_buckets=tuple(buckets),
                    target_rows=default_target_rows(tuple(buckets), 3),
                    kv_capacity_tokens=max(buckets) * (max_model_len + 4),
                    max_model_len=max_model_len, block_size=16)


def test_a_table_that_covers_the_engine_says_nothing():
    table = load_table(TINY)
    gaps = coverage_gaps(table, _engine((1, 2, 4, 8)))
    assert not gaps and gaps.describe() == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_coverage(table, _engine((1, 2, 4, 8)))


def test_missing_buckets_and_kv_are_named_once():
    table = load_table(TINY)
    gaps = coverage_gaps(table, _engine((1, 2, 4, 8, 16, 32), max_model_len=8192))
    assert gaps.request_buckets == (16, 32) and gaps.kv == ((4097, 8192),)
    with pytest.warns(CoverageWarning) as caught:
        warn_coverage(table, _engine((1, 2, 4, 8, 16, 32), max_model_len=8192), source="T")
    (w,) = caught
    text = str(w.message)
    assert "request buckets [16, 32]" in text and "KV 4097..8192" in text and text.startswith("T ")


def test_bench_on_a_table_without_the_engines_buckets_warns_and_runs_full_width(tmp_path):
    """The engine captured 1..16, the table 1..8: a 12-request batch used to end the bench with
    "verify_budget: got 0"; now it runs at full width, warned and counted."""
    res = CliRunner().invoke(app, [
        "bench", "--model", "tiny", "--policy", "fixed:1,adaptive-verify", "--cost-table",
        str(TINY), "--num-requests", "12", "--request-buckets", "1,2,4,8,16", "--max-tokens", "6",
        "--repeats", "1", "--json"], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert any("request buckets [16]" in w for w in doc["table_warnings"])
    by = {p["policy"]: p for p in doc["policies"]}
    verify = by["adaptive-verify"]
    assert verify["rounds_uncalibrated"] > 0
    assert verify["rounds_priced"] + verify["rounds_uncalibrated"] == verify["rounds"]
