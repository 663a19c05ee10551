"""CLI command ``speccal generate``: prompts through the embedded speculative runner.

Prompts are token ids, or text when the checkpoint folder has a tokenizer; the command prints
the generated ids (and text). It parses its options into a ``speccal.live.generate.GenerateJob``
(the engine through ``speccal.cli.options.engine_config``) and calls
``speccal.live.generate.run_generate``. Under ``torchrun`` it takes ``--tp``/``--dp``
(``speccal.cli.dist.run_ranks``): every rank runs the job, rank 0 alone prints, and an error on
another rank surfaces on rank 0 naming the rank. Human output goes to stderr through Rich,
``--json`` to stdout; random-weight presets are labelled as such in both. ``speccal.live`` and
``speccal.runner`` are imported inside the command: they import torch, and the CLI must start
(and report a missing torch) without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from speccal.base.atomic import nan_to_none
from speccal.base.errors import InputError
from speccal.cli import options as o
from speccal.cli import parse
from speccal.cli.dist import is_distributed, run_ranks
from speccal.cli.options import check_replica_k, engine_config
from speccal.cli.render_run import err_console, print_generate


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
            help="greedy (lossless), sample (rejection sampling), synthetic (accepted lengths "
            "drawn from --acceptance-profile) or forced (every draft accepted).",
        ),
    ] = "greedy",
    profile: o.Profile = None,
    score_informativeness: o.ScoreInformativeness = 0.0,
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
    as_json: o.Json = False,
) -> None:
    """Generate tokens with the embedded speculative runner (token ids in and out)."""
    # lazy: these import torch; the CLI starts (and reports a missing torch) without it
    from speccal.live.generate import GenerateJob, run_generate
    from speccal.runner.sampling import SamplingParams

    if not prompt_ids and not prompt:
        raise InputError("--prompt-ids/--prompt", None, "at least one prompt")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        stop_token_ids=tuple(parse.ids(stop_ids, "--stop-ids")) if stop_ids else (),
        ignore_eos=ignore_eos,
    )
    if k is not None and not (plain or 1 <= k <= draft_width):
        raise InputError("--k", k, f"an integer in [1, {draft_width}] (--draft-width)")
    cfg = engine_config(
        model, device, dtype, draft_width, acceptance, profile, seed, max_model_len, not plain,
        graph_mode=graph_mode, attention_backend=attention_backend, loop=loop,
        state_strategy=state_strategy, score_informativeness=score_informativeness,
    )
    distributed = is_distributed(tp, dp)
    if distributed:
        check_replica_k(k, dp)
    job = GenerateJob(
        engine=cfg,
        prompt_ids=tuple(tuple(parse.ids(p, "--prompt-ids")) for p in prompt_ids or ()),
        prompts=tuple(prompt or ()),
        params=params,
        num_draft_steps=0 if plain else (k if k is not None else draft_width),
    )
    if distributed:
        doc = run_ranks(tp, dp, device,
                        lambda comm, console: run_generate(job, console, comm, _tokenizer),
                        err_console, command="generate")
        if doc is None:  # not rank 0: rank 0 prints
            return
    else:
        doc = run_generate(job, err_console, load_tokenizer=_tokenizer)
    if as_json:
        typer.echo(json.dumps(nan_to_none(doc), allow_nan=False))
        return
    print_generate(doc)


def _tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer (``transformers``, imported only for a checkpoint that has one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def register(app: typer.Typer) -> None:
    """Attach ``speccal generate`` to the root app."""
    app.command("generate")(generate)
