"""CLI commands ``speccal generate`` and ``speccal bench`` (the embedded runner).

``generate`` runs prompts (token ids, or text when the checkpoint folder has a tokenizer) through
the speculative engine and prints the generated ids (and text); ``bench`` compares speculative
and plain decoding of the same random prompts in one process (tokens/s, TPOT, acceptance rate,
mean accepted length, speed-up). Human output goes to stderr through Rich, ``--json`` to stdout.
Random-weight presets are labelled as such in both outputs.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from speccal.errors import InputError

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


def _engine_config(
    model, device, dtype, draft_width, acceptance, profile, seed, max_model_len, speculative
):
    from speccal.runner.engine import EngineConfig

    return EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        draft_width=draft_width,
        request_buckets=(1, 2, 4, 8, 16, 32),
        acceptance=acceptance,
        acceptance_profile=_parse_floats(profile, "--profile"),
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
    model: Annotated[
        str,
        typer.Option("--model", help="Preset (tiny, dense-0.5b, dense-2b, mimo-7b) or HF folder."),
    ] = "tiny",
    device: Annotated[str, typer.Option("--device", help="cpu, cuda[:N] or npu[:N].")] = "cpu",
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="float32, bfloat16 or float16. Default: float32 on CPU, else bfloat16.",
            show_default=False,
        ),
    ] = None,
    draft_width: Annotated[int, typer.Option("--draft-width", help="Draft width w.")] = 3,
    k: Annotated[
        int | None,
        typer.Option("--k", help="Draft steps per round (1..w). Default: w.", show_default=False),
    ] = None,
    acceptance: Annotated[
        str, typer.Option("--acceptance", help="greedy, sample, synthetic or forced.")
    ] = "greedy",
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile", help="Synthetic acceptance profile, w values.", show_default=False
        ),
    ] = None,
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
    from speccal.runner.engine import Engine
    from speccal.runner.generate import generate as run_generate
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
        model, device, dtype, draft_width, acceptance, profile, seed, max_model_len, not plain
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
        typer.echo(json.dumps(doc, allow_nan=False, default=_nan_none))
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


def _nan_none(x):
    return None


def _clean(obj):
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def bench(
    model: Annotated[
        str,
        typer.Option("--model", help="Preset (tiny, dense-0.5b, dense-2b, mimo-7b) or HF folder."),
    ] = "tiny",
    device: Annotated[str, typer.Option("--device", help="cpu, cuda[:N] or npu[:N].")] = "cpu",
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="Default: float32 on CPU, else bfloat16.", show_default=False),
    ] = None,
    draft_width: Annotated[int, typer.Option("--draft-width", help="Draft width w.")] = 3,
    k: Annotated[
        int | None,
        typer.Option("--k", help="Draft steps per round. Default: w.", show_default=False),
    ] = None,
    acceptance: Annotated[
        str, typer.Option("--acceptance", help="greedy, synthetic or forced.")
    ] = "greedy",
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile", help="Synthetic acceptance profile, w values.", show_default=False
        ),
    ] = None,
    num_requests: Annotated[
        int, typer.Option("--num-requests", help="Requests decoded together.")
    ] = 4,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Random prompt length.")] = 32,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Tokens generated per request.")
    ] = 64,
    repeats: Annotated[
        int, typer.Option("--repeats", help="Timed runs per side (median reported).")
    ] = 3,
    seed: Annotated[int, typer.Option("--seed", help="Prompt / weight seed.")] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print results as JSON on stdout.")
    ] = False,
) -> None:
    """Speculative vs plain decoding in one process: tokens/s, TPOT, acceptance, speed-up."""
    from speccal.runner.generate import bench as run_bench

    if acceptance == "sample":
        raise InputError(
            "--acceptance", acceptance, "greedy, synthetic or forced (bench uses greedy requests)"
        )
    for name, value in (
        ("--num-requests", num_requests),
        ("--prompt-len", prompt_len),
        ("--max-tokens", max_tokens),
        ("--repeats", repeats),
    ):
        if value < 1:
            raise InputError(name, value, "an integer >= 1")
    num_k = k if k is not None else draft_width
    if not 1 <= num_k <= draft_width:
        raise InputError("--k", num_k, f"an integer in [1, {draft_width}] (--draft-width)")
    cfg = _engine_config(model, device, dtype, draft_width, acceptance, profile, seed, None, True)
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


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("generate")(generate)
    app.command("bench")(bench)
