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


@pytest.mark.parametrize("strategy", ["scratch_swap", "snapshots"])
def test_calibration_records_the_state_bytes_per_round(folder, tmp_path, strategy, monkeypatch):
    """``speccal calibrate`` on a hybrid target records its strategy and the state bytes a round
    moves per bucket and k (``calibration.state_traffic``, from the engine's own
    ``StateStrategy.round_traffic``): snapshots write one state row per verified position, so
    deeper speculation moves more state; scratch-swap moves two rows each way at every k. Its
    windows' prompts come from one prefilled source (``kv_copy``): one prefill in the run."""
    from rich.console import Console

    from speccal.calibrate.pipeline import CalibrateOptions, calibrate
    from speccal.costmodel.table import load_table
    from speccal.runner.hybrid_state import StateStrategy

    prefills: list[int] = []
    real = StateStrategy.prefill

    def counting(self, req, *a, **kw):
        prefills.append(len(req.prompt))
        return real(self, req, *a, **kw)

    monkeypatch.setattr(StateStrategy, "prefill", counting)

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({
        "request_buckets": [1, 2], "warmup_steps": 1, "window_steps": 2, "windows_per_point": 2,
        "contexts": [{"prefill_tokens": 12, "min_kv_length": 1, "max_kv_length": 40}]}))
    out = tmp_path / "t.json"
    opts = CalibrateOptions(model=str(folder), config_path=cfg, out=out, flags={"mode": "draft_step"},
                            request_buckets=(1, 2), max_model_len=64, state_strategy=strategy,
                            progress=False, remeasure_rounds=0, accept_noisy=True)
    calibrate(opts, console=Console(quiet=True))
    table = load_table(out)
    assert table.compatibility.state_strategy == strategy
    assert table.calibration.prompts == "kv_copy"
    assert len(prefills) == 1  # the source; every window admitted by copying KV and state
    traffic = {(s.bcap, s.k): s for s in table.calibration.state_traffic}
    assert set(traffic) == {(b, k) for b in (1, 2) for k in (1, 2, 3)}
    for b in (1, 2):
        totals = [traffic[(b, k)].total for k in (1, 2, 3)]
        assert totals[0] > 0
        if strategy == "snapshots":
            assert totals[0] < totals[1] < totals[2]
        assert traffic[(2, 1)].read == 2 * traffic[(1, 1)].read  # per request row of the bucket
