"""A replay as ``speccal replay`` and ``speccal plot`` run one: from a command's inputs (a trace
file or a synthetic scenario; a table, or the synthetic one) to a ``speccal.replay`` report and
the commands' JSON documents.

- :func:`prepare_replay` checks the inputs against each other and resolves them into a
  :class:`ReplaySetup` (trace, cost model, policies, adaptive-step settings and where they came
  from), refusing what cannot be replayed before any work; :func:`replay_doc` is the report's
  document with the settings' source and the table block (path, mode, synthetic, the
  recurrent-state strategy and bytes), :func:`state_traffic_line` the bytes in words;
- :func:`replay_table_policy` replays a table's adaptive policy against the fixed-``k``
  baselines (``plot``), :func:`plot_summary` the ``plot`` document of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speccal.base.errors import InputError
from speccal.costmodel.measurements import DEFAULT_MODE, MODES
from speccal.costmodel.table_schema import CostTable
from speccal.policy import (
    AdaptiveStepConfig,
    AdaptiveVerifyConfig,
    CostModel,
    PolicySpec,
    parse_policy,
    table_step_config,
)
from speccal.replay import ReplayConfig, ReplayReport, check_replayable, replay
from speccal.scenarios import generate, make_scenario, scenario_geometry, synthetic_table
from speccal.trace import RoundTrace, load_trace

#: Draft width of a scenario without a table: the runner's default, as ``calibrate`` and
#: ``trace`` use.
DEFAULT_DRAFT_WIDTH = 3


def scenario_trace(
    scenario: str, rounds: int, draft_width: int, num_requests: int, kv_length: float, seed: int
) -> RoundTrace:
    """The round trace of a synthetic scenario (``speccal.scenarios``)."""
    return generate(
        make_scenario(
            scenario,
            rounds=rounds,
            draft_width=draft_width,
            num_requests=num_requests,
            kv_length=kv_length,
            seed=seed,
        )
    )


def step_config(window_size: int | None, update_interval: int | None,
                switch_min_gain: float | None, table=None) -> tuple[AdaptiveStepConfig, str]:
    """The adaptive-step settings: each value given, else the table's ``calibration.policy``
    (the settings it was calibrated for), else the defaults; a bad one is refused naming its
    flag (``--switch-min-gain``). Returns ``(config, source)``: ``flags``, ``table``,
    ``default``, or ``table + flags`` / ``default + flags``."""
    stored = table_step_config(table) if table is not None else None
    base = stored or AdaptiveStepConfig()
    given = (window_size, update_interval, switch_min_gain)
    source = ("flags" if all(v is not None for v in given) else
              "table" if stored is not None else "default")
    if any(v is not None for v in given) and source != "flags":
        source += " + flags"
    try:
        return AdaptiveStepConfig(
            window_size=base.window_size if window_size is None else window_size,
            update_interval=base.update_interval if update_interval is None else update_interval,
            switch_min_gain=base.switch_min_gain if switch_min_gain is None else switch_min_gain,
        ), source
    except InputError as exc:
        flag = "--" + exc.field.rsplit(".", 1)[-1].replace("_", "-")
        raise InputError(flag, exc.value, exc.expected) from None


@dataclass(frozen=True, eq=False)
class ReplaySetup:
    """What a replay runs (:func:`prepare_replay`): the trace, the cost model, the table it
    prices with (the synthetic one without a table), the replay config and the source of its
    adaptive-step settings."""

    trace: Any  # RoundTrace, or a token-level trace
    cost: CostModel
    table: CostTable
    config: ReplayConfig
    step_source: str


def prepare_replay(
    *,
    table: CostTable | None,
    specs: list[PolicySpec],
    trace: Path | None = None,
    scenario: str | None = None,
    mode: str | None = None,
    rounds: int = 20_000,
    draft_width: int | None = None,
    num_requests: int = 8,
    kv_length: float = 1024.0,
    seed: int = 0,
    step: tuple[int | None, int | None, float | None] = (None, None, None),
) -> ReplaySetup:
    """Resolve a replay's inputs (``speccal replay``'s options) into a :class:`ReplaySetup`.

    ``table`` None: the synthetic table (``speccal.scenarios.synthetic_table``) of mode ``mode``
    (default ``target_verify``, as calibrate) over the trace's batch sizes. ``specs`` empty: the
    table mode's adaptive policy. ``step``: the adaptive-step values given (window size, update
    interval, switch min gain; see :func:`step_config`). A ``mode`` or ``draft_width`` other
    than the table's, a bad step value, and a trace the table cannot replay are refused, each
    before the work it guards.
    """
    if table is not None:
        w = table.draft_width
        if mode is not None and mode != table.mode:
            raise InputError("--mode", mode, f"the table's mode {table.mode!r} (or no --mode)")
        if draft_width is not None and draft_width != w:
            raise InputError("--draft-width", draft_width, f"the table's draft_width = {w}")
    else:
        if mode is not None and mode not in MODES:
            raise InputError("--mode", mode, " or ".join(MODES))
        w = draft_width or DEFAULT_DRAFT_WIDTH
    step_cfg, step_source = step_config(*step, table)  # refused before the work
    if trace is not None:
        tr = load_trace(trace)
    else:
        tr = scenario_trace(scenario, rounds, w, num_requests, kv_length, seed)
    if table is None:
        nmax = (
            int(tr.num_requests.max())
            if isinstance(tr, RoundTrace)
            else int(np.unique(tr.request).size)
        )
        table = synthetic_table(scenario_geometry(tr.draft_width, nmax), mode or DEFAULT_MODE)
    cost = CostModel.from_table(table)
    if not specs:
        specs = [parse_policy("adaptive-step" if cost.mode == "draft_step" else "adaptive-verify")]
    cfg = ReplayConfig(
        policies=tuple(p.text for p in specs if p.kind != "fixed"),
        step=step_cfg,
        verify=AdaptiveVerifyConfig(),
    )
    check_replayable(tr, cost, specs)
    return ReplaySetup(trace=tr, cost=cost, table=table, config=cfg, step_source=step_source)


def replay_doc(report: ReplayReport, setup: ReplaySetup, table_path: Path | None) -> dict:
    """``speccal replay --json``: the report's document, the source of the adaptive-step
    settings (``config.step_source``) and the ``table`` block (``path`` None and ``synthetic``
    without a table)."""
    d = report.to_dict()
    d["config"]["step_source"] = setup.step_source  # flags, the table's calibration.policy, defaults
    traffic = setup.table.calibration.state_traffic
    d["table"] = {
        "path": str(table_path) if table_path else None,
        "mode": setup.cost.mode,
        "synthetic": table_path is None,
        # a hybrid target's recurrent-state handling is inside every measured round cost; the
        # table records the strategy and (calibrated since 2026-12-02) the bytes it moves
        "state_strategy": setup.table.compatibility.state_strategy,
        "state_traffic": None if traffic is None else [
            {**s.model_dump(), "total": s.total} for s in traffic],
    }
    return d


def state_traffic_line(traffic: list[dict[str, Any]]) -> str:
    """``state bytes per round at Bcap B: k 1: X MB, ...`` at the largest bucket of a
    ``replay_doc``'s ``table.state_traffic``."""
    top = max(s["bcap"] for s in traffic)
    per_k = ", ".join(f"k {s['k']}: {s['total'] / 1e6:,.1f} MB"
                      for s in sorted(traffic, key=lambda s: s["k"]) if s["bcap"] == top)
    return f"state bytes per round at Bcap {top}: {per_k}"


def replay_table_policy(
    table: CostTable,
    trace: Path | None,
    scenario: str | None,
    rounds: int,
    num_requests: int,
    kv_length: float | None,
    seed: int,
) -> ReplayReport:
    """Replay the table's adaptive policy (by mode) and the fixed-k baselines on a trace file or
    a scenario (at ``kv_length``, default: the middle of the table's first context interval)."""
    if trace is not None:
        tr = load_trace(trace)
    else:
        if kv_length is None:  # a KV length the table is calibrated at
            f = table.fits[0]
            kv_length = (f.min_kv_length + f.max_kv_length) / 2.0
        tr = scenario_trace(scenario, rounds, table.draft_width, num_requests, kv_length, seed)
    cost = CostModel.from_table(table)
    policy = "adaptive-step" if cost.mode == "draft_step" else "adaptive-verify"
    return replay(tr, cost, ReplayConfig(policies=(policy,)))


def plot_summary(table_path: Path, out: Path, paths: list[Path],
                 report: ReplayReport | None) -> dict[str, Any]:
    """``speccal plot --json``: the table, the directory, the files written and, with a replay,
    its best fixed ``k``, rounds and each adaptive policy's gain over the best fixed ``k``."""
    summary: dict[str, Any] = {"table": str(table_path), "out": str(out)}
    if report is not None:
        d = report.to_dict()
        summary["replay"] = {
            "best_fixed": d["best_fixed"],
            "rounds": d["rounds"],
            # None: the policy hit a point the table cannot price (no tokens/s to compare).
            "gain_vs_best_fixed_pct": {
                p["name"]: p["gain_vs_best_fixed_pct"]
                for p in d["policies"]
                if p["kind"] != "fixed"
            },
        }
    summary["plots"] = [str(p) for p in paths]
    return summary

