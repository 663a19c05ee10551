"""A scenario trace too large for memory is one line and exit 2, before numpy allocates
(issue 34, item 4: ``speccal trace --num-requests 100000000`` / ``--rounds 10**12``)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from speccal import scenarios
from speccal.base.errors import InputError
from speccal.cli import app
from speccal.scenarios import generate, make_scenario, trace_nbytes


@pytest.mark.parametrize(
    "args",
    [
        ["--num-requests", "100000000"],
        ["--rounds", str(10**12)],
    ],
)
def test_trace_cli_refuses_a_scenario_that_cannot_fit(tmp_path, args):
    out = tmp_path / "t.parquet"
    res = CliRunner().invoke(
        app, ["trace", "--scenario", "steady", "--out", str(out), *args], terminal_width=200
    )
    assert res.exit_code == 2, res.output
    assert "rounds x num_requests" in res.output and "needs" in res.output
    assert "Traceback" not in res.output and "MemoryError" not in res.output
    assert not out.exists()


def test_the_bound_is_the_available_memory(monkeypatch):
    need = trace_nbytes(4_000, 4_000 * 8, 5)
    monkeypatch.setattr(scenarios, "host_memory_available", lambda: need - 1)
    with pytest.raises(InputError, match="4000 rounds, 32000 request rows"):
        make_scenario("steady", rounds=4_000)
    monkeypatch.setattr(scenarios, "host_memory_available", lambda: need)
    tr = generate(make_scenario("steady", rounds=4_000))
    held = tr.draft_scores.nbytes + tr.accepted.nbytes + tr.num_requests.nbytes
    assert held <= need  # the estimate covers what the trace holds


def test_unknown_memory_refuses_nothing(monkeypatch):
    monkeypatch.setattr(scenarios, "host_memory_available", lambda: None)
    assert make_scenario("decay", rounds=40).phases
