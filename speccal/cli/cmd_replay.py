"""CLI commands ``speccal replay`` (policies against a table) and ``speccal trace`` (record a trace).

``replay`` loads a table (or builds the synthetic one, ``speccal.scenarios.synthetic_table``) and
a trace (a file, or a synthetic ``--scenario``), runs ``speccal.replay.replay`` and prints a Rich
table on stderr (``--json``: the report on stdout; ``--plot DIR``: PNGs) and a line naming each
adaptive policy's gain over the best fixed ``k``. Without ``--table`` the rounds are priced by
invented costs: the human output says so in a banner line before anything else (``--json``:
``table.synthetic``), and the synthetic table takes calibrate's defaults (mode
``target_verify``, the trace's draft width, else 3 as calibrate's runner and ``trace``).
``trace`` writes a synthetic scenario trace, or drives ``speccal.runner.engine.Engine`` (imported lazily: torch is
only needed for recording) to record a round trace (``--kind rounds``) or the per-token
acceptance matrix (``--kind tokens``: greedy, drafting from every output position).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.table import Table

from speccal.base.atomic import check_writable
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.base.progress import ProgressReporter
from speccal.base.rich_tables import make_console, print_table
from speccal.costmodel.measurements import DEFAULT_MODE, MODES
from speccal.costmodel.table import load_table
from speccal.plots_replay import THROUGHPUT_PNG, TIMELINE_PNG, write_plots
from speccal.plots_table import table_title
from speccal.policy import (
    AdaptiveStepConfig,
    AdaptiveVerifyConfig,
    CostModel,
    parse_policy,
    table_step_config,
)
from speccal.replay import ReplayConfig, check_replayable, replay
from speccal.scenarios import generate, make_scenario, scenario_geometry, synthetic_table
from speccal.trace import RoundTrace, load_trace, save_trace

err_console = make_console()

#: Draft width of a scenario without a table: the runner's default, as ``calibrate`` and
#: ``trace`` use.
DEFAULT_DRAFT_WIDTH = 3

SYNTHETIC_BANNER = (
    "SYNTHETIC COSTS: no --table given, so every round is priced by an invented cost "
    "(speccal.scenarios.synthetic_table, docs/TRACES.md), not by a calibration of this "
    "machine; pass --table TABLE.json for a real prediction"
)


def _step_config(window_size: int | None, update_interval: int | None,
                 switch_min_gain: float | None, table=None):
    """The adaptive-step settings: each flag given, else the table's ``calibration.policy``
    (the settings it was calibrated for), else the defaults; a bad one is refused naming its
    flag (``--switch-min-gain``). Returns ``(config, source)``."""
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


def _scenario_trace(
    scenario: str, rounds: int, draft_width: int, num_requests: int, kv_length: float, seed: int
):
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


def _num(v: float | None, spec: str) -> str:
    """``v`` formatted with ``spec``; ``n/a`` when the report has no value (None)."""
    return "n/a" if v is None else format(v, spec)


def _print_report(d: dict[str, Any]) -> None:
    verify = d["mode"] == "target_verify"
    c = d["config"]
    if any(p.startswith("adaptive-step") for p in c["policies"]):
        err_console.print(
            f"adaptive step: window {c['window_size']}, update interval {c['update_interval']}, "
            f"switch min gain {c['switch_min_gain']:g} ({c.get('step_source', 'default')})",
            markup=False)
    t = Table(
        title=f"replay: {d['rounds']:,} rounds, mode {d['mode']}, w={d['draft_width']}, best fixed {d['best_fixed']}",
        title_justify="left",
    )
    for col in (
        "policy",
        "tokens/s",
        "TPOT ms",
        "accept rate",
        "mean accepted",
        "mean G" if verify else "mean k",
        "switches",
        "gain vs best fixed %",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for p in d["policies"]:
        if not p["priced"]:
            unpriced = p["rounds"] - p["rounds_priced"]
            t.add_row(p["name"], f"uncalibrated ({unpriced}/{p['rounds']} rounds)", "-", "-", "-",
                      "-", "-", "-")
            continue
        # Any metric may be None (no finite value, e.g. no priced baseline to compare with).
        t.add_row(
            p["name"],
            _num(p.get("tokens_per_s"), ",.1f"),
            _num(p.get("tpot_ms"), ".3f"),
            _num(p.get("acceptance_rate"), ".3f"),
            _num(p.get("mean_accepted_length"), ".3f"),
            _num(p.get("mean_g" if verify else "mean_k"), ".2f"),
            str(p["switches"]),
            _num(p.get("gain_vs_best_fixed_pct"), "+.2f"),
        )
    print_table(err_console, t)
    strategy = d.get("table", {}).get("state_strategy", "none")
    if strategy != "none":
        err_console.print(f"recurrent-state strategy: {strategy} (its cost is inside every "
                          "round cost the table measured)", markup=False)
    traffic = d.get("table", {}).get("state_traffic")
    if traffic:
        top = max(s["bcap"] for s in traffic)
        per_k = ", ".join(f"k {s['k']}: {s['total'] / 1e6:,.1f} MB"
                          for s in sorted(traffic, key=lambda s: s["k"]) if s["bcap"] == top)
        err_console.print(f"state bytes per round at Bcap {top}: {per_k}", soft_wrap=True)
    err_console.print(f"per-phase oracle choice: {d['oracle_per_phase']}", markup=False)
    for p in d["policies"]:
        gain = p.get("gain_vs_best_fixed_pct")
        if p["name"].startswith("adaptive") and gain is not None:
            err_console.print(
                f"{p['name']}: {gain:+.2f} % tokens/s over the best fixed k ({d['best_fixed']}), "
                f"{p['switches']} switch(es)",
                markup=False,
            )


def replay_cmd(
    table: Annotated[
        Path | None,
        typer.Option(
            "--table",
            help="Cost table JSON; default: the synthetic table (speccal.scenarios.synthetic_table).",
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Trace file (.parquet / .jsonl, see docs/TRACES.md)."),
    ] = None,
    scenario: Annotated[
        str | None,
        typer.Option(
            "--scenario",
            help="Synthetic trace instead of --trace: steady, transition, batch_change, decay.",
        ),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            help="adaptive-step, adaptive-verify or fixed:K (repeatable); fixed:1..w always run.",
        ),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            help="Synthetic table mode (no --table): target_verify (default, as calibrate) or "
            "draft_step.",
            show_default=False,
        ),
    ] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Scenario rounds.")] = 20_000,
    draft_width: Annotated[
        int | None,
        typer.Option(
            "--draft-width",
            help="Scenario draft width. Default: the table's, else 3 (calibrate's and trace's).",
            show_default=False,
        ),
    ] = None,
    num_requests: Annotated[int, typer.Option("--num-requests", help="Scenario batch size B.")] = 8,
    kv_length: Annotated[
        float, typer.Option("--kv-length", help="Scenario mean KV length (tokens).")
    ] = 1024.0,
    seed: Annotated[int, typer.Option("--seed", help="Scenario seed.")] = 0,
    window_size: Annotated[
        int | None,
        typer.Option(
            "--window-size", help="Adaptive step: completed batches in the acceptance window "
            "(default: the table's calibration.policy, else 20)."
        ),
    ] = None,
    update_interval: Annotated[
        int | None,
        typer.Option("--update-interval", help="Adaptive step: batches between re-scorings "
                     "(default: the table's, else 5).")
    ] = None,
    switch_min_gain: Annotated[
        float | None,
        typer.Option(
            "--switch-min-gain",
            help="Adaptive step: predicted relative gain a switch must exceed, in [0, 1) "
            "(default: the table's, else 0.05).",
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON on stdout.")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Directory for replay_timeline.png and replay_throughput.png."),
    ] = None,
) -> None:
    """Replay speculation policies against a cost table and report predicted throughput."""
    if (trace is None) == (scenario is None):
        raise InputError(
            "--trace/--scenario",
            None if trace is None else f"{trace} and {scenario}",
            "exactly one of --trace PATH or --scenario NAME",
        )
    specs = [parse_policy(p) for p in (policy or [])]  # refuses a combined adaptive spec first
    if plot is not None:
        check_outputs(
            [("--plot", plot / n) for n in (TIMELINE_PNG, THROUGHPUT_PNG)],
            [("--table", table), ("--trace", trace)],
        )
        check_writable(plot, "--plot", directory=True)  # before the replay, not after it
    cost_table = None
    if table is not None:
        cost_table = load_table(table)
        w = cost_table.draft_width
        if mode is not None and mode != cost_table.mode:
            raise InputError("--mode", mode, f"the table's mode {cost_table.mode!r} (or no --mode)")
        if draft_width is not None and draft_width != w:
            raise InputError("--draft-width", draft_width, f"the table's draft_width = {w}")
    else:
        if mode is not None and mode not in MODES:
            raise InputError("--mode", mode, " or ".join(MODES))
        w = draft_width or DEFAULT_DRAFT_WIDTH
    # refused before the work
    step, step_source = _step_config(window_size, update_interval, switch_min_gain, cost_table)
    if trace is not None:
        tr = load_trace(trace)
    else:
        tr = _scenario_trace(scenario, rounds, w, num_requests, kv_length, seed)
    if cost_table is None:
        mode = mode or DEFAULT_MODE
        nmax = (
            int(tr.num_requests.max())
            if isinstance(tr, RoundTrace)
            else int(np.unique(tr.request).size)
        )
        cost_table = synthetic_table(scenario_geometry(tr.draft_width, nmax), mode)
    cost = CostModel.from_table(cost_table)
    if not specs:
        specs = [parse_policy("adaptive-step" if cost.mode == "draft_step" else "adaptive-verify")]
    cfg = ReplayConfig(
        policies=tuple(p.text for p in specs if p.kind != "fixed"),
        step=step,
        verify=AdaptiveVerifyConfig(),
    )

    check_replayable(tr, cost, specs)
    if table is None and not json_out:
        err_console.print(f"[bold yellow]{SYNTHETIC_BANNER}[/]", soft_wrap=True)
    with ProgressReporter("replay", console=err_console, transient=True) as prog:
        report = replay(tr, cost, cfg, on_step=lambda s: prog.update(phase=s))
    d = report.to_dict()
    d["config"]["step_source"] = step_source  # flags, the table's calibration.policy, defaults
    d["table"] = {
        "path": str(table) if table else None,
        "mode": cost.mode,
        "synthetic": table is None,
        # a hybrid target's recurrent-state handling is inside every measured round cost; the
        # table records the strategy and (calibrated since 2026-12-02) the bytes it moves
        "state_strategy": cost_table.compatibility.state_strategy,
        "state_traffic": None if cost_table.calibration.state_traffic is None else [
            {**s.model_dump(), "total": s.total} for s in cost_table.calibration.state_traffic],
    }
    if plot is not None:
        # The synthetic table is a real CostTable too: its title says it is synthetic.
        d["plots"] = [str(p) for p in write_plots(report, plot, title=table_title(cost_table))]
    if json_out:
        typer.echo(json.dumps(d, sort_keys=True, allow_nan=False))
    else:
        _print_report(d)
        for p in d.get("plots", []):
            err_console.print(f"wrote {p}", markup=False)


def trace_cmd(
    out: Annotated[Path, typer.Option("--out", help="Trace file to write (.parquet or .jsonl).")],
    scenario: Annotated[
        str | None,
        typer.Option("--scenario", help="Write a synthetic scenario trace instead of recording."),
    ] = None,
    kind: Annotated[
        str,
        typer.Option(
            "--kind",
            help="rounds (per-round acceptance) or tokens (per-token acceptance matrix, greedy).",
        ),
    ] = "rounds",
    model: Annotated[
        str, typer.Option("--model", help="Runner model preset or HF folder.")
    ] = "tiny",
    device: Annotated[str, typer.Option("--device", help="cpu, cuda[:N] or npu[:N].")] = "cpu",
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="float32 / bfloat16 / float16 (default per device)."),
    ] = None,
    draft_width: Annotated[
        int, typer.Option("--draft-width", help="Draft width w (every round drafts w).")
    ] = 3,
    num_requests: Annotated[
        int, typer.Option("--num-requests", help="Concurrent requests (batch size B).")
    ] = 4,
    prompt_len: Annotated[
        int, typer.Option("--prompt-len", help="Random prompt tokens per request.")
    ] = 32,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Generated tokens per request.")
    ] = 64,
    acceptance: Annotated[
        str, typer.Option("--acceptance", help="greedy or synthetic (rounds only).")
    ] = "greedy",
    acceptance_profile: Annotated[
        str | None,
        typer.Option(
            "--acceptance-profile",
            "--profile",
            help="Synthetic: comma-separated conditional acceptance per position.",
        ),
    ] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Scenario rounds.")] = 20_000,
    kv_length: Annotated[
        float, typer.Option("--kv-length", help="Scenario mean KV length.")
    ] = 1024.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of prompts / scenario / runner.")] = 0,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print a summary as JSON on stdout.")
    ] = False,
    rounds_out: Annotated[
        Path | None,
        typer.Option(
            "--rounds-out",
            help="With --kind tokens: also write the round trace of the full-width run.",
        ),
    ] = None,
) -> None:
    """Record an acceptance trace with the embedded runner (or write a synthetic scenario)."""
    if kind not in ("rounds", "tokens"):
        raise InputError("--kind", kind, "rounds or tokens")
    if scenario is not None and kind != "rounds":
        raise InputError("--kind", kind, "rounds with --scenario (scenarios are round traces)")
    check_outputs([("--out", out), ("--rounds-out", rounds_out)])
    check_writable(out, "--out")  # before recording: a bad path never costs the run
    if rounds_out is not None:
        if scenario is not None or kind != "tokens":  # refused before --out is written
            raise InputError("--rounds-out", str(rounds_out), "only with --kind tokens (recording)")
        check_writable(rounds_out, "--rounds-out")
    t0 = time.perf_counter()
    round_trace = None
    if scenario is not None:
        tr = _scenario_trace(scenario, rounds, draft_width, num_requests, kv_length, seed)
    else:
        # lazy: the runner imports torch; the CLI starts (and reports a missing torch) without it
        from speccal.live.record import TraceRecording, record_trace

        tr, round_trace = record_trace(
            TraceRecording(
                kind=kind, model=model, device=device, dtype=dtype, draft_width=draft_width,
                num_requests=num_requests, prompt_len=prompt_len, max_tokens=max_tokens,
                acceptance=acceptance, acceptance_profile=_profile(acceptance_profile),
                seed=seed),
            _progress,
        )
    path = save_trace(tr, out)
    if rounds_out is not None:
        save_trace(round_trace, rounds_out)
    summary = {
        "path": str(path),
        "kind": "rounds" if hasattr(tr, "num_rounds") else "tokens",
        "draft_width": tr.draft_width,
        "records": int(tr.num_rounds if hasattr(tr, "num_rounds") else tr.request.size),
        "elapsed_s": round(time.perf_counter() - t0, 3),
        "meta": tr.meta,
    }
    if json_out:
        typer.echo(json.dumps(summary, sort_keys=True, allow_nan=False))
    else:
        err_console.print(
            f"wrote {summary['kind']} trace {path}: {summary['records']:,} records, "
            f"w={tr.draft_width} ({summary['elapsed_s']} s)",
            markup=False,
        )


def _profile(text: str | None) -> tuple[float, ...] | None:
    """``--acceptance-profile``: comma-separated probabilities."""
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise InputError("--acceptance-profile", text, "comma-separated probabilities") from None


def _progress(phase: str, unit: str, total: int | None = None) -> ProgressReporter:
    """The trace recording's progress on stderr (a bar on a terminal, log lines elsewhere)."""
    return ProgressReporter(
        "trace", console=err_console, total=total, unit=unit, phase=phase, transient=True
    )


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("replay")(replay_cmd)
    app.command("trace")(trace_cmd)
