"""Calibration on every rank of a tensor- x data-parallel run: one table for all of them.

This module owns the distributed calibration run (:func:`calibrate_ranks`) and its pure parts:
the per-rank skew of every grid point (:func:`rank_skew`), the refusal when ranks disagree
beyond a stated bound (:func:`check_rank_skew`, :class:`RankSkewError`), the merge of every
rank's windows into the rows one table is fitted on (:func:`merge_ranks`) and the check that
every rank holds the same table (:func:`table_digest`, :func:`check_same_table`).

Order (each phase ends at an error barrier, ``Comm.agree``, so an error on any rank surfaces on
every rank naming it):

1. rank 0 checks that the outputs can be written, takes their locks and refuses to discard a
   journal with finished windows (unless ``overwrite``); ``resume`` is refused (a resumed run
   would need every rank's journal);
2. every rank builds and warms its engine (``engine_factory``: a ``DistributedEngine``); the
   compatibility is the engine's (``topology = {tp, dp}``) and every rank's device name is
   gathered;
3. the effective configuration, gate and grid are resolved on every rank (the same values);
4. every rank measures every window of the grid (``speccal.calibrate.driver.drive``, its own
   clock); the windows are gathered on every rank after each measuring round, and the noisy
   points to re-measure are chosen from the merged rows, so every rank re-measures the same
   points (TP ranks must run the same rounds); then the KV spread points where the
   configuration asks for them (``kv_spread``, as ``speccal.calibrate.pipeline`` measures them);
5. the per-rank skew of each grid point (the spread of the ranks' median window times,
   ``(max - min) / min``) is reported; beyond ``max_rank_skew_pct`` the run is refused naming
   the ranks and points (:class:`RankSkewError`, exit 1) and no table is written (rank 0 keeps
   the journal of every rank's windows);
6. rank 0 fits one table on the merged rows (each window's slowest rank: a step of a TP replica,
   and a round of a DP deployment, lasts as long as its slowest rank) with the quality gate of
   ``speccal.calibrate.pipeline``, and the spread term on the merged spread windows; the table's
   JSON is broadcast and every rank validates it against its own engine's compatibility (so a
   topology mismatch is refused there) and checks that its SHA-256 equals every other rank's;
   then rank 0 alone writes it.

Only rank 0 prints (``console`` of the others is the caller's to silence) and writes files.
This module imports no torch: the runner comes in through ``engine_factory`` and ``comm``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console

from speccal.base.atomic import check_writable
from speccal.base.errors import InputError, SpeccalError, UnsupportedError
from speccal.calibrate import lock, machine, report
from speccal.calibrate.config import UserConfig, parse_config_file, resolve_config
from speccal.calibrate.driver import drive, loop_of, prompt_fill
from speccal.calibrate.feasibility import check_feasible
from speccal.calibrate.gate import (
    EarlyStop,
    GateConfig,
    QualityGateError,
    held_out,
    points_for_more_windows,
    points_to_remeasure,
    select_windows,
)
from speccal.calibrate.grid import build_grid
from speccal.calibrate.journal import check_discard, open_journal, window_key
from speccal.calibrate.pipeline import (
    CalibrateOptions,
    check_run_values,
    engine_config,
    spread_plan,
)
from speccal.calibrate.timing import loop_timing
from speccal.costmodel.compat import check_compatibility
from speccal.costmodel.spread import fit_spread, split_windows
from speccal.costmodel.table import load_table, parse_table, save_table
from speccal.costmodel.table_build import assemble_table, fit_table
from speccal.costmodel.table_schema import Provenance

#: Default bound on the per-rank skew of a point's median window time, in percent.
DEFAULT_MAX_RANK_SKEW_PCT = 5.0


class RankSkewError(SpeccalError):
    """Ranks measured the same points too differently to share one table (exit 1)."""


@dataclass(frozen=True)
class PointSkew:
    """The per-rank medians of one grid point's window times and their spread.

    ``step_ms[r]``: rank ``r``'s median ``step_ms`` over its windows of the point;
    ``skew_pct = (max - min) / min * 100``; ``slowest`` / ``fastest``: the ranks at the ends.
    """

    key: tuple[int, int, int, int]  # (context_index, bcap, g, k)
    step_ms: tuple[float, ...]
    skew_pct: float
    slowest: int
    fastest: int

    def describe(self) -> str:
        c, b, g, k = self.key
        return (f"point (context {c}, Bcap {b}, G {g}, k {k}): rank {self.slowest} "
                f"{self.step_ms[self.slowest]:.3f} ms vs rank {self.fastest} "
                f"{self.step_ms[self.fastest]:.3f} ms per round (+{self.skew_pct:.1f} %)")

    def to_dict(self) -> dict[str, Any]:
        c, b, g, k = self.key
        return {"context_index": c, "bcap": b, "g": g, "k": k, "step_ms": list(self.step_ms),
                "skew_pct": self.skew_pct, "slowest_rank": self.slowest,
                "fastest_rank": self.fastest}


def _point(row: Mapping[str, Any]) -> tuple[int, int, int, int]:
    return (int(row["context_index"]), int(row["bcap"]), int(row["g"]), int(row["k"]))


def rank_skew(rows_by_rank: Sequence[Sequence[Mapping[str, Any]]]) -> list[PointSkew]:
    """Every point's per-rank skew (:class:`PointSkew`), over the points every rank measured,
    in point order.

    Raises
    ------
    InputError
        A rank without windows of a point another rank measured (ranks must run one grid).
    """
    per_rank: list[dict[tuple, list[float]]] = []
    for rows in rows_by_rank:
        d: dict[tuple, list[float]] = {}
        for row in rows:
            d.setdefault(_point(row), []).append(float(row["step_ms"]))
        per_rank.append(d)
    keys = sorted(set().union(*per_rank)) if per_rank else []
    out = []
    for key in keys:
        missing = [r for r, d in enumerate(per_rank) if key not in d]
        if missing:
            raise InputError(f"windows of point {key}", f"missing on ranks {missing}",
                             "every rank measuring the same grid")
        med = tuple(float(np.median(d[key])) for d in per_rank)
        lo, hi = int(np.argmin(med)), int(np.argmax(med))
        skew = 100.0 * (med[hi] - med[lo]) / med[lo] if med[lo] > 0 else float("inf")
        out.append(PointSkew(key, med, skew, hi, lo))
    return out


def check_rank_skew(skews: Sequence[PointSkew], max_rank_skew_pct: float) -> None:
    """Refuse (:class:`RankSkewError`) when any point's skew exceeds ``max_rank_skew_pct``,
    naming every such point and its slowest and fastest ranks."""
    bad = [s for s in skews if s.skew_pct > max_rank_skew_pct]
    if bad:
        ranks = sorted({s.slowest for s in bad} | {s.fastest for s in bad})
        raise RankSkewError(
            f"rank skew beyond the {max_rank_skew_pct:g} % bound on {len(bad)} of {len(skews)} "
            f"points (ranks {ranks}): " + "; ".join(s.describe() for s in bad)
            + "; no table written: the ranks do not measure the same costs (a slower device or "
            "a busy host); fix the slow rank, or raise --max-rank-skew-pct")


def check_skew_bound(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InputError("max_rank_skew_pct", value, "a positive percentage")


def merge_ranks(rows_by_rank: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per window (point, window index): the slowest rank's (largest ``elapsed_s``),
    in rank 0's window order. The table is fitted on these."""
    best: dict[tuple, dict[str, Any]] = {}
    order: list[tuple] = []
    for rows in rows_by_rank:
        for row in rows:
            key = window_key(row)
            if key not in best:
                order.append(key)
                best[key] = dict(row)
            elif float(row["elapsed_s"]) > float(best[key]["elapsed_s"]):
                best[key] = dict(row)
    return [best[k] for k in order]


def table_digest(text: str) -> str:
    """SHA-256 of a table's canonical JSON (sorted keys, as ``save_table`` writes it)."""
    doc = json.loads(text)
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def check_same_table(digests: Sequence[str]) -> None:
    """Refuse when the ranks' table digests differ, naming the ranks off rank 0's."""
    off = [r for r, d in enumerate(digests) if d != digests[0]]
    if off:
        raise SpeccalError(
            f"table hash differs on ranks {off} from rank 0's ({digests[0][:16]}...): "
            f"{', '.join(f'rank {r} {digests[r][:16]}...' for r in off)}")


class _RankJournal:
    """A rank's windows in memory (``drive`` appends; rank 0 journals every rank's at the end)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    @property
    def done(self) -> set:
        return {window_key(r) for r in self.rows}

    def append(self, row: Mapping[str, Any]) -> None:
        self.rows.append(dict(row))


def topology_record(comm: Any, device_names: Sequence[str]) -> dict[str, Any]:
    """What a run's journal header and summary record of its topology."""
    t = comm.topology
    return {"tp": t.tp, "dp": t.dp, "world_size": t.world_size,
            "devices": [{"rank": r, "name": n} for r, n in enumerate(device_names)]}


def _check_options(opts: CalibrateOptions, max_rank_skew_pct: float) -> None:
    check_skew_bound(max_rank_skew_pct)
    check_run_values(opts)  # --loop, --clock, ... as one rank checks them
    if opts.resume:
        raise UnsupportedError("--resume with more than one rank: a resumed run would need every "
                               "rank's journal; rerun with --overwrite")
    if opts.clock == "cpu_probe":
        # each rank would price its rounds at its own probe; the ranks' windows are compared
        # with each other (max_rank_skew_pct), so several ranks keep the wall clock
        raise UnsupportedError("--clock cpu_probe with more than one rank: the ranks time "
                               "their windows by the wall clock (--clock auto or wall)")
    if opts.cost_table is not None:
        if not opts.cost_table.is_file():
            raise InputError("--cost-table", str(opts.cost_table), "an existing cost table file")
        return
    check_writable(opts.out, "--out")
    check_writable(opts.journal_path, "--journal" if opts.journal is not None else "--out")
    if opts.journal_path.resolve() == opts.out.resolve():
        raise InputError("--journal", str(opts.journal_path), "a path other than --out")


def calibrate_ranks(
    opts: CalibrateOptions,
    comm: Any,
    *,
    engine_factory: Callable[[CalibrateOptions], Any],
    max_rank_skew_pct: float = DEFAULT_MAX_RANK_SKEW_PCT,
    console: Console | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Calibrate on every rank of ``comm`` and write one table (module docstring).

    ``engine_factory(opts)`` builds this rank's engine; ``clock`` times this rank's windows
    (tests give one rank a slower clock to simulate skew). Returns the ``--json`` summary on
    every rank (with ``rank_skew`` per point and ``topology``).

    Raises
    ------
    RankError
        A phase failed on some rank (``speccal.runner.distributed.comm``), naming it.
    RankSkewError
        Ranks disagree beyond ``max_rank_skew_pct`` (no table written).
    QualityGateError
        The fitted table's held-out error is beyond the gate's bound (no table written).
    """
    console = console or Console(stderr=True)
    t_start = time.perf_counter()
    is_root = comm.rank == 0
    held: list[lock.OutputLock] = []

    def prepare() -> None:
        _check_options(opts, max_rank_skew_pct)
        if is_root and opts.cost_table is None:
            for output, name in lock.run_outputs(opts.out, opts.journal_path):
                held.append(lock.acquire(output, name))
            check_discard(opts.journal_path, resume=False, overwrite=opts.overwrite)

    try:
        comm.agree("calibrate: option checks", prepare)
        return _run(opts, comm, engine_factory, max_rank_skew_pct, console, clock, t_start)
    finally:
        for h in reversed(held):
            h.release()


def _run(opts, comm, engine_factory, max_skew, console, clock, t_start) -> dict[str, Any]:
    is_root = comm.rank == 0
    parsed = comm.agree("calibrate: read --config", lambda: (
        parse_config_file(opts.config_path) if opts.config_path is not None else None))
    with machine.pin_threads(opts.device, opts.threads) as threads:
        t0 = time.perf_counter()
        engine = comm.agree("calibrate: build the runner", lambda: engine_factory(opts))
        names = engine.device_names()
        topo = topology_record(comm, names)
        compat = engine.compatibility()
        geometry = engine.geometry
        compile_capture_s = comm.agree("calibrate: warm-up", lambda: time.perf_counter() - t0)
        console.print(
            f"compile/capture {compile_capture_s:.1f} s: runner {engine.description} built and "
            f"warmed on {topo['world_size']} ranks (tp={topo['tp']}, dp={topo['dp']})",
            soft_wrap=True)
        if opts.cost_table is not None:
            table = comm.agree("calibrate: check --cost-table", lambda: load_table(
                opts.cost_table, expect=compat, runtime_versions=engine.runtime_versions()))
            report.print_reused_table(console, table, opts.cost_table)
            return {"status": "reused", "cost_table": str(opts.cost_table),
                    "compatibility": dict(compat), "topology": topo}

        def resolve():
            flags = dict(opts.flags)
            if opts.request_buckets is not None and not (
                    parsed and parsed.calibration.request_buckets is not None):
                flags["request_buckets"] = tuple(geometry.request_buckets)
            kind = str(compat["device"]["kind"])
            cfg = resolve_config(UserConfig.build(parsed, flags), geometry, device_kind=kind)
            gate = GateConfig.resolve(
                kind, max_spread_pct=opts.max_spread_pct,
                max_heldout_pct=opts.max_heldout_pct, remeasure_rounds=opts.remeasure_rounds,
                accept_noisy=opts.accept_noisy)
            check_feasible(cfg, geometry)
            return cfg, gate, build_grid(cfg)

        cfg, gate, points = comm.agree("calibrate: resolve the configuration", resolve)
        report.print_effective_config(console, cfg, geometry, compat, threads, gate)
        report.print_grid(console, points, cfg, 0)
        device_label = f"{compat['device']['kind']}:{compat['device']['name']}"
        vocab = int(engine.vocab_size)
        w = cfg.windows_per_point
        mine = _RankJournal()
        load_before = machine.load_sample(opts.device)

        def measure(due, indices):
            return drive(engine, cfg, due, mine, device=device_label, vocab_size=vocab,
                         window_indices=indices, clock=clock)

        early = EarlyStop.of(cfg, gate)
        first = range(w) if early is None else early.first
        stats = comm.agree("calibrate: measure", lambda: measure(points, first))
        by_rank = comm.all_gather_object(mine.rows)
        if early is not None:  # every rank decides on the same gathered rows
            due = points_for_more_windows(merge_ranks(by_rank), points, early)
            report.print_more_windows(console, early, due, len(points))
            if due:
                more = comm.agree("calibrate: more windows",
                                  lambda due=due: measure(due, early.rest))
                stats = stats.plus(more)
                by_rank = comm.all_gather_object(mine.rows)
        for r in range(1, gate.remeasure_rounds + 1):
            due = points_to_remeasure(merge_ranks(by_rank), points, w, r, gate, early)
            if not due:
                break
            report.print_remeasure(console, r, gate, due)
            more = comm.agree(f"calibrate: re-measure {r}",
                              lambda due=due, r=r: measure(due, range(r * w, (r + 1) * w)))
            stats = stats.plus(more)
            by_rank = comm.all_gather_object(mine.rows)
        # the KV spread term's points (speccal.costmodel.spread), as one rank measures them:
        # after the grid, every context that can spread, one pass of the first windows
        extra = spread_plan(cfg, geometry)
        if extra:
            more = comm.agree("calibrate: KV spread", lambda: measure(extra, first))
            stats = stats.plus(more)
            by_rank = comm.all_gather_object(mine.rows)
        load_after = machine.load_sample(opts.device)

    # the rank skew judges the grid's points (the spread points only price the spread term)
    skews = rank_skew([split_windows(rows)[0] for rows in by_rank])
    skew_max = max((s.skew_pct for s in skews), default=0.0)
    console.print(f"rank skew: largest {skew_max:.1f} % over {len(skews)} points on "
                  f"{comm.world_size} ranks (bound {max_skew:g} %)", soft_wrap=True)
    for s in skews:
        console.print(f"  {s.describe()}", soft_wrap=True, highlight=False)
    header = {"config": cfg.to_dict(), "geometry": geometry.to_dict(),
              "compatibility": dict(compat),
              "measurement": {"threads": threads.threads, "topology": topo,
                              "windows": "replicates"}}
    if is_root:  # every rank's windows, each tagged with its rank
        with open_journal(opts.journal_path, header, resume=False, overwrite=True) as journal:
            for rank, rows in enumerate(by_rank):
                for row in rows:
                    journal.append({**row, "rank": rank})
    check_rank_skew(skews, max_skew)  # the same verdict on every rank (same gathered rows)

    merged = merge_ranks(by_rank)
    selection = select_windows(merged, points, w, gate, early)
    versions = engine.runtime_versions()
    timings = {"compile_capture_s": compile_capture_s, "transition_s": stats.transition_s,
               "warmup_s": stats.warmup_s, "sampling_s": stats.sampling_s}

    def fit() -> tuple[str, dict[str, Any]]:
        parts = fit_table(
            pd.DataFrame(selection.rows), model=cfg.model, compatibility=compat,
            calibration={**cfg.to_dict(), "sources": {**cfg.sources, "threads": threads.source},
                         "threads": threads.threads,
                         "timing": loop_timing(selection.rows, loop_of(engine)),
                         "prompts": prompt_fill(engine)},
            geometry=geometry,
            provenance=Provenance.now(command=_command(comm.world_size), timings=timings,
                                      torch_version=versions["torch_version"],
                                      driver_version=versions["driver_version"]))
        held = held_out(parts)
        passed = held.passes(gate)
        quality = {
            **report.gate_dict(gate), "model": parts.model, "heldout_pct": held.pct,
            "window_spread_pct_max": selection.spread_max_pct, "passed": passed,
            "override_used": not passed and gate.accept_noisy,
            "flagged_points": [q.to_dict() for q in selection.flagged],
            "remeasured_windows": sum(int(r["window_index"]) >= w for r in merged),
            "load": machine.load_record(opts.device, load_before, load_after),
            "sources": dict(gate.sources),
        }
        spread_rows = split_windows(merged)[1]
        spread = fit_spread(selection.rows, spread_rows) if spread_rows else None
        # built once, with its quality and spread term
        table = assemble_table(parts, quality=quality, kv_spread=spread)
        report.print_fit_report(console, table)
        report.print_kv_spread(console, table)
        report.print_gate(console, quality, selection, held)
        return json.dumps(table.to_json_dict(), sort_keys=True, allow_nan=False), quality

    fitted = comm.agree("calibrate: fit", fit if is_root else lambda: None)
    text, quality = comm.broadcast_object(fitted)
    summary = {
        "status": "calibrated", "out": str(opts.out), "journal": str(opts.journal_path),
        "points_total": stats.points_total, "windows": len(selection.rows),
        "windows_measured": stats.windows_measured, "rounds": stats.rounds,
        "topology": topo, "rank_skew": [s.to_dict() for s in skews],
        "max_rank_skew_pct": max_skew, "quality": quality,
        "timings": {**timings, "total_s": time.perf_counter() - t_start},
    }
    if not quality["passed"] and not gate.accept_noisy:
        summary.update(status="refused", out=None)
        raise QualityGateError(
            f"quality gate: held-out error {quality['heldout_pct']:.1f} % is beyond the "
            f"{gate.max_heldout_pct:g} % bound, so {opts.out} was not written; the journal "
            f"{opts.journal_path} keeps every rank's windows", summary=summary)

    def verify() -> str:  # every rank: the same table, valid for its own engine
        parse_table(text, source="the table rank 0 fitted")
        own = dict(engine.compatibility())
        load_check(text, own)
        return table_digest(text)

    digests = comm.all_gather_object(comm.agree("calibrate: check the table", verify))
    check_same_table(digests)
    if is_root:
        save_table(parse_table(text, source="the table rank 0 fitted"), opts.out)
        console.print(f"wrote {opts.out} ({stats.points_done}/{stats.points_total} points, "
                      f"table sha256 {digests[0][:16]}..., the same on {len(digests)} ranks)")
    summary["table_sha256"] = digests[0]
    return summary


def _command(world_size: int) -> str | None:
    """The launch that made the table: ``torchrun ... -m speccal calibrate ...``."""
    if not sys.argv or Path(sys.argv[0]).name not in ("speccal", "__main__.py"):
        return None
    return " ".join(["torchrun", "--nproc-per-node", str(world_size), "-m", "speccal",
                     *sys.argv[1:]])


def load_check(text: str, expect: Mapping[str, Any]) -> None:
    """Refuse a table's compatibility against ``expect`` (semantic fields, topology among them),
    as loading it from disk would."""
    check_compatibility(expect, parse_table(text, source="table").compatibility)


def rank_engine_factory(comm: Any) -> Callable[[CalibrateOptions], Any]:
    """``engine_factory`` of :func:`calibrate_ranks`: this rank's warmed ``DistributedEngine``
    for ``opts`` (forced acceptance, as ``speccal.calibrate.pipeline.make_engine``), on
    ``cuda:LOCAL_RANK`` for ``--device cuda``. Under TP > 1 the path defaults to eager graphs
    and the torch backend (the only TP path; an explicit other one is refused by the engine).

    The runner is imported when the factory runs, so that this module stays torch-free.
    """

    def make(opts: CalibrateOptions) -> Any:
        try:
            from speccal.runner.distributed.comm import rank_device
            from speccal.runner.distributed.engine import DistributedEngine
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] != "torch":
                raise
            raise UnsupportedError(machine.TORCH_MISSING) from None
        # the same options -> EngineConfig conversion as one rank (it dropped the state
        # strategy and the calibration prefill chunk when it was a copy)
        cfg = engine_config(opts, device=rank_device(opts.device, comm), tp=comm.tp_size)
        return DistributedEngine(cfg, comm)

    return make
