"""One calibration run end to end: what ``speccal calibrate`` calls.

Order (nothing is sampled before every check has passed):

0. check that every output (table, journal, their lock files) can be written
   (``speccal.base.atomic.check_writable``), take the lock of the outputs for the whole run
   (``speccal.calibrate.lock``: a second run on the same ``--out`` is refused, naming the
   holder) and refuse to discard a journal with finished windows unless ``--resume`` or
   ``--overwrite`` says what to do with it - all before the runner is built, so a bad output
   path never costs a calibration;
1. parse the calibration JSON (if any) - bad files fail before the runner is built;
2. build and warm the runner (``Engine``, forced full acceptance) - timed as ``warmup_capture_s``;
3. ``--cost-table``: load the table against ``Engine.compatibility()`` (semantic mismatch refused),
   print it and stop: no sampling, no fitting (warmup is not skipped);
4. resolve the effective configuration against the captured geometry, print it, check
   feasibility, build the grid;
5. open the journal (``--resume`` keeps finished windows of the same run, each window once;
   ``--overwrite`` discards them), drive the grid with a progress bar, appending each window
   (fsync) - ``sampling_s``;
6. fit (``speccal.costmodel.table_build.build_table``), print the fit report, write the table atomically
   at ``--out`` - ``fit_s``. A crash before this leaves the previous table untouched.

Returns a JSON-able summary (``--json``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from speccal.base.atomic import check_writable
from speccal.base.errors import InputError, UnsupportedError
from speccal.calibrate import lock, report
from speccal.calibrate.config import UserConfig, parse_config_file, resolve_config
from speccal.calibrate.driver import drive
from speccal.calibrate.feasibility import check_feasible
from speccal.calibrate.grid import build_grid
from speccal.calibrate.journal import check_discard, open_journal


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
    (keys of ``speccal.calibrate.config.KEYS``; None = not given).
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
    cost_table: Path | None = None
    max_model_len: int | None = None
    flags: Mapping[str, Any] = field(default_factory=dict)
    progress: bool = True
    seed: int = 0
    graph_mode: str | None = None
    attention_backend: str | None = None

    @property
    def journal_path(self) -> Path:
        return self.journal or self.out.with_name(self.out.name + ".journal.jsonl")


def make_engine(opts: CalibrateOptions) -> Any:
    """Build and warm the runner for calibration (forced full acceptance: shapes == grid).

    Raises ``UnsupportedError`` (exit 2, one line) when torch is not installed: the runner is
    imported here, not at module level, so that the rest of calibrate stays torch-free.
    """
    try:
        from speccal.runner.engine import Engine, EngineConfig
        from speccal.runner.path import served_path
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torch":
            raise
        raise UnsupportedError(
            "speccal calibrate drives the embedded runner, which needs torch: "
            "install it (pip install torch) or fit measurement rows with speccal fit"
        ) from None

    kwargs: dict[str, Any] = {
        "model": opts.model,
        "device": opts.device,
        "acceptance": "forced",
        "seed": opts.seed,
    }
    if opts.dtype is not None:
        kwargs["dtype"] = opts.dtype
    if opts.draft_width is not None:
        kwargs["draft_width"] = opts.draft_width
    if opts.request_buckets is not None:
        kwargs["request_buckets"] = tuple(opts.request_buckets)
    if opts.max_model_len is not None:
        kwargs["max_model_len"] = opts.max_model_len
    # Calibrate the path a deployment serves with unless asked otherwise; a table records
    # graph_mode, so an eager table cannot serve graphs.
    served = served_path(opts.device)
    kwargs["path"] = served.with_(
        graph_mode=opts.graph_mode or served.graph_mode,
        attention_backend=opts.attention_backend or served.attention_backend,
    )
    return Engine(EngineConfig(**kwargs))


def _check_options(opts: CalibrateOptions) -> None:
    """Refuse contradictory options and unwritable outputs before anything is built."""
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
    """Outputs whose lock a calibration holds: the table, and a journal kept elsewhere."""
    outputs = [(opts.out, "--out")]
    if opts.journal is not None:
        outputs.append((opts.journal, "--journal"))
    return outputs


def calibrate(
    opts: CalibrateOptions,
    *,
    console: Console | None = None,
    engine_factory: Callable[[CalibrateOptions], Any] | None = None,
) -> dict[str, Any]:
    """Run one calibration (or validate a reused table); return the ``--json`` summary.

    ``engine_factory(opts)`` builds the warmed runner (default ``make_engine``).

    Raises
    ------
    InputError
        Bad options or config, an unwritable output (``OutputError``), an output locked by
        another run (``lock.OutputLockedError``), a journal with finished windows and neither
        ``resume`` nor ``overwrite``; each before the runner is built.
    """
    console = console or Console(stderr=True)
    t_start = time.perf_counter()
    _check_options(opts)
    if opts.cost_table is not None:
        return _calibrate(opts, console, engine_factory, t_start)
    held: list[lock.OutputLock] = []
    try:
        for output, field_name in _locked_outputs(opts):
            held.append(lock.acquire(output, field_name, command=_invocation()))
        # Under the lock, so that no other run changes the journal between check and use.
        check_discard(opts.journal_path, resume=opts.resume, overwrite=opts.overwrite)
        return _calibrate(opts, console, engine_factory, t_start)
    finally:
        for h in reversed(held):
            h.release()


def _calibrate(
    opts: CalibrateOptions,
    console: Console,
    engine_factory: Callable[[CalibrateOptions], Any] | None,
    t_start: float,
) -> dict[str, Any]:
    """``calibrate`` after the option checks, with the outputs locked."""
    from speccal.costmodel.table import load_table, save_table
    from speccal.costmodel.table_build import build_table
    from speccal.costmodel.table_schema import Provenance

    parsed = parse_config_file(opts.config_path) if opts.config_path is not None else None

    t0 = time.perf_counter()
    engine = (engine_factory or make_engine)(opts)
    geometry = engine.geometry
    compat = engine.compatibility()
    warmup_capture_s = time.perf_counter() - t0
    description = getattr(engine, "description", opts.model)
    console.print(
        f"runner {description} warmed in {warmup_capture_s:.2f} s ({compat.get('graph_mode')} graphs)"
    )

    if opts.cost_table is not None:
        table = load_table(
            opts.cost_table, expect=compat, runtime_versions=engine.runtime_versions()
        )
        report.print_reused_table(console, table, opts.cost_table)
        return {
            "status": "reused",
            "cost_table": str(opts.cost_table),
            "calibration": table.calibration.model_dump(mode="json"),
            "compatibility": dict(compat),
            "geometry": geometry.to_dict(),
            "timings": {
                "warmup_capture_s": warmup_capture_s,
                "total_s": time.perf_counter() - t_start,
            },
        }

    flags = dict(opts.flags)
    if opts.request_buckets is not None and not (
        parsed and parsed.calibration.request_buckets is not None
    ):
        # The captured buckets were chosen on the command line: calibrating all of them is the flag's doing.
        flags["request_buckets"] = tuple(geometry.request_buckets)
    cfg = resolve_config(UserConfig.build(parsed, flags), geometry)
    report.print_effective_config(console, cfg, geometry, compat)
    check_feasible(cfg, geometry)
    points = build_grid(cfg)

    header = {
        "config": cfg.to_dict(),
        "geometry": geometry.to_dict(),
        "compatibility": dict(compat),
    }
    device_label = f"{compat['device']['kind']}:{compat['device']['name']}"
    vocab_size = _vocab_size(engine)
    with open_journal(
        opts.journal_path, header, resume=opts.resume, overwrite=opts.overwrite
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
                f"resuming from {opts.journal_path}: {len(journal.rows)} windows already measured"
                + (f" ({'; '.join(notes)})" if notes else "")
            )
        report.print_grid(console, points, cfg, len(journal.rows))
        total_windows = len(points) * cfg.windows_per_point
        with _progress(console, opts.progress) as progress:
            task = progress.add_task(
                "calibrating",
                total=total_windows,
                completed=len(journal.done & _all_windows(points, cfg.windows_per_point)),
                points=sum(
                    all((*p.key, i) in journal.done for i in range(cfg.windows_per_point))
                    for p in points
                ),
                points_total=len(points),
            )

            def on_window(windows_done: int, points_done: int, point) -> None:
                progress.update(
                    task,
                    completed=windows_done,
                    points=points_done,
                    description=f"Bcap={point.bcap} G={point.g} k={point.k}",
                )

            stats = drive(
                engine,
                cfg,
                points,
                journal,
                device=device_label,
                vocab_size=vocab_size,
                on_window=on_window,
            )
            progress.update(task, points=stats.points_done)
        rows = pd.DataFrame(journal.rows)

    t_fit = time.perf_counter()
    versions = engine.runtime_versions()
    table = build_table(
        rows,
        model=cfg.model,
        compatibility=compat,
        calibration={**cfg.to_dict(), "sources": dict(cfg.sources)},
        geometry=geometry,
        provenance=Provenance.now(
            command=_invocation(),
            torch_version=versions["torch_version"],
            driver_version=versions["driver_version"],
        ),
    )
    fit_s = time.perf_counter() - t_fit
    report.print_fit_report(console, table)
    save_table(table, opts.out)  # --out was checked writable before the runner was built
    console.print(f"wrote {opts.out} ({stats.points_done}/{stats.points_total} points)")
    return {
        "status": "calibrated",
        "out": str(opts.out),
        "journal": str(opts.journal_path),
        "points_total": stats.points_total,
        "points_done": stats.points_done,
        "points_resumed": stats.points_skipped,
        "windows": len(rows),
        "windows_measured": stats.windows_measured,
        "journal_duplicates_dropped": journal.dropped_duplicates,
        "rounds": stats.rounds,
        "effective_config": report.effective_config_dict(cfg, geometry, compat),
        "fit": report.fit_summary(table),
        "timings": {
            "warmup_capture_s": warmup_capture_s,
            "transition_s": stats.transition_s,
            "warmup_s": stats.warmup_s,
            "sampling_s": stats.sampling_s,
            "fit_s": fit_s,
            "total_s": time.perf_counter() - t_start,
        },
    }


def _all_windows(points, windows_per_point: int) -> set:
    return {(*p.key, i) for p in points for i in range(windows_per_point)}


def _vocab_size(engine: Any) -> int:
    return int(engine.loaded.config.vocab_size)


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("windows, points {task.fields[points]}/{task.fields[points_total]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
