"""The options of ``speccal calibrate`` (``cmd_calibrate``), one ``Annotated`` type each: its
flag and help. Grouped as the help reads: the run (model, device, widths, buckets), the config
and outputs, the window counts, the execution path, the quality gate, the ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speccal.cli.options import Device, Dtype, Model  # noqa: F401 (the runner's own)

DraftWidth = Annotated[
    int | None,
    typer.Option(
        "--draft-width",
        help="num_speculative_tokens w of the run (runner default if unset).",
    ),
]

RequestBuckets = Annotated[
    str | None,
    typer.Option(
        "--request-buckets",
        help="Captured request buckets of the run, e.g. 1,2,4,8; calibration samples them unless "
        "the config names a subset.",
    ),
]

MaxModelLen = Annotated[
    int | None,
    typer.Option(
        "--max-model-len", help="Model context of the run (runner default if unset)."
    ),
]

Config = Annotated[
    Path | None,
    typer.Option(
        "--config", help='Calibration JSON, every key optional: model, draft_width, request_buckets, target_graph_rows, contexts [{prefill_tokens, min_kv_length, max_kv_length}], warmup_steps, window_steps, windows_per_point, min_windows_per_point, early_stop_spread_pct, kv_spread, token_seed; or those keys under "calibration" next to "policy" {window_size, update_interval, switch_min_gain} (the adaptive-draft-step file: the two config shapes of the xLLM engine).'
    ),
]

Out = Annotated[
    Path,
    typer.Option(
        "--out",
        help="Cost table to write (atomically, at the end); OUT.lock marks the run "
        "in progress, so a second run on the same --out is refused.",
    ),
]

Journal = Annotated[
    Path | None,
    typer.Option("--journal", help="Window journal (default: OUT.journal.jsonl)."),
]

Resume = Annotated[
    bool, typer.Option("--resume", help="Skip windows already in the journal.")
]

Overwrite = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Discard the finished windows of an existing journal and start afresh "
        "(without it, or --resume, such a journal is refused).",
    ),
]

DropBadWindows = Annotated[
    bool,
    typer.Option(
        "--drop-bad-windows",
        help="With --resume: drop invalid window lines of the journal (named in a "
        "warning) and measure those windows again, instead of refusing the journal.",
    ),
]

CostTable = Annotated[
    Path | None,
    typer.Option(
        "--cost-table",
        help="Reuse a saved table: validate it against this run, skip sampling.",
    ),
]

Mode = Annotated[
    str | None,
    typer.Option(
        "--mode",
        help="target_verify (trimmed verify budgets at full draft width) or draft_step (one point "
        "set per k). Default: draft_step for the adaptive-draft-step file shape, else target_verify.",
    ),
]

WarmupSteps = Annotated[
    int | None, typer.Option("--warmup-steps", help="Override warmup_steps.")
]

WindowSteps = Annotated[
    int | None, typer.Option("--window-steps", help="Override window_steps.")
]

WindowsPerPoint = Annotated[
    int | None, typer.Option("--windows-per-point", help="Override windows_per_point.")
]

MinWindowsPerPoint = Annotated[
    int | None,
    typer.Option(
        "--min-windows-per-point",
        help="Adaptive window count: every point gets this many windows (2 or more), "
        "and only a point whose windows spread more than --early-stop-spread-pct gets "
        "the rest of --windows-per-point. Default: 2 on cuda, off elsewhere; "
        "--windows-per-point itself turns it off.",
    ),
]

EarlyStopSpreadPct = Annotated[
    float | None,
    typer.Option(
        "--early-stop-spread-pct",
        help="A point whose first windows spread ((max - min) / median) at most this "
        "many % keeps them (capped by --max-spread-pct). Default: 1 on cuda; with "
        "--min-windows-per-point elsewhere, the gate's --max-spread-pct.",
    ),
]

KVSpread = Annotated[
    bool | None,
    typer.Option(
        "--kv-spread/--no-kv-spread",
        help="After the grid, measure one spread point per request bucket (half the requests "
        "short, half long, at a calibrated point's mean KV) so the table prices a batch whose "
        "KV lengths spread (its kv_spread term). Default: on on cuda, off elsewhere.",
        show_default=False,
    ),
]

GraphMode = Annotated[
    str | None,
    typer.Option(
        "--graph-mode",
        help="eager or split (captured CUDA/NPU round graphs). Default: split on cuda/npu, "
        "eager on cpu: calibrate the execution path you serve with.",
    ),
]

AttentionBackend = Annotated[
    str | None,
    typer.Option(
        "--attention-backend",
        help="torch (reference) or triton (speccal.kernels). Default: triton on cuda, "
        "torch elsewhere.",
    ),
]

Kernels = Annotated[
    Path | None,
    typer.Option(
        "--kernels",
        help="Kernel configuration JSON (the object a table records under "
        "compatibility.kernels.config, e.g. from `speccal table show --json`; every "
        "group optional). Default: the built-in configuration.",
    ),
]

Loop = Annotated[
    str,
    typer.Option(
        "--loop",
        help="Round loop of the calibrating engine: pipelined (round n + 1 queued while n "
        "runs, what a deployment serves with; a round costs about its device time) or "
        "synchronous (host and device work in series). Recorded in the table.",
    ),
]

Clock = Annotated[
    str,
    typer.Option(
        "--clock",
        help="How windows are timed: auto (cpu_probe on cpu, wall elsewhere), wall "
        "(wall time between synced edges) or cpu_probe (each round's thread CPU time "
        "over a speed probe's, priced at the run's median probe: a shared CPU's speed "
        "drifts). Recorded in the table.",
    ),
]

StateStrategy = Annotated[
    str,
    typer.Option(
        "--state-strategy",
        help="Hybrid (linear-attention) targets: how the recurrent state survives "
        "rejected drafts: scratch_swap (verify writes a scratch row; full acceptance "
        "swaps, partial acceptance replays the accepted prefix) or snapshots (the state "
        "after every draft position; acceptance picks one). Recorded in the table; "
        "ignored by full-attention targets.",
    ),
]

Threads = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="torch intra-op threads while measuring (recorded in the table). Default: 1 "
        "on cpu (default threads made identical CPU runs 3-295 ms apart on a busy "
        "2-core machine), torch's own count on cuda/npu.",
    ),
]

MaxSpreadPct = Annotated[
    float | None,
    typer.Option(
        "--max-spread-pct",
        help="Quality gate: a point whose windows spread more than this "
        "((max - min) / median, %) is re-measured. Default: 10 on cpu, 3 on cuda/npu.",
    ),
]

RemeasureRounds = Annotated[
    int | None,
    typer.Option(
        "--remeasure-rounds",
        help="Quality gate: extra rounds of windows a noisy point gets, at most "
        "(0-5; default 2). The fit pools every round of a point (median of its windows).",
    ),
]

MaxHeldoutPct = Annotated[
    float | None,
    typer.Option(
        "--max-heldout-pct",
        help="Quality gate: no table is written when its leave-one-point-out mean error "
        "exceeds this (%). Default: 10 on cpu, 5 on cuda/npu.",
    ),
]

AcceptNoisy = Annotated[
    bool,
    typer.Option(
        "--accept-noisy",
        help="Write the table even beyond --max-heldout-pct (the table records the "
        "override); with --resume, without measuring again.",
    ),
]

Tp = Annotated[
    int,
    typer.Option(
        "--tp",
        help="Tensor-parallel ranks per model replica (launch with torchrun "
        "--nproc-per-node TP*DP -m speccal calibrate ...). Recorded in the table.",
    ),
]

Dp = Annotated[
    int,
    typer.Option(
        "--dp",
        help="Data-parallel replicas, each measuring its own windows. Recorded in the "
        "table.",
    ),
]

MaxRankSkewPct = Annotated[
    float,
    typer.Option(
        "--max-rank-skew-pct",
        help="Several ranks: no table is written when the ranks' median window times "
        "of a point differ by more than this ((max - min) / min, %).",
    ),
]

AsJson = Annotated[
    bool, typer.Option("--json", help="Print the summary as JSON on stdout.")
]
