"""CLI command ``speccal calibrate``: parse options, call ``speccal.calibrate.pipeline.calibrate``.

Human output (effective configuration, progress, fit report, quality gate) goes to stderr
through Rich (progress as log lines when stderr is not a terminal); ``--json`` prints the summary
on stdout. Domain errors propagate to ``speccal.cli``: exit 2 for bad input, 1 when the quality
gate refuses the table (``speccal.calibrate.gate``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from speccal.base.atomic import read_json
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.base.rich_tables import make_console
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


def _buckets(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        out = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise InputError(
            "--request-buckets", text, "comma-separated integers, e.g. 1,2,4,8"
        ) from None
    if not out:
        raise InputError("--request-buckets", text, "at least one bucket")
    return out


def register(app: typer.Typer) -> None:
    """Attach ``calibrate`` to the root app."""

    @app.command("calibrate")
    def calibrate_cmd(
        model: Annotated[
            str, typer.Option("--model", help="Runner preset name or checkpoint folder.")
        ] = "tiny",
        device: Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N or npu.")] = "cpu",
        dtype: Annotated[
            str | None,
            typer.Option("--dtype", help="float32, bfloat16 or float16 (runner default if unset)."),
        ] = None,
        draft_width: Annotated[
            int | None,
            typer.Option(
                "--draft-width",
                help="num_speculative_tokens w of the run (runner default if unset).",
            ),
        ] = None,
        request_buckets: Annotated[
            str | None,
            typer.Option(
                "--request-buckets",
                help="Captured request buckets of the run, e.g. 1,2,4,8; calibration samples them unless "
                "the config names a subset.",
            ),
        ] = None,
        max_model_len: Annotated[
            int | None,
            typer.Option(
                "--max-model-len", help="Model context of the run (runner default if unset)."
            ),
        ] = None,
        config: Annotated[
            Path | None,
            typer.Option(
                "--config", help='Calibration JSON, every key optional: model, draft_width, request_buckets, target_graph_rows, contexts [{prefill_tokens, min_kv_length, max_kv_length}], warmup_steps, window_steps, windows_per_point, min_windows_per_point, early_stop_spread_pct, token_seed; or those keys under "calibration" next to "policy" {window_size, update_interval, switch_min_gain} (the adaptive-draft-step file: the two config shapes of the xLLM engine).'
            ),
        ] = None,
        out: Annotated[
            Path,
            typer.Option(
                "--out",
                help="Cost table to write (atomically, at the end); OUT.lock marks the run "
                "in progress, so a second run on the same --out is refused.",
            ),
        ] = Path("speccal-table.json"),
        journal: Annotated[
            Path | None,
            typer.Option("--journal", help="Window journal (default: OUT.journal.jsonl)."),
        ] = None,
        resume: Annotated[
            bool, typer.Option("--resume", help="Skip windows already in the journal.")
        ] = False,
        overwrite: Annotated[
            bool,
            typer.Option(
                "--overwrite",
                help="Discard the finished windows of an existing journal and start afresh "
                "(without it, or --resume, such a journal is refused).",
            ),
        ] = False,
        drop_bad_windows: Annotated[
            bool,
            typer.Option(
                "--drop-bad-windows",
                help="With --resume: drop invalid window lines of the journal (named in a "
                "warning) and measure those windows again, instead of refusing the journal.",
            ),
        ] = False,
        cost_table: Annotated[
            Path | None,
            typer.Option(
                "--cost-table",
                help="Reuse a saved table: validate it against this run, skip sampling.",
            ),
        ] = None,
        mode: Annotated[
            str | None,
            typer.Option(
                "--mode",
                help="target_verify (trimmed verify budgets at full draft width) or draft_step (one point "
                "set per k). Default: draft_step for the adaptive-draft-step file shape, else target_verify.",
            ),
        ] = None,
        warmup_steps: Annotated[
            int | None, typer.Option("--warmup-steps", help="Override warmup_steps.")
        ] = None,
        window_steps: Annotated[
            int | None, typer.Option("--window-steps", help="Override window_steps.")
        ] = None,
        windows_per_point: Annotated[
            int | None, typer.Option("--windows-per-point", help="Override windows_per_point.")
        ] = None,
        min_windows_per_point: Annotated[
            int | None,
            typer.Option(
                "--min-windows-per-point",
                help="Adaptive window count: every point gets this many windows (2 or more), "
                "and only a point whose windows spread more than --early-stop-spread-pct gets "
                "the rest of --windows-per-point. Default: 2 on cuda, off elsewhere; "
                "--windows-per-point itself turns it off.",
            ),
        ] = None,
        early_stop_spread_pct: Annotated[
            float | None,
            typer.Option(
                "--early-stop-spread-pct",
                help="A point whose first windows spread ((max - min) / median) at most this "
                "many % keeps them (capped by --max-spread-pct). Default: 1 on cuda; with "
                "--min-windows-per-point elsewhere, the gate's --max-spread-pct.",
            ),
        ] = None,
        graph_mode: Annotated[
            str | None,
            typer.Option(
                "--graph-mode",
                help="eager or split (captured CUDA/NPU round graphs). Default: split on cuda/npu, "
                "eager on cpu: calibrate the execution path you serve with.",
            ),
        ] = None,
        attention_backend: Annotated[
            str | None,
            typer.Option(
                "--attention-backend",
                help="torch (reference) or triton (speccal.kernels). Default: triton on cuda, "
                "torch elsewhere.",
            ),
        ] = None,
        kernels: Annotated[
            Path | None,
            typer.Option(
                "--kernels",
                help="Kernel configuration JSON (the object a table records under "
                "compatibility.kernels.config, e.g. from `speccal table show --json`; every "
                "group optional). Default: the built-in configuration.",
            ),
        ] = None,
        loop: Annotated[
            str,
            typer.Option(
                "--loop",
                help="Round loop of the calibrating engine: pipelined (round n + 1 queued while n "
                "runs, what a deployment serves with; a round costs about its device time) or "
                "synchronous (host and device work in series). Recorded in the table.",
            ),
        ] = "pipelined",
        clock: Annotated[
            str,
            typer.Option(
                "--clock",
                help="How windows are timed: auto (cpu_probe on cpu, wall elsewhere), wall "
                "(wall time between synced edges) or cpu_probe (each round's thread CPU time "
                "over a speed probe's, priced at the run's median probe: a shared CPU's speed "
                "drifts). Recorded in the table.",
            ),
        ] = "auto",
        state_strategy: Annotated[
            str,
            typer.Option(
                "--state-strategy",
                help="Hybrid (linear-attention) targets: how the recurrent state survives "
                "rejected drafts: scratch_swap (verify writes a scratch row; full acceptance "
                "swaps, partial acceptance replays the accepted prefix) or snapshots (the state "
                "after every draft position; acceptance picks one). Recorded in the table; "
                "ignored by full-attention targets.",
            ),
        ] = "scratch_swap",
        threads: Annotated[
            int | None,
            typer.Option(
                "--threads",
                help="torch intra-op threads while measuring (recorded in the table). Default: 1 "
                "on cpu (default threads made identical CPU runs 3-295 ms apart on a busy "
                "2-core machine), torch's own count on cuda/npu.",
            ),
        ] = None,
        max_spread_pct: Annotated[
            float | None,
            typer.Option(
                "--max-spread-pct",
                help="Quality gate: a point whose windows spread more than this "
                "((max - min) / median, %) is re-measured. Default: 10 on cpu, 3 on cuda/npu.",
            ),
        ] = None,
        remeasure_rounds: Annotated[
            int | None,
            typer.Option(
                "--remeasure-rounds",
                help="Quality gate: extra rounds of windows a noisy point gets, at most "
                "(0-5; default 2). The fit pools every round of a point (median of its windows).",
            ),
        ] = None,
        max_heldout_pct: Annotated[
            float | None,
            typer.Option(
                "--max-heldout-pct",
                help="Quality gate: no table is written when its leave-one-point-out mean error "
                "exceeds this (%). Default: 10 on cpu, 5 on cuda/npu.",
            ),
        ] = None,
        accept_noisy: Annotated[
            bool,
            typer.Option(
                "--accept-noisy",
                help="Write the table even beyond --max-heldout-pct (the table records the "
                "override); with --resume, without measuring again.",
            ),
        ] = False,
        tp: Annotated[
            int,
            typer.Option(
                "--tp",
                help="Tensor-parallel ranks per model replica (launch with torchrun "
                "--nproc-per-node TP*DP -m speccal calibrate ...). Recorded in the table.",
            ),
        ] = 1,
        dp: Annotated[
            int,
            typer.Option(
                "--dp",
                help="Data-parallel replicas, each measuring its own windows. Recorded in the "
                "table.",
            ),
        ] = 1,
        max_rank_skew_pct: Annotated[
            float,
            typer.Option(
                "--max-rank-skew-pct",
                help="Several ranks: no table is written when the ranks' median window times "
                "of a point differ by more than this ((max - min) / min, %).",
            ),
        ] = 5.0,
        as_json: Annotated[
            bool, typer.Option("--json", help="Print the summary as JSON on stdout.")
        ] = False,
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
            request_buckets=_buckets(request_buckets),
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
