"""The KV spread points: their layout, their place in the journal, the term they fit, and the
price a replay gives a round whose longest request runs past its mean KV."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from rich.console import Console

from speccal.base.errors import InputError
from speccal.calibrate.config import CalibrationConfig, ContextInterval
from speccal.calibrate.driver import prompt_lengths, spread_contexts, spread_room, two_level
from speccal.calibrate.grid import build_grid, spread_points
from speccal.calibrate.journal import window_key
from speccal.calibrate.pipeline import CalibrateOptions, calibrate
from speccal.costmodel.spread import SpreadPricer, fit_spread
from speccal.costmodel.table import load_table
from speccal.policy import CostModel, make_policy
from speccal.replay import replay, run_sequential
from speccal.trace import RoundTrace
from tests.calibrate.fakes import CONFIG, fake


def _cfg(**kw) -> CalibrationConfig:
    base = dict(
        model="additive", mode="draft_step", draft_width=3, request_buckets=(1, 2, 4, 8),
        target_graph_rows={b: tuple(b * (k + 1) for k in range(1, 4)) for b in (1, 2, 4, 8)},
        contexts=(ContextInterval(1, 1, 401), ContextInterval(435, 402, 870),
                  ContextInterval(944, 871, 1888)),
    )
    return CalibrationConfig(**{**base, **kw})


def test_two_level_keeps_the_mean_and_caps_the_long_requests():
    ramp = np.array([90, 100, 110, 120, 130, 140, 150, 160])
    out = two_level(ramp, room=10_000)
    assert out.sum() == ramp.sum() and out[:4].tolist() == [31] * 4 and out[4:].tolist() == [219] * 4
    capped = two_level(ramp, room=200)
    assert capped.sum() == ramp.sum() and capped.max() <= 200 + 3 and capped[:4].max() < 100
    odd = two_level(np.array([50, 60, 70]), room=1000)
    assert odd.sum() == 180 and odd.size == 3


def test_spread_points_one_per_bucket_at_every_context_that_can_spread():
    cfg = _cfg()
    ctxs = spread_contexts(cfg)
    assert ctxs == (0, 1, 2)  # every context's long requests reach a quarter past its mean
    pts = spread_points(cfg, ctxs)
    assert [(p.context_index, p.bcap, p.g, p.k, p.layout) for p in pts] == [
        (c, b, 2 * b, 1, "two_level") for c in ctxs for b in (2, 4, 8)]
    grid_keys = {p.key for p in build_grid(cfg)}
    for p in pts:
        assert p.key not in grid_keys and p.key[:4] in grid_keys  # its calibrated twin
        lengths = prompt_lengths(cfg, p)
        twin = prompt_lengths(cfg, replace(p, layout=None))
        assert lengths.sum() == twin.sum()  # the same mean KV
        assert lengths.max() <= spread_room(cfg, p)  # never past the context
        assert lengths.max() - lengths.mean() > 10 * max(twin.max() - twin.mean(), 1)
    assert spread_points(cfg, ()) == ()
    # a context too short to spread (its cap leaves no room past the mean) is left out
    tight = _cfg(contexts=(ContextInterval(1, 1, 401), ContextInterval(800, 790, 810)))
    assert spread_contexts(tight) == (0,)
    # one bucket: nothing to spread
    assert spread_contexts(_cfg(request_buckets=(1,), target_graph_rows={1: (2, 3, 4)})) == ()


def test_spread_rows_have_their_own_journal_key():
    row = {"context_index": 2, "bcap": 4, "g": 8, "k": 1, "window_index": 0}
    assert window_key(row) == (2, 4, 8, 1, 0)
    assert window_key({**row, "layout": "two_level"}) == (2, 4, 8, 1, "two_level", 0)


def test_kv_spread_must_be_a_bool():
    with pytest.raises(InputError, match="kv_spread"):
        _cfg(kv_spread=1)


def _calibrate(tmp_path, slope: float, mode: str | None = None, **cfg_extra):
    cfg = {**CONFIG, "contexts": [{"prefill_tokens": 32, "min_kv_length": 1,
                                   "max_kv_length": 128}], **cfg_extra}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    make = fake(spread_ms_per_token=slope)
    opts = CalibrateOptions(config_path=tmp_path / "cfg.json", out=tmp_path / "t.json",
                            progress=False, flags={"mode": mode} if mode else {})
    with open("/dev/null", "w") as sink:
        summary = calibrate(opts, console=Console(file=sink), engine_factory=make,
                            clock=make.clock)
    return summary, load_table(tmp_path / "t.json"), make


def test_calibration_measures_the_spread_term_exactly_on_an_exact_engine(tmp_path):
    slope = 0.004  # ms per token of excess
    summary, table, make = _calibrate(tmp_path, slope, kv_spread=True)
    block = table.kv_spread
    assert block is not None and block.layout == "two_level"
    (pt,) = block.points
    assert pt.context_index == 0  # Bcap 2 only (Bcap 1 has no spread)
    assert (pt.bcap, pt.g, pt.k) == (2, 8, 3)  # target_verify: full width
    assert pt.slope_ms_per_token == pytest.approx(slope, rel=1e-6)
    assert pt.spread_excess > pt.calibrated_excess
    assert summary["effective_config"]["kv_spread"] is True
    # the spread windows are journalled (3) and measured after the grid, never fitted
    rows = [json.loads(x) for x in (tmp_path / "t.json.journal.jsonl").read_text().splitlines()]
    spread_rows = [r["row"] for r in rows if r.get("kind") == "window"
                   and r["row"].get("layout") == "two_level"]
    assert len(spread_rows) == CONFIG["windows_per_point"]
    assert sum(len(f.windows) for f in table.fits) == 5 * CONFIG["windows_per_point"]
    # a resumed run finds them done
    make2 = fake(spread_ms_per_token=slope)
    opts = CalibrateOptions(config_path=tmp_path / "cfg.json", out=tmp_path / "t2.json",
                            journal=tmp_path / "t.json.journal.jsonl", resume=True,
                            progress=False)
    with open("/dev/null", "w") as sink:
        calibrate(opts, console=Console(file=sink), engine_factory=make2, clock=make2.clock)
    assert make2.last.windows == 0
    assert load_table(tmp_path / "t2.json").kv_spread == block


def test_no_spread_points_by_default_on_the_cpu(tmp_path):
    summary, table, make = _calibrate(tmp_path, 0.004)
    assert table.kv_spread is None and summary["effective_config"]["kv_spread"] is False
    assert summary["effective_config"]["sources"]["kv_spread"] == "default"


def test_fit_spread_clips_at_zero_and_skips_points_without_a_twin():
    def row(ctx, b, ms, mean, mx, **kw):
        return {"context_index": ctx, "bcap": b, "g": 2 * b, "k": 1, "step_ms": ms,
                "mean_kv_length": mean, "mean_kv_max_length": mx, **kw}

    calibrated = [row(1, 2, 3.0, 100, 110), row(1, 4, 4.0, 100, 115), row(0, 8, 9.0, 100, 101)]
    spread = [row(1, 2, 2.9, 100, 175), row(1, 4, 4.5, 100, 175), row(1, 8, 9.0, 100, 175)]
    block = fit_spread(calibrated, spread)
    by = {p["bcap"]: p for p in block["points"]}
    assert sorted(by) == [2, 4]  # Bcap 8 has no calibrated twin at context 1
    assert by[2]["slope_ms_per_token"] == 0.0  # faster when spread: noise, not a discount
    assert by[4]["slope_ms_per_token"] == pytest.approx(0.5 / 60)
    assert fit_spread(calibrated, []) is None


def test_replay_prices_the_spread_term_and_decides_on_the_mean(tmp_path):
    _, table, _ = _calibrate(tmp_path, 0.004, kv_spread=True, mode="draft_step",
                            target_graph_rows={"1": [2, 3, 4], "2": [4, 6, 8]})
    cost = CostModel.from_table(table)
    plain = CostModel.from_table(table)
    plain = replace(plain, spread=None)
    pricer = SpreadPricer(table.kv_spread)
    rng = np.random.default_rng(3)
    rounds = 40
    b = np.full(rounds, 2)
    kv = np.linspace(20, 60, rounds)
    kv_max = kv + np.where(np.arange(rounds) % 2 == 0, 40.0, 0.0)
    trace = RoundTrace(
        num_requests=b, accepted=rng.integers(0, 4, size=2 * rounds), kv_length=kv,
        k=np.full(rounds, 3), draft_width=3, kv_max_length=kv_max, meta={})
    with_spread = replay(trace, cost)
    without = replay(trace, plain)
    assert with_spread.spread_priced and not without.spread_priced
    extra = pricer.extra_ms(2, kv, kv_max)
    assert (extra[1::2] == 0).all() and (extra[0::2] > 0).all()
    for name in ("fixed:1", "fixed:3", "adaptive-step"):
        a, z = with_spread.run(name), without.run(name)
        assert np.array_equal(a.k, z.k)  # decisions on the mean KV
        assert np.allclose(a.cost_ms, z.cost_ms + extra)
    # the live prediction's sequential replay prices the same rounds the same
    seq = run_sequential(trace, cost, make_policy("adaptive-step", cost))
    assert np.allclose(seq.cost_ms, with_spread.run("adaptive-step").cost_ms)
    assert with_spread.to_dict()["spread_priced"] is True


def test_pricer_interpolates_a_buckets_points_in_the_mean_kv():
    """Points of one bucket at several mean KV lengths: slope and reference excess follow the
    round's mean KV piecewise linearly, flat past the ends; one point is a constant; other
    buckets price nothing."""
    from types import SimpleNamespace as NS

    def pt(bcap, mean, slope, ref):
        return NS(bcap=bcap, mean_kv_length=mean, slope_ms_per_token=slope, calibrated_excess=ref)

    pricer = SpreadPricer(NS(points=[pt(8, 1000.0, 0.002, 40.0), pt(8, 200.0, 0.004, 0.0),
                                     pt(4, 600.0, 0.001, 10.0)]))
    mean = np.array([100.0, 200.0, 600.0, 1000.0, 3000.0])
    top = mean + 100.0
    got = pricer.extra_ms(np.full(5, 8), mean, top)
    slope = np.array([0.004, 0.004, 0.003, 0.002, 0.002])
    ref = np.array([0.0, 0.0, 20.0, 40.0, 40.0])
    np.testing.assert_allclose(got, slope * (100.0 - ref))
    np.testing.assert_allclose(pricer.extra_ms(4, mean, top), 0.001 * 90.0)
    assert pricer.extra_ms(16, 500.0, 900.0) == 0.0
    assert pricer.extra_ms(8, 500.0, 500.0) == 0.0  # no spread, no extra
