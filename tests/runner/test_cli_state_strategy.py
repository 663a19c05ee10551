"""``--state-strategy`` on ``speccal generate`` and ``speccal bench`` (issue 22): a hybrid target
is served with the strategy its cost table was calibrated with (``speccal calibrate
--state-strategy``; a table of another strategy is refused), so the serving commands take the
same option. The engine's compatibility records the strategy it built; a bad value is refused
before any engine is built, naming the option."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import speccal.live.bench as bench_mod
from speccal.cli import app

# the random Qwen3.5 checkpoint of the hybrid engine tests (skips without transformers >= 5)
from tests.runner.test_hybrid_engine import write_checkpoint

ENV = {"COLUMNS": "120"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_state") / "qwen3_5"
    write_checkpoint(path, "qwen3_5")
    return path


@pytest.mark.parametrize("strategy", [None, "scratch_swap", "snapshots"])
def test_generate_serves_the_requested_state_strategy(folder, strategy):
    args = ["generate", "--model", str(folder), "--prompt-ids", "5,17,3,88", "--max-tokens", "4",
            "--ignore-eos", "--json"]
    if strategy is not None:
        args += ["--state-strategy", strategy]
    r = CliRunner().invoke(app, args, env=ENV)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["compatibility"]["state_strategy"] == (strategy or "scratch_swap")
    assert len(doc["outputs"][0]["output_ids"]) == 4


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1"], ["bench"]])
def test_an_unknown_state_strategy_is_refused_before_the_engine(command, monkeypatch):
    def no_engine(*a, **k):
        raise AssertionError("refusal must come before the engine is built")

    monkeypatch.setattr(bench_mod, "Engine", no_engine)
    r = CliRunner().invoke(app, [*command, "--state-strategy", "rollback"], env=ENV)
    assert r.exit_code == 2, r.output
    assert "--state-strategy: got 'rollback'" in r.stderr and "snapshots" in r.stderr
