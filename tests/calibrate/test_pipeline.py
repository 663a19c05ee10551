"""Calibration end to end on the real tiny-preset engine (CPU): sampling, journal, fit, table,
and every infeasible config refused before a single round runs."""

from __future__ import annotations

import json
import math

import pytest
from rich.console import Console

from speccal.base.errors import GridError, InputError
from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from speccal.costmodel.table import load_table


def quiet() -> Console:
    return Console(stderr=True, quiet=True)


def run(engine_factory, **kw):
    """Calibrate on the real tiny engine. Its windows are noisy on a shared CI box, so the
    quality gate is off here (no re-measurement, no refusal): ``test_gate.py`` tests it with a
    fake clock."""
    kw.setdefault("progress", False)
    kw.setdefault("remeasure_rounds", 0)
    kw.setdefault("accept_noisy", True)
    return calibrate(CalibrateOptions(**kw), console=quiet(), engine_factory=engine_factory)


def test_small_calibration_writes_a_valid_table(tmp_path, small_config, engine_factory):
    out = tmp_path / "table.json"
    summary = run(engine_factory, config_path=small_config, out=out)
    eng = engine_factory.last
    assert summary["status"] == "calibrated"
    assert (summary["points_total"], summary["points_done"], summary["windows"]) == (4, 4, 8)
    # per point and window: transition + warmup + a window of 2 rounds; nothing else
    assert eng.steps == 4 * 2 * (1 + 1 + 2) == summary["rounds"]
    assert summary["effective_config"]["sources"]["request_buckets"] == "file"

    table = load_table(out, expect=eng.compatibility())
    assert table.calibration.mode == "target_verify"
    assert table.calibration.sources["contexts"] == "file"
    assert {(w.bcap, w.g) for w in table.fits[0].windows} == {(1, 2), (1, 4), (2, 4), (2, 8)}
    for w in table.fits[0].windows:
        assert w.k == 3 and w.num_requests == w.bcap
        assert 1 <= w.mean_kv_length <= 128  # the batch's KV stays inside the interval
        assert w.step_ms > 0
    for bcap, g in ((1, 2), (1, 4), (2, 4), (2, 8)):
        hit = table.cost_ms(bcap, g, 64)
        assert hit.calibrated and math.isfinite(hit.cost_ms)
    assert not table.cost_ms(1, 2, 500).calibrated  # outside the calibrated interval

    journal = (tmp_path / "table.json.journal.jsonl").read_text().splitlines()
    assert len(journal) == 1 + 8
    assert json.loads(journal[0])["kind"] == "header"


def test_draft_step_mode_measures_each_k_on_its_own_points(
    tmp_path, small, write_config, engine_factory
):
    small.pop("target_graph_rows")
    small["request_buckets"] = [2]
    summary = run(
        engine_factory,
        config_path=write_config(small),
        out=tmp_path / "t.json",
        flags={"mode": "draft_step", "windows_per_point": 1},
    )
    table = load_table(tmp_path / "t.json")
    assert table.calibration.mode == "draft_step"
    assert sorted((w.g, w.k) for w in table.fits[0].windows) == [(4, 1), (6, 2), (8, 3)]
    assert summary["effective_config"]["sources"]["windows_per_point"] == "flag"


def test_draft_step_mode_measures_the_shapes_of_partly_filled_buckets(
    tmp_path, small, write_config, engine_factory
):
    # bucket 4 holds 3 or 4 requests: 3 at k = 1 verify 6 rows (G 6), 3 at k = 3 verify 12
    # rows, the G that 4 requests verify at k = 2; both rounds run on the real engine
    small.pop("target_graph_rows")
    small["request_buckets"] = [4]
    summary = run(engine_factory, config_path=write_config(small), out=tmp_path / "t.json",
                  flags={"mode": "draft_step", "windows_per_point": 1})
    assert summary["points_total"] == 5
    table = load_table(tmp_path / "t.json")
    assert table.calibration.target_graph_rows == {4: [6, 8, 12, 16]}
    shapes = sorted((w.g, w.k, w.num_requests) for w in table.fits[0].windows)
    assert shapes == [(6, 1, 3), (8, 1, 4), (12, 2, 4), (12, 3, 3), (16, 3, 4)]
    pts = {(p.g, p.k): p.num_requests for p in table.fits[0].diagnostics.points}
    assert pts[12, 3] == 3 and pts[12, 2] == 4
    kv = table.fits[0].windows[0].mean_kv_length
    for g, k, _ in shapes:
        assert table.cost_ms(4, g, kv, k).calibrated, (g, k)


@pytest.mark.parametrize(
    "patch, error, words",
    [
        ({"request_buckets": [3]}, InputError, "captured request bucket"),
        (
            {"request_buckets": [1], "target_graph_rows": {"1": [5]}},
            InputError,
            "captured target bucket",
        ),
        (
            {"contexts": [{"prefill_tokens": 120, "min_kv_length": 1, "max_kv_length": 128}]},
            InputError,
            "worst-case generated tokens",
        ),
        (
            {"contexts": [{"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 1000}]},
            InputError,
            "model context 256",
        ),
        (
            {
                "contexts": [
                    {"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 100},
                    {"prefill_tokens": 132, "min_kv_length": 100, "max_kv_length": 200},
                ]
            },
            GridError,
            "non-overlapping",
        ),
        ({"draft_width": 5}, InputError, "num_speculative_tokens=3"),
        (
            {"request_buckets": [1, 4], "target_graph_rows": {"1": [2], "4": [8]}},
            GridError,
            "disconnected",
        ),
        ({"window_steps": 0}, InputError, "window_steps"),
    ],
)
def test_infeasible_config_refused_before_any_round(
    tmp_path, small, write_config, engine_factory, patch, error, words
):
    small.update(patch)
    out = tmp_path / "t.json"
    with pytest.raises(error) as exc:
        run(engine_factory, config_path=write_config(small), out=out)
    assert words in str(exc.value)
    assert engine_factory.last.steps == 0
    assert not out.exists()
    assert not (tmp_path / "t.json.journal.jsonl").exists()


def test_default_config_that_cannot_fit_asks_for_smaller_config(tmp_path, engine_factory):
    # The documented defaults reserve (2 + 8 + 3 * 32) * 4 = 424 tokens per request: more than
    # this run's 256-token model context.
    with pytest.raises(InputError) as exc:
        run(engine_factory, out=tmp_path / "t.json")
    assert exc.value.field == "contexts"
    assert "smaller explicit config" in str(exc.value)
    assert engine_factory.last.steps == 0


def test_short_context_shrinks_default_prefill(tmp_path, engine_factory):
    flags = {"warmup_steps": 1, "window_steps": 2, "windows_per_point": 1}
    summary = run(engine_factory, out=tmp_path / "t.json", flags=flags)
    eff = summary["effective_config"]
    reserve = (2 + 1 + 2) * 4
    contexts = eff["config"]["contexts"]
    # cpu: one default interval (calibrate.config.KIND_DEFAULTS), its prefill shrunk from
    # 2048 to what the 256-token context holds past the reserve
    (ctx,) = contexts
    assert ctx["prefill_tokens"] == 256 - reserve and ctx["max_kv_length"] == 256
    assert "model context 256" in eff["notes"]["contexts"]
    assert eff["sources"]["contexts"] == "default"
    assert eff["config"]["request_buckets"] == [1, 2, 4]
    # every captured G of every captured Bcap
    assert summary["points_done"] == 4 + 5 + 5


def test_one_rank_and_the_ranks_build_the_same_engine_config():
    """``engine_config`` is the one options -> EngineConfig conversion: the ranks' factory
    (``calibrate.ranks``) takes it too, so the state strategy and the calibration prefill chunk
    reach every rank (its copy once dropped both); TP > 1 defaults the path to eager / torch."""
    from speccal.calibrate.pipeline import CALIBRATION_PREFILL_CHUNK, engine_config

    opts = CalibrateOptions(model="tiny", device="cpu", out="t.json", state_strategy="snapshots",
                            request_buckets=(1, 2), draft_width=3)
    one = engine_config(opts)
    assert (one.state_strategy, one.prefill_chunk) == ("snapshots", CALIBRATION_PREFILL_CHUNK)
    assert one.acceptance == "forced" and one.request_buckets == (1, 2)
    rank = engine_config(opts, device="cpu", tp=2)
    assert (rank.state_strategy, rank.prefill_chunk) == (one.state_strategy, one.prefill_chunk)
    assert (rank.path.graph_mode, rank.path.attention_backend) == ("eager", "torch")
