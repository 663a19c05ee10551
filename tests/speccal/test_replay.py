"""Replay (speccal.replay): vectorised engine == live policy objects, metrics, refusals, CLI."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from speccal.base.errors import InputError, UnsupportedError
from speccal.cli import app
from speccal.costmodel.table import save_table
from speccal.policy import AdaptiveStepConfig, AdaptiveVerifyConfig, CostModel, make_policy
from speccal.replay import ReplayConfig, ReplayReport, replay, run_sequential
from speccal.scenarios import (
    Phase,
    Scenario,
    generate,
    make_scenario,
    scenario_geometry,
    synthetic_cost,
    synthetic_table,
)
from speccal.trace import RoundTrace, TokenTraceBuilder, load_trace, save_trace

ENV = {"COLUMNS": "120"}


def assert_exit_2(r, text: str) -> None:
    """The root group mapped a domain error to exit 2 with a one-line message."""
    assert r.exit_code == 2, r.output
    assert text in r.output and "Traceback" not in r.output


def mixed_trace(rounds: int = 900) -> RoundTrace:
    """Phases with different B and KV, one phase outside the calibrated KV interval."""
    sc = Scenario(
        name="mixed",
        draft_width=4,
        phases=(
            Phase("a", rounds // 3 + 2, (0.3,), 4, 500.0),  # low acceptance: a small k is held
            Phase("far", rounds // 6, (0.6,), 3, 9000.0),  # that k is uncalibrated here
            Phase("b", rounds // 3, (0.9, 0.8), 8, 700.0),
            Phase("c", rounds // 6, (0.95, 0.5), 2, 900.0),
        ),
        seed=11,
    )
    return generate(sc)


def patchy_cost(mode: str) -> CostModel:
    """Synthetic cost with holes: KV > 4096 is priced only for G >= 4 * Bcap (full width for
    every B of :func:`mixed_trace`: B = 3 pads k = 4 to G = 16 = 4 * Bcap)."""
    geo = scenario_geometry(4, 8)
    base = synthetic_cost(geo, mode)

    def f(bcap, g, kv):
        out = base.cost(bcap, g, np.minimum(kv, 4096.0))
        full = np.asarray(g) >= np.asarray(bcap) * 4
        return np.where((np.asarray(kv) <= 4096.0) | full, out, np.nan)

    return CostModel(cost=f, geometry=geo, mode=mode)


@pytest.mark.parametrize(("window", "interval"), [(20, 5), (7, 3), (2, 4)])
def test_vectorised_adaptive_step_equals_live_policy(window, interval):
    tr = mixed_trace()
    cost = patchy_cost("draft_step")
    cfg = AdaptiveStepConfig(window_size=window, update_interval=interval)
    vec = replay(tr, cost, ReplayConfig(policies=("adaptive-step",), step=cfg)).run("adaptive-step")
    seq = run_sequential(tr, cost, make_policy("adaptive-step", cost, step_config=cfg))
    np.testing.assert_array_equal(vec.k, seq.k)
    np.testing.assert_array_equal(vec.g, seq.g)
    np.testing.assert_allclose(vec.tokens, seq.tokens)
    np.testing.assert_allclose(vec.cost_ms, seq.cost_ms)
    assert vec.reasons.get("uncalibrated", 0) > 0 and vec.reasons.get("switch", 0) > 0
    assert vec.reasons == seq.reasons


def test_vectorised_adaptive_verify_equals_live_policy():
    tr = mixed_trace(900)
    cost = patchy_cost("target_verify")
    cfg = AdaptiveVerifyConfig(window_size=6)
    vec = replay(tr, cost, ReplayConfig(policies=("adaptive-verify",), verify=cfg)).run(
        "adaptive-verify"
    )
    seq = run_sequential(tr, cost, make_policy("adaptive-verify", cost, verify_config=cfg))
    np.testing.assert_array_equal(vec.g, seq.g)
    np.testing.assert_allclose(vec.tokens, seq.tokens)
    np.testing.assert_allclose(vec.verified, seq.verified)
    assert len(np.unique(vec.g)) > 2  # the budget really moves


def test_fixed_runs_match_live_fixed_policies():
    tr = mixed_trace(600)
    for mode in ("draft_step", "target_verify"):
        cost = patchy_cost(mode)
        rep = replay(tr, cost, ReplayConfig(policies=()))
        for k in (1, 3):
            seq = run_sequential(tr, cost, make_policy(f"fixed:{k}", cost))
            run = rep.run(f"fixed:{k}")
            np.testing.assert_allclose(run.tokens, seq.tokens)
            np.testing.assert_allclose(run.cost_ms, seq.cost_ms, equal_nan=True)


def test_transition_adaptive_step_beats_best_fixed_and_tracks_the_phase_oracle():
    # Seeded, 20,000 rounds (B = 8, w = 5): easy (q = 0.9) then hard (q = 0.45). Tolerance: the
    # adaptive policy must be >= the best fixed k and within 3% of the per-phase oracle.
    tr = generate(make_scenario("transition", rounds=20_000, seed=0))
    cost = synthetic_cost(scenario_geometry(5, 8), "draft_step")
    d = replay(tr, cost, ReplayConfig(policies=("adaptive-step",))).to_dict()
    pol = {p["name"]: p for p in d["policies"]}
    best = pol[d["best_fixed"]]["tokens_per_s"]
    ada = pol["adaptive-step"]["tokens_per_s"]
    oracle = pol["oracle:per-phase"]["tokens_per_s"]
    assert ada >= best
    assert ada >= 0.97 * oracle
    assert d["oracle_per_phase"]["easy"] != d["oracle_per_phase"]["hard"]
    assert pol["adaptive-step"]["gain_vs_best_fixed_pct"] == pytest.approx(100 * (ada / best - 1))
    json.dumps(d, allow_nan=False)


def test_metrics_are_the_documented_ratios():
    tr = RoundTrace(
        draft_width=2, num_requests=[2, 1], kv_length=[10.0, 10.0], k=[2, 2], accepted=[2, 0, 1]
    )
    cost = synthetic_cost(scenario_geometry(2, 2), "draft_step")
    run = replay(tr, cost, ReplayConfig(policies=())).run("fixed:2")
    t = run.totals()
    c = run.cost_ms
    assert t["tokens_per_s"] == pytest.approx(1000 * (4 + 2) / c.sum())  # sum(a + 1)
    assert t["tpot_ms"] == pytest.approx((c[0] * 2 + c[1] * 1) / 6)
    assert t["acceptance_rate"] == pytest.approx(3 / 6)
    assert t["mean_accepted_length"] == pytest.approx(3 / 3)


def test_token_trace_replay_walks_positions_exactly():
    b = TokenTraceBuilder(3)
    matches = [2, 0, 0, 3, 1, 1, 0, 0, 0]
    for t, m in enumerate(matches):
        b.add(0, t, 10 + t, m, np.full(3, 0.5))
    tr = b.build()
    cost = synthetic_cost(scenario_geometry(3, 1), "draft_step")
    rep = replay(tr, cost, ReplayConfig(policies=("adaptive-step",)))
    k1 = rep.run("fixed:1")
    # k = 1: t=0 a=1 -> t=2 a=0 -> t=3 a=1 -> t=5 a=1 -> t=7 a=0 -> t=8 a=0 -> done
    np.testing.assert_array_equal(k1.accepted, [1, 0, 1, 1, 0, 0])
    k3 = rep.run("fixed:3")
    # k = 3: t=0 a=2 -> t=3 a=3 -> t=7 a=0 -> t=8 a=0
    np.testing.assert_array_equal(k3.accepted, [2, 3, 0, 0])
    assert k3.tokens.sum() == k1.tokens.sum() == 9  # both policies emit the same 9 positions


def test_refusals_happen_before_simulating():
    tr = generate(make_scenario("steady", rounds=100, draft_width=4))
    with pytest.raises(InputError, match="draft_width"):
        replay(tr, synthetic_cost(scenario_geometry(5, 8)))
    with pytest.raises(UnsupportedError):
        replay(
            tr,
            synthetic_cost(scenario_geometry(4, 8), "target_verify"),
            ReplayConfig(policies=("adaptive-step",)),
        )
    with pytest.raises(InputError, match="num_requests"):
        replay(tr, synthetic_cost(scenario_geometry(4, 4)))
    far = generate(make_scenario("steady", rounds=100, draft_width=4, kv_length=10_000))
    with pytest.raises(InputError, match="table"):
        replay(far, synthetic_cost(scenario_geometry(4, 8)))
    censored = RoundTrace(draft_width=2, num_requests=[1], kv_length=[1.0], k=[1], accepted=[1])
    with pytest.raises(InputError, match="full width"):
        replay(censored, synthetic_cost(scenario_geometry(2, 1)))


def test_cli_replay_scenario_json_and_plots(tmp_path):
    r = CliRunner().invoke(
        app,
        [
            "replay",
            "--scenario",
            "transition",
            "--rounds",
            "2000",
            "--json",
            "--plot",
            str(tmp_path),
        ],
        env=ENV,
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    names = [p["name"] for p in d["policies"]]
    # calibrate's defaults: target_verify at the runner's width 3
    assert names[0] == "adaptive-verify" and "fixed:3" in names and "fixed:4" not in names
    assert "oracle:per-phase" in names and d["table"]["synthetic"] is True
    assert d["table"]["mode"] == "target_verify" and d["draft_width"] == 3
    assert "SYNTHETIC" not in r.stderr  # --json: said in table.synthetic
    assert d["trace"]["scenario"]["name"] == "transition"
    assert d["trace"]["scenario"]["phases"][0]["acceptance"] == [0.9]
    for p in d["plots"]:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_replay_without_a_table_says_its_costs_are_invented(tmp_path):
    r = CliRunner().invoke(app, ["replay", "--scenario", "steady", "--rounds", "200"], env=ENV)
    assert r.exit_code == 0, r.output
    first = r.stderr.strip().splitlines()[0]
    assert first.startswith("SYNTHETIC COSTS: no --table given") and "invented" in first
    assert "mode target_verify, w=3" in r.stderr
    table = save_table(
        synthetic_table(scenario_geometry(3, 8), "target_verify"), tmp_path / "t.json"
    )
    r = CliRunner().invoke(
        app, ["replay", "--table", str(table), "--scenario", "steady", "--rounds", "200"], env=ENV
    )
    assert r.exit_code == 0, r.output
    assert "SYNTHETIC COSTS" not in r.stderr
    assert re.search(r"adaptive-verify: [+-][0-9.]+ % tokens/s over the best fixed k", r.stderr)


@pytest.mark.parametrize("gain", ["5", "1", "-0.1"])
def test_cli_replay_switch_min_gain_is_a_fraction_below_one(gain):
    r = CliRunner().invoke(
        app,
        ["replay", "--scenario", "steady", "--rounds", "100", "--switch-min-gain", gain],
        env=ENV,
    )
    assert_exit_2(r, "--switch-min-gain")
    assert "[0, 1)" in r.stderr


def test_cli_replay_trace_file_and_refusals(tmp_path):
    path = save_trace(
        generate(make_scenario("steady", rounds=300, draft_width=3)), tmp_path / "t.parquet"
    )
    r = CliRunner().invoke(
        app, ["replay", "--trace", str(path), "--mode", "target_verify"], env=ENV
    )
    assert r.exit_code == 0, r.output
    assert "adaptive-verify" in r.output
    r = CliRunner().invoke(
        app,
        ["replay", "--scenario", "steady", "--policy", "adaptive-step+adaptive-verify"],
        env=ENV,
    )
    assert_exit_2(r, "cannot be combined")
    r = CliRunner().invoke(app, ["replay", "--scenario", "nope"], env=ENV)
    assert_exit_2(r, "scenario")
    r = CliRunner().invoke(app, ["replay"], env=ENV)
    assert_exit_2(r, "--trace")


def test_cli_trace_writes_a_scenario_trace(tmp_path):
    out = tmp_path / "s.jsonl"
    r = CliRunner().invoke(
        app,
        ["trace", "--scenario", "decay", "--rounds", "40", "--out", str(out), "--json"],
        env=ENV,
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["records"] == 40 and d["meta"]["phases"] == ["q=0.95", "q=0.8", "q=0.6", "q=0.4"]


@pytest.mark.slow
def test_cli_trace_records_tokens_consistent_with_the_live_run(tmp_path):
    """Greedy: replaying the token matrix with fixed:w reproduces the recorded rounds exactly."""
    rounds_path, tokens_path = tmp_path / "r.parquet", tmp_path / "t.parquet"
    args = [
        "trace",
        "--out",
        str(tokens_path),
        "--kind",
        "tokens",
        "--rounds-out",
        str(rounds_path),
    ]
    args += ["--draft-width", "2", "--num-requests", "2", "--prompt-len", "6", "--max-tokens", "10"]
    r = CliRunner().invoke(app, args, env=ENV)
    assert r.exit_code == 0, r.output
    rt, tt = load_trace(rounds_path), load_trace(tokens_path)
    assert rt.full_width and tt.request.size == 2 * 9
    cost = synthetic_cost(scenario_geometry(2, 2), "draft_step")
    sim = run_sequential(tt, cost, make_policy("fixed:2", cost))
    per_round = np.add.reduceat(rt.accepted, rt.cu_requests[:-1])
    assert per_round.sum() > 0  # the seeded tiny model accepts some drafts: not a trivial match
    np.testing.assert_array_equal(sim.num_requests, rt.num_requests)
    np.testing.assert_array_equal(sim.accepted, per_round)


def test_cli_replay_with_a_saved_table(tmp_path):
    path = save_table(
        synthetic_table(scenario_geometry(3, 8), "target_verify"), tmp_path / "t.json"
    )
    args = ["replay", "--table", str(path), "--scenario", "steady", "--rounds", "400"]
    r = CliRunner().invoke(app, [*args, "--json"], env=ENV)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["mode"] == "target_verify" and d["draft_width"] == 3
    assert d["policies"][0]["name"] == "adaptive-verify" and d["table"]["synthetic"] is False
    assert_exit_2(CliRunner().invoke(app, [*args, "--mode", "draft_step"], env=ENV), "--mode")
    assert_exit_2(
        CliRunner().invoke(app, [*args, "--policy", "adaptive-step"], env=ENV), "draft_step table"
    )


# ------------------------------------------------------------------------ unpriced baselines


def negative_k1_cost(rounds: str) -> CostModel:
    """Synthetic cost whose k = 1 cell (G = 2 * Bcap) is negative: on every round (``all``) or
    only for Bcap 2 (``some``: phase ``c`` of :func:`mixed_trace`, B = 2)."""
    geo = scenario_geometry(4, 8)
    base = synthetic_cost(geo, "draft_step")

    def f(bcap, g, kv):
        bcap, g = np.asarray(bcap), np.asarray(g)
        out = base.cost(bcap, g, np.minimum(kv, 4096.0))
        hit = (g == 2 * bcap) & ((bcap == 2) if rounds == "some" else True)
        return np.where(hit, -60.0, out)

    return CostModel(cost=f, geometry=geo, mode="draft_step")


@pytest.mark.parametrize("rounds", ["all", "some"])
def test_a_baseline_with_non_positive_cost_is_never_best_and_reports_unpriced(rounds):
    # "all": fixed:1 totals a negative time (tokens/s NaN), and max() kept the NaN first entry;
    # "some": a few -60 ms rounds shrink its total time, inflating tokens/s past every k.
    tr = mixed_trace()
    rep = replay(tr, negative_k1_cost(rounds), ReplayConfig(policies=("adaptive-step",)))
    assert not rep.run("fixed:1").priced
    assert rep.best_fixed != "fixed:1"
    assert "fixed:1" not in rep.phase_choice.values()
    d = rep.to_dict()
    pol = {p["name"]: p for p in d["policies"]}
    assert pol["fixed:1"]["priced"] is False and pol["fixed:1"]["gain_vs_best_fixed_pct"] is None
    best = pol[d["best_fixed"]]
    assert best["priced"] and best["tokens_per_s"] > 0 and best["gain_vs_best_fixed_pct"] == 0.0
    json.dumps(d, allow_nan=False)


def test_a_non_positive_full_width_cost_is_refused_before_replay():
    geo = scenario_geometry(4, 8)
    base = synthetic_cost(geo, "draft_step")
    cost = CostModel(
        cost=lambda b, g, kv: -base.cost(b, g, np.minimum(kv, 4096.0)),
        geometry=geo,
        mode="draft_step",
    )
    with pytest.raises(InputError, match="calibrated at every round's full-width point"):
        replay(mixed_trace(), cost)


def test_cli_replay_prints_na_for_a_missing_gain(monkeypatch):
    # A report whose comparison has no value (gain None, e.g. no priced fixed baseline to
    # compare with) used to crash the table printer with a TypeError.
    to_dict = ReplayReport.to_dict

    def without_gain(self):
        d = to_dict(self)
        for p in d["policies"]:
            p["gain_vs_best_fixed_pct"] = None
        d["policies"][0]["tokens_per_s"] = None
        return d

    monkeypatch.setattr(ReplayReport, "to_dict", without_gain)
    r = CliRunner().invoke(
        app,
        ["replay", "--scenario", "steady", "--rounds", "300", "--mode", "draft_step"],
        env={"COLUMNS": "200"},
    )
    assert r.exit_code == 0, r.output
    cells = {
        c[0]: c
        for ln in r.output.splitlines()
        if (c := [x.strip() for x in ln.strip("│ ").split("│")])[0] in ("adaptive-step", "fixed:2")
    }
    assert cells["adaptive-step"][1] == "n/a", r.output  # tokens/s
    assert cells["adaptive-step"][-1] == "n/a" and cells["fixed:2"][-1] == "n/a"
    assert cells["fixed:2"][1] != "n/a"  # the values that exist are still printed


def test_the_report_counts_each_policys_priced_rounds():
    """A fixed k whose rounds fall partly outside the table's span is "uncalibrated", and the
    report says how many of its rounds were unpriced (issue 35: coverage is never silent)."""
    trace = mixed_trace()
    report = replay(trace, patchy_cost("draft_step")).to_dict()
    by = {p["name"]: p for p in report["policies"]}
    assert all(p["rounds"] == trace.num_rounds for p in by.values())
    # the "far" phase (KV 9000) prices only full width: fixed:4 is priced there, fixed:1 is not
    assert by["fixed:4"]["priced"] and by["fixed:4"]["rounds_priced"] == trace.num_rounds
    low = by["fixed:1"]
    assert not low["priced"] and 0 < low["rounds_priced"] < trace.num_rounds
    far = int(np.count_nonzero(np.asarray(trace.kv_length) > 4096))
    assert low["rounds"] - low["rounds_priced"] == far


def test_the_tables_policy_is_the_adaptive_steps_default(tmp_path):
    """A table's ``calibration.policy`` (the settings it was calibrated for) is what replay,
    bench and the exports build adaptive-step with unless a flag says otherwise."""
    from pathlib import Path

    from speccal.costmodel.table import load_table

    base = load_table(Path(__file__).parents[2] / "tables" / "tiny-cpu-draft-step.json")
    pol = base.calibration.policy.model_copy(update={"window_size": 7, "switch_min_gain": 0.1})
    table = base.model_copy(update={"calibration": base.calibration.model_copy(
        update={"policy": pol})})
    path = save_table(table, tmp_path / "t.json")
    cost = CostModel.from_table(load_table(path))
    assert cost.step_config == AdaptiveStepConfig(window_size=7, update_interval=5,
                                                  switch_min_gain=0.1)
    assert make_policy("adaptive-step", cost).config == cost.step_config
    trace = generate(make_scenario("transition", draft_width=3, rounds=300, num_requests=6,
                                   kv_length=60.0))
    rep = replay(trace, cost, ReplayConfig(policies=("adaptive-step",)))
    assert rep.to_dict()["config"]["window_size"] == 7
    tp = save_trace(trace, tmp_path / "tr.jsonl")
    args = ["replay", "--table", str(path), "--trace", str(tp), "--json"]
    d = json.loads(CliRunner().invoke(app, args, env=ENV).stdout)
    assert (d["config"]["window_size"], d["config"]["step_source"]) == (7, "table")
    r = CliRunner().invoke(app, [*args, "--window-size", "9"], env=ENV)
    d = json.loads(r.stdout)
    assert (d["config"]["window_size"], d["config"]["switch_min_gain"]) == (9, 0.1)
    assert d["config"]["step_source"] == "table + flags"
