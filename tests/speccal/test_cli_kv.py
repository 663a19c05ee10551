"""``table show`` of a KV-aware table names the KV model and its held-out errors."""

from __future__ import annotations

from typer.testing import CliRunner

from speccal.cli.app import app
from speccal.costmodel.report import summary
from speccal.costmodel.table import save_table
from tests.speccal.test_kv_replay import _table


def test_show_and_summary_report_the_kv_model(tmp_path):
    table = _table(((256, 1, 512), (2048, 513, 4096), (6000, 4097, 8192)))
    s = summary(table)
    assert s["kv_model"]["kv_term"] == "shared" and "points" not in s["kv_model"]
    assert "kv_model" not in summary(_table(((4096, 1, 8192),)))
    save_table(table, tmp_path / "kv.json")
    res = CliRunner().invoke(
        app, ["table", "show", str(tmp_path / "kv.json")], env={"COLUMNS": "100"}
    )
    assert res.exit_code == 0, res.output
    assert "KV model (shared slope, chosen by leave_one_context_out) prices KV 1-8192" in " ".join(
        res.stderr.split()
    )
