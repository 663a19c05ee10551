"""``speccal replay`` reports the recurrent-state strategy of a hybrid target's table (issue 22):
``table.state_strategy`` in ``--json``, one line in the human report; a dense table (``none``)
prints no such line. The table measured the state handling inside each round cost and records
no state bytes, so replay reports no bytes."""

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
