"""Library entry point of ``speccal generate``: :func:`generate` runs requests to completion.

The benches (``speccal bench``) are ``speccal.live.bench``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from speccal.runner.distributed.dp import DataParallelRunner
from speccal.runner.engine import Engine, RoundPlan
from speccal.runner.sampling import SamplingParams


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
