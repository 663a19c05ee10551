"""Library entry point of ``speccal generate``: :func:`generate` runs requests to completion;
:func:`run_generate` runs a :class:`GenerateJob` (build the engine, tokenize, decode) on one rank
or every rank of a ``torchrun`` run and returns the command's document.

The benches (``speccal bench``) are ``speccal.live.bench``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from speccal.base.errors import InputError
from speccal.base.progress import ProgressReporter
from speccal.runner.distributed.dp import DataParallelRunner
from speccal.runner.distributed.engine import DistributedEngine
from speccal.runner.engine import Engine, EngineConfig, RoundPlan
from speccal.runner.sampling import SamplingParams


@dataclass(frozen=True)
class GenerateJob:
    """What ``speccal generate`` runs.

    Attributes
    ----------
    engine : the engine to build on each rank.
    prompt_ids : prompts as token ids.
    prompts : prompts as text, encoded with the checkpoint's tokenizer (after ``prompt_ids``).
    params : the sampling of every request.
    num_draft_steps : draft steps per round (0: plain decoding).
    """

    engine: EngineConfig
    prompt_ids: tuple[tuple[int, ...], ...]
    prompts: tuple[str, ...]
    params: SamplingParams
    num_draft_steps: int


def run_generate(
    job: GenerateJob,
    console: Console,
    comm: Any | None = None,
    load_tokenizer: Callable[[Path], Any] | None = None,
) -> dict[str, Any]:
    """Build this rank's engine, tokenize, decode; every rank of a ``torchrun`` run calls it.

    ``console``: where the random-weights notice and (one rank) the progress bar go;
    ``comm``: this rank's communicator (None: one process); ``load_tokenizer(path)``: the
    checkpoint's tokenizer (``transformers.AutoTokenizer``, which the caller imports).

    Returns ``model``, ``random_weights``, ``num_draft_steps``, ``outputs`` (per prompt:
    ``prompt_ids``, ``output_ids`` and ``text`` with a tokenizer), ``stats`` (None when plain;
    may hold NaN) and ``compatibility``.
    """
    engine = Engine(job.engine) if comm is None else DistributedEngine(job.engine, comm)
    tokenizer = None
    if engine.loaded.tokenizer_path is not None and load_tokenizer is not None:
        tokenizer = load_tokenizer(engine.loaded.tokenizer_path)
    prompts = [list(p) for p in job.prompt_ids]
    if job.prompts:
        if tokenizer is None:
            raise InputError(
                "--prompt", job.prompts[0], "token ids (--prompt-ids): the model has no tokenizer"
            )
        prompts += [tokenizer.encode(p) for p in job.prompts]
    if engine.is_random_weights:
        console.print(f"[yellow]RANDOM WEIGHTS[/]: {escape(engine.description)}", soft_wrap=True)
    num_k = job.num_draft_steps
    if comm is not None:
        outs = generate_on_ranks(engine, prompts, job.params, num_k, comm)
    else:
        with ProgressReporter("generate", console=console, unit="tokens", transient=True,
                              total=job.params.max_tokens * len(prompts)) as bar:
            outs = generate(engine, prompts, job.params, num_k,
                            on_step=lambda n: bar.update(advance=n))
    results = []
    for p, o in zip(prompts, outs, strict=True):
        item: dict[str, Any] = {"prompt_ids": p, "output_ids": o}
        if tokenizer is not None:
            item["text"] = tokenizer.decode(o)
        results.append(item)
    return {
        "model": engine.description,
        "random_weights": engine.is_random_weights,
        "num_draft_steps": num_k,
        "outputs": results,
        "stats": engine.stats.to_dict() if num_k > 0 else None,
        # every rank: gathers the ranks' device names (cached)
        "compatibility": engine.compatibility(),
    }


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    num_draft_steps: int,
    on_step: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Run ``prompts`` to completion; returns each request's generated token ids.

    ``on_step(num_new_tokens)`` is called after every round (progress bars).
    """
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
    plan = RoundPlan(num_draft_steps)
    while engine.has_unfinished():
        res = engine.step(plan)
        if on_step is not None:
            on_step(sum(len(e) for e in res.emitted))
    out = [list(engine.requests[r].output) for r in rids]
    for r in rids:
        engine.release(r)
    return out


def generate_on_ranks(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    num_draft_steps: int,
    comm,
) -> list[list[int]]:
    """:func:`generate` on every rank of a ``comm.topology`` run (``torchrun``; ``engine`` is
    this rank's ``speccal.runner.distributed.engine.DistributedEngine``).

    DP replica ``d`` decodes prompts ``d, d + D, d + 2 D, ...`` (the TP ranks of a replica decode
    them together); with ``D > 1`` the replicas run in step (``DataParallelRunner``: one agreed
    round shape per step, so ``num_draft_steps`` is the agreed one, not this argument). Every
    rank returns every prompt's tokens, in the order given (one host-side gather).
    """
    mine = list(prompts)[comm.dp_rank :: comm.dp_size]
    if comm.dp_size > 1:
        outs = DataParallelRunner(engine, comm).generate(mine, params)
    else:
        outs = generate(engine, mine, params, num_draft_steps)
    seen = comm.all_gather_object(outs)  # world-rank order; TP ranks of a replica agree
    result: list[list[int]] = [[] for _ in prompts]
    for d in range(comm.dp_size):
        for j, tokens in enumerate(seen[d * comm.tp_size]):
            result[d + j * comm.dp_size] = tokens
    return result
