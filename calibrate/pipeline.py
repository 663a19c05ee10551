"""One calibration run end to end: what ``speccal calibrate`` calls.

Order (nothing is sampled before every check has passed):

0. check that every option is usable (thread count, gate bounds) and every output (table,
   journal, their lock files) can be written (``speccal.base.atomic.check_writable``), take the
   lock of the outputs for the whole run (``speccal.calibrate.lock``: a second run on the same
   ``--out`` is refused, naming the holder) and refuse to discard a journal with finished windows
   unless ``--resume`` or ``--overwrite`` says what to do with it - all before the runner is
   built, so a bad output path never costs a calibration;
1. parse the calibration JSON (if any) - bad files fail before the runner is built;
2. pin torch's intra-op threads (``speccal.calibrate.machine``: one on cpu unless ``--threads``;
   restored at the end), build and warm the runner (``Engine``, forced full acceptance, the
   ``--loop`` round loop, pipelined by default: model load, kernel compiles, graph capture) -
   printed and timed as ``compile_capture_s``;
3. ``--cost-table``: load the table against ``Engine.compatibility()`` (semantic mismatch refused),
   print it and stop: no sampling, no fitting (warmup is not skipped);
4. resolve the effective configuration against the captured geometry and the quality gate's
   bounds against the device kind (``speccal.calibrate.gate``), print both with the thread
   count, check feasibility, build the grid;
5. open the journal (``--resume`` keeps finished windows of the same run, each window once;
   ``--overwrite`` discards them), read the machine load, drive the grid with a progress display
   (``speccal.base.progress``: a bar on a terminal, log lines elsewhere), appending each window
   (fsync); under the adaptive window count (``speccal.calibrate.gate.EarlyStop``) that first
   pass measures every point's first ``min_windows_per_point`` windows and a second one the
   rest of round 0 of the points whose windows spread; then re-measure the noisy points in at
   most ``remeasure_rounds`` rounds (appended the same way); print the warm-up
   (``transition_s`` + ``warmup_s``) and measuring (``sampling_s``) times and the load after
   (``--json``: each pass's seconds under ``timings.phases``);
6. fit every complete round of each point, pooled (``speccal.calibrate.gate``;
   ``speccal.costmodel.table_build.fit_table``), record the
   gate in ``calibration.quality``, the window timing (loop, wall over device span) in
   ``calibration.timing`` and the timings in ``provenance.timings``, print the fit report
   and the gate's verdict; refuse (``QualityGateError``, exit 1, the journal kept) a table whose
   held-out error is beyond the bound unless ``accept_noisy``; write the table atomically at
   ``--out`` - ``fit_s``; a last line prints every phase's seconds. A crash or refusal before
   this leaves the previous table untouched.

Returns a JSON-able summary (``--json``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.markup import escape

from speccal.base.atomic import check_writable
from speccal.base.errors import InputError, UnsupportedError
from speccal.base.progress import ProgressReporter
from speccal.base.run_spec import RunSpec
from speccal.base.runner_face import BuildReport, Routing, Runner
from speccal.calibrate import lock, machine, report
from speccal.calibrate.config import (
    CalibrationConfig,
    UserConfig,
    parse_config_file,
    resolve_config,
)
from speccal.calibrate.driver import DriveStats, drive, loop_of, prompt_fill, spread_contexts
from speccal.calibrate.feasibility import check_feasible, slot_tokens
from speccal.calibrate.gate import (
    EarlyStop,
    GateConfig,
    HeldOut,
    QualityGateError,
    Selection,
    check_bounds,
    held_out,
    point_key,
    points_for_more_windows,
    points_to_remeasure,
    select_windows,
)
from speccal.calibrate.grid import GridPoint, build_grid, spread_points
from speccal.calibrate.journal import Journal, check_discard, open_journal
from speccal.calibrate.timing import CLOCKS, SpeedProbe, at_run_speed, loop_timing
from speccal.costmodel.coverage import warn_coverage
from speccal.costmodel.report import routing_summary
from speccal.costmodel.spread import fit_spread
from speccal.costmodel.table import load_table, save_table
from speccal.costmodel.table_build import assemble_table, fit_table
from speccal.costmodel.table_schema import Provenance


def _invocation() -> str | None:
    """The command line that made the table: ``speccal ...`` for the CLI, else the script."""
    if not sys.argv:
        return None
    prog = Path(sys.argv[0]).name
    head = ["speccal"] if prog in ("speccal", "__main__.py", "cli.py") else ["python3", sys.argv[0]]
    return " ".join([*head, *sys.argv[1:]])


@dataclass(frozen=True)
class CalibrateOptions:
    """Everything ``speccal calibrate`` takes from its command line.

    ``request_buckets`` are the run's captured buckets (engine option); the calibration samples all
    of them unless the config names a subset. ``flags`` are calibration values set by CLI flags
    (keys of ``speccal.calibrate.config.KEYS``; None = not given). ``threads`` is torch's
    intra-op thread count (None: one on cpu, torch's own elsewhere); ``max_spread_pct``,
    ``max_heldout_pct``, ``remeasure_rounds`` and ``accept_noisy`` set the quality gate (None:
    the device kind's defaults, ``speccal.calibrate.gate.DEFAULTS``). ``loop`` is the engine's
    round loop (``speccal.base.vocab.LOOPS``): ``pipelined`` (default, what a deployment
    serves with: round ``n + 1`` queued while ``n`` runs) or ``synchronous``; recorded in the
    table's compatibility and ``calibration.timing``.
    """

    model: str = "tiny"
    device: str = "cpu"
    dtype: str | None = None
    draft_width: int | None = None
    request_buckets: tuple[int, ...] | None = None
    config_path: Path | None = None
    out: Path = Path("speccal-table.json")
    journal: Path | None = None
    resume: bool = False
    overwrite: bool = False
    drop_bad_windows: bool = False  # with resume: drop invalid journal lines (journal.py)
    cost_table: Path | None = None
    max_model_len: int | None = None
    flags: Mapping[str, Any] = field(default_factory=dict)
    progress: bool = True
    seed: int = 0
    graph_mode: str | None = None
    attention_backend: str | None = None
    threads: int | None = None
    max_spread_pct: float | None = None
    max_heldout_pct: float | None = None
    remeasure_rounds: int | None = None
    accept_noisy: bool = False
    loop: str = "pipelined"
    clock: str = "auto"  # auto | wall | cpu_probe (speccal.calibrate.timing.CLOCKS)
    state_strategy: str = "scratch_swap"  # hybrid targets (EngineConfig.state_strategy)
    kernels: Mapping[str, Any] | None = None  # a KernelConfig.to_dict() object; None: defaults

    @property
    def journal_path(self) -> Path:
        return self.journal or self.out.with_name(self.out.name + ".journal.jsonl")


# Prompt tokens per prefill forward of the calibrating engine. Windows time rounds, never
# prefill; a window's transition prefills its Bcap prompts, and at the runner's default chunk
# (512) a prefill is bound by kernel launches (H200, dense-2b, bench/bench_prefill.py: 18.9 k
# prompt tokens/s, 14.3x its GEMM floor, 14,679 launches for one 4,000-token prompt), which made
# the transitions most of a default calibration's wall time. One forward per prompt up to this
# many tokens.
CALIBRATION_PREFILL_CHUNK = 4096



def run_spec(opts: CalibrateOptions, *, device: str | None = None, tp: int = 1) -> RunSpec:
    """The run spec of a calibration (forced full acceptance: shapes == grid; the calibration
    prefill chunk; ``device`` a rank's own, ``cuda:LOCAL_RANK``; ``tp`` its TP size): the one
    value :func:`make_engine` and the ranks' factory (``speccal.calibrate.ranks``) build from.
    A deployment's served path unless the options name one (a table records ``graph_mode``,
    so an eager table cannot serve graphs)."""
    return RunSpec(
        model=opts.model, device=device or opts.device, dtype=opts.dtype,
        draft_width=opts.draft_width, request_buckets=opts.request_buckets,
        max_model_len=opts.max_model_len, seed=opts.seed, acceptance="forced",
        loop=opts.loop, state_strategy=opts.state_strategy, graph_mode=opts.graph_mode,
        attention_backend=opts.attention_backend, kernels=opts.kernels,
        prefill_chunk=CALIBRATION_PREFILL_CHUNK, tp=tp)


def engine_config(opts: CalibrateOptions, *, device: str | None = None,
                  tp: int = 1) -> Any:
    """The ``EngineConfig`` of a calibration (:func:`run_spec` through
    ``speccal.runner.engine_config.from_spec``).

    Raises ``UnsupportedError`` (exit 2, one line) when torch is not installed: the runner is
    imported here, not at module level, so that the rest of calibrate stays torch-free.
    """
    spec = run_spec(opts, device=device, tp=tp)
    try:
        from speccal.runner.engine_config import from_spec
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torch":
            raise
        raise UnsupportedError(machine.TORCH_MISSING) from None
    return from_spec(spec)


def make_engine(opts: CalibrateOptions) -> Any:
    """Build and warm the runner for calibration (:func:`engine_config`)."""
    from speccal.runner.engine import Engine

    return Engine(engine_config(opts))



def check_run_values(opts: CalibrateOptions) -> None:
    """Refuse a named value of the run that is none of its choices (threads, loop, clock,
    state strategy, gate bounds): one rule for one rank and for several (``ranks``)."""
    machine.check_threads(opts.threads)
    run_spec(opts)  # the loop, the state strategy, the graph mode and backend named
    if opts.clock not in ("auto", *CLOCKS):
        raise InputError("--clock", opts.clock, " or ".join(("auto", *CLOCKS)))
    check_bounds(opts.max_spread_pct, opts.max_heldout_pct, opts.remeasure_rounds)


def _check_options(opts: CalibrateOptions) -> None:
    """Refuse contradictory options and unwritable outputs before anything is built."""
    check_run_values(opts)
    if opts.resume and opts.overwrite:
        raise InputError(
            "--overwrite", True, "not combined with --resume (keep the journal or discard it)"
        )
    if opts.cost_table is not None:
        for name, given in (
            ("--resume", opts.resume),
            ("--overwrite", opts.overwrite),
            ("--journal", opts.journal is not None),
        ):
            if given:
                raise InputError(
                    name, True, "not combined with --cost-table (a reused table samples nothing)"
                )
        if not opts.cost_table.is_file():
            raise InputError("--cost-table", str(opts.cost_table), "an existing cost table file")
        return
    journal_field = "--journal" if opts.journal is not None else "--out"
    check_writable(opts.out, "--out")
    check_writable(opts.journal_path, journal_field)
    if opts.journal_path.resolve() == opts.out.resolve():
        raise InputError("--journal", str(opts.journal_path), "a path other than --out")
    for output, field_name in _locked_outputs(opts):
        check_writable(lock.lock_path(output), field_name)


def _locked_outputs(opts: CalibrateOptions) -> list[tuple[Path, str]]:
    """Outputs whose lock a calibration holds: the table and its journal (``lock.run_outputs``)."""
    return lock.run_outputs(opts.out, opts.journal_path)


def calibrate(
    opts: CalibrateOptions,
    *,
    console: Console | None = None,
    engine_factory: Callable[[CalibrateOptions], Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Run one calibration (or validate a reused table); return the ``--json`` summary.

    ``engine_factory(opts)`` builds the warmed runner (default ``make_engine``); ``clock`` is
    the wall clock of the window edges (``speccal.calibrate.driver.drive``).

    Raises
    ------
    InputError
        Bad options or config, an unwritable output (``OutputError``), an output locked by
        another run (``lock.OutputLockedError``), a journal with finished windows and neither
        ``resume`` nor ``overwrite``; each before the runner is built.
    QualityGateError
        The fitted table's held-out error is beyond ``max_heldout_pct`` and ``accept_noisy`` is
        not set: no table written, the journal kept (``--resume --accept-noisy`` writes it).
    """
    console = console or Console(stderr=True)
    t_start = time.perf_counter()
    startup_s = machine.process_age_s()  # interpreter start and imports, before this clock
    _check_options(opts)
    if opts.cost_table is not None:
        return _calibrate(opts, console, engine_factory, t_start, clock, startup_s)
    held: list[lock.OutputLock] = []
    try:
        for output, field_name in _locked_outputs(opts):
            held.append(lock.acquire(output, field_name, command=_invocation()))
        # Under the lock, so that no other run changes the journal between check and use.
        check_discard(opts.journal_path, resume=opts.resume, overwrite=opts.overwrite)
        return _calibrate(opts, console, engine_factory, t_start, clock, startup_s)
    finally:
        for h in reversed(held):
            h.release()


def _calibrate(
    opts: CalibrateOptions,
    console: Console,
    engine_factory: Callable[[CalibrateOptions], Any] | None,
    t_start: float,
    clock: Callable[[], float],
    startup_s: float | None = None,
) -> dict[str, Any]:
    """``calibrate`` after the option checks, with the outputs locked; ``startup_s``: the
    process's age when ``calibrate`` started (reported with the timings)."""
    parsed = parse_config_file(opts.config_path) if opts.config_path is not None else None

    meter = _compile_meter()
    with machine.pin_threads(opts.device, opts.threads) as threads, meter.measuring():
        t0 = time.perf_counter()
        engine = (engine_factory or make_engine)(opts)
        geometry = engine.geometry
        compat = engine.compatibility()
        compile_capture_s = time.perf_counter() - t0
        description = engine.description
        built = engine.build_report()
        console.print(
            f"compile/capture {compile_capture_s:.1f} s: runner {escape(str(description))} built and warmed "
            f"({compat.get('graph_mode')} graphs)",
            soft_wrap=True,
        )
        compile_info = _compile_info(built, meter)
        build = built.timings
        if build:
            console.print(_build_line(build, startup_s), soft_wrap=True)
        no_bytecode = machine.missing_bytecode()
        if no_bytecode:
            console.print(machine.describe_missing_bytecode(no_bytecode), soft_wrap=True)
        if compile_info is not None:
            console.print(_compile_line(compile_info), soft_wrap=True)

        if opts.cost_table is not None:
            table = load_table(
                opts.cost_table, expect=compat, runtime_versions=engine.runtime_versions()
            )
            warn_coverage(table, geometry, source=str(opts.cost_table))
            report.print_reused_table(console, table, opts.cost_table)
            return {
                "status": "reused",
                "cost_table": str(opts.cost_table),
                "calibration": table.calibration.model_dump(mode="json"),
                "compatibility": dict(compat),
                "geometry": geometry.to_dict(),
                "timings": {
                    "compile_capture_s": compile_capture_s,
                    "total_s": time.perf_counter() - t_start,
                },
            }

        flags = dict(opts.flags)
        if opts.request_buckets is not None and not (
            parsed and parsed.calibration.request_buckets is not None
        ):
            # The captured buckets were chosen on the command line: calibrating all of them is the flag's doing.
            flags["request_buckets"] = tuple(geometry.request_buckets)
        kind = str(compat["device"]["kind"])
        cfg = resolve_config(UserConfig.build(parsed, flags), geometry, device_kind=kind)
        gate = GateConfig.resolve(
            kind,
            max_spread_pct=opts.max_spread_pct,
            max_heldout_pct=opts.max_heldout_pct,
            remeasure_rounds=opts.remeasure_rounds,
            accept_noisy=opts.accept_noisy,
        )
        report.print_effective_config(console, cfg, geometry, compat, threads, gate)
        check_feasible(cfg, geometry)
        points = build_grid(cfg)
        measured = _measure(
            opts, console, engine, cfg, geometry, compat, points, threads, gate, clock
        )

    stats, journal, selection = measured.stats, measured.journal, measured.selection
    t_fit = time.perf_counter()
    versions = engine.runtime_versions()
    timings = {
        "compile_capture_s": compile_capture_s,
        "transition_s": stats.transition_s,
        "warmup_s": stats.warmup_s,
        "sampling_s": stats.sampling_s,
    }
    parts = fit_table(
        pd.DataFrame(selection.rows),
        model=cfg.model,
        compatibility=compat,
        calibration={
            **cfg.to_dict(),
            "sources": {**cfg.sources, "threads": threads.source},
            "threads": threads.threads,
            "timing": loop_timing(selection.rows, loop_of(engine)),
            "prompts": prompt_fill(engine),
            "state_traffic": (None if built.state_traffic is None
                              else [dict(r) for r in built.state_traffic]),
            "routing": routing_block(engine.routing),
        },
        geometry=geometry,
        provenance=Provenance.now(
            command=_invocation(),
            timings=timings,
            torch_version=versions["torch_version"],
            driver_version=versions["driver_version"],
        ),
    )
    held = held_out(parts)
    passed = held.passes(gate)
    quality = {
        **report.gate_dict(gate),
        "model": parts.model,
        "heldout_pct": held.pct,
        "window_spread_pct_max": selection.spread_max_pct,
        "passed": passed,
        "override_used": not passed and gate.accept_noisy,
        "flagged_points": [q.to_dict() for q in selection.flagged],
        "remeasured_windows": measured.remeasured_windows,
        "load": machine.load_record(opts.device, measured.load_before, measured.load_after),
        "sources": dict(gate.sources),
    }
    spread = fit_spread(selection.rows, measured.spread_rows) if measured.spread_rows else None
    # the table, built once with its quality and spread term
    table = assemble_table(parts, quality=quality, kv_spread=spread)
    fit_s = time.perf_counter() - t_fit
    total_s = time.perf_counter() - t_start
    report.print_fit_report(console, table)
    report.print_routing(console, table)
    report.print_kv_model(console, table)
    report.print_kv_spread(console, table)
    report.print_timing(console, table.calibration.timing)
    report.print_gate(console, quality, selection, held)
    refused = not passed and not gate.accept_noisy
    summary = {
        "status": "refused" if refused else "calibrated",
        "out": None if refused else str(opts.out),
        "journal": str(opts.journal_path),
        "points_total": stats.points_total,
        "points_done": stats.points_done,
        "points_resumed": stats.points_skipped,
        "windows": len(selection.rows),
        "windows_journal": len(journal.rows),
        "windows_measured": stats.windows_measured,
        "journal_duplicates_dropped": journal.dropped_duplicates,
        "rounds": stats.rounds,
        "effective_config": report.effective_config_dict(cfg, geometry, compat, threads, gate),
        "fit": report.fit_summary(table),
        "kv_model": report.kv_model_errors(table),
        "routing": routing_summary(table),
        "quality": quality,
        "timing": table.calibration.timing.model_dump(mode="json"),
        "window_spread_pct_max_last_round": selection.last_round_spread_max_pct,
        "window_count": window_count(cfg, measured.early, selection),
        "timings": {**timings, "fit_s": fit_s, "total_s": total_s,
                    "phases": {name: phase_timings(st) for name, st in measured.phases.items()},
                    "startup_s": startup_s, "build": dict(built.timings),
                    "no_bytecode": no_bytecode},
        "triton_compile": {**(compile_info or {}), "in_process_compiles": meter.count,
                           "in_process_compile_s": round(meter.seconds, 3)},
    }
    console.print(f"Triton: {meter.count} in-process compiles or cache loads, {meter.seconds:.1f} s "
                  "over the whole run", soft_wrap=True)
    console.print(phases_line(timings, fit_s, total_s), soft_wrap=True)
    if refused:
        raise QualityGateError(
            _refusal(opts, held, gate, kind, measured.load_after), summary=summary
        )
    save_table(table, opts.out)  # --out was checked writable before the runner was built
    console.print(f"wrote {escape(str(opts.out))} ({stats.points_done}/{stats.points_total} points)")
    return summary


def routing_block(routing: Routing | None) -> dict[str, Any] | None:
    """The table's ``calibration.routing`` of a runner's routed-expert layers (None: dense).
    The driver's prompts are random token ids (``driver.synthetic_base``): ``random_tokens``."""
    if routing is None:
        return None
    return {"source": "random_tokens", "experts": routing.experts, "top_k": routing.top_k,
            "layers": routing.layers}


def _compile_meter() -> Any:
    """``speccal.runner.device.CompileMeter`` (imported here: the runner needs torch, and a
    machine without it gets ``make_engine``'s one-line refusal, not an import error)."""
    try:
        from speccal.runner.device import CompileMeter
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torch":
            raise
        return _NoCompiles()
    return CompileMeter()


class _NoCompiles:
    """What a machine without torch compiles: nothing (``make_engine`` then refuses)."""

    count = 0
    seconds = 0.0

    def measuring(self):
        return contextlib.nullcontext(self)


def _compile_info(built: BuildReport, meter: Any) -> dict[str, Any] | None:
    """What building the runner compiled: its precompile report (None off CUDA/Triton) and the
    in-process compiles (cache loads included) counted so far."""
    if built.precompile is None:
        return None
    return {"precompile": dict(built.precompile), "build_compiles": meter.count,
            "build_compile_s": round(meter.seconds, 3),
            "graphs": built.graphs, "capture_s": round(built.capture_s, 3)}


def _build_line(build: dict[str, float], startup_s: float | None) -> str:
    """Where the runner build's time went (``Engine.build_timings``) and the process's start-up."""
    parts = [f"{name[:-2].replace('_', ' ')} {build[name]:.1f} s"
             for name in ("device_s", "load_s", "setup_s", "fuse_s", "graphs_s",
                          "prefill_warmup_s") if name in build]
    line = f"runner build {build.get('total_s', 0.0):.1f} s ({', '.join(parts)})"
    if startup_s is not None:
        line += f"; process start-up and imports before calibrate {startup_s:.1f} s"
    return line


def _compile_line(info: dict[str, Any]) -> str:
    rep = info["precompile"]
    line = (f"Triton: {rep['kernels']} kernels precompiled by {rep['workers']} worker processes "
            f"(precompile {rep['total_s']:.1f} s: "
            f"compiling {rep['compile_wall_s']:.1f} s, dry pass {rep['dry_pass_s']:.1f} s, "
            f"{rep['compile_cpu_s']:.1f} s of compiler time); capturing {info['graphs']} graphs "
            f"took {info['capture_s']:.1f} s with {info['build_compiles']} in-process compiles or "
            f"cache loads ({info['build_compile_s']:.1f} s)")
    if rep["failed"]:
        line += f"; {len(rep['failed'])} failed in the workers (compiled in-process): {rep['failed'][0]}"
    return line


@dataclass(frozen=True)
class _Measured:
    """What the measuring phase of ``_calibrate`` hands to the fit."""

    stats: DriveStats
    phases: dict[str, DriveStats]  # first, more (the early stop's rest), remeasure_<r>
    early: EarlyStop | None
    journal: Journal
    selection: Selection
    remeasured_windows: int
    load_before: dict[str, Any]
    load_after: dict[str, Any]
    spread_rows: list[dict[str, Any]] = field(default_factory=list)  # the spread points' windows


def _measure(
    opts: CalibrateOptions,
    console: Console,
    engine: Any,
    cfg: CalibrationConfig,
    geometry: Any,
    compat: Mapping[str, Any],
    points: tuple[GridPoint, ...],
    threads: machine.ThreadPin,
    gate: GateConfig,
    clock: Callable[[], float],
) -> _Measured:
    """Open the journal, drive the grid, re-measure noisy points; pick the windows to fit."""
    header = {
        "config": cfg.to_dict(),
        "geometry": geometry.to_dict(),
        "compatibility": dict(compat),
        # "windows": every window of a point a replicate at the same KV (driver, step 1); a
        # journal whose windows advanced through the interval is another run's
        "measurement": {"threads": threads.threads, "windows": "replicates"},
    }
    device_label = f"{compat['device']['kind']}:{compat['device']['name']}"
    vocab_size = _vocab_size(engine)
    w = cfg.windows_per_point
    early = EarlyStop.of(cfg, gate)
    # Every point's first pass: all of round 0, or its first windows under the early stop
    first = range(w) if early is None else early.first
    if early is not None:
        # a journal of another window-count rule measured other windows (journal key)
        header["measurement"]["early_stop"] = early.to_dict()
    # CPU rounds are timed by the probe clock (speccal.calibrate.timing); the journal's header
    # names the clock, so a journal of the other clock is another run's
    probe = SpeedProbe() if window_clock(opts.clock, _device_type(engine)) == "cpu_probe" else None
    header["measurement"]["clock"] = "wall" if probe is None else "cpu_probe"
    with open_journal(
        opts.journal_path, header, resume=opts.resume, overwrite=opts.overwrite,
        drop_bad=opts.drop_bad_windows,
    ) as journal:
        if journal.resumed:
            notes = []
            if journal.dropped_duplicates:
                notes.append(
                    f"dropped {journal.dropped_duplicates} duplicate window line(s), "
                    "keeping the first of each"
                )
            if journal.dropped_torn_line:
                notes.append("dropped a torn last line")
            console.print(
                f"resuming from {escape(str(opts.journal_path))}: {len(journal.rows)} windows already measured"
                + (f" ({'; '.join(notes)})" if notes else "")
            )
        report.print_grid(console, points, cfg, len(journal.rows))
        if probe is not None:
            console.print(
                "clock: each round's thread CPU time over a speed probe's (cpu: the machine's "
                "speed drifts; speccal.calibrate.timing), priced at the run's median probe",
                soft_wrap=True,
            )
        load_before = machine.load_sample(opts.device)
        note = "[bold yellow]busy[/]: expect noisy windows; " if machine.busy(load_before) else ""
        console.print(
            f"machine {machine.describe_load(load_before)} before measuring; {note}"
            f"torch intra-op threads {threads.threads}",
            soft_wrap=True,
        )
        base = _all_windows(points, first)
        left = {p.key: sum((*p.key, i) not in journal.done for i in first) for p in points}
        with ProgressReporter(
            "calibrate",
            console=console,
            total=len(base),
            completed=len(journal.done & base),
            unit="windows",
            enabled=opts.progress,
        ) as progress:
            points_done = sum(n == 0 for n in left.values())

            def on_window(point: GridPoint, window_index: int) -> None:
                nonlocal points_done
                if window_index in first and point.key in left:
                    left[point.key] -= 1
                    points_done += left[point.key] == 0
                progress.update(
                    advance=1,
                    detail=f"points {points_done}/{len(points)}, "
                    f"Bcap={point.bcap} G={point.g} k={point.k}",
                )

            def measure(pts, indices) -> DriveStats:
                return drive(engine, cfg, pts, journal, device=device_label,
                             vocab_size=vocab_size, window_indices=indices,
                             on_window=on_window, clock=clock, probe=probe)

            stats = measure(points, first)
            phases = {"first": stats}
            if early is not None:
                due = points_for_more_windows(journal.rows, points, early)
                report.print_more_windows(console, early, due, len(points))
                if due:
                    todo = sum((*p.key, i) not in journal.done for p in due for i in early.rest)
                    progress.update(
                        total=(progress.total or 0) + len(due) * len(early.rest),
                        advance=len(due) * len(early.rest) - todo,
                        phase="more windows",
                    )
                    phases["more"] = measure(due, early.rest)
                    stats = stats.plus(phases["more"])
            for r in range(1, gate.remeasure_rounds + 1):
                due = points_to_remeasure(journal.rows, points, w, r, gate, early)
                if not due:
                    break
                indices = range(r * w, (r + 1) * w)
                todo = sum((*p.key, i) not in journal.done for p in due for i in indices)
                if todo:  # a resumed run may find the whole round in the journal already
                    report.print_remeasure(console, r, gate, due)
                progress.update(
                    total=(progress.total or 0) + len(due) * w,
                    advance=len(due) * w - todo,
                    phase=f"re-measure {r}/{gate.remeasure_rounds}",
                )
                more = measure(due, indices)
                phases[f"remeasure_{r}"] = more
                stats = stats.plus(more)
            # The KV spread term's points (speccal.costmodel.spread), after the grid, at every
            # context that can spread: one pass of the first windows each (those the early stop
            # measures every point with), never re-measured (their median only prices the term)
            extra = spread_plan(cfg, geometry)
            if extra:
                todo = sum((*p.key, i) not in journal.done for p in extra for i in first)
                progress.update(total=(progress.total or 0) + len(extra) * len(first),
                                advance=len(extra) * len(first) - todo, phase="KV spread")
                phases["spread"] = measure(extra, first)
                stats = stats.plus(phases["spread"])
        load_after = machine.load_sample(opts.device)
        console.print(
            f"warm-up {stats.transition_s + stats.warmup_s:.1f} s (prefill and first round of each "
            f"window {stats.transition_s:.1f} s, warm-up rounds {stats.warmup_s:.1f} s), "
            f"measuring {stats.sampling_s:.1f} s ({stats.windows_measured} windows); "
            f"machine {machine.describe_load(load_after)} after",
            soft_wrap=True,
        )
        priced = at_run_speed(journal.rows)
        selection = select_windows(priced, points, w, gate, early)
        keys = {p.key for p in extra}
        spread_rows = [r for r in priced if point_key(r) in keys]
    return _Measured(
        stats=stats,
        phases=phases,
        early=early,
        journal=journal,
        selection=selection,
        # Every re-measured window of the journal, a resumed run's earlier ones included.
        remeasured_windows=sum(int(r["window_index"]) >= w for r in journal.rows),
        load_before=load_before,
        load_after=load_after,
        spread_rows=spread_rows,
    )


def spread_plan(cfg: CalibrationConfig, geometry: Any) -> tuple[GridPoint, ...]:
    """The KV spread points a calibration measures after its grid (none unless ``kv_spread``):
    one per bucket at every context that can spread within what a request may hold."""
    if not cfg.kv_spread:
        return ()
    return spread_points(cfg, spread_contexts(cfg, request_kv_limit(cfg, geometry)))


def request_kv_limit(cfg: CalibrationConfig, geometry: Any) -> int | None:
    """The most KV tokens one request of the largest bucket may hold: the model context and
    its share of the KV capacity (``feasibility.slot_tokens``), whichever is smaller."""
    limits = [slot_tokens(geometry, max(cfg.request_buckets))]
    if geometry.max_model_len:
        limits.append(int(geometry.max_model_len))
    return min(limits)


def phase_timings(stats: DriveStats) -> dict[str, float | int]:
    """One measuring phase's seconds (``--json``'s ``timings.phases``)."""
    return {"windows": stats.windows_measured, "transition_s": stats.transition_s,
            "warmup_s": stats.warmup_s, "sampling_s": stats.sampling_s}


def phases_line(timings: Mapping[str, float], fit_s: float, total_s: float) -> str:
    """Every phase's seconds in one line, at the end of a run."""
    parts = [("compile/capture", timings["compile_capture_s"]),
             ("transitions", timings["transition_s"]),
             ("warm-up rounds", timings["warmup_s"]),
             ("measuring", timings["sampling_s"]), ("fit", fit_s)]
    return (f"total {total_s:.1f} s: "
            + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in parts))


def window_count(
    cfg: CalibrationConfig, early: EarlyStop | None, selection: Selection
) -> dict[str, Any]:
    """The window-count rule and what it did (``--json``'s ``window_count``): the rule
    (``CalibrationConfig.windows_dict``, the early stop's effective bound) and how many points
    kept each count of round-0 windows (``{"2": 130, "3": 6}``)."""
    per_point: dict[tuple, int] = {}
    for row in selection.rows:
        if int(row["window_index"]) < cfg.windows_per_point:
            key = (int(row["context_index"]), int(row["bcap"]), int(row["g"]), int(row["k"]))
            per_point[key] = per_point.get(key, 0) + 1
    counts: dict[str, int] = {}
    for n in sorted(per_point.values()):
        counts[str(n)] = counts.get(str(n), 0) + 1
    return {**cfg.windows_dict(), "rule": "fixed" if early is None else "early_stop",
            "early_stop": None if early is None else early.to_dict(),
            "points_by_round0_windows": counts}


def window_clock(clock: str, device_type: str | None) -> str:
    """The clock that times the windows (``speccal.calibrate.timing.CLOCKS``): ``auto`` is the
    probe clock on a CPU engine and the wall clock elsewhere; an explicit ``cpu_probe`` needs
    a CPU engine (a GPU's rounds are not this thread's work)."""
    if clock == "auto":
        return "cpu_probe" if device_type == "cpu" else "wall"
    if clock == "cpu_probe" and device_type not in ("cpu", None):
        raise InputError("--clock", clock, f"wall or auto on a {device_type} engine "
                         "(cpu_probe times a CPU round's thread time)")
    return clock


def _device_type(engine: Runner) -> str | None:
    """The engine's torch device type (``cpu``, ``cuda``, ...); None for an engine without a
    device (the fakes of the tests, which keep the wall clock)."""
    return None if engine.device is None else str(engine.device.type)


def _refusal(
    opts: CalibrateOptions, held: HeldOut, gate: GateConfig, kind: str, load: dict[str, Any]
) -> str:
    """The one-line message of a :class:`QualityGateError`."""
    where = f" in context {held.context_index}" if held.context_index else ""
    return (
        f"quality gate: held-out error {held.pct:.1f} % (leave-one-point-out mean{where}) is "
        f"beyond the {gate.max_heldout_pct:g} % bound on {kind}, so {opts.out} was not written; "
        f"the journal {opts.journal_path} keeps every window: rerun with --resume --accept-noisy "
        "to write this table anyway (recorded in it), or with --overwrite on a quieter machine "
        f"(seen: {machine.describe_load(load)}), or raise --max-heldout-pct"
    )


def _all_windows(points, indices: range) -> set:
    return {(*p.key, i) for p in points for i in indices}


def _vocab_size(engine: Runner) -> int:
    return int(engine.vocab_size)
