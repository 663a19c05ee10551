"""``speccal replay`` reports the recurrent-state strategy of a hybrid target's table (issue 22):
``table.state_strategy`` in ``--json``, one line in the human report; a dense table (``none``)
prints no such line. The state handling's time is inside each measured round cost; a table
calibrated with its state bytes per round (``calibration.state_traffic``) has them reported too
(the largest bucket's, per k, in the human report; all of them in ``--json``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from speccal.cli import app
from speccal.costmodel.table import load_table, save_table
from speccal.scenarios import scenario_geometry, synthetic_table

ENV = {"COLUMNS": "120"}


def _table(tmp_path, strategy: str):
    table = synthetic_table(scenario_geometry(3, 8), "target_verify")
    compat = table.compatibility.model_copy(update={"state_strategy": strategy})
    path = save_table(table.model_copy(update={"compatibility": compat}), tmp_path / "t.json")
    assert load_table(path).compatibility.state_strategy == strategy  # survives the file
    return path


@pytest.mark.parametrize("strategy", ["scratch_swap", "snapshots", "none"])
def test_replay_reports_the_tables_state_strategy(tmp_path, strategy):
    args = ["replay", "--table", str(_table(tmp_path, strategy)), "--scenario", "steady",
            "--rounds", "200"]
    r = CliRunner().invoke(app, [*args, "--json"], env=ENV)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["table"]["state_strategy"] == strategy
    r = CliRunner().invoke(app, args, env=ENV)
    assert r.exit_code == 0, r.output
    line = f"recurrent-state strategy: {strategy}"
    assert (line in r.stderr) is (strategy != "none")


def test_replay_reports_the_state_bytes_a_table_recorded(tmp_path):
    from speccal.costmodel.table_schema import StateTrafficBlock

    path = _table(tmp_path, "snapshots")
    table = load_table(path)
    rows = [StateTrafficBlock(bcap=b, k=k, read=b * 10**6, written=b * k * 10**6, index_bytes=64,
                              saved_inputs=0) for b in (1, 8) for k in (1, 2, 3)]
    cal = table.calibration.model_copy(update={"state_traffic": rows})
    save_table(table.model_copy(update={"calibration": cal}), path)
    args = ["replay", "--table", str(path), "--scenario", "steady", "--rounds", "200"]
    r = CliRunner().invoke(app, [*args, "--json"], env=ENV)
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["table"]["state_traffic"]
    assert len(got) == 6 and {"bcap": 8, "k": 3, "read": 8 * 10**6, "written": 24 * 10**6,
                              "index_bytes": 64, "saved_inputs": 0, "total": 32000064} in got
    r = CliRunner().invoke(app, args, env=ENV)
    assert "state bytes per round at Bcap 8: k 1: 16.0 MB, k 2: 24.0 MB, k 3: 32.0 MB" in r.stderr
