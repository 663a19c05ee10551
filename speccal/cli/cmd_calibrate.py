"""CLI command ``speccal calibrate``: parse options, call ``speccal.calibrate.pipeline.calibrate``.

Human output (effective configuration, progress, fit report, quality gate) goes to stderr
through Rich (progress as log lines when stderr is not a terminal); ``--json`` prints the summary
on stdout. Domain errors propagate to ``speccal.cli``: exit 2 for bad input, 1 when the quality
gate refuses the table (``speccal.calibrate.gate``). The options are declared in
``speccal.cli.calibrate_options``.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from speccal.base.atomic import read_json
from speccal.base.paths import check_outputs
from speccal.base.rich_tables import make_console
from speccal.cli import calibrate_options as o
from speccal.cli import parse
from speccal.cli.dist import env_rank, is_distributed, run_ranks

_err = make_console()


def _calibrate_ranks(opts, tp: int, dp: int, max_rank_skew_pct: float):
    """``calibrate`` on every rank torchrun started (``speccal.calibrate.ranks``): one table,
    written by rank 0; the summary on rank 0, None on the others."""
    from speccal.calibrate.ranks import calibrate_ranks, rank_engine_factory

    def body(comm, console):
        return calibrate_ranks(opts, comm, engine_factory=rank_engine_factory(comm),
                               max_rank_skew_pct=max_rank_skew_pct, console=console)

    return run_ranks(tp, dp, opts.device, body, _err, command="calibrate")


def _check_outputs(opts, kernels: Path | None) -> None:
    """Refuse a table, journal or lock file that is one of the run's inputs or another output
    (``speccal.base.paths``); a reused table (``--cost-table``) writes nothing."""
    from speccal.calibrate.lock import lock_path  # in the command: the CLI starts without torch

    if opts.cost_table is not None:
        return
    journal = opts.journal_path
    check_outputs(
        [("--out", opts.out), ("--journal", journal),
         ("--out's lock", lock_path(opts.out)), ("--journal's lock", lock_path(journal))],
        [("--config", opts.config_path), ("--kernels", kernels)],
    )


def calibrate_cmd(
    model: o.Model = "tiny",
    device: o.Device = "cpu",
    dtype: o.Dtype = None,
    draft_width: o.DraftWidth = None,
    request_buckets: o.RequestBuckets = None,
    max_model_len: o.MaxModelLen = None,
    config: o.Config = None,
    out: o.Out = Path("speccal-table.json"),
    journal: o.Journal = None,
    resume: o.Resume = False,
    overwrite: o.Overwrite = False,
    drop_bad_windows: o.DropBadWindows = False,
    cost_table: o.CostTable = None,
    mode: o.Mode = None,
    warmup_steps: o.WarmupSteps = None,
    window_steps: o.WindowSteps = None,
    windows_per_point: o.WindowsPerPoint = None,
    min_windows_per_point: o.MinWindowsPerPoint = None,
    early_stop_spread_pct: o.EarlyStopSpreadPct = None,
    kv_spread: o.KVSpread = None,
    graph_mode: o.GraphMode = None,
    attention_backend: o.AttentionBackend = None,
    kernels: o.Kernels = None,
    loop: o.Loop = "pipelined",
    clock: o.Clock = "auto",
    state_strategy: o.StateStrategy = "scratch_swap",
    threads: o.Threads = None,
    max_spread_pct: o.MaxSpreadPct = None,
    remeasure_rounds: o.RemeasureRounds = None,
    max_heldout_pct: o.MaxHeldoutPct = None,
    accept_noisy: o.AcceptNoisy = False,
    tp: o.Tp = 1,
    dp: o.Dp = 1,
    max_rank_skew_pct: o.MaxRankSkewPct = 5.0,
    as_json: o.AsJson = False,
) -> None:
    """Warm the runner, sample the calibration grid, fit and write a cost table.

    On a CPU the defaults are one context interval and 6 windows of 24 rounds (2 warm-up)
    per point, and every round is timed in thread CPU time against a fixed speed probe run
    after it, priced at the run's median probe (the machine's speed drifts by 10-20 % within
    seconds on a shared host; the table records `calibration.timing.clock: cpu_probe`).
    The tiny preset's default CPU calibration takes under a minute.
    """
    from speccal.calibrate.gate import QualityGateError
    from speccal.calibrate.pipeline import CalibrateOptions, calibrate

    opts = CalibrateOptions(
        model=model,
        device=device,
        dtype=dtype,
        draft_width=draft_width,
        request_buckets=parse.calibrate_buckets(request_buckets),
        max_model_len=max_model_len,
        config_path=config,
        out=out,
        journal=journal,
        resume=resume,
        overwrite=overwrite,
        drop_bad_windows=drop_bad_windows,
        cost_table=cost_table,
        graph_mode=graph_mode,
        attention_backend=attention_backend,
        threads=threads,
        max_spread_pct=max_spread_pct,
        max_heldout_pct=max_heldout_pct,
        remeasure_rounds=remeasure_rounds,
        accept_noisy=accept_noisy,
        loop=loop,
        clock=clock,
        state_strategy=state_strategy,
        kernels=None if kernels is None else read_json(kernels, "--kernels"),
        flags={
            "mode": mode,
            "warmup_steps": warmup_steps,
            "window_steps": window_steps,
            "windows_per_point": windows_per_point,
            "min_windows_per_point": min_windows_per_point,
            "early_stop_spread_pct": early_stop_spread_pct,
            "kv_spread": kv_spread,
        },
    )
    _check_outputs(opts, kernels)
    try:
        if is_distributed(tp, dp):
            summary = _calibrate_ranks(opts, tp, dp, max_rank_skew_pct)
            if summary is None:  # ranks other than 0 print nothing
                return
        else:
            summary = calibrate(opts, console=_err)
    except QualityGateError as exc:
        if as_json and env_rank() == 0:  # the refused run's numbers, then the error (exit 1)
            typer.echo(json.dumps(exc.summary, sort_keys=True, allow_nan=False))
        raise
    except KeyboardInterrupt:
        _err.print(
            "[bold red]interrupted[/]: finished windows are in the journal; rerun with --resume"
        )
        raise typer.Exit(130) from None
    if as_json:
        typer.echo(json.dumps(summary, sort_keys=True, allow_nan=False))


def register(app: typer.Typer) -> None:
    """Attach ``calibrate`` to the root app."""
    app.command("calibrate")(calibrate_cmd)
