"""CLI commands ``speccal generate`` and ``speccal bench`` (the embedded runner).

``generate`` runs prompts (token ids, or text when the checkpoint folder has a tokenizer) through
the speculative engine and prints the generated ids (and text); ``bench`` compares speculative
and plain decoding of the same random prompts in one process (tokens/s, TPOT, acceptance rate,
mean accepted length, speed-up). ``bench --policy P`` (repeatable or comma list: ``fixed:K``,
``adaptive-step``, ``adaptive-verify``; the two adaptive modes together are refused before
anything runs) instead runs the same workload live under each policy (``speccal.live.policies``)
with ``--cost-table`` (loaded against the engine's compatibility; required by adaptive
policies), reports tokens/s, TPOT, acceptance, decisions, gain over the best fixed ``k`` and the
replay prediction of each run from its own trace; ``--trace-out`` writes the run traces.
``bench --policy ... --repeats N`` runs each policy ``N`` times on the same workload in an
interleaved order (round-robin, rotated each cycle: A B C, B C A, C A B, ...;
``speccal.live.policies.interleaved_order``) and reports per policy the median tokens/s with its
min-max spread, the median replay error and the gain over the best fixed ``k`` from medians;
``--json`` adds ``repeats``, ``order`` and ``run_log`` (per-run cycle, position, UTC start/end).
``N = 1`` (the ``--policy`` default) is one run per policy, output as before.
Human output goes to stderr through Rich, ``--json`` to stdout. Random-weight presets are
labelled as such in both outputs.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from speccal.base.errors import InputError

err_console = Console(stderr=True)


def _parse_ids(text: str, field: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise InputError(field, text, "comma- or space-separated integer token ids") from None
    if not ids:
        raise InputError(field, text, "at least one token id")
    return ids


def _parse_floats(text: str | None, field: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise InputError(field, text, "comma-separated probabilities") from None


DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)

# Options shared by ``generate`` and ``bench``.
ModelOpt = Annotated[
    str, typer.Option("--model", help="Preset (tiny, dense-0.5b, dense-2b, mimo-7b) or HF folder.")
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda[:N] or npu[:N].")]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="float32, bfloat16 or float16. Default: float32 on CPU, else bfloat16.",
        show_default=False,
    ),
]
DraftWidthOpt = Annotated[int, typer.Option("--draft-width", help="Draft width w.")]
KOpt = Annotated[
    int | None,
    typer.Option("--k", help="Draft steps per round (1..w). Default: w.", show_default=False),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--acceptance-profile",
        "--profile",
        help="Synthetic acceptance profile, w comma-separated values (as in `speccal trace`).",
        show_default=False,
    ),
]
GraphModeOpt = Annotated[
    str | None,
    typer.Option(
        "--graph-mode",
        help="eager or split (captured CUDA/NPU round graphs). Default: split on cuda/npu, "
        "eager on cpu.",
        show_default=False,
    ),
]
AttentionOpt = Annotated[
    str | None,
    typer.Option(
        "--attention-backend",
        help="torch or triton. Default: triton on cuda, torch elsewhere.",
        show_default=False,
    ),
]


def _engine_config(
    model,
    device,
    dtype,
    draft_width,
    acceptance,
    profile,
    seed,
    max_model_len,
    speculative,
    request_buckets=DEFAULT_BUCKETS,
    graph_mode=None,
    attention_backend=None,
):
    from speccal.runner.device import default_execution_path
    from speccal.runner.engine import EngineConfig

    default_graph, default_attention = default_execution_path(device)
    return EngineConfig(
        graph_mode=graph_mode or default_graph,
        attention_backend=attention_backend or default_attention,
        model=model,
        device=device,
        dtype=dtype,
        draft_width=draft_width,
        request_buckets=tuple(request_buckets),
        acceptance=acceptance,
        acceptance_profile=_parse_floats(profile, "--acceptance-profile"),
        seed=seed,
        max_model_len=max_model_len,
        speculative=speculative,
    )


def generate(
    prompt_ids: Annotated[
        list[str] | None,
        typer.Option(
            "--prompt-ids",
            help="Prompt token ids, e.g. '1,2,3'; repeat for a batch.",
            show_default=False,
        ),
    ] = None,
    prompt: Annotated[
        list[str] | None,
        typer.Option(
            "--prompt",
            help="Prompt text (needs a checkpoint folder with a tokenizer); repeatable.",
            show_default=False,
        ),
    ] = None,
    model: ModelOpt = "tiny",
    device: DeviceOpt = "cpu",
    graph_mode: GraphModeOpt = None,
    attention_backend: AttentionOpt = None,
    dtype: DtypeOpt = None,
    draft_width: DraftWidthOpt = 3,
    k: KOpt = None,
    acceptance: Annotated[
        str, typer.Option("--acceptance", help="greedy, sample, synthetic or forced.")
    ] = "greedy",
    profile: ProfileOpt = None,
    plain: Annotated[bool, typer.Option("--plain", help="Plain decoding (no draft head).")] = False,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Tokens to generate per prompt.")
    ] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="1 = off.")] = 1.0,
    min_p: Annotated[float, typer.Option("--min-p", help="0 = off.")] = 0.0,
    stop_ids: Annotated[
        str | None, typer.Option("--stop-ids", help="Extra stop token ids.", show_default=False)
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Keep generating past EOS.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Sampling / preset-weight seed.")] = 0,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            "--max-model-len", help="Context limit. Default: min(model, 4096).", show_default=False
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print results as JSON on stdout.")
    ] = False,
) -> None:
    """Generate tokens with the embedded speculative runner (token ids in and out)."""
    from speccal.live.generate import generate as run_generate
    from speccal.runner.engine import Engine
    from speccal.runner.sampling import SamplingParams

    if not prompt_ids and not prompt:
        raise InputError("--prompt-ids/--prompt", None, "at least one prompt")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        stop_token_ids=tuple(_parse_ids(stop_ids, "--stop-ids")) if stop_ids else (),
        ignore_eos=ignore_eos,
    )
    if k is not None and not (plain or 1 <= k <= draft_width):
        raise InputError("--k", k, f"an integer in [1, {draft_width}] (--draft-width)")
    cfg = _engine_config(
        model,
        device,
        dtype,
        draft_width,
        acceptance,
        profile,
        seed,
        max_model_len,
        not plain,
        graph_mode=graph_mode,
        attention_backend=attention_backend,
    )
    engine = Engine(cfg)
    tokenizer = None
    if engine.loaded.tokenizer_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(engine.loaded.tokenizer_path))
    prompts = [_parse_ids(p, "--prompt-ids") for p in (prompt_ids or [])]
    if prompt:
        if tokenizer is None:
            raise InputError(
                "--prompt", prompt[0], "token ids (--prompt-ids): the model has no tokenizer"
            )
        prompts += [tokenizer.encode(p) for p in prompt]
    num_k = 0 if plain else (k if k is not None else draft_width)
    if engine.is_random_weights:
        err_console.print(f"[yellow]RANDOM WEIGHTS[/]: {engine.description}", soft_wrap=True)
    with Progress(
        TextColumn("generate"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task("tokens", total=max_tokens * len(prompts))
        outs = run_generate(engine, prompts, params, num_k, on_step=lambda n: bar.advance(task, n))
    results = []
    for p, o in zip(prompts, outs, strict=True):
        item = {"prompt_ids": p, "output_ids": o}
        if tokenizer is not None:
            item["text"] = tokenizer.decode(o)
        results.append(item)
    stats = engine.stats.to_dict() if num_k > 0 else None
    doc = {
        "model": engine.description,
        "random_weights": engine.is_random_weights,
        "num_draft_steps": num_k,
        "outputs": results,
        "stats": stats,
        "compatibility": engine.compatibility(),
    }
    if as_json:
        typer.echo(json.dumps(_clean(doc), allow_nan=False))
        return
    for i, item in enumerate(results):
        err_console.print(f"[bold]request {i}[/] ids: {item['output_ids']}", soft_wrap=True)
        if "text" in item:
            err_console.print(f"  text: {item['text']!r}", soft_wrap=True)
    if stats:
        err_console.print(
            f"k={num_k}: acceptance rate {stats['acceptance_rate']:.3f}, mean accepted length "
            f"{stats['mean_accepted_length']:.3f}, accepted-length histogram {stats['accepted_length_hist']}"
        )


def _check_workload(num_requests: int, prompt_len: int, max_tokens: int) -> None:
    """The bench workload's sizes, each an integer >= 1."""
    for name, value in (
        ("--num-requests", num_requests),
        ("--prompt-len", prompt_len),
        ("--max-tokens", max_tokens),
    ):
        if value < 1:
            raise InputError(name, value, "an integer >= 1")


def _clean(obj):
    """``obj`` with every NaN float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def bench(
    model: ModelOpt = "tiny",
    device: DeviceOpt = "cpu",
    graph_mode: GraphModeOpt = None,
    attention_backend: AttentionOpt = None,
    dtype: DtypeOpt = None,
    draft_width: DraftWidthOpt = 3,
    k: KOpt = None,
    acceptance: Annotated[
        str, typer.Option("--acceptance", help="greedy, synthetic or forced.")
    ] = "greedy",
    profile: ProfileOpt = None,
    num_requests: Annotated[
        int, typer.Option("--num-requests", help="Requests decoded together.")
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
    seed: Annotated[int, typer.Option("--seed", help="Prompt / weight seed.")] = 0,
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
            help="Captured request buckets, e.g. 1,2,4,8 (default 1,2,4,8,16,32).",
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
    as_json: Annotated[
        bool, typer.Option("--json", help="Print results as JSON on stdout.")
    ] = False,
) -> None:
    """Speculative vs plain decoding in one process: tokens/s, TPOT, acceptance, speed-up.

    With --policy: the same workload live under each policy (one engine), with the replay
    prediction of every run from its own trace."""
    from speccal.live.generate import bench as run_bench

    if repeats is not None and repeats < 1:
        raise InputError("--repeats", repeats, "an integer >= 1")
    if policy:
        _bench_policies(
            policy,
            cost_table,
            phase,
            request_buckets,
            trace_out,
            model=model,
            device=device,
            graph_mode=graph_mode,
            attention_backend=attention_backend,
            dtype=dtype,
            draft_width=draft_width,
            acceptance=acceptance,
            profile=profile,
            num_requests=num_requests,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            seed=seed,
            repeats=1 if repeats is None else repeats,
            as_json=as_json,
        )
        return
    repeats = 3 if repeats is None else repeats
    for name, given in (
        ("--cost-table", cost_table),
        ("--phase", phase),
        ("--trace-out", trace_out),
        ("--request-buckets", request_buckets),
    ):
        if given:
            raise InputError(name, str(given), "only together with --policy")
    if acceptance == "sample":
        raise InputError(
            "--acceptance", acceptance, "greedy, synthetic or forced (bench uses greedy requests)"
        )
    _check_workload(num_requests, prompt_len, max_tokens)
    num_k = k if k is not None else draft_width
    if not 1 <= num_k <= draft_width:
        raise InputError("--k", num_k, f"an integer in [1, {draft_width}] (--draft-width)")
    cfg = _engine_config(
        model,
        device,
        dtype,
        draft_width,
        acceptance,
        profile,
        seed,
        None,
        True,
        graph_mode=graph_mode,
        attention_backend=attention_backend,
    )
    with Progress(
        TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console, transient=True
    ) as bar:
        task = bar.add_task("loading")
        res = run_bench(
            cfg,
            num_requests=num_requests,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            num_draft_steps=num_k,
            repeats=repeats,
            seed=seed,
            on_progress=lambda msg: bar.update(task, description=msg),
        )
    res = _clean(res)
    if as_json:
        typer.echo(json.dumps(res, allow_nan=False, sort_keys=True))
        return
    eng = res["engine"]["spec"]
    if eng["is_random_weights"]:
        err_console.print(f"[yellow]RANDOM WEIGHTS[/]: {eng['description']}", soft_wrap=True)
    else:
        err_console.print(eng["description"])
    table = Table(
        title=f"{model} on {eng['compatibility']['device']['name']}, k={num_k}, {num_requests} requests"
    )
    for col in ("mode", "tokens/s", "decode tok/s", "TPOT ms", "acceptance", "mean accepted"):
        table.add_column(col)
    for name in ("plain", "spec"):
        r = res[name]
        acc = r.get("acceptance_rate")
        mal = r.get("mean_accepted_length")
        table.add_row(
            name,
            f"{r['tokens_per_s']:.1f}",
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['tpot_ms']:.2f}",
            "-" if acc is None else f"{acc:.3f}",
            "-" if mal is None else f"{mal:.3f}",
        )
    err_console.print(table)
    err_console.print(
        f"speed-up {res['speedup']:.2f}x tokens/s, {res['tpot_speedup']:.2f}x TPOT; "
        f"outputs equal: {res['outputs_equal']}"
    )


def _parse_policies(values: list[str]) -> list[str]:
    from speccal.policy import check_adaptive_modes, parse_policy

    specs = [parse_policy(t).text for v in values for t in v.split(",") if t.strip()]
    if not specs:
        raise InputError(
            "--policy", values, "at least one of fixed:K, adaptive-step, adaptive-verify"
        )
    check_adaptive_modes(
        adaptive_draft_step="adaptive-step" in specs,
        adaptive_target_verify="adaptive-verify" in specs,
    )
    if len(set(specs)) != len(specs):
        raise InputError("--policy", ",".join(specs), "each policy at most once")
    return specs


def _parse_phases(values: list[str] | None, draft_width: int, acceptance: str) -> list:
    from speccal.live.policies import Phase

    if not values:
        return []
    if acceptance != "synthetic":
        raise InputError("--phase", values[0], "only with --acceptance synthetic")
    out = []
    for v in values:
        frac, _, prof = v.partition(":")
        try:
            f = float(frac)
        except ValueError:
            raise InputError("--phase", v, "FRACTION:p1,..,pw, e.g. 0.5:0.4,0.3,0.2") from None
        probs = _parse_floats(prof, "--phase") or ()
        if len(probs) != draft_width or not all(0.0 <= p <= 1.0 for p in probs):
            raise InputError("--phase", v, f"{draft_width} probabilities in [0, 1] after the ':'")
        out.append(Phase(f, probs))
    if min(p.start_fraction for p in out) != 0.0:
        out.append(Phase(0.0, ()))  # placeholder replaced below with the engine's profile
    return out


def _bench_policies(
    policy_values,
    cost_table,
    phase_values,
    request_buckets,
    trace_out,
    *,
    model,
    device,
    graph_mode,
    attention_backend,
    dtype,
    draft_width,
    acceptance,
    profile,
    num_requests,
    prompt_len,
    max_tokens,
    seed,
    repeats,
    as_json,
) -> None:
    from speccal.policy import CostModel

    specs = _parse_policies(policy_values)  # refusals come before anything is built
    if any(s.startswith("adaptive") for s in specs) and cost_table is None:
        raise InputError(
            "--cost-table", None, "a cost table path (adaptive policies price rounds with it)"
        )
    if cost_table is not None and not cost_table.is_file():
        raise InputError("--cost-table", str(cost_table), "an existing cost table file")
    if acceptance == "sample":
        raise InputError("--acceptance", acceptance, "greedy, synthetic or forced")
    _check_workload(num_requests, prompt_len, max_tokens)
    phases = _parse_phases(phase_values, draft_width, acceptance)
    buckets = DEFAULT_BUCKETS
    if request_buckets:
        try:
            buckets = tuple(int(b) for b in request_buckets.replace(",", " ").split())
        except ValueError:
            raise InputError(
                "--request-buckets", request_buckets, "integers, e.g. 1,2,4,8"
            ) from None
    from speccal.live.generate import bench_policies
    from speccal.runner.engine import Engine

    cfg = _engine_config(
        model,
        device,
        dtype,
        draft_width,
        acceptance,
        profile,
        seed,
        None,
        True,
        buckets,
        graph_mode=graph_mode,
        attention_backend=attention_backend,
    )
    if phases and any(not p.profile for p in phases):
        from speccal.live.policies import Phase

        phases = [Phase(0.0, cfg.acceptance_profile)] + [p for p in phases if p.profile]
    engine = Engine(cfg)
    table_warnings: list[str] = []
    if cost_table is not None:
        from speccal.costmodel.table import load_table

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            table = load_table(
                cost_table,
                expect=engine.compatibility(),
                runtime_versions=engine.runtime_versions(),
            )
        table_warnings = [str(w.message) for w in caught]
        from speccal.live.policies import live_cost_model

        cost = live_cost_model(table)
    else:
        import numpy as np

        def nan_cost(bcap, g, kv):
            return np.full(np.broadcast(bcap, g, kv).shape, np.nan)

        cost = CostModel(cost=nan_cost, geometry=engine.geometry, mode="draft_step")
    if cost.draft_width != draft_width:
        raise InputError("--cost-table", str(cost_table), f"a table of draft_width={draft_width}")
    with Progress(
        TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console, transient=True
    ) as bar:
        task = bar.add_task("running")
        res = bench_policies(
            engine,
            specs,
            cost,
            num_requests=num_requests,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            phases=phases,
            seed=seed,
            repeats=repeats,
            on_progress=lambda msg: bar.update(task, description=msg),
        )
    runs = res.pop("runs")
    written = {}
    if trace_out is not None:
        from speccal.trace import save_trace

        for tr in runs:
            # one file per run: '.<policy>' with several policies, '.r<cycle>' with repeats
            tag = tr.policy.replace(":", "") if len(specs) > 1 else ""
            if repeats > 1:
                tag = f"{tag}.r{tr.cycle + 1}" if tag else f"r{tr.cycle + 1}"
            key = tr.policy if repeats == 1 else f"{tr.policy}#{tr.cycle + 1}"
            path = trace_out
            if tag:
                path = trace_out.with_name(f"{trace_out.stem}.{tag}{trace_out.suffix}")
            written[key] = str(save_trace(tr.run.trace, path))
    doc = _clean(
        {
            **res,
            "cost_table": None if cost_table is None else str(cost_table),
            "table_mode": cost.mode,
            "table_warnings": table_warnings,
            "traces": written,
            "engine": {
                "description": engine.description,
                "is_random_weights": engine.is_random_weights,
                "compatibility": engine.compatibility(),
            },
            "setup": {
                **res["setup"],
                "model": model,
                "device": device,
                "dtype": engine.dtype_name,
                "draft_width": draft_width,
                "acceptance": acceptance,
                "request_buckets": list(buckets),
            },
        }
    )
    if as_json:
        typer.echo(json.dumps(doc, allow_nan=False, sort_keys=True))
        return
    if engine.is_random_weights:
        err_console.print(f"[yellow]RANDOM WEIGHTS[/]: {engine.description}", soft_wrap=True)
    for msg in table_warnings:
        err_console.print(f"[yellow]warning[/]: {msg}", soft_wrap=True)
    title = f"{model} live policies, {num_requests} requests x {max_tokens} tokens"
    if repeats > 1:
        title += f", median of {repeats} interleaved runs"
    table = Table(title=title)
    cols = ["policy", "tokens/s"] + (["min-max"] if repeats > 1 else [])
    for col in (
        *cols,
        "TPOT ms",
        "acceptance",
        "mean accepted",
        "mean k",
        "vs best fixed",
        "replay tok/s",
        *(["replay err % (median)"] if repeats > 1 else []),
    ):
        table.add_column(col)
    for s in doc["policies"]:
        gain = s.get("gain_vs_best_fixed_pct")
        pred = (s.get("replay") or {}).get("predicted_tokens_per_s")
        spread = s.get("spread", {}).get("round_tokens_per_s")
        extra = [f"{spread[0]:.1f}-{spread[1]:.1f}"] if repeats > 1 else []
        table.add_row(
            s["policy"],
            f"{s['round_tokens_per_s']:.1f}",
            *extra,
            f"{s['tpot_ms']:.2f}",
            _fmt(s["acceptance_rate"], ".3f"),
            _fmt(s["mean_accepted_length"], ".3f"),
            f"{s['mean_k']:.2f}",
            "-" if gain is None else f"{gain:+.1f}%",
            _fmt(pred, ".1f"),
            *([_fmt((s.get("replay") or {}).get("error_pct"), ".1f")] if repeats > 1 else []),
        )
    err_console.print(table)
    if repeats > 1:
        err_console.print(
            "run order (" + doc["order"]["scheme"] + "): " + " ".join(doc["order"]["sequence"]),
            soft_wrap=True,
        )
    for s in doc["policies"]:
        if s["policy"].startswith("adaptive"):
            err_console.print(
                escape(
                    f"{s['policy']} timeline [start, stop, k, g]: {s['timeline'][:12]}"
                    + (" ..." if len(s["timeline"]) > 12 else "")
                ),
                soft_wrap=True,
            )
    for name, path in written.items():
        err_console.print(f"trace of {name}: {path}")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("generate")(generate)
    app.command("bench")(bench)
