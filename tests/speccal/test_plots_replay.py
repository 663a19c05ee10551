"""Replay plots: lines that decide alike stay visible, integer decision ticks, labels inside the
axes, optional table title (passed by ``speccal plot`` and ``speccal replay``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from matplotlib.ticker import MaxNLocator
from typer.testing import CliRunner

from speccal.cli import app, cmd_plot, cmd_replay
from speccal.costmodel.table import load_table, save_table
from speccal.plots_replay import (
    OFFSET_FRACTION,
    throughput_figure,
    timeline_figure,
    write_plots,
)
from speccal.plots_table import table_title
from speccal.policy import CostModel
from speccal.replay import ReplayConfig, replay
from speccal.scenarios import (
    generate,
    make_scenario,
    scenario_geometry,
    synthetic_cost,
    synthetic_table,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TITLE = "tiny-mtp (fingerprint sha256:0123456789ab\u2026, float32) on cpu 'test-cpu'"


@pytest.fixture(scope="module", params=["draft_step", "target_verify"])
def report(request):
    # Transition (easy then hard, B = 8, w = 5): the adaptive policy and the per-phase oracle
    # decide alike for most rounds, and in target_verify the oracle equals the best fixed k.
    mode = request.param
    tr = generate(make_scenario("transition", rounds=3000, seed=0))
    cost = synthetic_cost(scenario_geometry(5, 8), mode)
    policy = "adaptive-step" if mode == "draft_step" else "adaptive-verify"
    return replay(tr, cost, ReplayConfig(policies=(policy,)))


def _lines(fig):
    ax = fig.axes[0]
    return ax, [
        ln for ln in ax.get_lines() if ln.get_label() and not ln.get_label().startswith("_")
    ]


def test_timeline_lines_that_decide_alike_do_not_overlap(report):
    fig = timeline_figure(report, title=TITLE)
    ax, lines = _lines(fig)
    verify = report.mode == "target_verify"
    shown = [r for r in report.runs if r.kind in ("adaptive-step", "adaptive-verify", "oracle")]
    shown.append(report.run(report.best_fixed))
    assert len(lines) == len(shown) == 3
    decisions = [np.asarray(r.g if verify else r.k, dtype=float) for r in shown]
    equal_somewhere = False
    for (la, da), (lb, db) in itertools.combinations(zip(lines, decisions, strict=True), 2):
        ya, yb = np.asarray(la.get_ydata()), np.asarray(lb.get_ydata())
        same = da == db
        equal_somewhere |= bool(same.any())
        assert (ya[same] != yb[same]).all()  # equal decisions, visibly different lines
        # ... but only just: the offset never reaches the next level.
        assert np.abs((ya - da) - (yb - db)).max() < 0.5 * (8 if verify else 1)
    assert equal_somewhere  # the scenario really has coinciding decisions
    assert len({ln.get_linestyle() for ln in lines}) == 3
    assert len({ln.get_marker() for ln in lines}) == 3
    assert len({ln.get_color() for ln in lines}) == 3
    legend = ax.get_legend()
    assert "offset" in legend.get_title().get_text()
    assert any("drawn" in t.get_text() for t in legend.get_texts())
    assert f"{OFFSET_FRACTION:g}" in legend.get_title().get_text() or verify


def test_timeline_decision_axis_has_integer_ticks_only(report):
    fig = timeline_figure(report)
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks)
    if report.mode == "draft_step":
        loc = ax.yaxis.get_major_locator()
        assert isinstance(loc, MaxNLocator) and loc._integer
        assert ticks == list(range(1, report.draft_width + 1))


def test_timeline_names_the_phases_and_takes_a_title(report):
    fig = timeline_figure(report, title=TITLE)
    ax = fig.axes[0]
    assert ax.get_title().endswith("\n" + TITLE)
    fig.canvas.draw()
    top = [t.get_text() for a in ax.child_axes for t in a.get_xticklabels()]
    assert {"easy", "hard"} <= set(top)
    assert TITLE not in timeline_figure(report).axes[0].get_title()


def test_throughput_labels_stay_inside_the_axes(report):
    fig = throughput_figure(report, title=TITLE)
    ax = fig.axes[0]
    fig.canvas.draw()
    box = ax.get_window_extent()
    labels = [t for t in ax.texts]
    assert len(labels) == len(report.runs)
    for t in labels:
        assert t.get_window_extent().x1 <= box.x1, t.get_text()
    assert ax.get_title().endswith("\n" + TITLE)
    best = next(t.get_text() for t in labels if "best fixed" in t.get_text())
    assert f"{report.run(report.best_fixed).totals()['tokens_per_s']:,.0f}" in best


def test_throughput_shows_an_unpriced_policy_instead_of_dropping_it():
    geo = scenario_geometry(4, 8)
    base = synthetic_cost(geo, "draft_step")

    def holes(bcap, g, kv):  # k = 1 unpriced: fixed:1 has no tokens/s
        return np.where(np.asarray(g) == 2 * np.asarray(bcap), np.nan, base.cost(bcap, g, kv))

    tr = generate(make_scenario("steady", rounds=300, draft_width=4, num_requests=4, seed=1))
    rep = replay(tr, CostModel(cost=holes, geometry=geo, mode="draft_step"), ReplayConfig())
    ax = throughput_figure(rep).axes[0]
    texts = {
        lbl.get_text(): t.get_text() for lbl, t in zip(ax.get_yticklabels(), ax.texts, strict=True)
    }
    assert "not priced" in texts["fixed:1"]


def test_write_plots_writes_both_pngs_with_a_title(report, tmp_path):
    paths = write_plots(report, tmp_path / "r", title=TITLE)
    assert [p.name for p in paths] == ["replay_timeline.png", "replay_throughput.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("command", ["plot", "replay"])
def test_cli_passes_the_table_title_to_the_replay_plots(command, tmp_path, monkeypatch):
    path = save_table(synthetic_table(scenario_geometry(3, 8), "draft_step"), tmp_path / "t.json")
    seen = {}

    def capture(report, directory, title=None):
        seen["title"] = title
        return []

    monkeypatch.setattr(cmd_plot if command == "plot" else cmd_replay, "write_plots", capture)
    if command == "plot":
        args = ["plot", str(path), "--out", str(tmp_path / "o"), "--scenario", "steady"]
    else:
        args = ["replay", "--table", str(path), "--scenario", "steady", "--plot", str(tmp_path)]
    r = CliRunner().invoke(app, [*args, "--rounds", "300"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    assert seen["title"] == table_title(load_table(path))
