"""CLI command ``speccal bench``: speculative vs plain decoding, or live policies, in one process.

``bench`` compares speculative and plain decoding of the same random prompts
(``speccal.live.bench.bench``: tokens/s, TPOT, acceptance rate, mean accepted length, speed-up).
``bench --policy P`` (repeatable or comma list: ``fixed:K``, ``adaptive-step``,
``adaptive-verify``; the two adaptive modes together are refused before anything runs) instead
runs the same workload live under each policy (``speccal.live.bench.run_policy_bench``) with
``--cost-table`` (loaded against the engine's compatibility; required by adaptive policies),
reports tokens/s, TPOT, acceptance, decisions, gain over the best fixed ``k`` and the replay
prediction of each run from its own trace; ``--trace-out`` writes the run traces.
``bench --policy ... --repeats N`` runs each policy ``N`` times on the same workload in an
interleaved order (round-robin, rotated each cycle: A B C, B C A, C A B, ...;
``speccal.live.policies.interleaved_order``) and reports per policy the median tokens/s with its
min-max spread, the median replay error and the gain over the best fixed ``k`` from medians;
``--json`` adds ``repeats``, ``order`` and ``run_log`` (per-run cycle, position, UTC start/end).
``N = 1`` (the ``--policy`` default) is one run per policy, output as before.
Under ``torchrun`` it takes ``--tp``/``--dp`` (``speccal.cli.dist.run_ranks``): every rank runs
both sides, rank 0 alone prints the tokens/s of the whole world, titled with the number of
ranks; ``bench --policy`` stays on one rank. Printing is ``speccal.cli.render_run``. The command
parses options into a config (``speccal.runner.engine.EngineConfig``,
``speccal.live.bench.PolicyBenchConfig``), calls the library and prints; ``speccal.live`` is
imported inside the command (torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from speccal.base.atomic import check_writable, nan_to_none
from speccal.base.errors import InputError
from speccal.base.paths import check_outputs
from speccal.cli import options as o
from speccal.cli import parse
from speccal.cli.dist import is_distributed, run_ranks
from speccal.cli.options import check_replica_k, engine_config
from speccal.cli.render_run import err_console, print_bench, print_policy_bench, status_bar


def bench(
    model: o.Model = "tiny",
    device: o.Device = "cpu",
    graph_mode: o.GraphMode = None,
    attention_backend: o.Attention = None,
    loop: o.Loop = "pipelined",
    state_strategy: o.StateStrategy = "scratch_swap",
    tp: o.Tp = 1,
    dp: o.Dp = 1,
    dtype: o.Dtype = None,
    draft_width: o.DraftWidth = 3,
    k: o.K = None,
    acceptance: Annotated[
        str,
        typer.Option(
            "--acceptance",
            help="greedy (lossless), synthetic (accepted lengths drawn from "
            "--acceptance-profile) or forced (every draft accepted).",
        ),
    ] = "greedy",
    profile: o.Profile = None,
    score_informativeness: o.ScoreInformativeness = 0.0,
    num_requests: Annotated[
        int, typer.Option("--num-requests", help="Requests decoded together, 1..256.")
    ] = 4,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Random prompt length.")] = 32,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Tokens generated per request.")
    ] = 64,
    repeats: Annotated[
        int | None,
        typer.Option(
            "--repeats",
            help="Timed runs per side (median reported); with --policy, runs per policy, "
            "interleaved in a rotated round-robin. Default: 3, or 1 with --policy.",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Prompt / weight seed; --policy runs: run c of every policy draws acceptance from seed + c.")] = 0,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            help="Run live under policies instead of spec vs plain: fixed:K, adaptive-step, "
            "adaptive-verify (repeatable or comma list).",
            show_default=False,
        ),
    ] = None,
    cost_table: Annotated[
        Path | None,
        typer.Option(
            "--cost-table",
            help="Cost table for --policy (checked against the engine); adaptive policies need one.",
            show_default=False,
        ),
    ] = None,
    phase: Annotated[
        list[str] | None,
        typer.Option(
            "--phase",
            help="With --policy and synthetic acceptance: 'FRACTION:p1,..,pw' switches the profile "
            "once that fraction of the workload's tokens is out (repeatable).",
            show_default=False,
        ),
    ] = None,
    request_buckets: Annotated[
        str | None,
        typer.Option(
            "--request-buckets",
            help="Captured request buckets, e.g. 1,2,4,8 (default: the device's served set, "
            "as speccal calibrate: 1..64 in powers of two on cuda/npu, 1,2,4,8 on cpu).",
            show_default=False,
        ),
    ] = None,
    trace_out: Annotated[
        Path | None,
        typer.Option(
            "--trace-out",
            help="With --policy: write each run's round trace (.jsonl/.parquet; several "
            "policies add '.<policy>' before the suffix).",
            show_default=False,
        ),
    ] = None,
    as_json: o.Json = False,
) -> None:
    """Speculative vs plain decoding in one process: tokens/s, TPOT, acceptance, speed-up.

    With --policy: the same workload live under each policy (one engine), with the replay
    prediction of every run from its own trace. Under torchrun with --tp/--dp: every rank runs
    both sides; rank 0 reports the whole world's tokens/s."""
    # lazy: these import torch; the CLI starts (and reports a missing torch) without it
    from speccal.live.bench import PolicyBenchConfig, run_policy_bench, trace_outputs
    from speccal.live.bench import bench as run_bench
    from speccal.live.policies import Phase

    if not policy:
        for name, given in (("--cost-table", cost_table), ("--phase", phase),
                            ("--trace-out", trace_out), ("--request-buckets", request_buckets)):
            if given:
                raise InputError(name, str(given), "only together with --policy")
    if trace_out is not None:
        check_writable(trace_out, "--trace-out")  # before the runs, not after them
    cfg = engine_config(
        model, device, dtype, draft_width, acceptance, profile, seed, None, True,
        parse.bench_buckets(request_buckets), graph_mode=graph_mode,
        attention_backend=attention_backend, loop=loop, state_strategy=state_strategy,
        score_informativeness=score_informativeness,
    )
    workload = {"num_requests": num_requests, "prompt_len": prompt_len, "max_tokens": max_tokens}
    if policy and not is_distributed(tp, dp):
        config = PolicyBenchConfig(
            engine=cfg, policies=parse.policies(policy), cost_table=cost_table,
            phases=tuple(Phase(*parse.phase(v)) for v in phase or ()), seed=seed,
            repeats=1 if repeats is None else repeats, trace_out=trace_out, **workload,
        )
        check_outputs([("--trace-out", p) for p in trace_outputs(config)],
                      [("--cost-table", cost_table)])
        with status_bar() as report:
            doc = run_policy_bench(config, on_progress=report)
        doc.pop("runs")  # the TimedRun objects (not JSON)
        print_policy_bench(nan_to_none(doc), model, as_json)
        return
    if is_distributed(tp, dp):
        if policy:
            raise InputError("--policy", ",".join(policy),
                             "unset with --tp/--dp (live policy benches run on one rank)")
        check_replica_k(k, dp)

    def body(comm, console: Console | None = None) -> dict:
        with status_bar(console) as report:
            return run_bench(cfg, num_draft_steps=k if k is not None else draft_width,
                             repeats=3 if repeats is None else repeats, seed=seed,
                             on_progress=report, comm=comm, **workload)

    res = (run_ranks(tp, dp, device, body, err_console, command="bench")
           if is_distributed(tp, dp) else body(None))
    if res is not None:  # rank 0 prints
        print_bench(nan_to_none(res), model, as_json)


def register(app: typer.Typer) -> None:
    """Attach ``speccal bench`` to the root app."""
    app.command("bench")(bench)
